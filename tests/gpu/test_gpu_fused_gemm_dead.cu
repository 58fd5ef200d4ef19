// A rank that stops taking part: the others' fused call fails with a bounded-wait error that
// names it, instead of hanging — and the process lives on: its kernel left through the abort
// word instead of trapping, so the same process then runs a cuBLAS GEMM, destroys the failed
// communicator, creates a new one and runs a fresh fused call that is checked element by
// element. Run with MK_SIGNAL_TIMEOUT_MS small.
#include <gtest/gtest.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/ops/fused.h"
#include "mkernel/runtime/bootstrap_mpi.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

// A [rows, cols] bf16 matrix of value v.
std::vector<__nv_bfloat16> filled(int64_t rows, int64_t cols, float v) {
  return std::vector<__nv_bfloat16>(size_t(rows * cols), __float2bfloat16(v));
}

TEST(FusedDeadRank, SilentRankIsNamedAndTheProcessRecovers) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world(), me = comm->rank();
  ASSERT_GE(W, 2) << "registered at 2 ranks and more";
  const int silent = W - 1;
  // One shard per tile-row, so every wait on the silent rank's rows names it.
  const int64_t M = int64_t(W) * 256, N = 512, K = 256;
  std::unique_ptr<ops::FusedGemm> op;
  MK_ASSERT_OK(ops::FusedGemm::create(comm, ops::FusedKind::kAgGemm, {M, N, K}, {}, &op));
  void *A = nullptr, *B = nullptr, *C = nullptr;
  ASSERT_EQ(cudaMalloc(&A, (M / W) * K * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&B, N * K * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&C, M * N * 2), cudaSuccess);
  {
    // A shard of rank r holds r + 1 everywhere, B holds 1: C[m][n] = (owner of m + 1) * K.
    auto a = filled(M / W, K, float(me + 1)), b = filled(N, K, 1.f);
    ASSERT_EQ(cudaMemcpy(A, a.data(), a.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(B, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    // A pageable cudaMemcpy may return before its DMA lands; the call's stream is non-blocking.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  if (me != silent) {
    ops::FusedArgs a;
    a.A = A;
    a.B = B;
    a.C = C;
    MK_ASSERT_OK(op->enqueue(a, comm->stream()));
    expect_silent_rank_named(comm, "ag_gemm", silent);
    EXPECT_FALSE(comm->check().ok());
    // A failed communicator runs nothing more, with a message that says so.
    Status again = op->enqueue(a, comm->stream());
    EXPECT_FALSE(again.ok());
    printf("rank %d: a call after the failure: %s\n", me, again.to_string().c_str());
    // The CUDA context survived: a cuBLAS GEMM runs and is right.
    cublasHandle_t h;
    ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    const float one = 1.f, zero = 0.f;
    ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M / W), int(K), &one, B, CUDA_R_16BF, int(K), A,
                           CUDA_R_16BF, int(K), &zero, C, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
    std::vector<__nv_bfloat16> c(size_t(M / W) * N);
    ASSERT_EQ(cudaMemcpy(c.data(), C, c.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t bad = 0;
    for (auto x : c) bad += __bfloat162float(x) != float((me + 1) * K);
    EXPECT_EQ(bad, 0) << "cuBLAS after the failed call";
    cublasDestroy(h);
  }
  // Everyone: destroy the operator and the failed communicator, then a new one.
  MK_EXPECT_OK(op->destroy());
  op.reset();
  {
    Status s = shared_comm_slot()->destroy();
    if (!s.ok()) printf("rank %d: teardown of the failed communicator: %s\n", me, s.to_string().c_str());
    shared_comm_slot().reset();
  }
  std::unique_ptr<Bootstrap> bs;
  MK_ASSERT_OK(make_mpi_bootstrap(MPI_COMM_WORLD, &bs));
  std::unique_ptr<Communicator> fresh;
  CommConfig cfg;
  cfg.require_gpu = true;
  MK_ASSERT_OK(Communicator::create(std::move(bs), cfg, &fresh));
  MK_ASSERT_OK(ops::FusedGemm::create(fresh.get(), ops::FusedKind::kAgGemm, {M, N, K}, {}, &op));
  ops::FusedArgs a;
  a.A = A;
  a.B = B;
  a.C = C;
  ASSERT_EQ(cudaMemset(C, 0xff, M * N * 2), cudaSuccess);  // NaN everywhere
  MK_ASSERT_OK(op->run(a, fresh->stream()));
  MK_ASSERT_OK(fresh->sync(fresh->stream()));
  MK_ASSERT_OK(fresh->check());
  std::vector<__nv_bfloat16> c(size_t(M) * N);
  ASSERT_EQ(cudaMemcpy(c.data(), C, c.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int64_t bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) bad += __bfloat162float(c[m * N + n]) != float((m / (M / W) + 1) * K);
  EXPECT_EQ(bad, 0) << "rank " << me << ": the fresh call after recovery";
  printf("rank %d: fresh communicator and call after the failure: %lld wrong elements\n", me, (long long)bad);
  MK_EXPECT_OK(op->destroy());
  MK_EXPECT_OK(fresh->destroy());
  cudaFree(A);
  cudaFree(B);
  cudaFree(C);
}

}  // namespace
}  // namespace test
}  // namespace mk
