"""Where a chunked prompt's time goes in the engine (no server): on Qwen3-4B's slots, the
wall time of a whole 512-token admit, of begin + prefill_next(256) x 2, of one chunk's
prompt pass alone (prefill_logits at start 0 and 256), and of a decode step with 8 rows
running, each synchronized and repeated; a torch profile of one continued chunk.

    python scripts/gpu_chunk_probe.py --model DIR [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "engine"))
from engine import Engine  # noqa: E402


def _ms(fn, reps: int = 5) -> list:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(round((time.perf_counter() - t0) * 1e3, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "chunk_probe.json"))
    args = ap.parse_args()
    eng = Engine(args.model)
    slots = eng.slots(max_slots=16, max_len=1024)
    model = slots.model
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    prompt = lambda: torch.randint(0, vocab, (512,), generator=gen).tolist()  # noqa: E731
    report: dict = {}
    keys = iter(range(10 ** 6))

    def whole():
        k = next(keys)
        slots.admit(k, prompt())
        slots.retire(k)

    def chunked():
        k = next(keys)
        slots.begin(k, prompt())
        slots.prefill_next(256)
        slots.prefill_next(256)
        slots.retire(k)

    report["admit_512_ms"] = _ms(whole)
    report["begin_chunks_2x256_ms"] = _ms(chunked)
    ids = torch.randint(0, vocab, (1, 256), generator=gen).to(eng.device)
    with torch.inference_mode():
        report["prefill_logits_256_start0_ms"] = _ms(lambda: model.prefill_logits(ids, row=slots.staging, start=0))
        report["prefill_logits_256_start256_ms"] = _ms(lambda: model.prefill_logits(ids, row=slots.staging, start=256))
    running = [next(keys) for _ in range(8)]
    for k in running:
        slots.admit(k, prompt())
    toks = torch.zeros(8, dtype=torch.int64, device=eng.device)
    report["step_8_rows_ms"] = _ms(lambda: slots.step_rows(toks), reps=10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.inference_mode():
            model.prefill_logits(ids, row=slots.staging, start=256)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:15]
    report["profile_continued_chunk_top_cpu"] = [
        {"name": e.key[:80], "cpu_ms": round(e.cpu_time_total / 1e3, 2), "cuda_ms": round(e.device_time_total / 1e3, 2)
         if hasattr(e, "device_time_total") else None, "calls": e.count} for e in rows]
    for k, v in report.items():
        print(k, json.dumps(v)[:600])
    json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
