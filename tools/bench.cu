// `mkernel bench <op>`: the fused GEMM collectives against cuBLAS + NCCL on the local GPUs.
//
//   mkernel bench ag_gemm|gemm_rs|gemm_ar|all [--m M --n N --k K] [--reps R] [--json FILE]
//   mkernel bench ring_attention [--seq S_per_rank]... [--non-causal] [--reps R] [--json FILE] [--trace PREFIX]
//
// Under mpirun one rank per process (else one rank). Per operator and shape: a correctness
// check of the fused result against the unfused GEMM on the same GPU (small integers, exact),
// then timings — median of --reps calls after warm-up, CUDA events around each call on the
// stream — of the fused kernel, its compute alone (T_c: the same GEMM without communication),
// and, when every rank has its own GPU, cuBLAS then NCCL, cuBLAS + NCCL pipelined in 4 row
// chunks, and the NCCL collective alone (T_x). When ranks share a GPU (processes under MPS)
// NCCL cannot run and fused times are not comparable with multi-GPU runs: they are marked so.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/trace.h"
#include "mkernel/gemm/gemm.h"
#include "mkernel/mkernel.h"
#include "mkernel/attention/attention.h"
#include "mkernel/ops/fused.h"
#include "mkernel/ops/ring_attention.h"
#include "tools/cli.h"
#if MK_HAVE_NCCL
#include "mkernel/ops/baseline.h"
#endif

namespace mk {
namespace cli {
namespace {

using ops::FusedKind;

__device__ inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}
// ints: integers in [-2, 2] (exact products); else approximately normal values (sum of 4 uniforms).
__global__ void fill(__nv_bfloat16* p, int64_t rows, int64_t cols, int64_t ld, uint64_t seed, int64_t row0,
                     int64_t src_cols, bool ints) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const uint64_t h = mix(seed ^ (uint64_t(r + row0) * uint64_t(src_cols) + uint64_t(c)));
    float v;
    if (ints) v = float(int(h % 5) - 2);
    else v = (float(h & 0xffff) + float((h >> 16) & 0xffff) + float((h >> 32) & 0xffff) + float(h >> 48)) / 65536.f - 2.f;
    p[r * ld + c] = __float2bfloat16(v);
  }
}
__global__ void count_diff(const uint16_t* a, const uint16_t* b, int64_t n, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (a[i] != b[i]) atomicAdd(bad, 1ull);
}

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { cudaMalloc(&p, std::max<size_t>(bytes, 16)); }
  ~Buf() { cudaFree(p); }
  __nv_bfloat16* bf() const { return static_cast<__nv_bfloat16*>(p); }
};

struct Timing {
  double median_ms = 0, min_ms = 0;
};

