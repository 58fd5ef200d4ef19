// mkernel — per-call epochs kept on the device, so flags need no host reset between calls
// and a captured CUDA graph replays correctly.
//
// Protocol: a kernel's CTAs read epoch_of_call() at their start; the call's signals carry
// that epoch (or targets derived from it: base * epoch + step); the last CTA to finish calls
// advance through epoch_finish(). Alternatively launch mk::launch_epoch_advance() after the
// call (stream-ordered, capturable).
#pragma once

#include <cstdint>

#include "mkernel/device/views.h"

namespace mk {

namespace device {

// The epoch of the running call: 1 for the first call, then 2, 3, ...
__device__ __forceinline__ uint64_t epoch_of_call(const EpochState* e) {
  return *reinterpret_cast<const volatile uint64_t*>(&e->value) + 1;
}

// Called by every CTA of the call after its last use of epoch_of_call(); the last CTA to
// arrive advances the epoch for the next call (stream order publishes it to that call), and
// zeroes *zero_last when given (a counter every CTA is done with: the next call's starts at 0).
__device__ __forceinline__ void epoch_finish(EpochState* e, uint32_t num_ctas, int* zero_last = nullptr) {
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    __threadfence();
    if (atomicAdd(&e->arrived, 1u) == num_ctas - 1) {
      e->arrived = 0;
      if (zero_last) *zero_last = 0;
      __threadfence();
      atomicAdd(reinterpret_cast<unsigned long long*>(&e->value), 1ull);
    }
  }
}

}  // namespace device
}  // namespace mk
