"""The OpenAI-compatible server under load, beside the engine's own generate(), in one run.

First generate() in this process with each stream count as the batch (--prompt-len + --output-len
tokens): TTFT, TPOT and output tokens/s, the median of --engine-reps calls after a warmup. Then
`fastqwen serve` in a subprocess on a free port (--max-batch the largest stream count, and
--max-model-len, --block-size, --prefill-chunk passed on), and fastqwen's own load generator,
`fastqwen bench-serve`, against it per stream count: streams x --waves requests, at most `streams`
in flight, each run its own prompts (a seed a run, so a prefix cache shares nothing between runs):
output tokens/s and TTFT / TPOT / ITL as bench-serve reports them (vLLM's definitions).

BENCH_SERVE_SITE, a folder of the server's libraries (FastAPI, uvicorn, ...; bench/gpu.sh installs the
carried wheels there on the GPU machine), goes first on the subprocesses' PYTHONPATH (the server and
the load generator load no Transformers, so nothing of the judge's stack is shadowed).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.runner import (REPO, BenchError, Column, add_model_argument, build_engine, gpu_visible, int_list,
                          positive_int, resolve_model)

COLUMNS = [Column("kind", width=6, left=True), Column("streams", width=7), Column("requests", width=8),
           Column("ready_s", "ready s", fmt="{:.1f}"), Column("slots", width=6), Column("running_peak", "peak", width=5),
           Column("output_tok_s", "out tok/s", fmt="{:.1f}"), Column("ttft_ms", "TTFT ms", fmt="{:.2f}"),
           Column("ttft_p99_ms", "TTFT p99", fmt="{:.2f}"), Column("tpot_ms", "TPOT ms", fmt="{:.3f}"),
           Column("itl_p99_ms", "ITL p99", fmt="{:.3f}"), Column("failed", width=6),
           Column("error", width=30, left=True)]


def add_arguments(parser) -> None:
    add_model_argument(parser)
    parser.add_argument("--streams", type=int_list, default=[1, 4, 16], help="concurrent streams (default 1,4,16)")
    parser.add_argument("--waves", type=positive_int, default=2, help="requests a run = streams x waves (default 2)")
    parser.add_argument("--prompt-len", type=positive_int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--output-len", type=positive_int, default=128, help="output tokens (default 128)")
    parser.add_argument("--engine-reps", type=positive_int, default=3, help="timed generate() calls (default 3)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048, help="the server's (default 2048)")
    parser.add_argument("--block-size", type=int, default=0, help="the server's paged KV cache (default 0: rows)")
    parser.add_argument("--prefill-chunk", type=int, default=0, help="the server's chunked prefill (default 0)")
    parser.add_argument("--speculation", default=None, choices=["off", "ngram", "auto"],
                        help="the server's speculation (default: its own default)")
    parser.add_argument("--server-timeout-s", type=positive_int, default=600,
                        help="for the server to answer /health (default 600)")
    parser.add_argument("--max-batch", type=positive_int, default=None,
                        help="the server's slot cap (default: the most streams)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="the server's GPU memory cap in GiB (its --gpu-memory-fraction of the device's total); "
                             "with more streams than fit, the extra requests wait for a slot (default: no cap)")
    parser.add_argument("--no-engine", action="store_true", help="skip the generate() rows (only the server's)")


def _ms(value):
    return None if value is None else value * 1e3


def engine_rows(model_dir: Path, args, report) -> None:
    import gc

    import torch

    eng = build_engine(model_dir)
    report.note(f"# {model_dir}: {eng.describe()}")
    for batch in args.streams:
        ids = torch.randint(0, eng.cfg.vocab_size, (batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(batch)).tolist()
        for _ in eng.generate(ids, args.output_len):      # warmup: tuning, graphs
            pass
        calls = []
        for _ in range(args.engine_reps):
            if gpu_visible():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stamps = [time.perf_counter() for _ in eng.generate(ids, args.output_len)]
            tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
            calls.append((stamps[-1] - t0, stamps[0] - t0, tpot))
        total, ttft, tpot = sorted(calls, key=lambda c: c[0])[len(calls) // 2]
        report.add({"kind": "engine", "streams": batch, "requests": batch, "prompt_len": args.prompt_len,
                    "output_len": args.output_len, "output_tok_s": batch * args.output_len / total,
                    "ttft_ms": _ms(ttft), "tpot_ms": _ms(tpot), "total_ms": _ms(total), "failed": 0})
    del eng
    gc.collect()
    if gpu_visible():
        torch.cuda.empty_cache()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    site = env.get("BENCH_SERVE_SITE")
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in [env.get("PYTHONPATH", "")] if p])
    return env


def _wait_healthy(proc, url: str, log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise BenchError(f"the server did not answer /health in {timeout_s} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def _server(cmd: list, env: dict, url: str, log: Path, timeout_s: float):
    """`fastqwen serve` (cmd) started with its output in log; yields the seconds from the start to
    its first /health 200, and stops it (politely, then by force) on exit."""
    began = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(proc, url, log, timeout_s)
        yield time.monotonic() - began
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _memory_fraction(gib: float) -> float:
    import torch

    if not gpu_visible():
        raise BenchError("--memory-gib needs a GPU (it is a fraction of the device's memory)")
    return gib * 2**30 / torch.cuda.get_device_properties(0).total_memory


def _slots(log: Path) -> int | None:
    """The slot count from the server's "ready" line: what its memory plan admits at once."""
    found = re.search(r"ready on \S+ \((\d+) slots", log.read_text())
    return int(found.group(1)) if found else None


