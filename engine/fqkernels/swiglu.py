"""Gated activations, with PyTorch's CUDA bits.

silu_mul: SwiGLU on a packed gate/up product.
    out = bf16( bf16(silu(g)) * u ), g = gu[:, :I], u = gu[:, I:], both already BF16.
    SiLU is evaluated in float32 (expf, exact division) on the BF16 g and rounded to BF16 before
    the multiply by up: the reference's `act_fn(gate_proj(x)) * up_proj(x)` in BF16.
    Shapes: gu [M, 2I] bf16 (unit stride on the last dim); out [M, I] bf16.
sigmoid_gate_mul: Qwen3.5's attention output gate, `attn * torch.sigmoid(gate)` in BF16.
    out = bf16( x * bf16(sigmoid(g)) ), sigmoid(g) = 1 / (1 + expf(-g)) in float32 (exact
    division), as PyTorch's CUDA sigmoid evaluates it on a BF16 tensor; the BF16 x BF16
    product is exact in float32 and rounded once. One kernel, reading g in place where it is a
    view (per head [query | gate] of q_proj's rows), where the torch ops took three (the copy of
    the strided gate, the sigmoid, the multiply).
    Shapes: x, g [B, T, H, D] bf16 (unit stride on D, any other strides); out [B, T, H * D] bf16.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fqkernels import pdl


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
def sigmoid_f32(x, INTERPRETED: tl.constexpr):
    """PyTorch's CUDA sigmoid of fp32 x: 1 / (1 + expf(-x)), the division correctly rounded, a
    subnormal quotient kept (x in about (-88.7, -87.3); expf(-x) overflows below): Triton 3.1
    compiles tl.math.div_rn to div.rn.ftz.f32, which flushes it to zero (3.6: div.rn.f32), so
    the division is written out in PTX; numpy's division under the CPU interpreter."""
    one = tl.full(x.shape, 1.0, tl.float32)
    den = 1.0 + exp_f32(-x, INTERPRETED)
    if INTERPRETED:
        return tl.math.div_rn(one, den)
    else:
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [one, den], dtype=tl.float32,
                                         is_pure=True, pack=1)


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


@triton.jit
def _sigmoid_gate_mul_kernel(x_ptr, g_ptr, out_ptr, T, H, stride_xb, stride_xt, stride_xh,
                             stride_gb, stride_gt, stride_gh, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             INTERPRETED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (token b * T + t, head h): out[token, h * D:(h + 1) * D] = bf16(x * bf16(sigmoid(g)))
    of that head's row; int64 offsets (a long prompt's gate view spans q_proj's whole output)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    b = row // T
    t = row % T
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    pdl.start(PDL)  # x and g come from earlier kernels
    x = tl.load(x_ptr + b * stride_xb + t * stride_xt + head * stride_xh + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + b * stride_gb + t * stride_gt + head * stride_gh + offs, mask=mask, other=0.0)
    gate = sigmoid_f32(g.to(tl.float32), INTERPRETED).to(tl.bfloat16)
    out = (x.to(tl.float32) * gate.to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + (row * H + head) * D + offs, out, mask=mask)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) with PyTorch's CUDA bits (sigmoid_gate_mul_reference), one kernel: x, gate
    [B, T, H, D] bf16 with unit stride on D (views: strides of B, T and H are read as they are);
    returns [B, T, H * D] bf16, contiguous. Decode-sized launches (B * T <= pdl.MAX_ROWS) use PDL."""
    if x.dim() != 4 or gate.shape != x.shape:
        raise ValueError(f"sigmoid_gate_mul: x {tuple(x.shape)} and gate {tuple(gate.shape)} must both be "
                         "[B, T, H, D]")
    for name, t in (("x", x), ("gate", gate)):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError(f"sigmoid_gate_mul: {name} must be bfloat16 with unit stride on its last dim, "
                             f"got {t.dtype} with strides {t.stride()}")
    B, T, H, D = x.shape
    out = torch.empty((B, T, H * D), dtype=torch.bfloat16, device=x.device)
    use_pdl, pdl_launch = pdl.for_rows(B * T)
    block_d = triton.next_power_of_2(D)
    _sigmoid_gate_mul_kernel[(B * T, H)](x, gate, out, T, H, x.stride(0), x.stride(1), x.stride(2),
                                         gate.stride(0), gate.stride(1), gate.stride(2), D=D, BLOCK_D=block_d,
                                         INTERPRETED=_INTERPRETED, PDL=use_pdl,
                                         num_warps=max(1, min(4, block_d // 256)), **pdl_launch)
    return out


def sigmoid_gate_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The reference's `attn_output * torch.sigmoid(gate)` (Transformers 5.17's Qwen3.5 attention) on
    x, gate [B, T, H, D], both flattened to [B, T, H * D] first as the reference holds them."""
    B, T = x.shape[:2]
    return x.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))


_INTERPRETED = type(_silu_mul_kernel).__name__ == "InterpretedFunction"

