# Sourced by the bench/gpu_session*.sh scripts: environment of a device call on H200s, the carried wheels
# (.whl: hydra-core, omegaconf, antlr4) on PYTHONPATH, a clock, and the two proof jobs of the real trainer.
# `source bench/gpu_env.sh "$@"`: OUT is the script's first argument (default /tmp/<script name>), created.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/$(basename "$0" .sh)}}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
common="logging.wandb.mode=disabled logging.progress_bar=false"
# the target-bound 1 + 1 job of calls 12 and 14 (bench/pipeline.py args): 64 anchors, the eager padded target
TARGET_BOUND_JOB=(--steps 120 --warmup-steps 20 --override drafter.num_anchors=64 --override target.packing=off
                  --override target.compile=false)

# core_job SECONDS LOG RUN_DIR [overrides]: 1 target + 1 drafter, Qwen3-0.6B-shaped target, 5-layer drafter,
# ~550-token samples in 4,096-token messages
core_job() {
  local secs=$1 log=$2 run=$3; shift 3
  rm -rf "$run"
  timeout -k 10 "$secs" torchrun --standalone --nproc-per-node 2 -m dflash_dist.train target=qwen3_0p6b_random \
    drafter=dflash data.source=synthetic:550:3000 target.max_batch_tokens=4096 logging.log_every=10 \
    train.output_dir="$run" $common "$@" 2>&1 | grep -v "^W1" > "$log"
  return "${PIPESTATUS[0]}"
}

# default_job SECONDS LOG RUN_DIR: the embedded default (tiny target, builtin data, in-training evaluation)
default_job() {
  local secs=$1 log=$2 run=$3
  rm -rf "$run"
  timeout -k 10 "$secs" torchrun --standalone --nproc-per-node 2 -m dflash_dist.train train.output_dir="$run" \
    $common logging.log_every=20 2>&1 | grep -v "^W1" > "$log"
  return "${PIPESTATUS[0]}"
}

# proof_jobs SECONDS OUT: core_job (80 steps) and default_job at once on the two GPUs, exit codes and last lines
proof_jobs() {
  local secs=$1 out=$2 pc pd
  echo "=== core job + default job at $(el) s"
  core_job "$secs" "$out/core.log" /tmp/core_run train.max_steps=80 & pc=$!
  default_job "$secs" "$out/default.log" /tmp/default_run & pd=$!
  wait $pc; echo "core exit $? at $(el) s"; wait $pd; echo "default exit $? at $(el) s"
  grep -E "step 80/|done:|Error|samples/s" "$out/core.log" | tail -5
  grep -E "acceptance|done:|Error|tau" "$out/default.log" | tail -4
}

# pipeline_then_threaded TOTAL OUT: bench/pipeline.py (8B-shaped target + 1B drafter: the drafter alone, then the
# real 1+1 job) in at most 200 s, then bench/threaded_baseline.py on the same job with what is left of TOTAL
pipeline_then_threaded() {
  local total=$1 out=$2 left pb
  left=$(( total - $(el) ))
  echo "=== pipeline at $(el) s (${left} s left)"
  pb=$(( left > 330 ? 200 : left * 6 / 10 ))
  timeout -k 10 $pb python3 bench/pipeline.py --out "$out/pipeline.json" --workdir /tmp/pipe --steps 40 \
    --warmup-steps 10 --alone-timeout $(( pb * 45 / 100 )) --e2e-timeout $(( pb * 52 / 100 )) > "$out/pipe_threaded.log" 2>&1
  echo "pipeline exit $? at $(el) s"; grep -E "^\|" "$out/pipe_threaded.log" | tail -5
  left=$(( total - $(el) ))
  if [ $left -gt 50 ]; then
    echo "=== threaded at $(el) s (${left} s)"
    timeout -k 10 $left python3 bench/threaded_baseline.py --out "$out/threaded.json" --workdir /tmp/thr --steps 40 \
      --warmup-steps 10 --timeout $(( left - 10 )) --compare "$out/pipeline.json" >> "$out/pipe_threaded.log" 2>&1
    echo "threaded exit $? at $(el) s"; grep -E "^\||compile errors" "$out/pipe_threaded.log" | tail -6
  fi
}

