// The session of one fused operator (see src/comm/session.h).
#include "src/comm/session.h"

#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/common/fault.h"

namespace mk {
namespace comm {

Status agree_on_request_bytes(Bootstrap& bs, const void* mine, size_t bytes, const char* what,
                              const std::function<std::string(const void*)>& describe) {
  const int W = bs.size();
  std::vector<uint8_t> all(size_t(W) * bytes);
  MK_CHECK(bs.allgather(mine, all.data(), bytes));
  for (int r = 1; r < W; ++r)
    if (std::memcmp(all.data(), all.data() + size_t(r) * bytes, bytes) != 0)
      return make_status(Code::kMismatch, "%s: ranks disagree: rank 0 has %s, rank %d has %s", what,
                         describe(all.data()).c_str(), r, describe(all.data() + size_t(r) * bytes).c_str());
  return OkStatus();
}

Layout layout_of(const Topology& t) {
  Layout l;
  l.world = t.world;
  l.node_of = t.node_of;
  l.local_of = t.local_rank_of;
  l.node_ranks = t.node_ranks;
  return l;
}

Status OpSession::create(Communicator* comm, const std::string& name, const std::string& staging,
                         std::unique_ptr<OpSession>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "%s: null communicator or output", name.c_str());
  MK_REQUIRE(comm->has_gpu(), Code::kNotSupported, "%s: this rank has no GPU", name.c_str());
  MK_REQUIRE(!comm->destroyed(), Code::kInvalidArgument, "%s: the communicator was destroyed", name.c_str());
  std::unique_ptr<OpSession> s(new OpSession());
  s->comm_ = comm;
  s->name_ = name;
  s->tag_ = op_tag_register(name.c_str());
  s->check_calls_ = tunables::check_calls() != 0;
  comm->attach(s.get());
  s->attached_ = true;
  if (comm->topology().node_ranks.size() > 1) MK_CHECK(NetSession::create(comm, staging, &s->net_));
  *out = std::move(s);
  return OkStatus();
}

OpSession::~OpSession() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "%s: destroy: %s", name_.c_str(), s.to_string().c_str());
}

void OpSession::on_communicator_destroy() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "%s: destroy: %s", name_.c_str(), s.to_string().c_str());
}

Status OpSession::setup(const ProgramDecl& decl) {
  Communicator* c = comm_;
  const size_t nb = decl.bufs.size();
  sym_.assign(nb, nullptr);
  host_.assign(nb, nullptr);
  win_.assign(nb, 0);
  auto fill_token = [&](const BufDecl& d) {
    return std::vector<uint64_t>(d.bytes / 8, uint64_t(c->rank()));
  };
  Status st = [&]() -> Status {
    for (size_t b = 0; b < nb; ++b) {
      const BufDecl& d = decl.bufs[b];
      if (!d.bytes || d.space != Space::kSymmetric) continue;
      MK_CHECK(c->heap().alloc(d.bytes, &sym_[b]));
      MK_CUDA_CHECK(cudaMemsetAsync(sym_[b]->local(), 0, sym_[b]->mapped_size(), c->setup_stream()));
      if (d.rank_token) {
        const std::vector<uint64_t> w = fill_token(d);
        MK_CUDA_CHECK(cudaMemcpyAsync(sym_[b]->local(), w.data(), w.size() * 8, cudaMemcpyHostToDevice,
                                      c->setup_stream()));
      }
    }
    MK_CHECK(c->alloc_signals(decl.pad_flags, &pad_));
    MK_CHECK(c->alloc_epoch(&epoch_));
    return sync_stream_bounded(c->setup_stream(), 60000, (name_ + ": zeroing the workspaces").c_str());
  }();
  MK_CHECK(agree(c->bootstrap(), st, name_ + " workspaces"));
  if (!net_) return OkStatus();
  MK_REQUIRE(decl.net_staged == net_->staged(), Code::kInternal, "%s: the program's staging differs from the network's",
             name_.c_str());
  for (size_t b = 0; b < nb; ++b) {
    const BufDecl& d = decl.bufs[b];
    if (!d.bytes || !d.network) continue;
    if (d.space == Space::kHost) {
      MK_CHECK(net_->add_host_window(d.bytes, &host_[b], &win_[b]));
      if (d.rank_token) {
        const std::vector<uint64_t> w = fill_token(d);
        memcpy(host_[b], w.data(), w.size() * 8);
      }
    } else if (d.space == Space::kSymmetric) {
      MK_REQUIRE(sym_[b], Code::kInternal, "%s: network buffer %s was not allocated", name_.c_str(), d.name.c_str());
      MK_CHECK(net_->add_gpu_window(sym_[b]->local(), sym_[b]->size(), &win_[b]));
    }
  }
  return net_->start(decl.pad_flags);
}

