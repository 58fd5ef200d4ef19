// mkernel — the session of one fused operator: everything its communication needs, owned once.
//
// An operator creates its session, builds its program for the session's staging mode, and hands
// the program's declarations to setup(): the session allocates the symmetric workspaces (zeroed),
// the signal pad and the epoch, and — when ranks span several nodes — the network windows (the
// buffers themselves, or pinned host mirrors when staged) and starts the proxy. resolve() turns
// a rank's program into the device descriptors the kernels' communication role reads (one
// resolver for every operator). The session attaches to the communicator: a communicator
// destroyed first takes the session's resources with it (the operator's later calls fail
// naming it) — see CommAttachment.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/status.h"
#include "mkernel/device/diag.h"
#include "mkernel/runtime/communicator.h"
#include "src/comm/device_program.h"
#include "src/comm/net_session.h"
#include "src/comm/program.h"

namespace mk {
namespace comm {

// The resolved form of a rank's program: a DeviceProgram (device_program.h) less what a call
// binds (the caller's buffers) and what the kernel's compute side adds (tile-row hooks).
struct Resolved {
  DeviceProgram program{};
  // Offsets of the program's hook pools (RankProgram::waits / ::signals) in program.waits /
  // program.signals: the compute side indexes them from there.
  uint32_t hook_wait0 = 0, hook_signal0 = 0;
};

// The communicator's layout of ranks on nodes, as programs take it.
Layout layout_of(const Topology& t);

// The first step of every operator's create (collective): every rank asked for the same thing.
// `mine` is the operator's request (a struct without padding: its bytes are compared); when a
// rank's differs from rank 0's every rank returns kMismatch "<what>: ranks disagree: rank 0 has
// <describe(rank 0's)>, rank r has <describe(rank r's)>" (the first r that differs).
Status agree_on_request_bytes(Bootstrap& bs, const void* mine, size_t bytes, const char* what,
                              const std::function<std::string(const void*)>& describe);
template <class Request, class Describe>
Status agree_on_request(Bootstrap& bs, const Request& mine, const char* what, Describe describe) {
  static_assert(std::is_trivially_copyable<Request>::value && std::has_unique_object_representations<Request>::value,
                "a request is compared byte by byte: no padding, no pointers to compare");
  return agree_on_request_bytes(bs, &mine, sizeof(Request), what,
                                [&](const void* r) { return describe(*static_cast<const Request*>(r)); });
}

// A list of per-rank counts as a request carries it (uneven shards): FNV-1a of their bytes; 0
// for an empty list.
inline uint64_t counts_hash(const std::vector<int64_t>& v) {
  uint64_t h = v.empty() ? 0 : 1469598103934665603ull;
  for (int64_t r : v)
    for (int i = 0; i < 8; ++i) h = (h ^ uint64_t((r >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

class OpSession : public CommAttachment {
 public:
  // Collective. `name` names the operator in errors and device-wait reports (op tag). When the
  // communicator's ranks span several nodes, the network backend starts here and decides the
  // staging mode (staging: "auto" | "always" | "never" | "": tunable net_staging), which the
  // operator's program must follow (staged()).
  static Status create(Communicator* comm, const std::string& name, const std::string& staging,
                       std::unique_ptr<OpSession>* out);
  ~OpSession() override;
  OpSession(const OpSession&) = delete;
  OpSession& operator=(const OpSession&) = delete;

  Communicator* comm() const { return comm_; }
  const std::string& name() const { return name_; }
  uint32_t op_tag() const { return tag_; }
  bool networked() const { return net_ != nullptr; }
  bool staged() const { return net_ && net_->staged(); }
  // The network backend ("libfabric/tcp;ofi_rxm", with ", staged" when staged), or "" without one.
  std::string net_name() const { return net_ ? net_->backend_name() + (net_->staged() ? ", staged" : "") : ""; }
  // Non-null while the session lives and the communicator was not destroyed first.
  bool alive() const { return !destroyed_; }

  // Collective: allocates what `decl` declares (see the class comment) and starts the network.
  // Buffers are zeroed, except rank tokens (BufDecl::rank_token).
  Status setup(const ProgramDecl& decl);

  // This rank's program as device descriptors (uploaded; owned by the session).
  Status resolve(const ProgramDecl& decl, const RankProgram& rp, Resolved* out);
  // A buffer reference as an op pointer entry: a (peer) device or host address, or a caller
  // buffer's entry (user_ptr, resolved per call by op_ptr).
  Status address(const ProgramDecl& decl, const BufRef& ref, uint64_t* out) const;

  // Addresses after setup: a buffer's local memory (device, or pinned host for kHost), its
  // symmetric allocation (null for host/user buffers), a region's first flag on `rank`'s pad
  // (proxy regions: this rank's host pad only).
  void* local(BufId b) const;
  SymmetricBuffer* symmetric(BufId b) const;
  Status region_addr(const ProgramDecl& decl, RegionId r, int rank, uint64_t** out) const;
  EpochState* epoch() const { return epoch_; }
  WaitCtx wait_ctx(Role role) const { return comm_->wait_ctx(tag_, role); }

  // Device memory owned by the session: a copy of `v` (null when empty), or `bytes` zeroed.
  template <class T>
  Status upload(const std::vector<T>& v, T** out) {
    void* p = nullptr;
    MK_CHECK(upload_bytes(v.data(), v.size() * sizeof(T), &p));
    *out = static_cast<T*>(p);
    return OkStatus();
  }
  Status alloc_zeroed(size_t bytes, void** out);

  // Local checks before a call: the session lives and the communicator has not failed.
  Status check_call() const;
  // A call's argument checks (`local`) as run() reports them: as they are, or — with the debug
  // tunable check_calls, read at create — agreed across ranks first (a host collective), so a
  // bad argument on one rank is the same error on every rank.
  Status agree_on_call(const Status& local, const std::string& what);

  // Collective, idempotent, bounded: stops the network, frees everything.
  Status destroy();

 protected:
  void on_communicator_destroy() override;

 private:
  OpSession() = default;
  Status upload_bytes(const void* src, size_t bytes, void** out);

  Communicator* comm_ = nullptr;
  std::string name_;
  uint32_t tag_ = 0;
  std::unique_ptr<NetSession> net_;
  std::vector<SymmetricBuffer*> sym_;  // [bufs]
  std::vector<void*> host_;            // [bufs] pinned host mirrors (owned by net_)
  std::vector<uint32_t> win_;          // [bufs] network window ids
  SymmetricBuffer* pad_ = nullptr;
  EpochState* epoch_ = nullptr;
  std::vector<void*> dev_allocs_;
  bool attached_ = false;
  bool destroyed_ = false;
  bool check_calls_ = false;
};

}  // namespace comm
}  // namespace mk
