// Tiles written into other ranks' symmetric memory (processes under MPS), with per-tile flags
// in the receiver's signal pad that the receiver's kernel waits on: the GEMM's TMA stores into
// a peer's buffer, and fp32 reduce-adds of every rank into one owner (a plain test kernel, the
// pattern of the fused operators' routed epilogue).
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <random>

#include "mkernel/common/check.h"
#include "mkernel/device/signal.cuh"
#include "mkernel/gemm/gemm.h"
#include "tests/gpu/mpi_fixture.h"
#include "tests/gpu/test_kernels.cuh"

namespace mk {
namespace test {
namespace {

constexpr int64_t M = 640, N = 776, K = 136;  // off the 128 x 256 x 64 tile

// Rank r's operands: small integers from a seed shared by all ranks.
void operands(uint64_t seed, int r, std::vector<__nv_bfloat16>* A, std::vector<__nv_bfloat16>* B) {
  std::mt19937_64 rng(seed ^ (uint64_t(r + 1) * 0x9e3779b97f4a7c15ull));
  std::uniform_int_distribution<int> d(-2, 2);
  A->resize(M * K);
  B->resize(N * K);
  for (auto& x : *A) x = __float2bfloat16(float(d(rng)));
  for (auto& x : *B) x = __float2bfloat16(float(d(rng)));
}
std::vector<float> product(const std::vector<__nv_bfloat16>& A, const std::vector<__nv_bfloat16>& B) {
  std::vector<float> P(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += __bfloat162float(A[m * K + k]) * __bfloat162float(B[n * K + k]);
      P[m * N + n] = acc;
    }
  return P;
}

// The receiver's kernel: waits (bounded, via the communicator's wait context) for every
// tile's flag to reach `expected`, then copies the tile (fp32 or bf16 as floats).
__global__ void wait_and_snapshot(SignalView flags, WaitCtx ctx, const void* C, bool f32, float* snap,
                                  int tiles_m, int tiles, uint64_t expected) {
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    if (threadIdx.x == 0) device::wait_ge(ctx, &flags.local[t], expected, -1, t);
    __syncthreads();
    const int64_t m0 = int64_t(t % tiles_m) * 128, n0 = int64_t(t / tiles_m) * 256;
    for (int i = threadIdx.x; i < 128 * 256; i += blockDim.x) {
      const int64_t m = m0 + i / 256, n = n0 + i % 256;
      if (m >= M || n >= N) continue;
      snap[m * N + n] = f32 ? reinterpret_cast<const volatile float*>(C)[m * N + n]
                            : __bfloat162float(const_cast<const __nv_bfloat16*>(
                                  reinterpret_cast<const volatile __nv_bfloat16*>(C))[m * N + n]);
    }
    __syncthreads();
  }
}

class GemmPeer : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = shared_comm();
    ASSERT_NE(comm, nullptr);
  }
  Communicator* comm = nullptr;
};

// Every rank stores its product into the next rank's buffer and raises that rank's flags;
// every rank checks what its predecessor sent, tile by tile as the flags rise.
TEST_F(GemmPeer, StoreIntoTheNextRank) {
  const int W = comm->world(), me = comm->rank(), next = (me + 1) % W, prev = (me + W - 1) % W;
  if (comm->topology().path[next] == PeerPath::kNetwork) GTEST_SKIP() << "next rank on another node";
  const uint64_t seed = test_seed();
  std::vector<__nv_bfloat16> A, B, pA, pB;
  operands(seed, me, &A, &B);
  operands(seed, prev, &pA, &pB);
  const std::vector<float> want = product(pA, pB);
  const gemm::TileCount tc = gemm::tile_count(M, N);
  SymmetricBuffer *C, *flags;
  MK_ASSERT_OK(comm->heap().alloc(M * N * 2, &C));
  MK_ASSERT_OK(comm->alloc_signals(tc.total(), &flags));
  cudaMemset(C->local(), 0xff, M * N * 2);
  void *dA, *dB;
  float* snap;
  cudaMalloc(&dA, A.size() * 2);
  cudaMalloc(&dB, B.size() * 2);
  cudaMalloc(&snap, M * N * 4);
  cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dB, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  MK_ASSERT_OK(comm->bootstrap().barrier());
  // Load the GEMM kernel before any kernel waits on it: with CUDA's lazy module loading,
  // loading a kernel waits for the running ones, and the watcher below waits for the GEMM.
  int resident = 0;
  MK_ASSERT_OK(gemm::persistent_ctas(&resident));
  cudaStream_t ws;
  cudaStreamCreateWithFlags(&ws, cudaStreamNonBlocking);
  wait_and_snapshot<<<2, 256, 0, ws>>>(flags->signal_view(), comm->wait_ctx(OpTag::kSignalTest, Role::kComm),
                                       C->local(), false, snap, tc.m, tc.total(), 1);
  gemm::Arguments args;
  args.A = dA;
  args.B = dB;
  args.C = C->peer(next);
  args.M = M;
  args.N = N;
  args.K = K;
  args.tile_flags = static_cast<uint64_t*>(flags->peer(next));
  gemm::RunConfig rc;
  rc.max_ctas = resident - 2;
  MK_ASSERT_OK(gemm::run(args, comm->stream(), rc));
  MK_ASSERT_OK(comm->sync(comm->stream()));
  MK_ASSERT_OK(comm->sync(ws));
  std::vector<float> got(M * N);
  cudaMemcpy(got.data(), snap, M * N * 4, cudaMemcpyDeviceToHost);
  int64_t bad = 0;
  for (int64_t i = 0; i < M * N; ++i) bad += got[i] != __bfloat162float(__float2bfloat16(want[i]));
  EXPECT_EQ(bad, 0) << "rank " << me << ": elements from rank " << prev << " wrong when their flag rose";
  cudaStreamDestroy(ws);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(snap);
  MK_ASSERT_OK(comm->bootstrap().barrier());
  MK_ASSERT_OK(comm->heap().free(flags));
  MK_ASSERT_OK(comm->heap().free(C));
}

