"""Fidelity figures: how close each side's tokens sit to the full forward's, side by side.

The replay (replay.py) gives, per side, the slack distribution of every emitted token (slack =
the full forward's max logit - the emitted token's logit) and its argmax agreement. This module
turns those into the figures a person compares across sides, per workload and over the run.

The comparison it names, `noise_vs_native`, is how the project shows that the engine's logit noise
is no larger than native's own cached decode path: summed over the run, the engine has no more
positions with slack > NOISE_SLACK than native, and in every workload its worst slack is within
WORST_SLACK_ALLOWANCE of native's worst. It is a diagnostic, never a gate: the platform's only
correctness gate is the 2.0-logit margin (gates.py), and a native run's own noise moves between
machines and seeds, so failing this comparison must not fail a run.
"""
from __future__ import annotations

import math

NOISE_SLACK = 0.75  # native's cached decode already differs from a full forward by up to ~0.75 logits
WORST_SLACK_ALLOWANCE = 0.25  # per workload: engine worst slack <= native worst slack + this
FIGURES = ("positions", "count_gt_0_75", "max_slack", "argmax_agree", "argmax_agree_fraction")
COMPARED_SIDES = ("engine", "baseline")  # each is compared against native when both were replayed


def excess_p(mine: int, native: int) -> float:
    """A sign test of a side's count of slack > NOISE_SLACK against native's, over the same
    prompts and positions: the chance of `mine` or more of the mine + native events falling on
    this side if each were equally likely to fall on either (binomial, p = 1/2). Small: this
    side's excess is more than one run's prompts make by chance (native's own count moves ~2x
    between prompt seeds); 1.0 when neither side has any."""
    n = mine + native
    if n == 0:
        return 1.0
    return min(1.0, sum(math.comb(n, k) for k in range(mine, n + 1)) / 2 ** n)


def side_figures(replayed: dict | None) -> dict | None:
    """The per-side fidelity figures from one side's replay result (None when it was not replayed)."""
    if not replayed:
        return None
    return {key: replayed.get(key) for key in FIGURES}


def workload_fidelity(replay_sides: dict) -> dict:
    """Per side the fidelity figures of one workload, and per compared side whether its worst slack
    is within the allowance of native's (None when either side has no replay)."""
    sides = {label: side_figures(r) for label, r in replay_sides.items()}
    native = sides.get("native")
    within = {}
    for label in COMPARED_SIDES:
        mine = sides.get(label)
        if mine is None:
            continue
        within[label] = (mine["max_slack"] <= native["max_slack"] + WORST_SLACK_ALLOWANCE
                         if native is not None else None)
    return {"sides": sides, "worst_slack_within_native_allowance": within}


def run_fidelity(results: list[dict], labels: list[str]) -> dict:
    """Sums over every workload per side, and the noise-vs-native comparison per compared side.

    A side missing from some workload's replay (its process failed, the replay crashed) leaves that
    workload out of its sums; `workloads` says how many were counted, and the comparison does not
    hold when any workload is missing, because a claim over the run needs every workload.
    """
    n = len(results)
    totals: dict[str, dict] = {}
    for label in labels:
        figures = [(r.get("fidelity") or {}).get("sides", {}).get(label) for r in results]
        present = [f for f in figures if f is not None]
        positions = sum(f["positions"] for f in present)
        agree = sum(f["argmax_agree"] for f in present)
        totals[label] = {
            "workloads": len(present),
            "positions": positions,
            "count_gt_0_75": sum(f["count_gt_0_75"] for f in present),
            "max_slack": max((f["max_slack"] for f in present), default=None),
            "argmax_agree": agree,
            "argmax_agree_fraction": agree / positions if positions else None,
        }

    comparisons = {}
    native = totals.get("native")
    for label in COMPARED_SIDES:
        mine = totals.get(label)
        if mine is None or native is None:
            continue
        per_workload = {r["workload"]["name"]: (r.get("fidelity") or {}).get(
            "worst_slack_within_native_allowance", {}).get(label) for r in results}
        count_ok = mine["count_gt_0_75"] <= native["count_gt_0_75"]
        complete = mine["workloads"] == native["workloads"] == n
        comparisons[label] = {
            "count_gt_0_75": mine["count_gt_0_75"],
            "native_count_gt_0_75": native["count_gt_0_75"],
            "count_within_native": count_ok,
            "count_excess_p": excess_p(mine["count_gt_0_75"], native["count_gt_0_75"]),
            "worst_slack_within_native_allowance": per_workload,
            "holds": complete and count_ok and all(v is True for v in per_workload.values()),
        }
    return {
        "noise_slack": NOISE_SLACK,
        "worst_slack_allowance": WORST_SLACK_ALLOWANCE,
        "sides": totals,
        "noise_vs_native": {
            "claim": (f"logit noise no larger than native's own: summed count of slack > {NOISE_SLACK} "
                      f"<= native's, and per workload worst slack <= native's + {WORST_SLACK_ALLOWANCE}"),
            "gated": False,
            "by_side": comparisons,
        },
    }
