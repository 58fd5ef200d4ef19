// Instantiation unit of the sm_90a attention backward kernel: head dimension 64.
#include "src/attention/kernel/bwd_launch.cuh"

namespace mk {
namespace attention {
namespace sm90 {

Status launch_bwd_d64(const BackwardArgs& a, const BwdWorkspace& w, cudaStream_t stream, const BwdRing* ring) {
  return launch_bwd<64>(a, w, stream, ring);
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
