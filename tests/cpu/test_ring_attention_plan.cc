// The ring-attention schedule (ops/ring_plan.h): coverage of every visible (query, key) pair
// exactly once, the ring's sends and receives, node crossings, and the zigzag balance. Sequence
// lengths: fixed ones and lengths drawn from the run seed (MK_TEST_SEED replays them). Packed
// documents: the kernels' document windows and tile spans (src/attention/doc_window.h) against a
// scan over the documents' bounds, and the call rules of cu_seqlens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "mkernel/ops/ring_attention.h"
#include "src/attention/doc_window.h"
#include "src/attention/ring_roles.h"
#include "src/ops/ring_attention/ring_attention_plan.h"
#include "src/ops/ring_attention/ring_attention_program.h"
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

// Uneven shards drawn from the run seed: each rank 1 to 40 tokens (zigzag 2 to 40).
std::vector<int64_t> random_rows(std::mt19937_64& rng, int W, SeqLayout lay) {
  const int64_t least = lay == SeqLayout::kZigzag ? 2 : 1;
  std::vector<int64_t> rows;
  for (int r = 0; r < W; ++r) rows.push_back(least + int64_t(rng() % uint64_t(41 - least)));
  return rows;
}

// Uneven shards: every visible pair once; rank r's chunks hold rows[r] tokens, lie in its block
// one after the other (chunk r first), and the chunks in global order tile the sequence
// (zigzag: chunk r has ceil(rows[r] / 2) tokens).
TEST(RingPlan, UnevenShardsCoverEveryVisiblePairOnce) {
  std::mt19937_64 rng(test::mix(test::test_seed(), 0x5E7E));
  for (int W : {1, 2, 3, 4, 6}) {
    for (int nodes : {1, 2, 3}) {
      if (W % nodes) continue;
      for (SeqLayout lay : {SeqLayout::kContiguous, SeqLayout::kZigzag})
        for (bool causal : {false, true})
          for (int draw = 0; draw < 3; ++draw) {
            const std::vector<int64_t> rows = random_rows(rng, W, lay);
            int64_t S = 0;
            for (int64_t r : rows) S += r;
            RingPlan p;
            ASSERT_TRUE(build_ring_plan(comm::Layout::uniform(W, nodes), S, lay, causal, &p, rows).ok());
            SCOPED_TRACE(testing::Message() << "W " << W << " nodes " << nodes << " zigzag " << int(lay) << " causal "
                                            << causal << " S " << S << " (run seed " << test::test_seed() << ")");
            EXPECT_EQ(p.rows, rows);
            std::vector<const SeqChunk*> order(size_t(lay == SeqLayout::kZigzag ? 2 * W : W), nullptr);
            for (int r = 0; r < W; ++r) {
              int64_t row0 = 0;
              for (const SeqChunk& c : p.chunks[r]) {
                EXPECT_EQ(c.row0, row0) << "rank " << r;
                EXPECT_GE(c.tokens, 1) << "rank " << r;
                row0 += c.tokens;
                ASSERT_TRUE(c.index >= 0 && c.index < int(order.size()) && !order[size_t(c.index)]);
                order[size_t(c.index)] = &c;
              }
              EXPECT_EQ(row0, rows[size_t(r)]) << "rank " << r;
              if (lay == SeqLayout::kZigzag) {
                EXPECT_EQ(p.chunks[r][0].index, r);
                EXPECT_EQ(p.chunks[r][0].tokens, (rows[size_t(r)] + 1) / 2) << "rank " << r;
              }
            }
            int64_t t0 = 0;
            for (const SeqChunk* c : order) {
              ASSERT_NE(c, nullptr);
              EXPECT_EQ(c->token0, t0);
              t0 += c->tokens;
            }
            EXPECT_EQ(t0, S);
            check_coverage(p);
          }
    }
  }
}

