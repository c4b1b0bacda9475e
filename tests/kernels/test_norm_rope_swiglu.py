"""Triton kernels of rmsnorm.py, rope_kv.py and swiglu.py against their torch
references on the GPU. The references are Transformers' functions bit for bit
(tests/test_reference_ops.py); here the kernels must match the references
exactly, except where a float32 special function (rsqrt, exp) may round one
ulp differently: then at most 1 BF16 ulp on a tiny fraction of elements.
Index and cache writes must match exactly."""
import sys

import pytest
import torch

from bf16_checks import close_to_ulp as _close_to_ulp
from engine_modules import ENGINE_DIR

sys.path.insert(0, str(ENGINE_DIR))

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fqkernels import gemv  # noqa: E402
from fqkernels.rmsnorm import (add_rmsnorm, add_rmsnorm_partials, add_rmsnorm_partials_reference,  # noqa: E402
                               add_rmsnorm_reference, embed_rmsnorm, embed_rmsnorm_reference,
                               mean_of_squares_torch_order, rmsnorm, rmsnorm_reference)
from fqkernels.rope_kv import qk_norm_rope_store, qk_norm_rope_store_reference, rope_tables  # noqa: E402
from fqkernels.swiglu import silu_mul, silu_mul_reference  # noqa: E402

DEV = torch.device("cuda")


@pytest.mark.parametrize("torch_order", [True, False])
@pytest.mark.parametrize("rows,n", [(1, 2560), (16, 2560), (7, 1000), (64, 4096), (3, 128), (2, 9000)])
def test_rmsnorm_and_add_rmsnorm(monkeypatch, rows, n, torch_order):
    """Both kernels (torch's summation order, the default; Triton's tl.sum, rmsnorm.TORCH_ORDER = False)
    within one bf16 ulp of the reference; rows wider than the torch-order kernel takes use tl.sum.
    The tl.sum kernel's mean may differ from torch's in its last bit; the normalized value then
    moves an ulp before the weight multiplies it and the product rounds again, so its outputs
    may move two ulps (seen once at 64 x 4096 on the H200)."""
    import fqkernels.rmsnorm as rn

    monkeypatch.setattr(rn, "TORCH_ORDER", torch_order)
    x = (torch.randn(rows, n, device=DEV) * 4).bfloat16()
    r = (torch.randn(rows, n, device=DEV) * 4).bfloat16()
    w = torch.randn(n, device=DEV).bfloat16()
    out = torch.full_like(x, float("nan"))
    rmsnorm(x, w, 1e-6, out=out)
    ulps = 1 if torch_order else 2
    _close_to_ulp(out, rmsnorm_reference(x, w, 1e-6), ulps=ulps)
    xk, xr = x.clone(), x.clone()
    out.fill_(float("nan"))
    add_rmsnorm(xk, r, w, 1e-6, out=out)
    ref = add_rmsnorm_reference(xr, r, w, 1e-6)
    assert torch.equal(xk, xr), "the BF16 residual add must be exact"
    _close_to_ulp(out, ref, ulps=ulps)


@pytest.mark.parametrize("rows,vocab,n", [(1, 151936, 2560), (16, 151936, 2560), (5, 300, 1000), (64, 1000, 4096)])
def test_embed_rmsnorm(rows, vocab, n):
    """The lookup is a copy (exact), the norm the plain kernel's bits, repeats and the last row included."""
    table = (torch.randn(vocab, n, device=DEV) * 0.05).bfloat16()
    ids = torch.randint(0, vocab, (rows,), device=DEV)
    ids[0], ids[-1] = vocab - 1, ids[0] if rows > 2 else vocab - 1
    w = torch.randn(n, device=DEV).bfloat16()
    for dtype in (torch.int64, torch.int32):
        x, out = embed_rmsnorm(ids.to(dtype), table, w, 1e-6)
        x_ref, out_ref = embed_rmsnorm_reference(ids, table, w, 1e-6)
        assert torch.equal(x, x_ref)
        assert torch.equal(out, rmsnorm(x_ref, w, 1e-6))
        _close_to_ulp(out, out_ref)


