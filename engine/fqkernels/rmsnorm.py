"""RMSNorm, and the residual add fused with the next RMSNorm.

Formula (the reference's cast points, kept exactly):
    s   = bf16(x + r)                         # residual add in BF16 (fused variant only)
    var = mean(float32(s)^2)
    y   = bf16(float32(s) * rsqrt(var + eps))  # normalized value rounded to BF16 ...
    out = bf16(y * w)                          # ... before the BF16 x BF16 weight product
Keeping y in float32 through the weight product would be "more accurate" and a
different function: it moves a cast point the 2.0-logit margin was calibrated on.
Shapes: x, r, out [M, N] bf16 (unit stride on N); w [N] bf16. One program per row.
`rmsnorm` also takes x [M, H, N], rows of heads read in place through x's strides (a column
slice of a packed product's rows, whose heads sit another stride apart than its rows); out is
then [M, H, N], contiguous.

`embed_rmsnorm` starts a forward pass: x = table[ids] (the embedding lookup, written
out as the residual stream) and its RMSNorm, in one kernel.

`add_rmsnorm_partials` takes r as the fp32 partial sums of a split-K product
(fqkernels.gemv.linear_partials, [S, M, N]) and first finishes that product the
way the GEMV's own reduce kernel does: r = bf16(p0 + p1 + ... + p_{S-1}) in that
order. So `linear` + `add_rmsnorm` and `linear_partials` + `add_rmsnorm_partials`
give the same bits, with one kernel fewer.

The mean of squares is summed in PyTorch's own order (`_rmsnorm_torch_order_kernel`).
The reference computes `x.pow(2).mean(-1)` with ATen's CUDA reduce kernel; for a row of
N contiguous fp32 values and 16 rows or more (every reference forward: its rows are
batch x sequence) that kernel runs one warp per row: lane t keeps four accumulators,
a_i = sum over blocks j of x[128 j + 4 t + i] (4-wide vector loads) or x[128 j + 32 i + t]
(scalar loads, 4 unrolled), in increasing j; the lane's value is ((a_0 + a_1) + a_2) + a_3;
the 32 lanes are combined by a warp shuffle tree; the mean is that sum times
float32(1 / N). Which loads and which tree (halves first, or adjacent pairs first) differ
between torch versions, so `torch_order` compares the installed torch's own mean with each
candidate once per width and the kernel sums that way (on torch 2.11: 4-wide from 128
elements, halves first). The kernel holds the row as
[blocks, 128]; column c (lane c // 4, accumulator c % 4 for 4-wide loads) is summed over
the blocks in program order by a tree of `tl.split`s that only moves values, so the
order is the program's on any Triton, not the compiler's choice for a tl.sum. Every row,
in a decode step of any batch or in a prefill, is then normalized with the bits the full
forward gives the same input row (GPU tests). Why: with Triton's own tl.sum (the other
kernel, `_rmsnorm_kernel`) the decode logits at batch 16-64 were ~5% further from the
full forward (mean max |diff|) than native's, and swapping in this order was the one op
change that closed it (docs/NUMERICS.md). It costs nothing measurable per decode step
(docs/PERFORMANCE.md). The torch-order kernel compiles without FMA
contraction (enable_fp_fusion=False) so that the mean times 1/N and the + eps stay two
roundings, as in the reference. TORCH_ORDER = False selects the tl.sum kernel, which also
serves rows wider than 64 x 128 and any width whose torch order is none of the kernel's (on
torch 2.11 none matches at 8,192, by the GPU tests; no Qwen3 norm is that wide).
"""
import functools

import torch
import triton
import triton.language as tl

from fqkernels import pdl


# Norms sum their squares in the installed torch's order (module doc); False sends every norm to
# the tl.sum kernel (scripts/compile_kernels.py builds that kernel this way; an A/B of the norms).
TORCH_ORDER: bool = True
# Widest row the torch-order kernel takes (64 blocks of 128); wider rows use tl.sum.
TORCH_ORDER_MAX_N = 64 * 128

# Lanes of the warp that reduces one row in ATen's reduce kernel (module doc).
_LANES = 32


