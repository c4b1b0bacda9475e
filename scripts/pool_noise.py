"""Pool the engine's and native's noise figures over several judge reports.

One judge run compares the engine with native on the same prompts, but each run draws them from
a fresh seed, and native's own count of slack > 0.75 moves ~2x between seeds. Pooled over runs,
the counts say more: per report and over all of them, per side, the positions replayed, how many
have slack > 0 and > 0.75, and the sign test of the engine's pooled count against native's
(fastqwen.judge.fidelity.excess_p).

    python scripts/pool_noise.py REPORT.json [REPORT.json ...] [--json OUT]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastqwen.judge.fidelity import NOISE_SLACK, excess_p  # noqa: E402

SIDES = ("engine", "native")
KEYS = ("positions", "count_gt_0", "count_gt_0_75")


def report_counts(path: str) -> dict:
    """Per side the summed counts of one report's replayed workloads (sides missing from any
    workload's replay are an error: a pooled figure needs both sides everywhere)."""
    with open(path) as f:
        report = json.load(f)
    counts = {side: dict.fromkeys(KEYS, 0) for side in SIDES}
    for r in report.get("results", []):
        sides = (r.get("replay") or {}).get("sides") or {}
        for side in SIDES:
            if side not in sides:
                raise SystemExit(f"{path}: workload {r['workload']['name']} has no {side} replay")
            for key in KEYS:
                counts[side][key] += sides[side][key]
    if not report.get("results"):
        raise SystemExit(f"{path}: no workloads")
    return {"report": path, "seed": (report.get("settings") or {}).get("seed", report.get("seed")), **counts}


def pool(paths: list[str]) -> dict:
    runs = [report_counts(p) for p in paths]
    total = {side: {key: sum(r[side][key] for r in runs) for key in KEYS} for side in SIDES}
    return {"runs": runs, "pooled": total,
            "count_excess_p": excess_p(total["engine"]["count_gt_0_75"], total["native"]["count_gt_0_75"])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    out = pool(args.reports)
    print(f"{'report':60s} {'positions':>9s} {'eng >0':>7s} {'nat >0':>7s} {'eng >' + str(NOISE_SLACK):>9s} "
          f"{'nat >' + str(NOISE_SLACK):>9s}")
    for r in out["runs"] + [{"report": "pooled", **out["pooled"]}]:
        e, n = r["engine"], r["native"]
        print(f"{r['report'][-60:]:60s} {e['positions']:9d} {e['count_gt_0']:7d} {n['count_gt_0']:7d} "
              f"{e['count_gt_0_75']:9d} {n['count_gt_0_75']:9d}")
    print(f"sign test of the engine's pooled count over {NOISE_SLACK} against native's: p = {out['count_excess_p']:.2g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
