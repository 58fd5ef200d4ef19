#!/usr/bin/env bash
# The configuration matrix on one GPU under MPS: test_gpu_matrix (every operator, aligned / odd /
# tiny shapes, 1 / default / 16 communication CTAs, deterministic and not, blocking CUDA calls
# while calls are in flight) launched in every layout a user can launch:
#   one node:        1 x W for W = 1..8
#   several nodes:   2x1, 3x1, 4x1, 5x1, 6x1, 8x1, 2x2, 3x2, 4x2, 2x4, each over shm, tcp_rxm and udp_rxd,
#                    staging auto or always (alternating, so that every layout and every
#                    provider meets both staging modes).
# The CLI half of the matrix is scripts/device/cli_smoke.sh.
#
#   MK_BUILD_DIR=dir       binaries (default /tmp/mkb): dir/tests/gpu/test_gpu_matrix
#   MK_MATRIX_LOGS=dir     logs (default /tmp/mk-matrix)
#   MK_MATRIX_ONLY=regex   run only the launches whose name matches (e.g. '2x2|1x4')
#   MK_MATRIX_FILTER=...   gtest filter passed to every launch (default: all but Matrix.LongRun, which
#                          runs in the launches of MK_MATRIX_LONG, a regex, default '1x2-|4x2-tcp', and
#                          Matrix.GraphReplays (200 replays per operator), in those of MK_MATRIX_GRAPH,
#                          default '1x1-|1x4-|1x8-|2x2-|3x1-udp|2x4-shm|5x1-tcp')
#   MK_MATRIX_SPLIT="static auto"  the fused operators' split modes (MK_FUSED_SPLIT): every launch
#                          runs once per mode listed (auto: the on-GPU SM-partition controller)
#   MK_MATRIX_TRACE_DIR=dir  (read by the ranks) the ring backward runs traced and every rank writes
#                          its timeline of each case there (ringbwd.<case>.call<n>.rank<r>.tsv), also
#                          after a failed call; bench/results/h100-2026-12-07-roles/residency.py reads them
# Prints one line per launch and a summary; exits non-zero if any launch failed.
set -uo pipefail
B=${MK_BUILD_DIR:-/tmp/mkb}
LOGS=${MK_MATRIX_LOGS:-/tmp/mk-matrix}
BIN=$B/tests/gpu/test_gpu_matrix
mkdir -p "$LOGS"
[[ -x $BIN ]] || { echo "matrix: $BIN not found"; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
started_mps=0
if ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
  nvidia-cuda-mps-control -d && started_mps=1
fi
trap '[[ $started_mps == 1 ]] && echo quit | nvidia-cuda-mps-control' EXIT

launches=()
for w in 1 2 3 4 5 6 7 8; do launches+=("1x$w"); done
layouts=(2x1 3x1 4x1 5x1 6x1 8x1 2x2 3x2 4x2 2x4)
providers=(shm tcp_rxm udp_rxd)
for i in "${!layouts[@]}"; do
  for j in "${!providers[@]}"; do
    st=auto; (( (i + j) % 2 )) && st=always
    launches+=("${layouts[$i]}-${providers[$j]}-$st")
  done
done

modes=(${MK_MATRIX_SPLIT:-static auto})
all=()
for m in "${modes[@]}"; do for l in "${launches[@]}"; do all+=("$l-$m"); done; done

pass=0; fail=0; failed=()
t_all=$(date +%s)
for name in "${all[@]}"; do
  [[ -n ${MK_MATRIX_ONLY:-} && ! $name =~ ${MK_MATRIX_ONLY} ]] && continue
  split=${name##*-}
  IFS=- read -r layout prov st <<<"${name%-*}"
  nodes=${layout%x*}; per=${layout#*x}; np=$((nodes * per))
  env=(-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) -x MK_TEST_SEED=${MK_TEST_SEED:-$RANDOM$RANDOM}
       -x MK_FUSED_SPLIT=$split)
  if (( nodes > 1 )); then
    env+=(-x MK_RANKS_PER_NODE=$per -x MK_NET_PROVIDER=$prov -x MK_NET_STAGING=$st)
  fi
  skip=()
  [[ $name =~ ${MK_MATRIX_LONG:-1x2-|4x2-tcp} ]] || skip+=(Matrix.LongRun)
  [[ $name =~ ${MK_MATRIX_GRAPH:-1x1-|1x4-|1x8-|2x2-|3x1-udp|2x4-shm|5x1-tcp} ]] || skip+=(Matrix.GraphReplays)
  args=()
  ((${#skip[@]})) && args=(--gtest_filter=-$(IFS=:; echo "${skip[*]}"))
  [[ -n ${MK_MATRIX_FILTER:-} ]] && args=(--gtest_filter="$MK_MATRIX_FILTER")
  t0=$(date +%s%N)
  timeout 150 mpirun --allow-run-as-root --oversubscribe --bind-to none -np $np "${env[@]}" "$BIN" "${args[@]}" \
    > "$LOGS/$name.log" 2>&1
  rc=$?
  dt=$(( ($(date +%s%N) - t0) / 100000000 )); dt="$((dt / 10)).$((dt % 10))"
  tests=$(sed 's/\x1b\[[0-9;]*m//g' "$LOGS/$name.log" | grep -cE '^\[       OK \]')
  if [[ $rc == 0 ]]; then
    pass=$((pass + 1)); echo "PASS  $name  np $np  ${dt}s  ($tests test runs ok over all ranks)"
  else
    fail=$((fail + 1)); failed+=("$name")
    echo "FAIL  $name  np $np  rc $rc  ${dt}s"
    grep -E "Failure|Expected|wrong|error|timed out|gave up|FAILED" "$LOGS/$name.log" | head -8 | sed 's/^/      /'
  fi
done
echo "matrix: $pass launches passed, $fail failed in $(( $(date +%s) - t_all )) s ${failed[*]:-}"
(( fail == 0 ))
