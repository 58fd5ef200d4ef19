// `mkernel bench moe_layer`: the MoE layer (include/mkernel/ops/moe_layer.h) against the same
// layer built from separate launches with cuBLAS's grouped GEMM.
//
// Per preset (a model's hidden size H, expert width I, experts E, top-k) and tokens per rank:
//   - inputs: x and the weights from a hash fill kernel (weights scaled by 1 / sqrt(fan-in)),
//     routing uniform over the experts (k distinct per token), weights in (0, 1] / k;
//   - layer_us: MoeLayer::run (dispatch, grouped GEMM with SwiGLU, grouped GEMM, combine);
//   - unfused_us: mkernel dispatch, cuBLAS grouped GEMM x·W1ᵀ (cublasGemmGroupedBatchedEx; its
//     per-expert sizes taken to the host once, outside the timing — in a real unfused layer a
//     device-to-host copy and a synchronization per call), a SwiGLU kernel, cuBLAS grouped GEMM
//     ·W2ᵀ, mkernel combine, as separate launches;
//   - compute_us: mkernel's two grouped GEMMs alone on the received rows; comm_us: dispatch +
//     combine alone. overlap = (compute + comm - layer) / min(compute, comm): 0 when the stages
//     run one after another (they do today), 1 when the shorter one is hidden;
//   - check: the layer's output against the unfused one (cuBLAS GEMMs, a different rounding:
//     the 2I-wide product rounded to bf16 before SwiGLU), relative Frobenius error below 2e-2.
// A time is the slowest rank's median (tools/bench_common.h, time_it). Ranks sharing a GPU get
// min(tokens, 4096 / W) tokens per rank (said in the line and the JSON); their times are not
// comparable across GPUs. Experts not a multiple of W are rounded up.
//   - nccl_us (every rank its own GPU, NCCL built): NCCL all-to-all-v of one row per (token,
//     expert) entry with permute kernels, the cuBLAS grouped GEMMs and SwiGLU kernel, the way
//     back and a weighted sum — maps and counts built on the host outside the timing; its output
//     is checked against the layer's too.
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/gemm/grouped.h"
#include "mkernel/mkernel.h"
#include "mkernel/ops/moe_layer.h"
#include "tools/bench_common.h"
#if MK_HAVE_CUBLAS
#include <cublas_v2.h>
#endif
#if MK_HAVE_NCCL && MK_HAVE_CUBLAS
#include "tools/baseline/baseline.h"
#define MK_LAYER_NCCL 1
#else
#define MK_LAYER_NCCL 0
#endif

namespace mk {
namespace bench {
namespace {

struct LayerPreset {
  const char* name;
  int64_t hidden, inter;
  int experts, topk;
};
constexpr LayerPreset kLayerPresets[] = {
    {"qwen3_30b", 2048, 768, 128, 8},
    {"qwen3_235b", 4096, 1536, 128, 8},
    {"mixtral", 4096, 14336, 8, 2},
    {"deepseek_v3", 7168, 2048, 256, 8},
};
constexpr int64_t kSharedTokens = 4096;

__global__ void fill_scaled(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix(seed ^ (i * 0x9e3779b97f4a7c15ull));
    p[i] = __float2bfloat16_rn((float(h >> 40) / 16777216.f * 2.f - 1.f) * scale);
  }
}

// act[r, j] = silu(h[r, j]) * h[r, I + j] for rows [0, rows): the unfused layer's activation.
__global__ void swiglu_rows(const __nv_bfloat16* h, __nv_bfloat16* act, int64_t rows, int64_t I) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * I; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / I, j = i % I;
    const float g = __bfloat162float(h[r * 2 * I + j]), u = __bfloat162float(h[r * 2 * I + I + j]);
    act[i] = __float2bfloat16_rn(g / (1.f + __expf(-g)) * u);
  }
}

__global__ void rel_err(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, double* acc) {
  double num = 0, den = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  atomicAdd(&acc[0], num);
  atomicAdd(&acc[1], den);
}

