// mkernel — policy "auto": fused or unfused, per call shape, from measurement (host code).
//
// A fused operator is not faster than its unfused form (the GEMM, then the collective) at
// every shape: a small GEMM has too few tiles to hide the traffic behind, and the fused kernel
// gives CTAs to communication. Under policy auto an operator times both paths on its first
// calls with a key — warm-up calls of each first, then the two alternating until each has
// `trials` timings — and from then on takes the path with the lower median (fused on a tie).
// The choice is cached per key for the process.
//
// Timings come back late (from CUDA events, read without a sync on later calls), so which path
// a call takes depends only on the calls issued so far; a key whose timings lag keeps
// alternating until they are in.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {
namespace ops {

enum class Path : int { kFused = 0, kUnfused = 1 };
const char* path_name(Path p);

struct PathPolicyConfig {
  int warmup = 1;  // calls of each path before timing
  int trials = 5;  // timed calls of each path
};

class PathChooser {
 public:
  explicit PathChooser(PathPolicyConfig cfg = {}) : cfg_(cfg) {}

  // Which path the next call with `key` takes, and whether its time is wanted (*timed: report
  // it). Counts the call as issued.
  Path next(const std::string& key, bool* timed);
  // A timed call's time (ms, > 0). kInvalidArgument for a key, path or time never asked for.
  Status report(const std::string& key, Path p, double ms);
  // The decision for `key`, once made.
  bool decided(const std::string& key, Path* p) const;
  // Both paths' median so far (ms; 0 when none), for logs and benchmarks.
  void medians(const std::string& key, double* fused_ms, double* unfused_ms) const;

 private:
  struct Entry {
    int issued[2] = {0, 0};
    int timed_asked[2] = {0, 0};
    std::vector<double> ms[2];
    bool decided = false;
    Path choice = Path::kFused;
  };
  static double median(std::vector<double> v);

  PathPolicyConfig cfg_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

}  // namespace ops
}  // namespace mk
