// mkernel — the record a timed-out device wait leaves for the host (host and device code).
//
// A kernel whose bounded wait expires claims the communicator's record (first writer wins,
// through a claim word in device memory), fills it in host-mapped pinned memory, fences at
// system scope and traps. The host, seeing the launch fail, turns the record into a Status
// that names rank, op, role, peer, flag and values (Communicator::check_device).
#pragma once

#include <cstdint>

namespace mk {

struct TraceEvent;  // device/trace.h

enum class Role : uint32_t {
  kNone = 0,
  kCompute = 1,
  kComm = 2,       // intra-node communication
  kNetSend = 3,
  kNetRecv = 4,
  kController = 5,
  kTest = 6,
  kLoad = 7,       // the TMA producer of a GEMM
  kWait = 8,       // a producer waiting for data from a peer (ring attention arrivals)
  kEpilogue = 9,   // a GEMM tile's epilogue after its MMA (the traced fused kernel)
  kSpin = 10,      // a bounded wait that had to spin (traced fused kernel; the peer in the role's high bits)
  kCta = 11,       // a CTA from its start to the end of its work (traced fused kernel)
  kHost = 12,      // the host enqueueing a call (written by the host, in the device's clock)
};
const char* role_name(Role r);

// Op tags: which operator a wait belongs to. The library's own checks use the fixed tags below;
// operators register a name once (op_tag_register) and pass the tag it returns.
enum class OpTag : uint32_t {
  kNone = 0,
  kSelfCheck = 1,
  kSignalTest = 2,
};
constexpr uint32_t kFirstOperatorTag = 16;
// Thread-safe; the same name gives the same tag. Host code.
uint32_t op_tag_register(const char* name);
const char* op_tag_name(uint32_t tag);

struct DiagRecord {
  uint32_t size;        // sizeof(DiagRecord), written by the host at creation
  uint32_t version;     // kDiagVersion
  uint32_t state;       // 0 empty, 2 complete (set last, after a system fence)
  int32_t rank;
  int32_t peer;         // rank expected to raise the flag (-1: not one peer)
  uint32_t op_tag;
  uint32_t role;
  int32_t flag_index;
  int32_t block;
  int32_t thread;
  uint64_t expected;    // waited for flag >= expected
  uint64_t seen;        // last value read
  uint64_t waited_ns;
  uint64_t timeout_ns;
  uint32_t reason;      // kDiagTimeout, or kDiagAborted: the communicator failed meanwhile
  uint32_t pad;
};
constexpr uint32_t kDiagVersion = 2;
constexpr uint32_t kDiagTimeout = 0;
constexpr uint32_t kDiagAborted = 1;
// flag_index values that are not flags
constexpr int32_t kDiagRingSlot = -2;  // a producer waiting for room in the command ring
static_assert(sizeof(DiagRecord) == 80, "DiagRecord is read by the host: keep its layout fixed");

// What a device wait needs to report its own failure; passed to kernels by value.
struct WaitCtx {
  DiagRecord* diag;     // host-mapped (device pointer of pinned host memory)
  uint32_t* claim;      // device memory, 0 until a wait claims the record
  const uint64_t* abort;  // pinned host word, non-zero once the communicator failed (or null)
  uint64_t timeout_ns;  // 0: unbounded is not allowed; the host always sets a bound
  int32_t rank;
  uint32_t op_tag;
  uint32_t role;
  // 0: poll a flag back to back; else sleep between polls (__nanosleep), doubling from 32 ns up
  // to this many ns (the tunable wait_backoff_ns): pollers leave the memory system to others.
  uint32_t backoff_ns;
  // Traced launches only (null otherwise): a wait that had to spin records one Role::kSpin
  // event (device/trace.h) here when it is met.
  TraceEvent* trace_events;
  unsigned int* trace_count;
  uint32_t trace_capacity;
  uint32_t pad2;
};
static_assert(sizeof(WaitCtx) == 72, "WaitCtx is a kernel parameter");

}  // namespace mk
