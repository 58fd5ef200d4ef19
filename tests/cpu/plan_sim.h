// mkernel tests — a timed model of one fused GEMM collective call on every rank (one node or
// several), driven by the operator's real plan (src/ops/fused_gemm/fused_gemm_plan.h): the tile order, the
// tile rows' load and store waits and signals, the communication ops with their waits, signals
// and bytes, and the kernel's work-item rule (comm_role.cuh's take_op and help_op). What it does
// not take from the plan it takes from SimCosts, which tests/cpu/test_split_calibration.cc fits
// to traced GPU calls. Host code only.
//
// The kernel as modelled: each rank runs `grid` CTAs; the first `split` of them (at most grid -
// 1) take ops first — in order (AG: an op whose waits are not met holds its CTA), or, peeking
// (RS/AR), only an op already ready while tiles remain; the others compute tiles in the plan's
// order. A tile waits for its row's load waits, runs its MMA, waits for its row's store waits,
// runs its epilogue (plain, routed to the owner, or the owner's final sum) and raises its row's
// store signals. Once no tile is left every CTA takes the remaining ops (help_op). Copies share
// the GPU's copy bandwidth (every rank's, as ranks that share one GPU do): each runs at
// min(per-CTA rate, total / copies running), recomputed whenever one starts or ends.
//
// Several nodes: a network put's CTA first copies the bytes into the host mirror when the plan is
// staged (a copy like the others), then hands the put to its rank's proxy and is free; the proxy
// sends its puts one after the other (net_gbps), each landing net_latency_us after it left, and
// then raises the destination's arrival flag and the sender's local-completion flag.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <queue>
#include <string>
#include <tuple>
#include <vector>

#include "src/comm/split_control.h"
#include "src/ops/fused_gemm/fused_gemm_plan.h"

namespace mk {
namespace test {

struct SimCosts {
  double mma_us = 40;           // a tile's main loop
  double epi_plain_us = 3;      // AG: the tile's store
  double epi_routed_us = 15;    // RS/AR: a tile routed to its owner (fp32 adds into the owner)
  double epi_final_us = 25;     // RS/AR on one node: the owner's final sum of its own tile
  double op_fixed_us = 1;       // an op's own cost besides its bytes (waits checked, signals)
  double copy_gbps_cta = 20;    // one CTA's copy rate (GB/s) of an op's bytes
  double copy_gbps_total = 1500;  // the GPU's, shared by every copy running on any rank
  double switch_us = 0;         // a tile after an op on the same CTA (its pipeline starts empty)
  double contention = 0;        // a tile's MMA is slowed by contention * (copies running) / grid
  double sample_us = 2.5;       // the controller's sample on its CTA (2.2-3.2 us measured under MPS)
  double net_latency_us = 9;    // a put's flight (libfabric tcp on the H200 host: 8.9 us per 8 B put)
  double net_gbps = 3.4;        // a proxy's send rate (tcp: 3.2-3.6 GB/s at 64 KiB-4 MiB; shm 9-14)
};

// The bytes an op moves through the GPU's memory (what SimCosts' copy rates apply to).
inline uint64_t op_bytes(const comm::Op& op) {
  switch (op.kind) {
    case comm::OpKind::kCopy:
    case comm::OpKind::kZero: return op.bytes * std::max<size_t>(1, op.dsts.size());
    case comm::OpKind::kReduce: return op.elems * 4 * (op.srcs.size() + op.dsts.size());
    case comm::OpKind::kNetPut: return op.stage_src.buf != comm::kNoBuf ? op.bytes : 0;  // the staging copy
    default: return 0;
  }
}

struct SimResult {
  bool ok = false;
  std::string error;            // a deadlock or an unmodelled op
  double kernel_us = 0;         // the slowest rank's last CTA end
  std::vector<double> rank_us;  // per rank
  int ops = 0, tiles = 0;       // per rank (rank 0)
  std::vector<int> settled;     // with the controller: each rank's count-weighted mean (split_mean)
  int changes = 0;              // with the controller: rank 0's switches
};

class PlanSim {
 public:
  PlanSim(const ops::Plan& plan, int grid, const SimCosts& c) : p_(plan), grid_(grid), c_(c) {}

