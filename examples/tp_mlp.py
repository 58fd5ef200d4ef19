"""A Llama-style MLP block, tensor parallel over the ranks of torchrun, on mkernel's fused ops.

Sequence parallel in, sequence parallel out: each rank holds S/W tokens of the hidden states.
The gate and up projections are column parallel (each rank holds I/W of their rows) and need
every token: all_gather_matmul gathers the tokens inside the GEMM. The down projection is row
parallel (each rank holds I/W of its columns): matmul_reduce_scatter sums the ranks' partial
products and leaves each rank its S/W tokens. The block checks itself against an unsharded fp64
computation of the same weights (every rank builds every rank's weights from seeds).

  torchrun --nproc-per-node 2 examples/tp_mlp.py [--tokens 1024 --hidden 1024 --inter 2816]

Several ranks on one GPU need MPS (nvidia-cuda-mps-control -d); see docs/pytorch.md.
"""
import argparse
import os
import sys

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except ModuleNotFoundError:
    sys.exit("tp_mlp.py needs PyTorch (>= 2.4): pip install '.[torch]' from the source tree")

# The installed package when there is one (pip install .); else the source tree's python/, which
# loads build/libmkernel_capi.so (scripts/setup.sh builds it).
try:
    import mkernel.torch as mkt
except ImportError:
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import mkernel.torch as mkt  # noqa: E402


class TPMLP(torch.nn.Module):
    """SwiGLU MLP with this rank's shards of the weights (nn.Linear layouts)."""

    def __init__(self, hidden, inter, world, rank):
        super().__init__()
        shard = inter // world
        g = torch.Generator().manual_seed(1234)  # the unsharded weights, the same on every rank
        full = [torch.randn(inter, hidden, generator=g) / hidden ** 0.5,
                torch.randn(inter, hidden, generator=g) / hidden ** 0.5,
                torch.randn(hidden, inter, generator=g) / inter ** 0.5]
        rows = slice(rank * shard, (rank + 1) * shard)
        self.gate = torch.nn.Linear(hidden, shard, bias=False)
        self.up = torch.nn.Linear(hidden, shard, bias=False)
        self.down = torch.nn.Linear(shard, hidden, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(full[0][rows])
            self.up.weight.copy_(full[1][rows])
            self.down.weight.copy_(full[2][:, rows])
        self.full = full

    def forward(self, x_shard):
        _, gate = mkt.all_gather_matmul(x_shard, self.gate.weight.t())  # [S, I/W], no weight copy
        _, up = mkt.all_gather_matmul(x_shard, self.up.weight.t())
        return mkt.matmul_reduce_scatter(F.silu(gate) * up, self.down.weight.t())  # [S/W, H]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        sys.exit("tp_mlp.py needs a CUDA GPU per rank (or ranks sharing one under MPS); torch sees none "
                 "here (`mkernel doctor` says why)")
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    mkt.init()

    mlp = TPMLP(args.hidden, args.inter, W, rank).cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(args.tokens, args.hidden, generator=g)  # every token; this rank takes its S/W
    n = args.tokens // W
    x_shard = x[rank * n:(rank + 1) * n].to(torch.bfloat16).cuda()
    y = mlp(x_shard)

    wg, wu, wd = (t.to(torch.bfloat16).double() for t in mlp.full)
    xb = x.to(torch.bfloat16).double()
    ref = ((F.silu(xb @ wg.t()) * (xb @ wu.t())) @ wd.t())[rank * n:(rank + 1) * n]
    err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    print(f"rank {rank}/{W}: y {tuple(y.shape)} {y.dtype}, max |y - fp64 reference| / max |ref| = {err:.2e}")
    dist.destroy_process_group()
    if err > 2 ** -5:
        raise SystemExit(f"rank {rank}: error {err:.3g} above 2^-5")


if __name__ == "__main__":
    main()
