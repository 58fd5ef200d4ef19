#include "mkernel/runtime/communicator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/common/fault.h"
#include "src/runtime/heap_context.h"
#include "src/runtime/ipc_socket.h"
#include "src/common/deadline.h"

namespace mk {

Communicator::Communicator() = default;

Communicator::~Communicator() { (void)destroy(); }

Status Communicator::create(std::unique_ptr<Bootstrap> bs, const CommConfig& cfg,
                            std::unique_ptr<Communicator>* out) {
  MK_REQUIRE(bs, Code::kInvalidArgument, "Communicator::create needs a bootstrap");
  std::unique_ptr<Communicator> c(new Communicator());
  MK_CHECK(c->init(std::move(bs), cfg));
  *out = std::move(c);
  return OkStatus();
}

namespace {
// The poll backoff cap where ranks share a GPU (wait_backoff_ns = -1). Measured on an H100 under
// MPS, ring attention W = 2 with uneven shards: caps of 1000 and 4000 ns give the same times,
// 100 ns does not help (bench/results/h100-2026-12-07-backoff/results.md).
constexpr uint32_t kSharedGpuBackoffNs = 1000;

// Setup and teardown syncs of the library's own streams: bounded by the signal timeout (the
// work on them is a few memsets, or kernels whose waits are bounded by it).

Status parse_mode(const std::string& s, SymmetricMode* m) {
  if (s == "auto") *m = SymmetricMode::kAuto;
  else if (s == "vmm") *m = SymmetricMode::kVmm;
  else if (s == "ipc") *m = SymmetricMode::kIpc;
  else return make_status(Code::kInvalidArgument, "symmem_mode must be auto, vmm or ipc, got '%s'", s.c_str());
  return OkStatus();
}
}  // namespace

std::string no_gpu_reason() {
  int n = 0, drv = 0;
  cudaDriverGetVersion(&drv);
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return "";
  cudaGetLastError();
  if (drv == 0) return std::string("no NVIDIA driver on this machine (") +
                       (e != cudaSuccess ? cudaGetErrorName(e) : "no device visible") + ")";
  char b[256];
  snprintf(b, sizeof b, "%s (the driver supports CUDA %d.%d)",
           e != cudaSuccess ? cudaGetErrorString(e) : "no device visible", drv / 1000, (drv % 1000) / 10);
  return b;
}

Status Communicator::init(std::unique_ptr<Bootstrap> bs, const CommConfig& cfg) {
  bs_ = std::move(bs);
  const int rank = bs_->rank(), world = bs_->size();
  log_set_rank(rank);

  // 0. settings: every one valid (one error naming each bad variable), on every rank
  MK_CHECK(agree(*bs_, tunables::check_all(), "communicator: settings"));

  // 1. hosts, so each rank can pick its GPU by its index on its host
  std::vector<RankInfo> infos(world);
  RankInfo me = local_host_info(rank);
  MK_CHECK(bs_->allgather(&me, infos.data(), sizeof(me)));

  // 2. GPU
  MK_CHECK(select_gpu(cfg, infos, &me));

  // 3. topology (pure function of the gathered infos; agreed, so all ranks fail alike)
  MK_CHECK(bs_->allgather(&me, infos.data(), sizeof(me)));
  int rpn = cfg.ranks_per_node >= 0 ? cfg.ranks_per_node
                                    : static_cast<int>(tunables::ranks_per_node());
  Status ts = build_topology(rank, infos, rpn, cuda_peer_access, &topo_);
  MK_CHECK(agree(*bs_, ts, "communicator: topology"));
  MK_INFO(kSubsysTopo, "%s", topo_.describe().c_str());

  // 4. the job's IPC secret and this rank's socket
  MK_CHECK(start_ipc());

  // 5. heap, streams, diagnostic record
  Status gs = make_heap(cfg, infos);
  if (gs.ok() && device_ >= 0) gs = make_streams();
  MK_CHECK(agree(*bs_, gs, "communicator: streams and diagnostics"));
  MK_INFO(kSubsysInit, "communicator ready: rank %d/%d, node %d/%d, GPU %d", rank, world,
          topo_.node, topo_.num_nodes, device_);
  return OkStatus();
}

// Picks this rank's GPU (the option, the tunable, else its index on its host) and fills its
// share of `me`; agreed: a rank whose GPU is present but unusable, or missing when one is
// required, fails the communicator on every rank.
Status Communicator::select_gpu(const CommConfig& cfg, const std::vector<RankInfo>& infos, RankInfo* me) {
  const int rank = bs_->rank();
  int ndev = 0;
  Status gpu_err;
  const std::string no_gpu = no_gpu_reason();
  if (!no_gpu.empty()) {
    ndev = 0;
    gpu_err = Status(Code::kNotSupported, "no GPU: " + no_gpu + " (`mkernel doctor` shows what this machine has)");
  } else {
    MK_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  }
  if (ndev > 0) {
    int want = cfg.device;
    if (want == -2) want = static_cast<int>(tunables::device());
    if (want < 0) want = host_local_index(infos, rank) % ndev;
    if (want >= ndev) {
      gpu_err = make_status(Code::kInvalidArgument, "device %d requested, %d visible", want, ndev);
    } else {
      Status s = [&]() -> Status {
        MK_CUDA_CHECK(cudaSetDevice(want));
        MK_CHECK(fill_gpu_info(want, me));
        return OkStatus();
      }();
      if (s.ok()) device_ = want;
      else gpu_err = s;
    }
  }
  {
    // Always agreed (every rank takes the same path): a rank whose GPU is present but
    // unusable, or missing when one is required, fails the communicator on every rank.
    Status mine = ((ndev > 0 || cfg.require_gpu) && device_ < 0) ? gpu_err : OkStatus();
    MK_CHECK(agree(*bs_, mine, "communicator: selecting GPUs"));
  }
  if (device_ < 0 && !gpu_err.ok())
    MK_INFO(kSubsysInit, "rank %d: running without GPU (%s)", rank, gpu_err.message().c_str());
  return OkStatus();
}

// The job's IPC secret (rank 0 draws it) and this rank's socket, under a name the rank draws at
// random when it binds; the names travel through the bootstrap, so no rank's name can be
// computed from anything another local user sees. Every step agreed.
Status Communicator::start_ipc() {
  const int rank = bs_->rank(), world = bs_->size();
  heap_ctx_ = std::make_unique<HeapContext>();
  Status ss = (rank == 0) ? make_ipc_secret(&heap_ctx_->secret) : OkStatus();
  MK_CHECK(agree(*bs_, ss, "communicator: drawing the job secret"));
  MK_CHECK(bs_->broadcast(heap_ctx_->secret.token.data(), heap_ctx_->secret.token.size(), 0));
  bool any_ipc = false;
  for (int r = 0; r < world; ++r) any_ipc |= topo_.path[r] == PeerPath::kIpc;
  Status is = (any_ipc && device_ >= 0) ? IpcServer::create(heap_ctx_->secret, rank, &ipc_) : OkStatus();
  MK_CHECK(agree(*bs_, is, "communicator: starting the IPC socket"));
  {
    IpcNameRecord mine = ipc_name_record(ipc_ ? ipc_->name() : std::string());
    std::vector<IpcNameRecord> recs(world);
    MK_CHECK(bs_->allgather(&mine, recs.data(), sizeof(mine)));
    heap_ctx_->ipc_names.assign(world, std::string());
    Status ns;
    for (int r = 0; r < world && ns.ok(); ++r)
      ns = ipc_name_from_record(recs[r], r, &heap_ctx_->ipc_names[r]);
    MK_CHECK(agree(*bs_, ns, "communicator: exchanging IPC socket names"));
  }
  return OkStatus();
}

// The symmetric heap's context (the requested mode: its parse error is returned, agreed by the
// caller) and the heap.
Status Communicator::make_heap(const CommConfig& cfg, const std::vector<RankInfo>& infos) {
  const int rank = bs_->rank(), world = bs_->size();
  std::string mode = cfg.symmem_mode.empty() ? tunables::symmem_mode()
                                             : cfg.symmem_mode;
  Status ms = parse_mode(mode, &heap_ctx_->requested);
  heap_ctx_->bs = bs_.get();
  heap_ctx_->topo = &topo_;
  heap_ctx_->ipc = ipc_.get();
  heap_ctx_->device = device_;
  for (int r = 0; r < world; ++r)
    if (topo_.path[r] == PeerPath::kSelf || topo_.path[r] == PeerPath::kSameProcess)
      heap_ctx_->process_devices.push_back(infos[r].cuda_device);
  std::sort(heap_ctx_->process_devices.begin(), heap_ctx_->process_devices.end());
  heap_ctx_->process_devices.erase(
      std::unique(heap_ctx_->process_devices.begin(), heap_ctx_->process_devices.end()),
      heap_ctx_->process_devices.end());
  heap_ = std::make_unique<SymmetricHeap>(heap_ctx_.get());
  int same_process_gpu = 0;
  for (int r = 0; r < world; ++r)
    same_process_gpu += topo_.path[r] == PeerPath::kSameProcess && infos[r].cuda_device == device_;
  if (same_process_gpu > 0 && device_ >= 0 && !getenv("CUDA_DEVICE_MAX_CONNECTIONS"))
    MK_WARN(kSubsysInit,
            "rank %d shares its GPU with %d rank(s) of this process: their kernels wait on each "
            "other, and CUDA may queue them behind one another on its 8 default hardware queues "
            "(a bounded wait then reports it). Set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA "
            "starts, or use one process per rank.",
            rank, same_process_gpu);
  return ms;
}

// The communicator's streams, the pinned mapped diagnostic record and abort word, the device
// claim word (zeroed, bounded).
Status Communicator::make_streams() {
  MK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MK_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  MK_CUDA_CHECK(cudaStreamCreateWithFlags(&setup_stream_, cudaStreamNonBlocking));
  heap_ctx_->own_streams = {stream_, comm_stream_, setup_stream_};
  MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&diag_), sizeof(DiagRecord),
                              cudaHostAllocMapped | cudaHostAllocPortable));
  memset(diag_, 0, sizeof(DiagRecord));
  diag_->size = sizeof(DiagRecord);
  diag_->version = kDiagVersion;
  MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&abort_word_), sizeof(uint64_t),
                              cudaHostAllocMapped | cudaHostAllocPortable));
  *abort_word_ = 0;
  MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&diag_claim_), sizeof(uint32_t)));
  MK_CUDA_CHECK(cudaMemsetAsync(diag_claim_, 0, sizeof(uint32_t), setup_stream_));
  MK_CHECK(sync_stream_bounded(setup_stream_, device_setup_timeout_ms(), "communicator: zeroing the claim word"));
  return OkStatus();
}