TEST(RingPlan, RejectsBadShardRows) {
  RingPlan p;
  const comm::Layout L = comm::Layout::uniform(3, 1);
  struct Bad {
    std::vector<int64_t> rows;
    int64_t S;
    SeqLayout lay;
    const char* names;
  };
  const Bad bad[] = {
      {{10, 10}, 20, SeqLayout::kContiguous, "2 shard row counts for 3 ranks"},
      {{10, 0, 10}, 20, SeqLayout::kContiguous, "rank 1 holds 0 tokens"},
      {{10, 1, 10}, 21, SeqLayout::kZigzag, "rank 1 holds 1 tokens (each rank at least 2: the zigzag"},
      {{10, 10, 10}, 31, SeqLayout::kContiguous, "sum to 30, not the sequence's 31"},
      {{10, -4, 25}, 31, SeqLayout::kContiguous, "rank 1 holds -4 tokens"},
  };
  for (const Bad& b : bad) {
    const Status s = build_ring_plan(L, b.S, b.lay, false, &p, b.rows);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.names;
    EXPECT_NE(s.message().find(b.names), std::string::npos) << s.to_string();
  }
  // Rows that split a sequence no equal chunks would.
  EXPECT_TRUE(build_ring_plan(L, 31, SeqLayout::kZigzag, true, &p, {10, 11, 10}).ok());
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


// ---- balanced shards for packed documents (ring_balanced_rows, ring_doc_work) ----

// Random bounds 0 = cu[0] <= ... <= cu[n] = S (empty documents too).
std::vector<int32_t> random_bounds(std::mt19937_64& rng, int32_t S, int n_docs) {
  std::vector<int32_t> cu{0};
  for (int d = 1; d < n_docs; ++d) cu.push_back(int32_t(rng() % uint64_t(S + 1)));
  cu.push_back(S);
  std::sort(cu.begin(), cu.end());
  return cu;
}
// The keys position p sees, by a scan of the bounds (the last document holding p).
int64_t keys_seen(const std::vector<int32_t>& cu, int64_t p, bool causal) {
  int64_t lo = 0, hi = cu.back();
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    if (cu[d] <= p && p < cu[d + 1]) lo = cu[d], hi = cu[d + 1];
  return causal ? p - lo + 1 : hi - lo;
}

// Every rank's work is the keys its queries see, by a scan of every (query, key) pair.
TEST(RingBalance, DocWorkCountsTheVisiblePairs) {
  std::mt19937_64 rng(test::mix(test::test_seed(), 0xBA1));
  for (int W : {1, 2, 3})
    for (SeqLayout lay : {SeqLayout::kContiguous, SeqLayout::kZigzag})
      for (bool causal : {false, true}) {
        const int64_t S = 12 * W;
        RingPlan p;
        ASSERT_TRUE(build_ring_plan(comm::Layout::uniform(W, 1), S, lay, causal, &p).ok());
        const std::vector<int32_t> cu = random_bounds(rng, int32_t(S), 4);
        const std::vector<double> got = ring_doc_work(p, cu, causal);
        for (int r = 0; r < W; ++r) {
          double want = 0;
          for (const SeqChunk& c : p.chunks[size_t(r)])
            for (int64_t q = c.token0; q < c.token0 + c.tokens; ++q)
              for (int64_t k = 0; k < S; ++k) {
                int dq = -1, dk = -1;
                for (size_t d = 0; d + 1 < cu.size(); ++d) {
                  if (cu[d] <= q && q < cu[d + 1]) dq = int(d);
                  if (cu[d] <= k && k < cu[d + 1]) dk = int(d);
                }
                want += dq == dk && (!causal || k <= q);
              }
          EXPECT_EQ(got[size_t(r)], want) << "W " << W << " rank " << r << " causal " << causal;
        }
      }
}

// The balanced rows: world counts >= 1 summing to S whose largest share of the work is the least
// of every contiguous split (a dynamic program over all of them, small S), and no larger than
// even contiguous shards' on long packed sequences.
TEST(RingBalance, RowsGiveTheLeastLargestShare) {
  std::mt19937_64 rng(test::mix(test::test_seed(), 0xBA2));
  for (int trial = 0; trial < 60; ++trial) {
    const int W = 1 + int(rng() % 5);
    const int32_t S = int32_t(W + rng() % 60);
    const bool causal = trial % 2;
    const std::vector<int32_t> cu = random_bounds(rng, S, 1 + int(rng() % 6));
    std::vector<int64_t> rows;
    ASSERT_TRUE(ring_balanced_rows(cu.data(), int(cu.size()) - 1, W, causal, &rows).ok());
    ASSERT_EQ(int(rows.size()), W);
    std::vector<int64_t> pre(size_t(S) + 1, 0);
    for (int64_t p = 0; p < S; ++p) pre[size_t(p) + 1] = pre[size_t(p)] + keys_seen(cu, p, causal);
    int64_t at = 0, most = 0;
    for (int64_t r : rows) {
      ASSERT_GE(r, 1);
      most = std::max(most, pre[size_t(at + r)] - pre[size_t(at)]);
      at += r;
    }
    ASSERT_EQ(at, S);
    // best[k][p]: the least largest share of k ranks over the first p tokens, one token each at least.
    const int64_t inf = INT64_MAX / 4;
    std::vector<std::vector<int64_t>> best(size_t(W) + 1, std::vector<int64_t>(size_t(S) + 1, inf));
    best[0][0] = 0;
    for (int k = 1; k <= W; ++k)
      for (int64_t p = k; p <= S; ++p)
        for (int64_t q = k - 1; q < p; ++q)
          best[size_t(k)][size_t(p)] =
              std::min(best[size_t(k)][size_t(p)], std::max(best[size_t(k) - 1][size_t(q)], pre[size_t(p)] - pre[size_t(q)]));
    EXPECT_EQ(most, best[size_t(W)][size_t(S)]) << "trial " << trial << " W " << W << " S " << S;
  }
  // Long sequences of documents of 1 to 3000 tokens: the busiest rank's work over the mean.
  for (int W : {2, 4, 8})
    for (bool causal : {false, true}) {
      const int32_t S = 4096 * W;
      std::vector<int32_t> cu{0};
      while (cu.back() < S) cu.push_back(std::min<int32_t>(S, cu.back() + 1 + int32_t(rng() % 3000)));
      std::vector<int64_t> rows;
      ASSERT_TRUE(ring_balanced_rows(cu.data(), int(cu.size()) - 1, W, causal, &rows).ok());
      double worst[3];
      const std::vector<int64_t> none;
      for (int k = 0; k < 3; ++k) {
        RingPlan p;
        ASSERT_TRUE(build_ring_plan(comm::Layout::uniform(W, 1), S, k == 2 ? SeqLayout::kZigzag : SeqLayout::kContiguous,
                                    causal, &p, k == 0 ? rows : none)
                        .ok());
        const std::vector<double> w = ring_doc_work(p, cu, causal);
        double sum = 0, most = 0;
        for (double x : w) sum += x, most = std::max(most, x);
        worst[k] = most / (sum / W);
      }
      printf("W %d %s: busiest / mean work: balanced %.3f (largest shard %.2f x S/W), even contiguous %.3f, even "
             "zigzag %.3f\n", W, causal ? "causal" : "full", worst[0],
             double(*std::max_element(rows.begin(), rows.end())) * W / S, worst[1], worst[2]);
      EXPECT_LE(worst[0], worst[1]);
      EXPECT_LE(worst[0], 1.01) << "W " << W << " causal " << causal;
    }
}

TEST(RingBalance, RejectsMalformedBounds) {
  std::vector<int64_t> rows;
  const int32_t ok[] = {0, 10, 20}, first[] = {1, 10, 20}, down[] = {0, 12, 8};
  EXPECT_TRUE(ring_balanced_rows(ok, 2, 4, true, &rows).ok());
  struct Bad {
    const int32_t* cu;
    int n_docs, world;
    const char* names;
  };
  const Bad bad[] = {{first, 2, 2, "cu_seqlens[0] is 1"},
                     {down, 2, 2, "decreases at entry 2"},
                     {ok, 2, 21, "20 tokens for 21 ranks"},
                     {nullptr, 2, 2, "cu_seqlens"},
                     {ok, 0, 2, "n_docs 0"}};
  for (const Bad& b : bad) {
    const Status s = ring_balanced_rows(b.cu, b.n_docs, b.world, false, &rows);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.names;
    EXPECT_NE(s.message().find(b.names), std::string::npos) << s.to_string();
  }
}

// ---- packed documents (RingAttentionArgs::cu_seqlens) ----

// The document around every position by a scan over the bounds {0, S} and every entry of cu
// clamped to [0, S]: the largest bound <= pos and the smallest one > pos.
std::vector<attention::DocWindow> scan_windows(const std::vector<int32_t>& cu, int32_t S) {
  std::vector<int32_t> b{0, S};
  for (int32_t c : cu) b.push_back(std::min(std::max(c, 0), S));
  std::vector<attention::DocWindow> out(size_t(S), attention::DocWindow{0, S});
  for (int32_t pos = 0; pos < S; ++pos)
    for (int32_t x : b) {
      attention::DocWindow& w = out[size_t(pos)];
      if (x <= pos) w.lo = std::max(w.lo, x);
      if (x > pos) w.hi = std::min(w.hi, x);
    }
  return out;
}

// Non-decreasing bounds over about S tokens: documents of 1 to 300 tokens and longer ones, empty
// ones, and (some arrays) a first entry past 0, a last before S, entries past S.
std::vector<int32_t> random_packing(std::mt19937_64& g, int32_t S) {
  std::vector<int32_t> cu{int32_t(g() % 3 == 0 ? g() % 40 : 0)};
  while (cu.back() < S) {
    const uint64_t x = g();
    const int32_t len = x % 7 == 0 ? 0 : x % 5 == 0 ? int32_t(x % uint64_t(S / 2 + 1)) : int32_t(1 + x % 300);
    cu.push_back(cu.back() + len);
  }
  const int32_t before = cu.size() > 1 ? cu[cu.size() - 2] : cu[0];
  if (g() % 3 == 0) cu.back() = std::max(before, S - int32_t(g() % 50));  // a tail in no document
  else if (g() % 3 == 0) cu.back() = S + 17;                              // an entry past S (clamped)
  return cu;
}

TEST(RingDocuments, WindowIsTheDocumentAroundThePosition) {
  std::mt19937_64 g(test::mix(test::test_seed(), 0xd0c1));
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t S = int32_t(1 + g() % 3000);
    const std::vector<int32_t> cu = random_packing(g, S);
    const std::vector<attention::DocWindow> scan = scan_windows(cu, S);
    for (int32_t pos = 0; pos < S; ++pos) {
      const attention::DocWindow got = attention::doc_window(cu.data(), int(cu.size()) - 1, S, pos);
      const attention::DocWindow want = scan[size_t(pos)];
      ASSERT_EQ(got.lo, want.lo) << "trial " << trial << " S " << S << " position " << pos;
      ASSERT_EQ(got.hi, want.hi) << "trial " << trial << " S " << S << " position " << pos;
    }
  }
}

