"""Which summation order does torch's CUDA `x.pow(2).mean(-1)` use on this GPU? Compares it,
bit for bit per row, with a family of candidate orders (vector width, lanes, accumulators,
how accumulators and lanes are combined, factor or division), for a few row counts and
widths; and times the RMSNorm kernel per launch. Prints a table; --out writes JSON.

    python scripts/gpu_reduce_order_probe.py [--out FILE]
"""
import argparse
import itertools
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))


def candidate(sq, vec, lanes, accs, acc_combine, lane_tree, final):
    """sq [M, N] float32 squares -> [M] under one candidate order."""
    m, n = sq.shape
    if vec > 1:
        # lane t, accumulator i takes element vec*(t + lanes*j) + i (i < vec), in order of j
        per = vec * lanes
        blocks = -(-n // per)
        x = torch.nn.functional.pad(sq, (0, blocks * per - n)).view(m, blocks, lanes, vec).transpose(2, 3)
        acc = torch.zeros(m, vec, lanes, device=sq.device)
        for j in range(blocks):
            acc = acc + x[:, j]
    else:
        # unrolled by `accs`: accumulator i takes element t + lanes*(accs*k + i), in order of k
        per = lanes * accs
        blocks = -(-n // per)
        x = torch.nn.functional.pad(sq, (0, blocks * per - n)).view(m, blocks, accs, lanes)
        acc = torch.zeros(m, accs, lanes, device=sq.device)
        for j in range(blocks):
            acc = acc + x[:, j]
    parts = [acc[:, i] for i in range(acc.shape[1])]
    if acc_combine == "seq":
        v = parts[0]
        for p in parts[1:]:
            v = v + p
    else:  # pairwise tree
        while len(parts) > 1:
            parts = [parts[k] + parts[k + 1] for k in range(0, len(parts), 2)]
        v = parts[0]
    if lane_tree == "down":   # adjacent pairs first
        while v.shape[1] > 1:
            v = v[:, 0::2] + v[:, 1::2]
    else:                     # xor butterfly: halves first
        while v.shape[1] > 1:
            h = v.shape[1] // 2
            v = v[:, :h] + v[:, h:]
    s = v[:, 0]
    if final == "factor":
        return s * (torch.tensor(1.0, device=sq.device) / torch.tensor(float(n), device=sq.device))
    return s / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    report = {"torch": torch.__version__, "orders": []}
    grid = list(itertools.product((1, 2, 4, 8), (32, 64, 128), (1, 2, 4, 8), ("seq", "tree"), ("down", "xor"),
                                  ("factor", "div")))
    for n in (2560, 1024, 128, 64):
        for m in (16, 64, 2048, 1, 4):
            x = (torch.randn(m, n, device="cuda") * 4).bfloat16()
            want = x.float().pow(2).mean(-1)
            sq = x.float().square()
            best = []
            for vec, lanes, accs, ac, lt, fin in grid:
                if vec > 1 and accs != vec:
                    continue
                got = candidate(sq, vec, lanes, accs, ac, lt, fin)
                frac = float((got == want).float().mean())
                best.append((frac, dict(vec=vec, lanes=lanes, accs=accs, acc_combine=ac, lane_tree=lt, final=fin)))
            best.sort(key=lambda b: -b[0])
            report["orders"].append({"n": n, "m": m, "best": [{"match": f, **c} for f, c in best[:4]]})
            print(f"n={n:5d} m={m:5d} best {best[0][0]:.3f} {best[0][1]}  next {best[1][0]:.3f} {best[1][1]}", flush=True)
    # per-launch time of the norm kernels (graph of 72 launches, as in a decode step)
    from fqkernels import rmsnorm as rn
    times = {}
    for m in (1, 16, 64):
        x = (torch.randn(m, 2560, device="cuda") * 4).bfloat16()
        r = (torch.randn(m, 2560, device="cuda")).bfloat16()
        w = torch.randn(2560, device="cuda").bfloat16()
        out = torch.empty_like(x)
        for _ in range(2):
            rn.add_rmsnorm(x, r, w, 1e-6, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(72):
                rn.add_rmsnorm(x, r, w, 1e-6, out=out)
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3 / 72)
        times[m] = sorted(ts)[10]
        print(f"add_rmsnorm m={m}: {times[m]:.2f} us per launch", flush=True)
    report["add_rmsnorm_us"] = times
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