# traced_e2e BOX NAME WORKDIR [pipeline.py args]: the real 1 + 1 job (bench/pipeline.py, its e2e part) with the
# target trace on, in at most BOX seconds; keeps $OUT/NAME.{json,log} and NAME_{metrics,trace}.jsonl, prints the
# rate, the target's closing line and the trace summary
traced_e2e() {
  local box=$1 name=$2 work=$3; shift 3
  timeout -k 10 "$box" python3 bench/pipeline.py --skip-alone --out "$OUT/$name.json" --workdir "$work" \
    --e2e-timeout $(( box - 10 )) --override logging.debug.trace_target=true "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $? at $(el) s"; grep -E "^\| \(b\)" "$OUT/$name.log"
  cp "$work/e2e_run/target_trace/rank1.jsonl" "$OUT/${name}_trace.jsonl" 2>/dev/null
  cp "$work/e2e_run/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  grep -v "^W1" "$work/e2e.log" > "$OUT/${name}_e2e.log" 2>/dev/null
  grep -E "target (done|stopped)" "$work/e2e.log" | tail -1
  python3 bench/trace_summary.py "$OUT/${name}_trace.jsonl" || true
}

# threaded_vs BOX NAME E2E_NAME [job args]: bench/threaded_baseline.py on the job of $OUT/E2E_NAME.json (the
# same job args), in at most BOX seconds; keeps $OUT/NAME.{json,log}, prints the comparison table
threaded_vs() {
  local box=$1 name=$2 e2e=$3; shift 3
  timeout -k 10 "$box" python3 bench/threaded_baseline.py --out "$OUT/$name.json" --workdir "/tmp/thr_$name" \
    --timeout $(( box - 15 )) --compare "$OUT/$e2e.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $? at $(el) s"; grep -E "^\||compile errors" "$OUT/$name.log" | tail -8
}

# pack_results: the device returns at most 8 files from a call, so everything goes into $OUT/results.tgz
pack_results() {
  ( cd "$OUT" && tar czf results.tgz --remove-files *.json *.jsonl *.log 2>/dev/null ); ls "$OUT"
}

# rendezvous_pair BOX NAME [job args]: traced_e2e twice, topology.tuning.rendezvous_sends=true then false, as
# NAME_rv_true / NAME_rv_false; also prints the drafter's last host and stream wait fractions of each
rendezvous_pair() {
  local box=$1 name=$2 rv; shift 2
  for rv in true false; do
    echo "=== $name: 1 + 1 job, rendezvous_sends=$rv at $(el) s"
    traced_e2e "$box" "${name}_rv_$rv" "/tmp/pipe_${name}_$rv" "$@" --override topology.tuning.rendezvous_sends=$rv
    grep -oE '"drafter_(stream_)?wait_frac": [0-9.e-]*' "$OUT/${name}_rv_${rv}_metrics.jsonl" | tail -4
  done
}

