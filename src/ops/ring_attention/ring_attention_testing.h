// RingAttention's internals for tests, the cuBLAS + NCCL baselines and the CLI's benchmark
// (library-internal: not installed; users have include/mkernel/ops/ring_attention.h).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "mkernel/common/status.h"
#include "mkernel/ops/ring_attention.h"
#include "src/ops/ring_attention/ring_attention_plan.h"

namespace mk {
namespace ops {

struct RingAttentionTesting {
  // The ring's schedule (chunks per rank, steps, pairs).
  static const RingPlan& plan(const RingAttention& op);
  // A K/V slot's rows per batch: S/W, or the largest shard's tokens (uneven shards; a shorter
  // block fills the first rows of its slot, the rest stay zero).
  static int64_t slot_rows(const RingAttention& op);
  // This rank's K/V slots after a call: [W][B][slot_rows][Hkv][D] (slot r holds rank r's block
  // once it passed through here).
  static const void* k_slots(const RingAttention& op);
  static const void* v_slots(const RingAttention& op);
  // The same kernel with no communication, over K/V the caller moved (baselines, and the
  // compute-only time T_c): step < 0 computes every pair of the call from k_src / v_src laid out
  // as the slots ([W][B][slot_rows][Hkv][D], slot r = rank r's block, zeros past its rows); step t
  // computes step t's pairs against the block held at step t, read from k_src / v_src
  // [B][slot_rows][Hkv][D] (step 0: may be the caller's own K/V when the shards are even). Steps must run in order 0, 1, ..., W - 1 on one stream: they merge
  // into the operator's fp32 accumulator and the last writes O.
  static Status enqueue_compute(RingAttention& op, const RingAttentionArgs& a, int step, const void* k_src,
                                const void* v_src, cudaStream_t stream);
  // The backward's kernel with no communication (the compute-only time of the backward): every
  // pair of the call against K/V laid out as the slots (k_all / v_all: [W][B][slot_rows][Hkv][D]), no
  // waits, no communication CTAs. dQ is the call's; dK and dV are not (no sums travel).
  static Status enqueue_backward_compute(RingAttentionBackward& op, const RingAttentionBackwardArgs& a,
                                         const void* k_all, const void* v_all, cudaStream_t stream);
  // Leave-one-out timing: the fused backward call with the communication CTAs running only the
  // program's K/V ops (RingRank::kv_ops), no dK/dV sum. dQ is the call's; dK and dV are not. The
  // sums' flags fall behind the calls: the operator's later full calls would wait for sums that
  // never come (until their bound), so run it after them.
  static Status enqueue_backward_without_sums(RingAttentionBackward& op, const RingAttentionBackwardArgs& a,
                                              cudaStream_t stream);
  // Where a backward call stands, read while it may still run (bounded copies on their own
  // stream): the call's epoch and finished CTAs, the communication CTAs' next op, and every
  // dK/dV piece's ready count and arrival short of this call's target. For a call that did not
  // finish: which items and ops it is stuck on.
  static Status backward_progress(const RingAttentionBackward& op, std::string* out);
};

}  // namespace ops
}  // namespace mk
