"""The measurement harness (bench/) on the CPU: the runner's header, timing and JSON, the CLI's
registry and argument errors, and every entry end to end on the `tiny` preset with tiny sizes
(times meaningless without a GPU; the code paths are the GPU run's, each kernel arm on its torch
reference)."""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import runner  # noqa: E402
from bench.__main__ import ENTRIES, main  # noqa: E402

TRACKED_KEYS = {"header", "entry", "args", "rows"}
HEADER_KEYS = {"device", "gpu", "sm_count", "memory_bytes", "l2_bytes", "torch", "triton", "cuda", "python",
               "commit", "commit_dirty", "date", "command"}


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory):
    """FASTQWEN_CACHE for this module: `--model tiny` is synthesized there once (resolve_model)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTQWEN_CACHE", str(tmp_path_factory.mktemp("bench_cache")))
        yield


@pytest.fixture
def one_thread(monkeypatch):
    """One intra-op thread here and in child processes: on a machine whose cores other work shares,
    a tiny model's products spend far longer waiting on their second thread than computing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def run_entry(argv: list[str], tmp_path, capsys) -> dict:
    """main(argv + --out) must succeed; returns the JSON it wrote."""
    out = tmp_path / "result.json"
    code = main([*argv, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc) == TRACKED_KEYS
    assert doc["entry"] == argv[0]
    assert doc["header"]["command"].startswith(f"python -m bench {argv[0]}")
    return doc


def engine_params() -> set:
    return set(inspect.signature(runner.import_engine().Engine).parameters)


# ---------------------------------------------------------------- the runner

def test_header_names_device_versions_commit_date_and_command():
    h = runner.header(["step", "--batches", "1"])
    assert set(h) == HEADER_KEYS
    assert h["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert h["torch"] == torch.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", h["date"])
    assert h["command"] == "python -m bench step --batches 1"
    if (runner.REPO / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", h["commit"]), h["commit"]


def test_commit_is_the_environments_stamp_first_then_git_then_the_stamp_file(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "REPO", tmp_path)          # a tree with no .git, as on the GPU machine
    monkeypatch.delenv("FASTQWEN_COMMIT", raising=False)
    assert runner.commit() == (None, None)
    (tmp_path / ".commit").write_text("0123abc\n")
    assert runner.commit() == ("0123abc", None)
    # a repository's HEAD wins over a stale .commit, with whether tracked files differ from it
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("a")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-qm", "f"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert runner.commit() == (head, False)
    (tmp_path / "f.txt").write_text("b")
    assert runner.commit() == (head, True)
    # the GPU script's stamp wins over a stale .git or .commit in the copied tree
    monkeypatch.setenv("FASTQWEN_COMMIT", "from-env")
    assert runner.commit() == ("from-env", None)


def test_report_writes_one_json_of_header_entry_args_rows_and_a_table(tmp_path, capsys):
    import argparse

    args = argparse.Namespace(out=tmp_path / "r.json", batches=[1, 2], _private=1)
    report = runner.Report("step", args, ["step"], [runner.Column("batch"), runner.Column("us", fmt="{:.1f}")],
                           args.out)
    report.add({"batch": 1, "us": 12.34})
    doc = json.loads(args.out.read_text())       # rewritten after every row
    assert set(doc) == TRACKED_KEYS and doc["entry"] == "step"
    assert doc["args"] == {"batches": [1, 2]}     # --out and private names are not arguments of the run
    assert doc["rows"] == [{"batch": 1, "us": 12.34}]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ") and lines[1].split() == ["batch", "us"] and lines[2].split() == ["1", "12.3"]


def test_timing_routines_call_the_work_and_return_microseconds():
    calls = []
    us = runner.time_graph(lambda x: calls.append(x), [1, 2, 3], reps=2)
    assert us >= 0 and calls[-3:] == [1, 2, 3]
    assert runner.time_eager(lambda: calls.append("e"), reps=2, warmup=1) >= 0 and calls.count("e") == 3


def test_an_engine_option_the_constructor_lacks_is_an_error(monkeypatch):
    class Engine:
        def __init__(self, model_path):
            pass

    monkeypatch.setattr(runner, "import_engine", lambda: type("module", (), {"Engine": Engine}))
    with pytest.raises(runner.BenchError, match="takes no exact_decode"):
        runner.build_engine("unused", {"exact_decode": False})
    assert isinstance(runner.build_engine("unused", {}), Engine)


# ---------------------------------------------------------------- the CLI

def test_list_names_every_registered_entry(capsys):
    assert main(["--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == list(ENTRIES)
    assert {"gemv", "attention", "gdn", "lm-screen", "step", "prefill", "memory", "serve", "fidelity"} <= set(names)


def test_every_entry_has_the_registry_interface():
    import importlib

    for name, (module_name, _) in ENTRIES.items():
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), name
        assert all(isinstance(c, runner.Column) for c in module.COLUMNS), name


def test_no_entry_is_an_error(capsys):
    assert main([]) == 2
    assert "name an entry" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["nope"], "invalid choice"),
    (["gdn", "--shapes", "1x0"], "BATCHxTOKENS"),
    (["gdn", "--fla", "maybe"], "expected on or off"),
    (["fidelity", "--swaps", "norms,nope"], "unknown op or group 'nope'"),
    (["fidelity", "--swaps", "products+rmsnorm"], "unknown op or group 'rmsnorm'"),
    (["fidelity", "--tokens", "mine"], "invalid choice"),
    (["fidelity", "--steps", "0"], "positive integer"),
    (["step", "--batches", "0"], "positive integer"),
    (["step", "--batches", "one"], "positive integer"),
    (["step", "--exact-decode", "maybe"], "expected on or off"),
    (["step", "--model", "/no/such/folder"], "neither a checkpoint folder"),
    (["memory", "--shapes", "1x512"], "BATCHxPROMPTxOUTPUT"),
    (["prefill", "--shapes", "1x0"], "BATCHxPROMPT"),
    (["gemv", "--shape", "12"], "NxK"),
    (["gemv", "--ops", "nope"], "unknown op"),
    (["gemv", "--config", "block_n"], "not name=value"),
    (["attention", "--contexts", "-1"], "positive integer"),
    (["gdn-rows", "--starts", "0,64"], "chunk rows 0-63"),
    (["gdn-rows", "--rows", "0"], "positive integer"),
])
def test_argument_errors_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_gemv_config_is_an_error_before_any_measurement(capsys):
    assert main(["gemv", "--shape", "64x128", "--config", "block_n=3,block_k=128"]) == 2
    assert "--config" in capsys.readouterr().err


