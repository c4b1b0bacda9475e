"""Peak GPU memory of the engine per shape, each in a fresh process (as the judge runs it),
against the issue's bar: weights + KV cache + 3 GiB.

For each shape and each MLP slice setting, a child process loads the engine, runs one
generate (the warmup) and one more, and reports torch.cuda.max_memory_reserved() over
its whole life (the judge's memory gate), the allocated peak, the KV cache as
allocated and as the shape needs it (batch x (prompt + output - 1) positions), and
the second call's TTFT.

Usage: python scripts/gpu_memory.py --model DIR [--shapes 1x32000x8,2x16384x8] [--mlp-rows 16384,0]
(--mlp-rows 0: the prefill's MLP over a group's rows unsliced)
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30


def child(model: str, shape: str, mlp_rows: int) -> dict:
    import torch

    sys.path.insert(0, os.path.join(REPO, "engine"))
    import fq_model

    fq_model.MLP_ROWS = mlp_rows or 1 << 62   # 0: never slice
    import engine as fast_engine

    batch, prompt, output = (int(v) for v in shape.split("x"))
    eng = fast_engine.Engine(model)
    ids = torch.randint(0, eng.cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in eng.generate(ids, output):   # warmup
        pass
    t0 = time.perf_counter()
    it = eng.generate(ids, output)
    next(it)
    ttft = time.perf_counter() - t0
    for _ in it:
        pass
    torch.cuda.synchronize()
    weights = eng.model.w.nbytes()
    kv_alloc = 2 * eng.model.k_cache.numel() * eng.model.k_cache.element_size()
    kv_need = eng.cfg.kv_bytes_per_token * batch * (prompt + output - 1)
    reserved = torch.cuda.max_memory_reserved()
    return {"shape": [batch, prompt, output], "mlp_rows": mlp_rows, "ttft_ms": ttft * 1e3,
            "peak_reserved_GiB": reserved / GiB, "peak_allocated_GiB": torch.cuda.max_memory_allocated() / GiB,
            "weights_GiB": weights / GiB, "kv_allocated_GiB": kv_alloc / GiB, "kv_needed_GiB": kv_need / GiB,
            "bar_GiB": (weights + kv_need) / GiB + 3.0,
            "over_weights_and_kv_GiB": (reserved - weights - kv_need) / GiB}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="1x32000x8,2x16384x8,16x2048x32")
    ap.add_argument("--mlp-rows", default="16384,0")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_memory.json"))
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "MLP_ROWS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child[0], int(args.child[1]))))
        return
    rows = []
    for shape in args.shapes.split(","):
        for mlp_rows in (int(v) for v in args.mlp_rows.split(",")):
            proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", shape, str(mlp_rows)],
                                  capture_output=True, text=True)
            if proc.returncode:
                row = {"shape": shape, "mlp_rows": mlp_rows, "error": proc.stderr[-2000:]}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
