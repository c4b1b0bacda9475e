"""Programmatic dependent launch (PDL) for the decode step's kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the
stream is still draining; it must not touch anything that kernel writes before
`wait` (griddepcontrol.wait returns once every prerequisite grid has completed
and its memory is visible). Every kernel here calls `wait` before its first
load of an input another kernel produces, so results are the same bits with or
without PDL. What may come before the wait: index arithmetic, and an L2
prefetch of weights (constant during decode), so a product's first weight
bytes are in flight while the previous kernel finishes. `launch_dependents`
lets the next kernel be scheduled: the GEMVs and the attention call it after
their main loop (earlier, its programs would occupy SMs the running kernel still
needs), the small kernels right after their wait.

Launching with PDL needs Triton's `launch_pdl` launch option (Triton 3.4+; our
GPU's 3.6) and an sm_90+ GPU. Where it is missing (the platform's Triton 3.1, the
CPU interpreter) the kernels compile without the instructions and launch as
before: same results, no overlap. FASTQWEN_NO_PDL=1 or the engine's pdl=False turns it off
(set_enabled).

Early reads (EARLY, on; a module setting, False turns them off): the attention's decode kernels
read the step's positions and lengths before the wait (and the RoPE tables' rows at them, and
ask L2 for the cached K/V lines a program will read), so their loads no longer wait for the
previous kernel. Valid because no kernel of a decode step writes positions or lengths: they are
advanced between steps by a kernel launched without PDL (DecodeRunner's add, LogitsStep's) or
copied in from the host, and such a kernel lets its dependents start only once it has completed.
The K/V lines are only prefetched (no data comes back before the wait), so the new position's
row, which the kernel just before writes, is read after it as always. Same bits either way
(the GPU tests). They shorten a graphed decode step at one row and lengthen it at 4 and 16 rows
(the K/V tiles asked of L2 by every program at once, beside the previous product's tail;
docs/PERFORMANCE.md), so they run at up to EARLY_MAX_ROWS rows (1).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["ENABLED", "LAUNCH", "MAX_ROWS", "EARLY", "EARLY_MAX_ROWS", "for_rows", "early", "wait", "launch_dependents",
           "start", "prefetch_l2", "prefetch"]


def available() -> bool:
    """Whether this Triton and GPU can launch with PDL (Triton 3.4+, sm_90+, not the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


# FASTQWEN_NO_PDL=1 (the engine's pdl=False sets the same through set_enabled) launches plainly.
ENABLED: bool = os.environ.get("FASTQWEN_NO_PDL") != "1" and available()
# Launch keyword arguments for a kernel compiled with PDL=ENABLED.
LAUNCH: dict = {"launch_pdl": True} if ENABLED else {}


def set_enabled(on: bool) -> bool:
    """Launch the decode kernels with PDL from now on (where available()) or not; returns the
    setting in effect. Process-wide: PDL is how kernels are launched, not a model's property; a
    CUDA graph captured before keeps the launches it captured."""
    global ENABLED, LAUNCH
    ENABLED = bool(on) and available()
    LAUNCH = {"launch_pdl": True} if ENABLED else {}
    return ENABLED
# Decode-sized launches only. In a prefill (thousands of rows) the kernel before a
# norm or RoPE launch is often a cuBLAS GEMM that signals its dependents early; our
# many-program grid then sat resident in its wait beside the GEMM's later waves, and
# TTFT rose with PDL there (docs/PERFORMANCE.md).
MAX_ROWS = 64


# The decode kernels' early reads (module note), at up to EARLY_MAX_ROWS sequences; read at each
# launch (an A/B may set EARLY between launches: a kernel is compiled for each setting).
EARLY: bool = True
EARLY_MAX_ROWS: int = 1


def early(flag: bool | None, rows: int) -> bool:
    """A launch's EARLY constexpr for a launch over `rows` sequences: `flag`, or where it is None the
    module's EARLY at up to EARLY_MAX_ROWS rows."""
    return EARLY and rows <= EARLY_MAX_ROWS if flag is None else bool(flag)


def for_rows(rows: int) -> tuple[bool, dict]:
    """(the PDL constexpr, the launch kwargs) for a launch over `rows` tokens."""
    if ENABLED and rows <= MAX_ROWS:
        return True, LAUNCH
    return False, {}


@triton.jit
def wait(ON: tl.constexpr):
    if ON:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents(ON: tl.constexpr):
    if ON:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def start(ON: tl.constexpr):
    """A small kernel's prologue: wait for the previous kernel, then let the next be scheduled.
    (The next first, before the wait, was measured slower in the Qwen3.5-4B decode step.)"""
    wait(ON)
    launch_dependents(ON)


@triton.jit
def prefetch_l2(ptrs, ON: tl.constexpr):
    """Ask L2 for the 128-byte line at each pointer of `ptrs` (any shape); no data returned."""
    if ON:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def prefetch(ptrs, LEVEL: tl.constexpr):
    """Ask the cache LEVEL (1: this multiprocessor's L1, 2: L2; 0: nothing) for the 128-byte line at
    each pointer of `ptrs` (any shape); no data returned."""
    if LEVEL == 1:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if LEVEL == 2:
        prefetch_l2(ptrs, True)
