// GoogleTest main for one-process tests. Exit codes (ctest: SKIP_RETURN_CODE 77): 1 if a test
// failed; 77 (skipped) if a GPU test finds no GPU, or if any test was skipped (GTEST_SKIP) and
// none failed — a binary that did not run all its tests is never reported as passed; else 0.
// The run seed is printed at the start and after every failing test (MK_TEST_SEED replays it).
#include <cstdio>

#include "tests/common/test_util.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
#ifdef MK_TEST_NEEDS_GPU
  if (!mk::test::have_gpu()) {
    printf("SKIPPED: no GPU on this machine\n");
    return mk::test::kSkipExitCode;
  }
#endif
  printf("test seed: %llu (MK_TEST_SEED to replay)\n",
         static_cast<unsigned long long>(mk::test::test_seed()));
  ::testing::UnitTest::GetInstance()->listeners().Append(mk::test::new_seed_reporter());
  const int rc = RUN_ALL_TESTS();
  return mk::test::exit_code(rc);
}
