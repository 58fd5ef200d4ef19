// MoE dispatch/combine on the CPU (src/ops/moe/moe_plan.h):
//  - the routing rules for W in {1, 2, 3, 4, 6, 8, 16} on 1, 2 and 4 nodes (between nodes the
//    hierarchical way: node slots repacked by the twins) with uniform, Zipf-skewed, all-local,
//    sparse (-1) routings and empty ranks: every rank's records packed
//    into slots, every destination's unpack, then combine's way back — every entry of every
//    token lands exactly once, at the row the layout says, with its row, and comes back to its
//    token's slot; counts and offsets add up; nothing overflows the worst-case capacity;
//  - the communication program replayed (src/comm/replay.h) for every layout (one node, several
//    nodes, strided), staged and direct, one or several pieces per slot, several communication
//    slots, over three calls with a new routing per call: each call's unpack on every rank
//    finds exactly this call's rows (call-tagged data), and the flag accounting holds;
//  - mutants (a dropped wait or signal, a shifted destination) are rejected.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "src/comm/replay.h"
#include "mkernel/ops/moe.h"
#include "src/ops/moe/moe_plan.h"
#include "src/ops/moe/moe_program.h"
#include "tests/common/moe_routing.h"
#include "tests/common/mutant_replay.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

using test::MoeRouting;

uint16_t xbits(uint64_t seed, int rank, int64_t t, int64_t c) { return test::moe_x_bits(seed, rank, t, c); }

struct World {
  MoeGeometry g;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> w;
  std::vector<int64_t> n;
  std::vector<SourceRoute> routes;
  std::vector<std::vector<uint16_t>> x;
};

void make_world(const MoeConfig& cfg, int W, MoeRouting kind, uint64_t seed, World* wd) {
  ASSERT_TRUE(moe_geometry(cfg, W, &wd->g).ok());
  wd->ids.resize(W), wd->w.resize(W), wd->n.resize(W), wd->routes.resize(W), wd->x.resize(W);
  for (int r = 0; r < W; ++r) {
    test::make_moe_routing(kind, seed, r, W, cfg.num_experts, cfg.topk, cfg.max_tokens_per_rank, &wd->ids[r], &wd->w[r],
                           &wd->n[r]);
    int64_t bad = -1;
    route_source(wd->g, wd->ids[r].data(), wd->n[r], &wd->routes[r], &bad);
    ASSERT_EQ(bad, 0);
    wd->x[r].resize(size_t(cfg.max_tokens_per_rank) * cfg.hidden);
    for (int64_t t = 0; t < cfg.max_tokens_per_rank; ++t)
      for (int64_t c = 0; c < cfg.hidden; ++c) wd->x[r][size_t(t) * cfg.hidden + c] = xbits(seed, r, t, c);
  }
}

