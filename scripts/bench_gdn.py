"""Time the Gated DeltaNet prompt pass (gdn.chunked_prefill, our three kernels) against the
pure-torch chunked reference at Qwen3.5-4B's head shapes (16 q/k heads, 32 value heads of
128), B in {1, 4, 16} x T in {512, 2048, 8192} by default, and check each result against
the reference; for the log, each of our kernels' device time (torch.profiler) and the same
kernels with single-pass TF32 products. With flash-linear-attention importable (installed,
or in the folder FASTQWEN_FLA_SITE names), its chunk_gated_delta_rule is timed beside them
(never required); then one decode step at a few batches, ours against the recurrent reference
and fla's fused recurrent kernel. One JSON line per shape, and a JSON file.

    python scripts/bench_gdn.py [--shapes 1x512,4x2048] [--out FILE]
    python scripts/bench_gdn.py --sweep 4x2048,16x8192    # every SWEEP launch plan instead
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))

from fqkernels import gdn  # noqa: E402

HK, HV, D = 16, 32, 128


def _ms(fn, reps: int = 15, warmup: int = 3) -> float:
    """The median of `reps` timed calls after `warmup` untimed ones (fla tunes its kernels at
    its first calls; with one warm-up and 5 reps its times moved up to 2x between runs,
    session 16)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernel_table(fn, reps: int) -> dict:
    """Device microseconds per call of fn by kernel name (torch.profiler), the 30 largest."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us, n = per.get(e.name, (0.0, 0))
            per[e.name] = (us + e.time_range.elapsed_us(), n + 1)
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    total = sum(us for us, _ in per.values()) / reps
    return {"total_us": round(total, 1),
            "kernels": [{"name": k[:90], "us": round(us / reps, 2), "calls": n // reps} for k, (us, n) in rows[:30]]}


def _fla():
    """flash-linear-attention's chunked rule, from the installed package or FASTQWEN_FLA_SITE."""
    if os.environ.get("FASTQWEN_FLA_SITE"):
        sys.path.insert(0, os.environ["FASTQWEN_FLA_SITE"])
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - optional comparison
        return None
    return chunk_gated_delta_rule


def _fla_pass(fla, q, k, v, g, beta):
    """fla's chunked rule over our inputs as the engine uses the rule: keys and queries
    l2-normalized inside, the final state returned; (o, final state)."""
    return fla(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)


def _fla_recurrent():
    """flash-linear-attention's fused recurrent rule (its decode step), or None."""
    if _fla() is None:
        return None
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001 - optional comparison
        return None
    return fused_recurrent_gated_delta_rule


