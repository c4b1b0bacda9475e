"""The GDN decode step in the full forward's arithmetic (fqkernels/gdn_exact_step.py): each step's
output against the reference's chunked rule over the whole generated sequence from the same
starting state (the full forward's rows), across a chunk boundary, with the state the chunk's
close leaves against the reference's state after 64 rows; sequences at different rows of their
chunks in one call; the copies of torch's l2 norm and cumulative sum. On a GPU bit for bit;
under Triton's CPU interpreter (>= 3.4) the logic, within rounding (the interpreter's products
are not the GPU's chains)."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from engine_modules import ENGINE_DIR, KERNEL_DEVICE, KERNELS_RUN, KERNELS_SKIP_REASON

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import gdn_exact_step as step  # noqa: E402
from fqkernels import gdn_norm, gdn_ref  # noqa: E402

DEV = KERNEL_DEVICE
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not KERNELS_RUN, reason=KERNELS_SKIP_REASON)]


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if DEV == "cuda":
        assert torch.equal(a, b), f"{what}: {(a.float() != b.float()).float().mean().item():.4%} of elements differ"
    else:
        rel = 2.0 ** -7 if a.dtype == torch.bfloat16 else 1e-4
        scale = max(a.float().abs().max().item(), b.float().abs().max().item(), 1e-30)
        err = (a.float() - b.float()).abs().max().item()
        assert err <= rel * scale, f"{what}: {err:.3g} against {scale:.3g}"


def _sequence(B, T, Hk, Hv, D, seed):
    g_ = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, Hk, D, generator=g_).bfloat16() for _ in range(2))
    v = torch.randn(B, T, Hv, D, generator=g_).bfloat16()
    g = -F.softplus(torch.randn(B, T, Hv, generator=g_)) * 0.1
    beta = torch.rand(B, T, Hv, generator=g_).bfloat16()
    state = torch.randn(B, Hv, D, D, generator=g_) * 0.1
    return [t.to(DEV) for t in (q, k, v, g, beta, state)]


def test_the_reference_step_is_the_rules_last_row():
    D, Hk, Hv = 32, 2, 4
    q, k, v, g, beta, state = _sequence(1, 9, Hk, Hv, D, seed=5)
    o, s = step.chunk_step_reference(q, k, v, g, beta, state)
    want, want_s = gdn_ref.delta_rule_chunked_reference(gdn_ref.expand_heads(q, Hv), gdn_ref.expand_heads(k, Hv), v, g, beta,
                                                    state=state)
    assert torch.equal(o, want[:, -1]) and torch.equal(s, want_s)


def _fused_steps(q, k, v, g, beta, state, rows, pos0, n, **kw):
    """n steps of fused_step from positions pos0 [B]: the outputs [B, n, Hv, Dv]."""
    return torch.stack([step.fused_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], pos0 + i, state, rows, **kw)
                        for i in range(n)], 1)


@pytest.mark.parametrize("D,block_v,tile,unroll,form,extra", [
    (32, 16, 32, 8, "fused", {}), (64, 32, 64, 8, "fused", {}), (64, 16, 32, 32, "fused", {}),
    (64, 64, 32, 16, "fused", {"maxnreg": 128}), (32, 16, 32, 8, "merged", {}),
    (64, 32, 32, 32, "merged", {}), (64, 64, 64, 16, "merged", {"maxnreg": 128}),
    (64, 32, 32, 32, "auto", {"maxnreg": "auto"}), (64, 32, 32, 64, "merged", {"close": (16, 16)}),
    (64, 64, 64, 16, "fused", {"close": (64, 64)}),
    (64, 64, 64, 16, "merged", {"early": True, "prefetch": "l2"}), (32, 16, 32, 8, "fused", {"early": True}),
    (64, 32, 32, 32, "merged", {"early": True, "prefetch": "l1"}), (64, 64, 64, 16, "merged", {"merged": "ws=64"}),
    (32, 16, 32, 8, "merged", {"merged": "ws=16"}), (64, 64, 64, 32, "merged", {"merged": "qs_late=1,keys=32"}),
    (32, 16, 32, 8, "merged", {"merged": "ws=32", "early": True}),
    (64, 64, 64, 16, "merged", {"merged": "qs_late=1,keys=64,ws=32"}),
    (64, 32, 32, 32, "merged", {"merged": "qs_late=1,keys=16,ws=64", "early": True, "prefetch": "l2"})])
def test_fused_steps_are_the_full_forwards_rows_across_a_chunk(D, block_v, tile, unroll, form, extra):
    """unroll: the rows a loop trip loads (8: the solve's blocks one a trip; 32: four); form: one
    kernel with a pass a product, or with the passes merged, or the grid's pick ("auto"); extra: a
    register cap, the close's blocks (state rows, chunk rows a dot), the position read before PDL's
    wait with the lines asked of L2 or L1 (each step's rows are the previous launch's writes), the
    merged form's schedules (MergedPlan: the passes at other rows a trip, (q e^gamma) S_c in the w S_c
    pass)."""
    B, T, Hk, Hv = 2, 70, 2, 4
    if "merged" in extra:
        extra = dict(extra, merged=step.MergedPlan.from_text(extra["merged"]))
    q, k, v, g, beta, state = _sequence(B, T, Hk, Hv, D, seed=D + 1)
    want, _, at_64 = gdn_ref.delta_rule_chunked_reference(
        gdn_ref.expand_heads(q, Hv), gdn_ref.expand_heads(k, Hv), v, g, beta, state=state, capture=1)
    rows = step.ChunkRows(B, Hv, D, D, DEV, block_v=block_v)
    S = state.clone()
    pos0 = torch.zeros(B, dtype=torch.int64, device=DEV)
    if DEV == "cuda":
        tile = step.scan_tile(B * Hv * 2)        # the bits of the reference's cumulative sum over two chunks
    got = _fused_steps(q, k, v, g, beta, S, rows, pos0, 64, tile=tile, unroll=unroll, form=form, **extra)
    _same(got, want[:, :64], "rows 0-63")
    _same(S, at_64, "the state the close leaves after row 63")
    closed = S.clone()
    got = _fused_steps(q[:, 64:], k[:, 64:], v[:, 64:], g[:, 64:], beta[:, 64:], S, rows, pos0 + 64, T - 64,
                       tile=tile, unroll=unroll, form=form, **extra)
    _same(got, want[:, 64:], "rows 64-69 (the second chunk, from the close's state)")
    assert torch.equal(S, closed)


@pytest.mark.parametrize("form", step.FORMS)
def test_fused_step_at_different_rows_and_wrong_shapes(form):
    """Two sequences at positions 10 + i and i (the first prefilled by ten steps of its own), each
    against its own reference; a state of the wrong shape is refused by name."""
    D, Hk, Hv = 32, 1, 2
    q, k, v, g, beta, state = _sequence(2, 70, Hk, Hv, D, seed=4)
    alone = step.ChunkRows(1, Hv, D, D, DEV, block_v=16)
    S0 = state[:1].clone()
    _fused_steps(q[:1], k[:1], v[:1], g[:1], beta[:1], S0, alone, torch.zeros(1, dtype=torch.int64, device=DEV), 10,
                 tile=64, form=form)
    rows = step.ChunkRows(2, Hv, D, D, DEV, block_v=16)
    for name in ("KT", "X", "VN", "G"):
        getattr(rows, name)[:1] = getattr(alone, name)
    S = state.clone()
    S[:1] = S0
    n = 60
    idx = torch.stack([torch.arange(10, 10 + n), torch.arange(0, n)]).to(DEV)
    pick = lambda x: torch.stack([x[b, idx[b]] for b in range(2)])                 # noqa: E731
    # each reference below scans 4 or 2 rows of g: torch's tile is the whole row there
    got = _fused_steps(pick(q), pick(k), pick(v), pick(g), pick(beta), S, rows,
                       torch.tensor([10, 0], dtype=torch.int64, device=DEV), n, tile=64, form=form)
    for b, T in ((0, 10 + n), (1, n)):
        want, _ = gdn_ref.delta_rule_chunked_reference(gdn_ref.expand_heads(q[b:b + 1, :T], Hv), gdn_ref.expand_heads(
            k[b:b + 1, :T], Hv), v[b:b + 1, :T], g[b:b + 1, :T], beta[b:b + 1, :T], state=state[b:b + 1])
        _same(got[b], want[0, T - n:], f"sequence {b}")
    with pytest.raises(ValueError, match="state"):
        step.fused_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], idx[:, 0], S[:, :1].contiguous(), rows)
    with pytest.raises(ValueError, match="ws must be 0 .* or a power of two from 8 to Dk = 32, got 48"):
        step.fused_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], idx[:, 0], S, rows,
                        merged=step.MergedPlan(ws=48))


@pytest.mark.parametrize("form", step.FORMS)
def test_the_gated_norm_in_the_step_is_the_gated_norm_kernels(form):
    """norm=(z, weight, eps): each output row through the gated norm in the step's own program, the
    gated norm kernel's bits over the step's plain output (z a column slice of wider rows, as
    in_proj's); a block narrower than the head is refused by name."""
    D, Hk, Hv, B, n = 128, 1, 2, 2, 3
    q, k, v, g, beta, state = _sequence(B, n, Hk, Hv, D, seed=9)
    g_ = torch.Generator().manual_seed(10)
    z = (torch.randn(B, Hv * D + 96, generator=g_) * 2).bfloat16().to(DEV)[:, 32:32 + Hv * D]
    w = (1.0 + 0.3 * torch.randn(D, generator=g_)).bfloat16().to(DEV)
    pos0 = torch.tensor([0, 5], dtype=torch.int64, device=DEV)
    outs = {}
    for normed in (False, True):
        rows, S = step.ChunkRows(B, Hv, D, D, DEV, block_v=D), state.clone()
        kw = {"norm": (z, w, 1e-6)} if normed else {}
        outs[normed] = _fused_steps(q, k, v, g, beta, S, rows, pos0, n, tile=64, form=form, **kw)
    want = torch.stack([gdn_norm.gated_rmsnorm(outs[False][:, i].reshape(-1, D), z, w, 1e-6).reshape(B, Hv, D)
                        for i in range(n)], 1)
    _same(outs[True], want, "the normed rows")
    rows = step.ChunkRows(B, Hv, D, D, DEV, block_v=64)
    with pytest.raises(ValueError, match="norm"):
        step.fused_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pos0, state.clone(), rows, norm=(z, w, 1e-6))


