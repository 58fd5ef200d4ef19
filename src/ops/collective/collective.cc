// Standalone collectives: the program's resolution, the workspaces, the network stack, launch.
#include "mkernel/ops/collective.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/runtime/communicator.h"
#include "src/comm/session.h"
#include "src/ops/collective/collective_launch.h"
#include "src/ops/collective/collective_plan.h"

namespace mk {
namespace ops {

struct CollectiveState {
  std::unique_ptr<comm::OpSession> session;  // workspaces, pad, epoch, network; the comm attachment
  CollPlan plan;                             // kind, dtype and count as asked
  comm::DeviceProgram program{};  // the resolved program
  int ctas = 1;
};

namespace {

struct Request {
  int32_t kind, dtype;
  int64_t count, chunk_elems;
};

std::string describe_request(const Request& r) {
  char b[160];
  snprintf(b, sizeof b, "%s %s of %lld elements (chunks of %lld)", collective_kind_name(CollectiveKind(r.kind)),
           coll_dtype_name(CollDType(r.dtype)), (long long)r.count, (long long)r.chunk_elems);
  return b;
}

// The SMs this process may use: the GPU's, or under MPS with an active thread percentage the
// client's share (the runtime reports that: 33 of an H100's 132 at 25 %).
Status sm_count(int* out) {
  int dev = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  MK_CUDA_CHECK(cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, dev));
  return OkStatus();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
bool overlaps(const void* p, uint64_t pb, const void* q, uint64_t qb) {
  auto x = reinterpret_cast<uintptr_t>(p), y = reinterpret_cast<uintptr_t>(q);
  return x < y + qb && y < x + pb;
}

}  // namespace

Status Collective::create(Communicator* comm, CollectiveKind kind, int64_t count, CollDType dtype,
                          const CollectiveOptions& opt, std::unique_ptr<Collective>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "collective: null communicator or output");
  const char* name = collective_kind_name(kind);
  // Every rank asked for the same thing first (a rank whose request alone is bad would otherwise
  // leave the others waiting in the agreement); then the rules, the same outcome everywhere.
  Request req{int32_t(kind), int32_t(dtype), count, opt.chunk_elems};
  MK_CHECK(comm::agree_on_request(comm->bootstrap(), req, name, describe_request));
  MK_CHECK(can_implement(kind, count, dtype, comm->world()));
  // The CTA count is this rank's own (it need not agree): its error is agreed, so no rank goes on
  // into the collective steps below without the others.
  const Status local = opt.ctas >= 0 && opt.chunk_elems >= 0
                           ? OkStatus()
                           : make_status(Code::kInvalidArgument,
                                         "%s: ctas (%d) and chunk_elems (%lld) must be >= 0 (0: the default)", name,
                                         opt.ctas, (long long)opt.chunk_elems);
  MK_CHECK(agree(comm->bootstrap(), local, std::string(name) + " options"));
  std::unique_ptr<Collective> op(new Collective());
  op->st_ = std::make_unique<CollectiveState>();
  CollectiveState* st = op->st_.get();
  const comm::Layout layout = comm::layout_of(comm->topology());
  // Same inputs on every rank: the plan (or its error) is the same everywhere.
  MK_CHECK(build_coll_plan(kind, count, dtype, layout, opt.chunk_elems, false, &st->plan));
  MK_CHECK(comm::OpSession::create(comm, name, opt.staging, &st->session));
  // The network decides how data crosses nodes; the plan follows.
  if (st->session->staged()) MK_CHECK(build_coll_plan(kind, count, dtype, layout, opt.chunk_elems, true, &st->plan));
  MK_CHECK(st->session->setup(st->plan));
  comm::Resolved r;
  Status rs = st->session->resolve(st->plan, st->plan.ranks[comm->rank()], &r);
  if (rs.ok()) {
    st->program = r.program;
    int sms = 0;
    rs = sm_count(&sms);
    // At most one CTA per op (a CTA takes one op at a time); by default half the SMs this
    // process may use: all-reduce of 64 MiB at W = 4 on one H100 under MPS (2026-12-05, one-off
    // sweeps of 4 to 132 CTAs) was fastest at 16 CTAs of a 33-SM share: 0.75-0.80 of a device
    // copy, against 0.64-0.73 at 32 and 0.24 at 4.
    const int want = opt.ctas > 0 ? opt.ctas : std::max(1, sms / 2);
    st->ctas = std::max(1, std::min(want, std::max<int>(1, st->program.n_ops)));
  }
  MK_CHECK(agree(comm->bootstrap(), rs, std::string(name) + " plan"));
  MK_CHECK(comm->bootstrap().barrier());
  MK_TRACE(kSubsysInit, "%s", describe(st->plan, comm->rank()).c_str());
  *out = std::move(op);
  return OkStatus();
}

Collective::~Collective() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "collective: destroy: %s", s.to_string().c_str());
}

