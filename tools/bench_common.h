// What every operator's `mkernel bench` entry shares: device buffers, decoded and agreed
// failures, timing, result checks, table/JSON cells, the "check:" lines and the verdict, and the
// entry points the CLI dispatches to (each defined in tools/bench/<operator>.cu).
//
// Part of the CLI (target mkernel_cli), not of the library: the entries time the cuBLAS + NCCL
// baselines of tools/baseline/.
//
// Failure contract of every helper here. A step a rank runs on its own (allocation, fill, one
// call) ends in agreed(): every rank learns the first failing rank's error at the same point and
// leaves by the same path (operator and communicator teardown are collective), so no rank waits
// in a collective for one that left. A result is read only after the call that wrote it was
// synchronized and comm->check() passed: a device wait that gave up does not fail the launch,
// only the communicator's decoded record says so.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/status.h"
#include "mkernel/device/trace.h"
#include "mkernel/ops/collective.h"
#include "mkernel/ops/fused.h"
#include "mkernel/runtime/communicator.h"

namespace mk {
namespace bench {

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

#ifdef __CUDACC__
// The hash the operators' fill kernels draw their inputs from (splitmix64's finalizer); host
// code can recompute what a fill kernel wrote (the MoE bench checks received rows so).
__host__ __device__ inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}
#endif

// ---- failures: decoded, then agreed ----

// `s` as the CLI reports it: when the communicator has failed (a device wait gave up, or an
// abort), its decoded record names the culprit and comes first, `s` follows as what the CLI
// saw (e.g. a sticky CUDA error after the kernel). Ok only if both are.
Status decoded(Communicator* comm, const Status& s);

// A CUDA call of the CLI's own, decoded.
Status cuda_step(Communicator* comm, cudaError_t e, const char* expr);
#define CLI_CUDA(comm, expr) ::mk::bench::cuda_step((comm), (expr), #expr)

// Synchronizes `st` (comm->sync: the decoded record when a wait gave up) and checks the
// communicator's health: the kernel finishing is not enough, a wait that gave up lets it finish.
Status synced(Communicator* comm, cudaStream_t st);

// Every rank passes the outcome of a step it ran on its own and gets the same result: ok, or
// the first failing rank's error (agree() carries ~250 characters of it, so a failing rank
// prints its own whole message too, rank 0 unless the summary holds it whole).
Status agreed(Communicator* comm, const Status& mine, const std::string& what);
// The first failure agreed() returned in this process ("<what>: ... failed on rank(s) 1: ..."), or
// one an entry noted (note_failure: a step every rank failed together, e.g. an operator's create),
// or OK. `mkernel bench` prints it on every rank.
const Status& first_failure();
void note_failure(const Status& s);

// ---- timing ----

struct Timing {
  double median_ms = 0, min_ms = 0;
  double host_median_ms = 0;  // this rank's wall-clock time to enqueue one call (f()), median
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
  // The ranks start together, then enqueue every call back to back: the GPUs' queues stay ahead
  // of the hosts, as in a training step, and a call's time is device work (a host barrier per
  // call would add the hosts' skew to the fused calls, whose ranks wait for each other, and not
  // to the GEMM alone). An enqueue failure stops the loop; the ranks agree after it.
  MK_CHECK(agreed(comm, s, what));
  std::vector<double> host(reps, 0.0);
  for (int i = 0; i < reps && s.ok(); ++i) {
    s = CLI_CUDA(comm, cudaEventRecord(ev.ev[2 * i], st));
    const auto h0 = std::chrono::steady_clock::now();
    if (s.ok()) s = decoded(comm, f());
    host[i] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
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
  std::sort(host.begin(), host.end());
  out->host_median_ms = host[reps / 2];
  out->median_ms = ms[reps / 2];
  out->min_ms = ms[0];
  return OkStatus();
}

// One traced call on every rank: `enqueue(buffer)` launches it recording into a trace buffer of
// `capacity` events; this rank's events come back in `ev` and go to `path` (Chrome trace JSON).
// Collective: the ranks start it together and agree on its outcome.
template <class F>
Status traced_call(Communicator* comm, cudaStream_t st, uint32_t capacity, const std::string& path, F&& enqueue,
                   std::vector<TraceEvent>* ev, uint64_t* dropped) {
  TraceRecorder rec;
  MK_CHECK(agreed(comm, TraceRecorder::create(capacity, &rec), "creating the trace recorder"));
  MK_CHECK(comm->bootstrap().barrier());
  Status s = decoded(comm, enqueue(rec.device()));
  if (s.ok()) s = synced(comm, st);
  if (s.ok()) s = rec.fetch(ev, dropped);
  if (s.ok()) s = write_chrome_trace(*ev, path);
  return agreed(comm, s, "the traced call");
}

// The host's steady clock (ns), and its offset from the device's %globaltimer (host - device,
// within a microsecond or two; tools/bench/trace_clock.cu).
int64_t host_now_ns();
Status host_minus_device_ns(Communicator* comm, int64_t* out);

// `calls` consecutive traced calls on every rank, started together and enqueued back to back as
// time_it's calls are: every event of all of them, plus one Role::kHost event per call (its
// enqueue on the host, in the device's clock; cta and item = the call's index), come back in
// `ev` and go to `path`.tsv (write_trace_table; `header` first) and `path`.json (Chrome trace).
// The ranks' tables share one clock when they share a GPU. Collective.
template <class F>
Status traced_calls(Communicator* comm, cudaStream_t st, int calls, uint32_t capacity, const std::string& header,
                    const std::string& path, F&& enqueue, std::vector<TraceEvent>* ev, uint64_t* dropped) {
  TraceRecorder rec;
  int64_t offset = 0;
  Status s = TraceRecorder::create(capacity, &rec);
  if (s.ok()) s = host_minus_device_ns(comm, &offset);
  MK_CHECK(agreed(comm, s, "preparing the traced calls"));
  std::vector<TraceEvent> host(calls);
  MK_CHECK(comm->bootstrap().barrier());
  for (int i = 0; i < calls && s.ok(); ++i) {
    const int64_t t0 = host_now_ns();
    s = decoded(comm, enqueue(rec.device()));
    const int64_t t1 = host_now_ns();
    host[i] = TraceEvent{uint64_t(t0 - offset), uint64_t(t1 - offset), 0, uint32_t(i), uint32_t(Role::kHost), i};
  }
  if (s.ok()) s = synced(comm, st);
  if (s.ok()) s = rec.fetch(ev, dropped);
  if (s.ok()) {
    ev->insert(ev->end(), host.begin(), host.end());
    s = write_trace_table(*ev, header + " calls " + std::to_string(calls), path + ".tsv");
  }
  if (s.ok()) s = write_chrome_trace(*ev, path + ".json");
  return agreed(comm, s, "the traced calls");
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

std::string cell(double v, int prec);
std::string jnum(double v, int prec);
// Overlap efficiency (T_c + T_x - T_fused) / min(T_c, T_x): only where something is
// communicated (W > 1) and both parts were measured; else NaN ("-", null).
double overlap_eff(int W, double compute, double coll, double fused);
std::string eff_cell(double e);
std::string eff_json(double e);
double ratio(double base, double fused);

// ---- checks, JSON file, verdict ----

// One "check:" line per operator and shape (rank 0 prints them after the table).
struct CheckLine {
  std::string label;
  bool done = false, ok = false;
  unsigned long long bad = 0;
  std::string error;
};

std::string check_line(const CheckLine& c, const char* how);

// Writes {"world", "nodes", "comparable", "results": [rows...]} to `path` (rows are JSON
// objects); false (and a line on stderr) when the file cannot be written.
bool write_json(const std::string& path, int W, int nodes, bool comparable, const std::vector<std::string>& rows);

// After an operator failed: is the communicator still usable on every rank? (A device wait
// that gave up fails it for good: the remaining operators are skipped.) Collective.
bool communicator_failed(Communicator* comm);

// Prints the check lines and the verdict (rank 0); returns the exit code.
int summarize(Communicator* comm, const std::vector<CheckLine>& checks, const char* how, bool other_failure);

// ---- operator entries ----
//
// Each runs its operator's sweep on `env.comm` (collective: every rank calls it with the same
// arguments, already checked by the CLI), prints the table (rank 0), writes `env.json` when
// given, prints the check lines and the verdict, and returns the exit code (0 passed, 1 not).
// The communicator outlives the call; its teardown is the caller's.

struct Env {
  Communicator* comm = nullptr;
  RunCfg rc;
  bool comparable = false;  // one GPU per rank and NCCL: baselines timed, times comparable
  bool own_gpu = false;     // no two ranks share a GPU (NCCL or not)
  std::string json;         // --json FILE, "" for none
};

// The fused operators' --sweep: Llama-3-70B (hidden 8192, intermediate 28672, 64 query / 8 KV
// heads of 128) at tensor parallelism 8, per GPU; M = tokens 2048..16384. AG: the column-parallel
// GEMMs (gate+up: N = 2 * 28672 / 8; QKV: N = (8192 + 2 * 1024) / 8) over the gathered rows; RS
// and AR: the row-parallel ones (down: K = 28672 / 8; o_proj: K = 8192 / 8) into the full hidden
// size. Also bench/bench_fused_threads's --sweep.
struct SweepShape {
  int64_t M, N, K;
};
inline std::vector<SweepShape> llama70b_tp8_sweep(bool ag) {
  std::vector<SweepShape> out;
  for (int64_t tokens : {2048, 4096, 8192, 16384}) {
    if (ag) {
      out.push_back(SweepShape{tokens, 7168, 8192});
      out.push_back(SweepShape{tokens, 1280, 8192});
    } else {
      out.push_back(SweepShape{tokens, 8192, 3584});
      out.push_back(SweepShape{tokens, 8192, 1024});
    }
  }
  return out;
}

// The static splits (communication CTAs) that --splits times against the SM-partition
// controller, those below the grid (`mkernel bench --splits`, bench_fused_threads --splits).
constexpr int kStaticSplits[] = {1, 2, 4, 8, 16, 24, 32};

// tools/bench/fused_gemm.cu. `which`: ag_gemm, gemm_rs, gemm_ar or all. m, n, k: the shape
// given (0: left out, 4096), all three 0 for the default shapes (o.sweep: the Llama-3-70B TP8
// sweep).
struct FusedBenchOpts {
  RunCfg rc;
  bool sweep = false;          // --sweep
  bool deterministic = false;  // --deterministic (RS/AR)
  bool splits = false;         // --splits: static splits {1..32} against the SM-partition controller
  std::string trace;           // --trace PREFIX: traced calls per shape and rank
  int trace_calls = 10;        // --trace-calls: how many consecutive calls are traced
  std::string path;            // --path fused|unfused|auto ("": the tunable fused_path)
  std::vector<int64_t> rows;   // --rows: each rank's shard rows (empty: see fused_shard_rows)
};
// Each rank's shard rows for a fused operator of M rows on W ranks: `given` (--rows), else for AG
// and RS, when M % W != 0, as even as M allows (the first M % W ranks one row more); empty: the
// operator's own split (M / W each; AR: its own split of any M).
inline std::vector<int64_t> fused_shard_rows(ops::FusedKind kind, int64_t M, int W, const std::vector<int64_t>& given) {
  if (!given.empty()) return given;
  if (kind == ops::FusedKind::kGemmAr || W < 1 || M % W == 0) return {};
  std::vector<int64_t> r;
  for (int s = 0; s < W; ++s) r.push_back(M / W + (s < M % W ? 1 : 0));
  return r;
}
int fused_gemm(const Env& env, const std::string& which, int64_t m, int64_t n, int64_t k, const FusedBenchOpts& o);

// tools/bench/ring_attention.cu. `seqs`: tokens per rank, one run each (empty: the default
// sweep); `trace`: a file prefix for one traced call per run ("" for none); doc_len > 0: the
// sequence packed with documents of doc_len tokens (the last shorter; cu_seqlens); shard_rows
// (one count per rank; seqs unused): uneven shards, then the same sequence on even shards of the
// largest count, and their ratio; balanced (with doc_len): per seq, the contiguous shards that
// balance the documents' work, then even zigzag ones, and their ratio.
int ring_attention(const Env& env, std::vector<int64_t> seqs, bool causal, const std::string& trace,
                   int64_t doc_len = 0, const std::vector<int64_t>& shard_rows = {}, bool balanced = false);

// tools/bench/moe_dispatch.cu: MoE dispatch and combine against a device copy of the same bytes and,
// when `env.comparable`, NCCL all-to-all-v plus permute kernels.
struct MoeBenchArgs {
  std::vector<std::string> presets;  // --preset, in order (names from moe_presets()); empty: all
  int64_t tokens = 0;                // --tokens: per rank; 0: the preset's (scaled down when ranks share a GPU)
  RunCfg rc;                         // --reps, --warmup
};
int moe_dispatch(const Env& env, const MoeBenchArgs& a);
// The preset names moe_dispatch knows, in its default order (the CLI checks --preset against them).
std::vector<std::string> moe_presets();

// tools/bench/moe_layer.cu: the MoE layer against the same layer from separate launches with
// cuBLAS's grouped GEMM; tokens per rank 128 and 4096 unless --tokens.
int moe_layer(const Env& env, const MoeBenchArgs& a);
std::vector<std::string> moe_layer_presets();

// tools/bench/collective.cu: a standalone collective (ops/collective.h), plain and zero-copy,
// checked bit for bit, against NCCL's collective of the same buffers and dtype (one GPU per rank)
// and a device copy of the bus bytes (nccl-tests' convention).
struct CollBenchArgs {
  ops::CollectiveKind kind = ops::CollectiveKind::kAllReduce;
  ops::CollDType dtype = ops::CollDType::kBF16;  // --dtype bf16|fp32
  std::vector<int64_t> counts;  // --count: elements per rank as the operator counts them; empty: 64 KiB .. 256 MiB
  int64_t chunk = 0;            // --chunk: CollectiveOptions::chunk_elems (0: the operator's default)
  int ctas = 0;                 // --ctas: CollectiveOptions::ctas (0: the operator's default)
  RunCfg rc;                    // --reps, --warmup
};
int collective(const Env& env, const CollBenchArgs& a);

}  // namespace bench
}  // namespace mk
