#!/usr/bin/env bash
# Two gpu_session.sh runs side by side on a two-GPU machine (kind nvidia-h200-x2), one per
# GPU, after a first list of stages that both need (checkpoints) has run once:
#
#   bash scripts/gpu_parallel.sh "FIRST STAGES" "GPU0 STAGES" "GPU1 STAGES"
#
# Each side writes under $OUT/g0 or $OUT/g1 and logs to $OUT/gN/session.log; at the end
# everything is packed into $OUT/results.tgz (the device tool brings back 8 files at most)
# and each side's log tail is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/g0" "$OUT/g1"
OUT="$OUT/g0" bash scripts/gpu_session.sh $1 2>&1 | tee "$OUT/g0/first.log" | tail -5
for g in 0 1; do
  stages=$([ $g = 0 ] && echo "$2" || echo "$3")
  # SESSION_TIMEOUT (s) ends a side that runs long, so what it finished still comes back.
  (CUDA_VISIBLE_DEVICES=$g OUT="$OUT/g$g" timeout "${SESSION_TIMEOUT:-100000}" bash scripts/gpu_session.sh $stages \
     > "$OUT/g$g/session.log" 2>&1) &
done
wait
for g in 0 1; do echo "===== GPU $g"; tail -c 5000 "$OUT/g$g/session.log"; done
tar czf /tmp/results.tgz -C "$OUT" g0 g1 && rm -rf "$OUT/g0" "$OUT/g1" && mv /tmp/results.tgz "$OUT/results.tgz"
ls -la "$OUT"
