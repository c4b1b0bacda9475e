"""The screened LM head (engine/fqkernels/lm_screen.py) against the GEMV and the argmax kernels.

On the model's own decode states (the final norm's output of eager decode steps after --prompts
random prompts, each step fed the full argmax's token): the screen's pick against argmax(GEMV) at
every state (they must be equal) and the candidates' count a state; then the LM head's tail as the
step runs it, GEMV + argmax against the screen under its default plan and each of --plans, each one
CUDA graph of a call per state (runner.time_graph), microseconds a call, with the picks of each
plan checked again. The decode step's time with and without the screen is the `step` entry run
twice (with and without --no-lm-screen).

Without a GPU the screen is screened_argmax_reference over the int8 copy (quantize_rows) and the
full pick argmax(gemv.linear_reference); no plans.
"""
from __future__ import annotations

from bench.runner import (BenchError, Column, add_engine_arguments, add_model_argument, build_engine,
                          engine_options, engine_on_path, gpu_visible, lm_head, positive_int, resolve_model,
                          time_graph)

DEFAULT_PLANS = ("rows=16,block_k=512,groups=4;rows=16,block_k=512,groups=8;rows=16,block_k=512,groups=32;"
                 "rows=32,block_k=256;rows=8,block_k=256,stages=1;rows=32,block_k=512,warps=8")

COLUMNS = [Column("arm", width=22, left=True), Column("plan", width=36, left=True), Column("us", fmt="{:.1f}"),
           Column("vs_gemv", "x GEMV", fmt="{:.3f}", width=7), Column("states", width=6),
           Column("mismatches", width=10), Column("cand_median", "cand p50", width=8),
           Column("cand_max", "cand max", width=8), Column("error", width=30, left=True)]


def add_arguments(parser) -> None:
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--steps", type=positive_int, default=32, help="decode states a prompt (default 32)")
    parser.add_argument("--prompts", type=positive_int, default=3, help="random prompts (default 3)")
    parser.add_argument("--plans", default=DEFAULT_PLANS,
                        help="';'-separated ScreenPlan texts timed besides the default (empty: none)")
    parser.add_argument("--reps", type=positive_int, default=7, help="timed graph replays (default 7)")


def decode_states(eng, pick, prompt: int, steps: int, prompts: int) -> list:
    """The final norm's outputs [1, K] of eager decode steps, each fed pick(state): the full argmax."""
    import torch

    model = eng.model
    states = []
    with torch.inference_mode():
        eng._prepare(1, prompt + steps)                     # the cache (and tuning) for one sequence
        for p in range(prompts):
            ids = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(p))
            tok = model.prefill(ids.to(eng.device))
            pos = torch.full((1,), prompt, dtype=torch.int32, device=eng.device)
            for _ in range(steps):
                h = model._decode_hidden(tok, pos, pos + 1)
                states.append(h.clone())
                tok = pick(h)
                pos += 1
    return states


def _counts(counts: list[int]) -> dict:
    counts = sorted(counts)
    return {"cand_min": counts[0], "cand_median": counts[len(counts) // 2],
            "cand_p90": counts[int(0.9 * (len(counts) - 1))], "cand_max": counts[-1]}


def run(args, report) -> None:
    import torch

    model_dir = resolve_model(args.model)
    eng = build_engine(model_dir, engine_options(args))
    engine_on_path()
    from fqkernels import gemv, lm_screen

    model = eng.model
    gpu = gpu_visible()
    w = lm_head(model)
    report.note(f"# {model_dir}: {eng.describe()}; LM head {tuple(w.shape)}")
    if gpu and model.screen is None:
        why = lm_screen.unsupported(w) or "this engine's op set has none (the torch op set screens nothing)"
        raise BenchError(f"no screen on this model: {why}")
    if gpu:
        from fqkernels import argmax as am

        screen = model.screen

        def full(x):
            return am.argmax(gemv.linear(x, w))

        def pick_and_count(s, x):
            return int(s.argmax(x)[0]), s.candidates_for(x)
    else:
        q, s = lm_screen.quantize_rows(w)
        screen = None

        def full(x):
            return torch.argmax(gemv.linear_reference(x, w), dim=-1)

        def pick_and_count(_, x):
            pick, count = lm_screen.screened_argmax_reference(x, w, q, s)
            return int(pick[0]), count

    xs = decode_states(eng, full, args.prompt, args.steps, args.prompts)

    def picks(s, states) -> dict:
        bad, counts = [], []
        for i, x in enumerate(states):
            got, count = pick_and_count(s, x)
            want = int(full(x)[0])
            counts.append(count)
            if got != want:
                bad.append([i, got, want])
        return {"states": len(states), "mismatches": len(bad), "mismatch_examples": bad[:10], **_counts(counts)}

    gemv_us = time_graph(full, xs, args.reps)
    report.add({"arm": "gemv+argmax", "plan": None, "us": gemv_us, "vs_gemv": 1.0})
    if gpu:
        default = str(screen.plan)
        up, tau = torch.empty_like(screen.up), torch.full_like(screen.tau, float("-inf"))
        approx_us = time_graph(lambda x: screen.approx(x, up, tau), xs, args.reps)
        report.add({"arm": "int8 pass alone", "plan": default, "us": approx_us, "vs_gemv": approx_us / gemv_us})
        arms = [("screen", default, screen)]
        for text in filter(None, (p.strip() for p in args.plans.split(";"))):
            try:
                arms.append(("screen", text, screen.with_plan(lm_screen.ScreenPlan.from_text(text))))
            except Exception as exc:   # noqa: BLE001 - a plan that cannot be made is a result
                report.add({"arm": "screen", "plan": text, "error": f"{type(exc).__name__}: {exc}"[:300]})
        for arm, text, s in arms:
            row = {"arm": arm, "plan": text}
            try:
                row.update(picks(s, xs if s is screen else xs[:24]))
                row["us"] = time_graph(lambda x, s=s: s.argmax(x), xs, args.reps)
                row["vs_gemv"] = row["us"] / gemv_us
            except Exception as exc:   # noqa: BLE001 - a plan that does not compile or launch is a result
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
            report.add(row)
    else:
        row = {"arm": "screen reference", "plan": None, **picks(None, xs)}
        row["us"] = time_graph(lambda x: lm_screen.screened_argmax_reference(x, w, q, s), xs, args.reps)
        row["vs_gemv"] = row["us"] / gemv_us
        report.add(row)