Status Collective::destroy() {
  CollectiveState* st = st_.get();
  if (!st || !st->session) return OkStatus();
  return st->session->destroy();
}

CollectiveKind Collective::kind() const { return st_->plan.kind; }
CollDType Collective::dtype() const { return st_->plan.dtype; }
int64_t Collective::count() const { return st_->plan.count; }
int64_t Collective::in_elems() const { return st_->plan.in_elems(); }
int64_t Collective::out_elems() const { return st_->plan.out_elems(); }
int Collective::ctas() const { return st_->ctas; }
void* Collective::input() const {
  if (!st_->session || !st_->session->alive()) return nullptr;
  return st_->session->local(CBuf::kIn);
}
void* Collective::output() const {
  if (st_->plan.kind != CollectiveKind::kAllReduce || !st_->session || !st_->session->alive()) return nullptr;
  return st_->session->local(CBuf::kOut);
}

Status Collective::can_implement(const CollectiveArgs& a) const {
  const CollectiveState* st = st_.get();
  MK_REQUIRE(st && st->session && st->session->alive(), Code::kInvalidArgument,
             "collective: the operator was destroyed (or its communicator was destroyed first)");
  const char* name = collective_kind_name(st->plan.kind);
  MK_REQUIRE(a.in && a.out, Code::kInvalidArgument, "%s: null input or output", name);
  MK_REQUIRE(aligned16(a.in) && aligned16(a.out), Code::kInvalidArgument, "%s: input and output must be 16-byte aligned",
             name);
  const uint64_t es = uint64_t(st->plan.esize());
  const uint64_t ib = uint64_t(in_elems()) * es, ob = uint64_t(out_elems()) * es;
  const void* ws_in = input();
  // The input is copied into the workspace before the kernel (unless it is the workspace): a
  // partial overlap would make that copy undefined.
  MK_REQUIRE(a.in == ws_in || !overlaps(a.in, ib, ws_in, ib), Code::kInvalidArgument,
             "%s: the input overlaps the operator's input workspace (pass input() itself, or memory apart from it)",
             name);
  if (st->plan.kind == CollectiveKind::kAllReduce) {
    // The result is copied out of output() after the kernel (unless the output is output()).
    const void* ws_out = output();
    MK_REQUIRE(a.out == ws_out || !overlaps(a.out, ob, ws_out, ob), Code::kInvalidArgument,
               "%s: the output overlaps the operator's output workspace (pass output() itself, or memory apart "
               "from it)",
               name);
  } else {
    // The kernel writes the output while the node's ranks read the input workspace.
    MK_REQUIRE(!overlaps(a.out, ob, ws_in, ib), Code::kInvalidArgument,
               "%s: the output overlaps the operator's input workspace (input())", name);
  }
  return OkStatus();
}

Status Collective::run(const CollectiveArgs& a, cudaStream_t stream) {
  if (st_->session)
    MK_CHECK(st_->session->agree_on_call(can_implement(a), std::string(collective_kind_name(st_->plan.kind)) + " arguments"));
  return enqueue(a, stream);
}

Status Collective::enqueue(const CollectiveArgs& a, cudaStream_t stream) {
  CollectiveState* st = st_.get();
  MK_CHECK(can_implement(a));
  MK_CHECK(st->session->check_call());
  const uint64_t es = uint64_t(st->plan.esize());
  const uint64_t ib = uint64_t(in_elems()) * es, ob = uint64_t(out_elems()) * es;
  if (st->session->comm()->world() == 1) {
    // One rank: every collective is the identity.
    if (a.out != a.in) MK_CUDA_CHECK(cudaMemcpyAsync(a.out, a.in, ob, cudaMemcpyDeviceToDevice, stream));
    return OkStatus();
  }
  // Stream order: the copy in follows the previous call, whose end waited until the node's ranks
  // were done reading this workspace; it precedes this call's entry signal.
  void* ws_in = st->session->local(CBuf::kIn);
  if (a.in != ws_in) MK_CUDA_CHECK(cudaMemcpyAsync(ws_in, a.in, ib, cudaMemcpyDeviceToDevice, stream));
  comm::DeviceProgram h = st->program;
  if (st->plan.kind != CollectiveKind::kAllReduce) h.user[kCollUserSlotOut] = a.out;
  MK_CHECK(collective_launch(h, st->ctas, stream));
  if (st->plan.kind == CollectiveKind::kAllReduce) {
    void* ws_out = st->session->local(CBuf::kOut);
    if (a.out != ws_out) MK_CUDA_CHECK(cudaMemcpyAsync(a.out, ws_out, ob, cudaMemcpyDeviceToDevice, stream));
  }
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
