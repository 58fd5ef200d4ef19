// mkernel — plans of the fused GEMM collectives (AllGather+GEMM, GEMM+ReduceScatter,
// GEMM+AllReduce): which tile each rank computes in which order, where each finished tile's
// values go, and the communication program its communication CTAs run. Pure host code, no
// CUDA: the same plan is resolved into device descriptors by the operator (ops/fused.h) and
// replayed on CPU buffers by the tests (tests/cpu/test_fused_gemm_plan.cc), which check the math, the
// flag counts and that no schedule can deadlock.
//
// Vocabulary
//  - W ranks on `nodes` nodes, `local` ranks per node (every node the same size). Shard s
//    (rank s's share of the rows) covers rows [row0_s, row0_s + rows_s) (Plan::shard_row0): M / W
//    rows each when even, PlanShape::rows when not. Ms (Plan::shard_rows) is the largest shard:
//    the stride of the per-shard workspaces.
//  - Tile-row tm covers GEMM rows [tm * 128, tm * 128 + 128). A *chunk* is the intersection of
//    a shard with a tile-row (at most 128 rows): the unit of data movement and of flags.
//  - Buffers are named (Buf) and addressed per rank with byte offsets (comm::BufRef). kAFull,
//    kAccum, kRecv, kCws and kToken are symmetric workspaces of the operator: reachable by
//    peer pointers on the same node and through the proxy (registered windows) across nodes.
//    kUserA and kUserC are the caller's local buffers: only their own rank touches them.
//  - Flags are 64-bit counters in a per-operator signal pad, grouped in regions. Waits and
//    signals are scaled by the call's epoch e (1, 2, ...; flags are never reset): a wait is
//    "flag >= mul * e"; a signal either sets value * e or adds value.
//  - Proxy-raised regions (kEntryNet, kNetIn, kSrcFree) are only ever raised by the proxy
//    (one +1 per put naming the flag); the other regions only by device code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/ops/fused.h"
#include "src/comm/program.h"

