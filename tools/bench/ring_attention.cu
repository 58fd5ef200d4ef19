// `mkernel bench ring_attention`: ring attention against an NCCL all-gather + attention and a
// per-step NCCL send/recv ring, and its backward against the same kernel with no communication.
//
// Per sequence length: a correctness check of the fused ring against the same attention kernel
// over the K/V blocks gathered on each rank (bf16 tolerance), then timings — median of --reps
// calls after --warmup calls, CUDA events around each call on the stream — of the fused ring,
// the attention alone over the gathered blocks (T_c), and, when every rank has its own GPU, the
// two NCCL baselines and the K/V all-gather alone (T_x; not at W = 1). --trace writes the
// per-CTA timeline of one traced fused call per rank, forward and backward. --doc-len packs the
// sequence with documents (RingAttentionArgs::cu_seqlens): every call masks by document, and the
// row reports the ranks' work balance (the most visible query-key pairs of a rank over the mean).
// --rows runs uneven shards (RingAttentionShape::rows: each rank's tokens) and then the same
// sequence padded to even shards of the largest one's tokens, and reports uneven / padded;
// --balanced (with --doc-len) runs the contiguous shards that balance the documents' work
// (ops::ring_balanced_rows) and then the even zigzag shards of the same sequence, and reports
// balanced / zigzag (no NCCL baselines on uneven shards: their all-gather takes equal blocks).
//
// Part of the CLI (mkernel_cli), not of the library; the shared helpers are tools/bench_common.h.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/attention/attention.h"
#include "mkernel/common/check.h"
#include "mkernel/device/trace.h"
#include "mkernel/mkernel.h"
#include "mkernel/ops/ring_attention.h"
#include "src/ops/ring_attention/ring_attention_testing.h"
#include "tools/bench_common.h"
#if MK_HAVE_NCCL
#include "tools/baseline/baseline.h"
#endif

