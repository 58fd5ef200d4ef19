#include "mkernel/common/tunables.h"

#include <cerrno>
#include <cstdlib>
#include <map>
#include <mutex>

#include "mkernel/common/log.h"

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

// The table. Add a tunable here, and its typed accessor to MK_TUNABLE_ACCESSORS
// (mkernel/common/tunables.h); code reads it through the accessor.
const std::vector<TunableDef> kTable = {
    {"debug", "MK_DEBUG", TunableType::kString, "WARN",
     "log level: NONE, WARN, INFO or TRACE"},
    {"debug_subsys", "MK_DEBUG_SUBSYS", TunableType::kString, "ALL",
     "comma list of INIT,BOOT,MEM,NET,PROXY,TOPO,SIGNAL,TUNE or ALL; a leading ^ excludes"},
    {"debug_file", "MK_DEBUG_FILE", TunableType::kString, "",
     "log to this file instead of stderr (%h host, %p pid expanded)"},
    {"bootstrap_timeout_ms", "MK_BOOTSTRAP_TIMEOUT_MS", TunableType::kInt, "60000",
     "how long a bootstrap collective waits for every rank before failing with the missing ranks", 1},
    {"failure_grace_ms", "MK_FAILURE_GRACE_MS", TunableType::kInt, "2000",
     "after a failure, how long a rank waits for every peer's failure notice before it names the "
     "ranks that said nothing as the culprits (then it tears down without waiting for anyone)", 0},
    {"ipc_timeout_ms", "MK_IPC_TIMEOUT_MS", TunableType::kInt, "30000",
     "how long a handle exchange over the node-local socket may take", 1},
    {"signal_timeout_ms", "MK_SIGNAL_TIMEOUT_MS", TunableType::kInt, "10000",
     "bound on every device-side wait; on expiry the kernel records who it waited for and traps", 1},
    {"ranks_per_node", "MK_RANKS_PER_NODE", TunableType::kInt, "0",
     "0: nodes from hostnames; k > 0: consecutive groups of k ranks form one (emulated) node"},
    {"device", "MK_DEVICE", TunableType::kInt, "-1",
     "CUDA device of this rank; -1: host-local rank modulo the visible device count", -1},
    {"symmem_mode", "MK_SYMMEM_MODE", TunableType::kString, "auto",
     "peer mapping of symmetric memory: auto (VMM, else cudaIpc), vmm or ipc"},
    {"net_backend", "MK_NET_BACKEND", TunableType::kString, "libfabric",
     "network backend between nodes: libfabric or loopback (ranks as threads of one process)"},
    {"net_provider", "MK_NET_PROVIDER", TunableType::kString, "auto",
     "libfabric provider: auto (efa, verbs;ofi_rxm, tcp;ofi_rxm; shm when all ranks share a host) or a name"},
    {"net_staging", "MK_NET_STAGING", TunableType::kString, "auto",
     "stage GPU windows through pinned host buffers: auto (when the provider lacks FI_HMEM), always, never"},
    {"proxy_ring_slots", "MK_PROXY_RING_SLOTS", TunableType::kInt, "4096",
     "commands the GPU-to-proxy ring holds (a power of two); a full ring back-pressures the GPU", 2},
    {"proxy_max_inflight", "MK_PROXY_MAX_INFLIGHT", TunableType::kInt, "512",
     "puts a proxy keeps posted at once; past it the proxy stops draining the ring", 1},
    {"net_timeout_ms", "MK_NET_TIMEOUT_MS", TunableType::kInt, "30000",
     "how long a proxy waits on a stalled peer (credits, completions) before failing, naming it", 1},
    {"fused_comm_ctas", "MK_FUSED_COMM_CTAS", TunableType::kInt, "8",
     "CTAs of a fused operator's persistent grid that start in the communication role (>= 1 when "
     "the operator communicates; they compute once the communication program is taken)", 1},
    {"fused_route", "MK_FUSED_ROUTE", TunableType::kString, "bulk",
     "how GEMM+RS/AR tiles reach their reducer: bulk (TMA boxes from shared memory: reduce-add, or "
     "store when deterministic) or red (a system-scope reduce-add or store per register pair)"},
    {"fused_split", "MK_FUSED_SPLIT", TunableType::kString, "static",
     "how a fused GEMM collective splits its grid between communication and compute when "
     "FusedOptions::comm_ctas is -1: static (fused_comm_ctas CTAs for the whole call) or auto (an "
     "on-GPU controller moves CTAs between the roles during the call, starting where the last call "
     "with that shape settled)"},
    {"split_memory_file", "MK_SPLIT_MEMORY_FILE", TunableType::kString, "",
     "with fused_split=auto: a text file where each rank keeps, per operator and shape, the split "
     "the controller settled on (read at first use; \"\": kept in memory only)"},
    {"ring_comm_ctas", "MK_RING_COMM_CTAS", TunableType::kInt, "4",
     "CTAs of ring attention's persistent grid that forward K/V blocks (the others compute)", 1},
    {"moe_comm_ctas", "MK_MOE_COMM_CTAS", TunableType::kInt, "16",
     "CTAs that move MoE dispatch/combine records between ranks (each slot travels in pieces, so "
     "several CTAs share one destination)", 1},
    {"fault", "MK_FAULT", TunableType::kString, "",
     "test hook: plant a failure, <site>:<action>@<rank>[#<n>] (call:kill|stop|badinput, "
     "put:error, completion:error, register:error; the rank's n-th such event; docs/testing.md)"},
    {"check_calls", "MK_CHECK_CALLS", TunableType::kInt, "0",
     "debug: every fused operator's run() agrees on its argument checks across ranks (a host "
     "collective per call; 0: run() checks locally only)", 0},
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

}  // namespace

