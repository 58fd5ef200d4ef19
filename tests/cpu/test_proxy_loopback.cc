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
INSTANTIATE_TEST_SUITE_P(World, Loopback, ::testing::Values(1, 2, 3, 4),
                         [](const auto& i) { return "W" + std::to_string(i.param); });

}  // namespace
}  // namespace test
}  // namespace mk
