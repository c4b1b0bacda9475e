"""Sampling for the serving front: per-request parameters, checked as the OpenAI API names
them, and one sampler over a batch of logits rows where each row has its own parameters and
its own seeded generator on the logits' device.

Conventions (OpenAI's and vLLM's): temperature 0 is greedy (the argmax, first index on ties,
as the engine's greedy decode and Transformers pick); otherwise the logits (fp32) are divided
by the temperature, cut to the top_k largest (top_k 0 or -1: no cut), then to the smallest set
of tokens whose probabilities reach top_p (the most likely token always stays), and one token
is drawn from the softmax of what is left with the request's generator. A request with a
seed draws the same tokens every time; without one its generator is seeded from the
server's own.

Every field is read through `Fields`, which returns a typed, range-checked value or raises
SamplingError naming the field: nothing a client sends reaches the scheduler unchecked. A new
parameter is a dataclass field and one line in `from_request` (and out of `UNSUPPORTED` if it
was listed there).
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field

import torch

from fastqwen.serve.logprobs import MAX_TOP_LOGPROBS

MAX_STOP = 4
# OpenAI's and vLLM's range for `seed` (a signed 64-bit integer); torch's manual_seed takes all of it.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1
# Parameters the server does not implement, each with the values that ask for nothing (accepted
# and ignored, as clients send them by default); any other value is a 400 naming the parameter.
UNSUPPORTED = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "best_of": (1,), "suffix": ("",), "min_p": (0,), "min_tokens": (0,), "stop_token_ids": ([],),
}
# ... and those of one endpoint only (the other endpoint's logprobs fields: chat's top_logprobs is
# completions' logprobs; vLLM's chat echo repeats the last message, which this server does not)
UNSUPPORTED_CHAT = {"echo": (False,)}
UNSUPPORTED_COMPLETIONS = {"top_logprobs": (0,)}


class SamplingError(ValueError):
    """A request parameter outside what the server accepts; the message names it and its value,
    `param` is its name."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def show(value, most: int = 80) -> str:
    """A client's value in an error message, as JSON, cut short; its cost bounded whatever the
    value's size or depth."""
    def head(v, depth):
        if isinstance(v, str):
            return v[:most + 1]
        if isinstance(v, (list, dict)) and depth >= 4:
            return "..."
        if isinstance(v, list):
            return [head(x, depth + 1) for x in v[:8]] + (["..."] if len(v) > 8 else [])
        if isinstance(v, dict):
            items = list(itertools.islice(v.items(), 8))
            return {str(k)[:most]: head(x, depth + 1) for k, x in items}
        return v

    try:
        text = json.dumps(head(value, 0), ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)[:most + 1]
    text = text.encode("utf-8", "backslashreplace").decode()       # a lone surrogate written out, as \ud800
    return text if len(text) <= most else text[:most] + "..."


