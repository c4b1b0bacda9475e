"""Per-head Q/K RMSNorm + rotary embedding + KV-cache write, fused.

For token t of sequence b at position p = positions[b] + t % seq_len, and each
head of the packed qkv row [q heads | k heads | v heads] (D = head_dim):
    n   = RMSNorm(x_head) * norm_w              (cast points as in rmsnorm.py)
    out = bf16(bf16(n * cos[p]) + bf16(rotate_half(n) * sin[p]))
rotate_half(n) = [-n[D/2:], n[:D/2]] (not interleaved). cos/sin are BF16 tables
built exactly as the reference builds them (float32, then cast), so each
product is rounded to BF16 before the sum, as the reference rounds it.
Q heads go to q_out [T, H, D]; K heads go to k_cache[b, kvh, p]; V heads are
copied unchanged to v_cache[b, kvh, p]. Caches are [B, KVH, C, D] (strided views
of the full [L, B, KVH, C, D] buffers are fine; unit stride on D).
Grid: (T, H + KVH), one program per (token, q-or-k head).

Paged caches (block_table, as vLLM's): the caches are page pools [P, KVH, PAGE, D]
and position p of sequence b lives in page block_table[b, p // PAGE] at offset
p % PAGE; only the store address changes (PAGED=False compiles none of it in).

Why `_round_bf16` instead of `.to(tl.bfloat16).to(tl.float32)`: measured on an
H200 (Triton 3.6), the cast pair before the sum was not honoured: the two
products were summed unrounded (contracted into an FMA), and 16% of the outputs
differed from the reference, by up to 256 ulps where the sum cancels. Rounding
with integer arithmetic cannot be folded or contracted away.
"""
import torch
import triton
import triton.language as tl

from fqkernels import pdl
from fqkernels.rmsnorm import _column_sums, _lane_sum, _scaled


