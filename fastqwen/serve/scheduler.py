"""The serving loop: one thread owns the engine and its slots (engine/fq_slots.py); requests
from the HTTP side wait in a bounded queue, join free slots between decode steps, and each
running one gets its next token every step: sampled from its logits (sampling.py), turned
into text (text.py), checked against its end tokens, stop strings, max_tokens and the room
left in its slot. Events go back to each request's asyncio queue on the server's loop.

A request the client abandons (`cancel`) leaves its slot at the next step.

Failures are kept to the request they belong to: a request whose own work raises (its
detokenizer, its stop checks, its sampling row, its event delivery) ends alone with an error
event, and the others go on with exactly the tokens they get alone. Only a failing engine call
(a prompt pass, a step, a retirement: one computation shared by every running request) ends
every request in flight. `abort_all` (the server's shutdown) ends every request with an error
event and its tokens so far.

With `prefill_chunk` at most that many prompt tokens are prefilled between two decode steps
while others run: a longer prompt is prefilled in chunks of that many tokens, one chunk between
two steps (fq_slots.Slots.begin / prefill_next), and shorter prompts of one length go in whole
together only as many as fit in it, so the running requests' inter-token latency grows by a
chunk's time, not by the whole prompt pass's (vLLM's token budget per step). Any prompts when
nothing runs go in whole.

The loop runs one step ahead of the host. Each step's tokens are sampled on the device, kept
there as the next step's input (`Slots.step_rows`) and copied back to the host without
waiting; the next step is queued before the host turns the previous step's tokens into
text and events, so the GPU never waits for that work (measured at one stream: the host's
part was 0.5 ms of a 3.1 ms token). The cost: a request that ends (an end token,
a stop string, max_tokens, a cancel) has already been given one more step, whose token is
dropped. A step whose every request is known to end at the token in flight (max_tokens, the
slot's room) is not queued ahead.

Log-probabilities (logprobs.py) are computed on the device from a step's logits, for the rows of
the requests that asked only (one log_softmax over those rows), and copied back with the step's
tokens, behind the same event: no other wait. A request that wants its prompt's own
log-probabilities (echo with logprobs) has a prompt pass of its own that gives the logits of
every position (`admit_group(all_positions=True)`: never in chunks, sharing no prefix).

Structured output (grammar.py): a request with a grammar has a matcher; before each of its
tokens is sampled, its logits row is masked to the tokens the matcher allows, so greedy and
sampled picks obey it, and every token it emits advances the matcher; the request finishes
("stop") once the grammar is complete. A step with such a row cannot run ahead of the host
fully: its forward is queued, then the host waits for the step in flight's tokens, advances the
matchers by them, fills the masks (while the forward runs) and queues the masking and the
sampling. Steps without a grammar row take the path above, unchanged.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from fastqwen.serve import logprobs as lp
from fastqwen.serve.grammar import apply_masks, to_device
from fastqwen.serve.sampling import SamplingParams, make_generator, sample
from fastqwen.serve.speculation import accepted

log = logging.getLogger("fastqwen.serve")


class QueueFull(RuntimeError):
    """More requests waiting than the server takes (the HTTP side answers 429)."""


@dataclass
class Event:
    """What a request gets: new text and token ids (with their log-probabilities when it asked:
    logprobs.rows() items), and at the end its finish reason ("error": `error` says why and
    `status` is the HTTP status it stands for, 500 a failure, 503 the server shutting down).
    The first event of a request that asked for its prompt's log-probabilities carries them
    (logprobs.prompt_rows())."""
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass(eq=False)                      # compared and hashed as itself
class Request:
    prompt: list
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    id: int = 0
    arrived: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    output: list = field(default_factory=list)
    cancelled: bool = False
    finish_reason: str | None = None
    detok: object = None
    generator: object = None
    latencies: list = field(default_factory=list)    # seconds between tokens after the first
    grammar: object = None       # a compiled grammar (grammar.Grammars.compile) its output must follow
    matcher: object = None       # its position in the grammar (made with its slot)
    fed: int = 0                 # tokens the matcher has been given
    lookup: object = None        # the engine's prompt_lookup over its prompt and output (speculation on)

    def send(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:      # the server's loop is closed (shutting down): nobody is listening
            self.cancelled = True


class Scheduler:
    """Owns an fastqwen Engine's slots in a thread of its own. submit() from any thread."""

    def __init__(self, engine, codec, max_batch: int, max_len: int, max_waiting: int = 256, seed: int = 0,
                 metrics=None, block_size: int | None = None, num_blocks: int | None = None,
                 prefill_chunk: int | None = None, share_prefixes: bool = True, state_snapshots: int | None = None,
                 grammars=None):
        """block_size: the paged KV cache (pages of block_size positions, num_blocks of them; a
        request takes those its prompt and max_tokens need); None: a row of max_len positions
        per slot. prefill_chunk: the most prompt tokens prefilled between two decode steps while
        requests run (module doc); None or 0: whole prompts, any number at once. share_prefixes:
        with block_size, requests whose prompts start alike share those pages (fq_slots, where
        the model allows; a Qwen3.5 model keeps state_snapshots of its GDN states for it, None:
        fq_slots' default). grammars: the grammar.Grammars of the codec's tokenizer, for requests
        with a grammar (None: the server takes none)."""
        self.prefill_chunk = prefill_chunk or None
        self._staged: Request | None = None          # the request being prefilled in chunks
        self.chunks = 0                              # chunks prefilled so far (a prompt in several counts each)
        self._passed = False                         # a prompt pass ran beside running requests since their last step
        self.engine, self.codec, self.metrics = engine, codec, metrics
        self.max_batch, self.max_len, self.max_waiting = max_batch, max_len, max_waiting
        self.slots = engine.slots(max_batch, max_len, page_size=block_size, num_pages=num_blocks,
                                  share_prefixes=share_prefixes, state_snapshots=state_snapshots)
        # speculation (speculation.py): the engine's option; "auto" weighs each bucket's measured
        # plain step against its verifies of each width, timed here before any request
        self.spec_k = self.slots.k
        mode = engine.spec.mode if self.spec_k else "off"
        if mode not in ("off", "ngram", "auto"):
            raise ValueError(f"the server speculates with prompt lookup (speculation 'ngram' or 'auto'), "
                             f"not {mode!r}")
        self.spec_policy = self.slots.auto_policy() if mode == "auto" else None
        self.slots.timing = self.spec_policy is not None       # its costs follow what steps measure
        self.spec_stats = {"verify_steps": 0, "drafted": 0, "accepted": 0}
        self.slots.warm()          # the prompt passes' kernels compiled before the first request
        self._hit_tokens = 0                         # prefix hits already reported to the metrics
        self.device = engine.device
        self.server_generator = torch.Generator().manual_seed(seed)
        self.waiting: queue.Queue = queue.Queue()
        self.running: dict[int, Request] = {}          # request id -> request, in a slot
        self._held: list[Request] = []                 # taken off the queue, not yet in a slot
        # each running row's newest token on the device (the next step's input), and the step
        # whose tokens are on their way to the host: (its rows' request ids, host buffer, event)
        self._tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self._pending: tuple | None = None
        pinned = self.device.type == "cuda"
        self._host = [torch.zeros(max_batch, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self.grammars = grammars
        self._bitmask = grammars.new_bitmask(max_batch) if grammars is not None else None
        self._ids = itertools.count(1)
        self._wake = threading.Event()
        self._stop = False
        self._abort: str | None = None               # abort_all's message, until the loop has ended them
        self.thread = threading.Thread(target=self._loop, name="fastqwen-scheduler", daemon=True)
        self.thread.start()

    # ---- the HTTP side -----------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self.waiting.qsize() + len(self._held) + (self._staged is not None)

    def submit(self, prompt: list, params: SamplingParams, loop, events, grammar=None) -> Request:
        """A request into the queue; grammar: a compiled grammar (grammar.Grammars.compile) its
        output must follow."""
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (the server takes {self.max_waiting})")
        if grammar is not None and self.grammars is None:
            raise ValueError("this scheduler has no grammars: it takes no request with a grammar")
        req = Request(prompt=list(prompt), params=params, loop=loop, events=events, id=next(self._ids),
                      arrived=time.monotonic(), grammar=grammar)
        self.waiting.put(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        self._wake.set()

    def abort_all(self, message: str) -> None:
        """End every request in flight or waiting with an error event (status 503) and the tokens
        it has had (the server shutting down); from any thread."""
        self._abort = message
        self._wake.set()

    @property
    def idle(self) -> bool:
        """No request running, staged or waiting."""
        return not self.running and self.num_waiting == 0

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=30)

    @property
    def kv_usage(self) -> float:
        """The KV cache in use (fq_slots.Slots.kv_usage: pages taken, or positions cached)."""
        return self.slots.kv_usage

    def _reserve(self, req: Request) -> int:
        """Positions a request may hold: its prompt and max_tokens (the last token is never cached;
        an echo of the prompt alone, max_tokens 0, holds one more as any admission must)."""
        return min(self.max_len, len(req.prompt) + max(1, req.params.max_tokens))

    # ---- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            busy = False
            try:
                if self._abort is not None:
                    message, self._abort = self._abort, None
                    self._fail_all(message, status=503, waiting=True)
                busy = self._admit() | self._step()
            except Exception as exc:  # noqa: BLE001 - an engine call: the requests in flight end with the error
                log.exception("the engine failed; every request in flight ends with the error")
                self._fail_all(f"{type(exc).__name__}: {exc}"[:300])
            try:
                if self.metrics is not None:
                    self.metrics.gauges(len(self.running), self.num_waiting, self.kv_usage)
                    hits = self.slots.stats()["prefix_hit_tokens"]
                    if hits > self._hit_tokens:
                        self.metrics.prefix_hits(hits - self._hit_tokens)
                        self._hit_tokens = hits
            except Exception:  # noqa: BLE001 - the metrics never stop the loop
                log.exception("updating the metrics failed")
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _admit(self) -> bool:
        """Waiting requests into free slots, in arrival order; those of the first one's prompt
        length that fit go in together (one prompt pass). A request that wants its prompt's
        log-probabilities goes alone, in one whole pass."""
        while not self.waiting.empty():
            self._held.append(self.waiting.get())
        for req in [r for r in self._held if r.cancelled]:
            self._held.remove(req)
            self._finish(req, "abort")
        if self.prefill_chunk and self._passed and self.running and all(
                self._can_step(r) for r in self.running.values()):
            return False               # the chunk budget is between two steps: this loop's step first
        if self._staged is not None:
            return self._prefill_staged()
        if not self._held or not self.slots.free:
            return False
        first = self._held[0]
        if first.params.prompt_logprobs:
            if not self.slots.fits([self._reserve(first)]):
                return False           # it waits for pages (paged cache)
            return self._admit_group([first], all_positions=True)
        if self.prefill_chunk and self.running and len(first.prompt) > self.prefill_chunk:
            if not self.slots.fits([self._reserve(first)]):
                return False           # it waits for pages (paged cache)
            self._held.remove(first)
            if not self._prepare(first):
                return True
            self.slots.begin(first.id, first.prompt, self._reserve(first))
            self._staged = first
            return self._prefill_staged()
        n = len(self._held[0].prompt)
        # with a chunk budget and requests running, as many as fit in it (the first always: it is
        # no longer than the budget, else it went in chunks above)
        most = self.prefill_chunk // n if self.prefill_chunk and self.running else len(self._held)
        group = []
        for req in (r for r in self._held if len(r.prompt) == n and not r.params.prompt_logprobs):
            if len(group) >= most or not self.slots.fits([self._reserve(r) for r in group + [req]]):
                break                  # in arrival order, while they fit
            group.append(req)
        if not group:                  # the first waits for pages (paged cache)
            return False
        return self._admit_group(group)

    def _admit_group(self, group: list, all_positions: bool = False) -> bool:
        """One prompt pass for the group (held requests of one prompt length that fit), their
        first tokens sampled and sent. all_positions: a group of one that wants its prompt's
        log-probabilities (the pass gives every position's logits)."""
        for req in list(group):
            if not self._prepare(req):
                self._held.remove(req)
                group.remove(req)
        if not group:
            return True
        row = len(self.slots.running)
        began = time.monotonic()
        self._passed = bool(self.running)
        logits = self.slots.admit_group([r.id for r in group], [r.prompt for r in group],
                                        [self._reserve(r) for r in group], all_positions=all_positions)
        for req in group:
            self._held.remove(req)
            self.running[req.id] = req
        prompt_entries, failed = None, {}
        if all_positions:
            req = group[0]
            try:
                prompt_entries = lp.prompt_rows(logits[0], req.prompt, req.params.logprobs)
            except Exception as exc:  # noqa: BLE001 - this request's own work: it ends alone
                failed[req] = exc
            logits = logits[:, -1]
        firsts, failed_first, entries = self._first_tokens(logits, group)
        failed.update(failed_first)
        self._tokens[row:row + len(group)].copy_(firsts)
        tokens = firsts.tolist()
        self._pass_done(began)
        for req, tok, entry in zip(group, tokens, entries):
            if req in failed:
                self._fail(req, failed[req])
            elif req.params.max_tokens == 0:
                self._echo_only(req, prompt_entries)
            else:
                self._emit(req, tok, entry=entry, prompt=prompt_entries)
        return True

    def _pass_done(self, began: float) -> None:
        """A prompt pass that ended in first tokens (on the host now): its time, by how it ran."""
        last_pass = self.slots.stats()["last_pass"]
        if self.metrics is not None and last_pass is not None:
            self.metrics.pass_done(last_pass, time.monotonic() - began)

    def _prepare(self, req: Request) -> bool:
        """What a request needs once it has a slot: its detokenizer, its sampling generator and
        its grammar's matcher. False: that failed, and the request has ended with the error (it
        never took its slot)."""
        try:
            req.detok = self.codec.detokenizer(req.params.stop)
            req.generator = make_generator(req.params, self.device, self.server_generator)
            if req.grammar is not None:
                req.matcher = self.grammars.matcher(req.grammar)
        except Exception as exc:  # noqa: BLE001 - this request's own parameters: it ends alone
            self._fail(req, exc)
            return False
        return True

    def _sample(self, logits, reqs: list) -> tuple:
        """Each row's token (sampling.sample) and {request: exception} for the rows whose own
        draw failed (their tokens meaningless; the other rows' draws are as without them)."""
        failed = {}
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], failed=failed)
        return tokens, {reqs[row]: exc for row, exc in failed.items()}

    def _first_tokens(self, logits, reqs: list) -> tuple:
        """The first tokens after a prompt pass (logits [len(reqs), vocab]): masked by the
        requests' fresh matchers, sampled, with the log-probabilities of those that asked (on the
        host: the caller reads the tokens there anyway). Returns (tokens on the device,
        {request: exception}, each request's entry or None)."""
        masked = [row for row, req in enumerate(reqs) if req.matcher is not None]
        failed = self._mask(logits, reqs, masked) if masked else {}
        tokens, failed_draws = self._sample(logits, reqs)
        failed.update(failed_draws)
        entries = [None] * len(reqs)
        asked = [row for row, req in enumerate(reqs) if req.params.logprobs is not None]
        if asked:
            try:
                rows = self._queue_logprobs(logits, tokens, reqs, asked, wait=True)
                for row, entry in zip(asked, self._host_logprobs(rows)):
                    entries[row] = entry
            except Exception as exc:  # noqa: BLE001 - the askers' own work: they end alone
                failed.update({reqs[row]: exc for row in asked if reqs[row] not in failed})
        return tokens, failed, entries

    def _mask(self, logits, reqs: list, masked: list) -> dict:
        """Mask logits rows `masked` (of reqs' rows) to the tokens their matchers allow next;
        returns {request: exception} for those rows if that failed (their grammars' own work)."""
        try:
            self.grammars.fill([req.matcher for req in reqs], self._bitmask)
            with torch.inference_mode():          # the engine's logits are inference tensors
                apply_masks(logits, self._bitmask, masked)
        except Exception as exc:  # noqa: BLE001 - the grammar rows' own work: they end alone
            return {reqs[row]: exc for row in masked}
        return {}

    def _queue_logprobs(self, logits, tokens, reqs: list, asked: list, wait: bool = False) -> tuple:
        """The askers' log-probabilities (logprobs.device_rows over their rows only), queued on
        the device with their copies to the host; _host_logprobs reads them once the step's
        event has passed (wait: the copies are done on return). Returns (asked rows, each one's
        top count, the three host tensors)."""
        top = max(reqs[row].params.logprobs for row in asked)
        if len(asked) < len(reqs):
            index = to_device(torch.tensor(asked, dtype=torch.int64), logits.device)
            logits, tokens = logits[index], tokens[index]
        found = lp.device_rows(logits, tokens, top)
        host = tuple(None if t is None else t.to("cpu", non_blocking=not wait) for t in found)
        return asked, [reqs[row].params.logprobs for row in asked], host

    @staticmethod
    def _host_logprobs(queued: tuple) -> list:
        """_queue_logprobs' result as one logprobs.rows() entry per asked row."""
        _, tops, (chosen, ids, values) = queued
        return lp.host_rows(chosen, ids, values, tops)

    def _fail(self, req: Request, exc, status: int = 500) -> None:
        """One request's own failure: it ends alone with an error event (its slot freed)."""
        message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, str):
            log.error("request %d failed alone: %s", req.id, message, exc_info=exc)
        self._finish(req, "error", message[:300], status)

    def _prefill_staged(self) -> bool:
        """The staged request's next chunk; after its last it runs, its first token sampled and sent."""
        req = self._staged
        if req.cancelled:
            self._staged = None
            self.slots.retire(req.id)
            self._finish(req, "abort")
            return True
        began = time.monotonic()
        self._passed = bool(self.running)
        logits = self.slots.prefill_next(self.prefill_chunk)
        self.chunks += 1
        if logits is None:
            return True
        self._staged = None
        row = len(self.slots.running) - 1
        self.running[req.id] = req
        first, failed, (entry,) = self._first_tokens(logits[None], [req])
        self._tokens[row:row + 1].copy_(first)
        token = int(first[0])
        self._pass_done(began)
        if failed:
            self._fail(req, failed[req])
        else:
            self._emit(req, token, entry=entry)
        return True

    def _step(self) -> bool:
        """Queue the next step (when every running request can take one), then hand out the
        tokens of the step before it."""
        for req in list(self.running.values()):
            if req.cancelled:
                self._finish(req, "abort")
        if not self.running and self._pending is None:
            return False
        width = self._speculate_now()
        if width:
            self._verify_step(width)
            return True
        queued = None
        if self.running and all(self._can_step(r) for r in self.running.values()):
            queued = self._queue_step()
        pending, self._pending = self._pending, queued
        if pending is not None:
            self._hand_out(pending, set(queued[0]) if queued else set())
        return True

    def _can_verify(self, req: Request) -> bool:
        """Whether the request can be one row of a verify now: greedy, nothing per token on the host
        (no grammar, no log-probabilities), room for k + 1 positions and two tokens to go."""
        in_flight = self._pending is not None and req.id in self._pending[0]
        return (self._speculable(req) and self.slots.room(req.id) >= self.spec_k + 1
                and req.params.max_tokens - len(req.output) - in_flight >= 2)

    @staticmethod
    def _speculable(req: Request) -> bool:
        """A greedy request with nothing per token on the host, past its first token: its tokens
        can come from a verify (_can_verify), and a plain step's count for auto's acceptance."""
        return bool(req.params.greedy and req.matcher is None and req.params.logprobs is None and req.output)

    def _speculate_now(self) -> int:
        """This step's drafts a request, 0 for a plain step (speculation.py): a verify where every
        running request can take one and, with "auto", of the width that pays best at the running
        acceptance and this batch's costs, if any does."""
        if not self.spec_k or not self.running or not all(self._can_verify(r) for r in self.running.values()):
            return 0
        policy = self.spec_policy
        if policy is None:
            return self.spec_k
        return policy.next_width(len(self.running))

    def _verify_step(self, k: int) -> None:
        """One verify of every running request (all greedy): the step in flight's tokens handed out
        first (the drafts continue them), then each row's last token and k drafts through the
        slots' verify, the agreeing drafts and the target's next pick emitted, the slots told what
        each row keeps."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._hand_out(pending, set())
        ids = list(self.slots.running)
        reqs = [self.running[i] for i in ids]
        if not reqs or not all(self._can_verify(r) for r in reqs):
            return                          # the next step is a plain one
        drafts = [self._lookup(r).draft(k) for r in reqs]
        rows = torch.tensor([[r.output[-1]] + d for r, d in zip(reqs, drafts)], dtype=torch.int64)
        picks = self.slots.verify_rows(rows.to(self.device)).tolist()
        self._passed = False
        if self.spec_policy is not None:          # the verify has finished (its picks are read)
            timing = self.slots.last_timing
            self.spec_policy.observe_cost(timing[0], timing[1], self.slots.timing_ms(timing))
        # the policy's drafts right and rows with a wrong one; the stats' drafts checked
        emits, right, rejected, drafted = [], 0, 0, 0
        for r, d, p, most in zip(reqs, drafts, picks, self.slots.verify_keep):
            # the drafts the verify checked: a wide Qwen3.5 verify runs no row from a chunk's close on
            checked = min(k, most - 1)
            matched = min(accepted(d, p), checked)
            right, rejected, drafted = right + matched, rejected + (matched < checked), drafted + checked
            emits.append(p[:min(matched + 1, r.params.max_tokens - len(r.output))])
        self.slots.commit([len(e) for e in emits])
        self._tokens[:len(reqs)].copy_(torch.tensor([e[-1] for e in emits], dtype=torch.int64))
        kept = sum(len(e) - 1 for e in emits)
        self.spec_stats["verify_steps"] += 1
        self.spec_stats["drafted"] += drafted
        self.spec_stats["accepted"] += kept
        if self.spec_policy is not None:
            self.spec_policy.observe_verify(right, rejected)
        if self.metrics is not None:
            self.metrics.speculated(drafted, kept)
        for r, e in zip(reqs, emits):
            for tok in e:
                if self.running.get(r.id) is not r:
                    break                     # it ended (an end token, a stop string): the rest dropped
                self._emit(r, tok)

    def _lookup(self, req: Request):
        """The request's prompt lookup (Engine.prompt_lookup), caught up with its output."""
        if req.lookup is None:
            req.lookup = self.engine.prompt_lookup(req.prompt)
        have = len(req.lookup.seq) - len(req.prompt)
        if have < len(req.output):
            req.lookup.extend(req.output[have:])
        return req.lookup

    def _can_step(self, req: Request) -> bool:
        """Whether the request takes another step after the one in flight (if any): room in its
        slot, and max_tokens not reached by the token in flight."""
        in_flight = self._pending is not None and req.id in self._pending[0]
        return self.slots.room(req.id) >= 1 and len(req.output) + in_flight < req.params.max_tokens

    def _queue_step(self) -> tuple:
        ids = list(self.slots.running)
        reqs = [self.running[i] for i in ids]
        n = len(ids)
        logits = self.slots.step_rows(self._tokens[:n])
        self._passed = False
        timing = self.slots.last_timing if self.slots.timing else None
        masked = [row for row, req in enumerate(reqs) if req.matcher is not None]
        failed = {}
        if masked:
            # the forward is queued; its rows' masks need the tokens of the step in flight first
            failed.update(self._feed_pending())
            failed.update(self._mask(logits, reqs, masked))
        tokens, failed_draws = self._sample(logits, reqs)
        failed.update(failed_draws)
        self._tokens[:n].copy_(tokens)
        host, self._turn = self._host[self._turn], 1 - self._turn
        host[:n].copy_(tokens, non_blocking=True)
        asked = [row for row, req in enumerate(reqs) if req.params.logprobs is not None]
        queued_logprobs = None
        if asked:
            try:
                queued_logprobs = self._queue_logprobs(logits, tokens, reqs, asked)
            except Exception as exc:  # noqa: BLE001 - the askers' own work: they end alone
                failed.update({reqs[row]: exc for row in asked if reqs[row] not in failed})
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for req, exc in failed.items():      # their rows' tokens are never handed out (not running)
            if req.finish_reason is None:
                self._fail(req, exc)
        return ids, host, event, queued_logprobs, timing

    def _feed_pending(self) -> dict:
        """Wait for the step in flight's tokens and give them to their requests' matchers (before
        the next step's masks); returns {request: exception} for a matcher that raised."""
        failed = {}
        if self._pending is None:
            return failed
        ids, host, event, *_ = self._pending
        if event is not None:
            event.synchronize()
        for rid, tok in zip(ids, host[:len(ids)].tolist()):
            req = self.running.get(rid)
            if req is not None and req.matcher is not None and req.fed == len(req.output):
                try:
                    self._feed(req, tok)
                except Exception as exc:  # noqa: BLE001 - this request's grammar: it ends alone
                    failed[req] = exc
        return failed

    def _feed(self, req: Request, token: int) -> None:
        """Advance the request's matcher by its token (never refused under its mask)."""
        if not req.matcher.accept(token):
            log.warning("request %d: its grammar refused token %d (%s)", req.id, token, req.matcher.error)
        req.fed += 1

    def _hand_out(self, pending: tuple, ahead: set) -> None:
        """A finished step's tokens to their requests (those still running); `ahead`: the ids
        the step queued after it includes (their slots hold one more position already)."""
        ids, host, event, queued_logprobs, timing = pending
        if event is not None:
            event.synchronize()
        if timing is not None and self.spec_policy is not None:     # the step has finished
            self.spec_policy.observe_cost(timing[0], timing[1], self.slots.timing_ms(timing))
        entries = {}
        if queued_logprobs is not None:
            try:
                found = self._host_logprobs(queued_logprobs)
                entries = {ids[row]: entry for row, entry in zip(queued_logprobs[0], found)}
            except Exception as exc:  # noqa: BLE001 - the askers' own work: they end alone
                for row in queued_logprobs[0]:
                    req = self.running.get(ids[row])
                    if req is not None:
                        self._fail(req, exc)
        right = wrong = 0
        for rid, tok in zip(ids, host[:len(ids)].tolist()):
            req = self.running.get(rid)
            if req is not None:
                if self.spec_policy is not None and self._speculable(req):
                    # auto: the draft prompt lookup would have made for this token, against it
                    hit = self._lookup(req).draft(1)[0] == tok
                    right, wrong = right + hit, wrong + (not hit)
                self._emit(req, tok, ahead=rid in ahead, entry=entries.get(rid))
        if right + wrong:
            self.spec_policy.observe_shadow(right, wrong)

    def _echo_only(self, req: Request, prompt) -> None:
        """A request for its prompt alone (echo, max_tokens 0): the prompt's log-probabilities
        (if it asked), then the end, reason "length"."""
        try:
            req.send(Event(prompt_logprobs=prompt))
        except Exception as exc:  # noqa: BLE001 - its delivery: it ends alone
            self._fail(req, exc)
            return
        self._finish(req, "length")

    def _emit(self, req: Request, token: int, ahead: bool = False, entry=None, prompt=None) -> None:
        """A request's new token: its grammar advanced, text, the stop checks, the event, the slot
        freed at the end. ahead: a step after this token's is already queued for the request (its
        room counts it). entry: the token's log-probabilities (logprobs.rows() item) if it asked;
        prompt: its prompt's (the first token of a request that asked)."""
        now = time.monotonic()
        if req.first_token is None:
            req.first_token = now
        else:
            req.latencies.append(now - req.last_token)
        req.last_token = now
        req.output.append(token)
        try:
            complete = False
            if req.matcher is not None:
                if req.fed < len(req.output):
                    self._feed(req, token)
                complete = req.matcher.is_terminated()
            finish = None
            if token in self.codec.stop_token_ids and not req.params.ignore_eos:
                text, finish = req.detok.flush(), "stop"
            else:
                text = req.detok.push(token)
                if req.detok.stopped:
                    finish = "stop"
                elif complete:                     # the grammar's value is whole: nothing may follow
                    text, finish = text + req.detok.flush(), "stop"
                elif len(req.output) >= req.params.max_tokens or self.slots.room(req.id) + ahead <= 0:
                    text, finish = text + req.detok.flush(), "length"
            req.send(Event(text=text, token_ids=[token], logprobs=None if entry is None else [entry],
                           prompt_logprobs=prompt))
        except Exception as exc:  # noqa: BLE001 - this request's text or delivery: it ends alone
            self._fail(req, exc)
            return
        if finish is not None:
            self._finish(req, finish)

    def _finish(self, req: Request, reason: str, error: str | None = None, status: int | None = None) -> None:
        if self.running.get(req.id) is req:
            del self.running[req.id]
            moved = self.slots.retire(req.id)
            if moved is not None:      # the last row moved into the freed one: its newest token too
                last, row = moved
                self._tokens[row].copy_(self._tokens[last])
        req.finish_reason = reason
        try:
            if self.metrics is not None:
                self.metrics.finished(req)
        except Exception:  # noqa: BLE001 - the metrics never keep a request from ending
            log.exception("counting request %d failed", req.id)
        try:
            req.send(Event(finish_reason=reason, error=error, status=status if reason == "error" else None))
        except Exception:  # noqa: BLE001 - its listener is gone: nothing more to tell it
            log.exception("ending request %d: its event could not be delivered", req.id)

    def _fail_all(self, message: str, status: int = 500, waiting: bool = False) -> None:
        """Every request in flight ends with an error event (an engine call failed, or the
        server shuts down); waiting: those queued for a slot too."""
        self._pending = None
        ended = list(self.running.values())
        if self._staged is not None:                  # a prompt being prefilled in chunks
            ended.append(self._staged)
        # a group whose prompt pass failed (prepared, not running), or with `waiting` every one queued
        while waiting and not self.waiting.empty():
            self._held.append(self.waiting.get())
        held = [r for r in self._held if waiting or r.detok is not None]
        for req in held:
            self._held.remove(req)
        for req in ended + held:
            try:
                if req is self._staged:
                    self._staged = None
                    self.slots.retire(req.id)
                self._finish(req, "error", message, status)
            except Exception:  # noqa: BLE001 - its slot could not be freed; it ends all the same
                log.exception("retiring request %d failed", req.id)
                self.running.pop(req.id, None)
                req.finish_reason = "error"
                try:
                    req.send(Event(finish_reason="error", error=message, status=status))
                except Exception:  # noqa: BLE001 - nobody to tell
                    pass
