#!/usr/bin/env bash
# Create .venv with the platform's pinned stack (Python 3.11, torch 2.5.1 with
# Triton 3.1.0, Transformers 4.51.3, safetensors 0.5.3, tokenizers 0.21.1), the serving
# front's libraries (FastAPI, uvicorn, prometheus-client; httpx, the openai client and
# lm-evaluation-harness for its tests) and install fastqwen into it. Safe to run again: an existing, complete .venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
# No pip cache: torch 2.5.1's wheels (~3 GB) would otherwise sit twice on the disk, cached
# and installed (a CI run once stopped on "No space left on device").
export PIP_NO_CACHE_DIR=1
free_gb() { df -Pk . | awk 'NR == 2 {printf "%.1f", $4 / 1048576}'; }
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import torch, transformers, fastqwen, fastapi, uvicorn, \
    prometheus_client, openai, httpx, lm_eval, tenacity, llguidance" >/dev/null 2>&1; then
  echo "setting up .venv (torch 2.5.1 brings several GB of CUDA libraries; a few minutes;" \
       "$(free_gb) GB free here, ~7 GB needed)" >&2
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.5.1 transformers==4.51.3 safetensors==0.5.3 \
      tokenizers==0.21.1 numpy pytest matplotlib
  # the serving front (fastqwen serve) and its tests: the OpenAI client drives it
  .venv/bin/python -m pip install -q fastapi==0.165.0 uvicorn==0.54.0 prometheus-client==0.26.0 \
      httpx==0.28.1 openai==3.57.0 jinja2==3.1.6 llguidance==1.9.1
  # lm-evaluation-harness over HTTP (its API models); datasets and the hub kept where
  # Transformers 4.51.3 works (huggingface-hub < 1)
  .venv/bin/python -m pip install -q "lm-eval[api]==0.4.13" datasets==3.6.0 "fsspec[http]==2025.3.0" \
      "huggingface-hub>=0.30,<1"
  .venv/bin/python -m pip install -q --no-deps -e .
fi
# The Qwen3.5 reference (Transformers 5.17.0, which needs newer huggingface-hub and
# tokenizers than 4.51.3 does) in a target folder over the same torch: prepended to
# PYTHONPATH only where the Qwen3.5 reference runs (fastqwen/refenv.py).
QWEN35=.venv-qwen35
if ! PYTHONPATH=$QWEN35 .venv/bin/python -c "import transformers as t; assert t.__version__ == '5.17.0'; \
    from transformers import Qwen3_5ForCausalLM" >/dev/null 2>&1; then
  echo "setting up $QWEN35 (Transformers 5.17.0 for the Qwen3.5 reference)" >&2
  rm -rf "$QWEN35"
  .venv/bin/python -m pip install -q --target "$QWEN35" transformers==5.17.0 "huggingface-hub>=1.5,<2" \
      "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" "regex>=2025.10.22" typer
fi
