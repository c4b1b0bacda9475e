"""`fastqwen serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) on the engine's slots.

Endpoints: GET /health, GET /v1/models, POST /v1/completions (a prompt as text or token ids),
POST /v1/chat/completions (messages through the checkpoint's chat template), both with
`stream`; GET /metrics (Prometheus). Each choice carries the generated `token_ids` besides
the text, so a client can check them.

Beyond sampling: log-probabilities in OpenAI's shapes (chat `logprobs` / `top_logprobs`,
completions `logprobs` and `echo`: logprobs.py), structured output (`response_format` on both
endpoints: grammar.py) and tools (chat `tools`, `tool_choice`, `parallel_tool_calls`: tools.py,
Qwen's <tool_call> format parsed into OpenAI `tool_calls`, streamed as `delta.tool_calls`). A
parameter the server does not implement is a 400 naming it unless its value asks for nothing.

Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}, FastAPI's own
404 / 405 included: 400 a bad request (every parameter is checked into a typed value before the
scheduler sees it), 404 another model's name or path, 405 a wrong method, 408 a body that does
not arrive in time, 413 a body over --max-request-bytes, 429 a full queue, 500 a failure (of
that request alone, or of an engine step: every request in flight), 503 while the engine loads
or the server drains. An error never closes a keep-alive connection unless its body was left
unread (408, 413). An error after a request ran carries its `usage` so far beside `error`.

Work a request brings is bounded before it is done: the body's size (Content-Length, then
while it is read), the prompt's characters against what the context can hold (before
tokenizing), token ids against the context (before checking each). Tokenizing and the chat
template run in a thread pool, never on the event loop. A client that goes away, streaming or
not, cancels its request within a step.

Lifecycle (`serve`): the port answers at once and the engine loads in a thread (/health 503
{"status": "loading"} until it is ready, then 200); on SIGTERM or SIGINT the server drains:
new requests get 503, those in flight run on for at most --drain-timeout seconds, then end with
an error event (503) and their usage so far, and the process exits.
"""
import asyncio
import importlib.util
import json
import logging
import os
import pathlib
import sys
import threading
import time
import uuid

from fastqwen.serve.grammar import GrammarError, response_format_spec
from fastqwen.serve.logprobs import chat_logprobs, completion_logprobs
from fastqwen.serve.precompile import Precompile
from fastqwen.serve.sampling import Fields, SamplingError, SamplingParams, show
from fastqwen.serve.text import TextError
from fastqwen.serve.tools import ToolError, ToolStream, parse_tool_calls, prepare_messages, tools_from_request

log = logging.getLogger("fastqwen.serve")

# A request body of a whole context of text fits many times over (4,096 tokens of a few bytes each,
# or token ids); far below what would stall the event loop parsing it (docs/SERVING.md).
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_BODY_TIMEOUT_S = 30.0          # the whole body must have arrived by then (slow senders: 408)
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# A request body at least this large (a text prompt of a quarter million characters) has its
# prompt prepared in the one thread kept for large inputs, not the text pool, and the C heap's
# free pages go back to the system after it (malloc_trim): tokenizing a long text leaves tens
# of MB free but held in each thread's heap that did it (docs/SERVING.md).
LARGE_BODY_BYTES = 256 * 2**10
# An echo with logprobs has the logits of every prompt position (bf16, prompt x vocab) at once:
# a prompt longer than this many bytes of them is refused (1 GiB: 3,533 tokens of Qwen3's
# 151,936-token vocabulary, 2,165 of Qwen3.5's 248,320; any tiny preset's context).
ECHO_LOGITS_BYTES = 2**30
# Request fields of chat alone (tools), refused on /v1/completions rather than ignored.
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "server_error",
               503: "service_unavailable_error"}


