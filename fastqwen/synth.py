"""`fastqwen synth`: write a synthetic Qwen3 checkpoint with the real layout and shapes.

The folder holds `config.json`, `generation_config.json`, BF16 safetensors
shards named as Hugging Face names them and `model.safetensors.index.json`,
so Transformers and any engine load it exactly as they load the real model.
Only the weight values are synthetic; speed does not depend on them, and the
init scheme below makes the logits spread like a trained model's, so that the
2.0-logit correctness gate can actually fail, while keeping the model as
insensitive to the order of BF16 sums as a trained one, so that a correct
engine passes it.

Determinism: every tensor gets its own generator, seeded from (seed, tensor
name), so the bytes do not depend on the order tensors are made in. The same
preset, seed and device give the same bytes; CPU and CUDA generators are
different algorithms, so `--device cpu` and `--device cuda` give different
(equally valid) weights for the same seed.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastqwen.checkpoint import expected_tensors
from fastqwen.errors import UserError
from fastqwen.presets import PRESETS, get_generation_config, get_preset

if TYPE_CHECKING:
    import torch

# Hugging Face's habit: shards of at most ~4 GB (the real Qwen3-4B-Instruct-2507
# folder has three: two just under 4 GB and a small tail).
MAX_SHARD_BYTES = 4_000_000_000
BF16_BYTES = 2


# ---------------------------------------------------------------------------
# The init scheme: the one place that decides the weight values.
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class InitScheme:
    """How each kind of tensor is drawn, and why. Measured with scripts/synth_sweep.py (results/synth_sweep/).

    A synthetic checkpoint must behave like a trained model in two ways.
    (1) Realistic logits, so the 2.0-logit gate can fail: top-1 far above the
    median, a top-1/top-2 gap with median ~1, p10 ~0.1 and p90 several logits;
    different positions predicting different tokens; greedy decoding that
    does not fall into a one-token loop. (2) Numerical stability: reordering
    BF16 sums (native's cached decode vs one full forward over the same
    tokens) must move the logits by a fraction of a logit.

    The previous scheme (`sharp_attention_init`) had (1) but not (2): the two
    paths differed by up to 37 logits on the 0.6B shape (CPU) and 27.5 on the
    4B (H200). In FP32 the same comparison differs by 3e-6 (relative, last
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
    the winner, compounding over depth. Now only the first `stem_layers` (2)
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
    positions of the max |logit diff| over the vocabulary / max slack):
      0.6B: previous 30.8 / 37.1 / 34.4 -> now 0.24 / 0.34 / 0.19
      4B:   previous 21.1 / 32.3 / 22.8 (H200: 20.2 / 27.5 / 28.8) -> now 0.34 / 0.53 / 0.19
      tiny's width at 24 layers, seeds 0-3: previous 2.0-2.9 / 7.9-14.9 / 2.9-7.3
            -> now 0.11-0.12 / 0.21-0.25 / <= 0.06
    with gaps p10/p50/p90 0.125/0.875/2.9, top-1 ~15 above the median, 58-67% of
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


# The chosen values (see InitScheme); scripts/synth_sweep.py measures alternatives.
QK_NORM_SCALE = 1.25
STEM_LAYERS = 2
STEM_QK_NORM_SCALE = 3.0
KEY_QUERY_CORRELATION = 0.7
VOCAB_ROW_NORM_SIGMA = 0.25
NORM_JITTER = 0.2
EMBEDDING_STD_RATIO = 0.25


