// How the CPU mutation tests replay a broken communication program (ring attention, MoE):
// replay k of a mutant, and how many replays a mutant gets.
//
// Replays cycle through the configuration's communication slots and 4, 8 and 16 (the device runs
// any number of communication CTAs; a wait that guards an op against one several places ahead
// of it shows only when that many run at once), with lopsided speeds (5 levels) and one op in
// 32 held until nothing else can move (src/comm/replay.h). The rarest mutants (a network put's
// entry wait dropped: the rest of the ring must run into the next call while one rank still has
// to read its mirror) need a few hundred replays: at most 752 in 30 runs of ring attention's
// W4n2 staged case (MK_TEST_SEED 101..130); without held ops up to 1436, and one miss in 2048
// (bench/results/2026-12-04-test-strength.md).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "src/comm/replay.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {

// Replays a mutant gets before it counts as not rejected.
constexpr uint64_t kMutantReplays = 2048;

// The options of replay k of a mutant, under `seed`.
inline comm::ReplayOptions mutant_replay(uint64_t seed, int config_slots, int compute_slots, uint64_t k) {
  const int slots[] = {config_slots, 4, 8, 16};
  comm::ReplayOptions o;
  o.seed = seed;
  o.comm_slots = slots[k % 4];
  o.compute_slots = compute_slots;
  o.calls = 3;
  o.speed_levels = 5;
  o.hold_one_in = 32;
  return o;
}

// Replays of each implied mutant (a dropped wait that changes nothing), which must all pass:
// 64, or MK_IMPLIED_REPLAYS.
inline uint64_t implied_replays() {
  const char* env = getenv("MK_IMPLIED_REPLAYS");
  return env ? std::strtoull(env, nullptr, 10) : 64;
}

// A broken program: `apply` breaks a copy of it; `implied`: a dropped wait that changes nothing
// (the test that marks it says why).
struct ProgramMutant {
  std::string what;
  std::function<void(comm::Program&)> apply;
  bool implied = false;
};

// `reject(m, k)`: "" when replay k of program m passes, else why it failed (k = 0 may also run
// the static check). Each mutant but the implied ones must fail one of kMutantReplays; each
// implied one must pass implied_replays() (a replay that caught one would prove its argument
// wrong). Prints a summary line under `name`; returns how many were rejected.
inline int rejected_mutants(const comm::Program& p, const std::vector<ProgramMutant>& ms, const std::string& name,
                            const std::function<std::string(const comm::Program&, uint64_t)>& reject) {
  int caught = 0, implied = 0;
  uint64_t most = 0;
  for (const ProgramMutant& mu : ms) {
    comm::Program m = p;
    mu.apply(m);
    std::string why;
    if (mu.implied) {
      ++implied;
      for (uint64_t k = 0; why.empty() && k < implied_replays(); ++k) why = reject(m, k);
      EXPECT_EQ(why, "") << name << ": an implied wait dropped, yet caught: " << mu.what;
      continue;
    }
    uint64_t k = 0;
    for (; why.empty() && k < kMutantReplays; ++k) why = reject(m, k);
    most = std::max(most, k);
    EXPECT_FALSE(why.empty()) << name << ": mutant not rejected in " << kMutantReplays << " replays: " << mu.what
                              << " (MK_TEST_SEED=" << test_seed() << ")";
    caught += !why.empty();
  }
  printf("%s: %zu mutants, %d rejected (at most %llu replays), %d implied ones unseen in %llu replays each\n",
         name.c_str(), ms.size() - size_t(implied), caught, static_cast<unsigned long long>(most), implied,
         static_cast<unsigned long long>(implied_replays()));
  return caught;
}

}  // namespace test
}  // namespace mk
