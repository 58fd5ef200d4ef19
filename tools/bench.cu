// `mkernel bench <op>`: the fused GEMM collectives against cuBLAS + NCCL on the local GPUs.
//
//   mkernel bench ag_gemm|gemm_rs|gemm_ar|all [--m M --n N --k K] [--reps R] [--warmup U] [--json FILE]
//   mkernel bench ring_attention [--seq S_per_rank]... [--non-causal] [--reps R] [--warmup U] [--json FILE]
//                                [--trace PREFIX]
//
// Under mpirun one rank per process (else one rank). Per operator and shape: a correctness
// check of the fused result against the unfused GEMM on the same GPU (small integers, exact),
// then timings — median of --reps calls after --warmup calls, CUDA events around each call on
// the stream — of the fused kernel, its compute alone (T_c: the same GEMM without
// communication), and, when every rank has its own GPU, cuBLAS then NCCL, cuBLAS + NCCL
// pipelined in 4 row chunks, and the NCCL collective alone (T_x). When ranks share a GPU
// (processes under MPS) NCCL cannot run and fused times are not comparable with multi-GPU
// runs: they are marked so. At W = 1 nothing is communicated: no overlap efficiency, no
// pipelined baseline, no collective alone ("-" in the table, null in JSON).
//
// Failures. Arguments are checked before any collective or GPU work (every rank gets the same
// argv, so every rank fails the same way). Every fused or ring call is followed by a stream
// sync and comm->check(): a device wait that gave up does not fail the launch, the kernel
// finishes, and only the communicator's decoded record ("rank 0 (op ag_gemm, role comm, ...)
// timed out ... on flag 5 from rank 1 ...") says so; a result is read only after that check.
// Every step a rank runs on its own ends in agree(): every rank learns the first failing
// rank's error at the same point and leaves by the same path (operator and communicator
// teardown are collective), so no rank waits in a collective for one that left.
#include <cuda_bf16.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
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
#include "bench/baseline/baseline.h"
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

// Device memory of the CLI's own; the allocation's outcome is checked by the caller.
struct Buf {
  void* p = nullptr;
  Buf() = default;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() {
    if (p) cudaFree(p);
  }
  cudaError_t alloc(size_t bytes) { return cudaMalloc(&p, std::max<size_t>(bytes, 16)); }
  __nv_bfloat16* bf() const { return static_cast<__nv_bfloat16*>(p); }
};

// ---- failures: decoded, then agreed ----

// `s` as the CLI reports it: when the communicator has failed (a device wait gave up, or an
// abort), its decoded record names the culprit and comes first, `s` follows as what the CLI
// saw (e.g. a sticky CUDA error after the kernel). Ok only if both are.
Status decoded(Communicator* comm, const Status& s) {
  const Status c = comm->check();
  if (c.ok()) return s;
  if (s.ok()) return c;
  if (s.message().find(c.message()) != std::string::npos) return s;  // s already carries the record
  return Status(c.code(), c.message() + " (then: " + s.to_string() + ")");
}

// A CUDA call of the CLI's own, decoded.
Status cuda_step(Communicator* comm, cudaError_t e, const char* expr) {
  if (e == cudaSuccess) return OkStatus();
  cudaGetLastError();  // clear a non-sticky error so later calls report their own
  return decoded(comm, Status(e == cudaErrorMemoryAllocation ? Code::kOutOfMemory : Code::kCudaError,
                              std::string(expr) + ": " + cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")"));
}
#define CLI_CUDA(comm, expr) cuda_step((comm), (expr), #expr)

// Synchronizes `st` (comm->sync: the decoded record when a wait gave up) and checks the
// communicator's health: the kernel finishing is not enough, a wait that gave up lets it finish.
Status synced(Communicator* comm, cudaStream_t st) { return decoded(comm, comm->sync(st)); }

// Every rank passes the outcome of a step it ran on its own and gets the same result: ok, or
// the first failing rank's error (agree() carries ~250 characters of it, so a failing rank
// prints its own whole message too, rank 0 unless the summary holds it whole).
Status agreed(Communicator* comm, const Status& mine, const std::string& what) {
  if (!mine.ok() && (comm->rank() != 0 || mine.message().size() > 200)) {
    fprintf(stderr, "rank %d: %s: %s\n", comm->rank(), what.c_str(), mine.to_string().c_str());
    fflush(stderr);
  }
  return agree(comm->bootstrap(), mine, what);
}

// ---- timing ----

struct Timing {
  double median_ms = 0, min_ms = 0;
};

struct Events {
  std::vector<cudaEvent_t> ev;
  ~Events() {
    for (cudaEvent_t e : ev)
      if (e) cudaEventDestroy(e);
  }
};

struct RunCfg {
  int reps = 20, warmup = 3;
};

