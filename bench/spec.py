"""Speculative decoding against plain decode on one engine, per batch: the oracle's speed curve
(drafts from a recorded plain run, each right with probability a) and the model-free drafters.

Shapes: --shapes BxPxO,... (each its own prompt and output), or --batches with one --prompt and
--steps. One engine is built with the engine options given (and Qwen3.5's MTP head where an arm is "mtp" or
a --speculative-token-map gives the head a draft vocabulary);
its speculation is switched per arm by Engine.set_speculation (the same weights, caches and tuning,
so the arms' tokens are comparable bit for bit). Per shape: random
prompts, a plain generate() (warmup, then --reps timed: the
median: the plain row), then per arm one untimed call (the oracle records its plain run there; every
arm compiles and tunes) and --reps timed pairs, a plain call then the arm's (switching back keeps the
arm's graphs), so a drift of the GPU's clock over the run moves both sides of the ratio: output
tokens/s, its ratio to its pairs' plain calls (medians; plain_tok_s), acceptance, tokens per
verify, the device's mean milliseconds a draft and a verify over the timed call (CUDA events), the
plain steps "auto" took and its verifies of each width, and whether the arm's tokens equal plain's.

--one-row sets which kernel one sequence's products run on (default "family": the model family's
choice, the engine's ops.one_row_tensor_cores: Qwen3 on the tensor cores; Qwen3.5 on them where the
engine is built to verify every step, here with an "mtp" arm, else fma): "dot" every
product on the tensor cores, "fma" none, or the names of those on the tensor cores (the
decode_products names, e.g. "self_attn.qkv_proj,mlp.gate_up"; products of one weight shape move
together). On the tensor cores a verify's rows
fit the plain step's 16-row tile (about one step, its bits); fma is the faster plain step with a
verify's rows in narrower shared tiles. Plain decode and every arm of the process run that way, so
compare two processes' rows against one baseline (the docs' trade).

--profile N: after an arm's timed calls, N more cycles of its steps (a draft and a verify of k)
launched eagerly under torch.profiler, with no room left to emit (the state stays as the call left
it), each kernel's device time put in the innermost part of the cycle it ran in: "draft"
(the drafter's own ops), "draft.head" (the MTP head's chained drafts), "verify" (the rows, the
acceptance, the tokens kept), "verify.target" (the model's rows up to the final norm),
"verify.screen" (one sequence's picks through the LM screen) or "verify.lm_head" (the LM head's
logits elsewhere), "verify.rollback" (the model's commit of the kept rows) and "verify.drafter"
(the drafter's update: the MTP head's pass over the verified rows). The arm's row gets "profile":
each part's microseconds and calls (kernel launches; CPU: operators) a cycle and its largest
kernels; the graphs' own device time a cycle (the timed call's draft_ms + verify_ms) less the
kernels' sum is what the graphs' launch gaps cost (less where PDL overlaps a kernel with the
last; eager kernels run without it).
The plain row gets the same for N eager decode steps of the same build (part "step", after every
arm of its shape): a verify's rows read against one row's kernels.
Without a GPU each part holds its CPU operators' self time.
"""
from __future__ import annotations

import statistics
import time

from bench.runner import (Column, add_engine_arguments, add_model_argument, build_engine, engine_on_path,
                          engine_options, gpu_visible, int_list, positive_int, resolve_model, shape_list)

COLUMNS = [Column("batch", width=5), Column("prompt", width=6), Column("steps", width=5),
           Column("arm", width=12, left=True), Column("k", width=3),
           Column("tok_s", "tok/s", fmt="{:.1f}"), Column("vs_plain", "x plain", fmt="{:.3f}"),
           Column("acceptance", "accept", fmt="{:.2f}"), Column("tokens_per_verify", "tok/verify", fmt="{:.2f}"),
           Column("draft_ms", "draft ms", fmt="{:.3f}"), Column("verify_ms", "verify ms", fmt="{:.2f}"),
           Column("plain_steps", "plain", width=5), Column("widths", "verifies by width", width=17, left=True),
           Column("same_tokens", "same", width=5)]


