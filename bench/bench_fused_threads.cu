// bench_fused_threads: a fused GEMM collective with its ranks as threads of one process on one
// GPU (thread bootstrap, one CUDA context, a stream per rank, no MPS), against the same GEMM with
// every rank running it at once — what `mkernel bench` measures with ranks as processes under
// MPS, without MPS. Each rank's persistent grid is SMs / W CTAs (FusedOptions::max_ctas and the
// GEMM's RunConfig::max_ctas: the kernels of all ranks must be co-resident, as MPS at 100/W %
// gives each process that share).
//   bench_fused_threads W gemm_rs|gemm_ar|ag_gemm M N K [reps] [--trace PREFIX] [--json FILE]
//   bench_fused_threads W --sweep [reps] [--json FILE]   (every operator at the CLI's --sweep shapes)
//   bench_fused_threads W gemm_rs|gemm_ar|ag_gemm M N K [reps] --splits [--trace PREFIX] [--json FILE]
// First a checked call on small integers, bit-exact against one unfused GEMM over the ranks'
// inputs (as the CLI's check); then on approximately normal data the median (and fastest) of
// `reps` calls of the slowest rank, enqueued back to back after a barrier, fused and GEMM alone.
// --trace PREFIX: 10 consecutive traced fused calls per rank into PREFIX.<op>.m.n.k.wW.rankR.tsv
// (tools/trace_report.py; no host events). Prints one JSON line per operator and shape; --json
// FILE writes them as tools/sweep_report.py reads them.
// --splits: also the fused call at every static split {1, 2, 4, 8, 16, 24, 32} below the grid
// (FusedGemm::set_comm_ctas) and with the SM-partition controller (a second operator created
// with fused_split=auto; its warm-up calls let it settle), each timed like the default; with
// --trace, 3 traced calls per split into PREFIX.<op>...w<W>.split<n>.rank<R>.tsv (n: the count,
// or "ctl") — what tools/split_calibration.py fits the controller's CPU model to.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/cuda_check.h"
#include "mkernel/device/trace.h"
#include "mkernel/gemm/gemm.h"
#include "mkernel/mkernel.h"
#include "mkernel/ops/fused.h"
#include "tools/bench_common.h"
#include "tools/bench/fused_inputs.cuh"

using namespace mk;

namespace {

// Buffers, inputs and the comparison as `mkernel bench` has them (tools/bench_common.h,
// tools/bench/fused_inputs.cuh).
using bench::Buf;
using bench::count_diff;
using bench::fill_fused_inputs;

struct Opts {
  int W = 2;
  ops::FusedKind kind = ops::FusedKind::kGemmRs;
  int64_t M = 8192, N = 3584, K = 4096;
  int reps = 30;
  std::string trace;
  bool splits = false;
};

struct RankOut {
  Status s;
  std::vector<double> fused, compute;  // ms per rep
  unsigned long long bad = 0;
  // --splits: per static split (bench::kStaticSplits, those below the grid) and with the controller.
  std::vector<std::vector<double>> statics;
  std::vector<int> static_n;
  std::vector<double> ctl;
  int ctl_split = 0, default_split = 0;
};

// Times `reps` calls of f enqueued back to back after a barrier (this rank's events).
template <class F>
Status time_calls(Communicator* comm, int reps, F&& f, std::vector<double>* ms) {
  cudaStream_t st = comm->stream();
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) MK_CUDA_CHECK(cudaEventCreate(&e));
  Status s;
  for (int i = 0; i < 3 && s.ok(); ++i) s = f();
  if (s.ok()) s = comm->sync(st);
  if (s.ok()) s = comm->bootstrap().barrier();
  for (int i = 0; i < reps && s.ok(); ++i) {
    cudaEventRecord(ev[2 * i], st);
    s = f();
    cudaEventRecord(ev[2 * i + 1], st);
  }
  if (s.ok()) s = comm->sync(st);
  for (int i = 0; i < reps && s.ok(); ++i) {
    float t = 0;
    if (cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]) != cudaSuccess) s = Status(Code::kCudaError, "event");
    ms->push_back(t);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return s;
}

