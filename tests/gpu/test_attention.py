"""GPU test of the sm_90a attention forward and the merge, against an fp32 reference.

Acceptance: for every configuration the kernel's largest absolute error against the fp32
reference is at most 1.3x that of torch SDPA in bf16 on the same inputs (SDPA given the same
causal offsets through an explicit mask where is_causal cannot express them), and never NaN; the
LSE matches the reference's log-sum-exp. A case over 1.3x on the error ratio alone is drawn once
more with fresh inputs and fails if it is over again (retried() says why). The merge of two key blocks is held to 1.3x the larger of
SDPA's error and that of merging the reference's own blocks rounded to bf16 (the merge's inputs
are bf16). Large-logit cases (logits up to about +-100, and rows whose logits all sit near +95 or
-95) fail without the max subtraction or with a wrong exp2 scaling. Fresh random inputs every
run from a seed printed at the start (MK_TEST_SEED=<n> replays a run), outputs poisoned with NaN.
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


def sdpa(q, k, v, causal, q_pos0=0, kv_pos0=0):
    """torch SDPA in bf16 on the same problem; causal offsets through an explicit mask. Rows with no
    visible key are set to 0 (as the reference), so they add no error of SDPA's own."""
    H, Hkv = q.shape[2], k.shape[2]
    if H != Hkv:  # query head h reads key/value head h // (H / Hkv), as the reference
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    Sq, Skv = q.shape[1], k.shape[1]
    mask, is_causal = None, False
    if causal and q_pos0 == 0 and kv_pos0 == 0 and Sq == Skv:
        is_causal = True
    elif causal:
        qpos = torch.arange(Sq, device=dev) + q_pos0
        kpos = torch.arange(Skv, device=dev) + kv_pos0
        mask = kpos[None, :] <= qpos[:, None]  # True: attend
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal)
    o = o.transpose(1, 2)
    if mask is not None:
        o = torch.nan_to_num(o, nan=0.0)
        o[:, ~mask.any(dim=-1)] = 0
    return o


# The kernel's largest error may be at most this many times SDPA's.
TOLERANCE = 1.3


def check(name, o, lse, ref_o, ref_lse, sdpa_err, last=True):
    """Prints the verdict; returns "ok", "fail", or "ratio" (only the error ratio was over: a
    case may then be drawn again, see retried())."""
    err = (o.float() - ref_o).abs().max().item()
    nan = bool(torch.isnan(o).any().item())
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    lse_ok = bool((torch.isinf(lse) == torch.isinf(ref_lse)).all().item())
    other_ok = not nan and lse_err <= 1e-3 and lse_ok
    ok = other_ok and err <= TOLERANCE * sdpa_err
    verdict = "ok" if ok else "ratio" if other_ok else "fail"
    tag = "ok  " if ok else "FAIL" if last or verdict == "fail" else "over"
    print(f"{tag} {name}: max|err| {err:.3e} (sdpa {sdpa_err:.3e}, ratio {err / max(sdpa_err, 1e-30):.2f})"
          f" lse err {lse_err:.2e}{' NaN' if nan else ''}" + ("" if ok or last else ": drawing fresh inputs once"),
          flush=True)
    return verdict


def retried(run):
    """run(last) builds fresh inputs, checks them and returns check()'s verdict. The largest
    error of a bf16 output is the largest of millions of roundings, and both the kernel's and
    SDPA's sit about half a unit in the last place above the reference: about once in several
    hundred cases the kernel's lands over 1.3x SDPA's because one element rounded the other way
    (seen on the H200: 1 of 792 cases at 1.32, 4 at 1.27-1.32). Such a case (error ratio only:
    never NaN or LSE) is drawn once more with fresh inputs and fails if it is over again; a kernel
    that is really less accurate is over on both draws."""
    verdict = run(False)
    if verdict == "ratio":
        verdict = run(True)
    if verdict != "ok":
        failures.append(current[0])


