// The grouped GEMM's host side: argument checks, tensor maps, the grid and the launch. The
// kernel is src/gemm/kernel/grouped_gemm.cuh.
#include "mkernel/gemm/grouped.h"

#include <algorithm>
#include <cstdint>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "src/common/per_device.h"
#include "src/gemm/tensor_map.h"
#include "src/runtime/cuda_driver.h"

#if MK_WITH_CUTLASS
#include "cutlass/util/packed_stride.hpp"
#include "src/gemm/kernel/grouped_gemm.cuh"
#endif

namespace mk {
namespace gemm {

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
}  // namespace

Status can_implement_grouped(const GroupedArguments& a) {
  MK_REQUIRE(a.epilogue == GroupedEpilogue::kStore || a.epilogue == GroupedEpilogue::kSwiGLU,
             Code::kInvalidArgument, "grouped gemm: unknown epilogue %d", int(a.epilogue));
  MK_REQUIRE(a.groups >= 1 && a.groups <= kMaxGroups, Code::kInvalidArgument,
             "grouped gemm: groups %d outside 1..%d", a.groups, kMaxGroups);
  MK_REQUIRE(a.rows >= 0 && a.rows < (1ll << 31), Code::kInvalidArgument,
             "grouped gemm: rows %lld outside 0..2^31-1", (long long)a.rows);
  MK_REQUIRE(a.N > 0 && a.K > 0 && a.N < (1ll << 31) && a.K < (1ll << 31), Code::kInvalidArgument,
             "grouped gemm: N %lld and K %lld must be in 1..2^31-1", (long long)a.N, (long long)a.K);
  const bool swiglu = a.epilogue == GroupedEpilogue::kSwiGLU;
  const int64_t n_out = swiglu ? a.N / 2 : a.N;
  MK_REQUIRE(a.K % 8 == 0, Code::kInvalidArgument,
             "grouped gemm: K must be a multiple of 8 (16-byte rows), got %lld", (long long)a.K);
  if (swiglu)
    MK_REQUIRE(a.N % 16 == 0, Code::kInvalidArgument,
               "grouped gemm: SwiGLU needs N = 2I with I a multiple of 8 (16-byte output rows), got N %lld",
               (long long)a.N);
  else
    MK_REQUIRE(a.N % 8 == 0, Code::kInvalidArgument,
               "grouped gemm: N must be a multiple of 8 (16-byte rows), got %lld", (long long)a.N);
  const int64_t lda = a.lda ? a.lda : a.K, ldc = a.ldc ? a.ldc : n_out;
  MK_REQUIRE(lda >= a.K && ldc >= n_out && lda % 8 == 0 && ldc % 8 == 0, Code::kInvalidArgument,
             "grouped gemm: row strides lda %lld (>= K %lld) and ldc %lld (>= %lld) must be multiples of 8",
             (long long)lda, (long long)a.K, (long long)ldc, (long long)n_out);
  MK_REQUIRE(int64_t(a.groups) * a.N * a.K < (int64_t(1) << 40) && a.rows * lda < (int64_t(1) << 40),
             Code::kInvalidArgument, "grouped gemm: A or B exceeds 2^40 elements");
  MK_REQUIRE(a.counts, Code::kInvalidArgument, "grouped gemm: counts (device [groups]) is required");
  if (a.rows > 0) {
    MK_REQUIRE(a.A && a.B && a.C, Code::kInvalidArgument, "grouped gemm: null A, B or C");
    MK_REQUIRE(aligned16(a.A) && aligned16(a.B) && aligned16(a.C), Code::kInvalidArgument,
               "grouped gemm: A, B and C must be 16-byte aligned");
    auto overlaps = [](const void* p, int64_t pb, const void* q, int64_t qb) {
      auto x = reinterpret_cast<uintptr_t>(p), y = reinterpret_cast<uintptr_t>(q);
      return x < y + qb && y < x + pb;
    };
    const int64_t ab = a.rows * lda * 2, bb = int64_t(a.groups) * a.N * a.K * 2, cb = a.rows * ldc * 2;
    MK_REQUIRE(!overlaps(a.C, cb, a.A, ab) && !overlaps(a.C, cb, a.B, bb), Code::kInvalidArgument,
               "grouped gemm: C overlaps A or B");
  }
#if !MK_WITH_CUTLASS
  return Status(Code::kNotSupported, "grouped gemm: mkernel was built without CUTLASS headers");
#else
  return OkStatus();
#endif
}

#if MK_WITH_CUTLASS
namespace {
using namespace sm90;
constexpr int kSmem = int(sizeof(GroupedSmem));
static_assert(kSmem <= 232448, "grouped GEMM shared storage exceeds the sm_90 opt-in limit");
static_assert(kGroupedMaxGroups == kMaxGroups, "one group limit");

Status resident_ctas(int* out) {
  int dev = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  static PerDeviceValue resident;
  return resident.get(dev, [dev](int* v) -> Status {
    int sms = 0, per_sm = 0;
    MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    MK_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    MK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grouped_gemm, kThreads, kSmem));
    MK_REQUIRE(per_sm >= 1, Code::kNotSupported, "grouped gemm: the kernel cannot be resident on this device");
    *v = sms * per_sm;
    return OkStatus();
  }, out);
}

}  // namespace
#endif

