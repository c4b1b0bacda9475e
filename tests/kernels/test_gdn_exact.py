"""The GDN chunked rule in the reference's order (fqkernels/gdn_exact.py) against the reference's
ops: on a GPU bit for bit (the triangular solve against torch.linalg.solve_triangular, the whole
rule against gdn.delta_rule_chunked_reference, with its final state and a captured one); under
Triton's CPU interpreter (>= 3.4) the logic, within fp32 rounding (the interpreter's FMA rounds
the product first, so its bits are not the GPU's)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
import triton

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import gdn, gdn_exact  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cpu" and not (INTERPRET and _TRITON >= (3, 4)),
                                 reason="needs a GPU, or TRITON_INTERPRET=1 with Triton >= 3.4")]


def _same(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-6) -> None:
    """Bit for bit on the GPU; under the interpreter within rel of the larger magnitude (bf16: an
    output's last bit may flip)."""
    if DEV == "cuda":
        assert torch.equal(a, b), f"{(a.float() != b.float()).float().mean().item():.4%} of elements differ"
    else:
        if a.dtype == torch.bfloat16:
            rel = max(rel, 2.0 ** -7)
        scale = max(a.float().abs().max().item(), b.float().abs().max().item(), 1e-30)
        assert (a.float() - b.float()).abs().max().item() <= rel * scale


def _rule_inputs(B, T, H, D, seed):
    g_ = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g_).bfloat16() for _ in range(3))
    g = -F.softplus(torch.randn(B, T, H, generator=g_)) * 0.3
    beta = torch.rand(B, T, H, generator=g_).bfloat16()
    return [t.to(DEV) for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("form", ["masked", "scratch"])
def test_solve_is_the_reference_solve(form):
    """The reference rule's own systems (its decayed k_beta k^T, unit lower) and two right-hand
    sides side by side, and random systems with the upper triangle filled (not read)."""
    q, k, v, g, beta = _rule_inputs(2, 128, 4, 128, seed=1)
    qf, kf, vf, gf, bf = gdn._prepare(q, k, v, g, beta, True)
    C = gdn.CHUNK
    kf, vf = kf.reshape(2, 4, 2, C, 128), vf.reshape(2, 4, 2, C, 128)
    kb, vb = kf * bf.reshape(2, 4, 2, C, 1), vf * bf.reshape(2, 4, 2, C, 1)
    gamma = gf.reshape(2, 4, 2, C).cumsum(-1)
    above = torch.ones(C, C, dtype=torch.bool, device=DEV).triu(1)
    system = (kb @ kf.transpose(-1, -2)) * (gamma[..., :, None] - gamma[..., None, :]).masked_fill(above, -torch.inf).exp()
    rhs = torch.cat([vb, kb * gamma.exp()[..., None]], dim=-1)
    want = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    _same(gdn_exact.solve_unit_lower(system, rhs, form=form), want)
    g_ = torch.Generator().manual_seed(2)
    L = (torch.randn(40, 64, 64, generator=g_) * 0.2).to(DEV)
    B = torch.randn(40, 64, 96, generator=g_).to(DEV)
    for block_n in (32, 64):                     # 96 columns: three whole programs, or one and a half
        _same(gdn_exact.solve_unit_lower(L, B, block_n=block_n, form=form),
              torch.linalg.solve_triangular(L, B, upper=False, unitriangular=True), rel=1e-5)
    with pytest.raises(ValueError, match="multiple of 8"):
        gdn_exact.solve_unit_lower(L[:, :60, :60], B[:, :60], form=form)
    with pytest.raises(ValueError, match="'masked' or 'scratch'"):
        gdn_exact.solve_unit_lower(L, B, form="other")


@pytest.mark.parametrize("B,T,H,D,state,capture", [(1, 64, 12, 128, False, None), (2, 150, 3, 128, True, 1),
                                                    (3, 5, 4, 64, True, None), (1, 256, 3, 128, False, 3),
                                                    (1, 64, 2, 128, False, None), (3, 5, 2, 64, True, None)])
def test_rule_is_the_reference_rule(B, T, H, D, state, capture):
    """Outputs, the final state and a captured one (the state at a chunk's start) as the reference
    gives them: T a multiple of 64 and not, from zero and from a state, batch > 1; more than 8
    systems of 64 (the batched solve: this solve kernel) and 8 or fewer (torch's own calls)."""
    q, k, v, g, beta = _rule_inputs(B, T, H, D, seed=T + D)
    s0 = (torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(3)) * 0.1).to(DEV) if state else None
    kw = {} if capture is None else {"capture": capture}
    got = gdn_exact.delta_rule_chunked_exact(q, k, v, g, beta, state=s0, **kw)
    want = gdn.delta_rule_chunked_reference(q, k, v, g, beta, state=s0, **kw)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same(a, b, rel=1e-5)


