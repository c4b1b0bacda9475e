"""Tests for engine/fqkernels/decode_attention.py: the split-KV decode-attention kernel.

Three tiers, each checking against an independent float64 computation too:
- always (any CPU, the pinned stack): the pure-torch reference, the split plan and
  the wrapper's argument checks;
- TRITON_INTERPRET=1 with Triton >= 3.4: the kernels' logic on CPU
  tensors at small shapes;
- CUDA (marked gpu): the kernels at the real shapes, determinism and CUDA graph replay.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch
import triton

from engine_modules import ENGINE_DIR

# engine/ is the submitted folder: its modules are imported by absolute name.
if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_plan,
    decode_attention_reference,
    default_num_splits,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])

needs_interpreter = pytest.mark.skipif(
    not (INTERPRET and _TRITON_VERSION >= (3, 4)),
    reason="needs TRITON_INTERPRET=1 and Triton >= 3.4 (Triton 3.1's interpreter is broken)",
)
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device (and no TRITON_INTERPRET)"
)

# Kernel vs reference: both round P and the output to bf16, at different points of the
# same sums, so they may differ by about one bf16 ulp of the row's magnitude.
MAX_ULPS = 2.0
# Anything vs exact float64 math on the same bf16 inputs.
MAX_REL_NORM = 1e-2


# ----------------------------------------------------------------------------- helpers


def _float64_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: list[int], scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Exact math written independently of the reference: float64, no bf16 rounding inside.
    With a window, query position L - 1 sees keys j > L - 1 - window (the reference's mask)."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    kv_of_head = torch.arange(heads, device=q.device) // (heads // kv_heads)
    out = torch.zeros((batch, heads, head_dim), dtype=torch.float64, device=q.device)
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        seen = torch.arange(length) > length - 1 - (window if window is not None else length)
        k = k_cache[b, :, :length][:, seen].double()[kv_of_head]  # [H, L, D]
        v = v_cache[b, :, :length][:, seen].double()[kv_of_head]
        scores = torch.einsum("hd,hld->hl", q[b].double(), k) * scale
        weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out[b] = torch.einsum("hl,hld->hd", weights, v)
    return out


def _ulp_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |out - ref| per (b, h) row, in bf16 ulps of that row's largest |ref|.

    Rows where ref is all zero (zero length) must match exactly (returns inf otherwise).
    """
    out = out.double()
    ref = ref.double()
    row_max = ref.abs().amax(dim=-1)
    err = (out - ref).abs().amax(dim=-1)
    zero = row_max == 0
    if bool((err[zero] > 0).any()):
        return math.inf
    # bf16 keeps 7 explicit mantissa bits: ulp(x) = 2^(floor(log2|x|) - 7).
    ulp = torch.exp2(torch.floor(torch.log2(row_max[~zero])) - 7)
    return float((err[~zero] / ulp).max()) if bool((~zero).any()) else 0.0


def _rel_norm(out: torch.Tensor, exact: torch.Tensor) -> float:
    denom = exact.double().norm()
    return float((out.double() - exact.double()).norm() / denom) if denom > 0 else float(out.double().norm())


