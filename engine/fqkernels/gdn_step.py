"""Qwen3.5's GDN decode step on the GPU, for the recurrent rule (exact decode's step is
gdn_exact_step's):

  conv_gates_step           the conv over the conv state's window (shifted in place) and the gates
  conv_gates_rows           the same for T rows of each sequence in turn (a speculative verify), one
                            kernel, each row's conv state kept: each row conv_gates_step's bits
  in_proj_conv_gates_step   in_proj's product with the conv and gates in its epilogue, one kernel
                            (gemv's sums, so the product's bits; used where the GEMV runs in_proj)
  decode_step               the gated delta rule's recurrent step on the fp32 state, in place

Each kernel has the cast points of the references in gdn_ref (conv output and SiLU rounded to
bf16, beta = bf16(sigmoid(b)), g = -exp(A_log) softplus(a + dt_bias) in fp32, the state fp32),
which tests/kernels/test_gdn_kernels.py checks them against. The gate formulas (_gate_values)
are shared with the prompt pass's gates kernel (gdn_prefill).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fqkernels import gemv, pdl
from fqkernels.swiglu import exp_f32, sigmoid_f32, silu_f32


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
        raise ValueError(f"gdn_step.decode_step: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if state.dtype != torch.float32 or tuple(state.shape) != (B, Hv, Dk, Dv) or not state.is_contiguous():
        raise ValueError(f"gdn_step.decode_step: state must be contiguous float32 {(B, Hv, Dk, Dv)}, "
                         f"got {state.dtype} {tuple(state.shape)}")
    if g.dtype != torch.float32 or tuple(g.shape) != (B, Hv) or tuple(beta.shape) != (B, Hv):
        raise ValueError(f"gdn_step.decode_step: g must be float32 {(B, Hv)} and beta {(B, Hv)}, "
                         f"got {g.dtype} {tuple(g.shape)} and {tuple(beta.shape)}")
    if Dk & (Dk - 1) or Dv % block_v:
        raise ValueError(f"gdn_step.decode_step: Dk must be a power of two and Dv a multiple of {block_v}")
    q, k, v, g, beta = step_views(q, k, v, g, beta)
    out = torch.empty((B, Hv, Dv), dtype=torch.bfloat16, device=v.device)
    use_pdl, pdl_launch = pdl.for_rows(B)
    _decode_step_kernel[(B * Hv, Dv // block_v)](
        q, k, v, g, beta, state, out, q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
        HV=Hv, RATIO=Hv // Hk, DK=Dk, BLOCK_V=block_v, PDL=use_pdl, num_warps=4, **pdl_launch)
    return out



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
        raise ValueError(f"gdn_step.conv_gates_step: conv_state {tuple(conv_state.shape)} and conv_w "
                         f"{tuple(conv_w.shape)} do not fit mixed {tuple(mixed.shape)}")
    if tuple(b.shape) != (B, Hv) or tuple(a_log.shape) != (Hv,) or tuple(dt_bias.shape) != (Hv,) or Hv & (Hv - 1):
        raise ValueError(f"gdn_step.conv_gates_step: gates a {tuple(a.shape)}, b {tuple(b.shape)}, A_log "
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
def _conv_gates_rows_kernel(mixed_ptr, conv_state_ptr, conv_w_ptr, x_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
                            g_ptr, beta_ptr, states_ptr, B, C, stride_mb, stride_mt, stride_sb, stride_sc,
                            stride_ab, stride_at, stride_ot, stride_ob, stride_oc, T: tl.constexpr,
                            HV: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
                            PDL: tl.constexpr = False):
    """conv_gates_step's program (a window of 4) over a sequence's T rows in turn: the window in
    registers, each row's conv summed as that kernel sums it, the state after each row stored to
    states[t, b] and the last one to the conv state; program (b, 0) forms every row's gates.
    Outputs row-major in t: x [T, B, C], g and beta [T, B, HV]. T (a verify's rows) is a constant:
    the rows unroll."""
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < C
    pdl.wait(PDL)  # mixed, a and b are the previous product's; the conv state an earlier step's
    pdl.launch_dependents(PDL)
    state = conv_state_ptr + b * stride_sb + offs * stride_sc
    s0 = tl.load(state + 0, mask=ok, other=0.0)
    s1 = tl.load(state + 1, mask=ok, other=0.0)
    s2 = tl.load(state + 2, mask=ok, other=0.0)
    s3 = tl.load(state + 3, mask=ok, other=0.0)
    w0 = tl.load(conv_w_ptr + offs * 4 + 0, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(conv_w_ptr + offs * 4 + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(conv_w_ptr + offs * 4 + 2, mask=ok, other=0.0).to(tl.float32)
    w3 = tl.load(conv_w_ptr + offs * 4 + 3, mask=ok, other=0.0).to(tl.float32)
    for t in tl.static_range(T):
        new = tl.load(mixed_ptr + b * stride_mb + t * stride_mt + offs, mask=ok, other=0.0)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        acc += w0 * s1.to(tl.float32)
        acc += w1 * s2.to(tl.float32)
        acc += w2 * s3.to(tl.float32)
        acc += w3 * new.to(tl.float32)
        s0, s1, s2, s3 = s1, s2, s3, new
        conv = acc.to(tl.bfloat16).to(tl.float32)
        tl.store(x_ptr + (t * B + b) * C + offs, silu_f32(conv, INTERPRETED).to(tl.bfloat16), mask=ok)
        out = states_ptr + t * stride_ot + b * stride_ob + offs * stride_oc
        tl.store(out + 0, s0, mask=ok)
        tl.store(out + 1, s1, mask=ok)
        tl.store(out + 2, s2, mask=ok)
        tl.store(out + 3, s3, mask=ok)
    tl.store(state + 0, s0, mask=ok)
    tl.store(state + 1, s1, mask=ok)
    tl.store(state + 2, s2, mask=ok)
    tl.store(state + 3, s3, mask=ok)
    if tl.program_id(1) == 0:
        h = tl.arange(0, HV)
        for t in tl.static_range(T):
            g, beta = _gate_values(tl.load(a_ptr + b * stride_ab + t * stride_at + h).to(tl.float32),
                                   tl.load(b_ptr + b * stride_ab + t * stride_at + h).to(tl.float32),
                                   tl.load(a_log_ptr + h).to(tl.float32), tl.load(dt_bias_ptr + h).to(tl.float32),
                                   INTERPRETED)
            tl.store(beta_ptr + (t * B + b) * HV + h, beta)
            tl.store(g_ptr + (t * B + b) * HV + h, g)


def conv_gates_rows(mixed: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                    block_c: int = 512):
    """conv_gates_step for T rows of each sequence in turn, in one kernel: mixed [B, T, C] bf16 (unit
    last stride; e.g. column slices of in_proj's rows), conv_state [B, C, 4] bf16 (left after the
    last row), conv_w [C, 4]; a, b [B, T, Hv] bf16 (one stride pair); a_log, dt_bias [Hv]; states
    [T, B, C, 4] bf16 (any strides, unit last), written with the conv state after each row (a
    verify's rollback keeps the one after its last kept row). Returns (x [T, B, C] bf16, g [T, B,
    Hv] fp32, beta [T, B, Hv] bf16), row t of each conv_gates_step's bits at that row."""
    B, T, C = mixed.shape
    Hv = a.shape[-1]
    if (tuple(conv_state.shape) != (B, C, 4) or conv_state.stride(2) != 1 or tuple(conv_w.shape) != (C, 4)
            or tuple(states.shape) != (T, B, C, 4) or states.stride(3) != 1 or states.dtype != conv_state.dtype):
        raise ValueError(f"gdn_step.conv_gates_rows: conv_state {tuple(conv_state.shape)}, conv_w "
                         f"{tuple(conv_w.shape)} and states {tuple(states.shape)} do not fit mixed {tuple(mixed.shape)} "
                         f"(a window of 4; unit last strides)")
    if (tuple(a.shape) != (B, T, Hv) or tuple(b.shape) != (B, T, Hv) or tuple(a_log.shape) != (Hv,)
            or tuple(dt_bias.shape) != (Hv,) or Hv & (Hv - 1)):
        raise ValueError(f"gdn_step.conv_gates_rows: gates a {tuple(a.shape)}, b {tuple(b.shape)}, A_log "
                         f"{tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)} (heads a power of two)")
    if mixed.stride(-1) != 1:
        mixed = mixed.contiguous()
    if a.stride(-1) != 1 or b.stride(-1) != 1 or a.stride()[:2] != b.stride()[:2]:
        a, b = a.contiguous(), b.contiguous()
    conv_w = conv_w.contiguous()
    x = torch.empty((T, B, C), dtype=mixed.dtype, device=mixed.device)
    g = torch.empty((T, B, Hv), dtype=torch.float32, device=mixed.device)
    beta = torch.empty((T, B, Hv), dtype=torch.bfloat16, device=mixed.device)
    use_pdl, pdl_launch = pdl.for_rows(B)
    _conv_gates_rows_kernel[(B, triton.cdiv(C, block_c))](
        mixed, conv_state, conv_w, x, a, b, a_log, dt_bias, g, beta, states, B, C, mixed.stride(0),
        mixed.stride(1), conv_state.stride(0), conv_state.stride(1), a.stride(0), a.stride(1), states.stride(0),
        states.stride(1), states.stride(2), T=T, HV=Hv, BLOCK_C=block_c, INTERPRETED=_INTERPRETED, PDL=use_pdl,
        num_warps=4, **pdl_launch)
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
    """The decode step's conv and gates as the epilogue of in_proj's product (_in_proj_conv_gates_kernel):
    acc holds fp32 sums of output columns `cols` for rows `rows` (broadcast shapes: a vector of one
    row's columns or a [rows, columns] tile), x1..dt_bias what
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


@triton.jit(do_not_specialize=["M"])
def _in_proj_conv_gates_kernel(x_ptr, w_ptr, out_ptr, g_ptr, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr,
                               M, N, stride_sb, stride_sc,
                               K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               SPLIT_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, EVEN_N: tl.constexpr,
                               EVEN_K: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr, CONV_DIM: tl.constexpr,
                               GATE_COL: tl.constexpr, HV: tl.constexpr, INTERPRETED: tl.constexpr,
                               PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 1):
    """in_proj's product (gemv's sums: FMA, its fma kernel's with one row a program; else its tl.dot
    kernel's, SWAP as there) with in_proj_epilogue on each output: x [M, K] bf16, w [N, K] the
    packed in_proj, out [M, N] bf16, g [M, HV] fp32; one K chunk a program (SPLIT_K 1)."""
    if FMA:
        pid_s, m0, offs_n, offs_k, cols_ld, k_lo = gemv.fma_setup(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                                                                  BLOCKS_PER_SPLIT, EVEN_N)
        w_ptrs = w_ptr + cols_ld.to(tl.int64)[:, None] * K + offs_k[None, :]
        gemv._prefetch_first_block(w_ptr, cols_ld, k_lo, 0, K, False, PDL, PREFETCH_LINES)
        e1, e2, e3, ew0, ew1, ew2, ew3, ea, ed = in_proj_epilogue_inputs(
            m0, offs_n, M, N, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, stride_sb, stride_sc, CONV_DIM,
            GATE_COL, HV)
        pdl.wait(PDL)  # x is the previous kernel's output
        acc0, acc1, acc2, acc3, accu0, accu1, accu2, accu3 = gemv.fma_sums(
            x_ptr, w_ptrs, m0, M, k_lo, offs_k, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKS_PER_SPLIT, EVEN_K, False)
        pdl.launch_dependents(PDL)
        in_proj_epilogue(tl.sum(acc0, axis=1), m0, offs_n, M, N, out_ptr, g_ptr, conv_state_ptr, stride_sb,
                         stride_sc, e1, e2, e3, ew0, ew1, ew2, ew3, ea, ed, CONV_DIM, GATE_COL, HV, INTERPRETED)
    else:
        pid_s, offs_m, offs_n, offs_k, rows_ld, cols_ld, k_lo = gemv.dot_setup(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, BLOCKS_PER_SPLIT, EVEN_N)
        x_ptrs = x_ptr + rows_ld[:, None] * K + (k_lo + offs_k)[None, :]
        w_ptrs = w_ptr + cols_ld.to(tl.int64)[:, None] * K + (k_lo + offs_k)[None, :]
        gemv._prefetch_first_block(w_ptr, cols_ld, k_lo, 0, K, False, PDL, PREFETCH_LINES)
        e1, e2, e3, ew0, ew1, ew2, ew3, ea, ed = in_proj_epilogue_inputs(
            offs_m[:, None], offs_n[None, :], M, N, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, stride_sb,
            stride_sc, CONV_DIM, GATE_COL, HV)
        pdl.wait(PDL)  # x is the previous kernel's output
        acc, acc_u = gemv.dot_sums(x_ptrs, w_ptrs, k_lo, offs_k, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKS_PER_SPLIT,
                                   EVEN_K, False, SWAP, INTERPRETED)
        pdl.launch_dependents(PDL)
        if SWAP:
            acc = tl.trans(acc)
        in_proj_epilogue(acc, offs_m[:, None], offs_n[None, :], M, N, out_ptr, g_ptr, conv_state_ptr, stride_sb,
                         stride_sc, e1, e2, e3, ew0, ew1, ew2, ew3, ea, ed, CONV_DIM, GATE_COL, HV, INTERPRETED)


def in_proj_conv_gates_step(h: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor,
                            a_log: torch.Tensor, dt_bias: torch.Tensor, value_dim: int,
                            config: gemv.GemvConfig | None = None):
    """A decode step's in_proj product with the conv and gates in its epilogue (one kernel in place
    of gemv.linear then conv_gates_step, the same bits): h [B, K] bf16; w [C + Hv Dv + 2 Hv, K] the
    packed in_proj (qkv | z | b | a); conv_state [B, C, W] bf16 (updated in place), conv_w [C, W];
    a_log, dt_bias [Hv]; value_dim = Hv Dv. Returns (x [B, C], z [B, Hv Dv], beta [B, Hv], all bf16
    column slices of one [B, N] row, and g [B, Hv] fp32 contiguous). config: gemv's (None: its
    table); one K chunk a program and, in its fma mode, one row a program (ValueError otherwise):
    each output column is then summed, rounded and post-processed by one program, so the conv
    state shifts exactly once."""
    B = h.shape[0]
    Hv = a_log.shape[0]
    C, W = conv_w.shape
    N = w.shape[0]
    if N != C + value_dim + 2 * Hv or tuple(dt_bias.shape) != (Hv,):
        raise ValueError(f"gdn_step.in_proj_conv_gates_step: in_proj {tuple(w.shape)} is not conv {C} + value "
                         f"{value_dim} + 2 x {Hv} heads (A_log {tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)})")
    if W != 4:
        raise ValueError(f"gdn_step.in_proj_conv_gates_step: the epilogue runs a conv window of 4, got {W}")
    if tuple(conv_state.shape) != (B, C, W) or conv_state.stride(2) != 1:
        raise ValueError(f"gdn_step.in_proj_conv_gates_step: conv_state {tuple(conv_state.shape)} (strides "
                         f"{conv_state.stride()}) must be [{B}, {C}, {W}] with unit stride on the window")
    gemv.check_operands(h, w, "w")
    gemv.check_device(h, w, "w")
    K = h.shape[1]
    config = gemv.select_config(N, K, False, B) if config is None else config
    plan = gemv.launch_plan(B, N, K, config)
    if plan["splits"] != 1 or (config.mode == "fma" and config.block_m != 1):
        raise ValueError(f"gdn_step.in_proj_conv_gates_step: the epilogue needs one K chunk a program and (fma) "
                         f"one row a program; config {config} gives {plan['splits']} chunks of K={K}")
    g = torch.empty((B, Hv), dtype=torch.float32, device=h.device)
    out = torch.empty((B, N), dtype=torch.bfloat16, device=h.device)
    use_pdl, pdl_launch = pdl.for_rows(B)
    _in_proj_conv_gates_kernel[plan["grid"]](
        h, w, out, g, conv_state, conv_w.contiguous(), a_log, dt_bias, B, N, conv_state.stride(0),
        conv_state.stride(1), FMA=config.mode == "fma", SWAP=config.mode == "dot_t", CONV_DIM=C,
        GATE_COL=C + value_dim, HV=Hv, INTERPRETED=_INTERPRETED, PDL=use_pdl, num_warps=config.num_warps,
        num_stages=config.num_stages, **plan["constexprs"], **pdl_launch)
    x, z, beta, _ = torch.split(out, [C, value_dim, Hv, Hv], dim=-1)
    return x, z, beta, g


_INTERPRETED = type(_decode_step_kernel).__name__ == "InterpretedFunction"
