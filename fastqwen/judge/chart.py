"""A PNG of each workload's throughput: engine, native, the baseline if any, and the physical floor."""
from __future__ import annotations

from pathlib import Path


def write_chart(report: dict, path: Path) -> bool:
    """Draw the chart; returns False (and draws nothing) when matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    results = report["results"]
    names = [r["workload"]["name"] for r in results]
    series = [("engine", [r["engine"]["summary"]["throughput"] for r in results], "#1f77b4")]
    if any(r.get("native") for r in results):
        series.append(("native", [(r.get("native") or {}).get("summary", {}).get("throughput") for r in results],
                       "#ff7f0e"))
    if any(r.get("baseline") for r in results):
        series.append(("baseline", [(r.get("baseline") or {}).get("summary", {}).get("throughput") for r in results],
                       "#2ca02c"))
    if any(r.get("roofline") for r in results):
        series.append(("floor (limit)", [((r.get("roofline") or {}).get("floors") or {}).get("throughput")
                                         for r in results], "#7f7f7f"))

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(names) + 2), 4.5))
    for k, (label, values, color) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(names))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=label, color=color)
        for bar, v in zip(bars, values):
            if v is not None:
                ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=7)
    for i, r in enumerate(results):
        if not r["passed"]:
            ax.annotate("FAIL: " + ",".join(c["code"] for c in r["codes"]), (i, 0), xytext=(0, -28),
                        textcoords="offset points", ha="center", fontsize=7, color="red")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    # The floor is often 10-100x the measured figures: a log axis keeps all three readable.
    ax.set_yscale("log", nonpositive="clip")
    ax.set_ylabel("throughput, tok/s (median)")
    device = report["device"].get("gpu_name") or report["device"].get("device")
    sc = report["score"]
    score = f"score {sc['engine']:.1f} tok/s" if sc["engine"] else "no score"
    if sc.get("ratio"):
        score += f" ({sc['ratio']:.2f}x native)"
    ax.set_title(f"fastqwen judge, {report['mode']}, {device}: {score}" + ("" if sc["valid"] else " [FAILED]"),
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
