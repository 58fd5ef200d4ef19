#!/usr/bin/env bash
# call 9 (final validation of this session's build): ring tests, the ring CLI lines, the ring
# launches of the configuration matrix, torch's ring autograd and the example, and the ring bench
# (traced) for the figures.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit smoke" MK_SMOKE_ONLY="ring* bad_seq" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' timeout 240 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^setup|^smoke|^FAIL" | head -20
B=/tmp/mkb
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== matrix (ring launches)"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mk-matrix MK_MATRIX_FILTER='Matrix.RingAttentionEveryLayout' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x1-|1x2-|1x4-|2x2-shm|4x1-tcp|2x4-udp|3x2-)' timeout 150 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL|matrix)" | head -20
echo "== torch"
export MK_CAPI=$B/libmkernel_capi.so PYTHONPATH=$PWD/python
MK_TORCH_STEPS=unit MK_TORCH_ONLY='test_torch_ops_np4$|example_decoder_layer_np2' timeout 150 bash scripts/device/torch_check.sh 2>&1 | grep -E "passed|PASS|FAIL|rror" | tail -6
mkdir -p /tmp/tr
for W in 2 4; do
  echo "== ring bench W=$W (traced)"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/W)) timeout -k 5 70 mpirun -np $W $B/mkernel bench ring_attention --seq 4096 --seq 8192 --reps 20 --json $OUT/ring_w$W.json --trace /tmp/tr/tr 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -10
  pkill -9 -f "mkernel bench"
done
tar czf $OUT/traces.tgz -C /tmp/tr .
