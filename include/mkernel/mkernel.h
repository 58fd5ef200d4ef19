// mkernel — fused multi-GPU, multi-node kernels. The one header users include.
#pragma once

#include "mkernel/common/log.h"
#include "mkernel/common/status.h"
#include "mkernel/common/tunables.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/views.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/communicator.h"
#include "mkernel/runtime/symmetric_heap.h"
#include "mkernel/runtime/topology.h"

namespace mk {
const char* version();
// Launches a one-thread kernel that advances *e (stream-ordered; capturable in a graph).
Status launch_epoch_advance(EpochState* e, cudaStream_t stream);
}  // namespace mk
