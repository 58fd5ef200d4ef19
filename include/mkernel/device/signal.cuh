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
//
// Failure contract: a wait that reaches its bound, or sees the communicator's abort word, gives
// up — it records who it waited for (DiagRecord), sets the abort word and returns false; the
// kernel runs to its end without waiting and raises no further signals (wait_failed), and the
// host turns the record into an error. Kernels are not trapped: the CUDA context (and with it
// the application's state) survives, and a new communicator can run again.
#pragma once

#include <cstdint>

#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"

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
// GPU scope: for flags that only threads of this GPU raise and read (a kernel's own work queue).
// A system-scope fence per wait serialized a persistent kernel's items (docs/moe.md).
__device__ __forceinline__ uint64_t ld_relaxed_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void red_add_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Raise a flag (own or a peer's) to v. Release, system scope. Callers that may run past a
// failed wait check wait_failed() first (see below).
__device__ __forceinline__ void signal_set(uint64_t* flag, uint64_t v) { st_release_sys(flag, v); }
// Add v to a flag (own or a peer's). Release, system scope.
__device__ __forceinline__ void signal_add(uint64_t* flag, uint64_t v) {
  red_add_release_sys(flag, v);
}

// Whether a wait of this rank's kernels has left without its flag (its bound expired, or the
// communicator was aborted): the claim word of the diagnostic record is then non-zero. Device
// memory, so the check costs an L2 read. A thread that raises signals to other CTAs or ranks
// checks it first and raises nothing once it is set: data computed past a failed wait may be
// garbage, and a flag must never vouch for it. Consumers downstream then fail their own waits
// (the abort word makes that immediate on this rank; peers reach their own bound).
__device__ __forceinline__ bool wait_failed(const WaitCtx& ctx) {
  return ctx.claim != nullptr && *reinterpret_cast<const volatile uint32_t*>(ctx.claim) != 0u;
}

// A wait that gives up: claims the communicator's diagnostic record (the first failed wait
// wins) and fills it, then sets the abort word so every other wait of this rank leaves at its
// next check. Returns; the kernel runs on without waiting and raises no more signals
// (wait_failed), so the host gets the record from a live CUDA context.
// Without a record or an abort word to leave through (a kernel given a bare WaitCtx), it traps.
// The claim word goes 0 -> 1 (claimed) -> 2 (record written).
__device__ __forceinline__ void leave_wait_body(const WaitCtx& ctx, const uint64_t* flag, int peer,
                                                int flag_index, uint64_t expected, uint64_t seen,
                                                uint64_t waited_ns, uint32_t reason) {
  if (!ctx.diag || !ctx.claim || !ctx.abort) __trap();
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
  }
  st_release_sys(const_cast<uint64_t*>(ctx.abort), 1);
}
inline __device__ __noinline__ void leave_wait(const WaitCtx& ctx, const uint64_t* flag, int peer,
                                               int flag_index, uint64_t expected, uint64_t seen,
                                               uint64_t waited_ns, uint32_t reason) {
  leave_wait_body(ctx, flag, peer, flag_index, expected, seen, waited_ns, reason);
}

// A traced launch's wait that had to spin, once met: one Role::kSpin event from its first poll to
// now, the peer (+ 1, 0: none) in the role's bits 8 and up, the flag's index as the item.
__device__ __forceinline__ void trace_spin_body(const WaitCtx& ctx, uint64_t start, int peer, int flag_index) {
  const unsigned int i = atomicAdd(ctx.trace_count, 1u);
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (i < ctx.trace_capacity)
    ctx.trace_events[i] = TraceEvent{start, global_timer_ns(), sm, blockIdx.x,
                                     static_cast<uint32_t>(Role::kSpin) | (static_cast<uint32_t>(peer + 1) << 8),
                                     flag_index};
}
inline __device__ __noinline__ void trace_spin(const WaitCtx& ctx, uint64_t start, int peer, int flag_index) {
  trace_spin_body(ctx, start, peer, flag_index);
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

// Waits until *flag >= expected (acquire, system scope) and returns true, or gives up and
// returns false: after ctx.timeout_ns, or as soon as the communicator's abort word is set (a
// peer died, the network failed, another wait of this rank gave up). A wait that gives up
// leaves the record naming rank, op, role, peer, flag, expected and seen (leave_wait); the
// kernel is not trapped, so the CUDA context survives and the host reports the record.
// kInlineReport: the cold path is inlined instead of called. Needed where one kernel waits in
// warps with different register budgets (setmaxnreg): ptxas cannot give one out-of-line
// function both budgets.
// kGpuScope: the flag is raised by threads of this GPU only (an acquire at GPU scope).
template <bool kInlineReport = false, bool kGpuScope = false>
__device__ __forceinline__ bool wait_ge(const WaitCtx& ctx, const uint64_t* flag, uint64_t expected,
                                        int peer, int flag_index) {
  // Poll with relaxed loads (an acquire load per poll would fence every iteration and slow
  // the SM and the memory system for everyone); once the value is there, one fence makes the
  // poll an acquire (PTX "acquire pattern": a strong read, then fence.acq_rel).
  uint64_t v = (kGpuScope ? ld_relaxed_gpu(flag) : ld_relaxed_sys(flag));
  if (v < expected) {
    const uint64_t start = global_timer_ns();
    uint32_t spins = 0, nap = 0;
    while ((v = (kGpuScope ? ld_relaxed_gpu(flag) : ld_relaxed_sys(flag))) < expected) {
      if (ctx.backoff_ns) {
        nap = nap ? min(2 * nap, ctx.backoff_ns) : min(32u, ctx.backoff_ns);
        __nanosleep(nap);
      }
      if ((++spins & 63u) == 0) {
        const uint64_t waited = global_timer_ns() - start;
        const bool aborted = ctx.abort && ld_volatile_u64(ctx.abort) != 0;
        if (waited > ctx.timeout_ns || aborted) {
          const uint32_t why = aborted ? kDiagAborted : kDiagTimeout;
          if constexpr (kInlineReport)
            leave_wait_body(ctx, flag, peer, flag_index, expected, v, waited, why);
          else
            leave_wait(ctx, flag, peer, flag_index, expected, v, waited, why);
          return false;
        }
      }
    }
    if (ctx.trace_events) {
      if constexpr (kInlineReport) trace_spin_body(ctx, start, peer, flag_index);
      else trace_spin(ctx, start, peer, flag_index);
    }
  }
  if constexpr (kGpuScope) fence_acq_rel_gpu();
  else fence_acq_rel_sys();
  return true;
}

}  // namespace device
}  // namespace mk
