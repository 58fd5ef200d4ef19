#!/usr/bin/env bash
# The CPU proxy benchmark on the GPU machine's 16 cores (the proxy and the waiting thread of
# each rank then have cores of their own). Logs and JSON come back as $OUT/proxy_bench.tgz.
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
OUT=/tmp/mk-pb
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULT"
trap 'tar -C "$OUT" -czf "$RESULT/proxy_bench.tgz" .' EXIT
source .devcarry/env.sh
source .devcarry/extra-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S . -B build -G Ninja > "$OUT/cmake.log" 2>&1 && ninja -C build -j16 bench_proxy > "$OUT/build.log" 2>&1
echo "build rc=$?"; lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/cpu.txt"
build/bench/bench_proxy drain --json "$OUT/drain.json" 2>&1 | tee "$OUT/drain.log" | tail -8
for p in shm tcp_rxm; do
  MK_NET_PROVIDER=$p mpirun --bind-to none -np 2 build/bench/bench_proxy latency --json "$OUT/latency_$p.json" \
    > "$OUT/latency_$p.log" 2>&1
  echo "latency $p rc=$?"; tail -12 "$OUT/latency_$p.log"
done
