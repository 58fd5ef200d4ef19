#!/usr/bin/env bash
# Call J (written 2026-12-07, not run: the session's device time ran out in refused starts):
# call I cut to ~110 s — the MoE units at np 1 (the direct-rows scatter past the small-batch
# bound), every preset's dispatch at its default tokens both ways (MK_MOE_LOCAL_DISPATCH 2: the
# scatter; 0: the record path), the uneven ring with and without poll backoff, the matrix ring
# backward 1x1 (zero-dK test fix) and 6x1-tcp_rxm-always (seed 317528730, each rank's progress
# printed on failure). With a full budget run callI.sh instead.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/j; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
keep() { tar czf $OUT/j.tgz -C $L . 2>/dev/null; }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
echo "== MoE units np 1 at $(el) s"
MK_SUITE_STEPS="unit" MK_UNIT_ONLY='test_gpu_moe_np1|test_gpu_moe_layer_np1' timeout 40 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -12
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
echo "== dispatch, every preset at its default tokens, W 1 at $(el) s"
for v in 2 0; do
  MK_MOE_LOCAL_DISPATCH=$v timeout 25 $B/mkernel bench moe_dispatch --reps 20 2>&1 | grep -E "^(preset|deepep|qwen3|mixtral) " | sed "s/^/direct $v  /"
done
nvidia-cuda-mps-control -d
echo "== uneven ring W 2 (MPS 50 %) at $(el) s"
rb() { CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 25 mpirun -np 2 $B/mkernel bench ring_attention --reps 10 --warmup 2 "$@" 2>&1 | grep -E "uneven /|check:" | head -2; }
echo "rows 3500,4692:"; rb --rows 3500,4692
echo "rows 3500,4692 MK_WAIT_BACKOFF_NS=1000:"; MK_WAIT_BACKOFF_NS=1000 rb --rows 3500,4692
mx() {  # name-regex seed tag
  MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/$3 MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY="$1" MK_TEST_SEED=$2 timeout 30 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/$3 /"
}
echo "== ring backward at $(el) s"
mx '^1x1-static' 317528730 a1; mx '^6x1-tcp' 317528730 t1; keep
grep -rh "did not\|: epoch\|ready\|dkv_arrived\|^rank [0-9]* call" $L/a* $L/t* 2>/dev/null | head -30
echo "done at $(el) s"
