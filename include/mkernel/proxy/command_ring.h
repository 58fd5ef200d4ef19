// mkernel — the command ring between producers (GPU threads, or CPU threads standing in for
// them) and one proxy thread.
//
// Memory and ordering:
//  - slots and `tail` live in pinned host memory mapped into the GPU (plain host memory when
//    the machine has no GPU); the GPU producers' claim counter `head` lives in device memory,
//    CPU producers use a host counter. One ring serves GPU producers or CPU producers, not both.
//  - claim: slot = atomicAdd(head, 1) on the GPU, then back-pressure: the producer waits
//    (bounded) until slot < tail + capacity, reading tail with acquire semantics (system scope).
//    A GPU wait that expires fails the communicator, ring and all. CPU producers claim only a
//    slot that has room (compare-and-swap on head once head < tail + capacity), so a CPU push
//    that gives up leaves the ring usable. Slots are never dropped.
//  - publish: every field but seq, a system-scope fence (__threadfence_system / release), then
//    seq = slot + 1 with a release store.
//  - consume (proxy only): acquire-load seq of slot `tail`; equal to tail + 1 means published;
//    copy the command, then store tail + 1 with release semantics (the slot may be reused).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "mkernel/common/status.h"
#include "mkernel/device/command.h"
#include "mkernel/device/ring_view.h"

namespace mk {

class CommandRing {
 public:
  static constexpr uint64_t kMaxCapacity = uint64_t{1} << 24;  // the proxy_ring_slots maximum
  // capacity: a power of two in [2, kMaxCapacity]. gpu: allocate pinned mapped memory and a device head
  // (needs a GPU); else plain host memory (CPU producers only).
  static Status create(uint64_t capacity, bool gpu, std::unique_ptr<CommandRing>* out);
  ~CommandRing();
  CommandRing(const CommandRing&) = delete;
  CommandRing& operator=(const CommandRing&) = delete;

  // What GPU producers take (device/command_ring.cuh). `abort` may be null.
  RingView view(const uint64_t* abort = nullptr) const;
  uint64_t capacity() const { return capacity_; }

  // CPU producer, thread-safe. Waits for room at most timeout_ms (kTimeout naming the ring
  // and the proxy's progress), or until *abort becomes non-zero (kRemoteError); a push that
  // fails claimed nothing.
  Status push(const Command& c, int64_t timeout_ms, const std::atomic<uint64_t>* abort = nullptr);

  // Consumer side (the proxy thread only).
  // Copies the next published command into *out; false when none is published yet.
  bool peek(Command* out) const;
  // Releases the slot peek() returned.
  void pop();
  uint64_t consumed() const { return tail_local_; }

 private:
  CommandRing() = default;
  uint64_t capacity_ = 0;
  bool gpu_ = false;
  Command* slots_ = nullptr;
  uint64_t* tail_ = nullptr;              // shared with producers
  unsigned long long* d_head_ = nullptr;  // GPU producers' claim counter
  std::atomic<uint64_t> host_head_{0};    // CPU producers' claim counter
  uint64_t tail_local_ = 0;               // the consumer's copy of tail
};

}  // namespace mk
