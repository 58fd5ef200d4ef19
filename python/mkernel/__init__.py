"""mkernel from Python (ctypes over build/libmkernel_capi.so; torch tensors in, torch tensors out).

Set MK_CAPI to the library's path when it is not build/libmkernel_capi.so under the project root.
"""
from .attention import attention_forward, attention_merge, MkError  # noqa: F401
