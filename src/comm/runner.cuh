// mkernel — a communication program run alone: the kernel whose CTAs all take the program's ops
// in order until none is left (executor.cuh), for operators with no compute role (standalone
// collectives, MoE's dispatch and combine). The last CTA advances the call's epoch.
#pragma once

#include <cuda_runtime_api.h>

#include "mkernel/common/cuda_check.h"
#include "mkernel/common/status.h"
#include "mkernel/device/epoch.cuh"
#include "src/comm/device_program.h"
#include "src/comm/executor.cuh"

namespace mk {
namespace comm {

// A runner's CTA is alone on its SM (its registers: about 250 per thread) and gets its bandwidth
// from bytes in flight per thread, not from resident warps: a copy keeps 64 KiB in flight per
// CTA, a reduce of bf16 sources 64 KiB of four sources (executor.cuh). Programs are taken in
// order, so CTAs that wait for an SM hold no op anyone waits for.
constexpr int kRunnerThreads = 256;
constexpr int kRunnerCopyWords = 16;     // 16-byte words in flight per thread in a copy
constexpr int kRunnerReduceSources = 4;  // a reduce's sources loaded together
constexpr int kRunnerReduceWords = 4;    // and 16-byte words of each per thread (bf16 sources)

template <int kThreads>
__global__ void __launch_bounds__(kThreads) program_runner(DeviceProgram h) {
  const uint64_t epoch = device::epoch_of_call(h.epoch);
  for_each_op_in_order<kThreads, 1>(h, int(threadIdx.x), [&](int op) {
    run_comm_op<kThreads, 1, kRunnerCopyWords, kRunnerReduceSources, kRunnerReduceWords>(h, op, int(threadIdx.x),
                                                                                           epoch);
  });
  // Every CTA took its last op (a failed wait returns, so the CTAs still get here): the last one
  // zeroes the op counter for the next call (allocated zeroed), instead of a memset launch per call.
  device::epoch_finish(h.epoch, gridDim.x, h.op_counter);
}

// Enqueues one call of program h on `ctas` CTAs. Nothing when the program has no op.
inline Status run_program(const DeviceProgram& h, int ctas, cudaStream_t stream) {
  if (h.n_ops <= 0) return OkStatus();
  program_runner<kRunnerThreads><<<ctas, kRunnerThreads, 0, stream>>>(h);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

}  // namespace comm
}  // namespace mk
