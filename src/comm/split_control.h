// mkernel — the SM-partition controller's rule (host and device code, no CUDA headers needed).
//
// A fused operator's persistent grid runs two kinds of work items: the GEMM's (or attention's)
// compute tiles and the communication program's ops. The first role_counts[0] CTAs take ops
// first (comm_role.cuh, take_op); the others take tiles. The controller — one thread of the
// grid, at its own work-item boundaries — samples progress the kernel keeps anyway and moves
// that count in both directions. This header is the rule alone: plain arithmetic on a sample,
// shared by the device controller and the CPU tests, which drive it from a simulated kernel
// (tests/cpu/test_split_control.cc). The device side is split_control.cuh; the host side
// src/ops/control/split_controller.h.
//
// The signals (SplitSample):
//   ops_ready    of the next kSplitPeek ops not yet taken, how many have their waits met:
//                communication work that no CTA has picked up (a backlog);
//   stalls       tile loads that found their input not there yet (cumulative): compute waiting
//                for communication;
//   stalled      tile loads waiting for their inputs at the sample (a gauge: a tile stalled
//                since the call's start shows here, not in new stalls);
//   ops_done     ops finished (cumulative): the communication role's rate;
//   ring_queued  commands pushed to the proxy and not yet taken by it: when the ring is mostly
//                full the network is the bottleneck, and more communication CTAs would only
//                wait for ring space;
//   tiles_taken / ops_taken of tiles_total / ops_total.
//
// The rule (split_step; docs/controller.md has it in prose):
//   - nothing moves once all tiles or all ops are taken: the kernel's tail already gives every
//     CTA to the remaining work (help_op);
//   - after a change, hold kSplitHold samples: its effect shows first;
//   - a growth is judged on about one op per communication CTA: if the op rate did not rise by
//     half the CTAs added while still starving, it is undone and that count becomes a ceiling
//     (and that rate the link rate);
//   - network saturated (ring 3/4 full): shrink by one;
//   - starving — peek mode: a backlog of kSplitBacklog ready ops in two consecutive samples; in
//     order: new stalls beside ready ops — grow by max(1, comm/2) up to the ceiling (peek mode:
//     only if split_predict says the call ends sooner);
//   - idle — no ready op, no new stall — for kSplitIdle consecutive samples: shrink by one;
//   - always within [lo, hi] (hi <= grid - 1: one CTA always computes).
// Growth is fast and shrinking slow: a starved communication role leaves the network idle now
// and exposes its transfers at the end, while a few surplus communication CTAs still compute
// between ops (peek mode) or cost a few SMs.
//
// The state also keeps the time-weighted mean split of the call (split_mean): the split the
// controller settled on, which the next call starts from.
#pragma once

#include <cstdint>

#include "mkernel/device/command.h"  // MK_HOST_DEVICE

