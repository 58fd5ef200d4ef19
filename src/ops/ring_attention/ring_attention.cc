// Ring attention: the ring plan turned into the persistent attention kernel's pairs and a
// communication program (see include/mkernel/ops/ring_attention.h).
#include "mkernel/ops/ring_attention.h"
#include "src/ops/ring_attention/ring_plan.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/comm/device_program.h"
#include "mkernel/runtime/communicator.h"
#include "src/attention/fmha_launch.h"
#include "src/comm/net_session.h"

namespace mk {
namespace ops {

struct RingState : CommAttachment {
  RingAttention* owner = nullptr;
  void on_communicator_destroy() override;
  bool attached = false;
  Communicator* comm = nullptr;
  RingAttentionShape shape;
  RingAttentionOptions opt;
  RingPlan plan;
  int64_t S_l = 0;          // tokens per rank
  int64_t chunk_len = 0;    // tokens per sequence chunk (S_l, or S_l / 2 for zigzag)
  int chunk_tokens = 0;     // tokens per forwarded piece
  int pieces = 0;           // forwarded pieces per (slot, batch)
  int comm_ctas = 0;
  SymmetricBuffer* k_slots = nullptr;
  SymmetricBuffer* v_slots = nullptr;
  SymmetricBuffer* token = nullptr;
  SymmetricBuffer* pad = nullptr;
  EpochState* epoch = nullptr;
  uint32_t flag_entry = 0, flag_srcfree = 0, n_flags = 0;
  // network (several nodes only): windows over the slots (direct) or their pinned host
  // mirrors (staged); the proxy's flags (same indices as the pad) in host memory
  std::unique_ptr<NetSession> net;
  void *k_net = nullptr, *v_net = nullptr, *token_net = nullptr;  // staged: host mirrors
  uint32_t win_k = 0, win_v = 0, win_token = 0;
  // kernel inputs
  std::vector<void*> dev_allocs;
  attention::FmhaLaunch launch;
  // Compute-only launches (enqueue_compute): every pair from gathered slots, and per step.
  attention::FmhaLaunch gathered;
  std::vector<attention::FmhaLaunch> per_step;
  bool destroyed = false;
};

namespace {

uint32_t ring_tag() {
  static const uint32_t tag = op_tag_register("ring_attention");
  return tag;
}

struct Request {
  int32_t B, H, Hkv, D, layout, causal;
  int64_t S;
};

template <class T>
Status upload(RingState* st, const std::vector<T>& v, T** out) {
  *out = nullptr;
  if (v.empty()) return OkStatus();
  void* p = nullptr;
  MK_CUDA_CHECK(cudaMalloc(&p, v.size() * sizeof(T)));
  st->dev_allocs.push_back(p);
  MK_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  *out = static_cast<T*>(p);
  return OkStatus();
}

Status dev_alloc(RingState* st, size_t bytes, void** out) {
  MK_CUDA_CHECK(cudaMalloc(out, bytes));
  st->dev_allocs.push_back(*out);
  return OkStatus();
}

PlanLayout layout_of(const Topology& t) {
  PlanLayout l;
  l.world = t.world;
  l.node_of = t.node_of;
  l.local_of = t.local_rank_of;
  l.node_ranks = t.node_ranks;
  return l;
}

Status check_shape(const RingAttentionShape& s, int W) {
  MK_REQUIRE(s.D == 64 || s.D == 128, Code::kInvalidArgument, "ring_attention: head dimension %d (64 or 128)", s.D);
  MK_REQUIRE(s.B >= 1 && s.H >= 1 && s.Hkv >= 1 && s.S >= 1, Code::kInvalidArgument,
             "ring_attention: empty shape B %d H %d Hkv %d S %lld", s.B, s.H, s.Hkv, (long long)s.S);
  MK_REQUIRE(s.H % s.Hkv == 0, Code::kInvalidArgument,
             "ring_attention: %d query heads are not a multiple of %d key/value heads", s.H, s.Hkv);
  MK_REQUIRE(s.S / W <= (int64_t(1) << 30), Code::kInvalidArgument, "ring_attention: %lld tokens per rank",
             (long long)(s.S / W));
  return OkStatus();
}

Status start_network(RingState* st) {
  Communicator* c = st->comm;
  MK_CHECK(NetSession::create(c, st->opt.staging, st->n_flags, &st->net));
  if (st->net->staged()) {
    MK_CHECK(st->net->add_host_window(st->k_slots->size(), &st->k_net, &st->win_k));
    MK_CHECK(st->net->add_host_window(st->v_slots->size(), &st->v_net, &st->win_v));
    MK_CHECK(st->net->add_host_window(st->token->size(), &st->token_net, &st->win_token));
  } else {
    MK_CHECK(st->net->add_gpu_window(st->k_slots->local(), st->k_slots->size(), &st->win_k));
    MK_CHECK(st->net->add_gpu_window(st->v_slots->local(), st->v_slots->size(), &st->win_v));
    MK_CHECK(st->net->add_gpu_window(st->token->local(), st->token->size(), &st->win_token));
  }
  return st->net->start();
}

// The kernel's pairs and this rank's communication program.
Status build_program(RingState* st) {
  const RingPlan& p = st->plan;
  const RingAttentionShape& s = st->shape;
  Communicator* c = st->comm;
  const int W = c->world(), me = c->rank();
  const Topology& topo = c->topology();
  const int64_t S_l = st->S_l, len = st->chunk_len;
  const int64_t row_bytes = int64_t(s.Hkv) * s.D * 2;
  const int64_t slot_bytes = int64_t(s.B) * S_l * row_bytes;
  const int pieces = st->pieces;
  auto flag_arrived = [&](int slot, int b, int piece) { return uint32_t((slot * s.B + b) * pieces + piece); };

  // ---- pairs: step by step; the pairs of a query chunk merge in step order ----
  std::vector<attention::FmhaPair> pairs;
  const int nq = int(p.chunks[me].size());
  std::vector<int> total(nq, 0), seen(nq, 0);
  for (const auto& stp : p.steps[me])
    for (const auto& pr : stp.pairs) ++total[pr.q_chunk];
  const int qtiles = int((len + attention::kTileM - 1) / attention::kTileM);
  const int seq_per_chunk = s.B * s.H * qtiles * 2;
  int items = 0;
  for (int t = 0; t < W; ++t) {
    const RingStep& stp = p.steps[me][t];
    for (const auto& pr : stp.pairs) {
      attention::FmhaPair f;
      f.q_row0 = int32_t(pr.q_chunk * len);
      f.q_len = int32_t(len);
      f.q_pos0 = p.chunks[me][pr.q_chunk].token0;
      f.kv_src = t == 0 ? 0 : 1;
      f.kv_slot = stp.kv_rank;
      f.kv_row0 = int32_t(pr.kv_chunk * len);
      f.kv_len = int32_t(len);
      f.kv_pos0 = p.chunks[stp.kv_rank][pr.kv_chunk].token0;
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
  MK_CHECK(upload(st, pairs, const_cast<attention::FmhaPair**>(&l.pairs)));
  // Compute-only variants: no waits, K/V from slots the caller filled.
  {
    std::vector<attention::FmhaPair> g = pairs;
    for (auto& f : g) {
      f.kv_src = 1;
      f.wait = 0;
    }
    st->gathered = attention::FmhaLaunch{};
    MK_CHECK(upload(st, g, const_cast<attention::FmhaPair**>(&st->gathered.pairs)));
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
      MK_CHECK(upload(st, ps, const_cast<attention::FmhaPair**>(&sl.pairs)));
      sl.n_pairs = int(ps.size());
      sl.n_items = it;
      sl.reset_seq = t == 0;
    }
  }
  l.n_pairs = int(pairs.size());
  l.n_items = items;
  l.slots.k = st->k_slots->local();
  l.slots.v = st->v_slots->local();
  l.slots.slots = W;
  l.slots.rows = int(S_l);
  l.slots.flags = static_cast<const uint64_t*>(st->pad->local());
  l.slots.chunks = pieces;
  l.slots.chunk_rows = st->chunk_tokens;
  l.slots.wait_mul = 2;  // K and V of a piece
  if (*std::max_element(total.begin(), total.end()) > 1) {  // some query chunk merges several pairs
    void* a = nullptr;
    MK_CHECK(dev_alloc(st, size_t(s.B) * s.H * S_l * s.D * 4, &a));
    l.o_acc = static_cast<float*>(a);
    MK_CHECK(dev_alloc(st, size_t(s.B) * s.H * S_l * 4, &a));
    l.lse_acc = static_cast<float*>(a);
    l.n_seq = nq * seq_per_chunk;
    MK_CHECK(dev_alloc(st, size_t(l.n_seq) * 8, &a));
    l.seq = static_cast<uint64_t*>(a);
  }
  for (attention::FmhaLaunch* v : {&st->gathered}) {
    v->o_acc = l.o_acc, v->lse_acc = l.lse_acc, v->seq = l.seq, v->n_seq = l.n_seq;
    v->hooks.wait = c->wait_ctx(ring_tag(), Role::kCompute);
  }
  for (auto& v : st->per_step) {
    v.o_acc = l.o_acc, v.lse_acc = l.lse_acc, v.seq = l.seq, v.n_seq = l.n_seq;
    v.hooks.wait = c->wait_ctx(ring_tag(), Role::kCompute);
  }

  // ---- the communication program ----
  std::vector<DevOp> ops;
  std::vector<DevWait> waits;
  std::vector<DevSignal> sigs;
  std::vector<uint64_t> ptrs;
  auto flag_ptr = [&](int rank, uint32_t index, uint64_t** out) -> Status {
    void* base = st->pad->peer(rank);
    MK_REQUIRE(base, Code::kInternal, "ring_attention: the signal pad of rank %d is not mapped here", rank);
    *out = static_cast<uint64_t*>(base) + index;
    return OkStatus();
  };
  // Waits on a flag of this rank: in the device pad, or (net) in the pad the proxy raises.
  auto add_wait = [&](DevOp& op, uint32_t index, uint64_t mul, int peer, bool net = false) -> Status {
    DevWait w{};
    if (net) {
      MK_REQUIRE(st->net, Code::kInternal, "ring_attention: a network flag without a network session");
      w.flag = st->net->flags() + index;
    } else {
      MK_CHECK(flag_ptr(me, index, const_cast<uint64_t**>(&w.flag)));
    }
    w.mul = mul;
    w.peer = peer;
    w.index = int32_t(index);
    if (op.nwait == 0) op.wait0 = uint32_t(waits.size());
    waits.push_back(w);
    ++op.nwait;
    return OkStatus();
  };
  auto add_signal = [&](DevOp& op, int rank, uint32_t index) -> Status {
    DevSignal g{};
    MK_CHECK(flag_ptr(rank, index, &g.flag));
    g.value = 1;
    g.add = 1;
    if (op.nsig == 0) op.sig0 = uint32_t(sigs.size());
    sigs.push_back(g);
    ++op.nsig;
    return OkStatus();
  };
  auto peer_ptr = [&](SymmetricBuffer* b, int rank, uint64_t off, uint64_t* out) -> Status {
    void* base = b->peer(rank);
    MK_REQUIRE(base, Code::kInternal, "ring_attention: slots of rank %d are not mapped here", rank);
    *out = reinterpret_cast<uint64_t>(static_cast<char*>(base) + off);
    return OkStatus();
  };
  const RingStep& s0 = p.steps[me][0];
  const int next = s0.send_to, prev = s0.recv_from;
  int net_puts = 0;
  if (W > 1) {
    const bool next_remote = topo.node_of[next] != topo.node_of[me];
    const bool prev_remote = topo.node_of[prev] != topo.node_of[me];
    // Entry: tell the previous rank that this rank's slots are free for this call (its call
    // started, so its previous call ended: stream order).
    // A block that came from a remote previous rank landed in the slot (direct) or in its host
    // mirror (staged), and the proxy raised its flag in the network pad: into the slot (staged)
    // and raise the device flag the compute CTAs and the forwarding wait on.
    auto relay = [&](int blk, int b, int pc) -> Status {
      const int64_t r0 = int64_t(pc) * st->chunk_tokens;
      const int64_t rows = std::min<int64_t>(st->chunk_tokens, S_l - r0);
      const uint64_t bytes = uint64_t(rows * row_bytes);
      const uint64_t slot_off = uint64_t(blk) * slot_bytes + uint64_t((int64_t(b) * S_l + r0) * row_bytes);
      const uint32_t arrived = flag_arrived(blk, b, pc);
      if (!st->net->staged()) {
        DevOp op{};
        op.kind = kDevSignal;
        MK_CHECK(add_wait(op, arrived, 2, prev, true));
        MK_CHECK(add_signal(op, me, arrived));
        MK_CHECK(add_signal(op, me, arrived));
        ops.push_back(op);
        return OkStatus();
      }
      for (int kv = 0; kv < 2; ++kv) {
        DevOp op{};
        op.kind = kDevCopy;
        op.flags = kDevOpHostMem;
        op.bytes = bytes;
        op.nsrc = op.ndst = 1;
        op.ptr0 = uint32_t(ptrs.size());
        ptrs.push_back(reinterpret_cast<uint64_t>(static_cast<char*>(kv ? st->v_net : st->k_net) + slot_off));
        uint64_t d = 0;
        MK_CHECK(peer_ptr(kv ? st->v_slots : st->k_slots, me, slot_off, &d));
        ptrs.push_back(d);
        MK_CHECK(add_wait(op, arrived, 2, prev, true));
        MK_CHECK(add_signal(op, me, arrived));
        ops.push_back(op);
      }
      return OkStatus();
    };
    {
      DevOp op{};
      if (prev_remote) {
        op.kind = kDevNetPut;
        MK_REQUIRE(st->net, Code::kInternal, "ring_attention: a network put without a network session");
        op.cmd = make_put(prev, st->win_token, uint64_t(me) * 8, st->win_token, uint64_t(me) * 8, 8, st->flag_entry,
                          st->flag_srcfree, 0);
        ++net_puts;
      } else {
        op.kind = kDevSignal;
        MK_CHECK(add_signal(op, prev, st->flag_entry));
      }
      ops.push_back(op);
    }
    for (int t = 0; t + 1 < W; ++t) {
      const int blk = p.steps[me][t].kv_rank;
      for (int b = 0; b < s.B; ++b)
        for (int pc = 0; pc < pieces; ++pc) {
          const int64_t r0 = int64_t(pc) * st->chunk_tokens;
          const int64_t rows = std::min<int64_t>(st->chunk_tokens, S_l - r0);
          const uint64_t bytes = uint64_t(rows * row_bytes);
          const uint64_t slot_off = uint64_t(blk) * slot_bytes + uint64_t((int64_t(b) * S_l + r0) * row_bytes);
          const uint64_t user_off = uint64_t((int64_t(b) * S_l + r0) * row_bytes);
          const uint32_t arrived = flag_arrived(blk, b, pc);
          if (t >= 1 && prev_remote) MK_CHECK(relay(blk, b, pc));
          if (t == 0 && next_remote) {
            // The own block goes out over the network from a registered buffer: stage it in the
            // own slot first.
            for (int kv = 0; kv < 2; ++kv) {
              DevOp op{};
              op.kind = kDevCopy;
              op.bytes = bytes;
              op.nsrc = op.ndst = 1;
              op.ptr0 = uint32_t(ptrs.size());
              ptrs.push_back(user_ptr(kv, user_off));
              uint64_t d = 0;
              MK_CHECK(peer_ptr(kv ? st->v_slots : st->k_slots, me, slot_off, &d));
              ptrs.push_back(d);
              MK_CHECK(add_signal(op, me, arrived));
              ops.push_back(op);
            }
          }
          for (int kv = 0; kv < 2; ++kv) {
            DevOp op{};
            MK_CHECK(add_wait(op, st->flag_entry, 1, next, next_remote));
            if (t > 0 || next_remote) MK_CHECK(add_wait(op, arrived, 2, t > 0 ? prev : me));
            if (next_remote) {
              op.kind = kDevNetPut;
              op.cmd = make_put(next, kv ? st->win_v : st->win_k, slot_off, kv ? st->win_v : st->win_k, slot_off,
                                bytes, arrived, st->flag_srcfree, uint64_t(t));
              ++net_puts;
              if (st->net->staged()) {
                // The slot's bytes go out from its host mirror: the CTA copies them there first.
                op.flags = kDevOpHostMem;
                op.bytes = bytes;
                op.nsrc = op.ndst = 1;
                op.ptr0 = uint32_t(ptrs.size());
                uint64_t sp = 0;
                MK_CHECK(peer_ptr(kv ? st->v_slots : st->k_slots, me, slot_off, &sp));
                ptrs.push_back(sp);
                ptrs.push_back(reinterpret_cast<uint64_t>(static_cast<char*>(kv ? st->v_net : st->k_net) + slot_off));
              }
            } else {
              op.kind = kDevCopy;
              op.bytes = bytes;
              op.nsrc = op.ndst = 1;
              op.ptr0 = uint32_t(ptrs.size());
              if (t == 0) {
                ptrs.push_back(user_ptr(kv, user_off));
              } else {
                uint64_t sp = 0;
                MK_CHECK(peer_ptr(kv ? st->v_slots : st->k_slots, me, slot_off, &sp));
                ptrs.push_back(sp);
              }
              uint64_t d = 0;
              MK_CHECK(peer_ptr(kv ? st->v_slots : st->k_slots, next, slot_off, &d));
              ptrs.push_back(d);
              MK_CHECK(add_signal(op, next, arrived));
            }
            ops.push_back(op);
          }
        }
    }
    if (prev_remote)
      for (int b = 0; b < s.B; ++b)
        for (int pc = 0; pc < pieces; ++pc) MK_CHECK(relay(p.steps[me][W - 1].kv_rank, b, pc));
    // A call ends only once every block meant for this rank is in its slot (also those no
    // query needs and the last one, which is not forwarded): no write of this call can land
    // during the next one.
    {
      DevOp op{};
      op.kind = kDevSignal;
      for (int t = 1; t < W; ++t)
        for (int b = 0; b < s.B; ++b)
          for (int pc = 0; pc < pieces; ++pc) MK_CHECK(add_wait(op, flag_arrived(p.steps[me][t].kv_rank, b, pc), 2, prev));
      ops.push_back(op);
    }
    if (net_puts) {
      // A call never ends while the proxy still reads this call's sources.
      DevOp op{};
      op.kind = kDevSignal;
      MK_CHECK(add_wait(op, st->flag_srcfree, uint64_t(net_puts), me, true));
      ops.push_back(op);
    }
  }
  FusedHooks& h = l.hooks;
  h = FusedHooks{};
  MK_CHECK(upload(st, ops, const_cast<DevOp**>(&h.ops)));
  h.n_ops = int32_t(ops.size());
  h.world = W;
  MK_CHECK(upload(st, waits, const_cast<DevWait**>(&h.waits)));
  MK_CHECK(upload(st, sigs, const_cast<DevSignal**>(&h.signals)));
  MK_CHECK(upload(st, ptrs, const_cast<uint64_t**>(&h.ptrs)));
  if (W > 1) {
    std::vector<int> counter{0};
    MK_CHECK(upload(st, counter, &h.op_counter));
    h.epoch = st->epoch;
  }
  h.wait = c->wait_ctx(ring_tag(), Role::kComm);
  if (st->net) h.ring = st->net->ring_view(h.wait.abort);
  l.comm_ctas = ops.empty() ? 0 : st->comm_ctas;
  if (attention::dynamic_schedule(true)) {
    // One counter per operator: its calls are stream-ordered.
    void* ctr = nullptr;
    MK_CHECK(dev_alloc(st, sizeof(int), &ctr));
    l.item_counter = static_cast<int*>(ctr);
    st->gathered.item_counter = l.item_counter;
    for (auto& v : st->per_step) v.item_counter = l.item_counter;
  }
  return OkStatus();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

Status RingAttention::create(Communicator* comm, const RingAttentionShape& shape, const RingAttentionOptions& opt,
                             std::unique_ptr<RingAttention>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "ring_attention: null communicator or output");
  const int W = comm->world();
  Request mine{shape.B, shape.H, shape.Hkv, shape.D, int32_t(shape.layout), shape.causal ? 1 : 0, shape.S};
  std::vector<Request> all(W);
  MK_CHECK(comm->bootstrap().allgather(&mine, all.data(), sizeof(Request)));
  for (int r = 1; r < W; ++r)
    MK_REQUIRE(std::memcmp(&all[0], &all[r], sizeof(Request)) == 0, Code::kInvalidArgument,
               "ring_attention: ranks disagree on the shape: rank 0 has B %d H %d Hkv %d D %d S %lld layout %d causal %d, "
               "rank %d has B %d H %d Hkv %d D %d S %lld layout %d causal %d",
               all[0].B, all[0].H, all[0].Hkv, all[0].D, (long long)all[0].S, all[0].layout, all[0].causal, r, all[r].B,
               all[r].H, all[r].Hkv, all[r].D, (long long)all[r].S, all[r].layout, all[r].causal);
  MK_CHECK(check_shape(shape, W));
  std::unique_ptr<RingAttention> op(new RingAttention());
  op->st_ = std::make_unique<RingState>();
  RingState* st = op->st_.get();
  st->owner = op.get();
  st->comm = comm;
  st->shape = shape;
  st->opt = opt;
  MK_CHECK(build_ring_plan(layout_of(comm->topology()), shape.S, shape.layout, shape.causal, &st->plan));
  MK_REQUIRE(comm->has_gpu(), Code::kNotSupported, "ring_attention: this rank has no GPU");
  MK_REQUIRE(!comm->destroyed(), Code::kInvalidArgument, "ring_attention: the communicator was destroyed");
  comm->attach(st);
  st->attached = true;
  st->S_l = shape.S / W;
  st->chunk_len = shape.layout == SeqLayout::kZigzag ? st->S_l / 2 : st->S_l;
  const int64_t row_bytes = int64_t(shape.Hkv) * shape.D * 2;
  int64_t ct = opt.chunk_tokens > 0 ? opt.chunk_tokens : std::max<int64_t>(64, (int64_t(2) << 20) / row_bytes);
  ct = std::min<int64_t>(ct, st->S_l);
  st->chunk_tokens = int(ct);
  st->pieces = int((st->S_l + ct - 1) / ct);
  int64_t cc = opt.comm_ctas;
  if (cc < 0) cc = tunables::ring_comm_ctas();
  st->comm_ctas = int(std::max<int64_t>(cc, 1));
  int grid = 0;
  Status rs = attention::fmha_ctas(&grid);
  if (rs.ok() && opt.max_ctas > 0) grid = std::min(grid, opt.max_ctas);
  if (rs.ok() && W > 1 && st->comm_ctas >= grid)
    rs = make_status(Code::kInvalidArgument, "ring_attention: %d communication CTAs leave none of %d CTAs to compute",
                     st->comm_ctas, grid);
  MK_CHECK(agree(comm->bootstrap(), rs, "ring_attention create"));
  // Workspaces: K/V slots [W][B][S/W][Hkv][D], the entry token, the signal pad.
  const uint64_t slot_bytes = uint64_t(W) * shape.B * st->S_l * row_bytes;
  MK_CHECK(comm->heap().alloc(slot_bytes, &st->k_slots));
  MK_CHECK(comm->heap().alloc(slot_bytes, &st->v_slots));
  MK_CHECK(comm->heap().alloc(uint64_t(W) * 8, &st->token));
  st->flag_entry = uint32_t(W * shape.B * st->pieces);
  st->flag_srcfree = st->flag_entry + 1;
  st->n_flags = st->flag_srcfree + 1;
  MK_CHECK(comm->alloc_signals(st->n_flags, &st->pad));
  MK_CHECK(comm->alloc_epoch(&st->epoch));
  MK_CUDA_CHECK(cudaMemsetAsync(st->token->local(), 0, st->token->mapped_size(), comm->setup_stream()));
  MK_CHECK(sync_stream_bounded(comm->setup_stream(), 60000, "ring_attention: zeroing the token"));
  if (comm->topology().node_ranks.size() > 1)
    MK_CHECK(agree(comm->bootstrap(), start_network(st), "ring_attention network"));
  MK_CHECK(agree(comm->bootstrap(), build_program(st), "ring_attention plan"));
  MK_CHECK(comm->bootstrap().barrier());
  *out = std::move(op);
  return OkStatus();
}

RingAttention::~RingAttention() {
  if (st_ && !st_->destroyed) {
    Status s = destroy();
    if (!s.ok()) MK_WARN(kSubsysInit, "ring_attention: destroy: %s", s.to_string().c_str());
  }
}

Status RingAttention::destroy() {
  RingState* st = st_.get();
  if (!st || st->destroyed) return OkStatus();
  st->destroyed = true;
  Status first;
  auto keep = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  if (st->net) keep(st->net->destroy());
  for (void* p : st->dev_allocs) cudaFree(p);
  st->dev_allocs.clear();
  for (SymmetricBuffer* b : {st->token, st->v_slots, st->k_slots})
    if (b) keep(st->comm->heap().free(b));
  if (st->pad) keep(st->comm->heap().free(st->pad));
  if (st->attached) st->comm->detach(st);
  st->attached = false;
  return first;
}

void RingState::on_communicator_destroy() {
  Status s = owner->destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "ring_attention: destroy: %s", s.to_string().c_str());
}

const RingPlan& RingAttention::plan() const { return st_->plan; }
int RingAttention::comm_ctas() const { return st_->launch.comm_ctas; }
int64_t RingAttention::local_tokens() const { return st_->S_l; }
int RingAttention::work_items() const { return st_->launch.n_items; }
int RingAttention::comm_ops() const { return st_->launch.hooks.n_ops; }
size_t RingAttention::block_elems() const {
  return size_t(st_->shape.B) * st_->S_l * st_->shape.Hkv * st_->shape.D;
}
const void* RingAttention::k_slots() const { return st_->k_slots->local(); }
const void* RingAttention::v_slots() const { return st_->v_slots->local(); }

Status RingAttention::can_implement(const RingAttentionArgs& a) const {
  const RingState* st = st_.get();
  MK_REQUIRE(st && !st->destroyed, Code::kInvalidArgument,
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
  return OkStatus();
}

Status RingAttention::run(const RingAttentionArgs& a, cudaStream_t stream) {
  MK_CHECK(agree(st_->comm->bootstrap(), can_implement(a), "ring_attention arguments"));
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
}  // namespace

Status RingAttention::enqueue_compute(const RingAttentionArgs& a, int step, const void* k_src, const void* v_src,
                                      cudaStream_t stream) {
  RingState* st = st_.get();
  MK_CHECK(can_implement(a));
  MK_REQUIRE(k_src && v_src, Code::kInvalidArgument, "ring_attention: null K/V source");
  MK_REQUIRE(step < st->plan.world, Code::kInvalidArgument, "ring_attention: step %d of %d", step, st->plan.world);
  attention::FmhaLaunch l = step < 0 ? st->gathered : st->per_step[step];
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
  // A failed communicator runs nothing more (see FusedGemm::enqueue).
  MK_CHECK(st->comm->check());
  attention::ForwardArgs f = forward_args(st, a);
  attention::FmhaLaunch l = st->launch;
  l.hooks.user[0] = const_cast<void*>(a.k);
  l.hooks.user[1] = const_cast<void*>(a.v);
  l.trace = a.trace;
  attention::RunConfig cfg;
  cfg.max_ctas = st->opt.max_ctas;
  return attention::run_fmha(f, l, stream, cfg);
}

}  // namespace ops
}  // namespace mk
