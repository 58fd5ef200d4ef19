// mkernel — small library kernels around signals and epochs (host entry points).
#pragma once

#include <cuda_runtime_api.h>

#include "mkernel/common/status.h"
#include "mkernel/device/views.h"

namespace mk {
// Launches a one-thread kernel that advances *e (stream-ordered; capturable in a graph).
Status launch_epoch_advance(EpochState* e, cudaStream_t stream);
}  // namespace mk
