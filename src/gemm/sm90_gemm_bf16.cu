// The persistent sm_90a bf16 GEMM: CUTLASS 4.2 collectives (TMA producer, WGMMA consumers,
// TMA-store epilogue) driven by mkernel's own kernel body and tile loop.
#include "mkernel/gemm/gemm.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "mkernel/device/trace.cuh"
#include "src/comm/device_program.h"
#include "src/gemm/fused_launch.h"

#if MK_WITH_CUTLASS
#include "cute/tensor.hpp"
#include "mkernel/device/command_ring.cuh"
#include "mkernel/device/epoch.cuh"
#include "mkernel/device/signal.cuh"
#include "src/comm/executor.cuh"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "cutlass/util/packed_stride.hpp"
#include <cuda_bf16.h>
#endif

namespace mk {
namespace gemm {

#if MK_WITH_CUTLASS
namespace sm90 {
using namespace cute;

using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _256, _64>;   // (BLK_M, BLK_N, BLK_K)
using ClusterShape = Shape<_1, _1, _1>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, 8,          // no C source
    Element, cutlass::layout::RowMajor, 8,       // D: bf16 row-major
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

// B is [N, K] row-major, i.e. K-contiguous: CUTLASS calls that a column-major B.
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, cutlass::layout::RowMajor, 8,
    Element, cutlass::layout::ColumnMajor, 8,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using TiledMma = typename CollectiveMainloop::TiledMma;
using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
using StrideA = typename CollectiveMainloop::StrideA;
using StrideB = typename CollectiveMainloop::StrideB;
using StrideC = typename CollectiveEpilogue::StrideC;
using StrideD = typename CollectiveEpilogue::StrideD;
using ProblemShape = Shape<int, int, int, int>;  // (M, N, K, L)

constexpr int kThreads = 384;     // producer warpgroup + two consumer warpgroups
constexpr int kMmaThreads = 256;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;  // 40 * 128 + 232 * 256 <= 64K registers
static_assert(size(TiledMma{}) == kMmaThreads, "two consumer warpgroups");

// The dynamic scheduler hands work items from the producer warp to the consumers through a
// two-slot ring in shared memory.
constexpr int kSchedStages = 2;
using SchedPipeline = cutlass::PipelineAsync<kSchedStages>;
constexpr int kItemDone = -1;  // no work left
constexpr int kItemComm = -2;  // this CTA has the communication role for this item
constexpr int kItemOp0 = -3;
constexpr int kEpiRoute = 3;   // fused RS/AR: fp32 values routed per shard (hooks.route)   // kItemOp0 - i: run op i of the communication program

// Every shared byte lives here; swizzled TMA tiles need 1 KiB alignment.
struct SharedStorage {
  alignas(1024) typename CollectiveMainloop::TensorStorage mainloop_tensors;
  alignas(1024) typename CollectiveEpilogue::TensorStorage epilogue_tensors;
  alignas(16) typename CollectiveMainloop::PipelineStorage mainloop_pipe;
  alignas(16) typename CollectiveEpilogue::PipelineStorage epi_load_pipe;
  alignas(16) typename SchedPipeline::SharedStorage sched_pipe;
  int sched_item[kSchedStages];
  int ops_done;  // communication ops this CTA's consumers finished
};
static_assert(sizeof(SharedStorage) <= 232448, "shared storage exceeds the sm_90 opt-in limit");

struct Params {
  ProblemShape problem;
  typename CollectiveMainloop::Params mainloop;
  typename CollectiveEpilogue::Params epilogue;
  int tiles_m, tiles_n, k_tiles;
  const int* order;       // caller-given tile order, or null (grouped static order)
  uint64_t* tile_flags;   // per-tile signal after the tile's stores are in global memory
  uint64_t flag_value;
  int flag_add;           // add flag_value instead of setting it
  int epi_mode;           // Epilogue
  void* c;                // the reduce-add destination (bf16 or fp32)
  int64_t ldc;
  TraceBuffer trace;      // used by the traced kernel variant only
  // Dynamic variant: role counts in device memory, re-read per work item; tiles from a
  // counter (zeroed before the launch); comm-role items counted in comm_items.
  const int* role_counts;
  int* tile_counter;
  unsigned int* comm_items;
  // Arrival order: work item i is arrival_queue[i], usable once *arrival_count > i.
  const int* arrival_queue;
  const uint64_t* arrival_count;
  WaitCtx arrival_wait;
  // Fused operators: the communication program and the per tile-row hooks (ops/fused_device.h).
  ops::FusedHooks hooks;
};

__device__ __forceinline__ uint64_t timer_ns() { return device::trace_now_ns(); }
__device__ __forceinline__ void trace_item(const Params& p, Role role, int item, uint64_t t0) {
  device::trace_record(p.trace, role, item, t0);
}

// Static persistent schedule: CTA b takes tiles b, b + grid, ... Tiles are numbered in groups
// of kGroupM tile-rows; within a group they walk down M first, then across N. A wave of ~132
// CTAs then covers about 16 x 8 tiles: per k-step it reads 16 A and 8 B slices (16 KiB and
// 32 KiB each) instead of 64 A slices with plain column order, so L2 serves most loads.
constexpr int kGroupM = 16;
// The schedulers share one method set: work item i of the persistent loop -> a tile id
// (t = n * tiles_m + m). Producer and consumers walk the same items, so they agree.
__device__ __forceinline__ int tile_of_item(const Params& p, int i) {
  if (p.order) return p.order[i];  // caller-given order
  const int per_group = kGroupM * p.tiles_n;
  const int first_m = (i / per_group) * kGroupM;
  const int rows = min(p.tiles_m - first_m, kGroupM);
  const int r = i % per_group;
  return (r / rows) * p.tiles_m + first_m + r % rows;
}
__device__ __forceinline__ auto tile_coord(const Params& p, int i) {
  const int t = tile_of_item(p, i);
  return make_coord(t % p.tiles_m, t / p.tiles_m, _, 0);
}

__device__ __forceinline__ void publish_flag(const Params& p, int t) {
  if (p.flag_add)
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p.tile_flags + t), "l"(p.flag_value) : "memory");
  else
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p.tile_flags + t), "l"(p.flag_value) : "memory");
}