@triton.jit
def _round_bf16(x):
    """x (float32) rounded to the nearest BF16 (ties to even), kept as float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _position_rows(pos_ptr, b, offset, cos_ptr, sin_ptr, stride_c, offs, mask):
    """Sequence b's position plus `offset` (int64), and the cos and sin tables' rows there at offs
    (fp32; zeros outside mask)."""
    p = (tl.load(pos_ptr + b) + offset).to(tl.int64)
    c = tl.load(cos_ptr + p * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + p * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    return p, c, s


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr,
    q_ptr, kc_ptr, vc_ptr,
    seq_len, eps,
    stride_qkv, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False,
    table_ptr=None, stride_tb=None, PAGED: tl.constexpr = False, PAGE: tl.constexpr = 1,
    EARLY: tl.constexpr = False,  # the position and its cos/sin rows read before PDL's wait (pdl.EARLY's note)
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    b = t // seq_len
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, D)
    rot = (offs + HALF) % D
    is_q = head < H
    # the norms' weights before the wait (no kernel writes them): their HBM round trip under the product's tail
    w = tl.where(is_q, tl.load(qn_ptr + offs), tl.load(kn_ptr + offs)).to(tl.float32)
    wr = tl.where(is_q, tl.load(qn_ptr + rot), tl.load(kn_ptr + rot)).to(tl.float32)
    if EARLY:
        p, c, s = _position_rows(pos_ptr, b, t % seq_len, cos_ptr, sin_ptr, D, offs, offs < D)
    pdl.wait(PDL)  # qkv and the positions come from earlier kernels
    pdl.launch_dependents(PDL)
    if not EARLY:
        p, c, s = _position_rows(pos_ptr, b, t % seq_len, cos_ptr, sin_ptr, D, offs, offs < D)
    row = qkv_ptr + t * stride_qkv + head * D  # k heads follow q heads in the packed row
    x = tl.load(row + offs).to(tl.float32)
    xr = tl.load(row + rot).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    n = _round_bf16(_round_bf16(x * inv) * w)
    nr = _round_bf16(_round_bf16(xr * inv) * wr)
    nr = tl.where(offs < HALF, -nr, nr)
    out = (_round_bf16(n * c) + _round_bf16(nr * s)).to(tl.bfloat16)
    if is_q:
        tl.store(q_ptr + t * stride_qt + head * stride_qh + offs, out)
    else:
        kvh = head - H
        if PAGED:  # position p of sequence b: page block_table[b, p // PAGE], offset p % PAGE
            page = tl.load(table_ptr + b * stride_tb + p // PAGE).to(tl.int64)
            slot = p % PAGE
            tl.store(kc_ptr + page * stride_kb + kvh * stride_kh + slot * stride_ks + offs, out)
            v = tl.load(qkv_ptr + t * stride_qkv + (H + KVH + kvh) * D + offs)
            tl.store(vc_ptr + page * stride_vb + kvh * stride_vh + slot * stride_vs + offs, v)
        else:
            tl.store(kc_ptr + b * stride_kb + kvh * stride_kh + p * stride_ks + offs, out)
            v = tl.load(qkv_ptr + t * stride_qkv + (H + KVH + kvh) * D + offs)
            tl.store(vc_ptr + b * stride_vb + kvh * stride_vh + p * stride_vs + offs, v)


def _check_block_table(fn: str, block_table, sequences: int, k_cache, v_cache) -> int:
    """The page size (k_cache.shape[2]) after checking a block table for `sequences` sequences
    against page pools k_cache, v_cache [P, KVH, PAGE, D]; ValueError naming what does not fit."""
    if not isinstance(block_table, torch.Tensor):
        raise ValueError(f"{fn}: block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"{fn}: block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"{fn}: block_table must be 2-D [B, W], got shape {tuple(block_table.shape)}")
    if not block_table.is_contiguous():
        raise ValueError(f"{fn}: block_table must be contiguous, got strides {block_table.stride()}")
    if block_table.device != k_cache.device:
        raise ValueError(f"{fn}: block_table is on {block_table.device}, the caches on {k_cache.device}")
    if block_table.shape[0] < sequences:
        raise ValueError(f"{fn}: block_table has {block_table.shape[0]} rows for {sequences} sequences")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or v_cache.shape[2] != k_cache.shape[2] or k_cache.shape[2] < 1:
        raise ValueError(f"{fn}: paged caches must be page pools [P, KVH, PAGE, D] with one page size, got "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    return k_cache.shape[2]


def qk_norm_rope_store(qkv, q_norm, k_norm, cos, sin, positions, seq_len: int,
                       k_cache, v_cache, eps: float, num_heads: int, num_kv_heads: int,
                       q_out: torch.Tensor = None, *, block_table: torch.Tensor | None = None,
                       early: bool | None = None) -> torch.Tensor:
    """Normalize + rotate Q and K of `qkv` [T, (H+2KVH)*D], write K/V to the caches; return Q [T, H, D].

    With block_table (int32 [B, W], contiguous, on the caches' device) the caches are page pools
    [P, KVH, PAGE, D] and position p of sequence b goes to k_cache[block_table[b, p // PAGE], :, p % PAGE];
    positions below W * PAGE and page ids below P are the caller's to ensure (as C is, unpaged).
    early: the positions and their cos/sin rows read before PDL's wait, only where no kernel launched
    with PDL just before writes the positions (pdl.EARLY's note); None: pdl.EARLY. Same bits."""
    D = k_cache.shape[-1]
    T = qkv.shape[0]
    for name, t in (("qkv", qkv), ("q_norm", q_norm), ("k_norm", k_norm), ("cos", cos), ("sin", sin),
                    ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on its last dim, got strides {t.stride()}")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected {(num_heads + 2 * num_kv_heads) * D}")
    if positions.dtype != torch.int32:
        raise ValueError(f"positions must be int32, got {positions.dtype}")
    # paged: the sequences must fit the block table's rows (checked there), not the pool's pages
    if T % seq_len or T // seq_len > positions.shape[0] or (block_table is None and T // seq_len > k_cache.shape[0]):
        raise ValueError(f"{T} tokens do not split into sequences of {seq_len} for {positions.shape[0]} positions")
    if block_table is not None:
        page = _check_block_table("qk_norm_rope_store", block_table, T // seq_len, k_cache, v_cache)
        paged = dict(table_ptr=block_table, stride_tb=block_table.stride(0), PAGED=True, PAGE=page)
    else:
        paged = {}   # table_ptr, stride_tb None (constexprs): the unpaged kernel's arguments
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] == D):
        raise ValueError("cos/sin tables must be contiguous [max_pos, head_dim]")
    if q_out is None:
        q_out = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    use_pdl, pdl_launch = pdl.for_rows(T)
    _qk_norm_rope_store_kernel[(T, num_heads + num_kv_heads)](
        qkv, q_norm, k_norm, cos, sin, positions, q_out, k_cache, v_cache,
        seq_len, eps, qkv.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=num_heads, KVH=num_kv_heads, D=D, num_warps=1 if D <= 128 else 2,
        PDL=use_pdl, **paged, **({"EARLY": True} if pdl.early(early, T) else {}), **pdl_launch,
    )
    return q_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope_store_reference(qkv, q_norm, k_norm, cos, sin, positions, seq_len: int,
                                 k_cache, v_cache, eps: float, num_heads: int, num_kv_heads: int, *,
                                 block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Transformers' Qwen3Attention prologue (q_norm/k_norm, apply_rotary_pos_emb) plus the cache write.
    With block_table the caches are page pools [P, KVH, PAGE, D]: position p of sequence b is written
    to page block_table[b, p // PAGE] at offset p % PAGE (qk_norm_rope_store's paged form)."""
    from fqkernels.rmsnorm import rmsnorm_reference

    D = k_cache.shape[-1]
    T = qkv.shape[0]
    B = T // seq_len
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = rmsnorm_reference(q.reshape(T, num_heads, D), q_norm, eps)
    k = rmsnorm_reference(k.reshape(T, num_kv_heads, D), k_norm, eps)
    dev = qkv.device
    b_idx = torch.arange(B, device=dev).repeat_interleave(seq_len)
    pos = positions.long()[b_idx] + torch.arange(seq_len, device=dev).repeat(B)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    rows, slots = b_idx, pos
    if block_table is not None:
        page = _check_block_table("qk_norm_rope_store_reference", block_table, B, k_cache, v_cache)
        rows, slots = block_table.long()[b_idx, pos // page], pos % page
    k_cache[rows, :, slots] = k
    v_cache[rows, :, slots] = v.reshape(T, num_kv_heads, D)
    return q.contiguous()


def rope_tables(head_dim: int, theta: float, length: int, device: torch.device):
    """BF16 cos/sin tables [length, head_dim], computed as Transformers' Qwen3RotaryEmbedding does:
    inv_freq in float32 on the CPU, the position product as a float32 matmul, cos/sin in float32
    on the target device, then cast to BF16."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = inv_freq.to(device)
    positions = torch.arange(length, device=device).float()
    freqs = (inv_freq[None, :, None].float() @ positions[None, None, :].float()).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(torch.bfloat16).contiguous(), emb.sin().to(torch.bfloat16).contiguous()


# ------------------------------------------------------------------ partial RoPE (Qwen3.5)
@triton.jit
def _rope_row(x_row, cos_row, sin_row, D: tl.constexpr, R: tl.constexpr):
    """One head's row (fp32 out, D values): the first R dims rotated (rotate-half over R) with
    the reference's cast points, the rest as loaded."""
    offs = tl.arange(0, D)
    x = tl.load(x_row + offs).to(tl.float32)
    rot = offs < R
    half = R // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    y = tl.load(x_row + partner, mask=rot, other=0.0).to(tl.float32)
    y = tl.where(offs < half, -y, y)                                   # rotate_half over the first R dims
    c = tl.load(cos_row + offs, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_row + offs, mask=rot, other=0.0).to(tl.float32)
    return tl.where(rot, _round_bf16(_round_bf16(x * c) + _round_bf16(y * s)), x)


@triton.jit
def _partial_rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, H, stride_xr, stride_xh, stride_c,
                         D: tl.constexpr, R: tl.constexpr, GATHER: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (row, head): _rope_row of that head, with cos/sin row `row` (GATHER: row
    positions[row] of the tables)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    pdl.wait(PDL)  # x (and the positions) come from earlier kernels
    pdl.launch_dependents(PDL)
    if GATHER:
        p = tl.load(pos_ptr + row).to(tl.int64)
    else:
        p = row.to(tl.int64)
    out = _rope_row(x_ptr + row * stride_xr + head * stride_xh, cos_ptr + p * stride_c, sin_ptr + p * stride_c,
                    D, R)
    tl.store(out_ptr + (row * H + head) * D + tl.arange(0, D), out.to(tl.bfloat16))


@triton.jit
def _rope_store_kv_kernel(k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, stride_kb, stride_kh,
                          stride_vb, stride_vh, stride_c, stride_cb, stride_ch, stride_cp,
                          D: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr = False,
                          table_ptr=None, stride_tb=None, PAGED: tl.constexpr = False, PAGE: tl.constexpr = 1):
    """Program (sequence, KV head): the key's _rope_row at the sequence's position (its cos/sin
    rows read from the tables there) and the value, both stored into the caches at that position
    (PAGED: in page table[b, p // PAGE] of the pools, at offset p % PAGE)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl.wait(PDL)  # k, v and the positions come from earlier kernels
    pdl.launch_dependents(PDL)
    p = tl.load(pos_ptr + b).to(tl.int64)
    offs = tl.arange(0, D)
    key = _rope_row(k_ptr + b * stride_kb + h * stride_kh, cos_ptr + p * stride_c, sin_ptr + p * stride_c, D, R)
    if PAGED:
        page = tl.load(table_ptr + b * stride_tb + p // PAGE).to(tl.int64)
        dst = page * stride_cb + h * stride_ch + (p % PAGE) * stride_cp + offs
    else:
        dst = b.to(tl.int64) * stride_cb + h * stride_ch + p * stride_cp + offs
    tl.store(kc_ptr + dst, key.to(tl.bfloat16))
    tl.store(vc_ptr + dst, tl.load(v_ptr + b * stride_vb + h * stride_vh + offs))


def rope_store_kv(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, *, block_table: torch.Tensor | None = None) -> None:
    """A decode step's keys and values into one attention layer's caches, one kernel: k, v [B, KVH, D]
    bf16 (k normed, not yet rotated; unit stride on D), cos, sin the [length, R] bf16 tables,
    positions [B] int on the device, k_cache, v_cache [B, KVH, C, D] bf16 (one layer's, same
    strides). k_cache[b, h, positions[b]] = partial_rope(k) there, v_cache[...] = v
    (rope_store_kv_reference); no host reads (graph-safe).
    With block_table (int32 [B', W], B' >= B, contiguous, on the device) the caches are page pools
    [P, KVH, PAGE, D] and position p of sequence b goes to page block_table[b, p // PAGE], offset
    p % PAGE; positions below W * PAGE and page ids below P are the caller's to ensure (as C is, unpaged)."""
    B, H, D = k.shape
    R = cos.shape[-1]
    rows_ok = k_cache.shape[:2] == (B, H) if block_table is None else k_cache.shape[1] == H
    if (k.dtype != torch.bfloat16 or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1
            or not rows_ok or k_cache.shape[3] != D or v_cache.shape != k_cache.shape
            or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1 or sin.shape != cos.shape
            or cos.stride(-1) != 1 or sin.stride() != cos.stride() or R % 2 or R > D or D & (D - 1)
            or tuple(positions.shape) != (B,)):
        raise ValueError(f"rope_store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)}, "
                         f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}, positions {tuple(positions.shape)}"
                         " do not fit")
    paged = {}   # unpaged: table_ptr, stride_tb None (constexprs), the unpaged kernel's arguments
    if block_table is not None:
        page = _check_block_table("rope_store_kv", block_table, B, k_cache, v_cache)
        paged = dict(table_ptr=block_table, stride_tb=block_table.stride(0), PAGED=True, PAGE=page)
    use_pdl, pdl_launch = pdl.for_rows(B)
    _rope_store_kv_kernel[(B, H)](k, v, cos, sin, positions, k_cache, v_cache, k.stride(0), k.stride(1),
                                  v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
                                  k_cache.stride(2), D=D, R=R, PDL=use_pdl, num_warps=1, **paged, **pdl_launch)


def rope_store_kv_reference(k, v, cos, sin, positions, k_cache, v_cache, *,
                            block_table: torch.Tensor | None = None) -> None:
    """rope_store_kv through partial_rope_reference and indexed writes (with block_table: position p
    of sequence b at page block_table[b, p // PAGE], offset p % PAGE of the page pools)."""
    pos = positions.long()
    rows = torch.arange(k.shape[0], device=k.device)
    slots = pos
    if block_table is not None:
        page = _check_block_table("rope_store_kv_reference", block_table, k.shape[0], k_cache, v_cache)
        rows, slots = block_table.long()[rows, pos // page], pos % page
    k_cache[rows, :, slots] = partial_rope_reference(k, cos[pos][:, None], sin[pos][:, None])
    v_cache[rows, :, slots] = v


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3.5's RoPE on the first R = cos.shape[-1] dims of each head: x [N, H, D] bf16 (unit
    stride on D), cos, sin [N, R] bf16 (the row's position), or with positions ([N] int on the
    device, graph-safe) the [length, R] tables, row n rotated at positions[n]; returns
    [N, H, D] bf16: bf16(bf16(x_r * cos) + bf16(rotate_half(x_r) * sin)) on the first R dims,
    the rest as is (partial_rope_reference, the reference's cast points)."""
    N, H, D = x.shape
    R = cos.shape[-1]
    rows_ok = tuple(cos.shape) == (N, R) if positions is None else (
        cos.dim() == 2 and tuple(positions.shape) == (N,) and not positions.is_floating_point())
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or not rows_ok or sin.shape != cos.shape \
            or R % 2 or R > D or D & (D - 1):
        raise ValueError(f"partial_rope: x {x.dtype} {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
                         + ("" if positions is None else f", positions {positions.dtype} {tuple(positions.shape)}")
                         + " do not fit (bf16 x with unit last stride, D a power of two, cos/sin [N, R] or tables "
                         "[length, R] with positions [N] int, R even <= D)")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((N, H, D), dtype=torch.bfloat16, device=x.device)
    use_pdl, pdl_launch = pdl.for_rows(N)
    _partial_rope_kernel[(N, H)](x, cos, sin, cos if positions is None else positions, out, H, x.stride(0),
                                 x.stride(1), cos.stride(0), D=D, R=R, GATHER=positions is not None, PDL=use_pdl,
                                 num_warps=1, **pdl_launch)
    return out


def partial_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with cos, sin [..., R] broadcasting over the heads: RoPE on the first R dims
    (rotate-half, BF16 products and sum), the rest passed through (Transformers 5.17's Qwen3.5)."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    half = torch.cat((-xr[..., r // 2:], xr[..., :r // 2]), dim=-1)
    return torch.cat([xr * cos + half * sin, xp], dim=-1)


# ------------------------------------------------------------------ Qwen3.5's decode q/k prologue, fused
@triton.jit
def _qk_norm_partial_rope_store_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                                       inv_n, eps, stride_row, stride_c, stride_cb, stride_ch, stride_cp,
                                       H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                                       BLOCK: tl.constexpr, VEC: tl.constexpr, HALVES: tl.constexpr,
                                       PDL: tl.constexpr = False, table_ptr=None, stride_tb=None,
                                       PAGED: tl.constexpr = False, PAGE: tl.constexpr = 1,
                                       EARLY: tl.constexpr = False):
    """Program (sequence b, head): a decode step's query head (head < H) or key head of the packed
    q | k | v row (per query head [query | gate], then the keys, then the values), its (1 + w)
    norm with the mean of squares in torch's order (rmsnorm's torch-order kernel, the same adds),
    then its partial RoPE at the sequence's position (_rope_row's cast points): queries to q_ptr
    [B, H, D]; keys, and the head's value, into the caches at that position (PAGED: through the
    block table). The RoPE's partner values are the partner dims normalized again (the same
    arithmetic, so the same bits)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    is_q = head < H
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    rot = offs < R
    half = R // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    if is_q:
        w_ptr = qn_ptr
    else:
        w_ptr = kn_ptr
    # the norm's weight before the wait (no kernel writes it): its HBM round trip under the product's tail
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    w_partner = tl.load(w_ptr + partner, mask=rot, other=0.0)
    # EARLY: the position and its cos/sin rows before the wait (pdl.EARLY's note)
    if EARLY:
        p, c, s = _position_rows(pos_ptr, b, 0, cos_ptr, sin_ptr, stride_c, offs, rot)
    pdl.wait(PDL)  # the packed row and the positions come from earlier kernels
    pdl.launch_dependents(PDL)
    if not EARLY:
        p, c, s = _position_rows(pos_ptr, b, 0, cos_ptr, sin_ptr, stride_c, offs, rot)
    row = qkv_ptr + b.to(tl.int64) * stride_row
    if is_q:
        src = row + head * (2 * D)
    else:
        src = row + 2 * H * D + (head - H) * D
    xf = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    NB: tl.constexpr = BLOCK // 128
    cols = _column_sums(tl.permute(tl.reshape(xf * xf, (NB, 128)), (1, 0)), NB)
    if VEC:
        lanes = tl.reshape(cols, (32, 4))
    else:
        lanes = tl.permute(tl.reshape(cols, (4, 32)), (1, 0))
    inv = tl.rsqrt(_lane_sum(lanes, HALVES) * inv_n + eps)
    n = _scaled(xf, inv, w, True).to(tl.float32)
    y = _scaled(tl.load(src + partner, mask=rot, other=0.0).to(tl.float32), inv, w_partner, True).to(tl.float32)
    y = tl.where(offs < half, -y, y)                                   # rotate_half over the first R dims
    out = tl.where(rot, _round_bf16(_round_bf16(n * c) + _round_bf16(y * s)), n).to(tl.bfloat16)
    if is_q:
        tl.store(q_ptr + (b * H + head) * D + offs, out, mask=ok)
    else:
        kvh = head - H
        if PAGED:
            page = tl.load(table_ptr + b * stride_tb + p // PAGE).to(tl.int64)
            dst = page * stride_cb + kvh * stride_ch + (p % PAGE) * stride_cp + offs
        else:
            dst = b.to(tl.int64) * stride_cb + kvh * stride_ch + p * stride_cp + offs
        tl.store(kc_ptr + dst, out, mask=ok)
        tl.store(vc_ptr + dst, tl.load(row + 2 * H * D + KVH * D + kvh * D + offs, mask=ok), mask=ok)


def qk_norm_partial_rope_store(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int, *,
                               block_table: torch.Tensor | None = None,
                               early: bool | None = None) -> torch.Tensor | None:
    """Qwen3.5's decode-step attention prologue in one kernel: qkv [B, (2H + 2KVH) D] bf16 (the packed
    q | k | v product's rows; per query head [query | gate]), q_norm, k_norm [D] (the (1 + w)
    norms' weights), cos, sin the [length, R] bf16 tables, positions [B] int on the device, the
    caches as rope_store_kv takes them (with block_table: page pools). Returns the queries
    [B, H, D] (normed and rotated); the keys (normed and rotated) and the values go into the
    caches at the positions. The bits of rmsnorm(one_plus) on each head, then partial_rope /
    rope_store_kv (GPU tests). None when this torch's order of the norm's mean at width D is one
    the kernel does not implement (the caller then runs the separate kernels). early: the positions
    and their cos/sin rows read before PDL's wait (pdl.EARLY's note; None: pdl.EARLY). Same bits."""
    from fqkernels.rmsnorm import _inverse, torch_order_launch

    B = qkv.shape[0]
    D = k_cache.shape[-1]
    R = cos.shape[-1]
    H, KVH = num_heads, num_kv_heads
    if (qkv.dtype != torch.bfloat16 or qkv.dim() != 2 or qkv.stride(-1) != 1 or qkv.shape[1] != (2 * H + 2 * KVH) * D
            or tuple(q_norm.shape) != (D,) or tuple(k_norm.shape) != (D,) or sin.shape != cos.shape
            or cos.stride(-1) != 1 or R % 2 or R > D or D & (D - 1) or tuple(positions.shape) != (B,)
            or k_cache.shape[1] != KVH or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride()
            or (block_table is None and k_cache.shape[0] < B)):
        raise ValueError(f"qk_norm_partial_rope_store: qkv {tuple(qkv.shape)}, norms {tuple(q_norm.shape)} / "
                         f"{tuple(k_norm.shape)}, cos {tuple(cos.shape)}, positions {tuple(positions.shape)}, caches "
                         f"{tuple(k_cache.shape)} for {H} query and {KVH} key heads do not fit")
    order = torch_order_launch(D, qkv.device)
    if order is None:
        return None
    vec, halves = order
    paged = {}
    if block_table is not None:
        page = _check_block_table("qk_norm_partial_rope_store", block_table, B, k_cache, v_cache)
        paged = dict(table_ptr=block_table, stride_tb=block_table.stride(0), PAGED=True, PAGE=page)
    q = torch.empty((B, H, D), dtype=torch.bfloat16, device=qkv.device)
    use_pdl, pdl_launch = pdl.for_rows(B)
    _qk_norm_partial_rope_store_kernel[(B, H + KVH)](
        qkv, q_norm, k_norm, cos, sin, positions, q, k_cache, v_cache, _inverse(D), eps, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), H=H, KVH=KVH, D=D, R=R, BLOCK=max(128, D), VEC=vec,
        HALVES=halves, PDL=use_pdl, num_warps=1 if D <= 128 else 2, enable_fp_fusion=False, **paged,
        **({"EARLY": True} if pdl.early(early, B) else {}), **pdl_launch)
    return q