// Median over ranks' slowest of rc.reps calls of f (after rc.warmup calls). Collective: a failed
// call on any rank (its enqueue, or comm->check() after it) fails it on every rank.
template <class F>
Status time_it(Communicator* comm, cudaStream_t st, const RunCfg& rc, const std::string& what, F&& f, Timing* out) {
  const int reps = rc.reps;
  Events ev;
  ev.ev.assign(size_t(2) * reps, nullptr);
  Status s;
  for (cudaEvent_t& e : ev.ev)
    if (s.ok()) s = CLI_CUDA(comm, cudaEventCreate(&e));
  for (int i = 0; i < rc.warmup && s.ok(); ++i) s = decoded(comm, f());
  if (s.ok()) s = synced(comm, st);
  for (int i = 0; i < reps; ++i) {
    // Ranks start each call together, as in a training step; a rank whose call failed stops
    // every rank here.
    MK_CHECK(agreed(comm, s, what));
    s = CLI_CUDA(comm, cudaEventRecord(ev.ev[2 * i], st));
    if (s.ok()) s = decoded(comm, f());
    if (s.ok()) s = CLI_CUDA(comm, cudaEventRecord(ev.ev[2 * i + 1], st));
  }
  if (s.ok()) s = synced(comm, st);
  std::vector<double> ms(reps);
  for (int i = 0; i < reps && s.ok(); ++i) {
    float t = 0;
    s = CLI_CUDA(comm, cudaEventElapsedTime(&t, ev.ev[2 * i], ev.ev[2 * i + 1]));
    ms[i] = t;
  }
  MK_CHECK(agreed(comm, s, what));
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

// Counts the elements where `got` differs from `want` (or is far from it) with `launch`, after
// the call that wrote `got` was synchronized and checked; every rank gets the world's total.
template <class Launch>
Status count_world(Communicator* comm, cudaStream_t st, Status s, unsigned long long* d_bad, Launch&& launch,
                   const std::string& what, unsigned long long* total) {
  unsigned long long mine = 0;
  if (s.ok()) s = CLI_CUDA(comm, cudaMemsetAsync(d_bad, 0, sizeof(*d_bad), st));
  if (s.ok()) {
    launch();
    s = CLI_CUDA(comm, cudaGetLastError());
  }
  if (s.ok()) s = synced(comm, st);
  if (s.ok()) s = CLI_CUDA(comm, cudaMemcpy(&mine, d_bad, sizeof(mine), cudaMemcpyDeviceToHost));
  MK_CHECK(agreed(comm, s, what));
  std::vector<unsigned long long> bads(comm->world());
  MK_CHECK(comm->bootstrap().allgather(&mine, bads.data(), sizeof(mine)));
  *total = 0;
  for (auto b : bads) *total += b;
  return OkStatus();
}

// ---- table and JSON cells: "-" / null where a figure was not measured or means nothing ----

std::string cell(double v, int prec) {
  if (!(v > 0) || !std::isfinite(v)) return "-";
  char b[32];
  snprintf(b, sizeof b, "%.*f", prec, v);
  return b;
}
std::string jnum(double v, int prec) {
  if (!(v > 0) || !std::isfinite(v)) return "null";
  char b[32];
  snprintf(b, sizeof b, "%.*f", prec, v);
  return b;
}
// Overlap efficiency (T_c + T_x - T_fused) / min(T_c, T_x): only where something is
// communicated (W > 1) and both parts were measured; else NaN ("-", null).
double overlap_eff(int W, double compute, double coll, double fused) {
  if (W <= 1 || !(compute > 0) || !(coll > 0) || !(fused > 0)) return NAN;
  return (compute + coll - fused) / std::min(compute, coll);
}
std::string eff_cell(double e) {
  if (!std::isfinite(e)) return "-";
  char b[32];
  snprintf(b, sizeof b, "%.2f", e);
  return b;
}
std::string eff_json(double e) {
  if (!std::isfinite(e)) return "null";
  char b[32];
  snprintf(b, sizeof b, "%.3f", e);
  return b;
}
double ratio(double base, double fused) { return base > 0 && fused > 0 ? base / fused : 0.0; }

// One "check:" line per operator and shape (rank 0 prints them after the table).
struct CheckLine {
  std::string label;
  bool done = false, ok = false;
  unsigned long long bad = 0;
  std::string error;
};

std::string check_line(const CheckLine& c, const char* how) {
  if (!c.error.empty() && !c.done) return "check: " + c.label + ": FAILED (" + c.error + ")";
  if (!c.ok) return "check: " + c.label + ": WRONG (" + std::to_string(c.bad) + " mismatches " + how + ")";
  std::string s = "check: " + c.label + ": ok (" + how + ")";
  if (!c.error.empty()) s += "; timing FAILED (" + c.error + ")";
  return s;
}

// ---- fused GEMM collectives ----

struct Row {
  std::string op;
  int64_t M, N, K;
  int W;
  bool checked = false, correct = false;
  unsigned long long bad = 0;
  bool comparable = false;
  double fused = 0, compute = 0, seq = 0, pipe = 0, coll = 0;  // ms (0: not run)
  double flops = 0;
};

// The flops of the whole operator (all ranks' GEMMs) per call, per rank's share.
double flops_of(FusedKind, int64_t M, int64_t N, int64_t K) { return 2.0 * double(M) * double(N) * double(K); }

Status bench_one_body(Communicator* comm, ops::FusedGemm* op, FusedKind kind, int64_t M, int64_t N, int64_t K,
                      const RunCfg& rc, Row* row) {
  const int W = comm->world(), me = comm->rank();
  cudaStream_t st = comm->stream();
  const int64_t a_rows = kind == FusedKind::kAgGemm ? M / W : M;
  const int64_t c_rows = kind == FusedKind::kGemmRs ? M / W : M;
  Buf A, B, C, Aref, Bref, Cref, bad;
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
    return CLI_CUDA(comm, cudaGetLastError());
  };
  gemm::Arguments ref;
  Status s = [&]() -> Status {
    MK_CHECK(CLI_CUDA(comm, A.alloc(size_t(a_rows) * K * 2)));
    MK_CHECK(CLI_CUDA(comm, B.alloc(size_t(N) * K * 2)));
    MK_CHECK(CLI_CUDA(comm, C.alloc(size_t(c_rows) * N * 2)));
    MK_CHECK(CLI_CUDA(comm, Aref.alloc(kind == FusedKind::kAgGemm ? size_t(M) * K * 2 : size_t(M) * K * W * 2)));
    MK_CHECK(CLI_CUDA(comm, Bref.alloc(kind == FusedKind::kAgGemm ? 16 : size_t(N) * K * W * 2)));
    MK_CHECK(CLI_CUDA(comm, Cref.alloc(size_t(M) * N * 2)));
    MK_CHECK(CLI_CUDA(comm, bad.alloc(sizeof(unsigned long long))));
    MK_CHECK(fill_inputs(true));
    ref.A = Aref.p;
    ref.B = kind == FusedKind::kAgGemm ? B.p : Bref.p;
    ref.C = Cref.p;
    ref.M = M, ref.N = N, ref.K = kind == FusedKind::kAgGemm ? K : K * W;
    MK_CHECK(gemm::run(ref, st));
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(C.p, 0xff, size_t(c_rows) * N * 2, st)));  // poison
    return synced(comm, st);
  }();
  MK_CHECK(agreed(comm, s, "preparing inputs and the reference"));

  // The checked call: run (collective), synchronize, comm->check(); only then read C.
  ops::FusedArgs fa;
  fa.A = A.p, fa.B = B.p, fa.C = C.p;
  s = decoded(comm, op->run(fa, st));
  if (s.ok()) s = synced(comm, st);
  const int64_t row0 = kind == FusedKind::kGemmRs ? me * (M / W) : 0;
  unsigned long long* d_bad = static_cast<unsigned long long*>(bad.p);
  MK_CHECK(count_world(
      comm, st, s, d_bad,
      [&] {
        count_diff<<<264, 256, 0, st>>>(static_cast<uint16_t*>(C.p), static_cast<uint16_t*>(Cref.p) + row0 * N,
                                        c_rows * N, d_bad);
      },
      "the checked call", &row->bad));
  row->checked = true;
  row->correct = row->bad == 0;
  if (!row->correct) return OkStatus();  // no timings of a wrong operator

  // Timing on approximately normal data (the GEMM's speed depends on the data).
  s = fill_inputs(false);
  if (s.ok()) s = synced(comm, st);
  MK_CHECK(agreed(comm, s, "refilling inputs"));
  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing the fused call", [&] { return op->enqueue(fa, st); }, &t));
  row->fused = t.median_ms;
  gemm::Arguments g;  // T_c: the same GEMM without communication
  g.A = kind == FusedKind::kAgGemm ? op->gathered_a() : A.p;
  g.B = B.p;
  g.C = Cref.p;
  g.M = M, g.N = N, g.K = K;
  MK_CHECK(time_it(comm, st, rc, "timing the GEMM alone", [&] { return gemm::run(g, st); }, &t));
  row->compute = t.median_ms;
