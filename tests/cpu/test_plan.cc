// CPU replay of the fused-operator plans (ops/plan.h). Every rank's plan runs at once on host
// buffers under a seeded random interleaving of its communication slots (several comm CTAs
// taking ops in list order), its GEMM tile slots and its proxy (puts delivered later, reading
// their source at delivery), for three consecutive calls (epochs 1..3); a rank starts its next
// call as soon as its own call ends, so ranks run ahead of each other. Inputs are small
// integers in bf16, so every sum is exact and each rank's output is checked bit for bit the
// moment its call ends. A schedule where nothing can move fails as a deadlock, with the blocked
// op or tile and its wait for every rank. A static pass checks the flag accounting: every wait
// is on a flag the plan raises exactly `mul` times per call (or sets once), on the waiter's node,
// and proxy regions are raised only by the proxy.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "mkernel/ops/plan.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

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

std::string flag_str(const FlagRef& f) {
  return std::string(region_name(f.region)) + "[rank " + std::to_string(f.rank) + "][" +
         std::to_string(f.index) + "]";
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
  uint64_t seed = 1;
  bool strided = false;  // node n holds ranks n, n + nodes, ... instead of a consecutive block
};
PlanLayout make_layout(const Config& c) {
  if (!c.strided) return PlanLayout::uniform(c.W, c.nodes);
  PlanLayout l;
  l.world = c.W;
  l.node_ranks.assign(c.nodes, {});
  for (int r = 0; r < c.W; ++r) {
    l.node_of.push_back(r % c.nodes);
    l.local_of.push_back(r / c.nodes);
    l.node_ranks[r % c.nodes].push_back(r);
  }
  return l;
}
std::string config_name(const Config& c) {
  std::string s = fused_kind_name(c.kind);
  if (c.det) s += "_det";
  return s + "_W" + std::to_string(c.W) + (c.strided ? "s" : "n") + std::to_string(c.nodes) + "_M" + std::to_string(c.M) + "_N" +
         std::to_string(c.N) + "_K" + std::to_string(c.K) + "_c" + std::to_string(c.comm_slots) + "_t" +
         std::to_string(c.tile_slots) + "_s" + std::to_string(c.seed);
}
void PrintTo(const Config& c, std::ostream* os) { *os << config_name(c); }  // gtest's failure line

