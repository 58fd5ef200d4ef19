"""The sm_90a attention forward, its backward and the merge of partial results, on torch tensors
(and the packed variable-length forms, attention_varlen_*).

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
    _check(lib().mk_attention_backward_workspace(B, H, Hkv, Sq, Skv, D, int(deterministic), ctypes.byref(nbytes)))
    ws = torch.empty(nbytes.value + 256, dtype=torch.uint8, device=q.device)
    ws_ptr = (ws.data_ptr() + 255) // 256 * 256
    st = (ctypes.c_int64 * 24)(*sum((_strides(t) for t in ts), []))
    _check(lib().mk_attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
                                       lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), st, B, H, Hkv,
                                       Sq, Skv, D, float(scale), int(causal), int(q_pos0), int(kv_pos0),
                                       int(deterministic), ws_ptr, nbytes.value, _stream()))
    return dq, dk, dv


def _varlen_check(what, cu_seqlens, q, kv, q_like, kv_like):
    """cu_seqlens (contiguous) after checking it and the shapes: q (S, H, D); kv and kv_like
    (S, Hkv, D); q_like as q."""
    if q.dim() != 3:
        raise MkError(1, f"{what}: q must be (S, heads, D), not {tuple(q.shape)}")
    S, _, D = q.shape
    for name, t in kv:
        if t.dim() != 3 or t.shape[0] != S or t.shape[2] != D or t.shape != kv[0][1].shape:
            raise MkError(1, f"{what}: {name} {tuple(t.shape)} must be (S, Hkv, D) with S {S} and D {D} as q's")
    for name, t in q_like:
        if t.shape != q.shape:
            raise MkError(1, f"{what}: {name} {tuple(t.shape)} must have q's shape {tuple(q.shape)}")
    for name, t in kv_like:
        if t.shape != kv[0][1].shape:
            raise MkError(1, f"{what}: {name} {tuple(t.shape)} must have k's shape {tuple(kv[0][1].shape)}")
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1
            or cu_seqlens.numel() < 2 or cu_seqlens.device != q.device):
        raise MkError(1, f"{what}: cu_seqlens must be a 1-D int32 tensor of n_docs + 1 >= 2 entries on {q.device}")
    return cu_seqlens.contiguous()


def attention_varlen_forward(q, k, v, cu_seqlens, causal=False, scale=0.0, out=None, lse=None):
    """O, LSE of packed variable-length attention: q (S, H, D), k/v (S, Hkv, D) bf16 holding documents
    back to back, document d being rows cu_seqlens[d] .. cu_seqlens[d + 1] - 1 (cu_seqlens int32 on
    the GPU, n_docs + 1 entries from 0 to S); each document attends within itself (causal: its own
    positions from 0). LSE is (H, S) fp32. Rows past cu_seqlens[-1] are not written."""
    if out is None:
        out = torch.empty_like(q)
    cu = _varlen_check("attention_varlen_forward", cu_seqlens, q, (("k", k), ("v", v)), (("out", out),), ())
    S, H, D = q.shape
    Hkv = k.shape[1]
    if lse is None:
        lse = torch.empty((H, S), dtype=torch.float32, device=q.device)
    if lse.dtype != torch.float32 or tuple(lse.shape) != (H, S) or not lse.is_contiguous():
        raise MkError(1, f"attention_varlen_forward: lse must be contiguous fp32 of shape {(H, S)}")
    ts = [t.unsqueeze(0) for t in (q, k, v, out)]
    for t, name in zip(ts, ("q", "k", "v", "out")):
        if t.dtype != torch.bfloat16 or t.dim() != 4 or t.stride(3) != 1:
            raise MkError(1, f"attention_varlen_forward: {name} must be (S, heads, D) bf16 with a contiguous head "
                             "dimension")
    st = (ctypes.c_int64 * 12)(*sum((_strides(t) for t in ts), []))
    _check(lib().mk_attention_varlen_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                             st, cu.data_ptr(), cu.numel() - 1, H, Hkv, S, D, float(scale),
                                             int(causal), _stream()))
    return out, lse


def attention_varlen_backward(q, k, v, out, lse, dout, cu_seqlens, causal=False, scale=0.0, deterministic=False,
                              dq=None, dk=None, dv=None):
    """dQ, dK, dV of attention_varlen_forward(q, k, v, cu_seqlens) given its output, its lse (H, S)
    and the output's gradient dout (S, H, D)."""
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    cu = _varlen_check("attention_varlen_backward", cu_seqlens, q, (("k", k), ("v", v)),
                       (("out", out), ("dout", dout), ("dq", dq)), (("dk", dk), ("dv", dv)))
    S, H, D = q.shape
    Hkv = k.shape[1]
    ts = [t.unsqueeze(0) for t in (q, k, v, out, dout, dq, dk, dv)]
    for t, name in zip(ts, ("q", "k", "v", "out", "dout", "dq", "dk", "dv")):
        if t.dtype != torch.bfloat16 or t.dim() != 4 or t.stride(3) != 1:
            raise MkError(1, f"attention_varlen_backward: {name} must be (S, heads, D) bf16 with a contiguous head "
                             "dimension")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (H, S):
        raise MkError(1, f"attention_varlen_backward: lse must be fp32 of shape {(H, S)}, not {lse.dtype} "
                         f"{tuple(lse.shape)}")
    lse = lse.contiguous()
    nbytes = ctypes.c_size_t(0)
    _check(lib().mk_attention_varlen_backward_workspace(H, Hkv, S, D, cu.numel() - 1, int(deterministic),
                                                        ctypes.byref(nbytes)))
    ws = torch.empty(nbytes.value + 256, dtype=torch.uint8, device=q.device)
    ws_ptr = (ws.data_ptr() + 255) // 256 * 256
    st = (ctypes.c_int64 * 24)(*sum((_strides(t) for t in ts), []))
    _check(lib().mk_attention_varlen_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                              dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                              dv.data_ptr(), st, cu.data_ptr(), cu.numel() - 1, H, Hkv, S, D,
                                              float(scale), int(causal), int(deterministic), ws_ptr, nbytes.value,
                                              _stream()))
    return dq, dk, dv
