#!/usr/bin/env bash
# call 6: sums in parts of at most 1 MiB (the call-4 script, a shorter tcp loop, plus bench_comm_ops under MPS).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^setup" | head -8
B=/tmp/mkb
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
s0=$(date +%s); n=0; ok=0
while [[ $(( $(date +%s) - s0 )) -lt 30 ]]; do
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 MK_SIGNAL_TIMEOUT_MS=3000 MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always \
    timeout -k 5 30 mpirun -np 4 --oversubscribe --bind-to none $B/tests/gpu/test_gpu_ring_attention --gtest_filter='RingBackward.*' > /tmp/t.log 2>&1
  rc=$?; n=$((n+1)); [[ $rc == 0 ]] && ok=$((ok+1))
  if [[ $rc != 0 ]]; then grep -E "did not finish|ready\[|epoch|timed out|FAIL" /tmp/t.log | head -8 | cut -c1-200; pkill -9 -f test_gpu_ring; sleep 4; fi
done
echo "== tcp loop: $ok of $n runs passed"
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
echo "== bench_comm_ops under MPS (50%)"; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 60 $B/bench/bench_comm_ops --reps 3 --mib 64 2>&1 | grep -E "(reduce2|copy bulk) .* (1|4) "
tar czf $OUT/traces.tgz -C /tmp/tr .
