"""Exact GDN decode (fq_qwen35 with exact_decode, the default) on the CPU path: every
GDN layer's rule outputs, over a prompt pass and the decode steps after it, are the reference's
chunked rule over the whole sequence of that layer's inputs, bit for bit (what the full forward
computes from them), and the cache holds the state at the last chunk's start; for a prompt in one
pass, a prompt going on from inside a chunk, a snapshot at a chunk boundary, and continuous batching
(rows moved, prompts in chunks). The layer inputs are recorded from the model's own calls, so the
check isolates the GDN wiring (rows, positions, the chunk closes) from the other layers' shapes.
test_a_wiring_slip_is_caught shows the check can fail."""
from __future__ import annotations

import sys
from collections import defaultdict

import pytest
import torch

from engine_modules import ENGINE_DIR, load_engine_module

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

import fq_config  # noqa: E402
import fq_qwen35  # noqa: E402
import fq_weights  # noqa: E402
from fq_ops import TorchOps  # noqa: E402
from fqkernels import gdn_exact_step, gdn_ref  # noqa: E402

from fastqwen import synth35  # noqa: E402

B = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35x") / "tiny", seed=3, progress=False)
    cfg = fq_config.Qwen35Config.from_dir(str(path))
    return path, cfg, fq_weights.load_qwen35_weights(str(path), cfg, torch.device("cpu"))


class Recorder:
    """Every GDN rule call of a model (the prompt rule, the exact step) by layer (the state's
    address): inputs and outputs per position, in call order."""

    def __init__(self, monkeypatch, model, step=None):
        self.calls = defaultdict(list)      # state address -> [((q, k, v, g, beta) [B, n, ...], o)]
        self.model = model
        rule, step = gdn_ref.chunked_prefill_reference, step or gdn_exact_step.reference_step

        def recorded_rule(q, k, v, g, beta, state_out=None, initial_state=None, capture=None, **kw):
            key = state_out.data_ptr()
            o, s = rule(q, k, v, g, beta, state_out=state_out, initial_state=initial_state, capture=capture, **kw)
            self.calls[key].append((tuple(t.clone() for t in (q, k, v, g, beta)), o.clone()))
            return o, s

        def recorded_step(q, k, v, g, beta, positions, state, rows):
            o = step(q, k, v, g, beta, positions, state, rows)
            ins = tuple(t[:, None].clone() for t in (q, k, v, g, beta))
            self.calls[state.data_ptr()].append((ins, o[:, None].clone()))
            return o

        monkeypatch.setattr(gdn_ref, "chunked_prefill_reference", recorded_rule)
        monkeypatch.setattr(gdn_exact_step, "reference_step", recorded_step)

    def check(self, rows: slice, start_state=None):
        """Each GDN layer's recorded outputs for cache rows `rows` are the reference's chunked rule
        over all its recorded inputs (from start_state[layer], else zeros), bit for bit, and its
        cache state is the state at the start of the chunk of its last position."""
        m = self.model
        for slot in range(len(m.gdn_slot)):
            calls = self.calls[m.state[slot, rows].data_ptr()]
            assert calls, f"GDN layer {slot}: no calls recorded"
            ins = [torch.cat([c[0][j] for c in calls], 1) for j in range(5)]
            got = torch.cat([c[1] for c in calls], 1)
            T, H = ins[2].shape[1], ins[2].shape[2]
            q, k = gdn_ref.expand_heads(ins[0], H), gdn_ref.expand_heads(ins[1], H)
            init = None if start_state is None else start_state[slot]
            last_chunk = (T - 1) // gdn_ref.CHUNK
            want, _, at = gdn_ref.delta_rule_chunked_reference(q, k, *ins[2:], state=init, capture=last_chunk)
            differ = (got != want).flatten(2).any(-1)      # [B, T]
            assert not differ.any(), f"GDN layer {slot}: positions {differ.nonzero()[:, 1].unique().tolist()} differ"
            if T % gdn_ref.CHUNK:
                assert torch.equal(m.state[slot, rows], at), f"GDN layer {slot}: the cache is not the chunk's start"
            else:
                _, end = gdn_ref.delta_rule_chunked_reference(q, k, *ins[2:], state=init)
                assert torch.equal(m.state[slot, rows], end), f"GDN layer {slot}: the cache is not the state at the end"
        return T


