#include "src/common/fault.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "mkernel/common/log.h"
#include "mkernel/common/check.h"
#include "mkernel/common/tunables.h"

namespace mk {
namespace fault {
namespace {

struct Plant {
  Site site;
  Action action;
  int rank;
  int64_t n;
  std::string text;  // the entry as written
};

struct State {
  std::mutex mu;
  bool loaded = false;
  std::vector<Plant> plants;
  std::map<std::pair<int, int>, int64_t> counts;  // (site, rank) -> events so far
};
State& state() {
  static State s;
  return s;
}
std::atomic<int> g_armed{-1};  // -1 not read yet, 0 nothing planted, 1 planted

bool site_of(const std::string& s, Site* out) {
  if (s == "call") *out = Site::kCall;
  else if (s == "put") *out = Site::kPut;
  else if (s == "completion") *out = Site::kCompletion;
  else if (s == "register") *out = Site::kRegister;
  else return false;
  return true;
}

bool action_of(const std::string& s, Action* out) {
  if (s == "kill") *out = Action::kKill;
  else if (s == "stop") *out = Action::kStop;
  else if (s == "badinput") *out = Action::kBadInput;
  else if (s == "error") *out = Action::kError;
  else return false;
  return true;
}

bool parse_int(const std::string& s, int64_t lo, int64_t* out) {
  if (s.empty() || s.size() > 12) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  *out = strtoll(s.c_str(), nullptr, 10);
  return *out >= lo;
}

Status parse_into(const std::string& spec, std::vector<Plant>* out) {
  size_t pos = 0;
  while (pos <= spec.size() && !spec.empty()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    const std::string e = spec.substr(pos, end - pos);
    pos = end + 1;
    auto bad = [&](const char* why) {
      return make_status(Code::kInvalidArgument,
                         "fault '%s': %s (expected <site>:<action>@<rank>[#<n>], site call|put|completion|register, "
                         "action kill|stop|badinput for call, error for the others)",
                         e.c_str(), why);
    };
    const size_t colon = e.find(':'), at = e.find('@'), hash = e.find('#');
    if (colon == std::string::npos || at == std::string::npos || at < colon) return bad("malformed");
    Plant p;
    p.text = e;
    if (!site_of(e.substr(0, colon), &p.site)) return bad("unknown site");
    if (!action_of(e.substr(colon + 1, at - colon - 1), &p.action)) return bad("unknown action");
    const bool call_action = p.action != Action::kError;
    if (call_action != (p.site == Site::kCall)) return bad("this action does not apply at this site");
    int64_t rank = 0;
    if (!parse_int(e.substr(at + 1, hash == std::string::npos ? std::string::npos : hash - at - 1), 0, &rank) ||
        rank > 1 << 24)
      return bad("the rank is not a number");
    p.rank = static_cast<int>(rank);
    p.n = 1;
    if (hash != std::string::npos && (hash < at || !parse_int(e.substr(hash + 1), 1, &p.n)))
      return bad("the count after # must be a number >= 1");
    out->push_back(p);
    if (end == spec.size()) break;
  }
  return OkStatus();
}

void load_locked(State& s) {
  s.plants.clear();
  s.counts.clear();
  Status st = parse_into(tunables::fault(), &s.plants);
  if (!st.ok()) {
    MK_WARN(kSubsysInit, "%s: nothing planted", st.message().c_str());
    s.plants.clear();
  }
  s.loaded = true;
  g_armed.store(s.plants.empty() ? 0 : 1, std::memory_order_release);
}

}  // namespace

Action at(Site site, int rank) {
  int armed = g_armed.load(std::memory_order_acquire);
  if (armed == 0) return Action::kNone;
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  if (!s.loaded) load_locked(s);
  if (s.plants.empty()) return Action::kNone;
  const int64_t n = ++s.counts[{static_cast<int>(site), rank}];
  for (const Plant& p : s.plants)
    if (p.site == site && p.rank == rank && p.n == n) {
      timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      MK_WARN(kSubsysInit, "rank %d: planted failure '%s' now (MK_FAULT; t=%.3f s monotonic)", rank, p.text.c_str(),
              ts.tv_sec + ts.tv_nsec * 1e-9);
      return p.action;
    }
  return Action::kNone;
}

void carry_out_later(Action a) {
  if (a != Action::kKill && a != Action::kStop) return;
  const int delay_ms = int(tunables::fault_delay_ms());  // a long one: after the call's work
  std::thread([a, delay_ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    kill(getpid(), a == Action::kKill ? SIGKILL : SIGSTOP);
  }).detach();
}

std::string planted(Site site, int rank) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  for (const Plant& p : s.plants)
    if (p.site == site && p.rank == rank) return "planted by MK_FAULT=" + p.text;
  return "planted by MK_FAULT";
}

Status parse(const std::string& spec, std::string* why) {
  std::vector<Plant> p;
  Status s = parse_into(spec, &p);
  if (why) *why = s.ok() ? "" : s.message();
  return s;
}

Status validate() {
  std::string spec;
  MK_CHECK(tunables::get_string("fault", &spec));  // the tunable's rule is parse_into's
  std::vector<Plant> p;
  return parse_into(spec, &p);
}

void reload() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  load_locked(s);
}

}  // namespace fault
}  // namespace mk
