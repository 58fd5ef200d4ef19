// MoE dispatch/combine: geometry and routing rules (see src/ops/moe/moe_plan.h).
#include "src/ops/moe/moe_plan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "mkernel/common/check.h"

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

void layout_from_headers(const MoeGeometry& g, const std::vector<const uint8_t*>& headers, int32_t* counts,
                         int32_t* offsets, int32_t* base) {
  std::vector<int32_t> c(size_t(g.W) * g.El);
  for (int s = 0; s < g.W; ++s) std::memcpy(&c[size_t(s) * g.El], headers[s] + 16, 4 * size_t(g.El));
  offsets[0] = 0;
  for (int le = 0; le < g.El; ++le) {
    int64_t sum = 0;
    for (int s = 0; s < g.W; ++s) sum += c[size_t(s) * g.El + le];
    counts[le] = int32_t(sum);
    offsets[le + 1] = offsets[le] + int32_t(round_up(sum, g.align));
  }
  for (int le = 0; le < g.El; ++le) {
    int64_t row = offsets[le];
    for (int s = 0; s < g.W; ++s) {
      base[size_t(s) * g.El + le] = int32_t(row);
      row += c[size_t(s) * g.El + le];
    }
  }
}

int64_t unpack_source(const MoeGeometry& g, const uint8_t* slot, const int32_t* base_s, uint16_t* recv_x,
                      int32_t* back, uint32_t first, uint32_t end) {
  int64_t over = 0;
  uint32_t nrec;
  std::memcpy(&nrec, slot + 8, 4);
  std::vector<int32_t> meta(size_t(g.meta_bytes / 4));
  for (uint32_t j = first; j < std::min(nrec, end); ++j) {
    const uint8_t* rec = slot + g.hdr_bytes + int64_t(j) * g.rec_bytes;
    std::memcpy(meta.data(), rec + g.row_bytes, size_t(g.meta_bytes));
    int32_t ord = 0;
    for (int kk = 0; kk < g.k; ++kk) {
      const int32_t le = meta[kMetaSlots + 2 * kk];
      if (le < 0) continue;
      const int64_t row = int64_t(base_s[le]) + meta[kMetaSlots + 2 * kk + 1];
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
  return over;
}

void unpack_slots(const MoeGeometry& g, int r, const std::vector<const uint8_t*>& slots, uint16_t* recv_x,
                  int32_t* counts, int32_t* offsets, int32_t* back, int64_t* overflow) {
  (void)r;
  std::vector<int32_t> base(size_t(g.W) * g.El);
  layout_from_headers(g, slots, counts, offsets, base.data());
  int64_t over = 0;
  for (int s = 0; s < g.W; ++s) over += unpack_source(g, slots[s], &base[size_t(s) * g.El], recv_x, back);
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

}  // namespace ops
}  // namespace mk
