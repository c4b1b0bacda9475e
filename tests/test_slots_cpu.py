"""Continuous batching (engine/fq_slots.py) on the CPU path: requests of different prompt
lengths join and leave between steps, each greedy request gets the tokens it gets alone
(Engine.generate at batch 1) and passes the 2.0-logit margin against Transformers' full
forward; both model families; the errors a caller can hit are named."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_modules import ENGINE_DIR, load_engine_module

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fastqwen import synth35

# (prompt length, tokens to generate, the step at which the request arrives)
SCHEDULE = [(7, 12, 0), (40, 6, 0), (129, 9, 2), (3, 10, 5), (65, 4, 6)]


def _prompt(length, seed, vocab):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_schedule(engine, prompts, schedule=SCHEDULE, max_slots=3, page_size=None, num_pages=None, max_len=160,
                 chunk=None):
    """The schedule through slots, greedy, with prompts[r] for request r: {request: emitted
    tokens}; more requests than slots, so some wait for a row to free up, and retiring moves
    the last row into the freed one (tests/test_engine_gpu.py runs it on a GPU too). With
    page_size: the paged cache, each request reserving its prompt and tokens, so with few
    pages requests also wait for pages. With chunk: a prompt longer than that arriving while
    others run is prefilled in chunks of it, one before each step (Slots.begin, prefill_next)."""
    slots = engine.slots(max_slots, max_len, page_size=page_size, num_pages=num_pages)
    waiting = [(r, prompts[r], want, at) for r, (_, want, at) in enumerate(schedule)]
    out, step = {}, 0
    running = set()
    while waiting or running or slots.staged is not None:
        if slots.staged is not None:
            r = slots.staged
            logits = slots.prefill_next(chunk)
            if logits is not None:
                out[r] = [int(logits.argmax())]
                running.add(r)
        for item in [w for w in waiting if w[3] <= step]:
            r, prompt, want, _ = item
            if not slots.fits([len(prompt) + want]):
                break
            waiting.remove(item)
            if chunk and running and len(prompt) > chunk:
                if slots.staged is not None:
                    waiting.insert(0, item)
                    break
                slots.begin(r, prompt, reserve=len(prompt) + want)
                continue
            out[r] = [int(slots.admit(r, prompt, reserve=len(prompt) + want).argmax())]
            running.add(r)
        for r in list(running):
            if len(out[r]) >= schedule[r][1]:
                slots.retire(r)
                running.discard(r)
        if running:
            logits = slots.step({r: out[r][-1] for r in running})
            for r in running:
                out[r].append(int(logits[r].argmax()))
        step += 1
    return {r: toks[:schedule[r][1]] for r, toks in out.items()}


def _run_schedule(engine, vocab):
    return run_schedule(engine, [_prompt(n, 100 + r, vocab) for r, (n, _, _) in enumerate(SCHEDULE)])


def _alone(engine, vocab):
    return {r: [s[0] for s in engine.generate([_prompt(n, 100 + r, vocab)], want)]
            for r, (n, want, _) in enumerate(SCHEDULE)}


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return load_engine_module(ENGINE_DIR, "fastqwen_slots_qwen3").Engine(str(tiny_model))


def _assert_margin(tiny_model, got: dict) -> None:
    """Each request's greedy tokens replayed through Transformers' full forward (the Qwen3 tiny
    model): every emitted token within the 2.0-logit margin of the argmax."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    for r, (n, _, _) in enumerate(SCHEDULE):
        seq = torch.tensor([_prompt(n, 100 + r, 4096) + got[r]])
        with torch.inference_mode():
            logits = model(input_ids=seq).logits[0, n - 1:-1].float()
        slack = logits.max(-1).values - logits[torch.arange(len(got[r])), torch.tensor(got[r])]
        assert slack.max() <= 2.0, (r, slack.max())


def test_qwen3_requests_get_their_own_tokens_and_pass_the_margin(qwen3, tiny_model):
    got = _run_schedule(qwen3, 4096)
    assert got == _alone(qwen3, 4096)
    _assert_margin(tiny_model, got)


def test_qwen35_requests_get_their_own_tokens(tmp_path_factory):
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35s") / "tiny", seed=3, progress=False)
    engine = load_engine_module(ENGINE_DIR, "fastqwen_slots_qwen35").Engine(str(path))
    alone = _alone(engine, 1024)
    assert _run_schedule(engine, 1024) == alone
    # the paged cache: the attention layers' K/V in pages, the GDN states in rows
    prompts = [_prompt(n, 100 + r, 1024) for r, (n, _, _) in enumerate(SCHEDULE)]
    assert run_schedule(engine, prompts, page_size=16, num_pages=14) == alone


@pytest.mark.parametrize("page_size,num_pages,max_slots", [(16, 14, 3), (32, 15, 3), (160, 3, 3), (16, 12, 4)])
def test_qwen3_paged_requests_get_their_own_tokens(qwen3, page_size, num_pages, max_slots):
    """The paged cache: each request takes the pages its prompt and tokens need and gives them back
    when it retires; with 14 pages of 16 the 138-position request waits until enough are free.
    With 4 slots, 3 running requests step as a bucket of 4, whose padding row must write into
    no request's page (pages are handed out again as requests leave). Every request's tokens
    are its tokens alone, and every page is free at the end."""
    prompts = [_prompt(n, 100 + r, 4096) for r, (n, _, _) in enumerate(SCHEDULE)]
    got = run_schedule(qwen3, prompts, page_size=page_size, num_pages=num_pages, max_slots=max_slots)
    slots = qwen3._slots
    assert slots.free_pages == num_pages and slots.kv_usage == 0.0 and not slots.keys
    assert got == _alone(qwen3, 4096)


