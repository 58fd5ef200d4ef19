#include "mkernel/common/tunables.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <mutex>

#include "mkernel/common/log.h"
#include "mkernel/common/check.h"
#include "src/common/fault.h"

namespace mk {

const char* tunable_source_name(TunableSource s) {
  switch (s) {
    case TunableSource::kDefault: return "default";
    case TunableSource::kEnv: return "env";
    case TunableSource::kApi: return "api";
  }
  return "?";
}

namespace tunables {
namespace {

constexpr int64_t kHourMs = 3600000;
constexpr int64_t kDayMs = 24 * kHourMs;

// The table. Add a tunable here, and its typed accessor to MK_TUNABLE_ACCESSORS
// (mkernel/common/tunables.h); code reads it through the accessor.
const std::vector<TunableDef> kTable = {
    {"debug", "MK_DEBUG", TunableType::kString, "WARN",
     "log level: NONE, WARN, INFO or TRACE (VERSION: WARN, and the version printed once)", 0, 0,
     "NONE|VERSION|WARN|INFO|TRACE"},
    {"debug_subsys", "MK_DEBUG_SUBSYS", TunableType::kString, "ALL",
     "comma list of INIT,BOOT,MEM,NET,PROXY,TOPO,SIGNAL,TUNE or ALL; a leading ^ excludes"},
    {"debug_file", "MK_DEBUG_FILE", TunableType::kString, "",
     "log to this file instead of stderr (%h host, %p pid expanded)"},
    {"bootstrap_timeout_ms", "MK_BOOTSTRAP_TIMEOUT_MS", TunableType::kInt, "60000",
     "how long a bootstrap collective waits for every rank before failing with the missing ranks", 1, kDayMs},
    {"failure_grace_ms", "MK_FAILURE_GRACE_MS", TunableType::kInt, "2000",
     "after a failure, how long a rank waits for every peer's failure notice before it names the "
     "ranks that said nothing as the culprits (then it tears down without waiting for anyone)", 0, kHourMs},
    {"ipc_timeout_ms", "MK_IPC_TIMEOUT_MS", TunableType::kInt, "30000",
     "how long a handle exchange over the node-local socket may take", 1, kDayMs},
    {"signal_timeout_ms", "MK_SIGNAL_TIMEOUT_MS", TunableType::kInt, "10000",
     "bound on every device-side wait; on expiry the wait records rank, peer, flag and values, "
     "stops the communicator's other waits and gives up without trapping (the call returns the error)",
     1, kDayMs},
    {"ranks_per_node", "MK_RANKS_PER_NODE", TunableType::kInt, "0",
     "0: nodes from hostnames; k > 0: consecutive groups of k ranks form one (emulated) node", 0, 1 << 20},
    {"device", "MK_DEVICE", TunableType::kInt, "-1",
     "CUDA device of this rank; -1: host-local rank modulo the visible device count", -1, 1023},
    {"symmem_mode", "MK_SYMMEM_MODE", TunableType::kString, "auto",
     "peer mapping of symmetric memory: auto (VMM, else cudaIpc), vmm or ipc", 0, 0, "auto|vmm|ipc"},
    {"net_backend", "MK_NET_BACKEND", TunableType::kString, "libfabric",
     "network backend between nodes: libfabric or loopback (ranks as threads of one process)", 0, 0,
     "libfabric|loopback"},
    {"net_provider", "MK_NET_PROVIDER", TunableType::kString, "auto",
     "libfabric provider: auto (efa, verbs;ofi_rxm, tcp;ofi_rxm; shm when all ranks share a host) or a "
     "name (tcp_rxm spells tcp;ofi_rxm; `mkernel doctor` lists the providers of this machine)"},
    {"net_staging", "MK_NET_STAGING", TunableType::kString, "auto",
     "stage GPU windows through pinned host buffers: auto (when the provider lacks FI_HMEM), always, never",
     0, 0, "auto|always|never"},
    {"net_check_senders", "MK_NET_CHECK_SENDERS", TunableType::kString, "auto",
     "drop network arrivals and control messages whose sender is not a rank of the job (FI_SOURCE): auto (on "
     "providers whose sender names were checked against the address vector: tcp;ofi_rxm), on (wherever the "
     "provider offers FI_SOURCE; udp;ofi_rxd and shm misname senders, and the job then fails) or off (memory "
     "keys are then a window's only credential)", 0, 0, "auto|on|off"},
    {"proxy_ring_slots", "MK_PROXY_RING_SLOTS", TunableType::kInt, "4096",
     "commands the GPU-to-proxy ring holds (a power of two); a full ring back-pressures the GPU", 2, 1 << 24},
    {"proxy_max_inflight", "MK_PROXY_MAX_INFLIGHT", TunableType::kInt, "512",
     "puts a proxy keeps posted at once; past it the proxy stops draining the ring", 1, 1 << 16},
    {"net_timeout_ms", "MK_NET_TIMEOUT_MS", TunableType::kInt, "30000",
     "how long a proxy waits on a stalled peer (credits, completions) before failing, naming it", 1, kDayMs},
    {"fused_comm_ctas", "MK_FUSED_COMM_CTAS", TunableType::kInt, "8",
     "CTAs of a fused operator's persistent grid that start in the communication role (>= 1 when "
     "the operator communicates; they compute once the communication program is taken)", 1, 1024},
    {"fused_route", "MK_FUSED_ROUTE", TunableType::kString, "bulk",
     "how GEMM+RS/AR tiles reach their reducer: bulk (TMA boxes from shared memory: reduce-add, or "
     "store when deterministic) or red (a system-scope reduce-add or store per register pair)", 0, 0,
     "bulk|red"},
    {"fused_split", "MK_FUSED_SPLIT", TunableType::kString, "static",
     "how a fused GEMM collective splits its grid between communication and compute when "
     "FusedOptions::comm_ctas is -1: static (fused_comm_ctas CTAs for the whole call) or auto (an "
     "on-GPU controller moves CTAs between the roles during the call, starting where the last call "
     "with that shape settled)", 0, 0, "static|auto"},
    {"fused_path", "MK_FUSED_PATH", TunableType::kString, "fused",
     "how a fused GEMM collective runs when FusedOptions::path is empty: fused (one persistent "
     "kernel), unfused (the GEMM, then the standalone collective) or auto (both timed on the first "
     "calls, then the faster for good, decided by all ranks together and remembered in "
     "split_memory_file)", 0, 0, "fused|unfused|auto"},
    {"split_memory_file", "MK_SPLIT_MEMORY_FILE", TunableType::kString, "",
     "with fused_split=auto or fused_path=auto: a text file where each rank keeps, per operator and "
     "shape, the split the controller settled on and the path auto chose (read at first use; \"\": kept in memory only)"},
    {"ring_comm_ctas", "MK_RING_COMM_CTAS", TunableType::kInt, "4",
     "CTAs of ring attention's persistent grid that forward K/V blocks (the others compute)", 1, 1024},
    {"moe_comm_ctas", "MK_MOE_COMM_CTAS", TunableType::kInt, "16",
     "CTAs that move MoE dispatch/combine records between ranks (each slot travels in pieces, so "
     "several CTAs share one destination)", 1, 1024},
    {"moe_small_tokens", "MK_MOE_SMALL_TOKENS", TunableType::kInt, "256",
     "MoE dispatch in direct mode with max_tokens_per_rank at most this: route and pack in one "
     "launch and layout and unpack in one (each CTA counts the entries before its token: work "
     "grows with the square of the tokens; 0: never)", 0, 4096},
    {"moe_local_dispatch", "MK_MOE_LOCAL_DISPATCH", TunableType::kInt, "2",
     "MoE dispatch on one rank (W = 1): each token's row copied straight to its experts' rows, no "
     "send record — 2: every batch (small ones in one launch, larger ones by route, scan, "
     "scatter); 1: small batches only; 0: the record path of W > 1", 0, 2},
    {"moe_fused_layer", "MK_MOE_FUSED_LAYER", TunableType::kInt, "0",
     "MoE layer: 1 runs each call as route and pack, then one persistent kernel whose CTAs take the "
     "dispatch and combine ops, the layout, unpack, both grouped GEMMs' tiles and the weighted sums "
     "as each is ready (docs/moe.md); 0: dispatch, the two GEMMs and combine as separate launches. "
     "Read when a layer is created; not for the hierarchical mode (falls back to the launches)", 0, 1},
    {"pdl", "MK_PDL", TunableType::kInt, "1",
     "MoE dispatch/combine kernels that follow another kernel of the same call are launched early "
     "(programmatic dependent launch): set up while the kernel before finishes, they wait for it "
     "at their start (0: plain launches)", 0, 1},
    {"wait_backoff_ns", "MK_WAIT_BACKOFF_NS", TunableType::kInt, "0",
     "device-side waits on a flag sleep between polls, doubling from 32 ns up to this many ns "
     "(0: poll back to back; -1: 1000 where another rank shares this rank's GPU, as under MPS, "
     "else 0 — not the default: it made the ring backward's rare first-call timeout in the "
     "matrix's 6x1 tcp launch more frequent, docs/attention.md); read when an operator is created",
     -1, 1000000},
    {"fault", "MK_FAULT", TunableType::kString, "",
     "test hook: plant a failure, <site>:<action>@<rank>[#<n>] (call:kill|stop|badinput, "
     "put:error, completion:error, register:error; the rank's n-th such event; docs/testing.md)"},
    {"check_calls", "MK_CHECK_CALLS", TunableType::kInt, "0",
     "debug: every fused operator's run() agrees on its argument checks across ranks (a host "
     "collective per call; 0: run() checks locally only)", 0, 1},
    {"fault_delay_ms", "MK_FAULT_DELAY_MS", TunableType::kInt, "1",
     "test hook: how long after the planted call a kill or stop happens (a long delay lets the call "
     "finish: a rank that dies or stops between calls)", 0, 600000},
};

struct State {
  std::mutex mu;
  std::map<std::string, std::string> api;  // overrides set through the API
};
State& state() {
  static State s;
  return s;
}

const TunableDef* find(const std::string& name) {
  for (const auto& d : kTable)
    if (name == d.name || name == d.env) return &d;
  return nullptr;
}

bool parse_int(const std::string& v, int64_t* out) {
  if (v.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long x = strtoll(v.c_str(), &end, 10);  // base 10: "010" is ten, not eight
  if (errno != 0 || *end != '\0') return false;
  *out = x;
  return true;
}

TunableValue value_of(const TunableDef& d) {
  {
    std::lock_guard<std::mutex> g(state().mu);
    auto it = state().api.find(d.name);
    if (it != state().api.end()) return {&d, it->second, TunableSource::kApi};
  }
  if (const char* e = getenv(d.env)) return {&d, e, TunableSource::kEnv};
  return {&d, d.default_value, TunableSource::kDefault};
}

std::vector<std::string> split_choices(const char* c) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = c; *p; ++p) {
    if (*p == '|') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *p;
    }
  }
  out.push_back(cur);
  return out;
}

// The tunable's own rule, for strings without a fixed list: "" when fine, else the reason.
std::string rule_error(const TunableDef& d, const std::string& v) {
  const std::string name = d.name;
  if (name == "debug_subsys") {
    const Status s = log_check_subsys(v);
    return s.ok() ? "" : s.message();
  }
  if (name == "fault") {
    std::string why;
    return fault::parse(v, &why).ok() ? "" : why;
  }
  if (name == "net_provider") {
    if (v.empty()) return "expects auto or a libfabric provider name, got an empty value";
    for (char c : v)
      if (!(isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ';' || c == '-' || c == '.'))
        return "expects auto or a libfabric provider name (letters, digits, '_', ';'), got '" + v + "'";
  }
  return "";
}

// One WARN per tunable and bad value (a value read in a loop warns once).
void warn_once(const TunableDef& d, const TunableValue& v, const Status& why) {
  static std::mutex mu;
  static std::set<std::string> warned;
  {
    std::lock_guard<std::mutex> g(mu);
    if (!warned.insert(std::string(d.name) + "=" + v.value).second) return;
  }
  MK_WARN(kSubsysTune, "%s; using the default %s", why.message().c_str(),
          d.default_value[0] ? d.default_value : "\"\"");
}

}  // namespace

