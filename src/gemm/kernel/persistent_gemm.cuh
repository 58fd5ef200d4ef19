// mkernel — the persistent sm_90a bf16 GEMM kernel. It only composes: the mainloop
// (mainloop.cuh), the epilogues (epilogue.cuh), a tile scheduler (scheduler.cuh) and a
// communication-role policy (src/comm/comm_role.cuh).
//
// CTA: 384 threads. Warpgroup 0 produces: its warp 0 streams A and B tiles by TMA into the
// stage ring (with the dynamic scheduler its lane 0 also decides, per work item, between a tile
// and a communication op); warps 1-3 idle. Warpgroups 1 and 2 consume: WGMMA into registers
// (each the half of a 128x256 tile), then the epilogue; with the dynamic scheduler they also
// run the communication ops handed to them. Registers are rebalanced with setmaxnreg (40 / 232).
//
// Instantiated (sm90_gemm_bf16.cu) as <kTrace, StaticScheduler, NoComm> for plain launches and
// <kTrace, DynamicScheduler, CommRole> for the fused operators. kTrace: the traced variant
// records one event per tile for the producer and one for the consumers; the untraced variant
// has no tracing code.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "mkernel/device/trace.cuh"
#include "mkernel/device/trace.h"
#include "src/comm/comm_role.cuh"
#include "src/gemm/kernel/config.cuh"
#include "src/gemm/kernel/epilogue.cuh"
#include "src/gemm/kernel/mainloop.cuh"
#include "src/gemm/kernel/scheduler.cuh"

