#!/usr/bin/env bash
# Call A, most valuable first (a call cut at its limit keeps what it wrote under $OUT): the torch
# ops at W = 2 with MoE dispatch/combine/layer (forward, autograd, compile, graph); the MoE gtests
# (caller-memory handles, a combine's own weights); the uneven/packed-documents ring gtests
# (d745850, b0f1393 and the packed-documents work, never run on a GPU); the ring units; torch at
# W = 4 and 1; examples/moe_block.py at W = 2. Carried binaries:
#   rm -rf .devbin && MK_BUILD_DIR=build MK_PACK_ONLY='test_gpu_ring_attention$|test_gpu_matrix$|test_gpu_moe$|test_gpu_moe_layer$|test_gpu_collective$' \
#     MK_PACK_MUTANTS=/tmp/mut2 bash scripts/device/pack_binaries.sh
# run as `bash .devbin/callA.sh` with carry [".devbin"].
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
B=/tmp/mkb
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
export PYTHONPATH=$PWD/python
torch_np() {
  local np=$1 s=$(date +%s)
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) MK_CAPI=$B/libmkernel_capi.so timeout 200 \
    python3 -m torch.distributed.run --standalone --nproc-per-node $np tests/gpu/test_torch_ops.py > $OUT/torch_np$np.log 2>&1
  echo "torch np$np rc=$? $(( $(date +%s) - s )) s"
  grep -E "FAIL|moe|ring_attention|uneven|balanced|packed|test_torch_ops " $OUT/torch_np$np.log | cut -c1-300 | head -16
}
echo "== torch W = 2 at $(( $(date +%s) - t0 )) s"; torch_np 2
echo "== MoE gtests at $(( $(date +%s) - t0 )) s"
for np in 1 2; do
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 90 mpirun -np $np $B/tests/gpu/test_gpu_moe \
    --gtest_filter='Moe.*:-*ConfigMismatch*' > $OUT/moe_np$np.log 2>&1; echo "moe np$np rc=$?"
  grep -E "OK \]|FAILED|PASSED|Failure" $OUT/moe_np$np.log | sort | uniq -c | head -12
done
echo "== MoE layer gtests (np 1; the small-batch dispatch path inside) at $(( $(date +%s) - t0 )) s"
timeout 150 mpirun -np 1 $B/tests/gpu/test_gpu_moe_layer > $OUT/moe_layer_np1.log 2>&1; echo "moe_layer np1 rc=$?"
grep -E "OK \]|FAILED|PASSED|Failure" $OUT/moe_layer_np1.log | sort | uniq -c | head -12
echo "== standalone collectives np 1, 2 (the runner's op counter now zeroed by its last CTA) at $(( $(date +%s) - t0 )) s"
for np in 1 2; do
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 120 mpirun -np $np $B/tests/gpu/test_gpu_collective > $OUT/coll_np$np.log 2>&1; echo "collective np$np rc=$?"
  grep -E "OK \]|FAILED|PASSED|Failure" $OUT/coll_np$np.log | sort | uniq -c | head -8
done
echo "== the uneven and packed-documents ring tests, by name (np 2) at $(( $(date +%s) - t0 )) s"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 mpirun -np 2 $B/tests/gpu/test_gpu_ring_attention \
  --gtest_filter='*Uneven*:*Documents*:*BadInput*' > $OUT/gtest.log 2>&1; echo "rc=$?"
grep -E "OK \]|FAILED|PASSED|Failure" $OUT/gtest.log | sort | uniq -c | head -30
echo "== ring units at $(( $(date +%s) - t0 )) s"
MK_SUITE_STEPS="unit" MK_UNIT_ONLY='test_gpu_ring_attention_(np4|2nodes_tcp_np4)$' \
  timeout 200 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -12
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== torch W = 4, 1 at $(( $(date +%s) - t0 )) s"; torch_np 4; torch_np 1
echo "== examples/moe_block.py W = 2 at $(( $(date +%s) - t0 )) s"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 MK_CAPI=$B/libmkernel_capi.so timeout 120 \
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/moe_block.py --reps 3 > $OUT/moe_block_np2.log 2>&1
echo "moe_block np2 rc=$?"; grep -E "rank 0|moe_block|Error" $OUT/moe_block_np2.log | head -8
echo "done at $(( $(date +%s) - t0 )) s"
