// Plans of the standalone collectives (see src/ops/collective/collective_plan.h).
#include "src/ops/collective/collective_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "mkernel/common/check.h"
#include "src/comm/program_builder.h"

namespace mk {
namespace ops {

using comm::BufId;
using comm::RegionId;

const char* collective_kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllGather: return "allgather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "allreduce";
  }
  return "?";
}
const char* coll_dtype_name(CollDType t) { return t == CollDType::kBF16 ? "bf16" : t == CollDType::kF32 ? "fp32" : "?"; }

Status parse_collective_kind(const std::string& n, CollectiveKind* out) {
  if (n == "allgather" || n == "all_gather") *out = CollectiveKind::kAllGather;
  else if (n == "reduce_scatter" || n == "reducescatter") *out = CollectiveKind::kReduceScatter;
  else if (n == "allreduce" || n == "all_reduce") *out = CollectiveKind::kAllReduce;
  else
    return make_status(Code::kInvalidArgument, "unknown collective '%s' (allgather, reduce_scatter, allreduce)",
                       n.c_str());
  return OkStatus();
}

const char* coll_buf_name(BufId b) {
  static const char* n[] = {"user_out", "in", "gather", "part", "recv", "out", "token",
                            "in_net", "gather_net", "part_net", "recv_net", "out_net", "token_net"};
  static_assert(sizeof(n) / sizeof(n[0]) == CBuf::kCount, "a name per buffer");
  return b < CBuf::kCount ? n[b] : "?";
}
const char* coll_region_name(RegionId r) {
  static const char* n[] = {"entry", "entry_net", "reads_done", "fwd", "net_in", "local", "final", "out_count",
                            "src_free", "chain"};
  static_assert(sizeof(n) / sizeof(n[0]) == CRegion::kCount, "a name per region");
  return r < CRegion::kCount ? n[r] : "?";
}

int64_t CollPlan::in_elems() const {
  return kind == CollectiveKind::kReduceScatter ? int64_t(layout.world) * count : count;
}
int64_t CollPlan::out_elems() const {
  return kind == CollectiveKind::kAllGather ? int64_t(layout.world) * count : count;
}

Status Collective::can_implement(CollectiveKind kind, int64_t count, CollDType dtype, int world) {
  const char* name = collective_kind_name(kind);
  MK_REQUIRE(kind == CollectiveKind::kAllGather || kind == CollectiveKind::kReduceScatter ||
                 kind == CollectiveKind::kAllReduce,
             Code::kInvalidArgument, "collective: unknown kind %d", int(kind));
  MK_REQUIRE(dtype == CollDType::kBF16 || dtype == CollDType::kF32, Code::kInvalidArgument,
             "%s: dtype must be bf16 or fp32 (got %d)", name, int(dtype));
  MK_REQUIRE(world >= 1, Code::kInvalidArgument, "%s: world size %d", name, world);
  MK_REQUIRE(count > 0, Code::kInvalidArgument, "%s: count must be > 0 (got %lld)", name, (long long)count);
  MK_REQUIRE(count % 8 == 0, Code::kInvalidArgument,
             "%s: count = %lld is not a multiple of 8 elements (16-byte rows for bf16 and fp32 alike): pad it",
             name, (long long)count);
  MK_REQUIRE(count < (1ll << 40) / world, Code::kInvalidArgument, "%s: %d x %lld elements is too many (< 2^40)",
             name, world, (long long)count);
  return OkStatus();
}

namespace {

using comm::add_to;
using comm::buf_at;
using comm::flag_at;
using comm::Op;
using comm::OpKind;
using comm::set_epoch;
using comm::wait_on;

struct Builder {
  CollPlan& p;
  const comm::Layout& L;
  int W, nodes, local;
  uint64_t es;  // element size of the data
  comm::ProgramBuilder pb;
  std::vector<uint64_t> reads_of;  // per rank: reads of its workspaces by other ranks, per call

  uint64_t in_off(int64_t elem) const { return uint64_t(elem) * es; }
  // Chunk c's first element in the data (the shard's offset added).
  int64_t data_elem(int c) const { return p.shard_lo[p.chunks[c].shard] + p.chunks[c].elem0; }
  // Where the partial of chunk c (of shard s) lies in kPart / kRecv, at node slot n (fp32).
  uint64_t part_off(int n, int c) const { return (uint64_t(n) * p.max_shard + p.chunks[c].elem0) * 4; }
  // The node's ranks in local order (the order of the node sums).
  const std::vector<int>& node_of_rank(int me) const { return L.node_ranks[L.node_of[me]]; }

