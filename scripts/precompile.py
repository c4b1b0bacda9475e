"""Fill Triton's cache with the kernels a `fastqwen serve` start launches, compiled in parallel,
before the server starts: a start on an empty cache otherwise compiles them one after another
(Qwen3.5-4B: ~140 s of its 152 s to ready on the H200, docs/SERVING.md).

How: the server's start is run over meta tensors that say "cuda" (scripts/compile_kernels.py's
capture: nothing is allocated or launched, no GPU is needed): the model at the checkpoint's
config, the slots of the server's settings, each bucket's step (and verifies) with our GEMV and
with cuBLAS for the decode products (the start's tuning picks per product; both are compiled),
and the slots' warm prompt passes. Every launch's specialization is recorded as Triton's own
launch path computes it, then compiled for the target into the cache (TRITON_CACHE_DIR or
--cache-dir) in worker processes, the longest kernels' first (on Triton 3.6, 16 threads on a GPU
machine summed 4.4x the compile time 2 threads do on a 2-core one, most likely waiting on the
compiler's Python front end: docs/SERVING.md). A launch the capture did not foresee compiles at the
start as before.

Usage:
    python scripts/precompile.py --model DIR [--max-batch 16] [--max-model-len 4096] [--block-size 0]
        [--speculation off|ngram|auto] [--speculative-tokens 4] [--target sm_90] [--jobs N]
        [--cache-dir DIR] [--capture-only] [--json PATH]
DIR is a checkpoint folder (its config.json is read; its weights are not). Exit status 0 when
every captured specialization compiled, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import compile_kernels as ck  # noqa: E402  (its capture machinery; it puts engine/ on the path)


def meta_model(model_dir: pathlib.Path, verifies: bool = False):
    """The engine's model for the checkpoint's config over meta weights (the file's tensors are not read)."""
    import fq_config
    import fq_ops
    import fq_qwen3
    import fq_qwen35
    import fq_weights

    cfg = fq_config.config_for(str(model_dir))
    ops = fq_ops.ops_for("triton", ck.CUDA, True)
    real = fq_weights.safe_open
    with tempfile.TemporaryDirectory(prefix="fq_precompile_") as tmp:
        folder = pathlib.Path(tmp)
        raw = json.loads((model_dir / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(raw))
        (folder / "model.safetensors").touch()
        if isinstance(cfg, fq_config.Qwen35Config):
            from fastqwen.checkpoint import expected_tensors

            fq_weights.safe_open = ck._MetaCheckpoint(dict(expected_tensors(raw)))
            try:
                weights = fq_weights.load_qwen35_weights(str(folder), cfg, ck.CUDA)
            finally:
                fq_weights.safe_open = real
            return fq_qwen35.Qwen35Model(cfg, weights, ck.CUDA, ops, exact_decode=True, verifies=verifies)
        fq_weights.safe_open = ck._MetaCheckpoint(fq_weights.expected_shapes(cfg))
        try:
            weights = fq_weights.load_weights(str(folder), cfg, ck.CUDA)
        finally:
            fq_weights.safe_open = real
        return fq_qwen3.Qwen3Model(cfg, weights, ck.CUDA, ops)


def capture_server_start(model_dir: pathlib.Path, max_batch: int, max_len: int, block_size: int | None,
                         speculation: str, k: int, target, pdl: bool, through: bool = False) -> tuple[list, list, list]:
    """The specializations a server start launches (see the module doc), the problems met and the
    scenarios run (a scenario names only the specializations it launched first);
    through: each launch goes on through Triton's own cache lookup and compile (ck.recording)."""
    import fq_slots
    import fq_spec

    recorder, problems, ran = ck.Recorder(), [], []
    with ck.MetaAsCuda(), ck.norm_orders_measured(), torch.inference_mode(), ck.pdl_forced(pdl):
        # as the engine builds it: a Qwen3.5 server that verifies every step ("ngram") runs one
        # sequence's products on the tensor cores
        model = meta_model(model_dir, verifies=fq_spec.parse_speculation(speculation).every_step)
        recorder.pdl = pdl
        widths = fq_spec.verify_widths(k) if speculation == "auto" else None
        slots = fq_slots.Slots(model, ck.CUDA, max_batch, max_len, use_graphs=False, page_size=block_size,
                               speculative_tokens=k if speculation != "off" else 0, verify_widths=widths)
        with ck.recording(recorder, target, through):
            for gemv in (True, False):
                model.ops.use_gemv = ck._GemvChoice(gemv, model.ops.GEMV_MAX_ROWS)
                for rows, step in slots._steps.items():
                    steps = [("step", step)] + [(f"verify {w}", slots._verifies[rows, w]) for w in slots.widths]
                    for name, one in steps:
                        recorder.scenario = f"bucket {rows} {name} ({'gemv' if gemv else 'cublas'})"
                        ran.append(recorder.scenario)
                        try:
                            one._step()
                        except Exception as exc:  # noqa: BLE001 - a finding, reported
                            problems.append(f"{recorder.scenario}: {type(exc).__name__}: {exc}")
            recorder.scenario = "warm prompt passes"
            ran.append(recorder.scenario)
            try:
                slots.warm()
            except Exception as exc:  # noqa: BLE001
                problems.append(f"warm: {type(exc).__name__}: {exc}")
    return list(recorder.specs.values()), problems, ran


def precompile_stamp(model_dir: pathlib.Path, args, cache: pathlib.Path, target) -> pathlib.Path:
    """Where the server looks for this precompile's stamp (fastqwen/serve/precompile.py): the
    settings resolved as the server resolves its own."""
    from fastqwen.serve import precompile

    resolved = precompile.settings(str(model_dir), args.max_batch, args.max_model_len, args.block_size or None,
                                   args.speculation, args.speculative_tokens)
    return precompile.stamp_path(cache, str(model_dir), resolved, triton.__version__, target.arch)


def longest_first(specs: list) -> list:
    """The specs in the order to compile them: the longest kernel sources first (the exact GDN step's
    take 10-18 s each, most others under a second), so no long one starts last."""
    return sorted(specs, key=lambda s: -len(getattr(s.kernel, "src", "")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (its config.json)")
    p.add_argument("--max-batch", type=int, default=16, help="the server's (default 16)")
    p.add_argument("--max-model-len", type=int, default=4096, help="the server's (default 4096)")
    p.add_argument("--block-size", type=int, default=0, help="the server's (default 0: rows, no pages)")
    p.add_argument("--speculation", default="off", choices=["off", "ngram", "auto"], help="the server's (default off)")
    p.add_argument("--speculative-tokens", type=int, default=4, help="the server's (default 4)")
    p.add_argument("--target", default=None, help="e.g. sm_90 (default: this machine's GPU, else sm_90)")
    p.add_argument("--jobs", type=int, default=0, help="compile processes (default: one per CPU)")
    p.add_argument("--cache-dir", default=None, help="default: TRITON_CACHE_DIR, else ~/.triton/cache")
    p.add_argument("--capture-only", action="store_true", help="record the specializations, compile nothing")
    p.add_argument("--json", default=None, help="write what was captured and compiled here")
    p.add_argument("--check", action="store_true",
                   help="after compiling, run the capture again through Triton's own launch path (its cache "
                   "lookup and compile) and count the cache files that adds: 0 when every key matched")
    args = p.parse_args(argv)
    model_dir = pathlib.Path(args.model)
    if not (model_dir / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    if args.target:
        target = ck.parse_target(args.target)
    elif torch.cuda.is_available():
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
    else:
        target = ck.parse_target("sm_90")
    from triton.backends.nvidia.compiler import CUDAOptions

    pdl = "launch_pdl" in CUDAOptions.__dataclass_fields__        # as fqkernels.pdl decides on a GPU
    began = time.perf_counter()
    specs, problems, scenarios = capture_server_start(model_dir, args.max_batch, args.max_model_len,
                                                      args.block_size or None, args.speculation,
                                                      args.speculative_tokens, target, pdl)
    captured = time.perf_counter() - began
    print(f"captured {len(specs)} specializations of {len({s.kernel for s in specs})} kernels in {captured:.1f} s"
          + (f"; {len(problems)} problem(s):" if problems else ""), flush=True)
    for line in problems:
        print("  " + line)
    compile_s = 0.0
    if not args.capture_only:
        from fastqwen.serve.precompile import cache_dir as triton_cache_dir

        cache_dir = args.cache_dir or str(triton_cache_dir())
        jobs = args.jobs or os.cpu_count() or 1
        t0 = time.perf_counter()
        ck.compile_all(longest_first(specs), target, jobs, cache_dir, progress=print)
        compile_s = time.perf_counter() - t0
        failed = [s for s in specs if not s.ok]
        print(f"compiled {len(specs) - len(failed)}/{len(specs)} into {cache_dir} in {compile_s:.1f} s wall "
              f"({sum(s.seconds for s in specs):.1f} s of compiles, {jobs} processes)")
        if not failed and not problems:
            stamp = precompile_stamp(model_dir, args, pathlib.Path(cache_dir), target)
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(json.dumps({"triton": triton.__version__, "target": str(target), "specializations": len(specs),
                                         "settings": sys.argv[1:] if argv is None else list(argv)}, indent=1))
            print(f"stamp {stamp}: a server start of these settings skips its precompile")
        if args.check:
            def files():
                return sum(1 for p in pathlib.Path(cache_dir).rglob("*") if p.is_file())

            before = files()
            os.environ["TRITON_CACHE_DIR"] = cache_dir
            _, again, _ = capture_server_start(model_dir, args.max_batch, args.max_model_len,
                                               args.block_size or None, args.speculation,
                                               args.speculative_tokens, target, pdl, through=True)
            added = files() - before
            problems += [f"check: {line}" for line in again]
            print(f"check: Triton's own launch path added {added} cache file(s)")
            if added:
                problems.append(f"check: Triton's own launch path added {added} cache file(s): a key differs")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "triton": triton.__version__, "target": str(target), "capture_s": captured, "compile_wall_s": compile_s,
            "problems": problems, "scenarios": scenarios,
            "specs": [{"kernel": s.name, "scenario": s.scenario, "ok": s.ok, "seconds": s.seconds} for s in specs]},
            indent=1))
    return 0 if not problems and all(s.ok for s in specs if s.ok is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