// ---- Static checks: tile orders, hook ranges and the flag accounting of every rank's plan.
std::string check_static(const Plan& p) {
  const int W = p.layout.world;
  const auto& node = p.layout.node_of;
  auto invalid = [&](const FlagRef& f) {
    return f.region >= Region::kCount || f.rank < 0 || f.rank >= W || f.index >= p.region_size[int(f.region)];
  };
  struct Raises { uint64_t adds = 0, sets = 0, set_value = 0; };
  std::map<std::pair<int, uint32_t>, Raises> raised;  // (rank, pad index) -> raises per call
  auto key = [&](const FlagRef& f) { return std::make_pair(f.rank, p.flag_index(f)); };
  std::string err;
  auto device = [&](int me, const PlanSignal& s, uint64_t times, const std::string& who) {
    if (invalid(s.flag)) err = who + ": invalid signal flag " + flag_str(s.flag);
    else if (p.proxy_region(s.flag.region)) err = who + ": device signal on proxy flag " + flag_str(s.flag);
    else if (node[s.flag.rank] != node[me]) err = who + ": device signal to another node " + flag_str(s.flag);
    if (!err.empty()) return;
    Raises& r = raised[key(s.flag)];
    if (s.add) r.adds += s.value * times;
    else r.sets += times, r.set_value = s.value;
  };
  auto proxy = [&](const FlagRef& f, const std::string& who) {
    if (invalid(f)) err = who + ": invalid put flag " + flag_str(f);
    else if (!p.proxy_region(f.region)) err = who + ": the proxy raises device flag " + flag_str(f);
    else raised[key(f)].adds += 1;
  };
  for (int me = 0; me < W && err.empty(); ++me) {
    const RankPlan& rp = p.ranks[me];
    const std::string rk = "rank " + std::to_string(me);
    std::vector<int> order = rp.tile_order;
    std::sort(order.begin(), order.end());
    for (int t = 0; t < p.tiles_m * p.tiles_n; ++t)
      if (int(order.size()) != p.tiles_m * p.tiles_n || order[t] != t) return rk + ": tile_order is not a permutation";
    if (int(rp.rows.size()) != p.tiles_m) return rk + ": rows.size() != tiles_m";
    if (p.kind != FusedKind::kAgGemm && int(rp.route.size()) != W) return rk + ": route.size() != world";
    for (size_t i = 0; i < rp.ops.size() && err.empty(); ++i) {
      const CommOp& op = rp.ops[i];
      const std::string who = rk + " op " + std::to_string(i) + " (" + op.what + ")";
      for (const auto& s : op.signals) device(me, s, 1, who);
      if (op.kind == CommKind::kNetPut) {
        if (op.remote_flag.rank != op.peer) err = who + ": remote flag not on the destination rank";
        if (op.local_flag.region != Region::kCount && op.local_flag.rank != me) err = who + ": local flag elsewhere";
        proxy(op.remote_flag, who);
        if (op.local_flag.region != Region::kCount) proxy(op.local_flag, who);
      }
    }
    for (int tm = 0; tm < p.tiles_m && err.empty(); ++tm) {
      const RowHooks& h = rp.rows[tm];
      if (h.load_wait0 + h.load_waits > rp.waits.size() || h.store_wait0 + h.store_waits > rp.waits.size() ||
          h.store_sig0 + h.store_sigs > rp.signals.size())
        return rk + ": hook range of tile-row " + std::to_string(tm) + " outside the pools";
      for (uint32_t i = 0; i < h.store_sigs; ++i)  // raised once by every tile of the row
        device(me, rp.signals[h.store_sig0 + i], uint64_t(p.tiles_n), rk + " tile-row " + std::to_string(tm));
    }
  }
  if (!err.empty()) return err;
  auto check_wait = [&](int me, const PlanWait& w, const std::string& who) {
    if (invalid(w.flag)) return err = who + ": invalid wait flag " + flag_str(w.flag), false;
    if (node[w.flag.rank] != node[me]) return err = who + ": waits on another node's flag " + flag_str(w.flag), false;
    auto it = raised.find(key(w.flag));
    const std::string f = flag_str(w.flag) + " >= " + std::to_string(w.mul) + "*e";
    if (it == raised.end()) return err = who + ": waits on " + f + " which nothing raises (deadlock)", false;
    const Raises& r = it->second;
    if (r.adds && r.sets) return err = who + ": " + f + " is both set and added", false;
    if (r.sets && (r.sets != 1 || w.mul > r.set_value))
      return err = who + ": " + f + " is set " + std::to_string(r.sets) + " times per call", false;
    if (r.adds && r.adds != w.mul)
      return err = who + ": waits " + f + " but the plan adds " + std::to_string(r.adds) + " per call", false;
    return true;
  };
  for (int me = 0; me < W; ++me) {
    const RankPlan& rp = p.ranks[me];
    for (size_t i = 0; i < rp.ops.size(); ++i)
      for (const auto& w : rp.ops[i].waits)
        if (!check_wait(me, w, "rank " + std::to_string(me) + " op " + std::to_string(i) + " (" + rp.ops[i].what + ")"))
          return err;
    for (int tm = 0; tm < p.tiles_m; ++tm) {
      const RowHooks& h = rp.rows[tm];
      const std::string who = "rank " + std::to_string(me) + " tile-row " + std::to_string(tm);
      for (uint32_t i = 0; i < h.load_waits; ++i)
        if (!check_wait(me, rp.waits[h.load_wait0 + i], who + " load")) return err;
      for (uint32_t i = 0; i < h.store_waits; ++i)
        if (!check_wait(me, rp.waits[h.store_wait0 + i], who + " store")) return err;
    }
  }
  return "";
}

