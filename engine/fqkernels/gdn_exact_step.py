"""A GDN decode step in the full forward's arithmetic: Qwen3.5's exact decode, the default.

Native's prompt pass is its full forward's, and its decode is not (a recurrent step where the
full forward runs the chunked rule), so its noise is its decode's. The engine's prompt pass
cannot have the full forward's bits at the speed bars (the reference order's ~41 GFLOP of FMA
chains a layer at 4x2048), which with a recurrent decode puts its noise at about twice native's;
with a decode that gives the full forward's bits its noise is the prompt's share alone, at
native's level (docs/NUMERICS.md).

The chunked rule's output at position t of a chunk depends only on the chunk's rows 0..t and
the state at the chunk's start, S_c; so a decode step can compute the full forward's row t from
rows kept as the chunk fills:

  K[j]   the normalized key (fp32 [Dk]; KT the same transposed),  X[j] = [u_j | w_j] (the solve's
         row, fp32 [Dv + Dk]),  VN[j] = v_new_j = u_j - w_j S_c (fp32 [Dv]),  G[j] the raw log
         decay (the chunk's gamma is its cumulative sum, recomputed each step as torch sums it),

and, once the chunk's 64th row is in, S_c <- S_c * exp(gamma_63) + K_d^T VN. Per step that reads
S_c and the rows so far and writes one row, where the recurrent step reads and writes the whole
state: about the same traffic.

Order of each piece, each measured on an H200 against the reference's torch ops: products are
ascending FMA chains from zero (cuBLAS's and an "ieee" tl.dot's chain for every output; written
out here as loops), multiplies, adds and subtracts rounded on their own (PTX), expf as torch's, the
solve's row in cuBLAS's blocked order (earlier 8-row blocks' terms each summed from zero and
subtracted, then the own block's rows by one FMA each); torch's l2 norm and cumulative sum in
their CUDA kernels' orders (torch_sum_order, scan_tile; torch_rows checks the copies).

  fused_step(...)          the step: row t's output, its rows into the chunk's buffers, the close
                           at row 63 in the same pass; one kernel in one of two forms ("fused":
                           a pass a product; "merged": fewer passes, each trip's loads serving
                           several chains), the same chains
  fused_rows               T rows of each sequence in turn (a verify's), in one launch where the
                           grid takes the merged form: each program runs its head's rows, each row
                           the merged step's chains (_merged_row)
  chunk_step_reference     the reference's chunked rule over the chunk's rows 0..t from S_c: row t

  ChunkRows / ReferenceRows a GDN layer's rows in the cache (the kernel's form; the reference's:
                           the step's own inputs), reference_step the step on the reference's ops
  run_rows                 a step over a prompt's positions in turn (fq_qwen35's prompt pass with
                           exact decode: the positions outside its whole chunks)

Bit-equal on an H200 to the reference after a 512-token prefix at B = 1, 4, 16 (outputs and the
closed state; results/bench_gdn_exact_step.json). The grid picks the form: the merged form
uncapped up to two programs a multiprocessor (B = 1 and 4 on the H200), the fused form at 128
registers beyond (B = 16); 32 rows a trip; the close on tl.dots. Its time per step against the
recurrent kernel's, the forms that measured slower, and the judge's figures: docs/PERFORMANCE.md.
The engine's exact_decode (the default) runs it; exact_decode=False (FASTQWEN_EXACT_DECODE=0)
runs the recurrent step (gdn_step.decode_step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fqkernels import pdl
from fqkernels.device import sm_count
from fqkernels.gdn_norm import gated_norm_rows
from fqkernels import gdn_ref
from fqkernels.gdn_ref import CHUNK, EPS
from fqkernels.gdn_step import step_views
from fqkernels.rmsnorm import _inverse, torch_order
from fqkernels.rounding import add_rn, mul_rn, sub_rn, tile_row
from fqkernels.swiglu import exp_f32

C = CHUNK
# fused_step's launch defaults (each also one of its arguments, which the bench varies). "auto"
# picks by the grid: grid_plan (the kernel form and register cap), close_blocks (the chunk close's
# blocks), auto_plan (the merged form's schedule); docs/PERFORMANCE.md holds the measurements.
UNROLL = 32            # rows a loop trip loads at once
BLOCK_V = 128          # value columns a program (a whole head of the 4B)
WARPS = 4
AUTO_CAP = 128         # the register cap where the grid has more programs than two a multiprocessor
AUTO_PLAN_SHARE = 0.5  # auto_plan's grids: at most this fraction of the multiprocessors in programs
# the lines a program reads first asked of a cache: "0" none, "l1" or "l2"; "auto": "l2" in the
# merged form (a grid in one wave), none in the fused form
PREFETCH_LEVELS = {"0": 0, "l1": 1, "l2": 2}
_EPS = tl.constexpr(EPS)         # the l2 norm's, as the reference adds it
# 128-byte lines prefetched of a program's scratch (the 4B's 5 Dk + 3 C = 832 floats: 26 lines; the
# offsets clamped to its last float)
_LINES_SCR = tl.constexpr(32)


@dataclass(frozen=True)
class MergedPlan:
    """How the merged form schedules its passes (each the same chains in the same order: the same
    bits; auto_plan picks one by the grid):
    keys: the keys' pass's rows a trip (the system's and attention's rows; 0: the step's unroll).
      Each row holds a key column and the scratch's scalars, and with the state's row for
      (q e^gamma) S_c (unless qs_late) ~6 values, which is why 32 is its most without spills.
    ws: the w S_c pass's rows a trip (0: the step's unroll): two values a row (three with qs_late).
    qs_late: (q e^gamma) S_c in the w S_c pass (the fused form's way) rather than the keys' pass: the
      keys' trips hold no state row (room for more rows a trip), the state's rows first read in the
      w S_c pass (from L2, which the prefetch fills) rather than read again from L1.
    Round trips at 32 rows a trip: the keys' pass 4, the solve 1-3, w S_c 4. qs_late with keys=64 and
    ws=64 shortens the 4B's graphed decode step at B = 1 (ws=64 alone does not; docs/PERFORMANCE.md)."""
    keys: int = 0
    ws: int = 0
    qs_late: bool = False

    @classmethod
    def from_text(cls, text: str) -> "MergedPlan":
        """From "name=value,..." (the bench's spelling); "" the defaults. An unknown name or a bad
        value is an error naming it."""
        kw = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = (x.strip() for x in part.partition("="))
            if not sep or name not in cls.__dataclass_fields__:
                raise ValueError(f"gdn_exact_step merged plan: {part!r} is not name=value with a name among "
                                 f"{', '.join(cls.__dataclass_fields__)}")
            if name in ("keys", "ws"):
                if not value.isdigit():
                    raise ValueError(f"gdn_exact_step merged plan: {name} must be a count of rows, got {value!r}")
                kw[name] = int(value)
            elif value in ("0", "1"):
                kw[name] = value == "1"
            else:
                raise ValueError(f"gdn_exact_step merged plan: {name} must be 0 or 1, got {value!r}")
        return cls(**kw)

    def check(self, Dk: int) -> None:
        for name in ("keys", "ws"):
            value = getattr(self, name)
            if value and (value < 8 or value > Dk or value & (value - 1)):
                raise ValueError(f"gdn_exact_step merged plan: {name} must be 0 (the step's unroll) or a power of "
                                 f"two from 8 to Dk = {Dk}, got {value}")

    def constexprs(self) -> dict:
        """The merged kernel's constexprs for this plan (none for the defaults: the same compiled kernel)."""
        out = {"UK": self.keys, "UW": self.ws, "QS_LATE": self.qs_late}
        return {k: v for k, v in out.items() if v}


def auto_plan(Dk: int, programs: int, device: torch.device) -> MergedPlan:
    """The merged form's schedule for a grid of `programs` (fused_step's merged=None): (q e^gamma) S_c in the
    w S_c pass and both passes at 64 rows a trip (Dk's at most) where the grid fills at most half
    the multiprocessors (B = 1 and 2 on the H200's 132: one program a head), the plain schedule
    elsewhere and on the CPU. It shortens the decode step at B = 1 (32 programs); at B = 4 (128
    programs), beside the early reads and the attention's gate in its merge, it measured slightly
    slower, so it is left out there (docs/PERFORMANCE.md)."""
    if device.type == "cuda" and programs <= AUTO_PLAN_SHARE * sm_count(device):
        return MergedPlan(keys=min(64, Dk), ws=min(64, Dk), qs_late=True)
    return MergedPlan()


def step_form() -> str:
    """fused_step's defaults in words (for the engine's describe())."""
    return (f"merged, or fused at {AUTO_CAP} registers beyond two programs a multiprocessor; {BLOCK_V} "
            f"columns and {WARPS} warps a program, {UNROLL} rows a trip, the close 32x16 merged, 16x16 fused"
            + (", PDL" if pdl.ENABLED else "") + ", L2 prefetch merged"
            + f", the position read before the wait at up to {pdl.EARLY_MAX_ROWS} sequence(s)"
            + ", the merged schedule by the grid (auto_plan)")


def grid_plan(form: str, maxnreg, programs: int, device: torch.device) -> tuple:
    """The step's kernel form and register cap for a grid of `programs`: "auto" for either picks by
    whether the programs outnumber two a multiprocessor (a GPU's; never on the CPU), the fused form
    at AUTO_CAP registers if they do (four a multiprocessor run more of them at once), else the
    merged form uncapped (a grid in one wave: the step's latency is all there is)."""
    wide = device.type == "cuda" and programs > 2 * sm_count(device)
    form = ("fused" if wide else "merged") if form == "auto" else form
    return form, (AUTO_CAP if wide else 0) if maxnreg == "auto" else maxnreg


def norm_in_step(B: int, Hv: int, Dv: int, block_v: int, device: torch.device) -> bool:
    """Whether the gated norm runs in the step's program for these rows (TritonOps' exact GDN step):
    where the grid picks the fused form (a faster decode step at B = 16 on the H200), not the merged
    one (slower at B = 1, no faster at B = 4; docs/PERFORMANCE.md)."""
    return grid_plan("auto", "auto", B * Hv * max(Dv // block_v, 1), device)[0] == "fused"


def close_blocks(form: str, close) -> tuple:
    """The close's (state rows a block, chunk rows a dot) for a kernel form: for "auto" 32x16 in the
    merged form and 16x16 in the fused one, else `close` as given (fused_step checks it)."""
    if close == "auto":
        return (16, 16) if form == "fused" else (32, 16)
    return close


class ChunkRows:
    """The chunk buffers of one GDN layer's cache rows: the normalized keys transposed KT [B, Hv,
    Dk, C], X [B, Hv, C, Dv + Dk], VN [B, Hv, C, Dv], G [B, Hv, C] (fp32), and the step's scratch;
    block_v: the step's value columns a program. scratch: a step's working rows, only used
    within one launch, so the GDN layers of a model can share one (scratch_for); None: its own."""

    # set by stacked(): the layers' buffers [layers, B, ...] in ROW_AXES' order, and this layer's index
    stack = None
    layer = 0

    def __init__(self, B: int, Hv: int, Dk: int, Dv: int, device, block_v: int = BLOCK_V, scratch=None,
                 buffers: tuple | None = None):
        f32 = dict(dtype=torch.float32, device=device)
        self.X, self.VN, self.G, self.KT = buffers or (
            torch.zeros((B, Hv, C, Dv + Dk), **f32), torch.zeros((B, Hv, C, Dv), **f32),
            torch.zeros((B, Hv, C), **f32),
            torch.zeros((B, Hv, Dk, C), **f32))               # KT transposed: the step reads its rows
        self.block_v = min(block_v, Dv)
        self.scratch = ChunkRows.scratch_for(B, Hv, Dk, Dv, device) if scratch is None else scratch
        need = ChunkRows._scratch_shape(B, Hv, Dk, Dv)
        if self.scratch.shape[1:] != need[1:] or self.scratch.shape[0] < B:
            raise ValueError(f"ChunkRows: scratch {tuple(self.scratch.shape)} does not fit {need}")

    @staticmethod
    def stacked(layers: int, B: int, Hv: int, Dk: int, Dv: int, device, scratch=None) -> list:
        """Every GDN layer's ChunkRows as views of one buffer of each kind ([layers, B, ...]), one
        scratch shared: a verify saves and restores all layers' first chunk rows in one copy a kind
        (rows_head, rows_put_head_where)."""
        f32 = dict(dtype=torch.float32, device=device)
        stack = (torch.zeros((layers, B, Hv, C, Dv + Dk), **f32), torch.zeros((layers, B, Hv, C, Dv), **f32),
                 torch.zeros((layers, B, Hv, C), **f32), torch.zeros((layers, B, Hv, Dk, C), **f32))
        scratch = ChunkRows.scratch_for(B, Hv, Dk, Dv, device) if scratch is None else scratch
        out = []
        for i in range(layers):
            rows = ChunkRows(B, Hv, Dk, Dv, device, scratch=scratch, buffers=tuple(t[i] for t in stack))
            rows.stack, rows.layer = stack, i
            out.append(rows)
        return out

    @staticmethod
    def _scratch_shape(B: int, Hv: int, Dk: int, Dv: int) -> tuple:
        """A program's vectors read back as scalars (kn, kb, qs, xw, qe [Dk] each; the system's and
        attention's rows and the decays [C] each), for column blocks down to 16."""
        return (B, Hv, max(Dv // 16, 1), 5 * Dk + 3 * C)

    @staticmethod
    def scratch_for(B: int, Hv: int, Dk: int, Dv: int, device) -> torch.Tensor:
        """A step's scratch for up to B sequences."""
        return torch.zeros(ChunkRows._scratch_shape(B, Hv, Dk, Dv), dtype=torch.float32, device=device)

    @staticmethod
    def row_bytes(Hv: int, Dk: int, Dv: int) -> int:
        """Bytes one sequence's buffers take in one layer (the shared scratch not counted)."""
        return 4 * Hv * C * (Dk + (Dv + Dk) + Dv + 1)

    def narrow(self, start: int, count: int) -> "ChunkRows":
        """The buffers of sequences [start, start + count): views, sharing the scratch (a launch
        indexes it from its first program)."""
        view = object.__new__(ChunkRows)
        for name in ("X", "VN", "G", "KT"):
            setattr(view, name, getattr(self, name).narrow(0, start, count))
        view.block_v, view.scratch = self.block_v, self.scratch
        return view

    def copy_row(self, src: int, dst: int) -> None:
        for t in (self.X, self.VN, self.G, self.KT):
            t[dst] = t[src]

    # the chunk-row axis of each buffer (KT holds its rows transposed)
    ROW_AXES = (("X", 2), ("VN", 2), ("G", 2), ("KT", 3))

    def head(self, n: int) -> list:
        """A copy of every sequence's first n chunk rows (a speculative verify that runs past a chunk's
        end writes the next chunk's rows there: put_head_where restores them)."""
        return [getattr(self, name).narrow(axis, 0, n).clone() for name, axis in self.ROW_AXES]

    def put_head_where(self, saved: list, mask: torch.Tensor) -> None:
        """head()'s rows back for the sequences where mask [B] bool is set (graph-safe)."""
        for (name, axis), rows in zip(self.ROW_AXES, saved):
            now = getattr(self, name).narrow(axis, 0, rows.shape[axis])
            now.copy_(torch.where(mask.view(-1, *([1] * (rows.dim() - 1))), rows, now))


class ReferenceRows:
    """The torch reference's form of the chunk's rows: the step's own inputs at each row so far
    (q, k [B, C, Hk, Dk] bf16, v [B, C, Hv, Dv] bf16, g fp32 and beta bf16 [B, C, Hv]), which
    reference_step runs the reference's chunked rule over (chunk_step_reference)."""

    def __init__(self, B: int, Hk: int, Hv: int, Dk: int, Dv: int, device):
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.q = torch.zeros((B, C, Hk, Dk), **bf16)
        self.k = torch.zeros((B, C, Hk, Dk), **bf16)
        self.v = torch.zeros((B, C, Hv, Dv), **bf16)
        self.g = torch.zeros((B, C, Hv), dtype=torch.float32, device=device)
        self.beta = torch.zeros((B, C, Hv), **bf16)

    @staticmethod
    def row_bytes(Hk: int, Hv: int, Dk: int, Dv: int) -> int:
        return C * (2 * 2 * Hk * Dk + 2 * Hv * Dv + 4 * Hv + 2 * Hv)

    def narrow(self, start: int, count: int) -> "ReferenceRows":
        view = object.__new__(ReferenceRows)
        for name in ("q", "k", "v", "g", "beta"):
            setattr(view, name, getattr(self, name).narrow(0, start, count))
        return view

    def copy_row(self, src: int, dst: int) -> None:
        for t in (self.q, self.k, self.v, self.g, self.beta):
            t[dst] = t[src]

    ROW_AXES = (("q", 1), ("k", 1), ("v", 1), ("g", 1), ("beta", 1))
    head = ChunkRows.head
    put_head_where = ChunkRows.put_head_where


def _one_stack(rows: list):
    """The stacked buffers `rows` are the layers of, in order (ChunkRows.stacked), else None."""
    stack = getattr(rows[0], "stack", None) if rows else None
    if stack is None or len(rows) != stack[0].shape[0]:
        return None
    if any(getattr(r, "stack", None) is not stack or r.layer != i for i, r in enumerate(rows)):
        return None
    return stack


def rows_head(rows: list, B: int, n: int) -> list:
    """A copy of sequences [0, B)'s first n chunk rows in every layer of `rows` (ChunkRows or
    ReferenceRows, one a layer): one copy a buffer kind where the layers are one stack, else
    each layer's head(n). rows_put_head_where takes it back."""
    stack = _one_stack(rows)
    if stack is None:
        return [r.narrow(0, B).head(n) for r in rows]
    return [t[:, :B].narrow(axis + 1, 0, n).clone() for t, (_, axis) in zip(stack, ChunkRows.ROW_AXES)]


def rows_put_head_where(rows: list, B: int, saved: list, mask: torch.Tensor) -> None:
    """rows_head's rows back for the sequences where mask [B] bool is set (graph-safe)."""
    stack = _one_stack(rows)
    if stack is None:
        for r, head in zip(rows, saved):
            r.narrow(0, B).put_head_where(head, mask)
        return
    for t, (_, axis), head in zip(stack, ChunkRows.ROW_AXES, saved):
        now = t[:, :B].narrow(axis + 1, 0, head.shape[axis + 1])
        now.copy_(torch.where(mask.view(1, -1, *([1] * (head.dim() - 2))), head, now))


def reference_step(q, k, v, g, beta, positions, state, rows: ReferenceRows, ends=None):
    """fused_step's contract on the reference's ops (the torch op set): this step's inputs into
    row position mod 64 of each sequence's chunk, then the reference's chunked rule over the
    chunk's rows so far from the chunk's start (state, advanced in place at its last row): the
    full forward's output at that row, on the reference's ops. Reads the positions on the host;
    sequences at the same row run together. ends: fused_step's (a sequence at or past its end is
    not run: output zero, nothing written). Returns o [B, Hv, Dv] bf16."""
    B, Hv, Dv = v.shape
    pos = positions.tolist()
    live = [True] * B if ends is None else [p < e for p, e in zip(pos, ends.tolist())]
    t_of = [int(p) % C for p in pos]
    for b, t in enumerate(t_of):
        if live[b]:
            rows.q[b, t], rows.k[b, t], rows.v[b, t], rows.g[b, t], rows.beta[b, t] = q[b], k[b], v[b], g[b], beta[b]
    out = torch.zeros((B, Hv, Dv), dtype=torch.bfloat16, device=v.device)
    for t in sorted({t for t, on in zip(t_of, live) if on}):
        idx = [b for b, tb in enumerate(t_of) if tb == t and live[b]]
        sel = torch.tensor(idx, device=v.device)
        o, s = chunk_step_reference(*(x[sel, :t + 1] for x in (rows.q, rows.k, rows.v, rows.g, rows.beta)),
                                    state[sel])
        out[sel] = o
        if t == C - 1:
            state[sel] = s
    return out


def chunk_step_reference(q, k, v, g, beta, state):
    """The reference's chunked rule over one chunk's rows 0..t (q, k [B, t + 1, Hk, Dk], v [B, t + 1,
    Hv, Dv] bf16, g fp32, beta bf16 [B, t + 1, Hv]) from state (the chunk's start, fp32 [B, Hv, Dk,
    Dv]): (row t's output [B, Hv, Dv] bf16, the state after the rows: the next chunk's start when
    t = 63), what the full forward gives there."""
    H = v.shape[2]
    q, k = gdn_ref.expand_heads(q, H), gdn_ref.expand_heads(k, H)
    o, s = gdn_ref.delta_rule_chunked_reference(q, k, v, g, beta, state=state)
    return o[:, -1], s


def run_rows(step, q, k, v, g, beta, pos0: int, state, rows, **kw):
    """`step` (fused_step or reference_step) over a prompt's positions pos0, pos0 + 1, ... in turn:
    q, k [B, n, Hk, Dk], v [B, n, Hv, Dv], g, beta [B, n, Hv] (a prompt pass's views). Returns
    the outputs [B, n, Hv, Dv]; the rows and state are left as n decode steps leave them."""
    B, n = v.shape[:2]
    positions = (torch.arange(n, dtype=torch.int32, device=v.device) + pos0)[:, None].expand(n, B).contiguous()
    return torch.stack([step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], positions[i], state, rows, **kw)
                        for i in range(n)], 1)


# ------------------------------------------------------------------ torch's reductions, copied
# The step's torch ops (the l2 norms' reductions, the chunk's cumulative sum) written in the
# order of torch's CUDA kernels, so the whole step is one launch: torch's reduce of a
# contiguous row of D values runs 32 lanes of D / 32 values each, a lane's values summed in
# turn, then the lanes combined by shuffles (sum_order picks which values a lane holds and which
# lanes the shuffles pair); its inner scan (a cumulative sum along the last dimension) runs
# Sklansky's levels over tiles of `scan_tile` values, a tile's first input carrying the total of
# the tiles before it (ATen ScanUtils.cuh: the tile is 32 for 33 to 32768 rows of 64, else 64).

SUM_ORDERS = {0: "strided lanes, adjacent pairs first", 1: "contiguous lanes, adjacent pairs first",
              2: "strided lanes, halves first", 3: "contiguous lanes, halves first"}


def torch_sum_order(D: int) -> int:
    """The SUM_ORDERS entry of torch's reduce over rows of D: its loads are vectorized (a lane's
    values contiguous) from D = 128 on (torch 2.11: order 3 matched bit for bit on an H200),
    strided below; its shuffles combine halves first either way."""
    return 3 if D >= 128 else 2


def scan_tile(rows: int, row_size: int = C) -> int:
    """The values one tile of torch's inner scan covers for `rows` rows of `row_size` (ATen's
    get_log_num_threads_x_inner_scan, its unsigned wrap-around included), at most row_size."""
    lx = max(row_size - 1, 0).bit_length()
    ly = max(rows - 1, 0).bit_length()
    d = (9 + lx - ly) % 2 ** 32
    log_x = min(max(4, d // 2), 9)
    return min(2 << log_x, row_size)


@triton.jit
def _pairs_adjacent(x, N: tl.constexpr):
    """[N] -> [N / 2]: x[2i] + x[2i + 1] (a sum of two: one rounding, either order)."""
    return tl.sum(tl.reshape(x, [N // 2, 2]), axis=1)


@triton.jit
def _pairs_halves(x, N: tl.constexpr):
    """[N] -> [N / 2]: x[i] + x[i + N / 2]."""
    return tl.sum(tl.reshape(x, [2, N // 2]), axis=0)


@triton.jit
def _lanes_adjacent(x):
    """The 32 lanes' values combined by shuffles at offsets 1, 2, 4, 8, 16: a balanced tree over
    adjacent pairs first. Returns a scalar."""
    x = _pairs_adjacent(_pairs_adjacent(_pairs_adjacent(_pairs_adjacent(_pairs_adjacent(x, 32), 16), 8), 4), 2)
    return tl.sum(x, axis=0)


@triton.jit
def _lanes_halves(x):
    """The 32 lanes combined at offsets 16, 8, 4, 2, 1: lane i with lane i + 16 first."""
    x = _pairs_halves(_pairs_halves(_pairs_halves(_pairs_halves(_pairs_halves(x, 32), 16), 8), 4), 2)
    return tl.sum(x, axis=0)


@triton.jit
def _torch_sumsq(x, D: tl.constexpr, ORDER: tl.constexpr, INTERPRETED: tl.constexpr):
    """(x * x).sum() over x [D] fp32 in the order of torch's CUDA reduce (SUM_ORDERS[ORDER]):
    each product rounded, lane l's D / 32 values summed in turn, then the 32 lanes."""
    E: tl.constexpr = D // 32
    sq = mul_rn(x, x, INTERPRETED)
    if ORDER % 2 == 1:
        m = tl.trans(tl.reshape(sq, [32, E]))          # m[a, l] = sq[E l + a]: a lane's values side by side
    else:
        m = tl.reshape(sq, [E, 32])                    # m[a, l] = sq[32 a + l]: strided by the lanes
    ee = tl.arange(0, E)
    acc = tile_row(m, ee, 0)
    for a in tl.static_range(1, E):
        acc = add_rn(acc, tile_row(m, ee, a), INTERPRETED)
    if ORDER // 2 == 1:
        return _lanes_halves(acc)
    else:
        return _lanes_adjacent(acc)


@triton.jit
def _torch_l2norm(x, D: tl.constexpr, ORDER: tl.constexpr, INTERPRETED: tl.constexpr):
    """gdn_ref.l2_normalize on one row: x * rsqrt(sum(x * x) + gdn_ref.EPS), each step rounded."""
    ss = add_rn(_torch_sumsq(x, D, ORDER, INTERPRETED), _EPS, INTERPRETED)
    if INTERPRETED:
        inv = 1.0 / tl.sqrt(ss)
    else:
        inv = libdevice.rsqrt(ss)
    return mul_rn(x, inv, INTERPRETED)


@triton.jit
def _sklansky_level(v, N: tl.constexpr, S: tl.constexpr, INTERPRETED: tl.constexpr):
    """One level of torch's inner scan over v [N]: each value in the upper half of its group of
    2S adds the lower half's last value."""
    v3 = tl.reshape(v, [N // (2 * S), 2, S])
    h = tl.arange(0, 2)[None, :, None]
    s = tl.arange(0, S)[None, None, :]
    low_last = tl.sum(tl.sum(tl.where((h == 0) & (s == S - 1), v3, 0.0), axis=2), axis=1)
    return tl.reshape(tl.where(h == 1, add_rn(v3, low_last[:, None, None], INTERPRETED), v3), [N])


@triton.jit
def _sklansky(v, N: tl.constexpr, LEVELS: tl.constexpr, INTERPRETED: tl.constexpr):
    """Levels 0..LEVELS-1 (at most 6) of torch's inner scan over v [N]."""
    v = _sklansky_level(v, N, 1, INTERPRETED)
    if LEVELS > 1:
        v = _sklansky_level(v, N, 2, INTERPRETED)
    if LEVELS > 2:
        v = _sklansky_level(v, N, 4, INTERPRETED)
    if LEVELS > 3:
        v = _sklansky_level(v, N, 8, INTERPRETED)
    if LEVELS > 4:
        v = _sklansky_level(v, N, 16, INTERPRETED)
    if LEVELS > 5:
        v = _sklansky_level(v, N, 32, INTERPRETED)
    return v


@triton.jit
def _torch_cumsum(x, jj, CH: tl.constexpr, TILE: tl.constexpr, LOG_TILE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x.cumsum(-1) over x [CH] in torch's inner scan's order, tiles of TILE (CH or CH / 2)."""
    v = _sklansky(x, CH, LOG_TILE, INTERPRETED)
    if TILE < CH:
        total = tl.sum(tl.where(jj == TILE - 1, v, 0.0), axis=0)
        v2 = _sklansky(tl.where(jj == TILE, add_rn(x, total, INTERPRETED), x), CH, LOG_TILE, INTERPRETED)
        v = tl.where(jj < TILE, v, v2)
    return v


@triton.jit
def _torch_rows_kernel(x_ptr, o_ptr, N: tl.constexpr, WHAT: tl.constexpr, ORDER: tl.constexpr, TILE: tl.constexpr,
                       LOG_TILE: tl.constexpr, INTERPRETED: tl.constexpr):
    """One row a program: WHAT 0 the l2 norm's replica, 1 the cumulative sum's (torch_rows)."""
    r = tl.program_id(0)
    n = tl.arange(0, N)
    x = tl.load(x_ptr + r * N + n)
    if WHAT == 0:
        y = _torch_l2norm(x, N, ORDER, INTERPRETED)
    else:
        y = _torch_cumsum(x, n, N, TILE, LOG_TILE, INTERPRETED)
    tl.store(o_ptr + r * N + n, y)


def torch_rows(x: torch.Tensor, what: str, sum_order: int | None = None, tile: int | None = None) -> torch.Tensor:
    """The copies on each row of x [R, N] fp32 contiguous: what="l2norm" (gdn_ref.l2_normalize in
    SUM_ORDERS[sum_order], torch_sum_order(N) unless given) or "cumsum" (x.cumsum(-1) with
    torch's tile, scan_tile(R, N) unless given). For the tests, and for checking them bit for bit
    against torch on a GPU."""
    R, N = x.shape
    tile = tile or scan_tile(R, N)
    if what not in ("l2norm", "cumsum") or N & (N - 1) or N < 32 or (what == "cumsum" and tile not in (N, N // 2)):
        raise ValueError(f"gdn_exact_step.torch_rows: {what!r} over rows of {N} (a power of two >= 32), tile {tile}")
    out = torch.empty_like(x)
    sum_order = torch_sum_order(N) if sum_order is None else sum_order
    _torch_rows_kernel[(R,)](x.contiguous(), out, N=N, WHAT=0 if what == "l2norm" else 1, ORDER=sum_order,
                             TILE=tile, LOG_TILE=tile.bit_length() - 1, INTERPRETED=not x.is_cuda)
    return out


FORMS = ("fused", "merged")


def fused_step(q, k, v, g, beta, positions, state, rows: ChunkRows, sum_order: int | None = None, tile: int = 32,
               block_v: int | None = None, num_warps: int = WARPS, unroll: int = UNROLL, form: str = "auto",
               maxnreg="auto", use_pdl: bool = True, close="auto", norm=None, prefetch: str = "auto",
               early: bool | None = None, merged: MergedPlan | None = None, ends: torch.Tensor | None = None):
    """One decode step of the rule in the full forward's arithmetic (`form`: its kernels): q, k [B, Hk,
    Dk] bf16 (the conv's output, not normalized, heads not repeated; any row stride, unit last),
    v [B, Hv, Dv] bf16, g [B, Hv] fp32, beta [B, Hv] bf16, positions [B] (each sequence's
    position: its row in its chunk is position mod 64), state [B, Hv, Dk, Dv] fp32 (the state at
    each chunk's start; advanced in place at a chunk's last row), rows (the chunk's rows so far;
    this step's written). sum_order: the l2 norms' order (SUM_ORDERS; torch_sum_order(Dk) unless
    given); tile: the cumulative sum's (scan_tile of the full forward's rows); unroll: the rows a
    loop trip loads at once (a power of two from 8 to Dk); form: "fused" (each column block's
    program computes its head's system and attention rows, w's solve, then its columns: a pass
    over the rows a product) or "merged" (q S_c's chain in the keys' trips; w's and u's solves and
    the attention over the earlier new values in one pass; w S_c over the state's rows read
    again from cache): the same chains, so the same bits; "auto": grid_plan's; maxnreg: the
    kernel's register cap (0: none; "auto": grid_plan's); use_pdl: launch with programmatic
    dependent launch where fqkernels.pdl allows (decode-sized batches; the same bits); close: the
    close's (state rows a block, chunk rows a dot), powers of two from 16 to Dk and to 64, or "auto"
    (close_blocks' for the form) (the same bits); norm: None, or (z, weight, eps) for the gated norm
    of each output row in the step's own program (gdn_norm.gated_norm_rows, the gated norm kernel's bits:
    gdn_norm.gated_rmsnorm(o, z, weight, eps)), z [B, Hv * Dv] bf16 (any row stride, unit last), weight
    [Dv]; it needs a program to hold a whole head (the block Dv, Dv = 128); prefetch: "0", "l1" or
    "l2", or "auto" (the form's: "l2" merged, "0" fused) (nothing on the CPU; the same bits); early:
    the positions read before PDL's wait, the chunk's rows asked for there (None: pdl.early's rule,
    pdl.EARLY at up to pdl.EARLY_MAX_ROWS sequences; the same bits); merged: the merged form's
    schedule (MergedPlan; None: auto_plan's; the same bits); ends: None, or int32 [B] (a
    speculative verify's): a sequence whose position is at or past ends[b] is not run, its output
    zero, its state and chunk rows untouched. Returns o [B, Hv, Dv] bf16, normed with norm."""
    B, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    bv = block_v or rows.block_v
    sum_order = torch_sum_order(Dk) if sum_order is None else sum_order
    prefetch = "auto" if prefetch is None else prefetch
    if merged is None:
        merged = auto_plan(Dk, B * Hv * max(Dv // bv, 1), v.device)
    merged.check(Dk)
    form, maxnreg = grid_plan(form, maxnreg, B * Hv * max(Dv // bv, 1), v.device)
    close = close_blocks(form, close)
    if (q.shape != k.shape or v.shape[0] != B or Hv % Hk or state.shape != (B, Hv, Dk, Dv)
            or not state.is_contiguous() or Dv % bv or bv % 16 or Dk < 32 or Dk & (Dk - 1)
            or tile not in (C, C // 2) or sum_order not in SUM_ORDERS or rows.KT.shape[:2] != (B, Hv)
            or unroll < 8 or unroll > Dk or unroll & (unroll - 1) or form not in FORMS
            or not (isinstance(maxnreg, int) and maxnreg >= 0)
            or not isinstance(close, tuple) or len(close) != 2 or not all(isinstance(x, int) for x in close)
            or any(x < 16 or x & (x - 1) for x in close) or close[0] > Dk or close[1] > C
            or (norm is not None and not _norm_fits(norm, B, Hv, Dv, bv))
            or prefetch not in (*PREFETCH_LEVELS, "auto") or not _ends_fit(ends, positions)):
        raise ValueError(f"gdn_exact_step.fused_step: q/k {tuple(k.shape)}, v {tuple(v.shape)}, state "
                         f"{tuple(state.shape)}, rows for {tuple(rows.KT.shape[:2])}, block {bv}, tile {tile}, "
                         f"sum order {sum_order}, unroll {unroll}, form {form!r}, register cap {maxnreg!r}, "
                         f"close {close!r}, norm {_norm_shapes(norm)}, prefetch {prefetch!r} (Dk a power of two "
                         f">= 32; the block a multiple of 16 dividing Dv; unroll a power of two from 8 to Dk; "
                         f"form one of {FORMS} or \"auto\"; the cap \"auto\" or registers >= 0; the close's blocks "
                         f"powers of two from 16 to Dk and 64, or \"auto\"; "
                         f"the norm's z [B, Hv * Dv] and weight [Dv] bf16, Dv = the block = 128; prefetch one of "
                         f"{sorted(PREFETCH_LEVELS)} or \"auto\"; ends {_ends_shape(ends)}: int32 like the "
                         f"positions {tuple(positions.shape)} or None)")
    q, k, v, g, beta = step_views(q, k, v, g, beta)
    out = torch.empty((B, Hv, Dv), dtype=torch.bfloat16, device=v.device)
    consts = dict(SCR=rows.scratch.shape[-1], HV=Hv, DK=Dk, DV=Dv, CH=C, NB=8, TILE=tile,
                  LOG_TILE=tile.bit_length() - 1, U=unroll, INTERPRETED=not v.is_cuda, RB=close[0], KB=close[1],
                  num_stages=1)
    if prefetch == "auto":
        prefetch = "l2" if form == "merged" else "0"
    use_pdl, pdl_launch = pdl.for_rows(B) if use_pdl else (False, {})
    caps = {"maxnreg": maxnreg} if maxnreg else {}
    consts["PF"] = PREFETCH_LEVELS[prefetch] if v.is_cuda else 0
    if pdl.early(early, B):
        consts["EARLY"] = True
    if norm is not None:
        z, nw, eps = norm
        vec, halves, _ = torch_order(Dv, v.device)
        norm_args = (z, z.stride(0), nw, _inverse(Dv), eps)
        consts.update(NORM=True, VEC=vec, HALVES=halves)
    else:
        norm_args = (out, 0, out, 1.0, 1.0)        # not read
        consts.update(NORM=False, VEC=False, HALVES=False)
    args = (q, k, v, g, beta, positions, state, rows.KT, rows.X, rows.VN, rows.G, rows.scratch, out,
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), Dk ** -0.5, *norm_args,
            positions if ends is None else ends)
    if ends is not None:
        consts["ENDS"] = True
    if form == "merged":
        _merged_step_kernel[(B * Hv, Dv // bv)](*args, RATIO=Hv // Hk, BV=bv, ORDER=sum_order, PDL=use_pdl,
                                                num_warps=num_warps, **consts, **merged.constexprs(), **pdl_launch,
                                                **caps)
    else:
        _chain_step_kernel[(B * Hv, Dv // bv)](*args, RATIO=Hv // Hk, BV=bv, ORDER=sum_order,
                                               PDL=use_pdl, num_warps=num_warps,
                                               **consts, **pdl_launch, **caps)
    return out


def fused_rows(q, k, v, g, beta, positions, state, rows: ChunkRows, tile: int = 32,
               use_pdl: bool = True, stamps: torch.Tensor | None = None,
               ends: torch.Tensor | None = None) -> torch.Tensor:
    """fused_step over T rows of each sequence in turn (a speculative verify's rows): q, k [T, B, Hk,
    Dk], v [T, B, Hv, Dv], g, beta [T, B, Hv] (any strides fused_step takes within a row), row r of
    sequence b at positions[b] + r; tile: the cumulative sum's (fused_step's); no gated norm (the
    caller norms the rows). Where the grid takes the merged form with a program a head (few
    sequences), one launch whose programs run the rows in turn, each row the merged step's chains
    (the same bits as T launches, a launch's fixed cost paid once); else T fused_step launches.
    T is a runtime argument: one compile serves every verify width (docs/PERFORMANCE.md: why the
    rows are not batched). The Triton op set's gdn_exact_rows. stamps: None, or int64 [B * Hv, T,
    len(PHASES) + 1, 2] for each row's phase stamps (a bench's measurement: the one-launch form on a
    GPU only; the same bits). ends: fused_step's (int32 [B]: sequence b's rows from position
    ends[b] on are not run: zero outputs, nothing written). Returns o [T, B, Hv, Dv] bf16; the
    state and rows as T steps (those run) leave them."""
    T, B, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if (q.shape != k.shape or v.shape[:2] != (T, B) or g.shape != (T, B, Hv) or beta.shape != (T, B, Hv)
            or Hv % Hk or state.shape != (B, Hv, Dk, Dv) or not state.is_contiguous()
            or q.stride(-1) != 1 or q.stride() != k.stride() or v.stride(-1) != 1 or g.stride(-1) != 1
            or beta.stride(-1) != 1 or rows.KT.shape[:2] != (B, Hv) or Dk < 32 or Dk & (Dk - 1) or Dv % 16
            or tile not in (C, C // 2) or not _ends_fit(ends, positions)):
        raise ValueError(f"gdn_exact_step.fused_rows: q/k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}, state {tuple(state.shape)}, rows for {tuple(rows.KT.shape[:2])} "
                         f"tile {tile}, ends {_ends_shape(ends)} (q, k, v, g and beta with a unit last stride, q and "
                         f"k alike; Dk a power of two >= 32; the tile 64 or 32; ends int32 like the positions "
                         f"{tuple(positions.shape)} or None)")
    programs = B * Hv * max(Dv // rows.block_v, 1)
    form, maxnreg = grid_plan("auto", "auto", programs, v.device)
    one_launch = form == "merged" and rows.block_v == Dv and T > 1
    stamp_shape = (B * Hv, T, len(PHASES) + 1, 2)
    if stamps is not None and (not v.is_cuda or not one_launch or stamps.dtype != torch.int64
                               or tuple(stamps.shape) != stamp_shape or not stamps.is_contiguous()):
        raise ValueError(f"gdn_exact_step.fused_rows: stamps {tuple(stamps.shape)} {stamps.dtype} on {v.device} for "
                         f"{T} rows of {B} x {Hv} heads (int64 {stamp_shape}, contiguous; a GPU and the one-launch "
                         f"form: more than one row, the merged form's grid, a program a head)")
    if not one_launch:
        return torch.stack([fused_step(q[r], k[r], v[r], g[r], beta[r], positions + r, state, rows, tile=tile,
                                       use_pdl=use_pdl, ends=ends)
                            for r in range(T)])
    merged = auto_plan(Dk, programs, v.device)
    out = torch.empty((T, B, Hv, Dv), dtype=torch.bfloat16, device=v.device)
    use_pdl, pdl_launch = pdl.for_rows(B) if use_pdl else (False, {})
    close = close_blocks(form, "auto")
    _merged_rows_kernel[(B * Hv, 1)](
        q, k, v, g, beta, positions, state, rows.KT, rows.X, rows.VN, rows.G, rows.scratch, out, T,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), out.stride(0), Dk ** -0.5, out if stamps is None else stamps,
        positions if ends is None else ends, SCR=rows.scratch.shape[-1], HV=Hv, RATIO=Hv // Hk, DK=Dk, DV=Dv,
        CH=C, NB=8, ORDER=torch_sum_order(Dk), TILE=tile, LOG_TILE=tile.bit_length() - 1, U=UNROLL,
        INTERPRETED=not v.is_cuda, RB=close[0], KB=close[1],
        PF=PREFETCH_LEVELS["l2"] if v.is_cuda else 0, PDL=use_pdl, num_warps=WARPS, num_stages=1,
        **merged.constexprs(), **({"STAMP": True} if stamps is not None else {}),
        **({"ENDS": True} if ends is not None else {}), **pdl_launch,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return out


def _ends_fit(ends, positions) -> bool:
    return ends is None or (ends.dtype == torch.int32 and ends.shape == positions.shape and ends.is_contiguous()
                            and ends.device == positions.device)


def _ends_shape(ends) -> str:
    return "none" if ends is None else f"{tuple(ends.shape)} {ends.dtype}"


def _norm_fits(norm, B: int, Hv: int, Dv: int, bv: int) -> bool:
    z, nw, _ = norm
    return (bv == Dv == 128 and z.dim() == 2 and tuple(z.shape) == (B, Hv * Dv) and z.stride(1) == 1
            and tuple(nw.shape) == (Dv,) and z.dtype == nw.dtype == torch.bfloat16)


def _norm_shapes(norm) -> str:
    return "none" if norm is None else f"z {tuple(norm[0].shape)} {norm[0].dtype}, weight {tuple(norm[1].shape)}"


# ------------------------------------------------------------------ the step's kernels
# Each product an explicit ascending FMA chain from zero (the chain cuBLAS and an "ieee" tl.dot
# run for every output): a loop over the chained index with one scalar (read back from the
# program's scratch) times one loaded row each time, no 16-row padding, the loads independent of
# the chains. The loops run U rows unrolled a trip (a whole unroll takes Triton 3.6 four minutes
# to compile). A sequence-head's scratch: kn | kb | qs | xw | qe [DK] | sys | attn | decay [CH].
# The pieces: _head_rows (norms, decays, the system's and attention's rows), _solve_row,
# _write_head_row, _columns_part (u's solve, the state's products, the attention) and _close, run
# in turn by the "fused" kernel; the "merged" kernel runs _head_rows with q S_c inside,
# _solve_rows_merged, then w S_c.


@triton.jit
def _head_rows(q_ptr, k_ptr, g_ptr, beta_ptr, kt_buf, g_buf, scr, s_rows, b, hk, bh, t, stride_qb, stride_qh,
               stride_gb, stride_betab, scale, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BV: tl.constexpr, CH: tl.constexpr, ORDER: tl.constexpr, TILE: tl.constexpr, LOG_TILE: tl.constexpr,
               U: tl.constexpr, Q_STATE: tl.constexpr, INTERPRETED: tl.constexpr):
    """A sequence-head's rows: the normalized key and query (torch's l2 norm), the decays (torch's
    cumulative sum), the system's and attention's row t over the chunk's keys, into the scratch;
    with Q_STATE also (q e^gamma_t) S_c for the columns at s_rows, its chain in the same trips as the
    keys' (the state's rows loaded beside the keys' entries). Returns (kn, kb, g, e_t, acc_q)."""
    jj = tl.arange(0, CH)
    dk = tl.arange(0, DK)
    qn = _torch_l2norm(tl.load(q_ptr + b * stride_qb + hk * stride_qh + dk).to(tl.float32), DK, ORDER, INTERPRETED)
    kn = _torch_l2norm(tl.load(k_ptr + b * stride_qb + hk * stride_qh + dk).to(tl.float32), DK, ORDER, INTERPRETED)
    qs = mul_rn(qn, scale, INTERPRETED)
    beta = tl.load(beta_ptr + b * stride_betab + bh % HV).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + bh % HV)
    kb = mul_rn(kn, beta, INTERPRETED)
    gamma = _torch_cumsum(tl.where(jj == t, g, tl.load(g_buf + bh * CH + jj)), jj, CH, TILE, LOG_TILE, INTERPRETED)
    g_t = tl.sum(tl.where(jj == t, gamma, 0.0), axis=0)
    e_t = exp_f32(g_t, INTERPRETED)
    tl.store(scr + dk, kn)
    tl.store(scr + DK + dk, kb)
    tl.store(scr + 2 * DK + dk, qs)
    tl.store(scr + 4 * DK + dk, mul_rn(qs, e_t, INTERPRETED))
    tl.debug_barrier()
    # the system's and attention's row t over the chunk's rows: chains over the key's entries
    acc_s = tl.zeros([CH], dtype=tl.float32)
    acc_a = tl.zeros([CH], dtype=tl.float32)
    acc_q = tl.zeros([BV], dtype=tl.float32)
    for i0 in range(0, DK, U):
        for u in tl.static_range(U):
            i = i0 + u
            col = tl.load(kt_buf + (bh * DK + i) * CH + jj, mask=jj < t, other=0.0)
            col = tl.where(jj == t, tl.load(scr + i), col)
            acc_s = tl.fma(tl.load(scr + DK + i), col, acc_s)
            acc_a = tl.fma(tl.load(scr + 2 * DK + i), col, acc_a)
            if Q_STATE:
                acc_q = tl.fma(tl.load(scr + 4 * DK + i), tl.load(s_rows + i * DV), acc_q)
    decay = exp_f32(tl.where(jj > t, float("-inf"), g_t - gamma), INTERPRETED)
    tl.store(scr + 5 * DK + jj, tl.where(jj < t, mul_rn(acc_s, decay, INTERPRETED), 0.0))
    tl.store(scr + 5 * DK + CH + jj, mul_rn(acc_a, decay, INTERPRETED))
    tl.store(scr + 5 * DK + 2 * CH + jj, decay)
    tl.debug_barrier()
    return kn, kb, g, e_t, acc_q


@triton.jit
def _write_head_row(x_buf, kt_buf, g_buf, scr, bh, t, xw, kn, g, write_row, DK: tl.constexpr, DV: tl.constexpr,
                    CH: tl.constexpr):
    """w's row into the scratch, and with write_row row t of the chunk's keys, w and g."""
    dk = tl.arange(0, DK)
    tl.store(scr + 3 * DK + dk, xw)
    if write_row:
        tl.store(x_buf + (bh * CH + t) * (DV + DK) + DV + dk, xw)
        tl.store(kt_buf + (bh * DK + dk) * CH + t, kn)
        tl.store(g_buf + bh * CH + t, g)
    tl.debug_barrier()


@triton.jit
def _solve_row(x, rows_ptr, cols, l_ptr, t, ROW: tl.constexpr, N: tl.constexpr, NB: tl.constexpr, U: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """Row t of the unit-lower solve in cuBLAS's blocked order, for the N columns `cols` of the
    solved rows (rows_ptr + j * ROW + cols) from its right-hand side x: each earlier block of NB
    rows one chain from zero, subtracted at the block's end (U / NB blocks a trip, in turn), then
    the own block's rows by one FMA each; l_ptr: the system's row t."""
    nblk = t // NB
    for blk0 in range(0, nblk, U // NB):
        for sb in tl.static_range(U // NB):
            blk = blk0 + sb
            live = blk < nblk
            acc = tl.zeros([N], dtype=tl.float32)
            for u in tl.static_range(NB):
                j = blk * NB + u
                lj = tl.load(l_ptr + j, mask=live, other=0.0)
                acc = tl.fma(lj, tl.load(rows_ptr + j * ROW + cols, mask=live, other=0.0), acc)
            x = tl.where(live, sub_rn(x, acc, INTERPRETED), x)
    for u in tl.static_range(NB):
        j = nblk * NB + u
        lj = tl.load(l_ptr + j)
        x = tl.where(j < t, tl.fma(-lj, tl.load(rows_ptr + j * ROW + cols, mask=j < t, other=0.0), x), x)
    return x


@triton.jit
def _solve_rows_merged(xw, xu, rows_ptr, dk, dv, l_ptr, a_ptr, vn_rows, t, ROW: tl.constexpr, DV: tl.constexpr,
                       NB: tl.constexpr, U: tl.constexpr, INTERPRETED: tl.constexpr):
    """_solve_row for w's row (columns DV + dk) and u's (columns dv) in one pass over the rows
    before t, each its own chains in the same order; in the same trips the attention's chain over
    those rows' new values (a_ptr: the attention's row t; vn_rows + j * DV: row j's columns), from
    zero and ascending as the unmerged loop runs it. Returns (xw, xu, that chain's sum). (The own
    block's rows in the earlier blocks' last trip, one round trip fewer at 48 of a chunk's rows,
    measured slower: the trips' doubled code cost more than the trip saved.)"""
    acc_i = tl.zeros(xu.shape, dtype=tl.float32)
    nblk = t // NB
    for blk0 in range(0, nblk, U // NB):
        for sb in tl.static_range(U // NB):
            blk = blk0 + sb
            live = blk < nblk
            aw = tl.zeros(xw.shape, dtype=tl.float32)
            au = tl.zeros(xu.shape, dtype=tl.float32)
            for u in tl.static_range(NB):
                j = blk * NB + u
                lj = tl.load(l_ptr + j, mask=live, other=0.0)
                aw = tl.fma(lj, tl.load(rows_ptr + j * ROW + DV + dk, mask=live, other=0.0), aw)
                au = tl.fma(lj, tl.load(rows_ptr + j * ROW + dv, mask=live, other=0.0), au)
                a_j = tl.load(a_ptr + j, mask=live, other=0.0)
                acc_i = tl.where(live, tl.fma(a_j, tl.load(vn_rows + j * DV, mask=live, other=0.0), acc_i), acc_i)
            xw = tl.where(live, sub_rn(xw, aw, INTERPRETED), xw)
            xu = tl.where(live, sub_rn(xu, au, INTERPRETED), xu)
    for u in tl.static_range(NB):
        j = nblk * NB + u
        lj = tl.load(l_ptr + j)
        xw = tl.where(j < t, tl.fma(-lj, tl.load(rows_ptr + j * ROW + DV + dk, mask=j < t, other=0.0), xw), xw)
        xu = tl.where(j < t, tl.fma(-lj, tl.load(rows_ptr + j * ROW + dv, mask=j < t, other=0.0), xu), xu)
        a_j = tl.load(a_ptr + j)
        acc_i = tl.where(j < t, tl.fma(a_j, tl.load(vn_rows + j * DV, mask=j < t, other=0.0), acc_i), acc_i)
    return xw, xu, acc_i


@triton.jit
def _columns_part(v_ptr, beta_ptr, s_rows, x_buf, vn_buf, scr, b, bh, t, dv, stride_vb, stride_vh,
                  stride_betab, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  CH: tl.constexpr, NB: tl.constexpr, U: tl.constexpr, INTERPRETED: tl.constexpr):
    """A sequence-head's BV value columns dv, after its head part: u's solve, v_new = u - w S_c,
    (q e^gamma) S_c + the attention over the new values (row t's output), row t of u and v_new
    stored. Returns (v_new, the output's fp32 row)."""
    beta = tl.load(beta_ptr + b * stride_betab + bh % HV).to(tl.float32)
    vb = mul_rn(tl.load(v_ptr + b * stride_vb + (bh % HV) * stride_vh + dv).to(tl.float32), beta, INTERPRETED)
    xu = _solve_row(vb, x_buf + bh * CH * (DV + DK), dv, scr + 5 * DK, t, DV + DK, BV, NB, U, INTERPRETED)
    # w S_c and (q e^gamma) S_c: chains over the state's rows
    acc_w2 = tl.zeros([BV], dtype=tl.float32)
    acc_q = tl.zeros([BV], dtype=tl.float32)
    for i0 in range(0, DK, U):
        for u in tl.static_range(U):
            i = i0 + u
            srow = tl.load(s_rows + i * DV)
            acc_w2 = tl.fma(tl.load(scr + 3 * DK + i), srow, acc_w2)
            acc_q = tl.fma(tl.load(scr + 4 * DK + i), srow, acc_q)
    v_new = sub_rn(xu, acc_w2, INTERPRETED)
    # attention over the chunk's new values so far (the terms past t are zeros: left out)
    acc_i = tl.zeros([BV], dtype=tl.float32)
    for j0 in range(0, t + 1, U):
        for u in tl.static_range(U):
            j = j0 + u
            vn = tl.where(j == t, v_new, tl.load(vn_buf + (bh * CH + j) * DV + dv, mask=j < t, other=0.0))
            a_j = tl.load(scr + 5 * DK + CH + j, mask=j <= t, other=0.0)
            acc_i = tl.where(j <= t, tl.fma(a_j, vn, acc_i), acc_i)
    tl.store(vn_buf + (bh * CH + t) * DV + dv, v_new)
    tl.store(x_buf + (bh * CH + t) * (DV + DK) + dv, xu)
    return v_new, add_rn(acc_q, acc_i, INTERPRETED)


@triton.jit
def _close(s_rows, kt_buf, vn_buf, scr, bh, t, dv, v_new, e_t, DK: tl.constexpr, DV: tl.constexpr,
           BV: tl.constexpr, CH: tl.constexpr, RB: tl.constexpr, KB: tl.constexpr, INTERPRETED: tl.constexpr):
    """The chunk's close at its last row t: S_c <- S_c e^gamma_t + (K e^(gamma_t - gamma))^T VN for
    the columns dv (row t's key from the scratch, its new values v_new from registers), RB of the
    state's rows at a time, each block's sums "ieee" tl.dots over KB of the chunk's rows at a time,
    each continuing the last's sums: an ascending FMA chain from zero for every sum, as the
    reference's product. (A loop of one row a trip, a [32, BV] FMA per row, was slower: each row's
    new values moved between layouts through shared memory; docs/PERFORMANCE.md.)"""
    for r0 in range(0, DK, RB):
        rr = r0 + tl.arange(0, RB)
        upd = tl.zeros([RB, BV], dtype=tl.float32)
        for j0 in range(0, CH, KB):
            jj = j0 + tl.arange(0, KB)
            kt = tl.load(kt_buf + (bh * DK + rr)[:, None] * CH + jj[None, :], mask=jj[None, :] < t, other=0.0)
            kt = tl.where(jj[None, :] == t, tl.load(scr + rr)[:, None], kt)
            kd = mul_rn(kt, tl.load(scr + 5 * DK + 2 * CH + jj)[None, :], INTERPRETED)   # e^(gamma_t - gamma_j)
            vn = tl.load(vn_buf + (bh * CH + jj)[:, None] * DV + dv[None, :], mask=jj[:, None] < t, other=0.0)
            vn = tl.where(jj[:, None] == t, v_new[None, :], vn)
            upd = tl.dot(kd, vn, upd, input_precision="ieee")
        s_ptrs = s_rows + rr[:, None] * DV
        tl.store(s_ptrs, add_rn(mul_rn(tl.load(s_ptrs), e_t, INTERPRETED), upd, INTERPRETED))


@triton.jit
def _prefetch_rows(x_buf, vn_buf, bh, cb, t, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                   CH: tl.constexpr, PF: tl.constexpr):
    """The chunk's rows before t (X's, and VN's columns of block cb) asked of cache level PF."""
    live = tl.where(tl.arange(0, CH) < t, tl.arange(0, CH), 0)     # rows at or past t: row 0's lines again
    pdl.prefetch(x_buf + (bh * CH + live)[:, None] * (DV + DK) + tl.arange(0, (DV + DK) // 32)[None, :] * 32, PF)
    pdl.prefetch(vn_buf + (bh * CH + live)[:, None] * DV + cb * BV + tl.arange(0, (BV + 31) // 32)[None, :] * 32, PF)


@triton.jit
def _prefetch_head(s_ptr, kt_buf, g_buf, scr, bh, cb, SCR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BV: tl.constexpr, CH: tl.constexpr, PF: tl.constexpr):
    """The lines a step program reads that no other kernel of the step writes, asked of cache level
    PF: the state's columns of block cb, the head's keys and decays, and the program's scratch (its
    vectors are stored, then read back as scalars: with its lines in L1 a read after the store may
    hit there)."""
    pdl.prefetch(s_ptr + bh * DK * DV + cb * BV + tl.arange(0, DK)[:, None] * DV
                 + tl.arange(0, (BV + 31) // 32)[None, :] * 32, PF)
    pdl.prefetch(kt_buf + (bh * DK + tl.arange(0, DK))[:, None] * CH + tl.arange(0, CH // 32)[None, :] * 32, PF)
    pdl.prefetch(g_buf + bh * CH + tl.arange(0, CH // 32) * 32, PF)
    pdl.prefetch(scr + tl.minimum(tl.arange(0, _LINES_SCR) * 32, SCR - 1), PF)


@triton.jit
def _program_start(pos_ptr, s_ptr, scr_ptr, z_ptr, stride_zb, nw_ptr, kt_buf, x_buf, vn_buf, g_buf, SCR: tl.constexpr,
                   HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CH: tl.constexpr,
                   NORM: tl.constexpr, PF: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """A step program's place (both forms): its sequence-head bh, column block cb, sequence b, row t
    in its chunk, scratch, value columns dv and their state columns, and with NORM the gated norm's
    z and weight for them (else zeros); PDL's wait before its first load (q, k, v, z and the gates
    are the previous kernel's; the positions maybe an earlier one's). PF: a cache level to ask
    first for the lines the program reads (pdl.prefetch): the state's columns, the head's keys and
    decays and the scratch before the wait (no kernel of the step writes them but this one), the
    chunk's rows before t after it; EARLY: the position read, and (L2 only: an L1 line asked for
    before the wait could be one the previous kernel writes, e.g. run_rows' previous step) the
    chunk's rows before t asked for, before the wait too (pdl.EARLY's note: no kernel of the step
    writes the positions)."""
    bh = tl.program_id(0)
    cb = tl.program_id(1)
    b = bh // HV
    if EARLY:
        t = (tl.load(pos_ptr + b) % CH).to(tl.int32)
    if PF != 0:
        _prefetch_head(s_ptr, kt_buf, g_buf, scr_ptr + (bh * (DV // 16) + cb) * SCR, bh, cb, SCR, DK, DV, BV, CH, PF)
        if EARLY and PF == 2:
            _prefetch_rows(x_buf, vn_buf, bh, cb, t, DK, DV, BV, CH, PF)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    if not EARLY:
        t = (tl.load(pos_ptr + b) % CH).to(tl.int32)
    if PF != 0 and not (EARLY and PF == 2):
        _prefetch_rows(x_buf, vn_buf, bh, cb, t, DK, DV, BV, CH, PF)
    dv = cb * BV + tl.arange(0, BV)
    z = tl.zeros([BV], dtype=tl.bfloat16)
    nw = tl.zeros([BV], dtype=tl.bfloat16)
    if NORM:
        z = tl.load(z_ptr + b * stride_zb + (bh % HV) * DV + dv)
        nw = tl.load(nw_ptr + dv)
    return bh, cb, b, t, scr_ptr + (bh * (DV // 16) + cb) * SCR, dv, s_ptr + bh * DK * DV + dv, z, nw


@triton.jit
def _store_out(o_ptr, bh, dv, o, z, nw, inv_n, eps, DV: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr,
               VEC: tl.constexpr, HALVES: tl.constexpr, INTERPRETED: tl.constexpr):
    """Row t's output (fp32 sums) rounded to bf16, with NORM through the gated norm (the program
    holds the whole head: BV = DV), stored."""
    o = o.to(tl.bfloat16)
    if NORM:
        o = tl.reshape(gated_norm_rows(tl.reshape(o, (1, BV)), tl.reshape(z, (1, BV)), tl.reshape(nw, (1, BV)),
                                           inv_n, eps, VEC, HALVES, INTERPRETED), (BV,))
    tl.store(o_ptr + bh * DV + dv, o)


# A verify row's phases as _merged_row runs them, each stamp taken after a barrier (fused_rows'
# stamps; bench gdn-rows): the row's start, the head's rows (norms, decays, the keys' pass), the
# solves, w S_c, the row's end (its stores, and the close at a chunk's last row).
PHASES = ("head_rows", "solve", "w_state", "stores")
_STAMP_SLOTS = tl.constexpr(2 * (len(PHASES) + 1))    # int64 a row: a clock and a timer a stamp


@triton.jit
def _stamp(ptr, i, ON: tl.constexpr):
    """With ON, after a barrier, the multiprocessor's cycle counter and the global timer (ns) into
    ptr[2 i], ptr[2 i + 1] (int64); nothing otherwise."""
    if ON:
        tl.debug_barrier()
        clock = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        timer = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        tl.store(ptr + 2 * i, clock)
        tl.store(ptr + 2 * i + 1, timer)


@triton.jit
def _chain_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pos_ptr, s_ptr, kt_buf, x_buf, vn_buf, g_buf,
                       scr_ptr, o_ptr, stride_qb, stride_qh, stride_vb, stride_vh, stride_gb, stride_betab, scale,
                       z_ptr, stride_zb, nw_ptr, inv_n, eps, end_ptr,
                       SCR: tl.constexpr, HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BV: tl.constexpr, CH: tl.constexpr, NB: tl.constexpr, ORDER: tl.constexpr,
                       TILE: tl.constexpr, LOG_TILE: tl.constexpr, U: tl.constexpr, INTERPRETED: tl.constexpr,
                       RB: tl.constexpr, KB: tl.constexpr, NORM: tl.constexpr, VEC: tl.constexpr,
                       HALVES: tl.constexpr, PF: tl.constexpr = 0, PDL: tl.constexpr = False,
                       EARLY: tl.constexpr = False, ENDS: tl.constexpr = False):
    """fused_step's "fused" program (sequence-head, BV value columns): the head's part in its own
    scratch (the first column block's program writes row t of the head's buffers), then its
    columns; the close at the chunk's last row. ENDS: a sequence at or past end_ptr[b] stores
    zeros only."""
    bh, cb, b, t, scr, dv, s_rows, z, nw = _program_start(pos_ptr, s_ptr, scr_ptr, z_ptr, stride_zb, nw_ptr, kt_buf,
                                                          x_buf, vn_buf, g_buf, SCR, HV, DK, DV, BV, CH, NORM, PF,
                                                          PDL, EARLY)
    live = True                     # without ENDS a constant: the row's code as before, no branch
    if ENDS:
        live = tl.load(pos_ptr + b) < tl.load(end_ptr + b)
    if live:
        _chain_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, kt_buf, x_buf, vn_buf, g_buf, o_ptr, stride_qb, stride_qh,
                   stride_vb, stride_vh, stride_gb, stride_betab, scale, inv_n, eps, bh, cb, b, t, scr, dv, s_rows,
                   z, nw, HV, RATIO, DK, DV, BV, CH, NB, ORDER, TILE, LOG_TILE, U, INTERPRETED, RB, KB, NORM, VEC,
                   HALVES)
    else:
        tl.store(o_ptr + bh * DV + dv, tl.zeros([BV], dtype=tl.bfloat16))


@triton.jit
def _chain_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, kt_buf, x_buf, vn_buf, g_buf, o_ptr, stride_qb, stride_qh,
               stride_vb, stride_vh, stride_gb, stride_betab, scale, inv_n, eps, bh, cb, b, t, scr, dv, s_rows, z, nw,
               HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
               CH: tl.constexpr, NB: tl.constexpr, ORDER: tl.constexpr, TILE: tl.constexpr, LOG_TILE: tl.constexpr,
               U: tl.constexpr, INTERPRETED: tl.constexpr, RB: tl.constexpr, KB: tl.constexpr, NORM: tl.constexpr,
               VEC: tl.constexpr, HALVES: tl.constexpr):
    """The fused program's row t."""
    kn, kb, g, e_t, acc_q = _head_rows(q_ptr, k_ptr, g_ptr, beta_ptr, kt_buf, g_buf, scr, s_rows, b,
                                       (bh % HV) // RATIO, bh, t, stride_qb, stride_qh, stride_gb, stride_betab,
                                       scale, HV, DK, DV, BV, CH, ORDER, TILE, LOG_TILE, U, False, INTERPRETED)
    xw = _solve_row(mul_rn(kb, e_t, INTERPRETED), x_buf + bh * CH * (DV + DK) + DV, tl.arange(0, DK),
                    scr + 5 * DK, t, DV + DK, DK, NB, U, INTERPRETED)
    _write_head_row(x_buf, kt_buf, g_buf, scr, bh, t, xw, kn, g, cb == 0, DK, DV, CH)
    v_new, o = _columns_part(v_ptr, beta_ptr, s_rows, x_buf, vn_buf, scr, b, bh, t, dv, stride_vb, stride_vh,
                             stride_betab, HV, DK, DV, BV, CH, NB, U, INTERPRETED)
    _store_out(o_ptr, bh, dv, o, z, nw, inv_n, eps, DV, BV, NORM, VEC, HALVES, INTERPRETED)
    if t == CH - 1:
        _close(s_rows, kt_buf, vn_buf, scr, bh, t, dv, v_new, e_t, DK, DV, BV, CH, RB, KB, INTERPRETED)


@triton.jit
def _merged_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pos_ptr, s_ptr, kt_buf, x_buf, vn_buf, g_buf,
                        scr_ptr, o_ptr, stride_qb, stride_qh, stride_vb, stride_vh, stride_gb, stride_betab, scale,
                        z_ptr, stride_zb, nw_ptr, inv_n, eps, end_ptr,
                        SCR: tl.constexpr, HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BV: tl.constexpr, CH: tl.constexpr, NB: tl.constexpr, ORDER: tl.constexpr,
                        TILE: tl.constexpr, LOG_TILE: tl.constexpr, U: tl.constexpr, INTERPRETED: tl.constexpr,
                        RB: tl.constexpr, KB: tl.constexpr, NORM: tl.constexpr, VEC: tl.constexpr,
                        HALVES: tl.constexpr, PF: tl.constexpr = 0, PDL: tl.constexpr = False,
                        EARLY: tl.constexpr = False, UK: tl.constexpr = 0, UW: tl.constexpr = 0,
                        QS_LATE: tl.constexpr = False, ENDS: tl.constexpr = False):
    """fused_step's "merged" program: the fused program's chains with fewer passes, each trip's
    loads serving several chains (_merged_row). ENDS: as the fused program's."""
    bh, cb, b, t, scr, dv, s_rows, z, nw = _program_start(pos_ptr, s_ptr, scr_ptr, z_ptr, stride_zb, nw_ptr, kt_buf,
                                                          x_buf, vn_buf, g_buf, SCR, HV, DK, DV, BV, CH, NORM, PF,
                                                          PDL, EARLY)
    live = True                     # as the fused program's
    if ENDS:
        live = tl.load(pos_ptr + b) < tl.load(end_ptr + b)
    if live:
        _merged_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, kt_buf, x_buf, vn_buf, g_buf, o_ptr, stride_qb, stride_qh,
                    stride_vb, stride_vh, stride_gb, stride_betab, scale, inv_n, eps, bh, cb, b, t, scr, dv, s_rows,
                    z, nw, HV, RATIO, DK, DV, BV, CH, NB, ORDER, TILE, LOG_TILE, U, INTERPRETED, RB, KB, NORM, VEC,
                    HALVES, UK, UW, QS_LATE, o_ptr, False)
    else:
        tl.store(o_ptr + bh * DV + dv, tl.zeros([BV], dtype=tl.bfloat16))


@triton.jit
def _merged_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pos_ptr, s_ptr, kt_buf, x_buf, vn_buf, g_buf,
                        scr_ptr, o_ptr, R, stride_qt, stride_qb, stride_qh, stride_vt, stride_vb, stride_vh, stride_gt,
                        stride_gb, stride_betat, stride_betab, stride_ot, scale, stamp_ptr, end_ptr,
                        SCR: tl.constexpr, HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        CH: tl.constexpr, NB: tl.constexpr, ORDER: tl.constexpr,
                        TILE: tl.constexpr, LOG_TILE: tl.constexpr, U: tl.constexpr, INTERPRETED: tl.constexpr,
                        RB: tl.constexpr, KB: tl.constexpr, PF: tl.constexpr = 0, PDL: tl.constexpr = False,
                        UK: tl.constexpr = 0, UW: tl.constexpr = 0, QS_LATE: tl.constexpr = False,
                        STAMP: tl.constexpr = False, ENDS: tl.constexpr = False):
    """fused_rows' program (sequence-head, the whole head's columns): R rows of its sequence in turn,
    row r at the sequence's position + r, each the merged step's row (_merged_row: its chains, so
    its bits), a barrier between rows (row r's chunk rows, and at a close the state, written by
    this program, are row r + 1's reads). STAMP: each row's phase stamps (_stamp) at stamp_ptr +
    (bh R + r) _STAMP_SLOTS. ENDS: the rows at positions from end_ptr[b] on store zeros only."""
    bh = tl.program_id(0)
    b = bh // HV
    dv = tl.arange(0, DV)
    s_rows = s_ptr + bh * DK * DV + dv
    scr = scr_ptr + bh * (DV // 16) * SCR
    if PF != 0:
        _prefetch_head(s_ptr, kt_buf, g_buf, scr, bh, 0, SCR, DK, DV, DV, CH, PF)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    pos = tl.load(pos_ptr + b)
    zeros = tl.zeros([DV], dtype=tl.bfloat16)           # no gated norm here: the caller norms the rows
    n = R
    if ENDS:
        n = tl.minimum(tl.maximum(tl.load(end_ptr + b) - pos, 0), R)
    for r in range(n):
        t = ((pos + r) % CH).to(tl.int32)
        if PF != 0:
            _prefetch_rows(x_buf, vn_buf, bh, 0, t, DK, DV, DV, CH, PF)
        _merged_row(q_ptr + r * stride_qt, k_ptr + r * stride_qt, v_ptr + r * stride_vt, g_ptr + r * stride_gt,
                    beta_ptr + r * stride_betat, kt_buf, x_buf, vn_buf, g_buf, o_ptr + r * stride_ot, stride_qb,
                    stride_qh, stride_vb, stride_vh, stride_gb, stride_betab, scale, 1.0, 1.0, bh, 0, b, t, scr, dv,
                    s_rows, zeros, zeros, HV, RATIO, DK, DV, DV, CH, NB, ORDER, TILE, LOG_TILE, U, INTERPRETED, RB,
                    KB, False, False, False, UK, UW, QS_LATE, stamp_ptr + (bh * R + r) * _STAMP_SLOTS, STAMP)
        tl.debug_barrier()
    if ENDS:
        for r in range(n, R):
            tl.store(o_ptr + r * stride_ot + bh * DV + dv, zeros)


@triton.jit
def _merged_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, kt_buf, x_buf, vn_buf, g_buf, o_ptr, stride_qb, stride_qh,
                stride_vb, stride_vh, stride_gb, stride_betab, scale, inv_n, eps, bh, cb, b, t, scr, dv, s_rows, z, nw,
                HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                CH: tl.constexpr, NB: tl.constexpr, ORDER: tl.constexpr, TILE: tl.constexpr, LOG_TILE: tl.constexpr,
                U: tl.constexpr, INTERPRETED: tl.constexpr, RB: tl.constexpr, KB: tl.constexpr, NORM: tl.constexpr,
                VEC: tl.constexpr, HALVES: tl.constexpr, UK: tl.constexpr, UW: tl.constexpr, QS_LATE: tl.constexpr,
                stamp, STAMP: tl.constexpr):
    """The merged program's row t (both merged kernels): (q e^gamma) S_c in the keys' trips, w's and
    u's solves and the attention over the earlier new values in one pass over the rows before t,
    then w S_c over the state's rows this program just read (cache hits); the close at the chunk's
    last row. MergedPlan's schedules: UK / UW the keys' / w S_c pass's rows a trip (0: U), QS_LATE
    (q e^gamma) S_c in the w S_c pass. STAMP: the phases' stamps at `stamp` (_stamp, PHASES)."""
    UKS: tl.constexpr = U if UK == 0 else UK
    UWS: tl.constexpr = U if UW == 0 else UW
    dk = tl.arange(0, DK)
    _stamp(stamp, 0, STAMP)
    kn, kb, g, e_t, acc_q = _head_rows(q_ptr, k_ptr, g_ptr, beta_ptr, kt_buf, g_buf, scr, s_rows, b,
                                       (bh % HV) // RATIO, bh, t, stride_qb, stride_qh, stride_gb, stride_betab,
                                       scale, HV, DK, DV, BV, CH, ORDER, TILE, LOG_TILE, UKS, not QS_LATE,
                                       INTERPRETED)
    _stamp(stamp, 1, STAMP)
    beta = tl.load(beta_ptr + b * stride_betab + bh % HV).to(tl.float32)
    vb = mul_rn(tl.load(v_ptr + b * stride_vb + (bh % HV) * stride_vh + dv).to(tl.float32), beta, INTERPRETED)
    xw, xu, acc_i = _solve_rows_merged(mul_rn(kb, e_t, INTERPRETED), vb, x_buf + bh * CH * (DV + DK), dk, dv,
                                       scr + 5 * DK, scr + 5 * DK + CH, vn_buf + bh * CH * DV + dv, t, DV + DK, DV,
                                       NB, U, INTERPRETED)
    _write_head_row(x_buf, kt_buf, g_buf, scr, bh, t, xw, kn, g, cb == 0, DK, DV, CH)
    _stamp(stamp, 2, STAMP)
    acc_w2 = tl.zeros([BV], dtype=tl.float32)
    for i0 in range(0, DK, UWS):
        for u in tl.static_range(UWS):
            i = i0 + u
            srow = tl.load(s_rows + i * DV)
            acc_w2 = tl.fma(tl.load(scr + 3 * DK + i), srow, acc_w2)
            if QS_LATE:      # (q e^gamma) S_c's chain here, not in the keys' trips (acc_q from zero there)
                acc_q = tl.fma(tl.load(scr + 4 * DK + i), srow, acc_q)
    v_new = sub_rn(xu, acc_w2, INTERPRETED)
    _stamp(stamp, 3, STAMP)
    acc_i = tl.fma(tl.load(scr + 5 * DK + CH + t), v_new, acc_i)     # the attention's last term: row t itself
    _store_out(o_ptr, bh, dv, add_rn(acc_q, acc_i, INTERPRETED), z, nw, inv_n, eps, DV, BV, NORM, VEC, HALVES,
               INTERPRETED)
    tl.store(vn_buf + (bh * CH + t) * DV + dv, v_new)
    tl.store(x_buf + (bh * CH + t) * (DV + DK) + dv, xu)
    if t == CH - 1:
        _close(s_rows, kt_buf, vn_buf, scr, bh, t, dv, v_new, e_t, DK, DV, BV, CH, RB, KB, INTERPRETED)
    _stamp(stamp, 4, STAMP)