void* OpSession::local(BufId b) const {
  if (b < sym_.size() && sym_[b]) return sym_[b]->local();
  if (b < host_.size()) return host_[b];
  return nullptr;
}

SymmetricBuffer* OpSession::symmetric(BufId b) const { return b < sym_.size() ? sym_[b] : nullptr; }

Status OpSession::region_addr(const ProgramDecl& p, RegionId r, int rank, uint64_t** out) const {
  MK_REQUIRE(r < p.regions.size(), Code::kInternal, "%s: unknown flag region %d", name_.c_str(), int(r));
  const uint32_t first = p.region_offset[r];
  if (p.proxy_region(r)) {
    // Raised by this rank's proxy with host stores, waited on by this rank only.
    MK_REQUIRE(net_ && rank == comm_->rank(), Code::kInternal, "%s: proxy flags %s of rank %d used on rank %d",
               name_.c_str(), p.region_name(r), rank, comm_->rank());
    *out = net_->flags() + first;
    return OkStatus();
  }
  void* base = pad_ ? pad_->peer(rank) : nullptr;
  MK_REQUIRE(base, Code::kInternal, "%s: the signal pad of rank %d is not mapped here", name_.c_str(), rank);
  *out = static_cast<uint64_t*>(base) + first;
  return OkStatus();
}

Status OpSession::upload_bytes(const void* src, size_t bytes, void** out) {
  *out = nullptr;
  if (!bytes) return OkStatus();
  MK_CUDA_CHECK(cudaMalloc(out, bytes));
  dev_allocs_.push_back(*out);
  // On the communicator's setup stream (non-blocking), bounded: another library's hung work does
  // not hang the operator's creation.
  MK_CUDA_CHECK(cudaMemcpyAsync(*out, src, bytes, cudaMemcpyHostToDevice, comm_->setup_stream()));
  return sync_stream_bounded(comm_->setup_stream(), device_setup_timeout_ms(), (name_ + ": uploading its tables").c_str());
}

Status OpSession::alloc_zeroed(size_t bytes, void** out) {
  MK_CUDA_CHECK(cudaMalloc(out, bytes));
  dev_allocs_.push_back(*out);
  MK_CUDA_CHECK(cudaMemsetAsync(*out, 0, bytes, comm_->setup_stream()));
  return sync_stream_bounded(comm_->setup_stream(), device_setup_timeout_ms(), (name_ + ": zeroing a workspace").c_str());
}

Status OpSession::check_call() const {
  MK_REQUIRE(!destroyed_, Code::kInvalidArgument,
             "%s: the operator was destroyed (or its communicator was destroyed first)", name_.c_str());
  // A failed communicator (a device wait gave up, the network failed) runs nothing more: its
  // flags and epochs are no longer consistent across ranks. Destroy it and create a new one.
  MK_CHECK(comm_->check());
  // Fault-injection tests (src/common/fault.h): this call is refused here alone, or the
  // process dies or stops while its kernel and its peers' are in flight.
  const fault::Action f = fault::at(fault::Site::kCall, comm_->rank());
  if (f == fault::Action::kBadInput)
    return make_status(Code::kInvalidArgument, "%s: rank %d: bad input on this rank alone (%s)", name_.c_str(),
                       comm_->rank(), fault::planted(fault::Site::kCall, comm_->rank()).c_str());
  fault::carry_out_later(f);
  return OkStatus();
}

Status OpSession::agree_on_call(const Status& local, const std::string& what) {
  if (!check_calls_ || destroyed_) return local;
  return agree(comm_->bootstrap(), local, what);
}

Status OpSession::address(const ProgramDecl& p, const BufRef& r, uint64_t* a) const {
  const int me = comm_->rank();
  const char* name = name_.c_str();
  MK_REQUIRE(r.buf < p.bufs.size(), Code::kInternal, "%s: unknown buffer %d", name, int(r.buf));
  const BufDecl& d = p.bufs[r.buf];
  MK_REQUIRE(r.offset <= d.bytes, Code::kInternal, "%s: %s past its %llu bytes", name, ref_str(p, r).c_str(),
             (unsigned long long)d.bytes);
  if (d.space == Space::kUser) {
    MK_REQUIRE(r.rank == me && d.user_slot >= 0 && d.user_slot < 2, Code::kInternal,
               "%s: caller buffer %s used on rank %d", name, ref_str(p, r).c_str(), me);
    *a = user_ptr(d.user_slot, r.offset);
    return OkStatus();
  }
  if (d.space == Space::kHost) {
    MK_REQUIRE(r.rank == me && host_[r.buf], Code::kInternal, "%s: host mirror %s used on rank %d", name,
               ref_str(p, r).c_str(), me);
    *a = reinterpret_cast<uint64_t>(static_cast<char*>(host_[r.buf]) + r.offset);
    return OkStatus();
  }
  SymmetricBuffer* b = sym_[r.buf];
  MK_REQUIRE(b, Code::kInternal, "%s: buffer %s was not allocated", name, d.name.c_str());
  void* base = b->peer(r.rank);
  MK_REQUIRE(base, Code::kInternal, "%s: %s is not mapped here", name, ref_str(p, r).c_str());
  *a = reinterpret_cast<uint64_t>(static_cast<char*>(base) + r.offset);
  return OkStatus();
}