@pytest.mark.parametrize("order", sorted(step.SUM_ORDERS))
def test_the_replicas_compute_torchs_functions(order):
    """The l2 norm's and the cumulative sum's replicas: torch's function (each sum order is a
    candidate for torch's bits, within rounding here; torch_sum_order names the one that matches
    on a GPU)."""
    g_ = torch.Generator().manual_seed(order)
    x = torch.randn(6, 128, generator=g_).to(DEV)
    got, want = step.torch_rows(x, "l2norm", sum_order=order), gdn_ref.l2_normalize(x)
    assert (got - want).abs().max().item() <= 1e-6, f"l2 norm, sum order {order}"
    g = (-F.softplus(torch.randn(6, 64, generator=g_)) * 0.1).to(DEV)
    for tile in (32, 64):
        got = step.torch_rows(g, "cumsum", tile=tile)
        if DEV == "cuda" and tile != step.scan_tile(6):
            continue                                   # bits: torch's own tile only
        _same(got, g.cumsum(-1), f"cumsum, tile {tile}")


def test_scan_tile_follows_atens_rule():
    assert step.scan_tile(16) == 64 and step.scan_tile(32) == 64         # few rows: one tile of the row
    assert step.scan_tile(33) == 32 and step.scan_tile(4096) == 32 and step.scan_tile(32768) == 32
    assert step.scan_tile(32769) == 64                                    # the unsigned wrap-around: 512 threads


