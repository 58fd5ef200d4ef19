#!/usr/bin/env bash
# Attention call on the GPU machine: build the library and the C ABI, the kernel's accuracy
# test against an fp32 reference and torch SDPA, the benchmark against SDPA (flash), and (when
# built) the ring operator's tests and benchmark under MPS.
# MK_ATTN_STEPS limits the steps: build test bench ring ringbench. Logs: $OUT/attn_logs.tgz.
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
OUT=/tmp/mk-attn
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULT"
trap 'tar -C "$OUT" -czf "$RESULT/attn_logs.tgz" .' EXIT
steps=${MK_ATTN_STEPS:-"build test bench ring ringbench"}
has() { [[ " $steps " == *" $1 "* ]]; }
source .devcarry/env.sh
source .devcarry/extra-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
t0=$(date +%s)
if has build; then
  cmake -S . -B build -G Ninja > "$OUT/cmake.log" 2>&1 && ninja -C build -j16 -k 0 ${MK_ATTN_TARGETS:-} > "$OUT/build.log" 2>&1
  echo "build rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "error|FAILED" "$OUT/build.log" | head -20
fi
if has test; then
  timeout 60 python3 tests/gpu/test_attention.py --quick > "$OUT/test_attention_quick.log" 2>&1
  rc=$?; echo "test_attention --quick rc=$rc"; cat "$OUT/test_attention_quick.log" | tail -5
  [[ $rc == 0 ]] || { echo "quick test failed: stopping"; exit 1; }
  timeout 240 python3 tests/gpu/test_attention.py > "$OUT/test_attention.log" 2>&1
  echo "test_attention rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "FAIL|cases|Error|error" "$OUT/test_attention.log" | head -30
  cp "$OUT/test_attention.log" "$RESULT/"
fi
if has bench; then
  timeout 200 python3 bench/bench_attention.py --json "$RESULT/bench_attention.json" ${MK_ATTN_BENCH_ARGS:-} > "$OUT/bench_attention.log" 2>&1
  echo "bench_attention rc=$? ($(( $(date +%s) - t0 )) s)"; cat "$OUT/bench_attention.log" | tail -12
fi
nvidia-cuda-mps-control -d
if has ring; then
  for t in np1 np2 np4 2nodes_shm_np4 2nodes_tcp_np4; do
    pct=25; [[ $t == np1 ]] && pct=100; [[ $t == np2 ]] && pct=50
    [[ -n $(ctest --test-dir build -N -R "^test_gpu_ring_${t}\$" | grep "Test #") ]] || continue
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout ${MK_RING_TIMEOUT:-150} ctest --test-dir build -V -R "^test_gpu_ring_${t}\$" > "$OUT/ring_$t.log" 2>&1
    echo "test_gpu_ring_$t rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "\[  (PASSED|FAILED) |FAILED  \]|Failure|Expected|Which is|wrong|timed out|error" "$OUT/ring_$t.log" | head -12
  done
fi
if has ringbench && [[ -x build/mkernel ]] && build/mkernel help 2>/dev/null | grep -q ring_attention; then
  for np in ${MK_BENCH_NPS:-1 2 4}; do
    pct=$(( 100 / np ))
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 200 mpirun --allow-run-as-root -np $np --bind-to none build/mkernel bench ring_attention ${MK_RING_BENCH_ARGS:-} --json "$RESULT/ring_np$np.json" > "$OUT/ringbench_np$np.log" 2>&1
    echo "bench ring_attention np$np rc=$?"; grep -vE "^vm:" "$OUT/ringbench_np$np.log" | tail -12
  done
fi
echo quit | nvidia-cuda-mps-control
echo "total $(( $(date +%s) - t0 )) s"
