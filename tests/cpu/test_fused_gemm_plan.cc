// CPU replay of the fused-operator plans (src/ops/fused_gemm/fused_gemm_plan.h). Every rank's plan runs at once on host
// buffers under a seeded random interleaving of its communication slots (several comm CTAs
// taking ops in list order), its GEMM tile slots and its proxy (puts delivered later, reading
// their source at delivery), for three consecutive calls (epochs 1..3); a rank starts its next
// call as soon as its own call ends, so ranks run ahead of each other, and each call draws how
// fast each rank's comm CTAs, tiles and proxy move. Inputs are small integers in bf16, so every
// sum is exact and each rank's output is checked bit for bit the moment its call ends. A schedule
// where nothing can move fails as a deadlock, with the blocked op or tile and its wait for every
// rank. A static pass checks the flag accounting: every wait is on a flag the plan raises exactly
// `mul` times per call (or sets to exactly mul * e once), on the waiter's node, proxy regions are
// raised only by the proxy, and no op waits for a flag that only a later op of its own list
// raises (a deadlock with one comm CTA).
//
// Seeds: every run draws a fresh run seed (test_seed(): MK_TEST_SEED if set, else random; the
// main prints it) and each configuration's replay seed is mixed from it and the configuration's
// name, so `MK_TEST_SEED=<n>` replays a run exactly; failures print both seeds.
//
// Mutation tests: valid plans of every kind (1, 2 and 4 nodes, staged and direct, deterministic
// or not) are broken one site at a time — a dropped wait, a changed wait count or signal value, a
// dropped signal, two dependent ops swapped, a shortened copy/put/zero/reduce, a destination at
// the wrong offset — and every mutant must be rejected by the static pass or the replay.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "src/comm/replay.h"
#include "src/ops/fused_gemm/fused_gemm_plan.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

using comm::BufId;
using comm::BufRef;
using comm::FlagRef;
using comm::Op;
using comm::OpKind;
using comm::RegionId;
using comm::Wait;

constexpr int kCalls = 3;
constexpr uint16_t kPoison = 0x7fc1;  // a bf16 NaN: an output element nobody wrote

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
float dot(const float* a, const float* b, int64_t k) {
  float s = 0.f;
  for (int64_t i = 0; i < k; ++i) s += a[i] * b[i];
  return s;
}

// Names for failure messages (the plans' fixed buffer and region ids).
std::string flag_str(const FlagRef& f) {
  return std::string(region_name(f.region)) + "[rank " + std::to_string(f.rank) + "][" + std::to_string(f.index) + "]";
}
std::string ref_str(const BufRef& b) {
  return std::string(buf_name(b.buf)) + "@rank " + std::to_string(b.rank) + "+" + std::to_string(b.offset);
}

struct Config {
  FusedKind kind = FusedKind::kAgGemm;
  int W = 1, nodes = 1;
  int64_t M = 0, N = 0, K = 0;
  bool det = false;
  int comm_slots = 1, tile_slots = 1;
  int variant = 0;  // distinguishes configurations of equal shape in the sweep (part of the name)
  uint64_t seed = 0;  // the replay's seed: set from the run seed (seeded()), not part of the name
  bool strided = false;  // node n holds ranks n, n + nodes, ... instead of a consecutive block
  bool staged = false;   // network traffic through host mirrors (Plan::net_staged)
  std::vector<int64_t> rows;  // uneven shards (PlanShape::rows); empty: M / W each (AR: as even as M allows)
};
PlanShape shape_of(const Config& c) { return PlanShape(c.M, c.N, c.K, c.rows); }
comm::Layout make_layout(const Config& c) {
  return c.strided ? comm::Layout::strided(c.W, c.nodes) : comm::Layout::uniform(c.W, c.nodes);
}
std::string config_name(const Config& c) {
  std::string s = fused_kind_name(c.kind);
  if (c.det) s += "_det";
  return s + "_W" + std::to_string(c.W) + (c.strided ? "s" : "n") + std::to_string(c.nodes) + "_M" + std::to_string(c.M) + "_N" +
         std::to_string(c.N) + "_K" + std::to_string(c.K) + "_c" + std::to_string(c.comm_slots) + "_t" +
         std::to_string(c.tile_slots) + "_v" + std::to_string(c.variant) + (c.staged ? "_staged" : "") +
         (c.rows.empty() ? "" : "_uneven");
}
void PrintTo(const Config& c, std::ostream* os) { *os << config_name(c); }  // gtest's failure line

// The configuration with its replay seed: a function of the run seed, the configuration's name
// and `salt` (mutation tests try several seeds per site).
uint64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}
Config seeded(Config c, uint64_t salt = 0) {
  c.seed = test::mix(test::mix(test::test_seed(), name_hash(config_name(c))), salt);
  return c;
}
// For failure messages: how to replay.
std::string seed_note(const Config& c) {
  const std::string run = std::to_string(test::test_seed());
  return " [" + config_name(c) + ": replay seed " + std::to_string(c.seed) + " from run seed " + run +
         "; MK_TEST_SEED=" + run + " replays it]";
}

// ---- Static checks: tile orders and hook ranges of every rank's plan, then the flag accounting
// of the program with the GEMM's tile hooks (comm::check_static).
std::vector<const comm::RankProgram*> rank_programs(const Plan& p) {
  std::vector<const comm::RankProgram*> v;
  for (const auto& rp : p.ranks) v.push_back(&rp);
  return v;
}

