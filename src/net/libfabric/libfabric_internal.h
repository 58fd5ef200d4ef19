// mkernel — the libfabric backend's internals (library-internal; not installed): its constants,
// message formats, helpers and the class, shared by its three sources —
//   libfabric_setup.cc     provider choice, endpoint, address exchange, registration, entry points
//   libfabric_backend.cc   windows and the data path (put, progress)
//   libfabric_teardown.cc  the collective quiesce, finalize, close
#pragma once

#include <cuda_runtime_api.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/net/backend.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/topology.h"
#include "src/common/env_defaults.h"
#include "src/common/fault.h"
#include "src/net/net_internal.h"
#include "src/common/deadline.h"

namespace mk {
namespace net {
namespace lf {

// The API version asked of fi_getinfo: this header's, capped at 1.18 (every feature used here
// exists since 1.10; the cap keeps a newer library from applying semantics not reviewed here).
constexpr uint32_t kFiVersion = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) < FI_VERSION(1, 18)
                                    ? FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION)
                                    : FI_VERSION(1, 18);
constexpr size_t kAddrMax = 256;   // fi_getname buffer
constexpr int kRecvPool = 256;     // posted receives (FI_RX_CQ_DATA and quiet messages)
constexpr size_t kSlot = 64;       // bytes per receive / control-send slot
constexpr int kCqBatch = 64;       // entries per fi_cq_read
constexpr int kMaxReadsPerProgress = 16;  // bound on one progress() call (it must not block)
constexpr uint32_t kQuietMagic = 0x4d4b5154u;  // "MKQT"
constexpr uint64_t kMrModesHandled = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                     FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;

// kPut: a put whose LocalDone comes from its completion; kPutInjected: a put posted with
// FI_INJECT, whose LocalDone was delivered at once (its completion only frees the context);
// kRecv: a posted receive; kCtrlSend: a quiet message sent with fi_send.
enum class CtxKind : uint8_t { kPut, kPutInjected, kRecv, kCtrlSend };

// Per-operation context. fi_context2 first: providers asking FI_CONTEXT / FI_CONTEXT2 own it.
struct OpCtx {
  fi_context2 fi;
  CtxKind kind;
  int32_t peer;
  uint32_t slot;
  uint64_t cookie;
  OpCtx* next_free;
};

struct QuietMsg {
  uint32_t magic;
  uint32_t epoch;
  int32_t rank;
  uint32_t pad;
};

// What each rank publishes at startup.
struct AddrMsg {
  uint32_t len;
  uint32_t cq_data_size;
  char prov[64];
  char fabric[64];
  uint8_t addr[kAddrMax];
};

// What each rank publishes per window.
struct WinMsg {
  uint64_t addr;  // remote address of byte 0 (base with FI_MR_VIRT_ADDR, else 0)
  uint64_t key;
  uint64_t size;
};

struct InfoList {
  fi_info* head = nullptr;
  ~InfoList() {
    if (head) fi_freeinfo(head);
  }
};

std::string fi_err(int ret);
std::string mode_names(uint64_t mode);
std::string mr_mode_names(int mode);
bool is_ip_provider(const std::string& prov);
// fi_getinfo for one provider (exact name), RDM + RMA write with remote CQ data.
int query_provider(const std::string& prov, bool hmem, fi_info** out);
bool usable(const fi_info* i, const std::string& prov, bool hmem);
std::vector<fi_info*> usable_infos(fi_info* head, const std::string& prov, bool hmem);
// One info among several for the same provider, the same rule on every rank (libfabric_setup.cc).
fi_info* pick_info(const std::vector<fi_info*>& v, const std::string& prov, bool one_host, int host_local);
// The unusual limits of udp;ofi_rxd (kNotSupported when this job cannot fit them).
Status rxd_fits(const Topology& topo, const std::string& prov);
// Removes, from `dir` (/dev/shm), the shm endpoint regions mkernel named ("<pid>:<uid>:<n>-mk"
// and 16 hex digits) whose process is gone: this user's, a regular file, the pid no longer
// alive. A process killed before closing its endpoint leaves its 16 MiB behind, and no later run
// would remove it. Returns how many were removed.
int remove_dead_shm_regions(const std::string& dir);

// What an endpoint left open after a failed job (close_all) may still use: its objects and the
// memory its posted receives and pending puts point at. Kept, reachable, until the process ends
// (keep_until_exit).
struct Abandoned {
  fid_ep* ep;
  fid_av* av;
  fid_cq* cq;
  fid_domain* domain;
  fid_fabric* fabric;
  std::vector<uint8_t> ctrl_buf, scratch;
  std::vector<OpCtx> recv_ctx;
  std::vector<std::unique_ptr<OpCtx[]>> chunks;
};

using Clock = std::chrono::steady_clock;

// Polling pause for the blocking loops (quiesce, sends): yields first, then sleeps briefly,
// so four ranks on two cores still make progress.
class Pause {
 public:
  void idle() {
    if (++n_ < 256) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  void busy() { n_ = 0; }

 private:
  int n_ = 0;
};

class LibfabricBackend final : public Backend {
 public:
  explicit LibfabricBackend(Bootstrap& bs) : bs_(bs), rank_(bs.rank()), world_(bs.size()) {}
  ~LibfabricBackend() override { (void)close_all(); }

