// mkernel — the sm_90a attention backward kernel: dK and dV of one 128-row key block per CTA,
// and that block's share of dQ.
//
// The preprocessing kernel (sm90_fmha_bwd.cu) has written, per query row, Dsum = rowsum(dO ∘ O)
// and LSE·log2(e) (+inf for a row that sees no key and for the padding past Sq, so that its P is
// 0), and zeroed an fp32 dQ accumulator [B][H][Sq_pad][D]. Then, per CTA (key block n of batch b
// and key/value head hk), for every query head of the group and every query block (128 rows at
// D = 64, 64 at D = 128) that sees a key of the block:
//
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ            (WGMMA from shared memory; 128 keys x 128 or 64 queries)
//   Pᵀ = exp2(Sᵀ·scale·log2 e − LSE₂), masked;  dSᵀ = Pᵀ ∘ (dPᵀ − Dsum)
//   dV += Pᵀ·dO,  dK += dSᵀ·Q          (Pᵀ and dSᵀ straight from registers, fp32 accumulators)
//   dQ_acc += dS·K · scale             (dS through shared memory; the fp32 tile bulk-added to the
//                                       workspace by a reducing warp, in fragment order)
//
// so dK and dV of a block never leave registers until the end (GQA: summed over the group's
// query heads in the same accumulators), and only dQ is reduced across CTAs. Deterministic mode
// orders the dQ reductions of each query block by key block (a per-(b, h, query block) counter,
// bounded waits); otherwise they land in any order. A finishing kernel rounds dQ to bf16.
//
// CTA: 3 warpgroups. Warpgroup 0's first thread issues the TMA loads (K and V once; Q, dO and
// the rows' LSE₂ and Dsum per step, 2 stages); its second warp is the reducing warp (each step's
// dQ tile from shared memory into the workspace, one bulk add). Warpgroups 1 and 2 each own 64 of the block's
// 128 key rows for Sᵀ, dPᵀ, dK and dV, and half of the step's query rows (D = 64, 128-row steps)
// or half of the head dimension (D = 128, 64-row steps) for dQ.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "mkernel/device/diag.h"
#include "mkernel/device/signal.cuh"
#include "src/attention/bwd_launch.h"
#include "src/attention/kernel/config.cuh"
#include "src/attention/kernel/scheduler.cuh"
#include "src/attention/kernel/varlen.cuh"
#include "src/attention/ring_roles.h"
#include "src/comm/comm_role.cuh"

// Leave-one-stage-out builds, for accounting where a call's time goes (benchmarks only; 0 in the
// library): bit 0 drops the dQ reductions, bit 1 the dQ MMA with its dS stores (and the
// reductions), bit 2 the dK and dV MMAs, bit 3 the exponentials and masks.
#ifndef MK_BWD_SKIP
#define MK_BWD_SKIP 0
#endif
// A step's order of its last two MMAs: 1 issues dQ before dK (dQ's store overlaps dK).
#ifndef MK_BWD_DQ_FIRST
#define MK_BWD_DQ_FIRST 0
#endif

namespace mk {
namespace attention {
namespace sm90 {

constexpr int kBwdBlockN = 128;  // key rows per CTA
constexpr uint32_t kBwdDsBarrier = 1;       // named barrier: dS of a step is in shared memory (256 threads)
constexpr uint32_t kBwdDqFullBarrier = 2;   // dQ of a step is in shared memory (256 consumers + the reducing warp)
constexpr uint32_t kBwdDqEmptyBarrier = 3;  // the reducing warp has read it
// The consumers of a ring compute CTA running communication ops once no item is left: not
// kCommBarrier, whose id is kBwdDqEmptyBarrier's, left with the reducing warp's last arrival.
constexpr uint32_t kBwdHelpBarrier = 4;
constexpr int kBwdDqThreads = kMmaThreads + 32;

// One item of the kernel: a key block (its K/V source, rows and position) against up to two
// query segments, for the query heads [h0, h0 + group) of key/value head hk. Its steps are
// (segment, head, query block), segments outermost.
struct BwdWork {
  int b, hk, h0, group;
  int src, slot;     // K/V: 0 the tensors (tma_k / tma_v), 1 the ring's slots (tma_ks / tma_vs)
  int row0, n, len;  // key rows [row0 + 128 n, ...) of the segment [row0, row0 + len)
  int64_t kv_pos0;
  int nseg;
  BwdSeg seg[2];
  int m_begin[2], m_count[2];
  int steps;
  int wait;          // ring: wait for the block's arrival flags first
  // Ring over packed documents (BwdParams::doc_win): the document window [doc_lo, doc_hi) of the
  // block's first key, and whether every key of the block lies in it (doc_one).
  int doc_lo, doc_hi, doc_one;
  int64_t tile;      // ring: the part tile it writes (-1: none)
  int ready;         // ring: the ready flag it adds 1 to
  uint64_t t0;       // ring, traced: when the consumers took it
  // Step s: its segment, head and query block.
  __device__ __forceinline__ int seg_of(int s) const { return s < m_count[0] * group ? 0 : 1; }
  __device__ __forceinline__ int head_of(int s, int sg) const {
    return h0 + (s - sg * m_count[0] * group) / m_count[sg];
  }
  __device__ __forceinline__ int m_of(int s, int sg) const {
    return m_begin[sg] + (s - sg * m_count[0] * group) % m_count[sg];
  }
};

template <int kD>
struct BwdCfg {
  // Query rows per step: 128 at D = 64 (the warpgroups split them for dQ), 64 at D = 128 (the
  // warpgroups split D for dQ); either way each WGMMA of dQ is 64 wide in its contiguous mode.
  static constexpr int kBlockM = kD == 64 ? 128 : 64;
  static constexpr int kBlockN = kBwdBlockN;
  static constexpr int kStages = 2;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;
  using HD = Int<kD>;
  // Sᵀ and dPᵀ: (keys, queries, D), both operands K-major from shared memory; the two consumer
  // warpgroups split the keys.
  using MmaSdP = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, BM, HD>>(),
                                         Layout<Shape<_2, _1, _1>>{}));
  // dV and dK: (keys, D, queries), A = Pᵀ / dSᵀ from registers, B = dOᵀ / Qᵀ (MN-major views).
  using MmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, HD, BM>, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // dQ: (queries, D, keys), A = dS (query-contiguous in shared memory), B = Kᵀ; the warpgroups
  // split the queries (D = 64) or D (D = 128).
  using MmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, _64, BN>, GMMA::Major::MN, GMMA::Major::MN>(),
      std::conditional_t<kD == 64, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>{}));
  using AtomK = decltype(GMMA::Layout_K_SW128_Atom<Element>{});
  using SmemKV = decltype(tile_to_shape(AtomK{}, Shape<BN, HD>{}));
  using SmemKt = decltype(composition(SmemKV{}, make_ordered_layout(Shape<HD, BN>{}, Step<_2, _1>{})));
  using SmemQ = decltype(tile_to_shape(AtomK{}, Shape<BM, HD, Int<kStages>>{}));
  using SmemQt =
      decltype(composition(SmemQ{}, make_ordered_layout(Shape<HD, BM, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // dS, double-buffered: a step writes one buffer while the other may still feed the previous
  // step's dQ MMA of the other warpgroup.
  using SmemdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<BM, BN, _2>{}));
  using PipeKV = cutlass::PipelineTmaAsync<1>;
  using PipeQ = cutlass::PipelineTmaAsync<kStages>;  // Q, dO, LSE₂ and Dsum of a step
  using PipeSched = cutlass::PipelineAsync<2>;          // the ring kernel's items, producer to the others
  struct Shared {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemKV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemdS>> ds;
    // dQ of a step in fragment order (element i of consumer thread t at i * 256 + t), for the
    // reducing warp's bulk add into the workspace, which keeps the same order (bwd_finish_dq).
    alignas(128) float dq[kBlockM * kD];
    alignas(16) float lse2[kStages][kBlockM];
    alignas(16) float dsum[kStages][kBlockM];
    // The ring over packed documents: the step's query rows' document windows (BwdParams::qwin).
    alignas(16) DocWindow qwin[kStages][kBlockM];
    alignas(16) typename PipeKV::SharedStorage pipe_kv;
    alignas(16) typename PipeQ::SharedStorage pipe_q;
    // The ring kernel's current item of the producer, the reducing warp and the consumers, and
    // its dynamic schedule's two item slots.
    alignas(16) BwdWork work[3];
    alignas(16) typename PipeSched::SharedStorage pipe_s;
    int sched[2];
  };
  // (seq, d, head, batch)
  using Gmem = Layout<Shape<int, int, int, int>, Stride<int64_t, _1, int64_t, int64_t>>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), Gmem{}),
                                      take<0, 2>(SmemQ{})));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                       make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), Gmem{}),
                                       SmemKV{}));
  // The ring's K/V slots: (seq, d, head, batch, slot)
  using GmemS = Layout<Shape<int, int, int, int, int>, Stride<int64_t, _1, int64_t, int64_t, int64_t>>;
  using TmaKVs = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                        make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemS{}),
                                        SmemKV{}));
};

