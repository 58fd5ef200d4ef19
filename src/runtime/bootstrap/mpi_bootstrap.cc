// Bootstrap over MPI. Collectives are built from point-to-point messages polled against a
// deadline (MPI's own collectives cannot time out), so the ranks whose messages never came
// are known and named.
#include "mkernel/runtime/bootstrap_mpi.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "mkernel/common/check.h"
#include "src/common/env_defaults.h"
#include "src/runtime/bootstrap/bootstrap_util.h"

namespace mk {
namespace {

constexpr int kTagBase = 0x4d4b;  // tags kTagBase + (seq % kTagSpan): never a user's tag space
constexpr int kTagSpan = 4096;
constexpr int kFailTag = kTagBase - 1;  // failure notices (Bootstrap::fail)

Status mpi_status(int err, const char* what) {
  char msg[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(err, msg, &len);
  return make_status(Code::kSystemError, "%s failed: %s", what, msg);
}
#define MK_MPI_CHECK(expr)                                              \
  do {                                                                  \
    int mk_mpi_e_ = (expr);                                             \
    if (mk_mpi_e_ != MPI_SUCCESS) {                                     \
      ::mk::Status mk_s_ = mpi_status(mk_mpi_e_, #expr);                \
      ::mk::detail::log_check_failure(__FILE__, __LINE__, #expr, mk_s_); \
      return mk_s_;                                                     \
    }                                                                   \
  } while (0)

// What a bootstrap leaves to MPI_Finalize: the notice communicators (never freed while MPI runs,
// see MpiBootstrap::notice_comm_) and the buffers of a failed bootstrap's notices that may still
// be on their way. MPI deletes MPI_COMM_SELF's attributes first thing in
// MPI_Finalize; the delete callback of ours frees them there.
struct Leftovers {
  std::mutex mu;
  int keyval = MPI_KEYVAL_INVALID;
  std::vector<MPI_Comm> comms;
  std::vector<std::deque<Bootstrap::FailureNotice>*> bufs;
};
Leftovers& leftovers() {
  static Leftovers* l = new Leftovers;  // NOLINT: lives as long as MPI may call back
  return *l;
}
// Receives one message of `tag` that has arrived on `c`, if any (never waits): its sender and
// bytes. False when none is there.
bool take_arrived(MPI_Comm c, int tag, int* from, std::vector<uint8_t>* bytes) {
  int flag = 0;
  MPI_Status st;
  if (MPI_Iprobe(MPI_ANY_SOURCE, tag, c, &flag, &st) != MPI_SUCCESS || !flag) return false;
  int count = 0;
  MPI_Get_count(&st, MPI_BYTE, &count);
  bytes->assign(static_cast<size_t>(std::max(count, 1)), 0);
  if (MPI_Recv(bytes->data(), count, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, c, MPI_STATUS_IGNORE) != MPI_SUCCESS)
    return false;
  bytes->resize(static_cast<size_t>(count));
  *from = st.MPI_SOURCE;
  return true;
}

int free_leftovers(MPI_Comm, int, void*, void*) {
  Leftovers& l = leftovers();
  std::lock_guard<std::mutex> g(l.mu);
  for (MPI_Comm& c : l.comms) {
    // Notices nobody read (they came after the last read): received here, so MPI holds none
    // of their buffers past the communicator.
    int from = 0;
    std::vector<uint8_t> sink;
    while (take_arrived(c, MPI_ANY_TAG, &from, &sink)) {
    }
    MPI_Comm_free(&c);
  }
  l.comms.clear();
  for (auto* b : l.bufs) delete b;
  l.bufs.clear();
  if (l.keyval != MPI_KEYVAL_INVALID) MPI_Comm_free_keyval(&l.keyval);
  return MPI_SUCCESS;
}
void leave_to_finalize(MPI_Comm c, std::deque<Bootstrap::FailureNotice>* bufs = nullptr) {
  Leftovers& l = leftovers();
  std::lock_guard<std::mutex> g(l.mu);
  if (l.keyval == MPI_KEYVAL_INVALID &&
      MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_leftovers, &l.keyval, nullptr) == MPI_SUCCESS)
    MPI_Comm_set_attr(MPI_COMM_SELF, l.keyval, nullptr);
  if (c != MPI_COMM_NULL) l.comms.push_back(c);
  if (bufs) l.bufs.push_back(bufs);
}

class MpiBootstrap final : public Bootstrap {
 public:
  // `notices`: a communicator of the same ranks that carries failure notices only. It is never
  // freed (see notice_comm_).
  MpiBootstrap(MPI_Comm comm, MPI_Comm notices, bool finalize_on_destroy)
      : comm_(comm), notice_comm_(notices), finalize_(finalize_on_destroy) {
    leave_to_finalize(notice_comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiBootstrap() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    // MPI_Finalize waits for every process of the job, so it would hang on a dead or stopped
    // one: after a failure (or when the ranks cannot meet once more, within the bootstrap
    // bound) this rank leaves without it. The launcher then sees the process end without
    // finalizing and ends the job (mpirun: on every rank).
    (void)poll_failure();  // a pending failure notice leaves now
    bool leave = failed();
    if (!leave && finalize_) leave = !barrier().ok();
    // A failure notice still in flight keeps its buffer: the requests are released, the
    // buffers left to MPI_Finalize (leave_to_finalize).
    for (MPI_Request& r : notice_reqs_) {
      int done = 0;
      if (r != MPI_REQUEST_NULL) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (!done && r != MPI_REQUEST_NULL) {
        MPI_Request_free(&r);
        leave = true;
      }
    }
    // MPI_Comm_free is local (it waits for no one); the notices' communicator stays.
    MPI_Comm_free(&comm_);
    if (leave) {
      leave_to_finalize(MPI_COMM_NULL, new std::deque<FailureNotice>(std::move(notice_bufs_)));
      return;
    }
    if (finalize_) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* kind() const override { return "mpi"; }

  Status allgather(const void* send, void* recv, size_t bytes, int64_t timeout_ms) override {
    MK_CHECK(detail::check_allgather_bytes("mpi", bytes, size_, static_cast<size_t>(INT_MAX)));
    const int64_t tmo = resolve_timeout(timeout_ms);
    const uint64_t seq = seq_++;
    MK_CHECK(failure_gate("allgather", seq));
    const int tag = kTagBase + static_cast<int>(seq % kTagSpan);
    auto* out = static_cast<uint8_t*>(recv);
    if (out + rank_ * bytes != send) memmove(out + rank_ * bytes, send, bytes);
    // (peer, request) pairs: receives first, then sends.
    std::vector<MPI_Request> reqs;
    std::vector<int> peer_of;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      reqs.emplace_back();
      peer_of.push_back(r);
      MK_MPI_CHECK(MPI_Irecv(out + r * bytes, static_cast<int>(bytes), MPI_BYTE, r, tag, comm_,
                             &reqs.back()));
    }
    const size_t nrecv = reqs.size();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      reqs.emplace_back();
      peer_of.push_back(r);
      MK_MPI_CHECK(MPI_Isend(out + rank_ * bytes, static_cast<int>(bytes), MPI_BYTE, r, tag,
                             comm_, &reqs.back()));
    }
    return wait_all(reqs, peer_of, nrecv, bytes, "allgather", seq, tmo);
  }

  Status broadcast(void* buf, size_t bytes, int root, int64_t timeout_ms) override {
    MK_REQUIRE(root >= 0 && root < size_, Code::kInvalidArgument,
               "broadcast root %d outside world of %d", root, size_);
    const int64_t tmo = resolve_timeout(timeout_ms);
    const uint64_t seq = seq_++;
    MK_CHECK(failure_gate("broadcast", seq));
    const int tag = kTagBase + static_cast<int>(seq % kTagSpan);
    std::vector<MPI_Request> reqs;
    std::vector<int> peer_of;
    size_t nrecv = 0;
    if (rank_ == root) {
      for (int r = 0; r < size_; ++r) {
        if (r == root) continue;
        reqs.emplace_back();
        peer_of.push_back(r);
        MK_MPI_CHECK(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, r, tag, comm_, &reqs.back()));
      }
    } else {
      reqs.emplace_back();
      peer_of.push_back(root);
      nrecv = 1;
      MK_MPI_CHECK(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, root, tag, comm_, &reqs.back()));
    }
    return wait_all(reqs, peer_of, nrecv, bytes, "broadcast", seq, tmo);
  }

 private:
  // Polls until every request completes or the deadline passes. A missing rank is one whose
  // receive never completed (or, for sends that need a matching receive, whose receive was
  // never posted). A receive shorter than `bytes` is a size mismatch (a longer one fails
  // with MPI_ERR_TRUNCATE). On any failure the outstanding requests are abandoned.
  Status wait_all(std::vector<MPI_Request>& reqs, const std::vector<int>& peer_of, size_t nrecv,
                  size_t bytes, const char* op, uint64_t seq, int64_t tmo) {
    auto deadline = deadline_after_ms(tmo);
    detail::Backoff backoff;
    std::vector<int> idx(reqs.size());
    std::vector<MPI_Status> st(reqs.size());
    int left = static_cast<int>(reqs.size());
    while (left > 0) {
      int n = 0;
      int err = MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &n, idx.data(), st.data());
      if (err != MPI_SUCCESS) {
        Status s = mpi_status(err, "MPI_Testsome");
        for (int i = 0; i < n; ++i) {
          if (st[i].MPI_ERROR == MPI_SUCCESS || st[i].MPI_ERROR == MPI_ERR_PENDING) continue;
          int len = 0;
          char msg[MPI_MAX_ERROR_STRING] = {0};
          MPI_Error_string(st[i].MPI_ERROR, msg, &len);
          s = make_status(st[i].MPI_ERROR == MPI_ERR_TRUNCATE ? Code::kMismatch : Code::kSystemError,
                          "mpi bootstrap %s #%llu with rank %d: %s (did the ranks pass the same "
                          "byte count?)",
                          op, static_cast<unsigned long long>(seq), peer_of[idx[i]], msg);
          break;
        }
        abandon(reqs, nrecv);
        return s;
      }
      if (n == MPI_UNDEFINED) break;
      for (int i = 0; i < n; ++i) {
        if (idx[i] >= static_cast<int>(nrecv)) continue;
        int count = 0;
        MPI_Get_count(&st[i], MPI_BYTE, &count);
        if (static_cast<size_t>(count) != bytes) {
          abandon(reqs, nrecv);
          return make_status(Code::kMismatch,
                             "mpi bootstrap %s #%llu: rank %d sent %d bytes, rank %d expected %zu",
                             op, static_cast<unsigned long long>(seq), peer_of[idx[i]], count,
                             rank_, bytes);
        }
      }
      left -= n;
      if (left == 0) break;
      // Another rank reported a failure: nobody is coming any more.
      Status gate = failure_gate(op, seq);
      if (!gate.ok()) {
        abandon(reqs, nrecv);
        return gate;
      }
      if (detail::Clock::now() > deadline) {
        std::vector<int> missing;
        for (size_t i = 0; i < reqs.size(); ++i)
          if (reqs[i] != MPI_REQUEST_NULL) missing.push_back(peer_of[i]);
        std::sort(missing.begin(), missing.end());
        missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
        abandon(reqs, nrecv);
        Status t = detail::missing_ranks_status("mpi", op, seq, missing, tmo);
        fail(t);
        return t;
      }
      backoff.pause();
    }
    return OkStatus();
  }

