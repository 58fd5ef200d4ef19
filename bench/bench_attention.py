"""Attention forward: mkernel's sm_90a kernel against torch SDPA in the same run: the flash backend
(the issue's baseline) and the backend torch picks by default (cuDNN on Hopper when available).

bf16, B1 H32 D128 by default; S in {4096, 8192}, causal and not. Both read the same (B, H, S, D)
tensors (mkernel through strided views). Per repetition the two are timed in turn with CUDA
events after ~1 s of warm-up; the median of --reps is reported, with TFLOP/s (causal counts the
visible half) and ratio = SDPA time / mkernel time.
  python3 bench/bench_attention.py [--reps 30] [--json out.json] [--seqs 4096,8192] [--d 128]
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
from mkernel.attention import attention_forward  # noqa: E402


def timed(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("bench_attention.py: skipped: no GPU (torch sees none; `mkernel doctor` says why)")
        sys.exit(77)
    B, H, D = args.b, args.h, args.d
    variants = ["default"]  # one row per kernel variant timed side by side
    rows = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; B{B} H{H} D{D} bf16; median of {args.reps}; "
          f"ratio = SDPA time / mkernel time")
    print(f"{'S':>6} {'causal':>6} {'variant':>9} {'mkernel ms':>10} {'TFLOP/s':>8} {'flash ms':>8} {'TFLOP/s':>8}"
          f" {'ratio':>6} {'default ms':>10} {'TFLOP/s':>8} {'ratio':>6}")
    for S in [int(s) for s in args.seqs.split(",")]:
        for causal in (False, True):
            q, k, v = (torch.randn((B, H, S, D), device="cuda", dtype=torch.bfloat16) for _ in range(3))
            o = torch.empty_like(q)
            lse = torch.empty((B, H, S), device="cuda", dtype=torch.float32)
            qt, kt, vt, ot = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2)

            def ours():
                attention_forward(qt, kt, vt, causal=causal, out=ot, lse=lse)

            def ref():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def ref_default():  # whichever backend torch picks (cuDNN on Hopper when available)
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            # Same answer (bf16 tolerance) before timing, for every variant.
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                r = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            diffs = {}
            for var in variants:
                o.fill_(float("nan"))
                ours()
                diffs[var] = (o.float() - r.float()).abs().max().item()
            t_end = time.time() + 1.0
            while time.time() < t_end:
                for var in variants:
                    ours()
                ref()
                ref_default()
            torch.cuda.synchronize()
            tm = {var: [] for var in variants}
            ts, td = [], []
            for _ in range(args.reps):
                for var in variants:
                    tm[var].append(timed(ours))
                ts.append(timed(ref))
                td.append(timed(ref_default))
            ms, md = statistics.median(ts), statistics.median(td)
            flops = 4.0 * B * H * S * S * D / (2 if causal else 1)
            for var in variants:
                mm = statistics.median(tm[var])
                row = dict(B=B, H=H, S=S, D=D, causal=causal, variant=var, mkernel_ms=mm, sdpa_ms=ms,
                           mkernel_tflops=flops / mm / 1e9, sdpa_tflops=flops / ms / 1e9, ratio=ms / mm,
                           max_abs_diff_vs_sdpa=diffs[var], sdpa_default_ms=md, sdpa_default_tflops=flops / md / 1e9,
                           ratio_vs_default=md / mm)
                rows.append(row)
                print(f"{S:>6} {str(causal):>6} {var:>9} {mm:>10.3f} {row['mkernel_tflops']:>8.1f} {ms:>8.3f} "
                      f"{row['sdpa_tflops']:>8.1f} {row['ratio']:>6.3f} {md:>10.3f} {row['sdpa_default_tflops']:>8.1f}"
                      f" {row['ratio_vs_default']:>6.3f}   (max |diff| {diffs[var]:.2e})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, reps=args.reps, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
