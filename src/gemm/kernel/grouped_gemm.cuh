// mkernel — the persistent sm_90a grouped GEMM kernel (include/mkernel/gemm/grouped.h).
//
// The plain GEMM's CTA (one TMA producer warp, two WGMMA consumer warpgroups, 128 x 256 x 64
// tiles, the same shared-memory stage ring and the same CUTLASS MMA), with its own loads and
// epilogue:
//   - loads: raw TMA from tensor maps built on the host — A as one [rows, K] matrix whose tile
//     row starts at the group's first row plus 128 per tile row (any row, not only multiples
//     of 128), B as [groups, N, K] indexed by the group (kSwiGLU: as [groups, 2, I, K], so one
//     box brings 128 gate rows and the 128 matching up rows: the tile's accumulator columns j
//     and j + 128 are gate and up of output column j);
//   - schedule: every CTA first reads the groups' counts (device memory) and scans them in
//     shared memory into tile prefixes; work item i is then (group, tile) by a binary search,
//     CTA b taking items b, b + grid, ... — producer and consumers walk the same items;
//   - epilogue: per consumer warp, 64 columns at a time through a shared-memory buffer, then
//     16-byte row pieces to C (grouped_store_staged, the default); or bf16 column pairs straight
//     from the accumulators (grouped_store). Rows past the group's count and columns past N are
//     skipped, so neighbouring groups are never overwritten.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "src/gemm/kernel/config.cuh"
#include "src/gemm/kernel/mainloop.cuh"

namespace mk {
namespace gemm {
namespace sm90 {

constexpr int kGroupedMaxGroups = 1024;
constexpr int kTileM = 128, kTileN = 256, kTileK = 64;

struct GroupedParams {
  CUtensorMap map_a;  // 2D {K, rows}, box {64, 128}
  CUtensorMap map_b;  // kStore: 3D {K, N, groups}, box {64, 256, 1}; kSwiGLU: 4D {K, I, 2, groups}, box {64, 128, 2, 1}
  MainloopParams mainloop;
  const int32_t* counts;
  const int32_t* offsets;  // null: packed
  int32_t* error;
  __nv_bfloat16* C;
  int64_t ldc;
  int groups, rows, n_out, k_tiles, tiles_n;
  int swiglu;
  int staged;  // epilogue through shared memory (grouped_store_staged) instead of register stores
};

// The staged epilogue's per-warp buffer: 16 rows x 64 columns of bf16, rows padded by 16 bytes
// so a warp's register writes (8 rows x 4 lanes) hit 32 distinct banks.
constexpr int kStageCols = 64, kStageRowBytes = kStageCols * 2 + 16, kStageWarpBytes = 16 * kStageRowBytes;

struct GroupedSmem {
  alignas(1024) MainloopStorage tensors;
  alignas(16) typename MainloopCollective::PipelineStorage pipe;
  int tile_prefix[kGroupedMaxGroups + 1];  // tiles of groups before g; [groups]: all tiles
  int first_row[kGroupedMaxGroups];        // group g's first row
  int count[kGroupedMaxGroups];            // group g's rows (0 when its range is bad)
  alignas(16) char stage[kMmaThreads / 32][kStageWarpBytes];  // the staged epilogue's buffers
};

// One TMA box into shared memory, completing on the stage's barrier.
__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, uint32_t smem, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load_3d(const CUtensorMap* map, uint32_t smem, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(smem), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void tma_load_4d(const CUtensorMap* map, uint32_t smem, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(smem), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

struct GroupedTile {
  int group, tm, tn;
};

// Work item -> (group, tile row, tile column): the group whose prefix range holds the item
// (binary search), then tile rows fastest (consecutive items share B's tile).
__device__ __forceinline__ GroupedTile grouped_tile_of(const GroupedSmem& s, int groups, int tiles_n, int item) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s.tile_prefix[mid] <= item) lo = mid;
    else hi = mid - 1;
  }
  const int local = item - s.tile_prefix[lo];
  const int tiles_m = (s.count[lo] + kTileM - 1) / kTileM;
  (void)tiles_n;
  return GroupedTile{lo, local % tiles_m, local / tiles_m};
}

// All threads: counts -> shared counts, first rows and tile prefixes. Bad ranges are recorded
// and left out.
__device__ __forceinline__ void grouped_prologue(const GroupedParams& p, GroupedSmem& s) {
  const int tid = threadIdx.x;
  for (int g = tid; g < p.groups; g += blockDim.x) {
    int c = p.counts[g];
    const int off = p.offsets ? p.offsets[g] : 0;
    s.count[g] = c;
    s.first_row[g] = off;
  }
  __syncthreads();
  if (tid < 32) {
    // Packed offsets: first_row is the running sum of counts (bad counts included as 0).
    // Then tile prefixes. Both as warp scans, 32 groups at a time.
    int row_base = 0, tile_base = 0;
    for (int g0 = 0; g0 < p.groups; g0 += 32) {
      const int g = g0 + tid;
      int c = g < p.groups ? s.count[g] : 0;
      if (c < 0) c = -1;  // bad; resolved below
      int rows_in = c > 0 ? c : 0;
      int incl = rows_in;
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (tid >= d) incl += v;
      }
      if (g < p.groups) {
        const int off = p.offsets ? s.first_row[g] : row_base + incl - rows_in;
        const bool bad = c < 0 || off < 0 || int64_t(off) + (c > 0 ? c : 0) > int64_t(p.rows);
        if (bad && p.error && blockIdx.x == 0) atomicCAS(p.error, 0, g + 1);
        s.first_row[g] = off;
        s.count[g] = bad ? 0 : c;
      }
      row_base += __shfl_sync(0xffffffffu, incl, 31);
      const int cg = g < p.groups ? s.count[g] : 0;
      const int tiles = (cg + kTileM - 1) / kTileM * p.tiles_n;
      int tincl = tiles;
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, tincl, d);
        if (tid >= d) tincl += v;
      }
      if (g < p.groups) s.tile_prefix[g] = tile_base + tincl - tiles;
      tile_base += __shfl_sync(0xffffffffu, tincl, 31);
    }
    if (tid == 0) s.tile_prefix[p.groups] = tile_base;
  }
  __syncthreads();
}

