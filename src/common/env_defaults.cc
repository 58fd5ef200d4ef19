#include "src/common/env_defaults.h"

#include <cstdlib>
#include <mutex>

namespace mk {

void apply_env_defaults() {
  static std::once_flag once;
  std::call_once(once, [] { setenv("FI_OFI_RXD_MAX_UNACKED", "8", /*overwrite=*/0); });
}

int rxd_max_unacked() {
  const char* v = getenv("FI_OFI_RXD_MAX_UNACKED");
  if (!v || !*v) return 128;  // libfabric's default
  const int x = atoi(v);
  return x > 0 ? x : 128;
}

}  // namespace mk
