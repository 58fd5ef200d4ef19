// CPU replay of the standalone collectives' programs (src/ops/collective/collective_plan.h).
//
// Every rank's program runs at once on host buffers (comm::Replay: a seeded random interleaving
// of each rank's communication slots and its proxy, three consecutive calls, ranks running ahead
// of each other). At the start of each call a rank's input workspace is filled with fresh random
// values, a function of (run seed, rank, call), as the launch's copy in leaves it, and every other
// buffer of the rank is poisoned: what the program reads must have been written in this call.
// When a rank's call ends its output is checked bit for bit against an independent reference:
// the gathered inputs (AG), or the fp32 sum in the documented order — by local index within each
// node, then the node partials in node order — rounded once to the output type (RS, AR).
//
// Mutation tests: valid programs (one and several nodes, staged and direct, every kind) are
// broken one site at a time — a dropped wait, a dropped signal, a changed wait count, a shortened
// copy/reduce/put, a destination moved — and every mutant must be rejected by the static
// accounting check or by a replay (up to test::kMutantReplays per mutant, cycling the slot
// counts 1..16 with held ops: tests/common/mutant_replay.h).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "src/comm/replay.h"
#include "src/ops/collective/collective_plan.h"
#include "tests/common/mutant_replay.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

using comm::BufRef;
using comm::Op;
using comm::OpKind;

struct Config {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  CollDType dtype = CollDType::kBF16;
  int W = 1, nodes = 1;
  bool strided = false, staged = false;
  int64_t count = 64, chunk = 16;
  int slots = 1;
  uint64_t seed = 0;  // from the run seed (seeded()); not part of the name
};
comm::Layout make_layout(const Config& c) {
  return c.strided ? comm::Layout::strided(c.W, c.nodes) : comm::Layout::uniform(c.W, c.nodes);
}
std::string config_name(const Config& c) {
  return std::string(collective_kind_name(c.kind)) + "_" + coll_dtype_name(c.dtype) + "_W" + std::to_string(c.W) +
         (c.strided ? "s" : "n") + std::to_string(c.nodes) + "_n" + std::to_string(c.count) + "_k" +
         std::to_string(c.chunk) + "_c" + std::to_string(c.slots) + (c.staged ? "_staged" : "");
}
void PrintTo(const Config& c, std::ostream* os) { *os << config_name(c); }
uint64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}
Config seeded(Config c) {
  c.seed = test::mix(test::test_seed(), name_hash(config_name(c)));
  return c;
}
std::string seed_note(const Config& c) {
  const std::string run = std::to_string(test::test_seed());
  return " [" + config_name(c) + ": replay seed " + std::to_string(c.seed) + " from run seed " + run +
         "; MK_TEST_SEED=" + run + " replays it]";
}

