"""fastqwen.serve.grammar: response_format checked into a grammar, masks that allow exactly the
grammar's next tokens, only end tokens once the value is complete, masks applied to a batch of
logits rows, and random-logits generation that always yields schema-valid JSON."""
from __future__ import annotations

import json

import pytest
import regex
import torch

from fastqwen import tokenizer as T
from fastqwen.serve import grammar as G

VOCAB = 4096
END = (4094, 4095)          # <|endoftext|>, <|im_end|> in the tiny layout


@pytest.fixture(scope="module")
def tok():
    return T.build(VOCAB, 4094, 4095)


@pytest.fixture(scope="module")
def grammars(tok):
    return G.Grammars(tok, VOCAB)


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet (the tokenizer's symbols) back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_bytes(tok) -> list:
    """Each id's bytes; None for the special tokens (never text)."""
    dec = _byte_decoder()
    special = set(tok.get_added_tokens_decoder())
    return [None if i in special else bytes(dec[c] for c in tok.id_to_token(i)) for i in range(VOCAB)]


def spec(schema) -> G.GrammarSpec:
    return G.response_format_spec({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})


WS = rb"(?: |\r?\n[ \t]{0,32})?"          # grammar.WHITESPACE
SMALL = {"type": "object",
         "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 20},
                        "ok": {"type": "boolean"}},
         "required": ["color", "n", "ok"]}
SMALL_LANGUAGE = regex.compile(
    rb"\{WS\"color\"WS:WS(?:\"red\"|\"green\")WS,WS\"n\"WS:WS(?:[0-9]|1[0-9]|20)WS,WS\"ok\"WS:WS(?:true|false)WS\}"
    .replace(b"WS", WS))


@pytest.mark.parametrize("doc", ['{"color": "green", "n": 17, "ok": false}',
                                 '{\n  "color": "red",\n  "n": 0,\n  "ok": true\n}'])
def test_the_mask_allows_exactly_the_grammars_next_tokens(tok, grammars, doc):
    """At every step of a document, the allowed tokens are those whose bytes extend the output
    towards a document of the schema's language (written out as a regex here, with the module's
    whitespace rule and no extra properties), and the end tokens only once it is whole. Where
    the grammar forces the next bytes, the library allows only their canonical tokens (the
    ones the tokenizer would produce), a non-empty subset."""
    table = _token_bytes(tok)
    m = grammars.matcher(grammars.compile(spec(SMALL)))
    ids = tok.encode(doc, add_special_tokens=False).ids
    prefix, choices = b"", 0
    for step, token in enumerate(ids + [END[1]]):
        want = {i for i, b in enumerate(table) if b and SMALL_LANGUAGE.fullmatch(prefix + b, partial=True)}
        whole = SMALL_LANGUAGE.fullmatch(prefix) is not None
        if whole:
            want |= set(END)
        got = set(m.allowed_mask().nonzero().flatten().tolist())
        next_bytes = {b for b in range(256) if SMALL_LANGUAGE.fullmatch(prefix + bytes([b]), partial=True)}
        if len(next_bytes) + whole > 1:
            assert got == want, (step, prefix, sorted(got ^ want)[:10])
            choices += 1
        else:
            assert got and got <= want, (step, prefix, sorted(got - want)[:10])
        assert m.accept(token)
        prefix += table[token] or b""
    assert m.is_terminated()
    assert choices >= 8

def test_end_tokens_come_only_after_the_value(tok, grammars):
    """A value that could go on (an integer's digits) allows its next tokens and the end tokens;
    one that cannot is terminated, only the end tokens allowed."""
    m = grammars.matcher(grammars.compile(spec({"type": "array", "items": {"type": "integer"}})))
    for t in tok.encode("[12", add_special_tokens=False).ids:
        assert not m.allowed_mask()[list(END)].any()
        assert m.accept(t)
    for t in tok.encode("]", add_special_tokens=False).ids:
        assert m.accept(t)
    assert m.is_terminated()
    assert m.allowed_mask().nonzero().flatten().tolist() == list(END)
    assert m.accept(END[1]) and m.is_terminated()

    m = grammars.matcher(grammars.compile(spec({"type": "integer"})))
    assert m.accept(tok.encode("7", add_special_tokens=False).ids[0])
    allowed = m.allowed_mask()
    assert allowed[list(END)].all() and allowed[tok.encode("3", add_special_tokens=False).ids[0]]
    assert not m.is_terminated()
    assert m.accept(END[0]) and m.is_terminated()


