// mkernel — ring attention: sequence-parallel attention over W ranks in one persistent kernel
// per call.
//
// Each rank holds a shard of the sequence (src/ops/ring_attention/ring_attention_plan.h: contiguous, or zigzag so that causal
// work is balanced): Q, K, V and O of its tokens, [B, S/W, heads, D] bf16 contiguous, its chunks
// in token order (zigzag: chunk r, then chunk 2W - 1 - r). Uneven shards (RingAttentionShape::
// rows): rank r holds rows[r] tokens instead of S/W (below, S/W stands for this rank's tokens).
// K/V blocks travel around a node-major
// ring: at step t a rank computes against the block it holds and forwards that block to the next
// rank. Inside the kernel, communication CTAs forward blocks in chunks — peer stores into the
// next GPU's slot on the node, puts through the proxy (libfabric) when the next rank is on another
// node, so each block crosses each node boundary once — and raise per-chunk arrival flags; compute
// CTAs start on the local block at once and wait (bounded) for a chunk's flag before loading it.
// Partial results of the steps are merged exactly (fp32 O and LSE, in step order).
//
// Usage (collective: every rank, same shape):
//   std::unique_ptr<RingAttention> op;
//   MK_CHECK(RingAttention::create(comm, {B, H, Hkv, D, S, SeqLayout::kZigzag, true}, {}, &op));
//   MK_CHECK(op->run({q, k, v, o, lse}, stream));   // CUDA-graph capturable
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/device/trace.h"

namespace mk {

class Communicator;

namespace ops {

// How the sequence is sharded: contiguous (W chunks, rank r holds chunk r) or zigzag (2W
// chunks, rank r holds chunks r and 2W - 1 - r, balancing causal work).
enum class SeqLayout : int { kContiguous = 0, kZigzag = 1 };

struct RingAttentionShape {
  int B = 1, H = 1, Hkv = 1, D = 128;
  int64_t S = 0;  // the whole sequence; each rank holds S / W tokens
  SeqLayout layout = SeqLayout::kContiguous;
  bool causal = false;
  // Uneven shards, or empty (S / W each): rows[r] tokens on rank r ([world] counts summing to S,
  // each >= 1; zigzag >= 2), agreed at create. Contiguous: rank r holds tokens [rows[0] + ... +
  // rows[r-1], + rows[r]). Zigzag: the sequence's 2W chunks have, in order, ceil(rows[0] / 2),
  // ceil(rows[1] / 2), ..., ceil(rows[W-1] / 2), then floor(rows[W-1] / 2), ..., floor(rows[0] / 2)
  // tokens; rank r holds chunks r and 2W - 1 - r (its first ceil(rows[r] / 2) rows, then the
  // rest). The K/V slots are sized by the largest shard.
  std::vector<int64_t> rows;

  RingAttentionShape() = default;
  RingAttentionShape(int b, int h, int hkv, int d, int64_t s, SeqLayout l = SeqLayout::kContiguous, bool c = false,
                     std::vector<int64_t> shard_rows = {})
      : B(b), H(h), Hkv(hkv), D(d), S(s), layout(l), causal(c), rows(std::move(shard_rows)) {}
};

struct RingAttentionOptions {
  int comm_ctas = -1;        // -1: tunable ring_comm_ctas (>= 1 when W > 1)
  int chunk_tokens = 0;      // tokens per forwarded chunk (arrival flag granularity); 0: ~2 MiB chunks
  int max_ctas = 0;          // persistent grid; 0: one CTA per SM this context may use
  float scale = 0.f;         // 0: 1 / sqrt(D)
  std::string staging;       // network staging "auto" | "always" | "never"; "": tunable net_staging
};

struct RingAttentionArgs {
  const void* q = nullptr;   // [B, S/W, H, D] bf16, this rank's tokens
  const void* k = nullptr;   // [B, S/W, Hkv, D]
  const void* v = nullptr;
  void* o = nullptr;         // [B, S/W, H, D]
  float* lse = nullptr;      // [B, H, S/W] fp32 (natural log), or null
  // Packed documents (B = 1), or null: device int32 [n_docs + 1], the documents' bounds in the
  // whole sequence's token positions — the same array on every rank, non-decreasing from 0 to S.
  // Each document attends only within itself (causal within itself when the shape is causal);
  // the sequence is sharded as without documents (a document may span chunks and ranks). Read
  // on the device, so a new packing per call needs no new operator and no host sync (graph
  // capturable). Tokens before cu_seqlens[0] or from cu_seqlens[n_docs] on form documents of
  // their own; a malformed array gives wrong rows, never an access outside the tensors.
  const int32_t* cu_seqlens = nullptr;
  int n_docs = 0;
  // Non-null: the traced kernel records per CTA every work item ("compute", item = index in
  // the launch's item list), every wait of the producer for a ring block that lasted > 5 us
  // ("wait"), and every communication op ("comm", or "net-send" for proxy puts; item = op
  // index). Export with write_chrome_trace (device/trace.h).
  const TraceBuffer* trace = nullptr;
};

// Uneven contiguous shards that balance the ring's work over `world` ranks for packed documents
// (RingAttentionShape::rows with SeqLayout::kContiguous). cu_seqlens: host memory, n_docs + 1
// bounds non-decreasing from 0 to S, as RingAttentionArgs::cu_seqlens takes them. A query's
// work is the keys it sees: its position in its document + 1 (causal) or its document's length;
// *rows gets `world` counts >= 1 summing to S whose largest share of the work is the least any
// contiguous split has. Shards are agreed at create: a packing that changes per call needs an
// operator per distinct result. kInvalidArgument for a malformed array or S < world.
Status ring_balanced_rows(const int32_t* cu_seqlens, int n_docs, int world, bool causal, std::vector<int64_t>* rows);

struct RingState;

class RingAttention {
 public:
  // The shape rules, before any communicator or GPU: D 64 or 128, H a multiple of Hkv, S split
  // into W (contiguous) or 2W (zigzag) equal chunks, or shard rows as above. create() applies
  // them too (the same error).
  static Status can_implement(const RingAttentionShape& shape, int world);
  // Collective: checks that every rank asked for the same shape (a mismatch is the same kMismatch
  // on every rank), builds the ring plan, allocates the K/V slots, the merge workspace and the
  // signal pad, and starts the network backend and proxy when ranks span several nodes.
  static Status create(Communicator* comm, const RingAttentionShape& shape, const RingAttentionOptions& opt,
                       std::unique_ptr<RingAttention>* out);
  ~RingAttention();
  RingAttention(const RingAttention&) = delete;
  RingAttention& operator=(const RingAttention&) = delete;
  Status destroy();  // collective, idempotent

