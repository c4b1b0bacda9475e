"""scripts/gpu_rule_bits_probe.py on the CPU: its pieces are the reference chunked rule's own ops
(chained, they give gdn.delta_rule_chunked_reference's output and state bit for bit), and under
Triton's interpreter each candidate kernel computes in the order it names (the interpreter's
fma rounds the product first, so there the FMA candidates are checked as ascending mul-adds;
the bits of interest are the GPU's)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import triton

from engine_modules import ENGINE_DIR, REPO

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2])
needs_interpreter = pytest.mark.skipif(not (INTERPRET and _TRITON >= (3, 4)),
                                       reason="the candidates run under TRITON_INTERPRET=1 with Triton >= 3.4")


def _probe():
    if "gpu_rule_bits_probe" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_rule_bits_probe", REPO / "scripts" / "gpu_rule_bits_probe.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["gpu_rule_bits_probe"] = module
    return sys.modules["gpu_rule_bits_probe"]


def test_the_pieces_are_the_references_ops():
    from fqkernels import gdn

    p = _probe()
    q, k, v, g, beta = p.inputs(2, 192, 4, torch.device("cpu"), seed=1)
    pieces, (out, state) = p.reference_pieces(q, k, v, g, beta)
    ref_out, ref_state = gdn.delta_rule_chunked_reference(q, k, v, g, beta)
    assert torch.equal(out, ref_out) and torch.equal(state, ref_state)
    assert set(pieces) == set(p.CANDIDATES)
    # each kept output is its op on its kept inputs (so a candidate is held to the right op)
    for name, (ins, want) in pieces.items():
        got = p.TORCH_OPS.get(name, lambda a, b: a @ b)(*ins)
        assert torch.equal(got.reshape(want.shape), want), name
    assert pieces["mm_ws"][0][1].abs().sum() > 0, "the state product must see a state that is not zero"
    assert pieces["mm_kkt"][0][0].shape[-2:] == (64, 128) and pieces["mm_ktv"][0][0].shape[-2:] == (128, 64)


@needs_interpreter
def test_the_candidates_compute_in_their_order():
    p = _probe()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 64, generator=gen)
    run, seq = torch.zeros(200), torch.empty_like(x)
    for j in range(64):
        run = run + x[:, j]
        seq[:, j] = run
    assert torch.equal(p._rows(2, x, True), seq) and torch.equal(p._rows(0, x, False), seq[:, -1])
    assert torch.allclose(p._rows(3, x, True), seq, atol=1e-5) and torch.allclose(p._rows(1, x, False), seq[:, -1],
                                                                                   atol=1e-5)
    # products on strided views (a transposed operand, a slice of a chunk axis), as the probe passes them
    a = torch.randn(3, 2, 64, 128, generator=gen)[:, 1]
    b = torch.randn(3, 64, 128, generator=gen).transpose(-1, -2)
    acc, lo, hi = (torch.zeros(3, 64, 64) for _ in range(3))
    for kk in range(128):                       # the interpreter's fma: the product rounded, then added
        acc = acc + a[..., kk, None] * b[..., None, kk, :]
    for kk in range(64):
        lo = lo + a[..., kk, None] * b[..., None, kk, :]
        hi = hi + a[..., 64 + kk, None] * b[..., None, 64 + kk, :]
    assert torch.equal(p._bmm(a, b, 0), acc) and torch.equal(p._bmm(a, b, 1), lo + hi)
    assert torch.allclose(p._bmm(a, b, 2), a @ b, atol=1e-4)
    L = torch.randn(3, 64, 64, generator=gen).tril(-1) * 0.1
    rhs = torch.randn(3, 64, 32, generator=gen)
    xs = rhs.clone()
    for j in range(63):
        xs[:, j + 1:] = xs[:, j + 1:] - L[:, j + 1:, j, None] * xs[:, j, None, :]
    assert torch.equal(p._trsm(L, rhs, False), xs) and torch.equal(p._trsm(L, rhs, True), xs)
    assert torch.allclose(xs, torch.linalg.solve_triangular(L + torch.eye(64), rhs, upper=False), atol=1e-4)
    y = torch.randn(1000, generator=gen)
    assert torch.allclose(p._unary(0, y), y.exp(), rtol=1e-6) and torch.allclose(p._unary(2, y.abs() + 0.1),
                                                                                  (y.abs() + 0.1).rsqrt(), rtol=1e-6)


@needs_interpreter
def test_the_probe_runs_end_to_end(tmp_path):
    import json

    p = _probe()
    out = tmp_path / "bits.json"
    report = p.main(["--shape", "1x128", "--heads", "2", "--out", str(out)])
    assert report["chain_is_the_reference"] and json.loads(out.read_text())["pieces"].keys() == report["pieces"].keys()
    for name, cands in report["pieces"].items():
        assert cands and all(0 <= r["equal"] <= 1 and r["max_abs"] < 1e-3 for r in cands.values()), (name, cands)


def test_the_emulated_torch_orders_are_the_orders_they_name():
    """The torch-order candidates (elementwise emulations, no Triton): sums of exactly
    representable values are exact in any order, so they equal the plain sums; on general values
    the strided order is its own arithmetic (checked against a direct loop)."""
    p = _probe()
    ints = torch.randint(-1000, 1000, (50, 128)).float()
    assert torch.equal(p._sum_strided(ints), ints.sum(-1)) and torch.equal(p._sum_vec4(ints), ints.sum(-1))
    assert torch.equal(p._cumsum_sklansky(ints[:, :64]), ints[:, :64].cumsum(-1))
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(3))
    lanes = [((x[:, t] + x[:, t + 32]) + x[:, t + 64]) + x[:, t + 96] for t in range(32)]
    while len(lanes) > 1:
        lanes = [lanes[i] + lanes[i + 1] for i in range(0, len(lanes), 2)]
    assert torch.equal(p._sum_strided(x), lanes[0])
    # the Sklansky scan's first block: element 3 is (x0 + x1) + (x2 + x3), not ((x0 + x1) + x2) + x3
    y = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    got = p._cumsum_sklansky(y)
    assert torch.equal(got[:, 3], (y[:, 0] + y[:, 1]) + (y[:, 2] + y[:, 3]))
    assert torch.equal(got[:, 32], y[:, 32] + got[:, 31])