Status run_rank(Communicator* comm, const Opts& o, int ctas, RankOut* out) {
  const int W = comm->world(), me = comm->rank();
  const int64_t M = o.M, N = o.N, K = o.K;
  const bool ag = o.kind == ops::FusedKind::kAgGemm;
  const int64_t a_rows = ag ? M / W : M, c_rows = o.kind == ops::FusedKind::kGemmRs ? M / W : M;
  cudaStream_t st = comm->stream();
  ops::FusedOptions fo;
  fo.max_ctas = ctas;
  // --splits sets fused_split=auto for the whole process (the controller's operator below): this
  // one keeps the default static count.
  if (o.splits) fo.comm_ctas = int(tunables::fused_comm_ctas());
  out->default_split = int(tunables::fused_comm_ctas());
  std::unique_ptr<ops::FusedGemm> op;
  MK_CHECK(ops::FusedGemm::create(comm, o.kind, {M, N, K}, fo, &op));
  Buf A, B, C, Aref, Bref, Cref, bad;
  MK_CUDA_CHECK(A.alloc(size_t(a_rows) * K * 2));
  MK_CUDA_CHECK(B.alloc(size_t(N) * K * 2));
  MK_CUDA_CHECK(C.alloc(size_t(c_rows) * N * 2));
  MK_CUDA_CHECK(Aref.alloc(ag ? size_t(M) * K * 2 : size_t(M) * K * W * 2));
  MK_CUDA_CHECK(Bref.alloc(ag ? 16 : size_t(N) * K * W * 2));
  MK_CUDA_CHECK(Cref.alloc(size_t(M) * N * 2));
  MK_CUDA_CHECK(bad.alloc(8));
  auto fill_inputs = [&](bool ints) {
    MK_CUDA_CHECK(fill_fused_inputs(o.kind, M, N, K, W, me, ints, A.bf(), B.bf(), Aref.bf(), Bref.bf(), st));
    return OkStatus();
  };
  // The checked call: every element against one unfused GEMM over all ranks' inputs.
  MK_CHECK(fill_inputs(true));
  gemm::Arguments ref;
  ref.A = Aref.p, ref.B = ag ? B.p : Bref.p, ref.C = Cref.p;
  ref.M = M, ref.N = N, ref.K = ag ? K : K * W;
  MK_CHECK(gemm::run(ref, st));
  MK_CUDA_CHECK(cudaMemsetAsync(C.p, 0xff, size_t(c_rows) * N * 2, st));
  MK_CUDA_CHECK(cudaMemsetAsync(bad.p, 0, 8, st));
  MK_CHECK(comm->sync(st));
  MK_CHECK(comm->bootstrap().barrier());
  ops::FusedArgs fa;
  fa.A = A.p, fa.B = B.p, fa.C = C.p;
  MK_CHECK(op->run(fa, st));
  MK_CHECK(comm->sync(st));
  const int64_t row0 = o.kind == ops::FusedKind::kGemmRs ? me * (M / W) : 0;
  count_diff<<<264, 256, 0, st>>>(static_cast<uint16_t*>(C.p), static_cast<uint16_t*>(Cref.p) + row0 * N, c_rows * N,
                                  static_cast<unsigned long long*>(bad.p));
  MK_CUDA_CHECK(cudaMemcpyAsync(&out->bad, bad.p, 8, cudaMemcpyDeviceToHost, st));
  MK_CHECK(comm->sync(st));
  // Timing on approximately normal data (the GEMM's speed depends on the data).
  MK_CHECK(fill_inputs(false));
  MK_CHECK(comm->sync(st));
  MK_CHECK(time_calls(comm, o.reps, [&] { return op->enqueue(fa, st); }, &out->fused));
  gemm::Arguments g;
  g.A = ag ? op->gathered_a() : A.p, g.B = B.p, g.C = Cref.p;
  g.M = M, g.N = N, g.K = K;
  gemm::RunConfig gc;
  gc.max_ctas = ctas;
  MK_CHECK(time_calls(comm, o.reps, [&] { return gemm::run(g, st, gc); }, &out->compute));
  const std::string name = o.trace + "." + ops::fused_kind_name(o.kind) + ".m" + std::to_string(M) + ".n" +
                           std::to_string(N) + ".k" + std::to_string(K) + ".w" + std::to_string(W);
  // `calls` consecutive traced calls of `f` into name + tag + ".rank<R>.tsv".
  auto traced = [&](ops::FusedGemm* f, int calls, const std::string& tag, const std::string& split) -> Status {
    const int64_t tiles = ((M + 127) / 128) * ((N + 255) / 256);
    TraceRecorder rec;
    MK_CHECK(TraceRecorder::create(uint32_t(calls * (8 * tiles + 32768)), &rec));
    MK_CHECK(comm->bootstrap().barrier());
    for (int i = 0; i < calls; ++i) {
      ops::FusedArgs ta = fa;
      ta.trace = rec.device();
      MK_CHECK(f->enqueue(ta, st));
    }
    MK_CHECK(comm->sync(st));
    std::vector<TraceEvent> ev;
    uint64_t dropped = 0;
    MK_CHECK(rec.fetch(&ev, &dropped));
    char header[320];
    snprintf(header, sizeof header,
             "op %s M %lld N %lld K %lld world %d rank %d nodes 1 ranks threads calls %d ctas %d split %s",
             ops::fused_kind_name(o.kind), (long long)M, (long long)N, (long long)K, W, me, calls, ctas, split.c_str());
    MK_CHECK(write_trace_table(ev, header, name + tag + ".rank" + std::to_string(me) + ".tsv"));
    if (dropped) fprintf(stderr, "bench_fused_threads: rank %d: %llu trace events dropped\n", me, (unsigned long long)dropped);
    return OkStatus();
  };
  if (!o.trace.empty() && !o.splits) MK_CHECK(traced(op.get(), 10, "", std::to_string(out->default_split)));
  if (o.splits) {
    constexpr int kTracedCalls = 3;
    for (int n : bench::kStaticSplits) {
      if (n >= ctas) break;
      MK_CHECK(op->set_comm_ctas(n, st));
      out->statics.emplace_back();
      out->static_n.push_back(n);
      MK_CHECK(time_calls(comm, o.reps, [&] { return op->enqueue(fa, st); }, &out->statics.back()));
      if (!o.trace.empty()) MK_CHECK(traced(op.get(), kTracedCalls, ".split" + std::to_string(n), std::to_string(n)));
    }
    // The controller: fused_split=auto (set by main before the ranks started).
    ops::FusedOptions co;
    co.max_ctas = ctas;
    std::unique_ptr<ops::FusedGemm> ctl;
    MK_CHECK(ops::FusedGemm::create(comm, o.kind, {M, N, K}, co, &ctl));
    Status s = ctl->split_controlled()
                   ? OkStatus()
                   : Status(Code::kInternal, "bench_fused_threads: the controller's operator is not split-controlled");
    if (s.ok()) s = time_calls(comm, o.reps, [&] { return ctl->enqueue(fa, st); }, &out->ctl);
    if (s.ok()) out->ctl_split = ctl->comm_ctas();
    if (s.ok() && !o.trace.empty()) s = traced(ctl.get(), kTracedCalls, ".splitctl", "ctl");
    const Status d = ctl->destroy();
    MK_CHECK(s);
    MK_CHECK(d);
  }
  return op->destroy();
}

