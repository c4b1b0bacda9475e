"""Structured output for the serving front: OpenAI's `response_format` (and the forced tool
calls of tools.py) as a token grammar that masks the logits every step.

The grammar library is llguidance (chosen by measurement: results/bench_grammar.json); nothing
outside this module names it. The interface:

- `response_format_spec(value)` checks a request's `response_format` into a `GrammarSpec`
  (None for text), raising `GrammarError` (a ValueError whose message and `.param` name the
  parameter) for a bad one.
- `Grammars` belongs to one tokenizer and one logits width (the model's vocab_size, which may
  exceed the tokenizer's); `compile(spec)` checks and compiles a spec (cached, bounded, thread
  safe: call it where the request is validated, so a schema the library refuses is a 400);
  `matcher(compiled)` starts one request's `Matcher`.
- Per step: `Grammars.fill(matchers, bitmask)` writes row i of a CPU int32 bitmask (one bit a
  token, 32 tokens a word, as `new_bitmask` allocates) for the batch's row i: the tokens its
  matcher allows, or every token where the row has none; `apply_masks(logits, bitmask, rows)`
  sets every disallowed logit to -inf on the logits' device (only `rows`, when given), so
  greedy and sampled decoding both obey it; after sampling, `Matcher.accept(token)`.
- End tokens: once the value is complete only the end tokens (`Grammars.end_token_ids`: the
  tokenizer's <|im_end|> and <|endoftext|>, plus any the server passes) are allowed, and
  accepting one terminates the matcher. An end token is never allowed before that.

Threads: `compile` may run on any thread (the cache has a lock); a Matcher is used by one
thread at a time; `fill` computes the rows on the library's own threads.

JSON is generated with at most one space, or one line break and an indent, between tokens
(WHITESPACE), and an object schema that lists `properties` but says nothing of
`additionalProperties` is generated without extra properties (OpenAI's strict mode; the output
is still valid under the schema as written).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

# Whitespace between JSON tokens: none, one space, or one line break and an indent (json.dumps'
# compact, default and indented forms all fit; a model cannot stall in whitespace).
WHITESPACE = r"(\x20|\x0D?\x0A[\x20\x09]{0,32})?"
CACHE_SIZE = 256                    # compiled grammars kept per tokenizer (least recently used go)
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class GrammarError(ValueError):
    """A response_format (or tool schema) the server cannot constrain to; `param` is the
    request parameter it names, for OpenAI's error object."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain the output to. kind: "json_object" (any JSON object), "json_schema"
    (`schema`, its JSON text) or "tool_calls" (`schema` describes one call's
    {"name", "arguments"} object; the output is <tool_call>\\n{call}\\n</tool_call>, one or,
    with `repeat`, several separated by a newline). `param` names the request parameter the
    spec came from, for errors."""
    kind: str
    schema: str = ""
    repeat: bool = False
    param: str = "response_format"


def response_format_spec(value) -> GrammarSpec | None:
    """A request's response_format checked into a spec; None for absent or {"type": "text"}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise GrammarError(f"response_format must be an object, got {value!r}"[:200], "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise GrammarError("response_format.type must be one of 'text', 'json_object', 'json_schema', "
                           f"got {kind!r}"[:200], "response_format.type")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise GrammarError("response_format.json_schema must be an object with name and schema, "
                           f"got {js!r}"[:200], "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise GrammarError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-', "
                           f"got {name!r}"[:200], "response_format.json_schema.name")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarError(f"response_format.json_schema.strict must be true or false, got {strict!r}"[:200],
                           "response_format.json_schema.strict")
    schema = js.get("schema")
    if schema is None:                       # OpenAI's schema is optional: any JSON object then
        return GrammarSpec("json_object", param="response_format.json_schema.schema")
    return GrammarSpec("json_schema", schema_text(schema, "response_format.json_schema.schema"),
                       param="response_format.json_schema.schema")


def schema_text(schema, param: str) -> str:
    """A JSON schema (an object, or true) as JSON text, the keys in the request's order (the
    order properties are generated in)."""
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError(f"{param} is false: no value satisfies it", param)
    if not isinstance(schema, dict):
        raise GrammarError(f"{param} must be a JSON schema object, got {schema!r}"[:200], param)
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"{param} is not JSON: {exc}", param) from None


