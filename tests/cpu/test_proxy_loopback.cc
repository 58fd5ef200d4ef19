// Proxy conformance over the loopback backend: ranks as threads of one process.
#include "tests/cpu/proxy_suite.h"

#include "src/common/keep_until_exit.h"
#include "src/proxy/proxy_impl.h"

namespace mk {
namespace test {
namespace {

template <class Fn>
void run_threads(int W, Fn fn) {
  std::vector<std::unique_ptr<Bootstrap>> world;
  MK_ASSERT_OK(make_thread_world(W, &world));
  std::vector<std::thread> th;
  for (int r = 0; r < W; ++r) th.emplace_back([&, r] { fn(world[r].get()); });
  for (auto& t : th) t.join();
}

net::BackendConfig cfg() {
  net::BackendConfig c;
  c.kind = "loopback";
  return c;
}

class Loopback : public ::testing::TestWithParam<int> {};

TEST_P(Loopback, RandomPutsEveryByteAndCompletion) {
  run_threads(GetParam(), [](Bootstrap* bs) { conformance(bs, cfg()); });
}
TEST_P(Loopback, StressHundredThousandCommands) {
  run_threads(GetParam(), [](Bootstrap* bs) { stress(bs, cfg()); });
}
TEST_P(Loopback, BadCommandsAreRejected) {
  run_threads(GetParam(), [](Bootstrap* bs) { bad_commands(bs, cfg()); });
}
// The staged protocol (host buffers, credits, chunks) on host memory.
TEST_P(Loopback, StagedRandomPutsEveryByteAndCompletion) {
  run_threads(GetParam(), [](Bootstrap* bs) { conformance(bs, cfg(), "always"); });
}
TEST_P(Loopback, StagedStress) {
  run_threads(GetParam(), [](Bootstrap* bs) { stress(bs, cfg(), 20000, "always"); });
}
TEST_P(Loopback, StagedBadCommandsAreRejected) {
  run_threads(GetParam(), [](Bootstrap* bs) { bad_commands(bs, cfg(), "always"); });
}
// A staging copy that fails (as a CUDA copy can): the proxy fails with that error, the chunk
// is never sent and its flag never rises, and nothing later is posted either.
class FailingCopier final : public StagingCopier {
 public:
  explicit FailingCopier(int fail_at) : fail_at_(fail_at) {}
  Status start(void* dst, const void* src, uint64_t bytes, bool, int* ticket) override {
    memcpy(dst, src, bytes);
    *ticket = started_++;
    return OkStatus();
  }
  Status poll(int ticket, bool* done) override {
    *done = false;
    if (ticket == fail_at_) return make_status(Code::kCudaError, "injected copy failure (ticket %d)", ticket);
    *done = true;
    return OkStatus();
  }

