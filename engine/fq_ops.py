"""The two op sets the model runs on: Triton kernels on a GPU, their pure-torch
references on the CPU. Both take the same arguments, so the model code is one.

Choosing the set is explicit (by device), never a silent fallback: a kernel
that fails on the GPU raises.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: int, seq_len: int, scale: float, last_only: bool = False,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention over a fresh prompt: q [B*S, H, D] against cache[:, :, :S].

    With a sliding `window` and a prompt of at least `window` tokens, the reference
    builds an explicit mask and SDPA runs its masked kernel: `_windowed_attention`
    does the same. A shorter prompt loses no key to the window, and the reference
    runs plain causal attention then, as below.

    SDPA's flash backend on the GPU, as the reference's sdpa path runs on the
    platform's torch 2.5.1. Newer torch would pick cuDNN attention first on Hopper
    (different tiles, different rounding), so the backends are named: flash, then
    memory-efficient, then math, never cuDNN. On the GPU the causal prompt pass
    hands flash the unexpanded K/V (enable_gqa: the kernel reads KV head h // G for
    query head h, the same arithmetic as on repeated K/V, without writing the
    repeated copy: TTFT at (4, 2048) -4.7 ms, PERF_LOG session 3); the one-row `last_only` pass and
    the CPU expand K/V per group as the reference's repeat_kv does (with one query
    row flash would fold the group into rows and pick other splits).
    Returns [B*S, H*D] BF16, or with `last_only` [B, H*D] for each sequence's last
    position (which sees every key, so no mask).
    """
    global _FLASH_GQA
    if window is not None and seq_len >= window:
        return _windowed_attention(q, k_cache, v_cache, batch, seq_len, scale, last_only, window)
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[1]
    qh = q.view(batch, seq_len, H, D)
    if last_only:
        qh = qh[:, -1:]
    qh = qh.transpose(1, 2)
    k, v = k_cache[:batch, :, :seq_len], v_cache[:batch, :, :seq_len]
    if q.is_cuda and not last_only and group > 1 and _FLASH_GQA is not False:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
            _FLASH_GQA = True
            return o.transpose(1, 2).reshape(-1, H * D)
        except RuntimeError:
            if _FLASH_GQA:  # it ran before: this is a real error, not a missing feature
                raise
            _FLASH_GQA = False  # this build's flash has no GQA: expand, as below
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(qh, expand_kv(k, group), expand_kv(v, group),
                                           is_causal=not last_only, scale=scale)
    return o.transpose(1, 2).reshape(-1, H * D)