@functools.lru_cache(maxsize=None)
def median_top_gap(vocab: int, row_norm_sigma: float, draws: int = 256) -> float:
    """Median top-1/top-2 gap of `vocab` logits c_v * N(0, 1), c_v log-normal of RMS 1 (fixed-seed simulation).

    Deterministic (its own CPU generator and seed, float64), so the final norm
    scale, and the checkpoint bytes, do not depend on anything but the config.
    With sigma 0 this is the classic ~ln 2 / sqrt(2 ln V).
    """
    import torch

    if vocab < 2:
        raise ValueError(f"vocab must be at least 2, got {vocab}")
    gen = torch.Generator().manual_seed(20250101)
    c = torch.exp(row_norm_sigma * torch.randn(vocab, generator=gen, dtype=torch.float64))
    c /= c.square().mean().sqrt()
    gaps = torch.empty(draws, dtype=torch.float64)
    for i in range(draws):
        top = (torch.randn(vocab, generator=gen, dtype=torch.float64) * c).topk(2).values
        gaps[i] = top[0] - top[1]
    return float(gaps.median())


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

    The keyword arguments exist for scripts/synth_sweep.py; checkpoints use the defaults.
    """
    if not 0.0 <= key_query_correlation <= 1.0:
        raise ValueError(f"key_query_correlation must lie in [0, 1], got {key_query_correlation}")
    matrix_std = float(config.get("initializer_range", 0.02))
    embedding_std = matrix_std * float(embedding_std_ratio)
    if late_output_scale is None:
        late_output_scale = default_late_output_scale(int(config["num_hidden_layers"]), int(stem_layers))
    hidden = int(config["hidden_size"])
    head_dim, group, output_head = _geometry(config)
    gap_at_unit_scale = median_top_gap(int(config["vocab_size"]), float(vocab_row_norm_sigma))
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
        final_norm_scale=target_median_gap / (gap_at_unit_scale * embedding_std * math.sqrt(hidden)),
        target_median_gap=target_median_gap,
        head_dim=head_dim,
        query_heads_per_kv_head=group,
        output_head=output_head,
    )


def sharp_attention_init(config: dict, target_median_gap: float = 1.0) -> InitScheme:
    """The previous scheme (q/k norm weights 3 in every layer, full-size embedding and outputs, equal row norms).

    Realistic logit statistics but numerically chaotic: on deep shapes the
    cached decode lands tens of logits from the full forward. Kept to show, in
    tests and scripts/synth_sweep.py, that the stability check can fail. (Its
    final norm scale now comes from `median_top_gap`, ~11% below the old
    closed-form estimate, so its bytes differ from old checkpoints.)
    """
    return init_scheme(
        config, target_median_gap, qk_norm_scale=3.0, key_query_correlation=0.0, vocab_row_norm_sigma=0.0,
        stem_layers=0, embedding_std_ratio=1.0,
    )


def plain_init(config: dict) -> InitScheme:
    """Transformers' own init (N(0, 0.02) matrices, norm weights exactly 1): logits too flat for the gate.

    Kept to show, in tests, that the logit-scale checks can fail.
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
    )


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one tensor, independent of the order tensors are made in."""
    digest = hashlib.sha256(f"fastqwen-synth/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _normal(name: str, shape: tuple[int, ...], seed: int, device: str) -> "torch.Tensor":
    """N(0, 1) FP32 draws from the tensor's own generator."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)


