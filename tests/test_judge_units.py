"""The judge's pure parts: roofline arithmetic, gates and score, replay figures and fidelity, sample
order, the report's rendering, workload files, prompts, input checks.

No engine process is launched here; everything runs in milliseconds except the tokenizer-trained
prompt test and the cached-checkpoint test (a second or two each).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import pytest

from fastqwen.errors import UserError
from fastqwen.judge import gates, roofline
from fastqwen.judge.child import _check_step
from fastqwen.judge.prompts import PromptSource, synthetic_stream
from fastqwen.judge.workloads import load_workloads, parse_workloads

# Qwen3-4B-Instruct-2507's config.json values (the platform's model).
QWEN3_4B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": True, "attention_bias": False, "max_position_embeddings": 262144,
}


# ------------------------------------------------------------------------------------------------
# roofline
# ------------------------------------------------------------------------------------------------
def test_qwen3_4b_parameter_and_cache_bytes():
    s = roofline.ModelShape.from_config(QWEN3_4B)
    # Per layer: q 2560x4096 + k,v 2 x 2560x1024 + o 4096x2560 + MLP 3 x 2560x9728 + norms 2x2560 + 2x128
    # = 10,485,760 + 5,242,880 + 10,485,760 + 74,711,040 + 5,376 = 100,930,816; x 36 = 3,633,509,376;
    # + tied embedding 151,936 x 2560 = 388,956,160, counted once; + final norm 2,560.
    assert roofline.layer_params(s) == 100_930_816
    assert roofline.parameter_count(s) == 4_022_468_096
    assert roofline.weight_bytes(s) == 8_044_936_192
    assert roofline.kv_bytes_per_token(s) == 147_456  # 2 x 36 x 8 x 128 x 2
    assert roofline.non_embedding_params(s) == 4_022_468_096 - 388_956_160


def test_sliding_window_bounds_the_attention_floors():
    """A windowed config reads at most `window` cached positions a step and attends a band in prefill."""
    full = roofline.ModelShape.from_config(QWEN3_4B)
    win = roofline.ModelShape.from_config({**QWEN3_4B, "sliding_window": 1024})
    assert win.window == 1024 and full.window is None
    assert roofline.decode_step_bytes(win, 2, 500) == roofline.decode_step_bytes(full, 2, 500)
    assert roofline.decode_step_bytes(win, 2, 5000) == roofline.decode_step_bytes(full, 2, 1024)
    per_pair = 2 * 2 * 36 * 32 * 128
    band = 1024 * 1024 / 2 + (4096 - 1024) * 1024
    assert roofline.prefill_flops(full, 1, 4096) - roofline.prefill_flops(win, 1, 4096) == \
        per_pair * (4096 * 4096 / 2 - band)


def test_untied_head_is_counted_twice_and_biases_add():
    tied = roofline.ModelShape.from_config(QWEN3_4B)
    untied = roofline.ModelShape.from_config({**QWEN3_4B, "tie_word_embeddings": False})
    biased = roofline.ModelShape.from_config({**QWEN3_4B, "attention_bias": True})
    assert roofline.parameter_count(untied) - roofline.parameter_count(tied) == 151_936 * 2560
    # q, k, v biases (4096 + 1024 + 1024) and the o bias (2560), every layer.
    assert roofline.parameter_count(biased) - roofline.parameter_count(tied) == 36 * (4096 + 2048 + 2560)


def test_qwen3_4b_prefill_flops():
    s = roofline.ModelShape.from_config(QWEN3_4B)
    dense = 2 * 3_633_511_936 * 512  # 2 x non-embedding params x batch x prompt
    attention = 2 * 2 * 36 * 32 * 128 * 512 * 512 / 2  # QK^T and PV, causal half
    lm_head = 2 * 151_936 * 2560  # last token only
    assert roofline.prefill_flops(s, 1, 512) == dense + attention + lm_head == 3_798_803_546_112
    assert roofline.prefill_flops(s, 4, 512) == 4 * roofline.prefill_flops(s, 1, 512)


def test_floors_match_the_anchors_decode_figures():
    """An H200 at 4.27 TB/s and 783 TFLOP/s: batch-1 decode floor 1.90 ms at (1, 512, 128), 518 tok/s."""
    s = roofline.ModelShape.from_config(QWEN3_4B)
    c = roofline.Ceilings(bandwidth_bytes_s=4.27e12, matmul_flops_s=783e12, matmul_size=8192, copy_bytes=0,
                          device="cuda")
    f = roofline.floors(s, c, 1, 512, 128)
    # Prefill is compute-bound here: 3.7988e12 FLOPs / 783e12 = 4.85 ms > 8.04 GB / 4.27 TB/s = 1.88 ms.
    assert f.ttft_s == pytest.approx(3_798_803_546_112 / 783e12)
    # Mean decode step: contexts 513..639, mean 576: (8,044,936,192 + 576 x 147,456) / 4.27e12.
    assert f.tpot_s == pytest.approx((8_044_936_192 + 576 * 147_456) / 4.27e12)
    assert f.tpot_s * 1e3 == pytest.approx(1.90, abs=0.01)
    assert f.throughput == pytest.approx(518, rel=0.01)
    assert f.total_s == pytest.approx(f.ttft_s + 127 * f.tpot_s)
    # Memory-bound prefill: a one-token prompt costs one read of the weights.
    assert roofline.floors(s, c, 1, 1, 2).ttft_s == pytest.approx(8_044_936_192 / 4.27e12)
    assert roofline.floors(s, c, 1, 512, 1).tpot_s is None


def test_distance_fractions():
    f = roofline.Floors(ttft_s=0.01, tpot_s=0.002, total_s=0.1, throughput=1000.0, median_step_bytes=8e9)
    d = roofline.distance(f, ttft_s=0.02, tpot_s=0.008, total_s=0.4)
    assert d["ttft_fraction"] == pytest.approx(0.5)
    assert d["tpot_fraction"] == pytest.approx(0.25)
    assert d["throughput_fraction"] == pytest.approx(0.25)
    assert d["decode_gb_s"] == pytest.approx(8e9 / 0.008 / 1e9)


# ------------------------------------------------------------------------------------------------
# gates and score
# ------------------------------------------------------------------------------------------------
def test_sample_figures_from_arrivals():
    fig = gates.sample_figures(10.0, [10.1, 10.15, 10.2, 10.25], batch=2)
    assert fig.ttft_s == pytest.approx(0.1)
    assert fig.total_s == pytest.approx(0.25)
    assert fig.tpot_s == pytest.approx(0.05)
    assert fig.throughput == pytest.approx(2 * 4 / 0.25)
    single = gates.sample_figures(0.0, [0.3], batch=1)
    assert single.tpot_s is None and single.total_s == pytest.approx(0.3)


def test_spread_and_medians():
    assert gates.spread([1.0, 1.2, 0.9]) == pytest.approx(0.3)
    assert gates.spread([5.0]) == 0.0
    figs = [gates.SampleFigures(t, t / 10, t * 10, 1 / t) for t in (0.3, 0.1, 0.2)]
    summary = gates.summarize(figs)
    assert summary.ttft_s == pytest.approx(0.2) and summary.total_s == pytest.approx(2.0)
    assert summary.spread == pytest.approx((3.0 - 1.0) / 2.0)


def _summary(ttft=0.1, tpot=0.01, spread=0.0, samples=5):
    return gates.SideSummary(samples=samples, ttft_s=ttft, tpot_s=tpot, total_s=1.0, throughput=100.0, spread=spread)


def test_latency_gate_boundary_and_mode():
    native = _summary()
    assert gates.check_gates(official=True, engine=_summary(ttft=0.11, tpot=0.011), native=native) == []
    slow_ttft = gates.check_gates(official=True, engine=_summary(ttft=0.1111), native=native)
    assert [c["code"] for c in slow_ttft] == ["latency_limit"] and "TTFT" in slow_ttft[0]["detail"]
    slow_tpot = gates.check_gates(official=True, engine=_summary(tpot=0.0112), native=native)
    assert "TPOT" in slow_tpot[0]["detail"] and "TTFT" not in slow_tpot[0]["detail"]
    # Public runs and runs without native never apply it.
    assert gates.check_gates(official=False, engine=_summary(ttft=1.0), native=native) == []
    assert gates.check_gates(official=True, engine=_summary(ttft=1.0), native=None) == []


def test_spread_gate_official_only():
    unstable = _summary(spread=0.26)
    assert [c["code"] for c in gates.check_gates(official=True, engine=unstable, native=None)] == ["unstable_timing"]
    assert gates.check_gates(official=True, engine=_summary(spread=0.25), native=None) == []
    assert gates.check_gates(official=False, engine=unstable, native=None) == []


def test_memory_pending_violation_and_failure_codes():
    e = _summary()
    mem = gates.check_gates(official=False, engine=e, native=None, memory_peak_bytes=2**30, memory_limit_bytes=2**30)
    assert [c["code"] for c in mem] == ["memory_limit"]
    assert gates.check_gates(official=False, engine=e, native=None, memory_peak_bytes=2**30 - 1,
                             memory_limit_bytes=2**30) == []
    assert gates.check_gates(official=False, engine=e, native=None, memory_peak_bytes=10**12) == []  # no limit
    pending = gates.check_gates(official=False, engine=e, native=None, pending_ms=[3.0, 51.0])
    assert [c["code"] for c in pending] == ["candidate_error"] and "51.0 ms" in pending[0]["detail"]
    assert gates.check_gates(official=False, engine=e, native=None, pending_ms=[49.9]) == []
    violation = {"sample": 1, "sequence": 3, "step": 4, "slack": 2.5, "emitted": 7, "argmax": 9}
    bad = gates.check_gates(official=False, engine=e, native=None, violations=[violation])
    assert [c["code"] for c in bad] == ["incorrect_output"]
    assert "sample 1, sequence 3, step 4" in bad[0]["detail"] and "2.500" in bad[0]["detail"]
    failed = gates.check_gates(official=True, engine=_summary(samples=0), native=_summary(),
                               failure={"code": "timeout", "detail": "x"})
    assert [c["code"] for c in failed] == ["timeout"]


def test_score_is_a_geometric_mean_and_needs_every_workload():
    s = gates.score([100.0, 400.0], [50.0, 50.0], all_passed=True)
    assert s["engine"] == pytest.approx(200.0) and s["native"] == pytest.approx(50.0)
    assert s["ratio"] == pytest.approx(4.0) and s["valid"]
    failed = gates.score([100.0, 400.0], [50.0, 50.0], all_passed=False)
    assert not failed["valid"] and failed["engine"] == pytest.approx(200.0)
    missing = gates.score([100.0, None], None, all_passed=False)
    assert missing["engine"] is None and missing["ratio"] is None and not missing["valid"]
    assert gates.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isclose(gates.geomean([3.0]), 3.0)


# ------------------------------------------------------------------------------------------------
# replay figures, fidelity comparison, sample order
# ------------------------------------------------------------------------------------------------
def _logits_and_emitted():
    """Two sequences of three steps over a 5-token vocabulary, every case the figures distinguish.

    The values are exact in bf16, so each slack is known to the bit.
    """
    import torch

    logits = torch.tensor([
        [[0.0, 4.0, 1.0, 0.0, 0.0],    # emitted 1: the argmax, slack 0, agrees
         [3.0, 0.0, 0.0, 3.0, 0.0],    # emitted 3: ties the max at a higher index, slack 0, disagrees
         [0.0, 0.0, 2.0, 0.0, 1.0]],   # emitted 4: slack 1.0 (> 0.75), disagrees
        [[0.0, 0.0, 0.0, 1.0, 0.25],   # emitted 3: the argmax
         [1.0, 0.25, 0.0, 0.0, 0.0],   # emitted 1: slack 0.75, not over 0.75
         [2.5, 0.0, 0.0, 0.0, 0.0]],   # emitted 2: slack 2.5, a violation
    ], dtype=torch.bfloat16)
    emitted = torch.tensor([[1, 3, 4], [3, 1, 2]])
    return logits, emitted


def test_replay_scores_slack_and_argmax_agreement_with_ties_to_the_lowest_index():
    import torch

    from fastqwen.judge.replay import score_positions, summarize_side

    logits, emitted = _logits_and_emitted()
    slack, argmax = score_positions(logits, emitted)
    assert slack.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.75, 2.5]]
    assert argmax.tolist() == [[1, 0, 2], [3, 0, 0]]  # the tie at step 1 goes to index 0
    agree = argmax == emitted
    figures = summarize_side(list(slack), list(agree), violations=[{"slack": 2.5}], sequences=2)
    assert figures["positions"] == 6
    assert figures["argmax_agree"] == 2 and figures["argmax_agree_fraction"] == pytest.approx(2 / 6)
    assert figures["count_gt_0_75"] == 2  # 1.0 and 2.5; exactly 0.75 is not over
    assert figures["count_gt_0"] == 3  # the tie has slack 0 yet disagrees: agreement is not count_gt_0's complement
    assert figures["max_slack"] == 2.5 and figures["violation_count"] == 1
    # Every position agreeing: fraction exactly 1.
    perfect = summarize_side([torch.zeros(4)], [torch.ones(4, dtype=torch.bool)], [], 1)
    assert (perfect["argmax_agree"], perfect["argmax_agree_fraction"], perfect["count_gt_0_75"]) == (4, 1.0, 0)


def _replayed(positions: int, over: int, worst: float, agree: int) -> dict:
    return {"sequences": 1, "positions": positions, "max_slack": worst, "p999_slack": worst, "count_gt_0_75": over,
            "count_gt_0": over, "argmax_agree": agree, "argmax_agree_fraction": agree / positions,
            "violation_count": 0, "violations": []}


def _fid_result(name: str, sides: dict) -> dict:
    from fastqwen.judge.fidelity import workload_fidelity

    return {"workload": {"name": name}, "fidelity": workload_fidelity(sides)}


def test_fidelity_sums_and_the_noise_comparison_at_its_boundaries():
    from fastqwen.judge.fidelity import run_fidelity

    results = [
        _fid_result("a", {"engine": _replayed(10, 1, 0.875, 9), "native": _replayed(10, 2, 0.625, 10),
                          "baseline": _replayed(10, 3, 1.0, 8)}),
        _fid_result("b", {"engine": _replayed(20, 1, 0.5, 20), "native": _replayed(20, 0, 0.25, 19),
                          "baseline": _replayed(20, 0, 0.25, 20)}),
    ]
    # Per workload: engine 0.875 <= 0.625 + 0.25 holds at equality; baseline 1.0 does not.
    assert results[0]["fidelity"]["worst_slack_within_native_allowance"] == {"engine": True, "baseline": False}
    assert results[0]["fidelity"]["sides"]["engine"] == {
        "positions": 10, "count_gt_0_75": 1, "max_slack": 0.875, "argmax_agree": 9, "argmax_agree_fraction": 0.9}
    run = run_fidelity(results, ["engine", "native", "baseline"])
    engine, native = run["sides"]["engine"], run["sides"]["native"]
    assert (engine["positions"], engine["count_gt_0_75"], engine["argmax_agree"]) == (30, 2, 29)
    assert engine["max_slack"] == 0.875
    assert engine["argmax_agree_fraction"] == pytest.approx(29 / 30) and native["argmax_agree"] == 29
    noise = run["noise_vs_native"]
    assert noise["gated"] is False and "0.75" in noise["claim"] and "0.25" in noise["claim"]
    # Engine: 2 over 0.75 against native's 2 (<=), both workloads within: holds.
    assert noise["by_side"]["engine"]["count_within_native"] and noise["by_side"]["engine"]["holds"]
    # Baseline: 3 > 2, and workload a beyond the allowance.
    base = noise["by_side"]["baseline"]
    assert not base["count_within_native"] and base["worst_slack_within_native_allowance"] == {"a": False, "b": True}
    assert not base["holds"]
    # the sign test: 3 of 5 events on the baseline's side, P(>= 3 of 5) = 16/32
    assert base["count_excess_p"] == pytest.approx(0.5) and noise["by_side"]["engine"]["count_excess_p"] == 11 / 16


def test_the_sign_test_of_a_count_over_natives():
    from fastqwen.judge.fidelity import excess_p
    from fastqwen.judge.report import noise_lines

    assert excess_p(0, 0) == 1.0 and excess_p(0, 7) == 1.0
    assert excess_p(3, 0) == pytest.approx(1 / 8)
    assert excess_p(19, 9) == pytest.approx(0.0436, abs=1e-4)     # 19 events against native's 9
    assert excess_p(32, 14) == pytest.approx(0.0057, abs=1e-4)
    assert excess_p(17, 27) > 0.9
    over = {"count_gt_0_75": 19, "native_count_gt_0_75": 9, "count_within_native": False, "count_excess_p": 0.0436,
            "worst_slack_within_native_allowance": {"a": True}, "holds": False}
    line = noise_lines({"fidelity": {"noise_vs_native": {"by_side": {"engine": over}}}})[0]
    assert "MORE THAN native, sign test p = 0.044)" in line
    under = dict(over, count_gt_0_75=5, count_within_native=True, count_excess_p=0.9, holds=True)
    line = noise_lines({"fidelity": {"noise_vs_native": {"by_side": {"engine": under}}}})[0]
    assert "(<= native)" in line and "sign test" not in line


def test_fidelity_without_native_or_with_a_missing_replay():
    from fastqwen.judge.fidelity import run_fidelity

    alone = [_fid_result("a", {"engine": _replayed(4, 0, 0.0, 4)})]
    assert alone[0]["fidelity"]["worst_slack_within_native_allowance"] == {"engine": None}
    run = run_fidelity(alone, ["engine"])
    assert run["sides"]["engine"]["positions"] == 4 and run["noise_vs_native"]["by_side"] == {}
    # The engine failed in workload b (no replay): its sums cover one workload and the claim cannot hold.
    partial = [_fid_result("a", {"engine": _replayed(4, 0, 0.0, 4), "native": _replayed(4, 0, 0.0, 4)}),
               _fid_result("b", {"native": _replayed(4, 0, 0.0, 4)})]
    run = run_fidelity(partial, ["engine", "native"])
    assert run["sides"]["engine"]["workloads"] == 1 and run["sides"]["native"]["workloads"] == 2
    assert not run["noise_vs_native"]["by_side"]["engine"]["holds"]
    # A side with no replay anywhere: zero positions, no fraction.
    nothing = run_fidelity([{"workload": {"name": "a"}, "fidelity": None}], ["engine"])
    assert nothing["sides"]["engine"]["positions"] == 0 and nothing["sides"]["engine"]["argmax_agree_fraction"] is None


def test_sample_order_rotates_who_goes_first():
    from fastqwen.judge.runner import sample_order

    # Two sides: the platform's alternation, unchanged.
    assert [sample_order(["engine", "native"], i) for i in range(3)] == [
        ["engine", "native"], ["native", "engine"], ["engine", "native"]]
    assert sample_order(["engine"], 5) == ["engine"]
    three = ["engine", "native", "baseline"]
    orders = [sample_order(three, i) for i in range(12)]
    assert orders[:3] == [["engine", "baseline", "native"], ["native", "engine", "baseline"],
                          ["baseline", "engine", "native"]]
    # Engine before native exactly when i is even, as with two sides.
    assert all((o.index("engine") < o.index("native")) == (i % 2 == 0) for i, o in enumerate(orders))
    # Each side first once in every block of three, and in each position twice in six.
    for block in range(0, 12, 3):
        assert sorted(o[0] for o in orders[block:block + 3]) == sorted(three)
    for label in three:
        assert sorted(o.index(label) for o in orders[:6]) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="got 4"):
        sample_order(three + ["other"], 0)


def test_baseline_geomean_needs_every_workload():
    from fastqwen.judge.runner import baseline_summary

    def result(ratios, throughput=100.0):
        return {"ratios_vs_baseline": ratios, "baseline": {"summary": {"throughput": throughput}}}

    both = [result({"ttft": 1.0, "tpot": 0.98, "throughput": 1.02}),
            result({"ttft": 4.0, "tpot": 1.0, "throughput": 1.0}, throughput=400.0)]
    summary = baseline_summary(both, pathlib.Path("/b"))
    assert summary["ratios_geomean"]["ttft"] == pytest.approx(2.0)
    assert summary["ratios_geomean"]["tpot"] == pytest.approx(0.98 ** 0.5)
    assert summary["throughput_geomean"] == pytest.approx(200.0) and summary["gated"] is False
    failed = baseline_summary([both[0], result(None, throughput=None)], pathlib.Path("/b"))
    assert failed["ratios_geomean"] == {"ttft": None, "tpot": None, "throughput": None}
    assert failed["throughput_geomean"] is None


# ------------------------------------------------------------------------------------------------
# the report's rendering
# ------------------------------------------------------------------------------------------------
def _side_json(ttft, tpot, throughput) -> dict:
    return {"summary": {"samples": 2, "ttft_s": ttft, "tpot_s": tpot, "total_s": 1.0, "throughput": throughput,
                        "spread": 0.01}, "memory_gated_bytes": 2**29}


def _rendered_report() -> dict:
    from fastqwen.judge.fidelity import run_fidelity

    r = _fid_result("wl-a", {"engine": _replayed(40, 1, 0.5, 39), "native": _replayed(40, 2, 0.625, 40),
                             "baseline": _replayed(40, 3, 1.0, 37)})
    r.update({"workload": {"name": "wl-a"}, "passed": True, "codes": [], "roofline": None,
              "engine": _side_json(0.010, 0.002, 500.0), "native": _side_json(0.020, 0.004, 250.0),
              "baseline": _side_json(0.010, 0.002, 490.0),
              "ratios": {"ttft": 0.5, "tpot": 0.5, "throughput": 2.0},
              "ratios_vs_baseline": {"ttft": 1.0, "tpot": 1.0, "throughput": 500 / 490}})
    return {"results": [r], "mode": "public", "samples": 2, "notes": [],
            "score": {"valid": True, "engine": 500.0, "native": 250.0, "ratio": 2.0},
            "baseline": {"dir": "/old/engine", "gated": False, "throughput_geomean": 490.0,
                         "ratios_geomean": {"ttft": 1.0, "tpot": 1.0, "throughput": 500 / 490}},
            "fidelity": run_fidelity([r], ["engine", "native", "baseline"])}


def _row(lines: list[str], *cells: str) -> list[str]:
    """The one table line whose leading cells are `cells` (blank cells dropped)."""
    found = [line.split() for line in lines if line.split()[:len(cells)] == list(cells)]
    assert len(found) == 1, (cells, lines)
    return found[0]


def test_report_renders_speed_and_fidelity_tables_and_the_comparisons():
    from fastqwen.judge.report import format_table

    text = format_table(_rendered_report())
    lines = text.splitlines()
    fidelity_at = next(i for i, line in enumerate(lines) if line.startswith("fidelity:"))
    totals_at = next(i for i, line in enumerate(lines) if line.startswith("all workloads"))
    speed, per_workload, totals = lines[:fidelity_at], lines[fidelity_at:totals_at], lines[totals_at:]
    assert _row(speed, "wl-a", "engine")[2:5] == ["10.00", "2.00", "500.0"]
    assert _row(speed, "baseline")[-2:] == ["not", "gated"]
    assert _row(speed, "engine/native")[1:4] == ["0.50x", "0.50x", "2.00x"]
    assert _row(speed, "engine/baseline")[1:4] == ["1.00x", "1.00x", "1.02x"]
    # The fidelity table: positions, count over 0.75, worst slack, agreement, the allowance check.
    assert "slack > 0.75" in per_workload[1] and "worst <= native + 0.25" in per_workload[1]
    assert _row(per_workload, "wl-a", "engine") == ["wl-a", "engine", "40", "1", "0.500", "39/40", "(97.5%)", "yes"]
    assert _row(per_workload, "native") == ["native", "40", "2", "0.625", "40/40", "(100.0%)"]
    assert _row(per_workload, "baseline") == ["baseline", "40", "3", "1.000", "37/40", "(92.5%)", "NO"]
    assert _row(totals, "all", "workloads", "engine")[3:] == ["40", "1", "0.500", "39/40", "(97.5%)", "1/1",
                                                              "workloads"]
    assert _row(totals, "baseline", "40")[-2:] == ["0/1", "workloads"]
    engine_line = next(line for line in lines if line.startswith("noise vs native, engine"))
    assert "not a gate" in engine_line and "1 position(s), native 2 (<= native)" in engine_line
    assert engine_line.endswith("1/1 workload(s): holds")
    assert next(line for line in lines if line.startswith("noise vs native, baseline")).endswith("DOES NOT HOLD")
    base_line = next(line for line in lines if line.startswith("baseline (not gated"))
    assert "/old/engine" in base_line and "TTFT 1.000x, TPOT 1.000x, tok/s 1.020x" in base_line


def test_report_without_native_or_baseline_has_no_comparison_rows():
    from fastqwen.judge.fidelity import run_fidelity
    from fastqwen.judge.report import format_table

    report = _rendered_report()
    r = report["results"][0]
    r.update({"native": None, "baseline": None, "ratios": None, "ratios_vs_baseline": None})
    r.update(_fid_result("wl-a", {"engine": _replayed(40, 1, 0.5, 39)}))
    report.update({"baseline": None, "fidelity": run_fidelity([r], ["engine"]),
                   "score": {"valid": True, "engine": 500.0, "native": None, "ratio": None}})
    lines = format_table(report).splitlines()
    assert not any(word in ("native", "baseline") or word.startswith(("engine/native", "engine/baseline"))
                   for line in lines for word in line.split()[:2])
    assert not any(line.startswith(("noise vs native", "baseline (")) for line in lines)
    assert _row(lines, "wl-a", "engine", "40")[-1] == "-"  # no native to compare with
    assert _row(lines, "all", "workloads", "engine")[-1] == "(97.5%)"  # nor a count of workloads within


def test_report_shows_the_engines_speculation_per_workload():
    from fastqwen.judge.report import format_table

    report = _rendered_report()
    assert not any(line.startswith("speculation") for line in format_table(report).splitlines())
    report["results"][0]["engine"]["speculation"] = {"mode": "off", "k": 0, "verify_steps": 0, "plain_steps": 0}
    assert not any(line.startswith("speculation") for line in format_table(report).splitlines())
    report["results"][0]["engine"]["speculation"] = {
        "mode": "auto", "k": 4, "acceptance": 0.5, "tokens_per_verify": 2.25, "verify_steps": 12,
        "width_steps": {"4": 10, "1": 2}, "plain_steps": 30, "draft_ms": 0.05, "verify_ms": 3.1, "plain_ms": 2.5}
    line = next(line for line in format_table(report).splitlines() if line.startswith("speculation"))
    assert line == ("speculation (auto, k=4), wl-a: acceptance 0.50, tokens per verify 2.25, 12 verifies "
                    "(by width 1:2 4:10), 30 plain steps; device ms a draft 0.050, a verify 3.10, a plain step 2.50")


# ------------------------------------------------------------------------------------------------
# the child's yield checks
# ------------------------------------------------------------------------------------------------
def test_step_checks_want_plain_lists_of_plain_ints():
    import numpy as np

    class MyList(list):
        pass

    assert _check_step([1, 2, 3], 0) is None
    assert "not a plain list" in _check_step((1, 2), 0)
    assert "not a plain list" in _check_step(MyList([1]), 0)
    assert "element 1 is builtins.bool" in _check_step([1, True], 3)
    assert "not a plain int" in _check_step([np.int64(4)], 0)
    assert "step 5" in _check_step([1.0], 5)


# ------------------------------------------------------------------------------------------------
# workload files
# ------------------------------------------------------------------------------------------------
def test_embedded_sets():
    public = load_workloads("public")
    assert [(w.batch, w.prompt, w.output) for w in public.workloads] == [(1, 512, 32), (4, 2048, 32), (16, 512, 128)]
    default = load_workloads("default", max_positions=4096)
    assert 2 <= len(default.workloads) <= 3 and all(w.prompt + w.output <= 256 for w in default.workloads)


@pytest.mark.parametrize("doc, message", [
    ([], "top level must be a JSON object"),
    ({"workloads": []}, "'workloads' must be a non-empty list"),
    ({"workloads": [{"batch": 1, "prompt": 8}]}, "missing field 'output'"),
    ({"workloads": [{"batch": 0, "prompt": 8, "output": 2}]}, "batch must be >= 1, got 0"),
    ({"workloads": [{"batch": 1, "prompt": 0, "output": 2}]}, "prompt must be >= 1, got 0"),
    ({"workloads": [{"batch": 1, "prompt": 8, "output": -1}]}, "output must be >= 1, got -1"),
    ({"workloads": [{"batch": True, "prompt": 8, "output": 2}]}, "batch must be an integer, got True"),
    ({"workloads": [{"batch": 1, "prompt": "8", "output": 2}]}, "prompt must be an integer"),
    ({"workloads": [{"batch": 1, "prompt": 4000, "output": 97}]}, "4097 exceeds the model's max_position_embeddings 4096"),
    ({"workloads": [{"name": "a", "batch": 1, "prompt": 8, "output": 2},
                    {"name": "a", "batch": 2, "prompt": 8, "output": 2}]}, "duplicate workload name 'a'"),
])
def test_malformed_workloads_name_the_bad_value(doc, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_workloads(doc, "w.json", max_positions=4096)


def test_workload_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="is not valid JSON"):
        load_workloads(str(bad))
    with pytest.raises(UserError, match="unknown workload set 'privat'"):
        load_workloads("privat")
    with pytest.raises(UserError, match="does not exist"):
        load_workloads(str(tmp_path / "missing.json"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"workloads": [{"batch": 2, "prompt": 8, "output": 3}]}))
    ws = load_workloads(str(good))
    assert ws.workloads[0].name == "b2-p8-o3" and ws.name == "good"


# ------------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------------
def test_synthetic_stream_is_text_like_and_deterministic():
    a = synthetic_stream(4096, n_tokens=20000)
    assert a == synthetic_stream(4096, n_tokens=20000)
    assert a != synthetic_stream(4096, n_tokens=20000, seed=1)
    assert all(0 <= t < 4096 for t in a)
    counts = sorted((a.count(t) for t in set(a)), reverse=True)
    # Zipf-like: the most frequent id is far above a uniform share, and many ids are rare.
    assert counts[0] > 20 * len(a) / 4096
    # Recurring phrases: some 6-grams repeat.
    grams = [tuple(a[i:i + 6]) for i in range(len(a) - 6)]
    assert len(set(grams)) < len(grams) * 0.95


def test_prompts_are_never_repeated_and_wrap():
    source = PromptSource(list(range(50)), seed=3, kind="test")
    drawn = [tuple(p) for _ in range(10) for p in source.draw(4, 20)]
    assert len(set(drawn)) == len(drawn) == 40
    long = source.draw(1, 120)[0]
    assert len(long) == 120 and all(long[i + 1] == (long[i] + 1) % 50 for i in range(119))
    with pytest.raises(RuntimeError, match="unseen prompt"):
        for _ in range(20):
            source.draw(5, 3)


def test_prompts_from_a_model_tokenizer_are_corpus_windows(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fastqwen.judge.prompts import CORPUS_PATH

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(CORPUS_PATH)], trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    text = CORPUS_PATH.read_text()
    assert 20_000 < len(text.encode()) < 60_000
    source = PromptSource.for_model(tmp_path, vocab_size=600, seed=0)
    assert source.kind.startswith("corpus windows")
    # The stream is the whole corpus, tokenized by the model's tokenizer...
    assert tok.decode(source.stream) == text
    # ...and every prompt is a (cyclic) window of it.
    doubled = source.stream * 2
    for prompt in source.draw(3, 40):
        starts = [i for i in range(len(source.stream)) if doubled[i:i + 40] == prompt]
        assert starts, prompt
    # Without a tokenizer the synthetic stream is used, and for a checkpoint synth made, whose
    # tokenizer is as synthetic as its weights.
    assert PromptSource.for_model(tmp_path / "nothing", 600, 0).kind.startswith("synthetic")
    (tmp_path / "fastqwen_synth.json").write_text("{}")
    assert PromptSource.for_model(tmp_path, 600, 0).kind.startswith("synthetic")


# ------------------------------------------------------------------------------------------------
# command line: every bad input is one line, before anything is launched
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    import fastqwen.judge.runner as runner

    def refuse(*args, **kwargs):
        raise AssertionError("the run was started despite a bad input")

    monkeypatch.setattr(runner, "run_judge", refuse)


def _engine(tmp_path: pathlib.Path, source: str) -> pathlib.Path:
    folder = tmp_path / "eng"
    folder.mkdir(exist_ok=True)
    (folder / "engine.py").write_text(source)
    return folder


def _cli_error(capsys, argv: list[str]) -> str:
    from fastqwen.cli import main

    assert main(["judge"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_engine_folders(tmp_path, capsys, no_launch, tiny_model):
    model = ["--model", str(tiny_model)]
    assert "does not exist" in _cli_error(capsys, ["--engine", str(tmp_path / "nope")] + model)
    (tmp_path / "empty").mkdir()
    assert "has no engine.py" in _cli_error(capsys, ["--engine", str(tmp_path / "empty")] + model)
    assert "defines no top-level class Engine" in _cli_error(
        capsys, ["--engine", str(_engine(tmp_path, "class Engin:\n    pass\n"))] + model)
    assert "does not parse" in _cli_error(capsys, ["--engine", str(_engine(tmp_path, "class Engine(:\n"))] + model)


def test_baseline_folder_gets_the_engine_checks_and_names_its_flag(tmp_path, capsys, no_launch, native_engine_dir,
                                                                   tiny_model):
    from fastqwen.judge.cli import add_arguments, build_settings

    base = ["--engine", str(native_engine_dir), "--model", str(tiny_model)]
    assert "--baseline folder" in _cli_error(capsys, base + ["--baseline", str(tmp_path / "nope")])
    assert "does not exist" in _cli_error(capsys, base + ["--baseline", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    assert "has no engine.py" in _cli_error(capsys, base + ["--baseline", str(tmp_path / "empty")])
    assert "defines no top-level class Engine" in _cli_error(
        capsys, base + ["--baseline", str(_engine(tmp_path, "class Engin:\n    pass\n"))])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = ["--out", str(tmp_path / "r.json")]
    assert build_settings(parser.parse_args(base + out)).baseline_dir is None
    relative = pathlib.Path(__file__).parent.parent / "fastqwen" / "native_engine" / ".." / "native_engine"
    settings = build_settings(parser.parse_args(base + out + ["--baseline", str(relative)]))
    assert settings.baseline_dir == native_engine_dir.resolve()


def test_engine_detection_reads_source_without_importing(tmp_path):
    from fastqwen.judge.cli import check_engine_dir

    # Importing this would raise; the check must not import it.
    assert check_engine_dir(_engine(tmp_path, "raise SystemExit(9)\nclass Engine:\n    pass\n"))
    assert check_engine_dir(_engine(tmp_path, "from impl import FastEngine as Engine\n"))
    with pytest.raises(UserError, match="class Engine"):
        check_engine_dir(_engine(tmp_path, "def f():\n    class Engine:\n        pass\n"))


def test_bad_model_and_workloads(tmp_path, capsys, no_launch, native_engine_dir, tiny_model):
    engine = ["--engine", str(native_engine_dir)]
    assert "does not exist" in _cli_error(capsys, engine + ["--model", str(tmp_path / "nomodel")])
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    assert "not valid JSON" in _cli_error(capsys, engine + ["--model", str(broken)])
    model = ["--model", str(tiny_model)]
    assert "unknown workload set 'secret'" in _cli_error(capsys, engine + model + ["--workloads", "secret"])
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"workloads": [{"batch": 1, "prompt": 4090, "output": 10}]}))
    assert "max_position_embeddings" in _cli_error(capsys, engine + model + ["--workloads", str(long)])
    assert "--samples must be >= 1" in _cli_error(capsys, engine + model + ["--samples", "0"])
    assert "--sample-timeout must be > 0" in _cli_error(capsys, engine + model + ["--sample-timeout", "0"])


def test_modes_set_the_sample_count(native_engine_dir, tiny_model, tmp_path):
    from fastqwen.judge.cli import add_arguments, build_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--engine", str(native_engine_dir), "--model", str(tiny_model), "--out", str(tmp_path / "r.json")]
    official = build_settings(parser.parse_args(base + ["--official"]))
    public = build_settings(parser.parse_args(base))
    override = build_settings(parser.parse_args(base + ["--official", "--samples", "2", "--seed", "5"]))
    assert (official.official, official.samples) == (True, 5)
    assert (public.official, public.samples) == (False, 1)
    assert (override.official, override.samples, override.seed) == (True, 2, 5)
    assert official.native and not build_settings(parser.parse_args(base + ["--no-native"])).native
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--official", "--public"])


def test_default_model_is_synthesized_once_into_the_cache(tmp_path, monkeypatch):
    from fastqwen.judge.cli import default_model

    monkeypatch.setenv("FASTQWEN_CACHE", str(tmp_path / "cache"))
    first = default_model(progress=False)
    assert first == tmp_path / "cache" / "checkpoints" / "tiny-seed0"
    stamp = (first / "config.json").stat().st_mtime_ns
    assert default_model(progress=False) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == ["tiny-seed0"]  # no staging folder left


def test_chart_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    from fastqwen.judge.chart import write_chart

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert write_chart({"results": []}, tmp_path / "c.png") is False
    assert not (tmp_path / "c.png").exists()


def test_report_names_the_engine_switches_in_effect():
    from fastqwen.judge.runner import engine_switches

    env = {"FASTQWEN_NO_PDL": "1", "FASTQWEN_COMMIT": "abc", "PATH": "/bin", "FASTQWEN_NO_GRAPHS": "0"}
    assert engine_switches(env) == {"FASTQWEN_NO_GRAPHS": "0", "FASTQWEN_NO_PDL": "1"}
    assert engine_switches({"HOME": "/root"}) == {}


def test_child_reports_what_the_engine_describes():
    from fastqwen.judge.child import describe

    class Described:
        def describe(self):
            return {"family": "qwen3.5", "backend": "triton", "decode_graph": True, "x" * 300: "y" * 300}

    class Broken:
        def describe(self):
            raise RuntimeError("no")

    class Odd:
        def describe(self):
            return ["backend"]

    info = describe(Described())
    assert info["family"] == "qwen3.5" and info["decode_graph"] == "True"
    assert max(len(k) for k in info) == 200 and max(len(v) for v in info.values()) == 200
    assert describe(object()) is None
    assert "RuntimeError" in describe(Broken())["error"]
    assert "list" in describe(Odd())["error"]


def test_the_speculation_summary_sums_the_timed_samples():
    from fastqwen.judge.runner import speculation_summary

    one = {"mode": "auto", "k": 4, "drafted": 8, "accepted": 4, "verify_steps": 3, "plain_steps": 10,
           "verified_rows": 3, "emitted": 7, "width_steps": {1: 1, 4: 2}, "draft_ms": 0.1, "verify_ms": 3.0,
           "plain_ms": 2.5}
    two = dict(one, width_steps={"4": 3}, drafted=12, accepted=8, verify_steps=3, verified_rows=3, emitted=11,
               verify_ms=9.9)
    got = speculation_summary([{"speculation": one}, {"speculation": two}, {}])
    assert got["drafted"] == 20 and got["accepted"] == 12 and got["acceptance"] == pytest.approx(0.6)
    assert got["width_steps"] == {"1": 1, "4": 5}
    assert got["tokens_per_verify"] == pytest.approx(18 / 6)
    assert got["verify_ms"] == 3.0             # the first sample's (measured once per shape)
    assert speculation_summary([{}, {"speculation": None}]) is None


def test_the_child_passes_on_numbers_small_tables_and_short_strings_of_spec_stats():
    from fastqwen.judge.child import spec_stats

    class Engine:
        def spec_stats(self):
            return {"mode": "auto", "drafted": 8, "verify_ms": None, "width_steps": {1: 2, 4: 3},
                    "verify_ms_by_width": {1: 2.5}, "odd": {"a": "b"}, "long": "x" * 100}

    got = spec_stats(Engine())
    assert got["width_steps"] == {"1": 2, "4": 3} and got["verify_ms_by_width"] == {"1": 2.5}
    assert got["drafted"] == 8 and got["verify_ms"] is None and got["mode"] == "auto"
    assert got["odd"] == "{'a': 'b'}" and len(got["long"]) == 60

    class Broken:
        def spec_stats(self):
            raise RuntimeError("no")

    assert spec_stats(Broken()) is None and spec_stats(object()) is None
