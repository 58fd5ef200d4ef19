#!/usr/bin/env bash
# Call N (2026-12-07): the ring backward's hang in the matrix (call M: 6x1-tcp_rxm-always and
# 4x2-shm-auto, second call, no item of the call done on any rank) with the poll backoff off
# (0) and at its default (-1: on under MPS), twice each; then the unit tests call L's time
# limit cut (the MoE layer, the MoE block example), the uneven ring at the defaults, the CLI lines.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/n; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
keep() { tar czf $OUT/n.tgz -C $L . 2>/dev/null; }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
mx() {  # name-regex backoff tag
  MK_WAIT_BACKOFF_NS=$2 MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/$3 MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY="$1" timeout 70 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/$3 backoff $2: /"
}
echo "== ring backward at $(el) s"
for i in 1 2; do for bo in 0 -1; do mx '^(6x1-tcp|4x2-shm)' $bo r$i$bo; keep; done; done
echo "== units at $(el) s"
MK_UNIT_ONLY='moe_layer|example_moe_block' MK_SUITE_STEPS="unit" timeout 200 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
nvidia-cuda-mps-control -d 2>/dev/null
echo "== uneven ring W 2 (MPS 50 %), defaults, at $(el) s"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 40 mpirun -np 2 $B/mkernel bench ring_attention --reps 10 --warmup 2 --rows 3500,4692 2>&1 | grep -E "uneven /|check:|backward:" | head -6
echo "== CLI lines at $(el) s"
MK_BUILD_DIR=$B MK_SMOKE_LOGS=$L/smoke MK_SMOKE_MPS=0 timeout $(( 520 - $(el) )) bash scripts/device/cli_smoke.sh > $L/smoke.log 2>&1
echo "smoke: $(grep -cE "^PASS" $L/smoke.log) PASS, $(grep -cE "^FAIL" $L/smoke.log) FAIL"; grep -E "^FAIL" -A4 $L/smoke.log | head -24; tail -1 $L/smoke.log
keep; echo "done at $(el) s"
