"""The screened LM head (fqkernels.lm_screen): one sequence's greedy pick from an int8 copy of the
head and the exact logits of the rows that can still win, against the argmax of the whole GEMV.

Which tests run where:
  pinned stack, no GPU      the int8 copy and its bound, the torch reference of the screen against
                            the full argmax (ties, near-ties, NaN), the bound itself on every row,
                            plans and errors
  TRITON_INTERPRET=1        + the three kernels on small heads (explicit fma configs): the same pick
                            as argmax(gemv.linear(...)), every row a candidate too, NaN rows
  a CUDA device             + the kernels on the Qwen3-4B and Qwen3.5-4B heads (marked gpu): the same
                            pick as the GEMV's argmax over random and near-tied rows, and with every
                            row a candidate (then every logit is the refine's: its bits against the GEMV's)
"""
from __future__ import annotations

import math
import sys

import pytest
import torch
import triton

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import gemv, lm_screen  # noqa: E402
from fqkernels.argmax import argmax_reference  # noqa: E402
from fqkernels.gemv import GemvConfig  # noqa: E402

# the kernels' device (CPU tensors under the interpreter, else CUDA) and their mark, as the argmax tests'
from .test_argmax import DEV, INTERPRETED, needs_kernels  # noqa: E402

needs_gpu = pytest.mark.skipif(DEV is None or INTERPRETED, reason="needs a CUDA device")
FMA8 = GemvConfig(block_n=8, block_k=128, split_k=1, mode="fma", block_m=1)


def _head(V: int, K: int, seed: int, scale: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, K, generator=g) * scale
    # heavier tails on a few rows and an all-zero row: the scales' range
    w[::97] *= 6
    w[5] = 0
    return w.to(torch.bfloat16)


def _x(K: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, K, generator=g) * scale).to(torch.bfloat16)


# ----------------------------------------------------------------------------- no kernels run

def test_int8_copy_within_half_a_scale():
    w = _head(300, 256, 0)
    q, s = lm_screen.quantize_rows(w, chunk_rows=64)
    assert q.dtype == torch.uint8 and s.dtype == torch.float32
    qd = q.double() - 128
    assert qd.abs().max() <= 127
    err = (w.double() - s.double()[:, None] * qd).abs()
    assert bool((err <= s.double()[:, None] / 2).all())
    assert s[5] == 0 and bool((q[5] == 128).all())         # the zero row: no scale, every byte 128
    # the scale is at least the row's largest magnitude over 127 (rounded up, never down)
    assert bool((s.double() * 127 >= w.double().abs().amax(1)).all())


def test_bound_coefficient():
    c = lm_screen.bound_coefficient(2560)
    assert 0.5 + 254.5 * 2560 * 2.0 ** -24 < c < 0.545
    assert lm_screen.bound_coefficient(8192) > c


@pytest.mark.parametrize("seed", range(6))
def test_bound_holds_on_every_row(seed):
    """|bf16 logit - a_j| <= B_j for every row: the fp32 GEMV sum (torch's order) of the bf16
    weights, rounded to bf16, against the int8 pass's approximation and bound in fp32."""
    V, K = 2000, 512
    w = _head(V, K, seed)
    x = _x(K, 100 + seed, scale=[1.0, 30.0, 1e-3][seed % 3])
    q, s = lm_screen.quantize_rows(w)
    logits = gemv.linear_reference(x, w)[0].double()
    approx = ((x.float() @ (q.float() - 128).t())[0] * s)
    bound = lm_screen.bound_coefficient(K) * s * x.float().abs().sum() + 2.0 ** -8 * approx.abs()
    slack = bound.double() - (logits - approx.double()).abs()
    assert bool((slack >= 0).all()), f"row {int(slack.argmin())}: bound short by {-float(slack.min())}"


