"""Which Python environment runs a checkpoint's reference.

Qwen3 checkpoints are judged against Transformers 4.51.3 (the project's .venv); Qwen3.5
checkpoints (model_type qwen3_5_text, or the released multimodal wrapper's qwen3_5)
against Transformers 5.17.0, which needs newer huggingface-hub and tokenizers than
4.51.3 allows. scripts/setup_env.sh installs 5.17.0 and those into a target folder,
.venv-qwen35, that runs over .venv's own torch: a process gets it by having the folder
first on PYTHONPATH.
"""
from __future__ import annotations

import os
from pathlib import Path

QWEN35_MODEL_TYPES = frozenset({"qwen3_5_text", "qwen3_5"})
QWEN35_TRANSFORMERS = "5.17.0"
REPO = Path(__file__).resolve().parent.parent


def qwen35_site() -> Path:
    """The target folder holding Transformers 5.17.0 (FASTQWEN_QWEN35_SITE overrides it)."""
    return Path(os.environ.get("FASTQWEN_QWEN35_SITE", REPO / ".venv-qwen35"))


def reference_env(model_type: str, environ: dict | None = None) -> dict:
    """The environment a reference process for this model_type runs with (a copy of
    `environ`, default os.environ). Raises FileNotFoundError naming the fix when the
    Qwen3.5 reference is not installed, ValueError for a model_type with no reference."""
    env = dict(os.environ if environ is None else environ)
    if model_type == "qwen3":
        return env
    if model_type not in QWEN35_MODEL_TYPES:
        raise ValueError(f"no reference environment for model_type {model_type!r}; "
                         f"known: qwen3, {', '.join(sorted(QWEN35_MODEL_TYPES))}")
    site = qwen35_site()
    if not (site / "transformers").is_dir():
        raise FileNotFoundError(f"the Qwen3.5 reference (Transformers {QWEN35_TRANSFORMERS}) is not installed "
                                f"at {site}; run scripts/setup_env.sh")
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH", "")] if p])
    return env