std::string check_static(const Plan& p) {
  const int W = p.layout.world;
  if (int(p.ranks.size()) != W) return "ranks.size() != world";
  std::vector<comm::ComputeRaise> raises;
  std::vector<comm::ComputeWait> waits;
  for (int me = 0; me < W; ++me) {
    const RankPlan& rp = p.ranks[me];
    const std::string rk = "rank " + std::to_string(me);
    std::vector<int> order = rp.tile_order;
    std::sort(order.begin(), order.end());
    for (int t = 0; t < p.tiles_m * p.tiles_n; ++t)
      if (int(order.size()) != p.tiles_m * p.tiles_n || order[t] != t) return rk + ": tile_order is not a permutation";
    if (int(rp.rows.size()) != p.tiles_m) return rk + ": rows.size() != tiles_m";
    if (p.kind != FusedKind::kAgGemm && int(rp.route.size()) != W) return rk + ": route.size() != world";
    for (int tm = 0; tm < p.tiles_m; ++tm) {
      const RowHooks& h = rp.rows[tm];
      if (h.load_wait0 + h.load_waits > rp.waits.size() || h.store_wait0 + h.store_waits > rp.waits.size() ||
          h.store_sig0 + h.store_sigs > rp.signals.size())
        return rk + ": hook range of tile-row " + std::to_string(tm) + " outside the pools";
      const std::string who = "tile-row " + std::to_string(tm);
      for (uint32_t i = 0; i < h.store_sigs; ++i)  // raised once by every tile of the row
        raises.push_back({me, rp.signals[h.store_sig0 + i], uint64_t(p.tiles_n), who});
      for (uint32_t i = 0; i < h.load_waits; ++i) waits.push_back({me, rp.waits[h.load_wait0 + i], who + " load"});
      for (uint32_t i = 0; i < h.store_waits; ++i) waits.push_back({me, rp.waits[h.store_wait0 + i], who + " store"});
    }
  }
  return comm::check_static(p, rank_programs(p), raises, waits);
}

// ---- The GEMM's side in the replay: tiles in the plan's order, each loaded (AG: after its
// row's chunks arrived, reading the gathered A then) and stored (RS/AR: after its store waits,
// adding or storing fp32 along the route, then raising the row's signals).
class GemmCompute : public comm::ReplayCompute {
 public:
  explicit GemmCompute(const Plan& p)
      : p_(p), W_(p.layout.world), M_(p.shape.M), N_(p.shape.N), K_(p.shape.K) {
    ag_ = p.kind == FusedKind::kAgGemm;
    acc_.resize(W_);
    ag_c_.resize(W_);
  }
  size_t units(int rank) const override { return p_.ranks[rank].tile_order.size(); }
  int phases(int, size_t) const override { return 2; }
  const Wait* waits(int rank, size_t unit, int phase, size_t* n) const override {
    const RankPlan& rp = p_.ranks[rank];
    const RowHooks& h = rp.rows[rp.tile_order[unit] % p_.tiles_m];
    const uint32_t w0 = phase == 0 ? h.load_wait0 : h.store_wait0;
    *n = phase == 0 ? h.load_waits : h.store_waits;
    return rp.waits.data() + w0;
  }
  bool run(comm::Replay& r, int rank, size_t unit, int phase) override {
    return phase == 0 ? load_tile(r, rank, unit) : store_tile(r, rank, unit);
  }
  void start_call(comm::Replay& r, int me, int epoch) override;
  bool finish_call(comm::Replay& r, int me, int epoch) override;
  std::string unit_name(int rank, size_t unit) const override {
    const int id = p_.ranks[rank].tile_order[unit];
    return "tile (" + std::to_string(id % p_.tiles_m) + ", " + std::to_string(id / p_.tiles_m) + ")";
  }

 private:
  struct CallData {                            // inputs and reference of one call, all ranks
    std::vector<std::vector<float>> a, b;      // A (AG: shard [rows of the shard, K]; RS/AR: [M, K]), B [N, K]
    std::vector<std::vector<float>> prod;      // RS/AR: A·Bᵀ [M, N]
    std::vector<float> sum;                    // RS/AR: Σ over ranks
  };
  const CallData& call_data(int e);
  bool load_tile(comm::Replay& r, int me, size_t unit);
  bool store_tile(comm::Replay& r, int me, size_t unit);

  const Plan& p_;
  const int W_;
  const int64_t M_, N_, K_;
  bool ag_ = false;
  std::map<int, CallData> calls_;
  std::vector<std::map<size_t, std::vector<float>>> acc_;  // [rank] unit -> the tile's fp32 values
  std::vector<std::vector<uint16_t>> ag_c_;                // AG: the caller's C [M, N] (the GEMM writes it)
  uint64_t data_seed_ = 0;
  bool seeded_ = false;

 public:
  void set_seed(uint64_t s) { data_seed_ = s, seeded_ = true; }
};

// Fresh inputs for call e, drawn independently per rank (even ranks from [-2, 2], odd ones from
// [-1, 2]), and the fp32 reference, exact since every value is a small integer.
const GemmCompute::CallData& GemmCompute::call_data(int e) {
  auto it = calls_.find(e);
  if (it != calls_.end()) return it->second;
  CallData& d = calls_[e];
  std::mt19937_64 rng(test::mix(data_seed_, uint64_t(e)));
  for (int r = 0; r < W_; ++r) {
    const int lo = r % 2 ? -1 : -2;
    auto draw = [&](int64_t n) {
      std::vector<float> v(n);
      for (auto& x : v) x = float(lo + int(rng() % uint64_t(3 - lo)));
      return v;
    };
    d.a.push_back(draw((ag_ ? p_.rows_of(r) : M_) * K_));
    d.b.push_back(draw(N_ * K_));
  }
  if (!ag_) {
    d.sum.assign(M_ * N_, 0.f);
    for (int r = 0; r < W_; ++r) {
      std::vector<float> pr(M_ * N_);
      for (int64_t m = 0; m < M_; ++m)
        for (int64_t n = 0; n < N_; ++n) pr[m * N_ + n] = dot(&d.a[r][m * K_], &d.b[r][n * K_], K_);
      for (int64_t i = 0; i < M_ * N_; ++i) d.sum[i] += pr[i];
      d.prod.push_back(std::move(pr));
    }
  }
  return d;
}

