#!/usr/bin/env bash
# Call D: call C cut to what the session's last device time fits: the torch ops at W 2 (the MoE
# layer's derived bound), the matrix's ring launch 1x2 with its failure lines, MoE dispatch at
# 128 tokens (six-launch vs small-batch path, 0 256 0 256).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
B=/tmp/mkb
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 MK_CAPI=$B/libmkernel_capi.so PYTHONPATH=$PWD/python timeout 80 \
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/test_torch_ops.py > $OUT/torch_np2.log 2>&1
echo "torch np2 rc=$?"; grep -E "FAIL|moe_layer|test_torch_ops " $OUT/torch_np2.log | cut -c1-300 | head -6
echo "== matrix ring 1x2 at $(( $(date +%s) - t0 )) s"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mr MK_MATRIX_FILTER='Matrix.RingAttention*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^1x2-' timeout 40 bash scripts/device/matrix_check.sh 2>&1 | head -12
cp /tmp/mr/*.log $OUT/ 2>/dev/null
echo "== MoE dispatch 128 tokens at $(( $(date +%s) - t0 )) s"
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
for v in 0 256 0 256; do
  MK_MOE_SMALL_TOKENS=$v timeout 30 $B/mkernel bench moe_dispatch --preset deepep_ll --preset qwen3 --preset mixtral \
    --tokens 128 --reps 50 2>&1 | grep -E "^(deepep_ll|qwen3|mixtral) " | sed "s/^/small_tokens $v  /"
done
echo "done at $(( $(date +%s) - t0 )) s"
