"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch


@pytest.fixture
def spy_launches(monkeypatch: pytest.MonkeyPatch):
    """spy_launches(module, name): module.name, a Triton kernel, with each launch's grid
    (kernel[grid](...)) appended to the list returned, the launch then made as before; undone
    after the test."""
    def spy(module, name: str) -> list:
        real = getattr(module, name)
        calls: list = []
        monkeypatch.setattr(module, name, type("Spy", (), {
            "__getitem__": lambda self, grid: (calls.append(grid), real[grid])[1]})())
        return calls

    return spy


@pytest.fixture
def interpreter_bf16_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter casts fp32 -> bf16 by truncation; the GPU rounds to nearest
    even. Under TRITON_INTERPRET=1 the cast rounds as the GPU does; elsewhere nothing changes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


@pytest.fixture
def interpreter_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Triton 3.6's CPU interpreter compute what the GPU computes, for this test only.

    The interpreter stores bf16 as uint16 and
    - multiplies the raw bit patterns in tl.dot (triton-lang/triton#11584: bf16 dot is
      unsupported there); bf16 x bf16 products are exact in fp32, so converting the
      operands to fp32 first is what the tensor cores compute;
    - casts fp32 -> bf16 by truncation, where the GPU rounds to nearest even;
    - breaks on tensor-valued loop bounds with numpy >= 2.4 (triton-lang/triton#9171).
    The kernel code stays untouched; only the interpreter's arithmetic is corrected.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    def to_f32(handle):  # type: ignore[no-untyped-def]
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.int16))
        return interpreter.TensorHandle(bits.view(torch.bfloat16).float().numpy(), tl.float32)

    original_dot = interpreter.InterpreterBuilder.create_dot
    original_cast = interpreter.InterpreterBuilder.cast_impl
    original_patch_tensor = interpreter._patch_lang_tensor

    def create_dot(self, a, b, d, *args):  # type: ignore[no-untyped-def]
        return original_dot(self, to_f32(a), to_f32(b), d, *args)

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    def patch_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        original_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_tensor)