void Communicator::attach(CommAttachment* a) {
  std::lock_guard<std::mutex> g(attach_mu_);
  attached_.push_back(a);
}

void Communicator::detach(CommAttachment* a) {
  std::lock_guard<std::mutex> g(attach_mu_);
  attached_.erase(std::remove(attached_.begin(), attached_.end(), a), attached_.end());
}

Status Communicator::destroy() {
  if (destroyed_) return OkStatus();
  // After a failure every collective step below returns at once (the bootstrap has failed):
  // the teardown releases this rank's resources without waiting for peers that may be gone.
  (void)check();
  // Operators still alive go first (newest first; each detaches itself): they hold symmetric
  // buffers, proxies and streams of this communicator.
  for (;;) {
    CommAttachment* a = nullptr;
    {
      std::lock_guard<std::mutex> g(attach_mu_);
      if (attached_.empty()) break;
      a = attached_.back();
    }
    MK_WARN(kSubsysInit, "rank %d: communicator destroyed while an operator is alive: destroying the operator first",
            topo_.rank);
    a->on_communicator_destroy();
    detach(a);  // in case the operator did not
  }
  destroyed_ = true;
  Status first;
  if (heap_) first = heap_->destroy();
  if (ipc_) ipc_->shutdown();
  if (device_ >= 0) {
    cudaSetDevice(device_);
    for (void* p : device_allocs_) cudaFree(p);
    device_allocs_.clear();
    if (stream_) cudaStreamDestroy(stream_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    if (setup_stream_) cudaStreamDestroy(setup_stream_);
    if (diag_claim_) cudaFree(diag_claim_);
    if (diag_) cudaFreeHost(diag_);
    if (abort_word_) cudaFreeHost(abort_word_);
    abort_word_ = nullptr;
    stream_ = comm_stream_ = setup_stream_ = nullptr;
    diag_claim_ = nullptr;
    diag_ = nullptr;
    cudaGetLastError();  // a sticky error from a trapped kernel must not leak into the caller
  }
  return first;
}

Status Communicator::alloc_signals(uint32_t count, SymmetricBuffer** out) {
  MK_REQUIRE(count > 0, Code::kInvalidArgument, "alloc_signals: count must be > 0");
  SymmetricBuffer* b = nullptr;
  MK_CHECK(heap_->alloc(static_cast<size_t>(count) * sizeof(uint64_t), &b));
  Status s = [&]() -> Status {
    MK_CUDA_CHECK(cudaMemsetAsync(b->local(), 0, b->mapped_size(), setup_stream_));
    return sync_stream_bounded(setup_stream_, device_setup_timeout_ms(), "alloc_signals: zeroing the pad");
  }();
  // Every pad is zero before any rank may signal into it.
  MK_CHECK(agree(*bs_, s, "alloc_signals"));
  *out = b;
  return OkStatus();
}

Status Communicator::alloc_epoch(EpochState** out) {
  MK_REQUIRE(device_ >= 0, Code::kNotSupported, "alloc_epoch: no GPU");
  void* p = nullptr;
  MK_CUDA_CHECK(cudaMalloc(&p, sizeof(EpochState)));
  device_allocs_.push_back(p);
  MK_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(EpochState), setup_stream_));
  MK_CHECK(sync_stream_bounded(setup_stream_, device_setup_timeout_ms(), "alloc_epoch"));
  *out = static_cast<EpochState*>(p);
  return OkStatus();
}