// Every rank packs, every rank unpacks, combine goes back: every entry accounted for. With a
// layout of several nodes (and several ranks each), slots between nodes go the hierarchical
// way: the source's node slot, repacked by its twin.
void check_world(const MoeConfig& cfg, int W, const World& wd, const std::string& what,
                 const comm::Layout* layout = nullptr) {
  const MoeGeometry& g = wd.g;
  const int k = cfg.topk;
  const int64_t H = cfg.hidden;
  // slots[s][r]: what s sends r
  std::vector<std::vector<std::vector<uint8_t>>> slots(W, std::vector<std::vector<uint8_t>>(W));
  for (int s = 0; s < W; ++s)
    for (int r = 0; r < W; ++r) {
      slots[s][r].assign(size_t(g.slot_bytes), 0xcd);
      if (layout && layout->node_of[s] != layout->node_of[r]) {
        const MoeNodeGeometry ng = moe_node_geometry(g, layout->local());
        std::vector<uint8_t> ns(size_t(ng.nslot_bytes), 0xab);
        pack_node_slot(g, ng, *layout, s, layout->node_of[r], wd.x[s].data(), wd.ids[s].data(), wd.routes[s],
                       ns.data());
        repack_node_slot(g, ng, *layout, s, r, ns.data(), slots[s][r].data());
      } else {
        pack_record_slot(g, s, r, wd.x[s].data(), wd.ids[s].data(), wd.routes[s], slots[s][r].data());
      }
      uint64_t used;
      memcpy(&used, slots[s][r].data(), 8);
      ASSERT_LE(used, uint64_t(g.slot_bytes)) << what;
      ASSERT_EQ(used, uint64_t(g.hdr_bytes + int64_t(wd.routes[s].rec_tokens[r].size()) * g.rec_bytes));
    }
  std::vector<const int32_t*> idp(W);
  for (int r = 0; r < W; ++r) idp[r] = wd.ids[r].data();
  // Entries seen at destinations: [s][t * k + kk] -> (rank, combine row)
  std::vector<std::vector<int>> seen(W);
  for (int s = 0; s < W; ++s) seen[s].assign(size_t(wd.n[s]) * k, 0);
  // combine slots back: cback[r][s] rows tagged (r, row)
  std::vector<std::vector<std::vector<int64_t>>> cback(W, std::vector<std::vector<int64_t>>(W));
  for (int r = 0; r < W; ++r) {
    std::vector<const uint8_t*> in(W);
    for (int s = 0; s < W; ++s) in[s] = slots[s][r].data();
    std::vector<uint16_t> recv(size_t(g.recv_rows) * H, 0xffff);
    std::vector<int32_t> counts(g.El), offsets(g.El + 1), back(size_t(2 * g.recv_rows), -7);
    int64_t over = -1;
    unpack_slots(g, r, in, recv.data(), counts.data(), offsets.data(), back.data(), &over);
    ASSERT_EQ(over, 0) << what;
    DestLayout L;
    dest_layout(g, r, idp, wd.n, wd.routes, &L);
    ASSERT_EQ(counts, L.counts) << what << " rank " << r;
    ASSERT_EQ(offsets, L.offsets) << what << " rank " << r;
    ASSERT_LE(offsets[g.El], g.recv_rows);
    for (int le = 0; le < g.El; ++le) {
      ASSERT_EQ(offsets[le] % g.align, 0);
      ASSERT_GE(offsets[le + 1] - offsets[le], counts[le]);
    }
    for (int s = 0; s < W; ++s) cback[r][s].assign(size_t(wd.routes[s].ncomb[r]), -1);
    for (int64_t row = 0; row < offsets[g.El]; ++row) {
      const RowOrigin o = L.rows[size_t(row)];
      if (o.src < 0) continue;
      // the row, the entry's expert, the way back
      ASSERT_EQ(memcmp(&recv[size_t(row) * H], &wd.x[o.src][size_t(o.token) * H], size_t(H) * 2), 0)
          << what << " rank " << r << " row " << row;
      const int32_t e = wd.ids[o.src][size_t(o.token) * k + o.slot];
      ASSERT_EQ(e / g.El, r);
      ASSERT_GE(row, offsets[e - r * g.El]);
      ASSERT_LT(row, offsets[e - r * g.El] + counts[e - r * g.El]);
      ASSERT_EQ(back[2 * row], o.src);
      const int32_t cp = back[2 * row + 1];
      ASSERT_EQ(cp, wd.routes[o.src].cpos[size_t(o.token) * k + o.slot]);
      ASSERT_GE(cp, 0);
      ASSERT_LT(cp, int32_t(cback[r][o.src].size()));
      ASSERT_EQ(cback[r][o.src][size_t(cp)], -1) << "two rows back to one combine row";
      cback[r][o.src][size_t(cp)] = int64_t(r) << 32 | row;
      ++seen[o.src][size_t(o.token) * k + o.slot];
    }
  }
  // Every valid entry seen exactly once; combine finds its own row back.
  for (int s = 0; s < W; ++s)
    for (int64_t t = 0; t < wd.n[s]; ++t)
      for (int kk = 0; kk < k; ++kk) {
        const int32_t e = wd.ids[s][size_t(t) * k + kk];
        ASSERT_EQ(seen[s][size_t(t) * k + kk], e >= 0 ? 1 : 0) << what << " rank " << s << " token " << t;
        if (e < 0) continue;
        const int r = e / g.El;
        const int64_t tag = cback[r][s][size_t(wd.routes[s].cpos[size_t(t) * k + kk])];
        ASSERT_EQ(tag >> 32, r);
      }
  for (int r = 0; r < W; ++r)
    for (int s = 0; s < W; ++s)
      for (int64_t v : cback[r][s]) ASSERT_GE(v, 0) << "a combine row nobody fills";
}

TEST(MoeRouting, EveryEntryAccountedFor) {
  int cases = 0;
  for (int W : {1, 2, 3, 4, 6, 8, 16})
    for (int kind = 0; kind < test::kMoeRoutings; ++kind)
      for (int variant = 0; variant < 2; ++variant) {
        MoeConfig cfg;
        cfg.hidden = 16;
        cfg.num_experts = W * (variant ? 3 : 1);
        cfg.topk = variant ? 4 : 2;
        cfg.max_tokens_per_rank = variant ? 37 : 64;
        cfg.expert_align = variant ? 4 : 1;
        const uint64_t seed = test::mix(test::test_seed(), uint64_t(W) * 100 + kind * 10 + variant);
        World wd;
        ASSERT_NO_FATAL_FAILURE(make_world(cfg, W, MoeRouting(kind), seed, &wd));
        const std::string what = "W" + std::to_string(W) + " " + test::moe_routing_name(MoeRouting(kind)) + " v" +
                                 std::to_string(variant);
        ASSERT_NO_FATAL_FAILURE(check_world(cfg, W, wd, what));
        ++cases;
        // 2 and 4 nodes (several ranks each): the slots between nodes through the twins.
        for (int nodes : {2, 4}) {
          if (W % nodes || W / nodes < 2) continue;
          for (int strided = 0; strided < 2; ++strided) {
            const comm::Layout l = strided ? comm::Layout::strided(W, nodes) : comm::Layout::uniform(W, nodes);
            ASSERT_NO_FATAL_FAILURE(check_world(cfg, W, wd,
                                                what + " " + std::to_string(nodes) + " nodes" + (strided ? " strided" : ""),
                                                &l));
            ++cases;
          }
        }
      }
  printf("%d routings checked\n", cases);
}

