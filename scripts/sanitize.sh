#!/usr/bin/env bash
# Sanitizer stage (CI runs it after scripts/test.sh): every CPU test (ctest label cpu: threads,
# MPI and libfabric ones) built with ASan+UBSan into build-asan and with TSan into build-tsan,
# and run under each. Only the C/C++ host code is instrumented (MK_SANITIZE); the CUTLASS
# kernels are left out (MK_WITH_CUTLASS=OFF) and only the cpu test targets are built.
# Suppressions for third-party code: scripts/sanitizers/*.supp (docs/testing.md, "Sanitizers").
# Fails on any sanitizer report (reports go to files, printed at the end) and on any failed test.
#   MK_SAN_KINDS="asan tsan"  the builds to run (default both)
#   MK_SAN_TESTS=regex        only the cpu tests whose name matches (ctest -R)
#   MK_SAN_RETRY=1            rerun once the tests that failed without a sanitizer report (timing
#                             on a loaded 2-core machine); they are named; 0: no rerun
#   MK_SAN_STRIDE=n           the CPU plan tests run one in n of their sweep configurations and
#                             mutants under the sanitizers (MK_TEST_STRIDE; default 4, 1: all;
#                             tests/common/test_util.h): their sanitized run is 5-8 times slower,
#                             and scripts/test.sh runs every one unsanitized
#   MK_JOBS=n                 build jobs (default: all cores)
# Run scripts/setup.sh first (CI's scripts/test.sh does); this script installs nothing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
jobs=${MK_JOBS:-$(nproc)}
kinds=${MK_SAN_KINDS:-asan tsan}
supp=$root/scripts/sanitizers
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# Tests whose TSan reports come from code under repair elsewhere: still run, their reports
# printed, but they do not fail the stage. Empty: every report fails. (Name + issue when used.)
tsan_known_races=()
# Not run under TSan: single-threaded tests (TSan finds races between threads only) that take
# minutes under it. ASan+UBSan runs them.
tsan_single_threaded=(test_fused_gemm_plan test_ring_attention_program test_collective_plan test_moe_plan test_moe_layer_program)

