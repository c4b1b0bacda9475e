"""The server's exact speculative decoding (the engine's `speculation` option, "ngram" or "auto"):
when every running request decodes greedily with nothing per token on the host (no grammar, no
log-probabilities), a step may be a verify: each request's last token and k drafts from prompt
lookup over its prompt and output, checked in one pass of the engine's slots
(fq_slots.Slots.verify_rows: each row the plain step's bits), the agreeing drafts and the
target's next pick emitted. The tokens are those plain steps would give. "auto" verifies, with
the number of drafts (1-4 .. k) that pays best, only while the running acceptance pays for
the verify's measured cost at the running batch (the engine's AutoPolicy rule).
"""
from __future__ import annotations


class PromptLookup:
    """Prompt lookup over a request's growing sequence (prompt, then output): draft(k) gives the k
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
        seq, latest = self.seq, self._latest
        for t in tokens:
            seq.append(t)
            end = len(seq) - 1                 # the n-grams ending before the newest token
            for n in range(1, min(self.max_n, end) + 1):
                latest[n][tuple(seq[end - n:end])] = end - n

    def found(self) -> bool:
        """Whether the last token occurred before: draft() gives more than padding."""
        return len(self.seq) > 1 and (self.seq[-1],) in self._latest[1]

    def draft(self, k: int) -> list:
        seq = self.seq
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            start = self._latest[n].get(tuple(seq[-n:]))
            if start is not None:
                got = seq[start + n:start + n + k]
                return got + [seq[-1]] * (k - len(got))
        return [seq[-1]] * k


def ngram_draft(seq: list, k: int, max_n: int = 3) -> list:
    """PromptLookup's draft for a whole sequence at once."""
    return PromptLookup(seq, max_n).draft(k)


def accepted(drafts: list, picks: list) -> int:
    """How many leading drafts equal the target's picks (picks[j]: its pick after drafts[:j])."""
    m = 0
    while m < len(drafts) and drafts[m] == picks[m]:
        m += 1
    return m