def test_a_refused_token_leaves_only_the_end_tokens(tok, grammars):
    """A token outside the mask (never sampled from masked logits) fails the matcher; its mask
    then lets the request end rather than run on unconstrained."""
    m = grammars.matcher(grammars.compile(G.GrammarSpec("json_object")))
    assert not m.accept(tok.encode("x", add_special_tokens=False).ids[0])
    assert m.error
    assert m.allowed_mask().nonzero().flatten().tolist() == list(END)


def test_json_object_starts_an_object(tok, grammars):
    allowed = grammars.matcher(G.response_format_spec({"type": "json_object"})).allowed_mask()
    texts = [tok.decode([i]) for i in allowed.nonzero().flatten().tolist()]
    assert texts and all(t.startswith("{") for t in texts)


def test_ids_past_the_tokenizer_are_never_allowed(tok):
    """The model's logits may be wider than the tokenizer (Qwen3-4B: 151,936 rows, 151,669 tokens)."""
    wide = G.Grammars(tok, VOCAB + 64)
    m = wide.matcher(wide.compile(G.GrammarSpec("json_object")))
    for t in tok.encode('{"a": [1, "b"]}', add_special_tokens=False).ids:
        assert not m.allowed_mask()[VOCAB:].any()
        assert m.accept(t)
    logits = torch.zeros(1, VOCAB + 64)
    bitmask = wide.new_bitmask(1)
    wide.fill([m], bitmask)
    G.apply_masks(logits, bitmask)
    assert torch.isinf(logits[0, VOCAB:]).all()


def test_apply_masks_sets_disallowed_logits_to_minus_inf_on_the_given_rows(grammars):
    words = grammars.words
    bitmask = torch.zeros(3, words, dtype=torch.int32)
    bitmask[0, 0] = 0b101                 # row 0: tokens 0 and 2
    bitmask[2, words - 1] = G._bit(31)    # row 2: the last token of the last word
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    G.apply_masks(logits, bitmask, rows=[0, 2])
    finite = torch.isfinite(logits)
    assert finite[0].nonzero().flatten().tolist() == [0, 2]
    assert torch.equal(logits[0, [0, 2]], before[0, [0, 2]])
    assert torch.equal(logits[1], before[1])                       # not a masked row
    assert finite[2].nonzero().flatten().tolist() == [words * 32 - 1]
    G.apply_masks(logits, bitmask)
    assert not torch.isfinite(logits[1]).any()


def test_fill_allows_every_token_on_rows_without_a_matcher(tok, grammars):
    bitmask = torch.zeros(3, grammars.words, dtype=torch.int32)
    m = grammars.matcher(G.GrammarSpec("json_object"))
    grammars.fill([None, m], bitmask)
    assert (bitmask[0] == -1).all()
    assert torch.equal(G.unpack(bitmask[1:2], VOCAB)[0], m.allowed_mask())
    assert (bitmask[2] == 0).all()                                 # past the matchers: untouched
    logits = G.apply_masks(torch.zeros(2, VOCAB), bitmask)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[1]).sum() == m.allowed_mask().sum()


PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                         "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                                  "legs": {"type": "integer", "minimum": 0,
                                                                           "maximum": 4}},
                                 "required": ["kind"]}},
          "required": ["name", "age", "color", "tags"]}


