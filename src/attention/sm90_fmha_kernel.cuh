// The persistent sm_90a attention forward (CuTe: TMA loads, WGMMA, warp-specialized producer and
// consumers, online softmax in registers). Included by the instantiation units
// sm90_fmha_d64.cu and sm90_fmha_d128.cu, so that they compile in parallel.
//
// CTA: 3 warpgroups. Warpgroup 0 is the producer (one warp issues TMA loads of Q, K, V tiles;
// it also waits, bounded, for ring blocks to arrive). Warpgroups 1 and 2 each own 64 of the
// tile's 128 query rows: S = Q·Kᵀ by WGMMA from shared memory, the online softmax in registers,
// then O += P·V with P taken straight from registers (the accumulator layout of S is the
// A-operand layout of the next WGMMA). Inside a warpgroup the next tile's Q·Kᵀ runs on the tensor
// cores while the softmax of the current tile runs on the FMA/MUFU units. (Turn taking between
// the two warpgroups, as FlashAttention-3 does, measured 0-2 % slower here: docs/attention.md.)
// In the ring operator the first comm_ctas CTAs run the communication program instead.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/epoch.cuh"
#include "mkernel/device/signal.cuh"
#include "mkernel/device/trace.cuh"
#include "src/attention/fmha_launch.h"
#include "src/comm/executor.cuh"

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
// Named barriers 4 + w: consumer warpgroup w's merge order.

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
  // consumers through a two-slot ring.
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

template <int kD>
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
  ops::FusedHooks hooks;
  int comm_ctas;
  int* item_counter;  // non-null: dynamic schedule (zeroed by the launch)
  WaitCtx wait;  // arrival waits (also used for the merge order)
  TraceBuffer trace;  // traced variant only
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

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

struct ItemInfo {
  const FmhaPair* pair;
  int b, h, qt;  // batch, head, query tile within the pair's segment
};

template <int kD>
__device__ __forceinline__ ItemInfo item_info(const Params<kD>& p, int item) {
  const FmhaPair* pr = &p.single;
  if (p.pairs) {
    int lo = 0;
    while (lo + 1 < p.n_pairs && p.pairs[lo + 1].item0 <= item) ++lo;
    pr = p.pairs + lo;
  }
  const int w = item - pr->item0;
  const int qtiles = (pr->q_len + kTileM - 1) / kTileM;
  const int bh = w / qtiles;
  int qt = w % qtiles;
  // Causal: a head's longest tiles first (they see the most keys).
  if (pr->causal) qt = qtiles - 1 - qt;
  return ItemInfo{pr, bh / p.H, bh % p.H, qt};
}

// Key tiles an item visits: all of the segment, or up to the last visible key when causal.
__device__ __forceinline__ int kv_tiles_of(const FmhaPair& pr, int qt, int block_n) {
  int n = (pr.kv_len + block_n - 1) / block_n;
  if (pr.causal) {
    const int q_last = min(pr.q_len, (qt + 1) * kTileM) - 1;
    const int64_t last_key = pr.q_pos0 + q_last - pr.kv_pos0;  // last visible key row
    if (last_key < 0) return 0;
    n = min<int64_t>(n, last_key / block_n + 1);
  }
  return n;
}

