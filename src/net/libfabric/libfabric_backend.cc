// The libfabric backend: one RDM endpoint per rank, one CQ (FI_CQ_FORMAT_DATA) and one AV
// (FI_AV_TABLE). A put is fi_writedata (fi_writemsg with FI_INJECT when small) carrying the
// 32-bit imm as remote CQ data, so the target learns of every arrival from its own CQ, after
// the bytes are visible — correct on unordered transports (EFA SRD) and ordered ones alike.
//
// Besides the windows the backend registers two buffers of its own: a control area (a pool
// of receive slots, used for the FI_RX_CQ_DATA receives and for the "quiet" messages of the
// collective steps) and a tiny scratch region that stands in for zero-byte windows.
//
// Collective steps ("quiesce", in register_window, deregister_window and finalize): each rank
// (for the latter two) progresses until its own puts are complete, then sends a quiet message
// to every peer and keeps progressing until it has one from every peer and its own were taken,
// then joins a bootstrap agreement. A rank thus never stops driving the transport while a peer
// may still depend on it (manual-progress providers such as tcp;ofi_rxm, udp;ofi_rxd, shm and
// efa move bytes only inside calls). Completions seen meanwhile are kept and returned by the
// next progress(). docs/backend-contract.md has the whole contract.
#include <cuda_runtime_api.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
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

namespace mk {
namespace net {
namespace {

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

std::string fi_err(int ret) {
  int e = ret < 0 ? -ret : ret;
  return std::string(fi_strerror(e)) + " (" + std::to_string(ret) + ")";
}


std::string mode_names(uint64_t mode) {
  std::string s;
  if (mode & FI_CONTEXT) s += "FI_CONTEXT ";
  if (mode & FI_CONTEXT2) s += "FI_CONTEXT2 ";
  if (mode & FI_RX_CQ_DATA) s += "FI_RX_CQ_DATA ";
  if (s.empty()) s = "none";
  else s.pop_back();
  return s;
}

std::string mr_mode_names(int mode) {
  std::string s;
  if (mode & FI_MR_LOCAL) s += "LOCAL|";
  if (mode & FI_MR_VIRT_ADDR) s += "VIRT_ADDR|";
  if (mode & FI_MR_ALLOCATED) s += "ALLOCATED|";
  if (mode & FI_MR_PROV_KEY) s += "PROV_KEY|";
  if (mode & FI_MR_ENDPOINT) s += "ENDPOINT|";
  if (mode & FI_MR_HMEM) s += "HMEM|";
  if (s.empty()) return "none";
  s.pop_back();
  return s;
}

bool is_ip_provider(const std::string& prov) {
  std::string core = prov.substr(0, prov.find(';'));
  return core == "tcp" || core == "udp" || core == "net" || core == "sockets";
}

struct InfoList {
  fi_info* head = nullptr;
  ~InfoList() {
    if (head) fi_freeinfo(head);
  }
};

// fi_getinfo for one provider (exact name), RDM + RMA write with remote CQ data.
int query_provider(const std::string& prov, bool hmem, fi_info** out) {
  *out = nullptr;
  fi_info* hints = fi_allocinfo();
  if (!hints) return -FI_ENOMEM;
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE;
  if (hmem) hints->caps |= FI_HMEM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode = static_cast<int>(kMrModesHandled);
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->av_type = FI_AV_TABLE;
  hints->fabric_attr->prov_name = strdup(prov.c_str());
  int ret = fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, out);
  fi_freeinfo(hints);
  return ret;
}

bool usable(const fi_info* i, const std::string& prov, bool hmem) {
  if (!i->fabric_attr || !i->fabric_attr->prov_name || prov != i->fabric_attr->prov_name)
    return false;
  if (!i->ep_attr || i->ep_attr->type != FI_EP_RDM) return false;
  if (!(i->caps & FI_RMA)) return false;
  if (hmem && !(i->caps & FI_HMEM)) return false;
  if (!i->domain_attr || i->domain_attr->cq_data_size < 4) return false;
  if (static_cast<uint64_t>(i->domain_attr->mr_mode) & ~kMrModesHandled) return false;
  return true;
}

std::vector<fi_info*> usable_infos(fi_info* head, const std::string& prov, bool hmem) {
  std::vector<fi_info*> v;
  for (fi_info* i = head; i; i = i->next)
    if (usable(i, prov, hmem)) v.push_back(i);
  return v;
}

// One info among several for the same provider, the same rule on every rank:
//  - IP providers (tcp, udp, ...): 127.0.0.1/32 when every rank shares this host, else the
//    first IPv4 fabric that is not loopback, else the first non-loopback, else the first;
//  - efa: the NIC (domain) at this rank's host-local index modulo the NIC count;
//  - others: the first.
fi_info* pick_info(const std::vector<fi_info*>& v, const std::string& prov, bool one_host,
                   int host_local) {
  if (v.empty()) return nullptr;
  auto is_lo = [](const fi_info* i) {
    const char* f = i->fabric_attr->name ? i->fabric_attr->name : "";
    const char* d = i->domain_attr->name ? i->domain_attr->name : "";
    return strcmp(d, "lo") == 0 || strncmp(f, "127.", 4) == 0 || strcmp(f, "::1/128") == 0;
  };
  if (is_ip_provider(prov)) {
    if (one_host)
      for (fi_info* i : v)
        if (i->fabric_attr->name && strcmp(i->fabric_attr->name, "127.0.0.1/32") == 0) return i;
    if (!one_host) {
      for (fi_info* i : v)
        if (!is_lo(i) && i->addr_format == FI_SOCKADDR_IN) return i;
      for (fi_info* i : v)
        if (!is_lo(i)) return i;
    }
    return v[0];
  }
  if (prov == "efa") {
    std::vector<std::string> domains;
    for (fi_info* i : v) {
      std::string d = i->domain_attr->name ? i->domain_attr->name : "";
      if (std::find(domains.begin(), domains.end(), d) == domains.end()) domains.push_back(d);
    }
    const std::string& want = domains[static_cast<size_t>(host_local) % domains.size()];
    for (fi_info* i : v)
      if (want == (i->domain_attr->name ? i->domain_attr->name : "")) return i;
  }
  return v[0];
}

// What an endpoint left open after a failed job (close_all) may still use: its objects and the
// memory its posted receives and pending puts point at. Kept, reachable, until the process ends.
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
void keep_until_exit(std::unique_ptr<Abandoned> a) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::unique_ptr<Abandoned>>();  // never freed: the point
  std::lock_guard<std::mutex> g(mu);
  kept->push_back(std::move(a));
}

using Clock = std::chrono::steady_clock;

Clock::time_point after_ms(int64_t ms) { return Clock::now() + std::chrono::milliseconds(ms); }

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
  void probe_gpu_registration();
  Status deregister_window(WindowId id) override;
  uint64_t window_size(WindowId id, int rank) const override;
  Status put(int peer, WindowId src, uint64_t src_off, WindowId dst, uint64_t dst_off,
             uint64_t bytes, uint32_t imm, uint64_t cookie, bool* posted) override;
  Status progress(std::vector<LocalDone>* done, std::vector<Arrival>* arrivals) override;
  Status finalize() override;

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

