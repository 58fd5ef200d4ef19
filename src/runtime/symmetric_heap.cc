#include "mkernel/runtime/symmetric_heap.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include <cuda_runtime_api.h>

#include "mkernel/common/cuda_check.h"
#include "mkernel/common/tunables.h"
#include "src/runtime/bootstrap/bootstrap_util.h"
#include "src/runtime/cuda_driver.h"
#include "src/runtime/heap_context.h"

namespace mk {

const char* symmetric_mode_name(SymmetricMode m) {
  switch (m) {
    case SymmetricMode::kAuto: return "auto";
    case SymmetricMode::kVmm: return "vmm";
    case SymmetricMode::kIpc: return "ipc";
    case SymmetricMode::kProcess: return "process";
  }
  return "?";
}

SymmetricView SymmetricBuffer::view() const {
  return SymmetricView{local_, d_peers_, bytes_, rank_, world_};
}
SignalView SymmetricBuffer::signal_view() const {
  return SignalView{static_cast<uint64_t*>(local_), reinterpret_cast<uint64_t* const*>(d_peers_),
                    static_cast<uint32_t>(bytes_ / 8), rank_, world_, 0};
}

namespace {

// What each rank publishes per allocation request.
struct AllocRequest {
  uint64_t bytes;
  int32_t mode;      // requested SymmetricMode
  int32_t has_gpu;
  int32_t vmm_ok;    // device supports VMM with POSIX-FD export
  int32_t vmm_lack;  // VmmLack: why not, when vmm_ok == 0
};
static_assert(sizeof(AllocRequest) == 24, "AllocRequest travels through the bootstrap");

// What each rank publishes per allocation once its own copy exists.
struct Exchange {
  uint64_t mapped;
  uint64_t ptr;            // for ranks of the same process
  cudaIpcMemHandle_t ipc;  // for cudaIpc mode
};

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Why a rank cannot take part in VMM peer mapping (0: it can).
enum VmmLack : int32_t {
  kVmmAvailable = 0,
  kVmmNoDriverApi = 1,   // the driver's VMM entry points could not be loaded
  kVmmQueryFailed = 2,   // cuDeviceGet / cuDeviceGetAttribute failed
  kVmmUnsupported = 3,   // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0
  kVmmNoPosixFd = 4,     // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0
};

const char* vmm_lack_text(int32_t why) {
  switch (why) {
    case kVmmNoDriverApi: return "the CUDA driver's VMM entry points could not be loaded";
    case kVmmQueryFailed: return "querying the device's VMM attributes failed";
    case kVmmUnsupported: return "the GPU does not support CUDA VMM";
    case kVmmNoPosixFd: return "the GPU cannot export VMM memory as a POSIX file descriptor";
  }
  return "unknown reason";
}

int32_t vmm_lack(int device) {
  const CudaDriver* d = nullptr;
  if (!cuda_driver(&d).ok()) return kVmmNoDriverApi;
  CUdevice dev;
  int vmm = 0, fd = 0;
  if (d->cuDeviceGet(&dev, device) != CUDA_SUCCESS ||
      d->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS ||
      d->cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) != CUDA_SUCCESS)
    return kVmmQueryFailed;
  if (!vmm) return kVmmUnsupported;
  if (!fd) return kVmmNoPosixFd;
  return kVmmAvailable;
}

// "rank(s) 1, 3: <why>; rank(s) 2: <why>" for the ranks that lack VMM peer mapping.
std::string vmm_lack_list(const std::vector<AllocRequest>& reqs) {
  std::map<int32_t, std::vector<int>> by_why;
  for (size_t r = 0; r < reqs.size(); ++r)
    if (!reqs[r].vmm_ok) by_why[reqs[r].vmm_lack].push_back(static_cast<int>(r));
  std::string out;
  for (const auto& kv : by_why) {
    if (!out.empty()) out += "; ";
    out += "rank(s) " + detail::rank_list(kv.second) + ": " + vmm_lack_text(kv.first);
  }
  return out;
}

std::string size_list(const std::vector<AllocRequest>& reqs) {
  std::string s;
  for (size_t r = 0; r < reqs.size() && r < 8; ++r) {
    if (r) s += ", ";
    s += "rank " + std::to_string(r) + ": " + std::to_string(reqs[r].bytes) + " B";
  }
  if (reqs.size() > 8) s += ", ...";
  return s;
}

}  // namespace