def test_serve_rejects_a_prompt_longer_than_the_server_holds(capsys):
    assert main(["serve", "--model", "tiny", "--prompt-len", "2000", "--output-len", "100"]) == 2
    assert "exceeds --max-model-len" in capsys.readouterr().err


# ---------------------------------------------------------------- every entry on the CPU

def test_gemv_times_cublas_and_the_kernel_arm_and_suggests_a_config(tmp_path, capsys):
    doc = run_entry(["gemv", "--shape", "64x128", "--shape", "64x128:silu", "--rows", "1,2", "--calls", "2",
                     "--reps", "1"], tmp_path, capsys)
    measured = [r for r in doc["rows"] if r["kind"] == "measure"]
    assert {(r["op"], r["rows"], r["impl"]) for r in measured} == {
        (op, m, impl) for op in ("64x128", "64x128:silu") for m in (1, 2)
        for impl in ("cublas", "gemv" if torch.cuda.is_available() else "reference")}
    assert all(r["error"] is None and r["us"] > 0 for r in measured)
    assert {r["op"] for r in doc["rows"] if r["kind"] == "suggested"} == {"64x128", "64x128:silu"}


def test_attention_times_both_arms_and_they_agree(tmp_path, capsys):
    doc = run_entry(["attention", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--batches", "1,2",
                     "--contexts", "16", "--reps", "1"], tmp_path, capsys)
    assert [(r["batch"], r["context"]) for r in doc["rows"]] == [(1, 16), (2, 16)]
    assert all(r["kernel_us"] > 0 and r["sdpa_us"] > 0 and r["max_abs_diff"] < 0.05 for r in doc["rows"])


def test_step_times_each_batch_with_the_options_given(tmp_path, capsys, bench_cache, monkeypatch):
    import bench.step

    argv = ["step", "--model", "tiny", "--batches", "1,2", "--prompt", "8", "--steps", "2", "--warmup", "1",
            "--rounds", "1", "--no-lm-screen"]
    # the engine options where this engine's constructor takes them (build_engine refuses the others)
    params = engine_params()
    options = {name: False for name in ("graphs", "exact_decode") if name in params}
    argv += [arg for name in options for arg in (f"--{name.replace('_', '-')}", "off")]
    built = []

    def spy(model_dir, opts):
        eng = runner.build_engine(model_dir, opts)
        eng.model.screen = object()      # a screen that breaks any step taken before --no-lm-screen drops it
        built.append(opts)
        return eng

    monkeypatch.setattr(bench.step, "build_engine", spy)
    doc = run_entry(argv, tmp_path, capsys)
    assert built == [options]
    assert [r["batch"] for r in doc["rows"]] == [1, 2]
    assert all(r["step_us"] > 0 and r["lm_screen"] is False and len(r["tokens"]) == 12 for r in doc["rows"])


def test_prefill_groups_device_time_by_kernel_for_both_phases(tmp_path, capsys, bench_cache):
    doc = run_entry(["prefill", "--model", "tiny", "--shapes", "1x8", "--steps", "2", "--top", "3"], tmp_path, capsys)
    totals = [r for r in doc["rows"] if r["kernel"] == "(all kernels)"]
    assert [r["phase"] for r in totals] == ["decode_step", "prefill"]
    assert all(r["us"] > 0 for r in totals)
    assert sum(r["phase"] == "prefill" and r["kernel"] != "(all kernels)" for r in doc["rows"]) == 3