class ApiError(Exception):
    """An error answer: status, message, the parameter it names; close: the connection is closed
    after it (its body was not read); usage: the request's tokens so far (after it ran)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 close: bool = False, usage: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "invalid_request_error")
        self.close, self.usage = close, usage


class ClientGone(Exception):
    """The client disconnected while its request waited or ran (the request is cancelled)."""


ENGINE_MODULE = "fastqwen_serve_engine"


def engine_module():
    """The engine folder's engine.py (the repository's engine/, the folder a user submits), loaded
    from its path under its own name, once a process: another module named `engine` imported
    earlier in the process (a baseline's, the native reference's) cannot stand in for it. Its
    folder goes on sys.path for the engine's own absolute imports of its siblings."""
    module = sys.modules.get(ENGINE_MODULE)
    if module is not None:
        return module
    folder = pathlib.Path(__file__).resolve().parents[2] / "engine"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(ENGINE_MODULE, folder / "engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[ENGINE_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[ENGINE_MODULE]
        raise
    return module


def _valid_text(value: str, param: str) -> str:
    """value, if it is text the tokenizer can take (no lone surrogate, which JSON's \\ud800 escapes
    can carry); else a 400 naming param."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"{param} is not valid Unicode: a lone surrogate {value[exc.start]!r} at character "
                           f"{exc.start}", param) from None
    return value


# (No `from __future__ import annotations` here: FastAPI reads the handlers' annotations,
# which must be the classes themselves.)


class Server:
    """The engine, its text codec, the scheduler and the metrics behind one FastAPI app."""

    def __init__(self, model_dir: str, max_batch: int | None = 16, max_model_len: int | None = None,
                 served_model_name: str | None = None, max_waiting: int = 256, seed: int = 0,
                 memory_fraction: float | None = None, block_size: int | None = None,
                 prefill_chunk: int | None = None, share_prefixes: bool = True,
                 state_snapshots: int | None = None, max_echo_tokens: int | None = None,
                 speculation: str | None = None, speculative_tokens: int | None = None, precompile: bool = True):
        """block_size: a paged KV cache of pages of that many positions (fq_slots); None or 0: a
        row of max_model_len positions per slot. prefill_chunk: the most prompt tokens prefilled
        between two decode steps while requests run, a longer prompt in chunks of it
        (scheduler.py); None or 0: whole prompts.
        share_prefixes: with block_size, prompts that start alike share those pages (Qwen3.5: with
        block_size a multiple of 64, through state_snapshots of its GDN states, None: fq_slots'
        default). max_echo_tokens: the longest prompt an echo with logprobs takes (None: as many
        as ECHO_LOGITS_BYTES of its logits hold). speculation, speculative_tokens: the engine's
        options (None: its defaults and FASTQWEN_SPECULATION); the server takes "off", "ngram" and
        "auto" (speculation.py). precompile: the start's Triton kernels compiled in parallel
        beside the weight load where a GPU runs them (precompile.py); the slots wait for it."""
        from concurrent.futures import ThreadPoolExecutor

        from fastqwen.serve.grammar import Grammars
        from fastqwen.serve.logprobs import TokenText
        from fastqwen.serve.metrics import Metrics
        from fastqwen.serve.scheduler import Scheduler
        from fastqwen.serve.text import TextCodec

        self.model_dir = str(model_dir)
        self.name = served_model_name or pathlib.Path(model_dir).resolve().name
        self.precompiled = None        # what the kernel precompile did, in a line (None: it did not run)
        kernels = Precompile.start(self.model_dir, max_batch, max_model_len, block_size, speculation,
                                   speculative_tokens) if precompile else None
        try:
            self.codec = TextCodec(model_dir)
            self.engine = engine_module().Engine(self.model_dir, speculation=speculation,
                                                 speculative_tokens=speculative_tokens)
        except BaseException:
            if kernels is not None:
                kernels.stop()
            raise
        if kernels is not None:   # before the slots launch a kernel, and before the memory plan (its CUDA context gone)
            self.precompiled = kernels.wait()
        limit = int(self.engine.cfg.max_position_embeddings)
        self.max_model_len = min(limit, max_model_len or 4096)
        # A token never covers more characters than the longest one in the vocabulary, so a text
        # longer than this has at least max_model_len tokens: refused before it is tokenized.
        self.max_prompt_chars = self.max_model_len * self.codec.longest_token
        vocab = int(self.engine.cfg.vocab_size)
        self.max_echo_tokens = min(self.max_model_len - 1, max_echo_tokens or max(1, ECHO_LOGITS_BYTES // (2 * vocab)))
        self.token_text = TokenText(self.codec.tokenizer)
        # the grammar library's view of the tokenizer, built here (the loading thread), not at a
        # request; a tokenizer it cannot take leaves structured output refused with the reason
        try:
            self.grammars, self.grammar_error = Grammars.for_codec(self.codec, vocab).prepare(), None
        except ImportError as exc:
            self.grammars, self.grammar_error = None, (f"structured output and tool_choice need llguidance ({exc}): "
                                                       "pip install 'fastqwen[serve]'")
        except (ValueError, RuntimeError) as exc:
            self.grammars, self.grammar_error = None, str(exc)
        plan = self.engine.plan_slots(self.max_model_len, max_slots=max_batch, page_size=block_size or None,
                                      share_prefixes=share_prefixes, state_snapshots=state_snapshots,
                                      memory_fraction=memory_fraction)
        self.block_size, self.num_blocks, self.max_batch = plan["page_size"], plan["num_pages"], plan["max_slots"]
        self.metrics = Metrics(self.name)
        self.scheduler = Scheduler(self.engine, self.codec, self.max_batch, self.max_model_len, max_waiting, seed,
                                   self.metrics, block_size=self.block_size, num_blocks=self.num_blocks,
                                   prefill_chunk=prefill_chunk, share_prefixes=share_prefixes,
                                   state_snapshots=state_snapshots, grammars=self.grammars)
        # tokenizing and chat templates, off the event loop (tokenizers releases the GIL while it
        # works); large inputs one at a time in a thread of their own
        self.text_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                            thread_name_prefix="fastqwen-text")
        self.large_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastqwen-large")
        self.created = int(time.time())

    def close(self) -> None:
        self.scheduler.close()
        for pool in (self.text_pool, self.large_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests: each field checked before anything runs ----------------------------------
    def _check_model(self, body: dict) -> None:
        model = self._fields(body, lambda f: f.string("model"))
        if model is not None and model != self.name:
            raise ApiError(404, f"The model {show(model)} does not exist (this server serves `{self.name}`).",
                           "model")

    @staticmethod
    def _fields(body: dict, read, prefix: str = ""):
        try:
            return read(Fields(body, prefix))
        except SamplingError as exc:
            raise ApiError(400, str(exc), exc.param) from None

    def _params(self, body: dict, chat: bool) -> SamplingParams:
        try:
            params = SamplingParams.from_request(body, default_max_tokens=16, max_model_len=self.max_model_len,
                                                 chat=chat)
        except SamplingError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        for stop in params.stop:
            _valid_text(stop, "stop")
        return params

    def _stream_options(self, body: dict) -> tuple:
        """(stream, include_usage): `stream` a boolean, `stream_options` an object, only with
        stream true (OpenAI's and vLLM's rule), its `include_usage` a boolean."""
        stream = self._fields(body, lambda f: f.boolean("stream", False))
        options = self._fields(body, lambda f: f.object("stream_options"))
        if options and not stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
        include_usage = self._fields(options or {}, lambda f: f.boolean("include_usage", False), "stream_options.")
        return stream, include_usage

    def _structure(self, body: dict, chat: bool) -> tuple:
        """(the chat request's tools.ToolSet or None, the grammar.GrammarSpec its output must
        follow or None): response_format, or a tool_choice that forces a call."""
        if not chat:
            for name in CHAT_ONLY:
                if body.get(name) is not None:
                    raise ApiError(400, f"{name} is only supported on /v1/chat/completions", name)
        try:
            toolset = tools_from_request(body) if chat else None
            spec = response_format_spec(body.get("response_format"))
        except (GrammarError, ToolError) as exc:
            raise ApiError(400, str(exc), exc.param) from None
        forced = toolset.grammar_spec() if toolset is not None else None
        if forced is not None and spec is not None:
            raise ApiError(400, "response_format cannot be used with a tool_choice that forces a tool call "
                           f"({show(body.get('tool_choice'))}): the output is the call", "response_format")
        return toolset, spec or forced

    def _compile(self, spec):
        """spec's compiled grammar (in the text pool: a new schema takes milliseconds), None for
        none; a schema the grammar library refuses is a 400 naming the parameter it came from."""
        if spec is None:
            return None
        if self.grammars is None:
            raise ApiError(400, f"{spec.param.split('.')[0]} is not supported with this checkpoint's tokenizer: "
                           f"{self.grammar_error}", spec.param)
        try:
            return self.grammars.compile(spec)
        except GrammarError as exc:
            raise ApiError(400, str(exc), exc.param) from None

    def completion_request(self, body: dict, spec) -> tuple:
        """(the prompt's token ids, its compiled grammar or None), in the text pool."""
        return self.completion_prompt(body), self._compile(spec)

    def chat_request(self, body: dict, toolset, spec) -> tuple:
        """(the messages' token ids, the compiled grammar or None), in the text pool."""
        return self.chat_prompt(body, toolset), self._compile(spec)

    def echo_text(self, body: dict, ids: list) -> str:
        """The prompt as an echo gives it back: its text as sent, or its token ids decoded."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else self.codec.decode(ids, skip_special_tokens=False)

    def completion_prompt(self, body: dict) -> list:
        """The prompt's token ids (in the text pool: it may tokenize)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                     # a batch of one
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise self._too_long("prompt", f"{len(prompt)} characters")
            ids = self.codec.encode(_valid_text(prompt, "prompt"))
        elif isinstance(prompt, list) and prompt:
            if len(prompt) >= self.max_model_len:
                raise self._too_long("prompt", f"{len(prompt)} token ids")
            if not all(type(t) is int for t in prompt):
                raise ApiError(400, "prompt must be a string or a non-empty list of token ids (one prompt a request), "
                               f"got {show(prompt)}", "prompt")
            ids = prompt
        else:
            raise ApiError(400, "prompt must be a string or a non-empty list of token ids (one prompt a request), "
                           f"got {show(prompt)}", "prompt")
        return self._check_ids(ids, "prompt")

    def chat_prompt(self, body: dict, toolset=None) -> list:
        """The messages through the chat template, as token ids (in the text pool); with the
        tools of `toolset` (tools.py) in the prompt, and assistant tool calls and tool results
        written as the template expects."""
        messages = body.get("messages")
        if isinstance(messages, list):
            chars = 0
            for m in messages:
                if isinstance(m, dict):
                    for value in m.values():
                        parts = value if isinstance(value, list) else [value]
                        for part in parts:
                            text = part.get("text") if isinstance(part, dict) else part
                            if isinstance(text, str):
                                chars += len(_valid_text(text, "messages"))
            if chars > self.max_prompt_chars:
                raise self._too_long("messages", f"{chars} characters")
        try:
            messages, render_kwargs = prepare_messages(messages, toolset, self.codec.chat_template)
        except ToolError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        try:
            text = self.codec.render_chat(messages, add_generation_prompt=True, **render_kwargs)
        except TextError as exc:
            raise ApiError(400, str(exc), "messages") from None
        if len(text) > self.max_prompt_chars:
            raise self._too_long("messages", f"{len(text)} characters in the chat template")
        return self._check_ids(self.codec.encode(_valid_text(text, "messages")), "messages")

    def _too_long(self, param: str, size: str) -> ApiError:
        return ApiError(400, f"the {param} has {size}: more than this server's context of {self.max_model_len} tokens "
                        "can hold", param)

    def _check_ids(self, ids: list, param: str) -> list:
        if not ids:
            raise ApiError(400, f"the {param} has no tokens", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"the {param} has {len(ids)} tokens; this server's context is {self.max_model_len} "
                           "tokens, so it must be shorter to leave room for output", param)
        vocab = int(self.engine.cfg.vocab_size)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param)
        return ids

    def submit(self, ids: list, params: SamplingParams, grammar=None) -> "Handle":
        from fastqwen.serve.scheduler import QueueFull

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            req = self.scheduler.submit(ids, params, loop, events, grammar=grammar)
        except QueueFull as exc:
            self.metrics.reject(429)
            raise ApiError(429, f"the server is busy: {exc}; retry later") from None
        return Handle(self.scheduler, req, events)


def _trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; elsewhere nothing)."""
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc(0)


_libc = None


class Handle:
    """One submitted request, seen from the event loop: its events in order, and cancel()."""

    def __init__(self, scheduler, req, events: asyncio.Queue):
        self.scheduler, self.req, self.events = scheduler, req, events
        self.ended = False

    async def next(self):
        event = await self.events.get()
        if event.finish_reason is not None:
            self.ended = True
        return event

    def cancel(self) -> None:
        """Cancel the request unless it has ended (any number of times)."""
        if not self.ended and self.req.finish_reason is None:
            self.scheduler.cancel(self.req)


def _error_body(status: int, message: str, param=None, kind=None, usage=None) -> dict:
    body = {"error": {"message": message, "type": kind or ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}
    if usage is not None:
        body["usage"] = usage
    return body


def _error_response(status: int, message: str, param=None, kind=None, close=False, usage=None):
    from starlette.responses import Response

    # ensure_ascii: a message quoting a client's text can never fail to encode
    content = json.dumps(_error_body(status, message, param, kind, usage)).encode()
    return Response(content, status_code=status, media_type="application/json",
                    headers={"connection": "close"} if close else None)


class AppState:
    """What the app serves from: the server once loaded (None while loading), why loading failed,
    whether it drains, and the API requests in flight."""

    def __init__(self, server: Server | None = None):
        self.server, self.load_error = server, None
        self.draining = False
        self.aborted = False             # the drain's bound passed: what runs was ended, nothing new starts
        self.in_flight = 0


class Guard:
    """ASGI middleware around the app (inside Starlette's error layer): bounds the request body
    (size, then the time it takes to arrive), answers 503 while loading or draining, counts the
    API requests in flight, and turns any exception that escaped the app before its response
    started into a logged 500 in OpenAI's shape, so the connection stays usable."""

    def __init__(self, app, state: AppState, max_request_bytes: int, body_timeout: float):
        self.app, self.state = app, state
        self.max_request_bytes, self.body_timeout = max_request_bytes, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        api = scope["path"].startswith("/v1/")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > self.max_request_bytes:     # h11 checked it is a number
            return await _error_response(413, f"the request body has {int(length)} bytes; this server takes at "
                                         f"most {self.max_request_bytes}", close=True)(scope, receive, send)
        if api and (self.state.server is None or self.state.draining):
            why = "shutting down" if self.state.draining else "loading the model"
            return await _error_response(503, f"the server is {why}; retry later")(scope, receive, send)
        started = False
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        received, body_done = 0, False

        async def bounded_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                               close=True) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise ApiError(413, f"the request body is over {self.max_request_bytes} bytes, the most this "
                                   "server takes", close=True)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def tracked_send(message):
            nonlocal started
            started = True
            await send(message)

        if api:
            self.state.in_flight += 1
        try:
            await self.app(scope, bounded_receive, tracked_send)
        except Exception as exc:
            if started:
                raise                  # a response half sent: the server closes the connection
            log.error("unexpected error answering %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if self.state.server is not None:
                self.state.server.metrics.reject(500)
            await _error_response(500, f"internal error: {type(exc).__name__}")(scope, receive, send)
        finally:
            if api:
                self.state.in_flight -= 1
            if scope.get("state", {}).get("large") and self.state.server is not None:
                self.state.server.large_pool.submit(_trim_heap)     # the request's objects are gone now


async def _disconnected(request) -> None:
    """Returns when the client has gone (the body was read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request, awaitable):
    """The awaitable's result; ClientGone if the client disconnects first (it is then cancelled)."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
    if task in done:
        return task.result()
    if not watch.cancelled():
        watch.exception()              # a receive that failed: the client is gone all the same
    raise ClientGone()


def create_app(server: Server | None = None, *, load=None, state: AppState | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT_S):
    """The FastAPI app on a loaded `server`, or on `load()` (a callable returning one), run in a
    thread when the app starts (its lifespan) while the port already answers: /health 503 until
    it returns. state: the AppState to serve from (serve() watches it to drain)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException

    state = state or AppState()
    if server is not None:
        state.server = server

    @asynccontextmanager
    async def lifespan(_app):
        if load is not None and state.server is None:
            def loading():
                try:
                    state.server = load()
                except BaseException as exc:  # noqa: BLE001 - reported by /health and by serve()
                    state.load_error = exc
                    log.error("loading the model failed: %s", exc)
            threading.Thread(target=loading, name="fastqwen-load", daemon=True).start()
        yield

    app = FastAPI(title="fastqwen", version="0.1.0", lifespan=lifespan)
    app.add_middleware(Guard, state=state, max_request_bytes=max_request_bytes, body_timeout=body_timeout)

    def reject(status: int) -> None:
        if state.server is not None:
            state.server.metrics.reject(status)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        if exc.status != 429:
            reject(exc.status)
        return _error_response(exc.status, exc.message, exc.param, exc.kind, exc.close, exc.usage)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc):
        reject(exc.status_code)
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc):
        reject(400)
        return _error_response(400, f"invalid request: {show(exc.errors()[:3], 300)}")

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        request.state.large = len(raw) >= LARGE_BODY_BYTES
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError as exc:      # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
            raise ApiError(400, f"the request body is not valid JSON: {show(str(exc), 200)}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        """200 once the engine is ready; 503 with the reason while loading, draining or failed."""
        srv = state.server
        if state.load_error is not None:
            status = {"status": "failed", "error": f"{type(state.load_error).__name__}: {state.load_error}"}
        elif srv is None:
            status = {"status": "loading"}
        elif state.draining:
            status = {"status": "draining"}
        elif not srv.scheduler.thread.is_alive():
            status = {"status": "failed", "error": "the scheduler thread has stopped"}
        else:
            return {"status": "ok"}
        return JSONResponse(status, status_code=503)

    @app.get("/v1/models")
    async def models():
        srv = state.server
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": srv.created,
                                            "owned_by": "fastqwen", "root": str(pathlib.Path(srv.model_dir).resolve()),
                                            "max_model_len": srv.max_model_len,
                                            "vocab_size": int(srv.engine.cfg.vocab_size)}]}

    @app.get("/metrics")
    async def metrics():
        if state.server is None:
            raise ApiError(503, "the server is loading the model")
        return Response(state.server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def respond(request: Request, chat: bool):
        srv = state.server
        body = await body_of(request)
        srv._check_model(body)
        stream, usage_in_stream = srv._stream_options(body)
        params = srv._params(body, chat)
        toolset, spec = srv._structure(body, chat)
        pool = srv.large_pool if request.state.large else srv.text_pool
        work = ((lambda: srv.chat_request(body, toolset, spec)) if chat else
                (lambda: srv.completion_request(body, spec)))
        ids, grammar = await asyncio.get_running_loop().run_in_executor(pool, work)
        if params.prompt_logprobs and len(ids) > srv.max_echo_tokens:
            raise ApiError(400, f"echo with logprobs scores every prompt position: this server takes at most "
                           f"{srv.max_echo_tokens} prompt tokens for it, the prompt has {len(ids)}", "prompt")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        echo = srv.echo_text(body, ids) if params.echo else None
        parse_tools = toolset is not None and toolset.in_prompt

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

        def failure(event, n_out: int) -> ApiError:
            status = event.status or 500
            what = "the server shut down before the request finished" if status == 503 else "the request failed"
            return ApiError(status, f"{what}: {event.error}", usage=usage(n_out))

        def logprobs_of(token_ids: list, entries: list, offset: int = 0):
            """The tokens' log-probabilities in the endpoint's shape (None: not asked)."""
            if params.logprobs is None:
                return None
            if chat:
                return chat_logprobs(srv.token_text, token_ids, entries)
            return completion_logprobs(srv.token_text.text_of, token_ids, entries, offset)

        def prompt_part(event) -> tuple:
            """An echo's prompt tokens and their entries (None each where the request did not ask)."""
            return ids, (event.prompt_logprobs or [None] * len(ids))

        if state.aborted:
            raise ApiError(503, "the server is shutting down; retry later")
        handle, streaming = srv.submit(ids, params, grammar), False
        try:
            # the first event (or the client gone) before any response goes out
            first = await _unless_gone(request, handle.next())
            if not stream:
                async def rest(event):
                    events = [event]
                    while events[-1].finish_reason is None:
                        events.append(await handle.next())
                    return events

                events = await _unless_gone(request, rest(first))
                text = "".join(e.text for e in events)
                token_ids = [t for e in events for t in e.token_ids]
                entries = [x for e in events for x in (e.logprobs or [None] * len(e.token_ids))]
                finish = events[-1].finish_reason
                if finish == "error":
                    raise failure(events[-1], len(token_ids))
                if chat:
                    message = {"role": "assistant", "content": text}
                    if parse_tools:
                        parsed = parse_tool_calls(text, toolset.names)
                        if parsed.tool_calls:
                            message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
                            finish = parsed.finish_reason
                    choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": token_ids,
                              "logprobs": logprobs_of(token_ids, entries)}
                else:
                    if echo is not None:
                        head, head_entries = prompt_part(first)
                        text, token_ids_all, entries = echo + text, head + token_ids, head_entries + entries
                    else:
                        token_ids_all = token_ids
                    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": token_ids,
                              "logprobs": logprobs_of(token_ids_all, entries)}
                return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                        "model": srv.name, "choices": [choice], "usage": usage(len(token_ids))}
            streaming = True
        except ClientGone:
            return _error_response(499, "the client closed the request")
        finally:
            if not streaming:
                handle.cancel()

        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, token_ids, finish, role=False, logprobs=None, tool_calls=None):
            if chat:
                delta = {"role": "assistant"} if role else {}
                if text or role:
                    delta["content"] = text
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                          "token_ids": token_ids}
            else:
                choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                          "token_ids": token_ids}
            payload = {"id": rid, "object": kind, "created": created, "model": srv.name, "choices": [choice]}
            return f"data: {json.dumps(payload)}\n\n"

        async def sse():
            event, first_chunk, n_out, offset = first, True, 0, 0
            calls = ToolStream(toolset.names) if parse_tools else None
            try:
                if echo is not None:             # the prompt first, in a chunk of its own
                    head, head_entries = prompt_part(first)
                    shaped = logprobs_of(head, head_entries)
                    offset = sum(map(len, shaped["tokens"])) if shaped else 0
                    yield chunk(echo, [], None, logprobs=shaped)
                while True:
                    n_out += len(event.token_ids)
                    if event.finish_reason == "error":
                        err = failure(event, n_out)
                        yield f"data: {json.dumps(_error_body(err.status, err.message, usage=err.usage))}\n\n"
                        break
                    text, call_deltas = calls.push(event.text) if calls is not None else (event.text, None)
                    if text or event.token_ids or first_chunk:
                        shaped = None
                        if event.token_ids:
                            shaped = logprobs_of(event.token_ids, event.logprobs or [None] * len(event.token_ids),
                                                 offset)
                            offset += sum(map(len, shaped["tokens"])) if shaped and not chat else 0
                        yield chunk(text, event.token_ids, None, role=first_chunk, logprobs=shaped)
                        first_chunk = False
                    if call_deltas:         # after the content that came before the call
                        yield chunk("", [], None, tool_calls=call_deltas)
                    if event.finish_reason is not None:
                        finish = event.finish_reason
                        if calls is not None:
                            rest, call_deltas, reason = calls.finish()
                            if rest:
                                yield chunk(rest, [], None)
                            if call_deltas:
                                yield chunk("", [], None, tool_calls=call_deltas)
                            finish = reason or finish
                        yield chunk("", [], finish)
                        break
                    event = await handle.next()
                if usage_in_stream:
                    payload = {"id": rid, "object": kind, "created": created, "model": srv.name, "choices": [],
                               "usage": usage(n_out)}
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"
            except Exception as exc:  # noqa: BLE001 - the stream ends with the error, in OpenAI's shape
                log.error("stream %s failed", rid, exc_info=exc)
                yield f"data: {json.dumps(_error_body(500, f'internal error: {type(exc).__name__}'))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                handle.cancel()

        # background: cancels the request also when the client left before the stream began
        return StreamingResponse(sse(), media_type="text/event-stream", background=BackgroundTask(handle.cancel))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    return app


