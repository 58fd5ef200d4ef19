// mkernel — Hopper GEMM building block (sm_90a): C[M,N] = A[M,K] · B[N,K]ᵀ, bf16 in and out,
// fp32 accumulation. A, B, C row-major (B in the PyTorch weight layout). A persistent,
// warp-specialized kernel (one TMA producer warpgroup, two WGMMA consumer warpgroups, 128x256x64
// tiles) whose tile loop is mkernel's own, built on CUTLASS 4.2's SM90 collectives.
//
// Any M, N, K whose rows are 16-byte aligned (K and N multiples of 8 bf16; lda, ldb, ldc
// multiples of 8; pointers 16-byte aligned): tile tails (M, N, K not multiples of 128, 256, 64)
// are handled by TMA bounds, not rejected. A ragged row (N = 1030) is rejected: TMA stores
// write whole 16-byte units.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "mkernel/common/status.h"
#include "mkernel/device/trace.h"

namespace mk {
namespace gemm {

enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// What the epilogue does with a finished tile. (The fused operators' routed fp32 epilogue is
// internal to the library.)
enum class Epilogue : int {
  kStore = 0,  // C = A·Bᵀ (bf16) through TMA stores; C may be a peer's buffer
};

struct Arguments {
  const void* A = nullptr;  // [M, K], row stride lda (elements)
  const void* B = nullptr;  // [N, K], row stride ldb
  void* C = nullptr;        // [M, N], row stride ldc
  int64_t M = 0, N = 0, K = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;  // 0: packed (K, K, N)
  DType a_type = DType::kBF16, b_type = DType::kBF16, c_type = DType::kBF16;

  // Tiles are 128 x 256; tile id t covers rows (t % tiles_m) * 128 and columns
  // (t / tiles_m) * 256, with tiles_m = ceil(M / 128) (see tile_count()).
  // Scheduler: nullptr — static persistent order, grouped 16 tile-rows at a time for L2
  // reuse; else a device array of every tile id once, in the order CTAs should take them
  // (e.g. rank-rotated so communication can start with the first tiles): CTA b takes
  // entries b, b + grid, ...
  const int* tile_order = nullptr;
  // Per-tile signal: when non-null, tile t's flag is set to tile_flag_value (release, system
  // scope) once every element of the tile is written to C in global memory. C may be a peer's
  // buffer (a symmetric-memory peer pointer): the flag then follows the remote writes.
  uint64_t* tile_flags = nullptr;
  uint64_t tile_flag_value = 1;
  // false: set the flag to tile_flag_value; true: add tile_flag_value (a counted arrival: the
  // receiver waits for the sum of several writers' additions).
  bool tile_flag_add = false;
  Epilogue epilogue = Epilogue::kStore;
  // Non-null: run the traced kernel variant, which records per CTA and tile a producer
  // ("load") and a consumer ("compute") event into the buffer (see device/trace.h).
  const TraceBuffer* trace = nullptr;
  // Split-K (plain launches): device memory for fp32 partial products, 16-byte aligned, at
  // least split_k_workspace_bytes(M, N, K) for the automatic choice (RunConfig::split_k = 0). Without
  // one, or with tile_flags or tile_order, the GEMM runs unsplit.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

struct TileCount {
  int m = 0, n = 0;
  int total() const { return m * n; }
};
TileCount tile_count(int64_t M, int64_t N);

struct RunConfig {
  int max_ctas = 0;  // 0: every CTA that can be co-resident on the SMs this context may use
  // Split-K: 0 chooses per shape (split_k_for; 1 when no workspace is given); 1 never splits;
  // n > 1 splits K into n ranges (fewer when K has fewer 64-wide slices), which needs
  // n * M * N * 4 bytes of workspace. Each range's fp32 partial tile goes to the workspace; a
  // second kernel sums the ranges in order (deterministic) and writes C.
  int split_k = 0;
};

// Split-K, the automatic choice: how many K ranges for an M x N x K GEMM on `ctas` persistent
// CTAs (1: none). It splits only when the 128 x 256 tiles leave SMs idle, and picks the count
// that minimizes waves x (K slices per range + per-item overhead) plus the reduction's memory
// traffic (docs/gemm.md, "Split-K"). Host-only, deterministic.
int split_k_for(int64_t M, int64_t N, int64_t K, int ctas);
// The workspace the automatic choice may need for M x N x K: bytes for the largest split it
// considers (16 ranges of M x N fp32).
size_t split_k_workspace_bytes(int64_t M, int64_t N, int64_t K);

// kInvalidArgument with the reason (dtype, alignment, zero K, aliasing of C with A or B);
// kNotSupported when this build has no CUTLASS or the device is not sm_90.
Status can_implement(const Arguments& args);
// Enqueues the GEMM on `stream`. M == 0 or N == 0 is a no-op.
Status run(const Arguments& args, cudaStream_t stream, const RunConfig& cfg = RunConfig{});
// The persistent grid run() would launch (co-resident CTAs on this context's SMs). It also
// loads the kernel: call it before launching another kernel that waits on this GEMM's tile
// flags — with CUDA's lazy module loading (the default), loading a kernel waits for running
// kernels, so a waiter launched first would wait forever (its bounded wait reports it).
Status persistent_ctas(int* out);

}  // namespace gemm
}  // namespace mk