  Status init(const Topology& topo, const std::string& requested);

  const char* name() const override { return name_.c_str(); }
  BackendCaps caps() const override { return caps_; }
  Status register_window(void* base, size_t bytes, MemKind kind, WindowId* id) override;
  void abandon() override;
  void probe_gpu_registration();
  Status deregister_window(WindowId id) override;
  uint64_t window_size(WindowId id, int rank) const override;
  Status put(int peer, WindowId src, uint64_t src_off, WindowId dst, uint64_t dst_off,
             uint64_t bytes, uint32_t imm, uint64_t cookie, bool* posted) override;
  Status progress(std::vector<LocalDone>* done, std::vector<Arrival>* arrivals) override;
  Status finalize() override;

  // Tests: the memory key rank `rank` published for window `id` (0 for none); whether the
  // provider chooses the keys (FI_MR_PROV_KEY) rather than taking ours; our keys' bits.
  uint64_t window_key(WindowId id, int rank) const {
    return id < windows_.size() && rank >= 0 && size_t(rank) < windows_[id].remote.size() ? windows_[id].remote[rank].key
                                                                                          : 0;
  }
  uint64_t window_addr(WindowId id, int rank) const {
    return id < windows_.size() && rank >= 0 && size_t(rank) < windows_[id].remote.size()
               ? windows_[id].remote[rank].addr
               : 0;
  }
  bool provider_keys() const { return (mr_mode_ & FI_MR_PROV_KEY) != 0; }
  unsigned key_bits() const { return key_bits_; }
  // Tests: whether completions name their sender (FI_SOURCE); how many arrivals and control
  // messages from outside the job (a sender not in the address vector) were dropped; this
  // endpoint's address (fi_getname), for a stranger to reach it.
  bool checks_senders() const { return source_; }
  uint64_t strangers_dropped() const { return strangers_; }
  std::vector<uint8_t> endpoint_address() const;

 private:
  struct Window {
    bool live = false;
    uint8_t* base = nullptr;
    uint64_t bytes = 0;
    MemKind kind = MemKind::kHost;
    fid_mr* mr = nullptr;        // null for a zero-byte window (the scratch MR stands in)
    void* desc = nullptr;        // passed to data transfers (FI_MR_LOCAL, or HMEM windows)
    std::vector<WinMsg> remote;  // [rank]
  };

  Status choose_provider(const Topology& topo, const std::string& requested, std::string* prov);
  Status open_endpoint(const Topology& topo, const std::string& prov);
  Status select_info(const Topology& topo, const std::string& prov);
  Status open_objects(const std::string& prov);
  Status open_control_area();
  void name_shm_endpoint();
  Status exchange_addresses();
  Status reg(void* base, size_t bytes, uint64_t access, MemKind kind, fid_mr** mr);
  void post_recv(OpCtx* c);
  void retry_reposts();
  Status poll(std::vector<LocalDone>* done, std::vector<Arrival>* arrivals, int* seen);
  Status read_error();
  // The collective step of register/deregister/finalize: a barrier that keeps the transport
  // progressing (see the file comment); own_puts: first wait for this rank's puts to complete.
  // `local` is this rank's outcome so far; every rank returns the agreed one.
  Status quiesce(const char* what, bool own_puts, Status local);
  Status send_quiet(int peer, uint32_t epoch, Clock::time_point deadline);
  Status close_all();

