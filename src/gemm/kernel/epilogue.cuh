// mkernel — the GEMM's epilogues, per tile, by the 256 consumer threads:
//   kStore  C = A·Bᵀ in bf16 through CUTLASS's TMA-store collective (C may be a peer's
//           symmetric-memory mapping); optionally followed by a per-tile flag.
//   kRoute  the fused RS/AR epilogue: the tile's fp32 values to the reducer of each row's shard
//           on this node (RouteEpilogue::route), reduce-added, or stored when deterministic. Two
//           paths: route_tile_bulk (default) stages 16x32 boxes per warp in shared memory and moves
//           them by TMA (a bulk reduce-add or store per box); route_tile sends each register
//           pair as its own system-scope `red` (or store). Followed by the tile row's hook
//           signals (comm_role.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "src/comm/device_program.h"
#include "src/comm/executor.cuh"
#include "src/gemm/route_epilogue.h"
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

// An accumulator column pair (columns n, n1 of one row) into an fp32 row N wide: one 8-byte
// store when the pair is adjacent, aligned and inside the row, else each column that is.
__device__ __forceinline__ void store_f32_pair(float* row, int n, int n1, int N, float x, float y) {
  if (n1 == n + 1 && (n & 1) == 0 && n1 < N) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(row + n), "f"(x), "f"(y) : "memory");
  } else {
    if (n < N) row[n] = x;
    if (n1 < N) row[n1] = y;
  }
}

// The first row of shard s and the shard of row m (0 <= m < M): a product and a division with
// even shards, the shards' first rows (a binary search) with uneven ones.
__device__ __forceinline__ int shard_start(const RouteEpilogue& h, int s) {
  return h.shard_rows > 0 ? s * static_cast<int>(h.shard_rows) : __ldg(h.shard_row0 + s);
}
__device__ __forceinline__ int shard_of_row(const RouteEpilogue& h, int m) {
  if (h.shard_rows > 0) return min(h.world - 1, m / static_cast<int>(h.shard_rows));
  int lo = 0, hi = h.world - 1;  // the last shard whose first row is <= m
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(h.shard_row0 + mid) <= m) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Routed fp32 epilogue: element (m, n) of shard s (the one holding row m) goes to
// route[s] + (m - shard_start(s)) * N + n, reduce-added (or stored when deterministic). The
// destinations are peers' accumulation buffers on this node. Rows and columns past (M, N) are
// skipped.
template <class Accum_>
__device__ __forceinline__ void route_tile(const RouteEpilogue& h, const ProblemShape& problem, const Accum_& accum,
                                           int mma_tid, int tile_m, int tile_n) {
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  const int M = get<0>(problem), N = get<1>(problem);
  Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(TileShape{}),
                             make_coord(tile_m, tile_n));
  Tensor tc = thr_mma.partition_C(coords);  // same layout as the accumulators
  static_assert(decltype(size(accum))::value % 2 == 0, "accumulators come in column pairs");
  // The tile's rows span shards [s_first, ...]: the common case is one shard, so the shard of a
  // row is found by stepping from the first one rather than by a search per element.
  const int m_first = tile_m * int(size<0>(TileShape{}));
  const int s_first = shard_of_row(h, m_first);
  const int s_next = s_first + 1 < h.world ? shard_start(h, s_first + 1) : M;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(accum); i += 2) {
    const int m = get<0>(tc(i)), n = get<1>(tc(i)), n1 = get<1>(tc(i + 1));
    if (m >= M) continue;
    int s = s_first;
    if (m >= s_next) {
      ++s;
      while (s + 1 < h.world && m >= shard_start(h, s + 1)) ++s;
    }
    const int r = m - shard_start(h, s);
    float* row = h.route[s] + int64_t(r) * N;
    if (h.route_store) {
      store_f32_pair(row, n, n1, N, accum(i), accum(i + 1));
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

// Split-K: the tile's fp32 partial products, row-major N wide, stored as they are (column
// pairs as 8-byte stores); rows and columns past (M, N) are skipped.
template <class Accum_>
__device__ __forceinline__ void store_partial(float* out, const ProblemShape& problem, const Accum_& accum,
                                              int mma_tid, int tile_m, int tile_n) {
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  const int M = get<0>(problem), N = get<1>(problem);
  Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(TileShape{}),
                             make_coord(tile_m, tile_n));
  Tensor tc = thr_mma.partition_C(coords);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(accum); i += 2) {
    const int m = get<0>(tc(i)), n = get<1>(tc(i)), n1 = get<1>(tc(i + 1));
    if (m >= M) continue;
    store_f32_pair(out + int64_t(m) * N, n, n1, N, accum(i), accum(i + 1));
  }
}

