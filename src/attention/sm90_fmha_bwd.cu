// The attention backward's API: argument checks, the workspace, the preprocessing kernel (Dsum,
// LSE₂, zeroed dQ accumulator), then the main kernel and the kernel that rounds dQ to bf16
// (src/attention/kernel/bwd.cuh, instantiated by sm90_fmha_bwd_d{64,128}.cu).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "mkernel/attention/attention.h"
#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/tunables.h"
#include "mkernel/runtime/communicator.h"
#include "src/attention/bwd_launch.h"
#include "src/attention/fmha_launch.h"

#if MK_WITH_CUTLASS
#include <cuda_bf16.h>

#include "src/attention/kernel/varlen.cuh"
#endif

namespace mk {
namespace attention {

namespace {
constexpr int kRowPad = 128;    // rows per (batch, head) in the workspace: a multiple of every query block
constexpr int kOrderRows = 64;  // rows per deterministic-order counter (the smallest query block)
constexpr size_t kAlign = 256;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct Parts {
  size_t dq = 0, lse2 = 0, dsum = 0, order = 0, total = 0;
  int sq_pad = 0;
};
// Packed calls (n_docs > 0): the rows of the virtual query blocks (varlen.cuh).
Parts parts_of(int B, int H, int Sq, int D, int n_docs) {
  Parts p;
  const int block_m = D == 64 ? 128 : 64;  // BwdCfg<D>::kBlockM
  const int64_t rows_needed = n_docs > 0 ? int64_t(varlen_tiles(Sq, n_docs, block_m)) * block_m : int64_t(Sq);
  p.sq_pad = int(round_up(size_t(rows_needed), kRowPad));
  const size_t rows = size_t(B) * H * p.sq_pad;
  p.dq = 0;
  p.lse2 = round_up(rows * D * sizeof(float), kAlign);
  p.dsum = p.lse2 + round_up(rows * sizeof(float), kAlign);
  p.order = p.dsum + round_up(rows * sizeof(float), kAlign);
  p.total = p.order + round_up(rows / kOrderRows * sizeof(uint64_t), kAlign);
  return p;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Bytes from a tensor's first element to one past its last.
uint64_t span_bytes(const Strides& st, int B, int S, int H, int D) {
  return uint64_t((B - 1) * st.b + int64_t(S - 1) * st.s + int64_t(H - 1) * st.h + D) * 2;
}
bool overlap(const void* a, uint64_t an, const void* b, uint64_t bn) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + bn && pb < pa + an;
}
}  // namespace

size_t backward_workspace_bytes(int B, int H, int Sq, int D, int n_docs) {
  if (B <= 0 || H <= 0 || Sq <= 0 || D <= 0 || n_docs < 0) return 0;
  if (int64_t(Sq) + int64_t(n_docs) * kRowPad >= (int64_t(1) << 30)) return 0;
  return parts_of(B, H, Sq, D, n_docs).total;
}

namespace {
// The split schedule's fp32 dK and dV accumulators: one 128-row key block per (batch, key/value
// head, CTA column), in fragment order.
size_t dkv_bytes(const BackwardArgs& a) {
  return round_up(2 * size_t(a.B) * a.Hkv * size_t(bwd_key_blocks(a)) * 128 * a.D * sizeof(float), kAlign);
}
// Whether a call may split a GQA group over several CTAs (dK / dV then summed in fp32 atomics, in
// any order: never in deterministic mode).
bool may_split(const BackwardArgs& a) { return !a.deterministic && a.Hkv > 0 && a.H / a.Hkv > 1; }
}  // namespace

size_t backward_workspace_bytes(const BackwardArgs& a) {
  const size_t base = backward_workspace_bytes(a.B, a.H, a.Sq, a.D, a.cu_seqlens ? a.n_docs : 0);
  if (base == 0 || a.Hkv <= 0 || a.Skv <= 0) return base;
  return may_split(a) ? base + dkv_bytes(a) : base;
}

double backward_flops(int B, int H, int Sq, int Skv, int D, bool causal) {
  const double f = 10.0 * B * H * double(Sq) * double(Skv) * D;
  return causal ? f / 2 : f;
}

Status can_implement_backward(const BackwardArgs& a) {
  MK_REQUIRE(a.q && a.k && a.v && a.o && a.dout && a.lse, Code::kInvalidArgument,
             "attention backward: null Q, K, V, O, dO or LSE");
  MK_REQUIRE(a.dq && a.dk && a.dv, Code::kInvalidArgument, "attention backward: null dQ, dK or dV");
  MK_REQUIRE(a.D == 64 || a.D == 128, Code::kInvalidArgument, "attention backward: head dimension %d (64 or 128)", a.D);
  MK_REQUIRE(a.B >= 1 && a.H >= 1 && a.Hkv >= 1 && a.Sq >= 1 && a.Skv >= 1, Code::kInvalidArgument,
             "attention backward: empty shape B %d H %d Hkv %d Sq %d Skv %d", a.B, a.H, a.Hkv, a.Sq, a.Skv);
  MK_REQUIRE(a.H % a.Hkv == 0, Code::kInvalidArgument,
             "attention backward: %d query heads are not a multiple of %d key/value heads", a.H, a.Hkv);
  const void* ptr[8] = {a.q, a.k, a.v, a.o, a.dout, a.dq, a.dk, a.dv};
  const Strides* st[8] = {&a.q_stride, &a.k_stride, &a.v_stride, &a.o_stride,
                          &a.do_stride, &a.dq_stride, &a.dk_stride, &a.dv_stride};
  const char* nm[8] = {"Q", "K", "V", "O", "dO", "dQ", "dK", "dV"};
  const bool is_kv[8] = {false, true, true, false, false, false, true, true};
  uint64_t bytes[8];
  for (int i = 0; i < 8; ++i) {
    MK_REQUIRE(aligned16(ptr[i]), Code::kInvalidArgument, "attention backward: %s must be 16-byte aligned", nm[i]);
    MK_REQUIRE(st[i]->b % 8 == 0 && st[i]->s % 8 == 0 && st[i]->h % 8 == 0 && st[i]->b > 0 && st[i]->s > 0 &&
                   st[i]->h > 0,
               Code::kInvalidArgument,
               "attention backward: %s strides (b %lld, s %lld, h %lld) must be positive multiples of 8 elements", nm[i],
               (long long)st[i]->b, (long long)st[i]->s, (long long)st[i]->h);
    bytes[i] = span_bytes(*st[i], a.B, is_kv[i] ? a.Skv : a.Sq, is_kv[i] ? a.Hkv : a.H, a.D);
  }
  for (int o = 5; o < 8; ++o)
    for (int i = 0; i < 8; ++i)
      if (i != o)
        MK_REQUIRE(!overlap(ptr[o], bytes[o], ptr[i], bytes[i]), Code::kInvalidArgument,
                   "attention backward: %s overlaps %s", nm[o], nm[i]);
  MK_CHECK(check_varlen("attention backward", a.cu_seqlens, a.n_docs, a.B, a.Sq, a.Skv, a.q_pos0, a.kv_pos0));
  const uint64_t lse_bytes = uint64_t(a.B) * a.H * a.Sq * 4;
  for (int o = 5; o < 8; ++o)
    MK_REQUIRE(!overlap(ptr[o], bytes[o], a.lse, lse_bytes), Code::kInvalidArgument,
               "attention backward: %s overlaps the LSE", nm[o]);
  const size_t need = backward_workspace_bytes(a.B, a.H, a.Sq, a.D, a.n_docs);
  MK_REQUIRE(a.workspace && a.workspace_bytes >= need, Code::kInvalidArgument,
             "attention backward: the workspace has %zu bytes, %zu needed (backward_workspace_bytes%s)",
             a.workspace ? a.workspace_bytes : size_t(0), need, a.n_docs ? " with n_docs" : "");
  MK_REQUIRE((reinterpret_cast<uintptr_t>(a.workspace) % kAlign) == 0, Code::kInvalidArgument,
             "attention backward: the workspace must be 256-byte aligned");
  // The bytes the call uses: the split schedule's accumulators too when they fit.
  const size_t full = backward_workspace_bytes(a);
  const size_t used = a.workspace_bytes >= full ? full : need;
  for (int i = 0; i < 8; ++i)
    MK_REQUIRE(!overlap(a.workspace, used, ptr[i], bytes[i]), Code::kInvalidArgument,
               "attention backward: the workspace overlaps %s", nm[i]);
#if !MK_WITH_CUTLASS
  return make_status(Code::kNotSupported, "attention backward: built without the CUTLASS headers (no sm_90a kernel)");
#else
  return OkStatus();
#endif
}

#if MK_WITH_CUTLASS
namespace sm90 {

struct PreArgs {
  const __nv_bfloat16* o;
  const __nv_bfloat16* dout;
  const float* lse;
  Strides o_st, do_st;
  int B, H, Sq, sq_pad, D;
  float* dq_acc;
  float* lse2;
  float* dsum;
  uint64_t* order;  // null: not deterministic
  const int32_t* cu;  // packed documents (workspace rows are virtual query blocks'), or null
  int n_docs, block_m;
};

// One warp per workspace row (b, h, row < sq_pad).
__global__ void bwd_pre_kernel(PreArgs a) {
  const int64_t rows = int64_t(a.B) * a.H * a.sq_pad;
  const int lane = threadIdx.x % 32;
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; w < rows;
       w += int64_t(gridDim.x) * blockDim.x / 32) {
    const int row = int(w % a.sq_pad);
    const int64_t bh = w / a.sq_pad;
    const int h = int(bh % a.H), b = int(bh / a.H);
    // The sequence row of this workspace row, or -1 (padding).
    int srow = row < a.Sq ? row : -1;
    if (a.cu) {
      const DocTile t = varlen_tile_warp(a.cu, a.n_docs, a.Sq, a.block_m, row / a.block_m);
      const int local = t.local * a.block_m + row % a.block_m;
      srow = varlen_valid(t, a.block_m) && local < t.len ? t.row0 + local : -1;
    }
    float acc = 0.f;
    if (srow >= 0) {
      const __nv_bfloat16* o = a.o + b * a.o_st.b + int64_t(srow) * a.o_st.s + int64_t(h) * a.o_st.h;
      const __nv_bfloat16* g = a.dout + b * a.do_st.b + int64_t(srow) * a.do_st.s + int64_t(h) * a.do_st.h;
      for (int d = lane * 2; d < a.D; d += 64) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + d));
        const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + d));
        acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
      }
    }
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    float4* dq = reinterpret_cast<float4*>(a.dq_acc + w * a.D);
    for (int i = lane; i < a.D / 4; i += 32) dq[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (lane == 0) {
      a.dsum[w] = acc;
      const float l = srow >= 0 ? a.lse[bh * a.Sq + srow] : -INFINITY;
      // A row that saw no key (LSE -inf) and the padding get P = exp2(s - inf) = 0.
      a.lse2[w] = l > -INFINITY ? l * 1.44269504088896340736f : INFINITY;
      if (a.order && row % kOrderRows == 0) a.order[w / kOrderRows] = 0;
    }
  }
}

}  // namespace sm90