def test_paged_slot_errors_are_named(qwen3):
    from fq_slots import SlotError

    with pytest.raises(ValueError, match="page_size 48 must be >= 1 and divide max_len 160"):
        qwen3.slots(2, 160, page_size=48)
    slots = qwen3.slots(2, 160, page_size=16, num_pages=6)
    slots.admit("a", [1, 2, 3], reserve=40)                  # 3 pages
    assert slots.free_pages == 3 and slots.room("a") == 37 and slots.kv_usage == 0.5
    assert not slots.fits([49]) and slots.fits([48])
    with pytest.raises(SlotError, match="4 KV pages needed for 1 request"):
        slots.admit("b", [1, 2], reserve=64)
    with pytest.raises(SlotError, match="more than its 3 prompt positions"):
        slots.admit("b", [1, 2, 3], reserve=3)
    slots.admit("b", [4, 5], reserve=48)
    assert slots.free_pages == 0
    for _ in range(slots.room("a")):
        slots.step({"a": 6, "b": 7})
    with pytest.raises(SlotError, match="request 'a' is full \\(40 positions\\)"):
        slots.step({"a": 6, "b": 7})
    slots.retire("a")                                         # b's block table row moves into row 0
    assert slots.keys == ["b"] and slots.free_pages == 3
    slots.retire("b")
    assert slots.free_pages == 6


def test_slot_errors_are_named(qwen3):
    from fq_slots import SlotError, buckets

    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(16) == [1, 2, 4, 8, 16]
    slots = qwen3.slots(1, 16)
    with pytest.raises(SlotError, match="a prompt of 16 tokens leaves no room"):
        slots.admit("a", list(range(16)))
    slots.admit("a", [1, 2, 3])
    with pytest.raises(SlotError, match="already running"):
        slots.admit("a", [4])
    with pytest.raises(SlotError, match="all 1 slots are running"):
        slots.admit("b", [4])
    with pytest.raises(SlotError, match=r"exactly the running requests \['a'\]"):
        slots.step({})
    for _ in range(slots.room("a")):
        slots.step({"a": 5})
    with pytest.raises(SlotError, match="request 'a' is full"):
        slots.step({"a": 5})
    slots.retire("a")
    assert slots.free == 1
    list(qwen3.generate([[1, 2, 3]], 2))       # generate() takes the caches back
    with pytest.raises(SlotError, match="taken back"):
        slots.admit("c", [1])


def _chunked_against_whole(engine, vocab, page_size):
    """Row 0 takes a 150-token prompt in one prompt pass, row 1 the same prompt in chunks of 64, 64
    and 22 (prefill_logits with start: the later chunks' queries see the cached keys, the GDN
    layers go on from their states); then one decode step of both rows. Returns the largest
    logit differences (last prompt position, decode step) and whether the argmaxes agree."""
    engine.slots(2, 256, page_size=page_size)
    model = engine.model
    if page_size:                     # each row its own pages (what Slots.admit does)
        per_row = 256 // page_size
        model.block_table[:2].copy_(torch.arange(2 * per_row, dtype=torch.int32).view(2, per_row))
    ids = torch.tensor([_prompt(150, 7, vocab)])
    with torch.inference_mode():
        whole = model.prefill_logits(ids, row=0)[0].float()
        for start, stop in ((0, 64), (64, 128), (128, 150)):
            chunked = model.prefill_logits(ids[:, start:stop], row=1, start=start)[0].float()
        nxt = torch.tensor([int(whole.argmax())] * 2)
        positions = torch.tensor([150, 150], dtype=torch.int32)
        step = model.decode_logits(nxt, positions, positions + 1).float()
    return ((whole - chunked).abs().max().item(), (step[0] - step[1]).abs().max().item(),
            int(whole.argmax()) == int(chunked.argmax()) and int(step[0].argmax()) == int(step[1].argmax()))


@pytest.mark.parametrize("page_size", [None, 16])
def test_qwen3_prompt_in_chunks_is_the_whole_prompt(qwen3, page_size):
    """A prompt prefilled in chunks (Qwen3): the last position's logits and the next step's are the
    whole prompt's, bit for bit on the CPU (the chunks' attention runs over a masked key range,
    the whole prompt's with the causal flag: on the GPU other kernels, so the margin decides)."""
    last, step, same = _chunked_against_whole(qwen3, 4096, page_size)
    assert last == 0.0 and step == 0.0 and same, (last, step)


@pytest.mark.parametrize("page_size", [None, 16])
def test_qwen35_prompt_in_chunks_is_the_whole_prompt(tmp_path_factory, page_size):
    """The same for Qwen3.5: the GDN layers continue from the conv and recurrent states the
    chunk before left (chunks of 64: the rule's own chunk boundaries), the attention layers
    over the cached keys; bit for bit on the CPU."""
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35c") / "tiny", seed=3, progress=False)
    engine = load_engine_module(ENGINE_DIR, "fastqwen_chunks_qwen35").Engine(str(path))
    last, step, same = _chunked_against_whole(engine, 1024, page_size)
    assert last == 0.0 and step == 0.0 and same, (last, step)


