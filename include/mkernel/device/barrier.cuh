// mkernel — CTA barriers for device code that must build without the CUTLASS headers (the
// communication executor, src/comm/executor.cuh, and the kernels that run it).
//
// Named barriers use the same hardware ids as CUTLASS's NamedBarrier: a kernel's barrier id b is
// hardware barrier b + kNamedBarrierBase, CUTLASS keeping ids below kNamedBarrierBase for its own
// collectives. Kernels that mix these helpers with CUTLASS's NamedBarrier therefore agree on every
// id.
//
// Transaction barriers (mbarrier) count arrivals and bytes of bulk copies into shared memory:
// init once per CTA (then fence_mbarrier_init and a CTA barrier), arrive_expect_tx by the thread
// that issues a copy, wait_parity by the threads that read what it copied.
#pragma once

#include <cstdint>

namespace mk {
namespace device {

// CUTLASS's ReservedNamedBarrierCount (cutlass/arch/barrier.h, 4.x): ids below it are CUTLASS's.
constexpr uint32_t kNamedBarrierBase = 8;

// The threads of `threads` (a multiple of 32, every thread of the warps taking part) meet at
// kernel barrier `id` (0 .. 7).
__device__ __forceinline__ void named_barrier_sync(uint32_t threads, uint32_t id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id + kNamedBarrierBase), "r"(threads) : "memory");
}

// A shared-memory address as the 32-bit address PTX's shared state space takes.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%1], %0;" ::"r"(arrivals), "r"(smem_addr(bar)) : "memory");
}
// Makes the inits of this thread visible (to the async proxy too) before a following CTA barrier.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival, and `bytes` more transaction bytes expected before the phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %0;" ::"r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// Until the phase of parity `phase` (0 or 1) completed.
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n\t"
      ".reg .pred p;\n\t"
      "MK_MBAR_WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, %2;\n\t"
      "@!p bra MK_MBAR_WAIT;\n\t"
      "}" ::"r"(smem_addr(bar)),
      "r"(phase), "r"(0x989680u)
      : "memory");
}

}  // namespace device
}  // namespace mk
