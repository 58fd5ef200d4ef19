// mkernel — communication programs: the one host-side form in which every fused operator states
// what its communication CTAs do (pure host code, no CUDA).
//
// A Program declares
//  - buffers: symmetric device workspaces (every rank has one of the same size, reachable by
//    peer pointers on the node and through the proxy across nodes), the caller's local tensors
//    (user buffers: only their own rank touches them) and pinned host mirrors (staged network
//    traffic: registered with the network backend as host memory);
//  - flag regions: 64-bit counters in the operator's signal pad, grouped by purpose. A region is
//    raised either by device code or only by the proxy (one +1 per put that names the flag);
//    the proxy's regions live in host memory of the waiting rank.
// and, per rank, the list of ops its communication CTAs take in order, plus pools of waits and
// signals that the compute side of the kernel (tile hooks) refers to by index.
//
// Waits and signals scale with the call's epoch e (1, 2, ...; flags are never reset): a wait is
// "flag >= mul * e"; a signal either sets value * e or adds value.
//
// Operators write their programs with the helpers of src/comm/program_builder.h. The same program
// is resolved into device descriptors by the operator's session (src/comm/session.h) and replayed
// on CPU buffers by the replayer (src/comm/replay.h), which checks the flag accounting and that no
// interleaving deadlocks or reads data before it is there.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {
namespace comm {

// Which ranks share a node. Ranks of a node may be any set; `node_ranks[n][l]` is the rank with
// local index l on node n.
struct Layout {
  int world = 1;
  std::vector<int> node_of;                  // [world]
  std::vector<int> local_of;                 // [world]
  std::vector<std::vector<int>> node_ranks;  // [nodes][local]
  int nodes() const { return static_cast<int>(node_ranks.size()); }
  int local() const { return node_ranks.empty() ? 0 : static_cast<int>(node_ranks[0].size()); }
  bool same_node(int a, int b) const { return node_of[a] == node_of[b]; }
  // The other ranks of me's node, from the one after me on (local indexes rotated).
  std::vector<int> node_peers(int me) const;
  // The rank with me's local index on every other node, nearest first (nodes n + 1, n + 2, ...).
  std::vector<int> twins(int me) const;
  // `nodes` nodes of world / nodes consecutive ranks each.
  static Layout uniform(int world, int nodes);
  // `nodes` nodes, node n holding ranks n, n + nodes, n + 2 * nodes, ... (hosts taken round-robin).
  static Layout strided(int world, int nodes);
  // kInvalidArgument "<what>: ..." unless the tables agree and every node holds as many ranks
  // (what the operators' plans need).
  Status check(const char* what) const;
};

using BufId = uint8_t;
using RegionId = uint8_t;
constexpr BufId kNoBuf = 0xff;
constexpr RegionId kNoRegion = 0xff;

enum class Space : uint8_t {
  kSymmetric = 0,  // device workspace of the operator, one per rank
  kUser = 1,       // the caller's tensor, changes per call; only its own rank touches it
  kHost = 2,       // pinned host mirror of a symmetric buffer (staged network traffic)
};

struct BufDecl {
  std::string name;
  uint64_t bytes = 0;          // per rank; 0: not used by this program
  Space space = Space::kSymmetric;
  int user_slot = -1;          // kUser: which caller pointer (the operator binds it per call)
  BufId mirror_of = kNoBuf;    // kHost: the symmetric buffer it mirrors (same size and offsets)
  bool network = false;        // registered with the network backend (crosses nodes)
  bool rank_token = false;     // every 8-byte word holds the owning rank (handshake payloads)
};

struct RegionDecl {
  std::string name;
  uint32_t size = 0;
  bool proxy = false;  // raised only by the proxy (host memory of the waiting rank)
};

struct BufRef {
  BufId buf = kNoBuf;
  int rank = -1;
  uint64_t offset = 0;  // bytes
};

struct FlagRef {
  RegionId region = kNoRegion;  // kNoRegion: no flag
  int rank = -1;
  uint32_t index = 0;
};

// Wait until flag >= mul * e. `peer` is the rank expected to raise it (reported on timeout).
struct Wait {
  FlagRef flag;
  uint64_t mul = 1;
  int peer = -1;
};
// add ? flag += value : flag = value * e. Release at system scope, after the op's data writes.
struct Signal {
  FlagRef flag;
  uint64_t value = 1;
  bool add = false;
};

enum class OpKind : uint8_t {
  kCopy = 0,    // bytes from srcs[0] to every dsts[i]
  kReduce = 1,  // elems values (fp32, or bf16 if src_bf16): dst[i] = their fp32 sum in list order
                // (bf16, or fp32 if dst_f32); then sources in zero_src_mask are zeroed
  kNetPut = 2,  // through the proxy: srcs[0] (own rank) -> dsts[0] (on `peer`), raising
                // remote_flag there on arrival and local_flag here on local completion. With
                // stage_src set (staged programs), the device first copies `bytes` from stage_src
                // (own device buffer) into srcs[0] (its host mirror), then hands the put over.
  kSignal = 3,  // signals only
  kZero = 4,    // zero bytes at every dsts[i]
};
const char* op_kind_name(OpKind k);

struct Op {
  OpKind kind = OpKind::kSignal;
  std::vector<Wait> waits;      // all satisfied before the op starts
  std::vector<Signal> signals;  // raised after the op's writes are visible
  std::vector<BufRef> srcs, dsts;
  uint64_t bytes = 0;  // kCopy, kNetPut, kZero (with count_at: the most it may move)
  uint64_t elems = 0;  // kReduce
  bool dst_f32 = false;
  bool src_bf16 = false;    // kReduce: the sources are bf16 (widened to fp32 as they are read)
  uint32_t zero_src_mask = 0;
  int peer = -1;            // kNetPut destination rank
  FlagRef remote_flag;      // kNetPut
  FlagRef local_flag;       // kNetPut (kNoRegion: none)
  BufRef stage_src;         // kNetPut in a staged program: the device buffer copied into srcs[0] first
  // Run-time byte count (kCopy, kZero, kNetPut): a uint64 at this place in the rank's own memory,
  // written before the op's waits are satisfied; the op moves min(that, bytes) rounded down to 16
  // bytes (a put: its staging copy and the put itself). kNoBuf: `bytes`.
  BufRef count_at;
  std::string what;         // for logs and test failures: "AG chunk 3 of shard 1 -> rank 2"
};

struct RankProgram {
  int rank = 0;
  std::vector<Op> ops;          // executed by the communication CTAs, taken in this order
  std::vector<Wait> waits;      // pool for the compute side's hooks
  std::vector<Signal> signals;  // pool for the compute side's hooks
};

// The declarations of a program: layout, buffers and flag regions. Operators whose compute side
// needs more per rank than a RankProgram derive from this and keep their own rank list (see
// Program below for the plain form).
struct ProgramDecl {
  Layout layout;
  // Network traffic through pinned host mirrors that the device copies into before a put and
  // reads after an arrival: the proxy then moves host memory only, needs no GPU registration
  // and makes no CUDA call. Only with several nodes.
  bool net_staged = false;
  std::vector<BufDecl> bufs;
  std::vector<RegionDecl> regions;
  std::vector<uint32_t> region_offset;  // index of each region's first flag in the pad
  uint32_t pad_flags = 0;

