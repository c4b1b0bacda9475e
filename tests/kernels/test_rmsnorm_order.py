"""The order the RMSNorm kernel sums its squares in (fqkernels/rmsnorm.py, module doc):
the pure-torch emulation against an independent scalar loop of ATen's reduce kernel,
always; the Triton kernel against the emulation bit for bit under the CPU interpreter
(Triton >= 3.4), the torch-order kernel (the default). On a GPU,
tests/kernels/test_norm_rope_swiglu.py checks that torch's own mean equals the emulation and that
the kernels give the reference's bits."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import triton

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import rmsnorm as rn  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])


def _aten_loop(row: torch.Tensor, vec: bool, halves: bool) -> torch.Tensor:
    """ATen's reduce for one row, written as scalar float32 steps: lane t of one warp,
    four accumulators (4-wide vector loads, or 4 unrolled scalar loads), combined
    ((a0 + a1) + a2) + a3, then the shuffle tree (halves or adjacent pairs first), times
    float32(1 / n)."""
    n = row.numel()
    sq = [v * v for v in row.float()]
    lanes = []
    for t in range(32):
        acc = [torch.tensor(0.0)] * 4
        for j in range(-(-n // 128)):
            for i in range(4):
                e = 128 * j + 4 * t + i if vec else 128 * j + 32 * i + t
                if e < n:
                    acc[i] = acc[i] + sq[e]
        lanes.append(((acc[0] + acc[1]) + acc[2]) + acc[3])
    while len(lanes) > 1:
        half = len(lanes) // 2
        if halves:
            lanes = [lanes[k] + lanes[k + half] for k in range(half)]
        else:
            lanes = [lanes[k] + lanes[k + 1] for k in range(0, len(lanes), 2)]
    return lanes[0] * (torch.tensor(1.0) / torch.tensor(float(n)))


@pytest.mark.parametrize("vec,halves", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("n", [2560, 1000, 128, 64, 40])
def test_emulation_is_atens_loop(n, vec, halves):
    x = (torch.randn(3, n, generator=torch.Generator().manual_seed(n)) * 4).bfloat16()
    got = rn.mean_of_squares_torch_order(x, vec, halves)
    for m in range(3):
        assert torch.equal(got[m], _aten_loop(x[m], vec, halves)), f"row {m}"


def test_order_matters():
    """The emulated order is not just any order: the plain float64-rounded mean and a
    sequential float32 sum disagree with it on some rows (so the GPU tests can fail)."""
    x = (torch.randn(256, 2560, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    ours = rn.mean_of_squares_torch_order(x)
    exact = x.double().square().mean(-1).float()
    sequential = x.float().square().cumsum(-1)[:, -1] * (torch.tensor(1.0) / 2560)
    assert not torch.equal(ours, exact) and not torch.equal(ours, sequential)
    assert not torch.equal(ours, rn.mean_of_squares_torch_order(x, halves=False))


def _expected(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    vec, halves, _ = rn.torch_order(x.shape[1], x.device)
    var = rn.mean_of_squares_torch_order(x, vec, halves)[:, None] + torch.tensor(eps, dtype=torch.float32)
    return (w.float() * (x.float() * torch.rsqrt(var)).bfloat16().float()).bfloat16()


@pytest.mark.skipif(not (INTERPRET and _TRITON_VERSION >= (3, 4)),
                    reason="needs TRITON_INTERPRET=1 and Triton >= 3.4 (Triton 3.1's interpreter is broken)")
@pytest.mark.parametrize("order", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("rows,n", [(5, 2560), (4, 128), (3, 64), (2, 4096), (3, 1000), (2, 5120)])
def test_kernels_sum_in_the_emulated_order_interpreted(interpreter_bf16_rounding, monkeypatch, rows, n, order):
    vec, halves = order
    if vec and n % 4:
        pytest.skip("4-wide loads need a width divisible by 4")
    monkeypatch.setattr(rn, "TORCH_ORDER", True)
    monkeypatch.setitem(rn._ORDERS, (n, "cpu"), (vec, halves, True))
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).bfloat16()
    r = torch.randn(rows, n, generator=g).bfloat16()
    w = (torch.rand(n, generator=g) + 0.5).bfloat16()
    assert torch.equal(rn.rmsnorm(x, w, 1e-6), _expected(x, w, 1e-6))
    xk = x.clone()
    out = rn.add_rmsnorm(xk, r, w, 1e-6)
    s = (x.float() + r.float()).bfloat16()
    assert torch.equal(xk, s) and torch.equal(out, _expected(s, w, 1e-6))
    ids = torch.randint(0, rows, (rows,), generator=g)
    xe, oute = rn.embed_rmsnorm(ids, x, w, 1e-6)
    assert torch.equal(xe, x[ids]) and torch.equal(oute, _expected(x[ids], w, 1e-6))


@pytest.mark.skipif(not (INTERPRET and _TRITON_VERSION >= (3, 4)),
                    reason="needs TRITON_INTERPRET=1 and Triton >= 3.4 (Triton 3.1's interpreter is broken)")
@pytest.mark.parametrize("order", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("n", [2560, 1000, 5120])
def test_kernel_mean_of_squares_is_the_emulation_interpreted(interpreter_bf16_rounding, monkeypatch, n, order):
    """The mean itself, bit for bit, on 64 rows: one changed association in the kernel's sum
    changes it on a few rows, where the normalized outputs almost never show it."""
    vec, halves = order
    if vec and n % 4:
        pytest.skip("4-wide loads need a width divisible by 4")
    monkeypatch.setitem(rn._ORDERS, (n, "cpu"), (vec, halves, True))
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(64, n, generator=g) * 3).bfloat16()
    r = torch.randn(64, n, generator=g).bfloat16()
    s = (x.float() + r.float()).bfloat16()
    assert torch.equal(rn.torch_order_mean_of_squares(x), rn.mean_of_squares_torch_order(x, vec, halves))
    assert torch.equal(rn.torch_order_mean_of_squares(x, r), rn.mean_of_squares_torch_order(s, vec, halves))


@pytest.mark.skipif(not (INTERPRET and _TRITON_VERSION >= (3, 4)),
                    reason="needs TRITON_INTERPRET=1 and Triton >= 3.4 (Triton 3.1's interpreter is broken)")
@pytest.mark.parametrize("rows,n", [(5, 2560), (3, 1000), (2, 9000)])
def test_tl_sum_kernel_interpreted(interpreter_bf16_rounding, monkeypatch, rows, n):
    """The tl.sum kernel (rmsnorm.TORCH_ORDER = False, and rows wider than the torch-order kernel takes):
    the residual stream exact, the output within one bf16 ulp of the reference (another
    summation order moves the mean by an ulp or so, which rarely moves an output)."""
    monkeypatch.setattr(rn, "TORCH_ORDER", n > rn.TORCH_ORDER_MAX_N)
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).bfloat16()
    parts = torch.randn(3, rows, n, generator=g)
    w = (torch.rand(n, generator=g) + 0.5).bfloat16()
    xk, xr = x.clone(), x.clone()
    out = rn.add_rmsnorm_partials(xk, parts, w, 1e-6)
    want = rn.add_rmsnorm_partials_reference(xr, parts, w, 1e-6)
    assert torch.equal(xk, xr)
    diff = (out.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2.0 ** -7 + 1e-30).all() and (diff > 0).float().mean() < 1e-3
    ids = torch.randint(0, rows, (rows,), generator=g)
    xe, oute = rn.embed_rmsnorm(ids, x, w, 1e-6)
    assert torch.equal(xe, x[ids])
    diff = (oute.float() - rn.rmsnorm_reference(x[ids], w, 1e-6).float()).abs()
    assert (diff <= oute.float().abs() * 2.0 ** -7 + 1e-30).all()


@pytest.mark.skipif(not (INTERPRET and _TRITON_VERSION >= (3, 4)),
                    reason="needs TRITON_INTERPRET=1 and Triton >= 3.4 (Triton 3.1's interpreter is broken)")
@pytest.mark.parametrize("torch_order", [True, False])
@pytest.mark.parametrize("rows,n", [(5, 2560), (3, 256), (2, 1000)])
def test_one_plus_norm_keeps_qwen35s_cast_points_interpreted(interpreter_bf16_rounding, monkeypatch, rows, n,
                                                             torch_order):
    """Qwen3.5's (1 + w) norm: (x * rsqrt(mean + eps)) * (1 + w) in fp32, rounded once, on the
    emulated mean (torch-order kernel) or on any sum (tl.sum kernel: checked against the
    same formula on the kernel's own mean, to an ulp), and the residual added first."""
    monkeypatch.setattr(rn, "TORCH_ORDER", torch_order)
    monkeypatch.setitem(rn._ORDERS, (n, "cpu"), (n % 4 == 0, True, True))
    g = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, n, generator=g) * 3).bfloat16()
    r = torch.randn(rows, n, generator=g).bfloat16()
    w = (torch.randn(n, generator=g) * 0.3).bfloat16()
    s = (x.float() + r.float()).bfloat16()

    def expected(rows_):
        mean = (rn.mean_of_squares_torch_order(rows_, n % 4 == 0, True) if torch_order
                else rows_.float().square().mean(-1))
        inv = torch.rsqrt(mean[:, None] + torch.tensor(1e-6, dtype=torch.float32))
        return ((rows_.float() * inv) * (1.0 + w.float())).bfloat16()

    got = rn.rmsnorm(x, w, 1e-6, one_plus=True)
    xk = x.clone()
    got_add = rn.add_rmsnorm(xk, r, w, 1e-6, one_plus=True)
    assert torch.equal(xk, s)
    if torch_order:
        assert torch.equal(got, expected(x)) and torch.equal(got_add, expected(s))
    else:
        for a, b in ((got, expected(x)), (got_add, expected(s))):
            assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -7).all()
    # the (1 + w) form is not the Qwen3 form on the same rows
    assert not torch.equal(got, rn.rmsnorm(x, w, 1e-6))