template <int kD, class Comm_ = comm::NoComm>
struct BwdParams {
  typename BwdCfg<kD>::TmaQ tma_q, tma_do;
  typename BwdCfg<kD>::TmaKV tma_k, tma_v;
  typename BwdCfg<kD>::TmaKVs tma_ks, tma_vs;  // ring: the K/V slots
  int B, H, Hkv, Sq, Skv, Sq_pad, m_blocks;
  const int32_t* cu_seqlens;  // packed documents (B = 1), or null
  int n_docs;
  const float* lse2;  // [B][H][Sq_pad]
  const float* dsum;  // [B][H][Sq_pad]
  float* dq_acc;      // [B][H][Sq_pad][D], per query block in fragment order (Shared::dq)
  uint64_t* dq_order; // [B][H][m_blocks], deterministic mode (zeroed by the preprocessing)
  Element* dk;
  Element* dv;
  int64_t dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh;
  float scale, scale_log2;
  int causal;
  int deterministic;
  int64_t q_pos0, kv_pos0;
  // Split schedule (head_split > 1): blockIdx.y = key/value head * head_split + part; the part's
  // group / head_split query heads, dK and dV added in fp32 to dkv_acc (fragment order, one
  // 128 x D tile per (batch, key/value head, blockIdx.x); dV after all of dK).
  int head_split;
  float* dkv_acc;
  WaitCtx wait;
  // Ring (pairs non-null): a persistent launch over the pairs' items (bwd_launch.h). The compute
  // CTAs (after the communication role's dedicated ones) take items in list order from
  // item_counter (zeroed by the launch), or — null — CTA c takes c, c + n, ... of n.
  const BwdRingPair* pairs;
  int n_pairs, n_items;
  // Ring over packed documents: doc_win[pos] the document window of global position pos, qwin
  // the windows of this rank's query rows in the workspace's rows (as lse2 without batch and
  // head: B = 1); null without documents.
  const DocWindow* doc_win;
  const DocWindow* qwin;
  int* item_counter;
  FmhaSlots slots;
  float* part;
  uint64_t* ready;
  int ring_kb, ring_dpieces, ring_kb_per_piece;
  // Ring: events non-null records each item ("compute", from its first load to its ready flag),
  // each producer wait for K/V that lasted > 5 us ("wait") and each communication op.
  TraceBuffer trace;
  typename Comm_::Params comm;
};

// The first of m_blocks query blocks that sees key row `key` (causal: the query row at
// key_pos - q_pos0 is the first), or 0.
template <int kBlockM_>
__device__ __forceinline__ int bwd_first_m(int causal, int64_t key_pos, int64_t q_pos0, int m_blocks) {
  if (!causal) return 0;
  const int64_t first_q = key_pos - q_pos0;
  if (first_q <= 0) return 0;
  return int(min<int64_t>(first_q / kBlockM_, m_blocks));
}

// A CTA's key block: its rows [row0 + 128 n, ...) of the segment [row0, row0 + len) of K/V (and of
// Q: the whole sequence, or a packed call's document), and the segment's first query block in
// the workspace's rows (qb0, a virtual block for packed calls).
struct BwdBlock {
  int n, row0, len, qb0, m_blocks;
};
// Called by whole warps (varlen_tile_warp).
template <class P_>
__device__ __forceinline__ BwdBlock bwd_block(const P_& p, int kBlockM) {
  if (!p.cu_seqlens) return BwdBlock{int(blockIdx.x), 0, p.Skv, 0, (p.Sq + kBlockM - 1) / kBlockM};
  const DocTile t = varlen_tile_warp(p.cu_seqlens, p.n_docs, p.Skv, kBwdBlockN, int(blockIdx.x));
  if (!varlen_valid(t, kBwdBlockN)) return BwdBlock{0, t.row0, 0, 0, 0};  // no work
  return BwdBlock{t.local, t.row0, t.len, t.row0 / kBlockM + t.doc, (t.len + kBlockM - 1) / kBlockM};
}

template <int kD, class P_>
__device__ __forceinline__ void bwd_steps(BwdWork& w) {
  constexpr int kBlockM = BwdCfg<kD>::kBlockM;
  w.steps = 0;
  w.m_count[1] = 0;
  w.m_begin[1] = 0;
  for (int i = 0; i < w.nseg; ++i) {
    const BwdSeg& g = w.seg[i];
    w.m_begin[i] = bwd_first_m<kBlockM>(g.causal, w.kv_pos0 + int64_t(w.n) * kBwdBlockN, g.q_pos0, g.m_blocks);
    w.m_count[i] = w.len > 0 ? g.m_blocks - w.m_begin[i] : 0;
    w.steps += w.m_count[i] * w.group;
  }
}

