"""The op sets the models run on: `TorchOps`, the pure-torch references (any device; the CPU
path), and `TritonOps`, the fused Triton kernels and our GEMV (CUDA, or Triton's interpreter).
Both take the same arguments and return the same shapes, so a model family is one piece of code
over either; which set runs is chosen once at load (`ops_for`) and reported, never a silent
fallback (a kernel that fails on the GPU raises).

The torch set computes what the family's reference computes, with its shapes: a packed matrix
(q | k | v, gate | up, a GDN layer's qkv | z | b | a) is multiplied part by part, as the
reference's separate products. The Triton set keeps the reference's cast points and, where a
test says so, its bits (exact decode: the GEMV and attention in the full forward's order at
7-32 rows, fqkernels/gemv.py and decode_attention.py; docs/NUMERICS.md).

Ops, by who calls them (Qwen3: fq_qwen3; Qwen3.5: fq_qwen35):
  products        linear, linear_split, linear_parts, linear_silu_mul, linear_add_rmsnorm (Qwen3),
                  mlp (Qwen3.5), tune (our GEMV or cuBLAS per decode product, measured at warmup)
  norms           embed_rmsnorm, add_rmsnorm (one_plus: Qwen3.5's (1 + w) norms)
  attention       qk_norm_rope_store and decode_attention (Qwen3); qk_norm_rope, gate_mul,
                  gated_attention_qk and gated_decode_attention (Qwen3.5)
  GDN (Qwen3.5)   gdn_gates, causal_conv, chunked_rule (a prompt); gdn_in_proj_step, gdn_rule_step,
                  gdn_exact_step, gdn_chunk_rows (a decode step); gated_rmsnorm (both)
  the pick        argmax, lm_screen
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fq_attention import cached_kv, sdpa_over_prefix
from fqkernels import gdn_exact_step, gdn_ref
from fqkernels.argmax import argmax_reference
from fqkernels.decode_attention import decode_attention_reference
from fqkernels.rmsnorm import rmsnorm_one_plus_reference, rmsnorm_reference
from fqkernels.rope_kv import partial_rope_reference, qk_norm_rope_store_reference
from fqkernels.swiglu import sigmoid_gate_mul_reference

BACKENDS = ("torch", "triton")


@dataclass
class DecodeProduct:
    """A matrix a decode step multiplies by, for the tuner: every layer's copy, and how the step
    calls it ("linear"; "silu_mul": the packed gate | up with SiLU * up fused; "add_rmsnorm": the
    residual add and the next norm fused after it, Qwen3's o and down)."""
    name: str
    weights: list
    kind: str = "linear"

    @property
    def silu(self) -> bool:
        return self.kind == "silu_mul"


def ops_for(backend: str, device: torch.device, exact_decode: bool = True):
    """The op set `backend` names ("auto": triton on a CUDA device, torch elsewhere); triton needs
    CUDA (or TRITON_INTERPRET=1). A name outside BACKENDS is an error naming it."""
    import os

    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of auto, {', '.join(BACKENDS)}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1)")
    return TritonOps(exact_decode) if backend == "triton" else TorchOps(exact_decode)


def _parts(w: torch.Tensor, sizes) -> tuple:
    """The row blocks of a packed matrix (contiguous views: the separate matrices' values)."""
    return torch.split(w, list(sizes))


