"""mkernel's torch ops against torch's own fused ops and against the unfused NCCL + matmul path,
in the same run, at Llama-3-70B TP8 MLP shapes (hidden 8192, intermediate 28672 / 8 = 3584 per
rank; gate and up fused, N = 7168):

  up   (column parallel): C[S, 7168]  = all_gather(x[S/W, 8192]) @ w_gate_up.t()
  down (row parallel):    y[S/W, 8192] = reduce_scatter(h[S, 3584] @ w_down.t())

  mkernel       mkernel.torch.all_gather_matmul / matmul_reduce_scatter
  symm_mem      torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter
  nccl+matmul   all_gather_into_tensor + matmul; matmul + reduce_scatter_tensor (NCCL)
  matmul        the GEMM alone (cuBLAS through torch), no communication

Times: CUDA events around each call, median of --reps after --warmup, on every rank; rank 0
prints the slowest rank's median. The torch baselines need NCCL, which refuses ranks that share
a GPU: with ranks sharing one (MPS) only mkernel and matmul run, and those times are not
comparable with one GPU per rank (the ranks split the GPU's SMs and memory bandwidth).

  torchrun --nproc-per-node W bench/bench_torch.py [--tokens 4096] [--reps 50] [--out file.json]
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import mkernel.torch as mkt  # noqa: E402

HIDDEN, INTER_TP8 = 8192, 3584


def timed(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096, help="S: tokens of the whole sequence (all ranks)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("bench_torch.py: skipped: no GPU (torch sees none; `mkernel doctor` says why)")
        sys.exit(77)

    local = int(os.environ.get("LOCAL_RANK", "0"))
    W_env = int(os.environ.get("WORLD_SIZE", "1"))
    shared = torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", W_env))
    torch.cuda.set_device(local % torch.cuda.device_count())
    # NCCL for the baselines when every rank has its own GPU; gloo otherwise (mkernel uses the store only).
    dist.init_process_group("gloo" if shared else "cpu:gloo,cuda:nccl", device_id=None if shared else
                            torch.device("cuda", torch.cuda.current_device()))
    rank, W = dist.get_rank(), dist.get_world_size()
    comm = mkt.init()
    S = args.tokens
    if S % W:
        raise SystemExit(f"--tokens {S} does not split over {W} ranks")
    g = torch.Generator(device="cuda").manual_seed(rank)

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 0.05).to(torch.bfloat16)

    x = rnd(S // W, HIDDEN)
    w_up = rnd(2 * INTER_TP8, HIDDEN)   # nn.Linear weights [N, K]
    h = rnd(S, INTER_TP8)
    w_down = rnd(HIDDEN, INTER_TP8)
    rows = []

    def add(op, path, fn, baseline_of=None):
        try:
            us = timed(fn, args.warmup, args.reps)
            t = torch.tensor([us], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group)
            rows.append({"op": op, "path": path, "us": t.item()})
        except Exception as e:  # noqa: BLE001 — a baseline that cannot run here is reported, not fatal
            rows.append({"op": op, "path": path, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})

    cpu_group = dist.new_group(backend="gloo")
    add("up", "mkernel", lambda: mkt.all_gather_matmul(x, w_up.t()))
    x_full = torch.cat([x] * W)
    add("up", "matmul", lambda: x_full @ w_up.t())
    add("down", "mkernel", lambda: mkt.matmul_reduce_scatter(h, w_down.t()))
    add("down", "matmul", lambda: h @ w_down.t())
    if not shared:
        gathered = torch.empty(S, HIDDEN, dtype=torch.bfloat16, device="cuda")
        part = torch.empty(S // W, HIDDEN, dtype=torch.bfloat16, device="cuda")

        def ag_mm():
            dist.all_gather_into_tensor(gathered, x)
            return gathered @ w_up.t()

        def mm_rs():
            dist.reduce_scatter_tensor(part, h @ w_down.t())
            return part

        add("up", "nccl+matmul", ag_mm)
        add("down", "nccl+matmul", mm_rs)
        try:
            import torch.distributed._symmetric_memory as symm_mem
            symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
            name = dist.group.WORLD.group_name
            add("up", "symm_mem", lambda: torch.ops.symm_mem.fused_all_gather_matmul(x, [w_up.t()], 0, name))
            add("down", "symm_mem",
                lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w_down.t(), "sum", 0, name))
        except Exception as e:  # noqa: BLE001
            rows.append({"op": "up/down", "path": "symm_mem", "error": f"{type(e).__name__}: {e}"[:200]})
    comm.check()

    if rank == 0:
        note = ("ranks share one GPU (MPS): times not comparable with one GPU per rank; NCCL baselines "
                "cannot run" if shared else "one GPU per rank")
        print(f"bench_torch: W={W} S={S} tokens ({S // W}/rank), {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}; {note}")
        print(f"{'op':5} {'path':12} {'us':>10} {'mkernel speedup':>16}")
        mk = {r["op"]: r["us"] for r in rows if r["path"] == "mkernel" and "us" in r}
        for r in rows:
            if "us" in r:
                sp = f"{r['us'] / mk[r['op']]:.2f}x" if r["op"] in mk and r["path"] != "mkernel" else ""
                print(f"{r['op']:5} {r['path']:12} {r['us']:10.1f} {sp:>16}")
            else:
                print(f"{r['op']:5} {r['path']:12} {'n/a':>10}  {r['error']}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"W": W, "tokens": S, "shared_gpu": shared, "gpu": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "reps": args.reps, "warmup": args.warmup,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