  uint64_t mr_mode_ = 0;
  bool rx_cq_data_ = false;
  bool hmem_ = false;
  std::string hmem_note_;  // why GPU windows are not offered although FI_HMEM was asked for
  size_t inject_size_ = 0;
  uint64_t next_key_ = 1;

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
  // After a teardown step's quiesce: a failed job (this backend's error, the bootstrap's, or
  // operations still in the provider, which the quiesce returned without) marks the teardown so
  // that close_all leaves an rxm endpoint open.
  void note_failed_teardown() {
    if (!error_.ok() || !bs_.poll_failure().ok() || outstanding_ > 0 || ctrl_outstanding_ > 0)
      failed_teardown_ = true;
  }
};

// ---- setup ----------------------------------------------------------------------------------

// udp;ofi_rxd keeps up to FI_OFI_RXD_MAX_UNACKED datagrams per peer in flight; what all peers
// have in flight to one rank must fit its UDP socket buffer, or a rank that is descheduled
// drops them and rxd's recovery can fail for good (docs/backend-contract.md). A datagram of
// 1472 bytes takes about 2 KiB of the buffer (the kernel counts its whole allocation).
Status rxd_fits(const Topology& topo, const std::string& prov) {
  if (prov != "udp;ofi_rxd") return OkStatus();
  int smallest_node = topo.world;
  for (const auto& n : topo.node_ranks) smallest_node = std::min<int>(smallest_node, static_cast<int>(n.size()));
  const int64_t peers = topo.world - smallest_node;  // ranks on other nodes, at most
  const int64_t window = rxd_max_unacked();
  int64_t rmem = 212992;  // Linux's usual net.core.rmem_default
  if (FILE* f = fopen("/proc/sys/net/core/rmem_default", "r")) {
    long long v = 0;
    if (fscanf(f, "%lld", &v) == 1 && v > 0) rmem = v;
    fclose(f);
  }
  const int64_t need = peers * window * 2048;
  if (peers > 0 && need > rmem)
    return make_status(Code::kNotSupported,
                       "udp;ofi_rxd cannot carry this job reliably: %lld peer(s) on other nodes x %lld unacknowledged "
                       "datagrams each (FI_OFI_RXD_MAX_UNACKED) x ~2 KiB = %lld bytes in flight to one rank, more "
                       "than its UDP receive buffer (net.core.rmem_default = %lld); use tcp;ofi_rxm, raise "
                       "net.core.rmem_default, or set a smaller FI_OFI_RXD_MAX_UNACKED before the process starts",
                       (long long)peers, (long long)window, (long long)need, (long long)rmem);
  return OkStatus();
}

Status LibfabricBackend::init(const Topology& topo, const std::string& requested) {
  apply_env_defaults();  // before this process's first fi_getinfo (libfabric reads them once)
  std::string prov;
  MK_CHECK(choose_provider(topo, requested, &prov));
  MK_CHECK(agree(bs_, rxd_fits(topo, prov), "libfabric provider " + prov));
  Status opened = open_endpoint(topo, prov);
  if (!opened.ok()) MK_INFO(kSubsysNet, "%s", opened.message().c_str());
  MK_CHECK(agree(bs_, opened, "libfabric endpoint (" + prov + ")"));
  MK_CHECK(exchange_addresses());
  return OkStatus();
}

Status LibfabricBackend::choose_provider(const Topology& topo, const std::string& requested,
                                         std::string* prov) {
  std::string want =
      normalize_provider(requested.empty() ? tunables::net_provider()
                                           : requested);
  if (want.empty()) want = "auto";
  if (want != "auto") {
    *prov = want;
    return OkStatus();
  }
  bool one_host = true;
  for (const RankInfo& i : topo.info) one_host &= i.host_hash == topo.info[0].host_hash;
  std::vector<std::string> cands;
  if (one_host) cands.push_back("shm");
  for (const char* c : {"efa", "verbs;ofi_rxm", "tcp;ofi_rxm"}) cands.push_back(c);
  // Each rank says which candidates it can open; the first one every rank can is taken.
  uint32_t mine = 0;
  for (size_t k = 0; k < cands.size(); ++k) {
    InfoList l;
    if (query_provider(cands[k], false, &l.head) == 0 && !usable_infos(l.head, cands[k], false).empty())
      mine |= 1u << k;
  }
  std::vector<uint32_t> all(world_);
  MK_CHECK(bs_.allgather(&mine, all.data(), sizeof(mine)));
  uint32_t common = ~0u;
  for (uint32_t m : all) common &= m;
  for (size_t k = 0; k < cands.size(); ++k) {
    if (common & (1u << k)) {
      *prov = cands[k];
      MK_INFO(kSubsysNet, "libfabric: provider auto -> %s (%s)", prov->c_str(),
              one_host ? "every rank on this host" : "ranks on several hosts");
      return OkStatus();
    }
  }
  std::string tried;
  for (const auto& c : cands) tried += (tried.empty() ? "" : ", ") + c;
  std::string have;
  for (const auto& p : libfabric_providers()) have += (have.empty() ? "" : ", ") + p;
  return make_status(Code::kNotSupported,
                     "libfabric provider auto: none of %s is usable on every rank (this rank "
                     "has mask 0x%x; RDM+RMA providers here: %s); set MK_NET_PROVIDER",
                     tried.c_str(), mine, have.empty() ? "none" : have.c_str());
}

