"""fastqwen.serve.tools: tools and tool_choice checked into typed values, messages with tool
calls and tool results rendered in Qwen's format, generated text parsed into OpenAI tool_calls
(malformed blocks stay content), and the forced-call grammar that makes even random logits
produce a valid call."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from fastqwen import tokenizer as T
from fastqwen.serve import grammar as G
from fastqwen.serve import tools as TL
from fastqwen.serve.text import TextCodec

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
END = (4094, 4095)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# ---- validation ------------------------------------------------------------------------------

def test_tools_and_tool_choice_become_typed_values():
    ts = TL.tools_from_request({"tools": [WEATHER, CLOCK]})
    assert [t.name for t in ts.tools] == ["get_weather", "now"]
    assert ts.choice == "auto" and ts.parallel and ts.in_prompt and ts.grammar_spec() is None
    assert ts.tools[1].parameters == {"type": "object", "properties": {}}
    assert ts.tools[0].as_openai() == WEATHER
    named = TL.tools_from_request({"tools": [WEATHER, CLOCK], "parallel_tool_calls": False,
                                   "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert (named.choice, named.function, named.parallel) == ("function", "now", False)
    none = TL.tools_from_request({"tools": [WEATHER], "tool_choice": "none"})
    assert not none.in_prompt and none.grammar_spec() is None
    assert TL.tools_from_request({}) is None
    assert TL.tools_from_request({"tools": [], "tool_choice": "auto"}) is None
    assert TL.tools_from_request({"tool_choice": "none"}) is None


@pytest.mark.parametrize("body, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get weather"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
])
def test_bad_tools_name_the_parameter(body, param):
    with pytest.raises(ValueError, match="^" + param.replace(".", r"\.").replace("[", r"\[")) as info:
        TL.tools_from_request(body)
    assert isinstance(info.value, TL.ToolError) and info.value.param == param


# ---- parsing ---------------------------------------------------------------------------------

NAMES = {"get_weather", "now"}


def test_a_well_formed_call_is_parsed():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    out = TL.parse_tool_calls(text, NAMES, new_id=ids())
    assert out.content is None and out.finish_reason == "tool_calls"
    assert out.tool_calls == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_several_calls_and_the_text_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 1}"}\n</tool_call>')
    out = TL.parse_tool_calls(text, NAMES, new_id=ids())
    assert out.content == "Let me check."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == [
        ("call_0", "now", {}), ("call_1", "get_weather", {"city": "Oslo", "days": 1})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "now", "arguments": {}\n</tool_call>',                # unbalanced JSON
    '<tool_call>\nnow()\n</tool_call>',                                          # not JSON
    '<tool_call>\n["now"]\n</tool_call>',                                        # not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',                              # no name
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',             # not a declared tool
    '<tool_call>\n{"name": "now", "arguments": [1]}\n</tool_call>',              # arguments not an object
    '<tool_call>\n{"name": "now", "arguments": "{oops"}\n</tool_call>',          # arguments not JSON
    '<tool_call>\n{"name": "now", "argu',                                        # cut off
    "Plain text, no call at all.",
])
def test_malformed_output_stays_content(text):
    out = TL.parse_tool_calls(text, NAMES)
    assert out.content == text and out.tool_calls == [] and out.finish_reason is None


def test_a_malformed_block_beside_a_good_one_stays_content():
    bad = '<tool_call>\n{"name": "now"\n</tool_call>'
    good = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    out = TL.parse_tool_calls(bad + "\n" + good, NAMES, new_id=ids())
    assert out.content == bad and [c["function"]["name"] for c in out.tool_calls] == ["now"]


def test_a_last_call_the_output_ended_inside_is_kept():
    out = TL.parse_tool_calls('<tool_call>\n{"name": "now", "arguments": {}}', NAMES)
    assert out.content is None and out.tool_calls[0]["function"]["name"] == "now"


def test_call_ids_are_openai_shaped_and_distinct():
    text = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' * 2
    calls = TL.parse_tool_calls(text, NAMES).tool_calls
    assert len({c["id"] for c in calls}) == 2
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["id"][5:].isalnum() for c in calls)


def _streamed(stream, text, step=1):
    """text pushed `step` characters at a time: (content sent, call deltas, finish's result)."""
    content, deltas = [], []
    for i in range(0, len(text), step):
        c, d = stream.push(text[i:i + step])
        content.append(c)
        deltas.extend(d)
    rest, last, reason = stream.finish()
    return "".join(content) + (rest or ""), deltas + last, reason


def _joined(deltas):
    """OpenAI's client-side accumulation of streamed tool-call deltas by index."""
    calls = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = d.get("id", call["id"])
        call["name"] = d.get("function", {}).get("name", call["name"])
        call["arguments"] += d.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_stream_sends_text_then_each_calls_name_then_its_arguments_as_they_come(step):
    args = '{"city": "Pa\\"ris}", "days": {"n": 3}}'
    text = ('Sure <b>.\n<tool_call>\n{"name": "get_weather", "arguments": ' + args + '}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    content, deltas, reason = _streamed(TL.ToolStream(NAMES, new_id=ids()), text, step)
    assert content == "Sure <b>.\n"               # a '<' that is no tag goes out, the tag never
    assert reason == "tool_calls"
    calls = _joined(deltas)
    assert [(c["id"], c["name"]) for c in calls] == [("call_0", "get_weather"), ("call_1", "now")]
    assert json.loads(calls[0]["arguments"]) == json.loads(args) and json.loads(calls[1]["arguments"]) == {}
    # the same calls as the whole output parsed at once
    whole = TL.parse_tool_calls(text, NAMES, new_id=ids()).tool_calls
    assert [json.loads(c["function"]["arguments"]) for c in whole] == [json.loads(c["arguments"]) for c in calls]
    if step == 1:       # the header before any argument; arguments in many pieces
        first = [d for d in deltas if d["index"] == 0]
        assert first[0]["function"] == {"name": "get_weather", "arguments": ""} and len(first) > 5


def test_a_stream_holds_a_block_of_another_shape_and_parses_it_whole():
    # "arguments" before "name": no streaming, the call whole at the block's end
    text = '<tool_call>{"arguments": {"x": 1}, "name": "now"}</tool_call>'
    content, deltas, reason = _streamed(TL.ToolStream(NAMES, new_id=ids()), text)
    assert content == "" and reason == "tool_calls"
    assert deltas == [{"index": 0, "id": "call_0", "type": "function",
                       "function": {"name": "now", "arguments": '{"x": 1}'}}]
    # a block that is no call of a known function stays content
    text = 'a <tool_call>{"name": "nope", "arguments": {}}</tool_call> b'
    content, deltas, reason = _streamed(TL.ToolStream(NAMES), text)
    assert content == text and deltas == [] and reason is None
    # a partial tag at the end is content
    content, deltas, reason = _streamed(TL.ToolStream(NAMES), "x <tool")
    assert content == "x <tool" and reason is None


def test_a_stream_cut_inside_a_call_still_names_it():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, deltas, reason = _streamed(TL.ToolStream(NAMES, new_id=ids()), text)
    assert reason == "tool_calls" and _joined(deltas)[0]["arguments"] == '{"city": "Pa'


# ---- messages --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    T.write(folder, 4096, 4094, 4095)
    return TextCodec(folder)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "12:00"}]},
]

