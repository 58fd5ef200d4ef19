// The network side of an operator spanning several nodes (see net_session.h).
#include "src/comm/net_session.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/runtime/communicator.h"
#include "src/common/keep_until_exit.h"

namespace mk {
namespace comm {

Status NetSession::create(Communicator* comm, const std::string& staging, std::unique_ptr<NetSession>* out) {
  std::unique_ptr<NetSession> s(new NetSession());
  s->comm_ = comm;
  Bootstrap& bs = comm->bootstrap();
  const std::string mode = staging.empty() ? tunables::net_staging() : staging;
  MK_CHECK(agree(bs,
                 (mode == "auto" || mode == "always" || mode == "never")
                     ? OkStatus()
                     : make_status(Code::kInvalidArgument, "net_staging must be auto, always or never, got '%s'",
                                   mode.c_str()),
                 "network staging mode"));
  MK_CHECK(net::create_backend(bs, comm->topology(), net::BackendConfig{}, &s->be_));
  // Direct only when every rank can register GPU memory; the first rank that cannot says why.
  struct Can {
    uint32_t can;
    char why[220];
  } mine{};
  const net::BackendCaps caps = s->be_->caps();
  mine.can = caps.cuda_windows ? 1 : 0;
  snprintf(mine.why, sizeof(mine.why), "%s",
           caps.cuda_windows_note.empty() ? "it cannot register GPU memory" : caps.cuda_windows_note.c_str());
  std::vector<Can> all(comm->world());
  MK_CHECK(bs.allgather(&mine, all.data(), sizeof(Can)));
  int refuses = -1;
  for (int r = 0; r < comm->world() && refuses < 0; ++r)
    if (!all[r].can) refuses = r;
  std::string reason;
  if (mode == "always") {
    s->staged_ = true;
    reason = "net_staging=always";
  } else if (refuses >= 0) {
    MK_REQUIRE(mode != "never", Code::kNotSupported,
               "net_staging=never, but %s on rank %d cannot take GPU memory: %s (use auto or always)",
               s->be_->name(), refuses, all[refuses].why);
    s->staged_ = true;
    reason = "rank " + std::to_string(refuses) + ": " + all[refuses].why;
  }
  s->what_ = std::string(s->be_->name()) +
             (s->staged_ ? ", staged through pinned host memory (" + reason + ")" : ", GPU memory registered (direct)");
  MK_INFO(kSubsysNet, "rank %d: network %s", comm->rank(), s->what_.c_str());
  // The operator stages (or not) itself: the proxy's own staging stays off for its windows.
  MK_CHECK(ProxyWindows::create(&bs, s->be_.get(), "never", StagingConfig{}, &s->wins_));
  *out = std::move(s);
  return OkStatus();
}

NetSession::~NetSession() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysNet, "network session teardown: %s", s.to_string().c_str());
}

Status NetSession::add_gpu_window(void* base, uint64_t bytes, uint32_t* id) {
  MK_REQUIRE(!staged_, Code::kInternal, "a GPU window in a staged network session");
  return wins_->add(base, bytes, net::MemKind::kCuda, id);
}

Status NetSession::add_host_window(uint64_t bytes, void** ptr, uint32_t* id) {
  void* p = nullptr;
  Status s = [&]() -> Status {
    MK_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    memset(p, 0, bytes);
    return OkStatus();
  }();
  if (p) host_.push_back(p);
  MK_CHECK(agree(comm_->bootstrap(), s, "network host buffer"));
  MK_CHECK(wins_->add(p, bytes, net::MemKind::kHost, id));
  *ptr = p;
  return OkStatus();
}

RingView NetSession::ring_view(const uint64_t* abort) const { return proxy_->ring().view(abort); }

Status NetSession::start(uint32_t n_flags) {
  MK_REQUIRE(!proxy_, Code::kInternal, "network session started twice");
  Bootstrap& bs = comm_->bootstrap();
  Communicator* c = comm_;
  Status fs = [&]() -> Status {
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flags_), std::max<uint32_t>(n_flags, 1) * 8,
                                cudaHostAllocMapped | cudaHostAllocPortable));
    memset(flags_, 0, std::max<uint32_t>(n_flags, 1) * 8);
    return OkStatus();
  }();
  MK_CHECK(agree(bs, fs, "network flag pad"));
  n_flags_ = n_flags;
  sink_ = std::make_unique<HostFlagSink>(flags_, n_flags);
  ProxyConfig pc;
  pc.gpu_ring = true;
  pc.near_gpu = c->device();
  pc.device = c->device();
  // The host is the first responder: a put that stalls fails the proxy (naming the peer and
  // the command) and aborts the communicator before the kernels' own bound expires, so the
  // error says the network lost it rather than only which flag never rose.
  const int64_t sig_ms = tunables::signal_timeout_ms();
  pc.timeout_ms = std::max<int64_t>(1, std::min<int64_t>(tunables::net_timeout_ms(), sig_ms * 3 / 4));
  MK_CHECK(agree(bs, Proxy::create(wins_.get(), sink_.get(), pc, &proxy_), "proxy"));
  proxy_->on_error([c](const Status& s) { c->abort(s); });
  MK_CHECK(proxy_->start());
  started_ = true;
  return OkStatus();
}

Status NetSession::destroy() {
  if (destroyed_) return OkStatus();
  destroyed_ = true;
  Status first;
  auto keep = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  if (proxy_ && started_) {
    // After a failure (this rank's, or one a peer reported) the puts in flight may never
    // complete (a dead peer): a short drain; the collective steps below then return at once.
    const bool failed = comm_->failed() || !comm_->bootstrap().poll_failure().ok();
    Status f = proxy_->flush(failed ? 200 : -1);
    if (!failed) keep(f);
    keep(comm_->bootstrap().teardown_barrier());
    keep(proxy_->stop());
  }
  if (proxy_ && proxy_->abandoned()) {
    // The proxy thread is stuck inside the provider (Proxy::stop gave it up): what it may still
    // touch — the proxy, the windows and their backend, the pinned buffers and flags — stays
    // until the process exits.
    keep_until_exit(std::move(proxy_));
    keep_until_exit(std::move(wins_));
    keep_until_exit(std::move(be_));
    host_.clear();
    flags_ = nullptr;
    return first;
  }
  if (wins_) keep(wins_->destroy());
  if (be_) keep(be_->finalize());
  proxy_.reset();
  for (void* p : host_) cudaFreeHost(p);
  host_.clear();
  if (flags_) cudaFreeHost(flags_);
  flags_ = nullptr;
  return first;
}

}  // namespace comm
}  // namespace mk
