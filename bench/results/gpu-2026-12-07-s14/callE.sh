#!/usr/bin/env bash
# Call E (2026-12-07): the fused layer's one-off timing counters (MK_MOE_FUSED_DEBUG=64: per item
# kind the producer's gate time and the consumers' time, summed over CTAs and calls; printed when
# the bench destroys the layer); 320 = 64 + every consumer thread fencing after a tile (as call C
# ran); 192 = 64 + no proxy fence before a tile's loads. Qwen3-30B preset, one rank.
set -u
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^(gpu|setup)"
B=/tmp/mkb
for d in 64 320 192; do for tok in 128 4096; do
  echo "== MK_MOE_FUSED_DEBUG=$d, tokens $tok"
  MK_MOE_FUSED_DEBUG=$d MK_MOE_FUSED_LAYER=1 timeout 30 $B/mkernel bench moe_layer --preset qwen3_30b --tokens $tok \
    --reps 5 --warmup 1 2>&1 | grep -E "^qwen3|moe fused stats|^  "
done; done
