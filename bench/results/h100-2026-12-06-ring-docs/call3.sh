#!/usr/bin/env bash
# call 3: after the empty-item merge path — ring tests (5 configurations), the packed-documents
# ring tests by name, the ring launches of the configuration matrix
# (forward and the new backward), torch ops (the packed check now collects its failures before
# raising). (The budget left no room for the bench.)
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^setup|^FAIL" | head -20
B=/tmp/mkb
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== the packed-documents ring tests, by name (np 2)"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 mpirun -np 2 $B/tests/gpu/test_gpu_ring_attention --gtest_filter='*Documents*' > $OUT/docs_gtest.log 2>&1; echo "rc=$?"; grep -E "OK \]|FAILED|PASSED|Failure" $OUT/docs_gtest.log | sort | uniq -c | head -20
echo "== matrix (ring launches, forward and backward)"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mk-matrix MK_MATRIX_FILTER='Matrix.RingAttention*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x1-|1x2-|1x4-|2x2-shm|4x1-tcp|2x4-udp|3x2-)' timeout 120 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL|matrix)" | head -20
grep -h -E "Failure|wrong; first|rank [0-9]+ call" /tmp/mk-matrix/*.log 2>/dev/null | sort | uniq -c | head -10
echo "== torch"
export MK_CAPI=$B/libmkernel_capi.so PYTHONPATH=$PWD/python
MK_TORCH_STEPS=unit MK_TORCH_ONLY='test_torch_ops_np4$' timeout 150 bash scripts/device/torch_check.sh > $OUT/torch.log 2>&1; grep -E "packed|ring_attention|passed|PASS |FAIL" $OUT/torch.log | cut -c1-400 | head -12
