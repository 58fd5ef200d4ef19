// mkernel — the network backend interface (version 1).
//
// A backend moves bytes from a local registered window into a peer's registered window and
// tells the peer when they have landed. It is driven by one proxy thread per rank: no entry is
// thread-safe, and only register/deregister/finalize are collective. Errors name the peer.
//
// Contract per entry (B = may block, NB = never blocks, C = collective over the bootstrap):
//   register_window    B C  the caller owns the memory; it must outlive the window
//   deregister_window  B C  idempotent
//   put                NB   *posted=false means "no resources now" (-FI_EAGAIN): call progress()
//                           and retry; the source bytes must stay unchanged until the put's
//                           LocalDone(cookie) comes back
//   progress           NB   appends completed local puts and remote arrivals; returns an error
//                           (naming the peer) when a put failed or a peer is gone
//   finalize           B C  idempotent; after it only the destructor may be called
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {

class Bootstrap;
struct Topology;

namespace net {

constexpr uint32_t kBackendApiVersion = 2;

// Window ids are the same on every rank: windows are registered collectively, in order.
using WindowId = uint32_t;
constexpr WindowId kNoWindow = 0xffffffffu;

enum class MemKind : uint32_t { kHost = 0, kCuda = 1 };

// A remote write that became visible in one of this rank's windows. `imm` is the 32-bit
// completion data the writer attached (32 bits: the smallest remote-CQ-data size among the
// supported providers, EFA's).
struct Arrival {
  uint32_t imm;
};

// A put of this rank finished locally: its source may be reused.
struct LocalDone {
  uint64_t cookie;
};

struct BackendCaps {
  bool cuda_windows = false;     // GPU memory can be registered (FI_HMEM); else stage on host
  std::string cuda_windows_note; // why not, when cuda_windows is false ("" if not asked for)
  uint32_t imm_bytes = 4;        // remote completion data size the provider carries (>= 4)
  uint64_t max_put_bytes = 0;    // largest single put
  uint64_t inject_bytes = 0;     // puts up to this size complete locally at once
};

class Backend {
 public:
  virtual ~Backend() = default;
  uint32_t api_version() const { return kBackendApiVersion; }
  // "libfabric/tcp;ofi_rxm", "libfabric/shm", "loopback"
  virtual const char* name() const = 0;
  virtual BackendCaps caps() const = 0;

  // B C. Registers [base, base + bytes) of this rank as window *id (same id on every rank;
  // sizes may differ per rank). Peers may write into it; it may also be a put's source.
  virtual Status register_window(void* base, size_t bytes, MemKind kind, WindowId* id) = 0;
  // B C. Idempotent.
  virtual Status deregister_window(WindowId id) = 0;
  // Size of `rank`'s copy of window `id` (0 if unknown): the proxy checks commands with it.
  virtual uint64_t window_size(WindowId id, int rank) const = 0;

  // NB. Write `bytes` (may be 0) from this rank's window `src` at `src_off` into `peer`'s
  // window `dst` at `dst_off`; `peer` then sees Arrival{imm} once the bytes are visible.
  // Bounds are the caller's to check (the proxy does). peer may be this rank.
  virtual Status put(int peer, WindowId src, uint64_t src_off, WindowId dst, uint64_t dst_off,
                     uint64_t bytes, uint32_t imm, uint64_t cookie, bool* posted) = 0;
  // NB. Drives the transport; appends what completed since the last call.
  virtual Status progress(std::vector<LocalDone>* done, std::vector<Arrival>* arrivals) = 0;
  // B C. Idempotent.
  virtual Status finalize() = 0;
  // L (any thread, returns at once). The thread that drives this backend is stuck inside
  // progress() or put() — a provider call that does not return, as when a peer died or stopped
  // while holding one of the provider's locks in shared memory — and has been given up (the
  // proxy's bounded stop). From now on nothing enters the provider again: put, progress,
  // deregister_window and finalize return an error at once and change nothing, the destructor
  // closes nothing; names the backend made in the file system are removed. The owner keeps the
  // backend (and what the stuck call uses) until the process exits (keep_until_exit), as
  // NetSession::destroy does. The default does nothing (a backend whose calls always return).
  virtual void abandon() {}
};

struct BackendConfig {
  std::string kind;      // "libfabric", "loopback" or "" (tunable net_backend)
  std::string provider;  // libfabric provider ("tcp;ofi_rxm", "shm", ...) or "" (tunable net_provider)
  // loopback only: arrivals a rank's inbound queue holds before put() returns posted=false
  // (back-pressure). 0: the default, 1024.
  uint32_t loopback_queue_depth = 0;
};

// C. Creates and initializes the backend for this world (address exchange included).
// "auto" libfabric provider: efa, then verbs;ofi_rxm, then tcp;ofi_rxm — or shm when every
// rank is on this host. loopback needs every rank in this process (a thread world).
Status create_backend(Bootstrap& bs, const Topology& topo, const BackendConfig& cfg,
                      std::unique_ptr<Backend>* out);

// Providers with RDM endpoints and RMA present on this machine (for doctor and tests).
std::vector<std::string> libfabric_providers();
// A provider name as libfabric spells it: trimmed, lower case, "tcp_rxm" -> "tcp;ofi_rxm" (a
// spelling without ';' for shells and CMake lists).
std::string normalize_provider(std::string p);

}  // namespace net
}  // namespace mk
