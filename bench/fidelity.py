"""Which op moves the logits: the engine's logits teacher-forced on one token sequence, with its op
set as it runs and with ops swapped for the torch reference's, each against native Transformers'
full forward over the same sequence.

Prompts: --batch windows of --prompt tokens drawn as the judge draws them (fastqwen/judge/prompts.py,
--seed). Tokens: --steps greedy tokens, native's (--tokens native: Transformers' cached decode as
the judge's native engine runs it) or the engine's own (--tokens engine: Engine.generate with the
engine options given). The reference runs in a child process in the checkpoint's reference
environment (fastqwen/refenv.py: Transformers 4.51.3 for Qwen3, 5.17.0 for Qwen3.5), as the
judge's replay does: one full forward over prompt + tokens, its logits in the replay's row slices
(the truth), and native's cached decode teacher-forced on the tokens (row "native_cached": how far
native's own decode sits from its full forward, the yardstick).

Variants, each a model of the engine's family over the engine's weights, teacher-forced: the
prompt pass's last-position logits, then one eager decode step per forced token (the graphs replay
the same kernels), --steps + 1 positions a sequence:
- base: the engine's op set (TritonOps on a GPU) with its exact_decode;
- exact_decode=off (or =on): the engine's other setting, its decode products tuned for it;
- swap:SPEC: the base op set with the ops SPEC names (a group of GROUPS or one op; "a+b" joins
  them) taken from the torch set, fq_ops.TorchOps, everything else the engine's.
Per variant: max |logit - full| over the vocabulary at each position, its max and mean over the
positions (and its mean at the prompt pass's position and over the decode steps); the pick (the
variant's own argmax op on its logits) and its slack, the full forward's max logit minus its
logit of the pick (the judge's figure, fastqwen/judge/replay.py): positions over 0.75 (native's
own noise, fidelity.NOISE_SLACK) and over the 2.0 margin, the worst; argmax agreement with the
full forward; agreement with the forced tokens (with the engine's own tokens, base's must be all:
a self-check); the max |diff| to base's logits (what the swap alone moves).
The LM-head screen is off in every variant (logits are read whole); the decode products run on
the GEMV or cuBLAS as base's tuning picked them at --batch rows.

Without a GPU the base is the torch op set (the kernels need one): a swap then changes nothing
and its logits are base's; the "setup" row says what ran ("swaps_change_ops").
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.runner import (REPO, BenchError, Column, add_engine_arguments, add_model_argument, build_engine,
                          engine_options, gpu_visible, import_engine, positive_int, resolve_model)

# Op-set methods by the part of the model they compute (fq_ops' own list of ops).
GROUPS: dict[str, tuple[str, ...]] = {
    "products": ("linear", "linear_split", "linear_parts", "linear_silu_mul", "linear_add_rmsnorm", "mlp"),
    "norms": ("embed_rmsnorm", "add_rmsnorm"),
    "rope": ("qk_norm_rope_store", "qk_norm_rope"),
    "attention": ("decode_attention", "gated_attention_qk", "gated_decode_attention", "gate_mul"),
    "gdn_prompt": ("gdn_gates", "causal_conv", "chunked_rule"),
    "gdn_step": ("gdn_in_proj_step", "gdn_rule_step", "gdn_exact_step", "gdn_chunk_rows", "gdn_rows_bytes"),
    "gated_rmsnorm": ("gated_rmsnorm",),
    "argmax": ("argmax",),
}
OPS: tuple[str, ...] = tuple(dict.fromkeys(op for ops in GROUPS.values() for op in ops))
GROUPS["all"] = OPS
# Ops that only work together: exact decode's step reads the chunk rows in the form its op set makes.
TIED = (("gdn_exact_step", "gdn_chunk_rows", "gdn_rows_bytes"),)
FAMILY_SWAPS = {
    "qwen3": ["products", "norms", "rope", "attention", "argmax", "all"],
    "qwen3.5": ["products", "norms", "rope", "attention", "gdn_prompt", "gdn_step", "gated_rmsnorm", "argmax", "all"],
}
EXPECTED_TRANSFORMERS = {"qwen3": "4.51.3", "qwen3.5": "5.17.0"}

COLUMNS = [Column("variant", width=24, left=True), Column("max_abs", "max|d|", fmt="{:.3f}", width=7),
           Column("mean_max_abs", "mean|d|", fmt="{:.4f}", width=8),
           Column("prefill_mean_max_abs", "prefill", fmt="{:.4f}", width=7),
           Column("count_gt_0_75", ">0.75", width=5), Column("count_gt_2_0", ">2.0", width=4),
           Column("max_slack", "max slack", fmt="{:.3f}", width=9), Column("argmax_agree", "agree", width=6),
           Column("token_agree", "tokens", width=6), Column("max_abs_vs_base", "vs base", fmt="{:.3f}", width=7),
           Column("seconds", "s", fmt="{:.1f}", width=6)]


def swap_list(text: str) -> list[str]:
    """An argparse type: "products,gdn_prompt+gdn_step,chunked_rule" -> its items, each a group or an
    op of the op set, "+" joining several into one swap ("" for none)."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    for item in items:
        for name in item.split("+"):
            if name not in GROUPS and name not in OPS:
                raise argparse.ArgumentTypeError(f"unknown op or group {name!r}; groups: {', '.join(GROUPS)}; "
                                                 f"ops: {', '.join(OPS)}")
    return items


