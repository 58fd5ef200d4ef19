// mkernel — the persistent sm_90a attention forward kernel. It only composes: the work items and
// their schedule (scheduler.cuh), the mainloop (mainloop.cuh: TMA producer, WGMMA consumers),
// the online softmax (softmax.cuh), the epilogue with the ring's merge (epilogue.cuh) and a
// communication-role policy (src/comm/comm_role.cuh: NoComm for plain launches, CommRole for
// ring attention, whose first dedicated CTAs run the communication program).
//
// CTA: 3 warpgroups. Warpgroup 0 is the producer (one thread issues the TMA loads; it drops to
// 24 registers). Warpgroups 1 and 2 (240 registers) each own 64 of the tile's 128 query rows.
// kTrace_: records one "compute" event per item, a "wait" event when the producer waited for a
// ring block's arrival, and one event per communication op; the untraced variant has no tracing
// code. Instantiated by the units sm90_fmha_d{64,128}{,_comm}.cu (launch.cuh).
#pragma once

#include <cstdint>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "mkernel/device/trace.cuh"
#include "src/attention/kernel/config.cuh"
#include "src/attention/kernel/epilogue.cuh"
#include "src/attention/kernel/mainloop.cuh"
#include "src/attention/kernel/scheduler.cuh"
#include "src/attention/kernel/softmax.cuh"
#include "src/comm/comm_role.cuh"

