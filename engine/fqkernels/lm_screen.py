"""The greedy pick of a one-sequence decode step without reading the whole LM head.

    LmScreen(w).argmax(x) == argmax(gemv.linear(x, w))     x [1, K] bf16, w [V, K] bf16

bit for bit (the same index, torch.argmax's rules: the first of the largest, NaN first), reading
an int8 copy of w (half its bytes) and then the bf16 rows of only the few tokens that can still
be the largest. The LM head is the largest product of a decode step (Qwen3.5-4B: 248,320 x 2,560,
1.27 GB of the step's ~8.4 GB); at one row its GEMV streams it at the memory's speed.

How, and why it is exact:
  Load time. Per row j a scale s_j = max_i |w_ji| / 127, rounded up to fp32, and Q_ji =
  round(w_ji / s_j) in [-127, 127], kept as the byte Q_ji + 128; checked exactly (fp64) that
  |w_ji - s_j Q_ji| <= s_j / 2 for every element.
  1. `_approx_kernel`: for every row a_j = s_j * sum_i x_i Q_ji (fp32; each product exact) and
       B_j = c1 * s_j * ||x||_1 + 2^-8 |a_j|
     with c1 = (1/2 + 254.5 gamma_K) (1 + 2^-9) (1 + 10^-3), gamma_K = K u / (1 - K u), u = 2^-24.
     Let y_j be gemv.linear's fp32 sum for row j (any order) and T_j the exact real sum. Then
     |y_j - T_j| <= gamma_K 127.5 s_j ||x||_1 (|w_ji| <= 127.5 s_j), |T_j - s_j sum x_i Q_ji| <=
     s_j ||x||_1 / 2 (the quantization), |a_j - s_j sum x_i Q_ji| <= gamma_K 127 s_j ||x||_1 (the
     sum and the scaling rounded), and the bf16 rounding of y_j moves it by at most 2^-9 |y_j|:
     so the logit bf16(y_j) lies in [a_j - B_j, a_j + B_j] (the factor 1 + 10^-3 and 2^-8 against
     2^-9 cover the bound's own fp32 rounding). The kernel writes the upper bounds a_j + B_j and
     takes tau = max_j (a_j - B_j) with an atomic max.
  2. `_refine_kernel`: a row whose upper bound is below tau cannot be the largest logit (the
     largest is at least tau); every other row (a candidate: the winner always is one, and so is
     every row tied with it) gets its logit from the bf16 weights, in blocks of gemv's one-row
     config (8 rows), with gemv's own code for a block (_load_w_block, _row_fma, one tl.sum):
     the same sums, so the same bits as the GEMV. Each program keeps its first largest logit
     and its first NaN over its rows.
  3. `_final_kernel`: the programs' results in index order (argmax's final rule), and tau back to
     -inf for the next step.
  Non-finite inputs: a NaN bound is never below tau and a NaN tau puts every row in, so with
  a NaN or infinite x every row is a candidate and the pick is the full argmax's.

More rows of one sequence (argmax_rows: a speculative verify's k + 1 rows, each a one-row step's):
one int8 pass for every row on the tensor cores, in integers, so exact:
  `_x_int_kernel`: per row r of x, sx_r the least power of two >= max_i |x_ri| / 16256 and
    X_ri = round(x_ri / sx_r) (exact: a power of two's scaling), so |x_ri - sx_r X_ri| <= sx_r / 2
    and |X_ri| <= 16257, split as X = 128 h + l with h in [-127, 127] and l in [-64, 63] (int8);
    and ||x_r||_1 in fp32.
  `_approx_rows_kernel`: H_j = sum_i h_i Q_ji and L_j = sum_i l_i Q_ji on int8 tensor cores
    (exact int32 sums), a_rj = fp32(s_j sx_r (128 H_j + L_j)) (one rounding after fp64), and
       B_rj = c1 s_j ||x_r||_1 + 2^-8 |a_rj| + c2 s_j sx_r ||Q_j||_1,    c2 = (1/2)(1 + 10^-3)
    (||Q_j||_1 kept from load time): the last term covers x's own rounding to X, since
    |s_j sum x_i Q_ji - s_j sx sum X_i Q_ji| <= s_j (sx / 2) ||Q_j||_1, and the rest is the
    one-row bound (its gamma_K term now covers no sum's rounding: a margin). Against the first
    term it is at most ~2 ||Q_j||_1 max|x| / (16256 K mean|x|): ~1% on rows without outliers.
Each row then has its own tau, candidates, refine and final pick, the one-row kernels' code with
a row index: each row's pick is argmax's for that row alone.

Cost at one row: the int8 pass (~V K bytes) plus the candidates' bf16 rows (8 rows a candidate's
block); the pick never depends on how many candidates there are, only the time does (every row a
candidate is the GEMV's reads plus the int8 pass). Memory: V (K + 8) bytes more, kept beside w
(the int8 copy, the scales and each row's ||Q_j||_1, which the rows pass reads).

On an H200 (synthetic 4B checkpoints) the pick equals the GEMV's argmax at every one of 96
decode states a model; the candidates a step and the time saved: docs/PERFORMANCE.md
(results/bench_lm_screen_qwen3.json, results/bench_lm_screen_qwen35.json).

The Triton op set builds a model's screen (for_model) and the model runs it at one sequence;
model.screen = None turns it off (the bench's --no-lm-screen arm): the decode step then runs the
LM head's product and the argmax kernels. The int8 pass's launch: a ScreenPlan (PLAN unless
LmScreen is given one, or with_plan), whose text form is e.g. "rows=16,block_k=512,warps=4".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fqkernels import gemv, pdl
from fqkernels.gemv import _load_w_block, _row_fma

__all__ = ["ScreenPlan", "LmScreen", "quantize_rows", "row_l1", "bound_coefficient", "x_integers",
           "rows_bounds_reference", "screened_argmax_reference"]

_NONE = tl.constexpr(2 ** 31 - 1)     # "no index yet", as fqkernels.argmax
_MAGIC = tl.constexpr(0x4B000000)      # the fp32 bits of 2^23: (2^23 + byte) exactly, from the byte's bits
_MAGIC_OFFSET = tl.constexpr(8388736.0)  # 2^23 + 128: the stored byte is Q + 128
_REL = tl.constexpr(2.0 ** -8)         # the bound's relative term (covers the bf16 rounding, 2^-9)


@dataclass(frozen=True)
class ScreenPlan:
    """The int8 pass's launch: rows a program, K elements a loop trip, warps, num_stages; the
    refine's blocks of the GEMV's config a program (groups). The int8 pass's time barely depends on
    its plan on an H200 (results/bench_lm_screen_qwen35_plans.json; docs/PERFORMANCE.md)."""
    rows: int = 16
    block_k: int = 512
    warps: int = 4
    groups: int = 16
    stages: int = 3

    @classmethod
    def from_text(cls, text: str | None) -> "ScreenPlan":
        kw = {}
        names = {f.name for f in fields(cls)}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            name, sep, value = (x.strip() for x in part.partition("="))
            if name == "stages" and value in ("1", "2", "3", "4"):
                kw[name] = int(value)
                continue
            if not sep or name not in names or not value.isdigit() or int(value) < 1 or int(value) & (int(value) - 1):
                raise ValueError(f"lm_screen plan: {part!r} is not name=value with a name among "
                                 f"{', '.join(sorted(names))} and a power of two (stages: 1-4)")
            kw[name] = int(value)
        plan = cls(**kw)
        if plan.groups > 32:
            raise ValueError(f"lm_screen plan: groups must be at most 32, got {plan.groups}")
        return plan


PLAN = ScreenPlan()


def bound_coefficient(K: int) -> float:
    """c1 of the module note for a sum over K terms."""
    u = 2.0 ** -24
    gamma = K * u / (1 - K * u)
    return (0.5 + 254.5 * gamma) * (1 + 2.0 ** -9) * (1 + 1e-3)


def quantize_rows(w: torch.Tensor, chunk_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes [V, K] uint8 = Q + 128, scales [V] fp32) of w [V, K] bf16 (module note), on w's
    device; raises if any element's error exceeds half its row's scale (it cannot: exact fp64)."""
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ValueError(f"lm_screen: w must be a 2-D bf16 matrix, got {w.dtype} {tuple(w.shape)}")
    V, K = w.shape
    q = torch.empty((V, K), dtype=torch.uint8, device=w.device)
    s = torch.empty(V, dtype=torch.float32, device=w.device)
    if w.is_meta:
        return q, s
    for r0 in range(0, V, chunk_rows):
        wd = w[r0:r0 + chunk_rows].double()
        top = wd.abs().amax(dim=1) / 127
        sc = top.float()
        sc = torch.where(sc.double() < top, torch.nextafter(sc, torch.full_like(sc, math.inf)), sc)
        scd = sc.double()[:, None]
        qd = torch.where(scd > 0, torch.round(wd / torch.where(scd > 0, scd, 1.0)), 0.0)
        err = (wd - scd * qd).abs()
        if bool((qd.abs() > 127).any()) or bool((err > scd / 2).any()):
            raise RuntimeError(f"lm_screen: the int8 copy of rows {r0}.. misses its bound (a bug)")
        q[r0:r0 + chunk_rows] = (qd + 128).to(torch.uint8)
        s[r0:r0 + chunk_rows] = sc
    return q, s


