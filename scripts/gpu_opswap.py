"""Which op moves the logits? Teacher-forced over one fixed token sequence, the
engine's model runs with every op set variant (all torch references on the GPU,
all Triton, and the references with one Triton op swapped in), and each
variant's per-step logits are compared with native Transformers' full forward
(the replay's truth), next to native's own cached decode as the yardstick.

    python scripts/gpu_opswap.py --model DIR [--shape 4x96x24] [--out FILE]
"""
import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))

import fq_ops  # noqa: E402
from fq_config import ModelConfig  # noqa: E402
from fq_model import Qwen3Model  # noqa: E402
from fq_weights import load_weights  # noqa: E402


CFG = None  # the model config, set in main (the unpacked variants need the q/kv sizes)


def _unpacked(decode_too: bool):
    """Reference ops with the packed QKV and gate/up products computed as the
    reference computes them: one product per projection (q, k, v; gate, up).
    Tells whether packing alone (cuBLAS picking other kernels for the wider
    matrix) moves the logits. With decode_too=False only prefill (rows > 64)."""
    from fqkernels import swiglu
    F = torch.nn.functional

    def linear(x, w):
        if (decode_too or x.shape[0] > 64) and w.shape[0] == CFG.q_size + 2 * CFG.kv_size:
            q, kv = CFG.q_size, CFG.kv_size
            return torch.cat([F.linear(x, w[:q]), F.linear(x, w[q:q + kv]), F.linear(x, w[q + kv:])], -1)
        return F.linear(x, w)

    def linear_silu_mul(x, w):
        if decode_too or x.shape[0] > 64:
            half = w.shape[0] // 2
            return F.silu(F.linear(x, w[:half])) * F.linear(x, w[half:])
        return swiglu.silu_mul_reference(F.linear(x, w))

    return {"linear": linear, "linear_silu_mul": linear_silu_mul}


def sdpa_decode_attention(q, k_cache, v_cache, lengths, scale):
    """Decode attention as native's cached path runs it: K/V of the valid positions
    expanded to the query heads, SDPA with one query row (its flash backend here)."""
    L = int(lengths[0])
    assert bool((lengths == L).all()), "the probe feeds equal lengths"
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :L].repeat_interleave(group, dim=1)
    v = v_cache[:, :, :L].repeat_interleave(group, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)
    return o[:, :, 0]


def variants():
    from fqkernels import decode_attention as da, gemv, rmsnorm as rn, rope_kv, swiglu
    gemv_ops = {"linear": lambda x, w: gemv.linear(x.contiguous(), w) if x.shape[0] <= 64 else torch.nn.functional.linear(x, w),
                "linear_silu_mul": lambda x, w: gemv.linear_silu_mul(x.contiguous(), w) if x.shape[0] <= 64
                else swiglu.silu_mul_reference(torch.nn.functional.linear(x, w))}
    return {
        "torch": {},
        "torch_unpacked_prefill": _unpacked(decode_too=False),
        "torch_unpacked": _unpacked(decode_too=True),
        "+rmsnorm": {"embed_rmsnorm": rn.embed_rmsnorm, "add_rmsnorm": rn.add_rmsnorm},
        "+rope": {"qk_norm_rope_store": rope_kv.qk_norm_rope_store},
        "+attention": {"decode_attention": da.decode_attention},
        "+silu": {"silu_mul": swiglu.silu_mul},
        "+gemv": gemv_ops,
        "triton_cublas": {"embed_rmsnorm": rn.embed_rmsnorm, "add_rmsnorm": rn.add_rmsnorm,
                          "qk_norm_rope_store": rope_kv.qk_norm_rope_store,
                          "decode_attention": da.decode_attention, "silu_mul": swiglu.silu_mul},
        "torch+sdpa_decode": {"decode_attention": sdpa_decode_attention},
        "triton_cublas+sdpa_decode": {"embed_rmsnorm": rn.embed_rmsnorm, "add_rmsnorm": rn.add_rmsnorm,
                                      "qk_norm_rope_store": rope_kv.qk_norm_rope_store,
                                      "decode_attention": sdpa_decode_attention, "silu_mul": swiglu.silu_mul},
        "+attention_1split": {"decode_attention": lambda q, k, v, n, sc: da.decode_attention(q, k, v, n, sc, num_splits=1)},
        "+attention_oldest_first": {"decode_attention": lambda q, k, v, n, sc: da.decode_attention(
            q, k, v, n, sc, flash_order=False)},
        "triton_all": dict(embed_rmsnorm=rn.embed_rmsnorm, add_rmsnorm=rn.add_rmsnorm, qk_norm_rope_store=rope_kv.qk_norm_rope_store,
                           decode_attention=da.decode_attention, silu_mul=swiglu.silu_mul, **gemv_ops),
    }


