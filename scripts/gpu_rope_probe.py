"""Where does the fused q/k-norm + RoPE kernel part from its torch reference?
Stage by stage on the GPU: the per-head norm alone, RoPE alone on BF16 input,
and the whole kernel, each as the fraction of elements that differ from torch
and the worst difference in BF16 ulps; plus two rsqrt variants."""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))
from fqkernels.rmsnorm import rmsnorm_reference  # noqa: E402
from fqkernels.rope_kv import _rotate_half, qk_norm_rope_store, qk_norm_rope_store_reference, rope_tables  # noqa: E402


@triton.jit
def _norm(x_ptr, w_ptr, o_ptr, eps, D: tl.constexpr, MODE: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, D)
    x = tl.load(x_ptr + r * D + offs).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    if MODE == 0:
        inv = tl.rsqrt(var + eps)
    else:
        inv = 1.0 / tl.sqrt_rn(var + eps)
    y = (x * inv).to(tl.bfloat16)
    w = tl.load(w_ptr + offs)
    tl.store(o_ptr + r * D + offs, (y.to(tl.float32) * w.to(tl.float32)).to(tl.bfloat16))


@triton.jit
def _rope(n_ptr, c_ptr, s_ptr, o_ptr, D: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, D)
    rot = (offs + D // 2) % D
    n = tl.load(n_ptr + r * D + offs).to(tl.float32)
    nr = tl.load(n_ptr + r * D + rot).to(tl.float32)
    nr = tl.where(offs < D // 2, -nr, nr)
    c = tl.load(c_ptr + r * D + offs).to(tl.float32)
    s = tl.load(s_ptr + r * D + offs).to(tl.float32)
    a = (n * c).to(tl.bfloat16)
    b = (nr * s).to(tl.bfloat16)
    tl.store(o_ptr + r * D + offs, (a.to(tl.float32) + b.to(tl.float32)).to(tl.bfloat16))


def stat(a, b):
    a, b = a.float(), b.float()
    d = a != b
    ulp = torch.maximum(a.abs(), b.abs()).clamp_min(1e-30) * 2.0 ** -8
    return {"frac_differ": float(d.float().mean()), "max_ulps": float(((a - b).abs() / ulp).max())}


def main():
    dev = "cuda"
    torch.manual_seed(0)
    R, D = 4096, 128
    x = (torch.randn(R, D, device=dev) * 3).bfloat16()
    w = torch.randn(D, device=dev).bfloat16()
    out = {}
    ref = rmsnorm_reference(x, w, 1e-6)
    for mode in (0, 1):
        o = torch.empty_like(x)
        _norm[(R,)](x, w, o, 1e-6, D=D, MODE=mode)
        out[f"norm_mode{mode}"] = stat(o, ref)
    cos, sin = rope_tables(D, 5e6, 8192, torch.device(dev))
    pos = torch.randint(0, 8192, (R,), device=dev)
    c, s = cos[pos].contiguous(), sin[pos].contiguous()
    n = ref
    o = torch.empty_like(n)
    _rope[(R,)](n, c, s, o, D=D)
    out["rope_only"] = stat(o, n * c + _rotate_half(n) * s)
    # the whole kernel, Q heads only
    H, KVH, T = 32, 8, 128
    qkv = (torch.randn(T, (H + 2 * KVH) * D, device=dev) * 3).bfloat16()
    qn, kn = torch.randn(D, device=dev).bfloat16(), torch.randn(D, device=dev).bfloat16()
    start = torch.zeros(T, dtype=torch.int32, device=dev) + torch.arange(T, device=dev, dtype=torch.int32) * 37
    kc = torch.zeros(T, KVH, 8192, D, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    q1 = qk_norm_rope_store(qkv, qn, kn, cos, sin, start, 1, kc, vc, 1e-6, H, KVH)
    q2 = qk_norm_rope_store_reference(qkv, qn, kn, cos, sin, start, 1, kc.clone(), vc.clone(), 1e-6, H, KVH)
    out["fused_q"] = stat(q1, q2)
    qn_only = rmsnorm_reference(qkv[:, :H * D].reshape(T, H, D), qn, 1e-6)
    o = torch.empty(T * H, D, device=dev, dtype=torch.bfloat16)
    _norm[(T * H,)](qkv[:, :H * D].contiguous().reshape(T * H, D), qn, o, 1e-6, D=D, MODE=0)
    out["norm_on_q_heads"] = stat(o.view(T, H, D), qn_only)
    print(json.dumps(out, indent=1))
    with open(os.path.join(os.environ.get("OUT", "."), "rope_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
