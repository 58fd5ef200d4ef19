// mkernel — a resolved plan as the persistent GEMM kernel reads it (host and device code).
//
// The operator (ops/fused.h) turns a rank's Plan (ops/plan.h) into these arrays in device
// memory: every BufRef becomes a pointer (a peer pointer on the node), every FlagRef a flag
// address in the operator's signal pad (a peer's pad on the node), every network put a ready
// Command for the proxy. The kernel's communication CTAs take ops in order from op_counter;
// its compute CTAs take tiles and honour the per tile-row hooks.
#pragma once

#include <cstdint>

#include "mkernel/device/diag.h"
#include "mkernel/device/views.h"
#include "mkernel/device/command.h"
#include "mkernel/device/ring_view.h"

namespace mk {
namespace ops {

struct DevWait {
  const uint64_t* flag;
  uint64_t mul;      // wait for *flag >= mul * epoch
  int32_t peer;      // reported on timeout
  int32_t index;     // the flag's index in its pad (reported on timeout)
};
struct DevSignal {
  uint64_t* flag;
  uint64_t value;    // add: *flag += value; else *flag = value * epoch
  uint32_t add;
  uint32_t pad;
};

constexpr uint64_t kUserPtrBit = 1ull << 63;
constexpr int kUserPtrA = 0, kUserPtrC = 1;
MK_HOST_DEVICE inline uint64_t user_ptr(int which, uint64_t offset) {
  return kUserPtrBit | (uint64_t(which) << 56) | offset;
}

enum DevOpKind : uint32_t { kDevCopy = 0, kDevReduce = 1, kDevNetPut = 2, kDevSignal = 3, kDevZero = 4 };

// DevOp::flags
constexpr uint32_t kDevOpHostMem = 1;  // touches pinned host memory: plain loads and stores only
constexpr uint32_t kDevOpCountAt = 2;  // kDevCopy / kDevZero / kDevNetPut: move min(bytes, *(uint64_t*)ptrs[count_ptr]) bytes

struct alignas(64) DevOp {
  uint32_t kind;
  uint32_t nsrc, ndst;  // kDevNetPut: 1 and 1 when staged (copy ptrs[ptr0] -> ptrs[ptr0 + 1] first)
  uint32_t dst_f32;
  uint32_t zero_mask;   // kDevReduce: sources zeroed after reading
  uint32_t wait0, nwait;
  uint32_t sig0, nsig;
  uint32_t ptr0;        // ptrs[ptr0 .. ptr0 + nsrc) sources, then ndst destinations
  uint64_t bytes;       // copy / zero / staged put (a multiple of 16)
  uint64_t elems;       // reduce (a multiple of 4)
  uint32_t flags;       // kDevOpHostMem | kDevOpCountAt
  uint32_t count_ptr;   // kDevOpCountAt: index in ptrs of the run-time byte count
  Command cmd;          // kDevNetPut: pushed as is
};
static_assert(sizeof(DevOp) == 128, "DevOp layout");

// Per tile-row hooks: index ranges into waits / signals (the same fields as ops::RowHooks).
struct DevRowHooks {
  uint32_t load_wait0, load_waits;
  uint32_t store_wait0, store_waits;
  uint32_t store_sig0, store_sigs;
};

struct FusedHooks {
  const DevOp* ops;          // null: no communication program
  int32_t n_ops;
  int32_t world;
  int* op_counter;           // zeroed before each launch
  const DevWait* waits;
  const DevSignal* signals;
  // Pointer pool of the ops. An entry with bit 63 set names a caller buffer, which changes from
  // call to call: bits 56..62 index user[], bits 0..55 are the byte offset into it.
  const uint64_t* ptrs;
  void* user[2];             // kUserPtrA: the caller's A shard (AG); kUserPtrC: the caller's C
  const DevRowHooks* rows;   // [tiles_m] or null
  float* const* route;       // [world] fp32 destinations of the epilogue (see plan.h) or null
  // [world] tensor maps (CUtensorMap, 128 bytes each) over route[s] as fp32 [shard_rows, N]: the
  // epilogue moves its tiles by TMA (store, or reduce-add) through them. Null: per-element
  // stores / reduce-adds from the registers (the route_mode tunable's "red").
  const void* route_maps;
  int64_t shard_rows;
  int32_t route_store;       // deterministic: store instead of add
  // One node: the owner's rows [fin_lo, fin_hi) (whole tile-rows) end in the epilogue of its own
  // tiles (ops::EpilogueFinal): the sum of fin_nsrc + 1 terms in order — fp32 [.., N] rows
  // fin_srcs[k] + (m - fin_row0) * N, the tile's own values as term fin_self — in bf16 to every
  // fin_dsts entry (op pointer entries: may name the caller's C) at (m - fin_row0) * N; the
  // sources zeroed after reading when fin_zero. fin_hi <= fin_lo: none.
  const float* const* fin_srcs;
  const uint64_t* fin_dsts;
  int64_t fin_row0, fin_lo, fin_hi;
  int32_t fin_nsrc, fin_self, fin_ndst, fin_zero;
  // Communication CTAs may compute a tile while the next op is not ready. Only when no tile
  // waits for an op (RS/AR): else (AG) every such CTA could block on rows that op would send.
  int32_t peek_ops;
  EpochState* epoch;         // read at the start, advanced by the last CTA
  WaitCtx wait;
  RingView ring;             // valid when the plan has network puts
};

}  // namespace ops
}  // namespace mk