@pytest.mark.parametrize("page_size", [None, 16])
def test_prompts_admitted_in_chunks_get_their_own_tokens(qwen3, tiny_model, tmp_path_factory, page_size):
    """Prompts longer than 24 tokens that arrive while others run are prefilled 24 tokens at a
    time, one chunk before each step, in the staging row, then join: every request's first token
    is its token alone and all its tokens pass the margin (Qwen3: a chunk of 24's attention runs
    SDPA with a mask, the whole prompt's the causal flag, so the CPU's bits may differ by the
    CPU's kernels; Qwen3.5: its tokens alone), row and paged caches; a request cancelled while
    being prefilled gives its row and pages back."""
    from fq_slots import SlotError

    prompts = [_prompt(n, 100 + r, 4096) for r, (n, _, _) in enumerate(SCHEDULE)]
    got, alone = run_schedule(qwen3, prompts, page_size=page_size, chunk=24), _alone(qwen3, 4096)
    assert {r: t[0] for r, t in got.items()} == {r: t[0] for r, t in alone.items()}
    assert {r: len(t) for r, t in got.items()} == {r: len(t) for r, t in alone.items()}
    _assert_margin(tiny_model, got)
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35k") / "tiny", seed=3, progress=False)
    q35 = load_engine_module(ENGINE_DIR, "fastqwen_chunked_qwen35").Engine(str(path))
    prompts35 = [_prompt(n, 100 + r, 1024) for r, (n, _, _) in enumerate(SCHEDULE)]
    assert run_schedule(q35, prompts35, page_size=page_size, chunk=24) == _alone(q35, 1024)
    slots = qwen3.slots(2, 160, page_size=page_size, num_pages=None if page_size is None else 20)
    slots.admit("a", [1, 2, 3], reserve=20)
    free = slots.free_pages
    slots.begin("b", list(range(50)), reserve=80)
    assert slots.free == 0 and slots.staged == "b"
    with pytest.raises(SlotError, match="one at a time"):
        slots.begin("c", [1, 2], reserve=10)
    assert slots.prefill_next(24) is None
    slots.retire("b")                                         # cancelled mid-prefill
    assert slots.staged is None and slots.free == 1 and slots.free_pages == free
    with pytest.raises(SlotError, match="no request is being prefilled"):
        slots.prefill_next(24)


def _greedy(slots, prompts: dict, want: int, together: bool = False) -> dict:
    """Admit each prompt (in order, one at a time; together: all in one admit_group, one pass if
    nothing is shared) and step all together until each has `want` tokens; {key: tokens}."""
    if together:
        keys = list(prompts)
        first = slots.admit_group(keys, [prompts[k] for k in keys], [len(prompts[k]) + want for k in keys])
        out = {k: [int(first[j].argmax())] for j, k in enumerate(keys)}
    else:
        out = {key: [int(slots.admit(key, prompt, reserve=len(prompt) + want).argmax())]
               for key, prompt in prompts.items()}
    while any(len(t) < want for t in out.values()):
        logits = slots.step({k: t[-1] for k, t in out.items()})
        for k in out:
            out[k].append(int(logits[k].argmax()))
    for key in prompts:
        slots.retire(key)
    return {k: t[:want] for k, t in out.items()}


def test_requests_with_a_common_prefix_share_its_pages(qwen3):
    """Paged slots, pages of 16: two prompts starting with the same 100 tokens; the second takes
    the first's 6 full pages of them (96 positions) and prefills only its rest, a third after
    both left finds the pages kept; each request's tokens are its tokens alone. Without sharing
    every page is new."""
    base = _prompt(100, 1, 4096)
    prompts = {"a": base + _prompt(10, 2, 4096), "b": base + _prompt(7, 3, 4096)}
    alone = {k: [s[0] for s in qwen3.generate([p], 6)] for k, p in prompts.items()}
    alone["c"] = [s[0] for s in qwen3.generate([base + [5]], 6)]
    slots = qwen3.slots(3, 160, page_size=16, num_pages=30)
    assert _greedy(slots, {"a": prompts["a"]}, 6) == {"a": alone["a"]}
    assert slots.pool.hit_tokens == 0 and slots.free_pages == 30           # a's 6 full pages kept, free
    free = slots.free_pages
    slots.admit("x", prompts["b"], reserve=120)                           # 8 pages, 6 of them a's
    assert slots.pool.hit_tokens == 96 and slots.free_pages == free - 8
    slots.retire("x")
    got = _greedy(slots, {"b": prompts["b"], "c": base + [5]}, 6)
    assert got == {"b": alone["b"], "c": alone["c"]} and slots.pool.hit_tokens == 3 * 96
    unshared = qwen3.slots(3, 160, page_size=16, num_pages=30, share_prefixes=False)
    assert _greedy(unshared, {"b": prompts["b"]}, 6) == {"b": alone["b"]} and unshared.pool.hit_tokens == 0


def test_pages_kept_for_a_prefix_are_reused_when_the_pool_runs_short(qwen3):
    """Kept pages no request holds count as free and are handed out (their prefix forgotten) when
    no free page is left: a pool of 8 pages fills with one request's kept pages and serves
    another's whole reserve after it."""
    slots = qwen3.slots(2, 128, page_size=16, num_pages=8)
    first, second = _prompt(96, 11, 4096), _prompt(100, 12, 4096)
    _greedy(slots, {"a": first}, 4)
    assert slots.free_pages == 8
    assert _greedy(slots, {"b": second}, 20) == {"b": [s[0] for s in qwen3.generate([second], 20)]}
    slots = qwen3.slots(2, 128, page_size=16, num_pages=8)
    _greedy(slots, {"a": first}, 4)
    _greedy(slots, {"b": second}, 20)
    assert slots.pool.hit_tokens == 0
    _greedy(slots, {"c": first + [1]}, 2)            # a's pages were reused by b: nothing found
    assert slots.pool.hit_tokens == 0


