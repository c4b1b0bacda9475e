"""`fastqwen serve` beyond sampling, on the tiny preset (CPU), through the `openai` client's typed
parsing: log-probabilities in OpenAI's shapes (chat logprobs / top_logprobs, completions logprobs
and echo), equal to the log_softmax of the engine's own logits; JSON-schema output that parses
and satisfies its schema from random weights; a tool call that round-trips; requests without a
grammar keeping exactly their tokens beside ones with a grammar or logprobs; and a 400 naming the
parameter for every bad value of the new fields."""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from serve_live import serving  # noqa: E402

MAX_ECHO = 64              # the server's echo-with-logprobs bound here (its default holds any tiny prompt)


@pytest.fixture(scope="module")
def live(tiny_model):
    from fastqwen.serve.app import Server

    srv = Server(str(tiny_model), max_batch=4, max_model_len=1024, served_model_name="tiny",
                 max_echo_tokens=MAX_ECHO)
    with serving(srv) as url:
        yield srv, url


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[1] + "/v1", api_key="none", max_retries=0)


def _prompt(seed: int, n: int) -> list:
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(srv):
    """A second engine on the server's checkpoint (the server's own is busy in its thread)."""
    from fastqwen.serve.app import engine_module

    cache = _engine.__dict__.setdefault("cache", {})
    if srv.model_dir not in cache:
        cache[srv.model_dir] = engine_module().Engine(srv.model_dir)
    return cache[srv.model_dir]


def _step_logits(srv, prompt, tokens) -> list:
    """The logits before each of `tokens` after `prompt`, through a second engine's public slots
    API (admit_group, then a step a token), no generate."""
    slots = _engine(srv).slots(2, 512)
    logits = [slots.admit_group(["ref"], [prompt], [100])[0]]
    for token in tokens[:-1]:
        logits.append(slots.step({"ref": token})["ref"])
    return logits


# ---- log-probabilities ----------------------------------------------------------------------
def test_greedy_logprobs_are_the_engines_log_softmax(live, client):
    """A greedy completion alone on the server, with echo and logprobs=5: each generated token's
    logprob is the maximum of its top_logprobs and equals the log_softmax of the engine's own
    logits at that step, and each prompt token's is that of the every-position prompt pass:
    both recomputed here through the engine's public slots API (admit_group, step), no generate."""
    srv, _ = live
    prompt = _prompt(3, 23)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=5, echo=True,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    generated = choice.token_ids
    assert len(generated) == 6 and len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + 6
    steps = _step_logits(srv, prompt, generated)
    whole = _engine(srv).slots(2, 512).admit_group(["all"], [prompt + generated[:-1]], [100], all_positions=True)[0]
    for i, token in enumerate(generated):
        want = torch.log_softmax(steps[i].float(), -1)
        got, top = lp.token_logprobs[len(prompt) + i], lp.top_logprobs[len(prompt) + i]
        assert int(want.argmax()) == token
        assert got == max(top.values()) and math.isclose(got, want[token].item(), abs_tol=1e-6), i
        assert len(top) == 5 and sorted(top.values(), reverse=True)[:5] == pytest.approx(
            want.topk(5).values.tolist(), abs=1e-6)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, len(prompt)):
        want = torch.log_softmax(whole[t - 1].float(), -1)[prompt[t]].item()
        assert math.isclose(lp.token_logprobs[t], want, abs_tol=1e-6), t
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert choice.text == srv.codec.decode(prompt, skip_special_tokens=False) + srv.codec.decode(generated)


def test_sampled_logprobs_are_the_raw_logits_log_softmax(live, client):
    """A sampled completion (temperature 0.8, top_k 5): each token's logprob is the log_softmax of
    the model's raw logits at that step (before the temperature and the cut, as vLLM's default),
    recomputed through the engine's slots API over the tokens it drew."""
    srv, _ = live
    prompt = _prompt(5, 17)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.8, seed=4, logprobs=3,
                                    extra_body={"ignore_eos": True, "top_k": 5})
    choice = out.choices[0]
    drawn, lp = choice.token_ids, choice.logprobs
    logits = _step_logits(srv, prompt, drawn)
    picked_other = False
    for i, token in enumerate(drawn):
        raw = torch.log_softmax(logits[i].float(), -1)
        assert math.isclose(lp.token_logprobs[i], raw[token].item(), abs_tol=1e-6), i
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == pytest.approx(raw.topk(3).values.tolist(),
                                                                                      abs=1e-6)
        picked_other |= token != int(raw.argmax())
    assert picked_other                          # sampled: not every token the argmax


