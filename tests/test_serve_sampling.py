"""fastqwen.serve.sampling: OpenAI-style parameters checked with the bad value named, greedy
rows equal to the argmax, seeded draws repeatable, top-k / top-p cuts as documented, and the
draws following the softmax."""
from __future__ import annotations

import pytest
import torch

from fastqwen.serve.sampling import SamplingError, SamplingParams, make_generator, sample


def test_defaults_and_openai_names():
    p = SamplingParams.from_request({"max_tokens": 7, "temperature": 0, "stop": "\n\n", "seed": 3})
    assert (p.max_tokens, p.greedy, p.stop, p.seed, p.top_k, p.top_p) == (7, True, ("\n\n",), 3, -1, 1.0)
    assert SamplingParams.from_request({}, default_max_tokens=32).max_tokens == 32
    assert SamplingParams.from_request({"max_completion_tokens": 5}).max_tokens == 5


@pytest.mark.parametrize("body,match", [
    ({"temperature": -0.1}, "temperature must be >= 0.0, got -0.1"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0}, "top_p must be > 0.0"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": 10**6}, "max_tokens must be <= 4096"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop takes at most 4"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"n": 2}, "n must be 1"),
    ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
    ({"logprobs": 21}, "logprobs must be <= 20"),
    ({"logprobs": True}, "logprobs must be an integer, got true"),
    ({"echo": "yes"}, 'echo must be true or false, got "yes"'),
    ({"top_logprobs": 2}, "top_logprobs is not supported"),
    ({"seed": 2**63}, "seed must be <= 9223372036854775807, got 9223372036854775808"),
    ({"seed": -2**63 - 1}, "seed must be >= -9223372036854775808"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"n": True}, "n must be an integer, got true"),
    ({"max_tokens": 8.0}, "max_tokens must be an integer, got 8.0"),
    ({"temperature": True}, "temperature must be a number, got true"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"top_k": 10**30}, None),
    ({"stop": ["a", 5]}, "stop must be a string or a list of strings"),
    ({"stop": [""]}, "stop takes at most 4 non-empty strings"),
    ({"ignore_eos": "yes"}, 'ignore_eos must be true or false, got "yes"'),
])
def test_bad_parameters_are_named(body, match):
    """Each bad value is a SamplingError naming the parameter (its `param`) and the value as JSON."""
    if match is None:          # a value within the checks: taken as it is
        SamplingParams.from_request(body, max_model_len=4096)
        return
    with pytest.raises(SamplingError, match=match) as info:
        SamplingParams.from_request(body, max_model_len=4096)
    assert info.value.param == next(iter(body))


@pytest.mark.parametrize("body,match", [
    ({"logprobs": 3}, "logprobs must be true or false, got 3"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be <= 20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be >= 0"),
    ({"top_logprobs": 2}, r"top_logprobs \(2\) needs logprobs set to true"),
    ({"echo": True}, "echo is not supported"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
])
def test_bad_chat_logprobs_are_named(body, match):
    with pytest.raises(SamplingError, match=match) as info:
        SamplingParams.from_request(body, max_model_len=4096, chat=True)
    assert info.value.param == ("top_logprobs" if "top_logprobs" in body else next(iter(body)))


def test_logprobs_of_each_endpoint():
    """Chat: logprobs a boolean, top_logprobs the alternatives; completions: logprobs the
    alternatives, echo the prompt first (max_tokens 0 only with it)."""
    chat = SamplingParams.from_request({"logprobs": True, "top_logprobs": 3}, chat=True)
    assert (chat.logprobs, chat.echo, chat.prompt_logprobs) == (3, False, False)
    assert SamplingParams.from_request({"logprobs": True}, chat=True).logprobs == 0
    assert SamplingParams.from_request({"logprobs": False, "top_logprobs": 0}, chat=True).logprobs is None
    legacy = SamplingParams.from_request({"logprobs": 2, "echo": True, "max_tokens": 0})
    assert (legacy.logprobs, legacy.echo, legacy.prompt_logprobs, legacy.max_tokens) == (2, True, True, 0)
    assert not SamplingParams.from_request({"echo": True}).prompt_logprobs
    assert SamplingParams.from_request({}).logprobs is None


def test_seeds_take_the_whole_signed_64_bit_range():
    """OpenAI's and vLLM's range for seed; each end makes a generator, and seeds repeat their draws."""
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0))
    for seed in (-2**63, -1, 0, 2**63 - 1):
        p = SamplingParams.from_request({"seed": seed, "temperature": 1.0})
        draws = [sample(logits, [p], [make_generator(p, torch.device("cpu"), None)]).item() for _ in range(2)]
        assert p.seed == seed and draws[0] == draws[1]


