"""Qwen3.5's gated RMSNorm (after each GDN layer's rule) for heads of 128, with PyTorch's bits.

    out = bf16( bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) * silu(z) ),  silu in fp32

The mean of squares is summed in torch's own order for a 128-wide row (fqkernels/rmsnorm.py:
lane t's four accumulators, then the lane tree, as the installed torch sums it), its squares and
the product by 1/D each one rounding, so the result is gdn_ref.gated_rmsnorm_reference's on
the GPU bit for bit. `gated_norm_rows` is the device function; the exact GDN step
(gdn_exact_step) ends with it in its own program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fqkernels import pdl
from fqkernels.rmsnorm import _inverse, torch_order
from fqkernels.rounding import mul_rn

EPS = 1e-6


@triton.jit
def _lane_sum_rows(acc, ROWS: tl.constexpr, HALVES: tl.constexpr):
    """rmsnorm._lane_sum for ROWS rows at once: acc [ROWS, 32 lanes, 4]. Each lane's
    ((a0 + a1) + a2) + a3, then the lane tree, halves first (lane t + 16, then + 8, ...) or
    adjacent pairs first, each level a sum over an axis of two (one fp add per output, in
    either operand order the same value): every row's sum has _lane_sum's bits."""
    col = tl.arange(0, 4)[None, None, :]
    v = tl.sum(tl.where(col == 0, acc, 0.0), axis=2)                     # [ROWS, 32]
    for i in tl.static_range(1, 4):
        v = v + tl.sum(tl.where(col == i, acc, 0.0), axis=2)
    if HALVES:
        v = tl.sum(tl.reshape(v, (ROWS, 2, 16)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 8)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 4)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 2)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 1)), axis=1)
    else:
        v = tl.sum(tl.reshape(v, (ROWS, 16, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 8, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 4, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 1, 2)), axis=2)
    return tl.reshape(v, (ROWS,))


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, R, inv_n, eps, z_heads, stride_z, D: tl.constexpr,
                          ROWS: tl.constexpr, VEC: tl.constexpr, HALVES: tl.constexpr, PDL: tl.constexpr = False,
                          INTERPRETED: tl.constexpr = False):
    """One program per ROWS rows of D = 128 values (gated_norm_rows). Row r's z is head r % z_heads
    of z's row r // z_heads (rows stride_z apart). The rows are one [ROWS, D] tile, so a program's
    loads are all in flight at once (a prompt's 8,192 tokens are 262,144 rows of the 4B's heads)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = (rows < R)[:, None]
    offs = tl.arange(0, D)[None, :]
    if PDL:    # a decode step's: the weight (no kernel writes it) before the wait, its HBM trip under the last kernel
        w = tl.load(w_ptr + offs)
    pdl.start(PDL)  # x and z are earlier kernels' outputs
    x = tl.load(x_ptr + rows[:, None] * D + offs, mask=ok, other=0.0)
    z = tl.load(z_ptr + (rows // z_heads)[:, None] * stride_z + (rows % z_heads)[:, None] * D + offs, mask=ok,
                other=0.0)
    if not PDL:
        w = tl.load(w_ptr + offs)
    tl.store(out_ptr + rows[:, None] * D + offs, gated_norm_rows(x, z, w, inv_n, eps, VEC, HALVES, INTERPRETED),
             mask=ok)


@triton.jit
def gated_norm_rows(x, z, w, inv_n, eps, VEC: tl.constexpr, HALVES: tl.constexpr, INTERPRETED: tl.constexpr):
    """The gated norm of rows x [ROWS, D] (bf16, D = 128) with their gates z [ROWS, D] (bf16) and
    weight w [1, D] (bf16): each row's mean of squares summed in torch's own order for one 128-wide block
    (fqkernels/rmsnorm.py: lane t's four accumulators, then the lane tree), y = bf16(x * rsqrt(mean
    + eps)), bf16(w * y), times silu(z) in fp32, rounded once. The squares and the mean's product
    by 1/D are each one rounding (mul.rn) whatever the caller's fp fusion, so a kernel compiled
    with fusion (the exact GDN step's, which ends with this) has the gated norm kernel's bits."""
    ROWS: tl.constexpr = x.shape[0]
    xf = x.to(tl.float32)
    sq = mul_rn(xf, xf, INTERPRETED)
    if VEC:
        lanes = tl.reshape(sq, (ROWS, 32, 4))
    else:
        lanes = tl.permute(tl.reshape(sq, (ROWS, 4, 32)), (0, 2, 1))
    mean = mul_rn(_lane_sum_rows(lanes, ROWS, HALVES), inv_n, INTERPRETED)
    y = (xf * tl.rsqrt(mean + eps)[:, None]).to(tl.bfloat16)
    wy = (w.to(tl.float32) * y.to(tl.float32)).to(tl.bfloat16)
    zf = z.to(tl.float32)
    return (wy.to(tl.float32) * (zf / (1.0 + tl.exp(-zf)))).to(tl.bfloat16)


# Rows a program of gated_rmsnorm takes, and its warps, past 4,096 rows (a prompt's; a decode step
# runs one row and one warp a program)
GATED_NORM_ROWS = 8
GATED_NORM_WARPS = 2


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = EPS,
                  rows_per_program: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """gated_rmsnorm_reference as one kernel for heads of 128: x [R, 128] bf16, w [128] bf16, z
    bf16 either [R, 128] or [G, H * 128] with R = G H (e.g. the z columns of a packed
    projection's rows, read in place: any row stride, unit column stride); z's rows in
    x's order. rows_per_program (a power of two) and num_warps: the launch (None: one row and
    one warp a program up to 4,096 rows, else GATED_NORM_ROWS and GATED_NORM_WARPS); every
    launch gives the same bits."""
    R, D = x.shape
    if D != 128 or z.dim() != 2 or z.shape[1] % D or z.shape[0] * (z.shape[1] // D) != R or tuple(w.shape) != (D,):
        raise ValueError(f"gdn_norm.gated_rmsnorm: x {tuple(x.shape)}, z {tuple(z.shape)}, w {tuple(w.shape)}: "
                         "rows of 128 (the 4B's value head), z's rows holding whole heads, one weight per column")
    small = R <= 4096
    rows = rows_per_program or (1 if small else GATED_NORM_ROWS)
    warps = num_warps or (1 if small else GATED_NORM_WARPS)
    if rows < 1 or rows & (rows - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"gdn_norm.gated_rmsnorm: rows_per_program ({rows}) and num_warps ({warps}) must be powers of two")
    x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty_like(x)
    vec, halves, _ = torch_order(D, x.device)
    use_pdl, pdl_launch = pdl.for_rows(z.shape[0])
    _gated_rmsnorm_kernel[(triton.cdiv(R, rows),)](x, z, w, out, R, _inverse(D), eps, z.shape[1] // D, z.stride(0),
                                                   D=D, ROWS=rows, VEC=vec, HALVES=halves, PDL=use_pdl,
                                                   INTERPRETED=_INTERPRETED, num_warps=warps, enable_fp_fusion=False,
                                                   **pdl_launch)
    return out



_INTERPRETED = type(_gated_rmsnorm_kernel).__name__ == "InterpretedFunction"
