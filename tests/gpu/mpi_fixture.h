// One communicator per process for the MPI GPU tests, created once and shared by the tests.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "mkernel/mkernel.h"
#include "mkernel/runtime/bootstrap_mpi.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {

inline std::unique_ptr<Communicator>& shared_comm_slot() {
  static std::unique_ptr<Communicator> comm = [] {
    std::unique_ptr<Bootstrap> bs;
    Status s = make_mpi_bootstrap(MPI_COMM_WORLD, &bs);
    std::unique_ptr<Communicator> c;
    if (s.ok()) {
      CommConfig cfg;
      cfg.require_gpu = true;
      s = Communicator::create(std::move(bs), cfg, &c);
    }
    if (!s.ok()) fprintf(stderr, "communicator: %s\n", s.to_string().c_str());
    return c;
  }();
  return comm;
}
// The binary's communicator; a binary whose communicator could not be created stops here, loudly
// (its tests cannot run), instead of handing a null pointer to the tests.
inline Communicator* shared_comm() {
  Communicator* c = shared_comm_slot().get();
  if (!c) {
    fprintf(stderr, "test harness: no communicator (see the error above); stopping\n");
    fflush(stderr);
    std::abort();
  }
  return c;
}

// After enqueueing a call whose peer `silent` stopped taking part: the sync must fail with a
// bounded-wait timeout that names that rank and the operator.
inline void expect_silent_rank_named(Communicator* comm, const std::string& op_name, int silent) {
  Status s = comm->sync(comm->stream());
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("rank " + std::to_string(silent)), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find(op_name), std::string::npos) << s.to_string();
  printf("rank %d: %s\n", comm->rank(), s.to_string().c_str());
}

// After the others' call failed on the silent rank: the job has failed, so the next host
// collective reports it on every rank instead of completing (the silent rank learns it there).
inline void expect_barrier_reports_failure(Communicator* comm) {
  Status b = comm->bootstrap().barrier();
  EXPECT_FALSE(b.ok()) << "a barrier after the failed call completed";
  EXPECT_NE(b.message().find("job failed"), std::string::npos) << b.to_string();
  printf("rank %d: the barrier after the failure: %s\n", comm->rank(), b.to_string().c_str());
}

// Tears the communicator down (collectively) before main() finalizes MPI.
class CommEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    auto& c = shared_comm_slot();
    if (c) {
      Status s = c->destroy();
      if (!s.ok()) fprintf(stderr, "communicator teardown: %s\n", s.to_string().c_str());
      c.reset();
    }
  }
};
inline ::testing::Environment* const kCommEnvironment =
    ::testing::AddGlobalTestEnvironment(new CommEnvironment);

// Device counter of bad words, read back and reset.
struct BadCounter {
  unsigned long long* d = nullptr;
  BadCounter() { cudaMalloc(&d, sizeof(*d)); cudaMemset(d, 0, sizeof(*d)); }
  ~BadCounter() { cudaFree(d); }
  unsigned long long take() {
    unsigned long long h = ~0ull;
    cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost);
    cudaMemset(d, 0, sizeof(*d));
    return h;
  }
};

}  // namespace test
}  // namespace mk