  // A read of rank q's kIn by me: waits for q's entry (its data of this call is there), counted
  // at q when done (AG, RS). AR counts nothing: every read of q's kIn comes before a result
  // chunk lands in q's kOut — the node sum of q's own node's shards writes it there, a partial
  // for another node's shard comes back as that shard's result, forwarded into q's kOut — and
  // q's end of call waits for every result chunk (kOutCount).
  void read_of(Op& op, int me, int q) {
    if (q == me) return;
    op.waits.push_back(wait_on(CRegion::kEntry, me, q, 1, q));
    if (p.kind == CollectiveKind::kAllReduce) return;
    op.signals.push_back(add_to(CRegion::kReadsDone, q, 0));
    ++reads_of[q];
  }

  // ---- all-gather ----
  // Chunk c from src into my output.
  Op chunk_to_output(int me, comm::BufRef src, int c, std::string what) const {
    Op op;
    op.kind = OpKind::kCopy;
    op.srcs = {src};
    op.dsts = {buf_at(CBuf::kUserOut, me, in_off(data_elem(c)))};
    op.bytes = uint64_t(p.chunks[c].elems) * es;
    op.what = std::move(what);
    return op;
  }

  void build_ag(int me) {
    comm::RankProgram& rp = p.ranks[me];
    const int n = L.node_of[me];
    pb.entry_ops(me, CRegion::kEntry, CRegion::kEntryNet, CBuf::kToken, &rp.ops);
    // 1. My shard into my output.
    for (int c : p.shard_chunks[me])
      rp.ops.push_back(chunk_to_output(me, buf_at(CBuf::kIn, me, in_off(p.chunks[c].elem0)), c,
                                       "own chunk " + std::to_string(c) + " into the output"));
    // 2. My shard to every twin's kGather (ready at the start: no local wait).
    for (int q : L.twins(me))
      for (int c : p.shard_chunks[me]) {
        Op op = pb.put(q, buf_at(CBuf::kIn, me, in_off(p.chunks[c].elem0)), buf_at(CBuf::kGather, q, in_off(data_elem(c))),
                       uint64_t(p.chunks[c].elems) * es, flag_at(CRegion::kNetIn, q, uint32_t(c)),
                       flag_at(CRegion::kSrcFree, me, uint32_t(c)),
                       "chunk " + std::to_string(c) + " to rank " + std::to_string(q) + " (network)");
        op.waits = {wait_on(CRegion::kEntryNet, me, q, 1, q)};
        rp.ops.push_back(op);
      }
    // 3. My twins' shards, landed here: into my output (staged: out of the host mirror into my
    //    kGather too, where the node's ranks read them), then the node's ranks are told.
    for (int s : L.twins(me))
      for (int c : p.shard_chunks[s]) {
        Op op;
        op.kind = OpKind::kCopy;
        op.waits = {wait_on(CRegion::kNetIn, me, uint32_t(c), 1, s)};
        op.srcs = {buf_at(p.net_staged ? CBuf::kGatherNet : CBuf::kGather, me, in_off(data_elem(c)))};
        if (p.net_staged) op.dsts.push_back(buf_at(CBuf::kGather, me, in_off(data_elem(c))));
        op.dsts.push_back(buf_at(CBuf::kUserOut, me, in_off(data_elem(c))));
        op.bytes = uint64_t(p.chunks[c].elems) * es;
        for (int q : L.node_peers(me)) op.signals.push_back(set_epoch(CRegion::kFwd, q, uint32_t(c)));
        op.what = "chunk " + std::to_string(c) + " of shard " + std::to_string(s) + " arrived: into the output, " +
                  "forwarded in the node";
        rp.ops.push_back(op);
      }
    // 4. The node's shards, read from their owners' kIn; 5. the other nodes' shards, read from
    //    the kGather of the rank of my node that received them.
    for (int q : L.node_peers(me))
      for (int c : p.shard_chunks[q]) {
        Op op = chunk_to_output(me, buf_at(CBuf::kIn, q, in_off(p.chunks[c].elem0)), c,
                                "chunk " + std::to_string(c) + " of shard " + std::to_string(q) + " read from its owner");
        read_of(op, me, q);
        rp.ops.push_back(op);
      }
    for (int d = 1; d < nodes; ++d)
      for (int s : L.node_ranks[(n + d) % nodes]) {
        const int f = node_of_rank(me)[L.local_of[s]];  // received it
        if (f == me) continue;                          // step 3
        for (int c : p.shard_chunks[s]) {
          Op op = chunk_to_output(me, buf_at(CBuf::kGather, f, in_off(data_elem(c))), c,
                                  "chunk " + std::to_string(c) + " of shard " + std::to_string(s) + " read from rank " +
                                      std::to_string(f));
          op.waits = {wait_on(CRegion::kFwd, me, uint32_t(c), 1, f)};
          op.signals.push_back(add_to(CRegion::kReadsDone, f, 0));
          ++reads_of[f];
          rp.ops.push_back(op);
        }
      }
  }