def _metric(url: str, name: str) -> float | None:
    """One of the server's /metrics values (the first series of that name), None where it has none."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf"^fastqwen:{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def _running_peak(url: str) -> float | None:
    return _metric(url, "num_requests_running_peak")


def server_rows(model_dir: Path, args, report, tmp: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fastqwen.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--max-batch", str(args.max_batch or max(args.streams)), "--max-model-len", str(args.max_model_len)]
    cmd += ["--block-size", str(args.block_size)] if args.block_size else []
    cmd += ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []
    cmd += ["--speculation", args.speculation] if args.speculation else []
    cmd += ["--gpu-memory-fraction", f"{_memory_fraction(args.memory_gib):.6f}"] if args.memory_gib else []
    log = tmp / "server.log"
    env = _env()
    with _server(cmd, env, url, log, args.server_timeout_s) as ready_s:
        report.add({"kind": "ready", "ready_s": ready_s, "slots": _slots(log),
                    "memory_gib": args.memory_gib, "server_log": log.read_text()[-1000:]})
        for seed, streams in enumerate(args.streams, start=10):
            out = tmp / f"bench_serve_{streams}.json"
            drafted0 = _metric(url, "spec_decode_num_draft_tokens_total") or 0.0
            accepted0 = _metric(url, "spec_decode_num_accepted_tokens_total") or 0.0
            requests = streams * args.waves
            load = [sys.executable, "-m", "fastqwen.cli", "bench-serve", "--url", url, "--requests", str(requests),
                    "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                    "--concurrency", str(streams), "--seed", str(seed), "--out", str(out), "--no-progress"]
            done = subprocess.run(load, cwd=REPO, capture_output=True, text=True, env=env,
                                  timeout=args.server_timeout_s)
            if not out.is_file():
                report.add({"kind": "server", "streams": streams, "requests": requests,
                            "error": (done.stderr or done.stdout)[-2000:]})
                continue
            r = json.loads(out.read_text())
            r.pop("samples", None)
            report.add({"kind": "server", "streams": streams, "requests": requests, "prompt_len": args.prompt_len,
                        "output_len": args.output_len, "output_tok_s": r["output_throughput"],
                        "ttft_ms": _ms(r["ttft_s"]["median"]), "ttft_p99_ms": _ms(r["ttft_s"]["p99"]),
                        "tpot_ms": _ms(r["tpot_s"]["median"]), "itl_p99_ms": _ms(r["itl_s"]["p99"]),
                        "failed": r["failed"], "running_peak": _running_peak(url),
                        # the server's speculation over this load: drafts verified, drafts accepted
                        "spec_draft_tokens": (_metric(url, "spec_decode_num_draft_tokens_total") or 0.0) - drafted0,
                        "spec_accepted_tokens": (_metric(url, "spec_decode_num_accepted_tokens_total") or 0.0)
                        - accepted0, "bench_serve": r})


def run(args, report) -> None:
    from bench import runner

    if args.engine is not None and runner.ENGINE_DIR != (REPO / "engine").resolve():
        raise BenchError("the server runs the repository's engine/ (fastqwen/serve/app.py): --engine is not "
                         "for this entry")
    if args.prompt_len + args.output_len > args.max_model_len:
        raise BenchError(f"--prompt-len {args.prompt_len} + --output-len {args.output_len} exceeds "
                         f"--max-model-len {args.max_model_len}")
    model_dir = resolve_model(args.model)
    if not args.no_engine:
        engine_rows(model_dir, args, report)
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        server_rows(model_dir, args, report, Path(tmp))
