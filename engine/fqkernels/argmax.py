"""Row-wise argmax of the logits, with torch.argmax's rules.

    out[m] = the lowest index of the largest value of x[m, :]   (ties: lowest index)
             the lowest index of a NaN, when the row holds one   (NaN counts as the largest)

Values are compared in float32 (exact for BF16/FP16 input), so the result is
torch.argmax(x, dim=-1)'s bit for bit, -inf rows and ties included.

Two kernels. The first splits each row into CHUNK-wide parts, one program a
part; a program keeps, lane by lane, the first index of the largest value it
has seen (a later equal value never replaces it) and the first NaN index, then
reduces its lanes to (largest value, its lowest index, first NaN index). The
second reduces a row's parts in order. Parts cover increasing index ranges, so
"lowest index among the equal largest" is the same rule at both levels.
Shapes: x [M, V] (unit stride on V), float32/bfloat16/float16; out [M] int64.
"""
import torch
import triton
import triton.language as tl

from fqkernels import pdl

BLOCK = 1024          # elements a program loads at once (8 a thread at 4 warps: 16-byte BF16 loads)
MAX_PARTS = 1024      # a row's parts, reduced by one program of the second kernel
_NONE = tl.constexpr(2 ** 31 - 1)   # "no index yet": larger than any column (kernels and host)


@triton.jit
def _argmax_parts_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, V, stride_x, PARTS,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    part = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    none = tl.full([BLOCK], _NONE, tl.int32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = none
    first_nan = none
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    for start in tl.static_range(0, CHUNK, BLOCK):
        offs = part * CHUNK + start + lane
        valid = offs < V
        x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.where(is_nan, offs, none))
        # NaN compares false both ways: it never becomes `best` (first_nan decides those rows).
        # Equal values replace only a lane's empty slot, so each lane keeps its first index;
        # a row of -inf still gets indices.
        take = (x > best) | ((x == best) & (best_i == none) & valid)
        best = tl.where(take, x, best)
        best_i = tl.where(take, offs, best_i)
    m = tl.max(best, axis=0)
    out = row * PARTS + part
    tl.store(val_ptr + out, m)
    tl.store(idx_ptr + out, tl.min(tl.where(best == m, best_i, none), axis=0))
    tl.store(nan_ptr + out, tl.min(first_nan, axis=0))


@triton.jit
def _argmax_final_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, PARTS,
                         BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < PARTS
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    v = tl.load(val_ptr + row * PARTS + offs, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * PARTS + offs, mask=mask, other=_NONE)
    n = tl.load(nan_ptr + row * PARTS + offs, mask=mask, other=_NONE)
    m = tl.max(v, axis=0)
    best = tl.min(tl.where(v == m, i, _NONE), axis=0)
    first_nan = tl.min(n, axis=0)
    res = tl.where(first_nan < _NONE, first_nan, best)
    tl.store(out_ptr + row, res.to(tl.int64))


def plan(rows: int, cols: int) -> tuple[int, int, int]:
    """(block, chunk, parts) for an [rows, cols] argmax: about 150+ programs at one row,
    wider parts (up to 8 blocks) as rows grow, at most MAX_PARTS parts a row."""
    block = min(BLOCK, max(16, triton.next_power_of_2(cols)))
    iters = min(8, max(1, triton.next_power_of_2(rows) // 2))
    iters = max(iters, triton.cdiv(cols, block * MAX_PARTS))
    chunk = block * iters
    return block, chunk, triton.cdiv(cols, chunk)


def argmax(x: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D x: int64 [M]."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, vocab], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"x needs unit stride on its last dim, got strides {x.stride()}")
    M, V = x.shape
    if M == 0 or V == 0:
        raise ValueError(f"argmax of an empty tensor (shape {tuple(x.shape)})")
    if V >= _NONE.value:
        raise ValueError(f"{V} columns do not fit the kernel's int32 indices")
    if out is None:
        out = torch.empty(M, dtype=torch.int64, device=x.device)
    elif out.dtype != torch.int64 or tuple(out.shape) != (M,):
        raise ValueError(f"out must be int64 of shape ({M},), got {out.dtype} {tuple(out.shape)}")
    block, chunk, parts = plan(M, V)
    vals = torch.empty((M, parts), dtype=torch.float32, device=x.device)
    idx = torch.empty((M, parts), dtype=torch.int32, device=x.device)
    nans = torch.empty((M, parts), dtype=torch.int32, device=x.device)
    use_pdl, pdl_launch = pdl.for_rows(M)
    _argmax_parts_kernel[(M, parts)](x, vals, idx, nans, V, x.stride(0), parts, CHUNK=chunk, BLOCK=block,
                                     num_warps=4, PDL=use_pdl, **pdl_launch)
    _argmax_final_kernel[(M,)](vals, idx, nans, out, parts, BLOCK_P=max(16, triton.next_power_of_2(parts)),
                               num_warps=4, PDL=use_pdl, **pdl_launch)
    return out


def argmax_reference(x: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """The reference's greedy pick: torch.argmax over the last dim (first index of the max; NaN wins)."""
    if out is None:
        return torch.argmax(x, dim=-1)
    return out.copy_(torch.argmax(x, dim=-1))
