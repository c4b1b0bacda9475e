"""The GDN chunked rule in the reference's order of operations (issue 12's noise: the engine's
extra logit distance to the full forward is all made by its prompt pass's chunked rule, whose
bits are not the reference's; session 18).

What each piece of the reference rule (gdn.delta_rule_chunked_reference, Transformers 5.17's
torch ops) computes, element by element, was measured on an H200 against kernels of known order
(scripts/gpu_rule_bits_probe.py, scripts/gpu_trsm_probe.py, session 19): the batched fp32
products are ascending FMA chains from zero (tl.dot with input_precision "ieee" gives them), and
cuBLAS's batched unit-lower triangular solve of a [64, 64] system is blocked by 8 rows,
right-looking: a block's rows by forward substitution (row i takes fma(-l_ij, x_j, x_i) for its
block's earlier rows j, ascending), then every later row subtracts that block's terms summed by
ascending FMA from zero (a GEMM, then x_i - acc). The reductions, exp and rsqrt have Triton
equivalents too; this first form keeps them on torch's ops and puts the two heavy pieces in
Triton:

  solve_unit_lower(L, B)   the solve, blocked by 8 as cuBLAS's batched solve (bits on the GPU:
                           tests/kernels; with 8 systems or fewer torch calls cuBLAS's
                           non-batched solve, other bits: the exact rule calls it there too)
  recurrence(...)          the chunk loop: v_new = u - w S; out = q_d S + A v_new;
                           S = S * carry + k_d^T v_new, each product an ascending chain from
                           zero, each multiply, add and subtract rounded on its own (written in
                           PTX: Triton would fuse them into FMAs or into the products' chains)
  chunk_systems(...)       the two [64, 64] products and their decays (system, attn), each
                           product an ascending chain, expf as torch's (optional: systems="triton")
  delta_rule_chunked_exact the whole rule: torch's ops for the element-wise parts, reductions and
                           (by default) the two [64, 64] products, then the kernels

recurrence's "sliced" form and solve_unit_lower's "scratch" form (the defaults since session 21,
bit-equal on an H200) read the operands they need back from memory a slice at a time (chained
tl.dot: the same chains) instead of holding or picking them out of registers, where the first
forms spent most of their time (the FMA units at a few percent of their peak): the whole rule
5.5 ms a layer at 4x2048 against ~18. chunk_systems runs the same chained products (bit-equal,
slower than torch's ops there: not the default).

On the CPU (the interpreter) the kernels run their logic; their bits are the GPU's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fqkernels import gdn
from fqkernels.gdn import _add_rn, _mul_rn, _sub_rn
from fqkernels.swiglu import exp_f32

SOLVE_BLOCK = 8     # cuBLAS's row block in the batched solve of a 64 x 64 system (session 19)
# torch solves at most this many systems of 64 or more rows one cuBLAS call each (non-batched,
# other bits: session 19's trsm-bits); the exact rule then makes that same call
LOOPED_SOLVES = 8


@triton.jit
def _row(x, rows, j):
    """Row j of the register tile x [M, N] as [N] (a sum of one value and zeros: exact)."""
    return tl.sum(tl.where(rows[:, None] == j, x, 0.0), axis=0)


@triton.jit
def _chain(acc, a_ptr, a_row, a_col, b_ptr, b_row, b_col, rows, cols, K: tl.constexpr, KS: tl.constexpr):
    """acc + a @ b for a [rows, K] (element (i, k) at a_ptr + i * a_row + k * a_col) and b [K, cols]
    (b_ptr + k * b_row + col * b_col) as one ascending FMA chain an output, from acc: K in slices of KS,
    each slice's product continuing the chain where the last one left it (tl.dot with an
    accumulator), so only a slice's operands are held at once."""
    ks = tl.arange(0, KS)
    for k0 in tl.static_range(0, K, KS):
        a = tl.load(a_ptr + rows[:, None] * a_row + (k0 + ks)[None, :] * a_col)
        b = tl.load(b_ptr + (k0 + ks)[:, None] * b_row + cols[None, :] * b_col)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _systems_kernel(q_ptr, k_ptr, kb_ptr, gamma_ptr, sys_ptr, attn_ptr, C: tl.constexpr, DK: tl.constexpr,
                    KS: tl.constexpr, INTERPRETED: tl.constexpr):
    """One chunk (program 0 over the sequence-heads' chunks): the unit-lower system
    (k beta) k^T * decay and attn = q k^T * decay [C, C], decay[i, j] = exp(gamma_i - gamma_j) on
    and below the diagonal and exp(-inf) = 0 above it, as gdn.chunked_pieces forms them: each
    product an ascending FMA chain from zero (k^T read in place), each multiply rounded on its
    own, expf as torch's (libdevice's)."""
    ch = tl.program_id(0)
    r = tl.arange(0, C)
    base = ch * C
    gamma = tl.load(gamma_ptr + base + r)
    decay = exp_f32(tl.where(r[None, :] > r[:, None], float("-inf"), gamma[:, None] - gamma[None, :]), INTERPRETED)
    kkt = _chain(tl.zeros([C, C], dtype=tl.float32), kb_ptr + base * DK, DK, 1, k_ptr + base * DK, 1, DK, r, r, DK, KS)
    tl.store(sys_ptr + (base + r[:, None]) * C + r[None, :], _mul_rn(kkt, decay, INTERPRETED))
    qkt = _chain(tl.zeros([C, C], dtype=tl.float32), q_ptr + base * DK, DK, 1, k_ptr + base * DK, 1, DK, r, r, DK, KS)
    tl.store(attn_ptr + (base + r[:, None]) * C + r[None, :], _mul_rn(qkt, decay, INTERPRETED))


