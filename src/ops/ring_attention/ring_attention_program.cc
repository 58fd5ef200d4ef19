// Ring attention's communication program (see src/ops/ring_attention/ring_attention_program.h).
#include "src/ops/ring_attention/ring_attention_program.h"

#include <algorithm>
#include <string>
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
using comm::wait_on;

struct Builder {
  RingProgram& p;
  const RingPlan& plan;
  const RingGeometry& g;
  uint64_t slot_bytes;  // one slot: B * S_l * row_bytes (the largest block)
  comm::ProgramBuilder pb;  // counts this rank's puts (kSrcFree)

  BufId slots(int kv) const { return kv ? RingBuf::kSlotsV : RingBuf::kSlotsK; }
  BufId mirror(int kv) const { return kv ? RingBuf::kSlotsVNet : RingBuf::kSlotsKNet; }
  // Rows of piece pc of block blk; its offset in a slot (S_l rows per batch) and in the caller's
  // K/V of the block's owner (rows_of(blk) rows per batch).
  uint64_t piece_rows(int blk, int pc) const {
    return uint64_t(std::min<int64_t>(g.chunk_tokens, g.rows_of(blk) - int64_t(pc) * g.chunk_tokens));
  }
  uint64_t in_slot(int b, int pc) const { return uint64_t((int64_t(b) * g.S_l + int64_t(pc) * g.chunk_tokens) * g.row_bytes); }
  uint64_t in_user(int blk, int b, int pc) const {
    return uint64_t((int64_t(b) * g.rows_of(blk) + int64_t(pc) * g.chunk_tokens) * g.row_bytes);
  }
  std::string piece_name(int blk, int b, int pc, int kv) const {
    return std::string(kv ? "V" : "K") + " of block " + std::to_string(blk) + " batch " + std::to_string(b) +
           " piece " + std::to_string(pc);
  }

  // A piece of block blk arrived over the network from `prev` (arrived_net): into the slot
  // (staged: from the host mirror) and count it in `arrived`, which the kernel and the
  // forwarding wait on.
  void relay(RingRank& rp, int me, int prev, int blk, int b, int pc) {
    const uint32_t a = p.arrived_index(blk, b, pc);
    const uint64_t off = uint64_t(blk) * slot_bytes + in_slot(b, pc);
    if (!p.net_staged) {
      Op op;
      op.kind = OpKind::kSignal;
      op.waits = {wait_on(RingRegion::kArrivedNet, me, a, 2, prev)};
      op.signals = {add_to(RingRegion::kArrived, me, a, 2)};
      op.what = "relay " + piece_name(blk, b, pc, 0) + " and V (landed in the slot)";
      rp.ops.push_back(op);
      return;
    }
    for (int kv = 0; kv < 2; ++kv) {
      Op op;
      op.kind = OpKind::kCopy;
      op.waits = {wait_on(RingRegion::kArrivedNet, me, a, 2, prev)};
      op.srcs = {BufRef{mirror(kv), me, off}};
      op.dsts = {BufRef{slots(kv), me, off}};
      op.bytes = piece_rows(blk, pc) * g.row_bytes;
      op.signals = {add_to(RingRegion::kArrived, me, a)};
      op.what = "relay " + piece_name(blk, b, pc, kv) + " from the host mirror into the slot";
      rp.ops.push_back(op);
    }
  }

  // Entry: tell the previous rank that this rank's slots are free for this call (its call
  // started, so its previous call ended: stream order).
  Op entry_signal(int me, int prev, bool prev_remote) {
    if (prev_remote)
      return pb.token_put(me, prev, RingBuf::kToken, flag_at(RingRegion::kEntryNet, prev, 0),
                          flag_at(RingRegion::kSrcFree, me, 0), "entry signal to rank " + std::to_string(prev) + " (network)");
    return comm::ProgramBuilder::signal_op({add_to(RingRegion::kEntry, prev, 0)}, "entry signal to rank " + std::to_string(prev));
  }

