"""The correctness check: every emitted sequence replayed teacher-forced through native Transformers.

Run as `python -m fastqwen.judge.replay --input SEQS.json --output RESULT.json [--device D]`, in a
fresh process after the engine process is dead. For each sequence: ONE full forward over prompt +
emitted tokens (`Qwen3ForCausalLM`, bf16, sdpa, TF32 off, inference mode), keeping only the
logits that predict the emitted tokens. At each emitted position, slack = max logit - logit of the
emitted token, both as float32 of the bf16 logits. A slack above 2.0 is a violation. The emitted
token agrees with the full forward where it is that forward's argmax (ties to the lowest index, as
the contract's greedy rule): a token can have slack 0 and still disagree, when it ties the maximum
at a higher index.

Input: {"model": DIR, "items": [{"side", "sample", "sequence", "prompt": [...], "emitted": [...]}]}.
Output: per side the slack distribution, the argmax agreement and every violation.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from fastqwen.judge.fidelity import NOISE_SLACK
from fastqwen.judge.gates import MARGIN_LOGITS

MAX_LISTED_VIOLATIONS = 200
# Bound the float32 logits of one forward (rows x kept positions x vocab x 4 bytes).
LOGIT_BUDGET_BYTES = {"cuda": 2 << 30, "cpu": 512 << 20}


def _percentile(values, q: float) -> float:
    """Nearest-rank percentile (torch.quantile refuses inputs over 16M elements)."""
    ordered = values.sort().values
    return float(ordered[min(ordered.numel() - 1, int(q * ordered.numel()))])


def score_positions(logits, emitted):
    """(slack, argmax) per position from the logits [rows, steps, vocab] that predict `emitted`
    [rows, steps]. Both are taken on the float32 of the logits, so bf16 logits compare exactly;
    torch.argmax returns the first maximal index, the contract's tie rule."""
    logits = logits.float()
    top = logits.max(dim=-1).values
    chosen = logits.gather(-1, emitted[..., None]).squeeze(-1)
    return top - chosen, logits.argmax(dim=-1)


def summarize_side(slacks: list, agrees: list, violations: list[dict], sequences: int) -> dict:
    """One side's replay figures from its per-sequence slack and agreement rows (1-D tensors)."""
    import torch

    flat = torch.cat(slacks)
    agree = int(torch.cat(agrees).sum())
    positions = int(flat.numel())
    return {
        "sequences": sequences,
        "positions": positions,
        "max_slack": float(flat.max()),
        "p999_slack": _percentile(flat, 0.999),
        "count_gt_0_75": int((flat > NOISE_SLACK).sum()),
        "count_gt_0": int((flat > 0).sum()),
        "argmax_agree": agree,
        "argmax_agree_fraction": agree / positions if positions else None,
        "violation_count": len(violations),
        "violations": sorted(violations, key=lambda v: -v["slack"])[:MAX_LISTED_VIOLATIONS],
    }


def replay(model_dir: str, items: list[dict], device: str, progress=None) -> dict:
    import torch

    from fastqwen.native_engine.engine import load_model
    from fastqwen.numerics import pin_reference_numerics

    pin_reference_numerics()  # the platform's: no TF32, flash attention (not cuDNN's)
    model = load_model(model_dir).to(device).eval()
    vocab = model.config.vocab_size

    slacks: dict[str, list] = {}
    agrees: dict[str, list] = {}
    violations: dict[str, list] = {}
    counts: dict[str, int] = {}
    # Group by total length so one forward holds sequences of one shape (no padding, no mask).
    groups: dict[tuple[int, int], list[dict]] = {}
    for item in items:
        groups.setdefault((len(item["prompt"]), len(item["emitted"])), []).append(item)
    done = 0
    for (prompt_len, out_len), group in groups.items():
        keep = out_len + 1  # logits at positions prompt-1 .. prompt+out-1; the last one predicts nothing
        rows = max(1, LOGIT_BUDGET_BYTES.get(device, 512 << 20) // (keep * vocab * 4 * 2))
        for start in range(0, len(group), rows):
            chunk = group[start:start + rows]
            ids = torch.tensor([it["prompt"] + it["emitted"] for it in chunk], dtype=torch.long, device=device)
            emitted = torch.tensor([it["emitted"] for it in chunk], dtype=torch.long, device=device)
            with torch.inference_mode():
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[:, :out_len, :]
                slack, argmax = score_positions(logits, emitted)
                agree = (argmax == emitted).cpu()
                slack, argmax = slack.cpu(), argmax.cpu()
            del logits
            for row, it in enumerate(chunk):
                side = it["side"]
                slacks.setdefault(side, []).append(slack[row])
                agrees.setdefault(side, []).append(agree[row])
                counts[side] = counts.get(side, 0) + 1
                bad = (slack[row] > MARGIN_LOGITS).nonzero().flatten().tolist()
                for step in bad:
                    violations.setdefault(side, []).append({
                        "sample": it["sample"],
                        "sequence": it["sequence"],
                        "step": step,
                        "position": prompt_len + step,
                        "slack": float(slack[row, step]),
                        "emitted": it["emitted"][step],
                        "argmax": int(argmax[row, step]),
                    })
            done += len(chunk)
            if progress is not None:
                progress(done, len(items))

    return {side: summarize_side(rows_, agrees[side], violations.get(side, []), counts[side])
            for side, rows_ in slacks.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    with open(args.input, encoding="utf-8") as f:
        request = json.load(f)
    start = time.perf_counter()
    result = replay(request["model"], request["items"], args.device)
    out = {"sides": result, "seconds": time.perf_counter() - start, "margin": MARGIN_LOGITS}
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
