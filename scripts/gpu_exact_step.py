"""The GDN decode step in the full forward's arithmetic (fqkernels/gdn_exact_step.py) on the GPU,
at the Qwen3.5-4B's shapes (16 q/k heads, 32 value heads of 128).

- replicas: the one-kernel step's copies of torch's l2 norm (each candidate sum order) and
  cumulative sum, bit for bit against torch's own ops at the full forward's shapes (the l2 norm
  over [B, 32, T, 128], the cumulative sum over [B, 32, chunks, 64]);
- bits: per batch and form (FORMS), fused_step's outputs over 72 steps (a chunk and 8 rows of the next) against
  the reference's chunked rule over 512 + 72 positions (the full forward of a 512-token prompt
  and its decode: the steps start from the state it leaves at position 512), and the state the
  chunk's close leaves against the reference's at position 576;
- time: a CUDA graph of 64 steps (one chunk's rows, its close included) per step, for fused_step
  at column blocks, warp counts, loop unrolls, close blocks, with and without a register cap and
  PDL, in both kernel forms and the grid's pick (FORMS), the first two also with all 64 steps at one row
  (ROWS: the step's cost against its row, the close's at 63), and for the recurrent kernel
  (gdn.decode_step).

    python scripts/gpu_exact_step.py [--batches 1,4,16] [--out FILE]
    python scripts/gpu_exact_step.py --best FILE     # FASTQWEN_GDN_STEP_* of the best bit-equal form
    python scripts/gpu_exact_step.py --ncu 1,16      # the default form alone, for Nsight Compute
    python scripts/gpu_exact_step.py --forms 0 --bits-only   # FORMS[0]'s bits alone (with the
        # FASTQWEN_GDN_STEP_* settings of the environment: e.g. _EARLY, _MERGED), no timing
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))

from fqkernels import gdn, gdn_exact_step as step  # noqa: E402
from gpu_rule_bits_probe import _time_us  # noqa: E402

HK, HV, D, PROMPT, STEPS = 16, 32, 128, 512, 72
# the step's forms, bits and time: (kernels ("auto": grid_plan's, merged at B = 1 / 4 and fused at
# B = 16 here), value columns a program, warps, rows a loop trip loads, register cap ("auto": 128
# where the grid outnumbers two programs a multiprocessor, B = 16 here; 0: none), programmatic
# dependent launch, the close's blocks (state rows x chunk rows a dot))
FORMS = (("auto", 128, 4, 32, "auto", 1, "32x16"), ("auto", 128, 4, 32, "auto", 1, "16x16"),
         ("auto", 128, 4, 64, "auto", 1, "16x16"))
ENV = ("FORM", "BLOCK_V", "WARPS", "UNROLL", "MAXNREG", "PDL", "CLOSE")   # FASTQWEN_GDN_STEP_<name>
ROWS = (0, 31, 62, 63)   # rows of the chunk timed alone (FORMS[:2]): the step's cost against its row


def _key(form, bv, warps, unroll, maxnreg, pdl, close) -> str:
    return f"{form}_bv{bv}_w{warps}_u{unroll}_r{maxnreg}_pdl{pdl}_c{close}"


def _close(close: str):
    return close if close == "auto" else tuple(int(x) for x in close.split("x"))


def _differ(a, b) -> float:
    return float((a != b).float().mean())


def replicas() -> dict:
    """Each sum order's l2 norm and the cumulative sum against torch's, fraction of elements differing."""
    out = {}
    for B, T in ((1, 544), (4, 2080), (16, 576)):
        g_ = torch.Generator(device="cuda").manual_seed(B)
        x = torch.randn(B, HV, T, D, device="cuda", generator=g_) * 3
        want = gdn.l2_normalize(x).reshape(-1, D)
        rows = x.reshape(-1, D)
        out[f"l2norm_{B}x{T}"] = {str(o): _differ(step.torch_rows(rows, "l2norm", sum_order=o), want)
                                  for o in step.SUM_ORDERS}
        g = -F.softplus(torch.randn(B, HV, T // 64 + 1, 64, device="cuda", generator=g_)) * 0.3
        grows = g.reshape(-1, 64)
        out[f"cumsum_{B}x{T}"] = {"tile": step.scan_tile(grows.shape[0]),
                                  "differing": _differ(step.torch_rows(grows, "cumsum"), g.cumsum(-1).reshape(-1, 64))}
    few = -F.softplus(torch.randn(16, 64, device="cuda")) * 0.3             # 16 rows: torch's tile is 64
    out["cumsum_16_rows"] = {"tile": step.scan_tile(16), "differing": _differ(step.torch_rows(few, "cumsum"),
                                                                             few.cumsum(-1))}
    return out


def inputs(B: int, T: int, seed: int):
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, T, HK, D, device="cuda", generator=g_).bfloat16() for _ in range(2))
    v = torch.randn(B, T, HV, D, device="cuda", generator=g_).bfloat16()
    g = -F.softplus(torch.randn(B, T, HV, device="cuda", generator=g_)) * 0.1
    beta = torch.rand(B, T, HV, device="cuda", generator=g_).bfloat16()
    state = torch.randn(B, HV, D, D, device="cuda", generator=g_) * 0.1
    return q, k, v, g, beta, state


def bits(B: int, sum_order: int, forms=FORMS) -> dict:
    T = PROMPT + STEPS
    q, k, v, g, beta, state = inputs(B, T, seed=B)
    c0 = PROMPT // gdn.CHUNK
    want, _, start = gdn.delta_rule_chunked_reference(gdn.expand_heads(q, HV), gdn.expand_heads(k, HV), v, g, beta,
                                                      state=state, capture=c0)
    _, _, at_next = gdn.delta_rule_chunked_reference(gdn.expand_heads(q, HV), gdn.expand_heads(k, HV), v, g, beta,
                                                     state=state, capture=c0 + 1)
    tile = step.scan_tile(B * HV * ((T + gdn.CHUNK - 1) // gdn.CHUNK))     # the reference's rows of g
    report = {"tile": tile}
    for form, bv, warps, unroll, maxnreg, pdl, close in forms:
        rows, S, outs, closed = step.ChunkRows(B, HV, D, D, "cuda", block_v=bv), start.clone(), [], None
        for i in range(PROMPT, T):
            pos = torch.full((B,), i, dtype=torch.int32, device="cuda")
            outs.append(step.fused_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], pos, S, rows,
                                        sum_order=sum_order, tile=tile, unroll=unroll, form=form, num_warps=warps,
                                        maxnreg=maxnreg, use_pdl=bool(pdl), close=_close(close)))
            if i == PROMPT + gdn.CHUNK - 1:
                closed = S.clone()
        got = torch.stack(outs, 1)
        report[_key(form, bv, warps, unroll, maxnreg, pdl, close)] = {
            "out_differing": _differ(got, want[:, PROMPT:]),
            "out_max_abs": float((got.float() - want[:, PROMPT:].float()).abs().max()),
            "state_differing": _differ(closed, at_next)}
    return report


def _graph_us(fn, n: int) -> float:
    """Microseconds a call of fn(i) for i in range(n), all n captured in one CUDA graph, per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            fn(i)
    return round(_time_us(graph.replay, reps=10) / n, 2)


