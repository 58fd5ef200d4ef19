#include "tests/common/test_util.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace mk {
namespace test {

uint64_t fresh_seed() {
  uint64_t t = static_cast<uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  return t ^ (static_cast<uint64_t>(std::random_device{}()) * 0x9e3779b97f4a7c15ull);
}

uint64_t test_seed() {
  static uint64_t seed = [] {
    if (const char* s = getenv("MK_TEST_SEED")) return static_cast<uint64_t>(strtoull(s, nullptr, 0));
    return fresh_seed();
  }();
  return seed;
}

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

}  // namespace test
}  // namespace mk