#if MK_HAVE_NCCL
  if (row->comparable) {
    using ops::baseline::Baselines;
    std::unique_ptr<Baselines> bl;
    MK_CHECK(agreed(comm, Baselines::create(comm->bootstrap(), comm->device(), &bl), "creating the NCCL baselines"));
    const int chunks = 4;
    Buf full, ws;  // AG: the gathered A and a workspace; RS: a workspace; AR: the full product
    size_t full_bytes = 0, ws_bytes = 0;
    std::function<Status(int)> base;  // cuBLAS + NCCL in `n` row chunks (1: the GEMM, then the collective)
    std::function<Status()> coll;     // the NCCL collective alone (T_x)
    bool can_chunk = (M / W) % chunks == 0;
    if (kind == FusedKind::kAgGemm) {
      full_bytes = size_t(M) * K * 2, ws_bytes = Baselines::ag_workspace_bytes(M, K, W, chunks);
      base = [&](int n) { return bl->ag_gemm(A.p, B.p, C.p, full.p, ws.p, M, N, K, n, st); };
      coll = [&] { return bl->collective(Baselines::Coll::kAllGather, A.p, full.p, size_t(M) * K, st); };
    } else if (kind == FusedKind::kGemmRs) {
      ws_bytes = Baselines::rs_workspace_bytes(M, N, W, chunks);
      base = [&](int n) { return bl->gemm_rs(A.p, B.p, C.p, ws.p, M, N, K, n, st); };
      coll = [&] { return bl->collective(Baselines::Coll::kReduceScatter, ws.p, C.p, size_t(M / W) * N, st); };
    } else {
      full_bytes = size_t(M) * N * 2;
      can_chunk = M % chunks == 0;
      base = [&](int n) { return bl->gemm_ar(A.p, B.p, full.p, M, N, K, n, st); };
      coll = [&] { return bl->collective(Baselines::Coll::kAllReduce, full.p, full.p, size_t(M) * N, st); };
    }
    s = CLI_CUDA(comm, full.alloc(full_bytes));
    if (s.ok()) s = CLI_CUDA(comm, ws.alloc(ws_bytes));
    MK_CHECK(agreed(comm, s, "allocating baseline buffers"));
    MK_CHECK(time_it(comm, st, rc, "timing cuBLAS + NCCL", [&] { return base(1); }, &t));
    row->seq = t.median_ms;
    // At W = 1 nothing is communicated: nothing to pipeline, no collective to time alone (and
    // so no overlap efficiency); cuBLAS + the one-rank NCCL call above is the only baseline.
    if (W > 1 && can_chunk) {
      MK_CHECK(time_it(comm, st, rc, "timing pipelined cuBLAS + NCCL", [&] { return base(chunks); }, &t));
      row->pipe = t.median_ms;
    }
    if (W > 1) {
      MK_CHECK(time_it(comm, st, rc, "timing the NCCL collective", [&] { return coll(); }, &t));
      row->coll = t.median_ms;
    }
  }