// Consumers: the tile's accumulators to C, bf16 column pairs. Element i of a thread is row
// lane / 4 + 8 * ((i / 2) % 2) of its warp's rows and column (lane % 4) * 2 + i % 2 + 8 * (i / 4)
// (the SM90 WGMMA C layout). kStore: element (r, n) of the tile goes to row first_row + tm * 128
// + r, column tn * 256 + n; kSwiGLU: columns j < 128 and j + 128 of the tile (elements i and
// i + 64) are gate and up of output column tn * 128 + j. Rows past the group's count and columns
// past N are skipped. (Measured on an H200: 16-byte stores after a transpose inside each quad
// of lanes made the down projections 5-15% slower than these 4-byte stores; the staged
// epilogue below made them 1.05-1.3x faster.)
template <class Accum_>
__device__ __forceinline__ void grouped_store(const GroupedParams& p, const Accum_& accum, int mma_tid, int first_row,
                                              int count, int tm, int tn) {
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  Tensor coords = make_identity_tensor(take<0, 2>(TileShape{}));  // (r, n) inside the tile
  Tensor tc = thr_mma.partition_C(coords);
  static_assert(decltype(size(accum))::value == 128, "a thread holds 128 accumulators of the 128 x 256 tile");
  const int rows_left = count - tm * kTileM;
  if (!p.swiglu) {
    const int col0 = tn * kTileN;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      const int r = get<0>(tc(i)), n = col0 + get<1>(tc(i));
      if (r >= rows_left || n >= p.n_out) continue;  // n even, n_out % 8 == 0: n + 1 is inside too
      __nv_bfloat16* dst = p.C + int64_t(first_row + tm * kTileM + r) * p.ldc + n;
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(accum(i), accum(i + 1));
    }
  } else {
    const int col0 = tn * (kTileN / 2);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum) / 2; i += 2) {
      const int r = get<0>(tc(i)), n = col0 + get<1>(tc(i));
      if (r >= rows_left || n >= p.n_out) continue;
      const float g0 = accum(i), g1 = accum(i + 1), u0 = accum(i + 64), u1 = accum(i + 65);
      const float h0 = g0 / (1.0f + __expf(-g0)) * u0, h1 = g1 / (1.0f + __expf(-g1)) * u1;
      __nv_bfloat16* dst = p.C + int64_t(first_row + tm * kTileM + r) * p.ldc + n;
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(h0, h1);
    }
  }
}

