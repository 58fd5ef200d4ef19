// mkernel — the attention forward's work items and their schedule.
//
// A work item is (pair, batch, head, 128-row query tile); items are numbered pair by pair
// (FmhaPair::item0) and, within a pair, head by head. Packed variable-length launches (one
// pair, B = 1) number items (virtual tile of a document, head) instead (varlen.cuh); a virtual
// tile that is no tile of its document is an empty item (no key tiles, no rows). Two schedules over the compute CTAs (the
// grid less the communication role's dedicated CTAs):
//   static   compute CTA c takes items c, c + n, ... (n compute CTAs); producer and consumers
//            walk them alike. Single calls: measured 2-4 % faster than the dynamic one at
//            S = 4096 on the H200 (docs/attention.md).
//   dynamic  the producer thread takes items from a global counter (zeroed by the launch) in
//            item order and hands each to the consumers through a two-slot ring in shared
//            memory. The ring's launches (FmhaLaunch::item_counter set).
#pragma once

#include <cstdint>

#include "src/attention/kernel/config.cuh"
#include "src/attention/kernel/varlen.cuh"

namespace mk {
namespace attention {
namespace sm90 {

struct ItemInfo {
  const FmhaPair* pair;  // the mask, positions, source and merge order
  int b, h, qt;          // batch, head, query tile within the segment
  // The segment: query rows [q_row0, q_row0 + q_len) and key rows [kv_row0, kv_row0 + kv_len)
  // (the pair's, or a document's).
  int q_row0, q_len, kv_row0, kv_len;
};

// cu: the launch's cu_seqlens (a copy in shared memory when it fits), null for pair launches.
template <int kD, class Comm_>
__device__ __forceinline__ ItemInfo item_info(const Params<kD, Comm_>& p, int item, const int32_t* cu) {
  if (p.cu_seqlens) {
    // Heads innermost: a static schedule's CTAs then see every document's tiles alike (the
    // static schedule modelled 0.78 of the mean load per CTA with heads outermost, 0.93 with
    // them innermost, for 4 causal documents of 8192 rows, H 16).
    const int h = item % p.H;
    const DocTile t = varlen_tile(cu, p.n_docs, p.Sq, kTileM, item / p.H);
    if (!varlen_valid(t, kTileM)) return ItemInfo{&p.single, 0, h, 0, t.row0, 0, t.row0, 0};
    const int qtiles = (t.len + kTileM - 1) / kTileM;
    const int qt = p.single.causal ? qtiles - 1 - t.local : t.local;  // causal: longest tiles first
    return ItemInfo{&p.single, 0, h, qt, t.row0, t.len, t.row0, t.len};
  }
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
  return ItemInfo{pr, bh / p.H, bh % p.H, qt, pr->q_row0, pr->q_len, pr->kv_row0, pr->kv_len};
}

// Key tiles an item visits: all of the segment, or up to the last visible key when causal; none
// for an empty item.
__device__ __forceinline__ int kv_tiles_of(const ItemInfo& it, int block_n) {
  const FmhaPair& pr = *it.pair;
  const int qt = it.qt;
  if (qt * kTileM >= it.q_len) return 0;
  int n = (it.kv_len + block_n - 1) / block_n;
  if (pr.causal) {
    const int q_last = min(it.q_len, (qt + 1) * kTileM) - 1;
    const int64_t last_key = pr.q_pos0 + q_last - pr.kv_pos0;  // last visible key row
    if (last_key < 0) return 0;
    n = min<int64_t>(n, last_key / block_n + 1);
  }
  return n;
}

// The key tiles [j0, n) an item visits: kv_tiles_of's, and — packed documents by position
// (Params::doc_win, communication variant) — from the tile holding the first row's document
// start to the one holding the last row's document end (or the last row, causal); the rows'
// windows grow with the row, so every key a row of the item sees lies in the span. n = 0 when
// no row sees a key of the segment (an empty item: O = 0, LSE = -inf, merged as nothing).
struct KvSpan {
  int j0, n;
};
template <int kD, class Comm_>
__device__ __forceinline__ KvSpan kv_span(const Params<kD, Comm_>& p, const ItemInfo& it, int block_n) {
  KvSpan s{0, kv_tiles_of(it, block_n)};
  if constexpr (Comm_::kEnabled) {
    if (s.n == 0 || !p.doc_win) return s;
    const FmhaPair& pr = *it.pair;
    const int rows = min(kTileM, it.q_len - it.qt * kTileM);
    const int64_t qf = pr.q_pos0 + int64_t(it.qt) * kTileM, ql = qf + rows - 1;
    int64_t klo, khi;
    doc_keys_of_rows(p.doc_win[qf], p.doc_win[ql], ql, pr.causal != 0, &klo, &khi);
    const int64_t lo = max<int64_t>(klo - pr.kv_pos0, 0), hi = min<int64_t>(khi - pr.kv_pos0, it.kv_len);
    if (hi <= lo) return KvSpan{0, 0};
    s.j0 = int(lo / block_n);
    s.n = min(s.n, int((hi + block_n - 1) / block_n));
  }
  return s;
}

// Items in turn; the first call passes prev = -1. A result >= n_items is the end.
template <class PipeSched_>
struct FmhaScheduler {
  bool dynamic;
  int cta, ncta;  // this CTA's index among the compute CTAs, and their number
  int* counter;   // dynamic: the next item
  PipeSched_& pipe;
  int* slots;     // the ring's two item slots (shared memory)

  // The producer thread: the next item; dynamic: taken from the counter and published (the end
  // too, so the consumers stop).
  template <class State_>
  __device__ __forceinline__ int producer_next(int prev, State_& s) const {
    if (!dynamic) return prev < 0 ? cta : prev + ncta;
    pipe.producer_acquire(s);
    const int item = atomicAdd(counter, 1);
    slots[s.index()] = item;
    pipe.producer_commit(s);
    ++s;
    return item;
  }
  // The consumer threads: the same items.
  template <class State_>
  __device__ __forceinline__ int consumer_next(int prev, State_& s) const {
    if (!dynamic) return prev < 0 ? cta : prev + ncta;
    pipe.consumer_wait(s);
    const int item = slots[s.index()];
    pipe.consumer_release(s);
    ++s;
    return item;
  }
};

}  // namespace sm90
}  // namespace attention
}  // namespace mk
