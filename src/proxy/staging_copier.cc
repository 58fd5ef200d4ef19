#include "src/proxy/staging_copier.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"

namespace mk {

DefaultStagingCopier::~DefaultStagingCopier() {
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (stream_) cudaStreamDestroy(stream_);
}

Status DefaultStagingCopier::prepare(int device, uint32_t max_copies) {
  MK_REQUIRE(device_ < 0 || device_ == device, Code::kNotSupported,
             "staged GPU windows on devices %d and %d: one proxy serves one device", device_, device);
  if (events_.size() >= max_copies && stream_) return OkStatus();
  // The stream and the events belong to the windows' device, whatever device is current here.
  int cur = 0;
  MK_CUDA_CHECK(cudaGetDevice(&cur));
  MK_CUDA_CHECK(cudaSetDevice(device));
  Status s = [&]() -> Status {
    if (!stream_) MK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    while (events_.size() < max_copies) {
      cudaEvent_t e;
      MK_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      events_.push_back(e);
      free_.push_back(static_cast<int>(events_.size()) - 1);
    }
    return OkStatus();
  }();
  cudaSetDevice(cur);
  MK_CHECK(s);
  device_ = device;
  return OkStatus();
}

Status DefaultStagingCopier::start(void* dst, const void* src, uint64_t bytes, bool device, int* ticket) {
  *ticket = -1;
  if (bytes == 0) return OkStatus();
  if (!device) {
    memcpy(dst, src, bytes);
    return OkStatus();
  }
  MK_REQUIRE(stream_ && !free_.empty(), Code::kInternal,
             "staging: a GPU copy with %s (prepare() sizes them)",
             stream_ ? "every copy ticket in flight" : "no stream");
  MK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  const int t = free_.back();
  MK_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[t]), stream_));
  free_.pop_back();
  *ticket = t;
  return OkStatus();
}

Status DefaultStagingCopier::poll(int ticket, bool* done) {
  *done = false;
  cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(events_[ticket]));
  if (e == cudaErrorNotReady) return OkStatus();
  if (e != cudaSuccess) {
    // Never done: the ticket is not reused, and staging fails (nothing more is posted).
    cudaGetLastError();
    return make_status(Code::kCudaError, "%s", cudaGetErrorString(e));
  }
  free_.push_back(ticket);
  *done = true;
  return OkStatus();
}

}  // namespace mk
