#!/usr/bin/env bash
# MoE dispatch/combine on the GPU machine, in one call: the GPU tests (every layout ctest
# launches), the CLI smoke lines, and the benchmark figures (JSON per run, packed into
# $OUT/moe_logs.tgz). Binaries from .devbin (scripts/device/pack_binaries.sh) or a build.
#   MK_MOE_STEPS   "setup unit smoke bench" (default: all, in that order)
#   MK_MOE_REPS    timing calls per figure (default "--reps 30 --warmup 5")
#   MK_MOE_NPS     world sizes of the one-node bench runs (default "1 2 4 8")
# On a machine with several GPUs the bench runs one rank per GPU (NCCL baseline, comparable
# figures); on one GPU the ranks share it under MPS (tokens scaled down, times not comparable).
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-moe
rm -rf "$L" && mkdir -p "$L" "$RESULT"
trap 'tar -C "$L" -czf "$RESULT/moe_logs.tgz" . 2>/dev/null' EXIT
steps=${MK_MOE_STEPS:-"setup unit smoke bench"}
read -r -a REPS <<< "${MK_MOE_REPS:-"--reps 30 --warmup 5"}"
has() { [[ " $steps " == *" $1 "* ]]; }
export B=/tmp/mkb OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if has setup; then MK_SUITE_STEPS=setup bash scripts/device/suite.sh 2>&1 | tail -2; fi
if has unit || has smoke; then
  steps_s=""
  has unit && steps_s+=" unit"
  has smoke && steps_s+=" smoke"
  MK_SUITE_STEPS="$steps_s" MK_UNIT_ONLY=moe MK_SMOKE_ONLY="moe* bad_preset" bash scripts/device/suite.sh > "$L/suite.log" 2>&1
  sed -n '/==== summary/,$p' "$L/suite.log"
  cp /tmp/mk-suite/suite_logs.tgz "$L/" 2>/dev/null
fi
if has bench; then
  ngpu=$(nvidia-smi -L | wc -l)
  started=0
  if ((ngpu == 1)) && ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    nvidia-cuda-mps-control -d && started=1
  fi
  run_bench() {  # name np envs args...
    local name=$1 np=$2 envs=$3
    shift 3
    local pct=100
    ((np > 1 && ngpu == 1)) && pct=$((100 / np))
    local cmd=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" -x "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct")
    local e
    for e in $envs; do cmd+=(-x "$e"); done
    echo "\$ ${cmd[*]} $B/mkernel bench moe_dispatch $* ${REPS[*]} --json $L/$name.json" > "$L/$name.log"
    timeout -k 10 240 "${cmd[@]}" "$B/mkernel" bench moe_dispatch "$@" "${REPS[@]}" --json "$L/$name.json" >> "$L/$name.log" 2>&1
    echo "bench $name rc=$?"
    grep -E "^(preset|deepep|qwen3|mixtral|bench:)" "$L/$name.log"
  }
  for np in ${MK_MOE_NPS:-1 2 4 8}; do run_bench "np$np" "$np" ""; done
  run_bench ll_np1 1 "" --preset deepep_ll --tokens 128
  run_bench hier2x2_tcp 4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always" --preset qwen3 --preset mixtral --tokens 1024
  run_bench hier2x2_shm 4 "MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=shm MK_NET_STAGING=always" --preset qwen3 --preset mixtral --tokens 1024
  ((started)) && echo quit | nvidia-cuda-mps-control
fi