#endif
  return OkStatus();
}

Status bench_one(Communicator* comm, FusedKind kind, int64_t M, int64_t N, int64_t K, const RunCfg& rc,
                 bool comparable, Row* row) {
  row->op = ops::fused_kind_name(kind);
  row->M = M, row->N = N, row->K = K, row->W = comm->world();
  row->comparable = comparable;
  row->flops = flops_of(kind, M, N, K);
  std::unique_ptr<ops::FusedGemm> op;
  // Collective: bad shapes (N not a multiple of 8, M not divisible by W, ...) are the same
  // error on every rank.
  MK_CHECK(ops::FusedGemm::create(comm, kind, {M, N, K}, ops::FusedOptions{}, &op));
  const Status s = bench_one_body(comm, op.get(), kind, M, N, K, rc, row);
  // Every rank gets here on the same path (the body's failures are agreed): destroy is collective.
  const Status d = op->destroy();
  return s.ok() ? d : s;
}

std::string row_json(const Row& r) {
  char b[1024];
  auto tf = [&](double ms) { return ms > 0 ? r.flops / (ms * 1e-3) / 1e12 : 0.0; };
  snprintf(b, sizeof b,
           "{\"op\": \"%s\", \"M\": %lld, \"N\": %lld, \"K\": %lld, \"world\": %d, \"correct\": %s, "
           "\"mismatches\": %llu, \"comparable\": %s, \"fused_ms\": %s, \"compute_only_ms\": %s, "
           "\"cublas_nccl_ms\": %s, \"cublas_nccl_pipelined_ms\": %s, \"nccl_only_ms\": %s, "
           "\"fused_tflops_per_rank\": %s, \"speedup_vs_sequential\": %s, \"speedup_vs_pipelined\": %s, "
           "\"overlap_efficiency\": %s}",
           r.op.c_str(), (long long)r.M, (long long)r.N, (long long)r.K, r.W, r.correct ? "true" : "false", r.bad,
           r.comparable ? "true" : "false", jnum(r.fused, 4).c_str(), jnum(r.compute, 4).c_str(),
           jnum(r.seq, 4).c_str(), jnum(r.pipe, 4).c_str(), jnum(r.coll, 4).c_str(), jnum(tf(r.fused), 1).c_str(),
           jnum(ratio(r.seq, r.fused), 3).c_str(), jnum(ratio(r.pipe, r.fused), 3).c_str(),
           eff_json(overlap_eff(r.W, r.compute, r.coll, r.fused)).c_str());
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
  bool causal = true, zigzag = true, checked = false, correct = false, comparable = false;
  unsigned long long bad = 0;
  double fused = 0, compute = 0, allgather = 0, sendrecv = 0, coll = 0, flops = 0;
};

