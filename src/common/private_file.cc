// mkernel — files named in settings, opened safely (private_file.h).
#include "src/common/private_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "mkernel/common/check.h"
#include "src/common/deadline.h"

namespace mk {

Status open_private_file(const std::string& path, int flags, const char* what, int* fd, bool* exists) {
  *fd = -1;
  if (exists) *exists = false;
  const int f = open(path.c_str(), flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600);
  if (f < 0) {
    const int e = errno;
    if (e == ENOENT && !(flags & O_CREAT)) return OkStatus();
    if (e == ELOOP)
      return make_status(Code::kPermissionDenied, "%s: %s is a symbolic link (refused: name the file itself)", what,
                         path.c_str());
    if (e == EACCES || e == EPERM)
      return make_status(Code::kPermissionDenied, "%s: cannot open %s: %s (a file of another user?)", what,
                         path.c_str(), strerror(e));
    return make_status(Code::kSystemError, "%s: cannot open %s: %s", what, path.c_str(), strerror(e));
  }
  struct stat st;
  Status bad;
  if (fstat(f, &st) != 0) {
    bad = make_status(Code::kSystemError, "%s: cannot stat %s: %s", what, path.c_str(), strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    bad = make_status(Code::kPermissionDenied, "%s: %s is not a regular file (refused)", what, path.c_str());
  } else if (st.st_uid != geteuid()) {
    bad = make_status(Code::kPermissionDenied, "%s: %s is owned by uid %u, not this user (uid %u): refused", what,
                      path.c_str(), static_cast<unsigned>(st.st_uid), static_cast<unsigned>(geteuid()));
  } else if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    bad = make_status(Code::kPermissionDenied,
                      "%s: %s is writable by group or others (mode %03o): refused (chmod go-w it)", what,
                      path.c_str(), static_cast<unsigned>(st.st_mode & 0777));
  } else if (fcntl(f, F_SETFL, fcntl(f, F_GETFL) & ~O_NONBLOCK) != 0) {
    bad = make_status(Code::kSystemError, "%s: %s: fcntl: %s", what, path.c_str(), strerror(errno));
  }
  if (!bad.ok()) {
    close(f);
    return bad;
  }
  *fd = f;
  if (exists) *exists = true;
  return OkStatus();
}

Status read_private_file(const std::string& path, size_t max_bytes, const char* what, std::string* text,
                         bool* exists) {
  text->clear();
  int fd = -1;
  MK_CHECK(open_private_file(path, O_RDONLY, what, &fd, exists));
  if (fd < 0) return OkStatus();
  struct stat st;
  Status s;
  if (fstat(fd, &st) != 0) {
    s = make_status(Code::kSystemError, "%s: cannot stat %s: %s", what, path.c_str(), strerror(errno));
  } else if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    s = make_status(Code::kInvalidArgument, "%s: %s holds %lld bytes, more than the %zu allowed: refused", what,
                    path.c_str(), static_cast<long long>(st.st_size), max_bytes);
  } else {
    text->resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < text->size()) {
      const ssize_t n = read(fd, &(*text)[got], text->size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        s = make_status(Code::kSystemError, "%s: reading %s: %s", what, path.c_str(), strerror(errno));
        break;
      }
      if (n == 0) break;  // shrank since fstat
      got += static_cast<size_t>(n);
    }
    text->resize(got);
  }
  close(fd);
  if (!s.ok()) text->clear();
  return s;
}

PrivateFileLock::~PrivateFileLock() {
  if (fd_ >= 0) {
    (void)flock(fd_, LOCK_UN);
    close(fd_);
  }
}

Status PrivateFileLock::lock(const std::string& path, int64_t timeout_ms, const char* what) {
  MK_REQUIRE(fd_ < 0, Code::kInternal, "%s: %s is locked already", what, path.c_str());
  int fd = -1;
  MK_CHECK(open_private_file(path, O_RDWR | O_CREAT, what, &fd));
  const auto deadline = deadline_after_ms(timeout_ms);
  auto pause = std::chrono::milliseconds(1);
  while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e != EWOULDBLOCK && e != EINTR) {
      close(fd);
      return make_status(Code::kSystemError, "%s: cannot lock %s: %s", what, path.c_str(), strerror(e));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      close(fd);
      return make_status(Code::kTimeout,
                         "%s: %s stayed locked by another process for %lld ms (a hung job of this user? "
                         "`fuser %s` names it)",
                         what, path.c_str(), static_cast<long long>(timeout_ms), path.c_str());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  fd_ = fd;
  return OkStatus();
}

}  // namespace mk