TEST(RingDocuments, WindowHoldsThePositionForAnyArray) {
  // Any int32 array (decreasing, negative, past S): a window around the position inside [0, S],
  // so a row always sees itself and no index leaves the sequence.
  std::mt19937_64 g(test::mix(test::test_seed(), 0xd0c2));
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t S = int32_t(1 + g() % 500);
    std::vector<int32_t> cu(1 + g() % 20);
    for (auto& c : cu) c = int32_t(int64_t(g() % 1400) - 400);
    for (int32_t pos = 0; pos < S; ++pos) {
      const attention::DocWindow w = attention::doc_window(cu.data(), int(cu.size()) - 1, S, pos);
      ASSERT_TRUE(0 <= w.lo && w.lo <= pos && pos < w.hi && w.hi <= S)
          << "trial " << trial << " position " << pos << ": [" << w.lo << ", " << w.hi << ")";
    }
  }
}

TEST(RingDocuments, TileSpansAreTheVisiblePairs) {
  // The spans a kernel visits for a tile — keys for a run of query rows (forward), queries for a
  // run of keys (backward) — are exactly the smallest and largest visible partner over all
  // positions: no visible pair is skipped and no tile outside is loaded.
  std::mt19937_64 g(test::mix(test::test_seed(), 0xd0c3));
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t S = int32_t(2 + g() % 1200);
    const std::vector<int32_t> cu = random_packing(g, S);
    const int n = int(cu.size()) - 1;
    const bool causal = g() % 2 == 0;
    const std::vector<attention::DocWindow> scan = scan_windows(cu, S);
    auto visible = [&](int32_t q, int32_t k) {
      const attention::DocWindow w = scan[size_t(q)];
      return k >= w.lo && k < w.hi && (!causal || k <= q);
    };
    const int32_t a = int32_t(g() % S), b = std::min<int32_t>(S - 1, a + int32_t(g() % 130));
    int64_t lo = 0, hi = 0;
    attention::doc_keys_of_rows(attention::doc_window(cu.data(), n, S, a), attention::doc_window(cu.data(), n, S, b),
                                b, causal, &lo, &hi);
    int64_t want_lo = S, want_hi = 0;
    for (int32_t q = a; q <= b; ++q)
      for (int32_t k = 0; k < S; ++k)
        if (visible(q, k)) want_lo = std::min<int64_t>(want_lo, k), want_hi = std::max<int64_t>(want_hi, k + 1);
    ASSERT_EQ(lo, want_lo) << "trial " << trial << " rows [" << a << ", " << b << "] causal " << causal;
    ASSERT_EQ(hi, want_hi) << "trial " << trial << " rows [" << a << ", " << b << "] causal " << causal;
    attention::doc_rows_of_keys(attention::doc_window(cu.data(), n, S, a), attention::doc_window(cu.data(), n, S, b),
                                a, causal, &lo, &hi);
    want_lo = S, want_hi = 0;
    for (int32_t k = a; k <= b; ++k)
      for (int32_t q = 0; q < S; ++q)
        if (visible(q, k)) want_lo = std::min<int64_t>(want_lo, q), want_hi = std::max<int64_t>(want_hi, q + 1);
    ASSERT_EQ(lo, want_lo) << "trial " << trial << " keys [" << a << ", " << b << "] causal " << causal;
    ASSERT_EQ(hi, want_hi) << "trial " << trial << " keys [" << a << ", " << b << "] causal " << causal;
  }
}

