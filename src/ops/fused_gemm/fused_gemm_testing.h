// FusedGemm's internals for tests (library-internal: not installed; users have
// include/mkernel/ops/fused.h).
#pragma once

#include <cuda_runtime_api.h>

#include "mkernel/common/status.h"
#include "mkernel/ops/fused.h"
#include "src/ops/control/split_controller.h"
#include "src/ops/fused_gemm/fused_gemm_plan.h"

namespace mk {
namespace ops {

struct FusedGemmTesting {
  // The operator's plan (program, tiles, routes).
  static const Plan& plan(const FusedGemm& op);
  // From the next call on, each call's controller sets the split to counts[i] once at_tiles[i]
  // tiles are taken (i in order, n <= 4; n = 0 clears), then carries on with its rule: role
  // switches in both directions at known points of a call. kInvalidArgument when the controller
  // is off or the lists are bad.
  static Status force_splits(FusedGemm* op, const int* at_tiles, const int* counts, int n, cudaStream_t stream);
  // The controller's device state after the calls on `stream` (synchronizes it): whether a call
  // ran the rule, the split it settled on, the switches of the latest call, the stalled gauge,
  // the measured sample cost and the interval.
  static Status split_state(FusedGemm* op, SplitReadout* out, cudaStream_t stream);
};


}  // namespace ops
}  // namespace mk
