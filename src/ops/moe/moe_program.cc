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
  // The flags the pieces raise at `to` (the layer's combine has its own).
  comm::RegionId arrived = MoeRegion::kArrived, arrived_net = MoeRegion::kArrivedNet;
  // Whether every piece waits for `to`'s entry (dispatch); and further waits of every piece.
  bool entry = true;
  std::vector<comm::Wait> waits;
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
      op = pb.put(m.to, src, dst, bytes, flag_at(m.arrived_net, m.to, uint32_t(m.me)),
                  flag_at(MoeRegion::kSrcFree, m.me, 0), what);
      if (m.entry) op.waits = {wait_on(MoeRegion::kEntryNet, m.me, uint32_t(m.to), 1, m.to)};
    } else {
      op.kind = OpKind::kCopy;
      op.srcs = {src};
      op.dsts = {dst};
      op.bytes = bytes;
      if (m.entry) op.waits = {wait_on(MoeRegion::kEntry, m.me, uint32_t(m.to), 1, m.to)};
      op.signals = {add_to(m.arrived, m.to, uint32_t(m.me))};
      op.what = what;
    }
    op.waits.insert(op.waits.end(), m.waits.begin(), m.waits.end());
    op.count_at = m.counts;
    op.count_at.offset += 8ull * pc;
    rp.ops.push_back(op);
  }
}

