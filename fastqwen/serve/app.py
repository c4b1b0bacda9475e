"""`fastqwen serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) on the engine's slots.

Endpoints: GET /health, GET /v1/models, POST /v1/completions (a prompt as text or token ids),
POST /v1/chat/completions (messages through the checkpoint's chat template), both with
`stream`; GET /metrics (Prometheus). Each choice carries the generated `token_ids` besides
the text, so a client can check them. Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 for a bad request, 404 for another
model's name, 429 when the queue is full, 500 for a failure inside the engine (the server
goes on serving).
"""
import asyncio
import json
import os
import pathlib
import sys
import time
import uuid

from fastqwen.serve.sampling import SamplingError, SamplingParams
from fastqwen.serve.text import TextError


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _engine_module():
    """The engine folder's Engine (the repository's engine/, the folder a user submits)."""
    folder = pathlib.Path(__file__).resolve().parents[2] / "engine"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    import engine

    return engine


# (No `from __future__ import annotations` here: FastAPI reads the handlers' annotations,
# which must be the classes themselves.)


class Server:
    """The engine, its text codec, the scheduler and the metrics behind one FastAPI app."""

    def __init__(self, model_dir: str, max_batch: int | None = 16, max_model_len: int | None = None,
                 served_model_name: str | None = None, max_waiting: int = 256, seed: int = 0,
                 memory_fraction: float | None = None, block_size: int | None = None,
                 prefill_chunk: int | None = None, share_prefixes: bool = True,
                 state_snapshots: int | None = None):
        """block_size: a paged KV cache of pages of that many positions (fq_slots); None or 0: a
        row of max_model_len positions per slot. prefill_chunk: the most prompt tokens prefilled
        between two decode steps while requests run, a longer prompt in chunks of it
        (scheduler.py); None or 0: whole prompts.
        share_prefixes: with block_size, prompts that start alike share those pages (Qwen3.5: with
        block_size a multiple of 64, through state_snapshots of its GDN states, None: fq_slots'
        default)."""
        from fastqwen.serve.metrics import Metrics
        from fastqwen.serve.scheduler import Scheduler
        from fastqwen.serve.text import TextCodec

        self.model_dir = str(model_dir)
        self.name = served_model_name or pathlib.Path(model_dir).resolve().name
        self.codec = TextCodec(model_dir)
        self.engine = _engine_module().Engine(self.model_dir)
        limit = int(self.engine.cfg.max_position_embeddings)
        self.max_model_len = min(limit, max_model_len or 4096)
        plan = self.engine.plan_slots(self.max_model_len, max_slots=max_batch, page_size=block_size or None,
                                      share_prefixes=share_prefixes, state_snapshots=state_snapshots,
                                      memory_fraction=memory_fraction)
        self.block_size, self.num_blocks, self.max_batch = plan["page_size"], plan["num_pages"], plan["max_slots"]
        self.metrics = Metrics(self.name)
        self.scheduler = Scheduler(self.engine, self.codec, self.max_batch, self.max_model_len, max_waiting, seed,
                                   self.metrics, block_size=self.block_size, num_blocks=self.num_blocks,
                                   prefill_chunk=prefill_chunk, share_prefixes=share_prefixes,
                                   state_snapshots=state_snapshots)
        self.created = int(time.time())

    def close(self) -> None:
        self.scheduler.close()

    # ---- requests --------------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves `{self.name}`).", "model",
                           "not_found_error")

    def _params(self, body: dict) -> SamplingParams:
        try:
            return SamplingParams.from_request(body, default_max_tokens=16, max_model_len=self.max_model_len)
        except SamplingError as exc:
            raise ApiError(400, str(exc), str(exc).split(" ", 1)[0]) from None

    def completion_prompt(self, body: dict) -> list:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                     # a batch of one
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = prompt
        else:
            raise ApiError(400, "prompt must be a string or a non-empty list of token ids (one prompt a request), "
                           f"got {json.dumps(prompt)[:200]}", "prompt")
        return self._check_ids(ids, "prompt")

    def chat_prompt(self, body: dict) -> list:
        try:
            text = self.codec.render_chat(body.get("messages"), add_generation_prompt=True)
        except TextError as exc:
            raise ApiError(400, str(exc), "messages") from None
        return self._check_ids(self.codec.encode(text), "messages")

    def _check_ids(self, ids: list, param: str) -> list:
        vocab = int(self.engine.cfg.vocab_size)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param)
        if not ids:
            raise ApiError(400, f"the {param} has no tokens", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"the {param} has {len(ids)} tokens; this server's context is {self.max_model_len} "
                           "tokens, so it must be shorter to leave room for output", param)
        return ids

    async def run(self, ids: list, params: SamplingParams):
        """Yield the scheduler's events for one request; cancels it if the consumer goes away."""
        from fastqwen.serve.scheduler import QueueFull

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            req = self.scheduler.submit(ids, params, loop, events)
        except QueueFull as exc:
            self.metrics.reject(429)
            raise ApiError(429, f"the server is busy: {exc}; retry later", None, "rate_limit_error") from None
        try:
            while True:
                event = await events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if req.finish_reason is None:
                self.scheduler.cancel(req)


