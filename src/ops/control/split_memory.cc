// mkernel — the learned starting split (split_memory.h).
#include "src/ops/control/split_memory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"

namespace mk {
namespace ops {
namespace {

constexpr const char* kHeader = "# mkernel split memory v1: key<TAB>communication CTAs";

// Holds an exclusive flock on "<path>.lock" for its lifetime.
class FileLock {
 public:
  explicit FileLock(const std::string& path) {
    fd_ = open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      err_ = errno;
      return;
    }
    while (flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        err_ = errno;
        close(fd_);
        fd_ = -1;
        return;
      }
    }
  }
  ~FileLock() {
    if (fd_ >= 0) {
      (void)flock(fd_, LOCK_UN);
      close(fd_);
    }
  }
  bool ok() const { return fd_ >= 0; }
  int err() const { return err_; }

 private:
  int fd_ = -1;
  int err_ = 0;
};

// The file's text, or "" with *exists = false when there is none.
Status read_text(const std::string& path, std::string* text, bool* exists) {
  std::ifstream f(path, std::ios::binary);
  *exists = f.good();
  text->clear();
  if (!*exists) {
    MK_REQUIRE(errno == ENOENT || errno == 0, Code::kSystemError, "split memory: cannot read %s: %s",
               path.c_str(), strerror(errno));
    return OkStatus();
  }
  std::stringstream ss;
  ss << f.rdbuf();
  *text = ss.str();
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
  MK_CHECK(read_text(path, &text, &exists));
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
  FileLock lock(path_);
  MK_REQUIRE(lock.ok(), Code::kSystemError, "split memory: cannot lock %s.lock: %s", path_.c_str(),
             strerror(lock.err()));
  // Merge: the file's entries (other ranks' and processes'), then ours over them.
  std::string text;
  bool exists = false;
  MK_CHECK(read_text(path_, &text, &exists));
  std::map<std::string, int> merged;
  Status ps = parse(text, path_, &merged);
  if (!ps.ok()) {
    MK_WARN(kSubsysTune, "%s: rewriting it", ps.message().c_str());
    merged.clear();
  }
  for (const auto& e : entries_) merged[e.first] = e.second;
  std::random_device rd;
  char suffix[48];
  snprintf(suffix, sizeof(suffix), ".tmp%d.%08x", static_cast<int>(getpid()), rd());
  const std::string tmp = path_ + suffix;
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    MK_REQUIRE(f.good(), Code::kSystemError, "split memory: cannot write %s: %s", tmp.c_str(), strerror(errno));
    f << format(merged);
    f.flush();
    if (!f.good()) {
      const int e = errno;
      unlink(tmp.c_str());
      return make_status(Code::kSystemError, "split memory: writing %s failed: %s", tmp.c_str(), strerror(e));
    }
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
