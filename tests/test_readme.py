"""The README's commands run as written: every fenced ```bash and ```python block, in the order the
README gives them, from the repository's root, on the CPU. (The test command itself is an indented
block, not a fenced one: running it here would run this test again.) A block that fails fails the
test with its output; the README's engine options table names every environment variable the
engine reads (tests/test_layout.py checks the engine's side)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README.read_text())]


def test_the_readme_has_its_blocks_and_stays_short():
    kinds = [kind for kind, _ in blocks()]
    assert kinds.count("bash") >= 4 and kinds.count("python") >= 1
    assert "fastqwen judge" in blocks()[0][1], "the first block is the main job"
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks())))
def test_a_readme_block_runs_as_written(index):
    kind, code = blocks()[index]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = ["bash", "-euo", "pipefail", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
    run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"README block {index} ({kind}) failed:\n{code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
