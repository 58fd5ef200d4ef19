// `mkernel bench ag_gemm|gemm_rs|gemm_ar|all`: the fused GEMM collectives against cuBLAS + NCCL.
//
// Per operator and shape: a correctness check of the fused result against the unfused GEMM on
// the same GPU (small integers, exact), then timings — median of --reps calls after --warmup
// calls, CUDA events around each call on the stream — of the fused kernel, its compute alone
// (T_c: the same GEMM without communication), and, when every rank has its own GPU, cuBLAS then
// NCCL, cuBLAS + NCCL pipelined in 4 row chunks, and the NCCL collective alone (T_x). When ranks
// share a GPU (processes under MPS) NCCL cannot run and fused times are not comparable with
// multi-GPU runs: they are marked so. At W = 1 nothing is communicated: no overlap efficiency,
// no pipelined baseline, no collective alone ("-" in the table, null in JSON).
//
// fused / compute (f/c): the fused call over the same GEMM without communication, both timed with
// every rank running: 1.0 means all communication was hidden. --sweep runs the Llama-3-70B TP8
// shapes; --trace PREFIX traces --trace-calls (10) consecutive fused calls per shape on every rank
// (a table per rank for tools/trace_report.py and Chrome JSON) and prints rank 0's breakdown:
// per-tile MMA and epilogue time, the communication ops, the waits, the tail after the last tile.
//
// Part of the CLI (mkernel_cli), not of the library; the shared helpers are tools/bench_common.h.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/tunables.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "mkernel/gemm/gemm.h"
#include "mkernel/mkernel.h"
#include "mkernel/ops/collective.h"
#include "mkernel/ops/fused.h"
#include "tools/bench_common.h"
#include "tools/bench/fused_inputs.cuh"
#if MK_HAVE_NCCL
#include "tools/baseline/baseline.h"
#endif