namespace mk {
namespace gemm {
namespace sm90 {

// Every shared byte lives here; swizzled TMA tiles need 1 KiB alignment. (The CUTLASS parts are
// kept out of the templates below: nvcc's host pass cannot spell the collectives' types inside a
// class template.)
// The two epilogues never run in one launch (Params::epi): they share their buffers.
union EpilogueSmem {
  typename EpilogueCollective::TensorStorage tensors;  // kStore: the TMA-store collective
  alignas(1024) char route[kRouteStageBytes];            // kRoute: route_tile_bulk's boxes
};
struct SharedCore {
  alignas(1024) typename MainloopCollective::TensorStorage mainloop_tensors;
  alignas(1024) EpilogueSmem epi;
  alignas(16) typename MainloopCollective::PipelineStorage mainloop_pipe;
  alignas(16) typename EpilogueCollective::PipelineStorage epi_load_pipe;
  ItemQueueStorage items;  // dynamic scheduler only
};
template <class Comm_>
struct SharedStorage : SharedCore {
  typename Comm_::SharedStorage comm;
};
static_assert(sizeof(SharedStorage<comm::CommRole>) <= 232448, "shared storage exceeds the sm_90 opt-in limit");

struct ParamsCore {
  ProblemShape problem;
  typename MainloopCollective::Params mainloop;
  typename EpilogueCollective::Params epilogue;
  int tiles_m, tiles_n, k_tiles;
  // Split-K (static scheduler only): work item i is K range i % splits of the scheduler's tile
  // i / splits; each range is k_per_split slices (the last fewer); its fp32 tile goes to
  // partials + range * M * N (row-major, N wide), and splitk_reduce sums the ranges.
  int splits, k_per_split;
  float* partials;
  SchedulerParams sched;
  TileSignal signal;
  EpiKind epi;
  TraceBuffer trace;  // used by the traced kernel variant only
};
struct NoRoute {};
template <class Comm_>
struct Params : ParamsCore {
  typename Comm_::Params comm;
  // The routed epilogue of the fused collectives (EpiKind::kRoute): with a communication role only.
  std::conditional_t<Comm_::kEnabled, RouteEpilogue, NoRoute> route;
};

// The producer warp with the static scheduler: every tile of this CTA's items, in turn.
template <bool kTrace_, class Comm_, class LoadInputs_>
__device__ __forceinline__ void produce_static(const Params<Comm_>& params, SharedStorage<Comm_>& smem,
                                               MainloopCollective& mainloop, LoadInputs_& load_inputs,
                                               MainloopPipeline& pipeline, MainloopState& state, int num_tiles,
                                               int lane, uint32_t cta_rank) {
  const StaticScheduler sched{params.sched, num_tiles * params.splits};
  for (int i = sched.first(); sched.valid(i); i = sched.next(i)) {
    uint64_t t0 = 0;
    if constexpr (kTrace_) t0 = device::trace_now_ns();
    const int t = sched.tile_of_item(i / params.splits);
    const int k_begin = (i % params.splits) * params.k_per_split;
    load_tile(mainloop, params.mainloop, pipeline, state, load_inputs, t % params.tiles_m, t / params.tiles_m,
              k_begin, min(params.k_per_split, params.k_tiles - k_begin), lane, cta_rank, smem.mainloop_tensors);
    if constexpr (kTrace_)
      if (lane == 0) device::trace_record(params.trace, Role::kLoad, t, t0);
  }
}

// The producer warp with the dynamic scheduler. Per work item its lane 0 takes a slot of the
// item ring, asks the communication role whether this CTA takes an op (the consumers run it)
// or a tile (then the tile row's load hooks), and publishes the item; the warp loads the tile.
template <bool kTrace_, class Comm_, class LoadInputs_>
__device__ __forceinline__ void produce_dynamic(const Params<Comm_>& params, SharedStorage<Comm_>& smem,
                                                ItemPipeline& item_pipeline, MainloopCollective& mainloop,
                                                LoadInputs_& load_inputs, MainloopPipeline& pipeline,
                                                MainloopState& state, int num_tiles, int lane, uint32_t cta_rank,
                                                uint64_t epoch) {
  const DynamicScheduler sched{params.sched, num_tiles};
  ItemState item_w = cutlass::make_producer_start_state<ItemPipeline>();
  typename Comm_::RoleState role{};
  for (;;) {
    int item = 0;
    if (lane == 0) {
      item_pipeline.producer_acquire(item_w);
      if (!Comm_::take_op(params.comm, role, sched, epoch, item)) {
        Comm_::finish_handed_ops(role, smem.comm);
        item = sched.take_tile();
        if (item == comm::kItemDone) {
          Comm_::finish_handed_tiles(role, smem.comm);
          item = Comm_::help_op(params.comm, role);
        } else {
          Comm_::tile_handed(role);
          Comm_::load_waits(params.comm, item % params.tiles_m, epoch);
        }
      }
      smem.items.items[item_w.index()] = item;
      item_pipeline.producer_commit(item_w);
    }
    ++item_w;
    item = __shfl_sync(0xffffffffu, item, 0);
    if (item == comm::kItemDone) break;
    if (comm::is_op_item(item)) continue;  // the consumers run the op
    uint64_t t0 = 0;
    if constexpr (kTrace_) t0 = device::trace_now_ns();
    load_tile(mainloop, params.mainloop, pipeline, state, load_inputs, item % params.tiles_m, item / params.tiles_m,
              0, params.k_tiles, lane, cta_rank, smem.mainloop_tensors);
    if constexpr (kTrace_)
      if (lane == 0) device::trace_record(params.trace, Role::kLoad, item, t0);
  }
}

// The two consumer warpgroups (mma_tid 0..255): per tile the mainloop's MMA, the tile row's
// store hooks around the epilogue, the optional per-tile flag; with the dynamic scheduler also
// the communication ops the producer hands them.
template <bool kTrace_, class Scheduler_, class Comm_>
__device__ __forceinline__ void consume(const Params<Comm_>& params, SharedStorage<Comm_>& smem,
                                        ItemPipeline& item_pipeline, MainloopCollective& mainloop,
                                        MainloopPipeline& pipeline, EpiLoadPipeline& epi_load_pipeline,
                                        EpiStorePipeline& epi_store_pipeline, int num_tiles, int mma_tid,
                                        uint64_t epoch) {
  EpilogueCollective epilogue(params.epilogue, smem.epi.tensors);
  TiledMma tiled_mma;
  MainloopState ml_read;
  EpiLoadState el_read;
  EpiStoreState es_write = cutlass::make_producer_start_state<EpiStorePipeline>();
  bool stored = false;
  // The routed epilogue's signals wait for the next tile's MMA (or an op, or the end): its writes
  // complete meanwhile. Raised before anything of this CTA waits, so no wait depends on them.
  bool pending = false;
  typename Comm_::TileHooks pending_hooks{};
  auto flush = [&]() {
    if constexpr (Comm_::kEnabled) {
      if (!pending) return;
      route_bulk_complete(mma_tid);
      Comm_::template store_signals<kMmaThreads, kHookBarrier>(params.comm, pending_hooks, mma_tid, epoch);
      pending = false;
    }
  };
  // One tile (tile id `tile`): MMA over K (split-K: over K range `range`), then the epilogue
  // and the signals.
  auto do_tile = [&](int tile, int range) {
    uint64_t t0 = 0;
    if constexpr (kTrace_) t0 = device::trace_now_ns();
    auto accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
    const int k_begin = range * params.k_per_split;
    mma_tile(mainloop, params.mainloop, pipeline, ml_read, accum, min(params.k_per_split, params.k_tiles - k_begin),
             mma_tid, smem.mainloop_tensors);
    uint64_t t_epi = 0;
    if constexpr (kTrace_) t_epi = device::trace_now_ns();
    const int tm = tile % params.tiles_m, tn = tile / params.tiles_m;
    const typename Comm_::TileHooks hk = Comm_::tile_hooks(params.comm, tm);
    flush();
    Comm_::template store_waits<kMmaThreads, kHookBarrier>(params.comm, hk, mma_tid, epoch);
    bool routed = false;
    if constexpr (Comm_::kEnabled) {
      if (params.epi == EpiKind::kRoute) {
        const RouteEpilogue& h = params.route;
        if (final_tile_row(h, tm))
          final_tile(params.comm.program, h, params.problem, accum, mma_tid, tm, tn);
        else if (h.route_maps)
          route_tile_bulk(h, params.problem, accum, mma_tid, tm, tn, smem.epi.route);
        else
          route_tile(h, params.problem, accum, mma_tid, tm, tn);
        pending = true;
        pending_hooks = hk;
        routed = true;
      }
    }
    if (!routed && params.splits > 1) {
      store_partial(params.partials + int64_t(range) * get<0>(params.problem) * get<1>(params.problem),
                    params.problem, accum, mma_tid, tm, tn);
    } else if (!routed) {
      store_tile(epilogue, epi_load_pipeline, el_read, epi_store_pipeline, es_write, params.problem, tm, tn, accum,
                 mma_tid, smem.epi.tensors);
      stored = true;
      if (params.signal.flags) signal_tile_after_tma(params.signal, mma_tid, tile);
    }
    if constexpr (kTrace_)
      if (mma_tid == 0) {
        device::trace_record(params.trace, Role::kCompute, tile, t0);
        device::trace_record(params.trace, Role::kEpilogue, tile, t_epi);
      }
  };
  if constexpr (Scheduler_::kDynamic) {
    ItemState item_r;
    for (;;) {
      item_pipeline.consumer_wait(item_r);
      const int item = smem.items.items[item_r.index()];
      item_pipeline.consumer_release(item_r);
      ++item_r;
      if (item == comm::kItemDone) break;
      if (comm::is_op_item(item)) {
        flush();  // the op may wait for these signals (a final sum for a row count)
        const int op = comm::op_of_item(item);
        uint64_t t0 = 0;
        if constexpr (kTrace_) t0 = device::trace_now_ns();
        Comm_::template run_op<kMmaThreads, kHookBarrier>(params.comm, op, mma_tid, epoch);
        if (mma_tid == 0) {
          if constexpr (kTrace_) device::trace_record(params.trace, Comm_::trace_role(params.comm, op), op, t0);
          Comm_::op_done(params.comm, smem.comm);
        }
        continue;
      }
      do_tile(item, 0);
      if (mma_tid == 0) Comm_::tile_done(smem.comm);
    }
  } else {
    const StaticScheduler sched{params.sched, num_tiles * params.splits};
    for (int i = sched.first(); sched.valid(i); i = sched.next(i))
      do_tile(sched.tile_of_item(i / params.splits), i % params.splits);
  }
  flush();
  if (stored) epilogue.store_tail(epi_load_pipeline, el_read, epi_store_pipeline, es_write);
}

template <bool kTrace_, class Scheduler_, class Comm_>
__global__ void __launch_bounds__(kThreads, 1) persistent_gemm(__grid_constant__ const Params<Comm_> params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Scheduler_::kDynamic || !Comm_::kEnabled,
                "a communication role hands ops to the consumers: it needs the dynamic scheduler");
  uint64_t t_start = 0;  // traced: the CTA's start (its Role::kCta event)
  if constexpr (kTrace_) t_start = device::trace_now_ns();
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage<Comm_>& smem = *reinterpret_cast<SharedStorage<Comm_>*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  const int lane = cutlass::canonical_lane_idx();
  const int mma_tid = int(threadIdx.x) % kMmaThreads;
  const uint32_t cta_rank = cute::block_rank_in_cluster();
  if (cutlass::canonical_warp_idx_sync() == 0 && cute::elect_one_sync()) {
    MainloopCollective::prefetch_tma_descriptors(params.mainloop);
    EpilogueCollective::prefetch_tma_descriptors(params.epilogue);
  }
  typename MainloopPipeline::Params mp;
  if (wg == 0 && warp_in_wg == 0) mp.role = MainloopPipeline::ThreadCategory::Producer;
  if (wg >= 1) mp.role = MainloopPipeline::ThreadCategory::Consumer;
  mp.is_leader = (threadIdx.x % cutlass::NumThreadsPerWarpGroup) == 0;
  mp.num_consumers = kMmaThreads;
  mp.num_producers = MainloopCollective::NumProducerThreadEvents;
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
  typename ItemPipeline::Params ip;
  if (wg == 0 && warp_in_wg == 0) ip.role = ItemPipeline::ThreadCategory::Producer;
  if (wg >= 1) ip.role = ItemPipeline::ThreadCategory::Consumer;
  ip.producer_arv_count = 1;
  ip.consumer_arv_count = kMmaThreads;
  ItemPipeline item_pipeline(smem.items.pipe, ip);
  if (threadIdx.x == 0) Comm_::init_shared(smem.comm);
  __syncthreads();  // barrier inits visible to the whole CTA (cluster of one); none after the split

