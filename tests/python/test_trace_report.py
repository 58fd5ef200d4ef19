#!/usr/bin/env python3
"""tools/trace_report.py on tables with known answers: two ranks, three calls, a grid of two CTAs.

Each call's events are placed so that every figure the report prints has one right value: the
launch gap, the kernel span, the CTA start spread, the first item, the tiles' MMA and epilogue,
the ops, spins inside an op, inside an epilogue and outside both (by peer), the idle CTA time,
the tail, the period of consecutive calls and the skew across ranks. A mutant table (a call's
CTA missing) must be refused.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import trace_report  # noqa: E402

US = 1000


def write(path, rank, calls, shift, drop_cta=False):
    lines = ["# op gemm_rs M 256 N 128 K 64 world 2 rank %d nodes 1 fused_median_ms 0.1 compute_median_ms 0.05 "
             "calls %d" % (rank, calls), "# role\tpeer\tsm\tcta\titem\tt0_ns\tt1_ns"]
    ev = lambda role, peer, cta, item, a, b: lines.append("%s\t%d\t%d\t%d\t%d\t%d\t%d" % (
        role, peer, cta, cta, item, a * US + shift, b * US + shift))
    for c in range(calls):
        base = 1000 + c * 200            # kernel c starts at base (+ shift), call period 200 us
        ev("host", -1, c, c, base - 50, base - 40)   # enqueued 50 us before; gap after call c-1's end
        # CTA 0: start base, an op [base+2, base+12] with a 4 us spin inside (peer 1), then a tile
        # [base+12, base+52] whose epilogue [base+42, base+52] holds a 6 us spin (peer 1).
        ev("cta", -1, 0, -1, base, base + 100)
        ev("comm", -1, 0, 7, base + 2, base + 12)
        ev("spin", 1, 0, 3, base + 5, base + 9)
        ev("compute", -1, 0, 0, base + 12, base + 52)
        ev("epilogue", -1, 0, 0, base + 42, base + 52)
        ev("spin", 1, 0, 4, base + 44, base + 50)
        # CTA 1: starts 10 us late, a producer spin (no peer) before its tile [base+20, base+60].
        if not (drop_cta and c == 1):
            ev("cta", -1, 1, -1, base + 10, base + 90)
        ev("spin", -1, 1, 5, base + 12, base + 20)
        ev("compute", -1, 1, 1, base + 20, base + 60)
        ev("epilogue", -1, 1, 1, base + 48, base + 60)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def near(a, b):
    return abs(a - b) < 1e-6


def main():
    d = tempfile.mkdtemp()
    paths = [os.path.join(d, "t.gemm_rs.m256.n128.k64.w2.rank%d.tsv" % r) for r in range(2)]
    write(paths[0], 0, 3, 0)
    write(paths[1], 1, 3, 3 * US)  # rank 1 three microseconds later
    with open(os.devnull, "w") as null:
        res = trace_report.report(paths, out=null)
    (name, g), = res.items()
    calls = g["calls"]["0"]
    assert len(calls) == 3, calls
    x = calls[1]
    checks = {
        "gap": (x["gap"], 40 * US),  # after the later of the previous end (-100) and the enqueue (-40)
        "kernel": (x["kernel"], 100 * US),
        "spread": (x["spread"], 10 * US),
        "first": (x["first"], 6 * US),  # CTA 0: 2 us, CTA 1: 10 us
        "tiles": (x["tiles"], 2),
        "mma": (x["mma"], 29 * US),
        "epi": (x["epi"], 11 * US),
        "ops": (x["ops"], 1),
        "op_us": (x["op_us"], 10 * US),
        "spin_op": (x["spin_op"], 4 * US),
        "spin_epi": (x["spin_epi"], 6 * US),
        "spin_other": (x["spin_other"], 8 * US),
        "idle": (x["idle"], (100 - 50) * US + (80 - 40) * US),
        "tail": (x["tail"], 40 * US),
    }
    for k, (got, want) in checks.items():
        assert near(got, want), "%s: got %s, want %s" % (k, got, want)
    assert near(calls[0]["gap"], 40 * US), calls[0]["gap"]  # the first call: after its enqueue
    assert x["spin_peer"] == {1: 10 * US, -1: 8 * US}, x["spin_peer"]
    # Tile 0 (rows 0-127) is rank 0's own (its final sum), tile 1 rank 1's.
    assert near(g["ranks"][0]["epi_own"], 10.0) and near(g["ranks"][0]["epi_routed"], 12.0), g["ranks"][0]
    assert near(g["ranks"][1]["epi_own"], 12.0) and near(g["ranks"][1]["epi_routed"], 10.0), g["ranks"][1]
    r0 = g["ranks"][0]
    assert near(r0["period"], 200.0), r0["period"]
    assert all(near(v, 3.0) for v in g["ranks"]["start_skew_us"]), g["ranks"]["start_skew_us"]
    assert all(near(v, 3.0) for v in g["ranks"]["end_skew_us"]), g["ranks"]["end_skew_us"]
    # A table whose calls do not divide into whole grids is refused, not guessed at.
    write(paths[1], 1, 3, 0, drop_cta=True)
    try:
        with open(os.devnull, "w") as null:
            trace_report.report(paths, out=null)
    except ValueError as e:
        assert "do not divide" in str(e)
    else:
        raise AssertionError("a table with a missing CTA was accepted")
    print("trace_report: ok")


if __name__ == "__main__":
    main()
