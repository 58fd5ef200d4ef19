#!/usr/bin/env python3
"""tools/split_calibration.py reduce on tables with known answers: two splits (1 and the
controller) of one rank, three calls, a grid of three CTAs.

Every call: CTA 0 runs an op [2, 12] us then a tile [12, 42] (after an op), CTA 1 a tile [0, 20]
(before the op) and a tile [20, 40] (after a tile, no op running), CTA 2 a tile [5, 35] started
while the op ran. The
controller's table adds a switch to 4 at 13 us. A table whose CTAs do not divide into its calls
must be refused; the untraced row is carried over.
"""
import json
import os
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "split_calibration.py")
US = 1000


def write(path, split, calls, drop_cta=False):
    lines = ["# op gemm_rs M 256 N 512 K 64 world 2 rank 0 nodes 1 ranks threads calls %d ctas 3 split %s"
             % (calls, split), "# role\tpeer\tsm\tcta\titem\tt0_ns\tt1_ns"]
    ev = lambda role, cta, item, a, b: lines.append("%s\t-1\t%d\t%d\t%d\t%d\t%d" % (role, cta, cta, item, a, b))
    for c in range(calls):
        base = 10 * US + c * 100 * US
        for cta in range(3):
            if not (drop_cta and c == 1 and cta == 2):
                ev("cta", cta, -1, base, base + 50 * US)
        ev("comm", 0, 0, base + 2 * US, base + 12 * US)
        ev("compute", 0, 0, base + 12 * US, base + 42 * US)
        ev("epilogue", 0, 0, base + 34 * US, base + 42 * US)
        ev("compute", 1, 1, base, base + 20 * US)
        ev("epilogue", 1, 1, base + 16 * US, base + 20 * US)
        ev("compute", 1, 2, base + 20 * US, base + 40 * US)
        ev("epilogue", 1, 2, base + 36 * US, base + 40 * US)
        ev("compute", 2, 3, base + 5 * US, base + 35 * US)
        ev("epilogue", 2, 3, base + 31 * US, base + 35 * US)
        ev("spin", 2, 3, base + 32 * US, base + 34 * US)
        if split == "ctl":
            ev("controller", 0, 4, base + 13 * US, base + 13 * US)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def run(d, tables, rows=None):
    args = [sys.executable, TOOL, "reduce", *tables, "--out", os.path.join(d, "cal.json"), "--tsv",
            os.path.join(d, "cal.tsv")]
    if rows:
        p = os.path.join(d, "rows.json")
        with open(p, "w") as f:
            json.dump({"results": rows}, f)
        args += ["--json", p]
    return subprocess.run(args, capture_output=True, text=True)


