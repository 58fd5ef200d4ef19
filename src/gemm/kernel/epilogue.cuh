// mkernel — the GEMM's epilogues, per tile, by the 256 consumer threads:
//   kStore  C = A·Bᵀ in bf16 through CUTLASS's TMA-store collective (C may be a peer's
//           symmetric-memory mapping); optionally followed by a per-tile flag.
//   kRoute  the fused RS/AR epilogue: fp32 values straight from the accumulator registers to
//           the reducer of each row's shard on this node (hooks.route), reduce-added, or stored
//           when deterministic. Followed by the tile row's hook signals (comm_role.cuh).
#pragma once

#include <cstdint>

#include "src/comm/device_program.h"
#include "src/gemm/kernel/config.cuh"

namespace mk {
namespace gemm {
namespace sm90 {

enum class EpiKind : int { kStore = 0, kRoute = 1 };

using EpiLoadState = typename EpilogueCollective::LoadPipelineState;
using EpiStoreState = typename EpilogueCollective::StorePipelineState;
using EpilogueStorage = typename EpilogueCollective::TensorStorage;

// The per-tile signal after a stored tile (Arguments::tile_flags).
struct TileSignal {
  uint64_t* flags;   // [tiles] or null
  uint64_t value;
  int add;           // add value instead of setting it
};

// One tile through the TMA-store collective. @post the load/store states are advanced.
template <class Accum_>
__device__ __forceinline__ void store_tile(EpilogueCollective& epilogue, EpiLoadPipeline& load_pipeline,
                                           EpiLoadState& load_read, EpiStorePipeline& store_pipeline,
                                           EpiStoreState& store_write, const ProblemShape& problem, int tile_m,
                                           int tile_n, Accum_& accum, int mma_tid, EpilogueStorage& smem) {
  TiledMma tiled_mma;
  auto [load_next, store_next] =
      epilogue.store(load_pipeline, load_read, store_pipeline, store_write, problem, TileShape{},
                     make_coord(tile_m, tile_n, _, 0), accum, tiled_mma, mma_tid, smem);
  load_read = load_next;
  store_write = store_next;
}

__device__ __forceinline__ void publish_flag(const TileSignal& s, int t) {
  if (s.add)
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(s.flags + t), "l"(s.value) : "memory");
  else
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(s.flags + t), "l"(s.value) : "memory");
}

// Per-tile signal after TMA stores: the warp that issued them (consumer warp 0; bulk-copy
// groups belong to the issuing thread) waits until the stores are complete in global memory,
// not only until shared memory was read, orders the async proxy's writes before its own, then
// one lane publishes the flag with release semantics at system scope.
__device__ __forceinline__ void signal_tile_after_tma(const TileSignal& s, int mma_tid, int t) {
  if (mma_tid >= 32) return;
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __syncwarp();
  if (mma_tid == 0) publish_flag(s, t);
}

// Routed fp32 epilogue: element (m, n) of shard s = m / shard_rows goes to
// route[s] + (m - s * shard_rows) * N + n, reduce-added (or stored when deterministic). The
// destinations are peers' accumulation buffers on this node. Rows and columns past (M, N) are
// skipped.
template <class Accum_>
__device__ __forceinline__ void route_tile(const ops::FusedHooks& h, const ProblemShape& problem, const Accum_& accum,
                                           int mma_tid, int tile_m, int tile_n) {
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  const int M = get<0>(problem), N = get<1>(problem);
  Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(TileShape{}),
                             make_coord(tile_m, tile_n));
  Tensor tc = thr_mma.partition_C(coords);  // same layout as the accumulators
  static_assert(decltype(size(accum))::value % 2 == 0, "accumulators come in column pairs");
  const int ms = static_cast<int>(h.shard_rows);
  // The tile's rows span shards [s_first, ...]: the common case is one shard, so the shard of a
  // row is found by stepping from the first one rather than by a division per element.
  const int m_first = tile_m * int(size<0>(TileShape{}));
  const int s_first = m_first / ms;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(accum); i += 2) {
    const int m = get<0>(tc(i)), n = get<1>(tc(i)), n1 = get<1>(tc(i + 1));
    if (m >= M) continue;
    int s = s_first, r = m - s_first * ms;
    while (r >= ms) {
      r -= ms;
      ++s;
    }
    float* row = h.route[s] + int64_t(r) * N;
    if (h.route_store) {
      if (n1 == n + 1 && (n & 1) == 0 && n1 < N) {
        asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(row + n), "f"(accum(i)), "f"(accum(i + 1)) : "memory");
      } else {
        if (n < N) row[n] = accum(i);
        if (n1 < N) row[n1] = accum(i + 1);
      }
    } else {
      if (n1 == n + 1 && (n & 1) == 0 && n1 < N) {
        // One 8-byte vector reduction for the column pair (sm_90).
        asm volatile("red.relaxed.sys.global.add.v2.f32 [%0], {%1, %2};" ::"l"(row + n), "f"(accum(i)),
                     "f"(accum(i + 1)) : "memory");
      } else {
        if (n < N) asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(row + n), "f"(accum(i)) : "memory");
        if (n1 < N) asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(row + n1), "f"(accum(i + 1)) : "memory");
      }
    }
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace mk
