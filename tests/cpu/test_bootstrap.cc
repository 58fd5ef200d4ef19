// CPU tests of the in-process bootstraps: the thread world (make_thread_world) and the
// key-value store bootstrap (make_store_bootstrap over an in-memory store), plus agree().
// Each rank is a thread; every collective passes an explicit, short timeout.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/runtime/bootstrap.h"
#include "src/comm/session.h"
#include "src/common/wire.h"
#include "tests/common/test_util.h"

namespace mk {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kOpTimeoutMs = 1500;   // happy-path collectives
constexpr int64_t kMissTimeoutMs = 500;  // collectives that are expected to time out

int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

using test::mix;
std::vector<uint8_t> payload(uint64_t op, int rank, size_t n) { return test::rank_payload(op, rank, n); }

// Compares every byte of an allgather result; returns "" or a description of the first error.
std::string check_gathered(const std::vector<uint8_t>& recv, uint64_t op, int world, size_t n) {
  if (recv.size() != n * world) return "recv has the wrong size";
  size_t bad = 0;
  std::string first;
  for (int r = 0; r < world; ++r) {
    std::vector<uint8_t> want = payload(op, r, n);
    for (size_t i = 0; i < n; ++i) {
      if (recv[r * n + i] != want[i]) {
        if (bad++ == 0)
          first = "block of rank " + std::to_string(r) + " byte " + std::to_string(i) + ": got " +
                  std::to_string(recv[r * n + i]) + ", want " + std::to_string(want[i]);
      }
    }
  }
  if (!bad) return "";
  return std::to_string(bad) + " wrong bytes (op " + std::to_string(op) + ", " +
         std::to_string(n) + " bytes/rank); first: " + first;
}

// A receive buffer pre-filled with the complement of the expected data: every byte is wrong
// until the collective writes it.
std::vector<uint8_t> poisoned_recv(uint64_t op, int world, size_t n) {
  std::vector<uint8_t> v(n * world);
  for (int r = 0; r < world; ++r) {
    std::vector<uint8_t> want = payload(op, r, n);
    for (size_t i = 0; i < n; ++i) v[r * n + i] = static_cast<uint8_t>(~want[i]);
  }
  return v;
}

template <class F>
void run_ranks(int world, F fn) {
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) th.emplace_back([&fn, r] { fn(r); });
  for (auto& t : th) t.join();
}

const std::vector<size_t> kSizes = {1, 2, 7, 8, 64, 1000, 4099, 100 * 1024};

// The checks shared by every bootstrap: allgather of every size (twice, the second time with
// send aliasing recv), broadcast from every root, barrier that really synchronizes.
void exercise(std::vector<std::unique_ptr<Bootstrap>>& bs, const char* kind) {
  const int W = static_cast<int>(bs.size());
  std::atomic<int> arrivals{0};
  run_ranks(W, [&](int rank) {
    Bootstrap& b = *bs[rank];
    EXPECT_EQ(b.rank(), rank);
    EXPECT_EQ(b.size(), W);
    EXPECT_STREQ(b.kind(), kind);
    uint64_t op = 0;
    for (int round = 0; round < 2; ++round) {
      for (size_t n : kSizes) {
        ++op;
        std::vector<uint8_t> recv = poisoned_recv(op, W, n);
        Status s;
        if (round == 0) {
          std::vector<uint8_t> send = payload(op, rank, n);
          s = b.allgather(send.data(), recv.data(), n, kOpTimeoutMs);
        } else {
          std::vector<uint8_t> mine = payload(op, rank, n);
          memcpy(recv.data() + rank * n, mine.data(), n);  // send aliases recv
          s = b.allgather(recv.data() + rank * n, recv.data(), n, kOpTimeoutMs);
        }
        EXPECT_TRUE(s.ok()) << "rank " << rank << " allgather " << n << ": " << s.to_string();
        if (!s.ok()) return;
        std::string err = check_gathered(recv, op, W, n);
        EXPECT_EQ(err, "") << "rank " << rank;
        if (!err.empty()) return;
      }
    }
    for (size_t n : {size_t(1), size_t(13), size_t(4096), size_t(100 * 1024)}) {
      for (int root = 0; root < W; ++root) {
        ++op;
        std::vector<uint8_t> buf = payload(op, rank, n);  // non-roots start with their own data
        std::vector<uint8_t> want = payload(op, root, n);
        if (rank != root && n >= 8) {
          ASSERT_NE(buf, want);
        }
        Status s = b.broadcast(buf.data(), n, root, kOpTimeoutMs);
        EXPECT_TRUE(s.ok()) << "rank " << rank << " broadcast root " << root << ": " << s.to_string();
        if (!s.ok()) return;
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i) bad += buf[i] != want[i];
        EXPECT_EQ(bad, 0u) << "rank " << rank << " broadcast of " << n << " bytes from " << root;
        if (bad) return;
      }
    }
    // Barrier: nobody leaves barrier #i before everybody has arrived at it.
    for (int i = 0; i < 20; ++i) {
      arrivals.fetch_add(1);
      if ((i + rank) % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      Status s = b.barrier(kOpTimeoutMs);
      EXPECT_TRUE(s.ok()) << "rank " << rank << " barrier " << i << ": " << s.to_string();
      if (!s.ok()) return;
      int seen = arrivals.load();
      EXPECT_GE(seen, W * (i + 1)) << "rank " << rank << " left barrier " << i << " early";
      // A second barrier so no rank races ahead into the next increment before all checked.
      s = b.barrier(kOpTimeoutMs);
      EXPECT_TRUE(s.ok()) << s.to_string();
      if (!s.ok()) return;
    }
    // Many back-to-back small collectives.
    for (int i = 0; i < 200; ++i) {
      ++op;
      const size_t n = 1 + (op % 24);
      std::vector<uint8_t> send = payload(op, rank, n);
      std::vector<uint8_t> recv = poisoned_recv(op, W, n);
      Status s = b.allgather(send.data(), recv.data(), n, kOpTimeoutMs);
      EXPECT_TRUE(s.ok()) << s.to_string();
      if (!s.ok()) return;
      std::string err = check_gathered(recv, op, W, n);
      EXPECT_EQ(err, "") << "rank " << rank;
      if (!err.empty()) return;
    }
  });
}