// ---- The replay engine.
class Replay {
 public:
  Replay(const Plan& p, const Config& c)
      : p_(p), rng_(c.seed), W_(p.layout.world), M_(p.shape.M), N_(p.shape.N), K_(p.shape.K), Ms_(p.shard_rows) {
    ag_ = p.kind == FusedKind::kAgGemm;
    ranks_.resize(W_);
    for (int r = 0; r < W_; ++r) {
      RankState& s = ranks_[r];
      for (int b = 0; b < int(Buf::kCount); ++b) s.mem[b].assign(buf_size(Buf(b)), 0);
      s.flags.assign(p.pad_flags, 0);
      s.comm.assign(c.comm_slots, -1);
      s.tiles.resize(c.tile_slots);
    }
  }
  bool run();
  const std::string& error() const { return err_; }

 private:
  struct TileSlot {
    int idx = -1;  // position in tile_order; -1: free
    bool loaded = false;
    std::vector<float> acc;  // the tile's fp32 values after the main loop
  };
  struct RankState {
    std::array<std::vector<uint8_t>, int(Buf::kCount)> mem;
    std::vector<uint64_t> flags;
    std::vector<uint16_t> ag_c;  // AG: the caller's C [M, N] (written by the GEMM directly)
    int epoch = 0;
    unsigned speed = 1;  // scheduling weight of this call: fast ranks run ahead into their next
    bool active = false;
    size_t next_op = 0, ops_done = 0, next_tile = 0, tiles_done = 0;
    std::vector<int> comm;      // op held by each comm slot; -1: free
    std::vector<TileSlot> tiles;
    std::deque<int> in_flight;  // issued puts (op indices), delivered in order
  };
  struct CallData {                            // inputs and reference of one call, all ranks
    std::vector<std::vector<float>> a, b;      // A (AG: shard [Ms, K]; RS/AR: [M, K]), B [N, K]
    std::vector<std::vector<float>> prod;      // RS/AR: A·Bᵀ [M, N]
    std::vector<float> sum;                    // RS/AR: Σ over ranks
  };
  enum class UnitKind { kComm, kTile, kDeliver };
  struct Unit { UnitKind kind; int rank, slot; };

  uint64_t buf_size(Buf b) const {
    if (b == Buf::kUserA) return ag_ ? uint64_t(Ms_ * K_ * 2) : 0;
    if (b == Buf::kUserC) return ag_ ? 0 : uint64_t((p_.kind == FusedKind::kGemmRs ? Ms_ : M_) * N_ * 2);
    return p_.buf_bytes[int(b)];
  }
  bool fail(const std::string& m) {
    if (err_.empty()) err_ = ctx_ + ": " + m;
    return false;
  }
  // Bytes [offset, offset + bytes) of a buffer, as rank `me` may reach them (net: via the proxy).
  uint8_t* mem(int me, const BufRef& b, uint64_t bytes, bool net) {
    if (b.buf >= Buf::kCount || b.rank < 0 || b.rank >= W_) return fail("bad buffer " + ref_str(b)), nullptr;
    const bool user = b.buf == Buf::kUserA || b.buf == Buf::kUserC;
    if (user && (b.rank != me || net)) return fail("touches the caller's buffer " + ref_str(b)), nullptr;
    if (!net && p_.layout.node_of[b.rank] != p_.layout.node_of[me])
      return fail("touches " + ref_str(b) + " on another node without the proxy"), nullptr;
    auto& v = ranks_[b.rank].mem[int(b.buf)];
    if (b.offset + bytes > v.size())
      return fail(ref_str(b) + " + " + std::to_string(bytes) + " bytes is past its " + std::to_string(v.size())), nullptr;
    return v.data() + b.offset;
  }
  uint64_t& flag(const FlagRef& f) { return ranks_[f.rank].flags[p_.flag_index(f)]; }
  bool holds(int me, const PlanWait& w) { return flag(w.flag) >= w.mul * uint64_t(ranks_[me].epoch); }
  const PlanWait* unmet(int me, const PlanWait* w, size_t n) {
    for (size_t i = 0; i < n; ++i)
      if (!holds(me, w[i])) return &w[i];
    return nullptr;
  }
  void raise(int me, const PlanSignal& s) {
    uint64_t& f = flag(s.flag);
    f = s.add ? f + s.value : s.value * uint64_t(ranks_[me].epoch);
  }
  const RowHooks& hooks(int me, const TileSlot& t) const {
    return p_.ranks[me].rows[p_.ranks[me].tile_order[t.idx] % p_.tiles_m];
  }
  const PlanWait* tile_unmet(int me, const TileSlot& t) {
    const RowHooks& h = hooks(me, t);
    const auto& w = p_.ranks[me].waits;
    return t.loaded ? unmet(me, w.data() + h.store_wait0, h.store_waits) : unmet(me, w.data() + h.load_wait0, h.load_waits);
  }
  std::string wait_str(int me, const PlanWait& w) {
    return flag_str(w.flag) + " = " + std::to_string(flag(w.flag)) + ", needs >= " +
           std::to_string(w.mul * uint64_t(ranks_[me].epoch)) +
           (w.peer < 0 ? " (raised by several ranks)" : " (raised by rank " + std::to_string(w.peer) + ")");
  }

