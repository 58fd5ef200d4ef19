// mkernel — files a user names in a setting (the split memory, the debug log), opened so that
// another local user cannot redirect, block or bloat them.
//
// Every open refuses a symbolic link at the last component (O_NOFOLLOW), never blocks on a FIFO
// or a device (O_NONBLOCK until the file is checked), and then requires a regular file owned by
// this process's user and writable by nobody else. Files it creates are 0600. Reads are capped.
// A lock on such a file is taken with a deadline: another process holding it fails the caller
// with kTimeout instead of blocking it for good.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mkernel/common/status.h"

namespace mk {

// Opens `path` (flags: O_RDONLY, O_WRONLY or O_RDWR, with O_CREAT / O_APPEND / O_EXCL / O_TRUNC
// as wanted; O_NOFOLLOW, O_CLOEXEC are added). *fd = -1 and OkStatus with *exists = false when
// the file is absent and O_CREAT was not given. Refusals are kPermissionDenied naming the path
// and the reason (a link, not a regular file, owned by uid N, writable by group or others).
// `what` names the setting in messages ("split memory").
Status open_private_file(const std::string& path, int flags, const char* what, int* fd, bool* exists = nullptr);

// The whole file into *text (at most max_bytes: a larger file is kInvalidArgument naming its size),
// or "" with *exists = false when there is none.
Status read_private_file(const std::string& path, size_t max_bytes, const char* what, std::string* text,
                         bool* exists);

// An exclusive flock(2) on a private file ("<path>", created 0600 if absent), taken within
// timeout_ms; released by the destructor.
class PrivateFileLock {
 public:
  PrivateFileLock() = default;
  PrivateFileLock(const PrivateFileLock&) = delete;
  PrivateFileLock& operator=(const PrivateFileLock&) = delete;
  ~PrivateFileLock();
  Status lock(const std::string& path, int64_t timeout_ms, const char* what);

 private:
  int fd_ = -1;
};

}  // namespace mk
