"""Paged KV-cache writes (block tables, as vLLM's) of fqkernels.rope_kv: qk_norm_rope_store
(Qwen3) and rope_store_kv (Qwen3.5) with `block_table` write into page pools [P, KVH, PAGE, D]
exactly what they write into a contiguous [B, KVH, C, D] cache, relocated: position p of
sequence b to page block_table[b, p // PAGE] at offset p % PAGE, every other entry of the pool
untouched; the Q output unchanged. The paged references make the same writes, and agree with
the paged kernels as the unpaged ones do (tests/kernels/test_norm_rope_swiglu.py,
tests/kernels/test_gdn_kernels.py). Kernels: under Triton's CPU interpreter (Triton >= 3.4)
or on a GPU; the references and the argument checks run anywhere."""
from __future__ import annotations

import sys

import pytest
import torch

from bf16_checks import close_to_ulp as _close_to_ulp
from engine_modules import ENGINE_DIR, KERNEL_DEVICE, KERNELS_RUN, KERNELS_SKIP_REASON

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels.rope_kv import (qk_norm_rope_store, qk_norm_rope_store_reference, rope_store_kv,  # noqa: E402
                               rope_store_kv_reference, rope_tables)

DEV = KERNEL_DEVICE
KERNELS = KERNELS_RUN
# the kernel tests (@pytest.mark.gpu, selected by `-m gpu` on a GPU machine, and @needs_kernels):
# on a GPU, or under the interpreter; the references' and the argument checks' tests run anywhere
needs_kernels = pytest.mark.skipif(not KERNELS, reason=KERNELS_SKIP_REASON)


@pytest.fixture(autouse=True)
def _bf16_rounding(interpreter_bf16_rounding):
    """tests/kernels/conftest.py: under the interpreter, fp32 -> bf16 rounds as on the GPU."""


# ----------------------------------------------------------------------------- pools and tables

def _table(B: int, W: int, P: int, gen: torch.Generator) -> torch.Tensor:
    """A shuffled block table: B rows of W distinct pages drawn from a pool of P > B * W pages
    (so some pages belong to no sequence)."""
    assert P > B * W
    return torch.randperm(P, generator=gen)[:B * W].view(B, W).to(torch.int32).contiguous()


