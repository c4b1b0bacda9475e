"""The serving front on a GPU, what issue 13 asks to be shown, in one run: the engine's own
batch-1 TPOT (Engine.generate, 512 + 128), then `fastqwen serve` in a subprocess and
`bench-serve` against it: one stream (TPOT against the engine's), 16 concurrent streams of
512 + 128 (output tok/s, to set beside the judge's (16, 512, 128)), several request rates
(TTFT / ITL p50 / p99 against rate), and with --memory-gib the most concurrent 1,024 + 256
requests the server runs at once under that memory cap. One JSON report.

    python scripts/gpu_serve_bench.py --model DIR [--out FILE] [--memory-gib 24] [--block-size 64] [--prefill-chunk 256]
        [--runs one_stream,sixteen_streams]

--block-size, --prefill-chunk: the server's options of those names; --runs: only these of the runs
(one_stream, sixteen_streams, sixteen_streams_long, rate_1, rate_4, rate_16, prefix_0, prefix_384; the memory cap's run
with --memory-gib). prefix_384 sends 16 requests one at a time whose prompts share their first
384 tokens (then 128 of their own, 32 out), prefix_0 the same without the common prefix: TTFT
with and without the prefix cache, and the server's prefix_cache_hit_tokens over each run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "engine"))


def engine_tpot(model: str) -> dict:
    import torch

    from engine import Engine

    eng = Engine(model)
    ids = torch.randint(0, min(32000, eng.cfg.vocab_size), (1, 512), generator=torch.Generator().manual_seed(0)).tolist()
    list(eng.generate(ids, 128))                       # warmup: tune, graphs
    times = []
    for _ in range(3):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        stamps = []
        for _ in eng.generate(ids, 128):
            stamps.append(time.perf_counter())
        times.append(((stamps[-1] - stamps[0]) / 127, stamps[0] - start))
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    tpot, ttft = sorted(times)[1]
    return {"tpot_s": tpot, "ttft_s": ttft}


def start_server(model: str, port: int, extra: list) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastqwen.cli", "serve", "--model", model, "--port", str(port)] + extra
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import httpx

    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.25)
    raise RuntimeError("server did not come up in 300 s")


def _series(text: str, name: str) -> float:
    """A series' value in Prometheus text, summed over its label sets."""
    return sum((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " ")), 0.0)


