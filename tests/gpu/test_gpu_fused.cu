// The fused GEMM collectives (ops/fused.h) on ranks as processes under MPS: W = 2, 4 on one
// node and 2 emulated nodes x 2 over libfabric (shm, tcp; host-staged).
//
// Data: small rank-tagged integers in bf16 (every product and every cross-rank sum exact in
// fp32), fresh per call. Reference: the unfused GEMM on the same GPU over inputs every rank
// rebuilds from the tags — AG: the gathered A; RS/AR: sum_r A_r·B_rᵀ as one GEMM over the
// concatenated K — so the fused result must match it bit for bit, every element, with C
// poisoned before each call.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/tunables.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "mkernel/gemm/gemm.h"
#include "mkernel/ops/fused.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

using ops::FusedGemm;
using ops::FusedKind;

// Value of element (row, col) of rank r's matrix `which` in call `call`: an integer in [-2, 2].
__host__ __device__ inline float tag_value(uint64_t seed, int rank, int which, uint64_t call, uint64_t i) {
  uint64_t x = seed ^ (uint64_t(rank) << 48) ^ (uint64_t(which) << 40) ^ (call << 32) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return float(int(x % 5) - 2);
}

// dst[r, c] (row stride ld) = tag of rank `rank`'s matrix at (r + row0, c + col0) of a [., cols] matrix.
__global__ void fill_tag(__nv_bfloat16* dst, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank,
                         int which, uint64_t call, int64_t src_cols, int64_t row0) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld + c] = __float2bfloat16(tag_value(seed, rank, which, call, uint64_t(r + row0) * src_cols + c));
  }
}
__global__ void poison(uint16_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 0x7fc1;  // a NaN
}
__global__ void compare(const uint16_t* got, const uint16_t* want, int64_t n, unsigned long long* bad,
                        unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (got[i] != want[i]) {
      atomicAdd(bad, 1ull);
      atomicMin(first, static_cast<unsigned long long>(i));
    }
}

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(b) { cudaMalloc(&p, b ? b : 16); }
  ~DevBuf() { cudaFree(p); }
  __nv_bfloat16* bf() const { return static_cast<__nv_bfloat16*>(p); }
};

constexpr int kFillGrid = 264, kFillBlock = 256;

// One operator instance and its buffers, checked call by call.
struct Case {
  Communicator* comm;
  FusedKind kind;
  ops::PlanShape s;
  bool deterministic = false;
  uint64_t seed = test_seed();
  std::unique_ptr<FusedGemm> op;
  std::unique_ptr<DevBuf> A, B, C, A_ref, B_ref, C_ref;
  unsigned long long* d_bad = nullptr;
  int64_t a_rows = 0, c_rows = 0, c_elems = 0;

  Status init(int comm_ctas = -1) {
    const int W = comm->world();
    ops::FusedOptions o;
    o.deterministic = deterministic;
    o.comm_ctas = comm_ctas;
    MK_CHECK(FusedGemm::create(comm, kind, s, o, &op));
    a_rows = kind == FusedKind::kAgGemm ? s.M / W : s.M;
    c_rows = kind == FusedKind::kGemmRs ? s.M / W : s.M;
    c_elems = c_rows * s.N;
    A = std::make_unique<DevBuf>(size_t(a_rows) * s.K * 2);
    B = std::make_unique<DevBuf>(size_t(s.N) * s.K * 2);
    C = std::make_unique<DevBuf>(size_t(c_elems) * 2);
    if (kind == FusedKind::kAgGemm) {
      A_ref = std::make_unique<DevBuf>(size_t(s.M) * s.K * 2);
      B_ref = std::make_unique<DevBuf>(0);
    } else {
      A_ref = std::make_unique<DevBuf>(size_t(s.M) * s.K * W * 2);
      B_ref = std::make_unique<DevBuf>(size_t(s.N) * s.K * W * 2);
    }
    C_ref = std::make_unique<DevBuf>(size_t(s.M) * s.N * 2);
    MK_CUDA_CHECK(cudaMalloc(&d_bad, 2 * sizeof(unsigned long long)));
    return OkStatus();
  }
  ~Case() {
    if (op) {
      Status st = op->destroy();
      if (!st.ok()) ADD_FAILURE() << st.to_string();
    }
    cudaFree(d_bad);
  }

