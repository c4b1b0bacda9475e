"""The judge's outputs a person reads: the end-of-run table, and the JSON report on disk."""
from __future__ import annotations

import json
from pathlib import Path

from fastqwen.judge.fidelity import NOISE_SLACK, WORST_SLACK_ALLOWANCE


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.2f}" if seconds is not None else "-"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return fmt.format(value) if value is not None else "-"


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def _gib(value: int | None) -> str:
    return f"{value / 2**30:.2f}" if value is not None else "-"


SPEED_HEADER = ("workload", "side", "TTFT ms", "TPOT ms", "tok/s", "spread", "peak GiB", "floor tok/s", "of floor",
                "GB/s", "verdict")
FIDELITY_HEADER = ("workload", "side", "positions", f"slack > {NOISE_SLACK}", "worst slack", "argmax agree",
                   f"worst <= native + {WORST_SLACK_ALLOWANCE}")
SIDES = ("engine", "native", "baseline")


def _table(header: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    """Fixed-width columns, left-aligned, trailing blanks trimmed."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return lines


def _speed_row(name: str, label: str, side: dict, roof: dict | None, verdict: str) -> list[str]:
    s = side["summary"]
    dist = (roof or {}).get(label) or {}
    floors = (roof or {}).get("floors") or {}
    return [name, label, _ms(s["ttft_s"]), _ms(s["tpot_s"]), _num(s["throughput"]), _pct(s["spread"]),
            _gib(side.get("memory_gated_bytes")),
            _num(floors.get("throughput")) if label == "engine" else "",
            _pct(dist.get("throughput_fraction")), _num(dist.get("decode_gb_s"), "{:.2f}"), verdict]


def _ratio_row(label: str, ratios: dict) -> list[str]:
    return ["", label, _num(ratios["ttft"], "{:.2f}x"), _num(ratios["tpot"], "{:.2f}x"),
            _num(ratios["throughput"], "{:.2f}x"), "", "", "", "", "", ""]


def speed_table(report: dict) -> list[str]:
    """Per workload each side's medians, then engine/native and engine/baseline ratios."""
    rows: list[list[str]] = []
    for r in report["results"]:
        name = r["workload"]["name"]
        verdict = "PASS" if r["passed"] else "FAIL " + ",".join(c["code"] for c in r["codes"])
        rows.append(_speed_row(name, "engine", r["engine"], r.get("roofline"), verdict))
        for label in ("native", "baseline"):
            if r.get(label) is not None:
                rows.append(_speed_row("", label, r[label], r.get("roofline"),
                                        "not gated" if label == "baseline" else ""))
        if r.get("ratios"):
            rows.append(_ratio_row("engine/native", r["ratios"]))
        if r.get("ratios_vs_baseline"):
            rows.append(_ratio_row("engine/baseline", r["ratios_vs_baseline"]))
    return _table(SPEED_HEADER, rows)


def _yes_no(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")


def _fidelity_row(name: str, label: str, fig: dict | None, within: str) -> list[str]:
    if fig is None:
        return [name, label, "-", "-", "-", "-", within]
    agree = f"{fig['argmax_agree']}/{fig['positions']} ({_pct(fig['argmax_agree_fraction'])})"
    return [name, label, str(fig["positions"]), str(fig["count_gt_0_75"]), _num(fig["max_slack"], "{:.3f}"),
            agree, within]


def fidelity_table(report: dict) -> list[str]:
    """Per workload and side: positions replayed, count of slack > 0.75, worst slack, argmax agreement
    and whether the worst slack is within native's + 0.25; then the sums over the run."""
    rows: list[list[str]] = []
    for r in report["results"]:
        fid = r.get("fidelity") or {}
        within = fid.get("worst_slack_within_native_allowance") or {}
        labels = [label for label in SIDES if r.get(label) is not None]
        for k, label in enumerate(labels):
            mark = "" if label == "native" else _yes_no(within.get(label))
            rows.append(_fidelity_row(r["workload"]["name"] if k == 0 else "", label,
                                      (fid.get("sides") or {}).get(label), mark))
    totals = (report.get("fidelity") or {}).get("sides") or {}
    comparisons = ((report.get("fidelity") or {}).get("noise_vs_native") or {}).get("by_side") or {}
    for k, label in enumerate(label for label in SIDES if label in totals):
        flags = list((comparisons.get(label) or {}).get("worst_slack_within_native_allowance", {}).values())
        mark = "" if label == "native" or not flags else f"{sum(f is True for f in flags)}/{len(flags)} workloads"
        rows.append(_fidelity_row("all workloads" if k == 0 else "", label, totals[label], mark))
    return _table(FIDELITY_HEADER, rows)


def _excess(c: dict) -> str:
    """A count over native's, with the sign test's chance of an excess that large at equal rates."""
    p = c.get("count_excess_p")
    return "" if c["count_within_native"] or p is None else f", sign test p = {p:.2g}"


def noise_lines(report: dict) -> list[str]:
    """The engine-vs-native noise comparison in words (and the baseline's, when there is one)."""
    noise = (report.get("fidelity") or {}).get("noise_vs_native") or {}
    lines = []
    for label, c in (noise.get("by_side") or {}).items():
        flags = list(c["worst_slack_within_native_allowance"].values())
        lines.append(
            f"noise vs native, {label} (diagnostic, not a gate): slack > {NOISE_SLACK} at {c['count_gt_0_75']} "
            f"position(s), native {c['native_count_gt_0_75']} ({'<=' if c['count_within_native'] else 'MORE THAN'} "
            f"native{_excess(c)}); worst slack <= native's + {WORST_SLACK_ALLOWANCE} in {sum(f is True for f in flags)}/"
            f"{len(flags)} workload(s): {'holds' if c['holds'] else 'DOES NOT HOLD'}")
    return lines


def baseline_line(report: dict) -> list[str]:
    base = report.get("baseline")
    if not base:
        return []
    g = base["ratios_geomean"]
    return [f"baseline (not gated; {base['dir']}): {_num(base['throughput_geomean'])} tok/s; engine/baseline "
            f"geomean over {len(report['results'])} workload(s): TTFT {_num(g['ttft'], '{:.3f}x')}, "
            f"TPOT {_num(g['tpot'], '{:.3f}x')}, tok/s {_num(g['throughput'], '{:.3f}x')}"]


def speculation_lines(report: dict) -> list[str]:
    """Per workload where the engine speculated: acceptance, tokens per verify, verifies (by width)
    and plain steps over the timed samples, and the device's ms a draft, verify and plain step."""
    lines = []
    for r in report["results"]:
        st = (r.get("engine") or {}).get("speculation")
        if not st or st.get("mode") == "off":     # an engine that reports its figures with speculation off
            continue
        by_width = sorted((st.get("width_steps") or {}).items(), key=lambda item: int(item[0]))
        widths = " ".join(f"{w}:{n}" for w, n in by_width)
        lines.append(
            f"speculation ({st.get('mode')}, k={st.get('k')}), {r['workload']['name']}: acceptance "
            f"{_num(st.get('acceptance'), '{:.2f}')}, tokens per verify {_num(st.get('tokens_per_verify'), '{:.2f}')}, "
            f"{st.get('verify_steps')} verifies{f' (by width {widths})' if widths else ''}, "
            f"{st.get('plain_steps')} plain steps; device ms a draft {_num(st.get('draft_ms'), '{:.3f}')}, "
            f"a verify {_num(st.get('verify_ms'), '{:.2f}')}, a plain step {_num(st.get('plain_ms'), '{:.2f}')}")
    return lines


def format_table(report: dict) -> str:
    """The speed table, the fidelity table, the score and comparison lines, then the codes and notes."""
    lines = speed_table(report)
    lines.append("")
    lines.append("fidelity: every emitted token replayed against native's full forward "
                 "(slack = max logit - emitted token's logit; argmax agree = emitted token is the argmax)")
    lines += fidelity_table(report)
    sc = report["score"]
    verdict = "valid" if sc["valid"] else "FAILED (a workload failed a gate; figures shown for information)"
    lines.append("")
    lines.append(f"score ({report['mode']}, {report['samples']} sample(s)): engine {_num(sc['engine'])} tok/s, "
                 f"native {_num(sc['native'])} tok/s, ratio {_num(sc['ratio'], '{:.2f}x')}: {verdict}")
    lines += baseline_line(report)
    lines += noise_lines(report)
    lines += speculation_lines(report)
    for r in report["results"]:
        for c in r["codes"]:
            first = c["detail"].strip().splitlines()
            lines.append(f"  {r['workload']['name']}: {c['code']}: {first[-1] if first else ''}")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
