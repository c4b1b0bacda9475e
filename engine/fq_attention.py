"""Attention over a prompt (SDPA with its backends named), the continued prompt's masked form,
Qwen3.5's gated-attention forms, and the paged cache's gathers and writes: the parts of
attention that run as torch calls whatever the op set (the decode step's attention is the op
set's `decode_attention`).

SDPA's backends are named as the platform's torch 2.5.1 picks them on Hopper: flash attention,
then memory-efficient, then math, never cuDNN's (newer torch picks that first on sm_90: other
bits, and a plan built per batch shape).
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# The RoPE tables grow in whole granules of positions: a rebuild drops every captured graph (they
# read the old tables), so a call a few positions longer than the last must not cause one.
ROPE_GRANULE = 4096


def rows_of(positions: torch.Tensor, n: int, block_table: torch.Tensor | None = None) -> tuple:
    """n decode rows for each of B sequences at positions [B] int32 .. + n - 1 (a speculative
    verify, the MTP head's rows): (each row's position [B * n] int32, a block table [B * n, W]
    int32 of the rows over the caches as page pools). block_table: the sequences' own (the paged
    form); None: the row form, read as pages of a whole cache row each (row b is page b).
    Graph-safe: no host reads."""
    B = positions.shape[0]
    pos = (positions.view(B, 1) + torch.arange(n, dtype=torch.int32, device=positions.device)).reshape(-1)
    rows = torch.arange(B, device=positions.device).view(B, 1).expand(B, n).reshape(-1)
    table = block_table[rows] if block_table is not None else rows.to(torch.int32).view(-1, 1)
    return pos, table


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: int, seq_len: int, scale: float, last_only: bool = False,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention over a fresh prompt: q [B*S, H, D] against cache[:, :, :S].

    With a sliding `window` and a prompt of at least `window` tokens, the reference
    builds an explicit mask and SDPA runs its masked kernel: `_windowed_attention`
    does the same. A shorter prompt loses no key to the window, and the reference
    runs plain causal attention then, as below.

    SDPA's flash backend on the GPU, as the reference's sdpa path runs on the
    platform's torch 2.5.1. Newer torch would pick cuDNN attention first on Hopper
    (different tiles, different rounding), so the backends are named: flash, then
    memory-efficient, then math, never cuDNN. On the GPU the causal prompt pass
    hands flash the unexpanded K/V (enable_gqa: the kernel reads KV head h // G for
    query head h, the same arithmetic as on repeated K/V, without writing the
    repeated copy); the one-row `last_only` pass and
    the CPU expand K/V per group as the reference's repeat_kv does (with one query
    row flash would fold the group into rows and pick other splits).
    Returns [B*S, H*D] BF16, or with `last_only` [B, H*D] for each sequence's last
    position (which sees every key, so no mask).
    """
    global _FLASH_GQA
    if window is not None and seq_len >= window:
        return _windowed_attention(q, k_cache, v_cache, batch, seq_len, scale, last_only, window)
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[1]
    qh = q.view(batch, seq_len, H, D)
    if last_only:
        qh = qh[:, -1:]
    qh = qh.transpose(1, 2)
    k, v = k_cache[:batch, :, :seq_len], v_cache[:batch, :, :seq_len]
    if q.is_cuda and not last_only and group > 1 and _FLASH_GQA is not False:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
            _FLASH_GQA = True
            return o.transpose(1, 2).reshape(-1, H * D)
        except RuntimeError:
            if _FLASH_GQA:  # it ran before: this is a real error, not a missing feature
                raise
            _FLASH_GQA = False  # this build's flash has no GQA: expand, as below
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(qh, expand_kv(k, group), expand_kv(v, group),
                                           is_causal=not last_only, scale=scale)
    return o.transpose(1, 2).reshape(-1, H * D)