  // Step t's piece (b, pc) of block blk, K and V, on to `next`: over the network from the slot
  // (staged: from its host mirror, which the CTA copies the slot into first), or a copy into
  // next's slot. At step 0 the own block goes out from the user's K/V (over the network: into
  // the own slot first, a registered buffer or the staging copy's source).
  void forward(RingRank& rp, int me, int next, int prev, bool next_remote, int t, int blk, int b, int pc) {
    const uint64_t bytes = piece_rows(blk, pc) * g.row_bytes;
    const uint64_t off = uint64_t(blk) * slot_bytes + in_slot(b, pc);
    const uint32_t a = p.arrived_index(blk, b, pc);
    const comm::RegionId entry = next_remote ? RingRegion::kEntryNet : RingRegion::kEntry;
    if (t == 0 && next_remote)
      for (int kv = 0; kv < 2; ++kv) {
        Op op;
        op.kind = OpKind::kCopy;
        op.srcs = {BufRef{kv ? RingBuf::kUserV : RingBuf::kUserK, me, in_user(blk, b, pc)}};
        op.dsts = {BufRef{slots(kv), me, off}};
        op.bytes = bytes;
        op.signals = {add_to(RingRegion::kArrived, me, a)};
        op.what = "own " + piece_name(blk, b, pc, kv) + " into the own slot";
        rp.ops.push_back(op);
      }
    for (int kv = 0; kv < 2; ++kv) {
      Op op;
      if (next_remote) {
        op = pb.put(next, BufRef{slots(kv), me, off}, BufRef{slots(kv), next, off}, bytes,
                    flag_at(RingRegion::kArrivedNet, next, a), flag_at(RingRegion::kSrcFree, me, 0),
                    piece_name(blk, b, pc, kv) + " to rank " + std::to_string(next) + " (network)");
      } else {
        op.kind = OpKind::kCopy;
        op.bytes = bytes;
        op.srcs = {t == 0 ? BufRef{kv ? RingBuf::kUserV : RingBuf::kUserK, me, in_user(blk, b, pc)}
                          : BufRef{slots(kv), me, off}};
        op.dsts = {BufRef{slots(kv), next, off}};
        op.signals = {add_to(RingRegion::kArrived, next, a)};
        op.what = piece_name(blk, b, pc, kv) + " to rank " + std::to_string(next);
      }
      op.waits = {wait_on(entry, me, 0, 1, next)};
      if (t > 0 || next_remote) op.waits.push_back(wait_on(RingRegion::kArrived, me, a, 2, t > 0 ? prev : me));
      rp.ops.push_back(op);
    }
  }

  // Waits on every piece of the block that step t reads (two arrivals each: K and V).
  void wait_block(std::vector<comm::Wait>* waits, int me, int prev, int t) const {
    const int blk = plan.steps[me][t].kv_rank;
    for (int b = 0; b < g.B; ++b)
      for (int pc = 0; pc < g.pieces_of(blk); ++pc)
        waits->push_back(wait_on(RingRegion::kArrived, me, p.arrived_index(blk, b, pc), 2, prev));
  }

  // A call ends only once every block meant for this rank is in its slot (also those no query
  // needs and the last one, which is not forwarded): no write of this call can land during the
  // next one. Nor while the proxy still reads this call's sources.
  void call_end(RingRank& rp, int me, int prev, bool prev_remote) {
    Op op;
    op.kind = OpKind::kSignal;
    for (int t = 1; t < plan.world; ++t) wait_block(&op.waits, me, prev, t);
    if (g.backward)  // the sums of the own block, back from the ring (where one began)
      for (int b = 0; b < g.B; ++b)
        for (int dp = 0; dp < g.dpieces(); ++dp)
          if (begun(me, dp, plan.world - 1))
            op.waits.push_back(
              wait_on(RingRegion::kDkvArrived, me, p.dkv_index(me, b, dp), dkv_arrivals(me, dp, prev_remote), prev));
    op.what = g.backward ? "every block and the own dK/dV of the call arrived" : "every block of the call arrived";
    rp.ops.push_back(op);
    pb.proxy_done_op(flag_at(RingRegion::kSrcFree, me, 0), me, "the proxy finished reading this call's sources",
                     &rp.ops);
  }


