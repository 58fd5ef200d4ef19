// cuBLAS + NCCL baselines (see include/mkernel/ops/baseline.h). Host code only: every kernel
// comes from cuBLAS or NCCL.
#include "tools/baseline/baseline.h"
#include "src/ops/ring_attention/ring_attention_testing.h"
#include "src/ops/ring_attention/ring_attention_plan.h"

#include <cublas_v2.h>
#include <nccl.h>

#include <climits>
#include <cstring>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"

namespace mk {
namespace ops {
namespace baseline {
namespace {

constexpr int64_t kElem = 2;  // bytes per bf16

const char* base_name(const char* file) {
  const char* b = strrchr(file, '/');
  return b ? b + 1 : file;
}

Status nccl_status(ncclResult_t r, const char* expr, const char* file, int line) {
  Code code = Code::kInternal;
  switch (r) {
    case ncclUnhandledCudaError: code = Code::kCudaError; break;
    case ncclSystemError: code = Code::kSystemError; break;
    case ncclInvalidArgument:
    case ncclInvalidUsage: code = Code::kInvalidArgument; break;
    case ncclRemoteError: code = Code::kRemoteError; break;
    default: break;
  }
  // NCCL's last error names the cause ("Duplicate GPU detected", a failing socket, ...).
  const char* last = ncclGetLastError(nullptr);
  const bool has_last = last != nullptr && last[0] != '\0';
  return make_status(code, "%s failed: %s (nccl %d)%s%s at %s:%d", expr, ncclGetErrorString(r), int(r),
                     has_last ? ": " : "", has_last ? last : "", base_name(file), line);
}

Status cublas_status(cublasStatus_t s, const char* expr, const char* file, int line) {
  Code code = Code::kCudaError;
  switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED: code = Code::kOutOfMemory; break;
    case CUBLAS_STATUS_INVALID_VALUE: code = Code::kInvalidArgument; break;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH: code = Code::kNotSupported; break;
    case CUBLAS_STATUS_INTERNAL_ERROR: code = Code::kInternal; break;
    default: break;
  }
  return make_status(code, "%s failed: %s (cublas %d) at %s:%d", expr, cublasGetStatusString(s), int(s),
                     base_name(file), line);
}

}  // namespace
}  // namespace baseline
}  // namespace ops
}  // namespace mk

