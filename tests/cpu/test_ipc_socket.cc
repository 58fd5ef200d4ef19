// CPU tests of the node-local fd exchange (src/runtime/ipc_socket.h): secrets, random socket
// names (unpredictable, exchanged, never computed), publishing a memfd, fetching it back, and
// the refusals (wrong token, foreign uid, retracted id, squatters).
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

#include <algorithm>
#include <bitset>
#include <chrono>
#include <fstream>
#include <cstddef>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/log.h"
#include "src/runtime/ipc_socket.h"
#include "mkernel/common/tunables.h"
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

std::string to_hex(const uint8_t* p, size_t n) {
  std::string s;
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    snprintf(b, sizeof(b), "%02x", p[i]);
    s += b;
  }
  return s;
}

// The 128 random bits of a drawn name (its hex digits after the prefix).
std::bitset<128> name_bits(const std::string& name) {
  std::bitset<128> bits;
  const size_t p = sizeof(kIpcNamePrefix) - 1;
  for (size_t i = 0; i < 32; ++i) {
    const char c = name[p + i];
    const int v = c <= '9' ? c - '0' : c - 'a' + 10;
    for (int k = 0; k < 4; ++k)
      if (v & (1 << k)) bits.set(i * 4 + k);
  }
  return bits;
}

// A listening socket bound to `name` in the abstract namespace (a squatter); -1 if taken.
int bind_listener(const std::string& name) {
  int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (l < 0) return -1;
  socklen_t len;
  sockaddr_un a = ipc_abstract_addr(name, &len);
  if (bind(l, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(l, 4) != 0) {
    close(l);
    return -1;
  }
  return l;
}

// True if a connection is waiting on listening socket l.
bool has_pending_connection(int l) {
  pollfd pf{l, POLLIN, 0};
  return poll(&pf, 1, 0) == 1;
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
  std::set<std::string> tokens;
  for (int i = 0; i < 16; ++i) {
    IpcSecret s;
    memset(&s, 0, sizeof(s));
    MK_ASSERT_OK(make_ipc_secret(&s));
    std::string tok(s.token.begin(), s.token.end());
    EXPECT_NE(tok, std::string(32, '\0'));
    EXPECT_TRUE(tokens.insert(tok).second) << "token repeated";
  }
}

TEST(IpcNameTest, DrawnNamesAreWellFormedAndDistinct) {
  std::set<std::string> names;
  for (int i = 0; i < 256; ++i) {
    std::string n;
    MK_ASSERT_OK(draw_ipc_socket_name(&n));
    EXPECT_EQ(n.size(), kIpcNameLength);
    EXPECT_EQ(n.rfind(kIpcNamePrefix, 0), 0u) << n;
    EXPECT_TRUE(is_ipc_socket_name(n)) << n;
    EXPECT_TRUE(names.insert(n).second) << "name repeated: " << n;
  }
  EXPECT_GE(kIpcNameRandomBytes * 8, 128u);
  for (const char* bad : {"", "mkernel-", "mkernel-0123", "mkernel-0123456789abcdef0123456789ABCDEF",
                          "mkernel-0123456789abcdef0123456789abcdeg",
                          "mkernel-0123456789abcdef0123456789abcdef0",
                          "xkernel-0123456789abcdef0123456789abcdef"})
    EXPECT_FALSE(is_ipc_socket_name(bad)) << bad;
  EXPECT_TRUE(is_ipc_socket_name("mkernel-0123456789abcdef0123456789abcdef"));
}

// Servers of the same job and the same rank still draw their own names.
TEST_F(IpcSocket, NamesDifferPerServerEvenForSameSecretAndRank) {
  std::vector<std::unique_ptr<IpcServer>> servers;
  std::set<std::string> names{server_->name()};
  EXPECT_TRUE(is_ipc_socket_name(server_->name())) << server_->name();
  for (int i = 0; i < 8; ++i) {
    std::unique_ptr<IpcServer> s;
    MK_ASSERT_OK(IpcServer::create(secret_, rank_, &s));
    EXPECT_TRUE(is_ipc_socket_name(s->name())) << s->name();
    EXPECT_TRUE(names.insert(s->name()).second) << "name repeated: " << s->name();
    servers.push_back(std::move(s));
  }
  // Each name reaches its own server: an id published on one is unknown to the others.
  auto bytes = random_bytes(99);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  MK_ASSERT_OK(servers[3]->publish(77, fd));
  int got = -1;
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 0, rank_, servers[3]->name(), 77, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), bytes), 0u);
  close(got);
  Status s = ipc_fetch_fd(secret_, 0, rank_, servers[4]->name(), 77, kFetchTimeoutMs, &got);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_EQ(got, -1);
  close(fd);
}