@pytest.mark.parametrize("rows,n,splits", [(1, 2560, 1), (4, 2560, 2), (16, 2560, 4), (3, 1000, 3)])
def test_add_rmsnorm_partials(rows, n, splits):
    """Split-K partials reduced inside the norm kernel: the residual is the reference's bit for bit."""
    x = (torch.randn(rows, n, device=DEV) * 4).bfloat16()
    parts = torch.randn(splits, rows, n, device=DEV) * 3
    w = torch.randn(n, device=DEV).bfloat16()
    xk, xr = x.clone(), x.clone()
    out = torch.full_like(x, float("nan"))
    add_rmsnorm_partials(xk, parts, w, 1e-6, out=out)
    ref = add_rmsnorm_partials_reference(xr, parts, w, 1e-6)
    assert torch.equal(xk, xr), "the reduced product and the BF16 residual add must be exact"
    _close_to_ulp(out, ref)


@pytest.mark.parametrize("name,n,k", [("o", 2560, 4096), ("down", 2560, 9728)])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_gemv_partials_into_add_rmsnorm_equal_gemv_then_add_rmsnorm(name, n, k, rows):
    """The fused decode path (GEMV partials -> reduce + add + norm) gives the same bits as
    GEMV (with its own reduce kernel) followed by add_rmsnorm, residual and output."""
    a = torch.randn(rows, k, device=DEV).bfloat16()
    wt = (torch.randn(n, k, device=DEV) * k ** -0.5).bfloat16()
    x = (torch.randn(rows, n, device=DEV) * 4).bfloat16()
    nw = torch.randn(n, device=DEV).bfloat16()
    x1, x2 = x.clone(), x.clone()
    fused = add_rmsnorm_partials(x1, gemv.linear_partials(a, wt), nw, 1e-6)
    plain = add_rmsnorm(x2, gemv.linear(a, wt), nw, 1e-6)
    assert torch.equal(x1, x2) and torch.equal(fused, plain)