@pytest.mark.parametrize("seed", range(20))
def test_reference_pick_is_the_full_argmax(seed):
    V, K = 3000, 256
    w = _head(V, K, seed)
    if seed % 4 == 1:     # exact ties: the winner's row copied to later rows (the first index must win)
        x = _x(K, 500 + seed)
        top = int(argmax_reference(gemv.linear_reference(x, w))[0])
        w[top + 1:: 400] = w[top]
        w[:top:300] = w[top]
    elif seed % 4 == 2:   # near-ties: rows a bf16 step apart
        w[1000:1010] = w[999] + torch.randn(10, K) * 1e-4
    x = _x(K, 500 + seed)
    pick, count = lm_screen.screened_argmax_reference(x, w, *lm_screen.quantize_rows(w))
    full = argmax_reference(gemv.linear_reference(x, w))
    assert int(pick[0]) == int(full[0])
    assert 1 <= count <= V


def test_reference_nan_row_first():
    V, K = 500, 128
    w = _head(V, K, 3)
    x = _x(K, 4)
    x[0, 7] = float("nan")
    pick, count = lm_screen.screened_argmax_reference(x, w, *lm_screen.quantize_rows(w))
    assert count == V                                   # NaN bounds: every row a candidate
    assert int(pick[0]) == int(torch.argmax(gemv.linear_reference(x, w), dim=-1)[0])


def _rows_x(K: int, seed: int) -> torch.Tensor:
    """x [6, K]: rows of the scales a verify meets, one with a few large outliers, one all zero, one
    with values near bf16's smallest normal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, K, generator=g)
    x[1] *= 30.0
    x[2, ::50] *= 400.0
    x[3] = 0
    x[4] *= 1e-36
    x[5] *= 1e-3
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("seed", range(4))
def test_x_integers_split_exactly(seed):
    """x_integers: sx a power of two, x = sx (128 h + l) + e with |e| <= sx / 2, h and l in int8's
    ranges [-127, 127] and [-64, 63], and |x| / sx <= 16256 at most one step over."""
    x = _rows_x(512, seed)
    hi, lo, sx = lm_screen.x_integers(x)
    assert hi.dtype == lo.dtype == torch.int8
    assert int(hi.abs().max()) <= 127 and int(lo.min()) >= -64 and int(lo.max()) <= 63
    mant, _ = torch.frexp(sx)
    assert bool((mant == 0.5).all())                       # powers of two
    big = hi.double() * 128 + lo.double()
    err = (x.double() - sx.double()[:, None] * big).abs()
    assert bool((err <= sx.double()[:, None] / 2).all())
    m = x.double().abs().amax(1)
    assert bool((m / sx.double() <= lm_screen.X_MAX).all())
    assert bool((sx[3] == 2.0 ** -126) & (hi[3] == 0).all() & (lo[3] == 0).all())   # the zero row


def test_x_integers_non_finite_rows():
    x = _rows_x(256, 9)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    _, _, sx = lm_screen.x_integers(x)
    assert torch.isnan(sx[1]) and torch.isnan(sx[2]) and bool(torch.isfinite(sx[[0, 3, 4, 5]]).all())


@pytest.mark.parametrize("seed", range(6))
def test_rows_bound_holds_on_every_row(seed):
    """argmax_rows' int8 pass (rows_bounds_reference, the kernels' formulas): |bf16 logit - a_rj| <=
    B_rj for every row of x and of the head, x's own rounding to integers included."""
    V, K = 1500, 512
    w = _head(V, K, 40 + seed)
    x = _rows_x(K, 60 + seed)
    q, s = lm_screen.quantize_rows(w)
    approx, bound = lm_screen.rows_bounds_reference(x, q, s, lm_screen.row_l1(q), lm_screen.bound_coefficient(K))
    for r in range(x.shape[0]):
        logits = gemv.linear_reference(x[r:r + 1], w)[0].double()
        slack = bound[r].double() - (logits - approx[r].double()).abs()
        assert bool((slack >= 0).all()), f"x row {r}, head row {int(slack.argmin())}: short by {-float(slack.min())}"
    # on rows of x without outliers the integers' term is a small share of the bound: the
    # candidates stay about the one-row pass's
    live = s > 0
    share = (lm_screen.C2 * lm_screen.x_integers(x)[2][0] * lm_screen.row_l1(q) * s)[live] / bound[0, live]
    assert float(share.max()) < 0.03