template <class F>
Status time_it(Communicator* comm, cudaStream_t st, int warm, int reps, F&& f, Timing* out) {
  for (int i = 0; i < warm; ++i) MK_CHECK(f());
  MK_CHECK(comm->sync(st));
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) MK_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    // Ranks start each call together, as in a training step.
    MK_CHECK(comm->bootstrap().barrier());
    MK_CUDA_CHECK(cudaEventRecord(ev[2 * i], st));
    MK_CHECK(f());
    MK_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], st));
  }
  MK_CHECK(comm->sync(st));
  std::vector<double> ms(reps);
  for (int i = 0; i < reps; ++i) {
    float t = 0;
    MK_CUDA_CHECK(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
    ms[i] = t;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  // The slowest rank's time is the call's time.
  std::vector<double> all(size_t(reps) * comm->world());
  MK_CHECK(comm->bootstrap().allgather(ms.data(), all.data(), sizeof(double) * reps));
  for (int i = 0; i < reps; ++i)
    for (int r = 0; r < comm->world(); ++r) ms[i] = std::max(ms[i], all[size_t(r) * reps + i]);
  std::sort(ms.begin(), ms.end());
  out->median_ms = ms[reps / 2];
  out->min_ms = ms[0];
  return OkStatus();
}

struct Row {
  std::string op;
  int64_t M, N, K;
  int W;
  bool correct = false;
  unsigned long long bad = 0;
  bool comparable = false;
  double fused = 0, compute = 0, seq = 0, pipe = 0, coll = 0;  // ms (0: not run)
  double flops = 0;
};

// The flops of the whole operator (all ranks' GEMMs) per call, per rank's share.
double flops_of(FusedKind k, int64_t M, int64_t N, int64_t K) { return 2.0 * double(M) * double(N) * double(K); }

Status bench_one(Communicator* comm, FusedKind kind, int64_t M, int64_t N, int64_t K, int reps, bool comparable,
                 Row* row) {
  const int W = comm->world(), me = comm->rank();
  cudaStream_t st = comm->stream();
  row->op = ops::fused_kind_name(kind);
  row->M = M, row->N = N, row->K = K, row->W = W;
  row->comparable = comparable;
  row->flops = flops_of(kind, M, N, K);
  std::unique_ptr<ops::FusedGemm> op;
  MK_CHECK(ops::FusedGemm::create(comm, kind, {M, N, K}, ops::FusedOptions{}, &op));
  const int64_t a_rows = kind == FusedKind::kAgGemm ? M / W : M;
  const int64_t c_rows = kind == FusedKind::kGemmRs ? M / W : M;
  Buf A(size_t(a_rows) * K * 2), B(size_t(N) * K * 2), C(size_t(c_rows) * N * 2);
  Buf Aref(kind == FusedKind::kAgGemm ? size_t(M) * K * 2 : size_t(M) * K * W * 2);
  Buf Bref(kind == FusedKind::kAgGemm ? 16 : size_t(N) * K * W * 2), Cref(size_t(M) * N * 2);
  // Correctness: exact small integers; the reference is the unfused GEMM over inputs every rank
  // rebuilds (AG: the gathered A; RS/AR: one GEMM over the ranks' concatenated K).
  auto fill_inputs = [&](bool ints) {
    const uint64_t sa = 0x5eed0000, sb = 0x5eed1000;
    if (kind == FusedKind::kAgGemm) {
      fill<<<264, 256, 0, st>>>(A.bf(), M / W, K, K, sa, me * (M / W), K, ints);
      fill<<<264, 256, 0, st>>>(B.bf(), N, K, K, sb + me, 0, K, ints);
      if (ints) fill<<<264, 256, 0, st>>>(Aref.bf(), M, K, K, sa, 0, K, ints);
    } else {
      fill<<<264, 256, 0, st>>>(A.bf(), M, K, K, sa + me, 0, K, ints);
      fill<<<264, 256, 0, st>>>(B.bf(), N, K, K, sb + me, 0, K, ints);
      if (ints)
        for (int r = 0; r < W; ++r) {
          fill<<<264, 256, 0, st>>>(Aref.bf() + r * K, M, K, W * K, sa + r, 0, K, ints);
          fill<<<264, 256, 0, st>>>(Bref.bf() + r * K, N, K, W * K, sb + r, 0, K, ints);
        }
    }
  };
  fill_inputs(true);
  gemm::Arguments ref;
  ref.A = Aref.p;
  ref.B = kind == FusedKind::kAgGemm ? B.p : Bref.p;
  ref.C = Cref.p;
  ref.M = M, ref.N = N, ref.K = kind == FusedKind::kAgGemm ? K : K * W;
  MK_CHECK(gemm::run(ref, st));
  MK_CUDA_CHECK(cudaMemsetAsync(C.p, 0xff, size_t(c_rows) * N * 2, st));
  MK_CHECK(comm->sync(st));
  ops::FusedArgs fa;
  fa.A = A.p, fa.B = B.p, fa.C = C.p;
  MK_CHECK(op->run(fa, st));
  unsigned long long* d_bad = nullptr;
  MK_CUDA_CHECK(cudaMalloc(&d_bad, sizeof(*d_bad)));
  MK_CUDA_CHECK(cudaMemsetAsync(d_bad, 0, sizeof(*d_bad), st));
  const int64_t row0 = kind == FusedKind::kGemmRs ? me * (M / W) : 0;
  count_diff<<<264, 256, 0, st>>>(static_cast<uint16_t*>(C.p), static_cast<uint16_t*>(Cref.p) + row0 * N,
                                  c_rows * N, d_bad);
  MK_CUDA_CHECK(cudaMemcpyAsync(&row->bad, d_bad, sizeof(row->bad), cudaMemcpyDeviceToHost, st));
  MK_CHECK(comm->sync(st));
  cudaFree(d_bad);
  std::vector<unsigned long long> bads(W);
  MK_CHECK(comm->bootstrap().allgather(&row->bad, bads.data(), sizeof(row->bad)));
  row->bad = 0;
  for (auto b : bads) row->bad += b;
  row->correct = row->bad == 0;

  // Timing on approximately normal data (the GEMM's speed depends on the data).
  fill_inputs(false);
  const int warm = 3;
  Timing t;
  MK_CHECK(time_it(comm, st, warm, reps, [&] { return op->enqueue(fa, st); }, &t));
  row->fused = t.median_ms;
  gemm::Arguments g;  // T_c: the same GEMM without communication
  g.A = kind == FusedKind::kAgGemm ? op->gathered_a() : A.p;
  g.B = B.p;
  g.C = Cref.p;
  g.M = M, g.N = N, g.K = K;
  MK_CHECK(time_it(comm, st, warm, reps, [&] { return gemm::run(g, st); }, &t));
  row->compute = t.median_ms;
#if MK_HAVE_NCCL
  if (comparable) {
    std::unique_ptr<ops::baseline::Baselines> bl;
    MK_CHECK(ops::baseline::Baselines::create(comm->bootstrap(), comm->device(), &bl));
    using ops::baseline::Baselines;
    const int chunks = 4;
    const bool can_chunk = (M / W) % chunks == 0;
    if (kind == FusedKind::kAgGemm) {
      Buf full(size_t(M) * K * 2), ws(Baselines::ag_workspace_bytes(M, K, W, chunks));
      MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->ag_gemm(A.p, B.p, C.p, full.p, ws.p, M, N, K, 1, st); }, &t));
      row->seq = t.median_ms;
      if (can_chunk) {
        MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->ag_gemm(A.p, B.p, C.p, full.p, ws.p, M, N, K, chunks, st); }, &t));
        row->pipe = t.median_ms;
      }
      MK_CHECK(time_it(comm, st, warm, reps, [&] {
        return bl->collective(Baselines::Coll::kAllGather, A.p, full.p, size_t(M) * K, st); }, &t));
      row->coll = t.median_ms;
    } else if (kind == FusedKind::kGemmRs) {
      Buf ws(Baselines::rs_workspace_bytes(M, N, W, chunks));
      MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->gemm_rs(A.p, B.p, C.p, ws.p, M, N, K, 1, st); }, &t));
      row->seq = t.median_ms;
      if (can_chunk) {
        MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->gemm_rs(A.p, B.p, C.p, ws.p, M, N, K, chunks, st); }, &t));
        row->pipe = t.median_ms;
      }
      MK_CHECK(time_it(comm, st, warm, reps, [&] {
        return bl->collective(Baselines::Coll::kReduceScatter, ws.p, C.p, size_t(M / W) * N, st); }, &t));
      row->coll = t.median_ms;
    } else {
      Buf full(size_t(M) * N * 2);
      MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->gemm_ar(A.p, B.p, full.p, M, N, K, 1, st); }, &t));
      row->seq = t.median_ms;
      if (M % chunks == 0) {
        MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->gemm_ar(A.p, B.p, full.p, M, N, K, chunks, st); }, &t));
        row->pipe = t.median_ms;
      }
      MK_CHECK(time_it(comm, st, warm, reps, [&] {
        return bl->collective(Baselines::Coll::kAllReduce, full.p, full.p, size_t(M) * N, st); }, &t));
      row->coll = t.median_ms;
    }
  }