  // Inputs of call `call` (this rank's) and the reference output, on `st`.
  Status prepare(uint64_t call, cudaStream_t st) {
    const int W = comm->world(), me = comm->rank();
    const int64_t M = s.M, N = s.N, K = s.K, Ms = M / W;
    if (kind == FusedKind::kAgGemm) {
      // Rank r's shard: rows [r Ms, (r+1) Ms) of one [M, K] tag matrix "rank 0, which 0"; B per rank.
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A->bf(), Ms, K, K, seed, 0, 0, call, K, me * Ms);
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A_ref->bf(), M, K, K, seed, 0, 0, call, K, 0);
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(B->bf(), N, K, K, seed, me, 1, call, K, 0);
      gemm::Arguments g;
      g.A = A_ref->p;
      g.B = B->p;
      g.C = C_ref->p;
      g.M = M, g.N = N, g.K = K;
      MK_CHECK(gemm::run(g, st));
    } else {
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A->bf(), M, K, K, seed, me, 0, call, K, 0);
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(B->bf(), N, K, K, seed, me, 1, call, K, 0);
      for (int r = 0; r < W; ++r) {  // [A_0 | A_1 | ...] and [B_0 | B_1 | ...]
        fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A_ref->bf() + r * K, M, K, W * K, seed, r, 0, call, K, 0);
        fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(B_ref->bf() + r * K, N, K, W * K, seed, r, 1, call, K, 0);
      }
      gemm::Arguments g;
      g.A = A_ref->p;
      g.B = B_ref->p;
      g.C = C_ref->p;
      g.M = M, g.N = N, g.K = W * K;
      MK_CHECK(gemm::run(g, st));
    }
    poison<<<kFillGrid, kFillBlock, 0, st>>>(static_cast<uint16_t*>(C->p), c_elems);
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  }
  ops::FusedArgs args() const {
    ops::FusedArgs a;
    a.A = A->p;
    a.B = B->p;
    a.C = C->p;
    return a;
  }
  // Mismatching elements of C against the reference (RS: this rank's rows of it).
  Status check(cudaStream_t st, unsigned long long* bad, unsigned long long* first) {
    const int64_t row0 = kind == FusedKind::kGemmRs ? comm->rank() * (s.M / comm->world()) : 0;
    unsigned long long init[2] = {0, ~0ull};
    MK_CUDA_CHECK(cudaMemcpyAsync(d_bad, init, sizeof(init), cudaMemcpyHostToDevice, st));
    compare<<<kFillGrid, kFillBlock, 0, st>>>(static_cast<const uint16_t*>(C->p),
                                              static_cast<const uint16_t*>(C_ref->p) + row0 * s.N, c_elems, d_bad,
                                              d_bad + 1);
    unsigned long long h[2];
    MK_CUDA_CHECK(cudaMemcpyAsync(h, d_bad, sizeof(h), cudaMemcpyDeviceToHost, st));
    MK_CHECK(comm->sync(st));
    *bad = h[0];
    *first = h[1];
    return OkStatus();
  }
};

class Fused : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = shared_comm();
    ASSERT_NE(comm, nullptr);
  }
  // `calls` calls with fresh data, each checked.
  void run_calls(FusedKind kind, ops::PlanShape s, bool det, int calls, int comm_ctas = -1) {
    Case c{comm, kind, s, det};
    MK_ASSERT_OK(c.init(comm_ctas));
    cudaStream_t st = comm->stream();
    for (int call = 0; call < calls; ++call) {
      MK_ASSERT_OK(c.prepare(call, st));
      MK_ASSERT_OK(comm->sync(st));
      MK_ASSERT_OK(c.op->run(c.args(), st));
      MK_ASSERT_OK(comm->sync(st));
      unsigned long long bad = 0, first = 0;
      MK_ASSERT_OK(c.check(st, &bad, &first));
      ASSERT_EQ(bad, 0ull) << ops::fused_kind_name(kind) << " M " << s.M << " N " << s.N << " K " << s.K
                           << (det ? " deterministic" : "") << " rank " << comm->rank() << " call " << call
                           << ": " << bad << " of " << c.c_elems << " elements wrong, first at " << first
                           << " (row " << first / s.N << ", col " << first % s.N << ")";
    }
  }
  Communicator* comm = nullptr;
};

