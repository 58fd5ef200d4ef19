// mkernel — plain views of symmetric memory that kernels take by value (host and device).
#pragma once

#include <cstdint>

namespace mk {

// A symmetric buffer as device code sees it. peers[r] is rank r's copy mapped into this
// rank's address space, or nullptr when r is on another node (reach it through the network).
struct SymmetricView {
  void* local;
  void* const* peers;  // device array [world]
  uint64_t bytes;
  int32_t rank;
  int32_t world;
};

// A pad of 64-bit flags in symmetric memory: local[i] is this rank's flag i, peers[r] is
// rank r's pad (nullptr across nodes).
struct SignalView {
  uint64_t* local;
  uint64_t* const* peers;
  uint32_t count;
  int32_t rank;
  int32_t world;
  int32_t pad;
};

// Per-call epoch counter in device memory (see epoch.cuh for the protocol).
struct EpochState {
  uint64_t value;     // number of completed calls
  uint32_t arrived;   // CTAs of the current call that have finished
  uint32_t pad;
};
static_assert(sizeof(EpochState) == 16, "EpochState lives in device memory");

}  // namespace mk
