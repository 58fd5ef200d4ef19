// The proxy thread (proxy_impl.h): ring -> backend -> flags.
#include "src/proxy/proxy_impl.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <string>
#include <fstream>
#include <sstream>

#include <cuda_runtime_api.h>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/runtime/cuda_driver.h"
#include "src/common/deadline.h"

namespace mk {
namespace {

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

const char* op_name(uint8_t op) {
  switch (static_cast<CmdOp>(op)) {
    case CmdOp::kNop: return "nop";
    case CmdOp::kPut: return "put";
    case CmdOp::kFence: return "fence";
  }
  return "unknown";
}

std::string describe(const Command& c) {
  char buf[256];
  snprintf(buf, sizeof(buf),
           "command #%llu (op %s=%u, peer %d, window %u+%llu -> window %u+%llu, %llu B, user %llu)",
           static_cast<unsigned long long>(c.seq - 1), op_name(c.op), c.op, c.peer, c.src_window,
           static_cast<unsigned long long>(c.src_offset), c.dst_window,
           static_cast<unsigned long long>(c.dst_offset), static_cast<unsigned long long>(c.bytes),
           static_cast<unsigned long long>(c.user));
  return buf;
}

// Binds the calling thread to the CPUs of the GPU's NUMA node (best effort).
void bind_near_gpu(int device) {
  char pci[32] = {0};
  if (device < 0 || cudaDeviceGetPCIBusId(pci, sizeof(pci), device) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  for (char* p = pci; *p; ++p) *p = static_cast<char>(tolower(*p));
  std::ifstream f(std::string("/sys/bus/pci/devices/") + pci + "/local_cpulist");
  std::string list;
  if (!f || !std::getline(f, list) || list.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  std::stringstream ss(list);
  std::string range;
  while (std::getline(ss, range, ',')) {
    int a = 0, b = 0;
    if (sscanf(range.c_str(), "%d-%d", &a, &b) == 2) {
      for (int c = a; c <= b && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
    } else if (sscanf(range.c_str(), "%d", &a) == 1 && a < CPU_SETSIZE) {
      CPU_SET(a, &set);
    }
  }
  if (CPU_COUNT(&set) > 0 && pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0)
    MK_INFO(kSubsysProxy, "proxy bound near GPU %d (%s): CPUs %s", device, pci, list.c_str());
}

}  // namespace

Status Proxy::create(ProxyWindows* windows, FlagSink* flags, const ProxyConfig& cfg, std::unique_ptr<Proxy>* out) {
  MK_REQUIRE(windows && flags, Code::kInvalidArgument, "proxy needs windows and a flag sink");
  std::unique_ptr<ProxyImpl> p;
  MK_CHECK(ProxyImpl::create(windows->backend(), windows->rank(), windows->world(), flags, cfg, &p));
  *out = std::move(p);
  return OkStatus();
}

Status ProxyImpl::create(net::Backend* backend, int rank, int world, FlagSink* flags, const ProxyConfig& cfg,
                         std::unique_ptr<ProxyImpl>* out) {
  MK_REQUIRE(backend->api_version() == net::kBackendApiVersion, Code::kMismatch,
             "backend %s speaks API version %u, the proxy %u", backend->name(), backend->api_version(),
             net::kBackendApiVersion);
  std::unique_ptr<ProxyImpl> p(new ProxyImpl());
  p->be_ = backend;
  p->rank_ = rank;
  p->world_ = world;
  p->flags_ = flags;
  p->cfg_ = cfg;
  uint64_t slots = cfg.ring_slots ? cfg.ring_slots
                                  : static_cast<uint64_t>(tunables::proxy_ring_slots());
  p->cfg_.max_inflight = cfg.max_inflight
                             ? cfg.max_inflight
                             : static_cast<uint32_t>(tunables::proxy_max_inflight());
  p->timeout_ms_ = cfg.timeout_ms >= 0 ? cfg.timeout_ms : tunables::net_timeout_ms();
  MK_CHECK(CommandRing::create(slots, cfg.gpu_ring, &p->ring_));
  p->ops_.resize(p->cfg_.max_inflight);
  for (uint32_t i = p->cfg_.max_inflight; i > 0; --i) p->free_ops_.push_back(i - 1);
  p->flag_counts_.assign(flags->count(), 0);
  p->done_buf_.reserve(256);
  p->arrival_buf_.reserve(256);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0) {
    int cur = 0;
    MK_CUDA_CHECK(cudaGetDevice(&cur));
    p->device_ = cfg.device >= 0 ? cfg.device : cur;
    MK_REQUIRE(p->device_ < ndev, Code::kInvalidArgument, "proxy: device %d of %d", p->device_, ndev);
    // The stream belongs to the rank's device, whichever device this thread has current.
    MK_CUDA_CHECK(cudaSetDevice(p->device_));
    cudaError_t e = cudaStreamCreateWithFlags(&p->stream_, cudaStreamNonBlocking);
    cudaSetDevice(cur);
    MK_CUDA_CHECK(e);
  } else {
    cudaGetLastError();
  }
  *out = std::move(p);
  return OkStatus();
}

ProxyImpl::~ProxyImpl() {
  (void)stop();
  if (stream_) cudaStreamDestroy(stream_);
}

Status CudaFlagSink::raise(uint32_t index, uint64_t value, cudaStream_t stream) {
  const CudaDriver* d = nullptr;
  MK_CHECK(cuda_driver(&d));
  MK_CU_CHECK(d->cuStreamWriteValue64(reinterpret_cast<CUstream>(stream),
                                      reinterpret_cast<CUdeviceptr>(&flags_[index]), value, 0));
  return OkStatus();
}

Status ProxyImpl::start() {
  MK_REQUIRE(!running_.load(), Code::kInvalidArgument, "proxy already started");
  stop_.store(false);
  exited_.store(false);
  running_.store(true);
  thread_ = std::thread([this] {
    if (device_ >= 0) {
      cudaError_t e = cudaSetDevice(device_);
      int now = -1;
      if (e == cudaSuccess) e = cudaGetDevice(&now);
      if (e != cudaSuccess) {
        cudaGetLastError();
        fail(make_status(Code::kCudaError, "rank %d: proxy thread: cudaSetDevice(%d): %s", rank_, device_,
                         cudaGetErrorString(e)));
      }
      thread_device_.store(now);
    }
    if (cfg_.near_gpu >= 0) bind_near_gpu(cfg_.near_gpu);
    loop();
    exited_.store(true, std::memory_order_release);
  });
  return OkStatus();
}

Status ProxyImpl::stop() {
  stop_.store(true);
  if (thread_.joinable()) {
    // A loop pass takes microseconds, but a backend call may not return: a provider whose peer
    // died or stopped while holding one of its locks in shared memory (the shm provider, seen
    // with a stopped rank) spins in it for good. The wait is bounded; past it the thread is
    // given up, and the backend told not to enter the provider again (its teardown would wait
    // on the same lock), so that this rank still leaves.
    const int64_t bound = std::max<int64_t>(100, std::min<int64_t>(timeout_ms_, 1000));
    const auto deadline = deadline_after_ms(bound);
    while (!exited_.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (exited_.load(std::memory_order_acquire)) {
      thread_.join();
    } else {
      // Detached, not joined: it stays inside the provider until the process exits; the owners
      // keep what it uses until then (abandoned(), keep_until_exit).
      thread_.detach();
      abandoned_ = true;
      be_->abandon();
      fail(make_status(Code::kTimeout,
                       "rank %d: the proxy thread did not stop within %lld ms: it is stuck inside %s (a peer "
                       "that died or stopped inside the provider may hold one of its locks); given up, with "
                       "the backend's provider state, until the process exits",
                       rank_, static_cast<long long>(bound), be_->name()));
    }
  }
  running_.store(false);
  return status();
}

Status ProxyImpl::status() const {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

ProxyStats ProxyImpl::stats() const {
  ProxyStats s;
  s.commands = commands_.load();
  s.puts = puts_.load();
  s.bytes = bytes_.load();
  s.arrivals = arrivals_.load();
  s.nops = nops_.load();
  s.eagain = eagain_.load();
  s.rejected = rejected_.load();
  return s;
}

void ProxyImpl::fail(const Status& s) {
  bool first = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (error_.ok()) {
      error_ = s;
      first = true;
    }
  }
  if (!first) return;
  failed_.store(1, std::memory_order_release);
  MK_WARN(kSubsysProxy, "proxy of rank %d failed: %s", rank_, s.to_string().c_str());
  if (on_error_) on_error_(s);
}

Status ProxyImpl::validate(const Command& c) const {
  // The common case costs a few compares; the message is formatted only for a bad command.
  auto bad = [&](const char* fmt, auto... args) {
    char why[160];
    snprintf(why, sizeof(why), fmt, args...);
    return make_status(Code::kInvalidArgument, "rank %d rejected %s: %s", rank_, describe(c).c_str(), why);
  };
  if (c.size != sizeof(Command) || c.version != kCommandVersion)
    return bad("size %u / version %u, expected %zu / %u", c.size, c.version, sizeof(Command),
               unsigned(kCommandVersion));
  if (c.op >= kCmdOpCount) return bad("unknown op");
  if (c.local_flag != kNoFlag && c.local_flag >= flags_->count())
    return bad("local flag %u past the %u flags", c.local_flag, flags_->count());
  if (c.op != static_cast<uint8_t>(CmdOp::kPut)) return OkStatus();
  if (c.peer < 0 || c.peer >= world_) return bad("unknown peer (world of %d)", world_);
  if (c.remote_flag != kNoFlag && c.remote_flag >= kImmNoFlag)
    return bad("remote flag %u not encodable", c.remote_flag);
  const uint64_t src_size = be_->window_size(c.src_window, rank_);
  const uint64_t dst_size = be_->window_size(c.dst_window, c.peer);
  if (src_size == 0) return bad("unknown source window");
  if (dst_size == 0) return bad("unknown window on rank %d", c.peer);
  // Overflow-safe: offset <= size and bytes <= size - offset.
  if (c.src_offset > src_size || c.bytes > src_size - c.src_offset)
    return bad("source range past this rank's window (%llu B)", static_cast<unsigned long long>(src_size));
  if (c.dst_offset > dst_size || c.bytes > dst_size - c.dst_offset)
    return bad("destination range past rank %d's window (%llu B)", c.peer,
               static_cast<unsigned long long>(dst_size));
  return OkStatus();
}

Status ProxyImpl::raise_local(uint32_t flag) {
  if (flag == kNoFlag) return OkStatus();
  return flags_->raise(flag, ++flag_counts_[flag], stream_);
}

Status ProxyImpl::raise_arrival(uint32_t imm) {
  arrivals_.fetch_add(1, std::memory_order_relaxed);
  if (imm == kImmNoFlag) return OkStatus();
  if (imm >= flags_->count())
    return make_status(Code::kInvalidArgument,
                       "rank %d: an arrival names flag %u, past this rank's %u flags (peers "
                       "disagree on the flag layout?)",
                       rank_, imm, flags_->count());
  return flags_->raise(imm, ++flag_counts_[imm], stream_);
}

bool ProxyImpl::drain() {
  bool any = false;
  Command c;
  const bool failed = failed_.load(std::memory_order_relaxed) != 0;
  const uint64_t batch_ns = now_ns();  // one clock read per batch: the stall bound is coarse anyway
  // A fence holds later commands back until every earlier put completed.
  while (!fence_waiting_ && (failed || inflight_ < cfg_.max_inflight) && ring_->peek(&c)) {
    ring_->pop();
    any = true;
    commands_.fetch_add(1, std::memory_order_relaxed);
    if (failed_.load(std::memory_order_relaxed)) continue;  // fail-stop: drain, post nothing
    Status v = validate(c);
    if (!v.ok()) {
      rejected_.fetch_add(1, std::memory_order_relaxed);
      fail(v);
      continue;
    }
    switch (static_cast<CmdOp>(c.op)) {
      case CmdOp::kNop: {
        nops_.fetch_add(1, std::memory_order_relaxed);
        Status s = raise_local(c.local_flag);
        if (!s.ok()) fail(s);
        break;
      }
      case CmdOp::kFence:
        if (inflight_ == 0) {
          Status s = raise_local(c.local_flag);
          if (!s.ok()) fail(s);
        } else {
          fence_waiting_ = true;
          fence_cmd_ = c;
        }
        break;
      case CmdOp::kPut: {
        uint32_t id = free_ops_.back();
        free_ops_.pop_back();
        Op& op = ops_[id];
        op.cmd = c;
        op.live = true;
        op.start_ns = batch_ns;
        ++inflight_;
        pending_.push_back(id);
        break;
      }
    }
  }
  return any;
}

bool ProxyImpl::post_pending() {
  bool any = false;
  while (pending_head_ < pending_.size()) {
    if (failed_.load(std::memory_order_relaxed)) break;
    const uint32_t id = pending_[pending_head_];
    const Command& c = ops_[id].cmd;
    bool posted = false;
    Status s = be_->put(c.peer, c.src_window, c.src_offset, c.dst_window, c.dst_offset, c.bytes,
                        imm_for_flag(c.remote_flag), id, &posted);
    if (!s.ok()) {
      fail(Status(s.code(), "rank " + std::to_string(rank_) + ": posting " + describe(c) + ": " + s.message()));
      break;
    }
    if (!posted) {
      eagain_.fetch_add(1, std::memory_order_relaxed);
      break;  // the backend is out of resources: progress first, keep the order
    }
    ++pending_head_;
    any = true;
  }
  if (pending_head_ == pending_.size()) {
    pending_.clear();
    pending_head_ = 0;
  }
  return any;
}

bool ProxyImpl::poll() {
  done_buf_.clear();
  arrival_buf_.clear();
  // Arrivals come back once their bytes are visible where the consumer reads them (the
  // backend's contract; staging copies and GPUDirect flushes happen inside it).
  Status s = be_->progress(&done_buf_, &arrival_buf_);
  if (!s.ok()) fail(s);
  for (const net::LocalDone& d : done_buf_) {
    if (d.cookie >= ops_.size() || !ops_[d.cookie].live) continue;
    const uint32_t id = static_cast<uint32_t>(d.cookie);
    Op& op = ops_[id];
    puts_.fetch_add(1, std::memory_order_relaxed);
    bytes_.fetch_add(op.cmd.bytes, std::memory_order_relaxed);
    Status r = raise_local(op.cmd.local_flag);
    if (!r.ok()) fail(r);
    op.live = false;
    free_ops_.push_back(id);
    --inflight_;
  }
  for (const net::Arrival& a : arrival_buf_) {
    Status r = raise_arrival(a.imm);
    if (!r.ok()) fail(r);
  }
  if (fence_waiting_ && inflight_ == 0) {
    fence_waiting_ = false;
    Status r = raise_local(fence_cmd_.local_flag);
    if (!r.ok()) fail(r);
  }
  return !done_buf_.empty() || !arrival_buf_.empty();
}

// A put that does not complete within the timeout names its peer. The oldest stalled put
// names the culprit: later puts to healthy peers can queue behind it in the backend.
void ProxyImpl::check_stalls() {
  if (failed_.load(std::memory_order_relaxed) || inflight_ == 0) return;
  const uint64_t now = now_ns(), limit = ms_to_ns(timeout_ms_);
  const Op* oldest = nullptr;
  for (const Op& op : ops_)
    if (op.live && (!oldest || op.start_ns < oldest->start_ns)) oldest = &op;
  if (oldest && now - oldest->start_ns > limit)
    fail(make_status(Code::kTimeout,
                     "rank %d: a put to rank %d did not complete within %lld ms (%s): is rank %d "
                     "alive?",
                     rank_, oldest->cmd.peer, static_cast<long long>(timeout_ms_),
                     describe(oldest->cmd).c_str(), oldest->cmd.peer));
}

bool ProxyImpl::busy() const { return inflight_ != 0 || fence_waiting_; }

void ProxyImpl::loop() {
  uint64_t idle = 0, last_check = now_ns();
  while (!stop_.load(std::memory_order_acquire)) {
    bool any = drain();
    if (!failed_.load(std::memory_order_relaxed)) any |= post_pending();
    any |= poll();
    // After a failure nothing completes reliably: count the proxy idle so flush() returns
    // (with the error) instead of waiting for puts that will never finish.
    if (!busy() || failed_.load(std::memory_order_relaxed))
      idle_epoch_.fetch_add(1, std::memory_order_release);
    const uint64_t t = now_ns();
    if (t - last_check > 10000000ull) {  // every 10 ms
      check_stalls();
      last_check = t;
    }
    if (any) {
      idle = 0;
    } else if (++idle > 1024) {
      // Quiet: yield the core now and then, but stay responsive (latency matters here).
      if ((idle & 63) == 0) std::this_thread::yield();
    }
  }
}

Status ProxyImpl::flush(int64_t timeout_ms) {
  if (timeout_ms < 0) timeout_ms = timeout_ms_;
  MK_REQUIRE(running_.load(), Code::kInvalidArgument, "proxy flush: not started");
  // Wait for the ring to be consumed up to what was pushed now, and for an idle pass after.
  auto deadline = deadline_after_ms(timeout_ms);
  const RingView v = ring_->view();
  for (;;) {
    Status s = status();
    if (!s.ok()) return s;
    // The ring is empty when the slot at tail is unpublished.
    const uint64_t tail = __atomic_load_n(v.tail, __ATOMIC_ACQUIRE);
    const Command* slot = &v.slots[tail & (v.capacity - 1)];
    const bool ring_empty = __atomic_load_n(&slot->seq, __ATOMIC_ACQUIRE) != tail + 1;
    if (ring_empty) {
      // Two idle passes after seeing the ring empty: nothing pending, nothing in flight.
      uint64_t e0 = idle_epoch_.load(std::memory_order_acquire);
      for (;;) {
        uint64_t e = idle_epoch_.load(std::memory_order_acquire);
        if (e >= e0 + 2) return status();
        if (std::chrono::steady_clock::now() > deadline) break;
        if (!status().ok()) return status();
        std::this_thread::yield();
      }
    }
    if (std::chrono::steady_clock::now() > deadline)
      return make_status(Code::kTimeout,
                         "rank %d: proxy flush did not finish within %lld ms (%llu commands "
                         "consumed, %llu puts completed)",
                         rank_, static_cast<long long>(timeout_ms),
                         static_cast<unsigned long long>(commands_.load()),
                         static_cast<unsigned long long>(puts_.load()));
    std::this_thread::yield();
  }
}

}  // namespace mk
