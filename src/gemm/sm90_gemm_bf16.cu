// The persistent sm_90a bf16 GEMM's host side: argument checks, the grid, the choice of kernel
// variant and its launch. The kernel is src/gemm/kernel/persistent_gemm.cuh (mainloop,
// epilogues, schedulers and the communication-role policy each in their own header).
#include "mkernel/gemm/gemm.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "src/common/per_device.h"
#include "mkernel/device/trace.h"
#include "src/comm/device_program.h"
#include "src/gemm/fused_launch.h"
#include "src/runtime/cuda_driver.h"

#if MK_WITH_CUTLASS
#include "cutlass/util/packed_stride.hpp"
#include "src/comm/comm_role.cuh"
#include "src/gemm/kernel/persistent_gemm.cuh"
#endif

namespace mk {
namespace gemm {

#if MK_WITH_CUTLASS
namespace sm90 {
// The variants: plain launches (static schedule, no communication) and fused launches (dynamic
// schedule, the communication role), each traced or not.
constexpr int kPlainSmem = int(sizeof(SharedStorage<comm::NoComm>));
constexpr int kFusedSmem = int(sizeof(SharedStorage<comm::CommRole>));

// The fields every variant shares; tiles_m/n follow tile_count(). (Not a template: nvcc's host
// pass cannot spell the CUTLASS collectives' types inside one.)
Status make_params(const Arguments& a, ParamsCore* out) {
  const int M = int(a.M), N = int(a.N), K = int(a.K);
  ProblemShape problem{M, N, K, 1};
  StrideA dA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
  StrideB dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
  StrideD dD = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(M, N, 1));
  cute::get<0>(dA) = a.lda ? a.lda : a.K;
  cute::get<0>(dB) = a.ldb ? a.ldb : a.K;
  cute::get<0>(dD) = a.ldc ? a.ldc : a.N;
  typename MainloopCollective::Arguments ml{static_cast<const Element*>(a.A), dA, static_cast<const Element*>(a.B), dB};
  typename EpilogueCollective::Arguments ep{};
  ep.thread.alpha = 1.0f;
  ep.thread.beta = 0.0f;
  ep.ptr_C = nullptr;
  ep.dC = StrideC(dD);
  ep.ptr_D = static_cast<Element*>(a.C);
  ep.dD = dD;
  MK_REQUIRE(MainloopCollective::can_implement(problem, ml) && EpilogueCollective::can_implement(problem, ep),
             Code::kInvalidArgument, "gemm: CUTLASS collectives reject this problem (M %d, N %d, K %d)", M, N, K);
  ParamsCore& p = *out;
  p = ParamsCore{};
  p.problem = problem;
  p.mainloop = MainloopCollective::to_underlying_arguments(problem, ml, nullptr);
  p.epilogue = EpilogueCollective::to_underlying_arguments(problem, ep, nullptr);
  const TileCount tc = tile_count(a.M, a.N);
  p.tiles_m = tc.m;
  p.tiles_n = tc.n;
  p.k_tiles = (K + 63) / 64;
  p.splits = 1;  // launch() sets a split
  p.k_per_split = p.k_tiles;
  p.sched.tiles_m = tc.m;  // the static scheduler's grouped order walks these
  p.sched.tiles_n = tc.n;
  p.sched.order = a.tile_order;
  p.signal.flags = a.tile_flags;
  p.signal.value = a.tile_flag_value;
  p.signal.add = a.tile_flag_add ? 1 : 0;
  p.epi = EpiKind::kStore;
  if (a.trace) p.trace = *a.trace;
  return OkStatus();
}
}  // namespace sm90
#endif  // MK_WITH_CUTLASS

#if MK_WITH_CUTLASS
namespace sm90 {
// Split-K's second kernel: C[m, n..n+7] = bf16(sum over ranges r = 0, 1, ... of
// partials[r][m][n..n+7]), each thread 8 columns (N % 8 == 0), the ranges summed in order.
__global__ void splitk_reduce(const float* __restrict__ partials, int splits, int64_t M, int64_t N,
                              __nv_bfloat16* __restrict__ C, int64_t ldc) {
  const int64_t groups_per_row = N / 8, groups = M * groups_per_row, plane = M * N;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = g / groups_per_row, n = (g - m * groups_per_row) * 8;
    const float* p = partials + m * N + n;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < splits; ++r, p += plane) {
      const float4 x = __ldcs(reinterpret_cast<const float4*>(p)), y = __ldcs(reinterpret_cast<const float4*>(p) + 1);
      acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w;
      acc[4] += y.x, acc[5] += y.y, acc[6] += y.z, acc[7] += y.w;
    }
    uint4 out;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
    for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    *reinterpret_cast<uint4*>(C + m * ldc + n) = out;
  }
}
}  // namespace sm90
#endif  // MK_WITH_CUTLASS

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF32: return "fp32";
  }
  return "?";
}
}  // namespace

