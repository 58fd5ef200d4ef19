// mkernel — the learned starting split (split_memory.h).
#include "src/ops/control/split_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "src/common/private_file.h"

namespace mk {
namespace ops {
namespace {

constexpr const char* kHeader = "# mkernel split memory v1: key<TAB>communication CTAs";

constexpr const char* kWhat = "split memory";

// The whole of fd's text written, or an error.
Status write_all(int fd, const std::string& text, const std::string& path) {
  size_t put = 0;
  while (put < text.size()) {
    const ssize_t n = write(fd, text.data() + put, text.size() - put);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return make_status(Code::kSystemError, "split memory: writing %s failed: %s", path.c_str(), strerror(errno));
    put += static_cast<size_t>(n);
  }
  return OkStatus();
}

}  // namespace

std::string split_key(const std::string& op, int64_t M, int64_t N, int64_t K, int world, int nodes,
                      const std::string& provider, int rank) {
  char b[160];
  snprintf(b, sizeof(b), " M=%lld N=%lld K=%lld W=%d nodes=%d provider=", static_cast<long long>(M),
           static_cast<long long>(N), static_cast<long long>(K), world, nodes);
  std::string prov = provider.empty() ? "none" : provider;
  for (char& c : prov)
    if (c == ' ' || c == '\t' || c == '\n') c = '_';
  return op + b + prov + " rank=" + std::to_string(rank);
}

SplitMemory& SplitMemory::process() {
  static SplitMemory* m = [] {
    auto* s = new SplitMemory();  // never destroyed: operators may record while the process exits
    const std::string file = tunables::split_memory_file();
    if (!file.empty()) {
      Status st = s->attach(file);
      if (!st.ok()) MK_WARN(kSubsysTune, "%s (starting from the defaults)", st.message().c_str());
    }
    return s;
  }();
  return *m;
}

std::string SplitMemory::format(const std::map<std::string, int>& entries) {
  std::string out = std::string(kHeader) + "\n";
  for (const auto& e : entries) out += e.first + "\t" + std::to_string(e.second) + "\n";
  return out;
}

Status SplitMemory::parse(const std::string& text, const std::string& where, std::map<std::string, int>* out) {
  std::map<std::string, int> got;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    const size_t tab = line.rfind('\t');
    MK_REQUIRE(tab != std::string::npos && tab > 0, Code::kInvalidArgument,
               "split memory %s line %d: expected 'key<TAB>count', got '%s'", where.c_str(), n, line.c_str());
    const std::string num = line.substr(tab + 1);
    char* end = nullptr;
    errno = 0;
    const long v = strtol(num.c_str(), &end, 10);
    MK_REQUIRE(!num.empty() && *end == '\0' && errno == 0 && v >= 1 && v <= 1 << 20, Code::kInvalidArgument,
               "split memory %s line %d: count '%s' is not a whole number >= 1", where.c_str(), n, num.c_str());
    got[line.substr(0, tab)] = static_cast<int>(v);
  }
  out->swap(got);
  return OkStatus();
}

Status SplitMemory::attach(const std::string& path) {
  std::lock_guard<std::mutex> g(mu_);
  if (path.empty()) {
    path_.clear();
    return OkStatus();
  }
  std::string text;
  bool exists = false;
  MK_CHECK(read_private_file(path, kMaxFileBytes, kWhat, &text, &exists));
  std::map<std::string, int> got;
  MK_CHECK(parse(text, path, &got));
  for (const auto& e : got) entries_.emplace(e.first, e.second);  // memory wins
  path_ = path;
  MK_INFO(kSubsysTune, "split memory: %zu entries from %s%s", got.size(), path.c_str(),
          exists ? "" : " (no file yet)");
  return OkStatus();
}

bool SplitMemory::lookup(const std::string& key, int* comm) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return false;
  *comm = it->second;
  return true;
}

Status SplitMemory::record(const std::string& key, int comm, bool write_now) {
  MK_REQUIRE(comm >= 1, Code::kInvalidArgument, "split memory: count %d for '%s' (must be >= 1)", comm,
             key.c_str());
  MK_REQUIRE(key.find_first_of("\t\n") == std::string::npos && !key.empty() && key[0] != '#',
             Code::kInvalidArgument, "split memory: key '%s' has a tab, a newline or a leading '#'", key.c_str());
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second == comm) return OkStatus();
  entries_[key] = comm;
  if (path_.empty()) return OkStatus();
  dirty_ = true;
  return write_now ? write_locked() : OkStatus();
}

Status SplitMemory::flush() {
  std::lock_guard<std::mutex> g(mu_);
  if (path_.empty() || !dirty_) return OkStatus();
  return write_locked();
}

Status SplitMemory::write_locked() {
  PrivateFileLock lock;
  MK_CHECK(lock.lock(path_ + ".lock", lock_timeout_ms_, kWhat));
  // Merge: the file's entries (other ranks' and processes'), then ours over them.
  std::string text;
  bool exists = false;
  MK_CHECK(read_private_file(path_, kMaxFileBytes, kWhat, &text, &exists));
  std::map<std::string, int> merged;
  Status ps = parse(text, path_, &merged);
  if (!ps.ok()) {
    MK_WARN(kSubsysTune, "%s: rewriting it", ps.message().c_str());
    merged.clear();
  }
  for (const auto& e : entries_) merged[e.first] = e.second;
  const std::string out = format(merged);
  MK_REQUIRE(out.size() <= kMaxFileBytes, Code::kInvalidArgument,
             "split memory: %zu entries make %zu bytes, more than the %zu a file may hold (not written)",
             merged.size(), out.size(), kMaxFileBytes);
  std::random_device rd;
  char suffix[48];
  snprintf(suffix, sizeof(suffix), ".tmp%d.%08x", static_cast<int>(getpid()), rd());
  const std::string tmp = path_ + suffix;
  int fd = -1;
  MK_CHECK(open_private_file(tmp, O_WRONLY | O_CREAT | O_EXCL, kWhat, &fd));
  Status w = write_all(fd, out, tmp);
  if (close(fd) != 0 && w.ok())
    w = make_status(Code::kSystemError, "split memory: writing %s failed: %s", tmp.c_str(), strerror(errno));
  if (!w.ok()) {
    unlink(tmp.c_str());
    return w;
  }
  if (rename(tmp.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    unlink(tmp.c_str());
    return make_status(Code::kSystemError, "split memory: rename %s -> %s: %s", tmp.c_str(), path_.c_str(),
                       strerror(e));
  }
  dirty_ = false;
  return OkStatus();
}

size_t SplitMemory::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return entries_.size();
}

void SplitMemory::clear() {
  std::lock_guard<std::mutex> g(mu_);
  entries_.clear();
}

}  // namespace ops
}  // namespace mk
