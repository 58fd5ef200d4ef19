"""mkernel's fused operators as PyTorch ops (namespace ``mkernel``), bootstrapped from torch.distributed.

    import torch, torch.distributed as dist, mkernel.torch as mkt
    dist.init_process_group("gloo")            # any backend: mkernel only uses the group's store
    torch.cuda.set_device(local_rank)
    mkt.init()                                 # collective over the group (default: WORLD)
    ag, y = mkt.all_gather_matmul(x_shard, w.t(), gather_dim=0)   # w: nn.Linear weight [N, K]
    z = mkt.matmul_reduce_scatter(h, w2.t(), scatter_dim=0)

The ops are registered with ``torch.library`` (``torch.ops.mkernel.*``), each with a fake
implementation (torch.compile, meta tensors) and, where one exists, autograd. They run on the
current CUDA stream and can be captured in a CUDA graph once the shape has run outside capture
(the operator for a shape is created, collectively, on its first call). Library failures raise
``mkernel.MkError`` with the library's message. docs/pytorch.md has the details.
"""
import atexit
import ctypes
import threading
from typing import List, NamedTuple, Optional

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as e:  # the package's torch part needs torch; the rest does not
    raise ImportError("mkernel.torch needs PyTorch (>= 2.4): pip install 'mkernel[torch]' (from the "
                      "source tree: pip install '.[torch]'), or install torch first") from e

from . import _capi
from ._capi import MkError, check

__all__ = ["init", "finalize", "finalize_all", "communicator", "Communicator", "all_gather_matmul",
           "matmul_reduce_scatter", "matmul_all_reduce", "attention", "attention_varlen", "ring_attention", "ring_balanced_rows",
           "all_gather", "reduce_scatter", "all_reduce", "moe_dispatch", "moe_combine", "MoeRouting", "moe_layer",
           "MkError"]

_KIND_AG, _KIND_RS, _KIND_AR = 0, 1, 2
_COLL_NAMES = ("all_gather", "reduce_scatter", "all_reduce")  # collective.h's kinds 0, 1, 2
_COLL_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
_LAYOUTS = {"contiguous": 0, "zigzag": 1}

_lock = threading.RLock()
_comms = {}          # group name -> Communicator
_generations = {}    # group name -> communicators created for it so far (store key namespace)
_default_name = None  # the group of group=None: the first init()'s


class _StoreBridge:
    """Serves the library's store bootstrap from a c10d store (called back from C, this thread)."""

    def __init__(self, store):
        self.store = store
        self.why = b""
        self._pending = None  # (key, value) whose value did not fit the library's buffer
        self.set_cb = _capi.STORE_SET(self._set)
        self.get_cb = _capi.STORE_GET(self._get)
        self.erase_cb = _capi.STORE_ERASE(self._erase)
        self.why_cb = _capi.STORE_WHY(self._why)

    def _fail(self, e):
        self.why = f"{type(e).__name__}: {e}".encode(errors="replace")
        return 1

    def _set(self, _ctx, key, data, length):
        try:
            self.store.set(key.decode(), ctypes.string_at(data, length))
            return 0
        except Exception as e:  # noqa: BLE001 (reported through `why`)
            return self._fail(e)

    def _get(self, _ctx, key, buf, cap, length, found):
        try:
            k = key.decode()
            if self._pending is not None and self._pending[0] == k:
                value = self._pending[1]
            elif self.store.check([k]):
                value = bytes(self.store.get(k))
            else:
                found[0] = 0
                return 0
            found[0] = 1
            length[0] = len(value)
            if len(value) <= cap:
                ctypes.memmove(buf, value, len(value))
                self._pending = None
            else:
                self._pending = (k, value)
            return 0
        except Exception as e:  # noqa: BLE001
            return self._fail(e)

    def _erase(self, _ctx, key):
        try:
            self.store.delete_key(key.decode())
            return 0
        except Exception as e:  # noqa: BLE001
            return self._fail(e)

    def _why(self, _ctx, buf, cap):
        if cap:
            n = min(len(self.why), cap - 1)
            ctypes.memmove(buf, self.why, n)
            ctypes.memset(buf + n, 0, 1)
        return 0


class Communicator:
    """mkernel's communicator for one process group, and the operators created on it (per shape)."""

    def __init__(self, group, name, handle, bridge):
        self.group = group
        self.group_name = name
        self._handle = handle
        self._bridge = bridge  # keeps the store and the callbacks alive as long as the communicator
        info = _capi.CommInfo()
        check(_capi.lib().mk_comm_info(handle, ctypes.byref(info)))
        (self.rank, self.world, self.node, self.nodes, self.local_rank, self.local_size,
         self.device) = (info.rank, info.world, info.node, info.nodes, info.local_rank, info.local_size, info.device)
        self._fused = {}  # (kind, M, N, K) -> handle, in creation order
        self._ring = {}   # (B, H, Hkv, D, S, layout, causal, scale, shard rows) -> handle
        self._ring_bwd = {}  # the same key -> the backward's handle
        self._coll = {}   # (kind, dtype, count) -> handle
        self._moe = {}    # (hidden, experts, topk, max tokens, expert align, recv capacity) -> handle
        self._moe_sizes = {}  # handle -> (recv rows, routing bytes), read once at creation
        self._moe_layer = {}  # the same and the experts' width -> handle

    def __repr__(self):
        return (f"mkernel.torch.Communicator(group={self.group_name!r}, rank={self.rank}, world={self.world}, "
                f"nodes={self.nodes}, device={self.device})")

    @property
    def alive(self):
        return self._handle is not None

    def _require(self):
        if self._handle is None:
            raise MkError(1, f"mkernel: the communicator of process group '{self.group_name}' was finalized")

    def check(self):
        """Raises MkError when a device wait gave up or a peer failed (the library's diagnosis)."""
        self._require()
        check(_capi.lib().mk_comm_check(self._handle))

    def _creating(self, what):
        self._require()
        if torch.cuda.is_current_stream_capturing():
            raise MkError(1, f"mkernel: {what} has not run outside CUDA graph capture yet: creating its operator "
                             "allocates memory and talks to every rank, which capture forbids; run the call once "
                             "(a warm-up, on every rank) before capturing it")

    def fused(self, kind, M, N, K, rows=None):
        rows = tuple(int(r) for r in rows) if rows else ()
        key = (kind, M, N, K, rows)
        h = self._fused.get(key)
        if h is None:
            self._creating(f"{('all_gather_matmul', 'matmul_reduce_scatter', 'matmul_all_reduce')[kind]} "
                           f"with M={M} N={N} K={K}" + (f" shard rows {list(rows)}" if rows else ""))
            out = ctypes.c_void_p()
            if rows:
                arr = (ctypes.c_int64 * len(rows))(*rows)
                check(_capi.lib().mk_fused_create_rows(self._handle, kind, M, N, K, arr, len(rows), 0, -1, b"",
                                                       ctypes.byref(out)))
            else:
                check(_capi.lib().mk_fused_create(self._handle, kind, M, N, K, 0, -1, b"", ctypes.byref(out)))
            h = self._fused[key] = out.value
        return h

    def _ring_op(self, table, create, what, B, H, Hkv, D, S, layout, causal, scale, rows):
        rows = tuple(int(r) for r in rows) if rows else ()
        key = (B, H, Hkv, D, S, layout, causal, scale, rows)
        h = table.get(key)
        if h is None:
            self._creating(f"{what} with B={B} H={H} Hkv={Hkv} D={D} S={S}" +
                           (f" shard rows {list(rows)}" if rows else ""))
            out = ctypes.c_void_p()
            arr = (ctypes.c_int64 * len(rows))(*rows) if rows else None
            check(create(self._handle, B, H, Hkv, D, S, layout, int(causal), float(scale), arr, len(rows), -1, b"",
                         ctypes.byref(out)))
            h = table[key] = out.value
        return h

    def ring(self, B, H, Hkv, D, S, layout, causal, scale, rows=None):
        return self._ring_op(self._ring, _capi.lib().mk_ring_create_rows, "ring_attention", B, H, Hkv, D, S, layout,
                             causal, scale, rows)

    def ring_backward(self, B, H, Hkv, D, S, layout, causal, scale, rows=None):
        return self._ring_op(self._ring_bwd, _capi.lib().mk_ring_backward_create_rows, "ring_attention's backward", B,
                             H, Hkv, D, S, layout, causal, scale, rows)

    def collective(self, kind, dtype, count):
        key = (kind, dtype, count)
        h = self._coll.get(key)
        if h is None:
            self._creating(f"{_COLL_NAMES[kind]} of {count} elements")
            out = ctypes.c_void_p()
            check(_capi.lib().mk_coll_create(self._handle, kind, dtype, count, 0, 0, b"", ctypes.byref(out)))
            h = self._coll[key] = out.value
        return h

    def moe(self, hidden, experts, topk, max_tokens, align, capacity):
        """(handle, recv rows, routing bytes) of the MoE operator for this configuration."""
        key = (hidden, experts, topk, max_tokens, align, capacity)
        h = self._moe.get(key)
        if h is None:
            self._creating(f"moe_dispatch with hidden={hidden} experts={experts} topk={topk} max_tokens={max_tokens}")
            out = ctypes.c_void_p()
            check(_capi.lib().mk_moe_create(self._handle, hidden, experts, topk, max_tokens, align, capacity, 0, 0,
                                            b"", ctypes.byref(out)))
            h = self._moe[key] = out.value
            rows, nbytes = ctypes.c_int64(), ctypes.c_int64()
            check(_capi.lib().mk_moe_recv_rows(h, ctypes.byref(rows)))
            check(_capi.lib().mk_moe_routing_bytes(h, ctypes.byref(nbytes)))
            self._moe_sizes[h] = (rows.value, nbytes.value)
        return (h,) + self._moe_sizes[h]

    def moe_layer(self, hidden, experts, topk, max_tokens, align, capacity, inter):
        key = (hidden, experts, topk, max_tokens, align, capacity, inter)
        h = self._moe_layer.get(key)
        if h is None:
            self._creating(f"moe_layer with hidden={hidden} experts={experts} topk={topk} max_tokens={max_tokens} "
                           f"intermediate={inter}")
            out = ctypes.c_void_p()
            check(_capi.lib().mk_moe_layer_create(self._handle, hidden, experts, topk, max_tokens, align, capacity,
                                                  inter, 0, 0, b"", ctypes.byref(out)))
            h = self._moe_layer[key] = out.value
        return h

    def check_moe(self):
        """After the stream completed: raises MkError naming the first bad routing input (an expert id
        out of range, too many tokens, an overflow of recv_capacity) a MoE call of this communicator
        met on the device."""
        torch.cuda.current_stream().synchronize()
        for h in self._moe.values():
            check(_capi.lib().mk_moe_check(h))
        for h in self._moe_layer.values():
            check(_capi.lib().mk_moe_layer_check(h))

    def clear_cache(self):
        """Collective: destroys the operators created so far (their memory), newest first."""
        errors = []
        lib = _capi.lib()
        for table, destroy in ((self._moe_layer, lib.mk_moe_layer_destroy), (self._moe, lib.mk_moe_destroy),
                               (self._coll, lib.mk_coll_destroy), (self._ring_bwd, lib.mk_ring_backward_destroy),
                               (self._ring, lib.mk_ring_destroy), (self._fused, lib.mk_fused_destroy)):
            for h in reversed(list(table.values())):
                if destroy(h) != 0:
                    errors.append(lib.mk_last_error().decode(errors="replace"))
            table.clear()
        self._moe_sizes.clear()
        if errors:
            raise MkError(8, "mkernel: destroying operators: " + "; ".join(errors))

    def destroy(self):
        """Collective: destroys every operator, then the communicator. Idempotent."""
        if self._handle is None:
            return
        lib = _capi.lib()
        try:
            self.clear_cache()
        finally:
            handle, self._handle = self._handle, None
            check(lib.mk_comm_destroy(handle))


