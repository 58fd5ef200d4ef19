// Fused GEMM collectives: plan resolution, workspaces, the network stack, launch.
#include "mkernel/ops/fused.h"
#include "src/ops/collectives/plan.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/comm/device_program.h"
#include "mkernel/runtime/communicator.h"
#include "src/gemm/fused_launch.h"
#include "src/comm/net_session.h"

namespace mk {
namespace ops {

struct FusedState : CommAttachment {
  FusedGemm* owner = nullptr;
  void on_communicator_destroy() override;
  Communicator* comm = nullptr;
  FusedKind kind = FusedKind::kAgGemm;
  PlanShape shape;
  FusedOptions opt;
  Plan plan;
  int comm_ctas = 0;
  SymmetricBuffer* bufs[int(Buf::kCount)] = {};
  SymmetricBuffer* pad = nullptr;
  EpochState* epoch = nullptr;
  // network (several nodes only): windows, the proxy's flag pad, host mirrors when staged
  std::unique_ptr<NetSession> net;
  void* host_bufs[int(Buf::kCount)] = {};
  uint32_t win_id[int(Buf::kCount)] = {};
  bool attached = false;
  // resolved program (device memory)
  std::vector<void*> dev_allocs;
  FusedHooks hooks{};
  int* d_role = nullptr;
  int* d_tile_counter = nullptr;
  int* d_order = nullptr;
  bool destroyed = false;
};

namespace {

template <class T>
Status upload(FusedState* st, const std::vector<T>& v, T** out) {
  *out = nullptr;
  if (v.empty()) return OkStatus();
  void* p = nullptr;
  MK_CUDA_CHECK(cudaMalloc(&p, v.size() * sizeof(T)));
  st->dev_allocs.push_back(p);
  MK_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  *out = static_cast<T*>(p);
  return OkStatus();
}

struct Request {
  int32_t kind, deterministic;
  int64_t M, N, K;
};

// Every rank asked for the same operator and shape; else the same error everywhere.
Status check_same_request(Bootstrap& bs, const Request& mine, int world, FusedKind kind) {
  std::vector<Request> all(world);
  MK_CHECK(bs.allgather(&mine, all.data(), sizeof(Request)));
  for (int r = 1; r < world; ++r) {
    const Request& a = all[0];
    const Request& b = all[r];
    MK_REQUIRE(a.kind == b.kind && a.deterministic == b.deterministic && a.M == b.M && a.N == b.N && a.K == b.K,
               Code::kInvalidArgument,
               "%s: ranks disagree on the operator or shape: rank 0 has %s (M %lld, N %lld, K %lld%s), rank %d "
               "has %s (M %lld, N %lld, K %lld%s)",
               fused_kind_name(kind), fused_kind_name(FusedKind(a.kind)), (long long)a.M, (long long)a.N,
               (long long)a.K, a.deterministic ? ", deterministic" : "", r, fused_kind_name(FusedKind(b.kind)),
               (long long)b.M, (long long)b.N, (long long)b.K, b.deterministic ? ", deterministic" : "");
  }
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

// Device workspaces, the signal pad and the epoch; with several nodes the network windows: the
// buffers that cross nodes (direct) or their pinned host mirrors (staged).
Status alloc_buffers(FusedState* st) {
  Communicator* c = st->comm;
  const Plan& p = st->plan;
  for (int b = 0; b < int(Buf::kCount); ++b) {
    const uint64_t bytes = p.buf_bytes[b];
    if (!bytes || b == int(Buf::kUserA) || b == int(Buf::kUserC) || is_host_buf(Buf(b))) continue;
    MK_CHECK(c->heap().alloc(bytes, &st->bufs[b]));
    MK_CUDA_CHECK(cudaMemsetAsync(st->bufs[b]->local(), 0, st->bufs[b]->mapped_size(), c->setup_stream()));
  }
  // Token: every rank's slot holds its rank (the payload of the network entry handshake).
  std::vector<uint64_t> token(c->world(), uint64_t(c->rank()));
  if (SymmetricBuffer* tok = st->bufs[int(Buf::kToken)])
    MK_CUDA_CHECK(cudaMemcpyAsync(tok->local(), token.data(), token.size() * 8, cudaMemcpyHostToDevice,
                                  c->setup_stream()));
  MK_CHECK(c->alloc_signals(p.pad_flags, &st->pad));
  MK_CHECK(c->alloc_epoch(&st->epoch));
  MK_CHECK(sync_stream_bounded(c->setup_stream(), 60000, "fused: zeroing the workspaces"));
  if (!st->net) return OkStatus();
  for (int b = 0; b < int(Buf::kCount); ++b) {
    const uint64_t bytes = p.buf_bytes[b];
    if (!bytes) continue;
    if (is_host_buf(Buf(b))) {
      MK_CHECK(st->net->add_host_window(bytes, &st->host_bufs[b], &st->win_id[b]));
      if (Buf(b) == Buf::kTokenNet) memcpy(st->host_bufs[b], token.data(), token.size() * 8);
    } else if (!p.net_staged && st->bufs[b]) {
      MK_CHECK(st->net->add_gpu_window(st->bufs[b]->local(), st->bufs[b]->size(), &st->win_id[b]));
    }
  }
  return st->net->start();
}

// The rank's plan as device arrays (pointers on the node, flag addresses, proxy commands).
Status resolve(FusedState* st) {
  const Plan& p = st->plan;
  const int me = st->comm->rank();
  const RankPlan& rp = p.ranks[me];
  auto flag_addr = [&](const FlagRef& f, uint64_t** out) -> Status {
    if (p.proxy_region(f.region)) {
      // Raised by this rank's proxy with host stores, waited on by this rank only.
      MK_REQUIRE(st->net && f.rank == me, Code::kInternal, "%s: proxy flag %s[%u] of rank %d used on rank %d",
                 fused_kind_name(p.kind), region_name(f.region), f.index, f.rank, me);
      *out = st->net->flags() + p.flag_index(f);
      return OkStatus();
    }
    void* base = st->pad->peer(f.rank);
    MK_REQUIRE(base, Code::kInternal, "%s: flag %s[%u] of rank %d is not mapped here", fused_kind_name(p.kind),
               region_name(f.region), f.index, f.rank);
    *out = static_cast<uint64_t*>(base) + p.flag_index(f);
    return OkStatus();
  };
  auto buf_addr = [&](const BufRef& r, uint64_t* out) -> Status {
    if (r.buf == Buf::kUserA || r.buf == Buf::kUserC) {
      MK_REQUIRE(r.rank == me, Code::kInternal, "plan: a caller buffer of rank %d", r.rank);
      *out = user_ptr(r.buf == Buf::kUserA ? kUserPtrA : kUserPtrC, r.offset);
      return OkStatus();
    }
    if (is_host_buf(r.buf)) {
      MK_REQUIRE(r.rank == me && st->host_bufs[int(r.buf)], Code::kInternal, "plan: host mirror %s of rank %d",
                 buf_name(r.buf), r.rank);
      *out = reinterpret_cast<uint64_t>(static_cast<char*>(st->host_bufs[int(r.buf)]) + r.offset);
      return OkStatus();
    }
    SymmetricBuffer* b = st->bufs[int(r.buf)];
    MK_REQUIRE(b, Code::kInternal, "plan: buffer %s was not allocated", buf_name(r.buf));
    void* base = b->peer(r.rank);
    MK_REQUIRE(base, Code::kInternal, "plan: %s of rank %d is not mapped here", buf_name(r.buf), r.rank);
    *out = reinterpret_cast<uint64_t>(static_cast<char*>(base) + r.offset);
    return OkStatus();
  };
  std::vector<DevOp> ops;
  std::vector<DevWait> waits;
  std::vector<DevSignal> sigs;
  std::vector<uint64_t> ptrs;
  auto add_wait = [&](const PlanWait& w) -> Status {
    MK_REQUIRE(w.flag.rank == me, Code::kInternal, "plan: a wait on rank %d's flag", w.flag.rank);
    DevWait d{};
    uint64_t* a = nullptr;
    MK_CHECK(flag_addr(w.flag, &a));
    d.flag = a;
    d.mul = w.mul;
    d.peer = w.peer;
    d.index = int32_t(p.flag_index(w.flag));
    waits.push_back(d);
    return OkStatus();
  };
  auto add_signal = [&](const PlanSignal& g) -> Status {
    DevSignal d{};
    MK_CHECK(flag_addr(g.flag, &d.flag));
    d.value = g.value;
    d.add = g.add ? 1 : 0;
    sigs.push_back(d);
    return OkStatus();
  };
  for (size_t i = 0; i < rp.ops.size(); ++i) {
    const CommOp& op = rp.ops[i];
    DevOp d{};
    d.kind = uint32_t(op.kind);
    d.wait0 = uint32_t(waits.size());
    d.nwait = uint32_t(op.waits.size());
    for (const auto& w : op.waits) MK_CHECK(add_wait(w));
    d.sig0 = uint32_t(sigs.size());
    d.nsig = uint32_t(op.signals.size());
    for (const auto& g : op.signals) MK_CHECK(add_signal(g));
    d.bytes = op.bytes;
    d.elems = op.elems;
    d.dst_f32 = op.dst_f32 ? 1 : 0;
    d.zero_mask = op.zero_src_mask;
    d.ptr0 = uint32_t(ptrs.size());
    auto touches_host = [&](const CommOp& o) {
      bool h = false;
      for (const auto& r : o.srcs) h |= is_host_buf(r.buf);
      for (const auto& r : o.dsts) h |= is_host_buf(r.buf);
      return h;
    };
    if (touches_host(op)) d.flags |= kDevOpHostMem;
    if (op.kind == CommKind::kNetPut) {
      MK_REQUIRE(st->net, Code::kInternal, "plan: a network put without a network session");
      const BufRef& s = op.srcs[0];
      const BufRef& t = op.dsts[0];
      d.cmd = make_put(op.peer, st->win_id[int(s.buf)], s.offset, st->win_id[int(t.buf)], t.offset, op.bytes,
                       p.flag_index(op.remote_flag),
                       op.local_flag.region == Region::kCount ? kNoFlag : p.flag_index(op.local_flag), i);
      if (op.stage_src.buf != Buf::kCount) {
        // Staged: the device copies the source into the host mirror, then pushes the put.
        MK_REQUIRE(op.bytes % 16 == 0, Code::kInternal, "plan: staged put '%s' is not 16-byte sized",
                   op.what.c_str());
        d.nsrc = d.ndst = 1;
        uint64_t a = 0;
        MK_CHECK(buf_addr(op.stage_src, &a));
        ptrs.push_back(a);
        MK_CHECK(buf_addr(s, &a));
        ptrs.push_back(a);
      }
    } else {
      MK_REQUIRE(op.srcs.size() + op.dsts.size() <= 16, Code::kNotSupported,
                 "%s: op '%s' touches %zu buffers (at most 16: fewer nodes or ranks per node)",
                 fused_kind_name(p.kind), op.what.c_str(), op.srcs.size() + op.dsts.size());
      MK_REQUIRE(op.bytes % 16 == 0 && op.elems % 4 == 0, Code::kInternal, "plan: op '%s' is not 16-byte sized",
                 op.what.c_str());
      d.nsrc = uint32_t(op.srcs.size());
      d.ndst = uint32_t(op.dsts.size());
      for (const auto& r : op.srcs) {
        uint64_t a = 0;
        MK_CHECK(buf_addr(r, &a));
        ptrs.push_back(a);
      }
      for (const auto& r : op.dsts) {
        uint64_t a = 0;
        MK_CHECK(buf_addr(r, &a));
        ptrs.push_back(a);
      }
    }
    ops.push_back(d);
  }
  std::vector<DevRowHooks> rows;
  if (!rp.rows.empty()) {
    const uint32_t w_base = uint32_t(waits.size()), s_base = uint32_t(sigs.size());
    for (const auto& w : rp.waits) MK_CHECK(add_wait(w));
    for (const auto& g : rp.signals) MK_CHECK(add_signal(g));
    for (const auto& h : rp.rows)
      rows.push_back(DevRowHooks{w_base + h.load_wait0, h.load_waits, w_base + h.store_wait0, h.store_waits,
                                 s_base + h.store_sig0, h.store_sigs});
  }
  std::vector<float*> route;
  for (const auto& r : rp.route) {
    uint64_t a = 0;
    MK_CHECK(buf_addr(r, &a));
    route.push_back(reinterpret_cast<float*>(a));
  }
  FusedHooks& h = st->hooks;
  h = FusedHooks{};
  MK_CHECK(upload(st, ops, const_cast<DevOp**>(&h.ops)));
  h.n_ops = int32_t(ops.size());
  h.world = p.layout.world;
  MK_CHECK(upload(st, waits, const_cast<DevWait**>(&h.waits)));
  MK_CHECK(upload(st, sigs, const_cast<DevSignal**>(&h.signals)));
  MK_CHECK(upload(st, ptrs, const_cast<uint64_t**>(&h.ptrs)));
  MK_CHECK(upload(st, rows, const_cast<DevRowHooks**>(&h.rows)));
  MK_CHECK(upload(st, route, const_cast<float***>(&h.route)));
  h.shard_rows = p.shard_rows;
  h.route_store = p.deterministic ? 1 : 0;
  h.peek_ops = p.kind == FusedKind::kAgGemm ? 0 : 1;
  h.epoch = st->epoch;
  const uint32_t tag = op_tag_register(fused_kind_name(p.kind));
  h.wait = st->comm->wait_ctx(tag, Role::kComm);
  if (st->net) h.ring = st->net->ring_view(h.wait.abort);
  std::vector<int> counters{st->comm_ctas, 0, 0};
  int* dc = nullptr;
  MK_CHECK(upload(st, counters, &dc));
  st->d_role = dc;
  h.op_counter = dc + 1;
  st->d_tile_counter = dc + 2;
  MK_CHECK(upload(st, rp.tile_order, &st->d_order));
  MK_REQUIRE(int(rp.tile_order.size()) == p.tiles_m * p.tiles_n, Code::kInternal, "plan: tile order incomplete");
  return OkStatus();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

Status FusedGemm::create(Communicator* comm, FusedKind kind, const PlanShape& shape, const FusedOptions& opt,
                         std::unique_ptr<FusedGemm>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "fused: null communicator or output");
  const char* name = fused_kind_name(kind);
  Request req{int32_t(kind), opt.deterministic ? 1 : 0, shape.M, shape.N, shape.K};
  MK_CHECK(check_same_request(comm->bootstrap(), req, comm->world(), kind));
  std::unique_ptr<FusedGemm> op(new FusedGemm());
  op->st_ = std::make_unique<FusedState>();
  FusedState* st = op->st_.get();
  st->owner = op.get();
  st->comm = comm;
  st->kind = kind;
  st->shape = shape;
  st->opt = opt;
  // Same inputs on every rank: the plan (or its error) is the same everywhere.
  MK_CHECK(build_plan(kind, shape, layout_of(comm->topology()), opt.deterministic, &st->plan));
  MK_REQUIRE(comm->has_gpu(), Code::kNotSupported, "%s: this rank has no GPU", name);
  MK_REQUIRE(!comm->destroyed(), Code::kInvalidArgument, "%s: the communicator was destroyed", name);
  comm->attach(st);
  st->attached = true;
  int64_t cc = opt.comm_ctas;
  if (cc < 0) cc = tunables::fused_comm_ctas();
  st->comm_ctas = int(std::max<int64_t>(cc, 1));
  int resident = 0;
  Status rs = gemm::persistent_ctas(&resident);
  if (rs.ok() && st->comm_ctas >= resident)
    rs = make_status(Code::kInvalidArgument,
                     "%s: %d communication CTAs leave none of the %d co-resident CTAs to compute", name,
                     st->comm_ctas, resident);
  MK_CHECK(agree(comm->bootstrap(), rs, std::string(name) + " create"));
  if (st->plan.layout.nodes() > 1) {
    // The network decides how data crosses nodes (GPU memory registered, or staged through
    // pinned host mirrors); the plan follows.
    MK_CHECK(NetSession::create(comm, opt.staging, st->plan.pad_flags, &st->net));
    MK_CHECK(build_plan(kind, shape, layout_of(comm->topology()), opt.deterministic, &st->plan, st->net->staged()));
    MK_REQUIRE(st->net->flag_count() == st->plan.pad_flags, Code::kInternal, "fused: flag pad size changed");
  }
  MK_CHECK(agree(comm->bootstrap(), alloc_buffers(st), std::string(name) + " workspaces"));
  MK_CHECK(agree(comm->bootstrap(), resolve(st), std::string(name) + " plan"));
  MK_CHECK(comm->bootstrap().barrier());
  MK_TRACE(kSubsysInit, "%s", describe(st->plan, comm->rank()).c_str());
  *out = std::move(op);
  return OkStatus();
}

FusedGemm::~FusedGemm() {
  if (st_ && !st_->destroyed) {
    Status s = destroy();
    if (!s.ok()) MK_WARN(kSubsysInit, "fused: destroy: %s", s.to_string().c_str());
  }
}

void FusedState::on_communicator_destroy() {
  Status s = owner->destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "fused: destroy: %s", s.to_string().c_str());
}

Status FusedGemm::destroy() {
  FusedState* st = st_.get();
  if (!st || st->destroyed) return OkStatus();
  st->destroyed = true;
  Status first;
  auto keep = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  if (st->net) keep(st->net->destroy());
  for (void* p : st->dev_allocs) cudaFree(p);
  st->dev_allocs.clear();
  for (int b = int(Buf::kCount) - 1; b >= 0; --b)
    if (st->bufs[b]) keep(st->comm->heap().free(st->bufs[b]));
  if (st->pad) keep(st->comm->heap().free(st->pad));
  if (st->attached) st->comm->detach(st);
  st->attached = false;
  return first;
}

FusedKind FusedGemm::kind() const { return st_->kind; }
const Plan& FusedGemm::plan() const { return st_->plan; }
int FusedGemm::comm_ctas() const { return st_->comm_ctas; }
const void* FusedGemm::gathered_a() const {
  SymmetricBuffer* b = st_->bufs[int(Buf::kAFull)];
  return b ? b->local() : nullptr;
}

Status FusedGemm::set_comm_ctas(int n, cudaStream_t stream) {
  MK_REQUIRE(n >= 1, Code::kInvalidArgument, "fused: at least one communication CTA");
  st_->comm_ctas = n;
  MK_CUDA_CHECK(cudaMemcpyAsync(st_->d_role, &st_->comm_ctas, sizeof(int), cudaMemcpyHostToDevice, stream));
  return OkStatus();
}

Status FusedGemm::can_implement(const FusedArgs& a) const {
  const FusedState* st = st_.get();
  MK_REQUIRE(st && !st->destroyed, Code::kInvalidArgument,
             "fused: the operator was destroyed (or its communicator was destroyed first)");
  const char* name = fused_kind_name(st->kind);
  const int W = st->comm->world();
  const PlanShape& s = st->shape;
  MK_REQUIRE(a.a_type == gemm::DType::kBF16 && a.b_type == gemm::DType::kBF16 && a.c_type == gemm::DType::kBF16,
             Code::kInvalidArgument, "%s: A, B and C must be bf16", name);
  MK_REQUIRE(a.A && a.B && a.C, Code::kInvalidArgument, "%s: null A, B or C", name);
  MK_REQUIRE(aligned16(a.A) && aligned16(a.B) && aligned16(a.C), Code::kInvalidArgument,
             "%s: A, B and C must be 16-byte aligned", name);
  const int64_t a_rows = st->kind == FusedKind::kAgGemm ? s.M / W : s.M;
  const int64_t c_rows = st->kind == FusedKind::kGemmRs ? s.M / W : s.M;
  const uint64_t ab = uint64_t(a_rows) * s.K * 2, bb = uint64_t(s.N) * s.K * 2, cb = uint64_t(c_rows) * s.N * 2;
  auto overlaps = [](const void* p, uint64_t pb, const void* q, uint64_t qb) {
    auto x = reinterpret_cast<uintptr_t>(p), y = reinterpret_cast<uintptr_t>(q);
    return x < y + qb && y < x + pb;
  };
  MK_REQUIRE(!overlaps(a.C, cb, a.A, ab) && !overlaps(a.C, cb, a.B, bb), Code::kInvalidArgument,
             "%s: C overlaps A or B", name);
  return OkStatus();
}

Status FusedGemm::run(const FusedArgs& a, cudaStream_t stream) {
  MK_CHECK(agree(st_->comm->bootstrap(), can_implement(a), std::string(fused_kind_name(st_->kind)) + " arguments"));
  return enqueue(a, stream);
}

Status FusedGemm::enqueue(const FusedArgs& a, cudaStream_t stream) {
  FusedState* st = st_.get();
  MK_CHECK(can_implement(a));
  // A failed communicator (a device wait gave up, the network failed) runs nothing more: its
  // flags and epochs are no longer consistent across ranks. Destroy it and create a new one.
  MK_CHECK(st->comm->check());
  if (st->comm->world() == 1) {
    // One rank: there is nothing to communicate; the plain GEMM writes C (AG also keeps the
    // "gathered" A, which is A itself).
    gemm::Arguments g;
    g.A = a.A;
    g.B = a.B;
    g.C = a.C;
    g.M = st->shape.M, g.N = st->shape.N, g.K = st->shape.K;
    gemm::RunConfig cfg;
    cfg.max_ctas = st->opt.max_ctas;
    MK_CHECK(gemm::run(g, stream, cfg));
    if (st->kind == FusedKind::kAgGemm)
      MK_CUDA_CHECK(cudaMemcpyAsync(st->bufs[int(Buf::kAFull)]->local(), a.A, st->plan.buf_bytes[int(Buf::kAFull)],
                                    cudaMemcpyDeviceToDevice, stream));
    return OkStatus();
  }
  gemm::Arguments g;
  g.M = st->shape.M;
  g.N = st->shape.N;
  g.K = st->shape.K;
  g.B = a.B;
  g.trace = a.trace;
  gemm::FusedLaunch f;
  f.hooks = st->hooks;
  f.role_counts = st->d_role;
  f.tile_counter = st->d_tile_counter;
  f.tile_order = st->d_order;
  if (st->kind == FusedKind::kAgGemm) {
    g.A = st->bufs[int(Buf::kAFull)]->local();
    g.C = a.C;
    f.hooks.user[kUserPtrA] = const_cast<void*>(a.A);
  } else {
    g.A = a.A;
    // The routed epilogue never writes C; the TMA-store descriptor still needs valid memory.
    g.C = st->bufs[int(Buf::kAccum)]->local();
    f.route = true;
    f.hooks.user[kUserPtrC] = a.C;
  }
  gemm::RunConfig cfg;
  cfg.max_ctas = st->opt.max_ctas;
  return gemm::run_fused(g, f, stream, cfg);
}

}  // namespace ops
}  // namespace mk
