// `mkernel bench <op>`: the fused operators against their unfused baselines on the local GPUs.
//
//   mkernel bench ag_gemm|gemm_rs|gemm_ar|all [--m M --n N --k K | --sweep] [--rows R0,R1,...]
//                                             [--deterministic] [--path P]
//                                             [--splits] [--reps R] [--warmup U] [--json FILE]
//                                             [--trace PREFIX [--trace-calls N]]
//   mkernel bench ring_attention [--seq S_per_rank]... [--rows R0,R1,...] [--non-causal] [--doc-len L [--balanced]]
//                                [--reps R] [--warmup U]
//                                [--json FILE] [--trace PREFIX]
//   mkernel bench moe_dispatch [--preset deepep_ht|deepep_ll|qwen3|mixtral]... [--tokens T_per_rank]
//                              [--reps R] [--warmup U] [--json FILE]
//   mkernel bench moe_layer [--preset qwen3_30b|qwen3_235b|mixtral|deepseek_v3]... [--tokens T_per_rank]
//                           [--reps R] [--warmup U] [--json FILE]
//   mkernel bench allgather|reduce_scatter|allreduce [--count N]... [--dtype bf16|fp32] [--chunk E]
//                                                    [--ctas C] [--reps R] [--warmup U] [--json FILE]
//
// Under mpirun one rank per process (else one rank). This file parses the arguments, creates the
// communicator, decides whether times are comparable (one GPU per rank and NCCL) and hands over
// to the operator's entry (tools/bench_common.h): tools/bench/fused_gemm.cu for the GEMM
// collectives, tools/bench/ring_attention.cu for ring attention, tools/bench/moe_dispatch.cu for MoE
// dispatch/combine, tools/bench/collective.cu for the standalone collectives; each checks its
// operator's result, then times it against its baselines.
//
// Failures. Arguments are checked before any collective or GPU work (every rank gets the same
// argv, so every rank fails the same way). Every fused or ring call is followed by a stream
// sync and comm->check(): a device wait that gave up does not fail the launch, the kernel
// finishes, and only the communicator's decoded record ("rank 0 (op ag_gemm, role comm, ...)
// timed out ... on flag 5 from rank 1 ...") says so; a result is read only after that check.
// Every step a rank runs on its own ends in agree(): every rank learns the first failing
// rank's error at the same point and leaves by the same path (operator and communicator
// teardown are collective), so no rank waits in a collective for one that left. When the job
// itself fails (a device wait gave up, the network failed, a rank died or stopped), agree()
// stops waiting (Bootstrap::fail); each rank prints "mkernel bench: rank R: job failed:
// culprit rank C: ..." and exits 1 after a teardown that waits for nobody.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "mkernel/mkernel.h"
#include "mkernel/ops/collective.h"
#include "mkernel/ops/fused.h"
#include "mkernel/ops/ring_attention.h"
#include "tools/bench_common.h"
#include "tools/cli.h"