 private:
  int fail_at_, started_ = 0;
};

TEST(LoopbackFault, FailedStagingCopyPostsNothingMore) {
  run_threads(2, [](Bootstrap* bs) {
    const int me = bs->rank();
    const uint64_t chunk = 256 << 10;  // ProxyWorld's staging chunk
    const int puts = 6, fail_at = 2;   // the sender's third copy fails
    FailingCopier copier(me == 0 ? fail_at : -1);
    ProxyWorld w;
    MK_ASSERT_OK(w.init(bs, cfg(), puts * chunk, puts * chunk, "always", &copier));
    std::vector<uint64_t> flags(puts + 1, 0);
    HostFlagSink sink(flags.data(), puts + 1);
    ProxyConfig pc;
    pc.timeout_ms = 5000;
    std::unique_ptr<Proxy> proxy;
    MK_ASSERT_OK(Proxy::create(w.wins.get(), &sink, pc, &proxy));
    MK_ASSERT_OK(proxy->start());
    MK_ASSERT_OK(bs->barrier());
    if (me == 0) {
      for (int k = 0; k < puts; ++k)
        MK_EXPECT_OK(proxy->ring().push(make_put(1, w.src_win, k * chunk, w.dst_win, k * chunk, chunk, k, puts, k),
                                        5000, &proxy->failed_word()));
      auto deadline = Clock::now() + std::chrono::seconds(10);
      while (proxy->status().ok() && Clock::now() < deadline) std::this_thread::yield();
      EXPECT_NE(proxy->status().message().find("injected copy failure"), std::string::npos)
          << proxy->status().to_string();
      // The failed chunk's put never completed locally: fewer completions than puts.
      EXPECT_LT(__atomic_load_n(&flags[puts], __ATOMIC_ACQUIRE), uint64_t(fail_at + 1));
    }
    MK_ASSERT_OK(bs->barrier());
    if (me == 1) {
      // Give a wrongly posted chunk time to land, then: nothing from the failed copy on.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      for (int k = fail_at; k < puts; ++k)
        EXPECT_EQ(__atomic_load_n(&flags[k], __ATOMIC_ACQUIRE), 0u) << "put " << k << " arrived after the failure";
    }
    MK_ASSERT_OK(bs->barrier());
    (void)proxy->flush(100);
    (void)proxy->stop();
    MK_EXPECT_OK(w.finish());
  });
}

// A backend whose progress() does not return once `stuck` is set: as a provider call that spins
// on a lock held by a dead peer. Never destroyed (the stuck thread stays inside it).
class StuckBackend final : public net::Backend {
 public:
  const char* name() const override { return "stuck"; }
  net::BackendCaps caps() const override { return {}; }
  Status register_window(void*, size_t, net::MemKind, net::WindowId* id) override {
    *id = 0;
    return OkStatus();
  }
  Status deregister_window(net::WindowId) override { return OkStatus(); }
  uint64_t window_size(net::WindowId, int) const override { return 0; }
  Status put(int, net::WindowId, uint64_t, net::WindowId, uint64_t, uint64_t, uint32_t, uint64_t,
             bool* posted) override {
    *posted = true;
    return OkStatus();
  }
  Status progress(std::vector<net::LocalDone>*, std::vector<net::Arrival>*) override {
    entered.store(true);
    while (stuck.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return OkStatus();
  }
  Status finalize() override { return OkStatus(); }
  void abandon() override { abandoned.store(true); }
  std::atomic<bool> stuck{false}, entered{false}, abandoned{false};
};

// The proxy's stop() is bounded: a thread stuck inside the backend is given up within
// min(net timeout, 1 s), the backend told (abandon), the error names it, abandoned() says so, and
// stop() again returns at once. A healthy backend's thread still stops and is joined.
TEST(ProxyStop, AThreadStuckInTheBackendIsGivenUp) {
  static StuckBackend* be = new StuckBackend();  // never freed: the given-up thread stays in it
  std::vector<uint64_t> flags(4, 0);
  HostFlagSink sink(flags.data(), 4);
  ProxyConfig pc;
  pc.timeout_ms = 300;
  {
    std::unique_ptr<ProxyImpl> healthy;
    MK_ASSERT_OK(ProxyImpl::create(be, 0, 1, &sink, pc, &healthy));
    MK_ASSERT_OK(healthy->start());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    MK_EXPECT_OK(healthy->stop());
    EXPECT_FALSE(be->abandoned.load());
    EXPECT_FALSE(healthy->abandoned());
  }
  be->stuck.store(true);
  be->entered.store(false);
  std::unique_ptr<ProxyImpl> proxy;
  MK_ASSERT_OK(ProxyImpl::create(be, 0, 1, &sink, pc, &proxy));
  MK_ASSERT_OK(proxy->start());
  while (!be->entered.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = Clock::now();
  const Status s = proxy->stop();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("did not stop within 300 ms"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("stuck inside stuck"), std::string::npos) << s.to_string();
  EXPECT_TRUE(be->abandoned.load()) << "the backend was not told";
  EXPECT_GE(ms, 290.0);
  EXPECT_LT(ms, 2000.0);
  EXPECT_TRUE(proxy->abandoned());
  const auto t1 = Clock::now();
  EXPECT_EQ(proxy->stop().code(), Code::kTimeout);
  keep_until_exit(std::move(proxy));  // as its owners do: the stuck thread still uses it
  const double again_ms = std::chrono::duration<double, std::milli>(Clock::now() - t1).count();
  EXPECT_LT(again_ms, 100.0) << "stop() again or the destructor waited";
}

INSTANTIATE_TEST_SUITE_P(World, Loopback, ::testing::Values(1, 2, 3, 4),
                         [](const auto& i) { return "W" + std::to_string(i.param); });

// The ring's size is checked before its bytes are computed (2^58 slots once wrapped to a
// 0-byte allocation that the first push overflowed).
TEST(CommandRing, CapacityIsBounded) {
  std::unique_ptr<CommandRing> r;
  for (uint64_t bad : {uint64_t{0}, uint64_t{1}, uint64_t{3}, uint64_t{6}, CommandRing::kMaxCapacity * 2,
                       uint64_t{1} << 58, uint64_t{1} << 63}) {
    Status s = CommandRing::create(bad, /*gpu=*/false, &r);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << bad << ": " << s.to_string();
    EXPECT_EQ(r, nullptr);
  }
  MK_EXPECT_OK(CommandRing::create(uint64_t{1} << 16, false, &r));
  MK_EXPECT_OK(CommandRing::create(2, false, &r));
}

// A push into a full ring times out and claims nothing: the ring goes on once the proxy
// consumes (a claimed, never published slot once stalled the consumer for good). Several
// producers racing for the last slots each get a slot or a timeout, never a hole.
TEST(CommandRing, APushThatTimesOutLeavesNoHole) {
  std::unique_ptr<CommandRing> r;
  MK_ASSERT_OK(CommandRing::create(4, false, &r));
  uint64_t next_user = 1;
  auto cmd = [&] { return make_put(0, 0, 0, 0, 0, 8, kNoFlag, kNoFlag, next_user++); };
  for (int i = 0; i < 4; ++i) MK_ASSERT_OK(r->push(cmd(), 1000));
  Status full = r->push(cmd(), 50);  // user 5: never enters the ring
  EXPECT_EQ(full.code(), Code::kTimeout) << full.to_string();
  std::vector<uint64_t> seen;
  auto consume = [&] {
    Command c;
    ASSERT_TRUE(r->peek(&c));
    seen.push_back(c.user);
    r->pop();
  };
  consume();
  MK_ASSERT_OK(r->push(cmd(), 1000));  // user 6
  // Four producer threads race for what room there is: 1 slot now, 2 more after 2 pops.
  std::atomic<int> ok{0}, timed_out{0};
  std::vector<std::thread> th;
  for (int t = 0; t < 4; ++t)
    th.emplace_back([&, t] {
      Status s = r->push(make_put(0, 0, 0, 0, 0, 8, kNoFlag, kNoFlag, 100 + t), 400);
      (s.ok() ? ok : timed_out)++;
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  consume();
  consume();
  for (auto& t : th) t.join();
  EXPECT_EQ(ok.load(), 2);
  EXPECT_EQ(timed_out.load(), 2);
  Command c;
  while (r->peek(&c)) {
    seen.push_back(c.user);
    r->pop();
  }
  ASSERT_EQ(seen.size(), 7u);  // 4 + user 6 + 2 racers, in ring order without a gap
  EXPECT_EQ(std::vector<uint64_t>(seen.begin(), seen.begin() + 5), (std::vector<uint64_t>{1, 2, 3, 4, 6}));
  EXPECT_GE(seen[5], 100u);
  EXPECT_GE(seen[6], 100u);
  EXPECT_EQ(r->consumed(), 7u);
}

}  // namespace
}  // namespace test
}  // namespace mk