def large_logits(q, k, mode):
    """q and k changed so that the logits q.k / sqrt(D) are large. "scaled": both x5, logits of
    standard deviation 25 (up to about +-100, softmax nearly one-hot). "offset+" / "offset-": a
    common component along the all-ones direction shifts every logit of a row to about +95 / -95
    while they still differ by a few units (a real average): exp() of them overflows / underflows
    fp32 unless the row's maximum is subtracted first."""
    D = q.shape[-1]
    if mode == "scaled":
        return (q.float() * 5).to(torch.bfloat16), (k.float() * 5).to(torch.bfloat16)
    c = math.sqrt(95 / math.sqrt(D))  # c * c * D / sqrt(D) = 95
    sign = 1.0 if mode == "offset+" else -1.0
    return (q.float() + c).to(torch.bfloat16), (k.float() + sign * c).to(torch.bfloat16)


current = [""]  # the name of the case being checked (for the failure list)


def case(B, H, Hkv, S, D, causal, layout, Skv=None, q_pos0=0, kv_pos0=0, logits=None):
    retried(lambda last: case_once(B, H, Hkv, S, D, causal, layout, Skv, q_pos0, kv_pos0, logits, last))


def case_once(B, H, Hkv, S, D, causal, layout, Skv, q_pos0, kv_pos0, logits, last):
    Skv = Skv or S
    q = make(B, S, H, D, layout)
    k = make(B, Skv, Hkv, D, layout)
    v = make(B, Skv, Hkv, D, layout)
    if logits:
        q2, k2 = large_logits(q, k, logits)
        q.copy_(q2)
        k.copy_(k2)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), device=dev)
    attention_forward(q, k, v, causal=causal, out=o, lse=lse, q_pos0=q_pos0, kv_pos0=kv_pos0)
    ref_o, ref_lse = reference(q, k, v, causal, q_pos0, kv_pos0)
    sdpa_err = (sdpa(q, k, v, causal, q_pos0, kv_pos0).float() - ref_o).abs().max().item()
    name = f"B{B} H{H} Hkv{Hkv} Sq{S} Skv{Skv} D{D} {'causal' if causal else 'full'} {layout}"
    if q_pos0 or kv_pos0:
        name += f" q_pos0 {q_pos0} kv_pos0 {kv_pos0}"
    if logits:
        amax = (ref_lse.max().item(), ref_lse.min().item())
        name += f" large logits ({logits}, LSE in [{amax[1]:.0f}, {amax[0]:.0f}])"
    current[0] = name
    verdict = check(name, o, lse, ref_o, ref_lse, sdpa_err, last)
    torch.cuda.synchronize()
    return verdict


def merged_rounding_err(q, k, v, causal, cut, ref_o):
    """The error of merging the reference's own two key blocks, each rounded to bf16 as the
    merge's inputs are, in fp32, rounded once more: the floor for a merge of bf16 blocks."""
    o1, l1 = reference(q, k[:, :cut], v[:, :cut], causal)
    o2, l2 = reference(q, k[:, cut:], v[:, cut:], causal, kv_pos0=cut)
    lse = torch.logaddexp(l1, l2)
    w1 = torch.nan_to_num(torch.exp(l1 - lse), nan=0.0).transpose(1, 2)[..., None]  # (B, S, H, 1)
    w2 = torch.nan_to_num(torch.exp(l2 - lse), nan=0.0).transpose(1, 2)[..., None]
    o = w1 * o1.to(torch.bfloat16).float() + w2 * o2.to(torch.bfloat16).float()
    return (o.to(torch.bfloat16).float() - ref_o).abs().max().item()


