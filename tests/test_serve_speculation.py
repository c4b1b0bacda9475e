"""fastqwen serve with exact speculative decoding (fastqwen/serve/speculation.py) on the tiny preset:
greedy requests get the engine's own tokens with verifies in the loop (prompts that repeat, so
prompt lookup is right at times), alone and several at once, the paged cache too; a sampled
request beside them turns verifies off while it runs; /metrics counts drafts and accepted
tokens; the server refuses a drafter it does not run."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serve_live import serving  # noqa: E402


def _repeating(seed: int, n: int) -> list:
    g = torch.Generator().manual_seed(seed)
    unit = torch.randint(0, 4000, (7,), generator=g).tolist()
    return (unit * (n // 7 + 1))[:n]


def _alone(model_dir, prompt_ids, n):
    """The engine's own greedy tokens for this prompt alone, speculation off."""
    from fastqwen.serve.app import engine_module

    eng = _alone.__dict__.setdefault("engines", {}).get(model_dir)
    if eng is None:
        eng = _alone.engines[model_dir] = engine_module().Engine(model_dir, speculation="off")
    return [s[0] for s in eng.generate([prompt_ids], n)]


def _until_eos(srv, tokens):
    n = next((k + 1 for k, t in enumerate(tokens) if t in srv.codec.stop_token_ids), len(tokens))
    return tokens[:n]


@pytest.fixture(scope="module", params=[None, 64], ids=["rows", "paged"])
def spec_server(tiny_model, request):
    from fastqwen.serve.app import Server

    srv = Server(str(tiny_model), max_batch=4, max_model_len=512, served_model_name="tiny", block_size=request.param,
                 speculation="ngram", speculative_tokens=3)
    with serving(srv) as url:
        yield srv, url


def test_greedy_requests_keep_their_tokens_with_verifies(spec_server):
    srv, url = spec_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompts = [_repeating(s, n) for s, n in ((1, 40), (2, 75), (3, 21), (4, 64))]
    want = [30, 24, 17, 40]
    before = dict(srv.scheduler.spec_stats)

    def one(i):
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=want[i], temperature=0)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for i, res in enumerate(results):
        assert res.choices[0].token_ids == _until_eos(srv, _alone(srv.model_dir, prompts[i], want[i])), i
    alone = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=want[0], temperature=0)
    assert alone.choices[0].token_ids == results[0].choices[0].token_ids
    stats = srv.scheduler.spec_stats
    assert stats["verify_steps"] > before["verify_steps"] and stats["drafted"] > before["drafted"]
    metrics = httpx.get(url + "/metrics").text
    drafted = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("fastqwen:spec_decode_num_draft_tokens_total"))
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("fastqwen:spec_decode_num_accepted_tokens_total"))
    # the repeating prompts make prompt lookup right at times: verifies emit several tokens
    assert drafted == stats["drafted"] and accepted == stats["accepted"] and 0 < accepted <= drafted


def test_a_sampled_request_beside_a_greedy_one_turns_verifies_off_while_it_runs(spec_server, monkeypatch):
    """A greedy request runs, a sampled one joins it: every step they share is a plain one, the
    greedy request verifies when it runs alone, and its tokens are the engine's own."""
    srv, url = spec_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    sched = srv.scheduler
    seen = []                   # each step's choice: (a sampled request runs, a greedy one runs, drafts)
    choose = sched._speculate_now

    def watched():
        width = choose()
        greedy = [r.params.greedy for r in list(sched.running.values())]
        seen.append((not all(greedy), any(greedy), width))
        return width

    monkeypatch.setattr(sched, "_speculate_now", watched)
    prompt = _repeating(9, 30)
    with ThreadPoolExecutor(1) as pool:
        greedy = pool.submit(client.completions.create, model="tiny", prompt=prompt, max_tokens=120,
                             temperature=0, extra_body={"ignore_eos": True})
        while not sched.running and not greedy.done():       # the greedy request admitted first
            time.sleep(0.001)
        sampled = client.completions.create(model="tiny", prompt=_repeating(10, 30), max_tokens=12, temperature=0.8,
                                            seed=3, extra_body={"ignore_eos": True})
        greedy = greedy.result()
    assert len(sampled.choices[0].token_ids) == 12
    assert greedy.choices[0].token_ids == _alone(srv.model_dir, prompt, 120)
    shared = [width for has_sampled, has_greedy, width in seen if has_sampled and has_greedy]
    assert shared and not any(shared)
    assert any(width for has_sampled, has_greedy, width in seen if has_greedy and not has_sampled)