  // A fixed split for the whole call; with `controller`, split_step moves each rank's count from
  // `split` on, sampling at a work-item boundary at most every split_interval_ns (the device's
  // rule: src/comm/split_control.cuh), the sample taking its CTA sample_us.
  SimResult run(int split, bool controller = false) {
    SimResult r;
    const int W = int(p_.ranks.size());
    const bool peek = p_.kind != ops::FusedKind::kAgGemm;
    controller_ = controller;
    lim_ = comm::SplitLimits{};
    lim_.lo = 1;
    lim_.hi = std::min(grid_ - 1, std::max(32, grid_ / 2));  // the device's ceiling (hi_auto)
    lim_.grid = grid_;
    lim_.in_order = !peek;
    interval_us_ = 1e-3 * double(comm::split_interval_ns(2000, int64_t(c_.sample_us * 1e3), grid_));
    flags_.assign(W, std::vector<uint64_t>(p_.pad_flags, 0));
    ranks_.assign(W, Rank{});
    proxy_free_.assign(W, 0.0);
    copies_.clear();
    blocked_.clear();
    q_ = {};
    now_ = 0;
    for (int k = 0; k < W; ++k) {
      ranks_[k].end.assign(grid_, 0.0);
      ranks_[k].last_op.assign(grid_, 0);
      ranks_[k].comm = std::max(1, std::min(split, grid_ - 1));
      comm::split_begin(&ranks_[k].ctl, ranks_[k].comm, lim_, 0);
      ranks_[k].comm = ranks_[k].ctl.comm;
      for (int c = 0; c < grid_; ++c) push(0.0, kFree, k, c, 0);
    }
    const double inf = std::numeric_limits<double>::infinity();
    while (!q_.empty() || !copies_.empty()) {
      // The next copy to end at the current rates, against the next event.
      double t_copy = inf;
      size_t which = 0;
      const double rate = copy_rate();
      for (size_t i = 0; i < copies_.size(); ++i) {
        const double t = now_ + copies_[i].left / rate;
        if (t < t_copy) t_copy = t, which = i;
      }
      const double t_ev = q_.empty() ? inf : std::get<0>(q_.top());
      if (t_copy <= t_ev) {
        advance(t_copy, rate);
        const Copy done = copies_[which];
        copies_.erase(copies_.begin() + long(which));
        push(now_ + c_.op_fixed_us, kOpDone, done.rank, done.cta, done.op);
        continue;
      }
      auto [t, seq, kind, rank, cta, item] = q_.top();
      q_.pop();
      (void)seq;
      advance(t, rate);
      step(kind, rank, cta, item, peek);
    }
    if (!blocked_.empty()) {
      const Blocked& b = blocked_.front();
      return fail(&r, "deadlock: rank " + std::to_string(b.rank) + " CTA " + std::to_string(b.cta) + " waits forever (" +
                          (b.what == kOpWait ? "op " : "tile ") + std::to_string(b.item) + ")");
    }
    r.ok = true;
    for (int k = 0; k < W; ++k) {
      double e = 0;
      for (double x : ranks_[k].end) e = std::max(e, x);
      r.rank_us.push_back(e);
      r.kernel_us = std::max(r.kernel_us, e);
    }
    r.ops = int(p_.ranks[0].ops.size());
    r.tiles = int(p_.ranks[0].tile_order.size());
    for (int k = 0; k < W; ++k) r.settled.push_back(controller ? comm::split_mean(ranks_[k].ctl) : ranks_[k].comm);
    r.changes = ranks_[0].ctl.changes;
    return r;
  }

 private:
  enum Kind { kFree = 0, kMmaDone = 1, kTileDone = 2, kOpDone = 3, kSampled = 4, kDelivered = 5 };
  enum What { kOpWait = 0, kLoadWait = 1, kStoreWait = 2 };
  struct Rank {
    size_t next_tile = 0, next_op = 0;
    std::vector<double> end;
    std::vector<char> last_op;
    int comm = 1;                 // CTAs that take ops first
    comm::SplitState ctl;         // the controller's state
    double last_sample = -1e30;
    int ops_done = 0, stalls = 0;
  };
  struct Copy {
    int rank, cta, op;
    double left;  // bytes
  };
  struct Blocked {
    What what;
    int rank, cta, item;
  };
  using Ev = std::tuple<double, uint64_t, int, int, int, int>;  // time, seq, kind, rank, cta, item

