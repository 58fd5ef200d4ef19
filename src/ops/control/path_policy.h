// mkernel — the path policy of a fused operator: fused, or unfused (the GEMM, then the standalone
// collective), or auto — chosen per operator instance from timed calls (host code).
//
// A fused operator is not faster than its unfused form at every shape: a small GEMM has too few
// tiles to hide the traffic behind, and the fused kernel gives CTAs to communication. Under
// auto an operator times both paths on its first calls, in blocks of consecutive calls of one
// path as the calls after the decision will run (back to back; a call's time depends on the
// call before it: on one GPU shared by the ranks, unfused calls alternating with fused ones ran
// 2-5x faster than unfused calls back to back, 2026-12-05), fused-unfused-fused so that a drift
// (clocks) weighs on both: fused `warmup` untimed + ceil(trials / 2) timed, unfused `warmup` +
// `trials` timed, fused `warmup` + floor(trials / 2) timed — and then decides, once.
//
// Every rank must take the same path on every call (the paths run different programs), so the
// sequence of paths depends only on the number of calls made, and the decision is collective:
// at the call after the last timed one every rank hands in its medians and the ranks agree
// (decide(): the path whose slowest rank is faster; fused on a tie). The operator does that
// exchange (a host collective, once per operator) and remembers the choice (SplitMemory's file).
#pragma once

#include <string>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {
namespace ops {

enum class Path : int { kFused = 0, kUnfused = 1 };
const char* path_name(Path p);  // "fused", "unfused"

enum class PathMode : int { kFused = 0, kUnfused = 1, kAuto = 2 };
const char* path_mode_name(PathMode m);  // "fused", "unfused", "auto"
// "fused" | "unfused" | "auto"; kInvalidArgument naming the value otherwise.
Status parse_path_mode(const std::string& s, PathMode* out);

struct PathPolicyConfig {
  int warmup = 1;  // calls of each path before timing (>= 0)
  int trials = 5;  // timed calls of each path (>= 1)
};

class PathPolicy {
 public:
  explicit PathPolicy(PathMode mode = PathMode::kFused, PathPolicyConfig cfg = {});

  PathMode mode() const { return mode_; }
  // Whether every later call's path is known without timing: not auto, or auto decided.
  bool settled() const { return mode_ != PathMode::kAuto || decided_; }

  struct Call {
    Path path = Path::kFused;
    bool timed = false;          // report() this call's time
    bool decide_before = false;  // auto: the trials are in; decide() first, then next() again
  };
  // The next call's path (counts the call unless decide_before).
  Call next();
  // This rank's time of a timed call of path p (ms > 0; at most as many as timed calls of p).
  Status report(Path p, double ms);
  // This rank's median of path p's timings (ms; 0 when none).
  double median(Path p) const;
  // The decision, from every rank's medians (the same vectors on every rank): the path whose
  // slowest rank is faster; fused on a tie or when any time is missing (<= 0).
  void decide(const std::vector<double>& fused_ms, const std::vector<double>& unfused_ms);
  // A decision known before any call (remembered from an earlier run): auto takes it from now.
  void preset(Path p);

  bool decided() const { return decided_; }
  Path choice() const { return choice_; }
  // The slowest rank's medians the decision was made on (0 when preset).
  double decided_fused_ms() const { return ms_at_decision_[0]; }
  double decided_unfused_ms() const { return ms_at_decision_[1]; }
  // "fused", "unfused", "auto: deciding (call 3 of 12)", "auto: unfused (fused 1.20 ms, unfused
  // 0.95 ms, the slowest rank's medians)", "auto: fused (remembered)".
  std::string describe() const;

 private:
  static double median_of(std::vector<double> v);
  struct Step {
    Path path;
    bool timed;
  };

  PathMode mode_;
  PathPolicyConfig cfg_;
  std::vector<Step> schedule_;  // auto: the calls before the decision
  int calls_ = 0;
  int timed_[2] = {0, 0};
  std::vector<double> ms_[2];
  bool decided_ = false;
  bool preset_ = false;
  Path choice_ = Path::kFused;
  double ms_at_decision_[2] = {0, 0};
};

}  // namespace ops
}  // namespace mk