// The small-batch dispatch's route (route_pack: each token's CTA counts the entries before its
// own, small_route_own / small_route_before) gives route_source's positions: every entry's erank
// and cpos, every record's index and combine base — with bad ids among them (left out by both).
TEST(MoeRouting, SmallRouteCountsMatchRouteSource) {
  int tokens = 0;
  for (int W : {1, 2, 3, 8})
    for (int kind = 0; kind < test::kMoeRoutings; ++kind)
      for (int variant = 0; variant < 3; ++variant) {
        MoeConfig cfg;
        cfg.hidden = 16;
        cfg.num_experts = W * (variant == 0 ? 1 : variant == 1 ? 3 : 8);
        cfg.topk = variant == 0 ? 1 : variant == 1 ? 4 : 8;
        if (cfg.topk > cfg.num_experts && kind == int(MoeRouting::kUniform)) cfg.topk = cfg.num_experts;
        cfg.max_tokens_per_rank = variant == 2 ? 200 : 37;
        MoeGeometry g;
        ASSERT_TRUE(moe_geometry(cfg, W, &g).ok());
        const uint64_t seed = test::mix(test::test_seed(), uint64_t(W) * 100 + kind * 10 + variant);
        for (int rank = 0; rank < W; rank += W > 2 ? W - 1 : 1) {
          std::vector<int32_t> ids;
          std::vector<float> w;
          int64_t n = 0;
          test::make_moe_routing(MoeRouting(kind), seed, rank, W, g.E, g.k, g.T, &ids, &w, &n);
          for (size_t i = 7; i < ids.size(); i += 23) ids[i] = (i / 23) % 2 ? g.E + int32_t(i % 5) : -2;
          SourceRoute route;
          int64_t bad = 0;
          route_source(g, ids.data(), n, &route, &bad);
          const std::string what = "W" + std::to_string(W) + " " + test::moe_routing_name(MoeRouting(kind)) +
                                   " v" + std::to_string(variant) + " rank " + std::to_string(rank);
          auto expert = [&](int64_t i) { return ids[i] >= 0 && ids[i] < g.E ? ids[i] : -1; };
          for (int64_t t = 0; t < n; ++t) {
            int32_t ex[32], rk[32], er[32], cp[32], rp[32];
            bool first[32];
            for (int kk = 0; kk < g.k; ++kk) {
              ex[kk] = expert(t * g.k + kk);
              rk[kk] = ex[kk] >= 0 ? ex[kk] / g.El : -1;
            }
            for (int kk = 0; kk < g.k; ++kk) {
              small_route_own(g.k, kk, ex, rk, &er[kk], &cp[kk], &first[kk]);
              rp[kk] = 0;
            }
            for (int64_t t2 = 0; t2 < t; ++t2)
              small_route_before(g.k, g.El, [&](int j) { return expert(t2 * g.k + j); }, ex, rk, first, er, cp, rp,
                                 [](int32_t* c, int32_t v) { *c += v; });
            for (int kk = 0; kk < g.k; ++kk) {
              const size_t i = size_t(t) * g.k + kk;
              if (ex[kk] < 0) {
                EXPECT_EQ(route.erank[i], -1) << what << " token " << t << " slot " << kk;
                EXPECT_FALSE(first[kk]);
                continue;
              }
              EXPECT_EQ(er[kk], route.erank[i]) << what << " token " << t << " slot " << kk;
              EXPECT_EQ(cp[kk], route.cpos[i]) << what << " token " << t << " slot " << kk;
              const auto& rec = route.rec_tokens[rk[kk]];
              const int64_t idx = std::find(rec.begin(), rec.end(), int32_t(t)) - rec.begin();
              ASSERT_LT(idx, int64_t(rec.size())) << what << " token " << t;
              bool is_first = true;
              for (int k2 = 0; k2 < kk; ++k2) is_first = is_first && rk[k2] != rk[kk];
              EXPECT_EQ(first[kk], is_first) << what << " token " << t << " slot " << kk;
              if (!first[kk]) continue;
              EXPECT_EQ(rp[kk], idx) << what << " token " << t << " slot " << kk;
              EXPECT_EQ(cp[kk], route.cbase[size_t(rk[kk]) * n + t]) << what << " token " << t << " slot " << kk;
            }
            ++tokens;
            if (HasFailure()) return;
          }
        }
      }
  printf("%d tokens checked\n", tokens);
}

TEST(MoeRouting, GeometryChecks) {
  MoeGeometry g;
  EXPECT_TRUE(moe_geometry({7168, 256, 8, 4096, 1, 0}, 8, &g).ok());
  EXPECT_EQ(g.El, 32);
  EXPECT_EQ(g.worst_rows, 8 * 4096 * 8);
  EXPECT_EQ(g.comb_per_src, 4096 * 8);
  EXPECT_FALSE(moe_geometry({7168, 255, 8, 4096, 1, 0}, 8, &g).ok());  // experts % W
  EXPECT_FALSE(moe_geometry({7000 + 4, 256, 8, 4096, 1, 0}, 8, &g).ok());  // hidden % 8
  EXPECT_FALSE(moe_geometry({7168, 256, 0, 4096, 1, 0}, 8, &g).ok());
  EXPECT_FALSE(moe_geometry({7168, 256, 8, 0, 1, 0}, 8, &g).ok());
  EXPECT_FALSE(moe_geometry({7168, 256, 8, 4096, 0, 0}, 8, &g).ok());
  // Bad ids are left out and counted.
  ASSERT_TRUE(moe_geometry({16, 4, 2, 3, 1, 0}, 2, &g).ok());
  const int32_t ids[6] = {0, 9, -1, -3, 3, 3};
  SourceRoute r;
  int64_t bad = 0;
  route_source(g, ids, 3, &r, &bad);
  EXPECT_EQ(bad, 2);
  EXPECT_EQ(r.erank[1], -1);
  EXPECT_EQ(r.ecount[3], 2);  // a repeated expert: two entries
  EXPECT_EQ(r.rec_tokens[1].size(), 1u);  // one record
}

