// mkernel — the attention forward's epilogue, per item and consumer warpgroup (64 query rows):
// after the softmax's normalization (OnlineSoftmax::finish) the rows' O and LSE either go
// straight out (bf16 O, fp32 LSE), or — when several pairs cover the same query segment (one per
// key block of the ring) — merge in the pairs' ordinal order through an fp32 accumulator:
// lse = log(e^lse_acc + e^lse_part), O = O_acc·e^(lse_acc−lse) + O_part·e^(lse_part−lse). A
// per-(tile, warpgroup) sequence counter orders the merges (bounded wait); the last pair writes
// the bf16 O and the LSE.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "cutlass/arch/barrier.h"
#include "mkernel/device/signal.cuh"
#include "src/attention/kernel/config.cuh"
#include "src/attention/kernel/scheduler.cuh"

namespace mk {
namespace attention {
namespace sm90 {

// o_rc / c_rc: the warpgroup's normalized O and its (row, col) coordinates in the tile; lse: the
// rows' log-sum-exp (updated by a merge); mma_tid: 0..255 over both consumer warpgroups. no_keys:
// the item saw no key (O = 0, LSE = -inf: packed documents by position): a merge that is not the
// last passes the order on without touching the accumulator (the first writes only its LSE).
template <int kD, class Comm_, class O_, class Coords_, int kRows_>
__device__ __forceinline__ void store_item(const Params<kD, Comm_>& p, O_& o_rc, const Coords_& c_rc,
                                           float (&lse)[kRows_], const ItemInfo& it, int wg_c, int mma_tid, int lane,
                                           bool no_keys = false) {
  const FmhaPair& pr = *it.pair;
  const bool last = pr.ordinal == pr.total - 1;
  const int rows_here = min(kTileM, it.q_len - it.qt * kTileM);  // <= 0: an empty item
  const int64_t row_base = int64_t(it.q_row0) + int64_t(it.qt) * kTileM;  // local row of tile row 0
  if (pr.total > 1) {
    // Merge with the previous pairs of this query segment, in ordinal order.
    const int cnt = pr.seq_base + (((it.b * p.H + it.h) * ((it.q_len + kTileM - 1) / kTileM) + it.qt) * 2 + wg_c);
    if (no_keys && !last) {
      // Nothing to add: the first of the segment marks the accumulator empty (LSE -inf: the next
      // merge takes none of its O); a later one leaves it as it is. Then the order goes on.
      if (pr.ordinal == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows_; ++r) {
          const int row = get<0>(c_rc(r, 0));
          if (row < rows_here && (lane & 3) == 0)
            p.lse_acc[(int64_t(it.b) * p.H + it.h) * p.Sq + row_base + row] = -INFINITY;
        }
        __threadfence();
        cutlass::arch::NamedBarrier::sync(128, kMergeBarrier0 + wg_c);
      } else if ((mma_tid % 128) == 0) {
        device::wait_ge(p.wait, p.seq + cnt, uint64_t(pr.ordinal), -1, cnt);
      }
      if ((mma_tid % 128) == 0) device::red_add_release_sys(p.seq + cnt, 1);
      return;
    }
    if (pr.ordinal > 0) {
      if ((mma_tid % 128) == 0) {
        const uint64_t* f = p.seq + cnt;
        device::wait_ge(p.wait, f, uint64_t(pr.ordinal), -1, cnt);
      }
      cutlass::arch::NamedBarrier::sync(128, kMergeBarrier0 + wg_c);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows_; ++r) {
        const int row = get<0>(c_rc(r, 0));
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
        for (int c = 0; c < size<1>(o_rc); c += 2) {
          const int col = get<1>(c_rc(r, c));
          const float2 a = *reinterpret_cast<const float2*>(acc + col);
          // fa = 0: an accumulator marked empty (its O never written this call: not read)
          o_rc(r, c) = (fa > 0.f ? a.x * fa : 0.f) + o_rc(r, c) * fb;
          o_rc(r, c + 1) = (fa > 0.f ? a.y * fa : 0.f) + o_rc(r, c + 1) * fb;
        }
        lse[r] = lnew;
      }
    }
    if (!last) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows_; ++r) {
        const int row = get<0>(c_rc(r, 0));
        if (row >= rows_here) continue;
        const int64_t bhs = (int64_t(it.b) * p.H + it.h) * p.Sq + row_base + row;
        float* acc = p.o_acc + bhs * kD;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(o_rc); c += 2) {
          const int col = get<1>(c_rc(r, c));
          *reinterpret_cast<float2*>(acc + col) = make_float2(o_rc(r, c), o_rc(r, c + 1));
        }
        if ((lane & 3) == 0) p.lse_acc[bhs] = lse[r];
      }
      __threadfence();
      cutlass::arch::NamedBarrier::sync(128, kMergeBarrier0 + wg_c);
      if ((mma_tid % 128) == 0) device::red_add_release_sys(p.seq + cnt, 1);
      return;
    }
  }
  // Final: bf16 O and the LSE.
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < kRows_; ++r) {
    const int row = get<0>(c_rc(r, 0));
    if (row >= rows_here) continue;
    const int64_t srow = row_base + row;
    Element* out = p.o + it.b * p.o_sb + srow * p.o_ss + it.h * p.o_sh;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < size<1>(o_rc); c += 2) {
      const int col = get<1>(c_rc(r, c));
      __nv_bfloat162 v = __floats2bfloat162_rn(o_rc(r, c), o_rc(r, c + 1));
      *reinterpret_cast<__nv_bfloat162*>(out + col) = v;
    }
    if (p.lse && (lane & 3) == 0) p.lse[(int64_t(it.b) * p.H + it.h) * p.Sq + srow] = lse[r];
  }
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