// Rank `rank`'s routing: k distinct experts per token, uniform; weights (0, 1] / k. A function of
// (seed, rank): every rank can regenerate every rank's.
void make_routing(uint64_t seed, int rank, int64_t T, int k, int E, std::vector<int32_t>* ids, std::vector<float>* w) {
  ids->assign(size_t(T * k), -1);
  w->assign(size_t(T * k), 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int kk = 0; kk < k; ++kk) {
      int32_t* row = ids->data() + t * k;
      for (uint64_t a = 0;; ++a) {
        const int32_t e =
            int32_t(mix(seed ^ (uint64_t(rank) << 48) ^ (uint64_t(t) << 8) ^ uint64_t(kk) ^ (a << 56)) % uint64_t(E));
        if (std::find(row, row + kk, e) == row + kk) {
          row[kk] = e;
          break;
        }
      }
      (*w)[size_t(t * k + kk)] =
          float((mix(seed ^ 0x77ull ^ uint64_t(t * k + kk) ^ (uint64_t(rank) << 40)) >> 41) + 1) / float(1ull << 23) /
          float(k);
    }
}

// dst row map[i].y = src row map[i].x (rows of row_bytes, a multiple of 16); the NCCL baseline's
// permutations.
__global__ void permute_rows(const char* src, char* dst, const int2* map, int64_t n, int64_t row_bytes) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int4* a = reinterpret_cast<const int4*>(src + int64_t(map[i].x) * row_bytes);
    int4* b = reinterpret_cast<int4*>(dst + int64_t(map[i].y) * row_bytes);
    for (int64_t j = threadIdx.x; j < row_bytes / 16; j += blockDim.x) b[j] = a[j];
  }
}

// out[t, c] = bf16(sum over slots kk (in order) of w[t, kk] * back[pos[t, kk], c]), fp32; pos -1:
// no expert. The NCCL baseline's combine.
__global__ void weighted_sum(const __nv_bfloat16* back, const int32_t* pos, const float* w, int64_t T, int k,
                             int64_t H, __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * H; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, c = i % H;
    float acc = 0.f;
    for (int kk = 0; kk < k; ++kk) {
      const int32_t p = pos[t * k + kk];
      if (p >= 0) acc = fmaf(w[t * k + kk], __bfloat162float(back[int64_t(p) * H + c]), acc);
    }
    out[i] = __float2bfloat16_rn(acc);
  }
}

struct LayerRow {
  std::string preset;
  int W = 1, nodes = 1, experts = 0, experts_preset = 0, topk = 0;
  int64_t tokens = 0, tokens_preset = 0, hidden = 0, inter = 0;
  bool tokens_scaled = false, shared = false, checked = false, correct = false;
  double err = 0;
  double layer_us = 0, unfused_us = 0, compute_us = 0, comm_us = 0, nccl_us = 0;
  double nccl_err = 0;  // the NCCL baseline's output against the layer's (relative Frobenius)
};

#if MK_HAVE_CUBLAS
struct Cublas {
  cublasHandle_t h = nullptr;
  ~Cublas() {
    if (h) cublasDestroy(h);
  }
};
// A grouped GEMM over the non-empty experts: C rows (offsets) = A rows · B_eᵀ.
struct CublasGrouped {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  Buf ptrs;
  int groups = 0;
  Status build(Communicator* comm, const std::vector<int32_t>& counts, const std::vector<int32_t>& offsets,
               const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, int64_t N, int64_t K) {
    std::vector<const void*> pa, pb;
    std::vector<void*> pc;
    for (size_t e = 0; e < counts.size(); ++e) {
      if (!counts[e]) continue;
      ta.push_back(CUBLAS_OP_T), tb.push_back(CUBLAS_OP_N);
      m.push_back(int(N)), n.push_back(counts[e]), k.push_back(int(K));
      lda.push_back(int(K)), ldb.push_back(int(K)), ldc.push_back(int(N));
      alpha.push_back(1.f), beta.push_back(0.f), size.push_back(1);
      pa.push_back(B + int64_t(e) * N * K), pb.push_back(A + int64_t(offsets[e]) * K);
      pc.push_back(C + int64_t(offsets[e]) * N);
    }
    groups = int(ta.size());
    MK_CHECK(CLI_CUDA(comm, ptrs.alloc(size_t(3 * groups) * sizeof(void*))));
    void** d = static_cast<void**>(ptrs.p);
    MK_CHECK(CLI_CUDA(comm, cudaMemcpy(d, pa.data(), groups * sizeof(void*), cudaMemcpyHostToDevice)));
    MK_CHECK(CLI_CUDA(comm, cudaMemcpy(d + groups, pb.data(), groups * sizeof(void*), cudaMemcpyHostToDevice)));
    MK_CHECK(CLI_CUDA(comm, cudaMemcpy(d + 2 * groups, pc.data(), groups * sizeof(void*), cudaMemcpyHostToDevice)));
    // A pageable cudaMemcpy may return before its DMA lands, unordered with the (non-blocking)
    // stream the GEMMs run on.
    MK_CHECK(CLI_CUDA(comm, cudaDeviceSynchronize()));
    return OkStatus();
  }
  Status run(cublasHandle_t h) {
    if (!groups) return OkStatus();
    void** d = static_cast<void**>(ptrs.p);
    const cublasStatus_t s = cublasGemmGroupedBatchedEx(
        h, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), const_cast<const void* const*>(d),
        CUDA_R_16BF, lda.data(), const_cast<const void* const*>(d + groups), CUDA_R_16BF, ldb.data(), beta.data(),
        d + 2 * groups, CUDA_R_16BF, ldc.data(), groups, size.data(), CUBLAS_COMPUTE_32F);
    MK_REQUIRE(s == CUBLAS_STATUS_SUCCESS, Code::kCudaError, "cublasGemmGroupedBatchedEx failed (%d)", int(s));
    return OkStatus();
  }
};
#endif