namespace {
// The bounded waits of deterministic calls report here: one record per device, kept for the
// process's life (pinned host record and abort word, device claim word).
struct WaitRecord {
  DiagRecord* diag = nullptr;
  uint64_t* abort = nullptr;
  uint32_t* claim = nullptr;
};
Status wait_record(int dev, WaitRecord* out) {
  static std::mutex mu;
  static std::map<int, WaitRecord>* records = new std::map<int, WaitRecord>;  // outlives static destructors
  std::lock_guard<std::mutex> g(mu);
  auto it = records->find(dev);
  if (it == records->end()) {
    WaitRecord r;
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&r.diag), sizeof(DiagRecord),
                                cudaHostAllocMapped | cudaHostAllocPortable));
    memset(r.diag, 0, sizeof(DiagRecord));
    r.diag->size = sizeof(DiagRecord);
    r.diag->version = kDiagVersion;
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&r.abort), sizeof(uint64_t),
                                cudaHostAllocMapped | cudaHostAllocPortable));
    *r.abort = 0;
    MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&r.claim), sizeof(uint32_t)));
    MK_CUDA_CHECK(cudaMemset(r.claim, 0, sizeof(uint32_t)));
    it = records->emplace(dev, r).first;
  }
  *out = it->second;
  return OkStatus();
}
uint32_t bwd_op_tag() {
  static const uint32_t tag = op_tag_register("attention_backward");
  return tag;
}
}  // namespace
#endif  // MK_WITH_CUTLASS

