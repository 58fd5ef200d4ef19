"""An expert-parallel MoE block trained on mkernel's MoE ops: router, dispatch, SwiGLU experts, combine.

Each of the W ranks of torchrun holds T tokens and E / W of the E experts (expert e on rank
e // (E / W)). The block:

    probs = softmax(x · Wrᵀ);  ids = top-k(probs) (chosen once, in fp32);  w = probs[ids] normalized
    out   = x + sum_k w[t, k] · FFN_{ids[t, k]}(x[t]),   FFN_e(v) = W2_e (silu(W1_e[:I] v) * (W1_e[I:] v))

with moe_dispatch sending each token's row to its experts' ranks (expert-major rows, counts and
offsets on the GPU), the local experts run in plain torch on their row blocks, and moe_combine
bringing the weighted sum back. Backward: through combine (the experts' outputs and the routing
weights, so the router learns) and through dispatch (the tokens); the router weights are
replicated, their gradient summed over the ranks (mkernel all_reduce).

The example checks itself against the same block on one GPU in plain torch: every rank builds
every rank's tokens and all experts from seeds and computes the loss over all W·T tokens and every
gradient in fp32 (the reference) and in bf16 with torch's ops. Bound, for the loss and each
gradient (this rank's x, the router, this rank's experts' W1 and W2): max |mkernel - fp32| / max
|fp32| at most 2x the same error of torch's bf16 block plus 2^-8. Then the step time (forward +
backward, median of --reps).

  torchrun --nproc-per-node 2 examples/moe_block.py [--tokens 512 --hidden 512 --experts 8 --topk 2
                                                     --inter 256 --reps 10]

Several ranks on one GPU need MPS (nvidia-cuda-mps-control -d); see docs/pytorch.md.
"""
import argparse
import os
import statistics
import sys

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except ModuleNotFoundError:
    sys.exit("moe_block.py needs PyTorch (>= 2.4): pip install '.[torch]' from the source tree")

try:
    import mkernel.torch as mkt
except ImportError:
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import mkernel.torch as mkt  # noqa: E402


def route(x, wr, ids):
    """The slots' weights: the router's probabilities of the chosen experts, normalized. The choice
    (ids) is made once, in fp32 (choose()): near-ties would otherwise pick different experts in
    different precisions and the comparison would measure that, not the arithmetic."""
    probs = torch.softmax((x @ wr.t()).float(), dim=-1)
    w = probs.gather(1, ids.long())
    return w / w.sum(-1, keepdim=True)


def choose(x, wr, k):
    return torch.softmax(x.float() @ wr.float().t(), dim=-1).topk(k, dim=-1).indices.to(torch.int32)


def ffn(v, w1, w2):
    inter = w1.shape[0] // 2
    h = v @ w1.t()
    return (F.silu(h[:, :inter]) * h[:, inter:]) @ w2.t()


def block_mkernel(x, wr, w1, w2, ids, E):
    """This rank's tokens x [T, H] and their experts ids [T, k]; w1 [E_local, 2I, H], w2 [E_local, H, I]
    this rank's experts."""
    w = route(x, wr, ids)
    recv, counts, offsets, r = mkt.moe_dispatch(x, ids, E)
    # Each local expert on its block of rows (the counts read on the host: one synchronization).
    parts, at = [], 0
    for j, (o, c) in enumerate(zip(offsets.tolist(), counts.tolist())):
        parts.append(ffn(recv[o:o + c], w1[j], w2[j]))
        at = o + c
    parts.append(recv.new_zeros((recv.shape[0] - at, recv.shape[1])))  # rows no token landed in
    y = torch.cat(parts)
    return x + mkt.moe_combine(y, w, r)


def block_reference(xs, wr, w1, w2, ids, dtype):
    """The block over every rank's tokens on one GPU: xs [W·T, H], w1 [E, 2I, H], w2 [E, H, I]."""
    x = xs.to(dtype)
    w = route(x, wr.to(dtype), ids)
    out = x.float().clone()
    for e in range(w1.shape[0]):
        t, slot = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            y = ffn(x[t], w1[e].to(dtype), w2[e].to(dtype))
            out.index_add_(0, t, w[t, slot][:, None] * y.float())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    mkt.init()
    T, H, E, k, inter = a.tokens, a.hidden, a.experts, a.topk, a.inter
    if E % W:
        sys.exit(f"moe_block.py: {E} experts do not split over {W} ranks")
    El = E // W
    g = torch.Generator().manual_seed(1234)
    xs = (torch.randn(W * T, H, generator=g)).cuda()
    wr = (torch.randn(E, H, generator=g) * H ** -0.5).cuda()
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5).cuda()
    w2 = (torch.randn(E, H, inter, generator=g) * inter ** -0.5).cuda()
    G = torch.randn(W * T, H, generator=g).cuda()  # the loss is <G, out>
    ids = choose(xs, wr, k)
    mine = slice(rank * T, (rank + 1) * T)
    experts = slice(rank * El, (rank + 1) * El)

    # mkernel: bf16 leaves of this rank's tokens and experts, the router replicated.
    x = xs[mine].to(torch.bfloat16).requires_grad_()
    wr_m = wr.to(torch.bfloat16).requires_grad_()
    w1_m = w1[experts].to(torch.bfloat16).requires_grad_()
    w2_m = w2[experts].to(torch.bfloat16).requires_grad_()

    def step():
        out = block_mkernel(x, wr_m, w1_m, w2_m, ids[mine], E)
        loss = (out.float() * G[mine]).sum()
        loss.backward()
        return loss

    loss = step()
    loss_all = mkt.all_reduce(loss.detach().reshape(1).repeat(8))[0]
    grad_wr = mkt.all_reduce(wr_m.grad.float())  # the router's gradient from every rank's tokens
    got = {"loss": loss_all, "x": x.grad, "router": grad_wr, "w1": w1_m.grad, "w2": w2_m.grad}

    # References on one GPU: fp32 and torch's bf16.
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.clone().to(dtype).requires_grad_() for t in (xs, wr, w1, w2)]
        out = block_reference(leaves[0], leaves[1], leaves[2], leaves[3], ids, dtype)
        loss_r = (out * G).sum()
        loss_r.backward()
        refs[dtype] = {"loss": loss_r.detach(), "x": leaves[0].grad[mine], "router": leaves[1].grad,
                       "w1": leaves[2].grad[experts], "w2": leaves[3].grad[experts]}
    failed = []
    for name, val in got.items():
        ref = refs[torch.float32][name].double()
        scale = ref.abs().max().item() or 1.0
        err = (val.double() - ref).abs().max().item() / scale
        err_bf16 = (refs[torch.bfloat16][name].double() - ref).abs().max().item() / scale
        bound = 2 * err_bf16 + 2 ** -8
        ok = err <= bound
        if not ok:
            failed.append(name)
        print(f"[rank {rank}] {name}: max err / max |ref| {err:.2e} (torch bf16 {err_bf16:.2e}, bound {bound:.2e}) "
              f"{'ok' if ok else 'FAIL'}", flush=True)

    # Step time: forward + backward.
    times = []
    for _ in range(a.reps):
        for t in (x, wr_m, w1_m, w2_m):
            t.grad = None
        dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    mkt.communicator().check_moe()
    if rank == 0:
        note = "" if W == 1 else " (ranks sharing one GPU under MPS are not comparable to separate GPUs)"
        print(f"moe_block W={W} T={T} H={H} E={E} k={k} I={inter}: {statistics.median(times):.3f} ms per "
              f"forward + backward{note}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
