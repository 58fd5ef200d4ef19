// mkernel — the attention forward's mainloop, per work item.
//
// Producer (one thread of warpgroup 0): TMA loads of the item's Q tile (128 rows) and of its K
// and V tiles (128 rows each, 2 stages), key tiles from the last (the masked causal diagonal)
// to the first. Before a key tile of a ring block it calls the communication role's arrival
// wait (comm_role.cuh).
//
// Consumers (warpgroups 1 and 2, 64 query rows each): S = Q·Kᵀ by WGMMA from shared memory,
// the mask and online softmax in registers (softmax.cuh), then O += P·V with P straight from
// registers (the accumulator layout of S is the A-operand layout of the next WGMMA). Within a
// warpgroup the next tile's Q·Kᵀ is issued before the current softmax, so tensor cores and
// FMA/MUFU units overlap. (Turn taking between the two warpgroups, as FlashAttention-3 does,
// measured 0-2 % slower here: docs/attention.md.)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mkernel/device/trace.cuh"
#include "src/attention/kernel/config.cuh"
#include "src/attention/kernel/scheduler.cuh"
#include "src/attention/kernel/softmax.cuh"

namespace mk {
namespace attention {
namespace sm90 {

// Ring arrivals the producer has seen in this call: chunks (bit c < 64) of (slot, batch) `key`.
// An arrival stays true for the rest of the call, so each chunk is polled once per run of items
// on the same slot and batch instead of once per key tile (a system-scope poll and proxy fence
// cost about a key tile's compute time).
struct ArrivalCache {
  uint64_t mask = 0;
  int key = -1;
};

// Before loading key tile j of a ring block (pr.wait): waits (bounded) until the tile's key rows
// have arrived, then orders the peers' generic-proxy stores, acquired by the wait, before this
// thread's later TMA reads. Plain launches (NoComm) have no ring blocks.
template <bool kTrace_, int kBlockN_, int kD, class Comm_>
__device__ __forceinline__ void wait_kv_arrival(const Params<kD, Comm_>& p, ArrivalCache& seen, const FmhaPair& pr,
                                                const ItemInfo& it, int j, int item, uint64_t epoch) {
  if constexpr (Comm_::kEnabled) {
    if (!pr.wait) return;
    [[maybe_unused]] uint64_t t0 = 0;
    if constexpr (kTrace_) t0 = device::trace_now_ns();
    const int cr = p.slot_info.chunk_rows;
    const int r0 = it.kv_row0 + j * kBlockN_, r1 = it.kv_row0 + min(it.kv_len, (j + 1) * kBlockN_) - 1;
    const int key = pr.kv_slot * p.B + it.b;
    if (key != seen.key) {
      seen.key = key;
      seen.mask = 0;
    }
    bool polled = false;
    for (int c = r0 / cr; c <= r1 / cr; ++c) {
      if (c < 64 && ((seen.mask >> c) & 1u)) continue;
      const int idx = key * p.slot_info.chunks + c;
      Comm_::wait_arrival(p.wait, p.slot_info.flags + idx, p.slot_info.wait_mul * epoch, pr.kv_slot, idx);
      if (c < 64) seen.mask |= uint64_t(1) << c;
      polled = true;
    }
    if (!polled) return;
    asm volatile("fence.proxy.async.global;" ::: "memory");
    if constexpr (kTrace_)
      if (device::trace_now_ns() - t0 > 5000) device::trace_record(p.trace, Role::kWait, item, t0);
  }
}

// The producer's K and V loads of one item through descriptors tma_k / tma_v (the local K/V or
// the slots: separate parameters, indexed with constants so TMA reads them from parameter space).
template <bool kTrace_, int kD, class Comm_, class TmaKV_, class StateKV_>
__device__ __forceinline__ void load_kv(const Params<kD, Comm_>& p, const TmaKV_& tma_k, const TmaKV_& tma_v,
                                        typename Cfg<kD>::Shared& sh, typename Cfg<kD>::PipeKV& pipe_k,
                                        typename Cfg<kD>::PipeKV& pipe_v, StateKV_& sk, StateKV_& sv,
                                        ArrivalCache& seen, const FmhaPair& pr, const ItemInfo& it, int src, int hk,
                                        int j0, int nkv, int item, uint64_t epoch) {
  using C = Cfg<kD>;
  constexpr int kBlockN = C::kBlockN;
  Tensor sK = make_tensor(make_smem_ptr(sh.k.data()), typename C::SmemK{});
  Tensor sV = make_tensor(make_smem_ptr(sh.v.data()), typename C::SmemK{});
  Tensor mK = tma_k.get_tma_tensor(make_shape(p.kv_rows[src], kD, p.Hkv, p.B, src ? p.kv_slots : 1));
  Tensor mV = tma_v.get_tma_tensor(make_shape(p.kv_rows[src], kD, p.Hkv, p.B, src ? p.kv_slots : 1));
  const int slot = src ? pr.kv_slot : 0;
  Tensor gK = local_tile(domain_offset(make_coord(it.kv_row0, 0), mK(_, _, hk, it.b, slot)),
                         Shape<Int<kBlockN>, Int<kD>>{}, make_coord(_, 0));  // (BN, D, tiles)
  Tensor gV = local_tile(domain_offset(make_coord(it.kv_row0, 0), mV(_, _, hk, it.b, slot)),
                         Shape<Int<kBlockN>, Int<kD>>{}, make_coord(_, 0));
  auto cta_k = tma_k.get_slice(0);
  auto cta_v = tma_v.get_slice(0);
  Tensor tKg = cta_k.partition_S(gK);
  Tensor tKs = cta_k.partition_D(sK);
  Tensor tVg = cta_v.partition_S(gV);
  Tensor tVs = cta_v.partition_D(sV);
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
  wait_kv_arrival<kTrace_, kBlockN>(p, seen, pr, it, nkv - 1, item, epoch);
  load_k(nkv - 1);
  for (int j = nkv - 2; j >= j0; --j) {
    wait_kv_arrival<kTrace_, kBlockN>(p, seen, pr, it, j, item, epoch);
    load_k(j);
    load_v(j + 1);
  }
  load_v(j0);
}

// The producer thread: every item of this CTA, in the scheduler's order.
template <bool kTrace_, int kD, class Comm_, class Sched_>
__device__ __forceinline__ void fmha_produce(const Params<kD, Comm_>& p, typename Cfg<kD>::Shared& sh,
                                             typename Cfg<kD>::PipeQ& pipe_q, typename Cfg<kD>::PipeKV& pipe_k,
                                             typename Cfg<kD>::PipeKV& pipe_v, const Sched_& sched, uint64_t epoch,
                                             const int32_t* cu) {
  using C = Cfg<kD>;
  auto sq = cutlass::make_producer_start_state<typename C::PipeQ>();
  ArrivalCache seen;
  auto sk = cutlass::make_producer_start_state<typename C::PipeKV>();
  auto sv = cutlass::make_producer_start_state<typename C::PipeKV>();
  Tensor sQ = make_tensor(make_smem_ptr(sh.q.data()), typename C::SmemQ{});
  Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.Sq, kD, p.H, p.B));
  auto ss = cutlass::make_producer_start_state<typename C::PipeSched>();
  for (int item = sched.producer_next(-1, ss); item < p.n_items; item = sched.producer_next(item, ss)) {
    const ItemInfo it = item_info(p, item, cu);
    const FmhaPair& pr = *it.pair;
    const KvSpan span = kv_span(p, it, C::kBlockN);
    if (span.n == 0) continue;
    const int src = pr.kv_src;
    const int hk = it.h / (p.H / p.Hkv);
    // Q tile
    pipe_q.producer_acquire(sq);
    {
      Tensor gQ = local_tile(domain_offset(make_coord(it.q_row0, 0), mQ(_, _, it.h, it.b)),
                             Shape<Int<C::kBlockM>, Int<kD>>{}, make_coord(it.qt, 0));
      auto cta_q = p.tma_q.get_slice(0);
      copy(p.tma_q.with(*pipe_q.producer_get_barrier(sq)), cta_q.partition_S(gQ), cta_q.partition_D(sQ));
    }
    ++sq;
    if (src)
      load_kv<kTrace_>(p, p.tma_k[1], p.tma_v[1], sh, pipe_k, pipe_v, sk, sv, seen, pr, it, src, hk, span.j0, span.n,
                       item, epoch);
    else
      load_kv<kTrace_>(p, p.tma_k[0], p.tma_v[0], sh, pipe_k, pipe_v, sk, sv, seen, pr, it, src, hk, span.j0, span.n,
                       item, epoch);
  }
}

// The consumers' work on one item with key tiles [j0, nkv), nkv > j0: O (tOrO, unnormalized)
// and the softmax state over the key tiles, last to first. The operands and pipelines are the
// consumer's (fmha_consume); docs: the rows' document windows (packed documents by position).
template <int kD, class MmaQK_, class MmaPV_, class TQ_, class TK_, class TV_, class CS_, class PipeQ_, class StateQ_,
          class PipeKV_, class StateKV_, class TO_, class TORC_, class Softmax_, class Docs_>
__device__ __forceinline__ void fmha_mma(MmaQK_& mma_qk, MmaPV_& mma_pv, const TQ_& tSrQ, const TK_& tSrK,
                                         const TV_& tOrV, const CS_& cS_rc, PipeQ_& pipe_q, StateQ_& cq,
                                         PipeKV_& pipe_k, StateKV_& ck, PipeKV_& pipe_v, StateKV_& cv, TO_& tOrO,
                                         TORC_& tOrO_rc, Softmax_& softmax, const FmhaPair& pr, int kv_len, int qt,
                                         int j0, int nkv, int wg_c, float sl2, const Docs_& docs) {
  using C = Cfg<kD>;
  constexpr int kBlockN = C::kBlockN;
  constexpr int kRows = decltype(size<0>(tOrO_rc))::value;  // 2
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<C::kBlockM>, Int<kBlockN>>{});
  Tensor tSrS_rc = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
  Tensor tOrP = make_tensor<Element>(acc_to_a(tSrS.layout()));
  const int64_t q_pos_base = pr.q_pos0 + int64_t(qt) * kTileM;  // global position of tile row 0
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
  mask_tile<kBlockN>(tSrS_rc, cS_rc, pr, kv_len, j, q_pos_base, wg_c, docs);
  {
    float rs[kRows];
    softmax.update(tSrS_rc, sl2, rs);
  }
  to_p();
  for (--j; j >= j0; --j) {
    pipe_k.consumer_wait(ck);
    qk(ck.index());
    pipe_v.consumer_wait(cv);
    pv(cv.index());
    warpgroup_wait<1>();  // S ready; P·V still running
    pipe_k.consumer_release(ck);
    ++ck;
    mask_tile<kBlockN>(tSrS_rc, cS_rc, pr, kv_len, j, q_pos_base, wg_c, docs);
    float rs[kRows];
    softmax.update(tSrS_rc, sl2, rs);
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

}  // namespace sm90
}  // namespace attention
}  // namespace mk
