#!/usr/bin/env bash
# The H200 runs of beam-rl in few device calls: named stages in lanes, one lane per GPU, logs and
# results under $OUT (the device tool returns that folder).
#
#     bash scripts/h200_campaign.sh "bench_rollout dapo" "megatron bench_train gap"
#
# Everything under $OUT is packed into $OUT/results.tgz at the end (PACK=0 keeps the files).
# Each argument is a lane: its stages run in order on GPU <lane index> (CUDA_VISIBLE_DEVICES);
# with fewer GPUs than lanes the lanes run one after another, or side by side on the shared GPU with
# SHARE_GPU=1 on a GPU of at least SHARE_GPU_MIN_GIB (default 100: an H200, not an H100) GiB
# (host-bound stages such as two DAPO runs whose engines and trainers fit in its memory:
# the math recipes take 12% of the GPU for vLLM each; on an H100 two math DAPO runs started together
# were both still compiling their engines' Triton kernels after 205 s, where one alone starts its
# engine in ~60 s: math_wait starts the second after the first has its engine). Every stage runs under a timeout
# that ends before the call's own limit ($BUDGET seconds from the start, default 570) and records
# its exit code in $OUT/status; a stage out of time gets SIGABRT, so each Python process in it writes
# its threads' stacks to the stage's log (PYTHONFAULTHANDLER). With STALL_S=N, a stage whose log has
# not grown for N seconds is ended the same way (exit code 200 in $OUT/status) and, for the resumable
# math stages, run once more from its last checkpoint: an in-process vLLM engine once hung in
# Inductor's compile after "Dynamo bytecode transform time" (warm start, H200), silently for the rest
# of the call. The beam-mini checkpoint is written once to $WORK (seed 0).
#
# DETACH=1 runs the campaign in its own process session (setsid), so it outlives the device call that
# started it and goes on on the same machine (held up to 30 minutes) for DETACH_BUDGET seconds (default
# 1500; BUDGET is then this call's wait); its files go to $WORK/campaign. Every later call
#     bash scripts/h200_campaign.sh --wait          (BUDGET: how long this call waits, default 570)
# waits for it to end, at most BUDGET seconds, and returns a copy of its files so far (each run's
# metrics included). A DAPO run then crosses call boundaries without a resume (each costs its
# engine's start and the compiles again: ~140 s for the math warm start on the H200) and a lane never
# idles at a call's end; the math runs keep no checkpoints (MATH_LAST_CALL=1): with the machine gone,
# nothing could resume from them. --wait needs no kit and no setup. Make the --wait call as soon as
# the previous call returns: a device machine left idle goes back within about 30 s and ends the
# detached campaign with it (an H100 warm start was lost that way on 2026-12-07).
#
# Prerequisites: the gpu-kit unpacked and beam-rl's wheel installed into /tmp/beam, then
#     export PYTHONPATH=/tmp/beam:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# and BEAM_RL_COMMIT=<the commit the wheel was built from> (the benchmarks' JSON records it; the
# device's copy of the tree can carry an older .git: scripts/bench_provenance.py).
# Stages run from $WORK, never from the repository root (the source tree would shadow the
# installed package, whose beam_rl.rollout the vLLM plugin entry point imports).
#
# Stages:
#   megatron       tests/gpu/test_megatron_gpu.py (parity under R3 per mode, a training step)
#   kernels        tests/gpu/test_kernels_gpu.py
#   trainer_gpu    tests/gpu/test_trainer_gpu.py (the trainer's fast paths against the definitions they replace;
#                  TRAINER_GPU_ARGS, e.g. "-k changing")
#   bridge         tests/gpu/test_bridge_gpu.py (Beam through Megatron-Bridge: distributed-optimizer step and
#                  SkyRL's checkpoint save / load; needs the SkyRL kits installed)
#   bench_train    scripts/bench_train.py, beam-mini, batch 4 x 4096: baseline (plain PyTorch) / bf16 / lora / lora-merged / mxfp8-emulated /
#                  the Megatron GPT MoE peer, profiled
#   bench_rollout  scripts/bench_rollout.py: fused / compiled / eager builds, CUDA graphs
#   bench_concurrency  scripts/bench_rollout.py --concurrency: decode at batch 1 / 64 / 256, async on / off,
#                  R3 off / on, the Qwen3-MoE peer, weight updates (BENCH_CONCURRENCY_ARGS, e.g. "--variants beam-async")
#   rollout_gpu    tests/gpu/test_rollout_gpu.py (capture under async + CUDA graphs equals vLLM's, in-memory sync)
#   bench_kernels  scripts/bench_kernels.py (all kernels; BENCH_KERNELS_ARGS, e.g. "--tune --only boundary")
#   gap            scripts/gap_h200.sh (bf16, lora, mxfp8; then gap_sources.py)
#   gap_trained    scripts/pretrain_bytes.py (beam-mini as a byte LM on the stdlib, $PRETRAIN_S s), then
#                  gap_h200.sh on that checkpoint with held-out prompts (MODES, default "bf16 lora";
#                  TRAINER_ATTENTION=engine|flash|auto, the trainer's attention (default auto: flash); SOURCES=1 adds gap_sources.py there:
#                  one rollout, the trainer with each attention definition (flash included) and fast paths off)
#   dapo           beam-rl dapo --recipe recipes/mini-h200.yaml (10 steps; DAPO_ARGS, e.g. "--stop-after 4");
#                  the DAPO stages log torch.compile's recompiles and their reasons (TORCH_LOGS=recompiles),
#                  and each step's compile seconds are its `compile_s`
#   rollout_check  scripts/gpu_rollout_check.py (capture paths, parity, in-place reload A -> B -> A)
#   tp2            scripts/gpu_rollout_check.py --tensor-parallel 2 (needs 2 GPUs; run it alone)
#   warm           beam-rl warm-start --recipe recipes/mini-h200.yaml -> $WORK/mini-warm (the warm start
#                  `beam-rl dapo` runs on that recipe) + SkyRL data and tokenizer (python -m beam_rl.skyrl.data)
#   skyrl_bf16     beam-rl launch recipes/skyrl/dapo-bf16.yaml from $WORK/mini-warm, $SKYRL_STEPS steps (8);
#   skyrl_lora     ... dapo-lora.yaml; SkyRL's per-step metrics in $OUT/skyrl_<mode>/metrics.jsonl
#                  (SKYRL_ARGS: more key=value overrides, e.g. "trainer.eval_before_train=false")
#                  (the SkyRL stages need the SkyRL kits installed and run after `warm`)
#   (the math stages grade with math-verify: install the kit of scripts/gpu_kit_math.txt with the gpu-kit)
#   math_warm      beam-rl warm-start --recipe recipes/math/warm-mini-h200.yaml -> $WORK/ckpt/math-mini-warm (recompiles logged); stopped
#                  with a resumable checkpoint before the call's time runs out (MATH_KEEP_S, as below), resumed by the next call's math_warm
#   math_wait      waits for math_warm's checkpoint (another lane's, SHARE_GPU=1: "math_warm math_bf16" "math_wait math_no-r3"),
#                  then (at most 300 s) for the earlier lanes' DAPO engines to start (lane k waits for k logs with the
#                  "rollout attention numerics" line): two engines started together were still compiling after 205 s (H100)
#   math_bf16      beam-rl dapo --recipe recipes/math/bf16.yaml (math_NAME: recipes/math/NAME.yaml, e.g. lora, mxfp8, no-r3): the
#                  learning runs from that warm start, 50 steps, each call's part ended with a checkpoint
#                  before its time runs out (MATH_KEEP_S s kept to write it, default 90) and resumed by the next
#                  call; MATH_LAST_CALL=1 (a machine's last call): no checkpoint at all (--no-checkpoints: ~16 GB
#                  that would not outlive the machine), so MATH_KEEP_S=20 suffices; skipped when less than
#                  MATH_MIN_S (default 240) would be left after MATH_KEEP_S; metrics.jsonl and run.json in
#                  $OUT/runs/<mode>/, the input of scripts/learning_report.py (with $OUT/warm_start.json)
#   dapo_rollout   scripts/bench_dapo_rollout.py on the math warm start (after math_warm): the DAPO loop's rollout call at
#                  recipes/math/bf16.yaml's shape taken apart (vLLM alone, without per-request seeds), profiled
#                  (BENCH_DAPO_ROLLOUT_ARGS, e.g. "--repeats 5"); $OUT/rollout_dapo.json
#   dapo_train     scripts/bench_dapo_train.py at recipes/math/bf16.yaml's shape (beam-mini at its init seed: timing only,
#                  no warm start needed): the train phase unpacked (micro-batches of 64, as that recipe ran before
#                  packing: 256 unpacked rows ran out of an H100's memory) vs shared-prompt packing; $OUT/dapo_train_h200.json
#                  (BENCH_DAPO_TRAIN_ARGS, e.g. "--repeats 5")
#   spec_test      tests/test_rollout_spec.py on vLLM 0.26 (beam-tiny, the DFlash2 drafter distilled in the test:
#                  greedy and R3 equal without speculation, drafts equal the reference's, adaptive verification)
#   spec           scripts/bench_spec.py: no speculation vs DFlash2 at concurrency 1 / 8 / 32 / 128 on the math warm
#                  start with the drafter of stage `drafter` (BENCH_SPEC_ARGS, e.g. "--num-speculative 7")
#   drafter        beam-rl train-drafter on the math warm start ($WORK/ckpt/math-mini-warm) -> $WORK/drafter-math;
#                  the held-out acceptance curve in $OUT/train_drafter.json (DRAFTER_ARGS, e.g. "--steps 600")
set -uo pipefail
REPO=${CAMPAIGN_REPO:-$(cd "$(dirname "$0")/.." && pwd)}  # a detached campaign runs from a copy of this file
OUT=${OUT:-$REPO/runs/h200}
WORK=${WORK:-/tmp/beam-work}
BUDGET=${BUDGET:-570}
START=$(date +%s)
mkdir -p "$OUT" "$WORK"
DETACHED=$WORK/campaign

