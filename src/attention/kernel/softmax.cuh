// mkernel — the attention forward's masking and online softmax, in registers, on one consumer
// warpgroup's 64 rows of a (128 x 128) score tile S. The accumulator layouts are seen as
// (rows, cols) tensors (rowcol()): a thread holds kRows = 2 rows; a row's values are spread over
// the 4 threads of a quad, so row reductions end with quad shuffles.
#pragma once

#include <cmath>
#include <cstdint>

#include "src/attention/kernel/config.cuh"

namespace mk {
namespace attention {
namespace sm90 {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The document windows of a thread's rows as key columns of the item's segment (packed
// documents by position, communication variant): key column c is visible to row r iff
// lo[r] <= c < hi[r]. kOn_ false: none (plain launches; nothing kept).
template <int kRows_, bool kOn_>
struct RowDocs {
  static constexpr bool kOn = kOn_;
  bool on;
  int lo[kRows_], hi[kRows_];
};
template <int kRows_>
struct RowDocs<kRows_, false> {
  static constexpr bool kOn = false;
};

// Masks key tile j of S in place (-inf): keys past the segment, causal keys after the query
// and, with document windows, keys outside the row's document. s_rc / c_rc: the scores and
// their (row, col) coordinates in the tile; kv_len: the segment's key rows; q_pos_base: the
// global position of tile row 0; wg_c: the warpgroup's half of the tile (rows 64 wg_c ...).
template <int kBlockN_, class S_, class Coords_, class Docs_>
__device__ __forceinline__ void mask_tile(S_& s_rc, const Coords_& c_rc, const FmhaPair& pr, int kv_len, int j,
                                          int64_t q_pos_base, int wg_c, const Docs_& docs) {
  const int col0 = j * kBlockN_;
  const bool tail = col0 + kBlockN_ > kv_len;
  const bool diag = pr.causal && pr.kv_pos0 + col0 + kBlockN_ - 1 > q_pos_base + wg_c * 64;
  bool doc = false;
  if constexpr (Docs_::kOn) {
    if (docs.on) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(s_rc); ++r) doc = doc || col0 < docs.lo[r] || col0 + kBlockN_ > docs.hi[r];
    }
  }
  if (!tail && !diag && !doc) return;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < size<0>(s_rc); ++r) {
    const int64_t qpos = q_pos_base + get<0>(c_rc(r, 0));
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < size<1>(s_rc); ++c) {
      const int col = col0 + get<1>(c_rc(r, c));
      bool masked = col >= kv_len || (pr.causal && pr.kv_pos0 + col > qpos);
      if constexpr (Docs_::kOn) masked = masked || (doc && (col < docs.lo[r] || col >= docs.hi[r]));
      if (masked) s_rc(r, c) = -INFINITY;
    }
  }
}

// Running row maximum and sum of exponentials over the key tiles seen so far. Scores are in
// the natural scale; exponentials are taken base 2 with the softmax scale folded in
// (scale_log2 = scale * log2(e)).
template <int kRows_>
struct OnlineSoftmax {
  float row_max[kRows_], row_sum[kRows_];

  __device__ __forceinline__ void reset() {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows_; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }
  // Tile S (in place -> its exponentials); rescale[r]: the factor row r's earlier sum and
  // output must be multiplied by.
  template <class S_>
  __device__ __forceinline__ void update(S_& s_rc, float scale_log2, float (&rescale)[kRows_]) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows_; ++r) {
      float m = row_max[r];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) m = fmaxf(m, s_rc(r, c));
      m = quad_max(m);
      const float m_use = m == -INFINITY ? 0.f : m;  // a row that saw no key yet
      rescale[r] = exp2f((row_max[r] - m_use) * scale_log2);
      row_max[r] = m;
      const float off = m_use * scale_log2;
      float s = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const float e = exp2f(fmaf(s_rc(r, c), scale_log2, -off));
        s_rc(r, c) = e;
        s += e;
      }
      row_sum[r] = row_sum[r] * rescale[r] + s;
    }
  }
  // After the last key tile: O normalized by the row sums, and the rows' log-sum-exp (natural
  // log; -inf and O = 0 for a row that saw no key).
  template <class O_>
  __device__ __forceinline__ void finish(O_& o_rc, float scale_log2, float (&lse)[kRows_]) const {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows_; ++r) {
      const float l = quad_sum(row_sum[r]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      lse[r] = l > 0.f ? (row_max[r] * scale_log2 + __log2f(l)) * 0.69314718055994530942f : -INFINITY;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
    }
  }
};

}  // namespace sm90
}  // namespace attention
}  // namespace mk
