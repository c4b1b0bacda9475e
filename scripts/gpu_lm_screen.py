"""The screened LM head (engine/fqkernels/lm_screen.py) on a GPU, in one process, for one model:

1. picks: on the model's own decode hidden states (eager steps after real prompt passes), the
   screen's pick against the argmax of the whole GEMV, and the candidates' count per step;
2. kernels: the LM head's tail as the step runs it (GEMV + the two argmax kernels) against the
   screen under each plan, each as a CUDA graph of one call per hidden state (fq_ops._time_over,
   us a call), beside a read-only control over the int8 copy and the int8 pass with one piece
   changed at a time;
3. step: the graphed decode step at batch 1 with the screen (the best plan of 2) and without,
   interleaved rounds, the greedy tokens of both compared;
4. generate: `Engine.generate` as the host sees it (TTFT, TPOT, total) with and without, interleaved.

Usage: python scripts/gpu_lm_screen.py --model DIR --out FILE [--plans "rows=16,block_k=512;..."]
       [--prompt 512] [--steps 32] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import engine as fast_engine  # noqa: E402
from fq_decode import DecodeRunner  # noqa: E402
from fqkernels import argmax as am  # noqa: E402
from fqkernels import gemv, lm_screen  # noqa: E402
from fq_ops import _time_over  # noqa: E402
from gpu_check import graphed_step_ms  # noqa: E402

DEFAULT_PLANS = ("rows=16,block_k=512,groups=4;rows=16,block_k=512,groups=8;rows=16,block_k=512,groups=32;"
                 "rows=32,block_k=256;rows=8,block_k=256,stages=1;rows=32,block_k=512,warps=8")


@triton.jit
def _read_kernel(q_ptr, out_ptr, V, KW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """The control: the int8 copy read as 32-bit words with the int8 pass's tiling, one XOR a word
    (no conversion, no products): what reading those bytes alone costs."""
    rows = tl.minimum(tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R), V - 1)
    offs = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.int32)
    for k in range(0, KW, BLOCK_W):
        acc ^= tl.load(q_ptr + rows.to(tl.int64)[:, None] * KW + k + offs[None, :], eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _approx_variant_kernel(x_ptr, q_ptr, s_ptr, up_ptr, tau_ptr, V, c1, K: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_K: tl.constexpr, X_MODE: tl.constexpr, ATOMIC: tl.constexpr):
    """lm_screen._approx_kernel with one piece changed, for timing only (the values are not the
    screen's): X_MODE 0 as the kernel, 1 x's first block loaded once and reused every trip (no
    per-trip x load or layout change), 2 no x at all (the bytes' values summed); ATOMIC False: no
    atomic max and no bound epilogue (the sums stored)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_ld = tl.minimum(rows, V - 1)
    offs_k = tl.arange(0, BLOCK_K)
    q_ptrs = q_ptr + rows_ld.to(tl.int64)[:, None] * K + offs_k[None, :]
    s = tl.load(s_ptr + rows_ld)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    x_abs = tl.zeros([BLOCK_K], dtype=tl.float32)
    x0 = tl.load(x_ptr + offs_k).to(tl.float32)
    for k in range(0, K, BLOCK_K):
        b = tl.load(q_ptrs + k, eviction_policy="evict_first")
        f = (b.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        if X_MODE == 0:
            xv = tl.load(x_ptr + k + offs_k).to(tl.float32)
            acc += f * xv[None, :]
            x_abs += tl.abs(xv)
        elif X_MODE == 1:
            acc += f * x0[None, :]
        else:
            acc += f
    approx = tl.sum(acc, axis=1) * s
    live = rows < V
    if ATOMIC:
        bound = c1 * s * tl.sum(x_abs, axis=0) + 0.00390625 * tl.abs(approx)
        tl.store(up_ptr + rows, approx + bound, mask=live)
        tl.atomic_max(tau_ptr, tl.max(tl.where(live, approx - bound, float("-inf")), axis=0))
    else:
        tl.store(up_ptr + rows, approx, mask=live)


def variants_us(screen, xs) -> dict:
    """The int8 pass's time with one piece changed at a time (_approx_variant_kernel), the default
    plan's tiling: where its time over the read-only control goes."""
    V, K = screen.q.shape
    plan = screen.plan
    up, tau = torch.empty_like(screen.up), torch.full_like(screen.tau, float("-inf"))
    grid = (triton.cdiv(V, plan.rows),)
    out = {}
    for name, x_mode, atomic in (("as_kernel", 0, True), ("x_once", 1, True), ("no_x", 2, True),
                                 ("no_atomic_no_bound", 0, False), ("no_x_no_atomic", 2, False)):
        out[name] = graph_us(lambda x, x_mode=x_mode, atomic=atomic: _approx_variant_kernel[grid](
            x, screen.q, screen.s, up, tau, V, screen.c1, K=K, BLOCK_R=plan.rows, BLOCK_K=plan.block_k,
            X_MODE=x_mode, ATOMIC=atomic, num_warps=plan.warps, num_stages=plan.stages), xs)
    return out


def read_us(screen, xs) -> dict:
    """The control kernel's us over the int8 copy, at two tilings."""
    V, K = screen.q.shape
    words = screen.q.view(torch.int32)
    out = {}
    for rows, bw, warps in ((16, 128, 4), (32, 256, 8)):
        sink = torch.empty(triton.cdiv(V, rows), dtype=torch.int32, device=words.device)
        out[f"rows={rows},words={bw},warps={warps}"] = graph_us(
            lambda x, rows=rows, bw=bw, warps=warps, sink=sink: _read_kernel[(triton.cdiv(V, rows),)](
                words, sink, V, KW=K // 4, BLOCK_R=rows, BLOCK_W=bw, num_warps=warps), xs)
    return out


def collect_hidden(eng, prompt: int, steps: int, prompts: int) -> list:
    """The final norm's outputs [1, K] of eager decode steps after `prompts` random prompts."""
    model = eng.model
    eng._prepare(1, prompt + steps)       # caches, tune and the step's graph first: no spy in the capture
    seen = []
    screen = model.screen
    real = screen.argmax

    def spy(x, out=None):
        seen.append(x.clone())
        return real(x, out)

    screen.argmax = spy
    try:
        for p in range(prompts):
            ids = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(p))
            with torch.inference_mode():
                runner = DecodeRunner(model, 1, use_graph=False)
                runner.start(model.prefill(ids.cuda()), prompt)
                for _ in range(steps):
                    runner.step()
    finally:
        screen.argmax = real
    return seen


def picks(screen, w, xs) -> dict:
    bad, counts = [], []
    for i, x in enumerate(xs):
        got = int(screen.argmax(x)[0])
        full = int(am.argmax(gemv.linear(x, w))[0])
        if got != full:
            bad.append((i, got, full))
        counts.append(screen.candidates_for(x))
    counts.sort()
    return {"steps": len(xs), "mismatches": bad[:10], "mismatch_count": len(bad),
            "candidates": {"min": counts[0], "median": counts[len(counts) // 2],
                           "p90": counts[int(0.9 * (len(counts) - 1))], "max": counts[-1]}}


def graph_us(fn, xs) -> float:
    """Median us a call of fn(x) over a CUDA graph of one call per state in xs (fq_ops._time_over)."""
    return _time_over(fn, xs, 7)


def kernels(screen, w, xs, plans) -> dict:
    out = {"gemv_argmax": graph_us(lambda x: am.argmax(gemv.linear(x, w)), xs)}
    up, tau = torch.empty_like(screen.up), torch.full_like(screen.tau, float("-inf"))
    out["approx_only (default plan)"] = graph_us(lambda x: screen.approx(x, up, tau), xs)
    out["default plan"] = graph_us(lambda x: screen.argmax(x), xs)
    for text in plans:
        try:
            s = screen.with_plan(lm_screen.ScreenPlan.from_text(text))
            out[text] = graph_us(lambda x: s.argmax(x), xs)
        except Exception as exc:  # noqa: BLE001 - one plan failing is a result
            out[text] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def step_arms(eng, prompt: int, steps: int, rounds: int, screen) -> dict:
    model = eng.model
    eng._prepare(1, prompt + steps + 16)
    ids = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(11)).cuda()
    res = {"on": [], "off": []}
    toks = {}
    for r in range(rounds):
        for arm in (("off", "on") if r % 2 else ("on", "off")):
            model.screen = screen if arm == "on" else None
            t = [] if r == 0 else None
            with torch.inference_mode():
                res[arm].append(graphed_step_ms(model, ids, steps, tokens=t))
            if t is not None:
                toks[arm] = torch.stack(t).tolist()
    model.screen = screen
    return {"ms": {a: round(statistics.median(v), 4) for a, v in res.items()}, "rounds": res,
            "delta_us": round((statistics.median(res["on"]) - statistics.median(res["off"])) * 1e3, 1),
            "tokens_equal": toks.get("on") == toks.get("off")}


def generate_arms(eng, prompt: int, steps: int, rounds: int, screen) -> dict:
    model = eng.model
    out = {"on": [], "off": []}
    g = torch.Generator().manual_seed(5)
    for r in range(rounds * 2 + 2):
        arm = "on" if r % 2 == 0 else "off"
        model.screen = screen if arm == "on" else None
        eng._drop_graphs()                 # the step's graph captured again with this arm's tail
        prompts = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=g).tolist()
        for _ in eng.generate(prompts, steps):   # warm: capture, prefill graph
            pass
        prompts = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=g).tolist()
        t0 = time.perf_counter()
        stamps = [time.perf_counter() for _ in eng.generate(prompts, steps)]
        if r >= 2:
            out[arm].append({"ttft_ms": (stamps[0] - t0) * 1e3, "total_ms": (stamps[-1] - t0) * 1e3,
                             "tpot_ms": (stamps[-1] - stamps[0]) * 1e3 / (steps - 1)})
    model.screen = screen
    eng._drop_graphs()
    summary = {arm: {k: round(statistics.median(s[k] for s in v), 4) for k in ("ttft_ms", "tpot_ms", "total_ms")}
               for arm, v in out.items()}
    for arm in summary:
        summary[arm]["tok_per_s"] = round(steps / summary[arm]["total_ms"] * 1e3, 1)
    return {"median": summary, "samples": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plans", default=DEFAULT_PLANS)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels-only", action="store_true",
                    help="picks and the kernels' sweep only (no step or generate)")
    args = ap.parse_args()
    report = {"model": args.model, "commit": os.environ.get("FASTQWEN_COMMIT", "unknown"), "torch": torch.__version__}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    t0 = time.perf_counter()
    eng = fast_engine.Engine(args.model)
    model = eng.model
    report["describe"] = eng.describe()
    screen = model.screen
    if screen is None:
        report["error"] = "no screen on this model (FASTQWEN_LM_SCREEN=0, or unsupported)"
        save()
        return
    w = screen.w
    report["head"] = {"shape": list(w.shape), "gemv_config": str(screen.config), "plan": str(screen.plan),
                      "int8_bytes": screen.nbytes(), "load_s": round(time.perf_counter() - t0, 1)}
    xs = collect_hidden(eng, args.prompt, args.steps, prompts=3)
    report["picks"] = picks(screen, w, xs)
    print("picks", report["picks"], flush=True)
    save()
    plans = [p for p in args.plans.split(";") if p]
    report["kernels_us"] = kernels(screen, w, xs, plans)
    try:
        report["read_only_us"] = read_us(screen, xs)
    except Exception as exc:  # noqa: BLE001 - the control failing is a result
        report["read_only_us"] = f"{type(exc).__name__}: {exc}"[:300]
    print("read_only_us", report["read_only_us"], flush=True)
    try:
        report["approx_variants_us"] = variants_us(screen, xs)
    except Exception as exc:  # noqa: BLE001 - the variants failing is a result
        report["approx_variants_us"] = f"{type(exc).__name__}: {exc}"[:300]
    print("approx_variants_us", report["approx_variants_us"], flush=True)
    print("kernels_us", report["kernels_us"], flush=True)
    timed = {k: v for k, v in report["kernels_us"].items() if "=" in k and isinstance(v, float)}
    best = min(timed, key=timed.get) if timed else None
    report["best_plan"] = best
    if best is not None:
        screen = screen.with_plan(lm_screen.ScreenPlan.from_text(best))
        model.screen = screen
        report["picks_best_plan"] = picks(screen, w, xs[:24])
    save()
    if args.kernels_only:
        return
    report["step"] = step_arms(eng, args.prompt, args.steps, args.rounds, screen)
    print("step", {k: v for k, v in report["step"].items() if k != "rounds"}, flush=True)
    save()
    report["generate"] = generate_arms(eng, args.prompt, args.steps, args.rounds, screen)
    print("generate", report["generate"]["median"], flush=True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    save()


if __name__ == "__main__":
    main()
