"""A deterministic byte-level BPE tokenizer for synthetic checkpoints, laid out as Qwen's.

`fastqwen synth` writes one into every checkpoint (`tokenizer.json`, `tokenizer_config.json`),
so text goes in and out of a synthetic model as it would of a released one: Hugging Face
`tokenizers` loads it, Transformers' `AutoTokenizer` too, and the chat template is
ChatML with Qwen's special tokens.

- Regular tokens: a byte-level BPE (Qwen2's pre-tokenizer split pattern, NFC, the 256 byte
  symbols first) trained with `tokenizers`' BPE trainer, up to TRAINED_TOKENS, on a synthetic
  corpus made from a seeded word generator with Zipf-like counts; past that, merges of two
  earlier tokens (the second not starting a word) in a fixed order, lowest ids first, until
  the vocabulary is full (training all 151,643 of the 4B's takes 20 s, 248,294 for Qwen3.5
  47 s; this takes about a second). The same vocabulary size gives the same tokenizer byte
  for byte.
- Special tokens: Qwen's 26 added tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ...
  `</think>`), in Qwen's order, flagged `special` as Qwen's are (the tool-call, thinking and
  code-completion tags are not: decoding without special tokens keeps them). Where the config's
  bos_token_id leaves room below the vocabulary size, they start there (Qwen3-4B:
  151,643-151,668, Qwen's own ids); otherwise they take the top 26 ids, with `<|endoftext|>`
  on the config's bos id and `<|im_end|>` on its eos id when those lie in that block (the tiny
  preset: 4094 and 4095).
- The regular tokens fill every id below the special tokens; ids above them (Qwen3-4B's
  unused embedding rows past 151,668) decode to nothing, as a released tokenizer does.
"""
from __future__ import annotations

import json
import pathlib
import random

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
)
# The added tokens Qwen's released tokenizers mark `special: false` (tokenizer.json and
# tokenizer_config.json): text the model writes and a reader parses (tool calls, thinking, code
# completion markers), which decoding with skip_special_tokens keeps.
NOT_SPECIAL = frozenset((
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
))
# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation runs, newlines, spaces).
SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# ChatML as Qwen's templates write it (system, user and assistant turns; the generation prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The corpus: English letter frequencies, words of 2-11 letters; a few digits and punctuation
# marks appear as their own words so the trainer sees them.
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_LETTER_WEIGHTS = (12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0,
                   1.9, 1.5, 1.0, 0.8, 0.15, 0.15, 0.1, 0.07)
_EXTRA_WORDS = tuple("0123456789") + (".", ",", "!", "?", ":", ";", "\n", "\n\n", "(", ")", "'", '"', "-")


def special_token_ids(vocab_size: int, bos_token_id: int | None = None,
                      eos_token_id: int | None = None) -> dict[str, int]:
    """Each special token's id in a vocabulary of vocab_size (the module note's layout)."""
    n = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n + 1:
        raise ValueError(f"a vocabulary of {vocab_size} leaves no room for the 256 byte tokens and "
                         f"{n} special tokens")
    if bos_token_id is not None and 256 < bos_token_id and bos_token_id + n <= vocab_size:
        return {tok: bos_token_id + i for i, tok in enumerate(SPECIAL_TOKENS)}
    block = list(range(vocab_size - n, vocab_size))
    fixed = {}
    if bos_token_id in block:
        fixed["<|endoftext|>"] = bos_token_id
    if eos_token_id in block and eos_token_id not in fixed.values():
        fixed["<|im_end|>"] = eos_token_id
    free = iter(i for i in block if i not in fixed.values())
    return {tok: fixed[tok] if tok in fixed else next(free) for tok in SPECIAL_TOKENS}


def _corpus(words_wanted: int, seed: int):
    """Deterministic text: distinct words drawn by letter frequency, repeated with Zipf-like counts."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < words_wanted:
        words.add("".join(rng.choices(_LETTERS, _LETTER_WEIGHTS, k=rng.randint(2, 11))))
    ordered = sorted(words)
    rng.shuffle(ordered)
    for extra in _EXTRA_WORDS:
        yield (" " + extra) * 200
    for rank, word in enumerate(ordered):
        yield (" " + word) * max(1, int(2000 / (rank + 1) ** 0.8))


TRAINED_TOKENS = 16384


def _extended(tok, regular: int):
    """tok's BPE with merges appended (two earlier tokens, the second not starting a word, pairs
    taken by the sum of their ids, lowest first) until it holds `regular` tokens."""
    from tokenizers import Tokenizer, models

    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    by_id = sorted(vocab, key=vocab.get)
    total = 0
    while len(vocab) < regular:
        for i in range(max(0, total - len(by_id) + 1), min(total, len(by_id) - 1) + 1):
            a, b = by_id[i], by_id[total - i]
            if b.startswith("\u0120") or a + b in vocab:      # "\u0120": the byte-level space
                continue
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            if len(vocab) == regular:
                break
        total += 1
    out = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    out.normalizer, out.pre_tokenizer, out.decoder = tok.normalizer, tok.pre_tokenizer, tok.decoder
    return out


def build(vocab_size: int, bos_token_id: int | None = None, eos_token_id: int | None = None, seed: int = 0):
    """The tokenizers.Tokenizer for a model of vocab_size embedding rows (module note)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = special_token_ids(vocab_size, bos_token_id, eos_token_id)
    regular = min(specials.values())
    trained = min(regular, TRAINED_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=trained, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(max(2000, 3 * trained), seed), trainer=trainer)
    if tok.get_vocab_size() == trained < regular:
        tok = _extended(tok, regular)
    if tok.get_vocab_size() != regular:
        raise RuntimeError(f"the BPE trainer reached {tok.get_vocab_size()} tokens, not the {regular} asked for")
    for name, idx in sorted(specials.items(), key=lambda kv: kv[1]):
        if tok.get_vocab_size(with_added_tokens=True) != idx:   # ids in a block are consecutive
            raise RuntimeError(f"special token {name} would get id {tok.get_vocab_size(with_added_tokens=True)}, "
                               f"not {idx}")
        token = AddedToken(name, special=name not in NOT_SPECIAL, normalized=False)
        if token.special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def write(out_dir: str | pathlib.Path, vocab_size: int, bos_token_id: int | None = None,
          eos_token_id: int | None = None, seed: int = 0, max_length: int = 32768) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json (chat template, eos/pad tokens) into
    out_dir; returns the special tokens' ids."""
    out = pathlib.Path(out_dir)
    tok = build(vocab_size, bos_token_id, eos_token_id, seed)
    tok.save(str(out / "tokenizer.json"))
    specials = special_token_ids(vocab_size, bos_token_id, eos_token_id)
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": max_length,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": t not in NOT_SPECIAL}
                                 for t, i in sorted(specials.items(), key=lambda kv: kv[1])},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return specials


def write_for_config(out_dir: str | pathlib.Path, config: dict, progress: bool = False) -> dict[str, int]:
    """write() for a model config (vocab_size, bos_token_id, eos_token_id: the first of a list,
    max_position_embeddings), with a line on stderr when progress is set (the 4B's vocabulary
    takes seconds to train)."""
    import sys
    import time

    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    start = time.monotonic()
    ids = write(out_dir, int(config["vocab_size"]), config.get("bos_token_id"), eos,
                max_length=int(config.get("max_position_embeddings", 32768)))
    if progress:
        print(f"synth: wrote tokenizer.json ({min(ids.values())} BPE tokens + {len(ids)} special, "
              f"{time.monotonic() - start:.1f} s)", file=sys.stderr, flush=True)
    return ids