namespace mk {
namespace bench {
namespace {

using ops::FusedKind;

struct Row {
  std::string op;
  int64_t M, N, K;
  int W;
  bool checked = false, correct = false;
  unsigned long long bad = 0;
  bool comparable = false;
  bool deterministic = false;
  std::string route;  // MK_FUSED_ROUTE
  double fused = 0, compute = 0, seq = 0, pipe = 0, coll = 0;  // ms, medians (0: not run)
  double fused_min = 0, compute_min = 0;                       // ms, fastest call
  double flops = 0;
  // --splits: the fused call per static split (CTAs, median ms) and with the controller.
  std::vector<std::pair<int, double>> statics;
  double ctl = 0;
  int ctl_split = 0;
  int default_split = 0;
  // --path: the path the timed calls took and why (FusedGemm::path()), "fused" by default.
  std::string path = "fused";
  // --path auto (W > 1): in the same run, operators forced onto each path timed beside the auto
  // one, in two rounds (fused, unfused, auto; then auto, unfused, fused); each figure the mean
  // of its two medians (ms; 0: not run).
  double same_fused = 0, same_unfused = 0, same_auto = 0;
  // --path unfused or auto (W > 1): the unfused path's collective alone (a standalone operator of
  // the same kind and count, zero-copy, calls back to back; ms, median), beside the GEMM alone
  // (compute): the unfused call against the sum of its parts.
  double coll_alone = 0;
  // Uneven shards (--rows, or M % W != 0): each rank's rows (empty: the operator's own split) and
  // the same operator with every shard padded to the largest (M = W x largest, even), timed in
  // the same run (ms, median; 0: not run).
  std::vector<int64_t> rows;
  bool uneven = false;
  int64_t padded_M = 0;
  double padded = 0, uneven_same_run = 0;  // side by side (two rounds, ms)
};

// The unfused path's reference (RS/AR): every rank's product rounded to bf16 (as the GEMM writes
// it into the collective's workspace), summed in fp32 in the collective's order — by local index
// within each node, then the node partials in node order — and rounded once.
__global__ void accumulate_bf16(float* acc, const __nv_bfloat16* v, int64_t n, int first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc[i] = first ? __bfloat162float(v[i]) : __fadd_rn(acc[i], __bfloat162float(v[i]));
}
__global__ void accumulate_f32(float* acc, const float* v, int64_t n, int first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc[i] = first ? v[i] : __fadd_rn(acc[i], v[i]);
}
__global__ void round_bf16(const float* v, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(v[i]);
}

// Rank 0's traced calls, summarized per call: what a tile costs and where the kernel's time goes
// (tools/trace_report.py breaks down every rank's calls from the tables).
struct TraceSummary {
  int calls = 0;
  double span_us = 0;          // median over calls: the kernel's first CTA start to its last CTA end
  double tiles = 0, ops = 0;   // per call
  double mma_us = 0;           // mean per tile: compute event minus its epilogue
  double epi_us = 0;           // mean per tile: the epilogue (route or store, and its signals)
  double ops_us = 0;           // per call: the communication ops' times (waits included)
  double spin_us = 0;          // per call: the waits that had to spin, all CTAs and warps
  double tail_us = 0;          // median over calls: last compute end to the kernel's end
};

TraceSummary summarize_trace(const std::vector<TraceEvent>& ev, int calls) {
  TraceSummary t;
  std::vector<TraceEvent> ctas;
  for (const TraceEvent& e : ev)
    if ((e.role & 0xffu) == uint32_t(Role::kCta)) ctas.push_back(e);
  if (calls <= 0 || ctas.empty() || ctas.size() % size_t(calls)) return t;  // not one grid per call
  std::sort(ctas.begin(), ctas.end(), [](const TraceEvent& a, const TraceEvent& b) { return a.t0_ns < b.t0_ns; });
  const size_t grid = ctas.size() / size_t(calls);
  std::vector<double> spans, tails;
  double compute = 0, epi = 0, tiles = 0;
  for (int c = 0; c < calls; ++c) {
    uint64_t first = ~uint64_t(0), last = 0, last_compute = 0;
    for (size_t i = 0; i < grid; ++i) {
      first = std::min(first, ctas[c * grid + i].t0_ns);
      last = std::max(last, ctas[c * grid + i].t1_ns);
    }
    for (const TraceEvent& e : ev) {
      if (e.t0_ns < first || e.t1_ns > last) continue;
      const uint32_t r = e.role & 0xffu;
      const double d = double(e.t1_ns - e.t0_ns) * 1e-3;
      if (r == uint32_t(Role::kCompute)) {
        ++tiles;
        compute += d;
        last_compute = std::max(last_compute, e.t1_ns);
      } else if (r == uint32_t(Role::kEpilogue)) {
        epi += d;
      } else if (r == uint32_t(Role::kComm) || r == uint32_t(Role::kNetSend)) {
        ++t.ops;
        t.ops_us += d;
      } else if (r == uint32_t(Role::kSpin)) {
        t.spin_us += d;
      }
    }
    spans.push_back(double(last - first) * 1e-3);
    tails.push_back(last_compute ? double(last - last_compute) * 1e-3 : 0);
  }
  std::sort(spans.begin(), spans.end());
  std::sort(tails.begin(), tails.end());
  t.calls = calls;
  t.span_us = spans[spans.size() / 2];
  t.tail_us = tails[tails.size() / 2];
  if (tiles) {
    t.mma_us = (compute - epi) / tiles;
    t.epi_us = epi / tiles;
  }
  t.tiles = tiles / calls;
  t.ops /= calls;
  t.ops_us /= calls;
  t.spin_us /= calls;
  return t;
}

// The flops of the whole operator (all ranks' GEMMs) per call, per rank's share.
double flops_of(FusedKind, int64_t M, int64_t N, int64_t K) { return 2.0 * double(M) * double(N) * double(K); }

// --splits: the fused call at each static split (the operator's own, set_comm_ctas) and a second
// operator with the controller (fused_split=auto; the warm-up calls let it settle).
Status split_sweep(Communicator* comm, ops::FusedGemm* op, FusedKind kind, int64_t M, int64_t N, int64_t K,
                   bool deterministic, const RunCfg& rc, const ops::FusedArgs& fa, Row* row) {
  cudaStream_t st = comm->stream();
  int resident = 0;
  MK_CHECK(agreed(comm, gemm::persistent_ctas(&resident), "the persistent grid"));
  row->default_split = int(tunables::fused_comm_ctas());
  Timing t;
  for (int n : kStaticSplits) {
    if (n >= resident) break;
    MK_CHECK(agreed(comm, op->set_comm_ctas(n, st), "set_comm_ctas"));
    MK_CHECK(time_it(comm, st, rc, "timing a static split", [&] { return op->enqueue(fa, st); }, &t));
    row->statics.emplace_back(n, t.median_ms);
  }
  MK_CHECK(agreed(comm, tunables::set("fused_split", "auto"), "fused_split=auto"));
  std::unique_ptr<ops::FusedGemm> ctl;
  ops::FusedOptions fo;
  fo.deterministic = deterministic;
  Status s = ops::FusedGemm::create(comm, kind, ops::PlanShape(M, N, K, row->rows), fo, &ctl);
  (void)tunables::reset("fused_split");
  MK_CHECK(s);
  s = time_it(comm, st, rc, "timing the controller", [&] { return ctl->enqueue(fa, st); }, &t);
  if (s.ok()) {
    row->ctl = t.median_ms;
    row->ctl_split = ctl->comm_ctas();
  }
  const Status d = ctl->destroy();
  return s.ok() ? d : s;
}

Status bench_one_body(Communicator* comm, ops::FusedGemm* op, FusedKind kind, int64_t M, int64_t N, int64_t K,
                      const RunCfg& rc, const std::string& trace, int trace_calls, bool splits, Row* row,
                      ops::FusedGemm* forced_fused = nullptr, ops::FusedGemm* forced_unfused = nullptr) {
  const int W = comm->world(), me = comm->rank();
  cudaStream_t st = comm->stream();
  // This rank's shard: M / W rows at me * M / W, or its --rows entry after the lower ranks'.
  int64_t my_row0 = me * (M / W), my_rows = M / W;
  if (!row->rows.empty()) {
    my_row0 = 0;
    for (int q = 0; q < me; ++q) my_row0 += row->rows[size_t(q)];
    my_rows = row->rows[size_t(me)];
  }
  const int64_t a_rows = kind == FusedKind::kAgGemm ? my_rows : M;
  const int64_t c_rows = kind == FusedKind::kGemmRs ? my_rows : M;
  // AG and RS with uneven shards: NCCL's collectives and the unfused path take equal shards.
  const bool even_only = row->uneven && kind != FusedKind::kGemmAr;
  Buf A, B, C, Aref, Bref, Cref, bad;
  // Correctness: exact small integers; the reference is the unfused GEMM over inputs every rank
  // rebuilds (AG: the gathered A; RS/AR: one GEMM over the ranks' concatenated K).
  auto fill_inputs = [&](bool ints) {
    return CLI_CUDA(comm, fill_fused_inputs(kind, M, N, K, W, me, ints, A.bf(), B.bf(), Aref.bf(), Bref.bf(), st,
                                            my_row0, my_rows));
  };
  gemm::Arguments ref;
  // --path unfused or auto (RS/AR): the unfused path rounds each rank's product to bf16 before the
  // sum, so its result has a reference of its own (Cref_u); AG's unfused path is the same GEMM.
  const std::string mode = op->path();
  const bool unfused_ref = W > 1 && kind != FusedKind::kAgGemm && mode != "fused";
  Buf Cref_u, prod, part, total;
  auto unfused_reference = [&]() -> Status {
    const int64_t n = M * N;
    MK_CHECK(CLI_CUDA(comm, Cref_u.alloc(size_t(n) * 2)));
    MK_CHECK(CLI_CUDA(comm, prod.alloc(size_t(n) * 2)));
    MK_CHECK(CLI_CUDA(comm, part.alloc(size_t(n) * 4)));
    MK_CHECK(CLI_CUDA(comm, total.alloc(size_t(n) * 4)));
    const Topology& topo = comm->topology();
    for (int nd = 0; nd < topo.num_nodes; ++nd) {
      const std::vector<int>& ranks = topo.node_ranks[nd];  // ascending: local index order
      for (size_t l = 0; l < ranks.size(); ++l) {
        gemm::Arguments g;  // rank r's product: its slice of the concatenated K
        g.A = Aref.bf() + int64_t(ranks[l]) * K;
        g.B = Bref.bf() + int64_t(ranks[l]) * K;
        g.C = prod.p;
        g.M = M, g.N = N, g.K = K;
        g.lda = g.ldb = int64_t(W) * K;
        MK_CHECK(gemm::run(g, st));
        accumulate_bf16<<<264, 256, 0, st>>>(static_cast<float*>(part.p), prod.bf(), n, l == 0);
      }
      accumulate_f32<<<264, 256, 0, st>>>(static_cast<float*>(total.p), static_cast<const float*>(part.p), n, nd == 0);
    }
    round_bf16<<<264, 256, 0, st>>>(static_cast<const float*>(total.p), Cref_u.bf(), n);
    return CLI_CUDA(comm, cudaGetLastError());
  };
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
    if (unfused_ref) MK_CHECK(unfused_reference());
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(C.p, 0xff, size_t(c_rows) * N * 2, st)));  // poison
    return synced(comm, st);
  }();
  MK_CHECK(agreed(comm, s, "preparing inputs and the reference"));

