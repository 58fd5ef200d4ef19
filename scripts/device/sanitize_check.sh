#!/usr/bin/env bash
# compute-sanitizer over the GPU tests, on the GPU machine, inside a time budget:
#   memcheck1  every GPU test binary as one process (its np-1 registration's gtest filter)
#   memcheck2  every MPI GPU test binary at -np 2 (its np-2 registration's filter), ranks sharing
#              the GPU under MPS (50 % each)
#   racecheck  shared-memory hazards: the GEMM and grouped GEMM (np 1), attention (test_gpu_ring_attention
#              at np 1: the attention kernel alone) and, at np 2 with the communication roles
#              active, the fused GEMMs, the ring, MoE dispatch/combine and the MoE layer
#   synccheck  the same runs: barrier and warp-sync misuse
# racecheck and synccheck run with MK_TEST_SMALL=1 (the tests' large shapes left out; every code
# path stays) and the filters below. The whole set fits two calls of the GPU machine:
#   MK_SAN_STEPS="memcheck1 memcheck2"   then   MK_SAN_STEPS="racecheck synccheck"
# (tests/gpu/test_attention.py is not run: torch under compute-sanitizer does not fit the budget;
# test_gpu_ring_attention covers the attention kernel.)
# After every run no process of the run may hold the GPU: leftover ranks are killed, and the next
# run starts only once the GPU lists none of them (else MPS is restarted, and the run says so).
# Uses the test binaries already in MK_BUILD_DIR (default /tmp/mkb; suite.sh's setup puts them
# there), else builds them there (needs .devcarry from scripts/device/prepare.sh).
#   MK_SAN_STEPS="memcheck1 memcheck2 racecheck synccheck"   steps, run in that order
#   MK_SAN_BUDGET_S=540   the whole script's budget; a run that no longer fits is "skip(budget)"
#   MK_SAN_ONLY=regex     only binaries whose name matches
#   MK_SAN_FILTERS="bin=gtest-filter;..."   replaces the gtest filter of those binaries
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
budget=${MK_SAN_BUDGET_S:-540}
steps=${MK_SAN_STEPS:-"memcheck1 memcheck2 racecheck synccheck"}
B=${MK_BUILD_DIR:-/tmp/mkb}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[[ -f .devcarry/env.sh ]] && source .devcarry/env.sh
[[ -f .devcarry/extra-env.sh ]] && source .devcarry/extra-env.sh

# Tests that end a device wait on purpose (planted timeouts, a silent rank, abort): memcheck
# counts the launch failure they provoke, so they run only with MK_SAN_PLANTED=1 (and then with
# --report-api-errors no: only memory errors count).
planted=(test_gpu_abort test_gpu_signal_timeout test_gpu_fused_gemm_dead test_gpu_ring_attention_dead)
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
# The racecheck/synccheck runs: binary -> ranks (np 1: no communication roles; np 2: with them).
declare -A race_np=([test_gpu_gemm]=1 [test_gpu_grouped]=1 [test_gpu_ring_attention]="1 2" [test_gpu_fused_gemm]=2
                    [test_gpu_moe]=2 [test_gpu_moe_layer]=2)
