"""Gated DeltaNet, the linear-attention layers of Qwen3.5: the short causal conv, the
gates, the gated delta rule over an fp32 state, and the gated RMSNorm after it.

This file holds the pure-torch references and, beside them, the Triton kernels the
triton backend of fq_qwen35 runs. The references compute what the Qwen3.5 reference
computes (Transformers 5.17.0's torch fallback: neither flash-linear-attention nor
causal-conv1d installed), operation for operation where the bits depend on it, and the
tests check them bit for bit against it (tests/test_gdn.py); the kernels are gated
against the references and the float64 oracle (tests/kernels/test_gdn_kernels.py).

The rule, per sequence and value head, S [Dk, Dv] in fp32 (S_0: the initial state, or 0):
    q_t, k_t <- x * rsqrt(sum(x^2) + 1e-6) over Dk, in fp32 (l2norm)
    q_t <- q_t * Dk^-0.5
    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
o is rounded to the inputs' dtype once; the state stays fp32. The chunked form (chunk 64,
what every multi-token forward runs) is the same rule rearranged: within a chunk the
updates are solved as one unit-lower triangular system, across chunks S is carried.

Shapes: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H] with H the value heads
(q/k heads already repeated: `expand_heads`); state [B, H, Dk, Dv] fp32.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fqkernels import pdl
from fqkernels.rmsnorm import _inverse, torch_order
from fqkernels.swiglu import exp_f32, sigmoid_f32, silu_f32

CHUNK = 64
EPS = 1e-6


def expand_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """[B, T, Hk, D] -> [B, T, value_heads, D]: value head j reads q/k head j // (value_heads // Hk)
    (each head repeated in place, not the whole set tiled)."""
    ratio = value_heads // x.shape[2]
    if ratio * x.shape[2] != value_heads:
        raise ValueError(f"value heads {value_heads} are not a multiple of q/k heads {x.shape[2]}")
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=2)


def gates_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g fp32, beta in b's dtype): beta = sigmoid(b) in b's dtype (bf16 in the model);
    g = -exp(A_log) * softplus(a + dt_bias) in fp32 (a, A_log promoted; dt_bias as stored)."""
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + EPS)


def _prepare(q, k, v, g, beta, l2norm: bool):
    """fp32 [B, H, T, .] copies; q, k normalized if asked; q scaled by Dk^-0.5."""
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q, k, v, g, beta


def _initial(state, shape, like):
    if state is None:
        return torch.zeros(shape, dtype=torch.float32, device=like.device)
    if state.dtype != torch.float32 or tuple(state.shape) != tuple(shape):
        raise ValueError(f"state must be float32 {tuple(shape)}, got {state.dtype} {tuple(state.shape)}")
    return state.to(like)


def delta_rule_recurrent_reference(q, k, v, g, beta, state=None, l2norm: bool = True):
    """Token by token (the reference's cached one-token step). Returns (o [B, T, H, Dv] in q's
    dtype, final state fp32)."""
    dtype = q.dtype
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    q = q / (Dk ** 0.5)
    S = _initial(state, (B, H, Dk, Dv), v)
    out = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t].unsqueeze(-1)                                  # [B, H, Dk, 1]
        u = (v[:, :, t] - (S * k_t).sum(dim=-2)) * beta[:, :, t].unsqueeze(-1)
        S = S + k_t * u.unsqueeze(-2)
        out[:, :, t] = (S * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), S


def chunked_inputs(q, k, v, g, beta, l2norm: bool = True, chunk: int = CHUNK):
    """The chunked rule's per-position pieces on the reference's ops (T padded with zeros to a
    multiple of `chunk`, n chunks): (q scaled, k, k * beta, v * beta [B, H, n, chunk, D], gamma
    (the log decay from each chunk's start) [B, H, n, chunk])."""
    B, T, H, Dk = k.shape
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    q = q * Dk ** -0.5
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    n = (T + pad) // chunk
    vb, kb = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, kb, vb = (t.reshape(B, H, n, chunk, t.shape[-1]) for t in (q, k, kb, vb))
    gamma = g.reshape(B, H, n, chunk).cumsum(dim=3)                     # log decay from the chunk's start
    return q, k, kb, vb, gamma


def chunk_systems_reference(q, k, kb, gamma):
    """The unit-lower system (k beta) k^T * decay and attn = q k^T * decay [..., chunk, chunk]
    from chunked_inputs' q, k, k * beta and gamma, on the reference's ops."""
    chunk = gamma.shape[-1]
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()  # [.., i, j]
    system = (kb @ k.transpose(-1, -2)) * decay                         # unit-lower: only j < i is used
    attn = (q @ k.transpose(-1, -2)) * decay
    return system, attn


def chunked_pieces(q, k, v, g, beta, l2norm: bool = True, chunk: int = CHUNK, systems=chunk_systems_reference):
    """The chunked rule's pieces before its solves, on the reference's ops (chunked_inputs', then
    `systems`'s): (q scaled, k, v * beta [B, H, n, chunk, D], gamma [B, H, n, chunk], the
    unit-lower system (k beta) k^T * decay and attn = q k^T * decay [B, H, n, chunk, chunk],
    (k beta) * exp(gamma))."""
    q, k, kb, vb, gamma = chunked_inputs(q, k, v, g, beta, l2norm, chunk)
    system, attn = systems(q, k, kb, gamma)
    return q, k, vb, gamma, system, attn, kb * gamma.exp().unsqueeze(-1)


def delta_rule_chunked_reference(q, k, v, g, beta, state=None, l2norm: bool = True, chunk: int = CHUNK,
                                 capture: int | None = None):
    """The chunked form (every multi-token forward of the reference). T is padded with zeros
    to a multiple of `chunk` (padded steps have k = beta = g = 0: S passes through them).
    Returns (o [B, T, H, Dv] in q's dtype, final state fp32), and with capture=c the state at
    chunk c's start as a third (the state after c * chunk steps: a snapshot, fq_qwen35)."""
    dtype = q.dtype
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, vb, gamma, system, attn, kb_decayed = chunked_pieces(q, k, v, g, beta, l2norm, chunk)
    n = gamma.shape[2]
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb_decayed, upper=False, unitriangular=True)
    S = _initial(state, (B, H, Dk, Dv), u)
    out = torch.zeros_like(u)
    q = q * gamma.exp().unsqueeze(-1)
    k = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    carry = gamma[..., -1].exp()[..., None, None]
    captured = None
    for c in range(n):
        if c == capture:
            captured = S.clone()
        v_new = u[:, :, c] - w[:, :, c] @ S
        out[:, :, c] = q[:, :, c] @ S + attn[:, :, c] @ v_new
        S = S * carry[:, :, c] + k[:, :, c].transpose(-1, -2) @ v_new
    out = out.reshape(B, H, -1, Dv)[:, :, :T]
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    if capture is None:
        return out, S
    if captured is None:
        raise ValueError(f"delta_rule_chunked_reference: capture {capture} is not a chunk of the {n} here")
    return out, S, captured


def causal_conv_reference(u: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None):
    """Depthwise causal conv + SiLU over u [B, C, T] with weight [C, W] (W = 4), in weight's
    dtype (bf16: the conv's output and the SiLU each round). Without a state the positions
    before 0 are zeros (a prompt); with conv_state [B, C, W] (the last W inputs so far) the
    window continues from it (a decode step). Returns (out [B, C, T], the new state: the
    last W inputs, zeros on the left when fewer have been seen)."""
    width = weight.shape[-1]
    if conv_state is None:
        seen = u
        out = F.conv1d(u.to(weight.dtype), weight.unsqueeze(1), padding=width - 1, groups=u.shape[1])[..., :u.shape[-1]]
    else:
        seen = torch.cat([conv_state, u], dim=-1).to(weight.dtype)
        out = F.conv1d(seen, weight.unsqueeze(1), padding=0, groups=u.shape[1])[..., -u.shape[-1]:]
    new_state = F.pad(seen, (max(width - seen.shape[-1], 0), 0))[..., -width:]
    return F.silu(out).to(u.dtype), new_state


def gated_rmsnorm_reference(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Per head: RMS-normalize x in fp32, round to x's dtype, times w (a plain weight, in
    its dtype), times silu(z) in fp32, rounded once. x, z [..., D]; w [D]."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = w * xf.to(dtype)
    return (y * F.silu(z.to(torch.float32))).to(dtype)


# ---------------------------------------------------------------------------------- kernels
# The decode step of the rule as one Triton kernel (checked against the references and the
# float64 oracle's gates under the interpreter and on an H200, tests/kernels/test_gdn_kernels.py).


@triton.jit
def _gate_values(a, b, a_log, dt_bias, INTERPRETED: tl.constexpr):
    """(g fp32, beta bf16) from fp32 a, b, A_log, dt_bias, as gates_reference's torch ops on
    CUDA evaluate them: beta = bf16(sigmoid(b)) (swiglu.sigmoid_f32); g = -expf(A_log) *
    softplus(a + dt_bias), softplus(s) = s past 20, else log1p(expf(s))."""
    return _g_value(a, a_log, dt_bias, INTERPRETED), sigmoid_f32(b, INTERPRETED).to(tl.bfloat16)


@triton.jit
def _g_value(a, a_log, dt_bias, INTERPRETED: tl.constexpr):
    """g = -expf(A_log) * softplus(a + dt_bias) in fp32 (_gate_values)."""
    s = a + dt_bias
    e = exp_f32(tl.minimum(s, 20.0), INTERPRETED)
    if INTERPRETED:
        sp = tl.log(1.0 + e)
    else:
        sp = libdevice.log1p(e)
    return -exp_f32(a_log, INTERPRETED) * tl.where(s > 20.0, s, sp)


@triton.jit
def _decode_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr,
                        stride_qb, stride_qh, stride_vb, stride_vh, stride_gb, stride_betab, stride_ob, stride_oh,
                        stride_sb, stride_sh, stride_sk,
                        HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, BLOCK_V: tl.constexpr,
                        PDL: tl.constexpr = False):
    """One program per (sequence, value head, BLOCK_V columns of the state). q/k head
    hv // RATIO; q and k l2-normalized in fp32 over DK, q divided by sqrt(DK) (the
    reference's recurrent form divides); S <- exp(g) S; u = beta (v - S^T k);
    S <- S + k u^T; o = S^T q, rounded to bf16. S is read and written once, in place."""
    pid = tl.program_id(0)
    col0 = tl.program_id(1) * BLOCK_V
    b = pid // HV
    hv = pid % HV
    hk = hv // RATIO
    offs_k = tl.arange(0, DK)
    offs_v = col0 + tl.arange(0, BLOCK_V)
    pdl.wait(PDL)  # q, k, v, the gates and the state come from earlier kernels
    pdl.launch_dependents(PDL)
    q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + offs_k).to(tl.float32)
    k = tl.load(k_ptr + b * stride_qb + hk * stride_qh + offs_k).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q / tl.sqrt_rn(DK * 1.0)
    v = tl.load(v_ptr + b * stride_vb + hv * stride_vh + offs_v).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + hv)
    beta = tl.load(beta_ptr + b * stride_betab + hv).to(tl.float32)
    s_ptrs = state_ptr + b * stride_sb + hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s = tl.load(s_ptrs) * tl.exp(g)
    u = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(s_ptrs, s)
    o = tl.sum(s * q[:, None], axis=0).to(tl.bfloat16)
    tl.store(o_ptr + b * stride_ob + hv * stride_oh + offs_v, o)


