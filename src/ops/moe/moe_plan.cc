// MoE dispatch/combine: geometry, routing rules and programs (see src/ops/moe/moe_plan.h).
#include "src/ops/moe/moe_plan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "mkernel/common/check.h"
#include "src/comm/program_builder.h"

namespace mk {
namespace ops {

namespace {
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
}  // namespace

Status moe_geometry(const MoeConfig& c, int world, MoeGeometry* out) {
  MK_REQUIRE(world >= 1, Code::kInvalidArgument, "moe: world size %d", world);
  MK_REQUIRE(c.hidden >= 8 && c.hidden % 8 == 0 && c.hidden <= (int64_t(1) << 20), Code::kInvalidArgument,
             "moe: hidden %lld (a positive multiple of 8, at most 2^20)", (long long)c.hidden);
  MK_REQUIRE(c.num_experts >= 1 && c.num_experts % world == 0, Code::kInvalidArgument,
             "moe: %d experts are not a positive multiple of the world size %d", c.num_experts, world);
  MK_REQUIRE(c.num_experts <= 32768 && c.num_experts / world <= 8192, Code::kInvalidArgument,
             "moe: %d experts, %d per rank (at most 32768 and 8192)", c.num_experts, c.num_experts / world);
  MK_REQUIRE(c.topk >= 1 && c.topk <= 32, Code::kInvalidArgument, "moe: topk %d (1..32)", c.topk);
  MK_REQUIRE(c.max_tokens_per_rank >= 1 && c.max_tokens_per_rank <= (int64_t(1) << 24), Code::kInvalidArgument,
             "moe: max_tokens_per_rank %lld (1..2^24)", (long long)c.max_tokens_per_rank);
  MK_REQUIRE(c.expert_align >= 1 && c.expert_align <= 4096, Code::kInvalidArgument, "moe: expert_align %d (1..4096)",
             c.expert_align);
  MK_REQUIRE(c.recv_capacity >= 0, Code::kInvalidArgument, "moe: recv_capacity %lld", (long long)c.recv_capacity);
  MoeGeometry g;
  g.W = world;
  g.E = c.num_experts;
  g.El = c.num_experts / world;
  g.k = c.topk;
  g.align = c.expert_align;
  g.H = c.hidden;
  g.T = c.max_tokens_per_rank;
  g.row_bytes = 2 * g.H;
  g.meta_bytes = round_up(16 + 8 * int64_t(g.k), 16);
  g.rec_bytes = g.row_bytes + g.meta_bytes;
  g.hdr_bytes = round_up(16 + 4 * int64_t(g.El), 16);
  g.slot_bytes = g.hdr_bytes + g.T * g.rec_bytes;
  g.comb_per_src = g.T * g.k;  // a token may name one expert twice
  g.cslot_bytes = g.chdr_bytes + g.comb_per_src * g.row_bytes;
  g.worst_rows = int64_t(world) * g.comb_per_src + int64_t(g.El) * (g.align - 1);
  g.recv_rows = c.recv_capacity > 0 ? c.recv_capacity : g.worst_rows;
  MK_REQUIRE(g.worst_rows < (int64_t(1) << 31), Code::kInvalidArgument,
             "moe: %lld receive rows per rank exceed the int32 layout (fewer tokens or experts per rank)",
             (long long)g.worst_rows);
  *out = g;
  return OkStatus();
}

void route_source(const MoeGeometry& g, const int32_t* ids, int64_t n, SourceRoute* out, int64_t* bad) {
  SourceRoute& r = *out;
  r.rec_tokens.assign(g.W, {});
  r.erank.assign(size_t(n) * g.k, -1);
  r.cpos.assign(size_t(n) * g.k, -1);
  r.cbase.assign(size_t(g.W) * n, -1);
  r.ecount.assign(g.E, 0);
  r.ncomb.assign(g.W, 0);
  int64_t nbad = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int kk = 0; kk < g.k; ++kk) {
      const int32_t e = ids[t * g.k + kk];
      if (e == -1) continue;
      if (e < -1 || e >= g.E) {
        ++nbad;
        continue;
      }
      const int rk = e / g.El;
      if (r.rec_tokens[rk].empty() || r.rec_tokens[rk].back() != t) {
        r.rec_tokens[rk].push_back(int32_t(t));
        r.cbase[size_t(rk) * n + t] = r.ncomb[rk];
      }
      r.erank[t * g.k + kk] = r.ecount[e]++;
      r.cpos[t * g.k + kk] = r.ncomb[rk]++;
    }
  if (bad) *bad = nbad;
}

void dest_layout(const MoeGeometry& g, int r, const std::vector<const int32_t*>& ids, const std::vector<int64_t>& n,
                 const std::vector<SourceRoute>& routes, DestLayout* out) {
  DestLayout& d = *out;
  d.counts.assign(g.El, 0);
  d.offsets.assign(g.El + 1, 0);
  for (int s = 0; s < g.W; ++s)
    for (int le = 0; le < g.El; ++le) d.counts[le] += routes[s].ecount[r * g.El + le];
  for (int le = 0; le < g.El; ++le) d.offsets[le + 1] = d.offsets[le] + int32_t(round_up(d.counts[le], g.align));
  d.rows.assign(size_t(d.offsets[g.El]), RowOrigin{});
  std::vector<int64_t> base(d.offsets.begin(), d.offsets.end() - 1);
  for (int s = 0; s < g.W; ++s) {
    for (int64_t t = 0; t < n[s]; ++t)
      for (int kk = 0; kk < g.k; ++kk) {
        const int32_t e = ids[s][t * g.k + kk];
        if (e < 0 || e >= g.E || e / g.El != r) continue;
        const int64_t row = base[e - r * g.El] + routes[s].erank[t * g.k + kk];
        d.rows[size_t(row)] = RowOrigin{s, int32_t(t), kk};
      }
    for (int le = 0; le < g.El; ++le) base[le] += routes[s].ecount[r * g.El + le];
  }
}

void pack_record_slot(const MoeGeometry& g, int s, int r, const uint16_t* x, const int32_t* ids,
                      const SourceRoute& route, uint8_t* slot) {
  const auto& toks = route.rec_tokens[r];
  const int64_t n = int64_t(route.cbase.size()) / g.W;
  const uint64_t bytes = uint64_t(g.hdr_bytes + int64_t(toks.size()) * g.rec_bytes);
  std::memset(slot, 0, size_t(g.hdr_bytes));
  std::memcpy(slot, &bytes, 8);
  const uint32_t nrec = uint32_t(toks.size()), ncomb = uint32_t(route.ncomb[r]);
  std::memcpy(slot + 8, &nrec, 4);
  std::memcpy(slot + 12, &ncomb, 4);
  for (int le = 0; le < g.El; ++le) std::memcpy(slot + 16 + 4 * le, &route.ecount[r * g.El + le], 4);
  for (size_t j = 0; j < toks.size(); ++j) {
    const int64_t t = toks[j];
    uint8_t* rec = slot + g.hdr_bytes + int64_t(j) * g.rec_bytes;
    std::memcpy(rec, x + t * g.H, size_t(g.row_bytes));
    std::vector<int32_t> meta(size_t(g.meta_bytes / 4), 0);
    int32_t nk = 0;
    for (int kk = 0; kk < g.k; ++kk) {
      const int32_t e = ids[t * g.k + kk];
      const bool here = e >= 0 && e < g.E && e / g.El == r;
      meta[kMetaSlots + 2 * kk] = here ? e - r * g.El : -1;
      meta[kMetaSlots + 2 * kk + 1] = here ? route.erank[t * g.k + kk] : -1;
      nk += here;
    }
    meta[kMetaToken] = int32_t(t);
    meta[kMetaNk] = nk;
    meta[kMetaCbase] = route.cbase[size_t(r) * n + t];
    meta[kMetaSrc] = s;
    std::memcpy(rec + g.row_bytes, meta.data(), size_t(g.meta_bytes));
  }
}

void unpack_slots(const MoeGeometry& g, int r, const std::vector<const uint8_t*>& slots, uint16_t* recv_x,
                  int32_t* counts, int32_t* offsets, int32_t* back, int64_t* overflow) {
  (void)r;
  std::vector<int32_t> c(size_t(g.W) * g.El);
  for (int s = 0; s < g.W; ++s) std::memcpy(&c[size_t(s) * g.El], slots[s] + 16, 4 * size_t(g.El));
  offsets[0] = 0;
  for (int le = 0; le < g.El; ++le) {
    int64_t sum = 0;
    for (int s = 0; s < g.W; ++s) sum += c[size_t(s) * g.El + le];
    counts[le] = int32_t(sum);
    offsets[le + 1] = offsets[le] + int32_t(round_up(sum, g.align));
  }
  int64_t over = 0;
  std::vector<int64_t> base(offsets, offsets + g.El);
  for (int s = 0; s < g.W; ++s) {
    uint32_t nrec;
    std::memcpy(&nrec, slots[s] + 8, 4);
    for (uint32_t j = 0; j < nrec; ++j) {
      const uint8_t* rec = slots[s] + g.hdr_bytes + int64_t(j) * g.rec_bytes;
      std::vector<int32_t> meta(size_t(g.meta_bytes / 4));
      std::memcpy(meta.data(), rec + g.row_bytes, size_t(g.meta_bytes));
      int32_t ord = 0;
      for (int kk = 0; kk < g.k; ++kk) {
        const int32_t le = meta[kMetaSlots + 2 * kk];
        if (le < 0) continue;
        const int64_t row = base[le] + meta[kMetaSlots + 2 * kk + 1];
        if (row < g.recv_rows) {
          std::memcpy(recv_x + row * g.H, rec, size_t(g.row_bytes));
          back[2 * row] = meta[kMetaSrc];
          back[2 * row + 1] = meta[kMetaCbase] + ord;
        } else {
          ++over;
        }
        ++ord;
      }
    }
    for (int le = 0; le < g.El; ++le) base[le] += c[size_t(s) * g.El + le];
  }
  if (overflow) *overflow = over;
}

MoeNodeGeometry moe_node_geometry(const MoeGeometry& g, int local) {
  MoeNodeGeometry ng;
  ng.local = local;
  ng.nmeta_bytes = round_up(16 + 12 * int64_t(g.k) + 4 * int64_t(local), 16);
  ng.nrec_bytes = g.row_bytes + ng.nmeta_bytes;
  ng.nhdr_bytes = round_up(16 + int64_t(local) * (8 + 4 * int64_t(g.El)), 16);
  ng.nslot_bytes = ng.nhdr_bytes + g.T * ng.nrec_bytes;
  return ng;
}

std::vector<std::vector<int32_t>> node_tokens(const MoeGeometry& g, const comm::Layout& layout, int me,
                                              const int32_t* ids, int64_t n) {
  std::vector<std::vector<int32_t>> out(layout.nodes());
  for (int64_t t = 0; t < n; ++t)
    for (int kk = 0; kk < g.k; ++kk) {
      const int32_t e = ids[t * g.k + kk];
      if (e < 0 || e >= g.E) continue;
      const int node = layout.node_of[e / g.El];
      if (node == layout.node_of[me]) continue;
      if (out[node].empty() || out[node].back() != t) out[node].push_back(int32_t(t));
    }
  return out;
}

void pack_node_slot(const MoeGeometry& g, const MoeNodeGeometry& ng, const comm::Layout& layout, int s, int node,
                    const uint16_t* x, const int32_t* ids, const SourceRoute& route, uint8_t* slot) {
  const int64_t n = int64_t(route.cbase.size()) / g.W;
  const auto toks = node_tokens(g, layout, s, ids, n)[node];
  const int L = ng.local;
  std::memset(slot, 0, size_t(ng.nhdr_bytes));
  const uint64_t used = uint64_t(ng.nhdr_bytes + int64_t(toks.size()) * ng.nrec_bytes);
  std::memcpy(slot, &used, 8);
  const uint32_t nrec = uint32_t(toks.size());
  std::memcpy(slot + 8, &nrec, 4);
  std::vector<std::vector<int32_t>> index(L, std::vector<int32_t>(size_t(n), -1));
  for (int l = 0; l < L; ++l) {
    const int r = layout.node_ranks[node][l];
    uint8_t* h = slot + 16 + int64_t(l) * (8 + 4 * int64_t(g.El));
    const uint32_t nr = uint32_t(route.rec_tokens[r].size()), nc = uint32_t(route.ncomb[r]);
    std::memcpy(h, &nr, 4);
    std::memcpy(h + 4, &nc, 4);
    for (int le = 0; le < g.El; ++le) std::memcpy(h + 8 + 4 * le, &route.ecount[r * g.El + le], 4);
    for (size_t j = 0; j < route.rec_tokens[r].size(); ++j) index[l][size_t(route.rec_tokens[r][j])] = int32_t(j);
  }
  for (size_t j = 0; j < toks.size(); ++j) {
    const int64_t t = toks[j];
    uint8_t* rec = slot + ng.nhdr_bytes + int64_t(j) * ng.nrec_bytes;
    std::memcpy(rec, x + t * g.H, size_t(g.row_bytes));
    std::vector<int32_t> meta(size_t(ng.nmeta_bytes / 4), 0);
    meta[0] = int32_t(t);
    meta[1] = s;
    for (int kk = 0; kk < g.k; ++kk) {
      const int32_t e = ids[t * g.k + kk];
      const bool here = e >= 0 && e < g.E && layout.node_of[e / g.El] == node;
      meta[kNodeMetaSlots + 3 * kk] = here ? e : -1;
      meta[kNodeMetaSlots + 3 * kk + 1] = here ? route.erank[t * g.k + kk] : -1;
      meta[kNodeMetaSlots + 3 * kk + 2] = here ? route.cpos[t * g.k + kk] : -1;
    }
    for (int l = 0; l < L; ++l) meta[kNodeMetaSlots + 3 * g.k + l] = index[l][size_t(t)];
    std::memcpy(rec + g.row_bytes, meta.data(), size_t(ng.nmeta_bytes));
  }
}

void repack_node_slot(const MoeGeometry& g, const MoeNodeGeometry& ng, const comm::Layout& layout, int s, int d,
                      const uint8_t* nslot, uint8_t* slot) {
  const int l = layout.local_of[d];
  const uint8_t* h = nslot + 16 + int64_t(l) * (8 + 4 * int64_t(g.El));
  uint32_t nrec_d, ncomb_d, nrec;
  std::memcpy(&nrec_d, h, 4);
  std::memcpy(&ncomb_d, h + 4, 4);
  std::memcpy(&nrec, nslot + 8, 4);
  std::memset(slot, 0, size_t(g.hdr_bytes));
  const uint64_t used = uint64_t(g.hdr_bytes + int64_t(nrec_d) * g.rec_bytes);
  std::memcpy(slot, &used, 8);
  std::memcpy(slot + 8, &nrec_d, 4);
  std::memcpy(slot + 12, &ncomb_d, 4);
  std::memcpy(slot + 16, h + 8, 4 * size_t(g.El));
  for (uint32_t j = 0; j < nrec; ++j) {
    const uint8_t* nr = nslot + ng.nhdr_bytes + int64_t(j) * ng.nrec_bytes;
    std::vector<int32_t> nm(size_t(ng.nmeta_bytes / 4));
    std::memcpy(nm.data(), nr + g.row_bytes, size_t(ng.nmeta_bytes));
    const int32_t idx = nm[kNodeMetaSlots + 3 * g.k + l];
    if (idx < 0) continue;
    uint8_t* rec = slot + g.hdr_bytes + int64_t(idx) * g.rec_bytes;
    std::memcpy(rec, nr, size_t(g.row_bytes));
    std::vector<int32_t> meta(size_t(g.meta_bytes / 4), 0);
    int32_t nk = 0, cbase = -1;
    for (int kk = 0; kk < g.k; ++kk) {
      const int32_t e = nm[kNodeMetaSlots + 3 * kk];
      const bool here = e >= 0 && e / g.El == d;
      meta[kMetaSlots + 2 * kk] = here ? e - d * g.El : -1;
      meta[kMetaSlots + 2 * kk + 1] = here ? nm[kNodeMetaSlots + 3 * kk + 1] : -1;
      if (here && cbase < 0) cbase = nm[kNodeMetaSlots + 3 * kk + 2];
      nk += here;
    }
    meta[kMetaToken] = nm[0];
    meta[kMetaNk] = nk;
    meta[kMetaCbase] = cbase;
    meta[kMetaSrc] = nm[1];
    std::memcpy(rec + g.row_bytes, meta.data(), size_t(g.meta_bytes));
  }
}

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
  return round_up((slot_bytes + pieces - 1) / pieces, 16);
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
  auto remote = [&](int a, int b) { return layout.node_of[a] != layout.node_of[b]; };
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
    // The kernels' pools (moe_plan.h): repack waits, layout waits, repack signals.
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