#if MK_LAYER_NCCL
Status nccl_layer(Communicator* comm, const RunCfg& rc, uint64_t seed, cublasHandle_t cb, const Buf& x,
                  const Buf& wts, const Buf& w1, const Buf& w2, const Buf& layer_out, LayerRow* r);
#endif

Status bench_layer_one(Communicator* comm, const RunCfg& rc, uint64_t seed, bool comparable, LayerRow* r) {
  const int W = comm->world(), me = comm->rank(), k = r->topk;
  const int64_t T = r->tokens, H = r->hidden, I = r->inter;
  cudaStream_t st = comm->stream();
  ops::MoeLayerConfig cfg;
  cfg.moe.hidden = H;
  cfg.moe.num_experts = r->experts;
  cfg.moe.topk = k;
  cfg.moe.max_tokens_per_rank = T;
  cfg.intermediate = I;
  std::unique_ptr<ops::MoeLayer> layer;
  MK_CHECK(agreed(comm, ops::MoeLayer::create(comm, cfg, {}, &layer), "creating the MoE layer"));
  const int El = layer->local_experts();
  const int64_t rows = layer->recv_rows();
  Buf x, ids, wts, w1, w2, out, out2, recv2, h2, act2, y2, counts2, acc;
  Status s;
  for (auto [b, bytes] : {std::pair<Buf*, size_t>{&x, size_t(T * H * 2)}, {&ids, size_t(T * k * 4)},
                          {&wts, size_t(T * k * 4)}, {&w1, size_t(El) * 2 * I * H * 2}, {&w2, size_t(El) * H * I * 2},
                          {&out, size_t(T * H * 2)}, {&out2, size_t(T * H * 2)}, {&recv2, size_t(rows * H * 2)},
                          {&h2, size_t(rows * 2 * I * 2)}, {&act2, size_t(rows * I * 2)}, {&y2, size_t(rows * H * 2)},
                          {&counts2, size_t(El + 1) * 8},
                          {&acc, 16}})
    if (s.ok()) s = CLI_CUDA(comm, b->alloc(bytes));
  MK_CHECK(agreed(comm, s, "allocating the layer's inputs"));
  std::vector<int32_t> hid;
  std::vector<float> hw;
  make_routing(seed, me, T, k, r->experts, &hid, &hw);
  fill_scaled<<<1024, 256, 0, st>>>(x.bf(), size_t(T * H), mix(seed ^ uint64_t(me)), 1.f);
  fill_scaled<<<1024, 256, 0, st>>>(w1.bf(), size_t(El) * 2 * I * H, mix(seed ^ 0x1000 ^ uint64_t(me)),
                                    1.f / std::sqrt(float(H)));
  fill_scaled<<<1024, 256, 0, st>>>(w2.bf(), size_t(El) * H * I, mix(seed ^ 0x2000 ^ uint64_t(me)),
                                    1.f / std::sqrt(float(I)));
  s = CLI_CUDA(comm, cudaGetLastError());
  if (s.ok()) s = CLI_CUDA(comm, cudaMemcpyAsync(ids.p, hid.data(), hid.size() * 4, cudaMemcpyHostToDevice, st));
  if (s.ok()) s = CLI_CUDA(comm, cudaMemcpyAsync(wts.p, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice, st));
  if (s.ok()) s = synced(comm, st);
  MK_CHECK(agreed(comm, s, "filling the inputs"));
  ops::MoeLayerArgs a;
  a.x = x.p;
  a.topk_ids = static_cast<int32_t*>(ids.p);
  a.topk_weights = static_cast<float*>(wts.p);
  a.tokens = T;
  a.w1 = w1.p;
  a.w2 = w2.p;
  auto layer_call = [&] { return layer->run(a, out.p, st); };
  // One call: the expert layout (counts, offsets) the baselines reuse.
  s = decoded(comm, layer_call());
  if (s.ok()) s = synced(comm, st);
  if (s.ok()) s = layer->check();
  std::vector<int32_t> counts(El), offsets(El + 1);
  if (s.ok()) s = CLI_CUDA(comm, cudaMemcpy(counts.data(), layer->counts(), El * 4, cudaMemcpyDeviceToHost));
  if (s.ok()) s = CLI_CUDA(comm, cudaMemcpy(offsets.data(), layer->offsets(), (El + 1) * 4, cudaMemcpyDeviceToHost));
  MK_CHECK(agreed(comm, s, "the first layer call"));
  // compute: the two grouped GEMMs alone on the received rows.
  auto compute_call = [&]() -> Status { return layer->run_experts(w1.p, w2.p, st); };
  ops::MoeEp* ep = layer->ep();
  auto comm_call = [&]() -> Status {
    MK_CHECK(ep->dispatch({a.x, a.topk_ids, a.topk_weights, nullptr, T},
                          {recv2.p, static_cast<int32_t*>(counts2.p), static_cast<int32_t*>(counts2.p) + El + 1}, st));
    return ep->combine({recv2.p}, out2.p, st);
  };
  Timing tl, tc, tx;
  MK_CHECK(time_it(comm, st, rc, "moe_layer", layer_call, &tl));
  MK_CHECK(time_it(comm, st, rc, "grouped GEMMs", compute_call, &tc));
  MK_CHECK(time_it(comm, st, rc, "dispatch + combine", comm_call, &tx));
  r->layer_us = tl.median_ms * 1e3;
  r->compute_us = tc.median_ms * 1e3;
  r->comm_us = tx.median_ms * 1e3;
#if MK_HAVE_CUBLAS
  Cublas cb;
  s = cublasCreate(&cb.h) == CUBLAS_STATUS_SUCCESS ? OkStatus() : Status(Code::kCudaError, "cublasCreate failed");
  if (s.ok()) s = cublasSetStream(cb.h, st) == CUBLAS_STATUS_SUCCESS ? OkStatus()
                                                                     : Status(Code::kCudaError, "cublasSetStream failed");
  CublasGrouped c1, c2;
  if (s.ok())
    s = c1.build(comm, counts, offsets, static_cast<const __nv_bfloat16*>(recv2.p), w1.bf(), h2.bf(), 2 * I, H);
  if (s.ok()) s = c2.build(comm, counts, offsets, act2.bf(), w2.bf(), y2.bf(), H, I);
  MK_CHECK(agreed(comm, s, "the cuBLAS baseline's setup"));
  const int64_t used = offsets[El];
  auto unfused_call = [&]() -> Status {
    MK_CHECK(ep->dispatch({a.x, a.topk_ids, a.topk_weights, nullptr, T},
                          {recv2.p, static_cast<int32_t*>(counts2.p), static_cast<int32_t*>(counts2.p) + El + 1}, st));
    MK_CHECK(c1.run(cb.h));
    swiglu_rows<<<1024, 256, 0, st>>>(h2.bf(), act2.bf(), used, I);
    MK_CUDA_CHECK(cudaGetLastError());
    MK_CHECK(c2.run(cb.h));
    return ep->combine({y2.p}, out2.p, st);
  };
  Timing tu;
  MK_CHECK(time_it(comm, st, rc, "unfused layer (cuBLAS grouped)", unfused_call, &tu));
  r->unfused_us = tu.median_ms * 1e3;
  // Check: the layer's output against the unfused one, both from the same inputs.
  s = decoded(comm, layer_call());
  if (s.ok()) s = decoded(comm, unfused_call());
  if (s.ok()) s = CLI_CUDA(comm, cudaMemsetAsync(acc.p, 0, 16, st));
  if (s.ok()) {
    rel_err<<<256, 256, 0, st>>>(out.bf(), out2.bf(), T * H, static_cast<double*>(acc.p));
    s = CLI_CUDA(comm, cudaGetLastError());
  }
  if (s.ok()) s = synced(comm, st);
  double e[2] = {0, 0};
  if (s.ok()) s = CLI_CUDA(comm, cudaMemcpy(e, acc.p, 16, cudaMemcpyDeviceToHost));
  MK_CHECK(agreed(comm, s, "the layer check"));
  std::vector<double> all(size_t(2) * W);
  MK_CHECK(comm->bootstrap().allgather(e, all.data(), sizeof(e)));
  double num = 0, den = 0;
  for (int i = 0; i < W; ++i) num += all[size_t(2 * i)], den += all[size_t(2 * i + 1)];
  r->err = den > 0 ? std::sqrt(num / den) : (num > 0 ? 1.0 : 0.0);
  r->checked = true;
  r->correct = r->err < 2e-2 && std::isfinite(r->err) && den > 0;
#if MK_LAYER_NCCL
  if (comparable) {
    MK_CHECK(nccl_layer(comm, rc, seed, cb.h, x, wts, w1, w2, out, r));
    r->correct = r->correct && r->nccl_err < 2e-2;
  }
#else
  (void)comparable;
#endif
#else
  (void)comparable;
  r->checked = false;
#endif
  return agreed(comm, layer->destroy(), "destroying the layer");
}


