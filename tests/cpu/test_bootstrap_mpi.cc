// The MPI bootstrap under mpirun (1-4 ranks): collectives with rank-tagged random data,
// agree(), and a rank that never arrives. Every rank runs every test; the seed is the same
// on all ranks (mpi_gtest_main broadcasts it), so each rank can compute everyone's data.
#include <mpi.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/runtime/bootstrap_mpi.h"
#include "tests/common/test_util.h"

namespace mk {
namespace {

constexpr int64_t kOpTimeoutMs = 1500;
constexpr int64_t kMissTimeoutMs = 1000;

using test::mix;
std::vector<uint8_t> payload(uint64_t op, int rank, size_t n) { return test::rank_payload(op, rank, n); }

// Receive buffer holding the complement of what must arrive: every byte starts wrong.
std::vector<uint8_t> poisoned_recv(uint64_t op, int world, size_t n) {
  std::vector<uint8_t> v(n * world);
  for (int r = 0; r < world; ++r) {
    std::vector<uint8_t> want = payload(op, r, n);
    for (size_t i = 0; i < n; ++i) v[r * n + i] = static_cast<uint8_t>(~want[i]);
  }
  return v;
}

std::string check_gathered(const std::vector<uint8_t>& recv, uint64_t op, int world, size_t n) {
  size_t bad = 0;
  std::string first;
  for (int r = 0; r < world; ++r) {
    std::vector<uint8_t> want = payload(op, r, n);
    for (size_t i = 0; i < n; ++i)
      if (recv[r * n + i] != want[i] && bad++ == 0)
        first = "block of rank " + std::to_string(r) + " byte " + std::to_string(i);
  }
  if (!bad) return "";
  return std::to_string(bad) + " wrong bytes (op " + std::to_string(op) + ", " +
         std::to_string(n) + " bytes/rank); first: " + first;
}

class MpiBootstrapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MK_ASSERT_OK(make_mpi_bootstrap(MPI_COMM_WORLD, &bs_));
    ASSERT_NE(bs_, nullptr);
  }
  void TearDown() override {
    bs_.reset();
    MPI_Barrier(MPI_COMM_WORLD);  // keep the tests in step across ranks
  }
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Bootstrap> bs_;
};

TEST_F(MpiBootstrapTest, Identity) {
  EXPECT_EQ(bs_->rank(), rank_);
  EXPECT_EQ(bs_->size(), size_);
  EXPECT_STREQ(bs_->kind(), "mpi");
  EXPECT_TRUE(have_mpi());
  EXPECT_TRUE(launched_by_mpi() || size_ == 1);
}

TEST_F(MpiBootstrapTest, AllgatherEverySize) {
  const std::vector<size_t> sizes = {1, 2, 3, 8, 63, 64, 1000, 4096, 65537, 256 * 1024};
  uint64_t op = 0;
  for (int round = 0; round < 3; ++round) {
    for (size_t n : sizes) {
      ++op;
      std::vector<uint8_t> recv = poisoned_recv(op, size_, n);
      Status s;
      if (round != 1) {
        std::vector<uint8_t> send = payload(op, rank_, n);
        s = bs_->allgather(send.data(), recv.data(), n, kOpTimeoutMs);
      } else {  // in place: send aliases this rank's block of recv
        std::vector<uint8_t> mine = payload(op, rank_, n);
        memcpy(recv.data() + rank_ * n, mine.data(), n);
        s = bs_->allgather(recv.data() + rank_ * n, recv.data(), n, kOpTimeoutMs);
      }
      ASSERT_TRUE(s.ok()) << "allgather of " << n << " bytes: " << s.to_string();
      std::string err = check_gathered(recv, op, size_, n);
      ASSERT_EQ(err, "");
    }
  }
  // Many small ones back to back.
  for (int i = 0; i < 300; ++i) {
    ++op;
    const size_t n = 1 + op % 40;
    std::vector<uint8_t> send = payload(op, rank_, n);
    std::vector<uint8_t> recv = poisoned_recv(op, size_, n);
    Status s = bs_->allgather(send.data(), recv.data(), n, kOpTimeoutMs);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(check_gathered(recv, op, size_, n), "");
  }
}

TEST_F(MpiBootstrapTest, BroadcastFromEveryRoot) {
  uint64_t op = 1000;
  for (size_t n : {size_t(1), size_t(17), size_t(4096), size_t(200 * 1024)}) {
    for (int root = 0; root < size_; ++root) {
      ++op;
      std::vector<uint8_t> buf = payload(op, rank_, n);
      const std::vector<uint8_t> want = payload(op, root, n);
      Status s = bs_->broadcast(buf.data(), n, root, kOpTimeoutMs);
      ASSERT_TRUE(s.ok()) << "broadcast from " << root << ": " << s.to_string();
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) bad += buf[i] != want[i];
      ASSERT_EQ(bad, 0u) << n << " bytes from root " << root;
    }
  }
  uint8_t b[2] = {1, 2};
  EXPECT_EQ(bs_->broadcast(b, 2, size_, kOpTimeoutMs).code(), Code::kInvalidArgument);
  EXPECT_EQ(bs_->broadcast(b, 2, -1, kOpTimeoutMs).code(), Code::kInvalidArgument);
}

