// mkernel — the SM-partition controller of one operator, host side (the device side is
// src/comm/split_control.h: the rule, and the sampling the communication role runs).
//
// An operator that runs the controller (the tunable fused_split is "auto", no fixed count was
// asked, more than one rank) keeps one SplitController: at create it takes the learned start
// (SplitMemory: the split an earlier operator with the same key settled on) and puts the device
// state in the session's memory; each launch passes device() to the kernel; the split the calls
// settle on comes back through a mapped pinned word (written by the launch, one call behind) and
// is remembered for the next operator with this key; at destroy it is written to the split
// memory file.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "mkernel/common/status.h"
#include "src/comm/session.h"
#include "src/comm/split_control.h"

namespace mk {
namespace ops {

// The controller's device state as tests read it (SplitController::state).
struct SplitReadout {
  int has_mean = 0;       // a call ran the rule
  int last_mean = 0;      // the split it settled on
  int changes = 0;        // role switches of the latest call
  int stalled = 0;        // tile loads waiting now: 0 once calls are done
  int64_t sample_ns = 0;  // what a sample cost (smoothed)
  int64_t gap_ns = 0;     // the sampling interval in force
};

class SplitController {
 public:
  // The controller runs at most this often (its samples; split_control.h).
  static constexpr int64_t kIntervalNs = 2000;

  // Whether an operator runs it: fused_split=auto, no fixed count asked (comm_ctas_option < 0),
  // more than one rank.
  static bool wanted(int64_t comm_ctas_option, int world);

  SplitController() = default;
  ~SplitController();
  SplitController(const SplitController&) = delete;
  SplitController& operator=(const SplitController&) = delete;

  // Turns it on for `key` (split_key()): the starting count, the learned split or `fallback`.
  int start(const std::string& key, int fallback);
  // The device state, in the session's memory (after start). in_order: the communication role
  // takes ops strictly in program order (no peeking; the rule then keeps its count lower).
  Status setup(comm::OpSession& ses, bool in_order);

  bool on() const { return on_; }
  // A fixed count from now on (set_comm_ctas): launches no longer pass the controller.
  void turn_off() { on_ = false; }
  // What a launch passes the kernel: the device state while on, else null.
  comm::SplitCtl* device() const { return on_ ? d_ctl_ : nullptr; }
  // The split the calls settled on, one call behind (0 before the second call, or when off).
  int settled() const;
  // Remembers the settled split for the next operator with this key (after each launch);
  // write_now also writes the split memory file.
  void remember(bool write_now);
  // At destroy, before the session goes: the last call's split from the device state while it
  // still exists (device_alive: the session lives; waits for the device), remembered and
  // written. The mapped word is freed with the controller.
  void finish(bool device_alive);

  // Tests (through the operators' *_testing.h): the device state, and forced switches.
  Status state(SplitReadout* out, cudaStream_t stream) const;
  Status force(const int* at_tiles, const int* counts, int n, cudaStream_t stream);

 private:
  bool on_ = false;
  std::string key_;
  comm::SplitCtl* d_ctl_ = nullptr;  // session memory (the session frees it)
  int* h_mean_ = nullptr;            // mapped pinned word, written by each launch
  int recorded_ = 0;
};

}  // namespace ops
}  // namespace mk
