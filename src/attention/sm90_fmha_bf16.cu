// The attention API: argument checks, the choice of kernel variant and its launch (the kernel is
// src/attention/kernel/fmha_kernel.cuh, instantiated by sm90_fmha_d*.cu), and the merge of
// partial results.
#include "mkernel/attention/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "src/common/per_device.h"
#include "src/attention/fmha_launch.h"

#if MK_WITH_CUTLASS
#include <cuda_bf16.h>
#endif

namespace mk {
namespace attention {

int pair_items(const FmhaPair& p, int B, int H) { return B * H * ((p.q_len + kTileM - 1) / kTileM); }

double forward_flops(int B, int H, int Sq, int Skv, int D, bool causal) {
  const double f = 4.0 * B * H * double(Sq) * double(Skv) * D;
  return causal ? f / 2 : f;
}

#if MK_WITH_CUTLASS
namespace sm90 {

// ---- merge kernels ----

__global__ void merge_init_kernel(float* o, float* lse, int64_t n_o, int64_t n_lse) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_o; i += int64_t(gridDim.x) * blockDim.x) {
    o[i] = 0.f;
    if (i < n_lse) lse[i] = -INFINITY;
  }
}

// One warp per (b, s, h) row.
__global__ void merge_kernel(MergeArgs a) {
  const int64_t rows = int64_t(a.B) * a.S * a.H;
  const int lane = threadIdx.x % 32;
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; w < rows;
       w += int64_t(gridDim.x) * blockDim.x / 32) {
    const int h = int(w % a.H);
    const int s = int((w / a.H) % a.S);
    const int b = int(w / (int64_t(a.H) * a.S));
    const int64_t li = (int64_t(b) * a.H + h) * a.S + s;
    const float la = a.lse_acc[li], lb = a.lse_part[li];
    const float m = fmaxf(la, lb);
    const float mu = m == -INFINITY ? 0.f : m;
    const float wa = expf(la - mu), wb = expf(lb - mu), sum = wa + wb;
    const float fa = sum > 0.f ? wa / sum : 0.f, fb = sum > 0.f ? wb / sum : 0.f;
    float* acc = a.o_acc + ((int64_t(b) * a.S + s) * a.H + h) * a.D;
    const __nv_bfloat16* part = static_cast<const __nv_bfloat16*>(a.o_part) + b * a.part_stride.b +
                                int64_t(s) * a.part_stride.s + int64_t(h) * a.part_stride.h;
    for (int d = lane; d < a.D; d += 32) acc[d] = acc[d] * fa + __bfloat162float(part[d]) * fb;
    if (lane == 0) a.lse_acc[li] = sum > 0.f ? mu + logf(sum) : -INFINITY;
  }
}

__global__ void merge_finish_kernel(const float* acc, __nv_bfloat16* o, Strides st, int B, int H, int S, int D) {
  const int64_t n = int64_t(B) * S * H * D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int d = int(i % D);
    const int h = int((i / D) % H);
    const int s = int((i / (int64_t(D) * H)) % S);
    const int b = int(i / (int64_t(D) * H * S));
    o[b * st.b + s * st.s + h * st.h + d] = __float2bfloat16_rn(acc[i]);
  }
}

}  // namespace sm90
#endif  // MK_WITH_CUTLASS

// ---- API ----

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
}  // namespace

Status check_cu_seqlens(const char* what, const int32_t* cu, int n_docs) {
  if (!cu) {
    MK_REQUIRE(n_docs == 0, Code::kInvalidArgument, "%s: n_docs %d without cu_seqlens", what, n_docs);
    return OkStatus();
  }
  MK_REQUIRE(n_docs >= 1, Code::kInvalidArgument, "%s: cu_seqlens with n_docs %d (at least 1)", what, n_docs);
  MK_REQUIRE((reinterpret_cast<uintptr_t>(cu) & 3u) == 0, Code::kInvalidArgument,
             "%s: cu_seqlens must be 4-byte aligned int32", what);
  return OkStatus();
}

