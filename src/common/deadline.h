// mkernel — time limits that never wrap: a deadline or a nanosecond count from a caller's (or a
// setting's) millisecond count saturates instead of overflowing, so a huge limit waits long and a
// negative one does not wait, rather than either failing at once (a deadline in the past) or
// never (a count that wrapped).
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>

namespace mk {

// A hundred years: longer than any wait, and far from steady_clock's range (about 292 years of ns).
constexpr int64_t kForeverMs = int64_t{100} * 365 * 24 * 3600 * 1000;

// steady_clock::now() + ms, with ms clamped to [0, kForeverMs].
inline std::chrono::steady_clock::time_point deadline_after_ms(int64_t ms) {
  const int64_t c = ms < 0 ? 0 : (ms > kForeverMs ? kForeverMs : ms);
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(c);
}

// ms in nanoseconds: 0 for ms <= 0, UINT64_MAX where the product would not fit.
inline uint64_t ms_to_ns(int64_t ms) {
  if (ms <= 0) return 0;
  const uint64_t u = static_cast<uint64_t>(ms);
  return u > std::numeric_limits<uint64_t>::max() / 1000000u ? std::numeric_limits<uint64_t>::max() : u * 1000000u;
}

}  // namespace mk
