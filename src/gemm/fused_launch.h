// mkernel — the persistent GEMM as the fused operators launch it (library-internal).
#pragma once

#include "mkernel/gemm/gemm.h"
#include "src/comm/device_program.h"

namespace mk {
namespace gemm {

struct FusedLaunch {
  ops::FusedHooks hooks{};
  const int* role_counts = nullptr;  // device: communication CTAs (at least 1 when hooks.n_ops > 0)
  int* tile_counter = nullptr;       // device, zeroed on the stream by the launch
  const int* tile_order = nullptr;   // device: every tile id once (the plan's order)
  bool route = false;  // RS/AR: the routed fp32 epilogue (hooks.route); else a TMA store into C
};

// Checks `a` as a plain bf16 GEMM with a store epilogue (C must be valid memory of [M, N]
// bf16 even when the routed epilogue never writes it), zeroes the counters and launches.
Status run_fused(const Arguments& a, const FusedLaunch& f, cudaStream_t stream, const RunConfig& cfg);

}  // namespace gemm
}  // namespace mk