// A name carries neither the job's token nor the rank: nothing a name reveals helps anyone.
TEST(IpcNameTest, NameRevealsNeitherTokenNorRank) {
  for (int i = 0; i < 8; ++i) {
    IpcSecret secret;
    MK_ASSERT_OK(make_ipc_secret(&secret));
    const int rank = 10 * i + 7;
    std::unique_ptr<IpcServer> s;
    MK_ASSERT_OK(IpcServer::create(secret, rank, &s));
    const std::string& name = s->name();
    ASSERT_TRUE(is_ipc_socket_name(name)) << name;  // prefix + hex digits, nothing else
    // No 4-byte window of the token, in hex, appears in the name.
    const std::string tokhex = to_hex(secret.token.data(), secret.token.size());
    for (size_t k = 0; k + 8 <= tokhex.size(); k += 2)
      EXPECT_EQ(name.find(tokhex.substr(k, 8)), std::string::npos) << name << " vs token " << tokhex;
    // Not the old "<prefix><id>-<rank>" form: no separator after the prefix, no rank suffix.
    EXPECT_EQ(name.find('-', sizeof(kIpcNamePrefix) - 1), std::string::npos) << name;
  }
}

// No name follows from another: consecutive servers (ranks r, r+1, same job) and repeated
// draws share no structure. The random parts of two names differ in about 64 of 128 bits
// (at most 16 or at least 112 has probability < 1e-18 per pair), consecutive differences
// are not a constant step, and the bits are balanced.
TEST(IpcNameTest, NoNameIsDerivableFromAnother) {
  IpcSecret secret;
  MK_ASSERT_OK(make_ipc_secret(&secret));
  std::vector<std::unique_ptr<IpcServer>> servers;
  std::vector<std::bitset<128>> bits;
  for (int r = 0; r < 32; ++r) {
    std::unique_ptr<IpcServer> s;
    MK_ASSERT_OK(IpcServer::create(secret, r, &s));
    bits.push_back(name_bits(s->name()));
    servers.push_back(std::move(s));
  }
  for (int i = 0; i < 32; ++i) {
    std::string n;
    MK_ASSERT_OK(draw_ipc_socket_name(&n));
    bits.push_back(name_bits(n));
  }
  size_t ones = 0;
  std::set<std::string> steps;
  for (size_t i = 0; i < bits.size(); ++i) {
    ones += bits[i].count();
    for (size_t j = i + 1; j < bits.size(); ++j) {
      const size_t d = (bits[i] ^ bits[j]).count();
      EXPECT_GT(d, 16u) << "names " << i << " and " << j << " differ in only " << d << " bits";
      EXPECT_LT(d, 112u) << "names " << i << " and " << j << " are near complements";
    }
    if (i + 1 < bits.size()) steps.insert((bits[i] ^ bits[i + 1]).to_string());
  }
  EXPECT_EQ(steps.size(), bits.size() - 1) << "two consecutive pairs differ by the same step";
  // 64 names x 128 bits: 4096 ones expected, sigma 45; allow 7 sigma.
  EXPECT_GT(ones, 4096u - 320u);
  EXPECT_LT(ones, 4096u + 320u);
}

