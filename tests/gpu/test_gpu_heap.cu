// Symmetric memory across ranks (processes under mpirun; several may share one GPU under MPS).
#include <gtest/gtest.h>

#include <cstring>

#include "mkernel/common/cuda_check.h"
#include "tests/gpu/mpi_fixture.h"
#include "tests/gpu/test_kernels.cuh"

namespace mk {
namespace test {
namespace {

constexpr uint32_t kPoison = 0xDEADBEEFu;

class Heap : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = shared_comm();
    ASSERT_NE(comm, nullptr);
    ASSERT_TRUE(comm->has_gpu());
  }
  Communicator* comm = nullptr;
};

TEST_F(Heap, TopologyAndMode) {
  const Topology& t = comm->topology();
  EXPECT_EQ(t.world, comm->bootstrap().size());
  for (int r = 0; r < t.world; ++r) {
    if (r == t.rank) EXPECT_EQ(t.path[r], PeerPath::kSelf);
    else if (t.same_node(r)) EXPECT_EQ(t.path[r], PeerPath::kIpc) << "peer " << r;
    else EXPECT_EQ(t.path[r], PeerPath::kNetwork) << "peer " << r;
  }
  if (t.rank == 0) printf("%s\n", t.describe().c_str());
}

// Every rank fills its copy with words tagged by its rank, then reads every mapped peer's
// copy through the peer table; then writes tagged words into its slot of every peer's copy
// and checks, after a barrier, that every slot of its own copy came from the right rank.
TEST_F(Heap, ReadAndWritePeers) {
  const uint64_t seed = test_seed();
  const int W = comm->world(), me = comm->rank();
  for (size_t bytes : {size_t(4), size_t(4096), size_t(3u << 20) + 16, size_t(64u << 20)}) {
    SCOPED_TRACE("bytes " + std::to_string(bytes));
    const uint64_t n = bytes / 4;
    SymmetricBuffer* buf = nullptr;
    MK_ASSERT_OK(comm->heap().alloc(bytes, &buf));
    ASSERT_GE(buf->mapped_size(), bytes);
    // peer table on the device equals the host's
    std::vector<void*> dev(W);
    ASSERT_EQ(cudaMemcpy(dev.data(), buf->device_peers(), W * sizeof(void*), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(dev[r], buf->peer(r)) << "rank " << r;
      EXPECT_EQ(buf->peer(r) != nullptr, comm->topology().path[r] != PeerPath::kNetwork);
    }
    EXPECT_EQ(buf->peer(me), buf->local());

    fill_tagged<<<264, 256, 0, comm->stream()>>>(static_cast<uint32_t*>(buf->local()), n, seed, me, me, 1);
    MK_ASSERT_OK(comm->sync(comm->stream()));
    MK_ASSERT_OK(comm->bootstrap().barrier());
    BadCounter bad;
    for (int r : comm->topology().mapped_ranks()) {
      count_bad<<<264, 256, 0, comm->stream()>>>(static_cast<const uint32_t*>(buf->peer(r)), n, seed, r, r, 1, bad.d);
      MK_ASSERT_OK(comm->sync(comm->stream()));
      EXPECT_EQ(bad.take(), 0ull) << "reading rank " << r << "'s copy";
    }
    MK_ASSERT_OK(comm->bootstrap().barrier());
    MK_ASSERT_OK(comm->heap().free(buf));
  }

  // Remote writes: slot[src] of every copy, poisoned first.
  const uint64_t words = 4099;  // not a power of two
  SymmetricBuffer* slots = nullptr;
  MK_ASSERT_OK(comm->heap().alloc(W * words * 4, &slots));
  fill_u32<<<64, 256, 0, comm->stream()>>>(static_cast<uint32_t*>(slots->local()), W * words, kPoison);
  MK_ASSERT_OK(comm->sync(comm->stream()));
  MK_ASSERT_OK(comm->bootstrap().barrier());
  for (int r : comm->topology().mapped_ranks())
    fill_tagged<<<64, 256, 0, comm->stream()>>>(static_cast<uint32_t*>(slots->peer(r)) + me * words,
                                                 words, seed, me, r, 2);
  MK_ASSERT_OK(comm->sync(comm->stream()));
  MK_ASSERT_OK(comm->bootstrap().barrier());
  BadCounter bad;
  for (int r : comm->topology().mapped_ranks()) {
    count_bad<<<64, 256, 0, comm->stream()>>>(static_cast<const uint32_t*>(slots->local()) + r * words,
                                             words, seed, r, me, 2, bad.d);
    MK_ASSERT_OK(comm->sync(comm->stream()));
    EXPECT_EQ(bad.take(), 0ull) << "slot written by rank " << r;
  }
  MK_ASSERT_OK(comm->heap().free(slots));
  MK_EXPECT_OK(comm->heap().free(slots));  // idempotent
  if (me == 0) printf("mapping mode: %s\n", symmetric_mode_name(comm->heap().mode()));
}

TEST_F(Heap, ZeroSizeFailsOnEveryRank) {
  // Rank 0 asks for 0 bytes, the others for 4 KiB: every rank gets the same error.
  SymmetricBuffer* b = nullptr;
  Status s = comm->heap().alloc(comm->rank() == 0 ? 0 : 4096, &b);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("size 0"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("rank(s) 0"), std::string::npos) << s.to_string();
  EXPECT_EQ(b, nullptr);
}

TEST_F(Heap, SizeMismatchFailsOnEveryRank) {
  if (comm->world() < 2) GTEST_SKIP() << "needs 2 ranks";
  SymmetricBuffer* b = nullptr;
  Status s = comm->heap().alloc(4096 * (1 + comm->rank()), &b);
  EXPECT_EQ(s.code(), Code::kMismatch) << s.to_string();
  EXPECT_NE(s.message().find("rank 1: 8192 B"), std::string::npos) << s.to_string();
  // the same message on every rank
  char msg[512] = {0}, msg0[512] = {0};
  snprintf(msg, sizeof(msg), "%s", s.message().c_str());
  memcpy(msg0, msg, sizeof(msg));
  MPI_Bcast(msg0, sizeof(msg0), MPI_CHAR, 0, MPI_COMM_WORLD);
  EXPECT_STREQ(msg, msg0);
}

TEST_F(Heap, OutOfMemoryFailsOnEveryRank) {
  SymmetricBuffer* b = nullptr;
  Status s = comm->heap().alloc(size_t(1) << 40, &b);  // 1 TiB: more than any GPU has
  EXPECT_EQ(s.code(), Code::kOutOfMemory) << s.to_string();
  EXPECT_NE(s.message().find("rank(s)"), std::string::npos) << s.to_string();
  // The heap stays usable after a failed collective.
  MK_ASSERT_OK(comm->heap().alloc(1 << 20, &b));
  MK_ASSERT_OK(comm->heap().free(b));
}

TEST_F(Heap, ManyBuffersFreedInAnyOrderThenDestroy) {
  std::vector<SymmetricBuffer*> bufs;
  for (int i = 0; i < 8; ++i) {
    SymmetricBuffer* b = nullptr;
    MK_ASSERT_OK(comm->heap().alloc((i + 1) * 100000, &b));
    bufs.push_back(b);
  }
  MK_ASSERT_OK(comm->heap().free(bufs[3]));
  MK_ASSERT_OK(comm->heap().free(bufs[0]));
  EXPECT_EQ(comm->heap().live_buffers(), 6u);
  // destroy() releases the rest; comm->destroy() at exit finds nothing left and is a no-op.
}

}  // namespace
}  // namespace test
}  // namespace mk
