// The SM-partition controller of one operator, host side (see src/ops/control/split_controller.h).
#include "src/ops/control/split_controller.h"

#include <cstddef>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/ops/control/split_memory.h"

namespace mk {
namespace ops {

bool SplitController::wanted(int64_t comm_ctas_option, int world) {
  return comm_ctas_option < 0 && tunables::fused_split() == "auto" && world > 1;
}

SplitController::~SplitController() {
  if (h_mean_) (void)cudaFreeHost(h_mean_);
}

int SplitController::start(const std::string& key, int fallback) {
  on_ = true;
  key_ = key;
  int learned = 0;
  return SplitMemory::process().lookup(key_, &learned) ? learned : fallback;
}

Status SplitController::setup(comm::OpSession& ses, bool in_order) {
  if (!on_) return OkStatus();
  comm::SplitCtl c{};
  c.hi_auto = 1;
  c.interval_ns = kIntervalNs;
  c.limits.lo = 1;
  c.limits.hi = 1;
  c.limits.in_order = in_order ? 1 : 0;
  MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&h_mean_), sizeof(int), cudaHostAllocMapped));
  *h_mean_ = 0;
  MK_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&c.host_mean), h_mean_, 0));
  MK_CHECK(ses.upload(std::vector<comm::SplitCtl>{c}, &d_ctl_));
  return OkStatus();
}

int SplitController::settled() const {
  if (!on_ || !h_mean_) return 0;
  const int v = *reinterpret_cast<volatile int*>(h_mean_);
  return v >= 1 ? v : 0;
}

void SplitController::remember(bool write_now) {
  if (!h_mean_) return;
  const int v = *reinterpret_cast<volatile int*>(h_mean_);
  if (v >= 1 && v != recorded_) {
    Status s = SplitMemory::process().record(key_, v, false);
    if (!s.ok()) MK_WARN(kSubsysTune, "%s", s.message().c_str());
    recorded_ = v;
  }
  if (write_now) {
    Status s = SplitMemory::process().flush();
    if (!s.ok()) MK_WARN(kSubsysTune, "%s", s.message().c_str());
  }
}

void SplitController::finish(bool device_alive) {
  if (!h_mean_) return;
  // A graph that captured calls must be destroyed before the operator, as for its buffers.
  // Bounded: a device hung by other work costs the remembered split, not a hung destroy.
  if (d_ctl_ && device_alive) {
    Status s = device_sync_bounded(-1, "fused: reading the controller's last split");
    if (s.ok()) s = copy_bounded(h_mean_, &d_ctl_->last_mean, sizeof(int), -1, "fused: reading the controller's last split");
    if (!s.ok()) MK_WARN(kSubsysTune, "%s (the split is not remembered)", s.message().c_str());
  }
  remember(true);
}

Status SplitController::state(SplitReadout* out, cudaStream_t stream) const {
  MK_REQUIRE(d_ctl_, Code::kInvalidArgument, "fused: the controller was never on");
  comm::SplitCtl c{};
  MK_CUDA_CHECK(cudaMemcpyAsync(&c, d_ctl_, sizeof(c), cudaMemcpyDeviceToHost, stream));
  MK_CUDA_CHECK(cudaStreamSynchronize(stream));
  out->has_mean = c.has_mean;
  out->last_mean = c.last_mean;
  out->changes = c.state.changes;
  out->stalled = c.stalled;
  out->sample_ns = c.sample_ns;
  out->gap_ns = c.gap_ns;
  return OkStatus();
}

Status SplitController::force(const int* at_tiles, const int* counts, int n, cudaStream_t stream) {
  MK_REQUIRE(on_ && d_ctl_, Code::kInvalidArgument,
             "fused: forced splits need the controller on (fused_split=auto, comm_ctas -1, W > 1)");
  MK_REQUIRE(n >= 0 && n <= comm::kSplitForceMax && (n == 0 || (at_tiles && counts)), Code::kInvalidArgument,
             "fused: 0..%d forced splits (got %d)", comm::kSplitForceMax, n);
  struct Block {
    int32_t n_force, next_force;
    int32_t at[comm::kSplitForceMax], to[comm::kSplitForceMax];
  } b{};
  static_assert(offsetof(comm::SplitCtl, force_to) - offsetof(comm::SplitCtl, n_force) ==
                    offsetof(Block, to) - offsetof(Block, n_force),
                "SplitCtl's forced-split block");
  b.n_force = n;
  for (int i = 0; i < n; ++i) {
    MK_REQUIRE(counts[i] >= 1 && at_tiles[i] >= 0 && (i == 0 || at_tiles[i] >= at_tiles[i - 1]),
               Code::kInvalidArgument, "fused: forced split %d: %d CTAs at %d tiles (counts >= 1, tiles ascending)",
               i, counts[i], at_tiles[i]);
    b.at[i] = at_tiles[i];
    b.to[i] = counts[i];
  }
  char* dst = reinterpret_cast<char*>(d_ctl_) + offsetof(comm::SplitCtl, n_force);
  MK_CUDA_CHECK(cudaMemcpyAsync(dst, &b, sizeof(b), cudaMemcpyHostToDevice, stream));
  MK_CUDA_CHECK(cudaStreamSynchronize(stream));  // b lives on this stack
  return OkStatus();
}

}  // namespace ops
}  // namespace mk