def _make_inputs(
    batch: int,
    heads: int,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    lengths: list[int],
    device: str,
    seed: int,
    layers: int = 2,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q and one layer of a cache, NaN past each length (and, with a
    window, before each sequence's window: those positions must never be read).

    The cache is laid out [B, layers, KVH, C, D], so the layer view's batch stride is
    not that of a contiguous [B, KVH, C, D] tensor: the kernel must use the strides it
    is given. The NaNs prove that no invalid position reaches the kernel's sums.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, layers, kv_heads, capacity, head_dim)
    k_all = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    v_all = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    q = torch.randn((batch, heads, head_dim), generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    layer = layers - 1
    k, v = k_all[:, layer], v_all[:, layer]
    for b, length in enumerate(lengths):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
        if window is not None:
            k[b, :, :max(0, length - window)] = float("nan")
            v[b, :, :max(0, length - window)] = float("nan")
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, k, v, lengths_t


def _paginate(
    k: torch.Tensor, v: torch.Tensor, page: int, seed: int, lengths: list[int] | None = None, spare: int = 3,
    layers: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same logical contents as k, v [B, KVH, C, D] in the paged form: one layer of
    [layers, P, KVH, page, D] pools (P = B * C / page + spare) and an int32 block table
    [B, C / page] on k's device, every logical page in a pool page of a random permutation.
    The spare pages, and the other layer, hold NaN. With `lengths`, the entries of pages
    wholly at or past a sequence's length point to a spare page instead (NaN there as in
    _make_inputs' caches past the length, so the logical contents stay the same)."""
    batch, kv_heads, capacity, head_dim = k.shape
    assert capacity % page == 0
    width = capacity // page
    pages = batch * width + spare
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages, generator=gen)
    table = order[:batch * width].view(batch, width).clone()
    garbage = int(order[-1])
    shape = (layers, pages, kv_heads, page, head_dim)
    pools = []
    for cache in (k, v):
        pool = torch.full(shape, float("nan"), dtype=cache.dtype, device=cache.device)[layers - 1]
        pool[table.reshape(-1).to(cache.device)] = (
            cache.reshape(batch, kv_heads, width, page, head_dim).transpose(1, 2).reshape(-1, kv_heads, page, head_dim)
        )
        pools.append(pool)
    if lengths is not None:
        for b, length in enumerate(lengths):
            table[b, -(-max(length, 0) // page):] = garbage
    return pools[0], pools[1], table.to(torch.int32).to(k.device)


def _check_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    num_splits: int | None,
    flash_order: bool | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Run the kernel into a NaN-poisoned output and compare with the reference and float64."""
    out = torch.full_like(q, float("nan"))
    result = decode_attention(q, k, v, lengths, scale, out=out, num_splits=num_splits, flash_order=flash_order,
                              window=window)
    assert result.data_ptr() == out.data_ptr()
    assert bool(torch.isfinite(out).all()), "kernel left NaN/inf in the output"
    ref = decode_attention_reference(q, k, v, lengths, scale, window=window)
    ulps = _ulp_error(out, ref)
    assert ulps <= MAX_ULPS, f"kernel vs reference: {ulps:.2f} bf16 ulps (limit {MAX_ULPS})"
    exact = _float64_attention(q, k, v, lengths.tolist(), scale, window)
    rel = _rel_norm(out, exact)
    assert rel < MAX_REL_NORM, f"kernel vs float64: relative error {rel:.3g}"
    return out


# ------------------------------------------------------------- always: reference, plan, checks


@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,capacity,lengths,scale",
    [
        (2, 4, 2, 64, 96, [96, 37], 64**-0.5),
        (1, 8, 2, 128, 300, [257], 128**-0.5),
        (3, 2, 2, 16, 40, [1, 40, 0], 0.25),
        (1, 8, 1, 32, 50, [50], 2.0),  # peaked softmax: scores spread over tens
    ],
)
def test_reference_matches_float64(batch, heads, kv_heads, head_dim, capacity, lengths, scale):
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cpu", seed=1)
    ref = decode_attention_reference(q, k, v, lengths_t, scale)
    exact = _float64_attention(q, k, v, lengths, scale)
    assert ref.dtype == torch.bfloat16 and ref.shape == q.shape
    assert bool(torch.isfinite(ref).all())
    assert _rel_norm(ref, exact) < MAX_REL_NORM
    # The reference rounds P and the output to bf16: at most ~1.5 ulps from exact.
    assert _ulp_error(ref, exact.to(torch.bfloat16)) <= MAX_ULPS


def test_reference_zero_length_gives_zeros():
    q, k, v, lengths_t = _make_inputs(2, 4, 2, 32, 16, [0, 16], "cpu", seed=2)
    ref = decode_attention_reference(q, k, v, lengths_t, 0.5)
    assert bool((ref[0] == 0).all())
    assert bool((ref[1] != 0).any())


@pytest.mark.parametrize("window", [1, 5, 37, 96, 500])
def test_reference_window_matches_float64(window):
    lengths = [96, 37, 1]
    q, k, v, lengths_t = _make_inputs(3, 4, 2, 96, 64, lengths, "cpu", seed=6, window=window)
    ref = decode_attention_reference(q, k, v, lengths_t, 64**-0.5, window=window)
    exact = _float64_attention(q, k, v, lengths, 64**-0.5, window)
    assert bool(torch.isfinite(ref).all()), "a position before the window reached the sums"
    assert _ulp_error(ref, exact.to(torch.bfloat16)) <= MAX_ULPS


def test_window_one_is_the_newest_value():
    q, k, v, lengths_t = _make_inputs(2, 4, 2, 40, 32, [40, 7], "cpu", seed=7, window=1)
    ref = decode_attention_reference(q, k, v, lengths_t, 0.3, window=1)
    for b, length in enumerate([40, 7]):
        assert torch.equal(ref[b], v[b, :, length - 1].repeat_interleave(2, dim=0))


def test_reference_rejects_length_past_capacity():
    q, k, v, _ = _make_inputs(1, 2, 1, 8, 16, [8], "cpu", seed=3)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 9"):
        decode_attention_reference(q, k, v, torch.tensor([9], dtype=torch.int32), 0.25)


@pytest.mark.parametrize(
    "page,lengths,window",
    [
        (16, [0, 1, 16, 96], None),   # zero, one, a page boundary, full capacity
        (32, [96, 33, 0], None),
        (32, [96, 70, 5], 40),        # a window starting inside a page
        (96, [96, 95, 1], 7),         # one page a sequence
    ],
)
def test_paged_reference_matches_unpaged(page, lengths, window):
    q, k, v, lengths_t = _make_inputs(len(lengths), 4, 2, 96, 32, lengths, "cpu", seed=20, window=window)
    plain = decode_attention_reference(q, k, v, lengths_t, 32**-0.5, window=window)
    for redirect in (None, lengths):
        kp, vp, table = _paginate(k, v, page, seed=21, lengths=redirect)
        paged = decode_attention_reference(q, kp, vp, lengths_t, 32**-0.5, window=window, block_table=table)
        assert torch.equal(plain, paged)


def test_paged_reference_rejects_bad_tables():
    q, k, v, lengths_t = _make_inputs(2, 4, 2, 64, 16, [64, 10], "cpu", seed=22)
    kp, vp, table = _paginate(k, v, 16, seed=23)
    pages = kp.shape[0]
    bad = table.clone()
    bad[1, 0] = pages   # a page holding positions below lengths[1]
    with pytest.raises(ValueError, match=rf"block_table\[1, 0\] = {pages} outside \[0, {pages}\)"):
        decode_attention_reference(q, kp, vp, lengths_t, 0.25, block_table=bad)
    bad = table.clone()
    bad[1, 1:] = -1      # past lengths[1] = 10: never read
    assert torch.equal(decode_attention_reference(q, kp, vp, lengths_t, 0.25, block_table=bad),
                       decode_attention_reference(q, k, v, lengths_t, 0.25))
    with pytest.raises(ValueError, match="block_table must be int32"):
        decode_attention_reference(q, kp, vp, lengths_t, 0.25, block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table must be \[B, W\]"):
        decode_attention_reference(q, kp, vp, lengths_t, 0.25, block_table=table[:1])


@pytest.mark.parametrize(
    "batch,kv_heads,capacity,head_dim,expected",
    [
        (1, 8, 32768, 128, 64),  # 8 programs: double to the cap of 64
        (4, 8, 32768, 128, 16),  # 32 programs -> 512
        (8, 8, 32768, 128, 8),
        (16, 8, 32768, 128, 4),
        (64, 8, 32768, 128, 1),  # 512 programs without splitting
        (48, 8, 32768, 128, 2),  # 384 programs: one doubling
        (1, 8, 100, 128, 2),  # never more splits than 64-position tiles
        (1, 8, 100, 256, 4),  # 32-position tiles at D=256
        (3, 2, 4096, 64, 64),
    ],
)
def test_default_num_splits(batch, kv_heads, capacity, head_dim, expected):
    assert default_num_splits(batch, kv_heads, capacity, head_dim) == expected


@pytest.mark.parametrize("capacity", [1, 63, 64, 65, 320, 4096, 33000, 262144])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 4, 7, 32, 5000])
def test_plan_covers_capacity_exactly_once(capacity, num_splits):
    plan = decode_attention_plan(2, 32, 8, capacity, 128, num_splits)
    assert plan.split_len % plan.block_n == 0
    assert plan.num_splits * plan.split_len >= capacity  # every position is covered
    assert (plan.num_splits - 1) * plan.split_len < capacity  # no split starts past the capacity
    if num_splits is not None:
        assert plan.num_splits <= num_splits
    # G = 4 padded to the 16 rows tl.dot needs; to 64 where the FA2 path runs (one split)
    assert plan.block_g == (64 if plan.num_splits == 1 else 16)
    assert decode_attention_plan(2, 32, 8, capacity, 128, num_splits, fa2=False).block_g == 16


def _bad_call(case: str) -> dict:
    """Keyword arguments for decode_attention with exactly one thing wrong."""
    q, k, v, lengths = _make_inputs(2, 4, 2, 16, 32, [16, 3], "cpu", seed=4)
    args = dict(q=q, k_cache=k, v_cache=v, lengths=lengths, scale=0.25)
    if case == "q_dtype":
        args["q"] = q.float()
    elif case == "k_dtype":
        args["k_cache"] = k.half()
    elif case == "q_rank":
        args["q"] = q[:, :, None]
    elif case == "v_shape":
        args["v_cache"] = v[:, :, :8]
    elif case == "batch":
        args["q"] = q[:1]
    elif case == "group":
        args["q"] = torch.cat([q, q[:, :1]], dim=1)  # 5 heads over 2 KV heads
    elif case == "head_dim":
        args["q"], args["k_cache"], args["v_cache"] = q[..., :24], k[..., :24], v[..., :24]
    elif case == "stride":
        args["k_cache"] = k.transpose(2, 3).contiguous().transpose(2, 3)
    elif case == "lengths_dtype":
        args["lengths"] = lengths.long()
    elif case == "lengths_shape":
        args["lengths"] = lengths[:1]
    elif case == "scale":
        args["scale"] = 0.0
    elif case == "out_dtype":
        args["out"] = torch.empty_like(q, dtype=torch.float32)
    elif case == "out_shape":
        args["out"] = torch.empty_like(q[:1])
    elif case == "num_splits":
        args["num_splits"] = 0
    elif case == "window":
        args["window"] = 0
    elif case == "window_type":
        args["window"] = 4.0
    else:
        raise AssertionError(case)
    return args


@pytest.mark.parametrize(
    "case,message",
    [
        ("q_dtype", "q must be bfloat16"),
        ("k_dtype", "k_cache must be bfloat16"),
        ("q_rank", r"q must be \[B, H, D\]"),
        ("v_shape", "v_cache shape"),
        ("batch", "k_cache batch"),
        ("group", "not a multiple"),
        ("head_dim", "head_dim must be a power of two"),
        ("stride", "k_cache needs unit stride"),
        ("lengths_dtype", "lengths must be int32"),
        ("lengths_shape", "lengths must be a contiguous"),
        ("scale", "scale must be a positive"),
        ("out_dtype", "out must be bfloat16"),
        ("out_shape", "out shape"),
        ("num_splits", "num_splits must be a positive"),
        ("window", "window must be a positive int"),
        ("window_type", "window must be a positive int"),
    ],
)
def test_wrapper_rejects_bad_arguments(case, message):
    with pytest.raises(ValueError, match=message):
        decode_attention(**_bad_call(case))


@pytest.mark.skipif(INTERPRET, reason="CPU tensors are accepted under TRITON_INTERPRET=1")
def test_wrapper_rejects_cpu_tensors_without_interpreter():
    q, k, v, lengths = _make_inputs(1, 2, 1, 8, 16, [8], "cpu", seed=5)
    with pytest.raises(ValueError, match="needs CUDA"):
        decode_attention(q, k, v, lengths, 0.25)


def _bad_paged_call(case: str) -> dict:
    """Keyword arguments for a paged decode_attention call (D = 16: 64-position tiles) with
    exactly one thing wrong ("none": nothing)."""
    q, k, v, lengths = _make_inputs(2, 4, 2, 128, 16, [128, 3], "cpu", seed=24)
    kp, vp, table = _paginate(k, v, 64, seed=25)
    args = dict(q=q, k_cache=kp, v_cache=vp, lengths=lengths, scale=0.25, block_table=table)
    if case == "page_size":          # 32-position pages, 64-position tiles
        args["k_cache"], args["v_cache"], args["block_table"] = _paginate(k, v, 32, seed=25)
    elif case == "page_size_block_n":
        args["k_cache"], args["v_cache"], args["block_table"] = _paginate(k, v, 32, seed=25)
        args["block_n"] = 64
    elif case == "table_dtype":
        args["block_table"] = table.long()
    elif case == "table_rank":
        args["block_table"] = table.reshape(-1)
    elif case == "table_batch":
        args["block_table"] = torch.cat([table, table[:1]])
    elif case == "table_stride":
        args["block_table"] = torch.cat([table, table], dim=1)[:, ::2]
    elif case == "table_type":
        args["block_table"] = table.tolist()
    elif case == "pages_shape":
        args["k_cache"] = kp[..., None, :]
    elif case == "page_stride":
        args["k_cache"] = kp.transpose(2, 3).contiguous().transpose(2, 3)
    elif case != "none":
        raise AssertionError(case)
    return args


@pytest.mark.parametrize(
    "case,message",
    [
        ("page_size", r"page size 32 \(k_cache.shape\[2\]\) is not a multiple of the plan's block_n 64"),
        ("page_size_block_n", "page size 32 .* block_n 64"),
        ("table_dtype", "block_table must be int32, got torch.int64"),
        ("table_rank", r"block_table must be \[B, W\] = \[2, W >= 1\], got shape \(4,\)"),
        ("table_batch", r"block_table must be \[B, W\] = \[2, W >= 1\], got shape \(3, 2\)"),
        ("table_stride", "block_table needs unit stride on W"),
        ("table_type", "block_table must be a torch.Tensor, got list"),
        ("pages_shape", r"k_cache must be \[P, KVH, PAGE, D\]"),
        ("page_stride", "k_cache needs unit stride"),
    ],
)
def test_paged_wrapper_rejects_bad_arguments(case, message):
    with pytest.raises(ValueError, match=message):
        decode_attention(**_bad_paged_call(case))


@pytest.mark.skipif(INTERPRET, reason="CPU tensors are accepted under TRITON_INTERPRET=1")
def test_paged_wrapper_accepts_pools_of_another_size_without_interpreter():
    # 7 pages for 2 sequences: the unpaged form's batch check does not apply; every check
    # passes and only the device is refused.
    args = _bad_paged_call("none")
    assert args["k_cache"].shape[0] != args["q"].shape[0]
    with pytest.raises(ValueError, match="needs CUDA"):
        decode_attention(**args)


@pytest.mark.parametrize("page_ids", ["rows", "", None, 1])
def test_plan_rejects_bad_page_ids(page_ids):
    import dataclasses

    with pytest.raises(ValueError, match=r"page_ids must be one of \('tile', 'split'\), got"):
        decode_attention_plan(2, 4, 2, 128, 16, page_ids=page_ids)
    args = _bad_paged_call("none")
    plan = dataclasses.replace(decode_attention_plan(2, 4, 2, 128, 16), page_ids=page_ids)
    with pytest.raises(ValueError, match="page_ids must be one of"):
        decode_attention(**args, plan=plan)


@pytest.mark.parametrize(
    "capacity,page,num_splits,block_n,expected",
    [
        (2048, 64, 1, 64, 32),     # the FA2 path's one split: the whole table row
        (320, 64, 1, 64, 8),       # 5 pages, rounded up to a power of two
        (384, 128, 2, 64, 2),      # splits of 192: the second spans pages 1 and 2
        (384, 128, 3, 64, 1),      # splits of one page each
        (320, 64, 2, 64, 4),       # splits of 192 over pages of 64: 3 pages, rounded up
        (128, 64, 4, 32, 1),       # splits of one 32-position tile, two a page
        (16384, 64, 1, 64, 256),   # the most a program holds
    ],
)
def test_split_page_ids_vector_size(capacity, page, num_splits, block_n, expected):
    import fqkernels.decode_attention as da

    plan = decode_attention_plan(2, 4, 2, capacity, 64, num_splits, block_n, page_ids="split")
    assert da._page_ids_vector(plan, capacity, page) == expected
    assert da._page_ids_vector(decode_attention_plan(2, 4, 2, capacity, 64, num_splits, block_n), capacity, page) == 0


def test_split_page_ids_refuse_a_split_past_the_vector_limit():
    """One split over 32,768 positions in pages of 64 needs 512 page indices a program:
    refused (before the device is looked at), naming the count; "tile" takes it."""
    q, k, v, lengths = _make_inputs(1, 4, 2, 64, 16, [64], "cpu", seed=26)
    kp, vp, _ = _paginate(k, v, 64, seed=27)
    table = torch.zeros((1, 512), dtype=torch.int32)
    plan = decode_attention_plan(1, 4, 2, 512 * 64, 16, 1, page_ids="split")
    with pytest.raises(ValueError, match=r"page_ids='split' needs 512 page indices a program .* more than 256"):
        decode_attention(q, kp, vp, lengths, 0.25, plan=plan, block_table=table)


# ------------------------------------------------------------------ CPU, Triton interpreter

_INTERPRETED_CASES = [
    # batch, heads, kv_heads, head_dim, capacity, lengths, num_splits, scale
    (3, 4, 2, 64, 200, [1, 137, 200], None, 64**-0.5),  # tiny model's heads; 4 splits
    (3, 4, 2, 64, 200, [1, 137, 200], 1, 64**-0.5),  # direct path, no combine
    (3, 4, 2, 64, 200, [1, 137, 200], 3, 64**-0.5),  # odd split count
    (2, 8, 2, 16, 130, [130, 65], 5000, 16**-0.5),  # request above the tile count
    (1, 2, 2, 32, 64, [64], 1, 32**-0.5),  # G = 1
    (2, 16, 2, 128, 300, [0, 299], 8, 128**-0.5),  # G = 8, a zero length, real head_dim
    (1, 4, 1, 256, 100, [77], 2, 1.0),  # D = 256 (32-position tiles), peaked softmax
    (4, 8, 2, 32, 96, [96, 5, 64, 33], 2, 32**-0.5),  # mixed lengths: some splits empty
]


@needs_interpreter
@pytest.mark.parametrize("flash_order", [True, False], ids=["newest-first", "oldest-first"])
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,capacity,lengths,num_splits,scale", _INTERPRETED_CASES)
def test_kernel_matches_reference_interpreted(
    interpreter_fixes, batch, heads, kv_heads, head_dim, capacity, lengths, num_splits, scale, flash_order
):
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cpu", seed=10)
    out = _check_kernel(q, k, v, lengths_t, scale, num_splits, flash_order)
    # Same inputs, same plan: bit-identical (the merge reads the splits in a fixed
    # order whichever program arrives last).
    again = decode_attention(q, k, v, lengths_t, scale, num_splits=num_splits, flash_order=flash_order)
    assert torch.equal(out, again)


def _gate_for(q: torch.Tensor, seed: int) -> torch.Tensor:
    """An output gate [B, H, D] as the Qwen3.5 attention holds it: a view of wider packed rows."""
    gen = torch.Generator(device=q.device).manual_seed(seed)
    B, H, D = q.shape
    wide = (torch.randn((B, H, 2 * D), generator=gen, device=q.device) * 3).to(torch.bfloat16)
    return wide[..., D:]


def _gate_in_merge_agrees(q, k, v, lengths_t, scale, num_splits, window=None):
    """The gate in the merge against swiglu's gate kernel after the attention: the same bits (the
    same gate arithmetic on the same merged rows)."""
    from fqkernels.swiglu import sigmoid_gate_mul

    kw = dict(num_splits=num_splits, window=window)
    plain = decode_attention(q, k, v, lengths_t, scale, **kw)
    gate = _gate_for(q, seed=int(lengths_t.sum()))
    want = sigmoid_gate_mul(plain.unsqueeze(1), gate.unsqueeze(1)).view(q.shape)
    assert torch.equal(decode_attention(q, k, v, lengths_t, scale, gate=gate, **kw), want)
    return plain


@needs_interpreter
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,capacity,lengths,num_splits,scale",
                         [_INTERPRETED_CASES[i] for i in (0, 1, 5, 7)])
def test_gate_in_merge_interpreted(interpreter_fixes, batch, heads, kv_heads, head_dim, capacity, lengths, num_splits,
                                   scale):
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cpu", seed=12)
    _gate_in_merge_agrees(q, k, v, lengths_t, scale, num_splits)
    with pytest.raises(ValueError, match="gate"):
        decode_attention(q, k, v, lengths_t, scale, gate=q[..., :16])


@needs_interpreter
@pytest.mark.parametrize("flash_order", [True, False], ids=["newest-first", "oldest-first"])
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,capacity,lengths,num_splits,scale",
                         [_INTERPRETED_CASES[i] for i in (0, 1, 5, 6, 7)])
def test_early_reads_give_the_same_bits_interpreted(interpreter_fixes, batch, heads, kv_heads, head_dim, capacity,
                                                    lengths, num_splits, scale, flash_order):
    """early=True (the lengths read before PDL's wait; no prefetch off the GPU): the same output as
    without, gated too."""
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cpu", seed=14)
    kw = dict(num_splits=num_splits, flash_order=flash_order)
    assert torch.equal(decode_attention(q, k, v, lengths_t, scale, early=True, **kw),
                       decode_attention(q, k, v, lengths_t, scale, early=False, **kw))
    gate = _gate_for(q, seed=3)
    assert torch.equal(decode_attention(q, k, v, lengths_t, scale, gate=gate, early=True, **kw),
                       decode_attention(q, k, v, lengths_t, scale, gate=gate, early=False, **kw))


@needs_interpreter
@pytest.mark.parametrize("lengths,window", [([300, 1, 64], None), ([65, 128, 0], None), ([300, 200, 77], 100)])
def test_fa2_path_matches_reference_interpreted(interpreter_fixes, monkeypatch, lengths, window):
    """The FA2 path (one split, head_dim 128: flash's arithmetic) computes attention: within the
    same bounds of the reference and float64 as the default path, windows and empty rows too."""
    import fqkernels.decode_attention as da

    q, k, v, lengths_t = _make_inputs(3, 16, 4, 320, 128, lengths, "cpu", seed=12)
    assert da.fa2_applies(da.decode_attention_plan(3, 16, 4, 320, 128, num_splits=1), True, 128)
    _check_kernel(q, k, v, lengths_t, 128**-0.5, 1, None, window)


def test_fa2_path_applies_only_where_flash_runs_one_split_of_64_key_tiles():
    """fa2 (the engine's exact decode) takes flash's arithmetic where a launch fits it: one split of
    64-key tiles at head_dim 128; fa2=False never."""
    import fqkernels.decode_attention as da

    plan = da.decode_attention_plan(16, 32, 8, 1024, 128, fa2=False)
    assert plan.num_splits == 1 and not da.fa2_applies(plan, True, 128, fa2=False) and plan.block_g == 16
    plan = da.decode_attention_plan(16, 32, 8, 1024, 128)
    assert plan.block_g == 64                                                # rows, so warps split rows
    assert da.fa2_applies(plan, True, 128) and not da.fa2_applies(plan, False, 128)
    assert not da.fa2_applies(da.decode_attention_plan(1, 32, 8, 1024, 128), True, 128)          # splits
    assert not da.fa2_applies(da.decode_attention_plan(16, 16, 4, 1024, 256), True, 256)         # D = 256


@needs_interpreter
@pytest.mark.parametrize("flash_order", [True, False], ids=["newest-first", "oldest-first"])
@pytest.mark.parametrize("window", [1, 20, 64, 65, 150, 1000])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_kernel_window_matches_reference_interpreted(interpreter_fixes, num_splits, window, flash_order):
    lengths = [1, 137, 200]
    q, k, v, lengths_t = _make_inputs(3, 4, 2, 200, 64, lengths, "cpu", seed=14, window=window)
    _check_kernel(q, k, v, lengths_t, 64**-0.5, num_splits, flash_order, window)


@needs_interpreter
@pytest.mark.parametrize("block_n", [16, 128])
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,capacity,lengths,num_splits,scale", _INTERPRETED_CASES[:3])
def test_other_tile_sizes_match_reference_interpreted(
    interpreter_fixes, batch, heads, kv_heads, head_dim, capacity, lengths, num_splits, scale, block_n
):
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cpu", seed=13)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, lengths_t, scale, out=out, num_splits=num_splits, block_n=block_n)
    ref = decode_attention_reference(q, k, v, lengths_t, scale)
    assert _ulp_error(out, ref) <= MAX_ULPS


@needs_interpreter
def test_kernel_reads_lengths_at_call_time_interpreted(interpreter_fixes):
    q, k, v, lengths_t = _make_inputs(2, 4, 2, 128, 32, [128, 128], "cpu", seed=11)
    out = torch.empty_like(q)
    decode_attention(q, k, v, lengths_t, 0.2, out=out, num_splits=4)
    first = out.clone()
    lengths_t.copy_(torch.tensor([70, 3], dtype=torch.int32))
    decode_attention(q, k, v, lengths_t, 0.2, out=out, num_splits=4)
    assert not torch.equal(first, out)
    assert _ulp_error(out, decode_attention_reference(q, k, v, lengths_t, 0.2)) <= MAX_ULPS


@needs_interpreter
def test_kernel_ignores_garbage_past_lengths_interpreted(interpreter_fixes):
    # Huge finite values past the length: a mask that only zeroes P (not the loads)
    # would let them in through max() or 0 * inf.
    q, k, v, lengths_t = _make_inputs(1, 4, 2, 128, 32, [50], "cpu", seed=12)
    clean = decode_attention(q, k, v, lengths_t, 0.2, num_splits=2)
    k[:, :, 50:] = 3.0e38
    v[:, :, 50:] = -3.0e38
    assert torch.equal(clean, decode_attention(q, k, v, lengths_t, 0.2, num_splits=2))


_PAGED_CASES = [
    # batch, heads, kv_heads, head_dim, page, width, lengths, window, block_n
    (4, 4, 2, 64, 64, 4, [0, 1, 64, 256], None, None),     # page = tile: zero, one, a page boundary, full
    (4, 4, 2, 64, 128, 2, [0, 1, 128, 256], None, None),   # two tiles a page: rows from start % PAGE = 64
    (4, 4, 2, 64, 128, 2, [129, 65, 200, 256], 100, None),  # a window starting inside a page
    (3, 8, 2, 32, 16, 8, [0, 17, 128], None, 16),          # the smallest tile and page
    (2, 4, 1, 256, 64, 2, [0, 77], None, None),            # D = 256: 32-position tiles, two a page
    (2, 4, 2, 64, 64, 3, [500, 2**31 - 1], None, None),    # lengths past C: clamped to C, as unpaged
]


@needs_interpreter
@pytest.mark.parametrize("flash_order", [True, False], ids=["newest-first", "oldest-first"])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page,width,lengths,window,block_n", _PAGED_CASES)
def test_paged_kernel_matches_unpaged_bits_interpreted(
    interpreter_fixes, batch, heads, kv_heads, head_dim, page, width, lengths, window, block_n, num_splits,
    flash_order,
):
    """The paged form gives the unpaged form's bits on the same logical contents, pages
    shuffled and the rest of the pool (spare pages, the other layer) NaN."""
    capacity = page * width
    scale = head_dim**-0.5
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cpu", seed=30,
                                      window=window)
    kw = dict(num_splits=num_splits, flash_order=flash_order, window=window, block_n=block_n)
    plain = decode_attention(q, k, v, lengths_t, scale, **kw)
    for redirect in (None, lengths):   # entries past a length: the sequence's own pages, then a NaN page
        kp, vp, table = _paginate(k, v, page, seed=31, lengths=redirect)
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kp, vp, lengths_t, scale, out=out, block_table=table, **kw)
        assert torch.equal(out, plain), f"paged differs from unpaged (past-length entries redirected: {bool(redirect)})"
    assert bool(torch.isfinite(out).all())
    if max(lengths) <= capacity:
        ref = decode_attention_reference(q, kp, vp, lengths_t, scale, window=window, block_table=table)
        assert _ulp_error(out, ref) <= MAX_ULPS


_SPLIT_PAGE_IDS_CASES = _PAGED_CASES + [
    # batch, heads, kv_heads, head_dim, page, width, lengths, window, block_n
    (1, 4, 2, 64, 64, 5, [300], None, None),                 # batch 1, a length inside a page
    (1, 4, 2, 64, 128, 3, [383], 150, None),                 # batch 1, a window; 2 splits start mid-page
    (4, 4, 2, 64, 128, 3, [384, 129, 0, 250], None, None),
]


@needs_interpreter
@pytest.mark.parametrize("flash_order", [True, False], ids=["newest-first", "oldest-first"])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3])
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,page,width,lengths,window,block_n", _SPLIT_PAGE_IDS_CASES)
def test_paged_split_page_ids_match_unpaged_bits_interpreted(
    interpreter_fixes, batch, heads, kv_heads, head_dim, page, width, lengths, window, block_n, num_splits,
    flash_order,
):
    """page_ids "split" (each program loads its split's page indices before the key loop):
    the unpaged form's bits and page_ids "tile"'s, pages shuffled and the rest of the pool NaN,
    with splits that start inside a page (num_splits 2 over 3 pages of 128)."""
    capacity = page * width
    scale = head_dim**-0.5
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cpu", seed=36,
                                      window=window)
    kw = dict(flash_order=flash_order, window=window)
    plain = decode_attention(q, k, v, lengths_t, scale, num_splits=num_splits, block_n=block_n, **kw)
    for redirect in (None, lengths):   # entries past a length: the sequence's own pages, then a NaN page
        kp, vp, table = _paginate(k, v, page, seed=37, lengths=redirect)
        outs = {}
        for page_ids in ("tile", "split"):
            plan = decode_attention_plan(batch, heads, kv_heads, capacity, head_dim, num_splits, block_n,
                                         page_ids=page_ids)
            outs[page_ids] = torch.full_like(q, float("nan"))
            decode_attention(q, kp, vp, lengths_t, scale, out=outs[page_ids], plan=plan, block_table=table, **kw)
        assert torch.equal(outs["split"], plain), f"split page ids differ from unpaged (redirected: {bool(redirect)})"
        assert torch.equal(outs["split"], outs["tile"])


@needs_interpreter
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("lengths,window", [([300, 1, 64], None), ([65, 128, 0], None), ([383, 200, 77], 100)])
def test_paged_fa2_path_matches_unpaged_bits_interpreted(interpreter_fixes, monkeypatch, page, lengths, window):
    """The FA2 path (one split, head_dim 128, 64-key tiles) paged, the page indices read per
    tile or once for the split (page_ids): the unpaged path's bits."""
    import fqkernels.decode_attention as da

    capacity = 384
    q, k, v, lengths_t = _make_inputs(3, 16, 4, capacity, 128, lengths, "cpu", seed=32, window=window)
    assert da.fa2_applies(da.decode_attention_plan(3, 16, 4, capacity, 128, num_splits=1), True, 128)
    plain = decode_attention(q, k, v, lengths_t, 128**-0.5, num_splits=1, window=window)
    kp, vp, table = _paginate(k, v, page, seed=33, lengths=lengths)
    for page_ids in ("tile", "split"):
        plan = da.decode_attention_plan(3, 16, 4, capacity, 128, num_splits=1, page_ids=page_ids)
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kp, vp, lengths_t, 128**-0.5, out=out, plan=plan, window=window, block_table=table)
        assert torch.equal(out, plain), f"page_ids={page_ids!r}"
        assert bool(torch.isfinite(out).all())
    # without a plan the paged FA2 path takes "split" (measured faster there: docs/PERFORMANCE.md)
    seen = []
    real = da._page_ids_vector
    monkeypatch.setattr(da, "_page_ids_vector", lambda plan, *a: seen.append(plan.page_ids) or real(plan, *a))
    out = decode_attention(q, kp, vp, lengths_t, 128**-0.5, num_splits=1, window=window, block_table=table)
    assert torch.equal(out, plain) and seen[-1] == "split"


@needs_interpreter
@pytest.mark.parametrize("page_ids", ["tile", "split"])
def test_paged_kernel_reads_the_table_at_call_time_interpreted(interpreter_fixes, page_ids):
    """Pages moved elsewhere in the pool, the table updated to match: the same bits; the
    table changed alone: another result (the table is read by the kernel at each call)."""
    q, k, v, lengths_t = _make_inputs(2, 4, 2, 256, 32, [256, 150], "cpu", seed=34)
    kp, vp, table = _paginate(k, v, 64, seed=35, spare=8)
    plan = decode_attention_plan(2, 4, 2, 256, 32, 2, page_ids=page_ids)
    first = decode_attention(q, kp, vp, lengths_t, 0.2, plan=plan, block_table=table)
    used = set(table.reshape(-1).tolist())
    free = [p for p in range(kp.shape[0]) if p not in used]
    for j, dst in zip((0, 2), free):    # row 1's pages 0 and 2 to spare pages
        src = int(table[1, j])
        kp[dst], vp[dst] = kp[src], vp[src]
        kp[src] = vp[src] = float("nan")
        table[1, j] = dst
    assert torch.equal(first, decode_attention(q, kp, vp, lengths_t, 0.2, plan=plan, block_table=table))
    table[0, 0], table[0, 1] = int(table[0, 1]), int(table[0, 0])   # row 0's first two pages swapped
    swapped = decode_attention(q, kp, vp, lengths_t, 0.2, plan=plan, block_table=table)
    assert torch.equal(swapped[1], first[1]) and not torch.equal(swapped[0], first[0])


# ------------------------------------------------------------------------------------ CUDA

_GPU_HEADS = [(32, 8, 128), (16, 8, 128), (4, 2, 64)]


def _length_patterns(batch: int, capacity: int) -> list[list[int]]:
    singles = sorted({min(n, capacity) for n in (1, 5, 37, 1000, 2049, capacity)})
    patterns = [[n] * batch for n in singles]
    mixed = [(capacity * (i + 1)) // batch if i % 2 else 1 + (i * 997) % capacity for i in range(batch)]
    patterns.append(mixed)
    return patterns


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("capacity", [64, 4096, 33000])
@pytest.mark.parametrize("heads,kv_heads,head_dim", _GPU_HEADS)
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_kernel_matches_reference_gpu(batch, heads, kv_heads, head_dim, capacity):
    scale = head_dim**-0.5
    for i, lengths in enumerate(_length_patterns(batch, capacity)):
        q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cuda", seed=100 + i)
        out = _check_kernel(q, k, v, lengths_t, scale, None)
        for _ in range(3):
            assert torch.equal(out, decode_attention(q, k, v, lengths_t, scale)), "not deterministic"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("flash_order", [True, False], ids=["newest-first", "oldest-first"])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 32, 1000])
def test_explicit_num_splits_gpu(num_splits, flash_order):
    lengths = [4096, 1, 2049, 3000]
    q, k, v, lengths_t = _make_inputs(4, 32, 8, 4096, 128, lengths, "cuda", seed=200)
    _check_kernel(q, k, v, lengths_t, 128**-0.5, num_splits, flash_order)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(8, 8, 16), (16, 2, 32), (64, 8, 256), (8, 1, 256), (32, 4, 128)]
)
def test_other_head_shapes_gpu(heads, kv_heads, head_dim):
    lengths = [1, 999, 3000]
    q, k, v, lengths_t = _make_inputs(3, heads, kv_heads, 3000, head_dim, lengths, "cuda", seed=250)
    for num_splits in (None, 1):
        _check_kernel(q, k, v, lengths_t, head_dim**-0.5, num_splits)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_with_changing_lengths_gpu():
    batch, heads, kv_heads, head_dim, capacity = 4, 32, 8, 128, 4096
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, [capacity] * batch, "cuda", seed=300)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, lengths_t, scale, out=out)  # warmup: compile + workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, lengths_t, scale, out=out)
    for lengths in ([1, 2, 3, 4], [4096, 17, 1000, 2049], [4096] * 4, [64, 65, 4095, 129]):
        lengths_t.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = decode_attention(q, k, v, lengths_t, scale)
        assert torch.equal(out, eager), f"graph replay differs from eager at lengths {lengths}"
        ref = decode_attention_reference(q, k, v, lengths_t, scale)
        assert _ulp_error(out, ref) <= MAX_ULPS


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 4, 256), (32, 8, 128)])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_gate_in_merge_gpu(batch, heads, kv_heads, head_dim):
    """The Qwen3.5 and Qwen3 decode heads: the gate in the merge gives the separate gate kernel's
    bits; a graph of it replayed with other lengths gives the eager bits."""
    capacity = 2048
    for i, lengths in enumerate(_length_patterns(batch, capacity)):
        q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cuda", seed=260 + i)
        _gate_in_merge_agrees(q, k, v, lengths_t, head_dim**-0.5, None)
        _gate_in_merge_agrees(q, k, v, lengths_t, head_dim**-0.5, None, window=700)
    # the replays' lengths go up to the capacity: a cache with every position filled (the loop's
    # last one holds NaN past its lengths, which any longer length would read)
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, [capacity] * batch, "cuda", seed=270)
    gate = _gate_for(q, seed=5)
    out = decode_attention(q, k, v, lengths_t, head_dim**-0.5, gate=gate)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, lengths_t, head_dim**-0.5, gate=gate)
    for lengths in ([1] * batch, [capacity] * batch, _length_patterns(batch, capacity)[-1]):
        lengths_t.copy_(torch.tensor(lengths, dtype=torch.int32))
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_attention(q, k, v, lengths_t, head_dim**-0.5, gate=gate)), lengths


