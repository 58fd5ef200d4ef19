#include "src/common/random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdint>

#include "mkernel/common/check.h"

namespace mk {

Status random_bytes(void* buf, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  size_t got = 0;
  while (got < n) {
    const ssize_t k = getrandom(p + got, n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    MK_SYS_CHECK(k);
    got += static_cast<size_t>(k);
  }
  return OkStatus();
}

}  // namespace mk
