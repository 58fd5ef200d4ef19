// mkernel — the standalone collectives' launch (host declaration; kernel in collective_launch.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "mkernel/common/status.h"
#include "src/comm/device_program.h"

namespace mk {
namespace ops {

// One call of the resolved program h (the caller's buffers bound in h.user) on `ctas` CTAs.
Status collective_launch(const comm::DeviceProgram& h, int ctas, cudaStream_t stream);

}  // namespace ops
}  // namespace mk
