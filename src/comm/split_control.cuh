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

// A forced switch (tests) is due: the tiles taken reached the next forced point.
template <class Sched_>
__device__ __forceinline__ bool split_force_due(const SplitCtl* c, const Sched_& sched) {
  const int next = *reinterpret_cast<const volatile int*>(&c->next_force);
  return next < c->n_force && *reinterpret_cast<const volatile int*>(sched.p.counter) >= c->force_at[next];
}

// By the scheduling thread of any CTA at a work-item boundary: at most one runs the rule at a
// time (the others go on at once), at most once per interval. It samples the signals (the
// tiles of `sched`, the ops of `prog`, the command ring), runs the rule, and publishes the count
// in role_counts[0] for the next items of every CTA (traced when trace.events). A forced switch
// (tests) is applied at the first work item after its point, between samples too: a sample
// costs microseconds, so a short call may see few of them.
template <class Sched_>
__device__ __forceinline__ void split_control(SplitCtl* c, const DeviceProgram& prog, const int* role_counts,
                                              const TraceBuffer& trace, const Sched_& sched, uint64_t epoch) {
  const bool force_seen = c->n_force > 0 && split_force_due(c, sched);
  if (!force_seen && static_cast<int64_t>(device::trace_now_ns()) - *reinterpret_cast<volatile int64_t*>(&c->state.last_ns) <
                         *reinterpret_cast<volatile int64_t*>(&c->gap_ns))
    return;
  if (atomicCAS(&c->lock, 0, 1) != 0) return;
  __threadfence();
  // Under the lock: the forced point, the clock and the interval again (another thread may have
  // sampled or forced between the first check and the lock).
  const int64_t now = static_cast<int64_t>(device::trace_now_ns());
  const bool sample = now - c->state.last_ns >= c->gap_ns;
  const bool force = c->n_force > 0 && split_force_due(c, sched);
  if (!sample && !force) {
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
  int32_t after = sample ? split_step(&c->state, x, c->limits) : before;
  if (force) {
    after = split_clamp(c->force_to[c->next_force++], c->limits);
    split_change(&c->state, x, after);  // a change like the rule's (hold, window), judged by none
    c->state.probe_from = -1;
  }
  if (after != before || force) {  // a forced count is recorded even when it was already there
    atomicExch(const_cast<int*>(role_counts), after);
    if (trace.events) device::trace_record(trace, Role::kController, after, static_cast<uint64_t>(now));
  }
  c->last_mean = split_mean(c->state);
  c->has_mean = 1;
  if (!sample) {  // a forced switch alone: no sample cost to learn
    __threadfence();
    atomicExch(&c->lock, 0);
    return;
  }
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