  void push(double t, int kind, int rank, int cta, int item) { q_.push(Ev{t, seq_++, kind, rank, cta, item}); }
  SimResult fail(SimResult* r, const std::string& e) {
    r->ok = false;
    r->error = e;
    return *r;
  }
  double copy_rate() const {  // bytes per us of each running copy
    if (copies_.empty()) return 1.0;
    return 1e3 * std::min(c_.copy_gbps_cta, c_.copy_gbps_total / double(copies_.size()));
  }
  void advance(double t, double rate) {
    for (Copy& c : copies_) c.left = std::max(0.0, c.left - (t - now_) * rate);
    now_ = std::max(now_, t);
  }
  bool holds(const comm::Wait& w) const {
    return flags_[w.flag.rank][p_.flag_index(w.flag)] >= w.mul;  // one call: epoch 1
  }
  bool all_hold(const comm::Wait* w, size_t n) const {
    for (size_t i = 0; i < n; ++i)
      if (!holds(w[i])) return false;
    return true;
  }
  void raise(const comm::Signal& s) {
    uint64_t& f = flags_[s.flag.rank][p_.flag_index(s.flag)];
    f = s.add ? f + s.value : s.value;
  }
  const comm::Wait* op_waits(int rank, int op, size_t* n) const {
    const comm::Op& o = p_.ranks[rank].ops[op];
    *n = o.waits.size();
    return o.waits.data();
  }
  const comm::Wait* row_waits(int rank, int tile, bool store, size_t* n) const {
    const ops::RankPlan& rp = p_.ranks[rank];
    const ops::RowHooks& h = rp.rows[tile % p_.tiles_m];
    *n = store ? h.store_waits : h.load_waits;
    return rp.waits.data() + (store ? h.store_wait0 : h.load_wait0);
  }
  bool ready(int rank, int op) const {
    size_t n = 0;
    const comm::Wait* w = op_waits(rank, op, &n);
    return all_hold(w, n);
  }
  // The controller's view of a rank now (split_control.cuh's sample).
  comm::SplitSample sample(int rank) const {
    const Rank& R = ranks_[rank];
    const ops::RankPlan& rp = p_.ranks[rank];
    comm::SplitSample x;
    x.now_ns = int64_t(now_ * 1e3);
    x.tiles_total = int32_t(rp.tile_order.size());
    x.tiles_taken = int32_t(R.next_tile);
    x.ops_total = int32_t(rp.ops.size());
    x.ops_taken = int32_t(R.next_op);
    x.ops_done = R.ops_done;
    int ready_ops = 0;
    for (size_t i = R.next_op; i < std::min(rp.ops.size(), R.next_op + comm::kSplitPeek); ++i)
      ready_ops += ready(rank, int(i)) ? 1 : 0;
    x.ops_ready = ready_ops;
    x.stalls = R.stalls;
    for (const Blocked& b : blocked_) x.stalled += b.rank == rank && b.what == kLoadWait;
    return x;
  }
  // A CTA at an item boundary, a tile's MMA or epilogue done, an op done.
  void step(int kind, int rank, int cta, int item, bool peek) {
    Rank& R = ranks_[rank];
    const ops::RankPlan& rp = p_.ranks[rank];
    if (kind == kDelivered) {  // a put landed (cta: unused)
      const comm::Op& op = rp.ops[item];
      ++flags_[op.remote_flag.rank][p_.flag_index(op.remote_flag)];
      if (op.local_flag.region != comm::kNoRegion) ++flags_[op.local_flag.rank][p_.flag_index(op.local_flag)];
      unblock();
      return;
    }
    if (kind == kOpDone) {
      ++R.ops_done;
      const comm::Op& op = rp.ops[item];
      if (op.kind == comm::OpKind::kNetPut) {
        // Handed to the proxy: sent after its earlier puts, landing after the flight.
        const double sent = std::max(now_, proxy_free_[rank]) + double(op.bytes) / (c_.net_gbps * 1e3);
        proxy_free_[rank] = sent;
        push(sent + c_.net_latency_us, kDelivered, rank, -1, item);
      }
      for (const comm::Signal& s : op.signals) raise(s);
      R.last_op[cta] = 1;
      push(now_, kFree, rank, cta, 0);
      unblock();
      return;
    }
    if (kind == kMmaDone) {
      size_t n = 0;
      const comm::Wait* w = row_waits(rank, item, true, &n);
      if (!all_hold(w, n)) blocked_.push_back({kStoreWait, rank, cta, item});
      else start_epilogue(rank, cta, item);
      return;
    }
    if (kind == kTileDone) {
      const ops::RowHooks& h = rp.rows[item % p_.tiles_m];
      for (uint32_t i = 0; i < h.store_sigs; ++i) raise(rp.signals[h.store_sig0 + i]);
      push(now_, kFree, rank, cta, 0);
      unblock();
      return;
    }
    // kFree: the next work item (take_op / help_op), after the controller's sample when one is due.
    R.end[cta] = now_;
    const size_t n_tiles = rp.tile_order.size(), n_ops = rp.ops.size();
    const bool tiles_left = R.next_tile < n_tiles, ops_left = R.next_op < n_ops;
    if (!tiles_left && !ops_left) return;
    if (controller_ && kind == kFree && now_ - R.last_sample >= interval_us_) {
      R.last_sample = now_;
      R.comm = comm::split_step(&R.ctl, sample(rank), lim_);
      push(now_ + c_.sample_us, kSampled, rank, cta, 0);  // the sample's reads take this CTA's time
      return;
    }
    bool take_op = false;
    if (cta < std::min(R.comm, grid_ - 1) && ops_left) take_op = !peek || !tiles_left || ready(rank, int(R.next_op));
    if (!take_op && !tiles_left) take_op = true;  // help_op
    if (take_op) {
      const int op = int(R.next_op++);
      if (!ready(rank, op)) blocked_.push_back({kOpWait, rank, cta, op});
      else start_op(rank, cta, op);
      return;
    }
    const int tile = rp.tile_order[R.next_tile++];
    size_t n = 0;
    const comm::Wait* w = row_waits(rank, tile, false, &n);
    if (!all_hold(w, n)) {
      ++R.stalls;
      blocked_.push_back({kLoadWait, rank, cta, tile});
    } else {
      start_tile(rank, cta, tile);
    }
  }
  void start_op(int rank, int cta, int op) {
    const uint64_t bytes = op_bytes(p_.ranks[rank].ops[op]);
    if (bytes == 0) push(now_ + c_.op_fixed_us, kOpDone, rank, cta, op);
    else copies_.push_back({rank, cta, op, double(bytes)});
  }
  void start_tile(int rank, int cta, int tile) {
    Rank& R = ranks_[rank];
    double us = c_.mma_us * (1.0 + c_.contention * double(copies_.size()) / double(grid_));
    if (R.last_op[cta]) us += c_.switch_us;
    R.last_op[cta] = 0;
    push(now_ + us, kMmaDone, rank, cta, tile);
  }
  void start_epilogue(int rank, int cta, int tile) {
    double us = c_.epi_plain_us;
    if (p_.kind != ops::FusedKind::kAgGemm) {
      const ops::EpilogueFinal& f = p_.ranks[rank].fin;
      const int64_t row0 = int64_t(tile % p_.tiles_m) * ops::kPlanTileM;
      us = f.on && row0 >= f.lo && row0 < f.hi ? c_.epi_final_us : c_.epi_routed_us;
    }
    push(now_ + us, kTileDone, rank, cta, tile);
  }
  // After flags changed: every blocked CTA whose waits now hold goes on (in the order they blocked).
  void unblock() {
    for (size_t i = 0; i < blocked_.size();) {
      const Blocked b = blocked_[i];
      size_t n = 0;
      const comm::Wait* w = b.what == kOpWait ? op_waits(b.rank, b.item, &n) : row_waits(b.rank, b.item, b.what == kStoreWait, &n);
      if (!all_hold(w, n)) {
        ++i;
        continue;
      }
      blocked_.erase(blocked_.begin() + long(i));
      if (b.what == kOpWait) start_op(b.rank, b.cta, b.item);
      else if (b.what == kLoadWait) start_tile(b.rank, b.cta, b.item);
      else start_epilogue(b.rank, b.cta, b.item);
    }
  }

  const ops::Plan& p_;
  const int grid_;
  const SimCosts c_;
  std::vector<std::vector<uint64_t>> flags_;
  std::vector<Rank> ranks_;
  std::vector<double> proxy_free_;  // per rank: when its proxy has sent its last put
  std::vector<Copy> copies_;
  std::vector<Blocked> blocked_;
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> q_;
  uint64_t seq_ = 0;
  double now_ = 0;
  bool controller_ = false;
  comm::SplitLimits lim_;
  double interval_us_ = 2;
};

}  // namespace test
}  // namespace mk
