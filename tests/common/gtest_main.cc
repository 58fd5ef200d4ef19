// GoogleTest main for one-process tests. A GPU test without a GPU exits 77 (ctest: skipped).
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
  return RUN_ALL_TESTS();
}