def main():
    failures = []

    def check(what, got, want):
        if got != want:
            failures.append("%s: got %r, want %r" % (what, got, want))

    with tempfile.TemporaryDirectory() as d:
        name = os.path.join(d, "cal.gemm_rs.m256.n512.k64.w2.split%s.rank0.tsv")
        write(name % "1", "1", 3)
        write(name % "ctl", "ctl", 3)
        row = {"op": "gemm_rs", "M": 256, "N": 512, "K": 64, "world": 2, "ctas_per_rank": 3, "default_split": 8,
               "statics": [{"split": 1, "ms": 0.05, "min_ms": 0.049}], "ctl_ms": 0.06, "ctl_split": 4, "correct": True}
        r = run(d, [os.path.join(d, "cal.*.tsv")], [row])
        check("exit status", r.returncode, 0)
        if r.returncode == 0:
            doc = json.load(open(os.path.join(d, "cal.json")))
            check("records", len(doc["records"]), 1)
            rec = doc["records"][0]
            check("shape", (rec["op"], rec["M"], rec["N"], rec["K"], rec["world"]), ("gemm_rs", 256, 512, 64, 2))
            check("untraced statics", rec["untraced"]["statics"], row["statics"])
            check("untraced controller", (rec["untraced"]["ctl_ms"], rec["untraced"]["ctl_split"]), (0.06, 4))
            check("splits", sorted(rec["splits"]), ["1", "ctl"])
            for split in ("1", "ctl"):
                calls = rec["splits"][split]["0"]
                check(split + " calls", len(calls), 3)
                for c in calls:
                    check(split + " kernel", c["kernel_us"], 50.0)
                    check(split + " tiles", c["tiles"], 4)
                    check(split + " tile median", c["tile_us"], 25.0)      # 20, 20, 30, 30
                    check(split + " epilogue median", c["epi_us"], 4.0)
                    check(split + " after op", (c["tile_after_op_us"], c["tiles_after_op"]), (30.0, 1))
                    check(split + " after tile", c["tile_after_tile_us"], 20.0)
                    # Started with no op running: CTA 1's two tiles (0 and 20 us: 20 each) and CTA 0's
                    # (12: the op ended then; 30), median 20; with one: CTA 2's (5 us; 30).
                    check(split + " by running ops", c["tile_us_by_running_ops"], {"0-0": [20.0, 3], "1-1": [30.0, 1]})
                    check(split + " ops", (c["ops"], c["op_us"], c["op_sum_us"], c["op_ctas"]), (1, 10.0, 10.0, 1))
                    check(split + " op starts", c["op_starts_us"], [2.0])
                    check(split + " op items", c["op_items"], [0])
                    # Rank 0 of 2 owns rows 0..127: tile row 0 (items 0, 2: tiles_m 2); routed: 1, 3.
                    check(split + " own and routed epilogues", (c["epi_own_us"], c["epi_routed_us"]), (6.0, 4.0))
                    check(split + " spin", c["spin_us"], 2.0)
                    check(split + " tail", c["tail_us"], 8.0)
                    check(split + " switches", c["switches"], [[13.0, 4]] if split == "ctl" else [])
            tsv = [l.rstrip("\n").split("\t") for l in open(os.path.join(d, "cal.tsv")) if not l.startswith("#")]
            check("tsv split lines", [l for l in tsv if l[0] == "split"],
                  [["split", "gemm_rs", "2", "256", "512", "64", "3", "1", "0.0500", "0.0490"],
                   ["split", "gemm_rs", "2", "256", "512", "64", "3", "0", "0.0600", "0.0000"]])
            check("tsv call lines", sum(l[0] == "call" for l in tsv), 6)
            check("tsv op lines", [l[6:] for l in tsv if l[0] == "op"][:2],
                  [["1", "0", "0", "0", "2.00", "10.00"], ["1", "0", "1", "0", "2.00", "10.00"]])
        # A table whose CTA events do not divide into its calls is refused.
        bad = os.path.join(d, "bad")
        os.mkdir(bad)
        write(os.path.join(bad, "cal.gemm_rs.m256.n512.k64.w2.split2.rank0.tsv"), "2", 3, drop_cta=True)
        r = run(bad, [os.path.join(bad, "cal.*.tsv")])
        check("a table missing a CTA is refused", r.returncode != 0 and "do not divide" in r.stderr, True)
        # Nothing to reduce: an error, not an empty file.
        r = run(bad, [os.path.join(bad, "nothing.tsv")])
        check("no table is an error", r.returncode != 0, True)
    # from-reports: points from trace_report.py's text (two ranks, two calls; the slowest rank's
    # kernel per call, medians of the rest, an op's time without the spins inside it).
    with tempfile.TemporaryDirectory() as d:
        rep = os.path.join(d, "r.report.txt")
        with open(rep, "w") as f:
            f.write("== x.gemm_rs.m8192.n3584.k4096.w2: gemm_rs M 8192 N 3584 K 4096, 2 rank(s) traced (world 2, "
                    "nodes 1); untraced medians: fused None ms, compute None ms\n"
                    "call rank   enq     start   gap  kernel spread   1st tiles   mma   epi ops  op_us  spin:op   epi  "
                    "other    idle   tail\n"
                    "   0    0     nan      0.0   0.0   800.0    0.2   4.7   896 45.00 15.00   1   10.0      4.0 0.0 "
                    "0.0   991.4    1.6\n"
                    "   1    0     nan    900.0   6.6   900.0    0.2   3.3   896 47.00 17.00   1   12.0      2.0 0.0 "
                    "0.0   895.7    1.7\n"
                    "   0    1     nan      0.0   0.0   820.0    0.2   4.7   896 46.00 16.00   1    8.0      0.0 0.0 "
                    "0.0   991.4    1.6\n"
                    "   1    1     nan    900.0   6.6   880.0    0.2   3.3   896 44.00 14.00   1    9.0      1.0 0.0 "
                    "0.0   895.7    1.7\n"
                    "per rank, median over calls (us):  kernel  period   gap spread   1st  spin:op   epi other    idle\n"
                    "  rank 0    800.0\n"
                    "           epilogue per tile (median, us): own tiles (the final sum) 20.00, routed 10.00\n"
                    "  rank 1    820.0\n"
                    "           epilogue per tile (median, us): own tiles (the final sum) 22.00, routed 12.00\n")
        tsv = os.path.join(d, "p.tsv")
        r = subprocess.run([sys.executable, TOOL, "from-reports", rep, "--tsv", tsv], capture_output=True, text=True)
        check("from-reports exit status", r.returncode, 0)
        if r.returncode == 0:
            pts = [l.rstrip("\n").split("\t") for l in open(tsv) if l.startswith("point")]
            # kernel: call 0 max(800, 820) = 820, call 1 max(900, 880) = 900, median 860; mma 45 46 47 44
            # -> 45.5; epi 15 16 17 14 -> 15.5; own 20, 22 -> 21; routed 10, 12 -> 11; ops 1; op_us
            # (10-4, 12-2, 8-0, 9-1) = 6, 10, 8, 8 -> 8.
            check("from-reports point", pts, [["point", "gemm_rs", "2", "8192", "3584", "4096", "66", "8", "860.0",
                                               "45.50", "15.50", "21.00", "11.00", "1", "8.00", "2"]])
    for f in failures:
        print("FAIL " + f)
    print("test_split_calibration: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