namespace mk {
namespace comm {

constexpr int kSplitPeek = 8;      // ops examined for the backlog
constexpr int kSplitBacklog = 2;   // a backlog of this many ready ops counts as starving
constexpr int kSplitHold = 2;      // samples to wait after a change
constexpr int kSplitIdle = 3;      // idle samples before shrinking
// Sampling costs the sampling CTA's time: the interval grows so that sampling takes at most
// 1/kSplitSampleShare of the grid's time (a 1 us sample on 132 CTAs: every 2 us; on 33: 6 us).
constexpr int64_t kSplitSampleShare = 200;

// The interval between samples: at least base_ns, and long enough that samples of sample_ns
// (measured) take at most 1/kSplitSampleShare of the grid's time.
MK_HOST_DEVICE inline int64_t split_interval_ns(int64_t base_ns, int64_t sample_ns, int32_t grid) {
  const int64_t need = grid > 0 ? sample_ns * kSplitSampleShare / grid : 0;
  return need > base_ns ? need : base_ns;
}

struct SplitSample {
  int64_t now_ns = 0;
  int32_t tiles_taken = 0, tiles_total = 0;
  int32_t ops_taken = 0, ops_total = 0;
  int32_t ops_done = 0;       // ops finished by their CTAs (cumulative)
  int32_t ops_ready = 0;      // 0 .. kSplitPeek
  int32_t stalls = 0;         // cumulative
  int32_t stalled = 0;        // tile loads waiting for their inputs now (a gauge)
  int32_t ring_queued = 0;    // 0 when the call has no network puts
  int32_t ring_capacity = 0;  // 0: no ring
};

struct SplitLimits {
  int32_t lo = 1, hi = 1;  // the count stays in [lo, hi]
  int32_t grid = 2;        // CTAs of the persistent grid
  // How the op program and the tiles depend on each other:
  //   false (peek; GEMM+RS/AR): ops wait for tiles; communication CTAs compute a tile while no op
  //         is ready; what is left at the end, every CTA helps with;
  //   true  (in order; AG, ring attention): tiles wait for ops, taken in program order.
  bool in_order = false;
};

struct SplitState {
  int32_t comm = 1;          // the current count (what role_counts[0] holds)
  int32_t hold = 0;          // samples left before the next change
  int32_t backlog_run = 0;   // consecutive samples with a backlog
  int32_t idle_run = 0;      // consecutive idle samples
  int32_t last_stalls = 0;
  int32_t changes = 0;       // role switches made
  int32_t ceiling = 0;       // growth past this did not pay (0: none found)
  int32_t probe_from = -1;   // the count before the last growth, until it is judged
  int32_t mark_ops = 0;      // ops done at the last change (its window's start)
  int32_t mark_tiles = 0;    // tiles taken then
  float link_rate = 0.f;     // ops per ns past which growth did not pay (0: none found)
  float best_rate = 0.f;     // the highest op rate (ops per ns) seen in a window with a backlog
  int64_t mark_ns = 0;
  float base_rate = 0.f;     // ops done per ns in the window before the last growth
  int64_t last_ns = 0;
  int64_t weighted = 0;      // sum of comm * dt (ns)
  int64_t span_ns = 0;       // sum of dt
};

MK_HOST_DEVICE inline int32_t split_clamp(int32_t v, const SplitLimits& lim) {
  return v < lim.lo ? lim.lo : v > lim.hi ? lim.hi : v;
}

MK_HOST_DEVICE inline void split_begin(SplitState* s, int32_t start, const SplitLimits& lim, int64_t now_ns,
                                       int32_t stalls = 0) {
  *s = SplitState{};
  s->comm = split_clamp(start, lim);
  s->last_ns = now_ns;
  s->last_stalls = stalls;
  s->mark_ns = now_ns;
}

// The time-weighted mean of the split so far, rounded; the current count before any time passed.
MK_HOST_DEVICE inline int32_t split_mean(const SplitState& s) {
  return s.span_ns > 0 ? static_cast<int32_t>((s.weighted + s.span_ns / 2) / s.span_ns) : s.comm;
}

MK_HOST_DEVICE inline void split_change(SplitState* s, const SplitSample& x, int32_t next) {
  s->comm = next;
  ++s->changes;
  s->hold = kSplitHold;
  s->idle_run = 0;
  s->mark_ops = x.ops_done;
  s->mark_tiles = x.tiles_taken;
  s->mark_ns = x.now_ns;
}

// The time (ns) the tiles left take at the per-CTA rate on the grid - c CTAs that compute.
MK_HOST_DEVICE inline float split_compute_ns(const SplitSample& x, const SplitLimits& lim, float tile_rate, int32_t c) {
  return static_cast<float>(x.tiles_total - x.tiles_taken) / (tile_rate * static_cast<float>(lim.grid - c));
}

// Peek mode: the predicted time (ns) to the end of the call with c communication CTAs, from the
// window's per-CTA rates: the tiles left at (grid - c) CTAs; meanwhile the ops at c CTAs (capped
// by the link rate once found); then the rest. The rest is priced at the best op rate seen so
// far (or the link rate), not at every CTA's: what is left at the end is bound by the links or
// the network, which sat idle during the tiles — the traffic the fused kernel exists to hide.
MK_HOST_DEVICE inline float split_predict(const SplitState& s, const SplitSample& x, const SplitLimits& lim,
                                          float tile_rate, float op_rate, int32_t c) {
  const float ops_left = static_cast<float>(x.ops_total - x.ops_done);
  const float compute = split_compute_ns(x, lim, tile_rate, c);
  float during = op_rate * static_cast<float>(c);
  float tail = s.best_rate > during ? s.best_rate : during;
  if (s.link_rate > 0.f) {
    during = during < s.link_rate ? during : s.link_rate;
    tail = s.link_rate;
  }
  const float rest = ops_left - during * compute;
  return compute + (rest > 0.f ? rest / tail : 0.f);
}

// In order: the predicted time (ns) to the end of the call with c communication CTAs. Tiles
// wait for ops, so the call ends when the slower of the two streams does: the ops left at c
// CTAs' rate (capped by the link rate once found), the tiles left at the other CTAs'.
MK_HOST_DEVICE inline float split_predict_in_order(const SplitState& s, const SplitSample& x, const SplitLimits& lim,
                                                   float tile_rate, float op_rate, int32_t c) {
  const float compute = split_compute_ns(x, lim, tile_rate, c);
  float ops = op_rate * static_cast<float>(c);
  if (s.link_rate > 0.f && ops > s.link_rate) ops = s.link_rate;
  const float comm = static_cast<float>(x.ops_total - x.ops_done) / ops;
  return compute > comm ? compute : comm;
}

// One sample: updates the state and returns the new count (s->comm).
MK_HOST_DEVICE inline int32_t split_step(SplitState* s, const SplitSample& x, const SplitLimits& lim) {
  const int64_t dt = x.now_ns > s->last_ns ? x.now_ns - s->last_ns : 0;
  const bool tail = x.tiles_taken >= x.tiles_total || x.ops_taken >= x.ops_total;
  // The mean counts the time the split mattered: in the tail every CTA helps whatever it is.
  if (!tail) {
    s->weighted += static_cast<int64_t>(s->comm) * dt;
    s->span_ns += dt;
  }
  s->last_ns = x.now_ns > s->last_ns ? x.now_ns : s->last_ns;
  const int32_t new_stalls = x.stalls - s->last_stalls;
  s->last_stalls = x.stalls;
  s->backlog_run = x.ops_ready >= kSplitBacklog ? s->backlog_run + 1 : 0;
  s->idle_run = x.ops_ready == 0 && new_stalls <= 0 ? s->idle_run + 1 : 0;
  if (tail) return s->comm;
  if (s->hold > 0) --s->hold;
  if (s->hold > 0) return s->comm;
  // In order, only stalls (new, or tiles still waiting) beside ready ops mean the communication
  // role is short: without ready ops the tiles wait for data still on its way, which more CTAs
  // would not bring sooner; and ready ops without stalls are ahead of the tiles that need them.
  const bool starving =
      lim.in_order ? (new_stalls > 0 || x.stalled > 0) && x.ops_ready > 0 : s->backlog_run >= 2;
  const int64_t window = x.now_ns - s->mark_ns;
  const float op_rate_all = window > 0 ? static_cast<float>(x.ops_done - s->mark_ops) / static_cast<float>(window) : 0.f;
  if (starving && op_rate_all > s->best_rate) s->best_rate = op_rate_all;
  // Judge the last growth on about one op per communication CTA (two in order: a CTA added
  // there first finishes the tile it holds, which may wait for the very ops it is to run): did
  // the ops go faster, by at least half the CTAs added? If not, the role is bound elsewhere
  // (links, the network).
  if (s->probe_from > 0) {
    if (starving && x.ops_done - s->mark_ops < (lim.in_order ? 2 : 1) * s->comm) return s->comm;
    const int32_t from = s->probe_from;
    s->probe_from = -1;
    const float gain = static_cast<float>(s->comm - from) / static_cast<float>(from);
    if (starving && op_rate_all < s->base_rate * (1.f + 0.5f * gain)) {
      s->ceiling = from;
      s->link_rate = s->base_rate > op_rate_all ? s->base_rate : op_rate_all;
      split_change(s, x, split_clamp(from, lim));
      return s->comm;
    }
  }
  const bool saturated = x.ring_capacity > 0 && 4 * static_cast<int64_t>(x.ring_queued) >=
                                                    3 * static_cast<int64_t>(x.ring_capacity);
  const int32_t step = s->comm / 2 > 1 ? s->comm / 2 : 1;
  int32_t up = s->comm + step;
  if (s->ceiling > 0 && up > s->ceiling) up = s->ceiling;
  up = split_clamp(up, lim);
  int32_t next = s->comm;
  if (saturated) {
    next = s->comm - 1;
  } else if (starving && up > s->comm) {
    // Grow only if the prediction says the call ends sooner (by 1%), from rates measured over
    // the window since the last change. In order, over about one op per communication CTA (ops
    // take long against a sample: at the call's start none has ended yet while every tile
    // stalls on the first ones), and without the tiles taken that still wait for their inputs.
    const int32_t min_ops = lim.in_order ? s->comm : 1;
    const int32_t tiles = x.tiles_taken - s->mark_tiles - (lim.in_order ? x.stalled : 0);
    if (window > 0 && tiles > 0 && x.ops_done - s->mark_ops >= min_ops) {
      const float tile_rate =
          static_cast<float>(tiles) / (static_cast<float>(window) * static_cast<float>(lim.grid - s->comm));
      const float op_rate = op_rate_all / static_cast<float>(s->comm);
      if (lim.in_order) {
        const int32_t top = split_clamp(s->ceiling > 0 && s->ceiling < lim.hi ? s->ceiling : lim.hi, lim);
        if (2 * x.stalled > lim.grid - s->comm) {
          // Most compute CTAs wait for ops that are ready but untaken: double.
          next = s->comm * 2 < top ? s->comm * 2 : top;
        } else {
          // The two streams balance: the best of comm + step, 2x, 4x and the ceiling.
          float best_t = 0.99f * split_predict_in_order(*s, x, lim, tile_rate, op_rate, s->comm);
          const int32_t cand[4] = {up, s->comm * 2, s->comm * 4, top};
          for (int i = 0; i < 4; ++i) {
            const int32_t c = cand[i] < top ? cand[i] : top;
            if (c <= s->comm) continue;
            const float t = split_predict_in_order(*s, x, lim, tile_rate, op_rate, c);
            if (t < best_t) best_t = t, next = c;
          }
        }
      } else {
        const float now_t = split_predict(*s, x, lim, tile_rate, op_rate, s->comm);
        if (split_predict(*s, x, lim, tile_rate, op_rate, up) < 0.99f * now_t) next = up;
      }
    }
  } else if (s->idle_run >= kSplitIdle) {
    next = s->comm - 1;
  }
  next = split_clamp(next, lim);
  if (next != s->comm) {
    const int32_t from = s->comm;
    split_change(s, x, next);
    if (next > from) {
      s->probe_from = from;
      s->base_rate = op_rate_all;
    }
  }
  return s->comm;
}

// The controller's device state, one per operator (device memory). The launch resets the
// per-call part (fused_begin); the rule runs under `lock`, at most once per gap_ns, by
// whichever CTA's scheduling thread reaches a work-item boundary first.
constexpr int kSplitForceMax = 4;
struct SplitCtl {
  int32_t lock;             // 0 free, 1 a thread runs the rule
  int32_t ops_done;         // ops finished by their CTAs, this call
  int32_t stalls;           // tile loads that found their inputs not there yet, this call
  int32_t last_mean;        // the split settled on so far: the next call's start
  int32_t has_mean;         // last_mean was set by a call
  int32_t hi_auto;          // limits.hi from the grid at launch: min(grid - 1, max(32, grid / 2))
  int32_t stalled;          // tile loads waiting for their inputs now (SplitSample::stalled)
  int64_t interval_ns;      // the rule runs at most this often (the floor of gap_ns)
  int64_t sample_ns;        // what a sample costs its thread (measured, smoothed; kept across calls)
  int64_t gap_ns;           // the interval in force: split_interval_ns(interval_ns, sample_ns, grid)
  int32_t* host_mean;       // pinned host word, mapped: each launch's fused_begin writes the
                            // previous call's settled split there for the host (no copy per call)
  // Tests: at force_at[i] tiles taken, the count becomes force_to[i] (in order; the rule then
  // carries on from there). n_force 0: none.
  int32_t n_force, next_force;
  int32_t force_at[kSplitForceMax], force_to[kSplitForceMax];
  SplitLimits limits;
  SplitState state;
};

}  // namespace comm
}  // namespace mk
