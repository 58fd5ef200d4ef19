// Communication programs (see src/comm/program.h).
#include "src/comm/program.h"

namespace mk {
namespace ops {

PlanLayout PlanLayout::uniform(int world, int nodes) {
  PlanLayout l;
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

}  // namespace ops
}  // namespace mk