const std::vector<TunableDef>& table() { return kTable; }

std::vector<TunableValue> snapshot() {
  std::vector<TunableValue> out;
  for (const auto& d : kTable) out.push_back(value_of(d));
  return out;
}

Status validate(const TunableDef& d, const std::string& value) {
  auto bad = [&](const std::string& what) {
    return Status(Code::kInvalidArgument, std::string(d.env) + "='" + value + "': " + what);
  };
  if (d.type == TunableType::kInt) {
    int64_t x = 0;
    if (!parse_int(value, &x)) return bad("expects an integer (decimal)");
    if (x < d.min_value || x > d.max_value)
      return bad("out of range: expects " + std::to_string(d.min_value) + " to " + std::to_string(d.max_value));
    return OkStatus();
  }
  if (d.choices) {
    for (const std::string& c : split_choices(d.choices))
      if (value == c) return OkStatus();
    std::string list = d.choices;
    for (auto& ch : list)
      if (ch == '|') ch = ',';
    return bad("expects one of " + list);
  }
  const std::string why = rule_error(d, value);
  return why.empty() ? OkStatus() : bad(why);
}

Status check_all() {
  std::string msg;
  int n = 0;
  for (const auto& d : kTable) {
    const TunableValue v = value_of(d);
    const Status s = validate(d, v.value);
    if (s.ok()) continue;
    msg += (n++ ? "; " : "") + s.message() + " (from " + tunable_source_name(v.source) + ")";
  }
  if (n == 0) return OkStatus();
  return Status(Code::kInvalidArgument, std::string(n == 1 ? "a bad setting: " : "bad settings: ") + msg +
                                            " (`mkernel doctor` lists every setting, docs/tunables.md what each accepts)");
}

