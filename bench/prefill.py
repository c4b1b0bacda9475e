"""Where a decode step and a prefill spend their device time, kernel by kernel (torch.profiler).

Per shape BxP: one generate() of 4 tokens first (tuning, compiles, captures), then under the
profiler --steps eager decode steps (the graph's kernels, launched one by one), with --verify W,...
a speculative verify of each W drafts (fq_decode.verify_picks over W + 1 rows a sequence: the
model's rows and the engine's picks, one sequence's through the LM screen; --steps times: phase
"verify_W"), and one prompt pass. --one-row: where one sequence's products run (bench spec's).
Device time is summed per kernel name: a row per kernel (the --top largest of each phase) with
microseconds and calls per pass, and a row "(all kernels)" per phase. The graphed step's own time
(the `step` entry) less the decode step's sum is what launch gaps cost.

Without a GPU the profiler records CPU operators (self time, grouped by name) in place of kernels.
"""
from __future__ import annotations

from collections import defaultdict

from bench.runner import (Column, add_engine_arguments, add_model_argument, build_engine, engine_options,
                          engine_on_path, gpu_visible, int_list, positive_int, resolve_model, shape_list)
from bench.spec import add_one_row_argument, eager_decode, set_one_row

COLUMNS = [Column("shape", width=9, left=True), Column("phase", width=11, left=True), Column("us", fmt="{:.1f}"),
           Column("share", fmt="{:.3f}", width=6), Column("calls", width=5), Column("kernel", width=70, left=True)]


def add_arguments(parser) -> None:
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--shapes", type=shape_list(2, "BATCHxPROMPT"), default=[(1, 512), (4, 2048), (16, 512)],
                        help="batch x prompt tokens (default 1x512,4x2048,16x512)")
    parser.add_argument("--steps", type=positive_int, default=10, help="profiled decode steps (default 10)")
    parser.add_argument("--top", type=positive_int, default=40, help="kernels kept per phase (default 40)")
    parser.add_argument("--verify", type=int_list, default=[],
                        help="drafts of each speculative verify profiled, e.g. 3,4 (default: none)")
    add_one_row_argument(parser)


def device_us(ev) -> float:
    us = getattr(ev, "device_time", None)     # torch >= 2.6; cuda_time before
    return ev.cuda_time if us is None else us


def kernel_times(prof, passes: int, gpu: bool) -> list[tuple[str, float, int]]:
    """(name, microseconds a pass, calls a pass) per kernel (CPU: operator, self time), largest first."""
    import torch

    per: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if gpu:
            if ev.device_type != torch.autograd.DeviceType.CUDA or getattr(ev, "is_user_annotation", False):
                continue
            us = device_us(ev)
        else:
            if ev.device_type != torch.autograd.DeviceType.CPU:
                continue
            us = ev.self_cpu_time_total
        per[ev.name][0] += us / passes
        per[ev.name][1] += 1
    return sorted(((name, us, n // passes) for name, (us, n) in per.items()), key=lambda r: -r[1])


def run(args, report) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model_dir = resolve_model(args.model)
    eng = build_engine(model_dir, engine_options(args))
    set_one_row(eng, args.one_row)
    engine_on_path()
    from fq_decode import verify_picks

    model = eng.model
    gpu = gpu_visible()
    activity = ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU
    report.note(f"# {model_dir}: {eng.describe()}")
    for batch, prompt in args.shapes:
        prompts = torch.randint(0, eng.cfg.vocab_size, (batch, prompt),
                                generator=torch.Generator().manual_seed(prompt)).tolist()
        for _ in eng.generate(prompts, 4):
            pass
        ids = torch.tensor(prompts, device=eng.device)
        with torch.inference_mode():
            # the cache for every profiled step and verify
            runner = eager_decode(eng, ids, args.steps + 2 + max(args.verify, default=0))
            with profile(activities=[activity]) as prof:
                for _ in range(args.steps):
                    runner.step()
                if gpu:
                    torch.cuda.synchronize()
            decode = kernel_times(prof, args.steps, gpu)
            phases = [("decode_step", decode)]
            at = torch.full((batch,), prompt + args.steps + 1, dtype=torch.int32, device=eng.device)
            for width in args.verify:
                tokens = torch.randint(0, eng.cfg.vocab_size, (batch, width + 1), device=eng.device)
                verify_picks(model, tokens, at)                 # its first-call work
                if gpu:
                    torch.cuda.synchronize()
                with profile(activities=[activity]) as prof:
                    for _ in range(args.steps):
                        verify_picks(model, tokens, at)
                    if gpu:
                        torch.cuda.synchronize()
                phases.append((f"verify_{width}", kernel_times(prof, args.steps, gpu)))
            with profile(activities=[activity]) as prof:
                model.prefill(ids)
                if gpu:
                    torch.cuda.synchronize()
            phases.append(("prefill", kernel_times(prof, 1, gpu)))
        for phase, rows in phases:
            total = sum(us for _, us, _ in rows)
            shape = f"{batch}x{prompt}"
            report.add({"shape": shape, "batch": batch, "prompt": prompt, "phase": phase, "kernel": "(all kernels)",
                        "us": total, "share": 1.0, "calls": sum(n for _, _, n in rows),
                        "source": "cuda kernels" if gpu else "cpu operators (self time)"})
            for name, us, calls in rows[: args.top]:
                report.add({"shape": shape, "batch": batch, "prompt": prompt, "phase": phase, "kernel": name[:200],
                            "us": us, "share": us / total if total else None, "calls": calls})