// A slot from rank s on another node is here once all its `pieces` puts landed: staged, copied
// from its host mirror (`mirror`, byte count at its start) into `slot`; then arrived[s].
// (The layer's relays name their own regions, and where the byte count is when not at the
// mirror's start.)
Op relay_op(const comm::Program& p, int me, int s, BufRef mirror, BufRef slot, uint64_t bytes, uint64_t pieces,
            const std::string& label, comm::RegionId arrived_net = MoeRegion::kArrivedNet,
            comm::RegionId arrived = MoeRegion::kArrived, const BufRef* count_at = nullptr) {
  Op op;
  op.waits = {wait_on(arrived_net, me, uint32_t(s), pieces, s)};
  op.signals = {add_to(arrived, me, uint32_t(s))};
  if (p.net_staged) {
    op.kind = OpKind::kCopy;
    op.srcs = {mirror};
    op.dsts = {slot};
    op.bytes = bytes;
    op.count_at = count_at ? *count_at : mirror;
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

MoeLayerPools moe_layer_pools(int W, int El) {
  MoeLayerPools p;
  const uint32_t o = uint32_t(W - 1);
  p.hdr = 0;
  p.laid = p.hdr + o;
  p.arrived = p.laid + 1;
  p.unpacked = p.arrived + o;
  p.g1 = p.unpacked + uint32_t(W);
  p.packed = p.g1 + uint32_t(El);
  p.carrived = p.packed + 1;
  p.waits = p.carrived + o;
  p.s_laid = 0;
  p.s_unpacked = 1;
  p.s_g1 = p.s_unpacked + uint32_t(W);
  p.s_packed = p.s_g1 + uint32_t(El);
  p.signals = p.s_packed + 1;
  return p;
}

int64_t moe_layer_lay_bytes(const MoeGeometry& g) {
  return 4 * (int64_t(g.El) + (g.El + 1) + int64_t(g.W) * g.El + 2 * g.recv_rows + 2 * int64_t(g.El));
}

Status build_moe_layer_program(const comm::Layout& layout, const MoeGeometry& g, int64_t inter, int pieces_req,
                               int unpack_chunks, bool staged, comm::Program* out) {
  const int W = layout.world, El = g.El;
  MK_REQUIRE(W >= 1 && W == g.W && El >= 1 && inter > 0 && pieces_req >= 1 && unpack_chunks >= 1 &&
                 g.slot_bytes > g.hdr_bytes && g.hdr_bytes % 16 == 0 && g.cslot_bytes % 16 == 0,
             Code::kInvalidArgument,
             "moe layer: bad program geometry (world %d, geometry for %d, %d local experts, %d unpack chunks)", W, g.W,
             El, unpack_chunks);
  MK_CHECK(layout.check("moe layer"));
  const int64_t slot = g.slot_bytes, cslot = g.cslot_bytes, body = slot - g.hdr_bytes;
  const int P = moe_pieces(body, pieces_req), CP = moe_pieces(cslot, pieces_req);
  comm::Program& p = *out;
  p = comm::Program{};
  p.layout = layout;
  const bool net = layout.nodes() > 1;
  p.net_staged = staged && net;
  const bool direct = net && !p.net_staged;
  ProgramBuilder pb(p);
  declare_slots(pb, uint64_t(W) * uint64_t(slot), P, direct);
  const uint64_t call = uint64_t(W) * uint64_t(cslot);
  pb.buf("csend", call, comm::Space::kSymmetric, direct);
  pb.buf("crecv", call, comm::Space::kSymmetric, direct);
  pb.buf("csend_net", p.net_staged ? call : 0, comm::Space::kHost, p.net_staged, -1, MoeLayerBuf::kCSend);
  pb.buf("crecv_net", p.net_staged ? call : 0, comm::Space::kHost, p.net_staged, -1, MoeLayerBuf::kCRecv);
  pb.buf("cpiece_bytes", 8ull * W * CP, comm::Space::kSymmetric, false);
  pb.buf("recv_x", uint64_t(g.recv_rows * g.row_bytes), comm::Space::kUser, false);
  pb.buf("act", uint64_t(g.recv_rows * inter * 2), comm::Space::kUser, false);
  pb.buf("y", uint64_t(g.recv_rows * g.row_bytes), comm::Space::kUser, false);
  pb.buf("lay", uint64_t(moe_layer_lay_bytes(g)), comm::Space::kUser, false);
  pb.buf("out", uint64_t(g.T * g.row_bytes), comm::Space::kUser, false);
  const uint32_t Wu = uint32_t(W);
  p.add_region("arrived", Wu, false);
  p.add_region("arrived_net", Wu, true);
  p.add_region("entry", Wu, false);
  p.add_region("entry_net", Wu, true);
  p.add_region("src_free", 1, true);
  p.add_region("hdr", Wu, false);
  p.add_region("hdr_net", Wu, true);
  p.add_region("carrived", Wu, false);
  p.add_region("carrived_net", Wu, true);
  p.add_region("laid", 1, false);
  p.add_region("unpacked", Wu, false);
  p.add_region("g1done", uint32_t(El), false);
  p.add_region("packed", 1, false);
  p.place_regions();
  p.ranks.resize(W);
  auto remote = [&](int a, int b) { return !layout.same_node(a, b); };
  for (int me = 0; me < W; ++me) {
    comm::RankProgram& rp = p.ranks[me];
    rp.rank = me;
    const uint32_t m = uint32_t(me);
    // The kernels' pools (moe_layer_pools gives the places).
    for (int d = 1; d < W; ++d) {
      const int s = (me + d) % W;
      rp.waits.push_back(wait_on(MoeLayerRegion::kHdr, me, uint32_t(s), 1, s));
    }
    rp.waits.push_back(wait_on(MoeLayerRegion::kLaid, me, 0, 1, me));
    for (int d = 1; d < W; ++d) {
      const int s = (me + d) % W;
      rp.waits.push_back(wait_on(MoeRegion::kArrived, me, uint32_t(s), remote(me, s) ? 1 : uint64_t(P), s));
    }
    for (int s = 0; s < W; ++s)
      rp.waits.push_back(wait_on(MoeLayerRegion::kUnpacked, me, uint32_t(s), uint64_t(unpack_chunks), me));
    for (int le = 0; le < El; ++le) rp.waits.push_back(wait_on(MoeLayerRegion::kG1Done, me, uint32_t(le), 1, me));
    rp.waits.push_back(wait_on(MoeLayerRegion::kPacked, me, 0, uint64_t(El), me));
    for (int d = 1; d < W; ++d) {
      const int s = (me + d) % W;
      rp.waits.push_back(wait_on(MoeLayerRegion::kCArrived, me, uint32_t(s), remote(me, s) ? 1 : uint64_t(CP), s));
    }
    rp.signals.push_back(add_to(MoeLayerRegion::kLaid, me, 0));
    for (int s = 0; s < W; ++s) rp.signals.push_back(add_to(MoeLayerRegion::kUnpacked, me, uint32_t(s)));
    for (int le = 0; le < El; ++le) rp.signals.push_back(add_to(MoeLayerRegion::kG1Done, me, uint32_t(le)));
    rp.signals.push_back(add_to(MoeLayerRegion::kPacked, me, 0));
    if (W == 1) continue;
    // Dispatch: entry, every slot's header, then the records in pieces.
    for (int d = 1; d < W; ++d) {
      const int s = (me + W - d) % W;
      rp.ops.push_back(entry_op(pb, me, s, remote(me, s), "layer dispatch"));
    }
    for (int d = 1; d < W; ++d) {  // the headers: one piece each, hdr_bytes always
      const int r = (me + d) % W;
      SlotMove mv;
      mv.me = me, mv.to = r, mv.remote = remote(me, r);
      mv.src = BufRef{MoeBuf::kSend, me, uint64_t(r) * uint64_t(slot)};
      mv.dst = BufRef{MoeBuf::kRecv, r, m * uint64_t(slot)};
      mv.slot_bytes = g.hdr_bytes, mv.pieces = 1;
      mv.label = "layer dispatch header";
      mv.suffix = " to rank " + std::to_string(r) + (mv.remote ? " (network)" : "");
      mv.arrived = MoeLayerRegion::kHdr, mv.arrived_net = MoeLayerRegion::kHdrNet;
      add_slot_pieces(pb, rp, mv);
    }
    for (int d = 1; d < W; ++d) {
      const int r = (me + d) % W;
      SlotMove mv;
      mv.me = me, mv.to = r, mv.remote = remote(me, r);
      mv.src = BufRef{MoeBuf::kSend, me, uint64_t(r) * uint64_t(slot) + uint64_t(g.hdr_bytes)};
      mv.dst = BufRef{MoeBuf::kRecv, r, m * uint64_t(slot) + uint64_t(g.hdr_bytes)};
      mv.counts = BufRef{MoeBuf::kPieceBytes, me, 8ull * uint64_t(r) * P};
      mv.slot_bytes = body, mv.pieces = pieces_req;
      mv.label = "layer dispatch records";
      mv.suffix = " to rank " + std::to_string(r) + (mv.remote ? " (network)" : "");
      add_slot_pieces(pb, rp, mv);
    }
    // Arrivals from other nodes: the header, then the records (staged: out of the host mirror, as
    // many bytes as the header says are in use; so the records' relay waits for the header too).
    for (int d = 1; d < W; ++d) {
      const int s = (me + W - d) % W;
      if (!remote(me, s)) continue;
      const uint64_t at = uint64_t(s) * uint64_t(slot);
      rp.ops.push_back(relay_op(p, me, s, BufRef{MoeBuf::kRecvNet, me, at}, BufRef{MoeBuf::kRecv, me, at},
                                uint64_t(g.hdr_bytes), 1, "layer dispatch header", MoeLayerRegion::kHdrNet,
                                MoeLayerRegion::kHdr));  // the bytes in use (at the start) >= hdr_bytes
    }
    for (int d = 1; d < W; ++d) {
      const int s = (me + W - d) % W;
      if (!remote(me, s)) continue;
      const uint64_t at = uint64_t(s) * uint64_t(slot);
      const BufRef used{MoeBuf::kRecvNet, me, at};
      Op op = relay_op(p, me, s, BufRef{MoeBuf::kRecvNet, me, at + uint64_t(g.hdr_bytes)},
                       BufRef{MoeBuf::kRecv, me, at + uint64_t(g.hdr_bytes)}, uint64_t(body), uint64_t(P),
                       "layer dispatch records", MoeRegion::kArrivedNet, MoeRegion::kArrived, &used);
      if (p.net_staged) op.waits.push_back(wait_on(MoeLayerRegion::kHdrNet, me, uint32_t(s), 1, s));
      rp.ops.push_back(op);
    }
    // Combine: every expert's rows packed (the GEMM2 units), each slot in pieces. The destination's
    // combine slot for this rank is free: it entered this call (it sent its header, which the
    // layout waited for before any GEMM unit, and so before `packed`).
    for (int d = 1; d < W; ++d) {
      const int r = (me + d) % W;
      SlotMove mv;
      mv.me = me, mv.to = r, mv.remote = remote(me, r);
      mv.src = BufRef{MoeLayerBuf::kCSend, me, uint64_t(r) * uint64_t(cslot)};
      mv.dst = BufRef{MoeLayerBuf::kCRecv, r, m * uint64_t(cslot)};
      mv.counts = BufRef{MoeLayerBuf::kCPieceBytes, me, 8ull * uint64_t(r) * CP};
      mv.slot_bytes = cslot, mv.pieces = pieces_req;
      mv.label = "layer combine slot";
      mv.suffix = " to rank " + std::to_string(r) + (mv.remote ? " (network)" : "");
      mv.arrived = MoeLayerRegion::kCArrived, mv.arrived_net = MoeLayerRegion::kCArrivedNet;
      mv.entry = false;
      mv.waits = {wait_on(MoeLayerRegion::kPacked, me, 0, uint64_t(El), me)};
      add_slot_pieces(pb, rp, mv);
    }
    for (int d = 1; d < W; ++d) {
      const int s = (me + W - d) % W;
      if (!remote(me, s)) continue;
      const uint64_t at = uint64_t(s) * uint64_t(cslot);
      rp.ops.push_back(relay_op(p, me, s, BufRef{MoeLayerBuf::kCRecvNet, me, at},
                                BufRef{MoeLayerBuf::kCRecv, me, at}, uint64_t(cslot), uint64_t(CP),
                                "layer combine slot", MoeLayerRegion::kCArrivedNet, MoeLayerRegion::kCArrived));
    }
    // The call ends once the proxy finished reading this call's sources (the arrivals are the
    // units' waits).
    pb.proxy_done_op(flag_at(MoeRegion::kSrcFree, me, 0), me, "layer: the proxy read every source", &rp.ops);
  }
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