def _graphed_attention_step(family: str, batch: int, early: bool, steps: int, seed: int) -> list[torch.Tensor]:
    """A decode step's attention as the engines run it, captured as a CUDA graph and replayed
    `steps` times: the prologue kernel (norms, RoPE, the new key and value into the caches at the
    positions; PDL) right before decode_attention (PDL), then the positions and lengths advanced by
    one torch add, as DecodeRunner does. Returns each replay's output (cloned)."""
    from fqkernels.rope_kv import qk_norm_partial_rope_store, qk_norm_rope_store, rope_tables

    heads, kv_heads, head_dim = (16, 4, 256) if family == "qwen35" else (32, 8, 128)
    capacity, start = 1024, 300
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape: torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    width = (2 * heads + 2 * kv_heads) * head_dim if family == "qwen35" else (heads + 2 * kv_heads) * head_dim
    qkv = rnd(batch, width)
    q_norm, k_norm = 1 + 0.1 * rnd(head_dim), 1 + 0.1 * rnd(head_dim)
    kc, vc = rnd(batch, kv_heads, capacity, head_dim), rnd(batch, kv_heads, capacity, head_dim)
    cos, sin = rope_tables(64 if family == "qwen35" else head_dim, 10000.0, capacity, torch.device("cuda"))
    pos_len = torch.tensor([[start + 7 * i for i in range(batch)]] * 2, dtype=torch.int32, device="cuda")
    pos_len[1] += 1
    positions, lengths = pos_len[0], pos_len[1]
    scale = head_dim ** -0.5

    def run():
        if family == "qwen35":
            q = qk_norm_partial_rope_store(qkv, q_norm, k_norm, cos, sin, positions, kc, vc, 1e-6, heads, kv_heads,
                                           early=early)
            gate = qkv[:, :2 * heads * head_dim].view(batch, heads, 2 * head_dim)[..., head_dim:]
            out = decode_attention(q, kc, vc, lengths, scale, gate=gate, early=early)
        else:
            q = qk_norm_rope_store(qkv, q_norm, k_norm, cos, sin, positions, 1, kc, vc, 1e-6, heads, kv_heads,
                                   early=early)
            out = decode_attention(q, kc, vc, lengths, scale, early=early)
        pos_len.add_(1)
        return out

    run()      # compile, workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    outs = []
    for _ in range(steps):
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen35", "qwen3"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_early_reads_in_a_graphed_step_gpu(family, batch):
    """pdl.EARLY's reads (the positions, lengths and RoPE rows before PDL's wait, the first K/V
    tiles asked of L2 there) in a graphed step whose prologue writes the new position's key and
    value right before the attention reads them: every replay's output equals the step's without."""
    plain = _graphed_attention_step(family, batch, False, 6, seed=31)
    early = _graphed_attention_step(family, batch, True, 6, seed=31)
    for i, (a, b) in enumerate(zip(plain, early)):
        assert torch.equal(a, b), f"replay {i}: {(a != b).float().mean().item():.3%} of elements differ"