  // ---- the backward's dK/dV (see RingProgram) ----
  uint64_t dpiece_bytes(int blk, int dp) const { return uint64_t(g.dpiece_kbs(blk, dp)) * uint64_t(g.hkv) * g.tile_bytes; }
  uint64_t dpiece_off(int blk, int b, int dp) const { return g.tile_offset(blk, b, g.dpiece_kb0(dp), 0); }
  // A sum on the node moves a piece in parts of at most g.dkv_part_bytes (1 MiB), one op each: a
  // whole piece (4 MiB at 32 heads, D 128) took one CTA 0.6-0.9 ms, and the last step's pieces
  // were the call's tail; in parts the communication CTAs, and the compute CTAs that help once
  // their items are done, share them. Each part adds 1 to the receiver's dkv_arrived; over the
  // network a piece travels whole (its relay adds 1).
  uint32_t dkv_parts(uint64_t bytes) const { return uint32_t((bytes + g.dkv_part_bytes - 1) / g.dkv_part_bytes); }
  // The arrivals in dkv_arrived that make piece dp's sum complete, from a previous rank on this
  // node or across the network.
  uint32_t dkv_arrivals(int blk, int dp, bool from_remote) const {
    return from_remote ? 1 : dkv_parts(dpiece_bytes(blk, dp));
  }
  // Whether this rank's kernel computes piece dp of the block it holds at step t: its key chunk
  // is in a pair of the step, and the piece is not an empty one of a shorter chunk.
  bool computes(int me, int t, int dp) const {
    if (g.dpiece_kbs(plan.steps[me][t].kv_rank, dp) == 0) return false;
    for (const auto& pr : plan.steps[me][t].pairs)
      if (pr.kv_chunk == g.dpiece_chunk(dp)) return true;
    return false;
  }
  // The rank holding block blk at step t (each step of a ring plan hands every rank one block).
  int holder(int blk, int t) const {
    for (int r = 0; r < plan.world; ++r)
      if (plan.steps[r][t].kv_rank == blk) return r;
    return -1;
  }
  // Whether a rank holding block blk at steps 1 .. t computed piece dp of it: its sum has begun
  // (the owner's own tiles, step 0's, never travel: they stay in its part, and its finishing
  // kernel adds the sum that came back round the ring, where one began).
  bool begun(int blk, int dp, int t) const {
    for (int s = 1; s <= t; ++s) {
      const int h = holder(blk, s);
      if (h >= 0 && computes(h, s, dp)) return true;
    }
    return false;
  }
  std::string dpiece_name(int blk, int b, int dp) const {
    return "dK/dV of block " + std::to_string(blk) + " batch " + std::to_string(b) + " piece " + std::to_string(dp);
  }

  // The sum of a piece arrived over the network from `prev` (dkv_arrived_net): into acc (staged:
  // from its host mirror) and counted in dkv_arrived.
  void relay_dkv(RingRank& rp, int me, int prev, int blk, int b, int dp) {
    const uint32_t idx = p.dkv_index(blk, b, dp);
    Op op;
    op.waits = {wait_on(RingRegion::kDkvArrivedNet, me, idx, 1, prev)};
    op.signals = {add_to(RingRegion::kDkvArrived, me, idx)};
    if (!p.net_staged) {
      op.kind = OpKind::kSignal;
      op.what = "relay " + dpiece_name(blk, b, dp) + " (landed in acc)";
    } else {
      op.kind = OpKind::kCopy;
      op.srcs = {BufRef{RingBuf::kAccNet, me, dpiece_off(blk, b, dp)}};
      op.dsts = {BufRef{RingBuf::kAcc, me, dpiece_off(blk, b, dp)}};
      op.bytes = dpiece_bytes(blk, dp);
      op.what = "relay " + dpiece_name(blk, b, dp) + " from the host mirror into acc";
    }
    rp.ops.push_back(op);
  }

