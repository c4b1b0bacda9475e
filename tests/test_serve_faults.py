"""`fastqwen serve` against clients that misbehave, on loopback with the tiny preset (CPU): a real
uvicorn in a thread of this process (so a test can plant a fault in one request), and the
`fastqwen serve` command in a process of its own (its memory measured alone, and SIGTERM).

Asserted throughout: bad input gets a 4xx in OpenAI's error shape and the keep-alive connection
stays usable; no 5xx but the planted faults; a planted fault ends its own request only, the
others getting exactly the tokens they get alone; a client that leaves frees its slot at once;
no bystander stream stalls; every slot is free afterwards; memory comes back after large
requests and does not creep over rounds of new prompts; SIGTERM drains within its bound."""
from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MAX_LEN = 2048             # the in-process server's context
LIMIT = 2**20              # its --max-request-bytes
BODY_TIMEOUT = 1.0         # its body deadline (slow senders)
STALL_S = 0.5              # the longest a bystander stream may wait for its next chunk


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, seconds: float, proc=None) -> list:
    """Poll /health until 200; the (status, body) pairs seen before."""
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        assert proc is None or proc.poll() is None, "the server exited"
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return seen
            seen.append((r.status_code, r.json()))
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"/health did not answer 200 in {seconds} s: {seen[-3:]}")


class Live:
    """An ASGI app on a real uvicorn on loopback, in a thread of this process."""

    def __init__(self, app, wait_ready: bool = True):
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                 log_level="warning"))
        self.thread = threading.Thread(target=self.web.run, daemon=True)
        self.thread.start()
        while not self.web.started:
            time.sleep(0.01)
        if wait_ready:
            _wait_health(self.url, 60)

    def stop(self):
        self.web.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def live(tiny_model):
    from fastqwen.serve.app import Server, create_app

    srv = Server(str(tiny_model), max_batch=4, max_model_len=MAX_LEN, served_model_name="tiny")
    web = Live(create_app(srv, max_request_bytes=LIMIT, body_timeout=BODY_TIMEOUT))
    yield srv, web.url
    web.stop()
    srv.close()


def _alone(srv, prompt, n):
    """The engine's own greedy tokens for this prompt alone (a second engine)."""
    from fastqwen.serve.app import engine_module

    engines = _alone.__dict__.setdefault("engines", {})
    if srv.model_dir not in engines:
        engines[srv.model_dir] = engine_module().Engine(srv.model_dir)
    return [s[0] for s in engines[srv.model_dir].generate([prompt], n)]


def _prompts(seed: int, lengths) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (n,), generator=gen).tolist() for n in lengths]


