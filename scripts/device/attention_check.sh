#!/usr/bin/env bash
# Attention call on the GPU machine: build the library and the C ABI, the kernel's accuracy
# test against an fp32 reference and torch SDPA, the benchmark against SDPA (flash), and (when
# built) the ring operator's tests and benchmark under MPS.
# The backward: its test against float64 and SDPA's backward (bwdtest) and its benchmark against
# SDPA's backward (bwdbench; MK_ATTN_BWD_ARGS, e.g. --seqs 1024,4096,8192 --ds 64,128).
# Packed variable-length sequences: their test against float64 (varlentest) and the benchmark
# against the dense kernel at equal tokens (varlenbench; MK_ATTN_VARLEN_ARGS).
# MK_ATTN_STEPS limits the steps: build sass test bench bwdtest bwdbench varlentest varlenbench ring ringbench. Logs, traces and timeline
# PNGs: $OUT/attn_logs.tgz. MK_ATTN_BENCH_ARGS goes to bench_attention.py (e.g. --reps 30 --seqs 4096).
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
OUT=/tmp/mk-attn
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULT"
trap 'tar -C "$OUT" --exclude="*.sass" -czf "$RESULT/attn_logs.tgz" .' EXIT
steps=${MK_ATTN_STEPS:-"build sass test bench bwdtest bwdbench varlentest varlenbench ring ringbench"}
has() { [[ " $steps " == *" $1 "* ]]; }
source .devcarry/env.sh
source .devcarry/extra-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
t0=$(date +%s)
if has build; then
  cmake -S . -B build -G Ninja > "$OUT/cmake.log" 2>&1 && ninja -C build -j16 -k 0 ${MK_ATTN_TARGETS:-} > "$OUT/build.log" 2>&1
  echo "build rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "error|FAILED" "$OUT/build.log" | head -20
fi
if has sass && command -v cuobjdump >/dev/null; then
  # Local-memory traffic (spills) and tensor-core instructions per attention kernel variant.
  for o in build/CMakeFiles/mk_kernels.dir/src/attention/sm90_fmha_d*.cu.o build/CMakeFiles/mk_kernels.dir/src/attention/sm90_fmha_bwd_d*.cu.o; do
    [[ -f $o ]] || continue
    cuobjdump -sass "$o" > "$OUT/$(basename "$o").sass" 2>/dev/null
    awk '/Function :/ {f=$3} /HGMMA/ {g[f]++} /STL/ {st[f]++} /LDL/ {ld[f]++} END {for (k in g) printf "sass %s HGMMA %d STL %d LDL %d\n", k, g[k], st[k], ld[k]}' "$OUT/$(basename "$o").sass"
  done
fi
if has test; then
  timeout 60 python3 tests/gpu/test_attention.py --quick > "$OUT/test_attention_quick.log" 2>&1
  rc=$?; echo "test_attention --quick rc=$rc"; cat "$OUT/test_attention_quick.log" | tail -5
  if [[ $rc != 0 ]]; then
    # Fall back to the plain variant (128-row key tiles, no turn taking) for the later steps.
    echo "quick test failed: the later steps run MK_ATTENTION_BLOCK_N=128 MK_ATTENTION_TURNS=0"
    export MK_ATTENTION_BLOCK_N=128 MK_ATTENTION_TURNS=0
  fi
  timeout 240 python3 tests/gpu/test_attention.py > "$OUT/test_attention.log" 2>&1
  echo "test_attention rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "FAIL|cases|Error|error" "$OUT/test_attention.log" | head -30
  cp "$OUT/test_attention.log" "$RESULT/"
fi
if has bench; then
  timeout 200 python3 bench/bench_attention.py --json "$RESULT/bench_attention.json" ${MK_ATTN_BENCH_ARGS:-} > "$OUT/bench_attention.log" 2>&1
  echo "bench_attention rc=$? ($(( $(date +%s) - t0 )) s)"; cat "$OUT/bench_attention.log" | tail -40
fi
if has bwdtest; then
  timeout 200 python3 tests/gpu/test_attention_bwd.py > "$OUT/test_attention_bwd.log" 2>&1
  echo "test_attention_bwd rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "FAIL|cases|Error|error" "$OUT/test_attention_bwd.log" | head -30
  cp "$OUT/test_attention_bwd.log" "$RESULT/"
