"""`fastqwen serve` on the tiny preset (CPU), driven by the OpenAI client: completions from text
and from token ids, chat with streaming, 8 concurrent requests of different lengths each
getting its greedy tokens (the tokens the engine gives that prompt alone, which pass the
2.0-logit margin: tests/test_engine_cpu.py), bad requests answered 400 in OpenAI's shape
while the server goes on, and /metrics as Prometheus text."""
from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from serve_live import serving  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_model):
    from fastqwen.serve.app import Server

    srv = Server(str(tiny_model), max_batch=4, max_model_len=512, served_model_name="tiny")
    with serving(srv) as url:
        yield srv, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none")


def _alone(srv, prompt_ids, n):
    """The engine's own greedy tokens for this prompt alone (a second engine: the server's is busy)."""
    from fastqwen.serve.app import engine_module

    engines = _alone.__dict__.setdefault("engines", {})
    if srv.model_dir not in engines:
        engines[srv.model_dir] = engine_module().Engine(srv.model_dir)
    return [s[0] for s in engines[srv.model_dir].generate([prompt_ids], n)]


def _until_eos(srv, tokens):
    """tokens up to and with the first end token (where the server stops a request)."""
    n = next((k + 1 for k, t in enumerate(tokens) if t in srv.codec.stop_token_ids), len(tokens))
    return tokens[:n]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server[1] + "/health").json() == {"status": "ok"}


def test_completion_from_token_ids_is_the_engines_greedy_output(server, client):
    ids = torch.randint(0, 4000, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.token_ids == _until_eos(server[0], _alone(server[0], ids, 12))
    assert out.usage.prompt_tokens == 37 and out.usage.completion_tokens == len(choice.token_ids)
    assert choice.text == server[0].codec.decode(choice.token_ids)


def test_completion_from_text(server, client):
    out = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0)
    ids = server[0].codec.encode("The quick brown fox")
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].token_ids[:1] == _alone(server[0], ids, 1)


def test_chat_streams_the_whole_answer(server, client):
    messages = [{"role": "user", "content": "Say something."}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert text == whole.choices[0].message.content and finish == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"


def test_eight_concurrent_requests_each_get_their_own_tokens(server, client):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 4000, (n,), generator=gen).tolist() for n in (5, 90, 17, 200, 33, 64, 8, 129)]
    want = [6, 10, 14, 4, 9, 12, 7, 5]

    def one(i):
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=want[i], temperature=0)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, res in enumerate(results):
        got = res.choices[0].token_ids
        assert got == _until_eos(server[0], _alone(server[0], prompts[i], want[i])), i


def test_sampling_with_a_seed_repeats(client):
    """The same seed, the same tokens; other seeds draw other tokens, none of them greedy's."""
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.95,
              extra_body={"ignore_eos": True})

    def tokens(**more):
        return client.completions.create(**dict(kw, **more)).choices[0].token_ids

    a, b = tokens(seed=11), tokens(seed=11)
    assert a == b
    others = [tokens(seed=s) for s in (12, 13)]
    greedy = tokens(temperature=0)
    assert len({tuple(t) for t in [a] + others + [greedy]}) == 4