def prefix_mask(first: int, keys: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[keys - first, keys] bool: query position p in [first, keys) sees key j <= p (and j > p -
    window with a window), the causal mask of a continued prompt, aligned at the bottom right."""
    qpos = torch.arange(first, keys, device=device)[:, None]
    kpos = torch.arange(keys, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, seq_len: int, start: int,
                     scale: float, last_only: bool = False, window: int | None = None) -> torch.Tensor:
    """Attention of a continued prompt's queries (positions [start, start + seq_len), q [B*S, H, D])
    over the keys of positions [0, start + seq_len) (k, v [B, KVH, start + S, D], the cached ones
    first): query position p sees keys j <= p (and j > p - window with a window), the causal mask
    aligned at the bottom right. SDPA with that boolean mask on K/V expanded per query head (its
    memory-efficient kernel on the GPU, math on the CPU): the same function as a whole prompt's
    attention, in another kernel's arithmetic. Returns [B*S, H*D], or with `last_only` [B, H*D]."""
    H, D = q.shape[1], q.shape[2]
    group = H // k.shape[1]
    qh = q.view(batch, seq_len, H, D)
    first = seq_len - 1 if last_only else 0
    qh = qh[:, first:].transpose(1, 2)
    mask = prefix_mask(start + first, start + seq_len, q.device, window)
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(qh, expand_kv(k, group), expand_kv(v, group), attn_mask=mask,
                                           scale=scale)
    return o.transpose(1, 2).reshape(-1, H * D)


# Rows of the additive mask built at once (bf16): bounds a long prompt's mask to ~64 MB.
_MASK_ELEMENTS = 1 << 25


def _windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int,
                        seq_len: int, scale: float, last_only: bool, window: int) -> torch.Tensor:
    """Sliding-window prompt attention, computed as Transformers 4.51.3 computes it.

    Its mask builder, for a forward over S >= window tokens, makes a BF16 [S, S] mask
    holding finfo(bf16).min where key j is hidden from query p (j > p or j <= p - window)
    and -0.0 elsewhere (min times False), and SDPA gets it as attn_mask on K/V repeated
    per query head: flash takes no mask, so its memory-efficient kernel runs (math on
    the CPU). This function makes the same call on the same values, with the query rows
    taken in chunks so the mask stays small: each row's result depends only on its own
    scores, and keys past a chunk's last row are masked for all of its rows (they add
    exp(-huge) = 0 in the same key-block order), so they are left out.
    """
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[1]
    k = expand_kv(k_cache[:batch, :, :seq_len], group)
    v = expand_kv(v_cache[:batch, :, :seq_len], group)
    qh = q.view(batch, seq_len, H, D).transpose(1, 2)
    first = seq_len - 1 if last_only else 0
    rows = max(128, _MASK_ELEMENTS // seq_len // 128 * 128)
    outs = []
    for q0 in range(first, seq_len, rows):
        q1 = min(seq_len, q0 + rows)
        pos = torch.arange(q0, q1, device=q.device)[:, None]
        key = torch.arange(q1, device=q.device)
        mask = torch.full((q1 - q0, q1), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=q.device)
        mask *= (key > pos) | (key <= pos - window)
        with sdpa_kernel(SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(qh[:, :, q0:q1].contiguous(), k[:, :, :q1], v[:, :, :q1],
                                               attn_mask=mask[None, None], scale=scale)
        outs.append(o)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return o.transpose(1, 2).reshape(-1, H * D)


# Whether SDPA's flash backend takes unexpanded GQA K/V here: None until the first
# GPU prefill tries it (that first call is eager, never inside a graph capture).
_FLASH_GQA: bool | None = None


def expand_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[B, KVH, S, D] -> [B, KVH * group, S, D], each KV head repeated for its query
    heads (the reference's repeat_kv); expand + reshape, which a CUDA graph can capture."""
    b, kvh, s, d = kv.shape
    return kv[:, :, None].expand(b, kvh, group, s, d).reshape(b, kvh * group, s, d)


class TorchOps:
    """Reference ops: exact Transformers semantics, any device. The CPU path."""

    name = "torch"

    def __init__(self):
        from fqkernels.argmax import argmax_reference
        from fqkernels.decode_attention import decode_attention_reference
        from fqkernels.rmsnorm import add_rmsnorm_reference, embed_rmsnorm_reference
        from fqkernels.rope_kv import qk_norm_rope_store_reference
        from fqkernels.swiglu import silu_mul_reference

        self.embed_rmsnorm = embed_rmsnorm_reference
        self.add_rmsnorm = add_rmsnorm_reference
        self.qk_norm_rope_store = qk_norm_rope_store_reference
        self.decode_attention = decode_attention_reference
        self.silu_mul = silu_mul_reference
        self.argmax = argmax_reference

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def linear_silu_mul(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        return self.silu_mul(F.linear(x, w_gate_up))

    def linear_add_rmsnorm(self, a: torch.Tensor, w: torch.Tensor, x: torch.Tensor,
                           norm_w: torch.Tensor, eps: float) -> torch.Tensor:
        """x <- bf16(x + a @ w.T) (the residual stream, in place); returns RMSNorm(x) * norm_w."""
        return self.add_rmsnorm(x, self.linear(a, w), norm_w, eps)


class TritonOps(TorchOps):
    """Fused Triton kernels for everything around the matrix products (CUDA only).

    Decode products (few rows) go to our split-K GEMV or to cuBLAS, whichever
    `tune` measured faster for that (rows, matrix shape) on this GPU; prefill
    products (many rows) go to cuBLAS.
    """

    name = "triton"
    GEMV_MAX_ROWS = 64

    def __init__(self):
        super().__init__()
        from fqkernels import gemv
        from fqkernels.argmax import argmax
        from fqkernels.decode_attention import decode_attention
        from fqkernels.rmsnorm import add_rmsnorm, add_rmsnorm_partials, embed_rmsnorm
        from fqkernels.rope_kv import qk_norm_rope_store
        from fqkernels.swiglu import silu_mul

        self.embed_rmsnorm = embed_rmsnorm
        self.add_rmsnorm = add_rmsnorm
        self.add_rmsnorm_partials = add_rmsnorm_partials
        self.qk_norm_rope_store = qk_norm_rope_store
        self.decode_attention = decode_attention
        self.silu_mul = silu_mul
        self.argmax = argmax
        self._gemv = gemv
        self.use_gemv = {}  # (fused_silu, rows, N, K) -> bool, filled by tune()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.use_gemv.get((False, x.shape[0]) + tuple(w.shape)):
            return self._gemv.linear(x.contiguous(), w)
        return F.linear(x, w)

    def linear_silu_mul(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        if self.use_gemv.get((True, x.shape[0]) + tuple(w_gate_up.shape)):
            return self._gemv.linear_silu_mul(x.contiguous(), w_gate_up)
        return self.silu_mul(F.linear(x, w_gate_up))

    def linear_add_rmsnorm(self, a: torch.Tensor, w: torch.Tensor, x: torch.Tensor,
                           norm_w: torch.Tensor, eps: float) -> torch.Tensor:
        """With our GEMV: its fp32 split-K partials go straight into the residual-add +
        RMSNorm kernel, which finishes the product (same bits as GEMV + reduce + add)."""
        if self.use_gemv.get((False, a.shape[0]) + tuple(w.shape)):
            return self.add_rmsnorm_partials(x, self._gemv.linear_partials(a.contiguous(), w), norm_w, eps)
        return super().linear_add_rmsnorm(a, w, x, norm_w, eps)

    def tune(self, weights, rows: int, reps: int = 5) -> dict:
        """For a decode batch of `rows`, time cuBLAS against our GEMV on every
        decode matrix and keep the faster. Each timing is a CUDA graph that
        walks all layers' copies of the matrix, so the weights stream from HBM
        as in a real step instead of sitting in L2, and launch costs are the
        graph's, as in the decode step. Returns {matrix: (cublas_us, gemv_us)}."""
        if rows > self.GEMV_MAX_ROWS:
            return {}
        layers = weights.layers
        dev = weights.embed.device

        def rand(cols):
            return torch.randn(rows, cols, device=dev).to(torch.bfloat16)

        x = rand(weights.embed.shape[1])
        res = rand(weights.embed.shape[1])
        norm_w = layers[0].post_norm
        gemv = self._gemv
        # matrix -> (fused SiLU, the layer copies, our op, cuBLAS's op); each op is
        # timed as the decode step calls it, with what it fuses around the product.
        attn_in, down_in = rand(layers[0].o.shape[1]), rand(layers[0].down.shape[1])
        mats = {
            "qkv": (False, [l.qkv for l in layers],
                    lambda w: gemv.linear(x, w), lambda w: F.linear(x, w)),
            "o": (False, [l.o for l in layers],
                  lambda w: self.add_rmsnorm_partials(res, gemv.linear_partials(attn_in, w), norm_w, 1e-6),
                  lambda w: self.add_rmsnorm(res, F.linear(attn_in, w), norm_w, 1e-6)),
            "gate_up": (True, [l.gate_up for l in layers],
                        lambda w: gemv.linear_silu_mul(x, w), lambda w: self.silu_mul(F.linear(x, w))),
            "down": (False, [l.down for l in layers],
                     lambda w: self.add_rmsnorm_partials(res, gemv.linear_partials(down_in, w), norm_w, 1e-6),
                     lambda w: self.add_rmsnorm(res, F.linear(down_in, w), norm_w, 1e-6)),
            "lm_head": (False, [weights.lm_head],
                        lambda w: gemv.linear(x, w), lambda w: F.linear(x, w)),
        }
        report = {}
        for name, (fused, ws, ours, theirs) in mats.items():
            key = (fused, rows) + tuple(ws[0].shape)
            t_ours = _time_over(ours, ws, reps)
            t_theirs = _time_over(theirs, ws, reps)
            # FASTQWEN_EXACT_DECODE: an in-order GEMV gives the full forward's bits, cuBLAS at
            # decode rows does not (gemv.EXACT): take it whatever the times say.
            exact = gemv.exact_rows(rows) and gemv.in_order(
                gemv.select_config(ws[0].shape[0], ws[0].shape[1], fused, rows))
            self.use_gemv[key] = exact or t_ours < t_theirs
            report[name] = (round(t_theirs, 2), round(t_ours, 2))
        return report


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


def ops_for(device: torch.device):
    return TritonOps() if device.type == "cuda" else TorchOps()
