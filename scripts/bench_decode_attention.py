"""Time the decode-attention kernel against SDPA, both captured in a CUDA graph.

Shape: Qwen3-4B attention (32 query heads, 8 KV heads, head_dim 128), every cache
position valid (capacity == context). Each graph calls the op once per layer of a
[layers, B, KVH, C, D] cache, with enough layers that the KV read per replay is
several times the L2: the timing is of KV streamed from HBM, as in a real decode
step, not of a cache that stays resident. Reported per call: microseconds (median
over replays) and GB/s of K and V read.

    python scripts/bench_decode_attention.py [--out results.json]

With no --out, the JSON goes to $OUT/bench_decode_attention.json when OUT is set.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine"))

from fqkernels.decode_attention import decode_attention, decode_attention_plan  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# Rotate through at least this multiple of the L2 per replay, so little of it is a hit.
L2_MULTIPLE = 4
MAX_LAYERS = 256


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _commit() -> str:
    result = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() if result.returncode == 0 else "uncommitted"


def _time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median milliseconds of one replay, each replay timed by its own pair of events."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _capture(fn) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    # Warm up on a side stream first (Triton compiles, SDPA picks its kernel, the
    # attention workspace is allocated), as capture requires.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_one(batch: int, context: int, l2_bytes: int, replays: int) -> dict:
    device = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    layer_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * 2  # K and V, bf16
    layers = max(1, min(MAX_LAYERS, math.ceil(L2_MULTIPLE * l2_bytes / layer_bytes)))
    shape = (layers, batch, KV_HEADS, context, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    q = torch.randn((batch, HEADS, HEAD_DIM), device=device, dtype=torch.bfloat16)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    sdpa_out: list[torch.Tensor] = []

    def run_kernel() -> None:
        for layer in range(layers):
            decode_attention(q, k_cache[layer], v_cache[layer], lengths, scale, out=out)

    def run_sdpa() -> None:
        sdpa_out.clear()
        q4 = q.unsqueeze(2)  # [B, H, 1, D]
        for layer in range(layers):
            sdpa_out.append(
                F.scaled_dot_product_attention(q4, k_cache[layer], v_cache[layer], scale=scale, enable_gqa=True)
            )

    kernel_ms = _time_graph(_capture(run_kernel), replays) / layers
    sdpa_ms = _time_graph(_capture(run_sdpa), replays) / layers
    # Sanity: both computed the same attention of the last layer (within bf16 rounding).
    max_diff = (out.float() - sdpa_out[-1].squeeze(2).float()).abs().max().item()
    plan = decode_attention_plan(batch, HEADS, KV_HEADS, context, HEAD_DIM)
    del k_cache, v_cache, sdpa_out
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "context": context,
        "num_splits": plan.num_splits,
        "layers_rotated": layers,
        "kv_bytes_per_call": layer_bytes,
        "kernel_us": kernel_ms * 1e3,
        "kernel_gbps": layer_bytes / (kernel_ms * 1e-3) / 1e9,
        "sdpa_us": sdpa_ms * 1e3,
        "sdpa_gbps": layer_bytes / (sdpa_ms * 1e-3) / 1e9,
        "max_abs_diff_vs_sdpa": max_diff,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--batches", type=_int_list, default=[1, 4, 16])
    parser.add_argument("--contexts", type=_int_list, default=[512, 2048, 8192, 32768])
    parser.add_argument("--replays", type=int, default=100, help="timed graph replays per measurement")
    args = parser.parse_args(argv)
    if args.replays < 1:
        parser.error(f"--replays must be positive, got {args.replays}")
    if not torch.cuda.is_available():
        print("bench_decode_attention: needs a CUDA device", file=sys.stderr)
        return 2
    out_path = args.out
    if out_path is None and os.environ.get("OUT"):
        out_path = Path(os.environ["OUT"]) / "bench_decode_attention.json"

    props = torch.cuda.get_device_properties(0)
    # L2_cache_size is missing on some torch builds; 50 MiB is the H100's.
    l2_bytes = int(getattr(props, "L2_cache_size", 50 * 2**20))
    rows = []
    header = f"{'B':>3} {'ctx':>6} {'splits':>6} {'layers':>6} | {'kernel us':>9} {'GB/s':>6} | {'sdpa us':>8} {'GB/s':>6} | {'x':>5}"
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}; H={HEADS} KVH={KV_HEADS} D={HEAD_DIM}")
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        for context in args.contexts:
            row = bench_one(batch, context, l2_bytes, args.replays)
            rows.append(row)
            print(
                f"{batch:>3} {context:>6} {row['num_splits']:>6} {row['layers_rotated']:>6} | "
                f"{row['kernel_us']:>9.2f} {row['kernel_gbps']:>6.0f} | {row['sdpa_us']:>8.2f} {row['sdpa_gbps']:>6.0f} | "
                f"{row['sdpa_us'] / row['kernel_us']:>5.2f}",
                flush=True,
            )
    record = {
        "benchmark": "decode_attention",
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "timing": f"CUDA graph replays, median of {args.replays}, per call; KV rotated over >= {L2_MULTIPLE}x L2",
        "rows": rows,
    }
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out_path}")
    else:
        print("no --out and no OUT set: JSON not written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