def _closed(schema):
    """schema with additionalProperties: false on every object schema that lists properties and
    says nothing of extra ones (OpenAI's strict mode; allOf members are left open, as closing
    them would refuse the other members' properties)."""
    def walk(node, in_all_of=False):
        if isinstance(node, list):
            return [walk(n, in_all_of) for n in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, sub in node.items():
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                out[key] = {k: walk(v) for k, v in sub.items()} if isinstance(sub, dict) else sub
            elif key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "not", "if", "then",
                         "else", "contains", "additionalItems", "unevaluatedItems", "propertyNames"):
                out[key] = walk(sub)
            elif key == "allOf":
                out[key] = walk(sub, in_all_of=True)
            else:
                out[key] = sub
        if ("properties" in out and not in_all_of and not {"additionalProperties", "unevaluatedProperties",
                                                              "patternProperties"} & set(out)):
            out["additionalProperties"] = False
        return out
    return walk(schema)


def _grammar_text(spec: GrammarSpec, tokenizer) -> str:
    """The llguidance grammar for spec. The tool-call tags are named as tokens where the
    tokenizer has them as added tokens (Qwen's), as literal text otherwise."""
    import llguidance

    ws = {"whitespace_pattern": WHITESPACE}
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=ws)
    schema = _closed(json.loads(spec.schema))
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=ws)
    if spec.kind == "tool_calls":
        schema = dict(schema, **{"x-guidance": ws})
        calls = 'call ("\\n" call)*' if spec.repeat else "call"
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        tag_open, tag_close = (tag if tag in added else json.dumps(tag) for tag in ("<tool_call>", "</tool_call>"))
        lark = (f"start: {calls}\n"
                f'call: {tag_open} "\\n" body "\\n" {tag_close}\n'
                f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}", spec.param)


class Compiled:
    """A compiled grammar: a matcher at the start state that each request's matcher copies
    (copies share the grammar and its lexer cache)."""

    def __init__(self, spec: GrammarSpec, template):
        self.spec, self._template = spec, template


class Matcher:
    """One request's position in its grammar. Used by one thread at a time (the scheduler's)."""

    def __init__(self, grammars: "Grammars", inner):
        self._grammars, self._m = grammars, inner

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the tokens allowed next into bitmask[row] (a CPU int32 row of Grammars.words
        words). A terminated or failed matcher allows only the end tokens."""
        target = bitmask[row]
        if self._m.is_error() or self._m.is_stopped():
            target.zero_()
            for t in self._grammars.end_token_ids:
                target[t // 32] |= _bit(t % 32)
            return
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def allowed_mask(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The allowed tokens as a bool tensor of vocab_size (for tests and slow paths)."""
        bitmask = self._grammars.new_bitmask(1, pin=False)
        self.fill_mask(bitmask)
        allowed = unpack(bitmask, self._grammars.vocab_size)[0]
        if out is not None:
            out.copy_(allowed)
            return out
        return allowed

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and the matcher failed) if the grammar does not
        allow it, which a masked sample never is."""
        return bool(self._m.consume_token(int(token_id)))

    def is_terminated(self) -> bool:
        """The output is complete: an end token was accepted, or nothing but an end token can
        follow (the request may finish here, reason "stop", without sampling one)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


def _bit(i: int) -> int:
    """Bit i of an int32 word as a Python int in the int32 range."""
    return -(1 << 31) if i == 31 else 1 << i


