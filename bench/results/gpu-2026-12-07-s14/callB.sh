#!/usr/bin/env bash
# Call B (2026-12-07, fourteenth session): the first GPU run of the fused MoE layer kernel
# (src/ops/moe/moe_layer_kernel.cu, MK_MOE_FUSED_LAYER=1), from binaries built on the development
# machine (pack: MK_PACK_ONLY='test_gpu_moe_layer$'):
# 1. the MoE layer GPU tests, fused, at np 1, 2, 4, 3 nodes x 1 and 2 nodes x 2 over tcp; the
#    launches' np 1 for comparison;
# 2. mkernel bench moe_layer (qwen3_30b, 128 and 4096 tokens, one rank), launches then fused.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
t0=$(date +%s)
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^(gpu|setup)"
MK_UNIT_ONLY='test_gpu_moe_layer_(np1|fused_np1|fused_np2|fused_np4|fused_3nodes_tcp_np3|fused_2nodes_tcp_np4)$' \
  MK_SUITE_STEPS="unit" timeout 330 bash scripts/device/suite.sh 2>&1 | grep -E "^unit|^      " | head -40
cp /tmp/mk-suite/unit_*.log $OUT/ 2>/dev/null
echo "tests done at $(( $(date +%s) - t0 )) s"
for fused in 0 1; do
  for tok in 128 4096; do
    echo "== MK_MOE_FUSED_LAYER=$fused tokens $tok"
    MK_MOE_FUSED_LAYER=$fused timeout 60 /tmp/mkb/mkernel bench moe_layer --preset qwen3_30b --tokens $tok \
      --json $OUT/layer_f${fused}_t${tok}.json 2>&1 | tail -8
  done
done
echo "all done at $(( $(date +%s) - t0 )) s"