TEST(IpcNameTest, RecordsRoundTripAndRejectMalformed) {
  std::string n, back;
  MK_ASSERT_OK(draw_ipc_socket_name(&n));
  IpcNameRecord rec = ipc_name_record(n);
  MK_ASSERT_OK(ipc_name_from_record(rec, 3, &back));
  EXPECT_EQ(back, n);
  for (size_t i = n.size(); i < sizeof(rec.name); ++i) EXPECT_EQ(rec.name[i], '\0');
  // No server: an all-zero record, read back as "".
  rec = ipc_name_record("");
  back = "x";
  MK_ASSERT_OK(ipc_name_from_record(rec, 3, &back));
  EXPECT_EQ(back, "");

  auto expect_bad = [](const IpcNameRecord& r, const char* what) {
    std::string out = "x";
    Status s = ipc_name_from_record(r, 5, &out);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << what << ": " << s.to_string();
    EXPECT_NE(s.message().find("rank 5"), std::string::npos) << s.message();
    EXPECT_EQ(out, "") << what;
  };
  IpcNameRecord bad = ipc_name_record(n);
  memset(bad.name, 'a', sizeof(bad.name));
  expect_bad(bad, "no terminator");
  bad = ipc_name_record(n);
  bad.name[sizeof(bad.name) - 1] = 'z';
  expect_bad(bad, "bytes after the terminator");
  bad = ipc_name_record(n);
  bad.name[0] = 'x';
  expect_bad(bad, "wrong prefix");
  bad = ipc_name_record(n);
  bad.name[kIpcNameLength - 1] = 'G';
  expect_bad(bad, "not a hex digit");
  bad = ipc_name_record(n);
  bad.name[kIpcNameLength - 1] = '\0';
  expect_bad(bad, "too short");
  bad = ipc_name_record(n + "-3");
  expect_bad(bad, "old-style rank suffix");
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
    MK_ASSERT_OK(ipc_fetch_fd(secret_, rank_ + 1, rank_, server_->name(), ids[i], kFetchTimeoutMs, &got));
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
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 0, rank_, server_->name(), id, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), second), 0u);
  close(got);

  server_->retract(id);
  got = 12345;
  Status s = ipc_fetch_fd(secret_, 0, rank_, server_->name(), id, kFetchTimeoutMs, &got);
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
  Status s = ipc_fetch_fd(secret_, 3, rank_, server_->name(), id + 1, kFetchTimeoutMs, &got);
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
    Status s = ipc_fetch_fd(wrong, 1, rank_, server_->name(), id, kFetchTimeoutMs, &got);
    EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
    EXPECT_EQ(got, -1);
    EXPECT_EQ(wait_for_count([&] { return server_->refused(); }, i + 1), static_cast<uint64_t>(i + 1));
  }
  EXPECT_EQ(server_->served(), 0u);
  // The right token still works afterwards.
  int got = -1;
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 1, rank_, server_->name(), id, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), bytes), 0u);
  close(got);
  close(fd);
}

// A flood of refused connections (another local user's, or a broken client) is counted in full
// but logged only for the first few and then at each power of two: 200 refusals, at most
// 4 + 8 lines (before, one WARN line each).
TEST_F(IpcSocket, RefusalFloodDoesNotFloodTheLog) {
  char tmpl[] = "/tmp/mk-ipclog-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string log = std::string(tmpl) + "/log";
  MK_ASSERT_OK(tunables::set("debug", "WARN"));
  MK_ASSERT_OK(tunables::set("debug_file", log));
  IpcSecret wrong = secret_;
  wrong.token[0] ^= 1;
  const int kFlood = 200;
  for (int i = 0; i < kFlood; ++i) {
    int got = -1;
    EXPECT_EQ(ipc_fetch_fd(wrong, 1, rank_, server_->name(), 7, kFetchTimeoutMs, &got).code(),
              Code::kPermissionDenied);
  }
  EXPECT_EQ(wait_for_count([&] { return server_->refused(); }, kFlood), static_cast<uint64_t>(kFlood));
  MK_ASSERT_OK(tunables::reset("debug_file"));  // closes the log
  MK_ASSERT_OK(tunables::reset("debug"));
  std::ifstream f(log);
  std::string line;
  int refused_lines = 0;
  bool says_count = false;
  while (std::getline(f, line)) {
    if (line.find("refused: wrong job token") == std::string::npos) continue;
    ++refused_lines;
    says_count |= line.find("refusal 128;") != std::string::npos;
  }
  EXPECT_GE(refused_lines, 4);
  EXPECT_LE(refused_lines, 4 + 8);
  EXPECT_TRUE(says_count) << "the 128th refusal is logged with its count";
  unlink(log.c_str());
  rmdir(tmpl);
}

