// mkernel — the baselines the fused operators are judged against: cuBLAS then NCCL
// (chunks == 1), and cuBLAS + NCCL pipelined in row chunks on two internal streams (chunks > 1).
// bf16 in and out (collective(): fp32 too), fp32 accumulation in cuBLAS, sums in NCCL in the data
// type. Row-major throughout, B in the weight layout [N, K]. W = world size, Ms = M / W rows per
// shard, rc = Ms / chunks.
//
// Stream contract: every call is ordered after earlier work on `stream`, and later work on
// `stream` sees its results (the internal compute and comm streams fork from and join `stream`
// with events), so events recorded on `stream` time the whole op. Collective: every rank
// calls the same ops in the same order with the same shapes. One GPU per rank; call from a
// thread whose current device is the one given to create(). Built only with NCCL
// (MK_HAVE_NCCL, target mkernel_baseline).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mkernel/common/status.h"
#include "mkernel/ops/ring_attention.h"
#include "mkernel/runtime/bootstrap.h"

namespace mk {
namespace ops {
namespace baseline {

class Baselines {
 public:
  // Collective over `bs`: rank 0 makes the NCCL unique id and broadcasts it through the
  // bootstrap; each rank sets `device` current and creates its communicator, a cuBLAS handle,
  // the compute and comm streams (comm at the highest priority, so NCCL's kernels are not
  // starved by the GEMM) and events. Every rank returns the same outcome.
  static Status create(Bootstrap& bs, int device, std::unique_ptr<Baselines>* out);
  ~Baselines();
  Baselines(const Baselines&) = delete;
  Baselines& operator=(const Baselines&) = delete;

  int rank() const;
  int world() const;

  // C[M, N_loc] = allgather_rows(A_shard[Ms, K]) · B[N_loc, K]ᵀ.
  // chunks == 1: ncclAllGather into A_full [M, K] (rank-major; required), then one GEMM; ws unused.
  // chunks > 1: chunk c of every shard is gathered on the comm stream into
  //   ws [chunks][W][rc][K] (ws[c][r] = rows r*Ms + c*rc .. of the full A), and the GEMM of
  //   chunk c (strided-batched over W) runs on the compute stream once that gather is done.
  //   ws may be nullptr: A_full is then the gather buffer (same size), holding the gathered A
  //   in that chunk-major order, NOT rank-major. With ws given, A_full is not touched.
  // Needs M % W == 0 and Ms % chunks == 0.
  Status ag_gemm(const void* A_shard, const void* B, void* C, void* A_full, void* ws, int64_t M,
                 int64_t N_loc, int64_t K, int chunks, cudaStream_t stream);
  // 0 for chunks == 1, else M * K bf16.
  static size_t ag_workspace_bytes(int64_t M, int64_t K, int W, int chunks);

  // C[Ms, N] = reduce_scatter_rows(A[M, K_loc] · B[N, K_loc]ᵀ) (bf16 sum).
  // chunks == 1: GEMM into ws [M, N], then ncclReduceScatter into C.
  // chunks > 1: GEMM of rows r*Ms + c*rc .. of every shard r (strided-batched over W) into
  //   ws [chunks][W][rc][N], then ncclReduceScatter of ws[c] into C rows c*rc .. on the comm
  //   stream, overlapping the next chunk's GEMM. Needs M % W == 0 and Ms % chunks == 0.
  Status gemm_rs(const void* A, const void* B, void* C, void* ws, int64_t M, int64_t N, int64_t K_loc,
                 int chunks, cudaStream_t stream);
  // M * N bf16, any chunks.
  static size_t rs_workspace_bytes(int64_t M, int64_t N, int W, int chunks);

  // C[M, N] = allreduce(A[M, K_loc] · B[N, K_loc]ᵀ) (bf16 sum, in place in C).
  // chunks > 1: the GEMM of rows c*(M/chunks) .., then ncclAllReduce of those rows on the comm
  // stream, overlapped. Needs M % chunks == 0 (W does not enter the row split).
  Status gemm_ar(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K_loc, int chunks,
                 cudaStream_t stream);

  // The halves alone, on `stream`, for overlap-efficiency figures.
  // cuBLAS C[M, N] = A[M, K] · B[N, K]ᵀ.
  Status gemm(const void* A, const void* B, void* C, int64_t M, int64_t N, int64_t K, cudaStream_t stream);
  enum class Coll { kAllGather, kReduceScatter, kAllReduce };
  enum class DType { kBF16, kF32 };  // NCCL's ncclBfloat16 / ncclFloat32
  // One collective (sum for the reductions, in `dtype` as NCCL does them), counts as NCCL's with
  // recv_elems the receive count per rank: kAllGather sends recv_elems / W; kReduceScatter sends
  // W * recv_elems; kAllReduce sends recv_elems (send == recv is in place).
  Status collective(Coll c, const void* send, void* recv, size_t recv_elems, cudaStream_t stream,
                    DType dtype = DType::kBF16);

  // All-to-all-v of bf16 rows (row_elems elements each): to every rank r the send_rows[r] rows
  // at row send_off[r] of `send`, from every rank s recv_rows[s] rows into row recv_off[s] of
  // `recv`. One NCCL group of ncclSend / ncclRecv, self included, no call for a zero count.
  // The counts are host arrays of world() entries and must agree pairwise across ranks (rank
  // s's send_rows[r] == rank r's recv_rows[s]): the caller exchanged them beforehand.
  Status alltoallv(const void* send, const int64_t* send_rows, const int64_t* send_off, void* recv,
                   const int64_t* recv_rows, const int64_t* recv_off, int64_t row_elems, cudaStream_t stream);

  // Ring attention, unfused (op: the operator of the same shape, whose kernel computes):
  // all-gather: ncclAllGather of K and V into k_all / v_all ([W][B][S/W][Hkv][D] each), then
  //   attention over every block in one launch.
  Status ring_attn_allgather(RingAttention& op, const RingAttentionArgs& a, void* k_all, void* v_all,
                             cudaStream_t stream);
  // Per-step ring (the ring-flash-attention scheme): at step t the comm stream sends the held
  //   block to the next rank and receives the next block (ncclSend / ncclRecv) while the
  //   compute stream runs step t's attention; blocks alternate between two buffers of
  //   [B][S/W][Hkv][D] each (kbuf[0..1], vbuf[0..1]).
  Status ring_attn_sendrecv(RingAttention& op, const RingAttentionArgs& a, void* const kbuf[2], void* const vbuf[2],
                            cudaStream_t stream);

 private:
  struct Impl;
  Baselines();
  std::unique_ptr<Impl> impl_;
};

}  // namespace baseline
}  // namespace ops
}  // namespace mk
