// mkernel — fused GEMM collectives: AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce.
//
// One persistent kernel per call: compute CTAs run the GEMM's tiles in the plan's order
// (src/ops/fused_gemm/fused_gemm_plan.h), communication CTAs run the plan's communication program — peer stores over
// NVLink inside a node, puts through the proxy (libfabric) between nodes, hierarchically: RS and
// AR send only node-reduced partials between twins (same local rank), AG sends each shard once
// per remote node and forwards it inside the node. With W = nodes x local ranks:
//
//   ag_gemm: C[M, N] = allgather_rows(A[M/W, K]) · B[N, K]ᵀ      (N: this rank's N_loc)
//   gemm_rs: C[M/W, N] = reduce_scatter_rows(A[M, K] · B[N, K]ᵀ)  (K: this rank's K_loc)
//   gemm_ar: C[M, N] = allreduce(A[M, K] · B[N, K]ᵀ)
//
// bf16 in and out, fp32 accumulation; cross-rank sums in fp32 (reduce-adds into an fp32
// buffer, or — deterministic — per-rank partials summed in rank order). Shards: rank s owns
// rows [row0_s, row0_s + rows_s) of M, in rank order — M / W each by default (then M % W == 0 is
// required for AG and RS), or any counts >= 1 summing to M (PlanShape::rows; AR's shards are
// internal: any M >= W, split as evenly as possible). M need not be a multiple of the tile.
//
// Usage (collective: every rank, same shape):
//   std::unique_ptr<FusedGemm> op;
//   MK_CHECK(FusedGemm::create(comm, FusedKind::kGemmRs, {M, N, K_loc}, FusedOptions{}, &op));
//   MK_CHECK(op->run({A, B, C}, stream));   // capturable in a CUDA graph (replays advance epochs)
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mkernel/common/status.h"
#include "mkernel/gemm/gemm.h"

namespace mk {

class Communicator;

namespace ops {

enum class FusedKind : int { kAgGemm = 0, kGemmRs = 1, kGemmAr = 2 };
const char* fused_kind_name(FusedKind k);

// AG: C[M, N] = gathered A[M, K] · B[N, K]ᵀ (N is each rank's N_loc).
// RS: C[M/W, N] = reduce-scatter of A[M, K]·B[N, K]ᵀ (K is each rank's K_loc).
// AR: C[M, N] = all-reduce of A[M, K]·B[N, K]ᵀ.
struct PlanShape {
  int64_t M = 0, N = 0, K = 0;
  // Uneven shards: rank s's rows (AG: of its A shard; RS: of its C; AR: of the shard it reduces),
  // [world] entries >= 1 summing to M, the same on every rank. Empty: M / W each (AR: M split as
  // evenly as possible, the first M % W ranks one row more).
  std::vector<int64_t> rows;