@pytest.mark.parametrize("body,status,fragment", [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0.0"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"prompt": [1, 2, 99999]}, 400, "token id 99999 is outside the vocabulary"),
    ({"prompt": 5}, 400, "prompt must be a string"),
    ({"model": "other", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": "hi", "n": 3}, 400, "n must be 1"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, fragment):
    r = httpx.post(server[1] + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]
    ok = httpx.post(server[1] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_chat_and_bad_json(server):
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "non-empty list" in r.json()["error"]["message"]
    r = httpx.post(server[1] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_metrics_are_prometheus_text(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    text = httpx.get(server[1] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("fastqwen:time_to_first_token_seconds", "fastqwen:inter_token_latency_seconds",
                 "fastqwen:num_requests_running", "fastqwen:num_requests_waiting", "fastqwen:kv_cache_usage_perc",
                 "fastqwen:generation_tokens", "fastqwen:request_success"):
        assert name in families, sorted(families)
    done = sum(s.value for s in families["fastqwen:request_success"].samples if s.name.endswith("_total"))
    assert done >= 1
    # every request's prompt pass is counted by how it ran (on the CPU: eager, one pass a group)
    passes = {s.labels["kind"]: s.value for s in families["fastqwen:prompt_pass_seconds"].samples
              if s.name.endswith("_count")}
    assert set(passes) <= {"group", "eager", "capture", "graph"} and sum(passes.values()) >= 1, passes
    assert passes.get("capture", 0) == passes.get("graph", 0) == 0


def test_bench_serve_measures_every_request(server, tmp_path):
    import asyncio
    import json as json_module

    from fastqwen.cli import main

    report = asyncio.run(__import__("fastqwen.serve.bench", fromlist=["run_benchmark"]).run_benchmark(
        server[1], requests=6, prompt_len=20, output_len=5, rate=50.0, concurrency=3, progress=False))
    assert report["completed"] == 6 and report["failed"] == 0
    assert len(report["samples"]["ttft"]) == 6 and len(report["samples"]["itl"]) == 6 * 4
    assert report["output_throughput"] > 0 and report["ttft_s"]["p99"] >= report["ttft_s"]["median"] > 0
    out, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench-serve", "--url", server[1], "--requests", "4", "--prompt-len", "9", "--output-len", "3",
                 "--out", str(out), "--chart", str(chart), "--no-progress"]) == 0
    saved = json_module.loads(out.read_text())
    assert saved["completed"] == 4 and saved["tpot_s"]["mean"] > 0 and chart.stat().st_size > 1000
    # a prefix common to every prompt (vLLM's --random-prefix-len): counted in the prompt tokens
    shared = asyncio.run(__import__("fastqwen.serve.bench", fromlist=["run_benchmark"]).run_benchmark(
        server[1], requests=3, prompt_len=4, output_len=2, concurrency=1, progress=False, prefix_len=6))
    assert shared["completed"] == 3 and shared["prefix_len"] == 6
    total = shared["total_token_throughput"] * shared["duration_s"]
    assert abs(total - (3 * 2 + 3 * (6 + 4))) < 1e-6
    assert main(["bench-serve", "--url", server[1], "--prefix-len", "-1", "--no-progress"]) == 2


def test_lm_eval_runs_local_tasks_against_the_server(server, tmp_path, tiny_model, monkeypatch):
    """lm-evaluation-harness's local-completions model on the server, from another working
    directory (the tasks find their data beside their yaml), with the checkpoint's own tokenizer
    (no hub): a multiple-choice task (log-likelihoods: completions with echo and logprobs) and a
    generation task (tests/fixtures/lmeval); every document answered. Each choice's score is the
    sum of its tokens' log-probabilities, which the server's echo gives."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    fixtures = __import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "lmeval"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = (f"model=tiny,base_url={server[1]}/v1/completions,tokenizer={tiny_model},tokenizer_backend=huggingface,"
            "num_concurrent=4,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args,
                                      tasks=["fastqwen_choice", "fastqwen_local"],
                                      task_manager=TaskManager(include_path=str(fixtures)), log_samples=True)
    assert 0.0 <= results["results"]["fastqwen_local"]["exact_match,none"] <= 1.0
    assert 0.0 <= results["results"]["fastqwen_choice"]["acc,none"] <= 1.0
    generated = results["samples"]["fastqwen_local"]
    assert len(generated) == 6 and all(isinstance(s["resps"][0][0], str) for s in generated)
    scored = results["samples"]["fastqwen_choice"]
    assert len(scored) == 6 and all(len(s["resps"]) == 3 for s in scored)
    doc = scored[0]
    context = server[0].codec.encode(f"Q: {doc['doc']['question']}\nA:")
    answer = server[0].codec.encode(" " + doc["doc"]["choices"][0])
    echo = httpx.post(server[1] + "/v1/completions", json={"prompt": context + answer, "max_tokens": 1,
                                                            "logprobs": 1, "echo": True, "temperature": 0}).json()
    own = sum(echo["choices"][0]["logprobs"]["token_logprobs"][len(context):len(context) + len(answer)])
    assert abs(doc["resps"][0][0][0] - own) < 1e-4


def _metric(url, name, **labels):
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_a_client_that_disconnects_frees_its_slot(server):
    url = server[1]
    aborted = _metric(url, "fastqwen:request_success_total", finished_reason="abort")
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "go", "max_tokens": 400, "stream": True,
                                                              "ignore_eos": True}) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    for _ in range(100):                                  # the scheduler notices within a step or two
        if _metric(url, "fastqwen:request_success_total", finished_reason="abort") > aborted:
            break
        time.sleep(0.05)
    assert _metric(url, "fastqwen:request_success_total", finished_reason="abort") == aborted + 1
    assert _metric(url, "fastqwen:num_requests_running") == 0
    assert server[0].scheduler.slots.free == 4 and not server[0].scheduler.slots.running
    assert httpx.post(url + "/v1/completions", json={"prompt": "again", "max_tokens": 2}).status_code == 200


def test_stop_strings_and_usage_in_the_stream(server, client):
    codec = server[0].codec
    free = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0)
    text = free.choices[0].text
    if len(text) < 4:
        pytest.skip("the tiny model's continuation is too short to cut")
    stop = text[2:4]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == len(codec.encode("abc"))


def test_a_full_queue_is_a_429(tiny_model):
    """One slot, one waiting place: the third concurrent request is refused with 429."""
    import asyncio

    from fastqwen.serve.app import Server, create_app

    srv = Server(str(tiny_model), max_batch=1, max_model_len=512, served_model_name="tiny", max_waiting=1)
    try:
        async def scenario():
            transport = httpx.ASGITransport(app=create_app(srv))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as ac:
                body = {"prompt": "x", "max_tokens": 500, "ignore_eos": True}     # ~1 s a request here
                first = asyncio.create_task(ac.post("/v1/completions", json=body))
                for _ in range(6000):                             # running in the slot
                    if srv.scheduler.running:
                        break
                    await asyncio.sleep(0.005)
                second = asyncio.create_task(ac.post("/v1/completions", json=body))
                for _ in range(6000):                             # waiting
                    if srv.scheduler.num_waiting:
                        break
                    await asyncio.sleep(0.005)
                third = await ac.post("/v1/completions", json=body)
                return third, await first, await second

        third, first, second = asyncio.run(scenario())
        assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"
        assert first.status_code == 200 and second.status_code == 200
    finally:
        srv.close()


def test_a_qwen35_checkpoint_is_served(tmp_path):
    """The server sits on the engine's model interface: a Qwen3.5 checkpoint (the tiny hybrid,
    torch op set on the CPU) answers completions and chat, its greedy tokens the engine's own."""
    from fastqwen import synth35
    from fastqwen.serve.app import Server, create_app

    path = synth35.synthesize("qwen3.5-tiny", tmp_path / "q35", seed=3, progress=False)
    srv = Server(str(path), max_batch=2, max_model_len=256, served_model_name="q35")
    try:
        import asyncio

        async def calls():
            transport = httpx.ASGITransport(app=create_app(srv))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as ac:
                done = await asyncio.gather(
                    ac.post("/v1/completions", json={"prompt": list(range(3, 73)), "max_tokens": 6, "temperature": 0}),
                    ac.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 4, "temperature": 0}))
                return [r.json() for r in done]

        completion, chat = asyncio.run(calls())
        assert completion["choices"][0]["token_ids"] == _until_eos(srv, _alone(srv, list(range(3, 73)), 6))
        assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] >= 1
    finally:
        srv.close()


def test_qwen35_prompts_share_a_prefix_through_its_state_snapshot(tmp_path):
    """A Qwen3.5 checkpoint served with pages of 64: the second prompt takes the first's two whole
    pages of their common 150 tokens (the GDN states at 128 from the first pass's snapshot) and
    both get their tokens alone; /metrics counts the 128 positions. With --state-snapshots 0
    nothing is shared and the tokens are the same."""
    from fastqwen import synth35
    from fastqwen.serve.app import Server

    path = synth35.synthesize("qwen3.5-tiny", tmp_path / "q35", seed=3, progress=False)
    gen = torch.Generator().manual_seed(9)
    base = torch.randint(0, 1000, (150,), generator=gen).tolist()
    prompts = [base + [11, 12, 13], base + [21, 22]]
    for snapshots, want in ((None, 128), (0, 0)):          # --state-snapshots 0: nothing shared
        _serve_in_turn(Server(str(path), max_batch=2, max_model_len=256, served_model_name="q35", block_size=64,
                              state_snapshots=snapshots), prompts, 5, want)


def test_qwen35_more_requests_at_once_than_state_snapshots(tmp_path):
    """Qwen3.5, pages of 64, room for 2 state snapshots (fewer than the prompts arriving at once,
    as with 8 and 16 streams): two prompts served in turn keep theirs, then eight at once, two of
    them repeating those prompts (they share) and six new ones of one length (one pass, which
    would need six snapshots): every request gets its tokens alone, and the server goes on
    serving."""
    import asyncio

    from fastqwen import synth35
    from fastqwen.serve.app import Server, create_app

    path = synth35.synthesize("qwen3.5-tiny", tmp_path / "q35", seed=4, progress=False)
    srv = Server(str(path), max_batch=8, max_model_len=256, served_model_name="q35", block_size=64,
                 state_snapshots=2)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 1000, (150,), generator=gen).tolist() for _ in range(8)]
    try:
        async def calls():
            transport = httpx.ASGITransport(app=create_app(srv))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as ac:
                def ask(p):
                    return ac.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0})
                first = [(await ask(p)).json() for p in prompts[:2]]
                burst = [r.json() for r in await asyncio.gather(*(ask(p) for p in prompts))]
                return first + burst + [(await ask(prompts[2])).json()]

        results = asyncio.run(calls())
        for i, (res, prompt) in enumerate(zip(results, prompts[:2] + prompts + prompts[2:3])):
            assert "choices" in res, (i, res)
            assert res["choices"][0]["token_ids"] == _until_eos(srv, _alone(srv, prompt, 4)), i
        assert srv.scheduler.slots.pool.hit_tokens >= 2 * 128
    finally:
        srv.close()


