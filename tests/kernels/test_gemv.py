"""Decode matrix-vector kernels (fqkernels.gemv): references, configs, argument checks,
the kernels under Triton's CPU interpreter, an ahead-of-time sm_90 compile, and the
kernels on a GPU.

Which tests run where:
  pinned stack, no GPU      references, configs, argument errors, sm_90 compile
  TRITON_INTERPRET=1        + the kernels on small shapes (an environment with Triton >= 3.4:
                              PYTHONPATH=. TRITON_INTERPRET=1 \\
                              python -m pytest tests/kernels/test_gemv.py)
  a CUDA device             + the kernels on the Qwen3-4B shapes (marked gpu)
"""
from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

import triton  # noqa: E402

from fqkernels import gemv  # noqa: E402
from fqkernels.gemv import (  # noqa: E402
    GemvConfig,
    linear,
    linear_reference,
    linear_silu_mul,
    linear_silu_mul_reference,
    select_config,
)

INTERPRETED = gemv._INTERPRETED
HAS_GPU = torch.cuda.is_available() and not INTERPRETED
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs the kernels under TRITON_INTERPRET=1")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")

# (N, K) of the Qwen3-4B weights; gate_up is used by linear_silu_mul only.
SHAPES_4B = {
    "qkv": (6144, 2560),
    "o": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
    "lm_head": (151936, 2560),
}
# Explicit configs of the other modes, so every kernel is tested on every shape.
FMA_CONFIGS = [
    GemvConfig(block_n=32, block_k=128, split_k=1, mode="fma", block_m=1),
    GemvConfig(block_n=32, block_k=128, split_k=2, mode="fma", block_m=4),
    GemvConfig(block_n=64, block_k=128, split_k=2, mode="dot_t"),
]


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |v| (8 significant bits), in float64."""
    a = v.abs().double().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def fp32_sum_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fp32 sum of x[m, :] * w[n, :] in any order - exact| <= ~K * 2^-24 * sum|x w| (products are exact)."""
    k = x.shape[1]
    return 1.01 * k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())


