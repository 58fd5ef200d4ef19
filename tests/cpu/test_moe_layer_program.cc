// The fused MoE layer's program (src/ops/moe/moe_program.h, build_moe_layer_program) replayed on
// the CPU: every rank's communication ops, and its compute side as the items the layer kernel's
// work queue hands out (moe_layer_item: the layout, unpack per source and chunk, the two GEMMs
// per tile, combine per chunk of tokens), each after its waits. The math is integer and exact (16-bit wrap-around sums: any row in the wrong place, of
// another call or another expert changes the result): the layer's output of every token of every
// rank is checked against a reference computed straight from the token's routing, in every call
// (a new routing and new rows each call). Every buffer the units read is poisoned when the rank
// starts a call, so a unit that runs before its data is there reads poison. Then mutants: every
// wait and signal of the ops and of the units' pools dropped, the headers and the first pieces
// moved 16 bytes: each must fail a replay, but the implied ones (said where they are marked).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "mkernel/ops/moe.h"
#include "src/comm/replay.h"
#include "src/ops/moe/moe_plan.h"
#include "src/ops/moe/moe_program.h"
#include "tests/common/moe_routing.h"
#include "tests/common/mutant_replay.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

constexpr int64_t kInter = 6;  // the experts' intermediate size (act row: 12 bytes)
constexpr int64_t kTileRows = 3;  // rows of a GEMM tile row (the kernel's 128)
constexpr int kCombineChunks = 2;  // combine units (chunks of the own tokens)
constexpr int kTilesN1 = 2, kTilesN2 = 3;  // column tiles of the GEMMs (act: 6 columns, y: 8)

struct LayerCase {
  int W = 2, nodes = 1;
  bool strided = false, staged = false;
  int pieces = 1, comm_slots = 1, compute_slots = 1, align = 1;
  int chunks = 1;  // unpack units per source
};
std::string name_of(const LayerCase& c) {
  return "W" + std::to_string(c.W) + (c.strided ? "s" : "n") + std::to_string(c.nodes) + (c.staged ? "_staged" : "") +
         "_p" + std::to_string(c.pieces) + "_c" + std::to_string(c.comm_slots) + "_u" +
         std::to_string(c.compute_slots) + "_a" + std::to_string(c.align) + "_k" + std::to_string(c.chunks);
}
void PrintTo(const LayerCase& c, std::ostream* os) { *os << name_of(c); }

MoeConfig cfg_of(const LayerCase& c) {
  MoeConfig m;
  m.hidden = 8;
  m.num_experts = 2 * c.W;
  m.topk = 2;
  m.max_tokens_per_rank = 5;
  m.expert_align = c.align;
  m.recv_capacity = 0;
  return m;
}
comm::Layout layout_of(const LayerCase& c) {
  return c.strided ? comm::Layout::strided(c.W, c.nodes) : comm::Layout::uniform(c.W, c.nodes);
}

// The experts: integer maps of rows that differ per expert, column and input element.
uint16_t lo16(uint64_t v) { return uint16_t(v & 0xffffu); }
// Columns [c0, c1) of a row (a column tile).
void expert_up(const uint16_t* x, int64_t H, int e, int64_t c0, int64_t c1, uint16_t* act) {  // x [H] -> act [kInter]
  for (int64_t j = c0; j < c1; ++j) {
    uint64_t g = 0, u = 0;
    for (int64_t c = 0; c < H; ++c) {
      g += uint64_t(x[c]) * uint64_t(1 + (c * 7 + j * 3 + e * 5) % 11);
      u += uint64_t(x[c]) * uint64_t(1 + (c * 5 + j * 11 + e * 3) % 13);
    }
    act[j] = lo16(lo16(g) * (uint64_t(lo16(u)) | 1u) + uint64_t(e) * 31u + uint64_t(j));
  }
}
void expert_down(const uint16_t* act, int64_t H, int e, int64_t c0, int64_t c1, uint16_t* y) {  // act -> y [H]
  (void)H;
  for (int64_t h = c0; h < c1; ++h) {
    uint64_t v = uint64_t(e) * 131u + uint64_t(h);
    for (int64_t j = 0; j < kInter; ++j) v += uint64_t(act[j]) * uint64_t(1 + (j * 5 + h * 3 + e * 7) % 17);
    y[h] = lo16(v);
  }
}
// The combine weight of token t's slot kk (integer: the sum is exact).
uint64_t weight_of(int64_t t, int kk, int e) { return uint64_t(1 + (t * 5 + kk * 3 + e) % 7); }

constexpr uint8_t kPoison = 0xee;

struct World {
  std::vector<std::vector<int32_t>> ids;
  std::vector<int64_t> n;
  std::vector<SourceRoute> routes;
  std::vector<std::vector<uint16_t>> x;
};