SymmetricHeap::SymmetricHeap(HeapContext* ctx) : ctx_(ctx) {}

SymmetricMode SymmetricHeap::requested_mode() const { return ctx_->requested; }

SymmetricHeap::~SymmetricHeap() { (void)destroy(); }

size_t SymmetricHeap::live_buffers() const {
  size_t n = 0;
  for (const auto& b : buffers_) n += !b->freed_;
  return n;
}

Status SymmetricHeap::agree(const Status& mine, const char* what) {
  return mk::agree(*ctx_->bs, mine, what);
}

Status SymmetricHeap::alloc(size_t bytes, SymmetricBuffer** out) {
  *out = nullptr;
  MK_REQUIRE(!destroyed_, Code::kInvalidArgument, "symmetric alloc on a destroyed heap");
  Bootstrap& bs = *ctx_->bs;
  const int world = bs.size(), rank = bs.rank();

  AllocRequest mine{};
  mine.bytes = bytes;
  mine.mode = static_cast<int32_t>(ctx_->requested);
  mine.has_gpu = ctx_->device >= 0;
  if (mine.has_gpu) {
    MK_CUDA_CHECK(cudaSetDevice(ctx_->device));
    mine.vmm_lack = vmm_lack(ctx_->device);
    mine.vmm_ok = mine.vmm_lack == kVmmAvailable;
  }
  std::vector<AllocRequest> reqs(world);
  MK_CHECK(bs.allgather(&mine, reqs.data(), sizeof(mine)));
  // Validation on gathered data: every rank reaches the same verdict.
  std::vector<int> zero, nogpu;
  bool same_size = true, same_mode = true, all_vmm = true;
  for (int r = 0; r < world; ++r) {
    if (reqs[r].bytes == 0) zero.push_back(r);
    if (!reqs[r].has_gpu) nogpu.push_back(r);
    same_size &= reqs[r].bytes == reqs[0].bytes;
    same_mode &= reqs[r].mode == reqs[0].mode;
    all_vmm &= reqs[r].vmm_ok != 0;
  }
  if (!zero.empty())
    return make_status(Code::kInvalidArgument,
                       "symmetric alloc: size 0 requested by rank(s) %s (sizes: %s)",
                       detail::rank_list(zero).c_str(), size_list(reqs).c_str());
  if (!same_size)
    return make_status(Code::kMismatch, "symmetric alloc: ranks asked for different sizes (%s)",
                       size_list(reqs).c_str());
  if (!same_mode)
    return make_status(Code::kMismatch,
                       "symmetric alloc: ranks asked for different mapping modes (symmem_mode)");
  if (!nogpu.empty())
    return make_status(Code::kNotSupported, "symmetric alloc: no GPU on rank(s) %s",
                       detail::rank_list(nogpu).c_str());

  // The mode is chosen once, at the first allocation (the same on every rank: from gathered
  // data). Every way auto ends up without VMM is a fallback: WARN, and kept in
  // fallback_reason() for the communicator's users and `mkernel doctor`.
  if (mode_ == SymmetricMode::kAuto) {
    SymmetricMode want = static_cast<SymmetricMode>(reqs[0].mode);
    if (want == SymmetricMode::kVmm && !all_vmm)
      return make_status(Code::kNotSupported,
                         "symmetric alloc: symmem_mode=vmm but VMM peer mapping is not available "
                         "(%s); use symmem_mode=auto or ipc",
                         vmm_lack_list(reqs).c_str());
    if (want == SymmetricMode::kAuto && !all_vmm) {
      want = SymmetricMode::kIpc;
      fallback_reason_ = "VMM peer mapping is not available (" + vmm_lack_list(reqs) + ")";
      MK_WARN(kSubsysMem, "symmetric heap: %s; falling back to cudaIpc", fallback_reason_.c_str());
    } else if (want == SymmetricMode::kAuto) {
      want = SymmetricMode::kVmm;
    }
    mode_ = want;
    MK_INFO(kSubsysMem, "symmetric heap: peer mapping through %s (symmem_mode=%s)",
            symmetric_mode_name(mode_), symmetric_mode_name(ctx_->requested));
  }

  auto b = std::make_unique<SymmetricBuffer>();
  b->id_ = next_id_++;
  b->bytes_ = bytes;
  b->rank_ = rank;
  b->world_ = world;
  Status local_err;
  Status s = alloc_mode(bytes, mode_, b.get(), &local_err);
  if (!s.ok() && mode_ == SymmetricMode::kVmm &&
      static_cast<SymmetricMode>(reqs[0].mode) == SymmetricMode::kAuto &&
      s.code() != Code::kOutOfMemory && s.code() != Code::kTimeout) {
    // VMM export/import can be refused (container policies, MPS setups): fall back once, for
    // this and every later allocation (the error is agreed, so every rank falls back).
    fallback_reason_ = "VMM peer mapping failed at allocation #" + std::to_string(b->id_) +
                       " (" + s.message() + ")";
    MK_WARN(kSubsysMem, "symmetric heap: %s; falling back to cudaIpc", fallback_reason_.c_str());
    mode_ = SymmetricMode::kIpc;
    b->id_ = next_id_++;
    s = alloc_mode(bytes, mode_, b.get(), &local_err);
  }
  MK_CHECK(s);
  MK_INFO(kSubsysMem, "symmetric alloc #%llu: %zu B (mapped %zu B) via %s",
          static_cast<unsigned long long>(b->id_), bytes, b->mapped_, symmetric_mode_name(b->mode_));
  *out = b.get();
  buffers_.push_back(std::move(b));
  return OkStatus();
}

