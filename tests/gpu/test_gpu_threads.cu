// Ranks as threads of one process (thread bootstrap): symmetric memory shared by plain
// pointers, signals between kernels of different ranks, and a planted missing signal.
#include <gtest/gtest.h>

#include <thread>

#include "mkernel/mkernel.h"
#include "tests/common/test_util.h"
#include "tests/gpu/test_kernels.cuh"

namespace mk {
namespace test {
namespace {

unsigned long long read_bad(unsigned long long* d) {
  unsigned long long h = ~0ull;
  cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost);
  return h;
}

// Runs fn(rank, comm) on W threads, each with its own communicator.
// dead_context: fn traps a kernel on purpose, so teardown may report the dead context.
template <class Fn>
void run_world(int W, Fn fn, bool dead_context = false) {
  std::vector<std::unique_ptr<Bootstrap>> world;
  MK_ASSERT_OK(make_thread_world(W, &world));
  std::vector<std::thread> th;
  for (int r = 0; r < W; ++r)
    th.emplace_back([&, r] {
      std::unique_ptr<Communicator> comm;
      CommConfig cfg;
      cfg.require_gpu = true;
      Status s = Communicator::create(std::move(world[r]), cfg, &comm);
      EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.to_string();
      if (!s.ok()) return;
      fn(r, *comm);
      Status d = comm->destroy();
      if (!dead_context) MK_EXPECT_OK(d);
      else if (!d.ok()) printf("teardown after the trap (expected to report): %s\n", d.to_string().c_str());
    });
  for (auto& t : th) t.join();
}

TEST(Threads, SameProcessPeersShareMemoryAndSignals) {
  const uint64_t seed = test_seed();
  // W <= 2: ranks of one process share one context, and CUDA does not promise to run their
  // mutually waiting kernels concurrently; with 3 we saw one of them queued behind the others.
  for (int W : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(W));
    run_world(W, [&](int me, Communicator& comm) {
      for (int r = 0; r < W; ++r)
        EXPECT_EQ(comm.topology().path[r], r == me ? PeerPath::kSelf : PeerPath::kSameProcess);
      const uint32_t words = 5003;
      SymmetricBuffer* data = nullptr;
      SymmetricBuffer* flags = nullptr;
      EpochState* epoch = nullptr;
      MK_ASSERT_OK(comm.heap().alloc(size_t(W) * words * 4, &data));
      MK_ASSERT_OK(comm.alloc_signals(2 * W, &flags));
      MK_ASSERT_OK(comm.alloc_epoch(&epoch));
      unsigned long long* bad = nullptr;
      ASSERT_EQ(cudaMalloc(&bad, sizeof(*bad)), cudaSuccess);
      ASSERT_EQ(cudaMemset(bad, 0, sizeof(*bad)), cudaSuccess);
      MK_ASSERT_OK(comm.bootstrap().barrier());
      for (int i = 0; i < 20; ++i) {
        all_to_all<<<W, 128, 0, comm.stream()>>>(data->view(), flags->signal_view(),
                                                 comm.wait_ctx(OpTag::kSignalTest, Role::kTest),
                                                 epoch, words, seed, bad, /*self_advance=*/true);
        // One call in flight per rank: a queue of waiting kernels is what serializes them.
        MK_ASSERT_OK(comm.sync(comm.stream()));
      }
      MK_ASSERT_OK(comm.sync(comm.stream()));
      EXPECT_EQ(read_bad(bad), 0ull) << "rank " << me;
      cudaFree(bad);
      MK_ASSERT_OK(comm.bootstrap().barrier());
    });
  }
}

TEST(Threads, PlantedMissingSignalNamesRankAndFlag) {
  run_world(1, [&](int me, Communicator& comm) {
    SymmetricBuffer* flags = nullptr;
    MK_ASSERT_OK(comm.alloc_signals(8, &flags));
    wait_forever<<<2, 64, 0, comm.stream()>>>(flags->signal_view(),
                                              comm.wait_ctx(OpTag::kSignalTest, Role::kComm, 200),
                                              0, 5, 3);
    Status s = comm.sync(comm.stream());
    EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
    EXPECT_NE(s.message().find("rank 0 (op signal-test, role comm"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("flag 5 from rank 0: expected >= 3, seen 0"), std::string::npos) << s.to_string();
    printf("%s\n", s.to_string().c_str());
  }, /*dead_context=*/true);
}

}  // namespace
}  // namespace test
}  // namespace mk
