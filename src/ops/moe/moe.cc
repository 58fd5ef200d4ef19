// MoE dispatch/combine: the operator (see include/mkernel/ops/moe.h).
#include "mkernel/ops/moe.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/runtime/communicator.h"
#include "mkernel/runtime/topology.h"
#include "src/comm/session.h"
#include "src/ops/moe/moe_launch.h"
#include "src/ops/moe/moe_plan.h"
#include "src/ops/moe/moe_program.h"

namespace mk {
namespace ops {

struct MoeState {
  MoeConfig cfg;
  MoeOptions opt;
  MoeGeometry g;
  // Dispatch and combine are separate programs with their own epochs: a user may dispatch
  // several times before a combine (the combine follows the last dispatch).
  std::unique_ptr<comm::OpSession> dses, cses;
  comm::Program dprog, cprog;
  MoeLaunch l;  // with the operator's own handle's routing arrays
  bool hier = false;
  MoeNodeGeometry ng;
  MoeErrorRecord* err_host = nullptr;  // pinned, mapped
  // The first bad input check() reported: from then on dispatch() and combine() refuse. Latched
  // when the caller observes it (check(), in its program order), never from the device's record
  // as a call is enqueued: that record races the calls in flight (a combine right after the
  // dispatch that recorded it would be refused on one rank while its peers wait in theirs).
  mutable Status reported;
  bool dispatched = false;
  ~MoeState() {
    if (err_host) cudaFreeHost(err_host);
  }
};

struct MoeHandleState {
  const MoeState* owner = nullptr;
  MoeRouteState r;
  std::vector<void*> mem;  // cudaMalloc'd, freed with the handle (none for a caller's memory)
  bool dispatched = false;
  ~MoeHandleState() {
    for (void* p : mem) cudaFree(p);
  }
};

MoeHandle::MoeHandle() = default;
MoeHandle::~MoeHandle() = default;

namespace {

struct Request {
  int64_t hidden, max_tokens, recv_capacity;
  int32_t experts, topk, align, dtype;
};

// One dispatch's routing arrays, from `alloc` (zeroed device memory).
template <class Alloc>
Status alloc_route_state(const MoeGeometry& g, int nodes, int nchunks, bool hier, Alloc&& alloc, MoeRouteState* r) {
  auto get = [&](size_t bytes, auto** p) -> Status {
    void* v = nullptr;
    MK_CHECK(alloc(std::max<size_t>(bytes, 16), &v));
    *p = static_cast<std::remove_reference_t<decltype(**p)>*>(v);
    return OkStatus();
  };
  const size_t tk = size_t(g.T) * g.k;
  const size_t B = size_t(g.E + 2 * g.W + nodes);  // moe_buckets, node records included
  MK_CHECK(get(4 * tk, &r->erank));
  MK_CHECK(get(4 * tk, &r->cpos));
  MK_CHECK(get(4 * tk, &r->cpos_g));
  MK_CHECK(get(4 * tk, &r->recpos));
  if (hier) MK_CHECK(get(4 * tk, &r->nrecpos));
  MK_CHECK(get(4 * tk, &r->ids));
  MK_CHECK(get(4 * tk, &r->weights));
  MK_CHECK(get(4 * size_t(nchunks) * B, &r->hist));
  MK_CHECK(get(4 * B, &r->totals));
  MK_CHECK(get(4, &r->n_tokens));
  MK_CHECK(get(4 * size_t(g.El), &r->counts));
  MK_CHECK(get(4 * size_t(g.El + 1), &r->offsets));
  MK_CHECK(get(4 * size_t(g.W) * g.El, &r->base));
  MK_CHECK(get(4 * size_t(g.W), &r->nrec));
  MK_CHECK(get(4 * size_t(g.W), &r->ncomb));
  MK_CHECK(get(8 * size_t(g.recv_rows), &r->back));
  MK_CHECK(get(4 * tk, &r->self_row));
  return OkStatus();
}

// A handle's routing arrays carved from one block of caller memory: each array on a 256-byte
// boundary (as cudaMalloc gives). With base null it only counts (handle_bytes).
struct RouteCarver {
  char* base = nullptr;
  uint64_t used = 0, cap = 0;
  Status operator()(size_t bytes, void** p) {
    const uint64_t at = (used + 255) & ~uint64_t(255);
    MK_REQUIRE(!base || at + bytes <= cap, Code::kInvalidArgument,
               "moe: a handle's memory of %llu bytes is too small (handle_bytes() %llu or more)",
               (unsigned long long)cap, (unsigned long long)(at + bytes));
    *p = base ? base + at : nullptr;
    used = at + bytes;
    return OkStatus();
  }
};
uint64_t route_state_bytes(const MoeGeometry& g, int nodes, int nchunks, bool hier) {
  RouteCarver c;
  MoeRouteState r;
  (void)alloc_route_state(g, nodes, nchunks, hier, c, &r);
  return (c.used + 255) & ~uint64_t(255);
}

// The launch of a call: the operator's own, or — for a caller's handle — a copy with that
// handle's routing arrays (in *scratch).
const MoeLaunch& launch_for(const MoeState& st, const MoeHandleState* h, MoeLaunch* scratch);

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }


bool use_hier(const MoeConfig& cfg, MoeMode mode, int nodes, int local) {
  if (nodes < 2 || local < 2) return false;  // nothing to forward inside a node
  if (mode == MoeMode::kThroughput) return true;
  if (mode == MoeMode::kLowLatency) return false;
  return cfg.max_tokens_per_rank > 256;
}

// Tokens per route chunk (one warp counts a chunk in order): about 128 chunks, 8..64 tokens.
int route_chunk_tokens(const MoeGeometry& g) {
  return int(std::max<int64_t>(8, std::min<int64_t>(64, (g.T + 127) / 128)));
}
int route_chunks(const MoeGeometry& g) { return int((g.T + route_chunk_tokens(g) - 1) / route_chunk_tokens(g)); }

}  // namespace

int moe_default_pieces(int comm_ctas, int W) {
  return std::max(1, std::min(32, (comm_ctas + W - 2) / std::max(1, W - 1)));
}
const MoeLaunch& moe_launch_of(const MoeEp& ep) { return ep.st_->l; }

Status MoeEp::can_implement(const MoeConfig& cfg, int world) {
  MoeGeometry g;
  MK_CHECK(moe_geometry(cfg, world, &g));
  MK_REQUIRE(cfg.dtype == gemm::DType::kBF16, Code::kNotSupported, "moe: dtype %d (bf16 only)", int(cfg.dtype));
  return OkStatus();
}

Status MoeEp::buffer_bytes(const MoeConfig& cfg, const Topology& topo, bool staged, MoeMemory* out, MoeMode mode) {
  MK_REQUIRE(out, Code::kInvalidArgument, "moe: null output");
  const int W = topo.world;
  MoeGeometry g;
  MK_CHECK(moe_geometry(cfg, W, &g));
  const bool net = topo.num_nodes > 1;
  MoeMemory m;
  const uint64_t comb = 2 * uint64_t(W) * uint64_t(g.cslot_bytes);
  m.symmetric_bytes = 2 * uint64_t(W) * uint64_t(g.slot_bytes) + comb;
  if (net && staged) m.host_bytes = m.symmetric_bytes;
  if (use_hier(cfg, mode, topo.num_nodes, topo.local_size)) {
    const MoeNodeGeometry ng = moe_node_geometry(g, topo.local_size);
    const uint64_t nodes = 2 * uint64_t(topo.num_nodes) * uint64_t(ng.nslot_bytes);
    m.symmetric_bytes += nodes;
    if (staged) m.host_bytes = nodes + comb;  // node slots and combine slots cross the network
  }
  // The operator's own handle: what alloc_route_state takes (counted, not allocated).
  MoeRouteState counted;
  MK_CHECK(alloc_route_state(g, topo.num_nodes, route_chunks(g), use_hier(cfg, mode, topo.num_nodes, topo.local_size),
                             [&](size_t bytes, void** p) {
                               m.private_bytes += bytes;
                               *p = nullptr;
                               return OkStatus();
                             },
                             &counted));
  m.recv_rows = g.recv_rows;
  m.handle_bytes = route_state_bytes(g, topo.num_nodes, route_chunks(g),
                                     use_hier(cfg, mode, topo.num_nodes, topo.local_size));
  *out = m;
  return OkStatus();
}

namespace {

// Zeroed device memory from the dispatch session (which owns it), typed.
template <class T>
Status session_alloc(comm::OpSession& ses, size_t bytes, T** p) {
  void* v = nullptr;
  MK_CHECK(ses.alloc_zeroed(std::max<size_t>(bytes, 16), &v));
  *p = static_cast<T*>(v);
  return OkStatus();
}

// Throughput mode across nodes: the node slots, the node's receive slots as this rank's peer
// stores reach them, the kernels' pools of the dispatch program (r: its resolved form).
Status build_hier_launch(MoeState* st, const comm::Layout& layout, int me, int pieces, const comm::Resolved& r) {
  MoeLaunch& l = st->l;
  comm::OpSession& d = *st->dses;
  const MoeNodeGeometry& ng = st->ng;
  l.hier = true;
  l.nodes = layout.nodes(), l.local = layout.local();
  l.my_node = layout.node_of[me], l.my_local = layout.local_of[me];
  std::vector<int32_t> nr, no(layout.node_of.begin(), layout.node_of.end());
  for (const auto& v : layout.node_ranks) nr.insert(nr.end(), v.begin(), v.end());
  MK_CHECK(d.upload(nr, const_cast<int32_t**>(&l.node_ranks)));
  MK_CHECK(d.upload(no, const_cast<int32_t**>(&l.node_of)));
  l.nmeta_bytes = ng.nmeta_bytes, l.nrec_bytes = ng.nrec_bytes, l.nhdr_bytes = ng.nhdr_bytes;
  l.nslot_bytes = ng.nslot_bytes;
  l.nsend = static_cast<char*>(d.local(MoeBuf::kNSend));
  l.nrecv = static_cast<char*>(d.local(MoeBuf::kNRecv));
  l.npiece = static_cast<uint64_t*>(d.local(MoeBuf::kNPieceBytes));
  l.nP = moe_pieces(ng.nslot_bytes, pieces), l.npb = moe_piece_bytes(ng.nslot_bytes, pieces);
  MK_REQUIRE(l.nsend && l.nrecv && l.npiece, Code::kInternal, "moe: a node slot buffer was not allocated");
  MK_CHECK(session_alloc(d, 4, &l.repack_done));
  std::vector<uint64_t> peers;
  for (int r2 : layout.node_ranks[l.my_node]) {
    uint64_t a = 0;
    MK_CHECK(d.address(st->dprog, comm::BufRef{MoeBuf::kRecv, r2, 0}, &a));
    peers.push_back(a);
  }
  MK_CHECK(d.upload(peers, reinterpret_cast<uint64_t**>(const_cast<char***>(&l.peer_recv))));
  const MoeHierPools pl = moe_hier_pools(layout, me);
  l.rw0 = r.hook_wait0, l.rwn = pl.repack_waits;
  l.lw0 = r.hook_wait0 + pl.repack_waits, l.lwn = pl.layout_waits;
  l.rs0 = r.hook_signal0, l.rsn = pl.repack_signals;
  return OkStatus();
}

// The operator's launch (after both sessions' setup): sizes, the slot buffers, the routing state
// and error record, the resolved dispatch and combine programs.
Status build_launch(MoeState* st, const comm::Layout& layout, int me, int comm_ctas, int pieces) {
  const MoeGeometry& g = st->g;
  MoeLaunch& l = st->l;
  l = MoeLaunch{};
  l.W = layout.world, l.me = me, l.E = g.E, l.El = g.El, l.k = g.k, l.align = g.align;
  l.H = g.H, l.T = g.T, l.row_bytes = g.row_bytes, l.rec_bytes = g.rec_bytes, l.hdr_bytes = g.hdr_bytes;
  l.slot_bytes = g.slot_bytes, l.chdr_bytes = g.chdr_bytes, l.cslot_bytes = g.cslot_bytes, l.recv_rows = g.recv_rows;
  l.chunk_tokens = route_chunk_tokens(g);
  l.nchunks = route_chunks(g);
  l.small = !st->hier && g.T <= tunables::moe_small_tokens();
  const int64_t direct = tunables::moe_local_dispatch();
  l.direct_rows = layout.world == 1 && (direct == 2 || (direct == 1 && l.small));
  l.pdl = tunables::pdl() != 0;
  l.comm_ctas = comm_ctas;
  l.dP = moe_pieces(g.slot_bytes, pieces), l.dpb = moe_piece_bytes(g.slot_bytes, pieces);
  l.cP = moe_pieces(g.cslot_bytes, pieces), l.cpb = moe_piece_bytes(g.cslot_bytes, pieces);
  comm::OpSession& d = *st->dses;
  comm::OpSession& c = *st->cses;
  l.send = static_cast<char*>(d.local(MoeBuf::kSend));
  l.recv = static_cast<char*>(d.local(MoeBuf::kRecv));
  l.dpiece = static_cast<uint64_t*>(d.local(MoeBuf::kPieceBytes));
  l.csend = static_cast<char*>(c.local(MoeBuf::kSend));
  l.crecv = static_cast<char*>(c.local(MoeBuf::kRecv));
  l.cpiece = static_cast<uint64_t*>(c.local(MoeBuf::kPieceBytes));
  MK_REQUIRE(l.send && l.recv && l.csend && l.crecv && l.dpiece && l.cpiece, Code::kInternal,
             "moe: a slot buffer was not allocated");
  MoeRouteState own;  // the session owns the memory
  MK_CHECK(alloc_route_state(g, layout.nodes(), l.nchunks, st->hier,
                             [&](size_t bytes, void** p) { return d.alloc_zeroed(bytes, p); }, &own));
  set_route_state(l, own);
  MK_CHECK(session_alloc(d, 4, &l.err_claim));
  MK_CHECK(session_alloc(d, 4, &l.scan_done));
  MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&st->err_host), sizeof(MoeErrorRecord),
                              cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(st->err_host, 0, sizeof(MoeErrorRecord));
  MK_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&l.err), st->err_host, 0));
  comm::Resolved r;
  MK_CHECK(d.resolve(st->dprog, st->dprog.ranks[me], &r));
  l.dispatch_program = r.program;
  if (st->hier) MK_CHECK(build_hier_launch(st, layout, me, pieces, r));
  MK_CHECK(c.resolve(st->cprog, st->cprog.ranks[me], &r));
  l.combine_program = r.program;
  MK_CHECK(moe_prepare_launch(l));
  return OkStatus();
}

}  // namespace

