// Bootstrap base: default broadcast/barrier on top of allgather, and the shared helpers.
#include "mkernel/runtime/bootstrap.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "mkernel/common/check.h"
#include "mkernel/common/tunables.h"
#include "src/runtime/bootstrap/bootstrap_util.h"
#include "src/common/wire.h"

namespace mk {

// ---- job failure ---------------------------------------------------------------------------

static_assert(sizeof(Bootstrap::FailureNotice) == 512, "failure notice layout");

struct Bootstrap::FailureState {
  std::mutex mu;
  std::atomic<bool> failed{false};
  Status own;              // this rank's own cause (first wins)
  Status heard;            // the best cause heard from a peer: an own cause beats a relayed one
  int heard_from = -1;     // whose it is
  bool heard_own = false;  // the sender's own cause (not one it relayed)
  bool sent_own = false;   // notices sent: at most one heard, then one own
  bool sent_heard = false;
  // Owning thread only:
  std::vector<FailureNotice> peer;  // [rank] the latest notice (an own cause beats a heard one)
  std::vector<bool> have;           // [rank]
  detail::Clock::time_point last_read{};
  bool reported = false;
  Status report;
};

namespace {

// A cause that only says another rank did not do its part (a wait that expired): the rank
// waited on is nearer the culprit. Anything else (bad input, a network or CUDA error, a
// mismatch) is a cause of the reporting rank's own. What a rank only heard from another is
// flagged as heard, whatever its code.
bool is_consequence(Code c) { return c == Code::kTimeout; }

// The other rank a cause points at, as mkernel's messages name it: a wait "... from rank P",
// a put that failed or never completed "... to rank P ...", "is rank P alive?", a bootstrap
// "rank(s) P did not arrive". A cause that points at another rank is that rank's doing, not its
// reporter's: -1 when none does. (A put this rank could not post names its peer as "peer P":
// its own provider refused it.)
int suspect_in(const std::string& m, int self) {
  size_t best = std::string::npos;
  int who = -1;
  for (const char* key : {"from rank ", "to rank ", "is rank ", "rank(s) "}) {
    for (size_t at = m.find(key); at != std::string::npos; at = m.find(key, at + 1)) {
      const char* p = m.c_str() + at + strlen(key);
      if (*p < '0' || *p > '9') continue;
      const int r = atoi(p);
      if (r != self && at < best) {
        best = at;
        who = r;
      }
      break;
    }
  }
  return who;
}

// A rank's own cause that makes it the culprit: not a wait that expired, not one that names
// another rank.
bool is_own_fault(Code c, const std::string& m, int self) { return !is_consequence(c) && suspect_in(m, self) < 0; }

std::string notice_text(const Bootstrap::FailureNotice& n) {
  return std::string(n.message, strnlen(n.message, sizeof(n.message)));
}

Bootstrap::FailureNotice make_notice(const Status& s, bool heard) {
  Bootstrap::FailureNotice n;
  memset(&n, 0, sizeof(n));
  n.size = sizeof(n);
  n.version = Bootstrap::kFailureNoticeVersion;
  n.code = static_cast<int32_t>(s.code());
  n.heard = heard ? 1u : 0u;
  snprintf(n.message, sizeof(n.message), "%s", s.message().c_str());
  return n;
}

}  // namespace

Bootstrap::Bootstrap() : fs_(std::make_shared<FailureState>()) {}

void Bootstrap::fail(const Status& why) {
  if (why.ok()) return;
  std::lock_guard<std::mutex> g(fs_->mu);
  if (fs_->own.ok()) fs_->own = why;
  fs_->failed.store(true, std::memory_order_release);
}

bool Bootstrap::failed() const { return fs_->failed.load(std::memory_order_acquire); }

void Bootstrap::exchange_notices() {
  FailureState& f = *fs_;
  const int W = size();
  if (f.peer.empty()) {
    f.peer.resize(W);
    f.have.assign(W, false);
  }
  // 1. This rank's notice: its own cause once known, else what it heard (so that the peers
  //    learn this rank is alive and failed, not silent).
  FailureNotice out;
  bool send = false;
  {
    std::lock_guard<std::mutex> g(f.mu);
    if (!f.own.ok() && !f.sent_own) {
      out = make_notice(f.own, false);
      f.sent_own = send = true;
    } else if (f.own.ok() && !f.heard.ok() && !f.sent_heard && !f.sent_own) {
      out = make_notice(f.heard, true);
      f.sent_heard = send = true;
    }
  }
  if (send && W > 1) send_failure_notice(out);
  // 2. The peers' notices.
  std::vector<std::pair<int, FailureNotice>> in;
  if (W > 1) read_failure_notices(&in);
  f.last_read = detail::Clock::now();
  bool heard_now = false;
  for (auto& [r, n] : in) {
    if (r < 0 || r >= W || r == rank() || n.size != sizeof(FailureNotice) || n.version != kFailureNoticeVersion)
      continue;
    terminate_received(n.message);
    if (!f.have[r] || (f.peer[r].heard && !n.heard)) f.peer[r] = n;
    f.have[r] = true;
    std::lock_guard<std::mutex> g(f.mu);
    // What this rank tells of the failure: the lowest rank's own cause, else the first relay.
    const bool own = !n.heard;
    if (f.heard.ok() || (own && (!f.heard_own || r < f.heard_from))) {
      heard_now |= f.heard.ok();
      f.heard = make_status(Code::kRemoteError, "rank %d failed: %s", r, notice_text(n).c_str());
      f.heard_from = r;
      f.heard_own = own;
    }
    f.failed.store(true, std::memory_order_release);
  }
  // Heard first: tell the others at once that this rank is alive and failed.
  if (heard_now) exchange_notices();
}

Status Bootstrap::poll_failure() {
  exchange_notices();
  if (!failed()) return OkStatus();
  std::lock_guard<std::mutex> g(fs_->mu);
  return fs_->own.ok() ? fs_->heard : fs_->own;
}

Status Bootstrap::failure_gate(const char* op, uint64_t seq, bool throttle) {
  FailureState& f = *fs_;
  const bool was_failed = failed();
  if (!was_failed && throttle && detail::Clock::now() - f.last_read < std::chrono::milliseconds(20))
    return OkStatus();
  exchange_notices();
  if (!failed()) return OkStatus();
  std::vector<int> reporters;
  for (int r = 0; r < static_cast<int>(f.have.size()); ++r)
    if (f.have[r]) reporters.push_back(r);
  std::lock_guard<std::mutex> g(f.mu);
  if (!f.own.ok())
    return Status(f.own.code(), std::string(kind()) + " bootstrap " + op + " #" + std::to_string(seq) +
                                    ": the job failed on this rank: " + f.own.message());
  return Status(Code::kRemoteError, std::string(kind()) + " bootstrap " + op + " #" + std::to_string(seq) +
                                        ": the job failed: rank(s) " + detail::rank_list(reporters) +
                                        " reported a failure: " + f.heard.message());
}

Status Bootstrap::failure_report(int64_t grace_ms) {
  FailureState& f = *fs_;
  exchange_notices();
  if (!failed()) return OkStatus();
  if (f.reported) return f.report;
  if (grace_ms < 0) grace_ms = tunables::failure_grace_ms();
  const int W = size(), me = rank();
  auto deadline = deadline_after_ms(grace_ms);
  detail::Backoff backoff;
  for (;;) {
    int missing = 0;
    for (int r = 0; r < W; ++r) missing += r != me && !f.have[r];
    if (missing == 0 || detail::Clock::now() > deadline) break;
    backoff.pause();
    exchange_notices();
  }
  Status mine;
  {
    std::lock_guard<std::mutex> g(f.mu);
    mine = f.own.ok() ? f.heard : f.own;
  }

  // The culprit, in this order:
  //  1. the lowest rank with a cause of its own (bad input, a network error of its own);
  //  2. the ranks that said nothing (dead or stopped) — of those, only the ones the causes
  //     known here point at when there are such (a rank quick to fail names the peer its
  //     error names, not a peer that is merely still inside its own bounded wait);
  //  3. the lowest rank with a CUDA error of its own (under MPS, a client that dies with its
  //     kernel in flight can fault the others' contexts: a dead rank explains it better);
  //  4. the ranks that only heard of it (alive, not in the call the others waited in);
  //  5. the rank the most causes point at ("... from rank P", "a put to rank P ...").
  struct Cause {
    int rank;
    Code code;
    std::string text;
  };
  std::vector<Cause> own;  // every rank's cause of its own, as known here
  std::vector<int> silent, heard_only;
  for (int r = 0; r < W; ++r) {
    if (r == me) {
      if (!f.own.ok()) own.push_back({r, f.own.code(), f.own.message()});
      else heard_only.push_back(r);
      continue;
    }
    if (!f.have[r]) {
      silent.push_back(r);
      continue;
    }
    if (f.peer[r].heard) heard_only.push_back(r);
    else own.push_back({r, code_from_wire(f.peer[r].code), notice_text(f.peer[r])});
  }
  const Cause* primary = nullptr;
  const Cause* cuda = nullptr;
  std::vector<int> votes(W, 0);
  for (const Cause& c : own) {
    if (is_own_fault(c.code, c.text, c.rank)) {
      if (c.code == Code::kCudaError) {
        if (!cuda) cuda = &c;
      } else if (!primary) {
        primary = &c;
      }
    }
    const int p = suspect_in(c.text, c.rank);
    if (p >= 0 && p < W) ++votes[p];
  }
  const std::string here = "rank " + std::to_string(me) + (f.own.ok() ? " heard: " : " saw: ") + mine.message();
  auto named = [&](const Cause& c) {
    return c.rank == me ? Status(c.code, "job failed: culprit rank " + std::to_string(me) + ": " + c.text)
                        : Status(c.code, "job failed: culprit rank " + std::to_string(c.rank) + ": " + c.text + "; " + here);
  };
  const int most = static_cast<int>(std::max_element(votes.begin(), votes.end()) - votes.begin());
  if (primary) {
    f.report = named(*primary);
  } else if (!silent.empty()) {
    std::vector<int> pointed;
    for (int r : silent)
      if (votes[r] > 0) pointed.push_back(r);
    if (!pointed.empty()) silent = pointed;
    f.report = Status(Code::kTimeout, "job failed: culprit rank(s) " + detail::rank_list(silent) +
                                          ": did not report within " + std::to_string(grace_ms) +
                                          " ms (dead, stopped, or not in a mkernel call); " + here);
  } else if (cuda) {
    f.report = named(*cuda);
  } else if (!heard_only.empty() && static_cast<int>(heard_only.size()) < W) {
    f.report = Status(Code::kTimeout, "job failed: culprit rank(s) " + detail::rank_list(heard_only) +
                                          ": not in the call the others waited in (did not fail on their own); " +
                                          here);
  } else if (W > 0 && votes[most] > 0) {
    f.report = Status(mine.code(), "job failed: culprit rank " + std::to_string(most) + ": the rank " +
                                       std::to_string(votes[most]) + " rank(s)' failures point at; " + here);
  } else {
    f.report = Status(mine.code(), "job failed on every rank; " + here);
  }
  f.reported = true;
  return f.report;
}

int64_t Bootstrap::resolve_timeout(int64_t timeout_ms) const {
  if (timeout_ms >= 0) return timeout_ms;
  return tunables::bootstrap_timeout_ms();
}

Status Bootstrap::broadcast(void* buf, size_t bytes, int root, int64_t timeout_ms) {
  MK_REQUIRE(root >= 0 && root < size(), Code::kInvalidArgument,
             "broadcast root %d outside world of %d", root, size());
  MK_CHECK(detail::check_allgather_bytes(kind(), bytes, size(), SIZE_MAX));
  std::vector<uint8_t> all(bytes * size());
  MK_CHECK(allgather(buf, all.data(), bytes, timeout_ms));
  if (rank() != root) memcpy(buf, all.data() + bytes * root, bytes);
  return OkStatus();
}

Status Bootstrap::barrier(int64_t timeout_ms) {
  uint8_t one = 1;
  std::vector<uint8_t> all(size());
  return allgather(&one, all.data(), 1, timeout_ms);
}

Status Bootstrap::teardown_barrier(int64_t timeout_ms) {
  if (!poll_failure().ok()) return OkStatus();
  Status s = barrier(timeout_ms);
  return failed() ? OkStatus() : s;  // the job failed while waiting: the same
}

Status agree(Bootstrap& bs, const Status& mine, const std::string& what, int64_t timeout_ms) {
  struct Outcome {
    int32_t code;
    char msg[252];
  };
  static_assert(sizeof(Outcome) == 256, "agree() payload");
  Outcome o;
  memset(&o, 0, sizeof(o));
  o.code = static_cast<int32_t>(mine.code());
  snprintf(o.msg, sizeof(o.msg), "%s", mine.message().c_str());
  // A failed job agrees on nothing more: every rank reports the failure (naming its culprit)
  // instead of waiting for ranks that may be dead or stopped.
  if (bs.failed()) {
    bs.fail(mine);
    return bs.failure_report();
  }
  std::vector<Outcome> all(bs.size());
  Status gathered = bs.allgather(&o, all.data(), sizeof(o), timeout_ms);
  if (!gathered.ok()) {
    if (bs.failed()) {
      bs.fail(mine);
      return bs.failure_report();
    }
    return gathered;
  }
  std::vector<int> failed;
  for (int r = 0; r < bs.size(); ++r) {
    terminate_received(all[r].msg);  // a peer's outcome is not trusted to be well formed
    if (all[r].code != 0) failed.push_back(r);
  }
  if (failed.empty()) return OkStatus();
  const Outcome& first = all[failed[0]];
  return make_status(code_from_wire(first.code), "%s failed on rank(s) %s: %s", what.c_str(),
                     detail::rank_list(failed).c_str(), first.msg);
}

bool launched_by_mpi() {
  const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"};
  for (const char* v : vars)
    if (getenv(v)) return true;
  return false;
}

namespace detail {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ",";
    if (i == 16) {
      s += "... (" + std::to_string(ranks.size()) + " in all)";
      break;
    }
    s += std::to_string(ranks[i]);
  }
  return s;
}

Status missing_ranks_status(const char* kind, const char* op, uint64_t seq,
                            const std::vector<int>& missing, int64_t timeout_ms) {
  return make_status(Code::kTimeout,
                     "%s bootstrap %s #%llu: rank(s) %s did not arrive within %lld ms", kind, op,
                     static_cast<unsigned long long>(seq), rank_list(missing).c_str(),
                     static_cast<long long>(timeout_ms));
}

}  // namespace detail
}  // namespace mk
