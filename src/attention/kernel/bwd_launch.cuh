// mkernel — the attention backward kernel's host-side launch: TMA descriptors, parameters and
// the launch. Included by the instantiation units sm90_fmha_bwd_d{64,128}.cu, so that the two
// head dimensions compile in parallel.
#pragma once

#include <cstdint>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "src/attention/bwd_launch.h"
#include "src/attention/kernel/bwd.cuh"

namespace mk {
namespace attention {
namespace sm90 {

template <int kD, class Smem_>
auto make_tma_bwd(const void* ptr, int S, int H, int B, const Strides& st, Smem_ smem) {
  auto t = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       make_layout(make_shape(S, kD, H, B), make_stride(st.s, _1{}, st.h, st.b)));
  return make_tma_copy(SM90_TMA_LOAD{}, t, smem);
}

template <int kD>
auto make_tma_bwd_slots(const void* ptr, int rows, int Hkv, int B, int slots) {
  const int64_t row = int64_t(Hkv) * kD;
  auto t = make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       make_layout(make_shape(rows, kD, Hkv, B, slots),
                                   make_stride(row, _1{}, int64_t(kD), int64_t(rows) * row, int64_t(B) * rows * row)));
  return make_tma_copy(SM90_TMA_LOAD{}, t, typename BwdCfg<kD>::SmemKV{});
}

template <int kD, class Comm_>
Status launch_bwd(const BackwardArgs& a, const BwdWorkspace& w, cudaStream_t stream, const BwdRing* ring) {
  using C = BwdCfg<kD>;
  BwdParams<kD, Comm_> p{};
  p.tma_q = make_tma_bwd<kD>(a.q, a.Sq, a.H, a.B, a.q_stride, take<0, 2>(typename C::SmemQ{}));
  p.tma_do = make_tma_bwd<kD>(a.dout, a.Sq, a.H, a.B, a.do_stride, take<0, 2>(typename C::SmemQ{}));
  p.tma_k = make_tma_bwd<kD>(a.k, a.Skv, a.Hkv, a.B, a.k_stride, typename C::SmemKV{});
  p.tma_v = make_tma_bwd<kD>(a.v, a.Skv, a.Hkv, a.B, a.v_stride, typename C::SmemKV{});
  if (ring) {
    p.tma_ks = make_tma_bwd_slots<kD>(ring->slots.k, ring->slots.rows, a.Hkv, a.B, ring->slots.slots);
    p.tma_vs = make_tma_bwd_slots<kD>(ring->slots.v, ring->slots.rows, a.Hkv, a.B, ring->slots.slots);
  } else {  // unused: any valid descriptor
    p.tma_ks = make_tma_bwd_slots<kD>(a.k, 1, 1, 1, 1);
    p.tma_vs = p.tma_ks;
  }
  p.B = a.B, p.H = a.H, p.Hkv = a.Hkv, p.Sq = a.Sq, p.Skv = a.Skv;
  p.Sq_pad = w.sq_pad;
  p.cu_seqlens = ring ? nullptr : a.cu_seqlens;  // the ring's query chunks: its pairs' segments
  p.n_docs = ring ? 0 : a.n_docs;
  p.m_blocks = w.sq_pad / C::kBlockM;
  p.lse2 = w.lse2;
  p.dsum = w.dsum;
  p.dq_acc = w.dq_acc;
  p.dq_order = w.order;
  p.dk = static_cast<Element*>(a.dk);
  p.dv = static_cast<Element*>(a.dv);
  p.dk_sb = a.dk_stride.b, p.dk_ss = a.dk_stride.s, p.dk_sh = a.dk_stride.h;
  p.dv_sb = a.dv_stride.b, p.dv_ss = a.dv_stride.s, p.dv_sh = a.dv_stride.h;
  p.scale = w.scale;
  p.scale_log2 = w.scale * 1.44269504088896340736f;
  p.causal = a.causal ? 1 : 0;
  p.deterministic = a.deterministic ? 1 : 0;
  p.q_pos0 = a.q_pos0, p.kv_pos0 = a.kv_pos0;
  p.wait = w.wait;
  p.head_split = w.head_split;
  p.dkv_acc = w.dkv_acc;
  if (ring) {
    p.pairs = ring->pairs;
    p.n_pairs = ring->n_pairs;
    p.n_items = ring->n_items;
    p.item_counter = ring->item_counter;
    if (ring->item_counter) MK_CUDA_CHECK(cudaMemsetAsync(ring->item_counter, 0, sizeof(int), stream));
    p.slots = ring->slots;
    p.part = ring->part;
    p.ready = ring->ready;
    p.ring_kb = ring->kb;
    p.ring_dpieces = ring->dpieces;
    p.ring_kb_per_piece = ring->kb_per_piece;
    p.doc_win = ring->doc_win;
    p.qwin = ring->qwin;
    p.trace = ring->trace;
    p.wait = ring->program.wait;
    p.head_split = 1;
    p.deterministic = 0;
  }
  if constexpr (Comm_::kEnabled) {
    p.comm.program = ring->program;
    p.comm.dedicated_ctas = ring->comm_ctas;
    if (ring->program.op_counter) MK_CUDA_CHECK(cudaMemsetAsync(ring->program.op_counter, 0, sizeof(int), stream));
  }
  const int smem = int(sizeof(typename C::Shared));
  static_assert(C::kBlockN == 128, "bwd_key_blocks counts 128-row key blocks");
  const int key_blocks = bwd_key_blocks(a);
  if constexpr (Comm_::kEnabled) {  // the ring's persistent launch
    auto kernel = fmha_bwd_ring_kernel<kD, Comm_>;
    MK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<ring->grid, kThreads, smem, stream>>>(p);
  } else {
    auto kernel = fmha_bwd_kernel<kD>;
    MK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<dim3(key_blocks, a.Hkv * w.head_split, a.B), kThreads, smem, stream>>>(p);
  }
  MK_CUDA_CHECK(cudaGetLastError());
  if (ring) {
    bwd_ring_finish_dkv<kD><<<dim3(ring->kb, a.Hkv, a.B), kMmaThreads, 0, stream>>>(
        ring->own, ring->own_acc, ring->own_sum, p.dk, p.dv, a.dk_stride, a.dv_stride, a.Hkv, ring->kb,
        ring->kb_per_chunk, ring->chunk_len, ring->rows);
    MK_CUDA_CHECK(cudaGetLastError());
  } else if (w.head_split > 1) {
    bwd_finish_dkv<kD, Comm_><<<dim3(key_blocks, a.Hkv, a.B), kMmaThreads, 0, stream>>>(p);
    MK_CUDA_CHECK(cudaGetLastError());
  }
  const dim3 grid_dq(p.m_blocks, a.H, a.B);
  bwd_finish_dq<kD><<<grid_dq, kMmaThreads, 0, stream>>>(w.dq_acc, static_cast<Element*>(a.dq), a.dq_stride.b,
                                                          a.dq_stride.s, a.dq_stride.h, a.H, a.Sq, w.sq_pad,
                                                          w.wait.abort, a.cu_seqlens, a.n_docs);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

template <int kD>
Status launch_bwd(const BackwardArgs& a, const BwdWorkspace& w, cudaStream_t stream, const BwdRing* ring) {
  return ring ? launch_bwd<kD, comm::CommRole>(a, w, stream, ring) : launch_bwd<kD, comm::NoComm>(a, w, stream, ring);
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