Status MoeEp::create(Communicator* comm, const MoeConfig& cfg, const MoeOptions& opt, std::unique_ptr<MoeEp>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "moe: null communicator or output");
  const int W = comm->world(), me = comm->rank();
  Request mine{cfg.hidden,          cfg.max_tokens_per_rank, cfg.recv_capacity,          cfg.num_experts,
               cfg.topk,            cfg.expert_align,        int32_t(cfg.dtype)};
  MK_CHECK(comm::agree_on_request(comm->bootstrap(), mine, "moe", [](const Request& r) {
    char b[200];
    snprintf(b, sizeof b, "hidden %lld experts %d topk %d max_tokens %lld align %d capacity %lld dtype %d",
             (long long)r.hidden, r.experts, r.topk, (long long)r.max_tokens, r.align, (long long)r.recv_capacity,
             r.dtype);
    return std::string(b);
  }));
  MK_CHECK(can_implement(cfg, W));
  std::unique_ptr<MoeEp> op(new MoeEp());
  op->st_ = std::make_unique<MoeState>();
  MoeState* st = op->st_.get();
  st->cfg = cfg;
  st->opt = opt;
  MK_CHECK(moe_geometry(cfg, W, &st->g));
  const MoeGeometry& g = st->g;
  int64_t cc = opt.comm_ctas > 0 ? opt.comm_ctas : tunables::moe_comm_ctas();
  const int comm_ctas = int(std::max<int64_t>(1, std::min<int64_t>(cc, 1024)));
  const int pieces = moe_default_pieces(comm_ctas, W);
  const comm::Layout layout = comm::layout_of(comm->topology());

  const Topology& topo = comm->topology();
  st->hier = use_hier(cfg, opt.mode, topo.num_nodes, topo.local_size);
  st->ng = moe_node_geometry(g, topo.local_size);
  MK_CHECK(comm::OpSession::create(comm, "moe_dispatch", opt.staging, &st->dses));
  MK_CHECK(comm::OpSession::create(comm, "moe_combine", opt.staging, &st->cses));
  if (st->hier)
    MK_CHECK(build_moe_hier_program(layout, g.slot_bytes, st->ng.nslot_bytes, pieces, st->dses->staged(), &st->dprog));
  else
    MK_CHECK(build_moe_program(layout, g.slot_bytes, pieces, st->dses->staged(), "dispatch", &st->dprog));
  MK_CHECK(build_moe_program(layout, g.cslot_bytes, pieces, st->cses->staged(), "combine", &st->cprog));
  MK_CHECK(st->dses->setup(st->dprog));
  MK_CHECK(st->cses->setup(st->cprog));

  MK_CHECK(agree(comm->bootstrap(), build_launch(st, layout, me, comm_ctas, pieces), "moe create"));
  MK_CHECK(comm->bootstrap().barrier());
  *out = std::move(op);
  return OkStatus();
}