def _chunks_so_far(q, k, v, g, beta, state, starts):
    """ChunkRows (a program a head) and states of sequences at positions `starts` in the sequence
    q, k, v, g, beta [B, n, ...] from `state`: each sequence's chunk so far, the steps before its
    start run alone (state advanced at no close: the starts are its first chunk's)."""
    B, _, Hv, D = v.shape
    rows, S = step.ChunkRows(B, Hv, D, D, DEV, block_v=D), state.clone()
    for b, s in enumerate(starts):
        first = s - s % step.C
        alone, Sb = step.ChunkRows(1, Hv, D, D, DEV, block_v=D), S[b:b + 1].clone()
        if s % step.C:
            _fused_steps(q[b:b + 1, first:], k[b:b + 1, first:], v[b:b + 1, first:], g[b:b + 1, first:],
                         beta[b:b + 1, first:], Sb, alone, torch.full((1,), first, device=DEV), s % step.C, tile=64)
        for name in ("KT", "X", "VN", "G"):
            getattr(rows, name)[b] = getattr(alone, name)[0]
        S[b] = Sb[0]
    return rows, S


@pytest.mark.parametrize("D,T,starts,keep", [(32, 5, (61, 60, 3), (2, 5, 4)), (64, 4, (63, 62, 10), (4, 1, 0))])
@pytest.mark.parametrize("how", ["rows", "steps_merged", "steps_fused"])
def test_rows_stop_at_their_ends(D, T, starts, keep, how):
    """With ends (a wide verify's: the positions plus the rows each sequence may keep), fused_rows
    and fused_step's launches (either form) run sequence b's first keep[b] rows only: their outputs,
    the state and every chunk row are what keep[b] steps of the sequence alone give (a close at
    row 0, none kept, one kept, a close not run), the other rows' outputs zero; bit for bit."""
    B, Hk, Hv = len(starts), 1, 2
    q, k, v, g, beta, state = _sequence(B, 70 + T, Hk, Hv, D, seed=D + T)
    pos = torch.tensor(starts, dtype=torch.int32, device=DEV)
    ends = pos + torch.tensor(keep, dtype=torch.int32, device=DEV)
    idx = torch.stack([torch.arange(s, s + T) for s in starts]).to(DEV)
    args = [torch.stack([x[b, idx[b]] for b in range(B)], 1) for x in (q, k, v, g, beta)]     # [T, B, ...]
    rows, S = _chunks_so_far(q, k, v, g, beta, state, starts)
    if how == "rows":
        o = step.fused_rows(*args, pos, S, rows, tile=64, ends=ends)
    else:
        form = how.split("_")[1]
        o = torch.stack([step.fused_step(*(x[r] for x in args), pos + r, S, rows, tile=64, form=form, ends=ends)
                         for r in range(T)])
    want_rows, want_S = _chunks_so_far(q, k, v, g, beta, state, starts)
    for b, n in enumerate(keep):
        alone = _one_rows(want_rows, b)
        Sb = want_S[b:b + 1].clone()
        for r in range(n):
            ob = step.fused_step(*(x[r, b:b + 1] for x in args), pos[b:b + 1] + r, Sb, alone, tile=64)
            _same(o[r, b:b + 1], ob, f"sequence {b}'s row {r}")
        assert torch.equal(o[n:, b], torch.zeros_like(o[n:, b])), f"sequence {b}'s rows from {n} on"
        _same(S[b], Sb[0], f"sequence {b}'s state")
        for name in ("KT", "X", "VN", "G"):
            _same(getattr(rows, name)[b], getattr(alone, name)[0], f"sequence {b}'s chunk rows {name}")
    with pytest.raises(ValueError, match="ends"):
        step.fused_rows(*args, pos, S, rows, tile=64, ends=ends.to(torch.int64))