@triton.jit
def _lane_sum(acc, HALVES: tl.constexpr):
    """The row's sum from the accumulators acc [32 lanes, 4] as ATen forms it: each lane's
    ((a0 + a1) + a2) + a3, then the 32 lane values by the warp shuffle tree, halves first
    (lane t + 16, then + 8, ...) or adjacent pairs first. The lane index is split into its
    five bits (t = 16 b4 + 8 b3 + 4 b2 + 2 b1 + b0) once, so each tree level is one sum over
    an axis of two: one fp add per output whatever order Triton adds two values in. A column
    is taken out exactly, as a sum with three zeros."""
    acc = tl.reshape(acc, (2, 2, 2, 2, 2, 4))
    col = tl.arange(0, 4)[None, None, None, None, None, :]
    v = tl.sum(tl.where(col == 0, acc, 0.0), axis=5)
    for i in tl.static_range(1, 4):
        v = v + tl.sum(tl.where(col == i, acc, 0.0), axis=5)
    if HALVES:
        for _ in tl.static_range(5):
            v = tl.sum(v, axis=0)
    else:
        for level in tl.static_range(5):
            v = tl.sum(v, axis=4 - level)
    return v


@triton.jit
def _row_values(src, r_ptr, stride_split, offs, mask,
                HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr):
    """The row's bf16 values at `offs`: src's, plus the residual (bf16 r, or the sum of
    SPLITS fp32 partials rounded to bf16) added in fp32 and rounded, as the reference adds."""
    x = tl.load(src + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        if SPLITS == 0:
            r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        else:
            part = tl.load(r_ptr + offs, mask=mask, other=0.0)
            for s in tl.static_range(1, SPLITS):
                part += tl.load(r_ptr + s * stride_split + offs, mask=mask, other=0.0)
            r = part.to(tl.bfloat16)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16)
    return x


