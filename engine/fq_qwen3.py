"""Qwen3 forward passes over a static KV cache: prefill for a fresh prompt and
one decode step, written once over an op set (Triton kernels on a GPU, their
torch references on the CPU).

A sliding window (config.sliding_window) applies in every layer, as in the
reference: query position p attends to keys p - window < j <= p (fq_config).

Cast points are the reference's (see fqkernels/*): BF16 residual stream and
products, RMSNorm normalized value rounded to BF16 before the weight, SiLU
rounded before the multiply by up, RoPE products rounded before their sum,
logits in BF16, argmax ties to the lowest index and NaN first (torch.argmax's rules).
"""
import torch

from fq_attention import ROPE_GRANULE, cached_kv, prefill_attention, prefix_attention, rows_of, write_pages
from fq_config import Qwen3Config
from fq_ops import DecodeProduct
from fq_weights import ModelWeights
from fqkernels.rope_kv import rope_tables

# Prompts are prefilled in groups of whole sequences of at most this many
# tokens: bounds the activations (gate/up alone is 2 x intermediate x 2 B a
# token) without changing any result, since sequences are independent.
PREFILL_TOKENS = 16384
# A group larger than that (one prompt longer than PREFILL_TOKENS) runs its MLP
# over row slices of at most this many tokens: the gate/up activations (the
# largest, 2 x intermediate x 2 B a token) stay bounded at any prompt length.
MLP_ROWS = PREFILL_TOKENS


