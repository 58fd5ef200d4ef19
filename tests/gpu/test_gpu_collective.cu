// The standalone collectives (ops/collective.h) on ranks as processes under MPS: W = 1, 2, 4 on
// one node and 2 emulated nodes x 2 over libfabric (shm, tcp; host-staged), 2 x 1 over tcp. Every
// kind and dtype, tiny and odd counts, small chunks on few CTAs, the zero-copy workspaces and the
// all-reduce in place, bit for bit against the ordered sum (tests/gpu/collective_case.cuh: data,
// reference); graph replays: 100 calls back to back, the inputs advanced by a kernel inside the
// graph, every replay checked inside it; bad input.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/gpu/collective_case.cuh"

namespace mk {
namespace test {
namespace {

using coll::bump;
using coll::Case;
using coll::DevBuf;
using coll::run_calls;
using ops::CollDType;
using ops::Collective;
using ops::CollectiveKind;

class Coll : public ::testing::Test {
 protected:
  void SetUp() override { comm = shared_comm(); }
  Communicator* comm = nullptr;
};

std::vector<int64_t> counts(int W) {
  std::vector<int64_t> v = {8, 8 * (int64_t(37) * W + 3)};
  if (!small_shapes()) v.push_back((int64_t(1) << 20) + 8 * 13);
  return v;
}

TEST_F(Coll, EveryKindAndDtypeMatchesTheOrderedSum) {
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce})
    for (CollDType t : {CollDType::kBF16, CollDType::kF32})
      for (int64_t n : counts(comm->world())) {
        Case c{comm, k, t, n};
        MK_ASSERT_OK(c.init());
        run_calls(c, 3, 0);
        if (HasFatalFailure()) return;
      }
}

// Small chunks (many ops per rank) on few CTAs, and one CTA: ops queue behind each other.
TEST_F(Coll, FewCtasManyChunks) {
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce})
    for (int ctas : {1, 3}) {
      Case c{comm, k, CollDType::kBF16, 8 * (int64_t(301) * comm->world() + 5)};
      c.opt.chunk_elems = 1000;  // rounded up to 1000 (a multiple of 8)
      c.opt.ctas = ctas;
      MK_ASSERT_OK(c.init());
      EXPECT_EQ(c.op->ctas(), comm->world() > 1 ? ctas : c.op->ctas());
      run_calls(c, 3, 0);
      if (HasFatalFailure()) return;
    }
}

TEST_F(Coll, ZeroCopyAndInPlace) {
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce}) {
    Case c{comm, k, CollDType::kBF16, 8 * (int64_t(129) * comm->world() + 1)};
    MK_ASSERT_OK(c.init());
    EXPECT_EQ(c.op->output() != nullptr, k == CollectiveKind::kAllReduce);
    run_calls(c, 3, 1);
    if (HasFatalFailure()) return;
    if (k == CollectiveKind::kAllReduce) run_calls(c, 3, 2);
    if (HasFatalFailure()) return;
  }
}

// Captured once, replayed back to back with no host barrier between replays; each replay's
// output checked inside the graph.
TEST_F(Coll, GraphReplaysBackToBack) {
  constexpr int kReplays = 100;
  cudaStream_t st = comm->stream();
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce}) {
    Case c{comm, k, CollDType::kBF16, 8 * (int64_t(97) * comm->world() + 7)};
    c.opt.chunk_elems = 2048;
    MK_ASSERT_OK(c.init());
    ASSERT_EQ(cudaMemsetAsync(c.d_call, 0, sizeof(uint64_t), st), cudaSuccess);
    MK_ASSERT_OK(c.reset_bad(st));
    MK_ASSERT_OK(comm->sync(st));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    bump<<<1, 1, 0, st>>>(c.d_call);
    Status cap = c.prepare(0, c.in->p, c.out->p, st, c.d_call);
    if (cap.ok()) cap = c.op->enqueue({c.in->p, c.out->p}, st);
    if (cap.ok()) c.enqueue_compare(c.out->p, st, c.d_call);
    ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
    MK_ASSERT_OK(cap);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    MK_ASSERT_OK(comm->bootstrap().barrier());
    for (int rep = 0; rep < kReplays; ++rep) ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    unsigned long long h[3];
    MK_ASSERT_OK(c.take_bad(st, h));
    EXPECT_EQ(h[2], uint64_t(kReplays)) << c.name() << ": replays compared";
    EXPECT_EQ(h[0], 0ull) << c.name() << " rank " << comm->rank() << ": " << h[0] << " wrong words over " << kReplays
                          << " replays, the first in replay " << (h[1] >> 32) << " at word " << (h[1] & 0xffffffffull);
    int wrong = 0;
    MK_ASSERT_OK(c.check_reference(kReplays, 64, &wrong));
    EXPECT_EQ(wrong, 0) << "the reference kernel disagrees with the host";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    MK_ASSERT_OK(comm->bootstrap().barrier());
  }
}

// Bad input: the same clear error on every rank at create; local errors per call.
TEST_F(Coll, BadInputIsRejected) {
  const int W = comm->world();
  std::unique_ptr<Collective> op;
  Status s = Collective::create(comm, CollectiveKind::kAllReduce, 12, CollDType::kBF16, {}, &op);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("multiple of 8"), std::string::npos) << s.to_string();
  // Counts that differ across ranks.
  s = Collective::create(comm, CollectiveKind::kAllGather, 64 + 8 * (comm->rank() == W - 1), CollDType::kBF16, {}, &op);
  if (W > 1) {
    EXPECT_EQ(s.code(), Code::kMismatch) << s.to_string();
    EXPECT_NE(s.message().find("disagree"), std::string::npos) << s.to_string();
  }
  MK_ASSERT_OK(Collective::create(comm, CollectiveKind::kReduceScatter, 64, CollDType::kF32, {}, &op));
  DevBuf in(size_t(W) * 64 * 4 + 16), out(64 * 4 + 16);
  s = op->run({nullptr, out.p}, comm->stream());
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("null"), std::string::npos) << s.to_string();
  s = op->run({static_cast<char*>(in.p) + 4, out.p}, comm->stream());
  EXPECT_NE(s.message().find("aligned"), std::string::npos) << s.to_string();
  s = op->run({in.p, op->input()}, comm->stream());
  EXPECT_NE(s.message().find("overlaps the operator's input workspace"), std::string::npos) << s.to_string();
  s = op->run({static_cast<char*>(op->input()) + 16, out.p}, comm->stream());
  EXPECT_NE(s.message().find("overlaps the operator's input workspace"), std::string::npos) << s.to_string();
  MK_ASSERT_OK(op->destroy());
  MK_ASSERT_OK(comm->bootstrap().barrier());
}

}  // namespace
}  // namespace test
}  // namespace mk