@triton.jit
def _row_source(row, x_ptr, ids_ptr, table_ptr, stride_x, stride_h, stride_t, GATHER: tl.constexpr,
                HEADS: tl.constexpr):
    """Where the row's input values are: x's row, or (GATHER) row ids[row] of `table`; with
    HEADS > 1, head row % HEADS (stride_h apart) of x's row row // HEADS."""
    if GATHER:
        return table_ptr + tl.load(ids_ptr + row).to(tl.int64) * stride_t
    if HEADS > 1:
        return x_ptr + (row // HEADS) * stride_x + (row % HEADS) * stride_h
    return x_ptr + row * stride_x


@triton.jit
def _scaled(xf, inv, w, ONE_PLUS: tl.constexpr):
    """The normalized row times the weight, at the model's cast points: Qwen3 rounds
    x * inv to bf16 before w multiplies it; Qwen3.5's (1 + w) norm keeps
    (x * inv) * (1 + w) in fp32 and rounds once."""
    if ONE_PLUS:
        return ((xf * inv) * (1.0 + w.to(tl.float32))).to(tl.bfloat16)
    return ((xf * inv).to(tl.bfloat16).to(tl.float32) * w.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, ids_ptr, table_ptr, N, eps,
                    stride_x, stride_h, stride_r, stride_o, stride_split, stride_t,
                    HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                    GATHER: tl.constexpr = False, PDL: tl.constexpr = False, ONE_PLUS: tl.constexpr = False,
                    HEADS: tl.constexpr = 1):
    """The tl.sum kernel (TORCH_ORDER = False, and widths the torch-order kernel does not take):
    the mean of squares is Triton's tl.sum.
    SPLITS == 0: r is bf16; SPLITS >= 1: r is SPLITS fp32 partials, stride_split apart.
    GATHER: x's row is first copied from row ids[row] of `table` (the embedding lookup).
    HEADS > 1 (no residual, no gather): program `row` normalizes head row % HEADS of x's row
    row // HEADS (_row_source)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if PDL:    # a decode step's: the weight (no kernel writes it) before the wait, under the last kernel's tail
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    pdl.start(PDL)
    src = _row_source(row, x_ptr, ids_ptr, table_ptr, stride_x, stride_h, stride_t, GATHER, HEADS)
    x = _row_values(src, r_ptr + row * stride_r, stride_split, offs, mask, HAS_RESIDUAL, SPLITS)
    if GATHER or HAS_RESIDUAL:
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    if not PDL:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, _scaled(xf, tl.rsqrt(var + eps), w, ONE_PLUS), mask=mask)


@triton.jit
def _halves(t):
    """t [C, 2K] -> (t[:, :K], t[:, K:]), moved, not computed."""
    C: tl.constexpr = t.shape[0]
    K: tl.constexpr = t.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(t, (C, 2, K)), (0, 2, 1)))


@triton.jit
def _seq2(acc, t):
    """acc + t[:, 0] + t[:, 1], left to right (t [C, 2])."""
    a, b = tl.split(t)
    return (acc + a) + b


@triton.jit
def _seq4(acc, t):
    a, b = _halves(t)
    return _seq2(_seq2(acc, a), b)


@triton.jit
def _seq8(acc, t):
    a, b = _halves(t)
    return _seq4(_seq4(acc, a), b)


@triton.jit
def _seq16(acc, t):
    a, b = _halves(t)
    return _seq8(_seq8(acc, a), b)


@triton.jit
def _seq32(acc, t):
    a, b = _halves(t)
    return _seq16(_seq16(acc, a), b)


@triton.jit
def _seq64(acc, t):
    a, b = _halves(t)
    return _seq32(_seq32(acc, a), b)


@triton.jit
def _column_sums(t, NB: tl.constexpr):
    """[C] = each row of t [C, NB] summed left to right from 0 (NB a power of two <= 64), as
    ATen's accumulators run over the blocks: every add is one program-ordered fp add."""
    acc = tl.zeros([t.shape[0]], dtype=tl.float32)
    if NB == 1:
        return acc + tl.sum(t, axis=1)
    elif NB == 2:
        return _seq2(acc, t)
    elif NB == 4:
        return _seq4(acc, t)
    elif NB == 8:
        return _seq8(acc, t)
    elif NB == 16:
        return _seq16(acc, t)
    elif NB == 32:
        return _seq32(acc, t)
    else:
        return _seq64(acc, t)


@triton.jit
def _rmsnorm_torch_order_kernel(x_ptr, r_ptr, w_ptr, out_ptr, ids_ptr, table_ptr, stats_ptr, inv_n, eps,
                                stride_x, stride_h, stride_r, stride_o, stride_split, stride_t, N: tl.constexpr,
                                HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                                VEC: tl.constexpr, HALVES: tl.constexpr, STATS: tl.constexpr = False,
                                GATHER: tl.constexpr = False, PDL: tl.constexpr = False,
                                ONE_PLUS: tl.constexpr = False, HEADS: tl.constexpr = 1):
    """The row once, as [blocks, 128]; each of the 128 columns summed over the blocks in
    order, then column c is lane c // 4, accumulator c % 4 (VEC) or lane c % 32,
    accumulator c // 32, and the lanes go through ATen's tree (module doc).
    SPLITS == 0: r is bf16; SPLITS >= 1: r is SPLITS fp32 partials, stride_split apart.
    GATHER: x's row is first copied from row ids[row] of `table` (the embedding lookup).
    STATS: the row's mean of squares also goes to stats_ptr[row] (fp32; for the tests).
    HEADS > 1 (no residual, no gather): rows of heads, as in _rmsnorm_kernel."""
    row = tl.program_id(0)
    NB: tl.constexpr = (BLOCK + 127) // 128
    offs = tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = offs < N
    # a decode step's launch (PDL) loads the weight before the wait (no kernel writes it): its HBM
    # round trip under the previous kernel's tail, not after this row's sums (with the gated norm's
    # and the prologues', a shorter Qwen3.5 step: docs/PERFORMANCE.md); a prompt's, after the sums
    if PDL:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    pdl.start(PDL)
    src = _row_source(row, x_ptr, ids_ptr, table_ptr, stride_x, stride_h, stride_t, GATHER, HEADS)
    x = _row_values(src, r_ptr + row * stride_r, stride_split, offs, mask, HAS_RESIDUAL, SPLITS)
    xf = x.to(tl.float32)
    cols = _column_sums(tl.permute(xf * xf, (1, 0)), NB)
    if VEC:
        lanes = tl.reshape(cols, (32, 4))
    else:
        lanes = tl.permute(tl.reshape(cols, (4, 32)), (1, 0))
    mean = _lane_sum(lanes, HALVES) * inv_n
    if STATS:
        tl.store(stats_ptr + row, mean)
    inv = tl.rsqrt(mean + eps)
    if GATHER or HAS_RESIDUAL:
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    if not PDL:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, _scaled(xf, inv, w, ONE_PLUS), mask=mask)