// Every rank reduce-adds its product into rank 0's fp32 buffer and adds 1 to rank 0's tile
// flags (reduce_add_tiles); rank 0 waits for W arrivals per tile and finds the exact sum over
// ranks.
TEST_F(GemmPeer, ReduceAddIntoOneOwner) {
  const int W = comm->world(), me = comm->rank();
  for (int r = 0; r < W; ++r)
    if (comm->topology().path[r] == PeerPath::kNetwork) GTEST_SKIP() << "ranks on several nodes";
  const uint64_t seed = test_seed() + 7;
  std::vector<__nv_bfloat16> A, B;
  operands(seed, me, &A, &B);
  std::vector<float> want(M * N, 0.f);
  if (me == 0)
    for (int r = 0; r < W; ++r) {
      std::vector<__nv_bfloat16> rA, rB;
      operands(seed, r, &rA, &rB);
      const std::vector<float> p = product(rA, rB);
      for (int64_t i = 0; i < M * N; ++i) want[i] += p[i];
    }
  const gemm::TileCount tc = gemm::tile_count(M, N);
  SymmetricBuffer *C, *flags;
  MK_ASSERT_OK(comm->heap().alloc(M * N * 4, &C));
  MK_ASSERT_OK(comm->alloc_signals(tc.total(), &flags));
  cudaMemset(C->local(), 0, M * N * 4);
  void *dA, *dB;
  float* snap;
  cudaMalloc(&dA, A.size() * 2);
  cudaMalloc(&dB, B.size() * 2);
  cudaMalloc(&snap, M * N * 4);
  cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dB, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  MK_ASSERT_OK(comm->bootstrap().barrier());
  // Load the writer before any kernel waits on it (lazy loading, see above).
  cudaFuncAttributes fa;
  ASSERT_EQ(cudaFuncGetAttributes(&fa, reduce_add_tiles), cudaSuccess);
  cudaStream_t ws;
  cudaStreamCreateWithFlags(&ws, cudaStreamNonBlocking);
  if (me == 0)
    wait_and_snapshot<<<2, 256, 0, ws>>>(flags->signal_view(), comm->wait_ctx(OpTag::kSignalTest, Role::kComm),
                                         C->local(), true, snap, tc.m, tc.total(), uint64_t(W));
  reduce_add_tiles<<<16, 256, 0, comm->stream()>>>(static_cast<const __nv_bfloat16*>(dA),
                                                   static_cast<const __nv_bfloat16*>(dB),
                                                   static_cast<float*>(C->peer(0)), M, N, K,
                                                   static_cast<uint64_t*>(flags->peer(0)));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  MK_ASSERT_OK(comm->sync(comm->stream()));
  MK_ASSERT_OK(comm->sync(ws));
  if (me == 0) {
    std::vector<float> got(M * N);
    cudaMemcpy(got.data(), snap, M * N * 4, cudaMemcpyDeviceToHost);
    int64_t bad = 0;
    for (int64_t i = 0; i < M * N; ++i) bad += got[i] != want[i];
    EXPECT_EQ(bad, 0) << "sum over " << W << " ranks wrong when the tile's count reached " << W;
  }
  cudaStreamDestroy(ws);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(snap);
  MK_ASSERT_OK(comm->bootstrap().barrier());
  MK_ASSERT_OK(comm->heap().free(flags));
  MK_ASSERT_OK(comm->heap().free(C));
}

}  // namespace
}  // namespace test
}  // namespace mk