# Gtest filters (tool:binary, or tool:binary:np). Without one, a run takes the filter of the
# ctest registration at that np (e.g. test_gpu_moe leaves out its dead-rank test there).
declare -A filter=(
  # Binaries registered at np 2 and up only: at np 1 leave out what needs a second rank (a skip
  # would turn the run's result into skip(77) and hide the rest).
  [memcheck:test_gpu_heap:1]="-Heap.SizeMismatchFailsOnEveryRank"
  [memcheck:test_gpu_gemm]="-Gemm.RandomNormalAgainstCublas"
  [memcheck:test_gpu_grouped]="-Grouped.RandomAgainstCublasFp32"
  [racecheck:test_gpu_gemm]="Gemm.ExactOnSmallIntegers:Gemm.DynamicSchedulerWithoutProgram"
  [synccheck:test_gpu_gemm]="Gemm.ExactOnSmallIntegers:Gemm.DynamicSchedulerWithoutProgram"
  [racecheck:test_gpu_grouped]="Grouped.ExactOnSmallIntegers:Grouped.SwigluAgainstDoubleReference"
  [synccheck:test_gpu_grouped]="Grouped.ExactOnSmallIntegers:Grouped.SwigluAgainstDoubleReference"
  # np 1: the attention kernel (causal zigzag, D 64 with GQA); np 2: the ring's forwarding too.
  [racecheck:test_gpu_ring_attention:1]="Ring.ZigzagCausal:Ring.ContiguousCausalD64"
  [synccheck:test_gpu_ring_attention:1]="Ring.ZigzagCausal:Ring.ContiguousCausalD64"
  [racecheck:test_gpu_ring_attention:2]="Ring.ZigzagCausal:Ring.ContiguousFullTails"
  [synccheck:test_gpu_ring_attention:2]="Ring.ZigzagCausal:Ring.ContiguousFullTails"
  # Each fused operator (AG, RS, AR; 1 and 16 communication CTAs) at the small shapes.
  [racecheck:test_gpu_fused_gemm]="Fused.GemmRsMatchesReference:Fused.OneAndManyCommCtas"
  [synccheck:test_gpu_fused_gemm]="Fused.AgGemmMatchesReference:Fused.GemmRsMatchesReference:Fused.GemmArMatchesReference:Fused.OneAndManyCommCtas"
  # Both modes, every routing (dispatch, combine); the layer: grouped GEMMs between them.
  [racecheck:test_gpu_moe]="Moe.DispatchCombineEveryRouting"
  [synccheck:test_gpu_moe]="Moe.DispatchCombineEveryRouting:Moe.TwoHandlesInFlight"
  [racecheck:test_gpu_moe_layer]="MoeLayer.IntegerExact:MoeLayer.RunExpertsRedoesTheExpertOutputs"
  [synccheck:test_gpu_moe_layer]="MoeLayer.IntegerExact:MoeLayer.RunExpertsRedoesTheExpertOutputs"
)
# Binaries none of whose tests can run at np 1 (memcheck1 lists them as "n/a(np 1)").
needs_two=(test_gpu_proxy test_gpu_fused_gemm_dead test_gpu_ring_attention_dead)  # the dead-rank tests: registered at np 2
IFS=';' read -ra user_filters <<<"${MK_SAN_FILTERS:-}"
declare -A user_filter=()
for f in "${user_filters[@]}"; do [[ $f == *=* ]] && user_filter[${f%%=*}]=${f#*=}; done
# Per-run limits (s): a run also stops where the budget ends.
declare -A limit=([memcheck]=120 [racecheck]=200 [synccheck]=150)

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

# The GPU tests as ctest registered them. One line per binary, fields split by US (0x1f; not a tab:
# bash's read merges adjacent whitespace separators, so an empty env field would shift the filters
# into it):
#   name US path US mpi(0/1) US env (space-separated, first registration) US np=filter;np=filter...
# (the gtest filter of each one-node registration, i.e. one without MK_RANKS_PER_NODE, by its np).
ctest --test-dir "$B" -N -L gpu --show-only=json-v1 > "$L/ctest.json" 2>"$L/ctest.err"
mapfile -t bins < <(python3 - "$L/ctest.json" <<'PY'
import json, os, sys
order, info = [], {}
for t in json.load(open(sys.argv[1])).get("tests", []):
    cmd = t.get("command") or []
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    idx = next((i for i, c in enumerate(cmd) if "/tests/gpu/" in c and os.path.basename(c).startswith("test_gpu_")), None)
    if idx is None:
        continue
    exe = cmd[idx]
    mpi = 1 if os.path.basename(cmd[0]) in ("mpirun", "mpiexec") else 0
    np = 1
    if mpi and "-np" in cmd:
        np = int(cmd[cmd.index("-np") + 1])
    env = props.get("ENVIRONMENT", [])
    env = [env] if isinstance(env, str) else env
    flt = next((a.split("=", 1)[1] for a in cmd[idx + 1:] if a.startswith("--gtest_filter=")), "")
    if exe not in info:
        order.append(exe)
        info[exe] = {"mpi": mpi, "env": env, "filters": {}}
    plain = not any(e.startswith(("MK_RANKS_PER_NODE=", "MK_SYMMEM_MODE=")) for e in env)
    if plain and np not in info[exe]["filters"]:
        info[exe]["filters"][np] = flt
for exe in order:
    i = info[exe]
    env = i["env"]
    filters = ";".join("%d=%s" % (n, f) for n, f in sorted(i["filters"].items()))
    print("\x1f".join([os.path.basename(exe), exe, str(i["mpi"]), " ".join(env), filters]))
PY
)
if ((${#bins[@]} == 0)); then echo "sanitize_check: no GPU test binaries in $B (ctest -N -L gpu)" >&2; exit 1; fi
echo "${#bins[@]} GPU test binaries: $(cut -d$'\x1f' -f1 <<<"$(printf '%s\n' "${bins[@]}")" | tr '\n' ' ')"

is_planted() { local t; for t in "${planted[@]}"; do [[ $1 == "$t" ]] && return 0; done; return 1; }
in_list() { local x=$1 t; shift; for t in "$@"; do [[ $x == "$t" ]] && return 0; done; return 1; }
left() { echo $(( budget - ($(date +%s) - t0) )); }
mps_on() {
  if [[ $started_mps == 0 ]] && ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    nvidia-cuda-mps-control -d && started_mps=1
  fi
}
mps_off() {  # and wait (10 s at most) until the control daemon is gone, so that mps_on starts anew
  local i
  if [[ $started_mps == 1 ]]; then
    echo quit | nvidia-cuda-mps-control
    for i in $(seq 20); do echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || break; sleep 0.5; done
  fi
  started_mps=0
}
# Processes on the GPU other than the MPS server (pid list).
gpu_users() {
  nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null |
    grep -v "nvidia-cuda-mps-server" | cut -d, -f1 | tr -d ' ' | grep -E '^[0-9]+$'
}
# After a run: nothing of it may be left, on the host or the GPU, when the next starts.
# Prints what it had to do (empty: nothing was left).
reclaim() {  # exe rc
  local exe=$1 rc=$2 left_pids waited=0 did=""
  left_pids=$(pgrep -f -- "$exe" || true)
  if [[ -n $left_pids ]]; then did="killed leftover ranks ($(echo $left_pids | wc -w))"; kill -9 $left_pids 2>/dev/null; fi
  while [[ -n $(gpu_users) ]] && ((waited < 30)); do sleep 1; waited=$((waited + 1)); done
  if [[ -n $(gpu_users) ]]; then
    kill -9 $(gpu_users) 2>/dev/null
    did="$did; GPU still held after 30 s: killed $(gpu_users | wc -w) process(es)"
    sleep 2
  fi
  # A client killed mid-kernel (its run timed out, or leftovers were killed here) can leave the MPS
  # server refusing new clients ("CUDA-capable device(s) is/are busy or unavailable"): restart it.
  if ((rc == 124 || rc == 137)); then did="${did:+$did; }the run was killed at its limit"; fi
  if [[ -n $did && $started_mps == 1 ]]; then mps_off; mps_on; did="$did; MPS restarted"; fi
  echo "$did"
}

rows=()
failures=0
row() { rows+=("$(printf '%-30s %-10s %-3s %-14s %s' "$@")"); printf '%-30s %-10s %-3s %-14s %s\n' "$@"; }

# The gtest filter of a run: the user's, the script's (tool:bin:np, then tool:bin), else the one
# ctest registered at that np (then at any np: the first).
pick_filter() {  # tool name np regs
  local tool=$1 name=$2 np=$3 regs=$4 r
  if [[ -n ${user_filter[$name]:-} ]]; then echo "${user_filter[$name]}"; return; fi
  if [[ -n ${filter[$tool:$name:$np]:-} ]]; then echo "${filter[$tool:$name:$np]}"; return; fi
  if [[ -n ${filter[$tool:$name]:-} ]]; then echo "${filter[$tool:$name]}"; return; fi
  IFS=';' read -ra rr <<<"$regs"
  for r in "${rr[@]}"; do [[ ${r%%=*} == "$np" ]] && { echo "${r#*=}"; return; }; done
  [[ $name == test_gpu_threads && ${MK_SAN_PLANTED:-0} != 1 ]] && { echo "$planted_filter_test_gpu_threads"; return; }
  ((${#rr[@]})) && echo "${rr[0]#*=}"
}

# run TOOL NAME PATH MPI NP ENV REGS
run() {
  local tool=$1 name=$2 exe=$3 mpi=$4 np=$5 envs=$6 regs=$7
  local lim=${limit[$tool]} rem
  rem=$(( $(left) - 5 ))
  (( rem < lim )) && lim=$rem
  if (( lim < 20 )); then row "$name" "$tool" "$np" "skip(budget)" "-"; return; fi
  local f
  f=$(pick_filter "$tool" "$name" "$np" "$regs")
  local opts=(--tool "$tool" --error-exitcode 99 --print-limit 20)
  [[ $tool == memcheck && ${MK_SAN_LEAKS:-0} == 1 ]] && opts+=(--leak-check full)
  if is_planted "$name" || in_list "$name" "${api_errors_expected[@]}"; then opts+=(--report-api-errors no); fi
  local args=()
  [[ -n $f ]] && args+=("--gtest_filter=$f")
  local log="$L/${tool}_${name}_np${np}.log" s rc
  s=$(date +%s)
  # Waits are bounded: give the slowed kernels room (a test's own setting wins).
  local e=(MK_SIGNAL_TIMEOUT_MS=120000 MK_NET_TIMEOUT_MS=120000 $envs)
  [[ $tool != memcheck ]] && e+=(MK_TEST_SMALL=1)
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
  local cleanup
  cleanup=$(reclaim "$exe" "$rc")
  # One summary per process ("ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards
  # displayed (N errors, W warnings)"): sum the errors; fewer than np means a rank never got there.
  local sums errs
  sums=$(grep -cE "(ERROR|RACECHECK) SUMMARY:" "$log")
  errs=$( { grep -oE "ERROR SUMMARY: [0-9]+" "$log" | awk '{print $3}';
            grep -oE "RACECHECK SUMMARY: .*\(([0-9]+) errors" "$log" | grep -oE "\(([0-9]+)" | tr -d '('; } |
          awk '{s += $1} END {print s + 0}')
  local tests_ok
  tests_ok=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -cE '^\[       OK \]')
  local res
  if ((rc == 124 || rc == 137)); then res="timeout"
  elif ((rc == 77)); then res="skip(77)"
  elif ((errs > 0 || rc == 99)); then res="ERRORS"
  elif ((rc != 0)); then res="FAIL(rc=$rc)"
  elif ((sums < np)); then res="FAIL(summary)"
  elif ((tests_ok == 0)); then res="FAIL(no test)"  # a filter that matched nothing
  else res="clean"
  fi
  [[ $res == clean || $res == skip* ]] || failures=$((failures + 1))
  row "$name" "$tool" "$np" "$res" "$errs  ($(( $(date +%s) - s )) s, $tests_ok test runs ok${f:+, filter $f})"
  [[ -n $cleanup ]] && echo "      after the run: $cleanup" | tee -a "$L/cleanup.txt"
  if [[ $res != clean ]]; then
    grep -E "^========= (Invalid|Race|Barrier|Program hit|Error|.*hazard)|Failure|FAILED" "$log" | head -8 | sed 's/^/      /'
  fi
}

printf '%-30s %-10s %-3s %-14s %s\n' test tool np result errors
if [[ -n $(gpu_users) ]]; then echo "sanitize_check: the GPU is in use before the first run: $(gpu_users | tr '\n' ' ')"; fi
for step in $steps; do
  for line in "${bins[@]}"; do
    IFS=$'\x1f' read -r name exe mpi envs regs <<<"$line"
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
      memcheck1)
        if in_list "$name" "${needs_two[@]}"; then row "$name" memcheck 1 "n/a(np 1)" "-"
        else run memcheck "$name" "$exe" "$mpi" 1 "$envs" "$regs"; fi ;;
      memcheck2) ((mpi)) && run memcheck "$name" "$exe" 1 2 "$envs" "$regs" ;;
      racecheck|synccheck)
        for np in ${race_np[$name]:-}; do
          ((np > 1 && ! mpi)) && continue
          run "$step" "$name" "$exe" "$mpi" "$np" "$envs" "$regs"
        done ;;
      *) echo "unknown step $step" ;;
    esac
  done
done
mps_off

{
  # The binaries' commit: from the packed build when there is one (the machine's copy of the tree
  # need not carry the same git metadata).
  rev=$( [[ -f .devbin/origin.txt ]] && sed -n 4p .devbin/origin.txt | cut -c1-12 || git rev-parse --short HEAD 2>/dev/null)
  echo "compute-sanitizer over the GPU tests ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), binaries of $rev, steps: $steps)"
  printf '%-30s %-10s %-3s %-14s %s\n' test tool np result errors
  printf '%s\n' "${rows[@]}"
  [[ -f $L/cleanup.txt ]] && { echo "cleanup after runs:"; cat "$L/cleanup.txt"; }
  echo "runs: ${#rows[@]}, clean: $(printf '%s\n' "${rows[@]}" | grep -c ' clean '), not clean: $failures, total $(( $(date +%s) - t0 )) s"
} > "$RESULT/sanitize_summary.txt"
echo "==== summary"
cat "$RESULT/sanitize_summary.txt"
((failures == 0))
