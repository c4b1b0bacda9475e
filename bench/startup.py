"""`fastqwen serve` from process start to its first /health 200, cold and warm.

Each start is a fresh process on a free port with its own TRITON_CACHE_DIR: "cold" an empty folder
(every kernel compiled, as on a machine that never ran fastqwen), then --warm-starts more starts
reusing the folder the cold start filled (Triton's on-disk cache, the only compile cache the engine
relies on; a machine keeps it in ~/.triton/cache between processes). On a GPU the server compiles
its start's kernels in parallel beside the weight load (fastqwen/serve/precompile.py; its line of
the log is the row's "precompile"); --no-precompile starts it without (each kernel compiled as it
is first launched). The row gives the time to ready as a client sees it and the server's own
figure from its "ready" line (model load, the precompile's wait, memory plan, warmup and graph
capture; the rest is Python start-up and imports), and the kernels the start compiled ("compiled":
seconds after its launch and name, one a cubin; the precompile's first, any after them the
server's own). With --image-build, one more start on a cache filled as an image build does it
(scripts/precompile.py with no GPU visible, --target sm_90): whether a GPU start finds that cache
and its stamp. With --profile, one more
start (warm cache) builds the server's state in a child process under cProfile: the functions that
take the start-up's time, by cumulative seconds.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.runner import REPO, BenchError, Column, add_model_argument, positive_int, resolve_model
from bench.serve import _env, _free_port, _server, _slots

COLUMNS = [Column("start", width=6, left=True), Column("ready_s", "ready s", fmt="{:.1f}"),
           Column("server_s", "server s", fmt="{:.1f}"), Column("slots", width=6),
           Column("kernels_compiled", "compiled", width=8),
           Column("error", width=30, left=True)]


def add_arguments(parser) -> None:
    add_model_argument(parser)
    parser.add_argument("--warm-starts", type=positive_int, default=1, help="starts after the cold one (default 1)")
    parser.add_argument("--max-batch", type=positive_int, default=16, help="the server's (default 16)")
    parser.add_argument("--max-model-len", type=positive_int, default=4096, help="the server's (default 4096)")
    parser.add_argument("--server-timeout-s", type=positive_int, default=300,
                        help="for the server to answer /health (default 300)")
    parser.add_argument("--profile", action="store_true", help="one more warm start under cProfile")
    parser.add_argument("--image-build", action="store_true",
                        help="one more start on a fresh cache that scripts/precompile.py filled with the GPU hidden "
                        "(--target sm_90, as an image build without a GPU does): the row 'image', its build_s apart")
    parser.add_argument("--launches", action="store_true",
                        help="one more warm start that logs each kernel's first launch in the server's process "
                        "(its name and Triton's specialization key): the row 'launches', to set beside the "
                        "precompile's capture")
    parser.add_argument("--no-precompile", action="store_true",
                        help="the server started with --no-precompile (each kernel compiled as it is first launched)")


def profile_child(model_dir: str, max_batch: int, max_model_len: int, out: str, top: int = 40) -> None:
    """In a fresh process: the server's state built under cProfile; the top functions by cumulative time."""
    import cProfile
    import pstats

    began = time.monotonic()
    from fastqwen.serve.app import Server
    imported = time.monotonic() - began
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.monotonic()
    Server(model_dir, max_batch, max_model_len)
    built = time.monotonic() - t0
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(((v[3], v[2], v[1], f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}") for k, v in stats.stats.items()),
                  reverse=True)[:top]
    Path(out).write_text(json.dumps({"import_s": imported, "server_s": built,
                                     "top": [{"cum_s": c, "tot_s": t, "calls": n, "fn": f} for c, t, n, f in rows]}))


def _start(model_dir: Path, args, cache: Path, log: Path, extra_env: dict | None = None) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "fastqwen.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-model-len", str(args.max_model_len)]
    if args.no_precompile:
        cmd.append("--no-precompile")
    env = _env()
    env["TRITON_CACHE_DIR"] = str(cache)
    env.update(extra_env or {})
    before = set(cache.rglob("*.cubin"))
    launched = time.time()
    with _server(cmd, env, f"http://127.0.0.1:{port}", log, args.server_timeout_s) as ready:
        pass
    text = log.read_text()
    found = re.search(r"loaded in ([0-9.]+) s", text)
    kernels = re.search(r"fastqwen serve: (kernels? precompile.*)", text)
    return {"ready_s": ready, "server_s": float(found.group(1)) if found else None, "slots": _slots(log),
            "cache_files": sum(1 for p in cache.rglob("*") if p.is_file()),
            "precompile": kernels.group(1).strip() if kernels else None,
            "compiled": (compiled := compiled_since(cache, before, launched)), "kernels_compiled": len(compiled)}