// ---- The bulk route: per consumer warp (16 rows of the tile), 8 boxes of 16 x 32 fp32, each
// written from the registers into one of two 2 KiB shared-memory buffers (128-byte swizzle:
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8), so a warp's stores hit every bank
// once), then sent by lane 0 as one TMA op per shard the rows touch; the tensor map of shard s
// clips the rows outside it and the columns past N.
constexpr int kRouteBoxRows = 16, kRouteBoxCols = 32;
constexpr int kRouteBoxBytes = kRouteBoxRows * kRouteBoxCols * 4;
constexpr int kRouteWarps = kMmaThreads / 32;
constexpr int kRouteStageBytes = kRouteWarps * 2 * kRouteBoxBytes;  // 32 KiB
static_assert(size<0>(TileShape{}) == kRouteWarps * kRouteBoxRows, "a warp's rows make one box");
static_assert(size<1>(TileShape{}) == 8 * kRouteBoxCols, "8 boxes span the tile's columns");

__device__ __forceinline__ void tma_box_out(const void* map, uint32_t smem, int col, int row, bool store) {
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  if (store)
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(m), "r"(smem), "r"(col), "r"(row) : "memory");
  else
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(m), "r"(smem), "r"(col), "r"(row) : "memory");
}

// The accumulators are the SM90 64xNx16 WGMMA C layout: element i of a thread is row
// lane / 4 + 8 * ((i / 2) % 2) of its warp's 16, column (lane % 4) * 2 + i % 2 + 8 * (i / 4). Box
// k (columns [32k, 32k + 32)) is elements [16k, 16k + 16). The writes are in flight on return:
// route_bulk_complete() before the tile's signals and before the buffers are written again.
template <class Accum_>
__device__ __forceinline__ void route_tile_bulk(const RouteEpilogue& h, const ProblemShape& problem,
                                                const Accum_& accum, int mma_tid, int tile_m, int tile_n,
                                                char* stage) {
  static_assert(decltype(size(accum))::value == 8 * 16, "128 accumulators per thread (two warpgroups, 128x256)");
  const int M = get<0>(problem), N = get<1>(problem);
  const int warp = mma_tid / 32, lane = mma_tid % 32;
  const int m0 = tile_m * int(size<0>(TileShape{})) + warp * kRouteBoxRows;
  if (m0 >= M) return;
  const int n0 = tile_n * int(size<1>(TileShape{}));
  const int s_first = shard_of_row(h, m0), s_last = shard_of_row(h, min(m0 + kRouteBoxRows, M) - 1);
  const int box_row = m0 - shard_start(h, s_first);  // the warp's first row in shard s_first's map
  if (s_first != s_last) {
    // A shard starts inside the warp's rows: a box would need a negative row in the next
    // shard's map. These (rare: shards not a multiple of 16 rows) go element by element.
    route_tile(h, problem, accum, mma_tid, tile_m, tile_n);
    return;
  }
  const int boxes = min(8, (N - n0 + kRouteBoxCols - 1) / kRouteBoxCols);
  const uint32_t sbase = cute::cast_smem_ptr_to_uint(stage + warp * 2 * kRouteBoxBytes);
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
  const bool store = h.route_store != 0;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 8; ++k) {
    if (k < boxes) {
      const uint32_t sb = sbase + (k & 1) * kRouteBoxBytes;
      if (k >= 2) {
        // The box sent from this buffer two steps ago has been read.
        if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        __syncwarp();
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int i = 16 * k + 4 * j + 2 * half;
          const int r = r0 + 8 * half, c = 8 * j + c0;
          const uint32_t off = uint32_t(r * 128 + ((((c >> 2) ^ (r & 7))) << 4) + (c & 3) * 4);
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(sb + off), "f"(accum(i)), "f"(accum(i + 1))
                       : "memory");
        }
      }
      // The generic-proxy stores before the async proxy's reads.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
      if (lane == 0) {
        tma_box_out(static_cast<const char*>(h.route_maps) + size_t(s_first) * 128, sb, n0 + k * kRouteBoxCols,
                    box_row, store);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    }
  }
}

