// mkernel — the host proxy: GPU-initiated networking through the host.
//
// One proxy thread per rank drains the rank's command ring in batches, checks each command
// against the windows it names, posts puts on the windows' backend, polls completions, and
// turns them into flags: a put's arrival raises (+1) `remote_flag` on the receiver, its local
// completion raises `local_flag` on the sender. Flags count: a consumer waits for
// flag >= (number of puts it expects), with epochs deriving that number on the device.
//
// Failure is loud, never silent: a bad command (unknown op, unknown peer or window, bytes
// past a window) is rejected — nothing is written — and the proxy fails with an error naming
// the command; a backend error or a peer that stops completing puts within net_timeout_ms
// fails it naming the peer. After a failure the proxy keeps draining (so producers never
// block) but posts nothing, and calls the on_error callback once (e.g. Communicator::abort).
//
// This header is the proxy's interface; the thread, its queues and its staging live in
// src/proxy/ (docs/proxy.md).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "mkernel/common/status.h"
#include "mkernel/proxy/command_ring.h"
#include "mkernel/proxy/windows.h"

typedef struct CUstream_st* cudaStream_t;

namespace mk {

// Where flags live and how they are raised. raise() is called from the proxy thread only, and
// only once the data the flag vouches for is visible (the backend reported it).
class FlagSink {
 public:
  virtual ~FlagSink() = default;
  virtual uint32_t count() const = 0;
  // Sets flag `index` to `value` (values only grow). GPU sinks write on `stream`, the proxy's
  // own stream (null without a GPU).
  virtual Status raise(uint32_t index, uint64_t value, cudaStream_t stream) = 0;
};

// Flags in host memory, for CPU consumers and for kernels polling mapped pinned memory: a
// release store per raise, no CUDA call.
class HostFlagSink final : public FlagSink {
 public:
  HostFlagSink(uint64_t* flags, uint32_t count) : flags_(flags), count_(count) {}
  uint32_t count() const override { return count_; }
  Status raise(uint32_t index, uint64_t value, cudaStream_t) override {
    __atomic_store_n(&flags_[index], value, __ATOMIC_RELEASE);
    return OkStatus();
  }

 private:
  uint64_t* flags_;
  uint32_t count_;
};

// Flags in device memory (a symmetric signal pad), written on the proxy's CUDA stream with
// cuStreamWriteValue64.
class CudaFlagSink final : public FlagSink {
 public:
  CudaFlagSink(uint64_t* device_flags, uint32_t count) : flags_(device_flags), count_(count) {}
  uint32_t count() const override { return count_; }
  Status raise(uint32_t index, uint64_t value, cudaStream_t stream) override;

 private:
  uint64_t* flags_;
  uint32_t count_;
};

struct ProxyConfig {
  uint64_t ring_slots = 0;    // 0: tunable proxy_ring_slots
  uint32_t max_inflight = 0;  // 0: tunable proxy_max_inflight
  int64_t timeout_ms = -1;    // -1: tunable net_timeout_ms
  bool gpu_ring = false;      // the ring serves GPU producers (pinned memory, device head)
  int near_gpu = -1;          // bind the proxy thread to the CPUs near this CUDA device
  // The rank's CUDA device. The proxy thread makes it current before anything else, so its
  // stream (GPU flag writes), the staging copies it drives and GPUDirect flushes belong to that
  // device whatever device the creating thread had current. -1: the creating thread's device.
  int device = -1;
};

struct ProxyStats {
  uint64_t commands = 0;   // consumed from the ring
  uint64_t puts = 0;       // completed locally
  uint64_t bytes = 0;      // put bytes completed locally
  uint64_t arrivals = 0;   // remote puts that landed here
  uint64_t nops = 0;
  uint64_t eagain = 0;     // times the backend had no resources for a put
  uint64_t rejected = 0;   // bad commands
};

class Proxy {
 public:
  // Not collective. `windows` and `flags` must outlive the proxy.
  static Status create(ProxyWindows* windows, FlagSink* flags, const ProxyConfig& cfg,
                       std::unique_ptr<Proxy>* out);
  virtual ~Proxy() = default;  // stops the thread
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  virtual CommandRing& ring() = 0;
  // Called once with the first error: from the proxy thread, or from stop() when it gives the
  // thread up. Set before start().
  virtual void on_error(std::function<void(const Status&)> cb) = 0;

  virtual Status start() = 0;
  // Waits until every command pushed before the call is consumed and every put completed
  // locally (bounded by the timeout; -1: the proxy's); the thread keeps serving arrivals.
  // Owners shut down collectively: flush() on every rank, a bootstrap barrier, then stop().
  virtual Status flush(int64_t timeout_ms = -1) = 0;
  // Stops and joins the thread. Idempotent. Does not drain: flush() first. Bounded: a thread
  // that does not stop within min(net timeout, 1 s) (at least 0.1 s) — stuck inside a provider call —
  // is given up (the backend's abandon()), and the error says so.
  virtual Status stop() = 0;

  // stop() gave the thread up (stuck inside the backend): the owner must not destroy the proxy,
  // its windows or the backend — the thread may still use them — but keep them until the
  // process exits (NetSession::destroy does).
  virtual bool abandoned() const = 0;
  // ok while healthy; else the first error. Thread-safe.
  virtual Status status() const = 0;
  // Non-zero once failed: CPU producers pass it to CommandRing::push as the abort word.
  virtual const std::atomic<uint64_t>& failed_word() const = 0;
  virtual ProxyStats stats() const = 0;
  // The CUDA device the proxy thread made current (-1: none, or not started yet).
  virtual int thread_device() const = 0;

 protected:
  Proxy() = default;
};

}  // namespace mk
