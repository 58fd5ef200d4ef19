// mkernel — logging by level and subsystem.
//   MK_DEBUG=WARN|INFO|TRACE         (default WARN; VERSION prints the version once)
//   MK_DEBUG_SUBSYS=INIT,BOOT,MEM,...  (default ALL; a leading ^ excludes the listed ones)
//   MK_DEBUG_FILE=path               (default stderr; %h host, %p pid are expanded)
#pragma once

#include <cstdint>
#include <string>

#include "mkernel/common/status.h"

namespace mk {

enum class LogLevel : int { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

enum Subsys : uint32_t {
  kSubsysInit = 1u << 0,
  kSubsysBoot = 1u << 1,
  kSubsysMem = 1u << 2,
  kSubsysNet = 1u << 3,
  kSubsysProxy = 1u << 4,
  kSubsysTopo = 1u << 5,
  kSubsysSignal = 1u << 6,
  kSubsysTune = 1u << 7,
  kSubsysAll = 0xffffffffu,
};

bool log_enabled(LogLevel level, uint32_t subsys);
void log_message(LogLevel level, uint32_t subsys, const char* file, int line,
                 const char* fmt, ...) __attribute__((format(printf, 5, 6)));
// Re-reads MK_DEBUG / MK_DEBUG_SUBSYS from the tunables table (after tunables::set()).
void log_reconfigure();
// An MK_DEBUG_SUBSYS value: a comma list of INIT, BOOT, MEM, NET, PROXY, TOPO, SIGNAL, TUNE or
// ALL, optionally led by '^' (all but those); OK, or InvalidArgument naming the unknown entry.
Status log_check_subsys(const std::string& value);
// The rank printed in each line's prefix; -1 until a communicator sets it.
void log_set_rank(int rank);
// For an event another party can repeat at will (a refused connection, a dropped message): is
// its n-th occurrence (from 1) logged? The first kLoggedRepeats, then each power of two; every
// one is still counted by the caller.
constexpr uint64_t kLoggedRepeats = 4;
inline bool log_nth_repeat(uint64_t n) { return n <= kLoggedRepeats || (n & (n - 1)) == 0; }

}  // namespace mk

#define MK_LOG(level, subsys, ...)                                          \
  do {                                                                      \
    if (::mk::log_enabled((level), (subsys)))                               \
      ::mk::log_message((level), (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define MK_WARN(subsys, ...) MK_LOG(::mk::LogLevel::kWarn, ::mk::subsys, __VA_ARGS__)
#define MK_INFO(subsys, ...) MK_LOG(::mk::LogLevel::kInfo, ::mk::subsys, __VA_ARGS__)
#define MK_TRACE(subsys, ...) MK_LOG(::mk::LogLevel::kTrace, ::mk::subsys, __VA_ARGS__)