float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
uint16_t to_bf16(float f) {  // round to nearest even (no NaN here)
  uint32_t u = bits(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

std::vector<const comm::RankProgram*> rank_programs(const CollPlan& p) {
  std::vector<const comm::RankProgram*> v;
  for (const auto& rp : p.ranks) v.push_back(&rp);
  return v;
}

// The caller's side in the replay: inputs in, outputs checked.
class CollCheck : public comm::ReplayCompute {
 public:
  CollCheck(const CollPlan& p, uint64_t seed) : p_(p), seed_(seed) {}
  size_t units(int) const override { return 0; }
  int phases(int, size_t) const override { return 0; }
  const comm::Wait* waits(int, size_t, int, size_t* n) const override {
    *n = 0;
    return nullptr;
  }
  bool run(comm::Replay&, int, size_t, int) override { return true; }
  std::string unit_name(int, size_t) const override { return "none"; }

  // Element i of rank r's input in call e, as the data type holds it (exact in fp32).
  float input(int r, int e, int64_t i) const {
    const uint64_t h = test::mix(test::mix(seed_, uint64_t(r) * 1000003u + uint64_t(e)), uint64_t(i));
    // Sign, exponent in [2^-3, 2^3), a random mantissa: sums round, and a stale or misplaced
    // value shows.
    const uint32_t u = (uint32_t(h >> 63) << 31) | (uint32_t(124 + (h >> 40) % 6) << 23) | uint32_t(h & 0x7fffff);
    const float f = from_bits(u);
    return p_.dtype == CollDType::kBF16 ? from_bits(uint32_t(to_bf16(f)) << 16) : f;
  }
  // The reference of element i of the reduced data in call e: node sums in local order, then
  // the node partials in node order (fp32).
  float reduced(int e, int64_t i) const {
    const comm::Layout& L = p_.layout;
    float total = 0.f;
    for (int n = 0; n < L.nodes(); ++n) {
      float part = input(L.node_ranks[n][0], e, i);
      for (int l = 1; l < L.local(); ++l) part += input(L.node_ranks[n][l], e, i);
      total = n == 0 ? part : total + part;
    }
    return total;
  }

  void start_call(comm::Replay& r, int me, int e) override {
    const int64_t n = p_.in_elems();
    uint8_t* in = r.mem(me, BufRef{CBuf::kIn, me, 0}, uint64_t(n) * p_.esize());
    if (!in) return;
    for (int64_t i = 0; i < n; ++i) store(in, i, input(me, e, i));
    // Every other buffer of mine poisoned: nothing of an earlier call may be read.
    for (comm::BufId b = 0; b < p_.bufs.size(); ++b) {
      const comm::BufDecl& d = p_.bufs[b];
      if (b == CBuf::kIn || d.bytes == 0 || d.rank_token) continue;
      uint8_t* m = r.mem(me, BufRef{b, me, 0}, d.bytes);
      if (!m) return;
      memset(m, 0xff, d.bytes);  // NaN in fp32 and bf16
    }
  }

  bool finish_call(comm::Replay& r, int me, int e) override {
    const int64_t n = p_.out_elems();
    const comm::BufId ob = p_.kind == CollectiveKind::kAllReduce ? CBuf::kOut : CBuf::kUserOut;
    const uint8_t* out = r.mem(me, BufRef{ob, me, 0}, uint64_t(n) * p_.esize());
    if (!out) return false;
    for (int64_t i = 0; i < n; ++i) {
      float want;
      switch (p_.kind) {
        case CollectiveKind::kAllGather: want = input(int(i / p_.count), e, i % p_.count); break;
        case CollectiveKind::kReduceScatter: want = reduced(e, int64_t(me) * p_.count + i); break;
        default: want = reduced(e, i); break;
      }
      const uint32_t w = p_.dtype == CollDType::kBF16 ? to_bf16(want) : bits(want);
      const uint32_t got = load_bits(out, i);
      if (got != w) {
        char m[200];
        snprintf(m, sizeof m, "rank %d call %d: output element %lld is 0x%x, want 0x%x (%g)", me, e, (long long)i,
                 got, w, double(want));
        return r.fail(m);
      }
    }
    return true;
  }

 private:
  void store(uint8_t* m, int64_t i, float f) const {
    if (p_.dtype == CollDType::kBF16) {
      const uint16_t h = to_bf16(f);
      memcpy(m + 2 * i, &h, 2);
    } else {
      memcpy(m + 4 * i, &f, 4);
    }
  }
  uint32_t load_bits(const uint8_t* m, int64_t i) const {
    if (p_.dtype == CollDType::kBF16) {
      uint16_t h;
      memcpy(&h, m + 2 * i, 2);
      return h;
    }
    uint32_t u;
    memcpy(&u, m + 4 * i, 4);
    return u;
  }
  const CollPlan& p_;
  uint64_t seed_;
};

std::string check_static(const CollPlan& p) { return comm::check_static(p, rank_programs(p), {}, {}); }

// One replay of plan p (its own seed and options); "" when it passes.
std::string replay_once(const CollPlan& p, uint64_t data_seed, const comm::ReplayOptions& o) {
  CollCheck check(p, data_seed);
  comm::Replay r(p, rank_programs(p), &check, o);
  return r.run() ? "" : r.error();
}

// ---- The sweep.
std::vector<Config> sweep() {
  std::vector<Config> out;
  struct Lay {
    int W, nodes;
    bool strided;
  };
  auto base = [](CollectiveKind k, CollDType t, const Lay& l, bool staged) {
    Config c;
    c.kind = k;
    c.dtype = t;
    c.W = l.W;
    c.nodes = l.nodes;
    c.strided = l.strided;
    c.staged = staged;
    return c;
  };
  const Lay lays[] = {{1, 1, false}, {2, 1, false}, {3, 1, false}, {4, 1, false}, {8, 1, false}, {2, 2, false},
                      {4, 2, false}, {4, 2, true},  {6, 3, false}, {8, 2, false}, {8, 4, true}};
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce})
    for (CollDType t : {CollDType::kBF16, CollDType::kF32})
      for (const Lay& l : lays)
        for (bool staged : {false, true}) {
          if (staged && l.nodes == 1) continue;
          Config c = base(k, t, l, staged);
          // Several chunks per shard with a short tail, strict op order.
          c.count = 104, c.chunk = 32, c.slots = 1;
          out.push_back(c);
          // Many CTAs at once; an all-reduce count that leaves the last shards short or empty.
          c.count = k == CollectiveKind::kAllReduce ? 8 * (3 * l.W + 1) : 40;
          c.chunk = 16, c.slots = 6;
          out.push_back(c);
          // One chunk per shard (the default chunk).
          if (l.W <= 4) {
            c.count = 72, c.chunk = 0, c.slots = 3;
            out.push_back(c);
          }
        }
  // Final sums over more partials than one op's 16 buffers take: chains of links (17 nodes of
  // one: one link; 40 nodes: two links, the second not full; 9 nodes of 8, all-reduce: one link
  // of every partial and a last op of the accumulator alone into 8 outputs; 34 nodes of 2 across
  // strided nodes).
  const Lay chains[] = {{17, 17, false}, {40, 40, false}, {72, 9, false}, {34, 17, true}};
  for (CollectiveKind k : {CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce})
    for (CollDType t : {CollDType::kBF16, CollDType::kF32})
      for (const Lay& l : chains)
        for (bool staged : {false, true}) {
          Config c = base(k, t, l, staged);
          c.count = k == CollectiveKind::kAllReduce ? 8 * (2 * l.W + 1) : 24;
          c.chunk = 16, c.slots = 6;
          out.push_back(c);
        }
  return out;
}

