#!/usr/bin/env python3
"""Reads the ring backward's per-rank timelines (test_gpu_matrix with MK_MATRIX_TRACE_DIR; one
write_trace_table file per rank and case) and prints, per rank of one case and call, each CTA's
start and end (Role::kCta, item 1 = communication CTA), its first and last item or op, and the
long waits, in ms from the earliest start of any rank's CTA (all ranks share one GPU clock).
  cta_lives.py DIR [PATTERN]   PATTERN: a substring of the file names (default: the tiny case)"""
import glob, os, sys
d = sys.argv[1]
pat = sys.argv[2] if len(sys.argv) > 2 else "S_rank_2_H_2_2"
files = sorted(f for f in glob.glob(os.path.join(d, "ringbwd.*.tsv")) if pat in os.path.basename(f))
rows = {}
for f in files:
    head = open(f).readline().strip("# \n")
    ev = [l.rstrip("\n").split("\t") for l in open(f) if not l.startswith("#")]
    rows[f] = (head, [(r, int(p), int(sm), int(c), int(i), int(a), int(b)) for r, p, sm, c, i, a, b in ev])
t_base = min((e[5] for _, evs in rows.values() for e in evs if e[0] == "cta"), default=0)
ms = lambda t: (t - t_base) / 1e6
for f, (head, evs) in rows.items():
    print(f"== {os.path.basename(f)}: {head}")
    ctas = sorted((e for e in evs if e[0] == "cta"), key=lambda e: e[3])
    for e in ctas:
        mine = [x for x in evs if x[3] == e[3] and x[0] != "cta"]
        kinds = {}
        for x in mine:
            kinds.setdefault(x[0], []).append(x)
        desc = "; ".join(f"{k} x{len(v)} first {ms(min(y[5] for y in v)):.3f}-{ms(min(y[6] for y in v)):.3f}"
                         f" last end {ms(max(y[6] for y in v)):.3f}" for k, v in sorted(kinds.items()))
        print(f"  cta {e[3]:3d} sm {e[2]:3d} {'comm   ' if e[4] == 1 else 'compute'} start {ms(e[5]):9.3f} end {ms(e[6]):9.3f}  {desc}")
    waits = [x for x in evs if x[0] == "wait"]
    for x in sorted(waits, key=lambda x: x[6] - x[5], reverse=True)[:4]:
        print(f"  wait cta {x[3]} item {x[4]}: {ms(x[5]):.3f} -> {ms(x[6]):.3f} ({(x[6] - x[5]) / 1e6:.3f} ms)")