// The ring's item `item` (bwd_launch.h: pairs, items heads innermost).
template <int kD, class P_>
__device__ __forceinline__ BwdWork bwd_ring_work(const P_& p, int item) {
  int lo = 0;
  while (lo + 1 < p.n_pairs && p.pairs[lo + 1].item0 <= item) ++lo;
  const BwdRingPair& pr = p.pairs[lo];
  const int wi = item - pr.item0;
  const int nbc = (pr.kv_len + kBwdBlockN - 1) / kBwdBlockN;
  BwdWork w;
  w.hk = wi % p.Hkv;
  w.n = (wi / p.Hkv) % nbc;
  w.b = wi / (p.Hkv * nbc);
  w.group = p.H / p.Hkv;
  w.h0 = w.hk * w.group;
  w.src = pr.kv_src, w.slot = pr.slot;
  w.row0 = pr.kv_row0, w.len = pr.kv_len;
  w.kv_pos0 = pr.kv_pos0;
  w.nseg = pr.nseg;
  w.seg[0] = pr.seg[0];
  w.seg[1] = pr.seg[1];
  bwd_steps<kD, P_>(w);
  w.doc_one = 1;
  w.doc_lo = 0;
  w.doc_hi = 0x7fffffff;
  if (p.doc_win && w.steps > 0) {
    // Packed documents: only the query blocks that hold a row of the keys' documents — from the
    // first key's document start (or the first key, causal) to the last key's document end.
    constexpr int kBlockM = BwdCfg<kD>::kBlockM;
    const int64_t k0 = w.kv_pos0 + int64_t(w.n) * kBwdBlockN;
    const int64_t k1 = w.kv_pos0 + min(w.len, (w.n + 1) * kBwdBlockN);  // exclusive
    const DocWindow first = p.doc_win[k0], last = p.doc_win[k1 - 1];
    w.doc_lo = first.lo;
    w.doc_hi = first.hi;
    w.doc_one = first.hi >= k1;
    w.steps = 0;
    for (int i = 0; i < w.nseg; ++i) {
      const BwdSeg& g = w.seg[i];
      int64_t rlo, rhi;
      doc_rows_of_keys(first, last, k0, g.causal != 0, &rlo, &rhi);
      const int64_t q_lo = rlo - g.q_pos0, q_hi = rhi - g.q_pos0;
      const int mb = max<int64_t>(w.m_begin[i], q_lo <= 0 ? 0 : q_lo / kBlockM);
      const int me = min<int64_t>(g.m_blocks, q_hi <= 0 ? 0 : (q_hi + kBlockM - 1) / kBlockM);
      w.m_begin[i] = mb;
      w.m_count[i] = w.m_count[i] > 0 && me > mb ? me - mb : 0;
      w.steps += w.m_count[i] * w.group;
    }
  }
  w.wait = pr.wait;
  w.tile = pr.tile0 + (int64_t(w.b) * p.ring_kb + w.n) * p.Hkv + w.hk;
  w.ready = pr.ready0 + w.b * p.ring_dpieces + w.n / p.ring_kb_per_piece;
  return w;
}

// Bulk add of `bytes` of fp32 from shared to global memory (one thread), as one bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const float* smem, int bytes) {
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem), "r"(sa),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

template <class Mma_, class TA_, class TB_, class TC_>
__device__ __forceinline__ void bwd_gemm(Mma_& mma, const TA_& a, const TB_& b, TC_& c, bool zero) {
  mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

template <class Acc_, class Frag_>
__device__ __forceinline__ void bwd_to_bf16(const Acc_& acc, Frag_& frag) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    __nv_bfloat162 v = __floats2bfloat162_rn(acc(i), acc(i + 1));
    frag(i) = Element::bitcast(reinterpret_cast<uint16_t*>(&v)[0]);
    frag(i + 1) = Element::bitcast(reinterpret_cast<uint16_t*>(&v)[1]);
  }
}

// One step of a key block's consumer warpgroups, in both kernels: Sᵀ and dPᵀ for the step's
// query block (stage st of the Q pipeline), Pᵀ and dSᵀ (masked: keys at or past `len`, and causal
// keys past the query's position), dV and dK accumulated, dS through shared memory buffer `buf`
// into the step's dQ, which goes to shared memory for the reducing warp. q_pos_m: the global
// position of the block's first query row; kv_pos0 that of the segment's first key row.
// kDocs_ (the ring kernel): doc_step masks, besides, the keys outside each query row's document
// window (Shared::qwin of the stage; packed documents by position).
template <int kD, bool kDocs_ = false, class PipeQ_, class StateQ_, class MmaSdP_, class MmadKV_, class MmadQ_,
          class FragK_, class FragQ_, class FragQt_, class FragdS_, class FragKt_, class SmemdS_, class CoordS_,
          class CoordSrc_, class AccKV_>
__device__ __forceinline__ void bwd_consume_step(typename BwdCfg<kD>::Shared& sh, PipeQ_& pipe_q, StateQ_& cq,
                                                 MmaSdP_& mma_sdp, MmadKV_& mma_dkv, MmadQ_& mma_dq,
                                                 const FragK_& tSrK, const FragK_& tSrV, const FragQ_& tSrQ,
                                                 const FragQ_& tSrdO, const FragQt_& tdKrQt, const FragQt_& tdVrdOt,
                                                 const FragdS_& tdQrdS, const FragKt_& tdQrKt, SmemdS_& sdS,
                                                 const CoordS_& cS, const CoordSrc_& cS_rc, AccKV_& tdKrdK,
                                                 AccKV_& tdVrdV, int st, int buf, int key0, int len, int causal,
                                                 int64_t kv_pos0, int64_t q_pos_m, float sl2, float scale, int tid,
                                                 bool doc_step = false) {
  using C = BwdCfg<kD>;
  constexpr int kBlockM = C::kBlockM, kBlockN = C::kBlockN;
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ as two groups: Pᵀ is computed while dPᵀ runs.
  warpgroup_fence_operand(tSrS);
  warpgroup_arrive();
  bwd_gemm(mma_sdp, tSrK, tSrQ(_, _, _, st), tSrS, true);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tSrdP);
  warpgroup_arrive();
  bwd_gemm(mma_sdp, tSrV, tSrdO(_, _, _, st), tSrdP, true);
  warpgroup_commit_batch();
  warpgroup_wait<1>();
  warpgroup_fence_operand(tSrS);

  // Pᵀ in place of Sᵀ.
  Tensor S_rc = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
  Tensor dP_rc = make_tensor(tSrdP.data(), rowcol(tSrdP.layout()));
  bool need_mask = key0 + kBlockN > len || (causal && kv_pos0 + key0 + kBlockN - 1 > q_pos_m);
  if constexpr (kDocs_) need_mask = need_mask || doc_step;
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < size<1>(S_rc) && !(MK_BWD_SKIP & 8); ++c) {
    const int q = get<1>(cS_rc(0, c));
    const float l2 = sh.lse2[st][q];
    [[maybe_unused]] DocWindow qw{0, 0x7fffffff};
    if constexpr (kDocs_)
      if (doc_step) qw = sh.qwin[st][q];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(S_rc); ++r) {
      float pv = exp2f(fmaf(S_rc(r, c), sl2, -l2));
      if (need_mask) {
        const int key = key0 + get<0>(cS_rc(r, c));
        bool masked = key >= len || (causal && kv_pos0 + key > q_pos_m + q);
        if constexpr (kDocs_) masked = masked || kv_pos0 + key < qw.lo || kv_pos0 + key >= qw.hi;
        if (masked) pv = 0.f;
      }
      S_rc(r, c) = pv;
    }
  }
  // dV += Pᵀ·dO (Pᵀ in bf16 as the A operand) while dPᵀ finishes.
  Tensor tdVrP = make_tensor<Element>(acc_to_a(tSrS.layout()));
  bwd_to_bf16(tSrS, tdVrP);
  warpgroup_fence_operand(tdVrdV);
  warpgroup_arrive();
  if (!(MK_BWD_SKIP & 4)) bwd_gemm(mma_dkv, tdVrP, tdVrdOt(_, _, _, st), tdVrdV, false);
  warpgroup_commit_batch();
  warpgroup_wait<1>();
  warpgroup_fence_operand(tSrdP);
  // dSᵀ = Pᵀ ∘ (dPᵀ − Dsum) in place of dPᵀ.
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < size<1>(S_rc); ++c) {
    const float ds = sh.dsum[st][get<1>(cS_rc(0, c))];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(S_rc); ++r) dP_rc(r, c) = S_rc(r, c) * (dP_rc(r, c) - ds);
  }
  Tensor tdKrdS = make_tensor<Element>(acc_to_a(tSrdP.layout()));
  bwd_to_bf16(tSrdP, tdKrdS);
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kD>>{});
  // dS (query-major) into this step's buffer, for dQ: the buffer's previous reader (the dQ MMA
  // two steps back) finished before both warpgroups passed the last step's barrier. The A
  // fragment holds the accumulator's elements in the same order (acc_to_a only regroups modes),
  // so cS names their coordinates; a pair is two adjacent queries, adjacent in shared memory.
  auto store_ds = [&]() {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdS) && !(MK_BWD_SKIP & 2); i += 2) {
      const int key = get<0>(cS(i)), q = get<1>(cS(i));
      Element pair[2] = {tdKrdS(i), tdKrdS(i + 1)};
      *reinterpret_cast<uint32_t*>(&sdS(q, key, buf)) = *reinterpret_cast<const uint32_t*>(pair);
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kMmaThreads, kBwdDsBarrier);
  };
  // dQ (scaled) to shared memory in fragment order, for the reducing warp.
  auto store_dq = [&]() {
    cutlass::arch::NamedBarrier::sync(kBwdDqThreads, kBwdDqEmptyBarrier);
    if (!(MK_BWD_SKIP & 3)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdQrdQ); ++i) sh.dq[i * kMmaThreads + tid] = tdQrdQ(i) * scale;
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::arrive(kBwdDqThreads, kBwdDqFullBarrier);
  };
  auto mma_dq_ = [&]() {
    warpgroup_fence_operand(tdQrdQ);
    warpgroup_arrive();
    if (!(MK_BWD_SKIP & 2)) bwd_gemm(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, tdQrdQ, true);
    warpgroup_commit_batch();
  };
  auto mma_dk = [&]() {  // dK += dSᵀ·Q
    warpgroup_fence_operand(tdKrdK);
    warpgroup_arrive();
    if (!(MK_BWD_SKIP & 4)) bwd_gemm(mma_dkv, tdKrdS, tdKrQt(_, _, _, st), tdKrdK, false);
    warpgroup_commit_batch();
  };