#define MK_NCCL_CHECK(expr)                                                                   \
  do {                                                                                        \
    ncclResult_t mk_nccl_r_ = (expr);                                                         \
    if (mk_nccl_r_ != ncclSuccess) {                                                          \
      ::mk::Status mk_s_ = ::mk::ops::baseline::nccl_status(mk_nccl_r_, #expr, __FILE__, __LINE__); \
      ::mk::detail::log_check_failure(__FILE__, __LINE__, #expr, mk_s_);                      \
      return mk_s_;                                                                           \
    }                                                                                         \
  } while (0)

#define MK_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                        \
    cublasStatus_t mk_blas_r_ = (expr);                                                       \
    if (mk_blas_r_ != CUBLAS_STATUS_SUCCESS) {                                                \
      ::mk::Status mk_s_ = ::mk::ops::baseline::cublas_status(mk_blas_r_, #expr, __FILE__, __LINE__); \
      ::mk::detail::log_check_failure(__FILE__, __LINE__, #expr, mk_s_);                      \
      return mk_s_;                                                                           \
    }                                                                                         \
  } while (0)

namespace mk {
namespace ops {
namespace baseline {

namespace {

// Everything one rank holds; Baselines::Impl is this (the helpers below take it directly).
struct State {
  int rank = 0, world = 1, device = 0;
  ncclComm_t comm = nullptr;
  cublasHandle_t blas = nullptr;
  cudaStream_t compute = nullptr;      // the GEMMs of a chunked op
  cudaStream_t comm_stream = nullptr;  // the collectives of a chunked op
  cudaEvent_t fork = nullptr, compute_done = nullptr, comm_done = nullptr;
  std::vector<cudaEvent_t> chunk_ready;  // one per row chunk, grown on demand
};

// cuBLAS takes int dimensions.
Status check_dims(const char* op, int64_t M, int64_t N, int64_t K) {
  MK_REQUIRE(M > 0 && N > 0 && K > 0, Code::kInvalidArgument, "%s: M, N, K = %lld, %lld, %lld must be positive",
             op, (long long)M, (long long)N, (long long)K);
  MK_REQUIRE(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX, Code::kInvalidArgument,
             "%s: M, N, K = %lld, %lld, %lld exceed cuBLAS's int dimensions", op, (long long)M, (long long)N,
             (long long)K);
  return OkStatus();
}

// Shards and chunks are whole rows: no op pads a ragged shard or chunk.
Status check_rows(const char* op, int64_t M, int W, int chunks) {
  MK_REQUIRE(chunks >= 1, Code::kInvalidArgument, "%s: chunks = %d, must be >= 1", op, chunks);
  MK_REQUIRE(M % W == 0, Code::kInvalidArgument,
             "%s: rows must split evenly over the ranks: M = %lld is not a multiple of W = %d", op, (long long)M,
             W);
  MK_REQUIRE((M / W) % chunks == 0, Code::kInvalidArgument,
             "%s: rows must split evenly into chunks: the %lld rows of a shard (M / W) are not a multiple of "
             "chunks = %d",
             op, (long long)(M / W), chunks);
  return OkStatus();
}

Status check_device(const State& m, const char* op) {
  int cur = -1;
  MK_CUDA_CHECK(cudaGetDevice(&cur));
  MK_REQUIRE(cur == m.device, Code::kInvalidArgument,
             "%s: the current device is %d but these baselines were created on device %d", op, cur, m.device);
  return OkStatus();
}

// `batch` row-major GEMMs C_i[rows, N] = A_i[rows, K] · B[N, K]ᵀ on the handle's stream,
// A_i = A + i * stride_a, C_i = C + i * stride_c (elements), packed rows (lda = ldb = K,
// ldc = N). Row-major C = A·Bᵀ is column-major Cᵀ[N, rows] = op_T(B) · op_N(A).
Status blas_gemm(State& m, const void* A, const void* B, void* C, int64_t rows, int64_t N, int64_t K, int batch,
                 int64_t stride_a, int64_t stride_c) {
  const float one = 1.f, zero = 0.f;
  if (batch == 1) {
    MK_CUBLAS_CHECK(cublasGemmEx(m.blas, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(rows), int(K), &one, B,
                                 CUDA_R_16BF, int(K), A, CUDA_R_16BF, int(K), &zero, C, CUDA_R_16BF, int(N),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return OkStatus();
  }
  MK_CUBLAS_CHECK(cublasGemmStridedBatchedEx(m.blas, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(rows), int(K), &one, B,
                                             CUDA_R_16BF, int(K), 0, A, CUDA_R_16BF, int(K), stride_a, &zero, C,
                                             CUDA_R_16BF, int(N), stride_c, batch, CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT));
  return OkStatus();
}

Status ensure_chunk_events(State& m, int chunks) {
  while (int(m.chunk_ready.size()) < chunks) {
    cudaEvent_t e = nullptr;
    MK_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    m.chunk_ready.push_back(e);
  }
  return OkStatus();
}

// The internal streams start after the work already on `stream`.
Status fork_streams(State& m, cudaStream_t stream) {
  MK_CUDA_CHECK(cudaEventRecord(m.fork, stream));
  MK_CUDA_CHECK(cudaStreamWaitEvent(m.compute, m.fork, 0));
  MK_CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, m.fork, 0));
  return OkStatus();
}

// Later work on `stream` starts after both internal streams.
Status join_streams(State& m, cudaStream_t stream) {
  MK_CUDA_CHECK(cudaEventRecord(m.compute_done, m.compute));
  MK_CUDA_CHECK(cudaEventRecord(m.comm_done, m.comm_stream));
  MK_CUDA_CHECK(cudaStreamWaitEvent(stream, m.compute_done, 0));
  MK_CUDA_CHECK(cudaStreamWaitEvent(stream, m.comm_done, 0));
  return OkStatus();
}

// Runs a chunked pipeline between fork and join. The join is enqueued even when the body
// fails part-way, so `stream` never runs ahead of what was enqueued.
template <class Body>
Status pipelined(State& m, cudaStream_t stream, int chunks, Body body) {
  MK_CHECK(ensure_chunk_events(m, chunks));
  MK_CUBLAS_CHECK(cublasSetStream(m.blas, m.compute));
  MK_CHECK(fork_streams(m, stream));
  const Status s = body();
  const Status j = join_streams(m, stream);
  return s.ok() ? j : s;
}

const char* ptr_at(const void* p, int64_t elems) { return static_cast<const char*>(p) + elems * kElem; }
char* ptr_at(void* p, int64_t elems) { return static_cast<char*>(p) + elems * kElem; }

Status setup_local(State& m) {
  MK_CUDA_CHECK(cudaSetDevice(m.device));
  MK_CUBLAS_CHECK(cublasCreate(&m.blas));
  int least = 0, greatest = 0;
  MK_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  MK_CUDA_CHECK(cudaStreamCreateWithPriority(&m.compute, cudaStreamNonBlocking, least));
  MK_CUDA_CHECK(cudaStreamCreateWithPriority(&m.comm_stream, cudaStreamNonBlocking, greatest));
  for (cudaEvent_t* e : {&m.fork, &m.compute_done, &m.comm_done})
    MK_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  return OkStatus();
}

}  // namespace

struct Baselines::Impl : State {};

Baselines::Baselines() : impl_(new Impl) {}

Baselines::~Baselines() {
  Impl& m = *impl_;
  // Abort, not destroy: nothing of ours is in flight any more (every call was synchronized),
  // and after a failed job a destroy could wait for a peer that is gone.
  if (m.comm != nullptr) ncclCommAbort(m.comm);
  if (m.blas != nullptr) cublasDestroy(m.blas);
  for (cudaEvent_t e : m.chunk_ready) cudaEventDestroy(e);
  for (cudaEvent_t e : {m.fork, m.compute_done, m.comm_done})
    if (e != nullptr) cudaEventDestroy(e);
  if (m.compute != nullptr) cudaStreamDestroy(m.compute);
  if (m.comm_stream != nullptr) cudaStreamDestroy(m.comm_stream);
}

int Baselines::rank() const { return impl_->rank; }
int Baselines::world() const { return impl_->world; }

Status Baselines::create(Bootstrap& bs, int device, std::unique_ptr<Baselines>* out) {
  MK_REQUIRE(out != nullptr, Code::kInvalidArgument, "Baselines::create: out is null");
  std::unique_ptr<Baselines> b(new Baselines());
  Impl& m = *b->impl_;
  m.rank = bs.rank();
  m.world = bs.size();
  m.device = device;
  // Every rank learns whether all set up before any enters NCCL's init, which would otherwise
  // wait for a rank that already gave up.
  Status local = setup_local(m);
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  if (local.ok() && m.rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) local = nccl_status(r, "ncclGetUniqueId(&id)", __FILE__, __LINE__);
  }
  MK_CHECK(agree(bs, local, "baseline setup"));
  MK_CHECK(bs.broadcast(&id, sizeof(id), 0));
  Status init;
  const ncclResult_t r = ncclCommInitRank(&m.comm, m.world, id, m.rank);
  if (r != ncclSuccess) {
    m.comm = nullptr;
    init = nccl_status(r, "ncclCommInitRank(&m.comm, m.world, id, m.rank)", __FILE__, __LINE__);
  }
  MK_CHECK(agree(bs, init, "baseline ncclCommInitRank"));
  *out = std::move(b);
  return OkStatus();
}

size_t Baselines::ag_workspace_bytes(int64_t M, int64_t K, int W, int chunks) {
  return chunks > 1 ? size_t(M) * size_t(K) * kElem : 0;
}

size_t Baselines::rs_workspace_bytes(int64_t M, int64_t N, int W, int chunks) {
  return size_t(M) * size_t(N) * kElem;
}

Status Baselines::ag_gemm(const void* A_shard, const void* B, void* C, void* A_full, void* ws, int64_t M,
                          int64_t N_loc, int64_t K, int chunks, cudaStream_t stream) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "ag_gemm"));
  MK_CHECK(check_dims("ag_gemm", M, N_loc, K));
  MK_CHECK(check_rows("ag_gemm", M, m.world, chunks));
  MK_REQUIRE(A_shard != nullptr && B != nullptr && C != nullptr, Code::kInvalidArgument,
             "ag_gemm: A_shard, B and C must be non-null");
  const int W = m.world;
  const int64_t Ms = M / W;
  if (chunks == 1) {
    MK_REQUIRE(A_full != nullptr, Code::kInvalidArgument, "ag_gemm: chunks = 1 gathers into A_full, which is null");
    MK_NCCL_CHECK(ncclAllGather(A_shard, A_full, size_t(Ms * K), ncclBfloat16, m.comm, stream));
    MK_CUBLAS_CHECK(cublasSetStream(m.blas, stream));
    return blas_gemm(m, A_full, B, C, M, N_loc, K, 1, 0, 0);
  }
  void* gathered = ws != nullptr ? ws : A_full;
  MK_REQUIRE(gathered != nullptr, Code::kInvalidArgument,
             "ag_gemm: chunks > 1 gathers into ws (ag_workspace_bytes) or, when ws is null, A_full; both are null");
  const int64_t rc = Ms / chunks;
  return pipelined(m, stream, chunks, [&]() -> Status {
    for (int c = 0; c < chunks; ++c) {
      void* slot = ptr_at(gathered, c * W * rc * K);  // ws[c]: [W][rc][K]
      MK_NCCL_CHECK(ncclAllGather(ptr_at(A_shard, c * rc * K), slot, size_t(rc * K), ncclBfloat16, m.comm,
                                  m.comm_stream));
      MK_CUDA_CHECK(cudaEventRecord(m.chunk_ready[c], m.comm_stream));
      MK_CUDA_CHECK(cudaStreamWaitEvent(m.compute, m.chunk_ready[c], 0));
      // Batch r: rank r's chunk c, rows r*Ms + c*rc .. of C.
      MK_CHECK(blas_gemm(m, slot, B, ptr_at(C, c * rc * N_loc), rc, N_loc, K, W, rc * K, Ms * N_loc));
    }
    return OkStatus();
  });
}

Status Baselines::gemm_rs(const void* A, const void* B, void* C, void* ws, int64_t M, int64_t N, int64_t K_loc,
                          int chunks, cudaStream_t stream) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "gemm_rs"));
  MK_CHECK(check_dims("gemm_rs", M, N, K_loc));
  MK_CHECK(check_rows("gemm_rs", M, m.world, chunks));
  MK_REQUIRE(A != nullptr && B != nullptr && C != nullptr && ws != nullptr, Code::kInvalidArgument,
             "gemm_rs: A, B, C and ws (rs_workspace_bytes) must be non-null");
  const int W = m.world;
  const int64_t Ms = M / W;
  if (chunks == 1) {
    MK_CUBLAS_CHECK(cublasSetStream(m.blas, stream));
    MK_CHECK(blas_gemm(m, A, B, ws, M, N, K_loc, 1, 0, 0));
    MK_NCCL_CHECK(ncclReduceScatter(ws, C, size_t(Ms * N), ncclBfloat16, ncclSum, m.comm, stream));
    return OkStatus();
  }
  const int64_t rc = Ms / chunks;
  return pipelined(m, stream, chunks, [&]() -> Status {
    for (int c = 0; c < chunks; ++c) {
      void* slot = ptr_at(ws, c * W * rc * N);  // ws[c]: [W][rc][N], block r for rank r
      // Batch r: rows r*Ms + c*rc .. of A.
      MK_CHECK(blas_gemm(m, ptr_at(A, c * rc * K_loc), B, slot, rc, N, K_loc, W, Ms * K_loc, rc * N));
      MK_CUDA_CHECK(cudaEventRecord(m.chunk_ready[c], m.compute));
      MK_CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, m.chunk_ready[c], 0));
      MK_NCCL_CHECK(ncclReduceScatter(slot, ptr_at(C, c * rc * N), size_t(rc * N), ncclBfloat16, ncclSum, m.comm,
                                      m.comm_stream));
    }
    return OkStatus();
  });
}

