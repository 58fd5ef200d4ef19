#!/usr/bin/env bash
# The CMake package check (scripts/test.sh runs it after the tests): `cmake --install` of a
# build into a temporary prefix, then tests/consumer, a project outside mkernel, configured
# against that prefix (find_package(mkernel CONFIG), mkernel::mkernel), built and run; the
# installed CLI is run too. Exits nonzero on any failed step.
#   scripts/consumer_check.sh [build_dir]
#     MK_BUILD_DIR=dir   reuse that configured build (scripts/test.sh passes its own): only the
#                        installed targets are brought up to date, nothing after a full build
#     build_dir          otherwise configure and build into it (default build-install), with
#                        MK_CMAKE_ARGS appended (e.g. -DMK_WITH_CUTLASS=OFF for a quick build)
#   MK_JOBS=n            build jobs (default: all cores)
#   MK_KEEP_PREFIX=1     keep the temporary prefix and consumer build (the path is printed)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
jobs=${MK_JOBS:-$(nproc)}
say() { echo "consumer_check: $*"; }
die() { echo "consumer_check: FAILED: $*" >&2; exit 1; }

if [[ -n ${MK_BUILD_DIR:-} ]]; then
  build=$MK_BUILD_DIR
  [[ -f $build/CMakeCache.txt ]] || die "MK_BUILD_DIR=$build is not a configured build"
else
  build=${1:-build-install}
  nvcc=$(command -v nvcc || true)
  [[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
  [[ -n $nvcc ]] || die "nvcc not found (the CUDA toolkit is needed to configure; scripts/setup.sh)"
  say "configuring $build"
  # shellcheck disable=SC2086  # MK_CMAKE_ARGS is a list of flags: split on purpose
  cmake -S . -B "$build" -G Ninja -DCMAKE_CUDA_COMPILER="$nvcc" ${MK_CMAKE_ARGS:-}
fi
# The targets cmake/MkInstall.cmake installs.
cmake --build "$build" -j "$jobs" --target mkernel mkernel_capi mkernel_cli

cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
version=$(cache CMAKE_PROJECT_VERSION)
[[ -n $version ]] || die "no project version in $build/CMakeCache.txt"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/mk-consumer.XXXXXX")
if [[ ${MK_KEEP_PREFIX:-0} == 1 ]]; then
  say "keeping $tmp"
else
  trap 'rm -rf "$tmp"' EXIT
fi
prefix=$tmp/prefix

say "installing $build into $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; die "cmake --install"; }
config=$(find "$prefix" -path '*/cmake/mkernel/mkernelConfig.cmake' | head -n 1)
[[ -n $config ]] || die "no mkernelConfig.cmake under $prefix"
for f in include/mkernel/mkernel.h bin/mkernel; do
  [[ -f $prefix/$f ]] || die "$f not installed"
done
for f in libmkernel.a libmkernel_capi.so; do
  [[ -n $(find "$prefix" -name "$f") ]] || die "$f not installed"
done
# The installed CLI starts from the prefix (its run path kept) and reports this version.
cli_out=$("$prefix/bin/mkernel" version) || die "installed bin/mkernel version"
[[ $cli_out == "mkernel $version" ]] || die "installed bin/mkernel says '$cli_out', expected 'mkernel $version'"
say "installed: $(cd "$prefix" && find . -type f -not -path './include/*' | sort | tr '\n' ' ')"

# The consumer: its own build, same C++ compiler as mkernel's, packages from the prefix only
# (the user package registry left out).
say "building tests/consumer against $prefix"
# With the README's and docs/'s C++ snippets (scripts/snippets.py): none may rot.
python3 scripts/snippets.py extract "$tmp/snippets" || die "extracting the snippets"
consumer_args=(-DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DMK_SNIPPETS_DIR="$tmp/snippets")
cxx=$(cache CMAKE_CXX_COMPILER)
[[ -n $cxx ]] && consumer_args+=(-DCMAKE_CXX_COMPILER="$cxx")
cmake -S tests/consumer -B "$tmp/consumer" -G Ninja "${consumer_args[@]}" || die "consumer configure"
found=$(sed -n 's/^mkernel_DIR:PATH=//p' "$tmp/consumer/CMakeCache.txt")
[[ $found == "$(dirname "$config")" ]] || die "consumer found mkernel in '$found', not in $(dirname "$config")"
cmake --build "$tmp/consumer" || die "consumer build"

rc=0
out=$("$tmp/consumer/mkernel_consumer") || rc=$?
echo "$out"
((rc == 0)) || die "consumer exited with $rc"
grep -qx "consumer: mkernel $version (package $version)" <<<"$out" || die "consumer reports another version"
grep -qx "consumer: ok" <<<"$out" || die "consumer did not finish"
# The README's program as a user runs it: "app: ok" with a GPU; without one, one line saying so.
readme_prog=$(find "$tmp/consumer" -maxdepth 1 -name 'snippet_README_*' -type f -executable | head -n 1)
[[ -n $readme_prog ]] || die "the README's program was not built"
rc=0
app_out=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "$readme_prog" 2>&1) || rc=$?
say "README's program: exit $rc: $app_out"
if ((rc == 0)); then
  grep -qx "app: ok" <<<"$app_out" || die "the README's program exited 0 without 'app: ok'"
else
  grep -q "^app: .*no GPU" <<<"$app_out" || die "the README's program failed (exit $rc) with a GPU, or without saying there is none"
fi
# The documented CLI lines that need no GPU, with the installed binary.
python3 scripts/snippets.py cli "$prefix/bin/mkernel" || die "documented CLI lines"
say "ok (mkernel $version: installed, found with find_package, linked, run; snippets compiled)"