// The operator's config rules before any GPU (MoeEp::can_implement): what create() refuses, with
// the variable named, and the only dtype there is.
TEST(MoeRouting, CanImplementBeforeAnyGpu) {
  EXPECT_TRUE(MoeEp::can_implement({7168, 256, 8, 4096, 1, 0}, 8).ok());
  EXPECT_TRUE(MoeEp::can_implement({2048, 128, 8, 1, 64, 1000}, 1).ok());
  struct Bad {
    MoeConfig cfg;
    int world;
    Code code;
    const char* names;
  };
  const Bad bad[] = {
      {{7168, 255, 8, 4096, 1, 0}, 8, Code::kInvalidArgument, "experts"},
      {{7004, 256, 8, 4096, 1, 0}, 8, Code::kInvalidArgument, "hidden"},
      {{7168, 256, 33, 4096, 1, 0}, 8, Code::kInvalidArgument, "topk"},
      {{7168, 256, 8, 0, 1, 0}, 8, Code::kInvalidArgument, "max_tokens_per_rank"},
      {{7168, 256, 8, 4096, 5000, 0}, 8, Code::kInvalidArgument, "expert_align"},
      {{7168, 256, 8, 4096, 1, -1}, 8, Code::kInvalidArgument, "recv_capacity"},
      {{7168, 256, 8, 4096, 1, 0}, 0, Code::kInvalidArgument, "world"},
      {{7168, 256, 8, 4096, 1, 0, gemm::DType::kF16}, 8, Code::kNotSupported, "bf16 only"},
  };
  for (const Bad& b : bad) {
    const Status s = MoeEp::can_implement(b.cfg, b.world);
    EXPECT_EQ(s.code(), b.code) << b.names << ": " << s.to_string();
    EXPECT_NE(s.message().find(b.names), std::string::npos) << s.to_string();
  }
}

// Throughput mode across nodes: the twin's repack of a node slot gives, byte for byte, the
// record slot the source would have sent that rank directly; every token crosses to a node once.
TEST(MoeRouting, NodeSlotsRepackToTheDirectRecords) {
  int cases = 0;
  for (int W : {4, 6, 8, 16})
    for (int nodes : {2, 3, 4})
      for (int strided = 0; strided < 2; ++strided) {
        if (W % nodes || W / nodes < 2) continue;
        const comm::Layout layout = strided ? comm::Layout::strided(W, nodes) : comm::Layout::uniform(W, nodes);
        for (int kind = 0; kind < test::kMoeRoutings; ++kind) {
          MoeConfig cfg{16, 2 * W, 4, 29, 1, 0};
          const uint64_t seed = test::mix(test::test_seed(), uint64_t(W) * 1000 + nodes * 10 + kind + 77 * strided);
          World wd;
          ASSERT_NO_FATAL_FAILURE(make_world(cfg, W, MoeRouting(kind), seed, &wd));
          const MoeGeometry& g = wd.g;
          const MoeNodeGeometry ng = moe_node_geometry(g, W / nodes);
          std::vector<uint8_t> nslot(size_t(ng.nslot_bytes)), direct(size_t(g.slot_bytes)), via(size_t(g.slot_bytes));
          for (int s = 0; s < W; ++s) {
            const auto per_node = node_tokens(g, layout, s, wd.ids[s].data(), wd.n[s]);
            for (int n = 0; n < nodes; ++n) {
              if (n == layout.node_of[s]) {
                ASSERT_TRUE(per_node[n].empty());
                continue;
              }
              // Once per token and node: every token with an expert there, and no other.
              std::vector<int32_t> want;
              for (int64_t t = 0; t < wd.n[s]; ++t) {
                bool there = false;
                for (int kk = 0; kk < cfg.topk; ++kk) {
                  const int32_t e = wd.ids[s][size_t(t) * cfg.topk + kk];
                  there |= e >= 0 && layout.node_of[e / g.El] == n;
                }
                if (there) want.push_back(int32_t(t));
              }
              ASSERT_EQ(per_node[n], want);
              pack_node_slot(g, ng, layout, s, n, wd.x[s].data(), wd.ids[s].data(), wd.routes[s], nslot.data());
              for (int d : layout.node_ranks[n]) {
                std::fill(direct.begin(), direct.end(), 0xcd);
                std::fill(via.begin(), via.end(), 0xcd);
                pack_record_slot(g, s, d, wd.x[s].data(), wd.ids[s].data(), wd.routes[s], direct.data());
                repack_node_slot(g, ng, layout, s, d, nslot.data(), via.data());
                uint64_t used;
                memcpy(&used, direct.data(), 8);
                ASSERT_EQ(memcmp(direct.data(), via.data(), size_t(used)), 0)
                    << "W" << W << " nodes " << nodes << (strided ? " strided" : "") << " "
                    << test::moe_routing_name(MoeRouting(kind)) << ": source " << s << " to rank " << d;
              }
            }
          }
          ++cases;
        }
      }
  printf("%d routings x layouts checked\n", cases);
}

// ---- the program, replayed ----

