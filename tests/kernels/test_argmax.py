"""The argmax kernels (fqkernels.argmax) against torch.argmax: the same index on every
row, ties to the lowest index, NaN rows, -inf rows, every part boundary.

Which tests run where:
  pinned stack, no GPU      the plan, argument errors, the sm_90 compile
  TRITON_INTERPRET=1        + the kernels on CPU tensors (an environment with Triton >= 3.4:
                              PYTHONPATH=. TRITON_INTERPRET=1 \\
                              python -m pytest tests/kernels/test_argmax.py)
  a CUDA device             + the kernels on the GPU, against CUDA's torch.argmax (marked gpu)
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import argmax as am  # noqa: E402

from .test_gemv import _aot_compile  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    DEV = torch.device("cpu")
elif torch.cuda.is_available():
    DEV = torch.device("cuda")
else:
    DEV = None
# The kernel tests carry the gpu mark so `pytest -m gpu` on the GPU machine picks them; under the
# interpreter they run on CPU tensors (no marker filter there).
_no_kernels = pytest.mark.skipif(DEV is None, reason="needs a CUDA device or TRITON_INTERPRET=1")


def needs_kernels(test):
    return pytest.mark.gpu(_no_kernels(test))
QWEN_VOCAB = 151936


def _check(x: torch.Tensor) -> None:
    out = am.argmax(x)
    ref = torch.argmax(x, dim=-1)
    assert out.dtype == torch.int64 and out.shape == ref.shape
    bad = (out != ref).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]}: kernel {out[bad[:5]].tolist()} != torch {ref[bad[:5]].tolist()}"


# ----------------------------------------------------------------------------- no kernels run

@pytest.mark.parametrize("rows", [1, 2, 4, 16, 64, 300])
@pytest.mark.parametrize("cols", [1, 7, 1000, QWEN_VOCAB, 2 ** 21 + 3])
def test_plan_covers_the_row_in_whole_blocks(rows, cols):
    block, chunk, parts = am.plan(rows, cols)
    assert block & (block - 1) == 0 and 16 <= block <= am.BLOCK
    assert chunk % block == 0 and chunk // block <= max(8, -(-cols // (block * am.MAX_PARTS)))
    assert parts * chunk >= cols > (parts - 1) * chunk
    assert 1 <= parts <= am.MAX_PARTS


def test_plan_spreads_one_row_over_many_programs():
    assert am.plan(1, QWEN_VOCAB)[2] >= 132          # at least one program per H200 SM
    assert am.plan(16, QWEN_VOCAB)[1] > am.plan(1, QWEN_VOCAB)[1]


@pytest.mark.parametrize("x,match", [
    (torch.zeros(4), "2-D"),
    (torch.zeros(2, 3, dtype=torch.int32), "int32"),
    (torch.zeros(3, 2).t(), "unit stride"),
    (torch.zeros(0, 5), "empty"),
    (torch.zeros(2, 0), "empty"),
])
def test_bad_input_raises_naming_the_problem(x, match):
    with pytest.raises(ValueError, match=match):
        am.argmax(x)


def test_bad_out_raises():
    with pytest.raises(ValueError, match="out must be int64"):
        am.argmax(torch.zeros(2, 5), out=torch.empty(3, dtype=torch.int64))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_kernels_compile_for_sm90_with_pdl():
    sig = {"x_ptr": "*bf16", "val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32", "V": "i32",
           "stride_x": "i32", "PARTS": "i32"}
    ptx = _aot_compile(am._argmax_parts_kernel, sig, dict(CHUNK=2048, BLOCK=1024, PDL=True),
                       ("x_ptr",), 4, 1).asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    sig = {"val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32", "out_ptr": "*i64", "PARTS": "i32"}
    ptx = _aot_compile(am._argmax_final_kernel, sig, dict(BLOCK_P=256, PDL=True), (), 4, 1).asm["ptx"]
    assert "griddepcontrol.wait" in ptx


# ----------------------------------------------------------------------------- the kernels

@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, QWEN_VOCAB), (3, 1000), (16, QWEN_VOCAB), (64, 5000), (2, 7), (1, 1),
                                       (5, 4097)])
def test_random_logits(rows, cols, dtype):
    gen = torch.Generator().manual_seed(rows * 7919 + cols)
    x = (torch.randn(rows, cols, generator=gen) * 8).to(dtype)   # bf16 at this scale: many exact ties
    _check(x.to(DEV))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_ties_go_to_the_lowest_index_across_lanes_and_parts(rows):
    cols = QWEN_VOCAB
    block, chunk, parts = am.plan(rows, cols)
    x = torch.zeros(rows, cols, dtype=torch.bfloat16)
    # Each row's maximum is planted at several places, the first one in a different spot per row:
    # inside one lane (i, i + block), across lanes, and either side of a part boundary.
    places = [chunk - 1, chunk, 3 * chunk + 5, cols - 1, block + 2, 2]
    for r in range(rows):
        planted = places[r % len(places):]
        x[r, planted] = 4.0
        after_first = x[r, planted[0] + 1:]
        after_first.masked_fill_(after_first != 4.0, 3.0)   # just below the max, so the max stays the planted 4.0s
    _check(x.to(DEV))


@needs_kernels
def test_special_values():
    cols = 5000
    rows = []
    def row(**at):
        r = torch.full((cols,), -1.0)
        for i, v in at.items():
            r[int(i[1:])] = v
        rows.append(r)
    inf, nan = float("inf"), float("nan")
    row(i10=nan, i20=5.0)                          # NaN before the max: NaN wins
    row(i20=5.0, i4000=nan, i4500=nan)             # NaN after the max, twice: the first NaN
    row(i3=inf, i2000=inf, i10=nan)                # NaN wins over +inf
    row(i3=inf, i2000=inf)                         # +inf ties: the first
    rows.append(torch.full((cols,), -inf))         # all -inf: index 0
    r = torch.full((cols,), -inf)
    r[4999] = -1e30
    rows.append(r)                                 # one finite value at the end
    rows.append(torch.full((cols,), nan))          # all NaN: index 0
    x = torch.stack(rows)
    for dtype in (torch.bfloat16, torch.float32):
        _check(x.to(dtype).to(DEV))


@needs_kernels
def test_strided_rows_and_given_out():
    x = torch.randn(6, 3000).to(torch.bfloat16)[:, 100:2900]    # row stride 3000, unit column stride
    out = torch.full((6,), -1, dtype=torch.int64)
    x, out = x.to(DEV), out.to(DEV)
    assert am.argmax(x, out=out) is out
    assert torch.equal(out, torch.argmax(x, dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_and_replay():
    x = torch.randn(4, QWEN_VOCAB, device="cuda").bfloat16()
    am.argmax(x)   # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = am.argmax(x)
    for seed in range(3):
        x.copy_(torch.randn(4, QWEN_VOCAB, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda())
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))