// The shm provider names an endpoint's shared-memory region after the process id and a
// per-process endpoint count, and refuses (fi_enable: EBUSY) to take over a region of that name
// whose recorded owner is alive. A process that died without closing its endpoint (killed, or
// left through _exit) leaves its region behind; once the pid is recycled (quickly in
// containers), the new process with that pid can no longer open an endpoint. A nonce in the
// name makes every endpoint's region its own, whatever was left behind.
void LibfabricBackend::name_shm_endpoint() {
  const char* p = info_->fabric_attr ? info_->fabric_attr->prov_name : nullptr;
  if (!p || strcmp(p, "shm") != 0) return;
  // A provider that cannot be renamed keeps its default name: it works unless a leftover is
  // in the way, and then fi_enable says so.
  char base[kAddrMax] = {0};
  size_t len = sizeof(base) - 1;
  int ret = fi_getname(&ep_->fid, base, &len);
  if (ret != 0) {
    MK_INFO(kSubsysNet, "%s: keeps the provider's endpoint name (fi_getname before enable: %s)",
            name_.c_str(), fi_err(ret).c_str());
    return;
  }
  base[sizeof(base) - 1] = 0;
  std::random_device rd;
  const uint64_t nonce =
      ((static_cast<uint64_t>(rd()) << 32) ^ rd()) ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  char name[kAddrMax];
  const int n = snprintf(name, sizeof(name), "%s-mk%016llx", base,
                         static_cast<unsigned long long>(nonce));
  if (n <= 0 || static_cast<size_t>(n) >= 200) {
    MK_INFO(kSubsysNet, "%s: keeps the provider's endpoint name ('%s' too long for a nonce)",
            name_.c_str(), base);
    return;
  }
  ret = fi_setname(&ep_->fid, name, static_cast<size_t>(n) + 1);
  if (ret != 0)
    MK_INFO(kSubsysNet, "%s: keeps the provider's endpoint name (fi_setname: %s)", name_.c_str(),
            fi_err(ret).c_str());
}

Status LibfabricBackend::open_endpoint(const Topology& topo, const std::string& prov) {
  prov_ = prov;
  name_ = "libfabric/" + prov;
  bool one_host = true;
  for (const RankInfo& i : topo.info) one_host &= i.host_hash == topo.info[0].host_hash;
  const int host_local = host_local_index(topo.info, rank_);
  // FI_HMEM only where this rank has a GPU and GPU windows may be registered directly.
  const bool want_hmem = topo.info[rank_].cuda_device >= 0 &&
                         tunables::net_staging() != "always";

  InfoList hl, pl;
  fi_info* chosen = nullptr;
  if (want_hmem && query_provider(prov, true, &hl.head) == 0) {
    chosen = pick_info(usable_infos(hl.head, prov, true), prov, one_host, host_local);
    hmem_ = chosen != nullptr;
  }
  if (want_hmem && !hmem_) hmem_note_ = "the provider does not offer FI_HMEM here";
  int qret = 0;
  if (!chosen) {
    qret = query_provider(prov, false, &pl.head);
    if (qret == 0) chosen = pick_info(usable_infos(pl.head, prov, false), prov, one_host, host_local);
  }
  if (!chosen) {
    std::string why;
    if (qret != 0) {
      why = "fi_getinfo: " + fi_err(qret);
    } else {
      std::string offered;
      for (fi_info* i = pl.head; i; i = i->next) {
        std::string n = i->fabric_attr && i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "?";
        if (offered.find("'" + n + "'") == std::string::npos)
          offered += (offered.empty() ? "'" : ", '") + n + "'";
      }
      why = "fi_getinfo offered " + offered + ": provider names must match exactly, and the "
            "entry needs RMA, >= 4 bytes of remote CQ data and no MR mode beyond "
            "LOCAL|VIRT_ADDR|ALLOCATED|PROV_KEY|ENDPOINT|HMEM";
    }
    std::string have;
    for (const auto& p : libfabric_providers()) have += (have.empty() ? "" : ", ") + p;
    return make_status(Code::kNotSupported,
                       "libfabric provider '%s' gives no usable RDM endpoint with RMA writes "
                       "and remote CQ data on this machine (%s); RDM+RMA providers here: %s",
                       prov.c_str(), why.c_str(), have.empty() ? "none" : have.c_str());
  }
  info_ = fi_dupinfo(chosen);
  MK_REQUIRE(info_ != nullptr, Code::kOutOfMemory, "fi_dupinfo failed");
  mr_mode_ = static_cast<uint64_t>(info_->domain_attr->mr_mode);
  rx_cq_data_ = (info_->mode & FI_RX_CQ_DATA) != 0;
  inject_size_ = info_->tx_attr ? info_->tx_attr->inject_size : 0;

  int ret = fi_fabric(info_->fabric_attr, &fabric_, nullptr);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_fabric(%s): %s", name_.c_str(),
             info_->fabric_attr->name, fi_err(ret).c_str());
  ret = fi_domain(fabric_, info_, &domain_, nullptr);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_domain(%s): %s", name_.c_str(),
             info_->domain_attr->name, fi_err(ret).c_str());
  fi_cq_attr cq_attr;
  memset(&cq_attr, 0, sizeof(cq_attr));
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_NONE;
  cq_attr.size = (info_->tx_attr ? info_->tx_attr->size : 0) +
                 (info_->rx_attr ? info_->rx_attr->size : 0) + kRecvPool;
  ret = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_cq_open: %s", name_.c_str(), fi_err(ret).c_str());
  fi_av_attr av_attr;
  memset(&av_attr, 0, sizeof(av_attr));
  av_attr.type = FI_AV_TABLE;
  av_attr.count = static_cast<size_t>(world_);
  ret = fi_av_open(domain_, &av_attr, &av_, nullptr);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_av_open: %s", name_.c_str(), fi_err(ret).c_str());
  ret = fi_endpoint(domain_, info_, &ep_, nullptr);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_endpoint: %s", name_.c_str(), fi_err(ret).c_str());
  ret = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_ep_bind(cq): %s", name_.c_str(), fi_err(ret).c_str());
  ret = fi_ep_bind(ep_, &av_->fid, 0);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_ep_bind(av): %s", name_.c_str(), fi_err(ret).c_str());
  name_shm_endpoint();
  ret = fi_enable(ep_);
  MK_REQUIRE(ret == 0, Code::kSystemError, "%s: fi_enable: %s%s", name_.c_str(), fi_err(ret).c_str(),
             ret == -FI_EBUSY && prov == "shm"
                 ? " (a region of this endpoint's name is in /dev/shm, owned by a live process)"
                 : "");

  // The control area and the scratch region.
  ctrl_buf_.assign((static_cast<size_t>(kRecvPool) + 2 * static_cast<size_t>(world_)) * kSlot, 0);
  send_busy_.assign(2 * static_cast<size_t>(world_), 0);
  MK_CHECK(reg(ctrl_buf_.data(), ctrl_buf_.size(), FI_SEND | FI_RECV, MemKind::kHost, &ctrl_mr_));
  MK_CHECK(reg(scratch_.data(), scratch_.size(), FI_WRITE | FI_REMOTE_WRITE, MemKind::kHost,
               &scratch_mr_));
  if (mr_mode_ & FI_MR_LOCAL) {
    ctrl_desc_ = fi_mr_desc(ctrl_mr_);
    scratch_desc_ = fi_mr_desc(scratch_mr_);
  }
  scratch_remote_.addr = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(scratch_.data()) : 0;
  scratch_remote_.key = fi_mr_key(scratch_mr_);
  scratch_remote_.size = 0;

  recv_ctx_.resize(kRecvPool);
  for (int i = 0; i < kRecvPool; ++i) {
    memset(static_cast<void*>(&recv_ctx_[i]), 0, sizeof(OpCtx));
    recv_ctx_[i].kind = CtxKind::kRecv;
    recv_ctx_[i].slot = static_cast<uint32_t>(i);
    recv_ctx_[i].peer = -1;
  }
  for (int i = 0; i < kRecvPool; ++i) post_recv(&recv_ctx_[i]);
  MK_CHECK(post_error_);

  if (hmem_) probe_gpu_registration();
  caps_.cuda_windows = hmem_;
  caps_.cuda_windows_note = hmem_note_;
  caps_.imm_bytes = static_cast<uint32_t>(std::min<size_t>(info_->domain_attr->cq_data_size, 8));
  caps_.max_put_bytes = info_->ep_attr->max_msg_size;
  caps_.inject_bytes = inject_size_;
  MK_INFO(kSubsysNet,
          "%s: fabric %s, domain %s, api %u.%u, mode %s, mr_mode %s, cq_data %zu B, inject %zu B, "
          "max_msg %zu B, tx/rx depth %zu/%zu, hmem %s",
          name_.c_str(), info_->fabric_attr->name, info_->domain_attr->name,
          FI_MAJOR(kFiVersion), FI_MINOR(kFiVersion), mode_names(info_->mode).c_str(),
          mr_mode_names(info_->domain_attr->mr_mode).c_str(), info_->domain_attr->cq_data_size,
          inject_size_, info_->ep_attr->max_msg_size, info_->tx_attr ? info_->tx_attr->size : 0,
          info_->rx_attr ? info_->rx_attr->size : 0, hmem_ ? "yes" : "no");
  return OkStatus();
}

