// Ring attention's communication program (src/ops/ring_attention/ring_attention_program.h) replayed on the
// CPU through the same replayer as the GEMM collectives (src/comm/replay.h): every rank's program
// at once, random interleavings of its communication slots, its kernel's steps and its proxy, over
// three calls, in every layout (one node, several nodes of one or more ranks, ranks of a node not
// consecutive), staged and direct, with blocks in one piece or many. The caller's K/V are filled
// per call with words that name rank, call, K or V and position; every step the kernel computes
// checks, when its waits let it run, that the block it reads is exactly the one the plan says
// (rank-tagged, this call's), and every call ends with every slot holding this call's blocks.
// The flag accounting goes through the static check first. Mutants of valid programs (a dropped
// wait or signal, a shortened or shifted copy or put) must be rejected by one of the two.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "src/comm/program_builder.h"
#include "src/comm/replay.h"
#include "src/ops/ring_attention/ring_attention_program.h"
#include "tests/common/mutant_replay.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

struct RingConfig {
  int W = 2, nodes = 1;
  bool strided = false;  // node n holds ranks n, n + nodes, ...
  bool staged = false;
  bool zigzag = false, causal = false;
  int B = 1;
  int64_t S_l = 64;
  int chunk_tokens = 64;
  int comm_slots = 1, unit_slots = 1;
  bool backward = false;  // with the backward's dK/dV sums (3 key blocks per chunk, pieces of 2)
  std::vector<int64_t> rows = {};  // uneven shards (S_l: unused), or empty
  int kb_per_chunk = 3, kb_per_piece = 2;  // backward: key blocks per chunk and per dK/dV piece
};
std::string rows_name(const std::vector<int64_t>& rows) {
  std::string s = rows.empty() ? "" : "_rows";
  for (int64_t r : rows) s += "_" + std::to_string(r);
  return s;
}
std::string name_of(const RingConfig& c) {
  return "W" + std::to_string(c.W) + (c.strided ? "s" : "n") + std::to_string(c.nodes) + (c.staged ? "_staged" : "") +
         (c.zigzag ? "_zigzag" : "_contig") + (c.causal ? "_causal" : "") + "_B" + std::to_string(c.B) + "_S" +
         std::to_string(c.S_l) + "_ct" + std::to_string(c.chunk_tokens) + "_c" + std::to_string(c.comm_slots) + "_u" +
         std::to_string(c.unit_slots) + (c.backward ? "_bwd" : "") +
         (c.backward && (c.kb_per_chunk != 3 || c.kb_per_piece != 2)
              ? "_kb" + std::to_string(c.kb_per_chunk) + "p" + std::to_string(c.kb_per_piece)
              : "") +
         rows_name(c.rows);
}
void PrintTo(const RingConfig& c, std::ostream* os) { *os << name_of(c); }

comm::Layout layout_of(const RingConfig& c) {
  return c.strided ? comm::Layout::strided(c.W, c.nodes) : comm::Layout::uniform(c.W, c.nodes);
}

struct Built {
  RingPlan plan;
  RingProgram prog;
};
void build(const RingConfig& c, Built* b) {
  const comm::Layout l = layout_of(c);
  int64_t S = c.S_l * c.W, S_l = c.S_l;
  if (!c.rows.empty()) {
    S = 0, S_l = 0;
    for (int64_t r : c.rows) S += r, S_l = std::max(S_l, r);
  }
  ASSERT_TRUE(
      build_ring_plan(l, S, c.zigzag ? SeqLayout::kZigzag : SeqLayout::kContiguous, c.causal, &b->plan, c.rows).ok());
  RingGeometry g;
  g.B = c.B;
  g.S_l = S_l;
  g.rows = c.rows;
  g.row_bytes = 2 * 64 * 2;  // Hkv 2, D 64
  g.chunk_tokens = c.chunk_tokens;
  g.pieces = int((S_l + c.chunk_tokens - 1) / c.chunk_tokens);
  if (c.backward) {
    g.backward = true;
    g.hkv = 2;
    g.tile_bytes = 48;  // the program does not look inside a tile
    g.chunks = c.zigzag ? 2 : 1;
    g.kb_per_chunk = c.kb_per_chunk;
    g.kb_per_piece = c.kb_per_piece;
    g.dkv_part_bytes = 64;  // pieces of 96 and 192 bytes: sums on the node in 2 and 3 parts
    if (!c.rows.empty()) {
      // Uneven: the longest chunk has 3 key blocks of kbt tokens, the others as many as their
      // tokens need (1 to 3): pieces of 2, 1 or none.
      int64_t longest = 0;
      for (const auto& cs : b->plan.chunks)
        for (const SeqChunk& ch : cs) longest = std::max(longest, ch.tokens);
      const int64_t kbt = (longest + 2) / 3;
      for (const auto& cs : b->plan.chunks)
        for (const SeqChunk& ch : cs) g.chunk_kbs.push_back(int((ch.tokens + kbt - 1) / kbt));
    }
  }
  ASSERT_TRUE(build_ring_program(b->plan, l, g, c.staged, &b->prog).ok());
}

std::vector<const comm::RankProgram*> programs(const RingProgram& p) {
  std::vector<const comm::RankProgram*> v;
  for (const auto& r : p.ranks) v.push_back(&r);
  return v;
}

