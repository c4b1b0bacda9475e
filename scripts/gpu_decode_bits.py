"""Where does a decode step leave the full forward's bits? (issue 11)

For B random prompts of S tokens plus one more, the reference (Transformers, the judge's
replay model) runs one forward over all S + 1 tokens with its cache on: its K/V at every
layer and position, and its logits at positions S - 1 and S, are the truth. The engine's
model then, for each op-set variant (scripts/gpu_opswap.py's, the engine's GEMV/cuBLAS
choices from its own tune), prefills the S prompt tokens and decodes token S, and this
compares, bit for bit:
  prefill  the cache at positions < S, layer by layer (K and V), and the prefill's logits
  decode   the K/V the step writes at position S, layer by layer: layer l's new K/V is
           equal only if everything before layer l's norm + qkv + RoPE was, so the first
           unequal layer names the block that left the reference's bits
  logits   the step's logits against the reference's at position S
A step with equal K/V in every layer and equal logits is the full forward's, bit for bit.

    python scripts/gpu_decode_bits.py --model DIR [--batches 8,16,64] [--prompt 512] [--out FILE]
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_opswap import REPO, build_variants  # noqa: E402,F401  (puts engine/ and the repo on the path)

from fq_config import ModelConfig  # noqa: E402
from fq_model import Qwen3Model  # noqa: E402
from fq_weights import load_weights  # noqa: E402

VARIANTS = ("engine,engine_cublas,engine_gemv,engine_torch_norms,engine_torch_rope,engine_sdpa_attention,"
            "torch_unpacked")


def frac_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="8,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--device", default="cuda", help="cpu: the torch variants only (a smoke run of the script)")
    ap.add_argument("--knobs", default="", help="extra runs of the engine variant with decode_attention knobs: "
                    "'name:FA2=1;name2:...'")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_bits.json"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = ModelConfig.from_dir(args.model)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as the engine sets it
    w = load_weights(args.model, cfg, dev)
    from transformers import Qwen3ForCausalLM

    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()
    native = Qwen3ForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(dev).eval()
    S, L = args.prompt, cfg.num_layers
    report = {"model": args.model, "prompt": S, "batches": {}}
    for B in [int(b) for b in args.batches.split(",")]:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(11 + B)
        ids = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g).to(dev)
        with torch.inference_mode():
            out = native(input_ids=ids, use_cache=True, logits_to_keep=2)
            ref_logits = out.logits[:, -2:]
            ref_k = [out.past_key_values[i][0] for i in range(L)]
            ref_v = [out.past_key_values[i][1] for i in range(L)]
        del out
        makers, tuning = build_variants(cfg, w, B, args.variants.split(","))
        from fqkernels import decode_attention as da
        defaults = {k: getattr(da, k) for k in dir(da) if k.startswith("FA2")}
        runs = [(name, make, {}) for name, make in makers.items()]
        for spec in filter(None, args.knobs.split(";")):
            kname, _, kv = spec.partition(":")
            knobs = {k: int(v) for k, v in (item.split("=") for item in kv.split(","))}
            runs.append((f"engine@{kname}", build_variants(cfg, w, B, ["engine"])[0]["engine"], knobs))
        res = {}
        for name, make, knobs in runs:
            for k, v in defaults.items():
                setattr(da, k, v)
            for k, v in knobs.items():
                setattr(da, k, type(defaults[k])(v))
            model = Qwen3Model(cfg, w, dev, make())
            model.ensure_rope(S + 1)
            model.allocate_cache(B, S + 1)
            with torch.inference_mode():
                pl = model.prefill_logits(ids[:, :S].contiguous())
                pre_k = [frac_equal(model.k_cache[i, :, :, :S], ref_k[i][:, :, :S]) for i in range(L)]
                pre_v = [frac_equal(model.v_cache[i, :, :, :S], ref_v[i][:, :, :S]) for i in range(L)]
                pos = torch.full((B,), S, dtype=torch.int32, device=dev)
                dl = model.decode_logits(ids[:, S].contiguous(), pos, pos + 1)
                dec_k = [frac_equal(model.k_cache[i, :, :, S], ref_k[i][:, :, S]) for i in range(L)]
                dec_v = [frac_equal(model.v_cache[i, :, :, S], ref_v[i][:, :, S]) for i in range(L)]
            first = lambda fk, fv: next((i for i in range(L) if fk[i] < 1 or fv[i] < 1), None)  # noqa: E731
            r = {"prefill_logits_equal": frac_equal(pl, ref_logits[:, 0]),
                 "prefill_first_unequal_layer": first(pre_k, pre_v),
                 "decode_logits_equal": frac_equal(dl, ref_logits[:, 1]),
                 "decode_max_abs_diff": (dl.float() - ref_logits[:, 1].float()).abs().max().item(),
                 "decode_first_unequal_layer": first(dec_k, dec_v),
                 "prefill_k_equal": pre_k, "prefill_v_equal": pre_v, "decode_k_equal": dec_k, "decode_v_equal": dec_v}
            res[name] = r
            print(f"B={B} {name:24s} prefill: logits eq {r['prefill_logits_equal']:.4f} first unequal layer "
                  f"{r['prefill_first_unequal_layer']} | decode: first unequal layer {r['decode_first_unequal_layer']}"
                  f" (k {min(dec_k):.4f} v {min(dec_v):.4f} min), logits eq {r['decode_logits_equal']:.4f} "
                  f"max|d| {r['decode_max_abs_diff']:.3f}", flush=True)
            del model
            torch.cuda.empty_cache()
        report["batches"][B] = {"results": res, **tuning, "seconds": time.perf_counter() - t0}
        print(f"B={B} choices {tuning['choice']}", flush=True)
        del ref_k, ref_v, ref_logits
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