def _seq(cfg, length, seed=1):
    return torch.randint(0, cfg.vocab_size, (B, length), generator=torch.Generator().manual_seed(seed))


def _decode(model, seq, start, steps):
    with torch.inference_mode():
        pos = torch.full((B,), start, dtype=torch.int32)
        for t in range(start, start + steps):
            model.decode_logits(seq[:, t], pos, pos + 1)
            pos += 1


@pytest.mark.parametrize("prompt,steps", [(100, 40), (128, 3), (30, 70)])
def test_prompt_and_decode_are_the_full_forwards_rows(tiny, monkeypatch, prompt, steps):
    """A prompt ending inside a chunk (its tail rows through the step), at a boundary (no tail), and
    shorter than a chunk (no whole chunk: the steps from a zero state); decode across a boundary."""
    _, cfg, w = tiny
    model = fq_qwen35.Qwen35Model(cfg, dict(w), torch.device("cpu"), TorchOps(), exact_decode=True)
    rec = Recorder(monkeypatch, model)
    seq = _seq(cfg, prompt + steps)
    model.ensure_rope(prompt + steps)
    model.allocate_cache(B, prompt + steps)
    with torch.inference_mode():
        model.prefill_logits(seq[:, :prompt])
    _decode(model, seq, prompt, steps)
    assert rec.check(slice(0, B)) == prompt + steps


@pytest.mark.parametrize("first,second", [(40, 60), (40, 160), (64, 70), (10, 20)])
def test_a_prompt_going_on_from_inside_a_chunk(tiny, monkeypatch, first, second):
    """prefill_logits with start: the positions up to the next boundary through the step (the
    chunk's earlier rows already in the cache), whole chunks through the prompt rule, the rest
    through the step again."""
    _, cfg, w = tiny
    model = fq_qwen35.Qwen35Model(cfg, dict(w), torch.device("cpu"), TorchOps(), exact_decode=True)
    rec = Recorder(monkeypatch, model)
    total = first + second + 5
    seq = _seq(cfg, total, seed=2)
    model.ensure_rope(total)
    model.allocate_cache(B, total)
    with torch.inference_mode():
        model.prefill_logits(seq[:, :first])
        model.prefill_logits(seq[:, first:first + second], start=first)
    _decode(model, seq, first + second, 5)
    assert rec.check(slice(0, B)) == total


def test_a_snapshot_is_the_state_at_its_boundary_and_a_misplaced_one_is_refused(tiny, monkeypatch):
    _, cfg, w = tiny
    model = fq_qwen35.Qwen35Model(cfg, dict(w), torch.device("cpu"), TorchOps(), exact_decode=True)
    seq = _seq(cfg, 200, seed=3)
    model.ensure_rope(200)
    model.allocate_cache(B, 200)
    model.allocate_snapshots(4)
    with torch.inference_mode():
        model.prefill_logits(seq[:, :150], snapshot=(128, [0, 1]))
        model.prefill_logits(seq[:, :150], snapshot=(64, [2, 3]))
    # the states after 128 and 64 positions, as the prompt rule alone leaves them
    plain = fq_qwen35.Qwen35Model(cfg, dict(w), torch.device("cpu"), TorchOps(), exact_decode=False)
    plain.ensure_rope(200)
    for at, index in ((128, [0, 1]), (64, [2, 3])):
        plain.allocate_cache(B, 200)
        with torch.inference_mode():
            plain.prefill_logits(seq[:, :at])
        for b in range(B):
            assert torch.equal(model.snap_state[index[b]], plain.state[:, b]), (at, b)
            assert torch.equal(model.snap_conv[index[b]], plain.conv_state[:, b]), (at, b)
    # a continued prompt from inside a chunk cannot keep a snapshot 64 positions on (not a boundary)
    with torch.inference_mode():
        model.prefill_logits(seq[:, :40])
        with pytest.raises(ValueError, match="chunk boundary"):
            model.prefill_logits(seq[:, 40:150], start=40, snapshot=(104, [0, 1]))