TEST_F(MpiBootstrapTest, BarrierSynchronizes) {
  // Each round one rank (round % size) arrives 150 ms late; nobody may leave before it came (the
  // bound leaves 50 ms for the ranks' skew out of MPI_Barrier on a loaded machine).
  for (int round = 0; round < 6; ++round) {
    const int late = round % size_;
    MPI_Barrier(MPI_COMM_WORLD);  // common start
    auto t0 = std::chrono::steady_clock::now();
    if (rank_ == late) std::this_thread::sleep_for(std::chrono::milliseconds(150));
    Status s = bs_->barrier(kOpTimeoutMs);
    ASSERT_TRUE(s.ok()) << s.to_string();
    auto waited = std::chrono::steady_clock::now() - t0;
    if (size_ > 1) {
      EXPECT_GE(waited, std::chrono::milliseconds(100)) << "left the barrier before rank " << late;
    }
  }
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(bs_->barrier(kOpTimeoutMs).ok());
}

TEST_F(MpiBootstrapTest, Agree) {
  for (int i = 0; i < 3; ++i) {
    Status s = agree(*bs_, OkStatus(), "ok step", kOpTimeoutMs);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  const int bad = size_ > 1 ? 1 : 0;
  const std::string msg = "rank " + std::to_string(bad) + " broke, token " +
                          std::to_string(mix(test::test_seed(), 77) % 1000000);
  Status mine = rank_ == bad ? Status(Code::kOutOfMemory, msg) : OkStatus();
  Status s = agree(*bs_, mine, "alloc", kOpTimeoutMs);
  EXPECT_EQ(s.code(), Code::kOutOfMemory) << s.to_string();
  EXPECT_NE(s.message().find("rank(s) " + std::to_string(bad) + ":"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find(msg), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("alloc"), std::string::npos) << s.message();
  // Every rank returns the same message: compare through a second allgather.
  char mine_msg[256] = {0};
  snprintf(mine_msg, sizeof(mine_msg), "%s", s.message().c_str());
  std::vector<char> all(256 * size_);
  MK_ASSERT_OK(bs_->allgather(mine_msg, all.data(), 256, kOpTimeoutMs));
  for (int r = 0; r < size_; ++r)
    EXPECT_STREQ(all.data() + 256 * r, mine_msg) << "rank " << r << " agreed on something else";
  // Everybody failing: the lowest rank's code wins.
  Status each(rank_ == 0 ? Code::kCudaError : Code::kSystemError, "r" + std::to_string(rank_));
  Status e = agree(*bs_, each, "all", kOpTimeoutMs);
  EXPECT_EQ(e.code(), Code::kCudaError) << e.to_string();
  EXPECT_NE(e.message().find("rank(s) 0"), std::string::npos) << e.message();
}

// The last rank skips one allgather: every other rank returns kTimeout naming it, promptly.
TEST_F(MpiBootstrapTest, MissingRankIsNamed) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks";
  const int missing = size_ - 1;
  // A warm-up collective so the connections exist before the timed one.
  ASSERT_TRUE(bs_->barrier(kOpTimeoutMs).ok());
  if (rank_ != missing) {
    const size_t n = 64;
    std::vector<uint8_t> send = payload(5000, rank_, n);
    std::vector<uint8_t> recv = poisoned_recv(5000, size_, n);
    auto t0 = std::chrono::steady_clock::now();
    Status s = bs_->allgather(send.data(), recv.data(), n, kMissTimeoutMs);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                  std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
    EXPECT_NE(s.message().find("rank(s) " + std::to_string(missing) + " "), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("mpi"), std::string::npos) << s.message();
    EXPECT_GE(ms, kMissTimeoutMs - 50);
    EXPECT_LE(ms, 2 * kMissTimeoutMs) << "took " << ms << " ms";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Rank 0 passes 16 bytes, the others 8: every rank must return kMismatch, including rank 0,
// which receives the SHORTER messages (MPI reports no error for those: the bootstrap must
// compare the received count with the byte count itself).
TEST_F(MpiBootstrapTest, SizeMismatchIsAnErrorOnEveryRank) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks";
  const size_t n = rank_ == 0 ? 16 : 8;
  std::vector<uint8_t> send = payload(6000, rank_, n);
  // Kept alive to the end of the test: a failing rank may leave receives posted into it.
  std::vector<uint8_t> recv(16 * size_, 0x5a);
  Status s = bs_->allgather(send.data(), recv.data(), n, kOpTimeoutMs);
  EXPECT_FALSE(s.ok()) << "rank " << rank_ << " passed " << n
                       << " bytes and its allgather returned ok";
  EXPECT_EQ(s.code(), Code::kMismatch) << "rank " << rank_ << ": " << s.to_string();
  MPI_Barrier(MPI_COMM_WORLD);
}

// The last rank fails with a cause of its own while the others wait in an allgather with a
// long bound: its notice ends their waits at once, and every rank's report names it.
TEST_F(MpiBootstrapTest, FailureNoticeEndsThePeersWaits) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks";
  const int culprit = size_ - 1;
  ASSERT_TRUE(bs_->barrier(kOpTimeoutMs).ok());
  const std::string cause = "bad input on rank " + std::to_string(culprit) + " #" +
                            std::to_string(mix(test::test_seed(), 31) % 100000);
  auto t0 = std::chrono::steady_clock::now();
  Status st;
  if (rank_ == culprit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    bs_->fail(Status(Code::kInvalidArgument, cause));
  } else {
    std::vector<uint8_t> send = payload(7000, rank_, 32), recv(32 * size_);
    st = bs_->allgather(send.data(), recv.data(), 32, 30000);
    EXPECT_EQ(st.code(), Code::kRemoteError) << st.to_string();
    EXPECT_NE(st.message().find("rank " + std::to_string(culprit) + " failed: " + cause), std::string::npos)
        << st.to_string();
  }
  const Status rep = bs_->failure_report(5000);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rep.code(), Code::kInvalidArgument) << rep.to_string();
  EXPECT_NE(rep.message().find("culprit rank " + std::to_string(culprit) + ": " + cause), std::string::npos)
      << rep.to_string();
  EXPECT_LT(ms, 4000) << "a rank waited out a bound although every rank had reported";
  EXPECT_FALSE(bs_->barrier(30000).ok());  // at once: the job has failed
}

