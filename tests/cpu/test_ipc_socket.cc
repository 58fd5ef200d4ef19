// CPU tests of the node-local fd exchange (src/runtime/ipc_socket.h): secrets, publishing a
// memfd, fetching it back, and the refusals (wrong token, foreign uid, retracted id).
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/log.h"
#include "src/runtime/ipc_socket.h"
#include "tests/common/test_util.h"

namespace mk {
namespace {

constexpr int64_t kFetchTimeoutMs = 1000;
constexpr uid_t kNobody = 65534;

// A memfd holding `bytes`.
int make_memfd(const std::vector<uint8_t>& bytes) {
  int fd = memfd_create("mk-test", MFD_CLOEXEC);
  if (fd < 0) return -1;
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t k = pwrite(fd, bytes.data() + off, bytes.size() - off, static_cast<off_t>(off));
    if (k <= 0) {
      close(fd);
      return -1;
    }
    off += static_cast<size_t>(k);
  }
  return fd;
}

// The whole content of fd (by pread, so the offset does not matter).
std::vector<uint8_t> read_all(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return {};
  std::vector<uint8_t> out(static_cast<size_t>(st.st_size));
  size_t off = 0;
  while (off < out.size()) {
    ssize_t k = pread(fd, out.data() + off, out.size() - off, static_cast<off_t>(off));
    if (k <= 0) return {};
    off += static_cast<size_t>(k);
  }
  return out;
}

size_t count_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return SIZE_MAX;
  size_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += a[i] != b[i];
  return d;
}

// Waits (bounded) until counter() reaches want: the server thread counts asynchronously.
template <class F>
uint64_t wait_for_count(F counter, uint64_t want, int ms = 2000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  uint64_t v = counter();
  while (v < want && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    v = counter();
  }
  return v;
}

// The request a client sends, as laid out by ipc_socket.cc (its layout is static_assert'ed
// there as part of the wire protocol). Used to talk to the server without ipc_fetch_fd, which
// refuses foreign-uid servers before it sends anything.
bool drop_to_nobody() {
  return setgroups(0, nullptr) == 0 && setresgid(kNobody, kNobody, kNobody) == 0 &&
         setresuid(kNobody, kNobody, kNobody) == 0 && geteuid() == kNobody;
}

class IpcSocket : public ::testing::Test {
 protected:
  void SetUp() override {
    MK_ASSERT_OK(make_ipc_secret(&secret_));
    rank_ = static_cast<int>(rng_() % 4096);
    MK_ASSERT_OK(IpcServer::create(secret_, rank_, &server_));
    ASSERT_NE(server_, nullptr);
  }
  std::vector<uint8_t> random_bytes(size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng_());
    return v;
  }
  std::mt19937_64 rng_{test::test_seed() ^ 0x1BC};
  IpcSecret secret_{};
  int rank_ = 0;
  std::unique_ptr<IpcServer> server_;
};

TEST(IpcSecretTest, SecretsAreRandomAndDistinct) {
  std::set<std::string> ids, tokens;
  for (int i = 0; i < 16; ++i) {
    IpcSecret s;
    memset(&s, 0, sizeof(s));
    MK_ASSERT_OK(make_ipc_secret(&s));
    std::string id(s.job_id.begin(), s.job_id.end());
    std::string tok(s.token.begin(), s.token.end());
    EXPECT_NE(id, std::string(16, '\0'));
    EXPECT_NE(tok, std::string(32, '\0'));
    EXPECT_TRUE(ids.insert(id).second) << "job id repeated";
    EXPECT_TRUE(tokens.insert(tok).second) << "token repeated";
    EXPECT_NE(id, tok.substr(0, 16));
  }
}

TEST(IpcSecretTest, SocketNameHasJobIdAndRank) {
  IpcSecret s;
  MK_ASSERT_OK(make_ipc_secret(&s));
  std::string hex;
  char b[3];
  for (uint8_t x : s.job_id) {
    snprintf(b, sizeof(b), "%02x", x);
    hex += b;
  }
  EXPECT_EQ(ipc_socket_name(s, 7), "mkernel-" + hex + "-7");
  EXPECT_NE(ipc_socket_name(s, 7), ipc_socket_name(s, 8));
  IpcSecret t;
  MK_ASSERT_OK(make_ipc_secret(&t));
  EXPECT_NE(ipc_socket_name(s, 0), ipc_socket_name(t, 0));
  // The name must not reveal the token.
  std::string tokhex;
  for (uint8_t x : s.token) {
    snprintf(b, sizeof(b), "%02x", x);
    tokhex += b;
  }
  EXPECT_EQ(ipc_socket_name(s, 0).find(tokhex.substr(0, 8)), std::string::npos);
}

