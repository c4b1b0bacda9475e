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
