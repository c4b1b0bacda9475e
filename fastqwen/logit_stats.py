"""`fastqwen synth-stats`: how a checkpoint's logits are spread, as the correctness gate sees them.

The gate replays emitted tokens teacher-forced through Transformers (BF16,
sdpa) and fails a position whose token's logit is more than 2.0 below the
maximum. Whether a wrong token can pass depends on how far the top-1 logit
stands above the rest, so we measure, per position of a teacher-forced
forward of the same kind: the top-1 logit, top-1 minus the median logit, and
the top-1/top-2 gap. On synthetic weights these figures show whether the gate
has teeth (a trained model: median gap about 1, p10 about 0.1, p90 several).

The input is text-like random ids: Zipf-distributed tokens (frequent ones
spread over the vocabulary by a seeded permutation) with a bank of phrases
that recur, so attention sees repetition as in real text.

Whether the gate is fair depends on a second property, measured here as
`cached_vs_full`: how far Transformers' own cached decode (prefill, then one
token per forward, teacher-forced on the same ids) lands from one full
forward over the same sequence. The two differ only in the order of BF16
sums, so on a trained model they agree to well under a logit; a checkpoint
on which they do not is numerically chaotic, and no engine could be judged
on it. BF16 on the CPU also orders sums differently in the two paths, so the
check means something on either device.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING

from fastqwen.errors import UserError
from fastqwen.refenv import QWEN35_MODEL_TYPES

# Set in the process run() starts in Transformers 5.17's environment for a Qwen3.5 checkpoint.
_IN_REFERENCE_ENV = "FASTQWEN_SYNTH_STATS_IN_REFERENCE_ENV"

if TYPE_CHECKING:
    import numpy as np
    import torch

QUANTILES = (10, 50, 90, 99)
STAT_NAMES = ("top1_logit", "max_minus_median", "top1_top2_gap")
# Gap thresholds worth counting: under 2.0 a second token would also pass the gate.
GAP_THRESHOLDS = (0.5, 1.0, 2.0)
MAX_SEQUENCE_LENGTH = 1024
# cached_vs_full: each sequence is a prompt of this many ids, prefilled with the
# cache, then decoded one id per forward; the prefill's last position and every
# decode step are compared with one full forward over the whole sequence.
STABILITY_PROMPT_LENGTH = 128
STABILITY_POSITIONS_PER_SEQUENCE = 64


def text_like_ids(vocab_size: int, lengths: list[int], seed: int = 0, zipf_a: float = 1.1) -> list[list[int]]:
    """Sequences of token ids that look statistically like text: Zipf frequencies and recurring phrases."""
    import numpy as np

    if vocab_size < 2:
        raise UserError(f"vocab_size must be at least 2, got {vocab_size}")
    rng = np.random.default_rng(seed)
    rank_to_id = rng.permutation(vocab_size)

    def zipf_tokens(n: int) -> np.ndarray:
        ranks = rng.zipf(zipf_a, size=n) - 1
        # Ranks beyond the vocabulary fold back into it uniformly (the long tail).
        tail = ranks >= vocab_size
        ranks[tail] = rng.integers(0, vocab_size, size=int(tail.sum()))
        return rank_to_id[ranks]

    phrases = [zipf_tokens(int(rng.integers(2, 9))) for _ in range(64)]
    out: list[list[int]] = []
    for length in lengths:
        seq: list[int] = []
        while len(seq) < length:
            if rng.random() < 0.3:
                # Popular phrases recur more often than rare ones.
                k = min(int(rng.zipf(1.5)) - 1, len(phrases) - 1)
                seq.extend(int(t) for t in phrases[k])
            else:
                seq.append(int(zipf_tokens(1)[0]))
        out.append(seq[:length])
    return out


def position_statistics(logits: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Per-position statistics of logits [positions, vocab] (any float dtype), as FP32 vectors."""
    x = logits.float()
    top2 = x.topk(2, dim=-1).values
    median = x.median(dim=-1).values
    return {
        "top1_logit": top2[:, 0],
        "max_minus_median": top2[:, 0] - median,
        "top1_top2_gap": top2[:, 0] - top2[:, 1],
    }


