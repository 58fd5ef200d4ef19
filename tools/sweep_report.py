#!/usr/bin/env python3
"""Turns `mkernel bench ... --json FILE` results (one or more files, e.g. one per world size)
into a markdown table of fused / compute per operator, shape and world size, and optionally a
PNG plot of the same.

    python3 tools/sweep_report.py --md table.md [--png plot.png] np2.json np4.json ...

fused / compute is the fused call's time over the same GEMM without communication, both timed
with every rank running (1.0: all communication hidden). The plot needs matplotlib."""
import argparse
import json
import sys


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        for r in doc.get("results", doc.get("rows", [])):
            r = dict(r)
            r.setdefault("world", doc.get("world"))
            rows.append(r)
    return rows


def ratio(r):
    if r.get("fused_over_compute"):
        return r["fused_over_compute"]
    if r.get("fused_ms") and r.get("compute_only_ms"):
        return r["fused_ms"] / r["compute_only_ms"]
    return None


def variant(r):
    """The route (RS/AR) and deterministic mode a row ran with ("-" for AG)."""
    v = r.get("route") or "-"
    return v + (" det" if r.get("deterministic") else "")


def table(rows):
    worlds = sorted({r["world"] for r in rows})
    keys = sorted({(r["op"], r["M"], r["N"], r["K"], variant(r)) for r in rows})
    head = "| op | M | N | K | variant | " + " | ".join(f"W={w} fused ms | W={w} compute ms | W={w} f/c" for w in worlds) + " |"
    out = [head, "| " + " | ".join(["---"] * (5 + 3 * len(worlds))) + " |"]
    for op, m, n, k, v in keys:
        cells = [op, str(m), str(n), str(k), v]
        for w in worlds:
            hit = [r for r in rows if (r["op"], r["M"], r["N"], r["K"], variant(r), r["world"]) == (op, m, n, k, v, w)]
            if not hit:
                cells += ["-", "-", "-"]
                continue
            r = hit[0]
            q = ratio(r)
            cells += [f"{r['fused_ms']:.3f}" if r.get("fused_ms") else "-",
                      f"{r['compute_only_ms']:.3f}" if r.get("compute_only_ms") else "-",
                      f"{q:.2f}" if q else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op and ratio(r)]
        for w in sorted({r["world"] for r in mine}):
            for nk in sorted({(r["N"], r["K"]) for r in mine}):
                pts = sorted((r["M"], ratio(r)) for r in mine if r["world"] == w and (r["N"], r["K"]) == nk)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=f"W={w} N={nk[0]} K={nk[1]}")
        ax.axhline(1.15, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("fused / compute")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--md", required=True)
    ap.add_argument("--png")
    a = ap.parse_args()
    rows = load(a.json)
    if not rows:
        sys.exit("sweep_report: no result rows in " + ", ".join(a.json))
    with open(a.md, "w") as f:
        f.write(table(rows))
    if a.png:
        plot(rows, a.png)


if __name__ == "__main__":
    main()
