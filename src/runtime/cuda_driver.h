// CUDA driver entry points reached through the runtime (cudaGetDriverEntryPointByVersion),
// so mkernel never links libcuda and its binaries start on machines without a driver.
#pragma once

#include <cuda.h>

#include "mkernel/common/check.h"

namespace mk {

struct CudaDriver {
#define MK_DRIVER_FN(name) decltype(&::name) name = nullptr;
  MK_DRIVER_FN(cuMemCreate)
  MK_DRIVER_FN(cuMemRelease)
  MK_DRIVER_FN(cuMemMap)
  MK_DRIVER_FN(cuMemUnmap)
  MK_DRIVER_FN(cuMemSetAccess)
  MK_DRIVER_FN(cuMemAddressReserve)
  MK_DRIVER_FN(cuMemAddressFree)
  MK_DRIVER_FN(cuMemExportToShareableHandle)
  MK_DRIVER_FN(cuMemImportFromShareableHandle)
  MK_DRIVER_FN(cuMemGetAllocationGranularity)
  MK_DRIVER_FN(cuDeviceGetAttribute)
  MK_DRIVER_FN(cuDeviceGet)
  MK_DRIVER_FN(cuGetErrorString)
  MK_DRIVER_FN(cuStreamWriteValue64)
  MK_DRIVER_FN(cuFlushGPUDirectRDMAWrites)
  MK_DRIVER_FN(cuTensorMapEncodeTiled)
#undef MK_DRIVER_FN
};

// Resolved once per process; kNotSupported when there is no driver.
Status cuda_driver(const CudaDriver** out);
// "CUDA_ERROR_OUT_OF_MEMORY: out of memory" (or the number when the driver is absent).
const char* cu_error_string(CUresult r);

Status cu_status(CUresult r, const char* expr, const char* file, int line);

}  // namespace mk

// Driver-call check: logs file:line -> code and returns a Status naming the CUresult.
#define MK_CU_CHECK(expr)                                                            \
  do {                                                                               \
    CUresult mk_cu_e_ = (expr);                                                      \
    if (mk_cu_e_ != CUDA_SUCCESS) {                                                  \
      ::mk::Status mk_s_ = ::mk::cu_status(mk_cu_e_, #expr, __FILE__, __LINE__);     \
      ::mk::detail::log_check_failure(__FILE__, __LINE__, #expr, mk_s_);             \
      return mk_s_;                                                                  \
    }                                                                                \
  } while (0)