TEST(RingDocuments, CallRules) {
  const RingAttentionShape one{1, 8, 8, 128, 4096, SeqLayout::kZigzag, true};
  const int32_t* cu = reinterpret_cast<const int32_t*>(uintptr_t(1) << 32);  // never dereferenced
  EXPECT_TRUE(check_ring_documents("ring_attention", one, nullptr, 0).ok());
  EXPECT_TRUE(check_ring_documents("ring_attention", one, cu, 5).ok());
  struct Case {
    RingAttentionShape s;
    const int32_t* cu;
    int n;
    const char* says;
  } cases[] = {
      {one, nullptr, 3, "n_docs 3 without cu_seqlens"},
      {one, cu, 0, "n_docs 0 (at least 1)"},
      {one, cu + 0, -2, "n_docs -2"},
      {one, reinterpret_cast<const int32_t*>(uintptr_t(1) << 32 | 2), 4, "4-byte aligned"},
      {RingAttentionShape{2, 8, 8, 128, 4096, SeqLayout::kZigzag, true}, cu, 4, "need B = 1, not 2"},
      {RingAttentionShape{1, 8, 8, 128, int64_t(1) << 32, SeqLayout::kContiguous, false}, cu, 4, "4294967296 tokens"},
  };
  for (const Case& c : cases) {
    const Status st = check_ring_documents("ring_attention", c.s, c.cu, c.n);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << c.says;
    EXPECT_NE(st.message().find(c.says), std::string::npos) << st.to_string();
  }
}