Status bench_ring_body(Communicator* comm, ops::RingAttention* op, RingRow* r, const RunCfg& rc,
                       const std::string& trace) {
  const int W = comm->world(), me = comm->rank();
  cudaStream_t st = comm->stream();
  const size_t qe = size_t(r->B) * r->S_l * r->H * r->D, ke = op->block_elems();
  Buf q, o, o_ref, k_all, v_all, kb0, kb1, vb0, vb1, bad;
  Status s = [&]() -> Status {
    for (Buf* b : {&q, &o, &o_ref}) MK_CHECK(CLI_CUDA(comm, b->alloc(qe * 2)));
    for (Buf* b : {&k_all, &v_all}) MK_CHECK(CLI_CUDA(comm, b->alloc(ke * W * 2)));
    for (Buf* b : {&kb0, &kb1, &vb0, &vb1}) MK_CHECK(CLI_CUDA(comm, b->alloc(ke * 2)));
    MK_CHECK(CLI_CUDA(comm, bad.alloc(sizeof(unsigned long long))));
    fill_block<<<264, 256, 0, st>>>(q.bf(), int64_t(qe), 0x9000 + me);
    for (int b = 0; b < W; ++b) {
      fill_block<<<264, 256, 0, st>>>(k_all.bf() + size_t(b) * ke, int64_t(ke), 0x1000 + b);
      fill_block<<<264, 256, 0, st>>>(v_all.bf() + size_t(b) * ke, int64_t(ke), 0x2000 + b);
    }
    MK_CHECK(CLI_CUDA(comm, cudaGetLastError()));
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(o.p, 0xff, qe * 2, st)));  // poison
    return synced(comm, st);
  }();
  MK_CHECK(agreed(comm, s, "preparing inputs"));
  ops::RingAttentionArgs a{q.p, k_all.bf() + size_t(me) * ke, v_all.bf() + size_t(me) * ke, o.p, nullptr};

  // Correctness: the fused ring (run, synchronize, comm->check()) against the same kernel over
  // the blocks gathered here; O is read only after the check.
  s = decoded(comm, op->run(a, st));
  if (s.ok()) s = synced(comm, st);
  ops::RingAttentionArgs ar = a;
  ar.o = o_ref.p;
  if (s.ok()) s = decoded(comm, op->enqueue_compute(ar, -1, k_all.p, v_all.p, st));
  if (s.ok()) s = synced(comm, st);
  unsigned long long* d_bad = static_cast<unsigned long long*>(bad.p);
  MK_CHECK(count_world(
      comm, st, s, d_bad, [&] { count_far<<<264, 256, 0, st>>>(o.bf(), o_ref.bf(), int64_t(qe), d_bad); },
      "the checked call", &r->bad));
  r->checked = true;
  r->correct = r->bad == 0;
  if (!r->correct) return OkStatus();

  // Per rank: its queries against the whole sequence (causal: the visible half on average).
  r->flops = attention::forward_flops(r->B, r->H, int(r->S_l), int(r->S_l * W), r->D, r->causal);
  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing the fused call", [&] { return op->enqueue(a, st); }, &t));
  r->fused = t.median_ms;
  MK_CHECK(time_it(comm, st, rc, "timing the attention alone",
                   [&] { return op->enqueue_compute(a, -1, k_all.p, v_all.p, st); }, &t));
  r->compute = t.median_ms;
  if (!trace.empty()) {
    // One traced fused call: the per-CTA timeline of this rank (tools/trace_png.py draws it).
    TraceRecorder rec;
    std::vector<TraceEvent> ev;
    uint64_t dropped = 0;
    const std::string path = trace + ".s" + std::to_string(r->S_l) + ".w" + std::to_string(W) + ".rank" +
                             std::to_string(me) + ".json";
    MK_CHECK(agreed(comm, TraceRecorder::create(uint32_t(64 * (op->work_items() + op->comm_ops()) + 4096), &rec),
                    "creating the trace recorder"));
    ops::RingAttentionArgs at = a;
    at.trace = rec.device();
    MK_CHECK(comm->bootstrap().barrier());
    s = decoded(comm, op->enqueue(at, st));
    if (s.ok()) s = synced(comm, st);
    if (s.ok()) s = rec.fetch(&ev, &dropped);
    if (s.ok()) s = write_chrome_trace(ev, path);
    MK_CHECK(agreed(comm, s, "the traced call"));
    if (me == 0)
      printf("trace: %zu events (%llu dropped) -> %s\n", ev.size(), (unsigned long long)dropped, path.c_str());
  }
#if MK_HAVE_NCCL
  if (r->comparable) {
    std::unique_ptr<ops::baseline::Baselines> bl;
    MK_CHECK(agreed(comm, ops::baseline::Baselines::create(comm->bootstrap(), comm->device(), &bl),
                    "creating the NCCL baselines"));
    MK_CHECK(time_it(comm, st, rc, "timing NCCL all-gather + attention",
                     [&] { return bl->ring_attn_allgather(*op, a, k_all.p, v_all.p, st); }, &t));
    r->allgather = t.median_ms;
    void* kb[2] = {kb0.p, kb1.p};
    void* vb[2] = {vb0.p, vb1.p};
    MK_CHECK(time_it(comm, st, rc, "timing the NCCL send/recv ring",
                     [&] { return bl->ring_attn_sendrecv(*op, a, kb, vb, st); }, &t));
    r->sendrecv = t.median_ms;
    if (W > 1) {  // at W = 1 there is no K/V to move: no T_x, no overlap efficiency
      MK_CHECK(time_it(comm, st, rc, "timing the NCCL K/V all-gather", [&] {
        MK_CHECK(bl->collective(ops::baseline::Baselines::Coll::kAllGather, a.k, k_all.p, ke * W, st));
        return bl->collective(ops::baseline::Baselines::Coll::kAllGather, a.v, v_all.p, ke * W, st); }, &t));
      r->coll = t.median_ms;
    }
  }
#endif
  return OkStatus();
}

Status bench_ring_one(Communicator* comm, RingRow* r, const RunCfg& rc, const std::string& trace) {
  const int W = comm->world();
  ops::RingAttentionShape sh{r->B, r->H, r->Hkv, r->D, r->S_l * W,
                             r->zigzag ? ops::SeqLayout::kZigzag : ops::SeqLayout::kContiguous, r->causal};
  std::unique_ptr<ops::RingAttention> op;
  MK_CHECK(ops::RingAttention::create(comm, sh, {}, &op));  // collective: a bad shape fails every rank
  const Status s = bench_ring_body(comm, op.get(), r, rc, trace);
  const Status d = op->destroy();
  return s.ok() ? d : s;
}