def _stand_in_chunk_graphs(monkeypatch):
    """fq_slots' ChunkGraph as its buffers with each run an eager pass (no CUDA graph on the CPU),
    every construction (a capture on a GPU) counted as (length, start, snapshot cut); Graph.fail
    makes runs raise. Returns (the list of captures, the class)."""
    import fq_decode
    import fq_slots

    captured = []

    class Graph(fq_decode.ChunkGraph):
        fail = False

        def __init__(self, model, row, length, start, pool=None, cut=None):
            captured.append((length, start, cut))
            super().__init__(model, row, length, start, pool, cut, use_graph=False)

        def run(self, ids, index=None):
            if Graph.fail:
                raise RuntimeError("replay failed")
            return super().run(ids, index)

    monkeypatch.setattr(fq_slots, "ChunkGraph", Graph)
    return captured, Graph


def test_a_prompt_admitted_alone_runs_as_a_chunk_graph(qwen3, monkeypatch):
    """With graphs (a GPU's slots), a prompt admitted alone goes through the staging row as one
    chunk: its (length, start) runs eagerly the first time and as a ChunkGraph from the second
    on, a prefix hit's rest included (an eager pass is launch-bound at these sizes, and a hit's
    rest ran slower than a whole prompt). A group of two stays one eager pass; a
    failed pass holds nothing. Each request's tokens are its tokens alone. On the CPU a stand-in
    graph (ChunkGraph's buffers, each run an eager pass) counts the captures."""
    captured, Graph = _stand_in_chunk_graphs(monkeypatch)
    base = _prompt(64, 51, 4096)                           # four pages of 16
    prompts = {"w1": _prompt(80, 52, 4096), "w2": _prompt(80, 53, 4096), "h1": base + _prompt(16, 54, 4096),
               "h2": base + _prompt(16, 55, 4096), "h3": base + _prompt(16, 56, 4096)}
    alone = {k: [s[0] for s in qwen3.generate([p], 4)] for k, p in prompts.items()}
    slots = qwen3.slots(2, 160, page_size=16, num_pages=40)
    slots.use_graphs, slots._chunk_pool = True, "pool"     # as on a GPU (its steps stay eager here)
    kinds = []
    for key in prompts:                  # (80, 0) eager, captured, replayed (h1); then h2's rest eager, h3's captured
        assert _greedy(slots, {key: prompts[key]}, 4) == {key: alone[key]}
        kinds.append(slots.last_pass)
    assert kinds == ["eager", "capture", "graph", "eager", "capture"], kinds
    assert captured == [(80, 0, None), (16, 64, None)] and slots.pool.hit_tokens == 2 * 64
    assert _greedy(slots, {"w1": prompts["w1"], "w2": prompts["w2"]}, 4, together=True) == \
        {k: alone[k] for k in ("w1", "w2")} and len(captured) == 2 and slots.last_pass == "group"
    Graph.fail = True
    with pytest.raises(RuntimeError, match="replay failed"):
        slots.admit("x", prompts["w1"], reserve=90)
    assert slots.staged is None and slots.free == 2 and slots.free_pages == 40

@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35p") / "tiny", seed=3, progress=False)
    return load_engine_module(ENGINE_DIR, "fastqwen_prefix_qwen35").Engine(str(path))


def test_qwen35_requests_with_a_common_prefix_share_its_pages_and_states(qwen35):
    """Qwen3.5, pages of 64 (the rule's chunk): a's pass keeps a snapshot of its GDN states where
    its last whole page ends (128); b, sharing a's first 150 tokens, takes a's first 2 pages and
    that snapshot and prefills only positions 128-156; c shares them after both left; d shares
    only a's first page, where no snapshot was taken, so nothing. Each request's tokens are its
    tokens alone (bit for bit on the CPU: the snapshot is the state the pass has at a chunk
    start). Pages of 16 (not a multiple of the chunk): nothing is shared."""
    base = _prompt(150, 1, 1024)
    prompts = {"a": base + _prompt(10, 2, 1024), "b": base + _prompt(7, 3, 1024), "c": base[:140] + [5],
               "d": base[:70] + _prompt(30, 4, 1024)}
    alone = {k: [s[0] for s in qwen35.generate([p], 6)] for k, p in prompts.items()}
    slots = qwen35.slots(3, 320, page_size=64, num_pages=20)
    assert slots.pool.snapshots == 8
    assert _greedy(slots, {"a": prompts["a"]}, 6) == {"a": alone["a"]} and slots.pool.hit_tokens == 0
    assert _greedy(slots, {"b": prompts["b"]}, 6) == {"b": alone["b"]} and slots.pool.hit_tokens == 128
    assert _greedy(slots, {"c": prompts["c"], "d": prompts["d"]}, 6) == {"c": alone["c"], "d": alone["d"]}
    assert slots.pool.hit_tokens == 2 * 128                   # c found 128 positions, d none
    small = qwen35.slots(3, 320, page_size=16, num_pages=60)
    assert not small.pool.share
    assert _greedy(small, {"a": prompts["a"], "b": prompts["b"]}, 6) == {"a": alone["a"], "b": alone["b"]}
    assert small.pool.hit_tokens == 0


