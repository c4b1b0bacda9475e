"""The GDN prompt pass (gdn.chunked_prefill) run `--passes` times at one shape, nothing else:
the program a profiler wraps (the gdn-ncu stage: Nsight Compute over the solve, state and
output kernels of the last pass, their stall reasons, occupancy and throughput).

    python scripts/gpu_gdn_passes.py --shape 4x8192 [--passes 2] [--plan name=value,...]

Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from fqkernels import gdn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4x8192", help="BxT")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--plan", default="", help="a gdn.PrefillPlan as name=value,... (default: the default plan)")
    args = ap.parse_args()
    from bench_gdn import _inputs

    B, T = (int(x) for x in args.shape.split("x"))
    plan = gdn.plan_from_text(args.plan)
    q, k, v, g, beta = _inputs(B, T, torch.device("cuda"))
    for _ in range(args.passes):
        gdn.chunked_prefill(q, k, v, g, beta, plan=plan)
    torch.cuda.synchronize()
    print(f"{args.passes} passes at {B}x{T}, plan {plan}")


if __name__ == "__main__":
    main()