MoeEp::~MoeEp() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "moe: destroy: %s", s.to_string().c_str());
}

Status MoeEp::destroy() {
  MoeState* st = st_.get();
  if (!st) return OkStatus();
  Status first;
  if (st->dses) {
    Status s = st->dses->destroy();
    if (first.ok()) first = s;
  }
  if (st->cses) {
    Status s = st->cses->destroy();
    if (first.ok()) first = s;
  }
  return first;
}

const MoeConfig& MoeEp::config() const { return st_->cfg; }
int MoeEp::local_experts() const { return st_->g.El; }
int64_t MoeEp::recv_rows() const { return st_->g.recv_rows; }
int MoeEp::comm_ctas() const { return st_->l.comm_ctas; }
bool MoeEp::hierarchical() const { return st_->hier; }

Status MoeEp::check() const {
  if (st_ && !st_->reported.ok()) return st_->reported;
  const Status s = record_status();
  if (st_ && !s.ok()) st_->reported = s;
  return s;
}

Status MoeEp::record_status() const {
  const MoeErrorRecord* e = st_ ? st_->err_host : nullptr;
  if (!e || *reinterpret_cast<const volatile uint32_t*>(&e->state) == 0) return OkStatus();
  switch (e->kind) {
    case kMoeErrBadExpert:
      return make_status(Code::kInvalidArgument,
                         "moe dispatch on rank %d: token %d top-k slot %d names expert %d (valid: -1 or 0..%lld); the "
                         "entry was left out",
                         e->rank, e->token, e->slot, e->expert, (long long)e->count - 1);
    case kMoeErrTooManyTokens:
      return make_status(Code::kInvalidArgument,
                         "moe dispatch on rank %d: the device token count is %lld, more than the call's %lld rows (or "
                         "negative); the call used %lld",
                         e->rank, (long long)e->count, (long long)e->limit, e->count < 0 ? 0ll : (long long)e->limit);
    case kMoeErrOverflow:
      return make_status(Code::kOutOfMemory,
                         "moe dispatch on rank %d: %lld receive rows needed, capacity %lld (recv_capacity): local "
                         "expert %d and later lost rows (raise recv_capacity)",
                         e->rank, (long long)e->count, (long long)e->limit, e->expert);
    default:
      return make_status(Code::kInternal, "moe on rank %d: device error %d", e->rank, e->kind);
  }
}