// ---------------------------------------------------------------------------------------
// Thread world

class ThreadWorld : public ::testing::TestWithParam<int> {};

TEST_P(ThreadWorld, CollectivesDeliverEveryByte) {
  const int W = GetParam();
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  ASSERT_EQ(static_cast<int>(bs.size()), W);
  exercise(bs, "threads");
}

TEST_P(ThreadWorld, AgreeAllOk) {
  const int W = GetParam();
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  run_ranks(W, [&](int rank) {
    for (int i = 0; i < 5; ++i) {
      Status s = agree(*bs[rank], OkStatus(), "step", kOpTimeoutMs);
      EXPECT_TRUE(s.ok()) << "rank " << rank << ": " << s.to_string();
    }
  });
}

// What a peer sends agree() is not trusted: an outcome whose message fills its field without a
// terminator and whose code is no mk::Code gives a message cut at the field's end and
// kRemoteError (before, the message was read past the payload and the code passed through).
TEST(ThreadWorldAgree, MalformedOutcomeFromAPeer) {
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(2, &bs));
  struct Outcome {  // agree()'s payload
    int32_t code;
    char msg[252];
  };
  Status got;
  run_ranks(2, [&](int rank) {
    if (rank == 0) {
      got = agree(*bs[0], OkStatus(), "step", kOpTimeoutMs);
      return;
    }
    Outcome o;
    o.code = 77;
    memset(o.msg, 'x', sizeof(o.msg));
    Outcome all[2];
    (void)bs[1]->allgather(&o, all, sizeof(o), kOpTimeoutMs);
  });
  EXPECT_EQ(got.code(), Code::kRemoteError) << got.to_string();
  EXPECT_EQ(std::count(got.message().begin(), got.message().end(), 'x'), 251) << got.message();
  EXPECT_NE(got.message().find("rank(s) 1"), std::string::npos) << got.message();
}

// A byte count whose total over the ranks does not fit a size_t is refused before any buffer
// is sized from it (broadcast's bytes x ranks once wrapped to a small buffer).
TEST(ThreadWorldAgree, ByteCountsThatWrapAreRefused) {
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(4, &bs));
  uint8_t one = 1, out[4] = {};
  const size_t huge = SIZE_MAX / 2;
  Status a = bs[0]->allgather(&one, out, huge, kOpTimeoutMs);
  EXPECT_EQ(a.code(), Code::kInvalidArgument) << a.to_string();
  EXPECT_NE(a.message().find("too many"), std::string::npos) << a.message();
  Status b = bs[0]->broadcast(&one, huge, 0, kOpTimeoutMs);
  EXPECT_EQ(b.code(), Code::kInvalidArgument) << b.to_string();
}

TEST(Wire, CodesFromPeersStayInRange) {
  EXPECT_EQ(code_from_wire(static_cast<int32_t>(Code::kTimeout)), Code::kTimeout);
  EXPECT_EQ(code_from_wire(static_cast<int32_t>(Code::kInternal)), Code::kInternal);
  for (int32_t bad : {0, -1, 11, 77, INT32_MIN, INT32_MAX}) EXPECT_EQ(code_from_wire(bad), Code::kRemoteError) << bad;
}

// Worlds of two ranks and more (one rank has no other rank to report).
class ThreadWorldSeveral : public ::testing::TestWithParam<int> {};
TEST_P(ThreadWorldSeveral, AgreeReportsFailingRanks) {
  const int W = GetParam();
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  std::mt19937_64 rng(mix(test::test_seed(), 0xA64EE));
  const std::string what = "phase" + std::to_string(rng() % 1000);
  const std::string msg1 = "rank one broke " + std::to_string(rng());
  const std::string msg3 = "rank three broke " + std::to_string(rng());
  std::vector<Status> one(W), two(W);
  run_ranks(W, [&](int rank) {
    Status mine = rank == 1 ? Status(Code::kOutOfMemory, msg1) : OkStatus();
    one[rank] = agree(*bs[rank], mine, what, kOpTimeoutMs);
    // Second round: ranks 1 and 3 (if present) fail with different codes.
    Status mine2 = rank == 1   ? Status(Code::kCudaError, msg1)
                   : rank == 3 ? Status(Code::kSystemError, msg3)
                               : OkStatus();
    two[rank] = agree(*bs[rank], mine2, what, kOpTimeoutMs);
  });
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(one[r].code(), Code::kOutOfMemory) << one[r].to_string();
    EXPECT_NE(one[r].message().find("rank(s) 1:"), std::string::npos) << one[r].message();
    EXPECT_NE(one[r].message().find(msg1), std::string::npos) << one[r].message();
    EXPECT_NE(one[r].message().find(what), std::string::npos) << one[r].message();
    EXPECT_EQ(one[r].message(), one[0].message());
    EXPECT_EQ(two[r].code(), Code::kCudaError) << two[r].to_string();
    const std::string list = W > 3 ? "rank(s) 1,3:" : "rank(s) 1:";
    EXPECT_NE(two[r].message().find(list), std::string::npos) << two[r].message();
    EXPECT_NE(two[r].message().find(msg1), std::string::npos) << two[r].message();
    EXPECT_EQ(two[r].message(), two[0].message());
  }
}