def forced_logits(model, prompts, toks):
    B, S = prompts.shape
    N = toks.shape[1]
    model.ensure_rope(S + N)
    model.allocate_cache(B, S + N)
    with torch.inference_mode():
        out = [model.prefill_logits(prompts)]
        pos = torch.full((B,), S, dtype=torch.int32, device=prompts.device)
        for t in range(N - 1):
            out.append(model.decode_logits(toks[:, t].contiguous(), pos, pos + 1))
            pos += 1
    return torch.stack(out, 1).float()


def compare(lg, full):
    d = (lg - full).abs().amax(-1)
    am = lg.argmax(-1)
    slack = full.amax(-1) - full.gather(-1, am[..., None])[..., 0]
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "p99": float(torch.quantile(d.flatten(), 0.99)),
            "argmax_differs": int((slack > 0).sum()), "max_slack": float(slack.max()), "positions": int(d.numel())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--shape", default="4x96x24")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    B, S, N = (int(v) for v in args.shape.split("x"))
    dev = torch.device("cuda")
    cfg = ModelConfig.from_dir(args.model)
    global CFG
    CFG = cfg
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    w = load_weights(args.model, cfg, dev)
    from transformers import Qwen3ForCausalLM

    from fastqwen.numerics import pin_reference_numerics
    pin_reference_numerics()  # the platform's reference: flash attention, not cuDNN's
    native = Qwen3ForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, cfg.vocab_size, (B, S), generator=g).to(dev)
    with torch.inference_mode():  # native's own greedy tokens, cached path, and its logits
        out = native(input_ids=prompts, use_cache=True)
        cache, cached, tok = out.past_key_values, [out.logits[:, -1]], out.logits[:, -1].argmax(-1)
        toks = [tok]
        for _ in range(N - 1):
            out = native(input_ids=tok[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            cached.append(out.logits[:, -1])
            tok = out.logits[:, -1].argmax(-1)
            toks.append(tok)
        toks = torch.stack(toks, 1)
        full = native(input_ids=torch.cat([prompts, toks], 1), logits_to_keep=N + 1).logits[:, :-1].float()
    cached_lg = torch.stack(cached, 1).float()
    report = {"model": args.model, "shape": [B, S, N], "native_cached": compare(cached_lg, full)}
    del native, cache
    for name, over in variants().items():
        ops = fq_ops.TorchOps()
        for k, v in over.items():
            setattr(ops, k, v)
        model = Qwen3Model(cfg, w, dev, ops)
        lg = forced_logits(model, prompts, toks)
        report[name] = compare(lg, full)
        # 0 when this variant's prefill (first step) is native's bit for bit; then per-step identity
        report[name]["first_step_vs_native_cached"] = float((lg[:, 0] - cached_lg[:, 0]).abs().max())
        report[name]["steps_identical_to_native_cached"] = int((lg == cached_lg).all(-1).all(0).sum())
        print(name, json.dumps(report[name]), flush=True)
    print("native_cached", json.dumps(report["native_cached"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
