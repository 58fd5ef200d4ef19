// mkernel — device signals: 64-bit flags in symmetric memory, release/acquire at system
// scope (peers may be other processes and other GPUs), and bounded waits.
//
// Memory-ordering contract:
//  - signal_set / signal_add are release operations at .sys scope: every write this thread
//    made before (and, through a preceding __syncthreads, every write its CTA made) is
//    visible to a thread that observes the new value with an acquire load.
//  - wait_ge is an acquire: reads after it (in this thread, or in its CTA after a following
//    __syncthreads) see the data published before the matching signal.
//  - Flags are monotonic: a call's target is derived from its epoch (epoch.cuh), so flags are
//    never reset between calls and a captured CUDA graph can replay.
#pragma once

#include <cstdint>

#include "mkernel/device/diag.h"

namespace mk {
namespace device {

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Raise a flag (own or a peer's) to v. Release, system scope.
__device__ __forceinline__ void signal_set(uint64_t* flag, uint64_t v) { st_release_sys(flag, v); }
// Add v to a flag (own or a peer's). Release, system scope.
__device__ __forceinline__ void signal_add(uint64_t* flag, uint64_t v) {
  red_add_release_sys(flag, v);
}

// Writes the diagnostic record (first timed-out wait wins) and traps. Never returns.
// Out of line: the cold path stays out of every wait loop's instruction stream.
// The claim word goes 0 -> 1 (claimed) -> 2 (record written). A thread that loses the claim
// waits (bounded) for 2 before trapping: a trap ends the whole grid, and an early one from
// another thread would cut the winner's record short.
__device__ __forceinline__ void report_wait_timeout_body(const WaitCtx& ctx, const uint64_t* flag,
                                                         int peer, int flag_index, uint64_t expected,
                                                         uint64_t seen, uint64_t waited_ns,
                                                         uint32_t reason) {
  if (ctx.diag && ctx.claim) {
    if (atomicCAS(ctx.claim, 0u, 1u) == 0u) {
      volatile DiagRecord* d = ctx.diag;
      d->rank = ctx.rank;
      d->peer = peer;
      d->op_tag = ctx.op_tag;
      d->role = ctx.role;
      d->flag_index = flag_index;
      d->block = static_cast<int32_t>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
      d->thread = static_cast<int32_t>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
      d->expected = expected;
      d->seen = seen;
      d->waited_ns = waited_ns;
      d->timeout_ns = ctx.timeout_ns;
      d->reason = reason;
      __threadfence_system();
      d->state = 2u;
      __threadfence_system();
      atomicExch(ctx.claim, 2u);
    } else {
      const uint64_t t0 = global_timer_ns();
      while (atomicAdd(ctx.claim, 0u) != 2u && global_timer_ns() - t0 < 100000000ull) {
      }
    }
  }
  __trap();
}
inline __device__ __noinline__ void report_wait_timeout(const WaitCtx& ctx, const uint64_t* flag,
                                                        int peer, int flag_index, uint64_t expected,
                                                        uint64_t seen, uint64_t waited_ns,
                                                        uint32_t reason = kDiagTimeout) {
  report_wait_timeout_body(ctx, flag, peer, flag_index, expected, seen, waited_ns, reason);
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

// Waits until *flag >= expected (acquire, system scope) and returns the value seen.
// Bounded: after ctx.timeout_ns — or as soon as the communicator's abort word is set (a
// peer died, the network failed) — the wait reports (rank, op, role, peer, flag, expected,
// seen) and traps, so a lost signal becomes an error on the host, never a silent hang.
// kInlineReport: the cold path is inlined instead of called. Needed where one kernel waits in
// warps with different register budgets (setmaxnreg): ptxas cannot give one out-of-line
// function both budgets.
template <bool kInlineReport = false>
__device__ __forceinline__ uint64_t wait_ge(const WaitCtx& ctx, const uint64_t* flag,
                                            uint64_t expected, int peer, int flag_index) {
  // Poll with relaxed loads (an acquire load per poll would fence every iteration and slow
  // the SM and the memory system for everyone); once the value is there, one fence makes the
  // poll an acquire (PTX "acquire pattern": a strong read, then fence.acq_rel).
  uint64_t v = ld_relaxed_sys(flag);
  if (v < expected) {
    const uint64_t start = global_timer_ns();
    uint32_t spins = 0;
    while ((v = ld_relaxed_sys(flag)) < expected) {
      if ((++spins & 255u) == 0) {
        const uint64_t waited = global_timer_ns() - start;
        if (waited > ctx.timeout_ns || (ctx.abort && ld_volatile_u64(ctx.abort) != 0)) {
          const uint32_t why = waited > ctx.timeout_ns ? kDiagTimeout : kDiagAborted;
          if constexpr (kInlineReport)
            report_wait_timeout_body(ctx, flag, peer, flag_index, expected, v, waited, why);
          else
            report_wait_timeout(ctx, flag, peer, flag_index, expected, v, waited, why);
        }
      }
    }
  }
  fence_acq_rel_sys();
  return v;
}

}  // namespace device
}  // namespace mk