_SHIFTS: dict = {}


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A [rows, words] int32 bitmask as a [rows, vocab_size] bool tensor on its device."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows=None) -> torch.Tensor:
    """Set logits[i, t] to -inf wherever bitmask[i] does not allow token t, for every row i of
    logits or only those in `rows` (in place; returns logits). logits: [n, vocab] on any device;
    bitmask: [>= n, words] int32, row i for logits row i (a CPU one is copied over)."""
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words covers {bitmask.shape[-1] * 32} tokens, "
                         f"the logits have {vocab}")
    if rows is None:
        mask = to_device(bitmask[:logits.shape[0]], logits.device)
        logits.masked_fill_(~unpack(mask, vocab), float("-inf"))
        return logits
    index = torch.as_tensor(list(rows), dtype=torch.long)
    if len(index):
        mask = to_device(bitmask[index.to(bitmask.device)], logits.device)
        index = to_device(index, logits.device)
        logits[index] = logits[index].masked_fill(~unpack(mask, vocab), float("-inf"))
    return logits


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a CPU tensor on `device`, made without the host waiting for the device's queued
    work (a plain .to() waits for the stream: a step in flight), from a pinned copy of its own
    (the caller may change `tensor` at once)."""
    if device.type != "cuda":
        return tensor.to(device, copy=True)
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
    return staged.to(device, non_blocking=True)


class Grammars:
    """Grammars for one tokenizer and one logits width.

    tokenizer: a tokenizers.Tokenizer, a tokenizer.json path, or a checkpoint folder holding one;
    vocab_size: the model's logits width (ids past the tokenizer's are never allowed);
    end_token_ids: the tokens that may end a constrained output, added to the tokenizer's
    <|im_end|> and <|endoftext|>. The library's tokenizer view (about a second for a 150k
    vocabulary) is built on first use; `prepare()` builds it ahead."""

    def __init__(self, tokenizer, vocab_size: int, end_token_ids=(), cache_size: int = CACHE_SIZE,
                 threads: int | None = None):
        from tokenizers import Tokenizer

        if isinstance(tokenizer, (str, os.PathLike)):
            path = pathlib.Path(tokenizer)
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        ends = set(int(t) for t in end_token_ids)
        ends.update(i for i in (tokenizer.token_to_id(t) for t in END_TOKENS) if i is not None)
        if not ends:
            raise ValueError("no end tokens: the tokenizer has neither <|im_end|> nor <|endoftext|> and none were given")
        if max(ends) >= self.vocab_size:
            raise ValueError(f"end token {max(ends)} is outside the vocabulary of {self.vocab_size}")
        self.end_token_ids = tuple(sorted(ends))
        self.words = (self.vocab_size + 31) // 32
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._lltok = None
        self._executor = None
        self._threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))

    @classmethod
    def for_codec(cls, codec, vocab_size: int, **kwargs) -> "Grammars":
        """Grammars for a serve TextCodec (its tokenizer; its stop tokens end an output too)."""
        return cls(codec.tokenizer, vocab_size, end_token_ids=codec.stop_token_ids, **kwargs)

    def prepare(self) -> "Grammars":
        """Build the library's view of the tokenizer now (otherwise the first compile does)."""
        import llguidance

        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=list(self.end_token_ids))
                self._executor = llguidance.LLExecutor(num_threads=self._threads)
        return self

    def compile(self, spec: GrammarSpec) -> Compiled:
        """spec compiled (cached per spec, least recently used dropped past the bound); a
        GrammarError naming spec.param for a schema the library refuses."""
        import llguidance

        key = (spec.kind, spec.schema, spec.repeat)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        self.prepare()
        try:
            grammar = _grammar_text(spec, self.tokenizer)
        except ValueError as exc:
            raise GrammarError(f"{spec.param}: {exc}"[:500], spec.param) from None
        template = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"{spec.param}: {_short(template.get_error())}", spec.param)
        compiled = Compiled(spec, template)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Compiled | GrammarSpec) -> Matcher:
        """A new request's matcher at the grammar's start."""
        if isinstance(compiled, GrammarSpec):
            compiled = self.compile(compiled)
        return Matcher(self, compiled._template.deep_copy())

    def new_bitmask(self, rows: int, pin: bool | None = None) -> torch.Tensor:
        """A CPU int32 bitmask of rows x words, every token allowed (pinned where CUDA is, so
        apply_masks' copy does not wait)."""
        pin = torch.cuda.is_available() if pin is None else pin
        return torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=pin)

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        """bitmask[i]: the tokens matchers[i] allows, or every token where matchers[i] is None
        (rows past len(matchers) are left as they are); the rows are computed in parallel on
        the library's threads."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous() \
                or bitmask.shape[-1] != self.words or bitmask.shape[0] < len(matchers):
            raise ValueError(f"bitmask must be a contiguous CPU int32 tensor of at least {len(matchers)} x "
                             f"{self.words}, got {tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}")
        live = []
        for i, m in enumerate(matchers):
            if m is None:
                bitmask[i].fill_(-1)
            elif m._m.is_error() or m._m.is_stopped():
                m.fill_mask(bitmask, i)
            else:
                live.append((m._m, i))
        if len(live) == 1:
            matcher, i = live[0]
            row = bitmask[i]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        elif live:
            self.prepare()
            self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])


def _short(message: str) -> str:
    """The library's error without its parser-state dump."""
    return " ".join(message.split())[:300] if message else "the grammar library refused it"

