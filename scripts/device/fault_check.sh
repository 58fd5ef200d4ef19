#!/usr/bin/env bash
# Failures on the GPU machine, in one call (issue: a failure never hangs the job):
#   setup  binaries from .devbin (scripts/device/pack_binaries.sh) into /tmp/mkb
#   udp    the 5-emulated-node gemm_rs job over udp;ofi_rxd that hung before (mpirun -np 5,
#          MPS at 20 % each): .devbin-orig/mkernel.tar.xz (an earlier build, when carried) with the
#          ranks' stacks taken by cuda-gdb while it hangs; then this build twice as a user runs
#          it, and once with rxd's old window (FI_OFI_RXD_MAX_UNACKED=128) to show that a failure
#          there still ends every rank
#   api    tests/gpu/fault_check.py --modes api: the fault table through the public API
#   cli    tests/gpu/fault_check.py --modes cli: the same faults through `mpirun mkernel bench`
#   dead   the silent-rank GPU tests (fused, ring, MoE) under ctest
# MK_FAULT_STEPS picks steps (default "setup udp api"); logs and tables under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/mk-out}
mkdir -p "$OUT"
L=/tmp/mk-fault
rm -rf "$L" && mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/fault_logs.tgz" . 2>/dev/null' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=/tmp/mkb
steps=${MK_FAULT_STEPS:-"setup udp api"}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
summary=()
note() { summary+=("$1"); echo "$1"; }

mps_on() { echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; }

step_setup() {
  rm -rf "$B" && mkdir -p "$B" && tar -C "$B" -xJf .devbin/bins.tar.xz
  mapfile -t origin < .devbin/origin.txt
  find "$B" -name CTestTestfile.cmake -print0 | xargs -0 sed -i -e "s#${origin[0]}#$B#g" -e "s#${origin[1]}#$PWD#g" \
    -e "s#\"[^\"]*/python3[.0-9]*\"#\"$(command -v python3)\"#g"
  if [[ -f .devbin-orig/mkernel.tar.xz ]]; then mkdir -p /tmp/mkorig && tar -C /tmp/mkorig -xJf .devbin-orig/mkernel.tar.xz; fi
  note "setup: binaries of ${origin[3]:0:12} ($(elapsed) s); mpirun $(mpirun --version 2>&1 | head -1);" \
       " ofi components: $(ompi_info 2>/dev/null | grep -ci ofi)"
}

# One 5-rank udp job: label, binary, time limit, extra mpirun args. Prints rc and seconds; with
# MK_STACKS_AT=s, takes every rank's stacks with cuda-gdb once the job has run s seconds.
udp_job() {
  local label=$1 exe=$2 limit=$3; shift 3
  local log="$L/udp_$label.log" s=$(date +%s)
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 timeout -s KILL "$limit" mpirun --oversubscribe -np 5 \
    -x MK_RANKS_PER_NODE=1 -x MK_NET_PROVIDER=udp_rxd -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "$@" \
    "$exe" bench gemm_rs --m 5120 --n 1024 --k 256 --reps 3 > "$log" 2>&1 &
  local job=$!
  if [[ -n ${MK_STACKS_AT:-} ]]; then
    sleep "$MK_STACKS_AT"
    # The ranks alone (their command line starts with the binary; not timeout's or mpirun's).
    local ranks; ranks=$(pgrep -f "^$exe bench gemm_rs")
    if [[ -n $ranks ]]; then
      local gdbs=()
      for p in $ranks; do
        local r; r=$(tr '\0' '\n' < /proc/$p/environ | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
        timeout 40 cuda-gdb -p "$p" -batch -ex "thread apply all bt 14" > "$L/udp_${label}_stacks_rank$r.txt" 2>&1 &
        gdbs+=($!)
      done
      wait "${gdbs[@]}" 2>/dev/null
      note "udp $label: still running after $MK_STACKS_AT s; stacks taken (${#gdbs[@]} ranks)"
      pkill -KILL -f "^$exe bench gemm_rs"
    fi
  fi
  wait $job
  local rc=$?
  note "udp $label: rc $rc after $(( $(date +%s) - s )) s; $(grep -cE 'check: .*ok' "$log") check ok line(s);" \
       " $(grep -c 'job failed' "$log") 'job failed' line(s); left: $(pgrep -fc "^$exe bench") process(es)"
  grep -E "job failed|error|FAILED|check:" "$log" | head -8 | cut -c1-300 | sed 's/^/      /'
}

step_udp() {
  mps_on
  if [[ -x /tmp/mkorig/mkernel && ${MK_UDP_BEFORE:-1} == 1 ]]; then
    MK_STACKS_AT=60 udp_job before /tmp/mkorig/mkernel 100
    for f in "$L"/udp_before_stacks_rank*.txt; do
      [[ -f $f ]] || continue
      echo "== $(basename "$f")"; grep -E "^#[0-9]+ " "$f" | grep -vE "pthread_cond|futex|__GI_|clock_nanosleep|poll \(|epoll" | head -12
    done
  fi
  udp_job after1 "$B/mkernel" 120
  [[ ${MK_UDP_TWICE:-0} == 1 ]] && udp_job after2 "$B/mkernel" 120
  udp_job window128 "$B/mkernel" 120 -x FI_OFI_RXD_MAX_UNACKED=128
}

step_api() {
  mps_on
  timeout 420 python3 tests/gpu/fault_check.py --build "$B" --out "$OUT/api" --modes api --budget ${MK_FAULT_BUDGET_S:-330} \
    2>&1 | tee "$L/api.log" | grep -vE "^\|"
  note "api: $(tail -1 "$L/api.log")"
}

step_cli() {
  mps_on
  # Every fault, layout and operator family, as a user runs them (mpirun mkernel bench).
  timeout 420 python3 tests/gpu/fault_check.py --build "$B" --out "$OUT/cli" --modes cli \
    --budget ${MK_FAULT_CLI_BUDGET_S:-330} 2>&1 | tee "$L/cli.log" | grep -vE "^\|"
  note "cli: $(tail -1 "$L/cli.log")"
}

step_dead() {
  mps_on
  for t in test_gpu_fused_gemm_dead_np2 test_gpu_ring_attention_dead_np2 test_gpu_moe_dead_np2; do
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 ctest --test-dir "$B" -R "^$t\$" --output-on-failure > "$L/$t.log" 2>&1
    note "dead: $t rc $? $(grep -oE '[0-9]+% tests passed' "$L/$t.log")"
  done
}

for s in $steps; do
  if declare -F "step_$s" >/dev/null; then "step_$s"; else note "unknown step $s"; fi
done
mps_off
cp "$OUT"/api/faults.md "$OUT"/faults_api.md 2>/dev/null
cp "$OUT"/cli/faults.md "$OUT"/faults_cli.md 2>/dev/null
echo "==== summary ($(elapsed) s)"
printf '%s\n' "${summary[@]}"