class CollReplay : public ::testing::TestWithParam<Config> {};

TEST_P(CollReplay, ThreeCallsBitExact) {
  const Config c = seeded(GetParam());
  CollPlan p;
  MK_ASSERT_OK(build_coll_plan(c.kind, c.count, c.dtype, make_layout(c), c.chunk, c.staged, &p));
  ASSERT_EQ(p.net_staged, c.staged && c.nodes > 1);
  ASSERT_EQ(check_static(p), "") << seed_note(c);
  // Every rank has work, and the end-of-call op is last wherever another rank reads this one.
  for (int me = 0; me < c.W; ++me) ASSERT_FALSE(c.W > 1 && p.ranks[me].ops.empty()) << "rank " << me;
  for (int k = 0; k < 4; ++k) {
    comm::ReplayOptions o;
    o.seed = test::mix(c.seed, uint64_t(k));
    o.comm_slots = k == 0 ? c.slots : (k == 1 ? 1 : 16);
    o.calls = 3;
    o.speed_levels = 4;
    o.hold_one_in = k == 3 ? 16 : 0;
    const std::string err = replay_once(p, c.seed, o);
    ASSERT_EQ(err, "") << "replay " << k << " (" << o.comm_slots << " slots)" << seed_note(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CollReplay, ::testing::ValuesIn(test::strided(sweep())),
                         [](const ::testing::TestParamInfo<Config>& i) { return config_name(i.param); });

// ---- What the planner refuses, with what it says.
TEST(CollPlanErrors, RejectsBadCountsAndLayouts) {
  CollPlan p;
  const comm::Layout L = comm::Layout::uniform(4, 2);
  auto msg = [&](CollectiveKind k, int64_t count, CollDType t, const comm::Layout& l, int64_t chunk = 0) {
    Status s = build_coll_plan(k, count, t, l, chunk, false, &p);
    return s.ok() ? std::string("ok") : s.to_string();
  };
  EXPECT_NE(msg(CollectiveKind::kAllReduce, 0, CollDType::kBF16, L).find("count must be > 0"), std::string::npos);
  EXPECT_NE(msg(CollectiveKind::kAllGather, 12, CollDType::kF32, L).find("not a multiple of 8"), std::string::npos);
  EXPECT_NE(msg(CollectiveKind::kAllReduce, 64, CollDType(7), L).find("bf16 or fp32"), std::string::npos);
  EXPECT_NE(msg(CollectiveKind(9), 64, CollDType::kBF16, L).find("unknown kind"), std::string::npos);
  EXPECT_NE(msg(CollectiveKind::kAllReduce, 64, CollDType::kBF16, L, 1ll << 33).find("too large"), std::string::npos);
  comm::Layout bad = L;
  bad.node_ranks[1].pop_back();
  EXPECT_NE(msg(CollectiveKind::kAllReduce, 64, CollDType::kBF16, bad).find("same number of ranks"), std::string::npos);
  EXPECT_EQ(msg(CollectiveKind::kAllReduce, 64, CollDType::kBF16, L), "ok");
  // At most 16 buffers per op: the final sums over many nodes are chains (an all-reduce over 9
  // nodes of 8 ranks reads 9 partials and writes 8 ranks' outputs: 17), but a node sum is one op:
  // 16 ranks on one node (all-reduce: 16 inputs and 16 outputs), 16 ranks per node (16 inputs
  // and a partial) are refused.
  EXPECT_EQ(msg(CollectiveKind::kAllReduce, 8 * 72, CollDType::kBF16, comm::Layout::uniform(72, 9)), "ok");
  EXPECT_GT(p.chain_links, 0);
  EXPECT_EQ(msg(CollectiveKind::kAllReduce, 8 * 64, CollDType::kBF16, comm::Layout::uniform(64, 8)), "ok");
  EXPECT_EQ(p.chain_links, 0);
  EXPECT_EQ(msg(CollectiveKind::kReduceScatter, 64, CollDType::kF32, comm::Layout::uniform(256, 256)), "ok");
  EXPECT_NE(msg(CollectiveKind::kAllReduce, 8 * 16, CollDType::kBF16, comm::Layout::uniform(16, 1))
                .find("would touch 32 buffers"),
            std::string::npos);
  EXPECT_NE(msg(CollectiveKind::kReduceScatter, 64, CollDType::kBF16, comm::Layout::uniform(32, 2))
                .find("would touch 17 buffers"),
            std::string::npos);
  EXPECT_NE(msg(CollectiveKind::kAllReduce, 8 * 32, CollDType::kBF16, comm::Layout::uniform(32, 2))
                .find("would touch 17 buffers"),
            std::string::npos);
  CollectiveKind k;
  EXPECT_TRUE(parse_collective_kind("all_reduce", &k).ok());
  EXPECT_EQ(k, CollectiveKind::kAllReduce);
  EXPECT_NE(parse_collective_kind("broadcast", &k).to_string().find("unknown collective 'broadcast'"), std::string::npos);
}

// How many links a final sum takes: none while the partials and the destinations fit one op;
// then a first link of 15 partials, further links of 14, until the last op (the accumulator,
// what is left, the destinations) fits 16 buffers. Every op of every plan stays within 16.
TEST(CollPlanShape, FinalSumChains) {
  EXPECT_EQ(chain_links_for(15, 1), 0);
  EXPECT_EQ(chain_links_for(16, 1), 1);   // 15, then the accumulator + 1 + 1 output
  EXPECT_EQ(chain_links_for(29, 1), 1);   // 15, then 1 + 14 + 1
  EXPECT_EQ(chain_links_for(30, 1), 2);   // 15, 14, then 1 + 1 + 1
  EXPECT_EQ(chain_links_for(9, 8), 1);    // all 9, then the accumulator into 8 outputs
  EXPECT_EQ(chain_links_for(8, 8), 0);
  EXPECT_EQ(chain_links_for(40, 1), 2);   // 15, 14, then 1 + 11 + 1
  EXPECT_EQ(chain_links_for(40, 8), 3);   // 15, 14, 4 (the last op takes 1 + 7 + 8)
  for (CollectiveKind k : {CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce})
    for (auto [W, nodes] : {std::pair{17, 17}, {40, 40}, {72, 9}, {120, 15}, {256, 32}}) {
      CollPlan p;
      MK_ASSERT_OK(build_coll_plan(k, int64_t(8) * W, CollDType::kBF16, comm::Layout::uniform(W, nodes), 0, false, &p));
      int chained = 0;
      for (const auto& rp : p.ranks)
        for (const auto& op : rp.ops) {
          ASSERT_LE(op.srcs.size() + op.dsts.size(), size_t(comm::kMaxOpBuffers)) << op.what;
          chained += op.what.find(", link ") != std::string::npos;
        }
      EXPECT_EQ(chained, int(p.chunks.size()) * p.chain_links) << collective_kind_name(k) << " W " << W;
      EXPECT_EQ(p.chain_links > 0, nodes + (k == CollectiveKind::kAllReduce ? W / nodes : 1) > comm::kMaxOpBuffers);
    }
}

// Shards and chunks cover the data once, in order; the all-reduce's shards are 8-element aligned.
TEST(CollPlanShape, ShardsAndChunksTileTheData) {
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce})
    for (int W : {1, 3, 8})
      for (int64_t count : {8, 64, 8 * 1001}) {
        CollPlan p;
        MK_ASSERT_OK(build_coll_plan(k, count, CollDType::kBF16, comm::Layout::uniform(W, 1), 24, false, &p));
        const int64_t total = k == CollectiveKind::kAllReduce ? count : int64_t(W) * count;
        int64_t next = 0;
        for (int s = 0; s < W; ++s) {
          ASSERT_EQ(p.shard_lo[s], next);
          ASSERT_EQ(p.shard_lo[s] % 8, 0);
          int64_t e = 0;
          for (int c : p.shard_chunks[s]) {
            ASSERT_EQ(p.chunks[c].shard, s);
            ASSERT_EQ(p.chunks[c].elem0, e);
            ASSERT_GT(p.chunks[c].elems, 0);
            ASSERT_LE(p.chunks[c].elems, 24);
            ASSERT_EQ(p.chunks[c].elems % 8, 0);
            e += p.chunks[c].elems;
          }
          ASSERT_EQ(e, p.shard_hi[s] - p.shard_lo[s]);
          next = p.shard_hi[s];
        }
        ASSERT_EQ(next, total) << collective_kind_name(k) << " W " << W << " count " << count;
      }
}

