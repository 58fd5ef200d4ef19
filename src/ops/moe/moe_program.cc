// The communication programs of MoE dispatch and combine (see src/ops/moe/moe_program.h).
#include "src/ops/moe/moe_program.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "mkernel/common/check.h"
#include "src/comm/program_builder.h"

namespace mk {
namespace ops {

namespace {

using comm::add_to;
using comm::BufId;
using comm::BufRef;
using comm::flag_at;
using comm::Op;
using comm::OpKind;
using comm::ProgramBuilder;
using comm::wait_on;

// The buffers every MoE program declares first (MoeBuf kSend .. kPieceBytes) and its regions.
void declare_slots(ProgramBuilder& pb, uint64_t all, int pieces, bool direct) {
  const int W = pb.decl().layout.world;
  const bool staged = pb.decl().net_staged;
  pb.buf("send", all, comm::Space::kSymmetric, direct);
  pb.buf("recv", all, comm::Space::kSymmetric, direct);
  pb.buf("token", (direct ? 8ull : 0ull) * W, comm::Space::kSymmetric, direct, -1, comm::kNoBuf, true);
  pb.buf("send_net", staged ? all : 0, comm::Space::kHost, staged, -1, MoeBuf::kSend);
  pb.buf("recv_net", staged ? all : 0, comm::Space::kHost, staged, -1, MoeBuf::kRecv);
  pb.buf("token_net", (staged ? 8ull : 0ull) * W, comm::Space::kHost, staged, -1, MoeBuf::kToken, true);
  pb.buf("piece_bytes", 8ull * W * pieces, comm::Space::kSymmetric, false);
}
void declare_regions(comm::Program& p, bool fwd) {
  const uint32_t W = uint32_t(p.layout.world);
  p.add_region("arrived", W, false);
  p.add_region("arrived_net", W, true);
  p.add_region("entry", W, false);
  p.add_region("entry_net", W, true);
  p.add_region("src_free", 1, true);
  if (fwd) p.add_region("fwd", W, false);
  p.place_regions();
}

// Entry: this rank's receive slots are free for this call (its previous unpack ran before this
// call's runner, stream order) — source s may send. A device signal on the node, a token put
// (raising entry_net there) across nodes.
Op entry_op(ProgramBuilder& pb, int me, int s, bool remote, const std::string& what) {
  if (remote)
    return pb.token_put(me, s, MoeBuf::kToken, flag_at(MoeRegion::kEntryNet, s, uint32_t(me)),
                        flag_at(MoeRegion::kSrcFree, me, 0),
                        what + " entry signal to rank " + std::to_string(s) + " (network)");
  return ProgramBuilder::signal_op({add_to(MoeRegion::kEntry, s, uint32_t(me))},
                                   what + " entry signal to rank " + std::to_string(s));
}

// One slot from this rank to rank `to`, in pieces of moe_piece_bytes: the run-time count of piece
// pc at `counts` + 8 pc. Across nodes a put (staged: between the buffers' host mirrors) raising
// arrived_net[me] there; on the node a copy raising arrived[me] there.
struct SlotMove {
  int me = 0, to = 0;
  bool remote = false;
  BufRef src, dst, counts;
  int64_t slot_bytes = 0;
  int pieces = 1;  // requested (moe_pieces)
  std::string label, suffix;  // "<label>[ piece i]<suffix>"
};
void add_slot_pieces(ProgramBuilder& pb, comm::RankProgram& rp, const SlotMove& m) {
  const int P = moe_pieces(m.slot_bytes, m.pieces);
  const int64_t pb_bytes = moe_piece_bytes(m.slot_bytes, m.pieces);
  for (int pc = 0; pc < P; ++pc) {
    const uint64_t off = uint64_t(pc) * uint64_t(pb_bytes);
    const uint64_t bytes = uint64_t(std::min<int64_t>(pb_bytes, m.slot_bytes - int64_t(off)));
    BufRef src = m.src, dst = m.dst;
    src.offset += off;
    dst.offset += off;
    const std::string what = m.label + (P > 1 ? " piece " + std::to_string(pc) : std::string()) + m.suffix;
    Op op;
    if (m.remote) {
      op = pb.put(m.to, src, dst, bytes, flag_at(MoeRegion::kArrivedNet, m.to, uint32_t(m.me)),
                  flag_at(MoeRegion::kSrcFree, m.me, 0), what);
      op.waits = {wait_on(MoeRegion::kEntryNet, m.me, uint32_t(m.to), 1, m.to)};
    } else {
      op.kind = OpKind::kCopy;
      op.srcs = {src};
      op.dsts = {dst};
      op.bytes = bytes;
      op.waits = {wait_on(MoeRegion::kEntry, m.me, uint32_t(m.to), 1, m.to)};
      op.signals = {add_to(MoeRegion::kArrived, m.to, uint32_t(m.me))};
      op.what = what;
    }
    op.count_at = m.counts;
    op.count_at.offset += 8ull * pc;
    rp.ops.push_back(op);
  }
}

// A slot from rank s on another node is here once all its `pieces` puts landed: staged, copied
// from its host mirror (`mirror`, byte count at its start) into `slot`; then arrived[s].
Op relay_op(const comm::Program& p, int me, int s, BufRef mirror, BufRef slot, uint64_t bytes, uint64_t pieces,
            const std::string& label) {
  Op op;
  op.waits = {wait_on(MoeRegion::kArrivedNet, me, uint32_t(s), pieces, s)};
  op.signals = {add_to(MoeRegion::kArrived, me, uint32_t(s))};
  if (p.net_staged) {
    op.kind = OpKind::kCopy;
    op.srcs = {mirror};
    op.dsts = {slot};
    op.bytes = bytes;
    op.count_at = mirror;
    op.what = label + " of rank " + std::to_string(s) + " from the host mirror";
  } else {
    op.kind = OpKind::kSignal;
    op.what = label + " of rank " + std::to_string(s) + " landed";
  }
  return op;
}

// The call ends once every slot is here (waits: source and how many raises of arrived) and the
// proxy finished reading this call's sources.
Op final_op(const ProgramBuilder& pb, int me, const std::vector<std::pair<int, uint64_t>>& arrivals,
            const std::string& what) {
  Op op;
  op.kind = OpKind::kSignal;
  for (const auto& a : arrivals) op.waits.push_back(wait_on(MoeRegion::kArrived, me, uint32_t(a.first), a.second, a.first));
  if (const uint64_t puts = pb.completions_at(flag_at(MoeRegion::kSrcFree, me, 0)))
    op.waits.push_back(wait_on(MoeRegion::kSrcFree, me, 0, puts, me));
  op.what = what;
  return op;
}

}  // namespace

int64_t moe_piece_bytes(int64_t slot_bytes, int pieces) {
  pieces = std::max(pieces, 1);
  return ((slot_bytes + pieces - 1) / pieces + 15) / 16 * 16;  // rounded up to 16 bytes
}
int moe_pieces(int64_t slot_bytes, int pieces) {
  const int64_t pb = moe_piece_bytes(slot_bytes, pieces);
  return int((slot_bytes + pb - 1) / pb);
}
uint64_t moe_piece_count(int64_t slot_bytes, int pieces, int p, uint64_t used) {
  return moe_piece_count_of(slot_bytes, moe_piece_bytes(slot_bytes, pieces), p, used);
}

Status build_moe_program(const comm::Layout& layout, int64_t slot_bytes, int pieces_req, bool staged,
                         const std::string& what, comm::Program* out) {
  const int W = layout.world;
  MK_REQUIRE(W >= 1 && slot_bytes > 0 && slot_bytes % 16 == 0 && pieces_req >= 1, Code::kInvalidArgument,
             "moe: bad %s slot of %lld bytes in %d pieces", what.c_str(), (long long)slot_bytes, pieces_req);
  const int P = moe_pieces(slot_bytes, pieces_req);
  comm::Program& p = *out;
  p = comm::Program{};
  p.layout = layout;
  const bool net = layout.nodes() > 1;
  p.net_staged = staged && net;
  ProgramBuilder pb(p);
  declare_slots(pb, uint64_t(W) * uint64_t(slot_bytes), P, net && !p.net_staged);
  declare_regions(p, false);
  p.ranks.resize(W);
  auto slot = [&](BufId b, int rank, int index) { return BufRef{b, rank, uint64_t(index) * uint64_t(slot_bytes)}; };
  auto remote = [&](int a, int b) { return !layout.same_node(a, b); };
  for (int me = 0; me < W; ++me) {
    comm::RankProgram& rp = p.ranks[me];
    rp.rank = me;
    if (W == 1) continue;
    for (int d = 1; d < W; ++d) {
      const int s = (me + W - d) % W;
      rp.ops.push_back(entry_op(pb, me, s, remote(me, s), what));
    }
    // The slots, nearest destinations first in rotation (ranks do not all start on one peer),
    // piece by piece.
    for (int d = 1; d < W; ++d) {
      const int r = (me + d) % W;
      SlotMove m;
      m.me = me, m.to = r, m.remote = remote(me, r);
      m.src = slot(MoeBuf::kSend, me, r);
      m.dst = slot(MoeBuf::kRecv, r, me);
      m.counts = BufRef{MoeBuf::kPieceBytes, me, 8ull * uint64_t(r) * P};
      m.slot_bytes = slot_bytes, m.pieces = pieces_req;
      m.label = what + " slot";
      m.suffix = " to rank " + std::to_string(r) + (m.remote ? " (network)" : "");
      add_slot_pieces(pb, rp, m);
    }
    std::vector<std::pair<int, uint64_t>> arrivals;
    for (int d = 1; d < W; ++d) {
      const int s = (me + W - d) % W;
      arrivals.push_back({s, remote(me, s) ? 1 : uint64_t(P)});
      if (remote(me, s))
        rp.ops.push_back(relay_op(p, me, s, slot(MoeBuf::kRecvNet, me, s), slot(MoeBuf::kRecv, me, s),
                                  uint64_t(slot_bytes), uint64_t(P), what + " slot"));
    }
    rp.ops.push_back(final_op(pb, me, arrivals, what + ": every slot arrived"));
  }
  return OkStatus();
}

MoeHierPools moe_hier_pools(const comm::Layout& layout, int me) {
  MoeHierPools p;
  const int N = layout.node_of[me], L = layout.local_of[me];
  const int locals = int(layout.node_ranks[N].size());
  p.repack_waits = uint32_t(locals - 1 + layout.nodes() - 1);
  for (int s = 0; s < layout.world; ++s)
    if (layout.node_of[s] != N && layout.local_of[s] != L) ++p.layout_waits;
  p.repack_signals = uint32_t((locals - 1) * (layout.nodes() - 1));
  return p;
}

Status build_moe_hier_program(const comm::Layout& layout, int64_t slot_bytes, int64_t nslot_bytes, int pieces_req,
                              bool staged, comm::Program* out) {
  const int W = layout.world, NN = layout.nodes();
  MK_REQUIRE(NN > 1 && slot_bytes > 0 && slot_bytes % 16 == 0 && nslot_bytes > 0 && nslot_bytes % 16 == 0 &&
                 pieces_req >= 1,
             Code::kInvalidArgument, "moe: bad hierarchical program (%d nodes, slots %lld / %lld bytes)", NN,
             (long long)slot_bytes, (long long)nslot_bytes);
  const int P = moe_pieces(slot_bytes, pieces_req), NP = moe_pieces(nslot_bytes, pieces_req);
  comm::Program& p = *out;
  p = comm::Program{};
  p.layout = layout;
  p.net_staged = staged;
  const bool direct = !staged;
  const uint64_t nall = uint64_t(NN) * uint64_t(nslot_bytes);
  // The record slots stay on the node (no network windows, no mirrors); node slots cross.
  ProgramBuilder pb(p);
  declare_slots(pb, uint64_t(W) * uint64_t(slot_bytes), P, false);
  p.bufs[MoeBuf::kToken].bytes = direct ? 8ull * W : 0;
  p.bufs[MoeBuf::kToken].network = direct;
  p.bufs[MoeBuf::kTokenNet].bytes = staged ? 8ull * W : 0;
  p.bufs[MoeBuf::kTokenNet].network = staged;
  p.bufs[MoeBuf::kSendNet].network = p.bufs[MoeBuf::kRecvNet].network = false;
  p.bufs[MoeBuf::kSendNet].bytes = p.bufs[MoeBuf::kRecvNet].bytes = 0;
  pb.buf("nsend", nall, comm::Space::kSymmetric, direct);
  pb.buf("nrecv", nall, comm::Space::kSymmetric, direct);
  pb.buf("nsend_net", staged ? nall : 0, comm::Space::kHost, staged, -1, MoeBuf::kNSend);
  pb.buf("nrecv_net", staged ? nall : 0, comm::Space::kHost, staged, -1, MoeBuf::kNRecv);
  pb.buf("npiece_bytes", 8ull * NN * NP, comm::Space::kSymmetric, false);
  declare_regions(p, true);
  p.ranks.resize(W);
  for (int me = 0; me < W; ++me) {
    comm::RankProgram& rp = p.ranks[me];
    rp.rank = me;
    const int N = layout.node_of[me], L = layout.local_of[me];
    const std::vector<int>& mine = layout.node_ranks[N];
    std::vector<int> twins;  // the rank with my local index on every other node
    for (int n = 0; n < NN; ++n)
      if (n != N) twins.push_back(layout.node_ranks[n][L]);
    for (int s : mine)
      if (s != me) rp.ops.push_back(entry_op(pb, me, s, false, "dispatch"));
    for (int s : twins) rp.ops.push_back(entry_op(pb, me, s, true, "dispatch"));
    // Node slots first (the network is the long pole), then the node's own slots.
    for (int s : twins) {
      const int n = layout.node_of[s];
      SlotMove m;
      m.me = me, m.to = s, m.remote = true;
      m.src = BufRef{MoeBuf::kNSend, me, uint64_t(n) * uint64_t(nslot_bytes)};
      m.dst = BufRef{MoeBuf::kNRecv, s, uint64_t(N) * uint64_t(nslot_bytes)};
      m.counts = BufRef{MoeBuf::kNPieceBytes, me, 8ull * uint64_t(n) * NP};
      m.slot_bytes = nslot_bytes, m.pieces = pieces_req;
      m.label = "dispatch node slot";
      m.suffix = " to rank " + std::to_string(s) + " (node " + std::to_string(n) + ", network)";
      add_slot_pieces(pb, rp, m);
    }
    for (int d = 1; d < int(mine.size()); ++d) {
      const int r = mine[(L + d) % mine.size()];
      SlotMove m;
      m.me = me, m.to = r, m.remote = false;
      m.src = BufRef{MoeBuf::kSend, me, uint64_t(r) * uint64_t(slot_bytes)};
      m.dst = BufRef{MoeBuf::kRecv, r, uint64_t(me) * uint64_t(slot_bytes)};
      m.counts = BufRef{MoeBuf::kPieceBytes, me, 8ull * uint64_t(r) * P};
      m.slot_bytes = slot_bytes, m.pieces = pieces_req;
      m.label = "dispatch slot";
      m.suffix = " to rank " + std::to_string(r);
      add_slot_pieces(pb, rp, m);
    }
    for (int s : twins) {
      const uint64_t off = uint64_t(layout.node_of[s]) * uint64_t(nslot_bytes);
      rp.ops.push_back(relay_op(p, me, s, BufRef{MoeBuf::kNRecvNet, me, off}, BufRef{MoeBuf::kNRecv, me, off},
                                uint64_t(nslot_bytes), uint64_t(NP), "dispatch node slot"));
    }
    std::vector<std::pair<int, uint64_t>> arrivals;
    for (int s : mine)
      if (s != me) arrivals.push_back({s, uint64_t(P)});
    for (int s : twins) arrivals.push_back({s, 1});
    rp.ops.push_back(final_op(pb, me, arrivals, "dispatch: every slot of the node and every node slot arrived"));
    // The kernels' pools (moe_program.h): repack waits, layout waits, repack signals.
    for (int d : mine)
      if (d != me) rp.waits.push_back(wait_on(MoeRegion::kEntry, me, uint32_t(d), 1, d));
    for (int s : twins) rp.waits.push_back(wait_on(MoeRegion::kArrived, me, uint32_t(s), 1, s));
    for (int s = 0; s < W; ++s)
      if (layout.node_of[s] != N && layout.local_of[s] != L)
        rp.waits.push_back(wait_on(MoeRegion::kFwd, me, uint32_t(s), 1, layout.node_ranks[N][layout.local_of[s]]));
    for (int d : mine)
      if (d != me)
        for (int s : twins) rp.signals.push_back(add_to(MoeRegion::kFwd, d, uint32_t(s)));
  }
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