Status Baselines::gemm_ar(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K_loc, int chunks,
                          cudaStream_t stream) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "gemm_ar"));
  MK_CHECK(check_dims("gemm_ar", M, N, K_loc));
  MK_CHECK(check_rows("gemm_ar", M, 1, chunks));
  MK_REQUIRE(A != nullptr && B != nullptr && C != nullptr, Code::kInvalidArgument,
             "gemm_ar: A, B and C must be non-null");
  if (chunks == 1) {
    MK_CUBLAS_CHECK(cublasSetStream(m.blas, stream));
    MK_CHECK(blas_gemm(m, A, B, C, M, N, K_loc, 1, 0, 0));
    MK_NCCL_CHECK(ncclAllReduce(C, C, size_t(M * N), ncclBfloat16, ncclSum, m.comm, stream));
    return OkStatus();
  }
  const int64_t rc = M / chunks;
  return pipelined(m, stream, chunks, [&]() -> Status {
    for (int c = 0; c < chunks; ++c) {
      void* rows = ptr_at(C, c * rc * N);
      MK_CHECK(blas_gemm(m, ptr_at(A, c * rc * K_loc), B, rows, rc, N, K_loc, 1, 0, 0));
      MK_CUDA_CHECK(cudaEventRecord(m.chunk_ready[c], m.compute));
      MK_CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, m.chunk_ready[c], 0));
      MK_NCCL_CHECK(ncclAllReduce(rows, rows, size_t(rc * N), ncclBfloat16, ncclSum, m.comm, m.comm_stream));
    }
    return OkStatus();
  });
}

