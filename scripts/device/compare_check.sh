#!/usr/bin/env bash
# Speed of this build against an earlier one, measured in the same run on the same GPU:
#   bench_gemm (mkernel vs cuBLAS), `mkernel bench all` at W = 1, bench/bench_attention.py (vs
#   SDPA), and the host time of FusedGemm::run at W = 2 (bench_host_call, ranks under MPS).
# The earlier build's binaries come from .devbin-before/before.tar.xz (bench_gemm_before,
# bench_host_call_before, mkernel_before, libmkernel_capi_before.so); this build's from $B
# (scripts/device/suite.sh setup). Before and after run alternately (MK_COMPARE_ROUNDS rounds,
# default 1), so drift hits both alike.
# Output: $OUT/compare.txt (and the raw lines in $OUT/compare_raw.txt).
set -uo pipefail
B=${B:-/tmp/mkb}
OUT=${OUT:-/tmp/mk-out}
P=/tmp/mk-before
mkdir -p "$OUT"
rm -rf "$P" && mkdir -p "$P" && tar -C "$P" -xJf .devbin-before/before.tar.xz || { echo "compare: no earlier build"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
raw="$OUT/compare_raw.txt"
: > "$raw"
log() { echo "$*" | tee -a "$raw"; }
for round in $(seq 1 "${MK_COMPARE_ROUNDS:-1}"); do
  for who in before after; do
    if [[ $who == before ]]; then g=$P/bench_gemm_before; m=$P/mkernel_before; capi=$P/libmkernel_capi_before.so; h=$P/bench_host_call_before
    else g=$B/bench/bench_gemm; m=$B/mkernel; capi=$B/libmkernel_capi.so; h=$B/bench/bench_host_call; fi
    log "== round $round $who bench_gemm"
    timeout 120 "$g" --reps 15 4096 4096 4096 8192 8192 8192 2048 6144 1024 2>&1 | tee -a "$raw" | tail -6
    log "== round $round $who mkernel bench all (W = 1)"
    timeout 120 "$m" bench all --reps 15 2>&1 | tee -a "$raw" | tail -8
    if [[ ${MK_COMPARE_ATTN:-1} == 1 ]]; then
      log "== round $round $who bench_attention.py"
      MK_CAPI=$capi timeout 150 python3 bench/bench_attention.py --reps 10 2>&1 | tee -a "$raw" | tail -6
    fi
  done
done
# Host time of run(): W = 2 under MPS (the per-call path; before: it agreed across ranks).
started=0
if ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then nvidia-cuda-mps-control -d && started=1; fi
for round in $(seq 1 "${MK_COMPARE_HOST_ROUNDS:-2}"); do
  for who in before after; do
    if [[ $who == before ]]; then h=$P/bench_host_call_before; else h=$B/bench/bench_host_call; fi
    for op in gemm_rs ag_gemm; do
      log "== round $round $who host_call $op W=2"
      CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 60 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
        "$h" "$op" 2048 1024 1024 500 2>&1 | tee -a "$raw" | grep -E "^\{|rror" | head -3
    done
  done
done
[[ $started == 1 ]] && echo quit | nvidia-cuda-mps-control
cp "$raw" "$OUT/compare.txt"