namespace {
// check_c false: C is not written (the routed epilogue of a fused launch): skip its checks.
Status check_args(const Arguments& a, bool check_c) {
  MK_REQUIRE(a.epilogue == Epilogue::kStore, Code::kInvalidArgument, "gemm: unknown epilogue %d", int(a.epilogue));
  MK_REQUIRE(a.a_type == DType::kBF16 && a.b_type == DType::kBF16 && a.c_type == DType::kBF16,
             Code::kInvalidArgument, "gemm: only bf16 A, B and C are implemented (got %s, %s, %s)",
             dtype_name(a.a_type), dtype_name(a.b_type), dtype_name(a.c_type));
  MK_REQUIRE(a.M >= 0 && a.N >= 0 && a.K >= 0, Code::kInvalidArgument,
             "gemm: negative shape (%lld, %lld, %lld)", (long long)a.M, (long long)a.N, (long long)a.K);
  MK_REQUIRE(a.K > 0, Code::kInvalidArgument, "gemm: K must be > 0 (C = A·Bᵀ over an empty K is not a GEMM)");
  MK_REQUIRE(a.M < (1ll << 31) && a.N < (1ll << 31) && a.K < (1ll << 31), Code::kInvalidArgument,
             "gemm: each of M, N, K must be < 2^31");
  const int64_t lda = a.lda ? a.lda : a.K, ldb = a.ldb ? a.ldb : a.K, ldc = a.ldc ? a.ldc : a.N;
  MK_REQUIRE(lda >= a.K && ldb >= a.K && ldc >= a.N, Code::kInvalidArgument,
             "gemm: leading dimensions (%lld, %lld, %lld) shorter than the rows (%lld, %lld, %lld)",
             (long long)lda, (long long)ldb, (long long)ldc, (long long)a.K, (long long)a.K, (long long)a.N);
  // Rows are 16-byte aligned: K (rows of A and B) and N (rows of C) are multiples of 8 bf16.
  // Measured on an H200: with N = 1030 and ldc = 1032 the TMA store wrote the 16-byte
  // remainder of each row (2 elements past N), so a ragged row end is rejected, not clipped.
  MK_REQUIRE(a.K % 8 == 0 && a.N % 8 == 0, Code::kInvalidArgument,
             "gemm: K and N must be multiples of 8 (16-byte rows), got K %lld, N %lld; pad them "
             "(zeros in A/B, ignore the extra columns of C)",
             (long long)a.K, (long long)a.N);
  MK_REQUIRE(lda % 8 == 0 && ldb % 8 == 0 && ldc % 8 == 0, Code::kInvalidArgument,
             "gemm: row strides must be multiples of 8 elements (16 bytes): lda %lld, ldb %lld, ldc %lld",
             (long long)lda, (long long)ldb, (long long)ldc);
  if (a.M > 0 && a.N > 0) {
    MK_REQUIRE(a.A && a.B && a.C, Code::kInvalidArgument, "gemm: null pointer");
    MK_REQUIRE(aligned16(a.A) && aligned16(a.B) && aligned16(a.C), Code::kInvalidArgument,
               "gemm: A, B and C must be 16-byte aligned");
  }
  if (check_c && a.M > 0 && a.N > 0) {
    auto overlaps = [](const void* p, int64_t pb, const void* q, int64_t qb) {
      auto x = reinterpret_cast<uintptr_t>(p), y = reinterpret_cast<uintptr_t>(q);
      return x < y + qb && y < x + pb;
    };
    const int64_t ab = (a.M - 1) * lda * 2 + a.K * 2, bb = (a.N - 1) * ldb * 2 + a.K * 2,
                  cb = (a.M - 1) * ldc * 2 + a.N * 2;
    MK_REQUIRE(!overlaps(a.C, cb, a.A, ab) && !overlaps(a.C, cb, a.B, bb), Code::kInvalidArgument,
               "gemm: C overlaps A or B");
  }
#if !MK_WITH_CUTLASS
  return Status(Code::kNotSupported, "gemm: mkernel was built without CUTLASS headers");
#else
  return OkStatus();
#endif
}
}  // namespace

