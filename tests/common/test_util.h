// Shared test helpers.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "mkernel/common/status.h"

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

// A fresh seed per run (printed, so a failure can be replayed with MK_TEST_SEED=...).
uint64_t test_seed();
// A new random value (not cached); test_seed() reads MK_TEST_SEED or calls this once.
uint64_t fresh_seed();

// Mixes two 64-bit values (seed derivation).
uint64_t mix(uint64_t a, uint64_t b);

// Rank-tagged random bytes: a function of (seed, op, rank), so every rank can compute what
// every other rank sent. For n >= 8 the first bytes also spell out rank and op.
std::vector<uint8_t> rank_payload(uint64_t op, int rank, size_t n);

// True when a CUDA device is usable in this process.
bool have_gpu();

// Exit code that ctest (SKIP_RETURN_CODE) reports as "skipped".
constexpr int kSkipExitCode = 77;

}  // namespace test
}  // namespace mk
