// Lifetimes: a communicator destroyed while its operators are alive destroys them first; their
// later calls fail with a clear error, and destroying or deleting them afterwards touches
// nothing freed (run under compute-sanitizer / ASan to see that it does not).
#include <gtest/gtest.h>

#include "mkernel/mkernel.h"
#include "mkernel/ops/fused.h"
#include "mkernel/ops/ring_attention.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {
namespace {

TEST(Lifetime, CommunicatorDestroyedBeforeItsOperators) {
  std::unique_ptr<Communicator> comm;
  MK_ASSERT_OK(make_one_rank_comm(&comm));
  std::unique_ptr<ops::FusedGemm> gemm;
  MK_ASSERT_OK(ops::FusedGemm::create(comm.get(), ops::FusedKind::kGemmRs, {256, 256, 64}, {}, &gemm));
  std::unique_ptr<ops::RingAttention> ring;
  MK_ASSERT_OK(ops::RingAttention::create(comm.get(), {1, 2, 2, 64, 128, ops::SeqLayout::kContiguous, false}, {},
                                          &ring));
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 1 << 20), cudaSuccess);
  MK_ASSERT_OK(comm->destroy());
  // The operators went with it: every call is an error that says why.
  ops::FusedArgs a;
  a.A = a.B = a.C = buf;
  Status s = gemm->enqueue(a, nullptr);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("destroyed"), std::string::npos) << s.to_string();
  ops::RingAttentionArgs r;
  r.q = r.k = r.v = r.o = buf;
  s = ring->enqueue(r, nullptr);
  EXPECT_NE(s.message().find("destroyed"), std::string::npos) << s.to_string();
  MK_EXPECT_OK(gemm->destroy());  // idempotent, touches nothing of the communicator
  gemm.reset();
  comm.reset();  // the communicator object goes first ...
  ring.reset();  // ... and the operator's destructor must not reach it
  // A fresh communicator and operator work as before.
  MK_ASSERT_OK(make_one_rank_comm(&comm));
  MK_ASSERT_OK(ops::FusedGemm::create(comm.get(), ops::FusedKind::kGemmRs, {256, 256, 64}, {}, &gemm));
  gemm.reset();
  MK_EXPECT_OK(comm->destroy());
  cudaFree(buf);
}

}  // namespace
}  // namespace test
}  // namespace mk
