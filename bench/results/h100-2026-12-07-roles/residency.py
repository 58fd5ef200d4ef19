#!/usr/bin/env python3
"""Per run of a call's matrix loop (DIR/r<i>/trace, test_gpu_matrix with MK_MATRIX_TRACE_DIR): the
tiny ring-backward case's CTAs resident per rank at a few instants (ms from the first CTA start
of any rank; the ranks share one GPU clock), and per rank the CTAs that started more than 5 s
after that (they became resident only once waits had given up).
  residency.py DIR"""
import glob, os, sys
for run in sorted(glob.glob(os.path.join(sys.argv[1], "r*")), key=lambda p: int(os.path.basename(p)[1:])):
    files = sorted(glob.glob(run + "/trace/ringbwd.zigzag_causal_S_rank_2_H_2_2*.tsv"))
    if not files:
        continue
    ctas = {}
    for f in files:
        r = int(f.split("rank")[-1].split(".")[0])
        ctas[r] = [(int(e[5]), int(e[6])) for e in (l.split("\t") for l in open(f) if not l.startswith("#"))
                   if e[0] == "cta"]
    base = min(c[0] for v in ctas.values() for c in v)
    failed = any("failed" in open(f).readline() for f in files)  # any rank's call
    at = []
    for t in (0.1, 0.3, 0.5, 1.0, 2.0, 5.0):
        tt = base + t * 1e6
        at.append(f"{t}ms:" + ",".join(str(sum(1 for a, b in ctas[r] if a <= tt < b)) for r in sorted(ctas)))
    late = ",".join(str(sum(1 for a, _ in ctas[r] if a - base > 5e9)) for r in sorted(ctas))
    print(f"{os.path.basename(run):4s} {'FAILED' if failed else 'ok    '} resident per rank at " + " ".join(at) +
          f"  started after 5 s per rank: {late}")