// Shapes: M a multiple of W but not of the tile, shards smaller and larger than a tile-row,
// N not a multiple of 256.
std::vector<ops::PlanShape> shapes(int W) {
  return {{int64_t(W) * 250, 520, 264}, {int64_t(W) * 96, 264, 136}, {2048, 1024, 512}};
}

TEST_F(Fused, AgGemmMatchesReference) {
  for (auto s : shapes(comm->world())) run_calls(FusedKind::kAgGemm, s, false, 3);
}
TEST_F(Fused, GemmRsMatchesReference) {
  for (auto s : shapes(comm->world())) run_calls(FusedKind::kGemmRs, s, false, 3);
}
TEST_F(Fused, GemmRsDeterministicMatchesReference) {
  for (auto s : shapes(comm->world())) run_calls(FusedKind::kGemmRs, s, true, 2);
}
TEST_F(Fused, GemmArMatchesReference) {
  for (auto s : shapes(comm->world())) run_calls(FusedKind::kGemmAr, s, false, 3);
}
TEST_F(Fused, GemmArDeterministicMatchesReference) {
  for (auto s : shapes(comm->world())) run_calls(FusedKind::kGemmAr, s, true, 2);
}
TEST_F(Fused, OneAndManyCommCtas) {
  for (int cc : {1, 16}) {
    run_calls(FusedKind::kAgGemm, {int64_t(comm->world()) * 256, 512, 256}, false, 2, cc);
    run_calls(FusedKind::kGemmAr, {int64_t(comm->world()) * 256, 512, 256}, false, 2, cc);
  }
}

