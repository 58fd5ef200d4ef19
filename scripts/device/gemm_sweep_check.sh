#!/usr/bin/env bash
# The GEMM on the GPU machine from carried binaries (.devbin; scripts/device/pack_binaries.sh):
# test_gpu_gemm (exact, against cuBLAS, split-K), then bench_gemm on issue #19's shapes and the
# --sweep (M 64..8192 x Llama-3-8B/70B TP8 projections). JSON and logs: $OUT/gemm_sweep_logs.tgz,
# the JSON also as $OUT/gemm_issue.json and $OUT/gemm_sweep.json.
#   MK_GEMM_STEPS  "setup test issue sweep" (default: all)
#   MK_GEMM_REPS   timed repetitions per variant and shape (default 20)
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-gemm-sweep
rm -rf "$L" && mkdir -p "$L" "$RESULT"
trap 'tar -C "$L" -czf "$RESULT/gemm_sweep_logs.tgz" . 2>/dev/null' EXIT
steps=${MK_GEMM_STEPS:-"setup test issue sweep"}
has() { [[ " $steps " == *" $1 "* ]]; }
B=/tmp/mkb
reps=${MK_GEMM_REPS:-20}
if has setup; then MK_SUITE_STEPS=setup bash scripts/device/suite.sh 2>&1 | tail -1; fi
if has test; then
  "$B/tests/gpu/test_gpu_gemm" > "$L/test_gpu_gemm.log" 2>&1
  echo "test_gpu_gemm rc=$?"
  grep -E "^\[  (PASSED|FAILED)|^\[       OK|FAILED|Failure|relative error" "$L/test_gpu_gemm.log" | head -30
fi
if has issue; then
  "$B/bench/bench_gemm" --reps "$reps" --json "$L/gemm_issue.json" 128 8192 8192 256 1024 8192 1024 3584 8192 \
    512 8192 8192 2048 8192 3584 4096 28672 8192 > "$L/bench_issue.log" 2>&1
  echo "bench_gemm (issue shapes) rc=$?"; cat "$L/bench_issue.log"; cp "$L/gemm_issue.json" "$RESULT/"
fi
if has sweep; then
  "$B/bench/bench_gemm" --sweep --reps "$reps" --json "$L/gemm_sweep.json" > "$L/bench_sweep.log" 2>&1
  echo "bench_gemm --sweep rc=$?"; cat "$L/bench_sweep.log"; cp "$L/gemm_sweep.json" "$RESULT/"
fi
exit 0