  // ---- reduce-scatter and all-reduce ----

  // The node sum of chunk c, in local order, from the node's kIn: into `dsts` (fp32 when f32).
  Op node_sum(int me, int c, std::vector<comm::BufRef> dsts, bool f32) {
    Op op;
    op.kind = OpKind::kReduce;
    for (int q : node_of_rank(me)) {
      op.srcs.push_back(buf_at(CBuf::kIn, q, in_off(data_elem(c))));
      read_of(op, me, q);
    }
    op.src_bf16 = p.dtype == CollDType::kBF16;
    op.dsts = std::move(dsts);
    op.dst_f32 = f32;
    op.elems = uint64_t(p.chunks[c].elems);
    return op;
  }

  // Where the result of chunk c goes: RS my output; AR kOut of every rank of my node (counted
  // there). Their kOut is free once they entered the call: the op already waited for that —
  // one node: the node sum read their kIn after their entry; several: the op waits for my node
  // partial (kLocal), whose op did.
  void result_dsts(Op& op, int me, int c) {
    if (p.kind == CollectiveKind::kReduceScatter) {
      op.dsts = {buf_at(CBuf::kUserOut, me, in_off(p.chunks[c].elem0))};
      return;
    }
    for (int q : node_of_rank(me)) {
      op.dsts.push_back(buf_at(CBuf::kOut, q, in_off(data_elem(c))));
      op.signals.push_back(add_to(CRegion::kOutCount, q, 0));
    }
    if (nodes > 1) op.signals.push_back(set_epoch(CRegion::kFinal, me, uint32_t(c)));
  }