  OpCtx* get_ctx() {
    if (!free_) grow_ctx();
    OpCtx* c = free_;
    free_ = c->next_free;
    return c;
  }
  void put_ctx(OpCtx* c) {
    c->next_free = free_;
    free_ = c;
  }
  void grow_ctx() {
    constexpr int kChunk = 256;
    chunks_.emplace_back(new OpCtx[kChunk]);
    OpCtx* a = chunks_.back().get();
    for (int i = 0; i < kChunk; ++i) {
      memset(static_cast<void*>(&a[i]), 0, sizeof(OpCtx));
      a[i].next_free = i + 1 < kChunk ? &a[i + 1] : free_;
    }
    free_ = &a[0];
  }
  bool is_recv_ctx(const void* p) const {
    auto* c = static_cast<const OpCtx*>(p);
    return !recv_ctx_.empty() && c >= recv_ctx_.data() && c < recv_ctx_.data() + recv_ctx_.size();
  }
  uint8_t* slot_ptr(uint32_t slot) { return ctrl_buf_.data() + static_cast<size_t>(slot) * kSlot; }
  // Records the first failure (the backend stays failed) and returns `e`.
  Status fail(const Status& e) {
    if (error_.ok()) error_ = e;
    return e;
  }
  Status stash_poll() {
    int seen = 0;
    return poll(&stash_done_, &stash_arr_, &seen);
  }
  Status stash_poll_counted(int* seen) { return poll(&stash_done_, &stash_arr_, seen); }

  Bootstrap& bs_;
  const int rank_;
  const int world_;
  std::string name_ = "libfabric";
  std::string prov_;
  BackendCaps caps_;

  fi_info* info_ = nullptr;  // a copy (fi_dupinfo) of the chosen entry
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::vector<fi_addr_t> addr_;  // [rank]
  // FI_SOURCE: completions name their sender, and arrivals from outside the job are dropped.
  bool source_ = false;
  uint64_t strangers_ = 0;
  // The rank whose address `a` is, or -1 (not in the address vector: not of this job).
  int rank_of(fi_addr_t a) const {
    if (a == FI_ADDR_NOTAVAIL) return -1;
    if (a < addr_.size() && addr_[a] == a) return static_cast<int>(a);  // FI_AV_TABLE: rank order
    for (size_t r = 0; r < addr_.size(); ++r)
      if (addr_[r] == a) return static_cast<int>(r);
    return -1;
  }
  void drop_stranger(const char* what, uint64_t data);

  uint64_t mr_mode_ = 0;
  bool rx_cq_data_ = false;
  bool hmem_ = false;
  std::string hmem_note_;  // why GPU windows are not offered although FI_HMEM was asked for
  size_t inject_size_ = 0;
  // Memory keys when the provider takes ours (no FI_MR_PROV_KEY): drawn at random from the
  // operating system within the provider's key size, so a process that can reach this endpoint
  // cannot guess one (with keys 1, 2, 3 ... any sender could write into a window).
  unsigned key_bits_ = 64;
  Status draw_key(uint64_t* key) const;

  // Control area: kRecvPool receive slots, then 2 * world send slots (epoch parity).
  std::vector<uint8_t> ctrl_buf_;
  fid_mr* ctrl_mr_ = nullptr;
  void* ctrl_desc_ = nullptr;
  std::vector<OpCtx> recv_ctx_;     // sized once, before the first receive is posted
  std::vector<OpCtx*> repost_;      // receives whose re-post met -FI_EAGAIN
  std::vector<uint8_t> send_busy_;  // [2 * world] a quiet send slot still in flight
  // Scratch: stands in for zero-byte windows (a source or a target of zero-byte puts).
  std::vector<uint8_t> scratch_ = std::vector<uint8_t>(64, 0);
  fid_mr* scratch_mr_ = nullptr;
  void* scratch_desc_ = nullptr;
  WinMsg scratch_remote_{};

  std::vector<Window> windows_;

  std::vector<std::unique_ptr<OpCtx[]>> chunks_;
  OpCtx* free_ = nullptr;
  uint64_t outstanding_ = 0;  // puts posted (injected ones included) whose completion is due
  uint64_t ctrl_outstanding_ = 0;  // quiet messages whose send completion is due

  std::vector<LocalDone> stash_done_;  // completions seen outside progress() (inject, quiesce)
  std::vector<Arrival> stash_arr_;
  std::vector<uint32_t> quiet_epoch_;  // [rank] the last quiet epoch received from each
  uint32_t epoch_ = 0;

  Status error_;       // the first failure: sticky, returned by put/progress from then on
  Status post_error_;  // a receive could not be posted (also recorded in error_)
  bool finalized_ = false;
  bool closed_ = false;
  bool failed_teardown_ = false;  // the teardown of a failed job (close_all: see there)
  std::atomic<bool> abandoned_{false};  // abandon(): the provider is not entered again
  std::string shm_region_;              // the shm provider's region (/dev/shm), when named here
  // After a teardown step's quiesce: a failed job (this backend's error, the bootstrap's, or
  // operations still in the provider, which the quiesce returned without) marks the teardown so
  // that close_all leaves an rxm endpoint open.
  void note_failed_teardown() {
    if (!error_.ok() || !bs_.poll_failure().ok() || outstanding_ > 0 || ctrl_outstanding_ > 0)
      failed_teardown_ = true;
  }
};

}  // namespace lf
}  // namespace net
}  // namespace mk
