"""The harness's shared runner: what every entry's result carries and how GPU work is timed.

- `header(argv)`: the GPU (name, SM count, memory, L2), torch / Triton / CUDA versions, the
  commit, the date and time in UTC and the command line. "device" is "cuda" where a GPU is
  visible, else "cpu": then every time is wall-clock and means nothing; the code paths are real.
- `time_graph(fn, inputs)`: median microseconds a call of fn(x), from one CUDA graph of fn(x) for
  every x in inputs, each replay timed by CUDA events. The decode step runs as a graph, so a
  kernel's host launch cost must not count; rotating over several copies of a weight (`copies`)
  keeps L2 from holding the one being read, as in a step that reads every layer's copy once.
- `time_eager(fn)`: median microseconds of fn() as launched, CUDA events around each call.
- `Report`: the rows of one run, a table line on stdout per row as it comes, and with `--out` one
  JSON file, {"header", "entry", "args", "rows"}, rewritten after every row so that a run stopped
  by a time limit still leaves what it measured.
- `build_engine(path, options)`: the engine through its public constructor, imported as the judge
  imports it; `resolve_model(spec)`: a checkpoint folder, or a preset synthesized once into a cache.

Entry modules import torch inside their functions only, so `python -m bench --list` and argument
errors stay fast.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE_DIR = REPO / "engine"
# The L2 is assumed this large where the device does not report it (the H100's; the H200's is 60 MB).
DEFAULT_L2_BYTES = 50 * 2**20
# Copies of an operand rotated through so that one graph replay reads this many L2s' worth.
L2_MULTIPLE = 4


class BenchError(Exception):
    """A run that cannot go on (bad model, an engine without an asked-for option): one line to the user."""


# ---------------------------------------------------------------- header

def commit() -> tuple[str | None, bool | None]:
    """(HEAD, whether tracked files differ from it). FASTQWEN_COMMIT first where it is set (the GPU
    machine's script stamps the carried tree with it: a copy there may hold a stale .git of its
    own); else git; else the `.commit` file at the repository root. The difference is unknown
    (None) but from git."""
    if os.environ.get("FASTQWEN_COMMIT"):
        return os.environ["FASTQWEN_COMMIT"], None
    if (REPO / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10)
            status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=30)
            if head.returncode == 0 and head.stdout.strip():
                return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            pass
    stamp = REPO / ".commit"
    if stamp.is_file() and stamp.read_text().strip():
        return stamp.read_text().strip(), None
    return None, None


def gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def l2_bytes() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def header(argv: list[str]) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    head, dirty = commit()
    out = {"device": "cpu", "gpu": None, "sm_count": None, "memory_bytes": None, "l2_bytes": None,
           "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
           "python": platform.python_version(), "commit": head, "commit_dirty": dirty,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": shlex.join(["python", "-m", "bench", *argv])}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device="cuda", gpu=props.name, sm_count=props.multi_processor_count,
                   memory_bytes=props.total_memory, l2_bytes=l2_bytes())
    return out


def header_line(h: dict) -> str:
    where = (f"{h['gpu']} ({h['sm_count']} SMs, {h['memory_bytes'] / 2**30:.0f} GiB)" if h["device"] == "cuda"
             else "CPU (no GPU: wall-clock times, not measurements)")
    commit_text = (h["commit"] or "unknown")[:12] + ("+changes" if h["commit_dirty"] else "")
    return (f"# {where}; torch {h['torch']}, triton {h['triton']}, CUDA {h['cuda']}; commit {commit_text}; "
            f"{h['date']}")


# ---------------------------------------------------------------- timing

def copies(nbytes: int, limit: int = 64) -> int:
    """How many copies of an operand of nbytes to rotate through so that one pass over them reads
    L2_MULTIPLE times the L2 (at least 1, at most limit). Without a GPU: 2, so that the rotation
    itself runs."""
    if not gpu_visible():
        return min(2, limit)
    return max(1, min(limit, math.ceil(L2_MULTIPLE * l2_bytes() / max(1, nbytes))))


def time_graph(fn, inputs: list, reps: int = 15) -> float:
    """Median microseconds a call of fn(x) over `reps` replays of one CUDA graph that calls fn(x)
    for every x in inputs in order (a replay's time over len(inputs)). fn runs twice first on a
    side stream (compiles, picks kernels, allocates workspaces: nothing may do so in a capture).
    Without a GPU: the same calls eagerly, wall-clock."""
    import torch

    if not inputs:
        raise ValueError("time_graph needs at least one input")
    if not torch.cuda.is_available():
        fn(inputs[0])
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for x in inputs:
                fn(x)
            samples.append((time.perf_counter() - t0) * 1e6 / len(inputs))
        return statistics.median(samples)
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for x in inputs[:2]:
            fn(x)
    current.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in inputs:
            fn(x)
    graph.replay()           # the first replay uploads the graph
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 / len(inputs) for s, e in zip(starts, ends)]
    del graph
    return statistics.median(samples)


def time_eager(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median microseconds of fn() as launched (host launch costs included), CUDA events around
    each call on the current stream; without a GPU, wall-clock."""
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def digest(values) -> str:
    """A short hash of a JSON-able value (e.g. greedy tokens), to compare two runs' rows."""
    return hashlib.sha1(json.dumps(values).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- the report

class Column:
    """One column of the stdout table: a row's key, its title, a width, a format for floats, and
    whether it is text (left-aligned)."""

    def __init__(self, key: str, title: str | None = None, width: int = 10, fmt: str = "{:.2f}",
                 left: bool = False):
        self.key, self.title, self.fmt, self.left = key, title or key, fmt, left
        self.width = max(width, len(self.title))

    def align(self, text: str) -> str:
        text = text[: self.width]
        return text.ljust(self.width) if self.left else text.rjust(self.width)

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None:
            text = "-"
        elif isinstance(value, bool):
            text = "yes" if value else "no"
        elif isinstance(value, float):
            text = self.fmt.format(value)
        else:
            text = str(value)
        return self.align(text)


class Report:
    """The rows of one run (see the module note)."""

    def __init__(self, entry: str, args: argparse.Namespace, argv: list[str], columns: list[Column],
                 out: Path | None, quiet: bool = False):
        self.entry, self.columns, self.out, self.quiet = entry, columns, out, quiet
        self.args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if not k.startswith("_") and k not in ("out", "list", "entry")}
        self.header = header(argv)
        self.rows: list[dict] = []
        self._titled = False
        self.print(header_line(self.header))

    def print(self, text: str = "") -> None:
        if not self.quiet:
            print(text, flush=True)

    def add(self, row: dict, show: bool = True) -> dict:
        """Keep a row (JSON-able values), print it as a table line, and rewrite --out."""
        self.rows.append(row)
        if show:
            if not self._titled:
                self.print(" ".join(c.align(c.title) for c in self.columns))
                self._titled = True
            self.print(" ".join(c.cell(row) for c in self.columns))
        self.save()
        return row

    def note(self, text: str) -> None:
        """A line on stdout only (summaries, what was skipped and why)."""
        self.print(text)

    def document(self) -> dict:
        return {"header": self.header, "entry": self.entry, "args": self.args, "rows": self.rows}

    def save(self) -> None:
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.document(), indent=1, default=str) + "\n")
        tmp.replace(self.out)