def test_row_l1_counts_q():
    w = _head(300, 256, 2)
    q, _ = lm_screen.quantize_rows(w)
    assert torch.equal(lm_screen.row_l1(q, chunk_rows=64), (q.double() - 128).abs().sum(1).float())


def test_plans_and_errors():
    assert lm_screen.ScreenPlan.from_text("") == lm_screen.ScreenPlan()
    assert lm_screen.ScreenPlan.from_text("rows=32, block_k=256").rows == 32
    for bad in ("rows", "rows=3", "cols=8", "groups=64", "warps=0"):
        with pytest.raises(ValueError, match="lm_screen plan"):
            lm_screen.ScreenPlan.from_text(bad)
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    assert "not a one-chunk fma config" in lm_screen.unsupported(w, config=GemvConfig(block_n=16, block_k=128))
    assert "multiple of" in lm_screen.unsupported(torch.zeros(64, 192, dtype=torch.bfloat16),
                                                  lm_screen.ScreenPlan(block_k=128),
                                                  GemvConfig(block_n=8, block_k=64, mode="fma", block_m=1))
    assert lm_screen.unsupported(w, lm_screen.ScreenPlan(block_k=128), FMA8) is None
    # the real heads' one-row configs are the fma ones the screen needs
    for V in (151936, 248320):
        assert lm_screen.unsupported(torch.empty(V, 2560, dtype=torch.bfloat16, device="meta")) is None


# ----------------------------------------------------------------------------- the kernels

def _screen(w, plan=lm_screen.ScreenPlan(rows=16, block_k=128, warps=4, groups=4), config=FMA8):
    return lm_screen.LmScreen(w.to(DEV), plan, config)


def _full_pick(x, w, config=FMA8):
    return int(torch.argmax(gemv.linear(x, w, config=config).float(), dim=-1)[0])


@needs_kernels
@pytest.mark.parametrize("V", [1000, 1003, 2048])
@pytest.mark.parametrize("seed", range(3))
def test_kernels_pick_the_gemv_argmax(V, seed):
    K = 256
    w = _head(V, K, seed).to(DEV)
    screen = _screen(w)
    for t in range(3):
        x = _x(K, 40 * seed + t, scale=[1.0, 20.0, 0.01][t]).to(DEV)
        got = screen.argmax(x)
        assert int(got[0]) == _full_pick(x, w), f"step {t}"
        assert float(screen.tau[0]) == -math.inf          # reset for the next step
        assert 1 <= screen.candidates_for(x) <= V


@needs_kernels
def test_kernels_every_row_a_candidate():
    """An infinite bound: every row refined; the pick is still the GEMV's argmax (every logit the
    refine's own: its sums against the GEMV's)."""
    V, K = 1003, 256
    w = _head(V, K, 9).to(DEV)
    screen = _screen(w)
    screen.c1 = math.inf
    for t in range(4):
        x = _x(K, 70 + t, scale=1e-2).to(DEV)     # small logits: many bf16 ties
        assert screen.candidates_for(x) == V
        assert int(screen.argmax(x)[0]) == _full_pick(x, w)


@needs_kernels
def test_kernels_ties_and_nan():
    V, K = 1000, 256
    w = _head(V, K, 11)
    x = _x(K, 12)
    top = int(torch.argmax(gemv.linear_reference(x, w).float(), dim=-1)[0])
    w[top + 8] = w[top]
    w[max(top - 16, 0)] = w[top]
    w = w.to(DEV)
    screen = _screen(w)
    assert int(screen.argmax(x.to(DEV))[0]) == _full_pick(x.to(DEV), w)
    xn = x.clone()
    xn[0, 3] = float("nan")
    xn = xn.to(DEV)
    assert int(screen.argmax(xn)[0]) == int(torch.argmax(gemv.linear(xn, w, config=FMA8).float(), dim=-1)[0])


@needs_kernels
def test_argument_errors():
    w = _head(64, 256, 1).to(DEV)
    screen = _screen(w)
    with pytest.raises(ValueError, match="x must be"):
        screen.argmax(torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        screen.argmax(torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV),
                      out=torch.zeros(2, dtype=torch.int64, device=DEV))