#if MK_LAYER_NCCL
// The NCCL baseline (every rank its own GPU): one row per (token, expert) entry, sent to the
// expert's rank in (expert, token, slot) order — gather kernel, NCCL all-to-all-v, scatter into
// the expert-major layout, cuBLAS grouped GEMM, SwiGLU kernel, cuBLAS grouped GEMM, gather back,
// NCCL all-to-all-v back, a weighted sum per token. Every map and count is built on the host
// from every rank's routing (regenerated here), outside the timing.
Status nccl_layer(Communicator* comm, const RunCfg& rc, uint64_t seed, cublasHandle_t cb, const Buf& x,
                  const Buf& wts, const Buf& w1, const Buf& w2, const Buf& layer_out, LayerRow* r) {
  using ops::baseline::Baselines;
  const int W = comm->world(), me = comm->rank(), k = r->topk, E = r->experts, El = E / W;
  const int64_t T = r->tokens, H = r->hidden, I = r->inter;
  cudaStream_t st = comm->stream();
  std::vector<std::vector<int32_t>> ids(W);
  std::vector<float> unused_weights;  // the device's copy (wts) is what the baseline uses
  for (int src = 0; src < W; ++src) make_routing(seed, src, T, k, E, &ids[src], &unused_weights);
  // A source's entries (t * k + kk) to each destination, in (expert, token, slot) order.
  auto entries_to = [&](int src, int dst) {
    std::vector<int32_t> v;
    for (int64_t i = 0; i < T * k; ++i)
      if (ids[src][size_t(i)] >= 0 && ids[src][size_t(i)] / El == dst) v.push_back(int32_t(i));
    std::stable_sort(v.begin(), v.end(), [&](int32_t a, int32_t b) { return ids[src][size_t(a)] < ids[src][size_t(b)]; });
    return v;
  };
  std::vector<int64_t> send_rows(W), send_off(W + 1, 0), recv_rows(W), recv_off(W + 1, 0);
  std::vector<int2> gmap;               // x row -> send row
  std::vector<int32_t> pos(size_t(T * k), -1);  // entry -> its row in the returned buffer (= send row)
  for (int dst = 0; dst < W; ++dst) {
    const std::vector<int32_t> v = entries_to(me, dst);
    send_rows[dst] = int64_t(v.size());
    send_off[dst + 1] = send_off[dst] + send_rows[dst];
    for (size_t j = 0; j < v.size(); ++j) {
      gmap.push_back(make_int2(v[j] / k, int(send_off[dst] + int64_t(j))));
      pos[size_t(v[j])] = int32_t(send_off[dst] + int64_t(j));
    }
  }
  // Received from each source in its order; expert-major rows: by local expert, then source, then
  // the source's order.
  std::vector<int32_t> counts(El, 0), offsets(El + 1, 0);
  std::vector<std::vector<int32_t>> from(W);
  for (int src = 0; src < W; ++src) {
    from[src] = entries_to(src, me);
    recv_rows[src] = int64_t(from[src].size());
    recv_off[src + 1] = recv_off[src] + recv_rows[src];
    for (int32_t i : from[src]) ++counts[ids[src][size_t(i)] - me * El];
  }
  for (int le = 0; le < El; ++le) offsets[le + 1] = offsets[le] + counts[le];
  std::vector<int32_t> fill(offsets.begin(), offsets.end() - 1);
  std::vector<int2> smap, rmap;  // recv row -> expert row, and back
  for (int src = 0; src < W; ++src)
    for (size_t j = 0; j < from[src].size(); ++j) {
      const int32_t row = fill[ids[src][size_t(from[src][j])] - me * El]++;
      smap.push_back(make_int2(int(recv_off[src] + int64_t(j)), row));
      rmap.push_back(make_int2(row, int(recv_off[src] + int64_t(j))));
    }
  const int64_t ns = send_off[W], nr = recv_off[W];
  std::unique_ptr<Baselines> bl;
  MK_CHECK(agreed(comm, Baselines::create(comm->bootstrap(), comm->device(), &bl), "creating the NCCL baselines"));
  Buf sendb, recvb, xe, h, act, ye, yr, back, gm, sm, rm, dpos, out, acc;
  Status s;
  for (auto [b, bytes] : {std::pair<Buf*, size_t>{&sendb, size_t(ns * H * 2)}, {&recvb, size_t(nr * H * 2)},
                          {&xe, size_t(nr * H * 2)}, {&h, size_t(nr * 2 * I * 2)}, {&act, size_t(nr * I * 2)},
                          {&ye, size_t(nr * H * 2)}, {&yr, size_t(nr * H * 2)}, {&back, size_t(ns * H * 2)},
                          {&gm, gmap.size() * sizeof(int2)}, {&sm, smap.size() * sizeof(int2)},
                          {&rm, rmap.size() * sizeof(int2)}, {&dpos, pos.size() * 4}, {&out, size_t(T * H * 2)},
                          {&acc, 16}})
    if (s.ok()) s = CLI_CUDA(comm, b->alloc(bytes));
  auto up = [&](const Buf& b, const void* src, size_t bytes) {
    if (s.ok() && bytes) s = CLI_CUDA(comm, cudaMemcpy(b.p, src, bytes, cudaMemcpyHostToDevice));
  };
  up(gm, gmap.data(), gmap.size() * sizeof(int2));
  up(sm, smap.data(), smap.size() * sizeof(int2));
  up(rm, rmap.data(), rmap.size() * sizeof(int2));
  up(dpos, pos.data(), pos.size() * 4);
  if (s.ok()) s = CLI_CUDA(comm, cudaDeviceSynchronize());  // the pageable copies' DMA has landed
  CublasGrouped c1, c2;
  if (s.ok()) s = c1.build(comm, counts, offsets, xe.bf(), w1.bf(), h.bf(), 2 * I, H);
  if (s.ok()) s = c2.build(comm, counts, offsets, act.bf(), w2.bf(), ye.bf(), H, I);
  MK_CHECK(agreed(comm, s, "the NCCL baseline's setup"));
  auto grid = [](int64_t n) { return int(std::max<int64_t>(1, std::min<int64_t>(n, 1024))); };
  const int64_t rb = H * 2;
  auto call = [&]() -> Status {
    permute_rows<<<grid(ns), 128, 0, st>>>(static_cast<const char*>(x.p), static_cast<char*>(sendb.p),
                                           static_cast<const int2*>(gm.p), ns, rb);
    MK_CHECK(bl->alltoallv(sendb.p, send_rows.data(), send_off.data(), recvb.p, recv_rows.data(), recv_off.data(), H,
                           st));
    permute_rows<<<grid(nr), 128, 0, st>>>(static_cast<const char*>(recvb.p), static_cast<char*>(xe.p),
                                           static_cast<const int2*>(sm.p), nr, rb);
    MK_CHECK(c1.run(cb));
    swiglu_rows<<<1024, 256, 0, st>>>(h.bf(), act.bf(), nr, I);
    MK_CHECK(c2.run(cb));
    permute_rows<<<grid(nr), 128, 0, st>>>(static_cast<const char*>(ye.p), static_cast<char*>(yr.p),
                                           static_cast<const int2*>(rm.p), nr, rb);
    MK_CHECK(bl->alltoallv(yr.p, recv_rows.data(), recv_off.data(), back.p, send_rows.data(), send_off.data(), H, st));
    weighted_sum<<<1024, 256, 0, st>>>(back.bf(), static_cast<const int32_t*>(dpos.p), static_cast<const float*>(wts.p),
                                       T, k, H, out.bf());
    return CLI_CUDA(comm, cudaGetLastError());
  };
  s = decoded(comm, call());
  if (s.ok()) s = CLI_CUDA(comm, cudaMemsetAsync(acc.p, 0, 16, st));
  if (s.ok()) {
    rel_err<<<256, 256, 0, st>>>(out.bf(), layer_out.bf(), T * H, static_cast<double*>(acc.p));
    s = CLI_CUDA(comm, cudaGetLastError());
  }
  if (s.ok()) s = synced(comm, st);
  double e[2] = {0, 0};
  if (s.ok()) s = CLI_CUDA(comm, cudaMemcpy(e, acc.p, 16, cudaMemcpyDeviceToHost));
  MK_CHECK(agreed(comm, s, "the NCCL baseline's check"));
  std::vector<double> all(size_t(2) * W);
  MK_CHECK(comm->bootstrap().allgather(e, all.data(), sizeof(e)));
  double num = 0, den = 0;
  for (int i = 0; i < W; ++i) num += all[size_t(2 * i)], den += all[size_t(2 * i + 1)];
  r->nccl_err = den > 0 ? std::sqrt(num / den) : 1.0;
  Timing t;
  MK_CHECK(time_it(comm, st, rc, "NCCL all-to-all-v + cuBLAS grouped layer", call, &t));
  r->nccl_us = t.median_ms * 1e3;
  return OkStatus();
}
#endif

}  // namespace

