#!/usr/bin/env bash
# Ring attention's own loop on the GPU machine, inside one device call: build the library, the
# ring test and the CLI; run the ring tests at W = 1, 2, 4 on one node, the ring benchmark at
# W = 2 with a traced call (timeline PNG), then the 2 emulated nodes x 2 tests over shm and tcp
# side by side (each rank at 12 % of the SMs, so the two jobs fit the GPU together). Every step
# gets a hard time limit under MK_DEADLINE_S (default 330 s), so the logs are always packed.
# Results: $OUT/ring_logs.tgz (logs, PNGs), $OUT/ring_np2.json.
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
OUT=/tmp/mk-ring
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULT"
source .devcarry/env.sh
source .devcarry/extra-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
t0=$(date +%s)
deadline=${MK_DEADLINE_S:-330}
pack() { tar -C "$OUT" --exclude="*.json" -czf "$RESULT/ring_logs.tgz" .; }
left() { echo $(( deadline - ($(date +%s) - t0) )); }
limit() { local l; l=$(left); (( l > $1 )) && echo "$1" || echo $(( l > 5 ? l : 5 )); }
cmake -S . -B build -G Ninja > "$OUT/cmake.log" 2>&1 &&
  timeout "$(limit 150)" ninja -C build -j16 mkernel mkernel_cli test_gpu_ring_attention > "$OUT/build.log" 2>&1
echo "build rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "error|FAILED" "$OUT/build.log" | head -20
nvidia-cuda-mps-control -d
ring_test() {  # ring_test CONFIG PCT SECONDS
  local t=$1
  MK_TRACE_OUT=$OUT/trace_$t CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$2 timeout "$(limit "$3")" \
    ctest --test-dir build -V -R "^test_gpu_ring_attention_${t}\$" > "$OUT/ring_$t.log" 2>&1
  echo "test_gpu_ring_attention_$t rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "\[  (PASSED|FAILED) |FAILED  \]|\[       OK \]|Failure|Expected|Which is|wrong|timed out|error|trace ring" \
    "$OUT/ring_$t.log" | sed 's/^[0-9]*: //' | head -16
}
ring_test np1 100 30
ring_test np2 50 40
ring_test np4 25 60
pack
timeout "$(limit 60)" mpirun --allow-run-as-root -np 2 --bind-to none -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 \
  build/mkernel bench ring_attention --seq 4096 --seq 8192 --trace "$OUT/ringtrace" --json "$RESULT/ring_np2.json" \
  > "$OUT/ringbench_np2.log" 2>&1
echo "bench ring_attention np2 rc=$? ($(( $(date +%s) - t0 )) s)"; grep -vE "^vm:" "$OUT/ringbench_np2.log" | tail -6
for j in "$OUT"/ringtrace.s*.w2.rank0.json; do
  [[ -f $j ]] && timeout 30 python3 tools/trace_png.py "$j" "${j%.json}.png" > /dev/null 2>&1
done
pack
# The two emulated-node jobs side by side.
ring_test 2nodes_shm_np4 12 170 &
ring_test 2nodes_tcp_np4 12 170 &
wait
for j in "$OUT"/trace_*.ring_zigzag_causal.0.json; do
  [[ -f $j ]] && timeout 20 python3 tools/trace_png.py "$j" "${j%.json}.png" > /dev/null 2>&1
done
echo quit | nvidia-cuda-mps-control
pack
echo "total $(( $(date +%s) - t0 )) s"
