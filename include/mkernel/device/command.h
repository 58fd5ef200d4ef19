// mkernel — the command a producer (GPU thread, or a CPU thread standing in for one) pushes
// to its rank's proxy. Fixed 64-byte layout shared by host and device code.
//
// Slot protocol (see command_ring.h): the producer writes every field but `seq`, fences at
// system scope, then stores seq = slot + 1 with release semantics; the proxy reads seq with
// acquire semantics and only then the other fields.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MK_HOST_DEVICE __host__ __device__
#else
#define MK_HOST_DEVICE
#endif

namespace mk {

constexpr uint8_t kCommandVersion = 1;
constexpr uint32_t kNoFlag = 0xffffffffu;

enum class CmdOp : uint8_t {
  kNop = 0,    // consumed and counted; nothing is sent (drain-rate benchmarks)
  kPut = 1,    // bytes from (src_window, src_offset) to peer's (dst_window, dst_offset)
  kFence = 2,  // later commands wait until every earlier put completed locally; then local_flag
};
constexpr uint8_t kCmdOpCount = 3;

struct alignas(64) Command {
  uint16_t size;         // sizeof(Command)
  uint8_t version;       // kCommandVersion
  uint8_t op;            // CmdOp
  int32_t peer;          // destination rank (kPut)
  uint32_t src_window;   // this rank's window the bytes come from
  uint32_t dst_window;   // the peer's window they go to
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t bytes;
  uint32_t remote_flag;  // flag on the peer raised (+1) once the bytes are visible there; kNoFlag
  uint32_t local_flag;   // flag on this rank raised (+1) once the source may be reused; kNoFlag
  uint64_t user;         // the producer's own tag, echoed in errors (e.g. a tile id)
  uint64_t seq;          // slot sequence + 1; written last, with release semantics
};
static_assert(sizeof(Command) == 64, "Command layout is shared by GPU producers and the proxy");
static_assert(alignof(Command) == 64, "one command per 64-byte line");

MK_HOST_DEVICE inline Command make_put(int peer, uint32_t src_window, uint64_t src_offset, uint32_t dst_window,
                        uint64_t dst_offset, uint64_t bytes, uint32_t remote_flag,
                        uint32_t local_flag = kNoFlag, uint64_t user = 0) {
  Command c{};
  c.size = sizeof(Command);
  c.version = kCommandVersion;
  c.op = static_cast<uint8_t>(CmdOp::kPut);
  c.peer = peer;
  c.src_window = src_window;
  c.dst_window = dst_window;
  c.src_offset = src_offset;
  c.dst_offset = dst_offset;
  c.bytes = bytes;
  c.remote_flag = remote_flag;
  c.local_flag = local_flag;
  c.user = user;
  return c;
}

MK_HOST_DEVICE inline Command make_op(CmdOp op, uint32_t local_flag = kNoFlag, uint64_t user = 0) {
  Command c{};
  c.size = sizeof(Command);
  c.version = kCommandVersion;
  c.op = static_cast<uint8_t>(op);
  c.peer = -1;
  c.remote_flag = kNoFlag;
  c.local_flag = local_flag;
  c.user = user;
  return c;
}

}  // namespace mk