namespace {
const MoeLaunch& launch_for(const MoeState& st, const MoeHandleState* h, MoeLaunch* scratch) {
  if (!h) return st.l;
  *scratch = st.l;
  set_route_state(*scratch, h->r);
  return *scratch;
}
}  // namespace

Status MoeEp::create_handle(std::unique_ptr<MoeHandle>* out) {
  MoeState* st = st_.get();
  MK_REQUIRE(out, Code::kInvalidArgument, "moe: null output");
  MK_REQUIRE(st && st->dses && st->dses->alive(), Code::kInvalidArgument,
             "moe: the operator was destroyed (or its communicator was destroyed first)");
  std::unique_ptr<MoeHandle> h(new MoeHandle());
  h->st_ = std::make_unique<MoeHandleState>();
  MoeHandleState* hs = h->st_.get();
  hs->owner = st;
  MK_CHECK(alloc_route_state(st->g, st->dprog.layout.nodes(), st->l.nchunks, st->hier,
                             [&](size_t bytes, void** p) -> Status {
                               MK_CUDA_CHECK(cudaMalloc(p, bytes));
                               hs->mem.push_back(*p);
                               return zero_bounded(*p, bytes, -1, "moe: zeroing a handle's route state");
                             },
                             &hs->r));
  *out = std::move(h);
  return OkStatus();
}