def test_the_server_refuses_a_drafter_it_does_not_run(tiny_model):
    from fastqwen.serve.app import Server

    with pytest.raises(ValueError, match="prompt lookup"):
        Server(str(tiny_model), max_batch=2, max_model_len=128, speculation="recycle")


def test_auto_keeps_the_tokens_whatever_it_chooses(tiny_model):
    """speculation "auto": each bucket's plain step and verify timed when the slots open; whatever
    steps it takes on this machine, the greedy tokens are the engine's own."""
    from fastqwen.serve.app import Server

    srv = Server(str(tiny_model), max_batch=2, max_model_len=256, served_model_name="tiny", speculation="auto",
                 speculative_tokens=3)
    assert srv.scheduler.spec_policy is not None
    with serving(srv) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompt = _repeating(5, 50)
        before = {rows: (plain, dict(verify)) for rows, (plain, verify) in srv.scheduler.spec_policy.costs.items()}
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        assert out.choices[0].token_ids == _until_eos(srv, _alone(srv.model_dir, prompt, 40))
    # the steps were timed and bucket 1's costs moved toward what they measured
    assert srv.scheduler.slots.timing and srv.scheduler.slots.last_timing[0] == 1
    assert srv.scheduler.spec_policy.costs[1] != before[1]


def test_auto_checks_each_plain_steps_would_be_draft_on_the_host(tiny_model):
    """"auto" spends no verify on probes: each plain step's token of a greedy request is set
    against prompt lookup's first draft over the tokens before it; the counts the policy got equal
    a replay of PromptLookup over the request's output."""
    from fastqwen.serve.app import Server

    srv = Server(str(tiny_model), max_batch=2, max_model_len=256, served_model_name="tiny", speculation="auto",
                 speculative_tokens=3)
    policy, seen = srv.scheduler.spec_policy, []
    policy.next_width = lambda running: 0           # every step a plain one
    shadow = policy.observe_shadow
    policy.observe_shadow = lambda right, wrong: (seen.append((right, wrong)), shadow(right, wrong))
    with serving(srv) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompt = _repeating(7, 40)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    tokens = out.choices[0].token_ids
    hits = [srv.engine.prompt_lookup(prompt + tokens[:j]).draft(1)[0] == tokens[j] for j in range(1, len(tokens))]
    assert len(tokens) > 1 and srv.scheduler.spec_stats["verify_steps"] == 0
    assert (sum(r for r, _ in seen), sum(w for _, w in seen)) == (sum(hits), len(hits) - sum(hits))
    assert policy.policy.checked > 4          # the prior's 4 drafts and the checks since


def test_auto_verifies_of_every_width_keep_the_tokens(tiny_model):
    """The server's "auto" has a verify of 1, 2 and 3 drafts in every bucket; its choice replaced by
    a cycle through them and a plain step, two requests at once keep the engine's own tokens."""
    from fastqwen.serve.app import Server

    srv = Server(str(tiny_model), max_batch=2, max_model_len=256, served_model_name="tiny", speculation="auto",
                 speculative_tokens=3)
    assert srv.scheduler.slots.widths == (1, 2, 3)
    chosen = []

    def cycle(running):
        chosen.append((0, 1, 2, 3)[len(chosen) % 4])
        return chosen[-1]

    srv.scheduler.spec_policy.next_width = cycle
    with serving(srv) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompts = [_repeating(5, 50), _repeating(6, 40)]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=30,
                                                                     temperature=0), prompts))
        for p, out in zip(prompts, outs):
            assert out.choices[0].token_ids == _until_eos(srv, _alone(srv.model_dir, p, 30))
    assert {1, 2, 3} <= set(chosen) and srv.scheduler.spec_stats["verify_steps"] >= 3
