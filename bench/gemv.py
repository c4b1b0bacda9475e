"""The decode GEMV (engine/fqkernels/gemv.py) against cuBLAS (torch.mm), per decode product.

For each weight (N rows, K columns; gate_up also with the fused SiLU*up epilogue) and each row
count M: cuBLAS, the table's config (gemv.select_config, for exact decode or not) and, with --sweep
around, configs around it (mask-free tilings whose accumulators fit in registers), plus any --config
given. Every op is timed
as one CUDA graph of --calls launches over rotating copies of the weight, so the weight streams from
HBM as in a step that reads every layer's copy once (runner.time_graph). A config that fails to
compile, launch or match cuBLAS's result (within one bf16 ulp for nearly all elements and the fp32
summation bound for all) is a row with its error. After the measurements: the best config per
(op, M) against cuBLAS, and per op the one config nearest the per-M bests across every M (one
config for every M keeps a row's bits independent of the batch).

--shared times instead the row tiles a speculative verify could give a product whose one-row config
is the fma kernel (gemv.shared_rows): at each M, that config at block_m 1, 2 and 4 (1: every row a
program of its own, side by side, re-reading the weights from L2), each at the config's columns a
program and at fewer (down to 2: fewer registers a row); each row's output against the one-row
launch's bits (`same_bits`) and the engine's pick marked.

Without a GPU the kernel arm is gemv.linear_reference (torch), one row per (op, M), no sweep, and
--shared records the variants without timing them.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import time

from bench.runner import (BenchError, Column, copies, engine_on_path, gpu_visible, int_list, on_off, positive_int,
                          time_graph)

# name -> (N, K, fused SiLU*up epilogue): the Qwen3-4B decode products
QWEN3_OPS = {
    "qkv": (6144, 2560, False),
    "o": (2560, 4096, False),
    "gate_up": (19456, 2560, False),
    "gate_up_silu": (19456, 2560, True),
    "down": (2560, 9728, False),
    "lm_head": (151936, 2560, False),
}
# the Qwen3.5-4B decode products (its GDN out_proj and attention o_proj have the Qwen3 o's shape)
QWEN35_OPS = {
    "q35_in_proj": (12352, 2560, False),     # a GDN layer's qkv | z | b | a, packed
    "q35_qkv": (10240, 2560, False),         # an attention layer's q (query | gate per head) | k | v, packed
    "q35_gate_up_silu": (18432, 2560, True),
    "q35_down": (2560, 9216, False),
    "q35_lm_head": (248320, 2560, False),
}
OPS = {**QWEN3_OPS, **QWEN35_OPS}
GROUPS = {"qwen3": list(QWEN3_OPS), "qwen3.5": list(QWEN35_OPS)}

COLUMNS = [Column("op", width=16, left=True), Column("rows", width=4), Column("impl", width=9, left=True),
           Column("config_text", "config", width=30, left=True),
           Column("us", fmt="{:.1f}", width=9), Column("tbps", "TB/s", fmt="{:.2f}", width=6),
           Column("vs_cublas", "x cuBLAS", fmt="{:.3f}", width=8), Column("same_bits", "same", width=4),
           Column("error", width=30, left=True)]


def _shape(text: str) -> tuple[str, tuple[int, int, bool]]:
    import argparse

    base, _, flag = text.partition(":")
    try:
        n, k = (int(v) for v in base.split("x"))
    except ValueError:
        n = k = 0
    if n < 1 or k < 1 or flag not in ("", "silu"):
        raise argparse.ArgumentTypeError(f"{text!r} is not NxK or NxK:silu (positive integers)")
    if flag and n % 2:
        raise argparse.ArgumentTypeError(f"{text!r}: a SiLU*up weight has an even N (gate rows then up rows)")
    return text, (n, k, bool(flag))


def _op(text: str) -> str:
    import argparse

    if text not in OPS and text not in GROUPS:
        raise argparse.ArgumentTypeError(f"unknown op {text!r}; known: {', '.join(list(GROUPS) + list(OPS))}")
    return text


def _config_text(text: str) -> dict:
    """"mode=fma,block_m=1,block_n=8,block_k=512" -> GemvConfig's keyword arguments."""
    import argparse

    fields = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{part!r} in --config is not name=value")
        fields[name.strip()] = value.strip() if name.strip() == "mode" else _int_field(value, part)
    return fields


