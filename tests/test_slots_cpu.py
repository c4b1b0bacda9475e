"""Continuous batching (engine/fq_slots.py) on the CPU path: requests of different prompt
lengths join and leave between steps, each greedy request gets the tokens it gets alone
(Engine.generate at batch 1) and passes the 2.0-logit margin against Transformers' full
forward; both model families; the errors a caller can hit are named."""
from __future__ import annotations

import pytest
import torch

from engine_modules import ENGINE_DIR, load_engine_module

from fastqwen import synth35

# (prompt length, tokens to generate, the step at which the request arrives)
SCHEDULE = [(7, 12, 0), (40, 6, 0), (129, 9, 2), (3, 10, 5), (65, 4, 6)]


def _prompt(length, seed, vocab):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_schedule(engine, prompts, schedule=SCHEDULE, max_slots=3):
    """The schedule through slots, greedy, with prompts[r] for request r: {request: emitted
    tokens}; more requests than slots, so some wait for a row to free up, and retiring moves
    the last row into the freed one (tests/test_engine_gpu.py runs it on a GPU too)."""
    slots = engine.slots(max_slots, 160)
    waiting = [(r, prompts[r], want, at) for r, (_, want, at) in enumerate(schedule)]
    out, step = {}, 0
    running = set()
    while waiting or running:
        for item in [w for w in waiting if w[3] <= step]:
            if not slots.free:
                break
            r, prompt, want, _ = item
            waiting.remove(item)
            out[r] = [int(slots.admit(r, prompt).argmax())]
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


def test_qwen3_requests_get_their_own_tokens_and_pass_the_margin(qwen3, tiny_model):
    from transformers import Qwen3ForCausalLM

    got = _run_schedule(qwen3, 4096)
    assert got == _alone(qwen3, 4096)
    model = Qwen3ForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    for r, (n, _, _) in enumerate(SCHEDULE):
        seq = torch.tensor([_prompt(n, 100 + r, 4096) + got[r]])
        with torch.inference_mode():
            logits = model(input_ids=seq).logits[0, n - 1:-1].float()
        slack = logits.max(-1).values - logits[torch.arange(len(got[r])), torch.tensor(got[r])]
        assert slack.max() <= 2.0, (r, slack.max())


def test_qwen35_requests_get_their_own_tokens(tmp_path_factory):
    path = synth35.synthesize("qwen3.5-tiny", tmp_path_factory.mktemp("q35s") / "tiny", seed=3, progress=False)
    engine = load_engine_module(ENGINE_DIR, "fastqwen_slots_qwen35").Engine(str(path))
    assert _run_schedule(engine, 1024) == _alone(engine, 1024)


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
