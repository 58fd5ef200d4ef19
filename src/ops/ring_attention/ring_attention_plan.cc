// The schedule of ring attention (see src/ops/ring_attention/ring_attention_plan.h).
#include "src/ops/ring_attention/ring_attention_plan.h"

#include <algorithm>
#include <vector>

#include "mkernel/common/check.h"

namespace mk {
namespace ops {

Status check_ring_rows(const char* what, const std::vector<int64_t>& rows, int world, int64_t seq, SeqLayout layout) {
  if (rows.empty()) return OkStatus();
  MK_REQUIRE(int64_t(rows.size()) == world, Code::kInvalidArgument,
             "%s: %zu shard row counts for %d ranks (one per rank)", what, rows.size(), world);
  const int64_t least = layout == SeqLayout::kZigzag ? 2 : 1;
  int64_t sum = 0;
  for (int r = 0; r < world; ++r) {
    MK_REQUIRE(rows[size_t(r)] >= least, Code::kInvalidArgument,
               "%s: rank %d holds %lld tokens (each rank at least %lld%s)", what, r, (long long)rows[size_t(r)],
               (long long)least, least == 2 ? ": the zigzag layout gives it two chunks" : "");
    MK_REQUIRE(rows[size_t(r)] <= (int64_t(1) << 30), Code::kInvalidArgument, "%s: rank %d holds %lld tokens", what, r,
               (long long)rows[size_t(r)]);
    sum += rows[size_t(r)];
  }
  MK_REQUIRE(sum == seq, Code::kInvalidArgument, "%s: the shards' rows sum to %lld, not the sequence's %lld tokens",
             what, (long long)sum, (long long)seq);
  return OkStatus();
}

Status build_ring_plan(const comm::Layout& layout, int64_t seq, SeqLayout seq_layout, bool causal, RingPlan* out,
                       const std::vector<int64_t>& rows) {
  const int W = layout.world;
  MK_REQUIRE(W >= 1 && int(layout.node_of.size()) == W && layout.nodes() >= 1, Code::kInvalidArgument,
             "ring: malformed layout (world %d)", W);
  const int nchunks = seq_layout == SeqLayout::kZigzag ? 2 * W : W;
  MK_REQUIRE(seq > 0 && (!rows.empty() || seq % nchunks == 0), Code::kInvalidArgument,
             "ring: a sequence of %lld tokens does not split into %d equal chunks (%s layout over %d ranks)",
             (long long)seq, nchunks, seq_layout == SeqLayout::kZigzag ? "zigzag" : "contiguous", W);
  MK_CHECK(check_ring_rows("ring", rows, W, seq, seq_layout));
  RingPlan& p = *out;
  p = RingPlan{};
  p.world = W;
  p.seq = seq;
  p.layout = seq_layout;
  p.causal = causal;
  p.rows = rows.empty() ? std::vector<int64_t>(size_t(W), seq / W) : rows;
  // The chunks' lengths in the global chunk order, then their first tokens.
  std::vector<int64_t> len(static_cast<size_t>(nchunks)), token0(static_cast<size_t>(nchunks) + 1, 0);
  for (int c = 0; c < nchunks; ++c) {
    if (seq_layout == SeqLayout::kZigzag) {
      const int r = c < W ? c : 2 * W - 1 - c;
      const int64_t first = (p.rows[size_t(r)] + 1) / 2;
      len[size_t(c)] = c < W ? first : p.rows[size_t(r)] - first;
    } else {
      len[size_t(c)] = p.rows[size_t(c)];
    }
    token0[size_t(c) + 1] = token0[size_t(c)] + len[size_t(c)];
  }
  p.chunks.assign(W, {});
  for (int r = 0; r < W; ++r) {
    const int cs[2] = {r, 2 * W - 1 - r};
    int64_t row0 = 0;
    for (int k = 0; k < (seq_layout == SeqLayout::kZigzag ? 2 : 1); ++k) {
      const int c = cs[k];
      p.chunks[r].push_back(SeqChunk{token0[size_t(c)], len[size_t(c)], c, row0});
      row0 += len[size_t(c)];
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

namespace {

// The work of every position (see ring_doc_work); cu checked by the caller.
std::vector<int64_t> position_work(const std::vector<int32_t>& cu, int64_t S, bool causal) {
  std::vector<int64_t> w(size_t(S), 0);
  if (cu.size() < 2) {
    for (int64_t p = 0; p < S; ++p) w[size_t(p)] = causal ? p + 1 : S;
    return w;
  }
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t p = cu[d]; p < cu[d + 1]; ++p) w[size_t(p)] = causal ? p - cu[d] + 1 : int64_t(cu[d + 1]) - cu[d];
  return w;
}

}  // namespace

std::vector<double> ring_doc_work(const RingPlan& plan, const std::vector<int32_t>& cu, bool causal) {
  const std::vector<int64_t> w = position_work(cu, plan.seq, causal);
  std::vector<double> out(size_t(plan.world), 0.0);
  for (int r = 0; r < plan.world; ++r)
    for (const SeqChunk& c : plan.chunks[size_t(r)])
      for (int64_t p = c.token0; p < c.token0 + c.tokens; ++p) out[size_t(r)] += double(w[size_t(p)]);
  return out;
}

Status ring_balanced_rows(const int32_t* cu_seqlens, int n_docs, int world, bool causal, std::vector<int64_t>* rows) {
  MK_REQUIRE(rows && cu_seqlens && n_docs >= 1 && world >= 1, Code::kInvalidArgument,
             "ring_balanced_rows: cu_seqlens %p, n_docs %d, world %d", static_cast<const void*>(cu_seqlens), n_docs,
             world);
  const std::vector<int32_t> cu(cu_seqlens, cu_seqlens + n_docs + 1);
  MK_REQUIRE(cu[0] == 0, Code::kInvalidArgument, "ring_balanced_rows: cu_seqlens[0] is %d, not 0", cu[0]);
  for (int d = 0; d < n_docs; ++d)
    MK_REQUIRE(cu[size_t(d) + 1] >= cu[size_t(d)], Code::kInvalidArgument,
               "ring_balanced_rows: cu_seqlens decreases at entry %d (%d after %d)", d + 1, cu[size_t(d) + 1],
               cu[size_t(d)]);
  const int64_t S = cu.back();
  MK_REQUIRE(S >= world, Code::kInvalidArgument, "ring_balanced_rows: %lld tokens for %d ranks (one each at least)",
             (long long)S, world);
  const std::vector<int64_t> w = position_work(cu, S, causal);
  // The least largest share: a binary search on it, each bound tried by a greedy split (the
  // longest prefix within the bound, rank by rank; splitting a share further never raises it).
  int64_t lo = 0, hi = 0;
  for (int64_t x : w) lo = std::max(lo, x), hi += x;
  auto shares_within = [&](int64_t cap) {
    int n = 1;
    int64_t sum = 0;
    for (int64_t x : w) {
      if (sum + x > cap) ++n, sum = 0;
      sum += x;
    }
    return n <= world;
  };
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (shares_within(mid)) hi = mid;
    else lo = mid + 1;
  }
  // The split at that bound, each rank as many tokens as fit while the later ranks keep one each.
  rows->assign(size_t(world), 0);
  int64_t p = 0;
  for (int r = 0; r < world; ++r) {
    int64_t sum = 0, n = 0;
    const int64_t keep = world - 1 - r;  // tokens the later ranks need
    while (p < S - keep && (n == 0 || (r == world - 1 || sum + w[size_t(p)] <= lo))) sum += w[size_t(p++)], ++n;
    (*rows)[size_t(r)] = n;
  }
  MK_REQUIRE(p == S, Code::kInternal, "ring_balanced_rows: split %lld of %lld tokens", (long long)p, (long long)S);
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
