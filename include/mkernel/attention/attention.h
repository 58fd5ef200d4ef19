// mkernel — the Hopper (sm_90a) attention forward: softmax(Q·Kᵀ·scale [+ causal mask])·V in bf16
// with fp32 accumulation, returning O and the log-sum-exp of every query row, plus the exact
// merge of partial results (O, LSE) computed against disjoint key sets.
//
// Layout: Q [B, Sq, H, D], K and V [B, Skv, Hkv, D], O [B, Sq, H, D] as bf16 with the head
// dimension contiguous and any 16-byte aligned strides for batch, sequence and head (so both
// "bshd" and torch's "bhsd" memory layouts work). LSE is fp32 [B, H, Sq], natural log.
// Grouped-query attention: query head h reads key/value head h / (H / Hkv).
// Causal masking compares global positions: key j is visible to query i iff
// kv_pos0 + j <= q_pos0 + i (top-left aligned when both offsets are 0, like torch's is_causal).
// A query row that sees no key gets O = 0 and LSE = -inf.
//
// Packed variable-length sequences (`cu_seqlens`, forward and backward): B = 1 and the sequence
// axis holds documents back to back, document d being rows [cu_seqlens[d], cu_seqlens[d + 1]) of
// Q, K, V and O (and of the gradients); each attends only within itself, causal or not, its
// positions restarting at 0 (so Sq = Skv and q_pos0 = kv_pos0 = 0). cu_seqlens is device int32
// [n_docs + 1], non-decreasing from 0 to Sq, read by the kernels (no copy to the host, so the call
// does not synchronize); entries are clamped to [0, Sq], so a wrong one gives wrong rows but no
// access outside the tensors. Rows in no document (past cu_seqlens[n_docs]) are not written. LSE is
// [H, Sq] (B = 1).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/common/status.h"

namespace mk {
namespace attention {

struct Strides {  // in elements; the head dimension is contiguous
  int64_t b = 0, s = 0, h = 0;
  // [B, S, H, D] contiguous
  static Strides bshd(int64_t S, int64_t H, int64_t D) { return Strides{S * H * D, H * D, D}; }
  // [B, H, S, D] contiguous (torch's SDPA layout)
  static Strides bhsd(int64_t S, int64_t H, int64_t D) { return Strides{S * H * D, D, S * D}; }
};

struct ForwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // [B, H, Sq] fp32, or null
  Strides q_stride, k_stride, v_stride, o_stride;
  int B = 0, H = 0, Hkv = 0, Sq = 0, Skv = 0, D = 0;  // D: 64 or 128
  float scale = 0.f;                                   // 0: 1 / sqrt(D)
  bool causal = false;
  int64_t q_pos0 = 0, kv_pos0 = 0;                     // global positions of row 0 (causal)
  const int32_t* cu_seqlens = nullptr;                 // packed documents (see above), or null
  int n_docs = 0;                                      // documents in cu_seqlens (>= 1 with it)
};

struct RunConfig {
  int max_ctas = 0;  // 0: one CTA per SM this context may use
};

// kInvalidArgument with the reason for bad shapes, strides, alignment or aliasing;
// kNotSupported without the sm_90a kernel.
Status can_implement(const ForwardArgs& a);
Status forward(const ForwardArgs& a, cudaStream_t stream, const RunConfig& cfg = RunConfig{});

// Merge of partial attention results over disjoint key sets, in place and exact in fp32:
//   lse = log(exp(lse_acc) + exp(lse_part)),
//   O_acc = O_acc * exp(lse_acc - lse) + O_part * exp(lse_part - lse).
// O_acc fp32 [B, S, H, D] contiguous, lse_acc fp32 [B, H, S]; O_part bf16 with strides,
// lse_part fp32 [B, H, S]. Start from O_acc = 0 and lse_acc = -inf (merge_init).
struct MergeArgs {
  float* o_acc = nullptr;
  float* lse_acc = nullptr;
  const void* o_part = nullptr;
  Strides part_stride;
  const float* lse_part = nullptr;
  int B = 0, H = 0, S = 0, D = 0;
};
Status merge_init(float* o_acc, float* lse_acc, int B, int H, int S, int D, cudaStream_t stream);
Status merge(const MergeArgs& a, cudaStream_t stream);
// O (bf16, strides) = O_acc rounded.
Status merge_finish(const float* o_acc, void* o, Strides o_stride, int B, int H, int S, int D, cudaStream_t stream);

// FLOPs of one forward (2 GEMMs; causal counts the visible half, as FlashAttention reports).
double forward_flops(int B, int H, int Sq, int Skv, int D, bool causal);

// ---- backward ----
//
// dQ, dK, dV of the forward above from Q, K, V, O, its LSE and dO (bf16; fp32 accumulation):
// with P = softmax(Q·Kᵀ·scale) (masked) and dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)),
//   dV = Pᵀ·dO,  dK = scale · dSᵀ·Q,  dQ = scale · dS·K
// (GQA: dK and dV of a key/value head sum over its query heads). Same layouts, strides, causal
// positions and GQA rule as the forward; dQ, dK, dV bf16 [B, S, H(kv), D] with strides. dQ is
// reduced across key blocks in fp32: in any order by default, in a fixed order (bitwise
// reproducible from run to run) with `deterministic`. Needs a device workspace of
// backward_workspace_bytes(), 256-byte aligned, used for the call's duration (stream-ordered).
struct BackwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;  // [B, H, Sq] fp32, natural log, as the forward wrote it
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides q_stride, k_stride, v_stride, o_stride, do_stride, dq_stride, dk_stride, dv_stride;
  int B = 0, H = 0, Hkv = 0, Sq = 0, Skv = 0, D = 0;
  float scale = 0.f;  // 0: 1 / sqrt(D)
  bool causal = false;
  int64_t q_pos0 = 0, kv_pos0 = 0;
  const int32_t* cu_seqlens = nullptr;  // packed documents, as the forward's (see above)
  int n_docs = 0;
  bool deterministic = false;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The least workspace a call needs; n_docs: the documents of a packed variable-length call (0 for
// none).
size_t backward_workspace_bytes(int B, int H, int Sq, int D, int n_docs = 0);
// The workspace for a's fastest schedule: the least, plus room to split a GQA group's query heads
// over several CTAs when a call has fewer key blocks than SMs (dK and dV then summed in fp32, so
// not in deterministic mode). A call given the least workspace runs unsplit.
size_t backward_workspace_bytes(const BackwardArgs& a);
// kInvalidArgument with the reason; kNotSupported without the sm_90a kernel.
Status can_implement_backward(const BackwardArgs& a);
// A deterministic call whose ordering wait gave up (it cannot happen while the GPU runs the
// call's CTAs in launch order) poisons dQ with NaN; the next backward() on that device reports
// the wait (rank, flag, values) as kInternal.
Status backward(const BackwardArgs& a, cudaStream_t stream);

// FLOPs of one backward (5 GEMMs; causal counts the visible half).
double backward_flops(int B, int H, int Sq, int Skv, int D, bool causal);

}  // namespace attention
}  // namespace mk
