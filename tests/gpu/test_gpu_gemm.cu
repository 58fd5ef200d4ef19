// The Hopper GEMM building block against exact and cuBLAS references.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "mkernel/device/diag.h"
#include "mkernel/gemm/gemm.h"
#include "src/gemm/fused_launch.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {
namespace {

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
};

struct Shape {
  int64_t M, N, K, ldc;
};

// C[M, ldc] against the fp32 reference of small-integer A and B rounded to bf16, every element
// (the first 5 mismatches reported), and the row padding past N (poisoned 0xffff) untouched.
struct ExactCount {
  int64_t bad = 0, pad_touched = 0;
};
ExactCount count_exact(const std::vector<float>& a, const std::vector<float>& b, const std::vector<__nv_bfloat16>& C,
                       const Shape& s) {
  ExactCount e;
  for (int64_t m = 0; m < s.M; ++m) {
    for (int64_t n = 0; n < s.N; ++n) {
      float ref = 0;
      for (int64_t k = 0; k < s.K; ++k) ref += a[m * s.K + k] * b[n * s.K + k];
      const float want = __bfloat162float(__float2bfloat16(ref));
      const float got = __bfloat162float(C[m * s.ldc + n]);
      if (!(got == want) && e.bad++ < 5) ADD_FAILURE() << "C[" << m << "," << n << "] = " << got << ", want " << want;
    }
    for (int64_t n = s.N; n < s.ldc; ++n) {
      uint16_t raw;
      memcpy(&raw, &C[m * s.ldc + n], 2);
      e.pad_touched += raw != 0xffff;
    }
  }
  return e;
}

// Relative Frobenius errors of mkernel's C and cuBLAS's bf16 R against cuBLAS's fp32 F, and
// C's NaNs.
struct RelErrors {
  double mk = 0, cublas = 0;
  int64_t nan = 0;
};
RelErrors rel_errors(const std::vector<__nv_bfloat16>& C, const std::vector<__nv_bfloat16>& R,
                     const std::vector<float>& F) {
  double ef = 0, ec = 0, er = 0;
  RelErrors e;
  for (size_t i = 0; i < F.size(); ++i) {
    const double f = F[i], c = __bfloat162float(C[i]), r = __bfloat162float(R[i]);
    e.nan += std::isnan(c);
    ef += f * f;
    ec += (c - f) * (c - f);
    er += (r - f) * (r - f);
  }
  e.mk = std::sqrt(ec / ef);
  e.cublas = std::sqrt(er / ef);
  return e;
}

