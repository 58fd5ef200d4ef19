#!/usr/bin/env python3
"""Where the time of consecutive fused calls goes, on every rank.

Input: the tables `mkernel bench <op> --trace PREFIX [--trace-calls N]` writes, one per rank
(PREFIX.<op>.m<M>.n<N>.k<K>.w<W>.rank<R>.tsv: role, peer, sm, cta, item, t0_ns, t1_ns in the
device's clock, the host's enqueues as role "host" in the same clock). Ranks that share a GPU
share the clock, so their calls line up; on several GPUs only per-rank figures compare.

    python3 tools/trace_report.py PREFIX.gemm_rs.m8192.n3584.k64.w4.rank*.tsv [--json OUT]

Per call and rank (microseconds; times from the first kernel start of the run):
  enq      the host's enqueue of the call (start)
  start    the kernel's first CTA start; gap: start minus the later of the previous kernel's end
           and the enqueue's end (launch latency, the controller's and counters' small launches,
           or the GPU busy with other ranks' kernels)
  kernel   first CTA start to last CTA end
  spread   last CTA start minus first (CTAs that could not start at once: SMs taken)
  1st      mean over CTAs of the first item's start after the CTA's (op or tile)
  tiles, mma, epi: tiles of the call, mean MMA and epilogue per tile
  ops, op_us: communication ops and their summed time
  spin     waits that spun, summed over CTAs and warps, by where they were: in an op, in a tile's
           epilogue (the destination's readiness, the owner's wait for the peers' shares), or
           elsewhere (the producer's load waits before a tile, or taking an op)
  idle     summed over CTAs: CTA time not in a tile or an op (the consumers waiting for an item)
  tail     the kernel's end minus its last tile's end
Then per rank the medians (with, for gemm_rs and gemm_ar on one node, the epilogue of the rank's
own tiles — the final sum over the peers' shares — apart from the routed ones, the calls' start and end skew across ranks, and the consecutive
calls' period (what back-to-back timing sees).
"""
TILE_M = 128  # the persistent GEMM's tile rows (src/gemm/kernel/config.cuh)
import argparse
import collections
import json
import re
import statistics
import sys


def load(path):
    header = {}
    events = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                words = line[1:].split()
                if words and words[0] == "op":
                    header = dict(zip(words[0::2], words[1::2]))
                continue
            role, peer, sm, cta, item, t0, t1 = line.rstrip("\n").split("\t")
            events.append((role, int(peer), int(sm), int(cta), int(item), int(t0), int(t1)))
    return header, events


def union_len(intervals):
    total, end = 0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def split_calls(events, calls):
    """Per call: (window start, end, CTA events). The kernels of one rank run one after another."""
    ctas = sorted((e for e in events if e[0] == "cta"), key=lambda e: e[5])
    if calls <= 0 or not ctas or len(ctas) % calls:
        raise ValueError("%d CTA events do not divide into %d calls" % (len(ctas), calls))
    grid = len(ctas) // calls
    out = []
    for c in range(calls):
        group = ctas[c * grid:(c + 1) * grid]
        out.append((min(e[5] for e in group), max(e[6] for e in group), group))
    return out


