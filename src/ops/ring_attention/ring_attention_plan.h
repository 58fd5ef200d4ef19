// mkernel — the schedule of ring attention (host code, no CUDA): how the sequence is sharded,
// which rank's K/V block each rank holds at each step of the ring, where it sends it next, and
// which (query chunk, key chunk) pairs a step computes, with which mask.
//
// Sharding of a sequence of S tokens over W ranks:
//  - contiguous: W chunks of S / W tokens; rank r holds chunk r;
//  - zigzag: 2W chunks of S / (2W) tokens; rank r holds chunks r and 2W - 1 - r, so that under a
//    causal mask every rank has the same amount of work.
// Uneven shards (rows: rank r holds rows[r] tokens, summing to S): contiguous, chunk r has
// rows[r] tokens; zigzag, rank r's chunk r has ceil(rows[r] / 2) tokens and its chunk 2W - 1 - r
// the other floor(rows[r] / 2) (each rank at least 2). A rank's tokens are its chunks in token
// order, so chunk r's rows come first in its block.
// The ring visits ranks node by node (ring position p -> rank ring[p]), so a K/V block crosses
// each node boundary once per turn of the ring: W - 1 steps after the local one, every rank has
// seen every block once.
#pragma once

#include <cstdint>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/ops/ring_attention.h"
#include "src/comm/program.h"

namespace mk {
namespace ops {

enum class BlockMask : int {
  kFull = 0,      // every key of the key chunk is visible to every query of the query chunk
  kCausal = 1,    // same chunk: key j visible to query i iff j <= i
  kSkip = 2,      // no key visible (not computed)
};

struct SeqChunk {
  int64_t token0 = 0, tokens = 0;  // global token range
  int index = 0;                   // position in the global chunk order
  int64_t row0 = 0;                // first row in the owning rank's block
};

struct RingPair {
  int q_chunk = 0, kv_chunk = 0;  // indexes into the owning ranks' chunk lists
  BlockMask mask = BlockMask::kFull;
};

struct RingStep {
  int kv_rank = 0;    // whose K/V block this rank computes against at this step
  int send_to = -1;   // where this rank forwards the block it holds (-1: last step, no send)
  int recv_from = -1; // where the next step's block comes from (-1: none)
  bool send_crosses_node = false;
  std::vector<RingPair> pairs;  // (this rank's query chunk, kv_rank's key chunk) to compute
};

struct RingPlan {
  int world = 1;
  int64_t seq = 0;
  std::vector<int64_t> rows;                    // rank -> its tokens (even: seq / world each)
  SeqLayout layout = SeqLayout::kContiguous;
  bool causal = false;
  std::vector<int> ring;                        // ring position -> rank
  std::vector<std::vector<SeqChunk>> chunks;    // rank -> its chunks (1 or 2), in token order
  std::vector<std::vector<RingStep>> steps;     // rank -> W steps (step 0: its own block)
  // Work of a rank in query x key token pairs that are computed (skipped pairs excluded;
  // causal diagonal blocks count in full, as a kernel computes them).
  std::vector<int64_t> work;
};

// kInvalidArgument when S does not split (S % W, or S % 2W for zigzag) or the layout is bad.
// rows: uneven shards ([world] counts, each >= 1 (zigzag: >= 2), summing to seq), or empty.
Status build_ring_plan(const comm::Layout& layout, int64_t seq, SeqLayout seq_layout, bool causal, RingPlan* out,
                       const std::vector<int64_t>& rows = {});

// Each rank's work in a plan for packed documents (host cu_seqlens as ring_balanced_rows takes
// them; empty: one document): the keys its queries see, summed (a query at position p of a
// document starting at d sees p - d + 1 keys when causal, else the document's length).
std::vector<double> ring_doc_work(const RingPlan& plan, const std::vector<int32_t>& cu, bool causal);

// The rule on uneven shards alone (no layout): kInvalidArgument naming `what` unless rows is
// empty or holds `world` counts >= 1 (zigzag: >= 2) summing to seq.
Status check_ring_rows(const char* what, const std::vector<int64_t>& rows, int world, int64_t seq, SeqLayout layout);

}  // namespace ops
}  // namespace mk
