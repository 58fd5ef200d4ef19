// mkernel — plans of the standalone collectives (ops/collective.h): the communication program
// each rank's CTAs run, with no compute role. Pure host code, no CUDA: the operator resolves it
// into device descriptors (collective.cc), the tests replay it on CPU buffers
// (tests/cpu/test_collective_plan.cc).
//
// Vocabulary
//  - W ranks on `nodes` nodes of `local` ranks. Shard s (rank s's block of the data) covers
//    elements [lo_s, hi_s): AG and RS `count` each; AR the total split in W parts (multiples of
//    8 elements; the last ones may be shorter or empty). A shard is cut into chunks of at most
//    `chunk_elems`: the unit of data movement and of flags.
//  - The *reducer* of shard s on node n is the rank of n with s's local index; a rank's *twins*
//    are the ranks with its local index on the other nodes (Layout::twins).
//  - Every rank's input lies in its own symmetric workspace kIn when the kernel starts (the
//    launch copies it there unless the caller wrote it there: Collective::input()).
//
// The programs (op lists, in order)
//  AG  entry; my shard from kIn into my output; my shard to each twin's kGather (put); the twins'
//      shards that land here forwarded (a signal to the node's ranks; staged: first out of the
//      host mirror) and copied into my output; the node peers' shards read from their kIn, the
//      other nodes' from their forwarder's kGather; then the end of call.
//  RS  entry; per chunk of the shards I reduce (my own and my twins'), the node sum in local order
//      read from the node's kIn (one node: straight into my output); several nodes: the partials
//      of my twins' shards put to them (fp32), my own shard's partials summed in node order into
//      my output (more partials than an op's 16 buffers take: a chain of sums, each adding the
//      next nodes' partials to an fp32 accumulator in place of the first, in node order, so the
//      bits are those of one sum); then the end of call.
//  AR  as RS, the result of my shard written into kOut of every rank of my node, put to my
//      twins (kOut) and forwarded by them inside their nodes; then the end of call.
//  End of call (every kind): the last op waits until every read of my workspaces by the node's
//  ranks is done, every put of mine has left its source, and (AR) every chunk of the result has
//  landed in my kOut — so the next call may overwrite my workspaces, and the launch may copy
//  the result out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/ops/collective.h"
#include "src/comm/device_program.h"
#include "src/comm/program.h"

namespace mk {
namespace ops {

constexpr int kCollUserSlotOut = 1;  // the caller's output (AG, RS): DeviceProgram::user[1]

// The plan's buffers (ids in its ProgramDecl::bufs, in this order; unused ones have 0 bytes).
namespace CBuf {
enum : comm::BufId {
  kUserOut = 0,  // AG [W * count], RS [count]: the caller's output (AR: unused, see kOut)
  kIn = 1,       // [in_elems] dtype: this call's input
  kGather = 2,   // AG, several nodes: [W * count] dtype, the twins' shards land at their offset
  kPart = 3,     // RS/AR, several nodes: [nodes][max shard] fp32, the node partials I computed,
                 //   of the shard of node n's twin at slot n
  kRecv = 4,     // RS/AR, several nodes: [nodes][max shard] fp32, my shard's partials from node n
  kOut = 5,      // AR: [count] dtype, the result
  kToken = 6,    // 8 bytes per rank: the payload of the entry handshake across nodes
  // Staged (net_staged): pinned host mirrors of what crosses nodes, same size and offsets.
  kInNet = 7,      // AG: my shard out
  kGatherNet = 8,  // AG: the twins' shards in
  kPartNet = 9,    // RS/AR: partials out
  kRecvNet = 10,   // RS/AR: partials in (kRecv is then unused)
  kOutNet = 11,    // AR: result chunks out and in
  kTokenNet = 12,
  kCount = 13,
};
}  // namespace CBuf

namespace CRegion {
enum : comm::RegionId {
  kEntry = 0,      // [world] set to e by rank q when its call e starts: its kIn holds call e's
                   //   input and the buffers others write into are free
  kEntryNet = 1,   // [world] the same across nodes (proxy: the token put)
  kReadsDone = 2,  // [1] reads of my kIn / kGather by the node's ranks, done (adds)
  kFwd = 3,        // [chunks] AG: chunk c of another node's shard is in its forwarder's kGather
  kNetIn = 4,      // [chunks * (nodes + 1)] proxy: AG chunk c at c; a partial of chunk c from
                   //   node n at c * nodes + n; AR result chunk c at chunks * nodes + c
  kLocal = 5,      // [chunks] my node partial of chunk c is in kPart
  kFinal = 6,      // [chunks] AR: my result of chunk c is in my kOut
  kOutCount = 7,   // [1] AR: result chunks landed in my kOut (adds)
  kSrcFree = 8,    // [chunks] proxy: my puts of chunk c completed locally
  kChain = 9,      // [chunks * links] RS/AR: link l of chunk c's final sum is in its accumulator
  kCount = 10,
};
}  // namespace CRegion

const char* coll_buf_name(comm::BufId b);
const char* coll_region_name(comm::RegionId r);

struct CollChunk {
  int shard = 0;
  int64_t elem0 = 0, elems = 0;  // within the shard's data: elements [elem0, elem0 + elems)
};

struct CollPlan : comm::Program {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  CollDType dtype = CollDType::kBF16;
  int64_t count = 0;
  int64_t chunk_elems = 0;
  std::vector<int64_t> shard_lo, shard_hi;  // [world + 0]: shard s's elements [lo, hi)
  int64_t max_shard = 0;
  std::vector<CollChunk> chunks;            // in shard order
  std::vector<std::vector<int>> shard_chunks;  // shard -> chunk ids
  int chain_links = 0;  // RS/AR, several nodes: ops before the last of each chunk's final sum (0: one op)

  int esize() const { return dtype == CollDType::kBF16 ? 2 : 4; }
  int64_t in_elems() const;   // AG: count; RS: W * count; AR: count
  int64_t out_elems() const;  // AG: W * count; RS: count; AR: count
};

// The links a final sum over `partials` fp32 partials into `dsts` destinations needs before its
// last op (0: one op), each op within comm::kMaxOpBuffers.
int chain_links_for(int partials, int dsts);

// The default chunk: a 32nd of the largest shard (so up to 32 CTAs of a rank share its work),
// rounded up to 8 elements, within [8 Ki, 256 Ki] elements. The same on every rank (it depends on
// the count and the world size only).
constexpr int64_t kCollMinChunkElems = 8 * 1024, kCollMaxChunkElems = 256 * 1024;
int64_t default_chunk_elems(int64_t max_shard);

// Builds every rank's program. kInvalidArgument for counts can_implement refuses and malformed
// layouts (nodes of different sizes). chunk_elems <= 0: the default. net_staged: the network
// traffic goes through pinned host mirrors (ignored on one node).
Status build_coll_plan(CollectiveKind kind, int64_t count, CollDType dtype, const comm::Layout& layout,
                       int64_t chunk_elems, bool net_staged, CollPlan* out);

// One line per op, for logs and debugging.
std::string describe(const CollPlan& p, int rank);

}  // namespace ops
}  // namespace mk
