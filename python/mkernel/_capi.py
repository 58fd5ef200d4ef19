"""Loads mkernel's C ABI (libmkernel_capi.so) through ctypes and declares its functions.

Where the library is looked for, in order: the MK_CAPI environment variable; the package's own
folder (what `pip install .` installs); build/libmkernel_capi.so under the source tree.
"""
import ctypes
import os

_lib = None

c_int, c_int64, c_float, c_void_p, c_char_p, c_size_t = (ctypes.c_int, ctypes.c_int64, ctypes.c_float,
                                                         ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)

# Store callbacks (mk_comm_create_store): set, get, erase, why.
STORE_SET = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_void_p, c_size_t)
STORE_GET = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_void_p, c_size_t, ctypes.POINTER(c_size_t),
                             ctypes.POINTER(c_int))
STORE_ERASE = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p)
STORE_WHY = ctypes.CFUNCTYPE(c_char_p, c_void_p)

# mk::Code, by value (include/mkernel/common/status.h).
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


def _declare(lib):
    P = ctypes.POINTER
    sig = {
        "mk_attention_forward": [c_void_p] * 5 + [P(c_int64)] + [c_int] * 6 + [c_float, c_int, c_int64, c_int64,
                                                                                  c_void_p],
        "mk_attention_merge_init": [c_void_p, c_void_p] + [c_int] * 4 + [c_void_p],
        "mk_attention_merge": [c_void_p] * 3 + [P(c_int64), c_void_p] + [c_int] * 4 + [c_void_p],
        "mk_attention_merge_finish": [c_void_p, c_void_p, P(c_int64)] + [c_int] * 4 + [c_void_p],
        "mk_comm_create_store": [c_int, c_int, c_char_p, c_void_p, STORE_SET, STORE_GET, STORE_ERASE, STORE_WHY,
                                 c_int, c_int, c_int, P(c_void_p)],
        "mk_comm_info": [c_void_p, P(c_int)],
        "mk_comm_check": [c_void_p],
        "mk_comm_destroy": [c_void_p],
        "mk_tunable_set": [c_char_p, c_char_p],
        "mk_fused_create": [c_void_p, c_int, c_int64, c_int64, c_int64, c_int, c_int, c_char_p, P(c_void_p)],
        "mk_fused_run": [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p],
        "mk_fused_gathered_a": [c_void_p, P(c_void_p)],
        "mk_fused_copy_gathered_a": [c_void_p, c_void_p, c_void_p],
        "mk_fused_comm_ctas": [c_void_p, P(c_int)],
        "mk_fused_destroy": [c_void_p],
        "mk_ring_create": [c_void_p] + [c_int] * 4 + [c_int64, c_int, c_int, c_float, c_int, c_char_p, P(c_void_p)],
        "mk_ring_run": [c_void_p] * 7,
        "mk_ring_destroy": [c_void_p],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_int
    lib.mk_last_error.restype = c_char_p
    lib.mk_last_error.argtypes = []


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
        _declare(handle)
        _lib = handle
    return _lib


def check(rc):
    """Raises MkError carrying the library's message when rc is not 0."""
    if rc != 0:
        raise MkError(rc, lib().mk_last_error().decode(errors="replace"))