// Per-tile signal after TMA stores: the warp that issued them (consumer warp 0; bulk-copy
// groups belong to the issuing thread) waits until the stores are complete in global memory,
// not only until shared memory was read, orders the async proxy's writes before its own, then
// one lane publishes the flag with release semantics at system scope.
__device__ __forceinline__ void signal_tile_after_tma(const Params& p, int mma_tid, int t) {
  if (mma_tid >= 32) return;
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __syncwarp();
  if (mma_tid == 0) publish_flag(p, t);
}

// Reduce-add epilogue straight from the accumulator registers: each consumer thread adds its
// elements into C with system-scope reductions (atomic across GPUs writing one owner), pairs
// of adjacent bf16 columns as one bf16x2 reduction. Rows and columns past (M, N) are skipped.
template <class Accum>
__device__ __forceinline__ void reduce_add_tile(const Params& p, const Accum& accum, int mma_tid,
                                                int tile_m, int tile_n) {
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  const int M = get<0>(p.problem), N = get<1>(p.problem);
  Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(TileShape{}),
                             make_coord(tile_m, tile_n));
  Tensor tc = thr_mma.partition_C(coords);  // same layout as the accumulators
  static_assert(decltype(size(accum))::value % 2 == 0, "accumulators come in column pairs");
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(accum); i += 2) {
    const int m = get<0>(tc(i)), n = get<1>(tc(i)), n1 = get<1>(tc(i + 1));
    if (m >= M) continue;
    if (p.epi_mode == int(Epilogue::kReduceAddF32)) {
      float* row = static_cast<float*>(p.c) + int64_t(m) * p.ldc;
      if (n < N) asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(row + n), "f"(accum(i)) : "memory");
      if (n1 < N) asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(row + n1), "f"(accum(i + 1)) : "memory");
    } else {
      __nv_bfloat16* row = static_cast<__nv_bfloat16*>(p.c) + int64_t(m) * p.ldc;
      if (n1 == n + 1 && (n & 1) == 0 && n1 < N) {
        __nv_bfloat162 v = __floats2bfloat162_rn(accum(i), accum(i + 1));
        asm volatile("red.relaxed.sys.global.add.noftz.bf16x2 [%0], %1;" ::"l"(row + n),
                     "r"(*reinterpret_cast<uint32_t*>(&v)) : "memory");
      } else {
        if (n < N) {
          __nv_bfloat16 v = __float2bfloat16_rn(accum(i));
          asm volatile("red.relaxed.sys.global.add.noftz.bf16 [%0], %1;" ::"l"(row + n),
                       "h"(*reinterpret_cast<uint16_t*>(&v)) : "memory");
        }
        if (n1 < N) {
          __nv_bfloat16 v = __float2bfloat16_rn(accum(i + 1));
          asm volatile("red.relaxed.sys.global.add.noftz.bf16 [%0], %1;" ::"l"(row + n1),
                       "h"(*reinterpret_cast<uint16_t*>(&v)) : "memory");
        }
      }
    }
  }
}

// After a reduce-add tile: every consumer thread's reductions are made visible at system
// scope, the 256 consumer threads meet, then one thread publishes the flag.
constexpr uint32_t kReduceBarrier = 1;  // user named-barrier id (hardware id 9)
__device__ __forceinline__ void signal_tile_after_reduce(const Params& p, int mma_tid, int t) {
  __threadfence_system();
  cutlass::arch::NamedBarrier::sync(kMmaThreads, kReduceBarrier);
  if (mma_tid == 0) publish_flag(p, t);
}