  // Cancels outstanding receives (their buffers may be reused) and releases sends.
  static void abandon(std::vector<MPI_Request>& reqs, size_t nrecv) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i] == MPI_REQUEST_NULL) continue;
      if (i < nrecv) {
        MPI_Cancel(&reqs[i]);
        MPI_Wait(&reqs[i], MPI_STATUS_IGNORE);
      } else {
        MPI_Request_free(&reqs[i]);
      }
    }
  }

  void send_failure_notice(const FailureNotice& n) override {
    notice_bufs_.push_back(n);  // a deque: earlier buffers stay where their sends read them
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      notice_reqs_.emplace_back(MPI_REQUEST_NULL);
      if (MPI_Isend(&notice_bufs_.back(), sizeof(FailureNotice), MPI_BYTE, r, kFailTag, notice_comm_,
                    &notice_reqs_.back()) != MPI_SUCCESS)
        notice_reqs_.back() = MPI_REQUEST_NULL;  // best effort
    }
  }
  void read_failure_notices(std::vector<std::pair<int, FailureNotice>>* out) override {
    int from = 0;
    std::vector<uint8_t> buf;
    while (take_arrived(notice_comm_, kFailTag, &from, &buf)) {
      if (buf.size() != sizeof(FailureNotice)) continue;  // not a notice this build reads
      FailureNotice n;
      memcpy(&n, buf.data(), sizeof(n));
      out->emplace_back(from, n);
    }
  }


  MPI_Comm comm_;
  // Never freed: a notice may reach a rank after it destroyed its bootstrap, and a message for
  // a freed communicator waits in MPI for the next one to take its context id (OpenMPI then
  // delivers it there: seen crashing a later MPI_Comm_dup). On a communicator that lives to
  // the process's end, a late notice is only an unread message.
  MPI_Comm notice_comm_;
  bool finalize_;
  std::deque<FailureNotice> notice_bufs_;
  std::vector<MPI_Request> notice_reqs_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
};

}  // namespace

