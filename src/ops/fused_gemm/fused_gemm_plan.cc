// Plans of the fused GEMM collectives (see src/ops/fused_gemm/fused_gemm_plan.h).
#include "src/ops/fused_gemm/fused_gemm_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "mkernel/common/check.h"
#include "src/comm/program_builder.h"

namespace mk {
namespace ops {

using comm::BufId;
using comm::RegionId;

const char* fused_kind_name(FusedKind k) {
  switch (k) {
    case FusedKind::kAgGemm: return "ag_gemm";
    case FusedKind::kGemmRs: return "gemm_rs";
    case FusedKind::kGemmAr: return "gemm_ar";
  }
  return "?";
}
const char* buf_name(BufId b) {
  static const char* n[] = {"user_a", "a_full", "accum", "recv", "c_ws", "user_c", "token",
                            "a_full_net", "accum_net", "recv_net", "c_ws_net", "token_net"};
  static_assert(sizeof(n) / sizeof(n[0]) == Buf::kCount, "a name per buffer");
  return b < Buf::kCount ? n[b] : "?";
}
const char* region_name(RegionId r) {
  static const char* n[] = {"entry", "entry_net", "row_ready", "row_count", "out_row", "net_in", "local", "src_free"};
  static_assert(sizeof(n) / sizeof(n[0]) == Region::kCount, "a name per region");
  return r < Region::kCount ? n[r] : "?";
}

BufId net_mirror(BufId b) {
  switch (b) {
    case Buf::kAFull: return Buf::kAFullNet;
    case Buf::kAccum: return Buf::kAccumNet;
    case Buf::kRecv: return Buf::kRecvNet;
    case Buf::kCws: return Buf::kCwsNet;
    case Buf::kToken: return Buf::kTokenNet;
    default: return comm::kNoBuf;
  }
}
bool is_host_buf(BufId b) { return b >= Buf::kAFullNet && b < Buf::kCount; }

namespace {

using comm::add_to;
using comm::buf_at;
using comm::flag_at;
using comm::Op;
using comm::OpKind;
using comm::set_epoch;
using comm::wait_on;
using comm::Wait;

struct Builder {
  Plan& p;
  const comm::Layout& L;
  int64_t M, N, K, Ms;  // Ms: the largest shard (the per-shard workspaces' stride)
  int W, nodes, local;
  int64_t row0(int s) const { return p.shard_row0[size_t(s)]; }
  std::vector<std::vector<int>> shard_chunks;  // shard -> chunk ids
  std::vector<int> chunks_in_row;              // tile-row -> number of chunks
  comm::ProgramBuilder pb;                     // counts this rank's puts per kSrcFree flag

  // A call must not end while the proxy still reads one of its sources (the next call would
  // overwrite it): the last ops wait for every put's local completion (zeroing a reduce-add
  // source once it is free).
  void finish_puts(RankPlan& rp, int me, const std::map<uint32_t, Op>& zeros) {
    for (const auto& [c, count] : pb.completions(Region::kSrcFree, me)) {
      Op op;
      auto z = zeros.find(c);
      if (z != zeros.end()) op = z->second;
      else {
        op.kind = OpKind::kSignal;
        op.what = "puts of chunk " + std::to_string(c) + " done reading their source";
      }
      op.waits.push_back(wait_on(Region::kSrcFree, me, c, uint64_t(count), me));
      rp.ops.push_back(op);
    }
  }

  std::vector<int> local_all(int me) const {
    std::vector<int> out{me};
    for (int q : L.node_peers(me)) out.push_back(q);
    return out;
  }
  // Shards in the order their rows become available to `me`: own, same node, then other nodes.
  std::vector<int> shard_order(int me) const {
    std::vector<int> out = local_all(me);
    const int n = L.node_of[me], l = L.local_of[me];
    for (int d = 1; d < nodes; ++d) {
      const auto& nr = L.node_ranks[(n + d) % nodes];
      for (int i = 0; i < local; ++i) out.push_back(nr[(l + i) % local]);
    }
    return out;
  }
  void tile_order_by_shards(RankPlan& rp, const std::vector<int>& shards) const {
    std::vector<char> seen(p.tiles_m, 0);
    for (int s : shards)
      for (int c : shard_chunks[s]) {
        const int tm = p.chunks[c].tile_row;
        if (seen[tm]) continue;
        seen[tm] = 1;
        for (int tn = 0; tn < p.tiles_n; ++tn) rp.tile_order.push_back(tn * p.tiles_m + tm);
      }
  }