  MainloopCollective mainloop;
  auto load_inputs = mainloop.load_init(params.problem, params.mainloop);
  const int num_tiles = params.tiles_m * params.tiles_n;
  // The call's epoch (fused operators): read by every thread before any CTA can finish.
  const uint64_t epoch = Comm_::call_epoch(params.comm);

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0) {
      MainloopState state = cutlass::make_producer_start_state<MainloopPipeline>();
      if constexpr (Scheduler_::kDynamic)
        produce_dynamic<kTrace_>(params, smem, item_pipeline, mainloop, load_inputs, mainloop_pipeline, state,
                                 num_tiles, lane, cta_rank, epoch);
      else
        produce_static<kTrace_>(params, smem, mainloop, load_inputs, mainloop_pipeline, state, num_tiles, lane,
                                cta_rank);
      mainloop.load_tail(mainloop_pipeline, state);
    }
    // Warps 1-3 idle here.
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume<kTrace_, Scheduler_>(params, smem, item_pipeline, mainloop, mainloop_pipeline, epi_load_pipeline,
                                 epi_store_pipeline, num_tiles, mma_tid, epoch);
    if constexpr (kTrace_)
      if (mma_tid == 0) device::trace_record(params.trace, Role::kCta, -1, t_start);
  }
  Comm_::finish(params.comm);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: fail loudly instead of computing nothing
#endif
}

}  // namespace sm90
}  // namespace gemm
}  // namespace mk