def _serve_in_turn(srv, prompts, max_tokens, want_hits):
    """Each prompt through srv's completions in turn, greedy, max_tokens each: each gets its tokens
    alone, and /metrics counts want_hits prompt positions found in kept pages; srv closed after."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    from fastqwen.serve.app import create_app

    try:
        async def calls():
            transport = httpx.ASGITransport(app=create_app(srv))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as ac:
                out = [(await ac.post("/v1/completions", json={"prompt": p, "max_tokens": max_tokens,
                                                               "temperature": 0})).json() for p in prompts]
                return out, (await ac.get("/metrics")).text

        results, metrics = asyncio.run(calls())
        for i, res in enumerate(results):
            assert res["choices"][0]["token_ids"] == _until_eos(srv, _alone(srv, prompts[i], max_tokens)), i
        hits = sum(x.value for fam in text_string_to_metric_families(metrics) for x in fam.samples
                   if x.name == "fastqwen:prefix_cache_hit_tokens_total")
        assert hits == want_hits, hits
    finally:
        srv.close()


def test_the_serve_command_answers_like_the_readme_shows(tiny_model):
    """`fastqwen serve` as a user starts it (a process of its own), asked as the README asks it."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "fastqwen.cli", "serve", "--model", str(tiny_model), "--port",
                             str(port), "--max-batch", "2", "--max-model-len", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"on http://127.0.0.1:{port}" in out


