"""Log-probabilities for the serving front, in OpenAI's two shapes (and vLLM's values).

A token's log-probability is its log_softmax over the model's raw logits (fp32, before the
request's temperature, top-k or top-p: vLLM's default "raw" logprobs and OpenAI's; after a
structured-output grammar's mask, as vLLM's, so a token the grammar forbids has none), clamped
below at -9999.0 as OpenAI does, since JSON has no -inf. The `top` most likely tokens come in
descending order, ties by lower id (torch.argmax's and the engine's rule), so the greedy
token's log-probability is always the maximum of a row.

Shapes:
  completions   {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
                 "text_offset": [int]}  (echo: the prompt's tokens first, its first token's entries None)
  chat          {"content": [{"token": str, "logprob": float, "bytes": [int],
                              "top_logprobs": [{"token": str, "logprob": float, "bytes": [int]}]}]}
A token's text is its own bytes decoded as UTF-8 with errors replaced (a token can hold part of
a character; `bytes` says which bytes exactly).
"""
from __future__ import annotations

import functools

import torch

# OpenAI's bound for chat's top_logprobs; completions' logprobs take the same (vLLM's default
# max_logprobs; OpenAI's legacy bound was 5)
MAX_TOP_LOGPROBS = 20
FLOOR = -9999.0


def device_rows(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple:
    """rows()'s work on the logits' device, queued without waiting on it: (the chosen tokens'
    log-probabilities [R] fp32, the `top` most likely ids [R, top] int64 and their
    log-probabilities [R, top] fp32; both None when top is 0). tokens: [R] int64 on that device."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
    if top <= 0:
        return chosen, None, None
    if top == 1:
        ids = lp.argmax(dim=-1, keepdim=True)                # the first index on ties
    else:
        # topk's order among equal values is not specified and a row has many (bf16 logits): rank
        # by one int64 key per token, the value's order-preserving bits above the id's complement,
        # so the keys are distinct and their top-k is exactly (value desc, id asc)
        # (16 bytes a token at most beside the fp32 row: the int32 order, then the int64 key in place)
        bits = lp.view(torch.int32)
        key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
        key.mul_(2**32).add_(2**32 - 1 - torch.arange(lp.shape[-1], device=lp.device, dtype=torch.int64))
        ids = (2**32 - 1) - (key.topk(min(top, lp.shape[-1]), dim=-1).values & (2**32 - 1))
    return chosen, ids, lp.gather(1, ids)


def host_rows(chosen: torch.Tensor, ids: torch.Tensor | None, values: torch.Tensor | None,
              tops: list[int] | None = None) -> list[tuple[float, list[tuple[int, float]]]]:
    """device_rows' tensors (on the host, or copied there: this reads them) as rows() returns
    them; tops: each row's own count of top tokens (at most the tensors' width), else all."""
    chosen = chosen.tolist()
    if ids is None:
        return [(max(c, FLOOR), []) for c in chosen]
    pairs = zip(ids.tolist(), values.tolist())
    tops = tops or [None] * len(chosen)
    return [(max(c, FLOOR), [(t, max(v, FLOOR)) for t, v in list(zip(i, v))[:k]])
            for c, (i, v), k in zip(chosen, pairs, tops)]


def rows(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [R, V] (any float dtype, on any device), tokens [R] int64 (each row's chosen token):
    for each row (the chosen token's log-probability, its `top` most likely (token, log-probability)
    in descending order, ties by lower id). One pass and one copy to the host for all rows."""
    return host_rows(*device_rows(logits, tokens.to(logits.device), top))


# Rows of a prompt's logits taken through log_softmax at a time: the fp32 copy and the top-k keys
# of 64 rows of Qwen3's 151,936 logits take ~200 MB at most, whatever the prompt's length.
PROMPT_ROWS_AT_ONCE = 64


def prompt_rows(logits: torch.Tensor, prompt: list[int], top: int) -> list[tuple[float, list] | None]:
    """A prompt's own log-likelihood from its every-position logits [S, V]: for position t > 0 the
    log-probability of prompt[t] given prompt[:t] (row t - 1) and the top tokens there; None for
    the first token, which nothing predicts."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    targets = torch.tensor(prompt[1:], dtype=torch.int64, device=logits.device)
    out: list = [None]
    for at in range(0, len(prompt) - 1, PROMPT_ROWS_AT_ONCE):
        end = min(at + PROMPT_ROWS_AT_ONCE, len(prompt) - 1)
        out += rows(logits[at:end], targets[at:end], top)
    return out


class TokenText:
    """Token ids as their bytes and display text, from a checkpoint's byte-level BPE tokenizer
    (fastqwen.serve.text.TextCodec's): each piece's bytes through the GPT-2 byte alphabet, special
    and added tokens as their own text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special = {tok.content for tok in getattr(tokenizer, "get_added_tokens_decoder", dict)().values()}
        self._unicode_to_byte = {chr(c): b for b, c in _byte_alphabet().items()}

    @functools.lru_cache(maxsize=1 << 18)
    def bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(int(token_id))
        if piece is None:
            return b""
        if piece in self._special or any(ch not in self._unicode_to_byte for ch in piece):
            return piece.encode("utf-8")
        return bytes(self._unicode_to_byte[ch] for ch in piece)

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict:
    """GPT-2's byte -> printable code point map, which byte-level BPE tokenizers write pieces in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = b
        else:
            out[b] = 256 + extra
            extra += 1
    return out


def completion_logprobs(text_of, tokens: list[int], entries: list, offset: int = 0) -> dict:
    """The completions shape for `tokens` and their entries (rows()/prompt_rows() items, None
    where a token has none); text_offset counts characters from `offset`. A token's top_logprobs
    holds its top tokens and itself (OpenAI's "up to logprobs + 1" and vLLM's: `logprobs` 0
    gives the chosen token alone)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        out["tokens"].append(text_of(token))
        out["text_offset"].append(offset)
        offset += len(out["tokens"][-1])
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            logprob, top = entry
            out["token_logprobs"].append(logprob)
            alternatives = {text_of(t): v for t, v in top}
            alternatives.setdefault(out["tokens"][-1], logprob)
            out["top_logprobs"].append(alternatives)
    return out


def chat_logprobs(token_text: TokenText, tokens: list[int], entries: list) -> dict:
    """The chat shape: one item a generated token, with its bytes and its top alternatives."""
    def item(token, logprob):
        data = token_text.bytes_of(token)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}

    return {"content": [dict(item(token, logprob), top_logprobs=[item(t, v) for t, v in top])
                        for token, (logprob, top) in zip(tokens, entries)]}
