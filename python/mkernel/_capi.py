"""Loads mkernel's C ABI (libmkernel_capi.so) through ctypes and declares its functions.

Where the library is looked for, in order: the MK_CAPI environment variable; the package's own
folder (what `pip install .` installs); build/libmkernel_capi.so under the source tree.
"""
import ctypes
import os

_lib = None

c_int, c_int64, c_float, c_void_p, c_char_p, c_size_t = (ctypes.c_int, ctypes.c_int64, ctypes.c_float,
                                                         ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)

# Store callbacks (mk_comm_create_store): set, get, erase, why (c_api.h: mk_store_*_fn).
STORE_SET = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_void_p, c_size_t)
STORE_GET = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_void_p, c_size_t, ctypes.POINTER(c_size_t),
                             ctypes.POINTER(c_int))
STORE_ERASE = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p)
# why fills the library's buffer: a callback returning c_char_p would leak a Python object per call.
STORE_WHY = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t)

# The C ABI this module speaks (c_api.h: MK_C_API_VERSION); the library must say the same.
API_VERSION = 10


class CommInfo(ctypes.Structure):
    """c_api.h: mk_comm_info_t."""
    _fields_ = [("rank", c_int), ("world", c_int), ("node", c_int), ("nodes", c_int), ("local_rank", c_int),
                ("local_size", c_int), ("device", c_int)]


# mk_code_t by value (c_api.h; include/mkernel/common/status.h).
CODES = {0: "ok", 1: "invalid argument", 2: "mismatch", 3: "timeout", 4: "CUDA error", 5: "system error",
         6: "out of memory", 7: "not supported", 8: "remote error", 9: "permission denied", 10: "internal"}