def test_serve_command_errors_name_the_bad_value(tmp_path, tiny_model, capsys):
    from fastqwen.cli import main

    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_model), "--max-batch", "0"]) == 2
    assert "--max-batch must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_model), "--gpu-memory-fraction", "1.5"]) == 2
    assert "--gpu-memory-fraction must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_a_request_that_fills_its_slot_ends_with_length(server, client):
    """A prompt that leaves its slot 4 positions: the first token and 4 steps, then "length",
    the same tokens as the engine's own; the loop queues each step before it hands out the
    one before (scheduler.py), so the slot's room must count the step in flight."""
    prompt = torch.randint(0, 4000, (508,), generator=torch.Generator().manual_seed(3)).tolist()
    res = client.completions.create(model="tiny", prompt=prompt, max_tokens=50, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert res.choices[0].finish_reason == "length"
    assert res.choices[0].token_ids == _alone(server[0], prompt, 5)


def test_a_paged_server_gives_each_request_its_own_tokens(tiny_model):
    """--block-size: the paged KV cache behind the same API. 8 concurrent requests of different
    lengths on 4 slots and 12 blocks of 64 (each request takes the blocks for its prompt and
    max_tokens, so some wait for blocks as well as slots), each with its greedy tokens; every
    block is free again at the end and /metrics reports the cache in use."""
    import asyncio

    from fastqwen.serve.app import Server, create_app

    srv = Server(str(tiny_model), max_batch=4, max_model_len=512, served_model_name="tiny", block_size=64)
    srv.scheduler.close()                      # the same server with a smaller pool, to make requests wait
    from fastqwen.serve.scheduler import Scheduler

    srv.scheduler = Scheduler(srv.engine, srv.codec, 4, 512, metrics=srv.metrics, block_size=64, num_blocks=12)
    try:
        assert srv.num_blocks == 4 * 512 // 64
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, 4000, (n,), generator=gen).tolist() for n in (5, 90, 17, 200, 33, 64, 8, 129)]
        want = [6, 10, 14, 4, 9, 12, 7, 5]

        async def calls():
            transport = httpx.ASGITransport(app=create_app(srv))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as ac:
                done = await asyncio.gather(*(ac.post("/v1/completions", json={
                    "prompt": p, "max_tokens": n, "temperature": 0}) for p, n in zip(prompts, want)))
                metrics = (await ac.get("/metrics")).text
                return [r.json() for r in done], metrics

        results, metrics = asyncio.run(calls())
        for i, res in enumerate(results):
            assert res["choices"][0]["token_ids"] == _until_eos(srv, _alone(srv, prompts[i], want[i])), i
        assert "fastqwen:kv_cache_usage_perc" in metrics
        assert srv.scheduler.slots.free_pages == 12 and srv.scheduler.kv_usage == 0.0
    finally:
        srv.close()


