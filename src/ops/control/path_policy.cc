// mkernel — the path policy of a fused operator (path_policy.h).
#include "src/ops/control/path_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"

namespace mk {
namespace ops {

const char* path_name(Path p) { return p == Path::kFused ? "fused" : "unfused"; }
const char* path_mode_name(PathMode m) {
  return m == PathMode::kFused ? "fused" : m == PathMode::kUnfused ? "unfused" : "auto";
}
Status parse_path_mode(const std::string& s, PathMode* out) {
  if (s == "fused") *out = PathMode::kFused;
  else if (s == "unfused") *out = PathMode::kUnfused;
  else if (s == "auto") *out = PathMode::kAuto;
  else return make_status(Code::kInvalidArgument, "path '%s' is not fused, unfused or auto", s.c_str());
  return OkStatus();
}

PathPolicy::PathPolicy(PathMode mode, PathPolicyConfig cfg) : mode_(mode), cfg_(cfg) {
  cfg_.warmup = std::max(cfg_.warmup, 0);
  cfg_.trials = std::max(cfg_.trials, 1);
  auto block = [&](Path p, int timed) {
    if (timed <= 0) return;
    for (int i = 0; i < cfg_.warmup; ++i) schedule_.push_back({p, false});
    for (int i = 0; i < timed; ++i) schedule_.push_back({p, true});
  };
  const int first = (cfg_.trials + 1) / 2;
  block(Path::kFused, first);
  block(Path::kUnfused, cfg_.trials);
  block(Path::kFused, cfg_.trials - first);
}

double PathPolicy::median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

PathPolicy::Call PathPolicy::next() {
  Call c;
  if (mode_ == PathMode::kFused || mode_ == PathMode::kUnfused || decided_) {
    c.path = mode_ == PathMode::kUnfused ? Path::kUnfused : mode_ == PathMode::kFused ? Path::kFused : choice_;
    ++calls_;
    return c;
  }
  // The blocks of the schedule (path_policy.h), then decide.
  if (calls_ >= int(schedule_.size())) {
    c.decide_before = true;
    return c;
  }
  c.path = schedule_[size_t(calls_)].path;
  c.timed = schedule_[size_t(calls_)].timed;
  if (c.timed) ++timed_[int(c.path)];
  ++calls_;
  return c;
}

Status PathPolicy::report(Path p, double ms) {
  MK_REQUIRE(std::isfinite(ms) && ms > 0, Code::kInvalidArgument, "path policy: a time of %g ms (must be > 0)", ms);
  const int i = int(p);
  MK_REQUIRE(int(ms_[i].size()) < timed_[i], Code::kInvalidArgument,
             "path policy: more %s times than timed calls (%d)", path_name(p), timed_[i]);
  ms_[i].push_back(ms);
  return OkStatus();
}

double PathPolicy::median(Path p) const { return median_of(ms_[int(p)]); }

void PathPolicy::decide(const std::vector<double>& fused_ms, const std::vector<double>& unfused_ms) {
  double f = 0, u = 0;
  bool missing = fused_ms.empty() || unfused_ms.empty();
  for (double v : fused_ms) missing |= !(v > 0), f = std::max(f, v);
  for (double v : unfused_ms) missing |= !(v > 0), u = std::max(u, v);
  choice_ = !missing && u < f ? Path::kUnfused : Path::kFused;
  ms_at_decision_[0] = f;
  ms_at_decision_[1] = u;
  decided_ = true;
}

void PathPolicy::preset(Path p) {
  choice_ = p;
  decided_ = true;
  preset_ = true;
}

std::string PathPolicy::describe() const {
  if (mode_ != PathMode::kAuto) return path_mode_name(mode_);
  char b[200];
  if (!decided_)
    snprintf(b, sizeof b, "auto: deciding (call %d of %zu)", calls_, schedule_.size());
  else if (preset_)
    snprintf(b, sizeof b, "auto: %s (remembered)", path_name(choice_));
  else
    snprintf(b, sizeof b, "auto: %s (fused %.4f ms, unfused %.4f ms, the slowest rank's medians)", path_name(choice_),
             ms_at_decision_[0], ms_at_decision_[1]);
  return b;
}

}  // namespace ops
}  // namespace mk
