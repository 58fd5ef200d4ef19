#!/usr/bin/env bash
# Call K (2026-12-07): every preset's dispatch at W = 1 with moe_local_dispatch 2, 1, 0 and the
# poll backoff 0 and 1000 ns, twice; the uneven ring (W 2, MPS 50 %) with backoff caps 0, 100,
# 1000, 4000 ns; the even ring with 0 and 1000.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/k; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
echo "== dispatch every preset W 1 at $(el) s"
for rep in 1 2; do for v in 2 1 0; do for bo in 0 1000; do
  MK_WAIT_BACKOFF_NS=$bo MK_MOE_LOCAL_DISPATCH=$v timeout 40 $B/mkernel bench moe_dispatch --reps 30 2>&1 | grep -E "^(preset|deepep|qwen3|mixtral)" | sed "s/^/direct $v bo $bo  /"
done; done; done
nvidia-cuda-mps-control -d
echo "== ring W 2 (MPS 50 %) backoff sweep at $(el) s"
rb() { CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 40 mpirun -np 2 $B/mkernel bench ring_attention --reps 10 --warmup 2 "$@" 2>&1 | grep -vE "^\s*$" | tail -8; }
for bo in 0 100 1000 4000; do echo "rows 3500,4692 backoff $bo:"; MK_WAIT_BACKOFF_NS=$bo rb --rows 3500,4692; done
for bo in 0 1000; do echo "even default backoff $bo:"; MK_WAIT_BACKOFF_NS=$bo rb; done
echo "done at $(el) s"
