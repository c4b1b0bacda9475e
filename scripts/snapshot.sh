#!/usr/bin/env bash
# The tree a GPU call carries: HEAD's files (git archive), the carried wheels (.whl: the Qwen3
# reference's Transformers 4.51.3 and its tokenizers/hub; .whl_fla: fla-core and einops for
# bench_gdn.py; .whl_serve: FastAPI, uvicorn, prometheus-client, httpx and their dependencies for
# Python 3.12, for serve-bench), .commit (HEAD, for the reports), and with a commit argument that commit's
# engine/ under base/ (the judges' --baseline side).
#
#   bash scripts/snapshot.sh [BASE_COMMIT]      -> .snap/, then run with carry [".snap"]:
#   cd .snap && OUT=$OUT bash scripts/gpu_parallel.sh "FIRST" "GPU0 STAGES" "GPU1 STAGES"
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .snap && mkdir .snap
git archive HEAD | tar -x -C .snap
for d in .whl .whl_fla .whl_serve; do [ -d "$d" ] && cp -r "$d" ".snap/$d"; done
git rev-parse HEAD > .snap/.commit
if [ $# -ge 1 ]; then mkdir .snap/base && git archive "$1" engine | tar -x -C .snap/base; fi
du -sh .snap | cut -f1
