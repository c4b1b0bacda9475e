"""fastqwen.refenv: which environment runs a checkpoint's reference."""
from __future__ import annotations

import pytest

from fastqwen import refenv


def test_qwen3_runs_in_the_project_environment():
    assert refenv.reference_env("qwen3", {"PYTHONPATH": "x"}) == {"PYTHONPATH": "x"}


def test_qwen35_gets_the_5_17_folder_first(monkeypatch, tmp_path):
    (tmp_path / "transformers").mkdir()
    monkeypatch.setenv("FASTQWEN_QWEN35_SITE", str(tmp_path))
    env = refenv.reference_env("qwen3_5_text", {"PYTHONPATH": "/other"})
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), "/other"]
    assert refenv.reference_env("qwen3_5", {})["PYTHONPATH"] == str(tmp_path)


def test_missing_or_unknown_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTQWEN_QWEN35_SITE", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="run scripts/setup_env.sh"):
        refenv.reference_env("qwen3_5_text", {})
    with pytest.raises(ValueError, match="'llama'"):
        refenv.reference_env("llama", {})