def test_qwen35_snapshots_from_chunked_prompts_and_the_oldest_dropped(qwen35):
    """A prompt prefilled in chunks of 64 keeps its snapshot at a chunk's start (192), and a later
    prompt shares up to it; with room for one snapshot, a second prompt's snapshot drops the
    first's, whose prefix is then not found."""
    first, second = _prompt(200, 21, 1024), _prompt(140, 22, 1024)
    alone = {k: [s[0] for s in qwen35.generate([p], 4)] for k, p in
             (("x", first + [7]), ("y", second + [9]), ("z", first + [8]))}
    slots = qwen35.slots(2, 320, page_size=64, num_pages=16, state_snapshots=1)
    slots.begin("a", first, reserve=210)
    while slots.prefill_next(64) is None:
        pass
    slots.retire("a")
    assert _greedy(slots, {"x": first + [7]}, 4) == {"x": alone["x"]} and slots.pool.hit_tokens == 192
    assert _greedy(slots, {"y": second + [9]}, 4) == {"y": alone["y"]}    # its snapshot at 128 drops first's
    assert _greedy(slots, {"z": first + [8]}, 4) == {"z": alone["z"]} and slots.pool.hit_tokens == 192
    with pytest.raises(ValueError, match="state_snapshots"):
        qwen35.slots(2, 320, page_size=64, num_pages=16, state_snapshots=-1)


def test_qwen35_a_common_system_prompt_is_shared_from_the_third_request_on(qwen35):
    """Three prompts with the same 140-token start (two whole pages of 64) and different rests:
    a keeps its snapshot at its last whole page (192); b matches a's two pages but finds no
    snapshot at 128, so it shares nothing and keeps its snapshot there (bound to a's kept page);
    c shares those 128 positions. Each request's tokens are its tokens alone."""
    system = _prompt(140, 31, 1024)
    prompts = {"a": system + _prompt(100, 32, 1024), "b": system + _prompt(90, 33, 1024),
               "c": system + _prompt(50, 34, 1024)}
    alone = {k: [s[0] for s in qwen35.generate([p], 4)] for k, p in prompts.items()}
    slots = qwen35.slots(2, 320, page_size=64, num_pages=16)
    assert _greedy(slots, {"a": prompts["a"]}, 4) == {"a": alone["a"]} and slots.pool.hit_tokens == 0
    assert slots.pool.snapshot_point(prompts["b"], 0) == 128
    assert _greedy(slots, {"b": prompts["b"]}, 4) == {"b": alone["b"]} and slots.pool.hit_tokens == 0
    assert _greedy(slots, {"c": prompts["c"]}, 4) == {"c": alone["c"]} and slots.pool.hit_tokens == 128


def test_page_pool_keeps_snapshots_with_their_pages():
    """fq_slots.PagePool's snapshot bookkeeping alone (pages of 4, room for 2 snapshots): a prefix
    is found only up to a page that has a snapshot; a snapshot binds to whichever page keeps its
    prefix; the least recently used one is taken back first; a kept page handed out again
    forgets its prefix and gives its snapshot back."""
    import sys

    if str(ENGINE_DIR) not in sys.path:
        sys.path.insert(0, str(ENGINE_DIR))
    from fq_slots import PagePool

    pool = PagePool(6, 4, True, snapshots=2)
    a = list(range(10))                                   # two whole pages before its last token
    pages = pool.take(3)
    assert pool.snapshot_point(a, 0) == 8
    first = pool.new_snapshot()
    pool.keep(a, pages)
    pool.bind_snapshot(first, a, 8)
    pool.release(pages)                                   # kept: free again, still findable
    assert pool.free == 6 and pool.lookup(a + [1]) == pages[:2] and pool.snapshot_of(pages[1]) == first
    pool.release(pages[:2])
    b = a[:4] + [50, 51, 52, 53, 54]                      # matches a's first page only: no snapshot there
    assert pool.lookup(b) == [] and pool.snapshot_point(b, 0) == 4
    second = pool.new_snapshot()
    pool.bind_snapshot(second, b, 4)                      # bound to a's first page, which keeps a[:4]
    assert pool.lookup(b) == pages[:1] and pool.snapshot_of(pages[0]) == second
    pool.release(pages[:1])
    third = pool.new_snapshot()                           # none free: a's (least recently used) taken back
    assert third == first and pool.lookup(a + [1]) == pages[:1]
    pool.release(pages[:1])
    pool.drop_snapshot(third)
    got = pool.take(6)                                    # every page, the kept ones forgotten last
    assert sorted(got) == list(range(6)) and pool.lookup(b) == [] and pool.new_snapshot() in (first, second)
    pool.new_snapshot()
    assert pool.new_snapshot() is None                    # both being filled, none bound: none to take


def test_qwen35_more_prompts_at_once_than_snapshots(qwen35):
    """Room for two snapshots. Four prompts of one length admitted in one pass would need four:
    the pass takes none (no error, nothing held). Two of them alone then keep theirs; four
    prompts continuing all four (admitted together: two share, each its own pass) take the
    snapshots there are. Every request's tokens are its tokens alone, every page comes back."""
    prompts = {f"p{i}": _prompt(150, 40 + i, 1024) for i in range(4)}
    again = {f"q{i}": prompts[f"p{i}"][:140] + [3 + i] for i in range(4)}
    alone = {k: [s[0] for s in qwen35.generate([p], 4)] for k, p in {**prompts, **again}.items()}
    slots = qwen35.slots(4, 320, page_size=64, num_pages=40, state_snapshots=2)
    assert _greedy(slots, prompts, 4, together=True) == {k: alone[k] for k in prompts}
    assert slots.pool.hit_tokens == 0
    for key in ("p0", "p1"):                              # each keeps a snapshot at 128
        assert _greedy(slots, {key: prompts[key]}, 4) == {key: alone[key]}
    assert slots.pool.hit_tokens == 0
    assert _greedy(slots, again, 4, together=True) == {k: alone[k] for k in again}
    assert slots.pool.hit_tokens == 2 * 128 and slots.pool.free == 40            # q0 and q1 shared; all back