// Small integers are exact in bf16 and their products sum exactly in fp32, so the kernel's
// bf16 output must equal the fp32 reference rounded to bf16, element for element. C is
// poisoned (NaN) first, padding columns included, and every element is checked.
TEST(Gemm, ExactOnSmallIntegers) {
  std::mt19937_64 rng(test_seed());
  // M, N, K off the 128 x 256 x 64 tile; padded ldc (its padding must stay untouched).
  const Shape shapes[] = {{1000, 1032, 520, 1040}, {128, 256, 64, 256}, {129, 264, 72, 264},
                          {1, 8, 8, 8},           {300, 4096, 8, 4096}, {2048, 1024, 1536, 1024},
                          {777, 520, 2056, 528}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(testing::Message() << "M " << s.M << " N " << s.N << " K " << s.K << " ldc " << s.ldc);
    std::uniform_int_distribution<int> d(-3, 3);
    std::vector<__nv_bfloat16> A(s.M * s.K), B(s.N * s.K);
    std::vector<float> a(A.size()), b(B.size());
    bool nonzero = false;
    for (size_t i = 0; i < A.size(); ++i) nonzero |= (a[i] = float(d(rng))) != 0, A[i] = __float2bfloat16(a[i]);
    for (size_t i = 0; i < B.size(); ++i) b[i] = float(d(rng)), B[i] = __float2bfloat16(b[i]);
    ASSERT_TRUE(nonzero);
    DevBuf dA(A.size() * 2), dB(B.size() * 2), dC(s.M * s.ldc * 2);
    cudaMemcpy(dA.p, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dB.p, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(dC.p, 0xff, s.M * s.ldc * 2);  // 0xffff: NaN in bf16
    gemm::Arguments args;
    args.A = dA.p;
    args.B = dB.p;
    args.C = dC.p;
    args.M = s.M;
    args.N = s.N;
    args.K = s.K;
    args.ldc = s.ldc;
    MK_ASSERT_OK(gemm::run(args, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<__nv_bfloat16> C(s.M * s.ldc);
    cudaMemcpy(C.data(), dC.p, C.size() * 2, cudaMemcpyDeviceToHost);
    const ExactCount e = count_exact(a, b, C, s);
    const int64_t bad = e.bad, pad_touched = e.pad_touched;
    EXPECT_EQ(bad, 0);
    EXPECT_EQ(pad_touched, 0) << "the kernel wrote past N into the row padding";
  }
}

// Split-K: K cut into ranges whose fp32 partial tiles a second kernel sums in order. With small
// integers every partial and every sum is exact, so each forced split count (and the automatic
// choice) must give the unsplit answer bit for bit; C's row padding stays untouched and the
// workspace's bytes past the partials too.
TEST(Gemm, SplitKExactOnSmallIntegers) {
  std::mt19937_64 rng(test_seed() + 7);
  struct Case {
    Shape s;
    int split;  // RunConfig::split_k (0: automatic)
  };
  const Case cases[] = {{{1, 8, 8, 8}, 2},          {{1, 8, 512, 8}, 16},        {{128, 256, 512, 256}, 2},
                        {{129, 264, 8200, 272}, 7}, {{300, 1024, 1032, 1024}, 3}, {{64, 2048, 4096, 2048}, 0},
                        {{256, 1024, 8192, 1024}, 0}, {{96, 520, 4160, 528}, 5}};
  for (const Case& c : cases) {
    const Shape& s = c.s;
    SCOPED_TRACE(testing::Message() << "M " << s.M << " N " << s.N << " K " << s.K << " split_k " << c.split);
    std::uniform_int_distribution<int> d(-2, 2);
    std::vector<__nv_bfloat16> A(s.M * s.K), B(s.N * s.K);
    std::vector<float> a(A.size()), b(B.size());
    for (size_t i = 0; i < A.size(); ++i) a[i] = float(d(rng)), A[i] = __float2bfloat16(a[i]);
    for (size_t i = 0; i < B.size(); ++i) b[i] = float(d(rng)), B[i] = __float2bfloat16(b[i]);
    const size_t ws = gemm::split_k_workspace_bytes(s.M, s.N, s.K);
    DevBuf dA(A.size() * 2), dB(B.size() * 2), dC(s.M * s.ldc * 2), dW(ws + 64);
    cudaMemcpy(dA.p, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dB.p, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(dC.p, 0xff, s.M * s.ldc * 2);
    cudaMemset(dW.p, 0x7f, ws + 64);
    gemm::Arguments args;
    args.A = dA.p, args.B = dB.p, args.C = dC.p;
    args.M = s.M, args.N = s.N, args.K = s.K, args.ldc = s.ldc;
    args.workspace = dW.p;
    args.workspace_bytes = ws;
    gemm::RunConfig cfg;
    cfg.split_k = c.split;
    MK_ASSERT_OK(gemm::run(args, nullptr, cfg));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<__nv_bfloat16> C(s.M * s.ldc);
    cudaMemcpy(C.data(), dC.p, C.size() * 2, cudaMemcpyDeviceToHost);
    std::vector<uint8_t> tail(64);
    cudaMemcpy(tail.data(), static_cast<char*>(dW.p) + ws, 64, cudaMemcpyDeviceToHost);
    const ExactCount e = count_exact(a, b, C, s);
    const int64_t bad = e.bad, pad_touched = e.pad_touched;
    EXPECT_EQ(bad, 0);
    EXPECT_EQ(pad_touched, 0) << "the reduction wrote past N into the row padding";
    for (uint8_t x : tail) EXPECT_EQ(x, 0x7f) << "split-K wrote past the workspace it needs";
  }
}

// Split-K on random data against cuBLAS (as RandomNormalAgainstCublas), at the skinny shapes it
// is for, with the automatic choice; and the same answer from two runs (the order is fixed).
TEST(Gemm, SplitKRandomAgainstCublasAndDeterministic) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  int ctas = 0;
  MK_ASSERT_OK(gemm::persistent_ctas(&ctas));
  std::mt19937_64 rng(test_seed() + 8);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (Shape s : {Shape{128, 8192, 8192, 8192}, Shape{256, 1024, 8192, 1024}, Shape{64, 3584, 8192, 3584}}) {
    const int splits = gemm::split_k_for(s.M, s.N, s.K, ctas);
    SCOPED_TRACE(testing::Message() << "M " << s.M << " N " << s.N << " K " << s.K << " splits " << splits);
    EXPECT_GT(splits, 1) << "a skinny shape the automatic choice should split";
    std::vector<__nv_bfloat16> A(s.M * s.K), B(s.N * s.K);
    for (auto& x : A) x = __float2bfloat16(nd(rng));
    for (auto& x : B) x = __float2bfloat16(nd(rng));
    const size_t ws = gemm::split_k_workspace_bytes(s.M, s.N, s.K);
    DevBuf dA(A.size() * 2), dB(B.size() * 2), dC(s.M * s.N * 2), dC2(s.M * s.N * 2), dR(s.M * s.N * 2),
        dF(s.M * s.N * 4), dW(ws);
    cudaMemcpy(dA.p, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dB.p, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(dC.p, 0xff, s.M * s.N * 2);
    gemm::Arguments args;
    args.A = dA.p, args.B = dB.p, args.C = dC.p;
    args.M = s.M, args.N = s.N, args.K = s.K;
    args.workspace = dW.p;
    args.workspace_bytes = ws;
    MK_ASSERT_OK(gemm::run(args, nullptr));
    args.C = dC2.p;
    MK_ASSERT_OK(gemm::run(args, nullptr));
    const float one = 1, zero = 0;
    ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.N, s.M, s.K, &one, dB.p, CUDA_R_16BF, s.K, dA.p,
                           CUDA_R_16BF, s.K, &zero, dR.p, CUDA_R_16BF, s.N, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.N, s.M, s.K, &one, dB.p, CUDA_R_16BF, s.K, dA.p,
                           CUDA_R_16BF, s.K, &zero, dF.p, CUDA_R_32F, s.N, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<__nv_bfloat16> C(s.M * s.N), C2(s.M * s.N), R(s.M * s.N);
    std::vector<float> F(s.M * s.N);
    cudaMemcpy(C.data(), dC.p, C.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(C2.data(), dC2.p, C2.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(R.data(), dR.p, R.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(F.data(), dF.p, F.size() * 4, cudaMemcpyDeviceToHost);
    EXPECT_EQ(memcmp(C.data(), C2.data(), C.size() * 2), 0) << "two runs differ";
    const RelErrors re = rel_errors(C, R, F);
    const int64_t nan = re.nan;
    const double rel_mk = re.mk, rel_cublas = re.cublas;
    printf("split-K M %lld N %lld K %lld, %d ranges: relative error mkernel %.3e, cuBLAS bf16 %.3e\n",
           (long long)s.M, (long long)s.N, (long long)s.K, splits, rel_mk, rel_cublas);
    EXPECT_EQ(nan, 0);
    EXPECT_LE(rel_mk, 1.5 * rel_cublas + 1e-6);
  }
  cublasDestroy(h);
}

// Split-K's refusals: a forced split without (enough) workspace, or with per-tile flags.
TEST(Gemm, SplitKRejectsWhatItCannotDo) {
  DevBuf dA(64 * 1024 * 2), dB(256 * 1024 * 2), dC(64 * 256 * 2), dW(64 * 256 * 4 * 4);
  uint64_t* flags = nullptr;
  ASSERT_EQ(cudaMalloc(&flags, 8), cudaSuccess);
  gemm::Arguments args;
  args.A = dA.p, args.B = dB.p, args.C = dC.p;
  args.M = 64, args.N = 256, args.K = 1024;
  gemm::RunConfig cfg;
  cfg.split_k = 4;
  EXPECT_EQ(gemm::run(args, nullptr, cfg).code(), Code::kInvalidArgument);  // no workspace
  args.workspace = dW.p;
  args.workspace_bytes = 64 * 256 * 4 * 3;
  EXPECT_EQ(gemm::run(args, nullptr, cfg).code(), Code::kInvalidArgument);  // room for 3 ranges only
  args.workspace_bytes = 64 * 256 * 4 * 4;
  MK_EXPECT_OK(gemm::run(args, nullptr, cfg));
  args.tile_flags = flags;
  EXPECT_EQ(gemm::run(args, nullptr, cfg).code(), Code::kInvalidArgument);  // flags per tile
  cfg.split_k = -1;
  args.tile_flags = nullptr;
  EXPECT_EQ(gemm::run(args, nullptr, cfg).code(), Code::kInvalidArgument);
  cfg.split_k = 0;  // automatic with tile flags: runs unsplit
  args.tile_flags = flags;
  MK_EXPECT_OK(gemm::run(args, nullptr, cfg));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(flags);
}

// Random normal inputs: the kernel's error against an fp32-output cuBLAS reference must be
// close to cuBLAS's own bf16-output error against the same reference.
TEST(Gemm, RandomNormalAgainstCublas) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  std::mt19937_64 rng(test_seed() + 1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (Shape s : {Shape{2048, 2048, 1024, 2048}, Shape{1000, 3000, 520, 3000}, Shape{4096, 4096, 4096, 4096}}) {
    SCOPED_TRACE(testing::Message() << "M " << s.M << " N " << s.N << " K " << s.K);
    std::vector<__nv_bfloat16> A(s.M * s.K), B(s.N * s.K);
    for (auto& x : A) x = __float2bfloat16(nd(rng));
    for (auto& x : B) x = __float2bfloat16(nd(rng));
    DevBuf dA(A.size() * 2), dB(B.size() * 2), dC(s.M * s.N * 2), dR(s.M * s.N * 2), dF(s.M * s.N * 4);
    cudaMemcpy(dA.p, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dB.p, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(dC.p, 0xff, s.M * s.N * 2);
    gemm::Arguments args;
    args.A = dA.p;
    args.B = dB.p;
    args.C = dC.p;
    args.M = s.M;
    args.N = s.N;
    args.K = s.K;
    MK_ASSERT_OK(gemm::run(args, nullptr));
    // Row-major C[M,N] = A·Bᵀ is column-major Cᵀ[N,M] = op_T(B) · op_N(A).
    const float one = 1, zero = 0;
    ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.N, s.M, s.K, &one, dB.p, CUDA_R_16BF, s.K, dA.p,
                           CUDA_R_16BF, s.K, &zero, dR.p, CUDA_R_16BF, s.N, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.N, s.M, s.K, &one, dB.p, CUDA_R_16BF, s.K, dA.p,
                           CUDA_R_16BF, s.K, &zero, dF.p, CUDA_R_32F, s.N, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<__nv_bfloat16> C(s.M * s.N), R(s.M * s.N);
    std::vector<float> F(s.M * s.N);
    cudaMemcpy(C.data(), dC.p, C.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(R.data(), dR.p, R.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(F.data(), dF.p, F.size() * 4, cudaMemcpyDeviceToHost);
    const RelErrors re = rel_errors(C, R, F);
    const int64_t nan = re.nan;
    const double rel_mk = re.mk, rel_cublas = re.cublas;
    printf("M %lld N %lld K %lld: relative error mkernel %.3e, cuBLAS bf16 %.3e\n", (long long)s.M,
           (long long)s.N, (long long)s.K, rel_mk, rel_cublas);
    EXPECT_EQ(nan, 0);
    EXPECT_LE(rel_mk, 1.5 * rel_cublas + 1e-6);
    EXPECT_LT(rel_mk, 1e-2);
  }
  cublasDestroy(h);
}

// Fills A and B with small integers; returns the host copies.
void small_ints(std::mt19937_64& rng, std::vector<__nv_bfloat16>& v) {
  std::uniform_int_distribution<int> d(-3, 3);
  for (auto& x : v) x = __float2bfloat16(float(d(rng)));
}

std::vector<uint16_t> run_gemm(const gemm::Arguments& args, size_t elems) {
  EXPECT_EQ(cudaMemset(args.C, 0xff, elems * 2), cudaSuccess);
  Status s = gemm::run(args, nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(elems);
  cudaMemcpy(out.data(), args.C, elems * 2, cudaMemcpyDeviceToHost);
  return out;
}

// The caller-given scheduler: reversed and shuffled tile orders give the same C, bit for bit.
// Small random integers in bf16 (exact products, exact fp32 sums) copied to the device, and the
// Arguments of C = A·Bᵀ over them (C packed [M, N]).
struct IntProblem {
  DevBuf dA, dB, dC;
  gemm::Arguments args;
  IntProblem(std::mt19937_64& rng, int64_t M, int64_t N, int64_t K) : dA(M * K * 2), dB(N * K * 2), dC(M * N * 2) {
    std::vector<__nv_bfloat16> A(M * K), B(N * K);
    small_ints(rng, A);
    small_ints(rng, B);
    cudaMemcpy(dA.p, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dB.p, B.data(), B.size() * 2, cudaMemcpyHostToDevice);
    args.A = dA.p;
    args.B = dB.p;
    args.C = dC.p;
    args.M = M;
    args.N = N;
    args.K = K;
  }
};

TEST(Gemm, CallerGivenTileOrder) {
  std::mt19937_64 rng(test_seed() + 2);
  const int64_t M = 1000, N = 1032, K = 520;
  IntProblem prob(rng, M, N, K);
  gemm::Arguments args = prob.args;
  const std::vector<uint16_t> base = run_gemm(args, M * N);
  const gemm::TileCount tc = gemm::tile_count(M, N);
  std::vector<int> order(tc.total());
  for (int i = 0; i < tc.total(); ++i) order[i] = tc.total() - 1 - i;
  DevBuf dOrder(order.size() * sizeof(int));
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) std::shuffle(order.begin(), order.end(), rng);
    cudaMemcpy(dOrder.p, order.data(), order.size() * sizeof(int), cudaMemcpyHostToDevice);
    args.tile_order = static_cast<const int*>(dOrder.p);
    EXPECT_TRUE(run_gemm(args, M * N) == base) << (pass ? "shuffled" : "reversed") << " order";
  }
}

// Waits (bounded) for each tile's flag, then copies the tile: a flag raised before its data
// would leave poison in the snapshot.
__global__ void snapshot_on_flag(const uint64_t* flags, uint64_t value, const uint16_t* C, uint16_t* snap,
                                 int tiles_m, int tiles_total, int64_t M, int64_t N, int* timeouts) {
  for (int t = blockIdx.x; t < tiles_total; t += gridDim.x) {
    if (threadIdx.x == 0) {
      const long long t0 = clock64();
      uint64_t v;
      do {
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flags + t) : "memory");
      } while (v < value && clock64() - t0 < 20000000000ll);
      if (v < value) atomicAdd(timeouts, 1);
    }
    __syncthreads();
    const int64_t m0 = int64_t(t % tiles_m) * 128, n0 = int64_t(t / tiles_m) * 256;
    for (int i = threadIdx.x; i < 128 * 256; i += blockDim.x) {
      const int64_t m = m0 + i / 256, n = n0 + i % 256;
      if (m < M && n < N) snap[m * N + n] = reinterpret_cast<const volatile uint16_t*>(C)[m * N + n];
    }
    __syncthreads();
  }
}

TEST(Gemm, TileFlagsFollowTheirData) {
  std::mt19937_64 rng(test_seed() + 3);
  const int64_t M = 2048, N = 2048, K = 1024;
  IntProblem prob(rng, M, N, K);
  DevBuf dSnap(M * N * 2), dT(sizeof(int));
  gemm::Arguments args = prob.args;
  const std::vector<uint16_t> ref = run_gemm(args, M * N);  // no flags
  const gemm::TileCount tc = gemm::tile_count(M, N);
  DevBuf dFlags(tc.total() * 8);
  for (uint64_t epoch = 1; epoch <= 3; ++epoch) {  // flags are never reset: values grow
    if (epoch == 1) cudaMemset(dFlags.p, 0, tc.total() * 8);
    cudaMemset(prob.dC.p, 0xff, M * N * 2);
    cudaMemset(dSnap.p, 0xff, M * N * 2);
    cudaMemset(dT.p, 0, sizeof(int));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaStream_t s1, s2;
    cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
    // The watcher first (4 CTAs), then the GEMM on the SMs left: both must be resident.
    snapshot_on_flag<<<4, 256, 0, s2>>>(static_cast<uint64_t*>(dFlags.p), epoch, static_cast<uint16_t*>(prob.dC.p),
                                        static_cast<uint16_t*>(dSnap.p), tc.m, tc.total(), M, N,
                                        static_cast<int*>(dT.p));
    int resident = 0;
    MK_ASSERT_OK(gemm::persistent_ctas(&resident));
    gemm::RunConfig rc;
    rc.max_ctas = resident - 4;
    args.tile_flags = static_cast<uint64_t*>(dFlags.p);
    args.tile_flag_value = epoch;
    MK_ASSERT_OK(gemm::run(args, s1, rc));
    ASSERT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s2), cudaSuccess);
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    int timeouts = -1;
    cudaMemcpy(&timeouts, dT.p, sizeof(int), cudaMemcpyDeviceToHost);
    EXPECT_EQ(timeouts, 0);
    std::vector<uint16_t> C(M * N), snap(M * N);
    std::vector<uint64_t> flags(tc.total());
    cudaMemcpy(C.data(), prob.dC.p, M * N * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(snap.data(), dSnap.p, M * N * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(flags.data(), dFlags.p, flags.size() * 8, cudaMemcpyDeviceToHost);
    EXPECT_TRUE(C == ref) << "epoch " << epoch;
    int64_t early = 0;
    for (int64_t i = 0; i < M * N; ++i) early += snap[i] != ref[i];
    EXPECT_EQ(early, 0) << "elements read after their tile's flag that were not yet written, epoch " << epoch;
    for (int t = 0; t < tc.total(); ++t) ASSERT_EQ(flags[t], epoch) << "tile " << t;
  }
}

// The traced kernel variant: a producer event and two consumer events (compute, epilogue) per
// tile, sane stamps, the same C as the untraced variant; the timeline goes to MK_TRACE_OUT
// (Chrome/Perfetto JSON).
TEST(Gemm, TraceRecordsEveryTile) {
  std::mt19937_64 rng(test_seed() + 5);
  const int64_t M = 4096, N = 4096, K = 4096;
  IntProblem prob(rng, M, N, K);
  gemm::Arguments args = prob.args;
  const std::vector<uint16_t> plain = run_gemm(args, M * N);
  TraceRecorder rec;
  MK_ASSERT_OK(TraceRecorder::create(8192, &rec));
  args.trace = rec.device();
  EXPECT_TRUE(run_gemm(args, M * N) == plain) << "tracing changed the result";
  std::vector<TraceEvent> ev;
  uint64_t dropped = 0;
  MK_ASSERT_OK(rec.fetch(&ev, &dropped));
  const gemm::TileCount tc = gemm::tile_count(M, N);
  EXPECT_EQ(dropped, 0u);
  int sms = 0, resident = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  MK_ASSERT_OK(gemm::persistent_ctas(&resident));
  // One Role::kCta event per CTA of the grid (its whole life), apart from the tiles' events.
  const int grid = std::min(resident, tc.total());
  std::vector<int> ctas(sms, 0);
  std::vector<TraceEvent> tiles_ev;
  for (const TraceEvent& e : ev) {
    if (e.role != uint32_t(Role::kCta)) {
      tiles_ev.push_back(e);
      continue;
    }
    ASSERT_LT(e.cta, uint32_t(grid));
    EXPECT_LE(e.t0_ns, e.t1_ns);
    ++ctas[e.cta];
  }
  for (int b = 0; b < grid; ++b) EXPECT_EQ(ctas[b], 1) << "CTA " << b << "'s life events";
  ev.swap(tiles_ev);
  ASSERT_EQ(ev.size(), size_t(3 * tc.total()));  // load, compute, epilogue per tile
  std::vector<int> loads(tc.total(), 0), computes(tc.total(), 0), epilogues(tc.total(), 0);
  for (const TraceEvent& e : ev) {
    ASSERT_GE(e.item, 0);
    ASSERT_LT(e.item, tc.total());
    EXPECT_LE(e.t0_ns, e.t1_ns);
    EXPECT_LT(e.sm, 132u);
    EXPECT_LT(e.cta, uint32_t(sms));
    if (e.role == uint32_t(Role::kLoad)) ++loads[e.item];
    else if (e.role == uint32_t(Role::kCompute)) ++computes[e.item];
    else if (e.role == uint32_t(Role::kEpilogue)) ++epilogues[e.item];
    else ADD_FAILURE() << "unexpected role " << e.role;
  }
  for (int t = 0; t < tc.total(); ++t) {
    EXPECT_EQ(loads[t], 1) << "tile " << t;
    EXPECT_EQ(computes[t], 1) << "tile " << t;
    EXPECT_EQ(epilogues[t], 1) << "tile " << t;
  }
  const char* out = getenv("MK_TRACE_OUT");
  const std::string path = out ? out : "/tmp/mkernel_gemm_trace.json";
  MK_ASSERT_OK(write_chrome_trace(ev, path));
  FILE* f = fopen(path.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char head[64] = {0};
  ASSERT_GT(fread(head, 1, sizeof(head) - 1, f), 0u);
  fclose(f);
  EXPECT_NE(std::string(head).find("traceEvents"), std::string::npos);
}

// The fused operators' kernel variant (dynamic scheduler, communication role) without a
// communication program: with 0, 1, 8 and 32 CTAs counted in the communication role (device
// memory) every CTA computes tiles, taken from the counter, in the caller's order or the natural
// one; the result is the same, bit for bit, as the static schedule's.
TEST(Gemm, DynamicSchedulerWithoutProgram) {
  std::mt19937_64 rng(test_seed() + 6);
  const int64_t M = 2048, N = 2048, K = 1024;
  IntProblem prob(rng, M, N, K);
  const gemm::TileCount tc = gemm::tile_count(M, N);
  DevBuf dRoles(sizeof(int)), dCounter(sizeof(int)), dOrder(tc.total() * sizeof(int));
  const std::vector<uint16_t> plain = run_gemm(prob.args, M * N);
  std::vector<int> order(tc.total());
  for (int i = 0; i < tc.total(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  cudaMemcpy(dOrder.p, order.data(), order.size() * sizeof(int), cudaMemcpyHostToDevice);
  gemm::FusedLaunch f;
  f.role_counts = static_cast<const int*>(dRoles.p);
  f.tile_counter = static_cast<int*>(dCounter.p);
  for (int comm : {0, 1, 8, 32}) {
    for (bool shuffled : {false, true}) {
      SCOPED_TRACE(testing::Message() << comm << " communication CTAs, " << (shuffled ? "shuffled" : "natural")
                                      << " order");
      cudaMemcpy(dRoles.p, &comm, sizeof(int), cudaMemcpyHostToDevice);
      f.tile_order = shuffled ? static_cast<const int*>(dOrder.p) : nullptr;
      cudaMemset(prob.dC.p, 0xff, M * N * 2);
      MK_ASSERT_OK(gemm::run_fused(prob.args, f, nullptr, gemm::RunConfig{}));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint16_t> C(M * N);
      cudaMemcpy(C.data(), prob.dC.p, M * N * 2, cudaMemcpyDeviceToHost);
      EXPECT_TRUE(C == plain);
    }
  }
}

TEST(Gemm, BadInputIsRejected) {
  DevBuf A(1 << 20), B(1 << 20), C(1 << 20);
  gemm::Arguments ok;
  ok.A = A.p;
  ok.B = B.p;
  ok.C = C.p;
  ok.M = 64;
  ok.N = 64;
  ok.K = 64;
  MK_EXPECT_OK(gemm::can_implement(ok));
  auto expect_bad = [&](gemm::Arguments a, const char* what) {
    Status s = gemm::can_implement(a);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << what << ": " << s.to_string();
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
    EXPECT_FALSE(gemm::run(a, nullptr).ok());
  };
  gemm::Arguments a = ok;
  a.K = 0;
  expect_bad(a, "K must be > 0");
  a = ok;
  a.A = static_cast<char*>(A.p) + 2;
  expect_bad(a, "16-byte aligned");
  a = ok;
  a.lda = 65;
  a.K = 64;
  expect_bad(a, "multiples of 8");
  a = ok;
  a.N = 1030;
  a.ldc = 1032;
  expect_bad(a, "multiples of 8 (16-byte rows)");
  a = ok;
  a.c_type = gemm::DType::kF32;
  expect_bad(a, "only bf16");
  a = ok;
  a.C = A.p;
  expect_bad(a, "overlaps");
  int resident = 0;
  MK_ASSERT_OK(gemm::persistent_ctas(&resident));
  EXPECT_GT(resident, 0);
  gemm::RunConfig too_many;
  too_many.max_ctas = resident + 1;
  Status s = gemm::run(ok, nullptr, too_many);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("co-resident"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace test
}  // namespace mk
