"""Continuous batching: requests of their own prompt lengths join and leave between decode
steps (what a server needs; Engine.generate keeps its equal-length batches).

This first form keeps the model's own caches, max_slots rows of max_len positions, with the
running requests always in the first rows: admit() prefills a prompt into the next row
(admit_group() prompts of one length together, in one prompt pass);
retire() moves the last running request's row (its K/V and recurrent states) into the freed
one. step() runs one decode step of the first `bucket` rows, bucket the smallest of 1, 2, 4,
... max_slots that holds the running requests (a row past them runs token 0 at position 0 of
its own row, and its result is dropped), each row at its own position, and returns the
running requests' logits; the caller samples and passes each request's token back in the
next step(). step_rows() is the same step with the tokens already on the device, in row
order (a server's sampled tokens, never read back before the next step is queued: the
host's work on one step's tokens overlaps the next step on the GPU). On a GPU each bucket's step is a CUDA graph (fq_decode.LogitsStep), captured
when the slots open, before any request. A row's arithmetic does not depend on the other
rows' contents, so a request's greedy tokens depend only on the bucket's row count.

Not yet here (the serving issue's later parts): a paged cache (blocks and block tables, so a
request holds memory for its own length and shared prefixes share blocks) and prefills
chunked between steps (admit() prefills a whole prompt, eagerly).
"""
from __future__ import annotations

import torch

from fq_decode import LogitsStep


class SlotError(RuntimeError):
    """A slot request the current slots cannot take (no free row, a prompt too long, ...)."""


def buckets(max_slots: int) -> list[int]:
    """The step sizes: powers of two below max_slots, then max_slots."""
    out, b = [], 1
    while b < max_slots:
        out.append(b)
        b *= 2
    return out + [max_slots]


class Slots:
    def __init__(self, model, device: torch.device, max_slots: int, max_len: int, use_graphs: bool = False,
                 tune=None):
        """tune(rows): called once per bucket before its step is built (the engine's choice of
        products at that many rows)."""
        if max_slots < 1 or max_len < 2:
            raise ValueError(f"Slots: max_slots ({max_slots}) must be >= 1 and max_len ({max_len}) >= 2")
        self.model, self.device = model, device
        self.max_slots, self.max_len = max_slots, max_len
        model.ensure_rope(max_len)
        model.allocate_cache(max_slots, max_len)
        self.closed = False                       # Engine.generate() takes the caches back
        self.keys: list = []                      # the request in each running row, in row order
        self.lengths: list[int] = []              # positions cached per running row
        self._steps = {}
        # positions go to the device through two pinned buffers used in turn, each behind an
        # event, so a step is queued without waiting on the one before it
        pinned = device.type == "cuda"
        self._positions = [torch.zeros(max_slots, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._copied = [None, None]
        self._turn = 0
        for rows in buckets(max_slots):
            if tune is not None:
                tune(rows)
            self._steps[rows] = LogitsStep(model, rows, use_graphs)

    @property
    def free(self) -> int:
        return self.max_slots - len(self.keys)

    def _check_open(self) -> None:
        if self.closed:
            raise SlotError("the engine's caches were taken back (a generate() call): open new slots")

    def admit(self, key, prompt: list[int]) -> torch.Tensor:
        """Prefill `prompt` for request `key` into the next free row; returns the last
        position's logits [vocab]."""
        return self.admit_group([key], [prompt])[0]

    def admit_group(self, keys: list, prompts: list) -> torch.Tensor:
        """Prefill prompts of one length together (one prompt pass, as Engine.generate's) into
        the next free rows; returns their last positions' logits [len(keys), vocab]."""
        self._check_open()
        if not keys or len(keys) != len(prompts):
            raise SlotError(f"admit_group: {len(keys)} keys for {len(prompts)} prompts")
        clash = [k for k in keys if k in self.keys] or [k for i, k in enumerate(keys) if k in keys[:i]]
        if clash:
            raise SlotError(f"request {clash[0]!r} is already running")
        length = len(prompts[0])
        if length == 0:
            raise SlotError("a prompt needs at least one token")
        if any(len(p) != length for p in prompts):
            raise SlotError(f"admit_group takes prompts of one length, got {sorted({len(p) for p in prompts})}")
        if length >= self.max_len:
            raise SlotError(f"a prompt of {length} tokens leaves no room to generate within max_len {self.max_len}")
        if len(keys) > self.free:
            raise SlotError(f"all {self.max_slots} slots are running" if not self.free else
                            f"{len(keys)} requests for {self.free} free slots")
        row = len(self.keys)
        ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            logits = self.model.prefill_logits(ids, row=row)
        self.keys += list(keys)
        self.lengths += [length] * len(keys)
        return logits

    def room(self, key) -> int:
        """Tokens the request can still take (step() appends one each time)."""
        return self.max_len - self.lengths[self.keys.index(key)]

    def step(self, tokens: dict) -> dict:
        """One decode step: `tokens` maps every running request to its newest token (the one
        sampled from its last logits). Returns each request's next logits [vocab]."""
        self._check_open()
        if set(tokens) != set(self.keys):
            raise SlotError(f"step() needs a token for exactly the running requests {self.keys}, "
                            f"got {sorted(tokens, key=str)}")
        ids = torch.tensor([int(tokens[k]) for k in self.keys], dtype=torch.int64, device=self.device)
        logits = self.step_rows(ids)
        return {k: logits[r] for r, k in enumerate(self.keys)}

    def step_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step with each running row's newest token in `tokens` (int64 [running],
        row order, on the device; the rows are self.keys' order). Returns the logits
        [running, vocab]: a view of the step's static buffer, valid until the next step.
        Nothing here waits on the GPU (on a GPU: the step is queued behind the work before it)."""
        self._check_open()
        n = len(self.keys)
        if tuple(tokens.shape) != (n,) or tokens.dtype != torch.int64:
            raise SlotError(f"step_rows() needs int64 tokens [{n}] (one per running request), got "
                            f"{tokens.dtype} {tuple(tokens.shape)}")
        if not n:
            raise SlotError("step_rows(): no request is running")
        full = [k for k, length in zip(self.keys, self.lengths) if length >= self.max_len]
        if full:
            raise SlotError(f"request {full[0]!r} is full ({self.max_len} positions): retire it")
        step = self._steps[next(b for b in self._steps if b >= n)]
        step.tokens[:n].copy_(tokens, non_blocking=True)
        if step.rows > n:
            step.tokens[n:].zero_()
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()         # the copy two steps back has left this buffer
        positions = self._positions[turn]
        positions[:n] = torch.tensor(self.lengths, dtype=torch.int32)
        positions[n:step.rows] = 0
        step.positions.copy_(positions[:step.rows], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        with torch.inference_mode():
            logits = step.run()
        self.lengths = [length + 1 for length in self.lengths]
        return logits[:n]

    def retire(self, key) -> tuple | None:
        """Free a request's row (finished or cancelled); the last running row moves into it.
        Returns (last, row) when a row moved (a caller's own per-row buffers move likewise),
        else None."""
        if key not in self.keys:
            return None
        row, last = self.keys.index(key), len(self.keys) - 1
        moved = None
        if row != last:
            with torch.inference_mode():
                self.model.copy_row(last, row, self.lengths[last])
            self.keys[row], self.lengths[row] = self.keys[last], self.lengths[last]
            moved = (last, row)
        self.keys.pop()
        self.lengths.pop()
        return moved
