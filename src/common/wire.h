// mkernel — what arrives from another rank (through the bootstrap or a store) is not trusted to be
// well formed: its strings are terminated before use and its status codes mapped into range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "mkernel/common/status.h"

namespace mk {

// Terminates a received fixed-size string at its last byte (a peer may have filled it).
template <size_t N>
inline void terminate_received(char (&s)[N]) {
  s[N - 1] = '\0';
}
// True when a received fixed-size string holds its terminator.
template <size_t N>
inline bool is_terminated(const char (&s)[N]) {
  return memchr(s, '\0', N) != nullptr;
}

// A peer's mk::Code: an unknown value (a newer build, or garbage) reads as kRemoteError, so a
// received failure never turns into kOk or an out-of-range enum.
inline Code code_from_wire(int32_t c) {
  if (c <= 0 || c > static_cast<int32_t>(Code::kInternal)) return Code::kRemoteError;
  return static_cast<Code>(c);
}

}  // namespace mk
