// The loopback backend: every rank is a thread of this process (a thread world), so a put is
// a copy into the peer's window followed by an arrival pushed onto the peer's inbox.
//
// Ranks find each other through the bootstrap: each publishes a pointer to its backend object
// (and its pid, checked). Window tables are gathered at registration, so a put reads only this
// rank's copy of the table; the one shared structure is each rank's inbox (mutex-protected).
// Host windows are copied with memmove; when either window is GPU memory the copy is a
// cudaMemcpy (cudaMemcpyDefault), so host-only use never calls CUDA.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <limits>
#include <mutex>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/net/backend.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/topology.h"
#include "src/net/net_internal.h"

namespace mk {
namespace net {
namespace {

constexpr uint32_t kDefaultDepth = 1024;

class LoopbackBackend final : public Backend {
 public:
  LoopbackBackend(Bootstrap& bs, uint32_t depth)
      : bs_(bs), rank_(bs.rank()), world_(bs.size()), depth_(depth ? depth : kDefaultDepth) {}

  Status init() {
    struct Hello {
      uint64_t self;
      uint64_t pid;
    };
    Hello mine{reinterpret_cast<uint64_t>(this), static_cast<uint64_t>(getpid())};
    std::vector<Hello> all(world_);
    MK_CHECK(bs_.allgather(&mine, all.data(), sizeof(Hello)));
    peers_.resize(world_);
    for (int r = 0; r < world_; ++r) {
      MK_REQUIRE(all[r].pid == mine.pid, Code::kNotSupported,
                 "loopback backend: rank %d is process %llu, this rank (%d) is process %llu; "
                 "loopback needs every rank in one process",
                 r, static_cast<unsigned long long>(all[r].pid), rank_,
                 static_cast<unsigned long long>(mine.pid));
      peers_[r] = reinterpret_cast<LoopbackBackend*>(all[r].self);
    }
    MK_INFO(kSubsysNet, "loopback backend: %d ranks in process %llu, inbox depth %u", world_,
            static_cast<unsigned long long>(mine.pid), depth_);
    return OkStatus();
  }

  const char* name() const override { return "loopback"; }

  BackendCaps caps() const override {
    BackendCaps c;
    c.cuda_windows = true;  // copies go through cudaMemcpy when a window is GPU memory
    c.imm_bytes = 4;
    c.max_put_bytes = std::numeric_limits<uint64_t>::max();
    c.inject_bytes = std::numeric_limits<uint64_t>::max();  // every put is done when posted
    return c;
  }

  Status register_window(void* base, size_t bytes, MemKind kind, WindowId* id) override {
    MK_REQUIRE(id != nullptr, Code::kInvalidArgument, "loopback register_window: id is null");
    *id = kNoWindow;
    MK_REQUIRE(!finalized_, Code::kInvalidArgument, "loopback register_window after finalize");
    Status local;
    if (base == nullptr && bytes > 0)
      local = make_status(Code::kInvalidArgument,
                          "loopback register_window: null base for %zu bytes", bytes);
    else if (kind != MemKind::kHost && kind != MemKind::kCuda)
      local = make_status(Code::kInvalidArgument, "loopback register_window: unknown memory kind %u",
                          static_cast<unsigned>(kind));
    MK_CHECK(agree(bs_, local, "loopback register_window"));
    Entry mine{reinterpret_cast<uint64_t>(base), bytes, static_cast<uint32_t>(kind), 0};
    std::vector<Entry> all(world_);
    MK_CHECK(bs_.allgather(&mine, all.data(), sizeof(Entry)));
    windows_.push_back(std::move(all));
    live_.push_back(true);
    *id = static_cast<WindowId>(windows_.size() - 1);
    return OkStatus();
  }

  Status deregister_window(WindowId id) override {
    MK_REQUIRE(id < windows_.size(), Code::kInvalidArgument,
               "loopback deregister_window: unknown window %u", id);
    if (!live_[id] || finalized_) return OkStatus();
    MK_CHECK(bs_.teardown_barrier());  // no rank still writes into it
    live_[id] = false;
    return OkStatus();
  }

  uint64_t window_size(WindowId id, int rank) const override {
    if (id >= windows_.size() || !live_[id] || rank < 0 || rank >= world_) return 0;
    return windows_[id][rank].size;
  }

