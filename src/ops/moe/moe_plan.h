// mkernel — MoE dispatch/combine: geometry and the routing rules (pure host code, no CUDA; the
// communication programs are moe_program.h). The GPU kernels (moe_kernels.cu) implement exactly the rules
// written here on the CPU (route_source, dest_layout, pack_record_slot, unpack_slots), which the
// CPU tests replay for many world sizes, node layouts and routings, and the GPU tests take as
// the expected layout.
//
// A call's data path (dispatch; combine is the same with rows going back):
//   1. route (source rank s): for every token t < n and slot kk with a valid expert e = ids[t, kk]
//      (rank r = e / E_local): the token is sent once to r (a record, ordered by token), and the
//      entry (t, kk) gets its rank among s's entries for expert e (erank) and among s's entries
//      for rank r (cpos: its row in r's combine slot for s).
//   2. pack: records into the send slot for r (header: byte count, records, entries, and the
//      per-local-expert counts of r's experts), the own slot straight into the receive slot;
//   3. the program (runner kernel): entry handshakes, one copy (same node) or put (other node)
//      per destination with a run-time byte count (the slot's header), arrival flags;
//   4. unpack (rank r): per local expert, counts summed over sources, offsets aligned to
//      expert_align; row of entry (s, t, kk) = offsets[e] + sum_{s' < s} count[s'][e] + erank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/device/command.h"  // MK_HOST_DEVICE
#include "mkernel/ops/moe.h"
#include "src/comm/program.h"