def prefix_mask(first: int, keys: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[keys - first, keys] bool: query position p in [first, keys) sees key j <= p (and j > p -
    window with a window), the causal mask of a continued prompt, aligned at the bottom right."""
    qpos = torch.arange(first, keys, device=device)[:, None]
    kpos = torch.arange(keys, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, seq_len: int, start: int,
                     scale: float, last_only: bool = False, window: int | None = None) -> torch.Tensor:
    """Attention of a continued prompt's queries (positions [start, start + seq_len), q [B*S, H, D])
    over the keys of positions [0, start + seq_len) (k, v [B, KVH, start + S, D], the cached ones
    first): query position p sees keys j <= p (and j > p - window with a window), the causal mask
    aligned at the bottom right. SDPA with that boolean mask on K/V expanded per query head (its
    memory-efficient kernel on the GPU, math on the CPU): the same function as a whole prompt's
    attention, in another kernel's arithmetic. Returns [B*S, H*D], or with `last_only` [B, H*D]."""
    H, D = q.shape[1], q.shape[2]
    group = H // k.shape[1]
    qh = q.view(batch, seq_len, H, D)
    first = seq_len - 1 if last_only else 0
    qh = qh[:, first:].transpose(1, 2)
    mask = prefix_mask(start + first, start + seq_len, q.device, window)
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(qh, expand_kv(k, group), expand_kv(v, group), attn_mask=mask,
                                           scale=scale)
    return o.transpose(1, 2).reshape(-1, H * D)


# Rows of the additive mask built at once (bf16): bounds a long prompt's mask to ~64 MB.
_MASK_ELEMENTS = 1 << 25


def _windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int,
                        seq_len: int, scale: float, last_only: bool, window: int) -> torch.Tensor:
    """Sliding-window prompt attention, computed as Transformers 4.51.3 computes it.

    Its mask builder, for a forward over S >= window tokens, makes a BF16 [S, S] mask
    holding finfo(bf16).min where key j is hidden from query p (j > p or j <= p - window)
    and -0.0 elsewhere (min times False), and SDPA gets it as attn_mask on K/V repeated
    per query head: flash takes no mask, so its memory-efficient kernel runs (math on
    the CPU). This function makes the same call on the same values, with the query rows
    taken in chunks so the mask stays small: each row's result depends only on its own
    scores, and keys past a chunk's last row are masked for all of its rows (they add
    exp(-huge) = 0 in the same key-block order), so they are left out.
    """
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[1]
    k = expand_kv(k_cache[:batch, :, :seq_len], group)
    v = expand_kv(v_cache[:batch, :, :seq_len], group)
    qh = q.view(batch, seq_len, H, D).transpose(1, 2)
    first = seq_len - 1 if last_only else 0
    rows = max(128, _MASK_ELEMENTS // seq_len // 128 * 128)
    outs = []
    for q0 in range(first, seq_len, rows):
        q1 = min(seq_len, q0 + rows)
        pos = torch.arange(q0, q1, device=q.device)[:, None]
        key = torch.arange(q1, device=q.device)
        mask = torch.full((q1 - q0, q1), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=q.device)
        mask *= (key > pos) | (key <= pos - window)
        with sdpa_kernel(SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(qh[:, :, q0:q1].contiguous(), k[:, :, :q1], v[:, :, :q1],
                                               attn_mask=mask[None, None], scale=scale)
        outs.append(o)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return o.transpose(1, 2).reshape(-1, H * D)


# Whether SDPA's flash backend takes unexpanded GQA K/V here: None until the first
# GPU prefill tries it (that first call is eager, never inside a graph capture).
_FLASH_GQA: bool | None = None


def expand_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[B, KVH, S, D] -> [B, KVH * group, S, D], each KV head repeated for its query
    heads (the reference's repeat_kv); expand + reshape, which a CUDA graph can capture."""
    b, kvh, s, d = kv.shape
    return kv[:, :, None].expand(b, kvh, group, s, d).reshape(b, kvh * group, s, d)


def gqa_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen3.5's prompt attention (Transformers 5.17's sdpa path): q [B, H, S, D], k, v [B, KVH, S, D],
    no mask on an unpadded causal prompt, the K/V heads shared by GQA inside SDPA (enable_gqa: 5.17
    does not repeat them, and repeating gives other bits on the CPU). Returns [B, H, S, D]."""
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def gqa_prefix_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A continued prompt's attention (Qwen3.5): q [B, H, S, D] at positions [start, start + S) over
    the cached keys and these, kc, vc [B, KVH, start + S, D], the causal mask at the bottom right. On
    a GPU the memory-efficient kernel (flash takes no mask) on K/V repeated per query head; on the
    CPU SDPA with the heads shared. Returns [B, H, S, D]."""
    S = q.shape[2]
    mask = prefix_mask(start, start + S, q.device)
    if q.is_cuda:
        group = q.shape[1] // kc.shape[1]
        with sdpa_kernel(SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, expand_kv(kc, group), expand_kv(vc, group), attn_mask=mask,
                                                  scale=scale)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)


def sdpa_over_prefix(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lengths: torch.Tensor, scale: float):
    """The torch reference's decode attention: one query a sequence, q [B, H, 1, D], over its
    cached prefix, kc and vc [B, KVH, >= max(lengths), D] (K/V heads shared by GQA inside SDPA),
    unmasked when every sequence has the same length (always, in the engine's calls), as 5.17's
    cached step; a mask otherwise. Returns [B, H, 1, D]."""
    L = int(lengths.max())
    mask = None
    if int(lengths.min()) != L:
        mask = (torch.arange(L, device=q.device)[None, :] < lengths.long()[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, kc[:, :, :L], vc[:, :, :L], attn_mask=mask, scale=scale, enable_gqa=True)


def page_positions(table: torch.Tensor, length: int, start: int, page: int) -> tuple:
    """(page, slot within the page) of positions [start, start + length) of each row of `table`
    ([nb, W] int32), each [nb * length] int64, row-major (row 0's positions first)."""
    pos = torch.arange(start, start + length, device=table.device)
    return table.long()[:, pos // page].reshape(-1), (pos % page).repeat(table.shape[0])


def write_pages(k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                start: int) -> None:
    """One layer's K/V of a prompt pass, k, v [nb, KVH, S, D] at positions [start, start + S) of the
    rows of `table` ([nb, W]), into their pages of the pools [P, KVH, page, D]."""
    page_of, slot_of = page_positions(table, k.shape[2], start, k_pool.shape[2])
    for src, pool in ((k, k_pool), (v, v_pool)):
        pool[page_of, :, slot_of] = src.transpose(1, 2).reshape(-1, src.shape[1], src.shape[3])


def cached_kv(k_layer: torch.Tensor, v_layer: torch.Tensor, table: torch.Tensor | None, rows: slice,
              length: int) -> tuple:
    """One layer's cached K/V of positions [0, length) of `rows`, [nb, KVH, length, D]: the rows'
    slice of a row cache [B, KVH, C, D] (table None), or their pages gathered in order from the
    pools [P, KVH, page, D] through table[rows] (a copy)."""
    if table is None:
        return k_layer[rows, :, :length], v_layer[rows, :, :length]
    return tuple(gather_pages(pool, table[rows], length) for pool in (k_layer, v_layer))


def gather_pages(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of each row of `table` ([nb, W]) from a page pool [P, KVH, page, D]:
    [nb, KVH, length, D], a copy."""
    n = -(-length // pool.shape[2])
    pages = pool[table[:, :n].long()]                          # [nb, n, KVH, page, D]
    return pages.transpose(1, 2).reshape(table.shape[0], pool.shape[1], -1, pool.shape[3])[:, :, :length]
