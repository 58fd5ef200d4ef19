#!/usr/bin/env bash
# compute-sanitizer over the GPU tests, on the GPU machine, inside a time budget (issue 21):
#   memcheck1  every GPU test binary (ctest label gpu) as one process
#   memcheck2  every MPI GPU test binary at -np 2, ranks sharing the GPU under MPS (50 % each)
#   racecheck  the GEMM and the grouped GEMM (np 1), attention (test_gpu_ring at np 1: the attention kernel) and
#              fused (np 2, comm roles active) tests: shared-memory hazards
#   synccheck  the same three: barrier and warp-sync misuse
# (tests/gpu/test_attention.py is not run: torch under compute-sanitizer does not fit the budget;
# test_gpu_ring covers the attention kernel.)
# Uses the test binaries already in MK_BUILD_DIR (default /tmp/mkb; suite.sh's setup puts them
# there), else builds them there (needs .devcarry from scripts/device/prepare.sh).
#   MK_SAN_STEPS="memcheck1 racecheck synccheck memcheck2"   steps, run in that order
#   MK_SAN_BUDGET_S=450   the whole script's budget; a run that no longer fits is "skip(budget)"
#   MK_SAN_ONLY=regex     only binaries whose name matches
#   MK_SAN_FILTERS="bin=gtest-filter;..."   replaces the default gtest filter of those binaries
#   MK_SAN_PLANTED=1      also the tests that end a wait on purpose (listed in planted below)
#   MK_SAN_LEAKS=1        memcheck with --leak-check full
# Prints a table (test, tool, np, result, errors from "ERROR SUMMARY: N errors"), writes it to
# $OUT/sanitize_summary.txt and the logs to $OUT/sanitize_logs.tgz. Exit 1 on any error or
# failed run, 0 when every run that ran was clean (skips are listed, not failures).
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-san
rm -rf "$L" && mkdir -p "$L" "$RESULT"
started_mps=0
finish() {
  [[ $started_mps == 1 ]] && echo quit | nvidia-cuda-mps-control
  started_mps=0
  tar -C "$L" -czf "$RESULT/sanitize_logs.tgz" . 2>/dev/null
}
trap finish EXIT
trap 'exit 124' TERM INT  # killed from outside (suite.sh's timeout): logs still come back
t0=$(date +%s)
budget=${MK_SAN_BUDGET_S:-450}
steps=${MK_SAN_STEPS:-"memcheck1 racecheck synccheck memcheck2"}
B=${MK_BUILD_DIR:-/tmp/mkb}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[[ -f .devcarry/env.sh ]] && source .devcarry/env.sh
[[ -f .devcarry/extra-env.sh ]] && source .devcarry/extra-env.sh