X_MAX = 16256          # |x / sx| at most this: X = 128 h + l stays within int8's h and l (module note)
C2 = 0.5 * (1 + 1e-3)  # the rows pass's coefficient of s_j sx ||Q_j||_1 (module note)


def row_l1(q: torch.Tensor, chunk_rows: int = 8192) -> torch.Tensor:
    """||Q_j||_1 per row (fp32 [V], exact integers) of the stored bytes q = Q + 128."""
    out = torch.empty(q.shape[0], dtype=torch.float32, device=q.device)
    if q.is_meta:
        return out
    for r0 in range(0, q.shape[0], chunk_rows):
        out[r0:r0 + chunk_rows] = (q[r0:r0 + chunk_rows].int() - 128).abs().sum(1).float()
    return out


def x_integers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_x_int_kernel on torch's ops for x [R, K]: (h, l) int8 [R, K], sx fp32 [R] (NaN where a row's
    ||x||_1 is not finite: a NaN or an infinity in it, every head row then a candidate)."""
    xf = x.float()
    ax = xf.abs()
    m = ax.amax(1)
    finite = torch.isfinite(ax.sum(1))
    bits = (m / X_MAX).view(torch.int32)
    e = torch.clamp(((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).int(), min=1)
    sx, inv = (e << 23).view(torch.float32), ((254 - e) << 23).view(torch.float32)
    big = torch.where(finite[:, None], torch.round(xf * inv[:, None]), 0.0).to(torch.int32)
    lo = ((big + 64) & 127) - 64
    hi = (big - lo) >> 7
    return hi.to(torch.int8), lo.to(torch.int8), torch.where(finite, sx, math.nan)


def rows_bounds_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, q_l1: torch.Tensor,
                          c1: float) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax_rows' int8 pass on torch's ops (CPU): (a [R, V], B [R, V]) fp32, the kernels' formulas;
    the integer sums exact (int64), ||x||_1 in torch's order."""
    hi, lo, sx = x_integers(x.cpu())
    qi = q.cpu().long() - 128
    total = (hi.long() * 128 + lo.long()) @ qi.t()                     # [R, V], exact
    scale = sx.double()[:, None] * s.cpu().double()[None, :]
    approx = (total.double() * scale).float()
    l1 = x.cpu().float().abs().sum(1)
    bound = (c1 * s.cpu()[None, :] * l1[:, None] + _REL.value * approx.abs()
             + (C2 * scale * q_l1.cpu().double()[None, :]).float())
    return approx, bound