TEST_F(IpcSocket, PublishAndFetchReturnsSameFile) {
  std::vector<std::vector<uint8_t>> contents;
  std::vector<uint64_t> ids;
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) {
    contents.push_back(random_bytes(1 + rng_() % 20000));
    ids.push_back(rng_() | 1);
    int fd = make_memfd(contents.back());
    ASSERT_GE(fd, 0) << strerror(errno);
    fds.push_back(fd);
    MK_ASSERT_OK(server_->publish(ids.back(), fd));
  }
  // The server keeps its own dup: closing ours does not retract the publication.
  close(fds[2]);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE("allocation " + std::to_string(i));
    int got = -1;
    MK_ASSERT_OK(ipc_fetch_fd(secret_, rank_ + 1, rank_, ids[i], kFetchTimeoutMs, &got));
    ASSERT_GE(got, 0);
    if (i < 2) {
      EXPECT_NE(got, fds[i]);
    }
    EXPECT_EQ(count_diff(read_all(got), contents[i]), 0u);
    EXPECT_TRUE(fcntl(got, F_GETFD) & FD_CLOEXEC);
    if (i < 2) {
      // Same open file: a write through ours shows through the fetched one.
      struct stat a, b;
      ASSERT_EQ(fstat(fds[i], &a), 0);
      ASSERT_EQ(fstat(got, &b), 0);
      EXPECT_EQ(a.st_ino, b.st_ino);
      uint8_t x = static_cast<uint8_t>(~contents[i][0]);
      ASSERT_EQ(pwrite(fds[i], &x, 1, 0), 1);
      uint8_t y = contents[i][0];
      ASSERT_EQ(pread(got, &y, 1, 0), 1);
      EXPECT_EQ(y, x);
    }
    close(got);
  }
  EXPECT_EQ(wait_for_count([&] { return server_->served(); }, 3), 3u);
  EXPECT_EQ(server_->refused(), 0u);
  close(fds[0]);
  close(fds[1]);
}

TEST_F(IpcSocket, RepublishReplacesAndRetractRemoves) {
  auto first = random_bytes(777), second = random_bytes(1234);
  const uint64_t id = rng_();
  int fa = make_memfd(first), fb = make_memfd(second);
  ASSERT_GE(fa, 0);
  ASSERT_GE(fb, 0);
  MK_ASSERT_OK(server_->publish(id, fa));
  MK_ASSERT_OK(server_->publish(id, fb));  // replaces
  int got = -1;
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 0, rank_, id, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), second), 0u);
  close(got);

  server_->retract(id);
  got = 12345;
  Status s = ipc_fetch_fd(secret_, 0, rank_, id, kFetchTimeoutMs, &got);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_EQ(got, -1);
  server_->retract(id);       // idempotent
  server_->retract(id ^ 1);   // unknown: ignored
  close(fa);
  close(fb);
}

TEST_F(IpcSocket, UnknownIdIsAnError) {
  auto bytes = random_bytes(100);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  const uint64_t id = rng_();
  MK_ASSERT_OK(server_->publish(id, fd));
  int got = 777;
  Status s = ipc_fetch_fd(secret_, 3, rank_, id + 1, kFetchTimeoutMs, &got);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_EQ(got, -1);
  EXPECT_NE(s.message().find(std::to_string(id + 1)), std::string::npos) << s.message();
  // An unknown id is not an authentication failure.
  EXPECT_EQ(server_->refused(), 0u);
  close(fd);
}

TEST_F(IpcSocket, WrongTokenIsRefused) {
  auto bytes = random_bytes(4096);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  const uint64_t id = rng_();
  MK_ASSERT_OK(server_->publish(id, fd));
  for (int i = 0; i < 3; ++i) {
    IpcSecret wrong = secret_;
    const size_t pos = rng_() % wrong.token.size();
    wrong.token[pos] ^= static_cast<uint8_t>(1u << (rng_() % 8));  // one bit off
    int got = 555;
    Status s = ipc_fetch_fd(wrong, 1, rank_, id, kFetchTimeoutMs, &got);
    EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
    EXPECT_EQ(got, -1);
    EXPECT_EQ(wait_for_count([&] { return server_->refused(); }, i + 1), static_cast<uint64_t>(i + 1));
  }
  EXPECT_EQ(server_->served(), 0u);
  // The right token still works afterwards.
  int got = -1;
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 1, rank_, id, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), bytes), 0u);
  close(got);
  close(fd);
}