// The word at index i of rank r's K (kv 0) or V (kv 1) in call e.
uint32_t tag(int r, int e, int kv, uint64_t i) {
  return uint32_t(test::mix(test::mix(uint64_t(r) * 977 + uint64_t(e), uint64_t(kv)), i));
}

// The contribution of rank r's kernel in call e to float i of block blk's dK/dV (backward):
// small integers, so that any order of fp32 sums is exact.
float part_value(int r, int e, int blk, uint64_t i) {
  return float(1 + test::mix(test::mix(uint64_t(r) * 131 + uint64_t(e), uint64_t(blk) + 7), i) % 61);
}

// The kernel's side: per call, the steps that compute something (each reads one block after its
// arrival waits; step 0 reads the caller's own K/V). Backward: one unit per (step, batch, dK/dV
// piece) that the rank computes, which checks the block it reads, writes its tiles of the piece
// into part and raises the piece's ready flag once per tile, as the kernel's items do. Which
// pieces a step computes and how many tiles each has come from the plan and the chunks' key
// blocks here (kernel_kbs), not from the program's own counts.
class RingCompute : public comm::ReplayCompute {
 public:
  RingCompute(const RingPlan& plan, const RingProgram& p) : plan_(plan), p_(p) {
    units_.resize(plan.world);
    const RingGeometry& g = p.geo;
    for (int r = 0; r < plan.world; ++r)
      for (int t = 0; t < plan.world; ++t) {
        if (plan.steps[r][t].pairs.empty()) continue;
        if (!g.backward) {
          units_[r].push_back({t, 0, -1});
          continue;
        }
        const int blk = plan.steps[r][t].kv_rank;
        for (int b = 0; b < g.B; ++b)
          for (int dp = 0; dp < g.dpieces(); ++dp) {
            bool pair = false;
            for (const auto& pr : plan.steps[r][t].pairs) pair = pair || pr.kv_chunk == g.dpiece_chunk(dp);
            if (pair && kernel_kbs(blk, dp) > 0) units_[r].push_back({t, b, dp});
          }
      }
  }
  // Key blocks of piece dp of block blk as the kernel's items cover it: those of the piece's
  // range that its chunk has (the chunk's key blocks: chunk_kbs, or kb_per_chunk).
  int kernel_kbs(int blk, int dp) const {
    const RingGeometry& g = p_.geo;
    const int chunk = dp / g.dpieces_per_chunk(), first = (dp % g.dpieces_per_chunk()) * g.kb_per_piece;
    const int have = g.chunk_kbs.empty() ? g.kb_per_chunk : g.chunk_kbs[size_t(blk * g.chunks + chunk)];
    return std::max(0, std::min(g.kb_per_piece, have - first));
  }
  size_t units(int rank) const override { return units_[rank].size(); }
  int phases(int, size_t) const override { return 1; }
  const comm::Wait* waits(int rank, size_t unit, int, size_t* n) const override {
    const RingRank& rp = p_.ranks[rank];
    const int t = units_[rank][unit].t;
    *n = rp.step_waits[t];
    return rp.waits.data() + rp.step_wait0[t];
  }
  std::string unit_name(int rank, size_t unit) const override {
    const Unit& u = units_[rank][unit];
    std::string s = "step " + std::to_string(u.t) + " (block of rank " + std::to_string(plan_.steps[rank][u.t].kv_rank) + ")";
    if (u.dp >= 0) s += " batch " + std::to_string(u.b) + " dK/dV piece " + std::to_string(u.dp);
    return s;
  }
  // The caller's K/V hold this rank's rows (words tagged by rank, call, K or V and index); past
  // them, up to the declared size (the largest block), a poison word that no read may carry.
  void start_call(comm::Replay& r, int me, int e) override {
    for (int kv = 0; kv < 2; ++kv) {
      uint8_t* m = r.mem(me, comm::BufRef{comm::BufId(kv ? RingBuf::kUserV : RingBuf::kUserK), me, 0}, slot_block());
      for (uint64_t i = 0; m && i < slot_block() / 4; ++i) {
        const uint32_t w = i < user_block(me) / 4 ? tag(me, e, kv, i) : kPoison;
        memcpy(m + 4 * i, &w, 4);
      }
    }
  }
  bool run(comm::Replay& r, int me, size_t unit, int) override {
    const Unit& u = units_[me][unit];
    const int blk = plan_.steps[me][u.t].kv_rank;
    if (!check_block(r, me, blk, u.t == 0)) return false;
    if (u.dp < 0) return true;
    const RingGeometry& g = p_.geo;
    const uint64_t off = g.tile_offset(blk, u.b, g.dpiece_kb0(u.dp), 0);
    const uint64_t tiles = uint64_t(kernel_kbs(blk, u.dp)) * g.hkv;
    const uint64_t bytes = tiles * g.tile_bytes;
    uint8_t* m = r.mem(me, comm::BufRef{RingBuf::kPart, me, off}, bytes);
    if (!m) return false;
    for (uint64_t i = 0; i < bytes / 4; ++i) {
      const float v = part_value(me, r.epoch(me), blk, (off - uint64_t(blk) * g.dkv_block_bytes()) / 4 + i);
      memcpy(m + 4 * i, &v, 4);
    }
    const uint32_t idx = p_.dkv_index(blk, u.b, u.dp);
    r.raise(me, comm::add_to(RingRegion::kReady, me, idx, uint32_t(tiles)));
    return true;
  }
  bool finish_call(comm::Replay& r, int me, int e) override {
    for (int t = 1; t < plan_.world; ++t)
      if (!check_block(r, me, plan_.steps[me][t].kv_rank, false)) return false;
    return !p_.geo.backward || check_dkv(r, me, e);
  }
  // The raises of the units, for the static check.
  std::vector<comm::ComputeRaise> raises() const {
    std::vector<comm::ComputeRaise> out;
    for (int r = 0; r < plan_.world; ++r)
      for (const Unit& u : units_[r])
        if (u.dp >= 0) {
          const int blk = plan_.steps[r][u.t].kv_rank;
          const uint32_t idx = p_.dkv_index(blk, u.b, u.dp);
          out.push_back({r, comm::add_to(RingRegion::kReady, r, idx, uint32_t(kernel_kbs(blk, u.dp) * p_.geo.hkv)), 1,
                         unit_name(r, size_t(&u - units_[r].data()))});
        }
    return out;
  }

