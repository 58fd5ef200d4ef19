#!/usr/bin/env bash
# The SM-partition controller on the one-GPU machine from carried binaries (.devbin), in one call:
#   unit   the ctest entries of test_gpu_fused_gemm (W = 1, 2, 4, 2 nodes x 2 over shm and tcp: the
#          controller tests ControllerMatchesReference, ForcedRoleSwitchesMidCall,
#          ControllerGraphReplays, ControllerRefusals among them) via suite.sh
#   matrix test_gpu_matrix in every layout with MK_FUSED_SPLIT=auto (matrix_check.sh)
#   bench  `mkernel bench all --splits` at two shapes per operator in three settings, under MPS:
#          W = 4 on one node (peer stores), 2 nodes x 2 over shm staged, 2 nodes x 2 over tcp
#          staged: each static split {1, 2, 4, 8, 16, 24, 32} and the controller, median of
#          --reps after --warmup; JSON $OUT/splits_<setting>.json
#          The check fails (exit 1) when a row is wrong, or the controller reaches less than
#          MK_CTL_MIN_VS_BEST (default 0.97) of the best static split in any row.
#   MK_CTL_STEPS  "setup unit matrix bench" (default: all)
set -uo pipefail
RESULT=${OUT:-/tmp/mk-out}
mkdir -p "$RESULT"
steps=${MK_CTL_STEPS:-"setup unit matrix bench"}
has() { [[ " $steps " == *" $1 "* ]]; }
B=/tmp/mkb
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
s=""
has setup && s+="setup "
has unit && s+="unit"
[[ -n $s ]] && MK_SUITE_STEPS="$s" MK_UNIT_ONLY="test_gpu_fused_gemm_" bash scripts/device/suite.sh 2>&1 | tail -10
if has matrix; then
  MK_MATRIX_SPLIT=auto MK_MATRIX_LOGS=/tmp/mk-matrix-auto bash scripts/device/matrix_check.sh 2>&1 | tail -25
  tar czf "$RESULT/matrix_auto_logs.tgz" -C /tmp mk-matrix-auto 2>/dev/null
fi
if has bench; then
  nvidia-cuda-mps-control -d
  run() {  # name, env...
    local name=$1; shift
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 timeout 500 mpirun --allow-run-as-root -np 4 "$@" "$B/mkernel" bench all \
      --splits --reps 20 --warmup 5 --json "$RESULT/splits_$name.json" 2>&1 | tail -20
  }
  run w4
  run 2x2_shm -x MK_RANKS_PER_NODE=2 -x MK_NET_PROVIDER=shm -x MK_NET_STAGING=always
  run 2x2_tcp -x MK_RANKS_PER_NODE=2 -x MK_NET_PROVIDER=tcp_rxm -x MK_NET_STAGING=always
  echo quit | nvidia-cuda-mps-control
  # The gate: every row correct, the controller within MK_CTL_MIN_VS_BEST of the best split.
  python3 - "$RESULT" "${MK_CTL_MIN_VS_BEST:-0.97}" <<'PY' || rc=1
import glob, json, os, sys
out, floor = sys.argv[1], float(sys.argv[2])
bad, rows = [], 0
for path in sorted(glob.glob(os.path.join(out, "splits_*.json"))):
    doc = json.load(open(path))
    for r in doc.get("results", doc.get("rows", [])):
        if "controller_vs_best" not in r:
            continue
        rows += 1
        what = f"{os.path.basename(path)} {r['op']} {r['M']}x{r['N']}x{r['K']}"
        v = r["controller_vs_best"]
        print(f"  {what}: controller {v} of the best split ({r['best_static_split']} CTAs), "
              f"{r['controller_vs_default']} of the default")
        if not r.get("correct", False):
            bad.append(f"{what}: wrong result")
        elif v is None or v < floor:
            bad.append(f"{what}: controller {v} < {floor} of the best split")
if rows == 0:
    bad.append("no row with a controller figure (did the bench step run?)")
for b in bad:
    print("controller_check: FAIL:", b)
sys.exit(1 if bad else 0)
PY
fi
exit ${rc:-0}