// The default chunk: a 32nd of the largest shard within [8 Ki, 256 Ki] elements, the same on
// every rank (a function of count and world size).
TEST(CollPlanShape, DefaultChunks) {
  EXPECT_EQ(default_chunk_elems(8), 8 * 1024);
  EXPECT_EQ(default_chunk_elems(int64_t(4) << 20), int64_t(128) * 1024);  // 8 MiB of bf16: 32 chunks
  EXPECT_EQ(default_chunk_elems(int64_t(8) << 20), int64_t(256) * 1024);  // 16 MiB of bf16: 32 chunks
  EXPECT_EQ(default_chunk_elems(int64_t(1) << 30), 256 * 1024);
  EXPECT_EQ(default_chunk_elems(64 * 8 * 1024 + 8) % 8, 0);
  CollPlan p;
  // 64 MiB of bf16 over 4 ranks: 8 Mi elements per shard, 32 chunks each.
  MK_ASSERT_OK(build_coll_plan(CollectiveKind::kAllReduce, int64_t(32) << 20, CollDType::kBF16,
                               comm::Layout::uniform(4, 1), 0, false, &p));
  EXPECT_EQ(p.chunk_elems, int64_t(256) * 1024);
  EXPECT_EQ(p.chunks.size(), 4u * 32);
}