@pytest.mark.parametrize("block_size", [0, 64])
def test_long_prompts_join_in_chunks(tiny_model, block_size):
    """--prefill-chunk 32: prompts longer than 32 tokens that arrive while others run are prefilled
    32 tokens between two decode steps; 8 concurrent requests of different lengths each get
    their greedy tokens (rows and the paged cache)."""
    import asyncio

    from fastqwen.serve.app import Server, create_app

    srv = Server(str(tiny_model), max_batch=4, max_model_len=512, served_model_name="tiny", block_size=block_size,
                 prefill_chunk=32)
    # ("chunk", its tokens, rows running, its prompt's length), ("whole", tokens, rows running) or ("step",)
    slots, events = srv.scheduler.slots, []
    real_chunk, real_group, real_step = slots.prefill_next, slots.admit_group, slots.step_rows

    def chunk(tokens):
        _, prompt, _, _, done = slots._staged[:5]
        events.append(("chunk", min(tokens, len(prompt) - done), len(slots.keys), len(prompt)))
        return real_chunk(tokens)

    def group(keys, prompts, *args, **kwargs):
        events.append(("whole", sum(map(len, prompts)), len(slots.keys)))
        return real_group(keys, prompts, *args, **kwargs)

    def step(tokens):
        events.append(("step",))
        return real_step(tokens)

    slots.prefill_next, slots.admit_group, slots.step_rows = chunk, group, step
    try:
        gen = torch.Generator().manual_seed(8)
        prompts = [torch.randint(0, 4000, (n,), generator=gen).tolist() for n in (5, 90, 17, 200, 33, 64, 8, 129)]
        want = [12, 10, 14, 4, 9, 12, 7, 5]

        async def calls():
            transport = httpx.ASGITransport(app=create_app(srv))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as ac:
                first = asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": prompts[0], "max_tokens": want[0], "temperature": 0}))
                for _ in range(6000):                  # running when the long prompts arrive
                    if srv.scheduler.running:
                        break
                    await asyncio.sleep(0.005)
                rest = await asyncio.gather(*(ac.post("/v1/completions", json={
                    "prompt": p, "max_tokens": n, "temperature": 0}) for p, n in zip(prompts[1:], want[1:])))
                return [r.json() for r in [await first] + list(rest)]

        results = asyncio.run(calls())
        for i, res in enumerate(results):
            assert res["choices"][0]["token_ids"] == _until_eos(srv, _alone(srv, prompts[i], want[i])), i
        assert srv.scheduler.slots.staged is None and not srv.scheduler.running
        # the 200-token prompt went in 7 chunks; between two decode steps, with rows running, at
        # most 32 prompt tokens went in
        chunks = [e for e in events if e[0] == "chunk"]
        assert sum(e[3] == 200 for e in chunks) == 7 and srv.scheduler.chunks == len(chunks)
        between = 0
        for e in events:
            between = 0 if e[0] == "step" else between + (e[1] if e[2] else 0)
            assert between <= 32, events
    finally:
        srv.close()


