// mkernel — random bytes from the operating system (getrandom(2)): for secrets and for names
// and keys another process must not guess (IPC tokens and socket names, memory keys).
#pragma once

#include <cstddef>

#include "mkernel/common/status.h"

namespace mk {

// n bytes from getrandom(2), blocking until the pool is initialized (as at boot).
Status random_bytes(void* buf, size_t n);

}  // namespace mk