def _modes(text: str) -> tuple:
    import argparse

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in ("fma", "dot", "dot_t")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--modes {text!r}: each must be fma, dot or dot_t")
    return modes


def _int_field(value: str, part: str) -> int:
    import argparse

    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{part!r} in --config: the value is not an integer") from None


def add_arguments(parser) -> None:
    parser.add_argument("--ops", nargs="+", type=_op, default=None,
                        help="products or groups (qwen3, qwen3.5; default both unless --shape is given): "
                             + ", ".join(OPS))
    parser.add_argument("--shape", action="append", type=_shape, default=[], metavar="NxK[:silu]",
                        help="an extra weight shape (repeatable)")
    parser.add_argument("--rows", type=int_list, default=[1, 4, 16], help="row counts M (default 1,4,16)")
    parser.add_argument("--sweep", choices=("table", "around"), default="around",
                        help="table: the table's config only; around: a sweep around it (default)")
    parser.add_argument("--config", action="append", type=_config_text, default=[], metavar="FIELDS",
                        help="a GemvConfig to time besides, e.g. mode=fma,block_m=1,block_n=8,block_k=512,split_k=1")
    parser.add_argument("--exact-decode", type=on_off, default=True, metavar="on|off",
                        help="the table's configs for exact decode (on, the engine's default) or not")
    parser.add_argument("--calls", type=positive_int, default=20, help="launches per graph (default 20)")
    parser.add_argument("--reps", type=positive_int, default=15, help="timed graph replays (default 15)")
    parser.add_argument("--shared", action="store_true",
                        help="time the fma products' shared row tiles (block_m 1, 2, 4; 2 or more columns a program) "
                             "at each --rows, with each row's bits against the one-row launch")
    parser.add_argument("--modes", type=_modes, default=None, metavar="MODE,...",
                        help="sweep only these kernel modes (fma, dot, dot_t; e.g. dot,dot_t: one row's tensor-core "
                             "configs); the table's config is always timed")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="no new sweep config after this many seconds; table configs and cuBLAS always run")


def table_config(gemv, n: int, k: int, silu: bool, m: int, exact: bool):
    """gemv.select_config's pick (an engine whose select_config has no exact-decode switch: its only one)."""
    if "exact" in inspect.signature(gemv.select_config).parameters:
        return gemv.select_config(n, k, silu, m, exact=exact)
    return gemv.select_config(n, k, silu, m)


