// Ring attention: the ring plan turned into the persistent attention kernel's pairs and a
// communication program (see include/mkernel/ops/ring_attention.h).
#include "mkernel/ops/ring_attention.h"
#include "src/ops/ring_attention/ring_attention_testing.h"
#include "src/ops/ring_attention/ring_attention_plan.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/comm/device_program.h"
#include "mkernel/runtime/communicator.h"
#include "src/attention/fmha_launch.h"
#include "src/comm/session.h"
#include "src/ops/ring_attention/ring_attention_program.h"

namespace mk {
namespace ops {

struct RingState {
  std::unique_ptr<comm::OpSession> session;  // slots, pad, epoch, network; the comm attachment
  RingAttentionShape shape;
  RingAttentionOptions opt;
  RingPlan plan;
  RingProgram program;
  int64_t S_l = 0;          // this rank's tokens (S / W, or shape.rows[rank])
  int64_t slot_rows = 0;    // a K/V slot's rows per batch: the largest rank's tokens
  int comm_ctas = 0;
  // kernel inputs
  attention::FmhaLaunch launch;
  // Compute-only launches (enqueue_compute): every pair from gathered slots, and per step.
  attention::FmhaLaunch gathered;
  std::vector<attention::FmhaLaunch> per_step;
  // Packed documents: the windows of the sequence's S positions (computed per call, doc_windows).
  attention::DocWindow* doc_win = nullptr;
};

namespace {

struct Request {
  int32_t B, H, Hkv, D, layout, causal;
  int64_t S;
  int32_t nrows, pad;
  uint64_t rows_hash;  // RingAttentionShape::rows (comm::counts_hash; 0 and nrows 0 without them)
};

Status check_shape(const RingAttentionShape& s, int W) {
  MK_REQUIRE(W >= 1, Code::kInvalidArgument, "ring_attention: world size %d", W);
  MK_REQUIRE(s.D == 64 || s.D == 128, Code::kInvalidArgument, "ring_attention: head dimension %d (64 or 128)", s.D);
  MK_REQUIRE(s.B >= 1 && s.H >= 1 && s.Hkv >= 1 && s.S >= 1, Code::kInvalidArgument,
             "ring_attention: empty shape B %d H %d Hkv %d S %lld", s.B, s.H, s.Hkv, (long long)s.S);
  MK_REQUIRE(s.H % s.Hkv == 0, Code::kInvalidArgument,
             "ring_attention: %d query heads are not a multiple of %d key/value heads", s.H, s.Hkv);
  MK_REQUIRE(s.S / W <= (int64_t(1) << 30), Code::kInvalidArgument, "ring_attention: %lld tokens per rank",
             (long long)(s.S / W));
  const int nchunks = s.layout == SeqLayout::kZigzag ? 2 * W : W;
  MK_REQUIRE(!s.rows.empty() || s.S % nchunks == 0, Code::kInvalidArgument,
             "ring_attention: a sequence of %lld tokens does not split into %d equal chunks (%s layout over %d "
             "ranks; uneven shards: RingAttentionShape::rows)",
             (long long)s.S, nchunks, s.layout == SeqLayout::kZigzag ? "zigzag" : "contiguous", W);
  return check_ring_rows("ring_attention", s.rows, W, s.S, s.layout);
}

// The kernel's pairs and this rank's communication program.
Status build_program(RingState* st) {
  const RingPlan& p = st->plan;
  const RingAttentionShape& s = st->shape;
  comm::OpSession& ses = *st->session;
  Communicator* c = ses.comm();
  const int W = c->world(), me = c->rank();
  const int64_t S_l = st->S_l;

  // ---- pairs: step by step; the pairs of a query chunk merge in step order ----
  std::vector<attention::FmhaPair> pairs;
  const int nq = int(p.chunks[me].size());
  std::vector<int> total(nq, 0), seen(nq, 0);
  for (const auto& stp : p.steps[me])
    for (const auto& pr : stp.pairs) ++total[pr.q_chunk];
  int64_t longest = 0;  // this rank's longest chunk: the merge counters' stride per chunk
  for (const SeqChunk& c : p.chunks[me]) longest = std::max(longest, c.tokens);
  const int qtiles = int((longest + attention::kTileM - 1) / attention::kTileM);
  const int seq_per_chunk = s.B * s.H * qtiles * 2;
  int items = 0;
  for (int t = 0; t < W; ++t) {
    const RingStep& stp = p.steps[me][t];
    for (const auto& pr : stp.pairs) {
      const SeqChunk& qc = p.chunks[me][pr.q_chunk];
      const SeqChunk& kc = p.chunks[stp.kv_rank][pr.kv_chunk];
      attention::FmhaPair f;
      f.q_row0 = int32_t(qc.row0);
      f.q_len = int32_t(qc.tokens);
      f.q_pos0 = qc.token0;
      f.kv_src = t == 0 ? 0 : 1;
      f.kv_slot = stp.kv_rank;
      f.kv_row0 = int32_t(kc.row0);
      f.kv_len = int32_t(kc.tokens);
      f.kv_pos0 = kc.token0;
      f.causal = pr.mask == BlockMask::kCausal ? 1 : 0;
      f.ordinal = seen[pr.q_chunk]++;
      f.total = total[pr.q_chunk];
      f.seq_base = pr.q_chunk * seq_per_chunk;
      f.wait = t == 0 ? 0 : 1;
      f.item0 = items;
      items += attention::pair_items(f, s.B, s.H);
      pairs.push_back(f);
    }
  }
  attention::FmhaLaunch& l = st->launch;
  l = attention::FmhaLaunch{};
  MK_CHECK(ses.upload(pairs, const_cast<attention::FmhaPair**>(&l.pairs)));
  // Compute-only variants: no waits, K/V from slots the caller filled.
  {
    std::vector<attention::FmhaPair> g = pairs;
    for (auto& f : g) {
      f.kv_src = 1;
      f.wait = 0;
    }
    st->gathered = attention::FmhaLaunch{};
    MK_CHECK(ses.upload(g, const_cast<attention::FmhaPair**>(&st->gathered.pairs)));
    st->gathered.n_pairs = int(g.size());
    st->gathered.n_items = items;
    st->per_step.assign(W, attention::FmhaLaunch{});
    size_t i = 0;
    for (int t = 0; t < W; ++t) {
      std::vector<attention::FmhaPair> ps;
      int it = 0;
      for (size_t n = 0; n < p.steps[me][t].pairs.size(); ++n, ++i) {
        attention::FmhaPair f = g[i];
        f.kv_slot = 0;
        f.item0 = it;
        it += attention::pair_items(f, s.B, s.H);
        ps.push_back(f);
      }
      attention::FmhaLaunch& sl = st->per_step[t];
      MK_CHECK(ses.upload(ps, const_cast<attention::FmhaPair**>(&sl.pairs)));
      sl.n_pairs = int(ps.size());
      sl.n_items = it;
      sl.reset_seq = t == 0;
    }
  }
  l.n_pairs = int(pairs.size());
  l.n_items = items;
  l.slots.k = ses.local(RingBuf::kSlotsK);
  l.slots.v = ses.local(RingBuf::kSlotsV);
  l.slots.slots = W;
  // A slot holds its block's rows, then (a shorter shard's) zeros that no pair reads unmasked.
  l.slots.rows = int(st->slot_rows);
  uint64_t* arrived = nullptr;
  MK_CHECK(ses.region_addr(st->program, RingRegion::kArrived, me, &arrived));
  l.slots.flags = arrived;
  l.slots.chunks = st->program.geo.pieces;
  l.slots.chunk_rows = st->program.geo.chunk_tokens;
  l.slots.wait_mul = 2;  // K and V of a piece
  if (*std::max_element(total.begin(), total.end()) > 1) {  // some query chunk merges several pairs
    void* a = nullptr;
    MK_CHECK(ses.alloc_zeroed(size_t(s.B) * s.H * S_l * s.D * 4, &a));
    l.o_acc = static_cast<float*>(a);
    MK_CHECK(ses.alloc_zeroed(size_t(s.B) * s.H * S_l * 4, &a));
    l.lse_acc = static_cast<float*>(a);
    l.n_seq = nq * seq_per_chunk;
    MK_CHECK(ses.alloc_zeroed(size_t(l.n_seq) * 8, &a));
    l.seq = static_cast<uint64_t*>(a);
  }
  for (attention::FmhaLaunch* v : {&st->gathered}) {
    v->o_acc = l.o_acc, v->lse_acc = l.lse_acc, v->seq = l.seq, v->n_seq = l.n_seq;
    v->program.wait = ses.wait_ctx(Role::kCompute);
  }
  for (auto& v : st->per_step) {
    v.o_acc = l.o_acc, v.lse_acc = l.lse_acc, v.seq = l.seq, v.n_seq = l.n_seq;
    v.program.wait = ses.wait_ctx(Role::kCompute);
  }

  // ---- the communication program: resolved by the session ----
  comm::Resolved r;
  MK_CHECK(ses.resolve(st->program, st->program.ranks[me], &r));
  l.program = r.program;
  if (W == 1) l.program.epoch = nullptr;  // nothing to communicate: no epoch to keep
  l.comm_ctas = l.program.n_ops == 0 ? 0 : st->comm_ctas;
  {
    // The ring's launches take items from a device counter in item order (the dynamic schedule;
    // single calls run the static one). One counter per operator: its calls are stream-ordered.
    void* ctr = nullptr;
    MK_CHECK(ses.alloc_zeroed(sizeof(int), &ctr));
    l.item_counter = static_cast<int*>(ctr);
    st->gathered.item_counter = l.item_counter;
    for (auto& v : st->per_step) v.item_counter = l.item_counter;
  }
  if (s.S <= INT32_MAX) {  // packed documents' windows (cu_seqlens is int32: longer sequences have none)
    void* w = nullptr;
    MK_CHECK(ses.alloc_zeroed(size_t(s.S) * sizeof(attention::DocWindow), &w));
    st->doc_win = static_cast<attention::DocWindow*>(w);
  }
  return OkStatus();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

Status agree_on_ring_shape(Communicator* comm, const RingAttentionShape& shape, const char* what) {
  Request mine{shape.B, shape.H, shape.Hkv, shape.D, int32_t(shape.layout), shape.causal ? 1 : 0, shape.S,
               int32_t(shape.rows.size()), 0, comm::counts_hash(shape.rows)};
  return comm::agree_on_request(comm->bootstrap(), mine, what, [](const Request& r) {
    char b[200];
    snprintf(b, sizeof b, "B %d H %d Hkv %d D %d S %lld layout %d causal %d, %s", r.B, r.H, r.Hkv, r.D, (long long)r.S,
             r.layout, r.causal,
             r.nrows ? ("shard rows given, hash " + std::to_string(r.rows_hash)).c_str() : "even shards");
    return std::string(b);
  });
}

Status RingAttention::can_implement(const RingAttentionShape& shape, int world) { return check_shape(shape, world); }

Status ring_launch_ctas(const RingAttentionOptions& opt, int W, const char* what, int* comm_ctas, int* grid) {
  int64_t cc = opt.comm_ctas;
  if (cc < 0) cc = tunables::ring_comm_ctas();
  *comm_ctas = int(std::max<int64_t>(cc, 1));
  MK_CHECK(attention::fmha_ctas(grid));
  if (opt.max_ctas > 0) *grid = std::min(*grid, opt.max_ctas);
  MK_REQUIRE(W <= 1 || *comm_ctas < *grid, Code::kInvalidArgument,
             "%s: %d communication CTAs leave none of %d CTAs to compute", what, *comm_ctas, *grid);
  return OkStatus();
}

Status RingAttention::create(Communicator* comm, const RingAttentionShape& shape, const RingAttentionOptions& opt,
                             std::unique_ptr<RingAttention>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "ring_attention: null communicator or output");
  const int W = comm->world();
  MK_CHECK(agree_on_ring_shape(comm, shape, "ring_attention"));
  MK_CHECK(can_implement(shape, W));
  std::unique_ptr<RingAttention> op(new RingAttention());
  op->st_ = std::make_unique<RingState>();
  RingState* st = op->st_.get();
  st->shape = shape;
  st->opt = opt;
  MK_CHECK(build_ring_plan(comm::layout_of(comm->topology()), shape.S, shape.layout, shape.causal, &st->plan,
                           shape.rows));
  MK_CHECK(comm::OpSession::create(comm, "ring_attention", opt.staging, &st->session));
  const RingGeometry geo = ring_kv_geometry(shape.B, st->plan.rows, shape.Hkv, shape.D, opt.chunk_tokens);
  st->S_l = st->plan.rows[size_t(comm->rank())];
  st->slot_rows = geo.S_l;
  int grid = 0;
  MK_CHECK(agree(comm->bootstrap(), ring_launch_ctas(opt, W, "ring_attention", &st->comm_ctas, &grid),
                 "ring_attention create"));
  // The program (K/V slots [W][B][largest shard][Hkv][D], the entry token, the flags) for the network's
  // staging mode; the session allocates and starts what it declares.
  MK_CHECK(build_ring_program(st->plan, comm::layout_of(comm->topology()), geo, st->session->staged(), &st->program));
  MK_CHECK(st->session->setup(st->program));
  MK_CHECK(agree(comm->bootstrap(), build_program(st), "ring_attention plan"));
  MK_CHECK(comm->bootstrap().barrier());
  *out = std::move(op);
  return OkStatus();
}

RingAttention::~RingAttention() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "ring_attention: destroy: %s", s.to_string().c_str());
}

Status RingAttention::destroy() {
  RingState* st = st_.get();
  if (!st || !st->session) return OkStatus();
  return st->session->destroy();
}

int RingAttention::comm_ctas() const { return st_->launch.comm_ctas; }
int64_t RingAttention::local_tokens() const { return st_->S_l; }
int RingAttention::work_items() const { return st_->launch.n_items; }
int RingAttention::comm_ops() const { return st_->launch.program.n_ops; }
size_t RingAttention::block_elems() const {
  return size_t(st_->shape.B) * st_->S_l * st_->shape.Hkv * st_->shape.D;
}

// ---- ring_attention_testing.h ----
const RingPlan& RingAttentionTesting::plan(const RingAttention& op) { return op.st_->plan; }
int64_t RingAttentionTesting::slot_rows(const RingAttention& op) { return op.st_->slot_rows; }
const void* RingAttentionTesting::k_slots(const RingAttention& op) {
  return op.st_->session->alive() ? op.st_->session->local(RingBuf::kSlotsK) : nullptr;
}
const void* RingAttentionTesting::v_slots(const RingAttention& op) {
  return op.st_->session->alive() ? op.st_->session->local(RingBuf::kSlotsV) : nullptr;
}

Status RingAttention::can_implement(const RingAttentionArgs& a) const {
  const RingState* st = st_.get();
  MK_REQUIRE(st && st->session && st->session->alive(), Code::kInvalidArgument,
             "ring_attention: the operator was destroyed (or its communicator was destroyed first)");
  MK_REQUIRE(a.q && a.k && a.v && a.o, Code::kInvalidArgument, "ring_attention: null Q, K, V or O");
  MK_REQUIRE(aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.o), Code::kInvalidArgument,
             "ring_attention: Q, K, V and O must be 16-byte aligned");
  const RingAttentionShape& s = st->shape;
  const uint64_t qb = uint64_t(s.B) * st->S_l * s.H * s.D * 2, kb = uint64_t(s.B) * st->S_l * s.Hkv * s.D * 2;
  auto overlaps = [](const void* p, uint64_t pb, const void* q, uint64_t qb2) {
    auto x = reinterpret_cast<uintptr_t>(p), y = reinterpret_cast<uintptr_t>(q);
    return x < y + qb2 && y < x + pb;
  };
  MK_REQUIRE(!overlaps(a.o, qb, a.q, qb) && !overlaps(a.o, qb, a.k, kb) && !overlaps(a.o, qb, a.v, kb),
             Code::kInvalidArgument, "ring_attention: O overlaps Q, K or V");
  return check_ring_documents("ring_attention", s, a.cu_seqlens, a.n_docs);
}