def cached_and_full_logits(model: "torch.nn.Module", ids: list[int], prompt_length: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """FP32 logits [len(ids) - prompt_length + 1, vocab] of the cached path and of one full forward.

    The cached path is what the native engine runs: a forward over the first
    `prompt_length` ids with `use_cache=True`, then one forward per further id
    with the returned cache and `logits_to_keep=1`, teacher-forced on `ids`
    (not on its own argmax, so both paths see the same tokens). Rows are the
    positions prompt_length - 1 .. len(ids) - 1. Call under inference mode.
    """
    import torch

    if not 1 <= prompt_length <= len(ids):
        raise ValueError(f"prompt_length {prompt_length} must lie in [1, {len(ids)}]")
    device = model.device
    seq = torch.tensor([ids], dtype=torch.long, device=device)
    full = model(input_ids=seq, use_cache=False).logits[0, prompt_length - 1:].float()
    out = model(input_ids=seq[:, :prompt_length], use_cache=True)
    cache = out.past_key_values
    rows = [out.logits[0, -1].float()]
    del out
    for t in range(prompt_length, len(ids)):
        out = model(input_ids=seq[:, t:t + 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        rows.append(out.logits[0, -1].float())
        del out
    return torch.stack(rows), full


def compare_cached_full(cached: "torch.Tensor", full: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Per-position agreement of two logit matrices [positions, vocab], as FP32 / bool vectors.

    max_abs_diff: max over the vocabulary of |cached - full|. argmax_differs:
    the two argmaxes differ (ties go to the lowest index, as in torch). slack:
    full's max logit minus full's logit at cached's argmax, i.e. by how much
    the gate's replay (the full forward) would find the cached path's token
    below its top; 0 where the argmaxes agree.
    """
    if cached.shape != full.shape or cached.dim() != 2:
        raise ValueError(f"need two [positions, vocab] matrices of one shape, got {tuple(cached.shape)} and {tuple(full.shape)}")
    c, f = cached.float(), full.float()
    pick = c.argmax(dim=-1)
    return {
        "max_abs_diff": (c - f).abs().amax(dim=-1),
        "argmax_differs": pick != f.argmax(dim=-1),
        "slack": f.amax(dim=-1) - f.gather(1, pick[:, None])[:, 0],
    }


def cached_vs_full(
    model: "torch.nn.Module",
    vocab_size: int,
    positions: int,
    seed: int = 0,
    prompt_length: int = STABILITY_PROMPT_LENGTH,
    per_sequence: int = STABILITY_POSITIONS_PER_SEQUENCE,
) -> dict:
    """How far the cached decode path lands from one full forward, over `positions` compared positions.

    Sequences are text-like ids (their own seed stream, apart from the scale
    statistics' sequences) of `prompt_length` prompt ids plus `per_sequence - 1`
    decoded ids each. Returns a JSON-ready dict: the max/p99/mean of the
    per-position max |logit diff|, how many positions' argmaxes differ, and
    the largest slack (see `compare_cached_full`).
    """
    import numpy as np
    import torch

    if not isinstance(positions, int) or positions < 1:
        raise UserError(f"stability positions must be a positive integer, got {positions!r}")
    n_seq = math.ceil(positions / per_sequence)
    counts = [per_sequence] * (n_seq - 1) + [positions - per_sequence * (n_seq - 1)]
    sequences = text_like_ids(vocab_size, [prompt_length + k - 1 for k in counts], seed=seed + 1_000_003)
    diffs, slacks = [], []
    differs = 0
    with torch.inference_mode():
        for ids in sequences:
            cmp = compare_cached_full(*cached_and_full_logits(model, ids, prompt_length))
            diffs.append(cmp["max_abs_diff"].cpu().numpy())
            slacks.append(cmp["slack"].cpu().numpy())
            differs += int(cmp["argmax_differs"].sum())
    d = np.concatenate(diffs)
    return {
        "positions": int(d.size),
        "sequences": len(sequences),
        "prompt_length": prompt_length,
        "max_abs_diff": {"max": float(d.max()), "p99": float(np.percentile(d, 99)), "mean": float(d.mean())},
        "argmax_differs": differs,
        "max_slack": float(np.concatenate(slacks).max()),
    }


def summarize(values: "np.ndarray | list[float]") -> dict[str, float]:
    """mean and the QUANTILES percentiles of a vector, as plain floats."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("summarize() needs at least one value")
    out = {"mean": float(v.mean())}
    for q in QUANTILES:
        out[f"p{q}"] = float(np.percentile(v, q))
    return out


def _matching_preset(config: dict) -> str | None:
    from fastqwen.presets import PRESETS

    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    for name, preset in PRESETS.items():
        if all(preset.get(k) == config.get(k) for k in keys):
            return name
    return None


def measure(
    model_dir: str | pathlib.Path,
    positions: int = 4096,
    device: str = "cpu",
    seed: int = 0,
    stability_positions: int = 256,
) -> dict:
    """Teacher-forced logit statistics of the model in `model_dir` over `positions` text-like positions.

    Loads with `transformers.Qwen3ForCausalLM` in BF16 with sdpa (as the
    judge's replay does), runs sequences of up to MAX_SEQUENCE_LENGTH tokens
    one at a time, then compares cached decode with the full forward over
    `stability_positions` positions (`cached_vs_full`; 0 skips it), and
    returns a JSON-ready dict (see `format_table`).
    """
    import numpy as np
    import torch
    import transformers

    from fastqwen.checkpoint import check_tensors, read_config
    from fastqwen.synth_common import check_device

    if not isinstance(positions, int) or positions < 2:
        raise UserError(f"positions must be an integer of at least 2, got {positions!r}")
    if not isinstance(stability_positions, int) or stability_positions < 0:
        raise UserError(f"stability positions must be a non-negative integer, got {stability_positions!r}")
    device = check_device(device)
    cfg = read_config(model_dir)
    check_tensors(model_dir)
    seq_len = min(MAX_SEQUENCE_LENGTH, int(cfg.get("max_position_embeddings", MAX_SEQUENCE_LENGTH)), positions)
    n_seq = math.ceil(positions / seq_len)
    lengths = [seq_len] * (n_seq - 1) + [positions - seq_len * (n_seq - 1)]
    sequences = text_like_ids(int(cfg["vocab_size"]), lengths, seed=seed)

    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()
    start = time.monotonic()
    if cfg.get("model_type") in QWEN35_MODEL_TYPES:   # run() put Transformers 5.17 first on the path
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa"
        ).to(device).eval()
    else:
        model = transformers.Qwen3ForCausalLM.from_pretrained(
            str(model_dir), torch_dtype=torch.bfloat16, attn_implementation="sdpa"
        ).to(device).eval()
    load_s = time.monotonic() - start

    collected: dict[str, list[np.ndarray]] = {k: [] for k in STAT_NAMES}
    all_finite = True
    top1_is_input = 0
    distinct_top1 = 0
    top1_counts: dict[int, int] = {}
    start = time.monotonic()
    with torch.inference_mode():
        for seq in sequences:
            ids = torch.tensor([seq], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0]
            all_finite &= bool(torch.isfinite(logits).all())
            top1 = logits.argmax(dim=-1)
            top1_is_input += int((top1 == ids[0]).sum())
            distinct_top1 += int(top1.unique().numel())
            for token in top1.tolist():
                top1_counts[token] = top1_counts.get(token, 0) + 1
            for k, v in position_statistics(logits).items():
                collected[k].append(v.cpu().numpy())
            del logits
    forward_s = time.monotonic() - start
    start = time.monotonic()
    stability = (
        cached_vs_full(model, int(cfg["vocab_size"]), stability_positions, seed=seed) if stability_positions else None
    )
    stability_s = time.monotonic() - start

    stats: dict[str, dict[str, float]] = {}
    for k in STAT_NAMES:
        stats[k] = summarize(np.concatenate(collected[k]))
    gaps = np.concatenate(collected["top1_top2_gap"])
    result = {
        "model_dir": str(model_dir),
        "preset": _matching_preset(cfg),
        "config": {
            k: cfg.get(k)
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                      "rope_theta", "rms_norm_eps")
        },
        "final_norm_weight_mean": float(model.model.norm.weight.detach().float().mean()),
        "positions": int(gaps.size),
        "sequences": len(sequences),
        "sequence_length": seq_len,
        "seed": seed,
        "stats": stats,
        "fraction_gap_below": {str(t): float((gaps < t).mean()) for t in GAP_THRESHOLDS},
        "fraction_top1_is_input_token": top1_is_input / gaps.size,
        # Collapse check: a model whose hidden states collapse predicts one token everywhere.
        "distinct_top1_fraction": distinct_top1 / gaps.size,
        "most_common_top1_fraction": max(top1_counts.values()) / gaps.size,
        "all_logits_finite": all_finite,
        "cached_vs_full": stability,
        "dtype": "bfloat16",
        "attn_implementation": "sdpa",
        "device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "load_s": round(load_s, 2),
        "forward_s": round(forward_s, 2),
        "stability_s": round(stability_s, 2),
    }
    result["realism_problems"] = realism_problems(result)
    result["stability_problems"] = stability_problems(result)
    return result


# What "spread like a trained model" means, as checkable bounds on `measure()`'s result.
# A trained model's top-1/top-2 gap has a median near 1 logit, a p10 near 0.1 and
# a p90 of several logits, its top-1 stands far above the median logit, and
# different positions predict different tokens.
REALISM_BOUNDS = {
    "max_minus_median_p50_min": 10.0,
    "gap_p50_range": (0.4, 2.5),
    "gap_p10_max": 0.5,
    "gap_p90_min": 1.5,
    "top1_is_input_max": 0.25,
    # Hidden states that collapse onto one shared direction predict one token
    # almost everywhere (seen at 4-7% distinct, one token at 30-50% of positions).
    "distinct_top1_min": 0.15,
    "most_common_top1_max": 0.15,
}

# What "stable like a trained model" means for `cached_vs_full`. On the real
# Qwen3-4B the two paths differ by at most ~0.75 logits, at a handful of
# positions in twelve thousand (CONTRACT.md, "Numerics"); the bounds leave room
# for fewer, shorter measurements and the CPU's different kernels, and sit far
# below what a chaotic checkpoint shows (tens of logits).
STABILITY_BOUNDS = {
    "max_abs_diff_max": 1.5,
    "max_abs_diff_mean_max": 0.5,
    "max_slack_max": 0.75,
}


def realism_problems(result: dict) -> list[str]:
    """Why `measure()`'s result does not look like a trained model's logits (empty list: it does)."""
    b = REALISM_BOUNDS
    s = result["stats"]
    gap, mm = s["top1_top2_gap"], s["max_minus_median"]
    problems = []
    if not result["all_logits_finite"]:
        problems.append("some logits are inf or nan")
    if mm["p50"] < b["max_minus_median_p50_min"]:
        problems.append(f"median of max-minus-median is {mm['p50']:.2f} < {b['max_minus_median_p50_min']}: logits too flat")
    lo, hi = b["gap_p50_range"]
    if not lo <= gap["p50"] <= hi:
        problems.append(f"median top-1/top-2 gap is {gap['p50']:.3f}, outside [{lo}, {hi}]")
    if gap["p10"] > b["gap_p10_max"]:
        problems.append(f"p10 of the gap is {gap['p10']:.3f} > {b['gap_p10_max']}: no close calls")
    if gap["p90"] < b["gap_p90_min"]:
        problems.append(f"p90 of the gap is {gap['p90']:.3f} < {b['gap_p90_min']}: gap distribution collapsed")
    if result["fraction_top1_is_input_token"] > b["top1_is_input_max"]:
        problems.append(
            f"top-1 is the input token at {result['fraction_top1_is_input_token']:.1%} of positions: the model only echoes"
        )
    if result["distinct_top1_fraction"] < b["distinct_top1_min"]:
        problems.append(
            f"only {result['distinct_top1_fraction']:.1%} of positions have a top-1 of their own: hidden states collapse"
        )
    if result["most_common_top1_fraction"] > b["most_common_top1_max"]:
        problems.append(
            f"one token is top-1 at {result['most_common_top1_fraction']:.1%} of positions: hidden states collapse"
        )
    return problems


def stability_problems(result: dict) -> list[str]:
    """Why `measure()`'s cached-vs-full comparison looks chaotic (empty list: stable; or not measured)."""
    s = result.get("cached_vs_full")
    if s is None:
        return []
    b = STABILITY_BOUNDS
    d = s["max_abs_diff"]
    problems = []
    if d["max"] > b["max_abs_diff_max"]:
        problems.append(f"cached decode and full forward differ by up to {d['max']:.3f} > {b['max_abs_diff_max']} logits")
    if d["mean"] > b["max_abs_diff_mean_max"]:
        problems.append(
            f"mean per-position max difference {d['mean']:.3f} > {b['max_abs_diff_mean_max']} logits"
        )
    if s["max_slack"] > b["max_slack_max"]:
        problems.append(f"the full forward puts the cached path's token up to {s['max_slack']:.3f} > {b['max_slack_max']} below its top")
    return problems


def format_table(result: dict) -> str:
    """A short human-readable table of `measure()`'s statistics."""
    cols = ["mean"] + [f"p{q}" for q in QUANTILES]
    lines = [
        f"{result['model_dir']} (preset {result['preset']}), {result['positions']} positions, {result['device']}",
        f"{'':18}" + "".join(f"{c:>9}" for c in cols),
    ]
    for k in STAT_NAMES:
        lines.append(f"{k:18}" + "".join(f"{result['stats'][k][c]:9.3f}" for c in cols))
    below = ", ".join(f"<{t}: {v:.3f}" for t, v in result["fraction_gap_below"].items())
    lines.append(f"fraction of positions with gap {below}")
    lines.append(
        f"distinct top-1 tokens: {result['distinct_top1_fraction']:.3f} of positions; "
        f"most common top-1: {result['most_common_top1_fraction']:.3f}"
    )
    problems = realism_problems(result)
    lines.append("realistic logit scale: " + ("yes" if not problems else "NO: " + "; ".join(problems)))
    s = result.get("cached_vs_full")
    if s is not None:
        d = s["max_abs_diff"]
        lines.append(
            f"cached_vs_full over {s['positions']} positions: max |diff| max {d['max']:.3f}, p99 {d['p99']:.3f}, "
            f"mean {d['mean']:.3f}; argmax differs at {s['argmax_differs']}; max slack {s['max_slack']:.3f}"
        )
        problems = stability_problems(result)
        lines.append("numerically stable: " + ("yes" if not problems else "NO: " + "; ".join(problems)))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (Hugging Face layout)")
    parser.add_argument("--positions", type=int, default=4096, help="teacher-forced positions to measure (default 4096)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="seed of the text-like input ids")
    parser.add_argument(
        "--stability-positions", type=int, default=256,
        help="positions compared between cached decode and one full forward (default 256; 0 skips)",
    )
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--note", help="a free-text note stored in the JSON (e.g. why fewer positions)")


def run(args: argparse.Namespace) -> int:
    from fastqwen.checkpoint import read_config

    model_type = read_config(args.model).get("model_type")
    if model_type in QWEN35_MODEL_TYPES and os.environ.get(_IN_REFERENCE_ENV) != "1":
        # Qwen3.5 loads with Transformers 5.17, which has its own environment (fastqwen/refenv.py):
        # the same command runs again there.
        import subprocess

        from fastqwen.refenv import reference_env

        env = dict(reference_env(model_type), **{_IN_REFERENCE_ENV: "1"})
        argv = [sys.executable, "-m", "fastqwen.cli", "synth-stats", "--model", str(args.model),
                "--positions", str(args.positions), "--device", str(args.device), "--seed", str(args.seed),
                "--stability-positions", str(args.stability_positions)]
        argv += ["--out", str(args.out)] if args.out else []
        argv += ["--note", str(args.note)] if args.note else []
        return subprocess.run(argv, env=env).returncode
    result = measure(
        args.model, positions=args.positions, device=args.device, seed=args.seed,
        stability_positions=args.stability_positions,
    )
    if args.note:
        result["note"] = args.note
    print(format_table(result))
    if args.out:
        write_report(result, args.out)
    return 0


def write_report(result: dict, path: str | pathlib.Path) -> None:
    """`result` as indented JSON at `path` (parent folders made), and a line on stderr saying so."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