def _settled(srv, seconds: float = 5.0) -> float:
    """Seconds until no request runs or waits and every slot is free; fails past `seconds`."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        sched = srv.scheduler
        if sched.idle and sched.slots.free == srv.max_batch and sched.slots.stats()["running"] == 0:
            return time.monotonic() - began
        time.sleep(0.01)
    raise AssertionError(f"not settled after {seconds} s: {len(srv.scheduler.running)} running, "
                         f"{srv.scheduler.num_waiting} waiting, {srv.scheduler.slots.free} slots free")


def _metric(url, name, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for s in fam.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _fives(url) -> float:
    """5xx answers so far (the server counts each by status)."""
    return sum(_metric(url, "fastqwen:request_rejected_total", status=str(s)) for s in (500, 503))


def _stream(url, body, timeout=60.0) -> dict:
    """A streaming completion read to its end: its token ids, the chunks' error events, the
    longest wait between two chunks (the first one excluded: the prompt pass), its usage."""
    out = {"token_ids": [], "errors": [], "gap": 0.0, "usage": None, "done": False, "finish": None}
    with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                out["gap"] = max(out["gap"], now - last)
            last = now
            if line == "data: [DONE]":
                out["done"] = True
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out["errors"].append(data)
                out["usage"] = data.get("usage")
                continue
            if data.get("usage"):
                out["usage"] = data["usage"]
            for choice in data["choices"]:
                out["token_ids"] += choice["token_ids"]
                out["finish"] = choice["finish_reason"] or out["finish"]
    return out


def _check_error(r, status, param=None, fragment=""):
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert err["param"] == param and fragment in err["message"], err


# ---- bad input: OpenAI errors, and the connection goes on --------------------------------------
RAW = {"content-type": "application/json"}
BAD = [   # (path, body or raw bytes, status, param, fragment)
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed", "seed must be <= 9223372036854775807"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, 400, "seed", "seed must be >= "),
    ("/v1/completions", {"prompt": "hi", "stream": "no"}, 400, "stream", "stream must be true or false"),
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n", "n must be an integer, got true"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", "n must be 1"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": "x"}, 400, "stream_options",
     "stream_options must be an object"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed when stream is true"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "must be true or false"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", "lone surrogate"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"]}', 400, "stop", "lone surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud800"}]}', 400, "messages",
     "lone surrogate"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "nested too deeply"),
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", "must be finite"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens", "max_tokens must be <="),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("/v1/completions", {"model": 5, "prompt": "hi"}, 400, "model", "model must be a string"),
    ("/v1/completions", {"model": "other", "prompt": "hi"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "x" * (MAX_LEN * 96 + 1)}, 400, "prompt", "context of 2048 tokens"),
    ("/v1/completions", {"prompt": list(range(MAX_LEN))}, 400, "prompt", "2048 token ids"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * (MAX_LEN * 96)}]}, 400, "messages",
     "tokens"),
]


def test_bad_requests_get_openai_errors_and_the_connection_goes_on(live):
    """Every bad body above gets its status in OpenAI's shape naming the parameter, and the next
    request on the same keep-alive connection is answered; FastAPI's own 404 and 405 too."""
    srv, url = live
    with httpx.Client(base_url=url, timeout=30) as client:
        def port(r):
            return r.extensions["network_stream"].get_extra_info("client_addr")

        first = port(client.get("/health"))
        for path, body, status, param, fragment in BAD:
            r = (client.post(path, content=body, headers=RAW) if isinstance(body, bytes)
                 else client.post(path, json=body))
            _check_error(r, status, param, fragment)
            ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200 and port(r) == port(ok) == first, (path, body if len(str(body)) < 99 else "")
        _check_error(client.get("/nope"), 404, None, "Not Found")
        _check_error(client.get("/v1/completions"), 405, None, "Method Not Allowed")
        assert port(client.get("/health")) == first
    # the openai client, without retries: each error is raised, and the next call works
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for bad in ({"seed": 2**70}, {"extra_body": {"stream_options": "x"}}, {"extra_body": {"n": True}}):
        with pytest.raises(openai.BadRequestError):
            oa.completions.create(model="tiny", prompt="hi", max_tokens=2, **bad)
        assert oa.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].token_ids
    assert _fives(url) == 0
    _settled(srv)


def _random_json(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if roll < 0.1:
        return None
    if roll < 0.2:
        return rng.random() < 0.5
    if roll < 0.45:
        return rng.choice([rng.randint(-3, 24), rng.randint(-3, 24), 2**63, -2**63 - 1, 2**70, 10**20, 0])
    if roll < 0.55:
        return rng.choice([rng.uniform(-3, 3), math.nan, math.inf, -0.0, 1e308])
    if roll < 0.75:
        alphabet = "ab \n\u00e9\u4e2d\U0001f642\ud800\udfff<|im_end|>\\\""
        return "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 5, 40])))
    if depth >= 3:
        return []
    if roll < 0.9:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["role", "content", "type", "text", "include_usage", "x"]): _random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


