// mkernel — standalone collectives: all-gather, reduce-scatter and all-reduce of a device buffer
// (bf16 or fp32; sum), on the same runtime, program IR and proxy as the fused operators.
//
// Each is a communication program with no compute role (src/ops/collective/collective_plan.h),
// run by one kernel of communication CTAs: inside a node ranks read each other's input workspace
// and write results straight into the owners' buffers (peer pointers); across nodes only
// node-reduced fp32 partials (reduce-scatter, all-reduce) or each shard once per remote node
// (all-gather) cross the network, through the proxy. With W ranks and `count` elements:
//
//   kAllGather      in [count] per rank          -> out [W * count], rank s's block at s * count
//   kReduceScatter  in [W * count] per rank      -> out [count]: rank r's block summed over ranks
//   kAllReduce      in [count] per rank          -> out [count]: summed over ranks
//
// Sums are fp32, in a fixed order — within each node by local index, then the node partials in
// node order — so a result is the same bit for bit on every rank, on every call and for any
// number of CTAs, and equals that ordered fp32 sum rounded once to the output type.
//
// Zero-copy: the operator owns symmetric buffers. A caller that writes its input into input()
// and (all-reduce) reads its result from output() moves no extra byte; any other pointers are
// copied in before the kernel and (all-reduce) out after it, on the stream (copy engine).
//
// Usage (collective: every rank, same kind, count and dtype):
//   std::unique_ptr<Collective> ar;
//   MK_CHECK(Collective::create(comm, CollectiveKind::kAllReduce, count, CollDType::kBF16, {}, &ar));
//   MK_CHECK(ar->run({x, x}, stream));   // in place; capturable in a CUDA graph
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "mkernel/common/status.h"

namespace mk {

class Communicator;

namespace ops {

enum class CollectiveKind : int { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2 };
enum class CollDType : int { kBF16 = 0, kF32 = 1 };
const char* collective_kind_name(CollectiveKind k);  // "allgather", "reduce_scatter", "allreduce"
const char* coll_dtype_name(CollDType t);            // "bf16", "fp32"
// "allgather" | "reduce_scatter" | "allreduce" (also "all_gather", "all_reduce") -> kind.
Status parse_collective_kind(const std::string& name, CollectiveKind* out);

struct CollectiveOptions {
  // Elements per chunk: the unit of data movement, of flags and of work for one CTA (rounded up
  // to a multiple of 8; >= 8). 0: a 32nd of a shard, within 8 Ki .. 256 Ki elements.
  int64_t chunk_elems = 0;
  // Communication CTAs of the kernel (>= 1). 0: half the SMs this process may use (the device's,
  // or its share under MPS with an active thread percentage), at most one per op.
  int ctas = 0;
  std::string staging;  // network staging "auto" | "always" | "never"; "": tunable net_staging
};

struct CollectiveArgs {
  const void* in = nullptr;  // this rank's input (see the table above); input() needs no copy
  void* out = nullptr;       // this rank's output; may be `in` for kAllReduce (in place)
};

struct CollectiveState;

class Collective {
 public:
  // Collective. Checks that every rank asked for the same thing (a mismatch is the same error on
  // every rank), builds the program, allocates the symmetric buffers and the signal pad, and —
  // when ranks span several nodes — starts the network backend and the proxy.
  static Status create(Communicator* comm, CollectiveKind kind, int64_t count, CollDType dtype,
                       const CollectiveOptions& opt, std::unique_ptr<Collective>* out);
  ~Collective();
  Collective(const Collective&) = delete;
  Collective& operator=(const Collective&) = delete;
  // Collective, idempotent: stops the proxy, frees the buffers. Graphs that captured calls of the
  // operator must be destroyed first.
  Status destroy();

  // The shape rules, before any communicator or GPU: count > 0, a multiple of 8 elements
  // (16-byte rows for both dtypes), W * count < 2^40 elements. create() applies them too.
  static Status can_implement(CollectiveKind kind, int64_t count, CollDType dtype, int world);
  // Local checks: null or misaligned (16 bytes) pointers, an output overlapping the input
  // (except an all-reduce exactly in place).
  Status can_implement(const CollectiveArgs& args) const;
  // Local checks and the communicator's health, then enqueues: no host collective. With the
  // debug tunable check_calls=1 the ranks first agree on the checks.
  Status run(const CollectiveArgs& args, cudaStream_t stream);
  // Enqueues without the optional cross-rank agreement (graph capture, benchmarks).
  Status enqueue(const CollectiveArgs& args, cudaStream_t stream);

  CollectiveKind kind() const;
  CollDType dtype() const;
  int64_t count() const;
  int64_t in_elems() const;   // elements of args.in
  int64_t out_elems() const;  // elements of args.out
  int ctas() const;           // communication CTAs per call
  // The operator's input workspace (in_elems() elements on this rank): a caller that writes its
  // input here saves the copy in. Valid until destroy().
  void* input() const;
  // kAllReduce: where the result lands (out_elems() elements); a caller that reads it here saves
  // the copy out (pass it as args.out). Valid after a call completes and until the next call
  // starts. Null for the other kinds (they write args.out directly).
  void* output() const;

 private:
  Collective() = default;
  std::unique_ptr<CollectiveState> st_;
};

}  // namespace ops
}  // namespace mk