def test_systems_are_the_reference_systems():
    """chunk_systems against chunked_pieces' system and attn (T not a multiple of 64: the padded
    chunk's zeros too), and its k_slice check."""
    q, k, v, g, beta = _rule_inputs(2, 100, 3, 128, seed=9)
    qs, ks, kb, vb, gamma = gdn.chunked_inputs(q, k, v, g, beta)
    _, _, _, _, want_system, want_attn, _ = gdn.chunked_pieces(q, k, v, g, beta)
    system, attn = gdn_exact.chunk_systems(qs, ks, kb, gamma, k_slice=32)
    _same(system, want_system, rel=1e-5)
    _same(attn, want_attn, rel=1e-5)
    with pytest.raises(ValueError, match="k_slice 24"):
        gdn_exact.chunk_systems(qs, ks, kb, gamma, k_slice=24)


def test_rule_on_the_new_forms():
    """The whole rule with the solve's "scratch" form, the chunk loop's "sliced" one and the
    systems by chunk_systems: the reference's outputs, final and captured state (T not a multiple
    of 64, from a state)."""
    q, k, v, g, beta = _rule_inputs(2, 150, 5, 128, seed=11)
    s0 = (torch.randn(2, 5, 128, 128, generator=torch.Generator().manual_seed(4)) * 0.1).to(DEV)
    got = gdn_exact.delta_rule_chunked_exact(q, k, v, g, beta, state=s0, capture=1, systems="triton",
                                             solve={"form": "scratch"}, loop={"form": "sliced", "k_slice": 32})
    want = gdn.delta_rule_chunked_reference(q, k, v, g, beta, state=s0, capture=1)
    for a, b in zip(got, want):
        _same(a, b, rel=1e-5)


def test_prefill_contract_writes_state_and_snapshot():
    """chunked_prefill_exact: q, k heads shared by index (2 q/k heads for 4 value heads), the final
    state into state_out, from initial_state, the snapshot into capture's tensor; the same as
    chunked_prefill_reference."""
    B, T, Hk, Hv, D = 2, 130, 2, 4, 64
    g_ = torch.Generator().manual_seed(5)
    q, k = (torch.randn(B, T, Hk, D, generator=g_).bfloat16().to(DEV) for _ in range(2))
    _, _, v, g, beta = _rule_inputs(B, T, Hv, D, seed=6)
    s0 = (torch.randn(B, Hv, D, D, generator=g_) * 0.1).to(DEV)
    outs = []
    for rule in (gdn_exact.chunked_prefill_exact, gdn.chunked_prefill_reference):
        state_out, cap = torch.empty_like(s0), torch.empty_like(s0)
        o, s = rule(q, k, v, g, beta, state_out=state_out, initial_state=s0.clone(), capture=(1, cap))
        assert s is state_out
        outs.append((o, state_out, cap))
    for a, b in zip(*outs):
        _same(a, b, rel=1e-5)


@pytest.mark.parametrize("form,block_v,warps,k_slice", [("fused", 32, 4, 16), ("split", 32, 4, 16),
                                                        ("split", 16, 2, 16), ("fused", 64, 8, 16),
                                                        ("sliced", 32, 8, 16), ("sliced", 16, 4, 32)])
def test_chunk_loop_forms_are_the_reference_loop(form, block_v, warps, k_slice):
    """recurrence's forms and launch shapes against the reference's loop on torch's ops
    (recurrence_reference): outputs, the final state and a captured one."""
    BH, NC, C, D = 3, 4, 64, 64
    g_ = torch.Generator().manual_seed(7)
    u, w, qd, kd = ((torch.randn(BH, NC, C, D, generator=g_) * 0.2).to(DEV) for _ in range(4))
    attn = (torch.randn(BH, NC, C, C, generator=g_) * 0.1).to(DEV)
    carry = torch.rand(BH, NC, generator=g_).to(DEV)
    s0 = (torch.randn(BH, D, D, generator=g_) * 0.1).to(DEV)
    want_out, want_state = gdn_exact.recurrence_reference(u, w, qd, kd, attn, carry, s0)
    _, cap_state = gdn_exact.recurrence_reference(u[:, :2], w[:, :2], qd[:, :2], kd[:, :2], attn[:, :2],
                                                  carry[:, :2], s0)
    state, captured = s0.clone(), torch.empty_like(s0)
    out = gdn_exact.recurrence(u, w, qd, kd, attn, carry, state, capture=2, captured=captured, block_v=block_v,
                               form=form, num_warps=warps, k_slice=k_slice)
    _same(out, want_out, rel=1e-5)
    _same(state, want_state, rel=1e-5)
    _same(captured, cap_state, rel=1e-5)
    with pytest.raises(ValueError, match="'fused', 'split' or 'sliced'"):
        gdn_exact.recurrence(u, w, qd, kd, attn, carry, state, form="other")
    with pytest.raises(ValueError, match="k_slice 24"):
        gdn_exact.recurrence(u, w, qd, kd, attn, carry, state, form="sliced", k_slice=24)