@pytest.mark.skipif(not (INTERPRET and _TRITON_VERSION >= (3, 4)),
                    reason="needs TRITON_INTERPRET=1 and Triton >= 3.4 (Triton 3.1's interpreter is broken)")
@pytest.mark.parametrize("torch_order", [True, False])
@pytest.mark.parametrize("one_plus", [True, False])
@pytest.mark.parametrize("rows,heads,stride_h", [(3, 4, 128), (2, 3, 64), (1, 2, 64)])
def test_rows_of_heads_are_the_rows_interpreted(interpreter_bf16_rounding, monkeypatch, rows, heads, stride_h,
                                                 one_plus, torch_order):
    """rmsnorm over x [M, H, N] read in place (Qwen3.5's q heads: the first N of every 2N-wide
    head of a packed product's row; k heads: N apart) gives, head for head, the 2-D kernel's
    bits on the same rows made contiguous."""
    n = 64
    monkeypatch.setattr(rn, "TORCH_ORDER", torch_order)
    monkeypatch.setitem(rn._ORDERS, (n, "cpu"), (True, True, True))
    g = torch.Generator().manual_seed(rows * heads + stride_h)
    packed = (torch.randn(rows, heads * stride_h + 96, generator=g) * 3).bfloat16()   # other columns after
    x = packed[:, :heads * stride_h].view(rows, heads, stride_h)[..., :n]
    w = (torch.randn(n, generator=g) * 0.3).bfloat16()
    got = rn.rmsnorm(x, w, 1e-6, one_plus=one_plus)
    assert got.shape == (rows, heads, n) and got.is_contiguous()
    assert torch.equal(got, rn.rmsnorm(x.reshape(-1, n).contiguous(), w, 1e-6, one_plus=one_plus).view(rows, heads, n))
    with pytest.raises(ValueError, match=r"out must be contiguous of shape \(%d, %d, 64\)" % (rows, heads)):
        rn.rmsnorm(x, w, 1e-6, out=torch.empty(rows, heads, 2 * n, dtype=torch.bfloat16)[..., :n])