Status Baselines::gemm(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "gemm"));
  MK_CHECK(check_dims("gemm", M, N, K));
  MK_REQUIRE(A != nullptr && B != nullptr && C != nullptr, Code::kInvalidArgument, "gemm: A, B and C must be non-null");
  MK_CUBLAS_CHECK(cublasSetStream(m.blas, stream));
  return blas_gemm(m, A, B, C, M, N, K, 1, 0, 0);
}

Status Baselines::collective(Coll c, const void* send, void* recv, size_t recv_elems, cudaStream_t stream,
                             DType dtype) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "collective"));
  MK_REQUIRE(send != nullptr && recv != nullptr, Code::kInvalidArgument, "collective: send and recv must be non-null");
  MK_REQUIRE(dtype == DType::kBF16 || dtype == DType::kF32, Code::kInvalidArgument, "collective: unknown dtype %d",
             int(dtype));
  const ncclDataType_t t = dtype == DType::kF32 ? ncclFloat32 : ncclBfloat16;
  switch (c) {
    case Coll::kAllGather:
      MK_REQUIRE(recv_elems % size_t(m.world) == 0, Code::kInvalidArgument,
                 "collective: allgather of %zu elements does not split evenly over W = %d ranks", recv_elems, m.world);
      MK_NCCL_CHECK(ncclAllGather(send, recv, recv_elems / size_t(m.world), t, m.comm, stream));
      return OkStatus();
    case Coll::kReduceScatter:
      MK_NCCL_CHECK(ncclReduceScatter(send, recv, recv_elems, t, ncclSum, m.comm, stream));
      return OkStatus();
    case Coll::kAllReduce:
      MK_NCCL_CHECK(ncclAllReduce(send, recv, recv_elems, t, ncclSum, m.comm, stream));
      return OkStatus();
  }
  return make_status(Code::kInvalidArgument, "collective: unknown kind %d", int(c));
}