# each fuzzed field with values it may validly take (a replaced field takes one of them 40% of the time)
FUZZED = {"model": ["tiny"], "prompt": ["x", [1, 2, 3], ["hey"], [[5, 6]]], "max_tokens": [1, 3, None],
          "max_completion_tokens": [2, None], "temperature": [0, 0.5, 1.7], "top_p": [0.1, 1], "top_k": [-1, 0, 5],
          "seed": [0, -1, 2**63 - 1, -2**63], "stop": ["a", ["\n", "zz"], []], "stream": [True, False],
          "stream_options": [None, {"include_usage": True}], "n": [1], "ignore_eos": [True, False],
          "presence_penalty": [0], "logit_bias": [{}], "logprobs": [None, 0, 3, True], "top_logprobs": [0, 2],
          "echo": [False, True], "suffix": [None], "best_of": [1], "user": ["someone"],
          "response_format": [{"type": "json_object"}, {"type": "text"},
                              {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}],
          "tools": [[{"type": "function", "function": {"name": "f", "parameters": {
              "type": "object", "properties": {"x": {"type": "integer"}}}}}]],
          "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}],
          "parallel_tool_calls": [True, False],
          "messages": [[{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                       [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]}


def test_fuzzed_bodies_never_get_a_5xx(live):
    """160 seeded bodies, each a valid one with one to three fields (or the whole body) replaced by
    random JSON values (huge and negative numbers, NaN, lone surrogates, nesting, wrong types):
    every answer is a 200 or a 4xx in OpenAI's shape, no stream carries an error, and the server
    is idle after."""
    srv, url = live
    rng = random.Random(40)
    bodies = []
    for i in range(160):
        chat = i % 2 == 1
        body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello there"})
        body.update(model="tiny", max_tokens=4, temperature=0)
        if rng.random() < 0.05:
            body = _random_json(rng)
        else:
            for name in rng.sample(sorted(FUZZED), rng.randint(1, 3)):
                body[name] = rng.choice(FUZZED[name]) if rng.random() < 0.4 else _random_json(rng)
        bodies.append(("/v1/chat/completions" if chat else "/v1/completions",
                       json.dumps(body, allow_nan=True).encode()))

    def send(item):
        path, raw = item
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post(path, content=raw, headers=RAW)
            errors = [line for line in r.text.splitlines() if line.startswith('data: {"error"')]
            return r.status_code, r.text[:300], errors

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, bodies))
    for (path, raw), (status, text, errors) in zip(bodies, results):
        assert status == 200 or 400 <= status < 500, (status, text, raw[:300])
        if status != 200:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, text
        assert not errors, (errors, raw[:300])
    assert sum(s == 200 for s, _, _ in results) >= 30           # the fuzz reached the engine too
    assert _fives(url) == 0
    _settled(srv)


def test_an_unexpected_error_is_a_500_in_shape_and_the_connection_goes_on(live, monkeypatch):
    """An exception no handler expects (planted in the request path) is logged and answered 500
    in OpenAI's shape, without closing the keep-alive connection; the next request on it works."""
    srv, url = live
    fives = _fives(url)

    def broken(body):
        raise RuntimeError("planted: not a request's fault")

    with httpx.Client(base_url=url, timeout=30) as client:
        monkeypatch.setattr(srv, "_stream_options", broken)
        r = client.post("/v1/completions", json={"prompt": "hi"})
        monkeypatch.undo()
        _check_error(r, 500, None, "internal error: RuntimeError")
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        assert r.extensions["network_stream"].get_extra_info("client_addr") == \
            ok.extensions["network_stream"].get_extra_info("client_addr")
    assert _fives(url) == fives + 1
    _settled(srv)


# ---- isolation: a fault in one request ends it alone --------------------------------------------
def test_a_fault_in_one_request_ends_it_alone(live, monkeypatch):
    """Planted while a batch runs: one request's detokenizer raises at its third token, one's
    sampling generator turns unusable for its third draw (a decode step's, beside the seeded
    bystander's), one's event delivery raises at its third token. Each of
    those ends alone with a 500 (non-streaming) or an error event (streaming) in OpenAI's shape
    with its usage so far; the bystanders, greedy and seeded, streaming or not, get exactly the
    tokens they get alone, and every slot is free after. Then a failing engine step ends every
    request in flight (one shared computation), and the server goes on."""
    from fastqwen.serve import scheduler as scheduler_module
    from fastqwen.serve.text import Detokenizer

    srv, url = live
    codec, fives = srv.codec, _fives(url)

    class BrokenDetokenizer(Detokenizer):
        def push(self, token_id):
            if len(self.ids) >= 2:
                raise RuntimeError("planted: this request's detokenizer")
            return super().push(token_id)

    real_detokenizer, real_emit, real_sample, real_send = codec.detokenizer, scheduler_module.Scheduler._emit, \
        scheduler_module.Scheduler._sample, scheduler_module.Request.send
    monkeypatch.setattr(codec, "detokenizer", lambda stop=(): BrokenDetokenizer(codec, stop)
                        if "<fault:text>" in stop else real_detokenizer(stop))

    def emit(sched, req, token, *args, **kwargs):
        real_emit(sched, req, token, *args, **kwargs)
        if req.params.seed == 4242 and len(req.output) == 2:
            req.generator = object()               # its next draw raises

    failing_draws = []                             # the seeds of each draw's rows where it failed

    def sample_rows(sched, logits, reqs):
        tokens, failed = real_sample(sched, logits, reqs)
        if any(r.params.seed == 4242 for r in failed):
            failing_draws.append(sorted(r.params.seed for r in reqs if r.params.seed is not None))
        return tokens, failed

    monkeypatch.setattr(scheduler_module.Scheduler, "_emit", emit)
    monkeypatch.setattr(scheduler_module.Scheduler, "_sample", sample_rows)

    def send(req, event):
        if "<fault:send>" in req.params.stop and len(req.output) >= 3 and event.finish_reason is None:
            raise RuntimeError("planted: this request's event delivery")
        real_send(req, event)

    monkeypatch.setattr(scheduler_module.Request, "send", send)
    greedy = _prompts(21, (40, 9, 70))
    n = 48

    def post(body):
        return httpx.post(url + "/v1/completions", json=body, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        bystanders = [pool.submit(_stream, url, {"prompt": greedy[0], "max_tokens": n, "temperature": 0,
                                                 "ignore_eos": True}),
                      pool.submit(post, {"prompt": greedy[1], "max_tokens": n, "temperature": 0, "ignore_eos": True}),
                      pool.submit(post, {"prompt": greedy[2], "max_tokens": n, "temperature": 0.9, "seed": 5,
                                         "ignore_eos": True})]
        deadline = time.monotonic() + 30
        while len(srv.scheduler.running) < 3 and time.monotonic() < deadline:     # the bystanders run
            time.sleep(0.005)
        faults = [pool.submit(post, {"prompt": "fault one", "max_tokens": 30, "stop": "<fault:text>",
                                     "ignore_eos": True}),
                  pool.submit(_stream, url, {"prompt": "fault two", "max_tokens": 30, "temperature": 1.0,
                                             "seed": 4242, "ignore_eos": True}),
                  pool.submit(post, {"prompt": "fault three", "max_tokens": 30, "stop": ["<fault:send>"],
                                     "ignore_eos": True})]
        text_fault, sample_fault, send_fault = (f.result() for f in faults)
        stream, plain, sampled = (f.result() for f in bystanders)
    _check_error(text_fault, 500, None, "planted: this request's detokenizer")
    assert text_fault.json()["usage"]["completion_tokens"] == 2          # the two tokens it was sent
    _check_error(send_fault, 500, None, "planted: this request's event delivery")
    assert sample_fault["errors"] and sample_fault["done"] and "TypeError" in sample_fault["errors"][0]["error"][
        "message"]
    assert len(sample_fault["token_ids"]) == 2 and failing_draws == [[5, 4242]]
    assert stream["token_ids"] == _alone(srv, greedy[0], n) and not stream["errors"]
    assert plain.json()["choices"][0]["token_ids"] == _alone(srv, greedy[1], n)
    _settled(srv)
    monkeypatch.undo()
    alone = post({"prompt": greedy[2], "max_tokens": n, "temperature": 0.9, "seed": 5, "ignore_eos": True})
    assert sampled.json()["choices"][0]["token_ids"] == alone.json()["choices"][0]["token_ids"]

    # an engine step that fails: every request in flight ends with it; the server goes on
    slots, calls = srv.scheduler.slots, []
    real_step = slots.step_rows

    def step_rows(tokens):       # the second step that both requests are in (on a loaded machine one can come late)
        calls.append(len(tokens))
        if len(tokens) == 2 and calls.count(2) == 2:
            raise RuntimeError("planted: the engine step")
        return real_step(tokens)

    monkeypatch.setattr(slots, "step_rows", step_rows)
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(post, [{"prompt": p, "max_tokens": 20, "ignore_eos": True} for p in greedy[:2]]))
    monkeypatch.undo()
    for r in both:
        _check_error(r, 500, None, "planted: the engine step")
    _settled(srv)
    assert _fives(url) == fives + 4          # the two non-streaming planted faults and the step's two
    again = post({"prompt": greedy[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert again.json()["choices"][0]["token_ids"] == _alone(srv, greedy[0], 6)


# ---- cancellation ------------------------------------------------------------------------------
def test_abandoned_requests_are_cancelled_at_once(live, monkeypatch):
    """Eight non-streaming clients that give up after 0.4 s (each asked for 400 tokens: 8 s of
    work on 4 slots), the openai client's retries included: every one is cancelled within a
    step or two of its client leaving, every slot is free, and a short request after them is
    not kept waiting by their work."""
    from fastqwen.serve import scheduler as scheduler_module

    srv, url = live
    aborted, fives = _metric(url, "fastqwen:request_success_total", finished_reason="abort"), _fives(url)
    body = {"prompt": "orphan", "max_tokens": 400, "ignore_eos": True}
    cancelled, ended = {}, {}                    # request id -> when its client left / when it ended
    real_cancel, real_finish = scheduler_module.Scheduler.cancel, scheduler_module.Scheduler._finish

    def cancel(sched, req):
        cancelled.setdefault(req.id, time.monotonic())
        real_cancel(sched, req)

    def finish(sched, req, reason, *args, **kwargs):
        if reason == "abort":
            ended[req.id] = time.monotonic()
        real_finish(sched, req, reason, *args, **kwargs)

    monkeypatch.setattr(scheduler_module.Scheduler, "cancel", cancel)
    monkeypatch.setattr(scheduler_module.Scheduler, "_finish", finish)

    def leave(_):
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=0.4)
        except httpx.TimeoutException:
            return True
        return False

    def leave_with_retries(_):
        oa = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=0.4, max_retries=1)
        with pytest.raises(openai.APITimeoutError):
            oa.completions.create(model="tiny", prompt="orphan", max_tokens=400, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        retried = [pool.submit(leave_with_retries, i) for i in range(2)]
        gone = list(pool.map(leave, range(6))) + [f.result() is None for f in retried]
    assert all(gone)
    settled = _settled(srv, 2.0)
    # each one ended within a few steps of its client leaving (a step of these is milliseconds)
    assert len(cancelled) == 10 and set(ended) == set(cancelled)
    late = {i: ended[i] - cancelled[i] for i in cancelled}
    assert max(late.values()) < 0.3, late
    began = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "short", "max_tokens": 4, "ignore_eos": True}, timeout=30)
    waited = time.monotonic() - began
    assert r.status_code == 200 and waited < 2.0, waited
    assert _metric(url, "fastqwen:request_success_total", finished_reason="abort") == aborted + 10
    assert _fives(url) == fives
    print(f"abandoned: settled {settled * 1000:.0f} ms after the last client left; a short request then took "
          f"{waited * 1000:.0f} ms")


def test_random_disconnects_under_load_stall_no_bystander(live):
    """Twenty clients, streaming or not, leaving after seeded random times while a greedy
    bystander streams (long enough to outlast them all): the bystander gets exactly its tokens
    alone with no chunk later than STALL_S after the one before, the clients' requests end as
    aborts, and every slot is free after."""
    srv, url = live
    fives = _fives(url)
    aborted = _metric(url, "fastqwen:request_success_total", finished_reason="abort")
    rng = random.Random(7)
    prompt = _prompts(31, (25,))[0]
    n = 600
    plan = [(_prompts(100 + i, (rng.randint(3, 300),))[0], rng.uniform(0.05, 1.0)) for i in range(20)]

    def client(i):
        body = {"prompt": plan[i][0], "max_tokens": 300, "ignore_eos": True}
        wait = plan[i][1]
        try:
            if i % 2:
                httpx.post(url + "/v1/completions", json=body, timeout=wait)
            else:
                with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=5) as r:
                    end = time.monotonic() + wait
                    for _ in r.iter_lines():
                        if time.monotonic() > end:
                            break
        except httpx.TimeoutException:
            pass

    with ThreadPoolExecutor(8) as pool:
        bystander = pool.submit(lambda: (_stream(url, {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                       "ignore_eos": True}), time.monotonic()))
        list(pool.map(client, range(20)))
        left = time.monotonic()
        got, ended = bystander.result()
    assert ended > left                        # every client left while the bystander streamed
    assert got["token_ids"] == _alone(srv, prompt, n) and not got["errors"]
    assert got["gap"] < STALL_S, got["gap"]
    _settled(srv, 3.0)
    assert _fives(url) == fives
    # most leave mid-generation or waiting (a client whose wait outlasts its 300 tokens completes)
    aborts = _metric(url, "fastqwen:request_success_total", finished_reason="abort") - aborted
    assert 15 <= aborts <= 20, aborts
    print(f"random disconnects: the bystander's longest gap {got['gap'] * 1000:.0f} ms, outlasting the last "
          f"client by {ended - left:.2f} s; {aborts:.0f} of 20 aborted")