// After route_tile_bulk, before the tile's signals (it may be deferred past the next tile's MMA,
// hiding the writes' latency): the warp's TMA writes are complete and ordered before the
// signals' system-scope release (store_signals).
__device__ __forceinline__ void route_bulk_complete(int mma_tid) {
  if (mma_tid % 32 == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  __syncwarp();
}

// Whether tile row tile_m ends in this rank's epilogue (RouteEpilogue::fin_lo/hi: whole tile-rows).
__device__ __forceinline__ bool final_tile_row(const RouteEpilogue& h, int tile_m) {
  const int64_t r0 = int64_t(tile_m) * int64_t(size<0>(TileShape{}));
  return r0 >= h.fin_lo && r0 < h.fin_hi;
}

// The owner's final sum of one of its own tiles (RouteEpilogue::fin_*), per thread: its two rows,
// 8-column groups in batches of kFinBatch so that the loads of a term are in flight together (the
// sum is bound by their latency: 32 / kFinBatch round trips per row and term). The tile-row's
// store waits (every other rank's share arrived) came first.
constexpr int kFinBatch = 16;
template <class Accum_>
__device__ __forceinline__ void final_tile(const comm::DeviceProgram& prog, const RouteEpilogue& h, const ProblemShape& problem, Accum_& accum,
                                           int mma_tid, int tile_m, int tile_n) {
  const int M = get<0>(problem), N = get<1>(problem);
  const int lane = mma_tid % 32;
  const int m_warp = tile_m * int(size<0>(TileShape{})) + (mma_tid / 32) * kRouteBoxRows;
  const int n0 = tile_n * int(size<1>(TileShape{})) + (lane % 4) * 2;
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int m = m_warp + lane / 4 + 8 * half;
    if (m >= M || m >= h.fin_hi) continue;
    const int64_t row = (int64_t(m) - h.fin_row0) * N;
    CUTLASS_PRAGMA_UNROLL
    for (int gb = 0; gb < 32; gb += kFinBatch) {
      float2 a[kFinBatch];
      int k = 0;
      for (int t = 0; t <= h.fin_nsrc; ++t) {
        float2 x[kFinBatch];
        if (t == h.fin_self) {
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kFinBatch; ++g) {
            const int i = 4 * (gb + g) + 2 * half;
            x[g] = make_float2(accum(i), accum(i + 1));
          }
        } else {
          const float* src = h.fin_srcs[k++] + row;
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kFinBatch; ++g) {
            const int n = n0 + 8 * (gb + g);
            x[g] = n < N ? *reinterpret_cast<const float2*>(src + n) : make_float2(0.f, 0.f);
          }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < kFinBatch; ++g) {
          if (t == 0) a[g] = x[g];
          else a[g] = make_float2(a[g].x + x[g].x, a[g].y + x[g].y);
        }
      }
      if (h.fin_zero)
        for (int s = 0; s < h.fin_nsrc; ++s) {
          float* src = const_cast<float*>(h.fin_srcs[s]) + row;
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kFinBatch; ++g) {
            const int n = n0 + 8 * (gb + g);
            if (n < N) *reinterpret_cast<float2*>(src + n) = make_float2(0.f, 0.f);
          }
        }
      __nv_bfloat162 b[kFinBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kFinBatch; ++g) b[g] = __floats2bfloat162_rn(a[g].x, a[g].y);
      for (int d = 0; d < h.fin_ndst; ++d) {
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(comm::op_ptr(prog, h.fin_dsts[d])) + row / 2;
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < kFinBatch; ++g) {
          const int n = n0 + 8 * (gb + g);
          if (n < N) dst[n / 2] = b[g];
        }
      }
    }
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace mk