#endif
  MK_CHECK(op->destroy());
  return OkStatus();
}

std::string row_json(const Row& r) {
  char b[768];
  auto tf = [&](double ms) { return ms > 0 ? r.flops / (ms * 1e-3) / 1e12 : 0.0; };
  double eff = 0;
  if (r.coll > 0 && r.compute > 0)
    eff = (r.compute + r.coll - r.fused) / std::min(r.compute, r.coll);
  snprintf(b, sizeof b,
           "{\"op\": \"%s\", \"M\": %lld, \"N\": %lld, \"K\": %lld, \"world\": %d, \"correct\": %s, "
           "\"mismatches\": %llu, \"comparable\": %s, \"fused_ms\": %.4f, \"compute_only_ms\": %.4f, "
           "\"cublas_nccl_ms\": %.4f, \"cublas_nccl_pipelined_ms\": %.4f, \"nccl_only_ms\": %.4f, "
           "\"fused_tflops_per_rank\": %.1f, \"speedup_vs_sequential\": %.3f, \"speedup_vs_pipelined\": %.3f, "
           "\"overlap_efficiency\": %.3f}",
           r.op.c_str(), (long long)r.M, (long long)r.N, (long long)r.K, r.W, r.correct ? "true" : "false", r.bad,
           r.comparable ? "true" : "false", r.fused, r.compute, r.seq, r.pipe, r.coll, tf(r.fused),
           r.seq > 0 ? r.seq / r.fused : 0.0, r.pipe > 0 ? r.pipe / r.fused : 0.0, eff);
  return b;
}