 private:
  struct Unit {
    int t, b, dp;  // dp -1: forward (the whole step)
  };
  static constexpr uint32_t kPoison = 0x7fbadbadu;
  // A slot: B x S_l rows; rank r's block in the caller's K/V: B x rows_of(r) rows.
  uint64_t slot_block() const { return uint64_t(p_.geo.B) * p_.geo.S_l * p_.geo.row_bytes; }
  uint64_t user_block(int r) const { return uint64_t(p_.geo.B) * p_.geo.rows_of(r) * p_.geo.row_bytes; }
  // Rank owner's block as `me` reads it (own: the caller's K/V; else its slot): every row of it
  // this call's data, and in a slot the rows past the block (uneven shards) never written.
  bool check_block(comm::Replay& r, int me, int owner, bool own) {
    const int e = r.epoch(me);
    const RingGeometry& g = p_.geo;
    const uint64_t words_per_row = uint64_t(g.row_bytes) / 4, rows = uint64_t(g.rows_of(owner));
    const uint64_t stride = own ? rows : uint64_t(g.S_l);  // rows per batch where it lies
    for (int kv = 0; kv < 2; ++kv) {
      const comm::BufRef at = own ? comm::BufRef{comm::BufId(kv ? RingBuf::kUserV : RingBuf::kUserK), me, 0}
                                  : comm::BufRef{comm::BufId(kv ? RingBuf::kSlotsV : RingBuf::kSlotsK), me,
                                                 uint64_t(owner) * slot_block()};
      const uint8_t* m = r.mem(me, at, own ? user_block(owner) : slot_block());
      if (!m) return false;
      for (uint64_t b = 0; b < uint64_t(g.B); ++b)
        for (uint64_t row = 0; row < stride; ++row)
          for (uint64_t k = 0; k < words_per_row; ++k) {
            uint32_t w;
            memcpy(&w, m + 4 * ((b * stride + row) * words_per_row + k), 4);
            const bool used = row < rows;
            if (used ? w != tag(owner, e, kv, (b * rows + row) * words_per_row + k) : w != 0)
              return r.fail(std::string(kv ? "V" : "K") + " of rank " + std::to_string(owner) + "'s block, row " +
                            std::to_string(row) + " of batch " + std::to_string(b) +
                            (used ? ": not this call's data (" : ": past the block's rows, written (") +
                            (own ? "the caller's" : "slot") + ")");
          }
    }
    return true;
  }
  // The own block's dK/dV at the end of the call, as the finishing kernel reads it: every rank's
  // part of it that its kernel computed, summed — the own part (step 0's tiles, which stay) plus
  // acc where RingRank::own_sum says a sum came back round the ring.
  bool check_dkv(comm::Replay& r, int me, int e) {
    const RingGeometry& g = p_.geo;
    const int W = plan_.world;
    const uint64_t bytes = g.dkv_block_bytes();
    const uint8_t* m = r.mem(me, comm::BufRef{RingBuf::kPart, me, uint64_t(me) * bytes}, bytes);
    const uint8_t* a = W == 1 ? nullptr : r.mem(me, comm::BufRef{RingBuf::kAcc, me, uint64_t(me) * bytes}, bytes);
    if (!m || (W > 1 && !a)) return false;
    const std::vector<uint8_t>& own_sum = p_.ranks[me].own_sum;
    const uint64_t per_b = uint64_t(g.kb()) * g.hkv * g.tile_bytes;
    for (uint64_t i = 0; i < bytes / 4; ++i) {
      const int b = int(i * 4 / per_b);
      const int kbi = int((i * 4 % per_b) / (uint64_t(g.hkv) * g.tile_bytes));
      const int chunk = kbi / g.kb_per_chunk;
      if (kbi % g.kb_per_chunk >= g.kbs_of(me, chunk)) continue;  // past a shorter chunk's key blocks
      float want = 0.f;
      for (int q = 0; q < W; ++q)
        for (int t = 0; t < W; ++t)
          if (plan_.steps[q][t].kv_rank == me)
            for (const auto& pr : plan_.steps[q][t].pairs)
              if (pr.kv_chunk == chunk) {
                // the rank's call e: ranks run their calls in the same order
                want += part_value(q, e, me, i);
                break;
              }
      float got, sum = 0.f;
      memcpy(&got, m + 4 * i, 4);
      const int dp = chunk * g.dpieces_per_chunk() + (kbi % g.kb_per_chunk) / g.kb_per_piece;
      if (a && own_sum.at(size_t(b) * g.dpieces() + dp)) memcpy(&sum, a + 4 * i, 4);
      got += sum;
      if (got != want)
        return r.fail("dK/dV of the own block, batch " + std::to_string(b) + " key block " + std::to_string(kbi) +
                      " float " + std::to_string(i) + ": " + std::to_string(got) + ", want " + std::to_string(want));
    }
    return true;
  }
  const RingPlan& plan_;
  const RingProgram& p_;
  std::vector<std::vector<Unit>> units_;
};

