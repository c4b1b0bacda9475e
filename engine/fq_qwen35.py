"""Qwen3.5 (hybrid: Gated DeltaNet layers and gated full-attention layers) behind the same
interface as fq_qwen3.Qwen3Model: prefill over a fresh prompt, one decode step, static caches;
written once over an op set (fq_ops: the kernels on a GPU, their torch references on the CPU,
where its logits are Transformers 5.17's cached decode's bit for bit: tests/test_engine_qwen35_cpu.py).

The reference is Transformers 5.17.0's Qwen3_5ForCausalLM with its torch fallback
(read from its modeling source). Per layer, h += mixer(norm1(h)), then
h += MLP(norm2(h)), adds in BF16; every norm but the gated one is (1 + w): fp32 x *
rsqrt(mean x^2 + eps) * (1 + w) rounded once.
- Gated attention (every `full_attention` layer): q_proj gives per head [query | gate];
  (1 + w) q/k norms over head_dim; RoPE on the first head_dim * partial_rotary_factor
  dims (rotate-half, cos/sin of fp32 angles rounded to BF16; text positions make the
  interleaved M-RoPE plain RoPE); causal attention through SDPA with the K/V heads shared
  (enable_gqa, as 5.17's sdpa path); output times sigmoid(gate); o_proj.
- Gated DeltaNet (`linear_attention`): in_proj_qkv -> causal conv (width 4) + SiLU ->
  q | k | v heads; beta = sigmoid(b) in BF16, g = -exp(A_log) softplus(a + dt_bias) in
  fp32; q/k heads repeated to the value heads; the delta rule on an fp32 state (chunked
  over a prompt, one step at a time in decode); gated RMSNorm with silu(z); out_proj.
The weights are packed (fq_weights.qwen35_pack_groups: q | k | v, gate | up, a GDN layer's
qkv | z | b | a); the op set multiplies a pack whole or part by part (fq_ops).

Caches: K/V [L_attn, B, KVH, C, D] BF16 for the attention layers; per GDN layer the conv
state [B, conv_dim, 4] (the last 4 inputs of the conv) and the recurrent state
[B, Hv, Dk, Dv] fp32. Tokens of one call share their positions (the engine's contract).
Exact decode (exact_decode, the default): a GDN layer's decode step computes the full forward's
row of the chunked rule (fqkernels/gdn_exact_step.py), not the recurrent step: its state in the
cache is then the state at the start of the chunk the row's position is in, kept beside the
chunk's rows so far (self.rows), and a prompt pass runs its positions outside whole chunks
through that step, so it leaves the caches as decode expects them.
State snapshots (allocate_snapshots): a sequence's conv and recurrent states after a given
position, taken by a prompt pass where that position is one of the rule's chunk boundaries
(the rule's starting state of that chunk: no pass of its own), and put back into a row later;
fq_slots shares a prompt prefix's pages with them.
"""
import torch

from fq_attention import (ROPE_GRANULE, cached_kv, gqa_causal_attention, gqa_prefix_attention, rows_of,
                          write_pages)
from fq_config import Qwen35Config
from fq_ops import DecodeProduct
from fq_weights import qwen35_pack_groups
from fqkernels import gdn_exact_step
from fqkernels.gdn_ref import CHUNK


