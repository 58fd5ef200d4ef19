// mkernel — bootstrap: out-of-band collectives of bytes among the ranks of one job.
//
// Every collective is bounded by a timeout (tunable bootstrap_timeout_ms unless the call
// passes one). When a rank does not arrive, every rank that did returns kTimeout with a
// message naming the missing rank(s): "allgather #7: rank(s) 3 did not arrive within 2000 ms".
// Collectives must be called by all ranks in the same order (like MPI). Not thread-safe:
// one thread per rank drives its Bootstrap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {

class Bootstrap {
 public:
  Bootstrap();
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // A short name for logs and errors ("mpi", "threads", "store").
  virtual const char* kind() const = 0;

  // recv holds size() * bytes: rank r's contribution at recv + r * bytes.
  // send may alias recv + rank() * bytes. timeout_ms < 0: the tunable's value.
  virtual Status allgather(const void* send, void* recv, size_t bytes, int64_t timeout_ms = -1) = 0;
  // On return buf on every rank holds root's bytes.
  virtual Status broadcast(void* buf, size_t bytes, int root, int64_t timeout_ms = -1);
  virtual Status barrier(int64_t timeout_ms = -1);
  // The barrier of a teardown step (before releasing what peers may still use): a barrier,
  // or OK at once when the job has failed — nobody is left to wait for, and each rank releases
  // its own resources (peers' kernels are bounded and leave).
  Status teardown_barrier(int64_t timeout_ms = -1);

  // ---- job failure: a failed job ends on every rank, it never hangs ----
  //
  // Once any rank knows the job has failed (a device wait gave up, the network failed, a peer
  // went missing), waiting for peers is pointless and may be endless (a peer is dead or
  // stopped). fail() marks this rank's bootstrap failed; from then on every collective returns
  // at once with the failure instead of waiting, so a teardown made of collectives (barriers
  // before unmapping, quiesces before closing endpoints) runs through in local steps. The cause
  // also goes to every peer as a failure notice, which ends their collectives too (a rank
  // waiting in a collective for a stopped peer leaves as soon as another rank reports).
  //
  // fail() is thread-safe and never blocks: it records the cause (the first one wins; a
  // rank's own cause replaces one it only heard from a peer) and the notice leaves on the
  // owning thread's next bootstrap call. A collective that times out fails the bootstrap too
  // (ranks out of step cannot meet again).
  void fail(const Status& why);
  bool failed() const;
  // Owning thread, never blocks: sends this rank's pending notice, reads the peers' notices;
  // returns the job's failure (this rank's, or one a peer reported), or OK.
  Status poll_failure();
  // Owning thread. OK while the job has not failed. After a failure: waits up to grace_ms
  // (-1: tunable failure_grace_ms) for every peer's notice, then returns the job's failure
  // naming the culprit, the first of: the lowest rank that reported a cause of its own (bad
  // input, a network error of its own; not a wait that expired, nor an error that names another
  // rank: "a put to rank 3 failed" is rank 3's doing); the ranks that reported nothing (dead,
  // stopped); the lowest rank with a CUDA error of its own; the ranks that only heard of it
  // (alive, not in the call the others waited in); the rank most causes point at. This rank's
  // view follows. Waits once; later calls return the same report.
  //   "job failed: culprit rank 2: did not report within 2000 ms (dead, stopped, or not in a
  //    mkernel call); rank 0 saw: device wait failed: rank 0 (op gemm_rs, ...) waited ..."
  Status failure_report(int64_t grace_ms = -1);

  // One rank's failure as it travels between ranks (versioned, fixed size).
  struct FailureNotice {
    uint32_t size;     // sizeof(FailureNotice)
    uint32_t version;  // kFailureNoticeVersion
    int32_t code;      // mk::Code
    uint32_t heard;    // 1: the sender only heard of the failure from another rank
    char message[496];
  };
  static constexpr uint32_t kFailureNoticeVersion = 1;

 protected:
  int64_t resolve_timeout(int64_t timeout_ms) const;

  // Transport of failure notices, implemented per bootstrap; both are called on the owning
  // thread only and never block. send: to every peer (best effort). read: appends the
  // notices that arrived since the last call, as (sender rank, notice).
  virtual void send_failure_notice(const FailureNotice& n) = 0;
  virtual void read_failure_notices(std::vector<std::pair<int, FailureNotice>>* out) = 0;
  // For implementations: at the start of every collective and in its wait loop. OK, or the
  // job's failure as this collective returns it ("<kind> bootstrap <op> #<seq>: the job
  // failed: ..."). `throttle`: read the peers' notices at most every few milliseconds (for
  // transports where a read costs a round trip).
  Status failure_gate(const char* op, uint64_t seq, bool throttle = false);

 private:
  struct FailureState;
  void exchange_notices();  // owning thread: send the pending notice, read the peers'
  std::shared_ptr<FailureState> fs_;
};

// Collective agreement on an outcome: every rank passes its local status and every rank
// returns the same result — ok only if all were ok, else the first failing rank's code with
// "<what> failed on rank(s) 1,3: <rank 1's message>". When the job has failed (the bootstrap
// failed before, or during the exchange), `mine` joins this rank's causes and the result is
// failure_report(): no waiting for ranks that may be gone.
Status agree(Bootstrap& bs, const Status& mine, const std::string& what, int64_t timeout_ms = -1);

// A world of `size` ranks inside one process, one thread per rank (tests, single-process
// multi-GPU). make_thread_world returns one Bootstrap per rank; hand each to its thread.
Status make_thread_world(int size, std::vector<std::unique_ptr<Bootstrap>>* out);

// A key-value store interface, so a framework's store (PyTorch's c10d Store) can serve as
// the bootstrap. Both callbacks may be called from the rank's thread only.
struct StoreCallbacks {
  // Store `value` under `key`; keys are never rewritten by mkernel.
  std::function<Status(const std::string& key, const std::vector<uint8_t>& value)> set;
  // Non-blocking: *found = false when the key is absent (not an error). mkernel expects at most
  // max_bytes under `key`: a larger value is an error of the store (kMismatch), and the callback
  // need not read past max_bytes + 1 bytes of it (a store another writer filled must not make
  // mkernel allocate what that writer chose).
  std::function<Status(const std::string& key, size_t max_bytes, std::vector<uint8_t>* value, bool* found)>
      try_get;
  // Optional: delete a key mkernel no longer needs (keeps the store small).
  std::function<Status(const std::string& key)> erase;
};
// `prefix` namespaces the keys of this world (unique per communicator within one store).
Status make_store_bootstrap(int rank, int size, const std::string& prefix, StoreCallbacks cb,
                            std::unique_ptr<Bootstrap>* out);

// True when this build has MPI support; the MPI bootstrap itself is in bootstrap_mpi.h
// (which includes <mpi.h>). make_mpi_world_bootstrap uses MPI_COMM_WORLD and initializes MPI
// if the caller has not; it returns kNotSupported in a build without MPI.
bool have_mpi();
Status make_mpi_world_bootstrap(std::unique_ptr<Bootstrap>* out);
// True when the process looks launched by mpirun/srun (OMPI_/PMI_/PMIX_ variables).
bool launched_by_mpi();

}  // namespace mk