std::string static_check(const RingPlan& plan, const RingProgram& p) {
  std::vector<comm::ComputeWait> waits;
  for (int r = 0; r < p.layout.world; ++r) {
    const RingRank& rp = p.ranks[r];
    for (int t = 1; t < p.layout.world; ++t)
      for (uint32_t i = 0; i < rp.step_waits[t]; ++i)
        waits.push_back({r, rp.waits[rp.step_wait0[t] + i], "kernel step " + std::to_string(t)});
  }
  return comm::check_static(p, programs(p), RingCompute(plan, p).raises(), waits);
}

std::string replay(const RingPlan& plan, const RingProgram& p, const comm::ReplayOptions& o) {
  RingCompute compute(plan, p);
  comm::Replay rep(p, programs(p), &compute, o);
  return rep.run() ? "" : rep.error();
}

uint64_t seed_of(const RingConfig& c, uint64_t salt) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name_of(c)) h = (h ^ ch) * 1099511628211ull;
  return test::mix(test::mix(test::test_seed(), h), salt);
}

std::vector<RingConfig> sweep() {
  std::vector<RingConfig> out;
  auto add = [&](RingConfig c) { out.push_back(c); };
  for (int W : {1, 2, 3, 4})
    for (bool zz : {false, true})
      for (bool causal : {false, true}) add(RingConfig{W, 1, false, false, zz, causal, 1, 64, 64, 1, 1});
  // Several nodes: one rank each, two each, strided; staged and direct; pieces and slots.
  for (bool staged : {false, true}) {
    add(RingConfig{2, 2, false, staged, false, false, 1, 64, 64, 1, 1});
    add(RingConfig{3, 3, false, staged, true, true, 2, 64, 16, 2, 2});
    add(RingConfig{4, 2, false, staged, true, true, 1, 96, 32, 1, 2});
    add(RingConfig{4, 2, true, staged, false, true, 2, 48, 16, 3, 1});
    add(RingConfig{6, 3, false, staged, false, false, 1, 32, 8, 2, 3});
    add(RingConfig{6, 2, true, staged, true, false, 1, 64, 64, 4, 2});
  }
  add(RingConfig{4, 1, false, false, true, true, 2, 80, 16, 3, 3});
  for (bool staged : {false, true})  // the GPU matrix's smallest case: 2 tokens per rank
    add(RingConfig{6, 3, false, staged, true, true, 1, 2, 2, 4, 2});
  // ... in the matrix's 8x1 launch (staged, 12 communication CTAs), whose backward once timed out
  // on a GPU (udp_rxd; bench/results/h100-2026-12-07-moe-dispatch): the replay finds no cycle.
  add(RingConfig{8, 8, false, true, true, true, 1, 2, 2, 12, 4});
  add(RingConfig{5, 1, false, false, false, true, 1, 40, 24, 2, 1});  // a last piece shorter than the rest
  // Uneven shards: blocks of fewer pieces than the slots hold, a last piece of one row, ranks of
  // one row (contiguous) or two (zigzag), batches.
  auto uneven = [&](RingConfig c, std::vector<int64_t> rows) {
    c.rows = std::move(rows);
    add(c);
  };
  uneven(RingConfig{3, 1, false, false, false, true, 1, 0, 16, 2, 2}, {40, 64, 17});
  uneven(RingConfig{2, 1, false, false, true, false, 2, 0, 8, 1, 1}, {2, 33});
  uneven(RingConfig{4, 1, false, false, true, true, 1, 0, 16, 3, 2}, {50, 64, 2, 33});
  for (bool staged : {false, true}) {
    uneven(RingConfig{2, 2, false, staged, false, false, 1, 0, 64, 1, 1}, {1, 64});
    uneven(RingConfig{4, 2, false, staged, true, true, 1, 0, 16, 2, 2}, {50, 64, 2, 33});
    uneven(RingConfig{3, 3, false, staged, true, true, 2, 0, 8, 2, 2}, {20, 64, 7});
    uneven(RingConfig{4, 2, true, staged, false, true, 2, 0, 16, 3, 1}, {64, 10, 30, 64});
  }
  // The backward's dK/dV sums beside K/V: every layout kind, both sequence layouts, causal or not.
  for (RingConfig c : std::vector<RingConfig>(out)) {
    if (c.W > 4 && c.nodes == 1) continue;
    c.backward = true;
    out.push_back(c);
  }
  RingConfig one_node8{8, 1, false, false, true, true, 1, 2, 2, 12, 4};  // the matrix's 1x8 launch
  one_node8.backward = true;
  out.push_back(one_node8);
  // The matrix's tiny backward case as the device builds it: one token per chunk is one key
  // block per chunk and one dK/dV piece (kb_per_piece is many key blocks), in the launches whose
  // backward timed out on a GPU — 8x1 staged with 12 communication CTAs, 6x1 staged with 16
  // (bench/results/h200-2026-12-07-moe-one-launch) — with 2 and 4 compute CTAs. The replay finds
  // no cycle in these either.
  for (RingConfig c : {RingConfig{8, 8, false, true, true, true, 1, 2, 2, 12, 2},
                       RingConfig{6, 6, false, true, true, true, 1, 2, 2, 16, 4},
                       RingConfig{6, 6, false, true, true, true, 1, 2, 2, 16, 2},
                       RingConfig{6, 1, false, false, true, true, 1, 2, 2, 16, 2}}) {
    c.backward = true;
    c.kb_per_chunk = 1;
    c.kb_per_piece = 16;
    out.push_back(c);
  }
  return out;
}

