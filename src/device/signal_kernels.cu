// Small library kernels around signals and epochs.
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/epoch.cuh"
#include "mkernel/device/launch.h"

namespace mk {
namespace {
__global__ void epoch_advance_kernel(EpochState* e) {
  atomicAdd(reinterpret_cast<unsigned long long*>(&e->value), 1ull);
}
}  // namespace

Status launch_epoch_advance(EpochState* e, cudaStream_t stream) {
  MK_REQUIRE(e, Code::kInvalidArgument, "launch_epoch_advance: null epoch");
  epoch_advance_kernel<<<1, 1, 0, stream>>>(e);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

}  // namespace mk
