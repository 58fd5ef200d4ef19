#include <cstdio>
#include <deque>
#include <mutex>
#include <string>

#include "mkernel/device/diag.h"

namespace mk {

const char* role_name(Role r) {
  switch (r) {
    case Role::kNone: return "none";
    case Role::kCompute: return "compute";
    case Role::kComm: return "comm";
    case Role::kNetSend: return "net-send";
    case Role::kNetRecv: return "net-recv";
    case Role::kController: return "controller";
    case Role::kTest: return "test";
    case Role::kLoad: return "load";
    case Role::kWait: return "wait";
    case Role::kEpilogue: return "epilogue";
    case Role::kSpin: return "spin";
    case Role::kCta: return "cta";
    case Role::kHost: return "host";
  }
  return "unknown";
}

namespace {
// Registered operator names; a tag is kFirstOperatorTag + index. Entries are never removed, so
// the returned names stay valid.
struct TagRegistry {
  std::mutex mu;
  std::deque<std::string> names;
};
TagRegistry& registry() {
  static TagRegistry* r = new TagRegistry;  // outlives every static destructor that may log
  return *r;
}
}  // namespace

uint32_t op_tag_register(const char* name) {
  TagRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const std::string n = name ? name : "?";
  for (size_t i = 0; i < r.names.size(); ++i)
    if (r.names[i] == n) return kFirstOperatorTag + static_cast<uint32_t>(i);
  r.names.push_back(n);
  return kFirstOperatorTag + static_cast<uint32_t>(r.names.size() - 1);
}

const char* op_tag_name(uint32_t tag) {
  switch (static_cast<OpTag>(tag)) {
    case OpTag::kNone: return "none";
    case OpTag::kSelfCheck: return "selfcheck";
    case OpTag::kSignalTest: return "signal-test";
  }
  if (tag < kFirstOperatorTag) return "unknown";
  TagRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const size_t i = tag - kFirstOperatorTag;
  return i < r.names.size() ? r.names[i].c_str() : "unknown";
}

std::string describe_diag(const DiagRecord& d) {
  char buf[512];
  char peer[32];
  if (d.peer >= 0) snprintf(peer, sizeof(peer), "rank %d", d.peer);
  else snprintf(peer, sizeof(peer), "any rank");
  char what[64];
  if (d.flag_index == kDiagRingSlot) snprintf(what, sizeof(what), "a command-ring slot");
  else snprintf(what, sizeof(what), "flag %d", d.flag_index);
  snprintf(buf, sizeof(buf),
           "rank %d (op %s, role %s, block %d thread %d) %s after %.1f ms (bound %.1f ms) on %s "
           "from %s: expected >= %llu, seen %llu",
           d.rank, op_tag_name(d.op_tag), role_name(static_cast<Role>(d.role)), d.block, d.thread,
           d.reason == kDiagAborted ? "stopped waiting (communicator failed)" : "timed out",
           d.waited_ns / 1e6, d.timeout_ns / 1e6, what, peer,
           static_cast<unsigned long long>(d.expected), static_cast<unsigned long long>(d.seen));
  return buf;
}

}  // namespace mk
