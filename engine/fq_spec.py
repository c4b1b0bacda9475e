"""Exact speculative decoding: drafters propose k tokens per sequence, the target checks them all
in one verify pass over k + 1 positions, and the longest prefix of drafts that equals the target's
own picks is kept, followed by the target's next pick. Every emitted token is the target's argmax
on its prefix, computed by the verify rows in the decode step's arithmetic (each row of a verify
is what the one-row step at that position computes: the models' verify_logits), so speculation on
or off emits the same tokens.

Drafters (any draft is safe: a wrong one is only rejected work):
  ngram       prompt lookup: the tokens that followed the latest earlier occurrence of the
              sequence's last n tokens (n = 3, 2, 1)
  recycle     token recycling: per sequence, the target's pick after each token at its latest
              verify, chained from the last token
  mtp         Qwen3.5's multi-token-prediction head (the checkpoint's mtp.*): the target's
              final-normed state and the next token through the head give a draft; the head's
              own output and that draft, the next one (chained k times)
  oracle:<a>  measurement only: a plain run of the same prompts is recorded first (on a prompt
              not seen before, inside the call), then each draft is the recorded next token,
              replaced by another with probability 1 - a: end-to-end speed at acceptance a; on a
              checkpoint with an MTP head the head runs too and its drafts are then replaced (its
              real cost in the measurement)

This module is host-side bookkeeping (lists of ints); the models' verify pass is the device work.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

MODES = ("off", "ngram", "recycle", "mtp", "oracle")
DEFAULT_K = 4
MAX_K = 16


@dataclass(frozen=True)
class Speculation:
    """A parsed `speculation` option: mode, tokens drafted per verify (k), the oracle's acceptance."""
    mode: str = "off"
    k: int = DEFAULT_K
    accept: float = 1.0

    @property
    def on(self) -> bool:
        return self.mode != "off"


def parse_speculation(value, k: int | None = None) -> Speculation:
    """"off" | "ngram" | "recycle" | "mtp" | "oracle:<a>" (0 <= a <= 1) -> Speculation; anything else is a
    ValueError naming the value. k: drafts per verify, 1..MAX_K (default DEFAULT_K)."""
    if k is None:
        k = DEFAULT_K
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"speculative_tokens must be an int in [1, {MAX_K}], got {k!r}")
    if not isinstance(value, str):
        raise ValueError(f"speculation must be a string ({', '.join(MODES[:3])}, oracle:<a>), got {value!r}")
    text = value.strip().lower()
    if text in ("off", "ngram", "recycle", "mtp"):
        return Speculation(text, k)
    if text.startswith("oracle:"):
        try:
            accept = float(text.split(":", 1)[1])
        except ValueError:
            accept = -1.0
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"speculation {value!r}: the oracle's acceptance must be a number in [0, 1]")
        return Speculation("oracle", k, accept)
    if text == "auto":
        raise ValueError(f"speculation {value!r} is not available in this engine yet (off, ngram, recycle, mtp, "
                         f"oracle:<a> are)")
    raise ValueError(f"speculation {value!r} is not one of off, ngram, recycle, mtp, oracle:<a>")


@dataclass
class SpecStats:
    """One generate() call's speculation: drafts proposed and kept, verify passes, tokens they
    emitted (accepted drafts + the target's own pick each), host seconds drafting and verifying
    (the verify's include the device's work: the picks are read back each pass)."""
    mode: str = "off"
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    verified_rows: int = 0
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    record_s: float = 0.0

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["acceptance"] = self.accepted / self.drafted if self.drafted else None
        out["tokens_per_verify"] = self.emitted / self.verified_rows if self.verified_rows else None
        return out


# ---- drafters ------------------------------------------------------------------------------
class Drafter:
    """Per-sequence drafts. start() with each sequence's prompt, then per verify: draft(k) from
    the tokens emitted so far (`out[b]`, the last one not yet in the cache), observe() what the
    verify picked at each row."""

    def start(self, prompts: list[list[int]], vocab: int, first: list[int] | None = None) -> None:
        """Before the first verify: the prompts, the vocabulary size, the first generated tokens
        (the prompt pass has run)."""
        self.prompts, self.vocab = prompts, vocab

    def draft(self, out: list[list[int]], k: int) -> list[list[int]]:
        raise NotImplementedError

    def observe(self, tokens: list[list[int]], picks: list[list[int]], positions: list[int] | None = None,
                kept: list[int] | None = None) -> None:
        """After a verify at positions (each sequence's first row's): tokens[b] its input row (the
        last token + drafts), picks[b][j] the target's pick after tokens[b][: j + 1], kept[b] the
        rows it kept."""


def _pad(draft: list[int], k: int, fill: int) -> list[int]:
    draft = draft[:k]
    return draft + [fill] * (k - len(draft))


