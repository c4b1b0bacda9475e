"""Qwen3.5's attention output gate in one kernel (swiglu.sigmoid_gate_mul) against the torch ops
it replaces (sigmoid_gate_mul_reference: `attn * torch.sigmoid(gate)`), on the views the model
passes: the gate read in place from q_proj's rows (per head [query | gate]), the attention output
as decode_attention's rows or SDPA's transposed heads. On a GPU bit for bit; under Triton's CPU
interpreter (Triton >= 3.4) for the logic, within a BF16 ulp (numpy's expf is not libdevice's)
or, where a subnormal sigmoid enters the product, by less than 2^-120 (the interpreter converts
subnormal BF16 to float32 wrongly: bf16 6.06e-39 becomes 3.67e-40)."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_modules import ENGINE_DIR, KERNEL_DEVICE, KERNELS_RUN, KERNELS_SKIP_REASON

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels.swiglu import sigmoid_gate_mul, sigmoid_gate_mul_reference  # noqa: E402

DEV = KERNEL_DEVICE
# the kernel tests: selected by `-m gpu` on a GPU machine, and run under the interpreter too
needs_kernels = pytest.mark.skipif(not KERNELS_RUN, reason=KERNELS_SKIP_REASON)


@pytest.fixture(autouse=True)
def _bf16_rounding(interpreter_bf16_rounding):
    """tests/kernels/conftest.py: under the interpreter, fp32 -> bf16 rounds as on the GPU."""


def _views(B, T, H, D, seed, sdpa_layout):
    """(attn, gate) as the model holds them: gate = q_proj's output viewed per head [query | gate],
    its second half; attn [B, T, H, D] from SDPA's [B, H, T, D] (transposed) or decode_attention's
    [B, H, D] (unsqueezed)."""
    g_ = torch.Generator().manual_seed(seed)
    qp = (torch.randn(B, T, H * 2 * D, generator=g_) * 6).bfloat16().to(DEV)
    gate = qp.view(B, T, H, 2 * D)[..., D:]
    if sdpa_layout:
        attn = torch.randn(B, H, T, D, generator=g_).bfloat16().to(DEV).transpose(1, 2)
    else:
        attn = torch.randn(B, H, D, generator=g_).bfloat16().to(DEV).unsqueeze(1)
    return attn, gate


def _assert_matches(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    if DEV == "cuda":
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} outputs differ"
        return
    a, b = out.float(), ref.float()
    ulp = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7 + 2.0 ** -120
    assert ((a - b).abs() <= ulp).all(), "more than one bf16 ulp apart"
    assert ((a - b).abs() > 2.0 ** -120).float().mean() <= 1e-2, "many outputs an ulp apart"


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("B,H,D", [(1, 16, 256), (5, 16, 256), (3, 4, 64), (2, 3, 80)])
@pytest.mark.parametrize("prompt", [False, True], ids=["decode", "prompt"])
def test_gate_is_the_torch_ops(B, H, D, prompt):
    """Decode rows (T = 1, attn from decode_attention) and prompt rows (T = 37, attn SDPA's
    transposed output); D = 80 is not a power of two (masked lanes)."""
    T = 37 if prompt else 1
    attn, gate = _views(B, T, H, D, seed=B * D + T, sdpa_layout=prompt)
    _assert_matches(sigmoid_gate_mul(attn, gate), sigmoid_gate_mul_reference(attn, gate))


@pytest.mark.gpu
@needs_kernels
def test_saturated_and_special_gates():
    """Gates far past the sigmoid's bend (0 and 1 exactly), +-inf, and zeros; NaN propagates."""
    D = 64
    g = torch.tensor([-200.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 17.0, 30.0, 200.0, float("inf"), float("-inf"),
                      float("nan")]).repeat(D)[:D].bfloat16()
    gate = g.view(1, 1, 1, D).to(DEV)
    attn = torch.linspace(-3, 3, D).bfloat16().view(1, 1, 1, D).to(DEV)
    out, ref = sigmoid_gate_mul(attn, gate), sigmoid_gate_mul_reference(attn, gate)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    _assert_matches(out.masked_fill(nan, 0), ref.masked_fill(nan, 0))


def test_bad_inputs_are_named():
    """Checked before any launch: runs everywhere."""
    x = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \(1, 1, 4, 64\) and gate \(1, 1, 4, 32\) must both be"):
        sigmoid_gate_mul(x, torch.zeros(1, 1, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must both be"):
        sigmoid_gate_mul(x[0], x[0])
    with pytest.raises(ValueError, match="gate must be bfloat16 .* got torch.float32"):
        sigmoid_gate_mul(x, x.float())
    with pytest.raises(ValueError, match=r"x must be bfloat16 with unit stride .* strides \(256, 256, 1, 4\)"):
        sigmoid_gate_mul(x.transpose(2, 3).contiguous().transpose(2, 3), x)
