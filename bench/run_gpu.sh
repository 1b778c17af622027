#!/usr/bin/env bash
# Run a chosen set of the dflash_dist benchmarks on the GPUs of this machine, each part time-boxed, and write one
# results.json and one summary.md. From the repository root:
#
#   bash bench/run_gpu.sh [OUT_DIR] [PARTS]            (OUT_DIR default: $OUT, else /tmp/dflash_bench)
#   PARTS=drafter,target,pipeline bash bench/run_gpu.sh OUT_DIR
#   TINY=1 bash bench/run_gpu.sh /tmp/rehearsal         (every part on a CPU machine at toy sizes, ~2 minutes)
#
# PARTS (comma-separated; default: drafter,target,hybrid,pipeline,plan; threaded and overlap run one-off experiments
# of bench/experiments/ on request):
#   drafter    bench/drafter_step.py              one drafter training step, Qwen3-8B shapes (GPU0)
#   target     bench/target_capture.py            target feature capture, Qwen3-8B-shaped (GPU1, or GPU0 if one GPU)
#   hybrid     bench/target_capture.py --hybrid   reduced Qwen3-Next target, without and with causal-conv1d
#   fresh      bench/target_fresh_shapes.py       the capture on never-seen batch shapes
#   head       bench/head_serve.py                one served lm_head + loss request by chunk height
#   pipeline   bench/pipeline.py                  drafter alone vs the real 1 target + 1 drafter job (2 GPUs)
#   threaded   bench/experiments/threaded_baseline.py   the replaced single-process threaded design (2 GPUs)
#   overlap    bench/experiments/send_overlap.py        does a pending NCCL send slow the sender (2 GPUs)
#   transport  bench/transport_check.py           every payload checked byte for byte (2 GPUs)
#   plan       bench/plan_split.py                8-GPU split projection from the drafter and target parts
# Parts that need 2 GPUs are skipped (and said so) on a 1-GPU machine. With TINY=1 every part runs on the CPU.
#
# Optional inputs (git-ignored): .whl/*.whl (hydra-core, omegaconf, antlr4 for the real job, installed into
# /tmp/site), .carry/fla/*.whl (flash-linear-attention, on PYTHONPATH for the hybrid runs only),
# .carry/causal_conv1d-*.tar.xz (prebuilt causal-conv1d, on PYTHONPATH for the second hybrid run only).
#
# Time boxes (seconds, overridable from the environment): B_DRAFTER=200 on GPU0 in parallel with B_TARGET=120,
# then B_HYBRID=55 twice, B_FRESH=120, B_HEAD=90 on GPU1; then B_PIPE=250 (drafter alone 52%, real job the rest),
# B_THREAD=100, B_OVERLAP=90, B_TRANSPORT=90; the later parts shrink so that the script ends within TOTAL=575 s.
# A part that hits its box keeps the JSON it has written so far (every script rewrites its JSON as it goes).
#
# Output in OUT_DIR: results.json (every part's JSON, exit codes), summary.md (the tables), run.log (everything
# printed), e2e.log (the real job's log, with the pipeline part), plan_split.png (with the plan part, if matplotlib).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/dflash_bench}}
PARTS=${2:-${PARTS:-drafter,target,hybrid,pipeline,plan}}
WORK=/tmp/dflash_bench_work
rm -rf "$WORK"
mkdir -p "$OUT_DIR" "$WORK"

: "${B_DRAFTER:=200}" "${B_TARGET:=120}" "${B_HYBRID:=55}" "${B_FRESH:=120}" "${B_HEAD:=90}" "${B_PIPE:=250}"
: "${B_THREAD:=100}" "${B_OVERLAP:=90}" "${B_TRANSPORT:=90}"
: "${TOTAL:=575}"   # seconds for the whole script: later parts shrink to fit what is left
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s)

elapsed() { echo $(( $(date +%s) - T0 )); }
want() { [[ ",$PARTS," == *",$1,"* ]]; }
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

