// bench_comm_ops: how fast one communication CTA moves bytes with each of the executor's engines
// (src/comm/executor.cuh), alone on the GPU and beside a kernel that keeps the other SMs' memory
// traffic going — the ceiling of a fused kernel's dedicated communication CTAs. Engines: plain
// copy (copy_words, 8 and 16 words in flight per thread), bulk copy (bulk_copy, one thread
// driving the bulk-copy engine through 8 stages of 16 KiB), the fp32 reduce of two sources with
// plain loads (reduce_op as a fused kernel's CTA runs it) and through the stages
// (bulk_reduce_f32). Each of `ctas` CTAs of 256 threads moves its slice of a 256 MiB buffer; the
// figure is the median over reps of the kernel's time (events), as GB/s over the bytes read and
// written, for the CTAs together and per CTA; each reduce's output is checked.
//   bench_comm_ops [--reps N] [--mib M] [--json PATH]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "src/comm/executor.cuh"

using namespace mk;

namespace {

constexpr int kThreads = 256;
constexpr int kStages = 8;
constexpr uint32_t kStageBytes = 16384;
constexpr size_t kSmem = kStages * kStageBytes + 1024;

enum Mode { kPlainCopy8, kPlainCopy16, kBulkCopy, kPlainReduce, kBulkReduce, kModes };
const char* kNames[kModes] = {"copy plain x8", "copy plain x16", "copy bulk", "reduce2 plain", "reduce2 bulk"};

__global__ void __launch_bounds__(kThreads) engine_kernel(int mode, const float* a, const float* b, float* out,
                                                          uint64_t bytes_per_cta) {
  extern __shared__ __align__(1024) char smem[];
  const int tid = threadIdx.x;
  const uint64_t off = uint64_t(blockIdx.x) * bytes_per_cta;
  const char* ca = reinterpret_cast<const char*>(a) + off;
  const char* cb = reinterpret_cast<const char*>(b) + off;
  char* co = reinterpret_cast<char*>(out) + off;
  comm::BulkStages st{smem, reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes), kStages, kStageBytes, 0};
  if (tid == 0) comm::bulk_stages_init(st);
  __syncthreads();
  void* dst[1] = {co};
  void* ptr[3] = {const_cast<char*>(ca), const_cast<char*>(cb), co};
  switch (mode) {
    case kPlainCopy8: comm::copy_words<kThreads, 8>(ca, dst, 1, bytes_per_cta, tid); break;
    case kPlainCopy16: comm::copy_words<kThreads, 16>(ca, dst, 1, bytes_per_cta, tid); break;
    case kBulkCopy:
      if (tid == 0) comm::bulk_copy(st, ca, co, bytes_per_cta);
      break;
    case kPlainReduce: {
      comm::DevOp op{};
      op.kind = comm::kDevReduce;
      op.nsrc = 2;
      op.ndst = 1;
      op.dst_f32 = 1;
      op.elems = bytes_per_cta / 4;
      comm::reduce_op<kThreads, 1, 1>(op, ptr, tid);
      break;
    }
    case kBulkReduce: comm::bulk_reduce_f32<kThreads, 0>(st, ptr, 2, 1, bytes_per_cta / 4, tid); break;
    default: break;
  }
}

// The other SMs' traffic: every CTA streams a buffer of its own (read and written in place).
__global__ void load_kernel(float4* buf, uint64_t n, int passes, volatile int* stop) {
  for (int p = 0; p < passes && !*stop; ++p)
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
      float4 v = buf[i];
      v.x += 1.f;
      buf[i] = v;
    }
}

__global__ void fill(float* p, uint64_t n, float scale) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = scale * float((i * 2654435761ull) % 1021) - 3.f;
}