// The compute side as the kernel's work queue hands it out (moe_layer_item): the replay's compute
// slots take units in order, as CTAs take items from the queue's counter. The queue's length
// follows the layout, so the replay has as many units as the largest call can have: each unit
// past the static ones first waits for the layout (as a CTA that draws such an item does), finds
// its item, then waits for what that item needs; units past the call's items do nothing.
class LayerCompute : public comm::ReplayCompute {
 public:
  LayerCompute(const comm::Program& p, const LayerCase& c, uint64_t seed) : p_(p), c_(c), seed_(seed) {
    EXPECT_TRUE(moe_geometry(cfg_of(c), c.W, &g_).ok());
    W_ = c.W, El_ = g_.El;
    pl_ = moe_layer_pools(W_, El_);
    body_ = g_.slot_bytes - g_.hdr_bytes;
    P_ = moe_pieces(body_, c.pieces);
    CP_ = moe_pieces(g_.cslot_bytes, c.pieces);
    q_ = queue_of(c, g_);
    S_ = size_t(moe_layer_static_items(q_));
    const int J = moe_tile_rows(int64_t(W_) * g_.T * g_.k, q_.tile_rows);  // tile rows of the fullest expert
    U_ = S_ + size_t(El_) * size_t(J) * size_t(q_.tiles_n1 + q_.tiles_n2) + size_t(q_.combine_chunks);
    // The static units' waits, from the (possibly mutated) pools.
    waits_.resize(size_t(W_));
    for (int me = 0; me < W_; ++me) {
      const auto& pw = p.ranks[size_t(me)].waits;
      auto& w = waits_[size_t(me)];
      w.resize(S_ + 1);
      w[0].assign(pw.begin() + pl_.hdr, pw.begin() + pl_.hdr + (W_ - 1));
      for (size_t u = 1; u < S_; ++u) {
        const int idx = int(u - 1) / q_.unpack_chunks;  // source me + idx
        w[u] = {pw[pl_.laid]};
        if (idx > 0) w[u].push_back(pw[pl_.arrived + uint32_t(idx - 1)]);
      }
      w[S_] = {pw[pl_.laid]};  // every later unit's first phase
    }
  }
  static MoeLayerQueue queue_of(const LayerCase& c, const MoeGeometry& g) {
    MoeLayerQueue q;
    q.W = c.W, q.El = g.El, q.unpack_chunks = c.chunks, q.combine_chunks = kCombineChunks;
    q.tile_rows = int(kTileRows), q.tiles_n1 = kTilesN1, q.tiles_n2 = kTilesN2;
    return q;
  }

  size_t units(int) const override { return U_; }
  int phases(int, size_t u) const override { return u < S_ ? 1 : 2; }
  const comm::Wait* waits(int me, size_t u, int phase, size_t* n) const override {
    const std::vector<comm::Wait>* v = &waits_[size_t(me)][std::min(u, S_)];
    if (phase == 1) v = &items_.at({me, u}).second;
    *n = v->size();
    return v->data();
  }
  std::string unit_name(int me, size_t u) const override {
    if (u == 0) return "layout";
    if (u < S_)
      return "unpack(source " + std::to_string((me + int(u - 1) / q_.unpack_chunks) % W_) + ", chunk " +
             std::to_string(int(u - 1) % q_.unpack_chunks) + ")";
    auto it = items_.find({me, u});
    if (it == items_.end()) return "item " + std::to_string(u) + " (not drawn yet)";
    const MoeLayerItem& m = it->second.first;
    const std::string tile = "(expert " + std::to_string(m.a) + ", tile row " + std::to_string(m.b) + ", column tile " +
                             std::to_string(m.c) + ")";
    switch (m.kind) {
      case kMoeItemGemm1: return "gemm1" + tile;
      case kMoeItemGemm2: return "gemm2" + tile;
      case kMoeItemCombine: return "combine(chunk " + std::to_string(m.a) + ")";
      default: return "item " + std::to_string(u) + " (none)";
    }
  }

  void start_call(comm::Replay& r, int me, int e) override {
    World wd;
    world(e, &wd);
    // Poison what the units read: the other sources' receive and combine slots, and the caller's
    // buffers (a unit that reads before its data is there reads this).
    for (int s = 0; s < W_; ++s) {
      if (s == me) continue;
      if (!poison(r, me, comm::BufRef{MoeBuf::kRecv, me, uint64_t(s) * uint64_t(g_.slot_bytes)}, g_.slot_bytes) ||
          !poison(r, me, comm::BufRef{MoeLayerBuf::kCRecv, me, uint64_t(s) * uint64_t(g_.cslot_bytes)},
                  g_.cslot_bytes))
        return;
    }
    for (comm::BufId b : {MoeLayerBuf::kRecvX, MoeLayerBuf::kAct, MoeLayerBuf::kY, MoeLayerBuf::kLay, MoeLayerBuf::kOut})
      if (!poison(r, me, comm::BufRef{b, me, 0}, int64_t(p_.bufs[b].bytes))) return;
    // pack: the send slots (the own one in place) and their record pieces' counts.
    std::vector<uint8_t> slot(size_t(g_.slot_bytes));
    for (int d = 0; d < W_; ++d) {
      pack_record_slot(g_, me, d, wd.x[size_t(me)].data(), wd.ids[size_t(me)].data(), wd.routes[size_t(me)],
                       slot.data());
      const comm::BufRef at{d == me ? MoeBuf::kRecv : MoeBuf::kSend, me, uint64_t(d) * uint64_t(g_.slot_bytes)};
      uint8_t* m = r.mem(me, at, uint64_t(g_.slot_bytes));
      if (!m) return;
      memcpy(m, slot.data(), slot.size());
      if (d == me) continue;
      uint64_t used;
      memcpy(&used, slot.data(), 8);
      uint8_t* pc = r.mem(me, comm::BufRef{MoeBuf::kPieceBytes, me, 8ull * uint64_t(d) * P_}, 8ull * P_);
      if (!pc) return;
      for (int q = 0; q < P_; ++q) {
        const uint64_t v = moe_piece_count(body_, c_.pieces, q, used - uint64_t(g_.hdr_bytes));
        memcpy(pc + 8 * q, &v, 8);
      }
    }
  }

  bool run(comm::Replay& r, int me, size_t u, int phase) override {
    if (u == 0) return layout(r, me);
    if (u < S_) return unpack(r, me, (me + int(u - 1) / q_.unpack_chunks) % W_, int(u - 1) % q_.unpack_chunks);
    if (phase == 0) return draw(r, me, u);
    const MoeLayerItem m = items_.at({me, u}).first;
    switch (m.kind) {
      case kMoeItemGemm1: return gemm1(r, me, m);
      case kMoeItemGemm2: return gemm2(r, me, m);
      case kMoeItemCombine: return combine(r, me, m.a);
      case kMoeItemNone: return true;
      default: return r.fail("item " + std::to_string(u) + " of kind " + std::to_string(m.kind) + " past the static items");
    }
  }