std::string ring_json(const RingRow& r) {
  char b[1024];
  snprintf(b, sizeof b,
           "{\"op\": \"ring_attention\", \"B\": %d, \"H\": %d, \"Hkv\": %d, \"D\": %d, \"seq_per_rank\": %lld, "
           "\"world\": %d, \"causal\": %s, \"layout\": \"%s\", \"correct\": %s, \"mismatches\": %llu, "
           "\"comparable\": %s, \"fused_ms\": %s, \"compute_only_ms\": %s, \"allgather_then_attention_ms\": %s, "
           "\"sendrecv_ring_ms\": %s, \"nccl_allgather_kv_ms\": %s, \"fused_tflops_per_rank\": %s, "
           "\"speedup_vs_allgather\": %s, \"speedup_vs_sendrecv\": %s, \"overlap_efficiency\": %s}",
           r.B, r.H, r.Hkv, r.D, (long long)r.S_l, r.W, r.causal ? "true" : "false", r.zigzag ? "zigzag" : "contiguous",
           r.correct ? "true" : "false", r.bad, r.comparable ? "true" : "false", jnum(r.fused, 4).c_str(),
           jnum(r.compute, 4).c_str(), jnum(r.allgather, 4).c_str(), jnum(r.sendrecv, 4).c_str(),
           jnum(r.coll, 4).c_str(), jnum(r.fused > 0 ? r.flops / (r.fused * 1e-3) / 1e12 : 0, 1).c_str(),
           jnum(ratio(r.allgather, r.fused), 3).c_str(), jnum(ratio(r.sendrecv, r.fused), 3).c_str(),
           eff_json(overlap_eff(r.W, r.compute, r.coll, r.fused)).c_str());
  return b;
}