// The persistent kernel.
// kTrace: records one "compute" event per item, a "wait" event when the producer waited for a
// ring block's arrival, and one event per communication op; the untraced variant has no
// tracing code.
template <int kD, bool kTrace>
__global__ void __launch_bounds__(kThreads, 1) fmha_kernel(__grid_constant__ const Params<kD> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Cfg<kD>;
  constexpr int kBlockN = C::kBlockN;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sh = *reinterpret_cast<typename C::Shared*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % 4;
  const int lane = threadIdx.x % 32;
  const uint64_t epoch = p.hooks.epoch ? device::epoch_of_call(p.hooks.epoch) : 0;

  // Communication CTAs: the consumer threads run the program's ops in order.
  if (int(blockIdx.x) < p.comm_ctas) {
    // The same register budgets as the compute CTAs: a function called out of line from warps
    // with different budgets would not allocate.
    if (wg == 0) cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (wg >= 1) {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      __shared__ int op_slot;
      const int tid = threadIdx.x - 128;
      // The compute CTAs' Q/K/V buffers serve as bulk-copy stages here (16 KiB each, then
      // their mbarriers).
      constexpr uint32_t kStageBytes = 16384;
      constexpr int kCopyStages = int(cute::min(size_t(8), (sizeof(typename C::Shared) - 1024) / kStageBytes));
      static_assert(kCopyStages >= 2, "bulk-copy stages must fit the kernel's shared memory");
      ops::BulkStages stages{smem_raw, reinterpret_cast<uint64_t*>(smem_raw + kCopyStages * kStageBytes), kCopyStages,
                             kStageBytes, 0};
      if (tid == 0) ops::bulk_stages_init(stages);
      for (;;) {
        if (tid == 0) op_slot = atomicAdd(p.hooks.op_counter, 1);
        cutlass::arch::NamedBarrier::sync(kMmaThreads, kCommBarrier);
        const int op = op_slot;
        cutlass::arch::NamedBarrier::sync(kMmaThreads, kCommBarrier);
        if (op >= p.hooks.n_ops) break;
        [[maybe_unused]] uint64_t t0 = 0;
        if constexpr (kTrace) t0 = device::trace_now_ns();
        ops::run_comm_op_staged<kMmaThreads, kCommBarrier>(p.hooks, op, tid, epoch, stages);
        if constexpr (kTrace)
          if (tid == 0)
            device::trace_record(p.trace, p.hooks.ops[op].kind == ops::kDevNetPut ? Role::kNetSend : Role::kComm, op, t0);
      }
    }
    if (p.hooks.epoch) device::epoch_finish(p.hooks.epoch, gridDim.x);
    return;
  }
  const int cta = blockIdx.x - p.comm_ctas;
  const int ncta = gridDim.x - p.comm_ctas;

  typename C::PipeQ::Params pq;
  typename C::PipeKV::Params pk;
  if (wg == 0 && warp_in_wg == 0) {
    pq.role = C::PipeQ::ThreadCategory::Producer;
    pk.role = C::PipeKV::ThreadCategory::Producer;
  }
  if (wg >= 1) {
    pq.role = C::PipeQ::ThreadCategory::Consumer;
    pk.role = C::PipeKV::ThreadCategory::Consumer;
  }
  pq.is_leader = pk.is_leader = (threadIdx.x % 128) == 0;
  pq.num_consumers = pk.num_consumers = kMmaThreads;
  pq.transaction_bytes = C::kBlockM * kD * sizeof(Element);
  pk.transaction_bytes = kBlockN * kD * sizeof(Element);
  typename C::PipeQ pipe_q(sh.pipe_q, pq, Shape<_1, _1, _1>{});
  typename C::PipeKV pipe_k(sh.pipe_k, pk, Shape<_1, _1, _1>{});
  typename C::PipeKV pipe_v(sh.pipe_v, pk, Shape<_1, _1, _1>{});
  typename C::PipeSched::Params ps;
  if (wg == 0 && warp_in_wg == 0) ps.role = C::PipeSched::ThreadCategory::Producer;
  if (wg >= 1) ps.role = C::PipeSched::ThreadCategory::Consumer;
  ps.producer_arv_count = 1;
  ps.consumer_arv_count = kMmaThreads;
  typename C::PipeSched pipe_s(sh.pipe_s, ps);
  const bool dynamic = p.item_counter != nullptr;
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(sh.q.data()), typename C::SmemQ{});
  Tensor sK = make_tensor(make_smem_ptr(sh.k.data()), typename C::SmemK{});
  Tensor sVt = make_tensor(make_smem_ptr(sh.v.data()), typename C::SmemVt{});

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0 && elect_one_sync()) {
    auto sq = cutlass::make_producer_start_state<typename C::PipeQ>();
    // Ring arrivals this producer has seen in this call: chunks (bit c < 64) of (slot, batch)
    // arrived_key. An arrival stays true for the rest of the call, so each chunk is polled once
    // per run of items on the same slot and batch instead of once per key tile (a system-scope
    // poll and proxy fence cost about a key tile's compute time).
    uint64_t arrived_mask = 0;
    int arrived_key = -1;
    auto sk = cutlass::make_producer_start_state<typename C::PipeKV>();
    auto sv = cutlass::make_producer_start_state<typename C::PipeKV>();
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.Sq, kD, p.H, p.B));
    Tensor sV = make_tensor(make_smem_ptr(sh.v.data()), typename C::SmemK{});
    auto ss = cutlass::make_producer_start_state<typename C::PipeSched>();
    // Dynamic: items in counter order, published to the consumers (the end too).
    auto take = [&](int prev) {
      if (!dynamic) return prev < 0 ? cta : prev + ncta;
      pipe_s.producer_acquire(ss);
      const int item = atomicAdd(p.item_counter, 1);
      sh.sched[ss.index()] = item;
      pipe_s.producer_commit(ss);
      ++ss;
      return item;
    };
    for (int item = take(-1); item < p.n_items; item = take(item)) {
      const ItemInfo it = item_info(p, item);
      const FmhaPair& pr = *it.pair;
      const int nkv = kv_tiles_of(pr, it.qt, kBlockN);
      if (nkv == 0) continue;
      const int src = pr.kv_src;
      const int hk = it.h / (p.H / p.Hkv);
      // Q tile
      pipe_q.producer_acquire(sq);
      {
        Tensor gQ = local_tile(domain_offset(make_coord(pr.q_row0, 0), mQ(_, _, it.h, it.b)),
                               Shape<Int<C::kBlockM>, Int<kD>>{}, make_coord(it.qt, 0));
        auto cta_q = p.tma_q.get_slice(0);
        copy(p.tma_q.with(*pipe_q.producer_get_barrier(sq)), cta_q.partition_S(gQ), cta_q.partition_D(sQ));
      }
      ++sq;
      // The slot and local descriptors are separate parameters: index them with constants so
      // TMA reads them from parameter space.
      auto load_item = [&](const auto& tma_k, const auto& tma_v) {
      Tensor mK = tma_k.get_tma_tensor(make_shape(p.kv_rows[src], kD, p.Hkv, p.B, src ? p.kv_slots : 1));
      Tensor mV = tma_v.get_tma_tensor(make_shape(p.kv_rows[src], kD, p.Hkv, p.B, src ? p.kv_slots : 1));
      const int slot = src ? pr.kv_slot : 0;
      Tensor gK = local_tile(domain_offset(make_coord(pr.kv_row0, 0), mK(_, _, hk, it.b, slot)),
                             Shape<Int<kBlockN>, Int<kD>>{}, make_coord(_, 0));  // (BN, D, tiles)
      Tensor gV = local_tile(domain_offset(make_coord(pr.kv_row0, 0), mV(_, _, hk, it.b, slot)),
                             Shape<Int<kBlockN>, Int<kD>>{}, make_coord(_, 0));
      auto cta_k = tma_k.get_slice(0);
      auto cta_v = tma_v.get_slice(0);
      Tensor tKg = cta_k.partition_S(gK);
      Tensor tKs = cta_k.partition_D(sK);
      Tensor tVg = cta_v.partition_S(gV);
      Tensor tVs = cta_v.partition_D(sV);
      // Ring blocks: wait (bounded) until the key rows of tile j have arrived, then order the
      // peers' generic-proxy stores before this CTA's TMA reads.
      auto arrive_wait = [&](int j) {
        if (!pr.wait) return;
        [[maybe_unused]] uint64_t t0 = 0;
        if constexpr (kTrace) t0 = device::trace_now_ns();
        const int cr = p.slot_info.chunk_rows;
        const int r0 = pr.kv_row0 + j * kBlockN, r1 = pr.kv_row0 + min(pr.kv_len, (j + 1) * kBlockN) - 1;
        const int key = pr.kv_slot * p.B + it.b;
        if (key != arrived_key) {
          arrived_key = key;
          arrived_mask = 0;
        }
        bool polled = false;
        for (int c = r0 / cr; c <= r1 / cr; ++c) {
          if (c < 64 && ((arrived_mask >> c) & 1u)) continue;
          const int idx = key * p.slot_info.chunks + c;
          device::wait_ge<true>(p.wait, p.slot_info.flags + idx, p.slot_info.wait_mul * epoch, pr.kv_slot, idx);
          if (c < 64) arrived_mask |= uint64_t(1) << c;
          polled = true;
        }
        if (!polled) return;
        // Orders the peers' stores, acquired above, before this thread's later TMA reads.
        asm volatile("fence.proxy.async.global;" ::: "memory");
        if constexpr (kTrace)
          if (device::trace_now_ns() - t0 > 5000) device::trace_record(p.trace, Role::kWait, item, t0);
      };
      auto load_k = [&](int j) {
        pipe_k.producer_acquire(sk);
        copy(tma_k.with(*pipe_k.producer_get_barrier(sk)), tKg(_, _, _, j), tKs(_, _, _, sk.index()));
        ++sk;
      };
      auto load_v = [&](int j) {
        pipe_v.producer_acquire(sv);
        copy(tma_v.with(*pipe_v.producer_get_barrier(sv)), tVg(_, _, _, j), tVs(_, _, _, sv.index()));
        ++sv;
      };
      // Tiles are visited from the last to the first: the causal diagonal (masked) comes first.
      arrive_wait(nkv - 1);
      load_k(nkv - 1);
      for (int j = nkv - 2; j >= 0; --j) {
        arrive_wait(j);
        load_k(j);
        load_v(j + 1);
      }
      load_v(0);
      };
      if (src) load_item(p.tma_k[1], p.tma_v[1]);
      else load_item(p.tma_k[0], p.tma_v[0]);
    }
    }
  } else {
  // ---- consumers ----
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int mma_tid = threadIdx.x - 128;
  const int wg_c = wg - 1;  // rows [64 wg_c, 64 wg_c + 64) of the tile
  typename C::MmaQK mma_qk;
  typename C::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(mma_tid);
  auto thr_pv = mma_pv.get_thread_slice(mma_tid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
  Tensor tSrK = thr_qk.partition_fragment_B(sK);
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<C::kBlockM>, Int<kBlockN>>{}));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<C::kBlockM>, Int<kD>>{}));
  Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor cO_rc = make_tensor(cO.data(), rowcol(cO.layout()));
  auto cq = cutlass::PipelineState<1>();
  auto ck = cutlass::PipelineState<C::kStages>();
  auto cv = cutlass::PipelineState<C::kStages>();
  const float sl2 = p.scale_log2;

  auto cs = cutlass::PipelineState<2>();
  auto take = [&](int prev) {
    if (!dynamic) return prev < 0 ? cta : prev + ncta;
    pipe_s.consumer_wait(cs);
    const int item = sh.sched[cs.index()];
    pipe_s.consumer_release(cs);
    ++cs;
    return item;
  };
  for (int item = take(-1); item < p.n_items; item = take(item)) {
    [[maybe_unused]] uint64_t t_item = 0;
    if constexpr (kTrace) t_item = device::trace_now_ns();
    auto item_done = [&]() {
      if constexpr (kTrace)
        if (mma_tid == 0) device::trace_record(p.trace, Role::kCompute, item, t_item);
    };
    const ItemInfo it = item_info(p, item);
    const FmhaPair& pr = *it.pair;
    const int nkv = kv_tiles_of(pr, it.qt, kBlockN);
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<C::kBlockM>, Int<kD>>{});
    Tensor tOrO_rc = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
    constexpr int kRows = decltype(size<0>(tOrO_rc))::value;  // 2
    float row_max[kRows], row_sum[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
    clear(tOrO);
    if (nkv > 0) {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<C::kBlockM>, Int<kBlockN>>{});
      Tensor tSrS_rc = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
      Tensor tOrP = make_tensor<Element>(acc_to_a(tSrS.layout()));
      const int64_t q_pos_base = pr.q_pos0 + int64_t(it.qt) * kTileM;  // global position of tile row 0
      // Masks tile j in place: keys past the segment and (causal) keys after the query.
      auto mask = [&](int j) {
        const int col0 = j * kBlockN;
        const bool tail = col0 + kBlockN > pr.kv_len;
        const bool diag = pr.causal && pr.kv_pos0 + col0 + kBlockN - 1 > q_pos_base + wg_c * 64;
        if (!tail && !diag) return;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < size<0>(tSrS_rc); ++r) {
          const int64_t qpos = q_pos_base + get<0>(cS_rc(r, 0));
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(tSrS_rc); ++c) {
            const int col = col0 + get<1>(cS_rc(r, c));
            if (col >= pr.kv_len || (pr.causal && pr.kv_pos0 + col > qpos)) tSrS_rc(r, c) = -INFINITY;
          }
        }
      };
      // Online softmax over tile S (in place -> exponentials); returns per-row rescale factors.
      auto softmax = [&](float (&rescale)[kRows]) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          float m = row_max[r];
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(tSrS_rc); ++c) m = fmaxf(m, tSrS_rc(r, c));
          m = quad_max(m);
          const float m_use = m == -INFINITY ? 0.f : m;  // a row that saw no key yet
          rescale[r] = exp2f((row_max[r] - m_use) * sl2);
          row_max[r] = m;
          const float off = m_use * sl2;
          float s = 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(tSrS_rc); ++c) {
            const float e = exp2f(fmaf(tSrS_rc(r, c), sl2, -off));
            tSrS_rc(r, c) = e;
            s += e;
          }
          row_sum[r] = row_sum[r] * rescale[r] + s;
        }
      };
      auto to_p = [&]() {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); i += 2) {
          __nv_bfloat162 v = __floats2bfloat162_rn(tSrS(i), tSrS(i + 1));
          tOrP(i) = Element::bitcast(reinterpret_cast<uint16_t*>(&v)[0]);
          tOrP(i + 1) = Element::bitcast(reinterpret_cast<uint16_t*>(&v)[1]);
        }
      };
      auto qk = [&](int stage) {
        warpgroup_fence_operand(tSrS);
        warpgroup_arrive();
        mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < size<2>(tSrQ); ++k) {
          cute::gemm(mma_qk, tSrQ(_, _, k), tSrK(_, _, k, stage), tSrS);
          mma_qk.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_fence_operand(tSrS);
      };
      auto pv = [&](int stage) {
        warpgroup_fence_operand(tOrO);
        warpgroup_arrive();
        mma_pv.accumulate_ = GMMA::ScaleOut::One;
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < size<2>(tOrP); ++k) cute::gemm(mma_pv, tOrP(_, _, k), tOrV(_, _, k, stage), tOrO);
        warpgroup_commit_batch();
        warpgroup_fence_operand(tOrO);
      };

      pipe_q.consumer_wait(cq);
      // First (last-numbered) key tile.
      int j = nkv - 1;
      pipe_k.consumer_wait(ck);
      qk(ck.index());
      warpgroup_wait<0>();
      pipe_k.consumer_release(ck);
      ++ck;
      mask(j);
      {
        float rs[kRows];
        softmax(rs);
      }
      to_p();
      for (--j; j >= 0; --j) {
        pipe_k.consumer_wait(ck);
        qk(ck.index());
        pipe_v.consumer_wait(cv);
        pv(cv.index());
        warpgroup_wait<1>();  // S ready; P·V still running
        pipe_k.consumer_release(ck);
        ++ck;
        mask(j);
        float rs[kRows];
        softmax(rs);
        warpgroup_wait<0>();
        pipe_v.consumer_release(cv);
        ++cv;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r)
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(tOrO_rc); ++c) tOrO_rc(r, c) *= rs[r];
        to_p();
      }
      pipe_q.consumer_release(cq);
      ++cq;
      pipe_v.consumer_wait(cv);
      pv(cv.index());
      warpgroup_wait<0>();
      pipe_v.consumer_release(cv);
      ++cv;
    }

    // ---- epilogue: normalize, merge (ring), store ----
    float lse[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float l = quad_sum(row_sum[r]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      lse[r] = l > 0.f ? (row_max[r] * sl2 + __log2f(l)) * 0.69314718055994530942f : -INFINITY;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(tOrO_rc); ++c) tOrO_rc(r, c) *= inv;
    }
    const bool last = pr.ordinal == pr.total - 1;
    const int rows_here = min(kTileM, pr.q_len - it.qt * kTileM);
    const int64_t row_base = int64_t(pr.q_row0) + int64_t(it.qt) * kTileM;  // local row of tile row 0
    if (pr.total > 1) {
      // Merge with the previous pairs of this query segment, in ordinal order.
      const int cnt = pr.seq_base + (((it.b * p.H + it.h) * ((pr.q_len + kTileM - 1) / kTileM) + it.qt) * 2 + wg_c);
      if (pr.ordinal > 0) {
        if ((mma_tid % 128) == 0) {
          const uint64_t* f = p.seq + cnt;
          device::wait_ge(p.wait, f, uint64_t(pr.ordinal), -1, cnt);
        }
        cutlass::arch::NamedBarrier::sync(128, 4 + wg_c);
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = get<0>(cO_rc(r, 0));
          if (row >= rows_here) continue;
          const int64_t bhs = (int64_t(it.b) * p.H + it.h) * p.Sq + row_base + row;
          const float la = p.lse_acc[bhs];
          const float lm = fmaxf(la, lse[r]);
          const float lmu = lm == -INFINITY ? 0.f : lm;
          const float wa = __expf(la - lmu), wb = __expf(lse[r] - lmu);
          const float sum = wa + wb;
          const float lnew = sum > 0.f ? lmu + __logf(sum) : -INFINITY;
          const float fa = sum > 0.f ? wa / sum : 0.f, fb = sum > 0.f ? wb / sum : 0.f;
          const float* acc = p.o_acc + bhs * kD;
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(tOrO_rc); c += 2) {
            const int col = get<1>(cO_rc(r, c));
            const float2 a = *reinterpret_cast<const float2*>(acc + col);
            tOrO_rc(r, c) = a.x * fa + tOrO_rc(r, c) * fb;
            tOrO_rc(r, c + 1) = a.y * fa + tOrO_rc(r, c + 1) * fb;
          }
          lse[r] = lnew;
        }
      }
      if (!last) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = get<0>(cO_rc(r, 0));
          if (row >= rows_here) continue;
          const int64_t bhs = (int64_t(it.b) * p.H + it.h) * p.Sq + row_base + row;
          float* acc = p.o_acc + bhs * kD;
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(tOrO_rc); c += 2) {
            const int col = get<1>(cO_rc(r, c));
            *reinterpret_cast<float2*>(acc + col) = make_float2(tOrO_rc(r, c), tOrO_rc(r, c + 1));
          }
          if ((lane & 3) == 0) p.lse_acc[bhs] = lse[r];
        }
        __threadfence();
        cutlass::arch::NamedBarrier::sync(128, 4 + wg_c);
        if ((mma_tid % 128) == 0)
          device::red_add_release_sys(p.seq + cnt, 1);
        item_done();
        continue;
      }
    }
    // Final: bf16 O and the LSE.
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(cO_rc(r, 0));
      if (row >= rows_here) continue;
      const int64_t srow = row_base + row;
      Element* out = p.o + it.b * p.o_sb + srow * p.o_ss + it.h * p.o_sh;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(tOrO_rc); c += 2) {
        const int col = get<1>(cO_rc(r, c));
        __nv_bfloat162 v = __floats2bfloat162_rn(tOrO_rc(r, c), tOrO_rc(r, c + 1));
        *reinterpret_cast<__nv_bfloat162*>(out + col) = v;
      }
      if (p.lse && (lane & 3) == 0) p.lse[(int64_t(it.b) * p.H + it.h) * p.Sq + srow] = lse[r];
    }
    item_done();
  }
  }
  if (p.hooks.epoch) device::epoch_finish(p.hooks.epoch, gridDim.x);
