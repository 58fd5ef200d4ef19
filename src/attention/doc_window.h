// mkernel — packed documents by global position: the document window of a token.
//
// Ring attention over packed documents (RingAttentionArgs::cu_seqlens) shards the packed
// sequence like any other, so a query chunk and a key chunk hold pieces of any documents. A
// kernel masks by position instead of by segment: token `pos` belongs to the document
// [lo, hi) around it, and key j is visible to query i iff lo(i) <= j < hi(i) (and j <= i when
// causal). Positions before cu[0] form one document, as do those at or past cu[n_docs]; entries
// are clamped to [0, S]. The window always contains pos — whatever cu holds, a row sees at least
// itself, so no row is left without keys (a wrong cu gives wrong rows, never NaN or an access
// outside the tensors). Host and device code (the windows kernel; the CPU tests).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MK_DOC_HD __host__ __device__ __forceinline__
#else
#define MK_DOC_HD inline
#endif

namespace mk {
namespace attention {

struct DocWindow {
  int32_t lo, hi;  // the document [lo, hi) that holds the position
};

MK_DOC_HD int32_t doc_clamp(int32_t x, int32_t S) { return x < 0 ? 0 : (x > S ? S : x); }

// cu: n_docs + 1 entries (device memory on the device); 0 <= pos < S.
MK_DOC_HD DocWindow doc_window(const int32_t* cu, int n_docs, int32_t S, int32_t pos) {
  int lo = 0, hi = n_docs;  // the last boundary d with cu[d] <= pos, or -1
  int found = -1;
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    if (doc_clamp(cu[mid], S) <= pos) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  DocWindow w;
  w.lo = found < 0 ? 0 : doc_clamp(cu[found], S);
  const int32_t next = found < n_docs ? doc_clamp(cu[found + 1], S) : S;
  w.hi = next > pos ? next : S;
  if (w.lo > pos) w.lo = 0;  // a non-monotonic cu: still a window around pos
  return w;
}

// For a non-decreasing cu the windows grow with the position (lo and hi never decrease), so the
// spans below bound a whole tile's visible pairs by its first and last rows.
// The keys [*lo, *hi) that some query of the rows [q_first, q_last] sees (first, last: those rows'
// windows): from the first row's document start to the last row's document end, or to the last
// row itself when causal.
MK_DOC_HD void doc_keys_of_rows(DocWindow first, DocWindow last, int64_t q_last, bool causal, int64_t* lo,
                                int64_t* hi) {
  *lo = first.lo;
  *hi = causal ? q_last + 1 : last.hi;
}
// The queries [*lo, *hi) that some key of the keys [k_first, k_last] sees (first, last: those
// keys' windows): from the first key itself (causal) or its document's start, to the last key's
// document end.
MK_DOC_HD void doc_rows_of_keys(DocWindow first, DocWindow last, int64_t k_first, bool causal, int64_t* lo,
                                int64_t* hi) {
  *lo = causal ? k_first : first.lo;
  *hi = last.hi;
}

}  // namespace attention
}  // namespace mk
