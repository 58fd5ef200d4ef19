// mkernel — the bf16 TMA tensor maps of the grouped GEMM's loads (host code): 128-byte swizzle,
// 256-byte L2 promotion, zero fill out of bounds. Shared by the grouped GEMM and the fused MoE
// layer, whose kernels take the same boxes.
#pragma once

#include <cuda.h>

#include "mkernel/common/check.h"
#include "mkernel/common/status.h"
#include "src/runtime/cuda_driver.h"

namespace mk {
namespace gemm {

// A rank-`rank` map of bf16 elements at `base` (dims, byte strides of dims 1.., box per dim).
inline Status encode_bf16_map(const CudaDriver* drv, CUtensorMap* m, int rank, const void* base, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box) {
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  MK_CU_CHECK(drv->cuTensorMapEncodeTiled(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(rank), const_cast<void*>(base),
                                          dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return OkStatus();
}

}  // namespace gemm
}  // namespace mk