  void build_reduce(int me) {
    comm::RankProgram& rp = p.ranks[me];
    const int n = L.node_of[me];
    const bool f32 = p.dtype == CollDType::kF32;
    pb.entry_ops(me, CRegion::kEntry, CRegion::kEntryNet, CBuf::kToken, &rp.ops);
    // 1. The shards of my twins: the node sum (fp32) into kPart, put to the twin.
    for (int s : L.twins(me))
      for (int c : p.shard_chunks[s]) {
        Op op = node_sum(me, c, {buf_at(CBuf::kPart, me, part_off(L.node_of[s], c))}, true);
        op.signals.push_back(set_epoch(CRegion::kLocal, me, uint32_t(c)));
        op.what = "node sum of chunk " + std::to_string(c) + " (shard " + std::to_string(s) + ")";
        rp.ops.push_back(op);
        // AR needs no local completion: the partial is delivered before the twin's result of
        // the chunk exists, and that result comes back here (kOutCount, end of call).
        const comm::FlagRef done =
            p.kind == CollectiveKind::kAllReduce ? comm::FlagRef{} : flag_at(CRegion::kSrcFree, me, uint32_t(c));
        Op put = pb.put(s, buf_at(CBuf::kPart, me, part_off(L.node_of[s], c)), buf_at(CBuf::kRecv, s, part_off(n, c)),
                        uint64_t(p.chunks[c].elems) * 4, flag_at(CRegion::kNetIn, s, uint32_t(c * nodes + n)), done,
                        "partial of chunk " + std::to_string(c) + " to rank " + std::to_string(s) + " (network)");
        put.waits = {wait_on(CRegion::kLocal, me, uint32_t(c), 1, me), wait_on(CRegion::kEntryNet, me, s, 1, s)};
        rp.ops.push_back(put);
      }
    // 2. My own shard. One node: the node sum is the result. Several: my node's partial first
    //    (kPart at my node's slot), then the partials of every node summed in node order.
    for (int c : p.shard_chunks[me]) {
      if (nodes == 1) {
        Op op = node_sum(me, c, {}, f32);
        result_dsts(op, me, c);
        op.what = "sum of chunk " + std::to_string(c) + " (own shard)";
        rp.ops.push_back(op);
        continue;
      }
      Op part = node_sum(me, c, {buf_at(CBuf::kPart, me, part_off(n, c))}, true);
      part.signals.push_back(set_epoch(CRegion::kLocal, me, uint32_t(c)));
      part.what = "node sum of chunk " + std::to_string(c) + " (own shard)";
      rp.ops.push_back(part);
      // The partials in node order, each with the wait that makes it final.
      std::vector<comm::BufRef> srcs;
      std::vector<comm::Wait> waits;
      for (int nn = 0; nn < nodes; ++nn) {
        if (nn == n) {
          waits.push_back(wait_on(CRegion::kLocal, me, uint32_t(c), 1, me));
          srcs.push_back(buf_at(CBuf::kPart, me, part_off(n, c)));
        } else {
          waits.push_back(wait_on(CRegion::kNetIn, me, uint32_t(c * nodes + nn), 1, L.node_ranks[nn][L.local_of[me]]));
          // Staged: read where the partials landed, in the host mirror.
          srcs.push_back(buf_at(p.net_staged ? CBuf::kRecvNet : CBuf::kRecv, me, part_off(nn, c)));
        }
      }
      // More than one op takes (16 buffers): links that add the next partials to the first
      // one's buffer in place (fp32), each waiting for the link before it; the last op adds the
      // rest and writes the result. The same additions in the same order as one op.
      Op op;
      op.kind = OpKind::kReduce;
      op.elems = uint64_t(p.chunks[c].elems);
      result_dsts(op, me, c);
      size_t next = 0;
      for (int l = 0; l < p.chain_links; ++l) {
        Op link;
        link.kind = OpKind::kReduce;
        link.elems = op.elems;
        link.dst_f32 = true;
        if (l > 0) {
          link.srcs.push_back(srcs[0]);
          link.waits.push_back(wait_on(CRegion::kChain, me, uint32_t(c * p.chain_links + l - 1), 1, me));
        }
        while (link.srcs.size() < size_t(comm::kMaxOpBuffers - 1) && next < srcs.size()) {
          link.srcs.push_back(srcs[next]);
          link.waits.push_back(waits[next]);
          ++next;
        }
        link.dsts = {srcs[0]};
        link.signals.push_back(set_epoch(CRegion::kChain, me, uint32_t(c * p.chain_links + l)));
        link.what = "final sum of chunk " + std::to_string(c) + " (own shard), link " + std::to_string(l) +
                    ": the partials of nodes up to " + std::to_string(next - 1);
        rp.ops.push_back(link);
      }
      if (p.chain_links > 0) {
        op.srcs.push_back(srcs[0]);
        op.waits.push_back(wait_on(CRegion::kChain, me, uint32_t(c * p.chain_links + p.chain_links - 1), 1, me));
      }
      for (; next < srcs.size(); ++next) {
        op.srcs.push_back(srcs[next]);
        op.waits.push_back(waits[next]);
      }
      op.dst_f32 = f32;
      op.what = "final sum of chunk " + std::to_string(c) + " (own shard)";
      rp.ops.push_back(op);
    }
    if (p.kind != CollectiveKind::kAllReduce || nodes == 1) return;
    // 3. AR: my result chunks to my twins' kOut; theirs, landed here, forwarded in my node.
    const uint32_t res0 = uint32_t(p.chunks.size() * nodes);
    for (int q : L.twins(me))
      for (int c : p.shard_chunks[me]) {
        Op put = pb.put(q, buf_at(CBuf::kOut, me, in_off(data_elem(c))), buf_at(CBuf::kOut, q, in_off(data_elem(c))),
                        uint64_t(p.chunks[c].elems) * es, flag_at(CRegion::kNetIn, q, res0 + uint32_t(c)),
                        flag_at(CRegion::kSrcFree, me, uint32_t(c)),
                        "result chunk " + std::to_string(c) + " to rank " + std::to_string(q) + " (network)");
        // q's kOut is free: q entered this call before it sent its partial of the chunk, which
        // the result waited for (kFinal after kNetIn).
        put.waits = {wait_on(CRegion::kFinal, me, uint32_t(c), 1, me)};
        rp.ops.push_back(put);
      }
    for (int s : L.twins(me))
      for (int c : p.shard_chunks[s]) {
        Op op;
        op.waits = {wait_on(CRegion::kNetIn, me, res0 + uint32_t(c), 1, s)};
        const comm::BufRef mine = buf_at(CBuf::kOut, me, in_off(data_elem(c)));
        op.srcs = {p.net_staged ? buf_at(CBuf::kOutNet, me, mine.offset) : mine};
        if (p.net_staged) op.dsts.push_back(mine);
        // The node's kOut are free: the chunk's result was summed from my node partial of it,
        // which read every node peer's kIn after its entry (node_sum).
        for (int q : L.node_peers(me)) op.dsts.push_back(buf_at(CBuf::kOut, q, mine.offset));
        for (int q : node_of_rank(me)) op.signals.push_back(add_to(CRegion::kOutCount, q, 0));
        op.kind = op.dsts.empty() ? OpKind::kSignal : OpKind::kCopy;
        if (op.dsts.empty()) op.srcs.clear();
        op.bytes = op.dsts.empty() ? 0 : uint64_t(p.chunks[c].elems) * es;
        op.what = "result chunk " + std::to_string(c) + " of shard " + std::to_string(s) + " forwarded in the node";
        rp.ops.push_back(op);
      }
  }

