"""Speculative decoding against plain decode on one engine, per batch: the oracle's speed curve
(drafts from a recorded plain run, each right with probability a) and the model-free drafters.

Shapes: --shapes BxPxO,... (each its own prompt and output), or --batches with one --prompt and
--steps. One engine is built with the engine options given (and Qwen3.5's MTP head where an arm is "mtp" or
a --speculative-token-map gives the head a draft vocabulary);
its speculation is switched per arm by Engine.set_speculation (the same weights, caches and tuning,
so the arms' tokens are comparable bit for bit). Per shape: random
prompts, a plain generate() (warmup, then --reps timed: the
median), then per arm one untimed call (the oracle records its plain run there; every arm compiles
and tunes) and --reps timed calls: output tokens/s, its ratio to plain, acceptance, tokens per
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
"""
from __future__ import annotations

import statistics
import time

from bench.runner import (Column, add_engine_arguments, add_model_argument, build_engine,
                          engine_options, gpu_visible, int_list, positive_int, resolve_model, shape_list)

COLUMNS = [Column("batch", width=5), Column("prompt", width=6), Column("steps", width=5),
           Column("arm", width=12, left=True), Column("k", width=3),
           Column("tok_s", "tok/s", fmt="{:.1f}"), Column("vs_plain", "x plain", fmt="{:.2f}"),
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
        sync()
        t0 = time.perf_counter()
        tokens = list(eng.generate(prompts, steps))
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tokens


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
        report.add({**shape, "arm": "plain", "k": 0, "tok_s": batch * steps / plain_s, "vs_plain": 1.0,
                    "same_tokens": True})
        for arm, k in ((arm, k) for arm in arms for k in args.k):
            eng.set_speculation(arm, k)
            list(eng.generate(prompts, steps))             # the oracle records here; compiles, tunes
            seconds, tokens = _timed(eng, prompts, steps, args.reps, sync)
            st = eng.spec_stats()
            report.add({**shape, "arm": arm, "k": k, "tok_s": batch * steps / seconds,
                        "vs_plain": plain_s / seconds, "acceptance": st["acceptance"],
                        "tokens_per_verify": st["tokens_per_verify"],
                        "draft_ms": st["draft_ms"], "verify_ms": st["verify_ms"], "plain_steps": st["plain_steps"],
                        "widths": " ".join(f"{w}:{n}" for w, n in sorted(st["width_steps"].items())),
                        "same_tokens": tokens == plain_tokens, "stats": st})
        eng.set_speculation("off")