def compiled_since(cache: Path, before: set, launched: float) -> list:
    """The kernels this start compiled, [seconds after its launch, kernel name], in time order: one
    cubin each in Triton's cache. The precompile's come first; any after its last were the server's
    own (a launch the precompile's capture did not foresee)."""
    return sorted([round(p.stat().st_mtime - launched, 1), p.stem] for p in cache.rglob("*.cubin") if p not in before)


def _image_start(model_dir: Path, args, tmp: Path) -> dict:
    """A fresh cache filled as the README's image build does (no GPU visible), then a start on it."""
    cache = tmp / "image_triton"
    cache.mkdir()
    env = _env()
    env.update(TRITON_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(REPO / "scripts" / "precompile.py"), "--model", str(model_dir), "--max-batch",
           str(args.max_batch), "--max-model-len", str(args.max_model_len), "--target", "sm_90"]
    began = time.monotonic()
    built = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.server_timeout_s)
    row = {"start": "image", "model": str(model_dir), "build_s": round(time.monotonic() - began, 1),
           "build": [line for line in built.stdout.splitlines() if line.startswith(("captured", "compiled", "stamp"))]}
    if built.returncode != 0:
        return row | {"error": f"the image build exited {built.returncode}: {(built.stderr or built.stdout)[-1500:]}"}
    try:
        return row | _start(model_dir, args, cache, tmp / "server_image.log")
    except BenchError as exc:
        return row | {"error": str(exc)[-2000:]}


# A sitecustomize for the --launches start: Triton's launch hook (3.4+: knobs.runtime.jit_cache_hook;
# 3.1: JITFunction.cache_hook) appends each first launch's kernel and key to a file of its process.
LAUNCH_HOOK = """
import json, os
if os.environ.get("BENCH_LAUNCH_LOG"):
    import triton
    from triton.runtime.jit import JITFunction
    _log = open(os.environ["BENCH_LAUNCH_LOG"] + "." + str(os.getpid()), "a")
    def _hook(*, key, repr, fn, **_):
        _log.write(json.dumps([getattr(fn, "name", str(fn)), str(key)]) + "\\n")
        _log.flush()
        return False
    if hasattr(triton, "knobs"):
        triton.knobs.runtime.jit_cache_hook = _hook
    else:
        JITFunction.cache_hook = _hook
"""


def _launches_start(model_dir: Path, args, cache: Path, tmp: Path) -> dict:
    """A warm start with LAUNCH_HOOK: every kernel specialization the server's process launched."""
    hook = tmp / "launch_hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LAUNCH_HOOK)
    log = tmp / "launches"
    path = os.pathsep.join(p for p in (str(hook), _env().get("PYTHONPATH", "")) if p)   # the hook's first
    env = {"BENCH_LAUNCH_LOG": str(log), "PYTHONPATH": path}
    try:
        row = _start(model_dir, args, cache, tmp / "server_launches.log", extra_env=env)
    except BenchError as exc:
        return {"start": "launches", "error": str(exc)[-2000:]}
    seen = [json.loads(line) for path in sorted(tmp.glob("launches.*")) for line in path.read_text().splitlines()]
    return {"start": "launches", "model": str(model_dir), **row, "launches": len(seen), "launched": seen}


def run(args, report) -> None:
    from bench import runner

    if args.engine is not None and runner.ENGINE_DIR != (REPO / "engine").resolve():
        raise BenchError("the server runs the repository's engine/: --engine is not for this entry")
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        cache = Path(tmp) / "triton"
        cache.mkdir()
        for i in range(1 + args.warm_starts):
            start = "cold" if i == 0 else "warm"
            try:
                row = _start(model_dir, args, cache, Path(tmp) / f"server_{i}.log")
            except BenchError as exc:
                report.add({"start": start, "error": str(exc)[-2000:]})
                continue
            report.add({"start": start, "model": str(model_dir), **row})
        if args.image_build:
            report.add(_image_start(model_dir, args, Path(tmp)))
        if args.launches:
            report.add(_launches_start(model_dir, args, cache, Path(tmp)))
        if args.profile:
            out = Path(tmp) / "profile.json"
            env = _env()
            env["TRITON_CACHE_DIR"] = str(cache)
            code = (f"from bench.startup import profile_child; profile_child({str(model_dir)!r}, {args.max_batch}, "
                    f"{args.max_model_len}, {str(out)!r})")
            done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=args.server_timeout_s)
            if out.is_file():
                prof = json.loads(out.read_text())
                report.add({"start": "profile", "server_s": prof["server_s"], "import_s": prof["import_s"],
                            "top": prof["top"]})
                for r in prof["top"][:25]:
                    report.note(f"  {r['cum_s']:8.2f} {r['tot_s']:8.2f} {r['calls']:7d}  {r['fn']}")
            else:
                report.add({"start": "profile", "error": (done.stderr or done.stdout)[-2000:]})
