"""`fastqwen synth`: write a synthetic Qwen3 checkpoint with the real layout and shapes.

The folder holds `config.json`, `generation_config.json`, BF16 safetensors
shards named as Hugging Face names them and `model.safetensors.index.json`,
so Transformers and any engine load it exactly as they load the real model.
Only the weight values are synthetic; speed does not depend on them, and the
init scheme below makes the logits spread like a trained model's so that the
2.0-logit correctness gate can actually fail.

Determinism: every tensor gets its own generator, seeded from (seed, tensor
name), so the bytes do not depend on the order tensors are made in. The same
preset, seed and device give the same bytes; CPU and CUDA generators are
different algorithms, so `--device cpu` and `--device cuda` give different
(equally valid) weights for the same seed.
"""
from __future__ import annotations

import argparse
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
    """How each kind of tensor is drawn.

    Matrices (embedding, projections, untied LM head) are N(0, matrix_std^2),
    the plain Transformers init. RMSNorm weights are `scale * U(1 - jitter,
    1 + jitter)`: a jitter rather than exact ones so that a kernel that forgets
    to multiply by a norm weight gives different tokens than the reference.

    Why the final norm is scaled up: with the plain init every logit lies
    within ~2 of the others, so a 2.0-logit gate could never fail. The logit of
    token v is (final-normed h) . E[v]; with h of RMS `final_norm_scale` and
    rows of E of std `matrix_std`, the logits are roughly N(0, sigma^2) with
    sigma = final_norm_scale * matrix_std * sqrt(hidden). For V such draws the
    top-1/top-2 gap is about exponential with mean sigma / sqrt(2 ln V), so its
    median is ln 2 * sigma / sqrt(2 ln V). We pick sigma for a median gap of
    `target_median_gap` logits (1.0, as in a trained model), which also puts
    p10 near 0.15 and p90 near 3.3, and the top-1 about sqrt(2 ln V) * sigma
    (~30 logits at the 4B's vocabulary) above the median. A measurement on the
    4B shape matched: scale 7 gave gaps p10/median/p90 0.13/1.13/3.63.

    Why q_norm/k_norm are scaled up: after the per-head RMSNorm, q.k/sqrt(d)
    has a std of about qk_norm_scale^2. At scale 1 attention is nearly uniform,
    every position averages the same values, and the residual streams of all
    positions collapse onto one shared direction (a known trait of random deep
    transformers): on the 0.6B shape with scale 1.5, a 512-token teacher-forced
    run had one argmax token at 234 positions and only 59 distinct argmaxes,
    with gaps too wide (median 1.75). At scale 3 (score std ~9) attention
    points at a few positions as trained heads do, the streams stay distinct
    (491 distinct argmaxes of 512) and the gaps follow the estimate above
    (p10/median/p90 0.12/1.0/3.4). Peaked attention also makes a position or
    masking error in an engine change its tokens visibly.

    `fastqwen synth-stats` measures the result; results/synth_stats/ holds the
    committed figures (tiny and 0.6B on the CPU: gaps 0.125/1.125/3.5).
    """

    matrix_std: float
    norm_jitter: float
    qk_norm_scale: float
    final_norm_scale: float
    target_median_gap: float


def init_scheme(config: dict, target_median_gap: float = 1.0) -> InitScheme:
    """The init scheme for a Qwen3 config dict (see InitScheme for the reasoning)."""
    matrix_std = float(config.get("initializer_range", 0.02))
    vocab = int(config["vocab_size"])
    hidden = int(config["hidden_size"])
    logit_std = target_median_gap * math.sqrt(2.0 * math.log(vocab)) / math.log(2.0)
    return InitScheme(
        matrix_std=matrix_std,
        norm_jitter=0.2,
        qk_norm_scale=3.0,
        final_norm_scale=logit_std / (matrix_std * math.sqrt(hidden)),
        target_median_gap=target_median_gap,
    )


def plain_init(config: dict) -> InitScheme:
    """Transformers' own init (N(0, 0.02) matrices, norm weights exactly 1): logits too flat for the gate.

    Kept to show, in tests, that the logit-scale checks can fail.
    """
    return InitScheme(
        matrix_std=float(config.get("initializer_range", 0.02)),
        norm_jitter=0.0,
        qk_norm_scale=1.0,
        final_norm_scale=1.0,
        target_median_gap=float("nan"),
    )


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one tensor, independent of the order tensors are made in."""
    digest = hashlib.sha256(f"fastqwen-synth/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def make_tensor(name: str, shape: tuple[int, ...], scheme: InitScheme, seed: int, device: str) -> "torch.Tensor":
    """One BF16 tensor drawn as the scheme says for its kind, on `device`."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    if len(shape) == 2:
        # Drawn in FP32 and rounded once, like a BF16 checkpoint saved from FP32 training.
        out = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return out.mul_(scheme.matrix_std).to(torch.bfloat16)
    if name.endswith("self_attn.q_norm.weight") or name.endswith("self_attn.k_norm.weight"):
        scale = scheme.qk_norm_scale
    elif name == "model.norm.weight":
        scale = scheme.final_norm_scale
    else:
        scale = 1.0
    u = torch.rand(shape, generator=gen, device=device, dtype=torch.float32)
    return ((1.0 - scheme.norm_jitter) + 2.0 * scheme.norm_jitter * u).mul_(scale).to(torch.bfloat16)


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
