"""Where a decode step and a prefill spend their GPU time, kernel by kernel.

Runs the engine's model eagerly (same kernels as the graph) under
torch.profiler and sums device time per kernel name, per step. The graph's
own step time (gpu_check.py) minus the sum of kernel times is the launch-gap
cost that fusing kernels or PDL would remove.

    python scripts/gpu_profile.py --model DIR [--shapes 1x512,16x512] [--out FILE]
"""
import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))

import engine as fast_engine  # noqa: E402


def kernel_table(prof, steps: int) -> dict:
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time / steps if hasattr(ev, "device_time") else ev.cuda_time / steps
            per[ev.name][1] += 1
    rows = sorted(((name[:90], round(us, 2), n // steps) for name, (us, n) in per.items()), key=lambda r: -r[1])
    return {"total_us": round(sum(r[1] for r in rows), 1), "kernels": rows[:40]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="1x512,4x2048,16x512")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile.json"))
    args = ap.parse_args()
    eng = fast_engine.Engine(args.model)
    model = eng.model
    report = {"gpu": torch.cuda.get_device_name()}
    for spec in args.shapes.split(","):
        B, S = (int(v) for v in spec.split("x"))
        prompts = torch.randint(0, eng.cfg.vocab_size, (B, S)).tolist()
        list(eng.generate(prompts, 4))  # warm: tune, compile, capture
        ids = torch.tensor(prompts, device="cuda")
        steps = 10
        with torch.inference_mode():
            tok = model.prefill(ids)
            torch.cuda.synchronize()
            pos = torch.full((B,), S, dtype=torch.int32, device="cuda")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    tok = model.decode(tok, pos, pos + 1)
                torch.cuda.synchronize()
            decode = kernel_table(prof, steps)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.prefill(ids)
                torch.cuda.synchronize()
            prefill = kernel_table(prof, 1)
        report[spec] = {"decode_step": decode, "prefill": prefill, "gemv_choice": {str(k): v for k, v in eng.tuning.items()}}
        print(spec, "decode kernels sum", decode["total_us"], "us; prefill kernels sum", prefill["total_us"], "us", flush=True)
        for row in decode["kernels"][:12]:
            print("   ", row, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
