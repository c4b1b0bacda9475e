"""Peak memory of the engine per shape, each shape in a fresh process (as the judge runs an engine).

Per shape BxPxO a child process (`python -m bench memory --child BxPxO ...`) builds the engine
with the engine options given, runs one generate() (the warmup) and one more, and reports over its
whole life torch.cuda.max_memory_reserved() (what the judge's memory gate reads) and the allocated
peak, beside what the load allocated ("weights": the weights and the LM head's int8 copy where the
screen is on), the cache the shape needs
(model.cache_bytes(B, P + O - 1)), the bar weights + cache + 3 GiB, and the second call's TTFT.

Without a GPU the peak is the process's resident set (ru_maxrss) and the weights are their bytes.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from bench import runner
from bench.runner import (REPO, Column, add_engine_arguments, add_model_argument, build_engine,
                          check_engine_options, engine_argv, engine_options, gpu_visible, positive_int,
                          resolve_model, shape_list, weight_bytes)

GiB = 2 ** 30
HEADROOM_GIB = 3.0      # the bar: weights + the shape's cache + this

COLUMNS = [Column("shape", width=12, left=True), Column("peak_GiB", "peak GiB", fmt="{:.2f}"),
           Column("weights_GiB", "weights", fmt="{:.2f}"), Column("cache_GiB", "cache", fmt="{:.2f}"),
           Column("bar_GiB", "bar GiB", fmt="{:.2f}"), Column("over_GiB", "over w+c", fmt="{:.2f}"),
           Column("ttft_ms", "TTFT ms", fmt="{:.1f}"), Column("error", width=40, left=True)]


def add_arguments(parser) -> None:
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--shapes", type=shape_list(3, "BATCHxPROMPTxOUTPUT"),
                        default=[(1, 32000, 8), (2, 16384, 8), (16, 2048, 32)],
                        help="batch x prompt x output tokens (default 1x32000x8,2x16384x8,16x2048x32)")
    parser.add_argument("--timeout-s", type=positive_int, default=600, help="a child's limit (default 600)")
    parser.add_argument("--child", default=None, help=__import__("argparse").SUPPRESS)


def child(model_dir: str, options: dict, shape: tuple[int, int, int]) -> dict:
    import resource

    import torch

    batch, prompt, output = shape
    eng = build_engine(model_dir, options)
    gpu = gpu_visible()
    weights = torch.cuda.memory_allocated() if gpu else weight_bytes(eng.model)
    ids = torch.randint(0, eng.cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in eng.generate(ids, output):     # the warmup
        pass
    t0 = time.perf_counter()
    stream = eng.generate(ids, output)
    next(stream)
    ttft = time.perf_counter() - t0
    for _ in stream:
        pass
    if gpu:
        torch.cuda.synchronize()
        peak, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    else:
        peak, allocated = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None
    cache = eng.model.cache_bytes(batch, prompt + output - 1)
    return {"shape": f"{batch}x{prompt}x{output}", "batch": batch, "prompt": prompt, "output": output,
            "peak": "cuda max_memory_reserved" if gpu else "process ru_maxrss",
            "peak_GiB": peak / GiB, "peak_allocated_GiB": None if allocated is None else allocated / GiB,
            "weights_GiB": weights / GiB, "cache_GiB": cache / GiB,
            "bar_GiB": (weights + cache) / GiB + HEADROOM_GIB, "over_GiB": (peak - weights - cache) / GiB,
            "ttft_ms": ttft * 1e3, "engine": eng.describe()}


def run(args, report) -> None:
    options = engine_options(args)
    if args.child is not None:
        shape = tuple(int(v) for v in args.child.split("x"))
        print(json.dumps(child(args.model, options, shape)), flush=True)
        return
    check_engine_options(options)        # here, not once per child
    model_dir = resolve_model(args.model)
    for shape in args.shapes:
        name = "x".join(map(str, shape))
        cmd = [sys.executable, "-m", "bench", "memory", "--engine", str(runner.ENGINE_DIR), "--model", str(model_dir),
               *engine_argv(options), "--child", name]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            report.add({"shape": name, "error": f"timed out after {args.timeout_s} s"})
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            report.add({"shape": name, "error": (proc.stderr.strip() or proc.stdout.strip())[-2000:]})
            continue
        report.add(json.loads(lines[-1]))