Status can_implement(const Arguments& a) { return check_args(a, true); }

namespace {
constexpr int kMaxSplits = 16;
constexpr int kMinSlicesPerSplit = 4;  // 256 of K per range at least
// The K ranges a request of n gives for k_tiles slices: ranges of ceil(k_tiles / n) slices, so
// none is empty (7 requested over 8 slices gives 4 ranges of 2).
void split_ranges(int k_tiles, int n, int* splits, int* per) {
  n = std::max(1, std::min(n, k_tiles));
  *per = (k_tiles + n - 1) / n;
  *splits = (k_tiles + *per - 1) / *per;
}
}  // namespace

int split_k_for(int64_t M, int64_t N, int64_t K, int ctas) {
  if (M <= 0 || N <= 0 || K <= 0 || ctas <= 0) return 1;
  const int64_t tiles = tile_count(M, N).total();
  const int k_tiles = int((K + 63) / 64);
  if (tiles >= ctas) return 1;
  // Cost in units of one 128 x 256 x 64 slice on one SM (~0.56 us on an H200): waves of work
  // items times (slices per range + ~4 of prologue and epilogue per item), plus, when split,
  // the partials written and read back and C written at ~3 TB/s (~1.7 MB per unit) and ~6
  // units for the reduction kernel's launch and tail.
  auto cost = [&](int splits, int per) {
    const int64_t items = tiles * splits, waves = (items + ctas - 1) / ctas;
    double c = double(waves) * (per + 4);
    if (splits > 1) c += (8.0 * splits * M * N + 2.0 * M * N) / 1.7e6 + 6.0;
    return c;
  };
  int best = 1;
  double best_cost = cost(1, k_tiles);
  for (int n = 2; n <= kMaxSplits && k_tiles / n >= kMinSlicesPerSplit; ++n) {
    int splits = 0, per = 0;
    split_ranges(k_tiles, n, &splits, &per);
    const double c = cost(splits, per);
    if (c < best_cost * 0.97) best = splits, best_cost = c;  // a clear gain only
  }
  return best;
}

size_t split_k_workspace_bytes(int64_t M, int64_t N, int64_t K) {
  (void)K;
  return size_t(kMaxSplits) * size_t(std::max<int64_t>(M, 0)) * size_t(std::max<int64_t>(N, 0)) * 4;
}

TileCount tile_count(int64_t M, int64_t N) {
  TileCount c;
  c.m = static_cast<int>((M + 127) / 128);
  c.n = static_cast<int>((N + 255) / 256);
  return c;
}

