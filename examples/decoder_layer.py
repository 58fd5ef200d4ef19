"""A Llama-style decoder block trained with sequence parallelism on mkernel's ops, under torch.compile.

Each of the W ranks of torchrun holds S/W tokens of the sequence in the zigzag layout (chunks r and
2W-1-r of 2W, which balances causal attention). The block:

    h   = x + Wo · ring_attention(RoPE(Wq · norm1(x)), RoPE(Wk · norm1(x)), Wv · norm1(x))   causal, GQA
    out = h + down(silu(gate(norm2(h))) * up(norm2(h)))

Attention is sequence parallel: the projections and norms are replicated and act on this rank's
tokens; ring_attention sees the whole sequence (its backward gathers K/V and returns dK/dV). The MLP
is tensor parallel: all_gather_matmul gathers the tokens inside the gate/up GEMM (each rank holds
2I/W rows of [gate; up]), matmul_reduce_scatter sums the down projection's partial products and
leaves each rank its tokens. Replicated weights' gradients are summed over the ranks (all_reduce).

The forward and backward run under torch.compile(fullgraph=True). The example checks itself
against the same block on one GPU in plain torch: every rank builds the unsharded weights and the
whole sequence from seeds and computes the loss and every gradient in fp32 (the reference) and in
bf16 with torch's ops (SDPA, matmuls). Bound, for the loss and for each gradient (x, both norms,
Wq, Wk, Wv, Wo, gate/up and down): max |mkernel - fp32| / max |fp32| at most 2x the same error of
torch's bf16 block plus 2^-8. Then tokens/s of forward + backward (median of --reps), beside torch's
block on one GPU at W = 1 (at W > 1 the ranks share the GPU under MPS: not comparable).

  torchrun --nproc-per-node 2 examples/decoder_layer.py [--tokens 4096 --hidden 2048 --heads 16
                                                         --kv-heads 4 --inter 5632 --reps 20]

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
    sys.exit("decoder_layer.py needs PyTorch (>= 2.4): pip install '.[torch]' from the source tree")

try:
    import mkernel.torch as mkt
except ImportError:
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import mkernel.torch as mkt  # noqa: E402

D = 128  # head dimension


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rope(x, pos):
    """Rotary embedding (rotate-half, theta 10000) of x [B, S, heads, D] at global positions pos [S]."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    ang = pos.float()[:, None] * inv[None, :]                      # [S, D/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x.float()[..., :D // 2], x.float()[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def make_weights(hidden, heads, kv_heads, inter):
    """The unsharded weights (nn.Linear layouts), bf16-rounded, the same on every rank."""
    g = torch.Generator().manual_seed(2024)

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=g) / fan_in ** 0.5).to(torch.bfloat16)

    return {
        "norm1": (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16),
        "wq": rnd(heads * D, hidden, fan_in=hidden),
        "wk": rnd(kv_heads * D, hidden, fan_in=hidden),
        "wv": rnd(kv_heads * D, hidden, fan_in=hidden),
        "wo": rnd(hidden, heads * D, fan_in=heads * D),
        "norm2": (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16),
        "gate": rnd(inter, hidden, fan_in=hidden),
        "up": rnd(inter, hidden, fan_in=hidden),
        "down": rnd(hidden, inter, fan_in=inter),
    }