def own_tile_rows(header):
    """The tile rows whose epilogue is the final sum (gemm_rs/gemm_ar on one node), or None."""
    if header.get("op") not in ("gemm_rs", "gemm_ar") or header.get("nodes") != "1":
        return None
    M, W, r = int(header["M"]), int(header["world"]), int(header["rank"])
    lo, hi = r * (M // W), (r + 1) * (M // W)
    # A tile row is final when it starts inside this rank's shard (RouteEpilogue::fin_lo/hi).
    return {tm for tm in range((M + TILE_M - 1) // TILE_M) if lo <= tm * TILE_M < hi}


def epilogue_split(events, header):
    """Median epilogue (us) of the rank's own tiles and of the routed ones; None when not split."""
    own = own_tile_rows(header)
    if own is None:
        return None
    tiles_m = (int(header["M"]) + TILE_M - 1) // TILE_M
    mine, routed = [], []
    for e in events:
        if e[0] == "epilogue":
            (mine if e[4] % tiles_m in own else routed).append(e[6] - e[5])
    return (statistics.median(mine) / 1e3 if mine else 0.0, statistics.median(routed) / 1e3 if routed else 0.0)


def analyze_rank(events, calls):
    hosts = sorted((e for e in events if e[0] == "host"), key=lambda e: e[4])
    windows = split_calls(events, calls)
    rows = []
    prev_end = None
    for c, (w0, w1, ctas) in enumerate(windows):
        inside = [e for e in events if e[0] not in ("cta", "host") and e[5] >= w0 and e[6] <= w1]
        by_cta = collections.defaultdict(list)
        for e in inside:
            by_cta[e[3]].append(e)
        tiles = [e for e in inside if e[0] == "compute"]
        epis = [e for e in inside if e[0] == "epilogue"]
        ops = [e for e in inside if e[0] in ("comm", "net-send")]
        spin = collections.Counter()
        spin_peer = collections.Counter()
        for e in inside:
            if e[0] != "spin":
                continue
            where = "other"
            for o in by_cta[e[3]]:
                if o[0] in ("comm", "net-send") and o[5] <= e[5] and e[6] <= o[6]:
                    where = "op"
                    break
                if o[0] == "epilogue" and o[5] <= e[5] and e[6] <= o[6]:
                    where = "epilogue"
                    break
            spin[where] += e[6] - e[5]
            spin_peer[e[1]] += e[6] - e[5]
        first_item, idle = [], 0
        for cta in ctas:
            mine = [o for o in by_cta[cta[3]] if o[0] in ("compute", "comm", "net-send")]
            if mine:
                first_item.append(min(o[5] for o in mine) - cta[5])
            idle += (cta[6] - cta[5]) - union_len([(o[5], o[6]) for o in mine])
        last_tile = max((e[6] for e in tiles), default=w1)
        host = hosts[c] if c < len(hosts) else None
        # The kernel could start once the previous one ended and this call was enqueued.
        ready = max([x for x in (prev_end, host[6] if host else None) if x is not None], default=w0)
        rows.append({
            "call": c,
            "enq": host[5] if host else None,
            "enq_end": host[6] if host else None,
            "start": w0,
            "end": w1,
            "gap": w0 - ready,
            "kernel": w1 - w0,
            "spread": max(e[5] for e in ctas) - w0,
            "first": statistics.mean(first_item) if first_item else 0,
            "tiles": len(tiles),
            "mma": statistics.mean(t[6] - t[5] for t in tiles) - (statistics.mean(e[6] - e[5] for e in epis) if epis else 0)
            if tiles else 0,
            "epi": statistics.mean(e[6] - e[5] for e in epis) if epis else 0,
            "ops": len(ops),
            "op_us": sum(o[6] - o[5] for o in ops),
            "spin_op": spin["op"],
            "spin_epi": spin["epilogue"],
            "spin_other": spin["other"],
            "spin_peer": dict(spin_peer),
            "idle": idle,
            "tail": w1 - last_tile,
            "ctas": len(ctas),
        })
        prev_end = w1
    return rows


def us(ns):
    return ns / 1e3


def report(paths, out=sys.stdout):
    groups = collections.defaultdict(dict)
    for p in paths:
        m = re.match(r"(.*)\.rank(\d+)\.tsv$", p)
        if not m:
            raise SystemExit("trace_report: %s is not a PREFIX...rankR.tsv table" % p)
        groups[m.group(1)][int(m.group(2))] = p
    result = {}
    for name, ranks in sorted(groups.items()):
        per_rank = {}
        header = {}
        splits = {}
        for r, p in sorted(ranks.items()):
            header, events = load(p)
            per_rank[r] = analyze_rank(events, int(header.get("calls", "0")))
            splits[r] = epilogue_split(events, header)
        t0 = min(row["start"] for rows in per_rank.values() for row in rows)
        print("== %s: %s M %s N %s K %s, %d rank(s) traced (world %s, nodes %s); untraced medians: fused %s ms, "
              "compute %s ms" % (name, header.get("op"), header.get("M"), header.get("N"), header.get("K"),
                                 len(per_rank), header.get("world"), header.get("nodes"),
                                 header.get("fused_median_ms"), header.get("compute_median_ms")), file=out)
        cols = ("call rank   enq     start   gap  kernel spread   1st tiles   mma   epi ops  op_us  spin:op   epi "
                " other    idle   tail")
        print(cols, file=out)
        for r, rows in sorted(per_rank.items()):
            for x in rows:
                print("%4d %4d %7.1f %8.1f %5.1f %7.1f %6.1f %5.1f %5d %5.2f %5.2f %3d %6.1f %8.1f %5.1f %6.1f %7.1f %6.1f"
                      % (x["call"], r, us(x["enq"] - t0) if x["enq"] is not None else float("nan"),
                         us(x["start"] - t0), us(x["gap"]), us(x["kernel"]), us(x["spread"]), us(x["first"]),
                         x["tiles"], us(x["mma"]), us(x["epi"]), x["ops"], us(x["op_us"]), us(x["spin_op"]),
                         us(x["spin_epi"]), us(x["spin_other"]), us(x["idle"]), us(x["tail"])), file=out)
        summary = {}
        print("per rank, median over calls (us):  kernel  period   gap spread   1st  spin:op   epi other    idle"
              "   tail  spin by peer", file=out)
        for r, rows in sorted(per_rank.items()):
            med = lambda k: statistics.median(x[k] for x in rows)  # noqa: E731
            periods = [rows[i]["end"] - rows[i - 1]["end"] for i in range(1, len(rows))]
            peers = collections.Counter()
            for x in rows:
                peers.update(x["spin_peer"])
            s = {k: us(med(k)) for k in ("kernel", "gap", "spread", "first", "spin_op", "spin_epi", "spin_other",
                                          "idle", "tail", "mma", "epi")}
            s["period"] = us(statistics.median(periods)) if periods else float("nan")
            s["spin_by_peer"] = {str(p): us(v) / len(rows) for p, v in sorted(peers.items())}
            if splits.get(r):
                s["epi_own"], s["epi_routed"] = splits[r]
            summary[r] = s
            print("  rank %-3d %30.1f %7.1f %5.1f %6.1f %5.1f %8.1f %5.1f %5.1f %7.1f %6.1f  %s"
                  % (r, s["kernel"], s["period"], s["gap"], s["spread"], s["first"], s["spin_op"], s["spin_epi"],
                     s["spin_other"], s["idle"], s["tail"],
                     " ".join("%s:%.0f" % (p if p != "-1" else "-", v) for p, v in s["spin_by_peer"].items())),
                  file=out)
            if "epi_own" in s:
                print("           epilogue per tile (median, us): own tiles (the final sum) %.2f, routed %.2f"
                      % (s["epi_own"], s["epi_routed"]), file=out)
        calls = min(len(rows) for rows in per_rank.values())
        if len(per_rank) > 1 and calls:
            start_skew = [us(max(per_rank[r][c]["start"] for r in per_rank) - min(per_rank[r][c]["start"] for r in per_rank))
                          for c in range(calls)]
            end_skew = [us(max(per_rank[r][c]["end"] for r in per_rank) - min(per_rank[r][c]["end"] for r in per_rank))
                        for c in range(calls)]
            print("across ranks, per call (us): start skew %s; end skew %s" % (
                " ".join("%.1f" % v for v in start_skew), " ".join("%.1f" % v for v in end_skew)), file=out)
            summary["start_skew_us"] = start_skew
            summary["end_skew_us"] = end_skew
        result[name] = {"header": header, "ranks": summary,
                        "calls": {str(r): rows for r, rows in per_rank.items()}}
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="+")
    ap.add_argument("--json", help="also write the figures as JSON")
    a = ap.parse_args()
    res = report(a.tables)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
