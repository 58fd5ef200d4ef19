// A rank that stops taking part in ring attention: the others' call fails with a bounded-wait
// error that names it, instead of hanging; the kernel leaves without trapping, so the operator
// and the communicator are torn down normally afterwards. Run with MK_SIGNAL_TIMEOUT_MS small,
// at 2 ranks (each wait of the other rank is then on the silent one: its entry flag or its
// block's arrival).
#include <gtest/gtest.h>

#include <string>

#include "mkernel/common/check.h"
#include "mkernel/ops/ring_attention.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

TEST(RingDeadRank, SilentRankIsNamed) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world();
  if (W != 2) GTEST_SKIP() << "needs 2 ranks";
  const int silent = W - 1;
  const ops::RingAttentionShape shape{1, 8, 8, 128, int64_t(W) * 1024, ops::SeqLayout::kZigzag, true};
  std::unique_ptr<ops::RingAttention> op;
  MK_ASSERT_OK(ops::RingAttention::create(comm, shape, {}, &op));
  const size_t elems = size_t(1024) * 8 * 128;
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 4 * elems * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(buf, 0x3c, 4 * elems * 2), cudaSuccess);  // bf16 ~0.01: finite data
  auto* p = static_cast<char*>(buf);
  if (comm->rank() != silent) {
    ops::RingAttentionArgs a{p, p + elems * 2, p + 2 * elems * 2, p + 3 * elems * 2, nullptr};
    MK_ASSERT_OK(op->enqueue(a, comm->stream()));
    expect_silent_rank_named(comm, "ring_attention", silent);
  }
  expect_barrier_reports_failure(comm);
  MK_EXPECT_OK(op->destroy());
  EXPECT_EQ(cudaFree(buf), cudaSuccess);
}

}  // namespace
}  // namespace test
}  // namespace mk
