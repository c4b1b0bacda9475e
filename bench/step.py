"""The decode step per batch size on a checkpoint, as generate() runs it.

The engine is built through its constructor with the engine options given (left out: its
defaults); --no-lm-screen sets the built engine's `model.screen = None` before anything is captured
(the one-sequence LM head then runs as the GEMV and the argmax kernels): an A/B arm is a bench
argument, never an engine switch. Per batch: the engine's own decode runner for that batch (its
CUDA graph when graphs are on), and per round a prompt pass over the same random prompts, --warmup
steps, then --steps steps back to back between two CUDA events: microseconds a step (median over
rounds), and the weights' bytes over that time. The greedy tokens of 4 more steps after the last
round, hashed: two arms that agree give the same `tokens` value.
"""
from __future__ import annotations

from bench.runner import (Column, add_engine_arguments, add_model_argument, build_engine, digest, engine_options,
                          gpu_visible, int_list, positive_int, resolve_model, weight_bytes)

COLUMNS = [Column("batch", width=5), Column("prompt", width=6), Column("steps", width=5),
           Column("step_us", "step us", fmt="{:.1f}"), Column("step_us_min", "min us", fmt="{:.1f}"),
           Column("weights_gbps", "weights GB/s", fmt="{:.0f}", width=12), Column("graph", width=5),
           Column("lm_screen", "screen", width=6), Column("tokens", width=12, left=True)]


def add_arguments(parser) -> None:
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--no-lm-screen", action="store_true",
                        help="the built engine's model.screen = None before its first step (the A/B arm)")
    parser.add_argument("--batches", type=int_list, default=[1, 4, 16], help="default 1,4,16")
    parser.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--steps", type=positive_int, default=64, help="timed steps a round (default 64)")
    parser.add_argument("--warmup", type=positive_int, default=3, help="steps before the timed ones (default 3)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="prompt passes, each timed (default 3)")


def run(args, report) -> None:
    import torch

    model_dir = resolve_model(args.model)
    eng = build_engine(model_dir, engine_options(args))
    model = eng.model
    if args.no_lm_screen:
        model.screen = None
    describe = eng.describe()
    report.note(f"# {model_dir}: {describe}")
    gpu = gpu_visible()
    wbytes = weight_bytes(model)
    for batch in args.batches:
        ids = torch.randint(0, eng.cfg.vocab_size, (batch, args.prompt),
                            generator=torch.Generator().manual_seed(batch)).to(eng.device)
        with torch.inference_mode():
            runner = eng._prepare(batch, args.prompt + args.warmup + args.steps + 4)
        times = []
        for _ in range(args.rounds):
            with torch.inference_mode():
                runner.start(model.prefill(ids), args.prompt)
                for _ in range(args.warmup):
                    runner.step()
                times.append(_timed_steps(torch, runner, args.steps, gpu))
        tokens = []
        with torch.inference_mode():
            for _ in range(4):
                runner.step()
                tokens.append(runner.tokens.tolist())
        step_us = sorted(times)[len(times) // 2]
        report.add({"batch": batch, "prompt": args.prompt, "steps": args.steps, "rounds": args.rounds,
                    "step_us": step_us, "step_us_min": min(times), "step_us_rounds": times,
                    "weights_bytes": wbytes, "weights_gbps": wbytes / step_us / 1e3,
                    "graph": runner.graph is not None if hasattr(runner, "graph") else None,
                    "lm_screen": model.screen is not None and batch == 1, "tokens": digest(tokens),
                    "engine": describe})


def _timed_steps(torch, runner, steps: int, gpu: bool) -> float:
    """Microseconds a step over `steps` steps queued back to back (CUDA events; wall-clock on the CPU)."""
    import time

    if not gpu:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step()
        return (time.perf_counter() - t0) * 1e6 / steps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / steps
