// Private helpers shared by the bootstrap implementations.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/status.h"
#include "src/common/deadline.h"

namespace mk {
namespace detail {

// "0,3,5" (truncated after 16 entries).
std::string rank_list(const std::vector<int>& ranks);
// The one error every waiting rank returns when ranks are missing.
Status missing_ranks_status(const char* kind, const char* op, uint64_t seq,
                            const std::vector<int>& missing, int64_t timeout_ms);

// The byte count of one rank's part of an allgather: the whole (bytes x ranks) must fit a size_t
// and one part at most max_part bytes (MPI counts are ints). kInvalidArgument otherwise.
inline Status check_allgather_bytes(const char* kind, size_t bytes, int ranks, size_t max_part) {
  size_t total = 0;
  if (bytes > max_part || __builtin_mul_overflow(bytes, static_cast<size_t>(ranks), &total))
    return make_status(Code::kInvalidArgument, "%s bootstrap allgather: %zu bytes per rank x %d ranks is too many (at most %zu per rank)",
                       kind, bytes, ranks, max_part);
  return OkStatus();
}

// Polling backoff: spins briefly, then sleeps up to 1 ms, so a long wait costs little CPU.
class Backoff {
 public:
  void pause() {
    if (n_ < 64) {
      ++n_;
      std::this_thread::yield();
      return;
    }
    sleep_us_ = sleep_us_ < 1000 ? sleep_us_ * 2 : 1000;
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
  }

 private:
  int n_ = 0;
  int sleep_us_ = 1;
};

using Clock = std::chrono::steady_clock;

}  // namespace detail
}  // namespace mk