# ---------------------------------------------------------------- arguments

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16]: positive integers, comma-separated."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(p) for p in parts]


def shape_list(dims: int, names: str):
    """An argparse type: "1x512x8,2x64x4" -> [(1, 512, 8), (2, 64, 4)], each `dims` positive
    integers joined by x (`names` says what they are, for the error)."""
    def parse(text: str) -> list[tuple[int, ...]]:
        shapes = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            fields = part.split("x")
            try:
                values = tuple(int(f) for f in fields)
            except ValueError:
                values = ()
            if len(values) != dims or min(values) < 1:
                raise argparse.ArgumentTypeError(f"{part!r} is not {names} (positive integers joined by x)")
            shapes.append(values)
        if not shapes:
            raise argparse.ArgumentTypeError(f"expected comma-separated {names}, got {text!r}")
        return shapes

    return parse


def on_off(text: str) -> bool:
    if text in ("on", "off"):
        return text == "on"
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _presets() -> list[str]:
    from fastqwen import synth35
    from fastqwen.presets import PRESETS

    return list(PRESETS) + list(synth35.PRESETS)


def model_spec(text: str) -> str:
    """An argparse type: a checkpoint folder (holding config.json) or a preset's name."""
    if (Path(text) / "config.json").is_file():
        return str(Path(text).resolve())
    if text in _presets():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a checkpoint folder (with config.json) nor a preset "
                                     f"({', '.join(_presets())})")


def add_model_argument(parser: argparse.ArgumentParser, default: str = "qwen3-4b") -> None:
    parser.add_argument("--model", type=model_spec, default=default,
                        help=f"checkpoint folder, or a preset synthesized once into the cache (default {default})")