bool write_json(const std::string& path, int W, int nodes, bool comparable, const std::vector<std::string>& rows) {
  FILE* f = fopen(path.c_str(), "w");
  if (!f) {
    fprintf(stderr, "bench: cannot write %s: %s\n", path.c_str(), strerror(errno));
    return false;
  }
  fprintf(f, "{\"world\": %d, \"nodes\": %d, \"comparable\": %s, \"results\": [\n", W, nodes,
          comparable ? "true" : "false");
  for (size_t i = 0; i < rows.size(); ++i) fprintf(f, "  %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
  fprintf(f, "]}\n");
  return fclose(f) == 0;
}

// After an operator failed: is the communicator still usable on every rank? (A device wait
// that gave up fails it for good: the remaining operators are skipped.)
bool communicator_failed(Communicator* comm) {
  const Status h = agree(comm->bootstrap(), comm->check(), "communicator health");
  if (h.ok()) return false;
  if (comm->rank() == 0)
    fprintf(stderr, "bench: the communicator failed (%s): the remaining runs are skipped\n", h.to_string().c_str());
  return true;
}

// Prints the check lines and the verdict (rank 0); returns the exit code.
int summarize(Communicator* comm, const std::vector<CheckLine>& checks, const char* how, bool other_failure) {
  int ok = 0;
  for (const CheckLine& c : checks) ok += c.done && c.ok && c.error.empty();
  const bool pass = !other_failure && ok == int(checks.size()) && !checks.empty();
  if (comm->rank() == 0) {
    for (const CheckLine& c : checks) printf("%s\n", check_line(c, how).c_str());
    printf("bench: %s: %d of %zu checked run(s) ok\n", pass ? "passed" : "FAILED", ok, checks.size());
    fflush(stdout);
  }
  return pass ? 0 : 1;
}

int bench_ring(Communicator* comm, const std::vector<int64_t>& seqs, const RunCfg& rc, bool comparable, bool causal,
               const std::string& json, const std::string& trace) {
  const int W = comm->world(), me = comm->rank();
  if (me == 0) {
    printf("ring_attention: B1 H32 D128 bf16, %s, zigzag, %d rank(s), %d node(s); %s%s\n",
           causal ? "causal" : "non-causal", W, comm->topology().num_nodes,
           comparable ? "one GPU per rank: vs NCCL all-gather + attention and a per-step NCCL send/recv ring"
                      : "ranks share a GPU (or no NCCL): correctness and fused times only, NOT comparable",
           W == 1 ? "; W = 1: nothing to overlap" : "");
    printf("%8s %3s  %-6s %9s %8s %9s %9s %9s %9s %7s %7s %7s\n", "S/rank", "W", "check", "fused_ms", "TFLOP/s",
           "comp_ms", "ag_ms", "ring_ms", "nccl_ms", "vs_ag", "vs_ring", "overlap");
  }
  std::vector<std::string> rows;
  std::vector<CheckLine> checks;
  bool failed = false;
  for (int64_t S_l : seqs) {
    RingRow r;
    r.S_l = S_l, r.W = W, r.causal = causal, r.comparable = comparable;
    CheckLine c;
    c.label = "ring_attention S/rank " + std::to_string(S_l) + " W " + std::to_string(W);
    Status s = bench_ring_one(comm, &r, rc, trace);
    c.done = r.checked, c.ok = r.correct, c.bad = r.bad;
    if (!s.ok()) {
      c.error = s.to_string();
      if (me == 0) fprintf(stderr, "bench ring_attention S/rank %lld: %s\n", (long long)S_l, c.error.c_str());
    }
    checks.push_back(c);
    if (s.ok() && r.correct) {
      rows.push_back(ring_json(r));
      if (me == 0) {
        printf("%8lld %3d  %-6s %9s %8s %9s %9s %9s %9s %7s %7s %7s%s\n", (long long)S_l, W, "ok",
               cell(r.fused, 3).c_str(), cell(r.fused > 0 ? r.flops / (r.fused * 1e-3) / 1e12 : 0, 1).c_str(),
               cell(r.compute, 3).c_str(), cell(r.allgather, 3).c_str(), cell(r.sendrecv, 3).c_str(),
               cell(r.coll, 3).c_str(), cell(ratio(r.allgather, r.fused), 2).c_str(),
               cell(ratio(r.sendrecv, r.fused), 2).c_str(),
               eff_cell(overlap_eff(W, r.compute, r.coll, r.fused)).c_str(),
               comparable ? "" : "  (not comparable)");
        fflush(stdout);
      }
    } else if (me == 0 && r.checked && !r.correct) {
      printf("%8lld %3d  %-6s (%llu mismatches)\n", (long long)S_l, W, "WRONG", r.bad);
    }
    if (!s.ok() && communicator_failed(comm)) break;
  }
  if (me == 0 && !json.empty() && !write_json(json, W, comm->topology().num_nodes, comparable, rows)) failed = true;
  return summarize(comm, checks, "within bf16 tolerance of the same kernel over the gathered K/V", failed);
}

// ---- arguments ----

struct BenchArgs {
  std::string which, json, trace;
  int64_t m = 0, n = 0, k = 0;
  RunCfg rc;
  std::vector<int64_t> seqs;
  bool causal = true;
  std::vector<std::string> fused_only, ring_only;  // options given that apply to one family
};

// Dimensions fit the GEMM's 32-bit extents; counts stay small enough to finish.
constexpr int64_t kMaxDim = 2147483647;
constexpr int kMaxReps = 100000;

bool parse_bench_args(const std::vector<std::string>& args, BenchArgs* b, std::string* err) {
  ArgReader ar(args);
  bool ok = true;
  while (ok && !ar.done()) {
    const std::string a = ar.next();
    if (a == "--m" || a == "--n" || a == "--k") {
      int64_t* d = a == "--m" ? &b->m : a == "--n" ? &b->n : &b->k;
      ok = ar.int_value(int64_t(1), kMaxDim, d);
      b->fused_only.push_back(a);
    } else if (a == "--reps") {
      ok = ar.int_value(1, kMaxReps, &b->rc.reps);
    } else if (a == "--warmup") {
      ok = ar.int_value(0, kMaxReps, &b->rc.warmup);
    } else if (a == "--json") {
      ok = ar.value(&b->json);
    } else if (a == "--seq") {
      int64_t s = 0;
      ok = ar.int_value(int64_t(1), kMaxDim, &s);
      b->seqs.push_back(s);
      b->ring_only.push_back(a);
    } else if (a == "--non-causal") {
      ok = ar.no_value();
      b->causal = false;
      b->ring_only.push_back(a);
    } else if (a == "--trace") {
      ok = ar.value(&b->trace);
      b->ring_only.push_back(a);
    } else if (a == "--dtype") {
      std::string d;
      ok = ar.value(&d) && (d == "bf16" || ar.fail("--dtype '" + d + "': only bf16 is implemented"));
    } else if (a.rfind("-", 0) == 0) {
      ok = ar.fail("unknown option '" + a + "'");
    } else if (b->which.empty()) {
      b->which = a;
    } else {
      ok = ar.fail("unexpected argument '" + a + "' (the operator is already '" + b->which + "')");
    }
  }
  if (!ok) {
    *err = ar.error();
    return false;
  }
  static const char* kOps[] = {"ag_gemm", "gemm_rs", "gemm_ar", "all", "ring_attention"};
  if (b->which.empty()) b->which = "all";
  if (std::find_if(std::begin(kOps), std::end(kOps), [&](const char* o) { return b->which == o; }) == std::end(kOps)) {
    *err = "unknown operator '" + b->which + "' (ag_gemm, gemm_rs, gemm_ar, all, ring_attention)";
    return false;
  }
  const bool ring = b->which == "ring_attention";
  if (ring && !b->fused_only.empty()) {
    *err = b->fused_only[0] + " does not apply to ring_attention (use --seq)";
    return false;
  }
  if (!ring && !b->ring_only.empty()) {
    *err = b->ring_only[0] + " applies to ring_attention only, not to '" + b->which + "'";
    return false;
  }
  return true;
}

struct Shape {
  int64_t M, N, K;
};

// The shapes of one operator: the one given (a dimension left out is 4096), else the default
// sweep, Llama-70B-like TP shapes shrunk to run in seconds.
std::vector<Shape> shapes_of(FusedKind kind, const BenchArgs& ba, int W) {
  if (ba.m > 0 || ba.n > 0 || ba.k > 0)
    return {Shape{ba.m > 0 ? ba.m : 4096, ba.n > 0 ? ba.n : 4096, ba.k > 0 ? ba.k : 4096}};
  if (kind == FusedKind::kAgGemm) return {Shape{4096, 3584, 8192}, Shape{8192, 3584, 8192}};
  if (kind == FusedKind::kGemmRs) return {Shape{4096, 8192, 3584}, Shape{8192, 8192, 3584}};
  // N = M, K = M / W
  return {Shape{4096, 4096, std::max<int64_t>(8, 4096 / W / 8 * 8)},
          Shape{8192, 8192, std::max<int64_t>(8, 8192 / W / 8 * 8)}};
}

}  // namespace