  // Step t's piece (b, dp) of block blk (t >= 1) on to `next`: the sum received from prev (where
  // one began at an earlier step) plus this rank's part (when its kernel computes the piece),
  // into next's acc — one reduce (or copy) on the node; over the network a reduce into the own
  // part first, then a put. Nothing when neither: no sum has begun.
  void send_dkv(RingRank& rp, int me, int next, int prev, bool next_remote, bool prev_remote, int t, int blk, int b,
                int dp) {
    const uint32_t idx = p.dkv_index(blk, b, dp);
    const uint64_t off = dpiece_off(blk, b, dp), bytes = dpiece_bytes(blk, dp);
    const bool mine = computes(me, t, dp), recv = begun(blk, dp, t - 1);
    if (!mine && !recv) return;
    std::vector<comm::Wait> in;
    std::vector<BufRef> srcs;
    if (mine) {
      in.push_back(wait_on(RingRegion::kReady, me, idx, rp.ready_count[idx], me));
      srcs.push_back(BufRef{RingBuf::kPart, me, off});
    }
    if (recv) {
      in.push_back(wait_on(RingRegion::kDkvArrived, me, idx, dkv_arrivals(blk, dp, prev_remote), prev));
      srcs.push_back(BufRef{RingBuf::kAcc, me, off});
    }
    // No wait for next's entry: next's acc of block blk is free once the call's ring passed it
    // in the previous call, and this op runs only after that: it follows the block's K/V of this
    // call, which left the owner only after the owner's previous call ended (when its own
    // block's sum came back round the ring, and its finishing kernel read acc[owner]).
    // The replay test checks the argument (ImpliedWaitsChangeNothing would catch a counterexample
    // only with the wait; without it the replays must still deliver every sum).
    const std::string to = " to rank " + std::to_string(next);
    if (!next_remote) {
      const uint32_t parts = dkv_parts(bytes);
      for (uint32_t k = 0; k < parts; ++k) {
        const uint64_t o = k * g.dkv_part_bytes, n = std::min(g.dkv_part_bytes, bytes - o);
        Op op;
        op.kind = srcs.size() == 2 ? OpKind::kReduce : OpKind::kCopy;
        op.waits = in;
        for (BufRef r : srcs) op.srcs.push_back(BufRef{r.buf, r.rank, r.offset + o});
        op.dsts = {BufRef{RingBuf::kAcc, next, off + o}};
        if (op.kind == OpKind::kReduce) {
          op.elems = n / 4;
          op.dst_f32 = true;
        } else {
          op.bytes = n;
        }
        op.signals = {add_to(RingRegion::kDkvArrived, next, idx)};
        op.what = (srcs.size() == 2 ? "sum of " : "") + dpiece_name(blk, b, dp) +
                  (parts > 1 ? " part " + std::to_string(k) + " of " + std::to_string(parts) : std::string()) + to;
        rp.ops.push_back(op);
      }
      return;
    }
    std::vector<comm::Wait> put_waits = in;
    BufRef send = srcs[0];
    if (srcs.size() == 2) {
      Op sum;
      sum.kind = OpKind::kReduce;
      sum.waits = in;
      sum.srcs = srcs;
      sum.dsts = {BufRef{RingBuf::kPart, me, off}};
      sum.elems = bytes / 4;
      sum.dst_f32 = true;
      sum.signals = {add_to(RingRegion::kSummed, me, idx)};
      sum.what = "sum of " + dpiece_name(blk, b, dp) + " into the own part";
      rp.ops.push_back(sum);
      put_waits = {wait_on(RingRegion::kSummed, me, idx, 1, me)};
      send = BufRef{RingBuf::kPart, me, off};
    }
    Op put = pb.put(next, send, BufRef{RingBuf::kAcc, next, off}, bytes, flag_at(RingRegion::kDkvArrivedNet, next, idx),
                    flag_at(RingRegion::kSrcFree, me, 0), dpiece_name(blk, b, dp) + to + " (network)");
    put.waits = put_waits;
    rp.ops.push_back(put);
  }

  // The items that write each piece of each block at this rank (RingRank::ready_count).
  void count_ready(RingRank& rp, int me) const {
    rp.ready_count.assign(size_t(plan.world) * g.B * g.dpieces(), 0);
    for (int t = 0; t < plan.world; ++t)
      for (int b = 0; b < g.B; ++b)
        for (int dp = 0; dp < g.dpieces(); ++dp)
          if (computes(me, t, dp)) {
            const int blk = plan.steps[me][t].kv_rank;
            rp.ready_count[p.dkv_index(blk, b, dp)] = uint32_t(g.dpiece_kbs(blk, dp) * g.hkv);
          }
  }

