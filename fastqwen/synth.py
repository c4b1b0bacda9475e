"""`fastqwen synth`: write a synthetic Qwen3 checkpoint with the real layout and shapes.

The folder holds `config.json`, `generation_config.json`, BF16 safetensors
shards named as Hugging Face names them and `model.safetensors.index.json`,
so Transformers and any engine load it exactly as they load the real model,
a tokenizer laid out as Qwen's (`tokenizer.json`, `tokenizer_config.json`:
fastqwen/tokenizer.py), plus `fastqwen_synth.json`, which records how the weights were made (preset,
seed, init and its parameters, the massive-activation plant) and which no
loader reads. Only the weight values are synthetic; speed does not depend on
them, and the init scheme below makes the logits spread like a trained
model's, so that the 2.0-logit correctness gate can actually fail, while
keeping the model as insensitive to the order of BF16 sums as a trained one,
so that a correct engine passes it.

Two independent init families, so that an exactness bug one of them happens
to hide has a second chance to show: `fastqwen` (`init_scheme`, the default)
and `transformers` (`transformers_init`: Transformers' own init, final norm 7).
On top of either, `--massive-activations` plants the massive activations and
attention sinks trained Qwen3 checkpoints have (`MassivePlant`), and
`--sliding-window N` writes a window into config.json.

This module decides the Qwen3 weight values; `fastqwen.synth_common` holds the
per-tensor seeds and the folder writer it shares with the Qwen3.5 family
(`fastqwen.synth35`). `fastqwen synth` (`add_arguments`, `run`, below) hands a
Qwen3.5 preset to `fastqwen.synth35`.

Determinism: every tensor gets its own generator, seeded from (seed, tensor
name), so the bytes do not depend on the order tensors are made in. The same
preset, seed and device give the same bytes; CPU and CUDA generators are
different algorithms, so `--device cpu` and `--device cuda` give different
(equally valid) weights for the same seed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastqwen import synth35
from fastqwen.checkpoint import expected_tensors
from fastqwen.errors import UserError
from fastqwen.presets import PRESETS, get_generation_config, get_preset
from fastqwen.synth_common import (MAX_SHARD_BYTES, check_device, check_final_norm_scale, check_seed,
                                   final_norm_for_gap, tensor_seed, vocab_row_factors, write_checkpoint)

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------
# The init scheme: the one place that decides the weight values.
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class InitScheme:
    """How each kind of tensor is drawn, and why.

    A synthetic checkpoint must behave like a trained model in two ways.
    (1) Realistic logits, so the 2.0-logit gate can fail: top-1 far above the
    median, a top-1/top-2 gap with median ~1, p10 ~0.1 and p90 several logits;
    different positions predicting different tokens; greedy decoding that
    does not fall into a one-token loop. (2) Numerical stability: reordering
    BF16 sums (native's cached decode vs one full forward over the same
    tokens) must move the logits by a fraction of a logit.

    Sharp attention in every layer (`sharp_attention_init`) gives (1) but not
    (2): the two paths differ by up to 37 logits on the 0.6B shape (CPU) and
    27.5 on the 4B (H200). In FP32 the same comparison differs by 3e-6 (relative, last
    hidden state), so the network itself is not chaotic: BF16 rounding adds
    about one ulp of relative error per layer (a random walk, 1-3% after
    28-36 layers), and the question is how much attention amplifies it and
    how much the logits move for a given hidden-state error.

    Matrices: N(0, matrix_std^2), Transformers' init, except as below.
    RMSNorm weights: `scale * U(1 - jitter, 1 + jitter)`, jittered so that a
    kernel that forgets a norm weight gives different tokens.

    Stem and late layers. After the per-head RMSNorm, q.k/sqrt(d) has a std
    of about (q/k norm weight)^2. With weight 3 everywhere, attention picks
    one of a few random positions by a hair and a rounding difference flips
    the winner, compounding over depth. So only the first `stem_layers` (2)
    attend sharply (`stem_qk_norm_scale` 3): their inputs have barely drifted
    apart between the two paths yet (1e-4 relative, against 1.5% at the end),
    so their winners do not flip, and they give each position a
    context-dependent identity of its own
    (without them soft attention averages all positions into one vector and
    the hidden states collapse: one token top-1 almost everywhere). Later
    layers attend softly (`qk_norm_scale` 1.25, score std ~1.6), and their
    o_proj/down_proj are scaled by `late_output_scale` =
    sqrt(stem / (layers - stem)) (`default_late_output_scale`), so that all
    of them together add as much to the residual stream as the stem: each
    makes a small edit to a stream the stem built, as late layers of a
    trained model do, and a small edit adds little rounding error relative
    to the stream. Dropping all late layers still changes most argmaxes.
    (GPT-2's 1/sqrt(2 * layers) on every layer would shrink the stem too;
    every branch reads the stream through an RMSNorm, so scaling all of them
    only raises the embedding's share of the stream, which the tied head
    turns into echo, below.)

    Same-token heads (`key_query_correlation`). The keys of each KV head share
    a component with the first query head of its group: k_proj rows =
    c * (that head's q_proj rows) + sqrt(1 - c^2) * fresh noise. That head
    scores a position against itself and earlier copies of its token far
    above the rest (about c * scale^2 * sqrt(head_dim)): a wide margin that a
    rounding difference cannot flip, which keeps positions apart.

    Embedding (`embedding_std`, a quarter of matrix_std). The head is tied, so
    whatever share of the final hidden state is the input token's own
    embedding raises that token's logit: the model echoes its input, and with
    spread row norms greedy decoding on tiny locks onto one repeated token.
    A small embedding leaves the input's identity to the stem's outputs.

    Vocabulary row norms (`vocab_row_norm_sigma`). The output head's rows are
    scaled by log-normal factors exp(sigma * N(0, 1)) of RMS 1, as a trained
    vocabulary's norms spread. With equal norms the logits are one Gaussian,
    and a median gap of 1 then needs a logit std of ~7 (top-1 ~34 above the
    median) over which a hidden-state error is multiplied; with spread rows
    the top tokens stand out of a narrower bulk (top-1 ~15 above the median)
    and the same error moves the logits about half as much.

    Final norm (`final_norm_scale`). The logit of token v is (final-normed h)
    . W[v] ~ final_norm_scale * embedding_std * sqrt(hidden) * c_v * N(0, 1).
    `median_top_gap` gives, by a fixed-seed simulation, the median
    top-1/top-2 gap of V such draws at unit scale; the scale makes it
    `target_median_gap`.

    Measured (seed 0, BF16, CPU unless noted; cached_vs_full: mean / max over
    positions of the max |logit diff| over the vocabulary / max slack),
    `sharp_attention_init` -> this scheme:
      0.6B: 30.8 / 37.1 / 34.4 -> 0.24 / 0.34 / 0.19
      4B:   21.1 / 32.3 / 22.8 (H200: 20.2 / 27.5 / 28.8) -> 0.34 / 0.53 / 0.19
      tiny's width at 24 layers, seeds 0-3: 2.0-2.9 / 7.9-14.9 / 2.9-7.3
            -> 0.11-0.12 / 0.21-0.25 / <= 0.06
    this scheme with gaps p10/p50/p90 0.125/0.875/2.9, top-1 ~15 above the median, 58-67% of
    positions with a top-1 token of their own. On the 0.6B, FP32 puts the two
    paths' last hidden states 3e-6 apart (BF16: 1.5%); dropping all late
    layers changes 83% of argmaxes, dropping one changes 31% (0.4% beyond the
    gate), as removing one layer of a trained model barely matters.
    """

    matrix_std: float
    embedding_std: float
    norm_jitter: float
    qk_norm_scale: float
    stem_layers: int
    stem_qk_norm_scale: float
    late_output_scale: float
    key_query_correlation: float
    vocab_row_norm_sigma: float
    final_norm_scale: float
    target_median_gap: float
    # Geometry the same-token heads and the output head need (from the config).
    head_dim: int
    query_heads_per_kv_head: int
    output_head: str
    # Which family this is ("fastqwen": `init_scheme`; "transformers": `plain_init`,
    # `transformers_init`), for the provenance file; and the massive-activation plant
    # drawn on top of it (`MassivePlant`), if any.
    name: str = "fastqwen"
    massive: "MassivePlant | None" = None


# The chosen values (see InitScheme).
QK_NORM_SCALE = 1.25
STEM_LAYERS = 2
STEM_QK_NORM_SCALE = 3.0
KEY_QUERY_CORRELATION = 0.7
VOCAB_ROW_NORM_SIGMA = 0.25
NORM_JITTER = 0.2
EMBEDDING_STD_RATIO = 0.25


def default_late_output_scale(num_layers: int, stem_layers: int) -> float:
    """Output scale of the layers after the stem: all of them together add as much to the stream as the stem.

    Branch outputs add up in quadrature, so 2 * (L - stem) late branches of
    scale s match 2 * stem stem branches of scale 1 when s = sqrt(stem / (L - stem)).
    """
    if num_layers <= stem_layers or stem_layers == 0:
        return 1.0
    return math.sqrt(stem_layers / (num_layers - stem_layers))


def _geometry(config: dict) -> tuple[int, int, str]:
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    group = heads // int(config["num_key_value_heads"])
    output_head = "model.embed_tokens.weight" if config.get("tie_word_embeddings", False) else "lm_head.weight"
    return head_dim, group, output_head


def init_scheme(
    config: dict,
    target_median_gap: float = 1.0,
    qk_norm_scale: float = QK_NORM_SCALE,
    key_query_correlation: float = KEY_QUERY_CORRELATION,
    vocab_row_norm_sigma: float = VOCAB_ROW_NORM_SIGMA,
    stem_layers: int = STEM_LAYERS,
    stem_qk_norm_scale: float = STEM_QK_NORM_SCALE,
    embedding_std_ratio: float = EMBEDDING_STD_RATIO,
    late_output_scale: float | None = None,
) -> InitScheme:
    """The init scheme for a Qwen3 config dict (see InitScheme for the reasoning).

    The keyword arguments let a measurement vary one choice at a time (and build
    `sharp_attention_init`); checkpoints use the defaults.
    """
    if not 0.0 <= key_query_correlation <= 1.0:
        raise ValueError(f"key_query_correlation must lie in [0, 1], got {key_query_correlation}")
    matrix_std = float(config.get("initializer_range", 0.02))
    embedding_std = matrix_std * float(embedding_std_ratio)
    if late_output_scale is None:
        late_output_scale = default_late_output_scale(int(config["num_hidden_layers"]), int(stem_layers))
    hidden = int(config["hidden_size"])
    head_dim, group, output_head = _geometry(config)
    return InitScheme(
        matrix_std=matrix_std,
        embedding_std=embedding_std,
        norm_jitter=NORM_JITTER,
        qk_norm_scale=float(qk_norm_scale),
        stem_layers=int(stem_layers),
        stem_qk_norm_scale=float(stem_qk_norm_scale),
        late_output_scale=float(late_output_scale),
        key_query_correlation=float(key_query_correlation),
        vocab_row_norm_sigma=float(vocab_row_norm_sigma),
        final_norm_scale=final_norm_for_gap(target_median_gap, int(config["vocab_size"]),
                                            float(vocab_row_norm_sigma), embedding_std, hidden),
        target_median_gap=target_median_gap,
        head_dim=head_dim,
        query_heads_per_kv_head=group,
        output_head=output_head,
    )


def sharp_attention_init(config: dict, target_median_gap: float = 1.0) -> InitScheme:
    """Sharp attention everywhere (q/k norm weights 3 in every layer, full-size embedding and outputs,
    equal row norms).

    Realistic logit statistics but numerically chaotic: on deep shapes the
    cached decode lands tens of logits from the full forward. It exists to show,
    in tests, that the stability check can fail.
    """
    return init_scheme(
        config, target_median_gap, qk_norm_scale=3.0, key_query_correlation=0.0, vocab_row_norm_sigma=0.0,
        stem_layers=0, embedding_std_ratio=1.0,
    )


def plain_init(config: dict) -> InitScheme:
    """Transformers' own init (N(0, 0.02) matrices, norm weights exactly 1): logits too flat for the gate.

    Kept to show, in tests, that the logit-scale checks can fail; `transformers_init`
    is the same with a raised final norm.
    """
    head_dim, group, output_head = _geometry(config)
    return InitScheme(
        matrix_std=float(config.get("initializer_range", 0.02)),
        embedding_std=float(config.get("initializer_range", 0.02)),
        norm_jitter=0.0,
        qk_norm_scale=1.0,
        stem_layers=0,
        stem_qk_norm_scale=1.0,
        late_output_scale=1.0,
        key_query_correlation=0.0,
        vocab_row_norm_sigma=0.0,
        final_norm_scale=1.0,
        target_median_gap=float("nan"),
        head_dim=head_dim,
        query_heads_per_kv_head=group,
        output_head=output_head,
        name="transformers",
    )


# Final norm weight of `--init transformers` (ANCHORS.md, "Synthetic weights do not behave
# like a trained model for speculation": top-1/top-2 gaps p10 / median / p90 of
# 0.13 / 1.13 / 3.63 on the 4B at 7, against 0.03 / 0.16 / 0.50 at Transformers' 1).
TRANSFORMERS_FINAL_NORM_SCALE = 7.0


def transformers_init(config: dict, final_norm_scale: float = TRANSFORMERS_FINAL_NORM_SCALE) -> InitScheme:
    """The project's second, independent init family: Transformers' own init with a raised final norm.

    Every Linear and the embedding ~ N(0, initializer_range), drawn in FP32 and
    rounded to BF16 once; every RMSNorm weight exactly 1, except the final norm
    (`model.norm.weight`), a constant `final_norm_scale`, which spreads the
    logits (and so the top-1/top-2 gaps) the way a trained model's are spread.
    It shares no design choice with `init_scheme` (no stem, no same-token heads,
    no row-norm spread), so an exactness bug that one family happens to hide
    has a second chance to show.

    Measured (seed 0, CPU, `fastqwen synth-stats`): on the 0.6B the hidden states
    collapse onto a shared direction (3% of positions with a top-1 of their own)
    unless `--massive-activations` adds sinks (23%); with equal vocabulary row
    norms the top-1 stands ~20-31 above the median, so the logits move more for
    a given rounding difference than under `init_scheme`: native's cached decode
    vs its own full forward, max / mean / max slack, 0.34 / 0.25 / 0.12 on the
    0.6B and 1.16 / 0.85 / 0.50 on the 4B (over synth-stats' mean bound of 0.5),
    against 0.47 / 0.30 / 0.25 for `init_scheme` on the 4B.
    """
    return dataclasses.replace(plain_init(config), final_norm_scale=float(final_norm_scale))


def _normal(name: str, shape: tuple[int, ...], seed: int, device: str) -> "torch.Tensor":
    """N(0, 1) FP32 draws from the tensor's own generator."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)


def _qk_norm_scale(scheme: InitScheme, layer: int) -> float:
    """The nominal q_norm/k_norm weight of `layer`: sharp in the stem, soft after (see InitScheme)."""
    return scheme.stem_qk_norm_scale if layer < scheme.stem_layers else scheme.qk_norm_scale


def make_tensor(name: str, shape: tuple[int, ...], scheme: InitScheme, seed: int, device: str) -> "torch.Tensor":
    """One BF16 tensor drawn as the scheme says for its kind, on `device`.

    Depends only on (name, shape, scheme, seed, device): a k_proj redraws its
    layer's q_proj from the q_proj's own seed rather than reading it. The
    massive-activation plant, if the scheme has one, edits the FP32 values
    before the one rounding to BF16.
    """
    import torch

    if len(shape) == 2:
        # Drawn in FP32 and rounded once, like a BF16 checkpoint saved from FP32 training.
        out = _normal(name, shape, seed, device)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out.mul_(scheme.embedding_std / scheme.matrix_std)
        if name == scheme.output_head and scheme.vocab_row_norm_sigma > 0:
            out.mul_(vocab_row_factors(shape[0], scheme.vocab_row_norm_sigma, seed, name, device)[:, None])
        elif name.endswith("self_attn.k_proj.weight") and scheme.key_query_correlation > 0:
            out = _correlate_with_queries(name, out, scheme, seed, device)
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            if int(name.split(".")[2]) >= scheme.stem_layers:
                out.mul_(scheme.late_output_scale)
        out.mul_(scheme.matrix_std)
    else:
        if name.endswith("self_attn.q_norm.weight") or name.endswith("self_attn.k_norm.weight"):
            scale = _qk_norm_scale(scheme, int(name.split(".")[2]))
        elif name == "model.norm.weight":
            scale = scheme.final_norm_scale
        else:
            scale = 1.0
        gen = torch.Generator(device=device)
        gen.manual_seed(tensor_seed(seed, name))
        u = torch.rand(shape, generator=gen, device=device, dtype=torch.float32)
        out = ((1.0 - scheme.norm_jitter) + 2.0 * scheme.norm_jitter * u).mul_(scale)
    if scheme.massive is not None:
        _plant_massive(name, out, scheme, seed)
    return out.to(torch.bfloat16)


def _correlate_with_queries(name: str, noise: "torch.Tensor", scheme: InitScheme, seed: int, device: str) -> "torch.Tensor":
    """k_proj rows of KV head j = c * (rows of query head j * group) + sqrt(1 - c^2) * noise (unit-variance)."""
    c = scheme.key_query_correlation
    hd, group = scheme.head_dim, scheme.query_heads_per_kv_head
    kv_heads = noise.shape[0] // hd
    q_name = name.replace("self_attn.k_proj.weight", "self_attn.q_proj.weight")
    queries = _normal(q_name, (kv_heads * group * hd, noise.shape[1]), seed, device)
    first_of_group = queries.view(kv_heads, group, hd, -1)[:, 0].reshape(kv_heads * hd, -1)
    return noise.mul_(math.sqrt(1.0 - c * c)).add_(first_of_group, alpha=c)


# ---------------------------------------------------------------------------
# Massive activations and attention sinks (`--massive-activations`).
# ---------------------------------------------------------------------------
# The chosen values (see MassivePlant for what they give).
PLANT_LAYER = 1
MASSIVE_VALUES = (3000.0, -2000.0)
TRIGGER_RATE_PER_512 = 4.0
TRIGGER_MAX_ID_RATE_PER_512 = 1.5
TRIGGER_VOCAB_FRACTION = 0.01
TRIGGER_SATURATION = 4.0
PLANT_GATE = 50.0
CONSTANT_CHANNEL_SHARE = 0.5
SINK_KEY_WEIGHT = 1.0
SINK_SCORE_RANGE = (3.0, 9.0)


@dataclass(frozen=True)
class MassivePlant:
    """Massive activations and attention sinks, planted on top of either init.

    What trained Qwen3 checkpoints have and random weights lack (Sun et al. 2024,
    "Massive activations in large language models"; FIELD_NOTES.md: Qwen3-4B forms
    an |h| ~ 5,300 activation that builds which reorder arithmetic can flip): from
    an early layer on, a few hidden channels hold values in the thousands at a few
    tokens (the first token, delimiter-like tokens), written by one MLP and then
    carried by the residual stream; the RMSNorm weights there are small, so the
    stream is not swamped; and those tokens are attention sinks: queries attend to
    them strongly and their values are small, so a head with nothing to add parks
    its attention there. Numerics that only bite there: an activation scale per
    tensor or per token (FP8/INT8: E4M3 tops out at 448, the plant's down-projection
    input is ~2,500), FP16 squares in a norm (3,000^2 overflows FP16), an FP32
    residual where the reference rounds to BF16 (at 3,000 a BF16 step is 16, so the
    reference drops every small update to those channels), a softmax or split-KV
    combine with one dominant score.

    The construction (L = `plant_layer`; the seed picks two massive channels, a
    trigger channel t, a constant channel c and one MLP neuron n of layer L;
    s = head_dim / 2 - 1 is the head dimension of the lowest RoPE frequency, which
    turns by under 0.05 rad over 32K positions):

    - Reserved channels. Only the embedding writes t and c: every o_proj and
      down_proj has zero rows there, so their values are exact in every layer.
    - Trigger tokens: the bos id; ids of the judge's synthetic prompt stream
      (`fastqwen.judge.prompts.synthetic_stream`, the prompts the judge draws on a
      synthetic checkpoint), in a seeded order, none above
      `trigger_max_id_rate_per_512`, until they make `trigger_rate_per_512` of the
      stream (delimiter-like: frequent, several distinct ids); then ids that stream
      never uses, up to `trigger_vocab_fraction` of the vocabulary (other id
      generators and the model's own output meet those). Without the stream a
      random 1% of the vocabulary gives 0.4 to 41 triggers per 512 depending on
      whether it happens to hold a top-ranked id. A trigger token's embedding holds
      tau (`trigger_embedding`) on t, any other token's 0: tau = 4 sqrt(hidden) r,
      with r the stream's RMS entering layer L (`_stream_rms`), so at a trigger token
      t dominates layer L's RMS and its normalized value is ~0.97 sqrt(hidden)
      whatever the context.
    - The plant: neuron n of layer L reads only t (gate and up weights
      PLANT_GATE / that value): silu(50) x 50 = 2,500 at a trigger token (a
      massive value in the down projection's input, as in trained models), exactly
      0 anywhere else. Its down column writes only the massive channels,
      `plant_down_weights` = `massive_values` / 2,500. Every other weight there
      stays as the init drew it, so all layers keep writing their ordinary small
      values into those channels: at an ordinary token they are ordinary; at a
      trigger token the BF16 residual add rounds each such update away, and the
      value is carried unchanged to the last layer.
    - Small norms: after layer L, the input and post-attention norm weights at the
      massive channels and t are 1/sqrt(hidden). A trigger token's normalized
      vector is then ~unit length, nearly all on the massive channels (the rest of
      its stream is ~1/1000 of its RMS): small and the same for every trigger
      token, so its value is ~30x smaller than an ordinary token's and its MLP
      output negligible. At an ordinary token those channels are muted.
    - Sinks, in every layer after L: dimension s of every head is a sink
      direction. Key row s reads only the massive channels (`sink_key_weight`, with
      their signs): after k_norm a trigger token's key is ~sqrt(head_dim) w_k on s,
      any other token's ~0. Query row s reads only c, whose constant
      `constant_embedding` (gamma = sqrt(hidden) embedding_std / 2) every token
      carries to every layer, so every query is positive on s and a sink scores
      Delta above a key with nothing there, Delta drawn per head and layer from
      `sink_score_range`: some heads park most of their attention on the sinks,
      others barely look. The weight giving Delta assumes the stream's RMS
      (`_stream_rms`), so the realized Delta is an estimate. The q/k norm weights
      at s are the layer's nominal value, unjittered. Nothing else reads c: a
      direction every token shares would collapse the hidden states (measured on
      tiny: one token top-1 at 31% of positions).
    - Output: the final norm's weights at the massive channels, t and c are 0, so
      the tied head reads none of them (tau would make trigger tokens likelier,
      gamma every token alike).

    Simplifications. Every occurrence of a trigger id is massive and a sink, not
    only the first. A trained model removes the massive values in its last
    layers; here they reach the final norm, whose RMS they dominate, so a trigger
    position's logits are ~100x flatter than elsewhere (the gate's margin passes
    any token there; about 1 position in 130 of the judge's prompts). Removing
    them exactly would need the carried value to be bit-identical at every
    trigger token and in every path (a cancellation off by one BF16 step, 16,
    moves that position's logits by ~20%, several logits), which needs a trigger
    embedding in the thousands; the plant stays where the real models put it.

    Measured (seed 0, CPU, BF16; attention and activations read from Transformers' forward, the
    stability figures from `fastqwen synth-stats`):
    from layer L's output on, trigger tokens hold ~2,850 / -1,900 on the massive
    channels (2,430 on the transformers-init 4B), 185-8,000x any other token's
    largest |h|; queries put 8-89% of their attention on trigger positions (a
    layer's mean; 0.6-1.5% of the keys), single heads up to 99%; a trigger
    token's |v| is 3-4% of an ordinary one's. The trigger rate in the judge's
    prompts is 3.6-3.9 per 512 (seeds 0-3). Logit statistics unchanged under the
    fastqwen init; native's cached decode vs its own full forward, max / mean
    per-position max |logit diff| / max slack, without -> with the plant:
      0.6B, judge prompts (4 x 512 + 64):  0.34 / 0.22 / 0.12 -> 0.38 / 0.22 / 0.12
      0.6B, synth-stats (128-token prompts): 0.39 / 0.22 / 0.12 -> 0.62 / 0.22 / 0.06
      4B (36 layers), synth-stats:           0.47 / 0.30 / 0.25 -> 0.45 / 0.30 / 0.19
      0.6B transformers init, judge prompts: 0.31 / 0.24 / 0.12 -> 0.59 / 0.43 / 0.25
      4B transformers init, synth-stats:     1.16 / 0.85 / 0.50 -> 1.50 / 0.94 / 0.38
    (the transformers init's own noise at 4B depth, with or without the plant).
    """

    plant_layer: int
    massive_values: tuple[float, ...]
    trigger_rate_per_512: float
    trigger_max_id_rate_per_512: float
    trigger_vocab_fraction: float
    trigger_embedding: float
    constant_embedding: float
    plant_gate_weight: float
    plant_down_weights: tuple[float, ...]
    small_norm_weight: float
    sink_key_weight: float
    sink_score_range: tuple[float, float]
    sink_query_weight_per_score: tuple[float, ...]  # per layer
    # Geometry (from the config).
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    bos_token_id: int | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def sink_dim(self) -> int:
        """The head dimension of the lowest RoPE frequency (rotate-half pairs i with i + head_dim / 2)."""
        return self.head_dim // 2 - 1


def _silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


def _stream_rms(scheme: InitScheme, hidden: int, q_out: int, layer: int) -> float:
    """An estimate of the residual stream's RMS entering `layer` (>= 1), from the config alone.

    One branch adds about matrix_std^2 * sqrt(hidden * q_out) per channel (a value
    entry, matrix_std * sqrt(hidden), through o_proj, matrix_std * sqrt(q_out)), and
    branches add up in quadrature: the stem's at full size, the late layers' scaled
    by late_output_scale. Measured under the fastqwen init: 0.58 / 0.84 / 1.10 entering
    layers 1 / 2 / 27 of the 0.6B (estimate 0.58 / 0.82 / 1.14). Transformers' init
    has no stem and its hidden states grow a shared direction with depth; there a
    fit to the measured 0.6B and tiny figures (0.31 / 0.52 / 2.92 on the 0.6B) is used.
    """
    branch = scheme.matrix_std**2 * math.sqrt(hidden * q_out)
    layer = max(1, layer)
    if scheme.name == "transformers":
        return 0.5 * branch * layer**0.7
    stem = min(layer, scheme.stem_layers)
    return branch * math.sqrt(stem + scheme.late_output_scale**2 * (layer - stem))


def massive_plant(config: dict, scheme: InitScheme) -> MassivePlant:
    """The plant's numbers for a Qwen3 config dict on top of `scheme` (see MassivePlant for the reasoning).

    Raises UserError when the shape has no layer after the plant (nothing to carry the
    massive values or to hold sinks) or too few channels to pick four distinct ones.
    """
    layers = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    if layers < PLANT_LAYER + 2:
        raise UserError(
            f"--massive-activations needs at least {PLANT_LAYER + 2} layers (the plant sits in layer "
            f"{PLANT_LAYER}, sinks after it); this config has num_hidden_layers={layers}"
        )
    if hidden < len(MASSIVE_VALUES) + 2:
        raise UserError(f"--massive-activations needs hidden_size >= {len(MASSIVE_VALUES) + 2}, got {hidden}")
    heads = int(config["num_attention_heads"])
    head_dim = scheme.head_dim
    rms = [_stream_rms(scheme, hidden, heads * head_dim, layer) for layer in range(layers)]
    tau = TRIGGER_SATURATION * math.sqrt(hidden) * rms[PLANT_LAYER]
    # Layer L's post-attention norm at a trigger token: t holds tau, the rest ~rms each.
    x_trigger = math.sqrt(hidden) * tau / math.sqrt(tau**2 + hidden * rms[PLANT_LAYER] ** 2)
    activation = _silu(PLANT_GATE) * PLANT_GATE
    gamma = CONSTANT_CHANNEL_SHARE * math.sqrt(hidden) * scheme.embedding_std
    # Query row s reads x_c = gamma / rms[layer]; the other rows give ~matrix_std * sqrt(hidden) each,
    # which q_norm scales to w: a score Delta needs q[s] = Delta / w, so a weight of
    # Delta * query_rms / (x_c * w^2) (the 1 / w^2 is applied per layer, see _plant_massive).
    query_rms = scheme.matrix_std * math.sqrt(hidden)
    bos = config.get("bos_token_id")
    return MassivePlant(
        plant_layer=PLANT_LAYER,
        massive_values=MASSIVE_VALUES,
        trigger_rate_per_512=TRIGGER_RATE_PER_512,
        trigger_max_id_rate_per_512=TRIGGER_MAX_ID_RATE_PER_512,
        trigger_vocab_fraction=TRIGGER_VOCAB_FRACTION,
        trigger_embedding=tau,
        constant_embedding=gamma,
        plant_gate_weight=PLANT_GATE / x_trigger,
        plant_down_weights=tuple(a / activation for a in MASSIVE_VALUES),
        small_norm_weight=1.0 / math.sqrt(hidden),
        sink_key_weight=SINK_KEY_WEIGHT,
        sink_score_range=SINK_SCORE_RANGE,
        sink_query_weight_per_score=tuple(query_rms * r / gamma for r in rms),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        bos_token_id=int(bos) if isinstance(bos, int) and 0 <= bos < int(config["vocab_size"]) else None,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(config["num_key_value_heads"]),
        head_dim=head_dim,
    )


@dataclass(frozen=True)
class MassiveLayout:
    """Where a seed puts the plant: channels, the plant neuron, the trigger ids."""

    massive_channels: tuple[int, ...]
    trigger_channel: int
    constant_channel: int
    plant_neuron: int
    trigger_ids: tuple[int, ...]
    # Expected trigger tokens per 512 in the judge's synthetic prompt stream.
    judge_stream_rate_per_512: float


@functools.lru_cache(maxsize=8)
def massive_layout(plant: MassivePlant, seed: int) -> MassiveLayout:
    """The seed's choice of channels, plant neuron and trigger ids (CPU generators: the same on every device)."""
    import torch

    from fastqwen.judge.prompts import synthetic_stream

    def generator(what: str) -> "torch.Generator":
        return torch.Generator().manual_seed(tensor_seed(seed, f"massive/{what}"))

    k = len(plant.massive_values)
    channels = torch.randperm(plant.hidden_size, generator=generator("channels"))[: k + 2].tolist()
    neuron = int(torch.randint(plant.intermediate_size, (1,), generator=generator("neuron")))

    # Trigger ids: bos, then delimiter-like ids the judge's prompts use, up to the target rate,
    # then ids those prompts never use, up to the vocabulary fraction.
    stream = synthetic_stream(plant.vocab_size)
    per_512 = torch.bincount(torch.tensor(stream), minlength=plant.vocab_size).double() * (512 / len(stream))
    order = torch.randperm(plant.vocab_size, generator=generator("triggers")).tolist()
    chosen = {plant.bos_token_id} if plant.bos_token_id is not None else set()
    rate = sum(float(per_512[i]) for i in chosen)
    for i in order:
        if rate >= 0.9 * plant.trigger_rate_per_512:
            break
        f = float(per_512[i])
        if 0 < f <= plant.trigger_max_id_rate_per_512 and rate + f <= plant.trigger_rate_per_512 and i not in chosen:
            chosen.add(i)
            rate += f
    wanted = max(len(chosen), round(plant.trigger_vocab_fraction * plant.vocab_size))
    for i in order:
        if len(chosen) >= wanted:
            break
        if per_512[i] == 0:
            chosen.add(i)
    return MassiveLayout(
        massive_channels=tuple(channels[:k]),
        trigger_channel=channels[k],
        constant_channel=channels[k + 1],
        plant_neuron=neuron,
        trigger_ids=tuple(sorted(chosen)),
        judge_stream_rate_per_512=rate,
    )


def sink_scores(plant: MassivePlant, seed: int, layer: int) -> "torch.Tensor":
    """The sink score Delta of each query head of `layer`, drawn from the plant's range (FP32, CPU)."""
    import torch

    lo, hi = plant.sink_score_range
    gen = torch.Generator().manual_seed(tensor_seed(seed, f"massive/sink-scores/{layer}"))
    return lo + (hi - lo) * torch.rand(plant.num_heads, generator=gen, dtype=torch.float32)


def _plant_massive(name: str, out: "torch.Tensor", scheme: InitScheme, seed: int) -> None:
    """Edit one tensor's FP32 values in place as the massive-activation plant says (see MassivePlant)."""
    import torch

    plant = scheme.massive
    assert plant is not None
    lay = massive_layout(plant, seed)
    massive = list(lay.massive_channels)
    t, c, n = lay.trigger_channel, lay.constant_channel, lay.plant_neuron
    if name == "model.embed_tokens.weight":
        out[:, t] = 0.0
        out[list(lay.trigger_ids), t] = plant.trigger_embedding
        out[:, c] = plant.constant_embedding
        return
    if name == "model.norm.weight":
        out[massive + [t, c]] = 0.0
        return
    if not name.startswith("model.layers."):
        return  # an untied lm_head reads the final norm's output, where those channels are 0
    layer = int(name.split(".")[2])
    kind = name.split(".", 3)[3]
    after = layer > plant.plant_layer
    d, s = plant.head_dim, plant.sink_dim
    if kind in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        if after:
            out[massive + [t]] = plant.small_norm_weight
        elif layer == plant.plant_layer and kind == "post_attention_layernorm.weight":
            out[t] = 1.0  # the plant neuron's input scale is then known
    elif kind in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        out[[t, c], :] = 0.0  # reserved: only the embedding writes t and c
        if kind == "mlp.down_proj.weight" and layer == plant.plant_layer:
            out[:, n] = 0.0
            out[massive, n] = torch.tensor(plant.plant_down_weights, device=out.device)
    elif kind in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight"):
        # Every token carries the constant: read anywhere else it would be a direction all
        # tokens share, and the hidden states would collapse onto it (measured on tiny:
        # one token top-1 at 31% of positions).
        out[:, c] = 0.0
        if kind in ("mlp.gate_proj.weight", "mlp.up_proj.weight") and layer == plant.plant_layer:
            out[n, :] = 0.0
            out[n, t] = plant.plant_gate_weight
        elif after and kind == "self_attn.q_proj.weight":
            rows = [h * d + s for h in range(plant.num_heads)]
            w = _qk_norm_scale(scheme, layer)
            rho = sink_scores(plant, seed, layer) * (plant.sink_query_weight_per_score[layer] / (w * w))
            out[rows, :] = 0.0
            out[rows, c] = rho.to(out.device)
        elif after and kind == "self_attn.k_proj.weight":
            rows = torch.tensor([j * d + s for j in range(plant.num_kv_heads)], device=out.device)
            signs = [math.copysign(plant.sink_key_weight, a) for a in plant.massive_values]
            out[rows, :] = 0.0
            out[rows[:, None], torch.tensor(massive, device=out.device)[None, :]] = torch.tensor(signs, device=out.device)
    elif after and kind in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        out[s] = _qk_norm_scale(scheme, layer)


INITS = ("fastqwen", "transformers")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def build_scheme(
    config: dict,
    init: InitScheme | str | None = None,
    final_norm_scale: float | None = None,
    massive_activations: bool = False,
) -> InitScheme:
    """The init scheme a checkpoint of `config` gets: a family by name (or a ready scheme), its final norm, the plant.

    `init`: "fastqwen" (default, `init_scheme`), "transformers" (`transformers_init`)
    or an InitScheme. `final_norm_scale` replaces the family's final norm weight
    (under "fastqwen" it keeps its jitter). `massive_activations` adds the
    `MassivePlant`. Raises UserError naming a bad value.
    """
    if init is None or init == "fastqwen":
        scheme = init_scheme(config)
    elif init == "transformers":
        scheme = transformers_init(config)
    elif isinstance(init, InitScheme):
        scheme = init
    else:
        raise UserError(f"unknown init {init!r}; known inits: {', '.join(INITS)}")
    if final_norm_scale is not None:
        scheme = dataclasses.replace(scheme, final_norm_scale=check_final_norm_scale(final_norm_scale))
    if massive_activations:
        scheme = dataclasses.replace(scheme, massive=massive_plant(config, scheme))
    return scheme


def provenance(preset: str, seed: int, device: str, scheme: InitScheme, config: dict) -> dict:
    """What `fastqwen_synth.json` records: how the weights were made, so a report can name the init.

    Nothing reads it to load the model (the engine and Transformers read config.json and
    the safetensors only); it is there for people and measurement scripts.
    """
    def plain(value: object) -> object:
        return None if isinstance(value, float) and not math.isfinite(value) else value

    skip = ("name", "massive", "head_dim", "query_heads_per_kv_head", "output_head")
    params = {f.name: plain(getattr(scheme, f.name)) for f in dataclasses.fields(scheme) if f.name not in skip}
    massive = None
    if scheme.massive is not None:
        plant = scheme.massive
        lay = massive_layout(plant, seed)
        geometry = ("hidden_size", "intermediate_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        massive = {f.name: getattr(plant, f.name) for f in dataclasses.fields(plant) if f.name not in geometry}
        massive.update(
            massive_channels=list(lay.massive_channels),
            trigger_channel=lay.trigger_channel,
            constant_channel=lay.constant_channel,
            plant_neuron=lay.plant_neuron,
            sink_dim=plant.sink_dim,
            judge_stream_rate_per_512=lay.judge_stream_rate_per_512,
            trigger_count=len(lay.trigger_ids),
            trigger_ids=list(lay.trigger_ids),
        )
    return {
        "generator": "fastqwen synth",
        "preset": preset,
        "seed": seed,
        # CPU and CUDA generators draw different values; cuda:N all draw the same.
        "device": device.split(":")[0],
        "init": {"name": scheme.name, **params},
        "massive_activations": massive,
        "sliding_window": config.get("sliding_window"),
    }


def synthesize(
    preset: str,
    out_dir: str | pathlib.Path,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = True,
    force: bool = False,
    config: dict | None = None,
    init: InitScheme | str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    sliding_window: int | None = None,
    final_norm_scale: float | None = None,
    massive_activations: bool = False,
) -> pathlib.Path:
    """Write a synthetic checkpoint of `preset` into `out_dir` and return its path.

    `config` (optional) replaces the preset's config.json dict, for tests that
    need an odd shape; `preset` still names the generation config. `init`:
    "fastqwen" (the default), "transformers", or an InitScheme (e.g. to show
    what a plain init does); `final_norm_scale` and `massive_activations` as in
    `build_scheme`. `sliding_window` (a positive int) is written into
    config.json; None keeps the preset's value (null: no window). Transformers
    4.51.3 windows every layer by it once the key length reaches it.
    `max_shard_bytes` caps a shard's tensor bytes (tests use a small cap to get several shards).
    Besides the model files the folder gets `fastqwen_synth.json` (`provenance`).
    Raises UserError for an unknown preset, init or device, a bad seed, window or
    final norm scale, or a non-empty folder without `force`; nothing is written then.
    """
    cfg = get_preset(preset) if config is None else dict(config)
    gen_cfg = get_generation_config(preset)
    device = check_device(device)
    check_seed(seed)
    if sliding_window is not None:
        if not _is_positive_int(sliding_window):
            raise UserError(f"sliding window must be a positive integer (keys per query), got {sliding_window!r}")
        cfg["sliding_window"] = sliding_window
    scheme = build_scheme(cfg, init, final_norm_scale, massive_activations)
    return write_checkpoint(pathlib.Path(out_dir), cfg, gen_cfg, expected_tensors(cfg),
                            lambda name, shape: make_tensor(name, shape, scheme, seed, device),
                            provenance(preset, seed, device, scheme, cfg),
                            force=force, max_shard_bytes=max_shard_bytes, progress=progress)


# ---------------------------------------------------------------------------
# CLI: `fastqwen synth` writes either family; a Qwen3.5 preset goes to fastqwen.synth35.
# ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True,
                        help="model shape: " + ", ".join(list(PRESETS) + list(synth35.PRESETS)))
    parser.add_argument("--out", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--device", default="cpu", help="where to generate: cpu or cuda (different values for the same seed)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    parser.add_argument(
        "--init", choices=INITS, default=None,
        help="weight family: fastqwen (the default: the project's stable, realistic scheme; for Qwen3.5 "
             "fastqwen.synth35's) or transformers (Transformers' own init, norm weights 1, final norm "
             "--final-norm-scale)",
    )
    parser.add_argument(
        "--final-norm-scale", type=float, metavar="S",
        help=f"final norm weight (default: {TRANSFORMERS_FINAL_NORM_SCALE:g} for --init transformers; "
             "the fastqwen init derives its own from the vocabulary)",
    )
    parser.add_argument(
        "--massive-activations", action="store_true",
        help="plant massive activations (|h| ~ 3000 on two channels at trigger tokens) and attention sinks, "
             "as trained Qwen3 checkpoints have (see fastqwen.synth.MassivePlant)",
    )
    parser.add_argument(
        "--sliding-window", type=int, metavar="N",
        help="write sliding_window: N into config.json (default: the preset's, null); "
             "Transformers 4.51.3 then windows every layer",
    )


def run(args: argparse.Namespace) -> int:
    if args.preset in synth35.PRESETS:
        for flag, used in (("--massive-activations", args.massive_activations),
                           ("--sliding-window", args.sliding_window is not None)):
            if used:
                raise UserError(f"{flag} is for the Qwen3 presets; {args.preset} takes --seed, --device, --init, "
                                "--final-norm-scale")
        out = synth35.synthesize(args.preset, args.out, seed=args.seed, device=args.device, force=args.force,
                                 final_norm_scale=args.final_norm_scale, init=args.init or "fastqwen")
        print(out)
        return 0
    out = synthesize(
        args.preset, args.out, seed=args.seed, device=args.device, progress=True, force=args.force,
        init=args.init or "fastqwen", final_norm_scale=args.final_norm_scale,
        massive_activations=args.massive_activations, sliding_window=args.sliding_window,
    )
    print(out)
    return 0
