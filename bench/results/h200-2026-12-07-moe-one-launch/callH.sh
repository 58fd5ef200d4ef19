#!/usr/bin/env bash
# Call H (written 2026-12-07, for the next session, after callG.sh): the full configuration matrix
# (every layout, provider, staging mode; static then auto split), its logs kept in $OUT/mx.tgz.
# Call F ran it to its 430 s timeout (45 launches); the whole takes longer: static first.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=/tmp/mkb
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
MK_BUILD_DIR=$B MK_MATRIX_LOGS=/tmp/mx MK_MATRIX_SPLIT="${SPLIT:-static auto}" timeout 560 bash scripts/device/matrix_check.sh 2>&1 \
  | grep -E "^(FAIL|matrix)|^      " | head -40
tar czf $OUT/mx.tgz -C /tmp/mx . 2>/dev/null