@functools.lru_cache(maxsize=None)
def _inverse(n: int) -> float:
    """float32(1 / n), as ATen's mean computes its factor (float(outputs) / float(inputs)):
    one IEEE float32 division (the float64 value passed converts back to it exactly)."""
    one, count = torch.tensor(1.0, dtype=torch.float32), torch.tensor(float(n), dtype=torch.float32)
    return float(one / count)


def mean_of_squares_torch_order(x: torch.Tensor, vec: bool = True, halves: bool = True) -> torch.Tensor:
    """float32 [M] = mean(float32(x)^2) over the last dim of x [M, N] (any float dtype),
    summed in the order the kernel sums with (VEC, HALVES) = (vec, halves) (module doc),
    in torch's IEEE float32 arithmetic on any device: what the kernel must equal bit for bit."""
    m, n = x.shape
    sq = x.float().square()
    blocks = -(-n // 128)
    sq = torch.nn.functional.pad(sq, (0, blocks * 128 - n))
    # [M, block, i, lane]: accumulator i of lane t, summed block by block in order.
    if vec:
        parts = sq.view(m, blocks, _LANES, 4).transpose(2, 3)
    else:
        parts = sq.view(m, blocks, 4, _LANES)
    acc = torch.zeros(m, 4, _LANES, dtype=torch.float32, device=x.device)
    for j in range(blocks):
        acc = acc + parts[:, j]
    v = ((acc[:, 0] + acc[:, 1]) + acc[:, 2]) + acc[:, 3]
    while v.shape[1] > 1:
        half = v.shape[1] // 2
        v = v[:, :half] + v[:, half:] if halves else v[:, 0::2] + v[:, 1::2]
    return v[:, 0] * torch.tensor(_inverse(n), dtype=torch.float32, device=x.device)


# (width, device) -> (vec, halves, matched): the order torch's own mean uses here, found once.
_ORDERS: dict = {}


def torch_order(n: int, device: torch.device) -> tuple[bool, bool, bool]:
    """The (VEC, HALVES) order under which the kernel sums a row of width n as this torch's
    CUDA `pow(2).mean(-1)` does for 16 rows or more (every forward of the reference), and
    whether one matched. Measured, not assumed: ATen's lane tree and its vectorization
    threshold differ between torch versions (halves first and 4-wide from 128 elements on
    torch 2.11). Found by comparing torch's mean with each
    candidate on 64 random rows; with no match, the 2.11 order is used (and reported)."""
    key = (n, str(device))
    if device.type == "cuda" and not torch.cuda.is_available():
        return (n % 4 == 0 and n >= 128, True, False)   # compiling without a GPU: nothing to measure
    if key not in _ORDERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"rmsnorm: order for width {n} not known during graph capture; call once before")
        gen = torch.Generator(device=device).manual_seed(12345)
        x = (torch.randn((64, n), generator=gen, device=device) * 4).to(torch.bfloat16)
        want = x.float().pow(2).mean(-1)
        vec_ok = n % 4 == 0 and n >= 128
        found = None
        for vec in ((True, False) if vec_ok else (False,)):
            for halves in (True, False):
                if found is None and torch.equal(mean_of_squares_torch_order(x, vec, halves), want):
                    found = (vec, halves, True)
        _ORDERS[key] = found or (vec_ok, True, False)
    return _ORDERS[key]


def torch_order_launch(n: int, device: torch.device) -> tuple[bool, bool] | None:
    """(VEC, HALVES) where a norm of width n runs the torch-order kernel (TORCH_ORDER on, n within
    TORCH_ORDER_MAX_N, and this torch's order one the kernel implements, or nothing to measure
    it on); None where the tl.sum kernel runs. Every kernel that sums a norm's squares in torch's
    order (this file's, and those that fold a norm in) decides through this."""
    if not TORCH_ORDER or n > TORCH_ORDER_MAX_N:
        return None
    vec, halves, matched = torch_order(n, device)
    return (vec, halves) if matched or _no_order_to_measure(device) else None


