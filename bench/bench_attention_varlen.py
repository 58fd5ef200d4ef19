"""Packed variable-length attention (cu_seqlens) against the dense kernel at equal total tokens.

Per point (D, causal, document length L): T tokens as T / L documents of L rows, run by mkernel's
varlen forward and backward (one packed (T, H, D) sequence) and by its dense ones (B = T / L,
S = L): the same FLOPs. A "mixed" point packs documents of random lengths (uniform in
[--mixed-min, --mixed-max], a printed seed) and reports its TFLOP/s next to the dense kernel's at
the mean length. CUDA events around --inner calls back to back (the host's Python and launch
work then overlaps the GPU's, which a single short call's events would count), after ~1 s of
warm-up; the median of --reps, per call.
ratio = dense time / varlen time (1.0: no cost for the packing).
  python3 bench/bench_attention_varlen.py [--reps 20] [--inner 10] [--json out.json] [--tokens 32768] [--heads 16]
                                          [--lens 512,2048,8192] [--ds 64,128]
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from mkernel.attention import (attention_backward, attention_forward, attention_varlen_backward,  # noqa: E402
                               attention_varlen_forward)


def timed(fn, inner):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(inner):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / inner


def medians(fns, reps, inner):
    t_end = time.time() + 1.0
    while time.time() < t_end:
        for f in fns:
            f()
    torch.cuda.synchronize()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            ts[i].append(timed(f, inner))
    return [statistics.median(t) for t in ts]


def fwd_flops(lens, H, D, causal):
    f = sum(4.0 * H * L * L * D for L in lens)
    return f / 2 if causal else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--lens", default="512,2048,8192")
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--mixed-min", type=int, default=128)
    ap.add_argument("--mixed-max", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("bench_attention_varlen.py: skipped: no GPU (torch sees none; `mkernel doctor` says why)")
        sys.exit(77)
    seed = args.seed or int.from_bytes(os.urandom(4), "little")
    rnd = random.Random(seed)
    T, H = args.tokens, args.heads
    rows = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; bf16; T {T} tokens, H {H}; median of "
          f"{args.reps} x {args.inner} calls; ratio = dense time / varlen time; mixed seed {seed}")
    print(f"{'D':>4} {'causal':>6} {'docs':>14} {'pass':>4} {'varlen ms':>9} {'TFLOP/s':>8} {'dense ms':>9} "
          f"{'TFLOP/s':>8} {'ratio':>6}")
    for D in [int(d) for d in args.ds.split(",")]:
        for causal in (False, True):
            points = [("%dx%d" % (T // L, L), [L] * (T // L)) for L in (int(x) for x in args.lens.split(","))]
            mixed = []
            while sum(mixed) < T:
                mixed.append(min(rnd.randint(args.mixed_min, args.mixed_max), T - sum(mixed)))
            points.append((f"mixed {len(mixed)}", mixed))
            for label, lens in points:
                S = sum(lens)
                cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
                q, k, v, do = (torch.randn((S, H, D), device="cuda", dtype=torch.bfloat16) for _ in range(4))
                o, lse = attention_varlen_forward(q, k, v, cu, causal=causal)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                # Dense: B documents of the (mean) length.
                Ld = lens[0] if label[0] != "m" else max(128, round(S / len(lens) / 8) * 8)
                Bd = S // Ld
                qd, kd, vd, dod = (t[:Bd * Ld].view(Bd, Ld, H, D) for t in (q, k, v, do))
                od, lsed = attention_forward(qd, kd, vd, causal=causal)
                dqd, dkd, dvd = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)
                fns = {
                    "fwd": (lambda: attention_varlen_forward(q, k, v, cu, causal=causal, out=o, lse=lse),
                            lambda: attention_forward(qd, kd, vd, causal=causal, out=od, lse=lsed)),
                    "bwd": (lambda: attention_varlen_backward(q, k, v, o, lse, do, cu, causal=causal, dq=dq, dk=dk,
                                                              dv=dv),
                            lambda: attention_backward(qd, kd, vd, od, lsed, dod, causal=causal, dq=dqd, dk=dkd,
                                                       dv=dvd)),
                }
                for what, (fv, fd) in fns.items():
                    mv, md = medians([fv, fd], args.reps, args.inner)
                    mul = 2.5 if what == "bwd" else 1.0
                    fl_v = fwd_flops(lens, H, D, causal) * mul
                    fl_d = fwd_flops([Ld] * Bd, H, D, causal) * mul
                    r = {"D": D, "causal": causal, "docs": label, "pass": what, "varlen_ms": mv,
                         "varlen_tflops": fl_v / (mv * 1e-3) / 1e12, "dense_ms": md,
                         "dense_tflops": fl_d / (md * 1e-3) / 1e12, "dense_B": Bd, "dense_S": Ld,
                         "ratio": md / mv if label[0] != "m" else None, "tokens": S, "H": H}
                    rows.append(r)
                    ratio = f"{r['ratio']:>6.3f}" if r["ratio"] is not None else f"{'-':>6}"
                    print(f"{D:>4} {str(causal):>6} {label:>14} {what:>4} {mv:>9.3f} {r['varlen_tflops']:>8.1f} "
                          f"{md:>9.3f} {r['dense_tflops']:>8.1f} {ratio}", flush=True)
                del q, k, v, do, o, lse, dq, dk, dv, qd, kd, vd, dod, od, lsed, dqd, dkd, dvd, fns
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
                       "inner": args.inner,
                       "seed": seed, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
