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
              not seen before, inside the call), then each draft is the recorded token, replaced
              by another with probability 1 - a (drawn once per generated position, from a
              generator seeded per call): end-to-end speed at acceptance a; on a checkpoint with
              an MTP head the head runs too and its drafts are then replaced (its real cost)
  auto        prompt lookup where it pays: the loop runs plain decode steps and verifies of 1, 2,
              4 .. k drafts as the running acceptance and the measured costs of each say
              (AutoPolicy)

Everything a verify does runs on the device over static buffers (SpecState), so one CUDA graph
holds the draft, the verify, the acceptance and the bookkeeping (fq_decode.SpecRunner); the host
reads each step's picks back to yield them.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch

MODES = ("off", "auto", "ngram", "recycle", "mtp", "oracle")
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

    @property
    def every_step(self) -> bool:
        """Drafts and verifies every step (every mode but "off" and "auto", whose steps are plain
        until drafts pay): where a model may trade plain-step speed for cheaper verifies."""
        return self.on and self.mode != "auto"


def parse_speculation(value, k: int | None = None) -> Speculation:
    """"off" | "auto" | "ngram" | "recycle" | "mtp" | "oracle:<a>" (0 <= a <= 1) -> Speculation;
    anything else is a ValueError naming the value. k: drafts per verify, 1..MAX_K (default DEFAULT_K)."""
    if k is None:
        k = DEFAULT_K
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"speculative_tokens must be an int in [1, {MAX_K}], got {k!r}")
    if not isinstance(value, str):
        raise ValueError(f"speculation must be a string ({', '.join(MODES[:5])}, oracle:<a>), got {value!r}")
    text = value.strip().lower()
    if text in MODES[:5]:
        return Speculation(text, k)
    if text.startswith("oracle:"):
        try:
            accept = float(text.split(":", 1)[1])
        except ValueError:
            accept = -1.0
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"speculation {value!r}: the oracle's acceptance must be a number in [0, 1]")
        return Speculation("oracle", k, accept)
    raise ValueError(f"speculation {value!r} is not one of off, auto, ngram, recycle, mtp, oracle:<a>")


@dataclass
class SpecStats:
    """One generate() call's speculation: drafts proposed and kept, verify passes (width_steps:
    how many of each width, drafts per verify) and plain steps, tokens the verifies emitted
    (accepted drafts + the target's own pick each), and the device's mean milliseconds for one
    draft, one verify (with its acceptance and bookkeeping; by width too) and one plain step over
    the call (None for a kind that did not run)."""
    mode: str = "off"
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    verified_rows: int = 0
    emitted: int = 0
    width_steps: dict = field(default_factory=dict)
    draft_ms: float | None = None
    verify_ms: float | None = None
    plain_ms: float | None = None
    verify_ms_by_width: dict = field(default_factory=dict)
    loop_s: float = 0.0
    record_s: float = 0.0

    def as_dict(self) -> dict:
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()}
        out["acceptance"] = self.accepted / self.drafted if self.drafted else None
        out["tokens_per_verify"] = self.emitted / self.verified_rows if self.verified_rows else None
        return out


def expected_tokens(accept: float, k: int) -> float:
    """Tokens one verify of k drafts emits per sequence when each draft is right with probability
    `accept` independently: 1 + a + a^2 + ... + a^k."""
    return float(k + 1) if accept >= 1.0 else (1.0 - accept ** (k + 1)) / (1.0 - accept)


def verify_widths(k: int) -> tuple:
    """The verify widths (drafts per verify) "auto" chooses among for a speculation of k, its costs
    measured per batch size deciding: every width up to 4, past it those whose rows a sequence
    (w + 1) or drafts are a power of two, and k (k = 4: 1-4; k = 8: 1-4, 7, 8). A verify's cost
    steps with the products' row tiles: at one sequence the one-row GEMV's tile of 4 rows takes a
    verify of 3 in one weight pass, where 4 drafts (5 rows) take two."""
    return tuple(w for w in range(1, k + 1) if w <= 4 or w == k or not (w & (w - 1)) or not (w & (w + 1)))


def verify_observed(emit: int, width: int, room: int) -> tuple:
    """What one sequence's verify says about its drafts: (accepted, rejected). emit: the tokens it
    emitted (its matched drafts + 1, capped by room, the tokens it still had to emit). A rejection
    is seen where it emitted fewer than the drafts + 1 and the cap did not decide it."""
    if emit < 1:
        return 0, 0
    return emit - 1, int(emit - 1 < width and emit < room)