void GemmCompute::start_call(comm::Replay& r, int me, int epoch) {
  if (!seeded_) set_seed(r.rng()());
  const CallData& d = call_data(epoch);
  acc_[me].clear();
  if (ag_) {
    uint8_t* a = r.mem(me, BufRef{Buf::kUserA, me, 0}, d.a[me].size() * 2);
    for (size_t i = 0; a && i < d.a[me].size(); ++i) {
      const uint16_t h = to_bf16(d.a[me][i]);
      memcpy(a + 2 * i, &h, 2);
    }
    if (a && p_.own_copy_before) {
      // The launch's copy of my shard into my gathered A (stream order: before the kernel).
      const uint64_t bytes = d.a[me].size() * 2;
      uint8_t* full = r.mem(me, BufRef{Buf::kAFull, me, uint64_t(p_.shard_row0[me] * K_ * 2)}, bytes);
      if (full) memcpy(full, a, bytes);
    }
    ag_c_[me].assign(M_ * N_, kPoison);
  } else {
    const uint64_t bytes = p_.buf_bytes(Buf::kUserC);
    uint8_t* c = r.mem(me, BufRef{Buf::kUserC, me, 0}, bytes);
    for (uint64_t i = 0; c && i < bytes; i += 2) memcpy(c + i, &kPoison, 2);
  }
}

// Checks rank me's output of its call (exact).
bool GemmCompute::finish_call(comm::Replay& r, int me, int epoch) {
  const CallData& d = call_data(epoch);
  const int64_t rows = p_.kind == FusedKind::kGemmRs ? p_.rows_of(me) : M_;
  const int64_t row0 = p_.kind == FusedKind::kGemmRs ? p_.shard_row0[me] : 0;
  const uint8_t* c = ag_ ? nullptr : r.mem(me, BufRef{Buf::kUserC, me, 0}, uint64_t(rows * N_ * 2));
  if (!ag_ && !c) return false;
  int64_t bad = 0;
  std::string first;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < N_; ++n) {
      const int64_t gm = row0 + m;
      const int sh = p_.shard_of(gm);
      float want;
      uint16_t got;
      if (ag_) {
        want = dot(&d.a[sh][(gm - p_.shard_row0[sh]) * K_], &d.b[me][n * K_], K_);
        got = ag_c_[me][m * N_ + n];
      } else {
        want = d.sum[gm * N_ + n];
        memcpy(&got, c + (m * N_ + n) * 2, 2);
      }
      if (got != to_bf16(want) && bad++ == 0) {
        char line[160];
        snprintf(line, sizeof line, "C[%lld][%lld] (shard %lld) = %g (0x%04x), expected %g", (long long)gm,
                 (long long)n, (long long)sh, from_bf16(got), got, want);
        first = line;
      }
    }
  if (bad) return r.fail(first + "; " + std::to_string(bad) + " wrong elements");
  return true;
}

// The GEMM main loop of a tile: AG reads A's rows from the gathered kAFull now.
bool GemmCompute::load_tile(comm::Replay& r, int me, size_t unit) {
  const int id = p_.ranks[me].tile_order[unit], tm = id % p_.tiles_m, tn = id / p_.tiles_m;
  const int64_t r0 = int64_t(tm) * kPlanTileM, r1 = std::min<int64_t>(M_, r0 + kPlanTileM);
  const int64_t c0 = int64_t(tn) * kPlanTileN, c1 = std::min<int64_t>(N_, c0 + kPlanTileN);
  const CallData& d = call_data(r.epoch(me));
  std::vector<float>& acc = acc_[me][unit];
  acc.assign((r1 - r0) * (c1 - c0), 0.f);
  std::vector<float> a(K_);
  for (int64_t m = r0; m < r1; ++m) {
    if (ag_) {
      const uint8_t* row = r.mem(me, BufRef{Buf::kAFull, me, uint64_t(m * K_ * 2)}, K_ * 2);
      if (!row) return false;
      for (int64_t k = 0; k < K_; ++k) {
        uint16_t h;
        memcpy(&h, row + 2 * k, 2);
        a[k] = from_bf16(h);
      }
    }
    for (int64_t n = c0; n < c1; ++n)
      acc[(m - r0) * (c1 - c0) + (n - c0)] = ag_ ? dot(a.data(), &d.b[me][n * K_], K_) : d.prod[me][m * N_ + n];
  }
  return true;
}

// The epilogue: AG stores bf16 into the caller's C; RS/AR add (or store) fp32 along the route.
bool GemmCompute::store_tile(comm::Replay& r, int me, size_t unit) {
  const RankPlan& rp = p_.ranks[me];
  const int id = rp.tile_order[unit], tm = id % p_.tiles_m, tn = id / p_.tiles_m;
  const int64_t r0 = int64_t(tm) * kPlanTileM, r1 = std::min<int64_t>(M_, r0 + kPlanTileM);
  const int64_t c0 = int64_t(tn) * kPlanTileN, c1 = std::min<int64_t>(N_, c0 + kPlanTileN), w = c1 - c0;
  const std::vector<float> acc_all = std::move(acc_[me][unit]);
  acc_[me].erase(unit);
  for (int64_t m = r0; m < r1; ++m) {
    const float* acc = &acc_all[(m - r0) * w];
    if (ag_) {
      for (int64_t n = 0; n < w; ++n) ag_c_[me][m * N_ + c0 + n] = to_bf16(acc[n]);
      continue;
    }
    const int sh = p_.shard_of(m);
    if (rp.fin.on && m >= rp.fin.lo && m < rp.fin.hi) {
      // The owner's final sum (RankPlan::fin): the terms in order, its own values at fin.self.
      const EpilogueFinal& f = rp.fin;
      std::vector<uint8_t*> src(f.srcs.size());
      for (size_t k = 0; k < f.srcs.size(); ++k) {
        BufRef at = f.srcs[k];
        at.offset += uint64_t(((m - f.row0) * N_ + c0) * 4);
        if (!(src[k] = r.mem(me, at, uint64_t(w) * 4))) return false;
      }
      std::vector<uint8_t*> dst(f.dsts.size());
      for (size_t d = 0; d < f.dsts.size(); ++d) {
        BufRef at = f.dsts[d];
        at.offset += uint64_t(((m - f.row0) * N_ + c0) * 2);
        if (!(dst[d] = r.mem(me, at, uint64_t(w) * 2))) return false;
      }
      for (int64_t n = 0; n < w; ++n) {
        float v = 0;
        for (size_t k = 0, t = 0; t <= f.srcs.size(); ++t) {
          float x = acc[n];
          if (int(t) != f.self) memcpy(&x, src[k++] + 4 * n, 4);
          v = t == 0 ? x : v + x;
        }
        if (f.zero_srcs)
          for (uint8_t* z : src) memset(z + 4 * n, 0, 4);
        const uint16_t b = to_bf16(v);
        for (uint8_t* d : dst) memcpy(d + 2 * n, &b, 2);
      }
      continue;
    }
    BufRef to = rp.route[sh];
    to.offset += uint64_t(((m - p_.shard_row0[sh]) * N_ + c0) * 4);
    uint8_t* dst = r.mem(me, to, uint64_t(w) * 4);
    if (!dst) return false;
    for (int64_t n = 0; n < w; ++n) {
      float v = acc[n];
      if (!p_.deterministic) {
        float old;
        memcpy(&old, dst + 4 * n, 4);
        v += old;
      }
      memcpy(dst + 4 * n, &v, 4);
    }
  }
  const RowHooks& h = rp.rows[tm];
  for (uint32_t i = 0; i < h.store_sigs; ++i) r.raise(me, rp.signals[h.store_sig0 + i]);
  return true;
}

