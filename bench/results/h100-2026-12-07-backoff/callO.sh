#!/usr/bin/env bash
# Call O (2026-12-07): how often the ring backward's first call times out in the matrix's
# 6x1-tcp_rxm-always and 4x2-shm-auto launches with the poll backoff off (0) and on (-1: 1000 ns
# under MPS), alternating, until the time is spent.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/o; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
i=0
while [ $(el) -lt 250 ]; do
  i=$((i + 1))
  for bo in 0 -1; do
    MK_WAIT_BACKOFF_NS=$bo MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/r$i$bo MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
      MK_MATRIX_ONLY='^(6x1-tcp|4x2-shm)' timeout 40 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/round $i backoff $bo: /" | cut -c1-90
  done
done
tar czf $OUT/o.tgz -C $L . 2>/dev/null
echo "done at $(el) s"