  // The checked call: run (collective), synchronize, comm->check(); only then read C. Its path:
  // the operator's path before the call (auto: its first call is a fused warm-up).
  ops::FusedArgs fa;
  fa.A = A.p, fa.B = B.p, fa.C = C.p;
  const int64_t row0 = kind == FusedKind::kGemmRs ? my_row0 : 0;
  unsigned long long* d_bad = static_cast<unsigned long long*>(bad.p);
  auto checked_call = [&](const char* what) -> Status {
    const bool unfused = unfused_ref && (op->path() == "unfused" || op->path().rfind("auto: unfused", 0) == 0);
    Status cs = decoded(comm, op->run(fa, st));
    if (cs.ok()) cs = synced(comm, st);
    const uint16_t* want = static_cast<const uint16_t*>(unfused ? Cref_u.p : Cref.p) + row0 * N;
    return count_world(
        comm, st, cs, d_bad,
        [&] { count_diff<<<264, 256, 0, st>>>(static_cast<uint16_t*>(C.p), want, c_rows * N, d_bad); }, what,
        &row->bad);
  };
  MK_CHECK(checked_call("the checked call"));
  row->checked = true;
  row->correct = row->bad == 0;
  if (!row->correct) return OkStatus();  // no timings of a wrong operator
  // Auto: the calls it times (both paths) and its decision, before the timed calls; then the
  // path it chose checked the same way (exact data again, C poisoned).
  if (mode.rfind("auto", 0) == 0 && W > 1) {
    for (int i = 0; i < 64 && op->path().find("deciding") != std::string::npos; ++i) {
      s = decoded(comm, op->enqueue(fa, st));
      if (s.ok()) s = synced(comm, st);
      MK_CHECK(agreed(comm, s, "the calls policy auto times"));
    }
    s = CLI_CUDA(comm, cudaMemsetAsync(C.p, 0xff, size_t(c_rows) * N * 2, st));
    if (s.ok()) s = synced(comm, st);
    MK_CHECK(agreed(comm, s, "poisoning C"));
    MK_CHECK(checked_call("the call on the path auto chose"));
    row->correct = row->bad == 0;
    if (!row->correct) return OkStatus();
  }

