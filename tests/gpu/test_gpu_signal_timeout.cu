// A planted missing signal: the wait times out, the kernel records who it waited for and
// traps, and the host error names rank, op, role, peer, flag and values. The CUDA context of
// the waiting process is gone afterwards, so each binary runs one such test.
#include <gtest/gtest.h>

#include <chrono>

#include "tests/gpu/mpi_fixture.h"
#include "tests/gpu/test_kernels.cuh"

namespace mk {
namespace test {
namespace {

// Rank W-1 waits for flag[0] >= 7 from rank 0, which never signals; the other ranks only
// meet the barriers. The waiting rank must fail within the bound with a naming message.
TEST(SignalTimeout, MissingSignalIsNamed) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world(), me = comm->rank();
  SymmetricBuffer* flags = nullptr;
  MK_ASSERT_OK(comm->alloc_signals(4, &flags));
  const int64_t bound_ms = 300;
  const int waiter = W - 1;
  const int silent = 0;
  if (me == waiter) {
    auto t0 = std::chrono::steady_clock::now();
    wait_forever<<<1, 32, 0, comm->stream()>>>(flags->signal_view(),
                                               comm->wait_ctx(OpTag::kSignalTest, Role::kTest, bound_ms),
                                               silent, 2, 7);
    Status s = comm->sync(comm->stream());
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    printf("rank %d: %s (after %.0f ms)\n", me, s.to_string().c_str(), ms);
    EXPECT_EQ(s.code(), Code::kTimeout);
    EXPECT_TRUE(comm->wait_timed_out());
    const std::string& m = s.message();
    EXPECT_NE(m.find("rank " + std::to_string(me) + " (op signal-test, role test"), std::string::npos) << m;
    EXPECT_NE(m.find("on flag 2 from rank " + std::to_string(silent)), std::string::npos) << m;
    EXPECT_NE(m.find("expected >= 7, seen 0"), std::string::npos) << m;
    EXPECT_GE(ms, bound_ms * 0.9);
    EXPECT_LT(ms, bound_ms + 5000.0);
  }
  // Everyone meets here; the waiter's context is dead, teardown reports but does not hang.
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace test
}  // namespace mk