// ---- Mutation tests.
struct Mutant {
  std::string what;
  std::function<void(CollPlan&)> apply;
};

std::string op_name(const CollPlan& p, int r, size_t i) {
  return "rank " + std::to_string(r) + " op " + std::to_string(i) + " (" + p.ranks[r].ops[i].what + ")";
}

std::vector<Mutant> drop_wait_mutants(const CollPlan& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r)
    for (size_t i = 0; i < p.ranks[r].ops.size(); ++i)
      for (size_t j = 0; j < p.ranks[r].ops[i].waits.size(); ++j)
        out.push_back({op_name(p, r, i) + ": drop wait " + std::to_string(j),
                       [r, i, j](CollPlan& q) { auto& w = q.ranks[r].ops[i].waits; w.erase(w.begin() + long(j)); }});
  return out;
}
std::vector<Mutant> drop_signal_mutants(const CollPlan& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r)
    for (size_t i = 0; i < p.ranks[r].ops.size(); ++i)
      for (size_t j = 0; j < p.ranks[r].ops[i].signals.size(); ++j)
        out.push_back({op_name(p, r, i) + ": drop signal " + std::to_string(j),
                       [r, i, j](CollPlan& q) { auto& s = q.ranks[r].ops[i].signals; s.erase(s.begin() + long(j)); }});
  return out;
}
std::vector<Mutant> count_mutants(const CollPlan& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r)
    for (size_t i = 0; i < p.ranks[r].ops.size(); ++i)
      for (size_t j = 0; j < p.ranks[r].ops[i].waits.size(); ++j)
        out.push_back({op_name(p, r, i) + ": wait " + std::to_string(j) + " for one more",
                       [r, i, j](CollPlan& q) { q.ranks[r].ops[i].waits[j].mul += 1; }});
  return out;
}
// Data ops one 8-element group short, or writing their first destination 16 bytes further.
std::vector<Mutant> data_mutants(const CollPlan& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r)
    for (size_t i = 0; i < p.ranks[r].ops.size(); ++i) {
      const Op& op = p.ranks[r].ops[i];
      const bool sized = (op.kind == OpKind::kCopy || op.kind == OpKind::kNetPut) && op.bytes > 16;
      const bool reduce = op.kind == OpKind::kReduce && op.elems > 8;
      if (sized || reduce)
        out.push_back({op_name(p, r, i) + ": one group short", [r, i](CollPlan& q) {
                         Op& o = q.ranks[r].ops[i];
                         if (o.kind == OpKind::kReduce) o.elems -= 8;
                         else o.bytes -= 16;
                       }});
      if ((op.kind == OpKind::kCopy || op.kind == OpKind::kReduce) && !op.dsts.empty())
        out.push_back({op_name(p, r, i) + ": first destination moved", [r, i](CollPlan& q) {
                         q.ranks[r].ops[i].dsts[0].offset += 16;
                       }});
    }
  return out;
}