@pytest.mark.parametrize("rows", [16, 64, 2048])
@pytest.mark.parametrize("n", [2560, 4096, 5120, 1024, 1000, 128, 64])
def test_torch_order_is_found_and_holds(rows, n):
    """The premise of the norm kernel: one of its summation orders is this torch's own
    x.pow(2).mean(-1) over 16 rows or more, bit for bit, on fresh rows."""
    from fqkernels.rmsnorm import torch_order

    vec, halves, matched = torch_order(n, DEV)
    assert matched, f"no candidate order matches torch {torch.__version__}'s mean at width {n}"
    x = (torch.randn(rows, n, device=DEV) * 4).bfloat16()
    assert torch.equal(x.float().pow(2).mean(-1), mean_of_squares_torch_order(x, vec, halves))


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("n", [2560, 1024, 128])
def test_norms_give_the_full_forwards_bits(monkeypatch, rows, n):
    """With the torch-order kernel (the default), whatever the row count, each norm launch gives the bits the reference gives for
    the same rows inside a forward (16 rows or more there): the references run on the
    rows padded to at least 16 with other rows."""
    import fqkernels.rmsnorm as rn

    monkeypatch.setattr(rn, "TORCH_ORDER", True)
    pad = max(16, rows)
    x = (torch.randn(pad, n, device=DEV) * 4).bfloat16()
    r = (torch.randn(pad, n, device=DEV) * 4).bfloat16()
    parts = torch.randn(3, pad, n, device=DEV) * 3
    w = torch.randn(n, device=DEV).bfloat16()
    assert torch.equal(rmsnorm(x[:rows], w, 1e-6), rmsnorm_reference(x, w, 1e-6)[:rows])
    xk, xr = x[:rows].clone(), x.clone()
    assert torch.equal(add_rmsnorm(xk, r[:rows], w, 1e-6), add_rmsnorm_reference(xr, r, w, 1e-6)[:rows])
    xk, xr = x[:rows].clone(), x.clone()
    got = add_rmsnorm_partials(xk, parts[:, :rows].contiguous(), w, 1e-6)
    assert torch.equal(got, add_rmsnorm_partials_reference(xr, parts, w, 1e-6)[:rows])
    ids = torch.randint(0, pad, (pad,), device=DEV)
    assert torch.equal(embed_rmsnorm(ids[:rows], x, w, 1e-6)[1], embed_rmsnorm_reference(ids, x, w, 1e-6)[1][:rows])


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("n", [2560, 4096, 1024, 1000, 5120, 8192, 64])
def test_torch_order_kernel_mean_is_torchs(rows, n):
    """The torch-order kernel's mean of squares itself, with a bf16 residual and
    with fp32 partials, equals torch's own mean over the same rows inside a forward (16 rows
    or more), bit for bit: stronger than the outputs, which a one-ulp change rarely moves."""
    import fqkernels.rmsnorm as rn

    pad = max(16, rows)
    x = (torch.randn(pad, n, device=DEV) * 4).bfloat16()
    r = (torch.randn(pad, n, device=DEV) * 4).bfloat16()
    parts = torch.randn(3, pad, n, device=DEV) * 3
    if not rn.torch_order(n, DEV)[2]:
        # This torch sums width n in an order the kernel does not implement: the kernel
        # refuses to report a "torch order" there (the norms use the tl.sum kernel).
        with pytest.raises(ValueError, match=f"width {n}"):
            rn.torch_order_mean_of_squares(x[:rows])
        return
    assert torch.equal(rn.torch_order_mean_of_squares(x[:rows]), x.float().pow(2).mean(-1)[:rows])
    s = (x.float() + r.float()).bfloat16()
    assert torch.equal(rn.torch_order_mean_of_squares(x[:rows], r[:rows]), s.float().pow(2).mean(-1)[:rows])
    s = (x.float() + (parts[0] + parts[1] + parts[2]).bfloat16().float()).bfloat16()
    got = rn.torch_order_mean_of_squares(x[:rows], parts[:, :rows].contiguous(), partials=True)
    assert torch.equal(got, s.float().pow(2).mean(-1)[:rows])


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("n", [2560, 256])
def test_one_plus_norm_gives_qwen35s_reference_bits(rows, n):
    """Qwen3.5's (1 + w) norm (rmsnorm_one_plus_reference, Transformers 5.17's) bit for bit, alone
    and after the residual add, on the rows of a forward (16 or more: torch's order)."""
    from fqkernels.rmsnorm import rmsnorm_one_plus_reference

    pad = max(16, rows)
    x = (torch.randn(pad, n, device=DEV) * 4).bfloat16()
    r = (torch.randn(pad, n, device=DEV) * 4).bfloat16()
    w = (torch.randn(n, device=DEV) * 0.3).bfloat16()
    assert torch.equal(rmsnorm(x[:rows], w, 1e-6, one_plus=True), rmsnorm_one_plus_reference(x, w, 1e-6)[:rows])
    xk = x[:rows].clone()
    got = add_rmsnorm(xk, r[:rows], w, 1e-6, one_plus=True)
    s = x + r
    assert torch.equal(xk, s[:rows]) and torch.equal(got, rmsnorm_one_plus_reference(s, w, 1e-6)[:rows])


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_rows_of_heads_are_the_rows(rows):
    """rmsnorm over Qwen3.5-4B's q and k heads read in place from the packed q | k | v product's
    rows: the bits of the same rows made contiguous."""
    qkv = (torch.randn(rows, 10240, device=DEV) * 3).bfloat16()
    w = (torch.randn(256, device=DEV) * 0.3).bfloat16()
    for x in (qkv[:, :8192].view(rows, 16, 512)[..., :256], qkv[:, 8192:9216].view(rows, 4, 256)):
        want = rmsnorm(x.reshape(-1, 256).contiguous(), w, 1e-6, one_plus=True)
        assert torch.equal(rmsnorm(x, w, 1e-6, one_plus=True).view(-1, 256), want)