class RingReplay : public ::testing::TestWithParam<RingConfig> {};

TEST_P(RingReplay, ThreeCallsDeliverEveryBlock) {
  const RingConfig c = GetParam();
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(c, &b));
  ASSERT_EQ(static_check(b.plan, b.prog), "") << name_of(c);
  for (uint64_t k = 0; k < 4; ++k) {
    const uint64_t seed = seed_of(c, k);
    ASSERT_EQ(replay(b.plan, b.prog, comm::ReplayOptions{seed, c.comm_slots, c.unit_slots, 3}), "")
        << name_of(c) << " replay seed " << seed << " (MK_TEST_SEED=" << test::test_seed() << " replays it)";
  }
  // CTAs that take either kind of work and never spin on a kernel step while an op is ready
  // (ReplayOptions::shared_slots, 1 to 4 per rank): the program lets such a kernel finish however
  // few of its CTAs are resident (what a kernel with fixed roles needs both roles resident for).
  for (uint64_t k = 0; k < 4; ++k) {
    const uint64_t seed = seed_of(c, 40 + k);
    comm::ReplayOptions o{seed, 1, 1, 3};
    o.shared_slots = int(1 + k);
    ASSERT_EQ(replay(b.plan, b.prog, o), "") << name_of(c) << " shared slots " << o.shared_slots << " replay seed "
                                             << seed << " (MK_TEST_SEED=" << test::test_seed() << " replays it)";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, RingReplay, ::testing::ValuesIn(test::strided(sweep())),
                         [](const ::testing::TestParamInfo<RingConfig>& i) { return name_of(i.param); });

// ---- Mutations: every site of a few kinds broken alone must be rejected.
struct Mutant {
  std::string what;
  std::function<void(RingProgram&)> apply;
  int rank = -1;   // a dropped op wait: its site (for implied())
  size_t op = 0, wait = 0;
};

bool dkv_region(comm::RegionId g) {
  return g == RingRegion::kReady || g == RingRegion::kDkvArrived || g == RingRegion::kDkvArrivedNet ||
         g == RingRegion::kSummed;
}
bool dkv_buf(comm::BufId b) {
  return b == RingBuf::kPart || b == RingBuf::kAcc || b == RingBuf::kPartNet || b == RingBuf::kAccNet;
}
// An op of the backward's dK/dV sums (it moves or waits for dK/dV).
bool dkv_op(const comm::Op& op) {
  for (const auto& b : op.srcs) if (dkv_buf(b.buf)) return true;
  for (const auto& b : op.dsts) if (dkv_buf(b.buf)) return true;
  for (const auto& w : op.waits) if (dkv_region(w.flag.region)) return true;
  return false;
}

