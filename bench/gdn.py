"""The GDN prompt pass (the chunked gated delta rule, engine/fqkernels/gdn_prefill.py) against its
torch reference and flash-linear-attention.

Per shape B x T, at --key-heads / --value-heads / --head-dim (default Qwen3.5-4B's 16 / 32 / 128),
on seeded inputs as a GDN layer makes them (q, k, v as the conv's bf16 outputs, the gates from
random a, b): three arms on the same inputs.
- reference: gdn_ref.chunked_prefill_reference (the fp32 chunked rule), eager; the outputs and the
  final state every other arm is measured against (relative max abs: max |x - ref| / max |ref|).
- ours: gdn_prefill.chunked_prefill under each plan: `default` (called as the engine calls it:
  DEFAULT_PLAN), each --plan, and with --sweep the SWEEP candidates (launches around FAST_PLAN,
  then other precisions), timed as one CUDA graph of the call (runner.time_graph: the engine's prompt pass runs
  as a graph, so no host launch cost), with the sum of its kernels' device times beside it.
- fla: flash-linear-attention's chunk_gated_delta_rule where it imports (installed, or from the
  folder BENCH_FLA_SITE names; never an engine dependency), q and k heads repeated to the value
  heads, the l2 norm in its kernel, the final state returned: timed as launched (CUDA events
  around each call, its Python launch cost included) and as the sum of its kernels' device times
  (torch.profiler), the comparison that counts beside our graph (docs/PERFORMANCE.md).
With several plans, a row "best" after the measurements: best_plan's pick, the fastest plan over
the shapes whose state and outputs stayed within the reference-precision gates at every shape,
never a change of precision (that is a fidelity decision: `python -m bench fidelity`). A plan
that fails to compile or launch is a row with its error; one that faults the device ends the run
(the rows so far are in --out).

Without a GPU the "ours" arm is the reference (the kernels need one), fla is not run, and times
are wall-clock.
"""
from __future__ import annotations

import os
import sys
from dataclasses import fields, replace

from bench.runner import (BenchError, Column, engine_on_path, gpu_visible, on_off, positive_int, shape_list,
                          time_eager, time_graph)

# The kernels' gates against the float64 oracle (tests/test_gdn.py GATE_STATE / GATE_OUT): the fp32
# references reach 1.4e-6 on the state and 2.9e-3 on the bf16 outputs.
STATE_GATE = 2e-5
OUT_GATE = 5e-3
PRECISION_FIELDS = ("prec", "solve_form", "out_prec")

# name -> PrefillPlan fields over FAST_PLAN (None: PrefillPlan(), the plain plan, Triton < 3.6's
# default): launches and forms at FAST_PLAN's precisions first, then other precisions. A row's
# "precision_change" is against the engine's DEFAULT_PLAN (FAST_PLAN on Triton 3.6+, else the plain).
SWEEP: dict[str, dict | None] = {
    "plain": None,
    "fast": {},
    "fast_bv32": {"block_v": 32},
    "fast_bv64": {"block_v": 64},
    "fast_state_s1": {"state_stages": 1},
    "fast_state_w8": {"state_warps": 8},
    "fast_state_cap168": {"state_maxnreg": 168},
    "fast_out_w8": {"out_warps": 8},
    "fast_out_bv128": {"out_bv": 128},
    "fast_no_caps": {"solve_maxnreg": 0, "out_maxnreg": 0},
    "fast_uw": {"form": "uw"},
    "fast_16k": {"slice_tokens": 16384},
    "fast_tf32x3": {"prec": "tf32x3"},
    "fast_out_tf32x3": {"out_prec": "tf32x3"},
    "fast_state_bf16x2": {"prec": "bf16x2", "solve_prec": "bf16x3", "block_v": 16},
}