def test_prefill_profiles_a_verify_of_each_width_asked(tmp_path, capsys, bench_cache):
    doc = run_entry(["prefill", "--model", "tiny", "--shapes", "2x8", "--steps", "2", "--top", "3", "--verify", "1,3"],
                    tmp_path, capsys)
    totals = {r["phase"]: r for r in doc["rows"] if r["kernel"] == "(all kernels)"}
    assert list(totals) == ["decode_step", "verify_1", "verify_3", "prefill"]
    assert all(r["us"] > 0 for r in totals.values())


def test_lm_screen_picks_equal_the_full_argmax(tmp_path, capsys, bench_cache):
    doc = run_entry(["lm-screen", "--model", "tiny", "--prompt", "8", "--steps", "3", "--prompts", "1",
                     "--reps", "1"], tmp_path, capsys)
    screened = [r for r in doc["rows"] if r.get("states")]
    assert screened and all(r["states"] == 3 and r["mismatches"] == 0 and r["cand_min"] >= 1 for r in screened)
    assert doc["rows"][0]["arm"] == "gemv+argmax"


def test_memory_runs_each_shape_in_a_fresh_process(tmp_path, capsys, bench_cache, monkeypatch):
    from bench import memory

    children, real_run = [], memory.subprocess.run

    def run(cmd, **kwargs):                       # subprocess's own: git's calls pass through too
        if "--child" in cmd:
            children.append(cmd[cmd.index("--child") + 1])
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(memory.subprocess, "run", run)
    doc = run_entry(["memory", "--model", "tiny", "--shapes", "1x8x2,2x8x2"], tmp_path, capsys)
    assert children == ["1x8x2", "2x8x2"]               # a child process a shape
    assert [row["shape"] for row in doc["rows"]] == children
    for row in doc["rows"]:
        assert "error" not in row, row.get("error")
        assert row["peak_GiB"] > 0 and row["cache_GiB"] > 0
        assert row["bar_GiB"] == pytest.approx(row["weights_GiB"] + row["cache_GiB"] + 3.0)


def test_serve_loads_the_server_beside_generate(tmp_path, capsys, bench_cache):
    doc = run_entry(["serve", "--model", "tiny", "--streams", "1,2", "--waves", "1", "--prompt-len", "8",
                     "--output-len", "3", "--engine-reps", "1"], tmp_path, capsys)
    assert [(r["kind"], r.get("streams")) for r in doc["rows"]] == [
        ("engine", 1), ("engine", 2), ("ready", None), ("server", 1), ("server", 2)]
    server = [r for r in doc["rows"] if r["kind"] == "server"]
    assert all(r["bench_serve"]["completed"] == r["requests"] and r["failed"] == 0 for r in server), server
    assert all(r["output_tok_s"] > 0 for r in doc["rows"] if r["kind"] != "ready")
    [ready] = [r for r in doc["rows"] if r["kind"] == "ready"]
    assert ready["ready_s"] > 0 and ready["slots"] == 2
    # the peak is the server's own gauge: never more requests at once than streams or slots
    assert all(1 <= r["running_peak"] <= min(r["streams"], 2) for r in server), server


def test_serve_passes_speculation_to_the_server_and_reads_its_counts(tmp_path, capsys, bench_cache):
    doc = run_entry(["serve", "--model", "tiny", "--no-engine", "--streams", "1", "--waves", "1", "--prompt-len", "8",
                     "--output-len", "6", "--speculation", "ngram"], tmp_path, capsys)
    [server] = [r for r in doc["rows"] if r["kind"] == "server"]
    assert server["failed"] == 0 and server["spec_draft_tokens"] > 0      # greedy load: verify steps ran
    assert 0 <= server["spec_accepted_tokens"] <= server["spec_draft_tokens"]


def test_serve_with_a_slot_cap_below_the_streams_queues_the_rest(tmp_path, capsys, bench_cache):
    doc = run_entry(["serve", "--model", "tiny", "--no-engine", "--streams", "4", "--max-batch", "2", "--waves", "1",
                     "--prompt-len", "8", "--output-len", "3"], tmp_path, capsys)
    ready, server = doc["rows"]
    assert ready["slots"] == 2
    assert server["bench_serve"]["completed"] == 4 and server["failed"] == 0
    assert server["running_peak"] == 2


def test_startup_times_a_cold_then_a_warm_server_start(tmp_path, capsys, bench_cache):
    doc = run_entry(["startup", "--model", "tiny", "--max-model-len", "64", "--max-batch", "2"], tmp_path, capsys)
    assert [r["start"] for r in doc["rows"]] == ["cold", "warm"]
    assert all("error" not in r and 0 < r["server_s"] < r["ready_s"] and r["slots"] == 2 for r in doc["rows"])
    assert all(r["precompile"] is None for r in doc["rows"])        # no GPU: nothing to precompile
    assert all(r["compiled"] == [] and r["kernels_compiled"] == 0 for r in doc["rows"])    # nor anything compiled


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing")
def test_startup_image_build_fills_a_fresh_cache_without_a_gpu_then_starts_on_it(tmp_path, capsys, bench_cache):
    """--image-build: scripts/precompile.py with no GPU visible (--target sm_90) fills a cache and
    stamps it, then a server starts on that cache (here, without a GPU, it compiles nothing)."""
    doc = run_entry(["startup", "--model", "tiny", "--max-model-len", "64", "--max-batch", "2", "--warm-starts", "1",
                     "--image-build"], tmp_path, capsys)
    image = doc["rows"][-1]
    assert image["start"] == "image" and "error" not in image and image["slots"] == 2, image
    assert image["build_s"] > 0 and any(line.startswith("stamp ") for line in image["build"])
    assert any(line.startswith("compiled ") and "/" in line for line in image["build"])


