"""OpenAI `tools` / `tool_choice` in Qwen's tool-call format.

Qwen3's chat template lists the tools as JSON lines inside <tools></tools> in the system
message, and the model calls them as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block a call (several calls: blocks separated by a newline). An assistant turn that called
tools is rendered back the same way, and tool results go in a user turn as
<tool_response>\\n...\\n</tool_response> blocks, consecutive tool messages sharing one turn.

- `tools_from_request(body)` checks `tools`, `tool_choice` and `parallel_tool_calls` into a
  `ToolSet` (None when the request has no tools), raising `ToolError` (a ValueError whose
  message and `.param` name the parameter).
- `prepare_messages(messages, toolset, chat_template)` turns OpenAI messages (assistant
  `tool_calls`, role "tool") into what the template renders, and gives the keyword arguments for
  TextCodec.render_chat. A template that knows tools (Qwen's) gets the tools and messages as
  Transformers passes them; one that does not (plain ChatML, as `fastqwen synth` writes) gets
  messages already written in Qwen's form, so the prompt is the same text either way.
- `ToolSet.grammar_spec()`: for tool_choice "required" or a named function, the grammar.py spec
  that forces the whole output to be tool calls of the allowed functions with their argument
  schemas (None otherwise).
- `parse_tool_calls(text, names)` splits generated text into content and OpenAI `tool_calls`;
  a block that is not a JSON call of a known function stays in the content. `ToolStream` does
  the same for a stream: text before any <tool_call> goes out as it comes.

tool_choice "none" leaves the tools out of the prompt and the output unparsed.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from fastqwen.serve.grammar import GrammarSpec, schema_text

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_ID_CHARS = string.ascii_letters + string.digits


class ToolError(ValueError):
    """A bad tools / tool_choice / messages value; `param` names the request parameter."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict          # a JSON schema ({"type": "object", "properties": {}} when the request gave none)
    strict: bool | None = None

    def as_openai(self) -> dict:
        """The tool as OpenAI's request carries it (what Qwen's template writes into <tools>)."""
        function = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSet:
    tools: tuple
    choice: str = "auto"             # "none" | "auto" | "required" | "function"
    function: str | None = None      # the named function when choice == "function"
    parallel: bool = True            # parallel_tool_calls: several calls in one turn

    @property
    def names(self) -> frozenset:
        return frozenset(t.name for t in self.tools)

    @property
    def in_prompt(self) -> bool:
        """Whether the tools are rendered into the prompt and the output parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    def grammar_spec(self) -> GrammarSpec | None:
        """The forced-call grammar for "required" (one call, or several with parallel, of any
        tool) and for a named function (one call of it); None for "auto" and "none"."""
        if self.choice == "required":
            chosen, repeat, param = self.tools, self.parallel, "tools"
        elif self.choice == "function":
            index = next(i for i, t in enumerate(self.tools) if t.name == self.function)
            chosen, repeat, param = (self.tools[index],), False, f"tools[{index}].function.parameters"
        else:
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return GrammarSpec("tool_calls", schema_text(schema, param), repeat=repeat, param=param)


def tools_from_request(body: dict) -> ToolSet | None:
    """tools, tool_choice and parallel_tool_calls of a chat request, checked; None when the
    request has no tools and no tool_choice that needs them."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise ToolError(f"{old} is not supported (OpenAI's deprecated form); use tools and tool_choice", old)
    raw = body.get("tools")
    tools = []
    if raw is not None:
        if not isinstance(raw, list):
            raise ToolError(f"tools must be a list, got {raw!r}"[:200], "tools")
        for i, t in enumerate(raw):
            tools.append(_tool(t, i))
        names = [t.name for t in tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ToolError(f"tools: the function name {dup!r} appears more than once", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {parallel!r}"[:200], "parallel_tool_calls")
    choice, function = _choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    return ToolSet(tuple(tools), choice, function, parallel)


def _tool(t, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise ToolError(f"{where} must be an object, got {t!r}"[:200], where)
    if t.get("type") != "function":
        raise ToolError(f"{where}.type must be 'function', got {t.get('type')!r}"[:200], f"{where}.type")
    f = t.get("function")
    if not isinstance(f, dict):
        raise ToolError(f"{where}.function must be an object with a name, got {f!r}"[:200], f"{where}.function")
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"[:200],
                        f"{where}.function.name")
    description = f.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string, got {description!r}"[:200],
                        f"{where}.function.description")
    parameters = f.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object, got {parameters!r}"[:200],
                        f"{where}.function.parameters")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolError(f"{where}.function.parameters must describe an object (type 'object'), got type {kind!r}"
                        [:200], f"{where}.function.parameters")
    schema_text(parameters, f"{where}.function.parameters")       # JSON-serializable
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict must be true or false, got {strict!r}"[:200],
                        f"{where}.function.strict")
    return Tool(name, description, parameters, strict)


