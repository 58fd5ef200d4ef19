// Shared test helpers.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/common/tunables.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/communicator.h"

namespace mk {
namespace test {

// Asserts a Status is ok and prints its message otherwise.
#define MK_ASSERT_OK(expr)                                    \
  do {                                                        \
    ::mk::Status mk_t_s_ = (expr);                            \
    ASSERT_TRUE(mk_t_s_.ok()) << #expr << ": " << mk_t_s_.to_string(); \
  } while (0)
#define MK_EXPECT_OK(expr)                                    \
  do {                                                        \
    ::mk::Status mk_t_s_ = (expr);                            \
    EXPECT_TRUE(mk_t_s_.ok()) << #expr << ": " << mk_t_s_.to_string(); \
  } while (0)

// The run's seed: MK_TEST_SEED if set (decimal or 0x-hex), else fresh_seed() drawn once. The
// mains print it at the start and after every failing test, so `MK_TEST_SEED=<n>` replays a run.
// Thread-safe. Derive every random input of a test from it (mix(test_seed(), tag)).
uint64_t test_seed();
// Sets the run's seed (the MPI main: rank 0's seed on every rank) and MK_TEST_SEED for children.
void set_test_seed(uint64_t seed);
// A new random value (not cached): std::random_device mixed with the clock.
uint64_t fresh_seed();

// Mixes two 64-bit values (seed derivation).
uint64_t mix(uint64_t a, uint64_t b);

// Rank-tagged random bytes: a function of (seed, op, rank), so every rank can compute what
// every other rank sent. For n >= 8 the first bytes also spell out rank and op.
std::vector<uint8_t> rank_payload(uint64_t op, int rank, size_t n);

// True when a CUDA device is usable in this process.
bool have_gpu();

// A communicator of one rank (a thread world of one) on a GPU this process can use.
Status make_one_rank_comm(std::unique_ptr<Communicator>* out);

// A key-value store kept as files of `dir` (atomic renames), for processes of one host that
// bootstrap without MPI (make_store_bootstrap): fault tests fork or spawn their ranks, so that
// no launcher tears the job down for them.
StoreCallbacks file_store(const std::string& dir);

// Where a process that should have left is stuck, for a failure message: every thread's stack
// from gdb (`thread apply all bt`, bounded to 30 s) when gdb is there, else each thread's name
// and kernel wait channel from /proc. At most max_chars.
std::string stacks_of(int pid, size_t max_chars = 12000);

// MK_TEST_SMALL=1 (the device sanitizer runs, scripts/device/sanitize_check.sh): tests that
// loop over shapes leave out their large ones, keeping every code path at fewer tiles.
bool small_shapes();

// MK_TEST_STRIDE=n (n >= 1; the sanitizer stage, scripts/sanitize.sh, sets 4): the CPU plan
// tests (fused GEMM, ring attention, collectives) keep one in n of their sweep configurations and
// of their mutants, from an offset drawn from the run seed (runs cover different ones;
// MK_TEST_SEED replays a run's choice). Unset or 1: all of them, as scripts/test.sh runs them.
// Read at static initialization too (the sweeps' lists); a value that is not a number >= 1 aborts.
uint64_t test_stride();
template <class T>
std::vector<T> strided(std::vector<T> v) {
  const uint64_t n = test_stride();
  if (n <= 1 || v.empty()) return v;
  const uint64_t off = mix(test_seed(), 0x57121de) % n;
  std::vector<T> out;
  for (size_t i = off; i < v.size(); i += n) out.push_back(std::move(v[i]));
  if (out.empty()) out.push_back(std::move(v[off % v.size()]));  // a short list keeps one
  return out;
}

// Sets a tunable for the scope of a test (a failed set is a test failure), then drops the override.
struct ScopedTunable {
  std::string name;
  ScopedTunable(const std::string& n, const std::string& v) : name(n) { EXPECT_TRUE(tunables::set(n, v).ok()); }
  ~ScopedTunable() { (void)tunables::reset(name); }
};

// Exit code that ctest (SKIP_RETURN_CODE) reports as "skipped".
constexpr int kSkipExitCode = 77;

// ---- For the gtest mains (tests/common/*_main.cc).
// A listener that prints the run seed (and how to replay it) after every failing test;
// rank >= 0 prefixes the line with the rank.
::testing::TestEventListener* new_seed_reporter(int rank = -1);
// "Suite.Test: reason" for every test that was skipped in this process (GTEST_SKIP).
std::vector<std::string> skipped_tests();
// The process's exit code after RUN_ALL_TESTS() returned `rc`: 1 if anything failed, else
// kSkipExitCode if any test was skipped (ctest reports the binary as skipped, never as passed),
// else 0. Prints the skipped tests (prefixed with `rank` when >= 0; `quiet`: only the count).
int exit_code(int rc, int rank = -1, bool quiet = false);

}  // namespace test
}  // namespace mk
