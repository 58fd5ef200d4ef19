// mkernel — the persistent GEMM as the fused operators launch it (library-internal).
#pragma once

#include <cstdint>
#include <vector>

#include "mkernel/gemm/gemm.h"
#include "src/comm/device_program.h"
#include "src/comm/split_control.h"

namespace mk {
namespace gemm {

struct FusedLaunch {
  ops::FusedHooks hooks{};
  const int* role_counts = nullptr;  // device: communication CTAs (at least 1 when hooks.n_ops > 0)
  int* tile_counter = nullptr;       // device, zeroed on the stream by the launch
  const int* tile_order = nullptr;   // device: every tile id once (the plan's order)
  bool route = false;  // RS/AR: the routed fp32 epilogue (hooks.route); else a TMA store into C
  // Non-null: the SM-partition controller moves role_counts[0] during the call (split_control.h);
  // the launch resets its per-call state and sets the starting count.
  comm::SplitCtl* split = nullptr;
};

// The tensor maps of the routed bulk epilogue (FusedHooks::route_maps): one per destination
// dsts[i], an fp32 [rows, N] row-major block (16-byte aligned; N a multiple of 8), appended to
// `maps` (128 bytes each, to be copied to device memory). kNotSupported without CUTLASS or a
// driver; kInvalidArgument for extents the tensor maps cannot describe.
Status route_tensor_maps(float* const* dsts, int n, int64_t rows, int64_t N, std::vector<uint8_t>* maps);

// Checks `a` as a plain bf16 GEMM with a store epilogue (C must be valid memory of [M, N]
// bf16 even when the routed epilogue never writes it), zeroes the counters and launches.
Status run_fused(const Arguments& a, const FusedLaunch& f, cudaStream_t stream, const RunConfig& cfg);

}  // namespace gemm
}  // namespace mk
