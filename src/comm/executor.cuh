// mkernel — the device side of a communication program (device_program.h): bounded waits,
// signals, and the copy / reduce / zero / network-put ops that communication CTAs run. Kernels
// reach them through the communication-role policy (comm_role.cuh), which the persistent GEMM
// and the persistent attention kernel take as a template parameter, or run them alone
// (for_each_op_in_order: MoE's runner). Needs no CUTLASS headers (barriers: device/barrier.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mkernel/device/barrier.cuh"
#include "mkernel/device/command_ring.cuh"
#include "mkernel/device/signal.cuh"
#include "src/comm/device_program.h"

namespace mk {
namespace comm {

// Waits [w0, w0 + n) of the hook pool, by one thread (acquire at system scope). A wait that
// gives up (bound or abort) lets the rest go on without waiting: the kernel runs to its end.
// kProducer: called from the producer warp (40 registers), whose waits inline their cold path.
// kGpuScope: flags only this GPU's threads raise (device::wait_ge).
template <bool kProducer = false, bool kGpuScope = false>
__device__ __forceinline__ void hook_waits(const DeviceProgram& h, uint32_t w0, uint32_t n, uint64_t epoch) {
  for (uint32_t i = 0; i < n; ++i) {
    const DevWait& w = h.waits[w0 + i];
    if (w.mul) device::wait_ge<kProducer, kGpuScope>(h.wait, w.flag, w.mul * epoch, w.peer, w.index);
  }
}
// Raises nothing once a wait of this rank failed (device::wait_failed): a flag never vouches
// for data computed past a failed wait. kGpuScope: flags only this GPU's threads wait on
// (release at GPU scope).
template <bool kGpuScope = false>
__device__ __forceinline__ void hook_signals(const DeviceProgram& h, uint32_t s0, uint32_t n, uint64_t epoch) {
  if (n == 0 || device::wait_failed(h.wait)) return;
  for (uint32_t i = 0; i < n; ++i) {
    const DevSignal& g = h.signals[s0 + i];
    if constexpr (kGpuScope) {
      if (g.add) device::red_add_release_gpu(g.flag, g.value);
      else device::st_release_gpu(g.flag, g.value * epoch);
    } else {
      if (g.add) device::signal_add(g.flag, g.value);
      else device::signal_set(g.flag, g.value * epoch);
    }
  }
}

// An op's pointer entry: absolute, or (kUserPtrBit) an offset into caller buffer h.user[slot].
__device__ __forceinline__ char* op_ptr(const DeviceProgram& h, uint64_t v) {
  return (v & kUserPtrBit) ? static_cast<char*>(h.user[(v >> 56) & 0x7f]) + (v & ((1ull << 56) - 1))
                           : reinterpret_cast<char*>(v);
}

// Whether waits [w0, w0 + n) are already met (a peek: relaxed loads, no acquire).
__device__ __forceinline__ bool waits_met(const DeviceProgram& h, uint32_t w0, uint32_t n, uint64_t epoch) {
  for (uint32_t i = 0; i < n; ++i) {
    const DevWait& w = h.waits[w0 + i];
    if (w.mul && device::ld_relaxed_sys(w.flag) < w.mul * epoch) return false;
  }
  return true;
}

// Whether op `idx`'s waits are all met now (a peek: relaxed loads, no acquire).
__device__ __forceinline__ bool op_ready(const DeviceProgram& h, int idx, uint64_t epoch) {
  const DevOp& op = h.ops[idx];
  for (uint32_t i = 0; i < op.nwait; ++i) {
    const DevWait& w = h.waits[op.wait0 + i];
    if (device::ld_relaxed_sys(w.flag) < w.mul * epoch) return false;
  }
  return true;
}

// dsts[d][0, bytes) = src[0, bytes) for d < ndst, by kThreads threads; 16-byte aligned, bytes a
// multiple of 16. Plain vector loads and stores: also for pinned host memory (staged network).
// kU * 16 bytes in flight per thread (8: 32 KiB per 256 threads): copies under a running GEMM see
// microseconds of latency, so a CTA needs many bytes in flight (docs/fused.md); a runner CTA,
// with nothing else on its registers, takes 16.
template <int kThreads, int kU = 8>
__device__ __forceinline__ void copy_words(const void* src_, void* const* dsts, uint32_t ndst, uint64_t bytes,
                                           int tid) {
  const int4* src = static_cast<const int4*>(src_);
  const uint64_t n = bytes / 16;
  uint64_t j = tid;
  for (; j + (kU - 1) * kThreads < n; j += kU * kThreads) {
    int4 v[kU];
    #pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = src[j + u * kThreads];
    for (uint32_t d = 0; d < ndst; ++d) {
      int4* dst = static_cast<int4*>(dsts[d]);
      #pragma unroll
      for (int u = 0; u < kU; ++u) dst[j + u * kThreads] = v[u];
    }
  }
  for (; j < n; j += kThreads) {
    const int4 v = src[j];
    for (uint32_t d = 0; d < ndst; ++d) static_cast<int4*>(dsts[d])[j] = v;
  }
}

// The reduce op: dsts[d][i] = sum over k of srcs[k][i] for i < op.elems, in fp32, sources added
// in their order (deterministic plans rely on it); sources in op.zero_mask zeroed after reading.
// Bandwidth comes from bytes in flight: with kB > 1 every thread loads its words of kB sources
// before it adds any (kUW 16-byte words of each; one 8-byte word at a time, one source after the
// other, left a runner's CTA latency-bound: the bf16 all-reduce moved a quarter of a device
// copy's bytes). bf16 sources then go 8 elements per 16-byte word when every pointer is 16-byte
// aligned (the collectives' chunks are); otherwise, and for the last 4 elements, 4 per word.
// kB == 1: one source at a time, 4 words of 4 elements per thread (a fused kernel's CTAs).
template <int kThreads, int kB, int kUW>
__device__ __forceinline__ void reduce_op(const DevOp& op, void* const* ptr, int tid) {
  constexpr int kU4 = kB > 1 ? 2 : 4;  // 4-element words per thread (the same bytes in flight, or more)
  const uint32_t nsrc = op.nsrc, ndst = op.ndst;
  const bool bf16_src = (op.flags & kDevOpSrcBf16) != 0;
  auto add4 = [](float4& a, const float4& v) { a.x += v.x; a.y += v.y; a.z += v.z; a.w += v.w; };
  auto widen = [](uint32_t w) { return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w)); };
  auto narrow = [](float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  };
  uint64_t g4_begin = 0;  // the first 4-element group the general loop below takes
  bool wide = kB > 1 && bf16_src;
  for (uint32_t k = 0; k < nsrc + ndst && wide; ++k) wide = (reinterpret_cast<uintptr_t>(ptr[k]) & 15u) == 0;
  if constexpr (kB > 1) if (wide) {
    // 8 elements per word: sources uint4 (bf16), destinations uint4 (bf16) or 2 x float4 (fp32).
    const uint64_t n = op.elems / 8;
    auto finish8 = [&](uint64_t j, const float4& lo, const float4& hi) {
      for (uint32_t k = 0; k < nsrc; ++k)
        if (op.zero_mask & (1u << k)) static_cast<uint4*>(ptr[k])[j] = make_uint4(0u, 0u, 0u, 0u);
      if (op.dst_f32) {
        for (uint32_t d = 0; d < ndst; ++d) {
          float4* o = static_cast<float4*>(ptr[nsrc + d]);
          o[2 * j] = lo;
          o[2 * j + 1] = hi;
        }
      } else {
        const uint4 w = make_uint4(narrow(lo.x, lo.y), narrow(lo.z, lo.w), narrow(hi.x, hi.y), narrow(hi.z, hi.w));
        for (uint32_t d = 0; d < ndst; ++d) static_cast<uint4*>(ptr[nsrc + d])[j] = w;
      }
    };
    auto acc8 = [&](float4& lo, float4& hi, const uint4& w, bool first) {
      const float2 a = widen(w.x), b = widen(w.y), c = widen(w.z), d = widen(w.w);
      const float4 l = make_float4(a.x, a.y, b.x, b.y), h = make_float4(c.x, c.y, d.x, d.y);
      if (first) {
        lo = l, hi = h;
      } else {
        add4(lo, l), add4(hi, h);
      }
    };
    uint64_t j = tid;
    for (; j + (kUW - 1) * kThreads < n; j += kUW * kThreads) {
      float4 lo[kUW], hi[kUW];
      for (uint32_t k0 = 0; k0 < nsrc; k0 += kB) {
        uint4 v[kB][kUW];
        #pragma unroll
        for (int b = 0; b < kB; ++b)
          if (k0 + b < nsrc) {
            const uint4* src = static_cast<const uint4*>(ptr[k0 + b]);
            #pragma unroll
            for (int u = 0; u < kUW; ++u) v[b][u] = src[j + u * kThreads];
          }
        #pragma unroll
        for (int b = 0; b < kB; ++b)
          if (k0 + b < nsrc) {
            #pragma unroll
            for (int u = 0; u < kUW; ++u) acc8(lo[u], hi[u], v[b][u], k0 + b == 0);
          }
      }
      #pragma unroll
      for (int u = 0; u < kUW; ++u) finish8(j + u * kThreads, lo[u], hi[u]);
    }
    for (; j < n; j += kThreads) {
      float4 lo, hi;
      for (uint32_t k = 0; k < nsrc; ++k) acc8(lo, hi, static_cast<const uint4*>(ptr[k])[j], k == 0);
      finish8(j, lo, hi);
    }
    g4_begin = 2 * n;
  }
  // 4 elements per word: fp32 sources float4, bf16 sources uint2.
  const uint64_t n = op.elems / 4;
  auto finish = [&](uint64_t j, const float4& acc) {
    for (uint32_t k = 0; k < nsrc; ++k)
      if (op.zero_mask & (1u << k)) {
        if (bf16_src) static_cast<uint2*>(ptr[k])[j] = make_uint2(0u, 0u);
        else static_cast<float4*>(ptr[k])[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    if (op.dst_f32) {
      for (uint32_t d = 0; d < ndst; ++d) static_cast<float4*>(ptr[nsrc + d])[j] = acc;
    } else {
      const uint2 w = make_uint2(narrow(acc.x, acc.y), narrow(acc.z, acc.w));
      for (uint32_t d = 0; d < ndst; ++d) static_cast<uint2*>(ptr[nsrc + d])[j] = w;
    }
  };
  // Element group j (4 values) of source k: fp32, or bf16 widened (kDevOpSrcBf16).
  auto ld = [&](uint32_t k, uint64_t j) -> float4 {
    if (!bf16_src) return static_cast<const float4*>(ptr[k])[j];
    const uint2 raw = static_cast<const uint2*>(ptr[k])[j];
    const float2 lo = widen(raw.x), hi = widen(raw.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  };
  uint64_t j = g4_begin + tid;
  if constexpr (kB == 1) {
    // One source at a time (a fused kernel's communication CTA: its registers are the GEMM's).
    for (; j + (kU4 - 1) * kThreads < n; j += kU4 * kThreads) {
      float4 acc[kU4];
      #pragma unroll
      for (int u = 0; u < kU4; ++u) acc[u] = ld(0, j + u * kThreads);
      for (uint32_t k = 1; k < nsrc; ++k) {
        float4 v[kU4];
        #pragma unroll
        for (int u = 0; u < kU4; ++u) v[u] = ld(k, j + u * kThreads);
        #pragma unroll
        for (int u = 0; u < kU4; ++u) add4(acc[u], v[u]);
      }
      #pragma unroll
      for (int u = 0; u < kU4; ++u) finish(j + u * kThreads, acc[u]);
    }
  } else {
    for (; j + (kU4 - 1) * kThreads < n; j += kU4 * kThreads) {
      float4 acc[kU4];
      for (uint32_t k0 = 0; k0 < nsrc; k0 += kB) {
        float4 v[kB][kU4];
        #pragma unroll
        for (int b = 0; b < kB; ++b)
          if (k0 + b < nsrc) {
            #pragma unroll
            for (int u = 0; u < kU4; ++u) v[b][u] = ld(k0 + b, j + u * kThreads);
          }
        #pragma unroll
        for (int b = 0; b < kB; ++b)
          if (k0 + b < nsrc) {
            #pragma unroll
            for (int u = 0; u < kU4; ++u) {
              if (k0 + b == 0) acc[u] = v[b][u];
              else add4(acc[u], v[b][u]);
            }
          }
      }
      #pragma unroll
      for (int u = 0; u < kU4; ++u) finish(j + u * kThreads, acc[u]);
    }
  }
  for (; j < n; j += kThreads) {
    float4 acc = ld(0, j);
    for (uint32_t k = 1; k < nsrc; ++k) add4(acc, ld(k, j));
    finish(j, acc);
  }
}

// One op of the communication program, run by kThreads threads (tid 0..kThreads-1) of a CTA that
// meet on named barrier kBarrier. kCopyU: copy_words' words in flight per thread; kReduceB,
// kReduceUW: reduce_op's sources loaded together and 8-element words per thread (a runner's CTA
// takes more than a fused kernel's, whose registers the compute role sizes).
template <int kThreads, uint32_t kBarrier, int kCopyU = 8, int kReduceB = 1, int kReduceUW = 1>
__device__ __noinline__ void run_comm_op(const DeviceProgram& h, int index, int tid, uint64_t epoch) {
  const DevOp& op = h.ops[index];
  if (tid == 0) hook_waits(h, op.wait0, op.nwait, epoch);
  device::named_barrier_sync(kThreads, kBarrier);
  // Resolve the op's pointers (at most 16; a caller buffer's entry is relative to h.user).
  void* ptr[kMaxOpBuffers];
  const uint32_t np = min(op.nsrc + op.ndst, uint32_t(kMaxOpBuffers));
  for (uint32_t k = 0; k < np; ++k) ptr[k] = op_ptr(h, h.ptrs[op.ptr0 + k]);
  uint64_t bytes = op.bytes;
  if (op.flags & kDevOpCountAt) {
    // A run-time count, written before the op's waits were satisfied (read after them): at most
    // op.bytes, in whole 16-byte words.
    const uint64_t n = *reinterpret_cast<const volatile uint64_t*>(op_ptr(h, h.ptrs[op.count_ptr]));
    bytes = min(bytes, n) & ~uint64_t(15);
  }
  switch (op.kind) {
    case kDevCopy:
      copy_words<kThreads, kCopyU>(ptr[0], ptr + op.nsrc, op.ndst, bytes, tid);
      break;
    case kDevZero: {
      const uint64_t n = bytes / 16;
      const int4 z = make_int4(0, 0, 0, 0);
      for (uint32_t d = 0; d < op.ndst; ++d)
        for (uint64_t j = tid; j < n; j += kThreads) static_cast<int4*>(ptr[op.nsrc + d])[j] = z;
      break;
    }
    case kDevReduce:
      reduce_op<kThreads, kReduceB, kReduceUW>(op, ptr, tid);
      break;
    case kDevNetPut:
      // Its waits (taken above) made the source final; the proxy reads it after the push.
      // Staged: the CTA first copies it into the host mirror the proxy sends from.
      // A run-time count (kDevOpCountAt) sizes both the staging copy and the put.
      if (op.nsrc == 1 && op.ndst == 1) {
        copy_words<kThreads>(ptr[0], ptr + 1, 1, bytes, tid);
        __threadfence_system();
        device::named_barrier_sync(kThreads, kBarrier);
      }
      if (tid == 0) {
        __threadfence_system();
        Command c = op.cmd;
        c.bytes = bytes;
        device::ring_push(h.ring, h.wait, c);
      }
      break;
    default:
      break;
  }
  if (op.nsig) {
    __threadfence_system();
    device::named_barrier_sync(kThreads, kBarrier);
    if (tid == 0) hook_signals(h, op.sig0, op.nsig, epoch);
  }
}

// Shared-memory stages for bulk copies (the copy engine of the SM: cp.async.bulk), owned by the
// one thread that issues them. Many bytes in flight per CTA: a few KiB of plain loads per CTA
// leave a peer copy latency-bound (about 14 GB/s per CTA seen on the H200, docs/attention.md).
struct BulkStages {
  char* smem;          // stages * stage_bytes, 128-byte aligned
  uint64_t* bars;      // one mbarrier per stage
  int stages;          // >= 2
  uint32_t stage_bytes;  // multiple of 16, < 2^20
  uint32_t phases;     // parity of each stage's next completion (bit s)
};

// Initializes the stages' mbarriers (one thread; the CTA syncs before any use).
__device__ __forceinline__ void bulk_stages_init(BulkStages& b) {
  for (int s = 0; s < b.stages; ++s) device::mbarrier_init(&b.bars[s], 1);
  device::fence_mbarrier_init();
  b.phases = 0;
}

// A bulk load of len bytes (a multiple of 16) from global src into shared dst, completing on the
// mbarrier bar as a transaction of the stage (the caller expected its bytes).
__device__ __forceinline__ void bulk_load(char* dst, const char* src, uint32_t len, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(device::smem_addr(dst)), "l"(src), "r"(len), "r"(device::smem_addr(bar)) : "memory");
}

// dst[0, bytes) = src[0, bytes) through the stages, by the calling thread alone; both 16-byte
// aligned, bytes a multiple of 16. @post the writes are complete and ordered before the
// caller's later generic-proxy release (proxy fence).
__device__ __forceinline__ void bulk_copy(BulkStages& b, const char* src, char* dst, uint64_t bytes) {
  const uint64_t sb = b.stage_bytes;
  const uint64_t n = (bytes + sb - 1) / sb;
  auto len = [&](uint64_t c) { return uint32_t(min(sb, bytes - c * sb)); };
  auto load = [&](uint64_t c) {
    const int s = int(c % uint64_t(b.stages));
    device::mbarrier_arrive_expect_tx(&b.bars[s], len(c));
    bulk_load(b.smem + s * sb, src + c * sb, len(c), &b.bars[s]);
  };
  const uint64_t first = min(n, uint64_t(b.stages));
  for (uint64_t c = 0; c < first; ++c) load(c);
  for (uint64_t c = 0; c < n; ++c) {
    const int s = int(c % uint64_t(b.stages));
    device::mbarrier_wait_parity(&b.bars[s], (b.phases >> s) & 1u);
    b.phases ^= 1u << s;
    const uint32_t ssm = device::smem_addr(b.smem + s * sb);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * sb), "r"(ssm),
                 "r"(len(c)) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // Refill the stage the previous store read from, once that store has read it.
    if (c >= 1 && c - 1 + b.stages < n) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(c - 1 + b.stages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The other threads' view of the stages after thread 0 alone ran bulk_copy over `chunks`
// stage-sized chunks: each stage's completion parity flipped once per use.
__device__ __forceinline__ void bulk_stages_advance(BulkStages& b, uint64_t chunks) {
  for (int s = 0; s < b.stages; ++s) {
    const uint64_t uses = chunks / uint64_t(b.stages) + (uint64_t(s) < chunks % uint64_t(b.stages) ? 1 : 0);
    if (uses & 1u) b.phases ^= 1u << s;
  }
}

// dsts[d][i] = srcs[0][i] + srcs[1][i] + ... (fp32, sources added in their order, as reduce_op)
// for i < elems, through the bulk-copy engine both ways: each stage holds one chunk of every
// source; thread 0 issues the loads (up to stages x stage_bytes in flight); every thread waits
// for the stage and adds its words into the first source's place in it; thread 0 stores the
// chunk with a bulk copy and refills the stage once that copy has read it. Up to 128 KiB in
// flight where reduce_op's plain loads keep 16 KiB: beside other SMs' memory traffic one CTA's
// two-source reduce moved 41-44 GB/s this way and 19.5 with plain loads (bench_comm_ops, H100;
// alone 67 and 84). Every pointer 16-byte aligned, device memory, nsrc <= 4; run by all kThreads
// threads (named barrier kBarrier). @pre the op's waits were taken (thread 0, acquire).
// @post (thread 0) the stores are complete and ordered before its later generic-proxy release.
template <int kThreads, uint32_t kBarrier>
__device__ __forceinline__ void bulk_reduce_f32(BulkStages& b, void* const* ptr, uint32_t nsrc, uint32_t ndst,
                                                uint64_t elems, int tid) {
  const uint64_t bytes = elems * 4;
  const uint64_t cb = (uint64_t(b.stage_bytes) / nsrc) & ~uint64_t(15);  // bytes of each source per stage
  const uint64_t n = (bytes + cb - 1) / cb;
  auto len = [&](uint64_t c) { return uint32_t(min(cb, bytes - c * cb)); };
  auto stage = [&](uint64_t c) { return b.smem + (c % uint64_t(b.stages)) * b.stage_bytes; };
  auto load = [&](uint64_t c) {
    const int s = int(c % uint64_t(b.stages));
    device::mbarrier_arrive_expect_tx(&b.bars[s], len(c) * nsrc);
    for (uint32_t k = 0; k < nsrc; ++k)
      bulk_load(stage(c) + k * cb, static_cast<const char*>(ptr[k]) + c * cb, len(c), &b.bars[s]);
  };
  if (tid == 0) {
    // The sources were written through the generic proxy (released to this op's acquire).
    asm volatile("fence.proxy.async.global;" ::: "memory");
    for (uint64_t c = 0; c < min(n, uint64_t(b.stages)); ++c) load(c);
  }
  for (uint64_t c = 0; c < n; ++c) {
    const int s = int(c % uint64_t(b.stages));
    device::mbarrier_wait_parity(&b.bars[s], (b.phases >> s) & 1u);
    b.phases ^= 1u << s;
    char* st = stage(c);
    const uint32_t words = len(c) / 16;
    for (uint32_t w = tid; w < words; w += kThreads) {
      float4 a = reinterpret_cast<const float4*>(st)[w];
      for (uint32_t k = 1; k < nsrc; ++k) {
        const float4 v = reinterpret_cast<const float4*>(st + k * cb)[w];
        a.x += v.x, a.y += v.y, a.z += v.z, a.w += v.w;
      }
      reinterpret_cast<float4*>(st)[w] = a;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the sums, to the bulk store
    device::named_barrier_sync(kThreads, kBarrier);
    if (tid == 0) {
      for (uint32_t d = 0; d < ndst; ++d)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     ::"l"(static_cast<char*>(ptr[nsrc + d]) + c * cb), "r"(device::smem_addr(st)), "r"(len(c))
                     : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // Refill the stage the previous chunk's stores read from, once they have read it (its
      // threads' reads ended before the barrier above).
      if (c >= 1 && c - 1 + b.stages < n) {
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        load(c - 1 + b.stages);
      }
    }
  }
  if (tid == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
}

// Whether op's reduce can go through bulk_reduce_f32: fp32 in and out, device memory, nothing
// zeroed, every pointer 16-byte aligned.
__device__ __forceinline__ bool bulk_reducible(const DevOp& op, void* const* ptr) {
  if (op.kind != kDevReduce || !op.dst_f32 || (op.flags & (kDevOpHostMem | kDevOpSrcBf16)) || op.zero_mask ||
      op.nsrc == 0 || op.nsrc > 4 || op.ndst == 0 || op.nsrc + op.ndst > uint32_t(kMaxOpBuffers) || (op.elems & 3u))
    return false;
  for (uint32_t k = 0; k < op.nsrc + op.ndst; ++k)
    if (reinterpret_cast<uintptr_t>(ptr[k]) & 15u) return false;
  return true;
}

// run_comm_op for a CTA with bulk stages: a one-source, one-destination copy goes through
// bulk_copy (thread 0), an fp32 reduce through bulk_reduce_f32 (every thread); every other op
// runs as in run_comm_op.
template <int kThreads, uint32_t kBarrier>
__device__ __noinline__ void run_comm_op_staged(const DeviceProgram& h, int index, int tid, uint64_t epoch,
                                                BulkStages& b) {
  const DevOp& op = h.ops[index];
  if (op.kind == kDevReduce) {
    void* ptr[kMaxOpBuffers];  // resolved as run_comm_op resolves them (op_ptr)
    const uint32_t np = min(op.nsrc + op.ndst, uint32_t(kMaxOpBuffers));
    for (uint32_t k = 0; k < np; ++k) ptr[k] = op_ptr(h, h.ptrs[op.ptr0 + k]);
    if (!bulk_reducible(op, ptr)) {
      run_comm_op<kThreads, kBarrier>(h, index, tid, epoch);
      return;
    }
    if (tid == 0) hook_waits(h, op.wait0, op.nwait, epoch);
    device::named_barrier_sync(kThreads, kBarrier);
    bulk_reduce_f32<kThreads, kBarrier>(b, ptr, op.nsrc, op.ndst, op.elems, tid);
    if (op.nsig) __threadfence_system();
    device::named_barrier_sync(kThreads, kBarrier);  // the stages are free for the next op
    if (op.nsig && tid == 0) hook_signals(h, op.sig0, op.nsig, epoch);
    return;
  }
  // Pinned host memory goes through plain loads and stores (the bulk-copy engine is kept to
  // device memory); so do copies with a run-time count.
  if (op.kind != kDevCopy || op.nsrc != 1 || op.ndst != 1 || (op.bytes & 15u) ||
      (op.flags & (kDevOpHostMem | kDevOpCountAt))) {
    run_comm_op<kThreads, kBarrier>(h, index, tid, epoch);
    return;
  }
  if (tid == 0) {
    hook_waits(h, op.wait0, op.nwait, epoch);
    // Sources and destinations are 16-byte aligned: the operators' rows are, and user buffers
    // are checked by can_implement.
    bulk_copy(b, op_ptr(h, h.ptrs[op.ptr0]), op_ptr(h, h.ptrs[op.ptr0 + 1]), op.bytes);
    if (op.nsig) {
      __threadfence_system();
      hook_signals(h, op.sig0, op.nsig, epoch);
    }
  } else {
    bulk_stages_advance(b, (op.bytes + b.stage_bytes - 1) / b.stage_bytes);
  }
  device::named_barrier_sync(kThreads, kBarrier);
}

// The program's ops in program order, by kThreads threads (tid 0 .. kThreads - 1, meeting on
// named barrier kBarrier) of a CTA that takes nothing else: thread 0 takes the next op index from
// h.op_counter, all of them run it (run(op)), until none is left. A runner kernel's whole loop
// and a dedicated communication CTA's (comm_role.cuh).
template <int kThreads, uint32_t kBarrier, class Run>
__device__ __forceinline__ void for_each_op_in_order(const DeviceProgram& h, int tid, Run&& run) {
  __shared__ int op_slot;
  for (;;) {
    if (tid == 0) op_slot = atomicAdd(h.op_counter, 1);
    device::named_barrier_sync(kThreads, kBarrier);
    const int op = op_slot;
    device::named_barrier_sync(kThreads, kBarrier);
    if (op >= h.n_ops) break;
    run(op);
  }
}

}  // namespace comm
}  // namespace mk
