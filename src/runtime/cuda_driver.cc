#include "src/runtime/cuda_driver.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>

#include "mkernel/common/check.h"

namespace mk {
namespace {

CudaDriver g_driver;
Status g_status;

template <class Fn>
bool resolve(const char* name, Fn* fn, std::string* missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  // 12000: the ABI of each entry point as of CUDA 12.0 (all of these exist since 10.2/11.x).
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p) {
    cudaGetLastError();
    if (!missing->empty()) *missing += ",";
    *missing += name;
    return false;
  }
  *fn = reinterpret_cast<Fn>(p);
  return true;
}

}  // namespace

Status cuda_driver(const CudaDriver** out) {
  static std::once_flag once;
  std::call_once(once, [] {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      g_status = make_status(Code::kNotSupported, "no usable CUDA driver: %s",
                             cudaGetErrorString(e));
      return;
    }
    std::string missing;
#define MK_RESOLVE(name) resolve(#name, &g_driver.name, &missing);
    MK_RESOLVE(cuMemCreate)
    MK_RESOLVE(cuMemRelease)
    MK_RESOLVE(cuMemMap)
    MK_RESOLVE(cuMemUnmap)
    MK_RESOLVE(cuMemSetAccess)
    MK_RESOLVE(cuMemAddressReserve)
    MK_RESOLVE(cuMemAddressFree)
    MK_RESOLVE(cuMemExportToShareableHandle)
    MK_RESOLVE(cuMemImportFromShareableHandle)
    MK_RESOLVE(cuMemGetAllocationGranularity)
    MK_RESOLVE(cuDeviceGetAttribute)
    MK_RESOLVE(cuDeviceGet)
    MK_RESOLVE(cuGetErrorString)
    MK_RESOLVE(cuStreamWriteValue64)
    MK_RESOLVE(cuFlushGPUDirectRDMAWrites)
    MK_RESOLVE(cuTensorMapEncodeTiled)
#undef MK_RESOLVE
    if (!missing.empty())
      g_status = make_status(Code::kNotSupported, "CUDA driver lacks entry points: %s",
                             missing.c_str());
  });
  if (!g_status.ok()) return g_status;
  *out = &g_driver;
  return OkStatus();
}

const char* cu_error_string(CUresult r) {
  const char* s = nullptr;
  if (g_driver.cuGetErrorString && g_driver.cuGetErrorString(r, &s) == CUDA_SUCCESS && s) return s;
  return "unknown CUresult";
}

Status cu_status(CUresult r, const char* expr, const char* file, int line) {
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  Code code = (r == CUDA_ERROR_OUT_OF_MEMORY) ? Code::kOutOfMemory : Code::kCudaError;
  return make_status(code, "%s failed: %s (CUresult %d) at %s:%d", expr, cu_error_string(r),
                     static_cast<int>(r), base, line);
}

}  // namespace mk
