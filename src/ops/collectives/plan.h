// mkernel — plans of the fused GEMM collectives (AllGather+GEMM, GEMM+ReduceScatter,
// GEMM+AllReduce): which tile each rank computes in which order, where each finished tile's
// values go, and the communication program its communication CTAs run. Pure host code, no
// CUDA: the same plan is resolved into device descriptors by the operator (ops/fused.h) and
// replayed on CPU buffers by the tests (tests/cpu/test_plan.cc), which check the math, the
// flag counts and that no schedule can deadlock.
//
// Vocabulary
//  - W ranks on `nodes` nodes, `local` ranks per node (every node the same size). Shard s
//    (rank s's share of the rows) covers rows [s * Ms, (s + 1) * Ms), Ms = M / W.
//  - Tile-row tm covers GEMM rows [tm * 128, tm * 128 + 128). A *chunk* is the intersection of
//    a shard with a tile-row (at most 128 rows): the unit of data movement and of flags.
//  - Buffers are named (Buf) and addressed per rank with byte offsets (BufRef). kAFull,
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




enum class Buf : uint8_t {
  kUserA = 0,  // AG: the caller's shard [M/W, K] bf16
  kAFull = 1,  // AG: the gathered A [M, K] bf16
  kAccum = 2,  // RS/AR: fp32 node reduction [slots][nodes][Ms][N]; slots = deterministic ? local : 1
  kRecv = 3,   // RS/AR: fp32 node partials of this rank's shard from other nodes [nodes][Ms][N]
  kCws = 4,    // AR: the all-reduced C [M, N] bf16
  kUserC = 5,  // the caller's C (RS: [M/W, N]; AR: [M, N]) bf16
  kToken = 6,  // 8 bytes per rank [world]: the payload of entry handshakes across nodes
  // Staged network (Plan::net_staged): pinned host mirrors of the buffers that cross nodes,
  // registered with the network backend as host memory (which every provider can do). Same
  // size and offsets as the buffer they mirror; only their own rank's device code touches them
  // (copying in before a put, reading after an arrival), peers reach them through the proxy.
  kAFullNet = 7,   // mirror of kAFull (AG): own shard's rows out, twins' rows in
  kAccumNet = 8,   // mirror of kAccum (RS/AR): node-reduced partials out
  kRecvNet = 9,    // mirror of kRecv (RS/AR): other nodes' partials in (kRecv is then unused)
  kCwsNet = 10,    // mirror of kCws (AR): final rows out and in
  kTokenNet = 11,  // the entry token in host memory (kToken is then unused)
  kCount = 12,
};
const char* buf_name(Buf b);
// The host mirror of b in a staged plan (kCount if b has none); whether b is a host mirror.
Buf net_mirror(Buf b);
bool is_host_buf(Buf b);

struct BufRef {
  Buf buf = Buf::kCount;
  int rank = -1;
  uint64_t offset = 0;  // bytes
};

