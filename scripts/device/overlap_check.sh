#!/usr/bin/env bash
# Where a fused call's time goes (issue: communication hidden under compute), on the GPU machine,
# ranks as processes under MPS at 100/W % each: for each world size and shape, `mkernel bench all`
# (median of MK_OVERLAP_REPS calls, default 30) with MK_OVERLAP_CALLS (10) consecutive traced
# calls on every rank, then tools/trace_report.py over every rank's table; also the GPU's copy
# bandwidth (torch, one process) for the bytes-against-HBM account.
# Binaries: .devbin (scripts/device/pack_binaries.sh), unpacked by suite.sh's setup into /tmp/mkb.
#   MK_OVERLAP_STEPS   steps (default "setup hbm threads sweep peer trace nodes"), run in that
#                      order; threads: bench_fused_threads, the operators with ranks as threads of
#                      one process (before MPS starts: no MPS at all), traced; sweep: the same over
#                      the CLI's --sweep shapes at every world size, with tools/sweep_report.py's
#                      table (th_sweep.md); peer: bench_peer_write
#                      (stores and reduce-adds into the own and a peer's memory, every rank at once)
#                      with ranks as processes under MPS and as threads of one process
#   MK_OVERLAP_NPS     world sizes (default "2 4")
#   MK_OVERLAP_SHAPES  "M,N,K ..." (default: 8192,3584,4096 and the near-empty 8192,3584,64)
# Prints rank 0's trace line and the per-rank medians of each report; the whole reports and the
# bench logs come back in $OUT/overlap_logs.tgz, the tables (xz) in $OUT/overlap_tables_<tag>.tar.xz.
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-overlap
rm -rf "$L" && mkdir -p "$L" "$RESULT"
steps=${MK_OVERLAP_STEPS:-"setup hbm threads sweep peer trace nodes"}
has() { [[ " $steps " == *" $1 "* ]]; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=/tmp/mkb
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
if has setup; then
  OUT=/tmp/mk-out-setup MK_SUITE_STEPS=setup bash scripts/device/suite.sh 2>&1 | grep -E "setup|gpu:"
fi
pack() {
  tar -C "$L" --exclude='*.tsv' --exclude='*.rank*.json' -czf "$RESULT/overlap_logs.tgz" . 2>/dev/null
  for t in $(cd "$L" && ls *.rank0.tsv 2>/dev/null | cut -d_ -f1-2 | sort -u); do  # tr_np2, tr_np4, tr_2x2shm
    (cd "$L" && tar -cf - "$t"_*.tsv | xz -T4 -6 > "$RESULT/overlap_tables_$t.tar.xz")
  done
}
started=0
trap '[[ $started == 1 ]] && echo quit | nvidia-cuda-mps-control; pack' EXIT

if has hbm; then
  timeout 60 python3 - > "$L/hbm.log" 2>&1 <<'PY'
import torch
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(20):
    s.record(); b.copy_(a); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
ts.sort(); ms = ts[len(ts) // 2]
print("hbm: device copy of 1 GiB: %.3f ms median of 20, %.0f GB/s read + write (%.0f GB/s each way)"
      % (ms, 2 * n / ms / 1e6, n / ms / 1e6))
PY
  cat "$L/hbm.log"
fi

if has threads; then
  if echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "threads: an MPS server is running: these runs are under MPS too"
  fi
  for np in ${MK_OVERLAP_NPS:-2 4}; do
    for shape in ${MK_OVERLAP_SHAPES:-8192,3584,4096 8192,3584,64}; do
      IFS=, read -r m n k <<<"$shape"
      for op in ag_gemm gemm_rs gemm_ar; do
        tag="th_np${np}_${m}x${n}x${k}"
        timeout 120 "$B/bench/bench_fused_threads" "$np" "$op" "$m" "$n" "$k" "${MK_OVERLAP_REPS:-30}" \
          --trace "$L/$tag" 2>&1 | tee -a "$L/threads.log"
      done
      base=$L/$tag
      for g in $(ls "$L/$tag".*.rank0.tsv 2>/dev/null); do
        base=${g%.rank0.tsv}
        python3 tools/trace_report.py "$base".rank*.tsv --json "$base.report.json" > "$base.report.txt" 2>&1
        sed -n '/^per rank/,$p' "$base.report.txt" | sed "s#^#  $(basename "$base"): #" | head -8
      done
    done
  done
fi
if has sweep; then
  files=()
  for np in ${MK_OVERLAP_NPS:-2 4}; do
    timeout 400 "$B/bench/bench_fused_threads" "$np" --sweep "${MK_OVERLAP_REPS:-30}" --json "$L/th_sweep_np$np.json" \
      > "$L/th_sweep_np$np.log" 2>&1
    echo "== sweep, threads, W = $np: rc=$? ($(elapsed) s)"
    files+=("$L/th_sweep_np$np.json")
  done
  python3 tools/sweep_report.py --md "$L/th_sweep.md" "${files[@]}" && cat "$L/th_sweep.md"
fi
if ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then nvidia-cuda-mps-control -d && started=1; fi

if has peer; then
  for np in ${MK_OVERLAP_NPS:-2 4}; do
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 120 mpirun --allow-run-as-root -np "$np" --bind-to none \
      "$B/bench/bench_peer_write" 256 20 2>&1 | tee "$L/peer_np$np.log"
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 timeout 120 "$B/bench/bench_peer_write" --threads "$np" 256 20 2>&1 |
      tee "$L/peer_threads$np.log"
  done
fi

bench() {  # tag np env... -- args...
  local tag=$1 np=$2; shift 2
  local envs=()
  while [[ $1 != -- ]]; do envs+=(-x "$1"); shift; done
  shift
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 300 mpirun --allow-run-as-root -np "$np" --bind-to none \
    "${envs[@]}" "$B/mkernel" bench "$@" --reps "${MK_OVERLAP_REPS:-30}" --trace "$L/$tag" \
    --trace-calls "${MK_OVERLAP_CALLS:-10}" --json "$L/$tag.json" > "$L/$tag.log" 2>&1
  echo "== $tag (np $np ${envs[*]}) rc=$? ($(elapsed) s)"
  grep -E "^(ag_gemm|gemm_rs|gemm_ar) |trace rank|WRONG|error|failed" "$L/$tag.log" | head -20
  for g in $(ls "$L/$tag".*.rank0.tsv 2>/dev/null); do
    base=${g%.rank0.tsv}
    python3 tools/trace_report.py "$base".rank*.tsv --json "$base.report.json" > "$base.report.txt" 2>&1
    sed -n '/^per rank/,$p' "$base.report.txt" | sed "s#^#  $(basename "$base"): #" | head -12
  done
}
if has trace; then
  for np in ${MK_OVERLAP_NPS:-2 4}; do
    for shape in ${MK_OVERLAP_SHAPES:-8192,3584,4096 8192,3584,64}; do
      IFS=, read -r m n k <<<"$shape"
      bench "tr_np${np}_${m}x${n}x${k}" "$np" -- all --m "$m" --n "$n" --k "$k"
    done
    # A one-off beside it: the reduction into per-rank slots (stores, no reduce-add) at the
    # near-empty shape, where the adds' cost would show most.
    [[ $np -gt 2 ]] && bench "tr_np${np}_det_8192x3584x64" "$np" -- gemm_rs --m 8192 --n 3584 --k 64 --deterministic
  done
fi
if has nodes; then
  # 2 emulated nodes x 2 ranks over shm, staged (the issue's multi-node target shape).
  bench "tr_2x2shm_16384x8192x2048" 4 MK_RANKS_PER_NODE=2 MK_NET_PROVIDER=shm MK_NET_STAGING=always -- \
    all --m 16384 --n 8192 --k 2048
fi
echo "overlap_check: done ($(elapsed) s)"
