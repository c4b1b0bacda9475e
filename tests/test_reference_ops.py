"""The engine's pure-torch reference ops are Transformers' own functions, bit
for bit: they are what every Triton kernel is tested against."""
import sys

import pytest
import torch

from engine_modules import ENGINE_DIR

sys.path.insert(0, str(ENGINE_DIR))

from fqkernels.rmsnorm import add_rmsnorm_reference, rmsnorm_reference  # noqa: E402
from fqkernels.rope_kv import qk_norm_rope_store_reference, rope_tables  # noqa: E402
from fqkernels.swiglu import silu_mul_reference  # noqa: E402

qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")


@pytest.mark.parametrize("rows,n", [(1, 64), (7, 2560), (3, 100)])
def test_rmsnorm_is_transformers(rows, n):
    x = torch.randn(rows, n).mul(3).bfloat16()
    norm = qwen3.Qwen3RMSNorm(n, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n).bfloat16())
        assert torch.equal(rmsnorm_reference(x, norm.weight, 1e-6), norm(x))
        r = torch.randn(rows, n).bfloat16()
        x2 = x.clone()
        out = add_rmsnorm_reference(x2, r, norm.weight, 1e-6)
        assert torch.equal(x2, x + r)
        assert torch.equal(out, norm(x + r))


def test_silu_mul_is_transformers_mlp_activation():
    gu = torch.randn(5, 2 * 96).mul(4).bfloat16()
    g, u = gu.chunk(2, dim=-1)
    assert torch.equal(silu_mul_reference(gu), torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("heads,kv_heads,head_dim,theta", [(4, 2, 64, 1e6), (32, 8, 128, 5e6)])
def test_qk_norm_rope_store_is_transformers(heads, kv_heads, head_dim, theta):
    B, S, cap = 2, 9, 32
    start = torch.tensor([0, 5], dtype=torch.int32)
    cfg = qwen3.Qwen3Config(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, rope_theta=theta, max_position_embeddings=4096)
    rotary = qwen3.Qwen3RotaryEmbedding(cfg)
    qkv = torch.randn(B * S, (heads + 2 * kv_heads) * head_dim).mul(2).bfloat16()
    qn, kn = torch.randn(head_dim).bfloat16(), torch.randn(head_dim).bfloat16()
    cos, sin = rope_tables(head_dim, theta, 64, torch.device("cpu"))
    kc = torch.zeros(B, kv_heads, cap, head_dim, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    q = qk_norm_rope_store_reference(qkv, qn, kn, cos, sin, start, S, kc, vc, 1e-6, heads, kv_heads)

    q_norm = qwen3.Qwen3RMSNorm(head_dim, eps=1e-6).bfloat16()
    k_norm = qwen3.Qwen3RMSNorm(head_dim, eps=1e-6).bfloat16()
    with torch.no_grad():
        q_norm.weight.copy_(qn)
        k_norm.weight.copy_(kn)
        for b in range(B):
            rows = qkv[b * S:(b + 1) * S]
            hq, hk, hv = rows.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            pos = torch.arange(S)[None] + int(start[b])
            c, s = rotary(rows[None], pos)
            ref_q = q_norm(hq.view(1, S, heads, head_dim)).transpose(1, 2)
            ref_k = k_norm(hk.view(1, S, kv_heads, head_dim)).transpose(1, 2)
            ref_q, ref_k = qwen3.apply_rotary_pos_emb(ref_q, ref_k, c, s)
            assert torch.equal(q[b * S:(b + 1) * S], ref_q[0].transpose(0, 1))
            p0 = int(start[b])
            assert torch.equal(kc[b, :, p0:p0 + S], ref_k[0])
            assert torch.equal(vc[b, :, p0:p0 + S], hv.view(S, kv_heads, head_dim).transpose(0, 1))
