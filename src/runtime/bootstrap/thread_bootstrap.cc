// A world of W ranks inside one process: each rank is a thread holding its own Bootstrap;
// collectives meet in a shared table keyed by the per-rank sequence number.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>

#include "mkernel/common/check.h"
#include "mkernel/runtime/bootstrap.h"
#include "src/runtime/bootstrap/bootstrap_util.h"

namespace mk {
namespace {

struct ThreadWorld {
  struct Op {
    size_t bytes = 0;
    bool bytes_set = false;
    std::vector<std::vector<uint8_t>> data;
    std::vector<bool> arrived;
    int count = 0;
    int departed = 0;
    std::vector<int> failed;  // ranks that gave up on this op (timeout / mismatch)
    bool mismatch = false;    // ranks passed different sizes: nobody waits any longer
  };
  explicit ThreadWorld(int n) : size(n), inbox(n) {}
  int size;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Op> ops;
  // Failure notices: inbox[r] holds what was sent to rank r (guarded by notice_mu, taken after
  // mu where both are held); notices counts them all, so a waiter sees news without the lock.
  std::mutex notice_mu;
  std::vector<std::vector<std::pair<int, Bootstrap::FailureNotice>>> inbox;
  std::atomic<uint64_t> notices{0};
};

class ThreadBootstrap final : public Bootstrap {
 public:
  ThreadBootstrap(std::shared_ptr<ThreadWorld> w, int rank) : w_(std::move(w)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return w_->size; }
  const char* kind() const override { return "threads"; }

  Status allgather(const void* send, void* recv, size_t bytes, int64_t timeout_ms) override {
    MK_CHECK(detail::check_allgather_bytes("threads", bytes, w_->size, SIZE_MAX));
    const int64_t tmo = resolve_timeout(timeout_ms);
    const uint64_t seq = seq_++;
    MK_CHECK(failure_gate("allgather", seq));
    std::unique_lock<std::mutex> lk(w_->mu);
    ThreadWorld::Op& op = w_->ops[seq];
    if (op.data.empty()) {
      op.data.resize(w_->size);
      op.arrived.assign(w_->size, false);
    }
    // Every exit goes through depart(): its Status argument is built (reading op) before
    // the op can be freed, so no path reads op after leaving it.
    if (!op.failed.empty()) {
      return depart(seq, op,
                    make_status(Code::kRemoteError,
                                "threads bootstrap allgather #%llu already failed on rank(s) %s",
                                static_cast<unsigned long long>(seq),
                                detail::rank_list(op.failed).c_str()));
    }
    if (op.bytes_set && op.bytes != bytes) {
      op.failed.push_back(rank_);
      op.mismatch = true;
      w_->cv.notify_all();
      return depart(seq, op,
                    make_status(Code::kMismatch,
                                "threads bootstrap allgather #%llu: rank %d passed %zu bytes, "
                                "others %zu",
                                static_cast<unsigned long long>(seq), rank_, bytes, op.bytes));
    }
    op.bytes = bytes;
    op.bytes_set = true;
    op.data[rank_].assign(static_cast<const uint8_t*>(send),
                          static_cast<const uint8_t*>(send) + bytes);
    op.arrived[rank_] = true;
    ++op.count;
    w_->cv.notify_all();
    // Each waiter keeps its own deadline, so every waiter names the missing ranks itself; a
    // failure notice from any rank ends the wait at once.
    const auto deadline = deadline_after_ms(tmo);
    bool done = false;
    for (;;) {
      done = op.count == w_->size || op.mismatch;
      if (done || detail::Clock::now() >= deadline) break;
      const uint64_t seen = w_->notices.load();
      w_->cv.wait_until(lk, std::min(deadline, detail::Clock::now() + std::chrono::milliseconds(10)),
                        [&] { return op.count == w_->size || op.mismatch || w_->notices.load() != seen; });
      if (w_->notices.load() != seen) {
        Status gate = failure_gate("allgather", seq);
        if (!gate.ok()) {
          op.failed.push_back(rank_);
          w_->cv.notify_all();
          return depart(seq, op, gate);
        }
      }
    }
    if (op.mismatch) {
      return depart(seq, op,
                    make_status(Code::kRemoteError,
                                "threads bootstrap allgather #%llu failed on rank(s) %s",
                                static_cast<unsigned long long>(seq),
                                detail::rank_list(op.failed).c_str()));
    }
    if (!done) {
      std::vector<int> missing;
      for (int r = 0; r < w_->size; ++r)
        if (!op.arrived[r]) missing.push_back(r);
      op.failed.push_back(rank_);
      w_->cv.notify_all();
      Status t = detail::missing_ranks_status("threads", "allgather", seq, missing, tmo);
      fail(t);
      return depart(seq, op, t);
    }
    for (int r = 0; r < w_->size; ++r)
      memcpy(static_cast<uint8_t*>(recv) + r * bytes, op.data[r].data(), bytes);
    return depart(seq, op, OkStatus());
  }

 protected:
  void send_failure_notice(const FailureNotice& n) override {
    {
      std::lock_guard<std::mutex> g(w_->notice_mu);
      for (int r = 0; r < w_->size; ++r)
        if (r != rank_) w_->inbox[r].emplace_back(rank_, n);
    }
    w_->notices.fetch_add(1);
    w_->cv.notify_all();
  }
  void read_failure_notices(std::vector<std::pair<int, FailureNotice>>* out) override {
    std::lock_guard<std::mutex> g(w_->notice_mu);
    auto& mine = w_->inbox[rank_];
    out->insert(out->end(), mine.begin(), mine.end());
    mine.clear();
  }

 private:
  // @pre w_->mu held. @post op may be destroyed (the last rank out erases it): the caller
  // builds its result, reading op, before the call and must not touch op afterwards.
  Status depart(uint64_t seq, ThreadWorld::Op& op, Status result) {
    if (++op.departed == w_->size) w_->ops.erase(seq);
    return result;
  }

  std::shared_ptr<ThreadWorld> w_;
  int rank_;
  uint64_t seq_ = 0;
};

}  // namespace

Status make_thread_world(int size, std::vector<std::unique_ptr<Bootstrap>>* out) {
  MK_REQUIRE(size >= 1, Code::kInvalidArgument, "thread world size must be >= 1, got %d", size);
  auto w = std::make_shared<ThreadWorld>(size);
  out->clear();
  for (int r = 0; r < size; ++r) out->push_back(std::make_unique<ThreadBootstrap>(w, r));
  return OkStatus();
}

}  // namespace mk