def add_arguments(parser) -> None:
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences (default 16)")
    parser.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--steps", type=positive_int, default=64,
                        help="forced tokens, one decode step each (default 64)")
    parser.add_argument("--tokens", choices=("native", "engine"), default="native",
                        help="whose greedy tokens are forced: native's cached decode or the engine's (default native)")
    parser.add_argument("--swaps", type=swap_list, default=None, metavar="SPEC,...",
                        help="the swaps, each a group or an op ('+' joins several; '' none); default the family's "
                             f"groups (Qwen3: {','.join(FAMILY_SWAPS['qwen3'])}; Qwen3.5 adds the GDN groups). "
                             f"Groups: {', '.join(GROUPS)}")
    parser.add_argument("--seed", type=int, default=0, help="the prompt source's seed (default 0)")
    parser.add_argument("--reference-timeout-s", type=positive_int, default=1800,
                        help="the reference process's limit (default 1800)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


# ---------------------------------------------------------------- op sets

def expand(spec: str) -> tuple[str, ...]:
    """A swap's op names in order: groups opened, the ops tied to a named one added."""
    names: list[str] = []
    for part in spec.split("+"):
        names += GROUPS.get(part, (part,))
    for tied in TIED:
        if any(name in tied for name in names):
            names += tied
    return tuple(dict.fromkeys(names))


def swapped_ops(base: type, donor: type, names: tuple[str, ...] = ()) -> type:
    """A subclass of the op set `base` whose methods `names` are `donor`'s (as defined there: a
    method that calls another op calls this class's), and no LM-head screen. An op either class
    lacks is an error naming it."""
    attrs = {}
    for name in names:
        try:
            inspect.getattr_static(base, name)
            attrs[name] = inspect.getattr_static(donor, name)
        except AttributeError:
            raise BenchError(f"this engine's op sets have no op {name!r} ({base.__name__}, {donor.__name__})") from None
    attrs["lm_screen"] = lambda self, w: None
    return type(f"{base.__name__}[{'+'.join(names) or 'as is'}]", (base,), attrs)


# ---------------------------------------------------------------- the reference (a child process)

def reference_child(request_path: str) -> None:
    """In the reference environment: the request's full forward and native's cached decode (its
    greedy tokens, or the forced ones), written with torch.save to the request's "out"."""
    import torch
    import transformers

    from fastqwen.judge.replay import LOGIT_BUDGET_BYTES
    from fastqwen.native_engine.engine import load_model
    from fastqwen.numerics import pin_reference_numerics

    request = json.loads(Path(request_path).read_text())
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pin_reference_numerics()   # as the judge's native and replay: no TF32, no cuDNN attention
    model = load_model(request["model"]).to(device).eval()
    prompts = torch.tensor(request["prompts"], dtype=torch.long, device=device)
    forced = None if request["tokens"] is None else torch.tensor(request["tokens"], dtype=torch.long, device=device)
    G = request["steps"]
    B = prompts.shape[0]
    with torch.inference_mode():
        # native's decode as its engine runs it (fastqwen/native_engine): the prompt whole, then a token a forward
        out = model(input_ids=prompts, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        del out
        cached = torch.empty((B, G + 1, logits.shape[-1]), dtype=logits.dtype, device=device)
        tokens = torch.empty((B, G), dtype=torch.long, device=device)
        for t in range(G + 1):
            if t:
                out = model(input_ids=tokens[:, t - 1:t], past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache, logits = out.past_key_values, out.logits[:, -1]
                del out
            cached[:, t] = logits
            if t < G:
                tokens[:, t] = logits.argmax(-1) if forced is None else forced[:, t]
        del cache
        # the replay's forward: prompt + tokens in row slices under its logit budget, G + 1 positions kept
        ids = torch.cat([prompts, tokens], 1)
        keep, V = G + 1, cached.shape[-1]
        rows = max(1, LOGIT_BUDGET_BYTES.get(device, 512 << 20) // (keep * V * 4 * 2))
        full = torch.empty_like(cached)
        for r0 in range(0, B, rows):
            full[r0:r0 + rows] = model(input_ids=ids[r0:r0 + rows], use_cache=False, logits_to_keep=keep).logits
    torch.save({"tokens": tokens.cpu(), "full": full.cpu(), "cached": cached.cpu(),
                "transformers": transformers.__version__, "device": device, "pid": os.getpid(),
                "seconds": time.perf_counter() - t0}, request["out"])


def run_reference(model_dir: Path, model_type: str, prompts: list, tokens: list | None, steps: int,
                  timeout_s: int) -> dict:
    """reference_child in a fresh process in the checkpoint's reference environment; its result."""
    import torch

    from fastqwen import refenv

    env = refenv.reference_env(model_type)
    with tempfile.TemporaryDirectory(prefix="bench_fidelity_") as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "reference.pt"
        request.write_text(json.dumps({"model": str(model_dir), "prompts": prompts, "tokens": tokens, "steps": steps,
                                       "out": str(out)}))
        cmd = [sys.executable, "-m", "bench", "fidelity", "--child", str(request)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"the reference process did not finish in {timeout_s} s") from None
        if proc.returncode or not out.is_file():
            raise BenchError(f"the reference process failed (exit {proc.returncode}): "
                             f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        return torch.load(out, weights_only=True)


# ---------------------------------------------------------------- the engine's side

def forced_logits(model, prompts, tokens, capacity: int, pick) -> tuple:
    """(logits [B, G + 1, V] in the model's dtype, picks [B, G + 1] by `pick`): the prompt pass's
    last position, then a decode step fed each of tokens [B, G] at positions P, P + 1, ..."""
    import torch

    (B, P), G = prompts.shape, tokens.shape[1]
    with torch.inference_mode():
        model.ensure_rope(P + G)
        model.allocate_cache(B, capacity)
        first = model.prefill_logits(prompts)
        logits = torch.empty((B, G + 1, first.shape[-1]), dtype=first.dtype, device=first.device)
        picks = torch.empty((B, G + 1), dtype=torch.int64, device=first.device)
        logits[:, 0], picks[:, 0] = first, pick(first)
        pos = torch.full((B,), P, dtype=torch.int32, device=first.device)
        for t in range(G):
            step = model.decode_logits(tokens[:, t].contiguous(), pos, pos + 1)
            logits[:, t + 1], picks[:, t + 1] = step, pick(step)
            pos += 1
    return logits, picks


def figures(logits, picks, full, tokens, base=None) -> dict:
    """The per-variant figures (module doc) of logits and picks against the full forward's logits
    [B, G + 1, V]; tokens [B, G] the forced ones, base base's logits (None: no vs-base figure).
    A sequence at a time: no [B, G + 1, V] float temporaries."""
    import torch

    from fastqwen.judge.fidelity import NOISE_SLACK
    from fastqwen.judge.gates import MARGIN_LOGITS

    if logits.shape != full.shape:
        raise BenchError(f"logits {tuple(logits.shape)} against the reference's {tuple(full.shape)}")
    d, slack, agree, vs_base = [], [], [], []
    for b in range(full.shape[0]):
        f = full[b].float()
        d.append((logits[b].float() - f).abs().amax(-1))
        slack.append(f.amax(-1) - f.gather(-1, picks[b][:, None])[:, 0])
        agree.append(picks[b] == f.argmax(-1))
        if base is not None:
            vs_base.append((logits[b].float() - base[b].float()).abs().amax(-1))
    d, slack, agree = (torch.stack(x).cpu() for x in (d, slack, agree))
    G = tokens.shape[1]
    return {"positions": d.numel(), "max_abs": float(d.max()), "mean_max_abs": float(d.mean()),
            "prefill_mean_max_abs": float(d[:, 0].mean()),
            "decode_mean_max_abs": float(d[:, 1:].mean()) if G else None,
            "count_gt_0_75": int((slack > NOISE_SLACK).sum()), "count_gt_2_0": int((slack > MARGIN_LOGITS).sum()),
            "max_slack": float(slack.max()), "mean_slack": float(slack.mean()), "argmax_agree": int(agree.sum()),
            "token_agree": int((picks[:, :G].cpu() == tokens.cpu()).sum()),
            "max_abs_vs_base": float(torch.stack(vs_base).max()) if base is not None else None}


def run(args, report) -> None:
    if args.child is not None:
        reference_child(args.child)
        return
    import torch

    from fastqwen import refenv
    from fastqwen.judge.prompts import PromptSource

    model_dir = resolve_model(args.model)
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "qwen3")
    family = "qwen3.5" if model_type in refenv.QWEN35_MODEL_TYPES else "qwen3"
    try:
        refenv.reference_env(model_type)
    except (FileNotFoundError, ValueError) as exc:
        raise BenchError(str(exc)) from None
    specs = FAMILY_SWAPS[family] if args.swaps is None else args.swaps
    B, P, G = args.batch, args.prompt, args.steps

    eng = build_engine(model_dir, engine_options(args))
    engine_module = import_engine()
    describe = eng.describe()
    report.note(f"# {model_dir}: {describe}")
    source = PromptSource.for_model(model_dir, eng.cfg.vocab_size, args.seed)
    prompts = source.draw(B, P)
    forced = None
    if args.tokens == "engine":
        forced = [list(col) for col in zip(*eng.generate(prompts, G))]
    cfg, weights, device = eng.cfg, eng.model.w, eng.device
    Model, base_ops = type(eng.model), type(eng.model.ops)
    donor = getattr(sys.modules[base_ops.__module__], "TorchOps")
    exact = eng.model.ops.exact_decode
    classes = [("base", swapped_ops(base_ops, donor), exact),
               (f"exact_decode={'off' if exact else 'on'}", swapped_ops(base_ops, donor), not exact)]
    classes += [(f"swap:{spec}", swapped_ops(base_ops, donor, expand(spec)), exact) for spec in specs]
    del eng            # its caches, graphs and LM-head screen; the weights stay (the variants share them)
    gc.collect()
    gpu = gpu_visible()
    if gpu:
        torch.cuda.empty_cache()

    ref = run_reference(model_dir, model_type, prompts, forced, G, args.reference_timeout_s)
    expected = EXPECTED_TRANSFORMERS[family]
    if ref["transformers"] != expected:
        report.note(f"# the reference ran Transformers {ref['transformers']}, not {expected}")
    report.add({"kind": "setup", "model": str(model_dir), "family": family, "engine": describe,
                "prompts": source.kind, "tokens": args.tokens, "batch": B, "prompt": P, "steps": G,
                "positions": B * (G + 1), "base_ops": base_ops.__name__, "donor_ops": donor.__name__,
                "swaps_change_ops": base_ops is not donor, "reference_transformers": ref["transformers"],
                "reference_transformers_expected": expected, "reference_device": ref["device"],
                "reference_pid": ref["pid"], "reference_seconds": ref["seconds"]}, show=False)
    if base_ops is donor:
        report.note(f"# the base op set is {donor.__name__}: every swap is the op it replaces")

    dev = torch.device(device)
    full = ref["full"].to(dev)
    tokens = ref["tokens"].to(dev)
    cached = ref["cached"].to(dev)
    report.add({"kind": "variant", "variant": "native_cached", "ops": "transformers", "swapped": [],
                **figures(cached, cached.argmax(-1), full, tokens), "seconds": ref["seconds"]})
    del cached
    prompts_t = torch.tensor(prompts, dtype=torch.int64, device=dev)
    capacity = engine_module._rounded_capacity(P + G)
    takes_exact = "exact_decode" in inspect.signature(Model).parameters
    base_logits, base_choice = None, None
    for name, cls, exact_decode in classes:
        t0 = time.perf_counter()
        ops = cls(exact_decode)
        model = Model(cfg, weights, dev, ops, **({"exact_decode": exact_decode} if takes_exact else {}))
        tuning = None
        if gpu and hasattr(ops, "use_gemv"):
            # the decode products' GEMV / cuBLAS choice at B rows: base's, or measured for the other exact_decode
            if exact_decode == exact and base_choice is not None:
                ops.use_gemv = dict(base_choice)
            else:
                tuning = ops.tune(model.decode_products(), B)
                if exact_decode == exact:
                    base_choice = dict(ops.use_gemv)
        logits, picks = forced_logits(model, prompts_t, tokens, capacity, ops.argmax)
        if gpu:
            torch.cuda.synchronize()
        row = {"kind": "variant", "variant": name, "ops": cls.__name__, "exact_decode": exact_decode,
               "swapped": [n for n in OPS if n in cls.__dict__],
               **figures(logits, picks, full, tokens, base_logits), "seconds": time.perf_counter() - t0,
               "tuning": tuning}
        report.add(row)
        if base_logits is None:
            base_logits = logits
        else:
            del logits
        del model, ops, picks
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
