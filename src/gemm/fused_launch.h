// mkernel — the persistent GEMM as the fused operators launch it (library-internal).
#pragma once

#include <cstdint>
#include <vector>

#include "mkernel/gemm/gemm.h"
#include "src/comm/device_program.h"
#include "src/comm/split_control.h"
#include "src/gemm/route_epilogue.h"

namespace mk {
namespace gemm {

struct FusedLaunch {
  comm::DeviceProgram program{};     // the resolved communication program, its caller buffers bound
  const int* role_counts = nullptr;  // device: communication CTAs (at least 1 when program.n_ops > 0)
  int* tile_counter = nullptr;       // device, zeroed on the stream by the launch
  const int* tile_order = nullptr;   // device: every tile id once (the plan's order)
  // Communication CTAs may compute a tile while the next op is not ready. Only when no tile
  // waits for an op (RS/AR): else (AG) every such CTA could block on rows that op would send.
  bool peek_ops = false;
  bool route = false;                // RS/AR: the routed fp32 epilogue (route_epi); else a TMA store into C
  RouteEpilogue route_epi{};
  // Non-null: the SM-partition controller moves role_counts[0] during the call (split_control.h);
  // the launch resets its per-call state and sets the starting count.
  comm::SplitCtl* split = nullptr;
};

// The tensor maps of the routed bulk epilogue (RouteEpilogue::route_maps): one per destination
// dsts[i], an fp32 [rows[i], N] row-major block (16-byte aligned; N a multiple of 8), appended
// to `maps` (128 bytes each, to be copied to device memory). kNotSupported without CUTLASS or a
// driver; kInvalidArgument for extents the tensor maps cannot describe.
Status route_tensor_maps(float* const* dsts, int n, const int64_t* rows, int64_t N, std::vector<uint8_t>* maps);

// Checks `a` as a plain bf16 GEMM with a store epilogue (C must be valid memory of [M, N]
// bf16 even when the routed epilogue never writes it), zeroes the counters and launches.
Status run_fused(const Arguments& a, const FusedLaunch& f, cudaStream_t stream, const RunConfig& cfg);

}  // namespace gemm
}  // namespace mk
