"""Sweep the synthetic-checkpoint init scheme: logit realism and numerical stability per setting.

For each combination of the swept knobs (q/k norm scale, same-token head
correlation, vocabulary row-norm spread; see fastqwen.synth.InitScheme), this
synthesizes a checkpoint into a temporary folder, runs `fastqwen synth-stats`'s
`measure()` on it (logit statistics, collapse, cached decode vs full forward)
and a short greedy generation, and appends one JSON line per setting.

    python scripts/synth_sweep.py --preset qwen3-0.6b --qk 1.25 1.5 --kq 0.7 \
        --row-sigma 0 0.25 --out results/synth_sweep/qwen3-0.6b.jsonl

`--layers N` overrides the depth (e.g. the 4B width at full depth is what
shows chaos; a shallower copy is cheaper). `--previous` also measures the
previous scheme (`sharp_attention_init`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
import tempfile
import time

import torch

from fastqwen import logit_stats, synth
from fastqwen.presets import get_preset


def greedy_distinct(model_dir: pathlib.Path, vocab: int, steps: int, seed: int) -> int:
    """Distinct tokens among `steps` greedy tokens after a 128-token text-like prompt (native's loop)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    prompt = logit_stats.text_like_ids(vocab, [128], seed=seed + 7)[0]
    out_tokens = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(dim=-1)
            out_tokens.append(int(token))
            out = model(input_ids=token[:, None], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return len(set(out_tokens))


def run_one(config: dict, preset: str, label: str, scheme: synth.InitScheme, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        start = time.monotonic()
        folder = synth.synthesize(preset, pathlib.Path(tmp) / "m", seed=args.seed, progress=False, config=config, init=scheme)
        synth_s = time.monotonic() - start
        r = logit_stats.measure(folder, positions=args.positions, seed=args.seed, stability_positions=args.stability_positions)
        greedy = greedy_distinct(folder, int(config["vocab_size"]), args.greedy_steps, args.seed) if args.greedy_steps else None
    s = r["cached_vs_full"]
    return {
        "label": label,
        "preset": preset,
        "num_hidden_layers": config["num_hidden_layers"],
        "scheme": {k: v for k, v in scheme.__dict__.items() if k not in ("head_dim", "query_heads_per_kv_head", "output_head")},
        "seed": args.seed,
        "positions": r["positions"],
        "gap": {k: r["stats"]["top1_top2_gap"][k] for k in ("p10", "p50", "p90")},
        "max_minus_median_p50": r["stats"]["max_minus_median"]["p50"],
        "top1_is_input": r["fraction_top1_is_input_token"],
        "distinct_top1_fraction": r["distinct_top1_fraction"],
        "most_common_top1_fraction": r["most_common_top1_fraction"],
        "greedy_distinct": greedy,
        "greedy_steps": args.greedy_steps,
        "cached_vs_full": s,
        "realism_problems": r["realism_problems"],
        "stability_problems": r["stability_problems"],
        "seconds": {"synth": round(synth_s, 1), "forward": r["forward_s"], "stability": r["stability_s"]},
    }


def summary_line(row: dict) -> str:
    s = row["cached_vs_full"]["max_abs_diff"]
    g = row["gap"]
    return (
        f"{row['label']:60} diff max {s['max']:6.3f} mean {s['mean']:6.3f} flips {row['cached_vs_full']['argmax_differs']:3d} "
        f"slack {row['cached_vs_full']['max_slack']:5.3f} | gap {g['p10']:.3f}/{g['p50']:.3f}/{g['p90']:.3f} "
        f"mm {row['max_minus_median_p50']:5.1f} distinct {row['distinct_top1_fraction']:.2f} "
        f"common {row['most_common_top1_fraction']:.2f} greedy {row['greedy_distinct']}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True)
    p.add_argument("--layers", type=int, help="override num_hidden_layers")
    p.add_argument("--qk", type=float, nargs="+", default=[synth.QK_NORM_SCALE])
    p.add_argument("--kq", type=float, nargs="+", default=[synth.KEY_QUERY_CORRELATION])
    p.add_argument("--row-sigma", type=float, nargs="+", default=[synth.VOCAB_ROW_NORM_SIGMA])
    p.add_argument("--stem-layers", type=int, nargs="+", default=[synth.STEM_LAYERS])
    p.add_argument("--stem-qk", type=float, nargs="+", default=[synth.STEM_QK_NORM_SCALE])
    p.add_argument("--emb-ratio", type=float, nargs="+", default=[synth.EMBEDDING_STD_RATIO])
    p.add_argument(
        "--late-out", type=float, nargs="+", default=[None],
        help="output scale of the layers after the stem (default: synth.default_late_output_scale)",
    )
    p.add_argument("--previous", action="store_true", help="also measure sharp_attention_init (the previous scheme)")
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--stability-positions", type=int, default=128)
    p.add_argument("--greedy-steps", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", help="folder for the temporary checkpoints (default: the system's)")
    p.add_argument("--out", help="append one JSON line per setting here")
    args = p.parse_args()

    config = get_preset(args.preset)
    if args.layers:
        config["num_hidden_layers"] = args.layers
        config["max_window_layers"] = args.layers
    runs: list[tuple[str, synth.InitScheme]] = []
    if args.previous:
        runs.append(("previous scheme (sharp_attention_init)", synth.sharp_attention_init(config)))
    for qk, kq, sigma, n_stem, stem_qk, emb, late in itertools.product(
        args.qk, args.kq, args.row_sigma, args.stem_layers, args.stem_qk, args.emb_ratio, args.late_out
    ):
        scheme = synth.init_scheme(
            config, qk_norm_scale=qk, key_query_correlation=kq, vocab_row_norm_sigma=sigma,
            stem_layers=n_stem, stem_qk_norm_scale=stem_qk, embedding_std_ratio=emb, late_output_scale=late,
        )
        label = f"qk {qk} kq {kq} rows {sigma} stem {n_stem}x{stem_qk} emb {emb} late {scheme.late_output_scale:.3f}"
        runs.append((label, scheme))
    for label, scheme in runs:
        row = run_one(config, args.preset, label, scheme, args)
        print(summary_line(row), flush=True)
        if args.out:
            out = pathlib.Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