def test_startup_lists_the_kernels_a_start_compiled_in_time_order(tmp_path):
    """The cubins a start added to the cache (not those it found), seconds after its launch, in time order."""
    import os

    from bench.startup import compiled_since

    cache = tmp_path / "triton"
    (cache / "a").mkdir(parents=True)
    old = cache / "a" / "_found_kernel.cubin"
    old.write_bytes(b"x")
    before = set(cache.rglob("*.cubin"))
    for folder, name, t in (("b", "_late_kernel", 30.0), ("c", "_early_kernel", 5.0), ("d", "_early_kernel", 6.5)):
        (cache / folder).mkdir()
        path = cache / folder / f"{name}.cubin"
        path.write_bytes(b"x")
        (cache / folder / f"{name}.json").write_text("{}")
        os.utime(path, (1000.0 + t, 1000.0 + t))
    assert compiled_since(cache, before, 1000.0) == [[5.0, "_early_kernel"], [6.5, "_early_kernel"],
                                                     [30.0, "_late_kernel"]]


# ---------------------------------------------------------------- gdn: plans and the best one

def gdn_prefill_module():
    runner.engine_on_path()
    from fqkernels import gdn_prefill

    return gdn_prefill


def test_a_bad_gdn_plan_is_an_error_before_any_measurement(capsys):
    assert main(["gdn", "--shapes", "1x64", "--plan", "warps=4"]) == 2
    assert "--plan 'warps=4'" in capsys.readouterr().err


def test_every_candidate_plan_reads_back_from_its_text():
    """A row's plan text is what gdn_prefill.plan_from_text reads (the plain plan: ""), for the
    default, a --plan and every SWEEP candidate; equal plans are timed once."""
    from bench import gdn

    gp = gdn_prefill_module()
    plans = gdn.candidate_plans(gp, ["block_v=16,state_stages=1", "block_v=16, state_stages=1"], sweep=True)
    assert plans[0] == ("default", gp.DEFAULT_PLAN)
    assert [p for _, p in plans].count(gp.PrefillPlan(block_v=16, state_stages=1)) == 1
    assert len({p for _, p in plans}) == len(plans)
    for name, plan in plans:
        assert gp.plan_from_text(gdn.plan_text(plan)) == plan, name
    assert gdn.plan_text(gp.PrefillPlan()) == ""


def _sweep_row(name, us, state=1e-6, out=1e-3, B=1, T=512, precision_change=False, error=None):
    return {"arm": "ours", "plan_name": name, "plan": f"text-of-{name}", "batch": B, "tokens": T, "us": us,
            "state_err": state, "out_err": out, "precision_change": precision_change, "error": error}


def test_the_best_plan_is_the_fastest_within_the_gates_at_every_shape_and_never_a_precision_change():
    """bench.gdn.best_plan over a sweep's rows: a plan outside the state or the output gate at
    any shape, one missing a shape or failing at one, and one that changes the precision (unless
    named) are passed over, however fast; the reference's and fla's rows are not plans."""
    from bench.gdn import OUT_GATE, STATE_GATE, best_plan

    rows = [{"arm": "reference", "batch": 1, "tokens": 512, "us": 0.1},
            {"arm": "fla", "batch": 1, "tokens": 512, "us": 0.1, "state_err": 0.0, "out_err": 0.0}]
    for B in (1, 4):
        rows += [_sweep_row("default", 3.0, B=B), _sweep_row("bv16", 2.0, B=B),
                 _sweep_row("out_w8", 1.0, B=B, out=2 * OUT_GATE if B == 4 else 1e-3),   # outside at one shape
                 _sweep_row("state_s1", 1.0, B=B, state=2 * STATE_GATE if B == 1 else 1e-6),
                 _sweep_row("bf16x2", 0.5, B=B, precision_change=True),       # within the gates, another precision
                 _sweep_row("caps", 0.7, B=B, error="OutOfResources: shared memory" if B == 4 else None)]
    rows.append(_sweep_row("w2", 0.1, B=1))                                     # ran at one shape of two
    assert best_plan(rows) == "text-of-bv16"
    # named candidates: a precision change among them may win (the caller decided on precision) ...
    assert best_plan(rows, among=["default", "bf16x2"]) == "text-of-bf16x2"
    assert best_plan(rows, among=["default", "text-of-bf16x2"]) == "text-of-bf16x2"
    # ... but not one outside the gates; and no candidate at all is None, not a default
    assert best_plan(rows, among=["out_w8", "state_s1", "caps", "w2"]) is None
    no_ref = [dict(r, state_err=None) if r.get("plan_name") == "bv16" and r["batch"] == 4 else r for r in rows]
    assert best_plan(no_ref) == "text-of-default"          # an error not measured is not within the gate