def _name_of(group):
    if group is None:
        group = dist.group.WORLD
    return group.group_name


def init(group=None, *, ranks_per_node=-1, device=None, require_gpu=True):
    """Collective over `group` (default: the WORLD group): builds mkernel's communicator from the
    group's store. Returns it; a second call for the same group returns the same one.

    ranks_per_node: -1 finds the nodes from the hosts (or the tunable ranks_per_node); n > 0
    treats every n consecutive ranks as one node (emulated nodes: traffic between them takes the
    network path). device: the GPU (default: torch.cuda.current_device()). require_gpu=False
    gives, on a machine without a GPU, a communicator with bootstrap and topology only.
    """
    global _default_name
    if not dist.is_available() or not dist.is_initialized():
        raise MkError(1, "mkernel.torch.init: torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first, e.g. under torchrun)")
    if group is None:
        group = dist.group.WORLD
    name = group.group_name
    with _lock:
        c = _comms.get(name)
        if c is not None and c.alive:
            return c
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise MkError(1, f"mkernel.torch.init: this process is not a member of process group '{name}'")
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else -1
        gen = _generations.get(name, 0)
        _generations[name] = gen + 1
        prefix = f"mkernel/{name}/{gen}".encode()
        bridge = _StoreBridge(dist.distributed_c10d._get_default_store())
        out = ctypes.c_void_p()
        check(_capi.lib().mk_comm_create_store(rank, size, prefix, None, bridge.set_cb, bridge.get_cb,
                                                bridge.erase_cb, bridge.why_cb, int(device), int(ranks_per_node),
                                                int(bool(require_gpu)), ctypes.byref(out)))
        c = _comms[name] = Communicator(group, name, out.value, bridge)
        if _default_name is None or _default_name not in _comms:
            _default_name = name
        _hook_group_teardown()
        return c


def communicator(group=None):
    """The communicator init() made for `group` (default: the first group initialized)."""
    name = _default_name if group is None else (group if isinstance(group, str) else group.group_name)
    c = _comms.get(name) if name is not None else None
    if c is None or not c.alive:
        raise MkError(1, f"mkernel: no communicator for process group '{name}': call mkernel.torch.init(group) first")
    return c


def finalize(group=None):
    """Collective: destroys the communicator of `group` (default: the first initialized) and its operators."""
    global _default_name
    name = _default_name if group is None else (group if isinstance(group, str) else group.group_name)
    with _lock:
        c = _comms.pop(name, None)
        if name == _default_name:
            _default_name = next(iter(_comms), None)
    if c is not None:
        c.destroy()


def finalize_all():
    """Collective: destroys every communicator, newest first (at exit, and before the WORLD group goes)."""
    errors = []
    for name in reversed(list(_comms)):
        try:
            finalize(name)
        except MkError as e:
            errors.append(str(e))
    if errors:
        raise MkError(8, "; ".join(errors))


_hooked = False


def _hook_group_teardown():
    """torch.distributed.destroy_process_group(g) first destroys mkernel's communicator of g (all
    of them for the default group), while the store still serves it; at exit, finalize_all."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    original = dist.destroy_process_group

    def destroy_process_group(group=None):
        if group is None or group is dist.group.WORLD:
            finalize_all()
        elif group.group_name in _comms:
            finalize(group.group_name)
        return original(group)

    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    atexit.register(_finalize_at_exit)


def _finalize_at_exit():
    try:
        finalize_all()
    except MkError as e:
        print(f"mkernel: at exit: {e}")


def _world(name):
    c = _comms.get(name)
    if c is not None and c.alive:
        return c.world
    try:  # fake tensors and tracing need only the group's size
        return dist.distributed_c10d._resolve_process_group(name).size()
    except Exception:  # noqa: BLE001
        raise MkError(1, f"mkernel: no communicator for process group '{name}': "
                         "call mkernel.torch.init(group) first") from None


def _rank(name):
    c = _comms.get(name)
    if c is not None and c.alive:
        return c.rank
    try:
        return dist.distributed_c10d._resolve_process_group(name).rank()
    except Exception:  # noqa: BLE001
        raise MkError(1, f"mkernel: no communicator for process group '{name}': "
                         "call mkernel.torch.init(group) first") from None


def _check_rows(what, rows, W, M=None):
    """Uneven shards: every rank's rows (a list of W counts >= 1; M their sum when given)."""
    if rows is None:
        return
    if len(rows) != W or any(int(r) < 1 for r in rows):
        raise MkError(1, f"mkernel.{what}: shard rows {list(rows)}: one count >= 1 per rank ({W} ranks)")
    if M is not None and sum(rows) != M:
        raise MkError(1, f"mkernel.{what}: shard rows {list(rows)} sum to {sum(rows)}, not M = {M}")


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _op_comm(what, group_name, world_size, t):
    """The communicator an op call runs on, checked against the call's world size and device."""
    c = communicator(group_name)
    if world_size != c.world:
        raise MkError(1, f"mkernel.{what}: called for {world_size} ranks, but process group '{group_name}' has "
                         f"{c.world}")
    _device_check(c, what, t)
    return c


