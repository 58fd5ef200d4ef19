#!/usr/bin/env bash
# Call I (written 2026-12-07; run the next session on an H100: ../h100-2026-12-07-backoff/results.md). W = 1 dispatch
# with rows copied straight to the experts' rows past the small-batch bound too (route, scan,
# local_scatter): the MoE units at np 1 first, then every preset at its default tokens both ways
# (MK_MOE_LOCAL_DISPATCH 2: the scatter; 0: records); the uneven ring (W 2) with poll backoff,
# nearly even and mirrored rows; the MoE layer at W = 1 both ways; the matrix ring backward after
# call H (the 1x1 zero-dK test fix; the tiny-case timeout of 6x1-tcp_rxm-always, seed 317528730,
# and 8x1-udp_rxd-always, now printing each rank's progress).
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/i; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
keep() { tar czf $OUT/i.tgz -C $L . 2>/dev/null; }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
echo "== MoE units np 1 at $(el) s"
MK_SUITE_STEPS="unit" MK_UNIT_ONLY='test_gpu_moe_np1|test_gpu_moe_layer_np1' timeout 60 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -12
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
echo "== dispatch, every preset at its default tokens, W 1 at $(el) s"
for rep in 1 2; do for v in 2 0; do
  MK_MOE_LOCAL_DISPATCH=$v timeout 40 $B/mkernel bench moe_dispatch --reps 30 2>&1 | grep -E "^(preset|deepep|qwen3|mixtral) " | sed "s/^/direct $v  /"
done; done
keep
nvidia-cuda-mps-control -d
echo "== uneven ring W 2 (MPS 50 %) at $(el) s"
rb() { CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 40 mpirun -np 2 $B/mkernel bench ring_attention --reps 10 --warmup 2 "$@" 2>&1 | grep -E "uneven /|check:" | head -2; }
echo "rows 3500,4692:"; rb --rows 3500,4692
echo "rows 3500,4692 MK_WAIT_BACKOFF_NS=1000:"; MK_WAIT_BACKOFF_NS=1000 rb --rows 3500,4692
echo "rows 4690,4694:"; rb --rows 4690,4694
echo "rows 4692,3500:"; rb --rows 4692,3500
echo "== moe_layer W 1 (MPS daemon up, one process) at $(el) s"
for v in 2 0; do
  MK_MOE_LOCAL_DISPATCH=$v timeout 90 $B/mkernel bench moe_layer --preset qwen3_30b --reps 20 2>&1 | grep -E "qwen3|layer" | head -5 | sed "s/^/direct $v  /"
done
mx() {  # name-regex seed tag
  MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/$3 MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY="$1" MK_TEST_SEED=$2 timeout 60 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/$3 /"
}
echo "== ring backward at $(el) s"
mx '^1x1-' 317528730 a1
for i in 1 2; do mx '^6x1-tcp' 317528730 t$i; done; keep
mx '^6x1-tcp' $RANDOM$RANDOM t3; mx '^8x1-udp' $RANDOM$RANDOM u1; keep
grep -rh "did not\|: epoch\|ready\|dkv_arrived\|^rank [0-9]* call" $L/a* $L/t* $L/u* 2>/dev/null | head -40
keep
echo "done at $(el) s"
