"""mkernel.torch on a machine without a GPU (CI): the ops' schemas, their fake implementations
(shapes, dtypes, errors) at W = 4 through torch's fake process group, autograd's wiring on meta
tensors, tracing with fake tensors (what torch.compile does first), and the store bootstrap
between two real processes (gloo) with a CPU-only communicator.

Run: python3 tests/python/test_torch_cpu.py   (exit 77: torch is not installed — skipped)
"""
import ctypes
import os
import sys
import tempfile
import unittest

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:
    print("test_torch_cpu: torch is not installed: SKIPPED")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
if os.environ.get("MK_TEST_INSTALLED") == "1":
    sys.path.pop(0)  # the pip-installed package, not the source tree

try:
    import mkernel  # noqa: E402
    import mkernel.torch as mkt  # noqa: E402
except ImportError as e:
    if os.environ.get("MK_TEST_INSTALLED") != "1":
        raise
    print(f"test_torch_cpu: the package is not installed ({e}; scripts/python_setup.sh installs it): SKIPPED")
    sys.exit(77)
if os.environ.get("MK_TEST_INSTALLED") == "1" and "site-packages" not in mkernel.__file__:
    print(f"test_torch_cpu: MK_TEST_INSTALLED=1 but mkernel came from {mkernel.__file__}")
    sys.exit(1)

W = 4
bf16 = torch.bfloat16


def meta(*shape, dtype=bf16, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float32, device="meta").to(dtype).requires_grad_(requires_grad)


class Schemas(unittest.TestCase):
    def test_ops_registered_with_schemas(self):
        want = {
            "all_gather_matmul": "mkernel::all_gather_matmul(Tensor a, Tensor b, str group_name, SymInt world_size, "
                                 "bool return_a, SymInt[]? shard_rows=None) -> (Tensor, Tensor)",
            "matmul_reduce_scatter": "mkernel::matmul_reduce_scatter(Tensor a, Tensor b, str group_name, SymInt world_size, "
                                     "SymInt[]? shard_rows=None) -> Tensor",
            "matmul_all_reduce": "mkernel::matmul_all_reduce(Tensor a, Tensor b, str group_name, SymInt world_size) -> Tensor",
            "ring_attention": "mkernel::ring_attention(Tensor q, Tensor k, Tensor v, bool causal, str layout, "
                              "float scale, str group_name, Tensor? cu_seqlens=None, SymInt[]? shard_rows=None) "
                              "-> (Tensor, Tensor)",
            "attention": "mkernel::attention(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)",
            "attention_backward": "mkernel::attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                                  "Tensor dout, bool causal, float scale, SymInt q_pos0, SymInt kv_pos0, "
                                  "bool deterministic) -> (Tensor, Tensor, Tensor)",
            "attention_varlen": "mkernel::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, bool causal, "
                                "float scale) -> (Tensor, Tensor)",
            "attention_varlen_backward": "mkernel::attention_varlen_backward(Tensor q, Tensor k, Tensor v, Tensor o, "
                                         "Tensor lse, Tensor dout, Tensor cu_seqlens, bool causal, float scale, "
                                         "bool deterministic) -> (Tensor, Tensor, Tensor)",
            "ring_attention_backward": "mkernel::ring_attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, "
                                       "Tensor lse, Tensor dout, bool causal, str layout, float scale, "
                                       "str group_name, SymInt world_size, Tensor? cu_seqlens=None, "
                                       "SymInt[]? shard_rows=None) -> (Tensor, Tensor, Tensor)",
            "all_gather": "mkernel::all_gather(Tensor x, str group_name, SymInt world_size) -> Tensor",
            "reduce_scatter": "mkernel::reduce_scatter(Tensor x, str group_name, SymInt world_size) -> Tensor",
            "all_reduce": "mkernel::all_reduce(Tensor x, str group_name, SymInt world_size) -> Tensor",
            "moe_dispatch": "mkernel::moe_dispatch(Tensor x, Tensor topk_ids, SymInt num_experts, SymInt max_tokens, "
                            "SymInt expert_align, SymInt recv_capacity, str group_name, SymInt world_size) "
                            "-> (Tensor, Tensor, Tensor, Tensor)",
            "moe_combine": "mkernel::moe_combine(Tensor y, Tensor topk_ids, Tensor topk_weights, Tensor routing, "
                           "SymInt num_experts, SymInt max_tokens, SymInt expert_align, SymInt recv_capacity, "
                           "str group_name, SymInt world_size) -> Tensor",
            "moe_layer": "mkernel::moe_layer(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2, "
                         "SymInt num_experts, SymInt max_tokens, SymInt expert_align, SymInt recv_capacity, "
                         "str group_name, SymInt world_size) -> Tensor",
        }
        for name, schema in want.items():
            self.assertEqual(str(getattr(torch.ops.mkernel, name).default._schema), schema)

    def test_package_exports(self):
        self.assertTrue(issubclass(mkernel.MkError, RuntimeError))
        self.assertTrue(mkernel.library_path().endswith("libmkernel_capi.so"))
        if os.environ.get("MK_TEST_INSTALLED") == "1":  # the library pip built, inside the package
            self.assertEqual(os.path.dirname(mkernel.library_path()), os.path.dirname(mkernel.__file__))
            mkernel._capi.lib()  # loads, with every function the package declares


