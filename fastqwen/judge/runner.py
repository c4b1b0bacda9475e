"""The trusted parent: runs every workload on the engine and on native, replays, gates and scores.

Per workload, as the platform does: a fresh process per side; all load and warm up (load plus
warmup within the load budget); prompts drawn only after loading, never reused; samples alternate
which side goes first (see `sample_order`); every process is ended and waited for before the
replay process checks every emitted sequence. A broken engine never stops the run: its code is
recorded and the next workload starts.

An optional third side, the baseline (`--baseline DIR`: say an earlier commit's engine folder),
gets its own fresh process, the same prompts and its turn in the rotation, and is replayed like the
others, so "as fast as the previous version" is measured in one run, under one machine's
conditions. It is never gated: its figures and the engine/baseline ratios are reported, nothing more.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fastqwen import refenv
from fastqwen.errors import UserError
from fastqwen.judge import fidelity, gates, roofline
from fastqwen.judge.process import ChildFailure, EngineProcess, Generation
from fastqwen.judge.prompts import PromptSource
from fastqwen.judge.workloads import Workload, WorkloadSet

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the fastqwen package
NATIVE_ENGINE_DIR = Path(__file__).resolve().parents[1] / "native_engine"
PROBE_TIMEOUT_S = 300.0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class JudgeSettings:
    engine_dir: Path
    model_dir: Path
    model_config: dict
    workloads: WorkloadSet
    official: bool
    samples: int
    device: str = "auto"  # auto | cpu | cuda
    load_timeout_s: float = 300.0
    sample_timeout_s: float = 300.0
    memory_limit_gib: float | None = None
    native: bool = True
    native_dir: Path = NATIVE_ENGINE_DIR
    baseline_dir: Path | None = None  # a third, never-gated side (an earlier version of the engine)
    seed: int = 0
    log_dir: Path | None = None  # engine logs; a fresh temporary folder when None
    replay_timeout_s: float = 1800.0
    measure_ceilings: bool = True
    progress: Callable[[str], None] = field(default=_stderr)


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    # The engine's prints should reach its log as they happen, not at exit.
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Two engine processes stay resident per workload; with several OpenMP threads each, the
        # idle one's spinning threads and any other load on a small machine multiply step times
        # by 10-50x and make the timing gates meaningless. One thread each keeps CPU runs steady
        # (an explicit OMP_NUM_THREADS from the caller wins).
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def probe_device(device: str, measure: bool, env: dict[str, str]) -> dict:
    """Device facts, library versions and ceilings, from a short process of their own."""
    argv = [sys.executable, "-m", "fastqwen.judge.probe", "--device", device] + ([] if measure else ["--no-measure"])
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"device probe failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    info = json.loads(proc.stdout)
    if "error" in info:
        raise UserError(info["error"])
    return info


def git_commit(repo: Path) -> dict | None:
    """The repo's commit; where the tree is a copy without .git (a GPU machine
    gets one), the commit recorded in FASTQWEN_COMMIT by whoever copied it."""
    if os.environ.get("FASTQWEN_COMMIT"):
        return {"commit": os.environ["FASTQWEN_COMMIT"], "dirty": None, "source": "FASTQWEN_COMMIT"}
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def engine_switches(environ) -> dict[str, str]:
    """The FASTQWEN_* switches the engines inherit (FASTQWEN_NO_PDL, ...), for the report:
    a figure measured with an optimization switched off must say so."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith("FASTQWEN_") and k != "FASTQWEN_COMMIT"}


# ------------------------------------------------------------------------------------------------
# who goes first
# ------------------------------------------------------------------------------------------------
POSITION_WORDS = ("first", "second", "third")


def sample_order(labels: list[str], i: int) -> list[str]:
    """The order in which the sides run sample i; `labels` is [engine, native?, baseline?].

    Whoever runs first pays for a cold cache and a clock that has not ramped up, so the order rotates.
    Two sides (the platform's case): the engine first when i is even, the other side otherwise.
    Three sides (engine, native, baseline): the engine and native keep exactly that relation (engine
    before native when i is even), and the baseline takes position (i + 1) mod 3 among them:
    E B N, N E B, B E N, N B E, E N B, B N E, then again. Every side goes first once in each
    block of three samples (sample 0 engine, 1 native, 2 baseline, ...) and holds each position
    twice in six; a one-sample run times the engine first, as before.
    """
    if len(labels) == 1:
        return list(labels)
    pair = list(labels[:2]) if i % 2 == 0 else [labels[1], labels[0]]
    if len(labels) == 2:
        return pair
    if len(labels) == 3:
        pair.insert((i + 1) % 3, labels[2])
        return pair
    raise ValueError(f"sample_order handles 1 to 3 sides, got {len(labels)}: {labels}")