const std::vector<TunableDef>& table() { return kTable; }

std::vector<TunableValue> snapshot() {
  std::vector<TunableValue> out;
  for (const auto& d : kTable) out.push_back(value_of(d));
  return out;
}

Status set(const std::string& name, const std::string& value) {
  const TunableDef* d = find(name);
  if (!d) return make_status(Code::kInvalidArgument, "unknown tunable '%s'", name.c_str());
  int64_t x;
  if (d->type == TunableType::kInt && !parse_int(value, &x))
    return make_status(Code::kInvalidArgument, "tunable %s expects an integer, got '%s'",
                       d->name, value.c_str());
  if (d->type == TunableType::kInt && x < d->min_value)
    return make_status(Code::kInvalidArgument, "tunable %s must be >= %lld, got %lld", d->name,
                       static_cast<long long>(d->min_value), static_cast<long long>(x));
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
  TunableValue v = value_of(*d);
  if (!parse_int(v.value, out))
    return make_status(Code::kInvalidArgument, "tunable %s (from %s) is not an integer: '%s'",
                       d->name, tunable_source_name(v.source), v.value.c_str());
  if (*out < d->min_value)
    return make_status(Code::kInvalidArgument, "tunable %s (from %s) must be >= %lld, got %lld",
                       d->name, tunable_source_name(v.source),
                       static_cast<long long>(d->min_value), static_cast<long long>(*out));
  return OkStatus();
}

Status get_string(const std::string& name, std::string* out) {
  const TunableDef* d = find(name);
  if (!d) return make_status(Code::kInvalidArgument, "unknown tunable '%s'", name.c_str());
  *out = value_of(*d).value;
  return OkStatus();
}

int64_t int_or_default(const std::string& name) {
  int64_t v = 0;
  Status s = get_int(name, &v);
  if (s.ok()) return v;
  MK_WARN(kSubsysTune, "%s; using the default", s.message().c_str());
  const TunableDef* d = find(name);
  return (d && parse_int(d->default_value, &v)) ? v : 0;
}

std::string string_or_default(const std::string& name) {
  std::string v;
  if (get_string(name, &v).ok()) return v;
  return "";
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
