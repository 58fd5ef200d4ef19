#!/usr/bin/env bash
# Call S (2026-12-07, eleventh session), from carried binaries (pack:
# MK_PACK_ONLY='test_gpu_ring_attention$|test_gpu_matrix$'), the tree with the ring backward's
# roles interleaved by index (src/attention/ring_roles.h), in the little device time left:
# 1. the ring GPU tests at np 1, 2, 4 and 2 nodes x 2 over tcp;
# 2. the matrix's 6x1-tcp_rxm-always ring-backward launch, traced, until 85 s (call Q: 10 of 37
#    failed with the communication CTAs first).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/s; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_tcp_np4)' MK_SUITE_STEPS="unit" timeout 45 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -12
i=0
while [ $(el) -lt 85 ]; do
  i=$((i + 1)); mkdir -p $L/r$i/trace
  MK_MATRIX_TRACE_DIR=$L/r$i/trace MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/r$i MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY='^6x1-tcp' timeout 25 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/round $i: /" | cut -c1-90
done
echo "rounds: $i at $(el) s"
tar czf $OUT/s.tgz -C $L . 2>/dev/null
