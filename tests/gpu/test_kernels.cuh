// Kernels shared by the GPU tests: rank-tagged fills and checks, flag exchanges.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mkernel/device/epoch.cuh"
#include "mkernel/device/signal.cuh"
#include "mkernel/device/views.h"

namespace mk {
namespace test {

// A word that names its seed, source rank, destination rank, round and index: a wrong source,
// a stale round or a misplaced word all show.
__host__ __device__ inline uint32_t tag_word(uint64_t seed, int src, int dst, uint64_t round, uint64_t i) {
  uint64_t x = seed ^ (uint64_t(src + 1) << 56) ^ (uint64_t(dst + 1) << 48) ^ (round << 32) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x) | 1u;  // never zero
}

__global__ void fill_u32(uint32_t* p, uint64_t n, uint32_t v) {
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) p[i] = v;
}

__global__ void fill_tagged(uint32_t* p, uint64_t n, uint64_t seed, int src, int dst, uint64_t round) {
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = tag_word(seed, src, dst, round, i);
}

// Counts words of p that differ from tag(seed, src, dst, round, i).
__global__ void count_bad(const uint32_t* p, uint64_t n, uint64_t seed, int src, int dst,
                          uint64_t round, unsigned long long* bad) {
  unsigned long long b = 0;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    b += p[i] != tag_word(seed, src, dst, round, i);
  if (b) atomicAdd(bad, b);
}

// Ping-pong between `rank` and `partner`: `rounds` round trips. The initiator (lower rank)
// writes `words` tagged words into the partner's data buffer and raises its flag 0 to the
// round; the partner waits, checks every word, and answers the same way. Counts bad words.
__global__ void ping_pong(SymmetricView data, SignalView flags, WaitCtx ctx, int partner,
                          int rounds, uint32_t words, uint64_t seed, unsigned long long* bad) {
  const int me = data.rank;
  uint32_t* mine = static_cast<uint32_t*>(data.local);
  uint32_t* theirs = static_cast<uint32_t*>(data.peers[partner]);
  const bool initiator = me < partner;
  unsigned long long b = 0;
  for (int r = 1; r <= rounds; ++r) {
    if (initiator) {
      for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) theirs[i] = tag_word(seed, me, partner, r, i);
      __syncthreads();
      if (threadIdx.x == 0) device::signal_set(&flags.peers[partner][0], r);
      if (threadIdx.x == 0) device::wait_ge(ctx, &flags.local[0], r, partner, 0);
      __syncthreads();
      for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) b += mine[i] != tag_word(seed, partner, me, r, i);
    } else {
      if (threadIdx.x == 0) device::wait_ge(ctx, &flags.local[0], r, partner, 0);
      __syncthreads();
      for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) b += mine[i] != tag_word(seed, partner, me, r, i);
      for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) theirs[i] = tag_word(seed, me, partner, r, i);
      __syncthreads();
      if (threadIdx.x == 0) device::signal_set(&flags.peers[partner][0], r);
    }
  }
  if (b) atomicAdd(bad, b);
}

// All-to-all with acknowledgements, one CTA per peer. Call #e (e = the epoch of the call):
// CTA p waits until peer p acknowledged call e-1 (so its slot may be overwritten), writes
// `words` tagged words into slot[me] of peer p's data, raises p's data flag[me] to e
// (signal_set), waits for its own data flag[p] >= e, checks slot[p] for every word, then adds
// 1 to p's ack flag[me] (signal_add: after e calls it reads e). Flags: [0, W) data, [W, 2W)
// acks; data holds W slots of `words` words. With self_advance the kernel advances the epoch
// itself (epoch_finish by every CTA), else the caller launches launch_epoch_advance after it.
__global__ void all_to_all(SymmetricView data, SignalView flags, WaitCtx ctx, EpochState* epoch,
                           uint32_t words, uint64_t seed, unsigned long long* bad, bool self_advance) {
  const int me = data.rank, W = data.world, p = blockIdx.x;
  const uint64_t e = device::epoch_of_call(epoch);
  if (p < W && data.peers[p] != nullptr) {
    uint32_t* dst = static_cast<uint32_t*>(data.peers[p]) + uint64_t(me) * words;
    const uint32_t* src = static_cast<const uint32_t*>(data.local) + uint64_t(p) * words;
    if (threadIdx.x == 0 && e > 1) device::wait_ge(ctx, &flags.local[W + p], e - 1, p, W + p);
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = tag_word(seed, me, p, e, i);
    __syncthreads();
    if (threadIdx.x == 0) {
      device::signal_set(&flags.peers[p][me], e);
      device::wait_ge(ctx, &flags.local[p], e, p, p);
    }
    __syncthreads();
    unsigned long long b = 0;
    for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) b += src[i] != tag_word(seed, p, me, e, i);
    if (b) atomicAdd(bad, b);
    __syncthreads();
    if (threadIdx.x == 0) device::signal_add(&flags.peers[p][W + me], 1);
  }
  if (self_advance) device::epoch_finish(epoch, gridDim.x);
}

// C[M, N] (fp32, row stride N, possibly a peer's buffer) += A[M, K] · B[N, K]ᵀ (bf16), one
// 128 x 256 tile t = n * tiles_m + m per CTA iteration. Every thread reduce-adds its elements at
// system scope (atomic across GPUs adding into one owner), then fences at system scope; the CTA
// meets and one thread adds 1 to flags[t] with release semantics (a counted arrival). The
// fused operators' routed epilogue publishes its partial sums the same way.
__global__ void reduce_add_tiles(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C, int64_t M, int64_t N,
                                 int64_t K, uint64_t* flags) {
  const int tiles_m = int((M + 127) / 128), tiles = tiles_m * int((N + 255) / 256);
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t m0 = int64_t(t % tiles_m) * 128, n0 = int64_t(t / tiles_m) * 256;
    for (int i = threadIdx.x; i < 128 * 256; i += blockDim.x) {
      const int64_t m = m0 + i / 256, n = n0 + i % 256;
      if (m >= M || n >= N) continue;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += __bfloat162float(A[m * K + k]) * __bfloat162float(B[n * K + k]);
      asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(C + m * N + n), "f"(acc) : "memory");
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) device::signal_add(flags + t, 1);
  }
}

// Waits for a flag nobody raises: the planted missing signal.
__global__ void wait_forever(SignalView flags, WaitCtx ctx, int peer, int flag, uint64_t expected) {
  device::wait_ge(ctx, &flags.local[flag], expected, peer, flag);
}

}  // namespace test
}  // namespace mk