Status persistent_ctas(int* out) {
#if MK_WITH_CUTLASS
  int dev = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  // Every launch asks: the attributes, loads and the occupancy query run once per device.
  static PerDeviceValue resident;
  return resident.get(dev, [dev](int* v) -> Status {
    int sms = 0, per_sm = 0;
    // Under MPS this is the share of SMs this client may use, not the chip's count.
    MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    // All variants have the same resources; loading them here keeps later launches load-free.
    using namespace sm90;
    static_assert(kPlainSmem <= kFusedSmem, "the occupancy below holds for every variant");
    MK_CUDA_CHECK(cudaFuncSetAttribute(persistent_gemm<false, StaticScheduler, comm::NoComm>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kPlainSmem));
    MK_CUDA_CHECK(cudaFuncSetAttribute(persistent_gemm<true, StaticScheduler, comm::NoComm>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kPlainSmem));
    MK_CUDA_CHECK(cudaFuncSetAttribute(persistent_gemm<false, DynamicScheduler, comm::CommRole>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kFusedSmem));
    MK_CUDA_CHECK(cudaFuncSetAttribute(persistent_gemm<true, DynamicScheduler, comm::CommRole>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kFusedSmem));
    MK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, persistent_gemm<false, DynamicScheduler, comm::CommRole>, kThreads, kFusedSmem));
    MK_REQUIRE(per_sm >= 1, Code::kNotSupported, "gemm: the kernel cannot be resident on this device");
    *v = sms * per_sm;
    return OkStatus();
  }, out);
#else
  *out = 0;
  return Status(Code::kNotSupported, "gemm: mkernel was built without CUTLASS headers");
#endif
}