// The slowest rank per rep of the series pick(rank), then the median and the fastest.
template <class Pick>
void stats_of(const std::vector<RankOut>& out, Pick pick, double* med, double* min) {
  std::vector<double> t = pick(out[0]);
  for (const RankOut& r : out) {
    const std::vector<double>& v = pick(r);
    for (size_t i = 0; i < t.size() && i < v.size(); ++i) t[i] = std::max(t[i], v[i]);
  }
  std::sort(t.begin(), t.end());
  *med = t.empty() ? 0 : t[t.size() / 2];
  *min = t.empty() ? 0 : t[0];
}

// One operator and shape: W threads, each its communicator; the JSON row into *row.
int run_job(const Opts& o, int ctas, std::string* row) {
  const Status shape_ok = ops::FusedGemm::can_implement(o.kind, {o.M, o.N, o.K}, o.W);
  if (!shape_ok.ok()) return fprintf(stderr, "bench_fused_threads: %s\n", shape_ok.to_string().c_str()), 2;
  std::vector<std::unique_ptr<Bootstrap>> world;
  Status s = make_thread_world(o.W, &world);
  if (!s.ok()) return fprintf(stderr, "bench_fused_threads: %s\n", s.to_string().c_str()), 1;
  std::vector<RankOut> out(o.W);
  std::vector<std::thread> th;
  for (int r = 0; r < o.W; ++r)
    th.emplace_back([&, r] {
      CommConfig cfg;
      cfg.require_gpu = true;
      std::unique_ptr<Communicator> comm;
      out[r].s = Communicator::create(std::move(world[r]), cfg, &comm);
      if (out[r].s.ok()) out[r].s = run_rank(comm.get(), o, ctas, &out[r]);
      // A failed rank fails the job so that the others leave their waits and collectives.
      if (comm && !out[r].s.ok()) out[r].s = comm->failure(out[r].s);
      if (comm) {
        const Status d = comm->destroy();
        if (out[r].s.ok()) out[r].s = d;
      }
    });
  for (auto& t : th) t.join();
  unsigned long long bad = 0;
  for (int r = 0; r < o.W; ++r) {
    if (!out[r].s.ok()) {
      fprintf(stderr, "bench_fused_threads: rank %d: %s\n", r, out[r].s.to_string().c_str());
      return 1;
    }
    bad += out[r].bad;
  }
  double fm, fmin, cm, cmin;
  stats_of(out, [](const RankOut& r) -> const std::vector<double>& { return r.fused; }, &fm, &fmin);
  stats_of(out, [](const RankOut& r) -> const std::vector<double>& { return r.compute; }, &cm, &cmin);
  char b[640];
  snprintf(b, sizeof b,
           "{\"ranks\": \"threads\", \"op\": \"%s\", \"M\": %lld, \"N\": %lld, \"K\": %lld, \"world\": %d, "
           "\"ctas_per_rank\": %d, \"correct\": %s, \"mismatches\": %llu, \"fused_ms\": %.4f, \"fused_min_ms\": %.4f, "
           "\"compute_only_ms\": %.4f, \"compute_min_ms\": %.4f, \"f_over_c\": %.3f, \"median_over_fastest\": %.3f",
           ops::fused_kind_name(o.kind), (long long)o.M, (long long)o.N, (long long)o.K, o.W, ctas,
           bad ? "false" : "true", bad, fm, fmin, cm, cmin, cm > 0 ? fm / cm : 0.0, fmin > 0 ? fm / fmin : 0.0);
  *row = b;
  if (o.splits) {
    // Per static split and the controller: the slowest rank's median and fastest call (ms).
    std::string sp = ", \"default_split\": " + std::to_string(out[0].default_split) + ", \"statics\": [";
    double best = 0;
    int best_n = 0;
    for (size_t i = 0; i < out[0].statics.size(); ++i) {
      double med = 0, mn = 0;
      stats_of(out, [i](const RankOut& r) -> const std::vector<double>& { return r.statics[i]; }, &med, &mn);
      snprintf(b, sizeof b, "%s{\"split\": %d, \"ms\": %.4f, \"min_ms\": %.4f}", i ? ", " : "", out[0].static_n[i], med,
               mn);
      sp += b;
      if (best == 0 || med < best) best = med, best_n = out[0].static_n[i];
    }
    double cmed = 0, cmn = 0;
    stats_of(out, [](const RankOut& r) -> const std::vector<double>& { return r.ctl; }, &cmed, &cmn);
    snprintf(b, sizeof b,
             "], \"best_static_split\": %d, \"best_static_ms\": %.4f, \"ctl_ms\": %.4f, \"ctl_min_ms\": %.4f, "
             "\"ctl_split\": %d, \"controller_vs_best\": %.3f",
             best_n, best, cmed, cmn, out[0].ctl_split, cmed > 0 ? best / cmed : 0.0);
    sp += b;
    *row += sp;
  }
  *row += "}";
  return bad ? 1 : 0;
}

