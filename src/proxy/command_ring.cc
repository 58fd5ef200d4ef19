#include "mkernel/proxy/command_ring.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "mkernel/common/cuda_check.h"
#include "src/common/deadline.h"

namespace mk {

Status CommandRing::create(uint64_t capacity, bool gpu, std::unique_ptr<CommandRing>* out) {
  MK_REQUIRE(capacity >= 2 && capacity <= kMaxCapacity && (capacity & (capacity - 1)) == 0,
             Code::kInvalidArgument, "command ring capacity must be a power of two in [2, %llu], got %llu",
             static_cast<unsigned long long>(kMaxCapacity), static_cast<unsigned long long>(capacity));
  static_assert(kMaxCapacity <= SIZE_MAX / sizeof(Command), "the ring's byte count must not wrap");
  std::unique_ptr<CommandRing> r(new CommandRing());
  r->capacity_ = capacity;
  r->gpu_ = gpu;
  const size_t bytes = capacity * sizeof(Command);
  if (gpu) {
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&r->slots_), bytes,
                                cudaHostAllocMapped | cudaHostAllocPortable));
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&r->tail_), 64,
                                cudaHostAllocMapped | cudaHostAllocPortable));
    MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&r->d_head_), sizeof(unsigned long long)));
    // On a stream of its own, bounded: kernels in flight on other streams go on, and a device
    // hung by other work fails the call instead of hanging it.
    MK_CHECK(zero_bounded(r->d_head_, sizeof(unsigned long long), -1, "command ring: zeroing the head"));
  } else {
    r->slots_ = static_cast<Command*>(aligned_alloc(64, bytes));
    r->tail_ = static_cast<uint64_t*>(aligned_alloc(64, 64));
    MK_REQUIRE(r->slots_ && r->tail_, Code::kOutOfMemory, "command ring: host allocation failed");
  }
  memset(r->slots_, 0, bytes);  // seq 0 = never published (a published slot has seq >= 1)
  *r->tail_ = 0;
  *out = std::move(r);
  return OkStatus();
}

CommandRing::~CommandRing() {
  if (gpu_) {
    if (slots_) cudaFreeHost(slots_);
    if (tail_) cudaFreeHost(tail_);
    if (d_head_) cudaFree(d_head_);
  } else {
    free(slots_);
    free(tail_);
  }
}

RingView CommandRing::view(const uint64_t* abort) const {
  return RingView{slots_, d_head_, tail_, abort, capacity_};
}

Status CommandRing::push(const Command& c, int64_t timeout_ms, const std::atomic<uint64_t>* abort) {
  MK_REQUIRE(!gpu_, Code::kInvalidArgument,
             "command ring: this ring serves GPU producers; CPU pushes would race their claims");
  // A slot is claimed only once it has room, so a push that gives up leaves no claimed slot
  // behind: the ring goes on (a claimed, never published slot would stall the proxy for good).
  uint64_t slot = host_head_.load(std::memory_order_relaxed);
  auto deadline = std::chrono::steady_clock::time_point::max();
  int spins = 0;
  for (;;) {
    if (slot < __atomic_load_n(tail_, __ATOMIC_ACQUIRE) + capacity_) {
      if (host_head_.compare_exchange_weak(slot, slot + 1, std::memory_order_relaxed)) break;
      continue;  // another producer took it: `slot` now holds the current head
    }
    if (abort && abort->load(std::memory_order_acquire))
      return make_status(Code::kRemoteError, "command ring: proxy failed while slot %llu waited for room",
                         static_cast<unsigned long long>(slot));
    if (++spins > 64) {
      const auto now = std::chrono::steady_clock::now();
      if (deadline == std::chrono::steady_clock::time_point::max())
        deadline = deadline_after_ms(timeout_ms);
      if (now > deadline)
        return make_status(Code::kTimeout,
                           "command ring: no room for slot %llu within %lld ms (proxy consumed %llu "
                           "of %llu slots): is the proxy running?",
                           static_cast<unsigned long long>(slot), static_cast<long long>(timeout_ms),
                           static_cast<unsigned long long>(__atomic_load_n(tail_, __ATOMIC_ACQUIRE)),
                           static_cast<unsigned long long>(capacity_));
      std::this_thread::yield();
    }
    slot = host_head_.load(std::memory_order_relaxed);
  }
  Command* s = &slots_[slot & (capacity_ - 1)];
  Command tmp = c;
  tmp.seq = 0;
  // Every field but seq, then seq with release semantics.
  memcpy(s, &tmp, offsetof(Command, seq));
  __atomic_store_n(&s->seq, slot + 1, __ATOMIC_RELEASE);
  return OkStatus();
}

bool CommandRing::peek(Command* out) const {
  const Command* s = &slots_[tail_local_ & (capacity_ - 1)];
  if (__atomic_load_n(&s->seq, __ATOMIC_ACQUIRE) != tail_local_ + 1) return false;
  memcpy(out, s, sizeof(Command));
  out->seq = tail_local_ + 1;
  return true;
}

void CommandRing::pop() {
  ++tail_local_;
  __atomic_store_n(tail_, tail_local_, __ATOMIC_RELEASE);
}

}  // namespace mk
