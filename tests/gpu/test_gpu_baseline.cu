// The cuBLAS + NCCL baselines against exact host references: every op, sequential (chunks 1)
// and pipelined (chunks 4), on one rank (the collectives are copies, so this checks the
// plumbing, the chunked layouts and the stream joins) and, with 2 or 4 GPUs, on ranks as
// threads, one GPU each, with a different random shard per rank (a wrong source is visible).
// Small integers keep every product, sum and bf16 rounding exact, so every element must match.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tools/baseline/baseline.h"
#include "mkernel/runtime/bootstrap.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {
namespace {

using ops::baseline::Baselines;

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 2)), cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

// Host matrix of small integers, kept as float (exact) and uploaded as bf16.
using Mat = std::vector<float>;

Mat random_ints(std::mt19937_64& rng, size_t n, int lo, int hi) {
  std::uniform_int_distribution<int> d(lo, hi);
  Mat m(n);
  bool nonzero = false;
  for (float& x : m) nonzero |= (x = float(d(rng))) != 0;
  EXPECT_TRUE(nonzero);
  return m;
}

void upload(void* dst, const Mat& m) {
  std::vector<__nv_bfloat16> h(m.size());
  for (size_t i = 0; i < m.size(); ++i) h[i] = __float2bfloat16(m[i]);
  EXPECT_EQ(cudaMemcpy(dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
}

// C[M, N] = A[M, K] · B[N, K]ᵀ in fp32 (exact for these inputs).
Mat ref_gemm(const Mat& A, const Mat& B, int64_t M, int64_t N, int64_t K) {
  Mat C(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += A[m * K + k] * B[n * K + k];
      C[m * N + n] = acc;
    }
  return C;
}

// Every element of the bf16 device buffer `dev` must equal `want` rounded to bf16 (NaN poison
// left anywhere fails).
void expect_equal(const void* dev, const Mat& want, const std::string& what) {
  std::vector<__nv_bfloat16> got(want.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dev, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float w = __bfloat162float(__float2bfloat16(want[i]));
    const float g = __bfloat162float(got[i]);
    if (!(g == w) && bad++ < 5) ADD_FAILURE() << what << ": element " << i << " = " << g << ", want " << w;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " elements differ";
}

void poison(void* p, size_t bytes, cudaStream_t s) {
  EXPECT_EQ(cudaMemsetAsync(p, 0xff, bytes, s), cudaSuccess);  // 0xffff: NaN in bf16
}

// Runs body(rank, baselines, stream) on one thread per rank, rank r on GPU r, each with its
// own Baselines (created collectively) and a non-blocking stream. The body syncs only that
// stream before reading results, so a missing join of the internal streams shows up.
void on_ranks(int W, const std::function<void(int, Baselines&, cudaStream_t)>& body) {
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(W, &bs));
  std::vector<std::string> errors(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      if (cudaSetDevice(r) != cudaSuccess) {
        errors[r] = "cudaSetDevice failed";
        return;
      }
      std::unique_ptr<Baselines> bl;
      const Status s = Baselines::create(*bs[r], r, &bl);
      if (!s.ok()) {
        errors[r] = s.to_string();
        return;
      }
      EXPECT_EQ(bl->rank(), r);
      EXPECT_EQ(bl->world(), W);
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        errors[r] = "cudaStreamCreate failed";
        return;
      }
      body(r, *bl, stream);
      cudaStreamDestroy(stream);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < W; ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}

std::string tag(const char* op, int rank, int chunks, const char* what) {
  return std::string(op) + " rank " + std::to_string(rank) + " chunks " + std::to_string(chunks) + ": " + what;
}

// All ops on W ranks. M = 512 rows; the GEMM sizes shrink with W only where a reduction
// across ranks must stay exact in bf16 (every partial and partial sum an integer <= 256).
void check_all_ops(int W) {
  const int64_t M = 512, N = 384, K = 256, Ms = M / W, N_loc = N / W;
  // Reductions: one rank, K = 256 in [-2, 2] (the fp32 result is rounded to bf16 once, as
  // cuBLAS does); several, K_loc = 64 in [-1, 1], so |sum| <= 64 * W <= 256 at every step.
  const int64_t K_loc = W == 1 ? 256 : 64;
  const int lim = W == 1 ? 2 : 1;
  std::mt19937_64 rng(test_seed() + W);

  // AllGather + GEMM: rank r holds shard r of A and its own B_r [N_loc, K].
  std::vector<Mat> a_shard(W), b_ag(W), c_ag(W);
  Mat a_full;
  for (int r = 0; r < W; ++r) {
    a_shard[r] = random_ints(rng, Ms * K, -2, 2);
    a_full.insert(a_full.end(), a_shard[r].begin(), a_shard[r].end());
    b_ag[r] = random_ints(rng, N_loc * K, -2, 2);
  }
  for (int r = 0; r < W; ++r) c_ag[r] = ref_gemm(a_full, b_ag[r], M, N_loc, K);
  // GEMM + ReduceScatter / AllReduce: rank r holds A_r [M, K_loc], B_r [N, K_loc].
  std::vector<Mat> a_red(W), b_red(W), part(W);
  Mat sum(M * N, 0.f);
  for (int r = 0; r < W; ++r) {
    a_red[r] = random_ints(rng, M * K_loc, -lim, lim);
    b_red[r] = random_ints(rng, N * K_loc, -lim, lim);
    part[r] = ref_gemm(a_red[r], b_red[r], M, N, K_loc);
    for (int64_t i = 0; i < M * N; ++i) sum[i] += part[r][i];
  }

  on_ranks(W, [&](int r, Baselines& bl, cudaStream_t s) {
    // ---- ag_gemm
    DevBuf dA(Ms * K * 2), dB(N_loc * K * 2), dC(M * N_loc * 2), dAfull(M * K * 2),
        dWs(std::max<size_t>(Baselines::ag_workspace_bytes(M, K, W, 4), 2));
    upload(dA.p, a_shard[r]);
    upload(dB.p, b_ag[r]);
    // Chunk-major gather layout: ws[c][q] = rows q*Ms + c*rc .. of the full A.
    auto chunk_major = [&](int chunks) {
      const int64_t rc = Ms / chunks;
      Mat g(M * K);
      for (int c = 0; c < chunks; ++c)
        for (int q = 0; q < W; ++q)
          std::copy_n(&a_full[(q * Ms + c * rc) * K], rc * K, &g[((int64_t(c) * W + q) * rc) * K]);
      return g;
    };
    for (int chunks : {1, 4}) {
      for (bool use_ws : {true, false}) {
        if (chunks == 1 && !use_ws) continue;
        poison(dC.p, M * N_loc * 2, s);
        poison(dAfull.p, M * K * 2, s);
        poison(dWs.p, M * K * 2, s);
        MK_EXPECT_OK(bl.ag_gemm(dA.p, dB.p, dC.p, dAfull.p, use_ws ? dWs.p : nullptr, M, N_loc, K, chunks, s));
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        expect_equal(dC.p, c_ag[r], tag("ag_gemm", r, chunks, use_ws ? "C" : "C (A_full as ws)"));
        if (chunks == 1) expect_equal(dAfull.p, a_full, tag("ag_gemm", r, chunks, "A_full"));
        else expect_equal(use_ws ? dWs.p : dAfull.p, chunk_major(chunks), tag("ag_gemm", r, chunks, "gathered A"));
      }
    }

    // ---- gemm_rs and gemm_ar
    DevBuf dAr(M * K_loc * 2), dBr(N * K_loc * 2), dCr(M * N * 2), dWr(Baselines::rs_workspace_bytes(M, N, W, 4));
    upload(dAr.p, a_red[r]);
    upload(dBr.p, b_red[r]);
    const Mat rs_want(sum.begin() + r * Ms * N, sum.begin() + (r + 1) * Ms * N);
    for (int chunks : {1, 4}) {
      poison(dCr.p, M * N * 2, s);
      poison(dWr.p, M * N * 2, s);
      MK_EXPECT_OK(bl.gemm_rs(dAr.p, dBr.p, dCr.p, dWr.p, M, N, K_loc, chunks, s));
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      expect_equal(dCr.p, rs_want, tag("gemm_rs", r, chunks, "C"));

      poison(dCr.p, M * N * 2, s);
      MK_EXPECT_OK(bl.gemm_ar(dAr.p, dBr.p, dCr.p, M, N, K_loc, chunks, s));
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      expect_equal(dCr.p, sum, tag("gemm_ar", r, chunks, "C"));
    }

    // ---- the halves alone
    poison(dCr.p, M * N * 2, s);
    MK_EXPECT_OK(bl.gemm(dAr.p, dBr.p, dCr.p, M, N, K_loc, s));
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    expect_equal(dCr.p, part[r], tag("gemm", r, 1, "C"));

    poison(dAfull.p, M * K * 2, s);
    MK_EXPECT_OK(bl.collective(Baselines::Coll::kAllGather, dA.p, dAfull.p, M * K, s));
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    expect_equal(dAfull.p, a_full, tag("allgather", r, 1, "recv"));

    // The partial products (exact, from the GEMM above) reduced by NCCL alone.
    upload(dWr.p, part[r]);
    poison(dCr.p, M * N * 2, s);
    MK_EXPECT_OK(bl.collective(Baselines::Coll::kReduceScatter, dWr.p, dCr.p, Ms * N, s));
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    expect_equal(dCr.p, rs_want, tag("reduce_scatter", r, 1, "recv"));

    MK_EXPECT_OK(bl.collective(Baselines::Coll::kAllReduce, dWr.p, dWr.p, M * N, s));
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    expect_equal(dWr.p, sum, tag("allreduce", r, 1, "in place"));
  });
}

TEST(Baseline, AllOpsOneRank) { check_all_ops(1); }

TEST(Baseline, AllOpsSeveralGpus) {
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has " << n;
  check_all_ops(n >= 4 ? 4 : 2);
}

// Ragged shards or chunks are refused before anything is enqueued, with the reason.
TEST(Baseline, RejectsUnevenRows) {
  on_ranks(1, [](int, Baselines& bl, cudaStream_t s) {
    int dummy_storage = 0;
    void* p = &dummy_storage;  // never dereferenced: validation comes first
    for (int chunks : {3, 0}) {
      for (const Status& st : {bl.ag_gemm(p, p, p, p, p, 512, 384, 256, chunks, s),
                               bl.gemm_rs(p, p, p, p, 512, 384, 256, chunks, s),
                               bl.gemm_ar(p, p, p, 512, 384, 256, chunks, s)}) {
        EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
        if (chunks == 3) EXPECT_NE(st.message().find("evenly"), std::string::npos) << st.message();
      }
    }
    EXPECT_EQ(bl.ag_gemm(p, p, p, nullptr, nullptr, 512, 384, 256, 4, s).code(), Code::kInvalidArgument);
    EXPECT_EQ(bl.ag_gemm(p, p, p, nullptr, p, 512, 384, 256, 1, s).code(), Code::kInvalidArgument);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  });
}

TEST(Baseline, WorkspaceSizes) {
  EXPECT_EQ(Baselines::ag_workspace_bytes(512, 256, 4, 1), 0u);
  EXPECT_EQ(Baselines::ag_workspace_bytes(512, 256, 4, 4), 512u * 256 * 2);
  EXPECT_EQ(Baselines::rs_workspace_bytes(512, 384, 4, 1), 512u * 384 * 2);
  EXPECT_EQ(Baselines::rs_workspace_bytes(512, 384, 4, 4), 512u * 384 * 2);
}

}  // namespace
}  // namespace test
}  // namespace mk