struct ProgConfig {
  int W = 2, nodes = 1;
  bool strided = false, staged = false;
  int pieces = 1, comm_slots = 1;
};
std::string name_of(const ProgConfig& c) {
  return "W" + std::to_string(c.W) + (c.strided ? "s" : "n") + std::to_string(c.nodes) + (c.staged ? "_staged" : "") +
         "_p" + std::to_string(c.pieces) + "_c" + std::to_string(c.comm_slots);
}
void PrintTo(const ProgConfig& c, std::ostream* os) { *os << name_of(c); }

const MoeConfig kReplayCfg{8, 0, 2, 5, 1, 0};  // experts: 2 per rank

MoeConfig replay_cfg(int W) {
  MoeConfig c = kReplayCfg;
  c.num_experts = 2 * W;
  return c;
}

// What both programs' compute sides share: the call's world (a new routing per call), and
// writing a packed slot with its pieces' run-time counts (moe_piece_count), as pack does.
class MoeComputeBase : public comm::ReplayCompute {
 public:
  MoeComputeBase(const comm::Program& p, const MoeConfig& cfg, int pieces, uint64_t seed)
      : p_(p), cfg_(cfg), pieces_(pieces), seed_(seed) {
    EXPECT_TRUE(moe_geometry(cfg, p.layout.world, &g_).ok());
  }
  // Call e's routing: in a third of the replays every call kFull (send slots full to their last
  // piece in consecutive calls: a piece overwritten by the next call before it was read shows
  // only then); otherwise every kind in turn from a point the seed picks.
  void world(int e, World* wd) const {
    const int kind = seed_ % 3 == 0 ? int(test::MoeRouting::kFull)
                                    : int((uint64_t(e) + seed_ / 3 % test::kMoeRoutings) % test::kMoeRoutings);
    make_world(cfg_, p_.layout.world, MoeRouting(kind), test::mix(seed_, uint64_t(e)), wd);
  }

 protected:
  // `bytes` of `slot` at `at`; with `counts` set, the counts of its pieces there.
  bool put_slot(comm::Replay& r, int me, const comm::BufRef& at, const std::vector<uint8_t>& slot, int64_t bytes,
                const comm::BufRef* counts) {
    uint8_t* m = r.mem(me, at, uint64_t(bytes));
    if (!m) return false;
    memcpy(m, slot.data(), size_t(bytes));
    if (!counts) return true;
    const int P = moe_pieces(bytes, pieces_);
    uint64_t used;
    memcpy(&used, slot.data(), 8);
    uint8_t* pc = r.mem(me, *counts, 8ull * P);
    if (!pc) return false;
    for (int q = 0; q < P; ++q) {
      const uint64_t v = moe_piece_count(bytes, pieces_, q, used);
      memcpy(pc + 8 * q, &v, 8);
    }
    return true;
  }
  // Source me's record slots for the ranks in `dests`: send slots (the own one in place).
  bool put_record_slots(comm::Replay& r, int me, const World& wd, const std::vector<int>& dests) {
    const int P = moe_pieces(g_.slot_bytes, pieces_);
    std::vector<uint8_t> slot(size_t(g_.slot_bytes));
    for (int d : dests) {
      pack_record_slot(g_, me, d, wd.x[me].data(), wd.ids[me].data(), wd.routes[me], slot.data());
      const comm::BufRef at{d == me ? MoeBuf::kRecv : MoeBuf::kSend, me, uint64_t(d) * uint64_t(g_.slot_bytes)};
      const comm::BufRef counts{MoeBuf::kPieceBytes, me, 8ull * uint64_t(d) * P};
      if (!put_slot(r, me, at, slot, g_.slot_bytes, d == me ? nullptr : &counts)) return false;
    }
    return true;
  }

  const comm::Program& p_;
  MoeConfig cfg_;
  int pieces_;
  uint64_t seed_;
  MoeGeometry g_;
};

// The kernels' side of dispatch: pack before the program (start_call: send slots, piece counts,
// the own slot in place), unpack after it (finish_call: every row this call's).
class MoeCompute : public MoeComputeBase {
 public:
  using MoeComputeBase::MoeComputeBase;
  size_t units(int) const override { return 0; }
  int phases(int, size_t) const override { return 1; }
  const comm::Wait* waits(int, size_t, int, size_t* n) const override {
    *n = 0;
    return nullptr;
  }
  bool run(comm::Replay&, int, size_t, int) override { return true; }
  std::string unit_name(int, size_t) const override { return "-"; }

  void start_call(comm::Replay& r, int me, int e) override {
    World wd;
    world(e, &wd);
    std::vector<int> all(size_t(p_.layout.world));
    for (int d = 0; d < p_.layout.world; ++d) all[size_t(d)] = d;
    put_record_slots(r, me, wd, all);
  }
  bool finish_call(comm::Replay& r, int me, int e) override {
    World wd;
    world(e, &wd);
    const int W = p_.layout.world;
    std::vector<const uint8_t*> in(W);
    for (int s = 0; s < W; ++s) {
      in[s] = r.mem(me, comm::BufRef{MoeBuf::kRecv, me, uint64_t(s) * uint64_t(g_.slot_bytes)}, uint64_t(g_.slot_bytes));
      if (!in[s]) return false;
      uint64_t used;
      memcpy(&used, in[s], 8);
      if (used != uint64_t(g_.hdr_bytes + int64_t(wd.routes[s].rec_tokens[me].size()) * g_.rec_bytes))
        return r.fail("slot of rank " + std::to_string(s) + ": header of another call");
    }
    std::vector<uint16_t> recv(size_t(g_.recv_rows) * g_.H, 0xffff);
    std::vector<int32_t> counts(g_.El), offsets(g_.El + 1), back(size_t(2 * g_.recv_rows), -1);
    int64_t over = 0;
    unpack_slots(g_, me, in, recv.data(), counts.data(), offsets.data(), back.data(), &over);
    std::vector<const int32_t*> idp(W);
    for (int s = 0; s < W; ++s) idp[s] = wd.ids[s].data();
    DestLayout L;
    dest_layout(g_, me, idp, wd.n, wd.routes, &L);
    if (over || counts != L.counts || offsets != L.offsets) return r.fail("counts or offsets of another call");
    for (int64_t row = 0; row < offsets[g_.El]; ++row) {
      const RowOrigin o = L.rows[size_t(row)];
      if (o.src < 0) continue;
      if (memcmp(&recv[size_t(row) * g_.H], &wd.x[o.src][size_t(o.token) * g_.H], size_t(g_.row_bytes)) != 0)
        return r.fail("row " + std::to_string(row) + " (rank " + std::to_string(o.src) + " token " +
                      std::to_string(o.token) + "): not this call's data");
    }
    return true;
  }
};