  bool finish_call(comm::Replay& r, int me, int e) override {
    World wd;
    world(e, &wd);
    const uint8_t* out = r.mem(me, comm::BufRef{MoeLayerBuf::kOut, me, 0}, uint64_t(g_.T * g_.row_bytes));
    if (!out) return false;
    const int64_t H = g_.H;
    std::vector<uint16_t> act(static_cast<size_t>(kInter)), y(static_cast<size_t>(H));
    for (int64_t t = 0; t < g_.T; ++t) {
      const uint8_t* got = out + t * g_.row_bytes;
      if (t >= wd.n[size_t(me)]) {
        for (int64_t b = 0; b < g_.row_bytes; ++b)
          if (got[b] != kPoison) return r.fail("token " + std::to_string(t) + " past the call's tokens was written");
        continue;
      }
      std::vector<uint64_t> want(size_t(H), 0);
      for (int kk = 0; kk < g_.k; ++kk) {
        const int32_t ex = wd.ids[size_t(me)][size_t(t * g_.k + kk)];
        if (ex < 0) continue;
        expert_up(&wd.x[size_t(me)][size_t(t * H)], H, ex, 0, kInter, act.data());
        expert_down(act.data(), H, ex, 0, H, y.data());
        for (int64_t h = 0; h < H; ++h) want[size_t(h)] += weight_of(t, kk, ex) * y[size_t(h)];
      }
      for (int64_t h = 0; h < H; ++h) {
        uint16_t v;
        memcpy(&v, got + 2 * h, 2);
        if (v != lo16(want[size_t(h)]))
          return r.fail("token " + std::to_string(t) + " column " + std::to_string(h) + ": " + std::to_string(v) +
                        ", want " + std::to_string(lo16(want[size_t(h)])));
      }
    }
    return true;
  }

 private:
  // Call e's routing: in a quarter of the replays kFull in every call (dispatch send slots full to
  // their last piece), in another quarter every slot of every token to one other rank's experts
  // in every call (combine slots full to their last piece: T * k rows), in the rest every kind in
  // turn from a point the seed picks.
  void world(int e, World* wd) const {
    const MoeConfig cfg = cfg_of(c_);
    const int kind = seed_ % 4 == 0 ? int(test::MoeRouting::kFull)
                                    : int((uint64_t(e) + seed_ / 4 % test::kMoeRoutings) % test::kMoeRoutings);
    const uint64_t s = test::mix(seed_, uint64_t(e));
    wd->ids.resize(size_t(W_)), wd->n.resize(size_t(W_)), wd->routes.resize(size_t(W_)), wd->x.resize(size_t(W_));
    for (int q = 0; q < W_; ++q) {
      std::vector<float> w;
      test::make_moe_routing(test::MoeRouting(kind), s, q, W_, cfg.num_experts, cfg.topk, cfg.max_tokens_per_rank,
                             &wd->ids[size_t(q)], &w, &wd->n[size_t(q)]);
      if (seed_ % 4 == 1) {  // brim-full combine slots
        const int to = (q + 1 + int(s % uint64_t(W_ > 1 ? W_ - 1 : 1))) % W_;
        wd->n[size_t(q)] = g_.T;
        for (int64_t t = 0; t < g_.T; ++t)
          for (int kk = 0; kk < g_.k; ++kk) wd->ids[size_t(q)][size_t(t * g_.k + kk)] = to * El_ + int(t + kk) % El_;
      }
      int64_t bad = -1;
      route_source(g_, wd->ids[size_t(q)].data(), wd->n[size_t(q)], &wd->routes[size_t(q)], &bad);
      EXPECT_EQ(bad, 0);
      wd->x[size_t(q)].resize(size_t(g_.T * g_.H));
      for (int64_t t = 0; t < g_.T; ++t)
        for (int64_t c = 0; c < g_.H; ++c) wd->x[size_t(q)][size_t(t * g_.H + c)] = test::moe_x_bits(s, q, t, c);
    }
  }
  bool poison(comm::Replay& r, int me, const comm::BufRef& at, int64_t bytes) {
    uint8_t* m = r.mem(me, at, uint64_t(bytes));
    if (!m) return false;
    memset(m, kPoison, size_t(bytes));
    return true;
  }
  // `lay`: counts [El], offsets [El + 1], base [W][El], back [recv_rows][2], tiles done [2][El]
  // (moe_layer_lay_bytes).
  int32_t* lay(comm::Replay& r, int me) {
    return reinterpret_cast<int32_t*>(
        r.mem(me, comm::BufRef{MoeLayerBuf::kLay, me, 0}, uint64_t(moe_layer_lay_bytes(g_))));
  }
  int32_t* offsets(int32_t* l) const { return l + El_; }
  int32_t* base(int32_t* l) const { return l + El_ + El_ + 1; }
  int32_t* back(int32_t* l) const { return base(l) + W_ * El_; }
  int32_t* tiles_done(int32_t* l, int gemm) const { return back(l) + 2 * g_.recv_rows + gemm * El_; }
  // The layout as it is in `lay`, checked before use (read too early, it is poison).
  bool layout_sane(comm::Replay& r, int32_t* l) {
    const int32_t* off = offsets(l);
    for (int le = 0; le <= El_; ++le)
      if (off[le] < 0 || off[le] > g_.recv_rows || (le > 0 && off[le] < off[le - 1]))
        return r.fail("the layout read before it was written (offset " + std::to_string(off[le]) + ")");
    for (int le = 0; le < El_; ++le)
      if (l[le] < 0 || l[le] > off[le + 1] - off[le]) return r.fail("the layout's counts read before they were written");
    for (int i = 0; i < W_ * El_; ++i)
      if (base(l)[i] < 0 || base(l)[i] > g_.recv_rows) return r.fail("the layout's base read before it was written");
    return true;
  }
  // Rows [r0, r1) of the tile row, and its columns [c0, c1) of `n` in column tiles of tn.
  struct Tile {
    int64_t r0, r1, c0, c1;
  };
  Tile tile_of(int32_t* l, const MoeLayerItem& m, int64_t n, int tn) const {
    const int64_t r0 = offsets(l)[m.a] + int64_t(m.b) * q_.tile_rows;
    const int64_t cw = (n + tn - 1) / tn;
    return Tile{r0, std::min<int64_t>(r0 + q_.tile_rows, offsets(l)[m.a] + l[m.a]), m.c * cw,
                std::min<int64_t>(n, (m.c + 1) * cw)};
  }

