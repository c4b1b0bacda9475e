"""Text in and out for the serving front: the checkpoint's tokenizer (Hugging Face
`tokenizers`, from tokenizer.json), its chat template rendered as Transformers renders it
(jinja2's sandbox with trim_blocks and lstrip_blocks, loop controls, Transformers' tojson,
raise_exception and strftime_now, the special tokens as variables), the tokens that end a
generation, and per request an incremental detokenizer that applies stop strings.
"""
from __future__ import annotations

import json
import pathlib
from datetime import datetime


class TextError(ValueError):
    """A request's text or messages the checkpoint cannot take; the message says why."""


def _environment():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %} ... {% endgeneration %} (Transformers' assistant-mask markers) renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value):
    """A tokenizer_config special-token entry (a string or an AddedToken dict) as its text."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextCodec:
    """A checkpoint's tokenizer, chat template and end-of-generation tokens."""

    def __init__(self, model_dir: str | pathlib.Path):
        from tokenizers import Tokenizer

        folder = pathlib.Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (fastqwen synth writes one; a released "
                                    "checkpoint carries its own)")
        self.tokenizer = Tokenizer.from_file(str(path))
        # The most characters one token stands for (a byte-level vocabulary writes one symbol a
        # byte, and a character is at least a byte): a text of more than n times this has more
        # than n tokens, which the server checks before tokenizing it.
        self.longest_token = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):         # named templates: the default one
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)
        self.special_tokens = {name: _token_text(config.get(name))
                               for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        added = config.get("additional_special_tokens") or []
        self.special_tokens["additional_special_tokens"] = [_token_text(t) for t in added]
        self._template = None
        stop = set()
        eos_text = self.special_tokens.get("eos_token")
        if eos_text is not None and self.tokenizer.token_to_id(eos_text) is not None:
            stop.add(self.tokenizer.token_to_id(eos_text))
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            stop.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.stop_token_ids = frozenset(int(t) for t in stop)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of text as the model reads it (special tokens written in it are recognized;
        no BOS is added: Qwen's tokenizers add none). The batch form without character offsets:
        the same ids, in less time and memory."""
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat template applied to messages, as Transformers' apply_chat_template(tokenize=False)."""
        if not self.chat_template:
            raise TextError("this checkpoint's tokenizer_config.json has no chat_template")
        if not isinstance(messages, list) or not messages:
            raise TextError(f"messages must be a non-empty list, got {messages!r}"[:200])
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise TextError(f"messages[{i}] must be an object with a string role, got {m!r}"[:200])
            if isinstance(m.get("content"), list):     # OpenAI's content parts: text only
                parts = m["content"]
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
                    raise TextError(f"messages[{i}].content: only text parts are supported")
                messages[i] = dict(m, content="".join(p.get("text", "") for p in parts))
            elif not isinstance(m.get("content"), str):
                raise TextError(f"messages[{i}].content must be a string, got {m.get('content')!r}"[:200])
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as exc:
            raise TextError(f"the chat template refused the messages: {exc}") from None

    def detokenizer(self, stop: tuple = ()) -> "Detokenizer":
        return Detokenizer(self, stop)


class Detokenizer:
    """One request's output text, token by token: push(id) returns the text that is final so
    far (never half a UTF-8 character, never what could still turn out to start a stop
    string); `stopped` once a stop string appeared, the text then ending before it.

    Each push decodes only the tokens since the text last ended in a whole character, with the
    piece before them (vLLM's incremental detokenizing: a tokenizer's decoding of a token may
    depend on the one before), so the 4,000th token costs what the first did; decoding the
    whole output every token cost 0.9 ms a token at 4,000 tokens, on the thread every request's
    step waits for."""

    def __init__(self, codec: TextCodec, stop: tuple = ()):
        self.codec, self.stop = codec, tuple(stop)
        self.ids: list[int] = []
        self.text = ""          # emitted so far: a prefix of _full
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._full = ""         # the text of ids[:_read], whole characters
        self._prefix = self._read = 0     # ids[_prefix:_read]: the tokens of _full's last piece

    def _advance(self, final: bool) -> None:
        """The text of the tokens past _read onto _full, once it ends in a whole character
        (final: as it is)."""
        if self._read == len(self.ids):
            return
        before = self.codec.decode(self.ids[self._prefix:self._read])
        after = self.codec.decode(self.ids[self._prefix:])
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self._full += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        self._advance(final=False)
        cut = None
        for s in self.stop:
            at = self._full.find(s, max(0, len(self.text) - len(s) + 1))
            if at != -1 and (cut is None or at < cut):
                cut = at
        if cut is not None:
            self.stopped = True
            return self._emit(cut)
        return self._emit(len(self._full) - self._hold)

    def flush(self) -> str:
        """At the end: what push held back (a possible stop-string start, a partial character)."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._emit(len(self._full))

    def _emit(self, upto: int) -> str:
        """_full's text up to `upto` not emitted yet."""
        if upto <= len(self.text):
            return ""
        new = self._full[len(self.text):upto]
        self.text += new
        return new
