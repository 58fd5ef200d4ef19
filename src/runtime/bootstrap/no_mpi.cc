// Built instead of mpi_bootstrap.cc when mkernel is configured without MPI.
#include "mkernel/runtime/bootstrap.h"

namespace mk {

bool have_mpi() { return false; }

Status make_mpi_world_bootstrap(std::unique_ptr<Bootstrap>*) {
  return Status(Code::kNotSupported, "mkernel was built without MPI; use the threads or store bootstrap");
}

}  // namespace mk