#if MK_BWD_DQ_FIRST
  // dS to shared memory, then dQ = dS·K issued before dK, so that dQ's trip through shared memory
  // runs while the dK MMA does.
  store_ds();
  mma_dq_();
  mma_dk();
  warpgroup_wait<1>();  // dV and dQ done; dK runs on
  warpgroup_fence_operand(tdQrdQ);
  store_dq();
  warpgroup_wait<0>();
#else
  mma_dk();
  store_ds();  // while dK runs
  mma_dq_();   // dQ = dS·K (this warpgroup's half)
  warpgroup_wait<0>();
  warpgroup_fence_operand(tdQrdQ);
#endif
  warpgroup_fence_operand(tdVrdV);
  warpgroup_fence_operand(tdKrdK);
  pipe_q.consumer_release(cq);
  ++cq;
#if !MK_BWD_DQ_FIRST
  store_dq();
#endif
}

template <int kD>
__global__ void __launch_bounds__(kThreads, 1) fmha_bwd_kernel(__grid_constant__ const BwdParams<kD> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = BwdCfg<kD>;
  constexpr int kBlockM = C::kBlockM, kBlockN = C::kBlockN;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sh = *reinterpret_cast<typename C::Shared*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % 4;
  const int hk = blockIdx.y / p.head_split, b = blockIdx.z;
  const BwdBlock blk = bwd_block(p, kBlockM);
  if (p.cu_seqlens && blk.len == 0) return;  // a virtual key tile that is no tile of its document
  const int nb = blk.n;
  const int group = p.H / p.Hkv / p.head_split;                  // query heads of this CTA
  const int h0 = hk * (p.H / p.Hkv) + (blockIdx.y % p.head_split) * group;  // the first of them
  const int m_begin = bwd_first_m<kBlockM>(p.causal, p.kv_pos0 + int64_t(nb) * kBwdBlockN, p.q_pos0, blk.m_blocks);
  const int m_count = blk.len > 0 ? blk.m_blocks - m_begin : 0;  // query blocks per head
  const int steps = m_count * group;

  typename C::PipeKV::Params pkv;
  typename C::PipeQ::Params pq;
  if (wg == 0 && warp_in_wg == 0) {
    pkv.role = C::PipeKV::ThreadCategory::Producer;
    pq.role = C::PipeQ::ThreadCategory::Producer;
  }
  if (wg >= 1) {
    pkv.role = C::PipeKV::ThreadCategory::Consumer;
    pq.role = C::PipeQ::ThreadCategory::Consumer;
  }
  pkv.is_leader = pq.is_leader = (threadIdx.x % 128) == 0;
  pkv.num_consumers = pq.num_consumers = kMmaThreads;
  pkv.transaction_bytes = 2 * kBlockN * kD * sizeof(Element);
  pq.transaction_bytes = 2 * kBlockM * kD * sizeof(Element) + 2 * kBlockM * sizeof(float);
  typename C::PipeKV pipe_kv(sh.pipe_kv, pkv, Shape<_1, _1, _1>{});
  typename C::PipeQ pipe_q(sh.pipe_q, pq, Shape<_1, _1, _1>{});
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(sh.k.data()), typename C::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(sh.v.data()), typename C::SmemKV{});
  Tensor sQ = make_tensor(make_smem_ptr(sh.q.data()), typename C::SmemQ{});
  Tensor sdO = make_tensor(make_smem_ptr(sh.dout.data()), typename C::SmemQ{});

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0 && elect_one_sync()) {
      if (steps > 0) {
        auto skv = cutlass::make_producer_start_state<typename C::PipeKV>();
        pipe_kv.producer_acquire(skv);
        {
          Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.Skv, kD, p.Hkv, p.B));
          Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.Skv, kD, p.Hkv, p.B));
          Tensor gK = local_tile(domain_offset(make_coord(blk.row0, 0), mK(_, _, hk, b)), Shape<Int<kBlockN>, Int<kD>>{},
                                 make_coord(nb, 0));
          Tensor gV = local_tile(domain_offset(make_coord(blk.row0, 0), mV(_, _, hk, b)), Shape<Int<kBlockN>, Int<kD>>{},
                                 make_coord(nb, 0));
          auto ck = p.tma_k.get_slice(0);
          auto cv = p.tma_v.get_slice(0);
          copy(p.tma_k.with(*pipe_kv.producer_get_barrier(skv)), ck.partition_S(gK), ck.partition_D(sK));
          copy(p.tma_v.with(*pipe_kv.producer_get_barrier(skv)), cv.partition_S(gV), cv.partition_D(sV));
        }
        Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.Sq, kD, p.H, p.B));
        Tensor mdO = p.tma_do.get_tma_tensor(make_shape(p.Sq, kD, p.H, p.B));
        auto cq = p.tma_q.get_slice(0);
        auto cdo = p.tma_do.get_slice(0);
        Tensor tQs = cq.partition_D(sQ);
        Tensor tdOs = cdo.partition_D(sdO);
        auto sq = cutlass::make_producer_start_state<typename C::PipeQ>();
        for (int s = 0; s < steps; ++s) {
          const int h = h0 + s / m_count, m = m_begin + s % m_count;
          pipe_q.producer_acquire(sq);
          auto* bar = pipe_q.producer_get_barrier(sq);
          Tensor gQ = local_tile(domain_offset(make_coord(blk.row0, 0), mQ(_, _, h, b)), Shape<Int<kBlockM>, Int<kD>>{},
                                 make_coord(m, 0));
          Tensor gdO = local_tile(domain_offset(make_coord(blk.row0, 0), mdO(_, _, h, b)),
                                  Shape<Int<kBlockM>, Int<kD>>{}, make_coord(m, 0));
          copy(p.tma_q.with(*bar), cq.partition_S(gQ), tQs(_, _, _, sq.index()));
          copy(p.tma_do.with(*bar), cdo.partition_S(gdO), tdOs(_, _, _, sq.index()));
          const int64_t row = (int64_t(b) * p.H + h) * p.Sq_pad + int64_t(blk.qb0 + m) * kBlockM;
          SM90_BULK_COPY_G2S::copy(p.lse2 + row, bar, &sh.lse2[sq.index()][0], kBlockM * int(sizeof(float)));
          SM90_BULK_COPY_G2S::copy(p.dsum + row, bar, &sh.dsum[sq.index()][0], kBlockM * int(sizeof(float)));
          ++sq;
        }
      }
    } else if (warp_in_wg == 1) {
      // The reducing warp: each step's dQ tile, bulk-added into the workspace (deterministic:
      // after key blocks 0 .. n - 1 added theirs, and complete before it lets key block n + 1 on).
      if (steps > 0) cutlass::arch::NamedBarrier::arrive(kBwdDqThreads, kBwdDqEmptyBarrier);
      for (int s = 0; s < steps; ++s) {
        const int h = h0 + s / m_count, m = m_begin + s % m_count;
        cutlass::arch::NamedBarrier::sync(kBwdDqThreads, kBwdDqFullBarrier);
        if (elect_one_sync()) {
          float* tile = p.dq_acc + ((int64_t(b) * p.H + h) * p.Sq_pad + int64_t(blk.qb0 + m) * kBlockM) * kD;
          const int idx = (b * p.H + h) * p.m_blocks + blk.qb0 + m;
          if (p.deterministic)
            // A wait that gives up has set the abort word: the finishing kernel then poisons dQ,
            // and the next call reports the wait; later waits see the abort word and stop at once.
            (void)device::wait_ge<true>(p.wait, p.dq_order + idx, uint64_t(nb), -1, idx);
          bulk_reduce_add_f32(tile, sh.dq, kBlockM * kD * int(sizeof(float)));
          asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
          if (p.deterministic) {
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            asm volatile("fence.proxy.async.global;" ::: "memory");
            device::red_add_release_sys(p.dq_order + idx, 1);
          }
        }
        __syncwarp();
        cutlass::arch::NamedBarrier::arrive(kBwdDqThreads, kBwdDqEmptyBarrier);
      }
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int tid = threadIdx.x - 128;  // 0..255 over both consumer warpgroups
  Tensor sKt = make_tensor(make_smem_ptr(sh.k.data()), typename C::SmemKt{});
  Tensor sQt = make_tensor(make_smem_ptr(sh.q.data()), typename C::SmemQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(sh.dout.data()), typename C::SmemQt{});
  Tensor sdS = make_tensor(make_smem_ptr(sh.ds.data()), typename C::SmemdS{});
  typename C::MmaSdP mma_sdp;
  typename C::MmadKV mma_dkv;
  typename C::MmadQ mma_dq;
  auto t_sdp = mma_sdp.get_thread_slice(tid);
  auto t_dkv = mma_dkv.get_thread_slice(tid);
  auto t_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrK = t_sdp.partition_fragment_A(sK);     // (MMA, MMA_M, MMA_K)
  Tensor tSrV = t_sdp.partition_fragment_A(sV);
  Tensor tSrQ = t_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
  Tensor tSrdO = t_sdp.partition_fragment_B(sdO);
  Tensor tdKrQt = t_dkv.partition_fragment_B(sQt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdVrdOt = t_dkv.partition_fragment_B(sdOt);
  Tensor tdQrdS = t_dq.partition_fragment_A(sdS);   // (MMA, MMA_M, MMA_K, buffer)
  Tensor tdQrKt = t_dq.partition_fragment_B(sKt);
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  clear(tdKrdK);
  clear(tdVrdV);
  Tensor cS = t_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));  // (key, query)
  Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));
  const float sl2 = p.scale_log2;
  const int key0 = nb * kBlockN;

  if (steps > 0) {
    auto ckv = cutlass::PipelineState<1>();
    pipe_kv.consumer_wait(ckv);
  }
  auto cq = cutlass::PipelineState<C::kStages>();
  for (int s = 0; s < steps; ++s) {
    const int m = m_begin + s % m_count;
    const int st = cq.index();
    const int buf = s & 1;
    pipe_q.consumer_wait(cq);
    bwd_consume_step<kD>(sh, pipe_q, cq, mma_sdp, mma_dkv, mma_dq, tSrK, tSrV, tSrQ, tSrdO, tdKrQt, tdVrdOt, tdQrdS,
                         tdQrKt, sdS, cS, cS_rc, tdKrdK, tdVrdV, st, buf, key0, blk.len, p.causal, p.kv_pos0,
                         p.q_pos0 + int64_t(m) * kBlockM, sl2, p.scale, tid);
  }
  // The reducing warp's last arrival (it has read the last tile).
  if (steps > 0) cutlass::arch::NamedBarrier::sync(kBwdDqThreads, kBwdDqEmptyBarrier);

  if (p.head_split > 1) {
    // Split schedule: this CTA's share of dK (scaled) and dV, added in fp32 (bwd_finish_dkv).
    if (steps == 0) return;
    const int64_t tiles = int64_t(gridDim.x) * p.Hkv * p.B;
    float* dk_t = p.dkv_acc + ((int64_t(b) * p.Hkv + hk) * gridDim.x + blockIdx.x) * (kBlockN * kD);
    float* dv_t = dk_t + tiles * (kBlockN * kD);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) {
      atomicAdd(dk_t + i * kMmaThreads + tid, tdKrdK(i) * p.scale);
      atomicAdd(dv_t + i * kMmaThreads + tid, tdVrdV(i));
    }
    return;
  }
  // dK (scaled) and dV of the block, bf16.
  Tensor cKV = t_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{}));  // (key, d)
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); i += 2) {
    const int key = key0 + get<0>(cKV(i)), d = get<1>(cKV(i));
    if (key >= blk.len) continue;
    const int64_t row = blk.row0 + key;
    Element* dk = p.dk + b * p.dk_sb + row * p.dk_ss + hk * p.dk_sh + d;
    Element* dv = p.dv + b * p.dv_sb + row * p.dv_ss + hk * p.dv_sh + d;
    *reinterpret_cast<__nv_bfloat162*>(dk) = __floats2bfloat162_rn(tdKrdK(i) * p.scale, tdKrdK(i + 1) * p.scale);
    *reinterpret_cast<__nv_bfloat162*>(dv) = __floats2bfloat162_rn(tdVrdV(i), tdVrdV(i + 1));
  }