enum class Region : uint8_t {
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
const char* region_name(Region r);

struct FlagRef {
  Region region = Region::kCount;  // kCount: no flag
  int rank = -1;
  uint32_t index = 0;
};

// Wait until flag >= mul * e. `peer` is the rank expected to raise it (reported on timeout).
struct PlanWait {
  FlagRef flag;
  uint64_t mul = 1;
  int peer = -1;
};
// add ? flag += value : flag = value * e. Release at system scope, after the op's data writes.
struct PlanSignal {
  FlagRef flag;
  uint64_t value = 1;
  bool add = false;
};

enum class CommKind : uint8_t {
  kCopy = 0,    // bytes from srcs[0] to every dsts[i]
  kReduce = 1,  // elems fp32 values: dst[i] = sum of srcs in list order (bf16, or fp32 if dst_f32);
                // then sources in zero_src_mask are zeroed
  kNetPut = 2,  // through the proxy: srcs[0] (own rank) -> dsts[0] (on `peer`), raising
                // remote_flag there on arrival and local_flag here on local completion. With
                // stage_src set (staged plans), the device first copies `bytes` from stage_src
                // (own device buffer) into srcs[0] (its host mirror), then hands the put over.
  kSignal = 3,  // signals only
  kZero = 4,    // zero bytes at every dsts[i]
};
const char* comm_kind_name(CommKind k);

struct CommOp {
  CommKind kind = CommKind::kSignal;
  std::vector<PlanWait> waits;      // all satisfied before the op starts
  std::vector<PlanSignal> signals;  // raised after the op's writes are visible
  std::vector<BufRef> srcs, dsts;
  uint64_t bytes = 0;  // kCopy, kNetPut, kZero
  uint64_t elems = 0;  // kReduce
  bool dst_f32 = false;
  uint32_t zero_src_mask = 0;
  int peer = -1;            // kNetPut destination rank
  FlagRef remote_flag;      // kNetPut
  FlagRef local_flag;       // kNetPut (region kCount: none)
  BufRef stage_src;         // kNetPut in a staged plan: the device buffer copied into srcs[0] first
  std::string what;         // for logs and test failures: "AG chunk 3 of shard 1 -> rank 2"
};

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

struct RankPlan {
  int rank = 0;
  std::vector<int> tile_order;       // every tile id (tn * tiles_m + tm) once
  std::vector<CommOp> ops;           // executed by the communication CTAs, taken in this order
  std::vector<RowHooks> rows;        // [tiles_m]
  std::vector<PlanWait> waits;       // pool for RowHooks
  std::vector<PlanSignal> signals;   // pool for RowHooks
  // RS/AR epilogue routing: element (m, n) of this rank's product, m in shard s, goes to
  // route[s] + ((m - s * Ms) * N + n) * 4 (fp32), added (or stored when deterministic).
  std::vector<BufRef> route;         // [world]; empty for AG
};

struct Plan {
  FusedKind kind = FusedKind::kAgGemm;
  PlanShape shape;
  PlanLayout layout;
  bool deterministic = false;
  // Network traffic through pinned host mirrors (kAFullNet, ...) that the device copies into
  // before a put and reads after an arrival: the proxy then moves host memory only, needs no
  // GPU registration (FI_HMEM) and makes no CUDA call. Only with several nodes.
  bool net_staged = false;
  int64_t shard_rows = 0;             // Ms
  int tiles_m = 0, tiles_n = 0;
  std::vector<Chunk> chunks;          // in shard order
  uint64_t buf_bytes[static_cast<int>(Buf::kCount)] = {};   // per rank (symmetric sizes)
  uint32_t region_size[static_cast<int>(Region::kCount)] = {};
  uint32_t region_offset[static_cast<int>(Region::kCount)] = {};  // index in the pad
  uint32_t pad_flags = 0;
  std::vector<RankPlan> ranks;        // [world]

  uint32_t flag_index(const FlagRef& f) const { return region_offset[int(f.region)] + f.index; }
  bool proxy_region(Region r) const {
    return r == Region::kEntryNet || r == Region::kNetIn || r == Region::kSrcFree;
  }
};

constexpr int kPlanTileM = 128;
constexpr int kPlanTileN = 256;

// Builds every rank's plan. kInvalidArgument for shapes it cannot split: M % W != 0 (uneven
// shards are rejected), M, N, K <= 0, N or K not a multiple of 8, a layout whose nodes differ in
// size. Deterministic: RS/AR partials are stored per source rank and summed in a fixed order
// (within a node by local index, then across nodes in node order): reproducible bit for bit for
// a given layout. With one rank per node the plan is always deterministic (one writer per
// element; Plan::deterministic is then true). net_staged: see Plan::net_staged (ignored on
// one node).
Status build_plan(FusedKind kind, const PlanShape& shape, const PlanLayout& layout,
                  bool deterministic, Plan* out, bool net_staged = false);

// One line per op, for logs and debugging.
std::string describe(const Plan& p, int rank);

}  // namespace ops
}  // namespace mk