def test_gdn_times_the_reference_ours_per_plan_and_fla_and_picks_a_plan(tmp_path, capsys, one_thread):
    """On the CPU the ours arm is the reference (zero errors) and fla is not run, each said in its
    row; every plan of the sweep is a row at every shape, then a "best" row whose plan reads back."""
    from bench.gdn import SWEEP

    gp = gdn_prefill_module()
    doc = run_entry(["gdn", "--shapes", "2x80", "--key-heads", "1", "--value-heads", "2", "--head-dim", "64",
                     "--reps", "1", "--ref-reps", "1", "--sweep"], tmp_path, capsys)
    measured = [r for r in doc["rows"] if r["kind"] == "measure"]
    assert [r["arm"] for r in measured[:2]] == ["reference", "fla"]
    ours = [r for r in measured if r["arm"] == "ours"]
    assert ours[0]["plan_name"] == "default" and {r["plan_name"] for r in ours} >= set(SWEEP) - {"plain", "fast"}
    assert all(r.get("error") is None and r["us"] > 0 and r["kernels_us"] > 0 for r in ours)
    if torch.cuda.is_available():
        assert all(r["state_err"] <= 2e-5 and r["out_err"] <= 5e-3 for r in ours if not r["precision_change"])
    else:
        assert all(r["impl"] == "reference" and r["state_err"] == 0.0 and r["out_err"] == 0.0 for r in ours)
        assert measured[1]["error"] == "not run: no GPU"
    [best] = [r for r in doc["rows"] if r["kind"] == "best"]
    picked = next(r for r in ours if r["plan"] == best["plan"])
    assert not picked["precision_change"] and best["plan_name"] == picked["plan_name"]
    assert gp.plan_from_text(best["plan"]) in {gp.plan_from_text(r["plan"]) for r in ours}


# ---------------------------------------------------------------- fidelity

def test_a_swap_takes_the_donors_methods_and_its_tied_ops_and_nothing_else():
    """bench.fidelity.swapped_ops over the engine's op sets: the named ops are TorchOps's, exact
    decode's step brings the chunk rows' form with it, every other op stays the Triton set's, a
    swapped op calls the variant's other ops, no variant builds an LM-head screen, and an op the
    sets lack is an error naming it."""
    from bench.fidelity import GROUPS, expand, swapped_ops

    runner.engine_on_path()
    from fq_ops import TorchOps, TritonOps

    assert expand("gdn_exact_step") == ("gdn_exact_step", "gdn_chunk_rows", "gdn_rows_bytes")
    assert expand("norms+argmax") == ("embed_rmsnorm", "add_rmsnorm", "argmax")
    assert set(expand("all")) == {op for group, ops in GROUPS.items() for op in ops}
    cls = swapped_ops(TritonOps, TorchOps, expand("gdn_exact_step"))
    assert issubclass(cls, TritonOps)
    assert cls.gdn_exact_step is TorchOps.gdn_exact_step and cls.gdn_chunk_rows is TorchOps.gdn_chunk_rows
    assert cls.linear is TritonOps.linear and cls.chunked_rule is TritonOps.chunked_rule
    assert cls.lm_screen(object(), "weights") is None
    with pytest.raises(runner.BenchError, match="no op 'nope'"):
        swapped_ops(TritonOps, TorchOps, ("nope",))

    class Base:
        def inner(self):
            return "base"

        def outer(self):
            return "base outer"

    class Donor(Base):
        def inner(self):
            return "donor"

        def outer(self):
            return "donor outer of " + self.inner()

    assert swapped_ops(Base, Donor, ("outer",))().outer() == "donor outer of base"


def test_figures_follow_the_judges_slack():
    """slack = the full forward's max minus its logit of the pick; counted over 0.75 and over the
    2.0 margin (strictly, as the judge counts), with max |diff| per position and the agreements."""
    from bench.fidelity import figures

    full = torch.zeros(1, 3, 4)
    full[0, :, 0] = torch.tensor([5.0, 5.0, 5.0])
    full[0, 1, 1], full[0, 2, 2] = 4.0, 2.5              # slack 1.0 at position 1, 2.5 at position 2
    logits = full.clone()
    logits[0, 1, 3] = 0.5                                # max |diff| 0.5 at position 1
    picks = torch.tensor([[0, 1, 2]])
    tokens = torch.tensor([[0, 1]])
    f = figures(logits, picks, full, tokens, base=full)
    assert (f["positions"], f["count_gt_0_75"], f["count_gt_2_0"], f["max_slack"]) == (3, 2, 1, 2.5)
    assert (f["argmax_agree"], f["token_agree"], f["max_abs"], f["max_abs_vs_base"]) == (1, 2, 0.5, 0.5)
    assert f["prefill_mean_max_abs"] == 0.0 and f["decode_mean_max_abs"] == 0.25


def _fidelity_rows(doc):
    [setup] = [r for r in doc["rows"] if r["kind"] == "setup"]
    return setup, {r["variant"]: r for r in doc["rows"] if r["kind"] == "variant"}


