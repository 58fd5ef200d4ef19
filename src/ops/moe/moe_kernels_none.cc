// MoE kernels in a build without the CUTLASS headers (the communication executor needs them):
// the operator reports kNotSupported.
#include "mkernel/common/check.h"
#include "src/ops/moe/moe_launch.h"

namespace mk {
namespace ops {

Status moe_prepare_launch(const MoeLaunch&) { return OkStatus(); }
Status moe_dispatch_launch(const MoeLaunch&, const void*, const int32_t*, const float*, const int32_t*, int64_t, void*,
                           int32_t*, int32_t*, cudaStream_t) {
  return make_status(Code::kNotSupported, "moe: this build has no CUTLASS headers (the MoE kernels need them)");
}
Status moe_combine_launch(const MoeLaunch&, const void*, void*, cudaStream_t) {
  return make_status(Code::kNotSupported, "moe: this build has no CUTLASS headers (the MoE kernels need them)");
}

}  // namespace ops
}  // namespace mk