def step_views(q, k, v, g, beta):
    """A decode step's inputs as its kernels read them, copied only where they are not so already:
    q, k, v may be views of the conv's output row (unit last stride, q and k alike), beta a column
    slice of in_proj's rows (in_proj_conv_gates_step); g contiguous."""
    if q.stride() != k.stride() or q.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if beta.stride(-1) != 1:
        beta = beta.contiguous()
    return q, k, v, g.contiguous(), beta


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, block_v: int = 32) -> torch.Tensor:
    """One token of the rule for every sequence: q, k [B, Hk, Dk] bf16 (the conv's output,
    not normalized, heads not repeated), v [B, Hv, Dv] bf16, g [B, Hv] fp32, beta [B, Hv]
    bf16 (any row stride), state [B, Hv, Dk, Dv] fp32 (updated in place). Returns o [B, Hv, Dv] bf16."""
    B, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != B or Hv % Hk:
        raise ValueError(f"gdn.decode_step: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if state.dtype != torch.float32 or tuple(state.shape) != (B, Hv, Dk, Dv) or not state.is_contiguous():
        raise ValueError(f"gdn.decode_step: state must be contiguous float32 {(B, Hv, Dk, Dv)}, "
                         f"got {state.dtype} {tuple(state.shape)}")
    if g.dtype != torch.float32 or tuple(g.shape) != (B, Hv) or tuple(beta.shape) != (B, Hv):
        raise ValueError(f"gdn.decode_step: g must be float32 {(B, Hv)} and beta {(B, Hv)}, "
                         f"got {g.dtype} {tuple(g.shape)} and {tuple(beta.shape)}")
    if Dk & (Dk - 1) or Dv % block_v:
        raise ValueError(f"gdn.decode_step: Dk must be a power of two and Dv a multiple of {block_v}")
    q, k, v, g, beta = step_views(q, k, v, g, beta)
    out = torch.empty((B, Hv, Dv), dtype=torch.bfloat16, device=v.device)
    use_pdl, pdl_launch = pdl.for_rows(B)
    _decode_step_kernel[(B * Hv, Dv // block_v)](
        q, k, v, g, beta, state, out, q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
        HV=Hv, RATIO=Hv // Hk, DK=Dk, BLOCK_V=block_v, PDL=use_pdl, num_warps=4, **pdl_launch)
    return out


def decode_step_reference(q, k, v, g, beta, state):
    """decode_step through the recurrent reference (heads repeated, T = 1); state updated in place."""
    Hv = v.shape[1]
    o, s = delta_rule_recurrent_reference(expand_heads(q[:, None], Hv), expand_heads(k[:, None], Hv), v[:, None],
                                          g[:, None], beta[:, None], state=state)
    state.copy_(s)
    return o[:, 0]


@triton.jit
def _conv_gates_step_kernel(mixed_ptr, conv_state_ptr, conv_w_ptr, x_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
                            g_ptr, beta_ptr, C, stride_mb, stride_sb, stride_sc, stride_xb, stride_ab,
                            HV: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
                            PDL: tl.constexpr = False):
    """One program per (sequence, BLOCK_C channels): the conv's window is the state's last
    W - 1 inputs and the new one; out = bf16(silu(bf16(sum_j w_j x_j))), the products summed
    in fp32 in window order; the state shifts by one in place. Program (b, 0) also forms the
    sequence's gates: beta = bf16(sigmoid(b)), g = -exp(A_log) * softplus(a + dt_bias) in fp32."""
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < C
    pdl.wait(PDL)  # mixed, a and b are the previous product's; the conv state an earlier step's
    pdl.launch_dependents(PDL)
    new = tl.load(mixed_ptr + b * stride_mb + offs, mask=ok, other=0.0)
    state = conv_state_ptr + b * stride_sb + offs * stride_sc
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        xj = tl.load(state + j + 1, mask=ok, other=0.0)
        acc += tl.load(conv_w_ptr + offs * W + j, mask=ok, other=0.0).to(tl.float32) * xj.to(tl.float32)
        tl.store(state + j, xj, mask=ok)
    acc += tl.load(conv_w_ptr + offs * W + W - 1, mask=ok, other=0.0).to(tl.float32) * new.to(tl.float32)
    tl.store(state + W - 1, new, mask=ok)
    conv = acc.to(tl.bfloat16).to(tl.float32)
    tl.store(x_ptr + b * stride_xb + offs, silu_f32(conv, INTERPRETED).to(tl.bfloat16), mask=ok)
    if tl.program_id(1) == 0:
        h = tl.arange(0, HV)
        g, beta = _gate_values(tl.load(a_ptr + b * stride_ab + h).to(tl.float32),
                               tl.load(b_ptr + b * stride_ab + h).to(tl.float32),
                               tl.load(a_log_ptr + h).to(tl.float32), tl.load(dt_bias_ptr + h).to(tl.float32),
                               INTERPRETED)
        tl.store(beta_ptr + b * HV + h, beta)
        tl.store(g_ptr + b * HV + h, g)


def conv_gates_step(mixed: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, block_c: int = 512):
    """A decode step's conv (state updated in place) and gates: mixed [B, C] bf16 (in_proj_qkv's
    output), conv_state [B, C, W] bf16, conv_w [C, W] bf16; a, b [B, Hv] bf16; a_log, dt_bias
    [Hv] bf16. Returns (x [B, C] bf16, g [B, Hv] fp32, beta [B, Hv] bf16)."""
    B, C = mixed.shape
    Hv = a.shape[1]
    W = conv_w.shape[1]
    if tuple(conv_state.shape) != (B, C, W) or conv_state.stride(2) != 1 or tuple(conv_w.shape) != (C, W):
        raise ValueError(f"gdn.conv_gates_step: conv_state {tuple(conv_state.shape)} and conv_w "
                         f"{tuple(conv_w.shape)} do not fit mixed {tuple(mixed.shape)}")
    if tuple(b.shape) != (B, Hv) or tuple(a_log.shape) != (Hv,) or tuple(dt_bias.shape) != (Hv,) or Hv & (Hv - 1):
        raise ValueError(f"gdn.conv_gates_step: gates a {tuple(a.shape)}, b {tuple(b.shape)}, A_log "
                         f"{tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)} (heads a power of two)")
    # mixed, a and b may be column slices of one packed projection's rows: read in place
    # (a copy a tensor at more than one row); a and b share the kernel's row stride
    if mixed.stride(-1) != 1:
        mixed = mixed.contiguous()
    if a.stride(-1) != 1 or b.stride(-1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    conv_w = conv_w.contiguous()
    x = torch.empty((B, C), dtype=mixed.dtype, device=mixed.device)
    g = torch.empty((B, Hv), dtype=torch.float32, device=mixed.device)
    beta = torch.empty((B, Hv), dtype=torch.bfloat16, device=mixed.device)
    use_pdl, pdl_launch = pdl.for_rows(B)
    _conv_gates_step_kernel[(B, triton.cdiv(C, block_c))](
        mixed, conv_state, conv_w, x, a, b, a_log, dt_bias, g, beta, C, mixed.stride(0), conv_state.stride(0),
        conv_state.stride(1), x.stride(0), a.stride(0), HV=Hv, W=W, BLOCK_C=block_c, INTERPRETED=_INTERPRETED,
        PDL=use_pdl, num_warps=4, **pdl_launch)
    return x, g, beta


@triton.jit
def in_proj_epilogue_inputs(rows, cols, M, N, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, stride_sb,
                            stride_sc, CONV_DIM: tl.constexpr, GATE_COL: tl.constexpr, HV: tl.constexpr):
    """What in_proj_epilogue reads besides the product, loaded before the product's loop (none of it
    is written by the kernels before this one; its latency then hides under the weights' stream):
    the conv state's last three inputs and the conv's four weights at the conv columns, A_log and
    dt_bias at the a columns' heads (a window of 4, the Qwen3.5 conv's)."""
    ok = (rows < M) & (cols < N)
    in_conv = cols < CONV_DIM             # cols' own shape: the weights' loads (Triton 3.1 broadcasts no mask)
    conv = ok & in_conv
    st = conv_state_ptr + rows * stride_sb + cols * stride_sc
    x1 = tl.load(st + 1, mask=conv, other=0.0)
    x2 = tl.load(st + 2, mask=conv, other=0.0)
    x3 = tl.load(st + 3, mask=conv, other=0.0)
    w0 = tl.load(conv_w_ptr + cols * 4, mask=in_conv, other=0.0)
    w1 = tl.load(conv_w_ptr + cols * 4 + 1, mask=in_conv, other=0.0)
    w2 = tl.load(conv_w_ptr + cols * 4 + 2, mask=in_conv, other=0.0)
    w3 = tl.load(conv_w_ptr + cols * 4 + 3, mask=in_conv, other=0.0)
    hb = cols - GATE_COL
    in_a = (hb >= HV) & (hb < 2 * HV)
    h = tl.where(in_a, hb - HV, 0)
    a_log = tl.load(a_log_ptr + h, mask=in_a, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + h, mask=in_a, other=0.0)
    return x1, x2, x3, w0, w1, w2, w3, a_log, dt_bias


@triton.jit
def in_proj_epilogue(acc, rows, cols, M, N, out_ptr, g_ptr, conv_state_ptr, stride_sb, stride_sc,
                     x1, x2, x3, w0, w1, w2, w3, a_log, dt_bias,
                     CONV_DIM: tl.constexpr, GATE_COL: tl.constexpr, HV: tl.constexpr, INTERPRETED: tl.constexpr):
    """The decode step's conv and gates as the epilogue of in_proj's product (fqkernels/gemv.py,
    EPI): acc holds fp32 sums of output columns `cols` for rows `rows` (broadcast shapes: a
    vector of one row's columns or a [rows, columns] tile), x1..dt_bias what
    in_proj_epilogue_inputs loaded for them. Each column is first rounded to bf16 (the product's
    output), then, as _conv_gates_step_kernel computes it:
      columns [0, CONV_DIM): the conv over the state's last 3 inputs and this one (products
        summed in fp32 in window order), the state shifted in place, out = bf16(silu(bf16(sum)));
      columns [GATE_COL, GATE_COL + HV) (b): beta = bf16(sigmoid(b)), in place;
      columns [GATE_COL + HV, GATE_COL + 2 HV) (a): g (fp32) to g_ptr [M, HV]; the bf16 a stays;
      the rest (z) as the product gives it.
    Only with one K chunk a program (split_k 1): each (row, column) belongs to one program, so
    the state shifts exactly once."""
    ok = (rows < M) & (cols < N)
    val = acc.to(tl.bfloat16)
    vf = val.to(tl.float32)
    conv = ok & (cols < CONV_DIM)
    st = conv_state_ptr + rows * stride_sb + cols * stride_sc
    c = tl.zeros_like(acc)
    c += w0.to(tl.float32) * x1.to(tl.float32)
    c += w1.to(tl.float32) * x2.to(tl.float32)
    c += w2.to(tl.float32) * x3.to(tl.float32)
    c += w3.to(tl.float32) * vf
    tl.store(st, x1, mask=conv)
    tl.store(st + 1, x2, mask=conv)
    tl.store(st + 2, x3, mask=conv)
    tl.store(st + 3, val, mask=conv)
    x = silu_f32(c.to(tl.bfloat16).to(tl.float32), INTERPRETED).to(tl.bfloat16)
    hb = cols - GATE_COL
    is_b = ok & (hb >= 0) & (hb < HV)
    is_a = ok & (hb >= HV) & (hb < 2 * HV)
    g = _g_value(vf, a_log.to(tl.float32), dt_bias.to(tl.float32), INTERPRETED)
    tl.store(g_ptr + rows * HV + tl.where(is_a, hb - HV, 0), g, mask=is_a)
    beta = sigmoid_f32(vf, INTERPRETED).to(tl.bfloat16)
    tl.store(out_ptr + rows * N + cols, tl.where(conv, x, tl.where(is_b, beta, val)), mask=ok)


def in_proj_conv_gates_step(h: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor,
                            a_log: torch.Tensor, dt_bias: torch.Tensor, value_dim: int, config=None):
    """A decode step's in_proj product with the conv and gates in its epilogue (one kernel in place
    of gemv.linear then conv_gates_step, the same bits): h [B, K] bf16; w [C + Hv Dv + 2 Hv, K] the
    packed in_proj (qkv | z | b | a); conv_state [B, C, W] bf16 (updated in place), conv_w [C, W];
    a_log, dt_bias [Hv]; value_dim = Hv Dv. Returns (x [B, C], z [B, Hv Dv], beta [B, Hv], all bf16
    column slices of one [B, N] row, and g [B, Hv] fp32 contiguous). config: gemv's (None: its
    table); it must have split_k 1 (ValueError otherwise)."""
    from fqkernels import gemv

    B = h.shape[0]
    Hv = a_log.shape[0]
    C, W = conv_w.shape
    N = w.shape[0]
    if N != C + value_dim + 2 * Hv or tuple(dt_bias.shape) != (Hv,):
        raise ValueError(f"gdn.in_proj_conv_gates_step: in_proj {tuple(w.shape)} is not conv {C} + value "
                         f"{value_dim} + 2 x {Hv} heads (A_log {tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)})")
    if W != 4:
        raise ValueError(f"gdn.in_proj_conv_gates_step: the epilogue runs a conv window of 4, got {W}")
    if tuple(conv_state.shape) != (B, C, W) or conv_state.stride(2) != 1:
        raise ValueError(f"gdn.in_proj_conv_gates_step: conv_state {tuple(conv_state.shape)} (strides "
                         f"{conv_state.stride()}) must be [{B}, {C}, {W}] with unit stride on the window")
    g = torch.empty((B, Hv), dtype=torch.float32, device=h.device)
    epilogue = dict(g_ptr=g, conv_state_ptr=conv_state, conv_w_ptr=conv_w.contiguous(), a_log_ptr=a_log,
                    dt_bias_ptr=dt_bias, stride_sb=conv_state.stride(0), stride_sc=conv_state.stride(1),
                    CONV_DIM=C, GATE_COL=C + value_dim, HV=Hv)
    out = gemv.linear_epilogue(h, w, epilogue, config=config)
    x, z, beta, _ = torch.split(out, [C, value_dim, Hv, Hv], dim=-1)
    return x, z, beta, g


@triton.jit
def _conv_prefill_kernel(u_ptr, conv_w_ptr, x_ptr, T, C, stride_ub, stride_ut, stride_xb, stride_xt,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
                         state_ptr=None, stride_sb=None, stride_sc=None, HAS_STATE: tl.constexpr = False):
    """One program per (sequence, BLOCK_T positions, BLOCK_C channels) of a prompt: out =
    bf16(silu(bf16(sum_j w_j u_{t-W+1+j}))), zeros before position 0 (HAS_STATE: the conv
    state's inputs there, state[b, c, W + t'] for t' < 0, a continued sequence), the products
    summed in fp32 in window order (as the step kernel and the reference's depthwise conv)."""
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j
        ok = ((src >= 0) & (src < T))[:, None] & c_ok[None, :]
        uj = tl.load(u_ptr + b * stride_ub + src[:, None] * stride_ut + c[None, :], mask=ok, other=0.0)
        if HAS_STATE:
            before = (src < 0)[:, None] & c_ok[None, :]
            sj = tl.load(state_ptr + b * stride_sb + c[None, :] * stride_sc + (W + src)[:, None], mask=before, other=0.0)
            uj = tl.where(before, sj, uj)
        acc += tl.load(conv_w_ptr + c * W + j, mask=c_ok, other=0.0).to(tl.float32)[None, :] * uj.to(tl.float32)
    conv = acc.to(tl.bfloat16).to(tl.float32)
    tl.store(x_ptr + b * stride_xb + t[:, None] * stride_xt + c[None, :], silu_f32(conv, INTERPRETED).to(tl.bfloat16),
             mask=(t < T)[:, None] & c_ok[None, :])


def causal_conv_prefill(u: torch.Tensor, conv_w: torch.Tensor, block_t: int = 32, block_c: int = 128,
                        num_warps: int = 4, conv_state: torch.Tensor | None = None):
    """A prompt's causal conv + SiLU as one kernel: u [B, T, C] bf16, position-major (in_proj's
    output; channels need unit stride), conv_w [C, W] bf16; conv_state [B, C, W] (unit stride
    on W): the last W inputs before u (a sequence continued), else zeros before position 0.
    Returns (x [B, T, C] bf16, the conv state [B, C, W]: the last W inputs, zeros on the left
    when fewer have been seen), what causal_conv_reference returns on u transposed."""
    B, T, C = u.shape
    W = conv_w.shape[1]
    if tuple(conv_w.shape) != (C, W) or u.stride(2) != 1 or T < 1:
        raise ValueError(f"gdn.causal_conv_prefill: u {tuple(u.shape)} (strides {u.stride()}) and conv_w "
                         f"{tuple(conv_w.shape)} do not fit")
    if conv_state is not None and (tuple(conv_state.shape) != (B, C, W) or conv_state.stride(2) != 1
                                   or conv_state.dtype != u.dtype):
        raise ValueError(f"gdn.causal_conv_prefill: conv_state must be {u.dtype} {(B, C, W)} with unit stride on W, "
                         f"got {conv_state.dtype} {tuple(conv_state.shape)} (strides {conv_state.stride()})")
    conv_w = conv_w.contiguous()
    x = torch.empty((B, T, C), dtype=u.dtype, device=u.device)
    prior = {} if conv_state is None else dict(state_ptr=conv_state, stride_sb=conv_state.stride(0),
                                               stride_sc=conv_state.stride(1), HAS_STATE=True)
    _conv_prefill_kernel[(B, triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
        u, conv_w, x, T, C, u.stride(0), u.stride(1), x.stride(0), x.stride(1), W=W, BLOCK_T=block_t,
        BLOCK_C=block_c, INTERPRETED=_INTERPRETED, num_warps=num_warps, **prior)
    if conv_state is None:
        state = F.pad(u[:, -W:].transpose(1, 2), (max(W - T, 0), 0)).contiguous()
    else:
        state = torch.cat([conv_state, u[:, -W:].transpose(1, 2)], dim=-1)[..., -W:]
    return x, state


@triton.jit
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, R, stride_ar,
                  HV: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRETED: tl.constexpr):
    """One program per BLOCK_R rows of a prompt's gates (_gate_values); a and b rows stride_ar
    apart (columns of a packed projection), g and beta written contiguous."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, HV)
    ok = (r < R)[:, None]
    src = r.to(tl.int64)[:, None] * stride_ar + h[None, :]
    g, beta = _gate_values(tl.load(a_ptr + src, mask=ok, other=0.0).to(tl.float32),
                           tl.load(b_ptr + src, mask=ok, other=0.0).to(tl.float32),
                           tl.load(a_log_ptr + h).to(tl.float32)[None, :], tl.load(dt_bias_ptr + h).to(tl.float32)[None, :],
                           INTERPRETED)
    dst = r.to(tl.int64)[:, None] * HV + h[None, :]
    tl.store(g_ptr + dst, g, mask=ok)
    tl.store(beta_ptr + dst, beta, mask=ok)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, block_r: int = 64):
    """gates_reference as one kernel: a, b [..., Hv] bf16 (any row stride, unit column stride,
    the same strides: e.g. column slices of in_proj's packed output), a_log, dt_bias [Hv] bf16.
    Returns (g fp32, beta bf16), both [..., Hv] contiguous."""
    Hv = a.shape[-1]
    if a.shape != b.shape or tuple(a_log.shape) != (Hv,) or tuple(dt_bias.shape) != (Hv,) or Hv & (Hv - 1):
        raise ValueError(f"gdn.gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(a_log.shape)}, dt_bias "
                         f"{tuple(dt_bias.shape)} (heads a power of two)")
    lead = a.shape[:-1]
    a2, b2 = a.reshape(-1, Hv), b.reshape(-1, Hv)         # views for a packed product's column slices
    if a2.stride(-1) != 1 or a2.stride() != b2.stride():
        a2, b2 = a2.contiguous(), b2.contiguous()
    R = a2.shape[0]
    g = torch.empty((R, Hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((R, Hv), dtype=torch.bfloat16, device=a.device)
    _gates_kernel[(triton.cdiv(R, block_r),)](a2, b2, a_log, dt_bias, g, beta, R, a2.stride(0), HV=Hv, BLOCK_R=block_r,
                                              INTERPRETED=_INTERPRETED, num_warps=4)
    return g.view(*lead, Hv), beta.view(*lead, Hv)


def conv_gates_step_reference(mixed, conv_state, conv_w, a, b, a_log, dt_bias):
    """conv_gates_step through the references (conv_state updated in place)."""
    x, new_state = causal_conv_reference(mixed[:, :, None], conv_w, conv_state)
    conv_state.copy_(new_state)
    g, beta = gates_reference(a, b, a_log, dt_bias)
    return x[:, :, 0], g, beta


# Roundings written in PTX, each on its own whatever the kernel's fp fusion (gated_norm_rows here;
# gdn_exact's and gdn_exact_step's ordered chains)
@triton.jit
def _mul_rn(a, b, INTERPRETED: tl.constexpr):
    """a * b rounded on its own: never contracted with a following add into an FMA (PTX mul.rn)."""
    if INTERPRETED:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _add_rn(a, b, INTERPRETED: tl.constexpr):
    """a + b as its own rounding: Triton folds dot(x, y) + c into dot(x, y, c), a chain that
    starts from c instead of zero (other bits); an add written in PTX is not folded."""
    if INTERPRETED:
        return a + b
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _sub_rn(a, b, INTERPRETED: tl.constexpr):
    """a - b as its own rounding (_add_rn's reason)."""
    if INTERPRETED:
        return a - b
    else:
        return tl.inline_asm_elementwise("sub.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _lane_sum_rows(acc, ROWS: tl.constexpr, HALVES: tl.constexpr):
    """rmsnorm._lane_sum for ROWS rows at once: acc [ROWS, 32 lanes, 4]. Each lane's
    ((a0 + a1) + a2) + a3, then the lane tree, halves first (lane t + 16, then + 8, ...) or
    adjacent pairs first, each level a sum over an axis of two (one fp add per output, in
    either operand order the same value): every row's sum has _lane_sum's bits."""
    col = tl.arange(0, 4)[None, None, :]
    v = tl.sum(tl.where(col == 0, acc, 0.0), axis=2)                     # [ROWS, 32]
    for i in tl.static_range(1, 4):
        v = v + tl.sum(tl.where(col == i, acc, 0.0), axis=2)
    if HALVES:
        v = tl.sum(tl.reshape(v, (ROWS, 2, 16)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 8)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 4)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 2)), axis=1)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 1)), axis=1)
    else:
        v = tl.sum(tl.reshape(v, (ROWS, 16, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 8, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 4, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 2, 2)), axis=2)
        v = tl.sum(tl.reshape(v, (ROWS, 1, 2)), axis=2)
    return tl.reshape(v, (ROWS,))


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, R, inv_n, eps, z_heads, stride_z, D: tl.constexpr,
                          ROWS: tl.constexpr, VEC: tl.constexpr, HALVES: tl.constexpr, PDL: tl.constexpr = False,
                          INTERPRETED: tl.constexpr = False):
    """One program per ROWS rows of D = 128 values (gated_norm_rows). Row r's z is head r % z_heads
    of z's row r // z_heads (rows stride_z apart). The rows are one [ROWS, D] tile, so a program's
    loads are all in flight at once (a prompt's 8,192 tokens are 262,144 rows of the 4B's heads)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = (rows < R)[:, None]
    offs = tl.arange(0, D)[None, :]
    if PDL:    # a decode step's: the weight (no kernel writes it) before the wait, its HBM trip under the last kernel
        w = tl.load(w_ptr + offs)
    pdl.start(PDL)  # x and z are earlier kernels' outputs
    x = tl.load(x_ptr + rows[:, None] * D + offs, mask=ok, other=0.0)
    z = tl.load(z_ptr + (rows // z_heads)[:, None] * stride_z + (rows % z_heads)[:, None] * D + offs, mask=ok,
                other=0.0)
    if not PDL:
        w = tl.load(w_ptr + offs)
    tl.store(out_ptr + rows[:, None] * D + offs, gated_norm_rows(x, z, w, inv_n, eps, VEC, HALVES, INTERPRETED),
             mask=ok)


@triton.jit
def gated_norm_rows(x, z, w, inv_n, eps, VEC: tl.constexpr, HALVES: tl.constexpr, INTERPRETED: tl.constexpr):
    """The gated norm of rows x [ROWS, D] (bf16, D = 128) with their gates z [ROWS, D] (bf16) and
    weight w [1, D] (bf16): each row's mean of squares summed in torch's own order for one 128-wide block
    (fqkernels/rmsnorm.py: lane t's four accumulators, then the lane tree), y = bf16(x * rsqrt(mean
    + eps)), bf16(w * y), times silu(z) in fp32, rounded once. The squares and the mean's product
    by 1/D are each one rounding (mul.rn) whatever the caller's fp fusion, so a kernel compiled
    with fusion (the exact GDN step's, which ends with this) has the gated norm kernel's bits."""
    ROWS: tl.constexpr = x.shape[0]
    xf = x.to(tl.float32)
    sq = _mul_rn(xf, xf, INTERPRETED)
    if VEC:
        lanes = tl.reshape(sq, (ROWS, 32, 4))
    else:
        lanes = tl.permute(tl.reshape(sq, (ROWS, 4, 32)), (0, 2, 1))
    mean = _mul_rn(_lane_sum_rows(lanes, ROWS, HALVES), inv_n, INTERPRETED)
    y = (xf * tl.rsqrt(mean + eps)[:, None]).to(tl.bfloat16)
    wy = (w.to(tl.float32) * y.to(tl.float32)).to(tl.bfloat16)
    zf = z.to(tl.float32)
    return (wy.to(tl.float32) * (zf / (1.0 + tl.exp(-zf)))).to(tl.bfloat16)


# Rows a program of gated_rmsnorm takes, and its warps, by the launch's row count (decode: one
# row a program; a prompt: tiles of GATED_NORM_ROWS rows)
GATED_NORM_ROWS = int(os.environ.get("FASTQWEN_GATED_NORM_ROWS", "8"))
GATED_NORM_WARPS = int(os.environ.get("FASTQWEN_GATED_NORM_WARPS", "2"))


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = EPS,
                  rows_per_program: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """gated_rmsnorm_reference as one kernel for heads of 128: x [R, 128] bf16, w [128] bf16, z
    bf16 either [R, 128] or [G, H * 128] with R = G H (e.g. the z columns of a packed
    projection's rows, read in place: any row stride, unit column stride); z's rows in
    x's order. rows_per_program (a power of two) and num_warps: the launch (None: one row and
    one warp a program up to 4,096 rows, else GATED_NORM_ROWS and GATED_NORM_WARPS); every
    launch gives the same bits."""
    R, D = x.shape
    if D != 128 or z.dim() != 2 or z.shape[1] % D or z.shape[0] * (z.shape[1] // D) != R or tuple(w.shape) != (D,):
        raise ValueError(f"gdn.gated_rmsnorm: x {tuple(x.shape)}, z {tuple(z.shape)}, w {tuple(w.shape)}: "
                         "rows of 128 (the 4B's value head), z's rows holding whole heads, one weight per column")
    small = R <= 4096
    rows = rows_per_program or (1 if small else GATED_NORM_ROWS)
    warps = num_warps or (1 if small else GATED_NORM_WARPS)
    if rows < 1 or rows & (rows - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"gdn.gated_rmsnorm: rows_per_program ({rows}) and num_warps ({warps}) must be powers of two")
    x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty_like(x)
    vec, halves, _ = torch_order(D, x.device)
    use_pdl, pdl_launch = pdl.for_rows(z.shape[0])
    _gated_rmsnorm_kernel[(triton.cdiv(R, rows),)](x, z, w, out, R, _inverse(D), eps, z.shape[1] // D, z.stride(0),
                                                   D=D, ROWS=rows, VEC=vec, HALVES=halves, PDL=use_pdl,
                                                   INTERPRETED=_INTERPRETED, num_warps=warps, enable_fp_fusion=False,
                                                   **pdl_launch)
    return out


# ------------------------------------------------------------------ chunked prefill kernels
# The chunked rule of delta_rule_chunked_reference in three kernels, from a zero state (a
# fresh prompt).
#
# _chunk_solve_kernel, one program per (sequence, value head, chunk): the chunk's unit-lower
# system M = I + A (A_ij = beta_i k_i.k_j e^(gamma_i - gamma_j), j < i) is inverted by blocks
# of 16: the four diagonal blocks by forward substitution, all four at once (15 steps, not
# 63), then M^-1 = (I - N + N^2 - N^3) D^-1 with D the block diagonal and N = D^-1 (M - D),
# strictly block-lower, so N^4 = 0 (three terms, never a long power series, which loses
# everything when a key repeats); or (PrefillPlan.form "merged", the default on Triton 3.6) the
# diagonal blocks' inverses merged pairwise, 16 -> 32 -> 64. Then u = M^-1 (beta v) and
# w = M^-1 (beta k e^gamma) ("uw"), or P = M^-1 diag(beta) alone ("inverse", "merged").
# _chunk_state_kernel, one program per (block of value columns, sequence, value head), the
# only sequential part: walks the chunks in order carrying S [Dk, BV] (as two Dk halves), with
# two products a chunk (v_new = u - w S, then S <- e^gamma_last S + k_decayed^T v_new; from P,
# v_new = P (v - diag(rk e^gamma) k_raw S), one product more), and keeps each chunk's starting
# state and v_new (in u's place) and the final state.
# _chunk_out_kernel, one program per (sequence, value head, chunk, block of value columns):
# o = (q e^gamma) S_chunk + (q k^T (.) decay, causal) v_new, from what the state kernel kept.
# (The last two as one kernel, each chunk's outputs formed while the walk holds its starting
# state, was measured no faster: PERF_LOG, session 12.)
#
# Precision: fp32 throughout the solve and state kernels (u, w, the chunks' states, the final
# state), on tensor cores in two ways; the output kernel's two products with an fp32 operand
# on bf16 pairs (third point below).
# - A product with one operand that is exact as loaded in bf16 (the raw keys, queries and
#   values, before their l2 norms and gates, which become per-row or per-column factors
#   applied to the other operand or to the result) needs no split of that operand: in the
#   solve kernel the fp32 one becomes three bf16 parts whose sum is exactly it
#   (_bf16_thirds), three bf16 products, each exact in the fp32 accumulator
#   (_dot_f32_bf16); in the state and output kernels the bf16 one is exact in TF32, so two
#   TF32 products of the other's head and rest (_dot_tf32_exact). The key-key and query-key
#   products are one bf16 product of the raw rows.
# - A product of two fp32 operands (the solve's block products, w S, attn v_new) runs as
#   three TF32 products (_dot3: each operand split into its TF32 head and the rest; about
#   fp32's accuracy, far from TF32's). Written out rather than Triton's
#   input_precision="tf32x3", which the platform's Triton 3.1 fails to compile here.
# - The output kernel's q S_chunk and attn v_new (PrefillPlan.out_prec "bf16x2", the default):
#   each fp32 operand as two bf16 parts (hi + mid, ~16 significant bits), the products exact
#   in the fp32 accumulator (_dot_bf16_pair). Its sums are rounded to bf16 (8 bits) right
#   after and nothing else reads them, so an output moves at most one bf16 step from the
#   three-pass TF32 form ("tf32x3"), at half the kernel's time (session 14: 424 -> 215 us at
#   4 x 2048, 6.7 -> 3.4 ms at 16 x 8192).
# Keeping the bf16 operands as loaded also halves their registers: with every operand in
# fp32 and split, ptxas for sm_90 gave each kernel 255 registers and 1-1.5 KB of spills a
# thread (session 11). Gated against the float64 oracle in tests/kernels/test_gdn_kernels.py;
# the timing beside flash-linear-attention is scripts/bench_gdn.py ("tf32": one TF32 product
# in _dot3, for that comparison only).
_PREC = "tf32x3"
# Tokens per call of the kernels: u (then v_new), w and the chunks' starting states are fp32
# workspaces of 2 KiB per token and value head (1 GiB for 16K tokens of 32 heads), so longer
# batches run in slices of whole sequences (peak memory stays bounded).
_TOKENS_PER_SLICE = 16384


@triton.jit
def _tf32_head(x):
    """x's TF32 part (sign, exponent, the top 10 mantissa bits): x - head is exact in fp32."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _dot3(a, b, PREC: tl.constexpr):
    """a @ b for fp32 a, b on tensor cores: with PREC "tf32x3", head.head + head.rest + rest.head
    (the small terms first); "bf16x2": both as bf16 pairs (_dot_bf16_pair, ~16 bits); "bf16x3":
    both as bf16 thirds (_dot_bf16_thirds, about fp32); else one product at that precision."""
    if PREC == "bf16x2":
        return _dot_bf16_pair(a, b, False)
    elif PREC == "bf16x3":
        return _dot_bf16_thirds(a, b)
    elif PREC == "tf32x3":
        a_hi = _tf32_head(a)
        b_hi = _tf32_head(b)
        acc = tl.dot(a - a_hi, b_hi, input_precision="tf32")
        acc = tl.dot(a_hi, b - b_hi, acc, input_precision="tf32")
        return tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _bf16_thirds(x):
    """fp32 x as three bf16 parts, hi + mid + lo == x exactly (8 + 8 + 8 significant bits;
    each remainder is exact in fp32)."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_f32_bf16(a, b, PREC: tl.constexpr):
    """a @ b for fp32 a and bf16 b, to fp32's precision on bf16 tensor cores: a's three bf16
    parts times b, each product exact, the small parts first (PREC "bf16x2": a's two parts,
    ~16 bits)."""
    if PREC == "bf16x2":
        hi, mid = _bf16_pair(a)
        return tl.dot(hi, b, tl.dot(mid, b))
    hi, mid, lo = _bf16_thirds(a)
    acc = tl.dot(lo, b)
    acc = tl.dot(mid, b, acc)
    return tl.dot(hi, b, acc)


@triton.jit
def _dot_tf32_exact(a, b):
    """a @ b for fp32 a whose every element is exact in TF32 (a bf16 value converted) and fp32 b,
    to about fp32's precision: b's TF32 head and the rest, two TF32 products (a's own rest is
    zero). Not bf16 thirds of b: Triton 3.6 on sm_90 faulted (illegal address) on a product
    whose bf16 right operand, computed in registers, is 32 columns wide (session 11)."""
    b_hi = _tf32_head(b)
    acc = tl.dot(a, b - b_hi, input_precision="tf32")
    return tl.dot(a, b_hi, acc, input_precision="tf32")


@triton.jit
def _bf16_pair(x):
    """fp32 x as two bf16 parts, hi + mid, within 2^-17 of x relative (16 significant bits)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_bf16_pair(a, b, A_EXACT: tl.constexpr):
    """a @ b for fp32 b, and a either bf16 (A_EXACT: as loaded, exact) or fp32, on bf16 tensor
    cores to about 16 significant bits: b's two bf16 parts (and a's: hi.hi + hi.mid + mid.hi),
    each product exact in the fp32 accumulator, the small terms first. For the output kernel
    only (its results are rounded to bf16, 8 bits): the state never takes it."""
    b_hi, b_mid = _bf16_pair(b)
    if A_EXACT:
        acc = tl.dot(a, b_mid)
        return tl.dot(a, b_hi, acc)
    a_hi, a_mid = _bf16_pair(a)
    acc = tl.dot(a_mid, b_hi)
    acc = tl.dot(a_hi, b_mid, acc)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def _dot_bf16_exact_left(a, b):
    """a @ b for bf16 a (exact as loaded) and fp32 b, to about fp32's precision: b's three bf16
    parts, three products each exact in the fp32 accumulator, the small parts first."""
    b1, b2, b3 = _bf16_thirds(b)
    return tl.dot(a, b1, tl.dot(a, b2, tl.dot(a, b3)))


@triton.jit
def _dot_bf16_thirds(a, b):
    """a @ b for fp32 a and b on bf16 tensor cores to about fp32's precision: each as three bf16
    parts (_bf16_thirds), the six products whose parts' orders sum to at most 2 (hi.lo, mid.mid,
    lo.hi, hi.mid, mid.hi, hi.hi: the neglected ones are below 2^-24 of the sum), each exact in
    the fp32 accumulator, the small terms first. Six bf16 products take the tensor cores' time
    of three TF32 ones (the TF32 rate is half bf16's); against _dot3's three TF32 passes, the
    left operand's parts stay in registers (Triton 3.6 puts both of a tf32 product's operands in
    shared memory for sm_90a), so a product holds 24 KiB of shared memory at 64 x 64 instead of 64."""
    a1, a2, a3 = _bf16_thirds(a)
    b1, b2, b3 = _bf16_thirds(b)
    acc = tl.dot(a1, b3)
    acc = tl.dot(a2, b2, acc)
    acc = tl.dot(a3, b1, acc)
    acc = tl.dot(a1, b2, acc)
    acc = tl.dot(a2, b1, acc)
    return tl.dot(a1, b1, acc)


@triton.jit
def _inv_norm(x):
    """rsqrt(sum of squares + 1e-6) of each row of bf16 x, in fp32 (gdn.l2_normalize's factor)."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)


@triton.jit
def _chunk_solve_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, gamma_ptr, rk_ptr, T, NC,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_gb, stride_gt,
                        HV: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr,
                        p_ptr=None, INVERSE: tl.constexpr = False, MERGED: tl.constexpr = False):
    """INVERSE (PrefillPlan.form "inverse" or "merged"): the chunk's P = M^-1 diag(beta), fp32
    [C, C], to p_ptr, for the state kernel to form v_new from (v, u_ptr and w_ptr unused); else u
    and w. MERGED (form "merged", C = 64, with INVERSE): M^-1 from the diagonal blocks' inverses
    merged pairwise, else from the four [C, C] products of the power form."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = pid // HV
    hv = pid % HV
    r = tl.arange(0, C)
    t = c * C + r
    ok = t < T
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    k_rows = k_ptr + b * stride_kb + t[:, None] * stride_kt + (hv // RATIO) * stride_kh + dk[None, :]
    k = tl.load(k_rows, mask=ok[:, None], other=0.0)             # raw bf16 keys
    rk = _inv_norm(k)
    beta = tl.load(beta_ptr + b * stride_gb + t * stride_gt + hv, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + t * stride_gt + hv, mask=ok, other=0.0)
    gamma = tl.cumsum(g, axis=0)                                  # log decay from the chunk's start
    # Everything below on transposes (at = A^T, x = (D^-1)^T): a tile's rows stay in one warp,
    # so the substitution's sums run along rows, within warps, with no block-wide barrier.
    # at[i, j] = beta_j (k_j . k_i) e^(gamma_j - gamma_i), i < j: the raw keys' product, then
    # both norms and the gate as factors.
    at = tl.where(r[:, None] < r[None, :],
                  tl.dot(k, tl.trans(k)) * (rk[:, None] * (rk * beta)[None, :]) * tl.exp(gamma[None, :] - gamma[:, None]),
                  0.0)
    # D^-1 by rows (x by columns), on the diagonal blocks alone as [blocks, 16, 16] tiles
    # (at3[b] = at's block b): step i finishes row i of every block,
    # D^-1_i = e_i - sum_{j<i} A_ij D^-1_j (rows j < i of the block are final), so column i of
    # xt3[b] takes sum_j at3[b, j, i] xt3[b, :, j]. On the whole [C, C] tile (zeros outside the
    # blocks) the 15 steps were 55% of the kernel (scripts/gpu_gdn_probe.py, session 11); on the
    # blocks alone the kernel takes 0.54x the time, the same sums.
    same = (r[:, None] // 16) == (r[None, :] // 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    blk = tl.arange(0, C // 16)
    e16 = tl.arange(0, 16)
    diag4 = blk[:, None, None, None] == blk[None, None, :, None]
    at3 = tl.sum(tl.where(diag4, tl.reshape(at, [C // 16, 16, C // 16, 16]), 0.0), axis=2)
    xt3 = tl.where(e16[None, :, None] == e16[None, None, :], 1.0, 0.0) + tl.zeros([C // 16, 16, 16], dtype=tl.float32)
    for i in range(1, 16):
        coef = tl.sum(tl.where(e16[None, None, :] == i, at3, 0.0), axis=2)          # [blocks, 16] over j
        upd = tl.sum(xt3 * coef[:, None, :], axis=2)                                 # [blocks, 16] over columns
        xt3 = tl.where(e16[None, None, :] == i, xt3 - upd[:, :, None], xt3)
    base = (pid * NC + c).to(tl.int64) * C
    if MERGED:
        # Y = (M^T)^-1, block upper, merged from the diagonal blocks' inverses pairwise, 16 -> 32
        # -> 64: [[P, Q], [0, R]]^-1 = [[P^-1, -P^-1 Q R^-1], [0, R^-1]], two 16-block products
        # a pair and two 32-block ones (~13x fewer multiply-adds than the four [C, C] products
        # below). The blocks are cut and put together through the chunk's own P slot at p_ptr
        # (each barrier orders one stage's stores before the next stage's loads).
        pt = p_ptr + base * C
        e32 = tl.arange(0, 32)
        tl.store(pt + r[:, None] * C + r[None, :], at)
        tl.debug_barrier()
        a01 = tl.load(pt + e16[:, None] * C + (16 + e16)[None, :])
        a23 = tl.load(pt + (32 + e16)[:, None] * C + (48 + e16)[None, :])
        a_ab = tl.load(pt + e32[:, None] * C + (32 + e32)[None, :])
        tl.debug_barrier()
        y00 = tl.sum(tl.where(blk[:, None, None] == 0, xt3, 0.0), axis=0)
        y11 = tl.sum(tl.where(blk[:, None, None] == 1, xt3, 0.0), axis=0)
        y22 = tl.sum(tl.where(blk[:, None, None] == 2, xt3, 0.0), axis=0)
        y33 = tl.sum(tl.where(blk[:, None, None] == 3, xt3, 0.0), axis=0)
        zero = tl.zeros([16, 16], dtype=tl.float32)
        tl.store(pt + e16[:, None] * C + e16[None, :], y00)
        tl.store(pt + e16[:, None] * C + (16 + e16)[None, :], -_dot3(_dot3(y00, a01, PREC), y11, PREC))
        tl.store(pt + (16 + e16)[:, None] * C + e16[None, :], zero)
        tl.store(pt + (16 + e16)[:, None] * C + (16 + e16)[None, :], y11)
        tl.store(pt + (32 + e16)[:, None] * C + (32 + e16)[None, :], y22)
        tl.store(pt + (32 + e16)[:, None] * C + (48 + e16)[None, :], -_dot3(_dot3(y22, a23, PREC), y33, PREC))
        tl.store(pt + (48 + e16)[:, None] * C + (32 + e16)[None, :], zero)
        tl.store(pt + (48 + e16)[:, None] * C + (48 + e16)[None, :], y33)
        tl.store(pt + (32 + e32)[:, None] * C + e32[None, :], tl.zeros([32, 32], dtype=tl.float32))
        tl.debug_barrier()
        y_aa = tl.load(pt + e32[:, None] * C + e32[None, :])
        y_bb = tl.load(pt + (32 + e32)[:, None] * C + (32 + e32)[None, :])
        tl.store(pt + e32[:, None] * C + (32 + e32)[None, :], -_dot3(_dot3(y_aa, a_ab, PREC), y_bb, PREC))
        tl.debug_barrier()
        m_inv = tl.load(pt + r[None, :] * C + r[:, None])           # Y^T, read transposed
        tl.debug_barrier()
    else:
        x = tl.reshape(tl.where(diag4, tl.broadcast_to(xt3[:, :, None, :], [C // 16, 16, C // 16, 16]), 0.0),
                       [C, C])
        # M^-1 = (I - N)(I + N^2) D^-1 with N = D^-1 L (L: A off the diagonal blocks), transposed:
        # N^T = L^T x, and (M^-1)^T = x (I + N^T N^T) (I - N^T).
        nt = _dot3(tl.where(same, 0.0, at), x, PREC)
        m_inv = tl.trans(_dot3(_dot3(x, eye + _dot3(nt, nt, PREC), PREC), eye - nt, PREC))
    if INVERSE:
        tl.store(p_ptr + (base + r)[:, None] * C + r[None, :], m_inv * beta[None, :])
    else:
        # u = M^-1 diag(beta) v and w = M^-1 diag(beta rk e^gamma) k_raw: the factors on M^-1's
        # columns, the raw bf16 rows the exact operand
        v = tl.load(v_ptr + b * stride_vb + t[:, None] * stride_vt + hv * stride_vh + dv[None, :],
                    mask=ok[:, None], other=0.0)
        u = _dot_f32_bf16(m_inv * beta[None, :], v, PREC)
        tl.store(u_ptr + (base + r)[:, None] * DV + dv[None, :], u)
        w = _dot_f32_bf16(m_inv * (beta * rk * tl.exp(gamma))[None, :], k, PREC)
        tl.store(w_ptr + (base + r)[:, None] * DK + dk[None, :], w)
    tl.store(gamma_ptr + base + r, gamma)
    tl.store(rk_ptr + base + r, rk)


@triton.jit
def _initial_halves(init_ptr, stride_ib, b, hv, d0, d1, dv, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                    HAS_INIT: tl.constexpr):
    """The walk's starting state as its two Dk halves [Dk/2, BV]: sequence b's head hv of the fp32
    states at init_ptr ([B, Hv, Dk, Dv], rows stride_ib apart), or zeros (a fresh prompt)."""
    if HAS_INIT:
        src = init_ptr + b.to(tl.int64) * stride_ib + hv * DK * DV
        return tl.load(src + d0[:, None] * DV + dv[None, :]), tl.load(src + d1[:, None] * DV + dv[None, :])
    return tl.zeros([DK // 2, BV], dtype=tl.float32), tl.zeros([DK // 2, BV], dtype=tl.float32)


@triton.jit
def _dot_exact_left(a, b, PREC: tl.constexpr):
    """a @ b for bf16 a (raw keys, exact as loaded) and fp32 b in the state kernel's form: PREC
    "bf16x2" b's bf16 pair, "bf16x3" b's bf16 thirds, else two TF32 passes (_dot_tf32_exact)."""
    if PREC == "bf16x2":
        return _dot_bf16_pair(a, b, True)
    elif PREC == "bf16x3":
        return _dot_bf16_exact_left(a, b)
    else:
        return _dot_tf32_exact(a.to(tl.float32), b)


@triton.jit
def _chunk_state_kernel(k_ptr, u_ptr, w_ptr, gamma_ptr, rk_ptr, h_ptr, state_ptr, T, NC,
                        stride_kb, stride_kt, stride_kh, stride_sb,
                        HV: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                        init_ptr=None, stride_ib=None, HAS_INIT: tl.constexpr = False,
                        p_ptr=None, v_ptr=None, stride_vb=None, stride_vt=None, stride_vh=None,
                        INVERSE: tl.constexpr = False):
    """The state's Dk rows kept as two halves and every product taken over one half of Dk at
    a time: each operand tile is half the size, so fewer registers are live at once (with the
    whole Dk in one tile ptxas for sm_90 spilled ~1.2 KB a thread and the kernel took 2.3x
    as long at (16, 8192), session 10). Sums over Dk run as two half sums, added. The keys'
    norms come from the solve kernel (rk). The grid is (value blocks, sequence x value head):
    a head's blocks launch side by side, so the tiles they all read (keys, w or P) come from L2
    after the first. HAS_INIT: the walk starts from the state at init_ptr (a continued
    sequence), else from zeros.
    Two forms (PrefillPlan.form). "uw": v_new = u - w S from the solve's u and w (fp32, 1 KiB a
    token and value head at Dk = Dv = 128), the keys loaded transposed ([Dk/2, C] tiles, only
    ever the update's operand). INVERSE ("inverse"): v_new = P y with P = M^-1 diag(beta) (fp32
    [C, C], 256 bytes a token) and y = v - diag(rk e^gamma) (k_raw S), the raw bf16 keys and
    values read here: the same sum (u - w S = M^-1 diag(beta) (v - diag(rk e^gamma) k_raw S)),
    a quarter fewer bytes a chunk at 32 value columns, one more product (k_raw S, its left
    operand exact) in the chain."""
    v0 = tl.program_id(0) * BV
    pid = tl.program_id(1)
    b = pid // HV
    hv = pid % HV
    DH: tl.constexpr = DK // 2
    r = tl.arange(0, C)
    d0 = tl.arange(0, DH)
    d1 = DH + tl.arange(0, DH)
    dv = v0 + tl.arange(0, BV)
    s0, s1 = _initial_halves(init_ptr, stride_ib, b, hv, d0, d1, dv, DK, DV, BV, HAS_INIT)
    for c in range(NC):
        t = c * C + r
        chunk = pid * NC + c
        base = chunk.to(tl.int64) * C
        gamma = tl.load(gamma_ptr + base + r)
        last = tl.sum(tl.where(r == C - 1, gamma, 0.0), axis=0)
        rk = tl.load(rk_ptr + base + r)
        hrow = chunk.to(tl.int64) * DK
        tl.store(h_ptr + (hrow + d0)[:, None] * DV + dv[None, :], s0)          # S at the chunk's start
        tl.store(h_ptr + (hrow + d1)[:, None] * DV + dv[None, :], s1)
        if INVERSE:
            rows = k_ptr + b * stride_kb + t[:, None] * stride_kt + (hv // RATIO) * stride_kh
            k0 = tl.load(rows + d0[None, :], mask=(t < T)[:, None], other=0.0)    # raw bf16 keys, [C, DH]
            k1 = tl.load(rows + d1[None, :], mask=(t < T)[:, None], other=0.0)
            v = tl.load(v_ptr + b * stride_vb + t[:, None] * stride_vt + hv * stride_vh + dv[None, :],
                        mask=(t < T)[:, None], other=0.0)
            ks = _dot_exact_left(k0, s0, PREC)
            ks += _dot_exact_left(k1, s1, PREC)
            y = v.to(tl.float32) - (rk * tl.exp(gamma))[:, None] * ks
            pm = tl.load(p_ptr + (base + r)[:, None] * C + r[None, :])
            v_new = _dot3(pm, y, PREC)
            k0t = tl.trans(k0)
            k1t = tl.trans(k1)
        else:
            cols = k_ptr + b * stride_kb + t[None, :] * stride_kt + (hv // RATIO) * stride_kh
            k0t = tl.load(cols + d0[:, None], mask=(t < T)[None, :], other=0.0)      # raw bf16 keys, [DH, C]
            k1t = tl.load(cols + d1[:, None], mask=(t < T)[None, :], other=0.0)
            w0 = tl.load(w_ptr + (base + r)[:, None] * DK + d0[None, :])
            ws = _dot3(w0, s0, PREC)
            w1 = tl.load(w_ptr + (base + r)[:, None] * DK + d1[None, :])
            ws += _dot3(w1, s1, PREC)
            v_new = tl.load(u_ptr + (base + r)[:, None] * DV + dv[None, :]) - ws
        tl.store(u_ptr + (base + r)[:, None] * DV + dv[None, :], v_new)
        # S <- e^gamma_last S + k_raw^T diag(scale) v_new, scale the l2 norm of the whole row and
        # the decay to the chunk's end: the row factor on v_new, the raw keys exact
        carry = tl.exp(last)
        vs = v_new * (rk * tl.exp(last - gamma))[:, None]
        s0 = s0 * carry + _dot_exact_left(k0t, vs, PREC)
        s1 = s1 * carry + _dot_exact_left(k1t, vs, PREC)
    out = state_ptr + b * stride_sb + hv * DK * DV
    tl.store(out + d0[:, None] * DV + dv[None, :], s0)
    tl.store(out + d1[:, None] * DV + dv[None, :], s1)


@triton.jit
def _chunk_out_kernel(q_ptr, k_ptr, vn_ptr, gamma_ptr, rk_ptr, h_ptr, o_ptr, T, NC, scale,
                      stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh,
                      HV: tl.constexpr, RATIO: tl.constexpr, C: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """o = diag(rq e^gamma) (q_raw S_chunk) + attn v_new with attn = the raw rows' q k^T times
    rq_i rk_j e^(gamma_i - gamma_j), causal; rq, rk the l2 norms' factors (rq with Dk^-0.5; rk the
    solve kernel's). Over Dk in halves, as the state kernel. PREC "bf16x2": the two products
    with an fp32 operand on bf16 pairs (_dot_bf16_pair, ~16 bits before o's rounding to bf16's
    8), else TF32 as named."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    b = pid // HV
    hv = pid % HV
    hk = hv // RATIO
    DH: tl.constexpr = DK // 2
    r = tl.arange(0, C)
    d0 = tl.arange(0, DH)
    d1 = DH + tl.arange(0, DH)
    dv = v0 + tl.arange(0, BV)
    t = c * C + r
    ok = t < T
    q_rows = q_ptr + b * stride_qb + t[:, None] * stride_qt + hk * stride_qh
    k_rows = k_ptr + b * stride_qb + t[:, None] * stride_qt + hk * stride_qh
    q0 = tl.load(q_rows + d0[None, :], mask=ok[:, None], other=0.0)
    q1 = tl.load(q_rows + d1[None, :], mask=ok[:, None], other=0.0)
    k0 = tl.load(k_rows + d0[None, :], mask=ok[:, None], other=0.0)
    k1 = tl.load(k_rows + d1[None, :], mask=ok[:, None], other=0.0)
    q0f = q0.to(tl.float32)
    q1f = q1.to(tl.float32)
    rq = tl.rsqrt(tl.sum(q0f * q0f, axis=1) + tl.sum(q1f * q1f, axis=1) + 1e-6) * scale
    chunk = pid * NC + c
    base = chunk.to(tl.int64) * C
    rk = tl.load(rk_ptr + base + r)
    gamma = tl.load(gamma_ptr + base + r)
    qk = tl.dot(q1, tl.trans(k1), tl.dot(q0, tl.trans(k0)))
    attn = tl.where(r[:, None] >= r[None, :],
                    qk * (rq[:, None] * rk[None, :]) * tl.exp(gamma[:, None] - gamma[None, :]), 0.0)
    hrow = chunk.to(tl.int64) * DK
    h0 = tl.load(h_ptr + (hrow + d0)[:, None] * DV + dv[None, :])
    h1 = tl.load(h_ptr + (hrow + d1)[:, None] * DV + dv[None, :])
    v_new = tl.load(vn_ptr + (base + r)[:, None] * DV + dv[None, :])
    if PREC == "bf16x2":
        qh = _dot_bf16_pair(q0, h0, True)
        qh += _dot_bf16_pair(q1, h1, True)
        av = _dot_bf16_pair(attn, v_new, False)
    else:
        qh = _dot_tf32_exact(q0f, h0)
        qh += _dot_tf32_exact(q1f, h1)
        av = _dot3(attn, v_new, PREC)
    o = qh * (rq * tl.exp(gamma))[:, None] + av
    tl.store(o_ptr + b * stride_ob + t[:, None] * stride_ot + hv * stride_oh + dv[None, :], o.to(tl.bfloat16),
             mask=ok[:, None])


_OUT_PRECS = ("tf32x3", "tf32", "bf16x2")
_PRECS = ("tf32x3", "bf16x3", "bf16x2")
_FORMS = ("uw", "inverse", "merged")


@dataclass(frozen=True)
class PrefillPlan:
    """How chunked_prefill launches its kernels (what scripts/bench_gdn.py --sweep varies):
    warps per program of each kernel, the state kernel's value columns a program and
    pipeline stages, the output kernel's value columns a program, and the output kernel's
    products with an fp32 operand (the output kernel feeds no state, so its precision moves
    only the bf16 outputs): "bf16x2", each fp32 operand as two bf16 parts (~16 significant
    bits, bf16 tensor cores at twice TF32's rate; within one bf16 step of "tf32x3"),
    "tf32x3" (three TF32 passes, about fp32), or "tf32" (one pass: session 9's emulation
    put the outputs at 2.2-2.9e-3 of the oracle against 1.9-2.5e-3 with three, the gate
    5e-3; on the H200 they sat at 5.0e-3 of the three-pass ones).
    The defaults are session 10's sweep on an H200 (32 state columns with two stages was
    within 11% of the fastest plan at 1x512, 1x2048, 4x2048 and 16x8192, fastest at 4x2048)
    and session 14's (bf16 pairs halved the output kernel's time; 8 warps or 128 columns were
    slower, and so was a loop over several chunks a program, since removed: PERF_LOG).
    prec: the solve and state kernels' products with an fp32 operand, which make the state:
    "tf32x3" (about fp32, the default), "bf16x3" (each fp32 operand as three bf16 parts, six
    products, about fp32 too, in the tensor time of three TF32 passes, with the left operand
    kept in registers: the solve 180 registers and 64 KiB of shared memory against 237 and 80;
    a candidate) or "bf16x2" (bf16 pairs, ~16 significant bits, at bf16's rate and fewer
    registers: 139 at 16 value columns against 211, three programs an SM; a candidate to
    measure, speed beside fidelity, not a default).
    solve_maxnreg / state_maxnreg / out_maxnreg: a register cap for that kernel (Triton's
    maxnreg; 0: none). Each runs two programs of 4 warps an SM by its registers (237 / 253 /
    228); at 168 three fit by registers (ptxas, sm_90a: the solve spills 28 bytes a thread but
    its 80 KiB of shared memory still allows two, the state kernel 424 at 32 columns and 136
    at 16, the output kernel 4): candidates to measure.
    solve_prec: the solve kernel's products alone ("": as prec). The solve writes w and u in
    fp32 for the state kernel, so its products' form is independent of the state kernel's:
    session 16 measured the solve on bf16 thirds capped at 168 registers 12% faster than on
    three TF32 passes (4x8192: 1,090 against 1,238 us), the state kernel on thirds 11% slower.
    FAST_PLAN takes both precision-neutral gains of that sweep: the solve on bf16 thirds at 168
    registers and the output kernel at 168 (4x8192: 842 -> 685 us); the state kernel stays
    uncapped on three TF32 passes (capped it spills: 1,282 -> 1,862 us). Products on bf16 parts
    in the solve or state kernel need Dk >= 64: at Dk 32 the solve on thirds gave outputs of
    ~1e-37 on an H200 with Triton 3.6 (session 16), so chunked_prefill refuses such a plan there.
    form: what the solve hands the state kernel. "uw": u = M^-1 diag(beta) v and w = M^-1
    diag(beta rk e^gamma) k_raw (fp32, 1 KiB a token and value head at Dk = Dv = 128), the state
    kernel's v_new = u - w S. "inverse": P = M^-1 diag(beta) alone (fp32 [C, C], 256 bytes a
    token and head), the state kernel's v_new = P (v - diag(rk e^gamma) k_raw S) from the raw
    bf16 keys and values (the same sum; fewer bytes both sides, one more product in the walk).
    "merged": as "inverse", with the solve's M^-1 merged from its 16-blocks' inverses pairwise
    (16 -> 32 -> 64) in place of the power form's four [C, C] products.
    block_v 0: the state kernel's columns chosen per slice by how many programs fill the GPU
    (_state_columns). slice_tokens: tokens a call of the kernels takes at most (whole sequences;
    0: _TOKENS_PER_SLICE), which bounds the workspaces (~1.8 KiB a token and value head in the
    merged form, 2 KiB in "uw")."""
    solve_warps: int = 4
    state_warps: int = 4
    state_stages: int = 2
    block_v: int = 32
    out_warps: int = 4
    out_bv: int = 64
    out_prec: str = "bf16x2"
    prec: str = "tf32x3"
    solve_prec: str = ""
    solve_maxnreg: int = 0
    state_maxnreg: int = 0
    out_maxnreg: int = 0
    form: str = "uw"
    slice_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("solve_warps", "state_warps", "block_v", "out_warps", "out_bv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "block_v" else 1) or value & (value - 1):
                raise ValueError(f"gdn.PrefillPlan.{name} must be a power of two{' or 0' * (name == 'block_v')}, "
                                 f"got {value!r}")
        if not isinstance(self.slice_tokens, int) or self.slice_tokens < 0:
            raise ValueError(f"gdn.PrefillPlan.slice_tokens must be 0 (the default) or a count of tokens, "
                             f"got {self.slice_tokens!r}")
        for name in ("solve_maxnreg", "state_maxnreg", "out_maxnreg"):
            value = getattr(self, name)
            if not isinstance(value, int) or value and not 24 <= value <= 255:
                raise ValueError(f"gdn.PrefillPlan.{name} must be 0 (no cap) or 24-255 registers, got {value!r}")
        if self.out_prec not in _OUT_PRECS:
            raise ValueError(f"gdn.PrefillPlan.out_prec must be one of {_OUT_PRECS}, got {self.out_prec!r}")
        if self.prec not in _PRECS:
            raise ValueError(f"gdn.PrefillPlan.prec must be one of {_PRECS}, got {self.prec!r}")
        if self.form not in _FORMS:
            raise ValueError(f"gdn.PrefillPlan.form must be one of {_FORMS}, got {self.form!r}")
        if self.solve_prec and self.solve_prec not in _PRECS:
            raise ValueError(f"gdn.PrefillPlan.solve_prec must be '' (as prec) or one of {_PRECS}, "
                             f"got {self.solve_prec!r}")

    @property
    def solve_form(self) -> str:
        """The solve kernel's products: solve_prec, or prec where that is ""."""
        return self.solve_prec or self.prec

    def caps(self, kernel: str) -> dict:
        """The launch's register cap (Triton's maxnreg) for "solve", "state" or "out": {} for none."""
        value = getattr(self, f"{kernel}_maxnreg")
        return {"maxnreg": value} if value else {}


def plan_from_text(text: str | None) -> PrefillPlan:
    """A PrefillPlan from "name=value,..." (FASTQWEN_GDN_PLAN, e.g. "block_v=16,state_stages=1");
    empty or None: the defaults. An unknown name or a bad value is an error
    naming it."""
    if not text:
        return PrefillPlan()
    kinds = {f.name: f.type for f in fields(PrefillPlan)}
    kw = {}
    for part in text.split(","):
        name, sep, value = (p.strip() for p in part.partition("="))
        if not sep or name not in kinds:
            raise ValueError(f"gdn plan: {part!r} is not name=value with a name among {', '.join(kinds)}")
        if name in ("out_prec", "prec", "solve_prec", "form"):
            kw[name] = value
        else:
            try:
                kw[name] = int(value)
            except ValueError:
                raise ValueError(f"gdn plan: {name} must be an integer, got {value!r}") from None
    return PrefillPlan(**kw)


# The engine's plan where none is named. On Triton 3.6 or newer, FAST_PLAN (measured on an
# H200, sessions 16-17): the solve on bf16 thirds at 168 registers, its inverse merged from
# 16-blocks and handed to the state kernel as P ("merged"), the state kernel on bf16 thirds with
# its columns by its programs, the output kernel at 168 registers, slices of 32K tokens (session
# 17 run 3, against session 16's plan: 16x8192 12.37 -> 9.84 ms, 4x2048 0.95 -> 0.85; the same
# sums at fp32's accuracy, the state as close to the chunked reference). On older Triton (the
# platform's 3.1) the plain defaults: its ptxas spills 252 bytes a thread in the capped solve and
# 64 in the capped output kernel (none uncapped), and no GPU here runs that Triton to measure
# whether the caps or the forms pay there.
# FASTQWEN_GDN_PLAN (read at import) picks another plan, e.g. the fastest one bench_gdn.py
# --sweep found on this GPU.
FAST_PLAN = PrefillPlan(prec="bf16x3", solve_maxnreg=168, out_maxnreg=168, form="merged", block_v=0,
                        slice_tokens=32768)
_TRITON_36 = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
DEFAULT_PLAN = (plan_from_text(os.environ["FASTQWEN_GDN_PLAN"]) if os.environ.get("FASTQWEN_GDN_PLAN")
                else FAST_PLAN if _TRITON_36 else PrefillPlan())
_BF16_MIN_DK = 64       # the smallest Dk whose solve and state products on bf16 parts are right (above)
# FASTQWEN_GDN_EXACT_PREFILL=1 (read at import): the triton backend's prompt pass runs the chunked
# rule in the reference's order of operations (gdn_exact.chunked_prefill_exact), the bits
# Transformers' own chunked rule gives (chunked_prefill_reference's); the engine's prompt pass is
# then its full forward's, bit for bit, and its noise native's (session 18, scripts/gpu_q35_opswap.py
# with the reference's ops), slower than the fast kernels.
EXACT_PREFILL = os.environ.get("FASTQWEN_GDN_EXACT_PREFILL") == "1"


def chunked_prefill_reference(q, k, v, g, beta, block_v=None, plan=None, state_out=None, initial_state=None,
                              capture=None):
    """chunked_prefill's contract (q, k heads shared by index; state_out, initial_state, capture
    (c, out)) on the reference's ops: delta_rule_chunked_reference with the q / k heads repeated as
    the torch backend repeats them, so its bits. block_v and plan are the kernels' and unused."""
    return with_prefill_contract(delta_rule_chunked_reference, q, k, v, g, beta, state_out, initial_state, capture)


def with_prefill_contract(rule, q, k, v, g, beta, state_out=None, initial_state=None, capture=None):
    """A rule of delta_rule_chunked_reference's arguments (heads repeated, state, capture=c) run
    under chunked_prefill's contract: q, k heads shared by index, the final state into state_out,
    from initial_state, the state at chunk c's start into capture's (c, out)."""
    H = v.shape[2]
    q, k = expand_heads(q, H), expand_heads(k, H)
    if capture is not None:
        o, state, at = rule(q, k, v, g, beta, state=initial_state, capture=capture[0])
        capture[1].copy_(at)
    else:
        o, state = rule(q, k, v, g, beta, state=initial_state)
    if state_out is None:
        return o, state
    state_out.copy_(state)
    return o, state_out


def _sm_count(device: torch.device) -> int:
    """The device's SMs (132 on an H100 or H200; that where there is no GPU: the interpreter, or
    scripts/compile_kernels.py's tensors that only say they are on one)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _state_columns(heads: int, Dv: int, device: torch.device) -> int:
    """The state kernel's value columns a program for block_v 0 ("auto"), given a slice's sequence
    x value heads: its walks are sequential, so a program's time is its chunks times a step's
    latency, and the kernel's time the programs' waves over the SMs (two programs an SM) times
    that. 64 columns take ~1.7x a step of 32 (session 17: 11.4 against 6.8 us), so they pay where
    their programs still fill ~3/4 of the slots (4 x 2048: 256 programs, 0.80 against 1.00 ms;
    16 x 2048: 1.41 against 1.69), and 32 below (1 x 8192: 64 programs at 64 columns, 1.00 ms
    against 0.68)."""
    if Dv % 64 == 0 and heads * (Dv // 64) >= 3 * _sm_count(device) // 2:
        return 64
    return min(32, Dv)


def _uses_bf16_parts(plan: PrefillPlan) -> bool:
    """Whether the solve or the state kernel takes its fp32 products as bf16 parts."""
    return plan.prec != "tf32x3" or plan.solve_form != "tf32x3"


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    block_v: int | None = None, plan: PrefillPlan | None = None, state_out: torch.Tensor | None = None,
                    initial_state: torch.Tensor | None = None, capture: tuple | None = None):
    """The chunked rule over a prompt, as three kernels (from a zero state; with initial_state,
    a contiguous fp32 [B, Hv, Dk, Dv], from it: the rest of a sequence whose first part a
    call before this one took, e.g. a prompt prefilled in chunks; it may be state_out itself,
    the cache rows updated in place; capture (c, out): also the state at chunk c's start, after c
    chunks of this call, into out, fp32 [B, Hv, Dk, Dv], which the state kernel writes for the
    output kernel anyway (a snapshot, fq_qwen35)): q, k
    [B, T, Hk, Dk] bf16 (the conv's output: not normalized, heads not repeated), v [B, T, Hv, Dv]
    bf16, g [B, T, Hv] fp32, beta [B, T, Hv] bf16. block_v: value columns per state program (a
    power of two dividing Dv; None: the plan's); plan: the launches
    (PrefillPlan; None: DEFAULT_PLAN, on three TF32 passes where Dk < 64). q, k and v are read in place where their last dimension has unit stride
    (e.g. head views of the conv's output rows; q and k with the same strides), g and beta
    likewise. state_out: a contiguous fp32 [B, Hv, Dk, Dv] to write the final state into (a
    cache's rows), else a new one. Returns (o [B, T, Hv, Dv] bf16, the final state), what
    delta_rule_chunked_reference returns on the repeated heads."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (B, T) or Hv % Hk or tuple(g.shape) != (B, T, Hv) \
            or tuple(beta.shape) != (B, T, Hv) or g.dtype != torch.float32:
        raise ValueError(f"gdn.chunked_prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {g.dtype} {tuple(g.shape)}, beta {tuple(beta.shape)} do not fit")
    if plan is None:
        plan = DEFAULT_PLAN
        if Dk < _BF16_MIN_DK and _uses_bf16_parts(plan):
            plan = replace(plan, prec="tf32x3", solve_prec="tf32x3")
    elif Dk < _BF16_MIN_DK and _uses_bf16_parts(plan):
        raise ValueError(f"gdn.chunked_prefill: the plan's solve and state products on bf16 parts (prec "
                         f"{plan.prec!r}, solve_prec {plan.solve_prec!r}) need Dk >= {_BF16_MIN_DK}, got Dk {Dk}")
    rows = max(1, (plan.slice_tokens or _TOKENS_PER_SLICE) // (triton.cdiv(T, CHUNK) * CHUNK))  # sequences a slice
    block_v = min(plan.block_v if block_v is None else block_v, Dv) or _state_columns(min(rows, B) * Hv, Dv, v.device)
    if Dk & (Dk - 1) or Dk < 32 or Dv % block_v or block_v & (block_v - 1) or block_v < 16 or T < 1:
        raise ValueError(f"gdn.chunked_prefill: Dk ({Dk}) must be a power of two >= 32 (the state kernel's halves "
                         f"of 16 or more), block_v ({block_v}) a "
                         f"power of two >= 16 dividing Dv ({Dv}), T ({T}) >= 1")
    if q.stride() != k.stride() or q.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if g.stride() != beta.stride() or g.stride(-1) != 1:
        g, beta = g.contiguous(), beta.contiguous()
    nc = triton.cdiv(T, CHUNK)
    if capture is not None and (not 0 <= capture[0] < nc or capture[1].dtype != torch.float32
                                or tuple(capture[1].shape) != (B, Hv, Dk, Dv)):
        raise ValueError(f"gdn.chunked_prefill: capture must be (a chunk in [0, {nc}), float32 {(B, Hv, Dk, Dv)}), "
                         f"got ({capture[0]}, {capture[1].dtype} {tuple(capture[1].shape)})")
    dev = v.device
    out = torch.empty((B, T, Hv, Dv), dtype=torch.bfloat16, device=dev)
    if state_out is None:
        state = torch.empty((B, Hv, Dk, Dv), dtype=torch.float32, device=dev)
    elif state_out.dtype != torch.float32 or tuple(state_out.shape) != (B, Hv, Dk, Dv) or not state_out.is_contiguous():
        raise ValueError(f"gdn.chunked_prefill: state_out must be contiguous float32 {(B, Hv, Dk, Dv)}, got "
                         f"{state_out.dtype} {tuple(state_out.shape)}")
    else:
        state = state_out
    if initial_state is not None and (initial_state.dtype != torch.float32 or not initial_state.is_contiguous()
                                      or tuple(initial_state.shape) != (B, Hv, Dk, Dv)):
        raise ValueError(f"gdn.chunked_prefill: initial_state must be contiguous float32 {(B, Hv, Dk, Dv)}, got "
                         f"{initial_state.dtype} {tuple(initial_state.shape)}")
    ws = min(rows, B) * Hv * nc * CHUNK
    inverse = plan.form != "uw"
    u = torch.empty((ws, Dv), dtype=torch.float32, device=dev)          # u (or nothing), then v_new in its place
    # w, or with the inverse form each chunk's P = M^-1 diag(beta) ([C, C])
    w = torch.empty((ws, CHUNK if inverse else Dk), dtype=torch.float32, device=dev)
    gamma = torch.empty((ws,), dtype=torch.float32, device=dev)
    rk = torch.empty((ws,), dtype=torch.float32, device=dev)            # each key's l2 norm factor
    # each chunk's starting state (the output kernel's input)
    h = torch.empty((ws // CHUNK * Dk, Dv), dtype=torch.float32, device=dev)
    out_bv = min(plan.out_bv, Dv)
    if Dv % out_bv or out_bv < 16:
        raise ValueError(f"gdn.chunked_prefill: the plan's out_bv ({plan.out_bv}) must divide Dv ({Dv}), >= 16")
    # the solve's and the state kernel's products (_PREC other than "tf32x3": both, bench_gdn's A/B)
    solve_prec, prec = (_PREC, _PREC) if _PREC != "tf32x3" else (plan.solve_form, plan.prec)
    solve_form = {} if not inverse else dict(p_ptr=w, INVERSE=True, MERGED=plan.form == "merged")
    for b0 in range(0, B, rows):
        sl = slice(b0, min(B, b0 + rows))
        bs = sl.stop - sl.start
        qs, ks, vs, gs, bts, os_ = q[sl], k[sl], v[sl], g[sl], beta[sl], out[sl]
        init = {} if initial_state is None else dict(init_ptr=initial_state[sl], stride_ib=initial_state.stride(0),
                                                     HAS_INIT=True)
        state_form = {} if not inverse else dict(p_ptr=w, v_ptr=vs, stride_vb=vs.stride(0), stride_vt=vs.stride(1),
                                                 stride_vh=vs.stride(2), INVERSE=True)
        _chunk_solve_kernel[(bs * Hv, nc)](
            ks, vs, gs, bts, u, w, gamma, rk, T, nc, ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0),
            vs.stride(1), vs.stride(2), gs.stride(0), gs.stride(1), HV=Hv, RATIO=Hv // Hk, C=CHUNK, DK=Dk, DV=Dv,
            PREC=solve_prec, num_warps=plan.solve_warps, **solve_form, **plan.caps("solve"))
        _chunk_state_kernel[(Dv // block_v, bs * Hv)](
            ks, u, w, gamma, rk, h, state[sl], T, nc, ks.stride(0), ks.stride(1), ks.stride(2), state.stride(0),
            HV=Hv, RATIO=Hv // Hk, C=CHUNK, DK=Dk, DV=Dv, BV=block_v, PREC=prec, num_warps=plan.state_warps,
            num_stages=plan.state_stages, **init, **state_form, **plan.caps("state"))
        _chunk_out_kernel[(bs * Hv, nc, Dv // out_bv)](
            qs, ks, u, gamma, rk, h, os_, T, nc, Dk ** -0.5, qs.stride(0), qs.stride(1), qs.stride(2),
            os_.stride(0), os_.stride(1), os_.stride(2), HV=Hv, RATIO=Hv // Hk, C=CHUNK, DK=Dk, DV=Dv,
            BV=out_bv, PREC=_PREC if _PREC != "tf32x3" else plan.out_prec, num_warps=plan.out_warps,
            **plan.caps("out"))
        if capture is not None:     # h: each (sequence, head, chunk)'s starting state, [Dk, Dv] each
            capture[1][sl] = h[:bs * Hv * nc * Dk].view(bs, Hv, nc, Dk, Dv)[:, :, capture[0]]
    return out, state


_INTERPRETED = type(_decode_step_kernel).__name__ == "InterpretedFunction"