class MkError(RuntimeError):
    """A failure reported by the library: `code` is its mk::Code, the message its context."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.code_name = CODES.get(code, str(code))


def library_path():
    env = os.environ.get("MK_CAPI")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "libmkernel_capi.so")
    if os.path.exists(installed):
        return installed
    root = os.path.dirname(os.path.dirname(here))
    return os.path.join(root, "build", "libmkernel_capi.so")


def signatures():
    """Every function of the C ABI: name -> (argtypes, restype), as c_api.h declares them. Handles and
    device memory are addresses (c_void_p); host memory the library reads or writes (out-parameters,
    strides) is typed. tests/python/test_capi_header.py checks this against the header."""
    P = ctypes.POINTER
    sig = {
        "mk_api_version": [],
        "mk_tunable_set": [c_char_p, c_char_p],
        "mk_attention_forward": [c_void_p] * 5 + [P(c_int64)] + [c_int] * 6 + [c_float, c_int, c_int64, c_int64,
                                                                                  c_void_p],
        "mk_attention_backward_workspace": [c_int] * 7 + [P(c_size_t)],
        "mk_attention_backward": [c_void_p] * 9 + [P(c_int64)] + [c_int] * 6 + [c_float, c_int, c_int64, c_int64,
                                                                                   c_int, c_void_p, c_size_t,
                                                                                   c_void_p],
        "mk_attention_varlen_forward": [c_void_p] * 5 + [P(c_int64), c_void_p] + [c_int] * 5 + [c_float, c_int,
                                                                                              c_void_p],
        "mk_attention_varlen_backward_workspace": [c_int] * 6 + [P(c_size_t)],
        "mk_attention_varlen_backward": [c_void_p] * 9 + [P(c_int64), c_void_p] + [c_int] * 5 + [c_float, c_int, c_int,
                                                                                                c_void_p, c_size_t,
                                                                                                c_void_p],
        "mk_attention_merge_init": [c_void_p, c_void_p] + [c_int] * 4 + [c_void_p],
        "mk_attention_merge": [c_void_p] * 3 + [P(c_int64), c_void_p] + [c_int] * 4 + [c_void_p],
        "mk_attention_merge_finish": [c_void_p, c_void_p, P(c_int64)] + [c_int] * 4 + [c_void_p],
        "mk_comm_create_store": [c_int, c_int, c_char_p, c_void_p, STORE_SET, STORE_GET, STORE_ERASE, STORE_WHY,
                                 c_int, c_int, c_int, P(c_void_p)],
        "mk_comm_info": [c_void_p, P(CommInfo)],
        "mk_comm_check": [c_void_p],
        "mk_comm_destroy": [c_void_p],
        "mk_fused_create": [c_void_p, c_int, c_int64, c_int64, c_int64, c_int, c_int, c_char_p, P(c_void_p)],
        "mk_fused_create_rows": [c_void_p, c_int, c_int64, c_int64, c_int64, P(c_int64), c_int, c_int, c_int, c_char_p,
                                 P(c_void_p)],
        "mk_fused_run": [c_void_p] * 5,
        "mk_fused_gathered_a": [c_void_p, P(c_void_p)],
        "mk_fused_copy_gathered_a": [c_void_p] * 3,
        "mk_fused_comm_ctas": [c_void_p, P(c_int)],
        "mk_fused_destroy": [c_void_p],
        "mk_coll_create": [c_void_p, c_int, c_int, c_int64, c_int64, c_int, c_char_p, P(c_void_p)],
        "mk_coll_run": [c_void_p] * 4,
        "mk_coll_in_elems": [c_void_p, P(c_int64)],
        "mk_coll_out_elems": [c_void_p, P(c_int64)],
        "mk_coll_input": [c_void_p, P(c_void_p)],
        "mk_coll_output": [c_void_p, P(c_void_p)],
        "mk_coll_destroy": [c_void_p],
        "mk_ring_create": [c_void_p] + [c_int] * 4 + [c_int64, c_int, c_int, c_float, c_int, c_char_p, P(c_void_p)],
        "mk_ring_run": [c_void_p] * 7,
        "mk_ring_run_packed": [c_void_p] * 7 + [c_int, c_void_p],
        "mk_ring_create_rows": [c_void_p] + [c_int] * 4 + [c_int64, c_int, c_int, c_float, P(c_int64), c_int, c_int,
                                                          c_char_p, P(c_void_p)],
        "mk_ring_destroy": [c_void_p],
        "mk_ring_balanced_rows": [P(ctypes.c_int32), c_int, c_int, c_int, P(c_int64)],
        "mk_ring_backward_create": [c_void_p] + [c_int] * 4 + [c_int64, c_int, c_int, c_float, c_int, c_char_p,
                                                                P(c_void_p)],
        "mk_ring_backward_run": [c_void_p] * 11,
        "mk_ring_backward_run_packed": [c_void_p] * 11 + [c_int, c_void_p],
        "mk_ring_backward_create_rows": [c_void_p] + [c_int] * 4 + [c_int64, c_int, c_int, c_float, P(c_int64), c_int,
                                                                   c_int, c_char_p, P(c_void_p)],
        "mk_ring_backward_destroy": [c_void_p],
        "mk_moe_create": [c_void_p, c_int64, c_int, c_int, c_int64, c_int, c_int64, c_int, c_int, c_char_p,
                          P(c_void_p)],
        "mk_moe_recv_rows": [c_void_p, P(c_int64)],
        "mk_moe_local_experts": [c_void_p, P(c_int)],
        "mk_moe_dispatch": [c_void_p] * 5 + [c_int64] + [c_void_p] * 4,
        "mk_moe_combine": [c_void_p] * 4,
        "mk_moe_sizes": [c_int, c_int, c_int, c_int64, c_int, c_int, c_int64, c_int, c_int64, c_int, P(c_int64),
                         P(c_int64)],
        "mk_moe_routing_bytes": [c_void_p, P(c_int64)],
        "mk_moe_dispatch_routed": [c_void_p] * 5 + [c_int64] + [c_void_p] * 4 + [c_int64, c_void_p],
        "mk_moe_combine_routed": [c_void_p] * 4 + [c_int64, c_void_p, c_void_p],
        "mk_moe_check": [c_void_p],
        "mk_moe_destroy": [c_void_p],
        "mk_moe_layer_create": [c_void_p, c_int64, c_int, c_int, c_int64, c_int, c_int64, c_int64, c_int, c_int,
                                c_char_p, P(c_void_p)],
        "mk_moe_layer_run": [c_void_p] * 5 + [c_int64] + [c_void_p] * 4,
        "mk_moe_layer_check": [c_void_p],
        "mk_moe_layer_destroy": [c_void_p],
    }
    out = {name: (args, c_int) for name, args in sig.items()}
    out["mk_last_error"] = ([], c_char_p)
    return out


def _declare(lib):
    for name, (args, res) in signatures().items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def lib():
    """The loaded library (loaded on first use; MkError when it cannot be found or loaded)."""
    global _lib
    if _lib is None:
        path = library_path()
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            raise MkError(7, f"mkernel: cannot load the C ABI library {path}: {e} "
                             "(pip install . builds it; or build with scripts/setup.sh, or set MK_CAPI)") from None
        try:
            _declare(handle)
        except AttributeError as e:
            raise MkError(7, f"mkernel: the C ABI library {path} is from another version (missing {e}); "
                             "rebuild it or point MK_CAPI at a current one") from None
        have = handle.mk_api_version()
        if have != API_VERSION:
            raise MkError(7, f"mkernel: the C ABI library {path} speaks version {have}, this module {API_VERSION}; "
                             "rebuild it or point MK_CAPI at a current one")
        _lib = handle
    return _lib


def check(rc):
    """Raises MkError carrying the library's message when rc is not 0."""
    if rc != 0:
        raise MkError(rc, lib().mk_last_error().decode(errors="replace"))
