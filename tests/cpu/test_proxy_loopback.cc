// Proxy conformance over the loopback backend: ranks as threads of one process.
#include "tests/cpu/proxy_suite.h"

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

INSTANTIATE_TEST_SUITE_P(World, Loopback, ::testing::Values(1, 2, 3, 4),
                         [](const auto& i) { return "W" + std::to_string(i.param); });

}  // namespace
}  // namespace test
}  // namespace mk