#endif
}

template <int kD, class Comm_>
__global__ void __launch_bounds__(kThreads, 1) fmha_bwd_ring_kernel(__grid_constant__ const BwdParams<kD, Comm_> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = BwdCfg<kD>;
  using P = BwdParams<kD, Comm_>;
  constexpr int kBlockM = C::kBlockM, kBlockN = C::kBlockN;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sh = *reinterpret_cast<typename C::Shared*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % 4;
  [[maybe_unused]] const uint64_t epoch = Comm_::call_epoch(p.comm);
  // Traced: each CTA's life (Role::kCta, item 1 for a communication CTA, 0 for a compute one),
  // from its start to its end, so a timeline shows when each CTA became resident — also after
  // a wait gave up, when the CTAs still run to their end.
  const uint64_t t_start = p.trace.events ? device::trace_now_ns() : 0;

  // Roles interleaved by index (src/attention/ring_roles.h): a rank left without its last CTAs
  // (ranks sharing a GPU) still has both roles running.
  const int comm_ctas = Comm_::dedicated_ctas(p.comm);
  const RingRole role = ring_role(int(blockIdx.x), comm_ctas, int(gridDim.x));

  // The ring's dedicated communication CTAs: the consumer threads run the program's ops in
  // order (the same register budgets as the compute CTAs).
  if (role.comm) {
    if (wg == 0) cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (wg >= 1) {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      Comm_::template run_dedicated<true, kMmaThreads, kCommBarrier, sizeof(typename C::Shared)>(
          p.comm, smem_raw, threadIdx.x - 128, epoch, p.trace);
    }
    if (p.trace.events && threadIdx.x == 128) device::trace_record(p.trace, Role::kCta, 1, t_start);
    Comm_::finish(p.comm);
    return;
  }
  // Items in list order: the producer thread takes each from the counter and hands it to the
  // reducing warp and the consumers (sched); with no counter, items c, c + n, ... of n compute
  // CTAs. List order is step order, so a CTA waiting for a step's K/V holds no item of an earlier
  // step back. Each role keeps its current item in shared memory (sh.work[role], written by the
  // role's first thread): registers are short (the producer thread runs on 24).
  const int n_items = p.n_items;

  typename C::PipeKV::Params pkv;
  typename C::PipeQ::Params pq;
  if (wg == 0 && warp_in_wg == 0) {
    pkv.role = C::PipeKV::ThreadCategory::Producer;
    pq.role = C::PipeQ::ThreadCategory::Producer;
  }
  if (wg >= 1) {
    pkv.role = C::PipeKV::ThreadCategory::Consumer;
    pq.role = C::PipeQ::ThreadCategory::Consumer;
  }
  pkv.is_leader = pq.is_leader = (threadIdx.x % 128) == 0;
  pkv.num_consumers = pq.num_consumers = kMmaThreads;
  pkv.transaction_bytes = 2 * kBlockN * kD * sizeof(Element);
  pq.transaction_bytes = 2 * kBlockM * kD * sizeof(Element) + 2 * kBlockM * sizeof(float) +
                         (p.qwin ? kBlockM * sizeof(DocWindow) : 0);
  typename C::PipeKV pipe_kv(sh.pipe_kv, pkv, Shape<_1, _1, _1>{});
  typename C::PipeQ pipe_q(sh.pipe_q, pq, Shape<_1, _1, _1>{});
  typename C::PipeSched::Params ps;
  if (wg == 0 && warp_in_wg == 0) ps.role = C::PipeSched::ThreadCategory::Producer;
  if ((wg == 0 && warp_in_wg == 1) || wg >= 1) ps.role = C::PipeSched::ThreadCategory::Consumer;
  ps.producer_arv_count = 1;
  ps.consumer_arv_count = kBwdDqThreads;  // the consumers and the reducing warp
  typename C::PipeSched pipe_s(sh.pipe_s, ps);
  const FmhaScheduler<typename C::PipeSched> sched{p.item_counter != nullptr, role.compute_slot,
                                                   int(gridDim.x) - comm_ctas, p.item_counter, pipe_s, sh.sched};
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(sh.k.data()), typename C::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(sh.v.data()), typename C::SmemKV{});
  Tensor sQ = make_tensor(make_smem_ptr(sh.q.data()), typename C::SmemQ{});
  Tensor sdO = make_tensor(make_smem_ptr(sh.dout.data()), typename C::SmemQ{});

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0 && elect_one_sync()) {
      auto ss = cutlass::make_producer_start_state<typename C::PipeSched>();
      auto skv = cutlass::make_producer_start_state<typename C::PipeKV>();
      auto sq = cutlass::make_producer_start_state<typename C::PipeQ>();
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.Sq, kD, p.H, p.B));
      Tensor mdO = p.tma_do.get_tma_tensor(make_shape(p.Sq, kD, p.H, p.B));
      auto cq = p.tma_q.get_slice(0);
      auto cdo = p.tma_do.get_slice(0);
      Tensor tQs = cq.partition_D(sQ);
      Tensor tdOs = cdo.partition_D(sdO);
      for (int item = sched.producer_next(-1, ss); item < n_items; item = sched.producer_next(item, ss)) {
        BwdWork& w = sh.work[0];
        w = bwd_ring_work<kD, P>(p, item);
        if (w.steps == 0) continue;
        if constexpr (Comm_::kEnabled) {
          if (w.wait) {
            // The key block's rows arrived in the slot (every piece they touch, K and V).
            const uint64_t t0 = p.trace.events ? device::trace_now_ns() : 0;
            const FmhaSlots& sl = p.slots;
            const int r0 = w.row0 + w.n * kBlockN, r1 = w.row0 + min(w.len, (w.n + 1) * kBlockN) - 1;
            for (int c = r0 / sl.chunk_rows; c <= r1 / sl.chunk_rows; ++c) {
              const int idx = (w.slot * p.B + w.b) * sl.chunks + c;
              Comm_::wait_arrival(p.wait, sl.flags + idx, sl.wait_mul * epoch, w.slot, idx);
            }
            asm volatile("fence.proxy.async.global;" ::: "memory");
            if (p.trace.events && device::trace_now_ns() - t0 > 5000) device::trace_record(p.trace, Role::kWait, item, t0);
          }
        }
        pipe_kv.producer_acquire(skv);
        if (w.src == 0) {
          Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.Skv, kD, p.Hkv, p.B));
          Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.Skv, kD, p.Hkv, p.B));
          Tensor gK = local_tile(domain_offset(make_coord(w.row0, 0), mK(_, _, w.hk, w.b)),
                                 Shape<Int<kBlockN>, Int<kD>>{}, make_coord(w.n, 0));
          Tensor gV = local_tile(domain_offset(make_coord(w.row0, 0), mV(_, _, w.hk, w.b)),
                                 Shape<Int<kBlockN>, Int<kD>>{}, make_coord(w.n, 0));
          auto ck = p.tma_k.get_slice(0);
          auto cv = p.tma_v.get_slice(0);
          copy(p.tma_k.with(*pipe_kv.producer_get_barrier(skv)), ck.partition_S(gK), ck.partition_D(sK));
          copy(p.tma_v.with(*pipe_kv.producer_get_barrier(skv)), cv.partition_S(gV), cv.partition_D(sV));
        } else {
          Tensor mK = p.tma_ks.get_tma_tensor(make_shape(p.slots.rows, kD, p.Hkv, p.B, p.slots.slots));
          Tensor mV = p.tma_vs.get_tma_tensor(make_shape(p.slots.rows, kD, p.Hkv, p.B, p.slots.slots));
          Tensor gK = local_tile(domain_offset(make_coord(w.row0, 0), mK(_, _, w.hk, w.b, w.slot)),
                                 Shape<Int<kBlockN>, Int<kD>>{}, make_coord(w.n, 0));
          Tensor gV = local_tile(domain_offset(make_coord(w.row0, 0), mV(_, _, w.hk, w.b, w.slot)),
                                 Shape<Int<kBlockN>, Int<kD>>{}, make_coord(w.n, 0));
          auto ck = p.tma_ks.get_slice(0);
          auto cv = p.tma_vs.get_slice(0);
          copy(p.tma_ks.with(*pipe_kv.producer_get_barrier(skv)), ck.partition_S(gK), ck.partition_D(sK));
          copy(p.tma_vs.with(*pipe_kv.producer_get_barrier(skv)), cv.partition_S(gV), cv.partition_D(sV));
        }
        ++skv;
        for (int s = 0; s < w.steps; ++s) {
          const int sg = w.seg_of(s);
          const int h = w.head_of(s, sg), m = w.m_of(s, sg);
          const BwdSeg& g = w.seg[sg];
          pipe_q.producer_acquire(sq);
          auto* bar = pipe_q.producer_get_barrier(sq);
          Tensor gQ = local_tile(domain_offset(make_coord(g.q_row0, 0), mQ(_, _, h, w.b)),
                                 Shape<Int<kBlockM>, Int<kD>>{}, make_coord(m, 0));
          Tensor gdO = local_tile(domain_offset(make_coord(g.q_row0, 0), mdO(_, _, h, w.b)),
                                  Shape<Int<kBlockM>, Int<kD>>{}, make_coord(m, 0));
          copy(p.tma_q.with(*bar), cq.partition_S(gQ), tQs(_, _, _, sq.index()));
          copy(p.tma_do.with(*bar), cdo.partition_S(gdO), tdOs(_, _, _, sq.index()));
          const int64_t row = (int64_t(w.b) * p.H + h) * p.Sq_pad + int64_t(g.qb0 + m) * kBlockM;
          SM90_BULK_COPY_G2S::copy(p.lse2 + row, bar, &sh.lse2[sq.index()][0], kBlockM * int(sizeof(float)));
          SM90_BULK_COPY_G2S::copy(p.dsum + row, bar, &sh.dsum[sq.index()][0], kBlockM * int(sizeof(float)));
          if (p.qwin)
            SM90_BULK_COPY_G2S::copy(p.qwin + int64_t(g.qb0 + m) * kBlockM, bar, &sh.qwin[sq.index()][0],
                                     kBlockM * int(sizeof(DocWindow)));
          ++sq;
        }
      }
    } else if (warp_in_wg == 1) {
      // The reducing warp: each step's dQ tile, bulk-added into the workspace. The dQ tile's
      // barriers run on across items, one arrival of each side per phase: this warp frees the
      // tile once before the first step and after reading each step's (its arrivals are then
      // never two ahead of the consumers'; an arrival per item as well could complete a phase
      // of the empty barrier without a consumer warp that had not yet arrived — and hang it).
      cutlass::arch::NamedBarrier::arrive(kBwdDqThreads, kBwdDqEmptyBarrier);
      cutlass::PipelineState<2> cs;
      for (int item = sched.consumer_next(-1, cs); item < n_items; item = sched.consumer_next(item, cs)) {
        BwdWork& w = sh.work[1];
        __syncwarp();
        if (elect_one_sync()) w = bwd_ring_work<kD, P>(p, item);
        __syncwarp();
        if (w.steps == 0) continue;
        for (int s = 0; s < w.steps; ++s) {
          const int sg = w.seg_of(s);
          const int h = w.head_of(s, sg), m = w.m_of(s, sg);
          const int qb = w.seg[sg].qb0 + m;
          cutlass::arch::NamedBarrier::sync(kBwdDqThreads, kBwdDqFullBarrier);
          if (elect_one_sync()) {
            float* tile = p.dq_acc + ((int64_t(w.b) * p.H + h) * p.Sq_pad + int64_t(qb) * kBlockM) * kD;
            bulk_reduce_add_f32(tile, sh.dq, kBlockM * kD * int(sizeof(float)));
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
          }
          __syncwarp();
          cutlass::arch::NamedBarrier::arrive(kBwdDqThreads, kBwdDqEmptyBarrier);
        }
      }
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    const int tid = threadIdx.x - 128;  // 0..255 over both consumer warpgroups
    Tensor sKt = make_tensor(make_smem_ptr(sh.k.data()), typename C::SmemKt{});
    Tensor sQt = make_tensor(make_smem_ptr(sh.q.data()), typename C::SmemQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(sh.dout.data()), typename C::SmemQt{});
    Tensor sdS = make_tensor(make_smem_ptr(sh.ds.data()), typename C::SmemdS{});
    typename C::MmaSdP mma_sdp;
    typename C::MmadKV mma_dkv;
    typename C::MmadQ mma_dq;
    auto t_sdp = mma_sdp.get_thread_slice(tid);
    auto t_dkv = mma_dkv.get_thread_slice(tid);
    auto t_dq = mma_dq.get_thread_slice(tid);
    Tensor tSrK = t_sdp.partition_fragment_A(sK);     // (MMA, MMA_M, MMA_K)
    Tensor tSrV = t_sdp.partition_fragment_A(sV);
    Tensor tSrQ = t_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
    Tensor tSrdO = t_sdp.partition_fragment_B(sdO);
    Tensor tdKrQt = t_dkv.partition_fragment_B(sQt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tdVrdOt = t_dkv.partition_fragment_B(sdOt);
    Tensor tdQrdS = t_dq.partition_fragment_A(sdS);   // (MMA, MMA_M, MMA_K, buffer)
    Tensor tdQrKt = t_dq.partition_fragment_B(sKt);
    Tensor cS = t_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));  // (key, query)
    Tensor cS_rc = make_tensor(cS.data(), rowcol(cS.layout()));
    const float sl2 = p.scale_log2;
    auto ckv = cutlass::PipelineState<1>();
    auto cq = cutlass::PipelineState<C::kStages>();
    int buf_count = 0;  // steps so far over every item: the dS buffer alternates across items too
    cutlass::PipelineState<2> cs;
    for (int item = sched.consumer_next(-1, cs); item < n_items; item = sched.consumer_next(item, cs)) {
      BwdWork& w = sh.work[2];
      cutlass::arch::NamedBarrier::sync(kMmaThreads, kBwdDsBarrier);  // every consumer is done with the last item's
      if (tid == 0) {
        w = bwd_ring_work<kD, P>(p, item);
        if (p.trace.events) w.t0 = device::trace_now_ns();
      }
      cutlass::arch::NamedBarrier::sync(kMmaThreads, kBwdDsBarrier);
      const int key0 = w.n * kBlockN;
      Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
      Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
      clear(tdKrdK);
      clear(tdVrdV);
      if (w.steps > 0) pipe_kv.consumer_wait(ckv);
      for (int s = 0; s < w.steps; ++s, ++buf_count) {
        const int sg = w.seg_of(s);
        const int m = w.m_of(s, sg);
        const int st = cq.index();
        const int buf = buf_count & 1;
        pipe_q.consumer_wait(cq);
        const BwdSeg& g = w.seg[sg];
        const int64_t q_pos_m = g.q_pos0 + int64_t(m) * kBlockM;
        // Packed documents: the step masks by document unless the key block and the query
        // block lie in one document.
        const bool doc_step =
            p.qwin && !(w.doc_one && q_pos_m >= w.doc_lo && q_pos_m + kBlockM <= int64_t(w.doc_hi));
        bwd_consume_step<kD, true>(sh, pipe_q, cq, mma_sdp, mma_dkv, mma_dq, tSrK, tSrV, tSrQ, tSrdO, tdKrQt, tdVrdOt,
                                   tdQrdS, tdQrKt, sdS, cS, cS_rc, tdKrdK, tdVrdV, st, buf, key0, w.len, g.causal,
                                   w.kv_pos0, q_pos_m, sl2, p.scale, tid, doc_step);
      }
      if (w.steps > 0) {
        // K and V free for the next item: their last reader, the last step's dQ MMA, completed
        // (warpgroup_wait<0> in the step, in every consumer thread before it arrives here). The
        // last dQ tile is the reducing warp's until its next arrival (the next step's wait).
        pipe_kv.consumer_release(ckv);
        ++ckv;
      }

      // The item's fp32 tile of dK (scaled) then dV, in fragment order, into part; then its
      // piece's ready flag (the communication CTAs' sum waits for every item of the piece).
      float* t = p.part + w.tile * (2 * kBlockN * kD);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) {
        t[i * kMmaThreads + tid] = tdKrdK(i) * p.scale;
        t[kBlockN * kD + i * kMmaThreads + tid] = tdVrdV(i);
      }
      cutlass::arch::NamedBarrier::sync(kMmaThreads, kBwdDsBarrier);
      if (tid == 0) {
        __threadfence();
        asm volatile("fence.proxy.async.global;" ::: "memory");
        device::red_add_release_sys(p.ready + w.ready, 1);
        if (p.trace.events) device::trace_record(p.trace, Role::kCompute, item, w.t0);
      }
    }
  }
  if constexpr (Comm_::kEnabled) {
    // No item left: the consumers help the communication CTAs with the program's remaining ops
    // (the last steps' dK/dV sums, which 4 CTAs alone finished milliseconds after the last
    // item), taking them from the same counter in list order. Every K/V op comes before the
    // first sum and every item was taken by a running CTA, so an op a helper waits on needs only
    // running CTAs and the other ranks. The shared memory becomes bulk stages once every role
    // is done with it (the reducing warp's last bulk add has read its tile).
    if (Comm_::dedicated_ctas(p.comm) > 0) {
      __syncthreads();
      if (wg >= 1)
        Comm_::template run_dedicated<true, kMmaThreads, kBwdHelpBarrier, sizeof(typename C::Shared)>(
            p.comm, smem_raw, threadIdx.x - 128, epoch, p.trace);
    }
  }
  if (p.trace.events && threadIdx.x == 128) device::trace_record(p.trace, Role::kCta, 0, t_start);
  Comm_::finish(p.comm);