Status Baselines::alltoallv(const void* send, const int64_t* send_rows, const int64_t* send_off, void* recv,
                            const int64_t* recv_rows, const int64_t* recv_off, int64_t row_elems, cudaStream_t stream) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "alltoallv"));
  MK_REQUIRE(send != nullptr && recv != nullptr && send_rows != nullptr && send_off != nullptr &&
                 recv_rows != nullptr && recv_off != nullptr && row_elems > 0,
             Code::kInvalidArgument, "alltoallv: null buffer or count array, or row_elems %lld", (long long)row_elems);
  const int W = m.world;
  for (int r = 0; r < W; ++r)
    MK_REQUIRE(send_rows[r] >= 0 && send_off[r] >= 0 && recv_rows[r] >= 0 && recv_off[r] >= 0,
               Code::kInvalidArgument, "alltoallv: negative count or offset for rank %d", r);
  // The group is ended even when a call in it fails, so NCCL is not left inside a group.
  Status s;
  auto call = [&](ncclResult_t r, const char* expr) {
    if (s.ok() && r != ncclSuccess) s = nccl_status(r, expr, __FILE__, __LINE__);
  };
  MK_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < W; ++r) {
    if (send_rows[r] > 0)
      call(ncclSend(ptr_at(send, send_off[r] * row_elems), size_t(send_rows[r] * row_elems), ncclBfloat16, r, m.comm,
                    stream),
           "ncclSend");
    if (recv_rows[r] > 0)
      call(ncclRecv(ptr_at(recv, recv_off[r] * row_elems), size_t(recv_rows[r] * row_elems), ncclBfloat16, r, m.comm,
                    stream),
           "ncclRecv");
  }
  call(ncclGroupEnd(), "ncclGroupEnd()");
  return s;
}