# ------------------------------------------------------------------------------------------------
# one side of one workload
# ------------------------------------------------------------------------------------------------
def _described(info: dict | None) -> str:
    """' (family qwen3.5, backend triton, ...)' from an engine's describe(), or ''."""
    return f" ({', '.join(f'{k} {v}' for k, v in info.items())})" if info else ""


class Side:
    """One engine folder's process and everything measured on it for one workload."""

    def __init__(self, label: str, engine_dir: Path, settings: JudgeSettings, env: dict[str, str], log_path: Path):
        self.label = label
        self.engine_dir = engine_dir
        self.process = EngineProcess(label, engine_dir, settings.model_dir, env, log_path)
        self.failure: ChildFailure | None = None
        self.load_s: float | None = None
        self.warmup_s: float | None = None
        self.samples: list[dict] = []
        self.figures: list[gates.SampleFigures] = []
        self.sequences: list[tuple[int, int, list[int], list[int]]] = []  # sample, seq, prompt, emitted
        self.pending: list[dict] = []
        self.exit_code: int | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def fail(self, failure: ChildFailure) -> None:
        self.failure = failure

    def record_pending(self, gen: Generation, tag: str) -> None:
        pending = gen.done.get("pending")
        if pending is not None:
            self.pending.append({"generation": tag, **pending})

    def to_json(self, device: str, memory_limit: int | None) -> dict:
        return {
            "dir": str(self.engine_dir),
            "loaded": self.load_s is not None,
            "load_s": self.load_s,
            "describe": self.process.describe,
            "warmup_s": self.warmup_s,
            "summary": gates.summarize(self.figures).to_json(),
            "samples": self.samples,
            "memory": self.process.memory,
            "memory_gated_bytes": gated_memory(self.process.memory, device),
            "memory_limit_bytes": memory_limit,
            "pending_gpu": self.pending,
            "speculation": speculation_summary(self.samples),
            "failure": None if self.ok else {"code": self.failure.code, "detail": self.failure.detail},
            "exit_code": self.exit_code,
            "log": str(self.process.log_path),
            "log_tail": self.process.log_tail(),
        }


def speculation_summary(samples: list[dict]) -> dict | None:
    """The timed samples' speculation figures summed: drafted and accepted tokens, verify passes,
    plain steps, emitted tokens, verifies per width, and the acceptance and tokens per verify row they give; the
    device's milliseconds per draft, verify and plain step as the first sample reported them
    (measured once per shape); None where the engine reported none."""
    stats = [s["speculation"] for s in samples if s.get("speculation")]
    if not stats:
        return None
    keys = ("drafted", "accepted", "verify_steps", "plain_steps", "verified_rows", "emitted")
    total = {k: sum(st.get(k) or 0 for st in stats) for k in keys}
    total["mode"], total["k"] = stats[0].get("mode"), stats[0].get("k")
    widths = {}                     # verifies of each width (drafts a verify; "auto" chooses it)
    for st in stats:
        got = st.get("width_steps")
        for w, n in (got.items() if isinstance(got, dict) else ()):
            widths[str(w)] = widths.get(str(w), 0) + n
    total["width_steps"] = widths
    for cost in ("draft_ms", "verify_ms", "plain_ms"):
        total[cost] = stats[0].get(cost)
    total["acceptance"] = total["accepted"] / total["drafted"] if total["drafted"] else None
    total["tokens_per_verify"] = total["emitted"] / total["verified_rows"] if total["verified_rows"] else None
    return total


def gated_memory(snapshot: dict, device: str) -> int | None:
    """The figure the memory gate reads: torch's reserved peak on CUDA, peak RSS on the CPU."""
    if device == "cuda":
        return snapshot.get("cuda_max_reserved_bytes")
    return snapshot.get("cpu_peak_rss_bytes")


