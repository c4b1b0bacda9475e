"""Continuous batching over slots: requests of their own prompt lengths join and leave between
decode steps (what a server needs; Engine.generate keeps its equal-length batches).

This first form keeps the model's own caches: each slot is one batch row of them with room
for max_len positions. admit() prefills a prompt into a free row (that row only), step()
runs one decode step for every row, each at its own position (a row without a request runs
token 0 at position 0 of its own row, and its result is dropped), and returns the running slots' logits;
retire() frees a row. The caller samples from the logits and passes each slot's token back
in the next step(). Each row's arithmetic does not depend on the other rows' contents, so a
greedy request gets the tokens it would get in any batch of max_slots rows.

Not yet here (the serving issue's later parts): a paged cache (blocks and block tables, so a
request holds memory for its own length and shared prefixes share blocks), prefills chunked
between steps, and CUDA graphs per batch bucket (step() runs eagerly over all max_slots rows).
"""
from __future__ import annotations

import torch


class SlotError(RuntimeError):
    """A slot request the current slots cannot take (no free row, a prompt too long, ...)."""


class Slots:
    def __init__(self, model, device: torch.device, max_slots: int, max_len: int):
        if max_slots < 1 or max_len < 2:
            raise ValueError(f"Slots: max_slots ({max_slots}) must be >= 1 and max_len ({max_len}) >= 2")
        self.model, self.device = model, device
        self.max_slots, self.max_len = max_slots, max_len
        model.ensure_rope(max_len)
        model.allocate_cache(max_slots, max_len)
        self.closed = False                       # Engine.generate() takes the caches back
        self.lengths = [0] * max_slots            # positions cached per row; 0: free
        self.running: set[int] = set()
        self._tokens = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self._positions = torch.zeros(max_slots, dtype=torch.int32, device=device)

    @property
    def free(self) -> int:
        return self.max_slots - len(self.running)

    def _check_cache(self) -> None:
        if self.closed:
            raise SlotError("the engine's caches were taken back (a generate() call): open new slots")

    def admit(self, prompt: list[int]) -> tuple[int, torch.Tensor]:
        """Prefill `prompt` into a free row; returns (slot, the last position's logits [vocab])."""
        self._check_cache()
        if not prompt:
            raise SlotError("a prompt needs at least one token")
        if len(prompt) >= self.max_len:
            raise SlotError(f"a prompt of {len(prompt)} tokens leaves no room to generate within "
                            f"max_len {self.max_len}")
        slot = next((s for s in range(self.max_slots) if s not in self.running), None)
        if slot is None:
            raise SlotError(f"all {self.max_slots} slots are running")
        ids = torch.tensor([prompt], dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            logits = self.model.prefill_logits(ids, row=slot)[0]
        self.running.add(slot)
        self.lengths[slot] = len(prompt)
        return slot, logits

    def room(self, slot: int) -> int:
        """Tokens the slot can still take (step() appends one each time)."""
        return self.max_len - self.lengths[slot]

    def step(self, tokens: dict[int, int]) -> dict[int, torch.Tensor]:
        """One decode step: `tokens` maps every running slot to its newest token (the one
        sampled from its last logits). Returns each slot's next logits [vocab]."""
        self._check_cache()
        if set(tokens) != self.running:
            raise SlotError(f"step() needs a token for exactly the running slots {sorted(self.running)}, "
                            f"got {sorted(tokens)}")
        full = [s for s in tokens if self.lengths[s] >= self.max_len]
        if full:
            raise SlotError(f"slot {full[0]} is full ({self.max_len} positions): retire it")
        host_tokens = [0] * self.max_slots
        host_positions = [0] * self.max_slots
        for s, t in tokens.items():
            host_tokens[s] = int(t)
            host_positions[s] = self.lengths[s]
        self._tokens.copy_(torch.tensor(host_tokens, dtype=torch.int64))
        self._positions.copy_(torch.tensor(host_positions, dtype=torch.int32))
        with torch.inference_mode():
            logits = self.model.decode_logits(self._tokens, self._positions, self._positions + 1)
        for s in tokens:
            self.lengths[s] += 1
        return {s: logits[s] for s in tokens}

    def retire(self, slot: int) -> None:
        """Free a slot's row (a finished or cancelled request); idempotent."""
        self.running.discard(slot)
        self.lengths[slot] = 0
