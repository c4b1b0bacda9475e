"""Qwen3.5's GDN prompt pass on the GPU: the kernels a multi-token forward runs for a GDN layer.

  causal_conv_prefill   the short causal conv + SiLU over a prompt (from zeros, or from a
                        continued sequence's conv state)
  gates                 g and beta of every position, one kernel
  chunked_prefill       the gated delta rule over the prompt in chunks of 64, as three kernels
                        (the solve, the state walk, the outputs), launched by a PrefillPlan

The conv and the gates have the cast points of the references in gdn_ref (conv output and SiLU
rounded to bf16, beta = bf16(sigmoid(b)), g in fp32). The chunked rule keeps the state in fp32
and rounds the outputs to bf16 once, but sums in its own orders on tensor cores (the notes
above the kernels), so it is not the reference's rule bit for bit: tests/kernels/test_gdn_kernels.py
holds it to the float64 oracle; why the prompt pass is not bit-exact and what that costs:
docs/NUMERICS.md; the plans' measurements: docs/PERFORMANCE.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fqkernels.device import sm_count
from fqkernels.gdn_ref import CHUNK
from fqkernels.gdn_step import _gate_values
from fqkernels.swiglu import silu_f32


@triton.jit
def _conv_prefill_kernel(u_ptr, conv_w_ptr, x_ptr, T, C, stride_ub, stride_ut, stride_xb, stride_xt,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
                         state_ptr=None, stride_sb=None, stride_sc=None, HAS_STATE: tl.constexpr = False):
    """One program per (sequence, BLOCK_T positions, BLOCK_C channels) of a prompt: out =
    bf16(silu(bf16(sum_j w_j u_{t-W+1+j}))), zeros before position 0 (HAS_STATE: the conv
    state's inputs there, state[b, c, W + t'] for t' < 0, a continued sequence), the products
    summed in fp32 in window order (as the step kernel and the reference's depthwise conv)."""
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j
        ok = ((src >= 0) & (src < T))[:, None] & c_ok[None, :]
        uj = tl.load(u_ptr + b * stride_ub + src[:, None] * stride_ut + c[None, :], mask=ok, other=0.0)
        if HAS_STATE:
            before = (src < 0)[:, None] & c_ok[None, :]
            sj = tl.load(state_ptr + b * stride_sb + c[None, :] * stride_sc + (W + src)[:, None], mask=before, other=0.0)
            uj = tl.where(before, sj, uj)
        acc += tl.load(conv_w_ptr + c * W + j, mask=c_ok, other=0.0).to(tl.float32)[None, :] * uj.to(tl.float32)
    conv = acc.to(tl.bfloat16).to(tl.float32)
    tl.store(x_ptr + b * stride_xb + t[:, None] * stride_xt + c[None, :], silu_f32(conv, INTERPRETED).to(tl.bfloat16),
             mask=(t < T)[:, None] & c_ok[None, :])


def causal_conv_prefill(u: torch.Tensor, conv_w: torch.Tensor, block_t: int = 32, block_c: int = 128,
                        num_warps: int = 4, conv_state: torch.Tensor | None = None):
    """A prompt's causal conv + SiLU as one kernel: u [B, T, C] bf16, position-major (in_proj's
    output; channels need unit stride), conv_w [C, W] bf16; conv_state [B, C, W] (unit stride
    on W): the last W inputs before u (a sequence continued), else zeros before position 0.
    Returns (x [B, T, C] bf16, the conv state [B, C, W]: the last W inputs, zeros on the left
    when fewer have been seen), what causal_conv_reference returns on u transposed."""
    B, T, C = u.shape
    W = conv_w.shape[1]
    if tuple(conv_w.shape) != (C, W) or u.stride(2) != 1 or T < 1:
        raise ValueError(f"gdn_prefill.causal_conv_prefill: u {tuple(u.shape)} (strides {u.stride()}) and conv_w "
                         f"{tuple(conv_w.shape)} do not fit")
    if conv_state is not None and (tuple(conv_state.shape) != (B, C, W) or conv_state.stride(2) != 1
                                   or conv_state.dtype != u.dtype):
        raise ValueError(f"gdn_prefill.causal_conv_prefill: conv_state must be {u.dtype} {(B, C, W)} with unit stride on W, "
                         f"got {conv_state.dtype} {tuple(conv_state.shape)} (strides {conv_state.stride()})")
    conv_w = conv_w.contiguous()
    x = torch.empty((B, T, C), dtype=u.dtype, device=u.device)
    prior = {} if conv_state is None else dict(state_ptr=conv_state, stride_sb=conv_state.stride(0),
                                               stride_sc=conv_state.stride(1), HAS_STATE=True)
    _conv_prefill_kernel[(B, triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
        u, conv_w, x, T, C, u.stride(0), u.stride(1), x.stride(0), x.stride(1), W=W, BLOCK_T=block_t,
        BLOCK_C=block_c, INTERPRETED=_INTERPRETED, num_warps=num_warps, **prior)
    if conv_state is None:
        state = F.pad(u[:, -W:].transpose(1, 2), (max(W - T, 0), 0)).contiguous()
    else:
        state = torch.cat([conv_state, u[:, -W:].transpose(1, 2)], dim=-1)[..., -W:]
    return x, state


@triton.jit
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, R, stride_ar,
                  HV: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRETED: tl.constexpr):
    """One program per BLOCK_R rows of a prompt's gates (_gate_values); a and b rows stride_ar
    apart (columns of a packed projection), g and beta written contiguous."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, HV)
    ok = (r < R)[:, None]
    src = r.to(tl.int64)[:, None] * stride_ar + h[None, :]
    g, beta = _gate_values(tl.load(a_ptr + src, mask=ok, other=0.0).to(tl.float32),
                           tl.load(b_ptr + src, mask=ok, other=0.0).to(tl.float32),
                           tl.load(a_log_ptr + h).to(tl.float32)[None, :], tl.load(dt_bias_ptr + h).to(tl.float32)[None, :],
                           INTERPRETED)
    dst = r.to(tl.int64)[:, None] * HV + h[None, :]
    tl.store(g_ptr + dst, g, mask=ok)
    tl.store(beta_ptr + dst, beta, mask=ok)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, block_r: int = 64):
    """gates_reference as one kernel: a, b [..., Hv] bf16 (any row stride, unit column stride,
    the same strides: e.g. column slices of in_proj's packed output), a_log, dt_bias [Hv] bf16.
    Returns (g fp32, beta bf16), both [..., Hv] contiguous."""
    Hv = a.shape[-1]
    if a.shape != b.shape or tuple(a_log.shape) != (Hv,) or tuple(dt_bias.shape) != (Hv,) or Hv & (Hv - 1):
        raise ValueError(f"gdn_prefill.gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(a_log.shape)}, dt_bias "
                         f"{tuple(dt_bias.shape)} (heads a power of two)")
    lead = a.shape[:-1]
    a2, b2 = a.reshape(-1, Hv), b.reshape(-1, Hv)         # views for a packed product's column slices
    if a2.stride(-1) != 1 or a2.stride() != b2.stride():
        a2, b2 = a2.contiguous(), b2.contiguous()
    R = a2.shape[0]
    g = torch.empty((R, Hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((R, Hv), dtype=torch.bfloat16, device=a.device)
    _gates_kernel[(triton.cdiv(R, block_r),)](a2, b2, a_log, dt_bias, g, beta, R, a2.stride(0), HV=Hv, BLOCK_R=block_r,
                                              INTERPRETED=_INTERPRETED, num_warps=4)
    return g.view(*lead, Hv), beta.view(*lead, Hv)



# ------------------------------------------------------------------ chunked prefill kernels
# The chunked rule of delta_rule_chunked_reference in three kernels, from a zero state (a
# fresh prompt).
#
# _chunk_solve_kernel, one program per (sequence, value head, chunk): the chunk's unit-lower
# system M = I + A (A_ij = beta_i k_i.k_j e^(gamma_i - gamma_j), j < i) is inverted by blocks
# of 16: the four diagonal blocks by forward substitution, all four at once (15 steps, not
# 63), then M^-1 = (I - N + N^2 - N^3) D^-1 with D the block diagonal and N = D^-1 (M - D),
# strictly block-lower, so N^4 = 0 (three terms, never a long power series, which loses
# everything when a key repeats); or (PrefillPlan.form "merged", the default on Triton 3.6) the
# diagonal blocks' inverses merged pairwise, 16 -> 32 -> 64. Then u = M^-1 (beta v) and
# w = M^-1 (beta k e^gamma) ("uw"), or P = M^-1 diag(beta) alone ("inverse", "merged").
# _chunk_state_kernel, one program per (block of value columns, sequence, value head), the
# only sequential part: walks the chunks in order carrying S [Dk, BV] (as two Dk halves), with
# two products a chunk (v_new = u - w S, then S <- e^gamma_last S + k_decayed^T v_new; from P,
# v_new = P (v - diag(rk e^gamma) k_raw S), one product more), and keeps each chunk's starting
# state and v_new (in u's place) and the final state.
# _chunk_out_kernel, one program per (sequence, value head, chunk, block of value columns):
# o = (q e^gamma) S_chunk + (q k^T (.) decay, causal) v_new, from what the state kernel kept.
# (The last two as one kernel, each chunk's outputs formed while the walk holds its starting
# state, measured no faster: docs/PERFORMANCE.md.)
#
# Precision: fp32 throughout the solve and state kernels (u, w, the chunks' states, the final
# state), on tensor cores in two ways; the output kernel's two products with an fp32 operand
# on bf16 pairs (third point below).
# - A product with one operand that is exact as loaded in bf16 (the raw keys, queries and
#   values, before their l2 norms and gates, which become per-row or per-column factors
#   applied to the other operand or to the result) needs no split of that operand: in the
#   solve kernel the fp32 one becomes three bf16 parts whose sum is exactly it
#   (_bf16_thirds), three bf16 products, each exact in the fp32 accumulator
#   (_dot_f32_bf16); in the state and output kernels the bf16 one is exact in TF32, so two
#   TF32 products of the other's head and rest (_dot_tf32_exact). The key-key and query-key
#   products are one bf16 product of the raw rows.
# - A product of two fp32 operands (the solve's block products, w S, attn v_new) runs as
#   three TF32 products (_dot3: each operand split into its TF32 head and the rest; about
#   fp32's accuracy, far from TF32's). Written out rather than Triton's
#   input_precision="tf32x3", which the platform's Triton 3.1 fails to compile here.
# - The output kernel's q S_chunk and attn v_new (PrefillPlan.out_prec "bf16x2", the default):
#   each fp32 operand as two bf16 parts (hi + mid, ~16 significant bits), the products exact
#   in the fp32 accumulator (_dot_bf16_pair). Its sums are rounded to bf16 (8 bits) right
#   after and nothing else reads them, so an output moves at most one bf16 step from the
#   three-pass TF32 form ("tf32x3"), at half the kernel's time (docs/PERFORMANCE.md).
# Keeping the bf16 operands as loaded also halves their registers: with every operand in
# fp32 and split, ptxas for sm_90 gave each kernel 255 registers and 1-1.5 KB of spills a
# thread. Gated against the float64 oracle in tests/kernels/test_gdn_kernels.py; the timing
# beside flash-linear-attention is `python -m bench gdn` ("tf32": one TF32 product in _dot3,
# for that comparison only).
# Tokens per call of the kernels: u (then v_new), w and the chunks' starting states are fp32
# workspaces of 2 KiB per token and value head (1 GiB for 16K tokens of 32 heads), so longer
# batches run in slices of whole sequences (peak memory stays bounded).
_TOKENS_PER_SLICE = 16384


@triton.jit
def _tf32_head(x):
    """x's TF32 part (sign, exponent, the top 10 mantissa bits): x - head is exact in fp32."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _dot3(a, b, PREC: tl.constexpr):
    """a @ b for fp32 a, b on tensor cores: with PREC "tf32x3", head.head + head.rest + rest.head
    (the small terms first); "bf16x2": both as bf16 pairs (_dot_bf16_pair, ~16 bits); "bf16x3":
    both as bf16 thirds (_dot_bf16_thirds, about fp32); else one product at that precision."""
    if PREC == "bf16x2":
        return _dot_bf16_pair(a, b, False)
    elif PREC == "bf16x3":
        return _dot_bf16_thirds(a, b)
    elif PREC == "tf32x3":
        a_hi = _tf32_head(a)
        b_hi = _tf32_head(b)
        acc = tl.dot(a - a_hi, b_hi, input_precision="tf32")
        acc = tl.dot(a_hi, b - b_hi, acc, input_precision="tf32")
        return tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _bf16_thirds(x):
    """fp32 x as three bf16 parts, hi + mid + lo == x exactly (8 + 8 + 8 significant bits;
    each remainder is exact in fp32)."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_f32_bf16(a, b, PREC: tl.constexpr):
    """a @ b for fp32 a and bf16 b, to fp32's precision on bf16 tensor cores: a's three bf16
    parts times b, each product exact, the small parts first (PREC "bf16x2": a's two parts,
    ~16 bits)."""
    if PREC == "bf16x2":
        hi, mid = _bf16_pair(a)
        return tl.dot(hi, b, tl.dot(mid, b))
    hi, mid, lo = _bf16_thirds(a)
    acc = tl.dot(lo, b)
    acc = tl.dot(mid, b, acc)
    return tl.dot(hi, b, acc)


@triton.jit
def _dot_tf32_exact(a, b):
    """a @ b for fp32 a whose every element is exact in TF32 (a bf16 value converted) and fp32 b,
    to about fp32's precision: b's TF32 head and the rest, two TF32 products (a's own rest is
    zero). Not bf16 thirds of b: Triton 3.6 on sm_90 faulted (illegal address) on a product
    whose bf16 right operand, computed in registers, is 32 columns wide."""
    b_hi = _tf32_head(b)
    acc = tl.dot(a, b - b_hi, input_precision="tf32")
    return tl.dot(a, b_hi, acc, input_precision="tf32")


@triton.jit
def _bf16_pair(x):
    """fp32 x as two bf16 parts, hi + mid, within 2^-17 of x relative (16 significant bits)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_bf16_pair(a, b, A_EXACT: tl.constexpr):
    """a @ b for fp32 b, and a either bf16 (A_EXACT: as loaded, exact) or fp32, on bf16 tensor
    cores to about 16 significant bits: b's two bf16 parts (and a's: hi.hi + hi.mid + mid.hi),
    each product exact in the fp32 accumulator, the small terms first. For the output kernel
    only (its results are rounded to bf16, 8 bits): the state never takes it."""
    b_hi, b_mid = _bf16_pair(b)
    if A_EXACT:
        acc = tl.dot(a, b_mid)
        return tl.dot(a, b_hi, acc)
    a_hi, a_mid = _bf16_pair(a)
    acc = tl.dot(a_mid, b_hi)
    acc = tl.dot(a_hi, b_mid, acc)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def _dot_bf16_exact_left(a, b):
    """a @ b for bf16 a (exact as loaded) and fp32 b, to about fp32's precision: b's three bf16
    parts, three products each exact in the fp32 accumulator, the small parts first."""
    b1, b2, b3 = _bf16_thirds(b)
    return tl.dot(a, b1, tl.dot(a, b2, tl.dot(a, b3)))


@triton.jit
def _dot_bf16_thirds(a, b):
    """a @ b for fp32 a and b on bf16 tensor cores to about fp32's precision: each as three bf16
    parts (_bf16_thirds), the six products whose parts' orders sum to at most 2 (hi.lo, mid.mid,
    lo.hi, hi.mid, mid.hi, hi.hi: the neglected ones are below 2^-24 of the sum), each exact in
    the fp32 accumulator, the small terms first. Six bf16 products take the tensor cores' time
    of three TF32 ones (the TF32 rate is half bf16's); against _dot3's three TF32 passes, the
    left operand's parts stay in registers (Triton 3.6 puts both of a tf32 product's operands in
    shared memory for sm_90a), so a product holds 24 KiB of shared memory at 64 x 64 instead of 64."""
    a1, a2, a3 = _bf16_thirds(a)
    b1, b2, b3 = _bf16_thirds(b)
    acc = tl.dot(a1, b3)
    acc = tl.dot(a2, b2, acc)
    acc = tl.dot(a3, b1, acc)
    acc = tl.dot(a1, b2, acc)
    acc = tl.dot(a2, b1, acc)
    return tl.dot(a1, b1, acc)


@triton.jit
def _inv_norm(x):
    """rsqrt(sum of squares + 1e-6) of each row of bf16 x, in fp32 (gdn_ref.l2_normalize's factor)."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)


@triton.jit
def _chunk_solve_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, gamma_ptr, rk_ptr, T, NC,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_gb, stride_gt,
                        HV: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr,
                        p_ptr=None, INVERSE: tl.constexpr = False, MERGED: tl.constexpr = False):
    """INVERSE (PrefillPlan.form "inverse" or "merged"): the chunk's P = M^-1 diag(beta), fp32
    [C, C], to p_ptr, for the state kernel to form v_new from (v, u_ptr and w_ptr unused); else u
    and w. MERGED (form "merged", C = 64, with INVERSE): M^-1 from the diagonal blocks' inverses
    merged pairwise, else from the four [C, C] products of the power form."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = pid // HV
    hv = pid % HV
    r = tl.arange(0, C)
    t = c * C + r
    ok = t < T
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    k_rows = k_ptr + b * stride_kb + t[:, None] * stride_kt + (hv // RATIO) * stride_kh + dk[None, :]
    k = tl.load(k_rows, mask=ok[:, None], other=0.0)             # raw bf16 keys
    rk = _inv_norm(k)
    beta = tl.load(beta_ptr + b * stride_gb + t * stride_gt + hv, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + t * stride_gt + hv, mask=ok, other=0.0)
    gamma = tl.cumsum(g, axis=0)                                  # log decay from the chunk's start
    # Everything below on transposes (at = A^T, x = (D^-1)^T): a tile's rows stay in one warp,
    # so the substitution's sums run along rows, within warps, with no block-wide barrier.
    # at[i, j] = beta_j (k_j . k_i) e^(gamma_j - gamma_i), i < j: the raw keys' product, then
    # both norms and the gate as factors.
    at = tl.where(r[:, None] < r[None, :],
                  tl.dot(k, tl.trans(k)) * (rk[:, None] * (rk * beta)[None, :]) * tl.exp(gamma[None, :] - gamma[:, None]),
                  0.0)
    # D^-1 by rows (x by columns), on the diagonal blocks alone as [blocks, 16, 16] tiles
    # (at3[b] = at's block b): step i finishes row i of every block,
    # D^-1_i = e_i - sum_{j<i} A_ij D^-1_j (rows j < i of the block are final), so column i of
    # xt3[b] takes sum_j at3[b, j, i] xt3[b, :, j]. On the whole [C, C] tile (zeros outside the
    # blocks) the 15 steps were over half the kernel's time; on the blocks alone the kernel takes
    # about half as long, the same sums (docs/PERFORMANCE.md).
    same = (r[:, None] // 16) == (r[None, :] // 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    blk = tl.arange(0, C // 16)
    e16 = tl.arange(0, 16)
    diag4 = blk[:, None, None, None] == blk[None, None, :, None]
    at3 = tl.sum(tl.where(diag4, tl.reshape(at, [C // 16, 16, C // 16, 16]), 0.0), axis=2)
    xt3 = tl.where(e16[None, :, None] == e16[None, None, :], 1.0, 0.0) + tl.zeros([C // 16, 16, 16], dtype=tl.float32)
    for i in range(1, 16):
        coef = tl.sum(tl.where(e16[None, None, :] == i, at3, 0.0), axis=2)          # [blocks, 16] over j
        upd = tl.sum(xt3 * coef[:, None, :], axis=2)                                 # [blocks, 16] over columns
        xt3 = tl.where(e16[None, None, :] == i, xt3 - upd[:, :, None], xt3)
    base = (pid * NC + c).to(tl.int64) * C
    if MERGED:
        # Y = (M^T)^-1, block upper, merged from the diagonal blocks' inverses pairwise, 16 -> 32
        # -> 64: [[P, Q], [0, R]]^-1 = [[P^-1, -P^-1 Q R^-1], [0, R^-1]], two 16-block products
        # a pair and two 32-block ones (~13x fewer multiply-adds than the four [C, C] products
        # below). The blocks are cut and put together through the chunk's own P slot at p_ptr
        # (each barrier orders one stage's stores before the next stage's loads).
        pt = p_ptr + base * C
        e32 = tl.arange(0, 32)
        tl.store(pt + r[:, None] * C + r[None, :], at)
        tl.debug_barrier()
        a01 = tl.load(pt + e16[:, None] * C + (16 + e16)[None, :])
        a23 = tl.load(pt + (32 + e16)[:, None] * C + (48 + e16)[None, :])
        a_ab = tl.load(pt + e32[:, None] * C + (32 + e32)[None, :])
        tl.debug_barrier()
        y00 = tl.sum(tl.where(blk[:, None, None] == 0, xt3, 0.0), axis=0)
        y11 = tl.sum(tl.where(blk[:, None, None] == 1, xt3, 0.0), axis=0)
        y22 = tl.sum(tl.where(blk[:, None, None] == 2, xt3, 0.0), axis=0)
        y33 = tl.sum(tl.where(blk[:, None, None] == 3, xt3, 0.0), axis=0)
        zero = tl.zeros([16, 16], dtype=tl.float32)
        tl.store(pt + e16[:, None] * C + e16[None, :], y00)
        tl.store(pt + e16[:, None] * C + (16 + e16)[None, :], -_dot3(_dot3(y00, a01, PREC), y11, PREC))
        tl.store(pt + (16 + e16)[:, None] * C + e16[None, :], zero)
        tl.store(pt + (16 + e16)[:, None] * C + (16 + e16)[None, :], y11)
        tl.store(pt + (32 + e16)[:, None] * C + (32 + e16)[None, :], y22)
        tl.store(pt + (32 + e16)[:, None] * C + (48 + e16)[None, :], -_dot3(_dot3(y22, a23, PREC), y33, PREC))
        tl.store(pt + (48 + e16)[:, None] * C + (32 + e16)[None, :], zero)
        tl.store(pt + (48 + e16)[:, None] * C + (48 + e16)[None, :], y33)
        tl.store(pt + (32 + e32)[:, None] * C + e32[None, :], tl.zeros([32, 32], dtype=tl.float32))
        tl.debug_barrier()
        y_aa = tl.load(pt + e32[:, None] * C + e32[None, :])
        y_bb = tl.load(pt + (32 + e32)[:, None] * C + (32 + e32)[None, :])
        tl.store(pt + e32[:, None] * C + (32 + e32)[None, :], -_dot3(_dot3(y_aa, a_ab, PREC), y_bb, PREC))
        tl.debug_barrier()
        m_inv = tl.load(pt + r[None, :] * C + r[:, None])           # Y^T, read transposed
        tl.debug_barrier()
    else:
        x = tl.reshape(tl.where(diag4, tl.broadcast_to(xt3[:, :, None, :], [C // 16, 16, C // 16, 16]), 0.0),
                       [C, C])
        # M^-1 = (I - N)(I + N^2) D^-1 with N = D^-1 L (L: A off the diagonal blocks), transposed:
        # N^T = L^T x, and (M^-1)^T = x (I + N^T N^T) (I - N^T).
        nt = _dot3(tl.where(same, 0.0, at), x, PREC)
        m_inv = tl.trans(_dot3(_dot3(x, eye + _dot3(nt, nt, PREC), PREC), eye - nt, PREC))
    if INVERSE:
        tl.store(p_ptr + (base + r)[:, None] * C + r[None, :], m_inv * beta[None, :])
    else:
        # u = M^-1 diag(beta) v and w = M^-1 diag(beta rk e^gamma) k_raw: the factors on M^-1's
        # columns, the raw bf16 rows the exact operand
        v = tl.load(v_ptr + b * stride_vb + t[:, None] * stride_vt + hv * stride_vh + dv[None, :],
                    mask=ok[:, None], other=0.0)
        u = _dot_f32_bf16(m_inv * beta[None, :], v, PREC)
        tl.store(u_ptr + (base + r)[:, None] * DV + dv[None, :], u)
        w = _dot_f32_bf16(m_inv * (beta * rk * tl.exp(gamma))[None, :], k, PREC)
        tl.store(w_ptr + (base + r)[:, None] * DK + dk[None, :], w)
    tl.store(gamma_ptr + base + r, gamma)
    tl.store(rk_ptr + base + r, rk)


@triton.jit
def _initial_halves(init_ptr, stride_ib, b, hv, d0, d1, dv, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                    HAS_INIT: tl.constexpr):
    """The walk's starting state as its two Dk halves [Dk/2, BV]: sequence b's head hv of the fp32
    states at init_ptr ([B, Hv, Dk, Dv], rows stride_ib apart), or zeros (a fresh prompt)."""
    if HAS_INIT:
        src = init_ptr + b.to(tl.int64) * stride_ib + hv * DK * DV
        return tl.load(src + d0[:, None] * DV + dv[None, :]), tl.load(src + d1[:, None] * DV + dv[None, :])
    return tl.zeros([DK // 2, BV], dtype=tl.float32), tl.zeros([DK // 2, BV], dtype=tl.float32)


@triton.jit
def _dot_exact_left(a, b, PREC: tl.constexpr):
    """a @ b for bf16 a (raw keys, exact as loaded) and fp32 b in the state kernel's form: PREC
    "bf16x2" b's bf16 pair, "bf16x3" b's bf16 thirds, else two TF32 passes (_dot_tf32_exact)."""
    if PREC == "bf16x2":
        return _dot_bf16_pair(a, b, True)
    elif PREC == "bf16x3":
        return _dot_bf16_exact_left(a, b)
    else:
        return _dot_tf32_exact(a.to(tl.float32), b)


@triton.jit
def _chunk_state_kernel(k_ptr, u_ptr, w_ptr, gamma_ptr, rk_ptr, h_ptr, state_ptr, T, NC,
                        stride_kb, stride_kt, stride_kh, stride_sb,
                        HV: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                        init_ptr=None, stride_ib=None, HAS_INIT: tl.constexpr = False,
                        p_ptr=None, v_ptr=None, stride_vb=None, stride_vt=None, stride_vh=None,
                        INVERSE: tl.constexpr = False):
    """The state's Dk rows kept as two halves and every product taken over one half of Dk at
    a time: each operand tile is half the size, so fewer registers are live at once (with the
    whole Dk in one tile ptxas for sm_90 spilled ~1.2 KB a thread and the kernel ran over twice
    as long; docs/PERFORMANCE.md). Sums over Dk run as two half sums, added. The keys'
    norms come from the solve kernel (rk). The grid is (value blocks, sequence x value head):
    a head's blocks launch side by side, so the tiles they all read (keys, w or P) come from L2
    after the first. HAS_INIT: the walk starts from the state at init_ptr (a continued
    sequence), else from zeros.
    Two forms (PrefillPlan.form). "uw": v_new = u - w S from the solve's u and w (fp32, 1 KiB a
    token and value head at Dk = Dv = 128), the keys loaded transposed ([Dk/2, C] tiles, only
    ever the update's operand). INVERSE ("inverse"): v_new = P y with P = M^-1 diag(beta) (fp32
    [C, C], 256 bytes a token) and y = v - diag(rk e^gamma) (k_raw S), the raw bf16 keys and
    values read here: the same sum (u - w S = M^-1 diag(beta) (v - diag(rk e^gamma) k_raw S)),
    a quarter fewer bytes a chunk at 32 value columns, one more product (k_raw S, its left
    operand exact) in the chain."""
    v0 = tl.program_id(0) * BV
    pid = tl.program_id(1)
    b = pid // HV
    hv = pid % HV
    DH: tl.constexpr = DK // 2
    r = tl.arange(0, C)
    d0 = tl.arange(0, DH)
    d1 = DH + tl.arange(0, DH)
    dv = v0 + tl.arange(0, BV)
    s0, s1 = _initial_halves(init_ptr, stride_ib, b, hv, d0, d1, dv, DK, DV, BV, HAS_INIT)
    for c in range(NC):
        t = c * C + r
        chunk = pid * NC + c
        base = chunk.to(tl.int64) * C
        gamma = tl.load(gamma_ptr + base + r)
        last = tl.sum(tl.where(r == C - 1, gamma, 0.0), axis=0)
        rk = tl.load(rk_ptr + base + r)
        hrow = chunk.to(tl.int64) * DK
        tl.store(h_ptr + (hrow + d0)[:, None] * DV + dv[None, :], s0)          # S at the chunk's start
        tl.store(h_ptr + (hrow + d1)[:, None] * DV + dv[None, :], s1)
        if INVERSE:
            rows = k_ptr + b * stride_kb + t[:, None] * stride_kt + (hv // RATIO) * stride_kh
            k0 = tl.load(rows + d0[None, :], mask=(t < T)[:, None], other=0.0)    # raw bf16 keys, [C, DH]
            k1 = tl.load(rows + d1[None, :], mask=(t < T)[:, None], other=0.0)
            v = tl.load(v_ptr + b * stride_vb + t[:, None] * stride_vt + hv * stride_vh + dv[None, :],
                        mask=(t < T)[:, None], other=0.0)
            ks = _dot_exact_left(k0, s0, PREC)
            ks += _dot_exact_left(k1, s1, PREC)
            y = v.to(tl.float32) - (rk * tl.exp(gamma))[:, None] * ks
            pm = tl.load(p_ptr + (base + r)[:, None] * C + r[None, :])
            v_new = _dot3(pm, y, PREC)
            k0t = tl.trans(k0)
            k1t = tl.trans(k1)
        else:
            cols = k_ptr + b * stride_kb + t[None, :] * stride_kt + (hv // RATIO) * stride_kh
            k0t = tl.load(cols + d0[:, None], mask=(t < T)[None, :], other=0.0)      # raw bf16 keys, [DH, C]
            k1t = tl.load(cols + d1[:, None], mask=(t < T)[None, :], other=0.0)
            w0 = tl.load(w_ptr + (base + r)[:, None] * DK + d0[None, :])
            ws = _dot3(w0, s0, PREC)
            w1 = tl.load(w_ptr + (base + r)[:, None] * DK + d1[None, :])
            ws += _dot3(w1, s1, PREC)
            v_new = tl.load(u_ptr + (base + r)[:, None] * DV + dv[None, :]) - ws
        tl.store(u_ptr + (base + r)[:, None] * DV + dv[None, :], v_new)
        # S <- e^gamma_last S + k_raw^T diag(scale) v_new, scale the l2 norm of the whole row and
        # the decay to the chunk's end: the row factor on v_new, the raw keys exact
        carry = tl.exp(last)
        vs = v_new * (rk * tl.exp(last - gamma))[:, None]
        s0 = s0 * carry + _dot_exact_left(k0t, vs, PREC)
        s1 = s1 * carry + _dot_exact_left(k1t, vs, PREC)
    out = state_ptr + b * stride_sb + hv * DK * DV
    tl.store(out + d0[:, None] * DV + dv[None, :], s0)
    tl.store(out + d1[:, None] * DV + dv[None, :], s1)


@triton.jit
def _chunk_out_kernel(q_ptr, k_ptr, vn_ptr, gamma_ptr, rk_ptr, h_ptr, o_ptr, T, NC, scale,
                      stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh,
                      HV: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """o = diag(rq e^gamma) (q_raw S_chunk) + attn v_new with attn = the raw rows' q k^T times
    rq_i rk_j e^(gamma_i - gamma_j), causal; rq, rk the l2 norms' factors (rq with Dk^-0.5; rk the
    solve kernel's). Over Dk in halves, as the state kernel. PREC "bf16x2": the two products
    with an fp32 operand on bf16 pairs (_dot_bf16_pair, ~16 bits before o's rounding to bf16's
    8), else TF32 as named."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    b = pid // HV
    hv = pid % HV
    hk = hv // RATIO
    DH: tl.constexpr = DK // 2
    r = tl.arange(0, C)
    d0 = tl.arange(0, DH)
    d1 = DH + tl.arange(0, DH)
    dv = v0 + tl.arange(0, BV)
    t = c * C + r
    ok = t < T
    q_rows = q_ptr + b * stride_qb + t[:, None] * stride_qt + hk * stride_qh
    k_rows = k_ptr + b * stride_qb + t[:, None] * stride_qt + hk * stride_qh
    q0 = tl.load(q_rows + d0[None, :], mask=ok[:, None], other=0.0)
    q1 = tl.load(q_rows + d1[None, :], mask=ok[:, None], other=0.0)
    k0 = tl.load(k_rows + d0[None, :], mask=ok[:, None], other=0.0)
    k1 = tl.load(k_rows + d1[None, :], mask=ok[:, None], other=0.0)
    q0f = q0.to(tl.float32)
    q1f = q1.to(tl.float32)
    rq = tl.rsqrt(tl.sum(q0f * q0f, axis=1) + tl.sum(q1f * q1f, axis=1) + 1e-6) * scale
    chunk = pid * NC + c
    base = chunk.to(tl.int64) * C
    rk = tl.load(rk_ptr + base + r)
    gamma = tl.load(gamma_ptr + base + r)
    qk = tl.dot(q1, tl.trans(k1), tl.dot(q0, tl.trans(k0)))
    attn = tl.where(r[:, None] >= r[None, :],
                    qk * (rq[:, None] * rk[None, :]) * tl.exp(gamma[:, None] - gamma[None, :]), 0.0)
    hrow = chunk.to(tl.int64) * DK
    h0 = tl.load(h_ptr + (hrow + d0)[:, None] * DV + dv[None, :])
    h1 = tl.load(h_ptr + (hrow + d1)[:, None] * DV + dv[None, :])
    v_new = tl.load(vn_ptr + (base + r)[:, None] * DV + dv[None, :])
    if PREC == "bf16x2":
        qh = _dot_bf16_pair(q0, h0, True)
        qh += _dot_bf16_pair(q1, h1, True)
        av = _dot_bf16_pair(attn, v_new, False)
    else:
        qh = _dot_tf32_exact(q0f, h0)
        qh += _dot_tf32_exact(q1f, h1)
        av = _dot3(attn, v_new, PREC)
    o = qh * (rq * tl.exp(gamma))[:, None] + av
    tl.store(o_ptr + b * stride_ob + t[:, None] * stride_ot + hv * stride_oh + dv[None, :], o.to(tl.bfloat16),
             mask=ok[:, None])


_OUT_PRECS = ("tf32x3", "tf32", "bf16x2")
_PRECS = ("tf32x3", "bf16x3", "bf16x2")
_FORMS = ("uw", "inverse", "merged")


@dataclass(frozen=True)
class PrefillPlan:
    """How chunked_prefill launches its kernels (what `python -m bench gdn --sweep` varies):
    warps per program of each kernel, the state kernel's value columns a program and
    pipeline stages, the output kernel's value columns a program, and the output kernel's
    products with an fp32 operand (the output kernel feeds no state, so its precision moves
    only the bf16 outputs): "bf16x2", each fp32 operand as two bf16 parts (~16 significant
    bits, bf16 tensor cores at twice TF32's rate; within one bf16 step of "tf32x3"),
    "tf32x3" (three TF32 passes, about fp32), or "tf32" (one pass, for comparison only: its
    outputs sit further from the oracle, ~5e-3 of the three-pass ones on the H200).
    The field defaults are the fastest of a sweep on an H200 (32 state columns with two
    stages; bf16 pairs in the output kernel; 8 warps or 128 columns were slower:
    docs/PERFORMANCE.md); FAST_PLAN (below) is the engine's plan on Triton 3.6.
    prec: the solve and state kernels' products with an fp32 operand, which make the state:
    "tf32x3" (about fp32, the field default), "bf16x3" (each fp32 operand as three bf16 parts, six
    products, about fp32 too, in the tensor time of three TF32 passes, with the left operand
    kept in registers: the solve 180 registers and 64 KiB of shared memory against 237 and 80;
    FAST_PLAN's) or "bf16x2" (bf16 pairs, ~16 significant bits, at bf16's rate and fewer
    registers: 139 at 16 value columns against 211, three programs an SM; not a default: the
    state at ~16 bits, and with the solve on pairs too a near-singular system missed the
    oracle's gate, docs/NUMERICS.md).
    solve_maxnreg / state_maxnreg / out_maxnreg: a register cap for that kernel (Triton's
    maxnreg; 0: none). Each runs two programs of 4 warps an SM by its registers (237 / 253 /
    228); at 168 three fit by registers (ptxas, sm_90a: the solve spills 28 bytes a thread but
    its 80 KiB of shared memory still allows two, the state kernel 424 at 32 columns and 136
    at 16, the output kernel 4). FAST_PLAN caps the solve and the output kernel; the state
    kernel capped spills and runs slower (docs/PERFORMANCE.md).
    solve_prec: the solve kernel's products alone ("": as prec). The solve writes its result in
    fp32 for the state kernel, so its products' form is independent of the state kernel's.
    Products on bf16 parts in the solve or state kernel need Dk >= 64: at Dk 32 the solve on
    thirds gave outputs of ~1e-37 on an H200 with Triton 3.6, so chunked_prefill refuses such a
    plan there.
    form: what the solve hands the state kernel. "uw": u = M^-1 diag(beta) v and w = M^-1
    diag(beta rk e^gamma) k_raw (fp32, 1 KiB a token and value head at Dk = Dv = 128), the state
    kernel's v_new = u - w S. "inverse": P = M^-1 diag(beta) alone (fp32 [C, C], 256 bytes a
    token and head), the state kernel's v_new = P (v - diag(rk e^gamma) k_raw S) from the raw
    bf16 keys and values (the same sum; fewer bytes both sides, one more product in the walk).
    "merged": as "inverse", with the solve's M^-1 merged from its 16-blocks' inverses pairwise
    (16 -> 32 -> 64) in place of the power form's four [C, C] products.
    block_v 0: the state kernel's columns chosen per slice by how many programs fill the GPU
    (_state_columns). slice_tokens: tokens a call of the kernels takes at most (whole sequences;
    0: _TOKENS_PER_SLICE), which bounds the workspaces (~1.8 KiB a token and value head in the
    merged form, 2 KiB in "uw")."""
    solve_warps: int = 4
    state_warps: int = 4
    state_stages: int = 2
    block_v: int = 32
    out_warps: int = 4
    out_bv: int = 64
    out_prec: str = "bf16x2"
    prec: str = "tf32x3"
    solve_prec: str = ""
    solve_maxnreg: int = 0
    state_maxnreg: int = 0
    out_maxnreg: int = 0
    form: str = "uw"
    slice_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("solve_warps", "state_warps", "block_v", "out_warps", "out_bv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "block_v" else 1) or value & (value - 1):
                raise ValueError(f"gdn_prefill.PrefillPlan.{name} must be a power of two{' or 0' * (name == 'block_v')}, "
                                 f"got {value!r}")
        if not isinstance(self.slice_tokens, int) or self.slice_tokens < 0:
            raise ValueError(f"gdn_prefill.PrefillPlan.slice_tokens must be 0 (the default) or a count of tokens, "
                             f"got {self.slice_tokens!r}")
        for name in ("solve_maxnreg", "state_maxnreg", "out_maxnreg"):
            value = getattr(self, name)
            if not isinstance(value, int) or value and not 24 <= value <= 255:
                raise ValueError(f"gdn_prefill.PrefillPlan.{name} must be 0 (no cap) or 24-255 registers, got {value!r}")
        if self.out_prec not in _OUT_PRECS:
            raise ValueError(f"gdn_prefill.PrefillPlan.out_prec must be one of {_OUT_PRECS}, got {self.out_prec!r}")
        if self.prec not in _PRECS:
            raise ValueError(f"gdn_prefill.PrefillPlan.prec must be one of {_PRECS}, got {self.prec!r}")
        if self.form not in _FORMS:
            raise ValueError(f"gdn_prefill.PrefillPlan.form must be one of {_FORMS}, got {self.form!r}")
        if self.solve_prec and self.solve_prec not in _PRECS:
            raise ValueError(f"gdn_prefill.PrefillPlan.solve_prec must be '' (as prec) or one of {_PRECS}, "
                             f"got {self.solve_prec!r}")

    @property
    def solve_form(self) -> str:
        """The solve kernel's products: solve_prec, or prec where that is ""."""
        return self.solve_prec or self.prec

    def caps(self, kernel: str) -> dict:
        """The launch's register cap (Triton's maxnreg) for "solve", "state" or "out": {} for none."""
        value = getattr(self, f"{kernel}_maxnreg")
        return {"maxnreg": value} if value else {}


def plan_from_text(text: str | None) -> PrefillPlan:
    """A PrefillPlan from "name=value,..." (the bench's spelling, e.g. "block_v=16,state_stages=1");
    empty or None: the defaults. An unknown name or a bad value is an error
    naming it."""
    if not text:
        return PrefillPlan()
    kinds = {f.name: f.type for f in fields(PrefillPlan)}
    kw = {}
    for part in text.split(","):
        name, sep, value = (p.strip() for p in part.partition("="))
        if not sep or name not in kinds:
            raise ValueError(f"gdn_prefill plan: {part!r} is not name=value with a name among {', '.join(kinds)}")
        if name in ("out_prec", "prec", "solve_prec", "form"):
            kw[name] = value
        else:
            try:
                kw[name] = int(value)
            except ValueError:
                raise ValueError(f"gdn_prefill plan: {name} must be an integer, got {value!r}") from None
    return PrefillPlan(**kw)


# The engine's plan where none is named (chunked_prefill's plan=None). On Triton 3.6 or newer,
# FAST_PLAN: the solve on bf16 thirds at 168 registers, its inverse merged from 16-blocks and
# handed to the state kernel as P ("merged"), the state kernel on bf16 thirds with its columns by
# its programs, the output kernel at 168 registers, slices of 32K tokens: the fastest plan
# measured on an H200 (docs/PERFORMANCE.md), the same sums at fp32's accuracy, the state as close
# to the chunked reference. On older Triton (the platform's 3.1) the plain defaults: its ptxas
# spills 252 bytes a thread in the capped solve and 64 in the capped output kernel (none
# uncapped), and that Triton is unmeasured on a GPU, so whether the caps or the forms pay there
# is unknown.
# chunked_prefill's plan argument takes another plan, e.g. the fastest one
# `python -m bench gdn --sweep` finds on another GPU.
FAST_PLAN = PrefillPlan(prec="bf16x3", solve_maxnreg=168, out_maxnreg=168, form="merged", block_v=0,
                        slice_tokens=32768)
_TRITON_36 = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
DEFAULT_PLAN = FAST_PLAN if _TRITON_36 else PrefillPlan()
_BF16_MIN_DK = 64       # the smallest Dk whose solve and state products on bf16 parts are right (above)


def _state_columns(heads: int, Dv: int, device: torch.device) -> int:
    """The state kernel's value columns a program for block_v 0 ("auto"), given a slice's sequence
    x value heads: its walks are sequential, so a program's time is its chunks times a step's
    latency, and the kernel's time the programs' waves over the SMs (two programs an SM) times
    that. A step of 64 columns takes ~1.7x one of 32, so 64 pay where their programs still fill
    ~3/4 of the slots (e.g. 4 x 2048 and 16 x 2048), and 32 below (e.g. 1 x 8192;
    docs/PERFORMANCE.md)."""
    if Dv % 64 == 0 and heads * (Dv // 64) >= 3 * sm_count(device) // 2:
        return 64
    return min(32, Dv)


def _uses_bf16_parts(plan: PrefillPlan) -> bool:
    """Whether the solve or the state kernel takes its fp32 products as bf16 parts."""
    return plan.prec != "tf32x3" or plan.solve_form != "tf32x3"


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    block_v: int | None = None, plan: PrefillPlan | None = None, state_out: torch.Tensor | None = None,
                    initial_state: torch.Tensor | None = None, capture: tuple | None = None):
    """The chunked rule over a prompt, as three kernels (from a zero state; with initial_state,
    a contiguous fp32 [B, Hv, Dk, Dv], from it: the rest of a sequence whose first part a
    call before this one took, e.g. a prompt prefilled in chunks; it may be state_out itself,
    the cache rows updated in place; capture (c, out): also the state at chunk c's start, after c
    chunks of this call, into out, fp32 [B, Hv, Dk, Dv], which the state kernel writes for the
    output kernel anyway (a snapshot, fq_qwen35)): q, k
    [B, T, Hk, Dk] bf16 (the conv's output: not normalized, heads not repeated), v [B, T, Hv, Dv]
    bf16, g [B, T, Hv] fp32, beta [B, T, Hv] bf16. block_v: value columns per state program (a
    power of two dividing Dv; None: the plan's); plan: the launches
    (PrefillPlan; None: DEFAULT_PLAN, on three TF32 passes where Dk < 64). q, k and v are read in place where their last dimension has unit stride
    (e.g. head views of the conv's output rows; q and k with the same strides), g and beta
    likewise. state_out: a contiguous fp32 [B, Hv, Dk, Dv] to write the final state into (a
    cache's rows), else a new one. Returns (o [B, T, Hv, Dv] bf16, the final state), what
    delta_rule_chunked_reference returns on the repeated heads."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (B, T) or Hv % Hk or tuple(g.shape) != (B, T, Hv) \
            or tuple(beta.shape) != (B, T, Hv) or g.dtype != torch.float32:
        raise ValueError(f"gdn_prefill.chunked_prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {g.dtype} {tuple(g.shape)}, beta {tuple(beta.shape)} do not fit")
    if plan is None:
        plan = DEFAULT_PLAN
        if Dk < _BF16_MIN_DK and _uses_bf16_parts(plan):
            plan = replace(plan, prec="tf32x3", solve_prec="tf32x3")
    elif Dk < _BF16_MIN_DK and _uses_bf16_parts(plan):
        raise ValueError(f"gdn_prefill.chunked_prefill: the plan's solve and state products on bf16 parts (prec "
                         f"{plan.prec!r}, solve_prec {plan.solve_prec!r}) need Dk >= {_BF16_MIN_DK}, got Dk {Dk}")
    rows = max(1, (plan.slice_tokens or _TOKENS_PER_SLICE) // (triton.cdiv(T, CHUNK) * CHUNK))  # sequences a slice
    block_v = min(plan.block_v if block_v is None else block_v, Dv) or _state_columns(min(rows, B) * Hv, Dv, v.device)
    if Dk & (Dk - 1) or Dk < 32 or Dv % block_v or block_v & (block_v - 1) or block_v < 16 or T < 1:
        raise ValueError(f"gdn_prefill.chunked_prefill: Dk ({Dk}) must be a power of two >= 32 (the state kernel's halves "
                         f"of 16 or more), block_v ({block_v}) a "
                         f"power of two >= 16 dividing Dv ({Dv}), T ({T}) >= 1")
    if q.stride() != k.stride() or q.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if g.stride() != beta.stride() or g.stride(-1) != 1:
        g, beta = g.contiguous(), beta.contiguous()
    nc = triton.cdiv(T, CHUNK)
    if capture is not None and (not 0 <= capture[0] < nc or capture[1].dtype != torch.float32
                                or tuple(capture[1].shape) != (B, Hv, Dk, Dv)):
        raise ValueError(f"gdn_prefill.chunked_prefill: capture must be (a chunk in [0, {nc}), float32 {(B, Hv, Dk, Dv)}), "
                         f"got ({capture[0]}, {capture[1].dtype} {tuple(capture[1].shape)})")
    dev = v.device
    out = torch.empty((B, T, Hv, Dv), dtype=torch.bfloat16, device=dev)
    if state_out is None:
        state = torch.empty((B, Hv, Dk, Dv), dtype=torch.float32, device=dev)
    elif state_out.dtype != torch.float32 or tuple(state_out.shape) != (B, Hv, Dk, Dv) or not state_out.is_contiguous():
        raise ValueError(f"gdn_prefill.chunked_prefill: state_out must be contiguous float32 {(B, Hv, Dk, Dv)}, got "
                         f"{state_out.dtype} {tuple(state_out.shape)}")
    else:
        state = state_out
    if initial_state is not None and (initial_state.dtype != torch.float32 or not initial_state.is_contiguous()
                                      or tuple(initial_state.shape) != (B, Hv, Dk, Dv)):
        raise ValueError(f"gdn_prefill.chunked_prefill: initial_state must be contiguous float32 {(B, Hv, Dk, Dv)}, got "
                         f"{initial_state.dtype} {tuple(initial_state.shape)}")
    ws = min(rows, B) * Hv * nc * CHUNK
    inverse = plan.form != "uw"
    u = torch.empty((ws, Dv), dtype=torch.float32, device=dev)          # u (or nothing), then v_new in its place
    # w, or with the inverse form each chunk's P = M^-1 diag(beta) ([C, C])
    w = torch.empty((ws, CHUNK if inverse else Dk), dtype=torch.float32, device=dev)
    gamma = torch.empty((ws,), dtype=torch.float32, device=dev)
    rk = torch.empty((ws,), dtype=torch.float32, device=dev)            # each key's l2 norm factor
    # each chunk's starting state (the output kernel's input)
    h = torch.empty((ws // CHUNK * Dk, Dv), dtype=torch.float32, device=dev)
    out_bv = min(plan.out_bv, Dv)
    if Dv % out_bv or out_bv < 16:
        raise ValueError(f"gdn_prefill.chunked_prefill: the plan's out_bv ({plan.out_bv}) must divide Dv ({Dv}), >= 16")
    solve_prec, prec = plan.solve_form, plan.prec
    solve_form = {} if not inverse else dict(p_ptr=w, INVERSE=True, MERGED=plan.form == "merged")
    for b0 in range(0, B, rows):
        sl = slice(b0, min(B, b0 + rows))
        bs = sl.stop - sl.start
        qs, ks, vs, gs, bts, os_ = q[sl], k[sl], v[sl], g[sl], beta[sl], out[sl]
        init = {} if initial_state is None else dict(init_ptr=initial_state[sl], stride_ib=initial_state.stride(0),
                                                     HAS_INIT=True)
        state_form = {} if not inverse else dict(p_ptr=w, v_ptr=vs, stride_vb=vs.stride(0), stride_vt=vs.stride(1),
                                                 stride_vh=vs.stride(2), INVERSE=True)
        _chunk_solve_kernel[(bs * Hv, nc)](
            ks, vs, gs, bts, u, w, gamma, rk, T, nc, ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0),
            vs.stride(1), vs.stride(2), gs.stride(0), gs.stride(1), HV=Hv, RATIO=Hv // Hk, C=CHUNK, DK=Dk, DV=Dv,
            PREC=solve_prec, num_warps=plan.solve_warps, **solve_form, **plan.caps("solve"))
        _chunk_state_kernel[(Dv // block_v, bs * Hv)](
            ks, u, w, gamma, rk, h, state[sl], T, nc, ks.stride(0), ks.stride(1), ks.stride(2), state.stride(0),
            HV=Hv, RATIO=Hv // Hk, C=CHUNK, DK=Dk, DV=Dv, BV=block_v, PREC=prec, num_warps=plan.state_warps,
            num_stages=plan.state_stages, **init, **state_form, **plan.caps("state"))
        _chunk_out_kernel[(bs * Hv, nc, Dv // out_bv)](
            qs, ks, u, gamma, rk, h, os_, T, nc, Dk ** -0.5, qs.stride(0), qs.stride(1), qs.stride(2),
            os_.stride(0), os_.stride(1), os_.stride(2), HV=Hv, RATIO=Hv // Hk, C=CHUNK, DK=Dk, DV=Dv,
            BV=out_bv, PREC=plan.out_prec, num_warps=plan.out_warps,
            **plan.caps("out"))
        if capture is not None:     # h: each (sequence, head, chunk)'s starting state, [Dk, Dv] each
            capture[1][sl] = h[:bs * Hv * nc * Dk].view(bs, Hv, nc, Dk, Dv)[:, :, capture[0]]
    return out, state



_INTERPRETED = type(_gates_kernel).__name__ == "InterpretedFunction"