def chunk_systems(q, k, kb, gamma, k_slice: int = 16, num_warps: int = 4):
    """gdn.chunked_pieces' system and attn [..., C, C] from gdn.chunked_inputs' q (scaled), k,
    k * beta [..., C, Dk] and gamma [..., C] (fp32), in its order (its bits on the GPU)."""
    *lead, C, Dk = k.shape
    if Dk % k_slice or k_slice % 16:
        raise ValueError(f"chunk_systems: k_slice {k_slice} is not a multiple of 16 dividing Dk {Dk}")
    q3, k3, kb3 = (t.reshape(-1, C, Dk).contiguous() for t in (q, k, kb))
    system = torch.empty((*lead, C, C), dtype=torch.float32, device=k.device)
    attn = torch.empty_like(system)
    _systems_kernel[(q3.shape[0],)](q3, k3, kb3, gamma.reshape(-1, C).contiguous(), system, attn, C=C, DK=Dk,
                                    KS=k_slice, INTERPRETED=not k.is_cuda, num_warps=num_warps, num_stages=1)
    return system, attn


@triton.jit
def _system_tile(l_ptr, b_ptr, N, stride_lp, stride_bp, M: tl.constexpr, BN: tl.constexpr):
    """A solve program's system p (program 0), its BN columns (program 1) and their mask, the rows,
    its right-hand side's tile [M, BN] (zeros past N) and its L's base."""
    p = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rows = tl.arange(0, M)
    cmask = cols < N
    x = tl.load(b_ptr + p * stride_bp + rows[:, None] * N + cols[None, :], mask=cmask[None, :], other=0.0)
    return p, cols, rows, cmask, x, l_ptr + p * stride_lp


@triton.jit
def _solve_kernel(l_ptr, b_ptr, x_ptr, N, stride_lp, stride_bp, stride_xp, M: tl.constexpr, BN: tl.constexpr,
                  NB: tl.constexpr):
    """X = L^-1 B for one system p (L unit lower [M, M], rows of stride M; B, X [M, N] rows of
    stride N) and BN of its columns, blocked by NB rows, right-looking, as cuBLAS orders it."""
    p, cols, rows, cmask, x, l_base = _system_tile(l_ptr, b_ptr, N, stride_lp, stride_bp, M, BN)
    for s in tl.static_range(0, M, NB):
        # the block's own rows: forward substitution, each earlier row's term by one FMA
        for j in tl.static_range(s, s + NB - 1):
            xj = _row(x, rows, j)
            below = (rows > j) & (rows < s + NB)
            lj = tl.load(l_base + rows * M + j, mask=below, other=0.0)
            x = tl.where(below[:, None], tl.fma(-lj[:, None], xj[None, :], x), x)
        # the later rows: the block's terms summed from zero by ascending FMA, then subtracted
        if s + NB < M:
            later = rows >= s + NB
            acc = tl.zeros([M, BN], dtype=tl.float32)
            for j in tl.static_range(s, s + NB):
                lj = tl.load(l_base + rows * M + j, mask=later, other=0.0)
                acc = tl.fma(lj[:, None], _row(x, rows, j)[None, :], acc)
            x = tl.where(later[:, None], x - acc, x)
    tl.store(x_ptr + p * stride_xp + rows[:, None] * N + cols[None, :], x, mask=cmask[None, :])


