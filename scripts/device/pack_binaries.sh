#!/usr/bin/env bash
# Packs what the GPU machine needs to run the GPU tests and the CLI without building there:
# the test binaries, the mkernel CLI, the C ABI library, the GPU benchmarks and ctest's test files, from the build
# folder (default build/, built here for sm_90a), into .devbin/bins.tar.xz (git-ignored; send it
# with carry). One solid xz archive: the binaries share most of their bytes (the kernels), so
# it stays small. On the GPU machine scripts/device/suite.sh unpacks it into /tmp/mkb and
# rewrites ctest's paths; it builds there instead when the archive is absent.
# MK_PACK_SLIM=1 packs only what the suite's compare step runs (mkernel, the C ABI library,
# bench_gemm, bench_host_call): the full pack and .devbin-before together are over the 64 MiB
# a device call carries. MK_PACK_ONLY (below) keeps a subset of the tests.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
build=${MK_BUILD_DIR:-build}
out=.devbin
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out"
files=(mkernel libmkernel_capi.so CTestTestfile.cmake tests/CTestTestfile.cmake tests/cpu/CTestTestfile.cmake
       tests/gpu/CTestTestfile.cmake)
for f in "$build"/tests/gpu/test_gpu_* "$build"/tests/gpu/fault_rank; do [[ -x $f && ! -d $f ]] && files+=("${f#$build/}"); done
# The benchmarks that run on the GPU, when built.
for f in bench/bench_gemm bench/bench_grouped bench/bench_host_call bench/bench_gpu_proxy bench/bench_peer_write bench/bench_fused_threads bench/bench_comm_ops; do [[ -x $build/$f ]] && files+=("$f"); done
[[ ${MK_PACK_SLIM:-0} == 1 ]] && files=(mkernel libmkernel_capi.so bench/bench_gemm bench/bench_host_call)
# MK_PACK_ONLY=REGEX: of the test binaries and benchmarks, only those whose path matches (the CLI,
# the C ABI library and ctest's files always): a pack that fits the 64 MiB a call carries when
# the whole set (about 60 MiB) and the GPU mutants would not.
if [[ -n ${MK_PACK_ONLY:-} ]]; then
  keep=()
  for f in "${files[@]}"; do
    case $f in
      mkernel|libmkernel_capi.so|*CTestTestfile.cmake) keep+=("$f") ;;
      *) [[ $f =~ $MK_PACK_ONLY ]] && keep+=("$f") ;;
    esac
  done
  files=("${keep[@]}")
fi
for f in "${files[@]}"; do [[ -e $build/$f ]] || { echo "pack: $build/$f missing (build first)" >&2; exit 1; }; done
# MK_PACK_MUTANTS=DIR: also the GPU mutations' binaries (scripts/mutation_check.py --build-only DIR),
# as mutants/<name>/<path>, each right after its unmutated binary (the solid archive then stores
# little more than their differences); suite.sh's mutants step runs them.
args=()
build_abs=$(cd "$build" && pwd)
mut=${MK_PACK_MUTANTS:+$(cd "$MK_PACK_MUTANTS" && pwd)}
[[ -z $mut || -f $mut/mutants/mutations.json ]] || { echo "pack: no $mut/mutants/mutations.json" >&2; exit 1; }
for f in "${files[@]}"; do
  args+=(-C "$build_abs" "$f")
  if [[ -n $mut ]]; then
    for m in "$mut"/mutants/*/"$f"; do [[ -f $m ]] && args+=(-C "$mut" "${m#$mut/}"); done
  fi
done
[[ -n $mut ]] && args+=(-C "$mut" mutants/mutations.json)
tar -cf - "${args[@]}" | xz -T2 -9e > "$out/bins.tar.xz"
# Where this build came from: the suite rewrites these paths on the GPU machine.
printf '%s\n%s\n%s\n%s\n' "$root/$build" "$root" "$(command -v python3)" "$(git rev-parse HEAD)" > "$out/origin.txt"
echo "pack: $(du -h "$out/bins.tar.xz" | cut -f1) in $out/bins.tar.xz (${#files[@]} files)"
