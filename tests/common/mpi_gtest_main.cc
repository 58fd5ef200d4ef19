// GoogleTest main for tests run under mpirun. Every rank runs every test; rank 0 prints the
// full report, other ranks print only their failures (prefixed with their rank). Exit codes
// are agreed, so every rank returns the same: 1 if any rank failed; 77 (ctest: skipped) if
// there is no GPU for a GPU test on some rank, or if any rank skipped a test (GTEST_SKIP) and
// none failed — never "passed" for a binary that did not run all its tests; else 0. The job's
// seed (rank 0's) is printed at the start and after every failing test.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/common/test_util.h"

#if defined(__SANITIZE_ADDRESS__)
// Under ASan (scripts/sanitize.sh): whole allocation stacks through OpenMPI, which is built
// without frame pointers, so that the leak suppressions of what MPI_Init keeps
// (scripts/sanitizers/lsan.supp) can match its frames. Only in the MPI mains: the slow unwinder
// makes every allocation far dearer (test_moe_plan: 20 s with the fast one, 400 s without).
// ASAN_OPTIONS, read after this, can still set it.
extern "C" const char* __asan_default_options() { return "fast_unwind_on_malloc=0"; }
#endif

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
  unsigned long long seed = mk::test::test_seed();  // MK_TEST_SEED, else fresh
  MPI_Bcast(&seed, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  mk::test::set_test_seed(seed);
  if (rank == 0) printf("test seed: %llu (MK_TEST_SEED to replay), %d ranks\n", seed, size);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  listeners.Append(mk::test::new_seed_reporter(size > 1 ? rank : -1));
  const int rc = RUN_ALL_TESTS();
  // This rank's verdict (each rank lists the tests it skipped), then the job's: failed (2) >
  // skipped (1) > passed (0) on any rank.
  const int mine = mk::test::exit_code(rc, size > 1 ? rank : -1);
  int verdict = mine == 1 ? 2 : mine == mk::test::kSkipExitCode ? 1 : 0, job = 0;
  MPI_Allreduce(&verdict, &job, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && job == 2 && verdict != 2) printf("FAILED on another rank (see [rank N] lines)\n");
  if (rank == 0 && job == 1 && verdict != 1)
    printf("SKIPPED: another rank skipped tests (see its lines): the job reports skipped (exit %d)\n",
           mk::test::kSkipExitCode);
  fflush(stdout);
  MPI_Finalize();
  return job == 2 ? 1 : job == 1 ? mk::test::kSkipExitCode : 0;
}