#if MK_WITH_CUTLASS
namespace {
BwdWorkspace carve(const BackwardArgs& a, const Parts& parts) {
  char* ws = static_cast<char*>(a.workspace);
  BwdWorkspace w;
  w.dq_acc = reinterpret_cast<float*>(ws + parts.dq);
  w.lse2 = reinterpret_cast<float*>(ws + parts.lse2);
  w.dsum = reinterpret_cast<float*>(ws + parts.dsum);
  w.order = reinterpret_cast<uint64_t*>(ws + parts.order);
  w.sq_pad = parts.sq_pad;
  w.scale = a.scale > 0.f ? a.scale : 1.f / std::sqrt(float(a.D));
  return w;
}
// The preprocessing kernel (Dsum, LSE₂, zeroed dQ accumulator; deterministic: the counters).
Status preprocess(const BackwardArgs& a, const Parts& parts, const BwdWorkspace& w, cudaStream_t stream) {
  sm90::PreArgs pa{static_cast<const __nv_bfloat16*>(a.o), static_cast<const __nv_bfloat16*>(a.dout), a.lse,
                   a.o_stride, a.do_stride, a.B, a.H, a.Sq, parts.sq_pad, a.D, w.dq_acc, w.lse2, w.dsum,
                   a.deterministic ? w.order : nullptr, a.cu_seqlens, a.n_docs, a.D == 64 ? 128 : 64};
  const int64_t rows = int64_t(a.B) * a.H * parts.sq_pad;
  const int pre_blocks = int(std::min<int64_t>((rows + 7) / 8, 4096));
  sm90::bwd_pre_kernel<<<pre_blocks, 256, 0, stream>>>(pa);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}
}  // namespace
#endif