def test_neutral_values_of_unsupported_parameters_pass():
    """What clients send by default for parameters the server does not implement is accepted."""
    SamplingParams.from_request({"presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "logprobs": None,
                                 "echo": False, "best_of": 1, "n": 1, "suffix": None, "top_logprobs": 0})
    SamplingParams.from_request({"echo": False, "logprobs": False, "top_logprobs": 0}, chat=True)


def test_show_is_bounded_json():
    from fastqwen.serve.sampling import show

    deep = []
    for _ in range(100_000):
        deep = [deep]
    assert show(True) == "true" and show("no") == '"no"' and show("a\ud800") == '"a\\ud800"'
    assert show(list(range(10**6))).endswith('"..."]') and len(show("x" * 10**7)) <= 83
    assert show(deep) == '[[[["..."]]]]'


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_rows_are_the_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 5.0]], dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy, greedy], _gens(2)).tolist() == [1, 0]


def test_a_seed_repeats_its_draws_and_rows_are_independent():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[2] = logits[0]
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 1)]
    server = torch.Generator().manual_seed(9)
    draws = [sample(logits, params, [make_generator(p, torch.device("cpu"), server) for p in params]).tolist()
             for _ in range(2)]
    assert draws[0] == draws[1]
    assert draws[0][0] == draws[0][2]          # same seed, same logits: same token
    # each row draws alone what it draws beside the others, over several draws of its generator
    gens = [make_generator(p, torch.device("cpu"), server) for p in params]
    alone = [make_generator(p, torch.device("cpu"), server) for p in params]
    for _ in range(5):
        together = sample(logits, params, gens).tolist()
        assert together == [sample(logits[r:r + 1], params[r:r + 1], alone[r:r + 1]).item() for r in range(3)]


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gens = _gens(1)
    for _ in range(200):
        assert sample(logits, [SamplingParams(temperature=1.0, top_k=2)], gens).item() in (0, 1)
        # top_p 0.6: 0.5 alone does not reach it, 0.5 + 0.3 does: two tokens stay
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.6)], gens).item() in (0, 1)
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.4)], gens).item() == 0


def test_draws_follow_the_softmax():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None].repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    got = sample(logits, params, _gens(4000))
    freq = torch.bincount(got, minlength=3).float() / 4000
    assert (freq - probs).abs().max() < 0.04, freq
    # a low temperature sharpens: the top token's share grows
    cold = sample(logits, [SamplingParams(temperature=0.25)] * 4000, _gens(4000, 5000))
    assert (cold == 0).float().mean() > 0.9


def test_a_row_whose_generator_fails_leaves_the_others_exact():
    """sample(failed=...): a row whose own draw raises is reported there; the other rows draw
    exactly what they draw without it (their generators advance the same)."""
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3, 4)] + [SamplingParams(temperature=0.0)]
    logits = torch.cat([logits, logits[:1]])
    want = sample(logits, params, _gens(5))
    gens = _gens(5)
    gens[2] = object()                               # not a generator: its row's draw raises
    failed = {}
    got = sample(logits, params, gens, failed=failed)
    assert list(failed) == [2] and isinstance(failed[2], TypeError)
    assert got[[0, 1, 3, 4]].tolist() == want[[0, 1, 3, 4]].tolist()
    with pytest.raises(TypeError):
        sample(logits, params, gens)


def test_rows_of_one_call_keep_their_own_parameters():
    """Greedy, top-k 1, a tiny top-p and plain sampling side by side in one call: the first
    three are the argmax whatever the generator, the last one varies with its seed."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=1),
              SamplingParams(temperature=1.5, top_p=1e-6), SamplingParams(temperature=2.0)]
    draws = {tuple(sample(logits, params, _gens(4, seed)).tolist()) for seed in range(20)}
    argmax = logits.argmax(-1).tolist()
    assert all(d[:3] == tuple(argmax[:3]) for d in draws)
    assert len({d[3] for d in draws}) > 5