  const CallData& call_data(int e);
  void start_call(int me);
  bool finish_call(int me);
  bool exec_op(int me, int slot);
  bool deliver(int me);
  bool load_tile(int me, TileSlot& t);
  bool store_tile(int me, TileSlot& t);
  std::string deadlock_report();

  const Plan& p_;
  std::mt19937_64 rng_;
  const int W_;
  const int64_t M_, N_, K_, Ms_;
  bool ag_ = false;
  std::vector<RankState> ranks_;
  std::map<int, CallData> calls_;
  std::string err_, ctx_;
};

// Fresh inputs for call e, drawn independently per rank (even ranks from [-2, 2], odd ones from
// [-1, 2]), and the fp32 reference, exact since every value is a small integer.
const Replay::CallData& Replay::call_data(int e) {
  auto it = calls_.find(e);
  if (it != calls_.end()) return it->second;
  CallData& d = calls_[e];
  const int64_t arows = ag_ ? Ms_ : M_;
  for (int r = 0; r < W_; ++r) {
    std::uniform_int_distribution<int> v(-2 + (r & 1), 2);
    d.a.emplace_back(arows * K_);
    d.b.emplace_back(N_ * K_);
    for (auto& x : d.a.back()) x = float(v(rng_));
    for (auto& x : d.b.back()) x = float(v(rng_));
  }
  if (!ag_) {
    d.sum.assign(M_ * N_, 0.f);
    for (int r = 0; r < W_; ++r) {
      d.prod.emplace_back(M_ * N_);
      for (int64_t m = 0; m < M_; ++m)
        for (int64_t n = 0; n < N_; ++n) {
          const float v = dot(&d.a[r][m * K_], &d.b[r][n * K_], K_);
          d.prod[r][m * N_ + n] = v;
          d.sum[m * N_ + n] += v;
        }
    }
  }
  int oldest = e;  // drop the calls every rank is done with
  for (const RankState& s : ranks_) oldest = std::min(oldest, s.epoch);
  calls_.erase(calls_.begin(), calls_.lower_bound(oldest));
  return d;
}

void Replay::start_call(int me) {
  RankState& s = ranks_[me];
  ++s.epoch;
  s.active = true;
  s.speed = 1u << (2 * (rng_() % 3));  // 1, 4 or 16
  s.next_op = s.ops_done = s.next_tile = s.tiles_done = 0;
  const CallData& d = call_data(s.epoch);
  if (ag_) {
    uint16_t* a = reinterpret_cast<uint16_t*>(s.mem[int(Buf::kUserA)].data());
    for (size_t i = 0; i < d.a[me].size(); ++i) a[i] = to_bf16(d.a[me][i]);
    s.ag_c.assign(M_ * N_, kPoison);
  } else {
    auto& c = s.mem[int(Buf::kUserC)];
    for (size_t i = 0; i < c.size(); i += 2) memcpy(&c[i], &kPoison, 2);
  }
}

