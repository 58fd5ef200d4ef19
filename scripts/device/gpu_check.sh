#!/usr/bin/env bash
# One call on the GPU machine: build, run the test suite (ranks as processes under MPS),
# the selfcheck, and keep the logs under $OUT. Usage (from the project root, .devcarry sent):
#   bash scripts/device/gpu_check.sh
set -uo pipefail
# Logs go to $LOGS and come back packed as $OUT/logs.tgz (the tool returns few files).
RESULT=${OUT:-/tmp/mk-out}
OUT=/tmp/mk-logs
rm -rf "$OUT" && mkdir -p "$OUT" "$RESULT"
trap 'tar -C "$OUT" -czf "$RESULT/logs.tgz" .' EXIT
source .devcarry/env.sh
source .devcarry/extra-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv; nproc
  mpirun --version | head -1; mpicc --showme:incdirs 2>&1 | head -1
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
t0=$(date +%s)
MK_SKIP_INSTALL=1 MK_JOBS=16 bash scripts/setup.sh > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"; grep -E "mkernel:|error" "$OUT/build.log" | head -20
[[ $rc -eq 0 ]] || { tail -40 "$OUT/build.log"; exit 1; }
build/mkernel doctor > "$OUT/doctor.txt" 2>&1; sed -n '/GPUs/,/MPS/p' "$OUT/doctor.txt"

build/mkernel selfcheck > "$OUT/selfcheck_threads.log" 2>&1
echo "selfcheck threads rc=$?"; grep -E "signals|symmetric|FAILED|bootstrap|passed" "$OUT/selfcheck_threads.log" | head -6

# The GEMM's machine code: wgmma (HGMMA) must be there, and no spills.
cuobjdump -sass build/CMakeFiles/mkernel.dir/src/gemm/sm90_gemm_bf16.cu.o 2>/dev/null | grep -cE "HGMMA" | sed 's/^/HGMMA instructions: /'
cuobjdump -res-usage build/CMakeFiles/mkernel.dir/src/gemm/sm90_gemm_bf16.cu.o 2>/dev/null | grep -A1 persistent_gemm | tail -1
build/bench/bench_gemm --json "$OUT/bench_gemm.json" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"; cat "$OUT/bench_gemm.log"

# Single-process tests first, without MPS (the planted trap ends that process's context).
ctest --test-dir build -V -L gpu -LE mpi > "$OUT/ctest_single.log" 2>&1
tail -8 "$OUT/ctest_single.log"

nvidia-cuda-mps-control -d && echo "MPS started"
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${MK_MPS_PCT:-25}
ctest --test-dir build -V -L gpu -L mpi -E timeout ${MK_CTEST_ARGS:-} > "$OUT/ctest_mpi.log" 2>&1
grep -E "us per round|replays|mapping mode|GB/s|Test +#|tests passed|FAILED|Failure|rank [0-9]+\] " "$OUT/ctest_mpi.log" | head -60
# GPU-initiated networking benchmark: host-staged over shm and tcp, next to the host limits.
for v in shm:always tcp_rxm:always shm:auto; do
  p=${v%%:*}; st=${v##*:}
  MK_RANKS_PER_NODE=1 MK_NET_PROVIDER=$p MK_NET_STAGING=$st mpirun --bind-to none -np 2 \
    build/bench/bench_gpu_proxy --json "$OUT/bench_gpu_proxy_${p}_$st.json" > "$OUT/bench_gpu_proxy_${p}_$st.log" 2>&1
  echo "bench_gpu_proxy $p staging=$st rc=$?"; tail -12 "$OUT/bench_gpu_proxy_${p}_$st.log"
done
for np in 2 4; do
  mpirun --bind-to none -np $np build/mkernel selfcheck > "$OUT/selfcheck_np$np.log" 2>&1
  echo "selfcheck np=$np rc=$?"; grep -E "signals|symmetric|FAILED|bootstrap" "$OUT/selfcheck_np$np.log" | head -8
done
ctest --test-dir build -V -R timeout > "$OUT/ctest_timeout.log" 2>&1
grep -E "timed out|Test +#|tests passed|Failure" "$OUT/ctest_timeout.log" | head -20
# The README's main command, as a user would run it (MPS still up).
MK_SKIP_INSTALL=1 bash scripts/run.sh > "$OUT/run.log" 2>&1
echo "scripts/run.sh rc=$?"; grep -E "selfcheck|FAILED" "$OUT/run.log" | head -8
echo quit | nvidia-cuda-mps-control
echo "total $(( $(date +%s) - t0 )) s"