def screened_argmax_reference(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                              logits_of=None) -> tuple[torch.Tensor, int]:
    """The screen on torch's ops: (the argmax [1] int64, the candidates' count). x [1, K] bf16;
    logits_of(rows) gives the exact bf16 logits of those rows (default: fp32 sums of the bf16
    products, gemv.linear_reference). The bounds are the kernels' formulas in fp32."""
    K = x.shape[1]
    xf = x.float()
    qf = q.float() - 128.0
    approx = (xf @ qf.t())[0] * s
    bound = bound_coefficient(K) * s * xf.abs().sum() + _REL.value * approx.abs()
    tau = torch.max(approx - bound)
    cand = ~((approx + bound) < tau)
    rows = cand.nonzero().flatten()
    if logits_of is None:
        logits_of = lambda r: gemv.linear_reference(x, w[r])[0]   # noqa: E731
    vals = logits_of(rows).float()
    nan = torch.isnan(vals)
    if bool(nan.any()):
        return rows[nan][:1].clone(), int(rows.numel())
    return rows[torch.argmax(vals)].reshape(1), int(rows.numel())


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _q_values(b):
    """Q exactly (fp32), from the stored bytes Q + 128: the fp32 with bits 0x4B0000bb is 2^23 + bb, minus
    2^23 + 128 (x Q is then exact in fp32). The same time as a PRMT an element or shifts and masks in
    PTX: the conversion does not bound the pass."""
    return (b.to(tl.int32) | _MAGIC).to(tl.float32, bitcast=True) - _MAGIC_OFFSET


