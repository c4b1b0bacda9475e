"""The judge's outputs a person reads: the end-of-run table, and the JSON report on disk."""
from __future__ import annotations

import json
from pathlib import Path


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.2f}" if seconds is not None else "-"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return fmt.format(value) if value is not None else "-"


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def _gib(value: int | None) -> str:
    return f"{value / 2**30:.2f}" if value is not None else "-"


HEADER = ("workload", "side", "TTFT ms", "TPOT ms", "tok/s", "spread", "peak GiB", "max slack",
          "floor tok/s", "of floor", "GB/s", "verdict")


def _side_row(name: str, label: str, side: dict, replay: dict | None, roof: dict | None, verdict: str) -> list[str]:
    s = side["summary"]
    dist = (roof or {}).get(label) or {}
    floors = (roof or {}).get("floors") or {}
    slack = (replay or {}).get("sides", {}).get(label, {}).get("max_slack")
    return [name, label, _ms(s["ttft_s"]), _ms(s["tpot_s"]), _num(s["throughput"]), _pct(s["spread"]),
            _gib(side.get("memory_gated_bytes")), _num(slack, "{:.3f}"),
            _num(floors.get("throughput")) if label == "engine" else "",
            _pct(dist.get("throughput_fraction")), _num(dist.get("decode_gb_s"), "{:.2f}"), verdict]


def format_table(report: dict) -> str:
    """A fixed-width table of every workload, then the score line and the notes."""
    rows: list[list[str]] = []
    for r in report["results"]:
        name = r["workload"]["name"]
        verdict = "PASS" if r["passed"] else "FAIL " + ",".join(c["code"] for c in r["codes"])
        rows.append(_side_row(name, "engine", r["engine"], r.get("replay"), r.get("roofline"), verdict))
        if r.get("native") is not None:
            rows.append(_side_row("", "native", r["native"], r.get("replay"), r.get("roofline"), ""))
        ratios = r.get("ratios")
        if ratios:
            rows.append(["", "ratio", _num(ratios["ttft"], "{:.2f}x"), _num(ratios["tpot"], "{:.2f}x"),
                         _num(ratios["throughput"], "{:.2f}x"), "", "", "", "", "", "", ""])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    sc = report["score"]
    verdict = "valid" if sc["valid"] else "FAILED (a workload failed a gate; figures shown for information)"
    lines.append("")
    lines.append(f"score ({report['mode']}, {report['samples']} sample(s)): engine {_num(sc['engine'])} tok/s, "
                 f"native {_num(sc['native'])} tok/s, ratio {_num(sc['ratio'], '{:.2f}x')}: {verdict}")
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