@needs_kernels
@pytest.mark.parametrize("R", [2, 3, 5, 16])
def test_kernels_rows_pick_each_rows_gemv_argmax(R):
    """argmax_rows: one int8 pass for R rows, each row's pick the one-row GEMV's argmax (as argmax's),
    every row's tau back to -inf; again with every row a candidate (each logit the refine's own)."""
    V, K = 1003, 256
    w = _head(V, K, 20 + R).to(DEV)
    screen = _screen(w)
    scales = [1.0, 20.0, 0.01, 3.0]
    x = torch.cat([_x(K, 100 * R + r, scale=scales[r % 4]) for r in range(R)]).to(DEV)
    want = [_full_pick(x[r:r + 1], w) for r in range(R)]
    for _ in range(2):                                    # the taus reset: a second call the same
        assert screen.argmax_rows(x).tolist() == want
        assert bool((screen.rows_buffers[1] == -math.inf).all())
    screen.c1 = math.inf
    assert screen.argmax_rows(x).tolist() == want


@needs_kernels
def test_kernels_rows_ties_and_nan():
    """Exact ties planted in the head: each row's first index wins; a NaN in one row's x makes that
    row's pick the GEMV's (the first NaN logit) and leaves the other rows' picks alone."""
    V, K = 1000, 256
    w = _head(V, K, 31)
    x = torch.cat([_x(K, 32 + r) for r in range(3)])
    top = int(torch.argmax(gemv.linear_reference(x[:1], w).float(), dim=-1)[0])
    w[top + 8] = w[top]
    w[max(top - 16, 0)] = w[top]
    x[1, 3] = float("nan")
    w, x = w.to(DEV), x.to(DEV)
    want = [int(torch.argmax(gemv.linear(x[r:r + 1], w, config=FMA8).float(), dim=-1)[0]) for r in range(3)]
    assert want[0] == max(top - 16, 0)
    assert _screen(w).argmax_rows(x).tolist() == want


@needs_kernels
def test_rows_argument_errors():
    w = _head(64, 256, 1).to(DEV)
    screen = _screen(w)
    for bad in (torch.zeros(0, 256), torch.zeros(17, 256), torch.zeros(2, 128), torch.zeros(2, 256).t()):
        with pytest.raises(ValueError, match="x must be"):
            screen.argmax_rows(bad.to(torch.bfloat16).to(DEV))
    with pytest.raises(ValueError, match="out must be"):
        screen.argmax_rows(torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV),
                           out=torch.zeros(3, dtype=torch.int64, device=DEV))


