#!/usr/bin/env bash
# Call R (2026-12-07, eleventh session): a one-off probe, built on the GPU machine from the tree
# of this session's first commit plus callR-probe.patch (not committed; from the project root:
# patch -p1 < bench/results/h100-2026-12-07-roles/callR-probe.patch) — a switch,
# MK_PROBE_COMPUTE_FIRST=1, that makes the ring backward's first grid - comm_ctas CTAs by index
# compute and the last comm_ctas communicate (the reverse of the library's order), so that the
# CTAs the GPU starts first are the compute ones:
# 1. the ring GPU tests at np 2, np 4 and 2 nodes x 2 (tcp) with the switch on: correct?
# 2. the matrix's 6x1-tcp_rxm-always ring-backward launch with the switch on, traced, until
#    330 s (call Q: 10 of 37 failed with the library's order).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/r; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
source .devcarry/env.sh && source .devcarry/extra-env.sh
cmake -S . -B $B -G Ninja > /tmp/cmake.log 2>&1 && ninja -C $B -j16 mkernel test_gpu_ring_attention test_gpu_matrix > /tmp/build.log 2>&1
echo "build rc=$? at $(el) s"; grep -m5 -E "error|FAILED" /tmp/build.log
export MK_PROBE_COMPUTE_FIRST=1
MK_UNIT_ONLY='test_gpu_ring_attention_(np2|np4|2nodes_tcp_np4)' MK_SUITE_STEPS="unit" timeout 120 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
i=0; kept=0
while [ $(el) -lt 330 ]; do
  i=$((i + 1)); mkdir -p $L/r$i/trace
  MK_MATRIX_TRACE_DIR=$L/r$i/trace MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/r$i MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY='^6x1-tcp' timeout 40 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/round $i: /" | cut -c1-90
  if grep -q "timed out\|Failure" $L/r$i/*.log 2>/dev/null; then kept=$((kept + 1)); else [ $i -gt 2 ] && rm -rf $L/r$i; fi
done
echo "rounds: $i, failed kept: $kept, at $(el) s"
tar czf $OUT/r.tgz -C $L . 2>/dev/null