comm::Layout layout_of(const ProgConfig& c) {
  return c.strided ? comm::Layout::strided(c.W, c.nodes) : comm::Layout::uniform(c.W, c.nodes);
}
void build(const ProgConfig& c, comm::Program* p) {
  MoeGeometry g;
  ASSERT_TRUE(moe_geometry(replay_cfg(c.W), c.W, &g).ok());
  ASSERT_TRUE(build_moe_program(layout_of(c), g.slot_bytes, c.pieces, c.staged, "dispatch", p).ok());
}
std::vector<const comm::RankProgram*> programs(const comm::Program& p) {
  std::vector<const comm::RankProgram*> v;
  for (const auto& r : p.ranks) v.push_back(&r);
  return v;
}
// A replay of p under o (its seed also draws the calls' routings); compute slots: 1.
std::string replay(const comm::Program& p, const ProgConfig& c, const comm::ReplayOptions& o) {
  MoeCompute compute(p, replay_cfg(c.W), c.pieces, o.seed);
  comm::Replay rep(p, programs(p), &compute, o);
  return rep.run() ? "" : rep.error();
}
uint64_t seed_of(const ProgConfig& c, uint64_t salt) {
  return test::mix(test::mix(test::test_seed(), std::hash<std::string>{}(name_of(c))), salt);
}

std::vector<ProgConfig> sweep() {
  std::vector<ProgConfig> v;
  for (int W : {2, 3, 4, 6, 8, 16})  // one rank has no program (nothing to replay)
    for (int nodes : {1, 2, 3, 4}) {
      if (W % nodes) continue;
      for (int strided = 0; strided < (nodes > 1 && W / nodes > 1 ? 2 : 1); ++strided)
        for (int staged = 0; staged < (nodes > 1 ? 2 : 1); ++staged)
          for (int pieces : {1, 3}) v.push_back(ProgConfig{W, nodes, strided == 1, staged == 1, pieces, pieces == 3 ? 3 : 1});
    }
  return v;
}

class MoeReplay : public ::testing::TestWithParam<ProgConfig> {};

TEST_P(MoeReplay, ThreeCallsDeliverEveryRow) {
  const ProgConfig c = GetParam();
  comm::Program p;
  ASSERT_NO_FATAL_FAILURE(build(c, &p));
  ASSERT_EQ(comm::check_static(p, programs(p), {}, {}), "") << name_of(c);
  for (uint64_t k = 0; k < 4; ++k) {
    const uint64_t seed = seed_of(c, k);
    ASSERT_EQ(replay(p, c, comm::ReplayOptions{seed, c.comm_slots, 1, 3}), "") << name_of(c) << " replay seed " << seed
                                      << " (MK_TEST_SEED=" << test::test_seed() << " replays it)";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, MoeReplay, ::testing::ValuesIn(sweep()),
                         [](const ::testing::TestParamInfo<ProgConfig>& i) { return name_of(i.param); });

using Mutant = test::ProgramMutant;

// Mutants of a program's ops: every wait dropped (the implied ones marked), every signal dropped,
// and — with `shift_every` > 0 — the destination of a slot's first piece (the one carrying its
// header; offset a multiple of shift_every) moved 16 bytes on. Implied waits (a dropped copy
// changes nothing, whatever the number of communication CTAs — the library runs up to 1024,
// each taking the next op of the list, so no op is known to have finished before a later one
// starts):
//  - a wait on an arrival that an op of the same list (a relay) raises: a call ends only when
//    every op is done, that one included;
//  - staged, the wait for the proxy to finish reading the host mirrors: only this rank's next
//    call writes them, by puts that wait until the destination entered that call, which it does
//    only after its own call ended, i.e. after it received every slot of this call, i.e. after
//    the proxy read them.
std::vector<Mutant> op_mutants(const comm::Program& p, uint64_t shift_every) {
  std::vector<Mutant> ms;
  for (int r = 0; r < p.layout.world; ++r) {
    const auto& ops = p.ranks[r].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      const comm::Op& op = ops[i];
      const std::string site = "rank " + std::to_string(r) + " op " + std::to_string(i) + " (" + op.what + ")";
      for (size_t j = 0; j < op.waits.size(); ++j) {
        const comm::Wait& w = op.waits[j];
        bool implied = false;
        if (w.flag.region == MoeRegion::kArrived)
          for (const auto& o : ops)
            for (const auto& sg : o.signals) implied |= sg.flag.region == w.flag.region && sg.flag.index == w.flag.index;
        if (w.flag.region == MoeRegion::kSrcFree && p.net_staged) implied = true;
        ms.push_back({site + ": drop wait " + std::to_string(j),
                      [=](comm::Program& m) { auto& v = m.ranks[r].ops[i].waits; v.erase(v.begin() + j); }, implied});
      }
      for (size_t j = 0; j < op.signals.size(); ++j)
        ms.push_back({site + ": drop signal " + std::to_string(j),
                      [=](comm::Program& m) { auto& v = m.ranks[r].ops[i].signals; v.erase(v.begin() + j); }});
      if (shift_every && (op.kind == comm::OpKind::kCopy || op.kind == comm::OpKind::kNetPut) && op.bytes != 8 &&
          op.dsts[0].offset % shift_every == 0)
        ms.push_back({site + ": destination 16 bytes on",
                      [=](comm::Program& m) { m.ranks[r].ops[i].dsts[0].offset += 16; }});
    }
  }
  return ms;
}

