// mkernel — the GEMM's mainloop, one tile at a time: the producer warp streams a tile's A and B
// slices (BLK_K = 64 wide, all of K) by TMA into the shared-memory stage ring; the two consumer
// warpgroups run WGMMA over them into the (BLK_M, BLK_N) fp32 accumulators. CUTLASS 4.2's SM90
// collective does the per-stage work; these steps are what the persistent loop calls per tile.
#pragma once

#include "src/gemm/kernel/config.cuh"

namespace mk {
namespace gemm {
namespace sm90 {

using MainloopParams = typename MainloopCollective::Params;
using MainloopState = typename MainloopCollective::PipelineState;
using MainloopStorage = typename MainloopCollective::TensorStorage;

// Producer (one warp): the TMA loads of tile (tile_m, tile_n) over K slices k_begin ..
// k_begin + k_tiles - 1 (split-K: one range of them). @post `state` is advanced past the stages.
template <class LoadInputs_>
__device__ __forceinline__ void load_tile(MainloopCollective& mainloop, const MainloopParams& params,
                                          MainloopPipeline& pipeline, MainloopState& state, LoadInputs_& load_inputs,
                                          int tile_m, int tile_n, int k_begin, int k_tiles, int lane,
                                          uint32_t cta_rank, MainloopStorage& smem) {
  const auto k_shape = shape<3>(get<0>(load_inputs));
  auto k_iter = cute::make_coord_iterator(idx2crd(k_begin, k_shape), k_shape);
  mainloop.load(params, pipeline, state, load_inputs, make_coord(tile_m, tile_n, _, 0), k_iter, k_tiles, lane,
                cta_rank, smem);
  state.advance(k_tiles);
}

// Consumers (256 threads, mma_tid 0..255): accum = the tile's A·Bᵀ; the stages are released.
// @post `read` is advanced past the tile's stages.
template <class Accum_>
__device__ __forceinline__ void mma_tile(MainloopCollective& mainloop, const MainloopParams& params,
                                         MainloopPipeline& pipeline, MainloopState& read, Accum_& accum, int k_tiles,
                                         int mma_tid, MainloopStorage& smem) {
  mainloop.mma(pipeline, read, accum, k_tiles, mma_tid, smem, params);
  mainloop.mma_tail(pipeline, read, k_tiles);
  read.advance(k_tiles);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace mk