fi
if has bwdbench; then
  timeout 240 python3 bench/bench_attention_bwd.py --json "$RESULT/bench_attention_bwd.json" ${MK_ATTN_BWD_ARGS:-} \
    > "$OUT/bench_attention_bwd.log" 2>&1
  echo "bench_attention_bwd rc=$? ($(( $(date +%s) - t0 )) s)"; tail -30 "$OUT/bench_attention_bwd.log"
fi
if has varlentest; then
  timeout 300 python3 tests/gpu/test_attention_varlen.py > "$OUT/test_attention_varlen.log" 2>&1
  echo "test_attention_varlen rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "FAIL|cases|Error|error" "$OUT/test_attention_varlen.log" | head -30
  cp "$OUT/test_attention_varlen.log" "$RESULT/"
fi
if has varlenbench; then
  timeout 240 python3 bench/bench_attention_varlen.py --json "$RESULT/bench_attention_varlen.json" ${MK_ATTN_VARLEN_ARGS:-} \
    > "$OUT/bench_attention_varlen.log" 2>&1
  echo "bench_attention_varlen rc=$? ($(( $(date +%s) - t0 )) s)"; tail -30 "$OUT/bench_attention_varlen.log"
fi
# Deadline (s since the start): a ring step starts only if its usual length fits before it, so
# the logs are packed before the device call's limit.
deadline=${MK_DEADLINE_S:-540}
fits() { (( $(date +%s) - t0 + $1 < deadline )) || { echo "skipped $2: past the deadline"; return 1; }; }
ring_test() {  # ring_test CONFIG EXPECTED_S
  local t=$1 pct=25
  [[ $t == np1 ]] && pct=100; [[ $t == np2 ]] && pct=50
  [[ -n $(ctest --test-dir build -N -R "^test_gpu_ring_attention_${t}\$" | grep "Test #") ]] || return 0
  fits "$2" "test_gpu_ring_attention_$t" || return 0
  MK_TRACE_OUT=$OUT/trace_$t CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout ${MK_RING_TIMEOUT:-200} ctest --test-dir build -V -R "^test_gpu_ring_attention_${t}\$" > "$OUT/ring_$t.log" 2>&1
  echo "test_gpu_ring_attention_$t rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "\[  (PASSED|FAILED) |FAILED  \]|\[       OK \]|Failure|Expected|Which is|wrong|timed out|error|trace ring" "$OUT/ring_$t.log" | sed 's/^[0-9]*: //' | head -16
  for j in "$OUT"/trace_$t.*.0.json; do [[ -f $j ]] && python3 tools/trace_png.py "$j" "${j%.json}.png" >/dev/null 2>&1; done
  rm -f "$OUT"/trace_$t.*.[1-9].json
}
ring_bench() {  # ring_bench NP EXPECTED_S
  local np=$1 pct=$(( 100 / $1 ))
  fits "$2" "bench ring_attention np$np" || return 0
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 200 mpirun --allow-run-as-root -np $np --bind-to none build/mkernel bench ring_attention ${MK_RING_BENCH_ARGS:-} --trace "$OUT/ringtrace" --json "$RESULT/ring_np$np.json" > "$OUT/ringbench_np$np.log" 2>&1
  echo "bench ring_attention np$np rc=$? ($(( $(date +%s) - t0 )) s)"; grep -vE "^vm:" "$OUT/ringbench_np$np.log" | tail -8
  for j in "$OUT"/ringtrace.*.w$np.rank0.json; do [[ -f $j ]] && python3 tools/trace_png.py "$j" "${j%.json}.png" >/dev/null 2>&1; done
  rm -f "$OUT"/ringtrace.*.w$np.rank[1-9].json
}
nvidia-cuda-mps-control -d
# MK_RING_STEPS: the ring steps in order (test:CONFIG:SECONDS or bench:NP:SECONDS).
for step in ${MK_RING_STEPS:-test:np1:10 test:np2:20 test:np4:40 bench:2:60 bench:4:80 test:2nodes_shm_np4:150 test:2nodes_tcp_np4:160}; do
  IFS=: read -r kind arg secs <<< "$step"
  if [[ $kind == test ]] && has ring; then ring_test "$arg" "$secs"; fi
  if [[ $kind == bench ]] && has ringbench; then ring_bench "$arg" "$secs"; fi
done
echo quit | nvidia-cuda-mps-control
echo "total $(( $(date +%s) - t0 )) s"