Status check_varlen(const char* what, const int32_t* cu, int n_docs, int B, int Sq, int Skv, int64_t q_pos0,
                    int64_t kv_pos0) {
  MK_CHECK(check_cu_seqlens(what, cu, n_docs));
  if (!cu) return OkStatus();
  MK_REQUIRE(B == 1, Code::kInvalidArgument, "%s: packed sequences (cu_seqlens) need B = 1, not %d", what, B);
  MK_REQUIRE(Sq == Skv, Code::kInvalidArgument,
             "%s: packed sequences (cu_seqlens) need Sq = Skv (one packing for queries and keys), not %d and %d", what,
             Sq, Skv);
  MK_REQUIRE(q_pos0 == 0 && kv_pos0 == 0, Code::kInvalidArgument,
             "%s: packed sequences (cu_seqlens) restart positions at 0 in every document: q_pos0 %lld and kv_pos0 "
             "%lld must be 0",
             what, (long long)q_pos0, (long long)kv_pos0);
  // Items are (head, virtual tile): H * varlen_tiles() must fit an int (checked by the callers
  // that know H).
  MK_REQUIRE(int64_t(Sq) + int64_t(n_docs) * kTileM < (int64_t(1) << 30), Code::kInvalidArgument,
             "%s: %d documents over %d rows are too many for one call", what, n_docs, Sq);
  return OkStatus();
}

Status fmha_ctas(int* out) {
  int dev = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  static PerDeviceValue ctas;
  return ctas.get(dev, [dev](int* v) -> Status {
    MK_CUDA_CHECK(cudaDeviceGetAttribute(v, cudaDevAttrMultiProcessorCount, dev));
    return OkStatus();
  }, out);
}

Status can_implement(const ForwardArgs& a) {
  MK_REQUIRE(a.q && a.k && a.v && a.o, Code::kInvalidArgument, "attention: null Q, K, V or O");
  MK_REQUIRE(a.D == 64 || a.D == 128, Code::kInvalidArgument, "attention: head dimension %d (64 or 128)", a.D);
  MK_REQUIRE(a.B >= 1 && a.H >= 1 && a.Hkv >= 1 && a.Sq >= 1 && a.Skv >= 1, Code::kInvalidArgument,
             "attention: empty shape B %d H %d Hkv %d Sq %d Skv %d", a.B, a.H, a.Hkv, a.Sq, a.Skv);
  MK_REQUIRE(a.H % a.Hkv == 0, Code::kInvalidArgument, "attention: %d query heads are not a multiple of %d key/value heads",
             a.H, a.Hkv);
  MK_REQUIRE(aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.o), Code::kInvalidArgument,
             "attention: Q, K, V and O must be 16-byte aligned");
  const Strides* st[4] = {&a.q_stride, &a.k_stride, &a.v_stride, &a.o_stride};
  const char* nm[4] = {"Q", "K", "V", "O"};
  for (int i = 0; i < 4; ++i)
    MK_REQUIRE(st[i]->b % 8 == 0 && st[i]->s % 8 == 0 && st[i]->h % 8 == 0 && st[i]->b > 0 && st[i]->s > 0 &&
                   st[i]->h > 0,
               Code::kInvalidArgument,
               "attention: %s strides (b %lld, s %lld, h %lld) must be positive multiples of 8 elements", nm[i],
               (long long)st[i]->b, (long long)st[i]->s, (long long)st[i]->h);
  const uint64_t ob = uint64_t((a.B - 1) * a.o_stride.b + (a.Sq - 1) * a.o_stride.s + (a.H - 1) * a.o_stride.h + a.D) * 2;
  auto overlaps = [&](const void* x, uint64_t xb) {
    auto p0 = reinterpret_cast<uintptr_t>(a.o), p1 = reinterpret_cast<uintptr_t>(x);
    return p0 < p1 + xb && p1 < p0 + ob;
  };
  const uint64_t qb = uint64_t((a.B - 1) * a.q_stride.b + (a.Sq - 1) * a.q_stride.s + (a.H - 1) * a.q_stride.h + a.D) * 2;
  const uint64_t kb = uint64_t((a.B - 1) * a.k_stride.b + (a.Skv - 1) * a.k_stride.s + (a.Hkv - 1) * a.k_stride.h + a.D) * 2;
  const uint64_t vb = uint64_t((a.B - 1) * a.v_stride.b + (a.Skv - 1) * a.v_stride.s + (a.Hkv - 1) * a.v_stride.h + a.D) * 2;
  MK_REQUIRE(!overlaps(a.q, qb) && !overlaps(a.k, kb) && !overlaps(a.v, vb), Code::kInvalidArgument,
             "attention: O overlaps Q, K or V");
  MK_CHECK(check_varlen("attention", a.cu_seqlens, a.n_docs, a.B, a.Sq, a.Skv, a.q_pos0, a.kv_pos0));
#if !MK_WITH_CUTLASS
  return make_status(Code::kNotSupported, "attention: built without the CUTLASS headers (no sm_90a kernel)");
#else
  return OkStatus();
