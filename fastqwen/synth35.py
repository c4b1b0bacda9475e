"""Synthetic Qwen3.5 (hybrid Gated DeltaNet + gated attention) checkpoints.

The folder is what Transformers 5.17.0's `Qwen3_5ForCausalLM.save_pretrained` writes
for a text model (model_type qwen3_5_text, tied embeddings: no lm_head tensor), in
bf16, by fastqwen.synth_common's writer, plus the multi-token-prediction head the released
checkpoints carry (`mtp.*`, `mtp_num_hidden_layers: 1`; Transformers skips it on load; its
random weights draft tokens the model rarely picks). Two weight families, as for Qwen3 (fastqwen.synth):

- `transformers`: Transformers' own init (normal(0, 0.02) for every projection, the
  embedding and the conv; the (1 + w) norms' w at 0; the gated norm's plain weight at 1;
  dt_bias 1; A = uniform(0.01, 16) drawn in fp32 and stored as bf16 log A, which 5.17
  loads as bf16 too) with the final norm raised to `final_norm_scale` (its w = scale - 1,
  default 7). Its logits are not a trained model's: the head is tied, the embedding is as
  large as every layer's output, and the top-1 token is the input token at 99.9% of
  positions (tiny preset, `fastqwen synth-stats`), with a median top-1/top-2 gap of 5.
- `fastqwen` (the default): the same, except where the Qwen3 scheme's reasoning carries
  over (fastqwen.synth.InitScheme): the embedding at a quarter of the matrices' std
  (the input's identity then comes from the layers, not from the tied head echoing it),
  its rows scaled by log-normal factors of RMS 1 (sigma 0.25, a trained vocabulary's
  spread of row norms), the final norm's scale derived from the vocabulary for a median
  top-1/top-2 gap of 1 (fastqwen.synth_common.median_top_gap), and the attention layers' q/k
  norms at (1 + w) = 2 (sharper attention keeps positions apart: 21-24% of positions with
  a top-1 of their own, against 15-17% at 1). Measured on the tiny preset, seeds 0-3
  (synth-stats, 2,048 positions): gap p10 / p50 / p90 0.12-0.19 / 1.00-1.12 / 3.2-3.7,
  top-1 is the input at 2-7%, every realism bound met; cached decode against the full
  forward within 0.25 logits (128 positions). On the 4B (CPU, 512 positions) both
  families look trained (Transformers' init echoes only at the tiny's width) and this one
  is the steadier: cached decode against the full forward max 1.38 / mean 0.87 logits,
  slack 0.25, against 1.69 / 1.12 / 0.38.

Deterministic: every tensor has its own seed from (seed, name).
"""
from __future__ import annotations

import copy
import pathlib

from fastqwen.checkpoint import expected_tensors, mtp_tensors, qwen35_layer_types
from fastqwen.errors import UserError
from fastqwen.synth_common import (check_device, check_final_norm_scale, check_seed, final_norm_for_gap, tensor_seed,
                                   vocab_row_factors, write_checkpoint)

DEFAULT_FINAL_NORM_SCALE = 7.0      # the transformers family's
STD = 0.02
INITS = ("fastqwen", "transformers")
# The fastqwen family (module doc).
EMBEDDING_STD_RATIO = 0.25
VOCAB_ROW_NORM_SIGMA = 0.25
QK_NORM_WEIGHT = 1.0                # (1 + w) = 2
TARGET_MEDIAN_GAP = 1.0


def fastqwen_final_norm_scale(config: dict) -> float:
    """The fastqwen family's final norm scale: a median top-1/top-2 gap of TARGET_MEDIAN_GAP for
    logits (final-normed h) . E[v] ~ scale * embedding std * sqrt(hidden) * c_v * N(0, 1)."""
    return final_norm_for_gap(TARGET_MEDIAN_GAP, int(config["vocab_size"]), VOCAB_ROW_NORM_SIGMA,
                              STD * EMBEDDING_STD_RATIO, int(config["hidden_size"]))


def _config(**fields: object) -> dict:
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": None,
        "hidden_act": "silu",
        "initializer_range": STD,
        "linear_conv_kernel_dim": 4,
        "model_type": "qwen3_5_text",
        # the released checkpoints' multi-token-prediction head (mtp.*): one decoder layer
        "mtp_num_hidden_layers": 1,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "transformers_version": "5.17.0",
        "use_cache": True,
        **fields,
    }
    cfg["layer_types"] = qwen35_layer_types(int(cfg["num_hidden_layers"]))
    return dict(sorted(cfg.items()))


