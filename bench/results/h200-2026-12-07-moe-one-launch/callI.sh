#!/usr/bin/env bash
# Call I (2026-12-07): the matrix ring backward after call H — the 1x1 zero-dK check (a test
# error: dK is zero where every row seeing the keys sees one key) and the tiny-case timeout of
# 6x1-tcp_rxm-always (seed 317528730) and 8x1-udp_rxd-always, now with each rank's progress
# (CTAs finished, next op, ready/dkv_arrived flags) printed on failure; then the MoE layer at
# 128 tokens (W = 1, the one-launch dispatch) and the matrix's auto launches call H did not reach.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/i; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
keep() { tar czf $OUT/i.tgz -C $L . 2>/dev/null; }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
mx() {  # name-regex seed tag
  MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/$3 MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY="$1" MK_TEST_SEED=$2 timeout 60 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)" | sed "s/^/$3 /"
}
echo "== ring backward at $(el) s"
mx '^1x1-' 317528730 a1; mx '^1x1-' $RANDOM$RANDOM a2
for i in 1 2 3; do mx '^6x1-tcp' 317528730 t$i; done; keep
for i in 4 5; do mx '^6x1-tcp' $RANDOM$RANDOM t$i; done; keep
for i in 1 2; do mx '^8x1-udp' $RANDOM$RANDOM u$i; done; keep
grep -h "did not\|: epoch\|^  *ready\|dkv_arrived\|^rank [0-9]* call" -r $L | head -60
echo "== moe_layer 128 tokens W 1 at $(el) s"
for v in 1 0; do
  MK_MOE_LOCAL_DISPATCH=$v timeout 60 $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 30 2>&1 | grep -E "qwen3|layer_us|tokens" | head -4 | sed "s/^/one_launch $v  /"
done
echo "== matrix auto launches from 4x1-udp on at $(el) s"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/mxauto MK_MATRIX_SPLIT=auto MK_MATRIX_ONLY='^(4x1-udp|4x2|5x1|6x1|8x1)' timeout 200 \
  bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(FAIL|PASS|matrix)|^      " | head -30
keep
echo "done at $(el) s"