def merge_once(causal, last):
    B, H, S, D = 2, 8, 3000, 128
    q, k, v = make(B, S, H, D, "bshd"), make(B, S, H, D, "bshd"), make(B, S, H, D, "bshd")
    cut = 1234
    parts = [attention_forward(q, k[:, :cut], v[:, :cut], causal=causal),
             attention_forward(q, k[:, cut:], v[:, cut:], causal=causal, kv_pos0=cut)]
    o, lse = attention_merge(parts)
    ref_o, ref_lse = reference(q, k, v, causal)
    sdpa_err = (sdpa(q, k, v, causal).float() - ref_o).abs().max().item()
    floor = merged_rounding_err(q, k, v, causal, cut, ref_o)
    current[0] = f"merge of 2 key blocks B{B} H{H} S{S} D{D} {'causal' if causal else 'full'}"
    return check(f"{current[0]} (merge floor {floor:.3e})", o, lse, ref_o, ref_lse, max(sdpa_err, floor), last)


def run_seed():
    """MK_TEST_SEED (decimal or 0x-hex) if set, else a fresh one."""
    env = os.environ.get("MK_TEST_SEED", "")
    return int(env, 0) if env else int.from_bytes(os.urandom(8), "little")


def main():
    seed = run_seed()
    print(f"test seed: {seed} (MK_TEST_SEED to replay)", flush=True)
    torch.manual_seed(seed)
    n = 0
    if "--quick" in sys.argv:  # a first look: one small case per head dimension
        case(1, 8, 8, 1000, 128, False, "bshd")
        case(1, 8, 8, 1000, 64, True, "bhsd")
        case(1, 8, 8, 1000, 128, True, "bhsd")
        case(1, 8, 2, 1000, 128, True, "bshd", logits="offset+")
        return finish(seed, 4)
    for B, H, S, D, causal in itertools.product((1, 2), (8, 32), (1000, 4096, 8192), (64, 128), (False, True)):
        for Hkv in sorted({8, H}):
            layout = "bhsd" if n % 2 else "bshd"
            case(B, H, Hkv, S, D, causal, layout)
            n += 1
    # Tails, GQA, causal and offsets. (Single calls run the static schedule; the dynamic one,
    # the ring's, is checked by test_gpu_ring_attention against this kernel's single calls.)
    case(2, 8, 2, 1000, 128, False, "bshd")
    case(1, 32, 8, 4096, 128, True, "bhsd")
    case(1, 8, 8, 2000, 64, True, "bshd")
    case(2, 8, 2, 777, 128, True, "bhsd", Skv=1500, q_pos0=1500, kv_pos0=800)
    case(1, 8, 8, 300, 128, False, "bshd", Skv=1000)
    n += 5
    # Sequence lengths that differ, and causal offsets (the ring's blocks).
    case(1, 8, 8, 300, 128, False, "bshd", Skv=1000)
    case(1, 8, 8, 300, 64, True, "bshd", Skv=1000, q_pos0=700)
    case(2, 8, 2, 777, 128, True, "bhsd", Skv=1500, q_pos0=1500, kv_pos0=800)
    case(1, 8, 8, 512, 128, True, "bshd", Skv=512, q_pos0=0, kv_pos0=256)  # rows with no visible key
    n += 4
    # Large logits: one-hot-like rows (logits up to about +-100) and rows shifted to about +-95.
    for D, causal, mode in itertools.product((64, 128), (False, True), ("scaled", "offset+", "offset-")):
        case(1 + (D == 64), 8, 2 if causal else 8, 1000 if D == 64 else 2000, D, causal,
             "bhsd" if mode == "offset-" else "bshd", logits=mode)
        n += 1
    case(2, 8, 2, 777, 128, True, "bhsd", Skv=1500, q_pos0=1500, kv_pos0=800, logits="offset+")
    n += 1
    # Merge: two disjoint key sets give the full result.
    for causal in (False, True):
        retried(lambda last: merge_once(causal, last))
        n += 1
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
        n += 1
    return finish(seed, n)


def finish(seed, n):
    print(f"{n} attention cases, {len(failures)} failed" +
          (f": {', '.join(failures)} (test seed {seed}: MK_TEST_SEED={seed} replays it)" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
