// Instantiation unit of the sm_90a attention kernel: head dimension 64 with the communication
// role (ring attention), traced and untraced.
#include "src/attention/kernel/launch.cuh"

namespace mk {
namespace attention {
namespace sm90 {

Status launch_d64_comm(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid) {
  return l.trace ? launch<64, true, comm::CommRole>(a, l, stream, grid)
                 : launch<64, false, comm::CommRole>(a, l, stream, grid);
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