TEST_F(IpcSocket, WrongJobIdCannotReachServer) {
  IpcSecret other;
  MK_ASSERT_OK(make_ipc_secret(&other));
  other.token = secret_.token;  // right token, wrong job id: another socket name
  int got = 1;
  Status s = ipc_fetch_fd(other, 0, rank_, 1, kFetchTimeoutMs, &got);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(got, -1);
  // And the right job id with a rank that has no server.
  s = ipc_fetch_fd(secret_, 0, rank_ + 100000, 1, kFetchTimeoutMs, &got);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(std::to_string(rank_ + 100000)), std::string::npos) << s.message();
}

// A client running under another uid presents the RIGHT secret and must get nothing.
TEST_F(IpcSocket, ForeignUidClientIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch a child process to uid 65534";
  auto bytes = random_bytes(2048);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  const uint64_t id = rng_();
  MK_ASSERT_OK(server_->publish(id, fd));
  (void)log_enabled(LogLevel::kWarn, kSubsysMem);  // configure logging before fork
  const uint64_t refused_before = server_->refused();
  fflush(nullptr);
  pid_t pid = fork();
  ASSERT_GE(pid, 0) << strerror(errno);
  if (pid == 0) {
    if (!drop_to_nobody()) _exit(3);
    int got = -1;
    Status s = ipc_fetch_fd(secret_, 9, rank_, id, kFetchTimeoutMs, &got);
    if (s.ok() || got >= 0) _exit(1);
    _exit(s.code() == Code::kPermissionDenied ? 0 : 2);
  }
  int wst = 0;
  ASSERT_EQ(waitpid(pid, &wst, 0), pid);
  ASSERT_TRUE(WIFEXITED(wst)) << "child died abnormally, status " << wst;
  EXPECT_EQ(WEXITSTATUS(wst), 0)
      << "1: the foreign uid got the fd; 2: an error other than kPermissionDenied; "
         "3: could not switch uid";
  EXPECT_GE(wait_for_count([&] { return server_->refused(); }, refused_before + 1),
            refused_before + 1)
      << "the server did not count the foreign-uid connection as refused";
  EXPECT_EQ(server_->served(), 0u);
  close(fd);
}

// A foreign-uid client that bypasses ipc_fetch_fd's own checks and sends a well-formed request
// with the RIGHT token: the server's SO_PEERCRED check alone must keep the fd from it.
TEST_F(IpcSocket, ForeignUidIpcRequestGetsNoFd) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch a child process to uid 65534";
  auto bytes = random_bytes(512);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  const uint64_t id = rng_();
  MK_ASSERT_OK(server_->publish(id, fd));
  const uint64_t refused_before = server_->refused();
  fflush(nullptr);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (!drop_to_nobody()) _exit(3);
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    if (s < 0) _exit(4);
    timeval tv{1, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    socklen_t len;
    sockaddr_un a = ipc_abstract_addr(ipc_socket_name(secret_, rank_), &len);
    if (connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0) _exit(5);
    IpcRequest req;
    memset(&req, 0, sizeof(req));
    req.magic = kIpcMagic;
    req.version = 1;
    req.rank = 9;
    req.id = id;
    memcpy(req.token, secret_.token.data(), 32);
    (void)!send(s, &req, sizeof(req), MSG_NOSIGNAL);
    char rep[8];
    iovec iov{rep, sizeof(rep)};
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))];
    msghdr msg;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    (void)recvmsg(s, &msg, 0);
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) _exit(1);  // got an fd
    _exit(0);
  }
  int wst = 0;
  ASSERT_EQ(waitpid(pid, &wst, 0), pid);
  ASSERT_TRUE(WIFEXITED(wst)) << "child status " << wst;
  EXPECT_EQ(WEXITSTATUS(wst), 0) << "1: the foreign uid received the fd; 3-5: child setup failed";
  EXPECT_GE(wait_for_count([&] { return server_->refused(); }, refused_before + 1),
            refused_before + 1);
  EXPECT_EQ(server_->served(), 0u);
  close(fd);
}

