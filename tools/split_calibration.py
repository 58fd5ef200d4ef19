#!/usr/bin/env python3
"""The SM-partition controller's calibration data: what a fused call does at each static split,
reduced from the traced calls of `bench_fused_threads W OP M N K R --splits --trace PREFIX`
(one table per split and rank: PREFIX.<op>.m<M>.n<N>.k<K>.w<W>.split<n|ctl>.rank<R>.tsv) and
its JSON row (untraced medians per split).

    python3 tools/split_calibration.py reduce --json ROWS.json TABLES... --out CAL.json

For each table and call (microseconds unless said): the kernel's span, its tiles (count, median
time of a tile's compute event — MMA and epilogue — and of its epilogue), tiles that followed an
op on their CTA against tiles that followed a tile (what a role switch costs), tile time by the
number of ops running on the rank when the tile started (what copies cost the tiles), the ops
(count, median time, summed time, the CTAs that ran them), the waits that spun, and the
controller's switches. Per operator and shape it adds the untraced medians of the row. The
result is what tests/cpu/test_split_control.cc's calibration reads (tests/cpu/data/).
"""
import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_report  # noqa: E402  (load, split_calls)

NAME = re.compile(r"\.(ag_gemm|gemm_rs|gemm_ar)\.m(\d+)\.n(\d+)\.k(\d+)\.w(\d+)\.split(\w+)\.rank(\d+)\.tsv$")
OP_ROLES = ("comm", "net-send")
CONCURRENCY_BUCKETS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 1 << 30))


def med(xs):
    return statistics.median(xs) if xs else 0.0


def reduce_call(events, w0, w1, ctas, own_rows=None, tiles_m=1):
    inside = [e for e in events if e[0] not in ("cta", "host") and e[5] >= w0 and e[6] <= w1]
    tiles = sorted((e for e in inside if e[0] == "compute"), key=lambda e: e[5])
    epis = [e for e in inside if e[0] == "epilogue"]
    ops = sorted((e for e in inside if e[0] in OP_ROLES), key=lambda e: e[5])
    ctl = sorted((e for e in inside if e[0] == "controller"), key=lambda e: e[5])
    spin = sum(e[6] - e[5] for e in inside if e[0] == "spin")
    # Per CTA in time order: what preceded each tile (an op or a tile).
    by_cta = collections.defaultdict(list)
    for e in tiles + ops:
        by_cta[e[3]].append(e)
    after_op, after_tile = [], []
    for items in by_cta.values():
        items.sort(key=lambda e: e[5])
        for prev, cur in zip(items, items[1:]):
            if cur[0] == "compute":
                (after_op if prev[0] in OP_ROLES else after_tile).append(cur[6] - cur[5])
    # Tile time by the ops running on this rank when it started.
    starts = sorted(o[5] for o in ops)
    ends = sorted(o[6] for o in ops)
    by_conc = collections.defaultdict(list)
    si = ei = 0
    for t in tiles:
        while si < len(starts) and starts[si] <= t[5]:
            si += 1
        while ei < len(ends) and ends[ei] <= t[5]:
            ei += 1
        running = si - ei
        for lo, hi in CONCURRENCY_BUCKETS:
            if lo <= running <= hi:
                by_conc["%d-%d" % (lo, min(hi, 99))].append(t[6] - t[5])
                break
    last_tile = max((t[6] for t in tiles), default=w1)
    # RS/AR on one node: the epilogue of the rank's own tile rows (the final sum) apart from the
    # routed ones (trace_report.own_tile_rows).
    own_epi = [e[6] - e[5] for e in epis if own_rows is not None and e[4] % tiles_m in own_rows]
    routed_epi = [e[6] - e[5] for e in epis if own_rows is not None and e[4] % tiles_m not in own_rows]
    return {
        "kernel_us": (w1 - w0) / 1e3,
        "start_us": w0 / 1e3,  # the device's clock: ranks on one GPU share it
        "tiles": len(tiles),
        "tile_us": med([t[6] - t[5] for t in tiles]) / 1e3,
        "epi_us": med([e[6] - e[5] for e in epis]) / 1e3,
        "epi_own_us": med(own_epi) / 1e3,
        "epi_routed_us": med(routed_epi) / 1e3,
        "tile_after_op_us": med(after_op) / 1e3,
        "tile_after_tile_us": med(after_tile) / 1e3,
        "tiles_after_op": len(after_op),
        "tile_us_by_running_ops": {k: [round(med(v) / 1e3, 3), len(v)] for k, v in sorted(by_conc.items())},
        "ops": len(ops),
        "op_us": med([o[6] - o[5] for o in ops]) / 1e3,
        "op_sum_us": sum(o[6] - o[5] for o in ops) / 1e3,
        "op_items": [o[4] for o in ops],
        "op_starts_us": [round((o[5] - w0) / 1e3, 2) for o in ops],
        "op_durations_us": [round((o[6] - o[5]) / 1e3, 2) for o in ops],
        "op_ctas": len({o[3] for o in ops}),
        "spin_us": spin / 1e3,
        "tail_us": (w1 - last_tile) / 1e3,
        "switches": [[round((e[5] - w0) / 1e3, 2), e[4]] for e in ctl],
        "ctas": len(ctas),
    }