class FakeShapes(unittest.TestCase):
    """At W = 4 (fake process group): shapes and dtypes of every op, on meta tensors."""

    @classmethod
    def setUpClass(cls):
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=1, world_size=W, store=FakeStore())
        mkt._default_name = dist.group.WORLD.group_name  # no communicator: the ops resolve the group's size
        cls.name = mkt._default_name

    @classmethod
    def tearDownClass(cls):
        mkt._default_name = None
        dist.destroy_process_group()

    def test_all_gather_matmul(self):
        a, w = meta(96, 256), meta(512, 256)  # w: an nn.Linear weight [N, K]
        g, c = mkt.all_gather_matmul(a, w.t(), return_a=True)
        self.assertEqual((tuple(g.shape), tuple(c.shape), c.dtype), ((384, 256), (384, 512), bf16))
        none, c = mkt.all_gather_matmul(a, w.t())
        self.assertIsNone(none)
        # 3-D input, gather along dim 1 (sequence): [B, S/W, K] -> [B, S, N]
        _, c = mkt.all_gather_matmul(meta(2, 24, 256), w.t(), gather_dim=1)
        self.assertEqual(tuple(c.shape), (2, 96, 512))
        _, c = mkt.all_gather_matmul(meta(2, 24, 256), w.t(), gather_dim=-3)
        self.assertEqual(tuple(c.shape), (8, 24, 512))

    def test_matmul_reduce_scatter(self):
        out = mkt.matmul_reduce_scatter(meta(128, 64), meta(320, 64).t())
        self.assertEqual((tuple(out.shape), out.dtype), ((32, 320), bf16))
        out = mkt.matmul_reduce_scatter(meta(2, 128, 64), meta(320, 64).t(), scatter_dim=1)
        self.assertEqual(tuple(out.shape), (2, 32, 320))

    def test_uneven_shards(self):
        """shard_sizes (every rank's size along the shard dimension; this is rank 1 of 4): the
        gathered and scattered shapes follow them, in 2-D and along an inner dimension."""
        sizes, w = [10, 30, 20, 40], meta(512, 256)
        g, c = mkt.all_gather_matmul(meta(30, 256), w.t(), return_a=True, shard_sizes=sizes)
        self.assertEqual((tuple(g.shape), tuple(c.shape)), ((100, 256), (100, 512)))
        _, c = mkt.all_gather_matmul(meta(2, 30, 256), w.t(), gather_dim=1, shard_sizes=sizes)
        self.assertEqual(tuple(c.shape), (2, 100, 512))
        out = mkt.matmul_reduce_scatter(meta(100, 64), meta(320, 64).t(), shard_sizes=sizes)
        self.assertEqual(tuple(out.shape), (30, 320))
        out = mkt.matmul_reduce_scatter(meta(2, 100, 64), meta(320, 64).t(), scatter_dim=1, shard_sizes=sizes)
        self.assertEqual(tuple(out.shape), (2, 30, 320))
        # The op sees rows: sizes times the other leading dimensions (here 2).
        from torch.fx.experimental.proxy_tensor import make_fx
        gm = make_fx(lambda x, v: mkt.matmul_reduce_scatter(x, v.t(), scatter_dim=1, shard_sizes=sizes),
                     tracing_mode="fake")(meta(2, 100, 64), meta(320, 64))
        node = [n for n in gm.graph.nodes if str(n.target) == "mkernel.matmul_reduce_scatter.default"][0]
        self.assertEqual(list(node.args[4]), [20, 60, 40, 80])
        for bad in (lambda: mkt.all_gather_matmul(meta(30, 256), w.t(), shard_sizes=[10, 30, 20]),     # 3 of 4
                    lambda: mkt.all_gather_matmul(meta(31, 256), w.t(), shard_sizes=sizes),            # not mine
                    lambda: mkt.all_gather_matmul(meta(30, 256), w.t(), shard_sizes=[0, 30, 20, 40]),  # empty
                    lambda: mkt.matmul_reduce_scatter(meta(99, 64), meta(320, 64).t(), shard_sizes=sizes)):  # sum
            with self.assertRaises(mkernel.MkError) as cm:
                bad()
            self.assertIn("shard", str(cm.exception))

    def test_matmul_all_reduce(self):
        out = mkt.matmul_all_reduce(meta(3, 40, 64), meta(64, 72))
        self.assertEqual(tuple(out.shape), (3, 40, 72))

    def test_ring_attention(self):
        q, k = meta(2, 64, 8, 128), meta(2, 64, 2, 128)
        o, lse = mkt.ring_attention(q, k, k, causal=True, layout="zigzag")
        self.assertEqual((tuple(o.shape), o.dtype), ((2, 64, 8, 128), bf16))
        self.assertEqual((tuple(lse.shape), lse.dtype), ((2, 8, 64), torch.float32))

    def test_ring_balanced_rows(self):
        """Balanced contiguous shards for packed documents: one count >= 1 per rank summing to S, the
        busiest rank's share the least of every contiguous split (checked by brute force here)."""
        import itertools
        cu = [0, 3, 40, 41, 90, 100]
        for causal in (False, True):
            rows = mkt.ring_balanced_rows(torch.tensor(cu, dtype=torch.int32), causal=causal)
            self.assertEqual(len(rows), W)
            self.assertEqual(sum(rows), 100)
            self.assertTrue(all(r >= 1 for r in rows))
            work = []
            for d in range(len(cu) - 1):
                work += [(p - cu[d] + 1) if causal else (cu[d + 1] - cu[d]) for p in range(cu[d], cu[d + 1])]

            pre = [0]
            for x in work:
                pre.append(pre[-1] + x)

            def most(cuts):
                b = [0, *cuts, 100]
                return max(pre[b[i + 1]] - pre[b[i]] for i in range(W))
            at = [sum(rows[:i + 1]) for i in range(W - 1)]
            best = min(most(c) for c in itertools.combinations(range(1, 100), W - 1))
            self.assertEqual(most(at), best)
        self.assertEqual(mkt.ring_balanced_rows([0, 8], world=2), [4, 4])
        with self.assertRaises(mkernel.MkError):
            mkt.ring_balanced_rows([0, 2], world=3)  # 2 tokens for 3 ranks
        with self.assertRaises(mkernel.MkError):
            mkt.ring_balanced_rows([5, 2], world=1)  # not from 0

    def test_collectives(self):
        g = mkt.all_gather(meta(6, 8, dtype=torch.float32))
        self.assertEqual((tuple(g.shape), g.dtype), ((24, 8), torch.float32))
        g = mkt.all_gather(meta(2, 3, 16), dim=1)  # [B, S/W, H] -> [B, S, H]
        self.assertEqual(tuple(g.shape), (2, 12, 16))
        r = mkt.reduce_scatter(meta(32, 8))
        self.assertEqual((tuple(r.shape), r.dtype), ((8, 8), bf16))
        r = mkt.reduce_scatter(meta(2, 8, 16), dim=-2)
        self.assertEqual(tuple(r.shape), (2, 2, 16))
        a = mkt.all_reduce(meta(5, 8, dtype=torch.float32))
        self.assertEqual((tuple(a.shape), a.dtype), ((5, 8), torch.float32))

    def test_moe(self):
        """moe_dispatch's outputs: recv_x [R, H] with R the worst case W * max_tokens * k + E_local *
        (align - 1), or recv_capacity; counts and offsets of the local experts; the routing bytes the
        library says for this configuration. moe_combine: [T, H]."""
        T, H, E, k = 24, 64, 16, 4
        for max_tokens, align, cap in ((None, 1, 0), (40, 8, 0), (None, 1, 100)):
            with self.subTest(max_tokens=max_tokens, align=align, cap=cap):
                recv, counts, offsets, r = mkt.moe_dispatch(meta(T, H), meta(T, k, dtype=torch.int32), E,
                                                            max_tokens=max_tokens, expert_align=align,
                                                            recv_capacity=cap)
                mt = T if max_tokens is None else max_tokens
                rows = cap if cap else W * mt * k + (E // W) * (align - 1)
                self.assertEqual((tuple(recv.shape), recv.dtype), ((rows, H), bf16))
                self.assertEqual((tuple(counts.shape), counts.dtype), ((E // W,), torch.int32))
                self.assertEqual((tuple(offsets.shape), offsets.dtype), ((E // W + 1,), torch.int32))
                self.assertEqual(r.routing.dtype, torch.uint8)
                nbytes = mkt._moe_sizes("t", self.name, W, H, E, k, mt, align, cap)[1]
                self.assertEqual(r.routing.numel(), nbytes)
                # One routing is at least its arrays of T * k entries (ids, weights, positions).
                self.assertGreaterEqual(nbytes, 6 * 4 * mt * k)
                self.assertEqual((r.num_experts, r.max_tokens, r.expert_align, r.recv_capacity, r.world_size),
                                 (E, mt, align, cap, W))
                out = mkt.moe_combine(recv, meta(T, k, dtype=torch.float32), r)
                self.assertEqual((tuple(out.shape), out.dtype), ((T, H), bf16))
        # The layer: out like x.
        El, inter = E // W, 32
        out = mkt.moe_layer(meta(T, H), meta(T, k, dtype=torch.int32), meta(T, k, dtype=torch.float32),
                            meta(El, 2 * inter, H), meta(El, H, inter), E)
        self.assertEqual((tuple(out.shape), out.dtype), ((T, H), bf16))
        # int64 ids are taken (converted); the routing grows with max_tokens.
        _, _, _, r64 = mkt.moe_dispatch(meta(T, H), meta(T, k, dtype=torch.int64), E)
        self.assertEqual(r64.topk_ids.dtype, torch.int32)
        small = mkt._moe_sizes("t", self.name, W, H, E, k, 8, 1, 0)[1]
        self.assertLess(small, mkt._moe_sizes("t", self.name, W, H, E, k, 800, 1, 0)[1])
        # A layout the library refuses: 3 nodes of 2 ranks are not 4 ranks.
        rows, nb = mkernel._capi.ctypes.c_int64(), mkernel._capi.ctypes.c_int64()
        self.assertNotEqual(mkernel._capi.lib().mk_moe_sizes(W, 3, 2, H, E, k, T, 1, 0, 0, rows, nb), 0)
        self.assertIn("3 nodes of 2 ranks", mkernel._capi.lib().mk_last_error().decode())

    def test_bad_inputs_raise_mkerror(self):
        T, H, E, k = 8, 64, 16, 2
        ids, wts = meta(T, k, dtype=torch.int32), meta(T, k, dtype=torch.float32)
        _, _, _, r = mkt.moe_dispatch(meta(T, H), ids, E)
        rows = W * T * k
        cases = [
            lambda: mkt.all_gather_matmul(meta(8, 64, dtype=torch.float16), meta(64, 32)),   # dtype
            lambda: mkt.all_gather_matmul(meta(8, 64), meta(48, 32)),                       # K mismatch
            lambda: mkt.all_gather_matmul(meta(8, 64), meta(64, 32), gather_dim=1),         # gathers K
            lambda: mkt.matmul_reduce_scatter(meta(6, 64), meta(64, 32)),                   # 6 rows over 4
            lambda: mkt.matmul_reduce_scatter(meta(8, 64), meta(64, 32), reduce_op="avg"),  # unsupported
            lambda: mkt.ring_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64), layout="striped"),
            lambda: mkt.ring_attention(meta(1, 8, 2, 64), meta(1, 4, 2, 64), meta(1, 4, 2, 64)),
            lambda: mkt.ring_attention(meta(2, 8, 2, 64), meta(2, 8, 2, 64), meta(2, 8, 2, 64),
                                       cu_seqlens=meta(3, dtype=torch.int32)),                 # packed with B = 2
            lambda: mkt.ring_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64),
                                       cu_seqlens=meta(3, dtype=torch.int64)),                 # int64 cu_seqlens
            lambda: mkt.ring_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64),
                                       cu_seqlens=meta(1, dtype=torch.int32)),                 # no document
            lambda: mkt.ring_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64),
                                       shard_rows=[8, 8, 8]),                                  # 3 counts for 4 ranks
            lambda: mkt.ring_attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64),
                                       shard_rows=[8, 0, 8, 8]),                               # an empty shard
            lambda: mkt.attention(meta(1, 8, 2, 64), meta(1, 8, 2, 64, dtype=torch.float32), meta(1, 8, 2, 64)),
            lambda: torch.ops.mkernel.attention_backward(*(meta(1, 8, 2, 64) for _ in range(4)),
                                                         meta(1, 2, 4, dtype=torch.float32), meta(1, 8, 2, 64),
                                                         False, 0.0, 0, 0, False),
            lambda: torch.ops.mkernel.ring_attention_backward(*(meta(1, 8, 2, 64) for _ in range(4)),
                                                              meta(1, 2, 8, dtype=torch.float32), meta(1, 8, 2, 64),
                                                              True, "striped", 0.0, self.name, W),
            lambda: mkt.attention_varlen(meta(1, 8, 2, 64), meta(1, 8, 2, 64), meta(1, 8, 2, 64),
                                         meta(3, dtype=torch.int32)),                        # 4-D q
            lambda: mkt.attention_varlen(meta(8, 2, 64), meta(8, 2, 64), meta(8, 2, 64),
                                         meta(3, dtype=torch.int64)),                        # int64 cu_seqlens
            lambda: torch.ops.mkernel.attention_varlen_backward(*(meta(8, 2, 64) for _ in range(4)),
                                                                meta(8, 2, dtype=torch.float32), meta(8, 2, 64),
                                                                meta(3, dtype=torch.int32), False, 0.0, False),
            lambda: mkt.all_gather(meta(8, 8, dtype=torch.float16)),                         # dtype
            lambda: mkt.all_reduce(meta(3, 5)),                                              # 15 elements
            lambda: mkt.reduce_scatter(meta(6, 8)),                                          # 6 rows over 4
            lambda: mkt.reduce_scatter(meta(4, 6)),                                          # 6 per rank
            lambda: mkt.all_reduce(meta(8, 8), reduce_op="max"),                             # unsupported
            lambda: mkt.moe_dispatch(meta(T, H, dtype=torch.float32), ids, E),               # x dtype
            lambda: mkt.moe_dispatch(meta(T, H), meta(T, dtype=torch.int32), E),             # 1-D ids
            lambda: mkt.moe_dispatch(meta(T, H), ids, 18),                                   # 18 experts over 4
            lambda: mkt.moe_dispatch(meta(T, H), ids, E, max_tokens=4),                      # 8 tokens > 4
            lambda: mkt.moe_dispatch(meta(T, 60), ids, E),                                   # H * 2 not 16-byte rows
            lambda: mkt.moe_dispatch(meta(T, H), meta(T, 40, dtype=torch.int32), E),         # k = 40 > 32
            lambda: torch.ops.mkernel.moe_dispatch(meta(T, H), meta(T, k, dtype=torch.int64), E, T, 1, 0,
                                                   self.name, W),                            # int64 ids at the op
            lambda: mkt.moe_combine(meta(rows - 1, H), wts, r),                              # y rows
            lambda: mkt.moe_combine(meta(rows, H), meta(T, k), r),                           # bf16 weights
            lambda: mkt.moe_combine(meta(rows, H), meta(T, k + 1, dtype=torch.float32), r),  # weights' shape
            lambda: mkt.moe_combine(meta(rows, H), wts, r._replace(routing=r.routing[1:])),  # routing's size
            lambda: mkt.moe_combine(meta(rows, H), wts, r._replace(max_tokens=2 * T)),       # another config
            lambda: mkt.moe_layer(meta(T, H), ids, wts, meta(E // W, 64, H), meta(E // W, H, 16), E),  # I 32 vs 16
            lambda: mkt.moe_layer(meta(T, H), ids, wts, meta(E, 64, H), meta(E, H, 32), E),  # all experts' weights
            lambda: mkt.moe_layer(meta(T, H), ids, meta(T, k), meta(E // W, 64, H), meta(E // W, H, 32), E),
        ]
        for i, case in enumerate(cases):
            with self.subTest(case=i), self.assertRaises(mkernel.MkError) as cm:
                case()
            self.assertIn("mkernel.", str(cm.exception))

    def test_world_size_is_in_the_graph(self):
        """Traced at W = 4, the graph holds 4: a graph (or a compile cache entry) made at one world
        size cannot be reused at another, where the output shapes differ."""
        from torch.fx.experimental.proxy_tensor import make_fx
        gm = make_fx(lambda x, w: mkt.all_gather_matmul(x, w.t())[1], tracing_mode="fake")(meta(8, 64), meta(32, 64))
        node = [n for n in gm.graph.nodes if str(n.target) == "mkernel.all_gather_matmul.default"][0]
        self.assertEqual(node.args[2:], (self.name, W, False))
        self.assertEqual(tuple(node.meta["val"][1].shape), (8 * W, 32))

    def _backward_graph(self, op, *shapes, first=False):
        """The graph of forward + backward of op(inputs).sum() (first: of op(inputs)[0].sum(), for
        the attention ops' (O, LSE)) traced with fake tensors: the calls of the mkernel ops in it,
        as (target, args) pairs, and the gradients' shapes."""
        from torch.fx.experimental.proxy_tensor import make_fx

        def fwd_bwd(*xs):
            leaves = [x.detach().requires_grad_() for x in xs]
            out = op(*leaves)
            return torch.autograd.grad((out[0] if first else out).float().sum(), leaves)

        gm = make_fx(fwd_bwd, tracing_mode="fake")(*[meta(*s) for s in shapes])
        calls = [(str(n.target), n.args) for n in gm.graph.nodes
                 if n.op == "call_function" and str(n.target).startswith("mkernel.")]
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        return calls, [tuple(g.meta["val"].shape) for g in out]

    def test_backward_calls_the_other_op(self):
        """Traced forward + backward (make_fx): all_gather_matmul's backward is one
        matmul_reduce_scatter of the output gradient with b^T (d a) and the kept gathered A for
        d b; matmul_reduce_scatter's is one all_gather_matmul of the gradient that keeps the
        gathered gradient (return_a) for d b; matmul_all_reduce's calls no collective (its
        output gradient is already the same on every rank)."""
        name = self.name
        calls, grads = self._backward_graph(lambda a, w: mkt.all_gather_matmul(a, w.t())[1], (32, 64), (128, 64))
        self.assertEqual([c[0] for c in calls], ["mkernel.all_gather_matmul.default",
                                                 "mkernel.matmul_reduce_scatter.default"])
        self.assertEqual(calls[0][1][2:], (name, W, True))  # b needs a gradient: the gathered A is kept
        self.assertEqual(calls[1][1][2:], (name, W))
        self.assertEqual(tuple(calls[1][1][0].meta["val"].shape), (32 * W, 128))  # the output gradient
        self.assertEqual(grads, [(32, 64), (128, 64)])

        calls, grads = self._backward_graph(lambda h, w: mkt.matmul_reduce_scatter(h, w.t()), (128, 96), (64, 96))
        self.assertEqual([c[0] for c in calls], ["mkernel.matmul_reduce_scatter.default",
                                                 "mkernel.all_gather_matmul.default"])
        self.assertEqual(calls[1][1][2:], (name, W, True))  # w needs a gradient: the gathered gradient is kept
        self.assertEqual(tuple(calls[1][1][0].meta["val"].shape), (128 // W, 64))  # this rank's gradient rows
        self.assertEqual(grads, [(128, 96), (64, 96)])

        # Uneven shards: each op's backward calls the other with the same shard rows.
        rows = [10, 30, 20, 40]
        calls, grads = self._backward_graph(lambda a, w: mkt.all_gather_matmul(a, w.t(), shard_sizes=rows)[1],
                                            (30, 64), (128, 64))
        self.assertEqual([c[0] for c in calls], ["mkernel.all_gather_matmul.default",
                                                 "mkernel.matmul_reduce_scatter.default"])
        self.assertEqual(list(calls[0][1][5]), rows)
        self.assertEqual(list(calls[1][1][4]), rows)
        self.assertEqual(tuple(calls[1][1][0].meta["val"].shape), (100, 128))
        self.assertEqual(grads, [(30, 64), (128, 64)])
        calls, grads = self._backward_graph(lambda h, w: mkt.matmul_reduce_scatter(h, w.t(), shard_sizes=rows),
                                            (100, 96), (64, 96))
        self.assertEqual([c[0] for c in calls], ["mkernel.matmul_reduce_scatter.default",
                                                 "mkernel.all_gather_matmul.default"])
        self.assertEqual(list(calls[1][1][5]), rows)
        self.assertEqual(tuple(calls[1][1][0].meta["val"].shape), (30, 64))  # this rank's gradient rows
        self.assertEqual(grads, [(100, 96), (64, 96)])

        calls, grads = self._backward_graph(lambda x, w: mkt.matmul_all_reduce(x, w), (16, 32), (32, 8))
        self.assertEqual([c[0] for c in calls], ["mkernel.matmul_all_reduce.default"])
        self.assertEqual(grads, [(16, 32), (32, 8)])

    def test_attention_backward_wiring(self):
        """attention's backward is one attention_backward call on the saved O and LSE; ring_attention's
        one ring_attention_backward call on the saved tensors with the group and its size — the same
        graph on every rank (the op reads the rank when it runs: torch.compile's caches may hand one
        rank's compiled graph to another)."""
        q, kv = (2, 64, 8, 128), (2, 64, 2, 128)
        calls, grads = self._backward_graph(lambda a, b, c: mkt.attention(a, b, c, causal=True), q, kv, kv, first=True)
        self.assertEqual([c[0] for c in calls], ["mkernel.attention.default", "mkernel.attention_backward.default"])
        self.assertEqual(calls[1][1][6:], (True, 0.0, 0, 0, False))
        self.assertEqual(grads, [q, kv, kv])
        for layout, causal in (("contiguous", True), ("zigzag", True), ("zigzag", False)):
            with self.subTest(layout=layout, causal=causal):
                calls, grads = self._backward_graph(
                    lambda a, b, c: mkt.ring_attention(a, b, c, causal=causal, layout=layout), q, kv, kv, first=True)
                self.assertEqual([c[0] for c in calls], ["mkernel.ring_attention.default",
                                                         "mkernel.ring_attention_backward.default"])
                self.assertEqual(calls[1][1][6:], (causal, layout, 0.0, self.name, W))  # no cu_seqlens
                self.assertEqual([tuple(a.meta["val"].shape) for a in calls[1][1][:6]], [q, kv, kv, q, (2, 8, 64), q])
                self.assertEqual(grads, [q, kv, kv])

    def test_attention_varlen_backward_wiring(self):
        """attention_varlen's backward is one attention_varlen_backward call on the saved O, LSE and
        cu_seqlens, with the forward's mask and scale, not deterministic."""
        from torch.fx.experimental.proxy_tensor import make_fx

        def fwd_bwd(q, k, v, cu):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o, _ = mkt.attention_varlen(*leaves, cu, causal=True, scale=0.125)
            return torch.autograd.grad(o.float().sum(), leaves)

        q, kv = (300, 8, 128), (300, 2, 128)
        gm = make_fx(fwd_bwd, tracing_mode="fake")(meta(*q), meta(*kv), meta(*kv), meta(5, dtype=torch.int32))
        calls = [(str(n.target), n.args) for n in gm.graph.nodes
                 if n.op == "call_function" and str(n.target).startswith("mkernel.")]
        self.assertEqual([c[0] for c in calls], ["mkernel.attention_varlen.default",
                                                 "mkernel.attention_varlen_backward.default"])
        self.assertIs(calls[1][1][6], calls[0][1][3])  # the same cu_seqlens
        self.assertEqual(calls[1][1][7:], (True, 0.125, False))
        self.assertEqual([tuple(a.meta["val"].shape) for a in calls[1][1][:6]], [q, kv, kv, q, (8, 300), q])
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        self.assertEqual([tuple(g.meta["val"].shape) for g in out], [q, kv, kv])

    def test_ring_attention_packed_backward_wiring(self):
        """ring_attention over packed documents: its backward is one ring_attention_backward call
        with the forward's cu_seqlens (the same node), mask, layout and group."""
        from torch.fx.experimental.proxy_tensor import make_fx

        def fwd_bwd(q, k, v, cu):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o, _ = mkt.ring_attention(*leaves, causal=True, layout="zigzag", cu_seqlens=cu)
            return torch.autograd.grad(o.float().sum(), leaves)

        q, kv = (1, 64, 8, 128), (1, 64, 2, 128)
        gm = make_fx(fwd_bwd, tracing_mode="fake")(meta(*q), meta(*kv), meta(*kv), meta(7, dtype=torch.int32))
        calls = [(str(n.target), n.args) for n in gm.graph.nodes
                 if n.op == "call_function" and str(n.target).startswith("mkernel.")]
        self.assertEqual([c[0] for c in calls], ["mkernel.ring_attention.default",
                                                 "mkernel.ring_attention_backward.default"])
        self.assertIs(calls[1][1][11], calls[0][1][7])  # the same cu_seqlens
        self.assertEqual(calls[1][1][6:11], (True, "zigzag", 0.0, self.name, W))
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        self.assertEqual([tuple(g.meta["val"].shape) for g in out], [q, kv, kv])

    def test_ring_attention_uneven_backward_wiring(self):
        """ring_attention on uneven shards: its backward is one ring_attention_backward call with the
        forward's shard rows, mask, layout and group."""
        from torch.fx.experimental.proxy_tensor import make_fx
        rows = [64, 70, 58, 66]

        def fwd_bwd(q, k, v):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o, _ = mkt.ring_attention(*leaves, causal=True, layout="zigzag", shard_rows=rows)
            return torch.autograd.grad(o.float().sum(), leaves)

        q, kv = (1, 64, 8, 128), (1, 64, 2, 128)
        gm = make_fx(fwd_bwd, tracing_mode="fake")(meta(*q), meta(*kv), meta(*kv))
        calls = [(str(n.target), n.args, n.kwargs) for n in gm.graph.nodes
                 if n.op == "call_function" and str(n.target).startswith("mkernel.")]
        self.assertEqual([c[0] for c in calls], ["mkernel.ring_attention.default",
                                                 "mkernel.ring_attention_backward.default"])
        fwd_rows = calls[0][1][8] if len(calls[0][1]) > 8 else calls[0][2]["shard_rows"]
        bwd_rows = calls[1][1][12] if len(calls[1][1]) > 12 else calls[1][2]["shard_rows"]
        self.assertEqual(list(fwd_rows), rows)
        self.assertEqual(list(bwd_rows), rows)
        self.assertEqual(calls[1][1][6:11], (True, "zigzag", 0.0, self.name, W))
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        self.assertEqual([tuple(g.meta["val"].shape) for g in out], [q, kv, kv])

    def test_collective_backwards_are_their_adjoints(self):
        """Traced forward + backward: all_gather's backward is one reduce_scatter of the gradient,
        reduce_scatter's one all_gather, all_reduce's one all_reduce — with the group and its size."""
        name = self.name
        for op, back, shape, grad in (
                (mkt.all_gather, "mkernel.reduce_scatter.default", (8, 16), (8 * W, 16)),
                (mkt.reduce_scatter, "mkernel.all_gather.default", (8 * W, 16), (8, 16)),
                (mkt.all_reduce, "mkernel.all_reduce.default", (8, 16), (8, 16))):
            with self.subTest(op=op.__name__):
                calls, grads = self._backward_graph(op, shape)
                self.assertEqual(len(calls), 2)
                self.assertEqual(calls[0][0], f"mkernel.{op.__name__}.default")
                self.assertEqual(calls[1][0], back)
                self.assertEqual(calls[1][1][1:], (name, W))
                self.assertEqual(tuple(calls[1][1][0].meta["val"].shape), grad)  # the output gradient
                self.assertEqual(grads, [shape])

    def test_moe_backward_wiring(self):
        """Traced forward + backward of moe_combine(f(moe_dispatch(x)), w): combine's backward is one
        top-1 dispatch of the [T * k, H] weighted gradient rows (ids [T * k, 1], max_tokens T * k)
        for y and one top-1 combine of y along its routing for w; dispatch's is one combine of
        recv_x's gradient with unit weights along the dispatch's own routing."""
        T, H, E, k = 16, 64, 8, 2
        name = self.name
        from torch.fx.experimental.proxy_tensor import make_fx

        def fwd_bwd(x, ids, w):
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            recv, _, _, r = mkt.moe_dispatch(x, ids, E)
            out = mkt.moe_combine(recv * 2, w, r)
            return torch.autograd.grad(out.float().sum(), [x, w])

        gm = make_fx(fwd_bwd, tracing_mode="fake")(meta(T, H), meta(T, k, dtype=torch.int32),
                                                   meta(T, k, dtype=torch.float32))
        calls = [(str(n.target), n.args) for n in gm.graph.nodes
                 if n.op == "call_function" and str(n.target).startswith("mkernel.")]
        self.assertEqual([c[0] for c in calls], ["mkernel.moe_dispatch.default", "mkernel.moe_combine.default",
                                                 "mkernel.moe_dispatch.default", "mkernel.moe_combine.default",
                                                 "mkernel.moe_combine.default"])
        fwd_d, fwd_c, bwd_d, bwd_c1, bwd_c = calls
        self.assertEqual(fwd_d[1][2:], (E, T, 1, 0, name, W))
        # combine's backward: top-1 dispatch of T * k rows, then the top-1 combine of y for w.
        self.assertEqual(tuple(bwd_d[1][0].meta["val"].shape), (T * k, H))
        self.assertEqual(tuple(bwd_d[1][1].meta["val"].shape), (T * k, 1))
        self.assertEqual(bwd_d[1][2:], (E, T * k, 1, 0, name, W))
        self.assertIs(bwd_c1[1][0], fwd_c[1][0])                        # y itself
        self.assertEqual(tuple(bwd_c1[1][2].meta["val"].shape), (T * k, 1))  # unit weights per slot
        self.assertIs(bwd_c1[1][3].args[0], [n for n in gm.graph.nodes if n.op == "call_function"
                                             and str(n.target) == "mkernel.moe_dispatch.default"][1])
        self.assertEqual(bwd_c1[1][4:], (E, T * k, 1, 0, name, W))
        # dispatch's backward: a combine along the forward's routing with unit weights [T, k].
        self.assertIs(bwd_c[1][3].args[0], [n for n in gm.graph.nodes if n.op == "call_function"
                                            and str(n.target) == "mkernel.moe_dispatch.default"][0])
        self.assertIs(bwd_c[1][1], fwd_c[1][1])                         # the forward's ids
        self.assertEqual(bwd_c[1][4:], (E, T, 1, 0, name, W))
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        self.assertEqual([tuple(g.meta["val"].shape) for g in out], [(T, H), (T, k)])

    def test_autograd_wiring(self):
        """Forward and backward on meta tensors: gradients of every input, of the right shapes
        (which op each backward calls: test_backward_calls_the_other_op)."""
        a, w = meta(32, 64, requires_grad=True), meta(128, 64, requires_grad=True)
        _, c = mkt.all_gather_matmul(a, w.t())
        c.sum().backward()
        self.assertEqual((tuple(a.grad.shape), tuple(w.grad.shape)), ((32, 64), (128, 64)))
        h, w2 = meta(128, 96, requires_grad=True), meta(64, 96, requires_grad=True)
        out = mkt.matmul_reduce_scatter(h, w2.t())
        out.sum().backward()
        self.assertEqual((tuple(h.grad.shape), tuple(w2.grad.shape)), ((128, 96), (64, 96)))
        x, w3 = meta(16, 32, requires_grad=True), meta(32, 8, requires_grad=True)
        mkt.matmul_all_reduce(x, w3).sum().backward()
        self.assertEqual((tuple(x.grad.shape), tuple(w3.grad.shape)), ((16, 32), (32, 8)))

    def test_trace_tp_mlp_with_fake_tensors(self):
        """The tensor-parallel MLP traces to one graph holding the mkernel ops (no fallback)."""
        from torch.fx.experimental.proxy_tensor import make_fx

        def mlp(x, w_up, w_gate, w_down):
            _, up = mkt.all_gather_matmul(x, w_up.t())
            _, gate = mkt.all_gather_matmul(x, w_gate.t())
            return mkt.matmul_reduce_scatter(torch.nn.functional.silu(gate) * up, w_down.t())

        args = (meta(32, 256), meta(128, 256), meta(128, 256), meta(256, 128))
        gm = make_fx(mlp, tracing_mode="fake")(*args)
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        self.assertEqual(targets.count("mkernel.all_gather_matmul.default"), 2)
        self.assertEqual(targets.count("mkernel.matmul_reduce_scatter.default"), 1)
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        self.assertEqual(tuple(out.meta["val"].shape), (32, 256))


def _store_worker(rank, world, init_file, result_file):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}")
    try:
        c = mkt.init(require_gpu=False, ranks_per_node=1)
        again = mkt.init()
        info = (c.rank, c.world, c.node, c.nodes, c.local_rank, c.local_size, again is c)
        dist.destroy_process_group()  # tears mkernel's communicator down first
        with open(f"{result_file}.{rank}", "w") as f:
            f.write(repr((info, c.alive)))
    except Exception as e:  # noqa: BLE001
        with open(f"{result_file}.{rank}", "w") as f:
            f.write(f"error {type(e).__name__}: {e}")


class StoreBootstrap(unittest.TestCase):
    def test_two_processes_over_the_c10d_store(self):
        """The library's store bootstrap, served by PyTorch's store through the ctypes bridge."""
        try:
            mkernel._capi.lib()
        except mkernel.MkError as e:
            self.skipTest(f"no library: {e}")
        with tempfile.TemporaryDirectory() as d:
            init_file, result = os.path.join(d, "init"), os.path.join(d, "result")
            mp.start_processes(_store_worker, args=(2, init_file, result), nprocs=2, start_method="spawn")
            for r in range(2):
                with open(f"{result}.{r}") as f:
                    text = f.read()
                self.assertFalse(text.startswith("error"), text)
                info, alive = eval(text)  # noqa: S307 (our own repr)
                # ranks_per_node=1: two emulated nodes of one rank each
                self.assertEqual(info, (r, 2, r, 2, 0, 1, True))
                self.assertFalse(alive)

    def test_bridge_values_larger_than_the_buffer(self):
        """The get callback: absent key, a value that fits, one that does not (asked again with
        the size it reported), and a store failure reported through `why`."""
        store = dist.HashStore()
        big = bytes(range(256)) * 5
        store.set("k", big)
        br = mkt._StoreBridge(store)
        buf = ctypes.create_string_buffer(2048)
        n, found = ctypes.c_size_t(), ctypes.c_int()
        self.assertEqual(br.get_cb(None, b"absent", buf, 2048, ctypes.byref(n), ctypes.byref(found)), 0)
        self.assertEqual(found.value, 0)
        self.assertEqual(br.get_cb(None, b"k", buf, 100, ctypes.byref(n), ctypes.byref(found)), 0)
        self.assertEqual((found.value, n.value), (1, len(big)))
        self.assertEqual(br.get_cb(None, b"k", buf, n.value, ctypes.byref(n), ctypes.byref(found)), 0)
        self.assertEqual(buf.raw[:n.value], big)
        self.assertEqual(br.set_cb(None, b"k2", b"abc", 3), 0)
        self.assertEqual(store.get("k2"), b"abc")

        class Broken:
            def set(self, *_):
                raise OSError("store went away")
        br = mkt._StoreBridge(Broken())
        self.assertEqual(br.set_cb(None, b"x", b"1", 1), 1)
        # why fills the caller's buffer, cut and terminated at its last byte, and leaks nothing
        # (a callback returning c_char_p made ctypes warn "memory leak in callback function").
        import warnings
        why = ctypes.create_string_buffer(b"\xff" * 64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(br.why_cb(None, ctypes.addressof(why), 64), 0)
            self.assertEqual(br.why_cb(None, ctypes.addressof(why), 12), 0)
        self.assertEqual([str(w.message) for w in caught], [])
        self.assertEqual(why.raw[:12], b"OSError: st\0")

    def test_store_failure_reaches_the_error_through_why(self):
        """A failing store through the library: the reason from `why` is in the MkError."""
        class Broken:
            def set(self, *_):
                raise OSError("store went away")
        br = mkt._StoreBridge(Broken())
        comm = ctypes.c_void_p()
        rc = mkernel._capi.lib().mk_comm_create_store(0, 1, b"broken", None, br.set_cb, br.get_cb, br.erase_cb,
                                                      br.why_cb, -1, -1, 0, ctypes.byref(comm))
        self.assertEqual(rc, 5)  # system error
        self.assertIn("OSError: store went away", mkernel._capi.lib().mk_last_error().decode())
        self.assertIsNone(comm.value)

    def test_init_without_process_group(self):
        with self.assertRaises(mkernel.MkError) as cm:
            mkt.init()
        self.assertIn("init_process_group", str(cm.exception))


if __name__ == "__main__":
    unittest.main(verbosity=2)