namespace {

// A rank's program as device arrays, op by op (OpSession::resolve): the ops, and the pools of
// waits, signals and pointers they and the compute side index.
class Resolver {
 public:
  Resolver(const OpSession& ses, const ProgramDecl& p, const std::vector<uint32_t>& windows, bool networked)
      : ses_(ses), p_(p), win_(windows), networked_(networked), me_(ses.comm()->rank()), name_(ses.name().c_str()) {}

  Status add_wait(const Wait& w) {
    MK_REQUIRE(w.flag.rank == me_, Code::kInternal, "%s: a wait on rank %d's flag", name_, w.flag.rank);
    DevWait d{};
    uint64_t* a = nullptr;
    MK_CHECK(flag_addr(w.flag, &a));
    d.flag = a;
    d.mul = w.mul;
    d.peer = w.peer;
    d.index = int32_t(p_.flag_index(w.flag));
    waits.push_back(d);
    return OkStatus();
  }
  Status add_signal(const Signal& g) {
    MK_REQUIRE(!p_.proxy_region(g.flag.region), Code::kInternal, "%s: device signal on proxy flag %s", name_,
               flag_str(p_, g.flag).c_str());
    DevSignal d{};
    MK_CHECK(flag_addr(g.flag, &d.flag));
    d.value = g.value;
    d.add = g.add ? 1 : 0;
    sigs.push_back(d);
    return OkStatus();
  }
  // Op `index` of the rank's list.
  Status add_op(size_t index, const Op& op) {
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
    bool host = false;
    for (const auto& r : op.srcs) host |= p_.is_host(r.buf);
    for (const auto& r : op.dsts) host |= p_.is_host(r.buf);
    if (host) d.flags |= kDevOpHostMem;
    if (op.src_bf16) {
      MK_REQUIRE(op.kind == OpKind::kReduce, Code::kInternal, "%s: op '%s': bf16 sources on a %s", name_,
                 op.what.c_str(), op_kind_name(op.kind));
      d.flags |= kDevOpSrcBf16;
    }
    MK_CHECK(op.kind == OpKind::kNetPut ? put_operands(index, op, &d) : plain_operands(op, &d));
    if (op.count_at.buf != kNoBuf) {
      MK_REQUIRE(op.kind == OpKind::kCopy || op.kind == OpKind::kZero || op.kind == OpKind::kNetPut, Code::kNotSupported,
                 "%s: op '%s': a run-time byte count on a %s", name_, op.what.c_str(), op_kind_name(op.kind));
      MK_REQUIRE(op.count_at.rank == me_ && op.count_at.offset % 8 == 0, Code::kInternal,
                 "%s: op '%s' reads its byte count from %s", name_, op.what.c_str(), ref_str(p_, op.count_at).c_str());
      d.flags |= kDevOpCountAt;
      d.count_ptr = uint32_t(ptrs.size());
      MK_CHECK(add_ptr(op.count_at));
    }
    dops.push_back(d);
    return OkStatus();
  }

  std::vector<DevOp> dops;
  std::vector<DevWait> waits;
  std::vector<DevSignal> sigs;
  std::vector<uint64_t> ptrs;

