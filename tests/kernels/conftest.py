"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch


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
