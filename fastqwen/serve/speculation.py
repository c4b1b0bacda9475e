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

import pathlib
import sys

# The engine's folder, on the path as the server's Engine import puts it (app._engine_module):
# prompt lookup on the host is the engine's (fq_spec.PromptLookup, its device drafter's twin).
ENGINE_DIR = str(pathlib.Path(__file__).resolve().parents[2] / "engine")
if ENGINE_DIR not in sys.path:
    sys.path.insert(0, ENGINE_DIR)

from fq_spec import PromptLookup  # noqa: E402

__all__ = ["PromptLookup", "ngram_draft", "accepted"]


def ngram_draft(seq: list, k: int, max_n: int = 3) -> list:
    """PromptLookup's draft for a whole sequence at once."""
    return PromptLookup(seq, max_n).draft(k)


def accepted(drafts: list, picks: list) -> int:
    """How many leading drafts equal the target's picks (picks[j]: its pick after drafts[:j])."""
    m = 0
    while m < len(drafts) and drafts[m] == picks[m]:
        m += 1
    return m
