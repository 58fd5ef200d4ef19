"""mkernel from Python: ctypes over the C ABI (libmkernel_capi.so).

    mkernel.attention_forward / attention_merge   the attention kernel on torch tensors
    mkernel.torch                                  the fused operators as torch ops (import mkernel.torch)

The library is looked for in MK_CAPI, then in this package's folder (pip install .), then in
build/ of the source tree.
"""
from ._capi import MkError, library_path  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):  # the attention functions need torch: imported on first use
    if name in ("attention_forward", "attention_merge"):
        from . import attention
        return getattr(attention, name)
    raise AttributeError(f"module 'mkernel' has no attribute {name!r}")
