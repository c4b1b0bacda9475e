"""Decode attention: one new query per sequence against a static KV cache (split-KV, GQA).

    out[b, h, :] = softmax_j( (q[b, h] . k[b, h // G, j]) * scale ) @ v[b, h // G, :, :]
                   over the valid positions lengths[b] - window <= j < lengths[b],  G = H // KVH

`window` (the model's sliding_window, or None for no window) is only a start offset:
the same tiles, masks and merge, with positions before the window masked like those
past the length (the reference's rule: query position p sees keys p - window < j <= p).

Shapes and dtypes: q [B, H, D] bf16; k_cache, v_cache [B, KVH, C, D] bf16 (unit stride
on D; any other strides, so one layer of a [L, B, KVH, C, D] buffer is passed as a
view); lengths [B] int32 on the device; out [B, H, D] bf16.

Paged form (block_table=, as vLLM's): k_cache, v_cache are pools of pages
[P, KVH, PAGE, D] (one layer of a bigger buffer is fine) and block_table [B, W] int32
on the device maps sequence b's position p to row p % PAGE of page block_table[b, p // PAGE];
C = W * PAGE is the capacity everywhere (plan, workspace, clamping, window). PAGE must be a
multiple of the plan's block_n, so every key tile lies in one page: each tile reads its
page index from the table, and only its addresses change. Same tiles, order, masks and
casts, so the same bits as the unpaged form over a [B, KVH, C, D] cache of the same
contents (and, with PAGED a constexpr, the unpaged kernel compiles none of it in).
Where the page indices come from is the plan's page_ids: "tile" (decode_attention_plan's
default; what decode_attention runs without a plan, except on the FA2 path, where it takes
"split" when the split fits) loads each tile's entry from the table inside the key loop;
"split" loads the entries of the pages the program's split spans once, before the loop, as a
small vector (PAGE_IDS entries, a power of two), and each tile picks its own from it in
registers, so no load of the table sits in the loop (whose software pipeline may then keep
its stages for K and V). Both give the same page for every tile, hence the same bits.

Cast points (the same as the pure-torch reference below and as SDPA's flash path):
scores are fp32 sums of bf16 products (tl.dot), softmax runs in fp32, the
probabilities are rounded to bf16 before P @ V, that product accumulates in fp32, and
the result is rounded to bf16 once at the end. The kernel normalizes after P @ V
(online softmax), which reorders the arithmetic but keeps every cast.

Work split (flash-decoding): program (b * KVH + kvh, split) handles the G query heads
of one KV head over one fixed slice of the cache capacity, so each K/V tile is read
once for all G heads. The G rows are padded to 16 because tl.dot needs at least 16
rows. Partials (unnormalized fp32 acc, running max, running sum) go to a workspace
and a second kernel merges them; with a single split the first kernel writes the
output directly. The grid depends only on (B, KVH, C, D): lengths are read on the
device, so one CUDA graph serves every length up to C.

Tile order (flash_order). Exact arithmetic would make the order irrelevant; the
one rounding that matters is P's to bf16, which happens relative to the running
max at the time a tile is processed. Flash attention's forward (the reference's,
on the platform's torch) walks the key tiles newest first from -inf; its decode
does too, unsplit where batch x heads >= 212. With one split and newest first,
this kernel gives that forward's last row (on every element measured with the FA2
arithmetic below; on 99.98-100% of elements without it: docs/NUMERICS.md), so that is the
default there. With several splits no order reproduces it;
the default walks oldest first (newest first costs one extra tile of scores and
measured no fidelity gain).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from fqkernels import pdl
from fqkernels.rmsnorm import _seq16
from fqkernels.swiglu import sigmoid_f32, sigmoid_gate_mul

__all__ = [
    "DecodeAttentionPlan",
    "decode_attention",
    "decode_attention_plan",
    "decode_attention_reference",
    "default_num_splits",
]

# Scores are turned into exp2 arguments: exp(x) == exp2(x * log2(e)).
_LOG2E = 1.4426950408889634

# One split's arithmetic (the "FA2" path). Flash attention's forward as PyTorch builds it
# (FA2 with UNFUSE_FMA; read from its sources and the sm_90 code of torch 2.5.1 and 2.11,
# whose instruction sequences are the same): scores unscaled; p = exp2(RN(s c) - RN(m c)),
# no FMA (c = float(float(scale) * log2 e), m the running row max); on each later tile the
# rescale exp2((m_old - m_new) * c) multiplies the output accumulator before P @ V adds to
# it, and each lane of the row's quad keeps its own partial sum over its 16 of a tile's 64
# columns (8 j + 2 u + e for lane u, in the order (j, e)), rescaled and added to the
# first of them in one FMA, the rest added one by one; at the end the partials are added
# as (u0 + u2) + (u1 + u3) and the accumulator is multiplied by the IEEE reciprocal of the
# sum. This matches flash's decode on every element of every case measured (Triton's own
# softmax arithmetic, with a fused exponent, a rounded rescale and Triton's division, does not:
# docs/NUMERICS.md). Its lane sums cross warps when 4 warps split a tile's 64 columns, so it
# runs with 64 query rows a program (the G real ones padded; the warps then split rows): about
# as fast as Triton's arithmetic, where 16 rows were much slower (docs/PERFORMANCE.md). Taken
# where a launch fits it and the caller asks for it (fa2=True, the default: the engine's exact
# decode, with the in-order products of gemv.exact_rows).
_FA2_BLOCK_G = 64

# With early reads (decode_attention(early=...), pdl.EARLY): the tiles of a split's walk whose K/V
# lines are asked of L2 before PDL's wait (the key loop's pipeline, 3 stages, loads the first
# two together; the later tiles' loads are issued while those compute)
EARLY_TILES = 2

# The split heuristic: the best split count measured at every B in {1, 4, 16} and context
# 512..32768 (4B shape, CUDA graph, KV streamed from HBM) gives about 512 programs (~4 per SM:
# one program alone keeps too few bytes in flight), with up to 64 splits paying at B = 1 from
# 8K context; docs/PERFORMANCE.md.
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 64

# Where the reference's own decode runs unsplit. Flash attention's split heuristic
# (num_splits_heuristic, as in the platform's torch 2.5.1) keeps one split once
# batch x heads (x one 64-row query block) reaches 0.8 x 2 x the SM count; 211.2 on
# the 132-SM H100 and H200. Unsplit, its decode walks the same 64-key tiles newest
# first as its causal forward does for the last row, so its cached decode is
# bit-equal to its full forward there (a whole decode step is, with the in-order products:
# docs/NUMERICS.md). Ours with one split, newest first, in flash's arithmetic (the FA2 path)
# gives its bits: there we run one split, whatever it costs.
_UNSPLIT_ROWS = 212
# Measured at head_dim 128 only (Qwen3). Past it (Qwen3.5's 256) one split neither gives
# flash's bits (the FA2 path is for 128) nor was it measured closer to them, and it starves
# the GPU (64 programs at batch 16; docs/PERFORMANCE.md). There the split count follows speed
# (default_num_splits).
_UNSPLIT_MAX_HEAD_DIM = 128

# Offsets inside one (b, kvh) slice are int32 in the kernel; the per-(b, kvh) base is int64.
_INT32_LIMIT = 2**31

# The paged form's page_ids: where a program gets its tiles' page indices (module docstring).
_PAGE_IDS = ("tile", "split")
# page_ids="split" keeps a split's page indices in registers, at most this many (a power of
# two): 16 K positions of pages of 64 at one split. A longer split refuses the option
# (ValueError) rather than spill.
_MAX_PAGE_IDS = 256


@dataclass(frozen=True)
class DecodeAttentionPlan:
    """Static launch plan: depends only on shapes, never on lengths."""

    block_n: int  # cache positions per tile
    block_g: int  # query rows per program (G padded to >= 16 for tl.dot)
    num_splits: int  # programs per (b, kvh); 1 means no combine kernel
    split_len: int  # cache positions per split, a multiple of block_n
    num_warps: int
    num_stages: int
    # The paged form's page indices: "tile" loads each tile's table entry in the key loop,
    # "split" loads the split's entries once before it (module docstring). Unpaged: unused.
    page_ids: str = "tile"


def _block_n(head_dim: int) -> int:
    # At D=128, 64 positions with 4 warps beat every other combination of
    # block_n {32, 64, 128} x warps {4, 8} x stages {2, 3, 4} on the H200 (geometric
    # mean over five batch/context shapes). D=256 halves it to keep the K and V
    # tiles of a stage at 16 KiB each.
    return 64 if head_dim <= 128 else 32


def default_num_splits(batch: int, kv_heads: int, capacity: int, head_dim: int) -> int:
    """Splits per (sequence, KV head) from static sizes alone (graph-safe).

    Doubles until batch * kv_heads * splits reaches _TARGET_PROGRAMS, capped at
    _MAX_SPLITS and at the number of tiles in the capacity.
    """
    programs = batch * kv_heads
    splits = 1
    while programs * splits < _TARGET_PROGRAMS and splits < _MAX_SPLITS:
        splits *= 2
    return max(1, min(splits, triton.cdiv(capacity, _block_n(head_dim))))


def decode_attention_plan(
    batch: int,
    heads: int,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    page_ids: str = "tile",
    fa2: bool = True,
) -> DecodeAttentionPlan:
    """The launch plan for these sizes; `num_splits` / `block_n` None pick the defaults.
    `page_ids` ("tile" or "split") only matters to the paged form (module docstring); fa2: the
    FA2 path where the launch fits it (its rows a program)."""
    _check_page_ids(page_ids)
    if block_n is None:
        block_n = _block_n(head_dim)
    elif isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"decode_attention: block_n must be a power of two >= 16, got {block_n!r}")
    if num_splits is None:
        if batch * heads >= _UNSPLIT_ROWS and head_dim <= _UNSPLIT_MAX_HEAD_DIM:
            num_splits = 1
        else:
            num_splits = default_num_splits(batch, kv_heads, capacity, head_dim)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"decode_attention: num_splits must be a positive int, got {num_splits!r}")
    split_len = triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n
    # Rounding the slice up to whole tiles can leave trailing splits with nothing to
    # cover (and a request above the tile count does too): launch only those that cover C.
    effective = triton.cdiv(capacity, split_len)
    block_g = max(16, triton.next_power_of_2(heads // kv_heads))
    if _fa2_fits(effective, block_n, head_dim, fa2):
        block_g = max(block_g, _FA2_BLOCK_G)    # the FA2 path's rows (its note at the top)
    return DecodeAttentionPlan(
        block_n=block_n,
        block_g=block_g,
        num_splits=effective,
        split_len=split_len,
        num_warps=4,
        # 3 stages: faster than 2 for a split of several tiles (docs/PERFORMANCE.md); splits of
        # one or two tiles do not care.
        num_stages=3,
        page_ids=page_ids,
    )


def _check_page_ids(page_ids: object) -> None:
    if not isinstance(page_ids, str) or page_ids not in _PAGE_IDS:
        raise ValueError(f"decode_attention: page_ids must be one of {_PAGE_IDS}, got {page_ids!r}")


def _page_ids_vector(plan: DecodeAttentionPlan, capacity: int, page: int) -> int:
    """The PAGE_IDS constexpr of a paged launch: 0 with page_ids "tile"; with "split", the
    next power of two of the most pages one split's positions [s * split_len,
    min((s + 1) * split_len, C)) span (a split need not start on a page boundary, so this
    can be one more than split_len / PAGE rounded up). ValueError past _MAX_PAGE_IDS."""
    if plan.page_ids == "tile":
        return 0
    span = _split_page_span(plan, capacity, page)
    size = triton.next_power_of_2(span)
    if size > _MAX_PAGE_IDS:
        raise ValueError(
            f"decode_attention: page_ids='split' needs {size} page indices a program (a split of "
            f"{plan.split_len} positions spans {span} pages of {page}), more than {_MAX_PAGE_IDS}; "
            f"use page_ids='tile' or more splits"
        )
    return size


def _split_page_span(plan: DecodeAttentionPlan, capacity: int, page: int) -> int:
    """The most pages of `page` positions one split of the plan spans."""
    return max((min((s + 1) * plan.split_len, capacity) - 1) // page - (s * plan.split_len) // page + 1
               for s in range(plan.num_splits))


@triton.jit
def _prefetch_walk_l2(k_base, v_base, lo, hi, stride_kn, stride_vn, NEWEST_FIRST: tl.constexpr, D: tl.constexpr,
                      BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    """Ask L2 for every 128-byte line of the K and V rows of the first TILES tiles the key loop over
    [lo, hi) walks (newest first, or from lo), bf16 rows of D values; a tile's rows past hi ask for
    row hi - 1's again, tiles outside [lo, hi) for nothing. No data returned."""
    LINES: tl.constexpr = (D + 63) // 64
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, LINES) * 64
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    for i in tl.static_range(TILES):
        if i < n_tiles:
            if NEWEST_FIRST:
                start = lo + (n_tiles - 1 - i) * BLOCK_N
            else:
                start = lo + i * BLOCK_N
            rows = tl.minimum(start + offs_n, hi - 1).to(tl.int64)
            pdl.prefetch_l2(k_base + rows[:, None] * stride_kn + offs_l[None, :], True)
            pdl.prefetch_l2(v_base + rows[:, None] * stride_vn + offs_l[None, :], True)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr,
    table_ptr,  # the paged form's block table [B, W] int32 (None without PAGED)
    acc_ptr, m_ptr, l_ptr, out_ptr,
    qk_scale,  # scale * log2(e): scores come out in the exp2 domain
    WINDOW,  # keys a query sees, itself included (>= CAPACITY: no window)
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,  # PAGED: stride_kb / stride_vb step from page to page
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh,
    stride_tb,  # the block table's row stride (None without PAGED)
    KVH: tl.constexpr, G: tl.constexpr, CAPACITY,
    SPLIT_LEN, NUM_SPLITS,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    DIRECT: tl.constexpr, FLASH_ORDER: tl.constexpr, PDL: tl.constexpr = False,
    FA2_PATH: tl.constexpr = False,
    PAGED: tl.constexpr = False,  # k/v are pools of pages of PAGE positions, addressed through table_ptr
    PAGE: tl.constexpr = 1,  # positions a page (a multiple of BLOCK_N); unused without PAGED
    PAGE_IDS: tl.constexpr = 0,  # PAGED: 0 loads each tile's page index in the key loop; n > 0 loads
    # the n (a power of two) from the split's first page on once, before it (_split_page_ids)
    EARLY: tl.constexpr = False,  # the length read before PDL's wait (pdl.EARLY's note)
    PREFETCH: tl.constexpr = 0,  # with EARLY: the K/V lines of the walk's first PREFETCH tiles asked of L2
    # before the wait (unpaged; 0: none)
):
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bk // KVH
    kvh = pid_bk % KVH
    h0 = kvh * G  # first query head of this KV head's group
    if not EARLY:
        pdl.wait(PDL)  # q, the new K/V and the lengths come from earlier kernels

    # Clamp on the device: a length outside [0, C] must not read outside the cache.
    length = tl.load(lengths_ptr + b)
    length = tl.minimum(tl.maximum(length, 0), CAPACITY)
    # The window's first position. The walk starts at the tile holding it, so tiles
    # stay aligned to BLOCK_N from position 0 (as with no window); the positions of
    # that tile before it are masked.
    first = tl.maximum(length - WINDOW, 0)
    lo = tl.maximum(split * SPLIT_LEN, (first // BLOCK_N) * BLOCK_N)
    hi = tl.minimum(split * SPLIT_LEN + SPLIT_LEN, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_g < G

    if EARLY:
        if PREFETCH > 0:
            _prefetch_walk_l2(k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh,
                              v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh,
                              lo, hi, stride_kn, stride_vn, FLASH_ORDER, D, BLOCK_N, PREFETCH)
        pdl.wait(PDL)  # q and the new K/V come from earlier kernels
    # int64 bases: b * stride_kb exceeds int32 for large batch x capacity.
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h0 * stride_qh
    q = tl.load(q_base + offs_g[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if PAGED:
        # The sequence's rows are its table row's pages: each tile adds its own page's base
        # (_page_tile), so the per-(b, kvh) base holds the KV head alone.
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        t_base = table_ptr + b.to(tl.int64) * stride_tb
    else:
        k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
        t_base = table_ptr
    # page_ids "split" (PAGE_IDS > 0, paged only): the page indices of the split's pages, from
    # its first page, page0, on; the key loop's tiles pick theirs from them (_page_tile).
    if PAGE_IDS > 0:
        page0 = (split * SPLIT_LEN) // PAGE
        pages = _split_page_ids(t_base, page0, hi, PAGE, PAGE_IDS)
    else:
        page0 = 0
        pages = 0

    if FA2_PATH:
        _flash_one_split(q, k_base, v_base, t_base, pages, out_ptr, b, h0, stride_kb, stride_kn, stride_vb,
                         stride_vn, stride_ob, stride_oh, length, first, qk_scale, G, D, BLOCK_N, BLOCK_G, PDL,
                         PAGED, PAGE, PAGE_IDS)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
        if FLASH_ORDER:
            # Start every split from the running max that flash attention's forward (the
            # reference's full forward) has after its first tile: that of the last
            # BLOCK_N-aligned tile, holding the newest positions. The bf16 rounding of
            # P then happens at the same scale as there for most tiles (module doc).
            last = ((length - 1) // BLOCK_N) * BLOCK_N
            pos = last + offs_n
            pos_ok = (pos < length) & (pos >= first)
            if PAGED:
                k_tile, v_tile, rows = _page_tile(k_base, v_base, t_base, last, offs_n, stride_kb, stride_vb, PAGE)
            else:
                k_tile, rows = k_base, pos
            k = tl.load(k_tile + rows[:, None] * stride_kn + offs_d[None, :], mask=pos_ok[:, None], other=0.0)
            s = tl.where(pos_ok[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
            m_i = tl.max(s, axis=1)

        # An empty slice (lo >= hi: past the length, or before the window) runs no
        # iteration and leaves a partial with acc 0 and l 0 that the merge weighs as zero.
        n_tiles = tl.cdiv(hi - lo, BLOCK_N)
        for t in range(0, n_tiles):
            if FLASH_ORDER:
                start = lo + (n_tiles - 1 - t) * BLOCK_N   # newest tile first, as flash attention walks
            else:
                start = lo + t * BLOCK_N
            pos = start + offs_n
            pos_ok = (pos < hi) & (pos >= first)
            if PAGED:
                k_tile, v_tile, rows = _page_tile(k_base, v_base, t_base, start, offs_n, stride_kb, stride_vb, PAGE,
                                                  pages, page0, PAGE_IDS)
            else:
                k_tile, v_tile, rows = k_base, v_base, pos
            # Masked loads: positions past lengths[b] may hold stale or garbage K/V
            # (even NaN), which must not reach the sums, not even as 0 * NaN.
            k = tl.load(k_tile + rows[:, None] * stride_kn + offs_d[None, :], mask=pos_ok[:, None], other=0.0)
            v = tl.load(v_tile + rows[:, None] * stride_vn + offs_d[None, :], mask=pos_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N] fp32
            s = tl.where(pos_ok[None, :], s, float("-inf"))
            # Every tile holds at least one valid position (lo is the window's first
            # tile or later, and a split's bounds are whole tiles), so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # P is rounded to bf16 before P @ V, as the reference and flash attention do.
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
            m_i = m_new
        pdl.launch_dependents(PDL)

        if DIRECT:
            # A zero-length sequence has l == 0: write zeros (what an empty softmax @ V gives), not NaN.
            denom = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc / denom[:, None]
            o_base = out_ptr + b.to(tl.int64) * stride_ob + h0 * stride_oh
            tl.store(o_base + offs_g[:, None] * stride_oh + offs_d[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])
        else:
            # Workspace layout: acc [B, H, NUM_SPLITS, D], m and l [B, H, NUM_SPLITS], contiguous.
            row = (b * KVH * G + h0 + offs_g).to(tl.int64) * NUM_SPLITS + split
            tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
            tl.store(m_ptr + row, m_i, mask=row_ok)
            tl.store(l_ptr + row, l_i, mask=row_ok)


@triton.jit
def _page_tile(k_base, v_base, t_base, start, offs_n, stride_kb, stride_vb, PAGE: tl.constexpr,
               pages=0, page0=0, PAGE_IDS: tl.constexpr = 0):
    """The paged form's addresses of the tile of positions start + offs_n (start a multiple of
    BLOCK_N, so the tile lies in one page): (K page base, V page base, rows in the page).

    PAGE_IDS 0: the page index is loaded from the table. The table index is kept >= 0: the
    newest-first walk's first tile of a zero-length row starts before position 0 (all its
    positions masked), and must still read row b's table.
    PAGE_IDS > 0: it is picked from `pages`, the split's indices from page `page0` on
    (_split_page_ids), by a sum of one entry and zeros (exact); the tile must lie in the
    split and below its end (the key loop's tiles do)."""
    if PAGE_IDS > 0:
        pick = tl.arange(0, PAGE_IDS) == start // PAGE - page0
        page = tl.sum(tl.where(pick, pages, 0), axis=0).to(tl.int64)
    else:
        page = tl.load(t_base + tl.maximum(start // PAGE, 0)).to(tl.int64)
    return k_base + page * stride_kb, v_base + page * stride_vb, start % PAGE + offs_n


@triton.jit
def _split_page_ids(t_base, page0, hi, PAGE: tl.constexpr, PAGE_IDS: tl.constexpr):
    """page_ids "split": the table entries page0 .. page0 + PAGE_IDS - 1 of row b (t_base),
    those of pages holding a position below `hi` (the split's end, or the length: every tile
    the key loop reads) loaded, the others 0 (never picked, and never read past the table)."""
    idx = page0 + tl.arange(0, PAGE_IDS)
    return tl.load(t_base + idx, mask=idx * PAGE < hi, other=0)


@triton.jit
def _flash_one_split(q, k_base, v_base, t_base, pages, out_ptr, b, h0, stride_kb, stride_kn, stride_vb, stride_vn,
                     stride_ob, stride_oh, length, first, qk_scale, G: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr, PAGED: tl.constexpr,
                     PAGE: tl.constexpr, PAGE_IDS: tl.constexpr):
    """One split over positions [first, length), newest 64-key tile first, in flash attention's
    arithmetic (the FA2 note at the top of the module); writes the bf16 output rows. The
    kernel is compiled without FMA contraction: the one FMA flash has is written out.
    Paged with PAGE_IDS > 0, `pages` holds the sequence's page indices from page 0 on."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    lane_col = tl.arange(0, BLOCK_N // 4)[None, :]
    row_ok = offs_g < G
    lo = (first // BLOCK_N) * BLOCK_N
    n_tiles = tl.cdiv(length - lo, BLOCK_N)
    last = lo + (n_tiles - 1) * BLOCK_N
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    part = tl.zeros([BLOCK_G * 4], dtype=tl.float32)     # the four lanes' partial row sums
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for t in range(0, n_tiles):
        pos = last - t * BLOCK_N + offs_n
        pos_ok = (pos < length) & (pos >= first)
        if PAGED:
            k_tile, v_tile, rows = _page_tile(k_base, v_base, t_base, last - t * BLOCK_N, offs_n,
                                              stride_kb, stride_vb, PAGE, pages, 0, PAGE_IDS)
        else:
            k_tile, v_tile, rows = k_base, v_base, pos
        k = tl.load(k_tile + rows[:, None] * stride_kn + offs_d[None, :], mask=pos_ok[:, None], other=0.0)
        v = tl.load(v_tile + rows[:, None] * stride_vn + offs_d[None, :], mask=pos_ok[:, None], other=0.0)
        s = tl.where(pos_ok[None, :], tl.dot(q, tl.trans(k)), float("-inf"))   # unscaled fp32 scores
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # The first tile takes no rescale (its partials and accumulator are zero).
        alpha = tl.where(m_i == float("-inf"), 1.0, tl.exp2((m_i - m_new) * qk_scale))
        p = tl.exp2(s * qk_scale - (m_new * qk_scale)[:, None])
        # [rows x 4 lanes, 16]: lane u's columns of the tile in the order it adds them.
        cols = tl.reshape(tl.permute(tl.reshape(p, (BLOCK_G, BLOCK_N // 8, 4, 2)), (0, 2, 1, 3)),
                          (BLOCK_G * 4, BLOCK_N // 4))
        first_col = tl.sum(tl.where(lane_col == 0, cols, 0.0), axis=1)          # exact: one value and zeros
        lane_alpha = tl.reshape(tl.broadcast_to(alpha[:, None], (BLOCK_G, 4)), (BLOCK_G * 4,))
        part = _seq16(tl.math.fma(lane_alpha, part, first_col), tl.where(lane_col == 0, 0.0, cols))
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m_i = m_new
    pdl.launch_dependents(PDL)
    quad = tl.reshape(part, (BLOCK_G, 2, 2))             # lane u = 2 hi + lo
    l_i = tl.sum(tl.sum(quad, axis=1), axis=1)           # (u0 + u2) + (u1 + u3)
    inv = tl.where((l_i == 0.0) | (l_i != l_i), 1.0, tl.math.div_rn(tl.full([BLOCK_G], 1.0, tl.float32), l_i))
    o = acc * inv[:, None]
    o_base = out_ptr + b.to(tl.int64) * stride_ob + h0 * stride_oh
    tl.store(o_base + offs_g[:, None] * stride_oh + offs_d[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    acc_ptr, m_ptr, l_ptr, lengths_ptr, out_ptr,
    stride_ob, stride_oh,
    H: tl.constexpr, CAPACITY, SPLIT_LEN,
    NUM_SPLITS, SPLITS_P2: tl.constexpr, D: tl.constexpr, D_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
    gate_ptr=None, stride_gb=0, stride_gh=0, GATE: tl.constexpr = False, INTERPRETED: tl.constexpr = False,
    EARLY: tl.constexpr = False,  # the length read before PDL's wait (pdl.EARLY's note)
):
    pid = tl.program_id(0)  # one (b, h) row
    b = pid // H
    h = pid % H
    if not EARLY:
        pdl.wait(PDL)
        pdl.launch_dependents(PDL)
    length = tl.load(lengths_ptr + b)
    length = tl.minimum(tl.maximum(length, 0), CAPACITY)
    if EARLY:
        pdl.wait(PDL)  # the partials are the split kernel's
        pdl.launch_dependents(PDL)
    o_row = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    if GATE:
        g_row = gate_ptr + b.to(tl.int64) * stride_gb + h * stride_gh
    else:
        g_row = o_row     # not read
    _combine_row(acc_ptr, m_ptr, l_ptr, o_row, g_row, pid, length, SPLIT_LEN, NUM_SPLITS, SPLITS_P2, D, D_CHUNK,
                 GATE, INTERPRETED)


@triton.jit
def _combine_row(acc_ptr, m_ptr, l_ptr, o_ptr, g_ptr, pid, length, SPLIT_LEN, NUM_SPLITS, SPLITS_P2: tl.constexpr,
                 D: tl.constexpr, D_CHUNK: tl.constexpr, GATE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Query row pid's merge of its splits' partials into o_ptr [D] (bf16); with GATE times
    bf16(sigmoid(g_ptr [D])), rounded once more (swiglu.sigmoid_gate_mul's arithmetic). (A merge
    done by the last split program to finish, an arrival count in place of this kernel, measured
    slower at every batch: docs/PERFORMANCE.md.)"""
    # Only splits that start below the length hold data; skip reading the others.
    active = tl.cdiv(length, SPLIT_LEN)
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = (offs_s < NUM_SPLITS) & (offs_s < active)
    row = pid.to(tl.int64) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + row, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    # An empty split (m = -inf) weighs exp2(-inf) = 0. With no active split at all
    # m_max is -inf too; shift by 0 then, since -inf - -inf would be NaN.
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.exp2(m - m_max)
    l_sum = tl.sum(w * l, axis=0)
    denom = tl.where(l_sum > 0.0, l_sum, 1.0)
    # D in chunks so the [splits, D_CHUNK] fp32 tile stays in registers.
    for d0 in tl.static_range(0, D, D_CHUNK):
        offs_d = d0 + tl.arange(0, D_CHUNK)
        acc = tl.load(acc_ptr + row[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        o = (tl.sum(w[:, None] * acc, axis=0) / denom).to(tl.bfloat16)
        if GATE:
            gate = sigmoid_f32(tl.load(g_ptr + offs_d).to(tl.float32), INTERPRETED).to(tl.bfloat16)
            o = (o.to(tl.float32) * gate.to(tl.float32)).to(tl.bfloat16)
        tl.store(o_ptr + offs_d, o)


# One workspace per shape and device, allocated on first use (the warmup call) and
# reused by every later call, so a CUDA graph capture allocates nothing and every
# replay writes the same memory. Calls that share a key must not run concurrently
# on different streams.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(
    batch: int, heads: int, capacity: int, head_dim: int, splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = (batch, heads, capacity, head_dim, splits, str(device))
    ws = _WORKSPACES.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"decode_attention: no workspace for (B={batch}, H={heads}, C={capacity}, D={head_dim}, "
                f"splits={splits}) during CUDA graph capture; call it once with these shapes before capturing"
            )
        acc = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=device)
        m = torch.empty((batch, heads, splits), dtype=torch.float32, device=device)
        l = torch.empty((batch, heads, splits), dtype=torch.float32, device=device)
        ws = (acc, m, l)
        _WORKSPACES[key] = ws
    return ws


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    block_table: torch.Tensor | None = None,
) -> None:
    paged = block_table is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("lengths", lengths)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"decode_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"decode_attention: {name} must be bfloat16, got {t.dtype}")
    if q.dim() != 3:
        raise ValueError(f"decode_attention: q must be [B, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        form = "[P, KVH, PAGE, D] (pages, with block_table)" if paged else "[B, KVH, C, D]"
        raise ValueError(f"decode_attention: k_cache must be {form}, got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"decode_attention: v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    batch, heads, head_dim = q.shape
    kb, kv_heads, capacity, kd = k_cache.shape   # paged: kb pages of `capacity` (PAGE) positions
    if paged:
        _check_block_table(block_table, batch, q.device)
    elif kb != batch:
        raise ValueError(f"decode_attention: k_cache batch {kb} differs from q batch {batch}")
    if kd != head_dim:
        raise ValueError(f"decode_attention: k_cache head_dim {kd} differs from q head_dim {head_dim}")
    if batch < 1 or heads < 1 or kv_heads < 1 or capacity < 1 or kb < 1:
        raise ValueError(
            f"decode_attention: empty dimension in q {tuple(q.shape)} / k_cache {tuple(k_cache.shape)}"
        )
    if heads % kv_heads != 0:
        raise ValueError(f"decode_attention: q heads {heads} not a multiple of k_cache heads {kv_heads}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"decode_attention: head_dim must be a power of two in [16, 256], got {head_dim}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} needs unit stride on head_dim, got strides {t.stride()}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        # In-slice offsets are int32 in the kernel (the (b, kvh) base is int64; paged, the
        # (page, kvh) base, and the slice is one page).
        if (capacity - 1) * t.stride(2) + head_dim >= _INT32_LIMIT:
            what = "page size" if paged else "capacity"
            raise ValueError(
                f"decode_attention: {name} position stride {t.stride(2)} x {what} {capacity} overflows int32 offsets"
            )
    if lengths.dtype != torch.int32:
        raise ValueError(f"decode_attention: lengths must be int32, got {lengths.dtype}")
    if lengths.shape != (batch,) or lengths.stride(0) != 1:
        raise ValueError(
            f"decode_attention: lengths must be a contiguous [{batch}] tensor, got shape {tuple(lengths.shape)}"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"decode_attention: scale must be a positive finite float, got {scale!r}")
    device = q.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("lengths", lengths)):
        if t.device != device:
            raise ValueError(f"decode_attention: {name} is on {t.device}, q is on {device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"decode_attention: out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != torch.bfloat16:
            raise ValueError(f"decode_attention: out must be bfloat16, got {out.dtype}")
        if out.shape != q.shape:
            raise ValueError(f"decode_attention: out shape {tuple(out.shape)} differs from q shape {tuple(q.shape)}")
        if out.stride(-1) != 1:
            raise ValueError(f"decode_attention: out needs unit stride on head_dim, got strides {out.stride()}")
        if out.device != device:
            raise ValueError(f"decode_attention: out is on {out.device}, q is on {device}")


def _check_device(device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"decode_attention: tensors are on {device}; the kernel needs CUDA (or TRITON_INTERPRET=1)")


def _check_block_table(
    block_table: object, batch: int, device: torch.device | None, who: str = "decode_attention"
) -> None:
    """The paged form's table: int32 [B, W], W >= 1, unit stride on W, on `device` (None: any)."""
    if not isinstance(block_table, torch.Tensor):
        raise ValueError(f"{who}: block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"{who}: block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(
            f"{who}: block_table must be [B, W] = [{batch}, W >= 1], got shape {tuple(block_table.shape)}"
        )
    if block_table.stride(1) != 1 and block_table.shape[1] > 1:
        raise ValueError(f"{who}: block_table needs unit stride on W, got strides {block_table.stride()}")
    if device is not None and block_table.device != device:
        raise ValueError(f"{who}: block_table is on {block_table.device}, q is on {device}")


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    flash_order: bool | None = None,
    block_n: int | None = None,
    plan: DecodeAttentionPlan | None = None,
    window: int | None = None,
    block_table: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    early: bool | None = None,
    fa2: bool = True,
) -> torch.Tensor:
    """Attention of one new query per sequence over its first lengths[b] cached positions
    (the last `window` of them when a window is given).

    q [B, H, D] bf16; k_cache, v_cache [B, KVH, C, D] bf16 (unit stride on D); lengths
    [B] int32 on q's device, read only by the kernels (no host sync; values are
    clamped to [0, C], and a zero length gives a zero output row); H % KVH == 0 and
    query head h reads KV head h // (H // KVH); D a power of two in [16, 256].
    Returns out [B, H, D] bf16 (written into `out` when given).

    num_splits: KV slices per (sequence, KV head); None chooses from static sizes
    (default_num_splits). The result's rounding depends on the split count, so keep
    it fixed where bit-identical results across calls matter.

    flash_order: walk each split's tiles newest first, starting from the running
    max of the last aligned tile (see the module docstring); False walks them
    oldest first from -inf. Same math, different rounding of P. None (the default):
    newest first exactly when there is one split, where it reproduces flash
    attention's bits; with several splits neither order does, and oldest first
    skips the extra tile (no measurable fidelity change; docs/PERFORMANCE.md).

    block_n: cache positions per tile (None: 64 at D <= 128, 32 above).

    plan: a whole launch plan (from decode_attention_plan, e.g. with other warps or
    stages); then num_splits and block_n must be None.

    window: the model's sliding window (keys a query sees, itself included), or None.
    It moves each split's start, nothing else: same tiles, plan and graph.

    block_table: the paged form (module docstring). k_cache, v_cache are then pools
    [P, KVH, PAGE, D] bf16 (any strides but unit stride on D: one layer of a
    [L, P, KVH, PAGE, D] buffer is fine) and block_table int32 [B, W] on q's device
    (unit stride on W): sequence b's position p is row p % PAGE of page
    block_table[b, p // PAGE]. C = W * PAGE stands for the capacity everywhere (plan,
    workspace, clamping of lengths, window), and PAGE must be a multiple of the plan's
    block_n. Only the entries of pages holding positions in the window / below
    lengths[b] address memory; the others are never used to load K/V (they may hold
    anything), and the table is read on the device (graph replays see its contents
    then). Same bits as the unpaged call on a [B, KVH, C, D] cache of the same contents.
    The plan's page_ids picks how the kernel gets the page indices (module docstring):
    decode_attention_plan(..., page_ids="split") loads a split's indices once, before its key
    loop (ValueError where a split spans more than 256 pages); "tile", the default, in it.

    gate: an output gate [B, H, D] bf16 (unit stride on D; e.g. a view of a packed product's
    columns): the result is then out * bf16(sigmoid(gate)) rounded to bf16, swiglu.sigmoid_gate_mul's
    bits, merged into the combine where the plan has several splits (one kernel fewer); with one
    split that kernel runs after, and its result (not `out`) is returned.

    early: the kernels read lengths before PDL's wait, and the split kernel asks L2 for the K/V
    lines of its walk's first EARLY_TILES tiles there (unpaged, on a GPU): only where no kernel
    launched with PDL just before writes lengths (pdl.EARLY's note: a decode step's). None:
    pdl.EARLY. Same bits.

    fa2: where the launch fits it (one split of 64-key tiles at head_dim 128, walked newest first),
    one split's arithmetic is flash attention's (module note): the engine's exact decode. False:
    Triton's own softmax arithmetic there too.

    Graph use: call once eagerly with the same shapes before capture (compiles the
    kernels and allocates the cached workspace); replays then honour whatever
    lengths holds at replay time.
    """
    if gate is not None and (gate.shape != q.shape or gate.dtype != torch.bfloat16 or gate.stride(-1) != 1):
        raise ValueError(f"decode_attention: gate must be bfloat16 {tuple(q.shape)} with unit stride on its last "
                         f"dim, got {gate.dtype} {tuple(gate.shape)} with strides {gate.stride()}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"decode_attention: num_splits must be a positive int or None, got {num_splits!r}")
    _check_window(window)
    _check_inputs(q, k_cache, v_cache, lengths, scale, out, block_table)
    batch, heads, head_dim = q.shape
    _, kv_heads, rows, _ = k_cache.shape
    paged = block_table is not None
    # The logical capacity: paged, W pages of PAGE = rows positions.
    capacity = block_table.shape[1] * rows if paged else rows
    default_plan = plan is None
    if plan is None:
        plan = decode_attention_plan(batch, heads, kv_heads, capacity, head_dim, num_splits, block_n, fa2=fa2)
    else:
        _check_plan(plan, heads // kv_heads, capacity, num_splits, block_n)
    if paged and rows % plan.block_n:
        raise ValueError(
            f"decode_attention: page size {rows} (k_cache.shape[2]) is not a multiple of the plan's "
            f"block_n {plan.block_n}: a key tile must lie inside one page"
        )
    direct = plan.num_splits == 1
    if flash_order is None:
        flash_order = direct
    fa2 = fa2_applies(plan, bool(flash_order), head_dim, fa2)
    if (paged and default_plan and fa2
            and triton.next_power_of_2(_split_page_span(plan, capacity, rows)) <= _MAX_PAGE_IDS):
        # the default plan's paged FA2 path takes its page indices once a split: a table load a
        # tile in the key loop made it much slower than the row cache, the indices in registers
        # about as fast (docs/PERFORMANCE.md); elsewhere "tile" was as fast or faster
        plan = replace(plan, page_ids="split")
    page_ids = _page_ids_vector(plan, capacity, rows) if paged else 0
    _check_device(q.device)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    group = heads // kv_heads
    # flash's softmax_scale is a float: c = float(float(scale) * log2 e) there.
    qk_scale = (float(torch.tensor(scale, dtype=torch.float32)) if fa2 else float(scale)) * _LOG2E
    if direct:
        # Unused pointer arguments: any tensor on the device will do.
        acc_ws, m_ws, l_ws = out, out, out
    else:
        acc_ws, m_ws, l_ws = _workspace(batch, heads, capacity, head_dim, plan.num_splits, q.device)
    gated = gate is not None and not direct
    splits_p2 = triton.next_power_of_2(plan.num_splits)
    # The merge holds a [splits, D_CHUNK] fp32 tile in registers: at most 4K elements
    # (32 a thread at 4 warps), so 64 splits x D=256 merges in four chunks.
    d_chunk = max(16, min(head_dim, 4096 // splits_p2))

    use_pdl, pdl_launch = pdl.for_rows(batch)
    early_split, early_combine = {}, {}
    if pdl.early(early, batch):
        early_split = {"EARLY": True, "PREFETCH": EARLY_TILES if q.is_cuda and not paged else 0}
        early_combine = {"EARLY": True}
    _split_kernel[(batch * kv_heads, plan.num_splits)](
        q, k_cache, v_cache, lengths,
        block_table,  # None (a constexpr) when unpaged: the unpaged kernel is the same as without the argument
        acc_ws, m_ws, l_ws, out,
        qk_scale,
        capacity if window is None else min(window, capacity),  # a window >= C masks nothing
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_table.stride(0) if paged else None,
        KVH=kv_heads, G=group, CAPACITY=capacity,
        SPLIT_LEN=plan.split_len, NUM_SPLITS=plan.num_splits,
        D=head_dim, BLOCK_N=plan.block_n, BLOCK_G=plan.block_g,
        DIRECT=direct, FLASH_ORDER=bool(flash_order), PDL=use_pdl,
        FA2_PATH=fa2, PAGED=paged, PAGE=rows if paged else 1, PAGE_IDS=page_ids,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
        **({"enable_fp_fusion": False} if fa2 else {}), **early_split, **pdl_launch,
    )
    if not direct:
        _combine_kernel[(batch * heads,)](
            acc_ws, m_ws, l_ws, lengths, out,
            out.stride(0), out.stride(1),
            H=heads, CAPACITY=capacity, SPLIT_LEN=plan.split_len,
            NUM_SPLITS=plan.num_splits, SPLITS_P2=splits_p2, D=head_dim, D_CHUNK=d_chunk,
            num_warps=4, PDL=use_pdl, **early_combine, **pdl_launch,
            **({"gate_ptr": gate, "stride_gb": gate.stride(0), "stride_gh": gate.stride(1), "GATE": True,
                "INTERPRETED": _INTERPRETED} if gated else {}),
        )
    if gate is not None and direct:
        return sigmoid_gate_mul(out.unsqueeze(1), gate.unsqueeze(1)).view(batch, heads, head_dim)
    return out


def _fa2_fits(num_splits: int, block_n: int, head_dim: int, fa2: bool = True) -> bool:
    """fa2 asked for, and a launch shape the FA2 path runs: one split of 64-key tiles at head_dim
    128 (flash's tiles there)."""
    return fa2 and num_splits == 1 and block_n == 64 and head_dim == 128


def fa2_applies(plan: DecodeAttentionPlan, flash_order: bool, head_dim: int, fa2: bool = True) -> bool:
    """Whether a launch with this plan runs the FA2 path (module note): _fa2_fits, walked
    newest first."""
    return flash_order and _fa2_fits(plan.num_splits, plan.block_n, head_dim, fa2)


def _check_plan(plan: object, group: int, capacity: int, num_splits: object, block_n: object) -> None:
    if not isinstance(plan, DecodeAttentionPlan):
        raise ValueError(f"decode_attention: plan must be a DecodeAttentionPlan, got {type(plan).__name__}")
    if num_splits is not None or block_n is not None:
        raise ValueError("decode_attention: pass either plan or num_splits/block_n, not both")
    if (plan.split_len % plan.block_n or plan.num_splits * plan.split_len < capacity
            or (plan.num_splits - 1) * plan.split_len >= capacity or plan.block_g < max(16, group)):
        raise ValueError(f"decode_attention: plan {plan} does not cover capacity {capacity} with group {group}")
    _check_page_ids(plan.page_ids)


def _check_window(window: object) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"decode_attention: window must be a positive int or None, got {window!r}")


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float,
    window: int | None = None, block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch decode_attention with the same cast points (slow; reads lengths on the host).

    Per sequence: K/V of positions [max(0, lengths[b] - window), lengths[b]) (all of the
    first lengths[b] without a window) expanded to the H query heads,
    fp32 scores of the bf16 operands times scale, fp32 softmax, probabilities rounded
    to bf16, P @ V in fp32, result rounded to bf16. A zero length gives zeros.

    block_table: the paged form (decode_attention's): k_cache, v_cache pools
    [P, KVH, PAGE, D] and block_table int32 [B, W]. Each sequence's pages below its
    length are gathered (block_table read on the host, their indices checked against P)
    into a [B, KVH, W * PAGE, D] copy, NaN past the pages gathered, and the above runs on it.
    """
    if block_table is not None:
        k_cache, v_cache = _gather_pages(q, k_cache, v_cache, lengths, block_table)
    _check_shapes_for_reference(q, k_cache, v_cache, lengths)
    _check_window(window)
    batch, heads, head_dim = q.shape
    _, kv_heads, capacity, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    for b, length in enumerate(lengths.tolist()):
        if not 0 <= length <= capacity:
            raise ValueError(f"decode_attention_reference: lengths[{b}] = {length} outside [0, {capacity}]")
        first = 0 if window is None else max(0, length - window)
        k = k_cache[b, :, first:length].repeat_interleave(group, dim=0).float()  # [H, L, D]
        v = v_cache[b, :, first:length].repeat_interleave(group, dim=0).float()
        scores = torch.matmul(q[b].float().unsqueeze(1), k.transpose(1, 2)) * scale  # [H, 1, L]
        probs = torch.softmax(scores, dim=-1).to(torch.bfloat16).float()
        out[b] = torch.matmul(probs, v).squeeze(1).to(torch.bfloat16)
    return out


def _check_shapes_for_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"decode_attention_reference: want q [B, H, D] and k/v [B, KVH, C, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if k_cache.shape[0] != q.shape[0] or k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(
            f"decode_attention_reference: q {tuple(q.shape)} does not match k_cache {tuple(k_cache.shape)}"
        )
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"decode_attention_reference: lengths shape {tuple(lengths.shape)} is not ({q.shape[0]},)")


def _gather_pages(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's paged form: each sequence's pages holding positions below its length,
    copied in table order into contiguous [B, KVH, W * PAGE, D] caches (NaN elsewhere)."""
    who = "decode_attention_reference"
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{who}: want q [B, H, D] and k/v pages [P, KVH, PAGE, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch = q.shape[0]
    _check_block_table(block_table, batch, None, who)
    if lengths.shape != (batch,):
        raise ValueError(f"{who}: lengths shape {tuple(lengths.shape)} is not ({batch},)")
    pages, kv_heads, page, head_dim = k_cache.shape
    width = block_table.shape[1]
    table = block_table.long()
    # Pages holding a position below the length (lengths past W * PAGE are refused later).
    used = torch.arange(width, device=table.device)[None, :] * page < lengths.to(table.device).long()[:, None]
    rows, cols = used.nonzero(as_tuple=True)
    index = table[rows, cols]
    bad = (index < 0) | (index >= pages)
    if bool(bad.any()):
        b, j = int(rows[bad][0]), int(cols[bad][0])
        raise ValueError(f"{who}: block_table[{b}, {j}] = {int(table[b, j])} outside [0, {pages})")
    gathered = []
    for cache in (k_cache, v_cache):
        full = torch.full((batch, kv_heads, width, page, head_dim), float("nan"), dtype=cache.dtype,
                          device=cache.device)
        full[rows.to(cache.device), :, cols.to(cache.device)] = cache[index.to(cache.device)]
        gathered.append(full.view(batch, kv_heads, width * page, head_dim))
    return gathered[0], gathered[1]


_INTERPRETED = type(_combine_kernel).__name__ == "InterpretedFunction"