// A plan's replay under a configuration's slots and seed.
class Replay {
 public:
  Replay(const Plan& p, const Config& c)
      : compute_(p), replay_(p, rank_programs(p), &compute_, comm::ReplayOptions{c.seed, c.comm_slots, c.tile_slots, kCalls}) {}
  bool run() { return replay_.run(); }
  const std::string& error() const { return replay_.error(); }

 private:
  GemmCompute compute_;
  comm::Replay replay_;
};

// ---- The sweep.
std::vector<Config> sweep() {
  std::vector<Config> out;
  const FusedKind kinds[] = {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr};
  for (int W : {1, 2, 3, 4, 6, 8, 16})
    for (int nodes : {1, 2, 4}) {
      if (nodes > W || W % nodes) continue;
      for (FusedKind k : kinds)
        for (bool det : {false, true}) {
          if (det && k == FusedKind::kAgGemm) continue;
          auto add = [&](int64_t rows_per_rank, int64_t N, int64_t K, int cs, int ts, int variant,
                         bool strided = false) {
            out.push_back(Config{k, W, nodes, rows_per_rank * W, N, K, det, cs, ts, variant, 0, strided, false, {}});
            // Several nodes: the staged network (host mirrors) too, same shapes.
            if (nodes > 1) {
              out.push_back(out.back());
              out.back().staged = true;
            }
          };
          add(48, 264, 16, 1, 1, 1);                // shards smaller than a tile, strict op order
          add(48, 264, 16, 8, 4, 2);                // many comm CTAs holding ops at once
          if (W <= 8) add(136, 264, 24, 2, 4, 3);   // shards straddling tile-rows
          if (W <= 4) add(200, 520, 16, 2, 1, 4);   // shards over a tile
          if (W == 16) add(48, 264, 16, 2, 4, 5);
          if (nodes > 1 && nodes < W) add(40, 264, 16, 2, 2, 6, true);  // nodes of strided ranks
          if (W > 1 && W <= 8) {
            // Uneven shards: 1 to 150 rows (some within one tile-row, some straddling two or
            // three, one of a single row), and one large shard among small ones.
            std::vector<int64_t> mixed, lopsided;
            for (int s = 0; s < W; ++s) {
              mixed.push_back(s == W - 1 ? 1 : 1 + (s * 53 + 17) % 150);
              lopsided.push_back(s == W / 2 ? 300 : 5 + s);
            }
            for (const auto& rows : {mixed, lopsided}) {
              add(0, 264, 16, 2, 4, rows == mixed ? 7 : 8);
              out.back().rows = rows;
              out.back().M = 0;
              for (int64_t x : rows) out.back().M += x;
              if (nodes > 1) {  // the staged twin add() appended
                out[out.size() - 2].rows = rows;
                out[out.size() - 2].M = out.back().M;
              }
            }
            // AR without rows: M not a multiple of W, split as evenly as it allows.
            if (k == FusedKind::kGemmAr) add(0, 264, 16, 2, 4, 9), out.back().M = 131 * W + W - 1;
            if (k == FusedKind::kGemmAr && nodes > 1) out[out.size() - 2].M = out.back().M;
          }
        }
    }
  return out;
}

class PlanReplay : public ::testing::TestWithParam<Config> {};

TEST_P(PlanReplay, ThreeCallsExact) {
  const Config c = seeded(GetParam());
  Plan p;
  MK_ASSERT_OK(build_plan(c.kind, shape_of(c), make_layout(c), c.det, &p, c.staged));
  ASSERT_EQ(p.even, c.rows.empty() && c.M % c.W == 0);
  ASSERT_EQ(p.net_staged, c.staged && c.nodes > 1);
  ASSERT_EQ(check_static(p), "") << seed_note(c);
  Replay replay(p, c);
  EXPECT_TRUE(replay.run()) << replay.error() << seed_note(c);
}

INSTANTIATE_TEST_SUITE_P(Sweep, PlanReplay, ::testing::ValuesIn(test::strided(sweep())),
                         [](const ::testing::TestParamInfo<Config>& i) { return config_name(i.param); });