std::string markdown() {
  std::ostringstream o;
  o << "# Tunables\n\n"
       "Every setting of mkernel, from its one table (`src/common/tunables.cc`; this page is generated from\n"
       "it by `mkernel doctor --tunables-md`, and a test keeps the two equal). Each is read from the\n"
       "environment variable (`MK_<NAME>`) or set from code with `mk::tunables::set(\"name\", \"value\")`,\n"
       "which wins over the environment; `mkernel doctor` prints each current value and its source.\n"
       "A value outside what the setting accepts is an error naming the variable: `Communicator::create`\n"
       "and `mkernel doctor` report it before any work (a library path that reads the setting later\n"
       "uses the default and warns once).\n\n"
       "| variable | name | default | accepts | what it does |\n"
       "| --- | --- | --- | --- | --- |\n";
  for (const auto& d : kTable) {
    std::string accepts;
    if (d.type == TunableType::kInt) {
      accepts = "integer " + std::to_string(d.min_value) + " to " + std::to_string(d.max_value);
    } else if (d.choices) {
      for (const std::string& c : split_choices(d.choices)) accepts += (accepts.empty() ? "`" : ", `") + c + "`";
    } else {
      const std::string n = d.name;
      accepts = n == "debug_subsys" ? "comma list (leading `^` excludes)"
                : n == "fault"      ? "`<site>:<action>@<rank>[#<n>]`, comma list"
                : n == "net_provider" ? "`auto` or a provider name"
                                      : "any text";
    }
    std::string help = d.help;
    std::string esc;
    for (char c : help) esc += c == '|' ? std::string("\\|") : std::string(1, c);
    o << "| `" << d.env << "` | `" << d.name << "` | " << (d.default_value[0] ? "`" + std::string(d.default_value) + "`" : "\"\"")
      << " | " << accepts << " | " << esc << " |\n";
  }
  return o.str();
}

