// mkernel — the routed epilogue of the fused GEMM collectives (host and device code): where a
// reduce-scatter / all-reduce GEMM's tiles go instead of C. Filled by the operator
// (src/ops/fused_gemm/fused_gemm.cc) from its plan's routes and epilogue final sum
// (ops::RankPlan::route, ::fin); read by the GEMM kernel's epilogue (kernel/epilogue.cuh).
#pragma once

#include <cstdint>

namespace mk {
namespace gemm {

struct RouteEpilogue {
  int32_t world;             // shards (route entries)
  float* const* route;       // [world] fp32 destinations of the epilogue (see ops::RankPlan::route)
  // [world] tensor maps (CUtensorMap, 128 bytes each) over route[s] as fp32 [rows of shard s, N]:
  // the epilogue moves its tiles by TMA (store, or reduce-add) through them. Null: per-element
  // stores / reduce-adds from the registers (the route_mode tunable's "red").
  const void* route_maps;
  // Shard s covers rows [s * shard_rows, (s + 1) * shard_rows) when shard_rows > 0 (even shards);
  // else [shard_row0[s], shard_row0[s + 1]) (device, [world + 1]; every shard at least one row).
  int64_t shard_rows;
  const int32_t* shard_row0;
  int32_t route_store;       // deterministic: store instead of add
  // One node: the owner's rows [fin_lo, fin_hi) (whole tile-rows) end in the epilogue of its own
  // tiles (ops::EpilogueFinal): the sum of fin_nsrc + 1 terms in order — fp32 [.., N] rows
  // fin_srcs[k] + (m - fin_row0) * N, the tile's own values as term fin_self — in bf16 to every
  // fin_dsts entry (the program's op pointer entries: may name the caller's C) at
  // (m - fin_row0) * N; the sources zeroed after reading when fin_zero. fin_hi <= fin_lo: none.
  const float* const* fin_srcs;
  const uint64_t* fin_dsts;
  int64_t fin_row0, fin_lo, fin_hi;
  int32_t fin_nsrc, fin_self, fin_ndst, fin_zero;
};

}  // namespace gemm
}  // namespace mk
