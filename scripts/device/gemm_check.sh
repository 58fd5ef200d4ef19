#!/usr/bin/env bash
# GEMM-only call on the GPU machine: build the GEMM test and benchmark, check the machine code,
# run the tests and the benchmark against cuBLAS. Logs come back as $OUT/gemm_logs.tgz.
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
OUT=/tmp/mk-gemm
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULT"
trap 'tar -C "$OUT" -czf "$RESULT/gemm_logs.tgz" .' EXIT
source .devcarry/env.sh
source .devcarry/extra-env.sh
cmake -S . -B build -G Ninja > "$OUT/cmake.log" 2>&1 && ninja -C build -j16 test_gpu_gemm test_gpu_gemm_peer bench_gemm test_gpu_threads > "$OUT/build.log" 2>&1
echo "build rc=$?"; grep -E "error" "$OUT/build.log" | head
cuobjdump -sass build/CMakeFiles/mkernel.dir/src/gemm/sm90_gemm_bf16.cu.o 2>/dev/null | grep -cE "HGMMA" | sed 's/^/HGMMA instructions: /'
MK_TRACE_OUT="$OUT/gemm_trace.json" build/tests/gpu/test_gpu_gemm > "$OUT/test_gpu_gemm.log" 2>&1; echo "test_gpu_gemm rc=$?"; grep -E "OK|FAILED|relative|Failure|gemm" "$OUT/test_gpu_gemm.log" | head -20
python3 tools/trace_png.py "$OUT/gemm_trace.json" "$RESULT/gemm_trace.png" && echo "trace PNG written"
CUDA_DEVICE_MAX_CONNECTIONS=32 build/tests/gpu/test_gpu_threads > "$OUT/test_gpu_threads.log" 2>&1; echo "test_gpu_threads rc=$?"; grep -E "OK|FAILED" "$OUT/test_gpu_threads.log"
# The epilogues into other ranks' memory: processes under MPS.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-cuda-mps-control -d && CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 ctest --test-dir build -V -R test_gpu_gemm_peer > "$OUT/test_gpu_gemm_peer.log" 2>&1
echo "test_gpu_gemm_peer rc=$?"; grep -E "Test +#|OK \]|FAILED|Failure|rank [0-9]" "$OUT/test_gpu_gemm_peer.log" | head -20
echo quit | nvidia-cuda-mps-control
build/bench/bench_gemm --json "$OUT/bench_gemm.json" ${MK_GEMM_ARGS:-} > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"; cat "$OUT/bench_gemm.log"
