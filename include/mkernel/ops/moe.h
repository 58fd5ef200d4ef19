// mkernel — expert parallelism: MoE dispatch and combine across GPUs and nodes.
//
// W ranks hold num_experts / W experts each (expert e lives on rank e / E_local). Each rank
// routes its tokens to their top-k experts:
//
//   dispatch: every token goes once to every rank that holds one of its experts (a record: the
//             row and its routing), and lands there in an expert-major layout — expert e's rows
//             at [offsets[e], offsets[e] + counts[e]), each expert's block starting on a
//             multiple of expert_align rows (what a grouped GEMM takes), rows ordered by source
//             rank, then token, then top-k slot;
//   combine:  the expert outputs y (same layout) travel back, and each token's output is
//             sum_k topk_weights[t, k] * y(t, k) in fp32 (fused multiply-adds in slot order k:
//             the order is fixed, results are reproducible bit for bit), stored bf16.
//
// Counts and offsets stay on the device: a call makes no host synchronization and is
// capturable in a CUDA graph, which replays with new routings and token counts. Inside a node,
// records move by peer copies; across nodes, through the proxy (libfabric), host-staged or
// direct as the session decides — directly to each rank, or (throughput mode, MoeMode) once per
// node to the sender's twin there, which writes its node's records. Memory is fixed at create
// (buffer_bytes). docs/moe.md has the details.
//
// Bad input — an expert id out of range, more tokens than max_tokens_per_rank, more received
// rows than the receive capacity — is recorded on the device (rank, token, expert, count) and
// the entry is left out; check() then reports it, and once it did the operator refuses further
// calls (calls enqueued before the caller asked still run on every rank: the refusal follows the
// caller's program order, not the device's record racing the calls in flight). No rank waits for
// data that will not come: every record slot still travels with its header.
//
// Usage (collective: every rank, same config):
//   std::unique_ptr<MoeEp> ep;
//   MK_CHECK(MoeEp::create(comm, {7168, 256, 8, 4096}, {}, &ep));
//   MK_CHECK(ep->dispatch({x, ids, weights, d_num_tokens, T}, {recv_x, counts, offsets}, stream));
//   ... grouped GEMM over recv_x -> y ...
//   MK_CHECK(ep->combine({y}, out, stream));
//   MK_CHECK(comm->sync(stream)); MK_CHECK(ep->check());
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "mkernel/common/status.h"
#include "mkernel/gemm/gemm.h"

namespace mk {

class Communicator;
struct Topology;

namespace ops {

struct MoeConfig {
  int64_t hidden = 0;               // H (elements per token row; H * 2 a multiple of 16)
  int num_experts = 0;              // E, a multiple of the world size
  int topk = 0;                     // k, 1..32
  int64_t max_tokens_per_rank = 0;  // rows of x a call may carry (d_num_tokens <= this)
  int expert_align = 1;             // each expert's block starts on a multiple of this many rows
  // Rows of the expert-major receive layout (all local experts together). 0: the worst case,
  // W * max_tokens * k plus alignment — never overflows, but large; a smaller
  // capacity is checked on the device and an overflow reported by check().
  int64_t recv_capacity = 0;
  gemm::DType dtype = gemm::DType::kBF16;  // of x, recv_x, y and out: bf16 (the only one now)
};

// How records cross nodes. Throughput: hierarchically — a token bound for several ranks of a
// remote node crosses the network once, to the rank there with the sender's local index, which
// writes the records for its node's ranks over peer stores. Low latency: directly, one slot per
// destination rank (no forwarding step). Auto: throughput when ranks span several nodes with
// several ranks each and max_tokens_per_rank > 256, else low latency. One node: the same path.
enum class MoeMode : int { kAuto = 0, kThroughput = 1, kLowLatency = 2 };

struct MoeOptions {
  MoeMode mode = MoeMode::kAuto;
  int comm_ctas = 0;     // CTAs that move records (0: tunable moe_comm_ctas)
  std::string staging;   // network staging "auto" | "always" | "never"; "": tunable net_staging
};

struct MoeDispatchArgs {
  const void* x = nullptr;             // [tokens, H] bf16
  const int32_t* topk_ids = nullptr;   // [tokens, k]; -1: no expert
  const float* topk_weights = nullptr; // [tokens, k] (kept for combine); null: unit weights
  const int32_t* d_num_tokens = nullptr;  // device int: tokens of this call (<= tokens); null: tokens
  int64_t tokens = 0;                  // rows of x, ids and weights (<= max_tokens_per_rank)
};

struct MoeDispatchOut {
  void* recv_x = nullptr;        // [recv_rows(), H] bf16, expert-major
  int32_t* counts = nullptr;     // [E_local] rows per local expert (device)
  int32_t* offsets = nullptr;    // [E_local + 1] first row of each expert, then the rows in use (device); may be null
};

struct MoeCombineArgs {
  const void* y = nullptr;  // [recv_rows(), H] bf16, the layout of the last dispatch's recv_x
  // [tokens, k] fp32, this call's weights (the dispatch's tokens and slots); null: the weights the
  // dispatch kept. Lets a caller combine one routing with several weightings (e.g. unit weights
  // for a gradient), and weights computed after the dispatch.
  const float* topk_weights = nullptr;
};

// Symmetric and per-operator device memory of an operator with this config on this topology
// (before anything is allocated; the caller's recv_x and y are not included).
struct MoeMemory {
  uint64_t symmetric_bytes = 0;  // per rank: record slots and combine slots (send + receive)
  uint64_t host_bytes = 0;       // pinned host mirrors (staged networks)
  uint64_t private_bytes = 0;    // routing state kept from dispatch for combine
  int64_t recv_rows = 0;         // rows of recv_x / y
  uint64_t handle_bytes = 0;     // a handle's routing state in caller memory (MoeEp::create_handle)
};

struct MoeState;
struct MoeHandleState;
struct MoeLaunch;

// The routing one dispatch leaves for its combine (positions, weights, the way back). An
// operator has one of its own, used when a call passes none; a caller that keeps several
// dispatches in flight before their combines (micro-batches) gives each its own handle
// (MoeEp::create_handle). Calls of one operator run in stream order (one stream, or ordered by
// events); a handle belongs to the operator that created it and must not outlive it.
class MoeHandle {
 public:
  ~MoeHandle();
  MoeHandle(const MoeHandle&) = delete;
  MoeHandle& operator=(const MoeHandle&) = delete;

