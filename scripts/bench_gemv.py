"""Time the decode matrix-vector kernels (engine/fqkernels/gemv.py) against cuBLAS.

For each Qwen3-4B weight (qkv, o, gate_up, down, lm_head; gate_up also with the
fused SiLU*up epilogue) and each batch M, a small sweep of configs around the
table's entry, and torch (torch.mm; for SiLU*up, mm + silu + mul). Every op is
captured in a CUDA graph that runs it --calls times over rotating copies of the
weight, so L2 (50 MB) never holds the weight being read; one replay's time divided
by --calls, median over --replays replays. Prints a table (us, TB/s of weight bytes)
and writes every measurement, the best config per (op, M) and a suggested table
entry per op (ONE config for every M: what keeps a row's bits independent of the
batch) to JSON.

    python scripts/bench_gemv.py [--out PATH] [--m 1 4 16] [--ops qkv o ...]

A config that fails to compile, launch or verify is recorded with its error and
skipped. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
L2_FLUSH_BYTES = 400e6   # traffic between two reads of the same copy: several times H100/H200's 50 MB L2

# op name -> (weight rows, K, fused SiLU*up epilogue)
OPS = {
    "qkv": (6144, 2560, False),
    "o": (2560, 4096, False),
    "gate_up": (19456, 2560, False),
    "gate_up_silu": (19456, 2560, True),
    "down": (2560, 9728, False),
    "lm_head": (151936, 2560, False),
}
# Qwen3.5-4B's decode products (fq_qwen35._DECODE_PRODUCTS; its GDN out_proj and attention o_proj
# are the Qwen3 o's shape): timed with --ops q35_..., not by default.
Q35_OPS = {
    "q35_in_proj": (12352, 2560, False),     # a GDN layer's qkv | z | b | a, packed
    "q35_qkv": (10240, 2560, False),         # an attention layer's q (query | gate per head) | k | v, packed
    "q35_gate_up_silu": (18432, 2560, True),
    "q35_down": (2560, 9216, False),
    "q35_lm_head": (248320, 2560, False),
}
DEFAULT_OPS = list(OPS)
OPS.update(Q35_OPS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_out = os.path.join(os.environ["OUT"], "bench_gemv.json") if os.environ.get("OUT") else "bench_gemv.json"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=default_out, help=f"JSON file to write (default {default_out})")
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16], help="batch sizes (default 1 4 16)")
    p.add_argument("--ops", nargs="+", default=DEFAULT_OPS, choices=list(OPS),
                   help="which weights (default: Qwen3-4B's; q35_* are Qwen3.5-4B's)")
    p.add_argument("--calls", type=int, default=20, help="op launches per graph (default 20)")
    p.add_argument("--replays", type=int, default=15, help="timed graph replays (default 15)")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="stop trying new sweep configs after this many seconds; table configs and torch always run")
    args = p.parse_args(argv)
    for name in ("calls", "replays"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(m < 1 for m in args.m):
        p.error(f"--m values must be >= 1, got {args.m}")
    return args


def candidate_configs(gemv, n_rows: int, k: int, silu: bool, m: int) -> list:
    """The table's config for this M first, then a sweep sized for M.

    M = 1: fma configs with one row (the 2-D accumulator kernel), block_n 8-32,
    block_k 256-1024, split-K 1-8, plus dot configs. M <= 4: fma with 4 rows and
    dot. Larger M: dot. M > 1 also: dot_t (swapped operands), block_n 64-128. Only mask-free configs (block_k divides K into equal
    whole-block split-K chunks, block_n divides the output width) and ones whose
    accumulators fit in registers (<= 128 fp32 a thread) are tried.
    """
    base = gemv.select_config(n_rows, k, silu, m)
    cols = n_rows // 2 if silu else n_rows
    out = [base]

    def add(**fields) -> None:
        try:
            cfg = gemv.GemvConfig(**fields)
        except ValueError:
            return
        if cfg in out or cols % cfg.block_n or k % cfg.block_k or (k // cfg.block_k) % cfg.split_k:
            return
        per_thread = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
        if cfg.mode == "fma" and not (8 <= per_thread and per_thread * cfg.block_m * (2 if silu else 1) <= 128):
            return
        out.append(cfg)

    splits = (1, 2, 4, 8)
    if m == 1:
        for bn in (8, 4, 16, 32):
            for bk in (512, 256, 1024):
                for split in splits:
                    add(mode="fma", block_m=1, block_n=bn, block_k=bk, split_k=split,
                        num_warps=8 if bk * bn >= 16384 else 4)
    elif m <= 4:
        for bn in (16, 8, 32):
            for bk in (256, 128, 512):
                for split in splits:
                    add(mode="fma", block_m=4, block_n=bn, block_k=bk, split_k=split)
    for bn in (64, 32, 128):
        for bk in (128, 256):
            for split in splits[:3]:
                add(mode="dot", block_m=16, block_n=bn, block_k=bk, split_k=split)
    if m > 1:   # swapped operands: the weight tile on the MMA's 64-row side
        for bn in (64, 128):
            for bk in (128, 256):
                for split in splits:
                    for stages in (3, 4):
                        add(mode="dot_t", block_m=16, block_n=bn, block_k=bk, split_k=split, num_stages=stages)
    return out


def config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def time_graph(torch, run_once, weights: list, calls: int, replays: int) -> float:
    """Median microseconds per op over graph replays of `calls` ops on rotating weight copies."""
    run_once(weights[0])            # compile, allocate workspaces: nothing may allocate in the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            run_once(weights[i % len(weights)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(samples)


def check_close(torch, out, expected, sum_abs=None) -> str | None:
    """None when `out` is within one bf16 ulp of torch's result for nearly all elements
    and every element within 4 ulps plus the fp32 summation bound (K 2^-24 sum|x w|,
    `sum_abs` = K 2^-24 |x| @ |w|.T): where a sum cancels, two valid orders may differ
    by many ulps of the small result."""
    if out.isnan().any():
        return "NaN in the output"
    diff = (out.double() - expected.double()).abs()
    mag = torch.maximum(out.double().abs(), expected.double().abs()).clamp_min(2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    within = (diff <= ulp).double().mean().item()
    bound = 4 * ulp + (2 * sum_abs.double() if sum_abs is not None else 0)
    if within < 0.999 or not bool((diff <= bound).all()):
        return f"mismatch: {within:.5f} within one ulp, max {(diff / ulp).max().item():.1f} ulp"
    return None


def git_commit() -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gemv: needs a CUDA device, none is visible", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO / "engine"))
    import triton
    from fqkernels import gemv

    t_start = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    meta = {
        "device": props.name, "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "calls_per_graph": args.calls, "replays": args.replays,
    }
    results: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)

    for op in args.ops:
        n_rows, k, silu = OPS[op]
        cols = n_rows // 2 if silu else n_rows
        weight_bytes = n_rows * k * 2
        copies = (1 if weight_bytes >= L2_FLUSH_BYTES
                  else min(args.calls, math.ceil(L2_FLUSH_BYTES / weight_bytes) + 1))
        weights = [torch.randn(n_rows, k, device="cuda", generator=gen).mul_(k ** -0.5).to(torch.bfloat16)
                   for _ in range(copies)]
        fn = gemv.linear_silu_mul if silu else gemv.linear
        for m in args.m:
            configs = candidate_configs(gemv, n_rows, k, silu, m)
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.empty(m, cols, device="cuda", dtype=torch.bfloat16)
            gu = torch.empty(m, n_rows, device="cuda", dtype=torch.bfloat16)

            def torch_op(w, x=x, out=out, gu=gu):
                if silu:
                    torch.mm(x, w.t(), out=gu)
                    torch.mul(torch.nn.functional.silu(gu[:, :cols]), gu[:, cols:], out=out)
                else:
                    torch.mm(x, w.t(), out=out)

            torch_op(weights[0])
            expected = out.clone()
            if silu:   # the bound is for plain sums; the SiLU epilogue keeps the strict check
                sum_abs = None
            else:
                sum_abs = k * 2.0 ** -24 * (x.float().abs() @ weights[0].float().abs().t())
            row = {"op": op, "n": n_rows, "k": k, "silu_mul": silu, "m": m, "weight_bytes": weight_bytes}
            us = time_graph(torch, torch_op, weights, args.calls, args.replays)
            results.append(dict(row, impl="torch", config=None, us=us, tbps=weight_bytes / us / 1e6, error=None))

            for i, cfg in enumerate(configs):
                entry = dict(row, impl="triton", config=config_dict(cfg), table=(i == 0), us=None, tbps=None, error=None)
                if i > 0 and time.monotonic() - t_start > args.budget_s:
                    entry["error"] = "skipped: over --budget-s"
                    results.append(entry)
                    continue
                try:
                    out.fill_(float("nan"))
                    fn(x, weights[0], out=out, config=cfg)
                    torch.cuda.synchronize()
                    entry["error"] = check_close(torch, out, expected, sum_abs)
                    if entry["error"] is None:
                        entry["us"] = time_graph(torch, lambda w, cfg=cfg: fn(x, w, out=out, config=cfg),
                                                 weights, args.calls, args.replays)
                        entry["tbps"] = weight_bytes / entry["us"] / 1e6
                except Exception as exc:   # a config that does not compile or launch is data, not a crash
                    entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    torch.cuda.synchronize()
                results.append(entry)
        del weights
        torch.cuda.empty_cache()

    best, suggested = summarize(results, args.m)
    print_table(results, best)
    report = {"meta": meta, "results": results, "best": best, "suggested_table": suggested,
              "elapsed_s": time.monotonic() - t_start}
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out_path} ({len(results)} measurements, {report['elapsed_s']:.0f} s)")
    print("\nSuggested table entries (one config per weight for every M):")
    for op, s in suggested.items():
        print(f"  {op:13s} ({s['n']}, {s['k']}): {s['literal']}  # x{s['mean_ratio_to_best']:.3f} of per-M best")
    return 0


def summarize(results: list[dict], ms: list[int]) -> tuple[list[dict], dict]:
    """Best config per (op, M), and per op the config nearest the per-M bests across all M."""
    ok = [r for r in results if r["impl"] == "triton" and r["us"] is not None]
    torch_us = {(r["op"], r["m"]): r["us"] for r in results if r["impl"] == "torch"}
    best = []
    for op in dict.fromkeys(r["op"] for r in results):
        for m in ms:
            rows = [r for r in ok if r["op"] == op and r["m"] == m]
            if not rows:
                continue
            b = min(rows, key=lambda r: r["us"])
            table = next((r for r in rows if r.get("table")), None)
            best.append({"op": op, "m": m, "n": b["n"], "k": b["k"], "config": b["config"], "us": b["us"],
                         "tbps": b["tbps"], "table_us": table["us"] if table else None,
                         "torch_us": torch_us.get((op, m))})
    suggested = {}
    for op in dict.fromkeys(r["op"] for r in ok):
        per_m_best = {b["m"]: b["us"] for b in best if b["op"] == op}
        by_cfg: dict[str, dict[int, float]] = {}
        cfg_of: dict[str, dict] = {}
        for r in ok:
            if r["op"] == op:
                key = json.dumps(r["config"], sort_keys=True)
                by_cfg.setdefault(key, {})[r["m"]] = r["us"]
                cfg_of[key] = r["config"]
        complete = {c: t for c, t in by_cfg.items() if set(t) == set(per_m_best)}
        if not complete:
            continue
        # Geometric mean of the slowdown against each M's best: no single M dominates.
        score = {c: math.exp(sum(math.log(t[m] / per_m_best[m]) for m in t) / len(t)) for c, t in complete.items()}
        c = min(score, key=score.get)
        cfg = cfg_of[c]     # GemvConfig's field order
        sample = next(r for r in ok if r["op"] == op)
        fields = ", ".join(f"{key}={value!r}" for key, value in cfg.items())
        suggested[op] = {"n": sample["n"], "k": sample["k"], "silu_mul": sample["silu_mul"], "config": cfg,
                         "literal": f"GemvConfig({fields})", "mean_ratio_to_best": score[c],
                         "us_per_m": complete[c]}
    return best, suggested


def short(cfg: dict | None) -> str:
    if cfg is None:
        return "-"
    s = f"{cfg['mode']}{cfg['block_m']} n{cfg['block_n']} k{cfg['block_k']} s{cfg['split_k']} w{cfg['num_warps']}"
    return s + f" st{cfg['num_stages']}"


def print_table(results: list[dict], best: list[dict]) -> None:
    print(f"{'op':13s} {'M':>3s} | {'torch us':>9s} {'TB/s':>5s} | {'table us':>9s} {'TB/s':>5s} | "
          f"{'best us':>8s} {'TB/s':>5s}  best config")
    for b in best:
        bytes_ = next(r["weight_bytes"] for r in results if r["op"] == b["op"])

        def fmt(us):
            return (f"{us:9.1f} {bytes_ / us / 1e6:5.2f}") if us else f"{'-':>9s} {'-':>5s}"
        print(f"{b['op']:13s} {b['m']:3d} | {fmt(b['torch_us'])} | {fmt(b['table_us'])} | "
              f"{b['us']:8.1f} {b['tbps']:5.2f}  {short(b['config'])}")
    failed = [r for r in results if r["impl"] == "triton" and r["error"]]
    if failed:
        print(f"\n{len(failed)} config runs recorded an error or were skipped, e.g.:")
        for r in failed[:8]:
            print(f"  {r['op']} M={r['m']} {short(r['config'])}: {r['error']}")


if __name__ == "__main__":
    sys.exit(main())
