"""gdn_exact_step's schedules by name and by grid: plain Python, run everywhere (the kernels' own
tests are in test_gdn_exact_step.py: a GPU, or the interpreter of Triton >= 3.4)."""
import sys

import pytest
import torch

from engine_modules import ENGINE_DIR

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels import gdn_exact_step as step  # noqa: E402


def test_merged_plan_from_text_names_a_bad_value():
    assert step.MergedPlan.from_text("") == step.MergedPlan()
    assert step.MergedPlan.from_text("keys=64, ws=128,qs_late=1") == step.MergedPlan(64, 128, True)
    assert step.MergedPlan().constexprs() == {}        # the defaults add no constexprs: the same compiled kernel
    for text, message in (("keys=6x", "keys must be a count of rows, got '6x'"), ("foo=1", "'foo=1' is not name"),
                          ("qs_late=yes", "qs_late must be 0 or 1, got 'yes'"), ("one_pass=1", "'one_pass=1' is not")):
        with pytest.raises(ValueError, match=message):
            step.MergedPlan.from_text(text)


def test_auto_plan_by_grid(monkeypatch):
    """The merged schedule auto_plan picks: qs_late with both passes at 64 rows a trip (Dk's at most)
    where the grid fills at most half the multiprocessors, the plain one beyond and on the CPU."""
    monkeypatch.setattr(step, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert step.auto_plan(128, 32, cuda) == step.auto_plan(128, 66, cuda) == step.MergedPlan(64, 64, True)
    assert step.auto_plan(32, 32, cuda) == step.MergedPlan(32, 32, True)
    assert step.auto_plan(128, 67, cuda) == step.auto_plan(128, 128, cuda) == step.MergedPlan()
    assert step.auto_plan(128, 32, torch.device("cpu")) == step.MergedPlan()
