"""A plain decode step's bookkeeping between speculative verifies (fq_decode.SpecRunner's plain
step, speculation "auto"): the step's inputs read from the sequences' state before it, and its
pick appended after it, one launch each, where torch's ops took 13 small launches inside the
step's graph (what they cost: docs/PERFORMANCE.md).

The state is fq_spec.SpecState's: seq [B, W] int64 (prompt, then emitted tokens), length [B]
int64 (how many), limit [B] int64 (where a sequence stops)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _plain_inputs_kernel(seq_ptr, length_ptr, tok_ptr, pos_len_ptr, B, seq_stride, BLOCK: tl.constexpr):
    b = tl.arange(0, BLOCK)
    m = b < B
    n = tl.load(length_ptr + b, mask=m, other=1)
    tok = tl.load(seq_ptr + b.to(tl.int64) * seq_stride + n - 1, mask=m, other=0)
    tl.store(tok_ptr + b, tok, mask=m)
    tl.store(pos_len_ptr + b, (n - 1).to(tl.int32), mask=m)
    tl.store(pos_len_ptr + B + b, n.to(tl.int32), mask=m)


@triton.jit
def _plain_advance_kernel(pick_ptr, seq_ptr, length_ptr, limit_ptr, packed_ptr, B, seq_stride,
                          BLOCK: tl.constexpr):
    b = tl.arange(0, BLOCK)
    m = b < B
    n = tl.load(length_ptr + b, mask=m, other=0)
    emit = (n < tl.load(limit_ptr + b, mask=m, other=0)).to(tl.int64)
    pick = tl.load(pick_ptr + b, mask=m, other=0)
    tl.store(seq_ptr + b.to(tl.int64) * seq_stride + n, pick, mask=m & (emit != 0))
    tl.store(length_ptr + b, n + emit, mask=m)
    tl.store(packed_ptr + 2 * b, pick, mask=m)
    tl.store(packed_ptr + 2 * b + 1, emit, mask=m)


def _check(seq: torch.Tensor, length: torch.Tensor, **others: tuple) -> None:
    B = seq.shape[0]
    if seq.dim() != 2 or seq.dtype != torch.int64 or seq.stride(1) != 1:
        raise ValueError(f"spec_plain: seq must be int64 [B, W] with contiguous rows, got {seq.dtype} "
                         f"{tuple(seq.shape)} strides {seq.stride()}")
    for name, (t, shape, dtype) in {"length": (length, (B,), torch.int64), **others}.items():
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != seq.device:
            raise ValueError(f"spec_plain: {name} must be contiguous {dtype} {list(shape)} on {seq.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


def plain_inputs(seq: torch.Tensor, length: torch.Tensor, tok: torch.Tensor, pos_len: torch.Tensor) -> None:
    """The decode step's inputs: tok[b] = seq[b, length[b] - 1] (the last token, not yet in the
    cache), pos_len[0] = length - 1 (its position), pos_len[1] = length, as int32."""
    B = seq.shape[0]
    _check(seq, length, tok=(tok, (B,), torch.int64), pos_len=(pos_len, (2, B), torch.int32))
    _plain_inputs_kernel[(1,)](seq, length, tok, pos_len, B, seq.stride(0),
                               BLOCK=max(16, triton.next_power_of_2(B)))


def plain_advance(pick: torch.Tensor, seq: torch.Tensor, length: torch.Tensor, limit: torch.Tensor,
                  packed: torch.Tensor) -> None:
    """After the step: emit = length < limit (0 or 1, int64); where emit, seq[b, length[b]] = pick[b]
    and length[b] += 1; packed[b] = (pick[b], emit[b]), what the host reads."""
    B = seq.shape[0]
    _check(seq, length, pick=(pick, (B,), torch.int64), limit=(limit, (B,), torch.int64),
           packed=(packed, (B, 2), torch.int64))
    _plain_advance_kernel[(1,)](pick, seq, length, limit, packed, B, seq.stride(0),
                                BLOCK=max(16, triton.next_power_of_2(B)))


def plain_inputs_reference(seq: torch.Tensor, length: torch.Tensor, tok: torch.Tensor,
                           pos_len: torch.Tensor) -> None:
    """plain_inputs in torch."""
    tok.copy_(seq.gather(1, (length - 1).view(-1, 1)).view(-1))
    pos_len.copy_(torch.stack([length - 1, length]).to(torch.int32))


def plain_advance_reference(pick: torch.Tensor, seq: torch.Tensor, length: torch.Tensor, limit: torch.Tensor,
                            packed: torch.Tensor) -> None:
    """plain_advance in torch."""
    emit = (length < limit).to(torch.int64)
    at = length.view(-1, 1)
    seq.scatter_(1, at, torch.where(emit.view(-1, 1) != 0, pick.view(-1, 1), seq.gather(1, at)))
    length.add_(emit)
    packed.copy_(torch.stack([pick, emit], dim=1))