def _error_body(status: int, message: str, param=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def create_app(server: Server):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="fastqwen", version="0.1.0")

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        if exc.status != 429:
            server.metrics.reject(exc.status)
        return JSONResponse(_error_body(exc.status, exc.message, exc.param, exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc):
        server.metrics.reject(400)
        return JSONResponse(_error_body(400, f"invalid request: {exc.errors()[:3]}"), status_code=400)

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "fastqwen", "root": server.model_dir,
                                            "max_model_len": server.max_model_len,
                                            "vocab_size": int(server.engine.cfg.vocab_size)}]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def respond(body: dict, ids: list, chat: bool):
        params = server._params(body)
        stream = bool(body.get("stream", False))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        usage_in_stream = bool((body.get("stream_options") or {}).get("include_usage"))
        events = server.run(ids, params)
        # The first event (or an error) before any response goes out: a full queue is a 429.
        first = await events.__anext__()

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

        if not stream:
            text, token_ids, finish, error = "", [], None, None
            event = first
            while True:
                text += event.text
                token_ids += event.token_ids
                if event.finish_reason is not None:
                    finish, error = event.finish_reason, event.error
                    break
                event = await events.__anext__()
            if finish == "error":
                raise ApiError(500, f"the engine failed: {error}", None, "server_error")
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                          "token_ids": token_ids, "logprobs": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": token_ids, "logprobs": None}
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": server.name, "choices": [choice], "usage": usage(len(token_ids))}

        async def sse():
            n_out = 0
            kind = "chat.completion.chunk" if chat else "text_completion"

            def chunk(text, token_ids, finish, role=False):
                if chat:
                    delta = ({"role": "assistant", "content": text} if role else {"content": text}) if text or role \
                        else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": token_ids}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": token_ids}
                payload = {"id": rid, "object": kind, "created": created, "model": server.name, "choices": [choice]}
                return f"data: {json.dumps(payload)}\n\n"

            event, first_chunk = first, True
            try:
                while True:
                    n_out += len(event.token_ids)
                    if event.finish_reason == "error":
                        yield f"data: {json.dumps(_error_body(500, f'the engine failed: {event.error}'))}\n\n"
                        break
                    if event.text or event.token_ids or first_chunk:
                        yield chunk(event.text, event.token_ids, None, role=first_chunk)
                        first_chunk = False
                    if event.finish_reason is not None:
                        yield chunk("", [], event.finish_reason)
                        break
                    event = await events.__anext__()
                if usage_in_stream:
                    payload = {"id": rid, "object": kind, "created": created, "model": server.name, "choices": [],
                               "usage": usage(n_out)}
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        server._check_model(body)
        return await respond(body, server.completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        server._check_model(body)
        return await respond(body, server.chat_prompt(body), chat=True)

    return app


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int | None = None,
          max_model_len: int | None = None, gpu_memory_fraction: float | None = None,
          served_model_name: str | None = None, max_waiting: int = 256, block_size: int | None = None,
          prefill_chunk: int | None = None, share_prefixes: bool = True, state_snapshots: int | None = None) -> None:
    """Run the server until interrupted (`fastqwen serve`)."""
    import torch
    import uvicorn

    if gpu_memory_fraction is not None:
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {gpu_memory_fraction}")
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction)
    print(f"fastqwen serve: loading {model_dir}", file=sys.stderr, flush=True)
    server = Server(model_dir, max_batch, max_model_len, served_model_name, max_waiting,
                    memory_fraction=gpu_memory_fraction, block_size=block_size, prefill_chunk=prefill_chunk,
                    share_prefixes=share_prefixes, state_snapshots=state_snapshots)
    cache = (f"{server.max_batch} slots of {server.max_model_len} tokens" if server.block_size is None else
             f"{server.max_batch} slots of up to {server.max_model_len} tokens, {server.num_blocks} KV blocks of "
             f"{server.block_size}")
    print(f"fastqwen serve: {server.name} on http://{host}:{port} ({cache}; pid {os.getpid()})", file=sys.stderr,
          flush=True)
    try:
        uvicorn.run(create_app(server), host=host, port=port, log_level="warning")
    finally:
        server.close()