// ---- Shapes and layouts the planner must refuse.
TEST(PlanErrors, RejectsBadShapesAndLayouts) {
  Plan p;
  for (FusedKind k : {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr}) {
    // M % W != 0 without the shards' rows: AG and RS need them (the caller's buffers), AR splits.
    Status s = build_plan(k, PlanShape{100, 264, 16}, comm::Layout::uniform(3, 1), false, &p);
    if (k == FusedKind::kGemmAr) {
      MK_EXPECT_OK(s);
      EXPECT_EQ(p.shard_row0, (std::vector<int64_t>{0, 34, 67, 100}));
      EXPECT_FALSE(p.even);
    } else {
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find("PlanShape::rows"), std::string::npos) << s.to_string();
    }
    s = build_plan(k, PlanShape{2, 264, 16}, comm::Layout::uniform(3, 1), false, &p);  // fewer rows than ranks
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    // Shards' rows: one per rank, each >= 1, summing to M.
    for (const std::vector<int64_t>& rows : {std::vector<int64_t>{50, 50}, {50, 0, 50}, {50, 60, -10}, {40, 40, 40}}) {
      s = build_plan(k, PlanShape(100, 264, 16, rows), comm::Layout::uniform(3, 1), false, &p);
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
      EXPECT_EQ(s.code(), FusedGemm::can_implement(k, PlanShape(100, 264, 16, rows), 3).code());
    }
    MK_EXPECT_OK(build_plan(k, PlanShape(100, 264, 16, {1, 98, 1}), comm::Layout::uniform(3, 1), false, &p));
    EXPECT_EQ(p.shard_row0, (std::vector<int64_t>{0, 1, 99, 100}));
    EXPECT_EQ(p.shard_rows, 98);
    EXPECT_EQ(p.shard_of(0), 0);
    EXPECT_EQ(p.shard_of(1), 1);
    EXPECT_EQ(p.shard_of(98), 1);
    EXPECT_EQ(p.shard_of(99), 2);
    s = build_plan(k, PlanShape{96, 100, 16}, comm::Layout::uniform(3, 1), false, &p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    s = build_plan(k, PlanShape{96, 264, 0}, comm::Layout::uniform(3, 1), false, &p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    comm::Layout odd;  // nodes of 2 and 1 ranks
    odd.world = 3;
    odd.node_of = {0, 0, 1};
    odd.local_of = {0, 1, 0};
    odd.node_ranks = {{0, 1}, {2}};
    s = build_plan(k, PlanShape{96, 264, 16}, odd, false, &p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  }
}

TEST(PlanDescribe, EveryRankHasALog) {
  for (FusedKind k : {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr}) {
    Plan p;
    MK_ASSERT_OK(build_plan(k, PlanShape{192, 264, 16}, comm::Layout::uniform(4, 2), true, &p));
    for (int r = 0; r < 4; ++r) {
      const std::string d = describe(p, r);
      EXPECT_FALSE(d.empty());
      EXPECT_NE(d.find(fused_kind_name(k)), std::string::npos) << d;
    }
  }
}

// ---- Mutation tests: every broken plan must be rejected.
//
// Each test takes valid plans (below), breaks them one site at a time and checks that the
// mutant is rejected: by the static pass (flag accounting and op order), by the replay (a
// wrong output, a deadlock, an access outside a buffer), or by both, as the class requires.
// The replay is random, so a mutant that only shows under some interleavings (a missing wait
// lets an op run early only if the scheduler happens to run it early) is replayed under fresh
// seeds — and 1, 2, 4 or 8 comm slots, 1, 2 or 4 tile slots — until it fails, up to a bound;
// the seeds derive from the run seed, so a run is reproducible. A mutant never caught fails the
// test, named with its plan, rank, op and change.

struct Mutant {
  std::string what;
  std::function<void(Plan&)> apply;
};
enum class Detect {
  kStatic,        // check_static must reject it
  kReplay,        // check_static or the replay (some seed within the bound) must reject it
  kStaticAndOne,  // check_static must reject it, and so must the replay with one comm slot
};

std::vector<Config> mutation_bases() {
  std::vector<Config> out;
  auto add = [&](FusedKind k, int W, int nodes, bool det, bool staged, int64_t rows_per_rank) {
    Config c;
    c.kind = k, c.W = W, c.nodes = nodes, c.M = rows_per_rank * W, c.N = 264, c.K = 8;
    c.det = det, c.staged = staged, c.comm_slots = 4, c.tile_slots = 2;
    out.push_back(c);
  };
  // Shards smaller than a tile-row (48 rows) and straddling tile-rows (136 rows); one node, two
  // nodes of two ranks and nodes of one rank; direct and staged network; both reductions.
  add(FusedKind::kAgGemm, 2, 1, false, false, 136);
  add(FusedKind::kAgGemm, 4, 2, false, false, 48);
  add(FusedKind::kAgGemm, 4, 2, false, true, 48);
  add(FusedKind::kAgGemm, 2, 2, false, true, 136);
  add(FusedKind::kGemmRs, 2, 1, false, false, 136);
  add(FusedKind::kGemmRs, 4, 2, false, false, 48);
  add(FusedKind::kGemmRs, 4, 2, false, true, 48);
  add(FusedKind::kGemmRs, 4, 2, true, true, 48);
  add(FusedKind::kGemmRs, 2, 2, false, false, 136);
  add(FusedKind::kGemmAr, 2, 1, true, false, 136);
  add(FusedKind::kGemmAr, 4, 2, false, false, 48);
  add(FusedKind::kGemmAr, 4, 2, false, true, 48);
  add(FusedKind::kGemmAr, 4, 2, true, false, 48);
  add(FusedKind::kGemmAr, 4, 4, false, true, 48);
  // Uneven shards (a shard inside one tile-row, one straddling two, a single row).
  for (FusedKind k : {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr}) {
    add(k, 4, 2, k == FusedKind::kGemmAr, k == FusedKind::kGemmRs, 0);
    out.back().rows = {150, 1, 40, 129};
    out.back().M = 320;
  }
  return out;
}

std::string op_site(const Plan& p, int r, size_t i) {
  const Op& op = p.ranks[r].ops[i];
  return "rank " + std::to_string(r) + " op " + std::to_string(i) + " " + comm::op_kind_name(op.kind) + " (" + op.what + ")";
}
std::string wait_desc(const Wait& w) { return flag_str(w.flag) + " >= " + std::to_string(w.mul) + "*e"; }
std::string signal_desc(const comm::Signal& s) {
  return flag_str(s.flag) + (s.add ? " += " : " = ") + std::to_string(s.value) + (s.add ? "" : "*e");
}
// The entry handshake across nodes: an 8-byte put whose payload nobody reads (only its arrival
// flag counts), so its bytes and offsets are not data.
bool token_put(const Op& op) { return op.kind == OpKind::kNetPut && op.remote_flag.region == Region::kEntryNet; }

// Hook ranges of one tile-row, by kind: (first, count) into the rank's pools.
struct HookRange {
  const char* name;
  uint32_t RowHooks::*first;
  uint32_t RowHooks::*count;
};
const HookRange kHookWaits[] = {{"load wait", &RowHooks::load_wait0, &RowHooks::load_waits},
                                {"store wait", &RowHooks::store_wait0, &RowHooks::store_waits}};
std::string hook_site(int r, int tm, const char* what, uint32_t i) {
  return "rank " + std::to_string(r) + " tile-row " + std::to_string(tm) + " " + what + " " + std::to_string(i);
}
// Removes entry i of a tile-row's range (moves it past the end of the range).
template <class T>
void drop_hook(std::vector<T>& pool, RowHooks& h, uint32_t RowHooks::*first, uint32_t RowHooks::*count, uint32_t i) {
  std::swap(pool[h.*first + i], pool[h.*first + h.*count - 1]);
  --(h.*count);
}

// Waits whose dependency another chain of waits already orders, so that dropping one leaves a
// correct plan (no interleaving can show it); the test drops every other wait.
//  - Staged plans, waits for a put's local completion (kSrcFree): a staged put reads a host
//    mirror that only this rank's next staged put into the same rows overwrites, and that put
//    waits until the twin entered the next call (kEntryNet), which the twin does only once this
//    call's data arrived — so the mirror is free before it is reused, wait or not. (On the direct
//    path the source is a device buffer that the next call's copies, tile stores or zeroing
//    rewrite without such a wait: those are dropped and caught.)
//  - All-reduce, the reuse waits (kEntry, kEntryNet, kSrcFree: "the peer is done with the
//    previous call's contents"): a rank ends call e only when its C holds every row, i.e. after
//    every rank's final sum of call e, which came after every partial of call e was delivered and
//    summed; and it writes into a peer's kCws or kRecv in call e + 1 only after a flag of call
//    e + 1 that the peer's own tiles or puts raised (row counts count every local rank's tiles;
//    a final sum needs the twins' partials). So each reuse is ordered twice. Except the zeroing
//    of a sent partial (non-deterministic plans): nothing else orders it after the proxy read the
//    partial, so its kSrcFree wait is dropped and caught. The same reuse waits are built by the
//    same code for reduce-scatter, where nothing else orders them: dropped and caught there.
bool implied_wait(const Plan& p, const Wait& w, const Op* op) {
  const RegionId r = w.flag.region;
  if (p.net_staged && r == Region::kSrcFree) return true;
  const bool reuse = r == Region::kEntry || r == Region::kEntryNet || r == Region::kSrcFree;
  return p.kind == FusedKind::kGemmAr && reuse && !(op && op->kind == OpKind::kZero);
}

// Sites where dropping the wait must show in the replay: every wait of every op and every
// tile-row hook wait, except implied_wait() ones.
std::vector<Mutant> drop_wait_mutants(const Plan& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r) {
    const RankPlan& rp = p.ranks[r];
    for (size_t i = 0; i < rp.ops.size(); ++i)
      for (size_t j = 0; j < rp.ops[i].waits.size(); ++j) {
        if (implied_wait(p, rp.ops[i].waits[j], &rp.ops[i])) continue;
        out.push_back({op_site(p, r, i) + ": drop wait " + wait_desc(rp.ops[i].waits[j]),
                       [=](Plan& m) { auto& w = m.ranks[r].ops[i].waits; w.erase(w.begin() + j); }});
      }
    for (int tm = 0; tm < p.tiles_m; ++tm)
      for (const HookRange& hr : kHookWaits)
        for (uint32_t j = 0; j < rp.rows[tm].*hr.count; ++j) {
          const Wait& w = rp.waits[rp.rows[tm].*hr.first + j];
          if (implied_wait(p, w, nullptr)) continue;
          out.push_back({hook_site(r, tm, hr.name, j) + ": drop " + wait_desc(w), [=](Plan& m) {
                           RankPlan& q = m.ranks[r];
                           drop_hook(q.waits, q.rows[tm], hr.first, hr.count, j);
                         }});
        }
  }
  return out;
}

// Flags some op or tile-row waits on, as (rank, pad index). A signal on any other flag guards
// nothing (the single-node AG still marks its chunks ready for puts it does not have): changing
// or dropping it changes nothing, so the signal mutants leave those alone.
std::set<std::pair<int, uint32_t>> waited_flags(const Plan& p) {
  std::set<std::pair<int, uint32_t>> out;
  for (const RankPlan& rp : p.ranks) {
    for (const Op& op : rp.ops)
      for (const Wait& w : op.waits) out.insert({w.flag.rank, p.flag_index(w.flag)});
    for (const Wait& w : rp.waits) out.insert({w.flag.rank, p.flag_index(w.flag)});
  }
  return out;
}

// Every wait's count one more and one less; every (waited) signal's value one more and one less.
std::vector<Mutant> count_mutants(const Plan& p) {
  const auto waited = waited_flags(p);
  auto guards = [&](const comm::Signal& s) { return waited.count({s.flag.rank, p.flag_index(s.flag)}) > 0; };
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r) {
    const RankPlan& rp = p.ranks[r];
    for (int d : {+1, -1}) {
      const std::string by = d > 0 ? " + 1" : " - 1";
      for (size_t i = 0; i < rp.ops.size(); ++i) {
        for (size_t j = 0; j < rp.ops[i].waits.size(); ++j)
          out.push_back({op_site(p, r, i) + ": wait count of " + wait_desc(rp.ops[i].waits[j]) + by,
                         [=](Plan& m) { m.ranks[r].ops[i].waits[j].mul += d; }});
        for (size_t j = 0; j < rp.ops[i].signals.size(); ++j)
          if (guards(rp.ops[i].signals[j]))
            out.push_back({op_site(p, r, i) + ": value of " + signal_desc(rp.ops[i].signals[j]) + by,
                           [=](Plan& m) { m.ranks[r].ops[i].signals[j].value += d; }});
      }
      for (size_t j = 0; j < rp.waits.size(); ++j)
        out.push_back({"rank " + std::to_string(r) + " hook wait " + std::to_string(j) + ": count of " +
                           wait_desc(rp.waits[j]) + by,
                       [=](Plan& m) { m.ranks[r].waits[j].mul += d; }});
      for (size_t j = 0; j < rp.signals.size(); ++j)
        if (guards(rp.signals[j]))
          out.push_back({"rank " + std::to_string(r) + " hook signal " + std::to_string(j) + ": value of " +
                             signal_desc(rp.signals[j]) + by,
                         [=](Plan& m) { m.ranks[r].signals[j].value += d; }});
    }
  }
  return out;
}