def _no_order_to_measure(device: torch.device) -> bool:
    """Compiling without a GPU, or running under the interpreter on the CPU: torch_order
    cannot say what the GPU's torch does, and the torch-order kernel is the one to build."""
    return device.type != "cuda" or not torch.cuda.is_available()


def _check(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs unit stride on its last dim, got strides {t.stride()}")


def _launch(x, r, w, eps, out, partials=False, gather=None, stats=None, one_plus=False):
    """gather: (ids, table) to fill x with table[ids] first (x then is written, not read).
    stats: an fp32 [M] tensor for each row's mean of squares (runs the torch-order kernel).
    x [M, H, N] (rmsnorm's rows of heads; r and gather None): out is [M * H, N]."""
    heads = x.shape[1] if x.dim() == 3 else 1
    _check("x", x, 3 if x.dim() == 3 and r is None and gather is None else 2)
    _check("w", w, 1)
    splits, stride_split = 0, 0
    if partials:
        if r.dtype != torch.float32:
            raise ValueError(f"partials must be float32, got {r.dtype}")
        if r.dim() != 3 or tuple(r.shape[1:]) != tuple(x.shape) or r.shape[0] < 1:
            raise ValueError(f"partials must have shape [S, {x.shape[0]}, {x.shape[1]}], got {tuple(r.shape)}")
        if r.stride(-1) != 1:
            raise ValueError(f"partials need unit stride on their last dim, got strides {r.stride()}")
        splits, stride_split = r.shape[0], r.stride(0)
        r = r[0]
    elif r is not None:
        _check("residual", r, 2)
        if r.shape != x.shape:
            raise ValueError(f"residual shape {tuple(r.shape)} != x shape {tuple(x.shape)}")
    N = x.shape[-1]
    M = x.shape[0] * heads
    if w.shape[0] != N:
        raise ValueError(f"weight has {w.shape[0]} elements, rows have {N}")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _check("out", out, 2)
    if tuple(out.shape) != (M, N):
        raise ValueError(f"out must have shape ({M}, {N}), got {tuple(out.shape)}")
    block = triton.next_power_of_2(N)
    use_pdl, pdl_launch = pdl.for_rows(x.shape[0])     # tokens: a decode step's heads are one launch
    ids, table = gather if gather is not None else (x, x)   # (no gather: unused)
    rows = (x, r if r is not None else x, w, out, ids, table)
    strides = (x.stride(0), x.stride(1) if heads > 1 else 0, (r if r is not None else x).stride(0), out.stride(0),
               stride_split, table.stride(0) if gather is not None else 0)
    flags = dict(HAS_RESIDUAL=r is not None, SPLITS=splits, BLOCK=block, GATHER=gather is not None,
                 ONE_PLUS=bool(one_plus), HEADS=heads, num_warps=4 if block <= 4096 else 8, PDL=use_pdl,
                 **pdl_launch)
    # The torch-order kernel where torch_order_launch takes it, or when asked for its
    # statistics (in the order torch_order found, or 2.11's); else the tl.sum kernel.
    order = torch_order_launch(N, x.device)
    if order is None and stats is not None:
        order = torch_order(N, x.device)[:2]
    if order is not None:
        _rmsnorm_torch_order_kernel[(M,)](*rows, stats if stats is not None else x, _inverse(N), eps, *strides,
                                          N=N, VEC=order[0], HALVES=order[1], STATS=stats is not None,
                                          enable_fp_fusion=False, **flags)
    else:
        _rmsnorm_kernel[(M,)](*rows, N, eps, *strides, **flags)
    return out


def embed_rmsnorm(ids: torch.Tensor, table: torch.Tensor, w: torch.Tensor, eps: float,
                  x: torch.Tensor = None, out: torch.Tensor = None,
                  one_plus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x = table[ids] (the residual stream's start), out = RMSNorm(x) * w: (x, out), one kernel.
    ids [M] int64/int32, each in [0, table rows): the caller's check, the kernel does not bound it."""
    _check("table", table, 2)
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be a 1-D int64/int32 tensor, got {ids.dtype} {tuple(ids.shape)}")
    M, N = ids.shape[0], table.shape[1]
    if x is None:
        x = torch.empty((M, N), dtype=table.dtype, device=table.device)
    if tuple(x.shape) != (M, N):
        raise ValueError(f"x must have shape ({M}, {N}), got {tuple(x.shape)}")
    return x, _launch(x, None, w, eps, out, gather=(ids, table), one_plus=one_plus)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor = None,
            one_plus: bool = False) -> torch.Tensor:
    """out = RMSNorm(x) * w with the reference's cast points (one_plus: Qwen3.5's
    (1 + w) norm, rmsnorm_one_plus_reference). x [M, N], or [M, H, N]: each head's row
    normalized, read in place through x's strides (Qwen3.5's q and k heads: column slices of
    the attention's packed q | k | v product); out then [M, H, N], contiguous."""
    if x.dim() != 3:
        return _launch(x, None, w, eps, out, one_plus=one_plus)
    if out is None:
        out = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be contiguous of shape {tuple(x.shape)}, got {tuple(out.shape)} "
                         f"with strides {out.stride()}")
    _launch(x, None, w, eps, out.view(-1, x.shape[-1]), one_plus=one_plus)
    return out


def add_rmsnorm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor = None,
                one_plus: bool = False) -> torch.Tensor:
    """x <- bf16(x + r) in place (the residual stream); returns RMSNorm(x) * w (or * (1 + w))."""
    return _launch(x, r, w, eps, out, one_plus=one_plus)


