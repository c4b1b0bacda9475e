"""Measure a synthetic checkpoint with and without `--massive-activations`: the structure, the logits, the stability.

For one preset and init this synthesizes a checkpoint into a temporary folder
(or `--keep DIR`) and measures, with Transformers on the CPU in BF16:

- trigger rate: trigger tokens per 512 in the judge's synthetic prompt stream
  (`fastqwen.judge.prompts.synthetic_stream`, the stream the judge draws its
  prompts from on a synthetic checkpoint): over the whole stream and over
  random 512-token windows as the judge draws them; and in `synth-stats`'
  own text-like ids;
- structure (one 512-token window of that stream, eager attention, only for
  this measurement): per layer, the max |h| of the residual stream at trigger
  tokens and at the others, the attention mass that queries put on trigger
  positions (against the share of keys they are), the |v| of trigger tokens
  against the others;
- `fastqwen synth-stats` (`logit_stats.measure`, sdpa): logit statistics and
  native's cached decode against its own full forward (128-token prompts);
- the same stability check on the judge's own prompts: `--long-sequences`
  windows of `--long-prompt` tokens prefilled, then `--decode` ids decoded
  one per forward, each step against one full forward;
- at trigger positions against the others: the top-1/top-2 gap and top-1
  minus median (a trigger position's logits are flat, see MassivePlant), and
  how often a trigger token is the argmax.

    python scripts/synth_massive.py --preset qwen3-0.6b --massive --out results/synth_stats/qwen3-0.6b-massive.json

Without `--massive` the same figures (the trigger ids then come from the plant
the seed would make) give the baseline.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import sys
import tempfile
import time

import numpy as np
import torch

from fastqwen import logit_stats, synth
from fastqwen.judge.prompts import PromptSource, synthetic_stream
from fastqwen.presets import get_preset


def trigger_ids_for(config: dict, init: str, seed: int) -> list[int]:
    """The trigger ids the plant uses for this config and seed (also for a checkpoint without the plant)."""
    scheme = synth.build_scheme(config, init, massive_activations=True)
    return list(synth.massive_layout(scheme.massive, seed).trigger_ids)


def trigger_rates(vocab: int, triggers: set[int], windows: int = 256, seed: int = 0) -> dict:
    """Trigger tokens per 512 in the judge's stream (whole, and per judge-drawn 512-token window) and in text_like_ids."""
    stream = synthetic_stream(vocab)
    is_trigger = np.isin(np.array(stream), list(triggers))
    source = PromptSource(stream, seed=seed, kind="synthetic")
    counts = np.array([int(np.isin(w, list(triggers)).sum()) for w in source.draw(windows, 512)])
    text_like = np.array(sum(logit_stats.text_like_ids(vocab, [1024] * 8, seed=0), []))
    return {
        "judge_stream_per_512": float(is_trigger.mean() * 512),
        "judge_windows_512": {
            "windows": windows,
            "mean": float(counts.mean()),
            "p10": float(np.percentile(counts, 10)),
            "p50": float(np.percentile(counts, 50)),
            "p90": float(np.percentile(counts, 90)),
            "min": int(counts.min()),
            "max": int(counts.max()),
            "without_any": float((counts == 0).mean()),
        },
        "text_like_ids_per_512": float(np.isin(text_like, list(triggers)).mean() * 512),
    }