class AutoPolicy:
    """speculation "auto": per step, a plain decode step or a verify of w drafts (w among the widths
    whose costs were measured), whichever emits more tokens per millisecond at the running
    acceptance: verify w emits expected_tokens(a, w) per verify_ms[w], a plain step 1 per
    plain_ms; a verify is chosen when its rate beats the plain step's by `margin`.

    The acceptance a is a draft's chance to be right, estimated over about the last `window`
    drafts checked, from a prior of `prior` worth `prior_drafts` drafts. Two kinds of checks feed
    it: a verify's (observe_verify: each row checks its drafts up to its first rejection), and a
    plain step's, made on the host by the caller (observe_shadow: each sequence's token against
    the first draft prompt lookup would have made, PromptLookup). So no verify is spent finding
    out: a drafter that is right shows at once, one that is wrong costs nothing. observe_cost
    moves a kind's cost toward what its steps measure (the context grows as the call goes on)."""

    def __init__(self, verify_ms: dict, plain_ms: float, margin: float = 1.05, prior: float = 0.0,
                 prior_drafts: int = 4, window: int = 64):
        if not verify_ms or not all(ms > 0 for ms in verify_ms.values()) or not plain_ms > 0:
            raise ValueError(f"AutoPolicy needs positive costs, got verify {verify_ms!r} ms, plain {plain_ms!r} ms")
        self.margin, self.window = margin, window
        self.set_costs(verify_ms, plain_ms)
        self.checked = float(prior_drafts)
        self.accepted = prior * prior_drafts

    def set_costs(self, verify_ms: dict, plain_ms: float) -> None:
        """The costs to weigh from now on ({width: verify ms}, plain ms): a server's batch size changes."""
        self.verify_ms, self.plain_ms = dict(sorted(verify_ms.items())), plain_ms

    def observe_cost(self, width: int, ms: float, weight: float = 0.25) -> None:
        """A step's measured milliseconds (width 0: a plain step; else a draft and a verify of that
        width): its kind's cost moves `weight` of the way there."""
        if ms is None or not ms > 0:
            return
        if width:
            self.verify_ms[width] += weight * (ms - self.verify_ms[width])
        else:
            self.plain_ms += weight * (ms - self.plain_ms)

    def break_even(self, width: int) -> float:
        """The lowest acceptance at which a verify of `width` drafts pays (above 1.0: none)."""
        if self._rate(1.0, width) < self.margin / self.plain_ms:
            return 2.0
        lo, hi = 0.0, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self._rate(mid, width) >= self.margin / self.plain_ms else (mid, hi)
        return hi

    def _rate(self, accept: float, width: int) -> float:
        return expected_tokens(accept, width) / self.verify_ms[width]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.checked if self.checked else 0.0

    def best(self) -> int:
        """The width that pays best at the running acceptance, 0 where none beats a plain step."""
        a = self.acceptance
        width = max(self.verify_ms, key=lambda w: self._rate(a, w))
        return width if self._rate(a, width) >= self.margin / self.plain_ms else 0

    def pays(self) -> bool:
        """Whether some verify beats a plain step at the running acceptance."""
        return self.best() > 0

    def next_width(self) -> int:
        """The next step: a verify of that many drafts, or 0 for a plain step."""
        return self.best()

    def observe_verify(self, accepted: int, rejected: int) -> None:
        """A verify's outcome over its sequences: drafts accepted, rejections seen (verify_observed)."""
        self._observe(accepted, accepted + rejected)

    def observe_shadow(self, right: int, wrong: int) -> None:
        """A plain step's sequences' would-be first drafts checked against its picks on the host:
        `right` of them equal, `wrong` not."""
        self._observe(right, right + wrong)

    def _observe(self, accepted: int, checked: int) -> None:
        keep = max(0.0, 1.0 - checked / self.window)      # a running mean over about `window` drafts
        self.checked = self.checked * keep + checked
        self.accepted = self.accepted * keep + accepted