ENGINE_OPTIONS = ("backend", "graphs", "pdl", "exact_decode", "speculative_token_map")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options", "passed to Engine(); an option left out takes the "
                                      "engine's default")
    group.add_argument("--backend", choices=("auto", "torch", "triton"), default=None)
    group.add_argument("--graphs", type=on_off, default=None, metavar="on|off", help="the CUDA-graph decode step")
    group.add_argument("--pdl", type=on_off, default=None, metavar="on|off", help="dependent launches")
    group.add_argument("--exact-decode", type=on_off, default=None, metavar="on|off",
                       help="the decode step in the full forward's arithmetic")
    group.add_argument("--speculative-token-map", default=None, metavar="PATH",
                       help="the MTP head's draft vocabulary (.pt or .json token ids: fastqwen token-map)")


def engine_options(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name, None) is not None}


def engine_argv(options: dict) -> list[str]:
    """The command-line form of engine options (for a child process)."""
    out = []
    for name, value in options.items():
        out += [f"--{name.replace('_', '-')}", ("on" if value else "off") if isinstance(value, bool) else str(value)]
    return out


# ---------------------------------------------------------------- engine and checkpoints

def use_engine_dir(folder: Path) -> None:
    """Measure the engine in `folder` (say an earlier commit's engine/) in place of the repository's."""
    global ENGINE_DIR
    if not (Path(folder) / "engine.py").is_file():
        raise BenchError(f"{str(folder)!r} holds no engine.py")
    ENGINE_DIR = Path(folder).resolve()


def engine_on_path() -> None:
    """The engine folder first on sys.path, so that its modules (fqkernels, fq_decode) import as
    the engine imports them."""
    folder = str(ENGINE_DIR)
    sys.path[:] = [folder] + [p for p in sys.path if p != folder]


def import_engine():
    """The engine module as the judge imports it: the engine folder first on sys.path, `import engine`."""
    engine_on_path()
    loaded = sys.modules.get("engine")
    if loaded is not None and not hasattr(loaded, "Engine"):   # the repository's engine/ folder as a namespace
        del sys.modules["engine"]
    import engine

    return engine


def check_engine_options(options: dict):
    """The engine module, once its Engine's constructor is known to take every option. An option
    it does not take is an error, never dropped: an A/B arm must be what it says."""
    engine = import_engine()
    params = inspect.signature(engine.Engine).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = [name for name in options if name not in params]
        if unknown:
            raise BenchError(f"this engine's Engine{inspect.signature(engine.Engine)} takes no "
                             f"{', '.join(unknown)}")
    return engine


def build_engine(model_path, options: dict | None = None):
    """Engine(model_path, **options) through the public constructor (check_engine_options)."""
    options = dict(options or {})
    return check_engine_options(options).Engine(str(model_path), **options)


def resolve_model(spec: str) -> Path:
    """A checkpoint folder as given, or the preset's checkpoint (seed 0), synthesized on first use
    into the cache (fastqwen.judge.cli.cache_root) on the GPU where there is one (quick for a 4B,
    other values than the CPU's for the same seed: the folder's name says which)."""
    path = Path(spec)
    if (path / "config.json").is_file():
        return path
    if spec not in _presets():
        raise BenchError(f"{spec!r} is neither a checkpoint folder nor a preset")
    from fastqwen import synth, synth35
    from fastqwen.judge.cli import cache_root

    device = "cuda" if gpu_visible() else "cpu"
    target = cache_root() / "checkpoints" / f"{spec}-seed0-{device}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"bench: synthesizing {spec} into {target}", file=sys.stderr, flush=True)
    # Written beside the target and renamed: an interrupted write never passes for a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    if spec in synth35.PRESETS:
        synth35.synthesize(spec, staging, seed=0, device=device, force=True, progress=False)
    else:
        synth.synthesize(spec, staging, seed=0, device=device, force=True, progress=False)
    try:
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    return target


def lm_head(model):
    """The LM head [vocab, hidden] of either family's model."""
    w = model.w
    return w["lm_head.weight"] if isinstance(w, dict) else w.lm_head


def weight_bytes(model) -> int:
    """Bytes of the model's weights (a tied LM head counted once)."""
    import torch

    seen, total = set(), 0

    def walk(obj):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape))
            if key not in seen:
                seen.add(key)
                total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v)

    walk(model.w)
    return total