  // My chunk c of `buf` (final once kLocal[c] is set) to my twin q on another node, once q
  // entered the call, raising q's kNetIn[net_index]; its source is free at kSrcFree[c].
  // ready_before: the chunk is final when the kernel starts (AG's own shard, copied by the launch):
  // no kLocal wait.
  Op twin_put(int me, int q, int c, BufId buf, uint64_t row_bytes, uint32_t net_index, const char* what,
                  bool ready_before = false) {
    const Chunk& ch = p.chunks[c];
    Op op = pb.put(q, buf_at(buf, me, uint64_t(ch.row0) * row_bytes), buf_at(buf, q, uint64_t(ch.row0) * row_bytes),
                   uint64_t(ch.rows) * row_bytes, flag_at(Region::kNetIn, q, net_index),
                   flag_at(Region::kSrcFree, me, c),
                   what + std::to_string(c) + " to rank " + std::to_string(q) + " (network)");
    op.waits = {wait_on(Region::kEntryNet, me, q, 1, q)};
    if (!ready_before) op.waits.insert(op.waits.begin(), wait_on(Region::kLocal, me, c, 1, me));
    return op;
  }

  // Chunk c of twin s's rows arrived here over the network (flag kNetIn[net_index]): forward it
  // into the node peers' copies of `buf` and count it in `ready`'s tile-row on every rank of
  // the node (a signal-only op when this rank is alone on its node).
  Op forward_op(int me, int s, int c, BufId buf, uint64_t row_bytes, uint32_t net_index, RegionId ready,
                    const char* what) const {
    const Chunk& ch = p.chunks[c];
    Op op;
    op.waits.push_back(wait_on(Region::kNetIn, me, net_index, 1, s));
    op.srcs = {buf_at(buf, me, uint64_t(ch.row0) * row_bytes)};
    if (p.net_staged) {
      // The rows landed in the host mirror: into my own copy first, then the node's peers'.
      op.dsts.push_back(op.srcs[0]);
      op.srcs[0].buf = net_mirror(buf);
    }
    for (int q : L.node_peers(me)) {
      op.dsts.push_back(buf_at(buf, q, uint64_t(ch.row0) * row_bytes));
      op.waits.push_back(wait_on(Region::kEntry, me, q, 1, q));
    }
    for (int q : local_all(me)) op.signals.push_back(add_to(ready, q, ch.tile_row));
    op.kind = op.dsts.empty() ? OpKind::kSignal : OpKind::kCopy;
    if (op.dsts.empty()) op.srcs.clear();
    op.bytes = op.dsts.empty() ? 0 : uint64_t(ch.rows) * row_bytes;
    op.what = what + std::to_string(c) + " of shard " + std::to_string(s) + " forwarded in the node";
    return op;
  }