# ---- the device state of one speculative call ---------------------------------------------------
class SpecState:
    """Static device buffers of a speculative generate over `batch` sequences of up to `capacity`
    positions: seq [B, capacity + k + 1] int64 holds each sequence's prompt then its emitted tokens,
    length [B] int64 how many, limit [B] int64 where it stops (prompt + steps); a step writes the
    tokens it emitted into seq and advances length (never past limit). The rows past limit give
    a finished sequence's verify somewhere to write."""

    def __init__(self, batch: int, capacity: int, k: int, device):
        self.batch, self.k, self.device = batch, k, device
        self.seq = torch.zeros((batch, capacity + k + 1), dtype=torch.int64, device=device)
        self.length = torch.ones(batch, dtype=torch.int64, device=device)
        self.limit = torch.ones(batch, dtype=torch.int64, device=device)
        self.steps = torch.arange(k + 1, device=device)

    @property
    def capacity(self) -> int:
        return self.seq.shape[1] - self.k - 1

    def start(self, ids: torch.Tensor, first: torch.Tensor, steps: int) -> None:
        """Prompts ids [B, P] and their first generated tokens [B]; `steps` tokens in all."""
        B, P = ids.shape
        if P + steps > self.capacity:
            raise ValueError(f"SpecState: prompt {P} + {steps} steps exceeds its capacity {self.capacity}")
        self.seq[:, :P].copy_(ids)
        self.seq[:, P].copy_(first)
        self.length.fill_(P + 1)
        self.limit.fill_(P + steps)

    def last(self) -> torch.Tensor:
        """Each sequence's last token [B] (the next step's first input; not yet in the cache)."""
        return self.seq.gather(1, (self.length - 1).view(-1, 1)).view(-1)

    def positions(self) -> torch.Tensor:
        """Where each last token goes in the cache, [B] int32."""
        return (self.length - 1).to(torch.int32)

    def append(self, picks: torch.Tensor, emit: torch.Tensor) -> None:
        """seq[b, length[b] + j] = picks[b, j] for j < emit[b]; length += emit (graph-safe)."""
        T = picks.shape[1]
        idx = self.length.view(-1, 1) + self.steps[:T].view(1, -1)
        keep = self.seq.gather(1, idx)
        self.seq.scatter_(1, idx, torch.where(self.steps[:T].view(1, -1) < emit.view(-1, 1), picks, keep))
        self.length.add_(emit)


def accept_rows(drafts: torch.Tensor, picks: torch.Tensor, room: torch.Tensor) -> tuple:
    """A verify's acceptance on the device: drafts [B, k], picks [B, k + 1] (picks[:, j] the target's
    pick after row j) and room [B] (tokens a sequence may still emit) -> (matched [B]: the leading
    drafts equal to the target's picks, emit [B]: the tokens it emits, matched + 1 capped by room).
    The emitted tokens are picks[:, :emit]: the agreeing drafts, then the target's own next pick."""
    matched = torch.cumprod((drafts == picks[:, :-1]).to(torch.int64), dim=1).sum(dim=1)
    return matched, torch.minimum(matched + 1, room.clamp(min=0))


# ---- drafters: graph-safe functions of the state ------------------------------------------------
class Drafter:
    """Per-sequence drafts from the device state. start() after the prompt pass (eager, may read
    the host), then per verify draft(state) -> [B, k] int64 and observe(state, rows, picks, kept)
    with the verify's input rows [B, k + 1], picks [B, k + 1] and kept rows [B]: both graph-safe."""

    def prepare(self, state: SpecState) -> None:
        """The drafter's static buffers for this state (before any graph over them is captured)."""

    def start(self, state: SpecState, prompt: int, steps: int) -> None:
        """Before the first verify (the state holds the prompts and the first tokens)."""

    def draft(self, state: SpecState) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, state: SpecState, rows: torch.Tensor, picks: torch.Tensor, kept: torch.Tensor) -> None:
        """After a verify and its acceptance (the state already holds the emitted tokens)."""