#endif
}

// dQ (bf16, strides) from the workspace's accumulator: one CTA of 256 threads per (query block,
// head, batch), thread t reading its fragment elements i at i * 256 + t; NaN when a
// deterministic call's wait gave up (abort word set). Packed calls: a virtual query block, its
// rows within its document.
template <int kD>
__global__ void __launch_bounds__(kMmaThreads) bwd_finish_dq(const float* acc, Element* dq, int64_t sb, int64_t ss,
                                                             int64_t sh, int H, int Sq, int Sq_pad,
                                                             const uint64_t* abort, const int32_t* cu, int n_docs) {
  using C = BwdCfg<kD>;
  constexpr int kBlockM = C::kBlockM;
  typename C::MmadQ mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));  // (query, d)
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const float* tile = acc + ((int64_t(b) * H + h) * Sq_pad + int64_t(m) * kBlockM) * kD;
  const bool poison = abort && *reinterpret_cast<const volatile uint64_t*>(abort) != 0;
  int row0 = 0, rows = Sq, first = m * kBlockM;  // the segment's rows, and the block's first within it
  if (cu) {
    const DocTile t = varlen_tile_warp(cu, n_docs, Sq, kBlockM, m);
    if (!varlen_valid(t, kBlockM)) return;
    row0 = t.row0, rows = t.len, first = t.local * kBlockM;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(c); i += 2) {
    const int local = first + get<0>(c(i)), d = get<1>(c(i));
    if (local >= rows) continue;
    const int64_t row = int64_t(row0) + local;
    const float x = tile[i * kMmaThreads + threadIdx.x], y = tile[(i + 1) * kMmaThreads + threadIdx.x];
    *reinterpret_cast<__nv_bfloat162*>(dq + b * sb + row * ss + h * sh + d) =
        poison ? __floats2bfloat162_rn(NAN, NAN) : __floats2bfloat162_rn(x, y);
  }
}