// ---- fused operators: per tile-row hooks, the routed epilogue, the communication program ----

constexpr uint32_t kHookBarrier = 2;  // consumer named barrier for the hooks and comm ops

// The hooks' waits, signals and ops (src/comm/executor.cuh) on this kernel's Params.
template <bool kProducer = false>
__device__ __forceinline__ void hook_waits(const Params& p, uint32_t w0, uint32_t n, uint64_t epoch) {
  ops::hook_waits<kProducer>(p.hooks, w0, n, epoch);
}
__device__ __forceinline__ void hook_signals(const Params& p, uint32_t s0, uint32_t n, uint64_t epoch) {
  ops::hook_signals(p.hooks, s0, n, epoch);
}
__device__ __forceinline__ bool op_ready(const Params& p, int idx, uint64_t epoch) {
  return ops::op_ready(p.hooks, idx, epoch);
}

// Routed fp32 epilogue: element (m, n) of shard s = m / shard_rows goes to
// route[s] + (m - s * shard_rows) * N + n, reduce-added (or stored when deterministic). The
// destinations are peers' accumulation buffers on this node.
template <class Accum>
__device__ __forceinline__ void route_tile(const Params& p, const Accum& accum, int mma_tid, int tile_m, int tile_n) {
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(mma_tid);
  const int M = get<0>(p.problem), N = get<1>(p.problem);
  Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(TileShape{}),
                             make_coord(tile_m, tile_n));
  Tensor tc = thr_mma.partition_C(coords);
  const int ms = static_cast<int>(p.hooks.shard_rows);
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
    float* row = p.hooks.route[s] + int64_t(r) * N;
    if (p.hooks.route_store) {
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

// kTrace: the traced variant records one event per tile for the producer and one for the
// consumers (start/end global-timer stamps); the untraced variant has no tracing code.
// kDynamic: the role-aware dynamic scheduler. Per work item the producer warp re-reads the
// role counts (device memory, so a controller may change them while the kernel runs): CTAs
// below role_counts[0] take the communication role for that item; the others take the next
// tile from a global counter. Items reach the consumers through SchedPipeline.
template <bool kTrace, bool kDynamic>
__global__ void __launch_bounds__(kThreads, 1) persistent_gemm(__grid_constant__ const Params params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  const int lane = cutlass::canonical_lane_idx();
  const int mma_tid = int(threadIdx.x) % kMmaThreads;
  const uint32_t cta_rank = cute::block_rank_in_cluster();
  if (cutlass::canonical_warp_idx_sync() == 0 && cute::elect_one_sync()) {
    CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
    CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
  }
  typename MainloopPipeline::Params mp;
  if (wg == 0 && warp_in_wg == 0) mp.role = MainloopPipeline::ThreadCategory::Producer;
  if (wg >= 1) mp.role = MainloopPipeline::ThreadCategory::Consumer;
  mp.is_leader = (threadIdx.x % cutlass::NumThreadsPerWarpGroup) == 0;
  mp.num_consumers = kMmaThreads;
  mp.num_producers = CollectiveMainloop::NumProducerThreadEvents;
  mp.transaction_bytes = params.mainloop.tma_transaction_bytes;
  MainloopPipeline mainloop_pipeline(smem.mainloop_pipe, mp, ClusterShape{});
  typename EpiLoadPipeline::Params lp;
  if (wg == 0 && warp_in_wg == 2) lp.role = EpiLoadPipeline::ThreadCategory::Producer;
  if (wg >= 1) lp.role = EpiLoadPipeline::ThreadCategory::Consumer;
  lp.dst_blockid = cta_rank;
  lp.producer_arv_count = cutlass::NumThreadsPerWarp;
  lp.consumer_arv_count = kMmaThreads;
  lp.transaction_bytes = params.epilogue.tma_transaction_bytes;
  EpiLoadPipeline epi_load_pipeline(smem.epi_load_pipe, lp);
  typename EpiStorePipeline::Params spp;
  spp.always_wait = true;
  EpiStorePipeline epi_store_pipeline(spp);
  typename SchedPipeline::Params schp;
  if (wg == 0 && warp_in_wg == 0) schp.role = SchedPipeline::ThreadCategory::Producer;
  if (wg >= 1) schp.role = SchedPipeline::ThreadCategory::Consumer;
  schp.producer_arv_count = 1;
  schp.consumer_arv_count = kMmaThreads;
  SchedPipeline sched_pipeline(smem.sched_pipe, schp);
  if (threadIdx.x == 0) smem.ops_done = 0;
  __syncthreads();  // barrier inits visible to the whole CTA (cluster of one); none after the split

  TiledMma tiled_mma;
  auto blk_shape = TileShape{};
  auto problem_mnkl = params.problem;
  CollectiveMainloop mainloop;
  auto load_inputs = mainloop.load_init(problem_mnkl, params.mainloop);
  const int num_tiles = params.tiles_m * params.tiles_n;
  const int k_tiles = params.k_tiles;
  // The call's epoch (fused operators): read by every thread before any CTA can finish.
  const uint64_t epoch = (kDynamic && params.hooks.epoch) ? device::epoch_of_call(params.hooks.epoch) : 0;

  if (wg == 0) {
    // Producer warpgroup: warp 0 streams A and B tiles through TMA into the stage ring.
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0) {
      auto state = cutlass::make_producer_start_state<MainloopPipeline>();
      if constexpr (kDynamic) {
        auto sched_w = cutlass::make_producer_start_state<SchedPipeline>();
        bool ops_left_empty = false;
        int ops_issued = 0;
        for (;;) {
          int item = 0;
          if (lane == 0) {
            sched_pipeline.producer_acquire(sched_w);
            // At least one CTA always computes, whatever the count says: progress is guaranteed.
            const int comm = params.role_counts
                                 ? min(*reinterpret_cast<const volatile int*>(params.role_counts),
                                       static_cast<int>(gridDim.x) - 1)
                                 : 0;
            bool took = false;
            if (static_cast<int>(blockIdx.x) < comm) {
              if (params.hooks.n_ops > 0) {
                // Ops in program order. The next op is taken when its waits are already met, or
                // when no tile is left; otherwise this CTA computes a tile meanwhile (a run-time
                // move between roles: communication CTAs never idle in a wait while tiles remain).
                // Once no op is left it computes for good.
                if (!ops_left_empty && !params.hooks.peek_ops) {
                  const int op = atomicAdd(params.hooks.op_counter, 1);
                  if (op < params.hooks.n_ops) {
                    item = kItemOp0 - op;
                    took = true;
                    ++ops_issued;
                  } else {
                    ops_left_empty = true;
                  }
                } else if (!ops_left_empty) {
                  const int idx = *reinterpret_cast<volatile int*>(params.hooks.op_counter);
                  if (idx >= params.hooks.n_ops) {
                    ops_left_empty = true;
                  } else {
                    const bool tiles_left = *reinterpret_cast<volatile int*>(params.tile_counter) < num_tiles;
                    if (!tiles_left || op_ready(params, idx, epoch)) {
                      if (atomicCAS(params.hooks.op_counter, idx, idx + 1) == idx) {
                        item = kItemOp0 - idx;
                        took = true;
                        ++ops_issued;
                      }
                    }
                  }
                }
              } else {
                const int done = *reinterpret_cast<volatile int*>(params.tile_counter) >= num_tiles;
                item = done ? kItemDone : kItemComm;
                took = true;
              }
            }
            if (!took) {
              // A CTA leaving the communication role first lets its consumers finish the ops it
              // handed them: a tile queued behind an op that waits for that very tile's result
              // (a reduction waiting on the tile counts) would never run. The ops' own waits are
              // bounded, so this one ends too.
              while (ops_issued && *reinterpret_cast<volatile int*>(&smem.ops_done) < ops_issued) __nanosleep(64);
              item = atomicAdd(params.tile_counter, 1);
              if (item >= num_tiles) {
                item = kItemDone;
                // No tile left: help with the communication program's remaining ops (the final
                // reductions and copies), so they run on every SM instead of the comm CTAs only.
                if (params.hooks.n_ops > 0 && !ops_left_empty) {
                  const int op = atomicAdd(params.hooks.op_counter, 1);
                  if (op < params.hooks.n_ops) {
                    item = kItemOp0 - op;
                    ++ops_issued;
                  } else {
                    ops_left_empty = true;
                  }
                }
              } else if (params.arrival_queue) {
                // Arrival-ordered: the i-th item is the i-th tile made ready (bounded wait).
                device::wait_ge<true>(params.arrival_wait, params.arrival_count, uint64_t(item) + 1, -1, item);
                item = *reinterpret_cast<const volatile int*>(params.arrival_queue + item);
              } else if (params.order) {
                item = params.order[item];  // caller-given order
              }
              if (item >= 0 && params.hooks.rows) {
                // The tile's A rows must have arrived (AG) before TMA reads them.
                const ops::DevRowHooks h = params.hooks.rows[item % params.tiles_m];
                if (h.load_waits) {
                  hook_waits<true>(params, h.load_wait0, h.load_waits, epoch);
                  asm volatile("fence.proxy.async.global;" ::: "memory");
                }
              }
            }
            smem.sched_item[sched_w.index()] = item;
            sched_pipeline.producer_commit(sched_w);
          }
          ++sched_w;
          item = __shfl_sync(0xffffffffu, item, 0);
          if (item == kItemDone) break;
          if (item <= kItemOp0) continue;  // the consumers run the op
          if (item == kItemComm) {
            // The communication role's work goes here; for now it is counted and yields.
            if (lane == 0) {
              if (params.comm_items) atomicAdd(params.comm_items, 1u);
              __nanosleep(2000);
            }
            __syncwarp();
            continue;
          }
          uint64_t t0 = 0;
          if constexpr (kTrace) t0 = timer_ns();
          auto k_iter = cute::make_coord_iterator(shape<3>(get<0>(load_inputs)));
          mainloop.load(params.mainloop, mainloop_pipeline, state, load_inputs,
                        make_coord(item % params.tiles_m, item / params.tiles_m, _, 0), k_iter, k_tiles,
                        lane, cta_rank, smem.mainloop_tensors);
          state.advance(k_tiles);
          if constexpr (kTrace)
            if (lane == 0) trace_item(params, Role::kLoad, item, t0);
        }
      } else {
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
          uint64_t t0 = 0;
          if constexpr (kTrace) t0 = timer_ns();
          auto k_iter = cute::make_coord_iterator(shape<3>(get<0>(load_inputs)));
          mainloop.load(params.mainloop, mainloop_pipeline, state, load_inputs, tile_coord(params, t),
                        k_iter, k_tiles, lane, cta_rank, smem.mainloop_tensors);
          state.advance(k_tiles);
          if constexpr (kTrace)
            if (lane == 0) trace_item(params, Role::kLoad, tile_of_item(params, t), t0);
        }
      }
      mainloop.load_tail(mainloop_pipeline, state);
    }
    // Warps 1-3 idle here: the place for communication roles.
  } else {
    // Two consumer warpgroups share each tile: WGMMA into registers, then the TMA-store epilogue.
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    CollectiveEpilogue epilogue(params.epilogue, smem.epilogue_tensors);
    typename CollectiveMainloop::PipelineState ml_read;
    typename CollectiveEpilogue::LoadPipelineState el_read;
    auto es_write = cutlass::make_producer_start_state<EpiStorePipeline>();
    bool stored = false;
    // One tile: MMA over K, then the epilogue and the optional signal; `tile` is the tile id.
    auto do_tile = [&](int tile) {
      uint64_t t0 = 0;
      if constexpr (kTrace) t0 = timer_ns();
      auto blk_coord = make_coord(tile % params.tiles_m, tile / params.tiles_m, _, 0);
      auto accum = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
      mainloop.mma(mainloop_pipeline, ml_read, accum, k_tiles, mma_tid, smem.mainloop_tensors, params.mainloop);
      mainloop.mma_tail(mainloop_pipeline, ml_read, k_tiles);
      ml_read.advance(k_tiles);
      const int tm = tile % params.tiles_m;
      ops::DevRowHooks hk{};
      if (kDynamic && params.hooks.rows) hk = params.hooks.rows[tm];
      if (hk.store_waits) {
        // The destinations' owners have started this call (their buffers are free).
        if (mma_tid == 0) hook_waits(params, hk.store_wait0, hk.store_waits, epoch);
        cutlass::arch::NamedBarrier::sync(kMmaThreads, kHookBarrier);
      }
      if (params.epi_mode == kEpiRoute) {
        route_tile(params, accum, mma_tid, tm, tile / params.tiles_m);
        if (hk.store_sigs) {
          __threadfence_system();
          cutlass::arch::NamedBarrier::sync(kMmaThreads, kHookBarrier);
          if (mma_tid == 0) hook_signals(params, hk.store_sig0, hk.store_sigs, epoch);
        }
      } else if (params.epi_mode == int(Epilogue::kStore)) {
        auto [el_next, es_next] = epilogue.store(epi_load_pipeline, el_read, epi_store_pipeline, es_write,
                                                 problem_mnkl, blk_shape, blk_coord, accum, tiled_mma,
                                                 mma_tid, smem.epilogue_tensors);
        el_read = el_next;
        es_write = es_next;
        stored = true;
        if (params.tile_flags) signal_tile_after_tma(params, mma_tid, tile);
      } else {
        reduce_add_tile(params, accum, mma_tid, tile % params.tiles_m, tile / params.tiles_m);
        if (params.tile_flags) signal_tile_after_reduce(params, mma_tid, tile);
      }
      if constexpr (kTrace)
        if (mma_tid == 0) trace_item(params, Role::kCompute, tile, t0);
    };
    if constexpr (kDynamic) {
      typename SchedPipeline::PipelineState sched_r;
      for (;;) {
        sched_pipeline.consumer_wait(sched_r);
        const int item = smem.sched_item[sched_r.index()];
        sched_pipeline.consumer_release(sched_r);
        ++sched_r;
        if (item == kItemDone) break;
        if (item == kItemComm) continue;
        if (item <= kItemOp0) {
          uint64_t t0 = 0;
          if constexpr (kTrace) t0 = timer_ns();
          ops::run_comm_op<kMmaThreads, kHookBarrier>(params.hooks, kItemOp0 - item, mma_tid, epoch);
          if (mma_tid == 0) {
            if constexpr (kTrace) {
              const int op = kItemOp0 - item;
              trace_item(params, params.hooks.ops[op].kind == ops::kDevNetPut ? Role::kNetSend : Role::kComm, op, t0);
            }
            atomicAdd_block(&smem.ops_done, 1);
          }
          continue;
        }
        do_tile(item);
      }
    } else {
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) do_tile(tile_of_item(params, t));
    }
    if (stored) epilogue.store_tail(epi_load_pipeline, el_read, epi_store_pipeline, es_write);
  }
  if constexpr (kDynamic) {
    // The last CTA to finish advances the epoch for the next call.
    if (params.hooks.epoch) device::epoch_finish(params.hooks.epoch, gridDim.x);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: fail loudly instead of computing nothing
#endif
}

}  // namespace sm90
#endif  // MK_WITH_CUTLASS

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF32: return "fp32";
  }
  return "?";
}
}  // namespace