#endif
}

// ---- host ----

template <int kD>
typename Cfg<kD>::TmaQ make_tma_q(const void* ptr, int S, int H, int B, const Strides& st) {
  using C = Cfg<kD>;
  auto t = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       make_layout(make_shape(S, kD, H, B), make_stride(st.s, _1{}, st.h, st.b)));
  return make_tma_copy(SM90_TMA_LOAD{}, t, typename C::SmemQ{});
}
template <int kD>
typename Cfg<kD>::TmaKV make_tma_kv(const void* ptr, int S, int Hkv, int B, int slots, const Strides& st,
                                    int64_t slot_stride) {
  using C = Cfg<kD>;
  auto t = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       make_layout(make_shape(S, kD, Hkv, B, slots), make_stride(st.s, _1{}, st.h, st.b, slot_stride)));
  return make_tma_copy(SM90_TMA_LOAD{}, t, take<0, 2>(typename C::SmemK{}));
}

template <int kD, bool kTrace>
Status launch(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid) {
  using C = Cfg<kD>;
  Params<kD> p{};
  p.tma_q = make_tma_q<kD>(a.q, a.Sq, a.H, a.B, a.q_stride);
  p.tma_k[0] = make_tma_kv<kD>(a.k, a.Skv, a.Hkv, a.B, 1, a.k_stride, 0);
  p.tma_v[0] = make_tma_kv<kD>(a.v, a.Skv, a.Hkv, a.B, 1, a.v_stride, 0);
  const FmhaSlots& s = l.slots;
  if (s.k) {
    const Strides ss = Strides::bshd(s.rows, a.Hkv, kD);
    const int64_t slot_stride = int64_t(a.B) * s.rows * a.Hkv * kD;
    p.tma_k[1] = make_tma_kv<kD>(s.k, s.rows, a.Hkv, a.B, s.slots, ss, slot_stride);
    p.tma_v[1] = make_tma_kv<kD>(s.v, s.rows, a.Hkv, a.B, s.slots, ss, slot_stride);
  } else {
    p.tma_k[1] = p.tma_k[0];
    p.tma_v[1] = p.tma_v[0];
  }
  p.B = a.B, p.H = a.H, p.Hkv = a.Hkv, p.Sq = a.Sq;
  p.kv_rows[0] = a.Skv;
  p.kv_rows[1] = s.k ? s.rows : a.Skv;
  p.kv_slots = s.k ? s.slots : 1;
  p.o = static_cast<Element*>(a.o);
  p.o_sb = a.o_stride.b, p.o_ss = a.o_stride.s, p.o_sh = a.o_stride.h;
  p.lse = a.lse;
  const float scale = a.scale > 0.f ? a.scale : 1.f / std::sqrt(float(a.D));
  p.scale = scale;
  p.scale_log2 = scale * 1.44269504088896340736f;
  p.pairs = l.pairs;
  p.n_pairs = l.n_pairs;
  p.single = l.single;
  p.n_items = l.n_items;
  p.slot_info = s;
  p.o_acc = l.o_acc;
  p.lse_acc = l.lse_acc;
  p.seq = l.seq;
  p.hooks = l.hooks;
  p.comm_ctas = l.comm_ctas;
  p.item_counter = l.item_counter;
  p.wait = l.hooks.wait;
  if constexpr (kTrace) p.trace = *l.trace;
  if (l.item_counter) MK_CUDA_CHECK(cudaMemsetAsync(l.item_counter, 0, sizeof(int), stream));
  if (l.seq && l.n_seq && l.reset_seq) MK_CUDA_CHECK(cudaMemsetAsync(l.seq, 0, size_t(l.n_seq) * 8, stream));
  if (l.hooks.op_counter) MK_CUDA_CHECK(cudaMemsetAsync(l.hooks.op_counter, 0, sizeof(int), stream));
  const int smem = int(sizeof(typename C::Shared));
  auto kernel = fmha_kernel<kD, kTrace>;
  MK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

// One instantiation unit's entry: the traced or untraced kernel for head dimension kD.
template <int kD>
Status launch_variant(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid) {
  return l.trace ? launch<kD, true>(a, l, stream, grid) : launch<kD, false>(a, l, stream, grid);
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
