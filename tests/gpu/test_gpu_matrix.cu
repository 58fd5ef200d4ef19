// The configuration matrix, as a user runs it: every operator through its public API in the
// layout, provider and staging mode the launch gives (MK_RANKS_PER_NODE, MK_NET_PROVIDER,
// MK_NET_STAGING: scripts/device/matrix_check.sh launches this binary in every layout), over
// tile-aligned, odd and tiny shapes and several communication-CTA counts.
//
//  - Fused GEMMs: rank-tagged small integers in bf16, fresh per call; the reference is a plain
//    CUDA kernel (one thread per element, fp32 sums; independent of mkernel's GEMM and of
//    cuBLAS, whose heuristics returned zeros for some rows here when an MPS client had 16% of
//    the SMs) over the gathered (AG) or K-concatenated (RS/AR) inputs, which every rank rebuilds
//    from the tags: every product and sum is exact in fp32, both round once to bf16, so the
//    comparison is bit for bit, every element, with C poisoned (NaN) before each call. A
//    failure prints the first wrong element with the reference and an exact CPU value.
//  - Ring attention: the reference is a CPU fp64 attention over the whole sequence for this
//    rank's queries; O within bf16 rounding, LSE within 1e-3, O poisoned first.
//  - Standalone collectives: every kind and dtype, tiny and odd counts, small chunks on few CTAs,
//    bit for bit against the fp32 sum in the documented order (tests/gpu/collective_case.cuh).
//  - InFlight: while calls of every operator are in flight, the application thread makes the
//    blocking CUDA calls that once starved the proxy (pageable copies, cudaMalloc/cudaFree, a
//    first-use kernel launch on another stream, cudaStreamSynchronize of another stream); every
//    call must complete and be right.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cctype>
#include <numeric>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/trace.h"
#include "mkernel/gemm/gemm.h"
#include "mkernel/ops/fused.h"
#include "mkernel/ops/ring_attention.h"
#include "src/attention/fmha_launch.h"
#include "src/ops/ring_attention/ring_attention_testing.h"
#include "src/ops/ring_attention/ring_attention_plan.h"
#include "tests/gpu/collective_case.cuh"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

using ops::FusedGemm;
using ops::FusedKind;

// Element i of rank r's matrix `which` in call `call`: an integer in [-2, 2] (a pure function,
// so every rank can rebuild every other rank's inputs).
__host__ __device__ inline int tag_int(uint64_t seed, int rank, int which, uint64_t call, uint64_t i) {
  uint64_t x = seed ^ (uint64_t(rank + 1) << 52) ^ (uint64_t(which) << 44) ^ (call << 36) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return int(x % 5) - 2;
}

// dst[r * ld + c] = tag of rank's [., src_cols] matrix at (r + row0, c), for r < rows, c < cols.
// dcall, when set, holds the call index instead of `call` (a graph replay reads it on the device).
__global__ void fill_tags(__nv_bfloat16* dst, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int rank,
                          int which, uint64_t call, int64_t src_cols, int64_t row0, const uint64_t* dcall = nullptr) {
  if (dcall) call = *dcall;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld + c] = __float2bfloat16(float(tag_int(seed, rank, which, call, uint64_t(r + row0) * src_cols + c)));
  }
}
__global__ void poison16(uint16_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 0x7fc1;  // NaN in bf16
}
__global__ void count_diff(const uint16_t* got, const uint16_t* want, int64_t n, unsigned long long* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (got[i] != want[i]) {
      atomicAdd(&out[0], 1ull);
      atomicMin(&out[1], static_cast<unsigned long long>(i));
    }
}
// Graph replays: the call counter moves on the device, and each replay's comparison is counted.
__global__ void bump(uint64_t* call, unsigned long long* compared) {
  *call += 1;
  *compared += 1;
}
// A kernel launched for the first time while fused calls are in flight (module loading).
template <int kTag>
__global__ void first_use(int* p) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *p = kTag;
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { cudaMalloc(&p, bytes ? bytes : 16); }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

const char* kind_label(FusedKind k, bool det) {
  switch (k) {
    case FusedKind::kAgGemm: return "ag_gemm";
    case FusedKind::kGemmRs: return det ? "gemm_rs(det)" : "gemm_rs";
    case FusedKind::kGemmAr: return det ? "gemm_ar(det)" : "gemm_ar";
  }
  return "?";
}

// Whether every rank's call went well (MPI): ranks stop together after a failure instead of
// drifting into different collectives.
bool all_ok(bool mine) {
  int ok = mine ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return ok != 0;
}

