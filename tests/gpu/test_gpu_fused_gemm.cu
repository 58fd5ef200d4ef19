// The fused GEMM collectives (ops/fused.h) on ranks as processes under MPS: W = 1, 2, 4 on one
// node and 2 emulated nodes x 2 over libfabric (shm, tcp; host-staged).
//
// Data: small rank-tagged integers in bf16 (every product and every cross-rank sum exact in
// fp32), fresh per call, from the run seed. Reference, independent of the library's GEMM (at
// W = 1 the operator *is* that GEMM): a plain shared-memory GEMM kernel in this file over inputs
// every rank rebuilds from the tags — AG: the gathered A; RS/AR: sum_r A_r·B_rᵀ as one product
// over the concatenated K — itself checked against the host (double) at sampled elements of
// every call. The fused result must match it bit for bit, every element, with C poisoned
// before each call. Graph replays: 200 calls back to back with no host barrier between them,
// the inputs advanced by a kernel inside the graph, every replay's output checked inside it.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/tunables.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "mkernel/gemm/gemm.h"
#include "mkernel/ops/fused.h"
#include "src/ops/fused_gemm/fused_gemm_testing.h"
#include "src/ops/fused_gemm/fused_gemm_plan.h"
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

// dst[r, c] (row stride ld) = tag of rank `rank`'s matrix at (r + row0, c + col0) of a [., cols]
// matrix, in call `*call_at` if call_at is set (graph replays: a counter on the device), else `call`.
__global__ void fill_tag(__nv_bfloat16* dst, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank,
                         int which, uint64_t call, int64_t src_cols, int64_t row0, const uint64_t* call_at) {
  const int64_t n = rows * cols;
  const uint64_t e = call_at ? *call_at : call;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld + c] = __float2bfloat16(tag_value(seed, rank, which, e, uint64_t(r + row0) * src_cols + c));
  }
}
__global__ void poison(uint16_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 0x7fc1;  // a NaN
}
// Counts mismatching elements into bad[0] and the first index into bad[1]; with a replay
// counter, bad[2] counts the compares that ran and bad[1] holds (replay << 32 | index).
__global__ void compare(const uint16_t* got, const uint16_t* want, int64_t n, unsigned long long* bad,
                        const uint64_t* replay_at) {
  const unsigned long long rep = replay_at ? (static_cast<unsigned long long>(*replay_at) << 32) : 0ull;
  if (replay_at && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(bad + 2, 1ull);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (got[i] != want[i]) {
      atomicAdd(bad, 1ull);
      atomicMin(bad + 1, rep | static_cast<unsigned long long>(i));
    }
}
__global__ void bump(uint64_t* counter) { ++*counter; }

// The reference: C[M, N] = A[M, K] · B[N, K]ᵀ in fp32 (exact on the tagged integers: |C| <=
// 4 K < 2^24), rounded to bf16 once. 16x16 output tiles through shared memory.
constexpr int kRefTile = 16;
__global__ void reference_gemm(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, int64_t M,
                               int64_t N, int64_t K) {
  __shared__ float as[kRefTile][kRefTile + 1], bs[kRefTile][kRefTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m = int64_t(blockIdx.y) * kRefTile + ty, n = int64_t(blockIdx.x) * kRefTile + tx;
  const int64_t nb = int64_t(blockIdx.x) * kRefTile + ty;  // B row this thread loads
  float acc = 0.f;
  for (int64_t k0 = 0; k0 < K; k0 += kRefTile) {
    as[ty][tx] = m < M && k0 + tx < K ? __bfloat162float(A[m * K + k0 + tx]) : 0.f;
    bs[ty][tx] = nb < N && k0 + tx < K ? __bfloat162float(B[nb * K + k0 + tx]) : 0.f;
    __syncthreads();
    for (int kk = 0; kk < kRefTile; ++kk) acc += as[ty][kk] * bs[tx][kk];
    __syncthreads();
  }
  if (m < M && n < N) C[m * N + n] = __float2bfloat16(acc);
}
void launch_reference(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, cudaStream_t st) {
  const dim3 grid(unsigned((N + kRefTile - 1) / kRefTile), unsigned((M + kRefTile - 1) / kRefTile));
  reference_gemm<<<grid, dim3(kRefTile, kRefTile), 0, st>>>(static_cast<const __nv_bfloat16*>(A),
                                                             static_cast<const __nv_bfloat16*>(B),
                                                             static_cast<__nv_bfloat16*>(C), M, N, K);
}
uint16_t bf16_bits(float f) {
  const __nv_bfloat16 h = __float2bfloat16(f);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
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
  unsigned long long* d_bad = nullptr;  // [3]: see compare()
  uint64_t* d_call = nullptr;           // graph replays: the call whose inputs the graph builds
  int64_t a_rows = 0, c_rows = 0, c_elems = 0;
  int64_t my_row0 = 0, my_rows = 0;  // this rank's shard (PlanShape::rows, or M / W rows)
  std::string path;  // FusedOptions::path ("": the tunable)

  Status init(int comm_ctas = -1) {
    const int W = comm->world();
    ops::FusedOptions o;
    o.deterministic = deterministic;
    o.comm_ctas = comm_ctas;
    o.path = path;
    MK_CHECK(FusedGemm::create(comm, kind, s, o, &op));
    my_rows = s.M / W, my_row0 = comm->rank() * my_rows;
    if (!s.rows.empty()) {
      my_row0 = 0;
      for (int q = 0; q < comm->rank(); ++q) my_row0 += s.rows[size_t(q)];
      my_rows = s.rows[size_t(comm->rank())];
    }
    a_rows = kind == FusedKind::kAgGemm ? my_rows : s.M;
    c_rows = kind == FusedKind::kGemmRs ? my_rows : s.M;
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
    MK_CUDA_CHECK(cudaMalloc(&d_bad, 3 * sizeof(unsigned long long)));
    MK_CUDA_CHECK(cudaMalloc(&d_call, sizeof(uint64_t)));
    return OkStatus();
  }
  ~Case() {
    if (op) {
      Status st = op->destroy();
      if (!st.ok()) ADD_FAILURE() << st.to_string();
    }
    cudaFree(d_bad);
    cudaFree(d_call);
  }

  // Inputs of call `call` (this rank's; call_at: read the call from there instead) and the
  // reference output, on `st`; C poisoned. Capturable.
  Status prepare(uint64_t call, cudaStream_t st, const uint64_t* call_at = nullptr) {
    const int W = comm->world(), me = comm->rank();
    const int64_t M = s.M, N = s.N, K = s.K;
    if (kind == FusedKind::kAgGemm) {
      // Rank r's shard: its rows [row0_r, row0_r + rows_r) of one [M, K] tag matrix "rank 0,
      // which 0"; B per rank.
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A->bf(), my_rows, K, K, seed, 0, 0, call, K, my_row0, call_at);
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A_ref->bf(), M, K, K, seed, 0, 0, call, K, 0, call_at);
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(B->bf(), N, K, K, seed, me, 1, call, K, 0, call_at);
      launch_reference(A_ref->p, B->p, C_ref->p, M, N, K, st);
    } else {
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A->bf(), M, K, K, seed, me, 0, call, K, 0, call_at);
      fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(B->bf(), N, K, K, seed, me, 1, call, K, 0, call_at);
      for (int r = 0; r < W; ++r) {  // [A_0 | A_1 | ...] and [B_0 | B_1 | ...]
        fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(A_ref->bf() + r * K, M, K, W * K, seed, r, 0, call, K, 0, call_at);
        fill_tag<<<kFillGrid, kFillBlock, 0, st>>>(B_ref->bf() + r * K, N, K, W * K, seed, r, 1, call, K, 0, call_at);
      }
      launch_reference(A_ref->p, B_ref->p, C_ref->p, M, N, W * K, st);
    }
    poison<<<kFillGrid, kFillBlock, 0, st>>>(static_cast<uint16_t*>(C->p), c_elems);
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  }
  // The reference kernel's output of call `call` (prepared and synchronized) at `samples`
  // random elements against the host's sum in double: the number that differ.
  Status check_reference(uint64_t call, int samples, int* wrong, std::string* first) {
    const int W = comm->world(), me = comm->rank();
    std::vector<uint16_t> ref(size_t(s.M) * s.N);
    MK_CUDA_CHECK(cudaMemcpy(ref.data(), C_ref->p, ref.size() * 2, cudaMemcpyDeviceToHost));
    std::mt19937_64 rng(mix(seed, call * 1000003ull + uint64_t(me)));
    *wrong = 0;
    for (int i = 0; i < samples; ++i) {
      const int64_t m = int64_t(rng() % uint64_t(s.M)), n = int64_t(rng() % uint64_t(s.N));
      double want = 0;
      if (kind == FusedKind::kAgGemm) {
        for (int64_t k = 0; k < s.K; ++k)
          want += double(tag_value(seed, 0, 0, call, uint64_t(m * s.K + k))) *
                  tag_value(seed, me, 1, call, uint64_t(n * s.K + k));
      } else {
        for (int r = 0; r < W; ++r)
          for (int64_t k = 0; k < s.K; ++k)
            want += double(tag_value(seed, r, 0, call, uint64_t(m * s.K + k))) *
                    tag_value(seed, r, 1, call, uint64_t(n * s.K + k));
      }
      if (ref[m * s.N + n] != bf16_bits(float(want)) && (*wrong)++ == 0)
        *first = "reference C[" + std::to_string(m) + "][" + std::to_string(n) + "] is not " + std::to_string(want);
    }
    return OkStatus();
  }
  // Call `call` (fresh inputs) traced into a buffer of `capacity` events, then C checked: the
  // events, how many did not fit, C's mismatches and the first one.
  Status traced_call(uint64_t call, uint32_t capacity, std::vector<TraceEvent>* ev, uint64_t* dropped,
                     unsigned long long* bad, unsigned long long* first) {
    cudaStream_t st = comm->stream();
    TraceRecorder rec;
    MK_CHECK(TraceRecorder::create(capacity, &rec));
    MK_CHECK(prepare(call, st));
    ops::FusedArgs a = args();
    a.trace = rec.device();
    MK_CHECK(op->run(a, st));
    MK_CHECK(comm->sync(st));
    MK_CHECK(check(st, bad, first));
    return rec.fetch(ev, dropped);
  }
  ops::FusedArgs args() const {
    ops::FusedArgs a;
    a.A = A->p;
    a.B = B->p;
    a.C = C->p;
    return a;
  }
  // Enqueues the comparison of C against the reference (RS: this rank's rows of it) into d_bad.
  void enqueue_compare(cudaStream_t st, const uint64_t* replay_at = nullptr) {
    const int64_t row0 = kind == FusedKind::kGemmRs ? my_row0 : 0;
    compare<<<kFillGrid, kFillBlock, 0, st>>>(static_cast<const uint16_t*>(C->p),
                                              static_cast<const uint16_t*>(C_ref->p) + row0 * s.N, c_elems, d_bad,
                                              replay_at);
  }
  Status reset_bad(cudaStream_t st) {
    const unsigned long long init[3] = {0, ~0ull, 0};
    MK_CUDA_CHECK(cudaMemcpyAsync(d_bad, init, sizeof(init), cudaMemcpyHostToDevice, st));
    return comm->sync(st);
  }
  // Mismatching elements of C against the reference: h[0] count, h[1] first, h[2] compares run.
  Status take_bad(cudaStream_t st, unsigned long long h[3]) {
    MK_CUDA_CHECK(cudaMemcpyAsync(h, d_bad, 3 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, st));
    return comm->sync(st);
  }
  Status check(cudaStream_t st, unsigned long long* bad, unsigned long long* first) {
    MK_CHECK(reset_bad(st));
    enqueue_compare(st);
    unsigned long long h[3];
    MK_CHECK(take_bad(st, h));
    *bad = h[0];
    *first = h[1];
    return OkStatus();
  }
};

