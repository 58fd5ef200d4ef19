// mkernel — the host proxy: GPU-initiated networking through the host.
//
// One proxy thread per rank drains the rank's command ring in batches, checks each command
// against the windows it names, posts puts on the network backend, polls completions, and
// turns them into flags: a put's arrival raises (+1) `remote_flag` on the receiver, its local
// completion raises `local_flag` on the sender. Flags count: a consumer waits for
// flag >= (number of puts it expects), with epochs deriving that number on the device.
//
// Failure is loud, never silent: a bad command (unknown op, unknown peer or window, bytes
// past a window) is rejected — nothing is written — and the proxy fails with an error naming
// the command; a backend error or a peer that stops completing puts within net_timeout_ms
// fails it naming the peer. After a failure the proxy keeps draining (so producers never
// block) but posts nothing, and calls the on_error callback once (e.g. Communicator::abort).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/net/backend.h"
#include "mkernel/proxy/command_ring.h"
#include "mkernel/proxy/windows.h"

typedef struct CUstream_st* cudaStream_t;

namespace mk {

// Where flags live and how they are raised. raise() is called from the proxy thread only.
class FlagSink {
 public:
  virtual ~FlagSink() = default;
  virtual uint32_t count() const = 0;
  // Sets flag `index` to `value` (values only grow), visible to consumers after every copy
  // the proxy issued on `stream` before it (GPU sinks write on that stream; null without GPU).
  virtual Status raise(uint32_t index, uint64_t value, cudaStream_t stream) = 0;
};

// Flags in host memory, for CPU consumers: a release store per raise.
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

// How a staging proxy copies between a window and its staging slots. The default uses the
// CUDA runtime for GPU memory (an asynchronous copy on the proxy's stream, an event per copy)
// and memcpy for host memory. Called from the proxy thread only.
class StagingCopier {
 public:
  virtual ~StagingCopier() = default;
  // Starts a copy. *ticket >= 0: asynchronous, poll it; -1: already done.
  virtual Status start(void* dst, const void* src, uint64_t bytes, bool device, int* ticket) = 0;
  // *done = true once the copy finished (the ticket is then free); an error means it failed
  // (the proxy then fails: the chunk is never sent and its flag never raised).
  virtual Status poll(int ticket, bool* done) = 0;
};

struct ProxyConfig {
  uint64_t ring_slots = 0;    // 0: tunable proxy_ring_slots
  uint32_t max_inflight = 0;  // 0: tunable proxy_max_inflight
  int64_t timeout_ms = -1;    // -1: tunable net_timeout_ms
  bool gpu_ring = false;      // the ring serves GPU producers (pinned memory, device head)
  int near_gpu = -1;          // bind the proxy thread to the CPUs near this CUDA device
  // The rank's CUDA device. The proxy thread makes it current before anything else, so the
  // stream and events of its own staging copies, and GPUDirect flushes, belong to that device
  // whatever device the creating thread had current. -1: the creating thread's device.
  int device = -1;
  // Staging copies through this copier instead of the default (tests inject failures); the
  // caller keeps it alive while the proxy lives.
  StagingCopier* copier = nullptr;
};

struct ProxyStats {
  uint64_t commands = 0;   // consumed from the ring
  uint64_t puts = 0;       // completed locally
  uint64_t bytes = 0;      // put bytes completed locally
  uint64_t arrivals = 0;   // remote puts that landed here
  uint64_t nops = 0;
  uint64_t eagain = 0;     // times the backend had no resources
  uint64_t rejected = 0;   // bad commands
};

// Flags in device memory (a symmetric signal pad), written on the proxy's CUDA stream with
// cuStreamWriteValue64, so a flag rises only after the staging copies issued before it.
class CudaFlagSink final : public FlagSink {
 public:
  CudaFlagSink(uint64_t* device_flags, uint32_t count) : flags_(device_flags), count_(count) {}
  uint32_t count() const override { return count_; }
  Status raise(uint32_t index, uint64_t value, cudaStream_t stream) override;

 private:
  uint64_t* flags_;
  uint32_t count_;
};

class Proxy {
 public:
  static Status create(ProxyWindows* windows, FlagSink* flags, const ProxyConfig& cfg,
                       std::unique_ptr<Proxy>* out);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  CommandRing& ring() { return *ring_; }
  // Called once, from the proxy thread, with the first error. Set before start().
  void on_error(std::function<void(const Status&)> cb) { on_error_ = std::move(cb); }

  Status start();
  // Waits until every command pushed before the call is consumed and every put completed
  // locally (bounded by the timeout); the thread keeps serving arrivals. Owners shut down
  // collectively: flush() on every rank, a bootstrap barrier, then stop().
  Status flush(int64_t timeout_ms = -1);
  // Stops and joins the thread. Idempotent. Does not drain: flush() first.
  Status stop();

