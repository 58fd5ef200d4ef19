#!/usr/bin/env bash
# call 2: torch ops (packed ring added) and the example; the ring bench dense and packed at W = 2
# and 4 (ranks share the GPU under MPS); the GPU mutants of the packed path.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[[ -x /tmp/mkb/mkernel ]] || MK_SUITE_STEPS="setup" timeout 120 bash scripts/device/suite.sh 2>&1 | tail -2
B=/tmp/mkb
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== the packed-documents ring tests, by name (np 2)"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 mpirun -np 2 $B/tests/gpu/test_gpu_ring_attention --gtest_filter='*Documents*' > $OUT/docs_gtest.log 2>&1; echo "rc=$?"; grep -E "OK \]|FAILED|PASSED|Failure" $OUT/docs_gtest.log | sort | uniq -c | head -20
echo "== GPU mutants"
MK_SUITE_STEPS="setup mutants" timeout 200 bash scripts/device/suite.sh 2>&1 | grep -E "caught|SURVIVED|mutation|FAIL" | head -10
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== torch"
export MK_CAPI=$B/libmkernel_capi.so PYTHONPATH=$PWD/python
MK_TORCH_STEPS=unit MK_TORCH_ONLY='test_torch_ops_np4$|example_decoder_layer_np2' timeout 200 bash scripts/device/torch_check.sh 2>&1 | tee $OUT/torch.log | grep -E "passed|PASS|FAIL|rror|packed" | tail -8
for W in 2 4; do
  for D in "" "--doc-len 1024" "--doc-len 3000"; do
    n=$(echo "$D" | tr -d ' -' ); n=${n:-dense}
    echo "== ring bench W=$W $D"
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/W)) timeout -k 5 80 mpirun -np $W $B/mkernel bench ring_attention --seq 4096 --seq 8192 $D --reps 10 --json $OUT/ring_w${W}_$n.json 2>&1 | grep -E "^ +[0-9]|backward|documents|WRONG|rror" | head -10
    pkill -9 -f "mkernel bench"
  done
done