def _check_mm(what, a, b):
    if a.dim() != 2 or b.dim() != 2:
        raise MkError(1, f"mkernel.{what}: a and b must be 2-D (got {tuple(a.shape)} and {tuple(b.shape)})")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise MkError(1, f"mkernel.{what}: a and b must be bfloat16 (got {a.dtype} and {b.dtype})")
    if a.shape[1] != b.shape[0]:
        raise MkError(1, f"mkernel.{what}: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    if a.device != b.device:
        raise MkError(1, f"mkernel.{what}: a is on {a.device}, b on {b.device}")


def _weight(b):
    """b [K, N] as the kernel's B [N, K] row-major: free for b = weight.t() of an nn.Linear weight."""
    bt = b.t()
    return bt if bt.is_contiguous() else bt.contiguous()


def _device_check(c, what, t):
    if t.device.type != "cuda" or t.device.index != c.device:
        raise MkError(1, f"mkernel.{what}: tensors must be on cuda:{c.device}, the communicator's GPU "
                         f"(got {t.device})")


# ---- ops ------------------------------------------------------------------------------------
# The GEMM ops take the group's size as an argument: their output shapes depend on it, and a
# compiled graph (and torch.compile's caches, which key on the graph) must too — a graph traced
# at one world size is then never reused at another.

@torch.library.custom_op("mkernel::all_gather_matmul", mutates_args=(), device_types="cuda")
def _all_gather_matmul(a: torch.Tensor, b: torch.Tensor, group_name: str, world_size: int,
                       return_a: bool, shard_rows: Optional[List[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    c = _op_comm("all_gather_matmul", group_name, world_size, a)
    _check_mm("all_gather_matmul", a, b)
    W = c.world
    _check_rows("all_gather_matmul", shard_rows, W)
    if shard_rows is not None and shard_rows[c.rank] != a.shape[0]:
        raise MkError(1, f"mkernel.all_gather_matmul: rank {c.rank}'s shard has {a.shape[0]} rows, shard rows say "
                         f"{shard_rows[c.rank]}")
    M, K, N = (sum(shard_rows) if shard_rows is not None else a.shape[0] * W), a.shape[1], b.shape[1]
    a = a.contiguous()
    bt = _weight(b)
    out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    h = c.fused(_KIND_AG, M, N, K, shard_rows)
    s = _stream()
    check(_capi.lib().mk_fused_run(h, a.data_ptr(), bt.data_ptr(), out.data_ptr(), s))
    if not return_a:
        return a.new_empty((0,)), out
    gathered = torch.empty((M, K), dtype=torch.bfloat16, device=a.device)
    if W == 1:
        gathered.copy_(a)
    else:
        check(_capi.lib().mk_fused_copy_gathered_a(h, gathered.data_ptr(), s))
    return gathered, out


@_all_gather_matmul.register_fake
def _(a, b, group_name, world_size, return_a, shard_rows=None):
    _check_mm("all_gather_matmul", a, b)
    _check_rows("all_gather_matmul", shard_rows, world_size)
    M = sum(shard_rows) if shard_rows is not None else a.shape[0] * world_size
    gathered = a.new_empty((M, a.shape[1])) if return_a else a.new_empty((0,))
    return gathered, a.new_empty((M, b.shape[1]))


def _reduced_matmul(kind, what, a, b, group_name, world_size, shard_rows=None):
    """matmul_reduce_scatter (this rank's M/W rows, or its shard_rows entry) or matmul_all_reduce
    (all M rows)."""
    c = _op_comm(what, group_name, world_size, a)
    _check_mm(what, a, b)
    W = c.world
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    _check_rows(what, shard_rows, W, M)
    if kind == _KIND_RS and shard_rows is None and M % W:  # all-reduce splits any M itself
        raise MkError(1, f"mkernel.{what}: M = {M} rows do not split over {W} ranks (give shard_rows)")
    a = a.contiguous()
    bt = _weight(b)
    rows = M if kind != _KIND_RS else shard_rows[c.rank] if shard_rows is not None else M // W
    out = torch.empty((rows, N), dtype=torch.bfloat16, device=a.device)
    check(_capi.lib().mk_fused_run(c.fused(kind, M, N, K, shard_rows), a.data_ptr(), bt.data_ptr(), out.data_ptr(),
                                   _stream()))
    return out


@torch.library.custom_op("mkernel::matmul_reduce_scatter", mutates_args=(), device_types="cuda")
def _matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group_name: str, world_size: int,
                           shard_rows: Optional[List[int]] = None) -> torch.Tensor:
    return _reduced_matmul(_KIND_RS, "matmul_reduce_scatter", a, b, group_name, world_size, shard_rows)


@_matmul_reduce_scatter.register_fake
def _(a, b, group_name, world_size, shard_rows=None):
    _check_mm("matmul_reduce_scatter", a, b)
    W = world_size
    if shard_rows is not None:
        torch._check(a.shape[0] == sum(shard_rows),
                     lambda: f"mkernel.matmul_reduce_scatter: M rows are not the sum of shard rows {list(shard_rows)}")
        _check_rows("matmul_reduce_scatter", shard_rows, W)
        return a.new_empty((shard_rows[_rank(group_name)], b.shape[1]))
    torch._check(a.shape[0] % W == 0, lambda: f"mkernel.matmul_reduce_scatter: M rows do not split over {W} ranks")
    return a.new_empty((a.shape[0] // W, b.shape[1]))


@torch.library.custom_op("mkernel::matmul_all_reduce", mutates_args=(), device_types="cuda")
def _matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return _reduced_matmul(_KIND_AR, "matmul_all_reduce", a, b, group_name, world_size)


@_matmul_all_reduce.register_fake
def _(a, b, group_name, world_size):
    _check_mm("matmul_all_reduce", a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


def _check_attn(q, k, v):
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4 or t.dtype != torch.bfloat16:
            raise MkError(1, f"mkernel.ring_attention: {n} must be a 4-D [B, S/W, heads, D] bfloat16 tensor "
                             f"(got {tuple(t.shape)} {t.dtype})")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise MkError(1, f"mkernel.ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "do not match")


def _ring_seq(what, c, s, shard_rows):
    """The whole sequence's tokens of a ring call whose rank holds s of them: s * W, or the sum of
    shard_rows (uneven shards: one count per rank, this rank's s)."""
    if shard_rows is None:
        return s * c.world
    _check_rows(what, shard_rows, c.world)
    if shard_rows[c.rank] != s:
        raise MkError(1, f"mkernel.{what}: rank {c.rank} holds {s} tokens, shard rows say {shard_rows[c.rank]}")
    return sum(int(r) for r in shard_rows)


def _check_ring_docs(what, q, cu_seqlens):
    """n_docs of a ring call's packed documents (0 without them)."""
    if cu_seqlens is None:
        return 0
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise MkError(1, f"mkernel.{what}: cu_seqlens must be a 1-D int32 tensor of n_docs + 1 >= 2 entries "
                         f"(got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype})")
    if cu_seqlens.device != q.device:
        raise MkError(1, f"mkernel.{what}: cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
    if q.shape[0] != 1:
        raise MkError(1, f"mkernel.{what}: packed documents (cu_seqlens) need B = 1, not {q.shape[0]}")
    return cu_seqlens.numel() - 1


@torch.library.custom_op("mkernel::ring_attention", mutates_args=(), device_types="cuda")
def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, scale: float,
                    group_name: str, cu_seqlens: Optional[torch.Tensor] = None,
                    shard_rows: Optional[List[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    c = communicator(group_name)
    _check_attn(q, k, v)
    _device_check(c, "ring_attention", q)
    if layout not in _LAYOUTS:
        raise MkError(1, f"mkernel.ring_attention: layout '{layout}' is not 'contiguous' or 'zigzag'")
    n_docs = _check_ring_docs("ring_attention", q, cu_seqlens)
    B, s, H, D = q.shape
    S = _ring_seq("ring_attention", c, s, shard_rows)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty((B, H, s), dtype=torch.float32, device=q.device)
    h = c.ring(B, H, k.shape[2], D, S, _LAYOUTS[layout], causal, scale, shard_rows)
    if n_docs:
        check(_capi.lib().mk_ring_run_packed(h, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                             lse.data_ptr(), cu_seqlens.contiguous().data_ptr(), n_docs, _stream()))
    else:
        check(_capi.lib().mk_ring_run(h, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                      _stream()))
    return o, lse


@_ring_attention.register_fake
def _(q, k, v, causal, layout, scale, group_name, cu_seqlens=None, shard_rows=None):
    _check_attn(q, k, v)
    _check_ring_docs("ring_attention", q, cu_seqlens)
    if shard_rows is not None:
        _check_rows("ring_attention", shard_rows, _world(group_name))
    if layout not in _LAYOUTS:
        raise MkError(1, f"mkernel.ring_attention: layout '{layout}' is not 'contiguous' or 'zigzag'")
    B, s, H, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, H, s), dtype=torch.float32)


@torch.library.custom_op("mkernel::attention", mutates_args=(), device_types="cuda")
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .attention import attention_forward
    B, Sq, H, _ = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    return attention_forward(q, k, v, causal=causal, scale=scale, out=o, lse=lse)


@_attention.register_fake
def _(q, k, v, causal, scale):
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4 or t.dtype != torch.bfloat16:
            raise MkError(1, f"mkernel.attention: {n} must be a 4-D [B, S, heads, D] bfloat16 tensor "
                             f"(got {tuple(t.shape)} {t.dtype})")
    B, Sq, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Sq), dtype=torch.float32)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(output[1])


def _attention_backward_rule(ctx, grad_o, _grad_lse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.mkernel.attention_backward(q, k, v, o, lse, grad_o.to(torch.bfloat16).contiguous(),
                                                      ctx.causal, ctx.scale, 0, 0, False)
    return dq, dk, dv, None, None


_attention.register_autograd(_attention_backward_rule, setup_context=_attention_setup)


@torch.library.custom_op("mkernel::attention_backward", mutates_args=(), device_types="cuda")
def _attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, causal: bool, scale: float, q_pos0: int, kv_pos0: int,
                        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .attention import attention_backward
    return attention_backward(q, k, v, o, lse, dout, causal=causal, scale=scale, q_pos0=q_pos0, kv_pos0=kv_pos0,
                              deterministic=deterministic)


@_attention_backward.register_fake
def _(q, k, v, o, lse, dout, causal, scale, q_pos0, kv_pos0, deterministic):
    for t, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout")):
        if t.dim() != 4 or t.dtype != torch.bfloat16:
            raise MkError(1, f"mkernel.attention_backward: {n} must be a 4-D [B, S, heads, D] bfloat16 tensor "
                             f"(got {tuple(t.shape)} {t.dtype})")
    B, Sq, H, _ = q.shape
    if tuple(lse.shape) != (B, H, Sq) or lse.dtype != torch.float32:
        raise MkError(1, f"mkernel.attention_backward: lse must be fp32 of shape {(B, H, Sq)}")
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("mkernel::attention_varlen", mutates_args=(), device_types="cuda")
def _attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .attention import attention_varlen_forward
    S, H, _ = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((H, S), dtype=torch.float32, device=q.device)
    return attention_varlen_forward(q, k, v, cu_seqlens, causal=causal, scale=scale, out=o, lse=lse)


def _varlen_fake_check(what, ts, cu_seqlens):
    for t, n in ts:
        if t.dim() != 3 or t.dtype != torch.bfloat16:
            raise MkError(1, f"mkernel.{what}: {n} must be a 3-D [S, heads, D] bfloat16 tensor "
                             f"(got {tuple(t.shape)} {t.dtype})")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise MkError(1, f"mkernel.{what}: cu_seqlens must be a 1-D int32 tensor (got {tuple(cu_seqlens.shape)} "
                         f"{cu_seqlens.dtype})")


@_attention_varlen.register_fake
def _(q, k, v, cu_seqlens, causal, scale):
    _varlen_fake_check("attention_varlen", ((q, "q"), (k, "k"), (v, "v")), cu_seqlens)
    S, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((H, S), dtype=torch.float32)


def _attention_varlen_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, causal, scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, *output)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(output[1])


def _attention_varlen_backward_rule(ctx, grad_o, _grad_lse):
    q, k, v, cu_seqlens, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.mkernel.attention_varlen_backward(q, k, v, o, lse, grad_o.to(torch.bfloat16).contiguous(),
                                                             cu_seqlens, ctx.causal, ctx.scale, False)
    return dq, dk, dv, None, None, None


_attention_varlen.register_autograd(_attention_varlen_backward_rule, setup_context=_attention_varlen_setup)


@torch.library.custom_op("mkernel::attention_varlen_backward", mutates_args=(), device_types="cuda")
def _attention_varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                               lse: torch.Tensor, dout: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                               scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .attention import attention_varlen_backward
    return attention_varlen_backward(q, k, v, o, lse, dout, cu_seqlens, causal=causal, scale=scale,
                                     deterministic=deterministic)


@_attention_varlen_backward.register_fake
def _(q, k, v, o, lse, dout, cu_seqlens, causal, scale, deterministic):
    _varlen_fake_check("attention_varlen_backward", ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (dout, "dout")),
                       cu_seqlens)
    S, H, _ = q.shape
    if tuple(lse.shape) != (H, S) or lse.dtype != torch.float32:
        raise MkError(1, f"mkernel.attention_varlen_backward: lse must be fp32 of shape {(H, S)}")
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _check_coll(what, x, world_size, scatter):
    if x.dtype not in _COLL_DTYPES:
        raise MkError(1, f"mkernel.{what}: x must be bfloat16 or float32 (got {x.dtype})")
    if x.dim() < 1:
        raise MkError(1, f"mkernel.{what}: x must have at least one dimension (got a scalar)")
    W = world_size
    if scatter and x.shape[0] % W:
        raise MkError(1, f"mkernel.{what}: dimension 0 of size {x.shape[0]} does not split over {W} ranks")
    per_rank = x.numel() // W if scatter else x.numel()
    if per_rank % 8:
        raise MkError(1, f"mkernel.{what}: {per_rank} elements per rank is not a multiple of 8 (16-byte rows); "
                         "pad the tensor")


def _collective(kind, x, group_name, world_size):
    what = _COLL_NAMES[kind]
    c = _op_comm(what, group_name, world_size, x)
    _check_coll(what, x, world_size, kind == 1)
    x = x.contiguous()
    W = c.world
    if kind == 0:
        out = x.new_empty((W * x.shape[0],) + tuple(x.shape[1:]))
        count = x.numel()
    elif kind == 1:
        out = x.new_empty((x.shape[0] // W,) + tuple(x.shape[1:]))
        count = out.numel()
    else:
        out = torch.empty_like(x)
        count = x.numel()
    if count:
        h = c.collective(kind, _COLL_DTYPES[x.dtype], count)
        check(_capi.lib().mk_coll_run(h, x.data_ptr(), out.data_ptr(), _stream()))
    return out


@torch.library.custom_op("mkernel::all_gather", mutates_args=(), device_types="cuda")
def _all_gather(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return _collective(0, x, group_name, world_size)


@_all_gather.register_fake
def _(x, group_name, world_size):
    _check_coll("all_gather", x, world_size, False)
    return x.new_empty((world_size * x.shape[0],) + tuple(x.shape[1:]))


@torch.library.custom_op("mkernel::reduce_scatter", mutates_args=(), device_types="cuda")
def _reduce_scatter(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return _collective(1, x, group_name, world_size)


@_reduce_scatter.register_fake
def _(x, group_name, world_size):
    _check_coll("reduce_scatter", x, world_size, True)
    return x.new_empty((x.shape[0] // world_size,) + tuple(x.shape[1:]))


@torch.library.custom_op("mkernel::all_reduce", mutates_args=(), device_types="cuda")
def _all_reduce(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return _collective(2, x, group_name, world_size)


@_all_reduce.register_fake
def _(x, group_name, world_size):
    _check_coll("all_reduce", x, world_size, False)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# MoE expert parallelism (include/mkernel/ops/moe.h). Each dispatch keeps its routing (where each
# token's rows went and how they come back) in a uint8 tensor of its own, an output of the op: the
# combine and the backward pass take it from there, so any number of dispatches may be in flight
# (micro-batches, layers awaiting their backward) and torch frees a routing with its last user.

def _moe_sizes(what, group_name, world_size, hidden, experts, topk, max_tokens, align, capacity):
    """(recv_rows, routing_bytes) of the operator, from the library's rules, without creating it
    (fake tensors). The node layout is the communicator's (one node when tracing without one)."""
    c = _comms.get(group_name)
    nodes, local = (c.nodes, c.local_size) if c is not None and c.alive else (1, world_size)
    rows, nbytes = ctypes.c_int64(), ctypes.c_int64()
    rc = _capi.lib().mk_moe_sizes(world_size, nodes, local, hidden, experts, topk, max_tokens, align, capacity, 0,
                                  ctypes.byref(rows), ctypes.byref(nbytes))
    if rc != 0:
        raise MkError(rc, f"mkernel.{what}: " + _capi.lib().mk_last_error().decode(errors="replace"))
    return rows.value, nbytes.value


def _check_moe(what, x, x_name, topk_ids, experts, max_tokens, world_size):
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise MkError(1, f"mkernel.{what}: {x_name} must be a 2-D bfloat16 tensor (got {tuple(x.shape)} {x.dtype})")
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32:
        raise MkError(1, f"mkernel.{what}: topk_ids must be a 2-D int32 tensor [tokens, k] (got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype})")
    if topk_ids.device != x.device:
        raise MkError(1, f"mkernel.{what}: {x_name} is on {x.device}, topk_ids on {topk_ids.device}")
    if topk_ids.shape[0] > max_tokens:
        raise MkError(1, f"mkernel.{what}: {topk_ids.shape[0]} tokens, more than max_tokens = {max_tokens}")
    if experts % world_size:
        raise MkError(1, f"mkernel.{what}: {experts} experts do not split over {world_size} ranks")


@torch.library.custom_op("mkernel::moe_dispatch", mutates_args=(), device_types="cuda")
def _moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, max_tokens: int, expert_align: int,
                  recv_capacity: int, group_name: str, world_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _op_comm("moe_dispatch", group_name, world_size, x)
    _check_moe("moe_dispatch", x, "x", topk_ids, num_experts, max_tokens, world_size)
    T, H = x.shape
    k = topk_ids.shape[1]
    h, rows, nbytes = c.moe(H, num_experts, k, max_tokens, expert_align, recv_capacity)
    El = num_experts // c.world
    x, topk_ids = x.contiguous(), topk_ids.contiguous()
    # Rows no token lands in (alignment gaps, the capacity past the last expert) are zeros, so
    # that an expert computation over all rows adds nothing from them to its weights' gradients.
    recv_x = torch.zeros((rows, H), dtype=torch.bfloat16, device=x.device)
    counts = torch.empty((El,), dtype=torch.int32, device=x.device)
    offsets = torch.empty((El + 1,), dtype=torch.int32, device=x.device)
    routing = torch.zeros((nbytes,), dtype=torch.uint8, device=x.device)
    check(_capi.lib().mk_moe_dispatch_routed(h, x.data_ptr(), topk_ids.data_ptr(), None, None, T, recv_x.data_ptr(),
                                             counts.data_ptr(), offsets.data_ptr(), routing.data_ptr(), nbytes,
                                             _stream()))
    return recv_x, counts, offsets, routing


@_moe_dispatch.register_fake
def _(x, topk_ids, num_experts, max_tokens, expert_align, recv_capacity, group_name, world_size):
    _check_moe("moe_dispatch", x, "x", topk_ids, num_experts, max_tokens, world_size)
    rows, nbytes = _moe_sizes("moe_dispatch", group_name, world_size, x.shape[1], num_experts, topk_ids.shape[1],
                              max_tokens, expert_align, recv_capacity)
    El = num_experts // world_size
    return (x.new_empty((rows, x.shape[1])), topk_ids.new_empty((El,)), topk_ids.new_empty((El + 1,)),
            x.new_empty((nbytes,), dtype=torch.uint8))


def _check_combine(what, y, topk_ids, topk_weights, routing, rows, nbytes):
    if y.dim() != 2 or y.dtype != torch.bfloat16 or y.shape[0] != rows:
        raise MkError(1, f"mkernel.{what}: y must be bfloat16 [{rows}, H], the dispatch's recv_x rows (got "
                         f"{tuple(y.shape)} {y.dtype})")
    if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise MkError(1, f"mkernel.{what}: topk_weights must be float32 shaped as topk_ids {tuple(topk_ids.shape)} "
                         f"(got {tuple(topk_weights.shape)} {topk_weights.dtype})")
    if routing.dtype != torch.uint8 or routing.dim() != 1 or routing.numel() != nbytes:
        raise MkError(1, f"mkernel.{what}: routing must be the uint8 tensor of {nbytes} bytes moe_dispatch returned "
                         f"for this configuration (got {tuple(routing.shape)} {routing.dtype})")
    if not (y.device == topk_weights.device == routing.device):
        raise MkError(1, f"mkernel.{what}: y, topk_weights and routing must be on one device (got {y.device}, "
                         f"{topk_weights.device}, {routing.device})")


@torch.library.custom_op("mkernel::moe_combine", mutates_args=(), device_types="cuda")
def _moe_combine(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, routing: torch.Tensor,
                 num_experts: int, max_tokens: int, expert_align: int, recv_capacity: int, group_name: str,
                 world_size: int) -> torch.Tensor:
    c = _op_comm("moe_combine", group_name, world_size, y)
    _check_moe("moe_combine", y, "y", topk_ids, num_experts, max_tokens, world_size)
    T, k, H = topk_ids.shape[0], topk_ids.shape[1], y.shape[1]
    h, rows, nbytes = c.moe(H, num_experts, k, max_tokens, expert_align, recv_capacity)
    _check_combine("moe_combine", y, topk_ids, topk_weights, routing, rows, nbytes)
    y, w = y.contiguous(), topk_weights.contiguous()
    out = torch.empty((T, H), dtype=torch.bfloat16, device=y.device)
    check(_capi.lib().mk_moe_combine_routed(h, y.data_ptr(), w.data_ptr(), routing.data_ptr(), nbytes,
                                            out.data_ptr(), _stream()))
    return out


@_moe_combine.register_fake
def _(y, topk_ids, topk_weights, routing, num_experts, max_tokens, expert_align, recv_capacity, group_name,
      world_size):
    _check_moe("moe_combine", y, "y", topk_ids, num_experts, max_tokens, world_size)
    rows, nbytes = _moe_sizes("moe_combine", group_name, world_size, y.shape[1], num_experts, topk_ids.shape[1],
                              max_tokens, expert_align, recv_capacity)
    _check_combine("moe_combine", y, topk_ids, topk_weights, routing, rows, nbytes)
    return y.new_empty((topk_ids.shape[0], y.shape[1]))


def _check_moe_layer(x, topk_ids, topk_weights, w1, w2, num_experts, world_size):
    El = num_experts // world_size if num_experts % world_size == 0 else 0
    H = x.shape[1] if x.dim() == 2 else 0
    if w1.dim() != 3 or w2.dim() != 3 or w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise MkError(1, f"mkernel.moe_layer: w1 and w2 must be 3-D bfloat16 (got {tuple(w1.shape)} {w1.dtype}, "
                         f"{tuple(w2.shape)} {w2.dtype})")
    inter = w1.shape[1] // 2
    if tuple(w1.shape) != (El, 2 * inter, H) or tuple(w2.shape) != (El, H, inter):
        raise MkError(1, f"mkernel.moe_layer: w1 must be [E_local, 2I, H] = [{El}, 2I, {H}] and w2 [E_local, H, I] "
                         f"(got {tuple(w1.shape)} and {tuple(w2.shape)})")
    if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise MkError(1, f"mkernel.moe_layer: topk_weights must be float32 shaped as topk_ids "
                         f"{tuple(topk_ids.shape)} (got {tuple(topk_weights.shape)} {topk_weights.dtype})")
    return inter


@torch.library.custom_op("mkernel::moe_layer", mutates_args=(), device_types="cuda")
def _moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
               w2: torch.Tensor, num_experts: int, max_tokens: int, expert_align: int, recv_capacity: int,
               group_name: str, world_size: int) -> torch.Tensor:
    c = _op_comm("moe_layer", group_name, world_size, x)
    _check_moe("moe_layer", x, "x", topk_ids, num_experts, max_tokens, world_size)
    inter = _check_moe_layer(x, topk_ids, topk_weights, w1, w2, num_experts, world_size)
    T, H = x.shape
    h = c.moe_layer(H, num_experts, topk_ids.shape[1], max_tokens, expert_align, recv_capacity, inter)
    x, ids, w = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
    check(_capi.lib().mk_moe_layer_run(h, x.data_ptr(), ids.data_ptr(), w.data_ptr(), None, T, w1.data_ptr(),
                                       w2.data_ptr(), out.data_ptr(), _stream()))
    return out


@_moe_layer.register_fake
def _(x, topk_ids, topk_weights, w1, w2, num_experts, max_tokens, expert_align, recv_capacity, group_name,
      world_size):
    _check_moe("moe_layer", x, "x", topk_ids, num_experts, max_tokens, world_size)
    _check_moe_layer(x, topk_ids, topk_weights, w1, w2, num_experts, world_size)
    return x.new_empty(tuple(x.shape))


def _moe_layer_backward(ctx, grad):
    raise MkError(7, "mkernel.moe_layer has no backward (inference); for training compose moe_dispatch, the "
                     "experts in torch and moe_combine, which are differentiable")


_moe_layer.register_autograd(_moe_layer_backward)


# ---- autograd -------------------------------------------------------------------------------
# all_gather_matmul and matmul_reduce_scatter are each other's backward; matmul_all_reduce's
# gradients are local (its output gradient is the same on every rank). The gathered A that
# all_gather_matmul returns is not differentiable.

def _ag_setup(ctx, inputs, output):
    a, b, group_name, world_size, return_a, shard_rows = inputs
    ctx.group_name, ctx.world_size, ctx.shard_rows = group_name, world_size, shard_rows
    ctx.save_for_backward(b, output[0] if return_a else None)
    ctx.mark_non_differentiable(output[0])


def _ag_backward(ctx, _grad_gathered, grad_out):
    b, gathered = ctx.saved_tensors
    grad_out = grad_out.to(torch.bfloat16)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.mkernel.matmul_reduce_scatter(grad_out, b.t(), ctx.group_name, ctx.world_size,
                                                         ctx.shard_rows)
    if ctx.needs_input_grad[1]:
        if gathered is None or gathered.numel() == 0:
            raise MkError(1, "mkernel.all_gather_matmul: b needs a gradient but the gathered A was not kept "
                             "(call with return_a=True, or through mkernel.torch.all_gather_matmul)")
        grad_b = gathered.t() @ grad_out
    return grad_a, grad_b, None, None, None, None


_all_gather_matmul.register_autograd(_ag_backward, setup_context=_ag_setup)


def _rs_setup(ctx, inputs, output):
    a, b, group_name, world_size, shard_rows = inputs
    ctx.group_name, ctx.world_size, ctx.shard_rows = group_name, world_size, shard_rows
    ctx.save_for_backward(a, b)


def _rs_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    need_b = ctx.needs_input_grad[1]
    full, grad_a = torch.ops.mkernel.all_gather_matmul(grad_out.to(torch.bfloat16).contiguous(), b.t(),
                                                       ctx.group_name, ctx.world_size, need_b, ctx.shard_rows)
    grad_b = a.t() @ full if need_b else None
    return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None, None


_matmul_reduce_scatter.register_autograd(_rs_backward, setup_context=_rs_setup)


def _ar_setup(ctx, inputs, output):
    a, b, _, _ = inputs
    ctx.save_for_backward(a, b)


def _ar_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    grad_out = grad_out.to(torch.bfloat16)
    grad_a = grad_out @ b.t() if ctx.needs_input_grad[0] else None
    grad_b = a.t() @ grad_out if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


_matmul_all_reduce.register_autograd(_ar_backward, setup_context=_ar_setup)


# ring_attention's backward, one op (mkernel::ring_attention_backward): the library's fused ring
# backward (RingAttentionBackward: one persistent kernel per call; K/V travel the ring again and
# each block's dK/dV sums travel with them back to its owner). The rank is read when the op runs
# (in the library), not when a graph is traced: a compiled backward graph is the same on every
# rank (torch.compile's caches may share it between them). LSE is not differentiable.

@torch.library.custom_op("mkernel::ring_attention_backward", mutates_args=(), device_types="cuda")
def _ring_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                             dout: torch.Tensor, causal: bool, layout: str, scale: float, group_name: str,
                             world_size: int, cu_seqlens: Optional[torch.Tensor] = None,
                             shard_rows: Optional[List[int]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c_ = _op_comm("ring_attention_backward", group_name, world_size, q)
    _check_attn(q, k, v)
    if layout not in _LAYOUTS:
        raise MkError(1, f"mkernel.ring_attention_backward: layout '{layout}' is not 'contiguous' or 'zigzag'")
    B, s, H, D = q.shape
    Hkv = k.shape[2]
    if o.shape != q.shape or dout.shape != q.shape or lse.shape != (B, H, s):
        raise MkError(1, f"mkernel.ring_attention_backward: o {tuple(o.shape)}, dout {tuple(dout.shape)} must be "
                         f"{tuple(q.shape)} and lse {tuple(lse.shape)} must be {(B, H, s)}")
    q, k, v, o = q.contiguous(), k.contiguous(), v.contiguous(), o.to(torch.bfloat16).contiguous()
    dout = dout.to(torch.bfloat16).contiguous()
    lse = lse.to(torch.float32).contiguous()
    n_docs = _check_ring_docs("ring_attention_backward", q, cu_seqlens)
    S = _ring_seq("ring_attention_backward", c_, s, shard_rows)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    h = c_.ring_backward(B, H, Hkv, D, S, _LAYOUTS[layout], causal, scale, shard_rows)
    if n_docs:
        check(_capi.lib().mk_ring_backward_run_packed(h, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                                      dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                                      dv.data_ptr(), cu_seqlens.contiguous().data_ptr(), n_docs,
                                                      _stream()))
    else:
        check(_capi.lib().mk_ring_backward_run(h, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                               dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                               dv.data_ptr(), _stream()))
    return dq, dk, dv


@_ring_attention_backward.register_fake
def _(q, k, v, o, lse, dout, causal, layout, scale, group_name, world_size, cu_seqlens=None, shard_rows=None):
    _check_attn(q, k, v)
    _check_ring_docs("ring_attention_backward", q, cu_seqlens)
    _check_rows("ring_attention_backward", shard_rows, world_size)
    if layout not in _LAYOUTS:
        raise MkError(1, f"mkernel.ring_attention_backward: layout '{layout}' is not 'contiguous' or 'zigzag'")
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _ring_setup(ctx, inputs, output):
    q, k, v, causal, layout, scale, group_name, cu_seqlens, shard_rows = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.causal, ctx.layout, ctx.scale, ctx.group_name, ctx.shard_rows = causal, layout, scale, group_name, shard_rows
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, grad_o, _grad_lse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.mkernel.ring_attention_backward(q, k, v, o, lse, grad_o, ctx.causal, ctx.layout, ctx.scale,
                                                           ctx.group_name, _world(ctx.group_name), cu_seqlens,
                                                           ctx.shard_rows)
    return dq, dk, dv, None, None, None, None, None, None


_ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)


# The collectives' adjoints: all_gather and reduce_scatter are each other's; all_reduce's is
# all_reduce (every rank's output is the sum of every rank's input).

def _coll_setup(ctx, inputs, output):
    _, group_name, world_size = inputs
    ctx.group_name, ctx.world_size = group_name, world_size


def _all_gather_backward(ctx, grad):
    return torch.ops.mkernel.reduce_scatter(grad.contiguous(), ctx.group_name, ctx.world_size), None, None


def _reduce_scatter_backward(ctx, grad):
    return torch.ops.mkernel.all_gather(grad.contiguous(), ctx.group_name, ctx.world_size), None, None


def _all_reduce_backward(ctx, grad):
    return torch.ops.mkernel.all_reduce(grad.contiguous(), ctx.group_name, ctx.world_size), None, None


_all_gather.register_autograd(_all_gather_backward, setup_context=_coll_setup)
_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_coll_setup)
_all_reduce.register_autograd(_all_reduce_backward, setup_context=_coll_setup)


# MoE: dispatch copies each token's row to its top-k slots (a gather), so its adjoint is the sum of
# the slots' gradients — a combine with unit weights along the same routing. combine's out[t] =
# sum_k w[t, k] y[row(t, k)]: y's gradient at row(t, k) is w[t, k] grad_out[t], and w's is
# <grad_out[t], y[row(t, k)]>. Both need one row per (token, slot) moving on its own, which is a
# dispatch and a combine of the same routing with top-1: token t's slot k as token t * k + kk with
# the one expert ids[t, k]. Its receive layout is the top-k one row for row (experts' rows by source
# rank, then token, then slot), so the top-1 dispatch of w[t, k] grad_out[t] is y's gradient, and a
# top-1 combine of y with unit weights hands each token its k rows back.

def _moe_dispatch_setup(ctx, inputs, output):
    x, topk_ids, num_experts, max_tokens, expert_align, recv_capacity, group_name, world_size = inputs
    ctx.cfg = (num_experts, max_tokens, expert_align, recv_capacity, group_name, world_size)
    ctx.save_for_backward(topk_ids, output[3])
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _moe_dispatch_backward(ctx, grad_recv, _gc, _go, _gr):
    topk_ids, routing = ctx.saved_tensors
    ones = torch.ones(topk_ids.shape, dtype=torch.float32, device=topk_ids.device)
    grad_x = torch.ops.mkernel.moe_combine(grad_recv.to(torch.bfloat16).contiguous(), topk_ids, ones, routing,
                                           *ctx.cfg)
    return grad_x, None, None, None, None, None, None, None


_moe_dispatch.register_autograd(_moe_dispatch_backward, setup_context=_moe_dispatch_setup)


def _moe_combine_setup(ctx, inputs, output):
    y, topk_ids, topk_weights, routing, num_experts, max_tokens, expert_align, recv_capacity, group_name, \
        world_size = inputs
    ctx.cfg = (num_experts, max_tokens, expert_align, recv_capacity, group_name, world_size)
    ctx.save_for_backward(y, topk_ids, topk_weights)


def _moe_combine_backward(ctx, grad_out):
    y, topk_ids, topk_weights = ctx.saved_tensors
    E, max_tokens, align, capacity, group_name, world_size = ctx.cfg
    T, k = topk_ids.shape
    g = grad_out.float()
    ids1 = topk_ids.reshape(T * k, 1).contiguous()
    # One slot at a time: fp32 [T, k, H] intermediates would be k times grad_out's size in fp32.
    rows = torch.empty((T, k, g.shape[1]), dtype=torch.bfloat16, device=g.device)
    for kk in range(k):
        rows[:, kk] = g * topk_weights[:, kk:kk + 1]
    rows = rows.reshape(T * k, -1)
    grad_y, _, _, routing1 = torch.ops.mkernel.moe_dispatch(rows, ids1, E, max_tokens * k, align, capacity,
                                                            group_name, world_size)
    grad_w = None
    if ctx.needs_input_grad[2]:
        ones = torch.ones((T * k, 1), dtype=torch.float32, device=y.device)
        per_slot = torch.ops.mkernel.moe_combine(y.contiguous(), ids1, ones, routing1, E, max_tokens * k, align,
                                                 capacity, group_name, world_size)
        per_slot = per_slot.reshape(T, k, -1)
        grad_w = torch.stack([(per_slot[:, kk].float() * g).sum(-1) for kk in range(k)], dim=1)
    return (grad_y if ctx.needs_input_grad[0] else None), None, grad_w, None, None, None, None, None, None, None


_moe_combine.register_autograd(_moe_combine_backward, setup_context=_moe_combine_setup)


# ---- the public functions: any rank of input, torch's symm_mem argument order ---------------

def _group(group):
    if group is None:
        if _default_name is None:
            raise MkError(1, "mkernel: call mkernel.torch.init() before using its ops")
        return _default_name
    return group if isinstance(group, str) else group.group_name


def all_gather_matmul(a_shard, b, gather_dim=0, group=None, return_a=False, shard_sizes=None):
    """(A, C) with A = all_gather(a_shard, gather_dim) and C = A @ b, fused.

    a_shard [..., K] bf16 (this rank's shard along gather_dim), b [K, N] bf16 — an nn.Linear
    weight passed as weight.t() is used in place, any other b is copied once. A is returned when
    return_a (else None); it is also kept for the backward when b needs a gradient. Uneven shards:
    shard_sizes, every rank's size along gather_dim (the same list on every rank; None: equal).
    """
    name = _group(group)
    nd = a_shard.dim()
    gd = gather_dim % nd if nd else 0
    if nd < 2 or gd == nd - 1:
        raise MkError(1, f"mkernel.all_gather_matmul: gather_dim {gather_dim} of a {nd}-D input must not be "
                         "the last (K) dimension")
    x = a_shard.movedim(gd, 0) if gd else a_shard
    lead = x.shape[:-1]
    need_a = return_a or (torch.is_grad_enabled() and b.requires_grad)
    W = _world(name)
    rows, total = _shard_rows("all_gather_matmul", shard_sizes, W, lead, name)
    gathered, c = torch.ops.mkernel.all_gather_matmul(x.reshape(-1, x.shape[-1]), b, name, W, need_a, rows)
    total = W * lead[0] if total is None else total
    c = c.view(total, *lead[1:], c.shape[-1])
    c = c.movedim(0, gd) if gd else c
    if not return_a:
        return None, c
    gathered = gathered.view(total, *lead[1:], x.shape[-1])
    return (gathered.movedim(0, gd) if gd else gathered), c


def _shard_rows(what, shard_sizes, W, lead, name, total=None):
    """Uneven shards: the ops' shard rows (each rank's size along the shard dimension times the
    other leading dimensions) and the shard dimension's full size; (None, None) when even."""
    if shard_sizes is None:
        return None, None
    sizes = [int(s) for s in shard_sizes]
    if len(sizes) != W or any(s < 1 for s in sizes):
        raise MkError(1, f"mkernel.{what}: shard_sizes {sizes}: one size >= 1 per rank ({W} ranks)")
    if total is None and sizes[_rank(name)] != lead[0]:
        raise MkError(1, f"mkernel.{what}: this rank's shard has {lead[0]} along the gathered dimension, "
                         f"shard_sizes say {sizes[_rank(name)]}")
    if total is not None and sum(sizes) != total:
        raise MkError(1, f"mkernel.{what}: shard_sizes {sizes} sum to {sum(sizes)}, not {total}")
    inner = 1
    for d in lead[1:]:
        inner *= d
    return [s * inner for s in sizes], sum(sizes)


def matmul_reduce_scatter(a, b, scatter_dim=0, reduce_op="sum", group=None, shard_sizes=None):
    """reduce_scatter(a @ b, scatter_dim), fused: a [..., K_loc] bf16, b [K_loc, N] bf16 (weight.t()
    of an nn.Linear weight is used in place). Returns this rank's part, [..., N]. reduce_op: "sum".
    Uneven shards: shard_sizes, every rank's size along scatter_dim (the same list on every rank,
    summing to a's size there; None: equal)."""
    if reduce_op != "sum":
        raise MkError(7, f"mkernel.matmul_reduce_scatter: reduce_op '{reduce_op}' is not supported (only 'sum')")
    name = _group(group)
    nd = a.dim()
    sd = scatter_dim % nd if nd else 0
    if nd < 2 or sd == nd - 1:
        raise MkError(1, f"mkernel.matmul_reduce_scatter: scatter_dim {scatter_dim} of a {nd}-D input must not be "
                         "the last (K) dimension")
    W = _world(name)
    x = a.movedim(sd, 0) if sd else a
    rows, _ = _shard_rows("matmul_reduce_scatter", shard_sizes, W, x.shape[:-1], name, total=x.shape[0])
    if rows is None and x.shape[0] % W:
        raise MkError(1, f"mkernel.matmul_reduce_scatter: dimension {sd} of size {x.shape[0]} does not split over "
                         f"{W} ranks (give shard_sizes)")
    out = torch.ops.mkernel.matmul_reduce_scatter(x.reshape(-1, x.shape[-1]), b, name, W, rows)
    mine = x.shape[0] // W if rows is None else int(shard_sizes[_rank(name)])
    out = out.view(mine, *x.shape[1:-1], out.shape[-1])
    return out.movedim(0, sd) if sd else out


def matmul_all_reduce(a, b, group=None):
    """all_reduce(a @ b), fused: a [..., K_loc] bf16, b [K_loc, N] bf16. Returns [..., N]."""
    name = _group(group)
    out = torch.ops.mkernel.matmul_all_reduce(a.reshape(-1, a.shape[-1]), b, name, _world(name))
    return out.view(*a.shape[:-1], out.shape[-1])


def attention(q, k, v, causal=False, scale=None):
    """(O, LSE) of attention on this GPU: q [B, S, H, D], k and v [B, Skv, Hkv, D] bf16 (head
    dimension 64 or 128, contiguous; GQA when Hkv divides H); causal is top-left aligned, as
    torch's is_causal. Differentiable in q, k and v (not through LSE), by mkernel's backward kernel."""
    return torch.ops.mkernel.attention(q, k, v, bool(causal), 0.0 if scale is None else float(scale))


def attention_varlen(q, k, v, cu_seqlens, causal=False, scale=None):
    """(O, LSE) of attention over packed documents on this GPU: q [S, H, D], k and v [S, Hkv, D] bf16
    hold documents back to back, document d being rows cu_seqlens[d] .. cu_seqlens[d + 1] - 1
    (cu_seqlens: int32 on the GPU, n_docs + 1 entries from 0 to S, read by the kernel: no host
    synchronization); each document attends only within itself, causal from its own first row.
    LSE is [H, S] fp32. Differentiable in q, k and v."""
    return torch.ops.mkernel.attention_varlen(q, k, v, cu_seqlens, bool(causal), 0.0 if scale is None else float(scale))


def ring_attention(q, k, v, causal=False, layout="contiguous", scale=None, group=None, cu_seqlens=None,
                   shard_rows=None):
    """(O, LSE) of attention over the whole sequence, sharded over the group's ranks.

    q [B, S/W, H, D], k and v [B, S/W, Hkv, D] bf16: this rank's tokens — chunk r of W
    ("contiguous") or chunks r and 2W-1-r ("zigzag", balanced for causal). O is like q, LSE
    [B, H, S/W] fp32 (natural log). Differentiable in q, k and v (mkernel::ring_attention_backward).

    cu_seqlens (packed documents, B = 1): int32 on the GPU, n_docs + 1 entries from 0 to S in the
    whole sequence's positions, the same on every rank; each document attends only within itself
    (causal within itself when causal). The sequence is sharded as without documents.

    shard_rows (uneven shards): a list of every rank's token count (the same list on every rank,
    this rank's entry q's S/W, summing to S): contiguous, rank r holds tokens from the sum of the
    counts before it; zigzag, the 2W chunks hold ceil(rows[0] / 2), ..., ceil(rows[W-1] / 2), then
    floor(rows[W-1] / 2), ..., floor(rows[0] / 2) tokens and rank r its chunks r and 2W-1-r.
    """
    return torch.ops.mkernel.ring_attention(q, k, v, bool(causal), layout, 0.0 if scale is None else float(scale),
                                            _group(group), cu_seqlens,
                                            None if shard_rows is None else [int(r) for r in shard_rows])


def ring_balanced_rows(cu_seqlens, causal=False, group=None, world=None):
    """Uneven contiguous shards balancing ring_attention's work for packed documents: a list of
    every rank's token count, for ring_attention(..., layout="contiguous", cu_seqlens=...,
    shard_rows=...). cu_seqlens: n_docs + 1 bounds from 0 to S (any device; read on the host). A
    query's work is the keys it sees (its position in its document + 1 when causal, else its
    document's length); the busiest rank's share is the least any contiguous split has. world:
    the group's size when left out. Local: no collective, no GPU."""
    cu = torch.as_tensor(cu_seqlens).to(device="cpu", dtype=torch.int32).contiguous()
    if cu.dim() != 1 or cu.numel() < 2:
        raise MkError(1, f"mkernel.ring_balanced_rows: cu_seqlens must be 1-D with n_docs + 1 >= 2 entries "
                         f"(got {tuple(cu.shape)})")
    W = int(world) if world is not None else _world(_group(group))
    out = (ctypes.c_int64 * W)()
    check(_capi.lib().mk_ring_balanced_rows(ctypes.cast(cu.data_ptr(), ctypes.POINTER(ctypes.c_int32)),
                                            cu.numel() - 1, W, int(bool(causal)), out))
    return [int(x) for x in out]


def _along(x, dim, f):
    nd = x.dim()
    d = dim % nd if nd else 0
    y = f(x.movedim(d, 0) if d else x)
    return y.movedim(0, d) if d else y


def all_gather(x, dim=0, group=None):
    """all_gather(x, dim): the ranks' x concatenated along dim (rank order). bf16 or fp32; the
    elements per rank a multiple of 8."""
    name = _group(group)
    return _along(x, dim, lambda t: torch.ops.mkernel.all_gather(t.contiguous(), name, _world(name)))


def reduce_scatter(x, dim=0, reduce_op="sum", group=None):
    """reduce_scatter(x, dim): this rank's part (block `rank` of W along dim) of the sum over the
    ranks. fp32 sums in a fixed order (the same bits on every rank; docs/collectives.md)."""
    if reduce_op != "sum":
        raise MkError(7, f"mkernel.reduce_scatter: reduce_op '{reduce_op}' is not supported (only 'sum')")
    name = _group(group)
    return _along(x, dim, lambda t: torch.ops.mkernel.reduce_scatter(t.contiguous(), name, _world(name)))


def all_reduce(x, reduce_op="sum", group=None):
    """all_reduce(x): the sum over the ranks, a new tensor (x is not changed). fp32 sums in a fixed
    order: the same bits on every rank."""
    if reduce_op != "sum":
        raise MkError(7, f"mkernel.all_reduce: reduce_op '{reduce_op}' is not supported (only 'sum')")
    name = _group(group)
    return torch.ops.mkernel.all_reduce(x, name, _world(name))


class MoeRouting(NamedTuple):
    """What moe_dispatch leaves for its moe_combine (and for the backward pass): the routing
    (device bytes), the token's experts and the operator's configuration."""
    routing: torch.Tensor
    topk_ids: torch.Tensor
    num_experts: int
    max_tokens: int
    expert_align: int
    recv_capacity: int
    group_name: str
    world_size: int


def moe_dispatch(x, topk_ids, num_experts, *, max_tokens=None, expert_align=1, recv_capacity=0, group=None):
    """Expert parallelism: sends each token's row to the ranks of its top-k experts (expert e on rank
    e // (num_experts / W)). Returns (recv_x, counts, offsets, routing).

    x [T, H] bf16; topk_ids [T, k] (int32 or int64; -1: no expert). recv_x [R, H] bf16 expert-major:
    local expert j's rows at [offsets[j], offsets[j] + counts[j]), each block starting on a multiple
    of expert_align rows, rows by source rank, then token, then slot; the other rows are zeros.
    R = recv_capacity, or the worst case (W * max_tokens * k plus alignment) when 0 — set it to
    bound memory; an overflow is recorded on the device (communicator(group).check_moe() raises
    it). counts and offsets stay on the GPU: no host synchronization, capturable in a CUDA graph
    after a first call. max_tokens (default T) sizes the operator: calls with fewer tokens reuse it.
    routing goes to moe_combine. Differentiable in x (the adjoint is a combine of recv_x's
    gradient with unit weights)."""
    name = _group(group)
    W = _world(name)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    mt = int(x.shape[0] if max_tokens is None else max_tokens)
    recv_x, counts, offsets, routing = torch.ops.mkernel.moe_dispatch(x, ids, int(num_experts), mt, int(expert_align),
                                                                      int(recv_capacity), name, W)
    return recv_x, counts, offsets, MoeRouting(routing, ids, int(num_experts), mt, int(expert_align),
                                               int(recv_capacity), name, W)


def moe_combine(y, topk_weights, routing):
    """The experts' outputs back to their tokens: out[t] = sum_k topk_weights[t, k] * y(t, k), fp32
    multiply-adds in slot order, bf16 out [T, H]. y [R, H] bf16 in the layout of the dispatch that
    returned `routing`; topk_weights [T, k] float32. Differentiable in y and topk_weights."""
    r = routing
    return torch.ops.mkernel.moe_combine(y, r.topk_ids, topk_weights, r.routing, r.num_experts, r.max_tokens,
                                         r.expert_align, r.recv_capacity, r.group_name, r.world_size)


def moe_layer(x, topk_ids, topk_weights, w1, w2, num_experts, *, max_tokens=None, expert_align=1, recv_capacity=0,
              group=None):
    """A whole MoE layer with expert parallelism (inference): out[t] = sum_k topk_weights[t, k] *
    FFN_{e(t, k)}(x[t]), FFN_e(v) = W2_e (silu(W1_e[:I] v) * (W1_e[I:] v)), in fp32 sums of bf16
    products. x [T, H] bf16; topk_ids [T, k] (-1: no expert); topk_weights [T, k] float32; w1
    [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I] bf16: this rank's experts
    (expert e on rank e // E_local). dispatch, the two grouped GEMMs (SwiGLU in the first one's
    epilogue) and combine in stream order, no host synchronization (docs/moe.md, "The MoE layer").
    max_tokens, expert_align and recv_capacity as moe_dispatch's. Not differentiable: for training
    compose moe_dispatch, the experts and moe_combine."""
    name = _group(group)
    W = _world(name)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    mt = int(x.shape[0] if max_tokens is None else max_tokens)
    return torch.ops.mkernel.moe_layer(x, ids, topk_weights, w1, w2, int(num_experts), mt, int(expert_align),
                                       int(recv_capacity), name, W)
