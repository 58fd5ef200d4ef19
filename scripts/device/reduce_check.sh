#!/usr/bin/env bash
# The reduction path on the GPU machine (one call): the fused GPU tests, then `mkernel bench`
# with W ranks sharing the GPU under MPS, the route modes side by side in the same run
# (MK_FUSED_ROUTE=red: a system-scope reduce-add per register pair; bulk: TMA boxes), with one
# traced call per shape (rank 0's breakdown is printed), then the Llama-3-70B TP8 sweep.
# Binaries: .devbin (scripts/device/pack_binaries.sh), unpacked by suite.sh's setup into /tmp/mkb.
#   MK_REDUCE_STEPS   steps, in order (default "setup tests ab sweep png")
#   MK_REDUCE_ROUTES  routes of the A/B step (default "red bulk")
#   MK_REDUCE_NPS     world sizes (default "2 4")
# Results: $OUT/reduce_logs.tgz (logs, bench JSON rows, traces).
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-reduce
rm -rf "$L" && mkdir -p "$L" "$RESULT"
trap 'tar -C "$L" -czf "$RESULT/reduce_logs.tgz" . 2>/dev/null' EXIT
steps=${MK_REDUCE_STEPS:-"setup tests ab sweep png"}
has() { [[ " $steps " == *" $1 "* ]]; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=/tmp/mkb
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
if has setup; then
  MK_SUITE_STEPS=setup bash scripts/device/suite.sh 2>&1 | grep -E "setup|gpu:"
fi
nvidia-cuda-mps-control -d 2>/dev/null
bench() {  # np route tag args...
  local np=$1 route=$2 tag=$3
  shift 3
  MK_FUSED_ROUTE=$route CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 240 \
    mpirun --allow-run-as-root -np "$np" --bind-to none "$B/mkernel" bench "$@" --reps ${MK_REDUCE_REPS:-30} \
    --json "$L/$tag.json" > "$L/$tag.log" 2>&1
  echo "== $tag (np $np, route $route) rc=$? ($(elapsed) s)"
  grep -vE "^vm:|^route " "$L/$tag.log" | grep -E "^(ag_gemm|gemm_rs|gemm_ar) |trace rank|WRONG|error|check: .*(FAIL|WRONG)" | head -40
}
if has tests; then
  for t in ${MK_REDUCE_TESTS:-test_gpu_gemm test_gpu_fused_gemm_np1 test_gpu_fused_gemm_np2 test_gpu_fused_gemm_np4 test_gpu_fused_gemm_2nodes_shm_np4}; do
    np=$(sed -n 's/.*_np\([0-9]*\)$/\1/p' <<<"$t"); np=${np:-1}
    s=$(date +%s)
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 200 ctest --test-dir "$B" -R "^${t}\$" \
      --output-on-failure > "$L/$t.log" 2>&1
    echo "$t rc=$? ($(( $(date +%s) - s )) s)"
    grep -E "tests passed|FAILED|Failure|Expected|Which is|timed out" "$L/$t.log" | head -8
  done
fi
if has ab; then
  for np in ${MK_REDUCE_NPS:-2 4}; do
    for route in ${MK_REDUCE_ROUTES:-red bulk}; do
      for kind in gemm_rs gemm_ar; do
        bench "$np" "$route" "ab_np${np}_${route}_$kind" $kind --m 8192 --n 3584 --k 4096 --trace "$L/tr_np${np}_${route}"
      done
    done
    bench "$np" bulk "ab_np${np}_ag" ag_gemm --m 8192 --n 3584 --k 4096 --trace "$L/tr_np${np}_ag"
    bench "$np" bulk "ab_np${np}_det" gemm_rs --m 8192 --n 3584 --k 4096 --deterministic
    bench "$np" bulk "ab_np${np}_det_ar" gemm_ar --m 8192 --n 3584 --k 4096 --deterministic
    [[ $np == 2 ]] && bench "$np" bulk "ab_np${np}_big" all --m 16384 --n 8192 --k 2048
  done
fi
if has sweep; then
  for np in ${MK_REDUCE_NPS:-2 4}; do
    bench "$np" bulk "sweep_np$np" all --sweep
  done
  bench 1 bulk "sweep_np1" all --sweep
  python3 tools/sweep_report.py --md "$RESULT/sweep.md" --png "$RESULT/sweep.png" "$L"/sweep_np*.json &&
    cp "$L"/sweep_np*.json "$RESULT/" && cat "$RESULT/sweep.md"
fi
if has png; then  # timelines of rank 0's traced calls
  for j in "$L"/tr_np2_bulk.gemm_rs.*.rank0.json "$L"/tr_np2_bulk.gemm_ar.*.rank0.json "$L"/tr_np2_ag.*.rank0.json; do
    [[ -f $j ]] && python3 tools/trace_png.py "$j" "$RESULT/$(basename "${j%.json}").png" && echo "timeline: $(basename "${j%.json}").png"
  done
fi
echo quit | nvidia-cuda-mps-control
echo "total $(elapsed) s"