// The create-time agreement every operator shares (comm::agree_on_request): equal requests pass
// on every rank; when ranks differ every rank gets the same kMismatch naming rank 0's request and
// the first rank that differs, with its request.
struct TestRequest {
  int64_t rows, cols;
  int32_t kind, flags;
};
TEST_P(ThreadWorldSeveral, AgreeOnRequestNamesTheFirstRankThatDiffers) {
  const int W = GetParam();
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  std::mt19937_64 rng(mix(test::test_seed(), 0x5E0E57));
  const TestRequest base{int64_t(rng() % 100000) + 1, int64_t(rng() % 100000) + 1, int32_t(rng() % 7),
                         int32_t(rng() % 3)};
  auto describe = [](const TestRequest& r) {
    return "rows " + std::to_string(r.rows) + " cols " + std::to_string(r.cols) + " kind " + std::to_string(r.kind) +
           " flags " + std::to_string(r.flags);
  };
  // The differing ranks: the last one, and rank 1 as well in worlds of three and more (first).
  const int first = W > 2 ? 1 : W - 1;
  std::vector<Status> same(W), differ(W);
  run_ranks(W, [&](int rank) {
    same[rank] = comm::agree_on_request(*bs[rank], base, "test_op", describe);
    TestRequest mine = base;
    if (rank == W - 1) mine.cols += 8;
    if (rank == 1 && W > 2) mine.flags ^= 1;
    differ[rank] = comm::agree_on_request(*bs[rank], mine, "test_op", describe);
  });
  TestRequest theirs = base;
  if (first == W - 1) theirs.cols += 8;
  else theirs.flags ^= 1;
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(same[r].ok()) << same[r].to_string();
    EXPECT_EQ(differ[r].code(), Code::kMismatch) << differ[r].to_string();
    EXPECT_EQ(differ[r].message(), "test_op: ranks disagree: rank 0 has " + describe(base) + ", rank " +
                                       std::to_string(first) + " has " + describe(theirs));
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, ThreadWorld, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "W" + std::to_string(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(Sizes, ThreadWorldSeveral, ::testing::Values(2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "W" + std::to_string(i.param);
                         });

TEST(ThreadWorldErrors, BadArguments) {
  std::vector<std::unique_ptr<Bootstrap>> bs;
  EXPECT_EQ(make_thread_world(0, &bs).code(), Code::kInvalidArgument);
  EXPECT_EQ(make_thread_world(-3, &bs).code(), Code::kInvalidArgument);
  MK_ASSERT_OK(make_thread_world(2, &bs));
  uint8_t buf[4] = {1, 2, 3, 4};
  EXPECT_EQ(bs[0]->broadcast(buf, 4, 2, kOpTimeoutMs).code(), Code::kInvalidArgument);
  EXPECT_EQ(bs[0]->broadcast(buf, 4, -1, kOpTimeoutMs).code(), Code::kInvalidArgument);
}

// The rank that passes a different byte count gets kMismatch; the others an error, promptly.
TEST(ThreadWorldErrors, SizeMismatch) {
  for (int W : {2, 3, 4}) {
    SCOPED_TRACE("W=" + std::to_string(W));
    std::vector<std::unique_ptr<Bootstrap>> bs;
    MK_ASSERT_OK(make_thread_world(W, &bs));
    const int odd = W - 1;
    const size_t n = 16;
    std::vector<Status> st(W);
    std::vector<int64_t> took(W);
    run_ranks(W, [&](int rank) {
      // The odd rank comes last, so the others have already agreed on n.
      if (rank == odd) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      size_t mine = rank == odd ? n + 1 : n;
      std::vector<uint8_t> send = payload(1, rank, mine);
      std::vector<uint8_t> recv(mine * W, 0x5a);
      auto t0 = Clock::now();
      st[rank] = bs[rank]->allgather(send.data(), recv.data(), mine, kOpTimeoutMs);
      took[rank] = ms_since(t0);
    });
    EXPECT_EQ(st[odd].code(), Code::kMismatch) << st[odd].to_string();
    EXPECT_NE(st[odd].message().find(std::to_string(n + 1)), std::string::npos)
        << st[odd].message();
    for (int r = 0; r < W; ++r) {
      EXPECT_FALSE(st[r].ok()) << "rank " << r << " returned ok from a mismatched allgather";
      // Woken by the failure, not by their own deadline.
      EXPECT_LT(took[r], kOpTimeoutMs - 200) << "rank " << r << ": " << st[r].to_string();
    }
  }
}

// Whatever the arrival order (all 24 orders of 4 ranks, spaced by sleeps), exactly one rank
// of a mismatched allgather returns kMismatch naming both sizes and every other rank returns
// kRemoteError naming that rank. The ranks arriving after the failure take the "already
// failed" path, and the last of them frees the op: before the fix for issue 21 that path read
// the freed op for its message (heap-use-after-free under ASan/TSan).
TEST(ThreadWorldErrors, SizeMismatchAnyOrder) {
  const int W = 4;
  std::vector<int> order = {0, 1, 2, 3};  // order[i] = the rank that arrives i-th
  int perm = 0;
  do {
    const int odd = perm % W;  // the odd rank takes every identity as well as every position
    std::string when;
    for (int r : order) when += std::to_string(r);
    SCOPED_TRACE("arrival order " + when + ", odd rank " + std::to_string(odd));
    std::vector<int> pos(W);
    for (int i = 0; i < W; ++i) pos[order[i]] = i;
    std::vector<std::unique_ptr<Bootstrap>> bs;
    MK_ASSERT_OK(make_thread_world(W, &bs));
    std::vector<Status> st(W);
    run_ranks(W, [&](int rank) {
      std::this_thread::sleep_for(std::chrono::milliseconds(15 * pos[rank]));
      size_t mine = rank == odd ? 40 : 24;
      std::vector<uint8_t> send = payload(2, rank, mine);
      std::vector<uint8_t> recv(mine * W, 0x5a);
      st[rank] = bs[rank]->allgather(send.data(), recv.data(), mine, kOpTimeoutMs);
    });
    std::vector<int> mismatched;
    for (int r = 0; r < W; ++r) {
      EXPECT_FALSE(st[r].ok()) << "rank " << r;
      if (st[r].code() == Code::kMismatch) mismatched.push_back(r);
    }
    ASSERT_EQ(mismatched.size(), 1u) << "one rank detects the mismatch, the others are told";
    const int m = mismatched[0];
    EXPECT_NE(st[m].message().find("40"), std::string::npos) << st[m].message();
    EXPECT_NE(st[m].message().find("24"), std::string::npos) << st[m].message();
    for (int r = 0; r < W; ++r) {
      if (r == m) continue;
      EXPECT_EQ(st[r].code(), Code::kRemoteError) << "rank " << r << ": " << st[r].to_string();
      EXPECT_NE(st[r].message().find("rank(s) " + std::to_string(m)), std::string::npos)
          << "rank " << r << " does not name rank " << m << ": " << st[r].message();
    }
    ++perm;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(perm, 24);
}

// Deterministic form of the above: ranks 0 and 1 fail allgather #0 with a size mismatch and
// leave; rank 2 arrives afterwards, is the last rank out, frees the op and must still name
// rank 1 (issue 21: it read the freed op). The world then goes on: allgather #1 succeeds.
TEST(ThreadWorldErrors, LastRankOutOfFailedOpNamesTheFailure) {
  const int W = 3;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  std::vector<Status> st(W);
  run_ranks(2, [&](int rank) {
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    size_t mine = rank == 1 ? 9 : 8;
    std::vector<uint8_t> send = payload(5, rank, mine);
    std::vector<uint8_t> recv(mine * W, 0x5a);
    st[rank] = bs[rank]->allgather(send.data(), recv.data(), mine, kOpTimeoutMs);
  });
  EXPECT_EQ(st[0].code(), Code::kRemoteError) << st[0].to_string();
  EXPECT_EQ(st[1].code(), Code::kMismatch) << st[1].to_string();
  {
    std::vector<uint8_t> send = payload(5, 2, 8);
    std::vector<uint8_t> recv(8 * W, 0x5a);
    st[2] = bs[2]->allgather(send.data(), recv.data(), 8, kOpTimeoutMs);
  }
  EXPECT_EQ(st[2].code(), Code::kRemoteError) << st[2].to_string();
  EXPECT_NE(st[2].message().find("already failed on rank(s) 1"), std::string::npos)
      << st[2].message();
  const size_t n = 64;
  run_ranks(W, [&](int rank) {
    std::vector<uint8_t> send = payload(6, rank, n);
    std::vector<uint8_t> recv = poisoned_recv(6, W, n);
    Status s = bs[rank]->allgather(send.data(), recv.data(), n, kOpTimeoutMs);
    EXPECT_TRUE(s.ok()) << "rank " << rank << ": " << s.to_string();
    if (s.ok()) {
      EXPECT_EQ(check_gathered(recv, 6, W, n), "") << "rank " << rank;
    }
  });
}

// W=4, rank 2 skips allgather #0. As bootstrap.h promises, every rank that did arrive returns
// kTimeout naming rank 2, after (about) the timeout and not much later; rank 2 arriving late,
// after everyone gave up, gets an error rather than stale success or a hang.
// (Before commit 1dda30a only the first waiter to expire got kTimeout; the others returned
// kRemoteError naming that waiter instead of the missing rank.)
TEST(ThreadWorldErrors, MissingRankIsNamedByEveryWaiter) {
  const int W = 4, missing = 2;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  std::vector<Status> st(W);
  std::vector<int64_t> took(W, 0);
  const size_t n = 32;
  run_ranks(W, [&](int rank) {
    if (rank == missing) return;
    std::vector<uint8_t> send = payload(3, rank, n);
    std::vector<uint8_t> recv(n * W, 0x5a);
    auto t0 = Clock::now();
    st[rank] = bs[rank]->allgather(send.data(), recv.data(), n, kMissTimeoutMs);
    took[rank] = ms_since(t0);
  });
  for (int r = 0; r < W; ++r) {
    if (r == missing) continue;
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(st[r].code(), Code::kTimeout) << st[r].to_string();
    EXPECT_NE(st[r].message().find("rank(s) 2 "), std::string::npos) << st[r].message();
    EXPECT_NE(st[r].message().find(std::to_string(kMissTimeoutMs)), std::string::npos)
        << st[r].message();
    EXPECT_GE(took[r], kMissTimeoutMs - 50);
    EXPECT_LE(took[r], kMissTimeoutMs + 1000);
  }
  std::vector<uint8_t> send = payload(3, missing, n);
  std::vector<uint8_t> recv(n * W, 0x5a);
  auto t0 = Clock::now();
  Status late = bs[missing]->allgather(send.data(), recv.data(), n, kMissTimeoutMs);
  EXPECT_FALSE(late.ok()) << "the late rank's allgather succeeded although its peers gave up";
  // The late rank is the last one out of the op (issue 21: its message read the freed op).
  EXPECT_EQ(late.code(), Code::kRemoteError) << late.to_string();
  const size_t at = late.message().find("rank(s) ");
  ASSERT_NE(at, std::string::npos) << late.message();
  const std::string named = late.message().substr(at);
  for (int r : {0, 1, 3})
    EXPECT_NE(named.find(std::to_string(r)), std::string::npos)
        << "the late rank's error does not name rank " << r << ": " << late.message();
  EXPECT_LE(ms_since(t0), kMissTimeoutMs + 1000);
}

// Two ranks missing: both are named, by each of the others.
TEST(ThreadWorldErrors, TwoMissingRanksAreBothNamed) {
  const int W = 5;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  std::vector<Status> st(W);
  run_ranks(W, [&](int rank) {
    if (rank == 1 || rank == 4) return;
    std::vector<uint8_t> send = payload(4, rank, 5);
    std::vector<uint8_t> recv(5 * W, 0x5a);
    st[rank] = bs[rank]->allgather(send.data(), recv.data(), 5, 300);
  });
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(st[r].code(), Code::kTimeout) << "rank " << r << ": " << st[r].to_string();
    EXPECT_NE(st[r].message().find("rank(s) 1,4 "), std::string::npos) << st[r].message();
  }
}

// ---------------------------------------------------------------------------------------
// Store bootstrap over an in-memory store

class MemStore {
 public:
  StoreCallbacks callbacks(bool with_erase = true) {
    StoreCallbacks cb;
    cb.set = [this](const std::string& key, const std::vector<uint8_t>& value) {
      std::lock_guard<std::mutex> g(mu_);
      if (map_.count(key)) ++rewrites_;
      map_[key] = value;
      ++sets_;
      if (map_.size() > max_keys_) max_keys_ = map_.size();
      return OkStatus();
    };
    cb.try_get = [this](const std::string& key, size_t, std::vector<uint8_t>* value, bool* found) {
      std::lock_guard<std::mutex> g(mu_);
      auto it = map_.find(key);
      *found = it != map_.end();
      if (*found) *value = it->second;
      return OkStatus();
    };
    if (with_erase) {
      cb.erase = [this](const std::string& key) {
        std::lock_guard<std::mutex> g(mu_);
        erased_ += map_.erase(key);
        return OkStatus();
      };
    }
    return cb;
  }
  size_t size() {
    std::lock_guard<std::mutex> g(mu_);
    return map_.size();
  }
  size_t max_keys() {
    std::lock_guard<std::mutex> g(mu_);
    return max_keys_;
  }
  size_t sets() {
    std::lock_guard<std::mutex> g(mu_);
    return sets_;
  }
  size_t erased() {
    std::lock_guard<std::mutex> g(mu_);
    return erased_;
  }
  size_t rewrites() {
    std::lock_guard<std::mutex> g(mu_);
    return rewrites_;
  }
  std::vector<std::string> keys() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::string> k;
    for (const auto& kv : map_) k.push_back(kv.first);
    return k;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::vector<uint8_t>> map_;
  size_t max_keys_ = 0, sets_ = 0, erased_ = 0, rewrites_ = 0;
};

Status make_store_world(MemStore& store, int W, const std::string& prefix,
                        std::vector<std::unique_ptr<Bootstrap>>* out, bool with_erase = true) {
  out->clear();
  for (int r = 0; r < W; ++r) {
    out->emplace_back();
    Status s = make_store_bootstrap(r, W, prefix, store.callbacks(with_erase), &out->back());
    if (!s.ok()) return s;
  }
  return OkStatus();
}

class StoreWorld : public ::testing::TestWithParam<int> {};

TEST_P(StoreWorld, CollectivesDeliverEveryByte) {
  const int W = GetParam();
  MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_store_world(store, W, "pfx" + std::to_string(test::test_seed() % 1000), &bs));
  exercise(bs, "store");
  EXPECT_EQ(store.rewrites(), 0u) << "a key was written twice";
  // The erase callback keeps the store at O(W) keys however many collectives ran.
  EXPECT_LE(store.max_keys(), static_cast<size_t>(2 * W)) << "store grew with the op count";
  EXPECT_EQ(store.size(), static_cast<size_t>(W));
}

TEST_P(StoreWorld, AgreeReportsFailingRank) {
  const int W = GetParam();
  MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_store_world(store, W, "agree", &bs));
  const std::string msg = "store rank failed " + std::to_string(mix(test::test_seed(), 7));
  std::vector<Status> ok(W), bad(W);
  run_ranks(W, [&](int rank) {
    ok[rank] = agree(*bs[rank], OkStatus(), "init", kOpTimeoutMs);
    Status mine = (rank == 1 % W) ? Status(Code::kPermissionDenied, msg) : OkStatus();
    bad[rank] = agree(*bs[rank], mine, "init", kOpTimeoutMs);
  });
  const std::string who = "rank(s) " + std::to_string(1 % W) + ":";
  for (int r = 0; r < W; ++r) {
    EXPECT_TRUE(ok[r].ok()) << ok[r].to_string();
    EXPECT_EQ(bad[r].code(), Code::kPermissionDenied) << bad[r].to_string();
    EXPECT_NE(bad[r].message().find(who), std::string::npos) << bad[r].message();
    EXPECT_NE(bad[r].message().find(msg), std::string::npos) << bad[r].message();
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, StoreWorld, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "W" + std::to_string(i.param);
                         });

