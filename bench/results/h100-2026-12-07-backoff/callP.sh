#!/usr/bin/env bash
# Call P (written 2026-12-07 for the next session, not run): roles by arrival in the ring
# backward (MK_RING_ROLES_BY_ARRIVAL=1). The ring GPU tests in every layout (RolesByArrival among
# them), then the matrix's 6x1-tcp_rxm-always and 4x2-shm-auto ring-backward launches alternately
# with the tunable 0 and 1 until the time is spent (call O's measurement: 1 of 9 and 0 of 9 failed
# at 0). Pack: MK_PACK_ONLY='test_gpu_ring_attention$|test_gpu_matrix$'.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/p; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
MK_UNIT_ONLY='test_gpu_ring_attention' MK_SUITE_STEPS="unit" timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
i=0
while [ $(el) -lt 420 ]; do
  i=$((i + 1))
  for ra in 0 1; do
    MK_RING_ROLES_BY_ARRIVAL=$ra MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/r$i-$ra MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
      MK_MATRIX_ONLY='^(6x1-tcp|4x2-shm)' timeout 40 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/round $i by-arrival $ra: /" | cut -c1-90
  done
done
tar czf $OUT/p.tgz -C $L . 2>/dev/null
echo "done at $(el) s"