  // The end of call: my puts left their sources, the node's reads of my workspaces are done and
  // (AR) the whole result landed in my kOut.
  void end_of_call(int me) {
    comm::RankProgram& rp = p.ranks[me];
    for (const auto& [c, count] : pb.completions(CRegion::kSrcFree, me)) {
      Op op = pb.signal_op({}, "puts of chunk " + std::to_string(c) + " done reading their source");
      op.waits = {wait_on(CRegion::kSrcFree, me, c, count, me)};
      rp.ops.push_back(op);
    }
    Op end;
    end.kind = OpKind::kSignal;
    if (reads_of[me]) end.waits.push_back(wait_on(CRegion::kReadsDone, me, 0, reads_of[me], -1));
    if (p.kind == CollectiveKind::kAllReduce)
      end.waits.push_back(wait_on(CRegion::kOutCount, me, 0, uint64_t(p.chunks.size()), -1));
    end.what = "end of call: the node's reads of my workspaces done" +
               std::string(p.kind == CollectiveKind::kAllReduce ? ", the whole result in kOut" : "");
    if (!end.waits.empty()) rp.ops.push_back(end);
  }
};

}  // namespace

int chain_links_for(int partials, int dsts) {
  // One op: the partials and the destinations. Else links of up to kMaxOpBuffers - 1 new
  // partials (the first) or the accumulator and up to kMaxOpBuffers - 2 new ones, each with the
  // accumulator as its destination, until the last op fits: the accumulator, what is left (maybe
  // nothing) and the destinations.
  if (partials + dsts <= comm::kMaxOpBuffers) return 0;
  int left = partials - std::min(partials, comm::kMaxOpBuffers - 1), links = 1;
  while (1 + left + dsts > comm::kMaxOpBuffers) left -= std::min(left, comm::kMaxOpBuffers - 2), ++links;
  return links;
}

int64_t default_chunk_elems(int64_t max_shard) {
  // 32 chunks per shard: all-reduce of 64 MiB at W = 4 (2026-12-05, one-off sweep) was 0.70 of a
  // device copy with 64 chunks (128 Ki elements), 0.77-0.80 with 32.
  const int64_t c = ((max_shard + 31) / 32 + 7) / 8 * 8;
  return std::min(kCollMaxChunkElems, std::max(kCollMinChunkElems, c));
}

