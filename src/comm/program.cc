// Communication programs (see src/comm/program.h).
#include "src/comm/program.h"

#include <cstdio>

#include "mkernel/common/check.h"

namespace mk {
namespace comm {

Layout Layout::uniform(int world, int nodes) {
  Layout l;
  l.world = world;
  const int per = nodes > 0 ? world / nodes : 0;
  l.node_ranks.assign(nodes, {});
  l.node_of.resize(world);
  l.local_of.resize(world);
  for (int r = 0; r < world; ++r) {
    const int n = per ? r / per : 0;
    l.node_of[r] = n;
    l.local_of[r] = per ? r % per : 0;
    if (n < nodes) l.node_ranks[n].push_back(r);
  }
  return l;
}

Status Layout::check(const char* what) const {
  const int W = world;
  MK_REQUIRE(W >= 1 && int(node_of.size()) == W && int(local_of.size()) == W && nodes() >= 1, Code::kInvalidArgument,
             "%s: malformed layout (world %d)", what, W);
  const int l0 = local();
  for (const auto& nr : node_ranks)
    MK_REQUIRE(int(nr.size()) == l0 && l0 >= 1, Code::kInvalidArgument,
               "%s: every node must hold the same number of ranks (%d vs %d)", what, int(nr.size()), l0);
  MK_REQUIRE(nodes() * l0 == W, Code::kInvalidArgument, "%s: nodes x local != world", what);
  for (int n = 0; n < nodes(); ++n)
    for (int l = 0; l < l0; ++l) {
      const int r = node_ranks[n][l];
      MK_REQUIRE(r >= 0 && r < W && node_of[r] == n && local_of[r] == l, Code::kInvalidArgument,
                 "%s: layout tables disagree about rank %d", what, r);
    }
  return OkStatus();
}

Layout Layout::strided(int world, int nodes) {
  Layout l;
  l.world = world;
  l.node_ranks.assign(nodes, {});
  for (int r = 0; r < world; ++r) {
    l.node_of.push_back(r % nodes);
    l.local_of.push_back(r / nodes);
    l.node_ranks[r % nodes].push_back(r);
  }
  return l;
}

std::vector<int> Layout::node_peers(int me) const {
  const auto& nr = node_ranks[node_of[me]];
  const int n = static_cast<int>(nr.size()), l = local_of[me];
  std::vector<int> out;
  for (int i = 1; i < n; ++i) out.push_back(nr[(l + i) % n]);
  return out;
}

std::vector<int> Layout::twins(int me) const {
  const int n = node_of[me], l = local_of[me], N = nodes();
  std::vector<int> out;
  for (int d = 1; d < N; ++d) out.push_back(node_ranks[(n + d) % N][l]);
  return out;
}

const char* op_kind_name(OpKind k) {
  static const char* n[] = {"copy", "reduce", "net_put", "signal", "zero"};
  return int(k) < 5 ? n[int(k)] : "?";
}

BufId ProgramDecl::add_buf(const BufDecl& d) {
  bufs.push_back(d);
  return BufId(bufs.size() - 1);
}

RegionId ProgramDecl::add_region(const std::string& name, uint32_t size, bool proxy) {
  regions.push_back(RegionDecl{name, size, proxy});
  return RegionId(regions.size() - 1);
}

void ProgramDecl::place_regions() {
  region_offset.assign(regions.size(), 0);
  uint32_t off = 0;
  for (size_t r = 0; r < regions.size(); ++r) {
    region_offset[r] = off;
    off += regions[r].size;
  }
  pad_flags = off;
}

BufId ProgramDecl::mirror(BufId b) const {
  for (size_t i = 0; i < bufs.size(); ++i)
    if (bufs[i].space == Space::kHost && bufs[i].mirror_of == b) return BufId(i);
  return kNoBuf;
}

std::string flag_str(const ProgramDecl& p, const FlagRef& f) {
  return std::string(p.region_name(f.region)) + "[" + std::to_string(f.index) + "]@rank " + std::to_string(f.rank);
}

std::string ref_str(const ProgramDecl& p, const BufRef& b) {
  return std::string(p.buf_name(b.buf)) + "@rank " + std::to_string(b.rank) + "+" + std::to_string(b.offset);
}

std::string describe(const RankProgram& rp) {
  std::string s;
  char line[320];
  for (size_t i = 0; i < rp.ops.size(); ++i) {
    const Op& op = rp.ops[i];
    snprintf(line, sizeof line, "  %3zu %-7s waits %zu signals %zu: %s\n", i, op_kind_name(op.kind), op.waits.size(),
             op.signals.size(), op.what.c_str());
    s += line;
  }
  return s;
}

}  // namespace comm
}  // namespace mk
