#!/usr/bin/env bash
# All dflash_dist GPU benchmarks in ONE call on a 2-GPU machine (written for 2x H200, 10-minute limit), from the
# repository root:
#
#   bash bench/run_all_gpu.sh [OUT_DIR]          (default: $OUT, else /tmp/dflash_bench)
#
# Optional inputs (git-ignored, carried to the machine): .whl/*.whl (hydra-core, omegaconf, antlr4 for the real
# job: installed into /tmp/site), .carry/fla/*.whl (flash-linear-attention: installed into /tmp/fla and put on
# PYTHONPATH for the hybrid runs only), .carry/causal_conv1d-*.tar.xz (prebuilt causal-conv1d: unpacked into
# /tmp/cc1d, on PYTHONPATH for the second hybrid run only).
#
# Plan (seconds; every part is time-boxed with `timeout`, writes its JSON as it goes, and a part that hits its box
# keeps what it wrote):
#   phase A, in parallel:  GPU0 drafter_step (B_DRAFTER=200)
#                          GPU1 target_capture (B_TARGET=120) -> hybrid without causal-conv1d (B_HYBRID=55)
#                               -> hybrid with causal-conv1d (B_HYBRID=55)
#   phase B:               pipeline: drafter alone on GPU0 (52% of the box), then the real 1 target + 1 drafter
#                          job (the rest) (B_PIPE=250)
#   phase C:               threaded baseline, target thread GPU0 / drafter thread GPU1 (B_THREAD=100)
#   then:                  plan_split projection (W=8) and the summary (seconds)
# At most 200 + 250 + 100 s plus the installs (~15 s); phases B and C shrink so that the script ends within
# TOTAL=575 s, and results.json / summary.md are rewritten after every phase. Budgets can be overridden from the
# environment (B_DRAFTER, B_TARGET, B_HYBRID, B_PIPE, B_THREAD, TOTAL).
#
# TINY=1 bash bench/run_all_gpu.sh DIR rehearses every part on a CPU machine at toy sizes (about 2 minutes).
#
# Output in OUT_DIR (few files, the device tool brings back at most 8): results.json (every part's JSON),
# summary.md (all tables), run_all.log (everything printed), e2e.log (the real job's log), plan_split.png.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/dflash_bench}}
WORK=/tmp/dflash_bench_work
rm -rf "$WORK"
mkdir -p "$OUT_DIR" "$WORK"

: "${B_DRAFTER:=200}" "${B_TARGET:=120}" "${B_HYBRID:=55}" "${B_PIPE:=250}" "${B_THREAD:=100}"
: "${TOTAL:=575}"   # seconds for the whole script: later parts shrink to fit what is left
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s)

elapsed() { echo $(( $(date +%s) - T0 )); }
# fit BOX RESERVE: BOX, or less so that RESERVE seconds remain of TOTAL afterwards
fit() { local left=$(( TOTAL - $(elapsed) - $2 )); echo $(( $1 < left ? $1 : left )); }
summary() { python3 bench/summarize.py "$WORK" --json "$OUT_DIR/results.json" --md "$OUT_DIR/summary.md" > /dev/null 2>&1; }

# run NAME SECONDS CMD...: time-boxed, output prefixed with [NAME], exit code recorded in $WORK/rcs
run() {
  local name=$1 secs=$2
  shift 2
  echo "=== [$name] start at $(elapsed) s, time box ${secs} s"
  timeout -k 10 "$secs" "$@" 2>&1 | sed -u "s/^/[$name] /"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] exit $rc at $(elapsed) s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
  echo "$name $rc" >> "$WORK/rcs"
}