class NgramDrafter(Drafter):
    """Prompt lookup: the k tokens after the latest earlier occurrence of the last n tokens of the
    prompt + output (n from max_n down to 1); none found: the last token repeated (a cheap guess,
    right when the target loops on one token)."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n

    def draft(self, out, k):
        drafts = []
        for prompt, emitted in zip(self.prompts, out):
            seq = prompt + emitted
            drafts.append(_pad(self._lookup(seq, k), k, seq[-1]))
        return drafts

    def _lookup(self, seq: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            # the latest start i < len(seq) - n with seq[i:i + n] == tail
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i:i + n] == tail:
                    found = seq[i + n:i + n + k]
                    if found:
                        return found
        return []


class RecycleDrafter(Drafter):
    """Token recycling: per sequence a table token -> the target's latest pick after it (from every
    verify row), drafts chained from the last emitted token; a token never seen: the last token."""

    def start(self, prompts, vocab, first=None):
        super().start(prompts, vocab)
        self.next = [dict() for _ in prompts]

    def draft(self, out, k):
        drafts = []
        for table, emitted in zip(self.next, out):
            chain, token = [], emitted[-1]
            while len(chain) < k and token in table:
                token = table[token]
                chain.append(token)
            drafts.append(_pad(chain, k, emitted[-1]))
        return drafts

    def observe(self, tokens, picks, positions=None, kept=None):
        for table, row, pick in zip(self.next, tokens, picks):
            # only the rows whose input prefix the target confirmed: row j's input is the
            # target's own when all drafts before it were accepted
            for j, (token, after) in enumerate(zip(row, pick)):
                table[token] = after
                if j + 1 < len(row) and row[j + 1] != after:
                    break


class OracleDrafter(Drafter):
    """The recorded plain run's next tokens, each replaced (by a different token, drawn from a
    generator seeded per call) with probability 1 - accept."""

    def __init__(self, accept: float, seed: int = 0, inner: Drafter | None = None):
        self.accept, self.seed, self.inner = accept, seed, inner
        self.recordings: dict[tuple, list[int]] = {}

    def missing(self, prompts: list[list[int]], steps: int) -> list[int]:
        """Indices of prompts with no recording of at least `steps` tokens."""
        return [b for b, p in enumerate(prompts) if len(self.recordings.get(tuple(p), ())) < steps]

    def record(self, prompt: list[int], tokens: list[int]) -> None:
        self.recordings[tuple(prompt)] = list(tokens)

    def start(self, prompts, vocab, first=None):
        super().start(prompts, vocab)
        self.rng = random.Random(self.seed)
        self.records = [self.recordings.get(tuple(p), []) for p in prompts]
        if self.inner is not None:
            self.inner.start(prompts, vocab, first)

    def observe(self, tokens, picks, positions=None, kept=None):
        if self.inner is not None:
            self.inner.observe(tokens, picks, positions, kept)

    def draft(self, out, k):
        if self.inner is not None:      # its work is what is measured; its drafts are replaced
            self.inner.draft(out, k)
        drafts = []
        for record, emitted in zip(self.records, out):
            m = len(emitted)
            chain = []
            for token in record[m:m + k]:
                if self.rng.random() >= self.accept:
                    token = (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                chain.append(token)
            drafts.append(_pad(chain, k, emitted[-1]))
        return drafts


class MtpDrafter(Drafter):
    """The model's multi-token-prediction head (Qwen35Model.mtp_draft). After the prompt pass it
    runs over every prompt position (the head's K/V), after each verify over the verify's rows
    (the target's states with its picks); the row of each sequence's last kept token gives the
    first draft, and the head's own output chains the rest."""

    def __init__(self, model):
        self.model = model

    def start(self, prompts, vocab, first=None):
        import torch

        super().start(prompts, vocab)
        dev = self.model.device
        ids = torch.tensor(prompts, dtype=torch.int64, device=dev)
        nxt = torch.cat([ids[:, 1:], torch.tensor(first, dtype=torch.int64, device=dev).view(-1, 1)], dim=1)
        ones = torch.ones(len(prompts), dtype=torch.int32, device=dev)
        picks, hidden = self.model.mtp_draft(nxt, self.model.hidden, ones)
        self._ready(picks[:, -1], hidden[:, -1], ones * ids.shape[1])

    def _ready(self, pick, hidden, position) -> None:
        """The first draft of each sequence, the head's state after it, its last token's position."""
        self.pick, self.state, self.position = pick, hidden, position

    def draft(self, out, k):
        import torch

        chain, pick, state = [self.pick], self.pick, self.state
        for i in range(1, k):
            picks, hidden = self.model.mtp_draft(pick.view(-1, 1), state.unsqueeze(1), self.position + i)
            pick, state = picks[:, 0], hidden[:, 0]
            chain.append(pick)
        return torch.stack(chain, dim=1).tolist()

    def observe(self, tokens, picks, positions=None, kept=None):
        import torch

        dev = self.model.device
        pos = torch.tensor(positions, dtype=torch.int32, device=dev)
        heads, hidden = self.model.mtp_draft(torch.tensor(picks, dtype=torch.int64, device=dev), self.model.hidden,
                                             pos + 1)
        last = torch.tensor([max(0, m - 1) for m in kept], dtype=torch.int64, device=dev)
        rows = torch.arange(len(kept), device=dev)
        self._ready(heads[rows, last], hidden[rows, last], pos + last.to(torch.int32) + 1)


def make_drafter(spec: Speculation, seed: int = 0, model=None) -> Drafter:
    """The drafter of spec's mode; model: the target (the MTP head's owner, where it has one)."""
    head = model is not None and getattr(model, "has_mtp", False)
    if spec.mode == "ngram":
        return NgramDrafter()
    if spec.mode == "recycle":
        return RecycleDrafter()
    if spec.mode == "mtp":
        if not head:
            raise ValueError("speculation 'mtp' needs a model with its multi-token-prediction head loaded")
        return MtpDrafter(model)
    if spec.mode == "oracle":
        return OracleDrafter(spec.accept, seed, inner=MtpDrafter(model) if head else None)
    raise ValueError(f"no drafter for speculation mode {spec.mode!r}")


# ---- acceptance ------------------------------------------------------------------------------
def accept(drafts: list[int], picks: list[int]) -> list[int]:
    """The tokens one verify emits for a sequence: the target's picks up to and including the
    first that differs from the draft before it (drafts[j] is checked against picks[j], the
    target's pick after the row that ends with drafts[j - 1])."""
    n = 0
    while n < len(drafts) and drafts[n] == picks[n]:
        n += 1
    return picks[:n + 1]