// Checks rank me's output of its current call (exact), then starts its next call.
bool Replay::finish_call(int me) {
  RankState& s = ranks_[me];
  const CallData& d = call_data(s.epoch);
  ctx_ = "rank " + std::to_string(me) + " call " + std::to_string(s.epoch) + " output";
  const int64_t rows = p_.kind == FusedKind::kGemmRs ? Ms_ : M_;
  const int64_t row0 = p_.kind == FusedKind::kGemmRs ? me * Ms_ : 0;
  int64_t bad = 0;
  std::string first;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < N_; ++n) {
      const int64_t gm = row0 + m;
      float want;
      uint16_t got;
      if (ag_) {
        want = dot(&d.a[gm / Ms_][(gm % Ms_) * K_], &d.b[me][n * K_], K_);
        got = s.ag_c[m * N_ + n];
      } else {
        want = d.sum[gm * N_ + n];
        memcpy(&got, &s.mem[int(Buf::kUserC)][(m * N_ + n) * 2], 2);
      }
      if (got != to_bf16(want) && bad++ == 0) {
        char line[160];
        snprintf(line, sizeof line, "C[%lld][%lld] (shard %lld) = %g (0x%04x), expected %g", (long long)gm,
                 (long long)n, (long long)(gm / Ms_), from_bf16(got), got, want);
        first = line;
      }
    }
  if (bad) return fail(first + "; " + std::to_string(bad) + " wrong elements");
  if (s.epoch < kCalls) start_call(me);
  else s.active = false;
  return true;
}

bool Replay::exec_op(int me, int slot) {
  RankState& s = ranks_[me];
  const int idx = s.comm[slot];
  const CommOp& op = p_.ranks[me].ops[idx];
  ctx_ = "rank " + std::to_string(me) + " call " + std::to_string(s.epoch) + " op " + std::to_string(idx) + " " +
         comm_kind_name(op.kind) + " (" + op.what + ")";
  switch (op.kind) {
    case CommKind::kCopy: {
      if (op.srcs.size() != 1 || op.dsts.empty()) return fail("a copy needs one source and a destination");
      const uint8_t* src = mem(me, op.srcs[0], op.bytes, false);
      if (!src) return false;
      for (const auto& d : op.dsts) {
        uint8_t* dst = mem(me, d, op.bytes, false);
        if (!dst) return false;
        memmove(dst, src, op.bytes);
      }
      break;
    }
    case CommKind::kReduce: {
      if (op.srcs.empty() || op.dsts.empty() || op.srcs.size() > 32 || (op.zero_src_mask >> op.srcs.size()) != 0)
        return fail("malformed reduce");
      std::vector<float> sum(op.elems, 0.f), v(op.elems);
      std::vector<uint8_t*> src;
      for (const auto& r : op.srcs) {
        src.push_back(mem(me, r, op.elems * 4, false));
        if (!src.back()) return false;
        memcpy(v.data(), src.back(), op.elems * 4);
        for (uint64_t i = 0; i < op.elems; ++i) sum[i] += v[i];
      }
      for (const auto& d : op.dsts) {
        uint8_t* dst = mem(me, d, op.elems * (op.dst_f32 ? 4 : 2), false);
        if (!dst) return false;
        if (op.dst_f32) memcpy(dst, sum.data(), op.elems * 4);
        else
          for (uint64_t i = 0; i < op.elems; ++i) {
            const uint16_t h = to_bf16(sum[i]);
            memcpy(dst + 2 * i, &h, 2);
          }
      }
      for (size_t i = 0; i < src.size(); ++i)
        if (op.zero_src_mask >> i & 1) memset(src[i], 0, op.elems * 4);
      break;
    }
    case CommKind::kNetPut:  // handed to the proxy: the bytes are read when it delivers
      if (op.srcs.size() != 1 || op.dsts.size() != 1 || op.srcs[0].rank != me || op.dsts[0].rank != op.peer ||
          !op.signals.empty())
        return fail("malformed put");
      if (!mem(me, op.srcs[0], op.bytes, true) || !mem(me, op.dsts[0], op.bytes, true)) return false;
      s.in_flight.push_back(idx);
      break;
    case CommKind::kSignal:
      if (!op.srcs.empty() || !op.dsts.empty()) return fail("a signal op with buffers");
      break;
    case CommKind::kZero:
      for (const auto& d : op.dsts) {
        uint8_t* dst = mem(me, d, op.bytes, false);
        if (!dst) return false;
        memset(dst, 0, op.bytes);
      }
      break;
  }
  for (const auto& sig : op.signals) raise(me, sig);
  s.comm[slot] = -1;
  ++s.ops_done;
  return true;
}