def structure(folder: pathlib.Path, ids: list[int], triggers: set[int]) -> dict:
    """Per-layer max |h| at trigger vs other tokens, attention mass on trigger positions, |v| of triggers vs others."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(folder), torch_dtype=torch.bfloat16, attn_implementation="eager").eval()
    values: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda mod, inp, out, i=i: values.__setitem__(i, out[0].float()))
        for i, layer in enumerate(model.model.layers)
    ]
    mask = torch.tensor([t in triggers for t in ids])
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
    for h in hooks:
        h.remove()
    first = int(mask.nonzero()[0]) if mask.any() else len(ids)
    n = len(ids)
    # Share of a causal query's keys that are trigger positions, averaged over queries after the first trigger.
    key_share = (mask.float().cumsum(0) / torch.arange(1, n + 1))[first:].mean().item() if mask.any() else 0.0
    layers = []
    # hidden_states[0] is the embedding output, [i] the input of layer i, [-1] after the final norm.
    for i, h in enumerate(out.hidden_states[:-1]):
        a = h[0].float().abs()
        trig = float(a[mask].max()) if mask.any() else float("nan")
        other = float(a[~mask].max())
        row = {"input_of_layer": i, "max_abs_h_trigger": trig, "max_abs_h_other": other,
               "ratio": trig / other if other > 0 else float("inf")}
        if i < len(out.attentions):
            att = out.attentions[i][0].float()  # [heads, query, key]
            mass = att[:, first:, :][:, :, mask].sum(-1) if mask.any() else torch.zeros(att.shape[0], 1)
            per_head = mass.mean(-1)
            v = values[i].norm(dim=-1)
            row.update(
                sink_mass_mean=float(per_head.mean()),
                sink_mass_per_head_min=float(per_head.min()),
                sink_mass_per_head_max=float(per_head.max()),
                v_norm_trigger_over_other=float(v[mask].mean() / v[~mask].mean()) if mask.any() else float("nan"),
            )
        layers.append(row)
    final = out.hidden_states[-1][0].float()
    return {
        "tokens": n,
        "trigger_positions": int(mask.sum()),
        "first_trigger_position": first,
        "trigger_key_share": key_share,
        "layers": layers,
        "final_normed_rms_trigger_over_other": float(final[mask].pow(2).mean().sqrt() / final[~mask].pow(2).mean().sqrt())
        if mask.any() else float("nan"),
    }


def judge_prompt_stability(model: torch.nn.Module, vocab: int, triggers: set[int], prompt: int, decode: int,
                           sequences: int, seed: int) -> dict:
    """Cached decode vs full forward on judge-drawn windows (prompt + decode ids), and logits at trigger positions."""
    stream = synthetic_stream(vocab)
    source = PromptSource(stream, seed=seed + 17, kind="synthetic")
    diffs, slacks, differs = [], [], 0
    gaps = {"trigger": [], "other": []}
    mm = {"trigger": [], "other": []}
    argmax_trigger = 0
    positions = 0
    with torch.inference_mode():
        for ids in source.draw(sequences, prompt + decode - 1):
            cached, full = logit_stats.cached_and_full_logits(model, ids, prompt)
            cmp = logit_stats.compare_cached_full(cached, full)
            diffs.append(cmp["max_abs_diff"].numpy())
            slacks.append(cmp["slack"].numpy())
            differs += int(cmp["argmax_differs"].sum())
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            st = logit_stats.position_statistics(logits)
            is_t = torch.tensor([t in triggers for t in ids])
            for key, sel in (("trigger", is_t), ("other", ~is_t)):
                gaps[key].append(st["top1_top2_gap"][sel].numpy())
                mm[key].append(st["max_minus_median"][sel].numpy())
            argmax_trigger += int(torch.isin(logits.argmax(-1), torch.tensor(sorted(triggers))).sum())
            positions += len(ids)
    d = np.concatenate(diffs)

    def q(parts: list[np.ndarray]) -> dict | None:
        v = np.concatenate(parts)
        return None if v.size == 0 else {"n": int(v.size), **logit_stats.summarize(v)}

    return {
        "cached_vs_full": {
            "sequences": sequences, "prompt_length": prompt, "positions": int(d.size),
            "max_abs_diff": {"max": float(d.max()), "p99": float(np.percentile(d, 99)), "mean": float(d.mean())},
            "argmax_differs": differs, "max_slack": float(np.concatenate(slacks).max()),
        },
        "gap_at_trigger_positions": q(gaps["trigger"]),
        "gap_at_other_positions": q(gaps["other"]),
        "max_minus_median_at_trigger_positions": q(mm["trigger"]),
        "max_minus_median_at_other_positions": q(mm["other"]),
        "argmax_is_trigger_fraction": argmax_trigger / positions,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True)
    p.add_argument("--init", choices=synth.INITS, default="fastqwen")
    p.add_argument("--massive", action="store_true", help="synthesize with --massive-activations")
    p.add_argument("--layers", type=int, help="override num_hidden_layers (a shallower copy of a big shape)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--positions", type=int, default=4096, help="synth-stats positions (0 skips synth-stats)")
    p.add_argument("--stability-positions", type=int, default=256)
    p.add_argument("--long-prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--long-sequences", type=int, default=4)
    p.add_argument("--keep", help="write the checkpoint here instead of a temporary folder")
    p.add_argument("--tmp", help="folder for the temporary checkpoint")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()

    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()
    torch.manual_seed(0)
    random.seed(0)
    config = get_preset(args.preset)
    if args.layers:
        config["num_hidden_layers"] = args.layers
        config["max_window_layers"] = args.layers
    vocab = int(config["vocab_size"])
    triggers = set(trigger_ids_for(config, args.init, args.seed))
    result: dict = {
        "preset": args.preset, "num_hidden_layers": config["num_hidden_layers"], "init": args.init,
        "massive_activations": args.massive, "seed": args.seed, "trigger_count": len(triggers),
        "device": "cpu", "dtype": "bfloat16", "torch_version": torch.__version__,
    }
    import transformers

    result["transformers_version"] = transformers.__version__
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = pathlib.Path(args.keep) if args.keep else pathlib.Path(tmp) / "m"
        start = time.monotonic()
        synth.synthesize(args.preset, folder, seed=args.seed, progress=False, config=config, init=args.init,
                         massive_activations=args.massive, force=True)
        seconds["synth"] = round(time.monotonic() - start, 1)
        prov = synth.read_provenance(folder)
        if prov and prov.get("massive_activations"):
            prov["massive_activations"].pop("trigger_ids")  # long; the count and the seed name them
        result["provenance"] = prov

        start = time.monotonic()
        result["trigger_rates"] = trigger_rates(vocab, triggers, seed=args.seed)
        window = PromptSource(synthetic_stream(vocab), seed=args.seed + 5, kind="synthetic").draw(1, 512)[0]
        result["structure"] = structure(folder, window, triggers)
        seconds["structure"] = round(time.monotonic() - start, 1)

        if args.positions:
            start = time.monotonic()
            r = logit_stats.measure(folder, positions=args.positions, seed=args.seed,
                                    stability_positions=args.stability_positions)
            keep = ("positions", "stats", "fraction_gap_below", "fraction_top1_is_input_token", "distinct_top1_fraction",
                    "most_common_top1_fraction", "all_logits_finite", "cached_vs_full", "realism_problems",
                    "stability_problems", "final_norm_weight_mean")
            result["synth_stats"] = {k: r[k] for k in keep}
            seconds["synth_stats"] = round(time.monotonic() - start, 1)

        if args.long_sequences:
            from transformers import Qwen3ForCausalLM

            start = time.monotonic()
            model = Qwen3ForCausalLM.from_pretrained(str(folder), torch_dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").eval()
            result["judge_prompts"] = judge_prompt_stability(model, vocab, triggers, args.long_prompt, args.decode,
                                                            args.long_sequences, args.seed)
            seconds["judge_prompts"] = round(time.monotonic() - start, 1)
    result["seconds"] = seconds
    print(summary(result))
    if args.out:
        logit_stats.write_report(result, args.out)
    return 0


def summary(r: dict) -> str:
    s = r["structure"]
    lines = [f"{r['preset']} x{r['num_hidden_layers']} init {r['init']} massive {r['massive_activations']} seed {r['seed']}"]
    tr = r["trigger_rates"]
    w = tr["judge_windows_512"]
    lines.append(
        f"triggers: {r['trigger_count']} ids; per 512: judge stream {tr['judge_stream_per_512']:.2f}, windows "
        f"p10/p50/p90 {w['p10']:.0f}/{w['p50']:.0f}/{w['p90']:.0f} (none in {w['without_any']:.1%}), "
        f"text-like {tr['text_like_ids_per_512']:.2f}"
    )
    lines.append(f"structure window: {s['trigger_positions']} trigger positions, key share {s['trigger_key_share']:.3f}")
    for row in s["layers"]:
        extra = ""
        if "sink_mass_mean" in row:
            extra = (f" sink mass {row['sink_mass_mean']:.3f} [{row['sink_mass_per_head_min']:.3f}, "
                     f"{row['sink_mass_per_head_max']:.3f}] |v| trig/other {row['v_norm_trigger_over_other']:.3f}")
        lines.append(f"  in {row['input_of_layer']:2d}: max|h| trig {row['max_abs_h_trigger']:9.2f} other "
                     f"{row['max_abs_h_other']:7.2f} ratio {row['ratio']:9.1f}{extra}")
    if "synth_stats" in r:
        ss = r["synth_stats"]
        g = ss["stats"]["top1_top2_gap"]
        c = ss["cached_vs_full"]
        lines.append(
            f"synth-stats: gap p10/p50/p90 {g['p10']:.3f}/{g['p50']:.3f}/{g['p90']:.3f}, max-median p50 "
            f"{ss['stats']['max_minus_median']['p50']:.1f}, distinct {ss['distinct_top1_fraction']:.2f}, common "
            f"{ss['most_common_top1_fraction']:.3f}; cached_vs_full max {c['max_abs_diff']['max']:.3f} mean "
            f"{c['max_abs_diff']['mean']:.3f} slack {c['max_slack']:.3f} flips {c['argmax_differs']}; "
            f"problems {ss['realism_problems'] + ss['stability_problems']}"
        )
    if "judge_prompts" in r:
        j = r["judge_prompts"]
        c = j["cached_vs_full"]
        gt, go = j["gap_at_trigger_positions"], j["gap_at_other_positions"]
        lines.append(
            f"judge prompts ({c['sequences']} x {c['prompt_length']} + decode): cached_vs_full max "
            f"{c['max_abs_diff']['max']:.3f} mean {c['max_abs_diff']['mean']:.3f} slack {c['max_slack']:.3f} "
            f"flips {c['argmax_differs']}; argmax is a trigger {j['argmax_is_trigger_fraction']:.4f}; gap p50 "
            f"trigger {gt['p50'] if gt else float('nan'):.3f} other {go['p50']:.3f}; max-median p50 trigger "
            f"{j['max_minus_median_at_trigger_positions']['p50'] if gt else float('nan'):.2f}"
        )
    lines.append(f"seconds {r['seconds']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