  Status can_implement(const RingAttentionArgs& a) const;  // local checks
  Status run(const RingAttentionArgs& a, cudaStream_t stream);      // local checks, enqueues (see FusedGemm::run)
  Status enqueue(const RingAttentionArgs& a, cudaStream_t stream);  // no agreement (after a checked run)

  int comm_ctas() const;
  int64_t local_tokens() const;  // this rank's tokens: S / W, or rows[rank]
  int work_items() const;  // items of a call's launch (B * H * 128-row query tiles, per pair)
  int comm_ops() const;    // ops of this rank's communication program
  size_t block_elems() const;  // elements of this rank's K (or V) block: B * local_tokens() * Hkv * D

 private:
  // Tests, baselines and benchmarks reach the schedule, the slots and the compute-only launches
  // through src/ops/ring_attention/ring_attention_testing.h (not installed).
  friend struct RingAttentionTesting;
  RingAttention() = default;
  std::unique_ptr<RingState> st_;
};

// ---- the backward ----
//
// dQ, dK and dV of ring attention in one persistent kernel per call (plus a preprocessing and a
// finishing kernel): K/V travel the ring as in the forward, and each block's dK/dV partial sums
// travel with them — at every step a rank computes the key blocks of the block it holds against
// its own queries (dK/dV fp32 per 128-key tile, dQ accumulated locally), and its communication
// CTAs add its tiles to the sum that arrived from the previous rank and send it on, so that after
// W hops each block's dK/dV is back on its owner, having crossed each node boundary once per
// hop like K/V. Not deterministic (dQ accumulates in any order). Memory per rank: the forward's
// K/V slots, and two fp32 dK/dV buffers of W blocks each (8 * W * B * S/W * Hkv * D bytes each,
// S/W the largest shard's tokens,
// rounded to 128-key tiles). Both operators also keep the document windows of packed calls
// (8 bytes per position of the sequence, allocated at create whether or not calls pack).
//
// Usage (collective: every rank, same shape; o and lse from RingAttention::run of that shape):
//   std::unique_ptr<RingAttentionBackward> bwd;
//   MK_CHECK(RingAttentionBackward::create(comm, shape, {}, &bwd));
//   MK_CHECK(bwd->run({q, k, v, o, dout, lse, dq, dk, dv}, stream));   // CUDA-graph capturable
struct RingAttentionBackwardArgs {
  const void* q = nullptr;     // [B, S/W, H, D] bf16, this rank's tokens (as the forward's)
  const void* k = nullptr;     // [B, S/W, Hkv, D]
  const void* v = nullptr;
  const void* o = nullptr;     // [B, S/W, H, D]: the forward's output
  const void* dout = nullptr;  // [B, S/W, H, D]: the gradient of o
  const float* lse = nullptr;  // [B, H, S/W] fp32 (natural log): the forward's
  void* dq = nullptr;          // [B, S/W, H, D] bf16
  void* dk = nullptr;          // [B, S/W, Hkv, D]
  void* dv = nullptr;
  // Packed documents: the forward call's (RingAttentionArgs::cu_seqlens, n_docs), or null.
  const int32_t* cu_seqlens = nullptr;
  int n_docs = 0;
  // Non-null: the kernel records per CTA every work item ("compute", item = index in the
  // launch's item list, from its start to its ready flag), every wait of the producer for a
  // ring block that lasted > 5 us ("wait"), every communication op ("comm" / "net-send",
  // item = op index) and each CTA's life ("cta", from its start to its end; item 1 for a
  // communication CTA, 0 for a compute one). Export with write_chrome_trace (device/trace.h).
  const TraceBuffer* trace = nullptr;
};

struct RingBwdState;

class RingAttentionBackward {
 public:
  // Collective, as RingAttention::create (the same shape rules; its own slots and program).
  static Status create(Communicator* comm, const RingAttentionShape& shape, const RingAttentionOptions& opt,
                       std::unique_ptr<RingAttentionBackward>* out);
  ~RingAttentionBackward();
  RingAttentionBackward(const RingAttentionBackward&) = delete;
  RingAttentionBackward& operator=(const RingAttentionBackward&) = delete;
  Status destroy();  // collective, idempotent

  Status can_implement(const RingAttentionBackwardArgs& a) const;  // local checks
  Status run(const RingAttentionBackwardArgs& a, cudaStream_t stream);
  Status enqueue(const RingAttentionBackwardArgs& a, cudaStream_t stream);  // no agreement

  int comm_ctas() const;
  int work_items() const;  // items of a call's launch (key blocks x key/value heads x batch, per step)
  int comm_ops() const;

 private:
  friend struct RingAttentionTesting;  // src/ops/ring_attention/ring_attention_testing.h
  RingAttentionBackward() = default;
  std::unique_ptr<RingBwdState> st_;
};

}  // namespace ops
}  // namespace mk
