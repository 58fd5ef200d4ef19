"""GPU test of the sm_90a attention forward and the merge, against an fp32 reference.

Acceptance: for every configuration the kernel's largest absolute error against the fp32
reference is at most 2x that of torch SDPA in bf16 on the same inputs, and never NaN; the LSE
matches the reference's log-sum-exp. Fresh random inputs per case, outputs poisoned with NaN.
Exit code 77 (skipped) without a GPU or torch.
"""
import itertools
import math
import os
import sys

try:
    import torch
except ImportError:
    print("SKIPPED: no torch")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: no GPU")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from mkernel.attention import MkError, attention_forward, attention_merge  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda"
failures = []


def reference(q, k, v, causal, q_pos0=0, kv_pos0=0):
    """fp32 attention, heads in chunks; q (B, Sq, H, D). Returns O (B, Sq, H, D) and LSE (B, H, Sq)."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    scale = 1.0 / math.sqrt(D)
    out = torch.empty((B, Sq, H, D), dtype=torch.float32, device=dev)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=dev)
    qpos = torch.arange(Sq, device=dev) + q_pos0
    kpos = torch.arange(Skv, device=dev) + kv_pos0
    mask = kpos[None, :] > qpos[:, None]
    for b in range(B):
        for h0 in range(0, H, 4):
            hs = list(range(h0, min(H, h0 + 4)))
            qq = q[b, :, hs].float().permute(1, 0, 2)                       # (h, Sq, D)
            kk = k[b, :, [h // g for h in hs]].float().permute(1, 0, 2)     # (h, Skv, D)
            vv = v[b, :, [h // g for h in hs]].float().permute(1, 0, 2)
            s = torch.matmul(qq, kk.transpose(1, 2)) * scale
            if causal:
                s.masked_fill_(mask[None], float("-inf"))
            l = torch.logsumexp(s, dim=-1)                                  # (h, Sq)
            p = torch.exp(s - l[..., None])
            p = torch.nan_to_num(p, nan=0.0)
            out[b, :, hs] = torch.matmul(p, vv).permute(1, 0, 2)
            lse[b, hs] = l
    return out, lse


def make(B, S, H, D, layout):
    """Random normal bf16 tensor, logically (B, S, H, D), stored as bshd or bhsd."""
    if layout == "bhsd":
        return torch.randn((B, H, S, D), device=dev, dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn((B, S, H, D), device=dev, dtype=torch.bfloat16)


def sdpa(q, k, v, causal):
    H, Hkv = q.shape[2], k.shape[2]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=H != Hkv)
    return o.transpose(1, 2)


def check(name, o, lse, ref_o, ref_lse, sdpa_err):
    err = (o.float() - ref_o).abs().max().item()
    nan = bool(torch.isnan(o).any().item())
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    lse_ok = bool((torch.isinf(lse) == torch.isinf(ref_lse)).all().item())
    ok = not nan and err <= 2.0 * sdpa_err and lse_err <= 1e-3 and lse_ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max|err| {err:.3e} (sdpa {sdpa_err:.3e}, ratio {err / max(sdpa_err, 1e-30):.2f})"
          f" lse err {lse_err:.2e}{' NaN' if nan else ''}", flush=True)
    if not ok:
        failures.append(name)


def case(B, H, Hkv, S, D, causal, layout, Skv=None, q_pos0=0, kv_pos0=0):
    Skv = Skv or S
    q = make(B, S, H, D, layout)
    k = make(B, Skv, Hkv, D, layout)
    v = make(B, Skv, Hkv, D, layout)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), device=dev)
    attention_forward(q, k, v, causal=causal, out=o, lse=lse, q_pos0=q_pos0, kv_pos0=kv_pos0)
    ref_o, ref_lse = reference(q, k, v, causal, q_pos0, kv_pos0)
    if q_pos0 == 0 and kv_pos0 == 0 and S == Skv:
        sdpa_err = (sdpa(q, k, v, causal).float() - ref_o).abs().max().item()
    else:
        # SDPA's is_causal cannot express offsets: its error on the plain rounding of the
        # reference stands in (the reference rounded to bf16).
        sdpa_err = (ref_o.to(torch.bfloat16).float() - ref_o).abs().max().item() * 2
    name = f"B{B} H{H} Hkv{Hkv} Sq{S} Skv{Skv} D{D} {'causal' if causal else 'full'} {layout}"
    if q_pos0 or kv_pos0:
        name += f" q_pos0 {q_pos0} kv_pos0 {kv_pos0}"
    check(name, o, lse, ref_o, ref_lse, sdpa_err)
    torch.cuda.synchronize()


def main():
    torch.manual_seed(1234)
    n = 0
    if "--quick" in sys.argv:  # a first look: one small case per head dimension
        case(1, 8, 8, 1000, 128, False, "bshd")
        case(1, 8, 8, 1000, 64, True, "bhsd")
        case(1, 8, 8, 1000, 128, True, "bhsd")
        return 1 if failures else 0
    for B, H, S, D, causal in itertools.product((1, 2), (8, 32), (1000, 4096, 8192), (64, 128), (False, True)):
        for Hkv in sorted({8, H}):
            layout = "bhsd" if n % 2 else "bshd"
            case(B, H, Hkv, S, D, causal, layout)
            n += 1
    # The dynamic schedule (the grid above ran the default, static one for single calls) on
    # tails, GQA, causal and offsets.
    os.environ["MK_ATTENTION_DYNAMIC_SCHEDULE"] = "1"
    print("# attention_dynamic_schedule = 1")
    case(2, 8, 2, 1000, 128, False, "bshd")
    case(1, 32, 8, 4096, 128, True, "bhsd")
    case(1, 8, 8, 2000, 64, True, "bshd")
    case(2, 8, 2, 777, 128, True, "bhsd", Skv=1500, q_pos0=1500, kv_pos0=800)
    case(1, 8, 8, 300, 128, False, "bshd", Skv=1000)
    n += 5
    os.environ.pop("MK_ATTENTION_DYNAMIC_SCHEDULE", None)
    # Sequence lengths that differ, and causal offsets (the ring's blocks).
    case(1, 8, 8, 300, 128, False, "bshd", Skv=1000)
    case(1, 8, 8, 300, 64, True, "bshd", Skv=1000, q_pos0=700)
    case(2, 8, 2, 777, 128, True, "bhsd", Skv=1500, q_pos0=1500, kv_pos0=800)
    case(1, 8, 8, 512, 128, True, "bshd", Skv=512, q_pos0=0, kv_pos0=256)  # rows with no visible key
    # Merge: two disjoint key sets give the full result.
    for causal in (False, True):
        B, H, S, D = 2, 8, 3000, 128
        q, k, v = make(B, S, H, D, "bshd"), make(B, S, H, D, "bshd"), make(B, S, H, D, "bshd")
        cut = 1234
        parts = [attention_forward(q, k[:, :cut], v[:, :cut], causal=causal),
                 attention_forward(q, k[:, cut:], v[:, cut:], causal=causal, kv_pos0=cut)]
        o, lse = attention_merge(parts)
        ref_o, ref_lse = reference(q, k, v, causal)
        sdpa_err = (sdpa(q, k, v, causal).float() - ref_o).abs().max().item()
        check(f"merge of 2 key blocks B{B} H{H} S{S} D{D} {'causal' if causal else 'full'}", o, lse, ref_o, ref_lse,
              sdpa_err * 1.5)
    # Bad input: a clear error, nothing launched.
    q = make(1, 128, 8, 128, "bshd")
    for what, fn in (("D 96", lambda: attention_forward(make(1, 64, 8, 96, "bshd"), make(1, 64, 8, 96, "bshd"),
                                                        make(1, 64, 8, 96, "bshd"))),
                     ("H % Hkv", lambda: attention_forward(q, make(1, 128, 3, 128, "bshd"), make(1, 128, 3, 128, "bshd"))),
                     ("O aliases Q", lambda: attention_forward(q, q, q, out=q))):
        try:
            fn()
            print(f"FAIL bad input {what}: accepted")
            failures.append(what)
        except MkError as e:
            print(f"ok   bad input {what}: {e}")
    print(f"{n + 8} attention cases, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
