"""Logit-scale statistics: the helpers, the measurement on tiny, and that a plain init fails the check."""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import pytest
import torch

from fastqwen import logit_stats
from fastqwen.errors import UserError
from fastqwen.presets import get_preset
from fastqwen.synth import init_scheme, plain_init, sharp_attention_init, synthesize


def test_position_statistics_on_known_logits():
    logits = torch.tensor([[0.0, 1.0, 5.0, 3.0, 2.0], [4.0, 4.0, -1.0, 0.0, 1.0]], dtype=torch.bfloat16)
    s = logit_stats.position_statistics(logits)
    assert s["top1_logit"].tolist() == [5.0, 4.0]
    assert s["top1_top2_gap"].tolist() == [2.0, 0.0]  # a tie is a gap of 0
    assert s["max_minus_median"].tolist() == [3.0, 3.0]  # medians 2 and 1


def test_summarize_percentiles():
    s = logit_stats.summarize(list(range(1, 101)))
    assert s == pytest.approx({"mean": 50.5, "p10": 10.9, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    with pytest.raises(ValueError):
        logit_stats.summarize([])


def test_text_like_ids_are_deterministic_zipfian_and_repetitive():
    seqs = logit_stats.text_like_ids(4096, [500, 300], seed=3)
    assert [len(s) for s in seqs] == [500, 300]
    assert seqs == logit_stats.text_like_ids(4096, [500, 300], seed=3)
    assert seqs != logit_stats.text_like_ids(4096, [500, 300], seed=4)
    flat = np.array(seqs[0] + seqs[1])
    assert flat.min() >= 0 and flat.max() < 4096
    counts = np.bincount(flat, minlength=4096)
    assert counts.max() > 0.03 * flat.size  # a few very common tokens, as in text
    assert (counts > 0).sum() > 100  # and a long tail
    grams = [tuple(seqs[0][i:i + 4]) for i in range(len(seqs[0]) - 3)]
    assert len(set(grams)) < len(grams)  # phrases recur


def test_compare_cached_full_on_known_logits():
    full = torch.tensor([[0.0, 5.0, 4.5, 1.0], [2.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    cached = torch.tensor([[0.0, 4.0, 4.6, 1.0], [2.0, 0.5, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    c = logit_stats.compare_cached_full(cached, full)
    assert c["max_abs_diff"].tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert c["argmax_differs"].tolist() == [True, False, False]  # the tie in row 3 goes to index 0 in both
    assert c["slack"].tolist() == pytest.approx([0.5, 0.0, 0.0])  # full puts cached's pick (2) 0.5 below its top
    with pytest.raises(ValueError, match="one shape"):
        logit_stats.compare_cached_full(cached[:2], full)


def test_cached_path_is_aligned_with_the_full_forward(tiny_model: pathlib.Path):
    """In FP32 the two paths agree to rounding: the cached rows are the right positions."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = logit_stats.text_like_ids(4096, [40], seed=5)[0]
    with torch.inference_mode():
        cached, full = logit_stats.cached_and_full_logits(model, ids, prompt_length=30)
    assert cached.shape == full.shape == (11, 4096)
    assert (cached - full).abs().max() < 1e-3
    # One position off would be far apart: consecutive positions' logits differ by whole logits.
    assert (cached[1:] - full[:-1]).abs().amax(dim=-1).min() > 1.0


def test_tiny_has_a_realistic_logit_scale_and_is_stable(tiny_model: pathlib.Path):
    r = logit_stats.measure(tiny_model, positions=1024, seed=0, stability_positions=128)
    assert r["positions"] == 1024 and r["sequences"] == 1 and r["preset"] == "tiny"
    assert r["all_logits_finite"]
    assert r["realism_problems"] == [], r["realism_problems"]
    # The same bounds, spelled out: top-1 far above the median, gaps neither collapsed nor huge,
    # positions with tokens of their own.
    assert r["stats"]["max_minus_median"]["p50"] > 10
    gap = r["stats"]["top1_top2_gap"]
    assert gap["p10"] < 0.5 < gap["p50"] < 2.5 and gap["p90"] > 1.5
    assert r["distinct_top1_fraction"] > 0.15 and r["most_common_top1_fraction"] < 0.15
    # Cached decode vs one full forward: a fraction of a logit, as on a trained model.
    s = r["cached_vs_full"]
    assert s["positions"] == 128 and s["sequences"] == 2
    assert r["stability_problems"] == [], r["stability_problems"]
    assert s["max_abs_diff"]["max"] <= 1.5 and s["max_abs_diff"]["mean"] <= 0.5 and s["max_slack"] <= 0.75


def test_deep_models_chaotic_with_sharp_attention_stable_with_ours(tmp_path: pathlib.Path):
    """Chaos grows with depth, so the check runs on tiny's width at 24 layers (seconds on a CPU).

    Sharp attention everywhere (`sharp_attention_init`) fails the stability check
    there; the default scheme passes it, with realistic logits.
    """
    cfg = get_preset("tiny") | {"num_hidden_layers": 24, "max_window_layers": 24}
    sharp = synthesize("tiny", tmp_path / "sharp", progress=False, config=cfg, init=sharp_attention_init(cfg))
    ours = synthesize("tiny", tmp_path / "ours", progress=False, config=cfg, init=init_scheme(cfg))
    r_sharp = logit_stats.measure(sharp, positions=256, stability_positions=128)
    r_ours = logit_stats.measure(ours, positions=256, stability_positions=128)
    assert r_sharp["stability_problems"], r_sharp["cached_vs_full"]
    assert r_sharp["cached_vs_full"]["max_abs_diff"]["max"] > 3.0
    assert r_ours["stability_problems"] == [], r_ours["cached_vs_full"]
    assert r_ours["cached_vs_full"]["max_abs_diff"]["max"] < r_sharp["cached_vs_full"]["max_abs_diff"]["max"] / 4


def test_a_plain_init_fails_the_realism_check(tmp_path: pathlib.Path):
    folder = synthesize("tiny", tmp_path / "plain", progress=False, init=plain_init(get_preset("tiny")))
    r = logit_stats.measure(folder, positions=512, stability_positions=0)
    assert r["stats"]["max_minus_median"]["p50"] < 3  # all logits within a few of each other
    assert any("too flat" in p for p in r["realism_problems"])
    assert any("collapsed" in p for p in r["realism_problems"])


def test_measure_splits_positions_into_sequences(tiny_model: pathlib.Path):
    r = logit_stats.measure(tiny_model, positions=1500, seed=1, stability_positions=70)
    assert (r["positions"], r["sequences"], r["sequence_length"]) == (1500, 2, 1024)
    s = r["cached_vs_full"]
    assert (s["positions"], s["sequences"], s["prompt_length"]) == (70, 2, logit_stats.STABILITY_PROMPT_LENGTH)
    assert logit_stats.measure(tiny_model, positions=64, stability_positions=0)["cached_vs_full"] is None


def test_stability_problems_name_each_bound():
    ok = {"max_abs_diff": {"max": 0.5, "p99": 0.4, "mean": 0.1}, "argmax_differs": 1, "max_slack": 0.1, "positions": 9}
    assert logit_stats.stability_problems({"cached_vs_full": ok}) == []
    assert logit_stats.stability_problems({"cached_vs_full": None}) == []
    bad = ok | {"max_abs_diff": {"max": 20.0, "p99": 19.0, "mean": 12.0}, "max_slack": 8.0}
    problems = logit_stats.stability_problems({"cached_vs_full": bad})
    assert len(problems) == 3 and "20.000" in problems[0] and "12.000" in problems[1] and "8.000" in problems[2]


@pytest.mark.parametrize(
    "kwargs, needle",
    [({"positions": 1}, "positions"), ({"device": "gpu0"}, "gpu0"), ({"stability_positions": -1}, "stability")],
)
def test_measure_bad_input(tiny_model: pathlib.Path, kwargs: dict, needle: str):
    with pytest.raises(UserError, match=needle):
        logit_stats.measure(tiny_model, **kwargs)


def test_measure_checks_the_folder(tmp_path: pathlib.Path):
    with pytest.raises(UserError, match="does not exist"):
        logit_stats.measure(tmp_path / "none")


def test_cli_writes_json_and_prints_a_table(tiny_model: pathlib.Path, tmp_path: pathlib.Path, capsys):
    parser = argparse.ArgumentParser()
    logit_stats.add_arguments(parser)
    out = tmp_path / "sub" / "stats.json"
    args = parser.parse_args(
        ["--model", str(tiny_model), "--positions", "256", "--stability-positions", "64", "--out", str(out),
         "--note", "short run"]
    )
    assert logit_stats.run(args) == 0
    printed = capsys.readouterr().out
    assert "top1_top2_gap" in printed and "realistic logit scale" in printed
    assert "cached_vs_full over 64 positions" in printed and "numerically stable" in printed
    data = json.loads(out.read_text())
    assert data["note"] == "short run" and data["positions"] == 256
    assert set(data["stats"]) == set(logit_stats.STAT_NAMES)
    assert data["cached_vs_full"]["positions"] == 64


def test_synth_stats_runs_on_a_qwen35_checkpoint_in_its_reference_environment(tmp_path: pathlib.Path, synth_stats):
    """A Qwen3.5 checkpoint is measured with Transformers 5.17 (run() starts the same command in
    fastqwen/refenv.py's environment): the report is written, and the reference's cached decode
    agrees with its full forward on the preset."""
    from fastqwen import synth35

    ckpt = synth35.synthesize("qwen3.5-tiny", tmp_path / "q35", seed=3, progress=False)
    run, report = synth_stats(ckpt, tmp_path / "stats.json", 96, 24)
    assert report["positions"] == 96 and report["config"]["vocab_size"] == 1024
    assert report["transformers_version"] == "5.17.0"
    assert report["cached_vs_full"]["argmax_differs"] == 0 and report["stability_problems"] == []
    assert "numerically stable: yes" in run.stdout