// A provider may claim FI_HMEM and still refuse GPU memory (shm without its CUDA IPC support
// says -FI_ENOSYS at fi_mr_regattr): register a small GPU buffer once, locally, and offer GPU
// windows only when that works. Users then stage through host memory (net_staging=auto).
void LibfabricBackend::probe_gpu_registration() {
  void* probe = nullptr;
  if (cudaMalloc(&probe, 1 << 16) != cudaSuccess) {
    cudaGetLastError();
    hmem_ = false;
    hmem_note_ = "cudaMalloc of the probe buffer failed";
    return;
  }
  fid_mr* mr = nullptr;
  Status s = reg(probe, 1 << 16, FI_WRITE | FI_REMOTE_WRITE, MemKind::kCuda, &mr);
  if (mr) fi_close(&mr->fid);
  cudaFree(probe);
  if (!s.ok()) {
    hmem_ = false;
    hmem_note_ = "the provider offers FI_HMEM but cannot register GPU memory here (" + s.message() + ")";
    MK_INFO(kSubsysNet, "%s: %s: GPU windows are staged through host memory", name_.c_str(), hmem_note_.c_str());
  }
}

Status LibfabricBackend::exchange_addresses() {
  AddrMsg mine;
  memset(&mine, 0, sizeof(mine));
  size_t len = kAddrMax;
  int ret = fi_getname(&ep_->fid, mine.addr, &len);
  Status got = ret == 0 ? OkStatus()
                        : make_status(Code::kSystemError, "%s: fi_getname: %s (address needs %zu bytes)",
                                      name_.c_str(), fi_err(ret).c_str(), len);
  MK_CHECK(agree(bs_, got, "libfabric fi_getname"));
  mine.len = static_cast<uint32_t>(len);
  mine.cq_data_size = static_cast<uint32_t>(info_->domain_attr->cq_data_size);
  snprintf(mine.prov, sizeof(mine.prov), "%s", prov_.c_str());
  snprintf(mine.fabric, sizeof(mine.fabric), "%s", info_->fabric_attr->name ? info_->fabric_attr->name : "");
  std::vector<AddrMsg> all(world_);
  MK_CHECK(bs_.allgather(&mine, all.data(), sizeof(AddrMsg)));
  for (int r = 0; r < world_; ++r) {
    MK_REQUIRE(strcmp(all[r].prov, mine.prov) == 0, Code::kMismatch,
               "libfabric: rank %d uses provider %s, rank %d uses %s: every rank must use the "
               "same one (set MK_NET_PROVIDER alike everywhere)",
               r, all[r].prov, rank_, mine.prov);
    if (strcmp(all[r].fabric, mine.fabric) != 0)
      MK_INFO(kSubsysNet, "%s: rank %d is on fabric %s, this rank on %s", name_.c_str(), r,
              all[r].fabric, mine.fabric);
  }
  addr_.assign(world_, FI_ADDR_NOTAVAIL);
  Status ins;
  for (int r = 0; r < world_ && ins.ok(); ++r) {
    int n = fi_av_insert(av_, all[r].addr, 1, &addr_[r], 0, nullptr);
    if (n != 1)
      ins = make_status(Code::kSystemError, "%s: fi_av_insert of rank %d's address (fabric %s): %s",
                        name_.c_str(), r, all[r].fabric, n < 0 ? fi_err(n).c_str() : "not inserted");
  }
  quiet_epoch_.assign(world_, 0);
  // Doubles as the barrier after the AV insert: nobody writes before every rank can answer.
  MK_CHECK(agree(bs_, ins, "libfabric address exchange"));
  MK_INFO(kSubsysNet, "%s: %d peers in the address vector", name_.c_str(), world_);
  return OkStatus();
}