Status run_ring_backward(const BackwardArgs& a, const BwdRing& ring, cudaStream_t stream) {
#if MK_WITH_CUTLASS
  const Parts parts = parts_of(a.B, a.H, a.Sq, a.D, a.n_docs);
  MK_REQUIRE(a.workspace && a.workspace_bytes >= parts.total && !a.deterministic, Code::kInternal,
             "ring attention backward: workspace of %zu bytes (%zu needed)", a.workspace_bytes, parts.total);
  const BwdWorkspace w = carve(a, parts);
  MK_CHECK(preprocess(a, parts, w, stream));
  return a.D == 64 ? sm90::launch_bwd_d64(a, w, stream, &ring) : sm90::launch_bwd_d128(a, w, stream, &ring);
#else
  (void)a, (void)ring, (void)stream;
  return make_status(Code::kNotSupported, "ring attention backward: built without the CUTLASS headers");
#endif
}

Status backward(const BackwardArgs& a, cudaStream_t stream) {
  MK_CHECK(can_implement_backward(a));
#if MK_WITH_CUTLASS
  const Parts parts = parts_of(a.B, a.H, a.Sq, a.D, a.cu_seqlens ? a.n_docs : 0);
  BwdWorkspace w = carve(a, parts);
  // Few key blocks (short sequences, few key/value heads): the group's query heads split over up
  // to `group` CTAs per key block, so the grid fills the SMs, when the workspace has room for the
  // fp32 dK / dV accumulators (backward_workspace_bytes(a)).
  if (may_split(a) && a.workspace_bytes >= parts.total + dkv_bytes(a)) {
    int sms = 0;
    MK_CHECK(fmha_ctas(&sms));
    const int group = a.H / a.Hkv;
    const int64_t blocks = int64_t(a.B) * a.Hkv * bwd_key_blocks(a);
    while (group % (w.head_split * 2) == 0 && blocks * w.head_split * 2 <= sms) w.head_split *= 2;
    if (w.head_split > 1) {
      w.dkv_acc = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + parts.total);
      MK_CUDA_CHECK(cudaMemsetAsync(w.dkv_acc, 0, dkv_bytes(a), stream));
    }
  }
  if (a.deterministic) {
    int dev = 0;
    MK_CUDA_CHECK(cudaGetDevice(&dev));
    WaitRecord r;
    MK_CHECK(wait_record(dev, &r));
    if (*reinterpret_cast<volatile uint64_t*>(r.abort) != 0) {
      // An earlier call's wait gave up: report it once, then clear the record for the next call.
      const std::string msg = "attention backward: an earlier deterministic call's ordering wait gave up (its dQ "
                              "was set to NaN): " + describe_diag(*r.diag);
      MK_CUDA_CHECK(cudaMemsetAsync(r.claim, 0, sizeof(uint32_t), stream));
      MK_CUDA_CHECK(cudaStreamSynchronize(stream));
      r.diag->state = 0;
      *r.abort = 0;
      return make_status(Code::kInternal, "%s", msg.c_str());
    }
    memset(&w.wait, 0, sizeof(w.wait));
    w.wait.diag = r.diag;
    w.wait.claim = r.claim;
    w.wait.abort = r.abort;
    int64_t ms = tunables::signal_timeout_ms();
    w.wait.timeout_ns = uint64_t(ms > 0 ? ms : 1) * 1000000ull;
    w.wait.rank = -1;
    w.wait.op_tag = bwd_op_tag();
    w.wait.role = static_cast<uint32_t>(Role::kCompute);
  }
  MK_CHECK(preprocess(a, parts, w, stream));
  MK_CHECK(a.D == 64 ? sm90::launch_bwd_d64(a, w, stream) : sm90::launch_bwd_d128(a, w, stream));
  return OkStatus();
#else
  (void)stream;
  return make_status(Code::kNotSupported, "attention backward: built without the CUTLASS headers");
#endif
}

}  // namespace attention
}  // namespace mk
