"""Shared fixtures: one synthetic `tiny` checkpoint per test session, and the native engine's folder."""
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
