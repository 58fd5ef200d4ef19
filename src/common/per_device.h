// mkernel — a value computed once per CUDA device (library-internal): the co-resident CTAs of a
// persistent kernel, which take function attributes and an occupancy query that every launch
// would otherwise repeat. Thread-safe; the computation runs under the cache's lock, so racing
// threads compute it once.
#pragma once

#include <map>
#include <mutex>

#include "mkernel/common/check.h"
#include "mkernel/common/status.h"

namespace mk {

class PerDeviceValue {
 public:
  // The value for `device`: cached, or compute(&value) (a Status-returning callable); a failed
  // computation is not cached.
  template <class Compute>
  Status get(int device, Compute&& compute, int* out) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = known_.find(device);
    if (it == known_.end()) {
      int v = 0;
      MK_CHECK(compute(&v));
      it = known_.emplace(device, v).first;
    }
    *out = it->second;
    return OkStatus();
  }

 private:
  std::mutex mu_;
  std::map<int, int> known_;
};

}  // namespace mk