  bool layout(comm::Replay& r, int me) {
    std::vector<const uint8_t*> hdr(static_cast<size_t>(W_));
    for (int s = 0; s < W_; ++s) {
      hdr[size_t(s)] = r.mem(me, comm::BufRef{MoeBuf::kRecv, me, uint64_t(s) * uint64_t(g_.slot_bytes)},
                             uint64_t(g_.hdr_bytes));
      if (!hdr[size_t(s)]) return false;
      uint32_t nrec;
      memcpy(&nrec, hdr[size_t(s)] + 8, 4);
      if (nrec > uint32_t(g_.T)) return r.fail("the header of source " + std::to_string(s) + " is not there");
    }
    int32_t* l = lay(r, me);
    if (!l) return false;
    layout_from_headers(g_, hdr, l, offsets(l), base(l));
    for (int i = 0; i < 2 * g_.recv_rows; ++i) back(l)[i] = -1;
    for (int i = 0; i < 2 * El_; ++i) tiles_done(l, 0)[i] = 0;
    // Every combine slot's header (rows in use: the entries that source sent) and piece counts.
    for (int s = 0; s < W_; ++s) {
      if (s == me) continue;
      uint32_t entries;
      memcpy(&entries, hdr[size_t(s)] + 12, 4);
      const uint64_t used = uint64_t(g_.chdr_bytes) + uint64_t(entries) * uint64_t(g_.row_bytes);
      uint8_t* ch = r.mem(me, comm::BufRef{MoeLayerBuf::kCSend, me, uint64_t(s) * uint64_t(g_.cslot_bytes)}, 16);
      uint8_t* pc = r.mem(me, comm::BufRef{MoeLayerBuf::kCPieceBytes, me, 8ull * uint64_t(s) * CP_}, 8ull * CP_);
      if (!ch || !pc) return false;
      memset(ch, 0, 16);
      memcpy(ch, &used, 8);
      for (int q = 0; q < CP_; ++q) {
        const uint64_t v = moe_piece_count(g_.cslot_bytes, c_.pieces, q, used);
        memcpy(pc + 8 * q, &v, 8);
      }
    }
    // Experts without rows have no tiles in the queue: their flags are raised here.
    const auto& sg = p_.ranks[size_t(me)].signals;
    for (int le = 0; le < El_; ++le)
      if (moe_tile_rows(l[le], q_.tile_rows) == 0) {
        r.raise(me, sg[pl_.s_g1 + uint32_t(le)]);
        r.raise(me, sg[pl_.s_packed]);
      }
    r.raise(me, sg[pl_.s_laid]);
    return true;
  }

  bool unpack(comm::Replay& r, int me, int s, int chunk) {
    const uint8_t* slot =
        r.mem(me, comm::BufRef{MoeBuf::kRecv, me, uint64_t(s) * uint64_t(g_.slot_bytes)}, uint64_t(g_.slot_bytes));
    int32_t* l = lay(r, me);
    uint8_t* rx = r.mem(me, comm::BufRef{MoeLayerBuf::kRecvX, me, 0}, uint64_t(g_.recv_rows * g_.row_bytes));
    if (!slot || !l || !rx) return false;
    if (!layout_sane(r, l)) return false;
    uint32_t nrec;
    memcpy(&nrec, slot + 8, 4);
    if (nrec > uint32_t(g_.T)) return r.fail("the slot of source " + std::to_string(s) + " is not there");
    const uint32_t per = uint32_t((g_.T + q_.unpack_chunks - 1) / q_.unpack_chunks), j0 = uint32_t(chunk) * per,
                   j1 = j0 + per;
    // Records read before they landed hold poison: their expert indexes are out of range.
    for (uint32_t j = j0; j < std::min(nrec, j1); ++j) {
      const uint8_t* meta = slot + g_.hdr_bytes + int64_t(j) * g_.rec_bytes + g_.row_bytes;
      for (int kk = 0; kk < g_.k; ++kk) {
        int32_t le, er;
        memcpy(&le, meta + 4 * (kMetaSlots + 2 * kk), 4);
        memcpy(&er, meta + 4 * (kMetaSlots + 2 * kk + 1), 4);
        if (le < -1 || le >= El_ || (le >= 0 && (er < 0 || er >= g_.recv_rows)))
          return r.fail("a record of source " + std::to_string(s) + " read before it landed");
      }
    }
    if (unpack_source(g_, slot, base(l) + s * El_, reinterpret_cast<uint16_t*>(rx), back(l), j0, j1) != 0)
      return r.fail("rows past the receive buffer");
    r.raise(me, p_.ranks[size_t(me)].signals[pl_.s_unpacked + uint32_t(s)]);
    return true;
  }