Status check_ring_documents(const char* what, const RingAttentionShape& s, const int32_t* cu, int n_docs) {
  MK_CHECK(attention::check_cu_seqlens(what, cu, n_docs));
  if (!cu) return OkStatus();
  MK_REQUIRE(s.B == 1, Code::kInvalidArgument, "%s: packed documents (cu_seqlens) need B = 1, not %d", what, s.B);
  MK_REQUIRE(s.S <= INT32_MAX, Code::kInvalidArgument,
             "%s: packed documents (int32 cu_seqlens) over a sequence of %lld tokens", what, (long long)s.S);
  return OkStatus();
}

Status RingAttention::run(const RingAttentionArgs& a, cudaStream_t stream) {
  // Local checks (in enqueue); with the debug tunable check_calls the ranks agree on them first.
  if (st_->session) MK_CHECK(st_->session->agree_on_call(can_implement(a), "ring_attention arguments"));
  return enqueue(a, stream);
}

namespace {
attention::ForwardArgs forward_args(const RingState* st, const RingAttentionArgs& a) {
  const RingAttentionShape& s = st->shape;
  attention::ForwardArgs f;
  f.q = a.q, f.k = a.k, f.v = a.v, f.o = a.o, f.lse = a.lse;
  f.B = s.B, f.H = s.H, f.Hkv = s.Hkv, f.D = s.D;
  f.Sq = f.Skv = int(st->S_l);
  f.q_stride = f.o_stride = attention::Strides::bshd(st->S_l, s.H, s.D);
  f.k_stride = f.v_stride = attention::Strides::bshd(st->S_l, s.Hkv, s.D);
  f.scale = st->opt.scale;
  return f;
}

// Packed documents: this call's windows of every position, for the launch.
Status ring_doc_windows(const RingState* st, const RingAttentionArgs& a, cudaStream_t stream,
                        attention::FmhaLaunch* l) {
  if (!a.cu_seqlens) return OkStatus();
  const attention::DocSegment all{0, 0, st->shape.S};
  MK_CHECK(attention::doc_windows(a.cu_seqlens, a.n_docs, int32_t(st->shape.S), &all, 1, st->shape.S, st->doc_win,
                                  stream));
  l->doc_win = st->doc_win;
  return OkStatus();
}
}  // namespace

