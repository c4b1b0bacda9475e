"""Qwen3.5 on the GPU, piece by piece, each step reported even when a later one fails:
load on both backends; the prompt pass on each (logit distance triton vs torch); N decode
steps teacher-forced on each (max |logit diff| per step); the triton step captured as a
CUDA graph (tokens equal to its eager steps); then the graphed step's time and the prompt
pass's time (eager, and as a graph, whose first tokens on other prompts must equal the eager
pass's) at a few shapes; with --profile, the device time per kernel of an eager decode step and of a prompt
pass (torch.profiler) at the profiled shapes. One JSON report.

    python scripts/gpu_q35_check.py --model DIR [--shapes 1x512x32,4x2048x32,16x512x128]
        [--profile 1x512,16x512] [--out FILE]
        [--gemv NxK@ROWS:field=value,...]   # an A/B: one GEMV table entry replaced

--arms (timing only) times the graphed decode step at each shape under several settings in one
process, interleaved over --rounds rounds, each arm from a fresh prompt pass (so the exact GDN
step walks the same rows): ARMS below (exact decode on or off, and the knobs under test; those
measured this way in sessions 26-27 were removed as they lost, PERF_LOG). --warm-workers N: N
processes compile the arms' kernels first (one eager step each), in parallel, while this one
loads (each new constexpr of the exact step is a compile of a minute or more).

--gemv (repeatable; --gemv-silu for the fused gate/up table) sets the config of the table
entry for weight shape N x K whose row limit is ROWS (an int, or None: no limit; a limit the
entry lacks becomes a new row range) (fqkernels/gemv.py LINEAR_CONFIGS / SILU_MUL_CONFIGS)
to GemvConfig(field=value, ...) before the model loads.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))

import fq_qwen35  # noqa: E402
from fq_decode import DecodeRunner, PrefillGraph  # noqa: E402
from fqkernels import gdn_exact_step, gemv, pdl  # noqa: E402

from bench_gdn import kernel_table  # noqa: E402
from gpu_check import graphed_step_ms  # noqa: E402

# --arms: name -> the settings it changes from BASE (the defaults): "exact" (exact GDN decode), and
# the knobs: fq_qwen35.STEP_NORM (the gated norm in the exact step's program: "1", "0", "auto"),
# gdn_exact_step.PREFETCH (the step's lines asked of a cache first), fq_qwen35.ATTN_GATE_IN_COMBINE
# (the output gate in the attention's merge), pdl.EARLY (the attention's decode kernels read the
# positions, lengths and RoPE rows before PDL's wait and ask L2 for their first K/V tiles there),
# gdn_exact_step.EARLY (the exact step reads the position before the wait and asks for the chunk's
# rows there; both at up to pdl.EARLY_MAX_ROWS sequences, EARLY_ROWS), gdn_exact_step.MERGED (the merged
# step's schedule, MergedPlan's text, or "auto")
BASE = {"exact": True, "STEP_NORM": "auto", "PREFETCH": "auto", "GATE": fq_qwen35.ATTN_GATE_IN_COMBINE,
        "EARLY": pdl.EARLY, "EARLY_ROWS": pdl.EARLY_MAX_ROWS, "STEP_EARLY": gdn_exact_step.EARLY,
        "MERGED": gdn_exact_step.MERGED_TEXT}
ARMS = {"exact": {}, "exact_norm_in": {"STEP_NORM": "1"}, "exact_norm_apart": {"STEP_NORM": "0"},
        "exact_pf_off": {"PREFETCH": "0"}, "exact_pf_l2": {"PREFETCH": "l2"}, "exact_gate": {"GATE": True},
        "exact_early_attn": {"EARLY": True}, "exact_early_step": {"STEP_EARLY": True},
        "exact_early": {"EARLY": True, "STEP_EARLY": True},
        "exact_early_gate": {"EARLY": True, "STEP_EARLY": True, "GATE": True},
        "exact_ws64": {"MERGED": "ws=64"}, "exact_ws128": {"MERGED": "ws=128"},
        "exact_qslate": {"MERGED": "qs_late=1,ws=64"}, "exact_qslate_k64": {"MERGED": "qs_late=1,keys=64,ws=64"},
        # session 30: the defaults before it (no early reads, the gate apart, the plain schedule), the
        # defaults with the plain schedule at every grid, and the plan at every grid
        "exact_s29": {"EARLY": False, "STEP_EARLY": False, "GATE": False, "MERGED": ""},
        "exact_plain": {"MERGED": ""}, "exact_plan_all": {"MERGED": "qs_late=1,keys=64,ws=64"},
        "exact_early_all": {"EARLY_ROWS": 64}, "exact_no_early": {"EARLY": False, "STEP_EARLY": False},
        "fast": {"exact": False}, "fast_gate": {"exact": False, "GATE": True},
        "fast_early": {"exact": False, "EARLY": True}}


def _settings(model) -> dict:
    return {"exact": model.exact_decode, "STEP_NORM": fq_qwen35.STEP_NORM, "PREFETCH": gdn_exact_step.PREFETCH,
            "GATE": fq_qwen35.ATTN_GATE_IN_COMBINE, "EARLY": pdl.EARLY, "EARLY_ROWS": pdl.EARLY_MAX_ROWS,
            "STEP_EARLY": gdn_exact_step.EARLY,
            "MERGED": gdn_exact_step.MERGED_TEXT}


def _apply(model, settings: dict) -> None:
    model.exact_decode = settings["exact"]
    fq_qwen35.STEP_NORM, gdn_exact_step.PREFETCH = settings["STEP_NORM"], settings["PREFETCH"]
    fq_qwen35.ATTN_GATE_IN_COMBINE = settings["GATE"]
    pdl.EARLY, gdn_exact_step.EARLY = settings["EARLY"], settings["STEP_EARLY"]
    pdl.EARLY_MAX_ROWS = settings["EARLY_ROWS"]
    gdn_exact_step.MERGED_TEXT = settings["MERGED"]
    gdn_exact_step.MERGED = (None if settings["MERGED"] == "auto"
                             else gdn_exact_step.MergedPlan.from_text(settings["MERGED"]))


def _kernel_settings(arm: str) -> tuple:
    """An arm's settings, the ones that pick the decode kernels' compiled forms."""
    return tuple(sorted({**BASE, **ARMS[arm]}.items()))


def _warm_worker(model_path: str, tasks: list) -> list:
    """One process of --warm-workers: the model loaded, then for each (arm, batch, capacity) one eager
    decode step under the arm's settings, so its kernels are compiled into Triton's cache (shared on
    disk) before the timing process launches them. Returns the arms done."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = fq_qwen35.Qwen35Config.from_dir(model_path)
    model = fq_qwen35.Qwen35Model(cfg, fq_qwen35.load_weights(model_path, cfg, dev), dev,
                                  backend="triton" if dev.type == "cuda" else "torch")
    done = []
    for arm, b, capacity in tasks:
        _apply(model, {**BASE, **ARMS[arm]})
        model.ensure_rope(capacity)
        model.allocate_cache(b, capacity)
        pos = torch.full((b,), capacity - 9, dtype=torch.int32, device=dev)
        with torch.inference_mode():
            model.decode_logits(torch.zeros(b, dtype=torch.int64, device=dev), pos, pos + 1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        done.append(arm)
    return done


def _start_warm(model_path: str, shapes: list, arms: list, workers: int):
    """--warm-workers: the arms' distinct kernel settings at each shape, compiled by `workers` processes
    (spawned, each loading the model) while this one loads and runs its own; returns (pool, futures)."""
    import concurrent.futures
    import multiprocessing

    seen, tasks = set(), []
    for b, p, o in shapes:
        for arm in arms:
            key = (_kernel_settings(arm), b, p + max(8, o) + 8)
            if key not in seen:
                seen.add(key)
                tasks.append((arm, b, key[2]))
    workers = max(1, min(workers, len(tasks)))
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    return pool, [pool.submit(_warm_worker, model_path, tasks[i::workers]) for i in range(workers)]


def _time_arms(model, b: int, p: int, steps: int, arms: list[str], rounds: int, dev) -> dict:
    """{arm: {"ms": [one figure a round], "median_ms", "tokens_as": arm}}: the graphed step's time
    under each arm's settings, the arms interleaved round by round, each from its own prompt pass;
    tokens_as: the first arm with the same exact-decode setting whose greedy tokens (first round,
    the steps after the timed ones) are equal to this arm's (itself if none)."""
    ids = torch.randint(0, model.cfg.vocab_size, (b, p), device=dev)
    saved = _settings(model)
    times: dict = {a: [] for a in arms}
    toks: dict = {}
    try:
        for r in range(rounds):
            for arm in arms:
                _apply(model, {**BASE, **ARMS[arm]})
                model.allocate_cache(b, p + steps + 8)
                seen = [] if r == 0 else None
                with torch.inference_mode():
                    times[arm].append(round(graphed_step_ms(model, ids, steps, seen), 4))
                if seen is not None:
                    toks[arm] = torch.stack(seen).cpu()
    finally:
        _apply(model, saved)
    exact = {a: {**BASE, **ARMS[a]}["exact"] for a in arms}
    same = {a: next((o for o in arms if exact[o] == exact[a] and torch.equal(toks[o], toks[a])), a) for a in arms}
    return {a: {"ms": t, "median_ms": sorted(t)[len(t) // 2], "tokens_as": same[a]} for a, t in times.items()}


def _step(report: dict, name: str, fn):
    t0 = time.perf_counter()
    try:
        report[name] = {"ok": True, **(fn() or {})}
    except Exception:  # noqa: BLE001 - every step is reported, the next ones still run
        report[name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
    report[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(name, json.dumps(report[name])[:600], flush=True)
    return report[name]["ok"]


def _warm_ms(fn) -> float:
    """Milliseconds of one call of fn after one warm-up call, the device synchronized around it."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _forced(model, seq, S, N):
    B = seq.shape[0]
    model.ensure_rope(S + N)
    model.allocate_cache(B, S + N)
    with torch.inference_mode():
        out = [model.prefill_logits(seq[:, :S]).float()]
        pos = torch.full((B,), S, dtype=torch.int32, device=seq.device)
        for t in range(S, S + N - 1):
            out.append(model.decode_logits(seq[:, t].contiguous(), pos, pos + 1).float())
            pos += 1
    return torch.stack(out, 1)


def _replace_entry(ap: argparse.ArgumentParser, table: dict, spec: str) -> None:
    """--gemv's NxK@ROWS:field=value,...: the config of table[(N, K)]'s pair whose row limit is ROWS
    (added in order when there is none)."""
    try:
        shape, fields = spec.split(":", 1)
        nk, rows = shape.split("@")
        n, k = (int(x) for x in nk.split("x"))
        kw = {}
        for part in fields.split(","):
            name, value = part.split("=")
            kw[name.strip()] = value.strip() if name.strip() == "mode" else int(value)
        cfg = gemv.GemvConfig(**kw)
    except (ValueError, TypeError) as exc:
        ap.error(f"--gemv {spec!r}: not NxK@ROWS:field=value,... ({exc})")
    entry = table.get((n, k))
    if not isinstance(entry, tuple):
        ap.error(f"--gemv {spec!r}: the table has no row-ranged entry for {n} x {k}")
    limit = None if rows == "None" else int(rows)
    pairs = dict(entry)
    pairs[limit] = cfg          # replaced, or a new row range
    table[(n, k)] = tuple(sorted(pairs.items(), key=lambda p: float("inf") if p[0] is None else p[0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="1x512x32,4x2048x32,16x512x128")
    ap.add_argument("--profile", default="", help="shapes BxP whose decode step and prompt pass are profiled")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "q35_check.json"))
    ap.add_argument("--timing-only", action="store_true",
                    help="only the shapes' timings (no torch model, no teacher-forced or graph checks): an A/B")
    ap.add_argument("--arms", default="", help=f"with --timing-only: arms to time in one process ({', '.join(ARMS)})")
    ap.add_argument("--rounds", type=int, default=3, help="--arms: interleaved rounds")
    ap.add_argument("--warm-workers", type=int, default=0,
                    help="--arms: processes that compile the arms' kernels first, in parallel (each loads the model)")
    ap.add_argument("--gemv", action="append", default=[], metavar="NxK@ROWS:FIELDS",
                    help="replace a GEMV table entry's config (repeatable), e.g. 12352x2560@1:block_n=8,block_k=256,"
                    "mode=fma,block_m=1")
    ap.add_argument("--gemv-silu", action="append", default=[], metavar="NxK@ROWS:FIELDS",
                    help="the same for the fused gate/up (SiLU) table")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if arms and not args.timing_only:
        ap.error("--arms needs --timing-only")
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms: {a!r} is not one of {', '.join(ARMS)}")
    for table, specs in ((gemv.LINEAR_CONFIGS, args.gemv), (gemv.SILU_MUL_CONFIGS, args.gemv_silu)):
        for spec in specs:
            _replace_entry(ap, table, spec)
    gemv.select_config.cache_clear()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = fq_qwen35.Qwen35Config.from_dir(args.model)
    report: dict = {"model": args.model, "torch": torch.__version__}
    models: dict = {}

    def load():
        for backend in (("triton",) if args.timing_only else ("torch", "triton")):
            w = fq_qwen35.load_weights(args.model, cfg, dev)
            models[backend] = fq_qwen35.Qwen35Model(cfg, w, dev, backend=backend)
        return {"allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}

    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    warm = _start_warm(args.model, shapes, arms, args.warm_workers) if arms and args.warm_workers else None
    if not _step(report, "load", load):
        json.dump(report, open(args.out, "w"), indent=1)
        return
    if warm is not None:
        def warmed():
            pool, futures = warm
            t0 = time.perf_counter()
            done = [arm for f in futures for arm in f.result()]
            pool.shutdown()
            return {"kernel_sets": len(done), "wait_s": round(time.perf_counter() - t0, 1)}

        _step(report, "warm", warmed)
    B, S, N = 4, 200, 12
    seq = torch.randint(0, cfg.vocab_size, (B, S + N), generator=torch.Generator().manual_seed(3)).to(dev)

    def forced():
        ref = _forced(models["torch"], seq, S, N)
        got = _forced(models["triton"], seq, S, N)
        d = (got - ref).abs().amax(-1)                      # [B, N]
        return {"prompt_pass_max_abs": d[:, 0].max().item(), "decode_max_abs_per_step": d[:, 1:].amax(0).tolist(),
                "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}

    if not args.timing_only:
        _step(report, "teacher_forced_triton_vs_torch", forced)
        del models["torch"]
        torch.cuda.empty_cache()
    model = models["triton"]

    def graph():
        toks = {}
        for use_graph in (False, True):
            model.ensure_rope(S + N)
            model.allocate_cache(B, S + N)
            with torch.inference_mode():
                runner = DecodeRunner(model, B, use_graph=use_graph)
                runner.start(model.prefill(seq[:, :S]), S)
                out = []
                for _ in range(N):
                    runner.step()
                    out.append(runner.tokens.clone())
            toks[use_graph] = torch.stack(out)
        return {"graph_equals_eager": bool(torch.equal(toks[True], toks[False]))}

    if not args.timing_only:
        _step(report, "graph_capture", graph)

    for b, p, o in shapes:
        shape = f"{b}x{p}x{o}"

        def timing(b=b, p=p, o=o):
            ids = torch.randint(0, cfg.vocab_size, (b, p), device=dev)
            steps = max(8, o)
            model.ensure_rope(p + steps + 8)
            model.allocate_cache(b, p + steps + 8)            # room for the warm-up and timed steps
            res = {}
            with torch.inference_mode():
                model.prefill(ids)
                res["prefill_eager_ms"] = _warm_ms(lambda: model.prefill(ids))
                pg = PrefillGraph(model, b, p)
                res["prefill_graph_ms"] = _warm_ms(lambda: pg.run(ids))
                other = torch.randint(0, cfg.vocab_size, (b, p), device=dev)
                res["prefill_graph_equals_eager"] = bool(torch.equal(pg.run(other).clone(), model.prefill(other)))
                del pg
                res["tune"] = model.ops.tune(model.w, b)           # the products' choice, as the engine makes it
                res["graph_step_ms"] = graphed_step_ms(model, ids, steps)
            if arms:
                res["arms"] = _time_arms(model, b, p, steps, arms, args.rounds, dev)
            return res

        _step(report, f"timing_{shape}", timing)
    for shape in filter(None, args.profile.split(",")):
        b, p = (int(x) for x in shape.split("x"))

        def prof(b=b, p=p):
            ids = torch.randint(0, cfg.vocab_size, (b, p), device=dev)
            model.ensure_rope(p + 32)
            model.allocate_cache(b, p + 32)
            with torch.inference_mode():
                model.ops.tune(model.w, b)
                runner = DecodeRunner(model, b, use_graph=False)
                runner.start(model.prefill(ids), p)
                return {"decode_step": kernel_table(runner.step, 10), "prompt_pass": kernel_table(
                    lambda: model.prefill(ids), 1)}

        _step(report, f"profile_{shape}", prof)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
