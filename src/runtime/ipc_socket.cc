#include "src/runtime/ipc_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/common/random.h"

namespace mk {
namespace {

bool equal_ct(const uint8_t* a, const uint8_t* b, size_t n) {
  uint8_t d = 0;
  for (size_t i = 0; i < n; ++i) d |= a[i] ^ b[i];
  return d == 0;
}

void set_timeouts(int fd, int64_t ms) {
  timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Full read/write with EINTR handling; false on EOF, error or timeout.
bool read_full(int fd, void* buf, size_t n) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool send_reply(int conn, Code code, int fd) {
  IpcReply rep{kIpcMagic, static_cast<int32_t>(code)};
  iovec iov{&rep, sizeof(rep)};
  msghdr msg;
  memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    memset(ctrl, 0, sizeof(ctrl));
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t k;
  do {
    k = sendmsg(conn, &msg, MSG_NOSIGNAL);
  } while (k < 0 && errno == EINTR);
  return k == static_cast<ssize_t>(sizeof(rep));
}

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

}  // namespace

sockaddr_un ipc_abstract_addr(const std::string& name, socklen_t* len) {
  sockaddr_un a;
  memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  // Abstract namespace: sun_path[0] = '\0', the name follows, no terminator.
  const size_t n = std::min(name.size(), kIpcMaxNameLength);
  memcpy(a.sun_path + 1, name.data(), n);
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

Status make_ipc_secret(IpcSecret* out) {
  MK_CHECK(random_bytes(out->token.data(), out->token.size()));
  return OkStatus();
}

Status draw_ipc_socket_name(std::string* out) {
  uint8_t r[kIpcNameRandomBytes];
  MK_CHECK(random_bytes(r, sizeof(r)));
  *out = kIpcNamePrefix + hex(r, sizeof(r));
  return OkStatus();
}

bool is_ipc_socket_name(const std::string& name) {
  const size_t p = sizeof(kIpcNamePrefix) - 1;
  if (name.size() != kIpcNameLength || name.compare(0, p, kIpcNamePrefix) != 0) return false;
  for (size_t i = p; i < name.size(); ++i)
    if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f'))) return false;
  return true;
}

IpcNameRecord ipc_name_record(const std::string& name) {
  IpcNameRecord r;
  memset(&r, 0, sizeof(r));
  memcpy(r.name, name.data(), std::min(name.size(), sizeof(r.name) - 1));
  return r;
}

Status ipc_name_from_record(const IpcNameRecord& rec, int rank, std::string* out) {
  out->clear();
  const char* end = static_cast<const char*>(memchr(rec.name, '\0', sizeof(rec.name)));
  MK_REQUIRE(end, Code::kInvalidArgument, "rank %d's IPC socket name is not terminated", rank);
  for (const char* p = end; p < rec.name + sizeof(rec.name); ++p)
    MK_REQUIRE(*p == '\0', Code::kInvalidArgument,
               "rank %d's IPC socket name record has bytes after its terminator", rank);
  std::string name(rec.name, end);
  MK_REQUIRE(name.empty() || is_ipc_socket_name(name), Code::kInvalidArgument,
             "rank %d's IPC socket name is malformed (%zu characters, expected %s + %zu hex "
             "digits)",
             rank, name.size(), kIpcNamePrefix, 2 * kIpcNameRandomBytes);
  *out = std::move(name);
  return OkStatus();
}

Status IpcServer::create(const IpcSecret& secret, int rank, std::unique_ptr<IpcServer>* out) {
  return create(secret, rank, draw_ipc_socket_name, out);
}

Status IpcServer::create(const IpcSecret& secret, int rank, const NameSource& draw,
                         std::unique_ptr<IpcServer>* out) {
  std::unique_ptr<IpcServer> s(new IpcServer());
  s->secret_ = secret;
  s->rank_ = rank;
  std::string tried;
  for (int attempt = 0;; ++attempt) {
    std::string name;
    MK_CHECK(draw(&name));
    MK_REQUIRE(!name.empty() && name.size() <= kIpcMaxNameLength, Code::kInvalidArgument,
               "rank %d: IPC socket name of %zu characters (1 to %zu)", rank, name.size(),
               kIpcMaxNameLength);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MK_SYS_CHECK(fd);
    socklen_t len;
    sockaddr_un a = ipc_abstract_addr(name, &len);
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), len) == 0) {
      s->listen_fd_ = fd;
      s->name_ = name;
      break;
    }
    const int err = errno;
    close(fd);
    tried += (tried.empty() ? "@" : ", @") + name;
    // Only a name someone else holds is worth another draw; anything else would fail again.
    if (err != EADDRINUSE || attempt + 1 >= kIpcBindAttempts)
      return make_status(Code::kSystemError, "rank %d: cannot bind an IPC socket (tried %s): %s",
                         rank, tried.c_str(), strerror(err));
    MK_WARN(kSubsysMem, "rank %d: IPC socket name @%s is already in use; drawing another", rank,
            name.c_str());
  }
  MK_SYS_CHECK(listen(s->listen_fd_, 128));
  s->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  MK_SYS_CHECK(s->wake_fd_);
  s->thread_ = std::thread([p = s.get()] { p->loop(); });
  MK_INFO(kSubsysMem, "rank %d: IPC server listening on @%s", rank, s->name_.c_str());
  *out = std::move(s);
  return OkStatus();
}

