"""The two op sets the model runs on: Triton kernels on a GPU, their pure-torch
references on the CPU. Both take the same arguments, so the model code is one.

Choosing the set is explicit (by device), never a silent fallback: a kernel
that fails on the GPU raises.
"""
import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: int, seq_len: int, scale: float) -> torch.Tensor:
    """Causal attention over a fresh prompt: q [B*S, H, D] against cache[:, :, :S].

    GQA by expanding K/V per group, then SDPA (flash backend on the GPU), as the
    reference's sdpa path does. Returns [B*S, H*D] BF16.
    """
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[1]
    qh = q.view(batch, seq_len, H, D).transpose(1, 2)
    k = k_cache[:batch, :, :seq_len].repeat_interleave(group, dim=1)
    v = v_cache[:batch, :, :seq_len].repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
    return o.transpose(1, 2).reshape(batch * seq_len, H * D)


class TorchOps:
    """Reference ops: exact Transformers semantics, any device. The CPU path."""

    name = "torch"

    def __init__(self):
        from fqkernels.decode_attention import decode_attention_reference
        from fqkernels.rmsnorm import add_rmsnorm_reference, rmsnorm_reference
        from fqkernels.rope_kv import qk_norm_rope_store_reference
        from fqkernels.swiglu import silu_mul_reference

        self.rmsnorm = rmsnorm_reference
        self.add_rmsnorm = add_rmsnorm_reference
        self.qk_norm_rope_store = qk_norm_rope_store_reference
        self.decode_attention = decode_attention_reference
        self.silu_mul = silu_mul_reference

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def linear_silu_mul(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        return self.silu_mul(F.linear(x, w_gate_up))


class TritonOps(TorchOps):
    """Fused Triton kernels for everything around the matrix products (CUDA only)."""

    name = "triton"

    def __init__(self):
        super().__init__()
        from fqkernels.decode_attention import decode_attention
        from fqkernels.rmsnorm import add_rmsnorm, rmsnorm
        from fqkernels.rope_kv import qk_norm_rope_store
        from fqkernels.swiglu import silu_mul

        self.rmsnorm = rmsnorm
        self.add_rmsnorm = add_rmsnorm
        self.qk_norm_rope_store = qk_norm_rope_store
        self.decode_attention = decode_attention
        self.silu_mul = silu_mul


def ops_for(device: torch.device):
    return TritonOps() if device.type == "cuda" else TorchOps()
