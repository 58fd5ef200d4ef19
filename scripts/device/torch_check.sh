#!/usr/bin/env bash
# mkernel.torch on the GPU machine, in one call: the torch-labelled GPU tests (torchrun at
# W = 1, 2, 4 and 2 emulated nodes x 2 over tcp), the example, and bench/bench_torch.py at
# W = 1, 2, 4 (JSON per run). Logs and JSON are packed into $OUT/torch_logs.tgz.
# The package comes from the tree (python/ on the path) with the carried C ABI library
# (.devbin, scripts/device/pack_binaries.sh; MK_CAPI points at it); the machine has torch.
#   MK_TORCH_STEPS   "setup unit bench" (default: all, in that order)
#   MK_TORCH_ONLY    regex: the unit tests to run (default: every test labelled torch)
#   MK_TORCH_NPS     world sizes of the bench (default "1 2 4")
#   MK_TORCH_BENCH   extra bench arguments (default "--tokens 4096 --reps 50 --warmup 10")
# On one GPU the ranks share it under MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / W).
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
L=/tmp/mk-torch
rm -rf "$L" && mkdir -p "$L" "$RESULT"
trap 'tar -C "$L" -czf "$RESULT/torch_logs.tgz" . 2>/dev/null' EXIT
steps=${MK_TORCH_STEPS:-"setup unit bench"}
has() { [[ " $steps " == *" $1 "* ]]; }
export B=/tmp/mkb OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if has setup; then MK_SUITE_STEPS=setup bash scripts/device/suite.sh 2>&1 | tail -1; fi
export MK_CAPI=$B/libmkernel_capi.so
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
ngpu=$(nvidia-smi -L | wc -l)
started=0
if ((ngpu == 1)) && ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
  nvidia-cuda-mps-control -d && started=1
fi
pct() { if ((ngpu == 1 && $1 > 1)); then echo $((100 / $1)); else echo 100; fi; }
if has unit; then
  mapfile -t tests < <(ctest --test-dir "$B" -N -L torch | sed -n 's/^ *Test *#[0-9]*: //p' | grep -v _cpu)
  for t in "${tests[@]}"; do
    [[ -n ${MK_TORCH_ONLY:-} && ! $t =~ ${MK_TORCH_ONLY} ]] && continue
    np=$(sed -n 's/.*_np\([0-9]*\)$/\1/p' <<<"$t"); np=${np:-1}
    s=$(date +%s)
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$(pct "$np") timeout 560 ctest --test-dir "$B" -R "^${t}\$" --output-on-failure -V \
      > "$L/unit_$t.log" 2>&1
    if grep -q "100% tests passed" "$L/unit_$t.log"; then r=PASS; else r=FAIL; fi
    echo "unit $r $t $(( $(date +%s) - s )) s"
    grep -E "(PASS|FAIL) |test_torch_ops |rank [0-9]+/" "$L/unit_$t.log" | sed 's/^[0-9]*: //' | cut -c1-220 | head -20
    [[ $r == FAIL ]] && grep -E "Error|error|Traceback" "$L/unit_$t.log" | head -8
  done
fi
if has bench; then
  read -r -a BA <<< "${MK_TORCH_BENCH:-"--tokens 4096 --reps 50 --warmup 10"}"
  for np in ${MK_TORCH_NPS:-1 2 4}; do
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$(pct "$np") timeout 300 python3 -m torch.distributed.run --standalone \
      --nproc-per-node "$np" bench/bench_torch.py "${BA[@]}" --out "$L/bench_torch_w$np.json" > "$L/bench_w$np.log" 2>&1
    echo "bench W=$np rc=$?"
    grep -vE "Warning|warn|^\s*$" "$L/bench_w$np.log" | tail -12
    cp "$L/bench_torch_w$np.json" "$RESULT/" 2>/dev/null
  done
fi
((started)) && echo quit | nvidia-cuda-mps-control
exit 0