int bench(const std::vector<std::string>& args) {
  // Arguments first: before the bootstrap, the communicator or any GPU work.
  BenchArgs ba;
  std::string err;
  if (!parse_bench_args(args, &ba, &err)) {
    if (launch_rank() <= 0) fprintf(stderr, "mkernel bench: %s\n", err.c_str());
    return 2;
  }
  std::vector<FusedKind> kinds;
  if (ba.which == "ag_gemm") kinds = {FusedKind::kAgGemm};
  else if (ba.which == "gemm_rs") kinds = {FusedKind::kGemmRs};
  else if (ba.which == "gemm_ar") kinds = {FusedKind::kGemmAr};
  else if (ba.which == "all") kinds = {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr};

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
    // An error the ranks agreed on ("... failed on rank(s) ...") is printed once, by rank 0.
    const bool agreed_error = s.message().find("failed on rank(s)") != std::string::npos;
    if (launch_rank() <= 0 || !agreed_error) {
      fprintf(stderr, "mkernel bench: %s\n", s.to_string().c_str());
      if (s.code() == Code::kNotSupported)
        fprintf(stderr, "mkernel bench: needs a GPU per rank (or ranks sharing one under CUDA MPS); "
                        "`mkernel doctor` shows what this machine has\n");
    }
    return 1;
  }
  const int W = comm->world(), me = comm->rank();
  // NCCL needs one GPU per rank: compare only when no two ranks share one.
  std::set<std::string> gpus;
  for (const auto& info : comm->topology().info)
    gpus.insert(std::string(reinterpret_cast<const char*>(info.gpu_uuid), 16));
  bool comparable = int(gpus.size()) == W;
#if !MK_HAVE_NCCL
  comparable = false;
#endif
  int rc = 0;
  if (ba.which == "ring_attention") {
    if (ba.seqs.empty()) ba.seqs = {4096, 8192};
    rc = bench_ring(comm.get(), ba.seqs, ba.rc, comparable, ba.causal, ba.json, ba.trace);
  } else {
    if (me == 0) {
      printf("mkernel bench: %d rank(s), %d node(s); %s%s\n", W, comm->topology().num_nodes,
             comparable ? "one GPU per rank: fused vs cuBLAS + NCCL"
                        : "ranks share a GPU (or no NCCL): correctness and fused times only, NOT comparable "
                          "with multi-GPU runs; no NCCL baselines",
             W == 1 ? "; W = 1: nothing is communicated, no overlap figure" : "");
      printf("%-8s %6s %6s %6s  %-7s %9s %9s %9s %9s %9s %8s %8s %7s\n", "op", "M", "N", "K", "check", "fused_ms",
             "TFLOP/s", "comp_ms", "seq_ms", "pipe_ms", "vs_seq", "vs_pipe", "overlap");
    }
    std::vector<std::string> rows;
    std::vector<CheckLine> checks;
    bool stop = false;
    for (FusedKind kind : kinds) {
      if (stop) break;
      for (const Shape& sh : shapes_of(kind, ba, W)) {
        Row r;
        CheckLine c;
        c.label = std::string(ops::fused_kind_name(kind)) + " M " + std::to_string(sh.M) + " N " +
                  std::to_string(sh.N) + " K " + std::to_string(sh.K) + " W " + std::to_string(W);
        Status bs_ = bench_one(comm.get(), kind, sh.M, sh.N, sh.K, ba.rc, comparable, &r);
        c.done = r.checked, c.ok = r.correct, c.bad = r.bad;
        if (!bs_.ok()) {
          c.error = bs_.to_string();
          if (me == 0) fprintf(stderr, "bench %s: %s\n", c.label.c_str(), c.error.c_str());
        }
        checks.push_back(c);
        if (bs_.ok() && r.correct) {
          rows.push_back(row_json(r));
          if (me == 0) {
            const double tf = r.fused > 0 ? r.flops / (r.fused * 1e-3) / 1e12 : 0;
            printf("%-8s %6lld %6lld %6lld  %-7s %9s %9s %9s %9s %9s %8s %8s %7s%s\n", r.op.c_str(), (long long)r.M,
                   (long long)r.N, (long long)r.K, "ok", cell(r.fused, 3).c_str(), cell(tf, 1).c_str(),
                   cell(r.compute, 3).c_str(), cell(r.seq, 3).c_str(), cell(r.pipe, 3).c_str(),
                   cell(ratio(r.seq, r.fused), 2).c_str(), cell(ratio(r.pipe, r.fused), 2).c_str(),
                   eff_cell(overlap_eff(W, r.compute, r.coll, r.fused)).c_str(),
                   comparable ? "" : "  (not comparable)");
            fflush(stdout);
          }
        } else if (me == 0 && r.checked && !r.correct) {
          printf("%-8s %6lld %6lld %6lld  %-7s (%llu mismatches)\n", r.op.c_str(), (long long)r.M, (long long)r.N,
                 (long long)r.K, "WRONG", r.bad);
        }
        if (!bs_.ok() && communicator_failed(comm.get())) {
          stop = true;
          break;
        }
      }
    }
    bool failed = false;
    if (me == 0 && !ba.json.empty() && !write_json(ba.json, W, comm->topology().num_nodes, comparable, rows))
      failed = true;
    rc = summarize(comm.get(), checks, "bit-exact against the unfused GEMM", failed);
  }
  // Collective teardown: every rank gets here (failures above were agreed across ranks).
  Status d = comm->destroy();
  if (!d.ok()) {
    fprintf(stderr, "mkernel bench: rank %d: teardown: %s\n", me, d.to_string().c_str());
    rc = 1;
  }
  return rc;
}

}  // namespace cli
}  // namespace mk