class NgramDrafter(Drafter):
    """Prompt lookup: the k tokens after the latest earlier occurrence of the last n tokens of the
    prompt + output (n from max_n down to 1), each past the sequence's end replaced by its last
    token; no occurrence: the last token repeated (right when the target loops on one token)."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n

    def draft(self, state):
        seq, length, k = state.seq, state.length, state.k
        B, W = seq.shape
        last = state.last()
        cols = torch.arange(W, device=seq.device)
        best = torch.full((B,), -1, dtype=torch.int64, device=seq.device)   # where the copy starts
        for n in range(self.max_n, 0, -1):
            # windows starting at i: seq[b, i:i + n] == the last n tokens, i + n < length (one follows)
            tail = seq.gather(1, (length.view(-1, 1) - n + torch.arange(n, device=seq.device)).clamp(min=0))
            windows = seq.unfold(1, n, 1)                                     # [B, W - n + 1, n]
            match = (windows == tail.unsqueeze(1)).all(dim=2)
            starts = cols[:W - n + 1].view(1, -1)
            match &= (starts + n < length.view(-1, 1)) & (length.view(-1, 1) > n)
            latest = torch.where(match, starts, -1).amax(dim=1)
            best = torch.where((best < 0) & (latest >= 0), latest + n, best)
        at = best.view(-1, 1) + state.steps[:k].view(1, -1)
        found = (best.view(-1, 1) >= 0) & (at < length.view(-1, 1))
        return torch.where(found, seq.gather(1, at.clamp(min=0, max=W - 1)), last.view(-1, 1))


class PromptLookup:
    """NgramDrafter's twin on the host, over one sequence's growing tokens (prompt, then output):
    the server's drafter, and "auto"'s shadow check of plain steps. draft(k) gives the k
    tokens after the latest earlier occurrence of the sequence's last n tokens (n from max_n down
    to 1), padded with the last token; none found: the last token k times. An index of each
    n-gram's latest start with a token after it, kept as tokens come, makes a draft O(max_n), not
    a scan of the sequence (a scan took ~0.4 ms a request at 1,280 tokens: ~6 ms a verify of 16)."""

    def __init__(self, tokens: list = (), max_n: int = 3):
        self.max_n = max_n
        self.seq: list = []
        self._latest = [{} for _ in range(max_n + 1)]      # n -> {n tokens: latest start}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens; every n-gram now followed by a token is indexed at its latest start (in
        bulk: a 2,048-token prompt indexes in ~1 ms)."""
        seq, latest = self.seq, self._latest
        old = len(seq)
        seq.extend(tokens)
        last = len(seq) - 1                    # starts s with s + n <= last have a token after them
        for n in range(1, self.max_n + 1):
            first = max(0, old - n)            # those from before are indexed already
            if last - n >= first:
                grams = zip(*(seq[first + j:last - n + 1 + j] for j in range(n)))
                latest[n].update(zip(grams, range(first, last - n + 1)))

    def draft(self, k: int) -> list:
        seq = self.seq
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            start = self._latest[n].get(tuple(seq[-n:]))
            if start is not None:
                got = seq[start + n:start + n + k]
                return got + [seq[-1]] * (k - len(got))
        return [seq[-1]] * k


