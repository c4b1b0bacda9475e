"""Is a batch-1 decode product with the residual add + norm in its last program
(gemv.linear_add_rmsnorm) faster than the product then the norm's own kernel
(gemv.linear + rmsnorm.add_rmsnorm)? At the 4B products that feed a norm (o_proj / out_proj
2560 x 4096, down 2560 x 9216), each timed as a CUDA graph over 24 weight copies (fq_ops._time_over),
the bits of the two compared first. Qwen3.5's (1 + w) norm and Qwen3's plain one.

    python scripts/gpu_norm_tail_probe.py [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
from fq_ops import _time_over  # noqa: E402
from fqkernels import gemv, rmsnorm  # noqa: E402

COPIES = 24


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "norm_tail_probe.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (n, k) in {"o_proj": (2560, 4096), "down": (2560, 9216)}.items():
        ws = [(torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16)
        nw = (torch.randn(n, generator=gen, device=dev) * 0.1).to(torch.bfloat16)
        res = torch.randn(1, n, generator=gen, device=dev).to(torch.bfloat16)
        for one_plus in (True, False):
            a, b = res.clone(), res.clone()
            got = gemv.linear_add_rmsnorm(x, ws[0], a, nw, 1e-6, one_plus=one_plus)
            want = rmsnorm.add_rmsnorm(b, gemv.linear(x, ws[0]), nw, 1e-6, one_plus=one_plus)
            same = bool(torch.equal(got, want) and torch.equal(a, b))
            work = res.clone()
            t_two = _time_over(lambda w: rmsnorm.add_rmsnorm(work, gemv.linear(x, w), nw, 1e-6, one_plus=one_plus),
                               ws, 20)
            t_one = _time_over(lambda w: gemv.linear_add_rmsnorm(x, w, work, nw, 1e-6, one_plus=one_plus), ws, 20)
            rows.append({"product": name, "n": n, "k": k, "one_plus": one_plus, "same_bits": same,
                         "product_then_norm_us": round(t_two, 2), "norm_in_last_program_us": round(t_one, 2)})
            print(json.dumps(rows[-1]), flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