def add_arguments(parser) -> None:
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--batches", type=int_list, default=[1, 4, 16], help="default 1,4,16")
    parser.add_argument("--shapes", type=shape_list(3, "BATCHxPROMPTxSTEPS"), default=None,
                        help="batch x prompt x tokens per shape, e.g. 1x1024x256,4x2048x128 (overrides --batches, "
                             "--prompt and --steps)")
    parser.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--steps", type=positive_int, default=128, help="tokens generated a call (default 128)")
    parser.add_argument("--k", type=int_list, default=[4],
                        help="drafts a verify, each arm at each (default 4; e.g. 3,4: at one sequence a verify of 3 "
                             "fills the one-row GEMV's 4-row tile)")
    parser.add_argument("--arms", default="oracle:0,oracle:0.5,oracle:0.7,oracle:0.8,oracle:0.9,oracle:1,ngram,recycle,auto",
                        help="speculation values, comma-separated (default: the oracle at 0-1, ngram, recycle, auto)")
    parser.add_argument("--reps", type=positive_int, default=3, help="timed calls an arm (default 3)")
    parser.add_argument("--profile", type=positive_int, default=None, metavar="CYCLES",
                        help="profile this many eager cycles of each speculating arm after its timed calls "
                             "(the module note; default: none)")
    parser.add_argument("--top", type=positive_int, default=12, help="kernels kept per profiled part (default 12)")
    add_one_row_argument(parser)


def add_one_row_argument(parser) -> None:
    """--one-row (this entry's and bench prefill's): where one sequence's products run (set_one_row)."""
    parser.add_argument("--one-row", default="family",
                        help="one sequence's products: family (the model family's choice, default), fma, dot (the "
                             "tensor cores), or the comma-separated names of the products on the tensor cores")


def set_one_row(eng, choice: str) -> None:
    """--one-row on a built engine, before its first call (its tuning and graphs follow the choice)."""
    if choice != "family":
        eng.model.ops.one_row_tensor_cores = one_row_shapes(eng.model.decode_products(), choice)


