#!/usr/bin/env bash
# Installs mkernel's dependencies (Debian/Ubuntu packages and pip), then configures and
# builds into build/. Safe to re-run: installs only what is missing.
#   MK_SKIP_INSTALL=1   build only (a machine whose dependencies come another way)
#   MK_BUILD_DIR=dir    build directory (default build)
#   MK_JOBS=n           parallel build jobs (default: all cores)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=${MK_BUILD_DIR:-build}
jobs=${MK_JOBS:-$(nproc)}

need_sudo() { if [[ $(id -u) -ne 0 ]]; then echo sudo; fi; }

if [[ ${MK_SKIP_INSTALL:-0} != 1 ]]; then
  pkgs=(cmake ninja-build g++ pkg-config ccache libopenmpi-dev openmpi-bin libfabric-dev
        libfabric-bin googletest libgtest-dev python3-pip)
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    $(need_sudo) apt-get update -q
    DEBIAN_FRONTEND=noninteractive $(need_sudo) apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  if ! python3 -c 'import cutlass_library' 2>/dev/null; then
    echo "setup: installing CUTLASS 4.2 headers (pip nvidia-cutlass, no deps)"
    python3 -m pip install -q --no-deps nvidia-cutlass==4.2.0.0 ||
      python3 -m pip install -q --no-deps --break-system-packages nvidia-cutlass==4.2.0.0
  fi
fi

if ! command -v nvcc >/dev/null 2>&1; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
  else
    echo "setup: nvcc not found: install the CUDA toolkit (>= 12.4; 13.0 tested) first" >&2
    exit 1
  fi
fi

# Compiler-cache keys independent of the build folder's path (relative to the tree, no working
# directory): build/ here and build-pip/ of `pip install .` (scripts/python_setup.sh) share them.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
cmake -S . -B "$build" -G Ninja -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" ${MK_CMAKE_ARGS:-}
ninja -C "$build" -j "$jobs"
