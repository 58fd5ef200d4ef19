// Ring attention's backward: the ring plan turned into the persistent backward kernel's pairs
// (src/attention/bwd_launch.h) and a communication program whose dK/dV sums travel the ring
// behind K/V (src/ops/ring_attention/ring_attention_program.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "mkernel/attention/attention.h"
#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/ops/ring_attention.h"
#include "mkernel/runtime/communicator.h"
#include "src/attention/bwd_launch.h"
#include "src/attention/fmha_launch.h"
#include "src/comm/device_program.h"
#include "src/comm/session.h"
#include "src/ops/ring_attention/ring_attention_plan.h"
#include "src/ops/ring_attention/ring_attention_program.h"
#include "src/ops/ring_attention/ring_attention_testing.h"

namespace mk {
namespace ops {

struct RingBwdState {
  std::unique_ptr<comm::OpSession> session;
  RingAttentionShape shape;
  RingAttentionOptions opt;
  RingPlan plan;
  RingProgram program;
  int64_t S_l = 0;        // this rank's tokens (S / W, or shape.rows[rank])
  int64_t slot_rows = 0;  // a K/V slot's rows per batch: the largest rank's tokens
  int chunks = 1, comm_ctas = 0;
  attention::BwdRing ring;
  const attention::BwdRingPair* compute_pairs = nullptr;  // the pairs with no waits, K/V from slots
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int32_t* cu = nullptr;  // this rank's chunks' bounds in its rows {0, chunk 0's rows[, S_l]} (device)
  // Packed documents (computed per call, doc_windows): the windows of the sequence's S positions,
  // and of this rank's query rows in the workspace's virtual rows (qwin_rows of them).
  attention::DocWindow* doc_win = nullptr;
  attention::DocWindow* qwin = nullptr;
  int64_t qwin_rows = 0;
};

namespace {

constexpr int kKeyBlock = 128;  // the backward's key rows per item (kernel/bwd.cuh kBwdBlockN)

// The kernel's pairs: per step, per key chunk of the block this rank holds that some query chunk
// of this rank sees, that chunk against those query chunks.
Status build_pairs(RingBwdState* st, std::vector<attention::BwdRingPair>* out) {
  const RingPlan& p = st->plan;
  const RingAttentionShape& s = st->shape;
  const RingGeometry& g = st->program.geo;
  const int W = p.world, me = st->session->comm()->rank();
  const int block_m = s.D == 64 ? 128 : 64;  // BwdCfg<D>::kBlockM
  int items = 0;
  for (int t = 0; t < W; ++t) {
    const RingStep& stp = p.steps[me][t];
    for (int c = 0; c < st->chunks; ++c) {
      attention::BwdRingPair pr;
      for (const auto& q : stp.pairs) {
        if (q.kv_chunk != c || q.mask == BlockMask::kSkip) continue;
        MK_REQUIRE(pr.nseg < 2, Code::kInternal, "ring_attention backward: more than 2 query chunks see a key chunk");
        const SeqChunk& qc = p.chunks[me][q.q_chunk];
        attention::BwdSeg& sg = pr.seg[pr.nseg++];
        sg.q_row0 = int32_t(qc.row0);
        sg.m_blocks = int32_t((qc.tokens + block_m - 1) / block_m);
        sg.qb0 = sg.q_row0 / block_m + q.q_chunk;  // the workspace's virtual blocks (chunks as documents)
        sg.causal = q.mask == BlockMask::kCausal ? 1 : 0;
        sg.q_pos0 = qc.token0;
      }
      if (pr.nseg == 0) continue;
      const int blk = stp.kv_rank;
      const SeqChunk& kc = p.chunks[blk][c];
      pr.kv_src = t == 0 ? 0 : 1;
      pr.slot = blk;
      pr.kv_row0 = int32_t(kc.row0);
      pr.kv_len = int32_t(kc.tokens);
      pr.kv_pos0 = kc.token0;
      pr.wait = t == 0 ? 0 : 1;
      pr.item0 = items;
      pr.ready0 = int32_t(st->program.dkv_index(blk, 0, c * g.dpieces_per_chunk()));
      pr.tile0 = (int64_t(blk) * s.B * g.kb() + int64_t(c) * g.kb_per_chunk) * s.Hkv;
      // The kernel's items of the pair: B x its key blocks x Hkv (bwd_ring_work).
      items += s.B * g.kbs_of(blk, c) * s.Hkv;
      out->push_back(pr);
    }
  }
  st->ring.n_items = items;
  return OkStatus();
}

Status setup(RingBwdState* st) {
  comm::OpSession& ses = *st->session;
  Communicator* c = ses.comm();
  const int W = c->world(), me = c->rank();
  const RingAttentionShape& s = st->shape;
  const RingGeometry& g = st->program.geo;
  attention::BwdRing& r = st->ring;
  std::vector<attention::BwdRingPair> pairs;
  MK_CHECK(build_pairs(st, &pairs));
  MK_CHECK(ses.upload(pairs, const_cast<attention::BwdRingPair**>(&r.pairs)));
  r.n_pairs = int(pairs.size());
  for (auto& pr : pairs) pr.kv_src = 1, pr.wait = 0;
  MK_CHECK(ses.upload(pairs, const_cast<attention::BwdRingPair**>(&st->compute_pairs)));
  r.slots.k = ses.local(RingBuf::kSlotsK);
  r.slots.v = ses.local(RingBuf::kSlotsV);
  r.slots.slots = W;
  r.slots.rows = int(st->slot_rows);  // a shorter shard's slot: its rows, then zeros never read unmasked
  uint64_t* flags = nullptr;
  MK_CHECK(ses.region_addr(st->program, RingRegion::kArrived, me, &flags));
  r.slots.flags = flags;
  r.slots.chunks = g.pieces;
  r.slots.chunk_rows = g.chunk_tokens;
  r.slots.wait_mul = 2;  // K and V of a piece
  r.part = static_cast<float*>(ses.local(RingBuf::kPart));
  MK_CHECK(ses.region_addr(st->program, RingRegion::kReady, me, &r.ready));
  r.kb = g.kb();
  r.dpieces = g.dpieces();
  r.kb_per_piece = g.kb_per_piece;
  r.kb_per_chunk = g.kb_per_chunk;
  r.chunk_len = int(st->plan.chunks[size_t(me)][0].tokens);
  r.rows = int(st->S_l);
  r.own = reinterpret_cast<const float*>(reinterpret_cast<const char*>(r.part) + uint64_t(me) * g.dkv_block_bytes());
  if (W > 1) {
    // The key blocks of the own block whose sum comes back round the ring (own_sum per piece).
    const RingRank& rk = st->program.ranks[me];
    std::vector<uint8_t> blocks(size_t(g.B) * g.kb(), 0);
    for (int b = 0; b < g.B; ++b)
      for (int dp = 0; dp < g.dpieces(); ++dp)
        for (int k = 0; k < g.dpiece_kbs(me, dp); ++k)
          blocks[size_t(b) * g.kb() + g.dpiece_kb0(dp) + k] = rk.own_sum[size_t(b) * g.dpieces() + dp];
    MK_CHECK(ses.upload(blocks, const_cast<uint8_t**>(&r.own_sum)));
    r.own_acc = reinterpret_cast<const float*>(static_cast<const char*>(ses.local(RingBuf::kAcc)) +
                                               uint64_t(me) * g.dkv_block_bytes());
  }
  comm::Resolved res;
  MK_CHECK(ses.resolve(st->program, st->program.ranks[me], &res));
  r.program = res.program;
  if (W == 1) r.program.epoch = nullptr;  // nothing to communicate: no epoch to keep
  r.comm_ctas = r.program.n_ops == 0 ? 0 : st->comm_ctas;
  void* counter = nullptr;  // the dynamic schedule's (calls of an operator run in stream order)
  MK_CHECK(ses.alloc_zeroed(sizeof(int), &counter));
  r.item_counter = static_cast<int*>(counter);
  // The workspace (dQ accumulator, LSE₂, Dsum over the chunks' virtual query blocks) and the
  // chunks' bounds that map those blocks back to rows.
  st->workspace_bytes = attention::backward_workspace_bytes(s.B, s.H, int(st->S_l), s.D, st->chunks);
  MK_REQUIRE(st->workspace_bytes > 0, Code::kInvalidArgument, "ring_attention backward: %lld tokens per rank",
             (long long)st->S_l);
  MK_CHECK(ses.alloc_zeroed(st->workspace_bytes, &st->workspace));
  std::vector<int32_t> cu{0};
  for (const SeqChunk& ch : st->plan.chunks[size_t(me)]) cu.push_back(int32_t(ch.row0 + ch.tokens));
  MK_CHECK(ses.upload(cu, &st->cu));
  if (s.S <= INT32_MAX) {  // packed documents' windows (cu_seqlens is int32: longer sequences have none)
    const int block_m = s.D == 64 ? 128 : 64;  // BwdCfg<D>::kBlockM
    st->qwin_rows = int64_t(attention::varlen_tiles(int(st->S_l), st->chunks, block_m)) * block_m;
    void* w = nullptr;
    MK_CHECK(ses.alloc_zeroed(size_t(s.S) * sizeof(attention::DocWindow), &w));
    st->doc_win = static_cast<attention::DocWindow*>(w);
    MK_CHECK(ses.alloc_zeroed(size_t(st->qwin_rows) * sizeof(attention::DocWindow), &w));
    st->qwin = static_cast<attention::DocWindow*>(w);
  }
  return OkStatus();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

Status RingAttentionBackward::create(Communicator* comm, const RingAttentionShape& shape,
                                     const RingAttentionOptions& opt, std::unique_ptr<RingAttentionBackward>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "ring_attention backward: null communicator or output");
  const int W = comm->world();
  MK_CHECK(agree_on_ring_shape(comm, shape, "ring_attention_backward"));
  MK_CHECK(RingAttention::can_implement(shape, W));
  std::unique_ptr<RingAttentionBackward> op(new RingAttentionBackward());
  op->st_ = std::make_unique<RingBwdState>();
  RingBwdState* st = op->st_.get();
  st->shape = shape;
  st->opt = opt;
  MK_CHECK(build_ring_plan(comm::layout_of(comm->topology()), shape.S, shape.layout, shape.causal, &st->plan,
                           shape.rows));
  MK_CHECK(comm::OpSession::create(comm, "ring_attention_backward", opt.staging, &st->session));
  st->chunks = shape.layout == SeqLayout::kZigzag ? 2 : 1;
  RingGeometry geo = ring_kv_geometry(shape.B, st->plan.rows, shape.Hkv, shape.D, opt.chunk_tokens);
  st->S_l = st->plan.rows[size_t(comm->rank())];
  st->slot_rows = geo.S_l;
  geo.backward = true;
  geo.hkv = shape.Hkv;
  geo.tile_bytes = uint64_t(2) * kKeyBlock * shape.D * 4;
  geo.chunks = st->chunks;
  // Tiles at the longest chunk's key blocks per chunk; each chunk its own (uneven shards).
  int64_t longest = 0;
  for (const auto& cs : st->plan.chunks)
    for (const SeqChunk& ch : cs) longest = std::max(longest, ch.tokens);
  geo.kb_per_chunk = int((longest + kKeyBlock - 1) / kKeyBlock);
  if (!shape.rows.empty())
    for (const auto& cs : st->plan.chunks)
      for (const SeqChunk& ch : cs) geo.chunk_kbs.push_back(int((ch.tokens + kKeyBlock - 1) / kKeyBlock));
  geo.kb_per_piece = int(std::max<uint64_t>(1, (uint64_t(2) << 20) / (geo.tile_bytes * uint64_t(shape.Hkv))));
  int grid = 0;
  MK_CHECK(agree(comm->bootstrap(), ring_launch_ctas(opt, W, "ring_attention backward", &st->comm_ctas, &grid),
                 "ring_attention_backward create"));
  st->ring.grid = grid;
  MK_CHECK(build_ring_program(st->plan, comm::layout_of(comm->topology()), geo, st->session->staged(), &st->program));
  MK_CHECK(st->session->setup(st->program));
  MK_CHECK(agree(comm->bootstrap(), setup(st), "ring_attention_backward plan"));
  MK_CHECK(comm->bootstrap().barrier());
  *out = std::move(op);
  return OkStatus();
}

RingAttentionBackward::~RingAttentionBackward() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "ring_attention backward: destroy: %s", s.to_string().c_str());
}

Status RingAttentionBackward::destroy() {
  RingBwdState* st = st_.get();
  if (!st || !st->session) return OkStatus();
  return st->session->destroy();
}

int RingAttentionBackward::comm_ctas() const { return st_->ring.comm_ctas; }
int RingAttentionBackward::work_items() const { return st_->ring.n_items; }
int RingAttentionBackward::comm_ops() const { return st_->ring.program.n_ops; }

Status RingAttentionBackward::can_implement(const RingAttentionBackwardArgs& a) const {
  const RingBwdState* st = st_.get();
  MK_REQUIRE(st && st->session && st->session->alive(), Code::kInvalidArgument,
             "ring_attention backward: the operator was destroyed (or its communicator was destroyed first)");
  MK_REQUIRE(a.q && a.k && a.v && a.o && a.dout && a.lse && a.dq && a.dk && a.dv, Code::kInvalidArgument,
             "ring_attention backward: null Q, K, V, O, dO, LSE, dQ, dK or dV");
  const void* ptr[8] = {a.q, a.k, a.v, a.o, a.dout, a.dq, a.dk, a.dv};
  const char* nm[8] = {"Q", "K", "V", "O", "dO", "dQ", "dK", "dV"};
  const RingAttentionShape& s = st->shape;
  const uint64_t qb = uint64_t(s.B) * st->S_l * s.H * s.D * 2, kb = uint64_t(s.B) * st->S_l * s.Hkv * s.D * 2;
  const uint64_t bytes[8] = {qb, kb, kb, qb, qb, qb, kb, kb};
  for (int i = 0; i < 8; ++i)
    MK_REQUIRE(aligned16(ptr[i]), Code::kInvalidArgument, "ring_attention backward: %s must be 16-byte aligned",
               nm[i]);
  auto overlaps = [](const void* p, uint64_t pb, const void* q, uint64_t qb2) {
    auto x = reinterpret_cast<uintptr_t>(p), y = reinterpret_cast<uintptr_t>(q);
    return x < y + qb2 && y < x + pb;
  };
  const uint64_t lse_bytes = uint64_t(s.B) * s.H * st->S_l * 4;
  for (int o = 5; o < 8; ++o) {
    for (int i = 0; i < 8; ++i)
      MK_REQUIRE(i == o || !overlaps(ptr[o], bytes[o], ptr[i], bytes[i]), Code::kInvalidArgument,
                 "ring_attention backward: %s overlaps %s", nm[o], nm[i]);
    MK_REQUIRE(!overlaps(ptr[o], bytes[o], a.lse, lse_bytes), Code::kInvalidArgument,
               "ring_attention backward: %s overlaps the LSE", nm[o]);
  }
  return check_ring_documents("ring_attention backward", s, a.cu_seqlens, a.n_docs);
}

Status RingAttentionBackward::run(const RingAttentionBackwardArgs& a, cudaStream_t stream) {
  if (st_->session) MK_CHECK(st_->session->agree_on_call(can_implement(a), "ring_attention backward arguments"));
  return enqueue(a, stream);
}

namespace {
attention::BackwardArgs backward_args(const RingBwdState* st, const RingAttentionBackwardArgs& a) {
  const RingAttentionShape& s = st->shape;
  attention::BackwardArgs b;
  b.q = a.q, b.k = a.k, b.v = a.v, b.o = a.o, b.dout = a.dout, b.lse = a.lse;
  b.dq = a.dq, b.dk = a.dk, b.dv = a.dv;
  b.B = s.B, b.H = s.H, b.Hkv = s.Hkv, b.D = s.D;
  b.Sq = b.Skv = int(st->S_l);
  b.q_stride = b.o_stride = b.do_stride = b.dq_stride = attention::Strides::bshd(st->S_l, s.H, s.D);
  b.k_stride = b.v_stride = b.dk_stride = b.dv_stride = attention::Strides::bshd(st->S_l, s.Hkv, s.D);
  b.causal = s.causal;
  b.scale = st->opt.scale;
  b.cu_seqlens = st->cu;
  b.n_docs = st->chunks;
  b.workspace = st->workspace;
  b.workspace_bytes = st->workspace_bytes;
  return b;
}

// Packed documents: this call's windows of every position and of this rank's query rows (the
// workspace's virtual rows: chunk c's block m at row (row0 / block_m + c + m) * block_m, row0
// the chunk's first row).
Status ring_doc_windows(const RingBwdState* st, const RingAttentionBackwardArgs& a, cudaStream_t stream,
                        attention::BwdRing* r) {
  if (!a.cu_seqlens) return OkStatus();
  const int32_t S = int32_t(st->shape.S);
  const attention::DocSegment all{0, 0, st->shape.S};
  MK_CHECK(attention::doc_windows(a.cu_seqlens, a.n_docs, S, &all, 1, st->shape.S, st->doc_win, stream));
  const int block_m = st->shape.D == 64 ? 128 : 64;
  const int me = st->session->comm()->rank();
  attention::DocSegment segs[2];
  for (int c = 0; c < st->chunks; ++c) {
    const SeqChunk& ch = st->plan.chunks[size_t(me)][size_t(c)];
    segs[c].out0 = (ch.row0 / block_m + c) * block_m;
    segs[c].pos0 = ch.token0;
    segs[c].len = ch.tokens;
  }
  MK_CHECK(attention::doc_windows(a.cu_seqlens, a.n_docs, S, segs, st->chunks, st->qwin_rows, st->qwin, stream));
  r->doc_win = st->doc_win;
  r->qwin = st->qwin;
  return OkStatus();
}

// A fused call's launch: the operator's ring with this call's K/V and trace. kv_only: the
// communication CTAs run the program's K/V ops alone (RingRank::kv_ops; the leave-one-out timing).
Status enqueue_fused(const RingAttentionBackward& op, const RingBwdState* st, const RingAttentionBackwardArgs& a,
                     bool kv_only, cudaStream_t stream) {
  MK_CHECK(op.can_implement(a));
  MK_CHECK(st->session->check_call());  // a failed communicator runs nothing more
  attention::BwdRing r = st->ring;
  MK_CHECK(ring_doc_windows(st, a, stream, &r));
  r.program.user[kUserSlotK] = const_cast<void*>(a.k);
  r.program.user[kUserSlotV] = const_cast<void*>(a.v);
  if (a.trace) r.trace = *a.trace;
  if (kv_only && !st->program.ranks.empty()) {
    r.program.n_ops = int(st->program.ranks[size_t(st->session->comm()->rank())].kv_ops);
    if (r.program.n_ops == 0) r.comm_ctas = 0;
  }
  return attention::run_ring_backward(backward_args(st, a), r, stream);
}
}  // namespace

Status RingAttentionBackward::enqueue(const RingAttentionBackwardArgs& a, cudaStream_t stream) {
  return enqueue_fused(*this, st_.get(), a, false, stream);
}

Status RingAttentionTesting::enqueue_backward_compute(RingAttentionBackward& op, const RingAttentionBackwardArgs& a,
                                                      const void* k_all, const void* v_all, cudaStream_t stream) {
  RingBwdState* st = op.st_.get();
  MK_CHECK(op.can_implement(a));
  MK_REQUIRE(k_all && v_all, Code::kInvalidArgument, "ring_attention backward: null K/V source");
  attention::BwdRing r = st->ring;
  MK_CHECK(ring_doc_windows(st, a, stream, &r));
  r.pairs = st->compute_pairs;
  r.slots.k = k_all;
  r.slots.v = v_all;
  r.slots.flags = nullptr;
  r.program = comm::DeviceProgram{};
  r.comm_ctas = 0;
  return attention::run_ring_backward(backward_args(st, a), r, stream);
}

Status RingAttentionTesting::enqueue_backward_without_sums(RingAttentionBackward& op,
                                                           const RingAttentionBackwardArgs& a, cudaStream_t stream) {
  return enqueue_fused(op, op.st_.get(), a, true, stream);
}

Status RingAttentionTesting::backward_progress(const RingAttentionBackward& op, std::string* out) {
  const RingBwdState* st = op.st_.get();
  MK_REQUIRE(st && st->session && out, Code::kInvalidArgument, "ring_attention backward: no operator");
  const int me = st->session->comm()->rank();
  const RingProgram& p = st->program;
  EpochState ep{};
  if (st->session->epoch()) MK_CHECK(copy_bounded(&ep, st->session->epoch(), sizeof(ep), 2000, "reading the epoch"));
  int next_op = -1;
  if (st->ring.program.op_counter)
    MK_CHECK(copy_bounded(&next_op, st->ring.program.op_counter, sizeof(int), 2000, "reading the op counter"));
  const uint64_t e = ep.value + 1;  // the call in flight (or the next one)
  char line[256];
  snprintf(line, sizeof(line), "rank %d: epoch %llu (%u of %d CTAs finished the call in flight), next op %d of %d\n", me,
           (unsigned long long)ep.value, ep.arrived, st->ring.grid, next_op, st->ring.program.n_ops);
  *out = line;
  if (p.ranks.empty()) return OkStatus();
  const RingRank& rr = p.ranks[size_t(me)];
  const uint32_t n = uint32_t(rr.ready_count.size());
  for (auto [region, name] : {std::pair<comm::RegionId, const char*>{RingRegion::kReady, "ready"},
                              {RingRegion::kDkvArrived, "dkv_arrived"}}) {
    uint64_t* addr = nullptr;
    MK_CHECK(st->session->region_addr(p, region, me, &addr));
    std::vector<uint64_t> v(n);
    if (n) MK_CHECK(copy_bounded(v.data(), addr, n * sizeof(uint64_t), 2000, "reading the flags"));
    for (uint32_t i = 0; i < n; ++i) {
      const uint64_t want = region == RingRegion::kReady ? rr.ready_count[i] * e : e;
      if (region == RingRegion::kReady && rr.ready_count[i] == 0) continue;
      if (v[i] >= want) continue;
      const int per = p.geo.B * p.geo.dpieces();
      snprintf(line, sizeof(line), "  %s[%u] (block %d batch %d piece %d) = %llu, this call's target %llu\n", name, i,
               int(i) / per, (int(i) % per) / p.geo.dpieces(), int(i) % p.geo.dpieces(), (unsigned long long)v[i],
               (unsigned long long)want);
      *out += line;
    }
  }
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
