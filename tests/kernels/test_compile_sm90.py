"""Every Triton kernel launch the engine makes compiles for sm_90 with the platform's
Triton 3.1, down to a cubin (ptxas runs), on this CPU-only machine.

The platform runs Triton 3.1 on an H100; our GPU runs 3.6, so a kernel that only
builds on newer Triton would pass every GPU test and fail on the platform. The
check is scripts/compile_kernels.py (its docstring says how it works): it runs the
engine's own model code on meta tensors that report device "cuda", records each
launch's specialization as Triton 3.1's JITFunction.run binds it, and compiles
every distinct one for sm_90 in a process pool. Here it runs in a subprocess (its
capture fills the kernels' workspace caches with meta tensors, which must not leak
into other tests), and the harness itself is shown to report a kernel that newer
Triton would accept, or that ptxas rejects, as a compile failure naming the kernel
and its specialization.

On another Triton (our GPU's 3.6) the tests skip: the capture mirrors 3.1's launch path.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from engine_modules import ENGINE_DIR, REPO

SCRIPT = REPO / "scripts" / "compile_kernels.py"
if str(SCRIPT.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPT.parent))

import compile_kernels as ck  # noqa: E402

_reason = ck.unsupported_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"sm_90 compile check skipped: {_reason}")

SM90 = ck.parse_target("sm_90")


def _run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--quiet", *args], capture_output=True, text=True,
                          timeout=900)


def test_every_engine_kernel_launch_compiles_for_sm90(tmp_path):
    proc = _run_script("--json", str(tmp_path / "report.json"))
    assert proc.returncode == 0, f"scripts/compile_kernels.py failed:\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}"
    report = json.loads((tmp_path / "report.json").read_text())
    specs = report["specs"]
    assert report["never_launched"] == [] and report["problems"] == []
    assert specs and all(s["ok"] and s["cubin_bytes"] > 0 for s in specs)
    assert {s["kernel"].split(".")[0] for s in specs} >= {"gemv", "decode_attention", "rmsnorm", "rope_kv", "swiglu",
                                                          "argmax"}
    # every model of the sweep contributed, and the launches are the engine's on Triton 3.1: no dependent launch
    assert {s["scenario"].split(": ")[0] for s in specs if not s["scenario"].startswith(ck.EXTRA)} == \
        set(ck.DEFAULT_MODELS)
    # and the launches outside that sweep: the Qwen3.5 decode step's kernels, the FA2 attention path
    assert any(s["kernel"] == "gdn_step._decode_step_kernel" for s in specs)
    assert any(s["kernel"] == "decode_attention._split_kernel" and s["constants"].get("D") == 256 for s in specs)
    assert any(s["kernel"] == "decode_attention._split_kernel" and s["constants"].get("FA2_PATH") for s in specs)
    assert not any(s["pdl"] or s["constants"].get("PDL") for s in specs)


# A helper every decode kernel calls, broken the way a newer-Triton-only construct breaks on 3.1.
_BROKEN_WAIT = """

@triton.jit
def wait(ON: tl.constexpr):   # appended by tests/kernels/test_compile_sm90.py
    x = tl.arange(0, 16)
    tl.gather(x, x, 0)        # Triton 3.2 and later