  void build_ag(int me) {
    RankPlan& rp = p.ranks[me];
    const int64_t rowb = K * 2;
    pb.entry_ops(me, Region::kEntry, Region::kEntryNet, Buf::kToken, &rp.ops);
    // 1. My shard is in my own gathered A when the kernel starts (the launch copies it there with
    //    the copy engine, Plan::own_copy_before): my first tiles start at once and wait for
    //    nothing. My shard into my node's peers' (each waits for that peer's entry), chunk by
    //    chunk.
    if (local > 1)
      for (int c : shard_chunks[me]) {
        const Chunk& ch = p.chunks[c];
        Op op;
        op.kind = OpKind::kCopy;
        op.srcs = {buf_at(Buf::kUserA, me, uint64_t(ch.row0 - row0(me)) * rowb)};
        for (int q : L.node_peers(me)) {
          op.dsts.push_back(buf_at(Buf::kAFull, q, uint64_t(ch.row0) * rowb));
          op.waits.push_back(wait_on(Region::kEntry, me, q, 1, q));
          op.signals.push_back(add_to(Region::kRowReady, q, ch.tile_row));
        }
        op.bytes = uint64_t(ch.rows) * rowb;
        op.what = "AG chunk " + std::to_string(c) + " of shard " + std::to_string(me) + " to the node's peers";
        rp.ops.push_back(op);
      }
    // 2. My shard to my twin on every other node, once per node.
    for (int q : L.twins(me))
      for (int c : shard_chunks[me]) rp.ops.push_back(twin_put(me, q, c, Buf::kAFull, rowb, c, "AG chunk ", true));
    // 3. Shards of my twins arrive over the network: forward them inside the node.
    for (int s : L.twins(me))
      for (int c : shard_chunks[s])
        rp.ops.push_back(forward_op(me, s, c, Buf::kAFull, rowb, c, Region::kRowReady, "AG chunk "));
    finish_puts(rp, me, {});
    // Tiles wait for every chunk of their tile-row that other ranks deliver (my own are there).
    std::vector<int> own_in_row(p.tiles_m, 0);
    for (int c : shard_chunks[me]) ++own_in_row[p.chunks[c].tile_row];
    rp.rows.resize(p.tiles_m);
    for (int tm = 0; tm < p.tiles_m; ++tm) {
      rp.rows[tm].load_wait0 = uint32_t(rp.waits.size());
      const int others = chunks_in_row[tm] - own_in_row[tm];
      rp.rows[tm].load_waits = others > 0 ? 1 : 0;
      if (!others) continue;
      // Reported on timeout: the owner of the tile-row's first other shard.
      int owner = -1;
      for (const Chunk& ch : p.chunks)
        if (ch.tile_row == tm && ch.shard != me) {
          owner = ch.shard;
          break;
        }
      rp.waits.push_back(wait_on(Region::kRowReady, me, tm, uint64_t(others), owner));
    }
    tile_order_by_shards(rp, shard_order(me));
  }

  // One rank's reduction (RS/AR): where its workspaces hold what, and which tile-rows end in its
  // own epilogue.
  struct Reduce {
    const Builder* b;
    int me = 0;
    bool allreduce = false;
    int n = 0, l = 0;               // my node and local index
    int slots = 1;                  // accumulation slots (deterministic: one per local rank)
    uint64_t row4 = 0, row2 = 0;    // fp32 and bf16 bytes of a row of C
    uint64_t per_tile_row = 0;      // adds to a reducer's row count per tile-row
    // One node: the owner's final sum of a tile-row that holds its rows only runs in the
    // epilogue of its own tiles (RankPlan::fin); they then add nothing to its row count. A
    // tile-row shared by shards keeps the final op: its tiles carry rows for other reducers,
    // whose own tiles of that row would wait for each other.
    bool fin = false;

    bool pure_row(int tm) const { return fin && b->chunks_in_row[tm] == 1; }  // one shard's rows only
    bool fin_row(int tm) const {
      const int64_t r0 = int64_t(tm) * kPlanTileM;
      return pure_row(tm) && r0 >= b->row0(me) && r0 < b->row0(me + 1);
    }
    uint64_t row_target(int tm) const { return fin_row(tm) ? per_tile_row - b->p.tiles_n : per_tile_row; }
    // accum offset of row m of shard s (node n_s) in slot k
    uint64_t accum_off(int s, int k, int64_t m) const {
      return ((uint64_t(k) * b->nodes + b->L.node_of[s]) * b->Ms + uint64_t(m - b->row0(s))) * row4;
    }
    uint64_t recv_off(int s, int src_node, int64_t m) const {
      return (uint64_t(src_node) * b->Ms + uint64_t(m - b->row0(s))) * row4;
    }
  };
  Reduce reduce_of(int me, bool allreduce) const {
    Reduce r;
    r.b = this;
    r.me = me;
    r.allreduce = allreduce;
    r.n = L.node_of[me];
    r.l = L.local_of[me];
    r.slots = p.deterministic ? local : 1;
    r.row4 = uint64_t(N) * 4;
    r.row2 = uint64_t(N) * 2;
    r.per_tile_row = uint64_t(local) * p.tiles_n;
    r.fin = nodes == 1 && local > 1;
    return r;
  }

