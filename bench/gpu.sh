#!/usr/bin/env bash
# The GPU machine's side of a measurement call: installs the carried wheels, records the commit, then
# runs its arguments in order, each a named stage or a shell command, everything written under $OUT.
#
#   bash bench/gpu.sh STAGE|COMMAND ...
#   e.g. bash bench/gpu.sh kernels "python3 -m bench gemv --out \$OUT/bench_gemv.json" judge-public
#
# The machine gets a copy of the working tree without .git: write `git rev-parse HEAD > .commit` first.
# Carried wheels (each folder named in the call's carry where needed; pip download them for Python 3.12):
#   .whl        the judge's Qwen3 reference: transformers 4.51.3, tokenizers 0.21.1, huggingface_hub 0.30.2
#   .whl_serve  the server's libraries (FastAPI, uvicorn, prometheus-client and their needs), for `bench serve`
#   .whl_fla    flash-linear-attention (fla-core, einops), for a GDN comparison against fla
# Stages:
#   kernels           the GPU kernel and engine tests (pytest -m gpu, file groups in parallel) -> pytest_gpu.log
#   judge-public      the judge, official, the public workloads, synthetic Qwen3-4B -> judge_public.json/.png
#   judge-public-q35  the same on a synthetic Qwen3.5-4B -> judge_public_q35.json/.png
#   judge-spec, judge-spec-q35  the same with speculation "auto" (FASTQWEN_SPECULATION, the deployment's variable; the
#                     report lists it among its engine switches) -> judge_spec_public[_q35].json/.png
#                     (a machine's first judge compiles the kernels in its warmups: on a fresh machine
#                     judge-public-q35 and judge-spec-q35 do not fit one 600 s call together)
#   judge-ab, judge-ab-q35  the same with an earlier engine folder as a third, never-gated side in the
#                     same run (--baseline .base/engine: carry .base, made here with
#                     `mkdir -p .base && git archive COMMIT engine | tar -x -C .base`) -> judge_ab[_q35].json
#   gdn               the GDN prompt pass against the reference and fla (carried in .whl_fla) -> bench_gdn_prefill.json
#   gdn-rows          a verify's exact GDN rows at 1 and 4 sequences, 7 rows from chunk rows 0, 24 and 57: each
#                     phase's cycles a row (fused_rows' stamps), beside the graphed launch
#                     -> bench_gdn_rows.json, bench_gdn_rows_b4.json
#   spec, spec-q35    bench spec's curve at batch 4 and 16 (SPEC_SHAPES, SPEC_ARMS, 3 and 4 drafts) on synthetic
#                     Qwen3-4B / Qwen3.5-4B (its MTP head with the 32,768-token draft vocabulary)
#                     -> spec_qwen3.json / spec_qwen35.json
#   spec-b1           the curve at one sequence (1 x 1024 x 256; the oracle at 0.5-1; Qwen3 k = 3, 4 and 8, Qwen3.5
#                     k = 3, 4, 6 and 8 with its MTP head, so built to verify: its products on the tensor cores),
#                     and Qwen3.5's plain step on the one-row fma kernel its plain-first modes run (--one-row fma)
#                     -> spec_qwen3_b1.json, spec_qwen35_b1.json, spec_qwen35_b1_one_row_fma.json
#   spec-tests        the GPU tests of a verify's bits (the widened GEMV tiles, the one-row tensor-core tile, the
#                     conv of a verify's rows, the LM screen's rows, the attention's split count, speculation's
#                     tokens), two pytest
#                     groups at once -> pytest_spec.log
#   spec-auto, spec-auto-q35  auto against plain decode, median of 5 pairs, on the public and own shapes, and
#                     every drafter's tokens against plain's there (AUTO_ARMS; Qwen3.5 adds its MTP head; the
#                     shapes AUTO_Q3_SHAPES / AUTO_Q35_SHAPES, the file's suffix AUTO_SUFFIX: on an H100 Qwen3.5's
#                     seven shapes with auto and mtp take ~440 s beside the synth's ~60)
#                     -> spec_auto_qwen3.json / spec_auto_qwen35.json
#   spec-tests-conv   spec-tests' conv of a verify's rows alone -> pytest_conv_rows.log
#   screen-rows-tests the LM screen's tests of a verify's rows (its integer pass against the reference, each
#                     row's pick the GEMV's on the real heads) beside the engine's speculation GPU tests
#                     -> pytest_screen_rows.log
#   spec-b1-q35       spec-b1's Qwen3.5 run alone -> spec_qwen35_b1.json
#   shared-tiles     bench gemv --shared: the fma products' verify row tiles (block_m 1, 2, 4; fewer columns a
#                     program) at 2-5 rows, timed, each row's bits against the one-row launch -> bench_gemv_shared.json
#   one-row-tiles     bench gemv at one row, tensor-core configs only (dot, dot_t: the tiles a verify's rows can share)
#                     against the table's and cuBLAS, both families -> bench_gemv_one_row_tensor_cores.json
#   exact-step-tests  the exact GDN step's GPU tests (the one-row step's bits, a verify's rows in one launch against
#                     the steps), a process a test (each compiles its own kernels cold), beside the engine's
#                     speculation GPU tests -> pytest_exact_step.log
#   profile-verify, profile-verify-q35  device time per kernel of a plain step and a verify of 1, 3 and 4 drafts
#                     (bench prefill --verify) at the speculation curve's shapes -> profile_verify_qwen3[5].json
#   profile-spec-q35-b1  where Qwen3.5's cycle goes at one sequence (1 x 1024 x 256, the oracle at 0.9, 6, 7 and 8
#                     drafts, the MTP head with its 32,768-token draft vocabulary): bench spec --profile, each part's
#                     kernels (the head's drafts, the verify's rows, screen, rollback, the head's pass) and the
#                     graphs' gaps, beside speculation off's plain step (fma) -> profile_spec_qwen35_b1.json,
#                     spec_qwen35_b1_one_row_fma.json, token_map_32768.json
#   spec-b1-q35-ab    Qwen3.5 at one sequence (a = 0.9, 6 and 7 drafts, the 32,768-token map, median of 5) on an
#                     earlier engine (.base/engine, as judge-ab) and on this one, a process each
#                     -> spec_qwen35_b1_ab_base.json, spec_qwen35_b1_ab_head.json
#   spec-b1-q35-map   Qwen3.5's batch-1 curve (a = 0.5-1, 6 / 7 / 8 drafts) with the MTP head's draft vocabulary of
#                     32,768 tokens, beside speculation off's plain step (fma) -> spec_qwen35_b1_map.json,
#                     spec_qwen35_b1_one_row_fma.json, token_map_32768.json
#   serve, serve-q35  bench serve: generate() at batch 1 and 16 beside the server at one stream and 16 streams
#                     (Qwen3.5 with pages of 64) -> serve_qwen3.json / serve_qwen35.json
#   serve-cap        128 requests of 1,024 + 256 under a 24 GiB cap, pages of 64 -> serve_qwen3_memory_cap.json
#   startup          a cold start (empty Triton cache: the server's kernel precompile beside its weight load),
#                     a warm one, one on a cache built with the GPU hidden (the README's image build) and a
#                     profiled one, synthetic Qwen3.5-4B and Qwen3-4B -> startup_qwen35.json / startup_qwen3.json
#   fidelity          which op moves the logits, synthetic Qwen3-4B -> fidelity_qwen3.json
#   fidelity-q35      the same on a synthetic Qwen3.5-4B -> fidelity_qwen35.json
# Any other argument runs as a command (bash -c), e.g. a `python3 -m bench ENTRY ... --out $OUT/FILE.json`.
# $OUT brings back at most 8 files, 2 folders deep; this script's own log is gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

