#!/usr/bin/env bash
# Call B (the machine warm from call A): attention backward against cuDNN, the library as built (A)
# and a variant whose steps issue dQ before dK (V: the backward units built with
# -DMK_BWD_DQ_FIRST=1 and relinked, .devbin/capi_dqfirst.so.xz), A V A, and the backward test on V;
# the GPU mutants of the uneven and packed-documents ring work; the matrix's ring launches;
# ring bench: uneven against padded even, balanced against zigzag (W 2, 4 under MPS). First: MoE
# at 128 tokens per rank, W = 1, on the six-launch path and on the small-batch path (route+pack,
# layout+unpack; MK_MOE_SMALL_TOKENS), alternating.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
B=/tmp/mkb
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh > /dev/null 2>&1
xz -dc .devbin/capi_dqfirst.so.xz > /tmp/capi_v.so
export PYTHONPATH=$PWD/python
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
run() { MK_CAPI=$2 timeout 100 python3 bench/bench_attention_bwd.py --reps 10 --seqs 1024,4096,8192 --json $OUT/bwd_$1.json 2>&1 | tail -13; }
echo "== MoE small batches: six-launch path (MK_MOE_SMALL_TOKENS=0) and small-batch path (default 256), 0 256 0 256"
i=0; for v in 0 256 0 256; do i=$((i + 1))
  echo "-- moe_small_tokens $v"
  MK_MOE_SMALL_TOKENS=$v timeout 60 $B/mkernel bench moe_dispatch --preset deepep_ll --reps 50 --json $OUT/moe_ll_small${v}_$i.json 2>&1 | grep -vE "^(GB/s|unfused =|nccl =|moe_dispatch:)" | head -6
  MK_MOE_SMALL_TOKENS=$v timeout 60 $B/mkernel bench moe_dispatch --preset qwen3 --preset mixtral --tokens 128 --reps 50 2>&1 | grep -vE "^(GB/s|unfused =|nccl =|moe_dispatch:)" | head -8
  MK_MOE_SMALL_TOKENS=$v timeout 60 $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 50 --json $OUT/moe_layer128_small${v}_$i.json 2>&1 | grep -vE "^(GB/s|unfused =|nccl =|moe_layer:)" | head -6
done
echo "== A at $(( $(date +%s) - t0 )) s"; run A1 $B/libmkernel_capi.so
echo "== V"; run V1 /tmp/capi_v.so
echo "== A"; run A2 $B/libmkernel_capi.so
echo "== test V"; MK_CAPI=/tmp/capi_v.so timeout 90 python3 tests/gpu/test_attention_bwd.py 2>&1 | tail -2
echo "== mutants at $(( $(date +%s) - t0 )) s"
MK_SUITE_STEPS="mutants" timeout 200 bash scripts/device/suite.sh 2>&1 | grep -E "^mutant|caught|SURVIV" | head -10
pkill -9 -f test_gpu_ring
echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d
echo "== matrix ring launches at $(( $(date +%s) - t0 )) s"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mk-matrix MK_MATRIX_FILTER='Matrix.RingAttention*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x2-|1x4-|2x2-shm|4x1-tcp|3x2-)' timeout 120 bash scripts/device/matrix_check.sh 2>&1 \
  | grep -E "^(PASS|FAIL|matrix)" | head -20
echo "== ring bench at $(( $(date +%s) - t0 )) s"
for w in 2 4; do
  pct=$((100 / w))
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 60 mpirun -np $w $B/mkernel bench ring_attention \
    --rows $( ((w == 2)) && echo 3500,4692 || echo 3500,4692,4096,4100) --reps 10 --json $OUT/uneven_w$w.json 2>&1 \
    | grep -E "^ +[0-9]|uneven|backward" | head -8
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 60 mpirun -np $w $B/mkernel bench ring_attention \
    --seq 4096 --doc-len 3000 --balanced --reps 10 --json $OUT/balanced_w$w.json 2>&1 \
    | grep -E "^ +[0-9]|balanced|backward|documents" | head -10
done
echo "done at $(( $(date +%s) - t0 )) s"
