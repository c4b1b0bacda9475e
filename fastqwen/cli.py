"""`fastqwen` command line: one subcommand per tool, each owned by its module.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`,
and imports torch only inside the functions that need it, so building the
parser stays cheap and `fastqwen validate` never pays for importing torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from fastqwen.errors import UserError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("fastqwen.synth", "write a synthetic Qwen3 checkpoint with real shapes"),
    "synth-stats": ("fastqwen.logit_stats", "measure the logit-scale statistics of a checkpoint"),
    "token-map": ("fastqwen.token_map", "the MTP head's draft vocabulary: a checkpoint's most frequent tokens in a corpus"),
    "judge": ("fastqwen.judge.cli", "run an engine like the platform does, with native in the same run"),
    "validate": ("fastqwen.submission", "check a submission folder or archive against every archive rule"),
    "package": ("fastqwen.packaging", "build a reproducible submission archive from an engine folder"),
    "serve": ("fastqwen.serve.cli", "an OpenAI-compatible HTTP server on a checkpoint (continuous batching)"),
    "bench-serve": ("fastqwen.serve.bench", "load an OpenAI-compatible server: TTFT, TPOT, ITL, throughput"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastqwen", description="fastqwen: an exact Qwen3 engine and its tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        # Argument definitions live beside the code that uses them. Subcommand
        # modules keep torch out of their top-level imports, so this stays cheap.
        importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        print(f"fastqwen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fastqwen {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
