"""`python -m bench ENTRY [options] --out FILE.json`: one measurement harness over a registry of entries.

Each entry is a module of this package with `COLUMNS` (its stdout table), `add_arguments(parser)`
and `run(args, report)`; the shared runner (bench/runner.py) gives every result the same header
(GPU, versions, commit, UTC date, command line), the same timing routines and one JSON file a run.
`python -m bench --list` names the entries.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# name -> (module, one-line help)
ENTRIES: dict[str, tuple[str, str]] = {
    "gemv": ("bench.gemv", "the decode GEMV configs against cuBLAS per (rows, N, K) of both families' products"),
    "attention": ("bench.attention", "the decode-attention kernel against SDPA per batch and context"),
    "gdn": ("bench.gdn", "the GDN prompt pass's kernels per plan against the torch reference and fla"),
    "gdn-rows": ("bench.gdn_rows", "a verify's exact GDN rows: device time per phase of a row (GPU clocks)"),
    "lm-screen": ("bench.lm_screen", "the screened LM-head pick against GEMV + argmax: picks, candidates, time"),
    "spec": ("bench.spec", "speculative decoding against plain decode: the oracle's speed curve and the drafters"),
    "step": ("bench.step", "the graphed decode step per batch size on a checkpoint"),
    "prefill": ("bench.prefill", "per-kernel device time of a decode step and a prefill (torch.profiler)"),
    "memory": ("bench.memory", "peak memory per shape, each in a fresh process"),
    "serve": ("bench.serve", "the server under load at 1 / 4 / 16 streams (bench-serve) beside generate()"),
    "startup": ("bench.startup", "the server from process start to ready, with an empty and a filled compile cache"),
    "fidelity": ("bench.fidelity", "which op moves the logits: teacher-forced variants against native's full forward"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name the entries and exit")
    sub = parser.add_subparsers(dest="entry", metavar="ENTRY")
    for name, (module_name, help_text) in ENTRIES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                       help="write the run's JSON here ({header, entry, args, rows})")
        p.add_argument("--engine", type=Path, default=None, metavar="DIR",
                       help="the engine folder to measure (default: the repository's engine/)")
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from bench.runner import BenchError, Report, use_engine_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        width = max(map(len, ENTRIES))
        for name, (_, help_text) in ENTRIES.items():
            print(f"{name:{width}s}  {help_text}")
        return 0
    if args.entry is None:
        parser.print_usage(sys.stderr)
        print("python -m bench: error: name an entry (python -m bench --list)", file=sys.stderr)
        return 2
    module = importlib.import_module(ENTRIES[args.entry][0])
    report = Report(args.entry, args, argv, module.COLUMNS, args.out, quiet=getattr(args, "child", None) is not None)
    try:
        if args.engine is not None:
            use_engine_dir(args.engine)
        module.run(args, report)
    except BenchError as exc:
        print(f"python -m bench {args.entry}: error: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        report.save()
        report.note(f"wrote {args.out} ({len(report.rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