nvcc=$(command -v nvcc || true)
[[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
if [[ -z $nvcc ]]; then
  echo "sanitize: nvcc not found (the CUDA toolkit is needed to configure; scripts/setup.sh)" >&2
  exit 1
fi
for tool in cmake ninja ctest mpirun python3; do
  command -v $tool >/dev/null || { echo "sanitize: $tool not found: run scripts/setup.sh first" >&2; exit 1; }
done

# Sanitizer options for the test processes (ranks under mpirun inherit them: OpenMPI's local
# launcher passes the environment through; checked below).
sanitizer_env() {  # kind logs
  local kind=$1 logs=$2
  unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS
  export MK_TEST_STRIDE=${MK_SAN_STRIDE:-4}
  if [[ $kind == asan ]]; then
    # The MPI tests' main sets fast_unwind_on_malloc=0 for itself (tests/common/mpi_gtest_main.cc:
    # allocation stacks through OpenMPI for the leak suppressions); the others keep the fast
    # unwinder, 20 times cheaper per allocation. protect_shadow_gap=0: the CUDA driver maps
    # memory there on a GPU machine.
    export ASAN_OPTIONS="detect_leaks=1:protect_shadow_gap=0:check_initialization_order=1:log_path=$logs/asan"
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
    # UBSan in the ASan runtime reports on stderr (a log_path drops its stack): the test output.
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  else
    # exitcode=0: a race fails the stage through its report file (below), so the tests listed
    # in tsan_known_races can report without failing.
    export TSAN_OPTIONS="suppressions=$supp/tsan.supp:print_suppressions=0:second_deadlock_stack=1:exitcode=0:log_path=$logs/tsan"
  fi
}

# TSan needs its fixed memory layout: on kernels with more mmap randomization than gcc's TSan
# runtime allows ("unexpected memory mapping") it runs with ASLR off. mpirun's ranks inherit it.
tsan_prefix=()
if setarch "$(uname -m)" -R true 2>/dev/null; then tsan_prefix=(setarch "$(uname -m)" -R); fi

status=0
summary=()
for kind in $kinds; do
  case $kind in
    asan) san=address,undefined ;;
    tsan) san=thread ;;
    *) echo "sanitize: unknown kind '$kind' (asan, tsan)" >&2; exit 1 ;;
  esac
  dir=build-$kind
  logs=$root/$dir/sanitizer-logs
  t0=$(date +%s)
  echo "== sanitize: $kind: configure and build ($dir)"
  mkdir -p "$dir"
  # -O1 -g1: line tables are all a report's stack needs; this build compiles in a third of the
  # time -O2 -g takes (the gtest-heavy test sources), and runs about as fast.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_CUDA_COMPILER="$nvcc" -DMK_SANITIZE="$san" \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
        -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
        -DMK_WITH_CUTLASS=OFF -DMK_BUILD_TESTS=ON > "$dir/sanitize-cmake.log" 2>&1 ||
    { cat "$dir/sanitize-cmake.log"; exit 1; }
  # The executables defined in tests/cpu are exactly what label cpu runs.
  mapfile -t targets < <(ninja -C "$dir" -t targets all |
                         sed -n 's|^\(tests/cpu/[^/:]*\): CXX_EXECUTABLE_LINKER.*|\1|p')
  if [[ $kind == tsan ]]; then  # what TSan does not run, it does not build
    mapfile -t targets < <(printf '%s\n' "${targets[@]}" |
                           grep -vxE "tests/cpu/($(IFS='|'; echo "${tsan_single_threaded[*]}"))" || true)
  fi
  if ((${#targets[@]} == 0)); then
    echo "sanitize: no cpu test targets in $dir (GoogleTest missing? see $dir/sanitize-cmake.log)" >&2
    exit 1
  fi
  nice ninja -C "$dir" -j "$jobs" "${targets[@]}"
  t1=$(date +%s)

  rm -rf "$logs" && mkdir -p "$logs"
  sanitizer_env "$kind" "$logs"
  prefix=()
  [[ $kind == tsan ]] && prefix=("${tsan_prefix[@]}")
  # The ranks must see the options: one rank prints what it got.
  got=$("${prefix[@]}" mpirun --allow-run-as-root --oversubscribe -np 2 \
        sh -c 'echo "${ASAN_OPTIONS:-}${TSAN_OPTIONS:-}"' 2>/dev/null | head -1)
  if [[ $got != "${ASAN_OPTIONS:-}${TSAN_OPTIONS:-}" ]]; then
    echo "sanitize: mpirun does not pass the sanitizer options to its ranks (got '$got')" >&2
    exit 1
  fi
  echo "== sanitize: $kind: run the cpu tests (reports: $logs)"
  # Label torch: Python loading the instrumented C ABI library would need the sanitizer runtime
  # preloaded into the interpreter; those tests run unsanitized in scripts/test.sh.
  args=(--test-dir "$dir" -L cpu -LE torch --output-on-failure --no-tests=error)
  [[ -n ${MK_SAN_TESTS:-} ]] && args+=(-R "$MK_SAN_TESTS")
  if [[ $kind == tsan ]] && ((${#tsan_single_threaded[@]})); then
    args+=(-E "^($(IFS='|'; echo "${tsan_single_threaded[*]}"))\$")
  fi
  rc=0
  "${prefix[@]}" ctest "${args[@]}" 2>&1 | tee "$logs/ctest.out" || rc=$?
  reports() {
    find "$logs" -maxdepth 1 -type f -name '[at]san.*' | sort
    grep -l "runtime error:" "$logs"/ctest*.out 2>/dev/null || true
  }
  retried=""
  if ((rc != 0)) && [[ ${MK_SAN_RETRY:-1} == 1 ]] && [[ -z $(reports) ]]; then
    retried=$(cut -d: -f2 "$dir/Testing/Temporary/LastTestsFailed.log" 2>/dev/null | xargs)
    echo "== sanitize: $kind: failed without a sanitizer report, run again once: $retried"
    rc=0
    "${prefix[@]}" ctest "${args[@]}" --rerun-failed 2>&1 | tee "$logs/ctest-rerun.out" || rc=$?
  fi
  mapfile -t files < <(reports)
  unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS MK_TEST_STRIDE

  # Every report is printed; a report fails the stage unless it comes from a test listed in
  # tsan_known_races (matched by the binary's name in the report's frames).
  findings=0
  for f in "${files[@]}"; do
    echo "---- $f"
    if [[ $f == *.out ]]; then grep -A12 "runtime error:" "$f" | head -200; else head -c 20000 "$f"; fi
    known=0
    if [[ $kind == tsan ]]; then
      for t in "${tsan_known_races[@]}"; do
        grep -qE "[(/ ]$t[+ )]" "$f" && known=1
      done
    fi
    if ((known)); then echo "(known race, listed in tsan_known_races: not failing)"; else findings=$((findings + 1)); fi
  done
  t2=$(date +%s)
  line="$kind: build $((t1 - t0)) s, tests $((t2 - t1)) s (MK_TEST_STRIDE ${MK_SAN_STRIDE:-4}), ctest rc=$rc, sanitizer reports ${#files[@]} (failing $findings)"
  [[ -n $retried ]] && line+=", rerun once: $retried"
  summary+=("$line")
  if ((rc != 0 || findings != 0)); then status=1; fi
done

echo "== sanitize: summary"
printf '  %s\n' "${summary[@]}"
((status == 0)) && echo "sanitize: clean" || echo "sanitize: FAILED"
exit $status