// Backward programs: the mutants of the dK/dV sums only (the ops that move or wait for dK/dV,
// and the end of the call's waits for them). Their K/V ops are the forward program's, mutated in
// the forward configurations; beside the sums some of their waits become redundant (the sums go
// round the ring behind the blocks: a rank's call ends only after its block's sum came back, by
// then the ring read its K/V), so that dropping them shows in no replay.
std::vector<Mutant> mutants(const RingPlan& plan, const RingProgram& p) {
  std::vector<Mutant> out;
  const bool bwd = p.geo.backward;
  for (int r = 0; r < p.layout.world; ++r) {
    const auto& ops = p.ranks[r].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      const comm::Op& op = ops[i];
      if (bwd && !dkv_op(op)) continue;
      const bool whole = !bwd || op.kind != comm::OpKind::kSignal || op.signals.size();  // not the call's end
      const std::string site = "rank " + std::to_string(r) + " op " + std::to_string(i) + " (" + op.what + ")";
      for (size_t j = 0; j < op.waits.size(); ++j)
        if (whole || dkv_region(op.waits[j].flag.region))
        out.push_back({site + ": drop wait " + std::to_string(j),
                       [=](RingProgram& m) { auto& v = m.ranks[r].ops[i].waits; v.erase(v.begin() + j); }, r, i, j});
      for (size_t j = 0; j < op.signals.size(); ++j)
        out.push_back({site + ": drop signal " + std::to_string(j),
                       [=](RingProgram& m) { auto& v = m.ranks[r].ops[i].signals; v.erase(v.begin() + j); }});
      const bool token = op.kind == comm::OpKind::kNetPut && op.bytes == 8;  // payload nobody reads
      if (op.kind == comm::OpKind::kReduce) {
        out.push_back({site + ": 4 values short", [=](RingProgram& m) { m.ranks[r].ops[i].elems -= 4; }});
        out.push_back({site + ": destination 16 bytes on", [=](RingProgram& m) {
                         auto& d = m.ranks[r].ops[i].dsts[0];
                         d.offset = d.offset >= 16 ? d.offset - 16 : d.offset + 16;
                       }});
        out.push_back({site + ": second source dropped", [=](RingProgram& m) {
                         auto& v = m.ranks[r].ops[i].srcs;
                         v.pop_back();
                       }});
      }
      if ((op.kind == comm::OpKind::kCopy || op.kind == comm::OpKind::kNetPut) && !token) {
        out.push_back({site + ": 16 bytes short", [=](RingProgram& m) { m.ranks[r].ops[i].bytes -= 16; }});
        out.push_back({site + ": destination 16 bytes on", [=](RingProgram& m) {
                         auto& d = m.ranks[r].ops[i].dsts[0];
                         d.offset = d.offset >= 16 ? d.offset - 16 : d.offset + 16;
                       }});
      }
    }
    // The kernel's side: each arrival wait of each step that computes something dropped (the
    // step then reads the piece whenever its other waits let it). A step without query-key pairs
    // (causal: a later rank's block) reads nothing and waits for nothing on the device.
    const RingRank& rp = p.ranks[r];
    for (int t = 1; t < p.layout.world; ++t)
      for (uint32_t j = 0; !plan.steps[r][t].pairs.empty() && j < rp.step_waits[t]; ++j)
        out.push_back({"rank " + std::to_string(r) + " kernel step " + std::to_string(t) + ": drop wait " +
                           std::to_string(j),
                       [=](RingProgram& m) {
                         RingRank& q = m.ranks[r];
                         q.waits.erase(q.waits.begin() + q.step_wait0[t] + j);
                         --q.step_waits[t];
                         for (int u = t + 1; u < m.layout.world; ++u) --q.step_wait0[u];
                       }});
  }
  return out;
}

// Op waits whose drop changes nothing, so no check can catch it. Each argument holds for any
// number of communication CTAs (the library runs `ring_comm_ctas` of them, up to the grid less
// one, each taking the next op of the list; nothing says an earlier op finished before a later
// one starts, so a wait repeated earlier in the list proves nothing) and any number of compute
// CTAs:
//  - the final "every block arrived" wait on a block some step of the kernel reads, or another
//    op of the list waits for, or an op of the list raises (the relay from the host mirror): a
//    call ends only when every op and every kernel step is done, and each of those waited for the
//    same count or made it; likewise the backward's wait for the own block's dK/dV when an op of
//    the list raises it (the relay from the network);
//  - the wait for the proxy to finish reading this call's sources, when the only network put is
//    the entry token (its payload is the same every call), or when the sources are host mirrors
//    (staged): a mirror is rewritten only by this rank's next call, by a put that waits until the
//    next rank entered that call, which it does only after its own call ended, i.e. after every
//    block of this call arrived there, i.e. after the proxy read every source of this call.
bool implied(const RingPlan& plan, const RingProgram& p, int r, size_t i, size_t j) {
  const auto& ops = p.ranks[r].ops;
  const comm::Wait& w = ops[i].waits[j];
  if (w.flag.region == RingRegion::kSrcFree) {
    if (p.net_staged) return true;
    bool data_puts = false;
    for (const auto& o : ops) data_puts |= o.kind == comm::OpKind::kNetPut && o.bytes != 8;
    if (!data_puts) return true;
  }
  const comm::Op& op = ops[i];
  const bool arrival = w.flag.region == RingRegion::kArrived || w.flag.region == RingRegion::kDkvArrived;
  if (op.kind != comm::OpKind::kSignal || !arrival || !op.signals.empty()) return false;
  for (size_t k = 0; k < ops.size(); ++k) {
    for (const auto& x : ops[k].waits)
      if (k != i && x.flag.region == w.flag.region && x.flag.index == w.flag.index && x.mul >= w.mul) return true;
    for (const auto& x : ops[k].signals)
      if (x.flag.region == w.flag.region && x.flag.rank == r && x.flag.index == w.flag.index) return true;
  }
  if (w.flag.region != RingRegion::kArrived) return false;
  const int slot = int(w.flag.index / uint32_t(p.geo.B * p.geo.pieces));
  for (int t = 1; t < plan.world; ++t)
    if (plan.steps[r][t].kv_rank == slot && !plan.steps[r][t].pairs.empty()) return true;
  return false;
}

class RingMutation : public ::testing::TestWithParam<RingConfig> {};