@pytest.mark.gpu
@needs_cuda
def test_offsets_past_int32_gpu():
    # One layer of 16 x 8 x 262144 x 128 bf16 holds 2^32 elements: the per-sequence
    # base offset only fits in int64. Positions past the lengths stay uninitialized.
    batch, heads, kv_heads, head_dim, capacity = 16, 32, 8, 128, 262144
    k = torch.empty((batch, kv_heads, capacity, head_dim), dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    lengths = [3 + 50 * b for b in range(batch)]
    gen = torch.Generator(device="cuda").manual_seed(400)
    for b, length in enumerate(lengths):
        k[b, :, :length] = torch.randn((kv_heads, length, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
        v[b, :, :length] = torch.randn((kv_heads, length, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn((batch, heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    _check_kernel(q, k, v, lengths_t, head_dim**-0.5, None)
    del k, v
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [1, 63, 64, 65, 1000, 4096, 5000])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_kernel_window_matches_reference_gpu(batch, window):
    capacity = 4096
    for i, lengths in enumerate(_length_patterns(batch, capacity)):
        q, k, v, lengths_t = _make_inputs(batch, 32, 8, capacity, 128, lengths, "cuda", seed=500 + i, window=window)
        for num_splits, flash_order in ((None, None), (1, True), (1, False), (7, False), (7, True)):
            _check_kernel(q, k, v, lengths_t, 128**-0.5, num_splits, flash_order, window)


@pytest.mark.gpu
@needs_cuda
def test_window_past_capacity_is_no_window_gpu():
    q, k, v, lengths_t = _make_inputs(4, 32, 8, 1024, 128, [1024, 3, 700, 64], "cuda", seed=510)
    plain = decode_attention(q, k, v, lengths_t, 128**-0.5)
    assert torch.equal(plain, decode_attention(q, k, v, lengths_t, 128**-0.5, window=1024))
    assert torch.equal(plain, decode_attention(q, k, v, lengths_t, 128**-0.5, window=10**9))


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_with_window_gpu():
    batch, capacity, window = 4, 4096, 1000
    q, k, v, lengths_t = _make_inputs(batch, 32, 8, capacity, 128, [capacity] * batch, "cuda", seed=520)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, lengths_t, 0.088, out=out, window=window)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, lengths_t, 0.088, out=out, window=window)
    for lengths in ([1, 2, 999, 1000], [4096, 1001, 2049, 64]):
        lengths_t.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_attention(q, k, v, lengths_t, 0.088, window=window))
        ref = decode_attention_reference(q, k, v, lengths_t, 0.088, window=window)
        assert _ulp_error(out, ref) <= MAX_ULPS


def _paged_length_patterns(batch: int, capacity: int, page: int) -> list[list[int]]:
    """_length_patterns, and one with a zero length, page boundaries and a full row."""
    edges = [0, page, page + 1, 2 * page - 1, capacity]
    return _length_patterns(batch, capacity) + [[edges[i % len(edges)] for i in range(batch)]]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page",
    [(32, 8, 128, 64), (32, 8, 128, 128), (16, 4, 256, 64)],
    ids=["qwen3-page64", "qwen3-page128", "qwen3.5-page64"],
)
@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("page_ids", [None, "split"], ids=["default-plan", "split"])
def test_paged_matches_unpaged_bits_gpu(batch, heads, kv_heads, head_dim, page, page_ids):
    """Plain (eager) calls at the models' shapes: the paged form's bits are the unpaged
    form's, for the default plan, one split either way (the FA2 path at head_dim 128),
    several splits (7 over 2,048 positions: splits of 320 that start inside pages), and a
    window; without a plan (the FA2 path takes page_ids "split" then) or with page_ids "split"
    at the default pipeline depth and one more (5 may not fit shared memory at head_dim 256)."""
    import dataclasses

    capacity, scale = 2048, head_dim**-0.5
    for i, lengths in enumerate(_paged_length_patterns(batch, capacity, page)):
        q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, lengths, "cuda", seed=600 + i)
        kp, vp, table = _paginate(k, v, page, seed=610 + i, lengths=lengths)
        for num_splits, flash_order, window in ((None, None, None), (1, True, None), (1, False, None),
                                                (7, False, None), (7, True, None), (None, None, 1000), (1, True, 100)):
            kw = dict(flash_order=flash_order, window=window)
            plain = decode_attention(q, k, v, lengths_t, scale, num_splits=num_splits, **kw)
            if page_ids is None:
                plans = [None]
            else:
                base = decode_attention_plan(batch, heads, kv_heads, capacity, head_dim, num_splits, page_ids=page_ids)
                plans = [dataclasses.replace(base, num_stages=n) for n in (base.num_stages, base.num_stages + 1)]
            for plan in plans:
                paged = decode_attention(q, kp, vp, lengths_t, scale, block_table=table, **kw,
                                         **(dict(plan=plan) if plan else dict(num_splits=num_splits)))
                assert torch.equal(plain, paged), f"paged differs at lengths {lengths}, {kw}, {plan}"
        # the last call's (one split, window 100) against the paged reference
        ref = decode_attention_reference(q, kp, vp, lengths_t, scale, window=100, block_table=table)
        assert torch.equal(ref, decode_attention_reference(q, k, v, lengths_t, scale, window=100))
        assert _ulp_error(paged, ref) <= MAX_ULPS


@pytest.mark.gpu
@needs_cuda
def test_paged_cuda_graph_replay_gpu():
    """A graph captured over the paged call follows lengths and the table's contents at replay."""
    batch, heads, kv_heads, head_dim, capacity, page = 4, 32, 8, 128, 4096, 64
    q, k, v, lengths_t = _make_inputs(batch, heads, kv_heads, capacity, head_dim, [capacity] * batch, "cuda",
                                      seed=620)
    kp, vp, table = _paginate(k, v, page, seed=621, spare=capacity // page)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kp, vp, lengths_t, scale, out=out, block_table=table)   # warmup: compile + workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kp, vp, lengths_t, scale, out=out, block_table=table)
    spare = sorted(set(range(kp.shape[0])) - set(table.reshape(-1).tolist()))[:capacity // page]
    for step, lengths in enumerate(([1, 2, 3, 4], [4096, 17, 1000, 2049], [64, 65, 4095, 129])):
        if step == 2:    # row 2's pages move to the spare pages, its table row follows
            moved = table[2].long()
            kp[spare], vp[spare] = kp[moved], vp[moved]
            kp[moved] = vp[moved] = float("nan")
            table[2] = torch.tensor(spare, dtype=torch.int32, device="cuda")
        lengths_t.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_attention(q, k, v, lengths_t, scale)), f"replay at lengths {lengths}"


@pytest.mark.parametrize("block_n", [0, 8, 48, True, 64.0])
def test_plan_rejects_bad_block_n(block_n):
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        decode_attention_plan(1, 4, 2, 128, 64, None, block_n)


@pytest.mark.parametrize("batch,heads,split", [(16, 32, False), (7, 32, False), (6, 32, True), (1, 32, True),
                                               (4, 64, False), (4, 16, True)])
def test_unsplit_where_the_reference_decode_is(batch, heads, split):
    # batch x heads >= 212: flash attention's own decode runs one split there.
    plan = decode_attention_plan(batch, heads, 8, 4096, 128)
    assert (plan.num_splits > 1) == split


def test_wide_heads_split_for_speed():
    """Past head_dim 128 (Qwen3.5's 256: 16 query and 4 KV heads) the split count follows the
    programs, not flash's rule: batch 16 over 640 keys runs 4 splits (256 programs), not 1."""
    assert decode_attention_plan(16, 16, 4, 640, 256).num_splits > 1
    assert decode_attention_plan(16, 32, 8, 640, 128).num_splits == 1


@needs_interpreter
def test_explicit_plan_is_checked(interpreter_fixes):
    import dataclasses

    q, k, v, lengths = _make_inputs(2, 4, 2, 200, 64, [200, 3], "cpu", seed=15)
    plan = decode_attention_plan(2, 4, 2, 200, 64, 4)
    with pytest.raises(ValueError, match="either plan or"):
        decode_attention(q, k, v, lengths, 0.125, plan=plan, num_splits=4)
    with pytest.raises(ValueError, match="does not cover capacity"):
        decode_attention(q, k, v, lengths, 0.125, plan=dataclasses.replace(plan, num_splits=2))
    with pytest.raises(ValueError, match="must be a DecodeAttentionPlan"):
        decode_attention(q, k, v, lengths, 0.125, plan=(1, 2))


@needs_interpreter
def test_explicit_plan_runs_interpreted(interpreter_fixes):
    import dataclasses

    q, k, v, lengths = _make_inputs(2, 4, 2, 200, 64, [200, 3], "cpu", seed=16)
    plan = dataclasses.replace(decode_attention_plan(2, 4, 2, 200, 64, 4), num_warps=8, num_stages=3)
    out = decode_attention(q, k, v, lengths, 0.125, plan=plan)
    assert torch.equal(out, decode_attention(q, k, v, lengths, 0.125, num_splits=4))