"""


def test_a_broken_engine_kernel_fails_the_check(tmp_path):
    """End to end: the script over a copy of engine/ whose pdl.wait uses tl.gather exits 1
    and names each kernel that calls it, with the specialization."""
    engine = tmp_path / "engine"
    shutil.copytree(ENGINE_DIR, engine, ignore=shutil.ignore_patterns("__pycache__"))
    with open(engine / "fqkernels" / "pdl.py", "a", encoding="utf-8") as f:
        f.write(_BROKEN_WAIT)
    proc = _run_script("--engine-dir", str(engine), "--models", "tiny", "--json", str(tmp_path / "report.json"))
    assert proc.returncode == 1, proc.stdout[-5000:] + proc.stderr[-5000:]
    specs = json.loads((tmp_path / "report.json").read_text())["specs"]
    failed = {s["kernel"] for s in specs if not s["ok"]}
    assert {"rmsnorm._rmsnorm_kernel", "decode_attention._split_kernel", "argmax._argmax_final_kernel"} <= failed
    assert all("gather" in s["error"] for s in specs if not s["ok"])
    assert "swiglu._silu_mul_kernel" not in failed     # it never calls pdl.wait
    assert "COMPILE FAILED for sm_90 with Triton 3.1" in proc.stdout
    assert "rmsnorm._rmsnorm_kernel (rmsnorm.py)" in proc.stdout and "constexprs: {" in proc.stdout


# ----------------------------------------------------------------------------- the harness itself

@triton.jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _gather_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, tl.gather(x, BLOCK - 1 - offs, 0))   # tl.gather: Triton 3.2 and later


@triton.jit
def _bad_ptx_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # Triton passes inline asm through untouched; only ptxas sees that no such instruction exists.
    v = tl.inline_asm_elementwise("no_such_instruction.b32 $0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out_ptr, v.to(tl.float32))


@triton.jit(do_not_specialize=["n"])
def _spec_probe_kernel(a_ptr, b_ptr, n, aligned, odd, one, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(b_ptr + offs, tl.load(a_ptr + offs) + n + aligned + odd + one)


def _capture(launch) -> list:
    """The specializations `launch()` makes, on meta tensors that report "cuda"."""
    recorder = ck.Recorder()
    recorder.scenario = "test"
    with ck.MetaAsCuda(), ck.recording(recorder, SM90):
        launch()
    return list(recorder.specs.values())


def _launch_1d(kernel, block=64):
    x = torch.empty(block, dtype=torch.float32, device="cuda")
    out = torch.empty(block, dtype=torch.float32, device="cuda")
    kernel[(1,)](x, out, block, BLOCK=block)


def test_capture_specializes_as_a_gpu_launch():
    """A view 2 bytes into its allocation is not 16-byte aligned, an int 1 becomes a
    constant, do_not_specialize is honoured: what Triton sees on a GPU."""
    def launch():
        a = torch.empty(64, dtype=torch.bfloat16, device="cuda")
        assert a.is_cuda and a.device.type == "cuda"
        _spec_probe_kernel[(1,)](a, a[1:], 32, 48, 7, 1, BLOCK=16)
        _spec_probe_kernel[(1,)](a[8:], a, 7, 48, 7, 1, BLOCK=16)   # 16 bytes in: aligned; n is not specialized

    specs = _capture(launch)
    assert len(specs) == 2 and specs[0].launches == 1
    first, second = specs

    def aligned(spec):   # the arguments Triton assumes 16-divisible (constexprs aside)
        return {n for i, n in enumerate(_spec_probe_kernel.arg_names) if i in spec.attrs.divisible_by_16} & set(
            spec.signature)

    assert aligned(first) == {"a_ptr", "aligned"}
    assert aligned(second) == {"a_ptr", "b_ptr", "aligned"}
    assert first.constants == {"one": 1, "BLOCK": 16}
    assert first.signature["a_ptr"] == "*bf16" and first.signature["n"] == "i32"
    assert first.site.startswith("test_compile_sm90.py:")


def test_norm_orders_are_measured_outside_the_meta_stand_in(monkeypatch):
    """On a machine with a GPU a start measures torch's norm order (rmsnorm.torch_order) on it: the
    capture must let it, not hand it meta tensors (torch.equal has no meta kernel). The stand-in
    for the measurement reports what its tensors would be."""
    from fqkernels import rmsnorm

    seen = []

    def measure(n, device):
        try:
            seen.append("meta" if torch.empty(1, device="cuda").is_meta else "cuda")
        except (AssertionError, RuntimeError):      # a real CUDA tensor, on a machine without one
            seen.append("cuda")

    monkeypatch.setattr(rmsnorm, "torch_order", measure)
    with ck.MetaAsCuda():
        rmsnorm.torch_order(128, ck.CUDA)
        with ck.norm_orders_measured():
            rmsnorm.torch_order(128, ck.CUDA)
        rmsnorm.torch_order(128, ck.CUDA)
    assert seen == ["meta", "cuda", "meta"]


def test_a_kernel_that_compiles_is_reported_with_its_cubin():
    specs = _capture(lambda: _launch_1d(_copy_kernel))
    ck.compile_all(specs, SM90, jobs=1)
    assert specs[0].ok and specs[0].cubin_bytes > 0 and specs[0].error == ""


def test_a_kernel_only_newer_triton_compiles_fails_naming_it():
    specs = _capture(lambda: _launch_1d(_gather_kernel))
    ck.compile_all(specs, SM90, jobs=1)
    spec = specs[0]
    assert spec.ok is False and "gather" in spec.error
    report = ck.failure_report(spec, SM90)
    assert "COMPILE FAILED for sm_90" in report and "_gather_kernel" in report
    assert "'BLOCK': 64" in report and "num_warps=4" in report      # the specialization


def test_a_kernel_ptxas_rejects_fails():
    """The compile goes down to ptxas: an instruction that only ptxas can refuse is caught."""
    specs = _capture(lambda: _launch_1d(_bad_ptx_kernel))
    ck.compile_all(specs, SM90, jobs=1)
    spec = specs[0]
    assert spec.ok is False and "no_such_instruction" in spec.error
    assert "_bad_ptx_kernel" in ck.failure_report(spec, SM90)


def test_a_kernel_no_scenario_launches_is_reported(monkeypatch):
    """A kernel in engine/fqkernels that nothing launches is reported; a device helper
    that kernels call (pdl.wait) is not."""
    from fqkernels import rmsnorm

    monkeypatch.setattr(rmsnorm, "_unlaunched_kernel", _copy_kernel, raising=False)
    monkeypatch.setattr(_copy_kernel, "__module__", "fqkernels.rmsnorm")
    missing = ck.never_launched([])
    assert "rmsnorm._copy_kernel" in missing and "pdl.wait" not in missing
