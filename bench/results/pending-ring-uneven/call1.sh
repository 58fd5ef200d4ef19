#!/usr/bin/env bash
# The first GPU call after ring attention on uneven shards and balanced shards (commits d745850,
# b0f1393) and the previous session's untested packed-documents changes (empty items, the matrix
# backward test, the torch packed check's bound, bulk_load). Carry binaries built on the CPU
# machine: rm -rf .devbin && MK_BUILD_DIR=build MK_PACK_ONLY='test_gpu_ring_attention$|test_gpu_matrix$'
# MK_PACK_MUTANTS=/tmp/mut bash scripts/device/pack_binaries.sh (the mutants from
# MK_MUTATION_DIR=/tmp/mk-mutation-gpu python3 scripts/mutation_check.py --gpu --build-only /tmp/mut
# --only ring-uneven-finish-chunk1-full-length ring-uneven-slots-at-own-rows
# ring-docs-forward-keeps-other-documents ring-docs-backward-skips-last-query-block), then
# cp this file .devbin/call.sh and run `bash .devbin/call.sh` with carry [".devbin"].
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MK_SUITE_STEPS="setup unit mutants" MK_UNIT_ONLY='test_gpu_ring_attention_(np1|np2|np4|2nodes_shm_np4|2nodes_tcp_np4)$' \
  timeout 240 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^setup|^mutant|^FAIL|caught|SURVIV" | head -30
B=/tmp/mkb
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== the uneven and packed-documents ring tests, by name (np 2)"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 mpirun -np 2 $B/tests/gpu/test_gpu_ring_attention \
  --gtest_filter='*Uneven*:*Documents*:*BadInput*' > $OUT/gtest.log 2>&1; echo "rc=$?"
grep -E "OK \]|FAILED|PASSED|Failure" $OUT/gtest.log | sort | uniq -c | head -30
echo "== matrix (ring launches, forward and backward, with the uneven cases)"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mk-matrix MK_MATRIX_FILTER='Matrix.RingAttention*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x1-|1x2-|1x4-|2x2-shm|4x1-tcp|2x4-udp|3x2-)' timeout 150 bash scripts/device/matrix_check.sh 2>&1 \
  | grep -E "^(PASS|FAIL|matrix)" | head -20
grep -h -E "Failure|wrong; first|rank [0-9]+ call" /tmp/mk-matrix/*.log 2>/dev/null | sort | uniq -c | head -10
echo "== torch (uneven, balanced, packed)"
export MK_CAPI=$B/libmkernel_capi.so PYTHONPATH=$PWD/python
MK_TORCH_STEPS=unit MK_TORCH_ONLY='test_torch_ops_np4$' timeout 150 bash scripts/device/torch_check.sh > $OUT/torch.log 2>&1
grep -E "uneven|balanced|packed|ring_attention|passed|PASS |FAIL" $OUT/torch.log | cut -c1-400 | head -14
echo "== bench: uneven against padded even, balanced against zigzag (W 2 and 4 under MPS)"
for w in 2 4; do
  pct=$((100 / w))
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 120 mpirun -np $w $B/mkernel bench ring_attention \
    --rows $( ((w == 2)) && echo 3500,4692 || echo 3500,4692,4096,4100) --reps 10 --json $OUT/uneven_w$w.json 2>&1 \
    | grep -E "^ +[0-9]|uneven|backward" | head -8
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 120 mpirun -np $w $B/mkernel bench ring_attention \
    --seq 4096 --doc-len 3000 --balanced --reps 10 --json $OUT/balanced_w$w.json 2>&1 \
    | grep -E "^ +[0-9]|balanced|backward|documents" | head -10
done