 private:
  Status flag_addr(const FlagRef& f, uint64_t** a) const {
    MK_REQUIRE(f.region < p_.regions.size() && f.index < p_.regions[f.region].size, Code::kInternal,
               "%s: flag %s outside its region", name_, flag_str(p_, f).c_str());
    MK_CHECK(ses_.region_addr(p_, f.region, f.rank, a));
    *a += f.index;
    return OkStatus();
  }
  Status add_ptr(const BufRef& r) {
    uint64_t a = 0;
    MK_CHECK(ses_.address(p_, r, &a));
    ptrs.push_back(a);
    return OkStatus();
  }
  // A network put: the proxy command (windows, offsets, flags), and when staged the copy into
  // the host mirror first.
  Status put_operands(size_t index, const Op& op, DevOp* d) {
    MK_REQUIRE(networked_, Code::kInternal, "%s: a network put without a network session", name_);
    MK_REQUIRE(op.srcs.size() == 1 && op.dsts.size() == 1 && op.srcs[0].rank == me_ && op.dsts[0].rank == op.peer,
               Code::kInternal, "%s: malformed put '%s'", name_, op.what.c_str());
    const BufRef& s = op.srcs[0];
    const BufRef& t = op.dsts[0];
    MK_REQUIRE(p_.bufs[s.buf].network && p_.bufs[t.buf].network, Code::kInternal,
               "%s: put '%s' between buffers that are not network windows", name_, op.what.c_str());
    MK_REQUIRE(op.remote_flag.rank == op.peer && p_.proxy_region(op.remote_flag.region), Code::kInternal,
               "%s: put '%s' raises %s", name_, op.what.c_str(), flag_str(p_, op.remote_flag).c_str());
    const bool local_flag = op.local_flag.region != kNoRegion;
    d->cmd = make_put(op.peer, win_[s.buf], s.offset, win_[t.buf], t.offset, op.bytes, p_.flag_index(op.remote_flag),
                      local_flag ? p_.flag_index(op.local_flag) : kNoFlag, index);
    if (op.stage_src.buf != kNoBuf) {
      // Staged: the device copies the source into the host mirror, then pushes the put.
      MK_REQUIRE(op.bytes % 16 == 0, Code::kInternal, "%s: staged put '%s' is not 16-byte sized", name_,
                 op.what.c_str());
      d->nsrc = d->ndst = 1;
      d->flags |= kDevOpHostMem;
      MK_CHECK(add_ptr(op.stage_src));
      MK_CHECK(add_ptr(s));
    }
    return OkStatus();
  }
  // A copy, reduce, zero or signal: its sources, then its destinations, in the pointer pool.
  Status plain_operands(const Op& op, DevOp* d) {
    MK_REQUIRE(op.srcs.size() + op.dsts.size() <= size_t(kMaxOpBuffers), Code::kNotSupported,
               "%s: op '%s' touches %zu buffers (at most 16: fewer nodes or ranks per node)", name_, op.what.c_str(),
               op.srcs.size() + op.dsts.size());
    MK_REQUIRE(op.bytes % 16 == 0 && op.elems % 4 == 0, Code::kInternal, "%s: op '%s' is not 16-byte sized", name_,
               op.what.c_str());
    d->nsrc = uint32_t(op.srcs.size());
    d->ndst = uint32_t(op.dsts.size());
    for (const auto& r : op.srcs) MK_CHECK(add_ptr(r));
    for (const auto& r : op.dsts) MK_CHECK(add_ptr(r));
    return OkStatus();
  }

  const OpSession& ses_;
  const ProgramDecl& p_;
  const std::vector<uint32_t>& win_;
  const bool networked_;
  const int me_;
  const char* name_;
};

}  // namespace

Status OpSession::resolve(const ProgramDecl& p, const RankProgram& rp, Resolved* out) {
  Resolver r(*this, p, win_, net_ != nullptr);
  for (size_t i = 0; i < rp.ops.size(); ++i) MK_CHECK(r.add_op(i, rp.ops[i]));
  out->hook_wait0 = uint32_t(r.waits.size());
  out->hook_signal0 = uint32_t(r.sigs.size());
  for (const auto& w : rp.waits) MK_CHECK(r.add_wait(w));
  for (const auto& g : rp.signals) MK_CHECK(r.add_signal(g));
  DeviceProgram& h = out->program;
  h = DeviceProgram{};
  MK_CHECK(upload(r.dops, const_cast<DevOp**>(&h.ops)));
  h.n_ops = int32_t(r.dops.size());
  h.world = p.layout.world;
  MK_CHECK(upload(r.waits, const_cast<DevWait**>(&h.waits)));
  MK_CHECK(upload(r.sigs, const_cast<DevSignal**>(&h.signals)));
  MK_CHECK(upload(r.ptrs, const_cast<uint64_t**>(&h.ptrs)));
  void* ctr = nullptr;
  MK_CHECK(alloc_zeroed(sizeof(int), &ctr));
  h.op_counter = static_cast<int*>(ctr);
  h.epoch = epoch_;
  h.wait = wait_ctx(Role::kComm);
  if (net_) h.ring = net_->ring_view(h.wait.abort);
  return OkStatus();
}

Status OpSession::destroy() {
  if (destroyed_) return OkStatus();
  destroyed_ = true;
  Status first;
  auto keep = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  if (net_) keep(net_->destroy());
  for (void* p : dev_allocs_) cudaFree(p);
  dev_allocs_.clear();
  for (size_t b = sym_.size(); b-- > 0;)
    if (sym_[b]) keep(comm_->heap().free(sym_[b]));
  sym_.clear();
  if (pad_) keep(comm_->heap().free(pad_));
  pad_ = nullptr;
  if (attached_) comm_->detach(this);
  attached_ = false;
  return first;
}

}  // namespace comm
}  // namespace mk