// ---- ring attention ----

// Rank r's K (which 0) or V (which 1) block: approximately normal values from a hash.
__global__ void fill_block(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix(seed ^ uint64_t(i));
    const float v = (float(h & 0xffff) + float((h >> 16) & 0xffff) + float((h >> 32) & 0xffff) + float(h >> 48)) / 65536.f - 2.f;
    p[i] = __float2bfloat16(v);
  }
}
__global__ void count_far(const __nv_bfloat16* got, const __nv_bfloat16* want, int64_t n, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(got[i]), w = __bfloat162float(want[i]);
    if (!(fabsf(g - w) <= 2e-3f + 1.6e-2f * fabsf(w))) atomicAdd(bad, 1ull);
  }
}

struct RingRow {
  int64_t S_l = 0;
  int W = 0, B = 1, H = 32, Hkv = 32, D = 128;
  bool causal = true, zigzag = true, correct = false, comparable = false;
  unsigned long long bad = 0;
  double fused = 0, compute = 0, allgather = 0, sendrecv = 0, coll = 0, flops = 0;
};

Status bench_ring_one(Communicator* comm, RingRow* r, int reps, const std::string& trace) {
  const int W = comm->world(), me = comm->rank();
  cudaStream_t st = comm->stream();
  ops::RingAttentionShape sh{r->B, r->H, r->Hkv, r->D, r->S_l * W,
                             r->zigzag ? ops::SeqLayout::kZigzag : ops::SeqLayout::kContiguous, r->causal};
  std::unique_ptr<ops::RingAttention> op;
  MK_CHECK(ops::RingAttention::create(comm, sh, {}, &op));
  const size_t qe = size_t(r->B) * r->S_l * r->H * r->D, ke = op->block_elems();
  Buf q(qe * 2), o(qe * 2), o_ref(qe * 2), k_all(ke * W * 2), v_all(ke * W * 2), kb0(ke * 2), kb1(ke * 2), vb0(ke * 2),
      vb1(ke * 2);
  fill_block<<<264, 256, 0, st>>>(q.bf(), int64_t(qe), 0x9000 + me);
  for (int s = 0; s < W; ++s) {
    fill_block<<<264, 256, 0, st>>>(k_all.bf() + size_t(s) * ke, int64_t(ke), 0x1000 + s);
    fill_block<<<264, 256, 0, st>>>(v_all.bf() + size_t(s) * ke, int64_t(ke), 0x2000 + s);
  }
  ops::RingAttentionArgs a{q.p, k_all.bf() + size_t(me) * ke, v_all.bf() + size_t(me) * ke, o.p, nullptr};
  // Correctness: the fused ring against the same kernel over the blocks gathered here.
  MK_CUDA_CHECK(cudaMemsetAsync(o.p, 0xff, qe * 2, st));
  MK_CHECK(op->run(a, st));
  ops::RingAttentionArgs ar = a;
  ar.o = o_ref.p;
  MK_CHECK(op->enqueue_compute(ar, -1, k_all.p, v_all.p, st));
  unsigned long long* d_bad = nullptr;
  MK_CUDA_CHECK(cudaMalloc(&d_bad, sizeof(*d_bad)));
  MK_CUDA_CHECK(cudaMemsetAsync(d_bad, 0, sizeof(*d_bad), st));
  count_far<<<264, 256, 0, st>>>(o.bf(), o_ref.bf(), int64_t(qe), d_bad);
  MK_CUDA_CHECK(cudaMemcpyAsync(&r->bad, d_bad, sizeof(r->bad), cudaMemcpyDeviceToHost, st));
  MK_CHECK(comm->sync(st));
  cudaFree(d_bad);
  std::vector<unsigned long long> bads(W);
  MK_CHECK(comm->bootstrap().allgather(&r->bad, bads.data(), sizeof(r->bad)));
  r->bad = 0;
  for (auto b : bads) r->bad += b;
  r->correct = r->bad == 0;
  // Per rank: its queries against the whole sequence (causal: the visible half on average).
  r->flops = attention::forward_flops(r->B, r->H, int(r->S_l), int(r->S_l * W), r->D, r->causal);
  const int warm = 3;
  Timing t;
  MK_CHECK(time_it(comm, st, warm, reps, [&] { return op->enqueue(a, st); }, &t));
  r->fused = t.median_ms;
  MK_CHECK(time_it(comm, st, warm, reps, [&] { return op->enqueue_compute(a, -1, k_all.p, v_all.p, st); }, &t));
  r->compute = t.median_ms;
  if (!trace.empty()) {
    // One traced fused call: the per-CTA timeline of this rank (tools/trace_png.py draws it).
    TraceRecorder rec;
    MK_CHECK(TraceRecorder::create(uint32_t(64 * (op->work_items() + op->comm_ops()) + 4096), &rec));
    ops::RingAttentionArgs at = a;
    at.trace = rec.device();
    MK_CHECK(comm->bootstrap().barrier());
    MK_CHECK(op->enqueue(at, st));
    MK_CHECK(comm->sync(st));
    std::vector<TraceEvent> ev;
    uint64_t dropped = 0;
    MK_CHECK(rec.fetch(&ev, &dropped));
    const std::string path = trace + ".s" + std::to_string(r->S_l) + ".w" + std::to_string(W) + ".rank" +
                             std::to_string(me) + ".json";
    MK_CHECK(write_chrome_trace(ev, path));
    if (me == 0) printf("trace: %zu events (%llu dropped) -> %s\n", ev.size(), (unsigned long long)dropped, path.c_str());
  }
#if MK_HAVE_NCCL
  if (r->comparable) {
    std::unique_ptr<ops::baseline::Baselines> bl;
    MK_CHECK(ops::baseline::Baselines::create(comm->bootstrap(), comm->device(), &bl));
    MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->ring_attn_allgather(*op, a, k_all.p, v_all.p, st); }, &t));
    r->allgather = t.median_ms;
    void* kb[2] = {kb0.p, kb1.p};
    void* vb[2] = {vb0.p, vb1.p};
    MK_CHECK(time_it(comm, st, warm, reps, [&] { return bl->ring_attn_sendrecv(*op, a, kb, vb, st); }, &t));
    r->sendrecv = t.median_ms;
    MK_CHECK(time_it(comm, st, warm, reps, [&] {
      MK_CHECK(bl->collective(ops::baseline::Baselines::Coll::kAllGather, a.k, k_all.p, ke * W, st));
      return bl->collective(ops::baseline::Baselines::Coll::kAllGather, a.v, v_all.p, ke * W, st); }, &t));
    r->coll = t.median_ms;
  }