// The proxy of rank me completes its oldest put: copies the source as it is now, raises the
// destination's flag and then its own local-completion flag.
bool Replay::deliver(int me) {
  RankState& s = ranks_[me];
  const CommOp& op = p_.ranks[me].ops[s.in_flight.front()];
  s.in_flight.pop_front();
  ctx_ = "rank " + std::to_string(me) + " proxy delivering (" + op.what + ")";
  const uint8_t* src = mem(me, op.srcs[0], op.bytes, true);
  uint8_t* dst = mem(me, op.dsts[0], op.bytes, true);
  if (!src || !dst) return false;
  memmove(dst, src, op.bytes);
  flag(op.remote_flag) += 1;
  if (op.local_flag.region != Region::kCount) flag(op.local_flag) += 1;
  return true;
}

// The GEMM main loop of a tile: AG reads A's rows from the gathered kAFull now.
bool Replay::load_tile(int me, TileSlot& t) {
  const RankState& s = ranks_[me];
  const int id = p_.ranks[me].tile_order[t.idx], tm = id % p_.tiles_m, tn = id / p_.tiles_m;
  const int64_t r0 = int64_t(tm) * kPlanTileM, r1 = std::min<int64_t>(M_, r0 + kPlanTileM);
  const int64_t c0 = int64_t(tn) * kPlanTileN, c1 = std::min<int64_t>(N_, c0 + kPlanTileN);
  ctx_ = "rank " + std::to_string(me) + " call " + std::to_string(s.epoch) + " tile (" + std::to_string(tm) + ", " +
         std::to_string(tn) + ")";
  const CallData& d = call_data(s.epoch);
  t.acc.assign((r1 - r0) * (c1 - c0), 0.f);
  std::vector<float> a(K_);
  for (int64_t m = r0; m < r1; ++m) {
    if (ag_) {
      const uint8_t* row = mem(me, BufRef{Buf::kAFull, me, uint64_t(m * K_ * 2)}, K_ * 2, false);
      if (!row) return false;
      for (int64_t k = 0; k < K_; ++k) {
        uint16_t h;
        memcpy(&h, row + 2 * k, 2);
        a[k] = from_bf16(h);
      }
    }
    for (int64_t n = c0; n < c1; ++n)
      t.acc[(m - r0) * (c1 - c0) + (n - c0)] =
          ag_ ? dot(a.data(), &d.b[me][n * K_], K_) : d.prod[me][m * N_ + n];
  }
  t.loaded = true;
  return true;
}

