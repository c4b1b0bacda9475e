"""`fastqwen bench-serve`: a load generator for an OpenAI-compatible server, measured as vLLM's
serving benchmark measures (its names and definitions).

Requests go to /v1/completions with `stream`, random token-id prompts of --prompt-len tokens
(exact lengths, no tokenizer involved; ids below the vocabulary size /v1/models reports), after
a --prefix-len token prefix common to every request (vLLM's --random-prefix-len: what a shared
system prompt looks like to a prefix cache), and --output-len tokens each (`ignore_eos`), sent at
--rate requests a second (Poisson arrivals; inf sends them all at once), at most
--concurrency in flight. Per request: TTFT (send to the first token), TPOT ((last - first
token) / (tokens - 1)), ITL (the gaps between streamed tokens, a chunk of k tokens counting
k gaps of its gap / k). Reported: mean, median, p99 of each, request and token throughput,
failures; a JSON file and, with matplotlib, a chart of the three distributions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import random
import statistics
import sys
import time

from fastqwen.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--rate", type=float, default=math.inf, help="requests a second, Poisson (default inf: "
                        "all at once)")
    parser.add_argument("--requests", type=int, default=100, help="requests to send (default 100)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens a request (default 512)")
    parser.add_argument("--prefix-len", type=int, default=0, help="tokens of a prefix common to every prompt, "
                        "before its --prompt-len random ones (default 0)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens a request (default 128)")
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    parser.add_argument("--out", default="bench_serve.json", help="JSON report (default bench_serve.json)")
    parser.add_argument("--chart", default=None, help="PNG chart of TTFT, TPOT and ITL (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _percentiles(values: list) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


async def _one(client, url: str, body: dict) -> dict:
    """One streamed request: send time, each chunk's arrival and token count, or the error."""
    start = time.perf_counter()
    arrivals, tokens, error = [], 0, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        error = payload["error"].get("message", "error")
                        break
                    n = sum(len(c.get("token_ids") or []) for c in payload.get("choices", []))
                    if n:
                        arrivals.append((time.perf_counter(), n))
                        tokens += n
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
        error = f"{type(exc).__name__}: {exc}"
    return {"start": start, "arrivals": arrivals, "tokens": tokens, "error": error}


def _request_metrics(r: dict) -> dict:
    first = r["arrivals"][0][0]
    last = r["arrivals"][-1][0]
    itl, prev = [], first
    for t, n in r["arrivals"][1:]:
        itl += [(t - prev) / n] * n
        prev = t
    return {"ttft": first - r["start"], "tpot": (last - first) / (r["tokens"] - 1) if r["tokens"] > 1 else None,
            "itl": itl, "e2e": last - r["start"], "tokens": r["tokens"]}


async def run_benchmark(url: str, requests: int, prompt_len: int, output_len: int, rate: float = math.inf,
                        concurrency: int | None = None, model: str | None = None, seed: int = 0,
                        progress: bool = True, prefix_len: int = 0) -> dict:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30)) as client:
        models = (await client.get(url + "/v1/models")).json()["data"]
        model = model or models[0]["id"]
        vocab = next((m.get("vocab_size") for m in models if m["id"] == model), None) or 1000
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        prompts = [prefix + [rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
        gaps = [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(requests)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=requests, desc="bench-serve", unit="req")
        cap = asyncio.Semaphore(concurrency or requests)

        async def send(i):
            async with cap:
                body = {"model": model, "prompt": prompts[i], "max_tokens": output_len, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                result = await _one(client, url, body)
            if bar is not None:
                bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for i in range(requests):
            tasks.append(asyncio.create_task(send(i)))
            if gaps[i]:
                await asyncio.sleep(gaps[i])
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    ok = [r for r in results if r["error"] is None and r["tokens"]]
    per = [_request_metrics(r) for r in ok]
    out_tokens = sum(p["tokens"] for p in per)
    return {
        "url": url, "model": model, "requests": requests, "prompt_len": prompt_len, "prefix_len": prefix_len,
        "output_len": output_len,
        "rate": None if math.isinf(rate) else rate, "concurrency": concurrency, "seed": seed,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + (prefix_len + prompt_len) * len(ok)) / duration,
        "ttft_s": _percentiles([p["ttft"] for p in per]),
        "tpot_s": _percentiles([p["tpot"] for p in per if p["tpot"] is not None]),
        "itl_s": _percentiles([g for p in per for g in p["itl"]]),
        "e2e_s": _percentiles([p["e2e"] for p in per]),
        "samples": {"ttft": [p["ttft"] for p in per], "tpot": [p["tpot"] for p in per if p["tpot"] is not None],
                    "itl": [g for p in per for g in p["itl"]]},
    }


def _chart(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, values) in zip(axes, (("TTFT", report["samples"]["ttft"]), ("TPOT", report["samples"]["tpot"]),
                                         ("ITL", report["samples"]["itl"]))):
        if values:
            ms = sorted(v * 1e3 for v in values)
            ax.plot(ms, [(k + 1) / len(ms) for k in range(len(ms))])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    rate = "inf" if report["rate"] is None else f"{report['rate']:g}"
    prefix = f"{report['prefix_len']} shared + " if report.get("prefix_len") else ""
    fig.suptitle(f"{report['model']}: {report['completed']} requests of {prefix}{report['prompt_len']} + "
                 f"{report['output_len']} tokens at rate {rate}/s, {report['output_throughput']:.0f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print(report: dict) -> None:
    def ms(d):
        return " / ".join("-" if d[k] is None else f"{d[k] * 1e3:.2f}" for k in ("mean", "median", "p99"))

    print(f"completed {report['completed']} / {report['requests']} in {report['duration_s']:.2f} s "
          f"({report['failed']} failed)")
    print(f"request throughput  {report['request_throughput']:.2f} req/s")
    print(f"output throughput   {report['output_throughput']:.1f} tok/s (total {report['total_token_throughput']:.1f})")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        print(f"{key[:-2].upper():5s} ms mean / median / p99: {ms(report[key])}")
    for err in report["errors"]:
        print(f"error: {err}")


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "prompt_len", "output_len"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.rate > 0:
        raise UserError(f"--rate must be > 0 (inf: all at once), got {args.rate}")
    if args.prefix_len < 0:
        raise UserError(f"--prefix-len must be >= 0, got {args.prefix_len}")
    if args.concurrency is not None and args.concurrency < 1:
        raise UserError(f"--concurrency must be >= 1, got {args.concurrency}")
    report = asyncio.run(run_benchmark(args.url.rstrip("/"), args.requests, args.prompt_len, args.output_len,
                                       args.rate, args.concurrency, args.model, args.seed, not args.no_progress,
                                       args.prefix_len))
    _print(report)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"report: {args.out}", file=sys.stderr)
    if args.chart:
        try:
            _chart(report, args.chart)
            print(f"chart: {args.chart}", file=sys.stderr)
        except ImportError:
            print("chart skipped: matplotlib is not installed", file=sys.stderr)
    return 0 if report["completed"] else 1
