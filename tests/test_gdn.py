"""Gated DeltaNet references (engine/fqkernels/gdn_ref.py) against a float64 oracle of the
delta rule, in its recurrent and its chunked form, with error gates on the outputs and
the final states; and bit for bit against what Transformers 5.17.0 (the Qwen3.5
reference, torch fallback) computes, run in its own environment (.venv-qwen35).

The gates are the ones the Triton kernels are held to, set from what the fp32
references themselves reach against the oracle on these inputs: outputs within GATE_OUT
of the output's scale (they are rounded to bf16, whose half ulp is 2^-9 ~ 2e-3 relative;
the references reach 2.9e-3), final states within GATE_STATE of theirs (fp32; the
references reach 1.4e-6). A chunked form that stores its within-chunk solution in bf16,
as flash-linear-attention's kernel does, misses the state gate by 100x (a test below)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import gdn_prefill, gdn_ref  # noqa: E402

from fastqwen import refenv  # noqa: E402

GATE_OUT = 5e-3     # max |o - oracle| / max |oracle|, outputs in bf16 (the references: 2.9e-3)
GATE_STATE = 2e-5   # max |S - oracle| / max |oracle|, fp32 states (the references: 1.4e-6)


def inputs(B: int, T: int, Hk: int, Hv: int, D: int, seed: int, dtype=torch.bfloat16, state: bool = False):
    """Model-like inputs: q, k, v as the conv's bf16 outputs, gates as the layer forms them
    (A from uniform(0.01, 16) in fp32, dt_bias 1), heads expanded as the layer does."""
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, D, generator=g_).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g_).to(dtype)
    v = torch.randn(B, T, Hv, D, generator=g_).to(dtype)
    a = torch.randn(B, T, Hv, generator=g_).to(dtype)
    b = torch.randn(B, T, Hv, generator=g_).to(dtype)
    a_log = torch.log(torch.empty(Hv).uniform_(0.01, 16, generator=g_)).to(dtype)
    dt_bias = torch.ones(Hv, dtype=dtype)
    g, beta = gdn_ref.gates_reference(a, b, a_log, dt_bias)
    q, k = gdn_ref.expand_heads(q, Hv), gdn_ref.expand_heads(k, Hv)
    s0 = torch.randn(B, Hv, D, D, generator=g_) * 0.1 if state else None
    return q, k, v, g, beta, s0


# ---------------------------------------------------------------------------- the oracle

def _oracle_prepare(q, k, v, g, beta):
    q, k, v, g, beta = (t.double().transpose(1, 2) for t in (q, k, v, g, beta))  # [B, H, T, .]
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + gdn_ref.EPS)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + gdn_ref.EPS)
    return q / math.sqrt(q.shape[-1]), k, v, g, beta


def oracle_recurrent(q, k, v, g, beta, s0=None):
    """float64, one token at a time, one (sequence, head) at a time: the rule as written."""
    q, k, v, g, beta = _oracle_prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64) if s0 is None else s0.double().clone()
    for b in range(B):
        for h in range(H):
            s = S[b, h]
            for t in range(T):
                s = math.exp(g[b, h, t]) * s
                u = beta[b, h, t] * (v[b, h, t] - s.T @ k[b, h, t])
                s = s + torch.outer(k[b, h, t], u)
                out[b, h, t] = s.T @ q[b, h, t]
            S[b, h] = s
    return out.transpose(1, 2), S


def oracle_chunked(q, k, v, g, beta, s0=None, chunk=gdn_ref.CHUNK):
    """float64, by chunks, with the within-chunk system inverted outright (not solved by
    substitution as the reference does): a second construction of the same function."""
    q, k, v, g, beta = _oracle_prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    out = torch.zeros(B, H, T, Dv, dtype=torch.float64)
    S = torch.zeros(B, H, Dk, Dv, dtype=torch.float64) if s0 is None else s0.double().clone()
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(c0 + chunk, T))
        Q, K, V, G, Bt = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
        n = K.shape[2]
        gam = G.cumsum(-1)                                               # [B, H, n]
        D = torch.exp(gam[..., :, None] - gam[..., None, :]).tril()      # decay j -> i, j <= i
        A = torch.eye(n, dtype=torch.float64) + ((Bt[..., None] * K) @ K.transpose(-1, -2) * D).tril(-1)
        Ainv = torch.linalg.inv(A)
        U = Ainv @ (Bt[..., None] * V)
        W = Ainv @ (Bt[..., None] * K * torch.exp(gam)[..., None])
        Vn = U - W @ S
        out[:, :, sl] = (Q * torch.exp(gam)[..., None]) @ S + ((Q @ K.transpose(-1, -2)) * D) @ Vn
        S = torch.exp(gam[..., -1])[..., None, None] * S + (K * torch.exp(gam[..., -1:] - gam)[..., None]).transpose(-1, -2) @ Vn
    return out.transpose(1, 2), S


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


SHAPES = [(1, 1, 2, 4, 16), (2, 3, 2, 4, 16), (2, 63, 2, 4, 32), (1, 64, 2, 2, 32), (2, 65, 1, 2, 32),
          (2, 130, 2, 4, 32), (1, 200, 4, 8, 16)]


@pytest.mark.parametrize("B,T,Hk,Hv,D", SHAPES)
def test_oracle_forms_agree(B, T, Hk, Hv, D):
    q, k, v, g, beta, s0 = inputs(B, T, Hk, Hv, D, seed=T, state=True)
    o1, s1 = oracle_recurrent(q, k, v, g, beta, s0)
    o2, s2 = oracle_chunked(q, k, v, g, beta, s0)
    assert rel(o2, o1) < 1e-10 and rel(s2, s1) < 1e-10


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("B,T,Hk,Hv,D", SHAPES)
def test_references_within_the_gates(B, T, Hk, Hv, D, state):
    q, k, v, g, beta, s0 = inputs(B, T, Hk, Hv, D, seed=7 * T + D, state=state)
    o_ref, s_ref = oracle_recurrent(q, k, v, g, beta, s0)
    for name, fn in (("recurrent", gdn_ref.delta_rule_recurrent_reference), ("chunked", gdn_ref.delta_rule_chunked_reference)):
        o, s = fn(q, k, v, g, beta, state=s0)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and o.shape == v.shape
        assert rel(o, o_ref) <= GATE_OUT, f"{name}: output {rel(o, o_ref):.2e}"
        assert rel(s, s_ref) <= GATE_STATE, f"{name}: state {rel(s, s_ref):.2e}"


def test_a_bf16_stage_fails_the_gates():
    """The gates separate: the chunked form with its within-chunk solution rounded to bf16
    (what flash-linear-attention's chunk kernel stores) is outside them."""
    q, k, v, g, beta, _ = inputs(2, 130, 2, 4, 32, seed=3)
    o_ref, s_ref = oracle_recurrent(q, k, v, g, beta)
    orig = torch.linalg.solve_triangular

    def rounded(*a, **kw):
        return orig(*a, **kw).bfloat16().float()
    torch.linalg.solve_triangular = rounded
    try:
        o, s = gdn_ref.delta_rule_chunked_reference(q, k, v, g, beta)
    finally:
        torch.linalg.solve_triangular = orig
    assert rel(s, s_ref) > GATE_STATE


def test_prefill_then_steps_is_one_sequence():
    """A chunked prompt then token-by-token steps from its state = the rule over the whole."""
    q, k, v, g, beta, _ = inputs(2, 70, 2, 4, 32, seed=11)
    o_all, s_all = oracle_recurrent(q, k, v, g, beta)
    o1, s1 = gdn_ref.delta_rule_chunked_reference(q[:, :66], k[:, :66], v[:, :66], g[:, :66], beta[:, :66])
    o2, s2 = gdn_ref.delta_rule_recurrent_reference(q[:, 66:], k[:, 66:], v[:, 66:], g[:, 66:], beta[:, 66:], state=s1)
    assert rel(torch.cat([o1, o2], 1), o_all) <= GATE_OUT and rel(s2, s_all) <= GATE_STATE


def test_bad_state_is_named():
    q, k, v, g, beta, _ = inputs(1, 3, 1, 2, 16, seed=1)
    with pytest.raises(ValueError, match="state must be float32"):
        gdn_ref.delta_rule_recurrent_reference(q, k, v, g, beta, state=torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not a multiple"):
        gdn_ref.expand_heads(q[:, :, :1].expand(1, 3, 3, 16), 4)


def test_conv_prompt_then_steps():
    """The conv over a prompt, then one step at a time from its state, = the conv over all."""
    g_ = torch.Generator().manual_seed(5)
    u = torch.randn(2, 12, 9, generator=g_).bfloat16()
    w = (torch.randn(12, 4, generator=g_) * 0.5).bfloat16()
    whole, _ = gdn_ref.causal_conv_reference(u, w)
    head, state = gdn_ref.causal_conv_reference(u[..., :2], w)              # shorter than the window
    assert state.shape == (2, 12, 4) and torch.equal(state[..., :2], torch.zeros(2, 12, 2, dtype=torch.bfloat16))
    outs = [head]
    for t in range(2, 9):
        o, state = gdn_ref.causal_conv_reference(u[..., t:t + 1], w, state)
        outs.append(o)
    assert torch.equal(torch.cat(outs, -1), whole)
    assert torch.equal(state, u[..., -4:])


# ------------------------------------------------ bit for bit against Transformers 5.17.0

_REFERENCE_SCRIPT = r"""
import sys, torch, json
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as m
assert transformers.__version__ == "5.17.0", transformers.__version__
d = torch.load(sys.argv[1])
out = {}
for name in ("recurrent", "chunked"):
    fn = m.torch_recurrent_gated_delta_rule if name == "recurrent" else m.torch_chunk_gated_delta_rule
    for tag, s0 in (("", None), ("_state", d["s0"])):
        o, s = fn(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], initial_state=None if s0 is None else s0.clone(),
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        out[name + tag] = (o, s)
conv_state = torch.zeros(2, 12, 4, dtype=torch.bfloat16)
out["conv_prompt"] = m.causal_conv1d_fn(d["u"], d["cw"], None, activation="silu")
out["conv_step"] = (m.causal_conv1d_update(d["u"][..., :1], d["cs"].clone(), d["cw"], None, activation="silu"),)
norm = m.Qwen3_5RMSNormGated(d["nx"].shape[-1], eps=1e-6).to(torch.bfloat16)
with torch.no_grad():
    norm.weight.copy_(d["nw"])
    out["gated_norm"] = norm(d["nx"], d["nz"])
lin = m.Qwen3_5GatedDeltaNet.__new__(m.Qwen3_5GatedDeltaNet)
g = -d["a_log"].float().exp() * torch.nn.functional.softplus(d["a"].float() + d["dt_bias"])
out["gates"] = (g, d["b"].sigmoid())
torch.save(out, sys.argv[2])
"""


def test_references_are_transformers_5_17_bit_for_bit(tmp_path: Path):
    try:
        env = refenv.reference_env("qwen3_5_text")
    except FileNotFoundError as e:
        pytest.fail(str(e))
    q, k, v, g, beta, s0 = inputs(2, 70, 2, 4, 32, seed=21, state=True)
    g_ = torch.Generator().manual_seed(22)
    d = dict(q=q, k=k, v=v, g=g, beta=beta, s0=s0, u=torch.randn(2, 12, 9, generator=g_).bfloat16(),
             cw=(torch.randn(12, 4, generator=g_) * 0.5).bfloat16(), cs=torch.randn(2, 12, 4, generator=g_).bfloat16(),
             nx=torch.randn(6, 32, generator=g_).bfloat16(), nz=torch.randn(6, 32, generator=g_).bfloat16(),
             nw=(torch.rand(32, generator=g_) + 0.5).bfloat16(), a=torch.randn(2, 5, 4, generator=g_).bfloat16(),
             b=torch.randn(2, 5, 4, generator=g_).bfloat16(),
             a_log=torch.log(torch.empty(4).uniform_(0.01, 16, generator=g_)).bfloat16(),
             dt_bias=torch.ones(4, dtype=torch.bfloat16))
    torch.save(d, tmp_path / "in.pt")
    run = subprocess.run([sys.executable, "-c", _REFERENCE_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = torch.load(tmp_path / "out.pt", weights_only=True)
    for name, fn in (("recurrent", gdn_ref.delta_rule_recurrent_reference), ("chunked", gdn_ref.delta_rule_chunked_reference)):
        for tag, state in (("", None), ("_state", s0)):
            o, s = fn(q, k, v, g, beta, state=None if state is None else state.clone())
            assert torch.equal(o, ref[name + tag][0]), name + tag
            assert torch.equal(s, ref[name + tag][1]), name + tag
    assert torch.equal(gdn_ref.causal_conv_reference(d["u"], d["cw"])[0], ref["conv_prompt"])
    assert torch.equal(gdn_ref.causal_conv_reference(d["u"][..., :1], d["cw"], d["cs"])[0], ref["conv_step"][0])
    assert torch.equal(gdn_ref.gated_rmsnorm_reference(d["nx"], d["nz"], d["nw"]), ref["gated_norm"])
    gg, bb = gdn_ref.gates_reference(d["a"], d["b"], d["a_log"], d["dt_bias"])
    assert torch.equal(gg, ref["gates"][0]) and torch.equal(bb, ref["gates"][1])


def test_a_plan_is_read_from_text():
    """A launch plan from its text (gdn_prefill.plan_from_text, the bench's spelling): the
    defaults, each field, and a bad name or value refused naming it."""
    assert gdn_prefill.plan_from_text("") == gdn_prefill.PrefillPlan()
    assert gdn_prefill.plan_from_text("prec=bf16x2,block_v=16") == gdn_prefill.PrefillPlan(prec="bf16x2", block_v=16)
    capped = gdn_prefill.plan_from_text("state_maxnreg=168,solve_maxnreg=0,solve_prec=tf32x3")
    assert capped.caps("state") == {"maxnreg": 168} and capped.caps("solve") == {}
    assert capped.solve_prec == "tf32x3" and gdn_prefill.FAST_PLAN.caps("solve") == {"maxnreg": 168}
    assert gdn_prefill.plan_from_text("out_warps=8, block_v=16,state_stages=1,out_prec=tf32") == gdn_prefill.PrefillPlan(
        out_warps=8, block_v=16, state_stages=1, out_prec="tf32")
    for bad, match in (("warps=4", "name=value with a name among"), ("block_v=x", "block_v must be an integer"),
                       ("block_v=24", "block_v must be a power of two"), ("out_prec=bf16", "out_prec"),
                       ("prec=tf32", "prec must be one of"), ("out_maxnreg=300", "out_maxnreg must be 0"),
                       ("solve_prec=bf16", "solve_prec must be")):
        with pytest.raises(ValueError, match=match):
            gdn_prefill.plan_from_text(bad)
    merged = gdn_prefill.plan_from_text("form=merged,block_v=0,slice_tokens=32768")
    assert (merged.form, merged.block_v, merged.slice_tokens) == ("merged", 0, 32768)
    for bad, match in (("form=fused", "form must be one of"), ("slice_tokens=-1", "slice_tokens must be")):
        with pytest.raises(ValueError, match=match):
            gdn_prefill.plan_from_text(bad)


def test_the_state_kernels_columns_follow_the_programs():
    """block_v 0: 64 value columns where a slice's programs at 64 still fill ~3/4 of two a SM
    (132 SMs where there is no GPU), else 32."""
    cpu = torch.device("cpu")
    assert gdn_prefill._state_columns(4 * 32, 128, cpu) == 64          # 4 x 2048 in one slice: 256 programs
    assert gdn_prefill._state_columns(1 * 32, 128, cpu) == 32          # 1 x 8192: 64 programs at 64 columns
    assert gdn_prefill._state_columns(2 * 32, 128, cpu) == 32          # 16 x 8192 in slices of two sequences
    assert gdn_prefill._state_columns(64, 32, cpu) == 32 and gdn_prefill._state_columns(4096, 48, cpu) == 32


def test_the_reference_prompt_rule_keeps_the_kernels_contract():
    """gdn_ref.chunked_prefill_reference (the torch op set's prompt rule): q / k heads shared by index,
    the state written into state_out, a continuation from initial_state (state_out itself, in
    place), a capture of the state at a chunk's start; every result the reference rule's on the
    heads repeated, bit for bit."""
    g_ = torch.Generator().manual_seed(21)
    B, T, Hk, Hv, D = 2, 150, 2, 4, 32
    q, k = (torch.randn(B, T, Hk, D, generator=g_).bfloat16() for _ in range(2))
    v = torch.randn(B, T, Hv, D, generator=g_).bfloat16()
    g = -torch.rand(B, T, Hv, generator=g_)
    beta = torch.rand(B, T, Hv, generator=g_).bfloat16()
    qe, ke = gdn_ref.expand_heads(q, Hv), gdn_ref.expand_heads(k, Hv)
    o_ref, s_ref, at_ref = gdn_ref.delta_rule_chunked_reference(qe, ke, v, g, beta, capture=1)
    state = torch.full((B, Hv, D, D), float("nan"))
    snap = torch.empty_like(state)
    o, out = gdn_ref.chunked_prefill_reference(q, k, v, g, beta, state_out=state, capture=(1, snap))
    assert out is state and torch.equal(o, o_ref) and torch.equal(state, s_ref) and torch.equal(snap, at_ref)
    # the first 100 positions, then the rest from that state in place
    o1, s1 = gdn_ref.delta_rule_chunked_reference(qe[:, :100], ke[:, :100], v[:, :100], g[:, :100], beta[:, :100])
    o2, s2 = gdn_ref.delta_rule_chunked_reference(qe[:, 100:], ke[:, 100:], v[:, 100:], g[:, 100:], beta[:, 100:], state=s1)
    gdn_ref.chunked_prefill_reference(q[:, :100], k[:, :100], v[:, :100], g[:, :100], beta[:, :100], state_out=state)
    o_b, _ = gdn_ref.chunked_prefill_reference(q[:, 100:], k[:, 100:], v[:, 100:], g[:, 100:], beta[:, 100:],
                                           state_out=state, initial_state=state)
    assert torch.equal(o_b, o2) and torch.equal(state, s2)
    o_plain, s_plain = gdn_ref.chunked_prefill_reference(q, k, v, g, beta)
    assert torch.equal(o_plain, o_ref) and torch.equal(s_plain, s_ref)