namespace mk {
namespace bench {
namespace {

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
  int64_t S_l = 0;            // this rank's tokens
  int64_t S = 0;              // the whole sequence's
  std::vector<int64_t> rows;  // uneven shards (--rows), or empty
  int W = 0, B = 1, H = 32, Hkv = 32, D = 128;
  bool causal = true, zigzag = true, checked = false, correct = false, comparable = false;
  bool pair_first = false;  // compared with the next row (--rows, --balanced)
  unsigned long long bad = 0;
  double fused = 0, compute = 0, allgather = 0, sendrecv = 0, coll = 0, flops = 0;
  // The backward (RingAttentionBackward): fused and compute-only times, dQ checked against the
  // compute-only kernel.
  bool bwd_correct = false;
  unsigned long long bwd_bad = 0;
  double bwd_fused = 0, bwd_compute = 0;
  double bwd_no_sums = 0;  // leave-one-out: the fused call moving K/V only (W > 1)
  // Packed documents (--doc-len): the documents' bounds over the whole sequence (device), and the
  // work balance (the most visible query-key pairs on a rank / the ranks' mean).
  int64_t doc_len = 0;
  const int32_t* cu = nullptr;
  int n_docs = 0;
  double balance = 0;
};

// The bounds of documents of doc_len tokens over S positions (the last shorter).
std::vector<int32_t> doc_bounds(int64_t S, int64_t doc_len) {
  std::vector<int32_t> h;
  for (int64_t p = 0; p < S; p += doc_len) h.push_back(int32_t(p));
  h.push_back(int32_t(S));
  return h;
}

// One traced fused call of a ring operator (forward or backward) on every rank: the per-CTA
// timeline of this rank to <prefix>.s<S/rank>.w<W>.rank<r>.json (tools/trace_png.py draws it;
// uneven and balanced runs: <prefix>.uneven... and <prefix>.balanced...),
// its buffer sized by the call's items and ops.
template <class Op_, class Args_>
Status trace_ring_call(Communicator* comm, cudaStream_t st, Op_& op, Args_ args, const std::string& prefix,
                       int64_t S_l) {
  std::vector<TraceEvent> ev;
  uint64_t dropped = 0;
  const std::string path = prefix + ".s" + std::to_string(S_l) + ".w" + std::to_string(comm->world()) + ".rank" +
                           std::to_string(comm->rank()) + ".json";
  MK_CHECK(traced_call(
      comm, st, uint32_t(64 * (op.work_items() + op.comm_ops()) + 4096), path,
      [&](const TraceBuffer* tb) {
        args.trace = tb;
        return op.enqueue(args, st);
      },
      &ev, &dropped));
  if (comm->rank() == 0)
    printf("trace: %zu events (%llu dropped) -> %s\n", ev.size(), (unsigned long long)dropped, path.c_str());
  return OkStatus();
}

// The backward of the same shape: one checked call (dQ against the same kernel with no
// communication over the gathered K/V; the GPU tests check dK and dV), then the fused call and
// the compute-only kernel timed, and last (it leaves the sums' flags behind) the fused call
// without its dK/dV sums: fused - without sums is what the sums cost.
Status bench_ring_backward(Communicator* comm, ops::RingAttention* op, ops::RingAttentionBackward* bwd, RingRow* r,
                           const RunCfg& rc, const ops::RingAttentionArgs& fa, const void* k_all, const void* v_all,
                           const std::string& trace) {
  const int me = comm->rank();
  cudaStream_t st = comm->stream();
  const size_t qe = size_t(r->B) * r->S_l * r->H * r->D, ke = op->block_elems();
  Buf lse, dout, dq, dq_ref, dk, dv, bad;
  Status s = [&]() -> Status {
    for (Buf* b : {&dout, &dq, &dq_ref}) MK_CHECK(CLI_CUDA(comm, b->alloc(qe * 2)));
    for (Buf* b : {&dk, &dv}) MK_CHECK(CLI_CUDA(comm, b->alloc(ke * 2)));
    MK_CHECK(CLI_CUDA(comm, lse.alloc(size_t(r->B) * r->H * r->S_l * 4)));
    MK_CHECK(CLI_CUDA(comm, bad.alloc(sizeof(unsigned long long))));
    fill_block<<<264, 256, 0, st>>>(dout.bf(), int64_t(qe), 0x3000 + me);
    MK_CHECK(CLI_CUDA(comm, cudaGetLastError()));
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(dq.p, 0xff, qe * 2, st)));  // poison
    return synced(comm, st);
  }();
  MK_CHECK(agreed(comm, s, "preparing the backward's inputs"));
  ops::RingAttentionArgs f = fa;
  f.lse = static_cast<float*>(lse.p);
  s = decoded(comm, op->run(f, st));  // O and LSE of these inputs
  if (s.ok()) s = synced(comm, st);
  ops::RingAttentionBackwardArgs b{f.q, f.k, f.v, f.o, dout.p, f.lse, dq.p, dk.p, dv.p};
  b.cu_seqlens = r->cu, b.n_docs = r->n_docs;
  if (s.ok()) s = decoded(comm, bwd->run(b, st));
  if (s.ok()) s = synced(comm, st);
  ops::RingAttentionBackwardArgs br = b;
  br.dq = dq_ref.p;
  if (s.ok()) s = decoded(comm, ops::RingAttentionTesting::enqueue_backward_compute(*bwd, br, k_all, v_all, st));
  if (s.ok()) s = synced(comm, st);
  unsigned long long* d_bad = static_cast<unsigned long long*>(bad.p);
  MK_CHECK(count_world(
      comm, st, s, d_bad, [&] { count_far<<<264, 256, 0, st>>>(dq.bf(), dq_ref.bf(), int64_t(qe), d_bad); },
      "the checked backward call", &r->bwd_bad));
  r->bwd_correct = r->bwd_bad == 0;
  if (!r->bwd_correct) return OkStatus();
  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing the fused backward", [&] { return bwd->enqueue(b, st); }, &t));
  r->bwd_fused = t.median_ms;
  MK_CHECK(time_it(comm, st, rc, "timing the backward alone", [&] {
    return ops::RingAttentionTesting::enqueue_backward_compute(*bwd, b, k_all, v_all, st); }, &t));
  r->bwd_compute = t.median_ms;
  if (!trace.empty()) MK_CHECK(trace_ring_call(comm, st, *bwd, b, trace + ".bwd", r->S_l));
  if (comm->world() > 1) {
    MK_CHECK(time_it(comm, st, rc, "timing the fused backward without its sums", [&] {
      return ops::RingAttentionTesting::enqueue_backward_without_sums(*bwd, b, st); }, &t));
    r->bwd_no_sums = t.median_ms;
  }
  return OkStatus();
}

