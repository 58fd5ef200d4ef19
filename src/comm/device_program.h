// mkernel — a communication program as device code reads it (host and device code): the resolved
// form of a rank's comm::RankProgram (program.h), made by the operator's session
// (OpSession::resolve, session.h) and run by the executor (executor.cuh) in whatever kernel the
// operator launches — beside GEMM or attention tiles (comm_role.cuh) or alone (a runner kernel).
//
// Every BufRef became a pointer (a peer pointer on the node), every FlagRef a flag address in the
// operator's signal pad (a peer's pad on the node), every network put a ready Command for the
// proxy. Nothing here belongs to one operator: what a kernel needs beyond the program (a GEMM's
// epilogue routes, attention's step waits) is in that kernel's own parameters.
#pragma once

#include <cstdint>

#include "mkernel/device/diag.h"
#include "mkernel/device/views.h"
#include "mkernel/device/command.h"
#include "mkernel/device/ring_view.h"

namespace mk {
namespace comm {

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

// An op pointer entry that names a caller buffer (BufDecl::user_slot), bound per call: bit 63
// set, bits 56..62 the slot (DeviceProgram::user), bits 0..55 the byte offset into it.
constexpr uint64_t kUserPtrBit = 1ull << 63;
constexpr int kUserSlots = 2;
MK_HOST_DEVICE inline uint64_t user_ptr(int slot, uint64_t offset) {
  return kUserPtrBit | (uint64_t(slot) << 56) | offset;
}

// The buffers one op may touch, sources and destinations together: the executor's pointer table
// (executor.cuh). The session refuses a longer op; plans split theirs (collective_plan.cc).
constexpr int kMaxOpBuffers = 16;

enum DevOpKind : uint32_t { kDevCopy = 0, kDevReduce = 1, kDevNetPut = 2, kDevSignal = 3, kDevZero = 4 };

// DevOp::flags
constexpr uint32_t kDevOpHostMem = 1;  // touches pinned host memory: plain loads and stores only
constexpr uint32_t kDevOpCountAt = 2;  // kDevCopy / kDevZero / kDevNetPut: move min(bytes, *(uint64_t*)ptrs[count_ptr]) bytes
constexpr uint32_t kDevOpSrcBf16 = 4;  // kDevReduce: the sources are bf16 (4 elements = 8 bytes), else fp32

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

// Per tile-row hooks of a tiled compute side: index ranges into waits / signals (the form of
// ops::RowHooks in a program's compute-side pools). A kernel without tile rows leaves them null.
struct DevRowHooks {
  uint32_t load_wait0, load_waits;
  uint32_t store_wait0, store_waits;
  uint32_t store_sig0, store_sigs;
};

struct DeviceProgram {
  const DevOp* ops;          // null: no communication program
  int32_t n_ops;
  int32_t world;
  int* op_counter;           // zeroed before each launch (the runner: by its last CTA, after the call)
  const DevWait* waits;
  const DevSignal* signals;
  // Pointer pool of the ops. An entry with kUserPtrBit names a caller buffer: user[slot] + offset.
  const uint64_t* ptrs;
  void* user[kUserSlots];    // the caller's buffers of this call, by BufDecl::user_slot
  const DevRowHooks* rows;   // [tile rows] or null
  EpochState* epoch;         // read at the start, advanced by the last CTA
  WaitCtx wait;
  RingView ring;             // valid when the program has network puts
};

}  // namespace comm
}  // namespace mk