uint64_t MoeEp::handle_bytes() const {
  const MoeState* st = st_.get();
  return st ? route_state_bytes(st->g, st->dprog.layout.nodes(), st->l.nchunks, st->hier) : 0;
}

Status MoeEp::create_handle(void* mem, uint64_t bytes, bool holds_routing, std::unique_ptr<MoeHandle>* out) {
  MoeState* st = st_.get();
  MK_REQUIRE(out, Code::kInvalidArgument, "moe: null output");
  MK_REQUIRE(st && st->dses && st->dses->alive(), Code::kInvalidArgument,
             "moe: the operator was destroyed (or its communicator was destroyed first)");
  MK_REQUIRE(mem && aligned16(mem), Code::kInvalidArgument,
             "moe: a handle's memory must be non-null and 16-byte aligned");
  const uint64_t need = handle_bytes();
  MK_REQUIRE(bytes >= need, Code::kInvalidArgument,
             "moe: a handle's memory of %llu bytes is too small (handle_bytes() %llu)", (unsigned long long)bytes,
             (unsigned long long)need);
  std::unique_ptr<MoeHandle> h(new MoeHandle());
  h->st_ = std::make_unique<MoeHandleState>();
  MoeHandleState* hs = h->st_.get();
  hs->owner = st;
  hs->dispatched = holds_routing;
  // The arrays keep 256-byte boundaries from the block's start: relative to a 16-byte aligned
  // base they stay 16-byte aligned, all the kernels need.
  RouteCarver c{static_cast<char*>(mem), 0, bytes};
  MK_CHECK(alloc_route_state(st->g, st->dprog.layout.nodes(), st->l.nchunks, st->hier, c, &hs->r));
  *out = std::move(h);
  return OkStatus();
}

