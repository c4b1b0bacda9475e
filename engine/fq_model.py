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

from fq_config import ModelConfig
from fq_weights import ModelWeights
from fq_ops import prefill_attention
from fqkernels.rope_kv import rope_tables

# Prompts are prefilled in groups of whole sequences of at most this many
# tokens: bounds the activations (gate/up alone is 2 x intermediate x 2 B a
# token) without changing any result, since sequences are independent.
PREFILL_TOKENS = 16384
# A group larger than that (one prompt longer than PREFILL_TOKENS) runs its MLP
# over row slices of at most this many tokens: the gate/up activations (the
# largest, 2 x intermediate x 2 B a token) stay bounded at any prompt length.
MLP_ROWS = PREFILL_TOKENS
ROPE_GRANULE = 4096


class Qwen3Model:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device, ops):
        self.cfg = cfg
        self.w = weights
        self.device = device
        self.ops = ops
        self.scale = cfg.head_dim ** -0.5
        self.cos = self.sin = None
        self.k_cache = self.v_cache = None

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
        running request into a freed row)."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]

    def cache_fits(self, batch: int, capacity: int) -> bool:
        return (self.k_cache is not None and self.k_cache.shape[1] == batch
                and self.k_cache.shape[3] >= capacity)

    def cache_bytes(self, batch: int, capacity: int) -> int:
        """Bytes of the K and V caches for `batch` sequences of `capacity` positions."""
        return 2 * self.cfg.num_layers * batch * self.cfg.kv_size * capacity * 2

    def allocate_cache(self, batch: int, capacity: int) -> None:
        """One [L, B, KVH, C, D] buffer each for K and V. Contents are never read
        past a sequence's length, so nothing needs clearing between calls."""
        self.k_cache = self.v_cache = None  # free the old pair before taking the new
        c = self.cfg
        shape = (c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim)
        self.k_cache = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        self.v_cache = torch.empty(shape, dtype=torch.bfloat16, device=self.device)

    # ---- forward passes ------------------------------------------------------------
    def _next_norm(self, i: int) -> torch.Tensor:
        layers = self.w.layers
        return layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] int64 on the device -> first generated tokens [B] int64.
        Writes K/V for positions [0, S) of every sequence."""
        return self.ops.argmax(self.prefill_logits(ids))

    def prefill_logits(self, ids: torch.Tensor, row: int = 0) -> torch.Tensor:
        """BF16 logits [B, vocab] of the last prompt position; fills the cache like prefill,
        in cache rows [row, row + B) (a slot's own row: fq_slots)."""
        B, S = ids.shape
        group = max(1, PREFILL_TOKENS // S)
        return torch.cat([self._prefill_group(ids[b0:b0 + group], row + b0) for b0 in range(0, B, group)])

    def _prefill_group(self, ids: torch.Tensor, b0: int) -> torch.Tensor:
        c, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        nb, S = ids.shape
        positions = torch.zeros(nb, dtype=torch.int32, device=self.device)
        x, h = ops.embed_rmsnorm(ids.reshape(-1), self.w.embed, self.w.layers[0].input_norm, eps)
        last = len(self.w.layers) - 1
        for i, layer in enumerate(self.w.layers):
            kc, vc = self.k_cache[i, b0:b0 + nb], self.v_cache[i, b0:b0 + nb]
            # Each activation is dropped as soon as the next one exists: a long prompt's
            # peak memory is then the larger of the attention's and the MLP's working sets.
            qkv = ops.linear(h, layer.qkv)
            del h
            q = ops.qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, positions, S,
                                       kc, vc, eps, c.num_heads, c.num_kv_heads)
            del qkv
            if i == last:
                # Every position's K/V is cached above, but only the last position
                # of each sequence feeds the logits: the rest of the last layer
                # (attention output, o, MLP) runs on those rows alone.
                x = x.view(nb, S, -1)[:, -1].contiguous()
            attn = prefill_attention(q, kc, vc, nb, S, self.scale, last_only=i == last, window=c.sliding_window)
            del q
            h = ops.linear_add_rmsnorm(attn, layer.o, x, layer.post_norm, eps)
            del attn
            h = self._prefill_mlp(h, layer, x, self._next_norm(i))
        return ops.linear(h, self.w.lm_head)

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
        return self.ops.argmax(self.decode_logits(tokens, positions, lengths), out=out)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """BF16 logits [B, vocab] of one decode step (the step `decode` takes the argmax of)."""
        c, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        B = tokens.shape[0]
        x, h = ops.embed_rmsnorm(tokens, self.w.embed, self.w.layers[0].input_norm, eps)
        for i, layer in enumerate(self.w.layers):
            kc, vc = self.k_cache[i, :B], self.v_cache[i, :B]
            qkv = ops.linear(h, layer.qkv)
            q = ops.qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, positions, 1,
                                       kc, vc, eps, c.num_heads, c.num_kv_heads)
            attn = ops.decode_attention(q, kc, vc, lengths, self.scale, window=c.sliding_window)
            h = ops.linear_add_rmsnorm(attn.view(B, c.q_size), layer.o, x, layer.post_norm, eps)
            h = ops.linear_add_rmsnorm(ops.linear_silu_mul(h, layer.gate_up), layer.down, x, self._next_norm(i), eps)
        return ops.linear(h, self.w.lm_head)