  // The epilogue's routes (shard s -> its reducer on my node) and my own rows' final sum in it.
  void reduce_epilogue(RankPlan& rp, const Reduce& r) const {
    const int me = r.me;
    // Epilogue routing: shard s -> its reducer on my node (the rank with s's local index).
    rp.route.resize(W);
    for (int s = 0; s < W; ++s) {
      const int red = L.node_ranks[r.n][L.local_of[s]];
      rp.route[s] = buf_at(Buf::kAccum, red, r.accum_off(s, p.deterministic ? r.l : 0, row0(s)));
    }
    int64_t fin_lo = -1, fin_hi = -1;  // rows of the tile-rows with fin_row
    for (int tm = 0; tm < p.tiles_m; ++tm)
      if (r.fin_row(tm)) {
        if (fin_lo < 0) fin_lo = int64_t(tm) * kPlanTileM;
        fin_hi = std::min<int64_t>(M, int64_t(tm + 1) * kPlanTileM);
      }
    if (fin_lo >= 0) {
      EpilogueFinal& f = rp.fin;
      f.on = true;
      f.row0 = row0(me);
      f.lo = fin_lo;
      f.hi = fin_hi;
      if (p.deterministic) {
        // Slots in local order, this rank's own values at its own index.
        for (int k = 0; k < r.slots; ++k)
          if (k != r.l) f.srcs.push_back(buf_at(Buf::kAccum, me, r.accum_off(me, k, row0(me))));
        f.self = r.l;
      } else {
        f.srcs = {buf_at(Buf::kAccum, me, r.accum_off(me, 0, row0(me)))};
        f.self = 0;
        f.zero_srcs = true;
      }
      // AR: straight into my C, and into the node's other ranks' c_ws (they copy it to theirs).
      f.dsts = {buf_at(Buf::kUserC, me, r.allreduce ? uint64_t(row0(me)) * r.row2 : 0)};
      if (r.allreduce)
        for (int q : L.node_peers(me)) f.dsts.push_back(buf_at(Buf::kCws, q, uint64_t(row0(me)) * r.row2));
    }
  }

  // The store hooks of every tile-row: wait for the reducers' entry (and, for my own rows, the
  // node's shares), then count the tile at each reducer.
  void reduce_row_hooks(RankPlan& rp, const Reduce& r) const {
    const int me = r.me;
    rp.rows.resize(p.tiles_m);
    for (int tm = 0; tm < p.tiles_m; ++tm) {
      std::set<int> reducers;
      const int64_t r0 = int64_t(tm) * kPlanTileM, r1 = std::min<int64_t>(M, r0 + kPlanTileM);
      for (int s = p.shard_of(r0); s <= p.shard_of(r1 - 1); ++s) reducers.insert(L.node_ranks[r.n][L.local_of[s]]);
      RowHooks& h = rp.rows[tm];
      h.store_wait0 = uint32_t(rp.waits.size());
      h.store_sig0 = uint32_t(rp.signals.size());
      for (int red : reducers) {
        if (red != me) rp.waits.push_back(wait_on(Region::kEntry, me, red, 1, red));
        if (red != me || !r.fin_row(tm)) rp.signals.push_back(add_to(Region::kRowCount, red, tm));
      }
      if (r.fin_row(tm)) {
        // My own rows: every other rank of the node routed its share of this tile-row here.
        if (local > 1) rp.waits.push_back(wait_on(Region::kRowCount, me, tm, r.row_target(tm), -1));
        if (r.allreduce)
          for (int q : L.node_peers(me)) {
            if (!reducers.count(q)) rp.waits.push_back(wait_on(Region::kEntry, me, q, 1, q));
            rp.signals.push_back(add_to(Region::kOutRow, q, tm));
          }
      }
      h.store_waits = uint32_t(rp.waits.size()) - h.store_wait0;
      h.store_sigs = uint32_t(rp.signals.size()) - h.store_sig0;
    }
  }