 private:
  friend class MoeEp;
  MoeHandle();
  std::unique_ptr<MoeHandleState> st_;
};

class MoeEp {
 public:
  // Memory an operator will take (`staged`: whether network traffic is host-staged).
  static Status buffer_bytes(const MoeConfig& cfg, const Topology& topo, bool staged, MoeMemory* out,
                             MoeMode mode = MoeMode::kAuto);
  // The config's rules, before any communicator or GPU (sizes, experts a multiple of the world
  // size, dtype bf16). create() applies them too (the same error).
  static Status can_implement(const MoeConfig& cfg, int world);
  // Collective: checks every rank asked for the same config (a mismatch is the same kMismatch on
  // every rank, naming the first rank that differs), allocates and starts what it needs.
  static Status create(Communicator* comm, const MoeConfig& cfg, const MoeOptions& opt,
                       std::unique_ptr<MoeEp>* out);
  ~MoeEp();
  MoeEp(const MoeEp&) = delete;
  MoeEp& operator=(const MoeEp&) = delete;
  Status destroy();  // collective, idempotent

  // Local checks of a call's arguments: null or misaligned pointers, token counts, a handle of
  // another operator, a combine with no dispatch into its handle before it.
  Status can_implement(const MoeDispatchArgs& a, const MoeDispatchOut& out, const MoeHandle* handle = nullptr) const;
  Status can_implement(const MoeCombineArgs& a, const void* out, const MoeHandle* handle = nullptr) const;
  // Refused once check() reported a bad input a call recorded on the device; local checks
  // (can_implement, the communicator's health), then enqueues: no host collective, no host
  // synchronization, graph-capturable. With the debug tunable check_calls=1 the ranks first
  // agree on can_implement (a bad argument on one rank is then the same error on every rank).
  // The routing goes into `handle` (null: the operator's own).
  Status dispatch(const MoeDispatchArgs& a, const MoeDispatchOut& out, cudaStream_t stream,
                  MoeHandle* handle = nullptr);
  // Sends y back along the routes of the last dispatch into `handle` (null: the operator's
  // own); out: [tokens, H] bf16 (rows past that dispatch's token count are not written).
  // Checked as dispatch.
  Status combine(const MoeCombineArgs& a, void* out, cudaStream_t stream, const MoeHandle* handle = nullptr);
  // dispatch() / combine() without the cross-rank agreement and without the refusal after a
  // recorded bad input (graph capture, benchmarks; a layer that enqueues a dispatch and its
  // combine together: a record the dispatch writes meanwhile must not leave this rank's combine
  // out while the other ranks' wait for it).
  Status dispatch_enqueue(const MoeDispatchArgs& a, const MoeDispatchOut& out, cudaStream_t stream,
                          MoeHandle* handle = nullptr);
  Status combine_enqueue(const MoeCombineArgs& a, void* out, cudaStream_t stream, const MoeHandle* handle = nullptr);
  // A handle for this operator's calls (local: device memory for one dispatch's routing).
  Status create_handle(std::unique_ptr<MoeHandle>* out);
  // A handle whose routing state lives in the caller's device memory: `bytes` >= handle_bytes(),
  // 16-byte aligned, zeroed before the first dispatch into it, kept alive by the caller while the
  // handle (or a call enqueued with it) uses it; the handle never frees it. `holds_routing`: the
  // memory already holds the routing a dispatch of this operator wrote (through another handle
  // over the same memory), so a combine may take it — the caller vouches for that; otherwise a
  // combine before a dispatch into this handle is refused. For frameworks that keep one routing
  // per dispatch in their own tensors (the torch ops: a dispatch's routing travels with its
  // outputs to the combine and to the backward pass).
  Status create_handle(void* mem, uint64_t bytes, bool holds_routing, std::unique_ptr<MoeHandle>* out);
  // Device memory one handle's routing state takes (create_handle over caller memory).
  uint64_t handle_bytes() const;
  // After the stream completed: OK, or the first bad input a call met on the device (rank,
  // token, expert, count); once it returned one, dispatch() and combine() refuse with it. The
  // communicator's own failures (a silent rank) come from Communicator::sync / check.
  Status check() const;

  const MoeConfig& config() const;
  int local_experts() const;
  int64_t recv_rows() const;
  int comm_ctas() const;
  // Whether records cross nodes hierarchically (MoeMode, resolved at create).
  bool hierarchical() const;

 private:
  MoeEp() = default;
  // The device's record as it is now (check() latches what it returns).
  Status record_status() const;
  // The kernels' launch (library-internal: the fused MoE layer reuses the routing state and the
  // error record).
  friend const MoeLaunch& moe_launch_of(const MoeEp& ep);
  std::unique_ptr<MoeState> st_;
};

}  // namespace ops
}  // namespace mk
