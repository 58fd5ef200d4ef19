// mkernel — device side of the per-CTA timelines (device/trace.h): stamps and one event per
// work item. Traced kernel variants call these per item; the SM-partition controller records its
// role switches in any variant when the launch was given a trace buffer.
#pragma once

#include <cstdint>

#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"

namespace mk {
namespace device {

__device__ __forceinline__ uint32_t sm_id() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ uint64_t trace_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Records [t0, now) for `item` in `role`. Events past the capacity are counted, not written.
__device__ __forceinline__ void trace_record(const TraceBuffer& tb, Role role, int item, uint64_t t0) {
  const unsigned int i = atomicAdd(tb.count, 1u);
  if (i < tb.capacity) tb.events[i] = TraceEvent{t0, trace_now_ns(), sm_id(), blockIdx.x, uint32_t(role), item};
}

}  // namespace device
}  // namespace mk