// dK and dV (bf16, strides) from the split schedule's fp32 accumulators: one CTA of 256 threads
// per key block (blockIdx.x as the main kernel's), key/value head and batch, thread t reading its
// fragment elements i at i * 256 + t.
template <int kD, class Comm_>
__global__ void __launch_bounds__(kMmaThreads) bwd_finish_dkv(const BwdParams<kD, Comm_> p) {
  using C = BwdCfg<kD>;
  typename C::MmadKV mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kBwdBlockN>, Int<kD>>{}));  // (key, d)
  const int hk = blockIdx.y, b = blockIdx.z;
  const BwdBlock blk = bwd_block(p, C::kBlockM);
  const int64_t tiles = int64_t(gridDim.x) * p.Hkv * p.B;
  const float* dk_t = p.dkv_acc + ((int64_t(b) * p.Hkv + hk) * gridDim.x + blockIdx.x) * (kBwdBlockN * kD);
  const float* dv_t = dk_t + tiles * (kBwdBlockN * kD);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(c); i += 2) {
    const int key = blk.n * kBwdBlockN + get<0>(c(i)), d = get<1>(c(i));
    if (key >= blk.len) continue;
    const int64_t row = blk.row0 + key;
    const int j = i * kMmaThreads + threadIdx.x, j1 = (i + 1) * kMmaThreads + threadIdx.x;
    *reinterpret_cast<__nv_bfloat162*>(p.dk + b * p.dk_sb + row * p.dk_ss + hk * p.dk_sh + d) =
        __floats2bfloat162_rn(dk_t[j], dk_t[j1]);
    *reinterpret_cast<__nv_bfloat162*>(p.dv + b * p.dv_sb + row * p.dv_ss + hk * p.dv_sh + d) =
        __floats2bfloat162_rn(dv_t[j], dv_t[j1]);
  }
}