TEST(StoreBootstrap, KeysStayBoundedOverFiftyCollectives) {
  for (int W : {2, 5}) {
    SCOPED_TRACE("W=" + std::to_string(W));
    MemStore store;
    std::vector<std::unique_ptr<Bootstrap>> bs;
    MK_ASSERT_OK(make_store_world(store, W, "bounded", &bs));
    run_ranks(W, [&](int rank) {
      for (int i = 0; i < 50; ++i) {
        const size_t n = 1 + i;
        std::vector<uint8_t> send = payload(100 + i, rank, n);
        std::vector<uint8_t> recv = poisoned_recv(100 + i, W, n);
        Status s = bs[rank]->allgather(send.data(), recv.data(), n, kOpTimeoutMs);
        EXPECT_TRUE(s.ok()) << s.to_string();
        if (!s.ok()) return;
        std::string err = check_gathered(recv, 100 + i, W, n);
        EXPECT_EQ(err, "");
        if (!err.empty()) return;
      }
    });
    EXPECT_EQ(store.sets(), static_cast<size_t>(50 * W));
    EXPECT_EQ(store.erased(), static_cast<size_t>(49 * W));
    EXPECT_LE(store.max_keys(), static_cast<size_t>(2 * W));
    EXPECT_EQ(store.size(), static_cast<size_t>(W));
    for (const auto& k : store.keys()) EXPECT_EQ(k.rfind("bounded/", 0), 0u) << k;
  }
}

