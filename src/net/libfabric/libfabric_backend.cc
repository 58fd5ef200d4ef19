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
// next progress(). docs/backend-contract.md has the whole contract.//
// This file: windows and the data path; libfabric_setup.cc and libfabric_teardown.cc the rest
// (src/net/libfabric/libfabric_internal.h).
#include "src/net/libfabric/libfabric_internal.h"

namespace mk {
namespace net {
namespace lf {

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
  if (abandoned_.load()) {  // the region stays registered (closing it enters the provider)
    return make_status(Code::kInternal, "rank %d: %s: given up: window %u was left registered", rank_,
                       name_.c_str(), id);
  }
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
  MK_REQUIRE(!abandoned_.load(), Code::kInternal, "%s: given up (a thread is stuck inside the provider)",
             name_.c_str());
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
  fi_addr_t src[kCqBatch];
  for (int it = 0; it < kMaxReadsPerProgress; ++it) {
    ssize_t n = source_ ? fi_cq_readfrom(cq_, e, kCqBatch, src) : fi_cq_read(cq_, e, kCqBatch);
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
        // our receives (op_context); else op_context is null. From outside the job (a sender
        // the provider names but the address vector lacks): dropped, never an arrival.
        if (source_ && rank_of(src[i]) < 0)
          drop_stranger("an arrival", e[i].data);
        else
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
          // The rank a quiet message claims must be its sender, where the provider names it.
          if (source_ && (q.magic != kQuietMagic || rank_of(src[i]) != q.rank))
            drop_stranger("a control message", q.magic == kQuietMagic ? static_cast<uint64_t>(q.rank) : q.magic);
          else if (q.magic == kQuietMagic && q.rank >= 0 && q.rank < world_ && q.epoch > quiet_epoch_[q.rank])
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

// Every dropped message is counted; the first four and then each power of two are logged (a
// stranger's flood must not flood the log).
void LibfabricBackend::drop_stranger(const char* what, uint64_t data) {
  const uint64_t n = ++strangers_;
  if (log_nth_repeat(n))
    MK_WARN(kSubsysNet,
            "%s: rank %d dropped %s (data 0x%llx) from a sender outside this job's address vector "
            "(%llu so far; later ones are logged at each power of two)",
            name_.c_str(), rank_, what, static_cast<unsigned long long>(data), static_cast<unsigned long long>(n));
}

std::vector<uint8_t> LibfabricBackend::endpoint_address() const {
  std::vector<uint8_t> a(kAddrMax);
  size_t len = a.size();
  if (!ep_ || fi_getname(&ep_->fid, a.data(), &len) != 0) return {};
  a.resize(len);
  return a;
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
  MK_REQUIRE(!abandoned_.load(), Code::kInternal, "%s: given up (a thread is stuck inside the provider)",
             name_.c_str());
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

}  // namespace lf
}  // namespace net
}  // namespace mk