# Tests that end a device wait on purpose (planted timeouts, a silent rank, abort): memcheck
# counts the launch failure they provoke, so they run only with MK_SAN_PLANTED=1 (and then with
# --report-api-errors no: only memory errors count).
planted=(test_gpu_abort test_gpu_signal_timeout test_gpu_fused_dead test_gpu_ring_dead)
planted_filter_test_gpu_threads="-*Planted*"
# Not run under a sanitizer: test_gpu_threads' ranks are threads of one process whose kernels
# wait on each other, and the sanitizers serialize a process's kernel launches (each rank's
# kernel then waits for one that cannot start until it ends: the bounded waits expire).
excluded=(test_gpu_threads)
# API errors that are part of what a test checks or that a library makes and handles itself;
# memory errors in those runs still count:
#  - test_gpu_heap: Heap.OutOfMemoryFailsOnEveryRank asks for more memory than the GPU has;
#  - test_gpu_baseline: NCCL probes kernels it was not built for (cudaFuncGetAttributes fails
#    with "no kernel image" inside ncclCommInitRank) and carries on.
api_errors_expected=(test_gpu_heap test_gpu_baseline)
# Default gtest filters (the slow cases out; what stays covers every kernel of the binary).
declare -A filter=(
  [memcheck:test_gpu_gemm]="-Gemm.RandomNormalAgainstCublas"
  [racecheck:test_gpu_gemm]="Gemm.ExactOnSmallIntegers:Gemm.DynamicSchedulerWithoutProgram"
  [synccheck:test_gpu_gemm]="Gemm.ExactOnSmallIntegers:Gemm.DynamicSchedulerWithoutProgram"
  [racecheck:test_gpu_ring]="Ring.ZigzagCausal:Ring.ContiguousCausalD64"
  [memcheck:test_gpu_grouped]="-Grouped.RandomAgainstCublasFp32"
  [racecheck:test_gpu_grouped]="Grouped.ExactOnSmallIntegers:Grouped.SwigluAgainstDoubleReference"
  [synccheck:test_gpu_grouped]="Grouped.ExactOnSmallIntegers:Grouped.SwigluAgainstDoubleReference"
  [synccheck:test_gpu_ring]="Ring.ZigzagCausal:Ring.ContiguousCausalD64"
  # racecheck replays every shared-memory access: ~100 s per fused test at W = 2 on the H200.
  [racecheck:test_gpu_fused]="Fused.GemmRsMatchesReference"
  [synccheck:test_gpu_fused]="Fused.AgGemmMatchesReference:Fused.GemmRsMatchesReference:Fused.GemmArMatchesReference"
)
IFS=';' read -ra user_filters <<<"${MK_SAN_FILTERS:-}"
declare -A user_filter=()
for f in "${user_filters[@]}"; do [[ $f == *=* ]] && user_filter[${f%%=*}]=${f#*=}; done
# Per-run limits (s): a run also stops where the budget ends.
declare -A limit=([memcheck]=120 [racecheck]=150 [synccheck]=120)

cs=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [[ -z $cs && -x $c ]] && cs=$c
done
if [[ -z $cs ]]; then echo "sanitize_check: compute-sanitizer not found" >&2; exit 1; fi
echo "compute-sanitizer: $cs ($("$cs" --version 2>/dev/null | grep -oE 'Version [0-9.]+' | head -1))"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/gpu: /'

# Build only when the binaries are not there already.
if ! compgen -G "$B/tests/gpu/test_gpu_*" >/dev/null || [[ ! -f $B/tests/gpu/CTestTestfile.cmake ]]; then
  echo "build into $B"
  cmake -S . -B "$B" -G Ninja > "$L/cmake.log" 2>&1 &&
    timeout $((budget / 2)) ninja -C "$B" -j16 -k 0 > "$L/build.log" 2>&1
  echo "build rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "error" "$L/build.log" | head -5
fi

# The GPU tests as ctest registered them: binary, whether mpirun launches it, its environment.
# One line per binary (its first registration): name<TAB>path<TAB>mpi(0/1)<TAB>env (space-separated).
ctest --test-dir "$B" -N -L gpu --show-only=json-v1 > "$L/ctest.json" 2>"$L/ctest.err"
mapfile -t bins < <(python3 - "$L/ctest.json" <<'EOF'
import json, os, sys
seen = set()
for t in json.load(open(sys.argv[1])).get("tests", []):
    cmd = t.get("command") or []
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    exe = next((c for c in cmd if "/tests/gpu/" in c and os.path.basename(c).startswith("test_gpu_")), None)
    if not exe or exe in seen:
        continue
    seen.add(exe)
    mpi = 1 if os.path.basename(cmd[0]) in ("mpirun", "mpiexec") else 0
    env = props.get("ENVIRONMENT", [])
    env = [env] if isinstance(env, str) else env
    print("\t".join([os.path.basename(exe), exe, str(mpi), " ".join(env)]))
EOF
)
if ((${#bins[@]} == 0)); then echo "sanitize_check: no GPU test binaries in $B (ctest -N -L gpu)" >&2; exit 1; fi
echo "${#bins[@]} GPU test binaries: $(cut -f1 <<<"$(printf '%s\n' "${bins[@]}")" | tr '\n' ' ')"

is_planted() { local t; for t in "${planted[@]}"; do [[ $1 == "$t" ]] && return 0; done; return 1; }
in_list() { local x=$1 t; shift; for t in "$@"; do [[ $x == "$t" ]] && return 0; done; return 1; }
left() { echo $(( budget - ($(date +%s) - t0) )); }
mps_on() {
  if [[ $started_mps == 0 ]] && ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    nvidia-cuda-mps-control -d && started_mps=1
  fi
}
mps_off() { [[ $started_mps == 1 ]] && echo quit | nvidia-cuda-mps-control; started_mps=0; }

rows=()
failures=0
row() { rows+=("$(printf '%-26s %-10s %-3s %-14s %s' "$@")"); printf '%-26s %-10s %-3s %-14s %s\n' "$@"; }

# run TOOL NAME PATH MPI NP ENV
run() {
  local tool=$1 name=$2 exe=$3 mpi=$4 np=$5 envs=$6
  local lim=${limit[$tool]} rem
  rem=$(( $(left) - 5 ))
  (( rem < lim )) && lim=$rem
  if (( lim < 20 )); then row "$name" "$tool" "$np" "skip(budget)" "-"; return; fi
  local f=${user_filter[$name]:-${filter[$tool:$name]:-}}
  [[ -z $f && $name == test_gpu_threads && ${MK_SAN_PLANTED:-0} != 1 ]] && f=$planted_filter_test_gpu_threads
  local opts=(--tool "$tool" --error-exitcode 99 --print-limit 20)
  [[ $tool == memcheck && ${MK_SAN_LEAKS:-0} == 1 ]] && opts+=(--leak-check full)
  if is_planted "$name" || in_list "$name" "${api_errors_expected[@]}"; then opts+=(--report-api-errors no); fi
  local args=()
  [[ -n $f ]] && args+=("--gtest_filter=$f")
  local log="$L/${tool}_${name}_np${np}.log" s rc
  s=$(date +%s)
  # Waits are bounded: give the slowed kernels room (a test's own setting wins).
  local e=(MK_SIGNAL_TIMEOUT_MS=120000 MK_NET_TIMEOUT_MS=120000 $envs)
  # Ranks share the GPU under MPS; it stays on once started (single processes run fine under it).
  ((np >= 2)) && mps_on
  if ((mpi)); then
    env "${e[@]}" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout -k 10 "$lim" \
      mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$cs" "${opts[@]}" "$exe" "${args[@]}" \
      > "$log" 2>&1
    rc=$?
  else
    env "${e[@]}" timeout -k 10 "$lim" "$cs" "${opts[@]}" "$exe" "${args[@]}" > "$log" 2>&1
    rc=$?
  fi
  # A timed-out run's ranks may outlive mpirun: none may hold the GPU when the next run starts.
  if ((rc == 124 || rc == 137)); then pkill -9 -f "$exe" 2>/dev/null; sleep 2; fi
  # One summary per process ("ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards
  # displayed (N errors, W warnings)"): sum the errors; fewer than np means a rank never got there.
  local sums errs
  sums=$(grep -cE "(ERROR|RACECHECK) SUMMARY:" "$log")
  errs=$( { grep -oE "ERROR SUMMARY: [0-9]+" "$log" | awk '{print $3}';
            grep -oE "RACECHECK SUMMARY: .*\(([0-9]+) errors" "$log" | grep -oE "\(([0-9]+)" | tr -d '('; } |
          awk '{s += $1} END {print s + 0}')
  local res
  if ((rc == 124 || rc == 137)); then res="timeout"
  elif ((rc == 77)); then res="skip(77)"
  elif ((errs > 0 || rc == 99)); then res="ERRORS"
  elif ((rc != 0)); then res="FAIL(rc=$rc)"
  elif ((sums < np)); then res="FAIL(summary)"
  else res="clean"
  fi
  [[ $res == clean || $res == skip* ]] || failures=$((failures + 1))
  row "$name" "$tool" "$np" "$res" "$errs  ($(( $(date +%s) - s )) s${f:+, filter $f})"
  if [[ $res != clean ]]; then
    grep -E "^========= (Invalid|Race|Barrier|Program hit|Error|.*hazard)|Failure|FAILED" "$log" | head -8 | sed 's/^/      /'
  fi
}

printf '%-26s %-10s %-3s %-14s %s\n' test tool np result errors
for step in $steps; do
  for line in "${bins[@]}"; do
    IFS=$'\t' read -r name exe mpi envs <<<"$line"
    [[ -n ${MK_SAN_ONLY:-} && ! $name =~ ${MK_SAN_ONLY} ]] && continue
    if is_planted "$name" && [[ ${MK_SAN_PLANTED:-0} != 1 ]]; then
      [[ $step == memcheck1 ]] && row "$name" memcheck - "skip(planted)" "-"
      continue
    fi
    if in_list "$name" "${excluded[@]}"; then
      [[ $step == memcheck1 ]] && row "$name" memcheck - "not-run(threads)" "-"
      continue
    fi
    case $step in
      memcheck1) run memcheck "$name" "$exe" "$mpi" 1 "$envs" ;;
      memcheck2) ((mpi)) && run memcheck "$name" "$exe" 1 2 "$envs" ;;
      racecheck|synccheck)
        case $name in
          test_gpu_gemm|test_gpu_grouped|test_gpu_ring) run "$step" "$name" "$exe" "$mpi" 1 "$envs" ;;
          test_gpu_fused) run "$step" "$name" "$exe" 1 2 "$envs" ;;
        esac ;;
      *) echo "unknown step $step" ;;
    esac
  done
done
mps_off

{
  # The binaries' commit: from the packed build when there is one (the machine's copy of the tree
  # need not carry the same git metadata).
  rev=$( [[ -f .devbin/origin.txt ]] && sed -n 4p .devbin/origin.txt | cut -c1-12 || git rev-parse --short HEAD 2>/dev/null)
  echo "compute-sanitizer over the GPU tests ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), binaries of $rev)"
  printf '%-26s %-10s %-3s %-14s %s\n' test tool np result errors
  printf '%s\n' "${rows[@]}"
  echo "runs: ${#rows[@]}, clean: $(printf '%s\n' "${rows[@]}" | grep -c ' clean '), not clean: $failures, total $(( $(date +%s) - t0 )) s"
} > "$RESULT/sanitize_summary.txt"
echo "==== summary"
cat "$RESULT/sanitize_summary.txt"
((failures == 0))
