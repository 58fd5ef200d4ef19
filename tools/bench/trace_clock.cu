// The host clock against the device's %globaltimer, for multi-call traces (tools/bench_common.h:
// host_minus_device_ns): a probe kernel keeps writing the timer into mapped host memory while the
// host polls it; the smallest (host time after the read - value read) over many reads is the
// offset plus the shortest visibility latency (a microsecond or two).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>

#include "tools/bench_common.h"

namespace mk {
namespace bench {
namespace {

__global__ void clock_probe(volatile unsigned long long* out, const volatile int* stop) {
  // Bounded by the host's stop word, and by itself after ~0.5 s in case the host is gone.
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[0] = t;
  } while (!*stop && t - t0 < 500000000ull);
}

}  // namespace

int64_t host_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Status host_minus_device_ns(Communicator* comm, int64_t* out) {
  unsigned long long* word = nullptr;
  int* stop = nullptr;
  cudaStream_t st = nullptr;
  Status s = CLI_CUDA(comm, cudaHostAlloc(reinterpret_cast<void**>(&word), sizeof(*word), cudaHostAllocMapped));
  if (s.ok()) s = CLI_CUDA(comm, cudaHostAlloc(reinterpret_cast<void**>(&stop), sizeof(*stop), cudaHostAllocMapped));
  if (s.ok()) s = CLI_CUDA(comm, cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  if (s.ok()) {
    *word = 0;
    *stop = 0;
    unsigned long long* d_word = nullptr;
    int* d_stop = nullptr;
    s = CLI_CUDA(comm, cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_word), word, 0));
    if (s.ok()) s = CLI_CUDA(comm, cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_stop), stop, 0));
    if (s.ok()) {
      clock_probe<<<1, 1, 0, st>>>(d_word, d_stop);
      s = CLI_CUDA(comm, cudaGetLastError());
    }
    if (s.ok()) {
      volatile unsigned long long* w = word;
      int64_t best = INT64_MAX;
      int samples = 0;
      const int64_t give_up = host_now_ns() + 300000000;  // the probe may start late under MPS
      while (samples < 20000 && host_now_ns() < give_up) {
        const unsigned long long v = *w;
        const int64_t h = host_now_ns();
        if (v == 0) continue;
        ++samples;
        best = std::min<int64_t>(best, h - int64_t(v));
      }
      *reinterpret_cast<volatile int*>(stop) = 1;
      s = CLI_CUDA(comm, cudaStreamSynchronize(st));
      if (s.ok() && samples == 0) s = Status(Code::kTimeout, "trace: the clock probe kernel did not start within 300 ms");
      *out = best;
    }
  }
  if (st) cudaStreamDestroy(st);
  if (word) cudaFreeHost(word);
  if (stop) cudaFreeHost(stop);
  return s;
}

}  // namespace bench
}  // namespace mk