class Qwen3Model:
    # A cached prompt prefix is all a later prompt needs from it (its K/V): paged slots may share
    # its pages (fq_slots).
    prefix_sharing = True

    def __init__(self, cfg: Qwen3Config, weights: ModelWeights, device: torch.device, ops):
        self.cfg = cfg
        self.w = weights
        self.device = device
        self.ops = ops
        self.scale = cfg.head_dim ** -0.5
        self.cos = self.sin = None
        self.k_cache = self.v_cache = None
        # Paged form (allocate_paged_cache): the caches are pools of pages, [L, P, KVH, page, D],
        # and row b's position p sits in page block_table[b, p // page]; None: rows of positions.
        self.block_table = None
        # one sequence's decode pick without the whole LM head (fqkernels/lm_screen: the same pick)
        self.screen = ops.lm_screen(weights.lm_head)
        # One sequence's products on the tensor cores: a speculative verify's rows then cost about
        # one step and keep its bits, for ~2% on a plain step (docs/PERFORMANCE.md).
        ops.one_row_tensor_cores = frozenset(tuple(p.weights[0].shape) for p in self.decode_products())

    def decode_products(self) -> list:
        """The decode step's matrices, for the op set's tuner (fq_ops.DecodeProduct)."""
        layers = self.w.layers
        return [DecodeProduct("qkv", [l.qkv for l in layers]),
                DecodeProduct("o", [l.o for l in layers], "add_rmsnorm"),
                DecodeProduct("gate_up", [l.gate_up for l in layers], "silu_mul"),
                DecodeProduct("down", [l.down for l in layers], "add_rmsnorm"),
                DecodeProduct("lm_head", [self.w.lm_head])]

    # ---- buffers -----------------------------------------------------------------
    def ensure_rope(self, length: int) -> bool:
        """cos/sin tables covering positions [0, length). True when the tables
        were rebuilt (a captured graph still points at the old ones)."""
        if self.cos is not None and self.cos.shape[0] >= length:
            return False
        n = -(-length // ROPE_GRANULE) * ROPE_GRANULE
        self.cos, self.sin = rope_tables(self.cfg.head_dim, self.cfg.rope_theta, n, self.device)
        return True

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Cache row dst becomes row src's first `length` positions (fq_slots moves the last
        running request into a freed row); in the paged form row src's block table (its pages
        stay where they are)."""
        if self.block_table is not None:
            self.block_table[dst] = self.block_table[src]
            return
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]

    def cache_fits(self, batch: int, capacity: int) -> bool:
        return (self.k_cache is not None and self.block_table is None and self.k_cache.shape[1] == batch
                and self.k_cache.shape[3] >= capacity)

    def cache_bytes(self, batch: int, capacity: int) -> int:
        """Bytes of the K and V caches for `batch` sequences of `capacity` positions."""
        return 2 * self.cfg.num_layers * batch * self.cfg.kv_size * capacity * 2

    def allocate_cache(self, batch: int, capacity: int) -> None:
        """One [L, B, KVH, C, D] buffer each for K and V. Contents are never read
        past a sequence's length, so nothing needs clearing between calls."""
        self.k_cache = self.v_cache = self.block_table = None  # free the old pair before taking the new
        c = self.cfg
        shape = (c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim)
        self.k_cache = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        self.v_cache = torch.empty(shape, dtype=torch.bfloat16, device=self.device)

    def page_bytes(self, page: int) -> int:
        """Bytes of one page of `page` positions in every layer's K and V pools."""
        return self.cache_bytes(1, page)

    def allocate_paged_cache(self, rows: int, pages: int, page: int, capacity: int) -> None:
        """The paged form: K and V pools of `pages` pages of `page` positions, [L, P, KVH, page, D],
        and a block table of `rows` rows of capacity // page pages (int32 on the device, all
        page 0 until a row is given its pages). A pool is zeroed: a page is read only below
        its row's length, but a never-written position must not hold a NaN a mask multiplies."""
        if capacity % page:
            raise ValueError(f"allocate_paged_cache: capacity {capacity} is not a multiple of the page size {page}")
        self.k_cache = self.v_cache = self.block_table = None
        c = self.cfg
        shape = (c.num_layers, pages, c.num_kv_heads, page, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.block_table = torch.zeros((rows, capacity // page), dtype=torch.int32, device=self.device)

    def _paged(self, B: int, b0: int = 0) -> dict:
        """The block-table argument of the KV kernels for rows [b0, b0 + B) (none in the row form)."""
        return {} if self.block_table is None else {"block_table": self.block_table[b0:b0 + B]}


    # ---- forward passes ------------------------------------------------------------
    def _next_norm(self, i: int) -> torch.Tensor:
        layers = self.w.layers
        return layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] int64 on the device -> first generated tokens [B] int64.
        Writes K/V for positions [0, S) of every sequence."""
        return self.ops.argmax(self.prefill_logits(ids))

    def prefill_logits(self, ids: torch.Tensor, row: int = 0, start: int = 0, snapshot: tuple | None = None,
                       all_positions: bool = False) -> torch.Tensor:
        """BF16 logits [B, vocab] of the last prompt position; fills the cache like prefill,
        in cache rows [row, row + B) (a slot's own row: fq_slots). start > 0: ids are positions
        [start, start + S) of sequences whose first `start` positions those rows already hold
        (a prompt prefilled in chunks): their queries attend to the cached keys as well.
        snapshot: None (Qwen3's whole state is its K/V; Qwen3.5's model keeps snapshots). all_positions:
        the logits of every position, [B, S, vocab] (a prompt's own log-likelihood: a server's echo)."""
        if snapshot is not None:
            raise ValueError("prefill_logits: a Qwen3 model keeps no state snapshots (its K/V is its whole state)")
        B, S = ids.shape
        group = max(1, PREFILL_TOKENS // (start + S))
        return torch.cat([self._prefill_group(ids[b0:b0 + group], row + b0, start, all_positions)
                          for b0 in range(0, B, group)])

    def _prefill_group(self, ids: torch.Tensor, b0: int, start: int = 0, all_positions: bool = False) -> torch.Tensor:
        c, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        nb, S = ids.shape
        positions = torch.full((nb,), start, dtype=torch.int32, device=self.device)
        x, h = ops.embed_rmsnorm(ids.reshape(-1), self.w.embed, self.w.layers[0].input_norm, eps)
        last = len(self.w.layers) - 1 if not all_positions else -1     # -1: no layer narrows to the last rows
        paged = self.block_table is not None
        for i, layer in enumerate(self.w.layers):
            if paged and not start:   # the prompt's K/V in rows of their own, then into the rows' pages
                kc = torch.empty((nb, c.num_kv_heads, S, c.head_dim), dtype=torch.bfloat16, device=self.device)
                vc = torch.empty_like(kc)
            elif paged:               # a continued prompt's K/V straight into its pages
                kc, vc = self.k_cache[i], self.v_cache[i]
            else:
                kc, vc = self.k_cache[i, b0:b0 + nb], self.v_cache[i, b0:b0 + nb]
            # Each activation is dropped as soon as the next one exists: a long prompt's
            # peak memory is then the larger of the attention's and the MLP's working sets.
            qkv = ops.linear(h, layer.qkv)
            del h
            q = ops.qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, positions, S,
                                       kc, vc, eps, c.num_heads, c.num_kv_heads,
                                       **(self._paged(nb, b0) if paged and start else {}))
            del qkv
            if i == last:
                # Every position's K/V is cached above, but only the last position
                # of each sequence feeds the logits: the rest of the last layer
                # (attention output, o, MLP) runs on those rows alone.
                x = x.view(nb, S, -1)[:, -1].contiguous()
            if start:                 # the cached positions and these, the causal mask at the bottom right
                kc, vc = cached_kv(self.k_cache[i], self.v_cache[i], self.block_table, slice(b0, b0 + nb), start + S)
                attn = prefix_attention(q, kc, vc, nb, S, start, self.scale, last_only=i == last,
                                        window=c.sliding_window)
            else:
                attn = prefill_attention(q, kc, vc, nb, S, self.scale, last_only=i == last, window=c.sliding_window)
            del q
            if paged and not start:
                write_pages(self.k_cache[i], self.v_cache[i], self.block_table[b0:b0 + nb], kc, vc, 0)
            del kc, vc
            h = ops.linear_add_rmsnorm(attn, layer.o, x, layer.post_norm, eps)
            del attn
            h = self._prefill_mlp(h, layer, x, self._next_norm(i))
        logits = ops.linear(h, self.w.lm_head)
        return logits.view(nb, S, -1) if all_positions else logits

    def _prefill_mlp(self, h: torch.Tensor, layer, x: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """x <- x + down(SwiGLU(gate_up(h))) in place; returns RMSNorm(x) * norm. Rows are
        independent, so slicing them (at MLP_ROWS) only bounds the activations; a slice's
        result goes over its own input rows in h, which nothing reads again."""
        ops, eps, rows = self.ops, self.cfg.rms_norm_eps, h.shape[0]
        if rows <= MLP_ROWS:
            return ops.linear_add_rmsnorm(ops.linear_silu_mul(h, layer.gate_up), layer.down, x, norm, eps)
        for r0 in range(0, rows, MLP_ROWS):
            r1 = min(rows, r0 + MLP_ROWS)
            h[r0:r1] = ops.linear_add_rmsnorm(ops.linear_silu_mul(h[r0:r1], layer.gate_up), layer.down,
                                              x[r0:r1], norm, eps)
        return h

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
               out: torch.Tensor = None) -> torch.Tensor:
        """One step for every sequence: tokens [B] int64 at positions [B] int32
        (lengths = positions + 1, int32) -> next tokens [B] int64 (into `out` if
        given; `out` may be `tokens` itself). Graph-safe: no host reads, no shape
        depends on the positions."""
        h = self._decode_hidden(tokens, positions, lengths)
        if self.screen is not None and h.shape[0] == 1:   # the LM head screened: argmax of its GEMV's logits
            return self.screen.argmax(h, out)
        return self.ops.argmax(self.ops.linear(h, self.w.lm_head), out=out)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """BF16 logits [B, vocab] of one decode step (the step `decode` takes the argmax of)."""
        return self.ops.linear(self._decode_hidden(tokens, positions, lengths), self.w.lm_head)

    def verify_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A speculative verify: tokens [B, T] int64 at positions [B] int32 .. + T - 1 of cache rows
        [0, B) -> BF16 logits [B, T, vocab]. Each of the B * T rows is a decode step's row at its
        own position (its K/V written, then attention over its row's first position + 1 keys,
        which include the verify's earlier rows): row (b, j) computes what the one-row step of
        sequence b at positions[b] + j computes, so a kept draft's logits are the plain decode's.
        Writes K/V at every row's position; a rejected draft's are overwritten later."""
        B, T = tokens.shape
        h = self.verify_hidden(tokens, positions)
        with self.ops.planned_as(B):
            return self.ops.linear(h, self.w.lm_head).view(B, T, -1)

    def verify_hidden(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """verify_logits up to the LM head: the final norm's output of every row, [B * T, hidden]
        (sequence-major)."""
        B, T = tokens.shape
        pos, table = rows_of(positions, T, self.block_table)
        with self.ops.planned_as(B):
            return self._decode_hidden(tokens.reshape(-1), pos, pos + 1, table=table)

    def verify_keep(self, positions: torch.Tensor, T: int) -> torch.Tensor:
        """The rows a sequence may keep of a verify of T rows at positions [B]: all T (int64 [B])."""
        return torch.full((positions.shape[0],), T, dtype=torch.int64, device=positions.device)

    def commit_verify(self, positions: torch.Tensor, kept: torch.Tensor) -> None:
        """After verify_logits at positions [B], kept [B] rows each: nothing to roll back (a rejected
        row's K/V sits past the sequence's length and is rewritten when its position comes again)."""

    def _decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                       table: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step up to the LM head: the final norm's output [B, hidden]. table: a block
        table of the B rows over the caches as page pools (verify_logits: rows sharing a cache row)."""
        c, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        B = tokens.shape[0]
        x, h = ops.embed_rmsnorm(tokens, self.w.embed, self.w.layers[0].input_norm, eps)
        paged = self._paged(B) if table is None else {"block_table": table}
        for i, layer in enumerate(self.w.layers):
            kc, vc = (self.k_cache[i], self.v_cache[i]) if paged else (self.k_cache[i, :B], self.v_cache[i, :B])
            qkv = ops.linear(h, layer.qkv)
            q = ops.qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, positions, 1,
                                       kc, vc, eps, c.num_heads, c.num_kv_heads, **paged)
            attn = ops.decode_attention(q, kc, vc, lengths, self.scale, window=c.sliding_window, **paged)
            h = ops.linear_add_rmsnorm(attn.view(B, c.q_size), layer.o, x, layer.post_norm, eps)
            h = ops.linear_add_rmsnorm(ops.linear_silu_mul(h, layer.gate_up), layer.down, x, self._next_norm(i), eps)
        return h
