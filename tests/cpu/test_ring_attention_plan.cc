// The ring-attention schedule (ops/ring_plan.h): coverage of every visible (query, key) pair
// exactly once, the ring's sends and receives, node crossings, and the zigzag balance. Sequence
// lengths: fixed ones and lengths drawn from the run seed (MK_TEST_SEED replays them).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "mkernel/ops/ring_attention.h"
#include "src/ops/ring_attention/ring_attention_plan.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

// Marks every (query token, key token) pair each rank computes over the whole ring and checks
// each visible pair is computed exactly once (causal: key <= query; else all pairs).
void check_coverage(const RingPlan& p) {
  const int64_t S = p.seq;
  std::vector<uint8_t> seen(size_t(S) * S, 0);
  for (int r = 0; r < p.world; ++r)
    for (const RingStep& st : p.steps[r])
      for (const RingPair& pr : st.pairs) {
        const SeqChunk& q = p.chunks[r][pr.q_chunk];
        const SeqChunk& k = p.chunks[st.kv_rank][pr.kv_chunk];
        for (int64_t i = 0; i < q.tokens; ++i)
          for (int64_t j = 0; j < k.tokens; ++j) {
            const int64_t qi = q.token0 + i, kj = k.token0 + j;
            const bool visible = pr.mask == BlockMask::kFull || kj <= qi;
            if (visible) ++seen[size_t(qi) * S + kj];
          }
      }
  for (int64_t qi = 0; qi < S; ++qi)
    for (int64_t kj = 0; kj < S; ++kj) {
      const int want = (!p.causal || kj <= qi) ? 1 : 0;
      ASSERT_EQ(int(seen[size_t(qi) * S + kj]), want) << "query " << qi << " key " << kj;
    }
}

TEST(RingPlan, CoversEveryVisiblePairOnce) {
  std::mt19937_64 rng(test::mix(test::test_seed(), 0x41A6));
  for (int W : {1, 2, 3, 4, 6, 8}) {
    for (int nodes : {1, 2, 4}) {
      if (W % nodes) continue;
      for (SeqLayout lay : {SeqLayout::kContiguous, SeqLayout::kZigzag})
        for (bool causal : {false, true})
          // 8 tokens per rank, and an even number from 2 to 40 drawn from the run seed.
          for (int64_t per_rank : {int64_t(8), int64_t(2 + 2 * (rng() % 20))}) {
            RingPlan p;
            ASSERT_TRUE(build_ring_plan(comm::Layout::uniform(W, nodes), per_rank * W, lay, causal, &p).ok());
            SCOPED_TRACE(testing::Message() << "W " << W << " nodes " << nodes << " zigzag " << int(lay) << " causal "
                                            << causal << " S " << per_rank * W << " (run seed " << test::test_seed()
                                            << ")");
            check_coverage(p);
          }
    }
  }
}

// Step t + 1's block is what the previous rank on the ring held at step t; every block visits
// every rank once; the node boundary is crossed by `nodes` ranks per step (never more).
TEST(RingPlan, RingMovesBlocksOncePerNodeBoundary) {
  for (int W : {2, 4, 8, 16}) {
    for (int nodes : {1, 2, 4}) {
      if (W % nodes) continue;
      const comm::Layout L = comm::Layout::uniform(W, nodes);
      RingPlan p;
      ASSERT_TRUE(build_ring_plan(L, int64_t(2) * W * 4, SeqLayout::kZigzag, true, &p).ok());
      for (int t = 0; t < W; ++t) {
        int crossings = 0;
        for (int r = 0; r < W; ++r) {
          const RingStep& st = p.steps[r][t];
          if (t == 0) {
            EXPECT_EQ(st.kv_rank, r);
          }
          if (t + 1 < W) {
            EXPECT_EQ(p.steps[st.send_to][t + 1].kv_rank, st.kv_rank) << "W " << W << " step " << t;
            EXPECT_EQ(p.steps[st.recv_from][t].send_to, r);
            crossings += st.send_crosses_node;
          } else {
            EXPECT_EQ(st.send_to, -1);
          }
        }
        if (t + 1 < W) {
          EXPECT_EQ(crossings, nodes > 1 ? nodes : 0) << "W " << W << " nodes " << nodes;
        }
      }
      for (int r = 0; r < W; ++r) {
        std::vector<int> got;
        for (const auto& st : p.steps[r]) got.push_back(st.kv_rank);
        std::sort(got.begin(), got.end());
        for (int i = 0; i < W; ++i) EXPECT_EQ(got[i], i);
      }
    }
  }
}

// Causal zigzag: every rank computes the same number of token pairs; contiguous: the last rank
// computes W times the first's (diagonal blocks counted in full).
TEST(RingPlan, ZigzagBalancesCausalWork) {
  for (int W : {2, 4, 8}) {
    RingPlan z, c;
    ASSERT_TRUE(build_ring_plan(comm::Layout::uniform(W, 1), int64_t(1024) * W, SeqLayout::kZigzag, true, &z).ok());
    ASSERT_TRUE(build_ring_plan(comm::Layout::uniform(W, 1), int64_t(1024) * W, SeqLayout::kContiguous, true, &c).ok());
    for (int r = 1; r < W; ++r) EXPECT_EQ(z.work[r], z.work[0]) << "W " << W << " rank " << r;
    EXPECT_EQ(c.work[W - 1], c.work[0] * W) << "W " << W;
  }
}

TEST(RingPlan, RejectsSequencesThatDoNotSplit) {
  RingPlan p;
  Status s = build_ring_plan(comm::Layout::uniform(4, 1), 1001, SeqLayout::kContiguous, false, &p);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("equal chunks"), std::string::npos) << s.to_string();
  s = build_ring_plan(comm::Layout::uniform(4, 1), 4 * 3, SeqLayout::kZigzag, false, &p);  // 12 % 8 != 0
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
}

// The operator's shape rules before any GPU (RingAttention::can_implement), each named.
TEST(RingPlan, CanImplementBeforeAnyGpu) {
  EXPECT_TRUE(RingAttention::can_implement({2, 32, 8, 128, 4096, SeqLayout::kZigzag, true}, 4).ok());
  EXPECT_TRUE(RingAttention::can_implement({1, 8, 8, 64, 1000, SeqLayout::kContiguous, false}, 1).ok());
  struct Bad {
    RingAttentionShape shape;
    int world;
    const char* names;
  };
  const Bad bad[] = {
      {{1, 8, 8, 96, 1024, SeqLayout::kContiguous, false}, 2, "head dimension"},
      {{1, 12, 8, 128, 1024, SeqLayout::kContiguous, false}, 2, "multiple of 8 key/value heads"},
      {{0, 8, 8, 128, 1024, SeqLayout::kContiguous, false}, 2, "empty shape"},
      {{1, 8, 8, 128, 1001, SeqLayout::kContiguous, false}, 4, "4 equal chunks"},
      {{1, 8, 8, 128, 12, SeqLayout::kZigzag, true}, 4, "8 equal chunks (zigzag"},
      {{1, 8, 8, 128, 1024, SeqLayout::kContiguous, false}, 0, "world size"},
  };
  for (const Bad& b : bad) {
    const Status s = RingAttention::can_implement(b.shape, b.world);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.names << ": " << s.to_string();
    EXPECT_NE(s.message().find(b.names), std::string::npos) << s.to_string();
  }
}

}  // namespace
}  // namespace ops
}  // namespace mk
