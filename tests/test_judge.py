"""End-to-end: the judge runs real engine processes on `tiny` and records the right code for each break.

Every engine under tests/fixtures/engines/ breaks exactly one rule; the native baseline breaks none.
Shapes are tiny (batch 1-2, prompt 16-32, output 4-8) and most runs skip the native side, so the
whole file stays within a few minutes on two CPU cores.
"""
from __future__ import annotations

import json
import pathlib

import pytest

from fastqwen.checkpoint import read_config
from fastqwen.judge.runner import JudgeSettings, run_judge
from fastqwen.judge.workloads import parse_workloads

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "engines"


def judge(engine_dir: pathlib.Path, model: pathlib.Path, tmp_path: pathlib.Path, shapes=((1, 16, 6),),
          **overrides) -> dict:
    config = read_config(model)
    workloads = parse_workloads(
        {"name": "test", "workloads": [{"batch": b, "prompt": p, "output": o} for b, p, o in shapes]},
        "test", config["max_position_embeddings"])
    settings = dict(engine_dir=engine_dir, model_dir=model, model_config=config, workloads=workloads,
                    official=False, samples=1, device="cpu", load_timeout_s=120.0, sample_timeout_s=60.0,
                    native=False, seed=1234, log_dir=tmp_path / "logs", measure_ceilings=False,
                    progress=lambda line: None)
    settings.update(overrides)
    return run_judge(JudgeSettings(**settings))


def codes(report: dict, index: int = 0) -> list[str]:
    return [c["code"] for c in report["results"][index]["codes"]]


def detail(report: dict, code: str, index: int = 0) -> str:
    return next(c["detail"] for c in report["results"][index]["codes"] if c["code"] == code)


