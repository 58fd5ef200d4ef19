#!/usr/bin/env bash
# The main job: set up, build, then `mkernel doctor` and `mkernel selfcheck` — as threads of
# one process, and (when mpirun is there) as processes, which maps memory between processes.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
"$root/scripts/setup.sh"
build=${MK_BUILD_DIR:-build}
"$build/mkernel" doctor
echo
echo "== selfcheck: ranks as threads"
"$build/mkernel" selfcheck
if command -v mpirun >/dev/null 2>&1; then
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  np=$(( ngpu > 2 ? ngpu : 2 ))
  echo
  echo "== selfcheck: $np ranks as processes (mpirun)"
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$build/mkernel" selfcheck
fi
# The fused operators' benchmark: a short default sweep of ag_gemm, gemm_rs and gemm_ar
# (correctness check, then fused vs cuBLAS + NCCL), then ring attention (S/rank 4096 and 8192,
# vs NCCL all-gather + attention and a send/recv ring), then MoE dispatch/combine (DeepEP, Qwen3
# and Mixtral shapes vs NCCL all-to-all-v). Needs a GPU; one rank per GPU under mpirun.
if nvidia-smi -L >/dev/null 2>&1; then
  echo
  ngpu=$(nvidia-smi -L | wc -l)
  if (( ngpu > 1 )) && command -v mpirun >/dev/null 2>&1; then
    echo "== bench: fused operators, $ngpu ranks (one per GPU)"
    mpirun --allow-run-as-root --bind-to none -np "$ngpu" "$build/mkernel" bench all --reps 10
    mpirun --allow-run-as-root --bind-to none -np "$ngpu" "$build/mkernel" bench ring_attention --reps 10
    mpirun --allow-run-as-root --bind-to none -np "$ngpu" "$build/mkernel" bench moe_dispatch --reps 10
  else
    echo "== bench: fused operators, one rank"
    "$build/mkernel" bench all --reps 10
    "$build/mkernel" bench ring_attention --reps 10
    "$build/mkernel" bench moe_dispatch --reps 10
  fi
else
  echo
  echo "== bench: skipped (no GPU here): the fused operators need an sm_90 GPU"
fi
