// mkernel — the communication programs of MoE dispatch and combine (pure host code, no CUDA):
// the slots every rank moves to every other (directly, or hierarchically through the twin on
// each node), piece by piece with run-time byte counts, and their flags. The geometry and the
// routing rules that size and fill the slots are moe_plan.h.
#pragma once

#include <cstdint>
#include <string>

#include "mkernel/common/status.h"
#include "mkernel/device/command.h"  // MK_HOST_DEVICE
#include "src/comm/program.h"
#include "src/ops/moe/moe_plan.h"

namespace mk {
namespace ops {

namespace MoeBuf {
enum : comm::BufId { kSend = 0, kRecv = 1, kToken = 2, kSendNet = 3, kRecvNet = 4, kTokenNet = 5, kPieceBytes = 6,
                     kCount = 7,
                     // hierarchical programs only
                     kNSend = 7, kNRecv = 8, kNSendNet = 9, kNRecvNet = 10, kNPieceBytes = 11, kHierCount = 12 };
}  // namespace MoeBuf
namespace MoeRegion {
enum : comm::RegionId { kArrived = 0, kArrivedNet = 1, kEntry = 2, kEntryNet = 3, kSrcFree = 4, kCount = 5,
                         kFwd = 5, kHierCount = 6 };
}  // namespace MoeRegion

// Every rank's program moving W slots of `slot_bytes` (send[r] -> r's recv[me]; the own slot is
// written in place by the pack kernel), each in `pieces` pieces of piece_bytes(slot_bytes, pieces)
// (one op each, so several CTAs move one slot). A piece moves the bytes the pack kernel wrote in
// piece_bytes[r * pieces + p] (a uint64 in this rank's memory: the slot's bytes in use within the
// piece, at least 16, so every put carries data); a slot's first uint64 is its bytes in use.
// Flags: arrived[s] (device): s's slot is here (one raise per piece from a rank on the node, one
// in all for a rank on another node); arrived_net[s] (proxy): pieces landed over the network;
// entry[r] / entry_net[r]: rank r's receive slot for this rank is free (r entered the call);
// src_free: local completions of this rank's puts. `what`: "dispatch" or "combine" (op names).
Status build_moe_program(const comm::Layout& layout, int64_t slot_bytes, int pieces, bool staged,
                         const std::string& what, comm::Program* out);
// Throughput mode across nodes: `hier` (nodes > 1, local > 1). Same-node slots as above (send ->
// recv); node slots of `nslot_bytes` (nsend[node] -> twin's nrecv[my node], in pieces, counts in
// npiece_bytes[node * pieces + p]). Regions added: fwd[s] (device): source s's record slot was
// written here by its twin on this node. Compute-side pools (RankProgram::waits / signals), in
// this order: the repack's waits (entry[d] for every other rank d of the node, then arrived[s]
// for every remote twin s), the layout's waits (fwd[s] for every remote source s whose twin on
// this node is another rank), the repack's signals (fwd[s] at every other rank d of the node,
// for each remote twin s: d-major). moe_hier_pools gives the counts.
struct MoeHierPools {
  uint32_t repack_waits = 0, layout_waits = 0, repack_signals = 0;
};
Status build_moe_hier_program(const comm::Layout& layout, int64_t slot_bytes, int64_t nslot_bytes, int pieces,
                              bool staged, comm::Program* out);
MoeHierPools moe_hier_pools(const comm::Layout& layout, int me);

// Bytes of each piece but the last (a multiple of 16), and the number of pieces actually used.
int64_t moe_piece_bytes(int64_t slot_bytes, int pieces);
int moe_pieces(int64_t slot_bytes, int pieces);
// The count piece p (pieces of pb bytes) of a slot with `used` bytes in use moves:
// clamp(used - p * pb, 16, piece size). The pack kernels write exactly this (host and device).
MK_HOST_DEVICE inline uint64_t moe_piece_count_of(int64_t slot_bytes, int64_t pb, int p, uint64_t used) {
  const int64_t size = slot_bytes - int64_t(p) * pb < pb ? slot_bytes - int64_t(p) * pb : pb;
  const int64_t left = int64_t(used) - int64_t(p) * pb;
  const int64_t v = left < size ? left : size;
  return uint64_t(v > 16 ? v : 16);
}
uint64_t moe_piece_count(int64_t slot_bytes, int pieces, int p, uint64_t used);

// ---- The fused MoE layer (dispatch, the experts' two GEMMs and combine as one call) ----
//
// One program per layer call (one epoch): the communication CTAs take the ops, the compute side
// takes units in this order, each after its waits (pools below):
//   layout       after every other source's header (hdr[s]): counts, offsets and each source's
//                base rows from the W headers (layout_from_headers) into `lay`, every combine
//                slot's header and piece counts; zeroes the per-expert tile counters; raises the
//                flags of experts without rows (g1done, packed: they have no tiles); raises laid;
//   unpack(s, c) for s = me, then me + 1, ..., each in `unpack_chunks` chunks of its records:
//                after laid and the source's records (arrived[s]; none for the own slot, which
//                pack writes in place): the chunk's rows into recv_x and their way back into `lay`
//                (unpack_source); raises unpacked[s] (+1 per chunk);
//   gemm1(le, j, c) per tile of a local expert (tile row j, column tile c; as many as the layout
//                gives it: the items of the work queue, moe_layer_item in moe_plan.h): after laid,
//                then after unpacked[s] of each source with rows in its tile row (a run-time
//                subset): act = the first GEMM and SwiGLU of its rows and columns; the expert's last
//                tile to finish (a counter in `lay`) raises g1done[le];
//   gemm2(le, j, c) after g1done[le]: y = the second GEMM of its rows and columns, each row whose
//                token is another rank's also into that rank's combine send slot (its combine
//                row); the expert's last tile raises packed += 1;
//                (the layout raises both for an expert without rows: it has no tiles)
//   combine(c)   in chunks of the own tokens, after packed >= El (the own tokens' rows of y) and
//                every other source's combine slot (carrived[s]): the weighted sums into `out`.
// Units only wait for units before them (and for other ranks), so a queue that hands them out in
// this order cannot deadlock, whatever the number of CTAs.
// The ops: entry handshakes (as dispatch's); per destination the slot's header (hdr_bytes: hdr
// there, hdr_net across nodes) then its records in pieces from hdr_bytes on (run-time counts in
// piece_bytes, as dispatch's); the relays of other nodes' headers and records (staged: out of the
// host mirror); per destination the combine slot in pieces (after packed >= El; counts in
// cpiece_bytes) raising carrived (carrived_net); their relays; a last op waiting for the proxy's
// local completions. Headers travel first so that the layout, and the GEMMs of the sources that
// have landed, need not wait for the slowest slot.
namespace MoeLayerBuf {
enum : comm::BufId { kCSend = 7, kCRecv = 8, kCSendNet = 9, kCRecvNet = 10, kCPieceBytes = 11,
                     // the compute side's own (user buffers with no slot: no op touches them)
                     kRecvX = 12, kAct = 13, kY = 14, kLay = 15, kOut = 16, kCount = 17 };
}  // namespace MoeLayerBuf
namespace MoeLayerRegion {
enum : comm::RegionId { kHdr = 5, kHdrNet = 6, kCArrived = 7, kCArrivedNet = 8, kLaid = 9, kUnpacked = 10,
                         kG1Done = 11, kPacked = 12, kCount = 13 };
}  // namespace MoeLayerRegion
// The places of each unit's waits and signals in RankProgram::waits / signals. Lists over "the
// other sources" run s = me + 1, me + 2, ... (mod W).
struct MoeLayerPools {
  uint32_t hdr = 0;       // [W - 1] the layout's: hdr[s]
  uint32_t laid = 0;      // [1] unpack's and gemm1's
  uint32_t arrived = 0;   // [W - 1] unpack(s)'s: arrived[s] (pieces on the node, 1 across nodes)
  uint32_t unpacked = 0;  // [W] gemm1's: unpacked[s] >= unpack_chunks for s = 0 .. W - 1
  uint32_t g1 = 0;        // [El] gemm2(le)'s: g1done[le]
  uint32_t packed = 0;    // [1] combine's: packed >= El
  uint32_t carrived = 0;  // [W - 1] combine's: carrived[s]
  uint32_t waits = 0;     // all
  uint32_t s_laid = 0, s_unpacked = 0 /* [W] */, s_g1 = 0 /* [El] */, s_packed = 0, signals = 0;
};
MoeLayerPools moe_layer_pools(int W, int El);
// `lay` (int32): counts [El], offsets [El + 1], base [W][El], back [recv_rows][2], tile rows done
// per expert [2][El] (gemm1's, gemm2's).
int64_t moe_layer_lay_bytes(const MoeGeometry& g);
Status build_moe_layer_program(const comm::Layout& layout, const MoeGeometry& g, int64_t inter, int pieces,
                               int unpack_chunks, bool staged, comm::Program* out);

}  // namespace ops
}  // namespace mk