// Every (waited) signal of every op and tile-row dropped, and every put's local-completion flag.
std::vector<Mutant> drop_signal_mutants(const Plan& p) {
  const auto waited = waited_flags(p);
  auto guards = [&](const comm::Signal& s) { return waited.count({s.flag.rank, p.flag_index(s.flag)}) > 0; };
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r) {
    const RankPlan& rp = p.ranks[r];
    for (size_t i = 0; i < rp.ops.size(); ++i) {
      for (size_t j = 0; j < rp.ops[i].signals.size(); ++j)
        if (guards(rp.ops[i].signals[j]))
          out.push_back({op_site(p, r, i) + ": drop signal " + signal_desc(rp.ops[i].signals[j]),
                       [=](Plan& m) { auto& v = m.ranks[r].ops[i].signals; v.erase(v.begin() + j); }});
      if (rp.ops[i].kind == OpKind::kNetPut && rp.ops[i].local_flag.region != comm::kNoRegion)
        out.push_back({op_site(p, r, i) + ": drop local completion " + flag_str(rp.ops[i].local_flag),
                       [=](Plan& m) { m.ranks[r].ops[i].local_flag = FlagRef{}; }});
    }
    for (int tm = 0; tm < p.tiles_m; ++tm)
      for (uint32_t j = 0; j < rp.rows[tm].store_sigs; ++j)
        if (guards(rp.signals[rp.rows[tm].store_sig0 + j]))
          out.push_back({hook_site(r, tm, "store signal", j) + ": drop " +
                           signal_desc(rp.signals[rp.rows[tm].store_sig0 + j]),
                       [=](Plan& m) {
                         RankPlan& q = m.ranks[r];
                         drop_hook(q.signals, q.rows[tm], &RowHooks::store_sig0, &RowHooks::store_sigs, j);
                       }});
  }
  return out;
}

