"""The platform's gates and score, as pure functions of the measured figures.

Codes (any one fails the workload): incorrect_output, latency_limit (official runs), memory_limit,
unstable_timing (official runs), timeout, candidate_error; harness_error is the judge's own
failure (a replay that crashed, a native baseline that failed), never the engine's.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

MARGIN_LOGITS = 2.0  # emitted token's logit within this of the position's maximum
LATENCY_FACTOR = 1.10  # median TTFT and TPOT against native's
SPREAD_LIMIT = 0.25  # (max - min) / median of the sample totals; the formula is our conservative reading
PENDING_LIMIT_MS = 50.0  # GPU work still queued after the last yield

CODES = (
    "incorrect_output",
    "latency_limit",
    "memory_limit",
    "unstable_timing",
    "timeout",
    "candidate_error",
    "harness_error",
)


@dataclass(frozen=True)
class SampleFigures:
    """One generation as the parent timed it (seconds; tpot is None for a single step)."""

    ttft_s: float
    tpot_s: float | None
    total_s: float
    throughput: float


def sample_figures(send_t: float, arrivals: list[float], batch: int) -> SampleFigures:
    """TTFT, TPOT, total and throughput from the send time and each step's arrival time."""
    if not arrivals:
        raise ValueError("a sample needs at least one step arrival")
    ttft = arrivals[0] - send_t
    total = arrivals[-1] - send_t
    steps = len(arrivals)
    tpot = (total - ttft) / (steps - 1) if steps > 1 else None
    return SampleFigures(ttft_s=ttft, tpot_s=tpot, total_s=total, throughput=batch * steps / total)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def spread(totals: list[float]) -> float:
    """(max - min) / median of the sample totals; 0 with fewer than two samples."""
    if len(totals) < 2:
        return 0.0
    return (max(totals) - min(totals)) / statistics.median(totals)


@dataclass(frozen=True)
class SideSummary:
    """Medians over a side's samples (None when it produced none)."""

    samples: int
    ttft_s: float | None
    tpot_s: float | None
    total_s: float | None
    throughput: float | None
    spread: float | None

    def to_json(self) -> dict:
        return asdict(self)


def summarize(samples: list[SampleFigures]) -> SideSummary:
    totals = [s.total_s for s in samples]
    return SideSummary(
        samples=len(samples),
        ttft_s=_median([s.ttft_s for s in samples]),
        tpot_s=_median([s.tpot_s for s in samples]),
        total_s=_median(totals),
        throughput=_median([s.throughput for s in samples]),
        spread=spread(totals) if samples else None,
    )


def _code(code: str, detail: str) -> dict:
    return {"code": code, "detail": detail}


def check_gates(
    *,
    official: bool,
    engine: SideSummary,
    native: SideSummary | None,
    failure: dict | None = None,
    violations: list[dict] | None = None,
    memory_peak_bytes: int | None = None,
    memory_limit_bytes: int | None = None,
    pending_ms: list[float] | None = None,
) -> list[dict]:
    """Every failed gate of one workload as {"code", "detail"}; empty when it passed.

    `failure` is the run's own verdict on the engine process ({"code": "timeout" or
    "candidate_error", "detail"}); `violations` come from the replay (slack > MARGIN_LOGITS);
    `pending_ms` are the post-generation synchronize waits.
    """
    codes: list[dict] = []
    if failure is not None:
        codes.append(_code(failure["code"], failure["detail"]))
    if violations:
        worst = max(violations, key=lambda v: v["slack"])
        codes.append(_code(
            "incorrect_output",
            f"{len(violations)} position(s) beyond {MARGIN_LOGITS} logits; worst {worst['slack']:.3f} at "
            f"sample {worst['sample']}, sequence {worst['sequence']}, step {worst['step']} "
            f"(emitted {worst['emitted']}, argmax {worst['argmax']})",
        ))
    if memory_limit_bytes is not None and memory_peak_bytes is not None and memory_peak_bytes >= memory_limit_bytes:
        codes.append(_code(
            "memory_limit",
            f"peak {memory_peak_bytes / 2**30:.3f} GiB not under the limit {memory_limit_bytes / 2**30:.3f} GiB",
        ))
    late = [ms for ms in (pending_ms or []) if ms > PENDING_LIMIT_MS]
    if late:
        codes.append(_code(
            "candidate_error",
            f"GPU work left running after the last yield: synchronize waited {max(late):.1f} ms "
            f"(limit {PENDING_LIMIT_MS:.0f} ms) in {len(late)} generation(s)",
        ))
    if official and engine.samples >= 2 and engine.spread is not None and engine.spread > SPREAD_LIMIT:
        codes.append(_code(
            "unstable_timing",
            f"spread {engine.spread:.1%} of the sample totals exceeds {SPREAD_LIMIT:.0%}",
        ))
    if official and native is not None and engine.samples and native.samples:
        slow = []
        for label, mine, theirs in (("TTFT", engine.ttft_s, native.ttft_s), ("TPOT", engine.tpot_s, native.tpot_s)):
            if mine is not None and theirs is not None and mine > LATENCY_FACTOR * theirs:
                slow.append(f"median {label} {mine * 1e3:.2f} ms > {LATENCY_FACTOR:.2f} x native {theirs * 1e3:.2f} ms")
        if slow:
            codes.append(_code("latency_limit", "; ".join(slow)))
    return codes


def geomean(values: list[float]) -> float | None:
    if not values or any(v is None or v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def score(engine_throughputs: list[float | None], native_throughputs: list[float | None] | None,
          all_passed: bool) -> dict:
    """Geometric mean of median throughputs; a run with any failed workload has no valid score.

    The figures are still reported when the run failed (`valid` False), so a failing engine's
    speed stays visible.
    """
    engine = geomean(engine_throughputs) if all(t is not None for t in engine_throughputs) else None
    native = None
    if native_throughputs is not None and all(t is not None for t in native_throughputs):
        native = geomean(native_throughputs)
    return {
        "valid": all_passed and engine is not None,
        "engine": engine,
        "native": native,
        "ratio": engine / native if engine is not None and native else None,
    }