def reduce_tables(paths, rows):
    by_key = collections.defaultdict(list)
    for p in paths:
        m = NAME.search(p)
        if not m:
            print("split_calibration: skipping %s (not a --splits table)" % p, file=sys.stderr)
            continue
        op, M, N, K, W, split, rank = m.groups()
        by_key[(op, int(M), int(N), int(K), int(W))].append((split, int(rank), p))
    out = []
    for (op, M, N, K, W), tables in sorted(by_key.items()):
        rec = {"op": op, "M": M, "N": N, "K": K, "world": W, "splits": {}}
        for row in rows:
            if (row.get("op"), row.get("M"), row.get("N"), row.get("K"), row.get("world")) == (op, M, N, K, W):
                rec["untraced"] = {
                    "ctas_per_rank": row.get("ctas_per_rank"),
                    "compute_only_ms": row.get("compute_only_ms"),
                    "default_split": row.get("default_split"),
                    "statics": row.get("statics"),
                    "ctl_ms": row.get("ctl_ms"),
                    "ctl_min_ms": row.get("ctl_min_ms"),
                    "ctl_split": row.get("ctl_split"),
                    "correct": row.get("correct"),
                }
        for split, rank, path in sorted(tables, key=lambda t: (t[0], t[1])):
            header, events = trace_report.load(path)
            calls = int(header.get("calls", "3"))
            own = trace_report.own_tile_rows(header)
            tiles_m = (M + trace_report.TILE_M - 1) // trace_report.TILE_M
            per_call = [reduce_call(events, w0, w1, ctas, own, tiles_m)
                        for w0, w1, ctas in trace_report.split_calls(events, calls)]
            rec["splits"].setdefault(split, {})[str(rank)] = per_call
        out.append(rec)
    return out


def write_tsv(data, path):
    """The flat form tests/cpu/test_split_calibration.cc reads: one line per untraced split
    ("split"), per traced call ("call") and per op of a traced call ("op"); tab-separated, the
    first field names the line."""
    with open(path, "w") as f:
        f.write("# tools/split_calibration.py: the fused calls of bench_fused_threads --splits --trace\n")
        f.write("# split\top\tW\tM\tN\tK\tctas\tsplit\tmedian_ms\tmin_ms   (split 0: the controller)\n")
        f.write("# call\top\tW\tM\tN\tK\tsplit\trank\tcall\tkernel_us\ttiles\ttile_us\tepi_us\tepi_own_us\t"
                "epi_routed_us\ttile_after_op_us\ttile_after_tile_us\tops\tstart_us\n")
        f.write("# op\top\tW\tM\tN\tK\tsplit\trank\tcall\titem\tstart_us\tdur_us\n")
        for rec in data:
            key = "%s\t%d\t%d\t%d\t%d" % (rec["op"], rec["world"], rec["M"], rec["N"], rec["K"])
            u = rec.get("untraced") or {}
            for st in u.get("statics") or []:
                f.write("split\t%s\t%d\t%d\t%.4f\t%.4f\n" % (key, u["ctas_per_rank"], st["split"], st["ms"], st["min_ms"]))
            if u.get("ctl_ms"):
                f.write("split\t%s\t%d\t0\t%.4f\t%.4f\n" % (key, u["ctas_per_rank"], u["ctl_ms"], u.get("ctl_min_ms") or 0))
            for split, ranks in sorted(rec["splits"].items()):
                sp = 0 if split == "ctl" else int(split)
                for rank, calls in sorted(ranks.items()):
                    for c, x in enumerate(calls):
                        f.write("call\t%s\t%d\t%s\t%d\t%.3f\t%d\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%d\t%.3f\n" % (
                            key, sp, rank, c, x["kernel_us"], x["tiles"], x["tile_us"], x["epi_us"], x["epi_own_us"],
                            x["epi_routed_us"], x["tile_after_op_us"], x["tile_after_tile_us"], x["ops"], x["start_us"]))
                        for item, t0, d in zip(x["op_items"], x["op_starts_us"], x["op_durations_us"]):
                            f.write("op\t%s\t%d\t%s\t%d\t%d\t%.2f\t%.2f\n" % (key, sp, rank, c, item, t0, d))


