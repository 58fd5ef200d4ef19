#!/usr/bin/env bash
# Call Q (2026-12-07, eleventh session), built on the GPU machine (carry .devcarry from
# scripts/device/prepare.sh; no .devbin), the tree with roles by arrival removed and the ring backward's per-CTA life events (Role::kCta) traced:
# 1. the ring GPU tests in every layout;
# 2. the matrix's 6x1-tcp_rxm-always ring-backward launch, traced (MK_MATRIX_TRACE_DIR: every
#    rank's timeline of every case's backward call, written also after a failed call), again
#    and again until 330 s: a failed run's timelines say when each CTA started against when
#    the waits gave up.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/q; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
if [ ! -x $B/tests/gpu/test_gpu_matrix ] || [ -n "${REBUILD:-}" ]; then
  source .devcarry/env.sh && source .devcarry/extra-env.sh
  cmake -S . -B $B -G Ninja > /tmp/cmake.log 2>&1 && ninja -C $B -j16 mkernel test_gpu_ring_attention test_gpu_matrix > /tmp/build.log 2>&1
  echo "build rc=$? at $(el) s"; grep -m5 -E "error|FAILED" /tmp/build.log
fi
MK_UNIT_ONLY='test_gpu_ring_attention' MK_SUITE_STEPS="unit" timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
i=0; kept=0
while [ $(el) -lt 330 ]; do
  i=$((i + 1)); mkdir -p $L/r$i/trace
  MK_MATRIX_TRACE_DIR=$L/r$i/trace MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/r$i MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY='^6x1-tcp' timeout 40 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/round $i: /" | cut -c1-90
  if grep -q "timed out" $L/r$i/*.log 2>/dev/null; then kept=$((kept + 1)); else [ $i -gt 2 ] && rm -rf $L/r$i; fi
done
echo "rounds: $i, failed kept: $kept, at $(el) s"
tar czf $OUT/q.tgz -C $L . 2>/dev/null
ls -la $OUT
