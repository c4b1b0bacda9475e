#!/usr/bin/env bash
# The GPU machine's side of a measurement run: one call runs the named stages in
# order and writes everything under $OUT (the device tool brings $OUT back).
#
#   bash scripts/gpu_session.sh STAGE...     e.g.  kernels profile check judge-public
#
# Carry `.whl` (transformers 4.51.3, tokenizers 0.21.1, huggingface_hub 0.30.2
# wheels for the reference) and `.commit` (`git rev-parse HEAD > .commit` here:
# the machine gets a copy of the tree without .git).
# Stages:
#   kernels       every GPU kernel test and the engine's GPU tests (-m gpu)
#   bench         GEMV and decode-attention benchmarks (JSON per kernel)
#   bench-gemv    the GEMV sweep alone, wider (per-M candidates, 150 s budget)
#   bench-m1      the GEMV sweep at one row only
#   bench-gemv-q35  the GEMV sweep on Qwen3.5-4B's decode products (table entries for them)
#   bench-rows    the GEMV sweep at 4 and 16 rows (tl.dot tiles, both operand orders)
#   opswap-4b     which op moves the logits, qwen3-4b only (4x512x32)
#   profile       per-kernel device time of a decode step and a prefill
#   attn-probe    decode attention variants: bits against the full forward, and speed
#   kernels-attn  the decode-attention GPU tests alone
#   kernels-early the GPU tests of the reads before PDL's wait (attention, prologues, the exact step's early and w S_c
#                 cases) and of the gate in the attention's merge (EARLY_TESTS_TIMEOUT_S, default 420; EARLY_TESTS_K,
#                 pytest's -k, default those tests)
#   exact-step-bits  the exact GDN step's bits alone at the 4B's shapes, its defaults under this environment's
#                 FASTQWEN_GDN_STEP_* (gpu_exact_step.py --forms 0 --bits-only; EXACT_STEP_BATCHES)
#   q35-ckpt      the synthetic Qwen3.5-4B alone (/tmp/q35_4b), e.g. beside other stages
#   check         engine speed, fidelity against native, graph == eager
#   opswap        which op moves the logits (tiny and 4B)
#   judge-tiny    the judge's embedded default workloads on the tiny checkpoint, official
#   judge-public  the judge, official, public workloads, qwen3-4b
#   judge-own     the judge, official, results/workloads/own.json, qwen3-4b
#   judge-public-b1  the judge, official, the public batch-1 shape alone
#   judge-public-b4-b16  the judge, official, the public batch-4 and batch-16 shapes
#   judge-long    the judge, official, results/workloads/long.json (32K and 16K prompts)
#   memory        peak memory per shape in fresh processes (gpu_memory.py's default --mlp-rows 16384,0
#                 adds the unsliced prefill MLP: the slicing A/B)
#   judge-public-b1-nopdl  the public batch-1 shape with PDL off (as on the platform's Triton 3.1)
# Run every judge through this script: it puts the carried Transformers 4.51.3 first
# on the path and stamps the commit (a bare `python3 -m fastqwen.cli judge` on the
# machine loads its Transformers 5.x for the native side and reports no commit).
#   engine-gpu    the engine's GPU tests; on a failure later stages run without prefill graphs
#   speed-nopdl   gpu_check's speed part with FASTQWEN_NO_PDL=1 (the PDL A/B, same machine)
# A failing `kernels` stage turns PDL off for the stages after it.
#   all-checks    kernels check judge-public judge-own
# Exactness (issue 11):
#   ckpt-hf       /tmp/q4b_hf: the 4B shape with Transformers' own init, final norm raised to 7
#   ckpt-massive  /tmp/q4b_massive: the 4B shape with planted massive activations (synth --massive-activations)
#   ckpt-window   /tmp/q4b_w4096: /tmp/q4b's weights under a config with sliding_window 4096
#   opswap-a      which op moves the batch logits, /tmp/q4b (the project's init), batch 16 and 64
#   opswap-b      the same on /tmp/q4b_hf, batch 4, 16, 32 and 64
#   judge-window  the judge (public mode, 1 sample) on /tmp/q4b_w4096, results/workloads/window.json
#   opswap-a2, opswap-b2  the engine against native after a change: fewer variants, batch 1-64
#   reduce-probe  which summation order torch's CUDA mean uses (scripts/gpu_reduce_order_probe.py),
#                 norm kernel per-launch time, and the norm kernel tests with every failure listed
#   judge-fid1-a/-b, judge-fid2-a/-b  the judge, official, results/workloads/fidelity_{1,2}.json on /tmp/q4b (a)
#                 or /tmp/q4b_hf (b); with FID_BASELINE=1, base/engine (an earlier commit's engine) as --baseline
#   judge-public-ab, judge-window-official, judge-massive  the same for the public set, the windowed
#                 checkpoint and /tmp/q4b_massive (ckpt-massive); judge-massive-nb, judge-window-nb without the
#                 baseline (judge-window-nb needs ckpt-window first)
#   opswap-b3     /tmp/q4b_hf, batch 4-64: the engine, with the tl.sum norm kernel, with torch's norms
#                 and with one-split attention
#   opswap-b4     /tmp/q4b_hf, the fidelity set's (16, 1024, 192), (16, 512, 128) and (4, 2048, 160): the engine,
#                 with the tl.sum norm kernel and with torch's norms
#   judge-q35     the judge (public mode) on a synthetic Qwen3.5-4B against the machine's Transformers 5.17
#                 (written before any GPU run of the Qwen3.5 path: its first call tells whether it works)
#   judge-q35-eager  judge-q35 with FASTQWEN_NO_PREFILL_GRAPHS=1 (every prompt pass eager)
#   judge-q35-official, judge-q35-own  the judge, official (5 samples), on /tmp/q35_4b: the public set, and
#                 results/workloads/q35_own.json (issue 12's own shapes)
#   judge-q35-own-exact  results/workloads/q35_own_b2_b16.json (two own shapes), official, FASTQWEN_GDN_EXACT_PREFILL=1
#   judge-q35-exact  judge-q35-official with FASTQWEN_GDN_EXACT_PREFILL=1 (the prompt pass's rule in the
#                 reference's order, gdn_exact.py: its bits)
#   judge-q35-xdecode, judge-q35-own-xdecode  judge-q35-official / -own with FASTQWEN_GDN_EXACT_DECODE=1 (each
#                 GDN decode step the full forward's row, gdn_exact_step.py); JUDGE_SAMPLES=N: N samples, not 5
#   q35-opswap-xdecode  q35-opswap's engine alone with FASTQWEN_GDN_EXACT_DECODE=1, seeds 5 and 6
#   q35-opswap    Qwen3.5, teacher-forced on native's own tokens: mean / p99 / max logit distance to the full
#                 forward of the engine, of variants with one piece swapped, and of native's cached decode
#                 (gpu_q35_opswap.py; OPSWAP_SHAPES, default 16x512x128,4x2048x32; OPSWAP_VARIANTS, default all; OPSWAP_SEEDS, the prompts' seeds, default 5)
#   q35-check     Qwen3.5's triton backend piece by piece (gpu_q35_check.py): teacher-forced against the
#                 torch backend, the graph against eager, step and prompt-pass times, kernel profiles
#   rule-bits     each piece of the reference chunked rule (torch's ops as it calls them) against Triton
#                 kernels of known order: the fraction bit-equal (gpu_rule_bits_probe.py; 4x2048, 1x512)
#   serve-rates   serve-bench's runs on /tmp/q4b, pages of 64 (graphed admission), request rates included
#   serve-16      serve-rates' one-stream and 16-stream runs alone (short and long)
#   serve-cap     serve-bench's 24 GiB cap run alone: 64 requests of 1,024 + 256 at once, the peak running (rows)
#   serve-cap-paged  the same on the paged KV cache (pages of 64 positions)
#   kernels-gdn-exact  the GDN rule in the reference's order (gdn_exact.py) against the reference, bit for bit
#   kernels-gdn-exact-step  the GDN decode step in the full forward's arithmetic (gdn_exact_step.py) against the
#                 reference's rule over the whole sequence, bit for bit
#   exact-step    that step's bits (its replicas of torch's l2 norm and cumsum too) and time in 64-step graphs at
#                 the 4B's shapes, beside the recurrent step (gpu_exact_step.py; EXACT_STEP_BATCHES, default 1,4,16)
#   exact-step-ncu  Nsight Compute over that step (its default form) at B = 1 and 16 (stall reasons by line)
#   use-best-exact-step  exports the exact-step's best bit-equal form (FASTQWEN_GDN_STEP_*) for the later stages
#   exact-rule    that rule's bits and time against the reference's ops and the fast kernels (gpu_exact_rule.py)
#   trsm-bits     the rule's triangular solves against ~50 emulated solve orders, per row (gpu_trsm_probe.py)
#   gdn-probe     the GDN prompt pass's three kernels timed whole and with one stage taken out (gpu_gdn_probe.py)
#   prefill-pieces  the GDN layers' gated norm and conv at prompt sizes under other launches, bits against the
#                 default (scripts/gpu_prefill_pieces.py)
#   gdn-ncu       Nsight Compute over the GDN prompt pass's three kernels (gpu_gdn_passes.py; NCU_SHAPE, default
#                 4x8192): stall reasons, occupancy, throughput, into gdn_ncu.txt
#   bench-gdn     the GDN prompt pass: our chunked kernels against the torch reference (and fla if installed)
#   paged-attn-probe  the paged decode attention against the row one, pipeline depths 2-5, bits checked
#                 (scripts/gpu_paged_attn_probe.py)
#   serve-q35-snapgraph  serve-q35 with FASTQWEN_GRAPH_SNAPSHOT_PASSES=1 (each run's prompt passes by kind:
#                 prompt_passes in the report)
#   slots-gpu     the slots' GPU tests alone (tests/test_engine_gpu.py -k "slots or chunked_admission"): rows, pages,
#                 chunk graphs, Qwen3.5's graphed admission with its snapshots
#   kernels-paged the paged KV cache's GPU tests (decode attention and KV writes through block tables, paged slots)
#   kernels-screen  the screened LM head's GPU tests (engine/fqkernels/lm_screen.py)
#   lm-screen-q35, lm-screen-q3  the screened LM head on the synthetic Qwen3.5-4B (exact decode) / Qwen3-4B:
#                 picks, candidates, the tail's kernels by plan, the graphed step and generate with and without
#   q35-step      q35-check's timings alone (--timing-only): the decode step's graphed step times
#   q35-step-arms the graphed step under several settings in one process, interleaved (gpu_q35_check.py --arms;
#                 Q35_ARMS, default exact,fast; Q35_ARMS_SHAPES,
#                 default the public set; Q35_ARMS_ROUNDS, default 3; Q35_ARMS_PROFILE, shapes BxP whose eager
#                 step is profiled kernel by kernel with the process's own settings, e.g. 1x512; Q35_ARMS_WARM,
#                 default 4: processes that compile the arms' kernels first, in parallel)
#   q3-early-arms Qwen3-4B (/tmp/q4b): the graphed step with the attention's early reads (fqkernels.pdl.EARLY) off
#                 and on, interleaved (gpu_check.py --early-arms; Q3_ARMS_SHAPES, default the public set;
#                 Q3_ARMS_ROUNDS, default 3)
#   q35-gemv-ab   the decode step's time with the GEMV table and with other configs, one process an arm
#                 (gpu_q35_check.py --gemv): Q35_AB_ARMS (default "table in_proj_n16 session13"; also rows4,
#                 the 2-4 row candidates), Q35_AB_SHAPES (default 1x512x32)
#   chunk-probe   a chunked prompt's time in the engine's slots, no server (scripts/gpu_chunk_probe.py)
#   serve-paged   serve-bench's one stream, 16 streams and the shared-prefix pair (prefix_0 / prefix_384) with the
#                 paged KV cache (--block-size 64)
#   serve-q35     the same on the synthetic Qwen3.5-4B (prefix sharing through GDN state snapshots)
#   serve-chunked serve-bench's one stream, 16 streams and rates 4 / 16 with --prefill-chunk SERVE_CHUNK (default 256)
#   serve-bench   fastqwen serve on /tmp/q4b driven by bench-serve (scripts/gpu_serve_bench.py): one stream's
#                 TPOT against the engine's batch 1, 16 streams of 512 + 128, rates 1 / 4 / 16, 64 requests of
#                 1024 + 256 under a 24 GiB memory cap, slots sized by it (carry .whl_serve)
#   use-best-gdn-plan  FASTQWEN_GDN_PLAN for the later stages: the fastest plan bench-gdn-sweep found (within the
#                 state and output gates against the reference; BEST_AMONG: among these plans, comma list)
#   bench-gdn-sweep  every launch plan of the prompt pass's kernels (bench_gdn.py SWEEP) at 1x512, 1x2048, 4x2048, 16x8192
#                 (SWEEP_PLANS / SWEEP_SHAPES: comma lists, some plans or shapes only; the plan "fla" times
#                 flash-linear-attention on the same inputs; SWEEP_TIMEOUT_S, default 300)
#   kernels-gdn-prefill  test_gdn_kernels.py's prompt-pass and in_proj epilogue tests alone
#   gemm-probe    can a decode-sized product give the full forward's large-M bits (scripts/gpu_gemm_order_probe.py)
#   gemm-inorder  o and down without split-K: bits against the large-M product and time per config
#                 at 4-64 rows, against the table's config and cuBLAS (scripts/gpu_gemm_inorder.py)
#   gemm-inorder2 the same with deeper pipelines and 8 warps, at 4 and 16 rows
#   gemm-inorder3 the same with 16-column programs and long K tiles, at 16 and 64 rows
#   gemm-inorder64 every 4B decode product at 48 and 64 rows, 64-row tiles (exact decode past 32 rows)
#   kernels-gemv  the GEMV kernel tests alone, every failure listed
#   decode-bits-a/-b  where a decode step leaves the full forward's bits, layer by layer and per op
#                 variant (scripts/gpu_decode_bits.py), /tmp/q4b (a) or /tmp/q4b_hf (b)
#   attn-bits     which one-split arithmetic gives flash's decode bits (scripts/gpu_attn_bits.py)
#   decode-bits-e gpu_decode_bits.py for the engine as it is (and SDPA attention), /tmp/q4b
#   decode-bits-k the same with decode_attention's FA2 path on (decode-attention knobs)
#   exact-bits    FASTQWEN_EXACT_DECODE=1: is a decode step the full forward's, bit for bit (gpu_decode_bits.py)
#   exact-speed   graphed decode-step time with FASTQWEN_EXACT_DECODE=0 and 1, alternating twice (EXACT_REPS)
#   kernels-gdn   the GDN and Qwen3.5 step kernel tests alone, every failure listed
#   exact-on      FASTQWEN_EXACT_DECODE=1 for every later stage (e.g. exact-on judge-fid2-b; the default
#                 since session 8)
#   kernels-norm  the norm/rope/swiglu kernel tests alone, every failure listed
#   norm-speed    graphed decode-step time per RMSNorm kernel (scripts/gpu_norm_speed.py), /tmp/q4b
#   speed-ab      graphed decode-step time of this tree and of base/ (an earlier commit's tree, if
#                 carried), alternating twice on the same GPU
set -uo pipefail
cd "$(dirname "$0")/.."
# Wheels and checkpoints once per machine, under a lock (gpu_parallel.sh runs two sessions at once).
exec 9>/tmp/fastqwen-ckpt.lock; flock 9
[ -f /tmp/site/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && touch /tmp/site/.done; } || exit 1
# flash-linear-attention (fla-core, einops) in a folder of its own, off PYTHONPATH: only bench_gdn.py
# loads it (FASTQWEN_FLA_SITE), never the reference's process (Transformers would use it there).
if [ -d .whl_fla ] && [ ! -f /tmp/fla_site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla_site .whl_fla/*.whl \
    && touch /tmp/fla_site/.done
fi
# the serving front's libraries (FastAPI, uvicorn, ...) likewise, for the serve-bench stage only
if [ -d .whl_serve ] && [ ! -f /tmp/serve_site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve_site .whl_serve/*.whl \
    && touch /tmp/serve_site/.done
fi
export FASTQWEN_FLA_SITE=/tmp/fla_site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FASTQWEN_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
echo "commit $FASTQWEN_COMMIT" >> "$OUT/gpu.txt"
[ -f /tmp/tiny/config.json ] || python3 -m fastqwen.cli synth --preset tiny --out /tmp/tiny --device cpu >/dev/null 2>&1
if [ ! -f /tmp/q4b/config.json ] && [ -z "${FASTQWEN_NO_Q4B:-}" ]; then   # FASTQWEN_NO_Q4B=1: stages that need no model
  /usr/bin/time -f "synth_qwen3-4b_s %e" python3 -m fastqwen.cli synth --preset qwen3-4b --out /tmp/q4b --device cuda 2>&1 \
    | tail -1 >> "$OUT/gpu.txt"
fi
flock -u 9
q35_site() {  # the machine's own Transformers 5.17 first for the Qwen3.5 reference (fastqwen/refenv.py)
  export FASTQWEN_QWEN35_SITE=$(PYTHONPATH= python3 -c \
    "import os, transformers; print(os.path.dirname(os.path.dirname(transformers.__file__)))")
}
q35_ckpt() {  # the synthetic Qwen3.5-4B the q35 stages run on, made once per machine
  [ -f /tmp/q35_4b/config.json ] || python3 -m fastqwen.cli synth --preset qwen3.5-4b --device cuda \
    --out /tmp/q35_4b 2>&1 | tail -1
}
judge() {  # name, then judge arguments
  local name=$1; shift
  timeout 560 python3 -m fastqwen.cli judge --engine engine --official --out "$OUT/judge_$name.json" \
    --chart "$OUT/judge_$name.png" "$@" 2>&1 | tail -60  # speed table, fidelity table, score and comparison lines
}
# `all-checks`: everything the fast engine's issue asks to be shown, in one call (~10 min).
stages=()
for stage in "$@"; do
  if [ "$stage" = all-checks ]; then stages+=(kernels check judge-public judge-own); else stages+=("$stage"); fi
done
for stage in "${stages[@]}"; do
  echo "== $stage $(date -u +%T)"
  case $stage in
    kernels) timeout 300 python3 -m pytest -q -rf --tb=line -m gpu tests/kernels tests/test_engine_gpu.py 2>&1 \
               | grep -E "FAILED|passed|failed|Error" | tail -30 | tee "$OUT/pytest_gpu.log"
             grep -q failed "$OUT/pytest_gpu.log" && export FASTQWEN_NO_PDL=1 && echo "PDL OFF" ;;
    speed-nopdl) FASTQWEN_NO_PDL=1 timeout 150 python3 scripts/gpu_check.py --model /tmp/q4b --fidelity "" \
                   --speed 1x512x64,4x2048x32,16x512x128 --out "$OUT/gpu_check_nopdl.json" 2>&1 | grep -v Warn | tail -4 ;;
    q3-early-arms) # Qwen3-4B: the graphed step with the attention's early reads off and on (pdl.EARLY), interleaved
                 timeout "${Q3_ARMS_TIMEOUT_S:-240}" python3 scripts/gpu_check.py --model /tmp/q4b --fidelity "" \
                   --speed "${Q3_ARMS_SHAPES:-1x512x64,4x2048x32,16x512x128}" --early-arms "${Q3_ARMS_ROUNDS:-3}" \
                   --out "$OUT/gpu_check_early.json" > "$OUT/gpu_check_early.log" 2>&1
                 python3 -c "import json; d = json.load(open('$OUT/gpu_check_early.json'))
for a in d.get('early_arms', []): print(a['shape'], a['median_ms'], a['on_minus_off_us'], 'tokens_equal', a['tokens_equal'])" ;;
    bench) timeout 100 python3 scripts/bench_gemv.py --out "$OUT/bench_gemv.json" --budget-s 70 2>&1 | tail -25
           timeout 80 python3 scripts/bench_decode_attention.py --out "$OUT/bench_decode_attention.json" 2>&1 | tail -16 ;;
    bench-gemv) timeout 200 python3 scripts/bench_gemv.py --out "$OUT/bench_gemv.json" --budget-s 150 \
                  --ops qkv o down gate_up_silu lm_head 2>&1 | tail -40 ;;
    bench-rows) timeout 220 python3 scripts/bench_gemv.py --out "$OUT/bench_gemv_rows.json" --budget-s 170 --m 4 16 \
                  --ops qkv o down gate_up_silu 2>&1 | tail -14 ;;
    bench-gemv-q35) timeout 300 python3 scripts/bench_gemv.py --out "$OUT/bench_gemv_q35.json" --budget-s "${GEMV_BUDGET_S:-200}" \
                      --m 1 4 --ops q35_down q35_qkv q35_gate_up_silu q35_in_proj 2>&1 | tail -30 ;;
    bench-m1) timeout 120 python3 scripts/bench_gemv.py --out "$OUT/bench_gemv_m1.json" --budget-s 90 --m 1 \
                --ops qkv o down gate_up_silu lm_head 2>&1 | tail -12 ;;
    opswap-4b) timeout 150 python3 scripts/gpu_opswap.py --model /tmp/q4b --shape 4x512x32 --out "$OUT/opswap_4b.json" 2>&1 \
                 | grep -v Warn | tail -16 ;;
    attn-probe) timeout 200 python3 scripts/gpu_attn_probe.py --out "$OUT/attn_probe.json" 2>&1 | grep -v Warn | tail -12 ;;
    kernels-attn) timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_decode_attention.py 2>&1 | tail -4 | tee "$OUT/pytest_attn.log"
                  grep -q failed "$OUT/pytest_attn.log" && export FASTQWEN_NO_PDL=1 && echo "PDL OFF" ;;
    profile) timeout 120 python3 scripts/gpu_profile.py --model /tmp/q4b --out "$OUT/profile.json" 2>&1 | grep -v Warn | tail -45 ;;
    check) timeout 200 python3 scripts/gpu_check.py --model /tmp/q4b --out "$OUT/gpu_check.json" 2>&1 | grep -v Warn | tail -9 ;;
    opswap) timeout 60 python3 scripts/gpu_opswap.py --model /tmp/tiny --shape 4x96x24 --out "$OUT/opswap_tiny.json" 2>&1 | grep -v Warn | tail -9
            timeout 120 python3 scripts/gpu_opswap.py --model /tmp/q4b --shape 4x512x32 --out "$OUT/opswap_4b.json" 2>&1 | grep -v Warn | tail -9 ;;
    judge-tiny) judge tiny --model /tmp/tiny ;;
    judge-public) judge public --model /tmp/q4b --workloads public ;;
    judge-own) judge own --model /tmp/q4b --workloads results/workloads/own.json ;;
    judge-public-b1) judge public_b1 --model /tmp/q4b --workloads results/workloads/public_b1.json ;;
    judge-public-b4-b16) judge public_b4_b16 --model /tmp/q4b --workloads results/workloads/public_b4_b16.json ;;
    judge-long) judge long --model /tmp/q4b --workloads results/workloads/long.json ;;
    memory) timeout 300 python3 scripts/gpu_memory.py --model /tmp/q4b --mlp-rows 16384 --out "$OUT/gpu_memory.json" 2>&1 | tail -8 ;;
    judge-public-b1-nopdl) FASTQWEN_NO_PDL=1 judge public_b1_nopdl --model /tmp/q4b --workloads results/workloads/public_b1.json ;;
    engine-gpu) timeout 240 python3 -m pytest -q -m gpu tests/test_engine_gpu.py 2>&1 | tail -5 | tee "$OUT/pytest_engine_gpu.log"
                # a failing engine test turns the prefill graphs off for the stages after it
                grep -q failed "$OUT/pytest_engine_gpu.log" && export FASTQWEN_NO_PREFILL_GRAPHS=1 && echo "prefill graphs OFF" ;;
    ckpt-hf) [ -f /tmp/q4b_hf/config.json ] || flock /tmp/fastqwen-ckpt.lock python3 -m fastqwen.cli synth \
               --preset qwen3-4b --init transformers --seed 1 --device cuda --out /tmp/q4b_hf 2>&1 | tail -1 ;;
    ckpt-massive) [ -f /tmp/q4b_massive/config.json ] || flock /tmp/fastqwen-ckpt.lock python3 -m fastqwen.cli synth \
                    --preset qwen3-4b --massive-activations --device cuda --out /tmp/q4b_massive 2>&1 | tail -1 ;;
    ckpt-window) mkdir -p /tmp/q4b_w4096 && ln -sf /tmp/q4b/*.safetensors /tmp/q4b/model.safetensors.index.json \
                   /tmp/q4b/generation_config.json /tmp/q4b_w4096/ && \
                 python3 -c "import json; c=json.load(open('/tmp/q4b/config.json')); c['sliding_window']=4096; \
json.dump(c, open('/tmp/q4b_w4096/config.json', 'w'), indent=2)" ;;
    opswap-a) timeout 300 python3 scripts/gpu_opswap.py --model /tmp/q4b --shapes 16x512x128,64x256x48 \
                --out "$OUT/opswap_a.json" 2>&1 | grep -v Warn | tail -34 ;;
    opswap-b) timeout 420 python3 scripts/gpu_opswap.py --model /tmp/q4b_hf --shapes 16x512x128,64x256x48,4x2048x64,32x512x64 \
                --out "$OUT/opswap_b.json" 2>&1 | grep -v Warn | tail -68 ;;
    opswap-a2) timeout 300 python3 scripts/gpu_opswap.py --model /tmp/q4b --shapes 1x512x64,16x512x128,64x256x48 \
                 --variants torch,engine,engine_torch_norms,engine_cublas --out "$OUT/opswap_a2.json" 2>&1 | grep -v Warn | tail -24 ;;
    opswap-b2) timeout 420 python3 scripts/gpu_opswap.py --model /tmp/q4b_hf --shapes 4x2048x64,16x512x128,32x512x64,64x256x48 \
                 --variants torch,engine,engine_torch_norms,engine_cublas --out "$OUT/opswap_b2.json" 2>&1 | grep -v Warn | tail -32 ;;
    opswap-b3) timeout 300 python3 scripts/gpu_opswap.py --model /tmp/q4b_hf --shapes 4x2048x64,16x512x128,64x256x48 \
                 --variants engine,engine_tl_sum_norm,engine_torch_norms,engine_attention_1split \
                 --out "$OUT/opswap_b3.json" 2>&1 | grep -v Warn | tail -24 ;;
    opswap-b4) timeout 240 python3 scripts/gpu_opswap.py --model /tmp/q4b_hf --shapes 16x1024x192,16x512x128,4x2048x160 \
                 --variants engine,engine_tl_sum_norm,engine_torch_norms \
                 --out "$OUT/opswap_b4.json" 2>&1 | grep -v Warn | tail -24 ;;
    judge-q35) # Qwen3.5-4B (synth) in public mode: native and the replay on the machine's own Transformers
               # 5.17 (its site-packages first on PYTHONPATH, through fastqwen/refenv.py); the engine as it defaults.
               q35_site
               q35_ckpt
               timeout 560 python3 -m fastqwen.cli judge --engine engine --public --out "$OUT/judge_q35.json" \
                 --chart "$OUT/judge_q35.png" --model /tmp/q35_4b --workloads public 2>&1 | tail -40 ;;
    judge-q35-eager) # the same with every prompt pass eager (FASTQWEN_NO_PREFILL_GRAPHS=1)
               q35_site
               q35_ckpt
               FASTQWEN_NO_PREFILL_GRAPHS=1 timeout 560 python3 -m fastqwen.cli judge --engine engine --public \
                 --out "$OUT/judge_q35_eager.json" --chart "$OUT/judge_q35_eager.png" --model /tmp/q35_4b \
                 --workloads public 2>&1 | tail -40 ;;
    judge-q35-official|judge-q35-own)
               q35_site
               q35_ckpt
               set="public"; [ "$stage" = judge-q35-own ] && set=results/workloads/q35_own.json
               timeout 560 python3 -m fastqwen.cli judge --engine engine --official --out "$OUT/${stage//-/_}.json" \
                 --chart "$OUT/${stage//-/_}.png" --model /tmp/q35_4b --workloads "$set" 2>&1 | tail -40 ;;
    judge-q35-exact|judge-q35-own-exact|judge-q35-xdecode|judge-q35-own-xdecode) # official, the public set or own
               # shapes; *-exact: the prompt pass's chunked rule in the reference's order (gdn_exact; own: two
               # shapes), *-xdecode: the GDN decode step in the full forward's arithmetic (gdn_exact_step)
               q35_site
               q35_ckpt
               case "$stage" in
                 *-exact) flag=FASTQWEN_GDN_EXACT_PREFILL own=results/workloads/q35_own_b2_b16.json ;;
                 *) flag=FASTQWEN_GDN_EXACT_DECODE own=results/workloads/q35_own.json ;;
               esac
               set="public"; [[ "$stage" == *-own-* ]] && set=$own
               env "$flag=1" timeout 560 python3 -m fastqwen.cli judge --engine engine --official \
                 ${JUDGE_SAMPLES:+--samples "$JUDGE_SAMPLES"} \
                 --out "$OUT/${stage//-/_}.json" --chart "$OUT/${stage//-/_}.png" --model /tmp/q35_4b \
                 --workloads "$set" 2>&1 | tail -40 ;;
    q35-opswap-xdecode) # q35-opswap's engine with FASTQWEN_GDN_EXACT_DECODE=1 beside native (seeds 5 and 6)
               q35_site
               q35_ckpt
               FASTQWEN_GDN_EXACT_DECODE=1 timeout "${OPSWAP_TIMEOUT_S:-400}" python3 scripts/gpu_q35_opswap.py \
                 --model /tmp/q35_4b --shapes "${OPSWAP_SHAPES:-16x512x128,4x2048x32}" --variants engine \
                 --seeds "${OPSWAP_SEEDS:-5,6}" --out "$OUT/q35_opswap_xdecode.json" 2>&1 | grep -v Warn | tail -40 ;;
    q35-opswap) # teacher-forced on native's tokens: the engine's logits and its variants' against the full
                # forward, beside native's cached decode (gpu_q35_opswap.py)
                q35_site
                q35_ckpt
                timeout "${OPSWAP_TIMEOUT_S:-400}" python3 scripts/gpu_q35_opswap.py --model /tmp/q35_4b --shapes "${OPSWAP_SHAPES:-16x512x128,4x2048x32}" \
                  ${OPSWAP_VARIANTS:+--variants "$OPSWAP_VARIANTS"} ${OPSWAP_SEEDS:+--seeds "$OPSWAP_SEEDS"} --out "$OUT/q35_opswap.json" 2>&1 | grep -v Warn | tail -70 ;;
    q35-check) q35_ckpt
               timeout 400 python3 scripts/gpu_q35_check.py --model /tmp/q35_4b \
                 --profile 1x512,16x512 --out "$OUT/q35_check.json" 2>&1 | grep -v Warn | cut -c1-400 | tail -14 ;;
    q35-step) # the decode step's timings alone
                 q35_ckpt
                 timeout 150 python3 scripts/gpu_q35_check.py --model /tmp/q35_4b --timing-only \
                   --out "$OUT/q35_step.json" > /dev/null 2>&1
                 python3 -c "import json; d = json.load(open('$OUT/q35_step.json')); \
                   print({k: v.get('graph_step_ms', v) for k, v in d.items() if k.startswith('timing')})" ;;
    q35-step-arms) # the decode step's time under each arm's settings, one process, interleaved
                 q35_ckpt
                 timeout "${Q35_ARMS_TIMEOUT_S:-300}" python3 scripts/gpu_q35_check.py --model /tmp/q35_4b --timing-only \
                   --shapes "${Q35_ARMS_SHAPES:-1x512x32,4x2048x32,16x512x128}" \
                   --arms "${Q35_ARMS:-exact,fast}" \
                   --rounds "${Q35_ARMS_ROUNDS:-3}" ${Q35_ARMS_PROFILE:+--profile "$Q35_ARMS_PROFILE"} \
                   --warm-workers "${Q35_ARMS_WARM:-4}" \
                   --out "$OUT/q35_step_arms.json" > "$OUT/q35_step_arms.log" 2>&1
                 python3 -c "import json; d = json.load(open('$OUT/q35_step_arms.json'))
for k, v in d.items():
    if k.startswith('timing'): print(k, v.get('graph_step_ms'), {a: (r['median_ms'], r.get('tokens_as')) for a, r in v.get('arms', {}).items()}, v.get('error', '')[-300:])" ;;
    q35-gemv-ab) # the decode step with the GEMV table as committed and with each arm's configs, one process
                 # an arm, in this call (arms and shapes: the header)
                 q35_ckpt
                 fma1=mode=fma,block_m=1
                 i=0
                 for arm in ${Q35_AB_ARMS:-table in_proj_n16 session13}; do
                   i=$((i + 1))
                   case $arm in
                     table) extra=() ;;
                     in_proj_n16) extra=(--gemv "12352x2560@1:block_n=16,block_k=256,$fma1") ;;
                     session13) extra=(--gemv "12352x2560@1:block_n=8,block_k=256,$fma1"
                                       --gemv "10240x2560@1:block_n=8,block_k=256,$fma1"
                                       --gemv "2560x9216@1:block_n=4,block_k=512,$fma1"
                                       --gemv-silu "18432x2560@1:block_n=8,block_k=256,$fma1") ;;
                     # 2-4 rows: in_proj split-K 4 (bench: 18.65 us against 19.29; no epilogue there), gate_up dot_t
                     rows4) extra=(--gemv "12352x2560@4:block_n=64,block_k=128,split_k=4,num_stages=3,mode=dot_t"
                                   --gemv-silu "18432x2560@4:block_n=128,block_k=128,num_stages=3,mode=dot_t") ;;
                   esac
                   shapes=${Q35_AB_SHAPES:-1x512x32}
                   timeout 150 python3 scripts/gpu_q35_check.py --model /tmp/q35_4b --timing-only --shapes "$shapes" \
                     "${extra[@]}" --out "$OUT/q35_gemv_${i}_$arm.json" > /dev/null 2>&1
                   python3 -c "import json; d = json.load(open('$OUT/q35_gemv_${i}_$arm.json'))
for s in '$shapes'.split(','): print('$arm', s, d['timing_' + s].get('graph_step_ms'), d['timing_' + s].get('tune'))"
                 done ;;
    chunk-probe) timeout 200 python3 scripts/gpu_chunk_probe.py --model /tmp/q4b --out "$OUT/chunk_probe.json" 2>&1 \
                   | grep -v Warn | tail -12 ;;
    serve-paged) PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 300 python3 scripts/gpu_serve_bench.py \
                   --model /tmp/q4b --block-size 64 --runs one_stream,sixteen_streams,prefix_0,prefix_384 \
                   --out "$OUT/serve_paged.json" 2>&1 | grep -v Warn | tail -8 ;;
    serve-q35) q35_ckpt
               PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 400 python3 scripts/gpu_serve_bench.py \
                 --model /tmp/q35_4b --block-size 64 --runs one_stream,sixteen_streams,prefix_0,prefix_384 \
                 --out "$OUT/serve_q35.json" 2>&1 | grep -v Warn | tail -8 ;;
    serve-q35-snapgraph) q35_ckpt       # serve-q35 with a pass that keeps a state snapshot as a chunk graph too
               FASTQWEN_GRAPH_SNAPSHOT_PASSES=1 PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 400 python3 \
                 scripts/gpu_serve_bench.py --model /tmp/q35_4b --block-size 64 \
                 --runs one_stream,sixteen_streams,prefix_0,prefix_384 --out "$OUT/serve_q35_snapgraph.json" 2>&1 \
                 | grep -v Warn | tail -8 ;;
    serve-rates) PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 400 python3 scripts/gpu_serve_bench.py \
                   --model /tmp/q4b --block-size 64 \
                   --runs one_stream,sixteen_streams,sixteen_streams_long,rate_1,rate_4,rate_16,prefix_0,prefix_384 \
                   --out "$OUT/serve_rates.json" 2>&1 | grep -v Warn | tail -10 ;;
    serve-cap) PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 300 python3 scripts/gpu_serve_bench.py \
                 --model /tmp/q4b --memory-gib 24 --runs none --out "$OUT/serve_cap.json" 2>&1 | grep -v Warn | tail -4 ;;
    serve-cap-paged) PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 300 python3 scripts/gpu_serve_bench.py \
                 --model /tmp/q4b --memory-gib 24 --block-size 64 --runs none --out "$OUT/serve_cap_paged.json" 2>&1 \
                 | grep -v Warn | tail -4 ;;
    serve-16) PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 300 python3 scripts/gpu_serve_bench.py \
                --model /tmp/q4b --block-size 64 --runs one_stream,sixteen_streams,sixteen_streams_long \
                --out "$OUT/serve_16.json" 2>&1 | grep -v Warn | tail -6 ;;   # serve-rates' stream runs alone
    serve-chunked) PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 300 python3 scripts/gpu_serve_bench.py \
                     --model /tmp/q4b --prefill-chunk "${SERVE_CHUNK:-256}" --runs one_stream,sixteen_streams,rate_4,rate_16 \
                     --out "$OUT/serve_chunked_${SERVE_CHUNK:-256}.json" 2>&1 | grep -v Warn | tail -8 ;;
    paged-attn-probe) timeout 300 python3 scripts/gpu_paged_attn_probe.py --out "$OUT/paged_attn_probe.json" 2>&1 \
                        | grep -v Warn | tail -30 ;;
    slots-gpu) timeout 200 python3 -m pytest -q -rf --tb=short -m gpu tests/test_engine_gpu.py -k "slots or chunked_admission" 2>&1 \
                 | tail -30 | tee "$OUT/pytest_slots_gpu.log" ;;
    kernels-paged) timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/kernels/test_paged_kv_writes.py \
                     tests/kernels/test_decode_attention.py tests/test_engine_gpu.py -k "paged or slots" 2>&1 \
                     | tail -30 | tee "$OUT/pytest_paged.log" ;;
    serve-bench) PYTHONPATH=/tmp/serve_site:$PYTHONPATH timeout 560 python3 scripts/gpu_serve_bench.py \
                   --model /tmp/q4b --memory-gib 24 --out "$OUT/serve_bench.json" 2>&1 | grep -v Warn | tail -12 ;;
    bench-gdn-sweep) timeout "${SWEEP_TIMEOUT_S:-300}" python3 scripts/bench_gdn.py \
                       --sweep "${SWEEP_SHAPES:-1x512,1x2048,4x2048,16x8192}" --plans "${SWEEP_PLANS:-}" \
                       --out "$OUT/bench_gdn_sweep.json" 2>&1 | grep -v Warn | tee "$OUT/bench_gdn_sweep.jsonl" \
                       | cut -c1-300 | tail -60 ;;
    kernels-gdn-prefill) timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/kernels/test_gdn_kernels.py \
                           -k "prefill or epilogue" 2>&1 | tail -30 | tee "$OUT/pytest_gdn_prefill.log" ;;
    use-best-gdn-plan) # the fastest plan of this call's bench-gdn-sweep within the gates, for every later stage
                 export FASTQWEN_GDN_PLAN=$(python3 scripts/bench_gdn.py --best "$OUT/bench_gdn_sweep.json" \
                   --among "${BEST_AMONG:-}")
                 echo "FASTQWEN_GDN_PLAN=$FASTQWEN_GDN_PLAN" | tee "$OUT/gdn_plan.txt" ;;
    prefill-pieces) timeout 200 python3 scripts/gpu_prefill_pieces.py --out "$OUT/prefill_pieces.json" 2>&1 \
                      | grep -v Warn | tail -40 ;;
    rule-bits) for shape in 4x2048 1x512; do timeout 200 python3 scripts/gpu_rule_bits_probe.py --shape $shape \
                 --out "$OUT/rule_bits_$shape.json" 2>&1 | grep -v Warn | tail -30; done ;;
    kernels-gdn-exact) timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/kernels/test_gdn_exact.py 2>&1 \
                         | grep -v "^    \|^  File\|^E    +" | tail -40 | tee "$OUT/pytest_gdn_exact.log" ;;
    kernels-early) # the GPU tests of the reads before PDL's wait (pdl.EARLY, gdn_exact_step.EARLY) and the gate in the merge
                   timeout "${EARLY_TESTS_TIMEOUT_S:-420}" python3 -m pytest -q -rf --tb=short -m gpu \
                     tests/kernels/test_decode_attention.py tests/kernels/test_norm_rope_swiglu.py \
                     tests/kernels/test_paged_kv_writes.py tests/kernels/test_gdn_exact_step.py \
                     -k "${EARLY_TESTS_K:-early or gate_in_merge or qk_norm_rope_store or qwen35_prologue or extra1 or different_rows}" \
                     2>&1 | tail -12 | tee "$OUT/pytest_early.log" ;;
    exact-step-bits) # the exact step's bits alone at the 4B's shapes (B = 1 / 4 / 16), FORMS[0] (the defaults) under
                     # this environment's FASTQWEN_GDN_STEP_* (e.g. _EARLY, _MERGED); EXACT_STEP_BITS_TIMEOUT_S
                     timeout "${EXACT_STEP_BITS_TIMEOUT_S:-300}" python3 scripts/gpu_exact_step.py --forms 0 --bits-only \
                       --batches "${EXACT_STEP_BATCHES:-1,4,16}" --out "$OUT/exact_step_bits.json" 2>&1 | grep -v Warn | tail -5 ;;
    q35-ckpt) q35_ckpt ;;   # the synthetic Qwen3.5-4B alone (for a later stage or a parallel one)
    kernels-screen) # the screened LM head's GPU tests (tests/kernels/test_lm_screen.py), candidates per step printed
                    timeout 300 python3 -m pytest -q -rf --tb=short -s -m gpu tests/kernels/test_lm_screen.py 2>&1 \
                      | grep -v Warn | tail -8 | tee "$OUT/pytest_screen.log" ;;
    lm-screen-q35|lm-screen-q3) # the screened LM head on a 4B (scripts/gpu_lm_screen.py): picks against the GEMV's
                    # argmax on its decode states, the tail's kernels by plan, the graphed step and generate with
                    # and without (Qwen3.5: exact decode); LM_SCREEN_TIMEOUT_S, LM_SCREEN_ROUNDS, LM_SCREEN_PLANS
                    # (";"-separated plans to sweep), LM_SCREEN_KERNELS_ONLY=1 (picks and the sweep alone)
                    if [ "$stage" = lm-screen-q35 ]; then q35_ckpt; m=/tmp/q35_4b; xd=1; else m=/tmp/q4b; xd=0; fi
                    FASTQWEN_GDN_EXACT_DECODE=$xd timeout "${LM_SCREEN_TIMEOUT_S:-300}" python3 scripts/gpu_lm_screen.py \
                      --model $m --rounds "${LM_SCREEN_ROUNDS:-3}" ${LM_SCREEN_PLANS:+--plans "$LM_SCREEN_PLANS"} \
                      ${LM_SCREEN_KERNELS_ONLY:+--kernels-only} --out "$OUT/${stage//-/_}.json" 2>&1 | grep -v Warn \
                      | cut -c1-1500 | tail -8 ;;
    kernels-gdn-exact-step) timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/kernels/test_gdn_exact_step.py \
                              2>&1 | tail -6 | tee "$OUT/pytest_gdn_exact_step.log" ;;
    exact-step) timeout 420 python3 scripts/gpu_exact_step.py --batches "${EXACT_STEP_BATCHES:-1,4,16}" \
                  --out "$OUT/exact_step.json" 2>&1 | grep -v Warn | tail -5 ;;
    exact-step-ncu) # Nsight Compute over the exact GDN decode step (the default form) at B = 1 and 16, row 31:
                    # stall reasons by source line, occupancy, memory (the clocks left alone, METHOD.md)
             ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
             [ -n "$ncu_bin" ] || { echo "exact-step-ncu: no ncu here"; continue; }
             timeout 300 "$ncu_bin" --clock-control none --kernel-name regex:"_chain_step_kernel" --launch-skip 2 \
               --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
               --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
               python3 scripts/gpu_exact_step.py --ncu 1,16 > "$OUT/exact_step_ncu.txt" 2>&1
             grep -E "_chain_step|Duration|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput|Memory Throughput|Stall|Warp Cycles Per Issued" \
               "$OUT/exact_step_ncu.txt" | head -60 ;;
    use-best-exact-step) # the exact GDN decode step's best bit-equal form of this call's exact-step, for every later stage
                 best=$(python3 scripts/gpu_exact_step.py --best "$OUT/exact_step.json")
                 for assignment in $best; do export "$assignment"; done
                 echo "${best:-no form bit-equal at every batch: the defaults}" | tee "$OUT/exact_step_best.txt" ;;
    exact-rule) timeout 300 python3 scripts/gpu_exact_rule.py --out "$OUT/exact_rule.json" 2>&1 | grep -v Warn | tail -8 ;;
    trsm-bits) timeout 300 python3 scripts/gpu_trsm_probe.py --shape 4x2048 --count "${TRSM_COUNT:-1024}" \
                 --out "$OUT/trsm_bits.json" 2>&1 | grep -v Warn | cut -c1-330 | tail -70 ;;
    gdn-probe) timeout 300 python3 scripts/gpu_gdn_probe.py --out "$OUT/gdn_probe.json" 2>&1 \
                       | grep -v Warn | tail -6 ;;
    gdn-ncu) # Nsight Compute over one prompt pass's three GDN kernels at 4x8192 (a slice of two sequences:
             # the state kernel in one wave), after a first pass that compiles them: stall reasons, occupancy,
             # throughput (the hardware's counters; the clocks left alone, METHOD.md)
             ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
             [ -n "$ncu_bin" ] || { echo "gdn-ncu: no ncu here"; continue; }
             timeout 400 "$ncu_bin" --clock-control none --kernel-name regex:"_chunk_(solve|state|out)_kernel" \
               --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy --section LaunchStats \
               --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
               python3 scripts/gpu_gdn_passes.py --shape "${NCU_SHAPE:-4x8192}" --passes 2 > "$OUT/gdn_ncu.txt" 2>&1
             grep -E "_chunk_|Duration|Achieved Occupancy|Registers Per|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Stall|Warp Cycles Per Issued" \
               "$OUT/gdn_ncu.txt" | head -60 ;;
    bench-gdn) timeout 400 python3 scripts/bench_gdn.py --out "$OUT/bench_gdn.json" 2>&1 | grep -v Warn | tail -12 ;;
    gemm-probe) timeout 200 python3 scripts/gpu_gemm_order_probe.py --out "$OUT/gemm_order_probe.json" 2>&1 \
                  | grep -v Warn | tail -24 ;;
    gemm-inorder) timeout 400 python3 scripts/gpu_gemm_inorder.py --out "$OUT/gemm_inorder.json" 2>&1 \
                    | grep -v Warn | tail -14 ;;
    gemm-inorder2) timeout 400 python3 scripts/gpu_gemm_inorder.py --set deep --rows 4,16 \
                     --out "$OUT/gemm_inorder2.json" 2>&1 | grep -v Warn | tail -14 ;;
    gemm-inorder3) timeout 400 python3 scripts/gpu_gemm_inorder.py --set narrow --rows 16,64 \
                     --out "$OUT/gemm_inorder3.json" 2>&1 | grep -v Warn | tail -14 ;;
    gemm-inorder64) timeout 400 python3 scripts/gpu_gemm_inorder.py --set m64 --rows 48,64 \
                      --matrices qkv,gate_up,lm_head,o,down --out "$OUT/gemm_inorder64.json" 2>&1 | grep -v Warn | tail -14 ;;
    kernels-gemv) timeout 300 python3 -m pytest -q -rf --tb=line -m gpu tests/kernels/test_gemv.py 2>&1 \
                    | tail -30 | tee "$OUT/pytest_gemv.log" ;;
    decode-bits-a) timeout 300 python3 scripts/gpu_decode_bits.py --model /tmp/q4b --batches 16,8,64 \
                     --out "$OUT/decode_bits_a.json" 2>&1 | grep -v Warn | tail -24 ;;
    decode-bits-b) timeout 300 python3 scripts/gpu_decode_bits.py --model /tmp/q4b_hf --batches 16,4,32 \
                     --out "$OUT/decode_bits_b.json" 2>&1 | grep -v Warn | tail -24 ;;
    attn-bits) timeout 300 python3 scripts/gpu_attn_bits.py --out "$OUT/attn_bits.json" 2>&1 | grep -v Warn | tail -16 ;;
    decode-bits-e) timeout 300 python3 scripts/gpu_decode_bits.py --model /tmp/q4b --batches 16,8,32 \
                     --variants engine,engine_sdpa_attention --out "$OUT/decode_bits_e.json" 2>&1 | grep -v Warn | tail -8 ;;
    decode-bits-k) timeout 300 python3 scripts/gpu_decode_bits.py --model /tmp/q4b --batches 16,8 --variants engine \
                     --knobs "fa2:FA2=1" \
                     --out "$OUT/decode_bits_k.json" 2>&1 | grep -v Warn | grep -v choices | tail -16 ;;
    exact-bits) FASTQWEN_EXACT_DECODE=1 timeout 300 python3 scripts/gpu_decode_bits.py --model /tmp/q4b \
                  --batches 16,8,32,64 --variants engine,engine_sdpa_attention --out "$OUT/decode_bits_exact.json" 2>&1 \
                  | grep -v Warn | grep -v choices | tail -8 ;;
    exact-speed) for rep in $(seq "${EXACT_REPS:-2}"); do for exact in 0 1; do
                   FASTQWEN_EXACT_DECODE=$exact timeout 150 python3 scripts/gpu_check.py --model /tmp/q4b --fidelity "" \
                     --speed 1x512x64,16x512x128,64x256x48 --out "$OUT/speed_exact${exact}_$rep.json" 2>&1 \
                     | grep -v Warn | grep '^{' | python3 -c "import sys, json
for l in sys.stdin:
    r = json.loads(l); print('exact=$exact', '$rep', r['shape'], 'step %.4f ms' % r['graph_step_ms'])"
                 done; done ;;
    exact-on) export FASTQWEN_EXACT_DECODE=1 ;;
    kernels-gdn) timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/kernels/test_gdn_kernels.py tests/kernels/test_sigmoid_gate.py \
                   tests/kernels/test_qwen35_step.py 2>&1 | tail -30 | tee "$OUT/pytest_gdn.log" ;;
    kernels-norm) timeout 300 python3 -m pytest -q -rf --tb=line -m gpu tests/kernels/test_norm_rope_swiglu.py 2>&1 \
                    | tail -30 | tee "$OUT/pytest_norms.log" ;;
    norm-speed) timeout 300 python3 scripts/gpu_norm_speed.py --model /tmp/q4b --out "$OUT/norm_speed.json" 2>&1 \
                  | grep -v Warn | tail -8 ;;
    speed-ab) for rep in 1 2; do
                for tree in . base; do
                  [ -d "$tree/engine" ] || continue
                  (cd "$tree" && timeout 150 python3 scripts/gpu_check.py --model /tmp/q4b --fidelity "" \
                     --speed 1x512x64,16x512x128,64x256x48 --out "$OUT/speed_$(basename $(realpath $tree))_$rep.json" 2>&1 \
                     | grep -v Warn | python3 -c "import sys, json
for l in sys.stdin:
    if l.startswith('{'):
        r = json.loads(l); print('$tree', '$rep', r['shape'], 'step %.4f ms' % r['graph_step_ms'], 'tpot %.3f' % r['tpot_ms'])")
                done
              done ;;
    reduce-probe) timeout 200 python3 scripts/gpu_reduce_order_probe.py --out "$OUT/reduce_probe.json" 2>&1 | grep -v Warn | tail -30
                  timeout 200 python3 -m pytest -q -rf --tb=line -m gpu tests/kernels/test_norm_rope_swiglu.py 2>&1 \
                    | tail -40 | tee "$OUT/pytest_norms.log" ;;
    judge-fid1-a) judge fid1_a --model /tmp/q4b --workloads results/workloads/fidelity_1.json ${FID_BASELINE:+--baseline base/engine} ;;
    judge-fid1-b) judge fid1_b --model /tmp/q4b_hf --workloads results/workloads/fidelity_1.json ${FID_BASELINE:+--baseline base/engine} ;;
    judge-fid2-a) judge fid2_a --model /tmp/q4b --workloads results/workloads/fidelity_2.json ${FID_BASELINE:+--baseline base/engine} ;;
    judge-fid2-b) judge fid2_b --model /tmp/q4b_hf --workloads results/workloads/fidelity_2.json ${FID_BASELINE:+--baseline base/engine} ;;
    judge-public-ab) judge public_ab --model /tmp/q4b --workloads public --baseline base/engine ;;
    judge-window-official) judge window --model /tmp/q4b_w4096 --workloads results/workloads/window.json --baseline base/engine ;;
    judge-massive) judge massive --model /tmp/q4b_massive --workloads results/workloads/massive.json --baseline base/engine ;;
    judge-massive-nb) judge massive --model /tmp/q4b_massive --workloads results/workloads/massive.json ;;
    judge-window-nb) judge window --model /tmp/q4b_w4096 --workloads results/workloads/window.json ;;
    judge-window) timeout 300 python3 -m fastqwen.cli judge --engine engine --public --out "$OUT/judge_window.json" \
                    --chart "$OUT/judge_window.png" --model /tmp/q4b_w4096 --workloads results/workloads/window.json 2>&1 | tail -14 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