# ---- bounded input work ------------------------------------------------------------------------
def test_a_slow_body_times_out_and_stalls_nobody(live):
    """A client sending its body a byte every 0.1 s (slowloris) gets a 408 in OpenAI's shape once
    the body deadline passes, its connection closed; a bystander stream meanwhile never waits
    more than STALL_S."""
    srv, url = live
    fives = _fives(url)
    port = int(url.rsplit(":", 1)[1])
    prompt = _prompts(32, (12,))[0]
    with ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(_stream, url, {"prompt": prompt, "max_tokens": 150, "temperature": 0,
                                               "ignore_eos": True})
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n")
            began, reply = time.monotonic(), b""
            s.settimeout(0.1)
            while time.monotonic() - began < 5:
                try:
                    s.sendall(b" ")
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
                except socket.timeout:
                    continue
                except OSError:
                    break
            took = time.monotonic() - began
        got = bystander.result()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), reply[:300]
    assert json.loads(body)["error"]["code"] == 408
    # the server's clock starts when it reads the headers, a moment before `began` may be taken
    assert BODY_TIMEOUT - 0.1 <= took < BODY_TIMEOUT + 1.5, took
    assert got["token_ids"] == _alone(srv, prompt, 150) and got["gap"] < STALL_S, got["gap"]
    assert _fives(url) == fives
    _settled(srv)


