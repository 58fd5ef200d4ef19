#!/usr/bin/env bash
# Call C (2026-12-07): where the fused layer's time goes (tree: the units' waits and signals at GPU
# scope, the one-off bits below) (call B: 2677 us against 462 us at 128
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
# One-off experiments (MK_MOE_FUSED_DEBUG bits, src/ops/moe/moe_layer_kernel.cu): 1 the second
# GEMM's tile fence at system scope and 2 the units' waits and signals at system scope (3: the kernel
# as call B ran it), 8 the gate without its acquire, 4 no epilogue stores (wrong outputs: the check
# fails by design).
for d in 0 3 1 2 8 4; do
  for tok in 128 4096; do
    echo "== MK_MOE_FUSED_DEBUG=$d tokens $tok"
    MK_MOE_FUSED_DEBUG=$d MK_MOE_FUSED_LAYER=1 timeout 40 $B/mkernel bench moe_layer --preset qwen3_30b --tokens $tok \
      --reps 10 --warmup 2 2>&1 | grep -E "^qwen3"
  done
done
MK_UNIT_ONLY='test_gpu_moe_layer_(fused_np1|fused_np2|fused_np4|fused_3nodes_tcp_np3)$' MK_SUITE_STEPS="unit" \
  timeout 120 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -20
# W = 4 ranks sharing the GPU under MPS (25 % each): the launches, then the fused kernel.
nvidia-cuda-mps-control -d
for fused in 0 1; do
  echo "== W 4 (MPS) MK_MOE_FUSED_LAYER=$fused tokens 4096"
  timeout 100 mpirun -np 4 -x MK_MOE_FUSED_LAYER=$fused -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 $B/mkernel bench moe_layer \
    --preset qwen3_30b --tokens 4096 --reps 10 --warmup 2 --json $OUT/layer_w4_f$fused.json 2>&1 | grep -E "^qwen3|^check|^bench"
done
echo quit | nvidia-cuda-mps-control