namespace mk {
namespace ops {

// The caller's buffers as the program names them (BufDecl::user_slot; DeviceProgram::user).
constexpr int kUserSlotA = 0;  // AG: the caller's A shard
constexpr int kUserSlotC = 1;  // RS/AR: the caller's C

// The plan's buffers (ids in its ProgramDecl::bufs, in this order; unused ones have 0 bytes).
namespace Buf {
enum : comm::BufId {
  kUserA = 0,  // AG: the caller's shard [M/W, K] bf16
  kAFull = 1,  // AG: the gathered A [M, K] bf16
  kAccum = 2,  // RS/AR: fp32 node reduction [slots][nodes][Ms][N]; slots = deterministic ? local : 1
  kRecv = 3,   // RS/AR: fp32 node partials of this rank's shard from other nodes [nodes][Ms][N]
  kCws = 4,    // AR: the all-reduced C [M, N] bf16
  kUserC = 5,  // the caller's C (RS: [M/W, N]; AR: [M, N]) bf16
  kToken = 6,  // 8 bytes per rank [world]: the payload of entry handshakes across nodes
  // Staged network (net_staged): pinned host mirrors of the buffers that cross nodes. Same size
  // and offsets as the buffer they mirror; only their own rank's device code touches them
  // (copying in before a put, reading after an arrival), peers reach them through the proxy.
  kAFullNet = 7,   // mirror of kAFull (AG): own shard's rows out, twins' rows in
  kAccumNet = 8,   // mirror of kAccum (RS/AR): node-reduced partials out
  kRecvNet = 9,    // mirror of kRecv (RS/AR): other nodes' partials in (kRecv is then unused)
  kCwsNet = 10,    // mirror of kCws (AR): final rows out and in
  kTokenNet = 11,  // the entry token in host memory (kToken is then unused)
  kCount = 12,
};
}  // namespace Buf
// The names of the plan's buffers and regions ("a_full", "net_in"; "?" past the last).
const char* buf_name(comm::BufId b);
const char* region_name(comm::RegionId r);
// The host mirror of b in a staged plan (comm::kNoBuf if it has none); whether b is a host mirror.
comm::BufId net_mirror(comm::BufId b);
bool is_host_buf(comm::BufId b);

// The plan's flag regions (ids in its ProgramDecl::regions, in this order).
namespace Region {
enum : comm::RegionId {
  kEntry = 0,     // [world]  set to e by rank i (device) when its call e starts: its buffers are free
  kEntryNet = 1,  // [world]  the same across nodes, raised by the proxy (8-byte put into kToken)
  kRowReady = 2,  // [tiles_m] AG: chunks of the gathered A landed in this tile-row (adds)
  kRowCount = 3,  // [tiles_m] RS/AR: tiles reduced into this reducer's kAccum rows (adds)
  kOutRow = 4,    // [tiles_m] AR: final chunks landed in kCws (adds)
  kNetIn = 5,     // [chunks * (nodes + 1)] puts that landed here (proxy): AG chunk c at c;
                  //   RS/AR partial of chunk c from node n at c * nodes + n; AR final chunk c at
                  //   chunks * nodes + c
  kLocal = 6,     // [chunks] set to e by this rank when chunk c is ready to send
  kSrcFree = 7,   // [chunks] the put of chunk c completed locally (proxy): its source is free
  kCount = 8,
};
}  // namespace Region

// Per tile-row hooks of the GEMM (index ranges into RankPlan::waits / ::signals).
struct RowHooks {
  uint32_t load_wait0 = 0, load_waits = 0;    // before A's rows are loaded (AG)
  uint32_t store_wait0 = 0, store_waits = 0;  // before the tile's values are written (RS/AR)
  uint32_t store_sig0 = 0, store_sigs = 0;    // after they are written (RS/AR)
};

struct Chunk {
  int shard = 0, tile_row = 0;
  int64_t row0 = 0, rows = 0;  // global GEMM rows
};

// One node (RS/AR): the owner sums its own rows in the epilogue of its own tiles, from its
// registers and what the node's other ranks routed to it, once they all did (the tile-row's
// store waits), and writes the bf16 result itself: no reduction op, no fp32 round trip of its
// own share. Only tile-rows that hold no other shard's rows ([lo, hi)); the others keep the
// final op. Row m of the owner's shard is at offset (m - row0) * N * (4 or 2) of each ref.
struct EpilogueFinal {
  bool on = false;
  int64_t row0 = 0;                 // first row of the shard (me * Ms)
  int64_t lo = 0, hi = 0;           // the rows summed here
  std::vector<comm::BufRef> srcs;   // fp32 [Ms][N]: summed in this order ...
  int self = 0;                     // ... with the tile's own values as term `self` (0..srcs.size())
  bool zero_srcs = false;           // the reduce-add accumulation: zeroed once read
  std::vector<comm::BufRef> dsts;   // bf16 [Ms][N]: the caller's C (AR: its rows of the shard), and
                                    // for AR the node's other ranks' c_ws rows
};

// A rank's communication program (ops; waits and signals: the pools RowHooks index) and the
// GEMM's side of it.
struct RankPlan : comm::RankProgram {
  std::vector<int> tile_order;       // every tile id (tn * tiles_m + tm) once
  std::vector<RowHooks> rows;        // [tiles_m]
  // RS/AR epilogue routing: element (m, n) of this rank's product, m in shard s, goes to
  // route[s] + ((m - s * Ms) * N + n) * 4 (fp32), added (or stored when deterministic).
  std::vector<comm::BufRef> route;   // [world]; empty for AG
  EpilogueFinal fin;                 // RS/AR on one node: this rank's own rows (route[me] unused)
};

struct Plan : comm::ProgramDecl {
  FusedKind kind = FusedKind::kAgGemm;
  PlanShape shape;
  bool deterministic = false;
  // AG: the launch copies the caller's shard into its own gathered A (rows me * Ms ..) on the
  // stream before the kernel (the copy engine: tens of microseconds, where copies inside the
  // running GEMM crawl); the program's ops for those chunks only signal.
  bool own_copy_before = false;
  int64_t shard_rows = 0;             // Ms: the largest shard's rows (every shard's when even)
  std::vector<int64_t> shard_row0;    // [world + 1]: shard s covers rows [shard_row0[s], shard_row0[s + 1])
  bool even = true;                   // every shard M / W rows
  int64_t rows_of(int s) const { return shard_row0[size_t(s) + 1] - shard_row0[size_t(s)]; }
  int shard_of(int64_t m) const;      // the shard holding row m (0 <= m < M)
  int tiles_m = 0, tiles_n = 0;
  std::vector<Chunk> chunks;          // in shard order
  std::vector<RankPlan> ranks;        // [world]

  uint64_t buf_bytes(comm::BufId b) const { return b < bufs.size() ? bufs[b].bytes : 0; }
};

constexpr int kPlanTileM = 128;
constexpr int kPlanTileN = 256;

// Every shard's first row, [world + 1] (the last is M), from PlanShape::rows or the even split
// (AR without rows: as even as M allows); FusedGemm::can_implement's shard rules.
Status shard_starts(FusedKind kind, const PlanShape& shape, int world, std::vector<int64_t>* row0);

// Builds every rank's plan. kInvalidArgument for shapes it cannot split (FusedGemm::can_implement:
// M, N, K <= 0, N or K not a multiple of 8, shards that do not cover M), a layout whose nodes
// differ in size. Deterministic: RS/AR partials are stored per source rank and summed in a fixed order
// (within a node by local index, then across nodes in node order): reproducible bit for bit for
// a given layout. With one or two ranks per node the plan is always deterministic (the slot
// layout; Plan::deterministic is then true). net_staged: see Plan::net_staged (ignored on
// one node).
Status build_plan(FusedKind kind, const PlanShape& shape, const comm::Layout& layout,
                  bool deterministic, Plan* out, bool net_staged = false);

// One line per op, for logs and debugging.
std::string describe(const Plan& p, int rank);

}  // namespace ops
}  // namespace mk