def decode_rows(batches: list[int], dev: torch.device) -> list[dict]:
    """One decode step of the rule at each batch: ours (gdn.decode_step), the recurrent reference,
    and fla's fused recurrent kernel when present; times in us, the state against the reference's."""
    fla_step = _fla_recurrent()
    rows = []
    for B in batches:
        gen = torch.Generator(device=dev).manual_seed(B)
        q = torch.randn(B, HK, D, generator=gen, device=dev).bfloat16()
        k = torch.randn(B, HK, D, generator=gen, device=dev).bfloat16()
        v = torch.randn(B, HV, D, generator=gen, device=dev).bfloat16()
        g = -torch.rand(B, HV, generator=gen, device=dev)
        beta = torch.rand(B, HV, generator=gen, device=dev).bfloat16()
        s0 = torch.randn(B, HV, D, D, generator=gen, device=dev) * 0.1
        res = {"decode_B": B}
        s = s0.clone()
        res["ours_us"] = 1e3 * _ms(lambda: gdn.decode_step(q, k, v, g, beta, s), reps=20)
        s_r = s0.clone()
        res["reference_us"] = 1e3 * _ms(lambda: gdn.decode_step_reference(q, k, v, g, beta, s_r), reps=5)
        s, s_r = s0.clone(), s0.clone()
        gdn.decode_step(q, k, v, g, beta, s)
        gdn.decode_step_reference(q, k, v, g, beta, s_r)
        res["state_rel_to_reference"] = ((s - s_r).abs().max() / s_r.abs().max()).item()
        if fla_step is not None:
            try:
                qe, ke = gdn.expand_heads(q[:, None], HV), gdn.expand_heads(k[:, None], HV)
                st = s0.clone()
                res["fla_us"] = 1e3 * _ms(lambda: fla_step(qe, ke, v[:, None], g[:, None], beta[:, None],
                                                           initial_state=st, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True), reps=20)
            except Exception as exc:  # noqa: BLE001
                res["fla_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(res)
        print(json.dumps(res), flush=True)
    return rows


_FAST = dict(solve_prec="bf16x3", solve_maxnreg=168, out_maxnreg=168)     # session 16's FAST_PLAN
# Launch plans --sweep times (gdn.PrefillPlan): the default, then one kernel's launch changed
# at a time (each row's per-kernel table shows what that kernel gained), then combinations.
SWEEP = {
    "default": {},
    "out_w8": dict(out_warps=8),
    "out_bv128_w8": dict(out_bv=128, out_warps=8),
    "state_bv16_s1": dict(block_v=16, state_stages=1),
    "state_bv64_s2": dict(block_v=64),
    "state_w8_bv32": dict(state_warps=8, block_v=32),
    "solve_w8": dict(solve_warps=8),
    "w8_all": dict(solve_warps=8, out_warps=8, state_warps=8, block_v=32),
    "w8_bv16": dict(solve_warps=8, out_warps=8, block_v=16, state_stages=1),
    "out_tf32x3": dict(out_prec="tf32x3"),     # the output kernel's products before session 14
    # two warps: mma.sync with both operands in registers (no shared-memory copy of a computed
    # operand, as four warps' wgmma needs); ~200-240 bytes of spills a thread (ptxas, sm_90a)
    "state_w2_bv16": dict(state_warps=2, block_v=16),
    "out_w2_bv32": dict(out_warps=2, out_bv=32),
    # the solve and state kernels on bf16 pairs (~16 bits in place of three TF32 passes): 139
    # registers at 16 columns (three programs an SM), 179 at 32 (ptxas, sm_90a); a candidate
    # whose fidelity gpu_q35_opswap.py measures, never picked by best_plan
    "prec_bf16x2_bv16": dict(prec="bf16x2", block_v=16),
    "prec_bf16x2": dict(prec="bf16x2"),
    # register caps (Triton's maxnreg) for three programs an SM: the output kernel 228 -> 168 (4
    # bytes of spills a thread), the state kernel 253 -> 168 (424 bytes; at 16 columns 136), the
    # solve 237 -> 168 (28 bytes, but its shared memory still allows two); ptxas, sm_90a
    "out_cap168": dict(out_maxnreg=168),
    "state_cap168": dict(state_maxnreg=168),
    "state_cap168_bv16": dict(state_maxnreg=168, block_v=16),
    "caps168": dict(solve_maxnreg=168, state_maxnreg=168, out_maxnreg=168),
    "prec_bf16x2_caps": dict(prec="bf16x2", block_v=16, solve_maxnreg=168, out_maxnreg=168),
    # the solve and state kernels' fp32 products as bf16 thirds (six bf16 products: about fp32,
    # the tensor time of three TF32 passes, the left operand in registers): the solve 180
    # registers and 64 KiB of shared memory (three programs an SM at a cap of 168, no spills),
    # the state kernel at 16 or 32 columns and one stage 168 capped (44-72 bytes of spills, 32 KiB)
    "prec_bf16x3": dict(prec="bf16x3"),
    "bf16x3_solve_cap": dict(prec="bf16x3", solve_maxnreg=168),
    "bf16x3_caps_s1": dict(prec="bf16x3", solve_maxnreg=168, state_maxnreg=168, state_stages=1, out_maxnreg=168),
    "bf16x3_caps_s1_bv16": dict(prec="bf16x3", block_v=16, solve_maxnreg=168, state_maxnreg=168, state_stages=1,
                                out_maxnreg=168),
    # two stages at 16 columns: 76.5 KiB (three programs' 3 x 77.5 KiB with the 1 KiB each reserves
    # fit the SM's 228), capped at 168 with 8 bytes of spills
    "bf16x3_caps_bv16": dict(prec="bf16x3", block_v=16, solve_maxnreg=168, state_maxnreg=168, out_maxnreg=168),
    # the plan before session 16 (PrefillPlan(): the solve on three TF32 passes, no register caps)
    "session14": dict(solve_prec="tf32x3"),
    # FAST_PLAN with the state kernel forming v_new from the solve's P = M^-1 diag(beta) and the raw
    # keys and values (form "inverse": the solve writes 256 bytes a token and head in place of u
    # and w's 1 KiB, the state kernel reads ~25% fewer bytes a chunk at 32 columns), and with the
    # solve's inverse merged from its 16-blocks pairwise (form "merged": ~13x fewer multiply-adds
    # than the four [C, C] products); then the state kernel's launch around it
    "inverse": dict(_FAST, form="inverse"),
    "merged": dict(_FAST, form="merged"),
    "merged_bv64": dict(_FAST, form="merged", block_v=64),
    "merged_bv64_w8": dict(_FAST, form="merged", block_v=64, state_warps=8),
    "merged_bv16_s1": dict(_FAST, form="merged", block_v=16, state_stages=1),
    "merged_s1": dict(_FAST, form="merged", state_stages=1),
    "merged_state_bf16x3": dict(_FAST, form="merged", prec="bf16x3"),
    "merged_plain": dict(form="merged"),      # the plain plan's launches (Triton < 3.6's default) merged
    # session 17 run 3: the merged form with the state kernel on bf16 thirds (run 2's fastest at
    # 4 x 8192 and 16 x 8192), its columns per slice (block_v 0: 64 where their programs fill the
    # SMs), and slices of 32K tokens (at T = 8192 four sequences a slice: 64 columns fill the SMs)
    "merged_bf16x3_auto": dict(_FAST, form="merged", prec="bf16x3", block_v=0),
    "merged_bf16x3_bv64": dict(_FAST, form="merged", prec="bf16x3", block_v=64),
    "merged_bf16x3_auto_32k": dict(_FAST, form="merged", prec="bf16x3", block_v=0, slice_tokens=32768),
    "merged_bf16x3_bv64_32k": dict(_FAST, form="merged", prec="bf16x3", block_v=64, slice_tokens=32768),
    "session16": _FAST,                        # session 16's default, for the A/B against today's
}


def sweep_isolated(shapes: str, names: list[str]) -> list[dict]:
    """sweep_rows for each named SWEEP plan in a process of its own: a plan whose launch faults
    (an illegal address leaves the CUDA context unusable) is reported as that plan's error and
    the others still run."""
    rows = []
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json") as part:
            proc = subprocess.run([sys.executable, __file__, "--sweep", shapes, "--plans", name, "--in-process",
                                   "--out", part.name], capture_output=True, text=True)
            got = []
            if proc.returncode == 0:
                with open(part.name) as f:
                    got = json.load(f)["sweep"]
            if not got:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                got = [{"sweep": name, "plan": SWEEP.get(name, {}), "error": f"exit {proc.returncode}: {tail[0][:200]}"}]
        for res in got:
            print(json.dumps(res), flush=True)
        rows.extend(got)
    return rows


def sweep_rows(shapes: list[str], dev: torch.device, names: list[str] | None = None) -> list[dict]:
    """Every SWEEP plan (or those named) at each shape: ms, per-kernel us, and the outputs and
    final state against the default plan's (and, where it fits, the chunked reference's)."""
    rows = []
    for shape in shapes:
        B, T = (int(x) for x in shape.split("x"))
        q, k, v, g, beta = _inputs(B, T, dev)
        o0 = s0 = None
        if names is None or "default" in names:
            o0, s0 = gdn.chunked_prefill(q, k, v, g, beta)
        ref = None
        if B * T <= 16384 and (names is None or any(n in SWEEP for n in names)):
            ref = gdn.delta_rule_chunked_reference(gdn.expand_heads(q, HV), gdn.expand_heads(k, HV), v, g, beta)
        if names is not None and "fla" in names:   # flash-linear-attention at the same shape, same inputs
            res = {"sweep": "fla", "B": B, "T": T}
            fla = _fla()
            if fla is None:
                res["error"] = "flash-linear-attention is not installed (FASTQWEN_FLA_SITE)"
            else:
                try:
                    run = lambda: _fla_pass(fla, q, k, v, g, beta)  # noqa: E731
                    res["ms"] = _ms(run)
                    res["kernels"] = {r["name"]: r["us"] for r in kernel_table(run, 1)["kernels"]}
                except Exception as exc:  # noqa: BLE001
                    res["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(res)
            print(json.dumps(res), flush=True)
        for name, knobs in SWEEP.items():
            if names is not None and name not in names:
                continue
            res = {"sweep": name, "B": B, "T": T, "plan": knobs}
            try:
                plan = gdn.PrefillPlan(**knobs) if knobs else gdn.DEFAULT_PLAN   # "default": the engine's
                run = lambda: gdn.chunked_prefill(q, k, v, g, beta, plan=plan)  # noqa: E731
                o, s = run()
                res["ms"] = _ms(run)
                res["kernels"] = {r["name"]: r["us"] for r in kernel_table(run, 1)["kernels"]}
                if s0 is not None:
                    res["state_rel_to_default"] = ((s - s0).abs().max() / s0.abs().max()).item()
                    res["out_rel_to_default"] = ((o.float() - o0.float()).abs().max() / o0.float().abs().max()).item()
                if ref is not None:
                    res["state_rel_to_reference"] = ((s - ref[1]).abs().max() / ref[1].abs().max()).item()
                    res["out_rel_to_reference"] = ((o.float() - ref[0].float()).abs().max()
                                                   / ref[0].float().abs().max()).item()
            except Exception as exc:  # noqa: BLE001 - a plan that cannot launch here is reported, not fatal
                res["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(res)
            print(json.dumps(res), flush=True)
        del q, k, v, o0, s0, ref
        torch.cuda.empty_cache()
    return rows


def best_plan(rows: list[dict], state_gate: float = 2e-5, out_gate: float = 5e-3, among: list[str] | None = None) -> str:
    """The SWEEP plan with the least total time over the swept shapes, among those that ran at
    every shape and, where the reference was computed, kept the state within state_gate and the
    outputs within out_gate of it; as FASTQWEN_GDN_PLAN text ("" for the defaults). Plans that
    change the precision (prec, solve_prec, out_prec) are never picked: that is a fidelity decision, made
    on a fidelity measurement, not a launch choice; unless among names the candidates (the caller
    has made that decision for them, e.g. forms of the same sums at fp32's accuracy)."""
    shapes = {(r["B"], r["T"]) for r in rows}
    totals = {}
    for name in SWEEP:
        if among is not None and name not in among:
            continue
        if among is None and {"prec", "out_prec", "solve_prec"} & set(SWEEP[name]):
            continue
        mine = [r for r in rows if r["sweep"] == name]
        if len(mine) != len(shapes) or any("error" in r for r in mine):
            continue
        if any(r.get("state_rel_to_reference", 0.0) > state_gate or r.get("out_rel_to_reference", 0.0) > out_gate
               for r in mine):
            continue
        totals[name] = sum(r["ms"] for r in mine)
    if not totals:
        return ""
    return ",".join(f"{k}={v}" for k, v in SWEEP[min(totals, key=totals.get)].items())


def _inputs(B: int, T: int, dev: torch.device):
    """q, k, v, g, beta of one prompt pass at the 4B's head shapes (seeded by B x T)."""
    gen = torch.Generator(device=dev).manual_seed(B * T)
    q = torch.randn(B, T, HK, D, generator=gen, device=dev).bfloat16()
    k = torch.randn(B, T, HK, D, generator=gen, device=dev).bfloat16()
    v = torch.randn(B, T, HV, D, generator=gen, device=dev).bfloat16()
    a = torch.randn(B, T, HV, generator=gen, device=dev).bfloat16()
    b = torch.randn(B, T, HV, generator=gen, device=dev).bfloat16()
    a_log = torch.log(torch.empty(HV, device=dev).uniform_(0.01, 16, generator=gen)).bfloat16()
    g, beta = gdn.gates_reference(a, b, a_log, torch.ones(HV, dtype=torch.bfloat16, device=dev))
    return q, k, v, g, beta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x512,1x2048,1x8192,4x512,4x2048,4x8192,16x512,16x2048,16x8192")
    ap.add_argument("--decode", default="1,4,16,64", help="batches of the decode-step comparison ('' skips it)")
    ap.add_argument("--sweep", default="", help="shapes at which to time every SWEEP launch plan instead "
                    "(e.g. 4x2048,16x8192); the comparison with fla and the decode rows are skipped")
    ap.add_argument("--plans", default="", help="with --sweep: only these SWEEP plans (default: every plan), "
                    "each in a process of its own; 'fla' times flash-linear-attention on the same inputs")
    ap.add_argument("--in-process", action="store_true", help="with --sweep: the plans in this process")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_gdn.json"))
    ap.add_argument("--best", default="", help="print the best plan of a --sweep report (FASTQWEN_GDN_PLAN text)")
    ap.add_argument("--among", default="", help="with --best: only these SWEEP plans, precision changes allowed")
    args = ap.parse_args()
    if args.best:
        with open(args.best) as f:
            print(best_plan(json.load(f)["sweep"], among=[n for n in args.among.split(",") if n] or None))
        return
    dev = torch.device("cuda")
    if args.sweep:
        names = [n for n in args.plans.split(",") if n] or list(SWEEP)
        unknown = [n for n in names if n not in SWEEP and n != "fla"]
        if unknown:
            ap.error(f"--plans: unknown plan(s) {', '.join(unknown)}; known: {', '.join(SWEEP)}")
        rows = (sweep_rows(args.sweep.split(","), dev, names) if args.in_process
                else sweep_isolated(args.sweep, names))
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "sweep": rows}, f, indent=1)
        return
    fla = _fla()
    report = {"torch": torch.__version__, "fla": fla is not None, "results": []}
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        q, k, v, g, beta = _inputs(B, T, dev)
        res = {"B": B, "T": T}
        res["ours_ms"] = _ms(lambda: gdn.chunked_prefill(q, k, v, g, beta))
        res["ours_kernels"] = kernel_table(lambda: gdn.chunked_prefill(q, k, v, g, beta), 1)["kernels"]
        qe, ke = gdn.expand_heads(q, HV), gdn.expand_heads(k, HV)
        o, s = gdn.chunked_prefill(q, k, v, g, beta)
        if B * T <= 16384:   # the reference's working set grows with B x T
            res["reference_ms"] = _ms(lambda: gdn.delta_rule_chunked_reference(qe, ke, v, g, beta), reps=3)
            o_r, s_r = gdn.delta_rule_chunked_reference(qe, ke, v, g, beta)
            res["state_rel_to_reference"] = ((s - s_r).abs().max() / s_r.abs().max()).item()
            res["out_rel_to_reference"] = ((o.float() - o_r.float()).abs().max() / o_r.float().abs().max()).item()
        # The same kernels with one TF32 product (not three): the precision's price, for the log.
        saved, gdn._PREC = gdn._PREC, "tf32"
        try:
            res["ours_tf32_ms"] = _ms(lambda: gdn.chunked_prefill(q, k, v, g, beta))
            if "state_rel_to_reference" in res:
                s_t = gdn.chunked_prefill(q, k, v, g, beta)[1]
                res["tf32_state_rel_to_reference"] = ((s_t - s_r).abs().max() / s_r.abs().max()).item()
        finally:
            gdn._PREC = saved
        if fla is not None:
            try:
                res["fla_ms"] = _ms(lambda: _fla_pass(fla, q, k, v, g, beta))
                o_f, s_f = _fla_pass(fla, q, k, v, g, beta)
                if "state_rel_to_reference" in res:
                    res["fla_state_rel_to_reference"] = ((s_f.float() - s_r).abs().max() / s_r.abs().max()).item()
            except Exception as exc:  # noqa: BLE001
                res["fla_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        report["results"].append(res)
        print(json.dumps(res), flush=True)
        del q, k, v, qe, ke, o, s
        torch.cuda.empty_cache()
    if args.decode:
        report["decode"] = decode_rows([int(b) for b in args.decode.split(",")], dev)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