Status run_grouped(const GroupedArguments& a, cudaStream_t stream, const GroupedConfig& cfg) {
  MK_CHECK(can_implement_grouped(a));
  if (a.rows == 0) return OkStatus();
#if MK_WITH_CUTLASS
  int dev = 0, major = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  MK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MK_REQUIRE(major == 9, Code::kNotSupported, "grouped gemm: needs an sm_90 GPU (this one is sm_%d*)", major);
  int resident = 0;
  MK_CHECK(resident_ctas(&resident));
  MK_REQUIRE(cfg.max_ctas >= 0 && cfg.max_ctas <= resident, Code::kInvalidArgument,
             "grouped gemm: max_ctas %d outside 0..%d (co-resident CTAs)", cfg.max_ctas, resident);
  const bool swiglu = a.epilogue == GroupedEpilogue::kSwiGLU;
  const int64_t n_out = swiglu ? a.N / 2 : a.N;
  const int64_t lda = a.lda ? a.lda : a.K, ldc = a.ldc ? a.ldc : n_out;
  const CudaDriver* drv = nullptr;
  MK_CHECK(cuda_driver(&drv));

  GroupedParams p{};
  {
    const cuuint64_t dims[2] = {cuuint64_t(a.K), cuuint64_t(a.rows)};
    const cuuint64_t strides[1] = {cuuint64_t(lda) * 2};
    const cuuint32_t box[2] = {kTileK, kTileM};
    MK_CHECK(gemm::encode_bf16_map(drv, &p.map_a, 2, a.A, dims, strides, box));
  }
  if (swiglu) {
    const int64_t I = a.N / 2;
    const cuuint64_t dims[4] = {cuuint64_t(a.K), cuuint64_t(I), 2, cuuint64_t(a.groups)};
    const cuuint64_t strides[3] = {cuuint64_t(a.K) * 2, cuuint64_t(I * a.K) * 2, cuuint64_t(a.N * a.K) * 2};
    const cuuint32_t box[4] = {kTileK, kTileN / 2, 2, 1};
    MK_CHECK(gemm::encode_bf16_map(drv, &p.map_b, 4, a.B, dims, strides, box));
  } else {
    const cuuint64_t dims[3] = {cuuint64_t(a.K), cuuint64_t(a.N), cuuint64_t(a.groups)};
    const cuuint64_t strides[2] = {cuuint64_t(a.K) * 2, cuuint64_t(a.N * a.K) * 2};
    const cuuint32_t box[3] = {kTileK, kTileN, 1};
    MK_CHECK(gemm::encode_bf16_map(drv, &p.map_b, 3, a.B, dims, strides, box));
  }
  // The CUTLASS mainloop's parameters (its MMA reads none of them; the pipeline takes the
  // per-stage byte count): built for group 0's problem.
  {
    const int M = int(std::max<int64_t>(a.rows, 1)), N = int(a.N), K = int(a.K);
    ProblemShape problem{M, N, K, 1};
    StrideA dA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
    StrideB dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
    cute::get<0>(dA) = lda;
    typename MainloopCollective::Arguments ml{static_cast<const Element*>(a.A), dA, static_cast<const Element*>(a.B),
                                              dB};
    p.mainloop = MainloopCollective::to_underlying_arguments(problem, ml, nullptr);
    MK_REQUIRE(p.mainloop.tma_transaction_bytes == uint32_t(kTileM + kTileN) * kTileK * 2, Code::kInternal,
               "grouped gemm: stage bytes %u differ from the raw loads' %d", p.mainloop.tma_transaction_bytes,
               (kTileM + kTileN) * kTileK * 2);
  }
  p.counts = a.counts;
  p.offsets = a.offsets;
  p.error = a.error;
  p.C = static_cast<__nv_bfloat16*>(a.C);
  p.ldc = ldc;
  p.groups = a.groups;
  p.rows = int(a.rows);
  p.n_out = int(n_out);
  p.k_tiles = int((a.K + kTileK - 1) / kTileK);
  p.tiles_n = int(swiglu ? (n_out + kTileN / 2 - 1) / (kTileN / 2) : (a.N + kTileN - 1) / kTileN);
  p.swiglu = swiglu ? 1 : 0;
  MK_REQUIRE(cfg.store >= 0 && cfg.store <= 2, Code::kInvalidArgument, "grouped gemm: store %d outside 0..2",
             cfg.store);
  p.staged = cfg.store == 1 ? 0 : 1;  // 0: the default, staged
  // The tile count is known only on the device: launch every resident CTA, but no more than
  // the tiles can use when every row were one group's.
  const int64_t max_tiles = ((a.rows + kTileM - 1) / kTileM + a.groups) * int64_t(p.tiles_n);
  int grid = cfg.max_ctas > 0 ? cfg.max_ctas : resident;
  grid = int(std::max<int64_t>(1, std::min<int64_t>(grid, max_tiles)));
  grouped_gemm<<<grid, kThreads, kSmem, stream>>>(p);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
#else
  (void)stream;
  (void)cfg;
  return Status(Code::kNotSupported, "grouped gemm: mkernel was built without CUTLASS headers");
#endif
}

}  // namespace gemm
}  // namespace mk