Status RingAttentionTesting::enqueue_compute(RingAttention& op, const RingAttentionArgs& a, int step,
                                             const void* k_src, const void* v_src, cudaStream_t stream) {
  RingState* st = op.st_.get();
  MK_CHECK(op.can_implement(a));
  MK_REQUIRE(k_src && v_src, Code::kInvalidArgument, "ring_attention: null K/V source");
  MK_REQUIRE(step < st->plan.world, Code::kInvalidArgument, "ring_attention: step %d of %d", step, st->plan.world);
  attention::FmhaLaunch l = step < 0 ? st->gathered : st->per_step[step];
  MK_CHECK(ring_doc_windows(st, a, stream, &l));
  l.slots = st->launch.slots;
  l.slots.k = k_src;
  l.slots.v = v_src;
  l.slots.flags = nullptr;
  if (step >= 0) l.slots.slots = 1;
  attention::RunConfig cfg;
  cfg.max_ctas = st->opt.max_ctas;
  return attention::run_fmha(forward_args(st, a), l, stream, cfg);
}

Status RingAttention::enqueue(const RingAttentionArgs& a, cudaStream_t stream) {
  RingState* st = st_.get();
  MK_CHECK(can_implement(a));
  // A failed communicator runs nothing more (see OpSession::check_call).
  MK_CHECK(st->session->check_call());
  attention::ForwardArgs f = forward_args(st, a);
  attention::FmhaLaunch l = st->launch;
  MK_CHECK(ring_doc_windows(st, a, stream, &l));
  l.program.user[kUserSlotK] = const_cast<void*>(a.k);
  l.program.user[kUserSlotV] = const_cast<void*>(a.v);
  l.trace = a.trace;
  attention::RunConfig cfg;
  cfg.max_ctas = st->opt.max_ctas;
  return attention::run_fmha(f, l, stream, cfg);
}

}  // namespace ops
}  // namespace mk
