"""`fastqwen serve`: the OpenAI-compatible server (fastqwen/serve/app.py) on a checkpoint."""
from __future__ import annotations

import argparse
import pathlib

from fastqwen.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (config.json, safetensors, tokenizer.json; "
                        "default: the judge's tiny synthetic checkpoint, created once in a cache)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="requests running at once (slots; default: as many as the memory left beside the "
                        "weights holds, at most 64, under --gpu-memory-fraction; 16 on the CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="tokens a request may hold, prompt and output (default: 4096, or the model's limit)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=None,
                        help="the share of the GPU's memory this process may take, in (0, 1]")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                        "folder's name)")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429 (default 256)")
    parser.add_argument("--block-size", type=int, default=0,
                        help="a paged KV cache of blocks of this many positions (a multiple of 64 that divides "
                        "--max-model-len): each request holds blocks for its prompt and max_tokens only, so more "
                        "short requests fit; 0 (default): one row of --max-model-len positions per slot")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="at most this many prompt tokens prefilled between two decode steps while others "
                        "run: a longer prompt goes in chunks of it, shorter ones together as many as fit, so "
                        "running streams keep their inter-token latency; 0 (default): whole prompts")
    parser.add_argument("--no-prefix-sharing", action="store_true",
                        help="with --block-size: do not share the pages of prompts that start alike (shared by "
                        "default where the model allows: Qwen3; Qwen3.5 with a block size that is a multiple of 64)")
    parser.add_argument("--state-snapshots", type=int, default=None,
                        help="Qwen3.5 with --block-size a multiple of 64: how many snapshots of the GDN layers' "
                        "states to keep for shared prefixes (each one sequence's states, ~52 MB on the 4B; "
                        "default 8; 0: Qwen3.5 prompts share nothing)")
    parser.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                        help="the largest request body taken, in bytes (default 8 MiB); a larger one is answered "
                        "413 before it is read")
    parser.add_argument("--speculation", default=None, choices=["off", "ngram", "auto"],
                        help="exact speculative decoding of greedy requests: prompt lookup on every step where all "
                        "running requests can take it (ngram), or where its measured acceptance pays, with the number of drafts "
                        "that pays best (auto); "
                        "the same tokens as off (default: FASTQWEN_SPECULATION, else off)")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="tokens drafted per verify, 1-16 (default 4)")
    parser.add_argument("--no-precompile", action="store_true",
                        help="do not compile the start's Triton kernels in parallel beside the weight load (on a "
                        "GPU, by default: an empty Triton cache otherwise compiles them one after another)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM or SIGINT: seconds the requests in flight may run on while new ones get "
                        "503; those still running then end with an error and their usage so far (default 30)")


def default_model() -> pathlib.Path:
    """The judge's tiny checkpoint (fastqwen/judge/cli.py default_model), with the tokenizer synth
    writes (re)written when the cached copy predates it or flags the tool-call tags special
    (Qwen's are not: the server's tool-call parser reads them in the decoded text)."""
    import json

    from fastqwen import tokenizer
    from fastqwen.judge.cli import default_model as judge_default

    folder = judge_default()
    path = folder / "tokenizer.json"
    stale = not path.is_file() or any(t.get("special") for t in json.loads(path.read_text()).get("added_tokens", [])
                                      if t.get("content") in tokenizer.NOT_SPECIAL)
    if stale:        # written beside it, then moved in: a reader never sees half a file
        import os
        import shutil
        import tempfile

        staging = pathlib.Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=folder.parent))
        try:
            tokenizer.write_for_config(staging, json.loads((folder / "config.json").read_text()))
            for name in ("tokenizer.json", "tokenizer_config.json"):
                os.replace(staging / name, folder / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def run(args: argparse.Namespace) -> int:
    folder = pathlib.Path(args.model) if args.model else default_model()
    if not (folder / "config.json").is_file():
        raise UserError(f"{str(folder)!r} has no config.json: --model takes a checkpoint folder")
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{str(folder)!r} has no tokenizer.json (fastqwen synth writes one)")
    for name, value, lo in (("--max-batch", args.max_batch, 1), ("--port", args.port, 0),
                            ("--max-waiting", args.max_waiting, 1), ("--block-size", args.block_size, 0),
                            ("--prefill-chunk", args.prefill_chunk, 0), ("--state-snapshots", args.state_snapshots, 0),
                            ("--max-request-bytes", args.max_request_bytes, 1),
                            ("--drain-timeout", args.drain_timeout, 0)):
        if value is not None and value < lo:
            raise UserError(f"{name} must be >= {lo}, got {value}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UserError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.gpu_memory_fraction is not None and not 0 < args.gpu_memory_fraction <= 1:
        raise UserError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    from fastqwen.serve.app import serve

    try:
        serve(str(folder), args.host, args.port, args.max_batch, args.max_model_len, args.gpu_memory_fraction,
              args.served_model_name, args.max_waiting, args.block_size or None, args.prefill_chunk or None,
              not args.no_prefix_sharing, args.state_snapshots, max_request_bytes=args.max_request_bytes,
              drain_timeout=args.drain_timeout, speculation=args.speculation,
              speculative_tokens=args.speculative_tokens, precompile=not args.no_precompile)
    except ValueError as exc:       # a size that cannot fit (the slots' KV rows, the engine's limits)
        raise UserError(str(exc)) from None
    return 0