def test_qwen35_a_prompt_admitted_alone_keeps_its_snapshot_through_its_graph(qwen35, monkeypatch):
    """Qwen3.5 with graphs and graph_snapshot_passes: a prompt admitted alone keeps its GDN states at its last whole page as
    a snapshot, and its pass is still a graph from its shape's second pass on, the snapshot's
    position part of the shape and its index written into the graph's buffer before each run.
    w1's pass (eager) and w2's (captured) keep snapshots at 192 under different indices; a prompt
    sharing w2's first 192 tokens goes on from w2's snapshot and one sharing w1's from w1's (a
    graph writing its index anywhere else would overwrite one of them), each its tokens alone."""
    captured, _ = _stand_in_chunk_graphs(monkeypatch)
    w1, w2 = _prompt(200, 61, 1024), _prompt(200, 62, 1024)
    prompts = {"w1": w1, "w2": w2, "h2": w2[:192] + _prompt(20, 63, 1024), "h1": w1[:192] + _prompt(20, 64, 1024),
               "h2b": w2[:192] + _prompt(20, 65, 1024)}
    alone = {k: [s[0] for s in qwen35.generate([p], 4)] for k, p in prompts.items()}
    slots = qwen35.slots(2, 320, page_size=64, num_pages=24)
    assert slots.graph_snapshot_passes                     # the default (fq_slots.GRAPH_SNAPSHOT_PASSES)
    slots.use_graphs, slots._chunk_pool = True, "pool"
    for key in prompts:
        assert _greedy(slots, {key: prompts[key]}, 4) == {key: alone[key]}, key
    # w1 eager, w2 captured with its snapshot at 192; h2 eager (a new shape), h1 and h2b its graph
    assert captured == [(200, 0, 192), (20, 192, None)]
    assert slots.pool.hit_tokens == 3 * 192
    # the tiny model's tokens barely feel its small states: the kept snapshots themselves are
    # each prompt's states at 192, as an eager pass takes them (into a snapshot no page holds)
    model, pool = qwen35.model, slots.pool
    bound = {w: pool._snap_of[pool._page_of[tuple(w[:192])]] for w in ((*w1,), (*w2,))}
    spare = next(i for i in range(pool.snapshots) if i not in bound.values())
    for w, index in bound.items():
        with torch.inference_mode():
            model.prefill_logits(torch.tensor([w]), row=0, snapshot=(192, [spare]))
        assert torch.equal(model.snap_state[spare], model.snap_state[index])
        assert torch.equal(model.snap_conv[spare], model.snap_conv[index])


def test_qwen35_snapshot_passes_stay_eager_when_turned_off(qwen35, monkeypatch):
    """With graph_snapshot_passes off (the bench's A/B) a pass that keeps a snapshot runs eagerly
    even with graphs: only the prefix hits' rests (no snapshot) become graphs; new slots take the
    default (on) again."""
    captured, _ = _stand_in_chunk_graphs(monkeypatch)
    w1, w2 = _prompt(200, 71, 1024), _prompt(200, 72, 1024)
    prompts = {"w1": w1, "w2": w2, "h1": w1[:192] + _prompt(20, 73, 1024), "h2": w2[:192] + _prompt(20, 74, 1024)}
    alone = {k: [s[0] for s in qwen35.generate([p], 3)] for k, p in prompts.items()}
    slots = qwen35.slots(2, 320, page_size=64, num_pages=24)
    slots.use_graphs, slots._chunk_pool, slots.graph_snapshot_passes = True, "pool", False
    for key in prompts:
        assert _greedy(slots, {key: prompts[key]}, 3) == {key: alone[key]}, key
    assert captured == [(20, 192, None)] and slots.pool.hit_tokens == 2 * 192
    assert qwen35.slots(2, 320, page_size=64, num_pages=24).graph_snapshot_passes


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
def test_warm_runs_a_pass_and_its_continuation_and_keeps_nothing(model, request, monkeypatch):
    """Slots.warm (the server calls it at startup): a prompt pass and its continuation in the
    staging row (Qwen3.5: keeping a snapshot halfway), and a group pass over the rows (at most
    4), eagerly; afterwards rows, pages, kept
    prefixes and snapshots are as before, and requests get their tokens alone."""
    engine = request.getfixturevalue(model)
    vocab = 4096 if model == "qwen3" else 1024
    prompts = {"a": _prompt(150, 81, vocab), "b": _prompt(150, 81, vocab)[:140] + _prompt(20, 82, vocab)}
    alone = {k: [s[0] for s in engine.generate([p], 4)] for k, p in prompts.items()}
    slots = engine.slots(2, 320, page_size=64, num_pages=12)
    pool = slots.pool
    before = (slots.free, slots.free_pages, list(pool._free), list(pool._snap_free), dict(pool._page_of))
    calls = []
    real = engine.model.prefill_logits
    monkeypatch.setattr(engine.model, "prefill_logits", lambda ids, **kw: (calls.append((tuple(ids.shape), kw)),
                                                                          real(ids, **kw))[1])
    slots.warm()
    monkeypatch.undo()
    # the staging row's pass and continuation, then the two rows' group pass
    assert [(n, kw.get("start", 0), kw.get("row")) for n, kw in calls] == [((1, 128), 0, slots.staging),
                                                                         ((1, 128), 128, slots.staging),
                                                                         ((2, 128), 0, 0)]
    assert (calls[0][1].get("snapshot") is not None) == (model == "qwen35")
    assert (slots.free, slots.free_pages, list(pool._free), list(pool._snap_free), dict(pool._page_of)) == before
    assert not slots._chunk_graphs and slots.staged is None
    for key in prompts:
        assert _greedy(slots, {key: prompts[key]}, 4) == {key: alone[key]}, key
    import fq_slots

    slots.admit("c", prompts["a"], reserve=160)
    with pytest.raises(fq_slots.SlotError, match="before any request"):
        slots.warm()


