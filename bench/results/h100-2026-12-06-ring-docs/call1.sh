#!/usr/bin/env bash
# call 1: the ring tests (packed documents added), the ring CLI lines (a packed-documents line
# over tcp), the ring launches of the configuration matrix (two packed-documents cases added).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit smoke" MK_SMOKE_ONLY="ring* bad_seq bad_doc_len" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' timeout 330 bash scripts/device/suite.sh 2>&1 | tee $OUT/suite.log | grep -E "^unit|^setup|^smoke|^FAIL|^PASS" | head -30
B=/tmp/mkb
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== matrix (ring launches)"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mk-matrix MK_MATRIX_FILTER='Matrix.RingAttentionEveryLayout' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x1-|1x2-|1x4-|2x2-shm|4x1-tcp|2x4-udp|3x2-)' timeout 200 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL|matrix)" | head -20
mkdir -p $OUT/logs; cp -r /tmp/mk-matrix $OUT/logs/ 2>/dev/null
for f in $(grep -l "FAIL\|Failure" /tmp/mk-unit*/*.log /tmp/mk-*/*.log 2>/dev/null | head -5); do echo "== $f"; grep -E "Failure|Expected|Which is|rank [0-9]+ call|wrong|off" $f | head -20; done