copy_math_runs() {  # the math runs' metrics so far -> $OUT/runs/<mode>/, also where a stage was ended
  for r in "$WORK"/runs/math-*; do
    [ -f "$r/metrics.jsonl" ] && mkdir -p "$OUT/runs/${r##*/math-}" && cp "$r/metrics.jsonl" "$r/run.json" "$OUT/runs/${r##*/math-}/" 2>/dev/null
  done
}

report() {  # the status and the last $1 lines of each log; with PACK=1 (default) everything under $OUT in one
  # archive: the device tool returns only a few files per call
  echo "== status =="; cat "$OUT/status" 2>/dev/null
  for f in "$OUT"/*.log; do [ -f "$f" ] && { echo "== $(basename "$f") (tail) =="; grep -v -E "^(INFO|WARNING|DEBUG)|it/s\]|s/it\]" "$f" | tail -n "$1"; }; done
  if [ "${PACK:-1}" = 1 ]; then
    tar czf "$WORK/results.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$WORK/results.tgz" "$OUT/results.tgz"
  fi
}

if [ "${1:-}" = "--wait" ] || [ "${DETACH:-0}" = 1 ]; then
  if [ "${DETACH:-0}" = 1 ]; then
    [ -f "$DETACHED/.started" ] && [ ! -f "$DETACHED/.done" ] && { echo "a detached campaign already runs in $DETACHED; use --wait"; exit 2; }
    rm -rf "$DETACHED" && mkdir -p "$DETACHED" && touch "$DETACHED/.started"
    # bash reads a script as it runs it, and a later device call copies the working tree again: the
    # detached campaign runs from its own copy of this file
    cp "$REPO/scripts/h200_campaign.sh" "$DETACHED/campaign.sh"
    CAMPAIGN_REPO=$REPO DETACH=0 OUT=$DETACHED PACK=0 BUDGET=${DETACH_BUDGET:-1500} MATH_LAST_CALL=${MATH_LAST_CALL:-1} \
      setsid nohup bash "$DETACHED/campaign.sh" "$@" >"$DETACHED/campaign.out" 2>&1 </dev/null &
    echo "detached campaign started (pid $!): $*; files in $DETACHED"
  elif [ ! -f "$DETACHED/.started" ]; then
    echo "no detached campaign in $DETACHED (start one with DETACH=1)"; exit 2
  fi
  while [ ! -f "$DETACHED/.done" ] && [ $(( $(date +%s) - START )) -lt $(( BUDGET - 20 )) ]; do sleep 5; done
  cp -r "$DETACHED"/. "$OUT"/ 2>/dev/null  # its files so far, the math runs' metrics as they stand
  rm -f "$OUT/.done"
  copy_math_runs
  if [ -f "$DETACHED/.done" ]; then echo "== the detached campaign has ended"; else echo "== the detached campaign runs on (--wait again)"; fi
  report 15
  exit 0
fi
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONFAULTHANDLER=1
CKPT=$WORK/beam-mini
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)

checkpoint() {  # one writer; other lanes wait for it
  if mkdir "$WORK/.ckpt.lock" 2>/dev/null; then
    [ -f "$CKPT/config.json" ] || python3 -m beam_rl.cli init --preset beam-mini --seed 0 --out "$CKPT" >>"$OUT/checkpoint.log" 2>&1
    touch "$WORK/.ckpt.done"
  fi
  while [ ! -f "$WORK/.ckpt.done" ]; do sleep 2; done
}

wait_until() {  # what, most seconds, condition (evaluated anew every 5 s, globs included); a line a minute (STALL_S reads a silent log as a hang)
  local what=$1 most=$2 cond=$3 i=0
  until eval "$cond" || [ "$i" -ge "$most" ]; do sleep 5; i=$((i + 5)); [ $((i % 60)) = 0 ] && echo "waiting for $what: ${i}s"; done
  return 0
}

stage_cmd() {
  case "$1" in
    megatron) echo "python3 -m pytest -q -s -p no:cacheprovider --rootdir=$WORK $REPO/tests/gpu/test_megatron_gpu.py" ;;
    bridge) echo "python3 -m pytest -q -s -p no:cacheprovider --rootdir=$WORK $REPO/tests/gpu/test_bridge_gpu.py" ;;
    trainer_gpu) echo "python3 -m pytest -q -s -p no:cacheprovider --rootdir=$WORK $REPO/tests/gpu/test_trainer_gpu.py ${TRAINER_GPU_ARGS:-}" ;;
    kernels) echo "python3 -m pytest -q -p no:cacheprovider --rootdir=$WORK $REPO/tests/gpu/test_kernels_gpu.py ${KERNELS_ARGS:-}" ;;
    bench_train) echo "python3 $REPO/scripts/bench_train.py --preset beam-mini --batch 4 --seq 4096 --modes baseline bf16 lora lora-merged mxfp8-emulated peer --profile --json $OUT/train.json ${BENCH_TRAIN_ARGS:-}" ;;
    bench_rollout) echo "checkpoint; python3 $REPO/scripts/bench_rollout.py --checkpoint $CKPT --json $OUT/rollout.json --log-dir $OUT/rollout_logs ${BENCH_ROLLOUT_ARGS:-}" ;;
    bench_concurrency) echo "checkpoint; python3 $REPO/scripts/bench_rollout.py --concurrency --checkpoint $CKPT --decode-batches 64,256 --decode-tokens 64 --repeats 15 --work $WORK --json $OUT/rollout_concurrency.json --log-dir $OUT/concurrency_logs ${BENCH_CONCURRENCY_ARGS:-}" ;;
    rollout_gpu) echo "python3 -m pytest -q -s -p no:cacheprovider --rootdir=$WORK $REPO/tests/gpu/test_rollout_gpu.py" ;;
    bench_kernels) echo "python3 $REPO/scripts/bench_kernels.py --out $OUT/kernels.json ${BENCH_KERNELS_ARGS:-}" ;;
    gap) echo "checkpoint; OUT=$OUT/gap CKPT=$CKPT WORK=$WORK bash $REPO/scripts/gap_h200.sh" ;;
    gap_trained) echo "python3 $REPO/scripts/pretrain_bytes.py --preset beam-mini --out $WORK/beam-mini-bytes --seconds ${PRETRAIN_S:-150} --prompts-out $WORK/bytes-prompts.json && OUT=$OUT/gap_trained CKPT=$WORK/beam-mini-bytes PROMPTS=$WORK/bytes-prompts.json MODES='${MODES:-bf16 lora}' TRAINER_ATTENTION=${TRAINER_ATTENTION:-auto} WORK=$WORK SOURCES=${SOURCES:-0} bash $REPO/scripts/gap_h200.sh" ;;
    dapo) echo "TORCH_LOGS=recompiles python3 -m beam_rl.cli dapo --recipe $REPO/recipes/mini-h200.yaml --out $WORK/mini-h200 ${DAPO_ARGS:-}" ;;
    rollout_check) echo "python3 $REPO/scripts/gpu_rollout_check.py --preset beam-mini --out $WORK --prompts 8 --max-tokens 128 --free-running-tokens 32 --json $OUT/rollout_check.json" ;;
    tp2) echo "checkpoint; python3 $REPO/scripts/gpu_rollout_check.py --preset beam-mini --out $WORK --prompts 8 --max-tokens 128 --free-running-tokens 32 --tensor-parallel 2 --json $OUT/rollout_check_tp2.json" ;;
    warm) echo "python3 -m beam_rl.cli warm-start --recipe $REPO/recipes/mini-h200.yaml --out $WORK/mini-warm --overwrite && python3 -m beam_rl.skyrl.data --recipe $REPO/recipes/mini-h200.yaml --out $WORK/skyrl-data --tokenizer-into $WORK/mini-warm" ;;
    skyrl_bf16|skyrl_lora) echo "python3 -m beam_rl.cli launch $REPO/recipes/skyrl/dapo-${1#skyrl_}.yaml trainer.policy.model.path=$WORK/mini-warm \"data.train_data=['$WORK/skyrl-data/train.parquet']\" \"data.val_data=['$WORK/skyrl-data/validation.parquet']\" trainer.max_training_steps=${SKYRL_STEPS:-8} trainer.run_name=$1 trainer.log_path=$OUT/$1 trainer.ckpt_interval=1000 trainer.ckpt_path=$WORK/$1/ckpts trainer.export_path=$WORK/$1/exports ${SKYRL_ARGS:-}; rc=\$?; ray stop --force >/dev/null 2>&1; exit \$rc" ;;
    math_warm) w=$WORK/ckpt/math-mini-warm  # $2: the stage's seconds; MATH_KEEP_S of them kept for writing a resumable checkpoint
      echo "[ -f $w/warm_start.json ] && exit 0; TORCH_LOGS=recompiles python3 -m beam_rl.cli warm-start --recipe $REPO/recipes/math/warm-mini-h200.yaml --out $w \$( [ -d $w/checkpoints ] && echo --resume || echo --overwrite ) --max-seconds $(( $2 - ${MATH_KEEP_S:-90} )) && { [ ! -f $w/warm_start.json ] || cp $w/warm_start.json $OUT/; }" ;;
    # lane k waits for k DAPO engines (one per earlier lane; the warm start's does not count) to have started
    math_wait) echo "wait_until 'the warm start' 86400 'test -f $WORK/ckpt/math-mini-warm/warm_start.json'; wait_until \"the earlier lanes' DAPO engines\" 300 '[ \$(grep -ls \"rollout attention numerics\" $OUT/math_*.log | grep -vc math_warm.log) -ge ${LANE:-1} ]'" ;;
    math_*) m=${1#math_}; r=$WORK/runs/math-$m  # any DAPO recipe of recipes/math/ (bf16, lora, mxfp8, no-r3, variants)
      # a finished run's checkpoint goes (16 GB; the disk holds few), its metrics stay: --resume then does nothing;
      # "finished" by the recipe just run (a resume may raise run.total_steps; run.json keeps the first value),
      # read without validation: validating builds the task, seconds that a small MATH_KEEP_S did not hold
      echo "TORCH_LOGS=recompiles python3 -m beam_rl.cli dapo --recipe $REPO/recipes/math/$m.yaml --out $r \$( [ -f $r/metrics.jsonl ] && echo --resume ) --max-seconds $(( $2 - ${MATH_KEEP_S:-90} ))${MATH_LAST_CALL:+ --no-checkpoints}; rc=\$?; mkdir -p $OUT/runs/$m; cp $r/metrics.jsonl $r/run.json $OUT/runs/$m/; python3 -c \"import sys; from beam_rl.dapo.config import load_recipe; from beam_rl.dapo.rundir import finished; sys.exit(not finished('$r', load_recipe('$REPO/recipes/math/$m.yaml', validate=False).run.total_steps))\" && rm -rf $r/checkpoints; exit \$rc" ;;
    dapo_train) echo "python3 $REPO/scripts/bench_dapo_train.py --recipe $REPO/recipes/math/bf16.yaml --unpacked-micro-batch 64 --json $OUT/dapo_train_h200.json ${BENCH_DAPO_TRAIN_ARGS:-}" ;;
    dapo_rollout) echo "python3 $REPO/scripts/bench_dapo_rollout.py --recipe $REPO/recipes/math/bf16.yaml --checkpoint $WORK/ckpt/math-mini-warm --profile --json $OUT/rollout_dapo.json ${BENCH_DAPO_ROLLOUT_ARGS:-}" ;;
    spec_test) echo "python3 -m pytest -q -s -p no:cacheprovider --rootdir=$WORK $REPO/tests/test_rollout_spec.py" ;;
    spec) echo "python3 $REPO/scripts/bench_spec.py --checkpoint $WORK/ckpt/math-mini-warm --drafter $WORK/drafter-math --recipe $REPO/recipes/math/warm-mini-h200.yaml --json $OUT/spec.json ${BENCH_SPEC_ARGS:-}" ;;
    drafter) echo "rm -rf $WORK/drafter-math && python3 -m beam_rl.cli train-drafter --checkpoint $WORK/ckpt/math-mini-warm --recipe $REPO/recipes/math/warm-mini-h200.yaml --out $WORK/drafter-math --generate-with vllm ${DRAFTER_ARGS:-} && cp $WORK/drafter-math/train_drafter.json $OUT/" ;;
    *) echo "echo unknown stage $1; exit 2" ;;
  esac
}

run_stage() {  # stage, seconds left, GPU: runs it, appending to its log; returns its exit code, 200 if it stalled
  local log="$OUT/$1.log" size=-1 still=0
  ( cd "$WORK" && export -f checkpoint wait_until && export CKPT WORK OUT && \
    CUDA_VISIBLE_DEVICES=$([ "$1" = tp2 ] && echo 0,1 || echo "$3") exec timeout -s ABRT -k 20 "$2" bash -c "$(stage_cmd "$1" "$2")" ) >>"$log" 2>&1 &
  local pid=$!  # timeout's, the leader of the stage's process group
  while [ "${STALL_S:-0}" -gt 0 ] && kill -0 "$pid" 2>/dev/null; do
    sleep 5
    local now; now=$(stat -c %s "$log" 2>/dev/null || echo 0)
    if [ "$now" = "$size" ]; then still=$((still + 5)); else still=0; size=$now; fi
    if [ "$still" -ge "$STALL_S" ]; then
      echo "== $1 stalled: its log has not grown for ${still}s; SIGABRT to every process of the stage (Python stacks follow)" >>"$log"
      kill -ABRT -- "-$pid" 2>/dev/null
      for _ in $(seq 20); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done  # the stacks written, or
      kill -KILL -- "-$pid" 2>/dev/null; wait "$pid"; return 200
    fi
  done
  wait "$pid"
}

run_lane() {  # lane index, stages
  local gpu=$1; shift
  for stage in "$@"; do
    local tries=0 rc
    while :; do
      local left=$(( BUDGET - ($(date +%s) - START) ))
      if [ "$left" -lt 30 ]; then echo "$stage skipped (no time left)" >>"$OUT/status"; break; fi
      # a math DAPO run needs its start (~110 s: engine, checkpoint, the first step's compile) and a step
      # before its --max-seconds stop: with less left it would only cost the call's time
      if [[ "$stage" == math_* && "$stage" != math_warm && "$stage" != math_wait ]] && \
         [ "$(( left - ${MATH_KEEP_S:-90} ))" -lt "${MATH_MIN_S:-240}" ]; then
        echo "$stage skipped (${left}s left: under MATH_MIN_S=${MATH_MIN_S:-240} after MATH_KEEP_S)" >>"$OUT/status"; break
      fi
      local t0=$(date +%s)
      run_stage "$stage" "$left" "$gpu"; rc=$?
      echo "$stage rc=$rc ${left}s-budget took $(( $(date +%s) - t0 ))s gpu=$gpu$([ $rc = 200 ] && echo ' (stalled)')" >>"$OUT/status"
      tries=$((tries + 1))
      # a stalled resumable stage runs once more, from its last checkpoint
      [ "$rc" = 200 ] && [ "$tries" -lt 2 ] && [[ "$stage" == math_* ]] && [ "$(( BUDGET - ($(date +%s) - START) ))" -ge 150 ] || break
    done
  done
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/gpus.csv" 2>&1
# the GPU's memory and load, and each process's memory, every 10 s: what decides how many lanes share a GPU
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -l 10 >"$OUT/gpu_load.csv" 2>/dev/null & load_pid=$!
nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv,noheader -l 10 >"$OUT/gpu_apps.csv" 2>/dev/null & apps_pid=$!
# Two math DAPO runs, engine and trainer each, need more than an H100's 80 GB: on an H100 the LoRA
# run held 44.9 GiB when the MXFP8 run beside it ran out of memory at 34.2 GiB in its first training
# step (2026-12-07), twice, losing that lane's call; a bf16 run alone held 69 GB there (engine at 12% of
# the GPU, trainer). On an H200 bf16 + LoRA fit side by side; a third DAPO lane would not. PyTorch's
# cache is not what fills it: a LoRA run alone on an H100 peaked at 36.9 GiB allocated and 43.4 GiB
# reserved (its steps' gpu_peak_* metrics), 44.4 GiB in nvidia-smi.
# Below SHARE_GPU_MIN_GIB the lanes share nothing.
gpu_gib=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null || echo 0) / 1024 ))
if [ "$NGPU" = 1 ] && [ "${SHARE_GPU:-0}" = 1 ] && [ "$gpu_gib" -lt "${SHARE_GPU_MIN_GIB:-100}" ]; then
  echo "SHARE_GPU=1 ignored: the GPU has ${gpu_gib} GiB, under SHARE_GPU_MIN_GIB=${SHARE_GPU_MIN_GIB:-100}; lanes run one after another" | tee -a "$OUT/status"
  SHARE_GPU=0
fi
lane=0
pids=()
for stages in "$@"; do
  gpu=$(( NGPU > 1 ? lane % NGPU : 0 ))
  if [ "$NGPU" -gt 1 ] || [ "${SHARE_GPU:-0}" = 1 ]; then LANE=$lane run_lane "$gpu" $stages & pids+=($!); else LANE=$lane run_lane 0 $stages; fi
  lane=$((lane + 1))
done
for p in "${pids[@]}"; do wait "$p"; done
kill "$load_pid" "$apps_pid" 2>/dev/null
cp "$WORK/mini-h200/metrics.jsonl" "$OUT/dapo_metrics.jsonl" 2>/dev/null  # also after a timeout
copy_math_runs
report 25
[ "${PACK:-1}" = 1 ] || touch "$OUT/.done"  # a detached campaign's end, for --wait
