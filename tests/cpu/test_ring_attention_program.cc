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

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "src/comm/replay.h"
#include "src/ops/ring_attention/ring_attention_program.h"
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
  uint64_t seed = 0;
};
std::string name_of(const RingConfig& c) {
  return "W" + std::to_string(c.W) + (c.strided ? "s" : "n") + std::to_string(c.nodes) + (c.staged ? "_staged" : "") +
         (c.zigzag ? "_zigzag" : "_contig") + (c.causal ? "_causal" : "") + "_B" + std::to_string(c.B) + "_S" +
         std::to_string(c.S_l) + "_ct" + std::to_string(c.chunk_tokens) + "_c" + std::to_string(c.comm_slots) + "_u" +
         std::to_string(c.unit_slots);
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
  const int64_t S = c.S_l * c.W;
  ASSERT_TRUE(build_ring_plan(l, S, c.zigzag ? SeqLayout::kZigzag : SeqLayout::kContiguous, c.causal, &b->plan).ok());
  RingGeometry g;
  g.B = c.B;
  g.S_l = c.S_l;
  g.row_bytes = 2 * 64 * 2;  // Hkv 2, D 64
  g.chunk_tokens = c.chunk_tokens;
  g.pieces = int((c.S_l + c.chunk_tokens - 1) / c.chunk_tokens);
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

// The kernel's side: per call, the steps that compute something (each reads one block after its
// arrival waits; step 0 reads the caller's own K/V).
class RingCompute : public comm::ReplayCompute {
 public:
  RingCompute(const RingPlan& plan, const RingProgram& p) : plan_(plan), p_(p) {
    steps_.resize(plan.world);
    for (int r = 0; r < plan.world; ++r)
      for (int t = 0; t < plan.world; ++t)
        if (!plan.steps[r][t].pairs.empty()) steps_[r].push_back(t);
  }
  size_t units(int rank) const override { return steps_[rank].size(); }
  int phases(int, size_t) const override { return 1; }
  const comm::Wait* waits(int rank, size_t unit, int, size_t* n) const override {
    const RingRank& rp = p_.ranks[rank];
    const int t = steps_[rank][unit];
    *n = rp.step_waits[t];
    return rp.waits.data() + rp.step_wait0[t];
  }
  std::string unit_name(int rank, size_t unit) const override {
    const int t = steps_[rank][unit];
    return "step " + std::to_string(t) + " (block of rank " + std::to_string(plan_.steps[rank][t].kv_rank) + ")";
  }
  void start_call(comm::Replay& r, int me, int e) override {
    for (int kv = 0; kv < 2; ++kv) {
      const uint64_t bytes = block();
      uint8_t* m = r.mem(me, comm::BufRef{comm::BufId(kv ? RingBuf::kUserV : RingBuf::kUserK), me, 0}, bytes);
      for (uint64_t i = 0; m && i < bytes / 4; ++i) {
        const uint32_t w = tag(me, e, kv, i);
        memcpy(m + 4 * i, &w, 4);
      }
    }
  }
  bool run(comm::Replay& r, int me, size_t unit, int) override {
    const int t = steps_[me][unit];
    return check_block(r, me, plan_.steps[me][t].kv_rank, t == 0);
  }
  bool finish_call(comm::Replay& r, int me, int) override {
    for (int t = 1; t < plan_.world; ++t)
      if (!check_block(r, me, plan_.steps[me][t].kv_rank, false)) return false;
    return true;
  }

 private:
  uint64_t block() const { return uint64_t(p_.geo.B) * p_.geo.S_l * p_.geo.row_bytes; }
  bool check_block(comm::Replay& r, int me, int owner, bool own) {
    const int e = r.epoch(me);
    for (int kv = 0; kv < 2; ++kv) {
      const comm::BufRef at = own ? comm::BufRef{comm::BufId(kv ? RingBuf::kUserV : RingBuf::kUserK), me, 0}
                                  : comm::BufRef{comm::BufId(kv ? RingBuf::kSlotsV : RingBuf::kSlotsK), me,
                                                 uint64_t(owner) * block()};
      const uint8_t* m = r.mem(me, at, block());
      if (!m) return false;
      for (uint64_t i = 0; i < block() / 4; ++i) {
        uint32_t w;
        memcpy(&w, m + 4 * i, 4);
        if (w != tag(owner, e, kv, i)) {
          const uint64_t row = i * 4 / uint64_t(p_.geo.row_bytes);
          return r.fail(std::string(kv ? "V" : "K") + " of rank " + std::to_string(owner) + "'s block, row " +
                        std::to_string(row % uint64_t(p_.geo.S_l)) + " of batch " +
                        std::to_string(row / uint64_t(p_.geo.S_l)) + ": not this call's data (" +
                        (own ? "the caller's" : "slot") + ")");
        }
      }
    }
    return true;
  }
  const RingPlan& plan_;
  const RingProgram& p_;
  std::vector<std::vector<int>> steps_;
};

std::string static_check(const RingProgram& p) {
  std::vector<comm::ComputeWait> waits;
  for (int r = 0; r < p.layout.world; ++r) {
    const RingRank& rp = p.ranks[r];
    for (int t = 1; t < p.layout.world; ++t)
      for (uint32_t i = 0; i < rp.step_waits[t]; ++i)
        waits.push_back({r, rp.waits[rp.step_wait0[t] + i], "kernel step " + std::to_string(t)});
  }
  return comm::check_static(p, programs(p), {}, waits);
}

std::string replay(const RingPlan& plan, const RingProgram& p, const RingConfig& c, uint64_t seed) {
  RingCompute compute(plan, p);
  comm::Replay rep(p, programs(p), &compute, comm::ReplayOptions{seed, c.comm_slots, c.unit_slots, 3});
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
  add(RingConfig{5, 1, false, false, false, true, 1, 40, 24, 2, 1});  // a last piece shorter than the rest
  return out;
}

class RingReplay : public ::testing::TestWithParam<RingConfig> {};

TEST_P(RingReplay, ThreeCallsDeliverEveryBlock) {
  const RingConfig c = GetParam();
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(c, &b));
  ASSERT_EQ(static_check(b.prog), "") << name_of(c);
  for (uint64_t k = 0; k < 4; ++k) {
    const uint64_t seed = seed_of(c, k);
    ASSERT_EQ(replay(b.plan, b.prog, c, seed), "")
        << name_of(c) << " replay seed " << seed << " (MK_TEST_SEED=" << test::test_seed() << " replays it)";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, RingReplay, ::testing::ValuesIn(sweep()),
                         [](const ::testing::TestParamInfo<RingConfig>& i) { return name_of(i.param); });

// ---- Mutations: every site of a few kinds broken alone must be rejected.
struct Mutant {
  std::string what;
  std::function<void(RingProgram&)> apply;
};

std::vector<Mutant> mutants(const RingProgram& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r) {
    const auto& ops = p.ranks[r].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      const comm::Op& op = ops[i];
      const std::string site = "rank " + std::to_string(r) + " op " + std::to_string(i) + " (" + op.what + ")";
      for (size_t j = 0; j < op.waits.size(); ++j)
        out.push_back({site + ": drop wait " + std::to_string(j),
                       [=](RingProgram& m) { auto& v = m.ranks[r].ops[i].waits; v.erase(v.begin() + j); }});
      for (size_t j = 0; j < op.signals.size(); ++j)
        out.push_back({site + ": drop signal " + std::to_string(j),
                       [=](RingProgram& m) { auto& v = m.ranks[r].ops[i].signals; v.erase(v.begin() + j); }});
      const bool token = op.kind == comm::OpKind::kNetPut && op.bytes == 8;  // payload nobody reads
      if ((op.kind == comm::OpKind::kCopy || op.kind == comm::OpKind::kNetPut) && !token) {
        out.push_back({site + ": 16 bytes short", [=](RingProgram& m) { m.ranks[r].ops[i].bytes -= 16; }});
        out.push_back({site + ": destination 16 bytes on", [=](RingProgram& m) {
                         auto& d = m.ranks[r].ops[i].dsts[0];
                         d.offset = d.offset >= 16 ? d.offset - 16 : d.offset + 16;
                       }});
      }
    }
  }
  return out;
}

