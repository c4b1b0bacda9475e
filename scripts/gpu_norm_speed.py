"""Graphed decode-step time of the engine with each RMSNorm kernel variant, on one
loaded model: the torch-order kernel (the default) and Triton's tl.sum
(FASTQWEN_TORCH_ORDER_NORM=0). Session 6 measured with this script the torch-order
kernel's earlier two-pass form and other warp counts (results/PERF_LOG.md). Variants are timed in
rotation, several rounds, each round a fresh graph capture; the median per variant
is reported. Each torch-order variant is first checked bit for bit against the
emulation of torch's order (fqkernels.rmsnorm.mean_of_squares_torch_order) on the
decode's own launch (add_rmsnorm_partials) at every batch timed.

    python scripts/gpu_norm_speed.py --model DIR [--batches 1,4,16,64] [--prompt 512] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine"))

from engine import Engine  # noqa: E402
from fq_decode import DecodeRunner  # noqa: E402
from fqkernels import rmsnorm as rn  # noqa: E402
from gpu_check import runner_step_ms  # noqa: E402

# name -> TORCH_ORDER
VARIANTS = {"tl_sum": False, "torch_order": True}


def _set(variant: str) -> None:
    rn.TORCH_ORDER = VARIANTS[variant]


def bits_ok(rows: int, n: int, splits: int = 4) -> bool:
    """The decode's fused launch (S fp32 partials + residual + norm) against the emulation."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn((rows, n), generator=g, device="cuda") * 3).bfloat16()
    parts = torch.randn((splits, rows, n), generator=g, device="cuda")
    w = (torch.rand(n, generator=g, device="cuda") + 0.5).bfloat16()
    xk = x.clone()
    out = rn.add_rmsnorm_partials(xk, parts, w, 1e-6)
    acc = parts[0].clone()
    for s in range(1, splits):
        acc += parts[s]
    s_ = (x.float() + acc.bfloat16().float()).bfloat16()
    vec, halves, _ = rn.torch_order(n, x.device)
    mean = rn.mean_of_squares_torch_order(s_, vec, halves)
    if not torch.equal(rn.torch_order_mean_of_squares(x, parts, partials=True), mean):
        return False
    var = mean[:, None] + torch.tensor(1e-6, device="cuda")
    want = (w.float() * (s_.float() * torch.rsqrt(var)).bfloat16().float()).bfloat16()
    return bool(torch.equal(xk, s_) and torch.equal(out, want))


def step_ms(eng: Engine, batch: int, prompt: int, steps: int) -> float:
    runner = DecodeRunner(eng.model, batch, True)
    with torch.inference_mode():
        runner.start(torch.zeros(batch, dtype=torch.int64, device="cuda"), prompt)
        return runner_step_ms(runner, steps, warmup=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "norm_speed.json"))
    args = ap.parse_args()
    names = args.variants.split(",")
    eng = Engine(args.model)
    hidden = eng.cfg.hidden_size
    report = {"model": args.model, "torch": torch.__version__, "prompt": args.prompt, "steps": args.steps,
              "rounds": args.rounds, "bits": {}, "step_ms": {}}
    t0 = time.perf_counter()
    for batch in [int(b) for b in args.batches.split(",")]:
        # Cache, RoPE tables and the GEMV tuning for this batch, through the engine's own path.
        list(eng.generate(torch.randint(0, 1000, (batch, args.prompt)).tolist(), 2))
        times = {n: [] for n in names}
        for n in names:
            _set(n)
            if VARIANTS[n]:
                report["bits"][f"{n}_b{batch}"] = bits_ok(batch, hidden)
        for _ in range(args.rounds):
            for n in names:
                _set(n)
                times[n].append(step_ms(eng, batch, args.prompt, args.steps))
        med = {n: statistics.median(v) for n, v in times.items()}
        report["step_ms"][str(batch)] = {"median": med, "all": times}
        base = med.get("tl_sum")
        print(f"b{batch}: " + "  ".join(f"{n} {m:.4f} ms" + (f" ({(m / base - 1) * 100:+.1f}%)" if base else "")
                                        for n, m in med.items()), flush=True)
    rn.TORCH_ORDER = True
    report["seconds"] = time.perf_counter() - t0
    print("bits", report["bits"], flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