// Whether mutant m of base is rejected: by the static check, or by a replay within the budget.
// *replays: how many it took.
bool rejected(const CollPlan& base, const Config& c, const Mutant& m, uint64_t salt, uint64_t* replays) {
  CollPlan q = base;
  m.apply(q);
  *replays = 0;
  if (!check_static(q).empty()) return true;
  for (uint64_t k = 0; k < test::kMutantReplays; ++k) {
    ++*replays;
    const comm::ReplayOptions o = test::mutant_replay(test::mix(test::mix(c.seed, salt), k), c.slots, 1, k);
    if (!replay_once(q, c.seed, o).empty()) return true;
  }
  return false;
}

std::vector<Config> mutation_bases() {
  std::vector<Config> out;
  auto add = [&](CollectiveKind k, CollDType t, int W, int nodes, bool strided, bool staged) {
    Config c;
    c.kind = k;
    c.dtype = t;
    c.W = W;
    c.nodes = nodes;
    c.strided = strided;
    c.staged = staged;
    c.count = k == CollectiveKind::kAllReduce ? 8 * 3 * W : 24;
    c.chunk = 16;
    c.slots = 2;
    out.push_back(c);
  };
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce}) {
    add(k, CollDType::kBF16, 3, 1, false, false);
    add(k, CollDType::kF32, 4, 2, false, false);
    add(k, CollDType::kBF16, 4, 2, true, true);
    add(k, CollDType::kBF16, 6, 3, false, true);
  }
  return out;
}