namespace mk {
namespace cli {
namespace {

struct BenchArgs {
  std::string which, json, trace;
  int64_t m = 0, n = 0, k = 0;
  bench::RunCfg rc;
  std::vector<int64_t> seqs;
  bool causal = true;
  int64_t doc_len = 0;  // --doc-len (ring_attention): packed documents of this many tokens
  bool balanced = false;  // --balanced (ring_attention, with --doc-len): balanced contiguous shards
  bool sweep = false, deterministic = false, splits = false;
  std::string path;  // --path (fused operators)
  std::vector<int64_t> rows;  // --rows r0,r1,...: each rank's shard rows (fused operators)
  int trace_calls = 0;  // --trace-calls (fused operators; 0: not given, 10 consecutive calls)
  std::vector<std::string> presets;  // moe_dispatch, moe_layer (checked against the operator's list after parsing)
  int64_t tokens = 0;
  std::string dtype = "bf16";     // --dtype: bf16 everywhere; fp32 too for the collectives
  std::vector<int64_t> counts;    // --count (collectives; checked against the shape rules after parsing)
  int64_t chunk = 0;              // --chunk (collectives; 0: not given)
  int ctas = 0;                   // --ctas (collectives; 0: not given)
  std::vector<std::string> fused_only, ring_only, moe_only, coll_only;  // options given that apply to one family
};

// Dimensions fit the GEMM's 32-bit extents; counts stay small enough to finish.
constexpr int64_t kMaxDim = 2147483647;
constexpr int64_t kMaxMoeTokens = int64_t(1) << 24;  // MoeConfig::max_tokens_per_rank's limit
constexpr int kMaxReps = 100000;
// Collectives: W x count < 2^40 elements (the operator's rule, checked after parsing with W); a
// chunk of at most 2^32 elements (its plan's); CTAs beyond any GPU's SMs are pointless.
constexpr int64_t kMaxCollCount = int64_t(1) << 40;
constexpr int64_t kMaxCollChunk = int64_t(1) << 32;
constexpr int kMaxCollCtas = 4096;

bool is_collective(const std::string& which) {
  return which == "allgather" || which == "reduce_scatter" || which == "allreduce";
}

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
    } else if (a == "--doc-len") {
      ok = ar.int_value(int64_t(1), kMaxDim, &b->doc_len);
      b->ring_only.push_back(a);
    } else if (a == "--non-causal") {
      ok = ar.no_value();
      b->causal = false;
      b->ring_only.push_back(a);
    } else if (a == "--balanced") {
      ok = ar.no_value();
      b->balanced = true;
      b->ring_only.push_back(a);
    } else if (a == "--preset") {
      std::string p;
      ok = ar.value(&p);
      b->presets.push_back(p);
      b->moe_only.push_back(a);
    } else if (a == "--tokens") {
      ok = ar.int_value(int64_t(1), kMaxMoeTokens, &b->tokens);
      b->moe_only.push_back(a);
    } else if (a == "--trace") {
      ok = ar.value(&b->trace);
    } else if (a == "--trace-calls") {
      ok = ar.int_value(1, 1000, &b->trace_calls);
      b->fused_only.push_back(a);
    } else if (a == "--path") {
      ok = ar.value(&b->path);
      if (ok && b->path != "fused" && b->path != "unfused" && b->path != "auto") {
        *err = "--path '" + b->path + "': fused, unfused or auto";
        return false;
      }
      b->fused_only.push_back(a);
    } else if (a == "--rows") {
      std::string list;
      ok = ar.value(&list);
      size_t at = 0;
      while (ok && at <= list.size()) {
        const size_t comma = std::min(list.find(',', at), list.size());
        const std::string item = list.substr(at, comma - at);
        char* end = nullptr;
        const long long v = item.empty() ? 0 : strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || v < 1 || v > kMaxDim)
          ok = ar.fail("--rows '" + list + "': comma-separated row counts, each 1 to " + std::to_string(kMaxDim));
        else
          b->rows.push_back(v);
        at = comma + 1;
      }
    } else if (a == "--sweep" || a == "--deterministic" || a == "--splits") {
      ok = ar.no_value();
      (a == "--sweep" ? b->sweep : a == "--splits" ? b->splits : b->deterministic) = true;
      b->fused_only.push_back(a);
    } else if (a == "--dtype") {
      ok = ar.value(&b->dtype);  // checked once the operator is known
    } else if (a == "--count") {
      int64_t c = 0;
      ok = ar.int_value(int64_t(1), kMaxCollCount, &c);
      b->counts.push_back(c);
      b->coll_only.push_back(a);
    } else if (a == "--chunk") {
      ok = ar.int_value(int64_t(1), kMaxCollChunk, &b->chunk);
      b->coll_only.push_back(a);
    } else if (a == "--ctas") {
      ok = ar.int_value(1, kMaxCollCtas, &b->ctas);
      b->coll_only.push_back(a);
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
  static const char* kOps[] = {"ag_gemm",   "gemm_rs",   "gemm_ar",        "all",      "ring_attention", "moe_dispatch",
                               "moe_layer", "allgather", "reduce_scatter", "allreduce"};
  if (b->which.empty()) b->which = "all";
  ops::CollectiveKind kind = ops::CollectiveKind::kAllReduce;
  if (ops::parse_collective_kind(b->which, &kind).ok()) b->which = ops::collective_kind_name(kind);  // all_reduce, ...
  if (std::find_if(std::begin(kOps), std::end(kOps), [&](const char* o) { return b->which == o; }) == std::end(kOps)) {
    *err = "unknown operator '" + b->which +
           "' (ag_gemm, gemm_rs, gemm_ar, all, ring_attention, moe_dispatch, moe_layer, allgather, reduce_scatter, "
           "allreduce)";
    return false;
  }
  if (!b->presets.empty()) {
    const std::vector<std::string> known = b->which == "moe_layer" ? bench::moe_layer_presets() : bench::moe_presets();
    for (const std::string& p : b->presets)
      if (std::find(known.begin(), known.end(), p) == known.end()) {
        std::string list;
        for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
        *err = "--preset '" + p + "': unknown for " + b->which + " (" + list + ")";
        return false;
      }
  }
  const bool ring = b->which == "ring_attention";
  const bool moe = b->which == "moe_dispatch" || b->which == "moe_layer";
  const bool coll = is_collective(b->which);
  if (coll && b->dtype != "bf16" && b->dtype != "fp32") {
    *err = "--dtype '" + b->dtype + "': " + b->which + " takes bf16 or fp32";
    return false;
  }
  if (!coll && b->dtype != "bf16") {
    *err = "--dtype '" + b->dtype + "': only bf16 is implemented for " + b->which +
           " (fp32 too for allgather, reduce_scatter, allreduce)";
    return false;
  }
  if (coll && !b->fused_only.empty()) {
    *err = b->fused_only[0] + " does not apply to " + b->which + " (use --count)";
    return false;
  }
  if ((coll || moe) && !b->rows.empty()) {
    *err = "--rows does not apply to " + b->which + " (the fused operators and ring_attention take it)";
    return false;
  }
  if (b->balanced && (!b->doc_len || !b->rows.empty())) {
    *err = b->doc_len ? "--balanced chooses the shards itself: leave out --rows"
                      : "--balanced balances packed documents: give --doc-len";
    return false;
  }
  if (ring && !b->rows.empty()) {
    if (!b->seqs.empty()) {
      *err = "--rows gives each rank's tokens: leave out --seq";
      return false;
    }
    // The shape rules first (W: the launcher's size, else 1; the bench's shape: B1 H32 D128 zigzag).
    int64_t S = 0;
    for (int64_t r : b->rows) S += r;
    const ops::RingAttentionShape shape{1, 32, 32, 128, S, ops::SeqLayout::kZigzag, b->causal, b->rows};
    const Status s = ops::RingAttention::can_implement(shape, std::max(1, launch_size()));
    if (!s.ok()) {
      *err = "--rows: " + s.message();
      return false;
    }
  }
  if (coll && !b->trace.empty()) {
    *err = "--trace does not apply to " + b->which;
    return false;
  }
  if (!coll && !b->coll_only.empty()) {
    *err = b->coll_only[0] + " applies to allgather, reduce_scatter and allreduce only, not to '" + b->which + "'";
    return false;
  }
  if (coll) {
    // The shape rules first, before any GPU is looked for (W: the launcher's size, else 1).
    const ops::CollDType dt = b->dtype == "fp32" ? ops::CollDType::kF32 : ops::CollDType::kBF16;
    for (int64_t c : b->counts) {
      const Status s = ops::Collective::can_implement(kind, c, dt, std::max(1, launch_size()));
      if (!s.ok()) {
        *err = "--count " + std::to_string(c) + ": " + s.message();
        return false;
      }
    }
  }
  if (ring && !b->fused_only.empty()) {
    *err = b->fused_only[0] + " does not apply to ring_attention (use --seq)";
    return false;
  }
  if (moe && !b->fused_only.empty()) {
    *err = b->fused_only[0] + " does not apply to " + b->which + " (use --preset, --tokens)";
    return false;
  }
  if (b->trace_calls && b->trace.empty()) {
    *err = "--trace-calls needs --trace PREFIX";
    return false;
  }
  if (moe && !b->trace.empty()) {
    *err = "--trace does not apply to " + b->which;
    return false;
  }
  if (!moe && !b->moe_only.empty()) {
    *err = b->moe_only[0] + " applies to moe_dispatch and moe_layer only, not to '" + b->which + "'";
    return false;
  }
  if (!ring && !b->rows.empty() && b->sweep) {
    *err = "--rows needs one shape (--m, or none: M is then the rows' sum), not --sweep";
    return false;
  }
  if (!ring && !b->rows.empty() && !b->m) {
    for (int64_t r : b->rows) b->m += r;  // M: the shards' sum
    if (b->m > kMaxDim) {
      *err = "--rows: the rows sum to more than " + std::to_string(kMaxDim);
      return false;
    }
  }
  if (!ring && !moe && !coll && (b->m || b->n || b->k)) {
    // The shape rules first, before any GPU is looked for (a dimension left out is 4096; AG and
    // RS split an M that W does not divide as evenly as it allows, bench_common.h).
    const int W = std::max(1, launch_size());
    const int64_t M = b->m ? b->m : 4096;
    for (ops::FusedKind kind : {ops::FusedKind::kAgGemm, ops::FusedKind::kGemmRs, ops::FusedKind::kGemmAr}) {
      if (b->which != "all" && b->which != ops::fused_kind_name(kind)) continue;
      const ops::PlanShape shape(M, b->n ? b->n : 4096, b->k ? b->k : 4096, bench::fused_shard_rows(kind, M, W, b->rows));
      const Status s = ops::FusedGemm::can_implement(kind, shape, W);
      if (!s.ok()) {
        *err = (b->rows.empty() ? "" : "--rows: ") + s.message();
        return false;
      }
    }
  }
  if (b->sweep && (b->m || b->n || b->k)) {
    *err = "--sweep runs its own shapes: leave out --m, --n and --k";
    return false;
  }
  if (!ring && !b->ring_only.empty()) {
    *err = b->ring_only[0] + " applies to ring_attention only, not to '" + b->which + "'";
    return false;
  }
  return true;
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
        fprintf(stderr, "mkernel bench: needs a GPU per rank (or ranks sharing one under CUDA MPS)\n");
    }
    return 1;
  }
  const int W = comm->world(), me = comm->rank();
  // NCCL needs one GPU per rank: compare only when no two ranks share one.
  std::set<std::string> gpus;
  for (const auto& info : comm->topology().info)
    gpus.insert(std::string(reinterpret_cast<const char*>(info.gpu_uuid), 16));
  const bool own_gpu = int(gpus.size()) == W;
  bool comparable = own_gpu;