@triton.jit
def _solve_scratch_kernel(l_ptr, b_ptr, x_ptr, N, stride_lp, stride_bp, stride_xp, M: tl.constexpr,
                          BN: tl.constexpr, NB: tl.constexpr, INTERPRETED: tl.constexpr):
    """_solve_kernel's order with the rows it needs read back from the output (written by this
    program, a barrier between) instead of picked out of registers by masked sums, and each block's
    terms on the later rows as one tl.dot over 16 columns: 8 zeros first (a chain from zero through
    zeros is still zero), then the block's 8, so the chain is the block's 8 terms from zero."""
    p, cols, rows, cmask, x, l_base = _system_tile(l_ptr, b_ptr, N, stride_lp, stride_bp, M, BN)
    x_ptrs = x_ptr + p * stride_xp + rows[:, None] * N + cols[None, :]
    k16 = tl.arange(0, 2 * NB)
    for s in tl.static_range(0, M, NB):
        block = (rows >= s) & (rows < s + NB)
        tl.store(x_ptrs, x, mask=block[:, None] & cmask[None, :])
        for j in tl.static_range(s, s + NB - 1):
            tl.debug_barrier()                   # row j, written by some threads, read by all
            xj = tl.load(x_ptr + p * stride_xp + j * N + cols, mask=cmask, other=0.0)
            below = (rows > j) & (rows < s + NB)
            lj = tl.load(l_base + rows * M + j, mask=below, other=0.0)
            x = tl.where(below[:, None], tl.fma(-lj[:, None], xj[None, :], x), x)
            tl.store(x_ptrs, x, mask=(rows == j + 1)[:, None] & cmask[None, :])
        if s + NB < M:
            tl.debug_barrier()
            ks = s - NB + k16                    # columns s-8 .. s+7: the first 8 read as zeros
            real = ks >= s
            l_blk = tl.load(l_base + rows[:, None] * M + ks[None, :], mask=real[None, :] & (rows >= s + NB)[:, None],
                            other=0.0)
            x_blk = tl.load(x_ptr + p * stride_xp + ks[:, None] * N + cols[None, :],
                            mask=real[:, None] & cmask[None, :], other=0.0)
            acc = tl.dot(l_blk, x_blk, tl.zeros([M, BN], dtype=tl.float32), input_precision="ieee")
            x = tl.where((rows >= s + NB)[:, None], _sub_rn(x, acc, INTERPRETED), x)
    tl.store(x_ptrs, x, mask=cmask[None, :])


def solve_unit_lower(L: torch.Tensor, B: torch.Tensor, block_n: int = 64, num_warps: int = 4,
                     form: str = "scratch") -> torch.Tensor:
    """torch.linalg.solve_triangular(L, B, upper=False, unitriangular=True) for fp32 L [..., M, M]
    (M a multiple of 8; what lies on and above the diagonal is not read) and B [..., M, N], in
    cuBLAS's order (its bits on the GPU). form "masked" picks each solved row out of registers by a
    masked sum; "scratch" reads it back from the output and forms each block's terms on the later
    rows with tl.dot (the same order). The default, scratch with 64 columns and 4 warps a program,
    was the fastest of six launch shapes at 1x512, 4x2048 and 16x512 on an H200 (session 21: 58 /
    843 / 846 us for the rule's 256 right-hand sides, against masked 32/2's 113 / 1,553 / 1,561;
    all bit-equal)."""
    M, N = B.shape[-2], B.shape[-1]
    if L.shape[-1] != M or L.shape[-2] != M or M % SOLVE_BLOCK:
        raise ValueError(f"solve_unit_lower: L {tuple(L.shape)} against B {tuple(B.shape)} (M a multiple of 8)")
    l3 = L.reshape(-1, M, M).contiguous()
    b3 = B.reshape(-1, M, N).contiguous()
    out = torch.empty_like(b3)
    bn = min(block_n, triton.next_power_of_2(N))
    if form not in ("masked", "scratch"):
        raise ValueError(f"solve_unit_lower: form {form!r} is not 'masked' or 'scratch'")
    if form == "scratch":
        bn = max(bn, 16)                         # tl.dot's least width
    grid = (l3.shape[0], triton.cdiv(N, bn))
    if form == "masked":
        _solve_kernel[grid](l3, b3, out, N, l3.stride(0), b3.stride(0), out.stride(0), M=M, BN=bn, NB=SOLVE_BLOCK,
                            num_warps=num_warps)
    else:
        _solve_scratch_kernel[grid](l3, b3, out, N, l3.stride(0), b3.stride(0), out.stride(0), M=M, BN=bn,
                                    NB=SOLVE_BLOCK, INTERPRETED=not L.is_cuda, num_warps=num_warps)
    return out.view(B.shape)