// Each operator captured once in a CUDA graph and replayed 20 times, fresh data each replay.
TEST_F(Fused, GraphReplays) {
  for (FusedKind kind : {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr}) {
    Case c{comm, kind, {int64_t(comm->world()) * 192, 776, 200}, false};
    MK_ASSERT_OK(c.init());
    cudaStream_t st = comm->stream();
    MK_ASSERT_OK(c.prepare(0, st));
    MK_ASSERT_OK(c.op->run(c.args(), st));  // checked first call (agrees on the arguments)
    MK_ASSERT_OK(comm->sync(st));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    MK_ASSERT_OK(c.op->enqueue(c.args(), st));
    ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int rep = 1; rep <= 20; ++rep) {
      MK_ASSERT_OK(c.prepare(rep, st));
      MK_ASSERT_OK(comm->sync(st));
      MK_ASSERT_OK(comm->bootstrap().barrier());  // every rank's inputs are ready
      ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
      MK_ASSERT_OK(comm->sync(st));
      unsigned long long bad = 0, first = 0;
      MK_ASSERT_OK(c.check(st, &bad, &first));
      ASSERT_EQ(bad, 0ull) << ops::fused_kind_name(kind) << " replay " << rep << " rank " << comm->rank()
                           << ": first wrong element " << first;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// The traced fused kernel: every tile computed once, every communication op run once, on one
// timeline with sane stamps; the result is still exact. MK_TRACE_OUT=prefix writes each rank's
// timeline as prefix.<rank>.json (Chrome/Perfetto; tools/trace_png.py draws it).
TEST_F(Fused, TraceRecordsTilesAndOps) {
  if (comm->world() < 2) GTEST_SKIP() << "one rank runs the plain GEMM (nothing to communicate)";
  for (FusedKind kind : {FusedKind::kGemmRs, FusedKind::kAgGemm}) {
    const ops::PlanShape shape{int64_t(comm->world()) * 512, 2048, 1024};
    Case c{comm, kind, shape, false};
    MK_ASSERT_OK(c.init());
    TraceRecorder rec;
    const auto& plan = c.op->plan();
    const int tiles = plan.tiles_m * plan.tiles_n;
    const int n_ops = int(plan.ranks[comm->rank()].ops.size());
    MK_ASSERT_OK(TraceRecorder::create(uint32_t(4 * tiles + n_ops + 64), &rec));
    cudaStream_t st = comm->stream();
    MK_ASSERT_OK(c.prepare(0, st));
    ops::FusedArgs a = c.args();
    a.trace = rec.device();
    MK_ASSERT_OK(c.op->run(a, st));
    MK_ASSERT_OK(comm->sync(st));
    unsigned long long bad = 0, first = 0;
    MK_ASSERT_OK(c.check(st, &bad, &first));
    ASSERT_EQ(bad, 0ull) << "traced " << ops::fused_kind_name(kind);
    std::vector<TraceEvent> ev;
    uint64_t dropped = 0;
    MK_ASSERT_OK(rec.fetch(&ev, &dropped));
    EXPECT_EQ(dropped, 0u);
    std::vector<int> computed(tiles, 0), loaded(tiles, 0), ran(n_ops, 0);
    for (const auto& e : ev) {
      EXPECT_LE(e.t0_ns, e.t1_ns);
      if (e.role == uint32_t(Role::kCompute)) ++computed.at(e.item);
      else if (e.role == uint32_t(Role::kLoad)) ++loaded.at(e.item);
      else if (e.role == uint32_t(Role::kComm) || e.role == uint32_t(Role::kNetSend)) ++ran.at(e.item);
      else ADD_FAILURE() << "unexpected role " << e.role;
    }
    for (int t = 0; t < tiles; ++t) EXPECT_EQ(computed[t], 1) << "tile " << t;
    for (int t = 0; t < tiles; ++t) EXPECT_EQ(loaded[t], 1) << "tile " << t;
    for (int o = 0; o < n_ops; ++o) EXPECT_EQ(ran[o], 1) << "op " << o << ": " << plan.ranks[comm->rank()].ops[o].what;
    if (const char* out = getenv("MK_TRACE_OUT")) {
      const std::string path = std::string(out) + "." + ops::fused_kind_name(kind) + "." +
                               std::to_string(comm->rank()) + ".json";
      MK_ASSERT_OK(write_chrome_trace(ev, path));
    }
  }
}

// Bad input is the same clear error on every rank.
TEST_F(Fused, BadInputIsRejectedOnEveryRank) {
  const int W = comm->world();
  std::unique_ptr<FusedGemm> op;
  // Uneven shards.
  Status s = FusedGemm::create(comm, FusedKind::kGemmRs, {int64_t(W) * 128 + 1, 256, 256}, {}, &op);
  if (W > 1) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("equal shards"), std::string::npos) << s.to_string();
  }
  // Shapes that differ across ranks.
  s = FusedGemm::create(comm, FusedKind::kAgGemm, {int64_t(W) * 128, 256 + 8 * (comm->rank() == W - 1), 256}, {}, &op);
  if (W > 1) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("disagree"), std::string::npos) << s.to_string();
  }
  // dtype mismatch and a misaligned pointer on one rank only: every rank gets the error.
  MK_ASSERT_OK(FusedGemm::create(comm, FusedKind::kGemmAr, {int64_t(W) * 128, 256, 256}, {}, &op));
  DevBuf A(size_t(W) * 128 * 256 * 2 + 16), B(256 * 256 * 2), C(size_t(W) * 128 * 256 * 2);
  ops::FusedArgs a;
  a.A = A.p;
  a.B = B.p;
  a.C = C.p;
  if (comm->rank() == 0) a.c_type = gemm::DType::kF32;
  s = op->run(a, comm->stream());
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("bf16"), std::string::npos) << s.to_string();
  a.c_type = gemm::DType::kBF16;
  if (comm->rank() == W - 1) a.A = static_cast<char*>(A.p) + 2;
  s = op->run(a, comm->stream());
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("aligned"), std::string::npos) << s.to_string();
  MK_ASSERT_OK(op->destroy());
}

}  // namespace
}  // namespace test
}  // namespace mk