Status LibfabricBackend::reg(void* base, size_t bytes, uint64_t access, MemKind kind, fid_mr** mr) {
  *mr = nullptr;
  fi_mr_attr attr;
  memset(&attr, 0, sizeof(attr));
  iovec iov;
  iov.iov_base = base;
  iov.iov_len = bytes;
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = access;
  attr.requested_key = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : next_key_++;
  attr.iface = FI_HMEM_SYSTEM;
  if (kind == MemKind::kCuda) {
    cudaPointerAttributes pa;
    cudaError_t e = cudaPointerGetAttributes(&pa, base);
    MK_REQUIRE(e == cudaSuccess && pa.type == cudaMemoryTypeDevice, Code::kInvalidArgument,
               "%s: window %p registered as GPU memory is not device memory (%s)", name_.c_str(),
               base, e == cudaSuccess ? "host or managed" : cudaGetErrorString(e));
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = pa.device;
  }
  int ret = fi_mr_regattr(domain_, &attr, 0, mr);
  if (ret != 0) {
    *mr = nullptr;
    return make_status(ret == -FI_ENOMEM ? Code::kOutOfMemory : Code::kSystemError,
                       "%s: fi_mr_regattr of %zu bytes at %p (%s): %s", name_.c_str(), bytes, base,
                       kind == MemKind::kCuda ? "GPU" : "host", fi_err(ret).c_str());
  }
  if (mr_mode_ & FI_MR_ENDPOINT) {
    ret = fi_mr_bind(*mr, &ep_->fid, 0);
    if (ret == 0) ret = fi_mr_enable(*mr);
    if (ret != 0) {
      fi_close(&(*mr)->fid);
      *mr = nullptr;
      return make_status(Code::kSystemError, "%s: binding a memory region to the endpoint: %s",
                         name_.c_str(), fi_err(ret).c_str());
    }
  }
  if (fi_mr_key(*mr) == FI_KEY_NOTAVAIL) {
    fi_close(&(*mr)->fid);
    *mr = nullptr;
    return make_status(Code::kNotSupported, "%s: the provider uses raw memory keys (FI_MR_RAW)",
                       name_.c_str());
  }
  return OkStatus();
}

// ---- windows --------------------------------------------------------------------------------

Status LibfabricBackend::register_window(void* base, size_t bytes, MemKind kind, WindowId* id) {
  MK_REQUIRE(id != nullptr, Code::kInvalidArgument, "%s register_window: id is null", name_.c_str());
  *id = kNoWindow;
  MK_REQUIRE(!finalized_, Code::kInvalidArgument, "%s register_window after finalize", name_.c_str());
  Status local = error_;
  fid_mr* mr = nullptr;
  if (!local.ok()) {
  } else if (base == nullptr && bytes > 0) {
    local = make_status(Code::kInvalidArgument, "%s register_window: null base for %zu bytes",
                        name_.c_str(), bytes);
  } else if (kind != MemKind::kHost && kind != MemKind::kCuda) {
    local = make_status(Code::kInvalidArgument, "%s register_window: unknown memory kind %u",
                        name_.c_str(), static_cast<unsigned>(kind));
  } else if (kind == MemKind::kCuda && !hmem_) {
    local = make_status(Code::kNotSupported,
                        "%s: GPU windows need FI_HMEM, which this provider does not offer here "
                        "(or net_staging=always, or this rank has no GPU): stage through host memory",
                        name_.c_str());
  } else if (fault::at(fault::Site::kRegister, rank_) == fault::Action::kError) {  // tests
    local = make_status(Code::kSystemError, "%s register_window: the provider refused %zu bytes (%s)", name_.c_str(),
                        bytes, fault::planted(fault::Site::kRegister, rank_).c_str());
  } else if (bytes > 0) {
    local = reg(base, bytes, FI_WRITE | FI_REMOTE_WRITE, kind, &mr);
  }
  // A progressing barrier, not a plain agreement: a peer may still wait on bytes that need
  // this rank's progress to leave (manual-progress providers).
  Status s = quiesce("register_window", false, local);
  if (!s.ok()) {
    if (mr) fi_close(&mr->fid);
    return s;
  }
  WinMsg mine = scratch_remote_;
  if (mr) {
    mine.addr = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(base) : 0;
    mine.key = fi_mr_key(mr);
    mine.size = bytes;
  }
  Window w;
  w.remote.resize(world_);
  s = bs_.allgather(&mine, w.remote.data(), sizeof(WinMsg));
  if (!s.ok()) {
    if (mr) fi_close(&mr->fid);
    return s;
  }
  w.live = true;
  w.base = static_cast<uint8_t*>(base);
  w.bytes = bytes;
  w.kind = kind;
  w.mr = mr;
  if (mr && ((mr_mode_ & FI_MR_LOCAL) || (kind == MemKind::kCuda && (mr_mode_ & FI_MR_HMEM))))
    w.desc = fi_mr_desc(mr);
  windows_.push_back(std::move(w));
  *id = static_cast<WindowId>(windows_.size() - 1);
  MK_TRACE(kSubsysNet, "%s: window %u = %zu bytes at %p (%s)", name_.c_str(), *id, bytes, base,
           kind == MemKind::kCuda ? "GPU" : "host");
  return OkStatus();
}

Status LibfabricBackend::deregister_window(WindowId id) {
  MK_REQUIRE(id < windows_.size(), Code::kInvalidArgument, "%s deregister_window: unknown window %u",
             name_.c_str(), id);
  Window& w = windows_[id];
  if (!w.live || finalized_) return OkStatus();
  Status s = quiesce("deregister_window", true, OkStatus());
  note_failed_teardown();
  if (w.mr) {
    int ret = fi_close(&w.mr->fid);
    if (ret != 0 && s.ok())
      s = make_status(Code::kSystemError, "%s: closing window %u's memory region: %s",
                      name_.c_str(), id, fi_err(ret).c_str());
  }
  w.mr = nullptr;
  w.desc = nullptr;
  w.live = false;
  return s;
}

uint64_t LibfabricBackend::window_size(WindowId id, int rank) const {
  if (id >= windows_.size() || !windows_[id].live || rank < 0 || rank >= world_) return 0;
  return windows_[id].remote[rank].size;
}

// ---- data path ------------------------------------------------------------------------------

