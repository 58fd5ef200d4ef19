// mkernel — the SM-partition controller on the device: the sampling that feeds the rule
// (split_control.h) and the published count, run by the communication role (comm_role.cuh,
// take_op). The host side is src/ops/control/split_controller.h.
#pragma once

#include <cstdint>

#include "mkernel/device/trace.cuh"
#include "src/comm/device_program.h"
#include "src/comm/executor.cuh"
#include "src/comm/split_control.h"

namespace mk {
namespace comm {

// By the scheduling thread of any CTA at a work-item boundary: at most one runs the rule at a
// time (the others go on at once), at most once per interval. It samples the signals (the
// tiles of `sched`, the ops of `prog`, the command ring), applies a forced switch due (tests) or
// the rule, and publishes the count in role_counts[0] for the next items of every CTA (traced
// when trace.events).
template <class Sched_>
__device__ __forceinline__ void split_control(SplitCtl* c, const DeviceProgram& prog, const int* role_counts,
                                              const TraceBuffer& trace, const Sched_& sched, uint64_t epoch) {
  if (static_cast<int64_t>(device::trace_now_ns()) - *reinterpret_cast<volatile int64_t*>(&c->state.last_ns) <
      *reinterpret_cast<volatile int64_t*>(&c->gap_ns))
    return;
  if (atomicCAS(&c->lock, 0, 1) != 0) return;
  __threadfence();
  // Under the lock: the clock and the interval again (another thread may have sampled between
  // the first check and the lock).
  const int64_t now = static_cast<int64_t>(device::trace_now_ns());
  if (now - c->state.last_ns < c->gap_ns) {
    atomicExch(&c->lock, 0);
    return;
  }
  SplitSample x;
  x.now_ns = now;
  x.tiles_total = sched.num_tiles;
  x.tiles_taken = min(*reinterpret_cast<volatile int*>(sched.p.counter), sched.num_tiles);
  x.ops_total = prog.n_ops;
  x.ops_taken = min(*reinterpret_cast<volatile int*>(prog.op_counter), prog.n_ops);
  x.ops_done = *reinterpret_cast<volatile int*>(&c->ops_done);
  int ready = 0;
  for (int i = x.ops_taken; i < min(prog.n_ops, x.ops_taken + kSplitPeek); ++i)
    ready += op_ready(prog, i, epoch) ? 1 : 0;
  x.ops_ready = ready;
  x.stalls = *reinterpret_cast<volatile int*>(&c->stalls);
  x.stalled = max(*reinterpret_cast<volatile int*>(&c->stalled), 0);
  if (prog.ring.head) {
    const uint64_t head = *reinterpret_cast<volatile unsigned long long*>(prog.ring.head);
    const uint64_t tail = *reinterpret_cast<const volatile uint64_t*>(prog.ring.tail);
    x.ring_queued = head > tail ? static_cast<int32_t>(min(head - tail, uint64_t(1) << 30)) : 0;
    x.ring_capacity = static_cast<int32_t>(min(prog.ring.capacity, uint64_t(1) << 30));
  }
  const int32_t before = c->state.comm;
  int32_t after = split_step(&c->state, x, c->limits);
  bool forced = false;
  if (c->next_force < c->n_force && x.tiles_taken >= c->force_at[c->next_force]) {
    after = split_clamp(c->force_to[c->next_force++], c->limits);
    split_change(&c->state, x, after);  // a change like the rule's (hold, window), judged by none
    c->state.probe_from = -1;
    forced = true;                      // recorded even when the count was already there
  }
  if (after != before || forced) {
    atomicExch(const_cast<int*>(role_counts), after);
    if (trace.events) device::trace_record(trace, Role::kController, after, static_cast<uint64_t>(now));
  }
  c->last_mean = split_mean(c->state);
  c->has_mean = 1;
  // What this sample cost its thread (the CTA's next item waited for it), smoothed; the
  // interval keeps sampling within its share of the grid's time (split_interval_ns).
  int64_t cost = static_cast<int64_t>(device::trace_now_ns()) - now;
  cost = cost > 0 ? cost : 0;
  c->sample_ns = c->sample_ns > 0 ? (3 * c->sample_ns + cost + 3) / 4 : cost;
  c->gap_ns = split_interval_ns(c->interval_ns, c->sample_ns, c->limits.grid);
  __threadfence();
  atomicExch(&c->lock, 0);
}

}  // namespace comm
}  // namespace mk
