"""One-off (run from the repository root with MK_CAPI set; 2026-12-05, H100): the backward's split schedule against the unsplit one (the least workspace), same lib, same run."""
import ctypes, statistics, sys, os, time
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "python"))
from mkernel.attention import attention_forward, _strides, _stream, lib, _check


def run(q, k, v, o, lse, do, dq, dk, dv, causal, ws_bytes, ws):
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    st = (ctypes.c_int64 * 24)(*sum((_strides(t) for t in (q, k, v, o, do, dq, dk, dv)), []))
    _check(lib().mk_attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), do.data_ptr(),
                                       lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), st, B, H, Hkv,
                                       Sq, Skv, D, 0.0, int(causal), 0, 0, 0, ws.data_ptr(), ws_bytes, _stream()))


def timed(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); fn(); b.record(); b.synchronize()
    return a.elapsed_time(b)


print(torch.cuda.get_device_name())
for B, H, Hkv, S, D, causal in ((1, 8, 2, 2048, 128, True), (2, 8, 2, 2048, 128, True), (1, 16, 2, 1024, 64, True),
                                (1, 32, 8, 4096, 128, True), (1, 32, 4, 8192, 128, False)):
    q, do = (torch.randn((B, S, H, D), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((B, S, Hkv, D), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, lse = attention_forward(q, k, v, causal=causal)
    least, full = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _check(lib().mk_attention_backward_workspace(B, H, H, S, S, D, 0, ctypes.byref(least)))  # Hkv = H: no split room
    _check(lib().mk_attention_backward_workspace(B, H, Hkv, S, S, D, 0, ctypes.byref(full)))
    ws = torch.empty(full.value, dtype=torch.uint8, device="cuda")
    outs = {}
    for name, nb in (("unsplit", least.value), ("split", full.value)):
        g = [torch.empty_like(t) for t in (q, k, v)]
        f = lambda: run(q, k, v, o, lse, do, *g, causal, nb, ws)
        t_end = time.time() + 0.5
        while time.time() < t_end:
            f()
        torch.cuda.synchronize()
        outs[name] = (statistics.median(timed(f) for _ in range(20)), g)
    same = all((a.float() - b.float()).abs().max().item() <= 2 ** -6 * b.float().abs().max().item()
               for a, b in zip(outs["split"][1][1:], outs["unsplit"][1][1:]))
    print(f"B{B} H{H} Hkv{Hkv} S{S} D{D} causal={causal}: unsplit {outs['unsplit'][0]:.3f} ms, split "
          f"{outs['split'][0]:.3f} ms ({outs['unsplit'][0] / outs['split'][0]:.2f}x), dK/dV agree {same}", flush=True)
