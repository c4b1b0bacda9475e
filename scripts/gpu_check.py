"""Engine checks on a GPU that the CPU machine cannot make, in one process:

1. fidelity: per-step logits of the engine vs native's full forward on the
   same sequence, next to native's own cached-decode logits vs that same
   reference (max and p99.9 of the per-position max |diff|), plus the margin
   slack of every emitted token;
2. graph vs eager: the CUDA-graph decode and the eager decode give identical tokens;
3. speed: TTFT/TPOT of `generate` as the host sees it, and the pure GPU time of
   one graphed decode step, next to the bandwidth floor.

4. with --early-arms R: the graphed step's time with the attention's early reads off and on
   (fqkernels.pdl.EARLY), interleaved over R rounds, each from its own prompt pass, and whether
   both arms' greedy tokens agree.

Usage: python scripts/gpu_check.py --model DIR [--out FILE] [--shapes 1x512x64,4x2048x32] [--early-arms 3]
"""
import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))

import engine as fast_engine  # noqa: E402


def _pct(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x.float().flatten(), q)) if x.numel() else float("nan")


def engine_logits(eng, prompts: torch.Tensor, steps: int):
    """The engine's own tokens and BF16 logits per step, eagerly (same kernels as the graph)."""
    model = eng.model
    B, S = prompts.shape
    runner = eng._prepare(B, S + steps - 1)
    with torch.inference_mode():
        logits = [model.prefill_logits(prompts.cuda())]
        tok = torch.argmax(logits[0], -1)
        pos = torch.full((B,), S, dtype=torch.int32, device="cuda")
        for _ in range(steps - 1):
            lg = model.decode_logits(tok, pos, pos + 1)
            logits.append(lg)
            tok = torch.argmax(lg, -1)
            pos += 1
    toks = torch.stack([torch.argmax(lg, -1) for lg in logits], 1)  # [B, N]
    del runner
    return toks, torch.stack(logits, 1)  # [B, N, V]


