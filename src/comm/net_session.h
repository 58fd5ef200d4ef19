// The network side of an operator whose ranks span several nodes: backend, proxy, windows, and
// the pad of flags the proxy raises. Shared by the fused GEMM collectives and ring attention.
//
// Nothing the application does with CUDA may stall a call in flight, so the proxy makes no
// CUDA call while kernels wait for it:
//  - Flags the proxy raises (arrivals, local completions) live in pinned host memory mapped
//    for the GPU: the proxy raises them with plain release stores and kernels poll them.
//  - Staged mode (net_staging=always, or auto when some rank cannot register GPU memory): the
//    windows are pinned host buffers. Kernels copy into them before a put and read from them
//    after an arrival (their communication CTAs do the copies), so the proxy only moves host
//    memory. Every provider can register host memory.
//  - Direct mode (net_staging=never, or auto when every rank can register GPU memory): the
//    windows are the GPU buffers themselves (GPUDirect RDMA); the proxy flushes the NIC's writes
//    (cuFlushGPUDirectRDMAWrites) before a flag that vouches for them rises.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/net/backend.h"
#include "mkernel/proxy/proxy.h"
#include "mkernel/device/ring_view.h"

namespace mk {

class Communicator;

namespace comm {

class NetSession {
 public:
  // Collective (agreed: the same error on every rank): the backend, and whether traffic is
  // staged. staging: "auto", "always", "never" or "" (tunable net_staging).
  static Status create(Communicator* comm, const std::string& staging, std::unique_ptr<NetSession>* out);
  ~NetSession();
  NetSession(const NetSession&) = delete;
  NetSession& operator=(const NetSession&) = delete;

  bool staged() const { return staged_; }
  std::string backend_name() const { return be_->name(); }
  // "libfabric/tcp;ofi_rxm, staged through pinned host memory (rank 1: ...)"
  const std::string& describe() const { return what_; }

  // Collective, direct mode only: a window over this rank's GPU buffer (sizes may differ).
  Status add_gpu_window(void* base, uint64_t bytes, uint32_t* id);
  // Collective: `bytes` of zeroed pinned host memory, mapped for the GPU (*ptr is valid on the
  // host and, through unified addressing, on the device), registered as a window.
  Status add_host_window(uint64_t bytes, void** ptr, uint32_t* id);

  // The proxy's flag pad (host memory mapped for the GPU; n_flags entries, zeroed; after start).
  uint64_t* flags() const { return flags_; }
  uint32_t flag_count() const { return n_flags_; }
  // The command ring as kernels push into it (after start()).
  RingView ring_view(const uint64_t* abort) const;
  // Collective: allocates the proxy's flag pad (n_flags) and starts the proxy, after the windows
  // are added. Its failures abort the communicator.
  Status start(uint32_t n_flags);
  // Collective, idempotent, bounded: drains the proxy (briefly when the communicator has
  // failed: puts to a dead peer never complete), deregisters, frees the host memory.
  Status destroy();

 private:
  NetSession() = default;
  Communicator* comm_ = nullptr;
  bool staged_ = false;
  std::string what_;
  std::unique_ptr<net::Backend> be_;
  std::unique_ptr<ProxyWindows> wins_;
  uint64_t* flags_ = nullptr;
  uint32_t n_flags_ = 0;
  std::unique_ptr<HostFlagSink> sink_;
  std::unique_ptr<Proxy> proxy_;
  std::vector<void*> host_;
  bool started_ = false;
  bool destroyed_ = false;
};

}  // namespace comm
}  // namespace mk
