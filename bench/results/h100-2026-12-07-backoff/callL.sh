#!/usr/bin/env bash
# Call L (2026-12-07): after the defaults moved (moe_local_dispatch 2; wait_backoff_ns -1: a
# 1000 ns poll backoff where ranks share a GPU), every GPU test (ranks under MPS) and the CLI
# smoke lines; then the fused GEMMs' f/c under MPS with the backoff off and on (issue 31).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb
el() { echo $(( $(date +%s) - t0 )); }
MK_UNIT_ONLY='^(test_gpu_(threads|abort|bounded|lifetime|heap|signal|proxy|gemm_peer|fused|collective|matrix|baseline|ring|moe)|test_attention|test_torch|example)' MK_SUITE_STEPS="setup unit smoke" timeout 420 bash scripts/device/suite.sh 2>&1 | grep -E "^(setup|smoke)|^unit: |FAIL|^      " | head -40
echo "== bench all 8192x3584x4096, MPS at 100/W %, at $(el) s"
nvidia-cuda-mps-control -d 2>/dev/null
for np in 2 4; do for bo in 0 -1; do
  echo "-- np $np MK_WAIT_BACKOFF_NS=$bo"
  MK_WAIT_BACKOFF_NS=$bo CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/np)) timeout 60 mpirun -np $np $B/mkernel bench all --m 8192 --n 3584 --k 4096 --reps 20 2>&1 \
    | grep -vE "^\s*$|^bench:|^check" | tail -6
done; done
echo "done at $(el) s"