WaitCtx Communicator::wait_ctx(uint32_t op_tag, Role role, int64_t timeout_ms) const {
  if (timeout_ms < 0) timeout_ms = tunables::signal_timeout_ms();
  if (timeout_ms <= 0) timeout_ms = 1;  // every wait is bounded
  WaitCtx c;
  memset(&c, 0, sizeof(c));
  c.diag = diag_;  // mapped pinned memory: the host pointer is valid on the device (UVA)
  c.claim = diag_claim_;
  c.abort = abort_word_;
  c.timeout_ns = ms_to_ns(timeout_ms);
  c.rank = topo_.rank;
  c.op_tag = op_tag;
  c.role = static_cast<uint32_t>(role);
  // -1: back off only where ranks share this GPU (their spinning CTAs take issue slots from each
  // other's compute); a GPU of its own polls back to back. 0, the default: never.
  const int64_t backoff = tunables::wait_backoff_ns();
  c.backoff_ns = uint32_t(backoff >= 0 ? backoff : (topo_.gpu_sharers > 0 ? kSharedGpuBackoffNs : 0));
  return c;
}

bool Communicator::wait_timed_out() const {
  return diag_ && reinterpret_cast<volatile DiagRecord*>(diag_)->state == 2u;
}

void Communicator::abort(const Status& why) {
  {
    std::lock_guard<std::mutex> g(abort_mu_);
    if (abort_status_.ok()) abort_status_ = why;
  }
  if (abort_word_) __atomic_store_n(abort_word_, uint64_t(1), __ATOMIC_RELEASE);
  // The job has failed: collectives stop waiting, the peers hear of it (thread-safe, no wait).
  if (bs_) bs_->fail(why);
}

