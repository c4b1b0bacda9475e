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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_STOP = 4


class SamplingError(ValueError):
    """A request parameter outside what the server accepts; the message names it and its value."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple = field(default_factory=tuple)
    ignore_eos: bool = False     # vLLM's extension: run to max_tokens past end tokens (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_request(cls, body: dict, default_max_tokens: int = 16, max_model_len: int | None = None):
        """The parameters of an OpenAI-style request body; SamplingError names a bad one."""
        def number(name, default, lo=None, hi=None, integer=False, lo_open=False):
            value = body.get(name, default)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
                raise SamplingError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise SamplingError(f"{name} must be finite, got {value!r}")
            if lo is not None and (value <= lo if lo_open else value < lo):
                raise SamplingError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
            if hi is not None and value > hi:
                raise SamplingError(f"{name} must be <= {hi}, got {value!r}")
            return value

        max_tokens = number("max_tokens", default_max_tokens, lo=1, integer=True)
        if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
            max_tokens = number("max_completion_tokens", default_max_tokens, lo=1, integer=True)
        if max_model_len is not None and max_tokens > max_model_len:
            raise SamplingError(f"max_tokens must be <= {max_model_len} (the model's context), got {max_tokens}")
        temperature = float(number("temperature", 1.0, lo=0.0, hi=2.0))
        top_p = float(number("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True))
        top_k = number("top_k", -1, lo=-1, integer=True)
        seed = number("seed", None, integer=True)
        stop = body.get("stop")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise SamplingError(f"stop must be a string or a list of strings, got {stop!r}")
        if len(stop) > MAX_STOP or any(s == "" for s in stop):
            raise SamplingError(f"stop takes at most {MAX_STOP} non-empty strings, got {list(stop)!r}")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be true or false, got {ignore_eos!r}")
        n = body.get("n", 1)
        if n != 1:
            raise SamplingError(f"n must be 1 (one choice a request), got {n!r}")
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", None),
                              ("logprobs", None), ("top_logprobs", None), ("best_of", None), ("echo", False),
                              ("suffix", None)):
            value = body.get(name, neutral)
            if value not in (neutral, None, 0, False, {}):
                raise SamplingError(f"{name} is not supported, got {value!r}")
        return cls(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=int(top_k), seed=seed,
                   stop=stop, ignore_eos=ignore_eos)


def make_generator(params: SamplingParams, device: torch.device, server: torch.Generator) -> torch.Generator:
    """The request's own generator on `device`: from its seed, else from the server's generator."""
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=server))
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """One token id per row of logits [rows, vocab] (any float dtype) under that row's
    parameters and generator (unused for greedy rows). Returns int64 [rows] on the logits'
    device. The sampled rows go through each step together (one sort for top-k and top-p,
    one softmax), and each draws from its own generator: the row's probabilities divided by
    exponential noise, the largest taken (the exponential race: exactly a draw from them)."""
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
    noise = torch.stack([torch.empty(vocab, device=dev).exponential_(generator=generators[r]) for r in picked])
    out[picked] = (probs / noise).argmax(dim=-1)
    return out
