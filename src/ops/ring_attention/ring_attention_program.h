// mkernel — ring attention's communication program (host code, no CUDA): how each rank's K/V
// block travels the ring in pieces, as a comm::Program that the session resolves and the CPU
// replayer checks (tests/cpu/test_ring_attention_plan.cc).
//
// Buffers: the caller's K and V (user slots 0 and 1: [B][S/W][Hkv][D] bf16), the K/V slots
// ([W][B][S/W][Hkv][D], slot r holds rank r's block once it passed through), an 8-byte token
// per rank (the payload of the entry handshake across nodes), and — staged — pinned host
// mirrors of the slots and the token.
// Flags: `arrived[(slot * B + b) * pieces + piece]` counts K and V of a piece in this rank's
// slot (device; the kernel waits for 2 * e before reading the rows); `arrived_net` the same
// pieces landed over the network (proxy; the rank then relays them into `arrived`); `entry`
// (device) / `entry_net` (proxy): the next rank entered the call, its slots are free;
// `src_free` (proxy): local completions of this rank's puts.
// The compute side: at step t >= 1 the kernel reads block steps[t].kv_rank after the arrival
// waits in RingRank::waits[step_wait0[t], step_wait0[t] + step_waits[t]).
#pragma once

#include <cstdint>
#include <vector>

#include "mkernel/common/status.h"
#include "src/comm/program.h"
#include "src/ops/ring_attention/ring_attention_plan.h"

namespace mk {
namespace ops {

struct RingGeometry {
  int B = 1;
  int64_t S_l = 0;           // tokens per rank
  int64_t row_bytes = 0;     // Hkv * D * 2
  int chunk_tokens = 0;      // tokens per forwarded piece
  int pieces = 0;            // ceil(S_l / chunk_tokens)
};

// The caller's K and V as the program names them (BufDecl::user_slot; DeviceProgram::user).
constexpr int kUserSlotK = 0, kUserSlotV = 1;

namespace RingBuf {
enum : comm::BufId { kUserK = 0, kUserV = 1, kSlotsK = 2, kSlotsV = 3, kToken = 4, kSlotsKNet = 5, kSlotsVNet = 6,
                     kTokenNet = 7, kCount = 8 };
}  // namespace RingBuf
namespace RingRegion {
enum : comm::RegionId { kArrived = 0, kArrivedNet = 1, kEntry = 2, kEntryNet = 3, kSrcFree = 4, kCount = 5 };
}  // namespace RingRegion

struct RingRank : comm::RankProgram {
  std::vector<uint32_t> step_wait0, step_waits;  // [W] ranges in `waits` (step 0: none)
};

struct RingProgram : comm::ProgramDecl {
  RingGeometry geo;
  std::vector<RingRank> ranks;  // [world]
  uint32_t arrived_index(int slot, int b, int piece) const { return uint32_t((slot * geo.B + b) * geo.pieces + piece); }
};

// Every rank's program for `plan` (its layout decides which sends cross nodes). staged: network
// traffic through host mirrors (several nodes only).
Status build_ring_program(const RingPlan& plan, const comm::Layout& layout, const RingGeometry& g, bool staged,
                          RingProgram* out);

}  // namespace ops
}  // namespace mk