Status Communicator::abort_status() const {
  std::lock_guard<std::mutex> g(abort_mu_);
  return abort_status_;
}

Status Communicator::check_device(cudaError_t err) const {
  if (wait_timed_out()) {
    DiagRecord d;
    memcpy(&d, const_cast<const DiagRecord*>(diag_), sizeof(d));
    std::string msg = "device wait failed: " + describe_diag(d);
    if (err != cudaSuccess) msg += std::string(" (kernel: ") + cudaGetErrorName(err) + ")";
    Status why = abort_status();
    if (d.reason == kDiagAborted && !why.ok()) msg += "; cause: " + why.to_string();
    Status st(d.reason == kDiagAborted ? (why.ok() ? Code::kRemoteError : why.code()) : Code::kTimeout, msg);
    if (bs_) bs_->fail(st);  // the job has failed (see check())
    return st;
  }
  if (err != cudaSuccess)
    return make_status(err == cudaErrorMemoryAllocation ? Code::kOutOfMemory : Code::kCudaError,
                       "rank %d: %s (%s)", topo_.rank, cudaGetErrorString(err), cudaGetErrorName(err));
  return OkStatus();
}

Status Communicator::sync(cudaStream_t s) const { return check_device(cudaStreamSynchronize(s)); }

Status Communicator::check() const {
  Status s = health();
  // A failed communicator fails the job: its bootstrap stops waiting for peers and tells them.
  if (!s.ok() && bs_) bs_->fail(s);
  return s;
}

Status Communicator::health() const {
  if (wait_timed_out()) return check_device(cudaSuccess);
  Status why = abort_status();
  if (!why.ok())
    return Status(why.code(), "rank " + std::to_string(topo_.rank) + ": the communicator failed: " + why.message());
  // A wait gave up and set the abort word, and its record is on its way (the claim was lost to
  // a wait that is still writing it): failed all the same.
  if (abort_word_ && __atomic_load_n(abort_word_, __ATOMIC_ACQUIRE) != 0)
    return make_status(Code::kTimeout, "rank %d: a device wait of this communicator gave up", topo_.rank);
  return OkStatus();
}

Status Communicator::failure(const Status& mine) {
  (void)check();
  if (bs_ && !mine.ok()) bs_->fail(mine);
  return bs_ ? bs_->failure_report() : mine;
}

}  // namespace mk