def test_native_against_itself_passes_every_gate_but_wall_clock_luck(native_engine_dir, tiny_model, tmp_path):
    """Official mode through the CLI: both sides are the native folder. Every gate that does not
    compare wall-clock times must pass, and neither side may be handicapped by the harness.

    The latency gate (engine median within 1.10x native's) and the spread gate (25%) cannot be a
    pass/fail test of identical sides on a shared two-core machine: samples here are ~30 ms and
    foreign load moves one by 30-70%. Measured: with 3 samples per side, 3 of 4 identical-side
    runs on such a machine failed on timing alone (ratios 0.83x-1.15x either way). So this test
    asserts what identical sides must show on any machine (ratios near 1, within 2x, in a 5-sample
    run) and that a failure, if any, is timing and nothing else; the gates' arithmetic is tested on fixed figures in test_judge_units.py, and the
    spread gate firing on a real engine in test_wildly_varying_timing_* below.
    """
    from fastqwen.cli import main

    wl_file = tmp_path / "wl.json"
    wl_file.write_text(json.dumps({"name": "t", "workloads": [{"name": "b2", "batch": 2, "prompt": 32, "output": 8}]}))
    out = tmp_path / "report.json"
    rc = main(["judge", "--engine", str(native_engine_dir), "--model", str(tiny_model), "--workloads",
               str(wl_file), "--official", "--samples", "5", "--device", "cpu", "--memory-limit-gib", "2.0",
               "--seed", "7", "--out", str(out), "--load-timeout", "120", "--sample-timeout", "60"])
    report = json.loads(out.read_text())
    found = codes(report)
    assert set(found) <= {"latency_limit", "unstable_timing"}, report["results"][0]["codes"]
    if found:
        assert rc == 1 and not report["passed"]
    else:
        assert rc == 0 and report["passed"] and report["score"]["valid"]
    r = report["results"][0]
    # Every gate was actually evaluated: native ran, 3 samples each, memory measured under a limit.
    assert r["engine"]["summary"]["samples"] == 5 and r["native"]["summary"]["samples"] == 5
    # Identical code on both sides: the medians agree within 2x (a harness that handicapped one
    # side, e.g. by loading it second or polling it, shows here).
    for key in ("ttft", "tpot", "throughput"):
        assert 0.5 <= r["ratios"][key] <= 2.0, (key, r["ratios"])
    # The native engine's CPU peak (a tiny model, Transformers and what it imports) measured
    # 0.67-1.11 GiB across runs here (more with the optional packages Transformers finds
    # installed), so the limit sits at 2 GiB: under it, and measured.
    assert r["engine"]["memory_limit_bytes"] == 2 * 2**30 and 0 < r["engine"]["memory_gated_bytes"] < 2 * 2**30
    replay = r["replay"]["sides"]
    assert replay["engine"]["positions"] == 5 * 2 * 8 and replay["engine"]["violation_count"] == 0
    assert replay["native"]["violation_count"] == 0
    # Same prompts on both sides, same code: the tokens agree exactly.
    assert r["agreement_with_native"]["identical"] == 10
    # Samples alternate which side goes first.
    assert [s["went"] for s in r["engine"]["samples"]] == ["first", "second", "first", "second", "first"]
    assert [s["went"] for s in r["native"]["samples"]] == ["second", "first", "second", "first", "second"]
    # Roofline and the chart come with the CLI run.
    assert r["roofline"]["floors"]["throughput"] > 0 and r["roofline"]["engine"]["throughput_fraction"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert report["versions"]["torch"] and report["model"]["weight_bytes"] > 0


def test_baseline_is_a_third_side_timed_replayed_and_compared(native_engine_dir, tiny_model, tmp_path, capsys):
    """--baseline through the CLI: all three sides are the native folder, so on the same prompts they
    emit the same tokens and their replay figures must be identical; each goes first once in three."""
    from fastqwen.cli import main

    wl_file = tmp_path / "wl.json"
    wl_file.write_text(json.dumps({"name": "t", "workloads": [{"name": "b2", "batch": 2, "prompt": 16, "output": 4}]}))
    out = tmp_path / "report.json"
    rc = main(["judge", "--engine", str(native_engine_dir), "--baseline", str(native_engine_dir), "--model",
               str(tiny_model), "--workloads", str(wl_file), "--samples", "3", "--device", "cpu", "--seed", "11",
               "--out", str(out), "--load-timeout", "120", "--sample-timeout", "60"])
    report = json.loads(out.read_text())
    r = report["results"][0]
    assert rc == 0 and r["codes"] == []
    assert [s["went"] for s in r["engine"]["samples"]] == ["first", "second", "second"]
    assert [s["went"] for s in r["native"]["samples"]] == ["third", "first", "third"]
    assert [s["went"] for s in r["baseline"]["samples"]] == ["second", "third", "first"]
    assert r["baseline"]["summary"]["samples"] == 3 and r["baseline"]["log"].endswith("-baseline.log")
    assert r["agreement_with_baseline"]["identical"] == 6 and r["agreement_with_native"]["identical"] == 6
    sides = r["replay"]["sides"]
    assert sides["baseline"]["positions"] == 3 * 2 * 4
    assert sides["engine"]["argmax_agree"] == sides["native"]["argmax_agree"] == sides["baseline"]["argmax_agree"]
    figures = r["fidelity"]["sides"]
    assert figures["engine"] == figures["native"] == figures["baseline"]
    assert r["fidelity"]["worst_slack_within_native_allowance"] == {"engine": True, "baseline": True}
    assert all(v > 0 for v in r["ratios_vs_baseline"].values())
    run = report["fidelity"]
    assert run["sides"]["engine"]["positions"] == 24 and run["sides"]["baseline"] == run["sides"]["engine"]
    assert run["noise_vs_native"]["by_side"]["engine"]["holds"] and not run["noise_vs_native"]["gated"]
    assert report["baseline"]["dir"] == str(native_engine_dir.resolve())
    assert report["baseline"]["ratios_geomean"]["throughput"] == pytest.approx(r["ratios_vs_baseline"]["throughput"])
    printed = capsys.readouterr().out
    assert "engine/baseline" in printed and "noise vs native, engine (diagnostic, not a gate)" in printed
    assert "baseline (not gated;" in printed


def test_a_failing_baseline_is_reported_and_never_gated(native_engine_dir, tiny_model, tmp_path):
    report = judge(native_engine_dir, tiny_model, tmp_path, shapes=((1, 16, 4),),
                   baseline_dir=FIXTURES / "wrong_token")
    r = report["results"][0]
    assert codes(report) == [] and report["passed"] and report["score"]["valid"]
    assert r["replay"]["sides"]["baseline"]["violation_count"] == 1
    assert r["replay"]["sides"]["baseline"]["argmax_agree"] == 3  # the wrong token, and only it, disagrees
    assert "beyond 2.0 logits" in r["baseline_problems"][0]
    assert any("(baseline, not gated)" in note for note in report["notes"])
    assert r["agreement_with_baseline"] == {"sequences": 1, "identical": 0, "earliest_divergence_step": 2}


def test_wrong_token_is_incorrect_output_at_its_position(tiny_model, tmp_path):
    report = judge(FIXTURES / "wrong_token", tiny_model, tmp_path, shapes=((2, 24, 6),), samples=2)
    assert codes(report) == ["incorrect_output"]
    violations = report["results"][0]["replay"]["sides"]["engine"]["violations"]
    # Sequence 0 of each sample, step 2, and nothing else.
    assert sorted((v["sample"], v["sequence"], v["step"]) for v in violations) == [(0, 0, 2), (1, 0, 2)]
    assert all(v["slack"] > 2.0 and v["emitted"] != v["argmax"] and v["position"] == 24 + 2 for v in violations)
    assert "step 2" in detail(report, "incorrect_output")
    assert not report["passed"] and not report["score"]["valid"]
    # The numbers are still shown for a failed run.
    assert report["score"]["engine"] > 0


def test_one_yield_too_few_is_candidate_error(tiny_model, tmp_path):
    report = judge(FIXTURES / "short_yield", tiny_model, tmp_path, shapes=((1, 16, 5),))
    assert codes(report) == ["candidate_error"]
    assert "yielded 4 steps, expected max_new_tokens=5" in detail(report, "candidate_error")


def test_raise_mid_stream_is_candidate_error_with_message(tiny_model, tmp_path):
    report = judge(FIXTURES / "raises_midstream", tiny_model, tmp_path)
    assert codes(report) == ["candidate_error"]
    text = detail(report, "candidate_error")
    assert "at step 2" in text and "deliberate failure at step 2" in text and "RuntimeError" in text


def test_hang_is_timeout(tiny_model, tmp_path):
    report = judge(FIXTURES / "hangs", tiny_model, tmp_path, sample_timeout_s=3.0)
    assert codes(report) == ["timeout"]
    assert "sample exceeded 3 s" in detail(report, "timeout")
    # The hung process was killed, and the run went on to write a report.
    assert report["results"][0]["engine"]["exit_code"] is not None


def test_tensor_yields_are_candidate_error(tiny_model, tmp_path):
    report = judge(FIXTURES / "tensor_yields", tiny_model, tmp_path)
    assert codes(report) == ["candidate_error"]
    assert "torch.Tensor, not a plain list" in detail(report, "candidate_error")


def test_wildly_varying_timing_is_unstable_in_official_mode_only(tiny_model, tmp_path):
    official = judge(FIXTURES / "unstable_timing", tiny_model, tmp_path, official=True, samples=3)
    assert codes(official) == ["unstable_timing"]
    assert official["results"][0]["engine"]["summary"]["spread"] > 0.25
    public = judge(FIXTURES / "unstable_timing", tiny_model, tmp_path, official=False, samples=3)
    assert codes(public) == []


def test_memory_over_the_limit_is_memory_limit(tiny_model, tmp_path):
    """The native engine with 2.5 GiB of ballast under the 2 GiB limit that native alone stays under
    (the full run above): the peak counts the ballast, and the gate fires."""
    report = judge(FIXTURES / "memory_hog", tiny_model, tmp_path, memory_limit_gib=2.0)
    assert codes(report) == ["memory_limit"]
    assert report["results"][0]["engine"]["memory_gated_bytes"] >= 5 * 2**29


def test_load_failure_and_death_are_candidate_errors_and_the_run_goes_on(tiny_model, tmp_path):
    raising = judge(FIXTURES / "load_raises", tiny_model, tmp_path, shapes=((1, 8, 2), (1, 8, 3)))
    assert codes(raising, 0) == ["candidate_error"] and codes(raising, 1) == ["candidate_error"]
    assert "while loading" in detail(raising, "candidate_error") and "cannot load" in detail(raising, "candidate_error")
    dying = judge(FIXTURES / "dies", tiny_model, tmp_path, shapes=((1, 8, 4),))
    assert codes(dying) == ["candidate_error"]
    assert "died" in detail(dying, "candidate_error") and "exit code 7" in detail(dying, "candidate_error")


def test_a_native_side_that_fails_its_own_replay_is_a_judge_problem(native_engine_dir, tiny_model, tmp_path):
    """If the baseline's tokens fail the replay, the verdict is untrustworthy: harness_error, said plainly."""
    report = judge(native_engine_dir, tiny_model, tmp_path, shapes=((1, 16, 4),), native=True,
                   native_dir=FIXTURES / "wrong_token")
    r = report["results"][0]
    assert codes(report) == ["harness_error"]
    assert r["replay"]["sides"]["engine"]["violation_count"] == 0
    assert r["replay"]["sides"]["native"]["violation_count"] == 1
    assert "native failed its own replay" in r["judge_problems"][0]
    assert any("native failed its own replay" in note for note in report["notes"])


@pytest.mark.gpu
def test_gpu_work_left_after_the_last_yield_is_candidate_error(tiny_model, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    report = judge(FIXTURES / "gpu_pending_work", tiny_model, tmp_path, device="cuda")
    assert codes(report) == ["candidate_error"]
    assert "GPU work left running" in detail(report, "candidate_error")
    assert any(p["flagged"] for p in report["results"][0]["engine"]["pending_gpu"])


def test_the_report_carries_the_engines_speculation_figures(tiny_model, tmp_path, monkeypatch):
    """The repository's engine speculating (its deployment variable): each sample and the side's
    summary carry drafted / accepted / verify figures and the per-pass costs; every draft of
    oracle:1 is kept, and the tokens still pass every gate."""
    from engine_modules import ENGINE_DIR

    monkeypatch.setenv("FASTQWEN_SPECULATION", "oracle:1")
    report = judge(ENGINE_DIR, tiny_model, tmp_path, shapes=((2, 16, 9),), samples=2)
    r = report["results"][0]
    assert codes(report) == []
    assert report["engine_switches"] == {"FASTQWEN_SPECULATION": "oracle:1"}
    assert all(s["speculation"]["mode"] == "oracle" for s in r["engine"]["samples"])
    total = r["engine"]["speculation"]
    # 9 tokens: the prompt pass's first, then two verifies of 4 (k = 4: every draft right)
    assert total["verified_rows"] == 2 * 2 * 2 and total["emitted"] == 2 * 2 * 8
    assert total["tokens_per_verify"] == 4.0 and total["acceptance"] == 1.0
    assert total["verify_ms"] > 0 and total["draft_ms"] > 0