Status LibfabricBackend::put(int peer, WindowId src, uint64_t src_off, WindowId dst,
                             uint64_t dst_off, uint64_t bytes, uint32_t imm, uint64_t cookie,
                             bool* posted) {
  *posted = false;
  MK_REQUIRE(!finalized_, Code::kInvalidArgument, "%s: put to rank %d after finalize",
             name_.c_str(), peer);
  if (!error_.ok()) return error_;
  MK_REQUIRE(peer >= 0 && peer < world_, Code::kInvalidArgument, "%s: put to rank %d of %d",
             name_.c_str(), peer, world_);
  MK_REQUIRE(src < windows_.size() && windows_[src].live && dst < windows_.size() &&
                 windows_[dst].live,
             Code::kInvalidArgument, "%s: put to rank %d: window %u or %u not registered",
             name_.c_str(), peer, src, dst);
  if (fault::at(fault::Site::kPut, rank_) == fault::Action::kError)  // tests: a provider error here
    return fail(make_status(Code::kSystemError, "%s: posting a put (%llu bytes, peer %d): provider error (%s)",
                            name_.c_str(), static_cast<unsigned long long>(bytes), peer,
                            fault::planted(fault::Site::kPut, rank_).c_str()));
  const Window& s = windows_[src];
  const WinMsg& d = windows_[dst].remote[peer];
  // A zero-byte window has no memory of its own: the scratch region stands in (some providers
  // reject a null buffer even for zero bytes).
  void* buf = s.mr ? static_cast<void*>(s.base + src_off) : static_cast<void*>(scratch_.data());
  void* desc = s.mr ? s.desc : scratch_desc_;
  const uint64_t raddr = d.addr + dst_off;

  OpCtx* c = get_ctx();
  c->peer = peer;
  c->cookie = cookie;
  ssize_t ret;
  const bool inject = bytes <= inject_size_ && s.kind == MemKind::kHost;
  if (inject) {
    // FI_INJECT: the source may be reused at return, so LocalDone is due now; the completion
    // still comes (it frees the context and names the peer if the write fails).
    c->kind = CtxKind::kPutInjected;
    iovec iov;
    iov.iov_base = buf;
    iov.iov_len = bytes;
    fi_rma_iov riov;
    riov.addr = raddr;
    riov.len = bytes;
    riov.key = d.key;
    fi_msg_rma msg;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = addr_[peer];
    msg.rma_iov = &riov;
    msg.rma_iov_count = 1;
    msg.context = &c->fi;
    msg.data = imm;
    ret = fi_writemsg(ep_, &msg, FI_INJECT | FI_REMOTE_CQ_DATA | FI_COMPLETION);
  } else {
    c->kind = CtxKind::kPut;
    ret = fi_writedata(ep_, buf, bytes, desc, imm, addr_[peer], raddr, d.key, &c->fi);
  }
  if (ret == 0) {
    ++outstanding_;
    if (inject) stash_done_.push_back(LocalDone{cookie});
    *posted = true;
    return OkStatus();
  }
  put_ctx(c);
  if (ret == -FI_EAGAIN) return OkStatus();  // no resources now: progress, then retry
  return make_status(Code::kSystemError,
                     "%s: posting a put (peer %d, %llu bytes, window %u+%llu -> %u+%llu): %s: %s",
                     name_.c_str(), peer, static_cast<unsigned long long>(bytes), src,
                     static_cast<unsigned long long>(src_off), dst,
                     static_cast<unsigned long long>(dst_off),
                     inject ? "fi_writemsg(FI_INJECT)" : "fi_writedata", fi_err(static_cast<int>(ret)).c_str());
}

void LibfabricBackend::post_recv(OpCtx* c) {
  ssize_t ret = fi_recv(ep_, slot_ptr(c->slot), kSlot, ctrl_desc_, FI_ADDR_UNSPEC, &c->fi);
  if (ret == 0) return;
  if (ret == -FI_EAGAIN) {
    repost_.push_back(c);  // retried at the next poll
    return;
  }
  post_error_ = make_status(Code::kSystemError, "%s: posting a receive: %s", name_.c_str(),
                            fi_err(static_cast<int>(ret)).c_str());
  (void)fail(post_error_);
}

void LibfabricBackend::retry_reposts() {
  if (repost_.empty()) return;
  std::vector<OpCtx*> again;
  again.swap(repost_);
  for (OpCtx* c : again) post_recv(c);
}

Status LibfabricBackend::poll(std::vector<LocalDone>* done, std::vector<Arrival>* arrivals,
                              int* seen) {
  *seen = 0;
  retry_reposts();
  fi_cq_data_entry e[kCqBatch];
  for (int it = 0; it < kMaxReadsPerProgress; ++it) {
    ssize_t n = fi_cq_read(cq_, e, kCqBatch);
    if (n == -FI_EAGAIN) break;
    if (n == -FI_EAVAIL) {
      Status es = read_error();
      if (!es.ok()) return es;
      continue;
    }
    if (n < 0)
      return fail(make_status(Code::kSystemError, "%s: fi_cq_read: %s", name_.c_str(),
                              fi_err(static_cast<int>(n)).c_str()));
    *seen += static_cast<int>(n);
    for (ssize_t i = 0; i < n; ++i) {
      void* ctx = e[i].op_context;
      if (e[i].flags & FI_REMOTE_CQ_DATA) {
        // A remote write landed: its bytes are visible. With FI_RX_CQ_DATA it consumed one of
        // our receives (op_context); else op_context is null.
        arrivals->push_back(Arrival{static_cast<uint32_t>(e[i].data)});
        if (ctx && is_recv_ctx(ctx)) post_recv(static_cast<OpCtx*>(ctx));
        continue;
      }
      if (!ctx) continue;
      OpCtx* c = static_cast<OpCtx*>(ctx);
      if (is_recv_ctx(c)) {
        if (e[i].len >= sizeof(QuietMsg)) {
          QuietMsg q;
          memcpy(&q, slot_ptr(c->slot), sizeof(q));
          if (q.magic == kQuietMagic && q.rank >= 0 && q.rank < world_ &&
              q.epoch > quiet_epoch_[q.rank])
            quiet_epoch_[q.rank] = q.epoch;
        }
        post_recv(c);
        continue;
      }
      if ((c->kind == CtxKind::kPut || c->kind == CtxKind::kPutInjected) &&
          fault::at(fault::Site::kCompletion, rank_) == fault::Action::kError) {  // tests: as read_error() does
        const int peer = c->peer;
        const uint64_t cookie = c->cookie;
        --outstanding_;
        put_ctx(c);
        return fail(make_status(Code::kRemoteError,
                                "%s: the completion of a put (cookie %llu, peer %d) reports a provider error (%s)",
                                name_.c_str(), static_cast<unsigned long long>(cookie), peer,
                                fault::planted(fault::Site::kCompletion, rank_).c_str()));
      }
      switch (c->kind) {
        case CtxKind::kPut:
          done->push_back(LocalDone{c->cookie});
          --outstanding_;
          break;
        case CtxKind::kPutInjected:
          --outstanding_;
          break;
        case CtxKind::kCtrlSend:
          send_busy_[c->slot] = 0;
          --ctrl_outstanding_;
          break;
        case CtxKind::kRecv:
          break;
      }
      put_ctx(c);
    }
    if (n < kCqBatch) break;
  }
  return post_error_;
}