namespace mk {
namespace ops {

// Record: [row: H bf16][meta: int32 token, nk, cbase, src; then k x {int32 local expert or -1,
// int32 erank}], padded to 16 bytes. Dispatch slot: [header][records]; header: uint64 bytes in
// use (header included), uint32 records, uint32 entries (combine rows back), int32 count[E_local],
// padded to 16 bytes. Combine slot: [16-byte header: uint64 bytes in use][rows, cpos order].
struct MoeGeometry {
  int W = 1, E = 0, El = 0, k = 0, align = 1;
  int64_t H = 0, T = 0;          // hidden, max tokens per rank
  int64_t row_bytes = 0;         // H * 2
  int64_t meta_bytes = 0;
  int64_t rec_bytes = 0;         // row_bytes + meta_bytes
  int64_t hdr_bytes = 0;         // dispatch slot header
  int64_t slot_bytes = 0;        // hdr_bytes + T * rec_bytes
  int64_t comb_per_src = 0;      // T * k: most entries one source sends one rank
  int64_t chdr_bytes = 16;
  int64_t cslot_bytes = 0;       // chdr_bytes + comb_per_src * row_bytes
  int64_t worst_rows = 0;        // W * comb_per_src + El * (align - 1)
  int64_t recv_rows = 0;         // receive layout rows (config, or worst_rows)
};
Status moe_geometry(const MoeConfig& c, int world, MoeGeometry* out);


constexpr int kMetaToken = 0, kMetaNk = 1, kMetaCbase = 2, kMetaSrc = 3, kMetaSlots = 4;  // int32 indices

// What one source computes in route (the rules above), for n tokens with ids [n, k].
struct SourceRoute {
  std::vector<std::vector<int32_t>> rec_tokens;  // [W] tokens sent to each rank, in order
  std::vector<int32_t> erank;                    // [n * k] -1 for no expert
  std::vector<int32_t> cpos;                     // [n * k]
  std::vector<int32_t> cbase;                    // [W * n]: entries of tokens < t bound for r (record meta)
  std::vector<int32_t> ecount;                   // [E] entries per expert
  std::vector<int32_t> ncomb;                    // [W] entries per rank
};
// Ids out of [-1, E) are left out (as the device does) and counted in *bad.
void route_source(const MoeGeometry& g, const int32_t* ids, int64_t n, SourceRoute* out, int64_t* bad);

// Throughput mode across nodes (hierarchical): a token bound for ranks of a remote node crosses
// the network once, as a node record, to the rank of that node with the sender's local index
// (its twin), which writes the token's records for its node's ranks straight into their receive
// slots (the same bytes pack_record_slot makes at the source) over peer stores.
// Node record: [row][meta: int32 token, src, 0, 0; k x {global expert on the node or -1, erank,
// cpos}; L x {record index for local rank l or -1}], padded to 16 bytes. Node slot: [header:
// uint64 bytes in use, uint32 records, uint32 0, then per local rank l: uint32 records, uint32
// entries, int32 count[E_local]][records].
struct MoeNodeGeometry {
  int local = 1;                 // ranks per node
  int64_t nmeta_bytes = 0, nrec_bytes = 0, nhdr_bytes = 0, nslot_bytes = 0;
};
MoeNodeGeometry moe_node_geometry(const MoeGeometry& g, int local);
constexpr int kNodeMetaSlots = 4;  // int32 index of slot 0's {expert, erank, cpos}

// Tokens of source `me` bound for each node (node records; the own node's list stays empty).
std::vector<std::vector<int32_t>> node_tokens(const MoeGeometry& g, const comm::Layout& layout, int me,
                                              const int32_t* ids, int64_t n);
// Source s's node slot for node `node` (its twin there), as the pack kernel writes it.
void pack_node_slot(const MoeGeometry& g, const MoeNodeGeometry& ng, const comm::Layout& layout, int s, int node,
                    const uint16_t* x, const int32_t* ids, const SourceRoute& route, uint8_t* slot);
// At the twin: source s's record slot for local rank d of this node (d a global rank on it), from
// the node slot — byte for byte what pack_record_slot(g, s, d, ...) writes, but the padding.
void repack_node_slot(const MoeGeometry& g, const MoeNodeGeometry& ng, const comm::Layout& layout, int s, int d,
                      const uint8_t* nslot, uint8_t* slot);

// The small-batch route (route_pack, moe_kernels.cu: one CTA per token), shared with the CPU
// test that checks it against route_source. Token t's slots: ex[kk] its expert (-1: none or
// invalid), rk[kk] its rank (-1). small_route_own: slot kk's counts among the token's earlier
// slots (entries of its expert, entries of its rank) and whether it is the token's first for its
// rank (its record). small_route_before: the entries of one earlier token t2 (expert(j): its slot
// j's expert, -1 for none or invalid), added through add(counter, value): erank, cpos, and the
// record position of the slots that are their rank's first. Summed over every t2 < t they give
// route_source's erank, cpos and the record's index in rec_tokens.
MK_HOST_DEVICE inline void small_route_own(int k, int kk, const int32_t* ex, const int32_t* rk, int32_t* er,
                                           int32_t* cp, bool* first) {
  int32_t ce = 0, cr = 0;
  bool f = rk[kk] >= 0;
  for (int k2 = 0; k2 < kk; ++k2) {
    ce += ex[k2] == ex[kk];
    cr += rk[k2] == rk[kk];
    f = f && rk[k2] != rk[kk];
  }
  *er = ce;
  *cp = cr;
  *first = f;
}
template <class Expert, class Add>
MK_HOST_DEVICE inline void small_route_before(int k, int El, Expert expert, const int32_t* ex, const int32_t* rk,
                                              const bool* first, int32_t* er, int32_t* cp, int32_t* rp, Add add) {
  uint32_t holds = 0;  // own slots whose rank the token has an entry for
  for (int j = 0; j < k; ++j) {
    const int32_t e2 = expert(j);
    if (e2 < 0) continue;
    const int r2 = e2 / El;
    for (int kk = 0; kk < k; ++kk) {
      if (ex[kk] == e2) add(&er[kk], 1);
      if (rk[kk] == r2) {
        add(&cp[kk], 1);
        holds |= 1u << kk;
      }
    }
  }
  for (int kk = 0; kk < k; ++kk)
    if (((holds >> kk) & 1u) && first[kk]) add(&rp[kk], 1);
}

// One row of a rank's expert-major receive layout.
struct RowOrigin {
  int32_t src = -1, token = -1, slot = -1;  // -1: an alignment gap or unused
};
struct DestLayout {
  std::vector<int32_t> counts;    // [El]
  std::vector<int32_t> offsets;   // [El + 1]; offsets[El]: rows in use (may exceed recv_rows)
  std::vector<RowOrigin> rows;    // [offsets[El]]
};
// Rank r's layout from every source's ids (ids[s]: [n[s], k]) and routes.
void dest_layout(const MoeGeometry& g, int r, const std::vector<const int32_t*>& ids, const std::vector<int64_t>& n,
                 const std::vector<SourceRoute>& routes, DestLayout* out);

// The receive layout from the W slots' headers (headers[s]: source s's slot, its header at least):
// counts [El], offsets [El + 1] and base [W][El] (the row where source s's rows of local expert le
// begin: offsets[le] + the counts of the sources before s).
void layout_from_headers(const MoeGeometry& g, const std::vector<const uint8_t*>& headers, int32_t* counts,
                         int32_t* offsets, int32_t* base);
// One source's records [first, end) (clamped to the records in its slot) into recv_x at the rows
// base_s (its [El] of base) gives, with the way back of each row; returns the rows dropped past
// recv_rows.
int64_t unpack_source(const MoeGeometry& g, const uint8_t* slot, const int32_t* base_s, uint16_t* recv_x,
                      int32_t* back, uint32_t first = 0, uint32_t end = 0xffffffffu);
// The fused layer's GEMM units (moe_program.h, build_moe_layer_program), per tile row of an
// expert's rows. Whether source s has rows in rows [r0, r1) of local expert le: base [W][El]
// (layout_from_headers), `end` = offsets[le] + counts[le] (where the last source's rows end).
MK_HOST_DEVICE inline bool moe_tile_has_source(const int32_t* base, int W, int El, int le, int64_t end, int64_t r0,
                                               int64_t r1, int s) {
  const int64_t b0 = base[s * El + le];
  const int64_t b1 = s + 1 < W ? base[(s + 1) * El + le] : end;
  return b1 > b0 && b0 < r1 && r0 < b1;
}

// The fused layer's work queue: one counter per call, items handed out in this order (a unit
// waits only for units before it, so no CTA count deadlocks): the layout; unpack(i, c) for
// source me + i (i = 0: the own slot) and chunk c; every tile of the first GEMM; every tile of
// the second; the combine's chunks of the own tokens. The GEMMs' items follow from the layout's
// counts (tile_prefix, moe_layer_tile_prefix): per expert its tile rows times the column tiles,
// tile rows fastest (consecutive items share the weights' tile); an expert without rows has none
// (the layout raises its flags instead).
struct MoeLayerQueue {
  int W = 1, El = 1;
  int unpack_chunks = 1, combine_chunks = 1;
  int tile_rows = 128;             // rows of a GEMM tile
  int tiles_n1 = 1, tiles_n2 = 1;  // column tiles of the first GEMM (SwiGLU outputs) and the second
};
enum MoeLayerItemKind : int { kMoeItemLayout = 0, kMoeItemUnpack, kMoeItemGemm1, kMoeItemGemm2, kMoeItemCombine,
                              kMoeItemNone };
struct MoeLayerItem {
  int kind = kMoeItemNone;
  int a = 0, b = 0, c = 0;  // unpack: source index i, chunk; gemm: local expert, tile row, column tile; combine: chunk
};
// Tile rows of `count` rows.
MK_HOST_DEVICE inline int moe_tile_rows(int64_t count, int tile_rows) {
  return int((count + tile_rows - 1) / tile_rows);
}
// tile_prefix [El + 1]: the tile rows of the experts before le (from counts [El]).
MK_HOST_DEVICE inline void moe_layer_tile_prefix(const MoeLayerQueue& q, const int32_t* counts, int32_t* tile_prefix) {
  tile_prefix[0] = 0;
  for (int le = 0; le < q.El; ++le) tile_prefix[le + 1] = tile_prefix[le] + moe_tile_rows(counts[le], q.tile_rows);
}
// Items before the layout's counts are needed, and all of a call.
MK_HOST_DEVICE inline int64_t moe_layer_static_items(const MoeLayerQueue& q) {
  return 1 + int64_t(q.W) * q.unpack_chunks;
}
MK_HOST_DEVICE inline int64_t moe_layer_items(const MoeLayerQueue& q, const int32_t* tile_prefix) {
  return moe_layer_static_items(q) + int64_t(tile_prefix[q.El]) * (q.tiles_n1 + q.tiles_n2) + q.combine_chunks;
}
// Item `item` of the queue (tile_prefix: read only past the static items; kMoeItemNone past the end).
MK_HOST_DEVICE inline MoeLayerItem moe_layer_item(const MoeLayerQueue& q, const int32_t* tile_prefix, int64_t item) {
  MoeLayerItem it;
  if (item < 0) return it;
  if (item == 0) {
    it.kind = kMoeItemLayout;
    return it;
  }
  int64_t i = item - 1;
  if (i < int64_t(q.W) * q.unpack_chunks) {
    it.kind = kMoeItemUnpack;
    it.a = int(i / q.unpack_chunks);
    it.b = int(i % q.unpack_chunks);
    return it;
  }
  i -= int64_t(q.W) * q.unpack_chunks;
  for (int g = 0; g < 2; ++g) {
    const int tn = g == 0 ? q.tiles_n1 : q.tiles_n2;
    const int64_t n = int64_t(tile_prefix[q.El]) * tn;
    if (i < n) {
      int lo = 0, hi = q.El - 1;  // the expert whose items hold i: tile_prefix[le] * tn <= i
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (int64_t(tile_prefix[mid]) * tn <= i) lo = mid;
        else hi = mid - 1;
      }
      const int rows = tile_prefix[lo + 1] - tile_prefix[lo];
      const int64_t local = i - int64_t(tile_prefix[lo]) * tn;
      it.kind = g == 0 ? kMoeItemGemm1 : kMoeItemGemm2;
      it.a = lo;
      it.b = int(local % rows);
      it.c = int(local / rows);
      return it;
    }
    i -= n;
  }
  if (i < q.combine_chunks) {
    it.kind = kMoeItemCombine;
    it.a = int(i);
  }
  return it;
}
// Whether a finished tile of an expert with `tiles` tiles (tile rows x column tiles) raises the
// expert's flag, `done` of its tiles being done then (this one included; the kernel: an atomic
// add's result + 1): the last one to finish does.
MK_HOST_DEVICE inline bool moe_tile_raises(int tiles, int done) { return done == tiles; }

// The bytes of source s's dispatch slot for rank r (header and records) as the pack kernel
// writes them, from x [n, H] bf16 (as uint16) and ids [n, k]; `slot` holds g.slot_bytes.
void pack_record_slot(const MoeGeometry& g, int s, int r, const uint16_t* x, const int32_t* ids,
                      const SourceRoute& route, uint8_t* slot);
// Rank r's unpack from its W receive slots: recv_x [recv_rows, H] (rows past recv_rows are
// dropped and counted in *overflow), counts, offsets, and per row the (source, combine
// position) its output goes back to (back[2 * row]): layout_from_headers, then unpack_source for
// every source.
void unpack_slots(const MoeGeometry& g, int r, const std::vector<const uint8_t*>& slots, uint16_t* recv_x,
                  int32_t* counts, int32_t* offsets, int32_t* back, int64_t* overflow);

}  // namespace ops
}  // namespace mk