// Creates this rank's copy, agrees, then maps the peers' and agrees again. On any rank's
// failure every rank unwinds and returns the same error.
Status SymmetricHeap::alloc_mode(size_t bytes, SymmetricMode mode, SymmetricBuffer* b,
                                 Status* local_err) {
  const Topology& topo = *ctx_->topo;
  const int world = topo.world;
  b->mode_ = mode;
  b->peers_.assign(world, nullptr);
  b->peer_handles_.assign(world, 0);
  b->peer_opened_.assign(world, false);
  b->peer_mapped_.assign(world, 0);
  b->local_ = nullptr;
  b->local_handle_ = 0;
  b->d_peers_ = nullptr;

  // 1. this rank's copy
  auto create_local = [&]() -> Status {
    if (mode == SymmetricMode::kVmm) {
      const CudaDriver* d = nullptr;
      MK_CHECK(cuda_driver(&d));
      CUdevice dev;
      MK_CU_CHECK(d->cuDeviceGet(&dev, ctx_->device));
      CUmemAllocationProp prop;
      memset(&prop, 0, sizeof(prop));
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = dev;
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      int rdma = 0;
      if (d->cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                  dev) == CUDA_SUCCESS && rdma)
        prop.allocFlags.gpuDirectRDMACapable = 1;  // the network backend may register it
      size_t gran = 0;
      MK_CU_CHECK(d->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
      b->mapped_ = round_up(bytes, gran);
      CUmemGenericAllocationHandle h;
      MK_CU_CHECK(d->cuMemCreate(&h, b->mapped_, &prop, 0));
      b->local_handle_ = h;
      CUdeviceptr va = 0;
      MK_CU_CHECK(d->cuMemAddressReserve(&va, b->mapped_, gran, 0, 0));
      b->local_ = reinterpret_cast<void*>(va);
      MK_CU_CHECK(d->cuMemMap(va, b->mapped_, 0, h, 0));
      // Access for this GPU and for the GPUs of same-process ranks, which use this VA directly.
      std::vector<CUmemAccessDesc> acc;
      for (int devi : ctx_->process_devices) {
        CUmemAccessDesc a;
        memset(&a, 0, sizeof(a));
        a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        a.location.id = devi;
        a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        acc.push_back(a);
      }
      MK_CU_CHECK(d->cuMemSetAccess(va, b->mapped_, acc.data(), acc.size()));
    } else {
      b->mapped_ = round_up(bytes, 256);
      MK_CUDA_CHECK(cudaMalloc(&b->local_, b->mapped_));
      for (int devi : ctx_->process_devices) {
        if (devi == ctx_->device) continue;
        cudaError_t e = cudaDeviceEnablePeerAccess(devi, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
        else MK_CUDA_CHECK(e);
      }
    }
    return OkStatus();
  };
  MK_CUDA_CHECK(cudaSetDevice(ctx_->device));
  *local_err = create_local();
  Status s = agree(*local_err, ("symmetric alloc of " + std::to_string(bytes) + " B").c_str());
  if (!s.ok()) {
    release_local(b);
    return s;
  }
  s = map_peers(b, local_err);
  if (!s.ok()) {
    release_peers(b);
    release_local(b);
    return s;
  }
  return OkStatus();
}

Status SymmetricHeap::map_peers(SymmetricBuffer* b, Status* local_err) {
  const Topology& topo = *ctx_->topo;
  const int world = topo.world, rank = topo.rank;
  const CudaDriver* d = nullptr;
  int exported_fd = -1;
  Exchange mine;
  memset(&mine, 0, sizeof(mine));
  mine.mapped = b->mapped_;
  mine.ptr = reinterpret_cast<uint64_t>(b->local_);
  auto publish = [&]() -> Status {
    if (b->mode_ == SymmetricMode::kVmm) {
      MK_CHECK(cuda_driver(&d));
      bool any_ipc = false;
      for (int r = 0; r < world; ++r) any_ipc |= topo.path[r] == PeerPath::kIpc;
      if (any_ipc) {
        MK_REQUIRE(ctx_->ipc, Code::kInternal, "IPC peers but no IPC server");
        MK_CU_CHECK(d->cuMemExportToShareableHandle(
            &exported_fd, static_cast<CUmemGenericAllocationHandle>(b->local_handle_),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        Status ps = ctx_->ipc->publish(b->id_, exported_fd);
        close(exported_fd);
        MK_CHECK(ps);
      }
    } else {
      MK_CUDA_CHECK(cudaIpcGetMemHandle(&mine.ipc, b->local_));
    }
    return OkStatus();
  };
  Status ps = publish();
  // The allgather doubles as the barrier after which every rank's fd is published.
  std::vector<Exchange> all(world);
  MK_CHECK(ctx_->bs->allgather(&mine, all.data(), sizeof(mine)));
  Status ag = agree(ps, "symmetric alloc: exporting handles");
  if (!ag.ok()) {
    if (ctx_->ipc) ctx_->ipc->retract(b->id_);
    return ag;
  }

  auto import_all = [&]() -> Status {
    const int64_t tmo = tunables::ipc_timeout_ms();
    for (int r = 0; r < world; ++r) {
      switch (topo.path[r]) {
        case PeerPath::kSelf: b->peers_[r] = b->local_; break;
        case PeerPath::kNetwork: b->peers_[r] = nullptr; break;
        case PeerPath::kSameProcess: b->peers_[r] = reinterpret_cast<void*>(all[r].ptr); break;
        case PeerPath::kIpc:
          if (b->mode_ == SymmetricMode::kVmm) {
            int fd = -1;
            const std::string& name =
                static_cast<size_t>(r) < ctx_->ipc_names.size() ? ctx_->ipc_names[r] : std::string();
            MK_CHECK(ipc_fetch_fd(ctx_->secret, rank, r, name, b->id_, tmo, &fd));
            CUmemGenericAllocationHandle h;
            CUresult cr = d->cuMemImportFromShareableHandle(
                &h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            close(fd);
            MK_CU_CHECK(cr);
            b->peer_handles_[r] = h;
            CUdeviceptr va = 0;
            MK_CU_CHECK(d->cuMemAddressReserve(&va, all[r].mapped, 0, 0, 0));
            b->peers_[r] = reinterpret_cast<void*>(va);
            b->peer_mapped_[r] = all[r].mapped;
            MK_CU_CHECK(d->cuMemMap(va, all[r].mapped, 0, h, 0));
            CUmemAccessDesc a;
            memset(&a, 0, sizeof(a));
            a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            a.location.id = ctx_->device;
            a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            MK_CU_CHECK(d->cuMemSetAccess(va, all[r].mapped, &a, 1));
          } else {
            void* p = nullptr;
            MK_CUDA_CHECK(cudaIpcOpenMemHandle(&p, all[r].ipc, cudaIpcMemLazyEnablePeerAccess));
            b->peers_[r] = p;
            b->peer_opened_[r] = true;
          }
          break;
      }
    }
    MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b->d_peers_), world * sizeof(void*)));
    MK_CHECK(copy_bounded(b->d_peers_, b->peers_.data(), world * sizeof(void*), -1,
                          "symmetric alloc: the peer table"));
    return OkStatus();
  };
  *local_err = import_all();
  Status s = agree(*local_err, "symmetric alloc: mapping peers");
  // Every rank has imported (or given up): the exported fd need not be served any longer.
  if (ctx_->ipc) ctx_->ipc->retract(b->id_);
  return s;
}

void SymmetricHeap::release_peers(SymmetricBuffer* b) {
  const CudaDriver* d = nullptr;
  (void)cuda_driver(&d);
  for (int r = 0; r < static_cast<int>(b->peers_.size()); ++r) {
    if (b->peer_handles_.size() > static_cast<size_t>(r) && b->peer_handles_[r] && d) {
      if (b->peers_[r] && b->peer_mapped_[r]) {
        auto va = reinterpret_cast<CUdeviceptr>(b->peers_[r]);
        d->cuMemUnmap(va, b->peer_mapped_[r]);
        d->cuMemAddressFree(va, b->peer_mapped_[r]);
      }
      d->cuMemRelease(static_cast<CUmemGenericAllocationHandle>(b->peer_handles_[r]));
      b->peer_handles_[r] = 0;
    }
    if (b->peer_opened_.size() > static_cast<size_t>(r) && b->peer_opened_[r]) {
      cudaIpcCloseMemHandle(b->peers_[r]);
      b->peer_opened_[r] = false;
    }
    if (r != b->rank_) b->peers_[r] = nullptr;
  }
  if (b->d_peers_) {
    cudaFree(b->d_peers_);
    b->d_peers_ = nullptr;
  }
}

void SymmetricHeap::release_local(SymmetricBuffer* b) {
  if (!b->local_) return;
  if (b->mode_ == SymmetricMode::kVmm) {
    const CudaDriver* d = nullptr;
    if (cuda_driver(&d).ok()) {
      d->cuMemUnmap(reinterpret_cast<CUdeviceptr>(b->local_), b->mapped_);
      d->cuMemAddressFree(reinterpret_cast<CUdeviceptr>(b->local_), b->mapped_);
      if (b->local_handle_) d->cuMemRelease(static_cast<CUmemGenericAllocationHandle>(b->local_handle_));
    }
  } else {
    cudaFree(b->local_);
  }
  b->local_ = nullptr;
  b->local_handle_ = 0;
  if (!b->peers_.empty()) b->peers_[b->rank_] = nullptr;
}

Status SymmetricHeap::free(SymmetricBuffer* b) {
  if (!b || b->freed_) return OkStatus();
  // Own work on the buffer is done (the communicator's streams, bounded; the caller's own
  // streams are the caller's to have finished, as with cudaFree's users); the barrier says
  // every rank's is. A CUDA error is reported, but the barriers are still met so no peer waits
  // in vain.
  Status sync = OkStatus();
  cudaError_t e = cudaSetDevice(ctx_->device);
  if (e != cudaSuccess) {
    sync = make_status(Code::kCudaError, "symmetric free: cudaSetDevice(%d): %s", ctx_->device,
                       cudaGetErrorString(e));
    cudaGetLastError();
  }
  const int64_t bound = std::max<int64_t>(2 * tunables::signal_timeout_ms(), 10000);
  for (cudaStream_t st : ctx_->own_streams) {
    if (!sync.ok()) break;
    sync = sync_stream_bounded(st, bound, "symmetric free");
  }
  Status s1 = ctx_->bs->teardown_barrier();
  release_peers(b);
  // Nobody maps this rank's copy any more once every rank has released its peers.
  Status s2 = s1.ok() ? ctx_->bs->teardown_barrier() : s1;
  release_local(b);
  b->freed_ = true;
  MK_CHECK(sync);
  MK_CHECK(s1);
  MK_CHECK(s2);
  return OkStatus();
}

Status SymmetricHeap::destroy() {
  if (destroyed_) return OkStatus();
  destroyed_ = true;
  Status first;
  for (auto it = buffers_.rbegin(); it != buffers_.rend(); ++it) {
    Status s = free(it->get());
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

}  // namespace mk
