#!/usr/bin/env bash
# call 7 (sweep): ring bench at W = 2, 4 with 2, 4, 8 communication CTAs, 20 reps.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup" timeout 60 bash scripts/device/suite.sh 2>&1 | grep -E "^setup" | head -2
B=/tmp/mkb
nvidia-cuda-mps-control -d
for W in 2 4; do for C in 2 4 8; do
  echo "== ring bench W=$W MK_RING_COMM_CTAS=$C"
  MK_RING_COMM_CTAS=$C CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/W)) timeout -k 5 70 mpirun -np $W $B/mkernel bench ring_attention --seq 4096 --seq 8192 --reps 20 --json $OUT/ring_w${W}_c$C.json 2>&1 | grep -E "^ +[0-9]|backward|WRONG|rror" | head -10
  pkill -9 -f "mkernel bench"
done; done