def test_width_without_a_torch_order_uses_the_tl_sum_kernel(monkeypatch, spy_launches):
    """Where torch_order finds no match (a width torch sums some other way), the norms run
    the tl.sum kernel rather than a torch order that is not torch's."""
    import fqkernels.rmsnorm as rn

    monkeypatch.setattr(rn, "TORCH_ORDER", True)
    n = 384
    x = (torch.randn(16, n, device=DEV) * 4).bfloat16()
    w = torch.randn(n, device=DEV).bfloat16()
    monkeypatch.setattr(rn, "_no_order_to_measure", lambda device: False)
    monkeypatch.setitem(rn._ORDERS, (n, str(x.device)), (True, True, False))
    calls = spy_launches(rn, "_rmsnorm_kernel")
    rmsnorm(x, w, 1e-6)
    assert calls, "the tl.sum kernel was not launched for a width without a torch order"
    monkeypatch.setitem(rn._ORDERS, (n, str(x.device)), (True, True, True))
    calls.clear()
    rmsnorm(x, w, 1e-6)
    assert not calls


def test_add_rmsnorm_partials_bad_shape_names_partials():
    x = torch.zeros(2, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.ones(64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="partials must have shape"):
        add_rmsnorm_partials(x, torch.zeros(2, 3, 64, device=DEV), w, 1e-6)
    with pytest.raises(ValueError, match="partials must be float32"):
        add_rmsnorm_partials(x, torch.zeros(1, 2, 64, device=DEV, dtype=torch.bfloat16), w, 1e-6)


@pytest.mark.parametrize("B,S,H,KVH,D", [(1, 1, 32, 8, 128), (16, 1, 32, 8, 128), (2, 37, 32, 8, 128),
                                         (3, 5, 16, 8, 128), (2, 9, 4, 2, 64)])
@pytest.mark.parametrize("early", [False, True], ids=["", "early"])
def test_qk_norm_rope_store(B, S, H, KVH, D, early):
    """early: the positions and their RoPE rows read before PDL's wait (the bits of the plain
    launch, checked beside the reference)."""
    cap = 4096
    cos, sin = rope_tables(D, 5e6, cap, DEV)
    qkv = (torch.randn(B * S, (H + 2 * KVH) * D, device=DEV) * 3).bfloat16()
    qn, kn = torch.randn(D, device=DEV).bfloat16(), torch.randn(D, device=DEV).bfloat16()
    start = torch.randint(0, cap - S, (B,), device=DEV, dtype=torch.int32)
    # caches are views of one [L, B, KVH, C, D] buffer, as in the engine
    full_k = torch.full((2, B, KVH, cap, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    full_v = full_k.clone()
    ref_k, ref_v = full_k.clone(), full_v.clone()
    q = qk_norm_rope_store(qkv, qn, kn, cos, sin, start, S, full_k[1], full_v[1], 1e-6, H, KVH, early=early)
    if early:
        plain_k, plain_v = full_k.clone().fill_(float("nan")), full_v.clone().fill_(float("nan"))
        plain_q = qk_norm_rope_store(qkv, qn, kn, cos, sin, start, S, plain_k[1], plain_v[1], 1e-6, H, KVH,
                                     early=False)
        assert torch.equal(q, plain_q)
        assert torch.equal(full_k.nan_to_num(0), plain_k.nan_to_num(0))
    ref_q = qk_norm_rope_store_reference(qkv, qn, kn, cos, sin, start, S, ref_k[1], ref_v[1], 1e-6, H, KVH)
    # RoPE's sum of two rounded products can cancel: a one-ulp difference in a
    # product (from the norm's reduction order) is then many ulps of the sum, so
    # the bound is one ulp of the head's largest element.
    _close_to_ulp(q, ref_q, max_mismatch=2e-2, scale=ref_q.float().abs().amax(-1, keepdim=True))
    written = ~torch.isnan(ref_k)
    assert torch.equal(written, ~torch.isnan(full_k)), "cache positions written differ"
    assert torch.equal(full_v.nan_to_num(0), ref_v.nan_to_num(0)), "V must be copied exactly"
    kk, rk = full_k[1].float().nan_to_num(0), ref_k[1].float().nan_to_num(0)
    _close_to_ulp(kk, rk, max_mismatch=2e-2, scale=rk.abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("M,I", [(1, 9728), (16, 9728), (5, 1000), (2048, 384)])
def test_silu_mul(M, I):
    gu = (torch.randn(M, 2 * I, device=DEV) * 4).bfloat16()
    out = torch.full((M, I), float("nan"), device=DEV, dtype=torch.bfloat16)
    silu_mul(gu, out=out)
    _close_to_ulp(out, silu_mul_reference(gu))
