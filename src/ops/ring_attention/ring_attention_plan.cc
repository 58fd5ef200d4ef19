// The schedule of ring attention (see include/mkernel/ops/ring_plan.h).
#include "src/ops/ring_attention/ring_attention_plan.h"

#include "mkernel/common/check.h"

namespace mk {
namespace ops {

Status build_ring_plan(const comm::Layout& layout, int64_t seq, SeqLayout seq_layout, bool causal, RingPlan* out) {
  const int W = layout.world;
  MK_REQUIRE(W >= 1 && int(layout.node_of.size()) == W && layout.nodes() >= 1, Code::kInvalidArgument,
             "ring: malformed layout (world %d)", W);
  const int nchunks = seq_layout == SeqLayout::kZigzag ? 2 * W : W;
  MK_REQUIRE(seq > 0 && seq % nchunks == 0, Code::kInvalidArgument,
             "ring: a sequence of %lld tokens does not split into %d equal chunks (%s layout over %d ranks)",
             (long long)seq, nchunks, seq_layout == SeqLayout::kZigzag ? "zigzag" : "contiguous", W);
  RingPlan& p = *out;
  p = RingPlan{};
  p.world = W;
  p.seq = seq;
  p.layout = seq_layout;
  p.causal = causal;
  const int64_t len = seq / nchunks;
  p.chunks.assign(W, {});
  for (int r = 0; r < W; ++r) {
    if (seq_layout == SeqLayout::kZigzag) {
      p.chunks[r].push_back(SeqChunk{int64_t(r) * len, len, r});
      p.chunks[r].push_back(SeqChunk{int64_t(2 * W - 1 - r) * len, len, 2 * W - 1 - r});
    } else {
      p.chunks[r].push_back(SeqChunk{int64_t(r) * len, len, r});
    }
  }
  // Node by node: one crossing per node boundary per turn.
  for (const auto& nr : layout.node_ranks)
    for (int r : nr) p.ring.push_back(r);
  MK_REQUIRE(int(p.ring.size()) == W, Code::kInvalidArgument, "ring: the layout's nodes do not hold every rank once");
  std::vector<int> pos(W, -1);
  for (int i = 0; i < W; ++i) {
    MK_REQUIRE(p.ring[i] >= 0 && p.ring[i] < W && pos[p.ring[i]] < 0, Code::kInvalidArgument,
               "ring: rank %d appears twice in the layout", p.ring[i]);
    pos[p.ring[i]] = i;
  }
  p.steps.assign(W, {});
  p.work.assign(W, 0);
  for (int r = 0; r < W; ++r) {
    const int me = pos[r];
    const int next = p.ring[(me + 1) % W], prev = p.ring[(me + W - 1) % W];
    for (int t = 0; t < W; ++t) {
      RingStep st;
      st.kv_rank = p.ring[(me - t + W) % W];
      const bool last = t == W - 1;
      st.send_to = last ? -1 : next;
      st.recv_from = last ? -1 : prev;
      st.send_crosses_node = !last && layout.node_of[next] != layout.node_of[r];
      const auto& qc = p.chunks[r];
      const auto& kc = p.chunks[st.kv_rank];
      for (int a = 0; a < int(qc.size()); ++a)
        for (int b = 0; b < int(kc.size()); ++b) {
          BlockMask m = BlockMask::kFull;
          if (causal) {
            if (kc[b].index > qc[a].index) m = BlockMask::kSkip;
            else if (kc[b].index == qc[a].index) m = BlockMask::kCausal;
          }
          if (m == BlockMask::kSkip) continue;
          st.pairs.push_back(RingPair{a, b, m});
          p.work[r] += qc[a].tokens * kc[b].tokens;
        }
      p.steps[r].push_back(std::move(st));
    }
  }
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
