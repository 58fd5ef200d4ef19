// The libfabric backend, setup: provider choice, endpoint, address exchange, registration, and
// the entry points (see src/net/libfabric/libfabric_internal.h).
#include "src/net/libfabric/libfabric_internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "src/common/random.h"
#include "src/common/wire.h"

namespace mk {
namespace net {
namespace lf {

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


// fi_getinfo for one provider (exact name), RDM + RMA write with remote CQ data.
// Asks for FI_SOURCE first (completions then name their sender, and the backend drops arrivals
// from outside the job), and without it where the provider cannot give an entry with it.
int query_provider(const std::string& prov, bool hmem, fi_info** out) {
  *out = nullptr;
  int ret = 0;
  for (int with_source = 1; with_source >= 0; --with_source) {
    fi_info* hints = fi_allocinfo();
    if (!hints) return -FI_ENOMEM;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE;
    if (hmem) hints->caps |= FI_HMEM;
    if (with_source) hints->caps |= FI_SOURCE;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->domain_attr->mr_mode = static_cast<int>(kMrModesHandled);
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->av_type = FI_AV_TABLE;
    hints->fabric_attr->prov_name = strdup(prov.c_str());
    ret = fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, out);
    fi_freeinfo(hints);
    if (ret == 0 && (!with_source || !usable_infos(*out, prov, hmem).empty())) return 0;
    if (*out) fi_freeinfo(*out);
    *out = nullptr;
  }
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

int remove_dead_shm_regions(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (!d) return 0;
  const uid_t me = geteuid();
  int removed = 0;
  while (const dirent* e = readdir(d)) {
    // "<pid>:<uid>:<n>-mk<16 hex>", nothing more.
    unsigned long pid = 0, uid = 0, n = 0;
    char hex[17] = {0};
    int used = 0;
    if (sscanf(e->d_name, "%lu:%lu:%lu-mk%16[0-9a-f]%n", &pid, &uid, &n, hex, &used) != 4 ||
        e->d_name[used] != '\0' || strlen(hex) != 16 || uid != me || pid == 0 || pid > 0x7fffffffUL)
      continue;
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != me)
      continue;
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to ask)
    if (unlinkat(dirfd(d), e->d_name, 0) == 0) {
      ++removed;
      MK_INFO(kSubsysNet, "removed %s/%s: the shm region of process %lu, which is gone", dir.c_str(), e->d_name,
              pid);
    }
  }
  closedir(d);
  return removed;
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
  (void)remove_dead_shm_regions("/dev/shm");  // what killed processes of this user left
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
  else  // the region in /dev/shm is the name without its scheme ("fi_shm://")
    shm_region_ = strstr(name, "://") ? strstr(name, "://") + 3 : name;
}

Status LibfabricBackend::open_endpoint(const Topology& topo, const std::string& prov) {
  prov_ = prov;
  name_ = "libfabric/" + prov;
  MK_CHECK(select_info(topo, prov));
  MK_CHECK(open_objects(prov));
  MK_CHECK(open_control_area());
  if (hmem_) probe_gpu_registration();
  caps_.cuda_windows = hmem_;
  caps_.cuda_windows_note = hmem_note_;
  caps_.imm_bytes = static_cast<uint32_t>(std::min<size_t>(info_->domain_attr->cq_data_size, 8));
  caps_.max_put_bytes = info_->ep_attr->max_msg_size;
  caps_.inject_bytes = inject_size_;
  MK_INFO(kSubsysNet,
          "%s: fabric %s, domain %s, api %u.%u, mode %s, mr_mode %s, cq_data %zu B, inject %zu B, "
          "max_msg %zu B, tx/rx depth %zu/%zu, hmem %s, senders checked %s",
          name_.c_str(), info_->fabric_attr->name, info_->domain_attr->name,
          FI_MAJOR(kFiVersion), FI_MINOR(kFiVersion), mode_names(info_->mode).c_str(),
          mr_mode_names(info_->domain_attr->mr_mode).c_str(), info_->domain_attr->cq_data_size,
          inject_size_, info_->ep_attr->max_msg_size, info_->tx_attr ? info_->tx_attr->size : 0,
          info_->rx_attr ? info_->rx_attr->size : 0, hmem_ ? "yes" : "no",
          source_ ? "yes (FI_SOURCE)"
                  : tunables::net_check_senders() == "off"
                      ? "no (net_check_senders=off)"
                      : "no (not checked on this provider: docs/backend-contract.md, Senders)");
  return OkStatus();
}

// The provider's info entry for this rank (with FI_HMEM where this rank has a GPU and GPU windows
// may be registered directly, else without), copied into info_; kNotSupported naming what the
// provider offered when no entry fits.
Status LibfabricBackend::select_info(const Topology& topo, const std::string& prov) {
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
  // Senders are checked (auto) where the provider was seen to name them as its address vector
  // does: tcp;ofi_rxm (NetMpi.ArrivalsFromOutsideTheJobAreDropped). Not udp;ofi_rxd (it names the
  // job's own ranks with other addresses: their quiet messages were dropped) nor shm (a message
  // with remote CQ data from outside the job is named as rank 0; only this user's processes can
  // reach it anyway, its regions being 0600); providers not run here (verbs;ofi_rxm, efa) only
  // with net_check_senders=on, as a wrong name would drop the job's own traffic.
  const std::string check = tunables::net_check_senders();
  source_ = (info_->caps & FI_SOURCE) != 0 && (check == "on" || (check == "auto" && prov == "tcp;ofi_rxm"));
  mr_mode_ = static_cast<uint64_t>(info_->domain_attr->mr_mode);
  {
    const size_t ks = info_->domain_attr->mr_key_size;  // bytes; 0 or more than 8: the full 64 bits
    key_bits_ = ks > 0 && ks < 8 ? unsigned(8 * ks) : 64u;
  }
  rx_cq_data_ = (info_->mode & FI_RX_CQ_DATA) != 0;
  inject_size_ = info_->tx_attr ? info_->tx_attr->inject_size : 0;
  return OkStatus();
}

// Fabric, domain, completion queue, address vector and the enabled endpoint.
Status LibfabricBackend::open_objects(const std::string& prov) {
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
  return OkStatus();
}

// The control area (receive slots, quiet-message send slots), the scratch region for zero-byte
// windows, and the pool of posted receives.
Status LibfabricBackend::open_control_area() {
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
    terminate_received(all[r].prov);  // a peer's message is not trusted to be well formed
    terminate_received(all[r].fabric);
    MK_REQUIRE(all[r].len >= 1 && all[r].len <= kAddrMax, Code::kMismatch,
               "libfabric: rank %d sent an address of %u bytes (at most %zu)", r, all[r].len, kAddrMax);
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

Status LibfabricBackend::draw_key(uint64_t* key) const {
  do {
    MK_CHECK(random_bytes(key, sizeof(*key)));
    if (key_bits_ < 64) *key &= (uint64_t(1) << key_bits_) - 1;
  } while (*key == 0);
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
  // A drawn key another region of this domain already holds (the provider says -FI_ENOKEY):
  // draw again; 2^-(key bits - log2 regions) per try.
  int ret = 0;
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (!(mr_mode_ & FI_MR_PROV_KEY)) MK_CHECK(draw_key(&attr.requested_key));
    ret = fi_mr_regattr(domain_, &attr, 0, mr);
    if (ret != -FI_ENOKEY || (mr_mode_ & FI_MR_PROV_KEY)) break;
  }
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

}  // namespace lf

// ---- entry points ---------------------------------------------------------------------------

Status create_libfabric_backend(Bootstrap& bs, const Topology& topo, const std::string& provider,
                                std::unique_ptr<Backend>* out) {
  auto b = std::make_unique<lf::LibfabricBackend>(bs);
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
  hints->domain_attr->mr_mode = static_cast<int>(lf::kMrModesHandled);
  fi_info* list = nullptr;
  if (fi_getinfo(lf::kFiVersion, nullptr, nullptr, 0, hints, &list) == 0) {
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