int usage() {
  fprintf(stderr,
          "usage: bench_fused_threads W (gemm_rs|gemm_ar|ag_gemm M N K | --sweep) [reps] [--splits] "
          "[--trace PREFIX] [--json FILE]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  std::string json;
  bool sweep = false;
  std::vector<std::string> pos;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--trace" || a == "--json") && i + 1 < argc) (a == "--trace" ? o.trace : json) = argv[++i];
    else if (a == "--sweep") sweep = true;
    else if (a == "--splits") o.splits = true;
    else if (a.rfind("--", 0) == 0) return usage();
    else pos.push_back(a);
  }
  // W, then op M N K (or --sweep), then reps.
  if (pos.empty() || (!sweep && pos.size() < 5)) return usage();
  o.W = atoi(pos[0].c_str());
  std::vector<Opts> jobs;
  size_t next = 1;
  if (sweep) {
    // The CLI's --sweep (tools/bench_common.h): every operator at the Llama-3-70B TP8 shapes.
    for (ops::FusedKind kind : {ops::FusedKind::kAgGemm, ops::FusedKind::kGemmRs, ops::FusedKind::kGemmAr})
      for (const bench::SweepShape& sh : bench::llama70b_tp8_sweep(kind == ops::FusedKind::kAgGemm)) {
        Opts j = o;
        j.kind = kind, j.M = sh.M, j.N = sh.N, j.K = sh.K;
        jobs.push_back(j);
      }
  } else {
    if (pos[1] == "ag_gemm") o.kind = ops::FusedKind::kAgGemm;
    else if (pos[1] == "gemm_ar") o.kind = ops::FusedKind::kGemmAr;
    else if (pos[1] != "gemm_rs") return fprintf(stderr, "bench_fused_threads: unknown operator %s\n", pos[1].c_str()), 2;
    o.M = atoll(pos[2].c_str()), o.N = atoll(pos[3].c_str()), o.K = atoll(pos[4].c_str());
    jobs.push_back(o);
    next = 5;
  }
  const int reps = pos.size() > next ? atoi(pos[next].c_str()) : 30;
  if (o.W < 2 || reps < 1 || (!sweep && (o.M < 1 || o.N < 1 || o.K < 1)))
    return fprintf(stderr, "bench_fused_threads: W >= 2, reps >= 1 and a positive shape\n"), 2;
  if (o.splits && sweep) return fprintf(stderr, "bench_fused_threads: --splits takes one operator and shape\n"), 2;
  // The controller's operator is created with fused_split=auto; the others fix their count.
  if (o.splits && !tunables::set("fused_split", "auto").ok())
    return fprintf(stderr, "bench_fused_threads: cannot set fused_split=auto\n"), 1;
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 2 * o.W)
    return fprintf(stderr, "bench_fused_threads: no usable GPU\n"), 1;
  int rc = 0;
  std::vector<std::string> rows;
  for (Opts& j : jobs) {
    j.reps = reps;
    std::string row;
    const int r = run_job(j, sms / o.W, &row);
    if (!row.empty()) {
      printf("%s\n", row.c_str());
      fflush(stdout);
      rows.push_back(row);
    }
    rc = std::max(rc, r);
  }
  if (!json.empty()) {  // tools/sweep_report.py reads it
    FILE* f = fopen(json.c_str(), "w");
    if (!f) return fprintf(stderr, "bench_fused_threads: cannot write %s\n", json.c_str()), 1;
    fprintf(f, "{\"ranks\": \"threads\", \"world\": %d, \"results\": [\n", o.W);
    for (size_t i = 0; i < rows.size(); ++i) fprintf(f, "%s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
    fprintf(f, "]}\n");
    if (fclose(f) != 0) return fprintf(stderr, "bench_fused_threads: writing %s failed\n", json.c_str()), 1;
  }
  return rc;
}
