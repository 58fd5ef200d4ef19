#!/usr/bin/env bash
# Call 6 as run (the static build from .devbin's pack, the dynamic build under .devbin/new).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | tail -1
B=/tmp/mkb
mkdir -p /tmp/new && for f in test_gpu_ring_attention mkernel; do xz -dc .devbin/new/$f.xz > /tmp/new/$f; chmod +x /tmp/new/$f; done
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
loop() {  # name binary budget_s
  local name=$1 bin=$2 budget=$3 fails=0 s0=$(date +%s) n=0 ok=0
  for i in $(seq 1 200); do
    s=$(date +%s)
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 MK_SIGNAL_TIMEOUT_MS=3000 MK_BOOTSTRAP_TIMEOUT_MS=8000 MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=tcp_rxm MK_NET_STAGING=always \
      timeout -k 5 60 mpirun -np 4 --oversubscribe --bind-to none --tag-output \
      $bin --gtest_filter='RingBackward.*' > /tmp/t.log 2>&1
    rc=$?; n=$((n+1))
    if [[ $rc != 0 ]]; then
      fails=$((fails+1)); cp /tmp/t.log $OUT/${name}_fail$i.log
      echo "$name run $i rc=$rc $(( $(date +%s) - s )) s"
      grep -A30 "did not finish" /tmp/t.log | head -50 | cut -c1-250
      grep -E "timed out after" /tmp/t.log | head -4 | cut -c1-250
      pkill -9 -f test_gpu_ring_attention; sleep 5
      [[ $fails -ge 2 ]] && break
    else ok=$((ok+1)); fi
    [[ $(( $(date +%s) - s0 )) -gt $budget ]] && break
  done
  echo "== $name: $ok of $n runs passed"
}
loop old $B/tests/gpu/test_gpu_ring_attention 140
loop new /tmp/new/test_gpu_ring_attention 140
for W in 1 2 4; do for v in old new; do
  bin=$B/mkernel; [[ $v == new ]] && bin=/tmp/new/mkernel
  echo "== ring bench $v W=$W"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/W)) timeout -k 5 100 mpirun -np $W $bin bench ring_attention --seq 4096 --seq 8192 --reps 10 --json $OUT/ring_${v}_w$W.json 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -8
  pkill -9 -f "mkernel bench"
done; done
