// The fused GEMM collectives' benchmark inputs, shared by `mkernel bench` (tools/bench/fused_gemm.cu)
// and bench/bench_fused_threads.cu: this rank's A and B drawn from a hash of (seed, row, column),
// the reference inputs every rank can rebuild, and the comparison of a result with the reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/ops/fused.h"
#include "tools/bench_common.h"

namespace mk {
namespace bench {

// rows x cols at p (leading dimension ld): element (r + row0, c) of a src_cols-wide matrix drawn
// from `seed`. ints: integers in [-2, 2] (exact products); else approximately normal values (sum
// of 4 uniforms).
static __global__ void fill_bf16(__nv_bfloat16* p, int64_t rows, int64_t cols, int64_t ld, uint64_t seed,
                                 int64_t row0, int64_t src_cols, bool ints) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const uint64_t h = mix(seed ^ (uint64_t(r + row0) * uint64_t(src_cols) + uint64_t(c)));
    float v;
    if (ints) v = float(int(h % 5) - 2);
    else v = (float(h & 0xffff) + float((h >> 16) & 0xffff) + float((h >> 32) & 0xffff) + float(h >> 48)) / 65536.f - 2.f;
    p[r * ld + c] = __float2bfloat16(v);
  }
}

// Counts the 16-bit words where a and b differ into *bad.
static __global__ void count_diff(const uint16_t* a, const uint16_t* b, int64_t n, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (a[i] != b[i]) atomicAdd(bad, 1ull);
}

// This rank's A ([rows of its shard, K] for AG, else [M, K]) and B ([N, K]); with `ints` also the
// reference inputs of one unfused GEMM that every rank rebuilds: AG the gathered A [M, K] (B is
// its own); RS/AR the ranks' A and B side by side, Aref [M, W*K] and Bref [N, W*K]. AG's shard:
// rows [shard_row0, shard_row0 + shard_rows) of the gathered A (-1: M / W rows at me * M / W).
inline cudaError_t fill_fused_inputs(ops::FusedKind kind, int64_t M, int64_t N, int64_t K, int W, int me, bool ints,
                                     __nv_bfloat16* A, __nv_bfloat16* B, __nv_bfloat16* Aref, __nv_bfloat16* Bref,
                                     cudaStream_t st, int64_t shard_row0 = -1, int64_t shard_rows = -1) {
  const uint64_t sa = 0x5eed0000, sb = 0x5eed1000;
  if (shard_rows < 0) shard_row0 = me * (M / W), shard_rows = M / W;
  if (kind == ops::FusedKind::kAgGemm) {
    fill_bf16<<<264, 256, 0, st>>>(A, shard_rows, K, K, sa, shard_row0, K, ints);
    fill_bf16<<<264, 256, 0, st>>>(B, N, K, K, sb + me, 0, K, ints);
    if (ints) fill_bf16<<<264, 256, 0, st>>>(Aref, M, K, K, sa, 0, K, ints);
  } else {
    fill_bf16<<<264, 256, 0, st>>>(A, M, K, K, sa + me, 0, K, ints);
    fill_bf16<<<264, 256, 0, st>>>(B, N, K, K, sb + me, 0, K, ints);
    if (ints)
      for (int r = 0; r < W; ++r) {
        fill_bf16<<<264, 256, 0, st>>>(Aref + r * K, M, K, W * K, sa + r, 0, K, ints);
        fill_bf16<<<264, 256, 0, st>>>(Bref + r * K, N, K, W * K, sb + r, 0, K, ints);
      }
  }
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace mk