// The last rank says nothing (dead, stopped): after the grace every other rank names it.
TEST_F(MpiBootstrapTest, FailureReportNamesTheSilentRank) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks";
  const int silent = size_ - 1;
  if (rank_ != silent) {
    auto t0 = std::chrono::steady_clock::now();
    bs_->fail(make_status(Code::kTimeout, "rank %d waited 3000 ms on flag 2 from rank %d", rank_, silent));
    const Status rep = bs_->failure_report(600);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(rep.code(), Code::kTimeout) << rep.to_string();
    EXPECT_NE(rep.message().find("culprit rank(s) " + std::to_string(silent) + ": did not report within 600 ms"),
              std::string::npos)
        << rep.to_string();
    EXPECT_GE(ms, 550);
    EXPECT_LT(ms, 3000);
  }
  // The silent rank stays off its bootstrap until the others have reported (its destructor
  // would read their notices and answer that it only heard).
  MPI_Barrier(MPI_COMM_WORLD);
}

// A rank that was not in the call (alive, but it only hears of the failure when it next
// touches the bootstrap) is named as such.
TEST_F(MpiBootstrapTest, FailureReportNamesTheRankThatOnlyHeard) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks";
  const int absent = size_ - 1;
  Status rep;
  if (rank_ != absent) {
    bs_->fail(make_status(Code::kTimeout, "rank %d waited 3000 ms on flag 2 from rank %d", rank_, absent));
    rep = bs_->failure_report(20000);
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_FALSE(bs_->barrier(20000).ok());  // hears of it here
    rep = bs_->failure_report(20000);
  }
  EXPECT_EQ(rep.code(), Code::kTimeout) << rep.to_string();
  EXPECT_NE(rep.message().find("culprit rank(s) " + std::to_string(absent) + ": not in the call"), std::string::npos)
      << rep.to_string();
}

TEST(MpiBootstrapArgs, RequiresInitializedMpi) {
  // MPI is initialized by the test main; a bad communicator is an error, not a crash.
  int init = 0;
  MPI_Initialized(&init);
  ASSERT_TRUE(init);
  std::unique_ptr<Bootstrap> b;
  MK_ASSERT_OK(make_mpi_bootstrap(MPI_COMM_SELF, &b));
  EXPECT_EQ(b->size(), 1);
  EXPECT_EQ(b->rank(), 0);
  std::vector<uint8_t> send = payload(9, 0, 100), recv(100, 0x33);
  MK_ASSERT_OK(b->allgather(send.data(), recv.data(), 100, kOpTimeoutMs));
  EXPECT_EQ(recv, send);
}

}  // namespace
}  // namespace mk
