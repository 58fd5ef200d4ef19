// mkernel — communication programs (host code, no CUDA): the layout of ranks on nodes that
// every operator's program is built for.
#pragma once

#include <vector>

namespace mk {
namespace ops {

// Which ranks share a node. Ranks of a node may be any set; `node_ranks[n][l]` is the rank with
// local index l on node n.
struct PlanLayout {
  int world = 1;
  std::vector<int> node_of;                  // [world]
  std::vector<int> local_of;                 // [world]
  std::vector<std::vector<int>> node_ranks;  // [nodes][local]
  int nodes() const { return static_cast<int>(node_ranks.size()); }
  int local() const { return node_ranks.empty() ? 0 : static_cast<int>(node_ranks[0].size()); }
  // `nodes` nodes of world / nodes consecutive ranks each.
  static PlanLayout uniform(int world, int nodes);
};

}  // namespace ops
}  // namespace mk
