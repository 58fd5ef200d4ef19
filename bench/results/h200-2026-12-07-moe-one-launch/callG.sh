#!/usr/bin/env bash
# Call G (written 2026-12-07; the one-launch W = 1 dispatch added 2026-12-07 later): after the commits that followed calls E/F —
# route_pack's CTA 0 staging ids through shared memory (not yet run on a GPU), the matrix's zero-dQ
# check, the ring trace names, the smoke line rs_m3001. Steps: MoE units (every layout) first (the
# changed kernel), dispatch A/B at 128 tokens with ncu, the traced uneven ring (both ranks now),
# 8x1-udp ring backward alone (three times), then the CLI smoke list with its logs kept.
# Logs: $OUT/logs.tgz, $OUT/smoke.tgz. The full matrix: callH.sh, the next call.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s); B=/tmp/mkb; L=/tmp/g; mkdir -p $L
el() { echo $(( $(date +%s) - t0 )); }
keep() { tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
echo "== MoE units at $(el) s"
MK_SUITE_STEPS="unit" MK_UNIT_ONLY='test_gpu_moe' timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1
echo "== dispatch 128 tokens W 1 at $(el) s"
for rep in 1 2; do for v in "256 1" "256 0" "0 0"; do set -- $v
  MK_MOE_SMALL_TOKENS=$1 MK_MOE_LOCAL_DISPATCH=$2 timeout 30 $B/mkernel bench moe_dispatch --preset deepep_ll --preset qwen3 --preset mixtral \
    --tokens 128 --reps 50 2>&1 | grep -E "^(deepep_ll|qwen3|mixtral) " | sed "s/^/small $1 one_launch $2  /"
done; done
timeout 100 ncu --clock-control none --print-units base --metrics gpu__time_duration.sum --csv $B/mkernel bench moe_dispatch \
  --preset deepep_ll --tokens 128 --reps 5 --warmup 2 > $L/ncu_deepep.csv 2>/dev/null
python3 - $L/ncu_deepep.csv <<'PY'
import csv, sys, statistics, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; d = collections.OrderedDict()
for r in rows[1:]: d.setdefault(r[h.index("Kernel Name")][:60], []).append(float(r[h.index("Metric Value")].replace(",", "")))
for k, v in d.items(): print(f"{statistics.median(v)/1000:9.2f} us  n {len(v):3d}  {k}")
PY
keep
nvidia-cuda-mps-control -d
echo "== traced uneven ring W 2 at $(el) s"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 45 mpirun -np 2 $B/mkernel bench ring_attention --rows 3500,4692 --reps 10 \
  --trace $L/ringtr 2>&1 | grep -E "uneven|trace" | head -8; keep
echo "== 8x1-udp ring backward x3 at $(el) s"
for i in 1 2 3; do
  MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/udp$i MK_MATRIX_FILTER='Matrix.RingAttentionBackwardEveryLayout' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY='^8x1-udp' timeout 60 bash scripts/device/matrix_check.sh 2>&1 | grep -E "^(PASS|FAIL)"
done; keep
echo "== CLI smoke list at $(el) s"
MK_BUILD_DIR=$B timeout 200 bash scripts/device/cli_smoke.sh 2>&1 | grep -E "^FAIL|cli_smoke:|^     \|" | head -30
tar czf $OUT/smoke.tgz -C /tmp/mk-smoke . 2>/dev/null
echo "done at $(el) s (the full matrix is callH.sh)"