def linear_error_bound(exact: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Any fp32 summation order, then one bf16 rounding (a full ulp: slack for ties)."""
    return acc + bf16_ulp(exact.abs() + acc)


def silu_mul_error_bound(g: torch.Tensor, u: torch.Tensor, acc_g: torch.Tensor, acc_u: torch.Tensor) -> torch.Tensor:
    """The error of bf16(bf16(silu(bf16(g~))) * bf16(u~)) for fp32 sums g~, u~, against exact g, u."""
    eg, eu = linear_error_bound(g, acc_g), linear_error_bound(u, acc_u)
    sil = g / (1 + torch.exp(-g))
    e_act = 1.1 * eg + bf16_ulp(sil.abs() + 1.1 * eg)     # |silu'| <= 1.1
    e = e_act * (u.abs() + eu) + sil.abs() * eu
    return e + bf16_ulp((sil * u).abs() + e)


def _check_close(out: torch.Tensor, torch_out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    """Within one bf16 ulp of torch's bf16 result for nearly all elements, every element
    within the rounding-error bound of the exact value, and 1e-2 relative to float64."""
    assert not out.isnan().any(), "NaN left in the output: some elements were never written"
    diff = (out.double() - torch_out.double()).abs()
    ulp = bf16_ulp(torch.maximum(out.double().abs(), torch_out.double().abs()))
    within = (diff <= ulp).double().mean().item()
    assert within > 0.999, f"only {within:.5f} of the elements within one ulp of torch"
    bad = ((out.double() - exact).abs() > bound).sum().item()
    assert bad == 0, f"{bad} elements outside the error bound of the exact result"
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.3g} against float64"


def randn_bf16(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def interpreter_silu_mul_tol(g: torch.Tensor, u: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How far the interpreter's silu_mul may sit from the rounded-to-nearest result.

    The interpreter truncates every bf16 cast (the GPU rounds to nearest), so each
    cast may lose up to one ulp: that of g moves silu(g) by |silu'| <= 1.1 times it,
    and the losses of g, silu(g) and u are scaled by the product.
    """
    gb, ub = g.to(torch.bfloat16), u.to(torch.bfloat16)
    act = torch.nn.functional.silu(gb).double()
    return (ub.double().abs() * (bf16_ulp(act) + 1.1 * bf16_ulp(gb))
            + act.abs() * bf16_ulp(ub) + 2 * bf16_ulp(expected))


def staged_silu_mul_float64(g32: torch.Tensor, u32: torch.Tensor) -> torch.Tensor:
    """The model's cast sequence evaluated in float64 between the bf16 roundings."""
    g = g32.to(torch.bfloat16).double()
    u = u32.to(torch.bfloat16).double()
    act = (g / (1.0 + torch.exp(-g))).to(torch.bfloat16).double()
    return (act * u).to(torch.bfloat16)


# ----------------------------------------------------------------------------- references (pinned stack)

@pytest.mark.parametrize("m,n,k", [(1, 64, 2560), (7, 300, 1000), (16, 128, 9728)])
def test_linear_reference_is_one_rounding_of_the_exact_sum(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w = randn_bf16(m, k, gen=gen), randn_bf16(n, k, gen=gen, scale=0.05)
    exact = x.double() @ w.double().t()
    ref = linear_reference(x, w)
    assert ref.dtype == torch.bfloat16 and ref.shape == (m, n)
    # fp32 accumulation error plus one bf16 rounding to nearest (half an ulp).
    acc_err = fp32_sum_error_bound(x, w)
    bound = 0.5 * bf16_ulp(exact.abs() + acc_err) + acc_err
    assert ((ref.double() - exact).abs() <= bound).all()
    assert ((ref.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_gpu_checks_accept_the_reference_and_catch_one_bad_column():
    """The checks the GPU tests apply, on CPU results: no false alarm, and one wrong column is caught."""
    gen = torch.Generator().manual_seed(4)
    m, n, k = 16, 4096, 2560
    x, w = randn_bf16(m, k, gen=gen), randn_bf16(n, k, gen=gen, scale=k ** -0.5)
    # Columns whose exact result nearly cancels: a relative bound alone would fail there.
    x0 = x[0].float()
    w[:64] = (w[:64].float() - (w[:64].float() @ x0)[:, None] * x0 / (x0 ** 2).sum()).bfloat16()
    exact = x.double() @ w.double().t()
    acc = fp32_sum_error_bound(x, w)
    out = linear_reference(x, w)
    _check_close(out, torch.nn.functional.linear(x, w), exact, linear_error_bound(exact, acc))
    g, u = exact[:, : n // 2], exact[:, n // 2:]
    silu_out = linear_silu_mul_reference(x, w)
    _check_close(silu_out, silu_out, g / (1 + torch.exp(-g)) * u,
                 silu_mul_error_bound(g, u, acc[:, : n // 2], acc[:, n // 2:]))
    bad = out.clone()
    bad[:, 1000] = (bad[:, 1000].float() * 1.03).bfloat16()
    with pytest.raises(AssertionError, match="outside the error bound"):
        _check_close(bad, torch.nn.functional.linear(x, w), exact, linear_error_bound(exact, acc))


def test_linear_silu_mul_reference_keeps_the_models_cast_points():
    gen = torch.Generator().manual_seed(1)
    m, i, k = 4, 512, 2560
    x, w = randn_bf16(m, k, gen=gen), randn_bf16(2 * i, k, gen=gen, scale=0.05)
    ref = linear_silu_mul_reference(x, w)
    assert ref.dtype == torch.bfloat16 and ref.shape == (m, i)
    exact = x.double() @ w.double().t()
    staged = staged_silu_mul_float64(exact[:, :i], exact[:, i:])
    # The same function up to fp32-vs-exact sums and fp32-vs-float64 SiLU, which
    # move a result across a bf16 rounding boundary only rarely.
    same = (ref == staged).double().mean().item()
    assert same > 0.99, f"only {same:.4f} of the elements follow the staged cast sequence"
    assert ((ref.double() - staged.double()).abs() <= bf16_ulp(staged)).all()
    # The test can tell a moved cast apart: keeping silu(g) in fp32 through the
    # product by u (one cast fewer) changes many elements.
    g = exact[:, :i].to(torch.bfloat16).double()
    u = exact[:, i:].to(torch.bfloat16).double()
    fused = (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16)
    assert (fused != staged).double().mean().item() > 0.05


def test_linear_silu_mul_reference_is_the_models_op_sequence():
    """act_fn(gate_proj(x)) * up_proj(x) with nn.Linear and F.silu in BF16, as the model runs it."""
    gen = torch.Generator().manual_seed(2)
    m, i, k = 3, 256, 1024
    x, w = randn_bf16(m, k, gen=gen), randn_bf16(2 * i, k, gen=gen, scale=0.05)
    model = torch.nn.functional.silu(torch.nn.functional.linear(x, w[:i])) * torch.nn.functional.linear(x, w[i:])
    ref = linear_silu_mul_reference(x, w)
    # Both accumulate in fp32; only a different summation order inside the CPU
    # matmul can move g or u across a rounding boundary.
    assert (ref == model).double().mean().item() > 0.99
    assert ((ref.double() - model.double()).abs() <= 2 * bf16_ulp(model)).all()


# ----------------------------------------------------------------------------- configs and arguments

@pytest.mark.parametrize("name", sorted(SHAPES_4B))
def test_4b_shapes_have_mask_free_table_configs(name):
    """The split table (exact decode off; test_exact_decode_puts_every_4b_product_in_order
    checks what replaces o and down from 7 rows when it is on)."""
    _check_table(name)


def _check_table(name):
    n, k = SHAPES_4B[name]
    silu = name == "gate_up"
    table = gemv.SILU_MUL_CONFIGS if silu else gemv.LINEAR_CONFIGS
    entry = table[(n, k)]
    ranges = entry if isinstance(entry, tuple) else ((None, entry),)
    limits = [r for r, _ in ranges]
    assert limits[-1] is None and limits[:-1] == sorted(limits[:-1]), "ranges must rise and end open"
    cols = n // 2 if silu else n
    for rows in (1, 2, 4, 5, 16, 64):
        cfg = select_config(n, k, silu, rows, exact=False)
        want = next(c for r, c in ranges if r is None or rows <= r)
        assert cfg is want, f"rows={rows}"
        k_blocks = k // cfg.block_k
        assert k % cfg.block_k == 0 and cols % cfg.block_n == 0
        assert k_blocks % cfg.split_k == 0, "chunks of equal whole blocks keep the inner loop mask-free"


SHAPES_Q35 = {"in_proj": (12352, 2560), "qkv": (10240, 2560), "gate_up": (18432, 2560),
              "down": (2560, 9216), "lm_head": (248320, 2560)}


@pytest.mark.parametrize("name", sorted(SHAPES_Q35))
def test_q35_shapes_take_mask_free_table_configs(name):
    """Qwen3.5-4B's products: the table's one-row fma config, then tensor-core tiles, every
    one mask-free (its K and column blocks divide the shape)."""
    n, k = SHAPES_Q35[name]
    silu = name == "gate_up"
    table = gemv.SILU_MUL_CONFIGS if silu else gemv.LINEAR_CONFIGS
    entries = table[(n, k)]
    cfg = select_config(n, k, silu, 1)
    assert entries[0] == (1, cfg) and cfg.mode == "fma" and cfg.split_k == 1
    for rows in (1, 2, 4, 16, 32, 64):
        cfg = select_config(n, k, silu, rows)
        assert k % cfg.block_k == 0 and (n // 2 if silu else n) % cfg.block_n == 0, (rows, cfg)
        assert (k // cfg.block_k) % cfg.split_k == 0
        assert rows == 1 or cfg.mode in ("dot", "dot_t")


def test_one_row_on_tensor_cores_takes_the_next_ranges_tensor_core_config():
    """one_row_tensor_cores: every 4B product whose one-row config is fma takes its 2-4-row
    tensor-core config at one row (a verify's k + 1 <= 16 rows then fit that tile unwidened); the
    LM heads keep theirs (the screen's); other row counts are unchanged."""
    for shapes in (SHAPES_4B, SHAPES_Q35):
        for name, (n, k) in shapes.items():
            silu = name == "gate_up"
            one = select_config(n, k, silu, 1, one_row_tensor_cores=True)
            if n >= gemv.VOCAB_COLUMNS:
                assert one == select_config(n, k, silu, 1) and one.mode == "fma", name
                continue
            assert one.mode in ("dot", "dot_t") and one == select_config(n, k, silu, 4), name
            assert select_config(n, k, silu, 1).mode == "fma", name
            for rows in (2, 16):
                assert gemv.shared_rows(one, rows, silu, n=n) == one, (name, rows)
            for rows in (2, 4, 7, 16, 64):
                assert select_config(n, k, silu, rows, one_row_tensor_cores=True) == select_config(n, k, silu, rows)


def test_exact_decode_puts_every_4b_product_in_order():
    """Exact decode (the engine's exact_decode): from EXACT_FROM_ROWS to EXACT_TO_ROWS rows every 4B
    decode product walks K in order (what gives the full forward's bits,
    test_gpu_in_order_products_give_the_full_forwards_bits); outside that range, and with exact
    decode off, o and down keep their split-K configs."""
    for exact in (True, False):
        for name, (n, k) in SHAPES_4B.items():
            for rows in range(gemv.EXACT_FROM_ROWS, 65):
                cfg = select_config(n, k, name == "gate_up", rows, exact=exact)
                assert gemv.exact_rows(rows, exact) == (exact and rows <= gemv.EXACT_TO_ROWS)
                assert gemv.in_order(cfg) or (not gemv.exact_rows(rows, exact) and name in ("o", "down")), \
                    (name, rows, cfg)
                assert k % cfg.block_k == 0 and (n // 2 if name == "gate_up" else n) % cfg.block_n == 0
        assert not gemv.in_order(select_config(*SHAPES_4B["down"], False, 4, exact=exact))
        # Qwen3.5-4B's products (the op set takes these on the GEMV in order at exact decode's rows)
        for name, (n, k) in SHAPES_Q35.items():
            for rows in range(gemv.EXACT_FROM_ROWS, gemv.EXACT_TO_ROWS + 1):
                cfg = select_config(n, k, name == "gate_up", rows, exact=exact)
                assert gemv.in_order(cfg) or (not exact and name == "down"), (name, rows, cfg)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64])
def test_shared_rows_narrows_an_fma_tile_to_two_rows_of_four_columns(rows):
    """A verify's rows on the one-row step's fma config: 2-row tiles of at most 4 columns a program
    (no fewer: at 2 columns and block_k 256 a column's sums change order); one row keeps the config."""
    for block_n, block_k in ((8, 256), (16, 256), (4, 512), (8, 1024)):
        one = GemvConfig(block_n=block_n, block_k=block_k, mode="fma", block_m=1)
        got = gemv.shared_rows(one, rows, n=6144)
        want = one if rows == 1 else dataclasses.replace(one, block_m=2, block_n=min(block_n, 4))
        assert got == want, (block_n, block_k, got)
        assert gemv.shared_rows(one, rows, silu_mul=True, n=6144) == want
    two = GemvConfig(block_n=8, block_k=256, mode="fma", block_m=2)      # already a row tile: kept
    assert gemv.shared_rows(two, rows, n=6144) == two


@pytest.mark.parametrize("rows,block_m", [(1, 1), (2, 2), (3, 4), (5, 4), (64, 4)])
def test_shared_rows_widens_a_vocabulary_fma_tile_within_its_registers(rows, block_m):
    """An LM head (n >= VOCAB_COLUMNS) keeps its columns and widens its row tile, reading its
    weights once, as far as the accumulators fit FMA_SHARED_REGS."""
    vocab = gemv.VOCAB_COLUMNS
    small = GemvConfig(block_n=8, block_k=256, mode="fma", block_m=1)       # 16 fp32 a thread a block
    assert gemv.shared_rows(small, rows, n=vocab).block_m == block_m
    assert gemv.shared_rows(small, rows, n=vocab).block_n == 8 and gemv.shared_rows(small, rows, n=vocab).block_k == 256
    big = GemvConfig(block_n=16, block_k=512, mode="fma", block_m=1)        # 64 a block: 2 rows fit, 4 do not
    assert gemv.shared_rows(big, rows, n=vocab).block_m == min(block_m, 2)
    assert gemv.shared_rows(big, rows, silu_mul=True, n=vocab).block_m == 1  # gate and up blocks: 128 a row
    tiles = GemvConfig(block_n=64, block_k=256, mode="dot_t")
    assert gemv.shared_rows(tiles, rows).block_m == (16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 16)


@pytest.mark.parametrize("rows,block_m", [(4, 16), (16, 16), (17, 32), (20, 32), (32, 32), (33, 64), (64, 64), (80, 16)])
def test_shared_rows_widens_a_tensor_core_tile_within_shared_memory(rows, block_m):
    """A verify's rows planned as a 4- or 16-row step: the tile widens to the narrowest of 32 and 64
    that holds every row (past 64 it stays: a remainder tile would read the weights a second time),
    its stages cut to fit DOT_SHARED_SMEM (x and weight tiles in bf16, each stage), never below 2; a
    tile that cannot fit at 2 stages stays as it was."""
    cfg = GemvConfig(block_n=64, block_k=256, split_k=2, num_stages=4, mode="dot_t")
    wide = gemv.shared_rows(cfg, rows)
    assert wide.block_m == block_m and (wide.block_n, wide.block_k, wide.split_k, wide.mode) == (64, 256, 2, "dot_t")
    assert (wide.block_m + 64) * 256 * 2 * wide.num_stages <= gemv.DOT_SHARED_SMEM
    assert wide.num_stages == 4 if block_m == 16 else 2 <= wide.num_stages < 4
    big = GemvConfig(block_n=128, block_k=256, num_stages=3, mode="dot")    # 2 stages of 32 + 128 rows fit, of 64 not
    assert gemv.shared_rows(big, rows).block_m == (block_m if block_m <= 32 else 16)
    assert gemv.shared_rows(big, rows, silu_mul=True).block_m == 16         # gate and up: 256 weight rows


def test_select_config_rejects_zero_rows():
    with pytest.raises(ValueError, match="rows must be >= 1"):
        select_config(6144, 2560, False, 0)


@pytest.mark.parametrize("n,k,silu", [(100, 96, False), (4096, 1000, False), (1024, 3072, False),
                                      (151936, 1024, False), (6144, 4096, True), (2, 16, True)])
def test_default_config_is_valid_and_divides_k_when_it_can(n, k, silu):
    cfg = select_config(n, k, silu)
    assert isinstance(cfg, GemvConfig)
    if k % 16 == 0:
        assert k % cfg.block_k == 0
    k_blocks = triton.cdiv(k, cfg.block_k)
    assert k_blocks % cfg.split_k == 0
    assert select_config(n, k, silu) == cfg   # a pure function of the shape


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_n=48, block_k=128), "block_n"),
    (dict(block_n=64, block_k=8), "block_k"),
    (dict(block_n=64, block_k=128, split_k=0), "split_k"),
    (dict(block_n=64, block_k=128, mode="wgmma"), "mode"),
    (dict(block_n=64, block_k=128, mode="dot", block_m=4), "block_m"),
    (dict(block_n=64, block_k=128, mode="fma", block_m=16), "block_m"),
    (dict(block_n=8, block_k=128, mode="dot"), "block_n"),
    (dict(block_n=64, block_k=128, num_warps=3), "num_warps"),
])
def test_bad_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GemvConfig(**kwargs)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("call,match", [
    (lambda: linear(_bf16(2, 64).float(), _bf16(32, 64)), "x must be bfloat16"),
    (lambda: linear(_bf16(64), _bf16(32, 64)), "x must be 2-D"),
    (lambda: linear(_bf16(64, 2).t(), _bf16(32, 64)), "x must be contiguous"),
    (lambda: linear(_bf16(0, 64), _bf16(32, 64)), "x must not be empty"),
    (lambda: linear(_bf16(2, 64), _bf16(32, 64).half()), "w must be bfloat16"),
    (lambda: linear(_bf16(2, 64), _bf16(32, 48)), "w has 48 columns but x has K=64"),
    (lambda: linear(_bf16(2, 64), [[0.0]]), "w must be a torch.Tensor"),
    (lambda: linear_silu_mul(_bf16(2, 64), _bf16(33, 64)), "w_gate_up must have an even number of rows"),
    (lambda: linear(_bf16(2, 64), _bf16(32, 64), out=_bf16(2, 31)), r"out must have shape \(2, 32\)"),
    (lambda: linear_silu_mul(_bf16(2, 64), _bf16(32, 64), out=_bf16(2, 32)), r"out must have shape \(2, 16\)"),
    (lambda: linear(_bf16(2, 64), _bf16(32, 64), out=_bf16(2, 32).float()), "out must be bfloat16"),
    (lambda: linear(_bf16(2, 64), _bf16(32, 64), config=(32, 64)), "config must be a GemvConfig"),
])
def test_bad_arguments_raise_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on CPU tensors")
def test_cpu_tensors_are_refused_outside_the_interpreter():
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        linear(_bf16(2, 64), _bf16(32, 64))


# ----------------------------------------------------------------------------- sm_90 compile (no GPU needed)

def _aot_compile(kernel, signature: dict, constants: dict, aligned: tuple, num_warps: int, num_stages: int):
    """Compile a kernel for sm_90 with the installed Triton, without a driver."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    if triton.__version__.startswith("3.1."):
        from triton.compiler import AttrsDescriptor
        attrs = AttrsDescriptor(divisible_by_16=tuple(names.index(a) for a in aligned), equal_to_1=())
        src = ASTSource(kernel, signature, constants, attrs)
    elif triton.__version__.startswith("3.6."):
        sig = dict(signature, **{c: "constexpr" for c in constants})
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        src = ASTSource(kernel, sig, constants, attrs)
    else:
        pytest.skip(f"no ahead-of-time compile recipe for Triton {triton.__version__}")
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


MAIN_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "M": "i32", "N": "i32",
            "up_offset": "i32", "ws_split_stride": "i32", "ws_cols": "i32"}
MAIN_ALIGNED = ("x_ptr", "w_ptr", "out_ptr", "ws_ptr", "N", "up_offset", "ws_split_stride", "ws_cols")


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("name,mode,silu", [("o", "dot_t", False), ("gate_up", "dot", True),
                                            ("down", "fma", False), ("gate_up", "fma", True),
                                            ("o", "fma", False), ("lm_head", "fma", False)])
def test_kernels_compile_for_sm90(name, mode, silu):
    """Catches what only the compiler sees (layouts, dot shapes, libdevice) on a machine without a GPU.
    The table's configs: tl.dot ones (either operand order) for 16 rows, fma ones for one row."""
    n, k = SHAPES_4B[name]
    cols = n // 2 if silu else n
    cfg = select_config(n, k, silu, 1 if mode == "fma" else 16)
    assert cfg.mode == mode
    k_blocks = k // cfg.block_k
    constants = dict(K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                     BLOCKS_PER_SPLIT=k_blocks // cfg.split_k, EVEN_N=cols % cfg.block_n == 0, EVEN_K=True,
                     PARTIALS=cfg.split_k > 1, SILU=silu, INTERPRETED=False,
                     PDL=True, PREFETCH_LINES=max(1, cfg.block_k // 64))
    if mode == "fma":
        kernel = gemv._gemv_fma_kernel
    else:
        kernel, constants["SWAP"] = gemv._gemv_dot_kernel, mode == "dot_t"
    compiled = _aot_compile(kernel, MAIN_SIG, constants, MAIN_ALIGNED, cfg.num_warps, cfg.num_stages)
    ptx = compiled.asm["ptx"]
    assert ("mma." in ptx) == (mode != "fma")   # mma.sync or wgmma.mma_async: tensor cores
    # the dependent-launch wait, trigger and weight prefetch compile on this Triton too
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert "prefetch.global.L2" in ptx
    if silu and cfg.split_k == 1:
        # Correctly rounded division in the SiLU (PyTorch's), not Triton's default
        # approximate one (Triton 3.1 adds .ftz: subnormal inputs flush to zero).
        assert re.search(r"div\.rn(\.ftz)?\.f32", ptx) and "div.full" not in ptx
    if cfg.split_k > 1:
        reduce_sig = {"ws_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
                      "ws_split_stride": "i32", "ws_cols": "i32"}
        _aot_compile(gemv._splitk_reduce_kernel, reduce_sig,
                     dict(SPLIT_K=cfg.split_k, BLOCK=gemv._REDUCE_BLOCK, SILU=silu, INTERPRETED=False, PDL=True),
                     ("ws_ptr", "out_ptr", "N", "ws_split_stride", "ws_cols"), 4, 1)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_gdn_epilogue_compiles_for_sm90(rows):
    """in_proj's product with the GDN step's conv and gates in its epilogue (gdn_step's kernel, on
    this module's dot_sums / fma_sums) at Qwen3.5-4B's in_proj and the table's config for that many
    rows: the libdevice calls and the correctly rounded divisions (SiLU, sigmoid) compile on this
    Triton."""
    from fqkernels import gdn_step

    n, k = 12352, 2560
    cfg = select_config(n, k, False, rows)
    assert cfg.split_k == 1
    plan = gemv.launch_plan(rows, n, k, cfg)
    constants = dict(plan["constexprs"], FMA=cfg.mode == "fma", SWAP=cfg.mode == "dot_t", CONV_DIM=8192,
                     GATE_COL=8192 + 4096, HV=32, INTERPRETED=False, PDL=True)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "g_ptr": "*fp32", "conv_state_ptr": "*bf16",
           "conv_w_ptr": "*bf16", "a_log_ptr": "*bf16", "dt_bias_ptr": "*bf16", "M": "i32", "N": "i32",
           "stride_sb": "i32", "stride_sc": "i32"}
    compiled = _aot_compile(gdn_step._in_proj_conv_gates_kernel, sig, constants,
                            ("x_ptr", "w_ptr", "out_ptr", "g_ptr", "conv_state_ptr", "conv_w_ptr", "N"),
                            cfg.num_warps, cfg.num_stages)
    ptx = compiled.asm["ptx"]
    # libdevice inlined (3.6's PTX keeps its labels, so a call is what is looked for); the sigmoid's division
    assert "div.rn.f32" in ptx and not re.search(r"call[^;]*__nv_log1pf", ptx)


# ----------------------------------------------------------------------------- the kernels under the interpreter

# Interpreter shapes: odd N (clamped columns), K not a multiple of block_k (masked
# tail), several row tiles, uneven split-K chunks.
INTERP_CASES = [
    # (m, n, k, config)
    (1, 64, 64, GemvConfig(block_n=32, block_k=32, split_k=1)),
    (3, 100, 96, GemvConfig(block_n=32, block_k=32, split_k=2)),
    (17, 48, 100, GemvConfig(block_n=16, block_k=32, split_k=3)),
    (1, 100, 96, GemvConfig(block_n=16, block_k=32, split_k=1, mode="fma", block_m=1)),
    (3, 64, 128, GemvConfig(block_n=32, block_k=32, split_k=4, mode="fma", block_m=2)),
    (5, 48, 100, GemvConfig(block_n=16, block_k=32, split_k=2, mode="fma", block_m=4)),
    (3, 100, 96, GemvConfig(block_n=64, block_k=32, split_k=2, mode="dot_t")),
    (17, 48, 100, GemvConfig(block_n=16, block_k=32, split_k=1, mode="dot_t")),
]


def _case_id(case):
    m, n, k, cfg = case
    return f"m{m}-n{n}-k{k}-{cfg.mode}{cfg.block_m}-s{cfg.split_k}"


def _small_ints(*shape, gen):
    # Entries in {-1, 0, 1}: every sum over K <= 128 is an integer below 256, exact
    # in bf16, so even the interpreter's truncating bf16 cast gives exact results.
    return torch.randint(-1, 2, shape, generator=gen).to(torch.bfloat16)


@needs_interpreter
@pytest.mark.parametrize("case", INTERP_CASES, ids=_case_id)
def test_interpreted_linear_is_exact_on_exact_inputs(case):
    m, n, k, cfg = case
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = _small_ints(m, k, gen=gen), _small_ints(n, k, gen=gen)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert linear(x, w, out=out, config=cfg) is out
    assert torch.equal(out, linear_reference(x, w))


@needs_interpreter
@pytest.mark.parametrize("case", INTERP_CASES, ids=_case_id)
def test_interpreted_linear_silu_mul(case):
    m, n, k, cfg = case
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = _small_ints(m, k, gen=gen), _small_ints(2 * n, k, gen=gen)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    linear_silu_mul(x, w, out=out, config=cfg)
    ref = linear_silu_mul_reference(x, w)
    gu = linear_reference(x, w)     # exact integers here
    tol = interpreter_silu_mul_tol(gu[:, :n], gu[:, n:], ref)
    assert not out.isnan().any()
    assert ((out.double() - ref.double()).abs() <= tol).all()
    # The gate and up halves are not swapped or mixed: swapping them changes the result.
    swapped = linear_silu_mul_reference(x, torch.cat([w[n:], w[:n]]))
    assert ((out.double() - swapped.double()).abs() > tol).any()


@needs_interpreter
@pytest.mark.parametrize("case", INTERP_CASES[1:3] + INTERP_CASES[4:], ids=_case_id)
def test_interpreted_rows_do_not_depend_on_the_batch(case):
    m, n, k, cfg = case
    gen = torch.Generator().manual_seed(7)
    x, w = randn_bf16(max(m, 2), k, gen=gen), randn_bf16(n, k, gen=gen, scale=0.1)
    full = linear(x, w, config=cfg)
    for r in range(x.shape[0]):
        assert torch.equal(full[r], linear(x[r:r + 1].contiguous(), w, config=cfg)[0])
    assert torch.equal(full, linear(x, w, config=cfg))
    # Random inputs: within one ulp (truncation) of the reference.
    ref = linear_reference(x, w)
    assert ((full.double() - ref.double()).abs() <= bf16_ulp(ref)).all()


@pytest.mark.skipif(not (INTERPRETED or HAS_GPU), reason="runs a kernel: needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("case", INTERP_CASES, ids=_case_id)
def test_partials_summed_in_order_are_linear(case):
    """linear_partials: one fp32 sum per K chunk; added in chunk order and rounded once they
    are exactly what `linear` returns with the same config (its reduce kernel's order)."""
    m, n, k, cfg = case
    device = "cuda" if HAS_GPU else "cpu"
    gen = torch.Generator().manual_seed(m + 3 * n + k)
    x, w = randn_bf16(m, k, gen=gen).to(device), randn_bf16(n, k, gen=gen, scale=0.1).to(device)
    parts = gemv.linear_partials(x, w, config=cfg)
    k_blocks = triton.cdiv(k, cfg.block_k)
    splits = triton.cdiv(k_blocks, triton.cdiv(k_blocks, cfg.split_k))
    assert parts.dtype == torch.float32 and tuple(parts.shape) == (splits, m, n)
    acc = parts[0].clone()
    for s in range(1, splits):
        acc += parts[s]
    expected, got = acc.to(torch.bfloat16), linear(x, w, config=cfg)
    if HAS_GPU:
        assert torch.equal(got, expected)
    else:   # the interpreter's bf16 cast truncates where torch's rounds to nearest
        assert ((got.double() - expected.double()).abs() <= bf16_ulp(expected)).all()
        assert ((got.double() - acc.double()).abs() < bf16_ulp(expected)).all()


# ----------------------------------------------------------------------------- the epilogue, in isolation

@pytest.mark.skipif(not (INTERPRETED or HAS_GPU), reason="runs a kernel: needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu_mul"])
def test_splitk_reduce_is_the_reference_epilogue(silu):
    """Hand-made fp32 partials through the reduce kernel, against torch on the same sums.

    Isolates the epilogue from the matmul: on a GPU it must equal PyTorch's
    bf16(bf16(silu(bf16(g))) * bf16(u)) bit for bit, which holds only with
    libdevice expf and a correctly rounded division (Triton's tl.exp and `/` are
    approximations that move about one element in 10^4 by an ulp).
    """
    device = "cuda" if HAS_GPU else "cpu"
    splits, rows, n = 3, (16 if HAS_GPU else 3), (65536 if HAS_GPU else 1500)
    cols = 2 * n if silu else n
    gen = torch.Generator().manual_seed(9)
    ws = (torch.randn(splits, rows, cols, generator=gen) * 5).to(device)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)
    gemv._splitk_reduce_kernel[(triton.cdiv(n, gemv._REDUCE_BLOCK), rows)](
        ws, out, rows, n, rows * cols, cols,
        SPLIT_K=splits, BLOCK=gemv._REDUCE_BLOCK, SILU=silu, INTERPRETED=INTERPRETED)
    total = ws[0] + ws[1] + ws[2]          # fp32, in split order
    if silu:
        expected = torch.nn.functional.silu(total[:, :n].to(torch.bfloat16)) * total[:, n:].to(torch.bfloat16)
    else:
        expected = total.to(torch.bfloat16)
    assert not out.isnan().any()
    if HAS_GPU:
        mismatched = (out != expected).sum().item()
        assert mismatched == 0, f"{mismatched} of {out.numel()} elements differ from PyTorch's bits"
    else:
        # The interpreter truncates bf16 casts: one ulp for a plain sum.
        tol = bf16_ulp(expected)
        if silu:
            tol = interpreter_silu_mul_tol(total[:, :n], total[:, n:], expected)
        assert ((out.double() - expected.double()).abs() <= tol).all()


# ----------------------------------------------------------------------------- the kernels on a GPU

def _gpu_inputs(m: int, n: int, k: int, seed: int):
    # Drawn on the device: the lm_head weight alone has 389M elements.
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device="cuda").mul_(k ** -0.5).to(torch.bfloat16)
    return x, w


GPU_LINEAR_SHAPES = [SHAPES_4B[s] for s in ("qkv", "o", "down", "lm_head")] + [(100, 96), (4096, 1000)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k", GPU_LINEAR_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("cfg", [None] + FMA_CONFIGS, ids=["table", "fma1", "fma4-split2", "dot_t-split2"])
def test_gpu_linear_matches_torch(n, k, m, cfg):
    x, w = _gpu_inputs(m, n, k, seed=n + k + m)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    linear(x, w, out=out, config=cfg)
    exact = x.double() @ w.double().t()
    bound = linear_error_bound(exact, fp32_sum_error_bound(x, w))
    _check_close(out, torch.nn.functional.linear(x, w), exact, bound)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("i,k", [(SHAPES_4B["gate_up"][0] // 2, SHAPES_4B["gate_up"][1]), (100, 96), (4096, 1000)])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("cfg", [None] + FMA_CONFIGS, ids=["table", "fma1", "fma4-split2", "dot_t-split2"])
def test_gpu_linear_silu_mul_matches_torch(i, k, m, cfg):
    x, w = _gpu_inputs(m, 2 * i, k, seed=i + k + m)
    out = torch.full((m, i), float("nan"), dtype=torch.bfloat16, device="cuda")
    linear_silu_mul(x, w, out=out, config=cfg)
    gu = torch.nn.functional.linear(x, w)
    torch_out = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    exact_gu = x.double() @ w.double().t()
    acc = fp32_sum_error_bound(x, w)
    g, u = exact_gu[:, :i], exact_gu[:, i:]
    exact = g / (1 + torch.exp(-g)) * u
    _check_close(out, torch_out, exact, silu_mul_error_bound(g, u, acc[:, :i], acc[:, i:]))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", sorted(SHAPES_4B))
@pytest.mark.parametrize("cfg", [1, 16] + FMA_CONFIGS, ids=["table-1row", "table-16rows", "fma1", "fma4-split2", "dot_t-split2"])
def test_gpu_deterministic_and_rows_independent_of_batch(name, cfg):
    """For one config (the table's for a row-count range, or an explicit one), a row's
    bits do not depend on the batch it is computed in."""
    n, k = SHAPES_4B[name]
    fn = linear_silu_mul if name == "gate_up" else linear
    if isinstance(cfg, int):
        cfg = select_config(n, k, name == "gate_up", cfg)
    x, w = _gpu_inputs(16, n, k, seed=3)
    full = fn(x, w, config=cfg)
    assert torch.equal(full, fn(x, w, config=cfg)), "two calls differ"
    for r in range(16):
        single = fn(x[r:r + 1].contiguous(), w, config=cfg)
        assert torch.equal(single[0], full[r]), f"row {r} differs between batch 16 and batch 1"
    for m in (2, 7):   # other row counts pad the tile differently
        assert torch.equal(fn(x[:m].contiguous(), w, config=cfg), full[:m])


def _one_row_fma_products():
    """(family-product name, (n, k), silu) of every product whose one-row table config is fma."""
    out = []
    for family, shapes in (("qwen3", SHAPES_4B), ("qwen3.5", SHAPES_Q35)):
        for name, (n, k) in sorted(shapes.items()):
            silu = name == "gate_up"
            if select_config(n, k, silu, 1).mode == "fma":
                out.append((f"{family}-{name}", (n, k), silu))
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 3, 4, 5])
@pytest.mark.parametrize("name,shape,silu", _one_row_fma_products(), ids=[p[0] for p in _one_row_fma_products()])
def test_gpu_shared_rows_give_each_row_its_one_row_bits(name, shape, silu, rows):
    """A speculative verify at batch 1 runs its k + 1 rows as the one-row step, its fma row tile
    widened (gemv.shared_rows): every row, the one-row launch's bits."""
    n, k = shape
    fn = linear_silu_mul if silu else linear
    one = select_config(n, k, silu, 1)
    wide = gemv.shared_rows(one, rows, silu, n=n)
    x, w = _gpu_inputs(rows, n, k, seed=rows)
    got = fn(x, w, config=wide)
    for r in range(rows):
        assert torch.equal(got[r], fn(x[r:r + 1].contiguous(), w, config=one)[0]), (r, wide)


def _one_row_tensor_core_products():
    """(family-product name, (n, k), silu) of every product that one_row_tensor_cores moves."""
    return [(f"{family}-{name}", (n, k), name == "gate_up")
            for family, shapes in (("qwen3", SHAPES_4B), ("qwen3.5", SHAPES_Q35)) for name, (n, k) in sorted(shapes.items())
            if select_config(n, k, name == "gate_up", 1, one_row_tensor_cores=True).mode != "fma"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 4, 5, 9, 16])
@pytest.mark.parametrize("name,shape,silu", _one_row_tensor_core_products(),
                         ids=[p[0] for p in _one_row_tensor_core_products()])
def test_gpu_one_row_tensor_core_tile_gives_each_verify_row_its_one_row_bits(name, shape, silu, rows):
    """One sequence on the tensor cores (Qwen3's products): a verify's k + 1 rows run the one-row
    step's own config (shared_rows leaves it: 16 rows a tile); every row, the one-row launch's bits."""
    n, k = shape
    fn = linear_silu_mul if silu else linear
    one = select_config(n, k, silu, 1, one_row_tensor_cores=True)
    wide = gemv.shared_rows(one, rows, silu, n=n)
    x, w = _gpu_inputs(rows, n, k, seed=100 + rows)
    got = fn(x, w, config=wide)
    for r in range(rows):
        assert torch.equal(got[r], fn(x[r:r + 1].contiguous(), w, config=one)[0]), (r, wide)


def _planned_products():
    """(family-product name, (n, k), silu) of every decode product of both families."""
    return [(f"{family}-{name}", shape, name == "gate_up")
            for family, shapes in (("qwen3", SHAPES_4B), ("qwen3.5", SHAPES_Q35)) for name, shape in sorted(shapes.items())]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("planned,rows", [(2, 10), (4, 16), (4, 20), (16, 64), (16, 80)])
@pytest.mark.parametrize("name,shape,silu", _planned_products(), ids=[p[0] for p in _planned_products()])
def test_gpu_shared_tensor_core_rows_give_each_row_the_planned_steps_bits(name, shape, silu, planned, rows):
    """A verify at batch B runs its B (k + 1) rows as the B-row step, its tensor-core row tile
    widened (gemv.shared_rows): every row, the bits of the B-row launch that holds it."""
    n, k = shape
    fn = linear_silu_mul if silu else linear
    step = select_config(n, k, silu, planned)
    wide = gemv.shared_rows(step, rows, silu, n=n)
    x, w = _gpu_inputs(rows, n, k, seed=rows)
    got = fn(x, w, config=wide)
    for r0 in range(0, rows, planned):
        assert torch.equal(got[r0:r0 + planned], fn(x[r0:r0 + planned].contiguous(), w, config=step)), (r0, wide)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["qkv", "o", "down", "lm_head"])
@pytest.mark.parametrize("rows", [7, 16, 32, 64])
def test_gpu_in_order_products_give_the_full_forwards_bits(name, rows):
    """A product that walks K in order into one fp32 accumulator per output (tensor-core
    tiles, no split-K; either operand on the MMA's row side) gives, row for row, the bits of
    cuBLAS's product over many rows (the reference's full forward) on an H200; a split-K
    config does not (results/bench_gemv_inorder.json)."""
    n, k = SHAPES_4B[name]
    big = 512 if name == "lm_head" else 2048
    x, w = _gpu_inputs(big, n, k, seed=rows)
    x = x * 2
    full = torch.nn.functional.linear(x, w)
    for cfg in (GemvConfig(block_n=64, block_k=128, split_k=1, num_stages=4, mode="dot_t"),
                GemvConfig(block_n=32, block_k=256, split_k=1, num_stages=4, mode="dot")):
        assert torch.equal(linear(x[:rows].contiguous(), w, config=cfg), full[:rows]), cfg
    if name == "down":
        split = GemvConfig(block_n=64, block_k=128, split_k=4, num_stages=4, mode="dot_t")
        assert not torch.equal(linear(x[:rows].contiguous(), w, config=split), full[:rows])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["o", "down", "gate_up"])
def test_gpu_cuda_graph_capture_and_replay(name):
    n, k = SHAPES_4B[name]
    fn = linear_silu_mul if name == "gate_up" else linear
    x, w = _gpu_inputs(4, n, k, seed=5)
    out = torch.empty((4, n // 2 if name == "gate_up" else n), dtype=torch.bfloat16, device="cuda")
    fn(x, w, out=out)            # compile and create the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x, w, out=out)
    for seed in (11, 12):
        x.copy_(_gpu_inputs(4, 1, k, seed=seed)[0])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn(x, w))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("name,silu", [("o", False), ("gate_up", True)])
def test_swapped_dot_compiles_for_sm90(name, silu):
    """The swapped-operand tile (weight rows on the MMA's row side) compiles to tensor-core code."""
    n, k = SHAPES_4B[name]
    cols = n // 2 if silu else n
    cfg = GemvConfig(block_n=64, block_k=128, split_k=2, mode="dot_t")
    constants = dict(K=k, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, BLOCKS_PER_SPLIT=k // 256,
                     EVEN_N=cols % 64 == 0, EVEN_K=True, PARTIALS=True, SILU=silu, INTERPRETED=False, SWAP=True,
                     PDL=False, PREFETCH_LINES=2)
    ptx = _aot_compile(gemv._gemv_dot_kernel, MAIN_SIG, constants, MAIN_ALIGNED, cfg.num_warps,
                       cfg.num_stages).asm["ptx"]
    assert "mma" in ptx