  void build(int me) {
    RingRank& rp = p.ranks[me];
    rp.rank = me;
    const int W = plan.world;
    rp.step_wait0.assign(W, 0);
    rp.step_waits.assign(W, 0);
    if (g.backward) count_ready(rp, me);
    if (g.backward) {
      rp.own_sum.assign(size_t(g.B) * g.dpieces(), 0);
      for (int b = 0; b < g.B; ++b)
        for (int dp = 0; dp < g.dpieces(); ++dp)
          rp.own_sum[size_t(b) * g.dpieces() + dp] = W > 1 && begun(me, dp, W - 1);
    }
    if (W == 1) return;
    const auto& steps = plan.steps[me];
    const int next = steps[0].send_to, prev = steps[0].recv_from;
    const bool next_remote = !p.layout.same_node(next, me);
    const bool prev_remote = !p.layout.same_node(prev, me);
    rp.ops.push_back(entry_signal(me, prev, prev_remote));
    // K/V forwarded at step t (t < W - 1), and the backward's sums of step t.
    auto kv = [&](int t) {
      for (int b = 0; b < g.B; ++b)
        for (int pc = 0; pc < g.pieces_of(steps[t].kv_rank); ++pc) {
          if (t >= 1 && prev_remote) relay(rp, me, prev, steps[t].kv_rank, b, pc);
          forward(rp, me, next, prev, next_remote, t, steps[t].kv_rank, b, pc);
        }
    };
    auto dkv = [&](int t) {
      const int blk = steps[t].kv_rank;
      for (int b = 0; b < g.B; ++b)
        for (int dp = 0; dp < g.dpieces(); ++dp) {
          if (prev_remote && begun(blk, dp, t - 1)) relay_dkv(rp, me, prev, blk, b, dp);
          send_dkv(rp, me, next, prev, next_remote, prev_remote, t, blk, b, dp);
        }
    };
    // The last block K/V arrives (not forwarded): relayed from the network.
    auto last_kv = [&]() {
      if (prev_remote)
        for (int b = 0; b < g.B; ++b)
          for (int pc = 0; pc < g.pieces_of(steps[W - 1].kv_rank); ++pc) relay(rp, me, prev, steps[W - 1].kv_rank, b, pc);
    };
    // Backward: every K/V op before the first sum. A sum waits for this rank's kernel to finish
    // a step, and the communication CTAs take ops in list order; were a K/V op listed behind a
    // sum, the CTAs could all wait on sums whose items belong to compute CTAs that are not
    // resident yet (a persistent grid need not be: under MPS, or beside other kernels), while
    // the resident ones wait for that K/V op — a deadlock (seen at W = 4 under MPS with K/V one
    // step ahead of the sums). K/V forwarding waits for nothing the kernel computes.
    for (int t = 0; t + 1 < W; ++t) kv(t);
    last_kv();
    rp.kv_ops = uint32_t(rp.ops.size());
    if (g.backward)
      for (int t = 1; t < W; ++t) dkv(t);
    if (g.backward && prev_remote)
      for (int b = 0; b < g.B; ++b)
        for (int dp = 0; dp < g.dpieces(); ++dp)
          if (begun(me, dp, W - 1)) relay_dkv(rp, me, prev, me, b, dp);
    call_end(rp, me, prev, prev_remote);
    // The kernel's waits: step t reads block steps[t].kv_rank once every piece of it arrived.
    for (int t = 1; t < W; ++t) {
      rp.step_wait0[t] = uint32_t(rp.waits.size());
      wait_block(&rp.waits, me, prev, t);
      rp.step_waits[t] = uint32_t(rp.waits.size()) - rp.step_wait0[t];
    }
  }
};

}  // namespace

RingGeometry ring_kv_geometry(int B, const std::vector<int64_t>& rows, int Hkv, int D, int64_t chunk_tokens) {
  RingGeometry g;
  g.B = B;
  const int64_t S_l = rows.empty() ? 0 : *std::max_element(rows.begin(), rows.end());
  g.S_l = S_l;
  if (std::any_of(rows.begin(), rows.end(), [&](int64_t r) { return r != S_l; })) g.rows = rows;
  g.row_bytes = int64_t(Hkv) * D * 2;
  int64_t ct = chunk_tokens > 0 ? chunk_tokens : std::max<int64_t>(64, (int64_t(2) << 20) / std::max<int64_t>(g.row_bytes, 1));
  ct = std::max<int64_t>(1, std::min<int64_t>(ct, S_l));
  g.chunk_tokens = int(ct);
  g.pieces = int((S_l + ct - 1) / ct);
  return g;
}

