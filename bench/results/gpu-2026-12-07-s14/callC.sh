#!/usr/bin/env bash
# Call C (2026-12-07): where the fused layer's time goes (call B: 2677 us against 462 us at 128
# tokens, one rank). Same carried binaries as call B. ncu: every kernel's duration of a short
# bench run (fused), then the fused kernel's warp states and throughput.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^(gpu|setup)"
B=/tmp/mkb
which ncu nsys 2>&1 | head -2
MK_MOE_FUSED_LAYER=1 timeout 150 ncu --clock-control none --print-units base --metrics gpu__time_duration.sum --csv \
  $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 2 --warmup 1 > $OUT/ncu_times.csv 2>$OUT/ncu_times.err
python3 - $OUT/ncu_times.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; k = hdr.index("Kernel Name"); v = hdr.index("Metric Value")
agg = collections.OrderedDict()
for r in rows[1:]:
    name = r[k][:70]
    agg.setdefault(name, []).append(float(r[v].replace(",", "")))
for n, xs in agg.items(): print(f"{n:70s} n={len(xs):3d} median_ns={sorted(xs)[len(xs)//2]:.0f}")
PY
MK_MOE_FUSED_LAYER=1 timeout 200 ncu --clock-control none -k regex:moe_layer_fused --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
  $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 2 --warmup 1 > $OUT/ncu_fused.txt 2>&1
grep -E "Duration|Throughput|Stall|Warp Cycles|Active Warps|Eligible|Issued|Grid Size|Registers|Block Size|Waves" $OUT/ncu_fused.txt | head -60