def add_rmsnorm_partials(x: torch.Tensor, partials: torch.Tensor, w: torch.Tensor, eps: float,
                         out: torch.Tensor = None) -> torch.Tensor:
    """x <- bf16(x + bf16(sum of the fp32 partials [S, M, N] in order)); returns RMSNorm(x) * w."""
    return _launch(x, partials, w, eps, out, partials=True)


def torch_order_mean_of_squares(x: torch.Tensor, r: torch.Tensor = None, partials: bool = False) -> torch.Tensor:
    """fp32 [M]: the mean of squares the torch-order kernel normalizes each row of bf16(x + r)
    with (r bf16, or fp32 partials [S, M, N] with partials=True; x is not modified). For the
    tests: the outputs alone rarely show a one-ulp difference in it."""
    if x.shape[1] > TORCH_ORDER_MAX_N:
        raise ValueError(f"the torch-order kernel takes rows up to {TORCH_ORDER_MAX_N} wide, got {x.shape[1]}")
    if not (torch_order(x.shape[1], x.device)[2] or _no_order_to_measure(x.device)):
        raise ValueError(f"torch {torch.__version__} sums rows of width {x.shape[1]} in an order the torch-order "
                         "kernel does not implement (the norms use the tl.sum kernel there)")
    stats = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    w = torch.ones(x.shape[1], dtype=torch.bfloat16, device=x.device)
    _launch(x.clone(), r, w, 1e-6, None, partials=partials, stats=stats)
    return stats


def rmsnorm_one_plus_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers 5.17's Qwen3_5RMSNorm: fp32 x * rsqrt(mean x^2 + eps) * (1 + w), rounded once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


def rmsnorm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' Qwen3RMSNorm, op for op."""
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def embed_rmsnorm_reference(ids: torch.Tensor, table: torch.Tensor, w: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = table[ids]
    return x, rmsnorm_reference(x, w, eps)


def add_rmsnorm_reference(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x.add_(r)  # BF16 add, in place like the fused kernel
    return rmsnorm_reference(x, w, eps)


def add_rmsnorm_partials_reference(x: torch.Tensor, partials: torch.Tensor, w: torch.Tensor,
                                   eps: float) -> torch.Tensor:
    """The partials summed in order 0..S-1 in fp32, rounded to bf16, then add_rmsnorm_reference."""
    acc = partials[0].clone()
    for s in range(1, partials.shape[0]):
        acc += partials[s]
    return add_rmsnorm_reference(x, acc.to(torch.bfloat16), w, eps)