@needs_kernels
def test_kernels_rows_bounds_are_the_references():
    """argmax_rows' integer pass against rows_bounds_reference: x's integers and scales bit for bit,
    the upper bounds and each row's tau (the largest lower bound) within 1e-5 of the bound
    (||x||_1 is summed in another order)."""
    V, K = 1003, 512
    w = _head(V, K, 77).to(DEV)
    screen = _screen(w)
    x = _rows_x(K, 78)
    x[5, 3] = float("nan")
    R = x.shape[0]
    xd = x.to(DEV)
    approx, bound = lm_screen.rows_bounds_reference(x, screen.q, screen.s, screen.q_l1, screen.c1)
    up, tau, _, _, _, xi, sx, l1 = screen._rows_buffers()
    tau.fill_(float("-inf"))
    lm_screen._x_int_kernel[(R,)](xd, xi, sx, l1, K=K, R_PAD=screen.ROWS_MAX, BLOCK=K)
    hi, lo, sx_ref = lm_screen.x_integers(x)
    assert torch.equal(xi[:R].cpu(), hi) and torch.equal(xi[screen.ROWS_MAX:screen.ROWS_MAX + R].cpu(), lo)
    assert torch.equal(sx[:R].cpu()[:5], sx_ref[:5]) and bool(torch.isnan(sx[5]))
    lm_screen._approx_rows_kernel[(triton.cdiv(V, lm_screen.ROWS_BLOCK_R),)](
        xi, sx, l1, screen.q, screen.s, screen.q_l1, up, tau, V, R, screen.c1, lm_screen.C2, K=K,
        R_PAD=screen.ROWS_MAX, BLOCK_R=lm_screen.ROWS_BLOCK_R, BLOCK_K=lm_screen.ROWS_BLOCK_K)
    # ||x||_1's order and c2's fp32 rounding move a bound by ~1e-6 of itself, nothing more
    assert bool(((up[:5].cpu() - (approx + bound)[:5]).abs() <= 1e-5 * bound[:5]).all())
    lower = (approx - bound)[:5]
    top = lower.argmax(1, keepdim=True)
    assert bool(((tau[:5].cpu() - lower.amax(1)).abs() <= 1e-5 * bound[:5].gather(1, top)[:, 0]).all())
    assert bool(torch.isnan(up[5]).all())                   # a NaN row: every head row a candidate
    tau.fill_(float("-inf"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("V", [151936, 248320])
def test_gpu_real_heads_rows(V):
    """argmax_rows on the real heads' shapes at 2-16 rows: each row's pick the one-row GEMV's argmax,
    and with every row refined (an infinite bound)."""
    K = 2560
    w = (torch.randn(V, K, device=DEV) * 0.02).to(torch.bfloat16)
    screen = lm_screen.LmScreen(w)
    for R in (2, 4, 5, 7, 9, 16):
        x = (torch.randn(R, K, device=DEV) * (0.3 + R / 4)).to(torch.bfloat16)
        want = [int(torch.argmax(gemv.linear(x[r:r + 1], w).float(), dim=-1)[0]) for r in range(R)]
        assert screen.argmax_rows(x).tolist() == want, f"{R} rows"
    screen.c1 = math.inf
    x = (torch.randn(5, K, device=DEV) * 0.05).to(torch.bfloat16)
    assert screen.argmax_rows(x).tolist() == [int(torch.argmax(gemv.linear(x[r:r + 1], w).float(), dim=-1)[0])
                                              for r in range(5)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("V", [151936, 248320])
def test_gpu_real_heads(V):
    """The real heads' shapes: the pick is the GEMV's argmax on random rows, and on exact ties planted
    in the head (the winner's row copied a few rows before and after it, the screen rebuilt from the
    planted head so its int8 copy holds them): the first index, the lower twin, must win; then with
    every row refined (an infinite bound), each logit the refine's own against the GEMV's."""
    K = 2560
    w = (torch.randn(V, K, device=DEV) * 0.02).to(torch.bfloat16)
    screen = lm_screen.LmScreen(w)
    assert screen.config == gemv.select_config(V, K, False, 1)
    counts, ties = [], 0
    for t in range(64):
        x = (torch.randn(1, K, device=DEV) * (0.3 + t / 16)).to(torch.bfloat16)
        if t % 8 == 7:
            top = int(torch.argmax(gemv.linear(x, w).float(), dim=-1)[0])
            low, high = max(top - 5, 0), min(top + 3, V - 1)
            w[low] = w[top]
            w[high] = w[top]
            screen = lm_screen.LmScreen(w)
            want = int(torch.argmax(gemv.linear(x, w).float(), dim=-1)[0])
            assert want == low, "twins of the winner are exact ties: the first one must be the pick"
            ties += 1
        assert int(screen.argmax(x)[0]) == int(torch.argmax(gemv.linear(x, w).float(), dim=-1)[0]), f"step {t}"
        counts.append(screen.candidates_for(x))
    assert ties == 8
    screen.c1 = math.inf                 # every row refined: all of its logits against the GEMV's pick
    for t in range(16):
        x = (torch.randn(1, K, device=DEV) * 0.05).to(torch.bfloat16)
        assert int(screen.argmax(x)[0]) == int(torch.argmax(gemv.linear(x, w).float(), dim=-1)[0]), f"all {t}"
    print(f"V={V}: candidates per step median {sorted(counts)[len(counts) // 2]}, max {max(counts)}")
