// Instantiation unit of the sm_90a attention kernel: head dimension 128 with the communication
// role (ring attention), traced and untraced.
#include "src/attention/kernel/launch.cuh"

namespace mk {
namespace attention {
namespace sm90 {

Status launch_d128_comm(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid) {
  return l.trace ? launch<128, true, comm::CommRole>(a, l, stream, grid)
                 : launch<128, false, comm::CommRole>(a, l, stream, grid);
}

}  // namespace sm90
}  // namespace attention
}  // namespace mk
