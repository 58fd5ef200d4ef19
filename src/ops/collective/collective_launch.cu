// The standalone collectives' kernel: the program alone (src/comm/runner.cuh).
#include "src/comm/runner.cuh"
#include "src/ops/collective/collective_launch.h"

namespace mk {
namespace ops {

Status collective_launch(const comm::DeviceProgram& h, int ctas, cudaStream_t stream) {
  return comm::run_program(h, ctas, stream);
}

}  // namespace ops
}  // namespace mk
