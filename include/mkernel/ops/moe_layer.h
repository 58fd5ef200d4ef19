// mkernel — a whole MoE layer with expert parallelism: dispatch, the experts' gated MLP and
// combine.
//
//   out[t] = sum_k topk_weights[t, k] * FFN_{e(t, k)}(x[t]),
//   FFN_e(v) = W2_e · (silu(W1_e[0:I] · v) * (W1_e[I:2I] · v))
//
// with W1 [E_local, 2I, H] (gate rows [0, I), up rows [I, 2I)) and W2 [E_local, H, I] the local
// experts' weights (expert e lives on rank e / E_local, as in MoeEp). A call runs, in stream
// order and without host synchronization: MoeEp::dispatch (tokens to their experts' ranks,
// expert-major), the grouped GEMM x·W1ᵀ with SwiGLU in its epilogue (the 2I-wide product is never
// stored; counts and offsets read on the device), the grouped GEMM ·W2ᵀ, and MoeEp::combine
// (each token's weighted sum in fp32, fixed slot order). Intermediates: the expert inputs and
// outputs in bf16 ([recv_rows, H]) and the SwiGLU activations in bf16 ([recv_rows, I]), owned by
// the operator.
//
// By default the four stages are consecutive launches on the stream (dispatch and combine each
// several kernels, the GEMMs one persistent kernel each). With the tunable moe_fused_layer = 1
// a call is route and pack, then one persistent kernel whose CTAs take the dispatch and combine
// ops and the layout, unpack, GEMM-tile and weighted-sum units as each is ready (docs/moe.md).
//
// Errors and graphs follow MoeEp: bad routing input is recorded on the device and reported by
// check() after the stream completed (once it reported one, calls are refused); a call is capturable in a CUDA
// graph and replays with new routings and token counts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "mkernel/common/status.h"
#include "mkernel/ops/moe.h"

namespace mk {

class Communicator;

namespace ops {

struct MoeLayerConfig {
  MoeConfig moe;              // hidden H, experts, top-k, max tokens per rank, recv_capacity, ...
  int64_t intermediate = 0;   // I: each expert's MLP width (a multiple of 8)
};

struct MoeLayerArgs {
  const void* x = nullptr;              // [tokens, H] bf16
  const int32_t* topk_ids = nullptr;    // [tokens, k]; -1: no expert
  const float* topk_weights = nullptr;  // [tokens, k]
  const int32_t* d_num_tokens = nullptr;  // device int: tokens of this call; null: tokens
  int64_t tokens = 0;                   // rows of x, ids and weights (<= max_tokens_per_rank)
  const void* w1 = nullptr;             // [E_local, 2I, H] bf16, 16-byte aligned
  const void* w2 = nullptr;             // [E_local, H, I] bf16, 16-byte aligned
};

// Device memory a layer takes besides MoeEp's (MoeEp::buffer_bytes): the intermediates.
struct MoeLayerMemory {
  MoeMemory ep;
  uint64_t intermediate_bytes = 0;  // recv_x, activations, expert outputs, counts, offsets
};

class MoeLayer {
 public:
  static Status buffer_bytes(const MoeLayerConfig& cfg, const Topology& topo, bool staged, MoeLayerMemory* out,
                             MoeMode mode = MoeMode::kAuto);
  // Collective (every rank, same config): creates the MoeEp and allocates the intermediates.
  static Status create(Communicator* comm, const MoeLayerConfig& cfg, const MoeOptions& opt,
                       std::unique_ptr<MoeLayer>* out);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;
  Status destroy();  // collective, idempotent

  // out: [tokens, H] bf16 (rows past the call's token count are not written). Local checks, then
  // enqueues every stage on `stream`.
  Status run(const MoeLayerArgs& a, void* out, cudaStream_t stream);
  // The expert MLPs alone (what run() does between dispatch and combine) on the last call's
  // received rows, into the layer's buffers (expert_outputs()): for timing the compute part, or
  // for a caller that dispatches and combines through ep() itself.
  Status run_experts(const void* w1, const void* w2, cudaStream_t stream);
  // After the stream completed: OK, or the first bad input a call met on the device (MoeEp's
  // record, or an expert range the GEMMs refused). Once it returned one, run() and run_experts()
  // refuse with it (calls enqueued before it was asked still run on every rank).
  Status check() const;

  const MoeLayerConfig& config() const;
  // Whether calls run as route and pack, then one persistent kernel (the tunable moe_fused_layer,
  // read at create; not in MoeEp's hierarchical mode), instead of dispatch, the GEMMs and combine
  // as separate launches.
  bool fused() const;
  MoeEp* ep() const;           // the dispatch/combine operator inside
  int local_experts() const;
  int64_t recv_rows() const;
  // The last call's expert-major intermediates (device; valid after the stream completed):
  // counts [E_local], offsets [E_local + 1], expert inputs [recv_rows, H].
  const int32_t* counts() const;
  const int32_t* offsets() const;
  const void* expert_inputs() const;
  const void* expert_outputs() const;  // [recv_rows, H] bf16, what combine sends back

 private:
  MoeLayer() = default;
  Status enqueue_experts(const void* w1, const void* w2, cudaStream_t stream);
  struct State;
  friend struct MoeLayerInternal;  // library-internal (the fused path's setup)
  std::unique_ptr<State> st_;
};

}  // namespace ops
}  // namespace mk