Status MoeEp::can_implement(const MoeDispatchArgs& a, const MoeDispatchOut& o, const MoeHandle* handle) const {
  const MoeState* st = st_.get();
  MK_REQUIRE(st && st->dses && st->dses->alive() && st->cses->alive(), Code::kInvalidArgument,
             "moe: the operator was destroyed (or its communicator was destroyed first)");
  MK_REQUIRE(a.x && a.topk_ids && o.recv_x && o.counts, Code::kInvalidArgument,
             "moe dispatch: null x, topk_ids, recv_x or counts");
  MK_REQUIRE(aligned16(a.x) && aligned16(o.recv_x), Code::kInvalidArgument,
             "moe dispatch: x and recv_x must be 16-byte aligned");
  MK_REQUIRE(a.tokens >= 0 && a.tokens <= st->g.T, Code::kInvalidArgument,
             "moe dispatch: %lld token rows (max_tokens_per_rank %lld)", (long long)a.tokens, (long long)st->g.T);
  MK_REQUIRE(!handle || (handle->st_ && handle->st_->owner == st), Code::kInvalidArgument,
             "moe dispatch: the handle belongs to another operator");
  return OkStatus();
}

Status MoeEp::can_implement(const MoeCombineArgs& a, const void* out, const MoeHandle* handle) const {
  const MoeState* st = st_.get();
  MK_REQUIRE(st && st->dses && st->dses->alive() && st->cses->alive(), Code::kInvalidArgument,
             "moe: the operator was destroyed (or its communicator was destroyed first)");
  MK_REQUIRE(!handle || (handle->st_ && handle->st_->owner == st), Code::kInvalidArgument,
             "moe combine: the handle belongs to another operator");
  MK_REQUIRE(handle ? handle->st_->dispatched : st->dispatched, Code::kInvalidArgument,
             "moe combine: no dispatch into this handle before it");
  MK_REQUIRE(a.y && out, Code::kInvalidArgument, "moe combine: null y or out");
  MK_REQUIRE(aligned16(a.y) && aligned16(out), Code::kInvalidArgument,
             "moe combine: y and out must be 16-byte aligned");
  return OkStatus();
}