def test_fidelity_on_qwen3_against_native_run_in_its_own_process(tmp_path, capsys, bench_cache, one_thread):
    """Native's tokens and full forward from a child process on Transformers 4.51.3; every variant
    is a row over the same B x (steps + 1) positions, near the full forward; without a GPU every
    swap is the torch op it replaces, so its logits are base's."""
    import os

    from bench.fidelity import FAMILY_SWAPS

    doc = run_entry(["fidelity", "--model", "tiny", "--batch", "2", "--prompt", "12", "--steps", "3"],
                    tmp_path, capsys)
    setup, rows = _fidelity_rows(doc)
    assert setup["family"] == "qwen3" and setup["reference_transformers"] == "4.51.3"
    assert setup["reference_pid"] != os.getpid() and setup["positions"] == 2 * 4
    assert list(rows) == ["native_cached", "base", "exact_decode=off"] + [f"swap:{s}" for s in FAMILY_SWAPS["qwen3"]]
    assert all(r["positions"] == 8 and r["max_abs"] < 0.5 and r["count_gt_2_0"] == 0 for r in rows.values())
    assert rows["native_cached"]["token_agree"] == 2 * 3                  # native's own greedy tokens
    assert rows["swap:norms"]["swapped"] == ["embed_rmsnorm", "add_rmsnorm"]
    if not setup["swaps_change_ops"]:
        assert setup["base_ops"] == "TorchOps"
        assert all(r["max_abs_vs_base"] == 0.0 for name, r in rows.items() if name.startswith("swap:"))


def test_fidelity_on_qwen35_teacher_forced_on_the_engines_tokens(tmp_path, capsys, bench_cache, one_thread):
    """The Qwen3.5 reference runs on Transformers 5.17.0 (its own environment); forced on the
    engine's own greedy tokens, base picks every one of them again (the self-check); a swap of
    GDN ops by name runs on the same code path."""
    doc = run_entry(["fidelity", "--model", "qwen3.5-tiny", "--batch", "2", "--prompt", "64", "--steps", "3",
                     "--tokens", "engine", "--swaps", "gdn_prompt+gdn_step"], tmp_path, capsys)
    setup, rows = _fidelity_rows(doc)
    assert setup["family"] == "qwen3.5" and setup["reference_transformers"] == "5.17.0"
    assert list(rows) == ["native_cached", "base", "exact_decode=off", "swap:gdn_prompt+gdn_step"]
    assert rows["base"]["token_agree"] == 2 * 3 and rows["base"]["exact_decode"] is True
    assert rows["exact_decode=off"]["exact_decode"] is False
    assert "gdn_chunk_rows" in rows["swap:gdn_prompt+gdn_step"]["swapped"]
    assert all(r["positions"] == 2 * 4 and r["max_abs"] < 0.5 for r in rows.values())


def test_spec_times_each_arm_beside_plain_and_the_tokens_agree(tmp_path, capsys, bench_cache):
    doc = run_entry(["spec", "--model", "tiny", "--batches", "2", "--prompt", "8", "--steps", "9", "--reps", "1",
                     "--k", "3,2", "--arms", "ngram,oracle:1"], tmp_path, capsys)
    assert [(r["arm"], r["k"]) for r in doc["rows"]] == [("plain", 0), ("ngram", 3), ("ngram", 2), ("oracle:1", 3),
                                                         ("oracle:1", 2)]
    assert all(r["same_tokens"] and r["tok_s"] > 0 for r in doc["rows"])
    # each arm's ratio is to the plain calls paired with its own
    assert all(r["vs_plain"] == pytest.approx(r["tok_s"] / r["plain_tok_s"]) for r in doc["rows"][1:])
    for oracle, k in zip(doc["rows"][3:], (3, 2)):
        assert oracle["acceptance"] == 1.0 and oracle["stats"]["record_s"] == 0.0
        assert oracle["verify_ms"] > 0 and oracle["plain_steps"] == 0 and set(oracle["stats"]["width_steps"]) == {str(k)}


def test_spec_runs_shapes_of_their_own_and_auto(tmp_path, capsys, bench_cache):
    doc = run_entry(["spec", "--model", "tiny", "--shapes", "1x8x6,2x5x4", "--reps", "1", "--arms", "auto"],
                    tmp_path, capsys)
    assert [(r["batch"], r["prompt"], r["steps"], r["arm"]) for r in doc["rows"]] == [
        (1, 8, 6, "plain"), (1, 8, 6, "auto"), (2, 5, 4, "plain"), (2, 5, 4, "auto")]
    assert all(r["same_tokens"] for r in doc["rows"])
    auto = doc["rows"][1]["stats"]
    # auto's choices follow this machine's timings; each kind of step that ran has its time
    assert auto["plain_steps"] + auto["verify_steps"] >= 1
    assert (auto["plain_ms"] is not None) == (auto["plain_steps"] > 0)


