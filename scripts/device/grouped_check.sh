#!/usr/bin/env bash
# The grouped GEMM on the GPU machine from carried binaries (.devbin; scripts/device/pack_binaries.sh):
# test_gpu_grouped (exact, SwiGLU, cuBLAS fp32 reference, graph replays, bad ranges), then
# bench_grouped (MoE expert GEMMs at EP8 against cuBLAS grouped and dense). Logs:
# $OUT/grouped_logs.tgz; the JSON also as $OUT/grouped.json.
#   MK_GROUPED_STEPS  "setup test bench" (default: all)
#   MK_GROUPED_REPS   timed repetitions per variant and shape (default 20)
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-grouped
rm -rf "$L" && mkdir -p "$L" "$RESULT"
trap 'tar -C "$L" -czf "$RESULT/grouped_logs.tgz" . 2>/dev/null' EXIT
steps=${MK_GROUPED_STEPS:-"setup test bench"}
has() { [[ " $steps " == *" $1 "* ]]; }
B=/tmp/mkb
reps=${MK_GROUPED_REPS:-20}
if has setup; then MK_SUITE_STEPS=setup bash scripts/device/suite.sh 2>&1 | tail -1; fi
if has test; then
  timeout 300 "$B/tests/gpu/test_gpu_grouped" > "$L/test_gpu_grouped.log" 2>&1
  echo "test_gpu_grouped rc=$?"
  grep -E "^\[  (PASSED|FAILED)|^\[       OK|FAILED|Failure|want|Expected|Which|error" "$L/test_gpu_grouped.log" | head -40
fi
if has bench; then
  timeout 300 "$B/bench/bench_grouped" --reps "$reps" --json "$L/grouped.json" > "$L/bench_grouped.log" 2>&1
  echo "bench_grouped rc=$?"; cat "$L/bench_grouped.log"; cp "$L/grouped.json" "$RESULT/" 2>/dev/null
fi
exit 0