@triton.jit
def _approx_kernel(x_ptr, q_ptr, s_ptr, up_ptr, tau_ptr, V, c1,
                   K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                   LINES: tl.constexpr = 1):
    """up[j] = a_j + B_j for this program's BLOCK_R rows; tau <- max(tau, max_j a_j - B_j). Before the
    wait: the first LINES 128-byte lines of each row asked of L2, and the scales."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_ld = tl.minimum(rows, V - 1)
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + rows_ld.to(tl.int64)[:, None] * K + offs_k[None, :]
    pdl.prefetch_l2(q_ptr + rows_ld.to(tl.int64)[:, None] * K + (tl.arange(0, LINES) * 128)[None, :], PDL)
    s = tl.load(s_ptr + rows_ld)            # the weights' side: no kernel of the step writes it
    pdl.wait(PDL)                           # x is the previous kernel's output
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    x_abs = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        b = tl.load(q_ptrs + k, eviction_policy="evict_first")
        f = _q_values(b)
        xv = tl.load(x_ptr + k + offs_k).to(tl.float32)
        acc += f * xv[None, :]
        x_abs += tl.abs(xv)
    pdl.launch_dependents(PDL)
    approx = tl.sum(acc, axis=1) * s
    bound = c1 * s * tl.sum(x_abs, axis=0) + _REL * tl.abs(approx)
    live = rows < V
    tl.store(up_ptr + rows, approx + bound, mask=live)
    tl.atomic_max(tau_ptr, tl.max(tl.where(live, approx - bound, float("-inf")), axis=0))


@triton.jit
def _x_int_kernel(x_ptr, xi_ptr, sx_ptr, l1_ptr, K: tl.constexpr, R_PAD: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Row program_id(0) of x [R, K] as integers (module note): h into xi's row r, l into row R_PAD + r
    (int8 [2 R_PAD, K]), sx[r] (NaN where ||x_r||_1 is not finite), l1[r] = ||x_r||_1."""
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    pdl.wait(PDL)
    x = tl.load(x_ptr + r * K + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.launch_dependents(PDL)
    ax = tl.abs(x)
    m = tl.max(ax, axis=0)
    l1 = tl.sum(ax, axis=0)
    bits = libdevice.div_rn(m, 16256.0).to(tl.int32, bitcast=True)     # torch's m / X_MAX
    e = tl.maximum(((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32), 1)   # sx = 2^(e - 127)
    sx = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)                              # 1 / sx, exactly
    finite = l1 < float("inf")            # no NaN or infinity in x (tl.max passes NaN over; the sum does not)
    big = tl.where(finite, libdevice.rint(x * inv), 0.0).to(tl.int32)
    lo = ((big + 64) & 127) - 64
    hi = (big - lo) >> 7
    tl.store(xi_ptr + r * K + offs, hi.to(tl.int8), mask=mask)
    tl.store(xi_ptr + (R_PAD + r) * K + offs, lo.to(tl.int8), mask=mask)
    tl.store(sx_ptr + r, tl.where(finite, sx, float("nan")))
    tl.store(l1_ptr + r, l1)


@triton.jit
def _approx_rows_kernel(xi_ptr, sx_ptr, l1_ptr, q_ptr, s_ptr, ql1_ptr, up_ptr, tau_ptr, V, R, c1, c2,
                        K: tl.constexpr, R_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    """The int8 pass for R rows of x (R <= R_PAD) from _x_int_kernel's integers: up[r, j] = a_rj + B_rj,
    tau[r] <- max(tau[r], max_j a_rj - B_rj) (module note). Each int8 block of the head is read once,
    as one tensor-core product against [h | l] (2 R_PAD columns)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_ld = tl.minimum(rows, V - 1)
    offs_k = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 2 * R_PAD)                          # h of x's rows, then their l
    col_live = (cols % R_PAD) < R
    q_ptrs = q_ptr + rows_ld.to(tl.int64)[:, None] * K + offs_k[None, :]
    xi_ptrs = xi_ptr + cols[None, :] * K + offs_k[:, None]   # [BLOCK_K, 2 R_PAD]
    s = tl.load(s_ptr + rows_ld)                            # the weights' side: no kernel of the step writes it
    ql1 = tl.load(ql1_ptr + rows_ld)
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_R, 2 * R_PAD], dtype=tl.int32)
    for k in range(0, K, BLOCK_K):
        b = tl.load(q_ptrs + k, eviction_policy="evict_first")
        qv = (b ^ 128).to(tl.int8)                          # the byte Q + 128 back to Q (truncated: two's complement)
        xv = tl.load(xi_ptrs + k, mask=col_live[None, :], other=0)
        acc = tl.dot(qv, xv, acc, out_dtype=tl.int32)
    pdl.launch_dependents(PDL)
    weight = tl.where(cols < R_PAD, 128, 1).to(tl.int64)
    total = tl.sum(tl.reshape(acc.to(tl.int64) * weight[None, :], [BLOCK_R, 2, R_PAD]), axis=1)  # 128 H + L
    xr = tl.arange(0, R_PAD)
    x_live = xr < R
    sx = tl.load(sx_ptr + xr, mask=x_live, other=1.0)
    l1 = tl.load(l1_ptr + xr, mask=x_live, other=0.0)
    scale = s.to(tl.float64)[:, None] * sx.to(tl.float64)[None, :]
    approx = (total.to(tl.float64) * scale).to(tl.float32)
    bound = (c1 * s[:, None] * l1[None, :] + _REL * tl.abs(approx)
             + (c2 * scale * ql1.to(tl.float64)[:, None]).to(tl.float32))
    live = rows < V
    tl.store(up_ptr + xr[None, :] * V + rows[:, None], approx + bound, mask=live[:, None] & x_live[None, :])
    lower = tl.where(live[:, None], approx - bound, float("-inf"))
    tl.atomic_max(tau_ptr + xr, tl.max(lower, axis=0), mask=x_live)


@triton.jit
def _refine_kernel(x_ptr, w_ptr, up_ptr, tau_ptr, val_ptr, idx_ptr, nan_ptr, V,
                   K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                   EVEN_N: tl.constexpr, PDL: tl.constexpr = False):
    """The candidates among this program's GROUPS blocks of BLOCK_N rows for x's row program_id(1):
    their bf16 logits as gemv's one-row program computes them, the first largest and the first NaN."""
    pid = tl.program_id(0)
    row = tl.program_id(1)                 # x's row (argmax_rows: one a grid row; its own bounds and tau)
    x_ptr += row * K
    up_ptr += row * V
    tau_ptr += row
    part = row * tl.num_programs(0) + pid
    base = pid * (GROUPS * BLOCK_N)
    r = base + tl.arange(0, GROUPS * BLOCK_N)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    tau = tl.load(tau_ptr)
    up = tl.load(up_ptr + r, mask=r < V, other=float("-inf"))
    cand = ((up < tau) == 0) & (r < V)                       # a NaN bound or tau: a candidate
    flags = tl.max(tl.reshape(cand.to(tl.int32), [GROUPS, BLOCK_N]), axis=1)
    bits = tl.sum(flags << tl.arange(0, GROUPS), axis=0)      # block g a candidate: bit g
    offs_k = tl.arange(0, BLOCK_K)
    best = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    best_i = tl.max(tl.full([BLOCK_N], _NONE, tl.int32), axis=0)
    first_nan = best_i
    for g in range(GROUPS):
        if ((bits >> g) & 1) != 0:
            cols = base + g * BLOCK_N + tl.arange(0, BLOCK_N)
            cols_ld = cols if EVEN_N else tl.minimum(cols, V - 1)
            w_ptrs = w_ptr + cols_ld.to(tl.int64)[:, None] * K + offs_k[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            # gemv's one-row loop (EVEN_K: whole blocks), unrolled: every block's loads can be in flight
            # at once, each lane's sum still in increasing k (the same sums)
            for i in tl.static_range(K // BLOCK_K):
                kk = i * BLOCK_K
                w = _load_w_block(w_ptrs, kk, offs_k, K, True)
                acc = _row_fma(acc, w, x_ptr, kk, offs_k, K, True)
            logit = tl.sum(acc, axis=1).to(tl.bfloat16).to(tl.float32)
            live = cols < V
            logit = tl.where(live, logit, float("-inf"))
            first_nan = tl.minimum(first_nan, tl.min(tl.where(live & (logit != logit), cols, _NONE), axis=0))
            m = tl.max(logit, axis=0)
            at = tl.min(tl.where(logit == m, cols, _NONE), axis=0)
            # earlier blocks hold lower indices: an equal value replaces only "no index yet"
            take = (m > best) | ((m == best) & (best_i == _NONE))
            best_i = tl.where(take, at, best_i)
            best = tl.where(take, m, best)
    tl.store(val_ptr + part, best)
    tl.store(idx_ptr + part, best_i)
    tl.store(nan_ptr + part, first_nan)


@triton.jit
def _final_kernel(val_ptr, idx_ptr, nan_ptr, tau_ptr, out_ptr, PARTS, BLOCK_P: tl.constexpr,
                  PDL: tl.constexpr = False):
    row = tl.program_id(0)                 # x's row: its refine programs' results, its pick, its tau
    offs = tl.arange(0, BLOCK_P)
    mask = offs < PARTS
    val_ptr += row * PARTS
    idx_ptr += row * PARTS
    nan_ptr += row * PARTS
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    v = tl.load(val_ptr + offs, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + offs, mask=mask, other=_NONE)
    n = tl.load(nan_ptr + offs, mask=mask, other=_NONE)
    m = tl.max(v, axis=0)
    best = tl.min(tl.where((v == m) & (i < _NONE), i, _NONE), axis=0)
    first_nan = tl.min(n, axis=0)
    res = tl.where(first_nan < _NONE, first_nan, best)
    tl.store(out_ptr + row, res.to(tl.int64))
    tl.store(tau_ptr + row, float("-inf"))     # the next step's atomic max starts from nothing


# ----------------------------------------------------------------------------- the screen

def unsupported(w: torch.Tensor, plan: ScreenPlan | None = None, config: gemv.GemvConfig | None = None
                ) -> str | None:
    """Why the screen cannot run for w (None: it can); config: the one-row GEMV's (None: gemv's table)."""
    plan = plan or PLAN
    V, K = w.shape
    cfg = config or gemv.select_config(V, K, False, 1)
    if cfg.mode != "fma" or cfg.block_m != 1 or cfg.split_k != 1 or K % cfg.block_k:
        return f"the LM head's one-row GEMV config {cfg} is not a one-chunk fma config"
    if K % plan.block_k:
        return f"K={K} is not a multiple of the int8 pass's block_k {plan.block_k}"
    if V >= 2 ** 31 - 1:
        return f"{V} rows do not fit int32 indices"
    return None


class LmScreen:
    """The screen over one LM head w [V, K] (bf16, kept as it is; its int8 copy made here).
    argmax(x, out) for x [1, K]: the pick of argmax(gemv.linear(x, w, config=config)) (module
    note; config None: gemv's table's one-row config); argmax_rows(x, out) the same for each row of
    x [R, K], R <= ROWS_MAX (a speculative verify of one sequence: each row one-row decode's pick);
    graph-safe (fixed buffers, no host reads)."""

    # argmax_rows' most rows: a verify of up to 15 drafts (its int8 pass keeps 16 rows' sums in registers)
    ROWS_MAX = 16

    def __init__(self, w: torch.Tensor, plan: ScreenPlan | None = None, config: gemv.GemvConfig | None = None):
        why = unsupported(w, plan, config)
        if why is not None:
            raise ValueError(f"lm_screen: {why}")
        self.w, self.plan = w, plan or PLAN
        V, K = w.shape
        self.config = config or gemv.select_config(V, K, False, 1)
        self.q, self.s = quantize_rows(w)
        self.q_l1 = row_l1(self.q)
        self.c1 = bound_coefficient(K)
        self._buffers()

    def _buffers(self) -> None:
        """A step's buffers for this plan: the bounds, tau (-inf), the refine programs' results."""
        dev, V = self.w.device, self.w.shape[0]
        self.up = torch.empty(V, dtype=torch.float32, device=dev)
        self.tau = torch.full((1,), float("-inf"), dtype=torch.float32, device=dev)
        self.parts = triton.cdiv(V, self.plan.groups * self.config.block_n)
        self.val = torch.empty(self.parts, dtype=torch.float32, device=dev)
        self.idx = torch.empty(self.parts, dtype=torch.int32, device=dev)
        self.nan = torch.empty(self.parts, dtype=torch.int32, device=dev)
        self.rows_buffers = None           # argmax_rows' (ROWS_MAX rows), made at its first call

    def _rows_buffers(self) -> tuple:
        """argmax_rows' buffers, made once (a captured graph keeps their addresses): ROWS_MAX rows'
        bounds, taus (-inf) and refine results, then x's integers (h and l), scales and norms."""
        if self.rows_buffers is None:
            dev, (V, K), R = self.w.device, self.w.shape, self.ROWS_MAX
            self.rows_buffers = (torch.empty((R, V), dtype=torch.float32, device=dev),
                                 torch.full((R,), float("-inf"), dtype=torch.float32, device=dev),
                                 torch.empty((R, self.parts), dtype=torch.float32, device=dev),
                                 torch.empty((R, self.parts), dtype=torch.int32, device=dev),
                                 torch.empty((R, self.parts), dtype=torch.int32, device=dev),
                                 torch.empty((2 * R, K), dtype=torch.int8, device=dev),
                                 torch.empty(R, dtype=torch.float32, device=dev),
                                 torch.empty(R, dtype=torch.float32, device=dev))
        return self.rows_buffers

    def with_plan(self, plan: ScreenPlan) -> "LmScreen":
        """The same screen (the int8 copy shared) launched by another plan, with buffers of its own."""
        other = object.__new__(LmScreen)
        other.__dict__.update(self.__dict__)
        other.plan = plan
        other._buffers()
        return other

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.q_l1, self.up, self.val, self.idx,
                                                           self.nan))

    def approx(self, x: torch.Tensor, up: torch.Tensor, tau: torch.Tensor, use_pdl: bool = False,
               launch: dict | None = None) -> None:
        """The int8 pass alone: up <- the rows' upper bounds, tau <- max(tau, the largest lower bound)."""
        V, K = self.w.shape
        plan = self.plan
        _approx_kernel[(triton.cdiv(V, plan.rows),)](
            x, self.q, self.s, up, tau, V, self.c1, K=K, BLOCK_R=plan.rows, BLOCK_K=plan.block_k,
            PDL=use_pdl, LINES=max(1, plan.block_k // 128), num_warps=plan.warps, num_stages=plan.stages,
            **(launch or {}))

    def candidates_for(self, x: torch.Tensor) -> int:
        """The count of candidate rows for x [1, K] (runs the int8 pass again)."""
        tau = torch.full((1,), float("-inf"), dtype=torch.float32, device=x.device)
        up = torch.empty(self.w.shape[0], dtype=torch.float32, device=x.device)
        self.approx(x, up, tau)
        return int((~(up < tau)).sum())

    def argmax(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        V, K = self.w.shape
        if x.dim() != 2 or tuple(x.shape) != (1, K) or x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise ValueError(f"lm_screen: x must be a contiguous bf16 [1, {K}], got {x.dtype} {tuple(x.shape)}")
        if out is None:
            out = torch.empty(1, dtype=torch.int64, device=x.device)
        elif out.dtype != torch.int64 or tuple(out.shape) != (1,):
            raise ValueError(f"lm_screen: out must be int64 of shape (1,), got {out.dtype} {tuple(out.shape)}")
        use_pdl, launch = pdl.for_rows(1)
        self.approx(x, self.up, self.tau, use_pdl, launch)
        self._refine(x, 1, self.up, self.tau, self.val, self.idx, self.nan, out, use_pdl, launch)
        return out

    def argmax_rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """argmax for each row of x [R, K] (1 <= R <= ROWS_MAX) -> int64 [R]: one int8 pass for all
        rows, then each row's candidates refined as argmax refines them (the same picks)."""
        V, K = self.w.shape
        if (x.dim() != 2 or not 1 <= x.shape[0] <= self.ROWS_MAX or x.shape[1] != K or x.dtype != torch.bfloat16
                or not x.is_contiguous() or K % ROWS_BLOCK_K):
            raise ValueError(f"lm_screen: x must be a contiguous bf16 [R, {K}] with 1 <= R <= {self.ROWS_MAX} "
                             f"(K a multiple of {ROWS_BLOCK_K}), got {x.dtype} {tuple(x.shape)}")
        R = x.shape[0]
        if out is None:
            out = torch.empty(R, dtype=torch.int64, device=x.device)
        elif out.dtype != torch.int64 or tuple(out.shape) != (R,):
            raise ValueError(f"lm_screen: out must be int64 of shape ({R},), got {out.dtype} {tuple(out.shape)}")
        if R == 1:
            return self.argmax(x, out)
        up, tau, val, idx, nan, xi, sx, l1 = self._rows_buffers()
        use_pdl, launch = pdl.for_rows(1)
        _x_int_kernel[(R,)](x, xi, sx, l1, K=K, R_PAD=self.ROWS_MAX, BLOCK=triton.next_power_of_2(K),
                            PDL=use_pdl, num_warps=4, **launch)
        _approx_rows_kernel[(triton.cdiv(V, ROWS_BLOCK_R),)](
            xi, sx, l1, self.q, self.s, self.q_l1, up, tau, V, R, self.c1, C2, K=K, R_PAD=self.ROWS_MAX,
            BLOCK_R=ROWS_BLOCK_R, BLOCK_K=ROWS_BLOCK_K, PDL=use_pdl, num_warps=4, num_stages=3, **launch)
        self._refine(x, R, up, tau, val, idx, nan, out, use_pdl, launch)
        return out

    def _refine(self, x, R: int, up, tau, val, idx, nan, out, use_pdl: bool, launch: dict) -> None:
        """The refine and final kernels for x's R rows (bounds up [R, V], taus [R]): out [R] the picks,
        the taus back to -inf."""
        V, K = self.w.shape
        plan, cfg = self.plan, self.config
        _refine_kernel[(self.parts, R)](
            x, self.w, up, tau, val, idx, nan, V, K=K, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUPS=plan.groups, EVEN_N=V % cfg.block_n == 0, PDL=use_pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)
        _final_kernel[(R,)](val, idx, nan, tau, out, self.parts,
                            BLOCK_P=max(16, triton.next_power_of_2(self.parts)), PDL=use_pdl, num_warps=4, **launch)


# _approx_rows_kernel's tile: head rows a program and K a loop trip (argmax_rows needs K a multiple
# of it); an int8 tensor-core product of [BLOCK_R, BLOCK_K] against [BLOCK_K, 2 ROWS_MAX].
ROWS_BLOCK_R = 128
ROWS_BLOCK_K = 256


def for_model(w: torch.Tensor) -> LmScreen | None:
    """The screen for a model's LM head on a CUDA device where it is supported, else None."""
    if w.device.type != "cuda" or unsupported(w) is not None:
        return None
    return LmScreen(w)