  // 1. Shards owned by my twins on other nodes: node-reduce here, send the partial (the zeroing
  //    of a reduce-add source waits for the put's local completion: `zeros`, by chunk).
  void reduce_partials_out(RankPlan& rp, const Reduce& r, std::map<uint32_t, Op>* zeros) {
    const int me = r.me;
    for (int s : L.twins(me))
      for (int c : shard_chunks[s]) {
        const Chunk& ch = p.chunks[c];
        const uint64_t bytes = uint64_t(ch.rows) * r.row4;
        Wait counted = wait_on(Region::kRowCount, me, ch.tile_row, r.per_tile_row, -1);
        Wait ready = counted;
        if (p.deterministic && r.slots > 1) {
          Op red;
          red.kind = OpKind::kReduce;
          red.waits = {counted};
          for (int k = 0; k < r.slots; ++k) red.srcs.push_back(buf_at(Buf::kAccum, me, r.accum_off(s, k, ch.row0)));
          red.dsts = {buf_at(Buf::kAccum, me, r.accum_off(s, 0, ch.row0))};
          red.dst_f32 = true;
          red.elems = uint64_t(ch.rows) * N;
          red.signals = {set_epoch(Region::kLocal, me, c)};
          red.what = "node sum of chunk " + std::to_string(c) + " (shard " + std::to_string(s) + ")";
          rp.ops.push_back(red);
          ready = wait_on(Region::kLocal, me, c, 1, me);
        }
        Op put = pb.put(s, buf_at(Buf::kAccum, me, r.accum_off(s, 0, ch.row0)), buf_at(Buf::kRecv, s, r.recv_off(s, r.n, ch.row0)),
                        bytes, flag_at(Region::kNetIn, s, uint32_t(c * nodes + r.n)), flag_at(Region::kSrcFree, me, c),
                        "partial of chunk " + std::to_string(c) + " to rank " + std::to_string(s) + " (network)");
        put.waits = {ready, wait_on(Region::kEntryNet, me, s, 1, s)};
        if (!p.deterministic) {
          // The reduce-add accumulation must be zero for the next call once the proxy read it.
          Op z;
          z.kind = OpKind::kZero;
          z.dsts = {buf_at(Buf::kAccum, me, r.accum_off(s, 0, ch.row0))};
          z.bytes = bytes;
          z.what = "zero the sent partial of chunk " + std::to_string(c);
          (*zeros)[c] = z;
        }
        rp.ops.push_back(put);
      }
  }

  // 2. My own shard: node sum + the other nodes' partials, in node order (one node: in the
  //    epilogue instead, RankPlan::fin).
  void reduce_own_shard(RankPlan& rp, const Reduce& r) const {
    const int me = r.me;
    for (int c : shard_chunks[me]) {
      const Chunk& ch = p.chunks[c];
      if (r.fin_row(ch.tile_row)) continue;
      Op op;
      op.kind = OpKind::kReduce;
      op.waits.push_back(wait_on(Region::kRowCount, me, ch.tile_row, r.per_tile_row, -1));
      for (int nn = 0; nn < nodes; ++nn) {
        if (nn == r.n) {
          for (int k = 0; k < r.slots; ++k) {
            if (!p.deterministic) op.zero_src_mask |= 1u << op.srcs.size();
            op.srcs.push_back(buf_at(Buf::kAccum, me, r.accum_off(me, k, ch.row0)));
          }
        } else {
          op.waits.push_back(wait_on(Region::kNetIn, me, uint32_t(c * nodes + nn), 1, L.node_ranks[nn][r.l]));
          // Staged: the other nodes' partials are read where they landed, in the host mirror.
          op.srcs.push_back(buf_at(p.net_staged ? Buf::kRecvNet : Buf::kRecv, me, r.recv_off(me, nn, ch.row0)));
        }
      }
      op.elems = uint64_t(ch.rows) * N;
      if (!r.allreduce) {
        op.dsts = {buf_at(Buf::kUserC, me, uint64_t(ch.row0 - row0(me)) * r.row2)};
      } else {
        for (int q : local_all(me)) {
          op.dsts.push_back(buf_at(Buf::kCws, q, uint64_t(ch.row0) * r.row2));
          if (q != me) op.waits.push_back(wait_on(Region::kEntry, me, q, 1, q));
          op.signals.push_back(add_to(Region::kOutRow, q, ch.tile_row));
        }
        if (nodes > 1) op.signals.push_back(set_epoch(Region::kLocal, me, c));
      }
      op.what = "final sum of chunk " + std::to_string(c) + " (own shard)";
      rp.ops.push_back(op);
    }
  }