IpcServer::~IpcServer() { shutdown(); }

void IpcServer::shutdown() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  listen_fd_ = wake_fd_ = -1;
  std::lock_guard<std::mutex> g(mu_);
  for (auto& kv : fds_) close(kv.second);
  fds_.clear();
}

Status IpcServer::publish(uint64_t id, int fd) {
  int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0)
    return make_status(Code::kSystemError,
                       "rank %d: IPC server: cannot keep a copy of allocation %llu's descriptor: %s",
                       rank_, static_cast<unsigned long long>(id), strerror(errno));
  std::lock_guard<std::mutex> g(mu_);
  auto it = fds_.find(id);
  if (it != fds_.end()) close(it->second);
  fds_[id] = d;
  return OkStatus();
}

void IpcServer::retract(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = fds_.find(id);
  if (it == fds_.end()) return;
  close(it->second);
  fds_.erase(it);
}

void IpcServer::loop() {
  pollfd pf[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  for (;;) {
    int n = poll(pf, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      MK_WARN(kSubsysMem, "rank %d: IPC server poll failed: %s; serving stops", rank_,
              strerror(errno));
      return;
    }
    if (pf[1].revents) return;
    if (pf[0].revents & POLLIN) {
      int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      serve(conn);
      close(conn);
    }
  }
}

// Refusals are all counted (refused()), but logged only as log_nth_repeat says (the first few,
// then at each power of two): another local user's connection flood must not flood the job's log.
namespace {
std::string refusal_note(uint64_t n) {
  if (n < kLoggedRepeats) return "";
  return " (refusal " + std::to_string(n) + "; further ones are logged at each power of two)";
}
}  // namespace

// One request per connection. A legitimate client sends its request right after connecting,
// so a short deadline bounds how long a stalled (same-uid) client can hold up other peers.
void IpcServer::serve(int conn) {
  set_timeouts(conn, 250);
  ucred cred;
  socklen_t clen = sizeof(cred);
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &clen) < 0) {
    const int e = errno;
    if (const uint64_t n = ++refused_; log_nth_repeat(n))
      MK_WARN(kSubsysMem, "rank %d: IPC connection refused: SO_PEERCRED failed: %s%s", rank_, strerror(e),
              refusal_note(n).c_str());
    return;
  }
  if (cred.uid != geteuid()) {
    if (const uint64_t n = ++refused_; log_nth_repeat(n))
      MK_WARN(kSubsysMem, "rank %d: IPC connection from pid %d uid %u refused: not this job's uid %u%s",
              rank_, cred.pid, cred.uid, geteuid(), refusal_note(n).c_str());
    send_reply(conn, Code::kPermissionDenied, -1);
    return;
  }
  IpcRequest req;
  if (!read_full(conn, &req, sizeof(req)) || req.magic != kIpcMagic || req.version != kIpcWireVersion) {
    if (const uint64_t n = ++refused_; log_nth_repeat(n))
      MK_WARN(kSubsysMem, "rank %d: IPC connection from pid %d refused: malformed request%s", rank_,
              cred.pid, refusal_note(n).c_str());
    return;
  }
  if (!equal_ct(req.token, secret_.token.data(), 32)) {
    if (const uint64_t n = ++refused_; log_nth_repeat(n))
      MK_WARN(kSubsysMem, "rank %d: IPC connection from pid %d (claims rank %d) refused: wrong job token%s",
              rank_, cred.pid, req.rank, refusal_note(n).c_str());
    send_reply(conn, Code::kPermissionDenied, -1);
    return;
  }
  int fd = -1;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = fds_.find(req.id);
    if (it != fds_.end()) fd = it->second;
    // Sent while holding the lock, so a concurrent retract cannot close it mid-send.
    if (fd < 0) {
      send_reply(conn, Code::kInvalidArgument, -1);
    } else if (send_reply(conn, Code::kOk, fd)) {
      ++served_;
    }
  }
  if (fd < 0)
    MK_WARN(kSubsysMem, "rank %d: rank %d asked for unknown allocation %llu", rank_, req.rank,
            static_cast<unsigned long long>(req.id));
}