TEST(StoreBootstrap, WorksWithoutEraseCallback) {
  const int W = 3;
  MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_store_world(store, W, "noerase", &bs, /*with_erase=*/false));
  run_ranks(W, [&](int rank) {
    for (int i = 0; i < 10; ++i) {
      std::vector<uint8_t> send = payload(200 + i, rank, 9);
      std::vector<uint8_t> recv = poisoned_recv(200 + i, W, 9);
      Status s = bs[rank]->allgather(send.data(), recv.data(), 9, kOpTimeoutMs);
      EXPECT_TRUE(s.ok()) << s.to_string();
      if (!s.ok()) return;
      EXPECT_EQ(check_gathered(recv, 200 + i, W, 9), "");
    }
  });
  EXPECT_EQ(store.size(), static_cast<size_t>(10 * W));  // nothing erased
}

// Two worlds with different prefixes share one store concurrently without mixing data.
TEST(StoreBootstrap, PrefixesSeparateWorlds) {
  const int W = 3;
  MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> a, b;
  MK_ASSERT_OK(make_store_world(store, W, "commA", &a));
  MK_ASSERT_OK(make_store_world(store, W, "commB", &b));
  run_ranks(2 * W, [&](int t) {
    auto& world = t < W ? a : b;
    const int rank = t % W;
    const uint64_t base = t < W ? 1000 : 2000;
    for (int i = 0; i < 20; ++i) {
      const size_t n = 33;
      std::vector<uint8_t> send = payload(base + i, rank, n);
      std::vector<uint8_t> recv = poisoned_recv(base + i, W, n);
      Status s = world[rank]->allgather(send.data(), recv.data(), n, kOpTimeoutMs);
      EXPECT_TRUE(s.ok()) << s.to_string();
      if (!s.ok()) return;
      EXPECT_EQ(check_gathered(recv, base + i, W, n), "") << "world " << (t < W ? "A" : "B");
    }
  });
}

