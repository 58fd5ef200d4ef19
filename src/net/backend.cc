// net::create_backend: picks the backend kind (config, else tunable net_backend) and builds it.
#include "mkernel/net/backend.h"

#include <cctype>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/topology.h"
#include "src/net/net_internal.h"

namespace mk {
namespace net {

namespace {
std::string lower_trimmed(std::string s) {
  while (!s.empty() && isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t b = 0;
  while (b < s.size() && isspace(static_cast<unsigned char>(s[b]))) ++b;
  s = s.substr(b);
  for (auto& c : s) c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
  return s;
}
}  // namespace

Status create_backend(Bootstrap& bs, const Topology& topo, const BackendConfig& cfg,
                      std::unique_ptr<Backend>* out) {
  MK_REQUIRE(out != nullptr, Code::kInvalidArgument, "create_backend: out is null");
  out->reset();
  MK_REQUIRE(topo.world == bs.size() && topo.rank == bs.rank() &&
                 static_cast<int>(topo.info.size()) == bs.size(),
             Code::kInvalidArgument,
             "create_backend: topology (rank %d of %d, %zu infos) does not match the bootstrap "
             "(rank %d of %d)",
             topo.rank, topo.world, topo.info.size(), bs.rank(), bs.size());
  std::string kind = lower_trimmed(cfg.kind.empty() ? tunables::net_backend()
                                                    : cfg.kind);
  if (kind.empty()) kind = "libfabric";
  MK_INFO(kSubsysNet, "net: backend %s requested (%s)", kind.c_str(),
          cfg.kind.empty() ? "tunable net_backend" : "config");
  if (kind == "libfabric") return create_libfabric_backend(bs, topo, cfg.provider, out);
  if (kind == "loopback") return create_loopback_backend(bs, topo, cfg.loopback_queue_depth, out);
  return make_status(Code::kInvalidArgument,
                     "unknown network backend '%s' (expected libfabric or loopback)",
                     kind.c_str());
}

// "tcp_rxm" -> "tcp;ofi_rxm" (a spelling without ';' for shells and CMake lists).
std::string normalize_provider(std::string p) {
  while (!p.empty() && isspace(static_cast<unsigned char>(p.back()))) p.pop_back();
  size_t b = 0;
  while (b < p.size() && isspace(static_cast<unsigned char>(p[b]))) ++b;
  p = p.substr(b);
  for (auto& c : p) c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
  if (p.find(';') != std::string::npos) return p;
  size_t u = p.rfind('_');
  if (u != std::string::npos && u > 0) {
    std::string util = p.substr(u + 1);
    if (util == "rxm" || util == "rxd") return p.substr(0, u) + ";ofi_" + util;
  }
  return p;
}

}  // namespace net
}  // namespace mk