@pytest.mark.parametrize("slip", ["next row", "recurrent step"])
def test_a_wiring_slip_is_caught(tiny, monkeypatch, slip):
    """The check above can fail: the step told the next row of its chunk, or the recurrent step
    in its place (its state is then not the chunk's start, and its fp32 outputs are not the full
    forward's)."""
    _, cfg, w = tiny
    model = fq_qwen35.Qwen35Model(cfg, dict(w), torch.device("cpu"), TorchOps(), exact_decode=True)
    real = gdn_exact_step.reference_step
    def step(q, k, v, g, beta, positions, state, rows):
        if slip == "next row":
            return real(q, k, v, g, beta, positions + 1, state, rows)
        return gdn_ref.decode_step_reference(q, k, v, g, beta, state)

    rec = Recorder(monkeypatch, model, step=step)
    seq = _seq(cfg, 140)
    model.ensure_rope(140)
    model.allocate_cache(B, 140)
    with torch.inference_mode():
        model.prefill_logits(seq[:, :100])
    _decode(model, seq, 100, 40)
    # measured: the shifted rows give the same outputs (a zero row 0 passes the state through) and
    # a wrong closed state; the recurrent step other outputs at a few positions and no chunk start
    with pytest.raises(AssertionError, match="differ|chunk's start"):
        rec.check(slice(0, B))


@pytest.fixture()
def exact_engine(tiny, monkeypatch):
    """An Engine on the tiny preset with exact decode (its default)."""
    engine = load_engine_module(ENGINE_DIR, "fastqwen_exact_decode").Engine(str(tiny[0]), exact_decode=True)
    assert engine.model.exact_decode and engine.describe()["gdn_decode"] == "full forward's rows"
    return engine


def test_a_moved_row_takes_its_chunk_rows(tiny):
    _, cfg, w = tiny
    model = fq_qwen35.Qwen35Model(cfg, dict(w), torch.device("cpu"), TorchOps(), exact_decode=True)
    model.ensure_rope(100)
    model.allocate_cache(3, 100)
    seq = _seq(cfg, 90)
    with torch.inference_mode():
        model.prefill_logits(seq[:1, :90], row=2)
        model.copy_row(2, 0, 90)
    for rows in model.rows:
        for name in ("q", "k", "v", "g", "beta"):
            t = getattr(rows, name)
            assert torch.equal(t[0], t[2]) and t[0, :90 - 64].abs().sum() > 0, name
    assert torch.equal(model.state[:, 0], model.state[:, 2])


def test_continuous_batching_with_exact_decode(exact_engine):
    """fq_slots on the exact decode: requests joining and leaving (rows moved), the paged cache,
    prompts prefilled 24 tokens at a time (continued from inside a chunk): each request's tokens
    are its tokens alone."""
    from test_slots_cpu import SCHEDULE, _alone, _prompt, run_schedule

    alone = _alone(exact_engine, 1024)
    prompts = [_prompt(n, 100 + r, 1024) for r, (n, _, _) in enumerate(SCHEDULE)]
    assert run_schedule(exact_engine, prompts) == alone
    assert run_schedule(exact_engine, prompts, page_size=16, num_pages=14) == alone
    assert run_schedule(exact_engine, prompts, page_size=16, chunk=24) == alone


def test_shared_prefixes_with_exact_decode(exact_engine):
    """Pages of 64: b shares a's first 128 positions and its snapshot there (a chunk boundary, where
    the cache's state is the state), and gets its tokens alone."""
    from test_slots_cpu import _greedy, _prompt

    base = _prompt(150, 1, 1024)
    prompts = {"a": base + _prompt(10, 2, 1024), "b": base + _prompt(7, 3, 1024)}
    alone = {k: [s[0] for s in exact_engine.generate([p], 70)] for k, p in prompts.items()}
    slots = exact_engine.slots(3, 320, page_size=64, num_pages=20)
    assert _greedy(slots, {"a": prompts["a"]}, 70) == {"a": alone["a"]} and slots.pool.hit_tokens == 0
    assert _greedy(slots, {"b": prompts["b"]}, 70) == {"b": alone["b"]} and slots.pool.hit_tokens == 128