def make_tensor(name: str, shape: tuple[int, ...], scheme: InitScheme, seed: int, device: str) -> "torch.Tensor":
    """One BF16 tensor drawn as the scheme says for its kind, on `device`.

    Depends only on (name, shape, scheme, seed, device): a k_proj redraws its
    layer's q_proj from the q_proj's own seed rather than reading it.
    """
    import torch

    if len(shape) == 2:
        # Drawn in FP32 and rounded once, like a BF16 checkpoint saved from FP32 training.
        out = _normal(name, shape, seed, device)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out.mul_(scheme.embedding_std / scheme.matrix_std)
        if name == scheme.output_head and scheme.vocab_row_norm_sigma > 0:
            gen = torch.Generator(device=device)
            gen.manual_seed(tensor_seed(seed, name + "/row-norms"))
            rows = torch.exp(scheme.vocab_row_norm_sigma * torch.randn(shape[0], generator=gen, device=device))
            out.mul_((rows / rows.square().mean().sqrt())[:, None])
        elif name.endswith("self_attn.k_proj.weight") and scheme.key_query_correlation > 0:
            out = _correlate_with_queries(name, out, scheme, seed, device)
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            if int(name.split(".")[2]) >= scheme.stem_layers:
                out.mul_(scheme.late_output_scale)
        return out.mul_(scheme.matrix_std).to(torch.bfloat16)
    if name.endswith("self_attn.q_norm.weight") or name.endswith("self_attn.k_norm.weight"):
        in_stem = int(name.split(".")[2]) < scheme.stem_layers
        scale = scheme.stem_qk_norm_scale if in_stem else scheme.qk_norm_scale
    elif name == "model.norm.weight":
        scale = scheme.final_norm_scale
    else:
        scale = 1.0
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    u = torch.rand(shape, generator=gen, device=device, dtype=torch.float32)
    return ((1.0 - scheme.norm_jitter) + 2.0 * scheme.norm_jitter * u).mul_(scale).to(torch.bfloat16)


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
# Writing the folder.
# ---------------------------------------------------------------------------
def plan_shards(specs: list[tuple[str, tuple[int, ...]]], max_bytes: int = MAX_SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most `max_bytes` (a bigger tensor gets a shard alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * BF16_BYTES
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def shard_name(k: int, n: int) -> str:
    """Hugging Face's shard file name, 1-based."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def check_device(device: str) -> str:
    """`device` if it names a usable torch device ('cpu', 'cuda', 'cuda:N'); UserError otherwise."""
    import torch

    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"device {device!r} requested but CUDA is not available here")
        index = int(device[5:]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device {device!r} does not exist (this machine has {torch.cuda.device_count()} GPUs)")
        return device
    raise UserError(f"unknown device {device!r}; use 'cpu' or 'cuda' (or 'cuda:N')")


def _prepare_out_dir(out_dir: pathlib.Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {str(out_dir)!r} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise UserError(f"output folder {str(out_dir)!r} is not empty; pass --force to overwrite it")
        # Remove what an earlier run wrote, so no stale shard of another size survives.
        for old in list(out_dir.glob("model*.safetensors")) + [out_dir / "model.safetensors.index.json"]:
            if old.is_file():
                old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def synthesize(
    preset: str,
    out_dir: str | pathlib.Path,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = True,
    force: bool = False,
    config: dict | None = None,
    init: InitScheme | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> pathlib.Path:
    """Write a synthetic checkpoint of `preset` into `out_dir` and return its path.

    `config` (optional) replaces the preset's config.json dict, for tests that
    need an odd shape; `preset` still names the generation config. `init`
    (optional) replaces `init_scheme(config)`, e.g. to show what a plain init does.
    `max_shard_bytes` caps a shard's tensor bytes (tests use a small cap to get several shards).
    Raises UserError for an unknown preset or device, or a non-empty folder without `force`.
    """
    import torch
    from safetensors.torch import save_file

    cfg = get_preset(preset) if config is None else dict(config)
    gen_cfg = get_generation_config(preset)
    device = check_device(device)
    if not isinstance(seed, int) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")
    out = pathlib.Path(out_dir)
    _prepare_out_dir(out, force)

    scheme = init_scheme(cfg) if init is None else init
    specs = expected_tensors(cfg)
    shards = plan_shards(specs, max_shard_bytes)
    total_bytes = sum(math.prod(s) * BF16_BYTES for _, s in specs)
    weight_map: dict[str, str] = {}
    done_tensors = 0
    done_bytes = 0
    start = last_report = time.monotonic()

    def report(where: str) -> None:
        print(
            f"synth: {where}: {done_tensors}/{len(specs)} tensors, "
            f"{done_bytes / 1e9:.2f}/{total_bytes / 1e9:.2f} GB, {time.monotonic() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    for k, shard in enumerate(shards, start=1):
        fname = shard_name(k, len(shards))
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in shard:
            # Generate on the device (fast for the 4B), keep the shard on the CPU for writing.
            tensors[name] = make_tensor(name, shape, scheme, seed, device).cpu()
            weight_map[name] = fname
            done_tensors += 1
            done_bytes += math.prod(shape) * BF16_BYTES
            if progress and time.monotonic() - last_report > 5.0:
                report(f"generating {fname}")
                last_report = time.monotonic()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
        if progress:
            report(f"wrote {fname}")
            last_report = time.monotonic()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", gen_cfg)
    return out


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="model shape: " + ", ".join(PRESETS))
    parser.add_argument("--out", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--device", default="cpu", help="where to generate: cpu or cuda (different values for the same seed)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")


def run(args: argparse.Namespace) -> int:
    out = synthesize(args.preset, args.out, seed=args.seed, device=args.device, progress=True, force=args.force)
    print(out)
    return 0