def timing(B: int, sum_order: int, forms=FORMS) -> dict:
    q, k, v, g, beta, state = inputs(B, 1, seed=100 + B)
    q, k, v, g, beta = (x[:, 0].contiguous() for x in (q, k, v, g, beta))
    positions = [torch.full((B,), i, dtype=torch.int32, device="cuda") for i in range(gdn.CHUNK)]
    out = {}
    for form, bv, warps, unroll, maxnreg, pdl, close in forms:
        rows, S = step.ChunkRows(B, HV, D, D, "cuda", block_v=bv), state.clone()
        key = _key(form, bv, warps, unroll, maxnreg, pdl, close)
        kw = dict(sum_order=sum_order, num_warps=warps, unroll=unroll, form=form, maxnreg=maxnreg,
                  use_pdl=bool(pdl), close=_close(close))
        try:
            out[key] = _graph_us(lambda i: step.fused_step(q, k, v, g, beta, positions[i], S, rows, **kw), gdn.CHUNK)
            if (form, bv, warps, unroll, maxnreg, pdl, close) in FORMS[:2]:
                for t in ROWS:    # 64 steps all at row t (each rewrites row t; at 63 each closes)
                    out[f"{key}_row{t}"] = _graph_us(lambda i: step.fused_step(q, k, v, g, beta, positions[t], S,
                                                                               rows, **kw), gdn.CHUNK)
        except Exception as exc:  # noqa: BLE001 - a form that does not compile or fit is reported, not fatal
            out[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
    R = state.clone()
    out["recurrent"] = _graph_us(lambda i: gdn.decode_step(q, k, v, g, beta, R), gdn.CHUNK)
    return out


def best(report: dict) -> str:
    """The form bit-equal at every batch with the least sum over the batches of its time over the
    fastest form's there, as FASTQWEN_GDN_STEP_* assignments ("" if none is bit-equal everywhere)."""
    batches = [key for key in report if key.isdigit()]
    times = {}
    for form in FORMS:
        key = _key(*form)
        per = [report[b].get(key) for b in batches]
        if all(isinstance(p, dict) and not any(p[f] for f in ("out_differing", "out_max_abs", "state_differing"))
               and isinstance(report[b]["us_per_step"].get(key), float) for b, p in zip(batches, per)):
            times[form] = [report[b]["us_per_step"][key] for b in batches]
    if not times:
        return ""
    fastest = [min(t[i] for t in times.values()) for i in range(len(batches))]
    form = min(times, key=lambda f: sum(t / m for t, m in zip(times[f], fastest)))
    return " ".join(f"FASTQWEN_GDN_STEP_{name}={value}" for name, value in zip(ENV, form))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--best", default=None, metavar="REPORT",
                    help="print the best form of a report as FASTQWEN_GDN_STEP_* assignments, and exit")
    ap.add_argument("--ncu", default=None, metavar="BATCHES",
                    help="only run the default form eagerly, 4 steps at row 31 a batch (for Nsight Compute)")
    ap.add_argument("--forms", default=None, metavar="INDICES",
                    help="FORMS' entries to run, a comma list of indices (default: all)")
    ap.add_argument("--bits-only", action="store_true", help="the bits alone, no timing")
    args = ap.parse_args(argv)
    forms = FORMS
    if args.forms:
        try:
            forms = tuple(FORMS[int(i)] for i in args.forms.split(","))
        except (ValueError, IndexError):
            ap.error(f"--forms: indices into the {len(FORMS)} FORMS, got {args.forms!r}")
    if args.ncu:
        for B in (int(b) for b in args.ncu.split(",")):
            q, k, v, g, beta, state = inputs(B, 1, seed=100 + B)
            q, k, v, g, beta = (x[:, 0].contiguous() for x in (q, k, v, g, beta))
            rows, pos = step.ChunkRows(B, HV, D, D, "cuda"), torch.full((B,), 31, dtype=torch.int32, device="cuda")
            for _ in range(4):
                step.fused_step(q, k, v, g, beta, pos, state, rows)
            torch.cuda.synchronize()
        return {}
    if args.best:
        with open(args.best) as f:
            print(best(json.load(f)))
        return {}
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"replicas": replicas(), "settings": {k: v for k, v in os.environ.items()
                                                   if k.startswith("FASTQWEN_")}}
    l2 = [v for key, v in report["replicas"].items() if key.startswith("l2norm")]
    exact = [o for o in step.SUM_ORDERS if all(v[str(o)] == 0 for v in l2)]
    report["sum_order"] = exact[0] if exact else 0
    report["sum_order_matches"] = bool(exact)
    print(json.dumps(report, indent=None), flush=True)
    for B in (int(b) for b in args.batches.split(",")):
        report[str(B)] = bits(B, report["sum_order"], forms)
        if not args.bits_only:
            report[str(B)]["us_per_step"] = timing(B, report["sum_order"], forms)
        print(B, report[str(B)], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
