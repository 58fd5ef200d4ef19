// Built when libfabric is absent: the libfabric backend reports itself unsupported.
#include "mkernel/net/backend.h"
#include "src/net/net_internal.h"

namespace mk {
namespace net {

Status create_libfabric_backend(Bootstrap&, const Topology&, const std::string& provider,
                                std::unique_ptr<Backend>* out) {
  out->reset();
  return make_status(Code::kNotSupported,
                     "libfabric backend: this mkernel was built without libfabric (provider '%s' "
                     "requested); install libfabric's headers and rebuild, or use "
                     "MK_NET_BACKEND=loopback for ranks that are threads of one process",
                     provider.c_str());
}

std::vector<std::string> libfabric_providers() { return {}; }

}  // namespace net
}  // namespace mk
