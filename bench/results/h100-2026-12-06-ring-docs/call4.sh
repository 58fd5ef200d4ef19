#!/usr/bin/env bash
# call 4 (the budget's last ~170 s): the ring tests np2 / np4 / 2 nodes x 2 over tcp, the
# packed-documents ring tests by name (np 2, with output), the matrix's ring launches forward and
# backward (1x2, 4x1-tcp, 2x4-udp), torch ops at np 4.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit" MK_UNIT_ONLY='test_gpu_ring_attention_(np2|np4|2nodes_tcp_np4)$' timeout 60 bash scripts/device/suite.sh 2>&1 | tee $OUT/unit.log | grep -E "^unit|^setup" | head -6
pkill -9 -f test_gpu_ring
B=/tmp/mkb
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== the packed-documents ring tests, by name (np 2)"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 40 mpirun -np 2 $B/tests/gpu/test_gpu_ring_attention --gtest_filter='*Documents*' > $OUT/docs_gtest.log 2>&1; echo "rc=$?"; grep -E "OK \]|FAILED|PASSED|Failure" $OUT/docs_gtest.log | sort | uniq -c | head -20
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== matrix (ring launches, forward and backward)"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=$OUT/m MK_MATRIX_FILTER='Matrix.RingAttention*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x2-|4x1-tcp|2x4-udp)' timeout 50 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL|matrix)" | head -8
echo "== torch"
export MK_CAPI=$B/libmkernel_capi.so PYTHONPATH=$PWD/python
MK_TORCH_STEPS=unit MK_TORCH_ONLY='test_torch_ops_np4$' timeout 90 bash scripts/device/torch_check.sh > $OUT/torch.log 2>&1; grep -E "packed|ring_attention|passed|PASS |FAIL" $OUT/torch.log | cut -c1-300 | head -10
