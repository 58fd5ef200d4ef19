#include "mkernel/proxy/windows.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/runtime/bootstrap.h"

namespace mk {
namespace {

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

// Pinned (when a GPU exists, so copies to and from the GPU are asynchronous DMA) or plain.
Status host_alloc(bool gpu, size_t bytes, uint8_t** out) {
  if (gpu) {
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(out), bytes, cudaHostAllocPortable));
  } else {
    *out = static_cast<uint8_t*>(aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
    MK_REQUIRE(*out, Code::kOutOfMemory, "staging: cannot allocate %zu B", bytes);
  }
  memset(*out, 0, bytes);
  return OkStatus();
}
void host_free(bool gpu, uint8_t* p) {
  if (!p) return;
  if (gpu) cudaFreeHost(p);
  else free(p);
}

}  // namespace

Status ProxyWindows::create(Bootstrap* bs, net::Backend* be, const std::string& staging,
                            const StagingConfig& sc, std::unique_ptr<ProxyWindows>* out) {
  MK_REQUIRE(bs && be, Code::kInvalidArgument, "ProxyWindows needs a bootstrap and a backend");
  std::unique_ptr<ProxyWindows> w(new ProxyWindows());
  w->bs_ = bs;
  w->be_ = be;
  w->rank_ = bs->rank();
  w->world_ = bs->size();
  w->mode_ = staging.empty() ? tunables::net_staging() : staging;
  MK_REQUIRE(w->mode_ == "auto" || w->mode_ == "always" || w->mode_ == "never",
             Code::kInvalidArgument, "net_staging must be auto, always or never, got '%s'",
             w->mode_.c_str());
  MK_REQUIRE(sc.chunk_bytes >= 64 && sc.inbox_slots >= 1 && sc.inbox_slots <= 0xffff &&
                 sc.outbox_slots >= 1,
             Code::kInvalidArgument, "staging config: chunk >= 64 B, 1..65535 inbox slots, >= 1 outbox slot");
  MK_REQUIRE(w->world_ <= kMaxStagedRanks, Code::kNotSupported,
             "staging supports up to %d ranks", kMaxStagedRanks);
  w->sc_ = sc;
  w->gpu_ = have_gpu();
  *out = std::move(w);
  return OkStatus();
}

ProxyWindows::~ProxyWindows() { (void)destroy(); }

Status ProxyWindows::ensure_staging() {
  if (staging_ready_) return OkStatus();
  const uint64_t slot = slot_bytes();
  Status s = [&]() -> Status {
    MK_CHECK(host_alloc(gpu_, world_ * sc_.inbox_slots * slot, &inbox_));
    MK_CHECK(host_alloc(gpu_, sc_.outbox_slots * slot, &outbox_));
    MK_CHECK(host_alloc(gpu_, 64, &credit_));
    return OkStatus();
  }();
  MK_CHECK(agree(*bs_, s, "staging buffers"));
  MK_CHECK(be_->register_window(inbox_, world_ * sc_.inbox_slots * slot, net::MemKind::kHost, &inbox_id_));
  MK_CHECK(be_->register_window(outbox_, sc_.outbox_slots * slot, net::MemKind::kHost, &outbox_id_));
  MK_CHECK(be_->register_window(credit_, 64, net::MemKind::kHost, &credit_id_));
  staging_ready_ = true;
  MK_INFO(kSubsysProxy, "staging: %u x %u B inbox slots per rank, %u outbox slots",
          sc_.inbox_slots, sc_.chunk_bytes, sc_.outbox_slots);
  return OkStatus();
}

Status ProxyWindows::add(void* base, uint64_t bytes, net::MemKind kind, uint32_t* id) {
  MK_REQUIRE(!destroyed_, Code::kInvalidArgument, "ProxyWindows: add after destroy");
  Window w;
  w.base = base;
  w.bytes = bytes;
  w.kind = kind;
  struct Info {
    uint64_t bytes;
    uint32_t staged;
    uint32_t kind;
  } mine{bytes, 0, static_cast<uint32_t>(kind)};
  const bool hmem = be_->caps().cuda_windows;
  mine.staged = mode_ == "always" || (mode_ == "auto" && kind == net::MemKind::kCuda && !hmem);
  MK_REQUIRE(!(mode_ == "never" && kind == net::MemKind::kCuda && !hmem), Code::kNotSupported,
             "backend %s cannot register GPU memory and net_staging=never", be_->name());
  std::vector<Info> all(world_);
  MK_CHECK(bs_->allgather(&mine, all.data(), sizeof(mine)));
  for (int r = 0; r < world_; ++r) {
    MK_REQUIRE(all[r].staged == all[0].staged, Code::kMismatch,
               "window %zu: ranks disagree on staging (rank 0: %u, rank %d: %u)", wins_.size(),
               all[0].staged, r, all[r].staged);
    w.sizes.push_back(all[r].bytes);
  }
  w.staged = all[0].staged != 0;
  if (w.staged) {
    MK_CHECK(ensure_staging());
  } else {
    MK_CHECK(be_->register_window(base, bytes, kind, &w.backend_id));
    direct_gpu_ |= kind == net::MemKind::kCuda;
  }
  *id = static_cast<uint32_t>(wins_.size());
  wins_.push_back(w);
  MK_INFO(kSubsysProxy, "window %u: %llu B of %s memory, %s", *id,
          static_cast<unsigned long long>(bytes), kind == net::MemKind::kCuda ? "GPU" : "host",
          w.staged ? "staged through host buffers" : "registered with the backend");
  return OkStatus();
}

uint64_t ProxyWindows::size(uint32_t id, int rank) const {
  if (id >= wins_.size() || rank < 0 || rank >= world_) return 0;
  return wins_[id].sizes[rank];
}

uint8_t* ProxyWindows::inbox_slot(int sender, uint32_t k) const {
  return inbox_ + inbox_offset(sender, k);
}
uint64_t ProxyWindows::inbox_offset(int sender, uint32_t k) const {
  return (uint64_t(sender) * sc_.inbox_slots + k) * slot_bytes();
}
uint8_t* ProxyWindows::outbox_slot(uint32_t k) const { return outbox_ + uint64_t(k) * slot_bytes(); }

Status ProxyWindows::destroy() {
  if (destroyed_) return OkStatus();
  destroyed_ = true;
  Status first;
  for (auto it = wins_.rbegin(); it != wins_.rend(); ++it)
    if (!it->staged) {
      Status s = be_->deregister_window(it->backend_id);
      if (!s.ok() && first.ok()) first = s;
    }
  if (staging_ready_) {
    for (net::WindowId id : {credit_id_, outbox_id_, inbox_id_}) {
      Status s = be_->deregister_window(id);
      if (!s.ok() && first.ok()) first = s;
    }
  }
  host_free(gpu_, inbox_);
  host_free(gpu_, outbox_);
  host_free(gpu_, credit_);
  inbox_ = outbox_ = credit_ = nullptr;
  return first;
}

}  // namespace mk
