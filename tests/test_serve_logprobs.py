"""fastqwen/serve/logprobs.py: log-probabilities as OpenAI and vLLM return them, on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

from fastqwen.serve import logprobs


def test_rows_are_log_softmax_with_the_greedy_token_the_maximum():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 50, generator=g) * 4).to(torch.bfloat16)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1          # a tie at the top: the lower id first
    greedy = logits.float().argmax(-1)
    out = logprobs.rows(logits, greedy, top=5)
    want = torch.log_softmax(logits.float(), -1)
    for r, (lp, top) in enumerate(out):
        assert lp == max(pair[1] for pair in top) == want[r].max().item()
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert all(math.isclose(v, want[r, t].item()) for t, v in top)
    assert [t for t, _ in out[1][1][:2]] == [7, 9]
    sampled = torch.tensor([3, 4, 5])
    assert [lp for lp, _ in logprobs.rows(logits, sampled, top=0)] == [want[r, t].item() for r, t in enumerate([3, 4, 5])]
    assert all(top == [] for _, top in logprobs.rows(logits, sampled, top=0))


@pytest.mark.parametrize("top", [1, 2, 7])
def test_the_top_tokens_are_a_stable_sorts_with_many_ties(top):
    """device_rows' top tokens are a stable descending sort's (value desc, lower id first on
    ties), on bf16 logits (many ties), on rows masked to a few tokens (the rest -inf, fewer than
    `top` finite) and on an all-equal row; their values the log_softmax's."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(5, 300, generator=g) * 2).to(torch.bfloat16).float()
    logits[1] = torch.randint(0, 3, (300,), generator=g).float()         # three values only
    logits[2] = float("-inf")
    logits[2, [250, 7, 99]] = torch.tensor([1.0, 1.0, 0.5])               # a masked row
    logits[3] = 0.0
    tokens = logits.argmax(-1)
    chosen, ids, values = logprobs.device_rows(logits, tokens, top)
    want = torch.log_softmax(logits, -1)
    order = torch.sort(want, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, order.indices[:, :top]) and torch.equal(values, order.values[:, :top])
    assert torch.equal(chosen, want.gather(1, tokens[:, None])[:, 0])
    assert torch.equal(ids[:, 0], tokens)                                 # the greedy token leads


def test_rows_each_keep_their_own_count():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(6))
    out = logprobs.host_rows(*logprobs.device_rows(logits, logits.argmax(-1), 4), tops=[1, 4])
    assert [len(top) for _, top in out] == [1, 4]


def test_a_long_prompt_is_scored_in_pieces():
    """prompt_rows over more rows than it takes at once equals one pass over them all."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 50, (logprobs.PROMPT_ROWS_AT_ONCE * 2 + 5,), generator=g).tolist()
    logits = torch.randn(len(prompt), 50, generator=g)
    out = logprobs.prompt_rows(logits, prompt, top=2)
    assert out[0] is None and out[1:] == logprobs.rows(logits[:-1], torch.tensor(prompt[1:]), 2)


def test_minus_infinity_is_floored_for_json():
    logits = torch.tensor([[0.0, float("-inf")]])
    (lp, top), = logprobs.rows(logits, torch.tensor([1]), top=2)
    assert lp == logprobs.FLOOR and top[1] == (1, logprobs.FLOOR)


def test_a_prompts_own_log_likelihood():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 10, generator=g)
    prompt = [2, 5, 1, 9]
    out = logprobs.prompt_rows(logits, prompt, top=1)
    assert out[0] is None and len(out) == 4
    want = torch.log_softmax(logits, -1)
    assert [lp for lp, _ in out[1:]] == [want[t - 1, prompt[t]].item() for t in range(1, 4)]
    assert logprobs.prompt_rows(logits[:1], [3], top=1) == [None]


def test_token_text_gives_each_tokens_own_bytes(tiny_model):
    from fastqwen.serve.text import TextCodec

    codec = TextCodec(tiny_model)
    text = "Hello, wörld! 東京 <|im_end|> tab\there"
    ids = codec.encode(text)
    tt = logprobs.TokenText(codec.tokenizer)
    assert b"".join(tt.bytes_of(i) for i in ids).decode() == text
    assert any(tt.text_of(i) == "<|im_end|>" for i in ids)


def test_the_two_shapes():
    entries = [None, (-0.5, [(1, -0.5), (2, -1.5)]), (-2.0, [(1, -0.1)])]
    text_of = {1: "a", 2: "bc", 3: "d"}.__getitem__
    out = logprobs.completion_logprobs(text_of, [3, 1, 2], entries)
    assert out == {"tokens": ["d", "a", "bc"], "token_logprobs": [None, -0.5, -2.0],
                   "top_logprobs": [None, {"a": -0.5, "bc": -1.5}, {"a": -0.1, "bc": -2.0}], "text_offset": [0, 1, 2]}

    class Text:
        bytes_of = staticmethod(lambda t: {1: b"a", 2: b"\xe6"}[t])

    chat = logprobs.chat_logprobs(Text(), [2], [(-0.25, [(1, -0.1)])])
    assert chat == {"content": [{"token": "\ufffd", "logprob": -0.25, "bytes": [0xE6],
                                 "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}]}