Status set(const std::string& name, const std::string& value) {
  const TunableDef* d = find(name);
  if (!d) return make_status(Code::kInvalidArgument, "unknown tunable '%s'", name.c_str());
  MK_CHECK(validate(*d, value));
  {
    std::lock_guard<std::mutex> g(state().mu);
    state().api[d->name] = value;
  }
  if (std::string(d->name).rfind("debug", 0) == 0) log_reconfigure();
  return OkStatus();
}

Status reset(const std::string& name) {
  const TunableDef* d = find(name);
  if (!d) return make_status(Code::kInvalidArgument, "unknown tunable '%s'", name.c_str());
  {
    std::lock_guard<std::mutex> g(state().mu);
    state().api.erase(d->name);
  }
  if (std::string(d->name).rfind("debug", 0) == 0) log_reconfigure();
  return OkStatus();
}

Status get_int(const std::string& name, int64_t* out) {
  const TunableDef* d = find(name);
  if (!d) return make_status(Code::kInvalidArgument, "unknown tunable '%s'", name.c_str());
  if (d->type != TunableType::kInt)
    return make_status(Code::kInvalidArgument, "tunable %s is not an integer", d->name);
  const TunableValue v = value_of(*d);
  const Status s = validate(*d, v.value);
  if (!s.ok()) return Status(s.code(), s.message() + " (from " + tunable_source_name(v.source) + ")");
  parse_int(v.value, out);
  return OkStatus();
}

