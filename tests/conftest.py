"""Shared fixtures: one synthetic `tiny` checkpoint per test session, the native engine's folder,
and `fastqwen synth-stats` as a command."""
from __future__ import annotations

import pathlib

import pytest

import fastqwen


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A `tiny` checkpoint (seed 0, CPU), synthesized once per session. Treat it as read-only."""
    from fastqwen.synth import synthesize

    return synthesize("tiny", tmp_path_factory.mktemp("tiny_model"), seed=0, device="cpu", progress=False)


@pytest.fixture(scope="session")
def native_engine_dir() -> pathlib.Path:
    """The folder of the native baseline engine (its `engine.py` is imported as module `engine`)."""
    return pathlib.Path(fastqwen.__file__).parent / "native_engine"


@pytest.fixture(scope="session")
def synth_stats():
    """run(checkpoint, out_json, positions, stability_positions) -> (the finished process, the
    report): `fastqwen synth-stats` as a user runs it, in a process of its own."""
    import json
    import subprocess
    import sys

    def run(ckpt, out, positions: int, stability_positions: int):
        proc = subprocess.run([sys.executable, "-m", "fastqwen.cli", "synth-stats", "--model", str(ckpt),
                               "--positions", str(positions), "--stability-positions", str(stability_positions),
                               "--out", str(out)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, json.loads(pathlib.Path(out).read_text())

    return run
