// GoogleTest main for tests run under mpirun. Every rank runs every test; rank 0 prints the
// full report, other ranks print only their failures (prefixed with their rank). Exit codes
// are agreed: all ranks return 1 if any rank failed, 77 if there is no GPU for a GPU test.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/common/test_util.h"

namespace {
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
              r.line_number(), r.summary());
  }
 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ::testing::InitGoogleTest(&argc, argv);
#ifdef MK_TEST_NEEDS_GPU
  int gpu = mk::test::have_gpu() ? 1 : 0, all_gpu = 0;
  MPI_Allreduce(&gpu, &all_gpu, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_gpu) {
    if (rank == 0) printf("SKIPPED: no GPU on this machine (or on some rank)\n");
    MPI_Finalize();
    return mk::test::kSkipExitCode;
  }
#endif
  // One seed for the job, from rank 0, so ranks can generate each other's expected data.
  const char* env_seed = getenv("MK_TEST_SEED");
  unsigned long long seed = env_seed ? strtoull(env_seed, nullptr, 0) : mk::test::fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  setenv("MK_TEST_SEED", std::to_string(seed).c_str(), 1);
  if (rank == 0) printf("test seed: %llu (MK_TEST_SEED to replay), %d ranks\n", seed, size);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int rc = RUN_ALL_TESTS() ? 1 : 0, any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any && !rc) printf("FAILED on another rank (see [rank N] lines)\n");
  MPI_Finalize();
  return any;
}