def test_slots_are_sized_by_the_memory_left():
    """fq_slots.fit_rows, what Engine.plan_slots sizes a row cache by: the requested count checked
    against the budget, or as many as fit (at most DEFAULT_MAX_SLOTS); 16 on the CPU."""
    from fq_slots import DEFAULT_MAX_SLOTS, fit_rows

    gib = 2**30
    assert fit_rows(None, gib, None, 4096) == 16 and fit_rows(5, gib, None, 4096) == 5     # the CPU
    assert fit_rows(None, gib // 4, 10 * gib, 1280) == 40                   # as many as fit
    assert fit_rows(None, 1, 10 * gib, 1280) == DEFAULT_MAX_SLOTS
    assert fit_rows(48, gib // 8, 10 * gib, 1280) == 48
    with pytest.raises(ValueError, match=r"48 slots of 1280 tokens need 12.0 GiB .*room for 40"):
        fit_rows(48, gib // 4, 10 * gib, 1280)
    with pytest.raises(ValueError, match="no room for one slot"):
        fit_rows(None, gib, gib // 2, 1280)


def test_paged_cache_is_sized_by_the_memory_left():
    """fq_slots.fit_pages: the slots' own rows (Qwen3.5's states) and the staging row come out of
    the budget first, the rest in pages, never more than the slots can hold."""
    from fq_slots import DEFAULT_MAX_SLOTS, fit_pages

    gib, mib = 2**30, 2**20
    assert fit_pages(64, None, 4096, mib, 0, None) == (16, 16 * 64)          # the CPU: every slot's worth
    assert fit_pages(64, 8, 1024, mib, 0, None) == (8, 8 * 16)
    assert fit_pages(64, None, 1280, mib, 16 * mib, 2 * gib) == (DEFAULT_MAX_SLOTS, 2 * 1024 - 65 * 16)
    assert fit_pages(64, None, 1280, mib, 16 * mib, 10 * gib) == (DEFAULT_MAX_SLOTS, 64 * 20)
    assert fit_pages(64, 4, 1280, mib, 0, 10 * gib) == (4, 4 * 20)           # never more than the slots hold
    with pytest.raises(ValueError, match="1000 tokens must be a multiple of the page size 64"):
        fit_pages(64, None, 1000, mib, 0, 10 * gib)
    with pytest.raises(ValueError, match="one request of 1280 tokens need"):
        fit_pages(64, None, 1280, gib, 0, 10 * gib)


def test_plan_slots_and_the_slots_counters(qwen3):
    """Engine.plan_slots gives the arguments Engine.slots takes (on the CPU: 16 slots, every slot's
    pages); Slots.running lists the requests in row order and Slots.stats counts what a server
    reports (running, KV usage, prefix hits, how the last prompt pass ran)."""
    plan = qwen3.plan_slots(256, page_size=64)
    assert plan == {"max_slots": 16, "max_len": 256, "page_size": 64, "num_pages": 64, "share_prefixes": True,
                    "state_snapshots": None}
    with pytest.raises(ValueError, match="max_len must be >= 2"):
        qwen3.plan_slots(1)
    slots = qwen3.slots(**{**plan, "max_slots": 2})
    assert slots.running == () and slots.stats() == {"running": 0, "kv_usage": 0.0, "prefix_hit_tokens": 0,
                                                      "last_pass": None}
    slots.admit("a", _prompt(70, 3, 4096))
    slots.admit("b", _prompt(70, 3, 4096)[:64] + [5, 6])
    stats = slots.stats()
    assert slots.running == ("a", "b") and stats["running"] == 2 and stats["kv_usage"] > 0
    assert stats["prefix_hit_tokens"] == 64 and stats["last_pass"] in ("group", "eager")


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
def test_a_prompt_admitted_with_every_positions_logits(model, request):
    """admit_group(all_positions=True), a prompt's own log-likelihood (a server's echo): the logits
    of every prompt position, [G, length, vocab], each row within rounding of a pass over that
    prefix alone and with its argmax; the last row the plain admission's logits; nothing shared
    even where a kept prefix matches (its positions' logits are needed); then the request decodes
    the tokens it gets alone."""
    engine = request.getfixturevalue(model)
    vocab = 4096 if model == "qwen3" else 1024
    prompt = _prompt(70, 91, vocab)
    alone = [s[0] for s in engine.generate([prompt], 4)]
    slots = engine.slots(2, 256, page_size=64)
    plain = slots.admit("p", prompt, reserve=80)
    slots.retire("p")
    hits = slots.stats()["prefix_hit_tokens"]
    every = slots.admit_group(["e"], [prompt], [80], all_positions=True)
    assert every.shape == (1, 70, vocab)
    assert slots.stats()["prefix_hit_tokens"] == hits, "an echo admission shared a kept prefix"
    last = (every[0, -1].float() - plain.float()).abs().max().item()
    assert last <= 0.02 * plain.float().std().item() + 0.07 and int(every[0, -1].argmax()) == int(plain.argmax())
    for t in (0, 9, 40, 63, 64):
        with torch.inference_mode():
            ref = engine.model.prefill_logits(torch.tensor([prompt[:t + 1]]), row=1)[0].float()
        diff = (every[0, t].float() - ref).abs().max().item()
        assert diff <= 0.02 * ref.std().item() + 0.07, (t, diff)
        assert int(every[0, t].argmax()) == int(ref.argmax()), t
    out = [int(every[0, -1].argmax())]
    while len(out) < 4:
        out.append(int(slots.step({"e": out[-1]})["e"].argmax()))
    assert out == alone
    slots.retire("e")


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_a_verify_in_the_slots_keeps_each_requests_tokens(family, page_size, tiny_model, tmp_path_factory):
    """Slots.verify_rows then commit (the server's speculation) between plain steps, verifies of 3,
    2 and 1 drafts in turn: row 0's drafts are its true next tokens (all kept), row 1's wrong from
    the second on (one kept, then the target's pick), row 2's first verify closes a GDN chunk at a
    row it rejects; every request's greedy tokens are those it gets alone, and its slot's caches
    go on from the kept rows."""
    if family == "qwen3":
        engine, vocab = load_engine_module(ENGINE_DIR, "fastqwen_slots_spec3").Engine(str(tiny_model)), 4096
    else:
        path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35v") / "tiny", seed=3, progress=False)
        engine, vocab = load_engine_module(ENGINE_DIR, "fastqwen_slots_spec35").Engine(str(path)), 1024
    k, steps = 3, 24
    prompts = [_prompt(n, 300 + r, vocab) for r, n in enumerate((9, 30, 61))]
    want = [[s[0] for s in engine.generate([p], steps)] for p in prompts]
    slots = engine.slots(4, 128, page_size=page_size, speculative_tokens=k)
    assert slots.widths == (k,)
    from fq_slots import Slots, SlotError

    slots.closed = True
    engine._slots = slots = Slots(engine.model, engine.device, 4, 128, page_size=page_size, speculative_tokens=k,
                                  verify_widths=(1, 2))
    assert slots.widths == (1, 2, 3)
    out = []
    for r, p in enumerate(prompts):
        out.append([int(slots.admit(r, p).argmax())])
    for step in range(6):
        if step % 2:                 # a verify every other step: 3, 2, then 1 drafts
            w = k - step // 2
            drafts = [want[0][len(out[0]):len(out[0]) + w],
                      want[1][len(out[1]):len(out[1]) + 1]
                      + [(t + 1) % vocab for t in want[1][len(out[1]) + 1:len(out[1]) + w]],
                      [(t + 1) % vocab for t in want[2][len(out[2]):len(out[2]) + w]]]
            rows = torch.tensor([[o[-1]] + d for o, d in zip(out, drafts)])
            picks = slots.verify_rows(rows).tolist()
            kept = []
            for o, d, p in zip(out, drafts, picks):
                m = next((j for j in range(w) if d[j] != p[j]), w)
                o.extend(p[:m + 1])
                kept.append(m + 1)
            assert kept[0] == w + 1 and kept[1] == 2 and kept[2] == 1
            if w == 1:
                with pytest.raises(SlotError, match="needs 1..2 kept positions"):
                    slots.commit([3, 2, 1])
            slots.commit(kept)
        else:
            logits = slots.step({r: out[r][-1] for r in range(3)})
            for r in range(3):
                out[r].append(int(logits[r].argmax()))
    for r in range(3):
        assert out[r] == want[r][:len(out[r])], r
    with pytest.raises(SlotError, match="no verify to commit"):
        slots.commit([1, 1, 1])
    with pytest.raises(SlotError, match=r"for w in \(1, 2, 3\)"):
        slots.verify_rows(torch.zeros((3, 5), dtype=torch.int64))


def test_a_wide_qwen35_verify_in_the_slots_stops_before_each_close(tmp_path_factory):
    """Six running rows (a verify bucket wider than the model's rollback_rows): each row's
    verify_keep is the rows before its chunk's close (3, 2, 1 at 3, 2, 1 positions before it; 4
    where the close is row 0 or beyond the verify), commit refuses more, and with every draft
    right each row keeps what it may; every request's greedy tokens stay those it gets alone."""
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35w") / "tiny", seed=5, progress=False)
    engine, vocab = load_engine_module(ENGINE_DIR, "fastqwen_slots_wide35").Engine(str(path)), 1024
    from fq_slots import Slots, SlotError

    k, steps, lengths = 3, 24, (60, 61, 62, 63, 59, 30)
    assert len(lengths) > engine.model.rollback_rows
    prompts = [_prompt(n, 500 + r, vocab) for r, n in enumerate(lengths)]
    want = [[s[0] for s in engine.generate([p], steps)] for p in prompts]
    engine._slots = slots = Slots(engine.model, engine.device, 8, 128, speculative_tokens=k)
    out = [[int(slots.admit(r, p).argmax())] for r, p in enumerate(prompts)]
    first = True
    while min(len(o) for o in out) < 12:         # a row gains at most 5 a turn: drafts stay inside want
        drafts = [want[r][len(o):len(o) + k] for r, o in enumerate(out)]
        picks = slots.verify_rows(torch.tensor([[o[-1]] + d for o, d in zip(out, drafts)])).tolist()
        if first:
            assert slots.verify_keep == [3, 2, 1, 4, 4, 4]
            with pytest.raises(SlotError, match=r"row by row at most \[3, 2, 1, 4, 4, 4\]"):
                slots.commit([4] * 6)
            first = False
        kept = []
        for o, d, p, most in zip(out, drafts, picks, slots.verify_keep):
            m = min(next((j for j in range(k) if d[j] != p[j]), k), most - 1)
            o.extend(p[:m + 1])
            kept.append(m + 1)
        assert kept == slots.verify_keep          # every draft right: each row keeps all it may
        slots.commit(kept)
        logits = slots.step({r: out[r][-1] for r in range(len(out))})
        for r in range(len(out)):
            out[r].append(int(logits[r].argmax()))
    for r in range(len(out)):
        assert out[r] == want[r][:len(out[r])], r