# transport_checks BOX [transport_check.py args]: bench/transport_check.py in its three variants (payloads on their
# own stream; the same without record_stream, which must report corruption; on the compute stream), each in at
# most BOX seconds (TRANSPORT_EXTRA: more "name:args" variants); keeps $OUT/transport_<variant>.{json,log}, prints the table row or where a rank hung
transport_checks() {
  local box=$1 spec name args; shift
  for spec in "comm:" "comm_norecord:--break-record-stream" "nocomm:--no-comm-streams" ${TRANSPORT_EXTRA:-}; do
    name=${spec%%:*}; args=${spec#*:}
    echo "=== transport check $name at $(el) s"
    timeout -k 5 "$box" torchrun --standalone --nproc-per-node 2 bench/transport_check.py \
      --out "$OUT/transport_$name.json" $args "$@" 2>&1 | grep -v "^W1" > "$OUT/transport_$name.log"
    echo "exit ${PIPESTATUS[0]}"
    grep -E "^\| (on|posted)|received at|^Thread|File .*(dflash_dist|transport_check)" "$OUT/transport_$name.log" | head -12
  done
}

# eval_job BOX NAME SLICES STEPS EVERY PROMPTS TOKENS: the drafter-bound 1 + 1 job on the builtin corpus (8B-shaped
# target, 16-sample messages, 256 anchors, STEPS steps) with the in-training evaluation (PROMPTS held-out prompts,
# TOKENS new tokens each, every EVERY steps) run in slices on the target's waits (SLICES=true), whole between
# messages (false), or no evaluation (none); prints its evaluation lines
eval_job() {
  local box=$1 name=$2 slices=$3 steps=$4 every=$5 prompts=$6 tokens=$7 ev
  ev=(--override train.eval_prompts=$prompts --override train.eval_every=$every
      --override train.eval_max_new_tokens=$tokens --override train.tuning.eval_in_slices=$slices)
  [ "$slices" = none ] && ev=(--override train.eval_prompts=0)
  echo "=== evaluation job $name (eval_in_slices=$slices) at $(el) s"
  traced_e2e "$box" "$name" "/tmp/pipe_$name" --steps "$steps" --warmup-steps 20 --max-batch-samples 16 \
    --override drafter.num_anchors=256 --override data.source=builtin "${ev[@]}"
  grep -E "in-training evaluation|evaluation at step|skipped: the one|host syncs|target (done|stopped)" \
    "$OUT/${name}_e2e.log" | cut -c1-240
}

# goal4_pair BOX_MP BOX_THREADED NAME [job args]: goal 4 on one job: the multi-process 1 + 1 job (NAME_mp), then
# the same job threaded (NAME_threaded, one process, one thread per GPU), each in its box
goal4_pair() {
  local box_mp=$1 box_thr=$2 name=$3; shift 3
  echo "=== goal 4, job $name: multi-process at $(el) s"
  traced_e2e "$box_mp" "${name}_mp" "/tmp/pipe_$name" "$@"
  echo "=== the same job threaded at $(el) s"
  threaded_vs "$box_thr" "${name}_threaded" "${name}_mp" "$@"
}

# launch_bound_pair BOX_MP BOX_THREADED [NAME [job args]]: goal4_pair on a launch-bound job (Qwen3-0.6B-shaped
# target, eager and padded as in the replaced design, its 5-layer drafter; default 512 anchors, 80 steps; job args
# are added after these and override them); NAME default small
launch_bound_pair() {
  local box_mp=$1 box_thr=$2 name=${3:-small}; shift 3 2>/dev/null || shift $#
  goal4_pair "$box_mp" "$box_thr" "$name" --target qwen3_0p6b_random --steps 80 --warmup-steps 20 \
    --override target.packing=off --override target.compile=false "$@"
}

# hybrid_kernels: the carried flash-linear-attention wheels into /tmp/fla and the prebuilt causal-conv1d into
# /tmp/cc1d (.carry; the caller puts either on PYTHONPATH)
hybrid_kernels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .carry/fla/*.whl
  mkdir -p /tmp/cc1d && tar xJf .carry/causal_conv1d-*.tar.xz -C /tmp/cc1d
}

# hybrid_goal4_pairs BOX TOTAL [job args]: goal4_pair on the reduced Qwen3-Next-shaped target (padded, eager;
# hybrid_kernels on PYTHONPATH): hy512 (4-sample messages, 512 anchors, both runs in BOX seconds each), then, if
# more than 160 s of TOTAL are left, hy64 (1-sample messages, 64 anchors) in what is left; each packed
hybrid_goal4_pairs() {
  local box=$1 total=$2 left; shift 2
  local hy=(--target qwen3_next_small --override target.packing=off --override target.compile=false "$@")
  goal4_pair "$box" "$box" hy512 "${hy[@]}" --steps 100 --warmup-steps 30
  pack_one hy512
  left=$(( total - $(el) ))
  [ $left -gt 160 ] && goal4_pair $(( left / 2 )) $(( left / 2 )) hy64 "${hy[@]}" --max-batch-samples 1 \
    --override drafter.num_anchors=64 --steps 300 --warmup-steps 100 --log-every 20
  pack_one hy64
}

# pack_one NAME: the files of run NAME into $OUT/results_NAME.tgz (a call returns at most 8 files)
pack_one() { ( cd "$OUT" && tar czf "results_$1.tgz" --remove-files $1*.json $1*.jsonl $1*.log 2>/dev/null ); }

# traced_job STEP BOX NAME [overrides]: run_one (gpu_session27.sh's, sourced by the caller) with drafter step STEP
# traced (logging.debug.profile_step), the trace kept as $OUT/NAME_profile.json, its phase table printed, then packed
traced_job() {
  local step=$1 box=$2 name=$3; shift 3
  run_one "$box" "$name" --override logging.debug.profile_step=$step "$@"
  cp /tmp/pipe_$name/e2e_run/profile/drafter_rank0_step$step.json "$OUT/${name}_profile.json" 2>/dev/null
  grep -E "^\| (group|backward|clip|head)|step $step \(traced|NCCL" "$OUT/${name}_e2e.log" | cut -c1-200
  pack_one "$name"
}
