"""The synthetic checkpoints' tokenizer (fastqwen/tokenizer.py): Qwen's special-token layout,
determinism, lossless text round trips, and what Transformers makes of the written files."""
from __future__ import annotations

import json
import pathlib

import pytest

from fastqwen import tokenizer as T


def test_the_4b_layout_is_qwens_own():
    ids = T.special_token_ids(151936, 151643, 151645)
    assert (ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"], ids["</think>"]) == \
        (151643, 151644, 151645, 151668)


def test_a_small_vocabulary_puts_the_config_ids_on_endoftext_and_im_end():
    ids = T.special_token_ids(4096, 4094, 4095)
    assert ids["<|endoftext|>"] == 4094 and ids["<|im_end|>"] == 4095
    assert sorted(ids.values()) == list(range(4070, 4096))
    assert ids["<|im_start|>"] == 4070                       # the others in Qwen's order
    top = T.special_token_ids(248320)
    assert sorted(top.values()) == list(range(248294, 248320)) and top["<|endoftext|>"] == 248294


def test_a_vocabulary_too_small_is_named():
    with pytest.raises(ValueError, match="no room"):
        T.special_token_ids(200)


@pytest.fixture(scope="module")
def tiny_tok():
    return T.build(4096, 4094, 4095)


def test_same_size_same_tokenizer(tiny_tok):
    assert tiny_tok.to_str() == T.build(4096, 4094, 4095).to_str()
    assert tiny_tok.get_vocab_size(with_added_tokens=True) == 4096


@pytest.mark.parametrize("text", ["Hello, world!", "  two  spaces\nand a newline\n\n",
                                  "digits 1234567 and émoji 🙂 and 中文", "<|im_start|>user\nhi<|im_end|>\n"])
def test_text_round_trips(tiny_tok, text):
    enc = tiny_tok.encode(text)
    assert tiny_tok.decode(enc.ids, skip_special_tokens=False) == text
    assert all(0 <= i < 4096 for i in enc.ids)


def test_special_tokens_encode_to_their_ids(tiny_tok):
    ids = tiny_tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 4070 and ids[-1] == 4095


def test_ids_past_the_tokens_decode_to_nothing():
    tok = T.build(1100, None, None)            # 1,074 BPE tokens, the specials on the top 26 ids
    assert tok.decode([1099 + 50, 1099 + 100]) == ""


def test_written_files_load_in_transformers(tmp_path: pathlib.Path):
    from transformers import AutoTokenizer

    ids = T.write(tmp_path, 4096, 4094, 4095)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["chat_template"] == T.CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_id == ids["<|im_end|>"] == 4095 and tok.pad_token_id == 4094 and len(tok) == 4096
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.decode(tok(text)["input_ids"]) == text


def test_the_tiny_checkpoint_carries_its_tokenizer(tiny_model: pathlib.Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    config = json.loads((tiny_model / "config.json").read_text())
    assert tok.token_to_id("<|endoftext|>") == config["bos_token_id"]
    assert tok.token_to_id("<|im_end|>") == config["eos_token_id"]


def test_past_the_trained_tokens_merges_extend_the_vocabulary(monkeypatch):
    """Beyond TRAINED_TOKENS the vocabulary is filled by merging earlier tokens: the same
    tokenizer each time, every id a token, text still round trips, and an added token decodes
    to its two parts' text."""
    monkeypatch.setattr(T, "TRAINED_TOKENS", 600)
    tok = T.build(1100)
    assert tok.to_str() == T.build(1100).to_str() and tok.get_vocab_size(with_added_tokens=True) == 1100
    text = "Extended merges keep the text: 42 apples, 7 pears."
    assert tok.decode(tok.encode(text).ids) == text
    model = json.loads(tok.to_str())["model"]
    a, b = model["merges"][-1] if isinstance(model["merges"][-1], list) else model["merges"][-1].split(" ")
    last = model["vocab"][a + b]
    assert last == 1073 and tok.decode([last]) == tok.decode([model["vocab"][a], model["vocab"][b]])


def test_the_4b_tokenizer_is_full_and_fast():
    import time

    start = time.monotonic()
    tok = T.build(151936, 151643, 151645)
    assert time.monotonic() - start < 30
    assert tok.get_vocab_size(with_added_tokens=True) == 151669 and tok.token_to_id("<|im_end|>") == 151645
    text = "A longer text, with numbers 2026 and punctuation; it must come back unchanged."
    assert tok.decode(tok.encode(text).ids) == text