class Fields:
    """Typed reads of a request body's fields. Each returns the field's value, checked, or its
    default when the field is absent or null, and raises SamplingError naming the field
    otherwise. JSON's true and false are never numbers here, nor 1.0 an integer. prefix: the
    object's own name in a larger body ("stream_options."), for the names in errors."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def _value(self, name: str):
        return self.body.get(name)

    def _fail(self, name: str, what: str, value):
        name = self.prefix + name
        raise SamplingError(f"{name} must be {what}, got {show(value)}", name)

    def integer(self, name: str, default=None, lo: int | None = None, hi: int | None = None):
        value = self._value(name)
        if value is None:
            return default
        if type(value) is not int:
            self._fail(name, "an integer", value)
        if lo is not None and value < lo:
            self._fail(name, f">= {lo}", value)
        if hi is not None and value > hi:
            self._fail(name, f"<= {hi}", value)
        return value

    def number(self, name: str, default=None, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False):
        value = self._value(name)
        if value is None:
            return default
        if type(value) not in (int, float):
            self._fail(name, "a number", value)
        if not math.isfinite(value):
            self._fail(name, "finite", value)
        if lo is not None and (value <= lo if lo_open else value < lo):
            self._fail(name, f"{'>' if lo_open else '>='} {float(lo)}", value)
        if hi is not None and value > hi:
            self._fail(name, f"<= {float(hi)}", value)
        return float(value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self._value(name)
        if value is None:
            return default
        if type(value) is not bool:
            self._fail(name, "true or false", value)
        return value

    def string(self, name: str, default=None):
        value = self._value(name)
        if value is None:
            return default
        if type(value) is not str:
            self._fail(name, "a string", value)
        return value

    def strings(self, name: str, most: int) -> tuple:
        """A string or a list of at most `most` non-empty strings (OpenAI's `stop`), as a tuple."""
        value = self._value(name)
        if value is None:
            return ()
        if type(value) is str:
            value = [value]
        if type(value) is not list or not all(type(s) is str for s in value):
            self._fail(name, "a string or a list of strings", value)
        if len(value) > most or any(s == "" for s in value):
            name = self.prefix + name
            raise SamplingError(f"{name} takes at most {most} non-empty strings, got {show(value)}", name)
        return tuple(value)

    def object(self, name: str):
        """A JSON object (a dict), or None when absent or null."""
        value = self._value(name)
        if value is not None and type(value) is not dict:
            self._fail(name, "an object", value)
        return value

    def unsupported(self, name: str, neutral: tuple) -> None:
        """A parameter the server does not implement: only its values that ask for nothing pass."""
        value = self._value(name)
        if value is None or any(type(value) is type(v) and value == v for v in neutral) \
                or (type(value) in (int, float) and any(type(v) in (int, float) and value == v for v in neutral)):
            return
        name = self.prefix + name
        raise SamplingError(f"{name} is not supported, got {show(value)}", name)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple = field(default_factory=tuple)
    ignore_eos: bool = False     # vLLM's extension: run to max_tokens past end tokens (benchmarks)
    logprobs: int | None = None  # each token's log-probability and this many top alternatives; None: none
    echo: bool = False           # completions: the prompt first (with its log-probabilities if logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def prompt_logprobs(self) -> bool:
        """The prompt's own log-probabilities are wanted (echo with logprobs): its prompt pass
        gives the logits of every position."""
        return self.echo and self.logprobs is not None

    @classmethod
    def from_request(cls, body: dict, default_max_tokens: int = 16, max_model_len: int | None = None,
                     chat: bool = False):
        """The parameters of an OpenAI-style request body (chat: /v1/chat/completions', else
        /v1/completions'); SamplingError names a bad one.

        Log-probabilities: chat's `logprobs` (a boolean) and `top_logprobs` (0-20, only with
        logprobs true, as OpenAI and vLLM require); completions' `logprobs` (0-20 alternatives:
        vLLM's bound, OpenAI's legacy API took 5) and `echo` (the prompt first; max_tokens 0 then
        returns the prompt alone, as OpenAI's legacy API did)."""
        f = Fields(body)
        if chat:
            wanted = f.boolean("logprobs", False)
            top = f.integer("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
            if top and not wanted:
                raise SamplingError(f"top_logprobs ({top}) needs logprobs set to true", "top_logprobs")
            logprobs, echo = ((top or 0) if wanted else None), False
        else:
            logprobs = f.integer("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
            echo = f.boolean("echo", False)
        least = 0 if echo else 1
        max_tokens = f.integer("max_tokens", default_max_tokens, lo=least)
        max_tokens = f.integer("max_completion_tokens", max_tokens, lo=least)
        if max_model_len is not None and max_tokens > max_model_len:
            name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise SamplingError(f"{name} must be <= {max_model_len} (the model's context), got {max_tokens}", name)
        n = f.integer("n", 1)
        if n != 1:
            raise SamplingError(f"n must be 1 (one choice a request), got {show(n)}", "n")
        for name, neutral in {**UNSUPPORTED, **(UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETIONS)}.items():
            f.unsupported(name, neutral)
        return cls(max_tokens=max_tokens,
                   temperature=f.number("temperature", 1.0, lo=0, hi=2),
                   top_p=f.number("top_p", 1.0, lo=0, hi=1, lo_open=True),
                   top_k=f.integer("top_k", -1, lo=-1),
                   seed=f.integer("seed", None, lo=SEED_MIN, hi=SEED_MAX),
                   stop=f.strings("stop", MAX_STOP),
                   ignore_eos=f.boolean("ignore_eos", False), logprobs=logprobs, echo=echo)


def make_generator(params: SamplingParams, device: torch.device, server: torch.Generator) -> torch.Generator:
    """The request's own generator on `device`: from its seed, else from the server's generator."""
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=server))
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           failed: dict | None = None) -> torch.Tensor:
    """One token id per row of logits [rows, vocab] (any float dtype) under that row's
    parameters and generator (unused for greedy rows). Returns int64 [rows] on the logits'
    device. The sampled rows go through each step together (one sort for top-k and top-p,
    one softmax), and each draws from its own generator: the row's probabilities divided by
    exponential noise, the largest taken (the exponential race: exactly a draw from them).
    failed: a dict to which a row whose own draw raises is added (row -> the exception; its
    token is then meaningless) while the other rows keep exactly their draws; None: it raises."""
    rows, vocab = logits.shape
    if len(params) != rows or len(generators) != rows:
        raise ValueError(f"sample: {rows} logits rows, {len(params)} parameter sets, {len(generators)} generators")
    out = logits.argmax(dim=-1)
    picked = [r for r, p in enumerate(params) if not p.greedy]
    if not picked:
        return out
    dev = logits.device
    ps = [params[r] for r in picked]
    x = logits[picked].float() / torch.tensor([p.temperature for p in ps], device=dev)[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
    top_p = [p.top_p for p in ps]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        kth = sorted_x.gather(1, torch.tensor(top_k, device=dev)[:, None] - 1)
        drop = sorted_x < kth                         # top-k by value: ties at the k-th value stay
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop |= before >= torch.tensor(top_p, device=dev)[:, None]   # the first token never drops
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    noise = []
    for r in picked:
        try:
            noise.append(torch.empty(vocab, device=dev).exponential_(generator=generators[r]))
        except Exception as exc:  # noqa: BLE001 - that row's generator; the others draw as before
            if failed is None:
                raise
            failed[r] = exc
            noise.append(torch.ones(vocab, device=dev))
    out[picked] = (probs / torch.stack(noise)).argmax(dim=-1)
    return out
