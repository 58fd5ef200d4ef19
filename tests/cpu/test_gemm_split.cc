// The GEMM's split-K choice (gemm::split_k_for), on the host: it splits only where the tiles
// leave SMs idle, never into ranges of fewer than 4 K slices or more than 16 ranges, and it
// stops splitting where the reduction's traffic costs more than the idle SMs.
#include <gtest/gtest.h>

#include "mkernel/gemm/gemm.h"

namespace mk {
namespace test {
namespace {

constexpr int kCtas = 132;  // an H200's persistent grid

TEST(GemmSplitK, SplitsSkinnyShapesOnly) {
  // 128 x 8192 x 8192: 32 tiles on 132 CTAs, 128 K slices -> split.
  EXPECT_GT(gemm::split_k_for(128, 8192, 8192, kCtas), 1);
  EXPECT_GT(gemm::split_k_for(256, 1024, 8192, kCtas), 1);
  EXPECT_GT(gemm::split_k_for(64, 3584, 8192, kCtas), 1);
  // Enough tiles for every CTA: never.
  EXPECT_EQ(gemm::split_k_for(4096, 4096, 4096, kCtas), 1);
  EXPECT_EQ(gemm::split_k_for(2048, 8192, 3584, kCtas), 1);
  // 128 tiles of 132 CTAs: a second wave costs more than 4 idle SMs.
  EXPECT_EQ(gemm::split_k_for(512, 8192, 8192, kCtas), 1);
  // Short K: nothing to split (fewer than 2 x 4 slices).
  EXPECT_EQ(gemm::split_k_for(128, 1024, 448, kCtas), 1);
  EXPECT_EQ(gemm::split_k_for(1, 8, 8, kCtas), 1);
}

TEST(GemmSplitK, RangesStayWithinBounds) {
  for (int64_t M : {1, 64, 128, 256, 1024})
    for (int64_t N : {8, 256, 1024, 8192})
      for (int64_t K : {64, 512, 4096, 8192, 65536})
        for (int ctas : {8, 66, 132}) {
          const int s = gemm::split_k_for(M, N, K, ctas);
          const int64_t slices = (K + 63) / 64;
          SCOPED_TRACE(testing::Message() << M << " x " << N << " x " << K << " on " << ctas << ": " << s);
          EXPECT_GE(s, 1);
          EXPECT_LE(s, 16);
          if (s > 1) {
            EXPECT_GE(slices / s, 4) << "ranges of fewer than 4 slices";
            const int64_t tiles = ((M + 127) / 128) * ((N + 255) / 256);
            EXPECT_LT(tiles, ctas) << "split although every CTA had a tile";
            EXPECT_LE(size_t(s) * M * N * 4, gemm::split_k_workspace_bytes(M, N, K));
          }
        }
}

TEST(GemmSplitK, BadInputIsNoSplit) {
  EXPECT_EQ(gemm::split_k_for(0, 8192, 8192, kCtas), 1);
  EXPECT_EQ(gemm::split_k_for(128, 8192, 0, kCtas), 1);
  EXPECT_EQ(gemm::split_k_for(128, 8192, 8192, 0), 1);
}

}  // namespace
}  // namespace test
}  // namespace mk