TEST(StoreBootstrap, MissingRankIsNamedByEveryone) {
  const int W = 4, missing = 2;
  MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_store_world(store, W, "miss", &bs));
  std::vector<Status> st(W);
  std::vector<int64_t> took(W, 0);
  run_ranks(W, [&](int rank) {
    if (rank == missing) return;
    std::vector<uint8_t> send = payload(5, rank, 48);
    std::vector<uint8_t> recv(48 * W, 0x5a);
    auto t0 = Clock::now();
    st[rank] = bs[rank]->allgather(send.data(), recv.data(), 48, kMissTimeoutMs);
    took[rank] = ms_since(t0);
  });
  for (int r = 0; r < W; ++r) {
    if (r == missing) continue;
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(st[r].code(), Code::kTimeout) << st[r].to_string();
    EXPECT_NE(st[r].message().find("rank(s) 2 "), std::string::npos) << st[r].message();
    EXPECT_NE(st[r].message().find("store"), std::string::npos) << st[r].message();
    EXPECT_GE(took[r], kMissTimeoutMs - 50);
    EXPECT_LE(took[r], kMissTimeoutMs + 1000);
  }
  // The late rank finds every other key but must not succeed where its peers failed.
  std::vector<uint8_t> send = payload(5, missing, 48);
  std::vector<uint8_t> recv(48 * W, 0x5a);
  Status late = bs[missing]->allgather(send.data(), recv.data(), 48, kMissTimeoutMs);
  EXPECT_EQ(late.code(), Code::kRemoteError) << late.to_string();
}

TEST(StoreBootstrap, SizeMismatchIsAnError) {
  const int W = 3, odd = 1;
  MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_store_world(store, W, "mm", &bs));
  std::vector<Status> st(W);
  run_ranks(W, [&](int rank) {
    size_t n = rank == odd ? 21 : 20;
    std::vector<uint8_t> send = payload(6, rank, n);
    std::vector<uint8_t> recv(n * W, 0x5a);
    st[rank] = bs[rank]->allgather(send.data(), recv.data(), n, kOpTimeoutMs);
  });
  EXPECT_EQ(st[odd].code(), Code::kMismatch) << st[odd].to_string();
  for (int r = 0; r < W; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_EQ(st[r].code(), Code::kMismatch) << "rank " << r << ": " << st[r].to_string();
  }
}

// Every read tells the store how large the value may be (the C ABI refuses a larger one before
// allocating it): the byte count for a contribution, sizeof the notice for a failure notice.
TEST(StoreBootstrap, TellsTheStoreHowLargeAValueMayBe) {
  MemStore store;
  StoreCallbacks cb = store.callbacks();
  std::mutex mu;
  std::map<std::string, size_t> asked;  // key -> max_bytes
  auto get = cb.try_get;
  cb.try_get = [&](const std::string& key, size_t max_bytes, std::vector<uint8_t>* v, bool* found) {
    {
      std::lock_guard<std::mutex> g(mu);
      asked[key] = max_bytes;
    }
    return get(key, max_bytes, v, found);
  };
  const size_t bytes = 3 + mix(test::test_seed(), 21) % 200;
  std::vector<Status> st(2);
  run_ranks(2, [&](int rank) {
    std::unique_ptr<Bootstrap> b;
    st[rank] = make_store_bootstrap(rank, 2, "cap", cb, &b);
    if (!st[rank].ok()) return;
    std::vector<uint8_t> send(bytes, static_cast<uint8_t>(rank)), recv(2 * bytes);
    st[rank] = b->allgather(send.data(), recv.data(), bytes, kOpTimeoutMs);
  });
  for (int r = 0; r < 2; ++r) MK_EXPECT_OK(st[r]);
  ASSERT_TRUE(asked.count("cap/0/0") && asked.count("cap/0/1"));
  EXPECT_EQ(asked["cap/0/0"], bytes);
  EXPECT_EQ(asked["cap/0/1"], bytes);
  for (const auto& [key, max_bytes] : asked) {
    if (key.find("/abort") != std::string::npos) {
      EXPECT_LE(max_bytes, 16u) << key;
    }
  }
}

// A caller's huge timeout waits (saturating at a century) instead of wrapping into a deadline
// in the past: INT64_MAX ms once failed at once ("did not arrive within 9223372036854775807 ms").
TEST(StoreBootstrap, AHugeTimeoutWaitsInsteadOfFailing) {
  MemStore store;
  std::vector<Status> st(2);
  uint8_t got[2][2] = {};
  run_ranks(2, [&](int rank) {
    std::unique_ptr<Bootstrap> b;
    st[rank] = make_store_bootstrap(rank, 2, "huge", store.callbacks(), &b);
    if (!st[rank].ok()) return;
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    uint8_t mine = static_cast<uint8_t>(40 + rank);
    st[rank] = b->allgather(&mine, got[rank], 1, std::numeric_limits<int64_t>::max());
  });
  for (int r = 0; r < 2; ++r) {
    MK_EXPECT_OK(st[r]);
    EXPECT_EQ(got[r][0], 40);
    EXPECT_EQ(got[r][1], 41);
  }
}

TEST(StoreBootstrap, StoreErrorsPropagate) {
  StoreCallbacks cb;
  const std::string why = "store down " + std::to_string(mix(test::test_seed(), 9) % 100000);
  cb.set = [&](const std::string&, const std::vector<uint8_t>&) {
    return Status(Code::kSystemError, why);
  };
  cb.try_get = [](const std::string&, size_t, std::vector<uint8_t>*, bool* found) {
    *found = false;
    return OkStatus();
  };
  std::unique_ptr<Bootstrap> b;
  MK_ASSERT_OK(make_store_bootstrap(0, 2, "err", cb, &b));
  uint8_t send[3] = {9, 8, 7}, recv[6];
  Status s = b->allgather(send, recv, 3, kMissTimeoutMs);
  EXPECT_EQ(s.code(), Code::kSystemError) << s.to_string();
  EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
}

