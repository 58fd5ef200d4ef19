// mkernel — symmetric memory: the same-size allocation on every rank, each rank's copy
// mapped into the address space of every rank on its node.
//
// Intra-node mapping: CUDA VMM (cuMemCreate, exported as a POSIX file descriptor and handed
// to peers over the job's private Unix-domain socket) or, as fallback, cudaIpc handles; a
// fallback is never silent (WARN, fallback_reason(), `mkernel doctor`).
// Ranks of one process share plain pointers. Ranks on other nodes are never mapped.
//
// alloc and free are collective (every rank, same order). Bad input — zero size, sizes that
// differ across ranks — and out-of-memory on any rank produce the same error on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/device/views.h"

namespace mk {

class SymmetricHeap;

enum class SymmetricMode { kAuto = 0, kVmm = 1, kIpc = 2, kProcess = 3 };
const char* symmetric_mode_name(SymmetricMode m);

class SymmetricBuffer {
 public:
  uint64_t id() const { return id_; }
  size_t size() const { return bytes_; }           // as requested
  size_t mapped_size() const { return mapped_; }   // rounded to the allocation granularity
  void* local() const { return local_; }
  // Rank r's copy in this address space; nullptr for ranks on other nodes.
  void* peer(int r) const { return peers_[r]; }
  // Device array [world] of the same pointers, for kernels.
  void* const* device_peers() const { return d_peers_; }
  SymmetricView view() const;
  SignalView signal_view() const;  // the buffer read as size()/8 flags
  SymmetricMode mode() const { return mode_; }
  bool freed() const { return freed_; }

 private:
  friend class SymmetricHeap;
  uint64_t id_ = 0;
  size_t bytes_ = 0, mapped_ = 0;
  void* local_ = nullptr;
  std::vector<void*> peers_;
  void** d_peers_ = nullptr;
  SymmetricMode mode_ = SymmetricMode::kAuto;
  bool freed_ = false;
  int rank_ = 0, world_ = 1;
  unsigned long long local_handle_ = 0;   // CUmemGenericAllocationHandle (VMM)
  std::vector<unsigned long long> peer_handles_;  // imported handles (VMM), 0 if none
  std::vector<bool> peer_opened_;                 // cudaIpc handles opened
  std::vector<size_t> peer_mapped_;               // reserved VA size per imported peer
};

class Communicator;
struct HeapContext;  // private: bootstrap, topology, IPC server and secret, device

class SymmetricHeap {
 public:
  explicit SymmetricHeap(HeapContext* ctx);
  ~SymmetricHeap();
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  // Collective. On success *out stays valid (owned by the heap) until destroy().
  Status alloc(size_t bytes, SymmetricBuffer** out);
  // Collective; idempotent (a freed buffer or nullptr is a no-op that still meets the peers'
  // barriers only if they free too — free the same buffers in the same order everywhere).
  // @pre no kernel still uses the buffer on any rank.
  Status free(SymmetricBuffer* buf);
  // Frees every live buffer, newest first. Collective, idempotent.
  Status destroy();

  // How peers' copies are mapped: kAuto until the first alloc chooses (the same on every
  // rank), then kVmm or kIpc. A later alloc can still move kVmm to kIpc (see fallback_reason).
  SymmetricMode mode() const { return mode_; }
  // What was asked for (tunable symmem_mode or CommConfig::symmem_mode): kAuto, kVmm or kIpc.
  SymmetricMode requested_mode() const;
  // Why symmem_mode=auto ended up on cudaIpc instead of VMM — VMM not available on some
  // rank's GPU or driver (named), or VMM export/import refused at an allocation (its error) —
  // or "" when it did not. Every fallback is also logged at WARN on every rank.
  const std::string& fallback_reason() const { return fallback_reason_; }
  size_t live_buffers() const;

 private:
  Status alloc_mode(size_t bytes, SymmetricMode mode, SymmetricBuffer* b, Status* local_err);
  Status map_peers(SymmetricBuffer* b, Status* local_err);
  void release_peers(SymmetricBuffer* b);
  void release_local(SymmetricBuffer* b);
  Status agree(const Status& mine, const char* what);

  HeapContext* ctx_;
  SymmetricMode mode_ = SymmetricMode::kAuto;
  std::string fallback_reason_;
  uint64_t next_id_ = 1;
  std::vector<std::unique_ptr<SymmetricBuffer>> buffers_;
  bool destroyed_ = false;
};

}  // namespace mk
