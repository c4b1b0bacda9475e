"""Launch sweeps of two prompt-pass kernels of Qwen3.5's GDN layers that are bandwidth-bound:
the gated RMSNorm (gdn.gated_rmsnorm: rows a program, warps) and the causal conv + SiLU
(gdn.causal_conv_prefill: positions and channels a program, warps), at the 4B's widths for
a prompt pass of 512 and 8,192 tokens. Each launch is checked bit for bit against the
default launch's output (every launch must give the same bits) and timed; the achieved
bandwidth counts each tensor read or written once.

    python scripts/gpu_prefill_pieces.py [--out PATH]

Needs a CUDA device. Writes {"gated_rmsnorm": [...], "conv": [...]} to JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
from fqkernels import gdn  # noqa: E402

HEADS, DV, CONV, Z_COLS = 32, 128, 8192, 4096       # the 4B: value heads, head width, conv channels


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60) * 1000.0   # us


def gated_norm_sweep(tokens: int, dev) -> list:
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = (torch.randn(tokens * HEADS, DV, device=dev, generator=g) * 3).bfloat16()
    packed = torch.randn(tokens, CONV + Z_COLS + 64, device=dev, generator=g).bfloat16()
    z = packed[:, CONV:CONV + Z_COLS]                          # in_proj's z columns, read in place
    w = (torch.rand(DV, device=dev, generator=g) + 0.5).bfloat16()
    want = gdn.gated_rmsnorm(x, z, w, rows_per_program=1, num_warps=1)
    moved = 3 * x.numel() * 2
    rows = []
    for per, warps in [(1, 1), (2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (32, 8)]:
        got = gdn.gated_rmsnorm(x, z, w, rows_per_program=per, num_warps=warps)
        us = _time(lambda: gdn.gated_rmsnorm(x, z, w, rows_per_program=per, num_warps=warps))
        rows.append({"tokens": tokens, "rows_per_program": per, "num_warps": warps, "us": round(us, 2),
                     "tb_s": round(moved / us / 1e6, 3), "same_bits": bool(torch.equal(got, want))})
        print("gated_rmsnorm", json.dumps(rows[-1]), flush=True)
    us = _time(lambda: gdn.gated_rmsnorm(x, z, w))
    rows.append({"tokens": tokens, "default": True, "us": round(us, 2), "tb_s": round(moved / us / 1e6, 3),
                 "same_bits": bool(torch.equal(gdn.gated_rmsnorm(x, z, w), want))})
    print("gated_rmsnorm", json.dumps(rows[-1]), flush=True)
    return rows


def conv_sweep(tokens: int, batch: int, dev) -> list:
    g = torch.Generator(device=dev).manual_seed(tokens + 1)
    T = tokens // batch
    packed = torch.randn(batch, T, CONV + Z_COLS + 64, device=dev, generator=g).bfloat16()
    u = packed[..., :CONV]
    w = (torch.randn(CONV, 4, device=dev, generator=g) * 0.5).bfloat16()
    want, _ = gdn.causal_conv_prefill(u, w)
    moved = 2 * batch * T * CONV * 2
    rows = []
    for bt, bc, warps in [(32, 128, 4), (16, 256, 4), (32, 256, 4), (32, 256, 8), (64, 128, 4), (64, 256, 8),
                          (8, 512, 4), (16, 512, 4), (16, 512, 8), (64, 64, 4), (128, 64, 4), (128, 128, 8)]:
        got, _ = gdn.causal_conv_prefill(u, w, block_t=bt, block_c=bc, num_warps=warps)
        us = _time(lambda: gdn.causal_conv_prefill(u, w, block_t=bt, block_c=bc, num_warps=warps))
        rows.append({"tokens": tokens, "batch": batch, "block_t": bt, "block_c": bc, "num_warps": warps,
                     "us": round(us, 2), "tb_s": round(moved / us / 1e6, 3), "same_bits": bool(torch.equal(got, want))})
        print("conv", json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill_pieces.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    report = {"gated_rmsnorm": gated_norm_sweep(512, dev) + gated_norm_sweep(8192, dev),
              "conv": conv_sweep(512, 1, dev) + conv_sweep(8192, 4, dev) + conv_sweep(8192, 16, dev)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