  BufId add_buf(const BufDecl& d);
  RegionId add_region(const std::string& name, uint32_t size, bool proxy);
  // Lays the regions out in the pad (after every add_region).
  void place_regions();

  uint32_t flag_index(const FlagRef& f) const { return region_offset[f.region] + f.index; }
  bool proxy_region(RegionId r) const { return r < regions.size() && regions[r].proxy; }
  bool is_host(BufId b) const { return b < bufs.size() && bufs[b].space == Space::kHost; }
  bool is_user(BufId b) const { return b < bufs.size() && bufs[b].space == Space::kUser; }
  const char* buf_name(BufId b) const { return b < bufs.size() ? bufs[b].name.c_str() : "?"; }
  const char* region_name(RegionId r) const { return r < regions.size() ? regions[r].name.c_str() : "?"; }
  // The host mirror of symmetric buffer b (kNoBuf if it has none).
  BufId mirror(BufId b) const;
};

struct Program : ProgramDecl {
  std::vector<RankProgram> ranks;  // [world]
};

std::string flag_str(const ProgramDecl& p, const FlagRef& f);  // "entry[3]@rank 1"
std::string ref_str(const ProgramDecl& p, const BufRef& b);    // "a_full@rank 2+4096"
// One line per op, for logs and debugging.
std::string describe(const RankProgram& rp);

}  // namespace comm
}  // namespace mk
