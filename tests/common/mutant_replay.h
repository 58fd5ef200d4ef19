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

#include <cstdint>
#include <cstdlib>

#include "src/comm/replay.h"

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

}  // namespace test
}  // namespace mk