class TorchOps:
    """The references: each op as the family's reference computes it, on any device, eager (the
    decode ops read lengths and positions on the host, so no graph)."""

    name = "torch"

    def __init__(self, exact_decode: bool = True):
        self.exact_decode = exact_decode
        # a speculative verify's rows: its decode ops choose their launch (GEMV config, attention
        # plan) as the plain step of this many rows does, so each row's sums run in that step's
        # order (fq_spec); None: by their own row count
        self.rows_as = None
        # the weight shapes (N, K) whose one-row product runs on the tensor cores (gemv.select_config's
        # one_row_tensor_cores): the model family chooses (Qwen3: all; docs/PERFORMANCE.md has the trade)
        self.one_row_tensor_cores = frozenset()

    @contextlib.contextmanager
    def planned_as(self, rows: int):
        """Inside: decode ops launched as for a step of `rows` rows (a verify's B * (k + 1) rows
        computed in the B-row step's arithmetic). The references' rows never depend on the count."""
        before, self.rows_as = self.rows_as, rows
        try:
            yield
        finally:
            self.rows_as = before

    # ---- products ----------------------------------------------------------------------
    def copy_rows_where(self, dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
        """dst[:, b] = src[:, b] where mask[b], tensors [G, B, ...] (a verify's state save and rollback)."""
        from fqkernels.rows_copy import copy_rows_where_reference

        copy_rows_where_reference(dst, src, mask)

    def spec_plain_inputs(self, seq, length, tok, pos_len) -> None:
        """A plain step's inputs from speculation's state: tok = each sequence's last token, pos_len
        = (its position, length) as int32 (fqkernels.spec_plain)."""
        from fqkernels.spec_plain import plain_inputs_reference

        plain_inputs_reference(seq, length, tok, pos_len)

    def spec_plain_advance(self, pick, seq, length, limit, packed) -> None:
        """A plain step's pick appended where a sequence has room; packed = (pick, emitted)."""
        from fqkernels.spec_plain import plain_advance_reference

        plain_advance_reference(pick, seq, length, limit, packed)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w.T on x's rows made contiguous, as the reference holds them (the CPU's product of a
        row-strided view, e.g. each sequence's last position, can round differently)."""
        return F.linear(x.contiguous(), w)

    def linear_split(self, x: torch.Tensor, w: torch.Tensor, sizes) -> tuple:
        """The products of the matrices stacked in w (rows `sizes`), one output each. Here part by
        part; the Triton set multiplies the whole pack once (faster, other bits in a prompt)."""
        return tuple(F.linear(x, part) for part in _parts(w, sizes))

    def linear_parts(self, x: torch.Tensor, w: torch.Tensor, sizes) -> tuple:
        """linear_split, with the separate matrices' bits in a prompt on every op set."""
        return self.linear_split(x, w, sizes)

    def linear_silu_mul(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) in BF16, w_gate_up = gate | up (the reference's
        act_fn(gate_proj(x)) * up_proj(x))."""
        gate, up = _parts(w_gate_up, (w_gate_up.shape[0] // 2,) * 2)
        return F.silu(F.linear(x, gate)) * F.linear(x, up)

    def linear_add_rmsnorm(self, a: torch.Tensor, w: torch.Tensor, x: torch.Tensor, norm_w: torch.Tensor,
                           eps: float) -> torch.Tensor:
        """x <- bf16(x + a @ w.T) (the residual stream, in place); returns RMSNorm(x) * norm_w."""
        return self.add_rmsnorm(x, self.linear(a, w), norm_w, eps)

    def mlp(self, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(h)) * up(h)): Qwen3.5's MLP."""
        return self.linear(self.linear_silu_mul(h, gate_up), down)

    def tune(self, products: list, rows: int) -> dict:
        return {}

    # ---- norms -------------------------------------------------------------------------
    def embed_rmsnorm(self, ids: torch.Tensor, table: torch.Tensor, w: torch.Tensor, eps: float,
                      one_plus: bool = False) -> tuple:
        """(x = table[ids], the residual stream's start, and its norm)."""
        x = table[ids]
        return x, self._norm(x, w, eps, one_plus)

    def add_rmsnorm(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                    one_plus: bool = False) -> torch.Tensor:
        """x <- bf16(x + r) in place (the residual stream); returns its norm."""
        x.add_(r)
        return self._norm(x, w, eps, one_plus)

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, one_plus: bool = False) -> torch.Tensor:
        """The norm of rows x [M, N] (x unchanged): add_rmsnorm's of x added to zeros, its bits."""
        return self._norm(x, w, eps, one_plus)

    @staticmethod
    def _norm(x, w, eps, one_plus):
        return rmsnorm_one_plus_reference(x, w, eps) if one_plus else rmsnorm_reference(x, w, eps)

    # ---- Qwen3 attention ---------------------------------------------------------------
    def qk_norm_rope_store(self, *args, **kwargs) -> torch.Tensor:
        return qk_norm_rope_store_reference(*args, **kwargs)

    def decode_attention(self, q, k_cache, v_cache, lengths, scale, window=None, block_table=None):
        return decode_attention_reference(q, k_cache, v_cache, lengths, scale, window=window,
                                          block_table=block_table)

    # ---- Qwen3.5 gated attention --------------------------------------------------------
    def qk_norm_rope(self, q, k, q_norm, k_norm, eps, cos, sin) -> tuple:
        """A prompt's queries and keys, q [B, T, H, D] and k [B, T, KVH, D] (views of the packed
        product), after their (1 + w) norms and the partial RoPE at cos, sin [1 or B, T, R]:
        (q [B, H, T, D], k [B, KVH, T, D])."""
        q = rmsnorm_one_plus_reference(q, q_norm, eps).transpose(1, 2)
        k = rmsnorm_one_plus_reference(k, k_norm, eps).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return partial_rope_reference(q, cos, sin), partial_rope_reference(k, cos, sin)

    def gate_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate), x and gate [B, T, H, D] -> [B, T, H * D]."""
        return sigmoid_gate_mul_reference(x, gate)

    def gated_attention_qk(self, h, w_qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, eps, heads,
                           kv_heads, block_table=None) -> tuple:
        """A decode step's attention prologue: the packed q | k | v product of h [B, 1, hidden], the
        (1 + w) norms and partial RoPE at `positions` (cos, sin: the [length, R] tables), the keys
        and values into the caches (one layer's rows [B, KVH, C, D], or its page pools with
        block_table). Returns (q [B, H, 1, D], gate [B, 1, H, D])."""
        B, D = h.shape[0], k_cache.shape[-1]
        qp, k, v = self.linear_parts(h, w_qkv, (2 * heads * D, kv_heads * D, kv_heads * D))
        q, gate = torch.chunk(qp.view(B, 1, -1, 2 * D), 2, dim=-1)       # per head [query | gate]
        k = k.view(B, 1, -1, D)
        v = v.view(B, 1, -1, D).transpose(1, 2)
        pos = positions.long()
        q, k = self.qk_norm_rope(q, k, q_norm, k_norm, eps, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
        rows = torch.arange(B, device=h.device)
        if block_table is not None:
            page = k_cache.shape[2]
            pages = block_table[:B].long()[rows, pos // page]
            k_cache[pages, :, pos % page] = k[:, :, 0]
            v_cache[pages, :, pos % page] = v[:, :, 0]
        else:
            k_cache[rows, :, pos] = k[:, :, 0]
            v_cache[rows, :, pos] = v[:, :, 0]
        return q, gate

    def gated_decode_attention(self, q, gate, k_cache, v_cache, lengths, scale, block_table=None) -> torch.Tensor:
        """attn * sigmoid(gate) of one query a sequence (q [B, H, 1, D] from gated_attention_qk)
        over its cached prefix: [B, 1, H * D]. SDPA with the K/V heads shared, as 5.17's step."""
        B = q.shape[0]
        if block_table is not None:
            k_cache, v_cache = cached_kv(k_cache, v_cache, block_table, slice(0, B),
                                         block_table.shape[1] * k_cache.shape[2])
        attn = sdpa_over_prefix(q, k_cache, v_cache, lengths, scale)
        return self.gate_mul(attn.transpose(1, 2), gate)

    # ---- GDN (Qwen3.5) --------------------------------------------------------------------
    def gdn_gates(self, a, b, a_log, dt_bias) -> tuple:
        """(g fp32, beta bf16) of a prompt's a, b [B, T, Hv]."""
        return gdn_ref.gates_reference(a, b, a_log, dt_bias)

    def causal_conv(self, u, conv_w, conv_state=None) -> tuple:
        """A prompt's causal conv + SiLU over u [B, T, C] (from conv_state [B, C, W] where given):
        (x [B, T, C], the new conv state)."""
        x, state = gdn_ref.causal_conv_reference(u.transpose(1, 2), conv_w, conv_state)
        return x.transpose(1, 2), state

    def chunked_rule(self, q, k, v, g, beta, state_out=None, initial_state=None, capture=None) -> tuple:
        """The gated delta rule over a prompt (fqkernels/gdn_prefill.chunked_prefill's contract)."""
        return gdn_ref.chunked_prefill_reference(q, k, v, g, beta, state_out=state_out, initial_state=initial_state,
                                         capture=capture)

    def gdn_in_proj_step(self, h, w_in, sizes, conv_state, conv_w, a_log, dt_bias) -> tuple:
        """A decode step's in_proj (h [B, 1, hidden]; w_in = qkv | z | b | a, rows `sizes`), the conv
        over conv_state [B, C, W] (shifted in place) and the gates: (x [B, C], z [B, Hv Dv],
        g [B, Hv] fp32, beta [B, Hv])."""
        mixed, z, b, a = self.linear_split(h, w_in, sizes)
        x, g, beta = self.gdn_conv_gates_step(mixed[:, 0], conv_state, conv_w, a[:, 0], b[:, 0], a_log, dt_bias)
        return x, z[:, 0], g, beta

    def gdn_conv_gates_step(self, mixed, conv_state, conv_w, a, b, a_log, dt_bias) -> tuple:
        """gdn_in_proj_step after its product: in_proj's qkv columns mixed [B, C] through the conv
        (conv_state shifted in place), a and b [B, Hv] through the gates: (x [B, C], g, beta)."""
        g, beta = gdn_ref.gates_reference(a[:, None], b[:, None], a_log, dt_bias)
        x, state = gdn_ref.causal_conv_reference(mixed[:, None].transpose(1, 2), conv_w, conv_state)
        conv_state.copy_(state)
        return x.transpose(1, 2)[:, 0], g[:, 0], beta[:, 0]

    def gdn_conv_gates_rows(self, mixed, conv_state, conv_w, a, b, a_log, dt_bias, states) -> tuple:
        """gdn_conv_gates_step over T rows of each sequence in turn (mixed [B, T, C], a and b [B, T, Hv]),
        the conv state after row t into states[t] ([T, B, C, W]): (x [T, B, C], g, beta [T, B, Hv])."""
        out = []
        for t in range(mixed.shape[1]):
            out.append(self.gdn_conv_gates_step(mixed[:, t], conv_state, conv_w, a[:, t], b[:, t], a_log, dt_bias))
            states[t].copy_(conv_state)
        return tuple(torch.stack(parts) for parts in zip(*out))

    def gdn_rule_step(self, q, k, v, g, beta, state) -> torch.Tensor:
        """The rule's recurrent step (q, k [B, Hk, Dk], v [B, Hv, Dv]; state updated in place)."""
        return gdn_ref.decode_step_reference(q, k, v, g, beta, state)

    def gdn_exact_step(self, q, k, v, g, beta, positions, state, rows, tile=None, norm=None) -> tuple:
        """Exact decode's step (the full forward's row: fqkernels/gdn_exact_step): (o, whether
        `norm` = (z, weight, eps), the gated norm, was applied too; never here)."""
        return gdn_exact_step.reference_step(q, k, v, g, beta, positions, state, rows), False

    def gdn_exact_rows(self, q, k, v, g, beta, positions, state, rows, tile=None, ends=None) -> torch.Tensor:
        """gdn_exact_step over T rows of each sequence in turn, no gated norm (a verify's rows: q, k
        [T, B, Hk, Dk], v [T, B, Hv, Dv], g, beta [T, B, Hv], row r at positions + r) -> [T, B, Hv, Dv].
        ends: None, or int32 [B]: a row at a position from ends[b] on is not run (zeros, nothing
        written)."""
        return torch.stack([gdn_exact_step.reference_step(q[r], k[r], v[r], g[r], beta[r], positions + r, state,
                                                          rows, ends=ends) for r in range(v.shape[0])])

    def gdn_chunk_rows(self, layers: int, batch: int, Hk: int, Hv: int, Dk: int, Dv: int, device) -> list:
        """Exact decode's chunk rows of `batch` sequences for each of `layers` GDN layers."""
        return [gdn_exact_step.ReferenceRows(batch, Hk, Hv, Dk, Dv, device) for _ in range(layers)]

    def gdn_rows_head(self, rows: list, batch: int, n: int) -> list:
        """A verify's save of sequences [0, batch)'s first n chunk rows in every GDN layer (a verify
        past a chunk's end writes the next chunk's rows there): gdn_exact_step.rows_head."""
        return gdn_exact_step.rows_head(rows, batch, n)

    def gdn_rows_put_head_where(self, rows: list, batch: int, saved: list, mask: torch.Tensor) -> None:
        """gdn_rows_head's rows back where mask [batch] is set."""
        gdn_exact_step.rows_put_head_where(rows, batch, saved, mask)

    def gdn_rows_bytes(self, Hk: int, Hv: int, Dk: int, Dv: int) -> int:
        """Bytes of one sequence's chunk rows in one GDN layer."""
        return gdn_exact_step.ReferenceRows.row_bytes(Hk, Hv, Dk, Dv)

    def gated_rmsnorm(self, o, z, w, eps) -> torch.Tensor:
        """The gated norm of o [..., Dv] rows with z (the same rows' gates, [R, Hv Dv] or [R Hv, Dv])."""
        Dv = w.shape[0]
        return gdn_ref.gated_rmsnorm_reference(o.reshape(-1, Dv), z.reshape(-1, Dv), w, eps)

    # ---- the pick ----------------------------------------------------------------------
    def argmax(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return argmax_reference(x, out=out)

    def lm_screen(self, w: torch.Tensor):
        """The one-sequence decode pick screened through an int8 copy of the LM head
        (fqkernels/lm_screen), or None where this op set has none."""
        return None


class TritonOps(TorchOps):
    """Fused Triton kernels around the products; decode products (few rows) through our split-K
    GEMV or cuBLAS, whichever `tune` measured faster for that (rows, matrix) on this GPU, or the
    GEMV at exact decode's rows (its sums in the full forward's order); prompt products through
    cuBLAS. The decode ops read nothing on the host, so the engine captures a step as a CUDA graph."""

    name = "triton"
    GEMV_MAX_ROWS = 64
    # Qwen3.5's prompt MLP runs over row slices of at most this many tokens: rows are independent,
    # so slices bound gate | up's activations (2 x 9,216 x 2 B a token on the 4B) at any prompt size.
    MLP_ROWS = 8192

    def __init__(self, exact_decode: bool = True):
        super().__init__(exact_decode)
        from fqkernels import gemv

        self._gemv = gemv
        self.use_gemv = {}  # (fused SiLU, rows, N, K) -> bool, filled by tune()

    # ---- products ----------------------------------------------------------------------
    def _on_gemv(self, silu: bool, rows: int, w: torch.Tensor) -> bool:
        return bool(self.use_gemv.get((silu, rows) + tuple(w.shape)))

    def gemv_config(self, rows: int, w: torch.Tensor, silu: bool = False):
        """Our GEMV's config for w at `rows` rows (rows_as where set) where the products run it,
        else None (cuBLAS). A verify's rows (more than rows_as) share the weight loads where the
        config allows it without changing a row's bits (gemv.shared_rows)."""
        planned = self.rows_as or rows
        if not self._on_gemv(silu, planned, w):
            return None
        config = self._gemv.select_config(w.shape[0], w.shape[1], silu, planned, exact=self.exact_decode,
                                          one_row_tensor_cores=tuple(w.shape) in self.one_row_tensor_cores)
        return self._gemv.shared_rows(config, rows, silu, n=w.shape[0]) if rows > planned else config

    def copy_rows_where(self, dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
        """Only the selected rows read and written (fqkernels.rows_copy)."""
        from fqkernels.rows_copy import copy_rows_where

        copy_rows_where(dst, src, mask)

    def spec_plain_inputs(self, seq, length, tok, pos_len) -> None:
        """One launch (fqkernels.spec_plain)."""
        from fqkernels.spec_plain import plain_inputs

        plain_inputs(seq, length, tok, pos_len)

    def spec_plain_advance(self, pick, seq, length, limit, packed) -> None:
        """One launch (fqkernels.spec_plain)."""
        from fqkernels.spec_plain import plain_advance

        plain_advance(pick, seq, length, limit, packed)

    def force_gemv(self, products: list, rows: int) -> None:
        """Every product in `products` on our GEMV at `rows` rows (what tune picks where it is faster;
        the kernels' tests run every product kind through it)."""
        for product in products:
            for w in product.weights:
                self.use_gemv[(product.silu, rows) + tuple(w.shape)] = True

    def _as_step(self, x: torch.Tensor, product) -> torch.Tensor:
        """product (cuBLAS over [M, K] rows) over x [R, K]; inside planned_as(B), a verify's B T rows
        (T a sequence, sequence-major) go as the B-row step calls it: each of its T row groups, one
        row a sequence, in a call of B rows (cuBLAS picks its kernel by the row count, so only then
        do the rows keep the step's bits; the GEMV's rows keep them in any tile)."""
        B, R = self.rows_as, x.shape[0]
        if not B or R <= B or R % B:
            return product(x)
        rows = x.view(B, R // B, -1)
        return torch.stack([product(rows[:, j].contiguous()) for j in range(R // B)], dim=1).reshape(R, -1)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        config = self.gemv_config(rows, w)
        if config is not None:
            out = self._gemv.linear(x.reshape(rows, -1).contiguous(), w, config=config)
            return out.view(*x.shape[:-1], w.shape[0])
        if self.rows_as:
            return self._as_step(x.reshape(rows, -1), lambda a: F.linear(a, w)).view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)

    def linear_split(self, x: torch.Tensor, w: torch.Tensor, sizes) -> tuple:
        return torch.split(self.linear(x, w), list(sizes), dim=-1)

    def linear_parts(self, x: torch.Tensor, w: torch.Tensor, sizes) -> tuple:
        """A decode-sized call (at most GEMV_MAX_ROWS rows) is one product of the pack, its columns
        split (views); a prompt's runs cuBLAS on the pack's row slices, the separate products'
        shapes, so their bits."""
        if (self.rows_as or x.numel() // x.shape[-1]) <= self.GEMV_MAX_ROWS:
            return self.linear_split(x, w, sizes)
        return tuple(F.linear(x, part) for part in _parts(w, sizes))

    def linear_silu_mul(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        config = self.gemv_config(rows, w_gate_up, silu=True)
        if config is not None:
            out = self._gemv.linear_silu_mul(x.reshape(rows, -1).contiguous(), w_gate_up, config=config)
        else:
            from fqkernels.swiglu import silu_mul

            out = self._as_step(x.reshape(rows, -1), lambda a: silu_mul(F.linear(a, w_gate_up)))
        return out.view(*x.shape[:-1], w_gate_up.shape[0] // 2)

    def linear_add_rmsnorm(self, a: torch.Tensor, w: torch.Tensor, x: torch.Tensor, norm_w: torch.Tensor,
                           eps: float) -> torch.Tensor:
        """With our GEMV: its fp32 split-K partials go straight into the residual-add + RMSNorm
        kernel, which finishes the product (the same bits as GEMV + reduce + add)."""
        from fqkernels.rmsnorm import add_rmsnorm_partials

        config = self.gemv_config(a.shape[0], w)
        if config is not None:
            return add_rmsnorm_partials(x, self._gemv.linear_partials(a.contiguous(), w, config=config), norm_w, eps)
        return self.add_rmsnorm(x, self._as_step(a, lambda t: F.linear(t, w)), norm_w, eps)

    def mlp(self, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        rows = h.reshape(-1, h.shape[-1])
        if rows.shape[0] <= self.MLP_ROWS:
            return self.linear(self.linear_silu_mul(h, gate_up), down)
        # each slice's products are cuBLAS's at its row count
        out = torch.empty((rows.shape[0], down.shape[0]), dtype=h.dtype, device=h.device)
        for r0 in range(0, rows.shape[0], self.MLP_ROWS):
            out[r0:r0 + self.MLP_ROWS] = self.linear(self.linear_silu_mul(rows[r0:r0 + self.MLP_ROWS], gate_up), down)
        return out.view(*h.shape[:-1], down.shape[0])

    def tune(self, products: list, rows: int, reps: int = 5) -> dict:
        """For a decode batch of `rows`, time cuBLAS against our GEMV on every decode product, each
        as the step calls it (with what it fuses around the product), over all layers' copies in
        one CUDA graph so the weights stream from HBM as in a real step and launch costs are the
        graph's, and keep the faster above gemv.EXACT_TO_ROWS rows; up to it the GEMV whatever the
        times (exact decode's in-order sums; a verify's rows share its tiles).
        Returns {product: (cuBLAS us, GEMV us)}, or the GEMV's error where it cannot run here (the
        product then stays on cuBLAS)."""
        from fqkernels.rmsnorm import add_rmsnorm, add_rmsnorm_partials
        from fqkernels.swiglu import silu_mul

        if rows > self.GEMV_MAX_ROWS:
            return {}
        gemv = self._gemv
        report = {}
        for product in products:
            ws = product.weights
            N, K = ws[0].shape
            dev = ws[0].device
            x = torch.randn(rows, K, device=dev).to(torch.bfloat16)
            config = gemv.select_config(N, K, product.silu, rows, exact=self.exact_decode,
                                        one_row_tensor_cores=(N, K) in self.one_row_tensor_cores)
            if product.kind == "silu_mul":
                ours = lambda w: gemv.linear_silu_mul(x, w, config=config)     # noqa: E731
                theirs = lambda w: silu_mul(F.linear(x, w))                     # noqa: E731
            elif product.kind == "add_rmsnorm":
                res = torch.randn(rows, N, device=dev).to(torch.bfloat16)
                norm_w = torch.ones(N, dtype=torch.bfloat16, device=dev)
                ours = lambda w: add_rmsnorm_partials(res, gemv.linear_partials(x, w, config=config), norm_w, 1e-6)  # noqa: E731
                theirs = lambda w: add_rmsnorm(res, F.linear(x, w), norm_w, 1e-6)  # noqa: E731
            else:
                ours = lambda w: gemv.linear(x, w, config=config)              # noqa: E731
                theirs = lambda w: F.linear(x, w)                               # noqa: E731
            key = (product.silu, rows, N, K)
            t_theirs = _time_over(theirs, ws, reps)
            try:
                t_ours = _time_over(ours, ws, reps)
            except Exception as exc:  # noqa: BLE001 - a GEMV that cannot run here stays on cuBLAS, said in the report
                report[product.name] = (round(t_theirs, 2), f"gemv failed: {type(exc).__name__}: {exc}"[:200])
                self.use_gemv[key] = False
                continue
            # Up to EXACT_TO_ROWS rows our GEMV whatever the times: exact decode's sums (7-32 rows), and
            # a speculative verify planned at these rows shares its tiles (on cuBLAS, whose bits change
            # with the row count, it runs as T calls of the step's rows: _as_step). Where cuBLAS was
            # faster at these rows it was by at most ~4% on one product (docs/PERFORMANCE.md).
            self.use_gemv[key] = rows <= gemv.EXACT_TO_ROWS or t_ours < t_theirs
            report[product.name] = (round(t_theirs, 2), round(t_ours, 2))
        return report

    # ---- norms -------------------------------------------------------------------------
    def embed_rmsnorm(self, ids, table, w, eps, one_plus: bool = False) -> tuple:
        from fqkernels.rmsnorm import embed_rmsnorm

        return embed_rmsnorm(ids, table, w, eps, one_plus=one_plus)

    def add_rmsnorm(self, x, r, w, eps, one_plus: bool = False) -> torch.Tensor:
        from fqkernels.rmsnorm import add_rmsnorm

        return add_rmsnorm(x, r, w, eps, one_plus=one_plus)

    def rmsnorm(self, x, w, eps, one_plus: bool = False) -> torch.Tensor:
        from fqkernels.rmsnorm import rmsnorm

        return rmsnorm(x, w, eps, one_plus=one_plus)

    # ---- Qwen3 attention ---------------------------------------------------------------
    def qk_norm_rope_store(self, *args, **kwargs) -> torch.Tensor:
        from fqkernels.rope_kv import qk_norm_rope_store

        return qk_norm_rope_store(*args, **kwargs)

    def decode_attention(self, q, k_cache, v_cache, lengths, scale, window=None, block_table=None):
        """The decode attention kernel; with exact decode its one-split launches run flash
        attention's arithmetic (fqkernels/decode_attention.py, fa2)."""
        from fqkernels.decode_attention import decode_attention

        return decode_attention(q, k_cache, v_cache, lengths, scale, window=window, fa2=self.exact_decode,
                                **self._attention_launch(q, k_cache, block_table))

    def _attention_launch(self, q, k_cache, block_table) -> dict:
        """The decode attention's keyword arguments: the page table, and inside planned_as the plan
        (its split count) of the plain step of rows_as rows, so a verify row sums its keys in the
        order that step would (the default plan follows the row count)."""
        launch = {} if block_table is None else {"block_table": block_table}
        if self.rows_as is not None:
            from fqkernels.decode_attention import decode_attention_plan

            capacity = k_cache.shape[2] * (block_table.shape[1] if block_table is not None else 1)
            launch["plan"] = decode_attention_plan(self.rows_as, q.shape[1], k_cache.shape[1], capacity, q.shape[2],
                                                   fa2=self.exact_decode)
        return launch

    # ---- Qwen3.5 gated attention --------------------------------------------------------
    def qk_norm_rope(self, q, k, q_norm, k_norm, eps, cos, sin) -> tuple:
        """Each head's (1 + w) norm one kernel row, read in place (q: the first D of each 2D), then
        the partial RoPE."""
        from fqkernels.rmsnorm import rmsnorm
        from fqkernels.rope_kv import partial_rope

        B, T, _, D = q.shape
        q = rmsnorm(q.reshape(B * T, -1, D), q_norm, eps, one_plus=True)
        k = rmsnorm(k.reshape(B * T, -1, D), k_norm, eps, one_plus=True)
        cs, sn = (t.expand(B, T, -1).reshape(B * T, -1) for t in (cos, sin))
        q, k = partial_rope(q, cs, sn), partial_rope(k, cs, sn)
        return q.view(B, T, -1, D).transpose(1, 2), k.view(B, T, -1, D).transpose(1, 2)

    def gate_mul(self, x, gate) -> torch.Tensor:
        from fqkernels.swiglu import sigmoid_gate_mul

        return sigmoid_gate_mul(x, gate)

    def gated_attention_qk(self, h, w_qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, eps, heads,
                           kv_heads, block_table=None) -> tuple:
        """The packed product, then one kernel: each q and k head's (1 + w) norm and partial RoPE, the
        key and value into the caches at the positions. Past GEMV_MAX_ROWS rows (linear_parts' separate
        products), or where this torch's order of the norm's mean is not the fused kernel's, the
        separate kernels. Returns (q [B, H, D], gate [B, 1, H, D])."""
        from fqkernels.rmsnorm import rmsnorm
        from fqkernels.rope_kv import partial_rope, qk_norm_partial_rope_store, rope_store_kv

        B, D = h.shape[0], k_cache.shape[-1]
        table = {} if block_table is None else {"block_table": block_table}
        sizes = (2 * heads * D, kv_heads * D, kv_heads * D)
        if (self.rows_as or B) <= self.GEMV_MAX_ROWS:     # a verify's rows take its step's kernels
            y = self.linear(h, w_qkv).view(B, -1)
            q = qk_norm_partial_rope_store(y, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, eps, heads,
                                           kv_heads, **table)
            if q is not None:
                return q, y[:, :2 * heads * D].view(B, 1, heads, 2 * D)[..., D:]
        qp, k, v = self.linear_parts(h, w_qkv, sizes)
        q, gate = torch.chunk(qp.view(B, 1, -1, 2 * D), 2, dim=-1)
        q = partial_rope(rmsnorm(q.reshape(B, -1, D), q_norm, eps, one_plus=True), cos, sin, positions=positions)
        k = rmsnorm(k.reshape(B, -1, D), k_norm, eps, one_plus=True)
        rope_store_kv(k, v.view(B, -1, D), cos, sin, positions, k_cache, v_cache, **table)
        return q, gate

    def gated_decode_attention(self, q, gate, k_cache, v_cache, lengths, scale, block_table=None) -> torch.Tensor:
        """The decode attention kernel with the output gate in its merge of the splits (one kernel
        a layer fewer; the same bits): [B, 1, H * D]."""
        from fqkernels.decode_attention import decode_attention

        attn = decode_attention(q, k_cache, v_cache, lengths, scale, gate=gate[:, 0], fa2=self.exact_decode,
                                **self._attention_launch(q, k_cache, block_table))
        return attn.view(q.shape[0], 1, -1)

    # ---- GDN (Qwen3.5) --------------------------------------------------------------------
    def gdn_gates(self, a, b, a_log, dt_bias) -> tuple:
        from fqkernels.gdn_prefill import gates

        return gates(a, b, a_log, dt_bias)

    def causal_conv(self, u, conv_w, conv_state=None) -> tuple:
        from fqkernels.gdn_prefill import causal_conv_prefill

        return causal_conv_prefill(u, conv_w, conv_state=conv_state)

    def chunked_rule(self, q, k, v, g, beta, state_out=None, initial_state=None, capture=None) -> tuple:
        from fqkernels.gdn_prefill import chunked_prefill

        return chunked_prefill(q, k, v, g, beta, state_out=state_out, initial_state=initial_state, capture=capture)

    def gdn_in_proj_step(self, h, w_in, sizes, conv_state, conv_w, a_log, dt_bias) -> tuple:
        """At one row where the GEMV runs in_proj, the conv and gates in its epilogue (one kernel, the
        same bits as the product then conv_gates_step); elsewhere (cuBLAS runs it, more rows) the
        product, then conv_gates_step."""
        from fqkernels import gdn_step

        B = h.shape[0]
        config = self.gemv_config(1, w_in) if B == 1 else None
        if config is not None and config.split_k == 1:
            x, z, beta, g = gdn_step.in_proj_conv_gates_step(h[:, 0].contiguous(), w_in, conv_state, conv_w, a_log,
                                                             dt_bias, sizes[1], config)
            return x, z, g, beta
        mixed, z, b, a = self.linear_split(h[:, 0], w_in, sizes)    # column slices of one product
        x, g, beta = self.gdn_conv_gates_step(mixed, conv_state, conv_w, a, b, a_log, dt_bias)
        return x, z, g, beta

    def gdn_conv_gates_step(self, mixed, conv_state, conv_w, a, b, a_log, dt_bias) -> tuple:
        from fqkernels import gdn_step

        return gdn_step.conv_gates_step(mixed, conv_state, conv_w, a, b, a_log, dt_bias)

    def gdn_conv_gates_rows(self, mixed, conv_state, conv_w, a, b, a_log, dt_bias, states) -> tuple:
        """One kernel for the T rows (gdn_step.conv_gates_rows: each row the one-row kernel's bits),
        where the conv has its window of 4."""
        from fqkernels import gdn_step

        if conv_w.shape[1] != 4:
            return super().gdn_conv_gates_rows(mixed, conv_state, conv_w, a, b, a_log, dt_bias, states)
        return gdn_step.conv_gates_rows(mixed, conv_state, conv_w, a, b, a_log, dt_bias, states)

    def gdn_rule_step(self, q, k, v, g, beta, state) -> torch.Tensor:
        from fqkernels.gdn_step import decode_step

        return decode_step(q, k, v, g, beta, state)

    def gdn_exact_step(self, q, k, v, g, beta, positions, state, rows, tile=None, norm=None) -> tuple:
        """fused_step; the gated norm in its own program where a program holds a whole head and the
        grid takes the fused form (gdn_exact_step.norm_in_step; the gated norm kernel's bits)."""
        B, Hv, Dv = v.shape
        step_norm = (norm is not None and Dv == rows.block_v == 128
                     and gdn_exact_step.norm_in_step(B, Hv, 128, 128, v.device))
        o = gdn_exact_step.fused_step(q, k, v, g, beta, positions, state, rows, tile=tile,
                                      norm=norm if step_norm else None)
        return o, step_norm

    def gdn_exact_rows(self, q, k, v, g, beta, positions, state, rows, tile=None, ends=None) -> torch.Tensor:
        """gdn_exact_step.fused_rows: the T rows in one launch where the grid takes the merged form
        (each program runs its head's rows in turn: the steps' bits), else a fused_step launch a row."""
        return gdn_exact_step.fused_rows(q, k, v, g, beta, positions, state, rows, tile=tile or gdn_exact_step.C // 2,
                                         ends=ends)

    def gdn_chunk_rows(self, layers: int, batch: int, Hk: int, Hv: int, Dk: int, Dv: int, device) -> list:
        """The kernel's form: the layers' rows views of one buffer a kind (a verify saves them in one
        copy a kind), one scratch shared by the layers' steps (only used within a launch)."""
        return gdn_exact_step.ChunkRows.stacked(layers, batch, Hv, Dk, Dv, device)

    def gdn_rows_bytes(self, Hk: int, Hv: int, Dk: int, Dv: int) -> int:
        return gdn_exact_step.ChunkRows.row_bytes(Hv, Dk, Dv)

    def gated_rmsnorm(self, o, z, w, eps) -> torch.Tensor:
        """The kernel for heads of 128 (z's heads read in place), the reference otherwise."""
        from fqkernels.gdn_norm import gated_rmsnorm

        if w.shape[0] != 128:
            return super().gated_rmsnorm(o, z, w, eps)
        return gated_rmsnorm(o.reshape(-1, 128), z, w, eps)

    # ---- the pick ----------------------------------------------------------------------
    def argmax(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """torch.argmax's picks bit for bit, in two small kernels."""
        from fqkernels.argmax import argmax

        return argmax(x, out=out)

    def lm_screen(self, w: torch.Tensor):
        if w.device.type != "cuda":
            return None
        from fqkernels import lm_screen

        return lm_screen.for_model(w)


def _time_over(fn, weights, reps: int) -> float:
    """Median GPU microseconds per call of fn(w), cycling through `weights`,
    measured on CUDA-graph replays: the decode step runs as a graph, so the
    host's launch cost (far higher for a Triton launch than for cuBLAS) must
    not count here."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):  # compile, pick kernels, allocate workspaces: outside the capture
        for w in weights[:2]:
            fn(w)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()  # first replay uploads the graph
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    del graph
    return sorted(times)[len(times) // 2]