constexpr int kRefSamples = 64;  // host-checked elements of the reference, per call

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
    // With the controller on: it ran (a call set its settled split) and kept the count in range.
    struct AfterCalls {
      Case& c;
      ~AfterCalls() {
        if (::testing::Test::HasFailure() || !c.op->split_controlled()) return;
        ops::SplitReadout r;
        MK_EXPECT_OK(ops::FusedGemmTesting::split_state(c.op.get(), &r, c.comm->stream()));
        EXPECT_EQ(r.has_mean, 1) << "the controller never ran";
        EXPECT_GE(r.last_mean, 1);
        EXPECT_GE(c.op->comm_ctas(), 1);
        // Every stalled load that entered the gauge left it; the interval follows the samples'
        // measured cost (split_interval_ns), never below the floor.
        EXPECT_EQ(r.stalled, 0);
        EXPECT_GE(r.sample_ns, 0);
        EXPECT_GE(r.gap_ns, ops::SplitController::kIntervalNs);
        printf("[ controller ] settled at %d, a sample costs %lld ns, interval %lld ns\n", r.last_mean,
               static_cast<long long>(r.sample_ns), static_cast<long long>(r.gap_ns));
      }
    } after{c};
    cudaStream_t st = comm->stream();
    for (int call = 0; call < calls; ++call) {
      MK_ASSERT_OK(c.prepare(call, st));
      MK_ASSERT_OK(comm->sync(st));
      int wrong = 0;
      std::string first_ref;
      MK_ASSERT_OK(c.check_reference(call, kRefSamples, &wrong, &first_ref));
      ASSERT_EQ(wrong, 0) << "the reference kernel is wrong: " << first_ref;
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
  struct GraphKind {
    FusedKind kind;
    bool det;
  };
  // One operator captured in a graph and replayed `replays` times back to back (see below).
  void graph_replays(GraphKind k, int replays) {
    const char* name = ops::fused_kind_name(k.kind);
    Case c{comm, k.kind, {int64_t(comm->world()) * 192, 776, 200}, k.det};
    MK_ASSERT_OK(c.init());
    cudaStream_t st = comm->stream();
    MK_ASSERT_OK(c.prepare(0, st));
    MK_ASSERT_OK(c.op->run(c.args(), st));  // checked first call (agrees on the arguments)
    MK_ASSERT_OK(comm->sync(st));
    unsigned long long bad = 0, first = 0;
    MK_ASSERT_OK(c.check(st, &bad, &first));
    ASSERT_EQ(bad, 0ull) << name << " first call, rank " << comm->rank() << ": first wrong element " << first;
    // Calls 1..replays: the graph bumps the counter (0 now) first.
    ASSERT_EQ(cudaMemsetAsync(c.d_call, 0, sizeof(uint64_t), st), cudaSuccess);
    MK_ASSERT_OK(c.reset_bad(st));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    bump<<<1, 1, 0, st>>>(c.d_call);
    Status cap = c.prepare(0, st, c.d_call);
    if (cap.ok()) cap = c.op->enqueue(c.args(), st);
    if (cap.ok()) c.enqueue_compare(st, c.d_call);
    ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
    MK_ASSERT_OK(cap);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    MK_ASSERT_OK(comm->bootstrap().barrier());  // the last barrier: every rank's graph is ready
    for (int rep = 0; rep < replays; ++rep) ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    MK_ASSERT_OK(comm->sync(st));
    unsigned long long h[3];
    MK_ASSERT_OK(c.take_bad(st, h));
    uint64_t calls = 0;
    ASSERT_EQ(cudaMemcpy(&calls, c.d_call, sizeof(calls), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(calls, uint64_t(replays)) << name << ": replays that ran";
    EXPECT_EQ(h[2], uint64_t(replays)) << name << ": replays compared";
    EXPECT_EQ(h[0], 0ull) << name << (k.det ? " deterministic" : "") << " rank " << comm->rank() << ": " << h[0]
                          << " wrong elements over " << replays << " replays, the first in call "
                          << (h[1] >> 32) << " at element " << (h[1] & 0xffffffffull) << " of " << c.c_elems;
    // The graph's last reference (call replays) on the host; and the final C once more.
    int wrong = 0;
    std::string first_ref;
    MK_ASSERT_OK(c.check_reference(replays, kRefSamples, &wrong, &first_ref));
    EXPECT_EQ(wrong, 0) << "the reference kernel is wrong: " << first_ref;
    MK_ASSERT_OK(c.check(st, &bad, &first));
    EXPECT_EQ(bad, 0ull) << name << ": the last replay's C";
    if (c.op->split_controlled()) {
      ops::SplitReadout r;
      MK_EXPECT_OK(ops::FusedGemmTesting::split_state(c.op.get(), &r, st));
      EXPECT_EQ(r.has_mean, 1) << name << ": the controller never ran in the replays";
      EXPECT_EQ(r.stalled, 0) << name << ": the stalled gauge did not return to zero";
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    MK_ASSERT_OK(comm->bootstrap().barrier());
  }
  Communicator* comm = nullptr;
};

// Shapes: M a multiple of W but not of the tile, shards smaller and larger than a tile-row,
// N not a multiple of 256; and one larger shape (left out under MK_TEST_SMALL).
std::vector<ops::PlanShape> shapes(int W) {
  std::vector<ops::PlanShape> s = {{int64_t(W) * 250, 520, 264}, {int64_t(W) * 96, 264, 136}};
  if (!small_shapes()) s.push_back({2048, 1024, 512});
  return s;
}

// Uneven shards (PlanShape::rows): shards of 1 to a few hundred rows, inside one tile-row or
// straddling several, one large among small ones; AR on an M the ranks do not divide (its own
// split). Every kind, both reductions.
std::vector<ops::PlanShape> uneven_shapes(int W) {
  std::vector<int64_t> mixed, lopsided;
  for (int s = 0; s < W; ++s) {
    mixed.push_back(s == W - 1 ? 1 : 37 + 61 * s);
    lopsided.push_back(s == W / 2 ? 300 : 5 + 3 * s);
  }
  auto sum = [](const std::vector<int64_t>& v) {
    int64_t t = 0;
    for (int64_t x : v) t += x;
    return t;
  };
  return {ops::PlanShape(sum(mixed), 520, 264, mixed), ops::PlanShape(sum(lopsided), 264, 136, lopsided)};
}
TEST_F(Fused, UnevenShardsMatchReference) {
  const int W = comm->world();
  for (const ops::PlanShape& s : uneven_shapes(W)) {
    run_calls(FusedKind::kAgGemm, s, false, 2);
    run_calls(FusedKind::kGemmRs, s, false, 2);
    run_calls(FusedKind::kGemmRs, s, true, 2);
    run_calls(FusedKind::kGemmAr, s, false, 2);
  }
  // AR on any M: its own split (the first M mod W ranks one row more).
  run_calls(FusedKind::kGemmAr, {int64_t(W) * 250 + W - 1, 520, 264}, false, 2);
  run_calls(FusedKind::kGemmAr, {int64_t(W) * 250 + W - 1, 520, 264}, true, 2);
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

// Each operator captured once in a CUDA graph — a kernel advancing the call counter, the fills
// of this call's inputs and reference, the poisoning of C, the fused call and the comparison —
// and replayed kGraphReplays times back to back on every rank with no host barrier between
// replays (ranks drift apart by whole calls; the operator's epochs must keep them apart). Every
// replay's output is compared with its reference inside the graph; afterwards the counts say
// how many replays ran, compared and failed (the first failing replay and element), and the
// last call's reference is checked on the host.
constexpr int kGraphReplays = 200;

TEST_F(Fused, GraphReplaysBackToBack) {
  for (GraphKind k : {GraphKind{FusedKind::kAgGemm, false}, GraphKind{FusedKind::kGemmRs, false},
                      GraphKind{FusedKind::kGemmAr, false}, GraphKind{FusedKind::kGemmAr, true}}) {
    graph_replays(k, kGraphReplays);
    if (HasFatalFailure()) return;  // not into the next kind's collectives
  }
}

// The traced fused kernel: every tile computed once, every communication op run once, every CTA's
// span once (holding its items), every wait that spun naming a rank of the world and lying inside
// its CTA's span, on one timeline with sane stamps; the result is still exact (at W = 1, where the plain GEMM runs and
// records nothing, only that). MK_TRACE_OUT=prefix writes each rank's timeline as
// prefix.<rank>.json (Chrome/Perfetto; tools/trace_png.py draws it).
TEST_F(Fused, TraceRecordsTilesAndOps) {
  const bool one = comm->world() == 1;  // one rank runs the plain GEMM: no timeline, still exact
  for (FusedKind kind : {FusedKind::kGemmRs, FusedKind::kAgGemm}) {
    const ops::PlanShape shape{int64_t(comm->world()) * 512, 2048, 1024};
    Case c{comm, kind, shape, false};
    MK_ASSERT_OK(c.init());
    const auto& plan = ops::FusedGemmTesting::plan(*c.op);
    const int tiles = plan.tiles_m * plan.tiles_n;
    const int n_ops = int(plan.ranks[comm->rank()].ops.size());
    std::vector<TraceEvent> ev;
    uint64_t dropped = 0;
    unsigned long long bad = 0, first = 0;
    // Room for the tiles' three events, the ops, the CTAs and any number of spinning waits the
    // test could plausibly see (a drop fails the test).
    MK_ASSERT_OK(c.traced_call(0, uint32_t(8 * tiles + n_ops + 65536), &ev, &dropped, &bad, &first));
    ASSERT_EQ(bad, 0ull) << "traced " << ops::fused_kind_name(kind);
    if (one) continue;  // FusedArgs::trace records only where the fused kernel runs (W > 1)
    EXPECT_EQ(dropped, 0u);
    std::vector<int> computed(tiles, 0), epilogues(tiles, 0), loaded(tiles, 0), ran(n_ops, 0);
    std::map<uint32_t, std::pair<uint64_t, uint64_t>> cta_span;  // CTA -> its kCta event
    for (const auto& e : ev)
      if (e.role == uint32_t(Role::kCta)) {
        EXPECT_EQ(e.item, -1);
        EXPECT_TRUE(cta_span.emplace(e.cta, std::make_pair(e.t0_ns, e.t1_ns)).second) << "CTA " << e.cta << " twice";
      }
    EXPECT_GE(cta_span.size(), 2u) << "a fused launch has at least two CTAs";
    int spins = 0;
    for (const auto& e : ev) {
      EXPECT_LE(e.t0_ns, e.t1_ns);
      const auto span = cta_span.find(e.cta);
      if (span == cta_span.end()) {
        ADD_FAILURE() << "an event of CTA " << e.cta << " that recorded no span (role " << e.role << ")";
      } else if ((e.role & 0xffu) != uint32_t(Role::kLoad)) {  // the producer may finish after the consumers
        EXPECT_GE(e.t0_ns, span->second.first) << "role " << e.role << " item " << e.item;
        EXPECT_LE(e.t1_ns, span->second.second) << "role " << e.role << " item " << e.item;
      }
      if ((e.role & 0xffu) == uint32_t(Role::kSpin)) {
        const int peer = int(e.role >> 8) - 1;
        EXPECT_TRUE(peer >= -1 && peer < comm->world()) << "a spinning wait on rank " << peer;
        ++spins;
        continue;
      }
      if (e.role == uint32_t(Role::kCta)) continue;
      if (e.role == uint32_t(Role::kCompute)) ++computed.at(e.item);
      else if (e.role == uint32_t(Role::kEpilogue)) ++epilogues.at(e.item);
      else if (e.role == uint32_t(Role::kLoad)) ++loaded.at(e.item);
      else if (e.role == uint32_t(Role::kComm) || e.role == uint32_t(Role::kNetSend)) ++ran.at(e.item);
      else if (e.role == uint32_t(Role::kController)) EXPECT_GE(e.item, 1) << "a switch to no communication CTA";
      else ADD_FAILURE() << "unexpected role " << e.role;
    }
    for (int t = 0; t < tiles; ++t) EXPECT_EQ(computed[t], 1) << "tile " << t;
    for (int t = 0; t < tiles; ++t) EXPECT_EQ(epilogues[t], 1) << "tile " << t;
    for (int t = 0; t < tiles; ++t) EXPECT_EQ(loaded[t], 1) << "tile " << t;
    for (int o = 0; o < n_ops; ++o) EXPECT_EQ(ran[o], 1) << "op " << o << ": " << plan.ranks[comm->rank()].ops[o].what;
    printf("[rank %d] traced %s: %zu CTAs, %d waits spun\n", comm->rank(), ops::fused_kind_name(kind), cta_span.size(),
           spins);
    if (const char* out = getenv("MK_TRACE_OUT")) {
      const std::string path = std::string(out) + "." + ops::fused_kind_name(kind) + "." +
                               std::to_string(comm->rank()) + ".json";
      MK_ASSERT_OK(write_chrome_trace(ev, path));
    }
  }
}

// ---- the SM-partition controller (fused_split=auto) ----

// Every operator with the controller on, the unit's shapes, several calls each (each call
// starts where the last settled): exact, and the controller is on wherever there is traffic.
TEST_F(Fused, ControllerMatchesReference) {
  ScopedTunable auto_split("fused_split", "auto");
  struct K {
    FusedKind kind;
    bool det;
  };
  for (K k : {K{FusedKind::kAgGemm, false}, K{FusedKind::kGemmRs, false}, K{FusedKind::kGemmRs, true},
              K{FusedKind::kGemmAr, false}, K{FusedKind::kGemmAr, true}}) {
    for (auto s : shapes(comm->world())) {
      run_calls(k.kind, s, k.det, 3);
      if (HasFatalFailure()) return;
    }
    Case c{comm, k.kind, shapes(comm->world())[0], k.det};
    MK_ASSERT_OK(c.init());
    EXPECT_EQ(c.op->split_controlled(), comm->world() > 1);
  }
  // A fixed count is an override: no controller.
  Case c{comm, FusedKind::kGemmRs, shapes(comm->world())[0], false};
  MK_ASSERT_OK(c.init(4));
  EXPECT_FALSE(c.op->split_controlled());
}

// Role switches forced at known points of each call — down to one communication CTA, up to
// 24, down to 2 — under the trace: the result stays exact, the switches are on the timeline in
// order, and every tile and op still runs once.
TEST_F(Fused, ForcedRoleSwitchesMidCall) {
  if (comm->world() == 1) GTEST_SKIP() << "one rank: no communication, no controller";
  ScopedTunable auto_split("fused_split", "auto");
  for (FusedKind kind : {FusedKind::kGemmRs, FusedKind::kAgGemm, FusedKind::kGemmAr}) {
    const ops::PlanShape shape{int64_t(comm->world()) * 1024, 4096, 512};
    Case c{comm, kind, shape, false};
    MK_ASSERT_OK(c.init());
    ASSERT_TRUE(c.op->split_controlled());
    const auto& plan = ops::FusedGemmTesting::plan(*c.op);
    const int tiles = plan.tiles_m * plan.tiles_n;
    const int n_ops = int(plan.ranks[comm->rank()].ops.size());
    // The controller's ceiling on this grid (fused_begin): min(grid - 1, max(32, grid / 2)).
    int resident = 0;
    MK_ASSERT_OK(gemm::persistent_ctas(&resident));
    const int hi = std::min(resident - 1, std::max(32, resident / 2));
    const int at[3] = {tiles / 8, tiles / 3, (2 * tiles) / 3};
    const int to[3] = {1, std::min(24, hi), 2};
    cudaStream_t st = comm->stream();
    MK_ASSERT_OK(ops::FusedGemmTesting::force_splits(c.op.get(), at, to, 3, st));
    for (int call = 0; call < 3; ++call) {
      std::vector<TraceEvent> ev;
      uint64_t dropped = 0;
      unsigned long long bad = 0, first = 0;
      MK_ASSERT_OK(c.traced_call(call, uint32_t(4 * tiles + n_ops + 4096), &ev, &dropped, &bad, &first));
      ASSERT_EQ(bad, 0ull) << ops::fused_kind_name(kind) << " call " << call << " rank " << comm->rank()
                           << ": first wrong element " << first;
      EXPECT_EQ(dropped, 0u);
      std::sort(ev.begin(), ev.end(), [](const TraceEvent& x, const TraceEvent& y) { return x.t0_ns < y.t0_ns; });
      std::vector<int> switches, computed(tiles, 0), ran(n_ops, 0);
      for (const auto& e : ev) {
        if (e.role == uint32_t(Role::kController)) switches.push_back(e.item);
        else if (e.role == uint32_t(Role::kCompute)) ++computed.at(e.item);
        else if (e.role == uint32_t(Role::kComm) || e.role == uint32_t(Role::kNetSend)) ++ran.at(e.item);
      }
      for (int t = 0; t < tiles; ++t) ASSERT_EQ(computed[t], 1) << "tile " << t;
      for (int o = 0; o < n_ops; ++o) ASSERT_EQ(ran[o], 1) << "op " << o;
      // The forced counts appear in order among the switches (the rule may switch between them).
      size_t next = 0;
      for (int v : switches)
        if (next < 3 && v == to[next]) ++next;
      std::string seen;
      for (int v : switches) seen += std::to_string(v) + " ";
      EXPECT_EQ(next, 3u) << ops::fused_kind_name(kind) << " call " << call << " rank " << comm->rank()
                          << ": switches seen " << seen;
    }
    MK_ASSERT_OK(ops::FusedGemmTesting::force_splits(c.op.get(), nullptr, nullptr, 0, st));
  }
}

// The controller in CUDA graphs replayed back to back: it restarts each replay from the split
// the last one settled on, on the device.
TEST_F(Fused, ControllerGraphReplays) {
  ScopedTunable auto_split("fused_split", "auto");
  for (GraphKind k : {GraphKind{FusedKind::kAgGemm, false}, GraphKind{FusedKind::kGemmRs, false},
                      GraphKind{FusedKind::kGemmAr, true}}) {
    graph_replays(k, 50);
    if (HasFatalFailure()) return;
  }
}

// Host-side refusals of the forced-split hook, and a bad fused_split value.
TEST_F(Fused, ControllerRefusals) {
  {
    Case c{comm, FusedKind::kGemmRs, shapes(comm->world())[0], false};
    MK_ASSERT_OK(c.init(4));
    const int at[1] = {0}, to[1] = {2};
    EXPECT_EQ(ops::FusedGemmTesting::force_splits(c.op.get(), at, to, 1, comm->stream()).code(), Code::kInvalidArgument)
        << "controller off";
  }
  if (comm->world() > 1) {
    ScopedTunable auto_split("fused_split", "auto");
    Case c{comm, FusedKind::kGemmRs, shapes(comm->world())[0], false};
    MK_ASSERT_OK(c.init());
    const int at[2] = {10, 5}, to[2] = {2, 3}, zero[1] = {0};
    EXPECT_EQ(ops::FusedGemmTesting::force_splits(c.op.get(), at, to, 2, comm->stream()).code(), Code::kInvalidArgument)
        << "tiles not ascending";
    EXPECT_EQ(ops::FusedGemmTesting::force_splits(c.op.get(), at, zero, 1, comm->stream()).code(), Code::kInvalidArgument)
        << "count 0";
    EXPECT_EQ(ops::FusedGemmTesting::force_splits(c.op.get(), at, to, 5, comm->stream()).code(), Code::kInvalidArgument)
        << "too many";
  }
  // A bad split mode: refused by the API at once; from the environment (set after the
  // communicator was made), the operator's create names it on every rank.
  EXPECT_EQ(tunables::set("fused_split", "sometimes").code(), Code::kInvalidArgument);
  const char* before = getenv("MK_FUSED_SPLIT");
  const std::string kept = before ? before : "";
  ASSERT_EQ(setenv("MK_FUSED_SPLIT", "sometimes", 1), 0);
  std::unique_ptr<FusedGemm> op;
  Status s = FusedGemm::create(comm, FusedKind::kGemmRs, shapes(comm->world())[0], {}, &op);
  ASSERT_EQ(before ? setenv("MK_FUSED_SPLIT", kept.c_str(), 1) : unsetenv("MK_FUSED_SPLIT"), 0);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("MK_FUSED_SPLIT='sometimes'"), std::string::npos) << s.message();
}

// The unfused path (the GEMM, then the standalone collective) and policy auto (both paths
// timed, then one for good) against the same reference, every call. K = 64: each rank's product
// is an integer of magnitude at most 4 * 64 = 256, exact in bf16, so the unfused path's rounding
// of each rank's GEMM to bf16 before the sum changes nothing: bit for bit, as the fused path.
TEST_F(Fused, UnfusedAndAutoPathsMatchReference) {
  const int W = comm->world();
  cudaStream_t st = comm->stream();
  for (const char* path : {"unfused", "auto"})
    for (FusedKind k : {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr}) {
      Case c{comm, k, {int64_t(W) * 200, 264, 64}, false};
      c.path = path;
      MK_ASSERT_OK(c.init());
      // Auto: 1 warm-up and 5 timed calls of each path, then the decision; 16 calls cover both.
      for (int call = 0; call < 16; ++call) {
        MK_ASSERT_OK(c.prepare(call, st));
        MK_ASSERT_OK(c.op->run(c.args(), st));
        MK_ASSERT_OK(comm->sync(st));
        unsigned long long bad = 0, first = 0;
        MK_ASSERT_OK(c.check(st, &bad, &first));
        ASSERT_EQ(bad, 0ull) << path << " " << ops::fused_kind_name(k) << " rank " << comm->rank() << " call " << call
                             << " (" << c.op->path() << "): " << bad << " of " << c.c_elems
                             << " elements wrong, first at " << first;
      }
      const std::string said = c.op->path();
      if (W == 1) EXPECT_EQ(said, "fused") << "one rank runs the plain GEMM";
      else if (std::string(path) == "unfused") EXPECT_EQ(said, "unfused");
      else EXPECT_EQ(said.rfind("auto: ", 0), 0u) << said;
      if (W > 1 && std::string(path) == "auto") {
        EXPECT_EQ(said.find("deciding"), std::string::npos) << said;
        printf("[ path ] %s W %d: %s\n", ops::fused_kind_name(k), W, said.c_str());
      }
    }
  // Capturing a call before auto decided is refused, with the reason (nothing is enqueued).
  if (W > 1) {
    Case c{comm, FusedKind::kGemmAr, {int64_t(W) * 128, 256, 64}, false};
    c.path = "auto";
    MK_ASSERT_OK(c.init());
    MK_ASSERT_OK(c.prepare(0, st));
    MK_ASSERT_OK(comm->sync(st));
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    Status s = c.op->enqueue(c.args(), st);
    ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
    if (graph) cudaGraphDestroy(graph);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("before capturing"), std::string::npos) << s.to_string();
    MK_ASSERT_OK(comm->bootstrap().barrier());
  }
  // A bad path is named.
  std::unique_ptr<FusedGemm> op;
  ops::FusedOptions o;
  o.path = "sometimes";
  Status s = FusedGemm::create(comm, FusedKind::kGemmAr, {int64_t(W) * 128, 256, 256}, o, &op);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("'sometimes' is not fused, unfused or auto"), std::string::npos) << s.to_string();
}

// Bad input is the same clear error on every rank.
TEST_F(Fused, BadInputIsRejectedOnEveryRank) {
  const int W = comm->world();
  std::unique_ptr<FusedGemm> op;
  // An M the ranks do not divide, without the shards' rows (AG and RS need them).
  Status s = FusedGemm::create(comm, FusedKind::kGemmRs, {int64_t(W) * 128 + 1, 256, 256}, {}, &op);
  if (W > 1) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("equal shards"), std::string::npos) << s.to_string();
  }
  // Shards' rows that do not sum to M.
  s = FusedGemm::create(comm, FusedKind::kAgGemm, ops::PlanShape(int64_t(W) * 128, 256, 256, std::vector<int64_t>(W, 127)),
                        {}, &op);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("sum to"), std::string::npos) << s.to_string();
  if (W > 1) {
    // Uneven AG and RS have no unfused path.
    std::vector<int64_t> rows(W, 128);
    rows[0] = 129, rows[1] = 127;
    ops::FusedOptions uo;
    uo.path = "unfused";
    s = FusedGemm::create(comm, FusedKind::kGemmRs, ops::PlanShape(int64_t(W) * 128, 256, 256, rows), uo, &op);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("needs even shards"), std::string::npos) << s.to_string();
    // Rows that differ across ranks.
    rows[0] += comm->rank() == W - 1 ? 1 : 0;
    rows[1] -= comm->rank() == W - 1 ? 1 : 0;
    s = FusedGemm::create(comm, FusedKind::kAgGemm, ops::PlanShape(int64_t(W) * 128, 256, 256, rows), {}, &op);
    EXPECT_EQ(s.code(), Code::kMismatch) << s.to_string();
  }
  // Shapes that differ across ranks.
  s = FusedGemm::create(comm, FusedKind::kAgGemm, {int64_t(W) * 128, 256 + 8 * (comm->rank() == W - 1), 256}, {}, &op);
  if (W > 1) {
    EXPECT_EQ(s.code(), Code::kMismatch) << s.to_string();
    EXPECT_NE(s.message().find("disagree"), std::string::npos) << s.to_string();
  }
  // dtype mismatch and a misaligned pointer on one rank only: with the debug agreement
  // (check_calls, read at create) every rank gets the error. Without it run() checks locally
  // only: the rank with the bad argument gets it, and no host collective runs per call.
  MK_ASSERT_OK(tunables::set("check_calls", "1"));
  MK_ASSERT_OK(FusedGemm::create(comm, FusedKind::kGemmAr, {int64_t(W) * 128, 256, 256}, {}, &op));
  MK_ASSERT_OK(tunables::reset("check_calls"));
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
  // Default: local checks. The same bad argument on every rank fails on every rank, at once.
  MK_ASSERT_OK(FusedGemm::create(comm, FusedKind::kGemmAr, {int64_t(W) * 128, 256, 256}, {}, &op));
  a.A = static_cast<char*>(A.p) + 2;
  s = op->run(a, comm->stream());
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("aligned"), std::string::npos) << s.to_string();
  MK_ASSERT_OK(op->destroy());
}

}  // namespace
}  // namespace test
}  // namespace mk