Status build_ring_program(const RingPlan& plan, const comm::Layout& layout, const RingGeometry& g, bool staged,
                          RingProgram* out) {
  const int W = plan.world;
  MK_REQUIRE(layout.world == W && g.B >= 1 && g.S_l >= 1 && g.row_bytes > 0 && g.row_bytes % 16 == 0 &&
                 g.chunk_tokens >= 1 && g.pieces == int((g.S_l + g.chunk_tokens - 1) / g.chunk_tokens) &&
                 (g.rows.empty() || int(g.rows.size()) == W),
             Code::kInvalidArgument, "ring_attention: bad ring geometry");
  for (int r = 0; r < W; ++r)
    MK_REQUIRE(g.rows_of(r) >= 1 && g.rows_of(r) <= g.S_l && g.rows_of(r) == plan.rows[size_t(r)], Code::kInvalidArgument,
               "ring_attention: rank %d's block of %lld rows against %lld in the plan (slots of %lld)", r,
               (long long)g.rows_of(r), (long long)plan.rows[size_t(r)], (long long)g.S_l);
  MK_REQUIRE(!g.backward || (g.hkv >= 1 && g.tile_bytes > 0 && g.tile_bytes % 16 == 0 && (g.chunks == 1 || g.chunks == 2) &&
                             g.kb_per_chunk >= 1 && g.kb_per_piece >= 1 && g.dkv_part_bytes >= 16 &&
                             g.dkv_part_bytes % 16 == 0),
             Code::kInvalidArgument, "ring_attention: bad backward geometry");
  MK_REQUIRE(!g.backward || g.chunk_kbs.empty() || int(g.chunk_kbs.size()) == W * g.chunks, Code::kInvalidArgument,
             "ring_attention: %zu chunk key-block counts for %d ranks of %d chunks", g.chunk_kbs.size(), W, g.chunks);
  for (int k : g.chunk_kbs)
    MK_REQUIRE(!g.backward || (k >= 1 && k <= g.kb_per_chunk), Code::kInvalidArgument,
               "ring_attention: a chunk of %d key blocks (at most %d)", k, g.kb_per_chunk);
  RingProgram& p = *out;
  p = RingProgram{};
  p.layout = layout;
  p.geo = g;
  p.net_staged = staged && layout.nodes() > 1;
  const bool net = layout.nodes() > 1;
  const uint64_t block = uint64_t(g.B) * uint64_t(g.S_l) * uint64_t(g.row_bytes);
  Builder bld{p, plan, g, block, comm::ProgramBuilder(p)};
  comm::ProgramBuilder& pb = bld.pb;
  const bool direct = net && !p.net_staged;
  pb.buf("user_k", block, comm::Space::kUser, false, kUserSlotK);
  pb.buf("user_v", block, comm::Space::kUser, false, kUserSlotV);
  pb.buf("slots_k", uint64_t(W) * block, comm::Space::kSymmetric, direct);
  pb.buf("slots_v", uint64_t(W) * block, comm::Space::kSymmetric, direct);
  pb.buf("token", direct ? 8ull * W : 0, comm::Space::kSymmetric, direct, -1, comm::kNoBuf, true);
  pb.buf("slots_k_net", p.net_staged ? uint64_t(W) * block : 0, comm::Space::kHost, p.net_staged, -1, RingBuf::kSlotsK);
  pb.buf("slots_v_net", p.net_staged ? uint64_t(W) * block : 0, comm::Space::kHost, p.net_staged, -1, RingBuf::kSlotsV);
  pb.buf("token_net", p.net_staged ? 8ull * W : 0, comm::Space::kHost, p.net_staged, -1, RingBuf::kToken, true);
  const uint64_t dkv = g.backward ? uint64_t(W) * g.dkv_block_bytes() : 0;
  pb.buf("dkv_part", dkv, comm::Space::kSymmetric, direct);
  pb.buf("dkv_acc", dkv, comm::Space::kSymmetric, direct);
  pb.buf("dkv_part_net", p.net_staged ? dkv : 0, comm::Space::kHost, p.net_staged, -1, RingBuf::kPart);
  pb.buf("dkv_acc_net", p.net_staged ? dkv : 0, comm::Space::kHost, p.net_staged, -1, RingBuf::kAcc);
  const uint32_t arrivals = uint32_t(W * g.B * g.pieces);
  const uint32_t dflags = g.backward ? uint32_t(W * g.B * g.dpieces()) : 0;
  p.add_region("arrived", arrivals, false);
  p.add_region("arrived_net", arrivals, true);
  p.add_region("entry", 1, false);
  p.add_region("entry_net", 1, true);
  p.add_region("src_free", 1, true);
  p.add_region("ready", dflags, false);
  p.add_region("dkv_arrived", dflags, false);
  p.add_region("dkv_arrived_net", dflags, true);
  p.add_region("summed", dflags, false);
  p.place_regions();
  p.ranks.resize(W);
  for (int me = 0; me < W; ++me) bld.build(me);
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