@triton.jit
def _head_tile(s_ptr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """A chunk-loop program's indices: its sequence-head bh (program 0), its BV value columns
    (program 1), a chunk's rows, the key dimension, and its state tile's pointers in s_ptr."""
    bh = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    r = tl.arange(0, C)
    dk = tl.arange(0, DK)
    return bh, cols, r, dk, s_ptr + bh * DK * DV + dk[:, None] * DV + cols[None, :]


@triton.jit
def _walk_chunk(u_ptr, w_ptr, kd_ptr, carry_ptr, S, bh, c, NC, cols, r, dk, C: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, BV: tl.constexpr, INTERPRETED: tl.constexpr):
    """Chunk c of sequence-head bh's walk from its starting state S [DK, BV]: (v_new = u - w S,
    the state after it, S * carry + k_d^T v_new)."""
    base = (bh * NC + c) * C
    w = tl.load(w_ptr + (base + r[:, None]) * DK + dk[None, :])
    u = tl.load(u_ptr + (base + r[:, None]) * DV + cols[None, :])
    v_new = _sub_rn(u, tl.dot(w, S, input_precision="ieee"), INTERPRETED)
    kd_t = tl.load(kd_ptr + (base + r[None, :]) * DK + dk[:, None])            # [DK, C]
    carry = tl.zeros([DK, BV], dtype=tl.float32) + tl.load(carry_ptr + bh * NC + c)   # + 0: exact
    return v_new, _add_rn(_mul_rn(S, carry, INTERPRETED), tl.dot(kd_t, v_new, input_precision="ieee"), INTERPRETED)


@triton.jit
def _recurrence_kernel(u_ptr, w_ptr, qd_ptr, kd_ptr, a_ptr, carry_ptr, s_ptr, o_ptr, cap_ptr, NC, capture,
                       C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                       HAS_CAPTURE: tl.constexpr, INTERPRETED: tl.constexpr):
    """One sequence-head (program 0) and BV value columns (program 1), over its NC chunks in
    order, the state S [DK, BV] in registers (in: s_ptr's initial state; out: the final one).
    Per chunk c (u, w, q_d, k_d [NC, C, D] and A [NC, C, C] of this sequence-head, carry [NC]):
    v_new = u - w S; out = q_d S + A v_new; S = S * carry + k_d^T v_new."""
    bh, cols, r, dk, s_ptrs = _head_tile(s_ptr, C, DK, DV, BV)
    S = tl.load(s_ptrs)
    for c in range(NC):
        if HAS_CAPTURE:
            if c == capture:
                tl.store(cap_ptr + bh * DK * DV + dk[:, None] * DV + cols[None, :], S)
        v_new, S_next = _walk_chunk(u_ptr, w_ptr, kd_ptr, carry_ptr, S, bh, c, NC, cols, r, dk, C, DK, DV, BV,
                                    INTERPRETED)
        base = (bh * NC + c) * C
        qd = tl.load(qd_ptr + (base + r[:, None]) * DK + dk[None, :])
        a = tl.load(a_ptr + (base + r[:, None]) * C + r[None, :])
        out = _add_rn(tl.dot(qd, S, input_precision="ieee"), tl.dot(a, v_new, input_precision="ieee"), INTERPRETED)
        tl.store(o_ptr + (base + r[:, None]) * DV + cols[None, :], out)
        S = S_next
    tl.store(s_ptrs, S)


@triton.jit
def _states_kernel(u_ptr, w_ptr, kd_ptr, carry_ptr, s_ptr, h_ptr, vn_ptr, NC, C: tl.constexpr, DK: tl.constexpr,
                   DV: tl.constexpr, BV: tl.constexpr, INTERPRETED: tl.constexpr):
    """The split form's sequential half: _recurrence_kernel's walk without the outputs, keeping
    each chunk's starting state h [BH, NC, DK, DV] and its new values v_new [BH, NC, C, DV]."""
    bh, cols, r, dk, s_ptrs = _head_tile(s_ptr, C, DK, DV, BV)
    S = tl.load(s_ptrs)
    for c in range(NC):
        tl.store(h_ptr + (bh * NC + c) * DK * DV + dk[:, None] * DV + cols[None, :], S)
        v_new, S = _walk_chunk(u_ptr, w_ptr, kd_ptr, carry_ptr, S, bh, c, NC, cols, r, dk, C, DK, DV, BV, INTERPRETED)
        tl.store(vn_ptr + ((bh * NC + c) * C + r[:, None]) * DV + cols[None, :], v_new)
    tl.store(s_ptrs, S)


@triton.jit
def _outputs_kernel(qd_ptr, a_ptr, h_ptr, vn_ptr, o_ptr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BV: tl.constexpr, INTERPRETED: tl.constexpr):
    """The split form's parallel half: one chunk (program 0 over BH x NC) and BV value columns,
    out = q_d h + A v_new from the chunk's starting state and new values."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    r = tl.arange(0, C)
    dk = tl.arange(0, DK)
    base = chunk * C
    h = tl.load(h_ptr + chunk * DK * DV + dk[:, None] * DV + cols[None, :])
    qd = tl.load(qd_ptr + (base + r[:, None]) * DK + dk[None, :])
    a = tl.load(a_ptr + (base + r[:, None]) * C + r[None, :])
    vn = tl.load(vn_ptr + (base + r[:, None]) * DV + cols[None, :])
    out = _add_rn(tl.dot(qd, h, input_precision="ieee"), tl.dot(a, vn, input_precision="ieee"), INTERPRETED)
    tl.store(o_ptr + (base + r[:, None]) * DV + cols[None, :], out)


@triton.jit
def _states_sliced_kernel(u_ptr, w_ptr, kd_ptr, carry_ptr, s_ptr, h_ptr, vn_ptr, NC, C: tl.constexpr,
                          DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    """_states_kernel with its two products' operands read back from memory a slice of KS at a time
    (the state from h, the new values from vn, both just written by this program) instead of held
    whole in registers: the same chains, the same bits."""
    bh, cols, r, dk, s_ptrs = _head_tile(s_ptr, C, DK, DV, BV)
    S = tl.load(s_ptrs)
    for c in range(NC):
        base = (bh * NC + c) * C
        h_c = h_ptr + (bh * NC + c) * DK * DV
        vn_c = vn_ptr + base * DV
        tl.store(h_c + dk[:, None] * DV + cols[None, :], S)
        tl.debug_barrier()                       # the state's rows, written by all threads, read by each
        w_s = _chain(tl.zeros([C, BV], dtype=tl.float32), w_ptr + base * DK, DK, 1, h_c, DV, 1, r, cols, DK, KS)
        v_new = _sub_rn(tl.load(u_ptr + (base + r[:, None]) * DV + cols[None, :]), w_s, INTERPRETED)
        tl.store(vn_c + r[:, None] * DV + cols[None, :], v_new)
        tl.debug_barrier()
        # k_d^T v_new: k_d^T's element (i, k) is k_d's (k, i)
        kv = _chain(tl.zeros([DK, BV], dtype=tl.float32), kd_ptr + base * DK, 1, DK, vn_c, DV, 1, dk, cols, C, KS)
        carry = tl.zeros([DK, BV], dtype=tl.float32) + tl.load(carry_ptr + bh * NC + c)   # + 0: exact
        S = _add_rn(_mul_rn(S, carry, INTERPRETED), kv, INTERPRETED)
    tl.store(s_ptrs, S)


@triton.jit
def _outputs_sliced_kernel(qd_ptr, a_ptr, h_ptr, vn_ptr, o_ptr, C: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr, INTERPRETED: tl.constexpr):
    """_outputs_kernel with both products' operands read a slice of KS at a time."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    r = tl.arange(0, C)
    base = chunk * C
    qh = _chain(tl.zeros([C, BV], dtype=tl.float32), qd_ptr + base * DK, DK, 1, h_ptr + chunk * DK * DV, DV, 1, r,
                cols, DK, KS)
    av = _chain(tl.zeros([C, BV], dtype=tl.float32), a_ptr + base * C, C, 1, vn_ptr + base * DV, DV, 1, r, cols, C,
                KS)
    tl.store(o_ptr + (base + r[:, None]) * DV + cols[None, :], _add_rn(qh, av, INTERPRETED))


def recurrence(u, w, qd, kd, attn, carry, state, capture: int | None = None, captured=None, block_v: int = 32,
               form: str = "sliced", num_warps: int = 8, k_slice: int = 32):
    """The reference rule's chunk loop (delta_rule_chunked_reference's) over fp32 u [BH, NC, C, Dv],
    w, qd, kd [BH, NC, C, Dk], attn [BH, NC, C, C], carry [BH, NC], from state [BH, Dk, Dv]
    (contiguous fp32, updated in place to the final state). Returns out [BH, NC, C, Dv]; with
    capture=c the state at chunk c's start is written into captured [BH, Dk, Dv]. form "fused":
    one kernel walks the chunks and writes the outputs as it goes; "split": the walk keeps each
    chunk's starting state and new values, a second kernel forms the outputs in parallel over the
    chunks (the same products, the same bits; more memory: NC states per sequence-head); "sliced":
    split, each product's operands read back from memory k_slice of its inner dimension at a time
    (a multiple of 16 dividing 64 and Dk) instead of held whole in registers (the same bits). The
    default, sliced with 32 columns, 8 warps and slices of 32, was the fastest of eight sliced
    launch shapes over 1x512, 4x2048 and 16x512 together on an H200 (session 21: 0.12 / 1.56 / 1.30
    ms, against split 32/8's 0.92 / 13.6 / 13.7 and fused 32/4's 2.6 / 20.5 / 20.6 in session 20;
    all bit-equal)."""
    BH, NC, C, Dv = u.shape
    Dk = w.shape[-1]
    out = torch.empty(u.shape, dtype=u.dtype, device=u.device)      # contiguous, whatever u's strides
    bv = min(block_v, Dv)
    if Dv % bv:
        raise ValueError(f"recurrence: Dv {Dv} is not a multiple of {bv}")
    if form not in ("fused", "split", "sliced"):
        raise ValueError(f"recurrence: form {form!r} is not 'fused', 'split' or 'sliced'")
    if form == "sliced" and (k_slice % 16 or C % k_slice or Dk % k_slice):
        raise ValueError(f"recurrence: k_slice {k_slice} is not a multiple of 16 dividing {C} and Dk {Dk}")
    interpreted = not u.is_cuda
    u, w, qd, kd, attn, carry = (t.contiguous() for t in (u, w, qd, kd, attn, carry))
    if form in ("split", "sliced"):
        h = torch.empty((BH, NC, Dk, Dv), dtype=torch.float32, device=u.device)
        v_new = torch.empty_like(out)
        if form == "split":
            _states_kernel[(BH, Dv // bv)](u, w, kd, carry, state, h, v_new, NC, C=C, DK=Dk, DV=Dv, BV=bv,
                                           INTERPRETED=interpreted, num_warps=num_warps, num_stages=1)
            _outputs_kernel[(BH * NC, Dv // bv)](qd, attn, h, v_new, out, C=C, DK=Dk, DV=Dv, BV=bv,
                                                 INTERPRETED=interpreted, num_warps=num_warps, num_stages=1)
        else:
            _states_sliced_kernel[(BH, Dv // bv)](u, w, kd, carry, state, h, v_new, NC, C=C, DK=Dk, DV=Dv, BV=bv,
                                                  KS=k_slice, INTERPRETED=interpreted, num_warps=num_warps,
                                                  num_stages=1)
            _outputs_sliced_kernel[(BH * NC, Dv // bv)](qd, attn, h, v_new, out, C=C, DK=Dk, DV=Dv, BV=bv,
                                                        KS=k_slice, INTERPRETED=interpreted, num_warps=num_warps,
                                                        num_stages=1)
        if capture is not None:
            captured.copy_(h[:, capture])
        return out
    cap = captured if captured is not None else state
    _recurrence_kernel[(BH, Dv // bv)](u, w, qd, kd, attn, carry, state, out, cap, NC,
                                       -1 if capture is None else capture, C=C, DK=Dk, DV=Dv, BV=bv,
                                       HAS_CAPTURE=capture is not None, INTERPRETED=interpreted,
                                       num_warps=num_warps,
                                       num_stages=1)   # no loads kept in flight: its operands fill shared memory
    return out


def recurrence_reference(u, w, qd, kd, attn, carry, state):
    """recurrence's function on torch's ops, as delta_rule_chunked_reference's loop runs them
    (batched over BH): (out, final state); state is not changed."""
    S = state.clone()
    out = torch.empty_like(u)
    for c in range(u.shape[1]):
        v_new = u[:, c] - w[:, c] @ S
        out[:, c] = qd[:, c] @ S + attn[:, c] @ v_new
        S = S * carry[:, c, None, None] + kd[:, c].transpose(-1, -2) @ v_new
    return out, S


def delta_rule_chunked_exact(q, k, v, g, beta, state=None, l2norm: bool = True, capture: int | None = None,
                             solve: dict | None = None, loop: dict | None = None, systems: str = "torch"):
    """delta_rule_chunked_reference's function and arguments (q, k, v [B, T, H, D] with H heads
    each, g, beta [B, T, H], state [B, H, Dk, Dv] fp32 or None), its bits on the GPU: the same torch
    ops up to the solve, then solve_unit_lower and recurrence (solve, loop: their keyword arguments,
    form and launch shape; None: their defaults). systems "triton": the two [C, C] products and
    their decays by chunk_systems instead of torch's ops (the same bits)."""
    C = gdn.CHUNK
    dtype = q.dtype
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    if systems not in ("torch", "triton"):
        raise ValueError(f"delta_rule_chunked_exact: systems {systems!r} is not 'torch' or 'triton'")
    q, k, vb, gamma, system, attn, kb_decayed = gdn.chunked_pieces(
        q, k, v, g, beta, l2norm, C, chunk_systems if systems == "triton" else gdn.chunk_systems_reference)
    n = gamma.shape[2]
    if B * H * n > LOOPED_SOLVES:
        uw = solve_unit_lower(system, torch.cat([vb, kb_decayed], dim=-1), **(solve or {}))
        u, w = uw[..., :Dv], uw[..., Dv:]
    else:       # so few systems that torch solves them one by one: its own calls
        u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb_decayed, upper=False, unitriangular=True)
    S = gdn._initial(state, (B, H, Dk, Dv), u).contiguous().clone()
    qd = q * gamma.exp().unsqueeze(-1)
    kd = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    carry = gamma[..., -1].exp()
    captured = None
    if capture is not None:
        if not 0 <= capture < n:
            raise ValueError(f"delta_rule_chunked_exact: capture {capture} is not a chunk of the {n} here")
        captured = torch.empty_like(S)
    flat = lambda t: t.reshape(B * H, n, *t.shape[3:])  # noqa: E731
    out = recurrence(flat(u), flat(w), flat(qd), flat(kd), flat(attn), carry.reshape(B * H, n),
                     S.view(B * H, Dk, Dv), capture, None if captured is None else captured.view(B * H, Dk, Dv),
                     **(loop or {}))
    out = out.reshape(B, H, n * C, Dv)[:, :, :T]
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return (out, S) if capture is None else (out, S, captured)


def chunked_prefill_exact(q, k, v, g, beta, block_v=None, plan=None, state_out=None, initial_state=None,
                          capture=None):
    """gdn.chunked_prefill's contract (q, k heads shared by index; state_out, initial_state, capture
    (c, out)) on delta_rule_chunked_exact: the reference's bits (gdn.chunked_prefill_reference's)
    from these kernels. block_v and plan are the fast kernels' and unused."""
    return gdn.with_prefill_contract(delta_rule_chunked_exact, q, k, v, g, beta, state_out, initial_state, capture)
