"""What both synthetic-checkpoint families share: the seeded draws and the folder writer.

`fastqwen.synth` (Qwen3) and `fastqwen.synth35` (Qwen3.5) decide the weight values;
this module draws from per-tensor generators (`tensor_seed`, `vocab_row_factors`),
sizes the final norm for a target top-1/top-2 gap (`final_norm_for_gap`), checks the
user's device, seed and scale, and writes the folder as Hugging Face lays it out
(`write_checkpoint`: BF16 safetensors shards of at most ~4 GB, the index,
config.json, generation_config.json, the tokenizer, and the `fastqwen_synth.json`
provenance file that no loader reads). It imports neither family.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import pathlib
import sys
import time
from typing import TYPE_CHECKING, Callable

from fastqwen import tokenizer
from fastqwen.checkpoint import CONFIG_NAME, INDEX_NAME
from fastqwen.errors import UserError

if TYPE_CHECKING:
    import torch

# Hugging Face's habit: shards of at most ~4 GB (the real Qwen3-4B-Instruct-2507
# folder has three: two just under 4 GB and a small tail).
MAX_SHARD_BYTES = 4_000_000_000
BF16_BYTES = 2
PROVENANCE_NAME = "fastqwen_synth.json"

TensorSpecs = list[tuple[str, tuple[int, ...]]]


# ---------------------------------------------------------------------------
# Seeded draws.
# ---------------------------------------------------------------------------
def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one tensor, independent of the order tensors are made in."""
    digest = hashlib.sha256(f"fastqwen-synth/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def vocab_row_factors(rows: int, sigma: float, seed: int, name: str, device: str) -> "torch.Tensor":
    """FP32 factors exp(sigma * N(0, 1)) of RMS 1, one per vocabulary row of tensor `name`, from
    their own generator (seeded from (seed, name + "/row-norms"))."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name + "/row-norms"))
    factors = torch.exp(sigma * torch.randn(rows, generator=gen, device=device))
    return factors / factors.square().mean().sqrt()


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


def final_norm_for_gap(target_median_gap: float, vocab: int, row_norm_sigma: float, embedding_std: float,
                       hidden: int) -> float:
    """The final norm scale that gives logits (final-normed h) . E[v] ~ scale * embedding_std *
    sqrt(hidden) * c_v * N(0, 1) a median top-1/top-2 gap of `target_median_gap` (median_top_gap)."""
    return target_median_gap / (median_top_gap(vocab, row_norm_sigma) * embedding_std * math.sqrt(hidden))


# ---------------------------------------------------------------------------
# Checks of what the user passed.
# ---------------------------------------------------------------------------
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


def check_seed(seed: object) -> int:
    """`seed` if it is a non-negative integer; UserError otherwise."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


def check_final_norm_scale(scale: object) -> float:
    """`scale` as a float if it is a finite positive number; UserError otherwise."""
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not ok or not math.isfinite(scale) or scale <= 0:
        raise UserError(f"final norm scale must be a positive number, got {scale!r}")
    return float(scale)


# ---------------------------------------------------------------------------
# Writing the folder.
# ---------------------------------------------------------------------------
def plan_shards(specs: TensorSpecs, max_bytes: int = MAX_SHARD_BYTES) -> list[TensorSpecs]:
    """Split BF16 tensors, in order, into shards of at most `max_bytes` (a bigger tensor gets a shard alone)."""
    shards: list[TensorSpecs] = [[]]
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


def prepare_out_dir(out_dir: pathlib.Path, force: bool) -> None:
    """Create `out_dir`; a non-empty one is refused unless `force`, and then loses its old weights."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {str(out_dir)!r} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise UserError(f"output folder {str(out_dir)!r} is not empty; pass --force to overwrite it")
        # Remove the weights written there before, so no stale shard of another size survives.
        for old in list(out_dir.glob("model*.safetensors")) + [out_dir / INDEX_NAME, out_dir / PROVENANCE_NAME]:
            if old.is_file():
                old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def read_provenance(model_dir: str | pathlib.Path) -> dict | None:
    """The folder's `fastqwen_synth.json` as a dict, or None when it has none (a real checkpoint)."""
    path = pathlib.Path(model_dir) / PROVENANCE_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None


def write_checkpoint(
    out: pathlib.Path,
    config: dict,
    generation_config: dict,
    specs: TensorSpecs,
    make_tensor: Callable[[str, tuple[int, ...]], "torch.Tensor"],
    provenance: dict,
    *,
    force: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
) -> pathlib.Path:
    """Write a checkpoint folder: the tensors of `specs` drawn by `make_tensor(name, shape)` (BF16, on
    any device) into shards of at most `max_shard_bytes`, the index, `config`, `generation_config`,
    the tokenizer for `config`, and `provenance` as fastqwen_synth.json. Returns `out`.

    Callers check every argument first: the folder is prepared (`prepare_out_dir`) only here.
    Progress goes to stderr.
    """
    from safetensors.torch import save_file

    prepare_out_dir(out, force)
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
        tensors = {}
        for name, shape in shard:
            # Generate on the device (fast for the 4B), keep the shard on the CPU for writing.
            tensors[name] = make_tensor(name, shape).cpu()
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
    write_json(out / INDEX_NAME, {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))})
    write_json(out / CONFIG_NAME, config)
    write_json(out / "generation_config.json", generation_config)
    tokenizer.write_for_config(out, config, progress)
    write_json(out / PROVENANCE_NAME, provenance)
    return out