Status ipc_fetch_fd(const IpcSecret& secret, int my_rank, int peer, const std::string& peer_name,
                    uint64_t id, int64_t timeout_ms, int* fd_out) {
  *fd_out = -1;
  MK_REQUIRE(!peer_name.empty(), Code::kInvalidArgument,
             "rank %d: rank %d has no IPC socket name (it runs no IPC server)", my_rank, peer);
  MK_REQUIRE(peer_name.size() <= kIpcMaxNameLength, Code::kInvalidArgument,
             "rank %d: rank %d's IPC socket name has %zu characters (at most %zu)", my_rank, peer,
             peer_name.size(), kIpcMaxNameLength);
  if (timeout_ms <= 0) timeout_ms = tunables::ipc_timeout_ms();
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  MK_SYS_CHECK(s);
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{s};
  set_timeouts(s, timeout_ms);
  socklen_t len;
  sockaddr_un a = ipc_abstract_addr(peer_name, &len);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), len) < 0)
    return make_status(Code::kSystemError, "rank %d: cannot reach rank %d's IPC socket @%s: %s",
                       my_rank, peer, peer_name.c_str(), strerror(errno));
  ucred cred;
  socklen_t clen = sizeof(cred);
  MK_SYS_CHECK(getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &clen));
  if (cred.uid != geteuid())
    return make_status(Code::kPermissionDenied,
                       "rank %d: IPC socket of rank %d is owned by uid %u, not %u: refusing it",
                       my_rank, peer, cred.uid, geteuid());
  IpcRequest req;
  memset(&req, 0, sizeof(req));
  req.magic = kIpcMagic;
  req.version = kIpcWireVersion;
  req.rank = my_rank;
  req.id = id;
  memcpy(req.token, secret.token.data(), 32);
  if (send(s, &req, sizeof(req), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(req)))
    return make_status(Code::kSystemError, "rank %d: sending IPC request to rank %d: %s", my_rank,
                       peer, strerror(errno));
  IpcReply rep;
  iovec iov{&rep, sizeof(rep)};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))];
  msghdr msg;
  memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  ssize_t k;
  do {
    k = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  } while (k < 0 && errno == EINTR);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
    return make_status(Code::kTimeout, "rank %d: rank %d's IPC server did not answer within %lld ms",
                       my_rank, peer, static_cast<long long>(timeout_ms));
  if (k != static_cast<ssize_t>(sizeof(rep)) || rep.magic != kIpcMagic)
    return make_status(Code::kPermissionDenied,
                       "rank %d: rank %d's IPC server closed the connection without an answer "
                       "(refused)",
                       my_rank, peer);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      memcpy(&fd, CMSG_DATA(c), sizeof(int));
  if (rep.code != static_cast<int32_t>(Code::kOk)) {
    if (fd >= 0) close(fd);
    return make_status(static_cast<Code>(rep.code),
                       "rank %d: rank %d refused to share allocation %llu (%s)", my_rank, peer,
                       static_cast<unsigned long long>(id), code_name(static_cast<Code>(rep.code)));
  }
  if (fd < 0)
    return make_status(Code::kInternal, "rank %d: rank %d answered without a descriptor", my_rank,
                       peer);
  *fd_out = fd;
  return OkStatus();
}

}  // namespace mk
