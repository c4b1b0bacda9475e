"""Matrix-vector products for decode (a few rows against a whole weight matrix).

    linear(x, w)                    out[m, n] = bf16( sum_k x[m, k] * w[n, k] )
    linear_silu_mul(x, w_gate_up)   g = bf16(x @ Wg.T), u = bf16(x @ Wu.T)
                                    out = bf16( bf16(silu(g)) * u ),  silu(g) = g / (1 + exp(-g)) in fp32

Shapes and dtypes: x [M, K] bf16 contiguous (M = decode batch, any M >= 1, tiled);
w [N, K] bf16 contiguous (nn.Linear layout); w_gate_up [2I, K] with rows [0, I) the
gate projection and rows [I, 2I) the up projection; out [M, N] (or [M, I]) bf16.

Numerics. Every product of two bf16 values is exact in fp32, so the only freedom is
the order of the fp32 sums; the result is rounded to bf16 once. `linear_silu_mul`
keeps the reference's cast points (`act_fn(gate_proj(x)) * up_proj(x)` in BF16): g
and u are each rounded to bf16, SiLU is evaluated in fp32 on the bf16 g and rounded
to bf16, and the bf16 x bf16 product is rounded once more. On the GPU the SiLU uses
libdevice `expf` and a correctly rounded division, as PyTorch's CUDA SiLU does:
Triton's plain `tl.exp` / `/` are approximations (ex2.approx, div.full) that would
move a few bf16 results by one ulp.

Determinism. No floating-point atomics. For a given (N, K, config) each output
element is summed in one fixed order that M does not enter:
  - K is cut into SPLIT_K contiguous chunks of whole BLOCK_K blocks; inside a chunk
    the blocks are accumulated in increasing k;
  - inside a block the order is that of the compiled instruction sequence, which is
    the same for every M: a tile always holds BLOCK_M rows (rows past M are clamped
    copies of row M-1, never stored), and M is excluded from Triton's value
    specialisation (`do_not_specialize`), so every M runs the same binary; each
    output element depends only on its own row of x (an MMA or a per-row sum never
    mixes rows), so the other rows of the tile cannot change it;
  - with SPLIT_K > 1 the chunks' fp32 partials go to a cached workspace
    [SPLIT_K, rows, cols] and a small kernel adds them in the order 0, 1, ..., S-1.
So for a given config a row gives the same bits in a batch of 1 or of 16, and on
every call. The three kernel modes ("dot": tl.dot over 16-row tiles; "dot_t": the
same with the operands swapped, the weight tile on the MMA's row side; "fma": an
elementwise multiply-add loop over 1-4 rows) sum in different orders. The table
holds one config per (N, K) and row-count range (one row; 2-4; more), so a row's
bits are independent of the batch within a range, not across ranges (a model may run its one
row in the 2-4-row range's tile: select_config's one_row_tensor_cores). The config
is a function of the shapes alone, never of the device, so an H100 and an H200 run
the same code (given the same Triton version).

Dependent launch. Where Triton can launch with PDL (fqkernels/pdl.py), each program
prefetches its first weight block into L2, waits for the previous kernel, and lets the next
one be scheduled after its main loop; the arithmetic is unchanged.

Building blocks. A fused kernel that needs a product with its own epilogue (gdn_step's in_proj
with the conv and gates) builds on dot_setup / dot_sums and fma_setup / fma_sums and launches
by launch_plan: the same sums in the same order, so its products have `linear`'s bits.

Workspace. Allocated on first use per (device, splits, columns, row capacity) and
then kept for the life of the process, so calls made during CUDA-graph capture
after a warm-up call allocate nothing and a captured graph never points at freed
memory. It is shared by every call with the same key: calls on different CUDA
streams that run concurrently must not share a key.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from fqkernels import pdl
from fqkernels.swiglu import silu_f32

__all__ = [
    "GemvConfig",
    "select_config",
    "shared_rows",
    "linear",
    "linear_silu_mul",
    "linear_partials",
    "launch_plan",
    "dot_sums",
    "fma_sums",
    "linear_reference",
    "linear_silu_mul_reference",
    "in_order",
]

# ----------------------------------------------------------------------------- configs

_MODES = ("dot", "dot_t", "fma")
_DOT_BLOCK_M = (16, 32, 64)   # tl.dot needs at least 16 rows per tile
_FMA_BLOCK_M = (1, 2, 4)      # the fma kernel unrolls its rows by hand (see _gemv_fma_kernel)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tiling of one matrix-vector kernel.

    block_n: output columns per program (for linear_silu_mul: gate columns, each
        paired with the up column I later). block_k: reduction step. split_k: K
        chunks reduced by a second kernel. mode: "dot" (tl.dot, rows padded to
        block_m >= 16), "dot_t" (the same with the operands swapped: the weight tile
        is the MMA's row operand, w_tile @ x_tile.T, so block_n output columns fill
        the tensor core's 64-row side and the rows of x its narrow side) or "fma"
        (load-multiply-reduce, block_m in 1, 2, 4).
    """

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    mode: str = "dot"
    block_m: int = 16

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value!r}")
        for name in ("split_k", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GemvConfig.{name} must be a positive int, got {value!r}")
        if self.mode not in _MODES:
            raise ValueError(f"GemvConfig.mode must be one of {_MODES}, got {self.mode!r}")
        if self.block_k < 16:
            raise ValueError(f"GemvConfig.block_k must be >= 16, got {self.block_k}")
        if self.mode in ("dot", "dot_t"):
            if self.block_m not in _DOT_BLOCK_M:
                raise ValueError(
                    f"GemvConfig.block_m must be one of {_DOT_BLOCK_M} in mode {self.mode!r}, got {self.block_m!r}")
            if self.block_n < 16:
                raise ValueError(f"GemvConfig.block_n must be >= 16 in mode {self.mode!r}, got {self.block_n}")
        elif self.block_m not in _FMA_BLOCK_M:
            raise ValueError(f"GemvConfig.block_m must be one of {_FMA_BLOCK_M} in mode 'fma', got {self.block_m!r}")
        if self.num_warps > 16:
            raise ValueError(f"GemvConfig.num_warps must be <= 16, got {self.num_warps}")


# Tuned per weight shape (N, K) for the Qwen3-4B matrices and per row count, from
# the GEMV sweep on an H200 (`python -m bench gemv`; results/bench_gemv_qwen3.json:
# each op captured 20 times in a CUDA graph over weight copies that do not fit in
# L2). One row: the fma kernel with 8 columns a program and no tl.dot; 2-4 rows
# and 5+ rows: tl.dot tiles. Within one row-count range a row's bits do not depend
# on the batch (module docstring); across ranges the summation order differs.
_FMA1 = dict(mode="fma", block_m=1, block_n=8)
LINEAR_CONFIGS: dict[tuple[int, int], object] = {
    # 2-16 rows: swapped-operand tiles (dot_t), results/bench_gemv_qwen3_b4_b16.json
    # (us at 4 / 16 rows, ours vs cuBLAS).
    (6144, 2560): (                                                     # qkv_proj (q, k, v packed)
        (1, GemvConfig(block_k=256, split_k=1, **_FMA1)),              # 9.4 us (cuBLAS 10.5)
        (4, GemvConfig(block_n=64, block_k=256, split_k=1, num_stages=4, mode="dot_t")),   # 11.2 (11.1)
        (None, GemvConfig(block_n=64, block_k=256, split_k=1, num_stages=4, mode="dot_t")),  # 10.1 (10.9)
    ),
    (2560, 4096): (                                                     # o_proj
        (1, GemvConfig(block_k=1024, split_k=1, **_FMA1)),             # 7.8 us (cuBLAS 9.8)
        (4, GemvConfig(block_n=64, block_k=256, split_k=2, num_stages=4, mode="dot_t")),   # 9.4 (9.9)
        (None, GemvConfig(block_n=64, block_k=256, split_k=2, num_stages=4, mode="dot_t")),  # 9.4 (9.8)
    ),
    (2560, 9728): (                                                     # down_proj
        (1, GemvConfig(block_n=4, block_k=512, split_k=1, mode="fma", block_m=1)),  # 14.6 us (cuBLAS 16.8)
        (4, GemvConfig(block_n=128, block_k=128, split_k=4, num_stages=4, mode="dot_t")),  # 16.6 (16.9)
        (None, GemvConfig(block_n=64, block_k=128, split_k=4, num_stages=4, mode="dot_t")),  # 16.8 (17.8)
    ),
    (151936, 2560): (                                                   # lm_head (tied embedding)
        (1, GemvConfig(block_k=256, split_k=1, **_FMA1)),              # 171.5 us (cuBLAS 186.4)
        (4, GemvConfig(block_n=128, block_k=256, split_k=1)),
        (None, GemvConfig(block_n=128, block_k=128, split_k=1)),
    ),
    # Qwen3.5-4B's decode products (its o_proj / out_proj are the (2560, 4096) above): 1 and
    # 2-4 rows from results/bench_gemv_qwen35.json (us: this config, then in parentheses the
    # Qwen3-4B config of the same K and cuBLAS); 5+ rows take Qwen3-4B's configs for the same K.
    # in_proj keeps split_k 1 (its conv + gates epilogue needs it).
    (12352, 2560): (                                                    # GDN in_proj (qkv | z | b | a)
        # one row: the config of the product with the epilogue (gdn_step.in_proj_conv_gates_step); 16
        # columns a program timed faster alone but not in the step (docs/PERFORMANCE.md)
        (1, GemvConfig(block_k=256, split_k=1, **_FMA1)),
        (None, GemvConfig(block_n=64, block_k=256, split_k=1, num_stages=4, mode="dot_t")),  # 19.3 at 4 (19.7)
    ),
    (10240, 2560): (                                                    # attention q | k | v, packed
        (1, GemvConfig(block_n=16, block_k=256, split_k=1, mode="fma", block_m=1)),     # 13.6 us (15.2; 15.6)
        (4, GemvConfig(block_n=128, block_k=128, split_k=1, num_stages=4, mode="dot_t")),  # 15.7 (16.9; 15.7)
        (None, GemvConfig(block_n=64, block_k=256, split_k=1, num_stages=4, mode="dot_t")),
    ),
    (2560, 9216): (                                                     # down_proj
        (1, GemvConfig(block_n=8, block_k=1024, split_k=1, mode="fma", block_m=1)),     # 13.0 us (13.2; 15.9)
        (4, GemvConfig(block_n=128, block_k=128, split_k=4, num_stages=4, mode="dot_t")),  # 14.4 (14.8; 16.4)
        (None, GemvConfig(block_n=64, block_k=128, split_k=4, num_stages=4, mode="dot_t")),
    ),
    (248320, 2560): (                                                   # lm_head (tied)
        (1, GemvConfig(block_k=256, split_k=1, **_FMA1)),
        (4, GemvConfig(block_n=128, block_k=256, split_k=1)),
        (None, GemvConfig(block_n=128, block_k=128, split_k=1)),
    ),
}
# Keyed by the packed gate/up weight's shape (2I, K); block_n counts gate columns.
SILU_MUL_CONFIGS: dict[tuple[int, int], object] = {
    (19456, 2560): (                                                    # gate_proj + up_proj, SiLU * up
        (1, GemvConfig(block_k=256, split_k=1, **_FMA1)),              # 26.2 us (cuBLAS + SiLU*up 32.8)
        (4, GemvConfig(block_n=128, block_k=128, split_k=1)),
        (None, GemvConfig(block_n=32, block_k=128, split_k=1)),
    ),
    (18432, 2560): (                                                    # Qwen3.5-4B's (as above)
        (1, GemvConfig(block_n=4, block_k=256, split_k=1, mode="fma", block_m=1)),      # 24.8 us (25.8; 30.2)
        (4, GemvConfig(block_n=128, block_k=128, split_k=1)),
        (None, GemvConfig(block_n=32, block_k=128, split_k=1)),
    ),
}

# Exact decode (the engine's exact_decode, on by default; here select_config(..., exact=) and
# exact_rows(rows, exact)): from EXACT_FROM_ROWS rows, o and down walk K in order into one
# accumulator (no split-K), as every other decode product already does above one row. Each such
# product gives the bits of the full forward's large-M cuBLAS product on an H200
# (results/bench_gemv_inorder.json); with the attention in flash's arithmetic (decode_attention's
# fa2=True) a decode step is the full forward's, bit for bit, from 7 rows (where flash runs one
# split; docs/NUMERICS.md). The price is the in-order chain of tensor-core steps over K: a little
# more per product than the split table at 16 rows, less at 64 (docs/PERFORMANCE.md). Up to
# EXACT_TO_ROWS only: exactness also forces the GEMV for qkv, gate_up and lm_head (in order
# already, but where cuBLAS is faster the engine picks cuBLAS), which at 64 rows costs step time
# until those get 64-row configs.
EXACT_FROM_ROWS = 7
EXACT_TO_ROWS = 32
# Where exact_rows(rows, exact); us from the in-order sweep (results/bench_gemv_inorder.json). The
# open-ended entries (measured at 64 rows) are past EXACT_TO_ROWS; they stay for when 64-row
# configs let the cap rise.
EXACT_CONFIGS: dict[tuple[int, int], tuple] = {
    (2560, 4096): (                                                     # o_proj
        (32, GemvConfig(block_n=64, block_k=128, split_k=1, num_stages=8, mode="dot_t")),   # 8.2 us at 16 rows
        (None, GemvConfig(block_n=32, block_k=128, split_k=1, num_stages=6, mode="dot", block_m=64)),  # 10.2 at 64
    ),
    (2560, 9728): (                                                     # down_proj
        (16, GemvConfig(block_n=32, block_k=512, split_k=1, num_stages=4, mode="dot")),    # 15.8 at 16
        (32, GemvConfig(block_n=64, block_k=128, split_k=1, num_stages=6, mode="dot_t")),  # 18.2 at 32
        (None, GemvConfig(block_n=32, block_k=128, split_k=1, num_stages=6, mode="dot", block_m=64)),  # 21.4 at 64
    ),
    (2560, 9216): (                                                     # Qwen3.5-4B's down_proj: the same configs
        (16, GemvConfig(block_n=32, block_k=512, split_k=1, num_stages=4, mode="dot")),
        (32, GemvConfig(block_n=64, block_k=128, split_k=1, num_stages=6, mode="dot_t")),
        (None, GemvConfig(block_n=32, block_k=128, split_k=1, num_stages=6, mode="dot", block_m=64)),
    ),
}


def exact_rows(rows: int, exact: bool = True) -> bool:
    """Whether a decode product of `rows` rows runs in the full forward's order: exact decode on
    (`exact`, the engine's exact_decode) and rows in [EXACT_FROM_ROWS, EXACT_TO_ROWS]."""
    return exact and EXACT_FROM_ROWS <= rows <= EXACT_TO_ROWS


def in_order(config: GemvConfig) -> bool:
    """Whether the config sums each output as the full forward's product does: tensor-core
    tiles, K walked in increasing order into one accumulator (no split-K)."""
    return config.split_k == 1 and config.mode in ("dot", "dot_t")


# The default aims for about two waves of programs on a 132-SM GPU; it is a fixed
# function of the shape (never of the device) so every machine computes the same bits.
_TARGET_PROGRAMS = 264
_MAX_DEFAULT_SPLIT = 8
_MIN_BLOCKS_PER_SPLIT = 4


@functools.lru_cache(maxsize=None)
def select_config(n: int, k: int, silu_mul: bool = False, rows: int = 1, exact: bool = True,
                  one_row_tensor_cores: bool = False) -> GemvConfig:
    """The config for a weight of shape [n, k] (for silu_mul: the packed [2I, k]) and
    `rows` rows of x.

    A table entry is one config, or a tuple of (max_rows, config) pairs in
    increasing max_rows (None = no limit): the first pair whose max_rows >= rows.
    With `one_row_tensor_cores`, one row takes the 2-4-row range's tensor-core config where the
    table's one-row config is fma (vocabulary-wide products excepted: their one-row pick is the
    LM-head screen's): a speculative verify's k + 1 rows then fit the one-row step's 16-row tile,
    so they cost about one step and keep its bits (one_row_on_tensor_cores).
    Without an entry, a default that ignores rows: the largest block_k in 256..16
    that divides k (so the inner loop needs no mask; 64 with a masked tail when
    none does), 64 output columns per program (less for narrow outputs), and
    split-K doubled (keeping equal whole-block chunks) while there are fewer
    programs than two waves.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if n < 1 or k < 1:
        raise ValueError(f"weight shape must be positive, got ({n}, {k})")
    if silu_mul and n % 2:
        raise ValueError(f"a packed gate/up weight needs an even row count, got {n}")
    table = SILU_MUL_CONFIGS if silu_mul else LINEAR_CONFIGS
    entry = table.get((n, k))
    if exact_rows(rows, exact) and not silu_mul and (n, k) in EXACT_CONFIGS:
        entry = EXACT_CONFIGS[(n, k)]
    if isinstance(entry, GemvConfig):
        return entry
    if rows == 1 and one_row_tensor_cores and entry is not None:
        entry = one_row_on_tensor_cores(entry, n)
    if entry is not None:
        for max_rows, cfg in entry:
            if max_rows is None or rows <= max_rows:
                return cfg
    cols = n // 2 if silu_mul else n
    block_k = next((b for b in (256, 128, 64, 32, 16) if k % b == 0), 64)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(64, max(16, triton.next_power_of_2(cols)))
    programs = triton.cdiv(cols, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    while (programs * split * 2 <= _TARGET_PROGRAMS and split * 2 <= _MAX_DEFAULT_SPLIT
           and k_blocks % (split * 2) == 0 and k_blocks // (split * 2) >= _MIN_BLOCKS_PER_SPLIT):
        split *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split)


def one_row_on_tensor_cores(entry: tuple, n: int) -> tuple:
    """A table entry with its one-row fma config replaced by the next range's tensor-core config,
    where it has both and n < VOCAB_COLUMNS; otherwise the entry as it is."""
    if (n < VOCAB_COLUMNS and len(entry) > 1 and entry[0][0] == 1 and entry[0][1].mode == "fma"
            and entry[1][1].mode != "fma"):
        return ((1, entry[1][1]),) + tuple(entry[1:])
    return entry


# fp32 registers a thread may give the fma kernel's accumulators and its weight block(s) when
# shared_rows widens a row tile (a thread has 255; the rest holds addresses and x).
FMA_SHARED_REGS = 192
# The columns a program of a shared fma tile: fewer accumulators a thread, so more programs an SM
# keep loads in flight. Not below 4: at 2 columns and block_k 256 Triton lays the tile out
# differently and a column's sums change order (docs/PERFORMANCE.md, Speculation: the shared FMA tile).
FMA_SHARED_COLUMNS = 4
# A product at least this wide (a vocabulary) keeps its columns and widens its row tile instead:
# its weights, far larger than L2, are then read once, not once a 2-row tile.
VOCAB_COLUMNS = 65536


def shared_rows(config: GemvConfig, rows: int, silu_mul: bool = False, n: int = 0) -> GemvConfig:
    """`config` (the one-row or B-row step's, for a weight of n output rows) with its row tile
    widened toward `rows` rows, so the tile's rows share each weight load: a speculative verify's
    B (k + 1) rows, planned as the B-row step.
    fma (the one-row step's kernel): tiles of 2 rows at FMA_SHARED_COLUMNS columns a program; a
    vocabulary-wide product keeps its columns and takes block_m 2 or 4 where the accumulators fit
    FMA_SHARED_REGS. Every row's code in the fma kernel is the same at any block_m, and a column's
    sums keep their order at 4 or more columns, so each row keeps its bits.
    Tensor-core modes: block_m 32 or 64, the narrowest that holds every row, where the tiles of its
    stages fit DOT_SHARED_SMEM (fewer stages where that makes them fit: the pipeline's depth, not
    the sums' order); an MMA never mixes rows and K is walked in the same blocks, so each row keeps
    its bits. GPU tests check every product's widened configs against its one-row or B-row launch."""
    if config.mode != "fma":
        return _shared_dot_rows(config, rows, silu_mul)
    if rows < 2 or config.block_m != 1:
        return config
    if n < VOCAB_COLUMNS:
        narrow = dataclasses.replace(config, block_m=2, block_n=min(config.block_n, FMA_SHARED_COLUMNS))
        return narrow if _fma_registers(narrow, silu_mul) <= FMA_SHARED_REGS else config
    block_m = config.block_m
    for wider in _FMA_BLOCK_M:
        if block_m < wider and (wider // 2) < rows and _fma_registers(
                dataclasses.replace(config, block_m=wider), silu_mul) <= FMA_SHARED_REGS:
            block_m = wider
    return dataclasses.replace(config, block_m=block_m) if block_m != config.block_m else config


def _fma_registers(config: GemvConfig, silu_mul: bool) -> int:
    """fp32 registers a thread holds for an fma tile: a weight block (two with SiLU) and a row of
    accumulators per block row."""
    per_block = config.block_n * config.block_k // (32 * config.num_warps) * (2 if silu_mul else 1)
    return per_block * (config.block_m + 1)


# Shared memory a widened tensor-core tile's stages may take (its x and weight tiles in bf16); an
# H100 or H200 gives a program at most 227 KB, and the epilogue needs some.
DOT_SHARED_SMEM = 160 * 1024


def _shared_dot_rows(config: GemvConfig, rows: int, silu_mul: bool) -> GemvConfig:
    weight_rows = config.block_n * (2 if silu_mul else 1)
    block_m, stages = config.block_m, config.num_stages
    # Only to a width that holds every row: a remainder tile re-reads each weight block in a second,
    # mostly padded program of less work (docs/PERFORMANCE.md: 80 rows as 64 + 16 cost more than 5 x 16).
    wider = next((w for w in _DOT_BLOCK_M if w >= rows), None)
    if wider is not None and wider > block_m:
        fit = stages
        while fit > 2 and (wider + weight_rows) * config.block_k * 2 * fit > DOT_SHARED_SMEM:
            fit -= 1
        if (wider + weight_rows) * config.block_k * 2 * fit <= DOT_SHARED_SMEM:
            block_m, stages = wider, fit
    if block_m == config.block_m:
        return config
    return dataclasses.replace(config, block_m=block_m, num_stages=stages)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _silu_mul_bf16(g, u, INTERPRETED: tl.constexpr):
    """bf16( bf16(silu(bf16(g))) * bf16(u) ) from fp32 sums g and u."""
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    act = silu_f32(g, INTERPRETED).to(tl.bfloat16).to(tl.float32)
    return (act * u).to(tl.bfloat16)


@triton.jit
def _write_result(acc, acc_u, rows, cols, M, N, out_ptr, ws_ptr, pid_s, ws_split_stride, ws_cols,
                  PARTIALS: tl.constexpr, SILU: tl.constexpr, INTERPRETED: tl.constexpr):
    """This chunk's fp32 partial when PARTIALS (several K chunks, or the caller
    asked for the sums), else the final bf16 result.

    rows/cols broadcast against acc (a [BM, BN] tile, or one row's [BN] vector).
    Partials of the up half go ws_cols // 2 = N columns to the right of the gate half.
    """
    mask = (rows < M) & (cols < N)
    if not PARTIALS:
        if SILU:
            val = _silu_mul_bf16(acc, acc_u, INTERPRETED)
        else:
            val = acc.to(tl.bfloat16)
        tl.store(out_ptr + rows * N + cols, val, mask=mask)
    else:
        ptrs = ws_ptr + pid_s.to(tl.int64) * ws_split_stride + rows * ws_cols + cols
        tl.store(ptrs, acc, mask=mask)
        if SILU:
            tl.store(ptrs + N, acc_u, mask=mask)


@triton.jit
def _program_coords(M, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    # One flat grid, row tiles fastest: the programs that read the same weight
    # slice for different row tiles run side by side, so the re-reads hit L2.
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    rest = pid // m_tiles
    return pid_m, rest % SPLIT_K, rest // SPLIT_K


@triton.jit
def _prefetch_first_block(w_ptr, cols, k_lo, up_offset, K: tl.constexpr, SILU: tl.constexpr,
                          PDL: tl.constexpr, LINES: tl.constexpr):
    """L2 prefetch of the first LINES 128-byte lines of each of this program's weight rows from
    its K chunk's start (its first block), before the wait for the previous kernel: weights are
    constant, so this may overlap that kernel."""
    if PDL:
        k = tl.minimum(k_lo + tl.arange(0, LINES) * 64, K - 1)
        lines = w_ptr + cols.to(tl.int64)[:, None] * K + k[None, :]
        pdl.prefetch_l2(lines, PDL)
        if SILU:
            pdl.prefetch_l2(lines + up_offset, PDL)


@triton.jit
def dot_setup(M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SPLIT_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, EVEN_N: tl.constexpr):
    """A tl.dot program's tile: (its K chunk pid_s, rows offs_m, columns offs_n, K offsets offs_k,
    the rows and columns it loads (clamped in bounds: the clamped ones are computed and thrown
    away at the store), its chunk's first k)."""
    pid_m, pid_s, pid_n = _program_coords(M, BLOCK_M, SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_ld = tl.minimum(offs_m, M - 1)
    cols_ld = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    k_lo = pid_s * (BLOCKS_PER_SPLIT * BLOCK_K)
    return pid_s, offs_m, offs_n, offs_k, rows_ld, cols_ld, k_lo


@triton.jit
def dot_sums(x_ptrs, w_ptrs, k_lo, offs_k, up_offset, K: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
             SILU: tl.constexpr, SWAP: tl.constexpr, INTERPRETED: tl.constexpr):
    """The fp32 sums of a tl.dot program's K chunk, block by block in increasing k: acc (and acc_u,
    the up rows', with SILU), [BLOCK_M, BLOCK_N], or transposed [BLOCK_N, BLOCK_M] with SWAP
    (the caller transposes them back)."""
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        if EVEN_K:
            xt = tl.load(x_ptrs)
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            k_ok = (k_lo + i * BLOCK_K + offs_k) < K
            xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if INTERPRETED:
            # Triton 3.6's interpreter multiplies bf16 dot operands as raw bits;
            # fp32 operands hold the same values and the products stay exact.
            xt = xt.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
        if SILU:
            if EVEN_K:
                wu = tl.load(w_ptrs + up_offset, eviction_policy="evict_first")
            else:
                wu = tl.load(w_ptrs + up_offset, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            if INTERPRETED:
                wu = wu.to(tl.float32)
            if SWAP:
                acc_u = tl.dot(wu, tl.trans(xt), acc_u)
            else:
                acc_u = tl.dot(xt, tl.trans(wu), acc_u)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_u


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, M, N, up_offset, ws_split_stride, ws_cols,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                     EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PARTIALS: tl.constexpr,
                     SILU: tl.constexpr, INTERPRETED: tl.constexpr, SWAP: tl.constexpr,
                     PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 1):
    """acc[BLOCK_M, BLOCK_N] += x_tile @ w_tile.T over this program's K chunk (tl.dot, fp32 acc).
    SWAP computes the transposed tile, acc_t[BLOCK_N, BLOCK_M] += w_tile @ x_tile.T.

    x [M, K], w [N, K] (for SILU: [2N, K], up rows up_offset = N*K elements on), out [M, N] bf16,
    ws [SPLIT_K, rows, ws_cols] fp32 partials.
    """
    pid_s, offs_m, offs_n, offs_k, rows_ld, cols_ld, k_lo = dot_setup(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                                                                      BLOCKS_PER_SPLIT, EVEN_N)
    x_ptrs = x_ptr + rows_ld[:, None] * K + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + cols_ld.to(tl.int64)[:, None] * K + (k_lo + offs_k)[None, :]
    _prefetch_first_block(w_ptr, cols_ld, k_lo, up_offset, K, SILU, PDL, PREFETCH_LINES)
    pdl.wait(PDL)  # x is the previous kernel's output
    acc, acc_u = dot_sums(x_ptrs, w_ptrs, k_lo, offs_k, up_offset, K, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKS_PER_SPLIT,
                          EVEN_K, SILU, SWAP, INTERPRETED)
    pdl.launch_dependents(PDL)
    if SWAP:
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)
    _write_result(acc, acc_u, offs_m[:, None], offs_n[None, :], M, N, out_ptr, ws_ptr, pid_s,
                  ws_split_stride, ws_cols, PARTIALS, SILU, INTERPRETED)


@triton.jit
def _row_fma(acc, w, x_row_ptr, k, offs_k, K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc[BN, BK] + w[BN, BK] * x_row[BK] elementwise (fp32; bf16 products are exact)."""
    if EVEN_K:
        x = tl.load(x_row_ptr + k + offs_k)
    else:
        x = tl.load(x_row_ptr + k + offs_k, mask=(k + offs_k) < K, other=0.0)
    return acc + w * x.to(tl.float32)[None, :]


@triton.jit
def _rows_fma(acc0, acc1, acc2, acc3, w, x0, x1, x2, x3, k, offs_k, K: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """_row_fma for each of the tile's BLOCK_M rows (accumulators past BLOCK_M come back untouched)."""
    acc0 = _row_fma(acc0, w, x0, k, offs_k, K, EVEN_K)
    if BLOCK_M > 1:
        acc1 = _row_fma(acc1, w, x1, k, offs_k, K, EVEN_K)
    if BLOCK_M > 2:
        acc2 = _row_fma(acc2, w, x2, k, offs_k, K, EVEN_K)
        acc3 = _row_fma(acc3, w, x3, k, offs_k, K, EVEN_K)
    return acc0, acc1, acc2, acc3


@triton.jit
def _load_w_block(ptrs, k, offs_k, K: tl.constexpr, EVEN_K: tl.constexpr):
    """One [BN, BK] weight block at k, as fp32, streamed (evict first); masked past K when K is uneven."""
    if EVEN_K:
        w = tl.load(ptrs + k, eviction_policy="evict_first")
    else:
        w = tl.load(ptrs + k, mask=((k + offs_k) < K)[None, :], other=0.0, eviction_policy="evict_first")
    return w.to(tl.float32)


@triton.jit
def fma_setup(M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SPLIT_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, EVEN_N: tl.constexpr):
    """An fma program's tile: (its K chunk pid_s, first row m0, columns offs_n, K offsets offs_k,
    the columns it loads (clamped), its chunk's first k, its weight rows' pointers)."""
    pid_m, pid_s, pid_n = _program_coords(M, BLOCK_M, SPLIT_K)
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols_ld = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    k_lo = pid_s * (BLOCKS_PER_SPLIT * BLOCK_K)
    return pid_s, m0, offs_n, offs_k, cols_ld, k_lo


@triton.jit
def fma_sums(x_ptr, w_ptrs, m0, M, k_lo, offs_k, up_offset, K: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
             SILU: tl.constexpr):
    """The fp32 lane sums of an fma program's K chunk (see _gemv_fma_kernel): per row of the tile
    acc0..acc3 (and the up rows' accu0..accu3 with SILU), each [BLOCK_N, BLOCK_K], rows past
    BLOCK_M left zero."""
    # Row pointers, clamped to the last real row (computed, never stored).
    x0 = x_ptr + tl.minimum(m0, M - 1) * K
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1) * K
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1) * K
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1) * K
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    accu0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    accu1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    accu2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    accu3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        k = k_lo + i * BLOCK_K
        w = _load_w_block(w_ptrs, k, offs_k, K, EVEN_K)
        if SILU:
            wu = _load_w_block(w_ptrs + up_offset, k, offs_k, K, EVEN_K)
        acc0, acc1, acc2, acc3 = _rows_fma(acc0, acc1, acc2, acc3, w, x0, x1, x2, x3, k, offs_k, K, EVEN_K,
                                           BLOCK_M)
        if SILU:
            accu0, accu1, accu2, accu3 = _rows_fma(accu0, accu1, accu2, accu3, wu, x0, x1, x2, x3, k, offs_k, K,
                                                   EVEN_K, BLOCK_M)
    return acc0, acc1, acc2, acc3, accu0, accu1, accu2, accu3


@triton.jit(do_not_specialize=["M"])
def _gemv_fma_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, M, N, up_offset, ws_split_stride, ws_cols,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                     EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PARTIALS: tl.constexpr,
                     SILU: tl.constexpr, INTERPRETED: tl.constexpr,
                     PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 1):
    """Same contract as _gemv_dot_kernel for BLOCK_M in (1, 2, 4) rows, without tl.dot.

    Each weight block is loaded once into registers and multiplied by every row of
    the tile. Each row keeps a [BLOCK_N, BLOCK_K] fp32 accumulator that only takes
    elementwise multiply-adds inside the loop (lane j sums k = j, j + BK, j + 2 BK,
    ... in increasing order); one tl.sum over the lanes per row at the end. The
    loop body is then pure loads and FMAs, with no cross-thread reduction per
    block. The rows are unrolled by hand (acc0..acc3) so that each row's code is
    the same whatever BLOCK_M is: a 3-D [BM, BN, BK] product would let the
    layout, and so the summation tree, depend on BLOCK_M.
    """
    pid_s, m0, offs_n, offs_k, cols_ld, k_lo = fma_setup(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                                                         BLOCKS_PER_SPLIT, EVEN_N)
    w_ptrs = w_ptr + cols_ld.to(tl.int64)[:, None] * K + offs_k[None, :]
    _prefetch_first_block(w_ptr, cols_ld, k_lo, up_offset, K, SILU, PDL, PREFETCH_LINES)
    pdl.wait(PDL)  # x is the previous kernel's output
    acc0, acc1, acc2, acc3, accu0, accu1, accu2, accu3 = fma_sums(
        x_ptr, w_ptrs, m0, M, k_lo, offs_k, up_offset, K, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKS_PER_SPLIT, EVEN_K, SILU)
    pdl.launch_dependents(PDL)
    _write_result(tl.sum(acc0, axis=1), tl.sum(accu0, axis=1), m0, offs_n, M, N, out_ptr, ws_ptr, pid_s,
                  ws_split_stride, ws_cols, PARTIALS, SILU, INTERPRETED)
    if BLOCK_M > 1:
        _write_result(tl.sum(acc1, axis=1), tl.sum(accu1, axis=1), m0 + 1, offs_n, M, N, out_ptr, ws_ptr,
                      pid_s, ws_split_stride, ws_cols, PARTIALS, SILU, INTERPRETED)
    if BLOCK_M > 2:
        _write_result(tl.sum(acc2, axis=1), tl.sum(accu2, axis=1), m0 + 2, offs_n, M, N, out_ptr, ws_ptr,
                      pid_s, ws_split_stride, ws_cols, PARTIALS, SILU, INTERPRETED)
        _write_result(tl.sum(acc3, axis=1), tl.sum(accu3, axis=1), m0 + 3, offs_n, M, N, out_ptr, ws_ptr,
                      pid_s, ws_split_stride, ws_cols, PARTIALS, SILU, INTERPRETED)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(ws_ptr, out_ptr, M, N, ws_split_stride, ws_cols,
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          SILU: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """out[row, n] = bf16(p0 + p1 + ... + p_{S-1}), partials added in split order.

    For SILU the up sums sit N columns right of the gate sums and the epilogue is
    bf16(bf16(silu(bf16(g))) * bf16(u)), exactly as in the single-chunk kernels.
    """
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ptrs = ws_ptr + row * ws_cols + offs
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * ws_split_stride, mask=mask, other=0.0)
    if SILU:
        acc_u = tl.load(ptrs + N, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc_u += tl.load(ptrs + N + s * ws_split_stride, mask=mask, other=0.0)
        val = _silu_mul_bf16(acc, acc_u, INTERPRETED)
    else:
        val = acc.to(tl.bfloat16)
    tl.store(out_ptr + row * N + offs, val, mask=mask)


# Under TRITON_INTERPRET=1 triton.jit returns an interpreter object. The interpreter
# runs on CPU tensors, cannot call libdevice and mishandles bf16 tl.dot operands:
# the kernels take INTERPRETED as a constexpr to step around both (never on a GPU).
_INTERPRETED = type(_gemv_dot_kernel).__name__ == "InterpretedFunction"
_REDUCE_BLOCK = 1024
_MAX_ROWS = 65535   # rows are the reduce kernel's second grid axis
_MIN_WS_ROWS = 64   # one workspace covers every decode / verify batch up to 64 rows

_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, splits: int, cols: int, rows: int) -> torch.Tensor:
    """fp32 [splits, capacity, cols], created once per key and never freed (see module doc)."""
    capacity = max(_MIN_WS_ROWS, triton.next_power_of_2(rows))
    key = (device, splits, cols, capacity)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = torch.empty((splits, capacity, cols), dtype=torch.float32, device=device)
        _WORKSPACES[key] = ws
    return ws


# ----------------------------------------------------------------------------- host wrappers

def _check_matrix(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")


def check_device(x: torch.Tensor, w: torch.Tensor, w_name: str) -> None:
    """x and w on one device the kernels run on (CUDA; the CPU under Triton's interpreter)."""
    if w.device != x.device:
        raise ValueError(f"{w_name} is on {w.device} but x is on {x.device}")
    if _INTERPRETED:
        if x.device.type != "cpu":
            raise ValueError(f"x must be on the CPU under TRITON_INTERPRET=1, got {x.device}")
    elif x.device.type != "cuda":
        raise ValueError(f"x must be on a CUDA device, got {x.device}")


def check_operands(x: torch.Tensor, w: torch.Tensor, w_name: str, silu: bool = False) -> None:
    """x [M, K] and w [N, K] (for silu [2N, K]): bf16, contiguous, shapes that fit; ValueError
    naming the bad argument (check_device then says whether the kernels can run on them)."""
    _check_matrix("x", x)
    _check_matrix(w_name, w)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{w_name} has {w.shape[1]} columns but x has K={x.shape[1]}")
    if silu and w.shape[0] % 2:
        raise ValueError(f"{w_name} must have an even number of rows (gate then up), got {w.shape[0]}")
    if x.shape[0] > _MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; at most {_MAX_ROWS} (the reduce kernel's grid) are supported")


def launch_plan(m: int, n: int, k: int, config: GemvConfig) -> dict:
    """How a product of m rows, n output columns (gate columns for SiLU) and depth k runs under
    `config`: the grid, the number of K chunks actually used, and the constexprs every GEMV-style
    kernel takes (also a fused kernel built on dot_sums / fma_sums, e.g. gdn_step's).

    Whole BLOCK_K blocks per chunk, the same count in every chunk (a compile-time trip count);
    chunks that would be empty are dropped, so the split actually used is a function of (K,
    config) only. When the chunks do not tile K exactly, loads past K are masked to zero (adding
    0 to an fp32 sum is exact)."""
    k_blocks = triton.cdiv(k, config.block_k)
    blocks_per_split = triton.cdiv(k_blocks, config.split_k)
    splits = triton.cdiv(k_blocks, blocks_per_split)
    return {
        "grid": (triton.cdiv(m, config.block_m) * splits * triton.cdiv(n, config.block_n),),
        "splits": splits,
        "constexprs": dict(K=k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                           SPLIT_K=splits, BLOCKS_PER_SPLIT=blocks_per_split, EVEN_N=n % config.block_n == 0,
                           EVEN_K=k % config.block_k == 0 and k_blocks % blocks_per_split == 0,
                           PREFETCH_LINES=max(1, config.block_k // 64)),
    }


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, config: GemvConfig | None,
            silu: bool, w_name: str, partials: bool = False) -> torch.Tensor:
    check_operands(x, w, w_name, silu)
    m, k = x.shape
    n_rows = w.shape[0]
    n = n_rows // 2 if silu else n_rows
    if config is None:
        config = select_config(n_rows, k, silu, m)
    elif not isinstance(config, GemvConfig):
        raise ValueError(f"config must be a GemvConfig or None, got {type(config).__name__}")
    if out is not None:
        _check_matrix("out", out)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must have shape {(m, n)}, got {tuple(out.shape)}")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x is on {x.device}")
    check_device(x, w, w_name)
    if out is None and not partials:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    plan = launch_plan(m, n, k, config)
    splits = plan["splits"]
    ws_cols = 2 * n if silu else n
    write_partials = partials or splits > 1
    if write_partials:
        ws = _workspace(x.device, splits, ws_cols, m)
        ws_split_stride = ws.shape[1] * ws_cols
    else:
        ws, ws_split_stride = out, 0   # unused: the kernel writes bf16 straight to out
    use_pdl, pdl_launch = pdl.for_rows(m)
    if config.mode == "fma":
        kernel, extra = _gemv_fma_kernel, {}
    else:
        kernel, extra = _gemv_dot_kernel, {"SWAP": config.mode == "dot_t"}
    kernel[plan["grid"]](
        x, w, out if out is not None else ws, ws, m, n, n * k, ws_split_stride, ws_cols,
        PARTIALS=write_partials, SILU=silu, INTERPRETED=_INTERPRETED, PDL=use_pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **plan["constexprs"], **extra, **pdl_launch,
    )
    if partials:
        return ws[:, :m]   # [splits, m, ws_cols] fp32, rows at their workspace stride
    if splits > 1:
        _splitk_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
            ws, out, m, n, ws_split_stride, ws_cols,
            SPLIT_K=splits, BLOCK=_REDUCE_BLOCK, SILU=silu, INTERPRETED=_INTERPRETED, num_warps=4,
            PDL=use_pdl, **pdl_launch,
        )
    return out


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
           config: GemvConfig | None = None) -> torch.Tensor:
    """out[M, N] = bf16(x @ w.T) with fp32 accumulation; x [M, K] bf16, w [N, K] bf16.

    Deterministic and independent of M row by row (see the module docstring).
    `out` ([M, N] bf16 contiguous) is written in place and returned; `config`
    overrides the table (select_config).
    Raises ValueError naming a bad argument.
    """
    return _launch(x, w, out, config, silu=False, w_name="w")


def linear_partials(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """The fp32 partial sums of x @ w.T, one per K chunk of the config: [S, M, N].

    Adding them in the order 0, 1, ..., S-1 in fp32 and rounding to bf16 gives
    exactly `linear(x, w, config=config)` (S may be 1). For a consumer that fuses
    that reduction into its own kernel (rmsnorm.add_rmsnorm_partials). The
    tensor is a view of the shared workspace (see the module docstring): it is
    valid until the next call with the same (device, S, N, row capacity).
    """
    return _launch(x, w, None, config, silu=False, w_name="w", partials=True)


def linear_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None = None,
                    config: GemvConfig | None = None) -> torch.Tensor:
    """out[M, I] = bf16( bf16(silu(bf16(x @ Wg.T))) * bf16(x @ Wu.T) ), fp32 accumulation.

    x [M, K] bf16; w_gate_up [2I, K] bf16 with rows [0, I) = gate_proj and [I, 2I) =
    up_proj. SiLU is g / (1 + exp(-g)) in fp32 on the bf16 g. Same determinism as
    `linear`; `config.block_n` counts gate columns.
    """
    return _launch(x, w_gate_up, out, config, silu=True, w_name="w_gate_up")


# ----------------------------------------------------------------------------- references

def linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16(x @ w.T) computed in fp32 by torch: bf16 products are exact in fp32, one final rounding."""
    return (x.float() @ w.float().t()).to(torch.bfloat16)


def linear_silu_mul_reference(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """The reference's `act_fn(gate_proj(x)) * up_proj(x)` in BF16, on fp32-accumulated g and u.

    g and u are rounded to bf16 by linear_reference; F.silu on a bf16 tensor computes
    g / (1 + exp(-g)) in fp32 and rounds to bf16; the bf16 * bf16 product rounds once.
    """
    gu = linear_reference(x, w_gate_up)
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u