def _one_rows(rows, b):
    """Sequence b's chunk rows of `rows` as a ChunkRows of its own (a copy)."""
    D, Hv = rows.KT.shape[2], rows.KT.shape[1]
    alone = step.ChunkRows(1, Hv, D, D, DEV, block_v=D)
    for name in ("KT", "X", "VN", "G"):
        getattr(alone, name)[0] = getattr(rows, name)[b]
    return alone


@pytest.mark.parametrize("D,B,T,starts", [(32, 1, 7, (60,)), (64, 2, 5, (61, 3)), (32, 2, 4, (0, 63)),
                                          (32, 1, 8, (21,)), (64, 2, 3, (40, 9))])
def test_fused_rows_are_the_steps_rows(D, B, T, starts):
    """fused_rows (a verify's T rows in one launch, each program running its head's rows in turn)
    against T fused_step launches from the same state and rows, bit for bit: rows that close a chunk
    and go on in the next (starts 60, 61, 63), sequences at different rows of their chunks, and a
    wrong shape refused by name."""
    Hk, Hv = 1, 2
    q, k, v, g, beta, state = _sequence(B, 70 + T, Hk, Hv, D, seed=D + B + T)
    pos = torch.tensor(starts, dtype=torch.int64, device=DEV)
    idx = torch.stack([torch.arange(s, s + T) for s in starts]).to(DEV)
    pick = lambda x: torch.stack([x[b, idx[b]] for b in range(B)], 1)            # noqa: E731  [T, B, ...]
    results = []
    for rows_at_once in (False, True):
        rows, S = _chunks_so_far(q, k, v, g, beta, state, starts)
        args = [pick(x) for x in (q, k, v, g, beta)]
        if rows_at_once:
            o = step.fused_rows(*args, pos, S, rows, tile=64)
        else:
            o = torch.stack([step.fused_step(*(x[r] for x in args), pos + r, S, rows, tile=64) for r in range(T)])
        results.append((o, S, rows))
    (o0, S0, r0), (o1, S1, r1) = results
    assert torch.equal(o1, o0), "the rows' outputs"
    assert torch.equal(S1, S0), "the state (advanced at a close)"
    for name in ("KT", "X", "VN", "G"):
        assert torch.equal(getattr(r1, name), getattr(r0, name)), f"the chunk rows' {name}"
    with pytest.raises(ValueError, match="fused_rows"):
        step.fused_rows(*[x.transpose(-1, -2) if x.dim() == 4 and x is args[2] else x for x in args], pos, S, rows,
                        tile=64)