def test_the_steps_grid_plan(monkeypatch):
    """"auto" picks the step's form and register cap by its grid: the merged form uncapped where the
    programs fit two a multiprocessor (B <= 8 of the 4B on an H200), the fused form at 128 registers
    beyond; explicit choices are kept; the CPU never caps; a bad cap or close block is refused by
    name before any launch."""
    monkeypatch.setattr(gdn_exact_step, "sm_count", lambda device: 132)
    cuda0 = torch.device("cuda", 0)
    plan = [gdn_exact_step.grid_plan("auto", "auto", B * 32, cuda0) for B in (1, 4, 8, 9, 16)]
    assert plan == [("merged", 0)] * 3 + [("fused", 128)] * 2
    assert gdn_exact_step.grid_plan("auto", "auto", 512, torch.device("cpu")) == ("merged", 0)
    assert gdn_exact_step.grid_plan("fused", 168, 32, cuda0) == ("fused", 168)
    assert gdn_exact_step.grid_plan("merged", 0, 512, cuda0) == ("merged", 0)
    rows = gdn_exact_step.ChunkRows(1, 2, 32, 32, "cpu", block_v=16)
    q = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    v = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="register cap 'many'"):
        gdn_exact_step.fused_step(q, q, v, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bfloat16),
                                  torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, 32, 32), rows, maxnreg="many")
    with pytest.raises(ValueError, match=r"close \(8, 16\)"):
        gdn_exact_step.fused_step(q, q, v, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bfloat16),
                                  torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, 32, 32), rows, close=(8, 16))
    with pytest.raises(ValueError, match="close 'all'"):
        gdn_exact_step.fused_step(q, q, v, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bfloat16),
                                  torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, 32, 32), rows, close="all")
    # the close's blocks by form: 16x16 where the fused form runs capped, else 32x16
    assert gdn_exact_step.close_blocks("fused", "auto") == (16, 16)
    assert gdn_exact_step.close_blocks("merged", "auto") == (32, 16)
    assert gdn_exact_step.close_blocks("fused", (64, 64)) == (64, 64)


def test_stacked_chunk_rows_save_and_restore_a_verifys_heads_as_each_layer_does():
    """ChunkRows.stacked (the kernel op set's chunk rows: every layer a view of one buffer a kind):
    rows_head copies every layer's first n rows of sequences [0, B) in one copy a kind, and
    rows_put_head_where puts them back only where the mask is set, as the per-layer head and
    put_head_where do; a list that is not one stack in order takes the per-layer path."""
    layers, Bmax, Hv, Dk, Dv, n, Bv = 3, 4, 2, 32, 32, 5, 3
    stacked = gdn_exact_step.ChunkRows.stacked(layers, Bmax, Hv, Dk, Dv, torch.device("cpu"))
    single = [gdn_exact_step.ChunkRows(Bmax, Hv, Dk, Dv, torch.device("cpu")) for _ in range(layers)]
    gen = torch.Generator().manual_seed(5)
    for a, b in zip(stacked, single):
        assert a.X.data_ptr() != b.X.data_ptr() and a.stack is stacked[0].stack
        for name in ("X", "VN", "G", "KT"):
            getattr(a, name).copy_(torch.randn(getattr(a, name).shape, generator=gen))
            getattr(b, name).copy_(getattr(a, name))
    saved_s = gdn_exact_step.rows_head(stacked, Bv, n)
    saved_p = gdn_exact_step.rows_head(list(reversed(single)), Bv, n)[::-1]     # not a stack: per layer
    assert len(saved_s) == 4 and len(saved_p) == layers
    for rows in (stacked, single):                  # a verify past the chunk's end overwrites the heads
        for r in rows:
            for name, axis in gdn_exact_step.ChunkRows.ROW_AXES:
                getattr(r, name).narrow(axis, 0, n).fill_(7.0)
    mask = torch.tensor([True, False, True])
    gdn_exact_step.rows_put_head_where(stacked, Bv, saved_s, mask)
    for r, head in zip(single, saved_p):
        r.narrow(0, Bv).put_head_where(head, mask)
    for a, b in zip(stacked, single):
        for name in ("X", "VN", "G", "KT"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        # put back at sequences 0 and 2; not at 1 (masked off) nor 3 (past the verify's B)
        assert (a.X[0, :, :n] != 7.0).any() and (a.X[2, :, :n] != 7.0).any()
        assert (a.X[1, :, :n] == 7.0).all() and (a.X[3, :, :n] == 7.0).all()
