#!/usr/bin/env bash
# Fused-operator call on the GPU machine: build, the GEMM tests (arrival-ordered scheduler
# included), the fused operators at W = 1, 2, 4 and 2 emulated nodes x 2 (shm, tcp) under MPS,
# the silent-rank test, and (when built) `mkernel bench` on the default sweep.
# Logs come back as $OUT/fused_logs.tgz; MK_FUSED_STEPS limits the steps (e.g. "build fused").
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
OUT=/tmp/mk-fused
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULT"
trap 'tar -C "$OUT" -czf "$RESULT/fused_logs.tgz" .' EXIT
steps=${MK_FUSED_STEPS:-"build gemm gemmbench fused dead bench runsh"}
has() { [[ " $steps " == *" $1 "* ]]; }
source .devcarry/env.sh
source .devcarry/extra-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
t0=$(date +%s)
cmake -S . -B build -G Ninja > "$OUT/cmake.log" 2>&1 && ninja -C build -j16 -k 0 ${MK_FUSED_TARGETS:-} > "$OUT/build.log" 2>&1
echo "build rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "error|NCCL|nccl" "$OUT/build.log" "$OUT/cmake.log" | head
if has gemm; then
  timeout 300 build/tests/gpu/test_gpu_gemm > "$OUT/test_gpu_gemm.log" 2>&1; echo "test_gpu_gemm rc=$?"
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]|Failure" "$OUT/test_gpu_gemm.log" | head -20
fi
if has gemmbench; then
  build/bench/bench_gemm --json "$RESULT/bench_gemm.json" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"; cat "$OUT/bench_gemm.log"
fi
nvidia-cuda-mps-control -d
if has fused; then
  for t in np1 np2 np4 2nodes_shm_np4 2nodes_tcp_np4; do
    pct=25; [[ $t == np1 ]] && pct=100; [[ $t == np2 ]] && pct=50
    MK_TRACE_OUT="$OUT/trace_$t" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 280 ctest --test-dir build -V -R "^test_gpu_fused_gemm_${t}\$" > "$OUT/fused_$t.log" 2>&1
    echo "test_gpu_fused_gemm_$t rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "\[  (PASSED|FAILED) |FAILED  \]|Failure|Expected|Which is|wrong|timed out|error" "$OUT/fused_$t.log" | head -12
  done
fi
if has fused; then  # timelines of the traced fused calls (rank 0): PNGs come back
  for j in "$OUT"/trace_np4.*.0.json "$OUT"/trace_2nodes_tcp_np4.*.0.json; do
    [[ -f $j ]] && python3 tools/trace_png.py "$j" "$RESULT/$(basename "${j%.json}").png" && echo "timeline: $(basename "${j%.json}").png"
  done
fi
if has dead; then
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 ctest --test-dir build -V -R "^test_gpu_fused_gemm_dead_np2\$" > "$OUT/fused_dead.log" 2>&1
  echo "test_gpu_fused_gemm_dead rc=$?"; grep -E "rank [0-9]: |\[  (PASSED|FAILED) " "$OUT/fused_dead.log" | head -6
fi
if has bench && [[ -x build/mkernel ]] && build/mkernel help 2>/dev/null | grep -q bench; then
  for np in ${MK_BENCH_NPS:-1 2 4}; do
    pct=$(( 100 / np ))
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 200 mpirun --allow-run-as-root -np $np --bind-to none build/mkernel bench all --json "$RESULT/bench_np$np.json" > "$OUT/bench_np$np.log" 2>&1
    echo "bench np$np rc=$?"; grep -vE "^vm:" "$OUT/bench_np$np.log" | tail -12
  done
fi
echo quit | nvidia-cuda-mps-control
if has runsh; then
  MK_SKIP_INSTALL=1 timeout 300 bash scripts/run.sh > "$OUT/run.log" 2>&1
  echo "scripts/run.sh rc=$?"; grep -E "selfcheck:|== |^(ag_gemm|gemm_rs|gemm_ar) |FAILED" "$OUT/run.log" | head -16
fi
echo "total $(( $(date +%s) - t0 )) s"
