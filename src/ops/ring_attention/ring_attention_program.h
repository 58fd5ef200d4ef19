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

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/ops/ring_attention.h"
#include "src/comm/program.h"
#include "src/ops/ring_attention/ring_attention_plan.h"

namespace mk {
namespace ops {

struct RingGeometry {
  int B = 1;
  int64_t S_l = 0;           // a slot's rows per batch: the largest rank's tokens
  // Uneven shards: rank r's block has rows[r] <= S_l tokens per batch (empty: S_l each). A block
  // lies in its slot at S_l rows per batch, its first rows[r] rows used; in the caller's K/V at
  // rows[r] rows per batch.
  std::vector<int64_t> rows;
  int64_t row_bytes = 0;     // Hkv * D * 2
  int chunk_tokens = 0;      // tokens per forwarded piece
  int pieces = 0;            // ceil(S_l / chunk_tokens): the flags' stride per (slot, batch)
  int64_t rows_of(int r) const { return rows.empty() ? S_l : rows[size_t(r)]; }
  int pieces_of(int r) const { return int((rows_of(r) + chunk_tokens - 1) / chunk_tokens); }  // of rank r's block
  // The backward's dK/dV traffic (backward = true). Its unit is a *tile*: fp32 dK then dV of 128
  // keys x D of one (batch, key block, key/value head), tile_bytes = 2 * 128 * D * 4, in the
  // kernel's fragment order. A rank's block has B x kb x hkv tiles, key blocks numbered chunk by
  // chunk (kb_per_chunk each, the last one of a chunk partial); dK/dV pieces of up to
  // kb_per_piece key blocks (all heads) never straddle a chunk, so that a piece is either
  // computed at a step or not at all.
  bool backward = false;
  int hkv = 0;
  uint64_t tile_bytes = 0;
  int chunks = 1;            // sequence chunks per rank: 1 (contiguous) or 2 (zigzag)
  int kb_per_chunk = 0;      // ceil(chunk tokens / 128): of the longest chunk (the tiles' stride)
  // Uneven shards: key blocks of rank r's chunk c at [r * chunks + c], each <= kb_per_chunk
  // (empty: kb_per_chunk each). A chunk's pieces past its key blocks are empty: never computed,
  // never sent.
  std::vector<int> chunk_kbs;
  int kb_per_piece = 0;
  // A sum on the node moves a piece in ops of at most this many bytes (a multiple of 16; the
  // tests take a few tiles' worth, so that pieces go in several parts).
  uint64_t dkv_part_bytes = 1ull << 20;
  int dpieces_per_chunk() const { return (kb_per_chunk + kb_per_piece - 1) / kb_per_piece; }
  int dpieces() const { return chunks * dpieces_per_chunk(); }  // per (block, batch)
  int kb() const { return chunks * kb_per_chunk; }              // key blocks per (block, batch)
  uint64_t dkv_block_bytes() const { return uint64_t(B) * uint64_t(kb()) * uint64_t(hkv) * tile_bytes; }
  // Piece dp of a (block, batch): its key blocks [kb0, kb0 + n) and its chunk.
  int dpiece_chunk(int dp) const { return dp / dpieces_per_chunk(); }
  int dpiece_kb0(int dp) const { return dpiece_chunk(dp) * kb_per_chunk + (dp % dpieces_per_chunk()) * kb_per_piece; }
  int kbs_of(int blk, int chunk) const { return chunk_kbs.empty() ? kb_per_chunk : chunk_kbs[size_t(blk * chunks + chunk)]; }
  // Key blocks of piece dp of block blk (0: an empty piece of a shorter chunk).
  int dpiece_kbs(int blk, int dp) const {
    const int first = (dp % dpieces_per_chunk()) * kb_per_piece;
    return std::max(0, std::min(kb_per_piece, kbs_of(blk, dpiece_chunk(dp)) - first));
  }
  // Byte offset of tile (block, b, key block, head) in the part / acc buffers.
  uint64_t tile_offset(int blk, int b, int kbi, int h) const {
    return uint64_t(blk) * dkv_block_bytes() + ((uint64_t(b) * kb() + kbi) * hkv + h) * tile_bytes;
  }
};

// The K/V traffic of a shape: rank r's block of rows[r] tokens ([B][rows[r]][Hkv][D] bf16) in
// pieces of chunk_tokens tokens (0: about 2 MiB, at least 64), no more than the largest block.
// The forward's geometry; the backward adds its dK/dV fields.
RingGeometry ring_kv_geometry(int B, const std::vector<int64_t>& rows, int Hkv, int D, int64_t chunk_tokens);

// The persistent launch of a ring call (forward or backward): its dedicated communication CTAs
// (opt.comm_ctas, or the tunable ring_comm_ctas; at least 1) and its grid (one CTA per SM this
// context may use, at most opt.max_ctas). A local status naming `what` when W > 1 leaves no CTA
// to compute: the caller agrees on it. Defined in ring_attention.cc (it asks the device).
Status ring_launch_ctas(const RingAttentionOptions& opt, int W, const char* what, int* comm_ctas, int* grid);

// The local checks of a call's packed documents (RingAttentionArgs::cu_seqlens, n_docs): OK
// without them; with them, n_docs >= 1, an aligned array, B = 1 and S within int32. Defined in
// ring_attention.cc.
Status check_ring_documents(const char* what, const RingAttentionShape& s, const int32_t* cu, int n_docs);

// The first step of both ring operators' create (collective): every rank asked for the same
// shape (shard rows by their hash); kMismatch naming `what` and both shapes otherwise. Defined in
// ring_attention.cc.
Status agree_on_ring_shape(Communicator* comm, const RingAttentionShape& shape, const char* what);

// The caller's K and V as the program names them (BufDecl::user_slot; DeviceProgram::user).
constexpr int kUserSlotK = 0, kUserSlotV = 1;

namespace RingBuf {
enum : comm::BufId { kUserK = 0, kUserV = 1, kSlotsK = 2, kSlotsV = 3, kToken = 4, kSlotsKNet = 5, kSlotsVNet = 6,
                     kTokenNet = 7,
                     // the backward's (0 bytes in a forward program)
                     kPart = 8, kAcc = 9, kPartNet = 10, kAccNet = 11, kCount = 12 };
}  // namespace RingBuf
namespace RingRegion {
enum : comm::RegionId { kArrived = 0, kArrivedNet = 1, kEntry = 2, kEntryNet = 3, kSrcFree = 4,
                        // the backward's (empty in a forward program)
                        kReady = 5, kDkvArrived = 6, kDkvArrivedNet = 7, kSummed = 8, kCount = 9 };
}  // namespace RingRegion

struct RingRank : comm::RankProgram {
  std::vector<uint32_t> step_wait0, step_waits;  // [W] ranges in `waits` (step 0: none)
  // Backward: the items that add 1 to ready[dkv_index(blk, b, dp)] per call (the kernel's
  // items of that piece: key blocks x heads), 0 where no item computes it.
  std::vector<uint32_t> ready_count;
  // Backward: [B][dpieces], 1 where a sum of the own block's piece comes back round the ring into
  // acc[rank] (some other rank computes it); the result is part[rank] (the own step-0 tiles,
  // which never travel) plus, there, acc[rank].
  std::vector<uint8_t> own_sum;
  // Ops [0, kv_ops): the entry handshake and every K/V op; the backward's sums and the call's
  // end follow. A launch that runs only these (RingAttentionTesting's leave-one-out timing)
  // moves K/V as a full call does and no sum.
  uint32_t kv_ops = 0;
};

// The backward's dK/dV, with the buffers and regions above:
//  - part [W][dkv block] (symmetric): the kernel's items write their fp32 tiles of block o at the
//    step that computes it, then add 1 to ready[(o, b, piece)] (device, local);
//  - acc [W][dkv block] (symmetric): the sum of the earlier ranks' tiles of block o, as it
//    travels the ring with K/V: a rank adds its part to the acc it received (dkv_arrived: one
//    arrival per op; on the node a piece goes in parts of at most 1 MiB, an op each, over the
//    network whole) and sends the sum on (reduce into the next rank's acc on the node; over the
//    network a reduce into its own part, then a put). The sum begins at step 1 with the first
//    rank after the owner that computes the piece; the owner's own tiles (step 0) stay in its
//    part, and after W - 1 hops acc[owner] holds the other ranks' share of the block's dK/dV
//    (RingRank::own_sum: where there is one); the finishing kernel adds the two.
//  - summed (device, local): a network send's reduce into the own part is done (its put waits).
//  With W = 1 there is no program: part[0] is the result.

struct RingProgram : comm::ProgramDecl {
  RingGeometry geo;
  std::vector<RingRank> ranks;  // [world]
  uint32_t arrived_index(int slot, int b, int piece) const { return uint32_t((slot * geo.B + b) * geo.pieces + piece); }
  uint32_t dkv_index(int blk, int b, int dp) const { return uint32_t((blk * geo.B + b) * geo.dpieces() + dp); }
};

// Every rank's program for `plan` (its layout decides which sends cross nodes). staged: network
// traffic through host mirrors (several nodes only).
Status build_ring_program(const RingPlan& plan, const comm::Layout& layout, const RingGeometry& g, bool staged,
                          RingProgram* out);

}  // namespace ops
}  // namespace mk