namespace {

#if MK_WITH_CUTLASS
// Before a fused launch with the controller (one thread): hands the last call's settled split
// to the host (SplitCtl::host_mean), zeroes the op and tile counters and starts the controller's
// call — from the split the last call settled on, else from the count
// role_counts[0] holds (the option, the learned start or set_comm_ctas) — within
// [1, min(grid - 1, max(32, grid / 2))].
__global__ void fused_begin(int* op_counter, int* tile_counter, int* role_counts, comm::SplitCtl* c, int grid) {
  if (op_counter) *op_counter = 0;
  *tile_counter = 0;
  if (c->has_mean && c->host_mean) *reinterpret_cast<volatile int32_t*>(c->host_mean) = c->last_mean;
  comm::SplitLimits lim = c->limits;
  lim.grid = grid;
  lim.lo = max(lim.lo, 1);
  if (c->hi_auto) lim.hi = min(grid - 1, max(32, grid / 2));
  lim.hi = max(min(lim.hi, grid - 1), lim.lo);
  c->limits = lim;
  const int start = comm::split_clamp(c->has_mean ? c->last_mean : *role_counts, lim);
  *role_counts = start;
  // The clock set one interval back: the first work item of the call samples at once.
  c->gap_ns = comm::split_interval_ns(c->interval_ns, c->sample_ns, grid);
  comm::split_begin(&c->state, start, lim, static_cast<int64_t>(device::trace_now_ns()) - c->gap_ns);
  c->ops_done = 0;
  c->stalls = 0;
  c->stalled = 0;
  c->next_force = 0;
  c->lock = 0;
  __threadfence();
}
#endif

Status launch(const Arguments& a, const FusedLaunch* f, cudaStream_t stream, const RunConfig& cfg) {
  MK_CHECK(check_args(a, !(f && f->route)));
  if (a.M == 0 || a.N == 0) return OkStatus();
#if MK_WITH_CUTLASS
  using namespace sm90;
  int dev = 0, major = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  MK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MK_REQUIRE(major == 9, Code::kNotSupported, "gemm: needs an sm_90 GPU (this one is sm_%d*)", major);
  int resident = 0;
  MK_CHECK(persistent_ctas(&resident));
  // A persistent grid larger than what can be co-resident would serialize (and, with
  // communication CTAs waiting on compute CTAs, deadlock): refuse rather than launch it.
  MK_REQUIRE(cfg.max_ctas <= resident, Code::kInvalidArgument,
             "gemm: max_ctas %d exceeds the %d CTAs that can be co-resident", cfg.max_ctas, resident);
  const int tiles = tile_count(a.M, a.N).total();
  int grid = cfg.max_ctas > 0 ? cfg.max_ctas : resident;
  if (!f) {
    Params<comm::NoComm> p{};
    MK_CHECK(make_params(a, &p));
    // Split-K: asked for (cfg.split_k > 1), or chosen when a workspace is given.
    MK_REQUIRE(cfg.split_k >= 0, Code::kInvalidArgument, "gemm: split_k %d < 0", cfg.split_k);
    int want = cfg.split_k;
    const bool can_split = !a.tile_flags && !a.tile_order && a.workspace;
    if (want == 0) want = can_split ? split_k_for(a.M, a.N, a.K, grid) : 1;
    int splits = 1, per = p.k_tiles;
    if (want > 1) split_ranges(p.k_tiles, want, &splits, &per);
    if (splits > 1) {
      MK_REQUIRE(!a.tile_flags && !a.tile_order, Code::kInvalidArgument,
                 "gemm: split-K (%d ranges) does not combine with tile_flags or tile_order", splits);
      const size_t need = size_t(splits) * size_t(a.M) * size_t(a.N) * 4;
      MK_REQUIRE(a.workspace && a.workspace_bytes >= need, Code::kInvalidArgument,
                 "gemm: split-K into %d ranges needs %zu bytes of workspace (given %zu)", splits, need,
                 a.workspace ? a.workspace_bytes : size_t(0));
      MK_REQUIRE(aligned16(a.workspace), Code::kInvalidArgument, "gemm: the workspace must be 16-byte aligned");
      p.splits = splits;
      p.k_per_split = per;
      p.partials = static_cast<float*>(a.workspace);
    }
    if (grid > tiles * splits) grid = tiles * splits;
    if (a.trace) persistent_gemm<true, StaticScheduler, comm::NoComm><<<grid, kThreads, kPlainSmem, stream>>>(p);
    else persistent_gemm<false, StaticScheduler, comm::NoComm><<<grid, kThreads, kPlainSmem, stream>>>(p);
    MK_CUDA_CHECK(cudaGetLastError());
    if (splits > 1) {
      const int64_t groups = a.M * (a.N / 8);
      const int blocks = int(std::min<int64_t>((groups + 255) / 256, int64_t(resident) * 8));
      splitk_reduce<<<blocks, 256, 0, stream>>>(p.partials, splits, a.M, a.N, static_cast<__nv_bfloat16*>(a.C),
                                                a.ldc ? a.ldc : a.N);
      MK_CUDA_CHECK(cudaGetLastError());
    }
    return OkStatus();
  }
  // A fused launch keeps its communication CTAs even when the tiles are few.
  MK_REQUIRE(f->program.n_ops == 0 || grid >= 2, Code::kInvalidArgument,
             "gemm: a fused launch with communication needs at least 2 CTAs (got %d)", grid);
  MK_REQUIRE(f->tile_counter && (f->program.n_ops == 0 || f->role_counts), Code::kInvalidArgument,
             "gemm: a fused launch needs a tile counter, and role counts when it has communication ops");
  Params<comm::CommRole> p{};
  MK_CHECK(make_params(a, &p));
  p.sched.order = f->tile_order;
  p.sched.counter = f->tile_counter;
  p.comm.program = f->program;
  p.comm.role_counts = f->role_counts;
  p.comm.peek_ops = f->peek_ops ? 1 : 0;
  if (f->route) {
    p.epi = EpiKind::kRoute;
    p.route = f->route_epi;
  }
  if (a.trace) {  // every wait that has to spin records how long, on whom
    p.comm.program.wait.trace_events = a.trace->events;
    p.comm.program.wait.trace_count = a.trace->count;
    p.comm.program.wait.trace_capacity = a.trace->capacity;
  }
  if (f->split && f->program.n_ops > 0) {
    // The controller: its per-call reset and the starting count, with the counters' zeroing.
    p.comm.split = f->split;
    if (a.trace) p.comm.trace = *a.trace;
    fused_begin<<<1, 1, 0, stream>>>(f->program.op_counter, f->tile_counter, const_cast<int*>(f->role_counts),
                                     f->split, grid);
    MK_CUDA_CHECK(cudaGetLastError());
  } else {
    if (f->program.op_counter) MK_CUDA_CHECK(cudaMemsetAsync(f->program.op_counter, 0, sizeof(int), stream));
    MK_CUDA_CHECK(cudaMemsetAsync(f->tile_counter, 0, sizeof(int), stream));
  }
  // Traced: compute tiles, TMA loads and communication ops on one timeline.
  if (a.trace) persistent_gemm<true, DynamicScheduler, comm::CommRole><<<grid, kThreads, kFusedSmem, stream>>>(p);
  else persistent_gemm<false, DynamicScheduler, comm::CommRole><<<grid, kThreads, kFusedSmem, stream>>>(p);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
#else
  (void)f;
  (void)stream;
  (void)cfg;
  return Status(Code::kNotSupported, "gemm: mkernel was built without CUTLASS headers");
#endif
}
}  // namespace