// The right token is no use without the name: a name nobody bound, or no name, reaches nothing.
TEST_F(IpcSocket, WrongOrMissingNameCannotReachServer) {
  auto bytes = random_bytes(64);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  MK_ASSERT_OK(server_->publish(1, fd));
  std::string other;
  MK_ASSERT_OK(draw_ipc_socket_name(&other));
  ASSERT_NE(other, server_->name());
  int got = 1;
  Status s = ipc_fetch_fd(secret_, 0, rank_, other, 1, kFetchTimeoutMs, &got);
  EXPECT_EQ(s.code(), Code::kSystemError) << s.to_string();
  EXPECT_EQ(got, -1);
  EXPECT_NE(s.message().find("rank " + std::to_string(rank_)), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(other), std::string::npos) << s.message();
  // A rank that runs no server has no name: a clear error, not a connect to "@".
  got = 1;
  s = ipc_fetch_fd(secret_, 0, rank_ + 1, "", 1, kFetchTimeoutMs, &got);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_EQ(got, -1);
  EXPECT_NE(s.message().find("rank " + std::to_string(rank_ + 1)), std::string::npos) << s.message();
  s = ipc_fetch_fd(secret_, 0, rank_, std::string(kIpcMaxNameLength + 1, 'a'), 1, kFetchTimeoutMs, &got);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_EQ(server_->served(), 0u);
  EXPECT_EQ(server_->refused(), 0u);
  close(fd);
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
    Status s = ipc_fetch_fd(secret_, 9, rank_, server_->name(), id, kFetchTimeoutMs, &got);
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
    sockaddr_un a = ipc_abstract_addr(server_->name(), &len);
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

// A squatter under another uid on a name the client will use (a name seen in /proc/net/unix
// whose server has gone) that would hand an fd to anyone: the client must refuse it, and must
// not even send it the job token.
TEST(IpcSocketSquatter, ClientRefusesForeignUidServerAndKeepsToken) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch a child process to uid 65534";
  IpcSecret secret;
  MK_ASSERT_OK(make_ipc_secret(&secret));
  const int rank = 3;
  std::string name;
  MK_ASSERT_OK(draw_ipc_socket_name(&name));
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
    sockaddr_un a = ipc_abstract_addr(name, &len);
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
  Status s = ipc_fetch_fd(secret, 0, rank, name, 42, kFetchTimeoutMs, &got);
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
  EXPECT_EQ(got, -1);
  if (got >= 0) close(got);
  int wst = 0;
  ASSERT_EQ(waitpid(pid, &wst, 0), pid);
  ASSERT_TRUE(WIFEXITED(wst)) << "child status " << wst;
  EXPECT_EQ(WEXITSTATUS(wst), 0) << "1: the client sent the job token to a foreign-uid server; "
                                    "3-7: child setup failed";
}

// Someone who saw one rank's name binds every name the old scheme ("mkernel-<job id>-<rank>")
// or a simple derivation would give the job's other ranks, before they start: the ranks bind
// names of their own, the exchanged names reach the real servers, and no connection ever
// reaches the squatter.
TEST_F(IpcSocket, SquatterOnGuessedNamesGetsNothing) {
  const std::string seen = server_->name();
  const std::string id = seen.substr(sizeof(kIpcNamePrefix) - 1);
  std::vector<std::string> guesses;
  for (int r = 0; r < 8; ++r) {
    guesses.push_back(kIpcNamePrefix + id + "-" + std::to_string(rank_ + r));  // old style
    guesses.push_back(std::string(kIpcNamePrefix) + "-" + std::to_string(rank_ + r));
  }
  std::string next = seen;  // the seen name with its last digits stepped
  for (int k = 1; k <= 8; ++k) {
    next.back() = "0123456789abcdef"[(std::string("0123456789abcdef").find(seen.back()) + k) % 16];
    guesses.push_back(next);
  }
  std::vector<int> squats;
  for (const auto& g : guesses) {
    int l = bind_listener(g);
    ASSERT_GE(l, 0) << "could not squat " << g;
    squats.push_back(l);
  }
  // The job's other ranks start now.
  std::vector<std::unique_ptr<IpcServer>> ranks;
  std::vector<int> fds;
  std::vector<std::vector<uint8_t>> contents;
  for (int r = 1; r < 8; ++r) {
    std::unique_ptr<IpcServer> s;
    MK_ASSERT_OK(IpcServer::create(secret_, rank_ + r, &s));
    EXPECT_EQ(std::find(guesses.begin(), guesses.end(), s->name()), guesses.end()) << s->name();
    contents.push_back(random_bytes(100 + r));
    fds.push_back(make_memfd(contents.back()));
    ASSERT_GE(fds.back(), 0);
    MK_ASSERT_OK(s->publish(1000 + r, fds.back()));
    ranks.push_back(std::move(s));
  }
  // Every fetch through an exchanged name gets that rank's own file.
  for (int r = 1; r < 8; ++r) {
    int got = -1;
    MK_ASSERT_OK(ipc_fetch_fd(secret_, rank_, rank_ + r, ranks[r - 1]->name(), 1000 + r,
                              kFetchTimeoutMs, &got));
    EXPECT_EQ(count_diff(read_all(got), contents[r - 1]), 0u);
    close(got);
  }
  for (size_t i = 0; i < squats.size(); ++i) {
    EXPECT_FALSE(has_pending_connection(squats[i])) << "a connection reached " << guesses[i];
    close(squats[i]);
  }
  for (int fd : fds) close(fd);
}

