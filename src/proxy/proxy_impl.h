// The proxy behind include/mkernel/proxy/proxy.h: one thread draining the command ring into
// one net::Backend (the windows' backend: the transport wrapped in staging), and turning the
// backend's completions into flags. It knows nothing of staging or of memory kinds.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mkernel/net/backend.h"
#include "mkernel/proxy/proxy.h"

namespace mk {

// imm of a put: the receiver's flag index (31 bits; staging keeps bit 31).
constexpr uint32_t kImmNoFlag = 0x7fffffffu;
inline uint32_t imm_for_flag(uint32_t flag) { return flag == kNoFlag ? kImmNoFlag : (flag & 0x7fffffffu); }

class ProxyImpl final : public Proxy {
 public:
  static Status create(net::Backend* backend, int rank, int world, FlagSink* flags, const ProxyConfig& cfg,
                       std::unique_ptr<ProxyImpl>* out);
  ~ProxyImpl() override;

  CommandRing& ring() override { return *ring_; }
  void on_error(std::function<void(const Status&)> cb) override { on_error_ = std::move(cb); }
  Status start() override;
  Status flush(int64_t timeout_ms) override;
  Status stop() override;
  Status status() const override;
  const std::atomic<uint64_t>& failed_word() const override { return failed_; }
  ProxyStats stats() const override;
  int thread_device() const override { return thread_device_.load(); }
  bool abandoned() const override { return abandoned_; }

 private:
  // A put, from the ring until its local completion (its index is the backend cookie).
  struct Op {
    Command cmd;
    uint64_t start_ns = 0;  // when the proxy took the command: bounds how long it may take
    bool live = false;      // taken and not yet completed
  };
  ProxyImpl() = default;
  void loop();
  bool drain();          // consume ring commands; true if any
  bool post_pending();   // post queued puts; true if any
  bool poll();           // backend progress; true if anything completed
  void check_stalls();
  Status validate(const Command& c) const;
  bool busy() const;
  void fail(const Status& s);
  Status raise_local(uint32_t flag);
  Status raise_arrival(uint32_t imm);

  net::Backend* be_ = nullptr;
  int rank_ = 0, world_ = 1;
  FlagSink* flags_ = nullptr;
  ProxyConfig cfg_;
  int64_t timeout_ms_ = 30000;
  cudaStream_t stream_ = nullptr;  // GPU flag writes (when a GPU exists)
  int device_ = -1;                // CUDA device of stream_ and of the proxy thread
  std::unique_ptr<CommandRing> ring_;
  std::function<void(const Status&)> on_error_;

  // proxy-thread state
  std::vector<Op> ops_;
  std::vector<uint32_t> free_ops_;
  std::vector<uint32_t> pending_;  // ops waiting to be posted, FIFO
  size_t pending_head_ = 0;
  uint32_t inflight_ = 0;          // pending + posted
  bool fence_waiting_ = false;
  Command fence_cmd_{};
  std::vector<uint64_t> flag_counts_;
  std::vector<net::LocalDone> done_buf_;
  std::vector<net::Arrival> arrival_buf_;

  std::thread thread_;
  std::atomic<bool> exited_{false};  // the thread left its loop (stop() waits for this, bounded)
  bool abandoned_ = false;           // stop() gave the thread up: stuck inside the backend
  std::atomic<bool> stop_{false};
  std::atomic<bool> running_{false};
  std::atomic<uint64_t> failed_{0};
  std::atomic<uint64_t> idle_epoch_{0};  // bumps each loop pass with nothing in flight
  std::atomic<int> thread_device_{-1};
  mutable std::mutex mu_;
  Status error_;
  std::atomic<uint64_t> commands_{0}, puts_{0}, bytes_{0}, arrivals_{0}, nops_{0}, eagain_{0}, rejected_{0};
};

}  // namespace mk
