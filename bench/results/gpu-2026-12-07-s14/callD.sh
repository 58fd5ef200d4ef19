#!/usr/bin/env bash
# Call D (2026-12-07): the fused layer kernel's stall locations (ncu source page, SASS), 128 tokens,
# one rank; carried binaries of call C's tree.
set -u
MK_SUITE_STEPS="setup" bash scripts/device/suite.sh 2>&1 | grep -E "^(gpu|setup)"
B=/tmp/mkb
# One-off timing counters (MK_MOE_FUSED_DEBUG=64: per item kind the producer's gate time and the
# consumers' time, summed over CTAs and calls), printed when the bench destroys the layer.
for d in 64 192 320 8; do for tok in 128 4096; do
  echo "== MK_MOE_FUSED_DEBUG=$d, tokens $tok"
  MK_MOE_FUSED_DEBUG=$d MK_MOE_FUSED_LAYER=1 timeout 60 $B/mkernel bench moe_layer --preset qwen3_30b --tokens $tok \
    --reps 5 --warmup 1 2>&1 | grep -E "^qwen3|moe fused stats|^  "
done; done
MK_MOE_FUSED_LAYER=1 timeout 300 ncu --clock-control none -k regex:moe_layer_fused --launch-skip 2 --launch-count 1 \
  --section WarpStateStats --section SourceCounters --page source --print-source sass --csv \
  $B/mkernel bench moe_layer --preset qwen3_30b --tokens 128 --reps 2 --warmup 1 > $OUT/ncu_src.csv 2>$OUT/ncu_src.err
ls -la $OUT; head -c 600 $OUT/ncu_src.csv; echo
python3 - $OUT/ncu_src.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hi = next(i for i, r in enumerate(rows) if any("Source" == c or "Address" == c for c in r))
hdr = rows[hi]; body = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
print("columns:", hdr[:12])
def col(name):
    for i, h in enumerate(hdr):
        if h.startswith(name): return i
    return None
ci = col("Warp Stall Sampling (All"); si = col("Source"); ai = col("Address")
def num(x):
    try: return float(x.replace(",", ""))
    except: return 0.0
tot = sum(num(r[ci]) for r in body)
print("total samples", tot)
top = sorted(range(len(body)), key=lambda i: -num(body[i][ci]))[:30]
for i in sorted(top):
    r = body[i]
    print(f"{num(r[ci]) / max(tot, 1) * 100:5.1f}%  {r[ai] if ai is not None else i}  {r[si][:110]}")
    for j in range(max(0, i - 3), i):
        print(f"        ctx {body[j][si][:110]}")
PY