  // AR: 3. my final chunks to my twins, theirs forwarded inside my node; 4. the all-reduced rows
  // into the caller's C.
  void allreduce_out(RankPlan& rp, const Reduce& r) {
    const int me = r.me;
    if (!r.allreduce) return;
    // 3. My final chunks to my twins; theirs forwarded inside my node.
    for (int q : L.twins(me))
      for (int c : shard_chunks[me])
        rp.ops.push_back(twin_put(me, q, c, Buf::kCws, r.row2, uint32_t(p.chunks.size() * nodes + c), "final chunk "));
    for (int s : L.twins(me))
      for (int c : shard_chunks[s])
        rp.ops.push_back(forward_op(me, s, c, Buf::kCws, r.row2, uint32_t(p.chunks.size() * nodes + c),
                                    Region::kOutRow, "final chunk "));
    // 4. The all-reduced rows into the caller's C, tile-row by tile-row as they complete.
    for (int tm = 0; tm < p.tiles_m; ++tm) {
      if (r.fin_row(tm)) continue;  // my own rows: my epilogue wrote them into C
      const int64_t r0 = int64_t(tm) * kPlanTileM, r1 = std::min<int64_t>(M, r0 + kPlanTileM);
      Op op;
      op.kind = OpKind::kCopy;
      // Each chunk of the row lands once (final op), or once per tile of its owner (epilogue).
      op.waits = {wait_on(Region::kOutRow, me, tm, uint64_t(chunks_in_row[tm]) * (r.pure_row(tm) ? p.tiles_n : 1), -1)};
      op.srcs = {buf_at(Buf::kCws, me, uint64_t(r0) * r.row2)};
      op.dsts = {buf_at(Buf::kUserC, me, uint64_t(r0) * r.row2)};
      op.bytes = uint64_t(r1 - r0) * r.row2;
      op.what = "rows of tile-row " + std::to_string(tm) + " to C";
      rp.ops.push_back(op);
    }
  }

