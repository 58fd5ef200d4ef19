// mkernel — objects kept until the process exits (keep_until_exit.h).
#include "src/common/keep_until_exit.h"

#include <mutex>
#include <vector>

namespace mk {

void keep_until_exit(std::shared_ptr<void> p) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // never freed: the point
  std::lock_guard<std::mutex> g(mu);
  kept->push_back(std::move(p));
}

}  // namespace mk