TEST_P(RingMutation, EveryMutantIsRejected) {
  const RingConfig c = GetParam();
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(c, &b));
  std::vector<Mutant> ms;
  int caught = 0, skipped = 0;
  for (const Mutant& mu : mutants(b.plan, b.prog)) {
    if (mu.rank >= 0 && implied(b.plan, b.prog, mu.rank, mu.op, mu.wait)) ++skipped;
    else ms.push_back(mu);
  }
  ms = test::strided(std::move(ms));  // all but under MK_TEST_STRIDE
  uint64_t most = 0;
  for (const Mutant& mu : ms) {
    RingProgram m = b.prog;
    mu.apply(m);
    std::string why = static_check(b.plan, m);
    uint64_t k = 0;
    for (; why.empty() && k < test::kMutantReplays; ++k)
      why = replay(b.plan, m, test::mutant_replay(seed_of(c, 100 + k), c.comm_slots, c.unit_slots, k));
    most = std::max(most, k);
    EXPECT_FALSE(why.empty()) << name_of(c) << ": mutant not rejected in " << test::kMutantReplays
                              << " replays: " << mu.what << " (MK_TEST_SEED=" << test::test_seed() << ")";
    caught += !why.empty();
  }
  printf("%s: %zu mutants, %d rejected (at most %llu replays), %d implied waits left out\n", name_of(c).c_str(),
         ms.size(), caught, static_cast<unsigned long long>(most), skipped);
  EXPECT_GT(caught, 0);
}

// The other side of implied(): a wait it leaves out, dropped, must never show — a replay that
// caught one would prove the argument above wrong (test::implied_replays() replays each).
TEST_P(RingMutation, ImpliedWaitsChangeNothing) {
  const RingConfig c = GetParam();
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(c, &b));
  const uint64_t n = test::implied_replays();
  int checked = 0;
  std::vector<Mutant> ms;
  for (const Mutant& mu : mutants(b.plan, b.prog))
    if (mu.rank >= 0 && implied(b.plan, b.prog, mu.rank, mu.op, mu.wait)) ms.push_back(mu);
  for (const Mutant& mu : test::strided(std::move(ms))) {  // all but under MK_TEST_STRIDE
    RingProgram m = b.prog;
    mu.apply(m);
    ASSERT_EQ(static_check(b.plan, m), "") << name_of(c) << ": " << mu.what;
    for (uint64_t k = 0; k < n; ++k)
      ASSERT_EQ(replay(b.plan, m, test::mutant_replay(seed_of(c, 5000 + k), c.comm_slots, c.unit_slots, k)), "")
          << name_of(c) << ": an implied wait dropped, yet caught: " << mu.what;
    ++checked;
  }
  printf("%s: %d implied waits dropped, %llu replays each, none caught\n", name_of(c).c_str(), checked,
         static_cast<unsigned long long>(n));
}

INSTANTIATE_TEST_SUITE_P(Layouts, RingMutation,
                         ::testing::Values(RingConfig{3, 1, false, false, false, true, 1, 64, 32, 3, 2},
                                           RingConfig{2, 2, false, false, false, false, 1, 64, 32, 3, 2},
                                           RingConfig{2, 2, false, true, false, false, 1, 64, 32, 3, 2},
                                           RingConfig{4, 2, false, true, true, true, 1, 32, 16, 3, 2},
                                           RingConfig{4, 2, true, false, false, true, 1, 32, 16, 3, 2},
                                           RingConfig{3, 1, false, false, true, true, 1, 64, 32, 3, 2, true},
                                           RingConfig{2, 2, false, false, false, false, 1, 64, 32, 3, 2, true},
                                           RingConfig{4, 2, false, true, true, true, 1, 32, 16, 3, 2, true},
                                           RingConfig{4, 2, true, false, false, true, 2, 32, 16, 3, 2, true},
                                           RingConfig{3, 1, false, false, true, true, 1, 0, 16, 3, 2, false, {40, 64, 17}},
                                           RingConfig{3, 3, false, true, false, true, 1, 0, 16, 3, 2, false, {9, 40, 2}},
                                           RingConfig{3, 1, false, false, true, true, 1, 0, 16, 3, 2, true, {40, 64, 17}},
                                           RingConfig{4, 2, false, true, false, true, 1, 0, 16, 3, 2, true, {9, 40, 64, 2}}),
                         [](const ::testing::TestParamInfo<RingConfig>& i) { return name_of(i.param); });

