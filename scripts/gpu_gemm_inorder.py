"""What does the full forward's product order cost at decode? (issue 11, after
gpu_gemm_order_probe.py)

The order probe (results/h200-2026-11-30/session7) found that a tensor-core product walking
K in order with one fp32 accumulator per output gives the full forward's large-M cuBLAS
bits, and that the engine's GEMV already does for qkv, gate_up and lm_head (no split-K
there) but not for o and down, whose table configs split K (2 and 4 chunks) for speed.
This script times, for o and down at decode row counts, GEMV configs without split-K
against the table's config and cuBLAS, and checks each one's bits against the large-M
product:
  table        the config the engine uses now (select_config)
  cublas       F.linear over the decode rows (native's decode)
  dot_t/...    weight tile on the MMA's row side (64 or more output columns a program)
  dot/...      x padded to block_m rows on the MMA's row side, narrow output tiles (more programs)
Times are of `linear_partials` (what the engine launches before the norm that adds the
partials), captured in a CUDA graph over weight copies that do not fit in L2
(bench_gemv.time_graph), in microseconds.

    python scripts/gpu_gemm_inorder.py [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engine"))
sys.path.insert(0, HERE)

from fqkernels import gemv  # noqa: E402
from bench_gemv import L2_FLUSH_BYTES, time_graph  # noqa: E402

MATRICES = {"o": (2560, 4096), "down": (2560, 9728), "qkv": (6144, 2560), "gate_up": (19456, 2560),
            "lm_head": (151936, 2560)}
G = gemv.GemvConfig


def candidates(k: int, which: str) -> dict:
    if which == "deep":
        return deep_candidates()
    if which == "narrow":
        return narrow_candidates()
    if which == "m64":
        return m64_candidates()
    out = {}
    for bk in (128, 256):
        for st in (3, 4, 6):
            out[f"dot_t/n64/k{bk}/s{st}"] = G(block_n=64, block_k=bk, split_k=1, num_stages=st, mode="dot_t")
    for bm in (16, 64):
        for bn in (16, 32):
            for bk in (128, 256):
                for st in (4, 6):
                    out[f"dot/m{bm}/n{bn}/k{bk}/s{st}"] = G(block_n=bn, block_k=bk, split_k=1, num_stages=st,
                                                           mode="dot", block_m=bm)
    for bn in (16, 32):
        out[f"dot_t/n{bn}/k256/s4"] = G(block_n=bn, block_k=256, split_k=1, num_stages=4, mode="dot_t")
    return out


def _grid(specs, warps) -> dict:
    """In-order configs named mode/m/n/k/s/w: each (mode, block_m, block_n, block_k, stages) spec
    at each of its stages and each of `warps`."""
    out = {}
    for mode, bm, bn, bk, stages in specs:
        for st in stages:
            for nw in warps:
                out[f"{mode}/m{bm}/n{bn}/k{bk}/s{st}/w{nw}"] = G(block_n=bn, block_k=bk, split_k=1, num_stages=st,
                                                                 num_warps=nw, mode=mode, block_m=bm)
    return out


def deep_candidates() -> dict:
    """Round 2 (after round 1 showed every in-order config exact and the fastest limited by
    the bytes each program keeps in flight): deeper pipelines and more warps."""
    return _grid((("dot", 16, 32, 256, (6, 7, 8)), ("dot", 16, 32, 128, (8, 10, 12)), ("dot", 16, 32, 512, (3, 4)),
                  ("dot_t", 16, 64, 128, (6, 7, 8, 10)), ("dot_t", 16, 32, 256, (6, 8)),
                  ("dot_t", 16, 32, 128, (8, 12)), ("dot", 32, 32, 256, (6,))), (4, 8))


def narrow_candidates() -> dict:
    """Round 3 (session 8): at 2560 outputs, 32 columns a program is 80 programs on 132 SMs;
    16 columns with long K tiles and deep pipelines keeps more SMs and bytes busy."""
    return _grid((("dot", 16, 16, 512, (4, 6, 8)), ("dot", 16, 16, 1024, (3, 4)), ("dot", 16, 32, 1024, (2, 3)),
                  ("dot", 16, 32, 512, (5, 6)), ("dot", 64, 16, 512, (4,)), ("dot", 64, 32, 256, (6,))), (2, 4))


def m64_candidates() -> dict:
    """Round 4 (session 8): 33-64 rows, where exact decode forces the GEMV for qkv, gate_up and
    lm_head too and cuBLAS had been faster: x as the MMA's 64-row side, wider output tiles."""
    return _grid([("dot", 64, bn, bk, (3, 4, 6)) for bn in (32, 64, 128) for bk in (64, 128)], (4, 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8,16,32,64")  # round 2: --rows 4,16
    ap.add_argument("--big", type=int, default=2048, help="rows of the large (full forward) product")
    ap.add_argument("--set", default="wide", choices=("wide", "deep", "narrow", "m64"),
                    help="candidate configs: round 1, 2, 3 or 4")
    ap.add_argument("--matrices", default="o,down", help="which of " + ", ".join(MATRICES))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gemm_inorder.json"))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"torch": torch.__version__, "big_rows": args.big, "results": []}
    t0 = time.perf_counter()
    for name in args.matrices.split(","):
        n, k = MATRICES[name]
        copies = min(20, math.ceil(L2_FLUSH_BYTES / (n * k * 2)) + 1)
        weights = [(torch.randn((n, k), generator=gen, device="cuda") * k ** -0.5).bfloat16() for _ in range(copies)]
        x_big = (torch.randn((args.big, k), generator=gen, device="cuda") * 2).bfloat16()
        full = F.linear(x_big, weights[0])
        for rows in [int(r) for r in args.rows.split(",")]:
            x = x_big[:rows].contiguous()
            want = full[:rows]
            variants = {"table": gemv.select_config(n, k, False, rows), **candidates(k, args.set)}
            res = {"matrix": name, "N": n, "K": k, "rows": rows, "variants": {}}
            got = F.linear(x, weights[0])
            res["variants"]["cublas"] = {"equal_frac": (got == want).float().mean().item(),
                                         "us": time_graph(torch, lambda w: F.linear(x, w), weights, 20, 15)}
            for vname, cfg in variants.items():
                try:
                    got = gemv.linear(x, weights[0], config=cfg)
                    us = time_graph(torch, lambda w, cfg=cfg: gemv.linear_partials(x, w, config=cfg), weights, 20, 15)
                    res["variants"][vname] = {"equal_frac": (got == want).float().mean().item(), "us": us,
                                              "config": dataclasses.asdict(cfg)}
                except Exception as exc:  # a config that does not compile or launch is recorded
                    res["variants"][vname] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            report["results"].append(res)
            ok = {v: r for v, r in res["variants"].items() if "us" in r}
            exact = sorted((r["us"], v) for v, r in ok.items() if r["equal_frac"] == 1.0)
            print(f"{name} rows {rows}: table {ok['table']['us']:.1f} us eq {ok['table']['equal_frac']:.4f}, "
                  f"cublas {ok['cublas']['us']:.1f} eq {ok['cublas']['equal_frac']:.4f}; fastest exact: "
                  + ", ".join(f"{v} {u:.1f}" for u, v in exact[:3])
                  + f"; errors {sum('error' in r for r in res['variants'].values())}", flush=True)
        del weights, x_big, full
    report["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
