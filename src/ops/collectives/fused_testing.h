// mkernel — test hooks of the fused GEMM collectives (library-internal).
#pragma once

#include <cuda_runtime_api.h>

#include "mkernel/common/status.h"
#include "mkernel/ops/fused.h"

namespace mk {
namespace ops {

// From the next call on, each call's controller sets the split to counts[i] once at_tiles[i]
// tiles are taken (i in order, n <= 4; n = 0 clears), then carries on with its rule: role
// switches in both directions at known points of a call. kInvalidArgument when the controller
// is off or the lists are bad.
Status fused_force_splits(FusedGemm* op, const int* at_tiles, const int* counts, int n, cudaStream_t stream);

}  // namespace ops
}  // namespace mk