Status MoeEp::dispatch(const MoeDispatchArgs& a, const MoeDispatchOut& o, cudaStream_t stream, MoeHandle* handle) {
  MK_REQUIRE(st_, Code::kInvalidArgument, "moe: the operator was destroyed (or its communicator was destroyed first)");
  // The refusal after a bad input check() reported (MoeState::reported), then the local checks
  // (again in dispatch_enqueue); with the debug tunable check_calls the ranks agree on them first.
  Status local = st_->reported;
  if (local.ok()) local = can_implement(a, o, handle);
  MK_CHECK(st_->dses ? st_->dses->agree_on_call(local, "moe dispatch arguments") : local);
  return dispatch_enqueue(a, o, stream, handle);
}

Status MoeEp::dispatch_enqueue(const MoeDispatchArgs& a, const MoeDispatchOut& o, cudaStream_t stream,
                               MoeHandle* handle) {
  MK_CHECK(can_implement(a, o, handle));
  MoeState* st = st_.get();
  MK_CHECK(st->dses->check_call());
  MoeLaunch with_handle;
  MK_CHECK(moe_dispatch_launch(launch_for(*st, handle ? handle->st_.get() : nullptr, &with_handle), a.x, a.topk_ids,
                               a.topk_weights, a.d_num_tokens, a.tokens, o.recv_x, o.counts, o.offsets, stream));
  (handle ? handle->st_->dispatched : st->dispatched) = true;
  return OkStatus();
}

Status MoeEp::combine(const MoeCombineArgs& a, void* out, cudaStream_t stream, const MoeHandle* handle) {
  MK_REQUIRE(st_, Code::kInvalidArgument, "moe: the operator was destroyed (or its communicator was destroyed first)");
  Status local = st_->reported;
  if (local.ok()) local = can_implement(a, out, handle);
  MK_CHECK(st_->cses ? st_->cses->agree_on_call(local, "moe combine arguments") : local);
  return combine_enqueue(a, out, stream, handle);
}

Status MoeEp::combine_enqueue(const MoeCombineArgs& a, void* out, cudaStream_t stream, const MoeHandle* handle) {
  MK_CHECK(can_implement(a, out, handle));
  MoeState* st = st_.get();
  MK_CHECK(st->cses->check_call());
  MoeLaunch with_handle;
  return moe_combine_launch(launch_for(*st, handle ? handle->st_.get() : nullptr, &with_handle), a.y, a.topk_weights,
                            out, stream);
}

}  // namespace ops
}  // namespace mk
