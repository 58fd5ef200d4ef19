// mkernel — objects kept, reachable, until the process exits. For state that a thread which
// was given up (stuck inside a call that does not return) may still use: destroying it would
// free memory under that thread, so its owners park it here instead.
#pragma once

#include <memory>

namespace mk {

// Keeps `p` (and what it owns) alive until the process exits; never destroyed. Thread-safe.
void keep_until_exit(std::shared_ptr<void> p);

template <class T>
void keep_until_exit(std::unique_ptr<T>&& p) {
  if (p) keep_until_exit(std::shared_ptr<void>(std::move(p)));
}

}  // namespace mk
