#!/usr/bin/env bash
# Everything the one-GPU machine must show, in one call, with hard time limits per step:
#   setup   binaries from .devbin (scripts/device/pack_binaries.sh, built here) or a build
#           into /tmp/mkb (-j16; needs .devcarry from scripts/device/prepare.sh)
#   unit    every ctest test labelled gpu (under MPS, ranks as processes on the one GPU)
#   matrix  scripts/device/matrix_check.sh: every layout x provider x staging through the API
#   smoke   scripts/device/cli_smoke.sh: the CLI commands users ran, verbatim
#   san     scripts/device/sanitize_check.sh: compute-sanitizer memcheck/racecheck/synccheck
#   attn    tests/gpu/test_attention.py (needs torch)
#   compare scripts/device/compare_check.sh: this build's speed against .devbin-before's
#   mutants the GPU mutations of scripts/mutation_check.py from prebuilt mutant binaries
#           (pack_binaries.sh with MK_PACK_MUTANTS): each must make its tests fail
# MK_SUITE_STEPS picks steps, run in that order (default "setup unit matrix smoke"); MK_UNIT_ONLY
# (regex) limits the unit tests; logs come back packed as
# $OUT/suite_logs.tgz; the last lines printed are the summary.
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-suite
rm -rf "$L" && mkdir -p "$L" "$RESULT"
trap 'tar -C "$L" -czf "$RESULT/suite_logs.tgz" . 2>/dev/null' EXIT
steps=${MK_SUITE_STEPS:-"setup unit matrix smoke"}
has() { [[ " $steps " == *" $1 "* ]]; }
export MK_BUILD_DIR=/tmp/mkb B=/tmp/mkb
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
summary=()
note() { summary+=("$1"); echo "$1"; }
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv,noheader | sed 's/^/gpu: /'

step_setup() {
  if [[ -f .devbin/bins.tar.xz ]]; then
    rm -rf "$B" && mkdir -p "$B" && tar -C "$B" -xJf .devbin/bins.tar.xz
    mapfile -t origin < .devbin/origin.txt
    # ctest files name the paths of the machine that built them: point them here.
    find "$B" -name CTestTestfile.cmake -print0 | xargs -0 -r sed -i -e "s#${origin[0]}#$B#g" -e "s#${origin[1]}#$PWD#g" \
      -e "s#\"[^\"]*/python3[.0-9]*\"#\"$(command -v python3)\"#g"
    probe=$B/tests/gpu/test_gpu_fused_gemm; [[ -e $probe ]] || probe=$B/mkernel   # a slim pack has no tests
    if ldd "$probe" | grep -q "not found"; then
      note "setup: carried binaries lack libraries here: $(ldd "$probe" | grep 'not found' | tr '\n' ' ')"
    else
      note "setup: carried binaries of ${origin[3]:0:12} ($(elapsed) s)"
    fi
  else
    source .devcarry/env.sh && source .devcarry/extra-env.sh
    cmake -S . -B "$B" -G Ninja > "$L/cmake.log" 2>&1 && ninja -C "$B" -j16 -k 0 > "$L/build.log" 2>&1
    note "setup: build rc=$? ($(elapsed) s)"
    grep -E "error" "$L/build.log" | head -5
  fi
}

started_mps=0
mps_on() {
  if [[ $started_mps == 0 ]] && ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
    nvidia-cuda-mps-control -d && started_mps=1
  fi
}
mps_off() { [[ $started_mps == 1 ]] && echo quit | nvidia-cuda-mps-control; started_mps=0; }

step_unit() {
  mps_on
  # One test at a time; ranks of a test share the GPU under MPS at 100/np % each.
  mapfile -t tests < <(ctest --test-dir "$B" -N -L gpu | sed -n 's/^ *Test *#[0-9]*: //p' | grep -v test_attention_py)
  for t in "${tests[@]}"; do
    [[ -n ${MK_UNIT_ONLY:-} && ! $t =~ ${MK_UNIT_ONLY} ]] && continue
    np=$(sed -n 's/.*_np\([0-9]*\)$/\1/p' <<<"$t"); np=${np:-1}
    s=$(date +%s)
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np)) timeout 240 ctest --test-dir "$B" -R "^${t}\$" --output-on-failure \
      > "$L/unit_$t.log" 2>&1
    rc=$?
    # A test cut at its limit leaves its ranks behind (timeout ends ctest, not mpirun's children):
    # end them, or they hold the GPU (MPS: "busy or unavailable") for every later step.
    if [[ $rc == 124 ]]; then pkill -9 -f "$B/tests/" ; pkill -9 -f "$B/mkernel"; sleep 3; fi
    res=$(grep -oE "tests passed|tests failed|Not Run|\*\*\*Skipped|\*\*\*Timeout|\*\*\*Failed" "$L/unit_$t.log" | head -1)
    if grep -q "100% tests passed" "$L/unit_$t.log"; then line="PASS"; else line="FAIL"; fi
    grep -q "\*\*\*Skipped" "$L/unit_$t.log" && line="SKIP"
    note "unit $line  $t  $(( $(date +%s) - s )) s  (rc $rc${res:+, $res})"
    [[ $line == FAIL ]] && grep -E "Failure|Expected|Which is|wrong|error|timed out|gave up|FAILED" "$L/unit_$t.log" | head -6 | sed 's/^/      /'
  done
}