def memory_limit_bytes(settings: JudgeSettings, probe: dict) -> tuple[int | None, str]:
    if settings.memory_limit_gib is not None:
        return int(settings.memory_limit_gib * 2**30), f"--memory-limit-gib {settings.memory_limit_gib:g}"
    if probe["device"] == "cuda" and probe.get("device_memory_bytes"):
        return int(0.9 * probe["device_memory_bytes"]), "90% of the device memory (torch.cuda.max_memory_reserved)"
    return None, "not gated: CPU run without --memory-limit-gib (peak RSS is reported only)"


def _sample_line(label: str, fig: gates.SampleFigures) -> str:
    tpot = f"{fig.tpot_s * 1e3:.2f}" if fig.tpot_s is not None else "-"
    return f"{label}: TTFT {fig.ttft_s * 1e3:.2f} ms, TPOT {tpot} ms, total {fig.total_s * 1e3:.1f} ms, " \
           f"{fig.throughput:.1f} tok/s"


def _emitted_sequences(gen: Generation) -> list[list[int]]:
    return [list(column) for column in zip(*gen.steps)]


def run_replay(settings: JudgeSettings, device: str, sides: list[Side], work_dir: Path, env: dict[str, str]
               ) -> tuple[dict | None, str | None]:
    """Replay every sampled sequence of every side in a fresh process; (result, error)."""
    items = [
        {"side": side.label, "sample": sample, "sequence": seq, "prompt": prompt, "emitted": emitted}
        for side in sides for (sample, seq, prompt, emitted) in side.sequences
    ]
    if not items:
        return None, None
    request = work_dir / "replay_request.json"
    result_path = work_dir / "replay_result.json"
    request.write_text(json.dumps({"model": str(settings.model_dir), "items": items}))
    argv = [sys.executable, "-m", "fastqwen.judge.replay", "--input", str(request), "--output", str(result_path),
            "--device", device]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=settings.replay_timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"replay did not finish within {settings.replay_timeout_s:.0f} s"
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        return None, f"replay process failed (exit {proc.returncode}):\n{tail}"
    return json.loads(result_path.read_text()), None


def agreement(engine: Side, other: Side) -> dict | None:
    """How often the engine emitted exactly the other side's tokens for the same prompts (a diagnostic)."""
    theirs = {(s, q): emitted for (s, q, _, emitted) in other.sequences}
    pairs = [(emitted, theirs[(s, q)]) for (s, q, _, emitted) in engine.sequences if (s, q) in theirs]
    if not pairs:
        return None
    identical = sum(a == b for a, b in pairs)
    first_diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
    diverged = [d for d in first_diffs if d is not None]
    return {"sequences": len(pairs), "identical": identical,
            "earliest_divergence_step": min(diverged) if diverged else None}