std::vector<std::string> moe_layer_presets() {
  std::vector<std::string> v;
  for (const LayerPreset& p : kLayerPresets) v.push_back(p.name);
  return v;
}

int moe_layer(const Env& env, const MoeBenchArgs& a) {
  Communicator* comm = env.comm;
  const int W = comm->world(), me = comm->rank(), nodes = comm->topology().num_nodes;
  const bool shared = !env.own_gpu;
  uint64_t seed = 0;
  if (me == 0) seed = mix(uint64_t(std::chrono::system_clock::now().time_since_epoch().count()));
  if (!comm->bootstrap().broadcast(&seed, sizeof(seed), 0).ok()) return 1;
  std::vector<const LayerPreset*> chosen;
  if (a.presets.empty())
    for (const LayerPreset& p : kLayerPresets) chosen.push_back(&p);
  for (const std::string& name : a.presets)
    for (const LayerPreset& p : kLayerPresets)
      if (name == p.name && std::find(chosen.begin(), chosen.end(), &p) == chosen.end()) chosen.push_back(&p);
  const std::vector<int64_t> token_list = a.tokens > 0 ? std::vector<int64_t>{a.tokens} : std::vector<int64_t>{128, 4096};
  if (me == 0) {
    printf("moe_layer: bf16, %d rank(s), %d node(s), seed 0x%016llx%s\n", W, nodes, (unsigned long long)seed,
           shared ? "; ranks share a GPU: tokens scaled down, times not comparable across GPUs" : "");
    printf("unfused = mkernel dispatch + cuBLAS grouped GEMM + SwiGLU kernel + cuBLAS grouped GEMM + mkernel combine "
           "(separate launches); compute = mkernel's two grouped GEMMs alone; comm = dispatch + combine alone\n");
    printf("nccl = NCCL all-to-all-v of one row per (token, expert) + permute kernels + cuBLAS grouped GEMMs + SwiGLU "
           "kernel + weighted sum (one GPU per rank only)\n");
    printf("%-12s %3s %6s %5s %6s %4s %2s  %-6s %10s %10s %8s %10s %8s %10s %10s %8s\n", "preset", "W", "tokens", "H",
           "I", "E", "k", "check", "layer_us", "unfused_us", "vs_unf", "nccl_us", "vs_nccl", "compute_us", "comm_us",
           "overlap");
  }
  std::vector<std::string> rows;
  std::vector<CheckLine> checks;
  bool failed = false;
  int idx = 0;
  for (const LayerPreset* p : chosen) {
    for (int64_t tok : token_list) {
      LayerRow r;
      r.preset = p->name;
      r.W = W, r.nodes = nodes, r.topk = p->topk, r.hidden = p->hidden, r.inter = p->inter;
      r.experts_preset = p->experts;
      r.experts = (p->experts + W - 1) / W * W;
      r.tokens_preset = tok;
      r.tokens = shared && a.tokens == 0 ? std::min(tok, std::max<int64_t>(1, kSharedTokens / W)) : tok;
      r.tokens_scaled = r.tokens != tok;
      r.shared = shared;
      CheckLine c;
      c.label = "moe_layer " + r.preset + " tokens " + std::to_string(r.tokens) + " W " + std::to_string(W);
      const Status s = bench_layer_one(comm, a.rc, mix(seed ^ uint64_t(++idx)), env.comparable, &r);
      c.done = r.checked, c.ok = r.correct;
      if (!s.ok()) {
        c.error = s.to_string();
        note_failure(s);
        if (me == 0) fprintf(stderr, "bench moe_layer %s: %s\n", r.preset.c_str(), c.error.c_str());
      }
      checks.push_back(c);
      if (!s.ok()) {
        if (communicator_failed(comm)) break;
        continue;
      }
      const double ov = overlap_eff(W, r.compute_us, r.comm_us, r.layer_us);
      if (me == 0) {
        std::string notes;
        if (r.experts != r.experts_preset) notes += "  (experts rounded up to a multiple of W)";
        if (r.tokens_scaled) notes += "  (tokens " + std::to_string(tok) + " -> " + std::to_string(r.tokens) + ")";
        printf("%-12s %3d %6lld %5lld %6lld %4d %2d  %-6s %10s %10s %8s %10s %8s %10s %10s %8s%s\n", r.preset.c_str(),
               W, (long long)r.tokens, (long long)r.hidden, (long long)r.inter, r.experts, r.topk,
               !r.checked ? "n/a" : r.correct ? "ok" : "WRONG", cell(r.layer_us, 1).c_str(),
               r.unfused_us > 0 ? cell(r.unfused_us, 1).c_str() : "n/a", cell(ratio(r.unfused_us, r.layer_us), 3).c_str(),
               r.nccl_us > 0 ? cell(r.nccl_us, 1).c_str() : "n/a", cell(ratio(r.nccl_us, r.layer_us), 3).c_str(),
               cell(r.compute_us, 1).c_str(), cell(r.comm_us, 1).c_str(), eff_cell(ov).c_str(), notes.c_str());
        fflush(stdout);
      }
      char b[1536];
      snprintf(b, sizeof b,
               "{\"op\": \"moe_layer\", \"preset\": \"%s\", \"W\": %d, \"nodes\": %d, \"tokens\": %lld, "
               "\"tokens_preset\": %lld, \"hidden\": %lld, \"intermediate\": %lld, \"experts\": %d, \"topk\": %d, "
               "\"checked\": %s, \"correct\": %s, \"rel_err_vs_unfused\": %s, \"layer_us\": %s, \"unfused_us\": %s, "
               "\"speedup_vs_unfused\": %s, \"nccl_us\": %s, \"speedup_vs_nccl\": %s, \"rel_err_nccl_vs_layer\": %s, "
               "\"compute_us\": %s, \"comm_us\": %s, \"overlap\": %s, \"shared_gpu\": %s}",
               r.preset.c_str(), W, nodes, (long long)r.tokens, (long long)tok, (long long)r.hidden, (long long)r.inter,
               r.experts, r.topk, r.checked ? "true" : "false", r.correct ? "true" : "false", jnum(r.err, 5).c_str(),
               jnum(r.layer_us, 2).c_str(), jnum(r.unfused_us, 2).c_str(), jnum(ratio(r.unfused_us, r.layer_us), 4).c_str(),
               jnum(r.nccl_us, 2).c_str(), jnum(ratio(r.nccl_us, r.layer_us), 4).c_str(),
               r.nccl_us > 0 ? jnum(r.nccl_err, 5).c_str() : "null", jnum(r.compute_us, 2).c_str(), jnum(r.comm_us, 2).c_str(), eff_json(ov).c_str(),
               shared ? "true" : "false");
      rows.push_back(b);
    }
  }
  if (me == 0 && !env.json.empty() && !write_json(env.json, W, nodes, env.comparable, rows)) failed = true;
  return summarize(comm, checks, "the layer's output against the unfused layer's (cuBLAS GEMMs), rel. error < 2e-2",
                   failed);
}

}  // namespace bench
}  // namespace mk