class Qwen35Model:
    # A prompt prefix's pages are shared (fq_slots) together with the GDN states at its end,
    # kept as a snapshot (allocate_snapshots) at positions that are multiples of this.
    prefix_sharing = True
    snapshot_granule = CHUNK
    # A verify of up to this many sequences saves the recurrent states of those whose rows close
    # a chunk (48 MB a sequence on the 4B) and may keep rows past the close; a wider one stops
    # each sequence's rows before a close (verify_keep) and saves nothing (docs/PERFORMANCE.md).
    rollback_rows = 4

    def __init__(self, cfg: Qwen35Config, weights: dict, device: torch.device, ops, exact_decode: bool = True,
                 verifies: bool = False):
        self.cfg, self.w, self.device, self.ops = cfg, weights, device, ops
        self.exact_decode = exact_decode
        self.rows = None
        self.decode_tile = CHUNK // 2   # the full forward's cumulative-sum tile (_decode_tile)
        # layer index -> its slot in the attention layers' KV cache, or in the GDN layers' states
        self.attn_slot = {i: n for n, i in enumerate(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")}
        self.gdn_slot = {i: n for n, i in enumerate(i for i, t in enumerate(cfg.layer_types) if t == "linear_attention")}
        self.scale = cfg.head_dim ** -0.5
        c = cfg
        # the multi-token-prediction head (mtp.*), where the engine loaded it (speculation "mtp"):
        # its own K/V cache (mtp_k, mtp_v) beside the model's; keep_hidden: the last pass's
        # final-normed states at every position stay in `hidden` (what the head reads)
        self.has_mtp = "mtp.fc.weight" in weights
        self.mtp_k = self.mtp_v = None
        self.draft_ids = self.draft_head = None     # set_draft_tokens
        self.keep_hidden = self.has_mtp
        self.hidden = None
        self.in_proj_sizes = (c.conv_dim, c.linear_v_heads * c.linear_v_dim, c.linear_v_heads, c.linear_v_heads)
        self.qkv_sizes = (2 * c.num_heads * c.head_dim, c.kv_size, c.kv_size)
        self._pack()
        self.cos = self.sin = None
        self.k_cache = self.v_cache = self.conv_state = self.state = None
        self.snap_conv = self.snap_state = None     # allocate_snapshots
        self._capture = None                        # a prompt pass's snapshot: (offset, indices)
        # Paged form (allocate_paged_cache): the attention layers' caches are pools of pages,
        # [A, P, KVH, page, D], row b's position p in page block_table[b, p // page]; the GDN
        # states stay one row per sequence. None: rows of positions.
        self.block_table = None
        # one sequence's decode pick without the whole LM head (fqkernels/lm_screen: the same pick)
        self.screen = ops.lm_screen(self.w["lm_head.weight"])
        # verifies (the engine drafts and verifies every step): one sequence's products on the tensor
        # cores, where a verify's rows cost little more than a step, for ~5% on a plain step; else
        # the faster one-row fma kernel (docs/PERFORMANCE.md, Speculation)
        if verifies:
            ops.one_row_tensor_cores = frozenset(tuple(p.weights[0].shape) for p in self.decode_products())

    def _pack(self) -> None:
        """The packed matrices (qwen35_pack_groups), made in the weights dict itself, each original
        dropped as its pack is made; packs the loader already made are kept as they are."""
        for packed, names in qwen35_pack_groups(self.cfg, self.has_mtp).items():
            if packed not in self.w:
                self.w[packed] = torch.cat([self.w.pop(n) for n in names])

    def decode_products(self) -> list:
        """The decode step's matrices, for the op set's tuner (fq_ops.DecodeProduct)."""
        kinds = {"linear_attn.in_proj.weight": "linear", "linear_attn.out_proj.weight": "linear",
                 "self_attn.qkv_proj.weight": "linear", "self_attn.o_proj.weight": "linear",
                 "mlp.gate_up.weight": "silu_mul", "mlp.down_proj.weight": "linear", "lm_head.weight": "linear"}
        out = []
        for suffix, kind in kinds.items():
            ws = [w for name, w in self.w.items() if name.endswith(suffix) and not name.startswith("mtp.")]
            if ws:
                out.append(DecodeProduct(suffix.rsplit(".", 1)[0], ws, kind))
        return out

    # ---- buffers -----------------------------------------------------------------
    def ensure_rope(self, length: int) -> bool:
        """cos/sin tables covering positions [0, length), in whole ROPE_GRANULEs (a position's
        values do not depend on the table's length). True when rebuilt (graphs read the old ones)."""
        if self.cos is not None and self.cos.shape[0] >= length:
            return False
        c = self.cfg
        n = -(-length // ROPE_GRANULE) * ROPE_GRANULE
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float) / c.rotary_dim))
        freqs = torch.arange(n, dtype=torch.float)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device, torch.bfloat16)
        self.sin = emb.sin().to(self.device, torch.bfloat16)
        return True

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Cache row dst becomes row src: its first `length` K/V positions and its GDN states
        (fq_slots moves the last running request into a freed row); in the paged form its block
        table row instead of its K/V (the pages stay where they are)."""
        if self.block_table is not None:
            self.block_table[dst] = self.block_table[src]
        else:
            self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
            self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]
        self.conv_state[:, dst] = self.conv_state[:, src]
        self.state[:, dst] = self.state[:, src]
        for rows in self.rows or ():
            rows.copy_row(src, dst)

    def cache_fits(self, batch: int, capacity: int) -> bool:
        return (self.k_cache is not None and self.block_table is None and self.k_cache.shape[1] == batch
                and self.k_cache.shape[3] >= capacity)

    def page_bytes(self, page: int) -> int:
        """Bytes of one page of `page` positions in every attention layer's K and V pools."""
        return 2 * len(self.attn_slot) * self.cfg.kv_size * page * 2

    def row_bytes(self) -> int:
        """Bytes of one sequence's GDN states (conv and recurrent, and exact decode's chunk rows),
        which are not paged."""
        return self.cache_bytes(1, 0)

    def cache_bytes(self, batch: int, capacity: int) -> int:
        c = self.cfg
        kv = 2 * len(self.attn_slot) * batch * c.kv_size * capacity * 2
        states = len(self.gdn_slot) * batch * (c.conv_dim * c.conv_width * 2
                                                 + c.linear_v_heads * c.linear_k_dim * c.linear_v_dim * 4)
        rows = self.ops.gdn_rows_bytes(c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)
        return kv + states + (len(self.gdn_slot) * batch * rows if self.exact_decode else 0)

    def _decode_tile(self, batch: int, capacity: int) -> int:
        """The cumulative sum's tile of a full forward over `capacity` positions of `batch`
        sequences (gdn_exact_step.scan_tile over its rows of 64)."""
        return gdn_exact_step.scan_tile(batch * self.cfg.linear_v_heads * max(1, -(-capacity // CHUNK)))

    def _allocate_rows(self, batch: int, capacity: int) -> None:
        """Exact decode's chunk rows for `batch` sequences in every GDN layer, and the decode's tile
        for `capacity` positions (_decode_tile)."""
        self.rows = None
        if not self.exact_decode:
            return
        c = self.cfg
        self.decode_tile = self._decode_tile(batch, capacity)
        self.rows = self.ops.gdn_chunk_rows(len(self.gdn_slot), batch, c.linear_k_heads, c.linear_v_heads,
                                            c.linear_k_dim, c.linear_v_dim, self.device)

    def allocate_paged_cache(self, rows: int, pages: int, page: int, capacity: int) -> None:
        """The paged form: K and V pools of `pages` pages of `page` positions per attention layer,
        a block table of `rows` rows of capacity // page pages (int32, all page 0 until a row
        is given its pages), and the GDN states of `rows` sequences."""
        if capacity % page:
            raise ValueError(f"allocate_paged_cache: capacity {capacity} is not a multiple of the page size {page}")
        self.allocate_cache(rows, 0)
        self.decode_tile = self._decode_tile(rows, capacity)
        self.k_cache = self.v_cache = None
        c = self.cfg
        shape = (len(self.attn_slot), pages, c.num_kv_heads, page, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self.block_table = torch.zeros((rows, capacity // page), dtype=torch.int32, device=self.device)

    def allocate_snapshots(self, n: int) -> None:
        """Room for n snapshots of one sequence's GDN states (conv and recurrent, every GDN layer):
        taken by prefill_logits(snapshot=) or save_snapshot, put back by load_snapshot. A new
        cache (allocate_cache) drops them."""
        c, G = self.cfg, len(self.gdn_slot)
        self.snap_conv = self.snap_state = None
        self.snap_conv = torch.zeros((n, G, c.conv_dim, c.conv_width), dtype=torch.bfloat16, device=self.device)
        self.snap_state = torch.zeros((n, G, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim), dtype=torch.float32,
                                      device=self.device)

    def save_snapshot(self, row: int, index: int) -> None:
        """Snapshot `index` becomes cache row `row`'s GDN states as they are."""
        self.snap_conv[index] = self.conv_state[:, row]
        self.snap_state[index] = self.state[:, row]

    def load_snapshot(self, index: int, row: int) -> None:
        """Cache row `row`'s GDN states become snapshot `index` (a prompt then goes on from the
        snapshot's position: prefill_logits with start)."""
        self.conv_state[:, row] = self.snap_conv[index]
        self.state[:, row] = self.snap_state[index]

    def allocate_cache(self, batch: int, capacity: int) -> None:
        c, dev = self.cfg, self.device
        self.k_cache = self.v_cache = self.conv_state = self.state = self.block_table = None
        self.snap_conv = self.snap_state = self.rows = None
        shape = (len(self.attn_slot), batch, c.num_kv_heads, capacity, c.head_dim)
        # zeros: the torch op set's masked attention over rows of other lengths (fq_slots) reads
        # past a row's length, where a mask cannot hide a NaN an empty buffer may hold
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        self.conv_state = torch.zeros((len(self.gdn_slot), batch, c.conv_dim, c.conv_width),
                                      dtype=torch.bfloat16, device=dev)
        self.state = torch.zeros((len(self.gdn_slot), batch, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim),
                                 dtype=torch.float32, device=dev)
        self._allocate_rows(batch, capacity)
        self.mtp_k = self.mtp_v = self.hidden = None
        if self.has_mtp:
            mtp_shape = (c.mtp_layers, batch, c.num_kv_heads, capacity, c.head_dim)
            self.mtp_k = torch.zeros(mtp_shape, dtype=torch.bfloat16, device=dev)
            self.mtp_v = torch.zeros(mtp_shape, dtype=torch.bfloat16, device=dev)

    # ---- forward passes ------------------------------------------------------------
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.argmax(self.prefill_logits(ids))

    def prefill_logits(self, ids: torch.Tensor, row: int = 0, start: int = 0, snapshot: tuple | None = None,
                       all_positions: bool = False) -> torch.Tensor:
        """Last-position BF16 logits [B, vocab] of fresh prompts ids [B, S]; fills every cache
        in rows [row, row + B) (a slot's own row: fq_slots). start > 0: ids are positions
        [start, start + S) of sequences whose first `start` positions those rows already hold
        (a prompt prefilled in chunks): the GDN layers go on from their conv and recurrent
        states, the attention layers' queries see the cached keys too. snapshot (position,
        indices): each sequence's GDN states after `position` are also kept as snapshot
        indices[b] (allocate_snapshots; a list, or an int64 tensor on the device), position - start
        a multiple of snapshot_granule in (0, S): the states the pass has there anyway. all_positions:
        the logits of every position, [B, S, vocab] (a prompt's own log-likelihood: a server's echo)."""
        B, S = ids.shape
        if snapshot is not None:
            at, indices = snapshot
            cut = at - start
            if self.snap_state is None or len(indices) != B or not 0 < cut < S or cut % self.snapshot_granule:
                raise ValueError(f"prefill_logits: a snapshot at {at} of {len(indices)} sequence(s) needs allocated "
                                 f"snapshots, one index per sequence ({B}) and a position past {start} by a multiple "
                                 f"of {self.snapshot_granule} below {start + S}")
            # indices may be the caller's int64 tensor on the device (a graph's static buffer: fq_decode.ChunkGraph)
            self._capture = (cut, indices if isinstance(indices, torch.Tensor)
                             else torch.tensor(indices, dtype=torch.int64, device=self.device))
        rows = slice(row, row + B)
        self.ensure_rope(start + S)
        cos, sin = self.cos[None, start:start + S], self.sin[None, start:start + S]     # [1, S, r]
        try:
            h = self._layers(ids, lambda i, h: self._gdn_prompt(i, h, rows, start),
                             lambda i, h: self._attention_prompt(i, h, cos, sin, rows, start), all_positions)
        finally:
            self._capture = None
        return self._logits(h)

    def decode(self, tokens, positions, lengths, out=None):
        """One step for every sequence: tokens [B] int64 at positions [B] int32 (lengths =
        positions + 1) -> next tokens [B] int64 (into `out` if given). Graph-safe on the Triton op
        set: no host reads, no shape depends on the positions."""
        return self._picks(self._decode_hidden(tokens, positions, lengths), out)

    def _picks(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's argmax of final-normed rows h [R, hidden] -> int64 [R]; at one row screened
        (fqkernels/lm_screen: the argmax of its GEMV's logits, without the whole head)."""
        if self.screen is not None and h.shape[0] == 1:
            return self.screen.argmax(h.contiguous(), out)
        return self.ops.argmax(self._logits(h), out=out)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._logits(self._decode_hidden(tokens, positions, lengths))

    def _decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A decode step up to the LM head: the final norm's output [B, hidden]."""
        return self._layers(tokens[:, None], lambda i, h: self._gdn_step(i, h, positions),
                            lambda i, h: self._attention_step(i, h, positions, lengths))

    # ---- speculation: a verify over k + 1 positions, then its rollback (fq_spec) -----------------
    def verify_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A speculative verify: tokens [B, T] int64 at positions [B] int32 .. + T - 1 of cache rows
        [0, B) -> BF16 logits [B, T, vocab], each row what the one-row decode step at its position
        computes: the GDN layers run their T steps in turn (exact decode's rows: each row is the
        full forward's from the chunk's start and the rows before it), the attention layers, MLPs
        and the LM head over all B * T rows as the B-row step launches them. The GDN states end
        past all T rows they run (verify_keep); commit_verify then keeps each sequence's accepted
        rows only."""
        B, T = tokens.shape
        h = self.verify_hidden(tokens, positions)
        with self.ops.planned_as(B):
            return self._logits(h).view(B, T, -1)

    def verify_keep(self, positions: torch.Tensor, T: int) -> torch.Tensor:
        """The rows a sequence may keep of a verify of T rows at positions [B] int32 (any device):
        T, but in a verify of more than rollback_rows sequences, c where row c in 1 .. T - 1 closes
        the sequence's chunk (its position ends one). Such a verify runs no row from the close on,
        so nothing is rolled back there: the close is the next verify's row 0, always kept. Int64
        [B], on the positions' device."""
        B = positions.shape[0]
        if B <= self.rollback_rows:
            return torch.full((B,), T, dtype=torch.int64, device=positions.device)
        c = (CHUNK - 1 - positions.to(torch.int64)) % CHUNK
        return torch.where((c >= 1) & (c < T), c, torch.full_like(c, T))

    def verify_hidden(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """verify_logits up to the LM head: the final norm's output of every row, [B * T, hidden]
        (sequence-major); the rollback's state saved as there. Rows a sequence may not keep
        (verify_keep) are not run in the GDN layers; their outputs are meaningless."""
        if not self.exact_decode:
            raise ValueError("verify_logits: a Qwen3.5 verify needs exact decode (the recurrent step's state "
                             "cannot drop rejected rows)")
        B, T = tokens.shape
        G = len(self.gdn_slot)
        # What commit_verify rolls back to: the conv states before the verify and after each row;
        # up to rollback_rows sequences, the recurrent states of those one of whose rows closes a
        # chunk (exact decode changes them only there: a masked copy, no host read) and the
        # chunks' first rows; past it, nothing (the GDN rows stop before a close).
        state_before = heads = self._verify_ends = None
        if B <= self.rollback_rows:
            closes = (CHUNK - 1 - positions.to(torch.int64)) % CHUNK < T
            state_before = torch.empty_like(self.state[:, :B])
            self.ops.copy_rows_where(state_before, self.state[:, :B], closes)
            heads = self.ops.gdn_rows_head(self.rows, B, T)
        else:
            self._verify_ends = (positions.to(torch.int64) + self.verify_keep(positions, T)).to(torch.int32)
        self._verify_before = (self.conv_state[:, :B].clone(), state_before, heads)
        self._verify_conv = torch.empty((T, G, B) + tuple(self.conv_state.shape[2:]), dtype=self.conv_state.dtype,
                                        device=self.device)
        pos, table = rows_of(positions, T, self.block_table)
        lengths = pos + 1
        shape = (B, T, self.cfg.hidden_size)

        def gdn(i, h):
            return self._gdn_verify(i, h, positions, self._verify_conv[:, self.gdn_slot[i]])

        def attention(i, h):
            return self._attention_step(i, h.reshape(B * T, 1, -1), pos, lengths, table=table).view(shape)

        with self.ops.planned_as(B):
            return self._layers(tokens, gdn, attention, all_positions=True).reshape(B * T, -1)

    def mtp_draft(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  rows: tuple | None = None) -> tuple:
        """The multi-token-prediction head over n rows per sequence of cache rows [0, B): row j, at
        position positions + j, joins hidden[:, j] (a final-normed state: the target's at that
        position, or the head's own output for a chained draft) and tokens[:, j] (the token after it):
        fc over both normed side by side, the head's decoder layers (gated attention over the
        head's own K/V cache, written at those positions), its final norm, the LM head. Returns
        (picks [B, n] int64: each row's guess at the token after tokens[:, j]; the rows' normed
        outputs [B, n, hidden], a chained draft's hidden). rows: mtp_rows(positions, n), made ahead."""
        h = self.mtp_hidden(tokens, hidden, positions, rows)
        return self.mtp_picks(h), h

    def mtp_picks(self, h: torch.Tensor) -> torch.Tensor:
        """The head's picks for its normed outputs h [..., hidden]: the LM head's argmax (_picks), or
        with a draft vocabulary (set_draft_tokens) the argmax over its rows -> int64 [...] token
        ids. A caller that needs some rows' picks only selects them first: the LM head is most of
        the head's cost (1.27 GB on the 4B)."""
        rows = h.reshape(-1, h.shape[-1])
        if self.draft_ids is None:
            return self._picks(rows).view(h.shape[:-1])
        return self.draft_ids[self.ops.argmax(self.ops.linear(rows, self.draft_head))].view(h.shape[:-1])

    def set_draft_tokens(self, ids: torch.Tensor | None) -> None:
        """The head (loaded: the engine checks) drafts only these token ids (int64 [N], sorted,
        unique: fq_spec.load_token_map), through a copy of their rows of the LM head (N x hidden),
        or again every token (None). The verify's picks, so the tokens emitted, never depend on it;
        a draft the map lacks is a rejected draft (docs/PERFORMANCE.md, Speculation)."""
        if ids is None:
            self.draft_ids = self.draft_head = None
            return
        self.draft_ids = ids.to(self.device, torch.int64)
        self.draft_head = self.w["lm_head.weight"].index_select(0, self.draft_ids).contiguous()

    @staticmethod
    def mtp_rows(positions: torch.Tensor, n: int) -> tuple:
        """The head's n rows a sequence at positions [B] int32 .. + n - 1: (their positions [B * n],
        lengths = positions + 1, a table of cache rows [B * n, 1]), all int32; the head's cache is
        its rows, never paged. A caller chaining drafts makes them once for all its drafts."""
        pos, table = rows_of(positions, n)
        return pos, pos + 1, table

    def mtp_hidden(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   rows: tuple | None = None) -> torch.Tensor:
        """mtp_draft up to its final norm: the rows' normed outputs [B, n, hidden] (the head's K/V
        written at their positions), no LM head. rows: mtp_rows(positions, n), made ahead."""
        c, ops, eps, w = self.cfg, self.ops, self.cfg.rms_norm_eps, self.w
        B, n = tokens.shape
        pos, lengths, table = self.mtp_rows(positions, n) if rows is None else rows
        _, e = ops.embed_rmsnorm(tokens.reshape(-1), w["model.embed_tokens.weight"],
                                 w["mtp.pre_fc_norm_embedding.weight"], eps, one_plus=True)
        hn = ops.rmsnorm(hidden.reshape(B * n, -1).contiguous(), w["mtp.pre_fc_norm_hidden.weight"], eps,
                         one_plus=True)
        # the head's residual stream starts at fc's output (a fresh tensor, added to in place)
        x = ops.linear(torch.cat([e, hn], dim=-1), w["mtp.fc.weight"])
        h = ops.rmsnorm(x, w["mtp.layers.0.input_layernorm.weight"], eps, one_plus=True)
        for L in range(c.mtp_layers):
            p = f"mtp.layers.{L}."
            attn = self._gated_attention(p + "self_attn.", h.view(B * n, 1, -1), pos, lengths, self.mtp_k[L],
                                         self.mtp_v[L], table)
            h = ops.add_rmsnorm(x, attn.reshape(x.shape), w[p + "post_attention_layernorm.weight"], eps, one_plus=True)
            nxt = w[f"mtp.layers.{L + 1}.input_layernorm.weight"] if L + 1 < c.mtp_layers else w["mtp.norm.weight"]
            mlp = ops.mlp(h, w[p + "mlp.gate_up.weight"], w[p + "mlp.down_proj.weight"])
            h = ops.add_rmsnorm(x, mlp.reshape(x.shape), nxt, eps, one_plus=True)
        return h.view(B, n, -1)

    def commit_verify(self, positions: torch.Tensor, kept: torch.Tensor) -> None:
        """After verify_logits at positions [B] int32: sequence b keeps its first kept[b] rows (kept
        [B] int64; 0: none; at most verify_keep's). Its conv state becomes the one after its last
        kept row. Where the verify closed a chunk at a row it did not keep, the chunk's start state
        (exact decode advances it only at a close) and the chunk's first rows (the next chunk's rows
        went there) are put back as they were. Other rows past the kept ones are rewritten by the
        steps that reach their positions. Graph-safe: selections on the device, no host reads."""
        conv_before, state_before, heads = self._verify_before
        T, G, B = self._verify_conv.shape[:3]
        seqs = torch.arange(B, device=kept.device)
        after = self._verify_conv[(kept - 1).clamp(min=0), :, seqs].transpose(0, 1)   # [G, B, ...]
        some = (kept > 0).view(1, B, *([1] * (after.dim() - 2)))
        self.conv_state[:, :B].copy_(torch.where(some, after, conv_before))
        if state_before is not None:
            close = (CHUNK - 1 - positions.to(torch.int64)) % CHUNK      # the row whose position ends a chunk
            back = (kept <= close) & (close < T)                           # that row was not kept
            self.ops.copy_rows_where(self.state[:, :B], state_before, back)
            self.ops.gdn_rows_put_head_where(self.rows, B, heads, back)
        self._verify_before = self._verify_conv = self._verify_ends = None

    def _layers(self, ids: torch.Tensor, gdn, attention, all_positions: bool = False) -> torch.Tensor:
        """Every decoder layer over the embeddings of ids [B, T]: the mixer (gdn(i, h) or
        attention(i, h)), then the MLP, each residual add and the norm after it one op (the
        embedding lookup and the first norm too). Returns the final norm's output at each
        sequence's last position, [B, hidden] (all_positions: at every position, [B, T, hidden])."""
        ops, eps, L = self.ops, self.cfg.rms_norm_eps, self.cfg.num_layers
        ln = lambda i, kind: self.w[f"model.layers.{i}.{kind}.weight"]  # noqa: E731
        table = self.w["model.embed_tokens.weight"]
        shape = (*ids.shape, table.shape[1])
        # x: the residual stream [B * T, hidden], added to in place
        x, h = ops.embed_rmsnorm(ids.reshape(-1), table, ln(0, "input_layernorm"), eps, one_plus=True)
        h = h.view(shape)
        for i in range(L):
            mixed = gdn(i, h) if i in self.gdn_slot else attention(i, h)
            h = ops.add_rmsnorm(x, mixed.reshape(x.shape), ln(i, "post_attention_layernorm"), eps,
                                one_plus=True).view(shape)
            p = f"model.layers.{i}.mlp."
            nxt = ln(i + 1, "input_layernorm") if i + 1 < L else self.w["model.norm.weight"]
            mlp = ops.mlp(h, self.w[p + "gate_up.weight"], self.w[p + "down_proj.weight"])
            h = ops.add_rmsnorm(x, mlp.reshape(x.shape), nxt, eps, one_plus=True).view(shape)
        if self.keep_hidden:
            self.hidden = h
        return h if all_positions else h[:, -1]

    # ---- pieces ----------------------------------------------------------------------
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """BF16 logits of final-normed rows."""
        return self.ops.linear(h, self.w["lm_head.weight"])

    def _attention_prompt(self, i: int, h, cos, sin, rows: slice, start: int = 0):
        c, p = self.cfg, f"model.layers.{i}.self_attn."
        B, S, _ = h.shape
        qp, k, v = self.ops.linear_parts(h, self.w[p + "qkv_proj.weight"], self.qkv_sizes)
        q, gate = torch.chunk(qp.view(B, S, -1, 2 * c.head_dim), 2, dim=-1)    # per head [query | gate]
        v = v.view(B, S, -1, c.head_dim).transpose(1, 2)
        q, k = self.ops.qk_norm_rope(q, k.view(B, S, -1, c.head_dim), self.w[p + "q_norm.weight"],
                                     self.w[p + "k_norm.weight"], c.rms_norm_eps, cos, sin)
        slot = self.attn_slot[i]
        if self.block_table is not None:
            write_pages(self.k_cache[slot], self.v_cache[slot], self.block_table[rows], k, v, start)
        else:
            self.k_cache[slot, rows, :, start:start + S], self.v_cache[slot, rows, :, start:start + S] = k, v
        if start:   # a continued prompt: the cached keys and these, the causal mask at the bottom right
            kc, vc = cached_kv(self.k_cache[slot], self.v_cache[slot], self.block_table, rows, start + S)
            attn = gqa_prefix_attention(q, kc, vc, start, self.scale)
        else:
            attn = gqa_causal_attention(q, k, v, self.scale)
        return self.ops.linear(self.ops.gate_mul(attn.transpose(1, 2), gate), self.w[p + "o_proj.weight"])

    def _attention_step(self, i: int, h, positions, lengths, table: torch.Tensor | None = None):
        """table: a block table of h's rows over the caches as page pools (verify_logits' rows
        sharing a cache row); None: the first B rows, paged through the model's own table."""
        B = h.shape[0]
        slot = self.attn_slot[i]
        # the first B rows: this call's sequences (paged: the layer's pools, read through the table)
        paged = self.block_table is not None or table is not None
        kc, vc = (self.k_cache[slot], self.v_cache[slot]) if paged else (self.k_cache[slot, :B], self.v_cache[slot, :B])
        if table is None and self.block_table is not None:
            table = self.block_table[:B]
        return self._gated_attention(f"model.layers.{i}.self_attn.", h, positions, lengths, kc, vc, table)

    def _gated_attention(self, p: str, h, positions, lengths, kc, vc, table):
        """A gated attention layer's decode rows (weights under prefix p) over caches kc, vc."""
        c = self.cfg
        q, gate = self.ops.gated_attention_qk(h, self.w[p + "qkv_proj.weight"], self.w[p + "q_norm.weight"],
                                              self.w[p + "k_norm.weight"], self.cos, self.sin, positions, kc, vc,
                                              c.rms_norm_eps, c.num_heads, c.num_kv_heads, block_table=table)
        attn = self.ops.gated_decode_attention(q, gate, kc, vc, lengths, self.scale, block_table=table)
        return self.ops.linear(attn, self.w[p + "o_proj.weight"])

    def _gdn_prompt(self, i: int, h: torch.Tensor, rows: slice, start: int = 0) -> torch.Tensor:
        """GDN layer i over a prompt's h [B, T, hidden], filling cache rows `rows` (start > 0: going
        on from the rows' conv and recurrent states)."""
        c, p, ops = self.cfg, f"model.layers.{i}.linear_attn.", self.ops
        B, T, _ = h.shape
        slot = self.gdn_slot[i]
        mixed, z, b, a = ops.linear_split(h, self.w[p + "in_proj.weight"], self.in_proj_sizes)   # mixed [B, T, C]
        conv_w = self.w[p + "conv1d.weight"].squeeze(1)
        carried = start > 0          # the rows' states go on (a continued prompt)
        capture = self._capture
        if capture is not None:   # the conv's state after `cut` positions: the last conv_width inputs then
            cut, width = capture[0], c.conv_width
            if cut >= width:
                seen = mixed[:, cut - width:cut].transpose(1, 2)
            else:
                before = self.conv_state[slot, rows] if carried else torch.zeros_like(self.conv_state[slot, rows])
                seen = torch.cat([before[..., cut:], mixed[:, :cut].transpose(1, 2).to(before.dtype)], dim=-1)
            self.snap_conv[capture[1], slot] = seen.to(self.snap_conv.dtype)
        g, beta = ops.gdn_gates(a, b, self.w[p + "A_log"], self.w[p + "dt_bias"])
        mixed, new_conv = ops.causal_conv(mixed, conv_w, self.conv_state[slot, rows] if carried else None)
        self.conv_state[slot, rows].copy_(new_conv)
        q, k, v = self._qkv_heads(mixed, B, T)
        if self.exact_decode:
            o = self._exact_decode_prompt(slot, rows, q, k, v, g, beta, start, carried, capture)
        else:
            at = None if capture is None else (capture[0] // CHUNK, torch.empty_like(self.state[slot, rows]))
            o, _ = ops.chunked_rule(q, k, v, g, beta, state_out=self.state[slot, rows],
                                    initial_state=self.state[slot, rows] if carried else None, capture=at)
            if capture is not None:
                self.snap_state[capture[1], slot] = at[1]
        o = ops.gated_rmsnorm(o, z.reshape(B * T, -1), self.w[p + "norm.weight"], c.rms_norm_eps)
        return ops.linear(o.reshape(B, T, -1), self.w[p + "out_proj.weight"])

    def _qkv_heads(self, mixed: torch.Tensor, *lead) -> tuple:
        """The conv's output [..., C] as q, k [*lead, Hk, Dk] and v [*lead, Hv, Dv] (views)."""
        c = self.cfg
        kd = c.linear_k_heads * c.linear_k_dim
        q, k, v = torch.split(mixed, [kd, kd, c.linear_v_heads * c.linear_v_dim], dim=-1)
        return (q.reshape(*lead, -1, c.linear_k_dim), k.reshape(*lead, -1, c.linear_k_dim),
                v.reshape(*lead, -1, c.linear_v_dim))

    def _exact_decode_prompt(self, slot: int, rows: slice, q, k, v, g, beta, start: int, carried: bool,
                             capture) -> torch.Tensor:
        """A prompt pass's rule with exact decode on ([B, T, Hv, Dv] out): the positions before the
        prompt's first chunk boundary (a prompt going on inside a chunk) and after its last one go
        through the decode step one at a time, so the cache rows end as decode leaves them (the
        state at the last chunk's start and that chunk's rows so far); the whole chunks between
        through the op set's prompt rule, from the state the steps before left. A snapshot
        (capture: cut, indices) is taken at one of those chunks' boundaries."""
        C, T, ops = CHUNK, v.shape[1], self.ops
        state = self.state[slot, rows]
        chunk_rows = self.rows[slot].narrow(rows.start, rows.stop - rows.start)
        tile = self.decode_tile

        def step(*args):
            return ops.gdn_exact_step(*args, tile=tile)[0]

        head = min(-start % C, T)
        body = (T - head) // C * C
        if capture is not None and (capture[0] - head) % C:
            raise ValueError(f"prefill_logits: with exact decode a snapshot must sit at a chunk boundary, not "
                             f"position {start + capture[0]}")
        if not carried and not body:
            state.zero_()
        parts = []
        if head:
            parts.append(gdn_exact_step.run_rows(step, q[:, :head], k[:, :head], v[:, :head], g[:, :head],
                                                 beta[:, :head], start, state, chunk_rows))
        if body:
            cut = None if capture is None else (capture[0] - head) // C
            at = None if cut is None or cut * C == body else (cut, torch.empty_like(state))
            part = slice(head, head + body)
            o, _ = ops.chunked_rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state_out=state,
                                    initial_state=state if carried else None, capture=at)
            parts.append(o)
            if capture is not None:
                self.snap_state[capture[1], slot] = state if at is None else at[1]
        if head + body < T:
            tail = slice(head + body, T)
            parts.append(gdn_exact_step.run_rows(step, q[:, tail], k[:, tail], v[:, tail], g[:, tail], beta[:, tail],
                                                 start + head + body, state, chunk_rows))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _gdn_step(self, i: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step of GDN layer i: h [B, 1, hidden] -> [B, 1, hidden]. The conv and recurrent
        states (exact decode: the chunk's rows) of the first B rows are updated in place."""
        p, ops = f"model.layers.{i}.linear_attn.", self.ops
        B = h.shape[0]
        slot = self.gdn_slot[i]
        x, z, g, beta = ops.gdn_in_proj_step(h, self.w[p + "in_proj.weight"], self.in_proj_sizes,
                                             self.conv_state[slot, :B], self.w[p + "conv1d.weight"].squeeze(1),
                                             self.w[p + "A_log"], self.w[p + "dt_bias"])
        return ops.linear(self._gdn_rule(i, x, z, g, beta, positions).reshape(B, 1, -1), self.w[p + "out_proj.weight"])

    def _gdn_verify(self, i: int, h: torch.Tensor, positions: torch.Tensor, conv_rows: torch.Tensor) -> torch.Tensor:
        """GDN layer i over a verify's T rows a sequence (h [B, T, hidden]), row j the exact decode
        step at positions + j ([B] int32): in_proj and out_proj once over all B T rows (planned as the
        B-row step: each row the step's bits), the conv and gates of the T rows in one op, the rule's
        rows in turn in one op (gdn_exact_rows), the gated norm of all rows in one launch (per row,
        the step's bits). conv_rows [T, B, C, W] receives the conv state after each row."""
        p, ops = f"model.layers.{i}.linear_attn.", self.ops
        B, T, _ = h.shape
        slot = self.gdn_slot[i]
        w_in, w_out = self.w[p + "in_proj.weight"], self.w[p + "out_proj.weight"]
        mixed, z, b, a = ops.linear_split(h.reshape(B * T, -1), w_in, self.in_proj_sizes)
        mixed, z, b, a = (t.view(B, T, -1) for t in (mixed, z, b, a))
        x, g, beta = ops.gdn_conv_gates_rows(mixed, self.conv_state[slot, :B], self.w[p + "conv1d.weight"].squeeze(1),
                                             a, b, self.w[p + "A_log"], self.w[p + "dt_bias"], conv_rows)
        q, k, v = self._qkv_heads(x, T, B)
        o = ops.gdn_exact_rows(q, k, v, g, beta, positions, self.state[slot, :B], self.rows[slot].narrow(0, B),
                               tile=self.decode_tile, ends=self._verify_ends)           # [T, B, Hv, Dv]
        # z [B, T, Hv Dv] stays a view of in_proj's rows: the gated norm reads rows of any stride
        o = ops.gated_rmsnorm(o.transpose(0, 1).reshape(B, T, -1), z.reshape(B * T, -1), self.w[p + "norm.weight"],
                              self.cfg.rms_norm_eps)
        return ops.linear(o.reshape(B, T, -1), w_out)

    def _gdn_rule(self, i: int, x, z, g, beta, positions):
        """A decode step's rule of GDN layer i from its conv output x [B, C], z, the gates: the rule
        (exact decode: from the chunk's rows) and the gated norm, B * Hv rows of Dv (in some shape)."""
        c, p, ops = self.cfg, f"model.layers.{i}.linear_attn.", self.ops
        B = x.shape[0]
        slot = self.gdn_slot[i]
        state = self.state[slot, :B]
        norm_w = self.w[p + "norm.weight"]
        q, k, v = self._qkv_heads(x, B)
        normed = False
        if self.exact_decode:
            o, normed = ops.gdn_exact_step(q, k, v, g, beta, positions, state, self.rows[slot].narrow(0, B),
                                           tile=self.decode_tile, norm=(z, norm_w, c.rms_norm_eps))
        else:
            o = ops.gdn_rule_step(q, k, v, g, beta, state)
        if not normed:
            o = ops.gated_rmsnorm(o, z, norm_w, c.rms_norm_eps)
        return o