Status build_coll_plan(CollectiveKind kind, int64_t count, CollDType dtype, const comm::Layout& layout,
                       int64_t chunk_elems, bool net_staged, CollPlan* out) {
  const int W = layout.world;
  MK_CHECK(layout.check("collective plan"));
  const int local = layout.local();
  MK_CHECK(Collective::can_implement(kind, count, dtype, W));
  {
    // An op touches at most 16 buffers (the executor's pointer table): the node sums read a
    // node's inputs (and, for the one-node all-reduce, write every rank of the node); the final
    // sums over many nodes' partials are chains (chain_links_for).
    const int nodes = layout.nodes();
    int most = 3;  // AG: a staged arrival into kGather and the output
    if (kind == CollectiveKind::kReduceScatter) most = local + 1;
    if (kind == CollectiveKind::kAllReduce) most = nodes == 1 ? 2 * local : local + 1;
    MK_REQUIRE(most <= comm::kMaxOpBuffers, Code::kNotSupported,
               "%s on %d node(s) of %d rank(s): an op would touch %d buffers (at most %d: an all-reduce on one node "
               "up to 8 ranks, on several nodes up to 15 ranks per node; a reduce-scatter up to 15 ranks per node)",
               collective_kind_name(kind), nodes, local, most, comm::kMaxOpBuffers);
  }
  MK_REQUIRE(chunk_elems <= (1ll << 32), Code::kInvalidArgument, "%s: chunk of %lld elements is too large (<= 2^32)",
             collective_kind_name(kind), (long long)chunk_elems);
  CollPlan& p = *out;
  p = CollPlan{};
  p.kind = kind;
  p.dtype = dtype;
  p.count = count;
  p.layout = layout;
  p.net_staged = net_staged && layout.nodes() > 1;
  const int nodes = layout.nodes();
  // Shards: AG and RS `count` each; AR the count split in W parts of whole 8-element groups.
  p.shard_lo.resize(W);
  p.shard_hi.resize(W);
  const int64_t per = kind == CollectiveKind::kAllReduce ? (count / 8 + W - 1) / W * 8 : count;
  for (int s = 0; s < W; ++s) {
    const int64_t total = kind == CollectiveKind::kAllReduce ? count : int64_t(W) * count;
    p.shard_lo[s] = std::min<int64_t>(total, int64_t(s) * per);
    p.shard_hi[s] = std::min<int64_t>(total, int64_t(s + 1) * per);
    p.max_shard = std::max(p.max_shard, p.shard_hi[s] - p.shard_lo[s]);
  }
  p.chunk_elems = chunk_elems <= 0 ? default_chunk_elems(p.max_shard) : (chunk_elems + 7) / 8 * 8;
  p.shard_chunks.resize(W);
  for (int s = 0; s < W; ++s)
    for (int64_t e = 0; e < p.shard_hi[s] - p.shard_lo[s]; e += p.chunk_elems) {
      p.shard_chunks[s].push_back(int(p.chunks.size()));
      p.chunks.push_back(CollChunk{s, e, std::min(p.chunk_elems, p.shard_hi[s] - p.shard_lo[s] - e)});
    }
  MK_REQUIRE(p.chunks.size() < (1u << 24) / uint32_t(nodes + 1), Code::kInvalidArgument,
             "%s: %zu chunks are too many: raise chunk_elems", collective_kind_name(kind), p.chunks.size());
  const uint64_t es = uint64_t(p.esize());
  const bool reduce = kind != CollectiveKind::kAllGather;
  std::vector<uint64_t> bb(CBuf::kCount, 0);
  bb[CBuf::kIn] = uint64_t(p.in_elems()) * es;
  if (kind != CollectiveKind::kAllReduce) bb[CBuf::kUserOut] = uint64_t(p.out_elems()) * es;
  if (kind == CollectiveKind::kAllReduce) bb[CBuf::kOut] = uint64_t(count) * es;
  if (nodes > 1) {
    bb[CBuf::kToken] = 8ull * W;
    if (!reduce) bb[CBuf::kGather] = uint64_t(W) * count * es;
    if (reduce) bb[CBuf::kPart] = bb[CBuf::kRecv] = uint64_t(nodes) * p.max_shard * 4;
  }
  auto mirror = [](BufId b) -> BufId {
    switch (b) {
      case CBuf::kIn: return CBuf::kInNet;
      case CBuf::kGather: return CBuf::kGatherNet;
      case CBuf::kPart: return CBuf::kPartNet;
      case CBuf::kRecv: return CBuf::kRecvNet;
      case CBuf::kOut: return CBuf::kOutNet;
      case CBuf::kToken: return CBuf::kTokenNet;
      default: return comm::kNoBuf;
    }
  };
  // What crosses nodes: AG my shard (kIn) into the twins' kGather; RS/AR the partials (kPart
  // into kRecv); AR the results (kOut); the entry token.
  std::vector<char> crosses(CBuf::kCount, 0);
  if (nodes > 1) {
    crosses[CBuf::kToken] = 1;
    if (!reduce) crosses[CBuf::kIn] = crosses[CBuf::kGather] = 1;
    if (reduce) crosses[CBuf::kPart] = crosses[CBuf::kRecv] = 1;
    if (kind == CollectiveKind::kAllReduce) crosses[CBuf::kOut] = 1;
  }
  if (p.net_staged) {
    for (BufId b = 0; b < CBuf::kInNet; ++b)
      if (crosses[b]) bb[mirror(b)] = bb[b];
    // Only the network wrote these: read from (or sent out of) their mirrors instead.
    bb[CBuf::kRecv] = 0;
    bb[CBuf::kToken] = 0;
  }
  Builder b{p, layout, W, nodes, local, es, comm::ProgramBuilder(p), std::vector<uint64_t>(W, 0)};
  for (BufId id = 0; id < CBuf::kCount; ++id) {
    const bool user = id == CBuf::kUserOut, host = id >= CBuf::kInNet;
    BufId mirror_of = comm::kNoBuf;
    for (BufId m = 0; m < CBuf::kInNet; ++m)
      if (host && mirror(m) == id) mirror_of = m;
    const bool network = host ? bb[id] > 0 : (!user && crosses[id] && !p.net_staged);
    b.pb.buf(coll_buf_name(id), bb[id], user ? comm::Space::kUser : host ? comm::Space::kHost : comm::Space::kSymmetric,
             network, user ? kCollUserSlotOut : -1, mirror_of, id == CBuf::kToken || id == CBuf::kTokenNet);
  }
  const uint32_t nch = uint32_t(p.chunks.size());
  if (reduce && nodes > 1)
    p.chain_links = chain_links_for(nodes, kind == CollectiveKind::kAllReduce ? local : 1);
  p.add_region(coll_region_name(CRegion::kEntry), W, false);
  p.add_region(coll_region_name(CRegion::kEntryNet), W, true);
  p.add_region(coll_region_name(CRegion::kReadsDone), 1, false);
  p.add_region(coll_region_name(CRegion::kFwd), nch, false);
  p.add_region(coll_region_name(CRegion::kNetIn), nch * uint32_t(nodes + 1), true);
  p.add_region(coll_region_name(CRegion::kLocal), nch, false);
  p.add_region(coll_region_name(CRegion::kFinal), nch, false);
  p.add_region(coll_region_name(CRegion::kOutCount), 1, false);
  p.add_region(coll_region_name(CRegion::kSrcFree), nch, true);
  p.add_region(coll_region_name(CRegion::kChain), nch * uint32_t(p.chain_links), false);
  p.place_regions();
  p.ranks.resize(W);
  for (int me = 0; me < W; ++me) {
    p.ranks[me].rank = me;
    if (kind == CollectiveKind::kAllGather) b.build_ag(me);
    else b.build_reduce(me);
  }
  // The end-of-call ops count every rank's reads of the others' workspaces: after all lists.
  for (int me = 0; me < W; ++me) b.end_of_call(me);
  return OkStatus();
}

std::string describe(const CollPlan& p, int rank) {
  char line[256];
  snprintf(line, sizeof line, "%s %s rank %d: count %lld, %d ranks on %d nodes%s, %zu chunks of <= %lld, %zu ops\n",
           collective_kind_name(p.kind), coll_dtype_name(p.dtype), rank, (long long)p.count, p.layout.world,
           p.layout.nodes(), p.net_staged ? " (staged)" : "", p.chunks.size(), (long long)p.chunk_elems,
           p.ranks[rank].ops.size());
  return line + comm::describe(p.ranks[rank]);
}

}  // namespace ops
}  // namespace mk