COLUMNS = [Column("shape", width=8, left=True), Column("arm", width=9, left=True),
           Column("plan_name", "plan", width=18, left=True), Column("us", fmt="{:.1f}"),
           Column("timing", width=6, left=True), Column("kernels_us", "kernels us", fmt="{:.1f}"),
           Column("kernels_vs_fla", "x fla", fmt="{:.3f}", width=6), Column("out_err", "out err", fmt="{:.2e}"),
           Column("state_err", "state err", fmt="{:.2e}"), Column("error", width=30, left=True)]


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", type=shape_list(2, "BATCHxTOKENS"),
                        default=[(b, t) for b in (1, 4, 16) for t in (512, 2048, 8192)],
                        help="sequences x tokens (default {1,4,16} x {512,2048,8192})")
    parser.add_argument("--key-heads", type=positive_int, default=16, help="q / k heads (default 16)")
    parser.add_argument("--value-heads", type=positive_int, default=32, help="value heads (default 32)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="Dk = Dv (default 128)")
    parser.add_argument("--plan", action="append", default=[], metavar="FIELDS",
                        help="a PrefillPlan to time besides the default, as gdn_prefill.plan_from_text reads it, "
                             "e.g. block_v=64,state_stages=1 (repeatable)")
    parser.add_argument("--sweep", action="store_true", help="time the SWEEP candidate plans too, then pick the best")
    parser.add_argument("--fla", type=on_off, default=True, metavar="on|off",
                        help="flash-linear-attention's arm where it imports (default on)")
    parser.add_argument("--reps", type=positive_int, default=15, help="timed graph replays or calls (default 15)")
    parser.add_argument("--ref-reps", type=positive_int, default=3, help="timed reference calls (default 3)")
    parser.add_argument("--ref-max-tokens", type=positive_int, default=16 * 8192,
                        help="no reference (so no errors) past this many B x T tokens (default 131072)")


# ---------------------------------------------------------------- plans

def plan_text(plan) -> str:
    """The plan as gdn_prefill.plan_from_text reads it: the fields that differ from PrefillPlan()'s
    ("" for the plain plan)."""
    plain = type(plan)()
    return ",".join(f"{f.name}={getattr(plan, f.name)}" for f in fields(plan)
                    if getattr(plan, f.name) != getattr(plain, f.name))


def precision(plan) -> tuple:
    """The plan's products' forms (the solve's, the state kernel's, the output kernel's)."""
    return tuple(getattr(plan, name) for name in PRECISION_FIELDS)


def candidate_plans(gdn_prefill, extra: list[str], sweep: bool) -> list[tuple[str, object]]:
    """(name, plan): "default" (DEFAULT_PLAN), the --plan ones, with sweep SWEEP's; a plan equal to an
    earlier one is dropped. A --plan that plan_from_text refuses is an error naming it."""
    out = [("default", gdn_prefill.DEFAULT_PLAN)]
    for text in extra:
        try:
            out.append((text, gdn_prefill.plan_from_text(text)))
        except ValueError as exc:
            raise BenchError(f"--plan {text!r}: {exc}") from None
    if sweep:
        for name, over in SWEEP.items():
            out.append((name, gdn_prefill.PrefillPlan() if over is None else replace(gdn_prefill.FAST_PLAN, **over)))
    kept: list[tuple[str, object]] = []
    for name, plan in out:
        if all(plan != p for _, p in kept):
            kept.append((name, plan))
    return kept


def best_plan(rows: list[dict], among: list[str] | None = None) -> str | None:
    """The text of the plan with the least total time over the shapes of the "ours" rows, among the
    plans that ran at every shape with their final state within STATE_GATE and their outputs
    within OUT_GATE of the reference at each; None when none did. A plan that changes the
    precision (row "precision_change": its products' forms differ from the engine's default plan's)
    is never picked unless `among` names it (by plan name or text): precision is decided on a
    fidelity measurement, not on speed. With `among`, only the plans it names are candidates."""
    ours = [r for r in rows if r.get("arm") == "ours"]
    shapes = {(r["batch"], r["tokens"]) for r in ours}
    by_plan: dict[str, list[dict]] = {}
    for r in ours:
        by_plan.setdefault(r["plan"], []).append(r)
    totals = {}
    for text, mine in by_plan.items():
        named = among is not None and any(r["plan_name"] in among or text in among for r in mine)
        if among is not None and not named:
            continue
        if among is None and any(r.get("precision_change") for r in mine):
            continue
        if {(r["batch"], r["tokens"]) for r in mine} != shapes or any(r.get("error") or r.get("us") is None
                                                                      for r in mine):
            continue
        if any(r.get("state_err") is None or r["state_err"] > STATE_GATE or r.get("out_err") is None
               or r["out_err"] > OUT_GATE for r in mine):
            continue
        totals[text] = sum(r["us"] for r in mine)
    return min(totals, key=totals.get) if totals else None


# ---------------------------------------------------------------- arms

def gdn_inputs(B: int, T: int, Hk: int, Hv: int, D: int, device: str):
    """q, k [B, T, Hk, D], v [B, T, Hv, D] bf16, g fp32 and beta bf16 [B, T, Hv], seeded by B x T
    (tests/test_gdn.py's inputs: A_log from uniform(0.01, 16), dt_bias 1)."""
    import torch

    from fqkernels import gdn_ref

    gen = torch.Generator(device=device).manual_seed(B * T)
    q = torch.randn(B, T, Hk, D, generator=gen, device=device).bfloat16()
    k = torch.randn(B, T, Hk, D, generator=gen, device=device).bfloat16()
    v = torch.randn(B, T, Hv, D, generator=gen, device=device).bfloat16()
    a = torch.randn(B, T, Hv, generator=gen, device=device).bfloat16()
    b = torch.randn(B, T, Hv, generator=gen, device=device).bfloat16()
    a_log = torch.log(torch.empty(Hv, device=device).uniform_(0.01, 16, generator=gen)).bfloat16()
    g, beta = gdn_ref.gates_reference(a, b, a_log, torch.ones(Hv, dtype=torch.bfloat16, device=device))
    return q, k, v, g, beta


def load_fla():
    """(flash-linear-attention's chunk_gated_delta_rule, "fla VERSION"), or (None, why not). The
    folder BENCH_FLA_SITE names (bench/gpu.sh installs the carried wheels there) is searched after
    the installed packages."""
    site = os.environ.get("BENCH_FLA_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:   # noqa: BLE001 - an optional arm: why it is missing is the row's error
        return None, f"flash-linear-attention does not import: {type(exc).__name__}: {exc}"[:300]
    return chunk_gated_delta_rule, f"fla {getattr(fla, '__version__', 'of unknown version')}"


def rel(x, ref) -> float:
    """max |x - ref| / max |ref|, in fp32."""
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def kernel_sum(fn, reps: int, gpu: bool) -> tuple[float, str]:
    """(microseconds a call summed over its kernels, what was summed), from torch.profiler over
    `reps` calls after one (bench/prefill.kernel_times; without a GPU: CPU operators' self time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.prefill import kernel_times

    fn()
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if gpu:
            torch.cuda.synchronize()
    return sum(us for _, us, _ in kernel_times(prof, reps, gpu)), ("cuda kernels" if gpu else "cpu operators")


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def run(args, report) -> None:
    import torch

    engine_on_path()
    from fqkernels import gdn_prefill, gdn_ref

    if args.value_heads % args.key_heads:
        raise BenchError(f"--value-heads {args.value_heads} is not a multiple of --key-heads {args.key_heads}")
    plans = candidate_plans(gdn_prefill, args.plan, args.sweep)
    gpu = gpu_visible()
    device = "cuda" if gpu else "cpu"
    if not gpu:
        fla, fla_about = None, "not run: no GPU"
    elif not args.fla:
        fla, fla_about = None, "not run: --fla off"
    else:
        fla, fla_about = load_fla()
    default_precision = precision(gdn_prefill.DEFAULT_PLAN)
    report.note(f"# heads {args.key_heads} / {args.value_heads}, D {args.head_dim}; default plan "
                f"{plan_text(gdn_prefill.DEFAULT_PLAN)!r}; {fla_about}")
    if not gpu:
        report.note("# no GPU: the ours arm is the reference, times are wall-clock")
    Hk, Hv, D = args.key_heads, args.value_heads, args.head_dim

    def sync():
        if gpu:
            torch.cuda.synchronize()

    for B, T in args.shapes:
        base = {"kind": "measure", "shape": f"{B}x{T}", "batch": B, "tokens": T, "key_heads": Hk, "value_heads": Hv,
                "head_dim": D}
        q, k, v, g, beta = gdn_inputs(B, T, Hk, Hv, D, device)
        ref = None
        row = dict(base, arm="reference", plan_name=None, plan=None, impl="torch", timing="eager")
        if B * T > args.ref_max_tokens:
            row["error"] = f"skipped: {B * T} tokens over --ref-max-tokens"
        else:
            try:
                call = lambda: gdn_ref.chunked_prefill_reference(q, k, v, g, beta)   # noqa: E731
                ref = call()
                row["us"] = time_eager(call, reps=args.ref_reps, warmup=0)
            except torch.cuda.OutOfMemoryError as exc:
                row["error"] = _error(exc)
                ref = None
                torch.cuda.empty_cache()
        report.add(row)

        fla_kernels = None
        row = dict(base, arm="fla", plan_name=None, plan=None, impl=fla_about if fla else None, timing="eager")
        if fla is None:
            row["error"] = fla_about
        else:
            # the value heads' own q, k: correct on every fla version, grouped value heads or not
            qe, ke = gdn_ref.expand_heads(q, Hv), gdn_ref.expand_heads(k, Hv)
            call = lambda: fla(qe, ke, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)  # noqa: E731
            try:
                # fla tunes its kernels over its first calls: three before any timing
                row["us"] = time_eager(call, reps=args.reps, warmup=3)
                row["kernels_us"], row["kernels_source"] = kernel_sum(call, 3, gpu)
                fla_kernels = row["kernels_us"]
                if ref is not None:
                    o, s = call()
                    row["out_err"], row["state_err"] = rel(o, ref[0]), rel(s, ref[1])
            except Exception as exc:   # noqa: BLE001 - an optional arm that fails is a row with its error
                row["error"] = _error(exc)
                sync()
            del qe, ke
        report.add(row)

        for name, plan in plans:
            row = dict(base, arm="ours", plan_name=name, plan=plan_text(plan),
                       precision_change=precision(plan) != default_precision,
                       impl="kernels" if gpu else "reference", timing="graph" if gpu else "eager")
            if gpu:
                # the default as the engine calls it (plan None: DEFAULT_PLAN, three TF32 passes where Dk < 64)
                given = None if name == "default" else plan
                call = lambda given=given: gdn_prefill.chunked_prefill(q, k, v, g, beta, plan=given)   # noqa: E731
            else:
                call = lambda: gdn_ref.chunked_prefill_reference(q, k, v, g, beta)   # noqa: E731
            try:
                o, s = call()
                sync()
                if ref is not None:
                    row["out_err"], row["state_err"] = rel(o, ref[0]), rel(s, ref[1])
                del o, s
                row["us"] = time_graph(lambda _: call(), [None], args.reps)
                row["kernels_us"], row["kernels_source"] = kernel_sum(call, 3, gpu)
                if fla_kernels:
                    row["kernels_vs_fla"] = row["kernels_us"] / fla_kernels
            except Exception as exc:   # noqa: BLE001 - a plan that does not compile or launch is a result
                row["error"] = _error(exc)
                sync()
            report.add(row)
        del q, k, v, g, beta, ref
        if gpu:
            torch.cuda.empty_cache()
    if len(plans) > 1:
        summarize(report, plans)


def summarize(report, plans) -> None:
    """The "best" row (best_plan) and its total time against the default plan's, as a line too."""
    rows = report.rows
    text = best_plan(rows)
    total = {}
    for r in rows:
        if r.get("arm") == "ours" and r.get("us") is not None:
            total[r["plan"]] = total.get(r["plan"], 0.0) + r["us"]
    default = next(plan_text(p) for n, p in plans if n == "default")
    name = next((n for n, p in plans if plan_text(p) == text), None)
    report.add({"kind": "best", "arm": None, "plan_name": name, "plan": text,
                "total_us": total.get(text), "default_total_us": total.get(default),
                "state_gate": STATE_GATE, "out_gate": OUT_GATE}, show=False)
    if text is None:
        report.note("best plan: none ran at every shape within the gates")
    else:
        ratio = total[text] / total[default] if total.get(default) else float("nan")
        report.note(f"best plan: {name} {text!r}, {total[text]:.1f} us over the shapes, x{ratio:.3f} of the default's")