__global__ void check_sum(const float* a, const float* b, const float* out, uint64_t n, unsigned long long* bad) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    if (out[i] != a[i] + b[i]) atomicAdd(bad, 1ull);
}

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "bench_comm_ops: %s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  uint64_t mib = 256;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = strtoull(argv[++i], nullptr, 10);
    else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else {
      fprintf(stderr, "usage: bench_comm_ops [--reps N] [--mib M] [--json PATH]\n");
      return 2;
    }
  }
  if (reps < 1 || mib < 1) {
    fprintf(stderr, "bench_comm_ops: --reps and --mib must be >= 1\n");
    return 2;
  }
  const uint64_t bytes = mib << 20, n = bytes / 4;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  float *a, *b, *out;
  float4* hog;
  int* stop;
  unsigned long long* bad;
  const uint64_t hog_bytes = 2ull << 30;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMalloc(&out, bytes));
  CK(cudaMalloc(&hog, hog_bytes));
  CK(cudaMalloc(&stop, sizeof(int)));
  CK(cudaMalloc(&bad, sizeof(unsigned long long)));
  fill<<<1024, 256>>>(a, n, 0.5f);
  fill<<<1024, 256>>>(b, n, 0.25f);
  CK(cudaMemset(hog, 0, hog_bytes));
  CK(cudaFuncSetAttribute(engine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  cudaStream_t s, s_load;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s_load, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  printf("bench_comm_ops on %s: %d SMs, %llu MiB per buffer, %d threads per CTA, median of %d\n", prop.name, sms,
         (unsigned long long)mib, kThreads, reps);
  printf("%-16s %5s %6s %10s %10s %10s\n", "engine", "ctas", "beside", "ms", "GB/s", "GB/s/CTA");
  FILE* jf = json.empty() ? nullptr : fopen(json.c_str(), "w");
  if (!json.empty() && !jf) {
    fprintf(stderr, "bench_comm_ops: cannot write %s\n", json.c_str());
    return 1;
  }
  if (jf) fprintf(jf, "{\"gpu\": \"%s\", \"mib\": %llu, \"rows\": [\n", prop.name, (unsigned long long)mib);
  bool first = true;
  int failures = 0;
  for (int loaded = 0; loaded < 2; ++loaded)
    for (int mode = 0; mode < kModes; ++mode)
      for (int ctas : {1, 2, 4, 8, 16}) {
        if (loaded && ctas > 8) continue;
        const uint64_t per = (bytes / ctas) & ~uint64_t(16383);
        std::vector<float> ms;
        for (int r = 0; r <= reps; ++r) {  // rep 0: warm-up
          if (loaded) {
            CK(cudaMemsetAsync(stop, 0, sizeof(int), s_load));
            load_kernel<<<sms - ctas, 1024, 0, s_load>>>(hog, hog_bytes / 16, 1000, stop);
          }
          CK(cudaMemsetAsync(out, 0xff, bytes, s));
          CK(cudaStreamSynchronize(s));
          CK(cudaEventRecord(e0, s));
          engine_kernel<<<ctas, kThreads, kSmem, s>>>(mode, a, b, out, per);
          CK(cudaEventRecord(e1, s));
          CK(cudaEventSynchronize(e1));
          if (loaded) {
            CK(cudaMemcpyAsync(stop, &ctas, sizeof(int), cudaMemcpyHostToDevice, s));  // any non-zero
            CK(cudaStreamSynchronize(s));
            CK(cudaStreamSynchronize(s_load));
          }
          CK(cudaGetLastError());
          float t = 0;
          CK(cudaEventElapsedTime(&t, e0, e1));
          if (r) ms.push_back(t);
        }
        if (mode == kPlainReduce || mode == kBulkReduce) {
          CK(cudaMemset(bad, 0, sizeof(*bad)));
          check_sum<<<1024, 256>>>(a, b, out, per * ctas / 4, bad);
          unsigned long long h = 0;
          CK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
          if (h) {
            ++failures;
            printf("WRONG: %s with %d CTAs: %llu of %llu sums differ\n", kNames[mode], ctas, h,
                   (unsigned long long)(per * ctas / 4));
          }
        }
        std::sort(ms.begin(), ms.end());
        const double med = ms[ms.size() / 2];
        const double moved = double(per) * ctas * (mode >= kPlainReduce ? 3 : 2);
        const double gbs = moved / (med * 1e-3) / 1e9;
        printf("%-16s %5d %6s %10.3f %10.1f %10.1f\n", kNames[mode], ctas, loaded ? "load" : "-", med, gbs, gbs / ctas);
        if (jf)
          fprintf(jf, "%s  {\"engine\": \"%s\", \"ctas\": %d, \"beside_load\": %s, \"ms\": %.4f, \"gbs\": %.2f}",
                  first ? "" : ",\n", kNames[mode], ctas, loaded ? "true" : "false", med, gbs);
        first = false;
      }
  if (jf) {
    fprintf(jf, "\n]}\n");
    fclose(jf);
  }
  return failures ? 1 : 0;
}
