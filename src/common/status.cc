#include "mkernel/common/status.h"

#include <cerrno>
#include <chrono>
#include <thread>
#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include <cuda_runtime_api.h>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/common/deadline.h"

namespace mk {

const char* code_name(Code c) {
  switch (c) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kMismatch: return "mismatch across ranks";
    case Code::kTimeout: return "timeout";
    case Code::kCudaError: return "CUDA error";
    case Code::kSystemError: return "system error";
    case Code::kOutOfMemory: return "out of memory";
    case Code::kNotSupported: return "not supported";
    case Code::kRemoteError: return "remote error";
    case Code::kPermissionDenied: return "permission denied";
    case Code::kInternal: return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string s = code_name(code_);
  if (!msg_.empty()) s += ": " + msg_;
  return s;
}

Status make_status(Code code, const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return Status(code, buf);
}

namespace detail {

void log_check_failure(const char* file, int line, const char* expr, const Status& s) {
  // Strip the directory: the log line stays short and still points at the call site.
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  MK_LOG(LogLevel::kInfo, kSubsysAll, "%s:%d -> %s (%s)", base, line, code_name(s.code()), expr);
}

Status cuda_status(int err, const char* expr, const char* file, int line) {
  auto e = static_cast<cudaError_t>(err);
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  Code code = (e == cudaErrorMemoryAllocation) ? Code::kOutOfMemory : Code::kCudaError;
  return make_status(code, "%s failed: %s (%s, %d) at %s:%d", expr, cudaGetErrorString(e),
                     cudaGetErrorName(e), err, base, line);
}

Status errno_status(int err, const char* expr, const char* file, int line) {
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  return make_status(Code::kSystemError, "%s failed: %s (errno %d) at %s:%d", expr,
                     strerror(err), err, base, line);
}

}  // namespace detail

Status sync_stream_bounded(cudaStream_t stream, int64_t timeout_ms, const char* what) {
  const auto deadline = deadline_after_ms(timeout_ms);
  for (;;) {
    cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return OkStatus();
    if (e != cudaErrorNotReady) {
      cudaGetLastError();
      return make_status(e == cudaErrorMemoryAllocation ? Code::kOutOfMemory : Code::kCudaError,
                         "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    if (std::chrono::steady_clock::now() > deadline)
      return make_status(Code::kTimeout, "%s: the work on its stream did not finish within %lld ms",
                         what, static_cast<long long>(timeout_ms));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

int64_t device_setup_timeout_ms() { return std::max<int64_t>(2 * tunables::signal_timeout_ms(), 10000); }

namespace {
// A non-blocking stream for one bounded operation; destroyed on scope exit (work still queued
// on it finishes first, in the driver, without the host waiting).
struct OwnStream {
  cudaStream_t s = nullptr;
  ~OwnStream() {
    if (s) (void)cudaStreamDestroy(s);
  }
};
}  // namespace

Status copy_bounded(void* dst, const void* src, size_t bytes, int64_t timeout_ms, const char* what) {
  if (!bytes) return OkStatus();
  OwnStream st;
  MK_CUDA_CHECK(cudaStreamCreateWithFlags(&st.s, cudaStreamNonBlocking));
  MK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st.s));
  return sync_stream_bounded(st.s, timeout_ms < 0 ? device_setup_timeout_ms() : timeout_ms, what);
}

Status zero_bounded(void* dst, size_t bytes, int64_t timeout_ms, const char* what) {
  if (!bytes) return OkStatus();
  OwnStream st;
  MK_CUDA_CHECK(cudaStreamCreateWithFlags(&st.s, cudaStreamNonBlocking));
  MK_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, st.s));
  return sync_stream_bounded(st.s, timeout_ms < 0 ? device_setup_timeout_ms() : timeout_ms, what);
}

Status device_sync_bounded(int64_t timeout_ms, const char* what) {
  if (timeout_ms < 0) timeout_ms = device_setup_timeout_ms();
  int dev = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    cudaError_t err = cudaSuccess;
  };
  auto sh = std::make_shared<Shared>();
  std::thread([sh, dev] {
    cudaError_t e = cudaSetDevice(dev);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    std::lock_guard<std::mutex> g(sh->mu);
    sh->err = e;
    sh->done = true;
    sh->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lk(sh->mu);
  if (!sh->cv.wait_until(lk, deadline_after_ms(timeout_ms), [&] { return sh->done; }))
    return make_status(Code::kTimeout, "%s: the device's work did not finish within %lld ms", what,
                       static_cast<long long>(timeout_ms));
  if (sh->err != cudaSuccess)
    return make_status(sh->err == cudaErrorMemoryAllocation ? Code::kOutOfMemory : Code::kCudaError, "%s: %s (%s)",
                       what, cudaGetErrorString(sh->err), cudaGetErrorName(sh->err));
  return OkStatus();
}

}  // namespace mk