namespace {
// check_c false: C is not written (the routed epilogue of a fused launch): skip its checks.
Status check_args(const Arguments& a, bool check_c) {
  const DType want_c = a.epilogue == Epilogue::kReduceAddF32 ? DType::kF32 : DType::kBF16;
  MK_REQUIRE(a.epilogue == Epilogue::kStore || a.epilogue == Epilogue::kReduceAddBF16 ||
                 a.epilogue == Epilogue::kReduceAddF32,
             Code::kInvalidArgument, "gemm: unknown epilogue %d", int(a.epilogue));
  MK_REQUIRE(a.a_type == DType::kBF16 && a.b_type == DType::kBF16 && a.c_type == want_c,
             Code::kInvalidArgument,
             "gemm: only bf16 A and B are implemented, with a %s C for this epilogue (got %s, %s, %s)",
             dtype_name(want_c), dtype_name(a.a_type), dtype_name(a.b_type), dtype_name(a.c_type));
  MK_REQUIRE(a.M >= 0 && a.N >= 0 && a.K >= 0, Code::kInvalidArgument,
             "gemm: negative shape (%lld, %lld, %lld)", (long long)a.M, (long long)a.N, (long long)a.K);
  MK_REQUIRE(a.K > 0, Code::kInvalidArgument, "gemm: K must be > 0 (C = A·Bᵀ over an empty K is not a GEMM)");
  MK_REQUIRE(a.M < (1ll << 31) && a.N < (1ll << 31) && a.K < (1ll << 31), Code::kInvalidArgument,
             "gemm: each of M, N, K must be < 2^31");
  const int64_t lda = a.lda ? a.lda : a.K, ldb = a.ldb ? a.ldb : a.K, ldc = a.ldc ? a.ldc : a.N;
  MK_REQUIRE(lda >= a.K && ldb >= a.K && ldc >= a.N, Code::kInvalidArgument,
             "gemm: leading dimensions (%lld, %lld, %lld) shorter than the rows (%lld, %lld, %lld)",
             (long long)lda, (long long)ldb, (long long)ldc, (long long)a.K, (long long)a.K, (long long)a.N);
  // Rows are 16-byte aligned: K (rows of A and B) and N (rows of C) are multiples of 8 bf16.
  // Measured on an H200: with N = 1030 and ldc = 1032 the TMA store wrote the 16-byte
  // remainder of each row (2 elements past N), so a ragged row end is rejected, not clipped.
  MK_REQUIRE(a.K % 8 == 0 && a.N % 8 == 0, Code::kInvalidArgument,
             "gemm: K and N must be multiples of 8 (16-byte rows), got K %lld, N %lld; pad them "
             "(zeros in A/B, ignore the extra columns of C)",
             (long long)a.K, (long long)a.N);
  MK_REQUIRE(lda % 8 == 0 && ldb % 8 == 0 && ldc % 8 == 0, Code::kInvalidArgument,
             "gemm: row strides must be multiples of 8 elements (16 bytes): lda %lld, ldb %lld, ldc %lld",
             (long long)lda, (long long)ldb, (long long)ldc);
  if (a.M > 0 && a.N > 0) {
    MK_REQUIRE(a.A && a.B && a.C, Code::kInvalidArgument, "gemm: null pointer");
    MK_REQUIRE(aligned16(a.A) && aligned16(a.B) && aligned16(a.C), Code::kInvalidArgument,
               "gemm: A, B and C must be 16-byte aligned");
  }
  if (check_c && a.M > 0 && a.N > 0) {
    auto overlaps = [](const void* p, int64_t pb, const void* q, int64_t qb) {
      auto x = reinterpret_cast<uintptr_t>(p), y = reinterpret_cast<uintptr_t>(q);
      return x < y + qb && y < x + pb;
    };
    const int64_t cbytes = a.c_type == DType::kF32 ? 4 : 2;
    const int64_t ab = (a.M - 1) * lda * 2 + a.K * 2, bb = (a.N - 1) * ldb * 2 + a.K * 2,
                  cb = (a.M - 1) * ldc * cbytes + a.N * cbytes;
    MK_REQUIRE(!overlaps(a.C, cb, a.A, ab) && !overlaps(a.C, cb, a.B, bb), Code::kInvalidArgument,
               "gemm: C overlaps A or B");
  }
#if !MK_WITH_CUTLASS
  return Status(Code::kNotSupported, "gemm: mkernel was built without CUTLASS headers");
#else
  return OkStatus();
#endif
}
}  // namespace

