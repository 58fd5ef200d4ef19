// mkernel — MPI bootstrap over a caller's communicator. Needs <mpi.h>; available when
// mkernel was built with MPI (mk::have_mpi()).
#pragma once

#include <mpi.h>

#include <memory>

#include "mkernel/runtime/bootstrap.h"

namespace mk {

// Duplicates `comm` (collective over comm) so mkernel's traffic never matches the caller's.
// Collectives are point-to-point with a deadline, so a missing rank is named, not waited on.
// @pre MPI is initialized.
Status make_mpi_bootstrap(MPI_Comm comm, std::unique_ptr<Bootstrap>* out);

}  // namespace mk