  PlanShape() = default;
  PlanShape(int64_t m, int64_t n, int64_t k, std::vector<int64_t> shard_rows = {})
      : M(m), N(n), K(k), rows(std::move(shard_rows)) {}
};


struct FusedOptions {
  bool deterministic = false;  // RS/AR: fixed reduction order (per-rank partials, summed in order)
  // Communication CTAs, fixed for every call (>= 1). -1: the tunable fused_split decides —
  // static: fused_comm_ctas CTAs; auto: an on-GPU controller moves CTAs between the roles during
  // each call, starting where the last call with this shape settled (docs/controller.md).
  int comm_ctas = -1;
  int max_ctas = 0;            // persistent grid; 0: every co-resident CTA
  std::string staging;         // network staging "auto" | "always" | "never"; "": tunable net_staging
  // "fused" (one persistent kernel), "unfused" (the GEMM, then the standalone collective of
  // ops/collective.h), or "auto" (both timed on the first calls, then the faster one for good:
  // the ranks decide together; docs/controller.md). "": tunable fused_path. AG and RS with
  // uneven shards have no unfused path (the standalone collectives take equal shards): "unfused"
  // is an error there and "auto" runs fused.
  std::string path;
};

struct FusedArgs {
  const void* A = nullptr;  // AG: this rank's shard [rows_me, K] (M/W rows when even); RS/AR: [M, K_loc]
  const void* B = nullptr;  // [N, K] (AG: N_loc rows; RS/AR: K_loc columns)
  void* C = nullptr;        // AG: [M, N_loc]; RS: [rows_me, N]; AR: [M, N]
  gemm::DType a_type = gemm::DType::kBF16, b_type = gemm::DType::kBF16, c_type = gemm::DType::kBF16;
  // Non-null (W > 1): the traced kernel records per CTA every tile ("load", "compute") and every
  // communication op ("comm", or "net-send" for a put through the proxy; item = op index).
  const TraceBuffer* trace = nullptr;
};

struct FusedState;

class FusedGemm {
 public:
  // Collective. Checks that every rank asked for the same operator and shape (through the
  // bootstrap: a mismatch is the same error on every rank), builds the plan, allocates the
  // symmetric workspaces and the signal pad, and — when ranks span several nodes — starts the
  // network backend and the proxy.
  static Status create(Communicator* comm, FusedKind kind, const PlanShape& shape, const FusedOptions& opt,
                       std::unique_ptr<FusedGemm>* out);
  ~FusedGemm();
  FusedGemm(const FusedGemm&) = delete;
  FusedGemm& operator=(const FusedGemm&) = delete;
  // Collective, idempotent: flushes and stops the proxy, frees the workspaces. CUDA graphs that
  // captured calls of the operator must be destroyed first.
  Status destroy();

  // The shape rules, before any communicator or GPU: M, N, K > 0 and < 2^31, N and K multiples
  // of 8; shards: PlanShape::rows ([world] counts >= 1 summing to M) or, without them, M a
  // multiple of the world size (AR: M >= world). create() applies them too (the same error).
  static Status can_implement(FusedKind kind, const PlanShape& shape, int world);
  // Local checks: dtypes, null or misaligned pointers, C overlapping A or B.
  Status can_implement(const FusedArgs& args) const;
  // Local checks (can_implement, the communicator's health), then enqueues: no host collective.
  // With the debug tunable check_calls=1 the ranks first agree on can_implement (a bad
  // argument on one rank is then the same error on every rank).
  Status run(const FusedArgs& args, cudaStream_t stream);
  // Enqueues without the optional cross-rank agreement (graph capture, benchmarks).
  Status enqueue(const FusedArgs& args, cudaStream_t stream);

  FusedKind kind() const;
  // Communication CTAs: the fixed count; with the controller, the split the calls settled on as
  // the latest launch reported it (one call behind; the starting count before that).
  int comm_ctas() const;
  // RS/AR: whether the reduction order is fixed (results reproducible bit for bit): asked for
  // (FusedOptions::deterministic), or implied by the layout (at most two ranks per node).
  bool deterministic() const;
  // Fixes the number of communication CTAs for later calls (device memory, no relaunch); the
  // controller, if on, is off from then on.
  Status set_comm_ctas(int n, cudaStream_t stream);
  // Whether the controller moves the split during calls (fused_split=auto, no fixed count).
  bool split_controlled() const;
  // AG: the gathered A [M, K] (valid after a call completes). With one rank it is the caller's A
  // of the last call (nothing is gathered, nothing copied).
  const void* gathered_a() const;
  // The path calls take: "fused", "unfused", "auto: deciding (call 3 of 13)", "auto: unfused
  // (fused 1.20 ms, unfused 0.95 ms, the slowest rank's medians)", "auto: fused (remembered)".
  std::string path() const;

 private:
  FusedGemm() = default;
  Status enqueue_fused(const FusedArgs& args, cudaStream_t stream);
  // Tests reach the plan and the controller's hooks through src/ops/fused_gemm/fused_gemm_testing.h
  // (not installed).
  friend struct FusedGemmTesting;
  std::unique_ptr<FusedState> st_;
};

}  // namespace ops
}  // namespace mk