# Qwen3's chat template renders CONVERSATION with tools [WEATHER, CLOCK] to this.
QWEN_PROMPT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER) + "\n"
    + json.dumps({"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                                 "properties": {}}}})
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
    "\"days\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    "<|im_end|>\n<|im_start|>assistant\n")


def test_a_plain_chatml_template_gets_qwens_tool_format(codec):
    """fastqwen synth's template is plain ChatML: the tools, calls and results are written into
    the messages so the prompt is the text Qwen3's own template would give."""
    assert not TL.template_knows_tools(codec.chat_template)
    ts = TL.tools_from_request({"tools": [WEATHER, CLOCK]})
    messages, kwargs = TL.prepare_messages(json.loads(json.dumps(CONVERSATION)), ts, codec.chat_template)
    assert kwargs == {}
    assert codec.render_chat(messages, **kwargs) == QWEN_PROMPT


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(codec):
    ts = TL.tools_from_request({"tools": [WEATHER], "tool_choice": "none"})
    messages, kwargs = TL.prepare_messages([{"role": "user", "content": "hi"}], ts, codec.chat_template)
    assert "<tools>" not in codec.render_chat(messages, **kwargs)


# A template that renders tools itself, as Qwen's does: it gets them as Transformers passes them.
TOOL_TEMPLATE = (
    "{%- if tools %}TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}{{ m.role }}:{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %} <tool_call>{{ c.function.name }}"
    "{{ c.function.arguments }}{% endfor %}{% endif %}"
    "{%- if m.role == 'tool' %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
)


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them(codec):
    assert TL.template_knows_tools(TOOL_TEMPLATE)
    ts = TL.tools_from_request({"tools": [WEATHER, CLOCK]})
    messages, kwargs = TL.prepare_messages(json.loads(json.dumps(CONVERSATION)), ts, TOOL_TEMPLATE)
    assert kwargs == {"tools": [WEATHER, {"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}]}
    saved = codec.chat_template, codec._template
    codec.chat_template, codec._template = TOOL_TEMPLATE, None
    try:
        text = codec.render_chat(messages, add_generation_prompt=False, **kwargs)
    finally:
        codec.chat_template, codec._template = saved
    assert text == ("TOOLS get_weather now\nsystem:Be brief.\nuser:Weather in Paris and the time?\n"
                    'assistant: <tool_call>get_weather{"city": "Paris", "days": 1} <tool_call>now{}\n'
                    "tool:Sunny(call_a)\ntool:12:00(call_b)\n")


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c", "content": 3}, "messages[0].content"),
    ({"role": "assistant", "tool_calls": "now"}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "now", "arguments": 1}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_messages_name_the_field(message, param):
    with pytest.raises(ValueError, match="^" + param.replace(".", r"\.").replace("[", r"\[")) as info:
        TL.prepare_messages([message], None, None)
    assert info.value.param == param


# ---- forced calls ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grammars():
    return G.Grammars(T.build(4096, 4094, 4095), 4096)


def _generate(grammars, spec, runs: int, seed: int) -> list:
    """Texts from random logits under spec's grammar (every run must end)."""
    compiled = grammars.compile(spec)
    gen = torch.Generator().manual_seed(seed)
    bitmask = grammars.new_bitmask(1)
    texts = []
    for _ in range(runs):
        m, out = grammars.matcher(compiled), []
        while not m.is_terminated():
            assert len(out) < 400
            grammars.fill([m], bitmask)
            logits = G.apply_masks(torch.randn(1, 4096, generator=gen) * 4, bitmask)
            t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            assert m.accept(t)
            if t not in END:
                out.append(t)
        texts.append(grammars.tokenizer.decode(out, skip_special_tokens=False))
    return texts


def _weather_ok(args: dict) -> bool:
    return set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and args["days"] in range(1, 8)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_forces_valid_calls_even_from_random_logits(grammars, parallel):
    ts = TL.tools_from_request({"tools": [WEATHER, CLOCK], "tool_choice": "required",
                                "parallel_tool_calls": parallel})
    counts = set()
    for text in _generate(grammars, ts.grammar_spec(), runs=6, seed=int(parallel)):
        out = TL.parse_tool_calls(text, ts.names)
        assert out.content is None and out.tool_calls, text
        counts.add(len(out.tool_calls))
        for call in out.tool_calls:
            args = json.loads(call["function"]["arguments"])
            assert args == {} if call["function"]["name"] == "now" else _weather_ok(args), text
    assert counts == ({1, 2} if parallel else {1})        # several calls in a turn only with parallel


def test_a_named_function_forces_one_call_of_it(grammars):
    ts = TL.tools_from_request({"tools": [CLOCK, WEATHER],
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    for text in _generate(grammars, ts.grammar_spec(), runs=4, seed=3):
        out = TL.parse_tool_calls(text, ts.names)
        assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"], text
        assert _weather_ok(json.loads(out.tool_calls[0]["function"]["arguments"]))


def test_the_forced_call_starts_with_the_tool_call_token(grammars):
    ts = TL.tools_from_request({"tools": [CLOCK], "tool_choice": "required"})
    m = grammars.matcher(ts.grammar_spec())
    assert m.allowed_mask().nonzero().flatten().tolist() == [grammars.tokenizer.token_to_id("<tool_call>")]


def test_a_tool_schema_the_library_refuses_names_the_tool(grammars):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}
    named = TL.tools_from_request({"tools": [CLOCK, bad], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters: .*uniqueItems") as info:
        grammars.compile(named.grammar_spec())
    assert info.value.param == "tools[1].function.parameters"
    required = TL.tools_from_request({"tools": [CLOCK, bad], "tool_choice": "required"})
    with pytest.raises(ValueError, match=r"^tools: "):
        grammars.compile(required.grammar_spec())