Status get_string(const std::string& name, std::string* out) {
  const TunableDef* d = find(name);
  if (!d) return make_status(Code::kInvalidArgument, "unknown tunable '%s'", name.c_str());
  const TunableValue v = value_of(*d);
  const Status s = validate(*d, v.value);
  if (!s.ok()) return Status(s.code(), s.message() + " (from " + tunable_source_name(v.source) + ")");
  *out = v.value;
  return OkStatus();
}

int64_t int_or_default(const std::string& name) {
  int64_t v = 0;
  const Status s = get_int(name, &v);
  if (s.ok()) return v;
  const TunableDef* d = find(name);
  if (!d) {
    MK_WARN(kSubsysTune, "%s", s.message().c_str());
    return 0;
  }
  warn_once(*d, value_of(*d), s);
  return parse_int(d->default_value, &v) ? v : 0;
}

std::string string_or_default(const std::string& name) {
  std::string v;
  const Status s = get_string(name, &v);
  if (s.ok()) return v;
  const TunableDef* d = find(name);
  if (!d) return "";
  warn_once(*d, value_of(*d), s);
  return d->default_value;
}

// The typed accessors: each reads the table entry of its own name (the name is the function's,
// spelled once in MK_TUNABLE_ACCESSORS).
#define MK_TUNABLE_DEFINE_INT_(name_) \
  int64_t name_() { return int_or_default(#name_); }
#define MK_TUNABLE_DEFINE_STRING_(name_) \
  std::string name_() { return string_or_default(#name_); }
MK_TUNABLE_ACCESSORS(MK_TUNABLE_DEFINE_INT_, MK_TUNABLE_DEFINE_STRING_)
#undef MK_TUNABLE_DEFINE_INT_
#undef MK_TUNABLE_DEFINE_STRING_

}  // namespace tunables
}  // namespace mk