// The backward's roles (attention::ring_role): exactly C of G CTAs communicate, the compute CTAs'
// slots are 0 .. G - C - 1 once each in index order, and every first part of the grid holds
// both roles in proportion — what a rank that MPS left without its last CTAs needs (with the
// communication CTAs first, a first part of C CTAs had no compute CTA at all). Every grid up to
// 160 CTAs, every count.
TEST(RingRoles, InterleavedSoEveryFirstPartHoldsBothRoles) {
  for (int G = 1; G <= 160; ++G)
    for (int C = 0; C <= G; ++C) {
      int comm = 0, compute = 0;
      for (int i = 0; i < G; ++i) {
        const attention::RingRole r = attention::ring_role(i, C, G);
        if (r.comm) {
          ++comm;
        } else {
          ASSERT_EQ(r.compute_slot, compute) << "G " << G << " C " << C << " CTA " << i;
          ++compute;
        }
        const int L = i + 1;  // the first L CTAs
        ASSERT_GE(comm, L * C / G) << "G " << G << " C " << C << " first " << L;
        ASSERT_GE(compute, L * (G - C) / G) << "G " << G << " C " << C << " first " << L;
      }
      ASSERT_EQ(comm, C) << "G " << G;
      ASSERT_EQ(compute, G - C) << "G " << G;
      if (C > 0) {
        EXPECT_TRUE(attention::ring_role(0, C, G).comm) << "G " << G << " C " << C;
      }
    }
  // The matrix's launch that timed out: 16 of 20 communicating; its short ranks ran 10-16 CTAs.
  int compute = 0;
  for (int i = 0; i < 10; ++i) compute += attention::ring_role(i, 16, 20).comm ? 0 : 1;
  EXPECT_EQ(compute, 2);
}

}  // namespace
}  // namespace ops
}  // namespace mk