#endif
  return op->destroy();
}

std::string ring_json(const RingRow& r) {
  char b[768];
  const double eff = r.coll > 0 && r.compute > 0 ? (r.compute + r.coll - r.fused) / std::min(r.compute, r.coll) : 0;
  snprintf(b, sizeof b,
           "{\"op\": \"ring_attention\", \"B\": %d, \"H\": %d, \"Hkv\": %d, \"D\": %d, \"seq_per_rank\": %lld, "
           "\"world\": %d, \"causal\": %s, \"layout\": \"%s\", \"correct\": %s, \"mismatches\": %llu, "
           "\"comparable\": %s, \"fused_ms\": %.4f, \"compute_only_ms\": %.4f, \"allgather_then_attention_ms\": %.4f, "
           "\"sendrecv_ring_ms\": %.4f, \"nccl_allgather_kv_ms\": %.4f, \"fused_tflops_per_rank\": %.1f, "
           "\"speedup_vs_allgather\": %.3f, \"speedup_vs_sendrecv\": %.3f, \"overlap_efficiency\": %.3f}",
           r.B, r.H, r.Hkv, r.D, (long long)r.S_l, r.W, r.causal ? "true" : "false", r.zigzag ? "zigzag" : "contiguous",
           r.correct ? "true" : "false", r.bad, r.comparable ? "true" : "false", r.fused, r.compute, r.allgather,
           r.sendrecv, r.coll, r.flops / (r.fused * 1e-3) / 1e12, r.allgather > 0 ? r.allgather / r.fused : 0.0,
           r.sendrecv > 0 ? r.sendrecv / r.fused : 0.0, eff);
  return b;
}