#endif
}

Status run_fmha(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, const RunConfig& cfg) {
  MK_CHECK(can_implement(a));
#if MK_WITH_CUTLASS
  int grid = 0;
  MK_CHECK(fmha_ctas(&grid));
  if (cfg.max_ctas > 0) grid = std::min(grid, cfg.max_ctas);
  MK_REQUIRE(grid > l.comm_ctas, Code::kInvalidArgument, "attention: %d communication CTAs leave none of %d to compute",
             l.comm_ctas, grid);
  // Plain launches (single calls, the ring's compute-only launches) carry no communication
  // code; a launch with a program, arrival flags, tracing or document windows (packed documents
  // by position) takes the communication role.
  const bool comm = l.program.ops || l.program.epoch || l.comm_ctas > 0 || l.slots.flags || l.trace || l.doc_win;
  if (a.D == 64) return comm ? sm90::launch_d64_comm(a, l, stream, grid) : sm90::launch_d64(a, l, stream, grid);
  return comm ? sm90::launch_d128_comm(a, l, stream, grid) : sm90::launch_d128(a, l, stream, grid);
#else
  return make_status(Code::kNotSupported, "attention: built without the CUTLASS headers");
#endif
}

Status forward(const ForwardArgs& a, cudaStream_t stream, const RunConfig& cfg) {
  FmhaLaunch l;
  if (a.cu_seqlens) {
    l.cu_seqlens = a.cu_seqlens;
    l.n_docs = a.n_docs;
    l.single.q_len = l.single.kv_len = a.Sq;  // the documents' rows come from cu_seqlens
    l.single.causal = a.causal ? 1 : 0;
    l.n_pairs = 1;
    const int64_t items = int64_t(a.H) * varlen_tiles(a.Sq, a.n_docs, kTileM);
    MK_REQUIRE(items < (int64_t(1) << 31), Code::kInvalidArgument,
               "attention: %d heads x %d documents over %d rows are too many work items for one call", a.H, a.n_docs,
               a.Sq);
    l.n_items = int(items);
    return run_fmha(a, l, stream, cfg);
  }
  l.single.q_row0 = 0;
  l.single.q_len = a.Sq;
  l.single.q_pos0 = a.q_pos0;
  l.single.kv_src = 0;
  l.single.kv_row0 = 0;
  l.single.kv_len = a.Skv;
  l.single.kv_pos0 = a.kv_pos0;
  l.single.causal = a.causal ? 1 : 0;
  l.n_pairs = 1;
  l.n_items = pair_items(l.single, a.B, a.H);
  return run_fmha(a, l, stream, cfg);
}

Status merge_init(float* o_acc, float* lse_acc, int B, int H, int S, int D, cudaStream_t stream) {
  MK_REQUIRE(o_acc && lse_acc && B > 0 && H > 0 && S > 0 && D > 0, Code::kInvalidArgument, "merge_init: bad arguments");
#if MK_WITH_CUTLASS
  const int64_t n = int64_t(B) * H * S * D;
  sm90::merge_init_kernel<<<1024, 256, 0, stream>>>(o_acc, lse_acc, n, int64_t(B) * H * S);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
#else
  return make_status(Code::kNotSupported, "attention: built without the CUTLASS headers");
#endif
}

Status merge(const MergeArgs& a, cudaStream_t stream) {
  MK_REQUIRE(a.o_acc && a.lse_acc && a.o_part && a.lse_part, Code::kInvalidArgument, "merge: null buffer");
  MK_REQUIRE(a.B > 0 && a.H > 0 && a.S > 0 && a.D > 0, Code::kInvalidArgument, "merge: empty shape");
#if MK_WITH_CUTLASS
  sm90::merge_kernel<<<1024, 256, 0, stream>>>(a);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
#else
  return make_status(Code::kNotSupported, "attention: built without the CUTLASS headers");
#endif
}

Status merge_finish(const float* o_acc, void* o, Strides st, int B, int H, int S, int D, cudaStream_t stream) {
  MK_REQUIRE(o_acc && o && B > 0 && H > 0 && S > 0 && D > 0, Code::kInvalidArgument, "merge_finish: bad arguments");
#if MK_WITH_CUTLASS
  sm90::merge_finish_kernel<<<1024, 256, 0, stream>>>(o_acc, static_cast<__nv_bfloat16*>(o), st, B, H, S, D);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
#else
  return make_status(Code::kNotSupported, "attention: built without the CUDA kernels");
#endif
}

}  // namespace attention
}  // namespace mk
