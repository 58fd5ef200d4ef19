// mkernel — the attention backward as its API launches it (library-internal): the workspace's
// parts and the kernel's instantiation units (sm90_fmha_bwd_d{64,128}.cu).
#pragma once

#include <cstdint>

#include "mkernel/attention/attention.h"
#include "mkernel/device/diag.h"
#include "src/attention/fmha_launch.h"

namespace mk {
namespace attention {

// Carved from BackwardArgs::workspace (backward_workspace_bytes); rows padded to sq_pad.
struct BwdWorkspace {
  float* dq_acc = nullptr;  // [B][H][sq_pad][D] fp32, zeroed by the preprocessing
  float* lse2 = nullptr;    // [B][H][sq_pad]: LSE * log2(e), +inf where P is 0
  float* dsum = nullptr;    // [B][H][sq_pad]: rowsum(dO * O)
  uint64_t* order = nullptr;  // [B][H][sq_pad / 64]: deterministic mode's per-query-block counters
  int sq_pad = 0;
  float scale = 0.f;
  // Split schedule: each key block's GQA group over head_split CTAs (1: one CTA), dK and dV summed
  // in dkv_acc (fp32 [2][B][Hkv][key blocks][128 * D] in fragment order, zeroed by the launch).
  int head_split = 1;
  float* dkv_acc = nullptr;
  WaitCtx wait{};
};

// The backward grid's 128-row key blocks per (batch, key/value head): the sequence's, or a
// packed call's virtual key tiles (kernel/varlen.cuh).
inline int bwd_key_blocks(const BackwardArgs& a) {
  return a.cu_seqlens ? varlen_tiles(a.Skv, a.n_docs, 128) : (a.Skv + 127) / 128;
}

namespace sm90 {
Status launch_bwd_d64(const BackwardArgs& a, const BwdWorkspace& w, cudaStream_t stream);
Status launch_bwd_d128(const BackwardArgs& a, const BwdWorkspace& w, cudaStream_t stream);
}  // namespace sm90

}  // namespace attention
}  // namespace mk