install() {   # FOLDER TARGET: FOLDER's wheels into TARGET, once per machine
  [ -d "$1" ] || return 0
  [ -f "$2/.done" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl \
    && touch "$2/.done"
}
checkpoint() {   # PRESET -> its synthetic checkpoint's folder, made on the GPU once per machine (as bench does)
  python3 -c "import sys; from bench.runner import resolve_model; print(resolve_model(sys.argv[1]))" "$1"
}
q35_site() {   # the machine's own Transformers 5.x: the Qwen3.5 reference's environment (fastqwen/refenv.py)
  PYTHONPATH= python3 -c "import os, transformers; print(os.path.dirname(os.path.dirname(transformers.__file__)))"
}
judge() {   # NAME MODEL_DIR: the judge, official (5 samples, every gate), on the public workloads
  [ -n "$2" ] || { echo "gpu.sh: no checkpoint for judge_$1"; return 1; }
  # its progress kept whole in $OUT (a call that runs out of time still brings back the samples so far)
  timeout 560 python3 -m fastqwen.cli judge --engine engine --official --workloads public --model "$2" \
    --out "$OUT/judge_$1.json" --chart "$OUT/judge_$1.png" 2>&1 | tee "$OUT/judge_$1.log" | tail -60
}

judge_ab() {   # NAME MODEL_DIR: judge() with .base/engine as the baseline side (the before/after A/B)
  [ -d .base/engine ] || { echo "gpu.sh: judge-ab needs an earlier engine/ in .base/engine (carry .base)"; return 1; }
  [ -n "$2" ] || { echo "gpu.sh: no checkpoint for judge_ab_$1"; return 1; }
  timeout 590 python3 -m fastqwen.cli judge --engine engine --baseline .base/engine --official --workloads public \
    --model "$2" --out "$OUT/judge_ab_$1.json" --chart "$OUT/judge_ab_$1.png" 2>&1 | tail -60
}

kernels() {   # pytest -m gpu over the kernel and engine tests, groups of files at once (Triton's compiles
  # are CPU work that one process leaves mostly idle; serially they outrun a call). Each group is
  # pytest arguments as shell words; the GDN prompt-pass plans compile most and get a group alone.
  local plans="every_prefill_plan or bf16_pair"
  local groups=(
    "tests/kernels/test_decode_attention.py tests/kernels/test_argmax.py tests/kernels/test_paged_kv_writes.py tests/kernels/test_rows_copy.py tests/kernels/test_spec_plain.py"
    "tests/kernels/test_gemv.py tests/kernels/test_lm_screen.py tests/kernels/test_rmsnorm_order.py"
    "tests/kernels/test_gdn_kernels.py -k '$plans'"
    "tests/kernels/test_gdn_kernels.py -k 'not ($plans)'"
    "tests/kernels/test_gdn_exact_step.py"
    "tests/kernels/test_gdn_exact_step_plan.py tests/kernels/test_sigmoid_gate.py"
    "tests/kernels/test_qwen35_step.py tests/kernels/test_norm_rope_swiglu.py tests/kernels/test_pdl.py tests/kernels/test_compile_sm90.py"
    "tests/test_engine_gpu.py"
    "tests/test_judge.py tests/test_synth.py")
  local i
  for i in "${!groups[@]}"; do
    eval "timeout ${KERNELS_TIMEOUT_S:-480} python3 -m pytest -q -rf --tb=line -p no:cacheprovider -m gpu ${groups[$i]}" \
      > "/tmp/pytest_gpu_$i.log" 2>&1 &
  done
  wait
  for i in "${!groups[@]}"; do echo "-- ${groups[$i]}"; tail -25 "/tmp/pytest_gpu_$i.log"; done > "$OUT/pytest_gpu.log"
  cat "$OUT/pytest_gpu.log"
}

# the speculation curve's shapes and arms (the oracle at a, each at k = 3 and 4; batch 1 is spec-b1's and
# spec-b1-q35-map's; auto is the spec-auto stages')
SPEC_SHAPES=${SPEC_SHAPES:-4x2048x128,16x512x128}
SPEC_ARMS=${SPEC_ARMS:-oracle:0.5,oracle:0.7,oracle:0.9,oracle:1}
# the identity and auto stages' arms: every drafter's tokens against plain's, auto's speed against plain's
AUTO_ARMS=${AUTO_ARMS:-ngram,oracle:0.5,oracle:0.9,auto}
AUTO_Q3_SHAPES=${AUTO_Q3_SHAPES:-1x512x32,4x2048x32,16x512x128,1x2048x64,2x512x256,3x1024x96,8x768x48,12x1536x40,16x2048x32}
AUTO_Q35_SHAPES=${AUTO_Q35_SHAPES:-1x512x32,4x2048x32,16x512x128,1x4096x64,2x1000x128,8x768x64,16x1536x48}

token_map() {   # PRESET SIZE OUT: the MTP head's draft vocabulary of PRESET's checkpoint over the embedded corpus
  [ -f "$3" ] && return 0          # made by an earlier stage on this machine (its report already in $OUT)
  timeout 60 python3 -m fastqwen.cli token-map --model "$(checkpoint "$1")" --corpus fastqwen/data/corpus.txt \
    --size "$2" --out "$3" --report "$OUT/token_map_$2.json" 2>&1 | tail -n 2
}

fma_b1_q35() {   # speculation off's plain step at one sequence (the one-row fma products), the curve's baseline
  timeout 90 python3 -m bench spec --model qwen3.5-4b --shapes 1x1024x256 --one-row fma --arms oracle:0.9 --k 3 \
    --out "$OUT/spec_qwen35_b1_one_row_fma.json"
}

spec_b1_q35() {   # spec-b1's Qwen3.5 curve (built with its MTP head, so to verify every step)
  timeout 200 python3 -m bench spec --model qwen3.5-4b --shapes 1x1024x256 --arms "$SPEC_ARMS,mtp" --k 3,4,6,8 \
    --out "$OUT/spec_qwen35_b1.json"
}

main() {
  install .whl /tmp/site && install .whl_serve /tmp/serve_site && install .whl_fla /tmp/fla_site \
    || { echo "gpu.sh: the carried wheels did not install"; return 1; }
  # The machine's own Transformers is 5.x; the judge's Qwen3 reference needs the carried 4.51.3 first on
  # the path (a bare `python3 -m fastqwen.cli judge` there replays native on the wrong version).
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  # Off the path: only the server's processes (bench/serve.py) and an fla arm load these.
  export BENCH_SERVE_SITE=/tmp/serve_site BENCH_FLA_SITE=/tmp/fla_site
  # The judge's reports and bench's headers read the commit from here (no .git on this machine).
  export FASTQWEN_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
  echo "commit $FASTQWEN_COMMIT; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  for stage in "$@"; do
    echo "== $stage $(date -u +%T)"
    case $stage in
      kernels) kernels ;;
      judge-public) judge public "$(checkpoint qwen3-4b)" ;;
      judge-public-q35) FASTQWEN_QWEN35_SITE=$(q35_site) judge public_q35 "$(checkpoint qwen3.5-4b)" ;;
      judge-spec) FASTQWEN_SPECULATION=auto judge spec_public "$(checkpoint qwen3-4b)" ;;
      judge-spec-q35) FASTQWEN_SPECULATION=auto FASTQWEN_QWEN35_SITE=$(q35_site) judge spec_public_q35 "$(checkpoint qwen3.5-4b)" ;;
      judge-ab) judge_ab public "$(checkpoint qwen3-4b)" ;;
      judge-ab-q35) FASTQWEN_QWEN35_SITE=$(q35_site) judge_ab public_q35 "$(checkpoint qwen3.5-4b)" ;;
      gdn) timeout 560 python3 -m bench gdn --out "$OUT/bench_gdn_prefill.json" ;;
      gdn-rows) timeout 300 python3 -m bench gdn-rows --out "$OUT/bench_gdn_rows.json" \
                  && timeout 200 python3 -m bench gdn-rows --batch 4 --out "$OUT/bench_gdn_rows_b4.json" ;;
      spec) timeout 560 python3 -m bench spec --model qwen3-4b --shapes "$SPEC_SHAPES" --arms "$SPEC_ARMS" --k 3,4 \
              --out "$OUT/spec_qwen3.json" ;;
      spec-q35)
        token_map qwen3.5-4b 32768 /tmp/map_32768.pt
        timeout 500 python3 -m bench spec --model qwen3.5-4b --shapes "$SPEC_SHAPES" --arms "$SPEC_ARMS" --k 3,4 \
          --speculative-token-map /tmp/map_32768.pt --out "$OUT/spec_qwen35.json" ;;
      spec-b1)
        timeout 170 python3 -m bench spec --model qwen3-4b --shapes 1x1024x256 --arms "$SPEC_ARMS" --k 3,4,8 \
          --out "$OUT/spec_qwen3_b1.json"
        spec_b1_q35
        timeout 120 python3 -m bench spec --model qwen3.5-4b --shapes 1x1024x256 --one-row fma --arms oracle:0.9 --k 3,4 \
          --out "$OUT/spec_qwen35_b1_one_row_fma.json" ;;
      spec-b1-q35) spec_b1_q35 ;;
      exact-step-tests)
        timeout "${KERNELS_TIMEOUT_S:-400}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu \
          tests/test_engine_gpu.py -k 'specul or verif' > /tmp/pytest_exact_engine.log 2>&1 &
        python3 -m pytest --collect-only -q -m gpu tests/kernels/test_gdn_exact_step.py 2>/dev/null | grep '::' \
          | xargs -P 12 -I{} bash -c 'log="/tmp/pytest_exact_case_$(echo "$1" | md5sum | cut -c1-8).log"
              timeout "${KERNELS_TIMEOUT_S:-400}" python3 -m pytest -q -rf --tb=line -p no:cacheprovider -m gpu "$1" \
                > "$log" 2>&1; rc=$?; [ $rc -eq 124 ] && echo "not finished $1" || echo "$(tail -n 1 "$log") $1"' _ {} \
          > /tmp/pytest_exact_ids.log
        wait
        { sort /tmp/pytest_exact_ids.log; grep -l -E "^(FAILED|E )" /tmp/pytest_exact_case_*.log | xargs -r tail -n 15
          echo "-- tests/test_engine_gpu.py -k 'specul or verif'"; tail -n 25 /tmp/pytest_exact_engine.log; } \
          | tee "$OUT/pytest_exact_step.log" ;;
      screen-rows-tests)
        timeout 300 python3 -m pytest -q -rf --tb=short -p no:cacheprovider tests/kernels/test_lm_screen.py -k rows \
          > /tmp/pytest_screen_rows.log 2>&1 &
        timeout 300 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/test_engine_gpu.py \
          -k 'specul or verif' > /tmp/pytest_spec_engine.log 2>&1 &
        wait
        tail -n 25 /tmp/pytest_screen_rows.log /tmp/pytest_spec_engine.log | tee "$OUT/pytest_screen_rows.log" ;;
      spec-tests-conv) timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/kernels/test_gdn_kernels.py \
                         -k conv_gates_rows 2>&1 | tail -n 20 | tee "$OUT/pytest_conv_rows.log" ;;
      spec-tests)
        timeout 400 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/kernels/test_gemv.py tests/kernels/test_gdn_kernels.py \
          tests/kernels/test_lm_screen.py -k 'shared or one_row or conv_gates_rows or rows' \
          > /tmp/pytest_spec_0.log 2>&1 &
        timeout 400 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/test_engine_gpu.py \
          -k 'specul or verif or width or splits' > /tmp/pytest_spec_1.log 2>&1 &
        wait
        tail -n 40 /tmp/pytest_spec_0.log /tmp/pytest_spec_1.log | tee "$OUT/pytest_spec.log" ;;
      spec-auto) timeout 560 python3 -m bench spec --model qwen3-4b --arms "$AUTO_ARMS" --reps 5 \
                   --out "$OUT/spec_auto_qwen3${AUTO_SUFFIX:-}.json" --shapes "$AUTO_Q3_SHAPES" ;;
      spec-auto-q35) timeout 560 python3 -m bench spec --model qwen3.5-4b --arms "$AUTO_ARMS,mtp" --reps 5 \
                       --out "$OUT/spec_auto_qwen35${AUTO_SUFFIX:-}.json" --shapes "$AUTO_Q35_SHAPES" ;;
      shared-tiles) timeout 400 python3 -m bench gemv --shared --ops qwen3 qwen3.5 --rows 2,3,4,5 \
                      --out "$OUT/bench_gemv_shared.json" ;;
      one-row-tiles) timeout 400 python3 -m bench gemv --ops qkv o gate_up_silu down q35_in_proj q35_qkv q35_gate_up_silu \
                       q35_down --rows 1 --modes dot,dot_t --budget-s 300 \
                       --out "$OUT/bench_gemv_one_row_tensor_cores.json" ;;
      profile-verify) timeout 400 python3 -m bench prefill --model qwen3-4b --shapes 1x1024,4x2048,16x512 --steps 5 \
                        --verify 1,3,4 --top 25 --out "$OUT/profile_verify_qwen3.json" ;;
      profile-spec-q35-b1)
        token_map qwen3.5-4b 32768 /tmp/map_32768.pt
        fma_b1_q35
        timeout 300 python3 -m bench spec --model qwen3.5-4b --shapes 1x1024x256 --arms oracle:0.9 --k 6,7,8 \
          --speculative-token-map /tmp/map_32768.pt --profile 5 --top 25 --out "$OUT/profile_spec_qwen35_b1.json" ;;
      spec-b1-q35-ab)
        [ -d .base/engine ] || { echo "gpu.sh: spec-b1-q35-ab needs an earlier engine/ in .base/engine (carry .base)"; continue; }
        token_map qwen3.5-4b 32768 /tmp/map_32768.pt
        for side in base:.base/engine head:engine; do
          timeout 240 python3 -m bench spec --engine "${side#*:}" --model qwen3.5-4b --shapes 1x1024x256 --arms oracle:0.9 \
            --k 6,7 --reps 5 --speculative-token-map /tmp/map_32768.pt --out "$OUT/spec_qwen35_b1_ab_${side%%:*}.json"
        done ;;
      spec-b1-q35-map)
        token_map qwen3.5-4b 32768 /tmp/map_32768.pt
        fma_b1_q35
        timeout 400 python3 -m bench spec --model qwen3.5-4b --shapes 1x1024x256 --arms oracle:0.5,oracle:0.7,oracle:0.9,oracle:1,mtp \
          --k 6,7,8 --speculative-token-map /tmp/map_32768.pt --out "$OUT/spec_qwen35_b1_map.json" ;;
      profile-verify-q35) timeout 400 python3 -m bench prefill --model qwen3.5-4b --shapes 1x1024,4x2048,16x512 \
                            --steps 5 --verify 1,3,4 --top 25 --out "$OUT/profile_verify_qwen35.json" ;;
      serve) timeout 560 python3 -m bench serve --model qwen3-4b --streams 1,16 --waves 2 --engine-reps 3 \
               --out "$OUT/serve_qwen3.json" ;;
      serve-q35) timeout 560 python3 -m bench serve --model qwen3.5-4b --streams 1,16 --waves 2 --engine-reps 3 \
                   --block-size 64 --out "$OUT/serve_qwen35.json" ;;
      serve-cap) timeout 560 python3 -m bench serve --model qwen3-4b --no-engine --streams 128 --max-batch 128 --waves 1 \
                   --prompt-len 1024 --output-len 256 --max-model-len 1280 --block-size 64 --memory-gib 24 \
                   --out "$OUT/serve_qwen3_memory_cap.json" ;;
      startup)
        for pair in qwen3.5-4b:qwen35 qwen3-4b:qwen3; do
          timeout 290 python3 -m bench startup --model "${pair%%:*}" --image-build --profile \
            --out "$OUT/startup_${pair##*:}.json"
        done ;;
      fidelity) timeout 560 python3 -m bench fidelity --model qwen3-4b --out "$OUT/fidelity_qwen3.json" ;;
      fidelity-q35) FASTQWEN_QWEN35_SITE=$(q35_site) timeout 560 python3 -m bench fidelity --model qwen3.5-4b \
                      --out "$OUT/fidelity_qwen35.json" ;;
      *) bash -c "$stage" ;;
    esac
  done
}

# Piped through tee, not `exec > >(tee)`: the log is whole when the call returns.
main "$@" 2>&1 | tee -a "$OUT/gpu.log"
