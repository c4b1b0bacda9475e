"""A masked copy of sequences' rows, for speculative decoding's rollback (fq_qwen35.commit_verify):
dst[:, b] = src[:, b] where mask[b], over tensors [G, B, ...] (a layer axis, then the sequence),
each (layer, sequence) row contiguous. Graph-safe, and only the selected rows are read and
written: the copy is predicated on the mask, where a torch.where would read every row of both
(48 MB a sequence for Qwen3.5-4B's recurrent states; a verify restores a few rows at most)."""
import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _copy_rows_where_kernel(dst_ptr, src_ptr, mask_ptr, B, row_elems, dst_stride_g, dst_stride_b,
                            src_stride_g, src_stride_b, BLOCK: tl.constexpr):
    gb = tl.program_id(0)
    g = (gb // B).to(tl.int64)
    b = (gb % B).to(tl.int64)
    take = tl.load(mask_ptr + b) != 0
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = (offs < row_elems) & take          # a row not taken: every load and store predicated off
    v = tl.load(src_ptr + g * src_stride_g + b * src_stride_b + offs, mask=m)
    tl.store(dst_ptr + g * dst_stride_g + b * dst_stride_b + offs, v, mask=m)


def copy_rows_where(dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
    """dst[:, b] = src[:, b] for every b with mask[b] (mask [B] bool); dst and src [G, B, ...] of one
    shape and dtype on one device, each [g, b] row contiguous. A ValueError names a bad argument."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device or dst.dim() < 2:
        raise ValueError(f"copy_rows_where: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} "
                         f"{src.dtype} must be one shape [G, B, ...] and dtype on one device")
    G, B = dst.shape[:2]
    if tuple(mask.shape) != (B,) or mask.dtype != torch.bool or mask.device != dst.device:
        raise ValueError(f"copy_rows_where: mask must be bool [{B}] on {dst.device}, got {mask.dtype} "
                         f"{tuple(mask.shape)} on {mask.device}")
    row = dst[0, 0].numel()
    for t, name in ((dst, "dst"), (src, "src")):
        if not t[0, 0].is_contiguous() or (row > 1 and t.stride(-1) != 1):
            raise ValueError(f"copy_rows_where: each {name}[g, b] must be contiguous")
    if G * B == 0 or row == 0:
        return
    _copy_rows_where_kernel[(G * B, triton.cdiv(row, BLOCK))](
        dst, src, mask, B, row, dst.stride(0), dst.stride(1), src.stride(0), src.stride(1), BLOCK=BLOCK)


def copy_rows_where_reference(dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
    """copy_rows_where in torch (reads every row)."""
    dst.copy_(torch.where(mask.view(1, -1, *([1] * (dst.dim() - 2))), src, dst))
