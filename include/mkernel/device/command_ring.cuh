// mkernel — pushing commands to the proxy from device code. Any thread may push; slots are
// claimed with one atomicAdd on the device head; a full ring back-pressures the pushing
// thread (a bounded wait on the proxy's tail), nothing is dropped.
#pragma once

#include "mkernel/device/signal.cuh"
#include "mkernel/device/ring_view.h"

namespace mk {
namespace device {

// Pushes c (its seq field is ignored) and returns true; returns false, pushing nothing, once a
// wait of this rank failed (the ring's slot never freed, or the communicator was aborted): a
// command must never vouch for data computed past a failed wait.
// Ordering: the fields reach host memory before seq (system fence, then a release store), so
// the proxy never reads a half-written command. Data the command refers to must be written
// (and fenced by the caller's __syncthreads / __threadfence_system) before the push.
__device__ __forceinline__ bool ring_push(const RingView& r, const WaitCtx& ctx, const Command& c) {
  if (wait_failed(ctx)) return false;
  const uint64_t slot = atomicAdd(r.head, 1ull);
  // Room when slot < tail + capacity, i.e. tail >= slot - capacity + 1.
  if (slot >= r.capacity && !wait_ge(ctx, r.tail, slot - r.capacity + 1, -1, kDiagRingSlot)) return false;
  Command* s = &r.slots[slot & (r.capacity - 1)];
  // Words 0..6 hold every field but seq (word 7): they first, then the fence, then seq.
  const uint64_t* src = reinterpret_cast<const uint64_t*>(&c);
  volatile uint64_t* dst = reinterpret_cast<volatile uint64_t*>(s);
#pragma unroll
  for (int i = 0; i < 7; ++i) dst[i] = src[i];
  __threadfence_system();
  st_release_sys(&s->seq, slot + 1);
  return true;
}

}  // namespace device
}  // namespace mk