Status Baselines::ring_attn_allgather(RingAttention& op, const RingAttentionArgs& a, void* k_all, void* v_all,
                                      cudaStream_t stream) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "ring_attn_allgather"));
  MK_REQUIRE(k_all && v_all, Code::kInvalidArgument, "ring_attn_allgather: null gather buffers");
  MK_REQUIRE(RingAttentionTesting::plan(op).world == m.world, Code::kInvalidArgument, "ring_attn_allgather: the operator has %d ranks, NCCL %d",
             RingAttentionTesting::plan(op).world, m.world);
  const size_t blk = op.block_elems();
  MK_NCCL_CHECK(ncclGroupStart());
  MK_NCCL_CHECK(ncclAllGather(a.k, k_all, blk, ncclBfloat16, m.comm, stream));
  MK_NCCL_CHECK(ncclAllGather(a.v, v_all, blk, ncclBfloat16, m.comm, stream));
  MK_NCCL_CHECK(ncclGroupEnd());
  return RingAttentionTesting::enqueue_compute(op, a, -1, k_all, v_all, stream);
}

Status Baselines::ring_attn_sendrecv(RingAttention& op, const RingAttentionArgs& a, void* const kbuf[2],
                                     void* const vbuf[2], cudaStream_t stream) {
  Impl& m = *impl_;
  MK_CHECK(check_device(m, "ring_attn_sendrecv"));
  MK_REQUIRE(kbuf[0] && kbuf[1] && vbuf[0] && vbuf[1], Code::kInvalidArgument, "ring_attn_sendrecv: null buffers");
  const int W = m.world, me = m.rank;
  const RingPlan& p = RingAttentionTesting::plan(op);
  MK_REQUIRE(p.world == W, Code::kInvalidArgument, "ring_attn_sendrecv: the operator has %d ranks, NCCL %d", p.world, W);
  const size_t blk = op.block_elems();
  // Both streams start after what `stream` holds.
  MK_CUDA_CHECK(cudaEventRecord(m.fork, stream));
  MK_CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, m.fork, 0));
  const void* cur_k = a.k;
  const void* cur_v = a.v;
  for (int t = 0; t < W; ++t) {
    const RingStep& s = p.steps[me][t];
    void* nk = kbuf[t % 2];
    void* nv = vbuf[t % 2];
    if (s.send_to >= 0) {
      // The receive buffer was last read by step t - 1's attention.
      MK_CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, m.compute_done, 0));
      MK_NCCL_CHECK(ncclGroupStart());
      MK_NCCL_CHECK(ncclSend(cur_k, blk, ncclBfloat16, s.send_to, m.comm, m.comm_stream));
      MK_NCCL_CHECK(ncclSend(cur_v, blk, ncclBfloat16, s.send_to, m.comm, m.comm_stream));
      MK_NCCL_CHECK(ncclRecv(nk, blk, ncclBfloat16, s.recv_from, m.comm, m.comm_stream));
      MK_NCCL_CHECK(ncclRecv(nv, blk, ncclBfloat16, s.recv_from, m.comm, m.comm_stream));
      MK_NCCL_CHECK(ncclGroupEnd());
    }
    MK_CHECK(RingAttentionTesting::enqueue_compute(op, a, t, cur_k, cur_v, stream));
    MK_CUDA_CHECK(cudaEventRecord(m.compute_done, stream));
    if (s.send_to >= 0) {
      // The next step computes on what arrived.
      MK_CUDA_CHECK(cudaEventRecord(m.comm_done, m.comm_stream));
      MK_CUDA_CHECK(cudaStreamWaitEvent(stream, m.comm_done, 0));
      cur_k = nk;
      cur_v = nv;
    }
  }
  return OkStatus();
}

}  // namespace baseline
}  // namespace ops
}  // namespace mk
