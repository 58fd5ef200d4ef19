// Fused GEMM collectives: plan resolution, workspaces, the network stack, launch.
#include "mkernel/ops/fused.h"
#include "src/ops/fused_gemm/fused_gemm_plan.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/comm/device_program.h"
#include "mkernel/runtime/communicator.h"
#include "src/gemm/fused_launch.h"
#include "src/comm/session.h"
#include "src/common/deadline.h"
#include "mkernel/ops/collective.h"
#include "src/ops/control/path_policy.h"
#include "src/ops/control/split_controller.h"
#include "src/ops/control/split_memory.h"
#include "src/ops/fused_gemm/fused_gemm_testing.h"

namespace mk {
namespace ops {

struct FusedState {
  std::unique_ptr<comm::OpSession> session;  // workspaces, pad, epoch, network; the comm attachment
  FusedKind kind = FusedKind::kAgGemm;
  PlanShape shape;
  FusedOptions opt;
  Plan plan;
  int comm_ctas = 0;
  bool route_bulk = true;  // RS/AR: the epilogue's TMA boxes (tunable fused_route)
  const void* last_a = nullptr;  // one rank: the caller's A of the last call
  comm::DeviceProgram program{};     // the resolved program
  gemm::RouteEpilogue route_epi{};   // RS/AR: where the epilogue sends its tiles
  int* d_role = nullptr;   // communication CTAs (device; set_comm_ctas changes it)
  int* d_tile_counter = nullptr;
  int* d_order = nullptr;
  // The SM-partition controller (fused_split=auto and no comm_ctas option), on until
  // set_comm_ctas fixes a count.
  SplitController split;
  // The path of each call (FusedOptions::path / fused_path) and, unless always fused, the
  // unfused path's collective (W > 1).
  PathPolicy policy;
  std::unique_ptr<Collective> coll;
  std::string path_key;  // SplitMemory key of the path auto chose
  struct Timing {
    cudaEvent_t start = nullptr, stop = nullptr;
    Path path = Path::kFused;
  };
  std::vector<Timing> timings;  // auto: the timed calls (events read, then freed, at the decision)
  void free_timings() {
    for (auto& t : timings) {
      if (t.start) cudaEventDestroy(t.start);
      if (t.stop) cudaEventDestroy(t.stop);
    }
    timings.clear();
  }
  ~FusedState() { free_timings(); }
};

namespace {

struct Request {
  int32_t kind, deterministic;
  int64_t M, N, K;
  int32_t path, nrows;
  uint64_t rows_hash;  // PlanShape::rows (FNV-1a of the counts; 0 and nrows 0 without them)
};

std::string describe_request(const Request& r) {
  char b[240];
  snprintf(b, sizeof b, "%s (M %lld, N %lld, K %lld%s, path %s, %s)", fused_kind_name(FusedKind(r.kind)), (long long)r.M,
           (long long)r.N, (long long)r.K, r.deterministic ? ", deterministic" : "", path_mode_name(PathMode(r.path)),
           r.nrows ? ("shard rows given, hash " + std::to_string(r.rows_hash)).c_str() : "even shards");
  return b;
}

// AG and RS with uneven shards: the standalone collectives take equal shards, so no unfused path.
bool unfused_possible(FusedKind kind, const Plan& p) { return p.even || kind == FusedKind::kGemmAr; }

// The unfused path's collective: AG all-gathers the A shards, RS/AR reduce the GEMM's [M, N].
Status create_unfused(Communicator* comm, FusedState* st) {
  const int64_t W = comm->world(), M = st->shape.M, N = st->shape.N, K = st->shape.K;
  CollectiveOptions o;
  o.staging = st->opt.staging;
  switch (st->kind) {
    case FusedKind::kAgGemm:  // even shards only (unfused_possible)
      return Collective::create(comm, CollectiveKind::kAllGather, M / W * K, CollDType::kBF16, o, &st->coll);
    case FusedKind::kGemmRs:
      return Collective::create(comm, CollectiveKind::kReduceScatter, M / W * N, CollDType::kBF16, o, &st->coll);
    case FusedKind::kGemmAr:
      return Collective::create(comm, CollectiveKind::kAllReduce, M * N, CollDType::kBF16, o, &st->coll);
  }
  return make_status(Code::kInternal, "fused: unknown kind");
}

// Auto: a path remembered for this key on every rank (SplitMemory's file) is taken at once; the
// ranks agree on it (a host collective at create), else they learn it again.
Status preset_path(Communicator* comm, FusedState* st) {
  int mine = 0;
  SplitMemory::process().lookup(st->path_key, &mine);
  std::vector<int32_t> all(size_t(comm->world()), 0);
  const int32_t m32 = mine;
  MK_CHECK(comm->bootstrap().allgather(&m32, all.data(), sizeof m32));
  const bool same = std::all_of(all.begin(), all.end(), [&](int32_t v) { return v == all[0]; });
  if (same && (all[0] == 1 || all[0] == 2)) st->policy.preset(all[0] == 2 ? Path::kUnfused : Path::kFused);
  return OkStatus();
}

// The rank's plan as device arrays: the program through the session's resolver, then the GEMM's
// side (tile-row hooks into the resolved pools, the epilogue's routes, the tile order).
Status resolve(FusedState* st) {
  comm::OpSession& ses = *st->session;
  const Plan& p = st->plan;
  const int me = ses.comm()->rank();
  const RankPlan& rp = p.ranks[me];
  comm::Resolved r;
  MK_CHECK(ses.resolve(p, rp, &r));
  std::vector<comm::DevRowHooks> rows;
  for (const auto& h : rp.rows)
    rows.push_back(comm::DevRowHooks{r.hook_wait0 + h.load_wait0, h.load_waits, r.hook_wait0 + h.store_wait0, h.store_waits,
                               r.hook_signal0 + h.store_sig0, h.store_sigs});
  // Buffer references as op pointer entries (device addresses, or caller-buffer entries).
  auto addresses = [&](const std::vector<comm::BufRef>& refs, std::vector<uint64_t>* out) -> Status {
    for (const auto& ref : refs) {
      uint64_t a = 0;
      MK_CHECK(ses.address(p, ref, &a));
      out->push_back(a);
    }
    return OkStatus();
  };
  auto as_floats = [](const std::vector<uint64_t>& v) {
    std::vector<float*> f;
    for (uint64_t a : v) f.push_back(reinterpret_cast<float*>(a));
    return f;
  };
  std::vector<uint64_t> route_addr;  // the workspaces of this node's reducers
  MK_CHECK(addresses(rp.route, &route_addr));
  std::vector<float*> route = as_floats(route_addr);
  st->program = r.program;
  MK_CHECK(ses.upload(rows, const_cast<comm::DevRowHooks**>(&st->program.rows)));
  gemm::RouteEpilogue& h = st->route_epi;
  h = gemm::RouteEpilogue{};
  MK_CHECK(ses.upload(route, const_cast<float***>(&h.route)));
  if (!route.empty() && st->route_bulk) {
    std::vector<uint8_t> maps;
    std::vector<int64_t> rows;
    for (int s = 0; s < int(route.size()); ++s) rows.push_back(p.rows_of(s));
    MK_CHECK(gemm::route_tensor_maps(route.data(), int(route.size()), rows.data(), p.shape.N, &maps));
    MK_CHECK(ses.upload(maps, reinterpret_cast<uint8_t**>(const_cast<void**>(&h.route_maps))));
  }
  h.world = int32_t(route.size());
  // Even shards: the shard of a row is a division; uneven: a search of the shards' first rows.
  h.shard_rows = p.even ? p.shard_rows : 0;
  h.shard_row0 = nullptr;
  if (!route.empty() && !p.even) {
    std::vector<int32_t> row0(p.shard_row0.begin(), p.shard_row0.end());
    MK_CHECK(ses.upload(row0, const_cast<int32_t**>(&h.shard_row0)));
  }
  h.fin_lo = h.fin_hi = 0;
  if (rp.fin.on) {
    std::vector<uint64_t> src_addr, dsts;
    MK_CHECK(addresses(rp.fin.srcs, &src_addr));
    MK_CHECK(addresses(rp.fin.dsts, &dsts));
    std::vector<float*> srcs = as_floats(src_addr);
    MK_REQUIRE(!srcs.empty() && !dsts.empty(), Code::kInternal, "%s: an epilogue final sum without terms",
               fused_kind_name(p.kind));
    MK_CHECK(ses.upload(srcs, const_cast<float***>(&h.fin_srcs)));
    MK_CHECK(ses.upload(dsts, const_cast<uint64_t**>(&h.fin_dsts)));
    h.fin_row0 = rp.fin.row0;
    h.fin_lo = rp.fin.lo;
    h.fin_hi = rp.fin.hi;
    h.fin_nsrc = int32_t(srcs.size());
    h.fin_self = rp.fin.self;
    h.fin_ndst = int32_t(dsts.size());
    h.fin_zero = rp.fin.zero_srcs ? 1 : 0;
  }
  h.route_store = p.deterministic ? 1 : 0;
  std::vector<int> counters{st->comm_ctas, 0};
  int* dc = nullptr;
  MK_CHECK(ses.upload(counters, &dc));
  st->d_role = dc;
  st->d_tile_counter = dc + 1;
  // AG takes its ops in order (no peeking: FusedLaunch::peek_ops).
  MK_CHECK(st->split.setup(ses, p.kind == FusedKind::kAgGemm));
  MK_REQUIRE(int(rp.tile_order.size()) == p.tiles_m * p.tiles_n, Code::kInternal, "plan: tile order incomplete");
  MK_CHECK(ses.upload(rp.tile_order, &st->d_order));
  return OkStatus();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

Status FusedGemm::create(Communicator* comm, FusedKind kind, const PlanShape& shape, const FusedOptions& opt,
                         std::unique_ptr<FusedGemm>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "fused: null communicator or output");
  const char* name = fused_kind_name(kind);
  // The path: a bad one (on any rank) is every rank's error, before anything else is collective.
  PathMode mode = PathMode::kFused;
  Status ps = parse_path_mode(opt.path.empty() ? tunables::fused_path() : opt.path, &mode);
  if (!ps.ok())
    ps = make_status(Code::kInvalidArgument, "%s: %s (%s)", name, ps.message().c_str(),
                     opt.path.empty() ? "tunable fused_path, MK_FUSED_PATH" : "FusedOptions::path");
  MK_CHECK(agree(comm->bootstrap(), ps, std::string(name) + " path"));
  Request req{int32_t(kind), opt.deterministic ? 1 : 0, shape.M, shape.N, shape.K, int32_t(mode),
              int32_t(shape.rows.size()), comm::counts_hash(shape.rows)};
  MK_CHECK(comm::agree_on_request(comm->bootstrap(), req, name, describe_request));
  std::unique_ptr<FusedGemm> op(new FusedGemm());
  op->st_ = std::make_unique<FusedState>();
  FusedState* st = op->st_.get();
  st->kind = kind;
  st->shape = shape;
  st->opt = opt;
  // Same inputs on every rank: the plan (or its error) is the same everywhere.
  MK_CHECK(build_plan(kind, shape, comm::layout_of(comm->topology()), opt.deterministic, &st->plan));
  if (!unfused_possible(kind, st->plan)) {
    MK_REQUIRE(mode != PathMode::kUnfused, Code::kInvalidArgument,
               "%s: path \"unfused\" needs even shards (the standalone collectives take M / W rows per rank): "
               "use path \"fused\" or \"auto\" with uneven shards", name);
    mode = PathMode::kFused;  // auto: the one path there is
  }
  MK_CHECK(comm::OpSession::create(comm, name, opt.staging, &st->session));
  const std::string route = tunables::fused_route();
  st->route_bulk = route != "red";
  int64_t cc = opt.comm_ctas < 0 ? tunables::fused_comm_ctas() : opt.comm_ctas;
  if (SplitController::wanted(opt.comm_ctas, comm->world()))
    // The learned start: the split the controller settled on for this key (an earlier operator
    // of this process, or the split memory file).
    cc = st->split.start(split_key(name, shape.M, shape.N, shape.K, comm->world(), comm->topology().num_nodes,
                                   st->session->networked() ? st->session->net_name() : "nvlink", comm->rank()),
                         int(cc));
  st->comm_ctas = int(std::max<int64_t>(cc, 1));
  int resident = 0;
  // Every setting valid (fused_split, fused_route, ... may have been set after the communicator
  // was created): a bad one is this create's error on every rank, naming the variable.
  Status rs = tunables::check_all();
  if (rs.ok()) rs = gemm::persistent_ctas(&resident);
  if (rs.ok() && st->split.on() && st->comm_ctas >= resident) st->comm_ctas = std::max(resident - 1, 1);
  if (rs.ok() && st->comm_ctas >= resident)
    rs = make_status(Code::kInvalidArgument,
                     "%s: %d communication CTAs leave none of the %d co-resident CTAs to compute", name,
                     st->comm_ctas, resident);
  MK_CHECK(agree(comm->bootstrap(), rs, std::string(name) + " create"));
  // The network decides how data crosses nodes (GPU memory registered, or staged through pinned
  // host mirrors); the plan follows.
  if (st->session->staged())
    MK_CHECK(build_plan(kind, shape, comm::layout_of(comm->topology()), opt.deterministic, &st->plan, true));
  MK_CHECK(st->session->setup(st->plan));
  MK_CHECK(agree(comm->bootstrap(), resolve(st), std::string(name) + " plan"));
  st->policy = PathPolicy(comm->world() > 1 ? mode : PathMode::kFused);
  if (st->policy.mode() != PathMode::kFused) {
    MK_CHECK(create_unfused(comm, st));
    if (st->policy.mode() == PathMode::kAuto) {
      st->path_key = "path " + split_key(name, shape.M, shape.N, shape.K, comm->world(), comm->topology().num_nodes,
                                         st->session->networked() ? st->session->net_name() : "nvlink", comm->rank());
      MK_CHECK(preset_path(comm, st));
    }
  }
  MK_CHECK(comm->bootstrap().barrier());
  MK_TRACE(kSubsysInit, "%s", describe(st->plan, comm->rank()).c_str());
  *out = std::move(op);
  return OkStatus();
}

FusedGemm::~FusedGemm() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "fused: destroy: %s", s.to_string().c_str());
}

Status FusedGemm::destroy() {
  FusedState* st = st_.get();
  if (!st || !st->session) return OkStatus();
  // The last call's split, from the device state while it still exists (the calls done first).
  st->split.finish(st->session->alive());
  Status first = st->coll ? st->coll->destroy() : OkStatus();
  Status s = st->session->destroy();
  return first.ok() ? s : first;
}

std::string FusedGemm::path() const { return st_->policy.describe(); }

FusedKind FusedGemm::kind() const { return st_->kind; }
const Plan& FusedGemmTesting::plan(const FusedGemm& op) { return op.st_->plan; }
int FusedGemm::comm_ctas() const {
  const int settled = st_->split.settled();
  return settled >= 1 ? settled : st_->comm_ctas;
}
bool FusedGemm::deterministic() const { return st_->plan.deterministic; }
const void* FusedGemm::gathered_a() const {
  if (!st_->session || !st_->session->alive()) return nullptr;
  if (st_->session->comm()->world() == 1) return st_->last_a;
  return st_->session->local(Buf::kAFull);
}

Status FusedGemm::set_comm_ctas(int n, cudaStream_t stream) {
  MK_REQUIRE(n >= 1, Code::kInvalidArgument, "fused: at least one communication CTA");
  MK_CHECK(st_->session->check_call());
  st_->comm_ctas = n;
  st_->split.turn_off();  // a fixed count from now on
  MK_CUDA_CHECK(cudaMemcpyAsync(st_->d_role, &st_->comm_ctas, sizeof(int), cudaMemcpyHostToDevice, stream));
  return OkStatus();
}

bool FusedGemm::split_controlled() const { return st_->split.on(); }

Status FusedGemmTesting::split_state(FusedGemm* op, SplitReadout* out, cudaStream_t stream) {
  MK_REQUIRE(op && op->st_ && out, Code::kInvalidArgument, "fused: no operator or no readout");
  return op->st_->split.state(out, stream);
}

Status FusedGemmTesting::force_splits(FusedGemm* op, const int* at_tiles, const int* counts, int n,
                                      cudaStream_t stream) {
  MK_REQUIRE(op && op->st_, Code::kInvalidArgument, "fused: no operator");
  return op->st_->split.force(at_tiles, counts, n, stream);
}

Status FusedGemm::can_implement(const FusedArgs& a) const {
  const FusedState* st = st_.get();
  MK_REQUIRE(st && st->session && st->session->alive(), Code::kInvalidArgument,
             "fused: the operator was destroyed (or its communicator was destroyed first)");
  const char* name = fused_kind_name(st->kind);
  const PlanShape& s = st->shape;
  MK_REQUIRE(a.a_type == gemm::DType::kBF16 && a.b_type == gemm::DType::kBF16 && a.c_type == gemm::DType::kBF16,
             Code::kInvalidArgument, "%s: A, B and C must be bf16", name);
  MK_REQUIRE(a.A && a.B && a.C, Code::kInvalidArgument, "%s: null A, B or C", name);
  MK_REQUIRE(aligned16(a.A) && aligned16(a.B) && aligned16(a.C), Code::kInvalidArgument,
             "%s: A, B and C must be 16-byte aligned", name);
  const int64_t mine = st->plan.rows_of(st->session->comm()->rank());
  const int64_t a_rows = st->kind == FusedKind::kAgGemm ? mine : s.M;
  const int64_t c_rows = st->kind == FusedKind::kGemmRs ? mine : s.M;
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
  // Local checks (in enqueue); with the debug tunable check_calls the ranks agree on them first.
  if (st_->session)
    MK_CHECK(st_->session->agree_on_call(can_implement(a), std::string(fused_kind_name(st_->kind)) + " arguments"));
  return enqueue(a, stream);
}

namespace {

// The unfused path: the GEMM, then the standalone collective (AG: the collective first). Its
// workspaces: AG gathers into the operator's gathered A (gathered_a() stays valid); RS and AR
// compute into the collective's input workspace (no copy in), RS scatters into C, AR copies the
// result out of its output workspace into C.
Status enqueue_unfused(FusedState* st, const FusedArgs& a, cudaStream_t stream) {
  gemm::Arguments g;
  g.M = st->shape.M, g.N = st->shape.N, g.K = st->shape.K;
  g.B = a.B;
  gemm::RunConfig cfg;
  cfg.max_ctas = st->opt.max_ctas;
  if (st->kind == FusedKind::kAgGemm) {
    void* full = st->session->local(Buf::kAFull);
    MK_CHECK(st->coll->enqueue({a.A, full}, stream));
    g.A = full;
    g.C = a.C;
    return gemm::run(g, stream, cfg);
  }
  g.A = a.A;
  g.C = st->coll->input();
  MK_CHECK(gemm::run(g, stream, cfg));
  return st->coll->enqueue({st->coll->input(), a.C}, stream);
}

// Auto, once the trials are in: this rank's timed calls read (bounded: their kernels' waits
// are), every rank's medians exchanged, the same decision on every rank, remembered.
Status decide_path(FusedState* st) {
  Communicator* comm = st->session->comm();
  const auto deadline = deadline_after_ms(device_setup_timeout_ms());
  for (auto& t : st->timings) {
    cudaError_t e;
    while ((e = cudaEventQuery(t.stop)) == cudaErrorNotReady) {
      MK_REQUIRE(std::chrono::steady_clock::now() < deadline, Code::kTimeout,
                 "%s: policy auto: the timed calls did not complete within %lld ms", fused_kind_name(st->kind),
                 (long long)device_setup_timeout_ms());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    MK_CUDA_CHECK(e);
    float ms = 0;
    MK_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
    MK_CHECK(st->policy.report(t.path, double(ms)));
  }
  st->free_timings();
  const int W = comm->world();
  const double mine[2] = {st->policy.median(Path::kFused), st->policy.median(Path::kUnfused)};
  std::vector<double> all(size_t(2 * W));
  MK_CHECK(comm->bootstrap().allgather(mine, all.data(), sizeof mine));
  std::vector<double> f(W), u(W);
  for (int q = 0; q < W; ++q) f[q] = all[2 * q], u[q] = all[2 * q + 1];
  st->policy.decide(f, u);
  MK_INFO(kSubsysTune, "%s: policy %s", fused_kind_name(st->kind), st->policy.describe().c_str());
  const Status rs = SplitMemory::process().record(st->path_key, st->policy.choice() == Path::kUnfused ? 2 : 1);
  if (!rs.ok()) MK_WARN(kSubsysTune, "%s: remembering the path: %s", fused_kind_name(st->kind), rs.to_string().c_str());
  return OkStatus();
}

}  // namespace

Status FusedGemm::enqueue(const FusedArgs& a, cudaStream_t stream) {
  FusedState* st = st_.get();
  MK_CHECK(can_implement(a));
  MK_CHECK(st->session->check_call());
  if (st->session->comm()->world() > 1 && st->policy.mode() != PathMode::kFused) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    MK_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
    MK_REQUIRE(cap == cudaStreamCaptureStatusNone || st->policy.settled(), Code::kInvalidArgument,
               "%s: policy auto has not chosen a path yet (%s): run the calls it times outside CUDA graph capture, "
               "on every rank, before capturing",
               fused_kind_name(st->kind), st->policy.describe().c_str());
    PathPolicy::Call c = st->policy.next();
    if (c.decide_before) {
      MK_CHECK(decide_path(st));
      c = st->policy.next();
    }
    FusedState::Timing t;
    if (c.timed) {
      // Kept in the state at once (destroyed with it, whatever fails next).
      st->timings.emplace_back();
      FusedState::Timing& k = st->timings.back();
      k.path = c.path;
      MK_CUDA_CHECK(cudaEventCreate(&k.start));
      MK_CUDA_CHECK(cudaEventCreate(&k.stop));
      t = k;
      MK_CUDA_CHECK(cudaEventRecord(t.start, stream));
    }
    if (c.path == Path::kUnfused) MK_CHECK(enqueue_unfused(st, a, stream));
    else MK_CHECK(enqueue_fused(a, stream));
    if (c.timed) MK_CUDA_CHECK(cudaEventRecord(t.stop, stream));
    return OkStatus();
  }
  return enqueue_fused(a, stream);
}

Status FusedGemm::enqueue_fused(const FusedArgs& a, cudaStream_t stream) {
  FusedState* st = st_.get();
  if (st->session->comm()->world() == 1) {
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
    st->last_a = a.A;  // AG: the "gathered" A is the caller's (gathered_a())
    return OkStatus();
  }
  gemm::Arguments g;
  g.M = st->shape.M;
  g.N = st->shape.N;
  g.K = st->shape.K;
  g.B = a.B;
  g.trace = a.trace;
  gemm::FusedLaunch f;
  f.program = st->program;
  f.peek_ops = st->kind != FusedKind::kAgGemm;
  f.role_counts = st->d_role;
  f.tile_counter = st->d_tile_counter;
  f.tile_order = st->d_order;
  if (st->kind == FusedKind::kAgGemm) {
    g.A = st->session->local(Buf::kAFull);
    g.C = a.C;
    f.program.user[kUserSlotA] = const_cast<void*>(a.A);
    if (st->plan.own_copy_before) {
      // My shard into my gathered A before the kernel (Plan::own_copy_before): stream order
      // makes it follow the previous call's reads and precede this call's.
      const int me = st->session->comm()->rank();
      const uint64_t row = uint64_t(st->shape.K) * 2;
      MK_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(st->session->local(Buf::kAFull)) + uint64_t(st->plan.shard_row0[me]) * row,
                                    a.A, uint64_t(st->plan.rows_of(me)) * row, cudaMemcpyDeviceToDevice, stream));
    }
  } else {
    g.A = a.A;
    // The routed epilogue never writes C; the TMA-store descriptor still needs valid memory.
    g.C = st->session->local(Buf::kAccum);
    f.route = true;
    f.route_epi = st->route_epi;
    f.program.user[kUserSlotC] = a.C;
  }
  gemm::RunConfig cfg;
  cfg.max_ctas = st->opt.max_ctas;
  if (st->split.on()) {
    st->split.remember(false);
    f.split = st->split.device();
  }
  return gemm::run_fused(g, f, stream, cfg);
}

}  // namespace ops
}  // namespace mk
