// bench_grouped: mkernel's grouped GEMM (gemm::run_grouped) against cuBLAS's grouped GEMM
// (cublasGemmGroupedBatchedEx) on the same buffers, and against one dense cuBLAS GEMM with the
// same FLOPs (all rows as one M), same run. Shapes: the expert GEMMs of MoE models at expert
// parallelism 8 (a rank's local experts and the rows it receives: tokens x top-k), the first
// (N = 2I, K = H) and the second (N = H, K = I); routings balanced (equal counts) and skewed
// (a Zipf-like draw, some experts empty). mkernel reads the counts from device memory; cuBLAS
// takes them as host arrays (the sizes a host synchronization would bring back). The SwiGLU
// column is mkernel's first GEMM with the SwiGLU epilogue (output [rows, I]).
// Timed with events, cuBLAS and mkernel alternating within every repetition, median of --reps
// after ~0.3 s of warm-up per shape.
// --store 1|2: the epilogue (GroupedConfig::store: register stores, or staged through shared
// memory; default: the library's).
//   build/bench/bench_grouped [--json FILE] [--reps N] [--tokens T] [--store 1|2]
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mkernel/runtime/communicator.h"
#include "mkernel/gemm/grouped.h"

namespace {

__global__ void fill_normal(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = seed ^ (i * 0x9e3779b97f4a7c15ull);
    x ^= x >> 31; x *= 0xbf58476d1ce4e5b9ull; x ^= x >> 29; x *= 0x94d049bb133111ebull; x ^= x >> 32;
    const float u1 = ((x & 0xffffff) + 1) / 16777217.0f, u2 = ((x >> 24) & 0xffffff) / 16777216.0f;
    p[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2) * 0.05f);
  }
}

