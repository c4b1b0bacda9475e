"""scripts/pool_noise.py: the engine's and native's noise counts summed over judge reports."""
import json
import subprocess
import sys

import pytest

from engine_modules import REPO

SCRIPT = REPO / "scripts" / "pool_noise.py"


def _report(path, seed, workloads):
    results = [{"workload": {"name": name}, "replay": {"sides": {
        side: {"positions": pos, "count_gt_0": gt0, "count_gt_0_75": gt75}
        for side, (pos, gt0, gt75) in sides.items()}}} for name, sides in workloads.items()]
    path.write_text(json.dumps({"settings": {"seed": seed}, "results": results}))
    return str(path)


def test_pooled_counts_and_the_sign_test(tmp_path):
    a = _report(tmp_path / "a.json", 1, {"w1": {"engine": (10, 3, 2), "native": (10, 2, 1)},
                                         "w2": {"engine": (20, 4, 3), "native": (20, 5, 0)}})
    b = _report(tmp_path / "b.json", 2, {"w1": {"engine": (10, 1, 1), "native": (10, 1, 1)}})
    out_json = tmp_path / "pooled.json"
    run = subprocess.run([sys.executable, str(SCRIPT), a, b, "--json", str(out_json)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(out_json.read_text())
    assert [r["seed"] for r in out["runs"]] == [1, 2]
    assert out["runs"][0]["engine"] == {"positions": 30, "count_gt_0": 7, "count_gt_0_75": 5}
    assert out["pooled"] == {"engine": {"positions": 40, "count_gt_0": 8, "count_gt_0_75": 6},
                             "native": {"positions": 40, "count_gt_0": 8, "count_gt_0_75": 2}}
    # 6 of 8 events on the engine's side: P(>= 6 of 8) = (28 + 8 + 1) / 256
    assert out["count_excess_p"] == pytest.approx(37 / 256)
    assert "pooled" in run.stdout and "p = 0.14" in run.stdout


def test_a_report_without_natives_replay_is_refused(tmp_path):
    a = _report(tmp_path / "a.json", 1, {"w1": {"engine": (10, 3, 2)}})
    run = subprocess.run([sys.executable, str(SCRIPT), a], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "w1 has no native replay" in run.stderr