class RecycleDrafter(Drafter):
    """Token recycling: per sequence a table token -> the target's latest pick after it (from every
    verify row whose input the target confirmed), drafts chained from the last token; a token
    never seen ends the chain, the rest the last token."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.table = None

    def prepare(self, state):
        self.table = torch.full((state.batch, self.vocab), -1, dtype=torch.int64, device=state.device)

    def start(self, state, prompt, steps):
        self.table.fill_(-1)

    def draft(self, state):
        last = state.last()
        token, alive, out = last, torch.ones_like(last, dtype=torch.bool), []
        for _ in range(state.k):
            nxt = self.table.gather(1, token.view(-1, 1)).view(-1)
            alive = alive & (nxt >= 0)
            token = torch.where(alive, nxt, token)
            out.append(torch.where(alive, nxt, last))
        return torch.stack(out, dim=1)

    def observe(self, state, rows, picks, kept):
        # row j's input is the target's own token while every draft before it was accepted:
        # rows 0 .. matched (the first rejected draft's row is the last one confirmed), and only
        # rows the verify ran (a kept count below matched + 1: its cap, verify_keep's or room's)
        matched = torch.cumprod((rows[:, 1:] == picks[:, :-1]).to(torch.int64), dim=1).sum(dim=1)
        last = torch.minimum(matched, kept - 1)
        for j in range(rows.shape[1]):        # in row order: a later row's pick wins, as on the host
            at = rows[:, j:j + 1]
            now = self.table.gather(1, at)
            self.table.scatter_(1, at, torch.where((j <= last).view(-1, 1), picks[:, j:j + 1], now))


class OracleDrafter(Drafter):
    """The recorded plain run's tokens, each replaced by another with probability 1 - accept: the
    replacement for generated position m is drawn once per call (a generator seeded per call), so
    a position drafted again by the next verify gets the same decision."""

    def __init__(self, accept: float, vocab: int, seed: int = 0, inner: Drafter | None = None):
        self.accept, self.vocab, self.seed, self.inner = accept, vocab, seed, inner
        self.recordings: dict[tuple, list[int]] = {}
        self.tokens = None

    def missing(self, prompts: list[list[int]], steps: int) -> list[int]:
        """Indices of prompts with no recording of at least `steps` tokens."""
        return [b for b, p in enumerate(prompts) if len(self.recordings.get(tuple(p), ())) < steps]

    def record(self, prompt: list[int], tokens: list[int]) -> None:
        self.recordings[tuple(prompt)] = list(tokens)

    def set_prompts(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts

    def prepare(self, state):
        B, W = state.seq.shape
        self.tokens = torch.zeros((B, W), dtype=torch.int64, device=state.device)
        self.prompt = torch.zeros(B, dtype=torch.int64, device=state.device)
        self.recorded = torch.zeros(B, dtype=torch.int64, device=state.device)
        if self.inner is not None:
            self.inner.prepare(state)

    def start(self, state, prompt, steps):
        # the drafted token of generated position m: recorded[m] or its replacement, [B, W]
        gen = torch.Generator().manual_seed(self.seed)
        B, W = self.tokens.shape
        table = torch.zeros((B, W), dtype=torch.int64)
        for b, p in enumerate(self.prompts):
            rec = torch.tensor(self.recordings.get(tuple(p), [])[:W], dtype=torch.int64)
            table[b, :len(rec)] = rec
        wrong = torch.rand((B, W), generator=gen) >= self.accept
        other = (table + 1 + torch.randint(0, max(1, self.vocab - 1), (B, W), generator=gen)) % self.vocab
        self.tokens.copy_(torch.where(wrong, other, table))
        self.prompt.fill_(prompt)
        self.recorded.copy_(torch.tensor([min(W, len(self.recordings.get(tuple(p), []))) for p in self.prompts]))
        if self.inner is not None:
            self.inner.start(state, prompt, steps)

    def draft(self, state):
        if self.inner is not None:      # its work is what is measured; its drafts are replaced
            self.inner.draft(state)
        m = (state.length - self.prompt).view(-1, 1) + state.steps[:state.k].view(1, -1)   # generated index
        have = m < self.recorded.view(-1, 1)
        got = self.tokens.gather(1, m.clamp(max=self.tokens.shape[1] - 1))
        return torch.where(have, got, state.last().view(-1, 1))

    def observe(self, state, rows, picks, kept):
        if self.inner is not None:
            self.inner.observe(state, rows, picks, kept)


class MtpDrafter(Drafter):
    """The model's multi-token-prediction head (Qwen35Model.mtp_draft). A head row pairs the
    target's final-normed state at position t with the token at t + 1 and sits at position t (as
    vLLM and SGLang place it). After the prompt pass it runs over every prompt position (the
    head's K/V), after each verify over the verify's rows (the target's states with its picks);
    the row of each sequence's last kept token gives the first draft, and the head's own output
    chains the rest, one position further each."""

    def __init__(self, model):
        self.model = model

    def prepare(self, state):
        B, dev = state.batch, state.device
        self.pick = torch.zeros(B, dtype=torch.int64, device=dev)
        self.state = torch.zeros((B, self.model.cfg.hidden_size), dtype=torch.bfloat16, device=dev)
        self.position = torch.zeros(B, dtype=torch.int32, device=dev)
        # the chained drafts' offsets from the first draft's row [k - 1, 1], and each sequence's
        # cache row in the head's cache [B, 1]
        self.ahead = torch.arange(1, state.k, dtype=torch.int32, device=dev).view(-1, 1)
        self.table = torch.arange(B, dtype=torch.int32, device=dev).view(-1, 1)

    def start(self, state, prompt, steps):
        nxt = state.seq[:, 1:prompt + 1]            # each position's next token (the last: the first pick)
        zeros = torch.zeros(state.batch, dtype=torch.int32, device=state.device)
        hidden = self.model.mtp_hidden(nxt, self.model.hidden, zeros)[:, -1]   # every row's K/V, the last's pick
        self._ready(self.model.mtp_picks(hidden), hidden, zeros + prompt - 1)

    def _ready(self, pick, hidden, position) -> None:
        """The first draft of each sequence, the head's state that gave it and that row's position
        (static buffers: the graph reads them)."""
        self.pick.copy_(pick)
        self.state.copy_(hidden)
        self.position.copy_(position)

    def draft(self, state):
        chain, pick, hstate = [self.pick], self.pick, self.state
        # every chained draft's positions and lengths in two launches, not a few a draft
        # (Qwen35Model.mtp_rows' rows at n = 1: row i - 1 of each)
        positions = self.position.view(1, -1) + self.ahead            # [k - 1, B]
        lengths = positions + 1
        for i in range(1, state.k):
            rows = (positions[i - 1], lengths[i - 1], self.table)
            picks, hidden = self.model.mtp_draft(pick.view(-1, 1), hstate.unsqueeze(1), positions[i - 1], rows)
            pick, hstate = picks[:, 0], hidden[:, 0]
            chain.append(pick)
        return torch.stack(chain, dim=1)

    def observe(self, state, rows, picks, kept):
        pos = state.positions() - kept.to(torch.int32)       # the verify's first row's position
        hidden = self.model.mtp_hidden(picks, self.model.hidden, pos)  # every row's K/V ...
        last = (kept - 1).clamp(min=0)
        at = torch.arange(kept.shape[0], device=kept.device)
        hidden = hidden[at, last]                             # ... the LM head for the last kept row's only
        self._ready(self.model.mtp_picks(hidden), hidden, pos + last.to(torch.int32))


def load_token_map(path: str, vocab: int) -> torch.Tensor:
    """A speculative token map (the MTP head's draft vocabulary: fastqwen token-map writes one, as
    FR-Spec's frequency-ranked maps and SGLang's speculative token map): a .pt file holding a 1-D
    integer tensor or a list of token ids (SGLang's format) or a .json list -> int64 [N] on the CPU,
    sorted. Each id in [0, vocab), none twice, at least one; an error names the first bad value."""
    if not os.path.isfile(path):
        raise ValueError(f"speculative token map {path}: no such file")
    if str(path).endswith(".json"):
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative token map {path}: not valid JSON ({e})") from None
        if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise ValueError(f"speculative token map {path}: a .json map is a list of integer token ids")
        ids = torch.tensor(raw, dtype=torch.int64)
    elif str(path).endswith(".pt"):
        raw = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(raw, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raw = torch.tensor(list(raw), dtype=torch.int64)         # FR-Spec's files hold a list
        if not isinstance(raw, torch.Tensor) or raw.dim() != 1 or raw.dtype.is_floating_point or raw.dtype == torch.bool:
            raise ValueError(f"speculative token map {path}: a .pt map holds a 1-D integer tensor or a list of token "
                             f"ids, got {type(raw).__name__}" + (f" {raw.dtype} {tuple(raw.shape)}"
                                                                if isinstance(raw, torch.Tensor) else ""))
        ids = raw.to(torch.int64)
    else:
        raise ValueError(f"speculative token map {path}: expected a .pt or .json file")
    if ids.numel() == 0:
        raise ValueError(f"speculative token map {path}: no token ids")
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if bad.numel():
        raise ValueError(f"speculative token map {path}: token id {int(ids[bad[0, 0]])} outside the vocabulary "
                         f"[0, {vocab})")
    ids = ids.sort().values
    twice = (ids[1:] == ids[:-1]).nonzero()
    if twice.numel():
        raise ValueError(f"speculative token map {path}: token id {int(ids[twice[0, 0]])} appears more than once")
    return ids


def make_drafter(spec: Speculation, vocab: int, seed: int = 0, model=None) -> Drafter:
    """The drafter of spec's mode; model: the target (the MTP head's owner, where it has one)."""
    head = model is not None and getattr(model, "has_mtp", False)
    if spec.mode in ("ngram", "auto"):
        return NgramDrafter()
    if spec.mode == "recycle":
        return RecycleDrafter(vocab)
    if spec.mode == "mtp":
        if not head:
            raise ValueError("speculation 'mtp' needs a model with its multi-token-prediction head loaded")
        return MtpDrafter(model)
    if spec.mode == "oracle":
        return OracleDrafter(spec.accept, vocab, seed, inner=MtpDrafter(model) if head else None)
    raise ValueError(f"no drafter for speculation mode {spec.mode!r}")


def timed_call(fn, device):
    """(fn(), its timing mark): a pair of CUDA events around the call on a GPU (read by marks_ms
    once the device has run it), the host's milliseconds elsewhere."""
    if torch.device(device).type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        return out, (a, b)
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def marks_ms(marks: list) -> float | None:
    """The milliseconds of timing marks (timed_call's) together, None where one is missing (timing
    was off); CUDA events must have completed."""
    if not marks or any(m is None for m in marks):
        return None
    return sum(m if isinstance(m, float) else m[0].elapsed_time(m[1]) for m in marks)


def time_ms(fn, device, reps: int = 3) -> float:
    """Milliseconds one call of fn takes on `device` (timed_call's clock), the median of reps after
    one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        _, mark = timed_call(fn, device)
        if not isinstance(mark, float):
            mark[1].synchronize()
        times.append(marks_ms([mark]))
    return sorted(times)[len(times) // 2]