int bench_ring(Communicator* comm, const std::vector<int64_t>& seqs, int reps, bool comparable, bool causal,
               const std::string& json, const std::string& trace) {
  const int W = comm->world(), me = comm->rank();
  if (me == 0) {
    printf("ring_attention: B1 H32 D128 bf16, %s, zigzag; %s\n", causal ? "causal" : "non-causal",
           comparable ? "one GPU per rank: vs NCCL all-gather + attention and a per-step NCCL send/recv ring"
                      : "ranks share a GPU (or no NCCL): correctness and fused times only, NOT comparable");
    printf("%8s %3s  %-6s %9s %8s %9s %9s %9s %9s %7s %7s %7s\n", "S/rank", "W", "check", "fused_ms", "TFLOP/s",
           "comp_ms", "ag_ms", "ring_ms", "nccl_ms", "vs_ag", "vs_ring", "overlap");
  }
  std::vector<RingRow> rows;
  int rc = 0;
  for (int64_t S_l : seqs) {
    RingRow r;
    r.S_l = S_l, r.W = W, r.causal = causal, r.comparable = comparable;
    Status s = bench_ring_one(comm, &r, reps, trace);
    if (!s.ok()) {
      if (me == 0) fprintf(stderr, "bench ring_attention S/rank %lld: %s\n", (long long)S_l, s.to_string().c_str());
      rc = 1;
      continue;
    }
    if (!r.correct) rc = 1;
    rows.push_back(r);
    if (me == 0) {
      const double eff = r.coll > 0 ? (r.compute + r.coll - r.fused) / std::min(r.compute, r.coll) : 0;
      printf("%8lld %3d  %-6s %9.3f %8.1f %9.3f %9.3f %9.3f %9.3f %7.2f %7.2f %7.2f%s\n", (long long)S_l, W,
             r.correct ? "ok" : "WRONG", r.fused, r.flops / (r.fused * 1e-3) / 1e12, r.compute, r.allgather,
             r.sendrecv, r.coll, r.allgather > 0 ? r.allgather / r.fused : 0, r.sendrecv > 0 ? r.sendrecv / r.fused : 0,
             eff, comparable ? "" : "  (not comparable)");
      fflush(stdout);
    }
  }
  if (me == 0 && !json.empty()) {
    FILE* f = fopen(json.c_str(), "w");
    if (f) {
      fprintf(f, "{\"world\": %d, \"nodes\": %d, \"comparable\": %s, \"results\": [\n", W, comm->topology().num_nodes,
              comparable ? "true" : "false");
      for (size_t i = 0; i < rows.size(); ++i) fprintf(f, "  %s%s\n", ring_json(rows[i]).c_str(), i + 1 < rows.size() ? "," : "");
      fprintf(f, "]}\n");
      fclose(f);
    } else {
      rc = 1;
    }
  }
  return rc;
}

}  // namespace