// The epilogue: AG stores bf16 into the caller's C; RS/AR add (or store) fp32 along the route.
bool Replay::store_tile(int me, TileSlot& t) {
  RankState& s = ranks_[me];
  const RankPlan& rp = p_.ranks[me];
  const int id = rp.tile_order[t.idx], tm = id % p_.tiles_m, tn = id / p_.tiles_m;
  const int64_t r0 = int64_t(tm) * kPlanTileM, r1 = std::min<int64_t>(M_, r0 + kPlanTileM);
  const int64_t c0 = int64_t(tn) * kPlanTileN, c1 = std::min<int64_t>(N_, c0 + kPlanTileN), w = c1 - c0;
  ctx_ = "rank " + std::to_string(me) + " call " + std::to_string(s.epoch) + " tile (" + std::to_string(tm) + ", " +
         std::to_string(tn) + ") epilogue";
  for (int64_t m = r0; m < r1; ++m) {
    const float* acc = &t.acc[(m - r0) * w];
    if (ag_) {
      for (int64_t n = 0; n < w; ++n) s.ag_c[m * N_ + c0 + n] = to_bf16(acc[n]);
      continue;
    }
    const int64_t sh = m / Ms_;
    BufRef to = rp.route[sh];
    to.offset += uint64_t(((m - sh * Ms_) * N_ + c0) * 4);
    uint8_t* dst = mem(me, to, uint64_t(w) * 4, false);
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
  for (uint32_t i = 0; i < h.store_sigs; ++i) raise(me, rp.signals[h.store_sig0 + i]);
  t.idx = -1;
  t.loaded = false;
  ++s.tiles_done;
  return true;
}

std::string Replay::deadlock_report() {
  std::ostringstream os;
  os << "deadlock: no op, tile or put can move\n";
  for (int r = 0; r < W_; ++r) {
    RankState& s = ranks_[r];
    const RankPlan& rp = p_.ranks[r];
    os << " rank " << r << (s.active ? "" : " (finished)") << ": call " << s.epoch << ", ops " << s.ops_done << "/"
       << rp.ops.size() << ", tiles " << s.tiles_done << "/" << rp.tile_order.size() << ", puts in flight "
       << s.in_flight.size() << "\n";
    for (int idx : s.comm) {
      if (idx < 0) continue;
      const CommOp& op = rp.ops[idx];
      const PlanWait* w = unmet(r, op.waits.data(), op.waits.size());
      os << "   op " << idx << " " << comm_kind_name(op.kind) << " (" << op.what << ") waits "
         << (w ? wait_str(r, *w) : "nothing?") << "\n";
    }
    for (const TileSlot& t : s.tiles) {
      if (t.idx < 0) continue;
      const int id = rp.tile_order[t.idx];
      const PlanWait* w = tile_unmet(r, t);
      os << "   tile (" << id % p_.tiles_m << ", " << id / p_.tiles_m << ") " << (t.loaded ? "store" : "load")
         << " waits " << (w ? wait_str(r, *w) : "nothing?") << "\n";
    }
  }
  return os.str();
}

bool Replay::run() {
  for (int r = 0; r < W_; ++r) start_call(r);
  std::vector<Unit> units;
  for (;;) {
    units.clear();
    bool busy = false;
    for (int r = 0; r < W_; ++r) {
      RankState& s = ranks_[r];
      const RankPlan& rp = p_.ranks[r];
      if (!s.in_flight.empty()) units.push_back({UnitKind::kDeliver, r, 0});
      if (!s.active) continue;
      busy = true;
      for (size_t i = 0; i < s.comm.size(); ++i) {
        if (s.comm[i] < 0 && s.next_op < rp.ops.size()) s.comm[i] = int(s.next_op++);  // take the next op
        if (s.comm[i] >= 0 && !unmet(r, rp.ops[s.comm[i]].waits.data(), rp.ops[s.comm[i]].waits.size()))
          units.push_back({UnitKind::kComm, r, int(i)});
      }
      for (size_t i = 0; i < s.tiles.size(); ++i) {
        TileSlot& t = s.tiles[i];
        if (t.idx < 0 && s.next_tile < rp.tile_order.size()) t.idx = int(s.next_tile++);
        if (t.idx >= 0 && !tile_unmet(r, t)) units.push_back({UnitKind::kTile, r, int(i)});
      }
    }
    if (units.empty()) return busy ? (ctx_ = "replay", fail(deadlock_report())) : true;
    uint64_t total = 0;  // a random unit, weighted by its rank's speed
    for (const Unit& x : units) total += ranks_[x.rank].speed;
    uint64_t pick = rng_() % total;
    size_t i = 0;
    while (pick >= ranks_[units[i].rank].speed) pick -= ranks_[units[i++].rank].speed;
    const Unit u = units[i];
    RankState& s = ranks_[u.rank];
    bool ok = true;
    switch (u.kind) {
      case UnitKind::kDeliver: ok = deliver(u.rank); break;
      case UnitKind::kComm: ok = exec_op(u.rank, u.slot); break;
      case UnitKind::kTile: {
        TileSlot& t = s.tiles[u.slot];
        ok = t.loaded ? store_tile(u.rank, t) : load_tile(u.rank, t);
        break;
      }
    }
    if (!ok) return false;
    if (u.kind != UnitKind::kDeliver && s.ops_done == p_.ranks[u.rank].ops.size() &&
        s.tiles_done == p_.ranks[u.rank].tile_order.size() && !finish_call(u.rank))
      return false;
  }
}

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
          auto add = [&](int64_t rows_per_rank, int64_t N, int64_t K, int cs, int ts, uint64_t seed,
                         bool strided = false) {
            out.push_back(Config{k, W, nodes, rows_per_rank * W, N, K, det, cs, ts, seed, strided});
          };
          add(48, 264, 16, 1, 1, 1);                // shards smaller than a tile, strict op order
          add(48, 264, 16, 8, 4, 2);                // many comm CTAs holding ops at once
          if (W <= 8) add(136, 264, 24, 2, 4, 3);   // shards straddling tile-rows
          if (W <= 4) add(200, 520, 16, 2, 1, 4);   // shards over a tile
          if (W == 16) add(48, 264, 16, 2, 4, 5);
          if (nodes > 1 && nodes < W) add(40, 264, 16, 2, 2, 6, true);  // nodes of strided ranks
        }
    }
  return out;
}

