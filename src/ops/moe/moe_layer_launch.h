// mkernel — the fused MoE layer's launch (host code; the kernel is moe_layer_kernel.cu): after
// route and pack (moe_route_pack_launch, into the layer program's send slots), one persistent
// launch whose CTAs take the layer program's ops (build_moe_layer_program) and the units of its
// work queue (MoeLayerQueue, moe_plan.h): layout, unpack, the two grouped GEMMs' tiles, combine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/common/status.h"
#include "src/comm/device_program.h"
#include "src/ops/moe/moe_launch.h"
#include "src/ops/moe/moe_plan.h"
#include "src/ops/moe/moe_program.h"

namespace mk {
namespace ops {

struct MoeLayerFusedLaunch {
  // The dispatch operator's launch with the layer program's slots (send, recv, csend, crecv and
  // the pieces' counts: dP/dpb over a slot's records, after its header) and the operator's routing
  // state (weights, cpos_g, back, self_row, counts, offsets, base, err).
  MoeLaunch l;
  comm::DeviceProgram program{};  // the layer program, resolved
  MoeLayerPools pools;            // places in program.waits / .signals (the resolved offsets added)
  MoeLayerQueue q;
  int64_t I = 0;                  // intermediate size
  void* recv_x = nullptr;         // [recv_rows, H] bf16
  void* act = nullptr;            // [recv_rows, I] bf16
  void* y = nullptr;              // [recv_rows, H] bf16 (every row; other ranks' also in their combine slots)
  int32_t* counts_out = nullptr;  // [El] the layer's copies (MoeLayer::counts / offsets)
  int32_t* offsets_out = nullptr; // [El + 1]
  // Device, zeroed once: tile prefix [El + 1], rows the GEMMs take per expert [El] (the count,
  // cut at recv_rows), tiles done [2][El]; the queue's counter; CTAs that finished.
  int32_t* lay = nullptr;
  int* queue_counter = nullptr;
  int* done_ctas = nullptr;
  int grid = 0;                   // CTAs (set by moe_layer_fused_prepare)
  // One-off timing counters (MK_MOE_FUSED_DEBUG bit 64; device, [64]; null: none), printed when
  // the layer is destroyed (moe_layer_fused_print_stats).
  unsigned long long* stats = nullptr;
};
// Bytes of MoeLayerFusedLaunch::lay.
inline int64_t moe_layer_fused_lay_bytes(int El) { return 4 * (int64_t(El) + 1 + El + 2 * int64_t(El)); }
// Unpack chunks per source and combine chunks of a layer with at most T tokens per rank.
int moe_layer_unpack_chunks(int64_t T);
int moe_layer_combine_chunks(int64_t T);

// Once per layer: the kernel's attributes and grid (every co-resident CTA); kNotSupported without
// CUTLASS or an sm_90 GPU.
Status moe_layer_fused_prepare(MoeLayerFusedLaunch* f);
// The one-off timing counters to stderr (nothing when f.stats is null).
void moe_layer_fused_print_stats(const MoeLayerFusedLaunch& f);
// Route and pack into the slots of `l` (the first part of a dispatch): route, scan and pack, or the
// small-batch route_pack.
Status moe_route_pack_launch(const MoeLaunch& l, const void* x, const int32_t* ids, const float* weights,
                             const int32_t* d_n, int64_t tokens, cudaStream_t stream);
// One layer call: route and pack, then the fused kernel. out: [tokens, H] bf16.
Status moe_layer_fused_launch(const MoeLayerFusedLaunch& f, const void* x, const int32_t* ids, const float* weights,
                              const int32_t* d_n, int64_t tokens, const void* w1, const void* w2, void* out,
                              cudaStream_t stream);

}  // namespace ops
}  // namespace mk