// ---- the hierarchical program, replayed: pack (start_call), the twin's repack and the layout
// (compute units with their pools' waits and signals), every record slot checked at the end.
class MoeHierCompute : public MoeComputeBase {
 public:
  MoeHierCompute(const comm::Program& p, const MoeConfig& cfg, int pieces, uint64_t seed)
      : MoeComputeBase(p, cfg, pieces, seed) {
    ng_ = moe_node_geometry(g_, p.layout.local());
  }
  size_t units(int) const override { return 2; }  // repack, layout
  int phases(int, size_t) const override { return 1; }
  const comm::Wait* waits(int rank, size_t unit, int, size_t* n) const override {
    const MoeHierPools pl = moe_hier_pools(p_.layout, rank);
    const auto& w = p_.ranks[rank].waits;
    *n = unit == 0 ? pl.repack_waits : pl.layout_waits;
    return w.data() + (unit == 0 ? 0 : pl.repack_waits);
  }
  std::string unit_name(int, size_t unit) const override { return unit == 0 ? "repack" : "layout"; }
  void start_call(comm::Replay& r, int me, int e) override {
    World wd;
    world(e, &wd);
    const comm::Layout& L = p_.layout;
    if (!put_record_slots(r, me, wd, L.node_ranks[L.node_of[me]])) return;
    const int NP = moe_pieces(ng_.nslot_bytes, pieces_);
    std::vector<uint8_t> slot(size_t(ng_.nslot_bytes));
    for (int n = 0; n < L.nodes(); ++n) {
      if (n == L.node_of[me]) continue;
      pack_node_slot(g_, ng_, L, me, n, wd.x[me].data(), wd.ids[me].data(), wd.routes[me], slot.data());
      const comm::BufRef counts{MoeBuf::kNPieceBytes, me, 8ull * uint64_t(n) * NP};
      if (!put_slot(r, me, comm::BufRef{MoeBuf::kNSend, me, uint64_t(n) * uint64_t(ng_.nslot_bytes)}, slot,
                    ng_.nslot_bytes, &counts))
        return;
    }
  }
  bool run(comm::Replay& r, int me, size_t unit, int) override {
    if (unit != 0) return true;
    const comm::Layout& L = p_.layout;
    const int N = L.node_of[me];
    std::vector<uint8_t> slot(size_t(g_.slot_bytes));
    for (int n = 0; n < L.nodes(); ++n) {
      if (n == N) continue;
      const int s = L.node_ranks[n][L.local_of[me]];
      const uint8_t* ns = r.mem(me, comm::BufRef{MoeBuf::kNRecv, me, uint64_t(n) * uint64_t(ng_.nslot_bytes)},
                                uint64_t(ng_.nslot_bytes));
      if (!ns) return false;
      for (int d : L.node_ranks[N]) {
        repack_node_slot(g_, ng_, L, s, d, ns, slot.data());
        uint8_t* m = r.mem(me, comm::BufRef{MoeBuf::kRecv, d, uint64_t(s) * uint64_t(g_.slot_bytes)},
                           uint64_t(g_.slot_bytes));
        if (!m) return false;
        memcpy(m, slot.data(), slot.size());
      }
    }
    const MoeHierPools pl = moe_hier_pools(L, me);
    for (uint32_t i = 0; i < pl.repack_signals; ++i) r.raise(me, p_.ranks[me].signals[i]);
    return true;
  }
  bool finish_call(comm::Replay& r, int me, int e) override {
    World wd;
    world(e, &wd);
    std::vector<uint8_t> want(size_t(g_.slot_bytes));
    for (int s = 0; s < p_.layout.world; ++s) {
      pack_record_slot(g_, s, me, wd.x[s].data(), wd.ids[s].data(), wd.routes[s], want.data());
      uint64_t used;
      memcpy(&used, want.data(), 8);
      const uint8_t* got =
          r.mem(me, comm::BufRef{MoeBuf::kRecv, me, uint64_t(s) * uint64_t(g_.slot_bytes)}, uint64_t(g_.slot_bytes));
      if (!got) return false;
      if (memcmp(got, want.data(), size_t(used)) != 0)
        return r.fail("record slot of rank " + std::to_string(s) + ": not this call's records");
    }
    return true;
  }

 private:
  MoeNodeGeometry ng_;
};