int bench(const std::vector<std::string>& args) {
  std::string which, json, trace;
  int64_t m = 0, n = 0, k = 0;
  int reps = 20;
  std::vector<int64_t> seqs;
  bool causal = true;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto next = [&]() -> std::string { return i + 1 < args.size() ? args[++i] : std::string(); };
    if (a == "--m") m = std::stoll(next());
    else if (a == "--n") n = std::stoll(next());
    else if (a == "--k") k = std::stoll(next());
    else if (a == "--reps") reps = std::max(3, std::stoi(next()));
    else if (a == "--json") json = next();
    else if (a == "--seq") seqs.push_back(std::stoll(next()));
    else if (a == "--non-causal") causal = false;
    else if (a == "--trace") trace = next();
    else if (a == "--dtype") {
      if (next() != "bf16") {
        fprintf(stderr, "bench: only --dtype bf16 is implemented\n");
        return 2;
      }
    } else if (which.empty() && a[0] != '-') which = a;
    else {
      fprintf(stderr, "bench: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::vector<FusedKind> kinds;
  if (which == "ag_gemm") kinds = {FusedKind::kAgGemm};
  else if (which == "gemm_rs") kinds = {FusedKind::kGemmRs};
  else if (which == "gemm_ar") kinds = {FusedKind::kGemmAr};
  else if (which == "all" || which.empty()) kinds = {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr};
  else if (which != "ring_attention") {
    fprintf(stderr, "bench: unknown operator '%s' (ag_gemm, gemm_rs, gemm_ar, ring_attention, all)\n", which.c_str());
    return 2;
  }
  std::unique_ptr<Bootstrap> bs;
  Status s;
  if (launched_by_mpi() && have_mpi()) {
    s = make_mpi_world_bootstrap(&bs);
  } else {
    std::vector<std::unique_ptr<Bootstrap>> w;
    s = make_thread_world(1, &w);
    if (s.ok()) bs = std::move(w[0]);
  }
  std::unique_ptr<Communicator> comm;
  if (s.ok()) {
    CommConfig cfg;
    cfg.require_gpu = true;
    s = Communicator::create(std::move(bs), cfg, &comm);
  }
  if (!s.ok()) {
    fprintf(stderr, "bench: %s\n", s.to_string().c_str());
    return 1;
  }
  const int W = comm->world(), me = comm->rank();
  // NCCL needs one GPU per rank: compare only when no two ranks share one.
  std::set<std::string> gpus;
  for (const auto& info : comm->topology().info) gpus.insert(std::string(reinterpret_cast<const char*>(info.gpu_uuid), 16));
  bool comparable = int(gpus.size()) == W;
#if !MK_HAVE_NCCL
  comparable = false;
#endif
  if (which == "ring_attention") {
    if (seqs.empty()) seqs = {4096, 8192};
    int rc = bench_ring(comm.get(), seqs, reps, comparable, causal, json, trace);
    Status d = comm->destroy();
    if (!d.ok()) {
      fprintf(stderr, "bench: %s\n", d.to_string().c_str());
      rc = 1;
    }
    return rc;
  }
  if (me == 0) {
    printf("mkernel bench: %d rank(s), %d node(s); %s\n", W, comm->topology().num_nodes,
           comparable ? "one GPU per rank: fused vs cuBLAS + NCCL"
                      : "ranks share a GPU (or no NCCL): correctness and fused times only, NOT comparable "
                        "with multi-GPU runs; no NCCL baselines");
    printf("%-8s %6s %6s %6s  %-7s %9s %9s %9s %9s %9s %8s %8s %7s\n", "op", "M", "N", "K", "check", "fused_ms",
           "TFLOP/s", "comp_ms", "seq_ms", "pipe_ms", "vs_seq", "vs_pipe", "overlap");
  }
  // Default sweep: Llama-70B-like TP shapes shrunk to run in seconds.
  struct Shape { int64_t M, N, K; };
  std::vector<Row> rows;
  int rc = 0;
  for (FusedKind kind : kinds) {
    std::vector<Shape> shapes;
    if (m > 0) shapes = {{m, n > 0 ? n : 4096, k > 0 ? k : 4096}};
    else if (kind == FusedKind::kAgGemm) shapes = {{4096, 3584, 8192}, {8192, 3584, 8192}};
    else if (kind == FusedKind::kGemmRs) shapes = {{4096, 8192, 3584}, {8192, 8192, 3584}};
    else shapes = {{4096, 4096, std::max<int64_t>(8, 4096 / W / 8 * 8)}, {8192, 8192, std::max<int64_t>(8, 8192 / W / 8 * 8)}};  // N = M, K = M / W
    for (const Shape& sh : shapes) {
      Row r;
      Status bs_ = bench_one(comm.get(), kind, sh.M, sh.N, sh.K, reps, comparable, &r);
      if (!bs_.ok()) {
        if (me == 0) fprintf(stderr, "bench %s M %lld: %s\n", ops::fused_kind_name(kind), (long long)sh.M, bs_.to_string().c_str());
        rc = 1;
        continue;
      }
      if (!r.correct) rc = 1;
      rows.push_back(r);
      if (me == 0) {
        const double tf = r.flops / (r.fused * 1e-3) / 1e12;
        const double eff = r.coll > 0 ? (r.compute + r.coll - r.fused) / std::min(r.compute, r.coll) : 0;
        printf("%-8s %6lld %6lld %6lld  %-7s %9.3f %9.1f %9.3f %9.3f %9.3f %8.2f %8.2f %7.2f%s\n", r.op.c_str(),
               (long long)r.M, (long long)r.N, (long long)r.K, r.correct ? "ok" : "WRONG", r.fused, tf, r.compute,
               r.seq, r.pipe, r.seq > 0 ? r.seq / r.fused : 0, r.pipe > 0 ? r.pipe / r.fused : 0, eff,
               comparable ? "" : "  (not comparable)");
        fflush(stdout);
      }
    }
  }
  if (me == 0 && !json.empty()) {
    FILE* f = fopen(json.c_str(), "w");
    if (f) {
      fprintf(f, "{\"world\": %d, \"nodes\": %d, \"comparable\": %s, \"results\": [\n", W,
              comm->topology().num_nodes, comparable ? "true" : "false");
      for (size_t i = 0; i < rows.size(); ++i) fprintf(f, "  %s%s\n", row_json(rows[i]).c_str(), i + 1 < rows.size() ? "," : "");
      fprintf(f, "]}\n");
      fclose(f);
    } else {
      fprintf(stderr, "bench: cannot write %s\n", json.c_str());
      rc = 1;
    }
  }
  Status d = comm->destroy();
  if (!d.ok()) {
    fprintf(stderr, "bench: %s\n", d.to_string().c_str());
    rc = 1;
  }
  return rc;
}

}  // namespace cli
}  // namespace mk