// The resolver's view: the same program checks out for every rank of a 2-node layout, staged
// or not, and the pad does not depend on staging (the proxy's pad is sized before the program).
// Ops [0, kv_ops) of every rank move K/V and never dK/dV; the ops after them move dK/dV or end
// the call, never K/V (the backward's leave-one-out timing runs the first kv_ops alone).
bool kv_buf(comm::BufId b) {
  return b == RingBuf::kUserK || b == RingBuf::kUserV || b == RingBuf::kSlotsK || b == RingBuf::kSlotsV ||
         b == RingBuf::kSlotsKNet || b == RingBuf::kSlotsVNet;
}
bool moves_kv(const comm::Op& op) {
  for (const auto& b : op.srcs) if (kv_buf(b.buf)) return true;
  for (const auto& b : op.dsts) if (kv_buf(b.buf)) return true;
  return false;
}
TEST_P(RingReplay, KvOpsComeFirst) {
  const RingConfig c = GetParam();
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(c, &b));
  for (int r = 0; r < c.W; ++r) {
    const auto& rp = b.prog.ranks[r];
    ASSERT_LE(rp.kv_ops, rp.ops.size()) << name_of(c) << " rank " << r;
    if (c.W == 1) {
      EXPECT_EQ(rp.kv_ops, 0u);
      continue;
    }
    int kv = 0;
    for (uint32_t i = 0; i < rp.kv_ops; ++i) {
      EXPECT_FALSE(dkv_op(rp.ops[i])) << name_of(c) << " rank " << r << " op " << i << ": " << rp.ops[i].what;
      kv += moves_kv(rp.ops[i]);
    }
    EXPECT_GT(kv, 0) << name_of(c) << " rank " << r;
    // After them: the sums (backward), then the call's end — signal ops that move nothing.
    size_t dkv = 0;
    for (size_t i = rp.kv_ops; i < rp.ops.size(); ++i) {
      const comm::Op& op = rp.ops[i];
      EXPECT_FALSE(moves_kv(op)) << name_of(c) << " rank " << r << " op " << i << ": " << op.what;
      if (dkv_op(op) && (op.kind != comm::OpKind::kSignal || !op.srcs.empty())) ++dkv;
      else EXPECT_TRUE(op.kind == comm::OpKind::kSignal && op.srcs.empty() && op.dsts.empty())
          << name_of(c) << " rank " << r << " op " << i << ": " << op.what;
    }
    // A rank sends sums where its kernel computes a block after step 0 (the own block's tiles
    // stay home); one that computes nothing after step 0 and gets no sum of its own block back
    // moves no dK/dV at all (a received sum it only passes on, or relays, is an op too).
    bool later = false, home = false;
    for (int t = 1; t < c.W; ++t) later = later || !b.plan.steps[r][t].pairs.empty();
    for (uint8_t f : rp.own_sum) home = home || f;
    if (c.backward && later) {
      EXPECT_GT(dkv, 0u) << name_of(c) << " rank " << r;
    }
    if (!c.backward || (!later && !home)) {
      EXPECT_EQ(dkv, 0u) << name_of(c) << " rank " << r;
    }
  }
}

// The K/V pieces of a shape: about 2 MiB (at least 64 tokens), no more than a block, or the
// caller's size; the last piece may be short.
TEST(RingProgram, KvGeometryPieces) {
  struct Case { int B; int64_t S_l; int Hkv, D; int64_t ct; int want_ct, want_pieces; };
  const Case cases[] = {
      {1, 8192, 32, 128, 0, 256, 32},   // 8 KiB rows: 256 tokens of 2 MiB
      {2, 1000, 8, 64, 0, 1000, 1},     // 1 KiB rows: 2048 tokens, capped at the block
      {1, 1000, 8, 64, 300, 300, 4},    // the caller's: 300, 300, 300, 100
      {1, 100000, 1, 64, 0, 16384, 7},  // 128-byte rows
      {1, 4096, 128, 128, 0, 64, 64},   // 32 KiB rows: the 64-token floor
      {1, 1, 4, 64, 0, 1, 1},
  };
  for (const Case& c : cases) {
    const RingGeometry g = ring_kv_geometry(c.B, {c.S_l, c.S_l}, c.Hkv, c.D, c.ct);
    EXPECT_EQ(g.chunk_tokens, c.want_ct) << c.S_l << " " << c.Hkv << " " << c.D << " " << c.ct;
    EXPECT_EQ(g.pieces, c.want_pieces) << c.S_l << " " << c.Hkv << " " << c.D << " " << c.ct;
    EXPECT_EQ(g.B, c.B);
    EXPECT_EQ(g.S_l, c.S_l);
    EXPECT_EQ(g.row_bytes, int64_t(c.Hkv) * c.D * 2);
    EXPECT_FALSE(g.backward);
    EXPECT_TRUE(g.rows.empty());
  }
  // Uneven shards: slots of the largest block; each block its own pieces, the last one short.
  const RingGeometry g = ring_kv_geometry(1, {100, 300, 50}, 8, 64, 64);
  EXPECT_EQ(g.S_l, 300);
  EXPECT_EQ(g.pieces, 5);
  EXPECT_EQ(g.rows, (std::vector<int64_t>{100, 300, 50}));
  EXPECT_EQ(g.pieces_of(0), 2);
  EXPECT_EQ(g.pieces_of(1), 5);
  EXPECT_EQ(g.pieces_of(2), 1);
}

TEST(RingProgram, PadSizeDoesNotDependOnStaging) {
  RingConfig c{4, 2, false, false, true, true, 2, 64, 16, 1, 1};
  Built direct, staged;
  ASSERT_NO_FATAL_FAILURE(build(c, &direct));
  c.staged = true;
  ASSERT_NO_FATAL_FAILURE(build(c, &staged));
  EXPECT_EQ(direct.prog.pad_flags, staged.prog.pad_flags);
  EXPECT_TRUE(staged.prog.net_staged);
  EXPECT_FALSE(direct.prog.net_staged);
}

}  // namespace
}  // namespace ops
}  // namespace mk
