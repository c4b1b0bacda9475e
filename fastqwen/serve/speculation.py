"""The server's exact speculative decoding (the engine's `speculation` option, "ngram" or "auto"):
when every running request decodes greedily with nothing per token on the host (no grammar, no
log-probabilities), a step may be a verify: each request's last token and k drafts from prompt
lookup over its prompt and output (Engine.prompt_lookup, the device drafter's host twin), checked
in one pass of the engine's slots (fq_slots.Slots.verify_rows: each row the plain step's bits),
the agreeing drafts and the target's next pick emitted. The tokens are those plain steps would
give. "auto" verifies, with the number of drafts (1-4 .. k) that pays best, only while the running
acceptance pays for the verify's measured cost at the running batch (the engine's AutoPolicy rule).
"""
from __future__ import annotations


def accepted(drafts: list, picks: list) -> int:
    """How many leading drafts equal the target's picks (picks[j]: its pick after drafts[:j])."""
    m = 0
    while m < len(drafts) and drafts[m] == picks[m]:
        m += 1
    return m