def test_spec_profile_puts_each_part_of_a_qwen35_cycle_in_its_own_row(tmp_path, capsys, bench_cache):
    """--profile on the MTP head's checkpoint: every part of a cycle holds time, the head's chained
    drafts and its pass over the verified rows among them, and the plain row has its step's."""
    doc = run_entry(["spec", "--model", "qwen3.5-tiny", "--shapes", "1x12x8", "--reps", "1", "--k", "3",
                     "--arms", "mtp", "--profile", "2", "--top", "3"], tmp_path, capsys)
    row = doc["rows"][1]
    assert row["arm"] == "mtp" and row["same_tokens"]
    prof = row["profile"]
    parts = {p["part"]: p for p in prof["parts"]}
    assert {"draft", "draft.head", "verify", "verify.target", "verify.lm_head", "verify.rollback",
            "verify.drafter"} <= set(parts), sorted(parts)
    assert all(p["us"] > 0 and p["calls"] > 0 and 0 < len(p["kernels"]) <= 3 for p in parts.values())
    # k = 3: the head chains 2 drafts a cycle, each the same ops
    assert parts["draft.head"]["calls"] % 2 == 0
    assert prof["kernels_us"] == pytest.approx(sum(p["us"] for p in parts.values()))
    # the plain step of the same build, for the verify's rows to be read against
    plain = doc["rows"][0]
    assert plain["arm"] == "plain" and [p["part"] for p in plain["profile"]["parts"]] == ["step"]
    assert plain["profile"]["cycles"] == 2 and plain["profile"]["parts"][0]["us"] > 0


def test_spec_profile_leaves_the_engine_as_it_was(bench_cache):
    """profile_cycle labels the engine's methods only while it profiles: afterwards none is an
    instance attribute, and the next call's tokens are the ones before it."""
    from bench.runner import build_engine, resolve_model
    from bench.spec import PARTS, profile_cycle

    eng = build_engine(resolve_model("qwen3.5-tiny"), {"speculation": "mtp", "speculative_tokens": 3})
    prompts = torch.randint(0, eng.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3)).tolist()
    before = list(eng.generate(prompts, 8))
    prof = profile_cycle(eng, 3, 1, 2, eng.spec_stats())
    assert {p["part"] for p in prof["parts"]} >= {"draft.head", "verify.target"}
    for obj in (eng.model, eng._spec.drafter):
        assert not {method for _, method, _ in PARTS} & set(vars(obj)), type(obj).__name__
    assert list(eng.generate(prompts, 8)) == before


def test_spec_profile_credits_a_kernel_to_the_innermost_part():
    """part_times on a GPU's events: a kernel belongs to the innermost labelled range whose span
    holds its start, whatever operator (if any) the profiler linked it to; kernels outside every
    range are "(unlabelled)"; the ranges' own device-side annotations are no kernels."""
    from collections import namedtuple

    from bench.spec import part_times

    Span = namedtuple("Span", "start end")
    Kind = namedtuple("Kind", "name")

    class Ev:
        def __init__(self, name, start, end, device="CPU", annotation=False):
            self.name, self.time_range = name, Span(start, end)
            self.device_type, self.is_user_annotation = Kind(device), annotation

    def kernel(name, start, us):
        return Ev(name, start, start + us, "CUDA")

    events = [Ev("verify", 0, 100), Ev("verify.target", 10, 50), Ev("aten::mm", 12, 14),
              Ev("verify.target", 0, 60, "CUDA", annotation=True),      # the range's GPU-side copy
              kernel("cat", 2, 1.0), kernel("gemv", 20, 5.0), kernel("gdn_rows", 30, 3.0),
              kernel("gemv", 40, 5.0), kernel("argmax", 70, 2.0), kernel("add", 150, 4.0)]
    parts = part_times(events, gpu=True)
    assert {k: dict(v) for k, v in parts.items()} == {
        "verify": {"cat": [1.0, 1], "argmax": [2.0, 1]},
        "verify.target": {"gemv": [10.0, 2], "gdn_rows": [3.0, 1]},
        "(unlabelled)": {"add": [4.0, 1]}}


def test_the_gpu_kernels_stage_runs_every_gpu_test_file():
    """bench/gpu.sh's kernels stage lists its pytest groups by file: a GPU test file missing from
    them would never run on the GPU. The GPU files: every kernel test file and every other file
    with a test marked gpu."""
    root = REPO
    script = (root / "bench" / "gpu.sh").read_text()
    stage = script[script.index("kernels() {"):script.index("main() {")]
    named = set(re.findall(r"tests/[\w/]+\.py", stage))
    files = {str(p.relative_to(root)) for p in (root / "tests" / "kernels").glob("test_*.py")}
    files |= {str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py")
              if re.search(r"^(@pytest\.mark\.gpu|pytestmark = .*pytest\.mark\.gpu)", p.read_text(), re.M)}
    assert {"tests/test_engine_gpu.py", "tests/test_judge.py", "tests/test_synth.py"} <= files
    assert files - named == set(), sorted(files - named)
    assert named - files == set(), sorted(named - files)


def test_every_test_that_needs_a_gpu_is_marked_gpu():
    """The kernels stage selects `-m gpu`: a test skipped without a GPU (needs_gpu, or a skipif on
    torch.cuda.is_available()) but not marked gpu, in a file without a module-wide gpu mark, would
    run nowhere."""
    unmarked = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        source = path.read_text()
        if re.search(r"^pytestmark = .*pytest\.mark\.gpu", source, re.M):
            continue
        for block in re.findall(r"((?:^@.*\n(?:^ .*\n)*)+)^def (test_\w+)", source, re.M):
            decorators, name = block
            needs = "needs_gpu" in decorators or re.search(r"skipif\(\s*not torch\.cuda\.is_available", decorators)
            if needs and "pytest.mark.gpu" not in decorators:
                unmarked.append(f"{path.relative_to(REPO)}::{name}")
    assert unmarked == []


