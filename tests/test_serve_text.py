"""fastqwen.serve.text: the chat template rendered as Transformers renders it, the tokens that
end a generation, and streaming text that never splits a character nor shows a stop string."""
from __future__ import annotations

import json
import pathlib

import pytest

from fastqwen import tokenizer as T
from fastqwen.serve.text import TextCodec, TextError

# Qwen-style: a system default, loop controls, tojson, raise_exception.
RICH_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and loop.last and false %}{% break %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if tools %}{{- tools | tojson }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tok")
    T.write(path, 4096, 4094, 4095)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4095, 4094]}))
    return path


def test_end_tokens_come_from_the_tokenizer_and_generation_config(folder):
    assert TextCodec(folder).stop_token_ids == {4094, 4095}


@pytest.mark.parametrize("template", [None, RICH_TEMPLATE], ids=["chatml", "rich"])
def test_chat_is_rendered_as_transformers_renders_it(folder, tmp_path, template):
    from transformers import AutoTokenizer

    if template is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / name).write_bytes((folder / name).read_bytes())
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
        folder = tmp_path
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Tell me ünïcode 🙂"}]
    ours = TextCodec(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for gen in (True, False):
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render_chat([dict(m) for m in messages], add_generation_prompt=gen) == want
    assert ours.encode(want) == theirs(want, add_special_tokens=False)["input_ids"]


def test_bad_messages_are_named(folder, tmp_path):
    codec = TextCodec(folder)
    with pytest.raises(TextError, match="non-empty list"):
        codec.render_chat([])
    with pytest.raises(TextError, match=r"messages\[1\].content must be a string"):
        codec.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": 5}])
    assert codec.render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) \
        == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"


def test_streamed_text_is_the_whole_text_without_split_characters(folder):
    codec = TextCodec(folder)
    text = "Plain words, ünïcödé, emoji 🙂🎉 and 中文 mixed in."
    ids = codec.encode(text)
    det = codec.detokenizer()
    pieces = [det.push(i) for i in ids] + [det.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5           # it streams, not all at the end


def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed(folder):
    codec = TextCodec(folder)
    ids = codec.encode("alpha beta STOP gamma delta")
    det = codec.detokenizer(stop=("STOP", "never"))
    pieces = []
    for i in ids:
        pieces.append(det.push(i))
        if det.stopped:
            break
    pieces.append(det.flush())
    assert det.stopped and "".join(pieces) == "alpha beta "
    assert not any("ST" in p for p in pieces)


def test_special_tokens_are_not_in_the_text(folder):
    codec = TextCodec(folder)
    det = codec.detokenizer()
    out = "".join(det.push(i) for i in codec.encode("hi<|im_end|>")) + det.flush()
    assert out == "hi"


def test_no_token_stands_for_more_characters_than_the_longest(folder):
    """TextCodec.longest_token bounds every token's text, so a text of more than n times it has
    more than n tokens (the server's check before tokenizing)."""
    codec = TextCodec(folder)
    assert all(len(codec.decode([i], skip_special_tokens=False)) <= codec.longest_token
               for i in range(codec.vocab_size))
    text = "Words of every length, ünïcödé, 中文, spaces    and <|im_end|> too. " * 50
    assert len(codec.encode(text)) >= len(text) / codec.longest_token


def _whole_decode_reference(codec, ids, stop):
    """The detokenizer as it was, decoding the whole output every token (with its hold-back
    clamped at the text's start: it sliced from the end when the longest stop string was
    longer than the text, and streamed the start of a stop string): (text, stopped)."""
    text, hold = "", max((len(s) for s in stop), default=1) - 1
    for n in range(1, len(ids) + 1):
        full = codec.decode(ids[:n])
        cuts = [at for s in stop if (at := full.find(s, max(0, len(text) - len(s) + 1))) != -1]
        if cuts:
            return full[:min(cuts)] if full[:min(cuts)].startswith(text) else text, True
        full = full.rstrip("\ufffd")
        upto = full[:max(0, len(full) - hold)]
        if len(upto) > len(text) and upto.startswith(text):
            text = upto
    full = codec.decode(ids)
    return (full if full.startswith(text) else text), False


def test_incremental_text_is_the_whole_decodes(folder):
    """The incremental detokenizer gives what decoding the whole output every token gave, on 400
    seeded random sequences (bytes that split characters, special tokens, stop strings cut from
    the text itself or absent)."""
    import random

    codec = TextCodec(folder)
    rng = random.Random(11)
    for _ in range(400):
        ids = [rng.randrange(codec.vocab_size) for _ in range(rng.randint(1, 60))]
        whole, stop = codec.decode(ids), ()
        if whole and rng.random() < 0.5:                 # a stop string cut from the text itself
            at = rng.randrange(len(whole))
            stop = (whole[at:at + rng.randint(1, 4)],)
        if rng.random() < 0.3:
            stop += ("never-there",)
        # (U+FFFD in a stop string never matches: a partial character is not matched until it completes)
        stop = tuple(s for s in stop if "\ufffd" not in s)
        det = codec.detokenizer(stop)
        pieces = []
        for i in ids:
            pieces.append(det.push(i))
            if det.stopped:
                break
        pieces.append(det.flush())
        assert ("".join(pieces), det.stopped) == _whole_decode_reference(codec, ids, stop), (ids, stop)


def test_a_stop_string_longer_than_the_text_so_far_holds_it_all(folder):
    """A stop string longer than the text so far holds the whole text back: the start of a stop
    string that then completes is never streamed."""
    codec = TextCodec(folder)
    ids = codec.encode(",nsnnttasps dde")
    det = codec.detokenizer(stop=("tasp", "never-there"))
    pieces = []
    for i in ids:
        pieces.append(det.push(i))
        if det.stopped:
            break
    assert det.stopped and "".join(pieces) == ",nsnnt" and not any("ta" in p for p in pieces)
