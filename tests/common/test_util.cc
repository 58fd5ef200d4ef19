#include "tests/common/test_util.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

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

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x;
}

std::vector<uint8_t> rank_payload(uint64_t op, int rank, size_t n) {
  std::mt19937_64 g(mix(mix(test_seed(), op), static_cast<uint64_t>(rank) + 1));
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(g());
  if (n >= 8) {
    uint32_t r = static_cast<uint32_t>(rank), o = static_cast<uint32_t>(op);
    memcpy(v.data(), &r, 4);
    memcpy(v.data() + 4, &o, 4);
  }
  return v;
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
