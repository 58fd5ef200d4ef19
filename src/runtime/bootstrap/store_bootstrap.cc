// Bootstrap over a key-value store (PyTorch's c10d Store through callbacks).
// Key of rank r's contribution to collective #seq: "<prefix>/<seq>/<r>".
#include <algorithm>
#include <cstring>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/runtime/bootstrap.h"
#include "src/runtime/bootstrap/bootstrap_util.h"

namespace mk {
namespace {

constexpr size_t kMaxAbortBytes = 16;  // "<prefix>/<seq>/abort" holds a rank number

class StoreBootstrap final : public Bootstrap {
 public:
  StoreBootstrap(int rank, int size, std::string prefix, StoreCallbacks cb)
      : rank_(rank), size_(size), prefix_(std::move(prefix)), cb_(std::move(cb)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* kind() const override { return "store"; }

  Status allgather(const void* send, void* recv, size_t bytes, int64_t timeout_ms) override {
    MK_CHECK(detail::check_allgather_bytes("store", bytes, size_, SIZE_MAX));
    const int64_t tmo = resolve_timeout(timeout_ms);
    const uint64_t seq = seq_++;
    MK_CHECK(failure_gate("allgather", seq));
    std::vector<uint8_t> mine(static_cast<const uint8_t*>(send),
                              static_cast<const uint8_t*>(send) + bytes);
    MK_CHECK(cb_.set(key(seq, rank_), mine));
    std::vector<bool> have(size_, false);
    have[rank_] = true;
    memmove(static_cast<uint8_t*>(recv) + rank_ * bytes, mine.data(), bytes);
    int left = size_ - 1;
    auto deadline = deadline_after_ms(tmo);
    detail::Backoff backoff;
    // A rank that timed out leaves "<prefix>/<seq>/abort": a late rank must not succeed
    // where the others failed.
    auto aborted = [&](std::string* who) -> Status {
      std::vector<uint8_t> v;
      bool found = false;
      MK_CHECK(cb_.try_get(abort_key(seq), kMaxAbortBytes, &v, &found));
      if (found) *who = std::string(v.begin(), v.begin() + std::min(v.size(), kMaxAbortBytes));
      return OkStatus();
    };
    while (left > 0) {
      for (int r = 0; r < size_; ++r) {
        if (have[r]) continue;
        std::vector<uint8_t> v;
        bool found = false;
        MK_CHECK(cb_.try_get(key(seq, r), bytes, &v, &found));
        if (!found) continue;
        if (v.size() != bytes)
          return make_status(Code::kMismatch,
                             "store bootstrap allgather #%llu: rank %d sent %zu bytes, rank %d "
                             "expected %zu",
                             static_cast<unsigned long long>(seq), r, v.size(), rank_, bytes);
        memcpy(static_cast<uint8_t*>(recv) + r * bytes, v.data(), bytes);
        have[r] = true;
        --left;
      }
      if (left == 0) break;
      // A failure notice from any rank ends the wait (read every few ms: a read is a round
      // trip per peer).
      MK_CHECK(failure_gate("allgather", seq, /*throttle=*/true));
      if (detail::Clock::now() > deadline) {
        std::vector<int> missing;
        for (int r = 0; r < size_; ++r)
          if (!have[r]) missing.push_back(r);
        std::string r = std::to_string(rank_);
        (void)cb_.set(abort_key(seq), std::vector<uint8_t>(r.begin(), r.end()));
        Status t = detail::missing_ranks_status("store", "allgather", seq, missing, tmo);
        fail(t);
        return t;
      }
      backoff.pause();
    }
    std::string who;
    MK_CHECK(aborted(&who));
    if (!who.empty())
      return make_status(Code::kRemoteError,
                         "store bootstrap allgather #%llu already failed: rank %s timed out on it",
                         static_cast<unsigned long long>(seq), who.c_str());
    // Every rank has set its key of #seq, so every rank has finished reading #seq-1:
    // this rank's key of #seq-1 is no longer needed.
    if (seq > 0 && cb_.erase) (void)cb_.erase(key(seq - 1, rank_));
    return OkStatus();
  }

 protected:
  // Rank r's k-th notice (k = 0, 1: at most a heard one, then its own) under
  // "<prefix>/fail/<r>/<k>": keys are never rewritten.
  void send_failure_notice(const FailureNotice& n) override {
    const auto* p = reinterpret_cast<const uint8_t*>(&n);
    (void)cb_.set(fail_key(rank_, sent_++), std::vector<uint8_t>(p, p + sizeof(n)));
  }
  void read_failure_notices(std::vector<std::pair<int, FailureNotice>>* out) override {
    if (next_.empty()) next_.assign(size_, 0);
    for (int r = 0; r < size_; ++r) {
      while (r != rank_ && next_[r] < 2) {
        std::vector<uint8_t> v;
        bool found = false;
        if (!cb_.try_get(fail_key(r, next_[r]), sizeof(FailureNotice), &v, &found).ok() || !found) break;
        ++next_[r];
        if (v.size() != sizeof(FailureNotice)) continue;
        FailureNotice n;
        memcpy(&n, v.data(), sizeof(n));
        out->emplace_back(r, n);
      }
    }
  }

 private:
  std::string fail_key(int r, int k) const {
    return prefix_ + "/fail/" + std::to_string(r) + "/" + std::to_string(k);
  }
  std::string abort_key(uint64_t seq) const { return prefix_ + "/" + std::to_string(seq) + "/abort"; }
  std::string key(uint64_t seq, int r) const {
    return prefix_ + "/" + std::to_string(seq) + "/" + std::to_string(r);
  }
  int rank_, size_;
  std::string prefix_;
  StoreCallbacks cb_;
  uint64_t seq_ = 0;
  int sent_ = 0;            // notices this rank has stored
  std::vector<int> next_;   // [rank] the next notice index to look for
};

}  // namespace

Status make_store_bootstrap(int rank, int size, const std::string& prefix, StoreCallbacks cb,
                            std::unique_ptr<Bootstrap>* out) {
  MK_REQUIRE(size >= 1 && rank >= 0 && rank < size, Code::kInvalidArgument,
             "store bootstrap: rank %d outside world of %d", rank, size);
  MK_REQUIRE(cb.set && cb.try_get, Code::kInvalidArgument,
             "store bootstrap needs set and try_get callbacks");
  *out = std::make_unique<StoreBootstrap>(rank, size, prefix, std::move(cb));
  return OkStatus();
}

}  // namespace mk
