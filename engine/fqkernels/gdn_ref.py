"""Gated DeltaNet, the linear-attention layers of Qwen3.5, in pure torch: the references.

The short causal conv, the gates, the gated delta rule over an fp32 state (one token at a
time, and chunked), and the gated RMSNorm after it, computed as the Qwen3.5 reference computes
them (Transformers 5.17.0's torch fallback: neither flash-linear-attention nor causal-conv1d
installed), operation for operation where the bits depend on it; tests/test_gdn.py checks them
bit for bit against it. The kernels (gdn_step: the decode step; gdn_prefill: the prompt pass;
gdn_norm: the gated norm; gdn_exact_step: the exact decode step) are tested against these.

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

import torch
import torch.nn.functional as F

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



def decode_step_reference(q, k, v, g, beta, state):
    """decode_step through the recurrent reference (heads repeated, T = 1); state updated in place."""
    Hv = v.shape[1]
    o, s = delta_rule_recurrent_reference(expand_heads(q[:, None], Hv), expand_heads(k[:, None], Hv), v[:, None],
                                          g[:, None], beta[:, None], state=state)
    state.copy_(s)
    return o[:, 0]


def conv_gates_step_reference(mixed, conv_state, conv_w, a, b, a_log, dt_bias):
    """conv_gates_step through the references (conv_state updated in place)."""
    x, new_state = causal_conv_reference(mixed[:, :, None], conv_w, conv_state)
    conv_state.copy_(new_state)
    g, beta = gates_reference(a, b, a_log, dt_bias)
    return x[:, :, 0], g, beta


def chunked_prefill_reference(q, k, v, g, beta, block_v=None, plan=None, state_out=None, initial_state=None,
                              capture=None):
    """chunked_prefill's contract (q, k heads shared by index; state_out, initial_state, capture
    (c, out)) on the reference's ops: delta_rule_chunked_reference with the q / k heads repeated as
    the torch op set repeats them, so its bits. block_v and plan are the kernels' and unused."""
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

