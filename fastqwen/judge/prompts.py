"""Prompt token ids of text-like content, drawn fresh for every generation of a run.

With a tokenizer in the model folder, prompts are windows of the bundled public-domain corpus
at random offsets (wrapping round its end). Without one, or for a checkpoint `fastqwen synth`
made (its `fastqwen_synth.json`: its tokenizer's vocabulary is trained on generated words, not
the one its weights were trained with, since they were not), a seeded text-like id stream
stands in, as for every synthetic checkpoint before synth wrote tokenizers: Zipf-distributed "words" of one to four ids and recurring
phrases, so attention sees the repetition structure of language rather than uniform noise.
No prompt is ever handed out twice in a run: an engine cannot profit from caching one.
"""
from __future__ import annotations

import bisect
import random
from itertools import accumulate
from pathlib import Path

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"

# Synthetic stream: large enough that windows of the longest prompts rarely overlap much.
SYNTH_TOKENS = 32768
SYNTH_WORDS = 3000
SYNTH_PHRASES = 300


def _zipf_cumulative(n: int, exponent: float) -> list[float]:
    return list(accumulate(1.0 / (rank + 1) ** exponent for rank in range(n)))


def synthetic_stream(vocab_size: int, n_tokens: int = SYNTH_TOKENS, seed: int = 0) -> list[int]:
    """A deterministic text-like id stream: Zipf words, recurring phrases, ids < vocab_size."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = random.Random(f"fastqwen-synthetic-text-{vocab_size}-{seed}")
    # A random permutation decides which ids are frequent, so frequency does not track id order.
    id_rank = list(range(vocab_size))
    rng.shuffle(id_rank)
    id_cum = _zipf_cumulative(vocab_size, 1.05)

    def zipf_id() -> int:
        return id_rank[bisect.bisect_left(id_cum, rng.random() * id_cum[-1])]

    words = [[zipf_id() for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4)))] for _ in range(SYNTH_WORDS)]
    word_cum = _zipf_cumulative(len(words), 1.0)

    def zipf_word() -> list[int]:
        return words[bisect.bisect_left(word_cum, rng.random() * word_cum[-1])]

    phrases = [[tok for _ in range(rng.randint(3, 8)) for tok in zipf_word()] for _ in range(SYNTH_PHRASES)]
    out: list[int] = []
    while len(out) < n_tokens:
        if rng.random() < 0.12:
            out.extend(rng.choice(phrases))
        else:
            out.extend(zipf_word())
    return out[:n_tokens]


def corpus_stream(tokenizer_path: Path, vocab_size: int) -> list[int]:
    """The bundled corpus tokenized with the model's own tokenizer (ids >= vocab_size dropped)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = tokenizer.encode(CORPUS_PATH.read_text(encoding="utf-8"), add_special_tokens=False).ids
    return [i for i in ids if 0 <= i < vocab_size]


class PromptSource:
    """Draws batches of prompt windows from one id stream; never the same prompt twice."""

    def __init__(self, stream: list[int], seed: int, kind: str):
        if len(stream) < 2:
            raise ValueError(f"prompt stream too short ({len(stream)} ids)")
        self.stream = stream
        self.kind = kind
        self._rng = random.Random(seed)
        self._seen: set[tuple[int, ...]] = set()

    @classmethod
    def for_model(cls, model_dir: Path, vocab_size: int, seed: int) -> "PromptSource":
        tokenizer_path = Path(model_dir) / "tokenizer.json"
        if tokenizer_path.is_file() and not (Path(model_dir) / "fastqwen_synth.json").is_file():
            stream = corpus_stream(tokenizer_path, vocab_size)
            if len(stream) >= 2:
                return cls(stream, seed, kind=f"corpus windows ({len(stream)} tokens, {tokenizer_path.name})")
        return cls(synthetic_stream(vocab_size), seed, kind="synthetic text-like ids (Zipf words and phrases)")

    def _window(self, length: int) -> list[int]:
        n = len(self.stream)
        start = self._rng.randrange(n)
        reps = (start + length) // n + 1
        return (self.stream * reps)[start:start + length] if reps > 1 else self.stream[start:start + length]

    def draw(self, batch: int, length: int) -> list[list[int]]:
        """`batch` fresh windows of `length` ids, none of them handed out before in this run."""
        prompts: list[list[int]] = []
        for _ in range(batch):
            for _attempt in range(1000):
                window = self._window(length)
                key = tuple(window)
                if key not in self._seen:
                    break
            else:
                raise RuntimeError(f"could not draw an unseen prompt of length {length} from {len(self.stream)} ids")
            self._seen.add(key)
            prompts.append(window)
        return prompts