# boxed NAME BOX RESERVE MIN CMD...: run CMD with BOX shrunk to what TOTAL leaves, or skip it if below MIN
boxed() {
  local name=$1 box; box=$(fit "$2" "$3"); local min=$4
  shift 4
  if [ "$box" -ge "$min" ]; then run "$name" "$box" "$@"
  else echo "=== [$name] skipped: its time box would be ${box} s (< ${min} s) to end within TOTAL=${TOTAL} s"; fi
}

two_gpus() {  # two_gpus NAME: true if the part can run here (2 GPUs, or the CPU rehearsal)
  if [ "${TINY:-0}" = 1 ] || [ "$NGPU" -ge 2 ]; then return 0; fi
  echo "=== [$1] skipped: it needs 2 GPUs, this machine has $NGPU"; echo "$1 skipped" >> "$WORK/rcs"; return 1
}

main() {
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  echo "parts: $PARTS"
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
  elif want hybrid; then
    echo "NOTE: no .carry/fla wheels: the hybrid runs use whatever fla the environment has"
  fi
  HYB_CC=$HYB
  CC_TAR=$(ls .carry/causal_conv1d-*.tar.xz 2>/dev/null | head -1)
  if [ -n "$CC_TAR" ]; then
    mkdir -p /tmp/cc1d && tar xJf "$CC_TAR" -C /tmp/cc1d && HYB_CC=/tmp/cc1d:$HYB || echo "WARNING: unpacking $CC_TAR failed"
  elif want hybrid; then
    echo "NOTE: no .carry/causal_conv1d-*.tar.xz: the 'with causal-conv1d' run uses whatever the environment has"
  fi
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__)"
  if want pipeline || want threaded; then
    python3 -c "import hydra, omegaconf; print('hydra', hydra.__version__, 'omegaconf', omegaconf.__version__)" \
      || echo "WARNING: hydra missing: the pipeline and threaded parts will fail"
  fi
  if [ "${TINY:-0}" != 1 ] && [ "$NGPU" -lt 1 ]; then
    echo "no GPU visible: run with TINY=1 for the CPU rehearsal"; exit 2
  fi
  # the second device: GPU1 where there are two, else GPU0 after the drafter part
  local g1=1; [ "${TINY:-0}" != 1 ] && [ "$NGPU" -lt 2 ] && g1=0
  echo "=== setup done at $(elapsed) s ($NGPU GPU(s))"

  # per-part arguments; TINY=1 rehearses the whole script on a CPU machine at toy sizes
  if [ "${TINY:-0}" = 1 ]; then
    DS=(--tiny --configs 40x8 --repeats 2); TC=(--tiny --mixes 64 --budgets 256 --repeats 1 --warmup 0)
    HY=(--tiny --hybrid --mixes 64 --budgets 256 --repeats 1 --warmup 0)
    FS=(--target tiny --variants padded --pad-multiples 1,64 --batches 3 --samples-per-batch 2)
    HS=(--tiny)
    JOB=(--tiny --steps 4 --warmup-steps 2 --log-every 2)
    SO=(--tokens 64 --hidden 64 --payload-mb 1 --delay-s 0.05 --repeats 2)
    TR=(--messages 30)
    PS=(--target-mix 64 --target-budget 256 --drafter-config 40x8 --drafter-backend sdpa)
  else
    DS=(--repeats 8 --time-budget-s $(( B_DRAFTER - 50 )))
    TC=(--tokens-per-pass 49152 --repeats 2 --budgets 16384 --time-budget-s $(( B_TARGET - 35 )))
    HY=(--hybrid --tokens-per-pass 32768 --repeats 3)
    FS=(--batches 16)
    HS=()
    JOB=(--steps 20 --warmup-steps 10 --log-every 5)
    SO=()
    TR=()
    PS=()
  fi

  # ---- phase A: the drafter step on GPU0 || the target parts on the second device, one after the other
  local pa="" pb=""
  if want drafter; then
    ( export CUDA_VISIBLE_DEVICES=0
      run drafter_step "$B_DRAFTER" python3 bench/drafter_step.py --out "$WORK/drafter_step.json" "${DS[@]}" ) &
    pa=$!
    [ "$g1" = 0 ] && wait $pa   # one GPU: the target parts after the drafter part
  fi
  (
    export CUDA_VISIBLE_DEVICES=$g1
    if want target; then
      run target_capture "$B_TARGET" python3 bench/target_capture.py --out "$WORK/target_capture.json" "${TC[@]}"
    fi
    if want hybrid; then
      run hybrid_without_cc1d "$B_HYBRID" env PYTHONPATH="$HYB" python3 bench/target_capture.py \
        --out "$WORK/hybrid_without_cc1d.json" "${HY[@]}"
      run hybrid_with_cc1d "$B_HYBRID" env PYTHONPATH="$HYB_CC" python3 bench/target_capture.py \
        --out "$WORK/hybrid_with_cc1d.json" "${HY[@]}"
    fi
    if want fresh; then
      run fresh_shapes "$B_FRESH" python3 bench/target_fresh_shapes.py --out "$WORK/fresh_shapes.json" "${FS[@]}"
    fi
    if want head; then
      run head_serve "$B_HEAD" python3 bench/head_serve.py --out "$WORK/head_serve.json" "${HS[@]}"
    fi
  ) &
  pb=$!
  wait $pa $pb 2>/dev/null
  echo "=== phase A done at $(elapsed) s"
  summary

  # ---- phase B: parts on two devices, one after the other
  if want pipeline && two_gpus pipeline; then
    local bp; bp=$(fit "$B_PIPE" $(( $(want threaded && echo "$B_THREAD" || echo 0) + 15 )))
    if [ "$bp" -ge 60 ]; then
      local alone=$(( bp * 52 / 100 ))
      run pipeline "$bp" python3 bench/pipeline.py --out "$WORK/pipeline.json" --workdir "$WORK/pipe" "${JOB[@]}" \
        --alone-timeout "$alone" --e2e-timeout $(( bp - alone - 12 ))
      cp "$WORK/pipe/e2e.log" "$OUT_DIR/e2e.log" 2>/dev/null
    else
      echo "=== [pipeline] skipped: its time box would be ${bp} s (< 60 s) to end within TOTAL=${TOTAL} s"
    fi
    summary
  fi
  if want threaded && two_gpus threaded; then
    local cmp=(); [ -f "$WORK/pipeline.json" ] && cmp=(--compare "$WORK/pipeline.json")
    local bt; bt=$(fit "$B_THREAD" 12)
    if [ "$bt" -ge 40 ]; then
      run threaded "$bt" python3 bench/experiments/threaded_baseline.py --out "$WORK/threaded.json" \
        --workdir "$WORK/thr" "${JOB[@]}" --timeout $(( bt - 10 )) "${cmp[@]}"
    else
      echo "=== [threaded] skipped: its time box would be ${bt} s (< 40 s) to end within TOTAL=${TOTAL} s"
    fi
    summary
  fi
  if want overlap && two_gpus overlap; then
    boxed send_overlap "$B_OVERLAP" 10 30 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      bench/experiments/send_overlap.py --out "$WORK/send_overlap.json" "${SO[@]}"
  fi
  if want transport && two_gpus transport; then
    boxed transport_check "$B_TRANSPORT" 8 30 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      bench/transport_check.py --out "$WORK/transport_check.json" "${TR[@]}"
  fi

  # ---- projection and summary
  if want plan; then
    if [ -f "$WORK/target_capture.json" ] && [ -f "$WORK/drafter_step.json" ]; then
      run plan_split 30 python3 bench/plan_split.py --target-json "$WORK/target_capture.json" \
        --drafter-json "$WORK/drafter_step.json" --gpus 8 --out "$WORK/plan_split.json" --png "$OUT_DIR/plan_split.png" \
        "${PS[@]}"
    else
      echo "=== [plan_split] skipped: it needs the drafter and target parts' JSON"
    fi
  fi
  python3 bench/summarize.py "$WORK" --json "$OUT_DIR/results.json" --md "$OUT_DIR/summary.md"
  echo "=== all done at $(elapsed) s; files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
}

main 2>&1 | tee "$OUT_DIR/run.log"
