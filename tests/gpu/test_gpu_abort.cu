// A device wait on a flag from a peer that will never come ends as soon as the communicator
// is aborted (as the proxy's owner does when a peer dies), long before its timeout, and the
// host error carries the cause. The trap ends this process's CUDA context: one test only.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "mkernel/mkernel.h"
#include "tests/common/test_util.h"
#include "tests/gpu/test_kernels.cuh"

namespace mk {
namespace test {
namespace {

TEST(Abort, WaitEndsWithTheCauseNamingThePeer) {
  std::unique_ptr<Communicator> comm;
  MK_ASSERT_OK(make_one_rank_comm(&comm));
  SymmetricBuffer* flags = nullptr;
  MK_ASSERT_OK(comm->alloc_signals(4, &flags));
  auto t0 = std::chrono::steady_clock::now();
  // Bound 20 s: the abort, not the timeout, must end this wait.
  wait_forever<<<1, 32, 0, comm->stream()>>>(flags->signal_view(),
                                             comm->wait_ctx(OpTag::kSignalTest, Role::kNetRecv, 20000), 3, 1, 5);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  comm->abort(make_status(Code::kRemoteError, "proxy: a put to rank 3 failed: connection reset"));
  Status s = comm->sync(comm->stream());
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  printf("%s (after %.0f ms)\n", s.to_string().c_str(), ms);
  EXPECT_EQ(s.code(), Code::kRemoteError);
  EXPECT_NE(s.message().find("stopped waiting (communicator failed)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("op signal-test, role net-recv"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("flag 1 from rank 3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("a put to rank 3 failed"), std::string::npos) << s.message();
  EXPECT_LT(ms, 5000.0);
  (void)comm->destroy();  // reports the dead context; must not hang
}

}  // namespace
}  // namespace test
}  // namespace mk