// The blocking CUDA calls an application makes while a call is in flight on `stream`.
void blocking_calls(cudaStream_t stream, const void* dev_src, size_t bytes) {
  std::vector<uint8_t> pageable(bytes);
  // A pageable copy on the legacy stream, then one queued behind the call on its own stream.
  EXPECT_EQ(cudaMemcpy(pageable.data(), dev_src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  void* tmp = nullptr;
  EXPECT_EQ(cudaMalloc(&tmp, 64 << 20), cudaSuccess);
  EXPECT_EQ(cudaFree(tmp), cudaSuccess);
  cudaStream_t other;
  EXPECT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  int* flag = nullptr;
  EXPECT_EQ(cudaMalloc(&flag, sizeof(int)), cudaSuccess);
  first_use<__LINE__><<<1, 32, 0, other>>>(flag);
  EXPECT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
  EXPECT_EQ(cudaFree(flag), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(pageable.data(), dev_src, bytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
}

struct GemmCase {
  FusedKind kind;
  bool det;
  const char* shape;
  int64_t rows_per_rank, N, K;
  int comm_ctas;
};

// C = A · Bᵀ (row-major A [M, K], B [N, K], C [M, N]) in bf16, fp32 sums: the reference.
__global__ void ref_gemm(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, int64_t M, int64_t N,
                         int64_t K) {
  const int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, m = blockIdx.y;
  if (n >= N || m >= M) return;
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += __bfloat162float(A[m * K + k]) * __bfloat162float(B[n * K + k]);
  C[m * N + n] = __float2bfloat16_rn(acc);
}
Status gemm_ref(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, cudaStream_t st) {
  ref_gemm<<<dim3(unsigned((N + 127) / 128), unsigned(M)), 128, 0, st>>>(
      static_cast<const __nv_bfloat16*>(A), static_cast<const __nv_bfloat16*>(B), static_cast<__nv_bfloat16*>(C), M,
      N, K);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

// The "many" communication-CTA count of a case, within what this context can hold: with 8
// ranks sharing the GPU under MPS a client has about 14 co-resident CTAs, and the operators refuse
// a split that leaves none to compute (tested in test_gpu_fused_gemm). 1 and the default pass as
// they are; a larger count keeps two CTAs computing.
int comm_ctas_here(int asked, bool ring = false) {
  if (asked <= 1) return asked;
  int resident = 0;
  const Status s = ring ? attention::fmha_ctas(&resident) : gemm::persistent_ctas(&resident);
  if (!s.ok() || resident < 3) return 1;
  return std::min(asked, resident - 2);
}

// The case's operator (collective).
Status create_case(Communicator* comm, const GemmCase& c, std::unique_ptr<FusedGemm>* op) {
  ops::FusedOptions o;
  o.deterministic = c.det;
  o.comm_ctas = comm_ctas_here(c.comm_ctas);
  return FusedGemm::create(comm, c.kind, {c.rows_per_rank * comm->world(), c.N, c.K}, o, op);
}

// One fused case's buffers: this rank's inputs and output, and the reference's (every rank's
// inputs rebuilt from the tags).
struct GemmBuffers {
  GemmBuffers(const GemmCase& c, int W, int me)
      : kind(c.kind), W(W), me(me), Ms(c.rows_per_rank), M(Ms * W), N(c.N), K(c.K),
        ag(c.kind == FusedKind::kAgGemm), a_rows(ag ? Ms : M), c_rows(c.kind == FusedKind::kGemmRs ? Ms : M),
        ck(ag ? K : K * W), A(a_rows * K * 2), B(N * K * 2), C(c_rows * N * 2), A_ref(M * ck * 2),
        B_ref(N * ck * 2), C_ref(M * N * 2) {}
  // Enqueues call `e`'s inputs (or, with dcall, the call index the device holds there), the
  // reference's inputs and product, and the poisoning of C.
  Status prepare(uint64_t seed, uint64_t e, cudaStream_t st, const uint64_t* dcall = nullptr) {
    fill_tags<<<132, 256, 0, st>>>(A.as<__nv_bfloat16>(), a_rows, K, K, seed, me, 0, e, K, ag ? me * Ms : 0, dcall);
    fill_tags<<<132, 256, 0, st>>>(B.as<__nv_bfloat16>(), N, K, K, seed, me, 1, e, K, 0, dcall);
    if (ag) {
      for (int r = 0; r < W; ++r)
        fill_tags<<<132, 256, 0, st>>>(A_ref.as<__nv_bfloat16>() + r * Ms * K, Ms, K, K, seed, r, 0, e, K, r * Ms,
                                       dcall);
      MK_CHECK(gemm_ref(A_ref.p, B.p, C_ref.p, M, N, K, st));
    } else {
      for (int r = 0; r < W; ++r) {
        fill_tags<<<132, 256, 0, st>>>(A_ref.as<__nv_bfloat16>() + r * K, M, K, ck, seed, r, 0, e, K, 0, dcall);
        fill_tags<<<132, 256, 0, st>>>(B_ref.as<__nv_bfloat16>() + r * K, N, K, ck, seed, r, 1, e, K, 0, dcall);
      }
      MK_CHECK(gemm_ref(A_ref.p, B_ref.p, C_ref.p, M, N, ck, st));
    }
    poison16<<<132, 256, 0, st>>>(C.as<uint16_t>(), c_rows * N);
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  }
  ops::FusedArgs args() const {
    ops::FusedArgs a;
    a.A = A.p;
    a.B = B.p;
    a.C = C.p;
    return a;
  }
  // The reference rows this rank's C holds.
  const uint16_t* want() const { return C_ref.as<uint16_t>() + (kind == FusedKind::kGemmRs ? me * Ms * N : 0); }

  FusedKind kind;
  int W, me;
  int64_t Ms, M, N, K;
  bool ag;
  int64_t a_rows, c_rows, ck;
  Dev A, B, C, A_ref, B_ref, C_ref;
};

// Runs `calls` calls of one fused case, each checked bit for bit. in_flight: the blocking calls
// happen while each call is in flight.
void run_gemm_case(Communicator* comm, const GemmCase& c, uint64_t seed, int calls, bool in_flight) {
  const int W = comm->world(), me = comm->rank();
  const int64_t Ms = c.rows_per_rank, M = Ms * W, N = c.N, K = c.K;
  SCOPED_TRACE(std::string(kind_label(c.kind, c.det)) + " " + c.shape + " M " + std::to_string(M) + " N " +
               std::to_string(N) + " K " + std::to_string(K) + " comm_ctas " + std::to_string(comm_ctas_here(c.comm_ctas)));
  std::unique_ptr<FusedGemm> op;
  MK_ASSERT_OK(create_case(comm, c, &op));
  GemmBuffers g(c, W, me);
  const bool ag = g.ag;
  const int64_t c_rows = g.c_rows;
  Dev bad(16);
  cudaStream_t st = comm->stream();
  for (int call = 1; call <= calls; ++call) {
    const uint64_t e = uint64_t(call) + (in_flight ? 1000 : 0);
    MK_ASSERT_OK(g.prepare(seed, e, st));
    MK_ASSERT_OK(call == 1 ? op->run(g.args(), st) : op->enqueue(g.args(), st));
    if (in_flight) blocking_calls(st, g.C_ref.p, size_t(M) * N * 2);
    const Status s = comm->sync(st);
    EXPECT_TRUE(s.ok()) << "call " << call << ": " << s.to_string();
    ASSERT_TRUE(all_ok(s.ok())) << "a rank's call failed";
    unsigned long long init[2] = {0, ~0ull}, got[2];
    ASSERT_EQ(cudaMemcpy(bad.p, init, sizeof(init), cudaMemcpyHostToDevice), cudaSuccess);
    const uint16_t* want = g.want();
    count_diff<<<132, 256, 0, st>>>(g.C.as<uint16_t>(), want, c_rows * N, bad.as<unsigned long long>());
    ASSERT_EQ(cudaMemcpy(got, bad.p, sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
    std::string detail;
    if (got[0]) {
      // The first wrong element: the fused value, cuBLAS's, and an exact CPU value from the tags,
      // so a failure says which side is off.
      const int64_t i = int64_t(got[1]), row = i / N, col = i % N, grow = row + (c.kind == FusedKind::kGemmRs ? me * Ms : 0);
      uint16_t f = 0, r = 0;
      cudaMemcpy(&f, g.C.as<uint16_t>() + i, 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(&r, want + i, 2, cudaMemcpyDeviceToHost);
      double exact = 0;
      if (ag) {
        const int owner = int(grow / Ms);
        for (int64_t k = 0; k < K; ++k)
          exact += double(tag_int(seed, owner, 0, e, uint64_t(grow) * K + k)) * tag_int(seed, me, 1, e, uint64_t(col) * K + k);
      } else {
        for (int rr = 0; rr < W; ++rr)
          for (int64_t k = 0; k < K; ++k)
            exact += double(tag_int(seed, rr, 0, e, uint64_t(grow) * K + k)) * tag_int(seed, rr, 1, e, uint64_t(col) * K + k);
      }
      auto bf = [](uint16_t h) {
        uint32_t u = uint32_t(h) << 16;
        float x;
        memcpy(&x, &u, 4);
        return x;
      };
      detail = "; first at row " + std::to_string(grow) + " col " + std::to_string(col) + ": fused " +
               std::to_string(bf(f)) + ", reference " + std::to_string(bf(r)) + ", exact " + std::to_string(exact);
    }
    EXPECT_EQ(got[0], 0ull) << "rank " << me << " call " << call << ": " << got[0] << " of " << c_rows * N
                            << " elements wrong" << detail;
  }
  MK_EXPECT_OK(comm->check());
  MK_EXPECT_OK(op->destroy());
}

std::vector<GemmCase> gemm_cases() {
  struct Shape {
    const char* name;
    int64_t rows_per_rank, N, K;
  };
  // Odd: M not a multiple of the 128-row tile, N and K multiples of 8 but not of 64. Tiny: one
  // row per rank.
  const Shape shapes[] = {{"aligned", 256, 512, 256}, {"odd", 136, 264, 72}, {"tiny", 1, 8, 8}};
  const struct {
    FusedKind k;
    bool det;
  } kinds[] = {{FusedKind::kAgGemm, false}, {FusedKind::kGemmRs, false}, {FusedKind::kGemmAr, false},
               {FusedKind::kGemmRs, true}, {FusedKind::kGemmAr, true}};
  const int ctas[] = {1, -1, 16};
  std::vector<GemmCase> out;
  // Every (operator, shape) pair; the CTA count rotates so that every (operator, count) and
  // every (shape, count) pair occurs too.
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 3; ++j)
      out.push_back(GemmCase{kinds[i].k, kinds[i].det, shapes[j].name, shapes[j].rows_per_rank, shapes[j].N,
                             shapes[j].K, ctas[(i + j) % 3]});
  return out;
}

// ---- ring attention ----
struct RingCase {
  ops::SeqLayout layout;
  bool causal;
  int H, Hkv, D;
  int64_t tokens_per_rank;
  int comm_ctas;
  int doc_len = 0;  // > 0: packed documents of doc_len tokens over the whole sequence (cu_seqlens)
  bool uneven = false;  // uneven shards (RingAttentionShape::rows, ring_rows)
};

// A case's shard rows: tokens_per_rank each, or uneven: rank r holds tokens_per_rank +
// (37 r) % 61 - 30 tokens (at least 1; zigzag 2).
std::vector<int64_t> ring_rows(const RingCase& c, int W) {
  std::vector<int64_t> rows;
  const int64_t least = c.layout == ops::SeqLayout::kZigzag ? 2 : 1;
  for (int r = 0; r < W; ++r)
    rows.push_back(c.uneven ? std::max<int64_t>(least, c.tokens_per_rank + (37 * r) % 61 - 30) : c.tokens_per_rank);
  return rows;
}
std::string ring_case_name(const RingCase& c, const std::vector<int64_t>& rows, int me, int comm_ctas) {
  std::string s = std::string(c.layout == ops::SeqLayout::kZigzag ? "zigzag" : "contiguous") +
                  (c.causal ? " causal" : "") + " S/rank " + std::to_string(rows[size_t(me)]) +
                  (c.uneven ? " (uneven shards)" : "") + " H " + std::to_string(c.H) + "/" + std::to_string(c.Hkv) +
                  " D " + std::to_string(c.D) + " comm_ctas " + std::to_string(comm_ctas);
  return c.doc_len ? s + " documents of " + std::to_string(c.doc_len) : s;
}

// Inputs in eighths in [-1/2, 1/2] (exact in bf16), a function of (rank, which, call, index).
float ring_value(uint64_t seed, int rank, int which, uint64_t call, uint64_t i) {
  return float(tag_int(seed, rank, which + 8, call, i) * 2 + (tag_int(seed, rank, which + 16, call, i) & 1)) / 8.f;
}

// Every rank's tensors `which` (0 Q, 1 K, 2 V, 3 dO) of a call on the host, rank r's rows[r] rows
// of `row` elements (the reference needs the whole sequence's).
std::vector<std::vector<float>> ring_host(uint64_t seed, int which, uint64_t call, const std::vector<int64_t>& rows,
                                          int64_t row) {
  std::vector<std::vector<float>> h;
  for (size_t r = 0; r < rows.size(); ++r) {
    h.emplace_back(size_t(rows[r] * row));
    for (size_t i = 0; i < h.back().size(); ++i) h.back()[i] = ring_value(seed, int(r), which, call, i);
  }
  return h;
}
// h as bf16 into device d, on the operator's (non-blocking) stream: a cudaMemcpy from pageable
// memory may return before its DMA lands, unordered with that stream (a call read a rank's stale
// Q or K).
void upload_bf16(const std::vector<float>& h, void* d, cudaStream_t st) {
  std::vector<__nv_bfloat16> b(h.size());
  for (size_t i = 0; i < h.size(); ++i) b[i] = __float2bfloat16(h[i]);
  ASSERT_EQ(cudaMemcpyAsync(d, b.data(), b.size() * 2, cudaMemcpyHostToDevice, st), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
}

void run_ring_case(Communicator* comm, const RingCase& c, uint64_t seed, int calls, bool in_flight) {
  const int W = comm->world(), me = comm->rank();
  const int B = 1;
  const std::vector<int64_t> rows = ring_rows(c, W);
  const int64_t S_l = rows[size_t(me)], S = std::accumulate(rows.begin(), rows.end(), int64_t(0));
  const int64_t S_max = *std::max_element(rows.begin(), rows.end());
  const int comm_ctas = comm_ctas_here(c.comm_ctas, true);
  SCOPED_TRACE("ring_attention " + ring_case_name(c, rows, me, comm_ctas));
  ops::RingAttentionOptions o;
  o.comm_ctas = comm_ctas;
  // Several forwarded pieces per block even at these sizes: arrival flags per piece are tested.
  o.chunk_tokens = S_max > 64 ? 64 : 0;
  std::unique_ptr<ops::RingAttention> op;
  MK_ASSERT_OK(ops::RingAttention::create(
      comm, {B, c.H, c.Hkv, c.D, S, c.layout, c.causal, c.uneven ? rows : std::vector<int64_t>{}}, o, &op));
  const ops::RingPlan& plan = ops::RingAttentionTesting::plan(*op);
  // Global position of each local token of every rank (chunks in token order).
  std::vector<std::vector<int64_t>> pos(W);
  for (int r = 0; r < W; ++r)
    for (const auto& ch : plan.chunks[r])
      for (int64_t t = 0; t < ch.tokens; ++t) pos[r].push_back(ch.token0 + t);
  const size_t qn = size_t(S_l) * c.H * c.D, kn = size_t(S_l) * c.Hkv * c.D;
  Dev q(qn * 2), k(kn * 2), v(kn * 2), o_d(qn * 2), lse(size_t(c.H) * S_l * 4);
  cudaStream_t st = comm->stream();
  // Packed documents: bounds 0, doc_len, 2 doc_len, ..., S over the whole sequence.
  std::vector<int32_t> hcu;
  if (c.doc_len > 0) {
    for (int64_t p = 0; p < S; p += c.doc_len) hcu.push_back(int32_t(p));
    hcu.push_back(int32_t(S));
  }
  Dev cu(std::max<size_t>(hcu.size(), 1) * 4);
  if (!hcu.empty())
    ASSERT_EQ(cudaMemcpy(cu.p, hcu.data(), hcu.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  auto visible = [&](int64_t qpos, int64_t kpos) {
    if (c.causal && kpos > qpos) return false;
    return c.doc_len == 0 || qpos / c.doc_len == kpos / c.doc_len;
  };
  const double scale = 1.0 / std::sqrt(double(c.D));
  for (int call = 1; call <= calls; ++call) {
    const uint64_t e = uint64_t(call) + (in_flight ? 1000 : 0);
    const auto hq = ring_host(seed, 0, e, rows, int64_t(c.H) * c.D), hk = ring_host(seed, 1, e, rows, int64_t(c.Hkv) * c.D),
               hv = ring_host(seed, 2, e, rows, int64_t(c.Hkv) * c.D);
    for (auto [h, d] : {std::pair<const std::vector<float>*, void*>{&hq[me], q.p}, {&hk[me], k.p}, {&hv[me], v.p}})
      ASSERT_NO_FATAL_FAILURE(upload_bf16(*h, d, st));
    poison16<<<132, 256, 0, st>>>(o_d.as<uint16_t>(), int64_t(qn));
    ops::RingAttentionArgs a;
    a.q = q.p, a.k = k.p, a.v = v.p, a.o = o_d.p, a.lse = lse.as<float>();
    if (!hcu.empty()) a.cu_seqlens = cu.as<int32_t>(), a.n_docs = int(hcu.size()) - 1;
    MK_ASSERT_OK(call == 1 ? op->run(a, st) : op->enqueue(a, st));
    if (in_flight) blocking_calls(st, q.p, qn * 2);
    const Status s = comm->sync(st);
    EXPECT_TRUE(s.ok()) << "call " << call << ": " << s.to_string();
    ASSERT_TRUE(all_ok(s.ok())) << "a rank's call failed";
    std::vector<__nv_bfloat16> got(qn);
    std::vector<float> got_lse(size_t(c.H) * S_l);
    ASSERT_EQ(cudaMemcpy(got.data(), o_d.p, qn * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_lse.data(), lse.p, got_lse.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t bad = 0;
    std::string first;
    const int group = c.H / c.Hkv;
    std::vector<double> sc, acc(c.D);
    for (int64_t i = 0; i < S_l; ++i)
      for (int h = 0; h < c.H; ++h) {
        const float* qi = &hq[me][(size_t(i) * c.H + h) * c.D];
        const int hk_i = h / group;
        double mx = -INFINITY;
        sc.clear();
        for (int r = 0; r < W; ++r)
          for (int64_t j = 0; j < rows[size_t(r)]; ++j) {
            if (!visible(pos[me][i], pos[r][j])) {
              sc.push_back(-INFINITY);
              continue;
            }
            const float* kj = &hk[r][(size_t(j) * c.Hkv + hk_i) * c.D];
            double d = 0;
            for (int x = 0; x < c.D; ++x) d += double(qi[x]) * kj[x];
            sc.push_back(d * scale);
            mx = std::max(mx, d * scale);
          }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        size_t n = 0;
        for (int r = 0; r < W; ++r)
          for (int64_t j = 0; j < rows[size_t(r)]; ++j, ++n) {
            if (sc[n] == -INFINITY) continue;
            const double p = std::exp(sc[n] - mx);
            sum += p;
            const float* vj = &hv[r][(size_t(j) * c.Hkv + hk_i) * c.D];
            for (int x = 0; x < c.D; ++x) acc[x] += p * vj[x];
          }
        for (int x = 0; x < c.D; ++x) {
          const double want = acc[x] / sum;
          const float o = __bfloat162float(got[(size_t(i) * c.H + h) * c.D + x]);
          // bf16 output: half an ulp of rounding plus the kernel's fp32 arithmetic.
          if (!(std::fabs(o - want) <= 1e-2 * std::fabs(want) + 2e-3) && bad++ == 0)
            first = "O[token " + std::to_string(i) + "][head " + std::to_string(h) + "][" + std::to_string(x) +
                    "] = " + std::to_string(o) + ", expected " + std::to_string(want);
        }
        const double want_lse = mx + std::log(sum);
        const float l = got_lse[size_t(h) * S_l + i];
        if (!(std::fabs(l - want_lse) <= 1e-3 * std::max(1.0, std::fabs(want_lse))) && bad++ == 0)
          first = "LSE[head " + std::to_string(h) + "][token " + std::to_string(i) + "] = " + std::to_string(l) +
                  ", expected " + std::to_string(want_lse);
      }
    EXPECT_EQ(bad, 0) << "rank " << me << " call " << call << ": " << bad << " wrong; first " << first;
  }
  MK_EXPECT_OK(comm->check());
  MK_EXPECT_OK(op->destroy());
}

// The ring's backward (RingAttentionBackward) on the launch's layout: the forward's O and LSE,
// then dQ, dK and dV of this rank (poisoned before) against a float64 reference over the whole
// sequence with the case's mask (causal, packed documents): dQ of this rank's rows from their
// full rows of P; dK and dV of this rank's keys from every rank's rows, whose LSE and
// rowsum(dO * O) each rank computes for its own rows and shares (host allgather). Bound per
// element: 2^-6 of the tensor's largest magnitude plus 2^-6 of the element (bf16 P and dS in
// the kernel, sums over up to S keys in another order).
void run_ring_backward_case(Communicator* comm, const RingCase& c, uint64_t seed, int calls) {
  const int W = comm->world(), me = comm->rank();
  const std::vector<int64_t> rows = ring_rows(c, W);
  const int64_t S_l = rows[size_t(me)], S = std::accumulate(rows.begin(), rows.end(), int64_t(0));
  const int64_t S_max = *std::max_element(rows.begin(), rows.end());
  std::vector<int64_t> off(size_t(W) + 1, 0);  // rank r's rows in the reference's flat key order
  for (int r = 0; r < W; ++r) off[size_t(r) + 1] = off[size_t(r)] + rows[size_t(r)];
  const int comm_ctas = comm_ctas_here(c.comm_ctas, true);
  SCOPED_TRACE("ring_attention backward " + ring_case_name(c, rows, me, comm_ctas));
  ops::RingAttentionOptions o;
  o.comm_ctas = comm_ctas;
  o.chunk_tokens = S_max > 64 ? 64 : 0;
  const ops::RingAttentionShape shape{1, c.H, c.Hkv, c.D, S, c.layout, c.causal,
                                      c.uneven ? rows : std::vector<int64_t>{}};
  std::unique_ptr<ops::RingAttention> fwd;
  std::unique_ptr<ops::RingAttentionBackward> bwd;
  MK_ASSERT_OK(ops::RingAttention::create(comm, shape, o, &fwd));
  MK_ASSERT_OK(ops::RingAttentionBackward::create(comm, shape, o, &bwd));
  const ops::RingPlan& plan = ops::RingAttentionTesting::plan(*fwd);
  std::vector<std::vector<int64_t>> pos(W);
  for (int r = 0; r < W; ++r)
    for (const auto& ch : plan.chunks[r])
      for (int64_t t = 0; t < ch.tokens; ++t) pos[r].push_back(ch.token0 + t);
  std::vector<int32_t> hcu;
  if (c.doc_len > 0) {
    for (int64_t p = 0; p < S; p += c.doc_len) hcu.push_back(int32_t(p));
    hcu.push_back(int32_t(S));
  }
  auto visible = [&](int64_t qpos, int64_t kpos) {
    if (c.causal && kpos > qpos) return false;
    return c.doc_len == 0 || qpos / c.doc_len == kpos / c.doc_len;
  };
  const int H = c.H, Hkv = c.Hkv, D = c.D, group = H / Hkv;
  const size_t qn = size_t(S_l) * H * D, kn = size_t(S_l) * Hkv * D;
  Dev q(qn * 2), k(kn * 2), v(kn * 2), out(qn * 2), lse(size_t(H) * S_l * 4), dout(qn * 2), dq(qn * 2), dk(kn * 2),
      dv(kn * 2), cu(std::max<size_t>(hcu.size(), 1) * 4);
  if (!hcu.empty())
    ASSERT_EQ(cudaMemcpy(cu.p, hcu.data(), hcu.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t st = comm->stream();
  const double scale = 1.0 / std::sqrt(double(D));
  for (int call = 1; call <= calls; ++call) {
    const uint64_t e = uint64_t(call) + 3000;
    const auto hq = ring_host(seed, 0, e, rows, int64_t(H) * D), hk = ring_host(seed, 1, e, rows, int64_t(Hkv) * D),
               hv = ring_host(seed, 2, e, rows, int64_t(Hkv) * D), hdo = ring_host(seed, 3, e, rows, int64_t(H) * D);
    for (auto [h, d] : {std::pair<const std::vector<float>*, void*>{&hq[me], q.p}, {&hk[me], k.p}, {&hv[me], v.p},
                        {&hdo[me], dout.p}})
      ASSERT_NO_FATAL_FAILURE(upload_bf16(*h, d, st));
    poison16<<<132, 256, 0, st>>>(dq.as<uint16_t>(), int64_t(qn));
    poison16<<<132, 256, 0, st>>>(dk.as<uint16_t>(), int64_t(kn));
    poison16<<<132, 256, 0, st>>>(dv.as<uint16_t>(), int64_t(kn));
    ops::RingAttentionArgs a;
    a.q = q.p, a.k = k.p, a.v = v.p, a.o = out.p, a.lse = lse.as<float>();
    ops::RingAttentionBackwardArgs b{q.p, k.p, v.p, out.p, dout.p, lse.as<float>(), dq.p, dk.p, dv.p};
    // MK_MATRIX_TRACE_DIR: the backward runs traced, and each rank writes its timeline (every
    // CTA's life, items, ops and long waits; write_trace_table) there, also after a failed call.
    const char* trace_dir = getenv("MK_MATRIX_TRACE_DIR");
    TraceRecorder rec;
    if (trace_dir) {
      MK_ASSERT_OK(TraceRecorder::create(1u << 16, &rec));
      b.trace = rec.device();
    }
    if (!hcu.empty()) {
      a.cu_seqlens = b.cu_seqlens = cu.as<int32_t>();
      a.n_docs = b.n_docs = int(hcu.size()) - 1;
    }
    MK_ASSERT_OK(fwd->run(a, st));
    MK_ASSERT_OK(call == 1 ? bwd->run(b, st) : bwd->enqueue(b, st));
    const Status s = comm->sync(st);
    EXPECT_TRUE(s.ok()) << "call " << call << ": " << s.to_string();
    if (trace_dir) {
      std::vector<TraceEvent> ev;
      uint64_t dropped = 0;
      const std::string name = ring_case_name(c, rows, me, comm_ctas);
      std::string file;
      for (char ch : name) file += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
      const Status ts = rec.fetch(&ev, &dropped);
      if (ts.ok())
        MK_EXPECT_OK(write_trace_table(ev, name + " call " + std::to_string(call) + (s.ok() ? " ok" : " failed"),
                                       std::string(trace_dir) + "/ringbwd." + file + ".call" + std::to_string(call) +
                                           ".rank" + std::to_string(me) + ".tsv"));
    }
    if (!s.ok()) {  // where this rank's call stood: its CTAs that finished, its next op, its flags
      std::string where;
      const Status ps = ops::RingAttentionTesting::backward_progress(*bwd, &where);
      fprintf(stderr, "rank %d call %d: %s%s", me, call, ps.ok() ? "" : (ps.to_string() + "\n").c_str(), where.c_str());
    }
    ASSERT_TRUE(all_ok(s.ok())) << "a rank's call failed";
    std::vector<__nv_bfloat16> got_dq(qn), got_dk(kn), got_dv(kn);
    ASSERT_EQ(cudaMemcpy(got_dq.data(), dq.p, qn * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_dk.data(), dk.p, kn * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_dv.data(), dv.p, kn * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    // Scores of query row i of rank qr against key row j of rank kr, head h.
    auto score = [&](int qr, int64_t i, int kr, int64_t j, int h) {
      const float* qi = &hq[qr][(size_t(i) * H + h) * D];
      const float* kj = &hk[kr][(size_t(j) * Hkv + h / group) * D];
      double d = 0;
      for (int x = 0; x < D; ++x) d += double(qi[x]) * kj[x];
      return d * scale;
    };
    auto dprod = [&](int qr, int64_t i, int kr, int64_t j, int h) {  // dO_i . V_j
      const float* oi = &hdo[qr][(size_t(i) * H + h) * D];
      const float* vj = &hv[kr][(size_t(j) * Hkv + h / group) * D];
      double d = 0;
      for (int x = 0; x < D; ++x) d += double(oi[x]) * vj[x];
      return d;
    };
    // This rank's rows: LSE, rowsum(dO * O) = sum_j P_ij dO_i.V_j, and dQ.
    std::vector<double> want_dq(qn, 0.0), mine(size_t(2) * S_max * H);  // the largest shard's, for the allgather
    std::vector<double> sc(static_cast<size_t>(S)), dp(static_cast<size_t>(S));
    // A query row that sees one key has a zero dQ (its softmax is 1 whatever the score): a rank
    // whose rows all see one key (a one-token shard at the causal start) has a zero reference dQ.
    bool dq_nonzero = false;
    for (int64_t i = 0; i < S_l; ++i)
      for (int h = 0; h < H; ++h) {
        double mx = -INFINITY;
        int seen = 0;
        for (int r = 0; r < W; ++r)
          for (int64_t j = 0; j < rows[size_t(r)]; ++j) {
            const size_t n = size_t(off[size_t(r)] + j);
            seen += visible(pos[me][i], pos[r][j]);
            sc[n] = visible(pos[me][i], pos[r][j]) ? score(me, i, r, j, h) : -INFINITY;
            dp[n] = sc[n] == -INFINITY ? 0.0 : dprod(me, i, r, j, h);
            mx = std::max(mx, sc[n]);
          }
        dq_nonzero |= seen > 1;
        double sum = 0, dsum = 0;
        for (size_t n = 0; n < sc.size(); ++n)
          if (sc[n] != -INFINITY) sum += std::exp(sc[n] - mx);
        const double l = mx + std::log(sum);
        for (size_t n = 0; n < sc.size(); ++n)
          if (sc[n] != -INFINITY) dsum += std::exp(sc[n] - l) * dp[n];
        double* dqi = &want_dq[(size_t(i) * H + h) * D];
        for (int r = 0; r < W; ++r)
          for (int64_t j = 0; j < rows[size_t(r)]; ++j) {
            const size_t n = size_t(off[size_t(r)] + j);
            if (sc[n] == -INFINITY) continue;
            const double ds = std::exp(sc[n] - l) * (dp[n] - dsum) * scale;
            const float* kj = &hk[r][(size_t(j) * Hkv + h / group) * D];
            for (int x = 0; x < D; ++x) dqi[x] += ds * kj[x];
          }
        mine[(size_t(i) * H + h) * 2] = l;
        mine[(size_t(i) * H + h) * 2 + 1] = dsum;
      }
    std::vector<double> all(mine.size() * W);
    ASSERT_TRUE(comm->bootstrap().allgather(mine.data(), all.data(), mine.size() * sizeof(double)).ok());
    // This rank's keys: dK and dV from every rank's rows.
    std::vector<double> want_dk(kn, 0.0), want_dv(kn, 0.0);
    // dK is zero where every row that sees this rank's keys sees one key only (the same reason as
    // dQ: ds = P (dP - rowsum) vanishes when P is 1): nonzero expected only past that case.
    bool dk_nonzero = false;
    for (int r = 0; r < W; ++r)
      for (int64_t i = 0; i < rows[size_t(r)]; ++i) {
        int seen = 0;
        bool sees_mine = false;
        for (int r2 = 0; r2 < W; ++r2)
          for (int64_t j = 0; j < rows[size_t(r2)]; ++j) seen += visible(pos[r][i], pos[r2][j]);
        for (int64_t j = 0; j < S_l; ++j) sees_mine |= visible(pos[r][i], pos[me][j]);
        dk_nonzero |= seen > 1 && sees_mine;
      }
    for (int r = 0; r < W; ++r)
      for (int64_t i = 0; i < rows[size_t(r)]; ++i)
        for (int h = 0; h < H; ++h) {
          const double l = all[(size_t(r) * S_max * H + size_t(i) * H + h) * 2];
          const double dsum = all[(size_t(r) * S_max * H + size_t(i) * H + h) * 2 + 1];
          const float* qi = &hq[r][(size_t(i) * H + h) * D];
          const float* oi = &hdo[r][(size_t(i) * H + h) * D];
          for (int64_t j = 0; j < S_l; ++j) {
            if (!visible(pos[r][i], pos[me][j])) continue;
            const double p = std::exp(score(r, i, me, j, h) - l);
            const double ds = p * (dprod(r, i, me, j, h) - dsum) * scale;
            double* dkj = &want_dk[(size_t(j) * Hkv + h / group) * D];
            double* dvj = &want_dv[(size_t(j) * Hkv + h / group) * D];
            for (int x = 0; x < D; ++x) dkj[x] += ds * qi[x], dvj[x] += p * oi[x];
          }
        }
    auto check = [&](const char* name, const std::vector<__nv_bfloat16>& got, const std::vector<double>& want,
                     bool nonzero) {
      double m = 0;
      for (double w : want) m = std::max(m, std::fabs(w));
      if (nonzero) EXPECT_GT(m, 0.0) << name << ": a zero reference gradient";
      int64_t bad = 0;
      std::string first;
      for (size_t i = 0; i < want.size(); ++i) {
        const float g = __bfloat162float(got[i]);
        if (!(std::fabs(g - want[i]) <= (m + std::fabs(want[i])) / 64) && bad++ == 0)
          first = std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(g) + ", expected " +
                  std::to_string(want[i]) + " (max " + std::to_string(m) + ")";
      }
      EXPECT_EQ(bad, 0) << "rank " << me << " call " << call << ": " << bad << " of " << want.size() << " " << name
                        << " wrong; first " << first;
    };
    check("dQ", got_dq, want_dq, dq_nonzero);  // zero: every element must be exactly 0 (the bound is 0)
    check("dK", got_dk, want_dk, dk_nonzero);
    check("dV", got_dv, want_dv, true);
  }
  MK_EXPECT_OK(comm->check());
  MK_EXPECT_OK(fwd->destroy());
  MK_EXPECT_OK(bwd->destroy());
}

std::vector<RingCase> ring_cases() {
  return {
      {ops::SeqLayout::kContiguous, false, 4, 2, 128, 200, -1},  // GQA, tails (200 = 128 + 72)
      {ops::SeqLayout::kZigzag, true, 2, 1, 64, 136, 1},         // odd chunks (68 tokens each)
      {ops::SeqLayout::kZigzag, true, 2, 2, 64, 2, 16},          // tiny: one token per chunk
      // packed documents (cu_seqlens) that straddle chunks, ranks and tiles
      {ops::SeqLayout::kZigzag, true, 4, 2, 128, 200, -1, 37},
      {ops::SeqLayout::kContiguous, false, 2, 1, 64, 136, 1, 150},
      // uneven shards (rows 30 fewer to 30 more than tokens_per_rank), with documents too
      {ops::SeqLayout::kZigzag, true, 4, 2, 128, 200, -1, 0, true},
      {ops::SeqLayout::kContiguous, false, 2, 1, 64, 136, 1, 150, true},
      {ops::SeqLayout::kContiguous, true, 2, 2, 64, 3, 16, 0, true},  // tiny: ranks of 1 token beside 10 and 23
  };
}

class Matrix : public ::testing::Test {
 protected:
  void SetUp() override {
    comm_ = shared_comm();
    ASSERT_NE(comm_, nullptr);
    // A failed communicator runs nothing more: the later tests fail at once, on every rank.
    ASSERT_TRUE(all_ok(comm_->check().ok())) << "the communicator failed in an earlier test";
    if (comm_->rank() == 0)
      printf("matrix: %d ranks on %d node(s) of %d; provider %s, staging %s\n", comm_->world(),
             comm_->topology().num_nodes, int(comm_->topology().node_ranks[0].size()),
             getenv("MK_NET_PROVIDER") ? getenv("MK_NET_PROVIDER") : "auto",
             getenv("MK_NET_STAGING") ? getenv("MK_NET_STAGING") : "auto");
  }
  Communicator* comm_ = nullptr;
};

TEST_F(Matrix, FusedGemmEveryShapeAndCtaCount) {
  const uint64_t seed = test_seed();
  for (const GemmCase& c : gemm_cases()) {
    run_gemm_case(comm_, c, seed, 2, false);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Matrix, RingAttentionEveryLayout) {
  const uint64_t seed = test_seed();
  for (const RingCase& c : ring_cases()) {
    // Zigzag needs an even number of tokens per rank; the tiny case keeps one token per chunk.
    run_ring_case(comm_, c, seed, 2, false);
    if (HasFatalFailure()) return;
  }
}

// The backward on the same layouts and cases (GQA with tails, odd zigzag chunks, one token per
// chunk, packed documents).
TEST_F(Matrix, RingAttentionBackwardEveryLayout) {
  const uint64_t seed = test_seed();
  for (const RingCase& c : ring_cases()) {
    run_ring_backward_case(comm_, c, seed, 1);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Matrix, CollectivesEveryKindAndDtype) {
  const int W = comm_->world();
  struct Opt {
    int64_t chunk;
    int ctas;
  };
  for (ops::CollectiveKind k :
       {ops::CollectiveKind::kAllGather, ops::CollectiveKind::kReduceScatter, ops::CollectiveKind::kAllReduce})
    for (ops::CollDType t : {ops::CollDType::kBF16, ops::CollDType::kF32})
      for (int64_t n : {int64_t(8), 8 * (int64_t(37) * W + 3)})
        for (Opt o : {Opt{0, 0}, Opt{1000, 2}}) {
          coll::Case c{comm_, k, t, n};
          c.opt.chunk_elems = o.chunk;
          c.opt.ctas = o.ctas;
          MK_ASSERT_OK(c.init());
          coll::run_calls(c, 2, 0);
          if (HasFatalFailure()) return;
        }
}

// A long run: 2000 calls of GEMM+RS back to back through one operator, every call checked bit
// for bit on fresh tagged data (epochs, flags and the proxy's counters wrap no differently in
// call 2000 than in call 2). Run in some launches only (scripts/device/matrix_check.sh).
TEST_F(Matrix, LongRun) {
  run_gemm_case(comm_, GemmCase{FusedKind::kGemmRs, false, "aligned", 128, 256, 128, -1}, test_seed() ^ 0x10f6,
                2000, false);
}

// 200 back-to-back replays of one captured graph per operator: each replay bumps a device call
// counter, fills fresh tagged inputs and the reference's inputs from it, computes the reference,
// poisons C, runs the fused call and counts C's wrong elements, all on the stream, with no host
// step between replays. Run in some launches only (scripts/device/matrix_check.sh).
void run_gemm_graph(Communicator* comm, const GemmCase& c, uint64_t seed, int replays) {
  const int W = comm->world(), me = comm->rank();
  const int64_t Ms = c.rows_per_rank, M = Ms * W, N = c.N, K = c.K;
  SCOPED_TRACE(std::string("graph replays of ") + kind_label(c.kind, c.det) + " " + c.shape);
  std::unique_ptr<FusedGemm> op;
  MK_ASSERT_OK(create_case(comm, c, &op));
  GemmBuffers g(c, W, me);
  const bool ag = g.ag;
  const int64_t c_rows = g.c_rows;
  Dev dcall(sizeof(uint64_t)), bad(3 * sizeof(unsigned long long));
  cudaStream_t st = comm->stream();
  const uint64_t base = 5000;  // call indices of their own (the other tests use 1.. and 1001..)
  unsigned long long init[3] = {0, ~0ull, 0};
  ASSERT_EQ(cudaMemcpy(dcall.p, &base, sizeof(base), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(bad.p, init, sizeof(init), cudaMemcpyHostToDevice), cudaSuccess);
  auto body = [&]() -> Status {
    bump<<<1, 1, 0, st>>>(dcall.as<uint64_t>(), bad.as<unsigned long long>() + 2);
    MK_CHECK(g.prepare(seed, 0, st, dcall.as<uint64_t>()));
    MK_CHECK(op->enqueue(g.args(), st));
    count_diff<<<132, 256, 0, st>>>(g.C.as<uint16_t>(), g.want(), c_rows * N, bad.as<unsigned long long>());
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  };
  // One eager call first, on call `base`'s data: it agrees on the arguments across ranks (run).
  MK_ASSERT_OK(g.prepare(seed, base, st));
  MK_ASSERT_OK(op->run(g.args(), st));
  MK_ASSERT_OK(comm->sync(st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status cap = body();
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  MK_ASSERT_OK(cap);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_TRUE(all_ok(comm->bootstrap().barrier().ok()));  // every rank's graph is ready
  for (int rep = 0; rep < replays; ++rep) ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
  const Status s = comm->sync(st);
  EXPECT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(all_ok(s.ok())) << "a rank's replays failed";
  unsigned long long got[3];
  uint64_t last = 0;
  ASSERT_EQ(cudaMemcpy(got, bad.p, sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&last, dcall.p, sizeof(last), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(last, base + uint64_t(replays)) << "replays that ran";
  EXPECT_EQ(got[2], uint64_t(replays)) << "replays compared";
  EXPECT_EQ(got[0], 0ull) << "rank " << me << ": " << got[0] << " wrong elements over " << replays
                          << " replays of " << c_rows * N << " elements; the lowest wrong index " << (got[0] ? got[1] : 0);
  // The reference itself, at the last replay's call: a few of its elements against exact sums
  // from the tags on the host (a wrong reference would make the comparison meaningless).
  std::vector<uint16_t> ref(size_t(M) * N);
  ASSERT_EQ(cudaMemcpy(ref.data(), g.C_ref.p, ref.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int wrong_ref = 0;
  for (int64_t i = 0; i < M * N; i += std::max<int64_t>(1, M * N / 257)) {
    const int64_t row = i / N, col = i % N;
    double exact = 0;
    if (ag) {
      for (int64_t k = 0; k < K; ++k)
        exact += double(tag_int(seed, int(row / Ms), 0, last, uint64_t(row) * K + k)) *
                 tag_int(seed, me, 1, last, uint64_t(col) * K + k);
    } else {
      for (int r = 0; r < W; ++r)
        for (int64_t k = 0; k < K; ++k)
          exact += double(tag_int(seed, r, 0, last, uint64_t(row) * K + k)) * tag_int(seed, r, 1, last, uint64_t(col) * K + k);
    }
    uint32_t u = uint32_t(ref[size_t(i)]) << 16;
    float f;
    memcpy(&f, &u, 4);
    // Exact in fp32, rounded once to bf16.
    wrong_ref += f != __bfloat162float(__float2bfloat16_rn(float(exact)));
  }
  EXPECT_EQ(wrong_ref, 0) << "the reference differs from exact sums at the last call";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  MK_EXPECT_OK(comm->check());
  MK_EXPECT_OK(op->destroy());
}

TEST_F(Matrix, GraphReplays) {
  const uint64_t seed = test_seed() ^ 0x9a9a;
  for (const GemmCase& c : {GemmCase{FusedKind::kAgGemm, false, "odd", 136, 264, 72, -1},
                            GemmCase{FusedKind::kGemmRs, false, "odd", 136, 264, 72, -1},
                            GemmCase{FusedKind::kGemmAr, true, "odd", 136, 264, 72, -1}}) {
    run_gemm_graph(comm_, c, seed, 200);
    if (HasFatalFailure()) return;
  }
}

TEST_F(Matrix, InFlightBlockingCudaCalls) {
  const uint64_t seed = test_seed() ^ 0x5eed;
  for (FusedKind k : {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr}) {
    run_gemm_case(comm_, GemmCase{k, false, "aligned", 256, 512, 256, -1}, seed, 3, true);
    if (HasFatalFailure()) return;
  }
  run_ring_case(comm_, RingCase{ops::SeqLayout::kZigzag, true, 2, 1, 128, 256, -1}, seed, 3, true);
  if (HasFatalFailure()) return;
  coll::Case c{comm_, ops::CollectiveKind::kAllReduce, ops::CollDType::kBF16, 8 * (int64_t(4099) * comm_->world())};
  MK_ASSERT_OK(c.init());
  coll::run_calls(c, 3, 0, [&](cudaStream_t st) { blocking_calls(st, c.ref->p, size_t(c.op->out_elems()) * 2); });
}

}  // namespace
}  // namespace test
}  // namespace mk
