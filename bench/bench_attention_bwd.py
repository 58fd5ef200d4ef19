"""Attention backward: mkernel's sm_90a kernel against torch SDPA's backward in the same run: the
backend torch picks by default (cuDNN on Hopper when available) and the flash backend.

bf16; per point (S, D, causal): both read the same (B, H, S, D) tensors (mkernel through strided
views), O and LSE from each one's own forward. Per repetition each backward is timed in turn with
CUDA events after ~1 s of warm-up (SDPA: torch.autograd.grad of its output, retained graph; mkernel:
attention_backward, its workspace included); the median of --reps is reported, with TFLOP/s
(5 GEMMs; causal counts the visible half) and ratio = SDPA time / mkernel time.
  python3 bench/bench_attention_bwd.py [--reps 20] [--json out.json] [--seqs 1024,4096,8192]
                                       [--ds 64,128] [--bh 1x32] [--deterministic]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from mkernel.attention import attention_backward, attention_forward  # noqa: E402


def timed(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def flops(B, H, S, D, causal):
    f = 10.0 * B * H * S * S * D
    return f / 2 if causal else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--seqs", default="1024,4096,8192")
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--bh", default="1x32", help="BxH pairs, comma-separated (e.g. 1x32,4x16)")
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("bench_attention_bwd.py: skipped: no GPU (torch sees none; `mkernel doctor` says why)")
        sys.exit(77)
    rows = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; bf16; median of {args.reps}; "
          f"ratio = SDPA backward time / mkernel backward time; deterministic={args.deterministic}")
    print(f"{'BxH':>6} {'D':>4} {'S':>6} {'causal':>6} {'mkernel ms':>10} {'TFLOP/s':>8} {'default ms':>10} {'TFLOP/s':>8}"
          f" {'ratio':>6} {'flash ms':>8} {'ratio':>6}")
    for bh in args.bh.split(","):
        B, H = (int(x) for x in bh.split("x"))
        for D in [int(d) for d in args.ds.split(",")]:
            for S in [int(s) for s in args.seqs.split(",")]:
                for causal in (False, True):
                    q, k, v, do = (torch.randn((B, H, S, D), device="cuda", dtype=torch.bfloat16) for _ in range(4))
                    qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))
                    o, lse = attention_forward(qt, kt, vt, causal=causal)
                    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)

                    def ours():
                        attention_backward(qt, kt, vt, o, lse, dot, causal=causal, deterministic=args.deterministic,
                                           dq=dq, dk=dk, dv=dv)

                    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))

                    def make_ref(backend):
                        if backend is None:
                            out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                        else:
                            with sdpa_kernel(backend):
                                out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                        return lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)

                    ref_default = make_ref(None)
                    ref_flash = make_ref(SDPBackend.FLASH_ATTENTION)
                    fns = [ours, ref_default, ref_flash]
                    t_end = time.time() + 1.0
                    while time.time() < t_end:
                        for f in fns:
                            f()
                    torch.cuda.synchronize()
                    ts = [[], [], []]
                    for _ in range(args.reps):
                        for i, f in enumerate(fns):
                            ts[i].append(timed(f))
                    med = [statistics.median(t) for t in ts]
                    fl = flops(B, H, S, D, causal)
                    tf = [fl / (m * 1e-3) / 1e12 for m in med]
                    r = {"B": B, "H": H, "D": D, "S": S, "causal": causal, "mkernel_ms": med[0], "mkernel_tflops": tf[0],
                         "default_ms": med[1], "default_tflops": tf[1], "ratio_default": med[1] / med[0],
                         "flash_ms": med[2], "ratio_flash": med[2] / med[0], "deterministic": args.deterministic}
                    rows.append(r)
                    print(f"{B}x{H:<4} {D:>4} {S:>6} {str(causal):>6} {med[0]:>10.3f} {tf[0]:>8.1f} {med[1]:>10.3f}"
                          f" {tf[1]:>8.1f} {r['ratio_default']:>6.2f} {med[2]:>8.3f} {r['ratio_flash']:>6.2f}", flush=True)
                    del q, k, v, do, o, lse, dq, dk, dv, qr, kr, vr, fns, ref_default, ref_flash
                    torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