step_matrix() {
  mps_on
  # The 76 launches take 360-430 s on the H200 (2026-12-04): a call of its own (with setup).
  MK_MATRIX_LOGS="$L/matrix" timeout 560 bash scripts/device/matrix_check.sh 2>&1 | tee "$L/matrix.log" | grep -vE "^      "
  if tail -1 "$L/matrix.log" | grep -q "^matrix: "; then note "$(tail -1 "$L/matrix.log")"
  else note "matrix: cut at its time limit after $(grep -cE '^(PASS|FAIL) ' "$L/matrix.log") launches ($(grep -c '^FAIL ' "$L/matrix.log") failed): not a full pass"
  fi
}

step_smoke() {
  mps_on
  MK_SMOKE_LOGS="$L/smoke" MK_SMOKE_MPS=0 timeout 300 bash scripts/device/cli_smoke.sh > "$L/smoke.log" 2>&1
  note "smoke rc=$?: $(grep -E "^(PASS|FAIL)" "$L/smoke.log" | awk '{print $1}' | sort | uniq -c | tr '\n' ' ')"
  grep -E "^FAIL" -A4 "$L/smoke.log" | head -30
}

step_mutants() {
  # The GPU mutations (scripts/mutation_check.py --gpu --build-only, packed with MK_PACK_MUTANTS):
  # each mutant's binaries swapped into this build, its tests must fail.
  mps_on
  if [[ ! -f $B/mutants/mutations.json ]]; then note "mutants: none packed (MK_PACK_MUTANTS)"; return; fi
  MK_BUILD_DIR=$B MK_MUTATION_DIR="$L/mutation" MK_MUTATION_JSON="$L/mutation.json" timeout 560 \
    python3 scripts/mutation_check.py --prebuilt "$B" > "$L/mutants.log" 2>&1
  note "mutants rc=$?: $(tail -1 "$L/mutants.log")"
  grep -E "^  " "$L/mutants.log" | head -20
}

step_san() {
  mps_off  # the sanitizer script starts MPS itself where it needs it
  OUT="$L/san" timeout $(( ${MK_SAN_BUDGET_S:-450} + 30 )) bash scripts/device/sanitize_check.sh > "$L/san.log" 2>&1
  note "sanitizers rc=$?"; tail -30 "$L/san.log"
}

step_compare() {
  mps_off
  OUT="$L/compare" timeout 300 bash scripts/device/compare_check.sh > "$L/compare.log" 2>&1
  note "compare rc=$? (before/after figures in compare/compare.txt)"
  grep -E "^== |^\{|ratio|vs cuBLAS|TFLOP" "$L/compare.log" | head -80
}

step_attn() {
  mps_off
  MK_CAPI=$B/libmkernel_capi.so timeout ${MK_ATTN_TIMEOUT_S:-400} python3 tests/gpu/test_attention.py > "$L/attn.log" 2>&1
  note "test_attention.py rc=$?: $(tail -1 "$L/attn.log")"
}

# Steps run in the order given.
for s in $steps; do
  if declare -F "step_$s" >/dev/null; then "step_$s"; else note "unknown step $s"; fi
done
mps_off

echo "==== summary ($(elapsed) s)"
printf '%s\n' "${summary[@]}" | grep -vE "^unit PASS"
echo "unit: $(printf '%s\n' "${summary[@]}" | grep -c '^unit PASS') passed, $(printf '%s\n' "${summary[@]}" | grep -c '^unit FAIL') failed, $(printf '%s\n' "${summary[@]}" | grep -c '^unit SKIP') skipped"