def test_short_prompts_share_the_chunk_budget(tiny_model):
    """--prefill-chunk 32 with a request running: six 10-token prompts that arrive together go
    in whole, at most three a pass (30 of the 32 tokens between two steps), not all six in one
    pass; each gets its greedy tokens. Without the budget (whole prompts) the six go in one pass."""
    import asyncio

    from fastqwen.serve.app import Server, create_app

    srv = Server(str(tiny_model), max_batch=8, max_model_len=256, served_model_name="tiny", prefill_chunk=32)
    passes = []
    sched = srv.scheduler
    admit_group = sched.slots.admit_group
    sched.slots.admit_group = lambda keys, *a, **k: passes.append(len(keys)) or admit_group(keys, *a, **k)
    # The six arrive over a few milliseconds: once the first request runs, the scheduler's next
    # admission waits (at most 30 s) until all six are queued, so what a pass takes depends on the
    # budget alone, not on how the requests' arrival interleaves with the decode steps on a busy CPU.
    real_admit = sched._admit

    def admit():
        deadline = time.monotonic() + 30
        while len(passes) == 1 and sched.waiting.qsize() < 6 and time.monotonic() < deadline:
            time.sleep(0.002)
        return real_admit()

    sched._admit = admit
    try:
        gen = torch.Generator().manual_seed(9)
        prompts = [torch.randint(0, 4000, (10,), generator=gen).tolist() for _ in range(7)]

        async def calls(first_tokens):
            transport = httpx.ASGITransport(app=create_app(srv))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as ac:
                body = {"prompt": prompts[0], "max_tokens": first_tokens, "temperature": 0, "ignore_eos": True}
                first = asyncio.create_task(ac.post("/v1/completions", json=body))
                for _ in range(6000):                      # running (admitted alone) when the others arrive
                    if passes:
                        break
                    await asyncio.sleep(0.005)
                rest = await asyncio.gather(*(ac.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 6, "temperature": 0}) for p in prompts[1:]))
                return [r.json() for r in [await first] + list(rest)]

        results = asyncio.run(calls(60))
        assert passes[0] == 1 and max(passes[1:]) <= 3 and sum(passes) == 7, passes
        for i, res in enumerate(results[1:], start=1):
            assert res["choices"][0]["token_ids"] == _until_eos(srv, _alone(srv, prompts[i], 6)), i
        passes.clear()
        srv.scheduler.prefill_chunk = None                 # whole prompts: the six in one pass
        asyncio.run(calls(60))
        assert max(passes) == 6, passes
    finally:
        srv.close()


def test_prompts_that_start_alike_share_their_pages(tiny_model):
    """--block-size 64: a second request whose prompt starts with the first's 200 tokens takes the
    first's 3 full pages of them (192 positions, counted in /metrics) and gets its own greedy
    tokens; the same server with --no-prefix-sharing shares nothing."""
    from fastqwen.serve.app import Server

    gen = torch.Generator().manual_seed(9)
    base = torch.randint(0, 4000, (200,), generator=gen).tolist()
    prompts = [base + [11, 12, 13], base + [21, 22]]
    for share in (True, False):
        _serve_in_turn(Server(str(tiny_model), max_batch=2, max_model_len=512, served_model_name="tiny",
                              block_size=64, share_prefixes=share), prompts, 6, 192 if share else 0)


