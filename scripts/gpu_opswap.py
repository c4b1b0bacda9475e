"""Which op moves the logits? Teacher-forced over native's own greedy tokens, the
engine's model runs with op-set variants (the engine as it runs, with one piece
swapped for what native uses; the torch reference ops), and each variant's per-step
logits are compared with native Transformers' full forward over the same tokens (the
replay's truth), next to native's own cached decode as the yardstick.

Per variant and shape: mean / p99 / max over positions of the max |logit diff| over the
vocabulary; argmax agreement with the full forward; how many positions would carry a
slack above 0.75 (the full forward's max minus its logit of the variant's argmax, the
judge's figure); the worst such slack.

    python scripts/gpu_opswap.py --model DIR --shapes 16x512x128,64x256x48 [--variants a,b] [--out FILE]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
sys.path.insert(0, REPO)

import fq_ops  # noqa: E402
from fq_config import ModelConfig  # noqa: E402
from fq_model import Qwen3Model  # noqa: E402
from fq_weights import load_weights  # noqa: E402

SLACK = 0.75


def sdpa_decode_attention(q, k_cache, v_cache, lengths, scale, window=None):
    """Decode attention as native's cached path runs it (no window): K/V of the valid
    positions repeated per query head, SDPA with one query row."""
    assert window is None, "the SDPA decode variant has no window"
    length = int(lengths[0])
    assert bool((lengths == length).all()), "the probe feeds equal lengths"
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :length].repeat_interleave(group, dim=1)
    v = v_cache[:, :, :length].repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)[:, :, 0]


def unpacked_products(cfg):
    """linear / linear_silu_mul as the reference computes them: one product per
    projection (q, k, v; gate, up) instead of the packed matrices."""
    from fqkernels import swiglu

    qkv_rows = cfg.q_size + 2 * cfg.kv_size

    def linear(x, w):
        if w.shape[0] == qkv_rows:
            q, kv = cfg.q_size, cfg.kv_size
            return torch.cat([F.linear(x, w[:q]), F.linear(x, w[q:q + kv]), F.linear(x, w[q + kv:])], -1)
        return F.linear(x, w)

    def linear_silu_mul(x, w):
        half = w.shape[0] // 2
        return swiglu.silu_mul_reference(torch.cat([F.linear(x, w[:half]), F.linear(x, w[half:])], -1))

    return linear, linear_silu_mul


def matrix_keys(w, rows):
    """The TritonOps.use_gemv keys of each decode matrix at `rows` rows."""
    layer = w.layers[0]
    return {"qkv": (False, rows) + tuple(layer.qkv.shape), "o": (False, rows) + tuple(layer.o.shape),
            "gate_up": (True, rows) + tuple(layer.gate_up.shape), "down": (False, rows) + tuple(layer.down.shape),
            "lm_head": (False, rows) + tuple(w.lm_head.shape)}


def build_variants(cfg, w, rows, names):
    """name -> op set. `engine` is the engine's own: Triton ops with the GEMV/cuBLAS
    choices its warmup makes for this batch (TritonOps.tune)."""
    from fqkernels import rmsnorm as rn, rope_kv

    keys = matrix_keys(w, rows)
    if w.embed.device.type != "cuda":  # a CPU smoke run of the script itself: torch variants only
        names = [n for n in names if n.startswith("torch")]
        tuned, timing = fq_ops.TorchOps(), {}
        tuned.use_gemv = {}
    else:
        tuned = fq_ops.TritonOps()
        timing = tuned.tune(w, rows)

    def engine(**over):
        ops = fq_ops.TritonOps()
        ops.use_gemv = dict(tuned.use_gemv)
        for k, v in over.items():
            setattr(ops, k, v)
        return ops

    def with_gemv(choice):
        ops = engine()
        ops.use_gemv.update(choice)
        return ops

    def torch_ops(unpacked):
        ops = fq_ops.TorchOps()
        ops.decode_attention = sdpa_decode_attention
        if unpacked:
            ops.linear, ops.linear_silu_mul = unpacked_products(cfg)
        return ops

    makers = {
        "torch_unpacked": lambda: torch_ops(True),
        "torch": lambda: torch_ops(False),
        "engine": engine,
        "engine_cublas": lambda: with_gemv({k: False for k in keys.values()}),
        "engine_gemv": lambda: with_gemv({k: True for k in keys.values()}),
        "engine_sdpa_attention": lambda: engine(decode_attention=sdpa_decode_attention),
        "engine_attention_1split": lambda: engine(decode_attention=lambda *a, **k: _attn(*a, num_splits=1, **k)),
        "engine_torch_norms": lambda: engine(embed_rmsnorm=rn.embed_rmsnorm_reference,
                                             add_rmsnorm=rn.add_rmsnorm_reference,
                                             add_rmsnorm_partials=rn.add_rmsnorm_partials_reference),
        "engine_torch_rope": lambda: engine(qk_norm_rope_store=rope_kv.qk_norm_rope_store_reference),
        "engine_tl_sum_norm": lambda: engine(embed_rmsnorm=_tl_sum(rn.embed_rmsnorm),
                                             add_rmsnorm=_tl_sum(rn.add_rmsnorm),
                                             add_rmsnorm_partials=_tl_sum(rn.add_rmsnorm_partials)),
    }
    for name, key in keys.items():
        makers[f"engine_cublas_{name}"] = lambda key=key: with_gemv({key: False})
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(makers)}")
    choice = {name: ("gemv" if tuned.use_gemv.get(key) else "cublas") for name, key in keys.items()}
    return {n: makers[n] for n in names}, {"choice": choice, "tune_us": timing}


def _tl_sum(norm):
    """The engine's norm launch with FASTQWEN_TORCH_ORDER_NORM=0's kernel (Triton's tl.sum, fqkernels/rmsnorm.py)."""
    from fqkernels import rmsnorm as rn

    def run(*args, **kwargs):
        saved, rn.TORCH_ORDER = rn.TORCH_ORDER, False
        try:
            return norm(*args, **kwargs)
        finally:
            rn.TORCH_ORDER = saved
    return run


def _attn(*args, **kwargs):
    from fqkernels.decode_attention import decode_attention

    return decode_attention(*args, **kwargs)


def compare(step_logits, full):
    """step_logits, full: [B, N, V] float32 -> the per-variant figures (see module doc)."""
    d = (step_logits - full).abs().amax(-1)
    am = step_logits.argmax(-1)
    slack = full.amax(-1) - full.gather(-1, am[..., None])[..., 0]
    return {"mean_max_abs": float(d.mean()), "p99_max_abs": float(torch.quantile(d.flatten(), 0.99)),
            "max_abs": float(d.max()), "argmax_agree": int((am == full.argmax(-1)).sum()),
            f"count_slack_gt_{SLACK}": int((slack > SLACK).sum()), "max_slack": float(slack.max()),
            "positions": int(d.numel())}


def forced_logits(model, prompts, toks):
    """The model's logits at every emitted position, teacher-forced on `toks` [B, N]."""
    B, S = prompts.shape
    N = toks.shape[1]
    model.ensure_rope(S + N)
    model.allocate_cache(B, S + N)
    with torch.inference_mode():
        out = [model.prefill_logits(prompts).float()]
        pos = torch.full((B,), S, dtype=torch.int32, device=prompts.device)
        for t in range(N - 1):
            out.append(model.decode_logits(toks[:, t].contiguous(), pos, pos + 1).float())
            pos += 1
    return torch.stack(out, 1)


def native_run(native, prompts, N):
    """Native's greedy tokens from its cached decode, its per-step logits, and the full forward."""
    with torch.inference_mode():
        out = native(input_ids=prompts, use_cache=True)
        cache, cached, tok = out.past_key_values, [out.logits[:, -1].float()], out.logits[:, -1].argmax(-1)
        toks = [tok]
        for _ in range(N - 1):
            out = native(input_ids=tok[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            cached.append(out.logits[:, -1].float())
            tok = out.logits[:, -1].argmax(-1)
            toks.append(tok)
        toks = torch.stack(toks, 1)
        del cache, out
        full = native(input_ids=torch.cat([prompts, toks], 1), logits_to_keep=N + 1).logits[:, :-1].float()
    return toks, torch.stack(cached, 1), full


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="16x512x128", help="comma-separated BxSxN")
    ap.add_argument("--variants", default="torch_unpacked,torch,engine,engine_cublas,engine_sdpa_attention,"
                    "engine_cublas_qkv,engine_cublas_o,engine_cublas_gate_up,engine_cublas_down,"
                    "engine_cublas_lm_head,engine_gemv,engine_attention_1split,engine_torch_norms,engine_torch_rope")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the torch variants only (a smoke test)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = ModelConfig.from_dir(args.model)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as the engine sets it
    w = load_weights(args.model, cfg, dev)
    from transformers import Qwen3ForCausalLM

    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()  # the platform's reference: flash attention, not cuDNN's
    native = Qwen3ForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(dev).eval()
    names = [n for n in args.variants.split(",") if n]
    report = {"model": args.model, "seed": args.seed, "shapes": {}}
    for shape in args.shapes.split(","):
        B, S, N = (int(v) for v in shape.split("x"))
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(args.seed + B * 7 + S)
        prompts = torch.randint(0, cfg.vocab_size, (B, S), generator=g).to(dev)
        toks, cached, full = native_run(native, prompts, N)
        res = {"native_cached": compare(cached, full)}
        del cached
        makers, tuning = build_variants(cfg, w, B, names)
        for name, make in makers.items():
            model = Qwen3Model(cfg, w, dev, make())
            res[name] = compare(forced_logits(model, prompts, toks), full)
            del model
            torch.cuda.empty_cache()
        report["shapes"][shape] = {"results": res, **tuning, "seconds": time.perf_counter() - t0}
        print(f"== {shape} ({time.perf_counter() - t0:.0f} s) engine choices {tuning['choice']}", flush=True)
        print(f"{'variant':28s} {'mean|d|':>8s} {'p99|d|':>7s} {'max|d|':>7s} {'agree':>7s} "
              f"{'>0.75':>6s} {'maxslk':>7s}")
        for name, r in res.items():
            print(f"{name:28s} {r['mean_max_abs']:8.4f} {r['p99_max_abs']:7.3f} {r['max_abs']:7.3f} "
                  f"{r['argmax_agree']:7d} {r[f'count_slack_gt_{SLACK}']:6d} {r['max_slack']:7.3f}", flush=True)
        del full
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