// Waits a dropped copy of which changes nothing, so no check can catch it:
//  - the same flag (>= the same count) is waited by an op at least `comm_slots` places earlier in
//    the list: the communication CTAs take ops in list order, so that op completed before this
//    one is taken (the program repeats such waits so that ops stay safe under any CTA count);
//  - the final "every block arrived" wait on a block some later step of the kernel reads or
//    another op waits for (the call ends only when every op and step is done);
//  - the wait for the proxy to finish reading this call's sources when they are host mirrors
//    (staged: only this rank's next call writes them, after the next rank entered that call,
//    which it does only after every block of this call arrived there) or only the entry token.
bool implied(const RingPlan& plan, const RingProgram& p, int slots, int r, size_t i, size_t j) {
  const auto& ops = p.ranks[r].ops;
  const comm::Wait& w = ops[i].waits[j];
  for (size_t k = 0; k + size_t(slots) <= i; ++k)
    for (const auto& x : ops[k].waits)
      if (x.flag.region == w.flag.region && x.flag.rank == w.flag.rank && x.flag.index == w.flag.index &&
          x.mul >= w.mul)
        return true;
  if (w.flag.region == RingRegion::kSrcFree) {
    if (p.net_staged) return true;
    bool data_puts = false;  // the entry token's payload never changes: reading it late is harmless
    for (const auto& o : ops) data_puts |= o.kind == comm::OpKind::kNetPut && o.bytes != 8;
    if (!data_puts) return true;
  }
  const comm::Op& op = ops[i];
  if (op.kind != comm::OpKind::kSignal || w.flag.region != RingRegion::kArrived || !op.signals.empty()) return false;
  // The call ends only when every op is done: another op waiting for the same block, or the op
  // that relays it (which raises it), holds it open.
  for (size_t k = 0; k < ops.size(); ++k) {
    for (const auto& x : ops[k].waits)
      if (k != i && x.flag.region == w.flag.region && x.flag.index == w.flag.index && x.mul >= w.mul) return true;
    for (const auto& x : ops[k].signals)
      if (x.flag.region == w.flag.region && x.flag.rank == r && x.flag.index == w.flag.index) return true;
  }
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
  const std::vector<Mutant> ms = mutants(b.prog);
  int caught = 0, skipped = 0;
  for (const Mutant& mu : ms) {
    // Implied waits are recognised by their site before the mutation.
    bool imp = false;
    {
      const size_t colon = mu.what.find(": drop wait ");
      if (colon != std::string::npos) {
        int r = 0;
        size_t i = 0, j = 0;
        sscanf(mu.what.c_str(), "rank %d op %zu", &r, &i);
        j = std::stoul(mu.what.substr(colon + 12));
        imp = implied(b.plan, b.prog, c.comm_slots, r, i, j);
      }
    }
    if (imp) {
      ++skipped;
      continue;
    }
    RingProgram m = b.prog;
    mu.apply(m);
    std::string why = static_check(m);
    for (uint64_t k = 0; why.empty() && k < 256; ++k) why = replay(b.plan, m, c, seed_of(c, 100 + k));
    EXPECT_FALSE(why.empty()) << name_of(c) << ": mutant not rejected: " << mu.what;
    caught += !why.empty();
  }
  printf("%s: %zu mutants, %d rejected, %d implied waits left out\n", name_of(c).c_str(), ms.size(), caught, skipped);
  EXPECT_GT(caught, 0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, RingMutation,
                         ::testing::Values(RingConfig{3, 1, false, false, false, true, 1, 64, 32, 3, 2},
                                           RingConfig{2, 2, false, false, false, false, 1, 64, 32, 3, 2},
                                           RingConfig{2, 2, false, true, false, false, 1, 64, 32, 3, 2},
                                           RingConfig{4, 2, false, true, true, true, 1, 32, 16, 3, 2},
                                           RingConfig{4, 2, true, false, false, true, 1, 32, 16, 3, 2}),
                         [](const ::testing::TestParamInfo<RingConfig>& i) { return name_of(i.param); });

// The resolver's view: the same program checks out for every rank of a 2-node layout, staged
// or not, and the pad does not depend on staging (the proxy's pad is sized before the program).
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
