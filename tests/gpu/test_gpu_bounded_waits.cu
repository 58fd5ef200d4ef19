// The library's own host waits are bounded while someone else's GPU work hangs (issue 39): with
// every SM held by a spinning kernel of "another library" (released from the host when the test
// is done, and bounded on the device too, so it never outlives the test), setup copies and
// zeroing (copy_bounded, zero_bounded) finish or fail within their bound, a device-wide wait
// (device_sync_bounded) fails with kTimeout within its bound, where cudaDeviceSynchronize — what
// the MoE, MoE-layer and controller paths used to call — has not returned; after the release,
// everything completes. Then an operator-free part of setup (a command ring) goes through.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "mkernel/common/cuda_check.h"
#include "mkernel/proxy/command_ring.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {
namespace {

// Spins until *release != 0 or ~limit_ns of device time passed.
__global__ void hold_the_gpu(const volatile int* release, unsigned long long limit_ns) {
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    if (*release) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > limit_ns) return;
    __nanosleep(1000);
  }
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

TEST(BoundedWaits, AnotherLibrarysHungKernelFailsTheWaitInsteadOfHangingIt) {
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) GTEST_SKIP() << "no GPU";
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  int* release = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&release), sizeof(int), cudaHostAllocMapped), cudaSuccess);
  *release = 0;
  int* d_release = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_release), release, 0), cudaSuccess);
  cudaStream_t other;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  // Two 1024-thread blocks per SM fill every SM's thread slots; 30 s on the device at most.
  hold_the_gpu<<<2 * sms, 1024, 0, other>>>(d_release, 30ull * 1000 * 1000 * 1000);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(cudaStreamQuery(other), cudaErrorNotReady) << "the holding kernel ended early";

  // What the old code did: a device-wide sync, here on a thread of its own. It must still be
  // waiting after the bounded calls below have returned.
  std::atomic<bool> raw_returned{false};
  std::thread raw([&] {
    (void)cudaSetDevice(0);
    (void)cudaDeviceSynchronize();
    raw_returned = true;
  });

  constexpr int64_t kBound = 700;
  auto t0 = std::chrono::steady_clock::now();
  Status s = device_sync_bounded(kBound, "test: a device-wide wait");
  double ms = ms_since(t0);
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("test: a device-wide wait"), std::string::npos) << s.message();
  EXPECT_GE(ms, kBound * 0.9);
  EXPECT_LT(ms, kBound + 2000.0);

  void* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 4096), cudaSuccess);
  std::vector<uint8_t> host(4096, 0x5a);
  for (int k = 0; k < 2; ++k) {
    t0 = std::chrono::steady_clock::now();
    s = k == 0 ? zero_bounded(d, 4096, kBound, "test: zeroing") : copy_bounded(d, host.data(), 4096, kBound, "test: a copy");
    ms = ms_since(t0);
    // A copy engine may do it (ok) or it waits for an SM (kTimeout): either way within the bound.
    EXPECT_TRUE(s.ok() || s.code() == Code::kTimeout) << s.to_string();
    EXPECT_LT(ms, kBound + 2000.0) << (k == 0 ? "zero_bounded" : "copy_bounded");
    printf("%s while the GPU is held: %s after %.0f ms\n", k == 0 ? "zero_bounded" : "copy_bounded",
           s.ok() ? "done" : s.to_string().c_str(), ms);
  }
  EXPECT_FALSE(raw_returned.load()) << "cudaDeviceSynchronize returned while the GPU was held";

  *release = 1;  // the other library's kernel ends
  raw.join();
  EXPECT_TRUE(raw_returned.load());
  MK_EXPECT_OK(device_sync_bounded(10000, "test: after the release"));
  MK_EXPECT_OK(copy_bounded(d, host.data(), 4096, 10000, "test: a copy after the release"));
  std::vector<uint8_t> back(4096, 0);
  MK_EXPECT_OK(copy_bounded(back.data(), d, 4096, 10000, "test: reading back"));
  EXPECT_EQ(back, host);
  MK_EXPECT_OK(zero_bounded(d, 4096, 10000, "test: zeroing after the release"));
  MK_EXPECT_OK(copy_bounded(back.data(), d, 4096, 10000, "test: reading back"));
  EXPECT_EQ(back, std::vector<uint8_t>(4096, 0));
  std::unique_ptr<CommandRing> ring;
  MK_EXPECT_OK(CommandRing::create(1024, /*gpu=*/true, &ring));
  cudaFree(d);
  cudaStreamDestroy(other);
  cudaFreeHost(release);
}

}  // namespace
}  // namespace test
}  // namespace mk
