// mkernel — the sm_90a attention forward's compile-time configuration: tile shapes, the WGMMA
// atoms, shared-memory layouts and pipelines (Cfg<kD>), the CTA's warpgroups, register budgets
// and named barriers, and the kernel's parameters. Included by src/attention/kernel/*.cuh.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "src/attention/fmha_launch.h"

namespace mk {
namespace attention {
namespace sm90 {
using namespace cute;
using Element = cutlass::bfloat16_t;

constexpr int kThreads = 384;
constexpr int kMmaThreads = 256;
constexpr int kProducerRegs = 24;  // 24 * 128 + 240 * 256 fits the 168 * 384 registers the CTA launches with
constexpr int kConsumerRegs = 240;
constexpr uint32_t kCommBarrier = 3;   // named barrier of the 256 threads running comm ops
constexpr uint32_t kMergeBarrier0 = 4;  // named barriers 4 + w: consumer warpgroup w's merge order

template <int kD>
struct Cfg {
  static constexpr int kBlockM = kTileM;
  // 128-row key tiles: 176 (fewer row reductions per key) measured 0.62-0.65x of 128 on the
  // H200 (more registers than the consumers' 240 hold), see docs/attention.md.
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;
  using HD = Int<kD>;
  using MmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, BN, HD>>(), Layout<Shape<_2, _1, _1>>{}));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, HD, BN>, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  using AtomK = decltype(GMMA::Layout_K_SW128_Atom<Element>{});
  using SmemQ = decltype(tile_to_shape(AtomK{}, Shape<BM, HD>{}));
  using SmemK = decltype(tile_to_shape(AtomK{}, Shape<BN, HD, Int<kStages>>{}));
  // V^T: the same bytes as V seen as (D, N): N-contiguous rows become the MN-major B operand.
  using SmemVt = decltype(composition(SmemK{}, make_ordered_layout(Shape<HD, BN, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using PipeKV = cutlass::PipelineTmaAsync<kStages>;
  using PipeQ = cutlass::PipelineTmaAsync<1>;
  // Dynamic schedule: the producer takes items from a global counter and hands them to the
  // consumers through a two-slot ring (scheduler.cuh).
  using PipeSched = cutlass::PipelineAsync<2>;
  struct Shared {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemK>> v;
    alignas(16) typename PipeQ::SharedStorage pipe_q;
    alignas(16) typename PipeKV::SharedStorage pipe_k;
    alignas(16) typename PipeKV::SharedStorage pipe_v;
    alignas(16) typename PipeSched::SharedStorage pipe_s;
    int sched[2];
  };
  // Q: (seq, d, head, batch); K/V: (seq, d, head, batch, slot).
  using GmemQ = Layout<Shape<int, int, int, int>, Stride<int64_t, _1, int64_t, int64_t>>;
  using GmemKV = Layout<Shape<int, int, int, int, int>, Stride<int64_t, _1, int64_t, int64_t, int64_t>>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemQ{}),
                                      SmemQ{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                       make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemKV{}),
                                       take<0, 2>(SmemK{})));
};

// Comm_: the communication-role policy (src/comm/comm_role.cuh).
template <int kD, class Comm_>
struct Params {
  typename Cfg<kD>::TmaQ tma_q;
  typename Cfg<kD>::TmaKV tma_k[2], tma_v[2];  // [0] the local K/V, [1] the slots
  int B, H, Hkv, Sq;
  int kv_rows[2];                              // rows of [0] and of one slot of [1]
  int kv_slots;
  Element* o;
  int64_t o_sb, o_ss, o_sh;
  float* lse;
  float scale_log2, scale;
  const FmhaPair* pairs;
  int n_pairs, n_items;
  FmhaPair single;
  FmhaSlots slot_info;
  float* o_acc;
  float* lse_acc;
  uint64_t* seq;
  int* item_counter;  // non-null: dynamic schedule (zeroed by the launch)
  // Packed variable-length sequences (varlen.cuh): n_items = virtual tiles * H; cu_in_smem: the
  // CTA copies the n_docs + 1 entries into shared memory after Shared.
  const int32_t* cu_seqlens;
  int n_docs, cu_in_smem;
  const DocWindow* doc_win;  // packed documents by global position (FmhaLaunch::doc_win), or null
  WaitCtx wait;       // arrival waits and the merge order (the program's wait context)
  TraceBuffer trace;  // traced variant only
  typename Comm_::Params comm;
};

// Accumulator layout ((2, 2, V), M, N) -> (rows, cols) = ((2, M), (2, V, N)).
template <class L>
__device__ __forceinline__ auto rowcol(L l) {
  auto l0 = get<0>(l);
  return make_layout(make_layout(get<1>(l0), get<1>(l)), make_layout(get<0>(l0), get<2>(l0), get<2>(l)));
}
// Accumulator layout ((2, 2, V), M, N) -> the A-operand register layout ((2, 2, 2), M, V / 2 * N)
// of a k16 WGMMA: columns 16k .. 16k + 15 of S are the k-th slice of P.
template <class L>
__device__ __forceinline__ auto acc_to_a(L l) {
  auto l0 = get<0>(l);
  auto v = logical_divide(get<2>(l0), _2{});  // (2, V / 2)
  return make_layout(make_layout(get<0>(l0), get<1>(l0), get<0>(v)), get<1>(l), make_layout(get<1>(v), get<2>(l)));
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
