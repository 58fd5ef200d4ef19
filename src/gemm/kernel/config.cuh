// mkernel — the sm_90a bf16 GEMM's compile-time configuration: tile shape, the CUTLASS 4.2
// collectives it is built from (TMA/WGMMA mainloop, TMA-store epilogue), the CTA's warpgroups
// and register budgets. Included by the kernel's headers (src/gemm/kernel/*.cuh).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"

namespace mk {
namespace gemm {
namespace sm90 {
using namespace cute;

using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _256, _64>;   // (BLK_M, BLK_N, BLK_K)
using ClusterShape = Shape<_1, _1, _1>;

using EpilogueCollective = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, 8,          // no C source
    Element, cutlass::layout::RowMajor, 8,       // D: bf16 row-major
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

// B is [N, K] row-major, i.e. K-contiguous: CUTLASS calls that a column-major B. The stage
// count is what shared memory holds next to the epilogue's buffers (4 stages).
using MainloopCollective = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, cutlass::layout::RowMajor, 8,
    Element, cutlass::layout::ColumnMajor, 8,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename EpilogueCollective::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using TiledMma = typename MainloopCollective::TiledMma;
using MainloopPipeline = typename MainloopCollective::MainloopPipeline;
using EpiLoadPipeline = typename EpilogueCollective::LoadPipeline;
using EpiStorePipeline = typename EpilogueCollective::StorePipeline;
using StrideA = typename MainloopCollective::StrideA;
using StrideB = typename MainloopCollective::StrideB;
using StrideC = typename EpilogueCollective::StrideC;
using StrideD = typename EpilogueCollective::StrideD;
using ProblemShape = Shape<int, int, int, int>;  // (M, N, K, L)

constexpr int kThreads = 384;     // producer warpgroup + two consumer warpgroups
constexpr int kMmaThreads = 256;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;  // 40 * 128 + 232 * 256 <= 64K registers
static_assert(size(TiledMma{}) == kMmaThreads, "two consumer warpgroups");

// Named barrier of the 256 consumer threads for the communication hooks and ops (user id;
// CUTLASS's own barriers come first).
constexpr uint32_t kHookBarrier = 2;

}  // namespace sm90
}  // namespace gemm
}  // namespace mk