// The staged epilogue: per consumer warp (16 rows of the tile), 64 output columns at a time —
// bf16 pairs from the registers into the warp's shared buffer, then 16-byte rows back out to C,
// each row's 128 bytes written by 8 consecutive lanes (full 32-byte sectors), rows past the
// group's count skipped. Same values as grouped_store. `also(row)` (row: C's row) names a second
// place for a row (its output element n goes to also(row) + n), or null: none (the fused MoE
// layer's rows bound for another rank's combine slot).
struct NoSecondRow {
  __device__ __forceinline__ __nv_bfloat16* operator()(int) const { return nullptr; }
};
template <class Accum_, class Also_ = NoSecondRow>
__device__ __forceinline__ void grouped_store_staged(const GroupedParams& p, const Accum_& accum, int mma_tid,
                                                     int first_row, int count, int tm, int tn, char* stage,
                                                     const Also_& also = Also_{}) {
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  Tensor coords = make_identity_tensor(take<0, 2>(TileShape{}));
  Tensor tc = thr_mma.partition_C(coords);
  const int lane = mma_tid & 31;
  const int rows_left = count - tm * kTileM;
  const int warp_row0 = get<0>(tc(0)) & ~15;  // the warp's 16 rows start on a multiple of 16
  const int out_cols = p.swiglu ? kTileN / 2 : kTileN;
  const int col0 = tn * out_cols;
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
  CUTLASS_PRAGMA_UNROLL
  for (int pass = 0; pass < kTileN / kStageCols; ++pass) {
    if (pass * kStageCols >= out_cols) break;
    // Registers -> shared: element pairs whose output column lies in this pass's 64.
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      // Element i's column is 8 * (i / 4) + 2 * (lane % 4) (+1): its pass is i / 32, known at
      // compile time; SwiGLU's outputs are the elements i < 64 (their up values at i + 64).
      if ((i / 4) / 8 != pass || (p.swiglu && i >= 64)) continue;
      const int n = get<1>(tc(i));
      const int lr = get<0>(tc(i)) & 15;
      float x = accum(i), y = accum(i + 1);
      if (p.swiglu) {
        const float u0 = accum(i + 64), u1 = accum(i + 65);
        x = x / (1.0f + __expf(-x)) * u0;
        y = y / (1.0f + __expf(-y)) * u1;
      }
      const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(sbase + lr * kStageRowBytes + (n - pass * kStageCols) * 2),
                   "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
    }
    __syncwarp();
    // Shared -> C: 16 rows x 8 chunks of 16 bytes, 4 per lane.
    CUTLASS_PRAGMA_UNROLL
    for (int it = 0; it < 4; ++it) {
      const int c = lane + 32 * it, lr = c / 8, ch = c % 8;
      const int r = warp_row0 + lr, n = col0 + pass * kStageCols + ch * 8;
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(sbase + lr * kStageRowBytes + ch * 16));
      if (r < rows_left && n < p.n_out) {
        const int row = first_row + tm * kTileM + r;
        *reinterpret_cast<uint4*>(p.C + int64_t(row) * p.ldc + n) = v;
        if (__nv_bfloat16* o = also(row)) *reinterpret_cast<uint4*>(o + n) = v;
      }
    }
    __syncwarp();
  }
}