// A name that is taken (by anyone) is not fatal: the server draws another.
TEST_F(IpcSocket, BindDrawsAnotherNameWhenTaken) {
  int draws = 0;
  const std::string taken = server_->name();
  auto source = [&](std::string* out) -> Status {
    if (draws++ == 0) {
      *out = taken;
      return OkStatus();
    }
    return draw_ipc_socket_name(out);
  };
  std::unique_ptr<IpcServer> second;
  MK_ASSERT_OK(IpcServer::create(secret_, rank_, source, &second));
  EXPECT_EQ(draws, 2);
  EXPECT_NE(second->name(), taken);
  EXPECT_TRUE(is_ipc_socket_name(second->name()));
  // Both serve, each its own.
  auto a = random_bytes(333), b = random_bytes(444);
  int fa = make_memfd(a), fb = make_memfd(b);
  ASSERT_GE(fa, 0);
  ASSERT_GE(fb, 0);
  MK_ASSERT_OK(server_->publish(5, fa));
  MK_ASSERT_OK(second->publish(5, fb));
  int got = -1;
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 0, rank_, server_->name(), 5, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), a), 0u);
  close(got);
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 0, rank_, second->name(), 5, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), b), 0u);
  close(got);
  close(fa);
  close(fb);
}

// Only a bounded number of draws: a source that only yields taken names fails, naming them.
TEST_F(IpcSocket, BindGivesUpAfterBoundedDraws) {
  int draws = 0;
  auto source = [&](std::string* out) -> Status {
    ++draws;
    *out = server_->name();
    return OkStatus();
  };
  std::unique_ptr<IpcServer> dup;
  Status s = IpcServer::create(secret_, rank_, source, &dup);
  EXPECT_EQ(s.code(), Code::kSystemError) << s.to_string();
  EXPECT_EQ(dup, nullptr);
  EXPECT_EQ(draws, kIpcBindAttempts);
  EXPECT_NE(s.message().find(server_->name()), std::string::npos) << s.message();
  // A failing draw is passed through, and a name that cannot be an address is refused.
  auto failing = [](std::string*) { return make_status(Code::kSystemError, "no entropy"); };
  s = IpcServer::create(secret_, rank_, failing, &dup);
  EXPECT_NE(s.message().find("no entropy"), std::string::npos) << s.to_string();
  auto too_long = [](std::string* out) {
    *out = std::string(kIpcMaxNameLength + 1, 'a');
    return OkStatus();
  };
  s = IpcServer::create(secret_, rank_, too_long, &dup);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_EQ(dup, nullptr);
  // The first server is unaffected.
  auto bytes = random_bytes(50);
  int fd = make_memfd(bytes);
  ASSERT_GE(fd, 0);
  MK_ASSERT_OK(server_->publish(6, fd));
  int got = -1;
  MK_ASSERT_OK(ipc_fetch_fd(secret_, 0, rank_, server_->name(), 6, kFetchTimeoutMs, &got));
  EXPECT_EQ(count_diff(read_all(got), bytes), 0u);
  close(got);
  close(fd);
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
  Status s = ipc_fetch_fd(secret_, 0, rank_, server_->name(), 8, kFetchTimeoutMs, &got);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(got, -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(kFetchTimeoutMs + 500));
  // The name is free again once shut down: a server drawing it binds it at the first try.
  const std::string old_name = server_->name();
  int draws = 0;
  std::unique_ptr<IpcServer> again;
  MK_EXPECT_OK(IpcServer::create(secret_, rank_,
                                 [&](std::string* out) {
                                   ++draws;
                                   *out = old_name;
                                   return OkStatus();
                                 },
                                 &again));
  EXPECT_EQ(draws, 1);
  if (again) {
    EXPECT_EQ(again->name(), old_name);
  }
  server_.reset();  // destructor after shutdown: still safe
  close(fd);
}

}  // namespace
}  // namespace mk
