#!/usr/bin/env bash
# call 10: the forward's communication CTAs compute once their ops are taken: ring tests, the
# ring matrix launches, ring bench W = 2, 4 (traced).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit smoke" MK_SMOKE_ONLY="ring* bad_seq" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' timeout 200 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^smoke|^FAIL" | head -12
B=/tmp/mkb
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mk-matrix MK_MATRIX_FILTER='Matrix.RingAttentionEveryLayout' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x1-|1x2-|1x4-|2x2-shm|4x1-tcp|2x4-udp|3x2-)' timeout 100 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(FAIL|matrix)" | head -10
mkdir -p /tmp/tr
for W in 2 4; do
  echo "== ring bench W=$W (traced)"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/W)) timeout -k 5 70 mpirun -np $W $B/mkernel bench ring_attention --seq 4096 --seq 8192 --reps 20 --json $OUT/ring_w$W.json --trace /tmp/tr/tr 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -10
  pkill -9 -f "mkernel bench"
done
tar czf $OUT/traces.tgz -C /tmp/tr .
