// The default staging copier: memcpy for host memory; for GPU memory, cudaMemcpyAsync on a
// stream of the windows' device, one event per copy in flight.
//
// Only staged GPU windows make it touch CUDA: prepare() (at window registration, on the
// registering thread) creates the stream and every event it will need, so copies on the
// proxy thread create nothing. Host-only staging never calls CUDA.
#pragma once

#include <cstdint>
#include <vector>

#include "mkernel/proxy/windows.h"

typedef struct CUstream_st* cudaStream_t;

namespace mk {

class DefaultStagingCopier final : public StagingCopier {
 public:
  DefaultStagingCopier() = default;
  ~DefaultStagingCopier() override;
  DefaultStagingCopier(const DefaultStagingCopier&) = delete;
  DefaultStagingCopier& operator=(const DefaultStagingCopier&) = delete;

  // Readies GPU copies for memory of `device`, at most `max_copies` in flight. Idempotent for
  // the same device; GPU windows of two devices are refused (one proxy serves one device).
  // @post start(..., device=true, ...) needs no allocation
  Status prepare(int device, uint32_t max_copies);
  Status start(void* dst, const void* src, uint64_t bytes, bool device, int* ticket) override;
  Status poll(int ticket, bool* done) override;

 private:
  int device_ = -1;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> events_;    // cudaEvent_t, one per ticket
  std::vector<int> free_;        // tickets not in flight
};

}  // namespace mk
