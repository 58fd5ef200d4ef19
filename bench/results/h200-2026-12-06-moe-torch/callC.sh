#!/usr/bin/env bash
# Call C (2026-12-06, seventh session): after calls A and B — the torch ops with the MoE layer's
# derived bound (W 2, 4); the matrix's ring launches again with their logs kept (all 7 failed in
# 3-7 s in call B, logs lost); the MoE units in every layout (the small-batch path by default
# now); the matrix's collectives launches (the runner's op counter zeroed by its last CTA);
# MoE dispatch at 128 tokens, six-launch vs small-batch path (0 256 0 256). Logs: $OUT/logs.tgz.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
B=/tmp/mkb
L=/tmp/c; mkdir -p $L
keep() { tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
export PYTHONPATH=$PWD/python
for np in 2 4; do
  s=$(date +%s)
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) MK_CAPI=$B/libmkernel_capi.so timeout 150 \
    python3 -m torch.distributed.run --standalone --nproc-per-node $np tests/gpu/test_torch_ops.py > $L/torch_np$np.log 2>&1
  echo "torch np$np rc=$? $(( $(date +%s) - s )) s"
  grep -E "FAIL|moe_layer|test_torch_ops " $L/torch_np$np.log | cut -c1-300 | head -8
done
keep
echo "== matrix ring launches at $(( $(date +%s) - t0 )) s"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/matrix_ring MK_MATRIX_FILTER='Matrix.RingAttention*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x2-|1x4-|2x2-shm|4x1-tcp)' timeout 100 bash scripts/device/matrix_check.sh 2>&1 \
  | grep -E "^(PASS|FAIL|matrix)" | head -10
f=$(ls $L/matrix_ring/*1x2* 2>/dev/null | head -1); [ -n "$f" ] && grep -E "Failure|FAILED|rror|expected|Which is" $f | head -12
keep
echo "== MoE units, every layout, at $(( $(date +%s) - t0 )) s"
MK_SUITE_STEPS="unit" MK_UNIT_ONLY='test_gpu_moe' timeout 200 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
cp -r /tmp/mk-suite $L/suite 2>/dev/null
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
keep
echo "== matrix collectives launches at $(( $(date +%s) - t0 )) s"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/matrix_coll MK_MATRIX_FILTER='Matrix.Collectives*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x2-|1x4-|2x2-shm|4x1-tcp)' timeout 100 bash scripts/device/matrix_check.sh 2>&1 \
  | grep -E "^(PASS|FAIL|matrix)" | head -10
keep
echo "== MoE dispatch at 128 tokens, W 1: moe_small_tokens 0 256 0 256 at $(( $(date +%s) - t0 )) s"
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
for v in 0 256 0 256; do
  MK_MOE_SMALL_TOKENS=$v timeout 60 $B/mkernel bench moe_dispatch --preset deepep_ll --preset qwen3 --preset mixtral \
    --tokens 128 --reps 50 2>&1 | grep -E "^(deepep_ll|qwen3|mixtral) " | sed "s/^/small_tokens $v  /"
done
keep
echo "done at $(( $(date +%s) - t0 )) s"