// Two ops of one rank swapped where the later one waits for a flag the earlier one raises (a
// signal, or a put's local completion): the copy of a chunk and the put that sends it, a node
// sum and its put, a put and the op that waits for its source to be free, a forward and the copy
// of the finished rows to C, ...
std::vector<Mutant> swap_mutants(const Plan& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r) {
    const RankPlan& rp = p.ranks[r];
    for (size_t i = 0; i < rp.ops.size(); ++i) {
      std::vector<FlagRef> raised;
      for (const auto& s : rp.ops[i].signals) raised.push_back(s.flag);
      if (rp.ops[i].kind == OpKind::kNetPut && rp.ops[i].local_flag.region != comm::kNoRegion)
        raised.push_back(rp.ops[i].local_flag);
      for (size_t j = i + 1; j < rp.ops.size(); ++j) {
        bool dep = false;
        for (const auto& w : rp.ops[j].waits)
          for (const auto& f : raised) dep |= p.flag_index(f) == p.flag_index(w.flag) && f.rank == w.flag.rank;
        if (dep)
          out.push_back({op_site(p, r, i) + " swapped with op " + std::to_string(j) + " (" + rp.ops[j].what +
                             "), which waits for it",
                         [=](Plan& m) { std::swap(m.ranks[r].ops[i], m.ranks[r].ops[j]); }});
      }
    }
  }
  return out;
}

// Copies, zeroes and puts two bytes short and half short; reduces one element and half short.
std::vector<Mutant> shorten_mutants(const Plan& p) {
  std::vector<Mutant> out;
  for (int r = 0; r < p.layout.world; ++r) {
    const RankPlan& rp = p.ranks[r];
    for (size_t i = 0; i < rp.ops.size(); ++i) {
      const Op& op = rp.ops[i];
      const bool bytes = op.kind == OpKind::kCopy || op.kind == OpKind::kZero ||
                         (op.kind == OpKind::kNetPut && !token_put(op));
      if (bytes && op.bytes >= 4) {
        out.push_back({op_site(p, r, i) + ": " + std::to_string(op.bytes) + " bytes - 2",
                       [=](Plan& m) { m.ranks[r].ops[i].bytes -= 2; }});
        out.push_back({op_site(p, r, i) + ": " + std::to_string(op.bytes) + " bytes / 2",
                       [=](Plan& m) { m.ranks[r].ops[i].bytes /= 2; }});
      }
      if (op.kind == OpKind::kReduce && op.elems >= 2) {
        out.push_back({op_site(p, r, i) + ": " + std::to_string(op.elems) + " elements - 1",
                       [=](Plan& m) { m.ranks[r].ops[i].elems -= 1; }});
        out.push_back({op_site(p, r, i) + ": " + std::to_string(op.elems) + " elements / 2",
                       [=](Plan& m) { m.ranks[r].ops[i].elems /= 2; }});
      }
    }
  }
  return out;
}

// Every destination of every copy, zero, reduce and put, and every epilogue route, 16 bytes off
// (forward where that stays inside the buffer, else back).
std::vector<Mutant> offset_mutants(const Plan& p) {
  std::vector<Mutant> out;
  auto shift = [&p](const BufRef& b, uint64_t len) -> int64_t {
    const uint64_t size = p.buf_bytes(b.buf);
    if (b.buf == Buf::kUserA || b.buf == Buf::kUserC || b.offset + len + 16 <= size) return 16;
    return b.offset >= 16 ? -16 : 16;
  };
  for (int r = 0; r < p.layout.world; ++r) {
    const RankPlan& rp = p.ranks[r];
    for (size_t i = 0; i < rp.ops.size(); ++i) {
      const Op& op = rp.ops[i];
      if (op.kind == OpKind::kSignal || token_put(op)) continue;
      const uint64_t len = op.kind == OpKind::kReduce ? op.elems * (op.dst_f32 ? 4 : 2) : op.bytes;
      for (size_t j = 0; j < op.dsts.size(); ++j) {
        const int64_t d = shift(op.dsts[j], len);
        out.push_back({op_site(p, r, i) + ": destination " + ref_str(op.dsts[j]) + (d > 0 ? " + 16" : " - 16"),
                       [=](Plan& m) { m.ranks[r].ops[i].dsts[j].offset += d; }});
      }
    }
    for (size_t s = 0; s < rp.route.size(); ++s) {
      const int64_t d = shift(rp.route[s], uint64_t(p.shard_rows) * p.shape.N * 4);
      out.push_back({"rank " + std::to_string(r) + " epilogue route of shard " + std::to_string(s) + ": " +
                         ref_str(rp.route[s]) + (d > 0 ? " + 16" : " - 16"),
                     [=](Plan& m) { m.ranks[r].route[s].offset += d; }});
    }
  }
  return out;
}