void build_hier(const ProgConfig& c, comm::Program* p) {
  MoeGeometry g;
  ASSERT_TRUE(moe_geometry(replay_cfg(c.W), c.W, &g).ok());
  const comm::Layout l = layout_of(c);
  const MoeNodeGeometry ng = moe_node_geometry(g, l.local());
  ASSERT_TRUE(build_moe_hier_program(l, g.slot_bytes, ng.nslot_bytes, c.pieces, c.staged, p).ok());
}
std::string hier_static(const comm::Program& p) {
  std::vector<comm::ComputeRaise> raises;
  std::vector<comm::ComputeWait> waits;
  for (int r = 0; r < p.layout.world; ++r) {
    for (const auto& sg : p.ranks[r].signals) raises.push_back({r, sg, 1, "repack"});
    for (const auto& w : p.ranks[r].waits) waits.push_back({r, w, "repack or layout"});
  }
  return comm::check_static(p, programs(p), raises, waits);
}
// Compute slots: 2 (the repack and the layout).
std::string replay_hier(const comm::Program& p, const ProgConfig& c, const comm::ReplayOptions& o) {
  MoeHierCompute compute(p, replay_cfg(c.W), c.pieces, o.seed);
  comm::Replay rep(p, programs(p), &compute, o);
  return rep.run() ? "" : rep.error();
}

std::vector<ProgConfig> hier_sweep() {
  std::vector<ProgConfig> v;
  for (const ProgConfig& c : sweep())
    if (c.nodes > 1 && c.W / c.nodes > 1) v.push_back(c);
  return v;
}

class MoeHierReplay : public ::testing::TestWithParam<ProgConfig> {};

TEST_P(MoeHierReplay, ThreeCallsDeliverEverySlot) {
  const ProgConfig c = GetParam();
  comm::Program p;
  ASSERT_NO_FATAL_FAILURE(build_hier(c, &p));
  ASSERT_EQ(hier_static(p), "") << name_of(c);
  for (uint64_t k = 0; k < 4; ++k) {
    const uint64_t seed = seed_of(c, 500 + k);
    ASSERT_EQ(replay_hier(p, c, comm::ReplayOptions{seed, c.comm_slots, 2, 3}), "") << name_of(c) << " replay seed " << seed
                                           << " (MK_TEST_SEED=" << test::test_seed() << " replays it)";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, MoeHierReplay, ::testing::ValuesIn(hier_sweep()),
                         [](const ::testing::TestParamInfo<ProgConfig>& i) { return name_of(i.param); });

// Dropped waits (but the implied ones) and signals of the program and of the kernels' pools.
TEST(MoeHierMutation, EveryMutantIsRejected) {
  // Two communication slots: with one, ops complete in list order, and a relay op after a copy
  // would vouch for the copy (its twin's repack waits for it).
  for (const ProgConfig& c : {ProgConfig{4, 2, false, false, 1, 2}, ProgConfig{4, 2, true, true, 2, 2}}) {
    comm::Program p;
    ASSERT_NO_FATAL_FAILURE(build_hier(c, &p));
    std::vector<Mutant> ms = op_mutants(p, 0);
    // The pools: a kernel-side wait turned into no wait (mul 0 is "none" for the kernel; here a
    // wait on its own flag at 0).
    for (int r = 0; r < c.W; ++r)
      for (size_t j = 0; j < p.ranks[r].waits.size(); ++j)
        ms.push_back({"rank " + std::to_string(r) + " pool wait " + std::to_string(j) + ": waits for 0",
                      [=](comm::Program& m) { m.ranks[r].waits[j].mul = 0; }});
    test::rejected_mutants(p, ms, name_of(c), [&](const comm::Program& m, uint64_t k) {
      const std::string why = k == 0 ? hier_static(m) : "";
      return why.empty() ? replay_hier(m, c, test::mutant_replay(seed_of(c, 900 + k), c.comm_slots, 2, k)) : why;
    });
  }
}

// ---- mutants ----

class MoeMutation : public ::testing::TestWithParam<ProgConfig> {};

TEST_P(MoeMutation, EveryMutantIsRejected) {
  const ProgConfig c = GetParam();
  comm::Program p;
  ASSERT_NO_FATAL_FAILURE(build(c, &p));
  MoeGeometry g;
  ASSERT_TRUE(moe_geometry(replay_cfg(c.W), c.W, &g).ok());
  auto reject = [&](const comm::Program& m, uint64_t k) {
    const std::string why = k == 0 ? comm::check_static(m, programs(m), {}, {}) : "";
    return why.empty() ? replay(m, c, test::mutant_replay(seed_of(c, 100 + k), c.comm_slots, 1, k)) : why;
  };
  // (A few need hundreds of replays: a later piece's entry wait shows only when the slot is full,
  // kFull, in consecutive calls.)
  const int caught = test::rejected_mutants(p, op_mutants(p, uint64_t(g.slot_bytes)), name_of(c), reject);
  EXPECT_GT(caught, 0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeMutation,
                         ::testing::Values(ProgConfig{3, 1, false, false, 1, 1}, ProgConfig{2, 2, false, false, 1, 1},
                                           ProgConfig{2, 2, false, true, 2, 1}, ProgConfig{4, 2, true, true, 1, 1}),
                         [](const ::testing::TestParamInfo<ProgConfig>& i) { return name_of(i.param); });

}  // namespace
}  // namespace ops
}  // namespace mk
