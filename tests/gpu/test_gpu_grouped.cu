// The grouped GEMM (gemm::run_grouped) against exact and higher-precision references: small
// integers (exact in bf16 and in fp32 sums) for kStore, a double-precision SwiGLU reference,
// random data against cuBLAS's fp32 GEMM per group, skewed and empty groups, explicit offsets
// with gaps (untouched), bad ranges (recorded, left out), CUDA-graph replays with new counts.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "mkernel/gemm/grouped.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {
namespace {

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 16)), cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
void upload(const DevBuf& d, const std::vector<T>& v) {
  ASSERT_EQ(cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}
template <class T>
std::vector<T> download(const DevBuf& d, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), d.p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// A problem: groups' counts, their first rows (packed when !gaps), the rows of A and C.
struct Layout {
  std::vector<int32_t> counts, offsets;
  int64_t rows = 0;
};
Layout make_layout(const std::vector<int32_t>& counts, int gap) {
  Layout l;
  l.counts = counts;
  int64_t r = 0;
  for (int32_t c : counts) {
    r += gap;
    l.offsets.push_back(int32_t(r));
    r += c;
  }
  l.rows = r + gap;
  return l;
}

// The group of each row (-1: none).
std::vector<int> group_of_rows(const Layout& l) {
  std::vector<int> g(l.rows, -1);
  for (size_t e = 0; e < l.counts.size(); ++e)
    for (int32_t r = 0; r < l.counts[e]; ++r) g[l.offsets[e] + r] = int(e);
  return g;
}

struct Problem {
  Layout layout;
  int64_t N = 0, K = 0;
  bool swiglu = false;
  bool pass_offsets = true;  // false: packed (null offsets; layout built without gaps)
};

// Runs the grouped GEMM on host data a [rows, K], b [groups, N, K] (as bf16) into a poisoned C;
// returns C. `graph`: captured once and replayed twice.
std::vector<__nv_bfloat16> run(const Problem& pr, const std::vector<float>& a, const std::vector<float>& b,
                               int32_t* err_out = nullptr, int store = 0) {
  const Layout& l = pr.layout;
  const int G = int(l.counts.size());
  const int64_t n_out = pr.swiglu ? pr.N / 2 : pr.N;
  std::vector<__nv_bfloat16> A(a.size()), B(b.size());
  for (size_t i = 0; i < a.size(); ++i) A[i] = __float2bfloat16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) B[i] = __float2bfloat16(b[i]);
  DevBuf dA(A.size() * 2), dB(B.size() * 2), dC(l.rows * n_out * 2), dn(G * 4), doff(G * 4), derr(4);
  upload(dA, A);
  upload(dB, B);
  upload(dn, l.counts);
  upload(doff, l.offsets);
  cudaMemset(dC.p, 0xff, l.rows * n_out * 2);  // NaN in bf16
  cudaMemset(derr.p, 0, 4);
  gemm::GroupedArguments g;
  g.A = dA.p;
  g.B = dB.p;
  g.C = dC.p;
  g.groups = G;
  g.rows = l.rows;
  g.N = pr.N;
  g.K = pr.K;
  g.counts = dn.as<int32_t>();
  g.offsets = pr.pass_offsets ? doff.as<int32_t>() : nullptr;
  g.epilogue = pr.swiglu ? gemm::GroupedEpilogue::kSwiGLU : gemm::GroupedEpilogue::kStore;
  g.error = derr.as<int32_t>();
  gemm::GroupedConfig cfg;
  cfg.store = store;
  EXPECT_TRUE(gemm::run_grouped(g, nullptr, cfg).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (err_out) *err_out = download<int32_t>(derr, 1)[0];
  else EXPECT_EQ(download<int32_t>(derr, 1)[0], 0);
  return download<__nv_bfloat16>(dC, l.rows * n_out);
}

// Every element of C: rows of a group against want(row, group, col) (a bf16 ulp of slack when
// `tol_ulps`), every other row untouched (still the 0xffff poison).
template <class Want>
void check_all(const Problem& pr, const std::vector<__nv_bfloat16>& C, Want want, double tol_ulps) {
  const int64_t n_out = pr.swiglu ? pr.N / 2 : pr.N;
  const std::vector<int> grp = group_of_rows(pr.layout);
  int64_t bad = 0, touched = 0;
  for (int64_t r = 0; r < pr.layout.rows; ++r) {
    for (int64_t n = 0; n < n_out; ++n) {
      const __nv_bfloat16 c = C[r * n_out + n];
      if (grp[r] < 0) {
        uint16_t raw;
        memcpy(&raw, &c, 2);
        touched += raw != 0xffff;
        continue;
      }
      const double w = want(r, grp[r], n), got = __bfloat162float(c);
      const double tol = tol_ulps * std::max(std::fabs(w), 1e-3) / 128.0;  // bf16: 8 significant bits
      if (!(std::fabs(got - w) <= tol) && bad++ < 5)
        ADD_FAILURE() << "C[" << r << "," << n << "] (group " << grp[r] << ") = " << got << ", want " << w;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(touched, 0) << "rows outside every group were written";
}

void fill_ints(std::mt19937_64& rng, std::vector<float>& v, int lo, int hi) {
  std::uniform_int_distribution<int> d(lo, hi);
  for (float& x : v) x = float(d(rng));
}

double dot(const float* x, const float* y, int64_t K) {
  double s = 0;
  for (int64_t k = 0; k < K; ++k) s += double(x[k]) * double(y[k]);
  return s;
}
// An exact (integer) result as the bf16 the kernel stores.
double bf16r(double x) { return double(__bfloat162float(__float2bfloat16(float(x)))); }

// kStore with small integers: every product and sum is exact, so C must equal the reference
// rounded to bf16. Groups of every size class around the 128-row tile, empty ones, packed and
// with gaps between groups, N and K off the tile.
TEST(Grouped, ExactOnSmallIntegers) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int32_t> counts = {0, 1, 127, 128, 129, 0, 300, 7};
  for (int store : {1, 2})  // both epilogues: register stores and staged through shared memory
  for (int gap : {0, 5}) {
    for (const auto& nk : {std::pair<int64_t, int64_t>{264, 72}, {256, 64}, {1032, 520}, {8, 8}}) {
      const int64_t N = nk.first, K = nk.second;
      Problem pr;
      pr.layout = make_layout(counts, gap);
      pr.N = N;
      pr.K = K;
      pr.pass_offsets = gap != 0;
      SCOPED_TRACE(testing::Message() << "store " << store << " gap " << gap << " N " << N << " K " << K);
      const int G = int(counts.size());
      std::vector<float> a(pr.layout.rows * K), b(G * N * K);
      fill_ints(rng, a, -3, 3);
      fill_ints(rng, b, -3, 3);
      const auto C = run(pr, a, b, nullptr, store);
      check_all(pr, C, [&](int64_t r, int g, int64_t n) {
        return bf16r(dot(&a[r * K], &b[(g * N + n) * K], K));
      }, 0.0);
    }
  }
}

// SwiGLU: C[r, j] = silu(gate) * up, gate and up from B's rows j and I + j; double reference
// from the same bf16 inputs, one bf16 ulp of slack (the kernel rounds once from fp32).
TEST(Grouped, SwigluAgainstDoubleReference) {
  std::mt19937_64 rng(test_seed() + 1);
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::vector<int32_t> counts = {3, 0, 200, 128, 1, 64};
  for (int store : {1, 2})
  for (const auto& ik : {std::pair<int64_t, int64_t>{128, 64}, {136, 200}, {768, 256}, {8, 16}}) {
    const int64_t I = ik.first, K = ik.second;
    Problem pr;
    pr.layout = make_layout(counts, 3);
    pr.N = 2 * I;
    pr.K = K;
    pr.swiglu = true;
    SCOPED_TRACE(testing::Message() << "store " << store << " I " << I << " K " << K);
    const int G = int(counts.size());
    std::vector<float> a(pr.layout.rows * K), b(G * 2 * I * K);
    const float sa = 1.0f / std::sqrt(float(K));
    for (float& x : a) x = __bfloat162float(__float2bfloat16(nd(rng)));
    for (float& x : b) x = __bfloat162float(__float2bfloat16(nd(rng) * sa * 2));
    const auto C = run(pr, a, b, nullptr, store);
    check_all(pr, C, [&](int64_t r, int g, int64_t j) {
      const double gt = dot(&a[r * K], &b[(g * 2 * I + j) * K], K);
      const double up = dot(&a[r * K], &b[(g * 2 * I + I + j) * K], K);
      return gt / (1.0 + std::exp(-gt)) * up;
    }, 1.5);
  }
}

// Random normal data at model-like sizes against cuBLAS's fp32-output GEMM of each group (an
// independent kernel, higher-precision output), every element: |C - F| <= 2^-8 |F| (C's own
// rounding to bf16: at most half a unit, 2^-8 of the value at the bottom of a binade) + 1e-5
// ||a_row|| ||b_col|| (the two fp32 sums in different orders; Cauchy-Schwarz bounds sum |a b|,
// and 1e-5 of it is ~170 units of 2^-24, ten times a random walk of 2048 roundings). A wrong
// row, column or group is off by the order of |F| ~ sqrt(K). And the relative Frobenius error
// below bf16 rounding.
TEST(Grouped, RandomAgainstCublasFp32) {
  std::mt19937_64 rng(test_seed() + 2);
  std::normal_distribution<float> nd(0.f, 1.f);
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  // Skewed: one hot expert, several empty, 64 groups.
  std::vector<int32_t> counts(64);
  std::uniform_int_distribution<int> d(0, 90);
  for (auto& c : counts) c = d(rng) < 20 ? 0 : d(rng);
  counts[5] = 1500;
  const int64_t N = 1536, K = 2048;
  Problem pr;
  pr.layout = make_layout(counts, 0);
  pr.N = N;
  pr.K = K;
  pr.pass_offsets = false;
  const int G = int(counts.size());
  std::vector<float> a(pr.layout.rows * K), b(G * N * K);
  for (float& x : a) x = nd(rng);
  for (float& x : b) x = nd(rng);
  const auto C = run(pr, a, b);
  // cuBLAS per group: C_g (column-major N x M_g, i.e. row-major M_g x N) = B_g (K x N)ᵀ · A_g.
  std::vector<__nv_bfloat16> A(a.size()), B(b.size());
  for (size_t i = 0; i < a.size(); ++i) A[i] = __float2bfloat16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) B[i] = __float2bfloat16(b[i]);
  DevBuf dA(A.size() * 2), dB(B.size() * 2), dF(pr.layout.rows * N * 4);
  upload(dA, A);
  upload(dB, B);
  const float one = 1.f, zero = 0.f;
  for (int g = 0; g < G; ++g) {
    if (!counts[g]) continue;
    const int64_t off = pr.layout.offsets[g];
    ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), counts[g], int(K), &one, dB.as<__nv_bfloat16>() + g * N * K,
                           CUDA_R_16BF, int(K), dA.as<__nv_bfloat16>() + off * K, CUDA_R_16BF, int(K), &zero,
                           dF.as<float>() + off * N, CUDA_R_32F, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto F = download<float>(dF, pr.layout.rows * N);
  // Row norms of the bf16 inputs (what both kernels multiply), of A's rows and of each group's B rows.
  std::vector<double> na(size_t(pr.layout.rows), 0.0), nb(size_t(G) * N, 0.0);
  for (int64_t r = 0; r < pr.layout.rows; ++r) {
    double s2 = 0;
    for (int64_t k = 0; k < K; ++k) s2 += double(__bfloat162float(A[size_t(r * K + k)])) * __bfloat162float(A[size_t(r * K + k)]);
    na[size_t(r)] = std::sqrt(s2);
  }
  for (int64_t j = 0; j < int64_t(G) * N; ++j) {
    double s2 = 0;
    for (int64_t k = 0; k < K; ++k) s2 += double(__bfloat162float(B[size_t(j * K + k)])) * __bfloat162float(B[size_t(j * K + k)]);
    nb[size_t(j)] = std::sqrt(s2);
  }
  double num = 0, den = 0;
  int64_t nan = 0, bad = 0;
  for (int g = 0; g < G; ++g) {
    const int64_t off = pr.layout.offsets[g];
    for (int64_t r = off; r < off + counts[g]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        const size_t i = size_t(r * N + n);
        const double c = __bfloat162float(C[i]), f = F[i];
        nan += std::isnan(c);
        num += (c - f) * (c - f);
        den += f * f;
        const double tol = std::ldexp(std::fabs(f), -8) + 1e-5 * na[size_t(r)] * nb[size_t(g * N + n)];
        if (!(std::fabs(c - f) <= tol) && bad++ < 5)
          ADD_FAILURE() << "group " << g << " row " << r - off << " col " << n << ": " << c << " against cuBLAS " << f
                        << " (tolerance " << tol << ")";
      }
  }
  EXPECT_EQ(nan, 0);
  EXPECT_EQ(bad, 0) << "elements outside the bound";
  EXPECT_LT(std::sqrt(num / den), 4e-3) << "bf16 output rounding alone is ~2e-3";
  cublasDestroy(h);
}

// Counts and offsets on the device change between replays of one captured graph: each replay
// computes its own routing (no host synchronization in the call).
TEST(Grouped, GraphReplaysWithNewCounts) {
  std::mt19937_64 rng(test_seed() + 3);
  const int G = 4;
  const int64_t N = 256, K = 128, rows = 600;
  std::vector<float> a(rows * K), b(G * N * K);
  fill_ints(rng, a, -2, 2);
  fill_ints(rng, b, -2, 2);
  std::vector<__nv_bfloat16> A(a.size()), B(b.size());
  for (size_t i = 0; i < a.size(); ++i) A[i] = __float2bfloat16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) B[i] = __float2bfloat16(b[i]);
  DevBuf dA(A.size() * 2), dB(B.size() * 2), dC(rows * N * 2), dn(G * 4);
  upload(dA, A);
  upload(dB, B);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  gemm::GroupedArguments g;
  g.A = dA.p;
  g.B = dB.p;
  g.C = dC.p;
  g.groups = G;
  g.rows = rows;
  g.N = N;
  g.K = K;
  g.counts = dn.as<int32_t>();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_TRUE(gemm::run_grouped(g, s).ok());
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const std::vector<std::vector<int32_t>> routings = {{100, 200, 0, 300}, {0, 0, 600, 0}, {1, 129, 255, 3}};
  for (const auto& counts : routings) {
    upload(dn, counts);
    cudaMemset(dC.p, 0xff, rows * N * 2);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    Problem pr;
    pr.layout = make_layout(counts, 0);
    pr.layout.rows = rows;  // rows past the groups stay poisoned
    pr.N = N;
    pr.K = K;
    check_all(pr, download<__nv_bfloat16>(dC, rows * N), [&](int64_t r, int grp, int64_t n) {
      return bf16r(dot(&a[r * K], &b[(grp * N + n) * K], K));
    }, 0.0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// A group whose range leaves [0, rows) (or a negative count) is recorded (group + 1) and left
// out; the other groups are still computed and nothing outside them is written.
TEST(Grouped, BadRangesAreRecordedAndLeftOut) {
  std::mt19937_64 rng(test_seed() + 4);
  const int64_t N = 64, K = 64;
  Problem pr;
  pr.layout = make_layout({10, 20, 30}, 2);
  pr.N = N;
  pr.K = K;
  const int64_t rows = pr.layout.rows;
  pr.layout.counts[1] = int32_t(rows);  // group 1 runs past the end
  std::vector<float> a(rows * K), b(3 * N * K);
  fill_ints(rng, a, -3, 3);
  fill_ints(rng, b, -3, 3);
  int32_t err = 0;
  const auto C = run(pr, a, b, &err);
  EXPECT_EQ(err, 2) << "group 1's range, recorded as 1 + group";
  Problem good = pr;
  good.layout.counts[1] = 0;  // what must have been written: groups 0 and 2 only
  check_all(good, C, [&](int64_t r, int g, int64_t n) { return bf16r(dot(&a[r * K], &b[(g * N + n) * K], K)); },
            0.0);
}

TEST(Grouped, RejectsWhatItCannotDo) {
  int32_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64), cudaSuccess);
  gemm::GroupedArguments g;
  g.A = g.B = d;
  g.C = d + 8;
  g.groups = 2;
  g.rows = 1;
  g.N = 8;
  g.K = 8;
  g.counts = d;
  auto expect_invalid = [](const gemm::GroupedArguments& x, const char* what) {
    const Status s = gemm::run_grouped(x, nullptr);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << what << ": " << s.to_string();
  };
  gemm::GroupedArguments x = g;
  x.groups = 0;
  expect_invalid(x, "no groups");
  x = g, x.groups = gemm::kMaxGroups + 1;
  expect_invalid(x, "too many groups");
  x = g, x.K = 12;
  expect_invalid(x, "K not a multiple of 8");
  x = g, x.N = 8, x.epilogue = gemm::GroupedEpilogue::kSwiGLU;
  expect_invalid(x, "SwiGLU with I = 4");
  x = g, x.counts = nullptr;
  expect_invalid(x, "no counts");
  x = g, x.C = reinterpret_cast<char*>(d) + 2;
  expect_invalid(x, "misaligned C");
  x = g, x.C = d;
  expect_invalid(x, "C aliases A");
  cudaFree(d);
}

}  // namespace
}  // namespace test
}  // namespace mk
