"""The sm_90a attention forward, its backward and the merge of partial results, on torch tensors.

Tensors are logically (B, S, H, D) with the head dimension contiguous; any batch, sequence and
head strides (multiples of 8 elements) work, e.g. q.transpose(1, 2) of a (B, H, S, D) tensor.
"""
import ctypes

import torch

from ._capi import MkError, check as _check, lib  # noqa: F401


def _strides(t):
    return [t.stride(0), t.stride(1), t.stride(2)]


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def attention_forward(q, k, v, causal=False, scale=0.0, out=None, lse=None, q_pos0=0, kv_pos0=0):
    """O, LSE = attention(q, k, v); q (B, Sq, H, D), k/v (B, Skv, Hkv, D), bf16. LSE is (B, H, Sq) fp32."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    st = (ctypes.c_int64 * 12)(*(_strides(q) + _strides(k) + _strides(v) + _strides(out)))
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out")):
        if t.dtype != torch.bfloat16 or t.stride(3) != 1:
            raise MkError(1, f"attention: {name} must be bf16 with a contiguous head dimension")
    _check(lib().mk_attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), st,
                                      B, H, Hkv, Sq, Skv, D, float(scale), int(causal), int(q_pos0), int(kv_pos0),
                                      _stream()))
    return out, lse


def attention_merge(parts, out=None):
    """Merges [(O_i, LSE_i)] computed over disjoint key sets: returns (O bf16, LSE) of the union."""
    o0, _ = parts[0]
    B, S, H, D = o0.shape
    acc = torch.empty((B, S, H, D), dtype=torch.float32, device=o0.device)
    lse_acc = torch.empty((B, H, S), dtype=torch.float32, device=o0.device)
    _check(lib().mk_attention_merge_init(acc.data_ptr(), lse_acc.data_ptr(), B, H, S, D, _stream()))
    for o, lse in parts:
        st = (ctypes.c_int64 * 3)(*_strides(o))
        _check(lib().mk_attention_merge(acc.data_ptr(), lse_acc.data_ptr(), o.data_ptr(), st,
                                        lse.contiguous().data_ptr(), B, H, S, D, _stream()))
    if out is None:
        out = torch.empty_like(o0)
    st = (ctypes.c_int64 * 3)(*_strides(out))
    _check(lib().mk_attention_merge_finish(acc.data_ptr(), out.data_ptr(), st, B, H, S, D, _stream()))
    return out, lse_acc


def attention_backward(q, k, v, out, lse, dout, causal=False, scale=0.0, q_pos0=0, kv_pos0=0, deterministic=False,
                       dq=None, dk=None, dv=None):
    """dQ, dK, dV of attention_forward(q, k, v) given its output `out`, its `lse` (B, H, Sq) and the
    output's gradient `dout` (same shape as q). bf16; the same layouts and causal positions as the
    forward. deterministic: dQ's fp32 reductions in a fixed order (bitwise reproducible)."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    ts = (q, k, v, out, dout, dq, dk, dv)
    for t, name in zip(ts, ("q", "k", "v", "out", "dout", "dq", "dk", "dv")):
        if t.dtype != torch.bfloat16 or t.stride(3) != 1:
            raise MkError(1, f"attention_backward: {name} must be bf16 with a contiguous head dimension")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (B, H, Sq):
        raise MkError(1, f"attention_backward: lse must be fp32 of shape {(B, H, Sq)}, not {lse.dtype} {tuple(lse.shape)}")
    lse = lse.contiguous()
    nbytes = ctypes.c_size_t(0)
    _check(lib().mk_attention_backward_workspace(B, H, Sq, D, ctypes.byref(nbytes)))
    ws = torch.empty(nbytes.value + 256, dtype=torch.uint8, device=q.device)
    ws_ptr = (ws.data_ptr() + 255) // 256 * 256
    st = (ctypes.c_int64 * 24)(*sum((_strides(t) for t in ts), []))
    _check(lib().mk_attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
                                       lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), st, B, H, Hkv,
                                       Sq, Skv, D, float(scale), int(causal), int(q_pos0), int(kv_pos0),
                                       int(deterministic), ws_ptr, nbytes.value, _stream()))
    return dq, dk, dv