// dK and dV (bf16) of the ring's own block from its fp32 tiles: the own items' plus, where
// own_sum says one came back, the other ranks' sum (bwd_launch.h BwdRing::own, own_acc). One CTA
// of 256 threads per (key block, key/value head, batch); key block kb is block kb % kb_per_chunk
// of chunk kb / kb_per_chunk, whose rows begin at chunk * chunk_len: chunk 0 has chunk_len rows,
// chunk 1 (zigzag) the rest of the block's `rows` (fewer on an uneven shard of odd length).
template <int kD>
__global__ void __launch_bounds__(kMmaThreads) bwd_ring_finish_dkv(const float* own, const float* own_acc,
                                                                   const uint8_t* own_sum, Element* dk, Element* dv,
                                                                   Strides dk_st, Strides dv_st, int Hkv, int kb,
                                                                   int kb_per_chunk, int chunk_len, int rows) {
  using C = BwdCfg<kD>;
  typename C::MmadKV mma;
  auto thr = mma.get_thread_slice(threadIdx.x);
  Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kBwdBlockN>, Int<kD>>{}));  // (key, d)
  const int kbi = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int chunk = kbi / kb_per_chunk, n = kbi % kb_per_chunk;
  const int len = chunk == 0 ? chunk_len : rows - chunk_len;
  const int64_t tile = ((int64_t(b) * kb + kbi) * Hkv + hk) * (2 * kBwdBlockN * kD);
  const float* t = own + tile;
  const float* u = own_sum && own_sum[int64_t(b) * kb + kbi] ? own_acc + tile : nullptr;  // the ring's sum
  auto at = [&](int j) { return u ? t[j] + u[j] : t[j]; };
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(c); i += 2) {
    const int key = n * kBwdBlockN + get<0>(c(i)), d = get<1>(c(i));
    if (key >= len) continue;
    const int64_t row = int64_t(chunk) * chunk_len + key;
    const int j = i * kMmaThreads + threadIdx.x, j1 = (i + 1) * kMmaThreads + threadIdx.x;
    *reinterpret_cast<__nv_bfloat162*>(dk + b * dk_st.b + row * dk_st.s + hk * dk_st.h + d) =
        __floats2bfloat162_rn(at(j), at(j1));
    *reinterpret_cast<__nv_bfloat162*>(dv + b * dv_st.b + row * dv_st.s + hk * dv_st.h + d) =
        __floats2bfloat162_rn(at(kBwdBlockN * kD + j), at(kBwdBlockN * kD + j1));
  }
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