Status run(const Arguments& a, cudaStream_t stream, const RunConfig& cfg) { return launch(a, nullptr, stream, cfg); }

Status route_tensor_maps(float* const* dsts, int n, const int64_t* rows, int64_t N, std::vector<uint8_t>* maps) {
#if MK_WITH_CUTLASS
  using namespace sm90;
  static_assert(sizeof(CUtensorMap) == 128, "RouteEpilogue::route_maps holds 128-byte maps");
  MK_REQUIRE(N >= 8 && N % 8 == 0 && N < (1ll << 31), Code::kInvalidArgument,
             "gemm: route maps need N a positive multiple of 8 (got %lld)", (long long)N);
  const CudaDriver* drv = nullptr;
  MK_CHECK(cuda_driver(&drv));
  for (int i = 0; i < n; ++i) {
    MK_REQUIRE(rows[i] >= 1 && rows[i] < (1ll << 31), Code::kInvalidArgument,
               "gemm: route map %d needs 1 to 2^31 - 1 rows (got %lld)", i, (long long)rows[i]);
    MK_REQUIRE(dsts[i] && (reinterpret_cast<uintptr_t>(dsts[i]) & 15u) == 0, Code::kInvalidArgument,
               "gemm: route destination %d is null or not 16-byte aligned", i);
    CUtensorMap m;
    const cuuint64_t dims[2] = {cuuint64_t(N), cuuint64_t(rows[i])};
    const cuuint64_t strides[1] = {cuuint64_t(N) * 4};
    const cuuint32_t box[2] = {cuuint32_t(kRouteBoxCols), cuuint32_t(kRouteBoxRows)};
    const cuuint32_t elem[2] = {1, 1};
    MK_CU_CHECK(drv->cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, dsts[i], dims, strides, box, elem,
                                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&m);
    maps->insert(maps->end(), b, b + sizeof m);
  }
  return OkStatus();
#else
  (void)dsts, (void)n, (void)rows, (void)N, (void)maps;
  return Status(Code::kNotSupported, "gemm: mkernel was built without CUTLASS headers");
#endif
}

Status run_fused(const Arguments& a, const FusedLaunch& f, cudaStream_t stream, const RunConfig& cfg) {
  MK_REQUIRE(!a.tile_order, Code::kInvalidArgument, "gemm: a fused launch takes its schedule from the FusedLaunch");
  return launch(a, &f, stream, cfg);
}

}  // namespace gemm
}  // namespace mk
