"""The decode-attention kernel (engine/fqkernels/decode_attention.py) against SDPA.

One query per sequence over a cache of `context` valid positions (capacity == context), the heads
of --family's attention layers. Each arm is one CUDA graph of a call per layer of a
[layers, B, KVH, C, D] cache, with enough layers that a replay reads several L2s of K and V: the
time is of KV streamed from HBM, as in a decode step (runner.time_graph). Per (batch, context):
microseconds a call and GB/s of K and V read for both arms, the kernel's split count, and the
largest difference of the last layer's outputs.

Without a GPU the kernel arm is decode_attention_reference (torch).
"""
from __future__ import annotations

from bench.runner import Column, copies, engine_on_path, gpu_visible, int_list, positive_int, time_graph

# attention heads, KV heads, head_dim
FAMILIES = {"qwen3-4b": (32, 8, 128), "qwen3.5-4b": (16, 4, 256)}

COLUMNS = [Column("batch", width=5), Column("context", width=7), Column("num_splits", "splits", width=6),
           Column("layers", width=6), Column("kernel_us", "kernel us", fmt="{:.2f}"),
           Column("kernel_gbps", "GB/s", fmt="{:.0f}", width=6), Column("sdpa_us", "SDPA us", fmt="{:.2f}"),
           Column("sdpa_gbps", "GB/s", fmt="{:.0f}", width=6), Column("speedup", "x SDPA", fmt="{:.2f}", width=6),
           Column("max_abs_diff", "max|diff|", fmt="{:.2e}")]


def add_arguments(parser) -> None:
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen3-4b",
                        help="whose attention heads (default qwen3-4b: 32 / 8 / 128; qwen3.5-4b: 16 / 4 / 256)")
    parser.add_argument("--heads", type=positive_int, default=None, help="query heads (overrides --family)")
    parser.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (overrides --family)")
    parser.add_argument("--head-dim", type=positive_int, default=None, help="head dim (overrides --family)")
    parser.add_argument("--batches", type=int_list, default=[1, 4, 16], help="default 1,4,16")
    parser.add_argument("--contexts", type=int_list, default=[512, 2048, 8192, 32768],
                        help="valid cache positions (default 512,2048,8192,32768)")
    parser.add_argument("--reps", type=positive_int, default=50, help="timed graph replays (default 50)")


def run(args, report) -> None:
    import torch
    import torch.nn.functional as F

    engine_on_path()
    from fqkernels import decode_attention as da

    heads, kv_heads, head_dim = FAMILIES[args.family]
    heads, kv_heads, head_dim = args.heads or heads, args.kv_heads or kv_heads, args.head_dim or head_dim
    if heads % kv_heads:
        from bench.runner import BenchError

        raise BenchError(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    gpu = gpu_visible()
    device = "cuda" if gpu else "cpu"
    if not gpu:
        report.note("# no GPU: the kernel arm is decode_attention_reference")
    scale = head_dim ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    for batch in args.batches:
        for context in args.contexts:
            layer_bytes = 2 * batch * kv_heads * context * head_dim * 2     # K and V, bf16
            layers = copies(layer_bytes, limit=256)
            shape = (layers, batch, kv_heads, context, head_dim)
            k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
            v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
            q = torch.randn((batch, heads, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
            lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
            out = torch.empty_like(q)

            if gpu:
                def kernel(layer):
                    da.decode_attention(q, k_cache[layer], v_cache[layer], lengths, scale, out=out)
            else:
                def kernel(layer):
                    out.copy_(da.decode_attention_reference(q, k_cache[layer], v_cache[layer], lengths, scale))

            def sdpa(layer):
                return F.scaled_dot_product_attention(q.unsqueeze(2), k_cache[layer], v_cache[layer], scale=scale,
                                                      enable_gqa=True)

            order = list(range(layers))
            kernel_us = time_graph(kernel, order, args.reps)
            sdpa_us = time_graph(sdpa, order, args.reps)
            kernel(layers - 1)
            diff = (out.float() - sdpa(layers - 1).squeeze(2).float()).abs().max().item()
            plan = da.decode_attention_plan(batch, heads, kv_heads, context, head_dim)
            report.add({"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "batch": batch,
                        "context": context, "num_splits": plan.num_splits, "layers": layers,
                        "kv_bytes_per_call": layer_bytes, "kernel_impl": "kernel" if gpu else "reference",
                        "kernel_us": kernel_us, "kernel_gbps": layer_bytes / kernel_us / 1e3,
                        "sdpa_us": sdpa_us, "sdpa_gbps": layer_bytes / sdpa_us / 1e3,
                        "speedup": sdpa_us / kernel_us, "max_abs_diff": diff})
            del k_cache, v_cache
            if gpu:
                torch.cuda.empty_cache()
