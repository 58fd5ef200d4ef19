#!/usr/bin/env bash
# call 3: the bulk reduce with bulk stores: micro-bench, ring tests, ring bench.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^setup" | head -8
B=/tmp/mkb
pkill -9 -f test_gpu_ring
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
timeout 120 $B/bench/bench_comm_ops --reps 5 --json $OUT/comm_ops.json 2>&1 | grep -E "reduce|WRONG|engine|on NVIDIA"
nvidia-cuda-mps-control -d
mkdir -p /tmp/tr
for W in 2 4; do
  echo "== ring bench W=$W (traced)"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/W)) timeout -k 5 60 mpirun -np $W $B/mkernel bench ring_attention --seq 4096 --seq 8192 --reps 10 --json $OUT/ring_w$W.json --trace /tmp/tr/tr 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -10
  pkill -9 -f "mkernel bench"
done
for C in 8; do
  echo "== ring bench W=2 MK_RING_COMM_CTAS=$C"
  MK_RING_COMM_CTAS=$C CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout -k 5 45 mpirun -np 2 $B/mkernel bench ring_attention --seq 4096 --seq 8192 --reps 10 --json $OUT/ring_w2_c$C.json 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -10
  pkill -9 -f "mkernel bench"
done
tar czf $OUT/traces.tgz -C /tmp/tr .