Status LibfabricBackend::read_error() {
  fi_cq_err_entry err;
  memset(&err, 0, sizeof(err));
  ssize_t r = fi_cq_readerr(cq_, &err, 0);
  if (r == -FI_EAGAIN) return OkStatus();
  if (r < 0)
    return fail(make_status(Code::kSystemError, "%s: fi_cq_readerr: %s", name_.c_str(),
                            fi_err(static_cast<int>(r)).c_str()));
  std::string who = "an operation of unknown origin";
  char buf[160];
  void* ctx = err.op_context;
  if (ctx && is_recv_ctx(ctx)) {
    OpCtx* c = static_cast<OpCtx*>(ctx);
    if (err.err == FI_ECANCELED) return OkStatus();  // cancelled at close: not a failure
    snprintf(buf, sizeof(buf), "a receive (a quiet message or remote CQ data, %zu bytes too many)",
             err.olen);
    who = buf;
    post_recv(c);
  } else if (ctx) {
    OpCtx* c = static_cast<OpCtx*>(ctx);
    if (c->kind == CtxKind::kCtrlSend) {
      snprintf(buf, sizeof(buf), "the quiet message to rank %d", c->peer);
      send_busy_[c->slot] = 0;
      --ctrl_outstanding_;
    } else {
      snprintf(buf, sizeof(buf), "a put to rank %d (cookie %llu%s)", c->peer,
               static_cast<unsigned long long>(c->cookie),
               c->kind == CtxKind::kPutInjected ? ", injected" : "");
      --outstanding_;
    }
    who = buf;
    put_ctx(c);
  } else if (err.flags & FI_REMOTE_CQ_DATA) {
    snprintf(buf, sizeof(buf), "an incoming write (imm 0x%llx)",
             static_cast<unsigned long long>(err.data));
    who = buf;
  }
  char pbuf[256] = {0};
  const char* ps = fi_cq_strerror(cq_, err.prov_errno, err.err_data, pbuf, sizeof(pbuf));
  Status e = make_status(Code::kRemoteError, "%s: %s failed: %s (err %d); provider says: %s",
                         name_.c_str(), who.c_str(), fi_strerror(err.err), err.err,
                         ps && *ps ? ps : "(nothing)");
  MK_WARN(kSubsysNet, "%s", e.message().c_str());
  return fail(e);
}

Status LibfabricBackend::progress(std::vector<LocalDone>* done, std::vector<Arrival>* arrivals) {
  MK_REQUIRE(!finalized_, Code::kInvalidArgument, "%s: progress after finalize", name_.c_str());
  if (!stash_done_.empty()) {
    done->insert(done->end(), stash_done_.begin(), stash_done_.end());
    stash_done_.clear();
  }
  if (!stash_arr_.empty()) {
    arrivals->insert(arrivals->end(), stash_arr_.begin(), stash_arr_.end());
    stash_arr_.clear();
  }
  if (!error_.ok()) return error_;
  int seen = 0;
  Status ps = poll(done, arrivals, &seen);
  return ps.ok() ? ps : error_;
}

// ---- teardown -------------------------------------------------------------------------------

Status LibfabricBackend::send_quiet(int peer, uint32_t epoch, Clock::time_point deadline) {
  QuietMsg m;
  memset(&m, 0, sizeof(m));
  m.magic = kQuietMagic;
  m.epoch = epoch;
  m.rank = rank_;
  // fi_send, not fi_inject: its completion says the peer's provider has the message, and the
  // quiet step waits for it (an injected message may still need this rank's progress).
  const uint32_t slot = (epoch & 1) * static_cast<uint32_t>(world_) + static_cast<uint32_t>(peer);
  Pause pause;
  for (;;) {
    ssize_t ret = -FI_EAGAIN;
    if (!send_busy_[slot]) {
      uint8_t* b = slot_ptr(kRecvPool + slot);
      memcpy(b, &m, sizeof(m));
      OpCtx* c = get_ctx();
      c->kind = CtxKind::kCtrlSend;
      c->peer = peer;
      c->slot = slot;
      ret = fi_send(ep_, b, sizeof(m), ctrl_desc_, addr_[peer], &c->fi);
      if (ret == 0) {
        send_busy_[slot] = 1;
        ++ctrl_outstanding_;
      } else {
        put_ctx(c);
      }
    }
    if (ret == 0) return OkStatus();
    if (ret != -FI_EAGAIN)
      return make_status(Code::kSystemError, "%s: sending the quiet message to rank %d: %s",
                         name_.c_str(), peer, fi_err(static_cast<int>(ret)).c_str());
    MK_CHECK(stash_poll());
    if (Clock::now() > deadline)
      return make_status(Code::kTimeout, "%s: the quiet message to rank %d could not be posted "
                         "in time (no send resources)", name_.c_str(), peer);
    pause.idle();
  }
}

Status LibfabricBackend::quiesce(const char* what, bool own_puts, Status s) {
  const uint32_t epoch = ++epoch_;
  if (s.ok()) s = error_;
  // A failed job has no collective steps left: the peers may be gone (Bootstrap::fail), and
  // the caller only releases this rank's resources.
  // In a teardown (own_puts: deregister, finalize) that is no error: the caller closes what is
  // this rank's own.
  {
    Status f = bs_.poll_failure();
    if (!f.ok()) {
      bs_.fail(s);
      if (own_puts) return OkStatus();
      return Status(f.code(), name_ + " " + what + ": skipped, the job has failed: " + f.message());
    }
  }
  // Polled in the loops below, every 20 ms: another rank's failure ends the wait.
  auto job_failed = [&, next = Clock::now()]() mutable -> Status {
    if (Clock::now() < next) return OkStatus();
    next = Clock::now() + std::chrono::milliseconds(20);
    return bs_.poll_failure();
  };
  Pause pause;
  // 1. (teardown) This rank's puts complete; their targets keep progressing meanwhile, being
  //    in step 1 or 3 themselves or still in their own work loop.
  const int64_t net_ms = tunables::net_timeout_ms();
  auto deadline = after_ms(net_ms);
  while (own_puts && s.ok() && outstanding_ > 0) {
    int seen = 0;
    s = stash_poll_counted(&seen);
    if (!s.ok()) break;
    if (seen) {
      pause.busy();
      continue;
    }
    if (Clock::now() > deadline) {
      s = make_status(Code::kTimeout, "%s %s: %llu put(s) of rank %d still incomplete after %lld ms",
                      name_.c_str(), what, static_cast<unsigned long long>(outstanding_), rank_,
                      static_cast<long long>(net_ms));
      bs_.fail(s);  // a peer stopped taking this rank's puts: the job cannot go on
      break;
    }
    Status f = job_failed();
    if (!f.ok()) return own_puts ? OkStatus() : f;
    pause.idle();
  }
  // 2. Tell every peer (even after a local failure, so that peers do not wait on this rank).
  const int64_t boot_ms = tunables::bootstrap_timeout_ms();
  deadline = after_ms(boot_ms);
  bool sent = ep_ != nullptr;  // tried even after a failure: the endpoint may still carry them
  for (int p = 0; sent && p < world_; ++p) {
    if (p == rank_) continue;
    Status q = send_quiet(p, epoch, deadline);
    if (!q.ok()) {
      if (s.ok()) s = q;
      sent = false;
    }
  }
  // 3. Keep progressing until every peer has said the same and this rank's quiet messages
  //    have been taken by their targets.
  while (sent) {
    std::vector<int> missing;
    for (int p = 0; p < world_; ++p)
      if (p != rank_ && quiet_epoch_[p] < epoch) missing.push_back(p);
    if (missing.empty() && ctrl_outstanding_ == 0) break;
    int seen = 0;
    Status ps = stash_poll_counted(&seen);
    if (!ps.ok()) {
      if (s.ok()) s = ps;
      break;
    }
    if (seen) {
      pause.busy();
      continue;
    }
    if (Clock::now() > deadline) {
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 16; ++i)
        list += (i ? "," : "") + std::to_string(missing[i]);
      Status t = missing.empty()
                     ? make_status(Code::kTimeout, "%s %s: %llu quiet message(s) of rank %d not "
                                   "taken by their targets within %lld ms", name_.c_str(), what,
                                   static_cast<unsigned long long>(ctrl_outstanding_), rank_,
                                   static_cast<long long>(boot_ms))
                     : make_status(Code::kTimeout, "%s %s: rank(s) %s did not arrive within %lld ms",
                                   name_.c_str(), what, list.c_str(), static_cast<long long>(boot_ms));
      if (s.ok()) s = t;
      bs_.fail(t);
      break;
    }
    Status f = job_failed();
    if (!f.ok()) return own_puts ? OkStatus() : f;
    pause.idle();
  }
  // 4. Every rank returns the same outcome; this is also the barrier.
  return agree(bs_, s, name_ + " " + what);
}