class CollMutation : public ::testing::TestWithParam<Config> {
 protected:
  void expect_all_rejected(const char* cls, const std::vector<Mutant>& mutants, bool allow_none = false) {
    const Config c = seeded(GetParam());
    CollPlan p;
    MK_ASSERT_OK(build_coll_plan(c.kind, c.count, c.dtype, make_layout(c), c.chunk, c.staged, &p));
    ASSERT_EQ(check_static(p), "");
    // The unmutated program passes under the replays the mutants get.
    for (uint64_t k = 0; k < 64; ++k)
      ASSERT_EQ(replay_once(p, c.seed, test::mutant_replay(test::mix(c.seed, 77 + k), c.slots, 1, k)), "")
          << seed_note(c);
    const std::vector<Mutant> ms = test::strided(mutants);  // all but under MK_TEST_STRIDE
    if (ms.empty()) {
      EXPECT_TRUE(allow_none) << cls << ": no site";
      return;
    }
    std::vector<std::string> missed;
    uint64_t most = 0;
    for (size_t i = 0; i < ms.size(); ++i) {
      uint64_t n = 0;
      if (!rejected(p, c, ms[i], i, &n)) missed.push_back(ms[i].what);
      most = std::max(most, n);
    }
    printf("%s on %s: %zu mutants, %zu missed, at most %llu replays to reject one\n", cls, config_name(c).c_str(),
           ms.size(), missed.size(), (unsigned long long)most);
    std::string list;
    for (const auto& m : missed) list += "\n  " + m;
    EXPECT_TRUE(missed.empty()) << missed.size() << " of " << ms.size() << " " << cls << " mutants survived:" << list
                                << seed_note(c);
  }
  CollPlan plan() {
    const Config c = GetParam();
    CollPlan p;
    Status s = build_coll_plan(c.kind, c.count, c.dtype, make_layout(c), c.chunk, c.staged, &p);
    EXPECT_TRUE(s.ok()) << s.to_string();
    return p;
  }
};

TEST_P(CollMutation, DroppedWaitIsCaught) { expect_all_rejected("drop-wait", drop_wait_mutants(plan())); }
TEST_P(CollMutation, DroppedSignalIsCaught) { expect_all_rejected("drop-signal", drop_signal_mutants(plan())); }
TEST_P(CollMutation, ChangedCountIsCaught) { expect_all_rejected("count", count_mutants(plan())); }
TEST_P(CollMutation, ShortOrMisplacedDataIsCaught) { expect_all_rejected("data", data_mutants(plan())); }

INSTANTIATE_TEST_SUITE_P(Mutations, CollMutation, ::testing::ValuesIn(mutation_bases()),
                         [](const ::testing::TestParamInfo<Config>& i) { return config_name(i.param); });

}  // namespace
}  // namespace ops
}  // namespace mk