  Status put(int peer, WindowId src, uint64_t src_off, WindowId dst, uint64_t dst_off,
             uint64_t bytes, uint32_t imm, uint64_t cookie, bool* posted) override {
    *posted = false;
    MK_REQUIRE(!finalized_, Code::kInvalidArgument, "loopback put to rank %d after finalize", peer);
    MK_REQUIRE(peer >= 0 && peer < world_, Code::kInvalidArgument,
               "loopback put: peer %d outside world of %d", peer, world_);
    MK_REQUIRE(src < windows_.size() && live_[src] && dst < windows_.size() && live_[dst],
               Code::kInvalidArgument, "loopback put to rank %d: window %u or %u not registered",
               peer, src, dst);
    LoopbackBackend* p = peers_[peer];
    {
      std::lock_guard<std::mutex> g(p->in_mu_);
      if (p->inbox_.size() + p->reserved_ >= p->depth_) return OkStatus();  // back-pressure
      ++p->reserved_;
    }
    Status s;
    if (bytes > 0) {
      const Entry& se = windows_[src][rank_];
      const Entry& de = windows_[dst][peer];
      auto* from = reinterpret_cast<const uint8_t*>(se.base) + src_off;
      auto* to = reinterpret_cast<uint8_t*>(de.base) + dst_off;
      if (se.kind == static_cast<uint32_t>(MemKind::kHost) &&
          de.kind == static_cast<uint32_t>(MemKind::kHost)) {
        memmove(to, from, bytes);
      } else {
        cudaError_t e = cudaMemcpy(to, from, bytes, cudaMemcpyDefault);
        if (e != cudaSuccess)
          s = make_status(Code::kCudaError, "loopback put to rank %d (%llu bytes): cudaMemcpy: %s",
                          peer, static_cast<unsigned long long>(bytes), cudaGetErrorString(e));
      }
    }
    {
      std::lock_guard<std::mutex> g(p->in_mu_);
      --p->reserved_;
      if (s.ok()) p->inbox_.push_back(imm);
    }
    if (!s.ok()) return s;
    done_.push_back(LocalDone{cookie});
    *posted = true;
    return OkStatus();
  }

  Status progress(std::vector<LocalDone>* done, std::vector<Arrival>* arrivals) override {
    MK_REQUIRE(!finalized_, Code::kInvalidArgument, "loopback progress after finalize");
    if (!done_.empty()) {
      done->insert(done->end(), done_.begin(), done_.end());
      done_.clear();
    }
    std::lock_guard<std::mutex> g(in_mu_);
    for (uint32_t imm : inbox_) arrivals->push_back(Arrival{imm});
    inbox_.clear();
    return OkStatus();
  }

  Status finalize() override {
    if (finalized_) return OkStatus();
    finalized_ = true;
    // After this barrier no rank puts into this one, so the object may be destroyed.
    return bs_.teardown_barrier();
  }

 private:
  struct Entry {
    uint64_t base;
    uint64_t size;
    uint32_t kind;
    uint32_t pad;
  };

  Bootstrap& bs_;
  const int rank_;
  const int world_;
  const uint32_t depth_;
  std::vector<LoopbackBackend*> peers_;
  std::vector<std::vector<Entry>> windows_;  // [id][rank]
  std::vector<bool> live_;
  std::vector<LocalDone> done_;  // this rank's thread only
  bool finalized_ = false;

  // The inbox: written by every rank's thread, drained by this rank's.
  std::mutex in_mu_;
  std::deque<uint32_t> inbox_;
  size_t reserved_ = 0;  // slots taken by puts copying right now
};

}  // namespace

Status create_loopback_backend(Bootstrap& bs, const Topology& topo, uint32_t queue_depth,
                               std::unique_ptr<Backend>* out) {
  // Decided from the gathered infos alone, so every rank reaches the same verdict without
  // a collective (the path may be kNetwork between emulated nodes of one process: fine).
  const RankInfo& me = topo.info[topo.rank];
  for (int r = 0; r < topo.world; ++r) {
    const RankInfo& p = topo.info[r];
    MK_REQUIRE(p.pid == me.pid && p.host_hash == me.host_hash, Code::kNotSupported,
               "loopback backend needs every rank in this process (a thread world): rank %d is "
               "process %llu on %s, rank %d is process %llu on %s",
               r, static_cast<unsigned long long>(p.pid), p.hostname, topo.rank,
               static_cast<unsigned long long>(me.pid), me.hostname);
  }
  auto b = std::make_unique<LoopbackBackend>(bs, queue_depth);
  MK_CHECK(b->init());
  *out = std::move(b);
  return OkStatus();
}

}  // namespace net
}  // namespace mk
