#!/usr/bin/env bash
# The SM-partition controller's calibration data on the one-GPU machine (issue 32 item 1, issue 40
# item 1), from carried binaries (.devbin), in one call:
#   setup   binaries (suite.sh's setup)
#   threads ranks as threads of one process (no MPS): bench_fused_threads W OP M N K R --splits
#           --trace, for W in MK_CAL_NPS (default "2 4"), every fused operator and MK_CAL_SHAPES
#           (default "8192,3584,4096 16384,8192,2048"): every static split {1..32} and the
#           controller, median of R (MK_CAL_REPS, 20) untraced calls, then 3 traced calls per
#           split; tools/split_calibration.py reduces the tables to $OUT/calibration_threads.json
#   mps     the same splits with ranks as processes under MPS at 100/W % (`mkernel bench all
#           --splits`, untraced), JSON $OUT/splits_mps_w<W>.json, to set beside the threads
#   MK_CAL_STEPS  default "setup threads mps"
# The tables of the first shape come back as $OUT/calibration_tables.tar.xz; logs in
# $OUT/calibration_logs.tgz.
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-cal
rm -rf "$L" && mkdir -p "$L" "$RESULT"
steps=${MK_CAL_STEPS:-"setup threads mps"}
has() { [[ " $steps " == *" $1 "* ]]; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=/tmp/mkb
nps=${MK_CAL_NPS:-"2 4"}
shapes=${MK_CAL_SHAPES:-"8192,3584,4096 16384,8192,2048"}
reps=${MK_CAL_REPS:-20}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
started=0
finish() {
  [[ $started == 1 ]] && echo quit | nvidia-cuda-mps-control
  tar -C "$L" --exclude='*.tsv' -czf "$RESULT/calibration_logs.tgz" . 2>/dev/null
  first=${shapes%% *}
  IFS=, read -r m n k <<< "$first"
  (cd "$L" && ls ./*".m$m.n$n.k$k."*.tsv >/dev/null 2>&1 &&
    tar -cf - ./*".m$m.n$n.k$k."*.tsv | xz -T8 -6 > "$RESULT/calibration_tables.tar.xz")
}
trap finish EXIT

if has setup; then
  OUT=/tmp/mk-out-setup MK_SUITE_STEPS=setup bash scripts/device/suite.sh 2>&1 | grep -E "setup|gpu:"
fi

rc=0
if has threads; then
  if echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "threads: an MPS server is running: these runs are under MPS too"
  fi
  for np in $nps; do
    for shape in $shapes; do
      IFS=, read -r m n k <<< "$shape"
      for op in gemm_rs gemm_ar ag_gemm; do
        tag="th_w${np}_${op}_${m}x${n}x${k}"
        timeout 240 "$B/bench/bench_fused_threads" "$np" "$op" "$m" "$n" "$k" "$reps" --splits \
          --trace "$L/cal" --json "$L/$tag.json" > "$L/$tag.log" 2>&1 || { rc=1; echo "threads: $tag failed"; tail -5 "$L/$tag.log"; }
        python3 - "$L/$tag.json" <<'PY' 2>/dev/null
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    st = " ".join("%d:%.3f" % (s["split"], s["ms"]) for s in r.get("statics", []))
    print("threads w%d %s %dx%dx%d: correct %s, compute %.3f ms; splits (ms) %s; controller %.3f ms (settled %d), "
          "%.3f of the best (%d)" % (r["world"], r["op"], r["M"], r["N"], r["K"], r["correct"], r["compute_only_ms"], st,
                                     r.get("ctl_ms", 0), r.get("ctl_split", 0), r.get("controller_vs_best", 0),
                                     r.get("best_static_split", 0)))
PY
      done
    done
  done
  python3 tools/split_calibration.py reduce "$L/cal.*.tsv" $(for j in "$L"/th_*.json; do echo --json "$j"; done) \
    --out "$RESULT/calibration_threads.json" --tsv "$RESULT/split_calibration_h200.tsv" || rc=1
  echo "threads: done ($(elapsed) s)"
fi

if has mps; then
  nvidia-cuda-mps-control -d && started=1
  for np in $nps; do
    for shape in $shapes; do
      IFS=, read -r m n k <<< "$shape"
      tag="mps_w${np}_${m}x${n}x${k}"
      CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 300 mpirun --allow-run-as-root -np "$np" "$B/mkernel" bench all \
        --m "$m" --n "$n" --k "$k" --splits --reps "$reps" --warmup 5 --json "$RESULT/splits_$tag.json" \
        > "$L/$tag.log" 2>&1 || { rc=1; echo "mps: $tag failed"; tail -5 "$L/$tag.log"; }
      grep -E "ctl|split" "$L/$tag.log" | head -12
    done
  done
  echo "mps: done ($(elapsed) s)"
fi
exit $rc
