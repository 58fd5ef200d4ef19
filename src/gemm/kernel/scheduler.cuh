// mkernel — the GEMM's tile schedulers. Tile id t covers tile (t % tiles_m, t / tiles_m).
//   StaticScheduler   CTA b takes work items b, b + grid, ...; item i is tile order[i] (a
//                     caller-given order) or the i-th tile of the grouped order below. Producer
//                     and consumers walk the same items, so they agree without talking.
//   DynamicScheduler  items from a global counter (zeroed before the launch), mapped through
//                     order when given. Only the CTA's scheduling thread takes items; it hands
//                     each one (or a communication op, or the end) to the consumers through
//                     ItemQueue, a two-slot ring in shared memory.
#pragma once

#include "cutlass/pipeline/pipeline.hpp"
#include "src/comm/comm_role.cuh"

namespace mk {
namespace gemm {
namespace sm90 {

struct SchedulerParams {
  int tiles_m, tiles_n;
  const int* order;  // every tile id once, in the order to take them; null: grouped order
  int* counter;      // DynamicScheduler: the next work item (zeroed on the stream by the launch)
};

// Grouped order: tiles are numbered in groups of kGroupM tile-rows; within a group they walk
// down M first, then across N. A wave of ~132 CTAs then covers about 16 x 8 tiles: per k-step
// it reads 16 A and 8 B slices (16 KiB and 32 KiB each) instead of 64 A slices with plain
// column order, so L2 serves most loads.
constexpr int kGroupM = 16;

struct StaticScheduler {
  static constexpr bool kDynamic = false;
  const SchedulerParams& p;
  int num_tiles;

  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next(int i) const { return i + gridDim.x; }
  __device__ __forceinline__ bool valid(int i) const { return i < num_tiles; }
  // Work item i -> tile id.
  __device__ __forceinline__ int tile_of_item(int i) const {
    if (p.order) return p.order[i];  // caller-given order
    const int per_group = kGroupM * p.tiles_n;
    const int first_m = (i / per_group) * kGroupM;
    const int rows = min(p.tiles_m - first_m, kGroupM);
    const int r = i % per_group;
    return (r / rows) * p.tiles_m + first_m + r % rows;
  }
};

struct DynamicScheduler {
  static constexpr bool kDynamic = true;
  const SchedulerParams& p;
  int num_tiles;

  // Whether a tile is left (a peek: another CTA may take it first).
  __device__ __forceinline__ bool tiles_left() const {
    return *reinterpret_cast<volatile int*>(p.counter) < num_tiles;
  }
  // The next tile id, or comm::kItemDone when none is left.
  __device__ __forceinline__ int take_tile() const {
    const int i = atomicAdd(p.counter, 1);
    if (i >= num_tiles) return comm::kItemDone;
    return p.order ? p.order[i] : i;
  }
};

// The dynamic schedule's hand-off from the scheduling thread to the 256 consumer threads.
constexpr int kItemStages = 2;
using ItemPipeline = cutlass::PipelineAsync<kItemStages>;
struct ItemQueueStorage {
  alignas(16) typename ItemPipeline::SharedStorage pipe;
  int items[kItemStages];
};
using ItemState = cutlass::PipelineState<kItemStages>;

}  // namespace sm90
}  // namespace gemm
}  // namespace mk
