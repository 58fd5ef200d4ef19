// Bootstrap over MPI. Collectives are built from point-to-point messages polled against a
// deadline (MPI's own collectives cannot time out), so the ranks whose messages never came
// are known and named.
#include "mkernel/runtime/bootstrap_mpi.h"

#include <algorithm>
#include <cstring>

#include "mkernel/common/check.h"
#include "src/runtime/bootstrap/bootstrap_util.h"

namespace mk {
namespace {

constexpr int kTagBase = 0x4d4b;  // tags kTagBase + (seq % kTagSpan): never a user's tag space
constexpr int kTagSpan = 4096;

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

class MpiBootstrap final : public Bootstrap {
 public:
  MpiBootstrap(MPI_Comm comm, bool finalize_on_destroy)
      : comm_(comm), finalize_(finalize_on_destroy) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiBootstrap() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Comm_free(&comm_);
    if (finalize_) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* kind() const override { return "mpi"; }

  Status allgather(const void* send, void* recv, size_t bytes, int64_t timeout_ms) override {
    const int64_t tmo = resolve_timeout(timeout_ms);
    const uint64_t seq = seq_++;
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
    auto deadline = detail::deadline_after(tmo);
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
      if (detail::Clock::now() > deadline) {
        std::vector<int> missing;
        for (size_t i = 0; i < reqs.size(); ++i)
          if (reqs[i] != MPI_REQUEST_NULL) missing.push_back(peer_of[i]);
        std::sort(missing.begin(), missing.end());
        missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
        abandon(reqs, nrecv);
        return detail::missing_ranks_status("mpi", op, seq, missing, tmo);
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

  MPI_Comm comm_;
  bool finalize_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
};

}  // namespace

bool have_mpi() { return true; }

Status make_mpi_bootstrap(MPI_Comm comm, std::unique_ptr<Bootstrap>* out) {
  int init = 0;
  MPI_Initialized(&init);
  MK_REQUIRE(init, Code::kInvalidArgument, "make_mpi_bootstrap: MPI is not initialized");
  MPI_Comm dup;
  MK_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  MK_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  *out = std::make_unique<MpiBootstrap>(dup, false);
  return OkStatus();
}

Status make_mpi_world_bootstrap(std::unique_ptr<Bootstrap>* out) {
  int init = 0;
  MPI_Initialized(&init);
  bool ours = false;
  if (!init) {
    int provided = 0;
    MK_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
    ours = true;
  }
  MPI_Comm dup;
  MK_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
  MK_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  *out = std::make_unique<MpiBootstrap>(dup, ours);
  return OkStatus();
}

}  // namespace mk
