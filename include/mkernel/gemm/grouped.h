// mkernel — grouped GEMM on the Hopper tile engine (sm_90a): one problem per group (an MoE
// layer's local experts), C_g = A_g · B_gᵀ, bf16 in and out, fp32 accumulation.
//
// The groups' rows live in one A (and one C) matrix, group g's at [offsets[g], offsets[g] +
// counts[g]) — the expert-major layout MoE dispatch produces. counts (and offsets) are device
// arrays read by the kernel: nothing is copied to the host, so a call is graph-capturable and
// replays with new counts. B holds one [N, K] matrix per group (the weights, [groups, N, K]).
// One persistent launch takes 128 x 256 tiles of every group (a group with M rows has
// ceil(M / 128) tile rows; an empty group none), group by group.
//
// Epilogues: kStore writes C_g = A_g · B_gᵀ ([rows, N]); kSwiGLU is the first GEMM of a gated
// MLP: B_g is [2I, K] with the gate projection in rows [0, I) and the up projection in rows
// [I, 2I) (N = 2I), and C_g[r, j] = silu(gate[r, j]) * up[r, j] ([rows, I]), computed from the
// fp32 accumulators (the 2I-wide product is never stored).
//
// Rows of C outside every group are not written. A group whose range leaves [0, rows), or a
// negative count, is bad input: its tiles are skipped and, when `error` is given, the first
// such group is recorded there (group + 1; 0 means none) — check it after the stream completed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/common/status.h"

namespace mk {
namespace gemm {

enum class GroupedEpilogue : int {
  kStore = 0,   // C[rows, N] = A · B_gᵀ per group
  kSwiGLU = 1,  // C[rows, N / 2] = silu(A · B_g[0:N/2]ᵀ) * (A · B_g[N/2:N]ᵀ) per group
};

struct GroupedArguments {
  const void* A = nullptr;  // [rows, K] bf16, row stride lda (0: K)
  const void* B = nullptr;  // [groups, N, K] bf16, packed
  void* C = nullptr;        // [rows, N] (kStore) or [rows, N / 2] (kSwiGLU) bf16, row stride ldc (0: packed)
  int groups = 0;           // 1 .. kMaxGroups
  int64_t rows = 0;         // rows of A and C (every group's range must lie inside)
  int64_t N = 0, K = 0;
  int64_t lda = 0, ldc = 0;
  const int32_t* counts = nullptr;   // device [groups]: rows of each group
  // device [groups]: first row of each group; null: packed, group g starts where g - 1 ends
  // (the sum of the counts before it).
  const int32_t* offsets = nullptr;
  GroupedEpilogue epilogue = GroupedEpilogue::kStore;
  int32_t* error = nullptr;  // optional device int: 0, or 1 + the first group with a bad range
};

constexpr int kMaxGroups = 1024;

struct GroupedConfig {
  int max_ctas = 0;  // 0: every CTA that can be resident on this context's SMs
  // How the epilogue writes C: 0 the default (2), 1 bf16 pairs straight from the accumulators,
  // 2 staged through shared memory (16-byte row pieces, full sectors; 1.05-1.3x faster on an
  // H200 where K is short). Same values either way.
  int store = 0;
};

// kInvalidArgument with the reason (shapes, alignment, null pointers, group count, epilogue);
// kNotSupported when this build has no CUTLASS. Host-only: does not read the device arrays.
Status can_implement_grouped(const GroupedArguments& args);
// Enqueues the grouped GEMM on `stream` (no host synchronization). rows == 0 is a no-op.
Status run_grouped(const GroupedArguments& args, cudaStream_t stream, const GroupedConfig& cfg = GroupedConfig{});

}  // namespace gemm
}  // namespace mk