#define CK(x)                                                                      \
  do {                                                                             \
    auto e_ = (x);                                                                 \
    if (e_ != 0) {                                                                 \
      fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #x, int(e_)); \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)
#define MKCK(x)                                                                           \
  do {                                                                                    \
    mk::Status s_ = (x);                                                                  \
    if (!s_.ok()) {                                                                       \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, s_.to_string().c_str()); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

float median(std::vector<float> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Model {
  const char* name;
  int experts, topk;
  int64_t H, I;
};

// Counts of `rows` over `E` experts: balanced (equal, the remainder spread), or skewed
// (weights 1 / (rank + 1)^1.2 in a shuffled order, a quarter of the experts empty).
std::vector<int32_t> routing(int E, int64_t rows, bool skewed, uint64_t seed) {
  std::vector<int32_t> c(E, 0);
  if (!skewed) {
    for (int e = 0; e < E; ++e) c[e] = int32_t(rows / E + (e < rows % E));
    return c;
  }
  std::mt19937_64 rng(seed);
  std::vector<double> w(E);
  for (int e = 0; e < E; ++e) w[e] = (e < E - E / 4 || E == 1) ? 1.0 / std::pow(e + 1.0, 1.2) : 0.0;
  std::shuffle(w.begin(), w.end(), rng);
  double sum = 0;
  for (double x : w) sum += x;
  int64_t given = 0;
  int top = 0;
  for (int e = 0; e < E; ++e) {
    c[e] = int32_t(std::floor(rows * w[e] / sum));
    given += c[e];
    if (w[e] > w[top]) top = e;
  }
  c[top] += int32_t(rows - given);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  int reps = 30;
  std::vector<int64_t> token_list = {128, 4096};
  int store = 0;
  auto usage = [](const std::string& why) {
    fprintf(stderr, "bench_grouped: %s\nusage: bench_grouped [--json FILE] [--reps N] [--tokens T] [--store 0|1|2]\n",
            why.c_str());
    return 2;
  };
  // A whole number in [lo, hi], else false.
  auto number = [](const char* a, long long lo, long long hi, long long* out) {
    char* end = nullptr;
    errno = 0;
    const long long v = strtoll(a, &end, 10);
    if (errno || !*a || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    long long v = 0;
    if (a == "--json" || a == "--reps" || a == "--tokens" || a == "--store") {
      if (i + 1 >= argc) return usage(a + " needs a value");
      const char* val = argv[++i];
      if (a == "--json") json = val;
      else if (a == "--reps" && number(val, 1, 100000, &v)) reps = int(v);
      else if (a == "--tokens" && number(val, 1, 1 << 20, &v)) token_list = {v};
      else if (a == "--store" && number(val, 0, 2, &v)) store = int(v);
      else return usage(a + " '" + val + "': out of range or not a whole number");
    } else {
      return usage("unexpected argument '" + a + "'");
    }
  }
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    cudaGetLastError();
    printf("bench_grouped: skipped: no GPU: %s\n", mk::no_gpu_reason().c_str());
    return 77;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int ep = 8;  // expert parallelism the local shapes are taken from
  const Model models[] = {{"qwen3-30b-a3b", 128, 8, 2048, 768},
                          {"qwen3-235b-a22b", 128, 8, 4096, 1536},
                          {"mixtral-8x7b", 8, 2, 4096, 14336},
                          {"deepseek-v3", 256, 8, 7168, 2048}};
  printf("%s, %d SMs; EP%d local experts; median of %d; epilogue store %d\n", prop.name, prop.multiProcessorCount, ep,
         reps, store);
  mk::gemm::GroupedConfig gcfg;
  gcfg.store = store;
  printf("%-16s %6s %4s %-8s %-5s %6s %6s %6s %9s %9s %9s %9s %7s %7s\n", "model", "tokens", "E_loc", "routing",
         "gemm", "rows", "N", "K", "mk_us", "cublasG", "dense_us", "swiglu_us", "vs_grp", "vs_dense");
  FILE* jf = json.empty() ? nullptr : fopen(json.c_str(), "w");
  if (jf)
    fprintf(jf, "{\"device\": \"%s\", \"ep\": %d, \"reps\": %d, \"store\": %d, \"rows\": [\n", prop.name, ep, reps,
            store);
  bool first_row = true;
  cublasHandle_t h;
  CK(cublasCreate(&h));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cublasSetStream(h, s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Model& m : models) {
    const int E = std::max(1, m.experts / ep);
    for (int64_t T : token_list) {
      const int64_t rows = T * m.topk;  // what a rank receives when the routing is even across ranks
      for (int skewed = 0; skewed < 2; ++skewed) {
        if (E == 1 && skewed) continue;  // one local expert: nothing to skew
        const std::vector<int32_t> counts = routing(E, rows, skewed, 1234 + T);
        std::vector<int32_t> offsets(E);
        for (int e = 0, o = 0; e < E; o += counts[e++]) offsets[e] = o;
        for (int which = 0; which < 2; ++which) {
          const int64_t N = which == 0 ? 2 * m.I : m.H, K = which == 0 ? m.H : m.I;
          __nv_bfloat16 *A, *B, *C, *C2;
          int32_t *dn, *doff;
          CK(cudaMalloc(&A, rows * K * 2));
          CK(cudaMalloc(&B, E * N * K * 2));
          CK(cudaMalloc(&C, rows * N * 2));
          CK(cudaMalloc(&C2, rows * N * 2));
          CK(cudaMalloc(&dn, E * 4));
          CK(cudaMalloc(&doff, E * 4));
          fill_normal<<<1024, 256, 0, s>>>(A, rows * K, 1);
          fill_normal<<<1024, 256, 0, s>>>(B, E * N * K, 2);
          CK(cudaMemcpyAsync(dn, counts.data(), E * 4, cudaMemcpyHostToDevice, s));
          CK(cudaMemcpyAsync(doff, offsets.data(), E * 4, cudaMemcpyHostToDevice, s));
          mk::gemm::GroupedArguments g;
          g.A = A;
          g.B = B;
          g.C = C;
          g.groups = E;
          g.rows = rows;
          g.N = N;
          g.K = K;
          g.counts = dn;
          g.offsets = doff;
          mk::gemm::GroupedArguments gs = g;
          gs.epilogue = mk::gemm::GroupedEpilogue::kSwiGLU;
          // cuBLAS grouped: one group per non-empty expert (column-major view: C_gᵀ = B_g · A_gᵀ).
          std::vector<cublasOperation_t> ta, tb;
          std::vector<int> mm, nn, kk, lda, ldb, ldc, gsize;
          std::vector<const void*> pa, pb;
          std::vector<void*> pc;
          std::vector<float> alpha, beta;
          for (int e = 0; e < E; ++e) {
            if (!counts[e]) continue;
            ta.push_back(CUBLAS_OP_T), tb.push_back(CUBLAS_OP_N);
            mm.push_back(int(N)), nn.push_back(counts[e]), kk.push_back(int(K));
            lda.push_back(int(K)), ldb.push_back(int(K)), ldc.push_back(int(N));
            pa.push_back(B + e * N * K), pb.push_back(A + offsets[e] * K), pc.push_back(C2 + offsets[e] * N);
            alpha.push_back(1.f), beta.push_back(0.f), gsize.push_back(1);
          }
          const int ng = int(ta.size());
          void** dptr;
          CK(cudaMalloc(&dptr, 3 * ng * sizeof(void*)));
          CK(cudaMemcpyAsync(dptr, pa.data(), ng * sizeof(void*), cudaMemcpyHostToDevice, s));
          CK(cudaMemcpyAsync(dptr + ng, pb.data(), ng * sizeof(void*), cudaMemcpyHostToDevice, s));
          CK(cudaMemcpyAsync(dptr + 2 * ng, pc.data(), ng * sizeof(void*), cudaMemcpyHostToDevice, s));
          CK(cudaStreamSynchronize(s));
          auto mk_run = [&] { MKCK(mk::gemm::run_grouped(g, s, gcfg)); };
          auto mk_swiglu = [&] { MKCK(mk::gemm::run_grouped(gs, s, gcfg)); };
          auto cublas_grouped = [&] {
            CK(cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), mm.data(), nn.data(), kk.data(), alpha.data(),
                                          const_cast<const void* const*>(dptr), CUDA_R_16BF, lda.data(),
                                          const_cast<const void* const*>(dptr + ng), CUDA_R_16BF, ldb.data(),
                                          beta.data(), dptr + 2 * ng, CUDA_R_16BF, ldc.data(), ng, gsize.data(),
                                          CUBLAS_COMPUTE_32F));
          };
          const float one = 1.f, zero = 0.f;
          auto cublas_dense = [&] {
            CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(rows), int(K), &one, B, CUDA_R_16BF, int(K), A,
                            CUDA_R_16BF, int(K), &zero, C2, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
          };
          auto timed = [&](auto& f) {
            CK(cudaEventRecord(e0, s));
            f();
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            return ms * 1000.f;
          };
          const auto w0 = std::chrono::steady_clock::now();
          while (std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count() < 0.3) {
            mk_run();
            cublas_grouped();
            cublas_dense();
            if (which == 0) mk_swiglu();
          }
          CK(cudaStreamSynchronize(s));
          std::vector<float> tm, tg, td, ts;
          for (int r = 0; r < reps; ++r) {
            tm.push_back(timed(mk_run));
            tg.push_back(timed(cublas_grouped));
            td.push_back(timed(cublas_dense));
            if (which == 0) ts.push_back(timed(mk_swiglu));
          }
          const float mt = median(tm), gt = median(tg), dt = median(td), st = which == 0 ? median(ts) : 0.f;
          const char* routing_name = skewed ? "skewed" : "balanced";
          const char* gemm_name = which == 0 ? "up" : "down";
          printf("%-16s %6lld %4d %-8s %-5s %6lld %6lld %6lld %9.1f %9.1f %9.1f %9.1f %7.3f %7.3f\n", m.name,
                 (long long)T, E, routing_name, gemm_name, (long long)rows, (long long)N, (long long)K, mt, gt, dt, st,
                 gt / mt, dt / mt);
          if (jf) {
            fprintf(jf,
                    "%s  {\"model\": \"%s\", \"tokens\": %lld, \"experts_local\": %d, \"routing\": \"%s\", "
                    "\"gemm\": \"%s\", \"rows\": %lld, \"N\": %lld, \"K\": %lld, \"mkernel_us\": %.2f, "
                    "\"cublas_grouped_us\": %.2f, \"cublas_dense_us\": %.2f, \"mkernel_swiglu_us\": %.2f, "
                    "\"vs_cublas_grouped\": %.4f, \"vs_cublas_dense\": %.4f}",
                    first_row ? "" : ",\n", m.name, (long long)T, E, routing_name, gemm_name, (long long)rows,
                    (long long)N, (long long)K, mt, gt, dt, st, gt / mt, dt / mt);
            first_row = false;
          }
          CK(cudaFree(A));
          CK(cudaFree(B));
          CK(cudaFree(C));
          CK(cudaFree(C2));
          CK(cudaFree(dn));
          CK(cudaFree(doff));
          CK(cudaFree(dptr));
        }
      }
    }
  }
  if (jf) {
    fprintf(jf, "\n]}\n");
    fclose(jf);
  }
  cublasDestroy(h);
  return 0;
}
