// mkernel — the command ring as producers see it (plain struct; kernels take it by value).
#pragma once

#include <cstdint>

#include "mkernel/device/command.h"

namespace mk {

struct RingView {
  Command* slots;                  // [capacity], pinned host memory mapped for the GPU
  unsigned long long* head;        // claim counter: device memory (GPU producers)
  const uint64_t* tail;            // commands the proxy has consumed; pinned host, mapped
  const uint64_t* abort;           // non-zero once the communicator failed (pinned host)
  uint64_t capacity;               // a power of two
};
static_assert(sizeof(RingView) == 40, "RingView is a kernel parameter");

}  // namespace mk
