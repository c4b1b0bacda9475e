"""Distance to the limit: the physical floor of each workload, from the model config and two ceilings.

The ceilings are measured once per run (a device-to-device copy for bandwidth, counting bytes
read plus written; a bf16 matmul for the compute rate). The floors follow ANCHORS.md:
- prefill: max(FLOPs / rate, weight bytes / bandwidth): it must at least read every weight once;
- decode step at context c: (weight bytes + batch x c x KV bytes per token) / bandwidth, since each
  step reads every weight and the whole KV cache once (no speculation assumed).
The engine's fraction of the floor is floor / actual: 1.0 would be the hardware limit.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """The few config values the arithmetic needs, read once from config.json."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    attention_bias: bool
    window: int | None = None  # sliding_window: keys a query sees (Transformers 4.51.3 windows every layer)

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelShape | HybridShape":
        from fastqwen.refenv import QWEN35_MODEL_TYPES

        if cfg.get("model_type") in QWEN35_MODEL_TYPES:
            return HybridShape.from_config(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            vocab=int(cfg["vocab_size"]),
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        )


@dataclass(frozen=True)
class HybridShape:
    """Qwen3.5 (../shared/QWEN35.md section 5): Gated DeltaNet layers with an fp32 state per
    value head that a decode step reads and writes whole, a conv state, and gated
    full-attention layers with a KV cache."""

    vocab: int
    hidden: int
    attn_layers: int
    gdn_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_dim: int
    conv_width: int
    parameters: int
    embedding: int

    @classmethod
    def from_config(cls, cfg: dict) -> "HybridShape":
        from fastqwen.checkpoint import qwen35_expected_tensors, qwen35_layer_types

        cfg = cfg.get("text_config", cfg) if cfg.get("model_type") == "qwen3_5" else cfg
        specs = qwen35_expected_tensors(cfg)
        kinds = cfg.get("layer_types") or qwen35_layer_types(int(cfg["num_hidden_layers"]))
        kh, kd, vh, vd = (int(cfg[k]) for k in ("linear_num_key_heads", "linear_key_head_dim",
                                                  "linear_num_value_heads", "linear_value_head_dim"))
        vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
        return cls(vocab=vocab, hidden=hidden, attn_layers=kinds.count("full_attention"),
                   gdn_layers=kinds.count("linear_attention"), heads=int(cfg["num_attention_heads"]),
                   kv_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]), v_heads=vh, k_dim=kd,
                   v_dim=vd, conv_dim=2 * kh * kd + vh * vd, conv_width=int(cfg.get("linear_conv_kernel_dim", 4)),
                   parameters=sum(math.prod(shape) for _, shape in specs),
                   embedding=vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2))

    def state_bytes_per_sequence(self) -> int:
        """Read and written by every decode step: the fp32 recurrent states and the bf16 conv states."""
        recurrent = self.gdn_layers * self.v_heads * self.k_dim * self.v_dim * 4
        conv = self.gdn_layers * self.conv_dim * self.conv_width * BF16_BYTES
        return 2 * (recurrent + conv)

    def gdn_flops_per_token(self) -> float:
        """The chunked delta rule (chunk 64) per token: the within-chunk products and the state's."""
        return self.gdn_layers * self.v_heads * (4 * 64 * (self.k_dim + self.v_dim) + 4 * self.k_dim * self.v_dim)


def layer_params(s: ModelShape) -> int:
    q = s.hidden * s.heads * s.head_dim
    kv = 2 * s.hidden * s.kv_heads * s.head_dim
    o = s.heads * s.head_dim * s.hidden
    mlp = 3 * s.hidden * s.intermediate
    # input and post-attention RMSNorm weights, plus Qwen3's per-head q_norm and k_norm.
    norms = 2 * s.hidden + 2 * s.head_dim
    bias = (s.heads + 2 * s.kv_heads) * s.head_dim + s.hidden if s.attention_bias else 0
    return q + kv + o + mlp + norms + bias


def embedding_params(s: ModelShape) -> int:
    """Embedding plus LM head; a tied LM head is the same matrix and is counted once."""
    return s.vocab * s.hidden * (1 if s.tied else 2)


def parameter_count(s: ModelShape) -> int:
    if isinstance(s, HybridShape):
        return s.parameters
    return embedding_params(s) + s.layers * layer_params(s) + s.hidden  # + final norm


def non_embedding_params(s: ModelShape) -> int:
    return parameter_count(s) - (s.embedding if isinstance(s, HybridShape) else embedding_params(s))


def weight_bytes(s: ModelShape) -> int:
    return parameter_count(s) * BF16_BYTES


def kv_bytes_per_token(s: ModelShape) -> int:
    # K and V, every (attention) layer, every KV head, bf16.
    layers = s.attn_layers if isinstance(s, HybridShape) else s.layers
    return 2 * layers * s.kv_heads * s.head_dim * BF16_BYTES