main() {
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  BASE=$PWD
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && BASE=$BASE:/tmp/site || echo "WARNING: installing .whl/*.whl failed"
  fi
  export PYTHONPATH=$BASE${PYTHONPATH:+:$PYTHONPATH}
  HYB=$PYTHONPATH
  if compgen -G ".carry/fla/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla .carry/fla/*.whl \
      && HYB=/tmp/fla:$HYB || echo "WARNING: installing .carry/fla failed"
  else
    echo "NOTE: no .carry/fla wheels: the hybrid runs use whatever fla the image has (likely none)"
  fi
  HYB_CC=$HYB
  CC_TAR=$(ls .carry/causal_conv1d-*.tar.xz 2>/dev/null | head -1)
  if [ -n "$CC_TAR" ]; then
    mkdir -p /tmp/cc1d && tar xJf "$CC_TAR" -C /tmp/cc1d && HYB_CC=/tmp/cc1d:$HYB || echo "WARNING: unpacking $CC_TAR failed"
  else
    echo "NOTE: no .carry/causal_conv1d-*.tar.xz: the 'with causal-conv1d' run will not have it"
  fi
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__)"
  python3 -c "import hydra, omegaconf; print('hydra', hydra.__version__, 'omegaconf', omegaconf.__version__)" \
    || echo "WARNING: hydra missing: pipeline and threaded parts will fail"
  echo "=== setup done at $(elapsed) s"

  # per-part arguments; TINY=1 rehearses the whole script on a CPU machine at toy sizes
  if [ "${TINY:-0}" = 1 ]; then
    DS=(--tiny --configs 40x8 --repeats 2); TC=(--tiny --mixes 64 --budgets 256 --repeats 1 --warmup 0)
    HY=(--tiny --hybrid --mixes 64 --budgets 256 --repeats 1 --warmup 0)
    JOB=(--tiny --steps 4 --warmup-steps 2 --log-every 2)
    PS=(--target-mix 64 --target-budget 256 --drafter-config 40x8 --drafter-backend sdpa)
  else
    DS=(--repeats 8 --time-budget-s $(( B_DRAFTER - 50 )))
    TC=(--tokens-per-pass 49152 --repeats 2 --budgets 16384 --time-budget-s $(( B_TARGET - 35 )))
    HY=(--hybrid --tokens-per-pass 32768 --repeats 3)
    JOB=(--steps 20 --warmup-steps 10 --log-every 5)
    PS=()
  fi

  # ---- phase A: GPU0 drafter step || GPU1 target capture, then the hybrid target without / with causal-conv1d
  (
    export CUDA_VISIBLE_DEVICES=0
    run drafter_step "$B_DRAFTER" python3 bench/drafter_step.py --out "$WORK/drafter_step.json" "${DS[@]}"
  ) &
  local pa=$!
  (
    export CUDA_VISIBLE_DEVICES=1
    run target_capture "$B_TARGET" python3 bench/target_capture.py --out "$WORK/target_capture.json" "${TC[@]}"
    run hybrid_without_cc1d "$B_HYBRID" env PYTHONPATH="$HYB" python3 bench/target_capture.py \
      --out "$WORK/hybrid_without_cc1d.json" "${HY[@]}"
    run hybrid_with_cc1d "$B_HYBRID" env PYTHONPATH="$HYB_CC" python3 bench/target_capture.py \
      --out "$WORK/hybrid_with_cc1d.json" "${HY[@]}"
  ) &
  local pb=$!
  wait $pa $pb
  echo "=== phase A done at $(elapsed) s"

  summary
  # ---- phase B: pipeline efficiency (drafter alone on GPU0 in a subprocess, then the real job on both GPUs)
  local bp; bp=$(fit "$B_PIPE" $(( B_THREAD + 15 )))
  if [ "$bp" -ge 60 ]; then
    local alone=$(( bp * 52 / 100 ))
    run pipeline "$bp" python3 bench/pipeline.py --out "$WORK/pipeline.json" --workdir "$WORK/pipe" "${JOB[@]}" \
      --alone-timeout "$alone" --e2e-timeout $(( bp - alone - 12 ))
    cp "$WORK/pipe/e2e.log" "$OUT_DIR/e2e.log" 2>/dev/null
  else
    echo "=== [pipeline] skipped: its time box would be ${bp} s (< 60 s) to end within TOTAL=${TOTAL} s"
  fi
  summary

  # ---- phase C: the threaded single-process design on the same job
  local bt; bt=$(fit "$B_THREAD" 12)
  if [ "$bt" -ge 40 ]; then
    run threaded "$bt" python3 bench/threaded_baseline.py --out "$WORK/threaded.json" --workdir "$WORK/thr" \
      "${JOB[@]}" --timeout $(( bt - 10 )) --compare "$WORK/pipeline.json"
  else
    echo "=== [threaded] skipped: its time box would be ${bt} s (< 40 s) to end within TOTAL=${TOTAL} s"
  fi

  # ---- projection and summary
  if [ -f "$WORK/target_capture.json" ] && [ -f "$WORK/drafter_step.json" ]; then
    run plan_split 30 python3 bench/plan_split.py --target-json "$WORK/target_capture.json" \
      --drafter-json "$WORK/drafter_step.json" --gpus 8 --out "$WORK/plan_split.json" --png "$OUT_DIR/plan_split.png" \
      "${PS[@]}"
  fi
  python3 bench/summarize.py "$WORK" --json "$OUT_DIR/results.json" --md "$OUT_DIR/summary.md"
  echo "=== all done at $(elapsed) s; files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
}

main 2>&1 | tee "$OUT_DIR/run_all.log"
