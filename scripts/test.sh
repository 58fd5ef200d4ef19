#!/usr/bin/env bash
# The test suite: set up and build (scripts/setup.sh), then every test. Tests labelled gpu
# report "skipped" on a machine without a GPU. Several ranks on one GPU run side by side
# only under MPS (nvidia-cuda-mps-control -d); see docs/testing.md.
#   MK_TEST_LABELS=regex  run only tests whose label matches (e.g. 'cpu|mpi')
#   MK_SKIP_PYTHON=1      leave out scripts/python_setup.sh (torch, and the package by pip
#                         install .): the torch tests then report skipped
#   MK_SKIP_CONSUMER=1    leave out the last step: the CMake package check
#                         (scripts/consumer_check.sh: install this build, build tests/consumer)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
"$root/scripts/setup.sh"
if [[ ${MK_SKIP_PYTHON:-0} != 1 ]]; then
  "$root/scripts/python_setup.sh"
fi
# The include graph against the layer order of docs/architecture.md ("Layers"); fails fast on an upward include.
python3 "$root/scripts/check_layers.py"
build=${MK_BUILD_DIR:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(--test-dir "$build" --output-on-failure --no-tests=error)
if [[ -n ${MK_TEST_LABELS:-} ]]; then
  args+=(-L "$MK_TEST_LABELS")
elif ! nvidia-smi -L >/dev/null 2>&1; then
  # No GPU: the gpu tests are not run (and so not counted as passed); say which.
  echo "test: no GPU on this machine: these tests (label gpu) are SKIPPED, not run:"
  ctest --test-dir "$build" -N -L gpu | grep -E "Test +#" | sed 's/^/  /'
  args+=(-LE gpu)
fi
ctest "${args[@]}"

# The installed CMake package, from the build above (nothing is rebuilt).
if [[ ${MK_SKIP_CONSUMER:-0} != 1 ]]; then
  MK_BUILD_DIR=$build "$root/scripts/consumer_check.sh"
fi
