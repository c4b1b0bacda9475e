"""SwiGLU activation on a packed gate/up product.

out = bf16( bf16(silu(g)) * u ), g = gu[:, :I], u = gu[:, I:], both already BF16.
SiLU is evaluated in float32 (expf, exact division) on the BF16 g and rounded to BF16 before the
multiply by up: the reference's `act_fn(gate_proj(x)) * up_proj(x)` in BF16.
Shapes: gu [M, 2I] bf16 (unit stride on the last dim); out [M, I] bf16.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp_f32(x, INTERPRETED: tl.constexpr):
    """expf as PyTorch's CUDA kernels call it (libdevice __nv_expf; Triton's tl.exp is a faster
    approximation whose last bits differ); numpy's exp under the CPU interpreter, which has
    no libdevice."""
    if INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def silu_f32(x, INTERPRETED: tl.constexpr):
    """PyTorch's CUDA SiLU of fp32 x: x / (1 + expf(-x)), the division correctly rounded
    (Triton's default `/` is an approximation that can move the BF16 rounding of the result)."""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x, INTERPRETED))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_o, BLOCK: tl.constexpr,
                     INTERPRETED: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + I + offs, mask=mask, other=0.0)
    act = silu_f32(g, INTERPRETED).to(tl.bfloat16)
    out = (act.to(tl.float32) * u.to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def silu_mul(gu: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    if gu.dtype != torch.bfloat16 or gu.dim() != 2 or gu.stride(-1) != 1:
        raise ValueError(f"gu must be a 2-D bfloat16 tensor with unit last stride, got {gu.dtype} {tuple(gu.shape)}")
    if gu.shape[1] % 2:
        raise ValueError(f"gu's last dim {gu.shape[1]} is not even (gate and up halves)")
    M, I = gu.shape[0], gu.shape[1] // 2
    if out is None:
        out = torch.empty((M, I), dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(M, triton.cdiv(I, block))](gu, out, I, gu.stride(0), out.stride(0), BLOCK=block,
                                                  INTERPRETED=_INTERPRETED, num_warps=4)
    return out


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


_INTERPRETED = type(_silu_mul_kernel).__name__ == "InterpretedFunction"