def _choice(value, tools: list) -> tuple:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ToolError("tool_choice 'required' needs tools", "tool_choice")
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        f = value.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str):
            raise ToolError(f"tool_choice.function.name must be a string, got {name!r}"[:200],
                            "tool_choice.function.name")
        if name not in {t.name for t in tools}:
            raise ToolError(f"tool_choice.function.name {name!r} is not the name of a function in tools"[:200],
                            "tool_choice.function.name")
        return "function", name
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or "
                    f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}'[:200], "tool_choice")


# ---- messages ----------------------------------------------------------------------------

def template_knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools, tool calls and tool results itself (Qwen's do)."""
    return bool(chat_template) and "tools" in chat_template and "tool_call" in chat_template


def _text(content, where: str) -> str:
    """A message's content as text (None: empty; OpenAI's text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ToolError(f"{where}.content must be a string or a list of text parts, got {content!r}"[:200],
                    f"{where}.content")


def _calls(m: dict, where: str) -> list:
    """An assistant message's tool_calls checked, as [(call, name, arguments JSON text)]."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise ToolError(f"{where}.tool_calls must be a list, got {calls!r}"[:200], f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolError(f"{at} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}, got {c!r}"
                            [:200], at)
        args = f.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise ToolError(f"{at}.function.arguments must be a JSON string, got {args!r}"[:200],
                            f"{at}.function.arguments")
        out.append((c, f["name"], args))
    return out