// The kernel itself is defined once (sm90_grouped_bf16.cu); other kernels built from the parts
// above (the fused MoE layer) include this header with MK_GROUPED_PARTS_ONLY defined.
#ifndef MK_GROUPED_PARTS_ONLY
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm(__grid_constant__ const GroupedParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  GroupedSmem& smem = *reinterpret_cast<GroupedSmem*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  const int mma_tid = int(threadIdx.x) % kMmaThreads;
  if (threadIdx.x == 0) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.map_a)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.map_b)) : "memory");
  }
  typename MainloopPipeline::Params mp;
  if (wg == 0 && warp_in_wg == 0) mp.role = MainloopPipeline::ThreadCategory::Producer;
  if (wg >= 1) mp.role = MainloopPipeline::ThreadCategory::Consumer;
  mp.is_leader = (threadIdx.x % cutlass::NumThreadsPerWarpGroup) == 0;
  mp.num_consumers = kMmaThreads;
  mp.num_producers = 1;
  mp.transaction_bytes = p.mainloop.tma_transaction_bytes;
  MainloopPipeline pipeline(smem.pipe, mp, ClusterShape{});
  grouped_prologue(p, smem);  // ends with __syncthreads: the pipeline's barriers are visible too
  const int total = smem.tile_prefix[p.groups];

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0) {
      MainloopState state = cutlass::make_producer_start_state<MainloopPipeline>();
      if (cute::elect_one_sync()) {
        const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem.tensors.smem_A.data()));
        const uint32_t sb = static_cast<uint32_t>(__cvta_generic_to_shared(smem.tensors.smem_B.data()));
        constexpr uint32_t kStageA = kTileM * kTileK * 2, kStageB = kTileN * kTileK * 2;
        for (int item = blockIdx.x; item < total; item += gridDim.x) {
          const GroupedTile t = grouped_tile_of(smem, p.groups, p.tiles_n, item);
          const int row0 = smem.first_row[t.group] + t.tm * kTileM;
          for (int kt = 0; kt < p.k_tiles; ++kt) {
            pipeline.producer_acquire(state);
            const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(pipeline.producer_get_barrier(state)));
            const int stage = state.index();
            tma_load_2d(&p.map_a, sa + stage * kStageA, bar, kt * kTileK, row0);
            if (p.swiglu) tma_load_4d(&p.map_b, sb + stage * kStageB, bar, kt * kTileK, t.tn * (kTileN / 2), 0, t.group);
            else tma_load_3d(&p.map_b, sb + stage * kStageB, bar, kt * kTileK, t.tn * kTileN, t.group);
            ++state;
          }
        }
        // Keep the CTA alive until the consumers released every stage.
        pipeline.producer_tail(state);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    MainloopCollective mainloop;
    TiledMma tiled_mma;
    MainloopState read;
    for (int item = blockIdx.x; item < total; item += gridDim.x) {
      const GroupedTile t = grouped_tile_of(smem, p.groups, p.tiles_n, item);
      auto accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      mma_tile(mainloop, p.mainloop, pipeline, read, accum, p.k_tiles, mma_tid, smem.tensors);
      if (p.staged)
        grouped_store_staged(p, accum, mma_tid, smem.first_row[t.group], smem.count[t.group], t.tm, t.tn,
                             smem.stage[mma_tid / 32]);
      else
        grouped_store(p, accum, mma_tid, smem.first_row[t.group], smem.count[t.group], t.tm, t.tn);
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: fail loudly instead of computing nothing
#endif
}
#endif  // MK_GROUPED_PARTS_ONLY

}  // namespace sm90
}  // namespace gemm
}  // namespace mk