def speed_ratios(engine: gates.SideSummary, other: gates.SideSummary) -> dict:
    """engine / other for the median TTFT, TPOT (below 1: the engine is faster) and throughput
    (above 1: the engine is faster); None where either figure is missing."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {"ttft": ratio(engine.ttft_s, other.ttft_s), "tpot": ratio(engine.tpot_s, other.tpot_s),
            "throughput": ratio(engine.throughput, other.throughput)}


def baseline_summary(results: list[dict], baseline_dir: Path) -> dict:
    """The run-level engine/baseline comparison: each ratio's geometric mean over the workloads.

    A geometric mean needs every workload (as the score does): a workload whose baseline failed,
    or a one-step output with no TPOT, leaves that mean None rather than quietly narrowing it.
    """
    geo = {}
    for key in ("ttft", "tpot", "throughput"):
        values = [(r.get("ratios_vs_baseline") or {}).get(key) for r in results]
        geo[key] = gates.geomean(values) if all(v is not None for v in values) else None
    return {"dir": str(baseline_dir), "gated": False, "ratios_geomean": geo,
            "throughput_geomean": gates.geomean([r["baseline"]["summary"]["throughput"] for r in results])}


def run_workload(settings: JudgeSettings, wl: Workload, index: int, source: PromptSource, probe: dict,
                 env: dict[str, str], log_dir: Path, shape: roofline.ModelShape, memory_limit: int | None) -> dict:
    say = settings.progress
    tag = f"[{index + 1}/{len(settings.workloads.workloads)} {wl.name}]"
    device = probe["device"]
    vocab = shape.vocab
    wall_start = time.perf_counter()
    labels = [("engine", settings.engine_dir)] + ([("native", settings.native_dir)] if settings.native else []) \
        + ([("baseline", settings.baseline_dir)] if settings.baseline_dir is not None else [])
    say(f"{tag} batch {wl.batch}, prompt {wl.prompt}, output {wl.output}: loading "
        + ", ".join(label for label, _ in labels))
    ref_env = refenv.reference_env(settings.model_config.get("model_type", "qwen3"), env)
    sides = [Side(label, path, settings, ref_env if label == "native" else env,
                  log_dir / f"{index:02d}-{wl.name}-{label}.log") for label, path in labels]
    by_label = {s.label: s for s in sides}

    # All processes load at once; each has its own load + warmup budget from its own start.
    for side in sides:
        deadline = side.process.started + settings.load_timeout_s
        try:
            side.process.wait_loaded(deadline, settings.load_timeout_s)
            side.load_s = side.process.loaded_t - side.process.started
        except ChildFailure as failure:
            side.fail(failure)
    say(f"{tag} loaded: " + ", ".join(
        (f"{s.label} {s.load_s:.1f} s" + _described(s.process.describe)) if s.ok
        else f"{s.label} FAILED ({s.failure.code})" for s in sides))

    # Warmup: one generation of the workload's shape, on prompts drawn only now.
    warm_prompts = source.draw(wl.batch, wl.prompt)
    for side in sides:
        if not side.ok:
            continue
        remaining = settings.load_timeout_s - side.load_s
        try:
            gen = side.process.generate(warm_prompts, wl.output, time.perf_counter() + remaining,
                                        f"load + warmup exceeded {settings.load_timeout_s:.0f} s", vocab)
            side.warmup_s = gen.arrivals[-1] - gen.send_t
            side.record_pending(gen, "warmup")
        except ChildFailure as failure:
            side.fail(failure)
    say(f"{tag} warmup: " + ", ".join(
        f"{s.label} {s.warmup_s:.2f} s" if s.ok else f"{s.label} FAILED ({s.failure.code})" for s in sides))

    for i in range(settings.samples):
        prompts = source.draw(wl.batch, wl.prompt)
        order = [by_label[label] for label in sample_order([s.label for s in sides], i)]
        parts = []
        for position, side in enumerate(order):
            if not side.ok:
                continue
            try:
                gen = side.process.generate(prompts, wl.output, time.perf_counter() + settings.sample_timeout_s,
                                            f"sample exceeded {settings.sample_timeout_s:g} s", vocab)
            except ChildFailure as failure:
                side.fail(failure)
                parts.append(f"{side.label}: FAILED ({failure.code})")
                continue
            fig = gates.sample_figures(gen.send_t, gen.arrivals, wl.batch)
            side.figures.append(fig)
            side.record_pending(gen, f"sample {i}")
            side.samples.append({
                "index": i,
                "went": POSITION_WORDS[position],
                **{k: v for k, v in fig.__dict__.items()},
                "step_arrivals_s": [round(t - gen.send_t, 7) for t in gen.arrivals],
                # the engine's speculation figures for this call (acceptance, tokens per verify,
                # draft / verify seconds), where it reports them
                **({"speculation": gen.done["spec_stats"]} if gen.done.get("spec_stats") else {}),
            })
            for seq, emitted in enumerate(_emitted_sequences(gen)):
                side.sequences.append((i, seq, prompts[seq], emitted))
            parts.append(_sample_line(side.label, fig))
        say(f"{tag} sample {i + 1}/{settings.samples}: " + " | ".join(parts))

    # Every process must be dead before the replay starts.
    for side in sides:
        side.exit_code = side.process.stop()

    replay_result, replay_error = None, None
    with tempfile.TemporaryDirectory(prefix="fastqwen-replay-") as work:
        say(f"{tag} replay: {sum(len(s.sequences) for s in sides)} sequences, teacher-forced through Transformers")
        replay_result, replay_error = run_replay(settings, device, sides, Path(work), ref_env)
    replay_sides = (replay_result or {}).get("sides", {})

    engine, native, baseline = by_label["engine"], by_label.get("native"), by_label.get("baseline")
    eng_summary = gates.summarize(engine.figures)
    nat_summary = gates.summarize(native.figures) if native is not None else None
    base_summary = gates.summarize(baseline.figures) if baseline is not None else None
    codes = gates.check_gates(
        official=settings.official,
        engine=eng_summary,
        native=nat_summary if native is not None and native.ok else None,
        failure=None if engine.ok else {"code": engine.failure.code, "detail": engine.failure.detail},
        violations=replay_sides.get("engine", {}).get("violations"),
        memory_peak_bytes=gated_memory(engine.process.memory, device),
        memory_limit_bytes=memory_limit,
        pending_ms=[p["sync_ms"] for p in engine.pending],
    )
    # The engine's listed violations are capped; the code's count must be the true one.
    eng_replay = replay_sides.get("engine")
    if eng_replay and eng_replay["violation_count"] > len(eng_replay["violations"]):
        for c in codes:
            if c["code"] == "incorrect_output":
                c["detail"] += f" ({eng_replay['violation_count']} in all)"
    judge_problems: list[str] = []
    if replay_error is not None:
        judge_problems.append(replay_error)
        codes.append({"code": "harness_error", "detail": replay_error})
    if native is not None:
        if not native.ok:
            judge_problems.append(f"native baseline failed ({native.failure.code}): {native.failure.detail}")
            if settings.official:
                codes.append({"code": "harness_error", "detail": "native baseline failed: latency gate not checkable"})
        nat_replay = replay_sides.get("native")
        if nat_replay and nat_replay["violation_count"]:
            problem = (f"native failed its own replay ({nat_replay['violation_count']} positions, max slack "
                       f"{nat_replay['max_slack']:.3f}): the judge, the reference or the checkpoint's numerics "
                       f"are wrong, so this workload's correctness verdict cannot be trusted")
            judge_problems.append(problem)
            codes.append({"code": "harness_error", "detail": problem})
    # The baseline is never gated: its failures are reported for the person comparing, nothing more.
    baseline_problems: list[str] = []
    if baseline is not None:
        if not baseline.ok:
            baseline_problems.append(f"baseline failed ({baseline.failure.code}): {baseline.failure.detail}")
        base_replay = replay_sides.get("baseline")
        if base_replay and base_replay["violation_count"]:
            baseline_problems.append(f"baseline has {base_replay['violation_count']} position(s) beyond "
                                     f"{gates.MARGIN_LOGITS} logits (max slack {base_replay['max_slack']:.3f})")

    floors = None
    roof = None
    if probe.get("ceilings"):
        ceilings = roofline.Ceilings(**probe["ceilings"])
        floors = roofline.floors(shape, ceilings, wl.batch, wl.prompt, wl.output)
        roof = {"floors": floors.to_json(),
                "engine": roofline.distance(floors, eng_summary.ttft_s, eng_summary.tpot_s, eng_summary.total_s)}
        for label, summary in (("native", nat_summary), ("baseline", base_summary)):
            if summary is not None:
                roof[label] = roofline.distance(floors, summary.ttft_s, summary.tpot_s, summary.total_s)

    ratios = speed_ratios(eng_summary, nat_summary) if nat_summary is not None else None
    ratios_vs_baseline = speed_ratios(eng_summary, base_summary) if base_summary is not None else None
    fid = fidelity.workload_fidelity(replay_sides)

    passed = not codes
    if replay_result is not None:
        say(f"{tag} replay: " + ", ".join(
            f"{label} max slack {r['max_slack']:.3f}, {r['count_gt_0_75']} over {fidelity.NOISE_SLACK}, argmax "
            f"{r['argmax_agree']}/{r['positions']}, {r['violation_count']} violation(s)"
            for label, r in replay_sides.items()))
    say(f"{tag} {'PASS' if passed else 'FAIL: ' + '; '.join(c['code'] for c in codes)}")
    for c in codes:
        say(f"{tag}   {c['code']}: {c['detail'].splitlines()[-1] if c['detail'] else ''}")
    for problem in judge_problems:
        say(f"{tag}   judge: {problem.splitlines()[0]}")
    for problem in baseline_problems:
        say(f"{tag}   baseline (not gated): {problem.splitlines()[0]}")
    return {
        "workload": wl.to_json(),
        "passed": passed,
        "codes": codes,
        "engine": engine.to_json(device, memory_limit),
        "native": native.to_json(device, None) if native is not None else None,
        "baseline": baseline.to_json(device, None) if baseline is not None else None,
        "ratios": ratios,
        "ratios_vs_baseline": ratios_vs_baseline,
        "agreement_with_native": agreement(engine, native) if native is not None else None,
        "agreement_with_baseline": agreement(engine, baseline) if baseline is not None else None,
        "replay": replay_result,
        "replay_error": replay_error,
        "fidelity": fid,
        "judge_problems": judge_problems,
        "baseline_problems": baseline_problems,
        "roofline": roof,
        "seconds": time.perf_counter() - wall_start,
    }


# ------------------------------------------------------------------------------------------------
# the whole run
# ------------------------------------------------------------------------------------------------
def run_judge(settings: JudgeSettings) -> dict:
    """Run every workload and return the full report (see report.py for its rendering)."""
    say = settings.progress
    start = time.perf_counter()
    env = child_env("cpu" if settings.device == "cpu" else "auto")
    say(f"judge: probing the device ({settings.device})")
    # In the reference's environment, so the report names the Transformers that judged.
    probe = probe_device(settings.device, settings.measure_ceilings,
                         refenv.reference_env(settings.model_config.get("model_type", "qwen3"), env))
    device = probe["device"]
    env = child_env(device)
    shape = roofline.ModelShape.from_config(settings.model_config)
    memory_limit, memory_basis = memory_limit_bytes(settings, probe)
    source = PromptSource.for_model(settings.model_dir, shape.vocab, settings.seed)
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="fastqwen-judge-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ceilings = probe.get("ceilings")
    say(f"judge: device {device}" + (f" ({probe['gpu_name']})" if probe.get("gpu_name") else "")
        + (f", copy {ceilings['bandwidth_bytes_s'] / 1e9:.1f} GB/s, bf16 matmul "
           f"{ceilings['matmul_flops_s'] / 1e12:.2f} TFLOP/s" if ceilings else "")
        + f"; {'official' if settings.official else 'public'} mode, {settings.samples} sample(s); "
        f"prompts: {source.kind}; memory gate: {memory_basis}"
        + (f"; baseline (not gated): {settings.baseline_dir}" if settings.baseline_dir is not None else ""))

    results = []
    for index, wl in enumerate(settings.workloads.workloads):
        results.append(run_workload(settings, wl, index, source, probe, env, log_dir, shape, memory_limit))

    all_passed = all(r["passed"] for r in results)
    labels = ["engine"] + (["native"] if settings.native else []) + (["baseline"] if settings.baseline_dir else [])
    engine_tp = [r["engine"]["summary"]["throughput"] for r in results]
    native_tp = [r["native"]["summary"]["throughput"] for r in results] if settings.native else None
    notes = [f"{r['workload']['name']}: {p}" for r in results for p in r["judge_problems"]]
    notes += [f"{r['workload']['name']}: {p} (baseline, not gated)" for r in results for p in r["baseline_problems"]]
    if not settings.native:
        notes.append("--no-native: no ratios and no latency gate")
    if not settings.official:
        notes.append("public mode: latency and spread gates not applied")
    if device == "cuda":
        notes.append("memory gate reads torch.cuda.max_memory_reserved(); NVML per-process memory is reported "
                     "alongside when pynvml is importable")
    return {
        "judge": "fastqwen judge",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "official" if settings.official else "public",
        "samples": settings.samples,
        "seed": settings.seed,
        "passed": all_passed,
        "score": gates.score(engine_tp, native_tp, all_passed),
        "device": {k: probe.get(k) for k in ("device", "gpu_name", "device_memory_bytes", "sm_count", "cpu",
                                             "cuda_available")},
        "versions": probe.get("versions"),
        "git": git_commit(PACKAGE_ROOT),
        "engine_switches": engine_switches(os.environ),
        "engine_dir": str(settings.engine_dir),
        "native_dir": str(settings.native_dir) if settings.native else None,
        "baseline": baseline_summary(results, settings.baseline_dir) if settings.baseline_dir is not None else None,
        "model": {"path": str(settings.model_dir), "config": settings.model_config,
                  **roofline.model_summary(shape)},
        "workload_set": {"name": settings.workloads.name, "source": settings.workloads.source,
                         "workloads": [w.to_json() for w in settings.workloads.workloads]},
        "settings": {"load_timeout_s": settings.load_timeout_s, "sample_timeout_s": settings.sample_timeout_s,
                     "memory_limit_bytes": memory_limit, "memory_gate": memory_basis,
                     "margin_logits": gates.MARGIN_LOGITS, "latency_factor": gates.LATENCY_FACTOR,
                     "spread_limit": gates.SPREAD_LIMIT, "prompts": source.kind},
        "ceilings": ceilings,
        "results": results,
        "fidelity": fidelity.run_fidelity(results, labels),
        "notes": notes,
        "log_dir": str(log_dir),
        "seconds": time.perf_counter() - start,
    }
