"""The server's exact speculative decoding (the engine's `speculation` option, "ngram" or "auto"):
when every running request decodes greedily with nothing per token on the host (no grammar, no
log-probabilities), a step may be a verify: each request's last token and k drafts from prompt
lookup over its prompt and output, checked in one pass of the engine's slots
(fq_slots.Slots.verify_rows: each row the plain step's bits), the agreeing drafts and the
target's next pick emitted. The tokens are those plain steps would give. "auto" verifies, with
the number of drafts (1, 2, 4 .. k) that pays best, only while the running acceptance pays for
the verify's measured cost at the running batch (the engine's AutoPolicy rule).
"""
from __future__ import annotations


def ngram_draft(seq: list, k: int, max_n: int = 3) -> list:
    """Prompt lookup: the k tokens after the latest earlier occurrence of seq's last n tokens (n
    from max_n down to 1), padded with the last token; none found: the last token k times."""
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i:i + n] == tail:
                found = seq[i + n:i + n + k]
                return found + [seq[-1]] * (k - len(found))
    return [seq[-1]] * k


def accepted(drafts: list, picks: list) -> int:
    """How many leading drafts equal the target's picks (picks[j]: its pick after drafts[:j])."""
    m = 0
    while m < len(drafts) and drafts[m] == picks[m]:
        m += 1
    return m


class Seen:
    """The tokens a request has had (prompt and output), kept as they come: whether its last token
    occurred before, i.e. whether prompt lookup drafts more than padding for it."""

    def __init__(self, prompt: list):
        self.tokens, self.upto = set(prompt), 0

    def last_repeats(self, output: list) -> bool:
        self.tokens.update(output[self.upto:-1])
        self.upto = max(self.upto, len(output) - 1)
        return bool(output) and output[-1] in self.tokens