TEST(StoreBootstrap, BadArguments) {
  MemStore store;
  std::unique_ptr<Bootstrap> b;
  EXPECT_EQ(make_store_bootstrap(2, 2, "x", store.callbacks(), &b).code(), Code::kInvalidArgument);
  EXPECT_EQ(make_store_bootstrap(5, 2, "x", store.callbacks(), &b).code(), Code::kInvalidArgument);
  EXPECT_EQ(make_store_bootstrap(-1, 2, "x", store.callbacks(), &b).code(), Code::kInvalidArgument);
  EXPECT_EQ(make_store_bootstrap(0, 0, "x", store.callbacks(), &b).code(), Code::kInvalidArgument);
  EXPECT_EQ(b, nullptr);
  StoreCallbacks no_set = store.callbacks();
  no_set.set = nullptr;
  EXPECT_EQ(make_store_bootstrap(0, 2, "x", no_set, &b).code(), Code::kInvalidArgument);
  StoreCallbacks no_get = store.callbacks();
  no_get.try_get = nullptr;
  EXPECT_EQ(make_store_bootstrap(0, 2, "x", no_get, &b).code(), Code::kInvalidArgument);
  EXPECT_EQ(make_store_bootstrap(0, 2, "x", StoreCallbacks{}, &b).code(), Code::kInvalidArgument);
  EXPECT_EQ(b, nullptr);
  MK_EXPECT_OK(make_store_bootstrap(1, 2, "x", store.callbacks(/*with_erase=*/false), &b));
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->rank(), 1);
  EXPECT_EQ(b->size(), 2);
  uint8_t buf[2] = {3, 4};
  EXPECT_EQ(b->broadcast(buf, 2, 2, kOpTimeoutMs).code(), Code::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------
// Job failure (Bootstrap::fail, failure notices, failure_report), on both in-process kinds.

enum class WorldKind { kThreads, kStore };

struct FailWorld {
  MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> bs;
  Status make(WorldKind k, int W) {
    if (k == WorldKind::kThreads) return make_thread_world(W, &bs);
    return make_store_world(store, W, "fail" + std::to_string(test::test_seed() % 997), &bs);
  }
};

class JobFailure : public ::testing::TestWithParam<WorldKind> {};

// Rank 1 fails with a cause of its own while the others wait in an allgather with a long
// bound: they leave as soon as its notice arrives (not at their bound), with an error naming it
// and its cause; every later collective on every rank returns at once.
TEST_P(JobFailure, NoticeEndsThePeersWaits) {
  const int W = 4, culprit = 1;
  const int64_t long_ms = 20000;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  const std::string cause = "bad input on rank 1 #" + std::to_string(mix(test::test_seed(), 11) % 100000);
  std::vector<Status> st(W), later(W);
  std::vector<int64_t> took(W, 0), later_ms(W, 0);
  run_ranks(W, [&](int rank) {
    Bootstrap& b = *w.bs[rank];
    std::vector<uint8_t> send = payload(21, rank, 16), recv(16 * W);
    auto t0 = Clock::now();
    if (rank == culprit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others are waiting by now
      b.fail(Status(Code::kInvalidArgument, cause));
      EXPECT_TRUE(b.failed());
      st[rank] = b.allgather(send.data(), recv.data(), 16, long_ms);  // sends the notice, returns at once
    } else {
      st[rank] = b.allgather(send.data(), recv.data(), 16, long_ms);
    }
    took[rank] = ms_since(t0);
    auto t1 = Clock::now();
    later[rank] = b.barrier(long_ms);
    later_ms[rank] = ms_since(t1);
  });
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_FALSE(st[r].ok());
    EXPECT_NE(st[r].message().find(cause), std::string::npos) << st[r].to_string();
    if (r == culprit) {
      EXPECT_EQ(st[r].code(), Code::kInvalidArgument) << st[r].to_string();
    } else {
      EXPECT_EQ(st[r].code(), Code::kRemoteError) << st[r].to_string();
      EXPECT_NE(st[r].message().find("rank 1 failed: " + cause), std::string::npos) << st[r].to_string();
      EXPECT_GE(took[r], 150);
    }
    EXPECT_LT(took[r], 3000) << "waited for a failed job";
    EXPECT_FALSE(later[r].ok());
    EXPECT_LT(later_ms[r], 500) << "a collective after the failure waited";
    EXPECT_TRUE(w.bs[r]->failed());
  }
}

// Rank 2 says nothing (dead or stopped); the others fail with waits that expired and report:
// after the grace period every one names rank 2 as the culprit, with its own view after it.
TEST_P(JobFailure, ReportNamesTheSilentRank) {
  const int W = 4, silent = 2;
  const int64_t grace = 400;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  std::vector<Status> rep(W);
  std::vector<int64_t> took(W, 0);
  run_ranks(W, [&](int rank) {
    if (rank == silent) return;
    Bootstrap& b = *w.bs[rank];
    auto t0 = Clock::now();
    b.fail(make_status(Code::kTimeout, "rank %d waited 3000 ms on flag 7 from rank %d", rank, (rank + 1) % W));
    rep[rank] = b.failure_report(grace);
    took[rank] = ms_since(t0);
    Status again = b.failure_report(grace);  // the same report, without waiting again
    EXPECT_EQ(again.message(), rep[rank].message());
  });
  for (int r = 0; r < W; ++r) {
    if (r == silent) continue;
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(rep[r].code(), Code::kTimeout) << rep[r].to_string();
    EXPECT_NE(rep[r].message().find("culprit rank(s) 2: did not report within 400 ms"), std::string::npos)
        << rep[r].to_string();
    EXPECT_NE(rep[r].message().find("rank " + std::to_string(r) + " saw: rank " + std::to_string(r) + " waited"),
              std::string::npos)
        << rep[r].to_string();
    EXPECT_GE(took[r], grace - 50);
    EXPECT_LT(took[r], grace + 1500);
  }
}