def test_fused_rows_stamps_are_refused_where_they_cannot_run():
    """The phase stamps (a bench's measurement) need a GPU and the one-launch form: one row (a
    launch a row) and a wrong shape are each refused naming the stamps, before any launch."""
    D, B, T, Hk, Hv = 32, 1, 3, 1, 2
    q, k, v, g, beta, state = _sequence(B, T, Hk, Hv, D, seed=3)
    args = [x.transpose(0, 1) for x in (q, k, v, g, beta)]
    rows = step.ChunkRows(B, Hv, D, D, DEV, block_v=D)
    pos = torch.zeros(B, dtype=torch.int64, device=DEV)
    stamps = lambda rows_: torch.zeros((B * Hv, rows_, len(step.PHASES) + 1, 2), dtype=torch.int64,  # noqa: E731
                                       device=DEV)
    with pytest.raises(ValueError, match="stamps"):
        step.fused_rows(*[x[:1] for x in args], pos, state, rows, stamps=stamps(1))
    with pytest.raises(ValueError, match="stamps"):
        step.fused_rows(*args, pos, state, rows, stamps=stamps(T + 1))


@pytest.mark.skipif(DEV != "cuda", reason="the stamps read a GPU's clocks")
@pytest.mark.parametrize("start", [0, 30, 60])
def test_fused_rows_stamps_change_no_bit(start):
    """fused_rows with the phase stamps against without, from the same chunk rows and state: the
    same outputs, state and chunk rows bit for bit (start 60 crosses a close), and each program's
    stamps rising through every row's phases, the timer with them."""
    D, B, T, Hk, Hv = 128, 1, 7, 2, 4
    q, k, v, g, beta, state = _sequence(B, 64 + T, Hk, Hv, D, seed=start)
    rows = step.ChunkRows(B, Hv, D, D, DEV)
    if start:
        _fused_steps(q, k, v, g, beta, state, rows, torch.zeros(B, dtype=torch.int64, device=DEV), start, tile=64)
    pos = torch.full((B,), start, dtype=torch.int64, device=DEV)
    args = [x[:, start:start + T].transpose(0, 1) for x in (q, k, v, g, beta)]
    results = []
    for stamps in (None, torch.zeros((B * Hv, T, len(step.PHASES) + 1, 2), dtype=torch.int64, device=DEV)):
        r, S = step.ChunkRows(B, Hv, D, D, DEV), state.clone()
        for name, _ in rows.ROW_AXES:
            getattr(r, name).copy_(getattr(rows, name))
        results.append((step.fused_rows(*args, pos, S, r, tile=64, stamps=stamps), S, r, stamps))
    (o0, S0, r0, _), (o1, S1, r1, stamps) = results
    assert torch.equal(o1, o0) and torch.equal(S1, S0), "outputs and state"
    for name, _ in rows.ROW_AXES:
        assert torch.equal(getattr(r1, name), getattr(r0, name)), name
    flat = stamps.reshape(B * Hv, -1, 2)
    assert bool((flat[:, 1:] >= flat[:, :-1]).all()), "each program's clock and timer rise"
    assert bool((flat[:, -1, 0] > flat[:, 0, 0]).all()), "a launch takes cycles"
