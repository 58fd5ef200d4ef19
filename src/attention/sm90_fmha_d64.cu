// Instantiation unit of the sm_90a attention kernel: head dimension 64 (traced and untraced).
#include "src/attention/sm90_fmha_kernel.cuh"

namespace mk {
namespace attention {
namespace sm90 {

Status launch_d64(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid) {
  return launch_variant<64>(a, l, stream, grid);
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