def candidate_configs(gemv, n: int, k: int, silu: bool, m: int, sweep: str, extra: list, exact: bool,
                      modes: tuple | None = None) -> list:
    """The table's config for this M first, the --config ones, then with sweep "around" a sweep
    sized for M: M = 1 fma with one row (block_n 4-32, block_k 256-1024, split-K 1-8) and dot;
    M <= 4 fma with 4 rows and dot; larger M dot; every M dot_t (swapped operands: one row in a
    16-row tile, as Qwen3's one sequence runs). Only mask-free configs (block_k divides K into
    whole equal split-K chunks, block_n divides the output width) whose fma accumulators fit in
    registers (<= 128 fp32 a thread); with `modes`, the sweep's configs of those modes only."""
    cols = n // 2 if silu else n
    out = [table_config(gemv, n, k, silu, m, exact)]

    def add(check: bool = True, **fields) -> None:
        try:
            cfg = gemv.GemvConfig(**fields)
        except (TypeError, ValueError):
            return
        if cfg in out or (modes and cfg.mode not in modes):
            return
        if check:
            if cols % cfg.block_n or k % cfg.block_k or (k // cfg.block_k) % cfg.split_k:
                return
            per_thread = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
            if cfg.mode == "fma" and not (8 <= per_thread and per_thread * cfg.block_m * (2 if silu else 1) <= 128):
                return
        out.append(cfg)

    for fields in extra:
        add(check=False, **fields)
    if sweep != "around":
        return out
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
    for bn in (64, 128):
        for bk in (128, 256):
            for split in splits:
                for stages in (3, 4):
                    add(mode="dot_t", block_m=16, block_n=bn, block_k=bk, split_k=split, num_stages=stages)
    return out


def shared_variants(gemv, one, m: int, silu: bool, n: int) -> list:
    """The shared row tiles to time for m rows of a product whose one-row config is `one` (fma):
    the engine's pick (gemv.shared_rows) first, then block_m 1, 2, 4 (no wider than m needs) at the
    config's columns a program and at each halving of them down to 2. Fewer columns hold fewer
    accumulators (at 4 rows of qkv's 8 x 256 block: 115 registers a thread at 8 columns, 72 at 4,
    56 at 2; ptxas for sm_90) and should keep each column's bits: Triton lays the [block_n,
    block_k] tile out with its warps and lanes along K for every block_n >= 2, so a column's sums
    run in the same order."""
    out = [gemv.shared_rows(one, m, silu, n=n)]
    widths = [1] + [b for b in (2, 4) if b // 2 < m]
    columns = [one.block_n]
    while columns[-1] > 2:
        columns.append(columns[-1] // 2)
    for block_n in columns:
        for block_m in widths:
            cfg = dataclasses.replace(one, block_m=block_m, block_n=block_n)
            if cfg not in out:
                out.append(cfg)
    return out


def _weights(torch, n: int, k: int, calls: int, device: str, gen) -> tuple[list, list]:
    """Copies of an [n, k] bf16 weight (as many as keep the graph's reads out of L2, at most `calls`),
    and the `calls` launches' weights cycling through them."""
    weights = [torch.randn(n, k, device=device, generator=gen).mul_(k ** -0.5).to(torch.bfloat16)
               for _ in range(min(calls, copies(n * k * 2)))]
    return weights, [weights[i % len(weights)] for i in range(calls)]


def _launch_error(exc: Exception) -> str:
    """A config that does not compile or launch, as its row's error."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def run_shared(args, report, gemv, torch, shapes: dict, gpu: bool) -> None:
    """--shared: see the module note."""
    gen = torch.Generator(device="cuda").manual_seed(0) if gpu else None
    for op, (n, k, silu) in shapes.items():
        one = table_config(gemv, n, k, silu, 1, args.exact_decode)
        if one.mode != "fma":
            report.note(f"# {op}: its one-row config is {one.mode}, not fma: no shared tiles")
            continue
        cols, nbytes = (n // 2 if silu else n), n * k * 2
        weights, calls = _weights(torch, n, k, args.calls, "cuda", gen) if gpu else ([], [])
        launch = gemv.linear_silu_mul if silu else gemv.linear
        for m in args.rows:
            if gpu:
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                want = torch.cat([launch(x[j:j + 1].contiguous(), weights[0], config=one) for j in range(m)])
                out = torch.empty(m, cols, device="cuda", dtype=torch.bfloat16)
            for i, cfg in enumerate(shared_variants(gemv, one, m, silu, n)):
                row = {"kind": "shared", "op": op, "n": n, "k": k, "silu_mul": silu, "rows": m, "impl": "gemv",
                       "config": dataclasses.asdict(cfg), "config_text": None, "engine": i == 0, "us": None,
                       "tbps": None, "same_bits": None, "error": None if gpu else "no GPU: not run"}
                row["config_text"] = short(row["config"]) + (" engine" if i == 0 else "")
                if gpu:
                    fn = lambda w, cfg=cfg: launch(x, w, out=out, config=cfg)   # noqa: E731
                    try:
                        fn(weights[0])
                        torch.cuda.synchronize()
                        row["same_bits"] = bool(torch.equal(out, want))
                        row["us"] = time_graph(fn, calls, args.reps)
                        row["tbps"] = nbytes / row["us"] / 1e6
                    except Exception as exc:   # noqa: BLE001 - a config that does not compile or launch is data
                        row["error"] = _launch_error(exc)
                        torch.cuda.synchronize()
                report.add(row)
        del weights, calls
        if gpu:
            torch.cuda.empty_cache()


def short(cfg: dict | None) -> str | None:
    if cfg is None:
        return None
    return (f"{cfg['mode']}{cfg['block_m']} n{cfg['block_n']} k{cfg['block_k']} s{cfg['split_k']} "
            f"w{cfg['num_warps']} st{cfg['num_stages']}")


def check_close(torch, out, expected, sum_abs=None) -> str | None:
    """None when out is within one bf16 ulp of cuBLAS's result for >= 99.9% of the elements and
    every element within 4 ulps plus twice the fp32 summation bound (sum_abs = K 2^-24 |x| @ |w|.T):
    where a sum cancels, two valid orders differ by many ulps of the small result."""
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


def run(args, report) -> None:
    import torch

    engine_on_path()
    from fqkernels import gemv

    for fields in args.config:
        try:
            gemv.GemvConfig(**fields)
        except (TypeError, ValueError) as exc:
            raise BenchError(f"--config {fields}: {exc}") from None

    names = [] if args.ops is None and args.shape else list(dict.fromkeys(
        op for name in (args.ops or list(GROUPS)) for op in GROUPS.get(name, [name])))
    shapes = {name: OPS[name] for name in names}
    shapes.update(dict(args.shape))
    gpu = gpu_visible()
    if args.shared:
        return run_shared(args, report, gemv, torch, shapes, gpu)
    device = "cuda" if gpu else "cpu"
    if not gpu:
        report.note("# no GPU: the kernel arm is gemv.linear_reference, no sweep")
    t_start = time.monotonic()
    gen = torch.Generator(device=device).manual_seed(0)
    for op, (n, k, silu) in shapes.items():
        cols = n // 2 if silu else n
        nbytes = n * k * 2
        weights, calls = _weights(torch, n, k, args.calls, device, gen)
        for m in args.rows:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            out = torch.empty(m, cols, device=device, dtype=torch.bfloat16)
            gu = torch.empty(m, n, device=device, dtype=torch.bfloat16)

            def cublas(w, x=x, out=out, gu=gu, cols=cols, silu=silu):
                if silu:
                    torch.mm(x, w.t(), out=gu)
                    torch.mul(torch.nn.functional.silu(gu[:, :cols]), gu[:, cols:], out=out)
                else:
                    torch.mm(x, w.t(), out=out)

            cublas(weights[0])
            expected = out.clone()
            # the summation bound is for plain sums; the SiLU epilogue keeps the strict check
            sum_abs = None if silu else k * 2.0 ** -24 * (x.float().abs() @ weights[0].float().abs().t())
            base = {"op": op, "n": n, "k": k, "silu_mul": silu, "rows": m, "weight_bytes": nbytes}
            us = time_graph(cublas, calls, args.reps)
            cublas_us = us
            report.add(dict(base, kind="measure", impl="cublas", config=None, config_text=None, table=False, us=us,
                            tbps=nbytes / us / 1e6, vs_cublas=1.0, error=None))
            configs = candidate_configs(gemv, n, k, silu, m, args.sweep if gpu else "table", args.config,
                                        args.exact_decode, args.modes)
            if not gpu:
                configs = configs[:1]
            for i, cfg in enumerate(configs):
                row = dict(base, kind="measure", impl="gemv" if gpu else "reference",
                           config=dataclasses.asdict(cfg), config_text=None, table=i == 0, us=None, tbps=None,
                           vs_cublas=None, error=None)
                row["config_text"] = short(row["config"])
                if i > 0 and time.monotonic() - t_start > args.budget_s:
                    row["error"] = "skipped: over --budget-s"
                    report.add(row, show=False)
                    continue
                if gpu:
                    fn = (lambda w, cfg=cfg: gemv.linear_silu_mul(x, w, out=out, config=cfg)) if silu else \
                         (lambda w, cfg=cfg: gemv.linear(x, w, out=out, config=cfg))
                else:
                    ref = gemv.linear_silu_mul_reference if silu else gemv.linear_reference
                    fn = lambda w, ref=ref: out.copy_(ref(x, w))   # noqa: E731
                try:
                    out.fill_(float("nan"))
                    fn(weights[0])
                    if gpu:
                        torch.cuda.synchronize()
                    row["error"] = check_close(torch, out, expected, sum_abs)
                    if row["error"] is None:
                        row["us"] = time_graph(fn, calls, args.reps)
                        row["tbps"] = nbytes / row["us"] / 1e6
                        row["vs_cublas"] = row["us"] / cublas_us
                except Exception as exc:   # noqa: BLE001 - a config that does not compile or launch is data
                    row["error"] = _launch_error(exc)
                    if gpu:
                        torch.cuda.synchronize()
                report.add(row, show=row["error"] is None or i == 0)
        del weights, calls
        if gpu:
            torch.cuda.empty_cache()
    summarize(report)


def summarize(report) -> None:
    """Rows of kind "best" (the fastest config per (op, M) against cuBLAS) and "suggested" (per op,
    the config whose geometric-mean slowdown against each M's best is least, over configs timed
    at every M), each also as a line on stdout."""
    measured = [r for r in report.rows if r.get("kind") == "measure"]
    failed = [r for r in measured if r["error"]]
    if failed:
        report.note(f"{len(failed)} configs recorded an error or were skipped, e.g.:")
        for r in failed[:6]:
            report.note(f"  {r['op']} rows={r['rows']} {r['config_text']}: {r['error']}")
    ok = [r for r in measured if r["impl"] != "cublas" and r["us"] is not None]
    cublas = {(r["op"], r["rows"]): r["us"] for r in measured if r["impl"] == "cublas"}
    bests = []
    for op in dict.fromkeys(r["op"] for r in ok):
        for m in dict.fromkeys(r["rows"] for r in ok if r["op"] == op):
            rows = [r for r in ok if r["op"] == op and r["rows"] == m]
            b = min(rows, key=lambda r: r["us"])
            table = next((r for r in rows if r["table"]), None)
            bests.append({"kind": "best", "op": op, "n": b["n"], "k": b["k"], "rows": m, "config": b["config"],
                          "us": b["us"], "table_us": table["us"] if table else None,
                          "cublas_us": cublas.get((op, m)), "vs_cublas": b["us"] / cublas[(op, m)]})
    if bests:
        report.note("best per (op, rows): op rows | cuBLAS us | table us | best us  best config")
    for b in bests:
        report.add(b, show=False)
        table_us = f"{b['table_us']:9.1f}" if b["table_us"] else f"{'-':>9s}"
        report.note(f"  {b['op']:16s} {b['rows']:3d} | {b['cublas_us']:9.1f} | {table_us} | {b['us']:8.1f}  "
                    f"{short(b['config'])}")
    for op in dict.fromkeys(r["op"] for r in ok):
        per_m_best = {b["rows"]: b["us"] for b in bests if b["op"] == op}
        by_cfg: dict[str, dict[int, float]] = {}
        for r in ok:
            if r["op"] == op:
                by_cfg.setdefault(json.dumps(r["config"], sort_keys=True), {})[r["rows"]] = r["us"]
        complete = {c: t for c, t in by_cfg.items() if set(t) == set(per_m_best)}
        if not complete:
            continue
        score = {c: math.exp(sum(math.log(t[m] / per_m_best[m]) for m in t) / len(t)) for c, t in complete.items()}
        best = min(score, key=score.get)
        cfg = next(r["config"] for r in ok if r["op"] == op and json.dumps(r["config"], sort_keys=True) == best)
        literal = "GemvConfig(" + ", ".join(f"{key}={value!r}" for key, value in cfg.items()) + ")"
        sample = next(r for r in ok if r["op"] == op)
        report.add({"kind": "suggested", "op": op, "n": sample["n"], "k": sample["k"], "silu_mul": sample["silu_mul"],
                    "config": cfg, "literal": literal, "mean_ratio_to_best": score[best],
                    "us_per_rows": complete[best]}, show=False)
        report.note(f"suggested {op} ({sample['n']}, {sample['k']}): {literal}  # x{score[best]:.3f} of per-M best")
