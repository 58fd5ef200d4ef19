#include "mkernel/common/log.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "mkernel/common/tunables.h"
#include "src/common/private_file.h"

namespace mk {
namespace {

struct Subsys_ {
  const char* name;
  uint32_t bit;
};
const Subsys_ kSubsys[] = {{"INIT", kSubsysInit},   {"BOOT", kSubsysBoot},
                           {"MEM", kSubsysMem},     {"NET", kSubsysNet},
                           {"PROXY", kSubsysProxy}, {"TOPO", kSubsysTopo},
                           {"SIGNAL", kSubsysSignal}, {"TUNE", kSubsysTune}};

std::atomic<int> g_level{-1};  // -1: not configured yet
std::atomic<uint32_t> g_mask{kSubsysAll};
std::atomic<int> g_rank{-1};
std::mutex g_mu;
FILE* g_file = nullptr;

LogLevel parse_level(const std::string& v) {
  if (v == "NONE") return LogLevel::kNone;
  if (v == "INFO") return LogLevel::kInfo;
  if (v == "TRACE") return LogLevel::kTrace;
  return LogLevel::kWarn;  // WARN, VERSION and anything unknown
}

uint32_t parse_mask(std::string v) {
  if (v.empty() || v == "ALL") return kSubsysAll;
  bool invert = false;
  if (v[0] == '^') {
    invert = true;
    v = v.substr(1);
  }
  uint32_t m = 0;
  size_t pos = 0;
  while (pos <= v.size()) {
    size_t comma = v.find(',', pos);
    std::string tok = v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (tok == "ALL") m = kSubsysAll;
    for (const auto& s : kSubsys)
      if (tok == s.name) m |= s.bit;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return invert ? ~m : m;
}

}  // namespace

Status log_check_subsys(const std::string& value) {
  std::string v = value;
  if (!v.empty() && v[0] == '^') v = v.substr(1);
  if (v.empty()) return OkStatus();
  size_t pos = 0;
  while (true) {
    const size_t comma = v.find(',', pos);
    const std::string tok = v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    bool known = tok == "ALL";
    for (const auto& s : kSubsys) known = known || tok == s.name;
    if (!known)
      return Status(Code::kInvalidArgument, "unknown subsystem '" + tok +
                                                "' (INIT, BOOT, MEM, NET, PROXY, TOPO, SIGNAL, TUNE or ALL)");
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return OkStatus();
}

namespace {

// A logging setting read without the tunables' warning (that warning would log, under g_mu):
// a bad value gives the default, and its error is kept for one line on stderr once unlocked.
std::string g_bad_setting;  // guarded by g_mu
std::string read_setting(const char* name) {
  std::string v;
  const Status s = tunables::get_string(name, &v);
  if (s.ok()) return v;
  if (g_bad_setting.empty()) g_bad_setting = s.message();
  for (const auto& d : tunables::table())
    if (std::string(d.name) == name) return d.default_value;
  return "";
}
// After configure_locked, with g_mu released: the bad setting, once.
void report_bad_setting() {
  std::string msg;
  {
    std::lock_guard<std::mutex> g(g_mu);
    static bool said = false;
    if (g_bad_setting.empty() || said) return;
    said = true;
    msg = g_bad_setting;
  }
  fprintf(stderr, "mkernel WARN %s; logging uses the default\n", msg.c_str());
}

void configure_locked() {
  g_mask.store(parse_mask(read_setting("debug_subsys")));
  std::string file = read_setting("debug_file");
  if (g_file && g_file != stderr) fclose(g_file);
  g_file = stderr;
  if (!file.empty()) {
    std::string path;
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    for (size_t i = 0; i < file.size(); ++i) {
      if (file[i] == '%' && i + 1 < file.size() && file[i + 1] == 'h') {
        path += host;
        ++i;
      } else if (file[i] == '%' && i + 1 < file.size() && file[i + 1] == 'p') {
        path += std::to_string(getpid());
        ++i;
      } else {
        path += file[i];
      }
    }
    // A private file: no symbolic link, a regular file of this user (src/common/private_file.h).
    int fd = -1;
    Status s = open_private_file(path, O_WRONLY | O_APPEND | O_CREAT, "MK_DEBUG_FILE", &fd);
    FILE* f = s.ok() ? fdopen(fd, "a") : nullptr;
    if (f) {
      g_file = f;
    } else {
      if (fd >= 0) close(fd);
      if (g_bad_setting.empty()) g_bad_setting = s.ok() ? "MK_DEBUG_FILE: fdopen failed" : s.message();
    }
  }
  g_level.store(static_cast<int>(parse_level(read_setting("debug"))));
}

const char* subsys_name(uint32_t s) {
  for (const auto& x : kSubsys)
    if (s == x.bit) return x.name;
  return "ALL";
}

}  // namespace

bool log_enabled(LogLevel level, uint32_t subsys) {
  int cur = g_level.load(std::memory_order_relaxed);
  if (cur < 0) {
    {
      std::lock_guard<std::mutex> g(g_mu);
      if (g_level.load() < 0) configure_locked();
      cur = g_level.load();
    }
    report_bad_setting();
  }
  return static_cast<int>(level) <= cur && (g_mask.load(std::memory_order_relaxed) & subsys);
}

void log_reconfigure() {
  {
    std::lock_guard<std::mutex> g(g_mu);
    configure_locked();
  }
  report_bad_setting();
}

void log_set_rank(int rank) { g_rank.store(rank); }

void log_message(LogLevel level, uint32_t subsys, const char* file, int line, const char* fmt,
                 ...) {
  static const char* kLevel[] = {"NONE", "WARN", "INFO", "TRACE"};
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  std::lock_guard<std::mutex> g(g_mu);
  FILE* out = g_file ? g_file : stderr;
  int r = g_rank.load();
  if (r >= 0)
    fprintf(out, "%s:%d:%d mkernel %s %s %s:%d %s\n", host, getpid(), r,
            kLevel[static_cast<int>(level)], subsys_name(subsys), base, line, msg);
  else
    fprintf(out, "%s:%d mkernel %s %s %s:%d %s\n", host, getpid(), kLevel[static_cast<int>(level)],
            subsys_name(subsys), base, line, msg);
  fflush(out);
}

}  // namespace mk