def one_row_shapes(products, choice: str) -> frozenset:
    """The weight shapes --one-row puts on the tensor cores: "dot" every product's, "fma" none, or
    those of the named products (a name not among them is an error that lists them)."""
    if choice in ("dot", "fma"):
        return frozenset(tuple(p.weights[0].shape) for p in products) if choice == "dot" else frozenset()
    by_name = {p.name: tuple(p.weights[0].shape) for p in products}
    names = [n.strip() for n in choice.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise ValueError(f"--one-row: {', '.join(unknown) or repr(choice)} is not family, fma, dot or products "
                         f"among {', '.join(by_name)}")
    return frozenset(by_name[n] for n in names)


def _timed(eng, prompts, steps, reps, sync):
    times, tokens = [], None
    for _ in range(reps):
        seconds, tokens = _call(eng, prompts, steps, sync)
        times.append(seconds)
    return statistics.median(times), tokens


def _call(eng, prompts, steps, sync):
    sync()
    t0 = time.perf_counter()
    tokens = list(eng.generate(prompts, steps))
    sync()
    return time.perf_counter() - t0, tokens


def _paired(eng, arm, k, prompts, steps, reps, sync):
    """reps pairs, a plain call then the arm's: (plain's median seconds, the arm's, its tokens)."""
    plain, timed, tokens = [], [], None
    for _ in range(reps):
        eng.set_speculation("off")
        plain.append(_call(eng, prompts, steps, sync)[0])
        eng.set_speculation(arm, k)
        seconds, tokens = _call(eng, prompts, steps, sync)
        timed.append(seconds)
    return statistics.median(plain), statistics.median(timed), tokens


def run(args, report) -> None:
    import torch

    model_dir = resolve_model(args.model)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    options = engine_options(args)
    if "mtp" in arms or options.get("speculative_token_map"):   # the MTP head loads only when built with it
        options["speculation"] = "mtp"
    eng = build_engine(model_dir, options)
    set_one_row(eng, args.one_row)
    for arm in arms:                  # a bad arm or k fails before any work
        for k in args.k:
            eng.set_speculation(arm, k)
    eng.set_speculation("off")
    report.note(f"# {model_dir}: {eng.describe()}")
    sync = torch.cuda.synchronize if gpu_visible() else (lambda: None)
    shapes = args.shapes or [(b, args.prompt, args.steps) for b in args.batches]
    for batch, prompt, steps in shapes:
        prompts = torch.randint(0, eng.cfg.vocab_size, (batch, prompt),
                                generator=torch.Generator().manual_seed(batch * 7919 + prompt)).tolist()
        eng.set_speculation("off")
        list(eng.generate(prompts, steps))
        plain_s, plain_tokens = _timed(eng, prompts, steps, args.reps, sync)
        shape = {"batch": batch, "prompt": prompt, "steps": steps}
        plain_row = report.add({**shape, "arm": "plain", "k": 0, "tok_s": batch * steps / plain_s, "vs_plain": 1.0,
                                "same_tokens": True})
        for arm, k in ((arm, k) for arm in arms for k in args.k):
            eng.set_speculation(arm, k)
            list(eng.generate(prompts, steps))             # the oracle records here; compiles, tunes
            paired_s, seconds, tokens = _paired(eng, arm, k, prompts, steps, args.reps, sync)
            st = eng.spec_stats()
            report.add({**shape, "arm": arm, "k": k, "tok_s": batch * steps / seconds,
                        "vs_plain": paired_s / seconds, "plain_tok_s": batch * steps / paired_s,
                        "acceptance": st["acceptance"],
                        "tokens_per_verify": st["tokens_per_verify"],
                        "draft_ms": st["draft_ms"], "verify_ms": st["verify_ms"], "plain_steps": st["plain_steps"],
                        "widths": " ".join(f"{w}:{n}" for w, n in sorted(st["width_steps"].items())),
                        "same_tokens": tokens == plain_tokens, "stats": st,
                        **({"profile": profile_cycle(eng, k, args.profile, args.top, st)}
                           if args.profile and arm != "off" else {})})
            for part in report.rows[-1].get("profile", {}).get("parts", []):
                report.note(f"  {arm} k={k} {part['part']:<16} {part['us']:10.1f} us  {part['calls']:6.1f} calls")
        if args.profile:     # the plain step of the same build, beside the arms' verifies
            ids = torch.tensor(prompts, device=eng.device)
            plain_row["profile"] = profile_steps(eng, ids, args.profile, args.top)
            for part in plain_row["profile"]["parts"]:
                report.note(f"  plain {part['part']:<22} {part['us']:10.1f} us  {part['calls']:6.1f} calls")
            report.save()
        eng.set_speculation("off")


# The parts of a speculative cycle: (where, method, label); a kernel belongs to the innermost
# label whose span holds its start (part_times).
PARTS = (("model", "mtp_draft", "draft.head"), ("model", "verify_hidden", "verify.target"),
         ("model", "verify_logits", "verify.lm_head"), ("screen", "argmax_rows", "verify.screen"),
         ("model", "commit_verify", "verify.rollback"), ("drafter", "observe", "verify.drafter"))
LABELS = ("step", "draft", "verify") + tuple(label for _, _, label in PARTS)


def _labelled(fn, label, sync):
    """fn inside a record_function(label), the device drained on both sides: its kernels run
    inside the range's span (part_times places kernels by time)."""
    from torch.profiler import record_function

    def call(*args, **kwargs):
        sync()
        with record_function(label):
            out = fn(*args, **kwargs)
            sync()
        return out
    return call


def part_times(events, gpu: bool) -> dict:
    """{label: {kernel: [microseconds, calls]}} over profiled events: each kernel's device time in
    the innermost LABELS range whose span holds its start (the ranges drain the device at both ends,
    so a range's kernels run inside it; the profiler links Triton's launches to no operator, so
    time, not the launch's parent, places them); "(unlabelled)" outside them. CPU: each operator's
    self time in the innermost range around it."""
    from collections import defaultdict

    parts: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    events = list(events)
    if gpu:
        ranges = sorted(((ev.time_range.end - ev.time_range.start, ev.time_range.start, ev.time_range.end, ev.name)
                         for ev in events if ev.device_type.name == "CPU" and ev.name in LABELS))
        for ev in events:
            if ev.device_type.name != "CUDA" or getattr(ev, "is_user_annotation", False) or ev.name in LABELS:
                continue
            start = ev.time_range.start
            label = next((name for _, lo, hi, name in ranges if lo <= start <= hi), "(unlabelled)")
            parts[label][ev.name][0] += ev.time_range.end - start
            parts[label][ev.name][1] += 1
        return parts

    def walk(ev, label):
        if ev.name in LABELS:
            label = ev.name
        else:
            parts[label][ev.name][0] += ev.self_cpu_time_total
            parts[label][ev.name][1] += 1
        for child in ev.cpu_children:
            walk(child, label)

    for ev in events:
        if ev.cpu_parent is None and ev.device_type.name == "CPU":
            walk(ev, "(unlabelled)")
    return parts


def profile_cycle(eng, k: int, cycles: int, top: int, stats: dict) -> dict:
    """--profile: `cycles` eager cycles (a draft, a verify of k) of the engine's speculative steps
    after its last call, the kernels' device time a cycle by part (the module note)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    runner = eng._spec
    gpu = gpu_visible()
    owners = {"model": eng.model, "screen": getattr(eng.model, "screen", None), "drafter": runner.drafter}
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    wrapped = []
    for owner, method, label in PARTS:
        obj = owners[owner]
        if obj is not None and callable(getattr(obj, method, None)):
            setattr(obj, method, _labelled(getattr(obj, method), label, sync))
            wrapped.append((obj, method))
    draft = _labelled(runner.run_eager, "draft", sync)
    verify = _labelled(runner.run_eager, "verify", sync)

    def cycle():
        draft("draft")
        verify(f"verify{k}")

    try:
        with torch.inference_mode():
            cycle()                                  # the eager path's first-call work
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
            with profile(activities=activities) as prof:
                for _ in range(cycles):
                    cycle()
                sync()
    finally:
        for obj, method in wrapped:
            delattr(obj, method)
    graphs = (stats.get("draft_ms") or 0.0) + (stats.get("verify_ms") or 0.0)
    return _profile_doc(prof, cycles, top, gpu, graphs)


def _profile_doc(prof, cycles: int, top: int, gpu: bool, graphs_ms: float | None) -> dict:
    """A profile's parts a cycle (part_times), the largest `top` kernels of each."""
    parts = part_times(prof.events(), gpu)
    rows = []
    for label in (*LABELS, "(unlabelled)"):
        kernels = parts.get(label)
        if not kernels:
            continue
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
        rows.append({"part": label, "us": sum(us for us, _ in kernels.values()) / cycles,
                     "calls": sum(n for _, n in kernels.values()) / cycles,
                     "kernels": [[name[:200], us / cycles, n / cycles] for name, (us, n) in ranked[:top]]})
    total = sum(r["us"] for r in rows)
    return {"cycles": cycles, "source": "cuda kernels" if gpu else "cpu operators (self time)",
            "kernels_us": total, "graphs_us": graphs_ms * 1e3 if gpu and graphs_ms else None, "parts": rows}


def eager_decode(eng, ids, room: int):
    """An eager DecodeRunner (the graph's kernels launched one by one) after the prompt pass of ids
    [B, P], the engine's cache holding `room` positions past the prompt; its first step (the eager
    path's first-call work) already run."""
    import torch

    engine_on_path()
    from fq_decode import DecodeRunner

    batch, prompt = ids.shape
    eng._prepare(batch, prompt + room)
    runner = DecodeRunner(eng.model, batch, use_graph=False)
    runner.start(eng.model.prefill(ids), prompt)
    runner.step()
    if gpu_visible():
        torch.cuda.synchronize()
    return runner


def profile_steps(eng, ids, steps: int, top: int) -> dict:
    """--profile for plain decode: `steps` eager decode steps after the prompt pass of ids, each
    kernel under "step" (the engine's graphed step's own time is the row's tok/s)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = gpu_visible()
    with torch.inference_mode():
        runner = eager_decode(eng, ids, steps + 2)
        step = _labelled(runner.step, "step", torch.cuda.synchronize if gpu else (lambda: None))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
    return _profile_doc(prof, steps, top, gpu, None)