// A cause of a rank's own beats waits that expired, whatever the ranks' order; a rank that only
// heard of the failure is never the culprit; everyone reported, so nobody waits out the grace.
TEST_P(JobFailure, ReportNamesTheRankWithACauseOfItsOwn) {
  const int W = 4, culprit = 2, listener = 3;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  std::vector<Status> rep(W);
  std::vector<int64_t> took(W, 0);
  run_ranks(W, [&](int rank) {
    Bootstrap& b = *w.bs[rank];
    auto t0 = Clock::now();
    if (rank == listener) {
      // Healthy, in a collective: hears the failure, then reports what it heard.
      std::vector<uint8_t> send = payload(22, rank, 8), recv(8 * W);
      EXPECT_FALSE(b.allgather(send.data(), recv.data(), 8, 20000).ok());
    } else if (rank == culprit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      b.fail(Status(Code::kSystemError, "libfabric/tcp: the provider failed: Input/output error"));
    } else {
      b.fail(make_status(Code::kTimeout, "rank %d waited on flag 3 from rank 2", rank));
    }
    rep[rank] = b.failure_report(5000);
    took[rank] = ms_since(t0);
  });
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(rep[r].code(), Code::kSystemError) << rep[r].to_string();
    EXPECT_NE(rep[r].message().find("culprit rank 2: libfabric/tcp: the provider failed"), std::string::npos)
        << rep[r].to_string();
    EXPECT_LT(took[r], 3000) << "every rank reported: no need to wait out the grace";
  }
  EXPECT_NE(rep[listener].message().find("rank 3 heard: rank "), std::string::npos) << rep[listener].to_string();
}

// Under MPS a client that dies with its kernel in flight can fault the others' contexts: a
// silent rank explains a CUDA error better than the rank that reports it.
TEST_P(JobFailure, ASilentRankBeatsACudaError) {
  const int W = 3, silent = 1;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  std::vector<Status> rep(W);
  run_ranks(W, [&](int rank) {
    if (rank == silent) return;
    Bootstrap& b = *w.bs[rank];
    if (rank == 0) b.fail(Status(Code::kCudaError, "rank 0: an illegal memory access was encountered"));
    else b.fail(make_status(Code::kTimeout, "rank %d waited on flag 4 from rank 1", rank));
    rep[rank] = b.failure_report(300);
  });
  for (int r : {0, 2})
    EXPECT_NE(rep[r].message().find("culprit rank(s) 1: did not report"), std::string::npos) << rep[r].to_string();
}

// A rank whose own error names a peer fails before the others' waits expire: of the ranks that
// said nothing in the grace time, it names the one its error points at, not the one still waiting.
TEST_P(JobFailure, OfTheSilentRanksThePointedAtOneIsNamed) {
  const int W = 3, dead = 2, quick = 1;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  Status rep;
  run_ranks(W, [&](int rank) {
    if (rank != quick) return;  // rank 0 is still in its wait, rank 2 is dead: both silent here
    Bootstrap& b = *w.bs[rank];
    b.fail(make_status(Code::kRemoteError, "a put to rank %d failed: Transport endpoint is not connected", dead));
    rep = b.failure_report(300);
  });
  EXPECT_NE(rep.message().find("culprit rank(s) 2: did not report"), std::string::npos) << rep.to_string();
}

// Everyone reported a wait that expired (a stopped rank resumed in time to report): the rank the
// most of them waited for is named.
TEST_P(JobFailure, TheRankTheWaitsPointAtIsNamed) {
  const int W = 4;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  std::vector<Status> rep(W);
  run_ranks(W, [&](int rank) {
    Bootstrap& b = *w.bs[rank];
    const int waited_for = rank == 2 ? 0 : 2;
    b.fail(make_status(Code::kTimeout, "device wait failed: rank %d timed out on flag 5 from rank %d", rank, waited_for));
    rep[rank] = b.failure_report(3000);
  });
  for (int r = 0; r < W; ++r)
    EXPECT_NE(rep[r].message().find("culprit rank 2: the rank 3 rank(s)' failures point at"), std::string::npos)
        << rep[r].to_string();
}

// A collective that times out fails the job: the next one returns at once, on every rank that
// waited, and the late rank learns of it instead of waiting.
TEST_P(JobFailure, TimeoutFailsTheJob) {
  const int W = 3, late = 2;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  std::vector<int64_t> next_ms(W, 0);
  std::vector<Status> next(W);
  run_ranks(W, [&](int rank) {
    Bootstrap& b = *w.bs[rank];
    if (rank != late) {
      // The first waiter out times out; the other may hear of it from the first one's notice
      // an instant before its own bound (the first one's next collective sends it).
      std::vector<uint8_t> send = payload(23, rank, 8), recv(8 * W);
      Status s = b.allgather(send.data(), recv.data(), 8, 300);
      EXPECT_TRUE(s.code() == Code::kTimeout || s.code() == Code::kRemoteError) << s.to_string();
      EXPECT_NE(s.message().find("rank(s) 2 did not arrive"), std::string::npos) << s.to_string();
      EXPECT_TRUE(b.failed());
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(700));
    }
    auto t0 = Clock::now();
    next[rank] = b.barrier(20000);
    next_ms[rank] = ms_since(t0);
  });
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_FALSE(next[r].ok());
    EXPECT_LT(next_ms[r], 2000) << next[r].to_string();
  }
}

// agree() on a failed job returns the report at once instead of gathering.
TEST_P(JobFailure, AgreeOnAFailedJobReports) {
  const int W = 2;
  FailWorld w;
  MK_ASSERT_OK(w.make(GetParam(), W));
  std::vector<Status> st(W);
  run_ranks(W, [&](int rank) {
    Bootstrap& b = *w.bs[rank];
    if (rank == 0) b.fail(Status(Code::kCudaError, "rank 0: an illegal address"));
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    st[rank] = agree(b, OkStatus(), "after the call", 20000);
  });
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(st[r].code(), Code::kCudaError) << st[r].to_string();
    EXPECT_NE(st[r].message().find("culprit rank 0: rank 0: an illegal address"), std::string::npos)
        << st[r].to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, JobFailure, ::testing::Values(WorldKind::kThreads, WorldKind::kStore),
                         [](const ::testing::TestParamInfo<WorldKind>& i) {
                           return i.param == WorldKind::kThreads ? std::string("threads") : std::string("store");
                         });

TEST(Bootstrap, LaunchedByMpiFollowsEnvironment) {
  // This binary runs without mpirun; the check reads well-known launcher variables.
  const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"};
  bool any = false;
  for (const char* v : vars) any |= getenv(v) != nullptr;
  EXPECT_EQ(launched_by_mpi(), any);
}

}  // namespace
}  // namespace mk
