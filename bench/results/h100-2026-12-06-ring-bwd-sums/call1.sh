#!/usr/bin/env bash
# Session 2026-12-06 (third) call 1: HEAD's ring tests, GPU mutants, torch np4, ring bench traced.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit mutants" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' timeout 200 bash scripts/device/suite.sh 2>&1 | grep -vE "^      " | tail -20
B=/tmp/mkb
pkill -9 -f test_gpu_ring; pkill -9 -f "mkernel bench"
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
for W in 2 4; do
  echo "== ring bench W=$W (traced)"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/W)) timeout -k 5 60 mpirun -np $W $B/mkernel bench ring_attention --seq 4096 --seq 8192 --reps 10 --json $OUT/ring_w$W.json --trace $OUT/tr 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -10
  pkill -9 -f "mkernel bench"
done
for C in 8 16; do
  echo "== ring bench W=2 MK_RING_COMM_CTAS=$C"
  MK_RING_COMM_CTAS=$C CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout -k 5 45 mpirun -np 2 $B/mkernel bench ring_attention --seq 4096 --seq 8192 --reps 10 --json $OUT/ring_w2_c$C.json 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -10
  pkill -9 -f "mkernel bench"
done
echo "== torch np4"
export MK_CAPI=$B/libmkernel_capi.so PYTHONPATH=$PWD/python
MK_TORCH_STEPS=unit MK_TORCH_ONLY='test_torch_ops_np4$' timeout 120 bash scripts/device/torch_check.sh 2>&1 | tail -4