#if !MK_HAVE_NCCL
  comparable = false;
#endif
  bench::Env env;
  env.comm = comm.get();
  env.rc = ba.rc;
  env.comparable = comparable;
  env.own_gpu = own_gpu;
  env.json = ba.json;
  int rc = 0;
  if (ba.which == "ring_attention") {
    rc = bench::ring_attention(env, ba.seqs, ba.causal, ba.trace, ba.doc_len, ba.rows, ba.balanced);
  } else if (ba.which == "moe_dispatch") {
    bench::MoeBenchArgs ma;
    ma.presets = ba.presets;
    ma.tokens = ba.tokens;
    ma.rc = ba.rc;
    rc = bench::moe_dispatch(env, ma);
  } else if (is_collective(ba.which)) {
    bench::CollBenchArgs ca;
    (void)ops::parse_collective_kind(ba.which, &ca.kind);  // checked by parse_bench_args
    ca.dtype = ba.dtype == "fp32" ? ops::CollDType::kF32 : ops::CollDType::kBF16;
    ca.counts = ba.counts;
    ca.chunk = ba.chunk;
    ca.ctas = ba.ctas;
    ca.rc = ba.rc;
    rc = bench::collective(env, ca);
  } else if (ba.which == "moe_layer") {
    bench::MoeBenchArgs ma;
    ma.presets = ba.presets;
    ma.tokens = ba.tokens;
    ma.rc = ba.rc;
    rc = bench::moe_layer(env, ma);
  } else {
    bench::FusedBenchOpts fo;
    fo.rc = ba.rc;
    fo.sweep = ba.sweep;
    fo.deterministic = ba.deterministic;
    fo.splits = ba.splits;
    fo.path = ba.path;
    fo.rows = ba.rows;
    fo.trace = ba.trace;
    if (ba.trace_calls) fo.trace_calls = ba.trace_calls;
    rc = bench::fused_gemm(env, ba.which, ba.m, ba.n, ba.k, fo);
  }
  // A failed job: every rank says, in one line, who the culprit was and what this rank saw
  // (Communicator::failure), before tearing down. The teardown then waits for nobody.
  const Status job = comm->failure();
  if (!job.ok()) {
    fprintf(stderr, "mkernel bench: rank %d: %s\n", me, job.to_string().c_str());
    fflush(stderr);
    rc = 1;
  } else if (!bench::first_failure().ok()) {
    // A failure every rank agreed on (it names the rank(s) it came from): each rank says it too.
    fprintf(stderr, "mkernel bench: rank %d: failed: %s\n", me, bench::first_failure().to_string().c_str());
    fflush(stderr);
    rc = 1;
  }
  // Collective teardown: every rank gets here (failures above were agreed across ranks, or the
  // job failed and the teardown's collective steps return at once).
  Status d = comm->destroy();
  if (!d.ok() && job.ok()) {
    fprintf(stderr, "mkernel bench: rank %d: teardown: %s\n", me, d.to_string().c_str());
    rc = 1;
  }
  return rc;
}

}  // namespace cli
}  // namespace mk