  // A unit past the static ones, once the layout is there: its item, and what that item waits for.
  bool draw(comm::Replay& r, int me, size_t u) {
    int32_t* l = lay(r, me);
    if (!l) return false;
    if (!layout_sane(r, l)) return false;
    std::vector<int32_t> prefix(size_t(El_ + 1));
    moe_layer_tile_prefix(q_, l, prefix.data());
    const MoeLayerItem m = moe_layer_item(q_, prefix.data(), int64_t(u));
    auto& entry = items_[{me, u}];
    entry.first = m;
    std::vector<comm::Wait>& w = entry.second;
    w.clear();
    const auto& pw = p_.ranks[size_t(me)].waits;
    if (m.kind == kMoeItemGemm1) {
      const Tile t = tile_of(l, m, kInter, q_.tiles_n1);
      for (int s = 0; s < W_; ++s)
        if (moe_tile_has_source(base(l), W_, El_, m.a, offsets(l)[m.a] + l[m.a], t.r0, t.r1, s))
          w.push_back(pw[pl_.unpacked + uint32_t(s)]);
    } else if (m.kind == kMoeItemGemm2) {
      w.push_back(pw[pl_.g1 + uint32_t(m.a)]);
    } else if (m.kind == kMoeItemCombine) {
      w.assign(pw.begin() + pl_.packed, pw.begin() + pl_.packed + W_);  // packed, then carrived
    }
    return true;
  }
  // A finished tile of expert le: the last of its tiles raises the expert's signal.
  void tile_done(comm::Replay& r, int me, int32_t* l, int le, int gemm) {
    const int tiles = moe_tile_rows(l[le], q_.tile_rows) * (gemm == 0 ? q_.tiles_n1 : q_.tiles_n2);
    if (moe_tile_raises(tiles, ++tiles_done(l, gemm)[le]))
      r.raise(me, p_.ranks[size_t(me)].signals[gemm == 0 ? pl_.s_g1 + uint32_t(le) : pl_.s_packed]);
  }
  bool gemm1(comm::Replay& r, int me, const MoeLayerItem& m) {
    int32_t* l = lay(r, me);
    const uint8_t* rx = r.mem(me, comm::BufRef{MoeLayerBuf::kRecvX, me, 0}, uint64_t(g_.recv_rows * g_.row_bytes));
    uint8_t* act = r.mem(me, comm::BufRef{MoeLayerBuf::kAct, me, 0}, uint64_t(g_.recv_rows * kInter * 2));
    if (!l || !rx || !act) return false;
    const Tile t = tile_of(l, m, kInter, q_.tiles_n1);
    for (int64_t row = t.r0; row < t.r1; ++row)
      expert_up(reinterpret_cast<const uint16_t*>(rx + row * g_.row_bytes), g_.H, me * El_ + m.a, t.c0, t.c1,
                reinterpret_cast<uint16_t*>(act + row * kInter * 2));
    tile_done(r, me, l, m.a, 0);
    return true;
  }
  bool gemm2(comm::Replay& r, int me, const MoeLayerItem& m) {
    int32_t* l = lay(r, me);
    const uint8_t* act = r.mem(me, comm::BufRef{MoeLayerBuf::kAct, me, 0}, uint64_t(g_.recv_rows * kInter * 2));
    uint8_t* y = r.mem(me, comm::BufRef{MoeLayerBuf::kY, me, 0}, uint64_t(g_.recv_rows * g_.row_bytes));
    if (!l || !act || !y) return false;
    if (!layout_sane(r, l)) return false;
    const Tile t = tile_of(l, m, g_.H, q_.tiles_n2);
    for (int64_t row = t.r0; row < t.r1; ++row) {
      uint16_t* yr = reinterpret_cast<uint16_t*>(y + row * g_.row_bytes);
      expert_down(reinterpret_cast<const uint16_t*>(act + row * kInter * 2), g_.H, me * El_ + m.a, t.c0, t.c1, yr);
      const int32_t src = back(l)[2 * row], cpos = back(l)[2 * row + 1];
      if (src < 0 || src >= W_ || cpos < 0 || cpos >= g_.comb_per_src)
        return r.fail("row " + std::to_string(row) + " has no way back (unpacked after the GEMM?)");
      if (src == me) continue;  // combine reads the own tokens' rows in y
      // The tile's columns of the row, straight into the combine slot of its token's rank.
      uint8_t* dst = r.mem(me,
                           comm::BufRef{MoeLayerBuf::kCSend, me,
                                        uint64_t(src) * uint64_t(g_.cslot_bytes) + uint64_t(g_.chdr_bytes) +
                                            uint64_t(cpos) * uint64_t(g_.row_bytes) + uint64_t(2 * t.c0)},
                           uint64_t(2 * (t.c1 - t.c0)));
      if (!dst) return false;
      memcpy(dst, yr + t.c0, size_t(2 * (t.c1 - t.c0)));
    }
    tile_done(r, me, l, m.a, 1);
    return true;
  }
  bool combine(comm::Replay& r, int me, int chunk) {
    World wd;
    world(r.epoch(me), &wd);
    int32_t* l = lay(r, me);
    const uint8_t* y = r.mem(me, comm::BufRef{MoeLayerBuf::kY, me, 0}, uint64_t(g_.recv_rows * g_.row_bytes));
    uint8_t* out = r.mem(me, comm::BufRef{MoeLayerBuf::kOut, me, 0}, uint64_t(g_.T * g_.row_bytes));
    if (!l || !y || !out) return false;
    if (!layout_sane(r, l)) return false;
    // The own tokens' rows in y: where unpack put them (back: source me, combine row).
    std::map<int32_t, int64_t> own;
    for (int64_t row = 0; row < offsets(l)[El_]; ++row)
      if (back(l)[2 * row] == me) own[back(l)[2 * row + 1]] = row;
    const int64_t H = g_.H;
    const int64_t per = (g_.T + q_.combine_chunks - 1) / q_.combine_chunks;
    for (int64_t t = chunk * per; t < std::min<int64_t>(wd.n[size_t(me)], (chunk + 1) * per); ++t) {
      std::vector<uint64_t> acc(size_t(H), 0);
      for (int kk = 0; kk < g_.k; ++kk) {
        const int32_t ex = wd.ids[size_t(me)][size_t(t * g_.k + kk)];
        if (ex < 0) continue;
        const int rk = ex / El_;
        const int32_t cpos = wd.routes[size_t(me)].cpos[size_t(t * g_.k + kk)];
        const uint8_t* row;
        if (rk == me) {
          auto it = own.find(cpos);
          if (it == own.end()) return r.fail("token " + std::to_string(t) + ": its own row is not in the layout");
          row = y + it->second * g_.row_bytes;
        } else {
          row = r.mem(me,
                      comm::BufRef{MoeLayerBuf::kCRecv, me,
                                   uint64_t(rk) * uint64_t(g_.cslot_bytes) + uint64_t(g_.chdr_bytes) +
                                       uint64_t(cpos) * uint64_t(g_.row_bytes)},
                      uint64_t(g_.row_bytes));
          if (!row) return false;
        }
        for (int64_t h = 0; h < H; ++h) {
          uint16_t v;
          memcpy(&v, row + 2 * h, 2);
          acc[size_t(h)] += weight_of(t, kk, ex) * v;
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const uint16_t v = lo16(acc[size_t(h)]);
        memcpy(out + t * g_.row_bytes + 2 * h, &v, 2);
      }
    }
    return true;
  }

  const comm::Program& p_;
  LayerCase c_;
  uint64_t seed_;
  MoeGeometry g_;
  int W_ = 1, El_ = 1, P_ = 1, CP_ = 1;
  int64_t body_ = 0;
  MoeLayerPools pl_;
  MoeLayerQueue q_;
  size_t S_ = 0, U_ = 0;  // static units; all units
  std::vector<std::vector<std::vector<comm::Wait>>> waits_;  // [rank][static unit, then the later units' first phase]
  // (rank, unit) -> its item and the waits of its second phase, once drawn.
  std::map<std::pair<int, size_t>, std::pair<MoeLayerItem, std::vector<comm::Wait>>> items_;
};

void build(const LayerCase& c, comm::Program* p) {
  MoeGeometry g;
  ASSERT_TRUE(moe_geometry(cfg_of(c), c.W, &g).ok());
  ASSERT_TRUE(build_moe_layer_program(layout_of(c), g, kInter, c.pieces, c.chunks, c.staged, p).ok());
}
std::vector<const comm::RankProgram*> programs(const comm::Program& p) {
  std::vector<const comm::RankProgram*> v;
  for (const auto& r : p.ranks) v.push_back(&r);
  return v;
}
// The flag accounting, the units' pools included.
std::string layer_static(const comm::Program& p, int El, int chunks) {
  std::vector<comm::ComputeRaise> raises;
  std::vector<comm::ComputeWait> waits;
  for (int r = 0; r < p.layout.world; ++r) {
    const MoeLayerPools pl = moe_layer_pools(p.layout.world, El);
    const auto& sg = p.ranks[size_t(r)].signals;
    for (uint32_t i = 0; i < sg.size(); ++i)
      raises.push_back({r, sg[i],
                        i == pl.s_packed                                           ? uint64_t(El)
                        : i >= pl.s_unpacked && i < pl.s_unpacked + uint32_t(p.layout.world) ? uint64_t(chunks)
                                                                                   : 1,
                        "layer unit"});
    for (const auto& w : p.ranks[size_t(r)].waits) waits.push_back({r, w, "layer unit"});
  }
  return comm::check_static(p, programs(p), raises, waits);
}
std::string replay(const comm::Program& p, const LayerCase& c, const comm::ReplayOptions& o) {
  LayerCompute compute(p, c, o.seed);
  comm::Replay rep(p, programs(p), &compute, o);
  return rep.run() ? "" : rep.error();
}
uint64_t seed_of(const LayerCase& c, uint64_t salt) {
  return test::mix(test::mix(test::test_seed(), std::hash<std::string>{}(name_of(c))), salt);
}

TEST(MoeLayerProgram, BadGeometryIsRefused) {
  const LayerCase c{2, 1};
  MoeGeometry g;
  ASSERT_TRUE(moe_geometry(cfg_of(c), 2, &g).ok());
  comm::Program p;
  EXPECT_FALSE(build_moe_layer_program(comm::Layout::uniform(4, 1), g, kInter, 1, 1, false, &p).ok());  // world 4, geometry 2
  EXPECT_FALSE(build_moe_layer_program(comm::Layout::uniform(2, 1), g, 0, 1, 1, false, &p).ok());
  EXPECT_FALSE(build_moe_layer_program(comm::Layout::uniform(2, 1), g, kInter, 0, 1, false, &p).ok());
  EXPECT_FALSE(build_moe_layer_program(comm::Layout::uniform(2, 1), g, kInter, 1, 0, false, &p).ok());
  EXPECT_TRUE(build_moe_layer_program(comm::Layout::uniform(2, 1), g, kInter, 1, 1, false, &p).ok());
}

// The queue: every unit of a call exactly once, in the order the protocol needs (layout, unpack,
// every tile of the first GEMM, every tile of the second, combine), an expert's items contiguous
// with tile rows fastest; nothing past the end.
TEST(MoeLayerQueue, EveryItemOnceInOrder) {
  for (int El : {1, 2, 5})
    for (const std::vector<int32_t>& counts_of :
         {std::vector<int32_t>{0, 0, 0, 0, 0}, std::vector<int32_t>{1, 128, 129, 0, 300}, std::vector<int32_t>{500, 0, 0, 7, 256}}) {
      MoeLayerQueue q;
      q.W = 3, q.El = El, q.unpack_chunks = 2, q.combine_chunks = 3, q.tile_rows = 128, q.tiles_n1 = 2, q.tiles_n2 = 3;
      std::vector<int32_t> counts(counts_of.begin(), counts_of.begin() + El), prefix(size_t(El + 1));
      moe_layer_tile_prefix(q, counts.data(), prefix.data());
      const int64_t n = moe_layer_items(q, prefix.data());
      std::map<std::tuple<int, int, int, int>, int> seen;
      int last_kind = kMoeItemLayout;
      std::pair<int, int> last_tile{-1, -1};  // (expert, column tile) of the last GEMM item
      int last_row = -1;
      for (int64_t i = 0; i < n; ++i) {
        const MoeLayerItem m = moe_layer_item(q, prefix.data(), i);
        ASSERT_NE(m.kind, kMoeItemNone) << i;
        ASSERT_GE(m.kind, last_kind) << "item " << i << " out of order";
        if (m.kind != last_kind) last_tile = {-1, -1};
        last_kind = m.kind;
        ++seen[{m.kind, m.a, m.b, m.c}];
        if (m.kind == kMoeItemUnpack) {
          ASSERT_LT(m.a, q.W);
          ASSERT_LT(m.b, q.unpack_chunks);
        } else if (m.kind == kMoeItemGemm1 || m.kind == kMoeItemGemm2) {
          ASSERT_LT(m.a, El);
          ASSERT_LT(m.b, moe_tile_rows(counts[size_t(m.a)], q.tile_rows)) << "a tile row past the expert's rows";
          ASSERT_LT(m.c, m.kind == kMoeItemGemm1 ? q.tiles_n1 : q.tiles_n2);
          const std::pair<int, int> t{m.a, m.c};
          if (t == last_tile) ASSERT_EQ(m.b, last_row + 1) << "tile rows fastest";
          else ASSERT_EQ(m.b, 0);
          ASSERT_GE(t, last_tile) << "an expert's items together";
          last_tile = t, last_row = m.b;
        } else if (m.kind == kMoeItemCombine) {
          ASSERT_LT(m.a, q.combine_chunks);
        }
      }
      EXPECT_EQ(moe_layer_item(q, prefix.data(), n).kind, kMoeItemNone);
      EXPECT_EQ(moe_layer_item(q, prefix.data(), -1).kind, kMoeItemNone);
      int64_t tiles = 0;
      for (int32_t c : counts) tiles += moe_tile_rows(c, q.tile_rows);
      EXPECT_EQ(int64_t(seen.size()), n) << "an item twice";
      EXPECT_EQ(n, 1 + q.W * q.unpack_chunks + tiles * (q.tiles_n1 + q.tiles_n2) + q.combine_chunks);
    }
}

TEST(MoeLayerProgram, PoolsArePlacedAsDeclared) {
  for (int W : {1, 2, 3, 4, 8})
    for (int nodes : {1, 2}) {
      if (W % nodes) continue;
      const LayerCase c{W, nodes};
      comm::Program p;
      ASSERT_NO_FATAL_FAILURE(build(c, &p));
      const MoeLayerPools pl = moe_layer_pools(W, 2);
      for (int me = 0; me < W; ++me) {
        const auto& rp = p.ranks[size_t(me)];
        ASSERT_EQ(rp.waits.size(), pl.waits);
        ASSERT_EQ(rp.signals.size(), pl.signals);
        for (int d = 1; d < W; ++d) {
          const uint32_t s = uint32_t((me + d) % W);
          EXPECT_EQ(rp.waits[pl.hdr + uint32_t(d - 1)].flag.region, MoeLayerRegion::kHdr);
          EXPECT_EQ(rp.waits[pl.hdr + uint32_t(d - 1)].flag.index, s);
          EXPECT_EQ(rp.waits[pl.arrived + uint32_t(d - 1)].flag.region, MoeRegion::kArrived);
          EXPECT_EQ(rp.waits[pl.arrived + uint32_t(d - 1)].flag.index, s);
          EXPECT_EQ(rp.waits[pl.carrived + uint32_t(d - 1)].flag.region, MoeLayerRegion::kCArrived);
          EXPECT_EQ(rp.waits[pl.carrived + uint32_t(d - 1)].flag.index, s);
        }
        EXPECT_EQ(rp.waits[pl.laid].flag.region, MoeLayerRegion::kLaid);
        EXPECT_EQ(rp.waits[pl.packed].flag.region, MoeLayerRegion::kPacked);
        EXPECT_EQ(rp.waits[pl.packed].mul, 2u);
        for (int s = 0; s < W; ++s) {
          EXPECT_EQ(rp.waits[pl.unpacked + uint32_t(s)].flag.index, uint32_t(s));
          EXPECT_EQ(rp.signals[pl.s_unpacked + uint32_t(s)].flag.index, uint32_t(s));
        }
        for (uint32_t le = 0; le < 2; ++le) {
          EXPECT_EQ(rp.waits[pl.g1 + le].flag.region, MoeLayerRegion::kG1Done);
          EXPECT_EQ(rp.signals[pl.s_g1 + le].flag.index, le);
        }
        EXPECT_EQ(W == 1, rp.ops.empty());
      }
    }
}

std::vector<LayerCase> sweep() {
  std::vector<LayerCase> v;
  for (int W : {1, 2, 3, 4, 6, 8})
    for (int nodes : {1, 2, 3, 4}) {
      if (W % nodes) continue;
      for (int strided = 0; strided < (nodes > 1 && W / nodes > 1 ? 2 : 1); ++strided)
        for (int staged = 0; staged < (nodes > 1 ? 2 : 1); ++staged)
          for (int pieces : {1, 3})
            v.push_back(LayerCase{W, nodes, strided == 1, staged == 1, pieces, pieces == 3 ? 3 : 1,
                                  pieces == 3 ? 4 : 1, W % 2 == 0 && pieces == 3 ? 4 : 1, pieces == 3 ? 2 : 1});
    }
  return v;
}

class MoeLayerReplay : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoeLayerReplay, ThreeCallsGiveEveryTokensOutput) {
  const LayerCase c = GetParam();
  comm::Program p;
  ASSERT_NO_FATAL_FAILURE(build(c, &p));
  ASSERT_EQ(layer_static(p, 2, c.chunks), "") << name_of(c);
  for (uint64_t k = 0; k < 6; ++k) {
    const uint64_t seed = seed_of(c, k);
    comm::ReplayOptions o{seed, c.comm_slots, c.compute_slots, 3};
    o.speed_levels = 4;
    ASSERT_EQ(replay(p, c, o), "") << name_of(c) << " replay seed " << seed << " (MK_TEST_SEED=" << test::test_seed()
                                   << " replays it)";
  }
  // The kernel's CTAs taking either kind of work (ReplayOptions::shared_slots): from one CTA doing
  // everything up; none may deadlock, however few CTAs a rank gets.
  for (uint64_t k = 0; k < 8; ++k) {
    const uint64_t seed = seed_of(c, 50 + k);
    comm::ReplayOptions o{seed, 1, 1, 3};
    o.speed_levels = 4;
    o.shared_slots = int(1 + k % 4);
    ASSERT_EQ(replay(p, c, o), "") << name_of(c) << " shared slots " << o.shared_slots << " replay seed " << seed
                                   << " (MK_TEST_SEED=" << test::test_seed() << " replays it)";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, MoeLayerReplay, ::testing::ValuesIn(test::strided(sweep())),
                         [](const ::testing::TestParamInfo<LayerCase>& i) { return name_of(i.param); });

// ---- mutants ----

using Mutant = test::ProgramMutant;

// Every wait and signal of the ops and of the pools dropped (a pool wait: waits for 0; a pool
// signal: adds 0), and the header ops and every slot's first piece moved 16 bytes on. Implied
// (for any number of communication CTAs and compute units; the argument rests on this: a rank's
// call ends only after every other rank's combine slot came back, and a rank sends its combine
// slots only after `packed`, i.e. after every GEMM unit, each after the layout — which read every
// source's header of the call — and after unpacking the sources with rows of its expert, i.e.
// every source with at least one record for it):
//  - the last op's wait for the proxy to have read this call's sources: each put of the call was
//    consumed by its destination before that destination sent its combine slot back (header,
//    records of a destination with rows of ours, combine slots: consumed by the destination's own
//    call), but for record pieces to a destination with none of our rows, which nobody reads
//    (unpack reads only as many records as the header says). The program keeps the wait: the
//    replay delivers each rank's puts in order, a network may not (a late put of this call
//    landing after the next call's);
//  - staged, the entry waits of the network puts (header, records): they write the destination's
//    host mirror, which only its relays read; the header relay of this call ran before its layout,
//    the records relay before its unpack of us — before its combine slot if it had rows of ours;
//    if it had none, a later call's records copied in by a late relay are never read (this call's
//    header, in the receive slot, says no records). On the node (and across nodes direct) the
//    puts write the receive slot itself, which unpack reads, and the waits are caught.
std::vector<Mutant> mutants(const comm::Program& p, const MoeGeometry& g) {
  std::vector<Mutant> ms;
  for (int r = 0; r < p.layout.world; ++r) {
    const auto& ops = p.ranks[size_t(r)].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      const comm::Op& op = ops[i];
      const std::string site = "rank " + std::to_string(r) + " op " + std::to_string(i) + " (" + op.what + ")";
      for (size_t j = 0; j < op.waits.size(); ++j) {
        const comm::RegionId rg = op.waits[j].flag.region;
        const bool implied = rg == MoeRegion::kSrcFree || (rg == MoeRegion::kEntryNet && p.net_staged);
        ms.push_back({site + ": drop wait " + std::to_string(j),
                      [=](comm::Program& m) { auto& v = m.ranks[size_t(r)].ops[i].waits; v.erase(v.begin() + long(j)); },
                      implied});
      }
      for (size_t j = 0; j < op.signals.size(); ++j)
        ms.push_back({site + ": drop signal " + std::to_string(j), [=](comm::Program& m) {
                        auto& v = m.ranks[size_t(r)].ops[i].signals;
                        v.erase(v.begin() + long(j));
                      }});
      const bool moves = op.kind == comm::OpKind::kCopy || op.kind == comm::OpKind::kNetPut;
      const uint64_t off = moves ? op.dsts[0].offset : 1;
      const bool first = moves && op.bytes != 8 &&
                         (op.dsts[0].buf == MoeLayerBuf::kCRecv || op.dsts[0].buf == MoeLayerBuf::kCRecvNet
                              ? off % uint64_t(g.cslot_bytes) == 0
                              : off % uint64_t(g.slot_bytes) == 0 || off % uint64_t(g.slot_bytes) == uint64_t(g.hdr_bytes));
      if (first)
        ms.push_back({site + ": destination 16 bytes on",
                      [=](comm::Program& m) { m.ranks[size_t(r)].ops[i].dsts[0].offset += 16; }});
    }
    for (size_t j = 0; j < p.ranks[size_t(r)].waits.size(); ++j)
      ms.push_back({"rank " + std::to_string(r) + " pool wait " + std::to_string(j) + ": waits for 0",
                    [=](comm::Program& m) { m.ranks[size_t(r)].waits[j].mul = 0; }});
    for (size_t j = 0; j < p.ranks[size_t(r)].signals.size(); ++j)
      ms.push_back({"rank " + std::to_string(r) + " pool signal " + std::to_string(j) + ": adds 0",
                    [=](comm::Program& m) { m.ranks[size_t(r)].signals[j].value = 0; }});
  }
  return ms;
}

