#!/usr/bin/env bash
# Packs what the GPU machine lacks into .devcarry/ (git-ignored): the workplace's CUTLASS and
# libfabric headers (../shared/device/prepare-carry.sh), plus GoogleTest sources and OpenMPI
# headers, which the GPU machine's image may not have. Run from the project root, then send
# .devcarry along and start there with: source .devcarry/env.sh && source .devcarry/extra-env.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
bash ../shared/device/prepare-carry.sh
stage=$(mktemp -d)
mkdir -p "$stage/googletest" "$stage/mpi"
cp -r /usr/src/googletest/. "$stage/googletest/"
cp -r /usr/lib/x86_64-linux-gnu/openmpi/include/. "$stage/mpi/"
tar -C "$stage" -cJf .devcarry/extra.tar.xz .
rm -rf "$stage"
cat > .devcarry/extra-env.sh <<'EOS'
# sourced on the GPU machine after env.sh
mkdir -p /tmp/mkextra && tar -C /tmp/mkextra -xJf .devcarry/extra.tar.xz
export MK_GTEST_SOURCE_DIR=/tmp/mkextra/googletest
if ! mpicc --showme:incdirs >/dev/null 2>&1 || [[ ! -f $(mpicc --showme:incdirs 2>/dev/null | awk '{print $1}')/mpi.h ]]; then
  lib=$(ls /usr/lib/x86_64-linux-gnu/libmpi.so.40* /usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi.so.40* 2>/dev/null | head -1 || true)
  if [[ -n $lib ]]; then
    mkdir -p /tmp/mkextra/lib && ln -sf "$lib" /tmp/mkextra/lib/libmpi.so
    export MK_MPI_INCLUDE_DIR=/tmp/mkextra/mpi MK_MPI_LIBRARY=/tmp/mkextra/lib/libmpi.so
  fi
fi
EOS
du -sh .devcarry
