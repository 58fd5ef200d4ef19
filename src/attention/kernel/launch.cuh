// mkernel — the attention kernel's host-side launch: TMA descriptors, parameters, and the launch
// of one variant. Included by the instantiation units sm90_fmha_d{64,128}{,_comm}.cu, so that
// the variants compile in parallel.
#pragma once

#include <cmath>
#include <cstdint>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "src/attention/fmha_launch.h"
#include "src/attention/kernel/fmha_kernel.cuh"
#include "src/comm/comm_role.cuh"

namespace mk {
namespace attention {
namespace sm90 {

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

template <int kD, bool kTrace_, class Comm_>
Status launch(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid) {
  using C = Cfg<kD>;
  Params<kD, Comm_> p{};
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
  p.item_counter = l.item_counter;
  p.cu_seqlens = l.cu_seqlens;
  p.n_docs = l.n_docs;
  p.cu_in_smem = l.cu_seqlens && l.n_docs + 1 <= kVarlenSmemEntries;
  p.doc_win = l.doc_win;
  p.wait = l.program.wait;
  if constexpr (Comm_::kEnabled) {
    p.comm.program = l.program;
    p.comm.dedicated_ctas = l.comm_ctas;
  }
  if constexpr (kTrace_) p.trace = *l.trace;
  if (l.item_counter) MK_CUDA_CHECK(cudaMemsetAsync(l.item_counter, 0, sizeof(int), stream));
  if (l.seq && l.n_seq && l.reset_seq) MK_CUDA_CHECK(cudaMemsetAsync(l.seq, 0, size_t(l.n_seq) * 8, stream));
  if (l.program.op_counter) MK_CUDA_CHECK(cudaMemsetAsync(l.program.op_counter, 0, sizeof(int), stream));
  const int smem = int(sizeof(typename C::Shared)) + (p.cu_in_smem ? (l.n_docs + 1) * int(sizeof(int32_t)) : 0);
  auto kernel = fmha_kernel<kD, kTrace_, Comm_>;
  MK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