Status can_implement(const Arguments& a) { return check_args(a, true); }

TileCount tile_count(int64_t M, int64_t N) {
  TileCount c;
  c.m = static_cast<int>((M + 127) / 128);
  c.n = static_cast<int>((N + 255) / 256);
  return c;
}

Status persistent_ctas(int* out) {
#if MK_WITH_CUTLASS
  int dev = 0, sms = 0, per_sm = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  // Every launch asks: the attributes, loads and the occupancy query run once per device.
  static std::mutex mu;
  static std::map<int, int> known;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = known.find(dev);
    if (it != known.end()) {
      *out = it->second;
      return OkStatus();
    }
  }
  // Under MPS this is the share of SMs this client may use, not the chip's count.
  MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int smem = int(sizeof(sm90::SharedStorage));
  // All variants have the same resources; loading them here keeps later launches load-free.
  MK_CUDA_CHECK(cudaFuncSetAttribute(sm90::persistent_gemm<false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MK_CUDA_CHECK(cudaFuncSetAttribute(sm90::persistent_gemm<true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MK_CUDA_CHECK(cudaFuncSetAttribute(sm90::persistent_gemm<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MK_CUDA_CHECK(cudaFuncSetAttribute(sm90::persistent_gemm<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sm90::persistent_gemm<false, false>, sm90::kThreads, smem));
  MK_REQUIRE(per_sm >= 1, Code::kNotSupported, "gemm: the kernel cannot be resident on this device");
  *out = sms * per_sm;
  std::lock_guard<std::mutex> g(mu);
  known[dev] = *out;
  return OkStatus();
#else
  *out = 0;
  return Status(Code::kNotSupported, "gemm: mkernel was built without CUTLASS headers");
#endif
}

namespace {
Status launch(const Arguments& a, const FusedLaunch* f, cudaStream_t stream, const RunConfig& cfg) {
  MK_CHECK(check_args(a, !(f && f->route)));
  if (a.M == 0 || a.N == 0) return OkStatus();
#if MK_WITH_CUTLASS
  using namespace sm90;
  int dev = 0, major = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  MK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MK_REQUIRE(major == 9, Code::kNotSupported, "gemm: needs an sm_90 GPU (this one is sm_%d*)", major);
  const int M = int(a.M), N = int(a.N), K = int(a.K);
  ProblemShape problem{M, N, K, 1};
  StrideA dA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
  StrideB dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
  StrideD dD = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(M, N, 1));
  cute::get<0>(dA) = a.lda ? a.lda : a.K;
  cute::get<0>(dB) = a.ldb ? a.ldb : a.K;
  const int64_t ldc = a.ldc ? a.ldc : a.N;
  // The TMA-store descriptor is always built; for an fp32 reduce-add destination it views the
  // buffer as bf16 (twice the elements per row) and is never used.
  cute::get<0>(dD) = a.c_type == DType::kF32 ? 2 * ldc : ldc;
  typename CollectiveMainloop::Arguments ml{static_cast<const Element*>(a.A), dA, static_cast<const Element*>(a.B), dB};
  typename CollectiveEpilogue::Arguments ep{};
  ep.thread.alpha = 1.0f;
  ep.thread.beta = 0.0f;
  ep.ptr_C = nullptr;
  ep.dC = StrideC(dD);
  ep.ptr_D = static_cast<Element*>(a.C);
  ep.dD = dD;
  MK_REQUIRE(CollectiveMainloop::can_implement(problem, ml) && CollectiveEpilogue::can_implement(problem, ep),
             Code::kInvalidArgument, "gemm: CUTLASS collectives reject this problem (M %d, N %d, K %d)", M, N, K);
  Params p{};
  p.problem = problem;
  p.mainloop = CollectiveMainloop::to_underlying_arguments(problem, ml, nullptr);
  p.epilogue = CollectiveEpilogue::to_underlying_arguments(problem, ep, nullptr);
  p.tiles_m = (M + 127) / 128;
  p.tiles_n = (N + 255) / 256;
  p.k_tiles = (K + 63) / 64;
  p.order = a.tile_order;
  p.tile_flags = a.tile_flags;
  p.flag_value = a.tile_flag_value;
  p.flag_add = a.tile_flag_add ? 1 : 0;
  p.epi_mode = int(a.epilogue);
  p.c = a.C;
  p.ldc = ldc;
  int resident = 0;
  MK_CHECK(persistent_ctas(&resident));
  // A persistent grid larger than what can be co-resident would serialize (and, with the
  // communication roles to come, deadlock): refuse rather than launch it.
  MK_REQUIRE(cfg.max_ctas <= resident, Code::kInvalidArgument,
             "gemm: max_ctas %d exceeds the %d CTAs that can be co-resident", cfg.max_ctas, resident);
  const int tiles = p.tiles_m * p.tiles_n;
  int grid = cfg.max_ctas > 0 ? cfg.max_ctas : resident;
  // A fused launch keeps its communication CTAs even when the tiles are few.
  if (grid > tiles && !f) grid = tiles;
  MK_REQUIRE(!f || f->hooks.n_ops == 0 || grid >= 2, Code::kInvalidArgument,
             "gemm: a fused launch with communication needs at least 2 CTAs (got %d)", grid);
  if (f) {
    p.role_counts = f->role_counts;
    p.tile_counter = f->tile_counter;
    p.order = f->tile_order;
    p.hooks = f->hooks;
    if (f->route) p.epi_mode = kEpiRoute;
    MK_REQUIRE(f->tile_counter && (f->hooks.n_ops == 0 || f->role_counts), Code::kInvalidArgument,
               "gemm: a fused launch needs a tile counter, and role counts when it has communication ops");
    if (f->hooks.op_counter) MK_CUDA_CHECK(cudaMemsetAsync(f->hooks.op_counter, 0, sizeof(int), stream));
    MK_CUDA_CHECK(cudaMemsetAsync(f->tile_counter, 0, sizeof(int), stream));
    if (a.trace) {
      // Traced fused call: compute tiles, TMA loads and communication ops on one timeline.
      p.trace = *a.trace;
      persistent_gemm<true, true><<<grid, kThreads, sizeof(SharedStorage), stream>>>(p);
    } else {
      persistent_gemm<false, true><<<grid, kThreads, sizeof(SharedStorage), stream>>>(p);
    }
  } else if (a.role_counts || a.arrival_queue) {
    MK_REQUIRE(a.tile_counter && !a.trace && !a.tile_order, Code::kInvalidArgument,
               "gemm: role counts and arrival order need a tile_counter, and do not combine with "
               "tracing or a tile order");
    MK_REQUIRE(!a.arrival_queue || (a.arrival_count && a.arrival_wait.timeout_ns > 0), Code::kInvalidArgument,
               "gemm: an arrival queue needs arrival_count and a bounded arrival_wait");
    p.role_counts = a.role_counts;
    p.tile_counter = a.tile_counter;
    p.comm_items = a.comm_items;
    p.arrival_queue = a.arrival_queue;
    p.arrival_count = a.arrival_count;
    p.arrival_wait = a.arrival_wait;
    // Stream-ordered (capturable): the counter starts at 0 for this call.
    MK_CUDA_CHECK(cudaMemsetAsync(a.tile_counter, 0, sizeof(int), stream));
    persistent_gemm<false, true><<<grid, kThreads, sizeof(SharedStorage), stream>>>(p);
  } else if (a.trace) {
    p.trace = *a.trace;
    persistent_gemm<true, false><<<grid, kThreads, sizeof(SharedStorage), stream>>>(p);
  } else {
    persistent_gemm<false, false><<<grid, kThreads, sizeof(SharedStorage), stream>>>(p);
  }
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
#else
  (void)f;
  (void)stream;
  (void)cfg;
  return Status(Code::kNotSupported, "gemm: mkernel was built without CUTLASS headers");
#endif
}
}  // namespace

Status run(const Arguments& a, cudaStream_t stream, const RunConfig& cfg) { return launch(a, nullptr, stream, cfg); }

Status run_fused(const Arguments& a, const FusedLaunch& f, cudaStream_t stream, const RunConfig& cfg) {
  MK_REQUIRE(a.epilogue == Epilogue::kStore && !a.role_counts && !a.arrival_queue && !a.tile_order,
             Code::kInvalidArgument, "gemm: a fused launch takes its schedule from the FusedLaunch");
  return launch(a, &f, stream, cfg);
}

}  // namespace gemm
}  // namespace mk