def native_logits(model, prompts: torch.Tensor, toks: torch.Tensor):
    """Reference: one full forward; and native's cached decode teacher-forced on the same tokens."""
    B, S = prompts.shape
    N = toks.shape[1]
    seq = torch.cat([prompts.cuda(), toks], 1)
    with torch.inference_mode():
        full = model(input_ids=seq, logits_to_keep=N + 1).logits[:, :-1]  # predicts toks[:, 0..N-1]
        out = model(input_ids=prompts.cuda(), use_cache=True)
        cache, cached = out.past_key_values, [out.logits[:, -1]]
        for t in range(N - 1):
            out = model(input_ids=toks[:, t:t + 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            cached.append(out.logits[:, -1])
    return full, torch.stack(cached, 1)


def fidelity(eng, native, shape, seed):
    B, S, N = shape
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, eng.cfg.vocab_size, (B, S), generator=g)
    toks, ours = engine_logits(eng, prompts, N)
    full, cached = native_logits(native, prompts, toks)
    d_ours = (ours.float() - full.float()).abs().amax(-1)      # [B, N]
    d_native = (cached.float() - full.float()).abs().amax(-1)
    fullf = full.float()
    slack = fullf.amax(-1) - fullf.gather(-1, toks[..., None])[..., 0]
    native_tok = cached.argmax(-1)
    # graph path must reproduce the eager tokens exactly
    graph_toks = torch.tensor(list(eng.generate(prompts.tolist(), N))).T.cuda()
    return {
        "shape": list(shape),
        "engine_vs_full": {"max": float(d_ours.max()), "p999": _pct(d_ours, 0.999), "mean": float(d_ours.mean())},
        "native_cached_vs_full": {"max": float(d_native.max()), "p999": _pct(d_native, 0.999), "mean": float(d_native.mean())},
        "slack": {"max": float(slack.max()), "count_gt_0": int((slack > 0).sum()), "count_gt_0.75": int((slack > 0.75).sum()),
                  "violations_gt_2": int((slack > 2.0).sum()), "positions": int(slack.numel())},
        "tokens_equal_native_cached_greedy_first_step": bool(torch.equal(toks[:, 0], native_tok[:, 0])),
        "graph_equals_eager_tokens": bool(torch.equal(graph_toks, toks)),
    }


def runner_step_ms(runner, steps: int, warmup: int = 0) -> float:
    """Device milliseconds a step of `runner` (fq_decode.DecodeRunner) over `steps` steps run back to
    back (CUDA events), after `warmup` untimed ones."""
    for _ in range(warmup):
        runner.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def graphed_step_ms(model, ids, steps: int, tokens: list | None = None, use_graph: bool = True) -> float:
    """Milliseconds a step of the graphed decode (a fresh DecodeRunner, captured) after a prompt pass
    over ids (3 steps' warm-up), wall time over `steps` steps back to back; with `tokens`, the greedy
    tokens of 4 more steps after the timed ones appended to it (each step's tokens are the next one's
    inputs: a difference at any step carries on). use_graph=False: eager (a CPU dry run)."""
    from fq_decode import DecodeRunner

    b, p = ids.shape
    runner = DecodeRunner(model, b, use_graph=use_graph)
    runner.start(model.prefill(ids), p)
    for _ in range(3):
        runner.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    for _ in range(4 if tokens is not None else 0):
        runner.step()
        tokens.append(runner.tokens.clone())
    return ms


def speed(eng, shape, reps=3):
    B, S, N = shape
    g = torch.Generator().manual_seed(7)
    res = []
    for r in range(reps + 1):
        prompts = torch.randint(0, eng.cfg.vocab_size, (B, S), generator=g).tolist()
        t0 = time.perf_counter()
        stamps = [time.perf_counter() for _ in eng.generate(prompts, N)]
        if r:
            ttft = stamps[0] - t0
            res.append((ttft, (stamps[-1] - stamps[0]) / (N - 1), stamps[-1] - t0))
    res.sort(key=lambda x: x[2])
    ttft, tpot, total = res[len(res) // 2]
    # pure GPU time of one graphed step, replayed back to back
    runner = eng._runner
    steps = 50
    with torch.inference_mode():
        runner.start(torch.zeros(B, dtype=torch.int64, device="cuda"), S)
        step_ms = runner_step_ms(runner, steps)
    w_bytes = eng.model.w.nbytes()
    kv_bytes = B * (S + steps // 2) * eng.cfg.kv_bytes_per_token
    return {"shape": list(shape), "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "total_ms": total * 1e3,
            "tok_per_s": B * N / total, "graph_step_ms": step_ms,
            "graph_step_GBps": (w_bytes + kv_bytes) / (step_ms * 1e-3) / 1e9}


def early_arms(eng, shape, rounds: int, steps: int = 50) -> dict:
    """The graphed decode step's milliseconds with pdl.EARLY off and on at this batch (whatever
    pdl.EARLY_MAX_ROWS says; graphed_step_ms: a fresh
    runner and capture per arm and round, after its own prompt pass over the same prompts),
    interleaved; the greedy tokens of 4 steps after the timed ones (first round) compared."""
    from fqkernels import pdl

    B, S, _ = shape
    model = eng.model
    eng._prepare(B, S + steps + 8)
    ids = torch.randint(0, eng.cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(11)).to(eng.device)
    saved = pdl.EARLY, pdl.EARLY_MAX_ROWS
    pdl.EARLY_MAX_ROWS = max(B, saved[1])
    times: dict = {"off": [], "on": []}
    toks: dict = {}
    try:
        for r in range(rounds):
            for arm in ("off", "on"):
                pdl.EARLY = arm == "on"
                seen = [] if r == 0 else None
                with torch.inference_mode():
                    times[arm].append(round(graphed_step_ms(model, ids, steps, seen, eng.use_graphs), 4))
                if seen is not None:
                    toks[arm] = torch.stack(seen).cpu()
    finally:
        pdl.EARLY, pdl.EARLY_MAX_ROWS = saved
        eng._drop_graphs()     # the engine's own runner is captured again on its next use
    med = {a: sorted(t)[len(t) // 2] for a, t in times.items()}
    return {"shape": list(shape), "ms": times, "median_ms": med, "on_minus_off_us": round((med["on"] - med["off"]) * 1e3, 1),
            "tokens_equal": bool(torch.equal(toks["off"], toks["on"]))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    ap.add_argument("--fidelity", default="1x512x64,4x2048x32,16x512x64")
    ap.add_argument("--speed", default="1x512x64,1x2048x64,4x2048x32,16x512x128,4x1024x128")
    ap.add_argument("--early-arms", type=int, default=0, help="rounds of the early-reads A/B at each --speed shape")
    args = ap.parse_args()
    parse = lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",") if x]  # noqa: E731
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    from fqkernels import pdl
    report["pdl"] = pdl.ENABLED
    t0 = time.perf_counter()
    eng = fast_engine.Engine(args.model)
    report["load_s"] = time.perf_counter() - t0
    report["weights_GB"] = eng.model.w.nbytes() / 1e9
    report["speed"] = []
    for shape in parse(args.speed):
        t0 = time.perf_counter()
        r = speed(eng, shape)
        r["wall_s"] = time.perf_counter() - t0
        report["speed"].append(r)
        print(json.dumps(r), flush=True)
        if args.early_arms:
            a = early_arms(eng, shape, args.early_arms)
            report.setdefault("early_arms", []).append(a)
            print(json.dumps(a), flush=True)
    report["fidelity"] = []
    if parse(args.fidelity):
        from transformers import Qwen3ForCausalLM

        from fastqwen.numerics import pin_reference_numerics
        pin_reference_numerics()  # the platform's reference: flash attention, not cuDNN's
        native = Qwen3ForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                  attn_implementation="sdpa").cuda().eval()
    for i, shape in enumerate(parse(args.fidelity)):
        r = fidelity(eng, native, shape, seed=100 + i)
        report["fidelity"].append(r)
        print(json.dumps(r), flush=True)
    report["gemv_tuning"] = {str(k): v for k, v in eng.tuning.items()}
    report["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