namespace mk {
namespace attention {
namespace sm90 {

// The consumer warpgroups: per item the mainloop's MMAs and softmax, then the epilogue.
template <bool kTrace_, int kD, class Comm_, class Sched_>
__device__ __forceinline__ void fmha_consume(const Params<kD, Comm_>& p, typename Cfg<kD>::Shared& sh,
                                             typename Cfg<kD>::PipeQ& pipe_q, typename Cfg<kD>::PipeKV& pipe_k,
                                             typename Cfg<kD>::PipeKV& pipe_v, const Sched_& sched, int wg, int lane,
                                             const int32_t* cu) {
  using C = Cfg<kD>;
  constexpr int kBlockN = C::kBlockN;
  const int mma_tid = threadIdx.x - 128;
  const int wg_c = wg - 1;  // rows [64 wg_c, 64 wg_c + 64) of the tile
  Tensor sQ = make_tensor(make_smem_ptr(sh.q.data()), typename C::SmemQ{});
  Tensor sK = make_tensor(make_smem_ptr(sh.k.data()), typename C::SmemK{});
  Tensor sVt = make_tensor(make_smem_ptr(sh.v.data()), typename C::SmemVt{});
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
  for (int item = sched.consumer_next(-1, cs); item < p.n_items; item = sched.consumer_next(item, cs)) {
    [[maybe_unused]] uint64_t t_item = 0;
    if constexpr (kTrace_) t_item = device::trace_now_ns();
    const ItemInfo it = item_info(p, item, cu);
    const FmhaPair& pr = *it.pair;
    const KvSpan span = kv_span(p, it, kBlockN);
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<C::kBlockM>, Int<kD>>{});
    Tensor tOrO_rc = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
    constexpr int kRows = decltype(size<0>(tOrO_rc))::value;  // 2
    RowDocs<kRows, Comm_::kEnabled> docs;
    if constexpr (Comm_::kEnabled) {
      // Packed documents by position: each row's document window in the segment's key columns
      // (rows past the segment take the last row's; they are not stored).
      docs.on = p.doc_win != nullptr && span.n > 0;
      if (docs.on) {
        const int last = min(kTileM, it.q_len - it.qt * kTileM) - 1;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int64_t qpos = pr.q_pos0 + int64_t(it.qt) * kTileM + min(int(get<0>(cS_rc(r, 0))), last);
          const DocWindow w = p.doc_win[qpos];
          docs.lo[r] = int(int64_t(w.lo) - pr.kv_pos0);
          docs.hi[r] = int((pr.causal ? qpos + 1 : int64_t(w.hi)) - pr.kv_pos0);
        }
      }
    }
    OnlineSoftmax<kRows> softmax;
    softmax.reset();
    clear(tOrO);
    if (span.n > 0)
      fmha_mma<kD>(mma_qk, mma_pv, tSrQ, tSrK, tOrV, cS_rc, pipe_q, cq, pipe_k, ck, pipe_v, cv, tOrO, tOrO_rc, softmax,
                   pr, it.kv_len, it.qt, span.j0, span.n, wg_c, sl2, docs);
    float lse[kRows];
    softmax.finish(tOrO_rc, sl2, lse);
    store_item(p, tOrO_rc, cO_rc, lse, it, wg_c, mma_tid, lane, span.n == 0);
    if constexpr (kTrace_)
      if (mma_tid == 0) device::trace_record(p.trace, Role::kCompute, item, t_item);
  }
}

template <int kD, bool kTrace_, class Comm_>
__global__ void __launch_bounds__(kThreads, 1) fmha_kernel(__grid_constant__ const Params<kD, Comm_> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Cfg<kD>;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sh = *reinterpret_cast<typename C::Shared*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % 4;
  const int lane = threadIdx.x % 32;
  const uint64_t epoch = Comm_::call_epoch(p.comm);

  // Dedicated communication CTAs: the consumer threads run the program's ops in order. The same
  // register budgets as the compute CTAs: a function called out of line from warps with
  // different budgets would not allocate.
  if (Comm_::dedicated_cta(p.comm)) {
    if (wg == 0) cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (wg >= 1) {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      Comm_::template run_dedicated<kTrace_, kMmaThreads, kCommBarrier, sizeof(typename C::Shared)>(
          p.comm, smem_raw, threadIdx.x - 128, epoch, p.trace);
    }
    Comm_::finish(p.comm);
    return;
  }

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
  pk.transaction_bytes = C::kBlockN * kD * sizeof(Element);
  typename C::PipeQ pipe_q(sh.pipe_q, pq, Shape<_1, _1, _1>{});
  typename C::PipeKV pipe_k(sh.pipe_k, pk, Shape<_1, _1, _1>{});
  typename C::PipeKV pipe_v(sh.pipe_v, pk, Shape<_1, _1, _1>{});
  typename C::PipeSched::Params ps;
  if (wg == 0 && warp_in_wg == 0) ps.role = C::PipeSched::ThreadCategory::Producer;
  if (wg >= 1) ps.role = C::PipeSched::ThreadCategory::Consumer;
  ps.producer_arv_count = 1;
  ps.consumer_arv_count = kMmaThreads;
  typename C::PipeSched pipe_s(sh.pipe_s, ps);
  const int comm_ctas = Comm_::dedicated_ctas(p.comm);
  const FmhaScheduler<typename C::PipeSched> sched{p.item_counter != nullptr, int(blockIdx.x) - comm_ctas,
                                                   int(gridDim.x) - comm_ctas, p.item_counter, pipe_s, sh.sched};
  // Packed variable-length launches: cu_seqlens in shared memory (after Shared) when it fits.
  int32_t* cu_smem = reinterpret_cast<int32_t*>(&sh + 1);
  if (p.cu_in_smem)
    for (int i = threadIdx.x; i <= p.n_docs; i += kThreads) cu_smem[i] = p.cu_seqlens[i];
  const int32_t* cu = p.cu_in_smem ? cu_smem : p.cu_seqlens;
  __syncthreads();

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0 && elect_one_sync()) fmha_produce<kTrace_>(p, sh, pipe_q, pipe_k, pipe_v, sched, epoch, cu);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    fmha_consume<kTrace_>(p, sh, pipe_q, pipe_k, pipe_v, sched, wg, lane, cu);
  }
  Comm_::finish(p.comm);
#endif
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