  // Timing on approximately normal data (the GEMM's speed depends on the data).
  s = fill_inputs(false);
  if (s.ok()) s = synced(comm, st);
  MK_CHECK(agreed(comm, s, "refilling inputs"));
  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing the fused call", [&] { return op->enqueue(fa, st); }, &t));
  row->fused = t.median_ms;
  row->fused_min = t.min_ms;
  row->path = op->path();
  gemm::Arguments g;  // T_c: the same GEMM without communication
  g.A = kind == FusedKind::kAgGemm ? op->gathered_a() : A.p;
  g.B = B.p;
  g.C = Cref.p;
  g.M = M, g.N = N, g.K = K;
  MK_CHECK(time_it(comm, st, rc, "timing the GEMM alone", [&] { return gemm::run(g, st); }, &t));
  row->compute = t.median_ms;
  row->compute_min = t.min_ms;
  if (forced_fused && forced_unfused) {
    // The paths side by side: the forced operators were checked in their own runs (--path
    // fused / unfused run the same library paths); here they are timed on the same inputs.
    ops::FusedGemm* order[2][3] = {{forced_fused, forced_unfused, op}, {op, forced_unfused, forced_fused}};
    double sum[3] = {0, 0, 0};  // fused, unfused, auto
    for (auto& round : order)
      for (ops::FusedGemm* o : round) {
        MK_CHECK(time_it(comm, st, rc, "timing the paths side by side", [&] { return o->enqueue(fa, st); }, &t));
        sum[o == forced_fused ? 0 : o == forced_unfused ? 1 : 2] += t.median_ms;
      }
    row->same_fused = sum[0] / 2, row->same_unfused = sum[1] / 2, row->same_auto = sum[2] / 2;
  }
  if (W > 1 && mode != "fused") {
    // The unfused path's parts: its collective alone, as a standalone operator (the operator's
    // own is internal), on the same data sizes.
    const ops::CollectiveKind ck = kind == FusedKind::kAgGemm  ? ops::CollectiveKind::kAllGather
                                   : kind == FusedKind::kGemmRs ? ops::CollectiveKind::kReduceScatter
                                                                : ops::CollectiveKind::kAllReduce;
    const int64_t count = kind == FusedKind::kAgGemm ? M / W * K : kind == FusedKind::kGemmRs ? M / W * N : M * N;
    std::unique_ptr<ops::Collective> coll;
    MK_CHECK(ops::Collective::create(comm, ck, count, ops::CollDType::kBF16, {}, &coll));
    Buf out;
    Status cs = kind == FusedKind::kGemmAr ? Status() : CLI_CUDA(comm, out.alloc(size_t(coll->out_elems()) * 2));
    cs = agreed(comm, cs, "allocating the collective's output");
    if (cs.ok()) {
      void* o = kind == FusedKind::kGemmAr ? coll->output() : out.p;
      cs = time_it(comm, st, rc, "timing the unfused path's collective alone",
                   [&] { return coll->enqueue({coll->input(), o}, st); }, &t);
      row->coll_alone = t.median_ms;
    }
    const Status d = coll->destroy();
    MK_CHECK(cs);
    MK_CHECK(d);
  }
  if (row->uneven && W > 1) {
    // The same operator on even shards padded to the largest: what uneven shards cost.
    int64_t most = (M + W - 1) / W;
    for (int64_t r : row->rows) most = std::max(most, r);
    row->padded_M = most * W;
    const int64_t pa = kind == FusedKind::kAgGemm ? most : row->padded_M, pc = kind == FusedKind::kGemmRs ? most : row->padded_M;
    Buf Ap, Cp;
    std::unique_ptr<ops::FusedGemm> pad;
    ops::FusedOptions po;
    po.deterministic = op->deterministic();
    po.path = "fused";
    s = CLI_CUDA(comm, Ap.alloc(size_t(pa) * K * 2));
    if (s.ok()) s = CLI_CUDA(comm, Cp.alloc(size_t(pc) * N * 2));
    if (s.ok()) s = CLI_CUDA(comm, cudaMemsetAsync(Ap.p, 0x3c, size_t(pa) * K * 2, st));  // 0x3c3c: about 0.0115
    if (s.ok()) s = synced(comm, st);
    MK_CHECK(agreed(comm, s, "allocating the padded operator's buffers"));
    MK_CHECK(ops::FusedGemm::create(comm, kind, {row->padded_M, N, K}, po, &pad));
    ops::FusedArgs pf;
    pf.A = Ap.p, pf.B = B.p, pf.C = Cp.p;
    // Side by side in two rounds, uneven-padded then padded-uneven (a drift weighs on both), each
    // figure the mean of its two medians: ranks sharing a GPU swing by 10-20 % between runs.
    double sum_u = 0, sum_p = 0;
    for (int i = 0; i < 4 && s.ok(); ++i) {
      const bool padded = i == 1 || i == 2;
      s = padded ? time_it(comm, st, rc, "timing the padded even operator", [&] { return pad->enqueue(pf, st); }, &t)
                 : time_it(comm, st, rc, "timing the uneven operator", [&] { return op->enqueue(fa, st); }, &t);
      (padded ? sum_p : sum_u) += t.median_ms;
    }
    row->padded = sum_p / 2, row->uneven_same_run = sum_u / 2;
    const Status d = pad->destroy();
    MK_CHECK(s);
    MK_CHECK(d);
  }
  if (splits && W > 1) MK_CHECK(split_sweep(comm, op, kind, M, N, K, op->deterministic(), rc, fa, row));
  if (!trace.empty() && W > 1) {
    // trace_calls consecutive traced calls per rank (FusedArgs::trace records where the fused
    // kernel runs: W > 1); room per call for three events per tile, the communication ops and
    // the waits that spin.
    const gemm::TileCount tc = gemm::tile_count(M, N);
    std::vector<TraceEvent> ev;
    uint64_t dropped = 0;
    const std::string name = trace + "." + row->op + ".m" + std::to_string(M) + ".n" + std::to_string(N) + ".k" +
                             std::to_string(K) + ".w" + std::to_string(W);
    char header[256];
    snprintf(header, sizeof header, "op %s M %lld N %lld K %lld world %d rank %d nodes %d fused_median_ms %.4f "
             "compute_median_ms %.4f", row->op.c_str(), (long long)M, (long long)N, (long long)K, W, me,
             comm->topology().num_nodes, row->fused, row->compute);
    MK_CHECK(traced_calls(
        comm, st, trace_calls, uint32_t(trace_calls * (8 * tc.total() + 32768)), header,
        name + ".rank" + std::to_string(me),
        [&](const TraceBuffer* tb) {
          ops::FusedArgs ta = fa;
          ta.trace = tb;
          return op->enqueue(ta, st);
        },
        &ev, &dropped));
    if (me == 0) {
      const TraceSummary ts = summarize_trace(ev, trace_calls);
      printf("  trace rank 0, %d calls: kernel %.1f us (median), %.0f tiles (MMA %.2f us + epilogue %.2f us per "
             "tile), %.0f ops (%.1f us), waits spinning %.1f us over all CTAs, tail %.1f us after the last tile%s "
             "-> %s.rank*.tsv (tools/trace_report.py)\n",
             ts.calls, ts.span_us, ts.tiles, ts.mma_us, ts.epi_us, ts.ops, ts.ops_us, ts.spin_us, ts.tail_us,
             dropped ? " (events dropped)" : "", name.c_str());
    }
  }
#if MK_HAVE_NCCL
  if (row->comparable && !even_only) {
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

Status bench_one(Communicator* comm, FusedKind kind, int64_t M, int64_t N, int64_t K, const FusedBenchOpts& o,
                 bool comparable, Row* row) {
  row->op = ops::fused_kind_name(kind);
  row->M = M, row->N = N, row->K = K, row->W = comm->world();
  row->comparable = comparable;
  row->flops = flops_of(kind, M, N, K);
  row->route = kind == FusedKind::kAgGemm ? "" : tunables::fused_route();
  row->rows = fused_shard_rows(kind, M, comm->world(), o.rows);
  // Uneven: rows that differ, or (none given) an M the ranks do not divide.
  row->uneven = row->rows.empty() ? M % comm->world() != 0
                                  : std::adjacent_find(row->rows.begin(), row->rows.end(),
                                                       std::not_equal_to<int64_t>()) != row->rows.end();
  const ops::PlanShape shape(M, N, K, row->rows);
  std::unique_ptr<ops::FusedGemm> op;
  // Collective: bad shapes (N not a multiple of 8, M not divisible by W, ...) are the same
  // error on every rank.
  ops::FusedOptions fo;
  fo.deterministic = o.deterministic;
  fo.path = o.path;
  MK_CHECK(ops::FusedGemm::create(comm, kind, shape, fo, &op));
  row->deterministic = op->deterministic();
  // --path auto: the two forced paths too, timed in the same run (collective creates); AG and RS
  // on uneven shards have no unfused path (auto runs fused there).
  std::unique_ptr<ops::FusedGemm> forced[2];
  Status s;
  if (o.path == "auto" && comm->world() > 1 && !(row->uneven && kind != FusedKind::kGemmAr)) {
    for (int i = 0; i < 2 && s.ok(); ++i) {
      ops::FusedOptions fp = fo;
      fp.path = i == 0 ? "fused" : "unfused";
      s = ops::FusedGemm::create(comm, kind, shape, fp, &forced[i]);
    }
  }
  if (s.ok())
    s = bench_one_body(comm, op.get(), kind, M, N, K, o.rc, o.trace, o.trace_calls, o.splits, row, forced[0].get(),
                       forced[1].get());
  // Every rank gets here on the same path (the body's failures are agreed): destroy is collective.
  Status d = op->destroy();
  for (auto& f : forced)
    if (f) {
      const Status df = f->destroy();
      if (d.ok()) d = df;
    }
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
           "\"overlap_efficiency\": %s, \"fused_over_compute\": %s, \"deterministic\": %s, \"route\": \"%s\", "
           "\"fused_min_ms\": %s, \"compute_only_min_ms\": %s, \"path\": \"%s\"",
           r.op.c_str(), (long long)r.M, (long long)r.N, (long long)r.K, r.W, r.correct ? "true" : "false", r.bad,
           r.comparable ? "true" : "false", jnum(r.fused, 4).c_str(), jnum(r.compute, 4).c_str(),
           jnum(r.seq, 4).c_str(), jnum(r.pipe, 4).c_str(), jnum(r.coll, 4).c_str(), jnum(tf(r.fused), 1).c_str(),
           jnum(ratio(r.seq, r.fused), 3).c_str(), jnum(ratio(r.pipe, r.fused), 3).c_str(),
           eff_json(overlap_eff(r.W, r.compute, r.coll, r.fused)).c_str(),
           jnum(r.compute > 0 ? r.fused / r.compute : 0, 3).c_str(), r.deterministic ? "true" : "false",
           r.route.c_str(), jnum(r.fused_min, 4).c_str(), jnum(r.compute_min, 4).c_str(), r.path.c_str());
  std::string out = b;
  if (r.coll_alone > 0)
    out += ", \"unfused_collective_alone_ms\": " + jnum(r.coll_alone, 4);
  if (!r.rows.empty()) {
    out += ", \"shard_rows\": [";
    for (size_t i = 0; i < r.rows.size(); ++i) out += (i ? ", " : "") + std::to_string(r.rows[i]);
    out += "]";
  }
  if (r.padded > 0)
    out += ", \"padded_even\": {\"M\": " + std::to_string(r.padded_M) + ", \"ms\": " + jnum(r.padded, 4) +
           ", \"uneven_ms\": " + jnum(r.uneven_same_run, 4) + ", \"padded_over_uneven\": " +
           jnum(ratio(r.padded, r.uneven_same_run), 3) + "}";
  if (r.same_auto > 0) {
    const double faster = std::min(r.same_fused, r.same_unfused);
    out += ", \"paths_same_run\": {\"fused_ms\": " + jnum(r.same_fused, 4) + ", \"unfused_ms\": " +
           jnum(r.same_unfused, 4) + ", \"auto_ms\": " + jnum(r.same_auto, 4) + ", \"auto_vs_faster\": " +
           jnum(ratio(faster, r.same_auto), 3) + "}";
  }
  if (!r.statics.empty()) {
    double best = 0, dflt = 0;
    int best_at = 0;
    out += ", \"static_splits_ms\": {";
    for (size_t i = 0; i < r.statics.size(); ++i) {
      out += (i ? ", \"" : "\"") + std::to_string(r.statics[i].first) + "\": " + jnum(r.statics[i].second, 4);
      if (best == 0 || r.statics[i].second < best) best = r.statics[i].second, best_at = r.statics[i].first;
      if (r.statics[i].first == r.default_split) dflt = r.statics[i].second;
    }
    out += "}, \"best_static_split\": " + std::to_string(best_at) + ", \"default_split\": " +
           std::to_string(r.default_split) + ", \"controller_ms\": " + jnum(r.ctl, 4) +
           ", \"controller_split\": " + std::to_string(r.ctl_split) +
           ", \"controller_vs_best\": " + jnum(ratio(best, r.ctl), 3) +
           ", \"controller_vs_default\": " + jnum(ratio(dflt, r.ctl), 3);
  }
  return out + "}";
}

struct Shape {
  int64_t M, N, K;
};

// The shapes of one operator: the one given (a dimension left out is 4096), else the default
// sweep, Llama-70B-like TP shapes shrunk to run in seconds.
std::vector<Shape> shapes_of(FusedKind kind, int64_t m, int64_t n, int64_t k, int W, bool sweep) {
  if (m > 0 || n > 0 || k > 0) return {Shape{m > 0 ? m : 4096, n > 0 ? n : 4096, k > 0 ? k : 4096}};
  if (sweep) {
    std::vector<Shape> out;
    for (const SweepShape& sh : llama70b_tp8_sweep(kind == FusedKind::kAgGemm)) out.push_back(Shape{sh.M, sh.N, sh.K});
    return out;
  }
  if (kind == FusedKind::kAgGemm) return {Shape{4096, 3584, 8192}, Shape{8192, 3584, 8192}};
  if (kind == FusedKind::kGemmRs) return {Shape{4096, 8192, 3584}, Shape{8192, 8192, 3584}};
  // N = M, K = M / W
  return {Shape{4096, 4096, std::max<int64_t>(8, 4096 / W / 8 * 8)},
          Shape{8192, 8192, std::max<int64_t>(8, 8192 / W / 8 * 8)}};
}

}  // namespace

