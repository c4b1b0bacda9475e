"""`fastqwen judge`: arguments, every input check before anything is launched, then the run.

With no arguments it judges the repository's `engine/` on the `tiny` synthetic checkpoint
(synthesized once into a cache folder) with the embedded CPU workloads: a full platform-style run
in well under two minutes on a small CPU machine.
"""
from __future__ import annotations

import argparse
import ast
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from fastqwen.errors import UserError

if TYPE_CHECKING:
    from fastqwen.judge.runner import JudgeSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ENGINE_DIR = REPO_ROOT / "engine"
DEFAULT_PRESET = "tiny"
DEFAULT_SYNTH_SEED = 0
OFFICIAL_SAMPLES = 5
PUBLIC_SAMPLES = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", type=Path, default=None,
                        help=f"engine folder holding engine.py (default: the repository's {DEFAULT_ENGINE_DIR.name}/)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help="a second engine folder (say an earlier commit's engine/) timed and replayed as a "
                             "third side in the same run, on the same prompts; never gated, reported with the "
                             "engine/baseline ratios")
    parser.add_argument("--model", type=Path, default=None,
                        help="Qwen3 model folder (default: the 'tiny' synthetic checkpoint, created once in a cache)")
    parser.add_argument("--workloads", default="default",
                        help="'default' (small CPU shapes), 'public' (the platform's three) or a JSON file")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--official", dest="official", action="store_true",
                      help=f"{OFFICIAL_SAMPLES} samples, latency and spread gates applied")
    mode.add_argument("--public", dest="official", action="store_false",
                      help=f"{PUBLIC_SAMPLES} sample, no latency or spread gate (the default)")
    parser.set_defaults(official=False)
    parser.add_argument("--samples", type=int, default=None, help="samples per workload (overrides the mode's count)")
    parser.add_argument("--out", type=Path, default=Path("judge_report.json"), help="JSON report (default: %(default)s)")
    parser.add_argument("--chart", type=Path, default=None, help="PNG chart (default: next to the JSON report)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where engines run: cuda when available by default")
    parser.add_argument("--load-timeout", type=float, default=300.0, metavar="S",
                        help="load + warmup budget per engine process (default: %(default)g s)")
    parser.add_argument("--sample-timeout", type=float, default=300.0, metavar="S",
                        help="limit per sample (default: %(default)g s)")
    parser.add_argument("--memory-limit-gib", type=float, default=None, metavar="X",
                        help="memory gate limit (default: 90%% of the GPU; none on the CPU)")
    parser.add_argument("--no-native", action="store_true", help="skip the native baseline (no ratios, no latency gate)")
    parser.add_argument("--seed", type=int, default=None, help="prompt seed (default: a fresh one, recorded in the report)")


# ------------------------------------------------------------------------------------------------
# input checks: all before any process is launched
# ------------------------------------------------------------------------------------------------
def _defines_engine(tree: ast.Module) -> bool:
    """A top-level `class Engine`, or a top-level name Engine bound by assignment or import."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Engine":
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "Engine" for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name) == "Engine" for alias in node.names):
                return True
    return False


def check_engine_dir(path: Path, role: str = "engine") -> Path:
    """The engine folder, resolved; UserError unless it holds an engine.py defining Engine.

    `role` names the folder in the errors ("engine", "--baseline"), so a bad baseline is not
    mistaken for a bad engine.
    """
    if not path.exists():
        raise UserError(f"{role} folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise UserError(f"{role} path {str(path)!r} is not a folder")
    engine_py = path / "engine.py"
    if not engine_py.is_file():
        raise UserError(f"{role} folder {str(path)!r} has no engine.py")
    try:
        tree = ast.parse(engine_py.read_bytes(), filename=str(engine_py))
    except SyntaxError as exc:
        raise UserError(f"{str(engine_py)!r} does not parse: {exc.msg} at line {exc.lineno}") from None
    if not _defines_engine(tree):
        raise UserError(f"{str(engine_py)!r} defines no top-level class Engine")
    return path.resolve()


def cache_root() -> Path:
    explicit = os.environ.get("FASTQWEN_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fastqwen"


def default_model(progress: bool = True) -> Path:
    """The tiny synthetic checkpoint, synthesized on first use into the cache (keyed by preset and seed)."""
    from fastqwen.synth import synthesize

    target = cache_root() / "checkpoints" / f"{DEFAULT_PRESET}-seed{DEFAULT_SYNTH_SEED}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"judge: synthesizing the {DEFAULT_PRESET} checkpoint into {target}", file=sys.stderr)
    # Write beside the target and rename, so a run interrupted mid-write never leaves a half
    # checkpoint that later runs would take for a finished one.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    synthesize(DEFAULT_PRESET, staging, seed=DEFAULT_SYNTH_SEED, device="cpu", progress=False, force=True)
    try:
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent run's finished copy: a real problem
            raise
    return target


def build_settings(args: argparse.Namespace) -> "JudgeSettings":
    """Check every input and return the runner's settings; raises UserError on the first bad one."""
    from fastqwen.checkpoint import read_config
    from fastqwen.judge.runner import JudgeSettings
    from fastqwen.judge.workloads import load_workloads

    engine_dir = check_engine_dir(args.engine if args.engine is not None else DEFAULT_ENGINE_DIR)
    baseline_dir = check_engine_dir(args.baseline, "--baseline") if args.baseline is not None else None
    if args.samples is not None and args.samples < 1:
        raise UserError(f"--samples must be >= 1, got {args.samples}")
    for flag, value in (("--load-timeout", args.load_timeout), ("--sample-timeout", args.sample_timeout)):
        if not value > 0:
            raise UserError(f"{flag} must be > 0 seconds, got {value:g}")
    if args.memory_limit_gib is not None and not args.memory_limit_gib > 0:
        raise UserError(f"--memory-limit-gib must be > 0, got {args.memory_limit_gib:g}")
    if args.seed is not None and args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    if args.model is not None:
        model_dir = args.model
        config = read_config(model_dir)
    else:
        model_dir = default_model()
        config = read_config(model_dir)
    workloads = load_workloads(args.workloads, config.get("max_position_embeddings"))
    samples = args.samples if args.samples is not None else (OFFICIAL_SAMPLES if args.official else PUBLIC_SAMPLES)
    out = args.out
    return JudgeSettings(
        engine_dir=engine_dir,
        model_dir=Path(model_dir).resolve(),
        model_config=config,
        workloads=workloads,
        official=args.official,
        samples=samples,
        device=args.device,
        load_timeout_s=args.load_timeout,
        sample_timeout_s=args.sample_timeout,
        memory_limit_gib=args.memory_limit_gib,
        native=not args.no_native,
        baseline_dir=baseline_dir,
        seed=args.seed if args.seed is not None else random.SystemRandom().randrange(2**31),
        log_dir=out.parent / f"{out.stem}_logs",
    )


def run(args: argparse.Namespace) -> int:
    from fastqwen.judge.chart import write_chart
    from fastqwen.judge.report import format_table, write_json
    from fastqwen.judge.runner import run_judge

    settings = build_settings(args)
    report = run_judge(settings)
    write_json(report, args.out)
    print(format_table(report))
    chart = args.chart if args.chart is not None else args.out.with_suffix(".png")
    if write_chart(report, chart):
        print(f"report: {args.out}  chart: {chart}  engine logs: {report['log_dir']}")
    else:
        print(f"report: {args.out}  chart skipped (matplotlib is not importable)  engine logs: {report['log_dir']}")
    return 0 if report["passed"] else 1