Status LibfabricBackend::finalize() {
  if (finalized_) return OkStatus();
  Status s = ep_ ? quiesce("finalize", true, OkStatus()) : OkStatus();
  note_failed_teardown();
  finalized_ = true;
  Status c = close_all();
  stash_done_.clear();
  stash_arr_.clear();
  return s.ok() ? c : s;
}

Status LibfabricBackend::close_all() {
  if (closed_) return OkStatus();
  closed_ = true;
  Status first;
  auto close = [&](fid* f, const char* what) {
    if (!f) return;
    int ret = fi_close(f);
    if (ret != 0 && first.ok())
      first = make_status(Code::kSystemError, "%s: closing the %s: %s", name_.c_str(), what,
                          fi_err(ret).c_str());
  };
  auto close_mrs = [&]() {
    for (auto& w : windows_) {
      if (w.mr) close(&w.mr->fid, "window memory region");
      w.mr = nullptr;
      w.live = false;
    }
    if (ctrl_mr_) close(&ctrl_mr_->fid, "control memory region");
    if (scratch_mr_) close(&scratch_mr_->fid, "scratch memory region");
    ctrl_mr_ = nullptr;
    scratch_mr_ = nullptr;
  };
  if (ep_ && failed_teardown_ && name_.find("ofi_rxm") != std::string::npos) {
    // A failed job over an rxm provider: the endpoint stays open and goes with the process.
    // Closing it while a peer's write into this rank is under way (the peer failed or stopped
    // progressing mid-transfer, which a failed job makes likely) crashes tcp;ofi_rxm inside
    // fi_close (libfabric 1.17; NetMpi.TeardownOfAFailedJobWithPutsInFlight reproduced it in
    // about one run in three). The regions close, so nothing more lands in this rank's memory;
    // the endpoint, its queues, domain and fabric (sockets and a little memory) are not freed.
    close_mrs();
    MK_INFO(kSubsysNet, "rank %d: %s: the job failed: the endpoint is left open (closing it under a "
            "transfer crashes the provider); it goes with the process", rank_, name_.c_str());
    // The endpoint and what it may still write (its posted receives and their slots, the
    // contexts of puts it still holds) stay allocated until the process ends.
    auto a = std::make_unique<Abandoned>();
    a->ep = ep_, a->av = av_, a->cq = cq_, a->domain = domain_, a->fabric = fabric_;
    a->ctrl_buf = std::move(ctrl_buf_);
    a->scratch = std::move(scratch_);
    a->recv_ctx = std::move(recv_ctx_);
    a->chunks = std::move(chunks_);
    keep_until_exit(std::move(a));
    ep_ = nullptr;
    av_ = nullptr;
    cq_ = nullptr;
    domain_ = nullptr;
    fabric_ = nullptr;
    free_ = nullptr;
  }
  if (ep_) {
    int ret = fi_close(&ep_->fid);
    if (ret == -FI_EBUSY) {  // some providers want the bound memory regions gone first
      close_mrs();
      ret = fi_close(&ep_->fid);
    }
    if (ret != 0 && first.ok())
      first = make_status(Code::kSystemError, "%s: closing the endpoint: %s", name_.c_str(),
                          fi_err(ret).c_str());
    ep_ = nullptr;
  }
  close_mrs();
  if (av_) close(&av_->fid, "address vector");
  if (cq_) close(&cq_->fid, "completion queue");
  if (domain_) close(&domain_->fid, "domain");
  if (fabric_) close(&fabric_->fid, "fabric");
  av_ = nullptr;
  cq_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
  if (info_) fi_freeinfo(info_);
  info_ = nullptr;
  return first;
}

}  // namespace

// ---- entry points ---------------------------------------------------------------------------

Status create_libfabric_backend(Bootstrap& bs, const Topology& topo, const std::string& provider,
                                std::unique_ptr<Backend>* out) {
  auto b = std::make_unique<LibfabricBackend>(bs);
  MK_CHECK(b->init(topo, provider));
  *out = std::move(b);
  return OkStatus();
}

std::vector<std::string> libfabric_providers() {
  apply_env_defaults();
  std::vector<std::string> names;
  fi_info* hints = fi_allocinfo();
  if (!hints) return names;
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode = static_cast<int>(kMrModesHandled);
  fi_info* list = nullptr;
  if (fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, &list) == 0) {
    for (fi_info* i = list; i; i = i->next) {
      if (!(i->caps & FI_RMA) || !i->fabric_attr || !i->fabric_attr->prov_name) continue;
      std::string n = i->fabric_attr->prov_name;
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    }
    fi_freeinfo(list);
  }
  fi_freeinfo(hints);
  return names;
}

}  // namespace net
}  // namespace mk
