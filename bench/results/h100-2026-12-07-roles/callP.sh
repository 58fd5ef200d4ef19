#!/usr/bin/env bash
# Call P (2026-12-07, eleventh session), from carried binaries (pack:
# MK_PACK_ONLY='test_gpu_ring_attention$|test_gpu_matrix$|bench_grouped$'):
# 1. roles by arrival in the ring backward (MK_RING_ROLES_BY_ARRIVAL=1): the ring GPU tests in
#    every layout (RolesByArrival among them), then the matrix's 6x1-tcp_rxm-always and
#    4x2-shm-auto ring-backward launches alternately with the tunable 0 and 1 until 330 s
#    (last session's calls N/O: 1 of 11 failed at 0 in 6x1-tcp).
# 2. where the MoE layer's 128-token time goes (issue 33): the layer bench at 128 tokens, the
#    grouped GEMMs against cuBLAS's, and ncu's speed-of-light / memory / warp-state sections of
#    the two grouped GEMM launches of one layer call.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/p; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
MK_UNIT_ONLY='test_gpu_ring_attention' MK_SUITE_STEPS="unit" timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
i=0
while [ $(el) -lt 330 ]; do
  i=$((i + 1))
  for ra in 0 1; do
    MK_RING_ROLES_BY_ARRIVAL=$ra MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/r$i-$ra MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
      MK_MATRIX_ONLY='^(6x1-tcp|4x2-shm)' timeout 40 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/round $i by-arrival $ra: /" | cut -c1-90
  done
done
echo "ring rounds done at $(el) s"
echo quit | nvidia-cuda-mps-control 2>/dev/null
timeout 60 $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 20 2>&1 | tail -6
timeout 60 $B/bench/bench_grouped --tokens 128 --reps 20 2>&1 | tail -14
timeout 120 ncu --target-processes all -k regex:grouped_gemm --launch-skip 4 --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
  $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 3 > $L/ncu.txt 2>&1
grep -E "grouped_gemm|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Stall|Warp Cycles|Registers|Grid Size|L2 Hit|Mem Busy|Max Bandwidth" $L/ncu.txt | head -60
tar czf $OUT/p.tgz -C $L . 2>/dev/null
echo "done at $(el) s"
