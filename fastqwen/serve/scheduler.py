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

from fastqwen.serve.sampling import SamplingParams, make_generator, sample

log = logging.getLogger("fastqwen.serve")


class QueueFull(RuntimeError):
    """More requests waiting than the server takes (the HTTP side answers 429)."""


@dataclass
class Event:
    """What a request gets: new text and token ids, and at the end its finish reason
    ("error": `error` says why and `status` is the HTTP status it stands for, 500 a failure,
    503 the server shutting down)."""
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None


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

    def send(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:      # the server's loop is closed (shutting down): nobody is listening
            self.cancelled = True


class Scheduler:
    """Owns an fastqwen Engine's slots in a thread of its own. submit() from any thread."""

    def __init__(self, engine, codec, max_batch: int, max_len: int, max_waiting: int = 256, seed: int = 0,
                 metrics=None, block_size: int | None = None, num_blocks: int | None = None,
                 prefill_chunk: int | None = None, share_prefixes: bool = True, state_snapshots: int | None = None):
        """block_size: the paged KV cache (pages of block_size positions, num_blocks of them; a
        request takes those its prompt and max_tokens need); None: a row of max_len positions
        per slot. prefill_chunk: the most prompt tokens prefilled between two decode steps while
        requests run (module doc); None or 0: whole prompts, any number at once. share_prefixes:
        with block_size, requests whose prompts start alike share those pages (fq_slots, where
        the model allows; a Qwen3.5 model keeps state_snapshots of its GDN states for it, None:
        fq_slots' default)."""
        self.prefill_chunk = prefill_chunk or None
        self._staged: Request | None = None          # the request being prefilled in chunks
        self.chunks = 0                              # chunks prefilled so far (a prompt in several counts each)
        self.engine, self.codec, self.metrics = engine, codec, metrics
        self.max_batch, self.max_len, self.max_waiting = max_batch, max_len, max_waiting
        self.slots = engine.slots(max_batch, max_len, page_size=block_size, num_pages=num_blocks,
                                  share_prefixes=share_prefixes, state_snapshots=state_snapshots)
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

    def submit(self, prompt: list, params: SamplingParams, loop, events) -> Request:
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (the server takes {self.max_waiting})")
        req = Request(prompt=list(prompt), params=params, loop=loop, events=events, id=next(self._ids),
                      arrived=time.monotonic())
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
        """Positions a request may hold: its prompt and max_tokens (the last token is never cached)."""
        return min(self.max_len, len(req.prompt) + req.params.max_tokens)

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
        length that fit go in together (one prompt pass)."""
        while not self.waiting.empty():
            self._held.append(self.waiting.get())
        for req in [r for r in self._held if r.cancelled]:
            self._held.remove(req)
            self._finish(req, "abort")
        if self._staged is not None:
            return self._prefill_staged()
        if not self._held or not self.slots.free:
            return False
        first = self._held[0]
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
        for req in (r for r in self._held if len(r.prompt) == n):     # in arrival order, while they fit
            if len(group) >= most or not self.slots.fits([self._reserve(r) for r in group + [req]]):
                break
            group.append(req)
        if not group:                  # the first waits for pages (paged cache)
            return False
        for req in list(group):
            if not self._prepare(req):
                self._held.remove(req)
                group.remove(req)
        if not group:
            return True
        row = len(self.slots.running)
        began = time.monotonic()
        logits = self.slots.admit_group([r.id for r in group], [r.prompt for r in group],
                                        [self._reserve(r) for r in group])
        for req in group:
            self._held.remove(req)
            self.running[req.id] = req
        firsts, failed = self._sample(logits, group)
        self._tokens[row:row + len(group)].copy_(firsts)
        tokens = firsts.tolist()
        self._pass_done(began)
        for req, tok in zip(group, tokens):
            if req in failed:
                self._fail(req, failed[req])
            else:
                self._emit(req, tok)
        return True

    def _pass_done(self, began: float) -> None:
        """A prompt pass that ended in first tokens (on the host now): its time, by how it ran."""
        last_pass = self.slots.stats()["last_pass"]
        if self.metrics is not None and last_pass is not None:
            self.metrics.pass_done(last_pass, time.monotonic() - began)

    def _prepare(self, req: Request) -> bool:
        """What a request needs once it has a slot: its detokenizer and its sampling generator.
        False: that failed, and the request has ended with the error (it never took its slot)."""
        try:
            req.detok = self.codec.detokenizer(req.params.stop)
            req.generator = make_generator(req.params, self.device, self.server_generator)
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
        logits = self.slots.prefill_next(self.prefill_chunk)
        self.chunks += 1
        if logits is None:
            return True
        self._staged = None
        row = len(self.slots.running) - 1
        self.running[req.id] = req
        first, failed = self._sample(logits[None], [req])
        self._tokens[row:row + 1].copy_(first)
        token = int(first[0])
        self._pass_done(began)
        if failed:
            self._fail(req, failed[req])
        else:
            self._emit(req, token)
        return True

    def _step(self) -> bool:
        """Queue the next step (when every running request can take one), then hand out the
        tokens of the step before it."""
        for req in list(self.running.values()):
            if req.cancelled:
                self._finish(req, "abort")
        if not self.running and self._pending is None:
            return False
        queued = None
        if self.running and all(self._can_step(r) for r in self.running.values()):
            queued = self._queue_step()
        pending, self._pending = self._pending, queued
        if pending is not None:
            self._hand_out(pending, set(queued[0]) if queued else set())
        return True

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
        tokens, failed = self._sample(logits, reqs)
        self._tokens[:n].copy_(tokens)
        host, self._turn = self._host[self._turn], 1 - self._turn
        host[:n].copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for req, exc in failed.items():      # their rows' tokens are never handed out (not running)
            self._fail(req, exc)
        return ids, host, event

    def _hand_out(self, pending: tuple, ahead: set) -> None:
        """A finished step's tokens to their requests (those still running); `ahead`: the ids
        the step queued after it includes (their slots hold one more position already)."""
        ids, host, event = pending
        if event is not None:
            event.synchronize()
        for rid, tok in zip(ids, host[:len(ids)].tolist()):
            req = self.running.get(rid)
            if req is not None:
                self._emit(req, tok, ahead=rid in ahead)

    def _emit(self, req: Request, token: int, ahead: bool = False) -> None:
        """A request's new token: text, the stop checks, the event, the slot freed at the end.
        ahead: a step after this token's is already queued for the request (its room counts
        it)."""
        now = time.monotonic()
        if req.first_token is None:
            req.first_token = now
        else:
            req.latencies.append(now - req.last_token)
        req.last_token = now
        req.output.append(token)
        try:
            finish = None
            if token in self.codec.stop_token_ids and not req.params.ignore_eos:
                text, finish = req.detok.flush(), "stop"
            else:
                text = req.detok.push(token)
                if req.detok.stopped:
                    finish = "stop"
                elif len(req.output) >= req.params.max_tokens or self.slots.room(req.id) + ahead <= 0:
                    text, finish = text + req.detok.flush(), "length"
            req.send(Event(text=text, token_ids=[token]))
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
