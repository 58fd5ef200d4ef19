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

// The bound of the library's setup and teardown waits: max(2 x signal_timeout_ms, 10 s).
int64_t device_setup_timeout_ms();
// A copy (cudaMemcpyDefault) or a zeroing of fresh memory at setup, on a stream of its own that
// waits for no other work (cudaStreamNonBlocking), done within timeout_ms (< 0: the setup bound):
// a device busy with hung work of someone else fails the call with kTimeout naming `what`
// instead of hanging it (a plain cudaMemcpy or cudaMemset goes through the legacy stream).
Status copy_bounded(void* dst, const void* src, size_t bytes, int64_t timeout_ms, const char* what);
Status zero_bounded(void* dst, size_t bytes, int64_t timeout_ms, const char* what);
// Waits for all work on the current device, for at most timeout_ms (< 0: the setup bound). The
// driver's device-wide sync cannot be bounded, so it runs on a helper thread; after kTimeout that
// thread is left to finish (or not) on its own.
Status device_sync_bounded(int64_t timeout_ms, const char* what);
}  // namespace mk
