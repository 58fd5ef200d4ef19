// Device signals between ranks (processes under mpirun; several may share one GPU under MPS):
// ping-pong and all-to-all flag exchanges with data checks, and a CUDA graph of epoch-tagged
// signals replayed 100 times.
#include <gtest/gtest.h>

#include <chrono>

#include "mkernel/common/check.h"
#include "tests/gpu/mpi_fixture.h"
#include "tests/gpu/test_kernels.cuh"

namespace mk {
namespace test {
namespace {

class Signals : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = shared_comm();
    ASSERT_NE(comm, nullptr);
    ASSERT_TRUE(comm->has_gpu());
  }
  Communicator* comm = nullptr;
};

TEST_F(Signals, PingPongWithData) {
  const int W = comm->world(), me = comm->rank();
  // Pairs (0,1), (2,3), ...; an odd last rank sits out (but meets the barriers).
  const int partner = (me % 2 == 0) ? me + 1 : me - 1;
  const bool active = partner < W && comm->topology().path[partner] != PeerPath::kNetwork;
  const uint32_t words = 1000;
  const int rounds = 2000;
  SymmetricBuffer* data = nullptr;
  SymmetricBuffer* flags = nullptr;
  MK_ASSERT_OK(comm->heap().alloc(words * 4, &data));
  MK_ASSERT_OK(comm->alloc_signals(4, &flags));
  fill_u32<<<8, 256, 0, comm->stream()>>>(static_cast<uint32_t*>(data->local()), words, 0xDEADBEEFu);
  MK_ASSERT_OK(comm->sync(comm->stream()));
  MK_ASSERT_OK(comm->bootstrap().barrier());
  BadCounter bad;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  if (active) {
    cudaEventRecord(e0, comm->stream());
    ping_pong<<<1, 256, 0, comm->stream()>>>(data->view(), flags->signal_view(),
                                             comm->wait_ctx(OpTag::kSignalTest, Role::kTest),
                                             partner, rounds, words, test_seed(), bad.d);
    cudaEventRecord(e1, comm->stream());
  }
  MK_ASSERT_OK(comm->sync(comm->stream()));
  EXPECT_EQ(bad.take(), 0ull);
  if (active && me < partner) {
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    printf("rank %d <-> %d: %d round trips with %u words each: %.2f us per round trip\n", me,
           partner, rounds, words, ms * 1000 / rounds);
  }
  // Flags ended at the last round on both sides.
  uint64_t f = 0;
  cudaMemcpy(&f, flags->local(), 8, cudaMemcpyDeviceToHost);
  if (active) EXPECT_EQ(f, uint64_t(rounds));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  MK_ASSERT_OK(comm->bootstrap().barrier());
  MK_ASSERT_OK(comm->heap().free(flags));
  MK_ASSERT_OK(comm->heap().free(data));
}

struct AllToAll {
  Communicator* comm;
  SymmetricBuffer* data = nullptr;
  SymmetricBuffer* flags = nullptr;
  EpochState* epoch = nullptr;
  uint32_t words;
  Status init(uint32_t w) {
    words = w;
    const int W = comm->world();
    MK_CHECK(comm->heap().alloc(size_t(W) * words * 4, &data));
    MK_CHECK(comm->alloc_signals(2 * W, &flags));
    MK_CHECK(comm->alloc_epoch(&epoch));
    return comm->bootstrap().barrier();
  }
  // self_advance: the kernel's last CTA advances the epoch; else a separate launch does.
  void launch(uint64_t seed, unsigned long long* bad, bool self_advance) {
    all_to_all<<<comm->world(), 256, 0, comm->stream()>>>(
        data->view(), flags->signal_view(), comm->wait_ctx(OpTag::kSignalTest, Role::kTest),
        epoch, words, seed, bad, self_advance);
    if (!self_advance) (void)launch_epoch_advance(epoch, comm->stream());
  }
  Status finish() {
    MK_CHECK(comm->bootstrap().barrier());
    MK_CHECK(comm->heap().free(flags));
    return comm->heap().free(data);
  }
};

TEST_F(Signals, AllToAllWithAcks) {
  AllToAll a{comm};
  MK_ASSERT_OK(a.init(3001));
  BadCounter bad;
  const int calls = 50;
  for (int i = 0; i < calls; ++i) a.launch(test_seed(), bad.d, /*self_advance=*/i % 2 == 0);
  MK_ASSERT_OK(comm->sync(comm->stream()));
  EXPECT_EQ(bad.take(), 0ull);
  // Each mapped peer raised my data flag and my ack flag to the last epoch.
  const int W = comm->world();
  std::vector<uint64_t> f(2 * W);
  cudaMemcpy(f.data(), a.flags->local(), f.size() * 8, cudaMemcpyDeviceToHost);
  for (int r : comm->topology().mapped_ranks()) {
    EXPECT_EQ(f[r], uint64_t(calls)) << "data flag of rank " << r;
    EXPECT_EQ(f[W + r], uint64_t(calls)) << "ack flag of rank " << r;
  }
  MK_ASSERT_OK(a.finish());
}

class SignalsGraph : public Signals, public ::testing::WithParamInterface<bool> {};

TEST_P(SignalsGraph, Replays100Times) {
  const bool self_advance = GetParam();
  AllToAll a{comm};
  MK_ASSERT_OK(a.init(1024));
  BadCounter bad;
  cudaStream_t s = comm->stream();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  a.launch(test_seed(), bad.d, self_advance);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const int replays = 100;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < replays; ++i) ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  MK_ASSERT_OK(comm->sync(s));
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(bad.take(), 0ull);
  EpochState e;
  cudaMemcpy(&e, a.epoch, sizeof(e), cudaMemcpyDeviceToHost);
  EXPECT_EQ(e.value, uint64_t(replays)) << "epoch advanced once per replay";
  const int W = comm->world();
  std::vector<uint64_t> f(2 * W);
  cudaMemcpy(f.data(), a.flags->local(), f.size() * 8, cudaMemcpyDeviceToHost);
  for (int r : comm->topology().mapped_ranks()) {
    EXPECT_EQ(f[r], uint64_t(replays)) << "data flag of rank " << r;
    EXPECT_EQ(f[W + r], uint64_t(replays)) << "ack flag of rank " << r;
  }
  if (comm->rank() == 0)
    printf("%d graph replays of an all-to-all exchange (epoch advanced by %s): %.1f us each\n",
           replays, self_advance ? "the kernel" : "a second kernel", us / replays);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  MK_ASSERT_OK(a.finish());
}

INSTANTIATE_TEST_SUITE_P(EpochAdvance, SignalsGraph, ::testing::Bool());

}  // namespace
}  // namespace test
}  // namespace mk
