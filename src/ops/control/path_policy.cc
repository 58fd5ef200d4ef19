// mkernel — policy "auto" (path_policy.h).
#include "src/ops/control/path_policy.h"

#include <algorithm>
#include <cmath>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"

namespace mk {
namespace ops {

const char* path_name(Path p) { return p == Path::kFused ? "fused" : "unfused"; }

double PathChooser::median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Path PathChooser::next(const std::string& key, bool* timed) {
  std::lock_guard<std::mutex> g(mu_);
  Entry& e = entries_[key];
  *timed = false;
  if (e.decided) return e.choice;
  // Warm-up: each path cfg_.warmup times (fused first); then alternate, fused first, each
  // timed until it has asked for cfg_.trials timings; past that (timings still on their way)
  // keep alternating, untimed.
  const int warm = std::max(cfg_.warmup, 0);
  Path p;
  if (e.issued[0] < warm) {
    p = Path::kFused;
  } else if (e.issued[1] < warm) {
    p = Path::kUnfused;
  } else {
    p = e.issued[0] <= e.issued[1] ? Path::kFused : Path::kUnfused;
    const int i = static_cast<int>(p);
    if (e.timed_asked[i] < std::max(cfg_.trials, 1)) {
      ++e.timed_asked[i];
      *timed = true;
    }
  }
  ++e.issued[static_cast<int>(p)];
  return p;
}

Status PathChooser::report(const std::string& key, Path p, double ms) {
  MK_REQUIRE(std::isfinite(ms) && ms > 0, Code::kInvalidArgument, "policy auto: time %g ms for '%s' (must be > 0)",
             ms, key.c_str());
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(key);
  MK_REQUIRE(it != entries_.end(), Code::kInvalidArgument, "policy auto: a time for '%s', which never ran",
             key.c_str());
  Entry& e = it->second;
  const int i = static_cast<int>(p);
  MK_REQUIRE(static_cast<int>(e.ms[i].size()) < e.timed_asked[i], Code::kInvalidArgument,
             "policy auto: more %s times for '%s' than timed calls (%d)", path_name(p), key.c_str(),
             e.timed_asked[i]);
  e.ms[i].push_back(ms);
  const size_t want = static_cast<size_t>(std::max(cfg_.trials, 1));
  if (!e.decided && e.ms[0].size() >= want && e.ms[1].size() >= want) {
    const double f = median(e.ms[0]), u = median(e.ms[1]);
    e.choice = u < f ? Path::kUnfused : Path::kFused;
    e.decided = true;
    MK_INFO(kSubsysTune, "policy auto: %s -> %s (median fused %.4f ms, unfused %.4f ms over %zu calls each)",
            key.c_str(), path_name(e.choice), f, u, want);
  }
  return OkStatus();
}

bool PathChooser::decided(const std::string& key, Path* p) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end() || !it->second.decided) return false;
  *p = it->second.choice;
  return true;
}

void PathChooser::medians(const std::string& key, double* fused_ms, double* unfused_ms) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(key);
  *fused_ms = it == entries_.end() ? 0 : median(it->second.ms[0]);
  *unfused_ms = it == entries_.end() ? 0 : median(it->second.ms[1]);
}

}  // namespace ops
}  // namespace mk