def _call_text(name: str, arguments: str) -> str:
    """One call as Qwen's template writes it."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{CLOSE}'


def _tools_block(tools) -> str:
    """The system-message text Qwen3's template writes for tools (after any system content)."""
    lines = "".join("\n" + json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            + lines + "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def prepare_messages(messages, toolset: ToolSet | None, chat_template: str | None) -> tuple:
    """(messages, render_kwargs) for TextCodec.render_chat(messages, **render_kwargs): tool
    calls and tool results checked and written as the template expects (module note)."""
    if not isinstance(messages, list):
        return messages, {}          # render_chat reports the shape error
    knows = template_knows_tools(chat_template)
    tools = toolset.tools if toolset is not None and toolset.in_prompt else ()
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        where = f"messages[{i}]"
        role = m.get("role")
        if role == "tool":
            content = _text(m.get("content"), where)
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ToolError(f"{where}.tool_call_id must be a string (the id of the call it answers), "
                                f"got {call_id!r}"[:200], f"{where}.tool_call_id")
            if knows:
                out.append({**m, "content": content})
            else:       # consecutive results share one user turn
                block = f"<tool_response>\n{content}\n</tool_response>"
                if i > 0 and isinstance(messages[i - 1], dict) and messages[i - 1].get("role") == "tool":
                    out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
                else:
                    out.append({"role": "user", "content": block})
        elif role == "assistant" and m.get("tool_calls") is not None:
            content = _text(m.get("content"), where)
            calls = _calls(m, where)
            if knows:
                out.append({**m, "content": content,
                            "tool_calls": [{**c, "function": {**c["function"], "arguments": a}} for c, _, a in calls]})
            else:
                text = content + ("\n" if content and calls else "") + "\n".join(_call_text(n, a) for _, n, a in calls)
                out.append({"role": "assistant", "content": text})
        elif role == "assistant" and m.get("content") is None:
            out.append({**m, "content": ""})
        else:
            out.append(m)
    if not tools:
        return out, {}
    if knows:
        return out, {"tools": [t.as_openai() for t in tools]}
    system = ""
    if out and isinstance(out[0], dict) and out[0].get("role") == "system":
        system = _text(out[0].get("content"), "messages[0]") + "\n\n"
        out = out[1:]
    return [{"role": "system", "content": system + _tools_block(tools)}] + out, {}


# ---- output ------------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ParsedOutput:
    content: str | None                 # None when the output was tool calls only
    tool_calls: list = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish reason "tool_calls" when calls were made, else None (the engine's stays)."""
        return "tool_calls" if self.tool_calls else None


def _call(body: str, names, new_id) -> dict | None:
    """One block's JSON as an OpenAI tool call, or None when it is not a call of a known function."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str, names=None, new_id=new_call_id) -> ParsedOutput:
    """Generated text as content and tool calls: every <tool_call>...</tool_call> block (and a
    last block the output ended inside) holding {"name": a function in `names` (any when None),
    "arguments": an object} becomes a call; anything else, malformed blocks included, stays
    content (stripped; None when nothing but calls is left)."""
    if OPEN not in text:
        return ParsedOutput(text)
    calls, kept, at = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _call((match.group(1) if match.group(1) is not None else match.group(2)).strip(), names, new_id)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[at:match.start()])
        at = match.end()
    if not calls:
        return ParsedOutput(text)
    kept.append(text[at:])
    content = "".join(kept).strip()
    return ParsedOutput(content or None, calls)


# A call block's head, up to where its arguments object begins: the name is known from here on.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class ToolStream:
    """parse_tool_calls for a stream, OpenAI's streamed form. push(delta) returns (content that can
    go out now, tool-call deltas): the text before a <tool_call> (never a partial tag); inside a
    block whose JSON starts {"name": <a known function>, "arguments": {, first the call's
    header ({index, id, type, function: {name, arguments: ""}}), then each piece of the
    arguments object as it is generated ({index, function: {arguments}}), so the pieces joined
    are the object's JSON text. A block in another shape is held to its end and parsed whole
    (a call, or content). finish() returns (content still to send or None, the last call deltas,
    "tool_calls" when calls were made, else None)."""

    def __init__(self, names=None, new_id=new_call_id):
        self.names, self.new_id = names, new_id
        self._held = ""          # outside a block: a possible partial tag; inside: the block so far
        self._in_call = False
        self._streaming = False  # the block's header went out; its arguments stream
        self._scan = 0           # how much of the held block the arguments scanner has read
        self._depth, self._in_string, self._escape, self._args_done = 0, False, False, False
        self.calls = 0

    def push(self, delta: str) -> tuple:
        content, deltas = [], []
        text = delta
        while text:
            if not self._in_call:
                text = self._held + text
                self._held = ""
                at = text.find(OPEN)
                if at < 0:
                    keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1)
                                 if OPEN.startswith(text[-k:])), 0)
                    self._held = text[len(text) - keep:]
                    self._content(content, text[:len(text) - keep])
                    break
                self._content(content, text[:at])
                self._in_call, self._held, self._streaming = True, "", False
                text = text[at + len(OPEN):]
                continue
            self._held += text
            text = self._advance(deltas, content)
        return "".join(content), deltas

    def _content(self, content: list, piece: str) -> None:
        # the newlines between and after call blocks are the format's, not content
        if piece and (piece.strip() or not self.calls):
            content.append(piece)

    def _advance(self, deltas: list, content: list) -> str:
        """Inside a block: the header and argument deltas the held text allows (a block that is no
        call goes to content at its end); returns the text after the block's end, or "" while the
        block goes on."""
        if not self._streaming:
            head = _HEAD.match(self._held)
            if head is not None:
                try:
                    name = json.loads(f'"{head.group(1)}"')
                except ValueError:
                    name = None
                if name is not None and (self.names is None or name in self.names):
                    deltas.append({"index": self.calls, "id": self.new_id(), "type": "function",
                                   "function": {"name": name, "arguments": ""}})
                    self._streaming, self._scan = True, head.end()
                    self._depth, self._in_string, self._escape, self._args_done = 0, False, False, False
        if self._streaming and not self._args_done:
            start = self._scan
            for j in range(start, len(self._held)):
                ch = self._held[j]
                self._scan = j + 1
                if self._in_string:
                    if self._escape:
                        self._escape = False
                    elif ch == "\\":
                        self._escape = True
                    elif ch == '"':
                        self._in_string = False
                elif ch == '"':
                    self._in_string = True
                elif ch == "{":
                    self._depth += 1
                elif ch == "}":
                    self._depth -= 1
                    if self._depth == 0:
                        self._args_done = True
                        break
            if self._scan > start:
                deltas.append({"index": self.calls, "function": {"arguments": self._held[start:self._scan]}})
        end = self._held.find(CLOSE)
        if end < 0 or (self._streaming and not self._args_done and end >= self._scan):
            return ""
        rest = self._held[end + len(CLOSE):]
        if self._streaming:
            self.calls += 1
        else:                    # a block in another shape: parsed whole now
            parsed = parse_tool_calls(OPEN + self._held[:end] + CLOSE, self.names, self.new_id)
            if parsed.tool_calls:
                deltas.append(dict(parsed.tool_calls[0], index=self.calls))
                self.calls += 1
            else:
                content.append(OPEN + self._held[:end] + CLOSE)
        self._in_call, self._held, self._streaming = False, "", False
        return rest or ""

    def finish(self) -> tuple:
        content, deltas = "", []
        if self._in_call and not self._streaming:      # the output ended inside a block
            parsed = parse_tool_calls(OPEN + self._held, self.names, self.new_id)
            if parsed.tool_calls:
                deltas.append(dict(parsed.tool_calls[0], index=self.calls))
                self.calls += 1
            else:
                content += OPEN + self._held
        elif self._in_call:
            self.calls += 1                            # a streamed call the output cut short
        elif self._held:
            content += self._held
        self._held, self._in_call = "", False
        if self.calls and not content.strip():
            content = ""
        return content or None, deltas, ("tool_calls" if self.calls else None)