// The replay's bound per mutant. Measured over 200 seeds per site, the hardest sites (a dropped
// entry wait that shows only when one rank runs a whole call ahead of a slow twin) fail under
// about 1.5% of the seeds, most under far more; a site caught with probability p per seed
// escapes 2000 seeds with probability (1 - p)^2000 (p = 1%: 2e-9). Mutants cost only the seeds
// they need (on average about 4 per drop-wait site, 1 for the others).
constexpr int kMaxSeedsPerMutant = 2000;

class PlanMutation : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    base_ = seeded(GetParam());
    MK_ASSERT_OK(build_plan(base_.kind, shape_of(base_), make_layout(base_), base_.det, &plan_, base_.staged));
    // The unmutated plan passes, under the slot counts the mutants are replayed with.
    ASSERT_EQ(check_static(plan_), "") << seed_note(base_);
    for (int k = 0; k < 4; ++k) {
      Config c = attempt(base_, "unmutated", k);
      Replay replay(plan_, c);
      ASSERT_TRUE(replay.run()) << "unmutated plan: " << replay.error() << seed_note(c);
    }
  }
  // Seed k of a mutant: its own replay seed and slot counts.
  static Config attempt(const Config& base, const std::string& what, int k) {
    Config c = seeded(base, test::mix(name_hash(what), uint64_t(k)));
    static const int comm[] = {1, 2, 4, 8}, tile[] = {1, 2, 4};
    c.comm_slots = comm[k % 4];
    c.tile_slots = tile[(k / 4) % 3];
    return c;
  }
  // Applies each mutant to a copy of the plan and expects it rejected as `detect` says.
  // allow_none: the plan may have no site of this class (then there is nothing to break).
  // Under MK_TEST_STRIDE only some of them (test::strided).
  void expect_rejected(const char* cls, std::vector<Mutant> mutants, Detect detect, bool allow_none = false) {
    mutants = test::strided(std::move(mutants));
    if (mutants.empty() && allow_none) {
      printf("%s on %s: no site\n", cls, config_name(base_).c_str());
      return;
    }
    ASSERT_FALSE(mutants.empty()) << cls << ": no site in " << config_name(base_);
    std::vector<std::string> missed;
    int most = 0, by_static = 0;
    std::string hardest;
    for (const Mutant& mu : mutants) {
      Plan m = plan_;
      mu.apply(m);
      const std::string why = check_static(m);
      if (!why.empty()) ++by_static;
      if (detect == Detect::kStatic) {
        if (why.empty()) missed.push_back(mu.what + " (the static check passed it)");
        continue;
      }
      if (detect == Detect::kStaticAndOne) {
        if (why.empty()) missed.push_back(mu.what + " (the static check passed it)");
        Config c = attempt(base_, mu.what, 0);  // comm_slots 1: ops strictly in list order
        c.comm_slots = 1;
        Replay replay(m, c);
        if (replay.run()) missed.push_back(mu.what + " (the replay with one comm slot passed it)" + seed_note(c));
        else if (replay.error().find("deadlock") == std::string::npos)
          missed.push_back(mu.what + " (one comm slot failed other than by deadlock: " + replay.error() + ")");
        continue;
      }
      if (!why.empty()) continue;
      int k = 0;
      for (; k < kMaxSeedsPerMutant; ++k) {
        Replay replay(m, attempt(base_, mu.what, k));
        if (!replay.run()) break;
      }
      if (k == kMaxSeedsPerMutant) {
        missed.push_back(mu.what + " (passed the replay under " + std::to_string(k) + " seeds)");
      } else if (k + 1 > most) {
        most = k + 1;
        hardest = mu.what;
      }
    }
    printf("%s on %s: %zu mutants, %zu missed; %d rejected by the static check%s\n", cls, config_name(base_).c_str(),
           mutants.size(), missed.size(), by_static,
           most ? (", the replay needed up to " + std::to_string(most) + " seeds (" + hardest + ")").c_str() : "");
    std::string list;
    for (const auto& s : missed) list += "\n  " + s;
    EXPECT_TRUE(missed.empty()) << missed.size() << " of " << mutants.size() << " " << cls
                                << " mutants were not caught:" << list << "\n" << seed_note(base_);
  }
  Config base_;
  Plan plan_;
};

TEST_P(PlanMutation, DroppedWaitIsCaught) { expect_rejected("drop-wait", drop_wait_mutants(plan_), Detect::kReplay); }
TEST_P(PlanMutation, ChangedCountOrValueIsCaught) {
  expect_rejected("count/value", count_mutants(plan_), Detect::kStatic);
}
TEST_P(PlanMutation, DroppedSignalIsCaught) {
  expect_rejected("drop-signal", drop_signal_mutants(plan_), Detect::kStatic);
}
// On one node a rank's ops wait only for other ranks' ops and tiles (none for its own): no site.
TEST_P(PlanMutation, SwappedDependentOpsAreCaught) {
  expect_rejected("swap", swap_mutants(plan_), Detect::kStaticAndOne, /*allow_none=*/base_.nodes == 1);
}
TEST_P(PlanMutation, ShortenedCopyIsCaught) { expect_rejected("shorten", shorten_mutants(plan_), Detect::kReplay); }
TEST_P(PlanMutation, WrongDestinationIsCaught) {
  expect_rejected("offset", offset_mutants(plan_), Detect::kReplay);
}

INSTANTIATE_TEST_SUITE_P(Mutations, PlanMutation, ::testing::ValuesIn(mutation_bases()),
                         [](const ::testing::TestParamInfo<Config>& i) { return config_name(i.param); });

}  // namespace
}  // namespace ops
}  // namespace mk