def test_gemv_shared_lists_each_fma_products_row_tiles_with_the_engines_pick_first(tmp_path, capsys):
    """--shared: per fma product and row count, the engine's shared tile first, then block_m 1, 2, 4 (no
    wider than the rows need) at the config's columns and each halving down to 2; a product whose
    one-row config is not fma has none. On the CPU nothing is timed: every row says so."""
    doc = run_entry(["gemv", "--shared", "--ops", "qkv", "o", "--shape", "64x128", "--rows", "2,5", "--calls", "2"],
                    tmp_path, capsys)
    rows = [r for r in doc["rows"] if r["kind"] == "shared"]
    qkv2 = [r["config"] for r in rows if r["op"] == "qkv" and r["rows"] == 2]
    assert [(c["block_m"], c["block_n"]) for c in qkv2] == [(2, 4), (1, 8), (2, 8), (1, 4), (1, 2), (2, 2)]
    assert rows[0]["engine"] and not any(r["engine"] for r in rows if r["config"] != rows[0]["config"] and
                                         r["op"] == "qkv" and r["rows"] == 2)
    qkv5 = [(c["block_m"], c["block_n"]) for c in (r["config"] for r in rows if r["op"] == "qkv" and r["rows"] == 5)]
    assert qkv5[0] == (2, 4) and set(qkv5) == {(m, n) for m in (1, 2, 4) for n in (8, 4, 2)} and len(qkv5) == 9
    assert {r["op"] for r in rows} == {"qkv", "o"}          # 64x128 has a tensor-core one-row config
    if not torch.cuda.is_available():
        assert all(r["us"] is None and r["error"] == "no GPU: not run" for r in rows)


def test_gemv_sweep_at_one_row_takes_the_tensor_core_tiles_and_modes_filter_it():
    """bench gemv's sweep at one row holds dot_t configs (Qwen3's one sequence runs in that 16-row
    tile) beside fma and dot; --modes keeps only the named modes' sweep configs, the table's first."""
    runner.engine_on_path()
    from fqkernels import gemv

    from bench.gemv import candidate_configs

    every = candidate_configs(gemv, 6144, 2560, False, 1, "around", [], True)
    assert every[0] == gemv.select_config(6144, 2560, False, 1) and {c.mode for c in every} == {"fma", "dot", "dot_t"}
    tensor = candidate_configs(gemv, 6144, 2560, False, 1, "around", [], True, modes=("dot", "dot_t"))
    assert tensor[0] == every[0] and len(tensor) > 8
    assert {c.mode for c in tensor[1:]} == {"dot", "dot_t"} and set(tensor[1:]) <= set(every)
    assert gemv.select_config(6144, 2560, False, 1, one_row_tensor_cores=True) in tensor


# ---------------------------------------------------------------- gdn-rows: the phase stamps

def test_gdn_rows_phase_times_from_fabricated_stamps():
    """Two programs, two rows, stamps a known number of cycles apart: each phase's median over the
    programs of its mean over the rows, each row alone, and the timer's ns a cycle."""
    from bench.gdn_rows import phase_times

    runner.engine_on_path()
    from fqkernels.gdn_exact_step import PHASES

    phases = len(PHASES)
    stamps = torch.zeros((2, 2, phases + 1, 2), dtype=torch.int64)
    for p, (base, widths) in enumerate([(1000, (10, 20, 30, 40)), (5000, (30, 40, 50, 60))]):
        t = base
        for r in range(2):
            for i in range(phases + 1):
                stamps[p, r, i] = torch.tensor([t, 2 * t])          # the timer runs at 2 ns a cycle
                if i < phases:
                    t += widths[i] * (r + 1)                        # row 1's phases take twice row 0's
            t += 5                                                  # between rows
    got = phase_times(stamps)
    assert got["ns_per_cycle"] == pytest.approx(2.0)
    # program 0: phase 0 takes 10 and 20 (mean 15); program 1: 30 and 60 (mean 45); median 30
    assert got[PHASES[0]] == pytest.approx(30.0)
    assert got[PHASES[3]] == pytest.approx((60 + 90) / 2)
    assert got["row_0"] == pytest.approx((100 + 180) / 2) and got["row_1"] == pytest.approx((200 + 360) / 2)
    assert got["row"] == pytest.approx((150 + 270) / 2)
    assert sum(got[name] for name in PHASES) == pytest.approx(got["row"])


def test_gdn_rows_without_a_gpu_is_an_error_naming_why(capsys, monkeypatch):
    import bench.gdn_rows as gdn_rows

    monkeypatch.setattr(gdn_rows, "gpu_visible", lambda: False)
    assert main(["gdn-rows"]) == 2
    assert "no GPU is visible" in capsys.readouterr().err