def test_completion_logprobs_parse_and_stream_alike(client):
    """The openai client's types take completions' logprobs (with echo), and a stream's chunks
    carry the same tokens, values and offsets as the whole answer."""
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    assert whole.text.startswith("The quick brown fox")
    n_prompt = len(whole.logprobs.tokens) - len(whole.token_ids)
    assert whole.logprobs.token_logprobs[:1] == [None] and all(v is not None for v in whole.logprobs.token_logprobs[1:])
    # the 2 most likely, and the token itself where it is not among them
    assert all(len(top) in (2, 3) for top in whole.logprobs.top_logprobs[1:])
    chunks = list(client.completions.create(**kw, stream=True))
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices[0].logprobs is not None:
            for key in got:
                got[key] += getattr(c.choices[0].logprobs, key)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert got == whole.logprobs.model_dump() and n_prompt == len(chunks[0].choices[0].logprobs.tokens)
    plain = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0,
                                      logprobs=0).choices[0]
    assert plain.text == whole.text[len("The quick brown fox"):] and plain.logprobs.text_offset[0] == 0
    assert [list(t) for t in plain.logprobs.top_logprobs] == [[tok] for tok in plain.logprobs.tokens]


def test_chat_logprobs_parse_and_stream_alike(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Say something."}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == len(whole.token_ids)
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob == item.top_logprobs[0].logprob
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    streamed = [x for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]
    none = client.chat.completions.create(model="tiny", messages=kw["messages"], max_tokens=2).choices[0]
    assert none.logprobs is None


def test_echo_alone_returns_the_prompt(live, client):
    """echo with max_tokens 0: the prompt alone, as OpenAI's legacy API gave it (lm-evaluation-
    harness's loglikelihood_rolling asks this); echo with logprobs is bounded."""
    prompt = _prompt(5, 12)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.token_ids == [] and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == 12 and choice.logprobs.token_logprobs[0] is None
    assert choice.text == live[0].codec.decode(prompt, skip_special_tokens=False)
    text = client.completions.create(model="tiny", prompt="echo me", max_tokens=0, echo=True).choices[0]
    assert text.text == "echo me" and text.logprobs is None
    r = httpx.post(live[1] + "/v1/completions", json={"prompt": _prompt(6, MAX_ECHO + 1), "echo": True,
                                                      "logprobs": 1, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "echo" in r.json()["error"]["message"]
    long = client.completions.create(model="tiny", prompt=_prompt(6, MAX_ECHO + 1), max_tokens=1, echo=True)
    assert len(long.choices[0].token_ids) == 1


# ---- structured output and tools -------------------------------------------------------------
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["name", "age", "color", "tags"]}


def _person(value) -> bool:
    """PERSON's rules, checked by hand (no jsonschema in the environment)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "color", "tags"}
            and isinstance(value["name"], str) and len(value["name"]) <= 10
            and type(value["age"]) is int and 0 <= value["age"] <= 120 and value["color"] in ("red", "green", "blue")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(type(t) is bool for t in value["tags"]))


def _follows(srv, fmt, token_ids) -> bool:
    """Every token of an output (whole or cut by max_tokens) is one the response format's grammar
    allows there: replayed through a fresh matcher of the server's grammars."""
    from fastqwen.serve.grammar import response_format_spec

    matcher = srv.grammars.matcher(response_format_spec(fmt))
    return len(token_ids) > 0 and all(matcher.accept(t) for t in token_ids)


def test_a_json_schema_response_is_schema_valid(live, client):
    """Random weights, greedy and sampled, chat and completions, streaming too: every output
    parses and satisfies the schema, and ends with finish "stop" once the value is whole."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    outs = []
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A person?"}],
                                              max_tokens=200, temperature=temperature, seed=seed, response_format=fmt)
        outs.append((chat.choices[0].message.content, chat.choices[0].finish_reason))
        text = client.completions.create(model="tiny", prompt="Person:", max_tokens=200, temperature=temperature,
                                         seed=seed, extra_body={"response_format": fmt})
        outs.append((text.choices[0].text, text.choices[0].finish_reason))
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Another?"}],
                                            max_tokens=200, temperature=0.7, seed=3, response_format=fmt, stream=True)
    chunks = list(stream)
    outs.append(("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                 chunks[-1].choices[0].finish_reason))
    for text, finish in outs:
        assert finish == "stop" and _person(json.loads(text)), text
    # any object: its keys and strings are unbounded, so random weights may run out of tokens in one;
    # a cut one's tokens are still each one the grammar allowed
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON?"}],
                                         max_tokens=100, temperature=0, response_format={"type": "json_object"})
    text, finish = obj.choices[0].message.content, obj.choices[0].finish_reason
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict)), (text, finish)
    assert _follows(live[0], {"type": "json_object"}, obj.choices[0].token_ids)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def test_a_tool_call_round_trips_through_the_openai_client(live, client):
    """tool_choice "required" forces a call: parsed into tool_calls (finish "tool_calls"), its
    arguments valid under the tool's schema; the assistant message with it and the tool's result
    go back in the next request, which a named tool_choice forces to call that function; a stream
    gives the same call in delta.tool_calls, its arguments in pieces as they are generated."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                           tool_choice="required", max_tokens=300, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.id.startswith("call_") and call.type == "function"
        if call.function.name == "get_weather":
            assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
        else:
            assert call.function.name == "now" and args == {}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "Sunny, 21 C"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                            tool_choice=named, max_tokens=300, temperature=0)
    calls = second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    streamed, pieces = {}, 0
    for c in client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                            tool_choice=named, max_tokens=300, temperature=0, stream=True):
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            pieces += 1
            entry = streamed.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = c.choices[0].finish_reason if c.choices else None
    assert finish == "tool_calls" and pieces > 2       # the name first, then the arguments as they came
    assert [(v["name"], json.loads(v["arguments"])) for v in streamed.values()] == [
        (calls[0].function.name, json.loads(calls[0].function.arguments))]
    # tool_choice "none": the tools stay out of the prompt, and the output is plain content
    plain = client.chat.completions.create(model="tiny", messages=messages[:1], tools=[WEATHER], tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens < first.usage.prompt_tokens and plain.choices[0].message.tool_calls is None


def test_the_tool_call_tags_survive_decoding(tiny_model):
    """The synthetic tokenizer flags the tool-call and thinking tags as Qwen's does (not special),
    so the decoded text the parser reads keeps them; Transformers' AutoTokenizer loads the
    checkpoint's folder offline (lm-evaluation-harness's tokenizer)."""
    from fastqwen.serve.text import TextCodec

    codec = TextCodec(tiny_model)
    text = '<think>hm</think><tool_call>\n{"name": "now"}\n</tool_call><|im_end|>'
    assert codec.decode(codec.encode(text)) == text.replace("<|im_end|>", "")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    assert tok(text).input_ids == codec.encode(text)


def test_requests_without_a_grammar_keep_their_tokens_beside_one(live, client):
    """Greedy requests next to one with a grammar (its steps take the host-synchronised path)
    and one with logprobs get exactly the tokens the engine gives each alone."""
    srv, _ = live
    prompts = [_prompt(11, 30), _prompt(12, 9)]
    n = 24

    def plain(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].token_ids

    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 40}
    fmt = {"type": "json_schema", "json_schema": {"name": "ints", "schema": schema}}
    with ThreadPoolExecutor(4) as pool:
        got = [pool.submit(plain, p) for p in prompts]
        shaped = pool.submit(client.chat.completions.create, model="tiny", max_tokens=120, temperature=0,
                             messages=[{"role": "user", "content": "Numbers."}], response_format=fmt)
        scored = pool.submit(client.completions.create, model="tiny", prompt="abc", max_tokens=n, logprobs=3,
                             temperature=0.8, seed=9)
        got = [f.result() for f in got]
        shaped, scored = shaped.result(), scored.result()
    engine = _engine(srv)
    for p, tokens in zip(prompts, got):
        assert tokens == [s[0] for s in engine.generate([p], n)]
    ints = json.loads(shaped.choices[0].message.content) if shaped.choices[0].finish_reason == "stop" else None
    assert shaped.choices[0].finish_reason == "length" or (isinstance(ints, list) and len(ints) >= 40)
    assert _follows(srv, fmt, shaped.choices[0].token_ids)     # masked at every step, cut or whole
    assert len(scored.choices[0].logprobs.tokens) == len(scored.choices[0].token_ids)


# ---- bad values ------------------------------------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [   # (path, extra fields, param)
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"tools": [WEATHER]}, "tools"),
    ("/v1/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": BAD_SCHEMA}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"tools": {"a": 1}}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ("/v1/chat/completions", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"functions": [WEATHER["function"]]}, "functions"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                                             "arguments": 1}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


def test_bad_values_of_the_new_parameters_name_them(live):
    """Each gets a 400 in OpenAI's shape naming the parameter; the connection goes on; no 5xx."""
    _, url = live
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, extra, param in BAD:
            body = dict(CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 2}, **extra)
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, extra, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == 400 and param.split("[")[0].split(".")[0] in err["message"], \
                (param, err)
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
