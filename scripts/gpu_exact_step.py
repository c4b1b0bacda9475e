"""The GDN decode step in the full forward's arithmetic (fqkernels/gdn_exact_step.py) on the GPU,
at the Qwen3.5-4B's shapes (16 q/k heads, 32 value heads of 128): per batch, its outputs over 72
steps (a chunk and 8 rows of the next) against the reference's chunked rule over the whole
sequence from the same state (bit for bit: the fraction of elements that differ, the state after
the chunk's close), and one step's time as a CUDA graph (torch's per-step pieces, the row kernel,
the close) beside the recurrent kernel's (gdn.decode_step): the median over 64 replays, each the
next row of the chunk (all 64 rows once).

    python scripts/gpu_exact_step.py [--batches 1,4,16] [--out FILE]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))

from fqkernels import gdn, gdn_exact_step as step  # noqa: E402
from gpu_rule_bits_probe import graphed_us  # noqa: E402

HK, HV, D, STEPS = 16, 32, 128, 72


def inputs(B: int, seed: int):
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, STEPS, HK, D, device="cuda", generator=g_).bfloat16() for _ in range(2))
    v = torch.randn(B, STEPS, HV, D, device="cuda", generator=g_).bfloat16()
    g = -F.softplus(torch.randn(B, STEPS, HV, device="cuda", generator=g_)) * 0.1
    beta = torch.rand(B, STEPS, HV, device="cuda", generator=g_).bfloat16()
    state = torch.randn(B, HV, D, D, device="cuda", generator=g_) * 0.1
    return q, k, v, g, beta, state


def bits(B: int) -> dict:
    q, k, v, g, beta, state = inputs(B, seed=B)
    want, _, at_64 = gdn.delta_rule_chunked_reference(gdn.expand_heads(q, HV), gdn.expand_heads(k, HV), v, g, beta,
                                                      state=state, capture=1)
    rows, S, outs = step.ChunkRows(B, HV, D, D, "cuda"), state.clone(), []
    closed = None
    for i in range(STEPS):
        t = torch.full((B,), i % gdn.CHUNK, dtype=torch.int64, device="cuda")
        qs, kn, kb, vb, gamma = step.chunk_step_inputs(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], rows, t)
        outs.append(step.chunk_step(qs, kn, kb, vb, gamma, t, S, rows))
        step.chunk_close(gamma, t, S, rows)
        if i == gdn.CHUNK - 1:
            closed = S.clone()
    got = torch.stack(outs, 1)
    return {"out_fraction_differing": float((got != want).float().mean()),
            "out_bit_equal": bool(torch.equal(got, want)),
            "out_max_abs": float((got.float() - want.float()).abs().max()),
            "state_fraction_differing": float((closed != at_64).float().mean()),
            "state_bit_equal": bool(torch.equal(closed, at_64))}


def timing(B: int) -> dict:
    q, k, v, g, beta, state = inputs(B, seed=100 + B)
    q, k, v, g, beta = (x[:, 0].contiguous() for x in (q, k, v, g, beta))
    rows, S = step.ChunkRows(B, HV, D, D, "cuda"), state.clone()
    t = torch.zeros(B, dtype=torch.int64, device="cuda")

    def exact():
        qs, kn, kb, vb, gamma = step.chunk_step_inputs(q, k, v, g, beta, rows, t)
        step.chunk_step(qs, kn, kb, vb, gamma, t, S, rows)
        step.chunk_close(gamma, t, S, rows)
        t.add_(1).remainder_(gdn.CHUNK)                 # the next row (a decode step's position)

    R = state.clone()
    return {"us_exact_step": graphed_us(exact, reps=64),
            "us_recurrent_step": graphed_us(lambda: gdn.decode_step(q, k, v, g, beta, R), reps=64)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {}
    for B in (int(b) for b in args.batches.split(",")):
        report[str(B)] = {**bits(B), **timing(B)}
        print(B, report[str(B)], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