PRESETS: dict[str, dict] = {
    # The 4B shape (../shared/QWEN35.md section 0): 24 GDN + 8 gated-attention layers.
    "qwen3.5-4b": _config(
        head_dim=256, hidden_size=2560, intermediate_size=9216, linear_key_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_value_head_dim=128, max_position_embeddings=262144,
        num_attention_heads=16, num_hidden_layers=32, num_key_value_heads=4,
        rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                         "rope_theta": 10000000.0, "rope_type": "default"},
        vocab_size=248320,
    ),
    # CPU-test size: two of each layer pattern (3 GDN + 1 attention), value heads twice the
    # q/k heads as in the 4B, 16 rotary dims of 64, sizes that fill whole chunks.
    "qwen3.5-tiny": _config(
        head_dim=64, hidden_size=128, intermediate_size=256, linear_key_head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_value_head_dim=32, max_position_embeddings=4096,
        num_attention_heads=4, num_hidden_layers=8, num_key_value_heads=2,
        rope_parameters={"mrope_interleaved": True, "mrope_section": [3, 3, 2], "partial_rotary_factor": 0.25,
                         "rope_theta": 10000000.0, "rope_type": "default"},
        vocab_size=1024,
    ),
}
GENERATION_CONFIG = {"transformers_version": "5.17.0", "use_cache": True}


def get_preset(name: str) -> dict:
    if name not in PRESETS:
        raise UserError(f"unknown Qwen3.5 preset {name!r}; known: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def make_tensor(name: str, shape: tuple[int, ...], seed: int, final_norm_scale: float, device: str,
                init: str = "transformers"):
    """One bf16 tensor of the `init` family described in the module doc."""
    import torch

    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    if init == "fastqwen":
        if name == "model.embed_tokens.weight":
            c = vocab_row_factors(shape[0], VOCAB_ROW_NORM_SIGMA, seed, name, device)
            t = torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * (STD * EMBEDDING_STD_RATIO)
            return (t * c[:, None]).to(torch.bfloat16)
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return torch.full(shape, QK_NORM_WEIGHT, dtype=torch.bfloat16, device=device)
    if name.endswith("A_log"):
        a = torch.empty(shape, dtype=torch.float32, device=device).uniform_(0.01, 16, generator=gen)
        return torch.log(a).to(torch.bfloat16)
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if name == "model.norm.weight":
        return torch.full(shape, final_norm_scale - 1.0, dtype=torch.bfloat16, device=device)
    if name.endswith("norm.weight"):   # the (1 + w) norms: input, post-attention, q/k
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return (torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * STD).to(torch.bfloat16)


def synthesize(preset: str, out_dir: str | pathlib.Path, seed: int = 0, device: str = "cpu", force: bool = False,
               final_norm_scale: float | None = None, progress: bool = True, init: str = "fastqwen") -> pathlib.Path:
    """Write a synthetic Qwen3.5 checkpoint of `preset` and weight family `init` into `out_dir`
    (see the module doc). Raises UserError for an unknown preset, init or device, a bad seed or
    final norm scale, or a non-empty folder without `force`; nothing is written then."""
    import torch

    cfg = get_preset(preset)
    device = check_device(device)
    check_seed(seed)
    if init not in INITS:
        raise UserError(f"unknown init {init!r} for a Qwen3.5 preset; known: {', '.join(INITS)}")
    if final_norm_scale is not None:
        scale = check_final_norm_scale(final_norm_scale)
    else:
        scale = fastqwen_final_norm_scale(cfg) if init == "fastqwen" else DEFAULT_FINAL_NORM_SCALE
    provenance = {"preset": preset, "seed": seed, "device": device, "init": init, "final_norm_scale": scale,
                  **({"embedding_std": STD * EMBEDDING_STD_RATIO, "vocab_row_norm_sigma": VOCAB_ROW_NORM_SIGMA,
                      "qk_norm_weight": QK_NORM_WEIGHT} if init == "fastqwen" else {}),
                  "torch": torch.__version__}
    return write_checkpoint(pathlib.Path(out_dir), cfg, dict(GENERATION_CONFIG), expected_tensors(cfg) + mtp_tensors(cfg),
                            lambda name, shape: make_tensor(name, shape, seed, scale, device, init), provenance,
                            force=force, progress=progress)
