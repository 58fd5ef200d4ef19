// Instantiation unit of the sm_90a attention kernel: head dimension 64, plain launches (no
// communication, untraced).
#include "src/attention/kernel/launch.cuh"

namespace mk {
namespace attention {
namespace sm90 {

Status launch_d64(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid) {
  return launch<64, false, comm::NoComm>(a, l, stream, grid);
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
