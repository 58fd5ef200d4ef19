// A rank that stops taking part: the others' fused call fails with a bounded-wait error that
// names it, instead of hanging. The failed kernel traps (its CUDA context is gone), so this
// runs in its own binary. Run with MK_SIGNAL_TIMEOUT_MS small.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <string>

#include "mkernel/common/check.h"
#include "mkernel/ops/fused.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

TEST(FusedDeadRank, SilentRankIsNamed) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world();
  if (W < 2) GTEST_SKIP() << "needs 2 ranks";
  const int silent = W - 1;
  // One shard per tile-row, so every wait on the silent rank's rows names it.
  const int64_t M = int64_t(W) * 256, N = 512, K = 256;
  std::unique_ptr<ops::FusedGemm> op;
  MK_ASSERT_OK(ops::FusedGemm::create(comm, ops::FusedKind::kAgGemm, {M, N, K}, {}, &op));
  void *A = nullptr, *B = nullptr, *C = nullptr;
  ASSERT_EQ(cudaMalloc(&A, (M / W) * K * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&B, N * K * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&C, M * N * 2), cudaSuccess);
  cudaMemset(A, 0x11, (M / W) * K * 2);
  cudaMemset(B, 0x11, N * K * 2);
  if (comm->rank() != silent) {
    ops::FusedArgs a;
    a.A = A;
    a.B = B;
    a.C = C;
    MK_ASSERT_OK(op->enqueue(a, comm->stream()));
    expect_silent_rank_named(comm, "ag_gemm", silent);
  }
  MK_ASSERT_OK(comm->bootstrap().barrier());
  // The trapped contexts cannot free device memory: leave the operator to process exit.
  op.release();
}

}  // namespace
}  // namespace test
}  // namespace mk