def _gather(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The pool [P, KVH, PAGE, D] read back through the table [B, W]: [B, KVH, W * PAGE, D]."""
    B, W = table.shape
    _, KVH, PAGE, D = pool.shape
    return pool[table.long()].permute(0, 2, 1, 3, 4).reshape(B, KVH, W * PAGE, D)


def _unreferenced(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The pool's pages that no row of the table names."""
    keep = torch.ones(pool.shape[0], dtype=torch.bool)
    keep[table.long().flatten().cpu()] = False
    return pool[keep.to(pool.device)]


def _noise(shape, gen: torch.Generator) -> torch.Tensor:
    """A finite sentinel fill (torch.equal compares it; NaN would never be equal)."""
    return (torch.randn(shape, generator=gen) * 5).bfloat16()


def _pools(layers: int, P: int, KVH: int, PAGE: int, D: int, gen: torch.Generator):
    """K and V page pools as one layer's views of bigger buffers, with different strides:
    K = layer 1 of [layers, P, KVH, PAGE, D]; V the first D columns of [P, KVH, PAGE, 2D]."""
    k_full = _noise((layers, P, KVH, PAGE, D), gen)
    v_full = _noise((P, KVH, PAGE, 2 * D), gen)
    return k_full, v_full, (lambda kf: kf[1]), (lambda vf: vf[..., :D])


# ----------------------------------------------------------------------------- qk_norm_rope_store

QK_CASES = [  # (B, S, H, KVH, D, PAGE, starts): decode at page boundaries and 0; prefills over pages
    (6, 1, 4, 2, 64, 16, (0, 15, 16, 17, 47, 100)),
    (5, 1, 4, 2, 128, 64, (0, 63, 64, 127, 200)),
    (2, 37, 2, 1, 64, 16, (0, 0)),
    (2, 70, 1, 1, 64, 64, (0, 0)),
    (2, 23, 2, 1, 64, 16, (0, 9)),   # a later chunk of a prompt, starting mid-page
]


def _qk_inputs(B, S, H, KVH, D, PAGE, starts, seed):
    gen = torch.Generator().manual_seed(seed)
    W = -(-(max(starts) + S) // PAGE) + 1                         # one page to spare per row
    cos, sin = rope_tables(D, 5e6, W * PAGE, torch.device("cpu"))
    qkv = (torch.randn(B * S, (H + 2 * KVH) * D, generator=gen) * 3).bfloat16()
    qn, kn = torch.randn(D, generator=gen).bfloat16(), torch.randn(D, generator=gen).bfloat16()
    start = torch.tensor(starts, dtype=torch.int32)
    P = B * W + 3
    table = _table(B, W, P, gen)
    k_full, v_full, k_of, v_of = _pools(2, P, KVH, PAGE, D, gen)
    return dict(cos=cos, sin=sin, qkv=qkv, qn=qn, kn=kn, start=start, table=table, W=W,
                k_full=k_full, v_full=v_full, k_of=k_of, v_of=v_of)


def _qk_call(fn, x, S, H, KVH, kc, vc, **kw):
    d = lambda t: t.to(DEV)  # noqa: E731
    return fn(d(x["qkv"]), d(x["qn"]), d(x["kn"]), d(x["cos"]), d(x["sin"]), d(x["start"]), S, kc, vc, 1e-6, H, KVH,
              **kw)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("B,S,H,KVH,D,PAGE,starts", QK_CASES)
def test_qk_norm_rope_store_paged_is_the_unpaged_write_relocated(B, S, H, KVH, D, PAGE, starts):
    """The paged kernel's pool, read back through the shuffled table, is the unpaged kernel's
    contiguous cache bit for bit (written entries and the untouched rest); pages no sequence
    owns are untouched; Q is the same."""
    x = _qk_inputs(B, S, H, KVH, D, PAGE, starts, seed=B * S + D + PAGE)
    k_full, v_full = x["k_full"].to(DEV), x["v_full"].to(DEV)
    kp, vp = x["k_of"](k_full), x["v_of"](v_full)
    table = x["table"].to(DEV)
    # the unpaged caches start as the pool seen through the table: same sentinel everywhere
    kc, vc = _gather(kp, table).contiguous(), _gather(vp, table).contiguous()
    k0, v0 = kc.clone(), vc.clone()
    k_free, v_free = _unreferenced(kp, table).clone(), _unreferenced(vp, table).clone()
    k_other = k_full[0].clone()
    q = _qk_call(qk_norm_rope_store, x, S, H, KVH, kc, vc)
    q_paged = _qk_call(qk_norm_rope_store, x, S, H, KVH, kp, vp, block_table=table)
    assert torch.equal(q_paged, q)
    assert not torch.equal(kc, k0) and not torch.equal(vc, v0), "nothing written"
    assert torch.equal(_gather(kp, table), kc) and torch.equal(_gather(vp, table), vc)
    assert torch.equal(_unreferenced(kp, table), k_free) and torch.equal(_unreferenced(vp, table), v_free)
    assert torch.equal(k_full[0], k_other), "another layer's pool was written"
    assert torch.equal(v_full[..., D:], x["v_full"][..., D:].to(DEV)), "outside V's view was written"
    # and exactly the B * S positions changed, at the pages the table names
    pos = torch.tensor(starts)[:, None] + torch.arange(S)
    changed = (kc != k0).any(-1).any(1).cpu()                       # [B, W * PAGE]
    expect = torch.zeros_like(changed)
    expect[torch.arange(B)[:, None], pos] = True
    assert torch.equal(changed, expect)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("B,S,H,KVH,D,PAGE,starts", QK_CASES[:3])
def test_qk_norm_rope_store_paged_reference_agrees_with_the_paged_kernel(B, S, H, KVH, D, PAGE, starts):
    """As the unpaged test (test_norm_rope_swiglu.py::test_qk_norm_rope_store) compares them:
    the same entries written, V exact, Q and K within one BF16 ulp of the head's largest
    element on a small fraction (the norm's reduction order)."""
    x = _qk_inputs(B, S, H, KVH, D, PAGE, starts, seed=B * S + D + PAGE + 1)
    P = x["k_full"].shape[1]
    nan = lambda: torch.full((P, KVH, PAGE, D), float("nan"), dtype=torch.bfloat16)  # noqa: E731
    kp, vp, rk, rv = nan().to(DEV), nan().to(DEV), nan(), nan()
    table = x["table"]
    q = _qk_call(qk_norm_rope_store, x, S, H, KVH, kp, vp, block_table=table.to(DEV)).cpu()
    ref_q = qk_norm_rope_store_reference(x["qkv"], x["qn"], x["kn"], x["cos"], x["sin"], x["start"], S, rk, rv,
                                         1e-6, H, KVH, block_table=table)
    kp, vp = kp.cpu(), vp.cpu()
    _close_to_ulp(q, ref_q, max_mismatch=2e-2, scale=ref_q.float().abs().amax(-1, keepdim=True))
    written = ~torch.isnan(rk)
    assert written.sum() == B * S * KVH * D
    assert torch.equal(written, ~torch.isnan(kp)) and torch.equal(written, ~torch.isnan(vp))
    assert torch.equal(vp.nan_to_num(0), rv.nan_to_num(0)), "V must be copied exactly"
    kk, rr = kp.float().nan_to_num(0), rk.float().nan_to_num(0)
    _close_to_ulp(kk, rr, max_mismatch=2e-2, scale=rr.abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("B,S,H,KVH,D,PAGE,starts", QK_CASES)
def test_qk_norm_rope_store_paged_reference_is_the_unpaged_reference_relocated(B, S, H, KVH, D, PAGE, starts):
    """The references alone (they run anywhere): the paged write is the unpaged one relocated."""
    x = _qk_inputs(B, S, H, KVH, D, PAGE, starts, seed=B * S + D + PAGE + 2)
    kp, vp = x["k_of"](x["k_full"]), x["v_of"](x["v_full"])
    table = x["table"]
    kc, vc = _gather(kp, table).contiguous(), _gather(vp, table).contiguous()
    k_free, v_free = _unreferenced(kp, table).clone(), _unreferenced(vp, table).clone()
    args = (x["qkv"], x["qn"], x["kn"], x["cos"], x["sin"], x["start"], S)
    q = qk_norm_rope_store_reference(*args, kc, vc, 1e-6, H, KVH)
    q_paged = qk_norm_rope_store_reference(*args, kp, vp, 1e-6, H, KVH, block_table=table)
    assert torch.equal(q_paged, q)
    assert torch.equal(_gather(kp, table), kc) and torch.equal(_gather(vp, table), vc)
    assert torch.equal(_unreferenced(kp, table), k_free) and torch.equal(_unreferenced(vp, table), v_free)


# ----------------------------------------------------------------------------- rope_store_kv

KV_CASES = [  # (B, H, D, R, PAGE, positions): decode steps at page boundaries and position 0
    (6, 2, 64, 16, 16, (0, 15, 16, 31, 47, 70)),
    (4, 4, 256, 64, 64, (0, 63, 64, 130)),
    (3, 1, 128, 128, 16, (16, 0, 33)),
]


def _kv_inputs(B, H, D, R, PAGE, positions, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = (torch.randn(B, 2, H, D, generator=gen) * 3).bfloat16()
    W = -(-(max(positions) + 1) // PAGE) + 1
    cos, sin = rope_tables(R, 1e7, W * PAGE, torch.device("cpu"))
    P = B * W + 2
    table = _table(B, W, P, gen)
    full = _noise((2, 2, P, H, PAGE, D), gen)         # [layer, k|v, P, H, PAGE, D]: one layer's views
    return dict(k=kv[:, 0], v=kv[:, 1], cos=cos, sin=sin, pos=torch.tensor(positions, dtype=torch.int32),
                table=table, full=full)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("B,H,D,R,PAGE,positions", KV_CASES)
def test_rope_store_kv_paged_is_the_unpaged_write_relocated(B, H, D, R, PAGE, positions):
    """The paged kernel's pools, read back through the shuffled table, are the unpaged kernel's
    caches bit for bit; pages no sequence owns and the other layer untouched."""
    x = _kv_inputs(B, H, D, R, PAGE, positions, seed=B * D + R + PAGE)
    d = lambda t: t.to(DEV)  # noqa: E731
    full = d(x["full"])
    kp, vp = full[1, 0], full[1, 1]
    table = d(x["table"])
    kc, vc = _gather(kp, table).contiguous(), _gather(vp, table).contiguous()
    k0, v0 = kc.clone(), vc.clone()
    k_free, v_free = _unreferenced(kp, table).clone(), _unreferenced(vp, table).clone()
    rope_store_kv(d(x["k"]), d(x["v"]), d(x["cos"]), d(x["sin"]), d(x["pos"]), kc, vc)
    rope_store_kv(d(x["k"]), d(x["v"]), d(x["cos"]), d(x["sin"]), d(x["pos"]), kp, vp, block_table=table)
    assert not torch.equal(kc, k0) and not torch.equal(vc, v0), "nothing written"
    assert torch.equal(_gather(kp, table), kc) and torch.equal(_gather(vp, table), vc)
    assert torch.equal(_unreferenced(kp, table), k_free) and torch.equal(_unreferenced(vp, table), v_free)
    assert torch.equal(full[0], d(x["full"][0])), "another layer's pools were written"
    changed = (kc != k0).any(-1).any(1).cpu()
    expect = torch.zeros_like(changed)
    expect[torch.arange(B), torch.tensor(positions)] = True
    assert torch.equal(changed, expect)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("B,H,D,R,PAGE,positions", KV_CASES)
def test_rope_store_kv_paged_reference_is_the_paged_kernel(B, H, D, R, PAGE, positions):
    """As test_gdn_kernels.py::test_rope_store_kv_is_the_reference: bit for bit, through the table."""
    x = _kv_inputs(B, H, D, R, PAGE, positions, seed=B * D + R + PAGE + 1)
    want = [x["full"][1, 0].clone(), x["full"][1, 1].clone()]
    rope_store_kv_reference(x["k"], x["v"], x["cos"], x["sin"], x["pos"], *want, block_table=x["table"])
    got = [x["full"][1, 0].clone().to(DEV), x["full"][1, 1].clone().to(DEV)]
    d = lambda t: t.to(DEV)  # noqa: E731
    rope_store_kv(d(x["k"]), d(x["v"]), d(x["cos"]), d(x["sin"]), d(x["pos"]), *got, block_table=d(x["table"]))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert not torch.equal(want[0], x["full"][1, 0])


@pytest.mark.parametrize("B,H,D,R,PAGE,positions", KV_CASES)
def test_rope_store_kv_paged_reference_is_the_unpaged_reference_relocated(B, H, D, R, PAGE, positions):
    x = _kv_inputs(B, H, D, R, PAGE, positions, seed=B * D + R + PAGE + 2)
    kp, vp, table = x["full"][1, 0], x["full"][1, 1], x["table"]
    kc, vc = _gather(kp, table).contiguous(), _gather(vp, table).contiguous()
    k_free = _unreferenced(kp, table).clone()
    rope_store_kv_reference(x["k"], x["v"], x["cos"], x["sin"], x["pos"], kc, vc)
    rope_store_kv_reference(x["k"], x["v"], x["cos"], x["sin"], x["pos"], kp, vp, block_table=table)
    assert torch.equal(_gather(kp, table), kc) and torch.equal(_gather(vp, table), vc)
    assert torch.equal(_unreferenced(kp, table), k_free)


@pytest.mark.gpu
@needs_kernels
def test_more_sequences_than_pages_is_fine_when_paged():
    """Paged, the sequences must fit the table's rows, not the pool's first dim (the unpaged
    check): three sequences whose positions share the one page of a one-page pool get there
    what the unpaged kernels write into their own rows."""
    gen = torch.Generator().manual_seed(7)
    B, S, H, KVH, D, PAGE, starts = 3, 1, 2, 1, 64, 16, (0, 5, 9)
    d = lambda t: t.to(DEV)  # noqa: E731
    table = d(torch.zeros((B, 2), dtype=torch.int32))
    rows, pos = torch.arange(B), torch.tensor(starts)
    x = _qk_inputs(B, S, H, KVH, D, PAGE, starts, seed=7)
    y = _kv_inputs(B, KVH, D, 16, PAGE, starts, seed=7)
    for write in ("qk_norm_rope_store", "rope_store_kv"):
        kp, vp = d(_noise((1, KVH, PAGE, D), gen)), d(_noise((1, KVH, PAGE, D), gen))
        kc, vc = d(_noise((B, KVH, PAGE, D), gen)), d(_noise((B, KVH, PAGE, D), gen))
        k0, v0 = kp.clone(), vp.clone()
        if write == "qk_norm_rope_store":
            _qk_call(qk_norm_rope_store, x, S, H, KVH, kc, vc)
            _qk_call(qk_norm_rope_store, x, S, H, KVH, kp, vp, block_table=table)
        else:
            kv = (d(y["k"]), d(y["v"]), d(y["cos"]), d(y["sin"]), d(y["pos"]))
            rope_store_kv(*kv, kc, vc)
            rope_store_kv(*kv, kp, vp, block_table=table)
        for pool, cache, before in ((kp, kc, k0), (vp, vc, v0)):
            pool, cache, before = pool.cpu(), cache.cpu(), before.cpu()
            assert torch.equal(pool[0][:, pos].transpose(0, 1), cache[rows, :, pos]), write
            before[0][:, pos] = pool[0][:, pos]
            assert torch.equal(pool, before), f"{write}: other offsets of the page were written"


# ----------------------------------------------------------------------------- bad arguments

def _bad_tables(B: int, W: int) -> list[tuple[object, str]]:
    """(a bad block table for B sequences, the words its ValueError must contain)."""
    good = torch.zeros((B, W), dtype=torch.int32)
    return [
        (good.long(), r"block_table must be int32, got torch\.int64"),
        (good.float(), r"block_table must be int32, got torch\.float32"),
        (good.flatten(), r"block_table must be 2-D \[B, W\], got shape \(%d,\)" % (B * W)),
        (good[None], r"block_table must be 2-D"),
        (torch.zeros((W, B), dtype=torch.int32).t(), r"block_table must be contiguous"),
        (torch.zeros((B, 2 * W), dtype=torch.int32)[:, ::2], r"block_table must be contiguous"),
        (torch.zeros((B, W), dtype=torch.int32, device="meta"), r"block_table is on meta, the caches on cpu"),
        (good[:B - 1], r"block_table has %d rows for %d sequences" % (B - 1, B)),
        (good.tolist(), r"block_table must be a torch\.Tensor, got list"),
    ]


def test_bad_block_tables_are_named():
    """Every wrapper and reference rejects a bad table with a ValueError naming it (before any
    launch: these run on the CPU without a kernel)."""
    B, S, H, KVH, D, PAGE = 3, 1, 2, 1, 64, 16
    x = _qk_inputs(B, S, H, KVH, D, PAGE, (0, 16, 20), seed=3)
    y = _kv_inputs(B, KVH, D, 16, PAGE, (0, 16, 20), seed=3)
    kp, vp = x["k_of"](x["k_full"]), x["v_of"](x["v_full"])
    qk_args = (x["qkv"], x["qn"], x["kn"], x["cos"], x["sin"], x["start"], S, kp, vp, 1e-6, H, KVH)
    kv_args = (y["k"], y["v"], y["cos"], y["sin"], y["pos"], y["full"][1, 0], y["full"][1, 1])
    calls = [("qk_norm_rope_store", lambda t: qk_norm_rope_store(*qk_args, block_table=t)),
             ("qk_norm_rope_store_reference", lambda t: qk_norm_rope_store_reference(*qk_args, block_table=t)),
             ("rope_store_kv", lambda t: rope_store_kv(*kv_args, block_table=t)),
             ("rope_store_kv_reference", lambda t: rope_store_kv_reference(*kv_args, block_table=t))]
    before = [t.clone() for t in (kp, vp, y["full"])]
    for name, call in calls:
        for table, words in _bad_tables(B, 2):
            with pytest.raises(ValueError, match=f"^{name}: {words}"):
                call(table)
    assert all(torch.equal(a, b) for a, b in zip(before, (kp, vp, y["full"]))), "a rejected call wrote"


def test_bad_paged_caches_are_named():
    """Pools whose page sizes differ, or that are not [P, KVH, PAGE, D], and (rope_store_kv) a
    pool with another head count or shape."""
    B, S, H, KVH, D, PAGE = 2, 1, 2, 1, 64, 16
    x = _qk_inputs(B, S, H, KVH, D, PAGE, (0, 16), seed=4)
    table = torch.zeros((B, 2), dtype=torch.int32)
    kp = torch.zeros((5, KVH, PAGE, D), dtype=torch.bfloat16)
    other_page = torch.zeros((5, KVH, 2 * PAGE, D), dtype=torch.bfloat16)
    args = (x["qkv"], x["qn"], x["kn"], x["cos"], x["sin"], x["start"], S)
    for fn in (qk_norm_rope_store, qk_norm_rope_store_reference):
        with pytest.raises(ValueError, match=r"one page size, got k_cache \(5, 1, 16, 64\), v_cache \(5, 1, 32, 64\)"):
            fn(*args, kp, other_page, 1e-6, H, KVH, block_table=table)
    # qk_norm_rope_store's own checks still hold in paged mode
    with pytest.raises(ValueError, match="k_cache must be bfloat16"):
        qk_norm_rope_store(*args, kp.float(), kp, 1e-6, H, KVH, block_table=table)
    with pytest.raises(ValueError, match="tokens do not split"):
        qk_norm_rope_store(*args[:5], x["start"][:1], S, kp, kp, 1e-6, H, KVH, block_table=table)
    y = _kv_inputs(B, KVH, D, 16, PAGE, (0, 16), seed=4)
    kv = (y["k"], y["v"], y["cos"], y["sin"], y["pos"])
    with pytest.raises(ValueError, match=r"rope_store_kv: .*caches \(5, 2, 16, 64\)"):
        rope_store_kv(*kv, kp.expand(5, 2, PAGE, D).contiguous(), kp.expand(5, 2, PAGE, D).contiguous(),
                      block_table=table)                           # 2 KV heads in the pool, 1 in k
    with pytest.raises(ValueError, match=r"rope_store_kv: .*caches \(5, 1, 16, 64\) / \(5, 1, 32, 64\)"):
        rope_store_kv(*kv, kp, other_page, block_table=table)
    with pytest.raises(ValueError, match="rope_store_kv_reference: paged caches must be page pools"):
        rope_store_kv_reference(*kv, kp, other_page, block_table=table)


@pytest.mark.gpu
@pytest.mark.skipif(not KERNELS, reason=KERNELS_SKIP_REASON)
@pytest.mark.parametrize("B,H,KVH,D,R,page", [(3, 4, 2, 256, 64, None), (2, 4, 2, 256, 64, 16),
                                              (5, 2, 1, 64, 16, None), (1, 16, 4, 256, 64, 64)])
@pytest.mark.parametrize("early", [False, True], ids=["", "early"])
def test_fused_qwen35_prologue_is_the_separate_kernels(interpreter_bf16_rounding, B, H, KVH, D, R, page, early):
    """Qwen3.5's decode prologue in one kernel (rope_kv.qk_norm_partial_rope_store): each head's
    (1 + w) norm, its partial RoPE at the sequence's position, the key and value into the
    caches (rows, or pages through a block table), the same bits as the separate kernels the
    model runs where the fused one does not apply (rmsnorm with one_plus on the q and k heads read
    in place, partial_rope at the positions, rope_store_kv), every other cache entry untouched;
    early: the position and its RoPE rows read before PDL's wait, the same bits."""
    from fqkernels.rmsnorm import rmsnorm
    from fqkernels.rope_kv import partial_rope, qk_norm_partial_rope_store

    g_ = torch.Generator().manual_seed(B * D + H)
    C = 128
    qkv = (torch.randn(B, (2 * H + 2 * KVH) * D, generator=g_) * 3).bfloat16().to(DEV)
    qn, kn = ((torch.randn(D, generator=g_) * 0.3).bfloat16().to(DEV) for _ in range(2))
    cos, sin = (t.to(DEV) for t in rope_tables(R, 1e7, C, torch.device("cpu")))
    pos = torch.randint(0, C, (B,), generator=g_).int().to(DEV)
    caches = [torch.randn(B, KVH, C, D, generator=g_).bfloat16().to(DEV) for _ in range(2)]
    want = [c.clone() for c in caches]
    rows = qkv.view(B, -1)
    q_heads = rows[:, :2 * H * D].view(B, H, 2 * D)[..., :D]
    k_heads = rows[:, 2 * H * D:2 * H * D + KVH * D].view(B, KVH, D)
    v_heads = rows[:, 2 * H * D + KVH * D:].view(B, KVH, D)
    q_want = partial_rope(rmsnorm(q_heads, qn, 1e-6, one_plus=True), cos, sin, positions=pos)
    rope_store_kv(rmsnorm(k_heads, kn, 1e-6, one_plus=True), v_heads, cos, sin, pos, *want)
    if page is None:
        got = [c.clone() for c in caches]
        q_got = qk_norm_partial_rope_store(qkv, qn, kn, cos, sin, pos, *got, 1e-6, H, KVH, early=early)
    else:   # the same contents in pages of a shuffled table, gathered back to compare
        width = C // page
        perm = torch.randperm(B * width, generator=g_).int()
        table = perm.view(B, width).to(DEV)
        pools = [torch.empty(B * width, KVH, page, D, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
        for pool, c in zip(pools, caches):
            pool[table.reshape(-1).long()] = c.view(B, KVH, width, page, D).transpose(1, 2).reshape(-1, KVH, page, D)
        q_got = qk_norm_partial_rope_store(qkv, qn, kn, cos, sin, pos, *pools, 1e-6, H, KVH, block_table=table,
                                           early=early)
        got = [pool[table.long()].transpose(1, 2).reshape(B, KVH, C, D) for pool in pools]
    assert q_got is not None
    assert torch.equal(q_got, q_want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