bool have_mpi() { return true; }

Status make_mpi_bootstrap(MPI_Comm comm, std::unique_ptr<Bootstrap>* out) {
  int init = 0;
  MPI_Initialized(&init);
  MK_REQUIRE(init, Code::kInvalidArgument, "make_mpi_bootstrap: MPI is not initialized");
  MPI_Comm dup, notices;
  MK_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  MK_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  MK_MPI_CHECK(MPI_Comm_dup(comm, &notices));
  MK_MPI_CHECK(MPI_Comm_set_errhandler(notices, MPI_ERRORS_RETURN));
  *out = std::make_unique<MpiBootstrap>(dup, notices, false);
  return OkStatus();
}

Status make_mpi_world_bootstrap(std::unique_ptr<Bootstrap>* out) {
  int init = 0;
  MPI_Initialized(&init);
  bool ours = false;
  if (!init) {
    apply_env_defaults();  // MPI_Init may start libfabric, which reads them once
    int provided = 0;
    MK_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
    ours = true;
  }
  MPI_Comm dup, notices;
  MK_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
  MK_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  MK_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &notices));
  MK_MPI_CHECK(MPI_Comm_set_errhandler(notices, MPI_ERRORS_RETURN));
  *out = std::make_unique<MpiBootstrap>(dup, notices, ours);
  return OkStatus();
}

}  // namespace mk
