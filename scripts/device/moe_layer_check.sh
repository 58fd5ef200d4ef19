#!/usr/bin/env bash
# The grouped GEMM and the MoE layer on the one-GPU machine from carried binaries (.devbin):
# the ctest entries test_gpu_grouped and test_gpu_moe_layer_* (under MPS, suite.sh), then
# `mkernel bench moe_layer` at W = 1 and at W = 4 under MPS (tokens scaled down, said in its
# output). JSON: $OUT/moe_layer_w1.json, $OUT/moe_layer_w4.json; logs in $OUT/suite_logs.tgz.
#   MK_LAYER_STEPS  "setup unit grouped bench1 bench4" (default: all); grouped: bench_grouped with
#                   both epilogue stores (JSON $OUT/grouped_store1.json, grouped_store2.json)
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
mkdir -p "$RESULT"
steps=${MK_LAYER_STEPS:-"setup unit grouped bench1 bench4"}
has() { [[ " $steps " == *" $1 "* ]]; }
B=/tmp/mkb
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
s=""
has setup && s+="setup "
has unit && s+="unit"
[[ -n $s ]] && MK_SUITE_STEPS="$s" MK_UNIT_ONLY="grouped|moe_layer" bash scripts/device/suite.sh 2>&1 | tail -10
if has grouped; then
  for st in 1 2; do
    timeout 150 "$B/bench/bench_grouped" --reps 10 --store $st --json "$RESULT/grouped_store$st.json" 2>&1 | tail -30
  done
fi
if has bench1; then
  timeout 400 "$B/mkernel" bench moe_layer --reps 10 --warmup 2 --json "$RESULT/moe_layer_w1.json" 2>&1 | tail -14
fi
if has bench4; then
  nvidia-cuda-mps-control -d
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 timeout 300 mpirun --allow-run-as-root -np 4 "$B/mkernel" bench moe_layer \
    --preset qwen3_30b --preset qwen3_235b --preset mixtral --reps 10 --warmup 2 --json "$RESULT/moe_layer_w4.json" \
    2>&1 | tail -12
  echo quit | nvidia-cuda-mps-control
fi
exit 0
