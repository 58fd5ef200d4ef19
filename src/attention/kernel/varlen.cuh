// mkernel — packed variable-length sequences (cu_seqlens) as the attention kernels see them.
//
// The documents' row tiles are numbered without a prefix sum over the documents: document d's
// tiles of `tile` rows take the *virtual* numbers vstart(d) .. vstart(d) + ceil(len_d / tile) - 1
// with vstart(d) = floor(cu[d] / tile) + d. Since floor(cu[d + 1] / tile) - floor(cu[d] / tile) + 1
// >= ceil(len_d / tile), the documents' ranges never overlap, at most one number per document goes
// unused, and all of them lie below varlen_tiles(S, n_docs, tile) = floor(S / tile) + n_docs + 1
// (fmha_launch.h).
// vstart is strictly increasing, so a virtual tile finds its document by binary search over
// cu_seqlens. Entries are clamped to [0, S] (and a document's end to at least its start), so a bad
// cu_seqlens can give wrong results but never a read or write outside the tensors.
#pragma once

#include <cstdint>

namespace mk {
namespace attention {
namespace sm90 {

struct DocTile {
  int doc;    // the document
  int row0;   // its first row
  int len;    // its rows
  int local;  // the tile within the document: valid when 0 <= local < ceil(len / tile)
};

__device__ __forceinline__ int varlen_clamp(int x, int S) { return min(max(x, 0), S); }

// cu: n_docs + 1 entries (shared or global memory).
__device__ __forceinline__ DocTile varlen_tile(const int32_t* cu, int n_docs, int S, int tile, int v) {
  int lo = 0, hi = n_docs - 1;  // the last document with vstart <= v
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (varlen_clamp(cu[mid], S) / tile + mid <= v)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int r0 = varlen_clamp(cu[lo], S);
  const int r1 = max(r0, varlen_clamp(cu[lo + 1], S));
  return DocTile{lo, r0, r1 - r0, v - (r0 / tile + lo)};
}

// The same, by a whole warp (all 32 lanes call it with the same arguments and get the same
// result): each round the lanes probe 32 documents of the remaining range at once, so a search
// over n documents takes ceil(log32 n) dependent loads instead of ceil(log2 n) (global memory:
// about 0.5 us each, before a CTA of the backward can start).
__device__ __forceinline__ DocTile varlen_tile_warp(const int32_t* cu, int n_docs, int S, int tile, int v) {
  const int lane = threadIdx.x % 32;
  int lo = 0, hi = n_docs - 1;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 32) / 32;  // lanes probe lo + step * lane (lane 0: lo, always <= v)
    const int d = lo + step * lane;
    const bool ok = d <= hi && varlen_clamp(cu[d], S) / tile + d <= v;
    const int last = 31 - __clz(__ballot_sync(0xffffffffu, ok) | 1u);  // the last probe <= v
    lo = lo + step * last;
    hi = min(hi, lo + step - 1);
  }
  const int r0 = varlen_clamp(cu[lo], S);
  const int r1 = max(r0, varlen_clamp(cu[lo + 1], S));
  return DocTile{lo, r0, r1 - r0, v - (r0 / tile + lo)};
}

__device__ __forceinline__ bool varlen_valid(const DocTile& t, int tile) {
  return t.local >= 0 && t.local * tile < t.len;
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