class MoeLayerMutation : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoeLayerMutation, EveryMutantIsRejected) {
  const LayerCase c = GetParam();
  comm::Program p;
  ASSERT_NO_FATAL_FAILURE(build(c, &p));
  MoeGeometry g;
  ASSERT_TRUE(moe_geometry(cfg_of(c), c.W, &g).ok());
  auto reject = [&](const comm::Program& m, uint64_t k) {
    const std::string why = k == 0 ? layer_static(m, g.El, c.chunks) : "";
    return why.empty() ? replay(m, c, test::mutant_replay(seed_of(c, 100 + k), c.comm_slots, c.compute_slots, k)) : why;
  };
  EXPECT_GT(test::rejected_mutants(p, test::strided(mutants(p, g)), name_of(c), reject), 0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeLayerMutation,
                         ::testing::Values(LayerCase{3, 1, false, false, 1, 1, 1, 1, 2},
                                           LayerCase{2, 2, false, false, 1, 1, 2, 1, 1},
                                           LayerCase{2, 2, false, true, 2, 1, 1, 1, 2},
                                           LayerCase{4, 2, true, true, 1, 1, 2, 2, 1}),
                         [](const ::testing::TestParamInfo<LayerCase>& i) { return name_of(i.param); });

}  // namespace
}  // namespace ops
}  // namespace mk
