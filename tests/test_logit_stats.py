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
from fastqwen.synth import plain_init, synthesize

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results" / "synth_stats"


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


def test_tiny_has_a_realistic_logit_scale(tiny_model: pathlib.Path):
    r = logit_stats.measure(tiny_model, positions=1024, seed=0)
    assert r["positions"] == 1024 and r["sequences"] == 1 and r["preset"] == "tiny"
    assert r["all_logits_finite"]
    assert r["realism_problems"] == [], r["realism_problems"]
    # The same bounds, spelled out: top-1 far above the median, gaps neither collapsed nor huge.
    assert r["stats"]["max_minus_median"]["p50"] > 10
    gap = r["stats"]["top1_top2_gap"]
    assert gap["p10"] < 0.5 < gap["p50"] < 2.5 and gap["p90"] > 1.5


def test_a_plain_init_fails_the_realism_check(tmp_path: pathlib.Path):
    folder = synthesize("tiny", tmp_path / "plain", progress=False, init=plain_init(get_preset("tiny")))
    r = logit_stats.measure(folder, positions=512)
    assert r["stats"]["max_minus_median"]["p50"] < 3  # all logits within a few of each other
    assert any("too flat" in p for p in r["realism_problems"])
    assert any("collapsed" in p for p in r["realism_problems"])


def test_measure_splits_positions_into_sequences(tiny_model: pathlib.Path):
    r = logit_stats.measure(tiny_model, positions=1500, seed=1)
    assert (r["positions"], r["sequences"], r["sequence_length"]) == (1500, 2, 1024)


@pytest.mark.parametrize("kwargs, needle", [({"positions": 1}, "positions"), ({"device": "gpu0"}, "gpu0")])
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
    args = parser.parse_args(["--model", str(tiny_model), "--positions", "256", "--out", str(out), "--note", "short run"])
    assert logit_stats.run(args) == 0
    printed = capsys.readouterr().out
    assert "top1_top2_gap" in printed and "realistic logit scale" in printed
    data = json.loads(out.read_text())
    assert data["note"] == "short run" and data["positions"] == 256
    assert set(data["stats"]) == set(logit_stats.STAT_NAMES)


@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b", "qwen3-4b"])
def test_committed_results_show_a_realistic_scale(name: str):
    data = json.loads((RESULTS / f"{name}.json").read_text())
    assert data["preset"] == name
    assert data["config"]["hidden_size"] == get_preset(name)["hidden_size"]
    assert data["positions"] >= 1024
    assert logit_stats.realism_problems(data) == []
