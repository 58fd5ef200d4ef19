#!/usr/bin/env python3
"""Draws an mkernel trace (Chrome/Perfetto JSON from mk::write_chrome_trace) as a PNG timeline:
one row per SM, one bar per work item, coloured by role.

    python3 tools/trace_png.py trace.json timeline.png
Needs matplotlib."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"compute": "#1f77b4", "load": "#ff7f0e", "comm": "#2ca02c", "net-send": "#d62728",
           "net-recv": "#9467bd", "controller": "#8c564b", "wait": "#bcbd22", "epilogue": "#17becf"}


def main(src, dst):
    with open(src) as f:
        events = json.load(f)["traceEvents"]
    roles = sorted({e["cat"] for e in events})
    sms = sorted({e["tid"] for e in events})
    row = {sm: i for i, sm in enumerate(sms)}
    height = len(roles)
    fig, ax = plt.subplots(figsize=(14, max(4, len(sms) * 0.09 * height)))
    # One broken_barh per (SM, role): a call per event takes minutes for 10^5 events.
    bars = {}
    for e in events:
        bars.setdefault((e["tid"], e["cat"]), []).append((e["ts"], max(e["dur"], 0.05)))
    for (tid, cat), xs in bars.items():
        y = row[tid] * (height + 0.5) + roles.index(cat)
        ax.broken_barh(xs, (y, 0.9), facecolors=COLOURS.get(cat, "#7f7f7f"), linewidth=0)
    ax.set_xlabel("time (us)")
    ax.set_ylabel("SM (one band per SM; one row per role)")
    ax.set_yticks([])
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS.get(r, "#7f7f7f")) for r in roles]
    ax.legend(handles, roles, loc="upper right")
    ax.set_title(f"{len(events)} work items on {len(sms)} SMs")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