class PlanReplay : public ::testing::TestWithParam<Config> {};

TEST_P(PlanReplay, ThreeCallsExact) {
  const Config& c = GetParam();
  Plan p;
  MK_ASSERT_OK(build_plan(c.kind, PlanShape{c.M, c.N, c.K}, make_layout(c), c.det, &p));
  ASSERT_EQ(check_static(p), "");
  Replay replay(p, c);
  EXPECT_TRUE(replay.run()) << replay.error();
}

INSTANTIATE_TEST_SUITE_P(Sweep, PlanReplay, ::testing::ValuesIn(sweep()),
                         [](const ::testing::TestParamInfo<Config>& i) { return config_name(i.param); });

// ---- Shapes and layouts the planner must refuse.
TEST(PlanErrors, RejectsBadShapesAndLayouts) {
  Plan p;
  for (FusedKind k : {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr}) {
    Status s = build_plan(k, PlanShape{100, 264, 16}, PlanLayout::uniform(3, 1), false, &p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("uneven"), std::string::npos) << s.to_string();
    s = build_plan(k, PlanShape{96, 100, 16}, PlanLayout::uniform(3, 1), false, &p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    s = build_plan(k, PlanShape{96, 264, 0}, PlanLayout::uniform(3, 1), false, &p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    PlanLayout odd;  // nodes of 2 and 1 ranks
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
    MK_ASSERT_OK(build_plan(k, PlanShape{192, 264, 16}, PlanLayout::uniform(4, 2), true, &p));
    for (int r = 0; r < 4; ++r) {
      const std::string d = describe(p, r);
      EXPECT_FALSE(d.empty());
      EXPECT_NE(d.find(fused_kind_name(k)), std::string::npos) << d;
    }
  }
}

}  // namespace
}  // namespace ops
}  // namespace mk