  // RS and AR: the node reduction, the network step between twins, the owner's final sum.
  void build_reduce(int me, bool allreduce) {
    RankPlan& rp = p.ranks[me];
    const Reduce r = reduce_of(me, allreduce);
    reduce_epilogue(rp, r);
    reduce_row_hooks(rp, r);
    pb.entry_ops(me, Region::kEntry, Region::kEntryNet, Buf::kToken, &rp.ops);
    std::map<uint32_t, Op> zeros;
    reduce_partials_out(rp, r, &zeros);
    reduce_own_shard(rp, r);
    allreduce_out(rp, r);
    finish_puts(rp, me, zeros);
    // Tiles: shards of other nodes first (their partials cross the network), then the node's,
    // own shard last, each list rotated from my position.
    std::vector<int> order;
    for (int d = 1; d < nodes; ++d) {
      const auto& nr = L.node_ranks[(r.n + d) % nodes];
      for (int i = 0; i < local; ++i) order.push_back(nr[(r.l + i) % local]);
    }
    for (int q : L.node_peers(me)) order.push_back(q);
    order.push_back(me);
    tile_order_by_shards(rp, order);
  }
};

}  // namespace

Status FusedGemm::can_implement(FusedKind kind, const PlanShape& shape, int world) {
  const int64_t M = shape.M, N = shape.N, K = shape.K;
  const int W = world;
  MK_REQUIRE(M > 0 && N > 0 && K > 0, Code::kInvalidArgument,
             "%s: M, N, K must be > 0 (got %lld, %lld, %lld)", fused_kind_name(kind), (long long)M, (long long)N,
             (long long)K);
  MK_REQUIRE(N % 8 == 0 && K % 8 == 0, Code::kInvalidArgument,
             "%s: N and K must be multiples of 8 (16-byte rows), got N %lld, K %lld", fused_kind_name(kind),
             (long long)N, (long long)K);
  MK_REQUIRE(W >= 1, Code::kInvalidArgument, "%s: world size %d", fused_kind_name(kind), W);
  MK_REQUIRE(M < (1ll << 31) && N < (1ll << 31) && K < (1ll << 31), Code::kInvalidArgument,
             "%s: M, N, K must be < 2^31", fused_kind_name(kind));
  std::vector<int64_t> row0;
  return shard_starts(kind, shape, W, &row0);
}

Status shard_starts(FusedKind kind, const PlanShape& shape, int world, std::vector<int64_t>* row0) {
  const char* name = fused_kind_name(kind);
  const int64_t M = shape.M;
  const int W = world;
  row0->assign(size_t(W) + 1, 0);
  if (shape.rows.empty()) {
    // AG and RS: the caller's buffers are the shards, so their size is the caller's to state.
    MK_REQUIRE(kind == FusedKind::kGemmAr || M % W == 0, Code::kInvalidArgument,
               "%s: M = %lld does not split into %d equal shards: give every rank's rows (PlanShape::rows; "
               "`mkernel bench` splits as evenly as M allows)",
               name, (long long)M, W);
    MK_REQUIRE(M >= W, Code::kInvalidArgument, "%s: M = %lld is less than one row for each of the %d ranks", name,
               (long long)M, W);
    for (int s = 0; s < W; ++s) (*row0)[size_t(s) + 1] = (*row0)[size_t(s)] + M / W + (s < M % W ? 1 : 0);
    return OkStatus();
  }
  MK_REQUIRE(int64_t(shape.rows.size()) == W, Code::kInvalidArgument,
             "%s: PlanShape::rows has %zu entries for %d ranks (one per rank, or none)", name, shape.rows.size(), W);
  for (int s = 0; s < W; ++s) {
    const int64_t r = shape.rows[size_t(s)];
    MK_REQUIRE(r >= 1 && r <= M, Code::kInvalidArgument, "%s: rank %d's shard has %lld rows (each needs 1 to M = %lld)",
               name, s, (long long)r, (long long)M);
    (*row0)[size_t(s) + 1] = (*row0)[size_t(s)] + r;
  }
  MK_REQUIRE((*row0)[size_t(W)] == M, Code::kInvalidArgument, "%s: the shards' rows sum to %lld, not M = %lld", name,
             (long long)(*row0)[size_t(W)], (long long)M);
  return OkStatus();
}

int Plan::shard_of(int64_t m) const {
  // The last shard whose first row is <= m (every shard has a row).
  return int(std::upper_bound(shard_row0.begin(), shard_row0.end() - 1, m) - shard_row0.begin()) - 1;
}

Status build_plan(FusedKind kind, const PlanShape& shape, const comm::Layout& layout, bool deterministic,
                  Plan* out, bool net_staged) {
  const int W = layout.world;
  MK_CHECK(layout.check("plan"));
  const int local = layout.local();
  MK_CHECK(FusedGemm::can_implement(kind, shape, W));
  const int64_t M = shape.M, N = shape.N, K = shape.K;
  Plan& p = *out;
  p = Plan{};
  p.kind = kind;
  p.shape = shape;
  p.layout = layout;
  // With one rank per node every element of a reducer's buffer has one writer: the partials
  // are stored, never reduce-added (no atomics, no zeroing) — the deterministic layout with one
  // slot. With two per node the slot layout costs one more slot and saves the reduce-add's
  // read-modify-write and the zeroing: fewer bytes, and the order is fixed too.
  p.deterministic = (deterministic || layout.local() <= 2) && kind != FusedKind::kAgGemm;
  p.net_staged = net_staged && layout.nodes() > 1;
  MK_CHECK(shard_starts(kind, shape, W, &p.shard_row0));
  p.shard_rows = 0;
  for (int s = 0; s < W; ++s) p.shard_rows = std::max(p.shard_rows, p.rows_of(s));
  p.even = true;
  for (int s = 0; s < W; ++s) p.even = p.even && p.rows_of(s) == p.shard_rows;
  p.own_copy_before = kind == FusedKind::kAgGemm;
  p.tiles_m = int((M + kPlanTileM - 1) / kPlanTileM);
  p.tiles_n = int((N + kPlanTileN - 1) / kPlanTileN);
  Builder b{p, layout, M, N, K, p.shard_rows, W, layout.nodes(), local, {}, {}, comm::ProgramBuilder(p)};
  b.shard_chunks.resize(W);
  b.chunks_in_row.assign(p.tiles_m, 0);
  for (int s = 0; s < W; ++s) {
    const int64_t a = p.shard_row0[size_t(s)], e = p.shard_row0[size_t(s) + 1];
    for (int64_t r = a; r < e;) {
      const int tm = int(r / kPlanTileM);
      const int64_t stop = std::min<int64_t>(e, int64_t(tm + 1) * kPlanTileM);
      b.shard_chunks[s].push_back(int(p.chunks.size()));
      p.chunks.push_back(Chunk{s, tm, r, stop - r});
      ++b.chunks_in_row[tm];
      r = stop;
    }
  }
  const int nodes = layout.nodes();
  const uint32_t nch = uint32_t(p.chunks.size());
  std::vector<uint64_t> bb(Buf::kCount, 0);
  bb[Buf::kToken] = 8ull * W;
  // The caller's tensors (bound per call; their sizes bound the program's offsets).
  if (kind == FusedKind::kAgGemm) bb[Buf::kUserA] = uint64_t(b.Ms) * K * 2;
  else bb[Buf::kUserC] = uint64_t(kind == FusedKind::kGemmRs ? b.Ms : M) * N * 2;
  if (kind == FusedKind::kAgGemm) {
    bb[Buf::kAFull] = uint64_t(M) * K * 2;
  } else {
    const int slots = p.deterministic ? local : 1;
    bb[Buf::kAccum] = uint64_t(slots) * nodes * b.Ms * N * 4;
    if (nodes > 1) bb[Buf::kRecv] = uint64_t(nodes) * b.Ms * N * 4;
    if (kind == FusedKind::kGemmAr) bb[Buf::kCws] = uint64_t(M) * N * 2;
  }
  if (p.net_staged) {
    // Host mirrors of what crosses nodes; the device buffers that only the network wrote are
    // then not needed (kRecv: partials are read from the mirror; kToken: the mirror is sent).
    for (BufId m : {Buf::kAFull, Buf::kAccum, Buf::kRecv, Buf::kCws, Buf::kToken}) bb[net_mirror(m)] = bb[m];
    bb[Buf::kRecv] = 0;
    bb[Buf::kToken] = 0;
  }
  // Declarations, in the order of the Buf and Region ids.
  for (BufId id = 0; id < Buf::kCount; ++id) {
    const bool user = id == Buf::kUserA || id == Buf::kUserC, host = is_host_buf(id);
    BufId mirror_of = comm::kNoBuf;
    for (BufId m : {Buf::kAFull, Buf::kAccum, Buf::kRecv, Buf::kCws, Buf::kToken})
      if (host && net_mirror(m) == id) mirror_of = m;
    // Host mirrors cross nodes; direct (unstaged) plans on several nodes register the device
    // buffers that do.
    const bool network = host || (!user && nodes > 1 && !p.net_staged);
    b.pb.buf(buf_name(id), bb[id], user ? comm::Space::kUser : host ? comm::Space::kHost : comm::Space::kSymmetric,
             network, user ? (id == Buf::kUserA ? kUserSlotA : kUserSlotC) : -1, mirror_of, id == Buf::kToken || id == Buf::kTokenNet);
  }
  p.add_region(region_name(Region::kEntry), W, false);
  p.add_region(region_name(Region::kEntryNet), W, true);
  p.add_region(region_name(Region::kRowReady), p.tiles_m, false);
  p.add_region(region_name(Region::kRowCount), p.tiles_m, false);
  p.add_region(region_name(Region::kOutRow), p.tiles_m, false);
  p.add_region(region_name(Region::kNetIn), nch * uint32_t(nodes + 1), true);
  p.add_region(region_name(Region::kLocal), nch, false);
  p.add_region(region_name(Region::kSrcFree), nch, true);
  p.place_regions();
  p.ranks.resize(W);
  for (int me = 0; me < W; ++me) {
    p.ranks[me].rank = me;
    if (kind == FusedKind::kAgGemm)
      b.build_ag(me);
    else
      b.build_reduce(me, kind == FusedKind::kGemmAr);
  }
  return OkStatus();
}

std::string describe(const Plan& p, int rank) {
  char line[256];
  const RankPlan& rp = p.ranks[rank];
  snprintf(line, sizeof line, "%s rank %d: M %lld N %lld K %lld, %d x %d tiles, %zu chunks, %zu ops; shard rows [%lld, %lld)%s\n",
           fused_kind_name(p.kind), rank, (long long)p.shape.M, (long long)p.shape.N, (long long)p.shape.K,
           p.tiles_m, p.tiles_n, p.chunks.size(), rp.ops.size(), (long long)p.shard_row0[size_t(rank)],
           (long long)p.shard_row0[size_t(rank) + 1], p.even ? "" : " (uneven shards)");
  std::string out = line;
  if (rp.fin.on) {
    out += "  epilogue final of rows [" + std::to_string(rp.fin.lo) + ", " + std::to_string(rp.fin.hi) +
           "): own values as term " + std::to_string(rp.fin.self) + " of " + std::to_string(rp.fin.srcs.size() + 1) +
           (rp.fin.zero_srcs ? ", sources zeroed" : "") + "; sources";
    for (const auto& r : rp.fin.srcs) out += " " + comm::ref_str(p, r);
    out += "; destinations";
    for (const auto& r : rp.fin.dsts) out += " " + comm::ref_str(p, r);
    out += "\n";
  }
  return out + comm::describe(rp);
}

}  // namespace ops
}  // namespace mk
