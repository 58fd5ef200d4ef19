"""mkernel.torch on the GPU, as a user runs it: torchrun --nproc-per-node W (ranks may share one GPU
under MPS). Every rank builds every rank's inputs from seeds, so the references need no
communication (and no NCCL, which refuses ranks sharing a GPU).

  results against fp64 references (random bf16 data) and bit-exact with small integers;
  odd and tiny shapes, 3-D inputs with gather/scatter along another dimension, B given
  contiguous or as an nn.Linear weight's transpose; autograd gradients against fp64 autograd;
  torch.library.opcheck; CUDA-graph capture replayed 100 times with fresh data each replay;
  torch.compile(fullgraph=True) of a tensor-parallel MLP, forward and backward, no graph break;
  MoE dispatch/combine: the receive layout and copies bit-exact, combine against float64, the
  gradients of x and of the routing weights against float64, compiled and graph-replayed;
  ring attention (contiguous and zigzag, causal and not, GQA) against a full-sequence reference,
  and its gradients and the single-GPU attention's against float64 and SDPA's backward;
  library errors as MkError; teardown through torch.distributed.destroy_process_group.

Tolerances (random data): the outputs are bf16, rounded once from fp32 accumulation, so an
element may differ from the exact value by half a bf16 ulp (2^-8 relative) plus the fp32
accumulation error; we allow 2^-7 |ref| + 2^-8 rms(ref) per element (gradients, which pass
through one more bf16 rounding: 2^-6 |ref| + 2^-7 rms(ref)). A wrong row, rank or sum is off
by O(rms) and fails. Integer data in {-1, 0, 1} with K <= 64 gives sums exact in bf16: those
runs must match bit for bit.

Exit 0 when every check passed on every rank, 1 otherwise; 77 when there is no GPU or torch.
"""
import os
import sys
import time
import traceback

try:
    import torch
    import torch.distributed as dist
except ImportError:
    print("test_torch_ops: torch is not installed: SKIPPED")
    sys.exit(77)
if not torch.cuda.is_available():
    print("test_torch_ops: no GPU: SKIPPED")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import mkernel  # noqa: E402
import mkernel.torch as mkt  # noqa: E402

bf16 = torch.bfloat16
results = []  # (name, ok, detail)


