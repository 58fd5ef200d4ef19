// mkernel — CUDA runtime check macros (host code). Convert a cudaError_t into a Status with
// the failing expression, error name and call site, log it and return.
#pragma once

#include <cuda_runtime_api.h>

#include "mkernel/common/check.h"

#define MK_CUDA_CHECK(expr)                                                        \
  do {                                                                             \
    cudaError_t mk_cuda_e_ = (expr);                                               \
    if (mk_cuda_e_ != cudaSuccess) {                                               \
      ::mk::Status mk_s_ = ::mk::detail::cuda_status(mk_cuda_e_, #expr, __FILE__, __LINE__); \
      ::mk::detail::log_check_failure(__FILE__, __LINE__, #expr, mk_s_);           \
      return mk_s_;                                                                \
    }                                                                              \
  } while (0)

namespace mk {
// Waits until every piece of work on `stream` is done, polling (never blocking in the driver)
// for at most timeout_ms; kTimeout names `what` when it takes longer, a CUDA error is returned
// as a Status. For the library's own setup and teardown streams: never a device-wide sync.
Status sync_stream_bounded(cudaStream_t stream, int64_t timeout_ms, const char* what);
}  // namespace mk
