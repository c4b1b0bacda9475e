"""`fastqwen token-map`: a draft vocabulary for Qwen3.5's multi-token-prediction head.

The head's cost is mostly its LM head (Qwen3.5-4B: 248,320 x 2,560, 1.27 GB read per draft). A
map of the N tokens a tokenizer emits most often over a corpus (frequency-ranked, as FR-Spec's
maps) lets the head read only those N rows: `Engine(..., speculative_token_map=PATH)`. Drafts
only: every emitted token is still the target's own pick; a draft the map lacks is a rejected
one. The output is a 1-D int64 tensor of sorted ids in a .pt file (SGLang's
`--speculative-token-map` format) or a .json list; the checkpoint's end-of-sequence ids are
always in it. The coverage printed (and written with --report) is the share of the corpus's
tokens, and of a held-out text's with --check, whose id is in the map: a bound on the drafts
the map can still make.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from fastqwen.errors import UserError

DEFAULT_SIZE = 32768
LINES_A_BATCH = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder (its tokenizer.json and config.json)")
    parser.add_argument("--corpus", required=True, nargs="+", help="text files whose tokens are counted")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE,
                        help=f"token ids in the map (default {DEFAULT_SIZE}; at most the vocabulary)")
    parser.add_argument("--out", required=True, help="the map: a .pt (1-D int64 tensor) or .json (list) file")
    parser.add_argument("--check", nargs="*", default=[], help="held-out text files: the map's coverage of them")
    parser.add_argument("--report", default=None, help="also write the counts and coverage as JSON here")


def _tokenizer(model: pathlib.Path):
    from tokenizers import Tokenizer
    path = model / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"--model {model}: no tokenizer.json there")
    return Tokenizer.from_file(str(path))


def _config(model: pathlib.Path) -> tuple[int, list[int]]:
    """(vocab size, end-of-sequence ids) from config.json and generation_config.json."""
    path = model / "config.json"
    if not path.is_file():
        raise UserError(f"--model {model}: no config.json there")
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)          # the wrapped (multimodal) layout keeps it there
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise UserError(f"--model {model}: config.json has no vocab_size")
    eos = []
    for source in (text, cfg, _json_or_empty(model / "generation_config.json")):
        value = source.get("eos_token_id")
        eos += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return vocab, sorted({e for e in eos if 0 <= e < vocab})


def _json_or_empty(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def count_tokens(tokenizer, files: list[str], vocab: int, progress=None):
    """Occurrences of each token id (numpy int64 [vocab]) over the files' text, encoded a batch of
    lines at a time without special tokens; ids past vocab are an error (a tokenizer that does
    not match the checkpoint)."""
    import numpy as np
    counts = np.zeros(vocab, dtype=np.int64)
    for name in files:
        path = pathlib.Path(name)
        if not path.is_file():
            raise UserError(f"no such text file: {name}")
        done, size = 0, max(path.stat().st_size, 1)
        with path.open(encoding="utf-8", errors="replace") as f:
            while True:
                lines = [line for _, line in zip(range(LINES_A_BATCH), f)]
                if not lines:
                    break
                for enc in tokenizer.encode_batch(lines, add_special_tokens=False):
                    ids = np.asarray(enc.ids, dtype=np.int64)
                    if ids.size and int(ids.max()) >= vocab:
                        raise UserError(f"{name}: the tokenizer gave id {int(ids.max())}, past the checkpoint's "
                                        f"vocabulary of {vocab}")
                    counts += np.bincount(ids, minlength=vocab)
                done += sum(len(line.encode("utf-8", errors="replace")) for line in lines)
                if progress is not None:
                    progress(name, min(done / size, 1.0))
    return counts


def select(counts, size: int, always: list[int] = ()) -> list[int]:
    """The map: the ids in `always`, then the most frequent others (ties: the lower id first) up
    to `size` ids in all; sorted."""
    import numpy as np
    vocab = counts.shape[0]
    if not 1 <= size <= vocab:
        raise UserError(f"--size {size}: must lie in 1..{vocab} (the vocabulary)")
    keep = sorted(set(always))[:size]
    order = np.lexsort((np.arange(vocab), -counts))       # by count, descending; then by id
    taken = set(keep)
    for i in order:
        if len(keep) >= size:
            break
        if int(i) not in taken:
            keep.append(int(i))
            taken.add(int(i))
    return sorted(keep)


def coverage(counts, ids: list[int]) -> float | None:
    """The share of counted tokens whose id is in ids (None: nothing counted)."""
    total = int(counts.sum())
    return None if total == 0 else float(counts[ids].sum()) / total


def write_map(ids: list[int], out: pathlib.Path) -> None:
    if out.suffix == ".json":
        out.write_text(json.dumps(ids) + "\n")
    elif out.suffix == ".pt":
        import torch
        torch.save(torch.tensor(ids, dtype=torch.int64), out)
    else:
        raise UserError(f"--out {out}: expected a .pt or .json file name")


def run(args: argparse.Namespace) -> int:
    model, out = pathlib.Path(args.model), pathlib.Path(args.out)
    if out.suffix not in (".pt", ".json"):
        raise UserError(f"--out {out}: expected a .pt or .json file name")
    vocab, eos = _config(model)
    tokenizer = _tokenizer(model)
    began, shown = time.perf_counter(), [0.0]

    def progress(name, share):
        now = time.perf_counter()
        if now - shown[0] >= 2.0 or share >= 1.0:
            shown[0] = now
            print(f"token-map: {name} {100 * share:5.1f}%", file=sys.stderr)

    counts = count_tokens(tokenizer, args.corpus, vocab, progress)
    ids = select(counts, args.size, eos)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_map(ids, out)
    report = {"model": str(model), "vocab_size": vocab, "size": len(ids), "corpus": list(args.corpus),
              "corpus_tokens": int(counts.sum()), "distinct_tokens": int((counts > 0).sum()),
              "always": eos, "coverage": coverage(counts, ids), "seconds": round(time.perf_counter() - began, 2)}
    if args.check:
        held = count_tokens(tokenizer, args.check, vocab, progress)
        report.update(check=list(args.check), check_tokens=int(held.sum()), check_coverage=coverage(held, ids))
    print(f"token-map: {len(ids)} ids -> {out}; the corpus's {report['corpus_tokens']} tokens "
          f"({report['distinct_tokens']} distinct): coverage "
          + ("n/a" if report["coverage"] is None else f"{100 * report['coverage']:.2f}%")
          + ("" if not args.check else "; held out: "
             + ("n/a" if report["check_coverage"] is None else f"{100 * report['check_coverage']:.2f}%")))
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    return 0
