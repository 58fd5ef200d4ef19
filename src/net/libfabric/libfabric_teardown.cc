// The libfabric backend, teardown: the collective quiesce, finalize, close (see
// src/net/libfabric/libfabric_internal.h).
#include <sys/mman.h>
#include <cerrno>
#include <cstring>

#include "src/common/keep_until_exit.h"
#include "src/net/libfabric/libfabric_internal.h"

namespace mk {
namespace net {
namespace lf {

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
  auto deadline = deadline_after_ms(net_ms);
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
  deadline = deadline_after_ms(boot_ms);
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

void LibfabricBackend::abandon() {
  if (abandoned_.exchange(true)) return;
  // The region's name goes now (the stuck thread keeps its mapping); no provider call.
  if (!shm_region_.empty()) {
    const std::string path = "/" + shm_region_;
    if (shm_unlink(path.c_str()) != 0 && errno != ENOENT)
      MK_WARN(kSubsysNet, "rank %d: %s: could not remove the shared-memory region %s: %s", rank_, name_.c_str(),
              path.c_str(), strerror(errno));
  }
  MK_WARN(kSubsysNet, "rank %d: %s: given up (a thread is stuck inside the provider): its endpoint, queues and "
          "buffers are not closed and go with the process", rank_, name_.c_str());
}

Status LibfabricBackend::finalize() {
  // Given up: nothing is closed, nothing here changes (the stuck thread still reads it); the
  // owner keeps the backend until the process exits (keep_until_exit).
  if (abandoned_.load())
    return make_status(Code::kInternal, "rank %d: %s: given up: a thread is stuck inside the provider (a peer "
                       "that died or stopped inside it may hold one of its locks); nothing was closed",
                       rank_, name_.c_str());
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
  if (abandoned_.load()) return OkStatus();  // entering the provider would wait on the stuck thread's lock
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
    mk::keep_until_exit(std::move(a));
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

}  // namespace lf
}  // namespace net
}  // namespace mk
