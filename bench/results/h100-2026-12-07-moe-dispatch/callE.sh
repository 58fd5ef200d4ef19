#!/usr/bin/env bash
# Call E (2026-12-07): what calls C/D of 2026-12-06 left (matrix ring launches with their logs,
# the torch MoE layer's derived bound, MoE units in every layout, matrix collectives launches),
# plus: ncu per-kernel durations of MoE dispatch/combine (deepep_ll, 128 tokens) and of the MoE
# layer (qwen3_30b, 128 tokens); dispatch at 128 tokens alternating (moe_small_tokens, pdl);
# a traced uneven ring call (rows 3500,4692, W 2 under MPS). Steps in priority order, each
# skipped when the call's time would run out. Logs: $OUT/logs.tgz.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
B=/tmp/mkb
L=/tmp/c; mkdir -p $L
keep() { tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
el() { echo $(( $(date +%s) - t0 )); }
LIMIT=${LIMIT:-575}
fits() { (( $(el) + $1 < LIMIT )) || { echo "-- skipped $2 at $(el) s (time)"; return 1; }; }
mps_on() { echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 || nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; sleep 1; }
[ -x $B/mkernel ] || MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^setup"
export PYTHONPATH=$PWD/python
echo "== matrix ring launches at $(el) s"
mps_on
MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/matrix_ring MK_MATRIX_FILTER='Matrix.RingAttention*' MK_MATRIX_SPLIT=static \
  MK_MATRIX_ONLY='^(1x2-|1x4-|2x2-shm|4x1-tcp)' timeout 100 bash scripts/device/matrix_check.sh 2>&1 \
  | grep -E "^(PASS|FAIL|matrix)" | head -10
f=$(ls $L/matrix_ring/*1x2* 2>/dev/null | head -1)
[ -n "$f" ] && { grep -E "Failure|FAILED|rror|expected|Which is|Value of|Actual" $f | head -14; tail -20 $f | cut -c1-240; }
keep
cat > $L/ncu_sum.py <<'PY'
import csv, sys, statistics, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: sys.exit("no ncu rows")
h = rows[0]; d = collections.OrderedDict()
ki, vi = h.index("Kernel Name"), h.index("Metric Value")
for r in rows[1:]:
    d.setdefault(r[ki][:90], []).append(float(r[vi].replace(",", "")))
for k, v in d.items(): print(f"{statistics.median(v)/1000:9.2f} us  n {len(v):3d}  {k}")
PY
ncu_one() {  # name, timeout, then the mkernel bench arguments
  local n=$1 to=$2; shift 2
  fits $to "ncu $n" || return
  echo "== ncu $n at $(el) s"
  timeout $to ncu --clock-control none --print-units base --metrics gpu__time_duration.sum --csv $B/mkernel bench "$@" \
    > $L/ncu_$n.csv 2>$L/ncu_$n.err; echo "ncu rc=$?"
  python3 $L/ncu_sum.py $L/ncu_$n.csv 2>&1 | head -22; tail -2 $L/ncu_$n.err
  keep
}
mps_off
ncu_one deepep 100 moe_dispatch --preset deepep_ll --tokens 128 --reps 5 --warmup 2
if fits 90 "dispatch A/B"; then
  echo "== MoE dispatch at 128 tokens, W 1: (moe_small_tokens, pdl) alternating at $(el) s"
  for rep in 1 2; do for v in "256 1" "256 0" "0 1" "0 0"; do
    set -- $v
    MK_MOE_SMALL_TOKENS=$1 MK_PDL=$2 timeout 30 $B/mkernel bench moe_dispatch --preset deepep_ll --preset qwen3 \
      --preset mixtral --tokens 128 --reps 50 2>&1 | grep -E "^(deepep_ll|qwen3|mixtral) " | sed "s/^/small $1 pdl $2  /"
  done; done
  keep
fi
ncu_one layer128 120 moe_layer --preset qwen3_30b --tokens 128 --reps 3 --warmup 1
if fits 40 "layer bench"; then
  echo "== layer qwen3_30b 128 tokens W 1 at $(el) s"
  timeout 40 $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 30 --json $OUT/layer128.json 2>&1 | tail -3
fi
mps_on
if fits 120 "torch np2"; then
  echo "== torch np2 at $(el) s"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 MK_CAPI=$B/libmkernel_capi.so timeout 120 \
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/test_torch_ops.py > $L/torch_np2.log 2>&1
  echo "torch np2 rc=$?"; grep -E "FAIL|moe_layer|test_torch_ops " $L/torch_np2.log | cut -c1-300 | head -8
  keep
fi
if fits 45 "ring trace"; then
  echo "== traced uneven ring W 2 (MPS) at $(el) s"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 45 mpirun -np 2 $B/mkernel bench ring_attention --rows 3500,4692 \
    --reps 10 --trace $L/ringtr 2>&1 | grep -E "^ +[0-9]|uneven|trace" | head -8
  keep
fi
if fits 150 "MoE units"; then
  echo "== MoE units, every layout, at $(el) s"
  MK_SUITE_STEPS="unit" MK_UNIT_ONLY='test_gpu_moe' timeout 150 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
  cp -r /tmp/mk-suite $L/suite 2>/dev/null; mps_on; keep
fi
if fits 100 "matrix collectives"; then
  echo "== matrix collectives launches at $(el) s"
  MK_BUILD_DIR=$B MK_MATRIX_LOGS=$L/matrix_coll MK_MATRIX_FILTER='Matrix.Collectives*' MK_MATRIX_SPLIT=static \
    MK_MATRIX_ONLY='^(1x2-|1x4-|2x2-shm|4x1-tcp)' timeout 100 bash scripts/device/matrix_check.sh 2>&1 \
    | grep -E "^(PASS|FAIL|matrix)" | head -10
  keep
fi
if fits 120 "torch np4"; then
  echo "== torch np4 at $(el) s"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 MK_CAPI=$B/libmkernel_capi.so timeout 120 \
    python3 -m torch.distributed.run --standalone --nproc-per-node 4 tests/gpu/test_torch_ops.py > $L/torch_np4.log 2>&1
  echo "torch np4 rc=$?"; grep -E "FAIL|moe_layer|test_torch_ops " $L/torch_np4.log | cut -c1-300 | head -8
  keep
fi
echo "done at $(el) s"
