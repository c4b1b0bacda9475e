"""scripts/precompile.py: a server start's kernel launches captured over meta tensors (no GPU) and
compiled into a Triton cache before the server starts. Here, on the tiny presets: the capture
covers every bucket's step and each verify width of speculation "auto", and the slots' warm
prompt passes, with no problem; the tiny Qwen3's specializations compile into the cache folder
asked for. Whether a GPU start then finds them (Triton's cache key at launch) is measured on the
GPU: `python -m bench startup` (the server runs it beside its weight load). Run in a subprocess, as the sm_90 check is (the
capture leaves meta tensors in the kernels' workspace caches)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_modules import REPO

SCRIPT = REPO / "scripts" / "precompile.py"

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the interpreter compiles nothing")


def _config(folder, family: str):
    from fastqwen import presets, synth35

    folder.mkdir()
    raw = presets.get_preset("tiny") if family == "qwen3" else synth35.get_preset("qwen3.5-tiny")
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, cwd=REPO)


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_the_capture_covers_every_bucket_every_verify_width_and_the_warm_passes(family, tmp_path):
    model = _config(tmp_path / "model", family)
    out = tmp_path / "capture.json"
    proc = _run("--model", str(model), "--max-batch", "4", "--max-model-len", "256", "--speculation", "auto",
                "--capture-only", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["problems"] == [] and report["specs"]
    # every bucket's step and verifies of 1-4 drafts ("auto" at k = 4), on the GEMV and on cuBLAS,
    # then the warm passes, each run without a problem
    want = [f"bucket {rows} {name} ({lib})" for lib in ("gemv", "cublas") for rows in (1, 2, 4)
            for name in ["step"] + [f"verify {w}" for w in (1, 2, 3, 4)]] + ["warm prompt passes"]
    assert report["scenarios"] == want
    # a specialization is named by the scenario that launched it first: bucket 1's step first,
    # then what the other buckets, the verifies and the warm passes add
    first = {s["scenario"] for s in report["specs"]}
    assert "bucket 1 step (gemv)" in first and "warm prompt passes" in first
    assert any(s.startswith("bucket 1 verify") for s in first)
    assert any(s.startswith(("bucket 2", "bucket 4")) for s in first)
    assert all(s["ok"] is None for s in report["specs"])          # nothing compiled


def test_the_tiny_qwen3s_start_compiles_into_the_cache_triton_itself_looks_in(tmp_path):
    """Compiled, then --check runs the capture again through Triton's own launch path (its key, its
    cache lookup, its compile on a miss): it adds no file, so every key the capture compiled is the
    one a launch computes."""
    model = _config(tmp_path / "model", "qwen3")
    cache = tmp_path / "cache"
    out = tmp_path / "compiled.json"
    proc = _run("--model", str(model), "--max-batch", "2", "--max-model-len", "256", "--cache-dir", str(cache),
                "--json", str(out), "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    specs = json.loads(out.read_text())["specs"]
    assert specs and all(s["ok"] for s in specs)
    assert sum(1 for p in cache.rglob("*.cubin")) == len(specs)      # one binary a specialization
    assert "check: Triton's own launch path added 0 cache file(s)" in proc.stdout
    # every kernel compiled: the stamp a server start of these settings on sm_90 looks for
    import triton

    from fastqwen.serve import precompile

    settings = precompile.settings(str(model), 2, 256, None, "off", 4)
    stamp = precompile.stamp_path(cache, str(model), settings, triton.__version__, 90)
    assert stamp.is_file() and f"stamp {stamp}" in proc.stdout
    assert json.loads(stamp.read_text())["specializations"] == len(specs)


def test_the_check_sees_a_launch_path_that_finds_nothing(tmp_path):
    """The same launch path over an empty cache compiles every specialization itself: files appear
    (so the check above can fail)."""
    model = _config(tmp_path / "model", "qwen3")
    cache = tmp_path / "empty"
    cache.mkdir()
    code = (f"import os, pathlib, sys; os.environ['TRITON_CACHE_DIR'] = {str(cache)!r}; "
            f"sys.path.insert(0, {str(SCRIPT.parent)!r}); import precompile as pc; "
            f"specs, problems, _ = pc.capture_server_start(pathlib.Path({str(model)!r}), 2, 256, None, 'off', 4, "
            f"pc.ck.parse_target('sm_90'), False, through=True); "
            f"print(len(specs), len(problems), sum(1 for p in pathlib.Path({str(cache)!r}).rglob('*.cubin')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    specs, problems, cubins = map(int, proc.stdout.split()[-3:])
    assert problems == 0 and specs > 0 and cubins == specs


def test_the_longest_kernels_compile_first():
    """A long compile started last would set the wall time alone: the order puts the longest kernel
    sources (the exact GDN step's, 10-18 s each) first, and keeps every spec."""
    sys.path.insert(0, str(SCRIPT.parent))
    import precompile as pc

    class Kernel:
        def __init__(self, n):
            self.src = "x" * n

    class Spec:
        def __init__(self, n):
            self.kernel = Kernel(n)

    specs = [Spec(n) for n in (10, 5000, 300, 20000, 1)]
    assert [len(s.kernel.src) for s in pc.longest_first(specs)] == [20000, 5000, 300, 10, 1]