Status bench_ring_body(Communicator* comm, ops::RingAttention* op, ops::RingAttentionBackward* bwd, RingRow* r,
                       const RunCfg& rc, const std::string& trace) {
  const int W = comm->world(), me = comm->rank();
  cudaStream_t st = comm->stream();
  // ke: one slot of the gathered K/V (uneven shards: the largest block's size; a rank's block
  // fills its first rows, the rest is masked).
  const size_t qe = size_t(r->B) * r->S_l * r->H * r->D;
  const size_t ke = size_t(r->B) * ops::RingAttentionTesting::slot_rows(*op) * r->Hkv * r->D;
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
  a.cu_seqlens = r->cu, a.n_docs = r->n_docs;

  // Correctness: the fused ring (run, synchronize, comm->check()) against the same kernel over
  // the blocks gathered here; O is read only after the check.
  s = decoded(comm, op->run(a, st));
  if (s.ok()) s = synced(comm, st);
  ops::RingAttentionArgs ar = a;
  ar.o = o_ref.p;
  if (s.ok()) s = decoded(comm, ops::RingAttentionTesting::enqueue_compute(*op, ar, -1, k_all.p, v_all.p, st));
  if (s.ok()) s = synced(comm, st);
  unsigned long long* d_bad = static_cast<unsigned long long*>(bad.p);
  MK_CHECK(count_world(
      comm, st, s, d_bad, [&] { count_far<<<264, 256, 0, st>>>(o.bf(), o_ref.bf(), int64_t(qe), d_bad); },
      "the checked call", &r->bad));
  r->checked = true;
  r->correct = r->bad == 0;
  if (!r->correct) return OkStatus();

  // Per rank: its queries against the whole sequence (causal: the visible half on average);
  // packed documents: the ranks' mean of the visible pairs (4 D flops per pair and head).
  r->flops = attention::forward_flops(r->B, r->H, int(r->S_l), int(r->S), r->D, r->causal);
  if (r->doc_len > 0) {
    const std::vector<double> w =
        ops::ring_doc_work(ops::RingAttentionTesting::plan(*op), doc_bounds(r->S, r->doc_len), r->causal);
    double sum = 0, most = 0;
    for (double x : w) sum += x, most = std::max(most, x);
    r->flops = 4.0 * r->B * r->H * r->D * sum / W;
    r->balance = most / (sum / W);
  }
  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing the fused call", [&] { return op->enqueue(a, st); }, &t));
  r->fused = t.median_ms;
  MK_CHECK(time_it(comm, st, rc, "timing the attention alone",
                   [&] { return ops::RingAttentionTesting::enqueue_compute(*op, a, -1, k_all.p, v_all.p, st); }, &t));
  r->compute = t.median_ms;
  if (!trace.empty()) MK_CHECK(trace_ring_call(comm, st, *op, a, trace, r->S_l));
  MK_CHECK(bench_ring_backward(comm, op, bwd, r, rc, a, k_all.p, v_all.p, trace));
#if MK_HAVE_NCCL
  if (r->comparable && r->rows.empty()) {
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
  Buf cu;
  if (r->doc_len > 0) {  // documents of doc_len tokens over the whole sequence, the last shorter
    const int64_t S = r->S;
    const std::vector<int32_t> h = doc_bounds(S, r->doc_len);
    const Status s = [&]() -> Status {
      MK_REQUIRE(S <= INT32_MAX, Code::kInvalidArgument, "--doc-len: a sequence of %lld tokens", (long long)S);
      MK_CHECK(CLI_CUDA(comm, cu.alloc(h.size() * 4)));
      return CLI_CUDA(comm, cudaMemcpy(cu.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }();
    MK_CHECK(agreed(comm, s, "uploading the documents' bounds"));
    r->cu = static_cast<const int32_t*>(cu.p);
    r->n_docs = int(h.size()) - 1;
  }
  ops::RingAttentionShape sh{r->B, r->H, r->Hkv, r->D, r->S,
                             r->zigzag ? ops::SeqLayout::kZigzag : ops::SeqLayout::kContiguous, r->causal, r->rows};
  std::unique_ptr<ops::RingAttention> op;
  MK_CHECK(ops::RingAttention::create(comm, sh, {}, &op));  // collective: a bad shape fails every rank
  std::unique_ptr<ops::RingAttentionBackward> bwd;
  Status s = ops::RingAttentionBackward::create(comm, sh, {}, &bwd);
  if (s.ok()) s = bench_ring_body(comm, op.get(), bwd.get(), r, rc, trace);
  const Status d = op->destroy();
  const Status db = bwd ? bwd->destroy() : OkStatus();
  return !s.ok() ? s : !d.ok() ? d : db;
}

// paired: the run this one is compared with (--rows: the same sequence padded to even shards;
// --balanced: on even zigzag shards); JSON paired_*.
std::string ring_json(const RingRow& r, const RingRow* paired = nullptr) {
  std::string rows = "[";
  for (size_t i = 0; i < r.rows.size(); ++i) rows += (i ? ", " : "") + std::to_string(r.rows[i]);
  rows += "]";
  char b[2048];
  snprintf(b, sizeof b,
           "{\"op\": \"ring_attention\", \"B\": %d, \"H\": %d, \"Hkv\": %d, \"D\": %d, \"seq_per_rank\": %lld, "
           "\"world\": %d, \"causal\": %s, \"layout\": \"%s\", \"correct\": %s, \"mismatches\": %llu, "
           "\"comparable\": %s, \"fused_ms\": %s, \"compute_only_ms\": %s, \"allgather_then_attention_ms\": %s, "
           "\"sendrecv_ring_ms\": %s, \"nccl_allgather_kv_ms\": %s, \"fused_tflops_per_rank\": %s, "
           "\"speedup_vs_allgather\": %s, \"speedup_vs_sendrecv\": %s, \"overlap_efficiency\": %s, "
           "\"backward_dq_mismatches\": %llu, \"backward_fused_ms\": %s, \"backward_compute_only_ms\": %s, "
           "\"backward_without_sums_ms\": %s, \"fwd_bwd_fused_over_compute\": %s, \"doc_len\": %lld, "
           "\"work_max_over_mean\": %s, \"seq\": %lld, \"shard_rows\": %s, \"paired_seq_per_rank\": %lld, "
           "\"paired_fused_ms\": %s, \"paired_backward_fused_ms\": %s, \"fwd_bwd_over_paired\": %s}",
           r.B, r.H, r.Hkv, r.D, (long long)r.S_l, r.W, r.causal ? "true" : "false", r.zigzag ? "zigzag" : "contiguous",
           r.correct ? "true" : "false", r.bad, r.comparable ? "true" : "false", jnum(r.fused, 4).c_str(),
           jnum(r.compute, 4).c_str(), jnum(r.allgather, 4).c_str(), jnum(r.sendrecv, 4).c_str(),
           jnum(r.coll, 4).c_str(), jnum(r.fused > 0 ? r.flops / (r.fused * 1e-3) / 1e12 : 0, 1).c_str(),
           jnum(ratio(r.allgather, r.fused), 3).c_str(), jnum(ratio(r.sendrecv, r.fused), 3).c_str(),
           eff_json(overlap_eff(r.W, r.compute, r.coll, r.fused)).c_str(), r.bwd_bad, jnum(r.bwd_fused, 4).c_str(),
           jnum(r.bwd_compute, 4).c_str(), jnum(r.bwd_no_sums, 4).c_str(),
           jnum(ratio(r.fused + r.bwd_fused, r.compute + r.bwd_compute), 3).c_str(), (long long)r.doc_len,
           jnum(r.balance, 3).c_str(), (long long)r.S, rows.c_str(), (long long)(paired ? paired->S_l : 0),
           jnum(paired ? paired->fused : 0, 4).c_str(), jnum(paired ? paired->bwd_fused : 0, 4).c_str(),
           jnum(paired ? ratio(r.fused + r.bwd_fused, paired->fused + paired->bwd_fused) : 0, 3).c_str());
  return b;
}

}  // namespace

int ring_attention(const Env& env, std::vector<int64_t> seqs, bool causal, const std::string& trace,
                   int64_t doc_len, const std::vector<int64_t>& shard_rows, bool balanced) {
  Communicator* comm = env.comm;
  const RunCfg& rc = env.rc;
  const bool comparable = env.comparable;
  const std::string& json = env.json;
  const int W = comm->world(), me = comm->rank();
  if (!shard_rows.empty() && int(shard_rows.size()) != W) {
    if (me == 0)
      fprintf(stderr, "mkernel bench ring_attention: --rows gives %zu counts for %d ranks (one per rank)\n",
              shard_rows.size(), W);
    return 2;
  }
  // Runs: each --seq on even zigzag shards; or the uneven shards, then the same sequence padded
  // to even shards of the largest one's tokens; or (--balanced) per --seq the balanced contiguous
  // shards, then the even zigzag ones. Pairs compare their first run with their second.
  struct Run {
    int64_t S_l;
    std::vector<int64_t> rows;
    bool zigzag;
    bool pair_first;
  };
  std::vector<Run> runs;
  if (seqs.empty()) seqs = {4096, 8192};
  if (!shard_rows.empty()) {
    runs.push_back({shard_rows[size_t(me)], shard_rows, true, true});
    runs.push_back({*std::max_element(shard_rows.begin(), shard_rows.end()), {}, true, false});
  } else if (balanced) {
    for (int64_t S_l : seqs) {
      const std::vector<int32_t> cu = doc_bounds(S_l * W, doc_len);
      std::vector<int64_t> rows;
      const Status s = ops::ring_balanced_rows(cu.data(), int(cu.size()) - 1, W, causal, &rows);
      if (!s.ok()) {
        if (me == 0) fprintf(stderr, "mkernel bench ring_attention --balanced: %s\n", s.to_string().c_str());
        return 2;
      }
      runs.push_back({rows[size_t(me)], rows, false, true});
      runs.push_back({S_l, {}, true, false});
    }
  } else {
    for (int64_t S_l : seqs) runs.push_back({S_l, {}, true, false});
  }
  const char* pair_name = balanced ? "balanced contiguous / even zigzag" : "uneven / padded even";
  if (me == 0) {
    printf("ring_attention: B1 H32 D128 bf16, %s, zigzag, %d rank(s), %d node(s)%s%s; %s%s\n",
           causal ? "causal" : "non-causal", W, comm->topology().num_nodes,
           doc_len > 0 ? (", packed documents of " + std::to_string(doc_len) + " tokens").c_str() : "",
           !shard_rows.empty() ? ", uneven shards (then padded to even ones)"
                               : balanced ? ", balanced contiguous shards (then even zigzag ones)" : "",
           comparable ? "one GPU per rank: vs NCCL all-gather + attention and a per-step NCCL send/recv ring"
                      : "ranks share a GPU (or no NCCL): correctness and fused times only, NOT comparable",
           W == 1 ? "; W = 1: nothing to overlap" : "");
    printf("%8s %3s  %-6s %9s %8s %9s %9s %9s %9s %7s %7s %7s\n", "S/rank", "W", "check", "fused_ms", "TFLOP/s",
           "comp_ms", "ag_ms", "ring_ms", "nccl_ms", "vs_ag", "vs_ring", "overlap");
  }
  std::vector<RingRow> done;
  std::vector<CheckLine> checks;
  bool failed = false;
  for (const Run& run : runs) {
    RingRow r;
    r.S_l = run.S_l, r.rows = run.rows, r.W = W, r.causal = causal, r.comparable = comparable, r.doc_len = doc_len;
    r.zigzag = run.zigzag;
    r.S = 0;
    for (int64_t x : run.rows) r.S += x;
    if (run.rows.empty()) r.S = run.S_l * W;
    CheckLine c;
    c.label = "ring_attention S/rank " + std::to_string(run.S_l) +
              (run.rows.empty() ? "" : run.zigzag ? " (uneven shards)" : " (balanced contiguous shards)") + " W " +
              std::to_string(W);
    // Uneven and balanced runs trace under their own names: a rank's S/rank alone would let the
    // padded or even run that follows overwrite them.
    const std::string run_trace =
        trace.empty() || run.rows.empty() ? trace : trace + (run.zigzag ? ".uneven" : ".balanced");
    Status s = bench_ring_one(comm, &r, rc, run_trace);
    c.done = r.checked, c.ok = r.correct && (r.bwd_correct || !s.ok()), c.bad = r.bad + r.bwd_bad;
    if (!s.ok()) {
      c.error = s.to_string();
      note_failure(s);
      if (me == 0) fprintf(stderr, "bench ring_attention S/rank %lld: %s\n", (long long)run.S_l, c.error.c_str());
    }
    checks.push_back(c);
    if (s.ok() && r.correct && r.bwd_correct) {
      r.pair_first = run.pair_first;
      done.push_back(r);
      if (me == 0) {
        printf("%8lld %3d  %-6s %9s %8s %9s %9s %9s %9s %7s %7s %7s%s%s\n", (long long)r.S_l, W, "ok",
               cell(r.fused, 3).c_str(), cell(r.fused > 0 ? r.flops / (r.fused * 1e-3) / 1e12 : 0, 1).c_str(),
               cell(r.compute, 3).c_str(), cell(r.allgather, 3).c_str(), cell(r.sendrecv, 3).c_str(),
               cell(r.coll, 3).c_str(), cell(ratio(r.allgather, r.fused), 2).c_str(),
               cell(ratio(r.sendrecv, r.fused), 2).c_str(),
               eff_cell(overlap_eff(W, r.compute, r.coll, r.fused)).c_str(),
               comparable ? "" : "  (not comparable)",
               !run.rows.empty() ? (run.zigzag ? "  (uneven shards; rank 0's tokens)" : "  (balanced contiguous; rank 0's tokens)")
                                 : !shard_rows.empty() ? "  (padded even)" : balanced ? "  (even zigzag)" : "");
        printf("%8s %3s  backward: fused %s ms (without its sums %s), compute-only %s ms; forward+backward fused / "
               "compute-only %s\n", "", "", cell(r.bwd_fused, 3).c_str(), cell(r.bwd_no_sums, 3).c_str(),
               cell(r.bwd_compute, 3).c_str(), cell(ratio(r.fused + r.bwd_fused, r.compute + r.bwd_compute), 3).c_str());
        if (doc_len > 0) printf("%8s %3s  documents of %lld tokens: work of the busiest rank / the mean %s\n", "", "",
                                (long long)doc_len, cell(r.balance, 3).c_str());
        fflush(stdout);
      }
    } else if (me == 0 && r.checked && (!r.correct || !r.bwd_correct)) {
      printf("%8lld %3d  %-6s (%llu forward, %llu backward dQ mismatches)\n", (long long)r.S_l, W, "WRONG", r.bad,
             r.bwd_bad);
    }
    if (!s.ok() && communicator_failed(comm)) break;
  }
  std::vector<std::string> rows;
  for (size_t i = 0; i < done.size(); ++i) {
    const bool pair = done[i].pair_first && i + 1 < done.size() && !done[i + 1].pair_first;
    if (pair && me == 0)
      printf("%s (S/rank %lld): forward %s, backward %s, forward+backward %s\n", pair_name,
             (long long)done[i + 1].S_l, cell(ratio(done[i].fused, done[i + 1].fused), 3).c_str(),
             cell(ratio(done[i].bwd_fused, done[i + 1].bwd_fused), 3).c_str(),
             cell(ratio(done[i].fused + done[i].bwd_fused, done[i + 1].fused + done[i + 1].bwd_fused), 3).c_str());
    rows.push_back(ring_json(done[i], pair ? &done[i + 1] : nullptr));
  }
  if (me == 0 && !json.empty() && !write_json(json, W, comm->topology().num_nodes, comparable, rows)) failed = true;
  return summarize(comm, checks, "within bf16 tolerance of the same kernel over the gathered K/V", failed);
}

}  // namespace bench
}  // namespace mk
