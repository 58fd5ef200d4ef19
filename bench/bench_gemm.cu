// bench_gemm: mkernel's persistent sm_90a GEMM against cuBLAS, same random-normal buffers,
// same run. C[M,N] = A[M,K] · B[N,K]ᵀ, bf16 in and out, fp32 accumulation.
// Measured per shape after ~1 s of warm-up (clocks settle), cuBLAS and each mkernel variant
// timed in turn within every repetition (so drifting clocks hit all alike), median of --reps:
// the static schedule (plain launches), and the fused operators' variant (dynamic scheduler,
// communication role) without a communication program.
// Plain launches get a split-K workspace, so the automatic split-K choice applies (column
// "split": the K ranges it chose; 1 = none).
//   build/bench/bench_gemm [--json FILE] [--reps N] [--sweep] [M N K ...]
// --sweep: M in {64, 128, ..., 8192} x the (N, K) of Llama-3-8B and -70B's TP8 projections
// (qkv, o, gate+up, down), ~0.25 s of warm-up per shape.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mkernel/runtime/communicator.h"
#include "mkernel/gemm/gemm.h"
#include "src/gemm/fused_launch.h"

namespace {

__global__ void fill_normal(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = seed ^ (i * 0x9e3779b97f4a7c15ull);
    x ^= x >> 31; x *= 0xbf58476d1ce4e5b9ull; x ^= x >> 29; x *= 0x94d049bb133111ebull; x ^= x >> 32;
    const float u1 = ((x & 0xffffff) + 1) / 16777217.0f, u2 = ((x >> 24) & 0xffffff) / 16777216.0f;
    p[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

#define CK(x)                                                                  \
  do {                                                                         \
    auto e_ = (x);                                                             \
    if (e_ != 0) {                                                             \
      fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #x, int(e_)); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

template <class F>
float time_once(F& f, cudaEvent_t a, cudaEvent_t b) {
  cudaEventRecord(a);
  f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms;
}
float median(std::vector<float> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  int reps = 30;
  std::vector<long long> dims;
  bool sweep = false;
  auto usage = [](const char* why) {
    fprintf(stderr, "bench_gemm: %s\nusage: bench_gemm [--json FILE] [--reps N] [--sweep] [M N K ...]\n", why);
    return 2;
  };
  // A whole positive integer up to `max`, else false.
  auto positive = [](const char* a, long long max, long long* out) {
    char* end = nullptr;
    errno = 0;
    const long long v = strtoll(a, &end, 10);
    if (errno || !*a || *end || v < 1 || v > max) return false;
    *out = v;
    return true;
  };
  for (int i = 1; i < argc; ++i) {
    long long v = 0;
    if (!strcmp(argv[i], "--json")) {
      if (i + 1 >= argc) return usage("--json needs a file");
      json = argv[++i];
    } else if (!strcmp(argv[i], "--reps")) {
      if (i + 1 >= argc || !positive(argv[++i], 100000, &v)) return usage("--reps needs a whole number 1..100000");
      reps = int(v);
    } else if (!strcmp(argv[i], "--sweep")) {
      sweep = true;
    } else if (positive(argv[i], 1 << 20, &v)) {
      dims.push_back(v);
    } else {
      return usage((std::string("unexpected argument '") + argv[i] + "'").c_str());
    }
  }
  if (dims.size() % 3) return usage("dimensions come in triples M N K");
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    cudaGetLastError();
    printf("bench_gemm: skipped: no GPU: %s\n", mk::no_gpu_reason().c_str());
    return 77;
  }
  if (sweep) {
    // (N, K) per rank at TP8: Llama-3-8B (hidden 4096, 8 KV heads of 128, intermediate 14336)
    // and Llama-3-70B (hidden 8192, 8 KV heads, intermediate 28672).
    const long long nk[][2] = {{768, 4096}, {4096, 512}, {3584, 4096}, {4096, 1792},
                               {1280, 8192}, {8192, 1024}, {7168, 8192}, {8192, 3584}};
    for (long long m = 64; m <= 8192; m *= 2)
      for (const auto& p : nk) dims.insert(dims.end(), {m, p[0], p[1]});
  }
  if (dims.empty())
    dims = {8192, 8192, 8192, 4096, 8192, 2048, 16384, 16384, 1024, 8192, 4096, 4096,
            8192, 3584, 8192, 8192, 8192, 3584};
  cublasHandle_t h;
  CK(cublasCreate(&h));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  int ctas = 0;
  mk::Status s = mk::gemm::persistent_ctas(&ctas);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs; mkernel persistent grid %d CTAs; median of %d after ~1 s of warm-up\n", prop.name,
         prop.multiProcessorCount, ctas, reps);
  printf("%6s %6s %6s | %9s %9s | %9s %9s | %5s | %6s | %7s   (ratio: cuBLAS time / mkernel time)\n", "M", "N",
         "K", "cuBLAS ms", "TFLOP/s", "mkernel", "TFLOP/s", "split", "static", "dynamic");
  FILE* jf = json.empty() ? nullptr : fopen(json.c_str(), "w");
  if (jf) fprintf(jf, "{\"device\": \"%s\", \"rows\": [\n", prop.name);
  for (size_t i = 0; i + 2 < dims.size(); i += 3) {
    const long long M = dims[i], N = dims[i + 1], K = dims[i + 2];
    __nv_bfloat16 *A, *B, *C, *R;
    void* W = nullptr;
    const size_t ws = mk::gemm::split_k_workspace_bytes(M, N, K);
    CK(cudaMalloc(&W, ws));
    CK(cudaMalloc(&A, M * K * 2));
    CK(cudaMalloc(&B, N * K * 2));
    CK(cudaMalloc(&C, M * N * 2));
    CK(cudaMalloc(&R, M * N * 2));
    fill_normal<<<1024, 256>>>(A, M * K, 1);
    fill_normal<<<1024, 256>>>(B, N * K, 2);
    mk::gemm::Arguments args;
    args.A = A;
    args.B = B;
    args.C = C;
    args.M = M;
    args.N = N;
    args.K = K;
    args.workspace = W;
    args.workspace_bytes = ws;
    const int split = mk::gemm::split_k_for(M, N, K, ctas);
    const float one = 1, zero = 0;
    auto cublas = [&] {
      CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF, K, &zero, R,
                      CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    auto mine = [&] {
      mk::Status st = mk::gemm::run(args, nullptr);
      if (!st.ok()) {
        fprintf(stderr, "mkernel gemm: %s\n", st.to_string().c_str());
        exit(1);
      }
    };
    // The fused operators' variant: dynamic scheduler, no communication program.
    int* d_counter = nullptr;
    CK(cudaMalloc(&d_counter, sizeof(int)));
    mk::gemm::FusedLaunch fused;
    fused.tile_counter = d_counter;
    mk::gemm::Arguments fused_args = args;  // the fused variant has no split-K
    fused_args.workspace = nullptr;
    fused_args.workspace_bytes = 0;
    auto dynamic = [&] {
      mk::Status st = mk::gemm::run_fused(fused_args, fused, nullptr, mk::gemm::RunConfig{});
      if (!st.ok()) {
        fprintf(stderr, "mkernel gemm (dynamic): %s\n", st.to_string().c_str());
        exit(1);
      }
    };
    // Warm-up: about a second of work, so clocks and caches settle before measuring.
    {
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < (sweep ? 0.25 : 1.0)) {
        cublas();
        mine();
        CK(cudaDeviceSynchronize());
      }
    }
    std::vector<float> t_cublas, t_mine, t_dyn;
    for (int r = 0; r < reps; ++r) {
      t_cublas.push_back(time_once(cublas, a, b));
      t_mine.push_back(time_once(mine, a, b));
      t_dyn.push_back(time_once(dynamic, a, b));
    }
    const float tc = median(t_cublas), tm = median(t_mine), td = median(t_dyn);
    CK(cudaDeviceSynchronize());
    mine();  // C from the static schedule for the comparison below
    CK(cudaDeviceSynchronize());
    cudaFree(d_counter);
    // Same answer? (relative Frobenius distance between the two bf16 results)
    std::vector<__nv_bfloat16> hc(M * N), hr(M * N);
    cudaMemcpy(hc.data(), C, M * N * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hr.data(), R, M * N * 2, cudaMemcpyDeviceToHost);
    double num = 0, den = 0;
    for (long long j = 0; j < M * N; j += 7) {
      const double x = __bfloat162float(hc[j]), y = __bfloat162float(hr[j]);
      num += (x - y) * (x - y);
      den += y * y;
    }
    const double flop = 2.0 * M * N * K;
    printf("%6lld %6lld %6lld | %9.3f %9.1f | %9.3f %9.1f | %5d | %6.3f | %7.3f  (rel. diff %.1e)\n", M, N, K, tc,
           flop / tc / 1e9, tm, flop / tm / 1e9, split, tc / tm, tc / td, std::sqrt(num / den));
    if (jf)
      fprintf(jf, "  {\"M\": %lld, \"N\": %lld, \"K\": %lld, \"split_k\": %d, \"cublas_ms\": %.4f, \"mkernel_ms\": %.4f, \"cublas_tflops\": %.1f, \"mkernel_tflops\": %.1f, \"ratio\": %.3f, \"dynamic_ratio\": %.3f, \"rel_diff\": %.2e}%s\n",
              M, N, K, split, tc, tm, flop / tc / 1e9, flop / tm / 1e9, tc / tm, tc / td, std::sqrt(num / den),
              i + 5 < dims.size() ? "," : "");
    cudaFree(W);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    cudaFree(R);
  }
  if (jf) {
    fprintf(jf, "]}\n");
    fclose(jf);
  }
  cublasDestroy(h);
  return s.ok() ? 0 : 1;
}
