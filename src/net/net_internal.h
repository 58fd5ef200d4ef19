// Private: the per-kind constructors behind net::create_backend (src/net/backend.cc).
#pragma once

#include <memory>
#include <string>

#include "mkernel/net/backend.h"

namespace mk {
namespace net {

// C. provider: the configured name, "" for the tunable net_provider, or "auto".
Status create_libfabric_backend(Bootstrap& bs, const Topology& topo, const std::string& provider,
                                std::unique_ptr<Backend>* out);
// C. Every rank must be a thread of this process.
Status create_loopback_backend(Bootstrap& bs, const Topology& topo, uint32_t queue_depth,
                               std::unique_ptr<Backend>* out);

}  // namespace net
}  // namespace mk
