// The SM-partition controller's model against the GPU: tests/cpu/plan_sim.h (the fused call on
// every rank of one node, driven by the operator's real plan) with costs fitted to traced calls
// on the H200 (tests/cpu/data/split_calibration_h200.tsv, made by tools/split_calibration.py
// from scripts/device/calibration_check.sh's run).
#include <gtest/gtest.h>

#include <cstdio>

#include "src/comm/program.h"
#include "src/ops/fused_gemm/fused_gemm_plan.h"
#include "tests/cpu/plan_sim.h"

namespace mk {
namespace test {
namespace {

ops::Plan plan_of(ops::FusedKind kind, int W, int64_t M, int64_t N, int64_t K) {
  ops::Plan p;
  const Status s = ops::build_plan(kind, {M, N, K}, comm::Layout::uniform(W, 1), false, &p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return p;
}

// The model itself on cases with known answers.
TEST(PlanSim, KnownAnswers) {
  SimCosts c;
  c.mma_us = 10, c.epi_plain_us = 0, c.epi_routed_us = 0, c.epi_final_us = 0, c.op_fixed_us = 0;
  c.copy_gbps_cta = 1e9, c.copy_gbps_total = 1e9;
  for (auto kind : {ops::FusedKind::kAgGemm, ops::FusedKind::kGemmRs, ops::FusedKind::kGemmAr}) {
    const ops::Plan p = plan_of(kind, 2, 2048, 2048, 512);  // 16 x 8 tiles
    const int tiles = p.tiles_m * p.tiles_n;
    for (int split : {1, 4}) {
      PlanSim sim(p, 9, c);
      const SimResult r = sim.run(split);
      ASSERT_TRUE(r.ok) << r.error;
      EXPECT_EQ(r.tiles, tiles);
      // Free communication: the tiles alone decide, on grid - split CTAs at least and grid at most.
      const double lo = 10.0 * ((tiles + 8) / 9), hi = 10.0 * ((tiles + 9 - split - 1) / (9 - split)) + 1e-6;
      EXPECT_GE(r.kernel_us, lo - 1e-6) << ops::fused_kind_name(kind) << " split " << split;
      EXPECT_LE(r.kernel_us, hi) << ops::fused_kind_name(kind) << " split " << split;
    }
  }
}

TEST(PlanSim, Print) {
  SimCosts c;
  for (auto kind : {ops::FusedKind::kAgGemm, ops::FusedKind::kGemmRs, ops::FusedKind::kGemmAr})
    for (int W : {2, 4}) {
      const ops::Plan p = plan_of(kind, W, 8192, 3584, 4096);
      printf("%s W%d ops %zu:", ops::fused_kind_name(kind), W, p.ranks[0].ops.size());
      for (int split : {1, 2, 4, 8, 16, 24, 32}) {
        PlanSim sim(p, 132 / W, c);
        const SimResult r = sim.run(split);
        if (!r.ok) printf(" %d:%s", split, r.error.c_str());
        else printf(" %d:%.0f", split, r.kernel_us);
      }
      printf("\n");
    }
}

}  // namespace
}  // namespace test
}  // namespace mk