  // ok while healthy; else the first error. Thread-safe.
  Status status() const;
  // Non-zero once failed: CPU producers pass it to CommandRing::push as the abort word.
  const std::atomic<uint64_t>& failed_word() const { return failed_; }
  ProxyStats stats() const;
  // The CUDA device the proxy thread made current (-1: none, or not started yet).
  int thread_device() const { return thread_device_.load(); }

 private:
  struct Op {
    Command cmd;
    uint64_t start_ns = 0;   // when the proxy took the command: bounds how long it may take
    bool live = false;       // taken and not yet completed
    bool staged = false;
    uint32_t chunks = 1, chunks_started = 0, chunks_done = 0;
  };
  // Staging: one chunk of a staged put on its way out.
  struct OutChunk {
    uint32_t op, chunk, outbox_slot, inbox_slot;
    int copy = -1;           // copy ticket (-1: done)
    bool posted = false;
  };
  // Staging: one chunk landed in the inbox, being copied into its window.
  struct InChunk {
    int sender;
    uint32_t slot;
    StagedHeader h;
    int copy = -1;
  };
  Proxy() = default;
  void loop();
  bool drain();                 // consume ring commands; true if any
  bool post_pending();          // post queued puts; true if any
  bool poll();                  // backend progress; true if anything completed
  void check_stalls();
  Status validate(const Command& c) const;
  bool stage_out();             // start copies and post staged chunks; true if any
  Status on_staged_arrival(uint32_t imm);
  bool stage_in();              // finish inbox copies, raise flags, return credits
  Status copy(void* dst, const void* src, uint64_t bytes, bool device, int* ticket);
  // True once the copy finished successfully. A failed copy fails the proxy and is never
  // reported done (its data must not be sent or its flag raised).
  bool copy_done(int ticket);
  Status flush_gpu_writes();    // before raising a flag for a direct put into GPU memory
  bool busy() const;
  void fail(const Status& s);
  Status raise_local(uint32_t flag);
  Status raise_arrival(uint32_t flag);

  ProxyWindows* wins_ = nullptr;
  net::Backend* be_ = nullptr;
  int rank_ = 0, world_ = 1;
  cudaStream_t stream_ = nullptr;   // staging copies and GPU flag writes (when a GPU exists)
  int device_ = -1;                 // CUDA device of stream_ and of the proxy thread
  std::vector<void*> events_;       // copy tickets: cudaEvent_t, reused
  std::vector<int> free_events_;
  // staging state (proxy thread)
  std::vector<uint32_t> staged_queue_;  // ops with chunks left to start, FIFO
  std::vector<OutChunk> out_;
  std::vector<uint32_t> free_outbox_;
  std::vector<uint32_t> out_free_ids_;
  std::vector<uint64_t> sent_to_, credit_from_;     // per peer: my slots used / freed at peer
  std::vector<InChunk> in_;
  std::vector<std::vector<uint8_t>> freed_;         // per sender: inbox slots copied out
  std::vector<uint64_t> next_credit_;               // per sender: next slot (in order) to free
  std::vector<uint32_t> credit_owed_;               // per sender: freed slots not yet returned
  std::map<std::pair<int, uint64_t>, uint32_t> chunks_in_;  // (sender, command) -> chunks landed
  FlagSink* flags_ = nullptr;
  ProxyConfig cfg_;
  int64_t timeout_ms_ = 30000;
  std::unique_ptr<CommandRing> ring_;
  std::function<void(const Status&)> on_error_;

  // proxy-thread state
  std::vector<Op> ops_;              // indexed by cookie
  std::vector<uint32_t> free_ops_;
  std::vector<uint32_t> pending_;    // ops waiting to be posted, FIFO
  size_t pending_head_ = 0;
  uint32_t inflight_ = 0;            // pending + posted
  bool fence_waiting_ = false;
  Command fence_cmd_{};
  std::vector<uint64_t> flag_counts_;
  std::vector<net::LocalDone> done_buf_;
  std::vector<net::Arrival> arrival_buf_;

  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> running_{false};
  std::atomic<uint64_t> failed_{0};
  std::atomic<uint64_t> idle_epoch_{0};  // bumps each loop pass with nothing in flight
  std::atomic<int> thread_device_{-1};
  mutable std::mutex mu_;
  Status error_;
  std::atomic<uint64_t> commands_{0}, puts_{0}, bytes_{0}, arrivals_{0}, nops_{0}, eagain_{0},
      rejected_{0};
};

// imm (32-bit remote completion data) of a direct put: the receiver's flag index.
constexpr uint32_t kImmNoFlag = 0x7fffffffu;
inline uint32_t imm_for_flag(uint32_t flag) { return flag == kNoFlag ? kImmNoFlag : (flag & 0x7fffffffu); }

}  // namespace mk