def check(name):
    def wrap(fn):
        t0 = time.time()
        try:
            detail = fn() or ""
            results.append((name, True, f"{detail} ({time.time() - t0:.1f} s)"))
        except Exception as e:  # noqa: BLE001 — every check runs on every rank, failures are collected
            results.append((name, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return fn
    return wrap


def gen(seed, *shape, kind="randn", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    if kind == "int":
        t = torch.randint(-1, 2, shape, generator=g).to(torch.float32)
    else:
        t = torch.randn(*shape, generator=g) * scale
    return t.to(bf16).cuda()


def close(name, got, ref, grad=False):
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
    rms = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
    rtol, atol = (2 ** -6, 2 ** -7 * rms) if grad else (2 ** -7, 2 ** -8 * rms)
    err = (got - ref).abs()
    bad = err > rtol * ref.abs() + atol
    if not torch.isfinite(got).all() or bad.any():
        i = int(bad.flatten().nonzero()[0]) if bad.any() else -1
        raise AssertionError(f"{name}: {int(bad.sum())} of {got.numel()} elements off; first at flat {i}: "
                             f"got {got.flatten()[i].item()} ref {ref.flatten()[i].item()} (rms {rms:.3g})")
    return (err / (ref.abs() + rms + 1e-30)).max().item() if ref.numel() else 0.0


def rel_rms(got, ref):
    got, ref = got.double(), ref.double()
    rms = ref.pow(2).mean().sqrt()
    return ((got - ref).abs() / (ref.abs() + rms)).max().item()


def exact(name, got, ref):
    if got.shape != ref.shape or not torch.equal(got.float(), ref.float()):
        diff = (got.float() - ref.float()).abs()
        raise AssertionError(f"{name}: not bit-exact: {int((diff > 0).sum())} elements differ, max {diff.max()}")


def main():
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    comm = mkt.init()  # nodes: from the hosts, or emulated with MK_RANKS_PER_NODE
    tag = f"W={W} nodes={comm.nodes}"
    if rank == 0:
        print(f"test_torch_ops: {tag}, {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    # ---- forward results, every op and shape kind ---------------------------------------------
    @check("all_gather_matmul random (m, N, K) in (128,256,512) (40,72,136) (1,8,8), 3-D gather_dim 1")
    def _():
        worst = 0.0
        for i, (m, N, K) in enumerate([(128, 256, 512), (40, 72, 136), (1, 8, 8)]):
            shards = [gen(100 + 10 * i + r, m, K) for r in range(W)]
            w = gen(200 + 10 * i + rank, N, K)  # this rank's nn.Linear weight
            g, c = mkt.all_gather_matmul(shards[rank], w.t(), return_a=True)
            full = torch.cat(shards)
            exact("gathered A", g, full)
            worst = max(worst, close(f"C m={m} N={N} K={K}", c, full.double() @ w.double().t()))
            _, c2 = mkt.all_gather_matmul(shards[rank], w.t().contiguous())  # b contiguous [K, N]: copied once
            exact("b contiguous vs weight.t()", c2, c)
        # [B, S/W, K] gathered along the sequence
        xs = [gen(300 + r, 2, 24, 64) for r in range(W)]
        w = gen(310 + rank, 48, 64)
        _, c = mkt.all_gather_matmul(xs[rank], w.t(), gather_dim=1)
        worst = max(worst, close("3-D gather_dim=1", c, torch.cat(xs, 1).double() @ w.double().t()))
        return f"max rel err {worst:.2e}"

    @check("matmul_reduce_scatter random, 3-D scatter_dim 1")
    def _():
        worst = 0.0
        for i, (M, N, K) in enumerate([(256, 384, 256), (8 * W, 40, 72), (W, 8, 8)]):
            a = [gen(400 + 10 * i + r, M, K) for r in range(W)]
            w = [gen(500 + 10 * i + r, N, K) for r in range(W)]
            out = mkt.matmul_reduce_scatter(a[rank], w[rank].t())
            s = sum(a[r].double() @ w[r].double().t() for r in range(W))
            worst = max(worst, close(f"RS M={M} N={N} K={K}", out, s[rank * M // W:(rank + 1) * M // W]))
        a = [gen(600 + r, 2, 8 * W, 64) for r in range(W)]
        w = [gen(610 + r, 32, 64) for r in range(W)]
        out = mkt.matmul_reduce_scatter(a[rank], w[rank].t(), scatter_dim=1)
        s = sum(a[r].double() @ w[r].double().t() for r in range(W))
        worst = max(worst, close("3-D scatter_dim=1", out, s[:, rank * 8:(rank + 1) * 8]))
        return f"max rel err {worst:.2e}"

    @check("matmul_all_reduce random, 3-D input")
    def _():
        a = [gen(700 + r, 3, 40, 96) for r in range(W)]
        w = [gen(710 + r, 56, 96) for r in range(W)]
        out = mkt.matmul_all_reduce(a[rank], w[rank].t())
        return f"max rel err {close('AR', out, sum(a[r].double() @ w[r].double().t() for r in range(W))):.2e}"

    @check("integer data: all three ops bit-exact")
    def _():
        m, N, K = 48, 64, 64
        x = [gen(800 + r, m, K, kind="int") for r in range(W)]
        w = [gen(810 + r, N, K, kind="int") for r in range(W)]
        _, c = mkt.all_gather_matmul(x[rank], w[rank].t())
        exact("AG", c, torch.cat(x).float() @ w[rank].float().t())
        s = sum(x[r].float() @ w[r].float().t() for r in range(W))
        exact("RS", mkt.matmul_reduce_scatter(x[rank], w[rank].t()), s[rank * m // W:(rank + 1) * m // W])
        exact("AR", mkt.matmul_all_reduce(x[rank], w[rank].t()), s)

    @check("uneven shards (shard_sizes): all three ops bit-exact on integer data, and their backwards")
    def _():
        sizes = [1 + (37 * r + 11) % 60 for r in range(W)]  # 1 to 60 rows per rank
        M, N, K = sum(sizes), 64, 64
        lo = sum(sizes[:rank])
        x = [gen(850 + r, sizes[r], K, kind="int") for r in range(W)]
        w = [gen(860 + r, N, K, kind="int") for r in range(W)]
        _, c = mkt.all_gather_matmul(x[rank], w[rank].t(), shard_sizes=sizes)
        exact("AG uneven", c, torch.cat(x).float() @ w[rank].float().t())
        a = [gen(870 + r, M, K, kind="int") for r in range(W)]
        s = sum(a[r].float() @ w[r].float().t() for r in range(W))
        exact("RS uneven", mkt.matmul_reduce_scatter(a[rank], w[rank].t(), shard_sizes=sizes), s[lo:lo + sizes[rank]])
        exact("AR on M rows", mkt.matmul_all_reduce(a[rank][: M - 1 if M > W else M], w[rank].t()),
              s[: M - 1 if M > W else M])
        # Backward of AG on uneven shards: d x = this rank's rows of reduce_scatter(g @ w), exact.
        xr = x[rank].clone().requires_grad_()
        g = [gen(880 + r, M, N, kind="int") for r in range(W)]
        _, c = mkt.all_gather_matmul(xr, w[rank].t(), shard_sizes=sizes)
        (c.float() * g[rank].float()).sum().backward()
        want = sum(g[r].float() @ w[r].float() for r in range(W))[lo:lo + sizes[rank]]
        exact("AG uneven backward", xr.grad, want)

    # ---- autograd ------------------------------------------------------------------------------
    @check("autograd: all_gather_matmul and matmul_reduce_scatter (each the other's backward), matmul_all_reduce")
    def _():
        m, K, N = 32, 128, 96
        xs = [gen(900 + r, m, K) for r in range(W)]
        ws = [gen(910 + r, N, K) for r in range(W)]
        gs = [gen(920 + r, m * W, N) for r in range(W)]
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        _, c = mkt.all_gather_matmul(x, w.t())
        (c.float() * gs[rank].float()).sum().backward()
        X = [t.double().requires_grad_() for t in xs]
        Wd = [t.double().requires_grad_() for t in ws]
        full = torch.cat(X)
        sum(((full @ Wd[r].t()) * gs[r].double()).sum() for r in range(W)).backward()
        e1 = close("AG d a", x.grad, X[rank].grad, grad=True)
        e2 = close("AG d w", w.grad, Wd[rank].grad, grad=True)

        M, Kl, N = 16 * W, 64, 80
        hs = [gen(930 + r, M, Kl) for r in range(W)]
        vs = [gen(940 + r, N, Kl) for r in range(W)]
        gs = [gen(950 + r, M // W, N) for r in range(W)]
        h, v = hs[rank].clone().requires_grad_(), vs[rank].clone().requires_grad_()
        (mkt.matmul_reduce_scatter(h, v.t()).float() * gs[rank].float()).sum().backward()
        H = [t.double().requires_grad_() for t in hs]
        V = [t.double().requires_grad_() for t in vs]
        S = sum(H[r] @ V[r].t() for r in range(W))
        sum((S[r * M // W:(r + 1) * M // W] * gs[r].double()).sum() for r in range(W)).backward()
        e3 = close("RS d a", h.grad, H[rank].grad, grad=True)
        e4 = close("RS d w", v.grad, V[rank].grad, grad=True)

        h, v = hs[rank].clone().requires_grad_(), vs[rank].clone().requires_grad_()
        g = gen(960, M, N)  # the same on every rank, as after an all-reduce
        (mkt.matmul_all_reduce(h, v.t()).float() * g.float()).sum().backward()
        close("AR d a", h.grad, g.double() @ vs[rank].double(), grad=True)
        close("AR d w", v.grad, g.double().t() @ hs[rank].double(), grad=True)
        return f"max rel err {max(e1, e2, e3, e4):.2e}"

    @check("torch.library.opcheck of the three GEMM ops")
    def _():
        name = comm.group_name
        a, w = gen(970 + rank, 8 * W, 64), gen(980 + rank, 32, 64)
        for op, args in ((torch.ops.mkernel.all_gather_matmul.default, (a, w.t(), name, W, True)),
                         (torch.ops.mkernel.matmul_reduce_scatter.default, (a, w.t(), name, W)),
                         (torch.ops.mkernel.matmul_all_reduce.default, (a, w.t(), name, W))):
            res = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                              "test_autograd_registration"))
            bad = {k: v for k, v in res.items() if v != "SUCCESS"}
            if bad:
                raise AssertionError(f"{op}: {bad}")

    # ---- CUDA graph ----------------------------------------------------------------------------
    @check("CUDA graph: AG, RS and AR captured once, replayed 100 times with fresh integer data, bit-exact")
    def _():
        m, N, K = 32, 64, 64
        sx, sw = torch.empty(m, K, dtype=bf16, device="cuda"), torch.empty(N, K, dtype=bf16, device="cuda")
        ra, rw = torch.empty(m * W, K, dtype=bf16, device="cuda"), torch.empty(N, K, dtype=bf16, device="cuda")

        def step():
            return (mkt.all_gather_matmul(sx, sw.t())[1], mkt.matmul_reduce_scatter(ra, rw.t()),
                    mkt.matmul_all_reduce(ra, rw.t()))

        sx.copy_(gen(1000 + rank, m, K, kind="int"))
        sw.copy_(gen(1001 + rank, N, K, kind="int"))
        ra.copy_(gen(1002 + rank, m * W, K, kind="int"))
        rw.copy_(gen(1003 + rank, N, K, kind="int"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: creates the operators (collective, outside capture)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for it in range(100):
            xs = [gen(2000 + 7 * it + r, m, K, kind="int") for r in range(W)]
            wx = gen(3000 + 7 * it + rank, N, K, kind="int")
            As = [gen(4000 + 7 * it + r, m * W, K, kind="int") for r in range(W)]
            Ws = [gen(5000 + 7 * it + r, N, K, kind="int") for r in range(W)]
            sx.copy_(xs[rank]), sw.copy_(wx), ra.copy_(As[rank]), rw.copy_(Ws[rank])
            graph.replay()
            exact(f"replay {it} AG", outs[0], torch.cat(xs).float() @ wx.float().t())
            s = sum(As[r].float() @ Ws[r].float().t() for r in range(W))
            exact(f"replay {it} RS", outs[1], s[rank * m:(rank + 1) * m])
            exact(f"replay {it} AR", outs[2], s)
        comm.check()
        return "100 replays"

    @check("capture of a shape that never ran outside capture: MkError naming the warm-up")
    def _():
        a, w = gen(1100, 8 * W + 8 * W, 64), gen(1101, 24, 64)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                mkt.matmul_all_reduce(a, w.t())
        except mkernel.MkError as e:
            if "warm-up" not in str(e):
                raise
            return "raised: " + str(e)[:80]
        raise AssertionError("no error")

    # ---- torch.compile ---------------------------------------------------------------------------
    @check("torch.compile(fullgraph=True) of a tensor-parallel MLP, forward and backward, no graph break")
    def _():
        import torch._dynamo
        torch._dynamo.reset()
        S, Hd, I = 64 * W, 256, 128  # tokens (sequence parallel), hidden, this rank's intermediate

        class TPMLP(torch.nn.Module):
            def __init__(self, seed):
                super().__init__()
                self.gate = torch.nn.Parameter(gen(seed, I, Hd, scale=0.05))
                self.up = torch.nn.Parameter(gen(seed + 1, I, Hd, scale=0.05))
                self.down = torch.nn.Parameter(gen(seed + 2, Hd, I, scale=0.05))

            def forward(self, x):  # x: [S/W, H] this rank's tokens
                _, g = mkt.all_gather_matmul(x, self.gate.t())
                _, u = mkt.all_gather_matmul(x, self.up.t())
                return mkt.matmul_reduce_scatter(torch.nn.functional.silu(g) * u, self.down.t())

        eager, compiled_mod = TPMLP(1200 + 3 * rank), TPMLP(1200 + 3 * rank)
        compiled = torch.compile(compiled_mod, fullgraph=True)
        x = gen(1300 + rank, S // W, Hd)
        gout = gen(1310 + rank, S // W, Hd)
        ye = eager(x)
        (ye.float() * gout.float()).sum().backward()
        yc = compiled(x)
        (yc.float() * gout.float()).sum().backward()
        breaks = torch._dynamo.utils.counters["graph_break"]
        if breaks:
            raise AssertionError(f"graph breaks: {dict(breaks)}")
        # Inductor fuses silu(g) * u in fp32 where eager rounds each step to bf16, so the two
        # differ by those roundings carried through the last GEMM: compared as relative to
        # |ref| + rms(ref) (an element near zero is not held to a relative bound).
        for what, got, ref in [("y", yc, ye)] + [(f"d{n}", getattr(compiled_mod, n).grad, getattr(eager, n).grad)
                                                for n in ("gate", "up", "down")]:
            e = rel_rms(got, ref)
            if e > 2 ** -5:
                raise AssertionError(f"compiled vs eager {what}: max err / (|ref| + rms) {e:.3g} > 2^-5")
        # and the eager module against an fp64 reference of the whole layer over every rank
        xs = [gen(1300 + r, S // W, Hd).double() for r in range(W)]
        xf = torch.cat(xs)
        acc = 0
        for r in range(W):
            m = TPMLP(1200 + 3 * r)
            g, u = xf @ m.gate.double().t(), xf @ m.up.double().t()
            acc = acc + (torch.nn.functional.silu(g) * u) @ m.down.double().t()
        # two bf16 roundings inside (g, u; the SwiGLU product) before the last GEMM: 2^-5 relative
        err = rel_rms(ye, acc[rank * S // W:(rank + 1) * S // W])
        if err > 2 ** -5:
            raise AssertionError(f"eager TP MLP vs fp64 reference: max rel err {err:.3g} > 2^-5")
        return f"vs fp64 max rel err {err:.2e}"

    # ---- ring attention ----------------------------------------------------------------------------
    def ring_rows(layout, s):
        """This rank's rows of the whole sequence (s per rank): chunk `rank` of W, or chunks rank and
        2W-1-rank of 2W (zigzag)."""
        if layout == "contiguous":
            return torch.arange(rank * s, (rank + 1) * s).cuda()
        c = s // 2
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * W - 1 - rank) * c, (2 * W - rank) * c)]).cuda()

    def attn_ref(q, k, v, causal, dt=torch.float32):
        """(O, LSE) of attention over the whole sequence in dt; (B, S, H, D) tensors, LSE (B, H, S)."""
        H, Hkv, D, S = q.shape[2], k.shape[2], q.shape[3], q.shape[1]
        qf, kf, vf = (t.to(dt).transpose(1, 2) for t in (q, k, v))
        kf, vf = kf.repeat_interleave(H // Hkv, 1), vf.repeat_interleave(H // Hkv, 1)
        logits = (qf @ kf.transpose(-1, -2)) / D ** 0.5
        if causal:
            logits = logits.masked_fill(torch.ones(S, S, device="cuda").triu(1).bool(), float("-inf"))
        return (torch.softmax(logits, -1) @ vf).transpose(1, 2), torch.logsumexp(logits, -1)

    @check("ring_attention: contiguous and zigzag, causal and not, GQA, against a full-sequence fp32 reference")
    def _():
        B, H, Hkv, D, s = 1, 4, 2, 128, 128  # s tokens per rank
        S = s * W
        q, k, v = (gen(1400 + i, B, S, h, D) for i, h in ((0, H), (1, Hkv), (2, Hkv)))
        worst = 0.0
        for layout in ("contiguous", "zigzag"):
            idx = ring_rows(layout, s)
            for causal in (False, True):
                o, lse = mkt.ring_attention(q[:, idx], k[:, idx], v[:, idx], causal=causal, layout=layout)
                ref_o, ref_lse = attn_ref(q, k, v, causal)
                worst = max(worst, close(f"O {layout} causal={causal}", o, ref_o[:, idx], grad=True))
                d = (lse - ref_lse[:, :, idx]).abs().max().item()
                if d > 1e-3:
                    raise AssertionError(f"LSE {layout} causal={causal}: max abs err {d:.3g} > 1e-3")
        return f"max rel err {worst:.2e}"

    # ---- attention gradients ------------------------------------------------------------------------
    # Bound per gradient (dQ, dK, dV): max abs error against the float64 gradient at most 2x that
    # of torch SDPA's backward in bf16 on the same inputs (FlashAttention's own test bound) plus
    # 2^-8 of the gradient's largest magnitude (the ring's dK / dV are sums of up to 2W bf16
    # partials, each rounded once).
    def attn_grads_ref(q, k, v, do, causal):
        """float64 and SDPA (bf16) gradients of attention over the whole sequence; (B, S, H, D) tensors."""
        H, Hkv, D, S = q.shape[2], k.shape[2], q.shape[3], q.shape[1]
        out = []
        for dt in (torch.float64, bf16):
            leaves = [t.to(dt).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
            kk, vv = (t.repeat_interleave(H // Hkv, 1) for t in leaves[1:])
            if dt == torch.float64:
                logits = leaves[0] @ kk.transpose(-1, -2) / D ** 0.5
                if causal:
                    logits = logits.masked_fill(torch.ones(S, S, device="cuda").triu(1).bool(), float("-inf"))
                o = torch.softmax(logits, -1) @ vv
            else:
                o = torch.nn.functional.scaled_dot_product_attention(leaves[0], kk, vv, is_causal=causal)
            o.backward(do.to(dt).transpose(1, 2).contiguous())
            out.append([t.grad.transpose(1, 2) for t in leaves])
        return out

    def masked_refs(q, k, v, do, vis):
        """O and the gradients of attention over the whole sequence with the mask vis [S, S], in
        float64 and through SDPA (bf16): ([O64, Obf16], [[dq, dk, dv]64, [...]bf16], LSE64)."""
        H, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
        grads, outs, ref_lse = [], [], None
        for dt in (torch.float64, bf16):
            ls = [t.to(dt).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
            kk, vv = (t.repeat_interleave(H // Hkv, 1) for t in ls[1:])
            if dt == torch.float64:
                logits = (ls[0] @ kk.transpose(-1, -2) / D ** 0.5).masked_fill(~vis, float("-inf"))
                ref_lse = torch.logsumexp(logits, -1)
                out = torch.softmax(logits, -1) @ vv
            else:
                out = torch.nn.functional.scaled_dot_product_attention(ls[0], kk, vv, attn_mask=vis)
            out.backward(do.to(dt).transpose(1, 2).contiguous())
            outs.append(out.transpose(1, 2))
            grads.append([t.grad.transpose(1, 2) for t in ls])
        return outs, grads, ref_lse

    def grad_bound(name, got, ref, sdpa):
        err = (got.double() - ref).abs().max().item()
        serr = (sdpa.double() - ref).abs().max().item()
        bound = 2 * serr + 2 ** -8 * ref.abs().max().item()
        if not torch.isfinite(got).all() or not err <= bound:
            raise AssertionError(f"{name}: max abs err {err:.3g} > bound {bound:.3g} (sdpa {serr:.3g})")
        return err / max(bound, 1e-30)

    @check("attention (one GPU): gradients against float64 and SDPA's backward, causal and not, GQA, D 64")
    def _():
        B, S, H, Hkv, D = 2, 300, 4, 2, 64
        q, k, v, do = (gen(1420 + i, B, S, h, D) for i, h in ((0, H), (1, Hkv), (2, Hkv), (3, H)))
        worst = 0.0
        for causal in (False, True):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            o, _ = mkt.attention(*leaves, causal=causal)
            o.backward(do)
            ref, sd = attn_grads_ref(q, k, v, do, causal)
            for i, nm in enumerate(("dq", "dk", "dv")):
                worst = max(worst, grad_bound(f"{nm} causal={causal}", leaves[i].grad, ref[i], sd[i]))
        return f"worst err / bound {worst:.2f}"

    def ring_grads(B, H, Hkv, D, s):
        S = s * W
        q, k, v, do = (gen(1450 + i, B, S, h, D) for i, h in ((0, H), (1, Hkv), (2, Hkv), (3, H)))
        refs = {causal: attn_grads_ref(q, k, v, do, causal) for causal in (False, True)}
        worst = 0.0
        for layout in ("contiguous", "zigzag"):
            idx = ring_rows(layout, s)
            for causal in (False, True):
                leaves = [t[:, idx].detach().clone().requires_grad_() for t in (q, k, v)]
                o, _ = mkt.ring_attention(*leaves, causal=causal, layout=layout)
                o.backward(do[:, idx])
                ref, sd = refs[causal]
                for i, nm in enumerate(("dq", "dk", "dv")):
                    worst = max(worst, grad_bound(f"{nm} {layout} causal={causal} B{B} H{H} Hkv{Hkv} D{D} s{s}",
                                                  leaves[i].grad, ref[i][:, idx], sd[i][:, idx]))
        return worst

    @check("ring_attention backward: contiguous and zigzag, causal and not, GQA, against full-sequence gradients")
    def _():
        worst = 0.0
        for B, H, Hkv, D, s in ((1, 4, 2, 128, 128), (1, 8, 2, 128, 512), (2, 4, 4, 64, 192)):  # s tokens per rank
            worst = max(worst, ring_grads(B, H, Hkv, D, s))
        return f"worst err / bound {worst:.2f}"

    @check("ring_attention over packed documents (cu_seqlens): O, LSE and gradients against float64, "
           "both layouts, causal and not, a new packing per call")
    def _():
        B, H, Hkv, D, s = 1, 4, 2, 128, 320  # s tokens per rank
        S = s * W
        q, k, v, do = (gen(1480 + i, B, S, h, D) for i, h in ((0, H), (1, Hkv), (2, Hkv), (3, H)))
        worst, failed = 0.0, []
        # Every rank runs every call (collective) before any check may raise; O and the gradients
        # are held to 2x SDPA's own error against float64 (with the same mask) plus 2^-8 of the
        # largest magnitude, as the gradients above: a row of a short document averages few values.
        for n, (layout, causal) in enumerate((("zigzag", True), ("contiguous", True), ("zigzag", False),
                                              ("contiguous", False))):
            # documents of 1 to S/2 tokens, some shorter than a tile, some spanning ranks
            g = torch.Generator().manual_seed(1490 + n)
            cuts = {0, S}
            while len(cuts) < 2 + 3 * W:
                cuts.add(int(torch.randint(1, S, (1,), generator=g)))
            cut = sorted(cuts)
            cu = torch.tensor(cut, dtype=torch.int32, device="cuda")
            pos = torch.arange(S, device="cuda")
            doc = torch.bucketize(pos, cu[1:].long(), right=True)
            vis = doc[:, None] == doc[None, :]
            if causal:
                vis &= pos[None, :] <= pos[:, None]
            idx = ring_rows(layout, s)
            leaves = [t[:, idx].detach().clone().requires_grad_() for t in (q, k, v)]
            o, lse = mkt.ring_attention(*leaves, causal=causal, layout=layout, cu_seqlens=cu)
            o.backward(do[:, idx])
            outs, grads, ref_lse = masked_refs(q, k, v, do, vis)
            tag = f"{layout} causal={causal} {len(cut) - 1} documents"
            checks = [(f"O {tag}", o, outs[0][:, idx], outs[1][:, idx])]
            checks += [(f"{nm} {tag}", leaves[i].grad, grads[0][i][:, idx], grads[1][i][:, idx])
                       for i, nm in enumerate(("dq", "dk", "dv"))]
            for name, got, ref, sdpa in checks:
                try:
                    worst = max(worst, grad_bound(name, got, ref, sdpa))
                except AssertionError as e:
                    failed.append(str(e))
            d = (lse - ref_lse[:, :, idx]).abs().max().item()
            if not d <= 1e-3:
                failed.append(f"LSE {tag}: max abs err {d:.3g} > 1e-3")
        if failed:
            raise AssertionError("; ".join(failed))
        return f"worst err / bound {worst:.2f}"

    def uneven_rows(layout, rows):
        """This rank's rows of the whole sequence on uneven shards (rows: every rank's tokens):
        contiguous, from the sum of the earlier ranks' counts; zigzag, the 2W chunks hold
        ceil(rows[c] / 2) tokens (c < W), then floor(rows[2W-1-c] / 2), and this rank its chunks
        rank and 2W-1-rank."""
        if layout == "contiguous":
            at = sum(rows[:rank])
            return torch.arange(at, at + rows[rank]).cuda()
        lens = [(r + 1) // 2 for r in rows] + [r // 2 for r in reversed(rows)]
        start = [sum(lens[:c]) for c in range(2 * W)]
        a, b = rank, 2 * W - 1 - rank
        return torch.cat([torch.arange(start[a], start[a] + lens[a]),
                          torch.arange(start[b], start[b] + lens[b])]).cuda()

    @check("ring_attention on uneven shards (shard_rows): O, LSE and gradients against float64, both layouts, "
           "causal and not")
    def _():
        B, H, Hkv, D = 1, 4, 2, 128
        rows = [200 + (37 * r) % 61 - 30 for r in range(W)]  # 170 to 230 tokens, odd and even
        S = sum(rows)
        q, k, v, do = (gen(1500 + i, B, S, h, D) for i, h in ((0, H), (1, Hkv), (2, Hkv), (3, H)))
        worst, failed = 0.0, []
        refs = {c: (attn_grads_ref(q, k, v, do, c), attn_ref(q, k, v, c, torch.float64)) for c in (False, True)}
        for layout, causal in (("zigzag", True), ("contiguous", True), ("zigzag", False), ("contiguous", False)):
            idx = uneven_rows(layout, rows)
            leaves = [t[:, idx].detach().clone().requires_grad_() for t in (q, k, v)]
            o, lse = mkt.ring_attention(*leaves, causal=causal, layout=layout, shard_rows=rows)
            o.backward(do[:, idx])
            (ref, sd), (ref_o, ref_lse) = refs[causal]
            sd_o = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2))),
                is_causal=causal).transpose(1, 2)
            tag = f"{layout} causal={causal} rows {rows}"
            checks = [(f"O {tag}", o, ref_o[:, idx], sd_o[:, idx])]
            checks += [(f"{nm} {tag}", leaves[i].grad, ref[i][:, idx], sd[i][:, idx])
                       for i, nm in enumerate(("dq", "dk", "dv"))]
            for name, got, r_, sdpa in checks:
                try:
                    worst = max(worst, grad_bound(name, got, r_, sdpa))
                except AssertionError as e:
                    failed.append(str(e))
            d = (lse.double() - ref_lse[:, :, idx]).abs().max().item()
            if not d <= 1e-3:
                failed.append(f"LSE {tag}: max abs err {d:.3g} > 1e-3")
        if failed:
            raise AssertionError("; ".join(failed))
        return f"worst err / bound {worst:.2f}"

    @check("ring_attention over packed documents on the shards that balance their work (ring_balanced_rows, "
           "contiguous): O and gradients against float64")
    def _():
        B, H, Hkv, D = 1, 4, 2, 64
        S = 256 * W
        cut = [0]
        g = torch.Generator().manual_seed(1530)
        while cut[-1] < S:  # documents of 1 to S/3 tokens
            cut.append(min(S, cut[-1] + 1 + int(torch.randint(0, S // 3, (1,), generator=g))))
        rows = mkt.ring_balanced_rows(cut, causal=True)
        if sum(rows) != S or len(rows) != W:
            raise AssertionError(f"balanced rows {rows} for {W} ranks and {S} tokens")
        cu = torch.tensor(cut, dtype=torch.int32, device="cuda")
        pos = torch.arange(S, device="cuda")
        doc = torch.bucketize(pos, cu[1:].long(), right=True)
        vis = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        q, k, v, do = (gen(1540 + i, B, S, h, D) for i, h in ((0, H), (1, Hkv), (2, Hkv), (3, H)))
        idx = uneven_rows("contiguous", rows)
        leaves = [t[:, idx].detach().clone().requires_grad_() for t in (q, k, v)]
        o, _ = mkt.ring_attention(*leaves, causal=True, layout="contiguous", cu_seqlens=cu, shard_rows=rows)
        o.backward(do[:, idx])
        outs, grads, _ = masked_refs(q, k, v, do, vis)
        worst, failed = 0.0, []
        checks = [("O", o, outs[0][:, idx], outs[1][:, idx])]
        checks += [(nm, leaves[i].grad, grads[0][i][:, idx], grads[1][i][:, idx]) for i, nm in enumerate(("dq", "dk", "dv"))]
        for name, got, ref, sdpa in checks:
            try:
                worst = max(worst, grad_bound(f"{name} balanced rows {rows}", got, ref, sdpa))
            except AssertionError as e:
                failed.append(str(e))
        if failed:
            raise AssertionError("; ".join(failed))
        return f"rows {rows}, worst err / bound {worst:.2f}"

    # ---- standalone collectives: bit for bit against the documented order of the sum ------------
    places = [None] * W  # (node, local rank) of every rank
    dist.all_gather_object(places, (comm.node, comm.local_rank))

    def ordered_sum(xs):
        """fp32, within each node by local index, then the node partials in node order."""
        total = None
        for n in sorted({p[0] for p in places}):
            members = sorted((p[1], r) for r, p in enumerate(places) if p[0] == n)
            part = xs[members[0][1]].float().clone()
            for _, r in members[1:]:
                part = part + xs[r].float()
            total = part if total is None else total + part
        return total

    @check("all_gather / reduce_scatter / all_reduce bf16 and fp32: bit-exact against the ordered sum")
    def _():
        for dt in (bf16, torch.float32):
            for i, n in enumerate((8, 8 * (37 * W + 3), 8 * 4099)):
                xs = [(torch.randn(n, generator=torch.Generator().manual_seed(1600 + 10 * i + r)) * 4).to(dt).cuda()
                      for r in range(W)]
                exact(f"all_gather {dt} n={n}", mkt.all_gather(xs[rank]), torch.cat(xs))
                exact(f"all_reduce {dt} n={n}", mkt.all_reduce(xs[rank]), ordered_sum(xs).to(dt))
                big = [torch.cat([x] * W) + r for r, x in enumerate(xs)]  # [W * n] per rank
                exact(f"reduce_scatter {dt} n={n}", mkt.reduce_scatter(big[rank]),
                      ordered_sum(big).to(dt)[rank * n:(rank + 1) * n])
        xs = [gen(1650 + r, 2, 4, 16) for r in range(W)]  # along dim 1
        exact("all_gather dim=1", mkt.all_gather(xs[rank], dim=1), torch.cat(xs, 1))
        return "3 sizes x 2 dtypes, every element"

    @check("collectives' autograd: all_gather's gradient is the reduce_scatter of the gradients")
    def _():
        x = gen(1700 + rank, 8 * W, 16).float().requires_grad_()
        g = [torch.randn(8 * W * W, 16, generator=torch.Generator().manual_seed(1710 + r)).cuda() for r in range(W)]
        (mkt.all_gather(x) * g[rank]).sum().backward()
        exact("d x", x.grad, ordered_sum(g)[rank * 8 * W:(rank + 1) * 8 * W])
        return "exact"

    # ---- MoE dispatch and combine --------------------------------------------------------------
    def moe_inputs(seed, T, H, E, k, kind="randn"):
        """Every rank's x [T, H], ids [T, k] (distinct experts per token, about one slot in 8 -1) and
        weights [T, k], from seeds: the references need no communication."""
        xs, ids, wts = [], [], []
        for r in range(W):
            g = torch.Generator().manual_seed(seed + r)
            xs.append(gen(seed + 100 + r, T, H, kind=kind))
            e = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
            e[torch.rand(T, k, generator=g) < 0.125] = -1
            ids.append(e.cuda())
            w = torch.rand(T, k, generator=g) + 0.25
            wts.append((w.round() if kind == "int" else w).cuda())
        return xs, ids, wts

    def moe_layout(ids, T, E, k, align):
        """This rank's expected receive layout: per local expert its rows' (source, token) in order
        (by source rank, then token, then slot), counts and aligned offsets."""
        El = E // W
        rows, counts, offsets = [], [], [0]
        for j in range(El):
            e = rank * El + j
            mine = [(s, t) for s in range(W) for t in range(T) for kk in range(k) if int(ids[s][t, kk]) == e]
            rows.append(mine)
            counts.append(len(mine))
            offsets.append(offsets[-1] + (len(mine) + align - 1) // align * align)
        return rows, counts, offsets

    @check("moe_dispatch / moe_combine: layout and copies bit-exact, combine against float64, unused rows zero")
    def _():
        worst = 0.0
        for i, (T, H, E, k, align, cap) in enumerate([(37, 64, 4 * W, 3, 1, 0), (20, 136, 2 * W, 2, 8, 0),
                                                       (1, 8, W, 1, 1, 0), (29, 64, 8 * W, 4, 4, 40 * W * 4)]):
            xs, ids, wts = moe_inputs(7000 + 50 * i, T, H, E, k)
            recv, counts, offsets, r = mkt.moe_dispatch(xs[rank], ids[rank], E, expert_align=align, recv_capacity=cap)
            rows, want_c, want_o = moe_layout(ids, T, E, k, align)
            exact(f"counts case {i}", counts.cpu(), torch.tensor(want_c))
            exact(f"offsets case {i}", offsets.cpu(), torch.tensor(want_o))
            used = torch.zeros(recv.shape[0], dtype=torch.bool)
            scale = torch.zeros(recv.shape[0], dtype=torch.float32)
            for j, mine in enumerate(rows):
                for n, (s_, t) in enumerate(mine):
                    row = want_o[j] + n
                    exact(f"case {i} expert {j} row {row}", recv[row], xs[s_][t])
                    used[row] = True
                    scale[row] = 1.0 + 0.5 * j
            exact(f"case {i} unused rows", recv[~used.cuda()], torch.zeros_like(recv[~used.cuda()]))
            # Experts: row * (1 + j / 2) for local expert j; combine against the float64 sum.
            y = (recv.float() * scale.cuda()[:, None]).to(bf16)
            out = mkt.moe_combine(y, wts[rank], r)
            El = E // W
            ref = torch.zeros(T, H, dtype=torch.float64, device="cuda")
            for t in range(T):
                for kk in range(k):
                    e = int(ids[rank][t, kk])
                    if e >= 0:
                        yv = (xs[rank][t].float() * (1.0 + 0.5 * (e % El))).to(bf16).double()
                        ref[t] += wts[rank][t, kk].double() * yv
            worst = max(worst, close(f"combine case {i}", out, ref))
        comm.check()
        return f"4 cases, combine max rel err {worst:.2e}"

    @check("moe integer data: combine bit-exact; autograd d x and d topk_weights against float64")
    def _():
        T, H, E, k = 33, 64, 4 * W, 3
        xs, ids, wts = moe_inputs(7500, T, H, E, k, kind="int")
        recv, counts, offsets, r = mkt.moe_dispatch(xs[rank], ids[rank], E)
        out = mkt.moe_combine(recv, wts[rank], r)
        ref = torch.zeros(T, H, dtype=torch.float32, device="cuda")
        for kk in range(k):
            ref += torch.where(ids[rank][:, kk:kk + 1] >= 0, wts[rank][:, kk:kk + 1] * xs[rank].float(), 0.0)
        exact("combine of integers", out, ref)
        # Autograd with random data: loss = <G, combine(expert(dispatch(x)), w)>, expert = 3 * row.
        xs, ids, wts = moe_inputs(7600, T, H, E, k)
        x = xs[rank].clone().requires_grad_()
        w = wts[rank].clone().requires_grad_()
        G = torch.randn(T, H, generator=torch.Generator().manual_seed(7700 + rank)).cuda()
        recv, _, _, r = mkt.moe_dispatch(x, ids[rank], E)
        (mkt.moe_combine(recv * 3, w, r).float() * G).sum().backward()
        x64, w64 = xs[rank].double().requires_grad_(), wts[rank].double().requires_grad_()
        valid = (ids[rank] >= 0).double()
        out64 = ((w64 * valid)[:, :, None] * (3 * x64)[:, None, :]).sum(1)
        (out64 * G.double()).sum().backward()
        e1 = close("d x", x.grad, x64.grad, grad=True)
        e2 = close("d topk_weights", w.grad, w64.grad, grad=True)
        return f"d x {e1:.2e}, d w {e2:.2e}"

    @check("moe: torch.compile(fullgraph=True) forward and backward match eager; CUDA graph replays")
    def _():
        T, H, E, k = 24, 64, 2 * W, 2
        xs, ids, wts = moe_inputs(7800, T, H, E, k)

        def block(x, ids_, w):
            recv, _, _, r = mkt.moe_dispatch(x, ids_, E)
            return mkt.moe_combine(torch.nn.functional.silu(recv.float()).to(bf16), w, r)

        outs = []
        for fn in (block, torch.compile(block, fullgraph=True)):
            x = xs[rank].clone().requires_grad_()
            w = wts[rank].clone().requires_grad_()
            o = fn(x, ids[rank], w)
            o.float().sum().backward()
            outs.append((o, x.grad, w.grad))
        # Inductor's silu may round differently from eager's: close, not bit-exact.
        close("compiled forward", outs[1][0], outs[0][0])
        close("compiled d x", outs[1][1], outs[0][1], grad=True)
        close("compiled d w", outs[1][2], outs[0][2], grad=True)
        # Graph: capture after a warm-up, replay with new tokens and routings.
        sx, sid, sw = xs[rank].clone(), ids[rank].clone(), wts[rank].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block(sx, sid, sw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gout = block(sx, sid, sw)
        for it in range(5):
            nx, nid, nw = moe_inputs(7900 + 10 * it, T, H, E, k)
            sx.copy_(nx[rank]), sid.copy_(nid[rank]), sw.copy_(nw[rank])
            graph.replay()
            exact(f"replay {it}", gout, block(nx[rank], nid[rank], nw[rank]))
        comm.check()
        return "compiled close to eager, 5 replays == eager"

    @check("moe_layer (dispatch, SwiGLU experts, combine in one op) against float64 experts")
    def _():
        T, H, E, k, inter = 40, 64, 2 * W, 2, 64
        El = E // W
        xs, ids, wts = moe_inputs(8100, T, H, E, k)
        w1s = [gen(8200 + r, El, 2 * inter, H, scale=0.125) for r in range(W)]
        w2s = [gen(8300 + r, El, H, inter, scale=0.125) for r in range(W)]
        out = mkt.moe_layer(xs[rank], ids[rank], wts[rank], w1s[rank], w2s[rank], E)
        x = xs[rank].double()
        ref = torch.zeros(T, H, dtype=torch.float64, device="cuda")
        # The bound, element by element, from the layer's three bf16 roundings (each at most 2^-9
        # relative): the activations a (through w2: sum_j |w2_ij| |a_j|), the expert rows y
        # (|y_i|), the output (|out_i|); each weighted by |w|, with a factor 2 for the fp32 sums
        # and the rounded values standing for the exact ones.
        mag = torch.zeros(T, H, dtype=torch.float64, device="cuda")
        for t in range(T):
            for kk in range(k):
                e = int(ids[rank][t, kk])
                if e < 0:
                    continue
                h = w1s[e // El][e % El].double() @ x[t]
                a = torch.nn.functional.silu(h[:inter]) * h[inter:]
                w2 = w2s[e // El][e % El].double()
                y = w2 @ a
                wt = wts[rank][t, kk].double()
                ref[t] += wt * y
                mag[t] += wt.abs() * (w2.abs() @ a.abs() + y.abs())
        bound = 2.0 ** -8 * (mag + ref.abs())
        err = (out.double() - ref).abs()
        if not torch.isfinite(out).all() or (err > bound).any():
            bad = err > bound
            i = int(bad.flatten().nonzero()[0])
            raise AssertionError(f"moe_layer: {int(bad.sum())} of {out.numel()} elements past the rounding bound; "
                                 f"first at flat {i}: got {out.flatten()[i].item()} ref {ref.flatten()[i].item()} "
                                 f"bound {bound.flatten()[i].item():.3g}")
        comm.check_moe()
        # A token whose entries were all dropped has a zero bound and must be exactly zero (checked
        # above); the ratio leaves it out (0 / 0).
        ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.zeros_like(err))
        return f"worst err / bound {ratio.max().item():.2f}"

    # ---- errors ---------------------------------------------------------------------------------
    @check("library errors surface as MkError with the library's message")
    def _():
        try:  # an op called for another world size (a graph traced elsewhere)
            torch.ops.mkernel.matmul_all_reduce(gen(1504, 8 * W, 64), gen(1505, 16, 64).t(), comm.group_name, W + 1)
        except mkernel.MkError as e:
            if "ranks" not in str(e):
                raise
        else:
            raise AssertionError("a wrong world size was accepted")
        try:  # K = 12: rows are not 16-byte aligned, which the kernel cannot load
            mkt.matmul_all_reduce(gen(1500, 8 * W, 12), gen(1501, 16, 12).t())
        except mkernel.MkError as e:
            msg = str(e)
            if e.code_name != "invalid argument" or not msg:
                raise
        else:
            raise AssertionError("K = 12 was accepted")
        try:
            mkt.all_gather_matmul(gen(1502, 8, 64).float(), gen(1503, 16, 64).t())
        except mkernel.MkError as e:
            return f"K=12: {msg[:90]} | fp32: {str(e)[:60]}"
        raise AssertionError("fp32 was accepted")

    # ---- teardown -------------------------------------------------------------------------------
    comm.check()
    dist.destroy_process_group()  # destroys mkernel's communicator first (collective)
    results.append(("teardown through destroy_process_group", not comm.alive, "communicator destroyed"))

    failed = [r for r in results if not r[1]]
    for name, ok, detail in results:
        if rank == 0 or not ok:
            print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if rank == 0:
        print(f"test_torch_ops {tag}: {len(results) - len(failed)} passed, {len(failed)} failed on rank 0", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
