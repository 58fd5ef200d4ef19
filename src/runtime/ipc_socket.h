// Node-local exchange of file descriptors (CUDA VMM POSIX-FD exports) between the ranks of
// one job, over Unix-domain stream sockets with SCM_RIGHTS.
//
// Security: exported GPU memory must reach only this job's ranks.
//  - Each rank listens in the abstract namespace under "mkernel-<job id>-<rank>"; the job id
//    is 128 random bits chosen by rank 0 and shared through the bootstrap, so the name is not
//    guessable (and the abstract namespace leaves no file behind).
//  - The server accepts a request only from a peer with its own uid (SO_PEERCRED) that
//    presents the job's 256-bit token (also shared through the bootstrap; compared in
//    constant time). Anything else is refused, counted and logged at WARN.
//  - The client checks the server's uid too, so a squatter on the name gets nothing.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
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
  std::array<uint8_t, 16> job_id;
  std::array<uint8_t, 32> token;
};
// 48 random bytes from getrandom(2).
Status make_ipc_secret(IpcSecret* out);
std::string ipc_socket_name(const IpcSecret& s, int rank);  // without the leading NUL
// The abstract-namespace address of `name` (sun_path[0] = '\0'); *len is the address length.
sockaddr_un ipc_abstract_addr(const std::string& name, socklen_t* len);

class IpcServer {
 public:
  // Binds and starts the serving thread. kSystemError if the name is taken.
  static Status create(const IpcSecret& secret, int rank, std::unique_ptr<IpcServer>* out);
  ~IpcServer();
  IpcServer(const IpcServer&) = delete;
  IpcServer& operator=(const IpcServer&) = delete;

  // Serves `fd` under `id` until retract(id). The server keeps its own dup; the caller keeps fd.
  Status publish(uint64_t id, int fd);
  // Closes the server's dup. Unknown ids are ignored (retract is idempotent).
  void retract(uint64_t id);
  // Stops the thread and closes the socket. Idempotent.
  void shutdown();

  uint64_t refused() const { return refused_.load(); }
  uint64_t served() const { return served_.load(); }

 private:
  IpcServer() = default;
  void loop();
  void serve(int conn);

  IpcSecret secret_{};
  int rank_ = -1;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: wakes the thread for shutdown
  std::thread thread_;
  std::mutex mu_;
  std::map<uint64_t, int> fds_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> served_{0};
};

// Asks `peer`'s server for the fd published under `id`. On success *fd_out is a new fd owned
// by the caller. kPermissionDenied if the server refused, kTimeout if it did not answer.
// timeout_ms <= 0: the tunable ipc_timeout_ms.
Status ipc_fetch_fd(const IpcSecret& secret, int my_rank, int peer, uint64_t id,
                    int64_t timeout_ms, int* fd_out);

}  // namespace mk