// A squatter on the name under another uid that would hand an fd to anyone: the client must
// refuse it, and must not even send it the job token.
TEST(IpcSocketSquatter, ClientRefusesForeignUidServerAndKeepsToken) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch a child process to uid 65534";
  IpcSecret secret;
  MK_ASSERT_OK(make_ipc_secret(&secret));
  const int rank = 3;
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  fflush(nullptr);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(ready[0]);
    if (!drop_to_nobody()) _exit(3);
    int l = socket(AF_UNIX, SOCK_STREAM, 0);
    socklen_t len;
    sockaddr_un a = ipc_abstract_addr(ipc_socket_name(secret, rank), &len);
    if (l < 0 || bind(l, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(l, 4) != 0) _exit(4);
    int bait = memfd_create("bait", 0);
    char c = 1;
    if (bait < 0 || write(ready[1], &c, 1) != 1) _exit(5);
    pollfd pf{l, POLLIN, 0};
    if (poll(&pf, 1, 3000) != 1) _exit(6);  // the parent never connected
    int conn = accept(l, nullptr, nullptr);
    if (conn < 0) _exit(7);
    timeval tv{1, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    uint8_t buf[sizeof(IpcRequest)];
    size_t got = 0;
    for (;;) {
      ssize_t k = recv(conn, buf + got, sizeof(buf) - got, 0);
      if (k <= 0) break;
      got += static_cast<size_t>(k);
      if (got == sizeof(buf)) break;
    }
    // Answer "ok" with the bait fd, whatever was asked.
    uint32_t rep[2] = {kIpcMagic, 0};
    iovec iov{rep, sizeof(rep)};
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))];
    memset(ctrl, 0, sizeof(ctrl));
    msghdr msg;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &bait, sizeof(int));
    (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
    bool leaked = got >= offsetof(IpcRequest, token) + 32 &&
                  memcmp(buf + offsetof(IpcRequest, token), secret.token.data(), 32) == 0;
    _exit(leaked ? 1 : 0);
  }
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1) << "child could not bind the name";
  close(ready[0]);
  int got = -1;
  Status s = ipc_fetch_fd(secret, 0, rank, 42, kFetchTimeoutMs, &got);
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
  EXPECT_EQ(got, -1);
  if (got >= 0) close(got);
  int wst = 0;
  ASSERT_EQ(waitpid(pid, &wst, 0), pid);
  ASSERT_TRUE(WIFEXITED(wst)) << "child status " << wst;
  EXPECT_EQ(WEXITSTATUS(wst), 0) << "1: the client sent the job token to a foreign-uid server; "
                                    "3-7: child setup failed";
}

TEST_F(IpcSocket, SecondServerOnSameNameFails) {
  std::unique_ptr<IpcServer> dup;
  Status s = IpcServer::create(secret_, rank_, &dup);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kSystemError) << s.to_string();
  EXPECT_EQ(dup, nullptr);
  EXPECT_NE(s.message().find(ipc_socket_name(secret_, rank_)), std::string::npos) << s.message();
  // The first server is unaffected.
  auto bytes = random_bytes(333);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  MK_ASSERT_OK(server_->publish(5, fd));
  int got = -1;
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 0, rank_, 5, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), bytes), 0u);
  close(got);
  close(fd);
  // Another rank under the same secret is a different name and binds fine.
  std::unique_ptr<IpcServer> other;
  MK_EXPECT_OK(IpcServer::create(secret_, rank_ + 1, &other));
}

TEST_F(IpcSocket, ShutdownIsIdempotentAndStopsServing) {
  auto bytes = random_bytes(64);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  MK_ASSERT_OK(server_->publish(8, fd));
  server_->shutdown();
  server_->shutdown();
  int got = 4;
  auto t0 = std::chrono::steady_clock::now();
  Status s = ipc_fetch_fd(secret_, 0, rank_, 8, kFetchTimeoutMs, &got);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(got, -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(kFetchTimeoutMs + 500));
  // The name is free again once shut down.
  std::unique_ptr<IpcServer> again;
  MK_EXPECT_OK(IpcServer::create(secret_, rank_, &again));
  server_.reset();  // destructor after shutdown: still safe
  close(fd);
}

}  // namespace
}  // namespace mk