def test_large_bodies_and_prompts_are_refused_before_the_work(live):
    """A body over --max-request-bytes is a 413 (by its Content-Length, unread, and a chunked one
    while it is read); a prompt longer than the context can hold in characters is a 400 before
    it is tokenized; prompts that are tokenized, the largest the bound lets through, are
    tokenized off the event loop: /health answers within 0.4 s throughout, and a bystander
    stream never waits more than STALL_S."""
    srv, url = live
    fives = _fives(url)
    r = httpx.post(url + "/v1/completions", content=b"{" + b" " * LIMIT + b"}", headers=RAW)
    _check_error(r, 413, None, f"at most {LIMIT}")
    assert r.headers["connection"] == "close"

    def chunks():
        for _ in range(LIMIT // 2**16 + 2):
            yield b" " * 2**16

    r = httpx.post(url + "/v1/completions", content=chunks(), headers=RAW)
    _check_error(r, 413, None, "over 1048576 bytes")

    slowest, stop = [0.0], threading.Event()

    def poll():
        while not stop.is_set():
            began = time.monotonic()
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            slowest[0] = max(slowest[0], time.monotonic() - began)
            time.sleep(0.01)

    words = "".join(random.Random(3).choice("abcdefgh ij\n") for _ in range(MAX_LEN * 96 - 10))
    prompt = _prompts(33, (10,))[0]
    with ThreadPoolExecutor(6) as pool:
        poller = pool.submit(poll)
        bystander = pool.submit(_stream, url, {"prompt": prompt, "max_tokens": 100, "temperature": 0,
                                               "ignore_eos": True})
        began = time.monotonic()
        over = httpx.post(url + "/v1/completions", json={"prompt": "z" * (LIMIT - 100)}, timeout=30)
        refused_in = time.monotonic() - began
        tokenized = list(pool.map(lambda body: httpx.post(url + body[0], json=body[1], timeout=60), [
            ("/v1/completions", {"prompt": words}), ("/v1/completions", {"prompt": words[::-1]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": words[:-60]}]})]))
        got = bystander.result()
        stop.set()
        poller.result()
    _check_error(over, 400, "prompt", "characters")
    for r in tokenized:
        assert r.status_code == 400 and "tokens; this server's context is 2048" in r.json()["error"]["message"]
    assert slowest[0] < 0.4, slowest
    assert got["token_ids"] == _alone(srv, prompt, 100) and got["gap"] < STALL_S, got["gap"]
    print(f"large inputs: refused in {refused_in * 1000:.0f} ms; /health slowest {slowest[0] * 1000:.0f} ms; "
          f"bystander's longest gap {got['gap'] * 1000:.0f} ms")
    assert _fives(url) == fives
    _settled(srv)


# ---- lifecycle ---------------------------------------------------------------------------------
def test_health_is_503_until_the_engine_is_ready(live):
    """An app whose engine is still loading answers on its port at once: /health 503 with a JSON
    body, the API 503 in OpenAI's shape; once loaded, 200 and answers."""
    from fastqwen.serve.app import create_app

    srv, _ = live
    ready = threading.Event()
    web = Live(create_app(load=lambda: ready.wait() and srv), wait_ready=False)
    try:
        r = httpx.get(web.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        _check_error(httpx.post(web.url + "/v1/completions", json={"prompt": "hi"}), 503, None, "loading")
        ready.set()
        _wait_health(web.url, 10)
        assert httpx.post(web.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        ready.set()
        web.stop()


@pytest.fixture(scope="module")
def process(tiny_model, tmp_path_factory):
    """`fastqwen serve` in a process of its own (4 slots, a context of 4,096, a 1 s drain)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fastqwen.cli", "serve", "--model", str(tiny_model),
                                 "--port", str(port), "--max-batch", "4", "--max-model-len", "4096",
                                 "--drain-timeout", "1"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        seen = _wait_health(url, 120, proc)
        assert all(status == 503 and body == {"status": "loading"} for status, body in seen), seen
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_memory_comes_back_after_large_requests(process):
    """The server process's RSS after a warm-up, then after large requests (8 MiB bodies, bodies
    of a million token ids, texts at the character bound tokenized and refused), within 40 MB."""
    proc, url, _ = process
    with httpx.Client(base_url=url, timeout=60) as client:
        for n in (5, 50, 500):
            assert client.post("/v1/completions", json={"prompt": _prompts(n, (n,))[0], "max_tokens": 4}).is_success
        base = _rss_mb(proc.pid)
        words = "".join(random.Random(4).choice("abcdefgh ij\n") for _ in range(4096 * 96 - 10))
        peak = 0.0
        for i in range(3):
            for body in ({"prompt": "w" * (8 * 2**20 - 100)}, {"prompt": list(range(10, 10**6))},
                         {"prompt": words[i:]}):
                r = client.post("/v1/completions", json=body)
                assert r.status_code in (400, 413), r.text[:200]
                peak = max(peak, _rss_mb(proc.pid))
        time.sleep(0.5)                    # the heap is trimmed once the last one's objects are gone
        after = _rss_mb(proc.pid)
    print(f"RSS {base:.0f} MB before, {peak:.0f} at most while, {after:.0f} after large requests")
    assert after - base < 40, (base, peak, after)


def test_memory_does_not_creep_over_new_prompts(process):
    """Ten rounds of 16 prompts of new lengths each: the process's RSS grows by less than 30 MB
    over the last six (CPU matmul kernels cached per shape, 1,024 of each kind, grew it ~100 MB)."""
    proc, url, _ = process
    rng = random.Random(5)
    rss = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(10):
            lengths = rng.sample(range(20, 700), 16)
            with ThreadPoolExecutor(4) as pool:
                done = list(pool.map(lambda p: client.post("/v1/completions", json={"prompt": p, "max_tokens": 1}),
                                     _prompts(rng.randint(0, 10**6), lengths)))
            assert all(r.status_code == 200 for r in done)
            rss.append(_rss_mb(proc.pid))
    print("RSS over rounds of new prompts (MB):", [round(x) for x in rss])
    assert rss[-1] - rss[3] < 30, rss


def test_sigterm_drains_within_its_bound(process):
    """SIGTERM with two requests in flight: new requests get 503 (and /health 503 draining), the
    short one finishes, the long stream is ended by the 1 s drain bound with an error event and
    its usage so far, and the process exits 0 soon after."""
    proc, url, log = process
    # the short request's length from this machine's pace (a warm request's): its tokens in a third
    # of the drain
    for _ in range(2):
        began = time.monotonic()
        assert httpx.post(url + "/v1/completions", json={"prompt": "pace", "max_tokens": 16, "ignore_eos": True},
                          timeout=60).status_code == 200
    step_s = (time.monotonic() - began) / 16
    n = max(2, min(20, int(0.33 / step_s)))
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(_stream, url, {"prompt": "a long one", "max_tokens": 3000, "ignore_eos": True,
                                          "stream_options": {"include_usage": True}})
        time.sleep(0.5)
        short = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "short", "max_tokens": n,
                                                                       "ignore_eos": True}, timeout=30)
        deadline = time.monotonic() + 10     # both running before the signal, on a busy machine too
        while _metric(url, "fastqwen:num_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        _check_error(httpx.post(url + "/v1/completions", json={"prompt": "late"}), 503, None, "shutting down")
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert short.result().status_code == 200 and len(short.result().json()["choices"][0]["token_ids"]) == n
        got = long.result()
    ended = time.monotonic() - began
    assert got["errors"] and got["errors"][0]["error"]["code"] == 503 and got["done"], got["errors"]
    usage = got["errors"][0]["usage"]
    assert 0 < usage["completion_tokens"] == len(got["token_ids"]) < 3000 and got["usage"] == usage
    assert 0.8 < ended < 3.0, ended
    assert proc.wait(timeout=10) == 0, log.read_text()[-2000:]
    print(f"drain: the long stream ended {ended:.2f} s after SIGTERM with {usage['completion_tokens']} tokens; "
          f"the short one's {n} tokens finished ({step_s * 1e3:.0f} ms a token alone)")