def torch_block(x, P, heads, kv_heads, exact):
    """The block on one GPU in plain torch: x [1, S, hidden]. exact: fp32 with a float attention;
    otherwise bf16 with SDPA."""
    S = x.shape[1]
    pos = torch.arange(S, device=x.device)
    xn = rms_norm(x, P["norm1"])
    q = rope((xn @ P["wq"].t()).view(1, S, heads, D), pos)
    k = rope((xn @ P["wk"].t()).view(1, S, kv_heads, D), pos)
    v = (xn @ P["wv"].t()).view(1, S, kv_heads, D)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(heads // kv_heads, 1), vt.repeat_interleave(heads // kv_heads, 1)
    if exact:
        logits = (qt @ kt.transpose(-1, -2)) / D ** 0.5
        logits = logits.masked_fill(torch.ones(S, S, device=x.device, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(logits, -1) @ vt
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    h = x + o.transpose(1, 2).reshape(1, S, heads * D) @ P["wo"].t()
    hn = rms_norm(h, P["norm2"])
    return h + (F.silu(hn @ P["gate"].t()) * (hn @ P["up"].t())) @ P["down"].t()


class MkBlock(torch.nn.Module):
    """The block on mkernel's ops with this rank's parameters (replicated, or its MLP shard)."""

    def __init__(self, P, heads, kv_heads, W, rank):
        super().__init__()
        inter = P["gate"].shape[0]
        rows = slice(rank * inter // W, (rank + 1) * inter // W)
        self.heads, self.kv_heads = heads, kv_heads
        par = lambda t: torch.nn.Parameter(t.clone())  # noqa: E731
        self.norm1, self.wq, self.wk, self.wv, self.wo, self.norm2 = (
            par(P[n]) for n in ("norm1", "wq", "wk", "wv", "wo", "norm2"))
        self.gate_up = par(torch.cat([P["gate"][rows], P["up"][rows]]))  # [2I/W, hidden]
        self.down = par(P["down"][:, rows].contiguous())                # [hidden, I/W]
        self.replicated = ["norm1", "wq", "wk", "wv", "wo", "norm2"]

    def forward(self, x, pos):
        """x [1, S/W, hidden] (this rank's tokens), pos [S/W] their global positions."""
        s = x.shape[1]
        xn = rms_norm(x, self.norm1)
        q = rope((xn @ self.wq.t()).view(1, s, self.heads, D), pos)
        k = rope((xn @ self.wk.t()).view(1, s, self.kv_heads, D), pos)
        v = (xn @ self.wv.t()).view(1, s, self.kv_heads, D)
        o, _ = mkt.ring_attention(q, k, v, causal=True, layout="zigzag")
        h = x + o.reshape(1, s, self.heads * D) @ self.wo.t()
        hn = rms_norm(h, self.norm2)[0]                                   # [S/W, hidden]
        _, gu = mkt.all_gather_matmul(hn, self.gate_up.t())               # [S, 2I/W]: every token
        gate, up = gu.chunk(2, dim=-1)
        return h + mkt.matmul_reduce_scatter(F.silu(gate) * up, self.down.t())[None]  # [1, S/W, hidden]


def timed_median(fn, reps):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        sys.exit("decoder_layer.py needs a CUDA GPU per rank (or ranks sharing one under MPS); torch sees none "
                 "here (`mkernel doctor` says why)")
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    mkt.init()
    S, Hd, H, Hkv = args.tokens, args.hidden, args.heads, args.kv_heads
    if S % (2 * W) or (S // W) % 8 or args.inter % (8 * W) or H % Hkv:
        sys.exit(f"decoder_layer.py: tokens {S} must split into 2W chunks, inter {args.inter} into W multiples of 8, "
                 f"heads {H} into groups of kv-heads {Hkv}")
    dev = "cuda"
    P = {n: t.to(dev) for n, t in make_weights(Hd, H, Hkv, args.inter).items()}
    g = torch.Generator().manual_seed(7)
    x_full = torch.randn(1, S, Hd, generator=g).to(torch.bfloat16).to(dev)
    target = torch.randn(1, S, Hd, generator=g).to(dev)  # loss = mean((out * target))
    c = S // (2 * W)
    idx = torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * W - 1 - rank) * c, (2 * W - rank) * c)])
    idx = idx.to(dev)

    # ---- mkernel, sequence parallel, compiled ----
    block = MkBlock(P, H, Hkv, W, rank).to(dev)
    step = torch.compile(block, fullgraph=True)
    x = x_full[:, idx].detach().clone().requires_grad_()

    def mk_step():
        out = step(x, idx)
        loss = (out.float() * target[:, idx]).sum() / target.numel()
        loss.backward()
        return loss

    loss_local = mk_step()
    loss = mkt.all_reduce(loss_local.detach().reshape(1).repeat(8))[0]  # the sum over the ranks' tokens
    grads = {"x": x.grad.clone()}
    for n in block.replicated:  # replicated weights: the sum of the ranks' gradients
        grads[n] = mkt.all_reduce(getattr(block, n).grad.float().contiguous())
    inter_w = args.inter // W
    grads["gate"], grads["up"] = block.gate_up.grad[:inter_w].clone(), block.gate_up.grad[inter_w:].clone()
    grads["down"] = block.down.grad.clone()

    # ---- the same block on one GPU in plain torch: fp32 reference and torch's bf16 ops ----
    rows = slice(rank * inter_w, (rank + 1) * inter_w)
    results = {}
    for exact in (True, False):
        dt = torch.float32 if exact else torch.bfloat16
        Pr = {n: t.to(dt).requires_grad_() for n, t in P.items()}
        xr = x_full.to(dt).requires_grad_()
        out = torch_block(xr, Pr, H, Hkv, exact)
        lr = (out.float() * target).sum() / target.numel()
        lr.backward()
        gr = {"x": xr.grad[:, idx]}
        for n in ("norm1", "wq", "wk", "wv", "wo", "norm2"):
            gr[n] = Pr[n].grad
        gr["gate"], gr["up"], gr["down"] = Pr["gate"].grad[rows], Pr["up"].grad[rows], Pr["down"].grad[:, rows]
        results[exact] = (lr.detach(), gr)
    (l32, g32), (l16, g16) = results[True], results[False]

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    failed = []
    lines = []
    for name, ours, ref, theirs in [("loss", loss, l32, l16)] + [(n, grads[n], g32[n], g16[n]) for n in grads]:
        e, et = rel(ours, ref), rel(theirs, ref)
        bound = 2 * et + 2 ** -8
        ok = bool(torch.isfinite(ours).all()) and e <= bound
        lines.append(f"{name} {e:.2e} (torch bf16 {et:.2e}){'' if ok else ' OVER ' + f'{bound:.2e}'}")
        if not ok:
            failed.append(name)
    print(f"rank {rank}/{W}: loss {loss.item():.6f} (fp32 reference {l32.item():.6f}); max rel err vs fp32: "
          + ", ".join(lines), flush=True)

    # ---- tokens/s, forward + backward ----
    for _ in range(3):
        mk_step()
    torch.cuda.synchronize()
    dist.barrier()
    t_mk = timed_median(mk_step, args.reps)
    line = f"rank {rank}/{W}: mkernel block fwd+bwd {t_mk:.3f} ms, {S / t_mk * 1e3:,.0f} tokens/s"
    if W == 1:
        Pt = {n: t.clone().requires_grad_() for n, t in P.items()}
        xt = x_full.clone().requires_grad_()
        tblock = torch.compile(lambda xx: torch_block(xx, Pt, H, Hkv, False), fullgraph=True)

        def torch_step():
            out = tblock(xt)
            ((out.float() * target).sum() / target.numel()).backward()

        for _ in range(3):
            torch_step()
        t_t = timed_median(torch_step, args.reps)
        line += f"; torch's ops (compiled, SDPA) {t_t:.3f} ms, {S / t_t * 1e3:,.0f} tokens/s; ratio {t_t / t_mk:.2f}"
    else:
        line += " (ranks share one GPU under MPS: not comparable with torch's block on one GPU)"
    print(line, flush=True)
    dist.destroy_process_group()
    if failed:
        raise SystemExit(f"rank {rank}: over the bound: {', '.join(failed)}")


if __name__ == "__main__":
    main()