def scrape(url: str) -> dict:
    """One read of the server's /metrics: its prefix_cache_hit_tokens counter ("hits"); its own
    TTFT histogram's (sum, count) ("ttft": from a request's submit to the scheduler, after the HTTP
    side parsed it, to its first token handed to the HTTP side); its prompt_pass_seconds as kind ->
    [count, seconds] ("passes": each prompt pass that ended in first tokens, by how it ran: group,
    eager, capture, graph; scheduler.py)."""
    import httpx

    text = httpx.get(url + "/metrics").text
    passes = {}
    for line in text.splitlines():
        for suffix, at in (("_count", 0), ("_sum", 1)):
            if line.startswith("fastqwen:prompt_pass_seconds" + suffix + "{") and 'kind="' in line:
                kind = line.split('kind="', 1)[1].split('"', 1)[0]
                passes.setdefault(kind, [0.0, 0.0])[at] += float(line.rsplit(" ", 1)[1])
    return {"hits": _series(text, "fastqwen:prefix_cache_hit_tokens_total"),
            "ttft": tuple(_series(text, "fastqwen:time_to_first_token_seconds" + s) for s in ("_sum", "_count")),
            "passes": passes}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from fastqwen.serve.bench import run_benchmark

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "serve_bench.json"))
    ap.add_argument("--memory-gib", type=float, default=None)
    ap.add_argument("--quick", action="store_true", help="a few small requests (a CPU smoke run)")
    ap.add_argument("--block-size", type=int, default=0, help="the server's paged KV cache (0: rows)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="the server's chunked prefill (0: whole prompts)")
    ap.add_argument("--runs", default="", help="comma-separated subset of the runs (default: all; none: only "
                    "the --memory-gib run)")
    args = ap.parse_args()
    report = {"model": args.model, "block_size": args.block_size, "prefill_chunk": args.prefill_chunk}
    paged = ["--block-size", str(args.block_size)] if args.block_size else []
    paged += ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    def slim(r):
        r = dict(r)
        r.pop("samples", None)
        return r

    # each run its own seed: no run's prompts repeat another's, so with a prefix cache only the
    # prefix runs share anything (session 16: the 16 streams repeated the one stream's prompts)
    runs = {"one_stream": dict(requests=8, prompt_len=512, output_len=128, concurrency=1, seed=10),
            "sixteen_streams": dict(requests=32, prompt_len=512, output_len=128, concurrency=16, seed=11),
            # the same for 6 waves: a steadier figure (32 requests last ~1.3 s, so how the first
            # wave's arrivals group into prompt passes moves it by several percent)
            "sixteen_streams_long": dict(requests=96, prompt_len=512, output_len=128, concurrency=16, seed=21)}
    for seed, rate in enumerate((1.0, 4.0, 16.0), start=12):
        runs[f"rate_{rate:g}"] = dict(requests=48, prompt_len=512, output_len=128, rate=rate, seed=seed)
    runs["prefix_0"] = dict(requests=16, prompt_len=512, output_len=32, concurrency=1, seed=1)
    runs["prefix_384"] = dict(requests=16, prompt_len=128, prefix_len=384, output_len=32, concurrency=1, seed=2)
    if args.runs:
        runs = {name: kw for name, kw in runs.items() if name in args.runs.split(",")}
    if args.quick:
        runs = {name: dict(kw, requests=3, output_len=8) for name, kw in list(runs.items())[:3]}
    if runs:           # "--runs none": only the memory cap's run below
        report["engine_batch1"] = engine_tpot(args.model)
        print("engine batch 1", report["engine_batch1"], flush=True)
        save()
        port = free_port()
        proc = start_server(args.model, port, ["--max-batch", "16", "--max-model-len", "2048"] + paged)
        url = f"http://127.0.0.1:{port}"
        try:
            for name, kw in runs.items():
                before = scrape(url)
                report[name] = slim(asyncio.run(run_benchmark(url, progress=False, **kw)))
                r, after = report[name], scrape(url)
                r["prefix_cache_hit_tokens"] = after["hits"] - before["hits"]
                # the server's mean TTFT over the run (submit -> first token out of the scheduler): the
                # client's TTFT less this is the HTTP side (parse, SSE out, the hand-off between threads)
                (s1, n1), (s0, n0) = after["ttft"], before["ttft"]
                r["server_ttft_mean_s"] = (s1 - s0) / max(1.0, n1 - n0)
                # the run's prompt passes by how they ran: [count, seconds in all]
                was = before["passes"]
                r["prompt_passes"] = {k: [n - was.get(k, [0, 0])[0], round(t - was.get(k, [0, 0])[1], 4)]
                                      for k, (n, t) in after["passes"].items() if n > was.get(k, [0, 0])[0]}
                print(name, f"{r['output_throughput']:.1f} tok/s, TPOT median {r['tpot_s']['median']}, "
                      f"TTFT p50/p99 {r['ttft_s']['median']}/{r['ttft_s']['p99']}, failed {r['failed']}, "
                      f"prefix hits {r['prefix_cache_hit_tokens']:g}, server TTFT mean {r['server_ttft_mean_s']:.4f}, "
                      f"passes {r['prompt_passes']}",
                      flush=True)
                save()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if args.memory_gib:
        import torch

        fraction = args.memory_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
        port = free_port()
        # no --max-batch: the server opens as many slots as the capped memory holds (at most 64)
        proc = start_server(args.model, port, ["--max-model-len", "1280", "--gpu-memory-fraction", f"{fraction:.4f}"]
                            + paged)
        try:
            r = slim(asyncio.run(run_benchmark(f"http://127.0.0.1:{port}", requests=64, prompt_len=1024,
                                               output_len=256, concurrency=64, progress=False)))
            metrics = __import__("httpx").get(f"http://127.0.0.1:{port}/metrics").text
            peak = [line for line in metrics.splitlines() if line.startswith("fastqwen:num_requests_running_peak")]
            report["memory_cap"] = {"gib": args.memory_gib, "fraction": fraction, "run": r, "running_peak": peak,
                                    "metrics_tail": metrics[-3000:]}
            print("memory cap", args.memory_gib, "GiB:", r["completed"], "of 64 completed; peak", peak, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        save()


if __name__ == "__main__":
    main()