def attended_keys(s: ModelShape, context: float) -> float:
    """Keys one query at this context length must read: all of them, or the window's."""
    return context if isinstance(s, HybridShape) or s.window is None else min(context, s.window)


def prefill_flops(s: ModelShape, batch: int, prompt: int) -> float:
    """Matmul FLOPs of one prefill: dense layers, causal attention (half the square, or the
    window's band), last-token LM head."""
    dense = 2 * non_embedding_params(s) * batch * prompt
    pairs = prompt * prompt / 2
    if isinstance(s, HybridShape):
        attention = 2 * 2 * s.attn_layers * s.heads * s.head_dim * pairs * batch
        return dense + attention + s.gdn_flops_per_token() * batch * prompt + 2 * s.vocab * s.hidden * batch
    if s.window is not None and prompt > s.window:
        pairs = s.window * s.window / 2 + (prompt - s.window) * s.window
    attention = 2 * 2 * s.layers * s.heads * s.head_dim * pairs * batch
    lm_head = 2 * s.vocab * s.hidden * batch
    return dense + attention + lm_head


@dataclass(frozen=True)
class Ceilings:
    bandwidth_bytes_s: float  # device-to-device copy, bytes read + written per second
    matmul_flops_s: float  # bf16 matmul
    matmul_size: int
    copy_bytes: int
    device: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Floors:
    ttft_s: float
    tpot_s: float | None
    total_s: float
    throughput: float
    median_step_bytes: float

    def to_json(self) -> dict:
        return asdict(self)


def decode_step_bytes(s: ModelShape, batch: int, context: float) -> float:
    state = s.state_bytes_per_sequence() if isinstance(s, HybridShape) else 0
    return weight_bytes(s) + batch * (attended_keys(s, context) * kv_bytes_per_token(s) + state)


def floors(s: ModelShape, c: Ceilings, batch: int, prompt: int, output: int) -> Floors:
    """The fastest the workload could run on this device without speculation."""
    ttft = max(prefill_flops(s, batch, prompt) / c.matmul_flops_s, weight_bytes(s) / c.bandwidth_bytes_s)
    # Step k (1..output-1) produces token k while attending to prompt + k cached positions.
    decode = sum(decode_step_bytes(s, batch, prompt + k) for k in range(1, output)) / c.bandwidth_bytes_s
    total = ttft + decode
    return Floors(
        ttft_s=ttft,
        tpot_s=decode / (output - 1) if output > 1 else None,
        total_s=total,
        throughput=batch * output / total,
        median_step_bytes=decode_step_bytes(s, batch, prompt + output / 2),
    )


def distance(f: Floors, ttft_s: float | None, tpot_s: float | None, total_s: float | None) -> dict:
    """Fractions of the floor the engine reached (floor / actual) and its achieved decode bandwidth."""

    def frac(floor: float | None, actual: float | None) -> float | None:
        return floor / actual if floor is not None and actual else None

    return {
        "ttft_fraction": frac(f.ttft_s, ttft_s),
        "tpot_fraction": frac(f.tpot_s, tpot_s),
        # floor throughput / actual throughput inverted: actual / floor = floor total / actual total.
        "throughput_fraction": frac(f.total_s, total_s),
        "decode_gb_s": f.median_step_bytes / tpot_s / 1e9 if tpot_s else None,
    }


def model_summary(s: ModelShape) -> dict:
    return {
        "parameters": parameter_count(s),
        "non_embedding_parameters": non_embedding_params(s),
        "weight_bytes": weight_bytes(s),
        "kv_bytes_per_token": kv_bytes_per_token(s),
    }


def measure_ceilings(device: str) -> Ceilings:
    """Best-of-several copy bandwidth and bf16 matmul rate; large shapes on CUDA, small on CPU."""
    import time

    import torch

    on_cuda = device == "cuda"
    copy_elems = (1 << 30) // 2 if on_cuda else (64 << 20) // 2  # 1 GiB or 64 MiB of bf16
    size = 8192 if on_cuda else 512
    reps = 10 if on_cuda else 3
    dev = torch.device(device)
    src = torch.empty(copy_elems, dtype=torch.bfloat16, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    a = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=dev)

    def best(fn) -> float:
        fn()  # warm up allocator, cuBLAS heuristics, caches
        times = []
        for _ in range(reps):
            if on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return min(times)

    copy_s = best(lambda: dst.copy_(src))
    mm_s = best(lambda: torch.mm(a, b))
    copy_bytes = 2 * copy_elems * BF16_BYTES  # read + written
    return Ceilings(
        bandwidth_bytes_s=copy_bytes / copy_s,
        matmul_flops_s=2 * size**3 / mm_s,
        matmul_size=size,
        copy_bytes=copy_bytes,
        device=device,
    )