REPORT_HEAD = re.compile(r"^== \S+: (\w+) M (\d+) N (\d+) K (\d+), \d+ rank\(s\) traced \(world (\d+), nodes (\d+)\)")
EPI_SPLIT = re.compile(r"own tiles \(the final sum\) ([\d.]+), routed ([\d.]+)")


def from_reports(paths, split, sms):
    """Points from tools/trace_report.py's text reports of traced calls at one split (the
    default): per operator and shape the slowest rank's kernel per call (median over calls),
    the tiles' MMA and epilogue, the own and routed epilogues, and an op's time without the
    waits that spun inside it. Ranks as threads of one process: each rank had sms / W CTAs."""
    points = []
    for path in paths:
        lines = open(path).read().splitlines()
        m = REPORT_HEAD.match(lines[0]) if lines else None
        if not m:
            sys.exit("split_calibration: %s is not a trace_report report" % path)
        op, M, N, K, W, nodes = m.group(1), *map(int, m.groups()[1:])
        if nodes != 1:
            continue
        rows, own, routed = [], [], []
        for line in lines[2:]:
            f = line.split()
            if len(f) == 18 and f[0].isdigit() and f[1].isdigit():
                rows.append(f)
            e = EPI_SPLIT.search(line)
            if e:
                own.append(float(e.group(1)))
                routed.append(float(e.group(2)))
        # call rank enq start gap kernel spread 1st tiles mma epi ops op_us spin:op epi other idle tail
        slowest = collections.defaultdict(float)
        for f in rows:
            slowest[int(f[0])] = max(slowest[int(f[0])], float(f[5]))
        op_us = [(float(f[12]) - float(f[13])) / int(f[11]) for f in rows if int(f[11]) > 0]
        points.append({"op": op, "M": M, "N": N, "K": K, "world": W, "ctas": sms // W, "split": split,
                       "kernel_us": med(list(slowest.values())), "mma_us": med([float(f[9]) for f in rows]),
                       "epi_us": med([float(f[10]) for f in rows]), "epi_own_us": med(own),
                       "epi_routed_us": med(routed), "ops": int(med([int(f[11]) for f in rows])),
                       "op_us": med(op_us), "calls": len(slowest)})
    return points


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reduce", help="tables and rows into one calibration JSON")
    r.add_argument("tables", nargs="+", help="the --splits tables (globs allowed)")
    r.add_argument("--json", action="append", default=[], help="bench_fused_threads --json files (rows)")
    r.add_argument("--out", required=True)
    r.add_argument("--tsv", help="also the flat form tests/cpu/test_split_calibration.cc reads")
    fr = sub.add_parser("from-reports", help="points at one split from trace_report.py's text reports")
    fr.add_argument("reports", nargs="+")
    fr.add_argument("--split", type=int, default=8, help="the split the traced calls ran at (default 8)")
    fr.add_argument("--sms", type=int, default=132, help="the GPU's SMs (each rank had sms / W CTAs)")
    fr.add_argument("--tsv", required=True)
    a = ap.parse_args()
    if a.cmd == "from-reports":
        pts = from_reports(a.reports, a.split, a.sms)
        with open(a.tsv, "w") as f:
            f.write("# tools/split_calibration.py from-reports %s\n" % " ".join(os.path.basename(r) for r in a.reports))
            f.write("# point\top\tW\tM\tN\tK\tctas\tsplit\tkernel_us\tmma_us\tepi_us\tepi_own_us\tepi_routed_us\t"
                    "ops\top_us\tcalls\n")
            for p in pts:
                f.write("point\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%.1f\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t%.2f\t%d\n" % (
                    p["op"], p["world"], p["M"], p["N"], p["K"], p["ctas"], p["split"], p["kernel_us"], p["mma_us"],
                    p["epi_us"], p["epi_own_us"], p["epi_routed_us"], p["ops"], p["op_us"], p["calls"]))
        print("split_calibration: %d points -> %s" % (len(pts), a.tsv))
        return
    paths = sorted({p for t in a.tables for p in (glob.glob(t) or [t])})
    rows = []
    for j in a.json:
        with open(j) as f:
            rows += json.load(f).get("results", [])
    data = reduce_tables(paths, rows)
    if not data:
        sys.exit("split_calibration: no --splits table among %d paths" % len(paths))
    with open(a.out, "w") as f:
        json.dump({"source": "bench_fused_threads --splits --trace", "records": data}, f, indent=1)
    if a.tsv:
        write_tsv(data, a.tsv)
    print("split_calibration: %d operator/shape records from %d tables -> %s" % (len(data), len(paths), a.out))


if __name__ == "__main__":
    main()
