// Node-local exchange of file descriptors (CUDA VMM POSIX-FD exports) between the ranks of
// one job, over Unix-domain stream sockets with SCM_RIGHTS.
//
// Security: exported GPU memory must reach only this job's ranks.
//  - Each rank's server draws its own socket name when it binds: "mkernel-" followed by 128
//    random bits from getrandom(2) in hex, in the abstract namespace (no file left behind).
//    A name is derived from nothing — not the rank, not the job, not another rank's name — so
//    seeing one name (every local user can list abstract names in /proc/net/unix) predicts no
//    other, and nobody can bind a job's names before the job does. A name already in use
//    (EADDRINUSE) is replaced by a fresh draw, a few times. The ranks learn each other's
//    names through the bootstrap (the communicator's step 4), never by computing them.
//  - The server accepts a request only from a peer with its own uid (SO_PEERCRED) that
//    presents the job's 256-bit token (drawn by rank 0, shared through the bootstrap;
//    compared in constant time; not part of any name). Anything else is refused, counted and
//    logged at WARN.
//  - The client checks the server's uid before it sends anything, so a process of another
//    uid that binds a name after its server has gone gets neither the token nor a chance to
//    hand out a descriptor.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <sys/socket.h>
#include <sys/un.h>

#include <thread>

#include "mkernel/common/status.h"

namespace mk {

// Wire protocol between ranks of one build (one request per connection, one reply, the fd
// attached to an ok reply with SCM_RIGHTS).
constexpr uint32_t kIpcMagic = 0x4d4b4950;  // "MKIP"
constexpr uint32_t kIpcWireVersion = 1;
struct IpcRequest {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  uint32_t pad;
  uint64_t id;
  uint8_t token[32];
};
static_assert(sizeof(IpcRequest) == 56, "IPC request layout is part of the wire protocol");
struct IpcReply {
  uint32_t magic;
  int32_t code;  // mk::Code; kOk comes with exactly one fd
};
static_assert(sizeof(IpcReply) == 8, "IPC reply layout is part of the wire protocol");

struct IpcSecret {
  std::array<uint8_t, 32> token;  // the job's token: every request carries it
};
// 32 random bytes from getrandom(2).
Status make_ipc_secret(IpcSecret* out);

// Socket names: kIpcNamePrefix + 2 * kIpcNameRandomBytes lowercase hex digits (without the
// abstract namespace's leading NUL).
constexpr char kIpcNamePrefix[] = "mkernel-";
constexpr size_t kIpcNameRandomBytes = 16;  // 128 bits
constexpr size_t kIpcNameLength = sizeof(kIpcNamePrefix) - 1 + 2 * kIpcNameRandomBytes;
// How many names IpcServer::create draws before it gives up on EADDRINUSE.
constexpr int kIpcBindAttempts = 4;
// A fresh name from getrandom(2).
Status draw_ipc_socket_name(std::string* out);
// True for a name draw_ipc_socket_name could have drawn.
bool is_ipc_socket_name(const std::string& name);
// The longest name an abstract address holds (sun_path less its leading NUL).
constexpr size_t kIpcMaxNameLength = sizeof(sockaddr_un::sun_path) - 1;
// The abstract-namespace address of `name` (sun_path[0] = '\0'); *len is the address length.
// @pre name.size() <= kIpcMaxNameLength
sockaddr_un ipc_abstract_addr(const std::string& name, socklen_t* len);

// One rank's socket name as exchanged through the bootstrap (fixed size, NUL-padded; all
// zero when the rank runs no IPC server).
struct IpcNameRecord {
  char name[64];
};
static_assert(sizeof(IpcNameRecord) == 64 && kIpcNameLength < sizeof(IpcNameRecord::name),
              "an IPC name record holds one name and its terminator");
// @pre name is "" or is_ipc_socket_name(name)
IpcNameRecord ipc_name_record(const std::string& name);
// *out = the record's name ("" for an all-zero record). kInvalidArgument, naming `rank`, for
// a record that is not NUL-terminated and padded or holds something other than a name.
Status ipc_name_from_record(const IpcNameRecord& rec, int rank, std::string* out);

class IpcServer {
 public:
  // Draws a name (draw_ipc_socket_name), binds it and starts the serving thread. A name
  // already in use is replaced by a fresh draw, up to kIpcBindAttempts names; then, or on
  // any other bind error, kSystemError.
  static Status create(const IpcSecret& secret, int rank, std::unique_ptr<IpcServer>* out);
  // The same with the names drawn by `draw` (tests: a name known to be taken, a name to reuse).
  using NameSource = std::function<Status(std::string*)>;
  static Status create(const IpcSecret& secret, int rank, const NameSource& draw,
                       std::unique_ptr<IpcServer>* out);
  ~IpcServer();
  IpcServer(const IpcServer&) = delete;
  IpcServer& operator=(const IpcServer&) = delete;

  // The name this server listens on (without the leading NUL); peers pass it to ipc_fetch_fd.
  const std::string& name() const { return name_; }

  // Serves `fd` under `id` until retract(id). The server keeps its own dup; the caller keeps fd.
  Status publish(uint64_t id, int fd);
  // Closes the server's dup. Unknown ids are ignored (retract is idempotent).
  void retract(uint64_t id);
  // Stops the thread and closes the socket (the name is free again). Idempotent.
  void shutdown();

  uint64_t refused() const { return refused_.load(); }
  uint64_t served() const { return served_.load(); }

 private:
  IpcServer() = default;
  void loop();
  void serve(int conn);

  IpcSecret secret_{};
  int rank_ = -1;
  std::string name_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: wakes the thread for shutdown
  std::thread thread_;
  std::mutex mu_;
  std::map<uint64_t, int> fds_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> served_{0};
};

// Asks `peer`'s server, listening on `peer_name` (what that rank's IpcServer::name() said,
// as exchanged through the bootstrap), for the fd published under `id`. On success *fd_out is
// a new fd owned by the caller. kPermissionDenied if the server refused or runs under another
// uid (it then never sees the token), kTimeout if it did not answer, kInvalidArgument for an
// empty or over-long name. timeout_ms <= 0: the tunable ipc_timeout_ms.
Status ipc_fetch_fd(const IpcSecret& secret, int my_rank, int peer, const std::string& peer_name,
                    uint64_t id, int64_t timeout_ms, int* fd_out);

}  // namespace mk
