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
#include <vector>

#include "mkernel/common/status.h"

namespace mk {

class Bootstrap {
 public:
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

 protected:
  int64_t resolve_timeout(int64_t timeout_ms) const;
};

// Collective agreement on an outcome: every rank passes its local status and every rank
// returns the same result — ok only if all were ok, else the first failing rank's code with
// "<what> failed on rank(s) 1,3: <rank 1's message>". A bootstrap failure is returned as is.
Status agree(Bootstrap& bs, const Status& mine, const std::string& what, int64_t timeout_ms = -1);

// A world of `size` ranks inside one process, one thread per rank (tests, single-process
// multi-GPU). make_thread_world returns one Bootstrap per rank; hand each to its thread.
Status make_thread_world(int size, std::vector<std::unique_ptr<Bootstrap>>* out);

// A key-value store interface, so a framework's store (PyTorch's c10d Store) can serve as
// the bootstrap. Both callbacks may be called from the rank's thread only.
struct StoreCallbacks {
  // Store `value` under `key`; keys are never rewritten by mkernel.
  std::function<Status(const std::string& key, const std::vector<uint8_t>& value)> set;
  // Non-blocking: *found = false when the key is absent (not an error).
  std::function<Status(const std::string& key, std::vector<uint8_t>* value, bool* found)> try_get;
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
