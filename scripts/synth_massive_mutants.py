"""Do numerics bugs that bite at massive activations show on a `--massive-activations` checkpoint, and only there?

Runs Transformers' Qwen3 (BF16, sdpa, CPU) over judge-like prompts
(`fastqwen.judge.prompts.synthetic_stream` windows), once as the reference and
once per "mutant": the same model with one arithmetic change an engine might
make, patched in for the measurement. Each mutant is scored as the gate would
score an engine that emits the mutant's argmax, teacher-forced on the same ids:
slack = the reference's max logit minus its logit at the mutant's argmax, and
the max |logit diff|. Run once with and once without `--massive`.

Mutants:
- fp8-down-input: the down projection's input quantized to FP8 E4M3 with one
  scale per tensor (amax / 448), as an FP8 prefill does;
- int8-per-token-down-input: the same with INT8 and one scale per token;
- norm-fp32-weight: RMSNorm multiplies the normalized value by the weight in
  FP32 and rounds once (CONTRACT.md: a reformulation, not a reordering);
- fp32-residual: the residual stream kept in FP32 across each decoder layer's
  two adds, rounded to BF16 only where the next op reads it.

    python scripts/synth_massive_mutants.py --preset qwen3-0.6b --massive --out results/synth_stats/mutants-qwen3-0.6b-massive.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import tempfile

import torch

from fastqwen import synth
from fastqwen.judge.prompts import PromptSource, synthetic_stream
from fastqwen.presets import get_preset


@contextlib.contextmanager
def mutant(model: torch.nn.Module, name: str):
    """Patch one arithmetic change into `model` for the duration of the block."""
    from transformers.models.qwen3 import modeling_qwen3 as mq

    undo = []
    if name in ("fp8-down-input", "int8-per-token-down-input"):
        def quantize(mod, args):
            (x,) = args
            if name == "fp8-down-input":
                scale = x.float().abs().amax().clamp(min=1e-12) / 448.0
                q = (x.float() / scale).to(torch.float8_e4m3fn).float() * scale
            else:
                scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
                q = (x.float() / scale).round().clamp(-127, 127) * scale
            return (q.to(x.dtype),)

        for layer in model.model.layers:
            undo.append(layer.mlp.down_proj.register_forward_pre_hook(quantize).remove)
    elif name == "norm-fp32-weight":
        original = mq.Qwen3RMSNorm.forward

        def forward(self, hidden_states):
            dtype = hidden_states.dtype
            h = hidden_states.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * h).to(dtype)

        mq.Qwen3RMSNorm.forward = forward
        undo.append(lambda: setattr(mq.Qwen3RMSNorm, "forward", original))
    elif name == "fp32-residual":
        original = mq.Qwen3DecoderLayer.forward

        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                    output_attentions=False, use_cache=False, cache_position=None, position_embeddings=None, **kwargs):
            # The stream arrives in BF16 from the previous layer; keep this layer's two adds in FP32.
            residual = hidden_states.float()
            h = self.input_layernorm(hidden_states)
            h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_value=past_key_value, output_attentions=output_attentions,
                                  use_cache=use_cache, cache_position=cache_position,
                                  position_embeddings=position_embeddings, **kwargs)
            residual = residual + h.float()
            h = self.mlp(self.post_attention_layernorm(residual.to(hidden_states.dtype)))
            return ((residual + h.float()).to(hidden_states.dtype),)

        mq.Qwen3DecoderLayer.forward = forward
        undo.append(lambda: setattr(mq.Qwen3DecoderLayer, "forward", original))
    else:
        raise ValueError(f"unknown mutant {name!r}")
    try:
        yield
    finally:
        for u in undo:
            u()


MUTANTS = ("fp8-down-input", "int8-per-token-down-input", "norm-fp32-weight", "fp32-residual")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True)
    p.add_argument("--init", choices=synth.INITS, default="fastqwen")
    p.add_argument("--massive", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--tmp")
    p.add_argument("--out")
    args = p.parse_args()

    from transformers import Qwen3ForCausalLM

    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()
    cfg = get_preset(args.preset)
    result = {"preset": args.preset, "init": args.init, "massive_activations": args.massive, "seed": args.seed,
              "batch": args.batch, "length": args.length, "device": "cpu", "mutants": {}}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = synth.synthesize(args.preset, pathlib.Path(tmp) / "m", seed=args.seed, progress=False, init=args.init,
                                  massive_activations=args.massive)
        model = Qwen3ForCausalLM.from_pretrained(str(folder), torch_dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        ids = torch.tensor(PromptSource(synthetic_stream(int(cfg["vocab_size"])), seed=args.seed + 11, kind="x")
                           .draw(args.batch, args.length))
        with torch.inference_mode():
            ref = model(input_ids=ids).logits.float()
            for name in MUTANTS:
                with mutant(model, name):
                    got = model(input_ids=ids).logits.float()
                pick = got.argmax(-1)
                slack = ref.amax(-1) - ref.gather(-1, pick[..., None])[..., 0]
                diff = (got - ref).abs().amax(-1)
                finite = bool(torch.isfinite(got).all())
                row = {
                    "max_slack": float(slack.max()) if finite else None,
                    "positions_over_2": int((slack > 2.0).sum()),
                    "max_abs_logit_diff": float(diff.max()) if finite else None,
                    "mean_abs_logit_diff": float(diff.mean()) if finite else None,
                    "argmax_agree": float((pick == ref.argmax(-1)).float().mean()),
                    "all_finite": finite,
                }
                result["mutants"][name] = row
                print(f"{args.preset} {args.init} massive={args.massive} {name:28} slack {row['max_slack']} "
                      f"over-2 {row['positions_over_2']} max|diff| {row['max_abs_logit_diff']} agree {row['argmax_agree']:.3f}",
                      flush=True)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