def bound_cpu_kernel_caches(entries: int = 128) -> None:
    """Cap oneDNN's and ideep's caches of compiled CPU matmul kernels (PyTorch's CPU bf16 matmuls),
    which keep one entry per distinct shape, so per prompt length, 1,024 each by default: a CPU
    server's memory grew with every new prompt length (docs/SERVING.md). Both read their
    environment variable at their first matmul, so this runs before the engine loads; a value
    the user set wins."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int | None = None,
          max_model_len: int | None = None, gpu_memory_fraction: float | None = None,
          served_model_name: str | None = None, max_waiting: int = 256, block_size: int | None = None,
          prefill_chunk: int | None = None, share_prefixes: bool = True, state_snapshots: int | None = None,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
          body_timeout: float = DEFAULT_BODY_TIMEOUT_S, speculation: str | None = None,
          speculative_tokens: int | None = None, precompile: bool = True) -> None:
    """Run the server until SIGTERM or SIGINT, then drain (`fastqwen serve`). The port answers
    while the model loads; a failure to load is raised here after the port closes."""
    import torch
    import uvicorn

    bound_cpu_kernel_caches()
    if gpu_memory_fraction is not None:
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {gpu_memory_fraction}")
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction)
    state = AppState()

    def load() -> Server:
        began = time.monotonic()
        server = Server(model_dir, max_batch, max_model_len, served_model_name, max_waiting,
                        memory_fraction=gpu_memory_fraction, block_size=block_size, prefill_chunk=prefill_chunk,
                        share_prefixes=share_prefixes, state_snapshots=state_snapshots, speculation=speculation,
                        speculative_tokens=speculative_tokens, precompile=precompile)
        if server.precompiled:
            print(f"fastqwen serve: {server.precompiled}", file=sys.stderr, flush=True)
        cache = (f"{server.max_batch} slots of {server.max_model_len} tokens" if server.block_size is None else
                 f"{server.max_batch} slots of up to {server.max_model_len} tokens, {server.num_blocks} KV blocks "
                 f"of {server.block_size}")
        print(f"fastqwen serve: {server.name} ready on http://{host}:{port} ({cache}; loaded in "
              f"{time.monotonic() - began:.1f} s; pid {os.getpid()})", file=sys.stderr, flush=True)
        return server

    app = create_app(load=load, state=state, max_request_bytes=max_request_bytes, body_timeout=body_timeout)
    # the drain ends every request by drain_timeout; uvicorn's own bound is a backstop past it
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=int(drain_timeout) + 10)
    web = _draining_server(config, state, drain_timeout)
    print(f"fastqwen serve: starting on http://{host}:{port}, loading {model_dir} (/health answers 200 once "
          f"ready; pid {os.getpid()})", file=sys.stderr, flush=True)
    try:
        web.run()
    finally:
        if state.server is not None:
            state.server.close()
    if state.load_error is not None:
        raise state.load_error


def _draining_server(config, state: AppState, drain_timeout: float):
    """uvicorn's Server with a bounded drain on SIGTERM / SIGINT (the module doc): a second
    signal ends the drain at once, a third exits without waiting. uvicorn checks on_tick every
    0.1 s; its own shutdown follows once no API request is in flight."""
    import uvicorn

    class Draining(uvicorn.Server):
        def __init__(self):
            super().__init__(config)
            self.signals = 0
            self.drain_began = self.aborted = None

        def handle_exit(self, sig, frame):        # a signal handler: flags only
            self.signals += 1
            state.draining = True
            if self.signals >= 3:
                self.force_exit = self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            if state.load_error is not None:
                self.should_exit = True
            if state.draining and not self.should_exit:
                now = time.monotonic()
                if self.drain_began is None:
                    self.drain_began = now
                    print(f"fastqwen serve: draining ({state.in_flight} requests in flight, at most "
                          f"{drain_timeout:g} s)", file=sys.stderr, flush=True)
                if state.in_flight == 0 or (self.aborted is not None and now - self.aborted > 5):
                    self.should_exit = True
                elif self.aborted is None and (self.signals >= 2 or now - self.drain_began >= drain_timeout):
                    self.aborted, state.aborted = now, True
                    if state.server is not None:
                        state.server.scheduler.abort_all("the server is shutting down")
            return await super().on_tick(counter)

    return Draining()
