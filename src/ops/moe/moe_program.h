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

}  // namespace ops
}  // namespace mk