int fused_gemm(const Env& env, const std::string& which, int64_t m, int64_t n, int64_t k, const FusedBenchOpts& o) {
  Communicator* comm = env.comm;
  const bool comparable = env.comparable;
  const int W = comm->world(), me = comm->rank();
  std::vector<FusedKind> kinds;
  if (which == "ag_gemm") kinds = {FusedKind::kAgGemm};
  else if (which == "gemm_rs") kinds = {FusedKind::kGemmRs};
  else if (which == "gemm_ar") kinds = {FusedKind::kGemmAr};
  else if (which == "all") kinds = {FusedKind::kAgGemm, FusedKind::kGemmRs, FusedKind::kGemmAr};
  if (me == 0) {
    printf("mkernel bench: %d rank(s), %d node(s); %s%s\n", W, comm->topology().num_nodes,
           comparable ? "one GPU per rank: fused vs cuBLAS + NCCL"
                      : "ranks share a GPU (or no NCCL): correctness and fused times only, NOT comparable "
                        "with multi-GPU runs; no NCCL baselines",
           W == 1 ? "; W = 1: nothing is communicated, no overlap figure" : "");
    printf("route %s%s%s%s\n", tunables::fused_route().c_str(), o.deterministic ? ", deterministic" : "",
           o.path.empty() ? "" : ", path ", o.path.c_str());
    printf("%-8s %6s %6s %6s  %-7s %9s %9s %9s %6s %9s %9s %8s %8s %7s\n", "op", "M", "N", "K", "check", "fused_ms",
           "TFLOP/s", "comp_ms", "f/c", "seq_ms", "pipe_ms", "vs_seq", "vs_pipe", "overlap");
  }
  std::vector<std::string> rows;
  std::vector<CheckLine> checks;
  bool stop = false;
  for (FusedKind kind : kinds) {
    if (stop) break;
    for (const Shape& sh : shapes_of(kind, m, n, k, W, o.sweep)) {
      Row r;
      CheckLine c;
      c.label = std::string(ops::fused_kind_name(kind)) + " M " + std::to_string(sh.M) + " N " +
                std::to_string(sh.N) + " K " + std::to_string(sh.K) + " W " + std::to_string(W);
      Status bs_ = bench_one(comm, kind, sh.M, sh.N, sh.K, o, comparable, &r);
      c.done = r.checked, c.ok = r.correct, c.bad = r.bad;
      if (!bs_.ok()) {
        c.error = bs_.to_string();
        note_failure(bs_);
        if (me == 0) fprintf(stderr, "bench %s: %s\n", c.label.c_str(), c.error.c_str());
      }
      checks.push_back(c);
      if (bs_.ok() && r.correct) {
        rows.push_back(row_json(r));
        if (me == 0) {
          const double tf = r.fused > 0 ? r.flops / (r.fused * 1e-3) / 1e12 : 0;
          printf("%-8s %6lld %6lld %6lld  %-7s %9s %9s %9s %6s %9s %9s %8s %8s %7s%s\n", r.op.c_str(), (long long)r.M,
                 (long long)r.N, (long long)r.K, "ok", cell(r.fused, 3).c_str(), cell(tf, 1).c_str(),
                 cell(r.compute, 3).c_str(), cell(r.compute > 0 ? r.fused / r.compute : 0, 2).c_str(),
                 cell(r.seq, 3).c_str(), cell(r.pipe, 3).c_str(),
                 cell(ratio(r.seq, r.fused), 2).c_str(), cell(ratio(r.pipe, r.fused), 2).c_str(),
                 eff_cell(overlap_eff(W, r.compute, r.coll, r.fused)).c_str(),
                 comparable ? "" : "  (not comparable)");
          if (r.path != "fused") printf("  path: %s\n", r.path.c_str());
          if (r.uneven) {
            std::string rs;
            for (size_t i = 0; i < r.rows.size(); ++i) rs += (i ? ", " : "") + std::to_string(r.rows[i]);
            printf("  uneven shards (rows %s), same run: uneven %s ms, padded to M = %lld (even) %s ms; padded / "
                   "uneven %s\n",
                   rs.empty() ? "as even as M allows" : rs.c_str(), cell(r.uneven_same_run, 4).c_str(),
                   (long long)r.padded_M, cell(r.padded, 4).c_str(), cell(ratio(r.padded, r.uneven_same_run), 3).c_str());
          }
          if (r.coll_alone > 0)
            printf("  unfused path's parts, each alone: GEMM %s ms + collective %s ms = %s ms\n",
                   cell(r.compute, 4).c_str(), cell(r.coll_alone, 4).c_str(),
                   cell(r.compute + r.coll_alone, 4).c_str());
          if (r.same_auto > 0)
            printf("  paths, same run: fused %s ms, unfused %s ms, auto %s ms: auto %s of the faster\n",
                   cell(r.same_fused, 4).c_str(), cell(r.same_unfused, 4).c_str(), cell(r.same_auto, 4).c_str(),
                   cell(ratio(std::min(r.same_fused, r.same_unfused), r.same_auto), 3).c_str());
          if (!r.statics.empty()) {
            double best = 0, dflt = 0;
            int best_at = 0;
            std::string line = "  splits:";
            for (const auto& [n, ms] : r.statics) {
              line += " " + std::to_string(n) + ":" + cell(ms, 3);
              if (best == 0 || ms < best) best = ms, best_at = n;
              if (n == r.default_split) dflt = ms;
            }
            printf("%s  controller: %s (settled at %d)  ctl/best %s (best %d)  ctl/default %s\n", line.c_str(),
                   cell(r.ctl, 3).c_str(), r.ctl_split, cell(ratio(best, r.ctl), 3).c_str(), best_at,
                   cell(ratio(dflt, r.ctl), 3).c_str());
          }
          fflush(stdout);
        }
      } else if (me == 0 && r.checked && !r.correct) {
        printf("%-8s %6lld %6lld %6lld  %-7s (%llu mismatches)\n", r.op.c_str(), (long long)r.M, (long long)r.N,
               (long long)r.K, "WRONG", r.bad);
      }
      if (!bs_.ok() && communicator_failed(comm)) {
        stop = true;
        break;
      }
    }
  }
  bool failed = false;
  if (me == 0 && !env.json.empty() && !write_json(env.json, W, comm->topology().num_nodes, comparable, rows))
    failed = true;
  return summarize(comm, checks, "bit-exact against the unfused GEMM", failed);
}

}  // namespace bench
}  // namespace mk