def _valid(value) -> bool:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        return jsonschema.Draft202012Validator(PERSON).is_valid(value)
    ok = (isinstance(value, dict) and {"name", "age", "color", "tags"} <= set(value)
          and set(value) <= {"name", "age", "color", "tags", "pet"}
          and isinstance(value["name"], str) and len(value["name"]) <= 12
          and type(value["age"]) is int and 0 <= value["age"] <= 120
          and value["color"] in ("red", "green", "blue")
          and isinstance(value["tags"], list) and len(value["tags"]) <= 3
          and all(isinstance(t, str) and len(t) <= 6 for t in value["tags"]))
    pet = value.get("pet") if isinstance(value, dict) else None
    if ok and pet is not None:
        ok = (isinstance(pet, dict) and pet.get("kind") in ("cat", "dog") and set(pet) <= {"kind", "legs"}
              and ("legs" not in pet or (type(pet["legs"]) is int and 0 <= pet["legs"] <= 4)))
    return ok


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_random_logits_under_a_schema_always_give_valid_json(tok, grammars, greedy):
    """Eight requests at a time, random logits masked by one batched fill; every output ends
    (the schema is bounded) and parses into a value the schema accepts."""
    compiled = grammars.compile(spec(PERSON))
    gen = torch.Generator().manual_seed(1 if greedy else 2)
    bitmask = grammars.new_bitmask(8)
    outputs = []
    for _ in range(2):
        matchers = [grammars.matcher(compiled) for _ in range(8)]
        ids = [[] for _ in range(8)]
        for _ in range(600):
            live = [m if not m.is_terminated() else None for m in matchers]
            if not any(live):
                break
            grammars.fill(live, bitmask)
            logits = torch.randn(8, VOCAB, generator=gen) * 4
            G.apply_masks(logits, bitmask)
            tokens = (logits.argmax(-1) if greedy else
                      torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]).tolist()
            for m, out, t in zip(live, ids, tokens):
                if m is not None:
                    assert m.accept(t)
                    if t not in END:
                        out.append(t)
        assert all(m.is_terminated() for m in matchers)
        outputs += [tok.decode(out) for out in ids]
    for text in outputs:
        assert _valid(json.loads(text)), text


@pytest.mark.parametrize("value, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes", "schema": {}}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": "object"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": False}}, "response_format.json_schema.schema"),
])
def test_a_bad_response_format_names_the_parameter(value, param):
    with pytest.raises(ValueError, match=param.replace(".", r"\.")) as info:
        G.response_format_spec(value)
    assert isinstance(info.value, G.GrammarError) and info.value.param == param


@pytest.mark.parametrize("schema, why", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),           # invalid
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),                          # unsupported
    ({"type": "string", "pattern": "[a-"}, "regex"),                                  # invalid pattern
    ({"type": "integer", "minimum": 5, "maximum": 1}, "nsatisfiable"),                # no value
    ({"$ref": "https://example.com/s.json"}, "example.com"),                          # remote reference
])
def test_a_schema_the_library_refuses_names_the_schema(grammars, schema, why):
    s = spec(schema)
    with pytest.raises(ValueError, match=r"^response_format\.json_schema\.schema: .*" + why) as info:
        grammars.compile(s)
    assert info.value.param == "response_format.json_schema.schema"


def test_text_and_absent_formats_are_unconstrained():
    assert G.response_format_spec(None) is None
    assert G.response_format_spec({"type": "text"}) is None
    assert G.response_format_spec({"type": "json_schema", "json_schema": {"name": "a"}}).kind == "json_object"


def test_extra_properties_are_closed_unless_the_schema_opens_them():
    closed = G._closed({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
                        "$defs": {"d": {"properties": {"x": {}}, "additionalProperties": True}},
                        "allOf": [{"properties": {"c": {}}}]})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["allOf"][0]
    assert "additionalProperties" not in G._closed({"type": "object"})


def test_compiled_grammars_are_cached_with_a_bound(tok):
    small = G.Grammars(tok, VOCAB, cache_size=2)
    a = small.compile(spec({"enum": ["a"]}))
    assert small.compile(spec({"enum": ["a"]})) is a
    small.compile(spec({"enum": ["b"]}))
    small.compile(spec({"enum": ["c"]}))
    assert len(small._cache) == 2
    assert small.compile(spec({"enum": ["a"]})) is not a


def test_built_from_a_checkpoint_folder_with_its_end_tokens(tmp_path):
    T.write(tmp_path, VOCAB, 4094, 4095)
    g = G.Grammars(tmp_path, VOCAB, end_token_ids=[7])
    assert g.end_token_ids == (7, 4094, 4095)
    m = g.matcher(spec({"const": 1}))
    assert m.accept(g.tokenizer.token_to_id("1"))
    assert m.allowed_mask().nonzero().flatten().tolist() == [7, 4094, 4095]
