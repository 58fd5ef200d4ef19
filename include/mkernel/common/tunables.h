// mkernel — the one table of tunables. Each has a name, an env var, a default and a help
// line; the value comes from (lowest to highest precedence) the default, the environment,
// or the API (tunables::set). `mkernel doctor` prints all of them with their source.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/common/status.h"

namespace mk {

enum class TunableType { kInt, kString };
enum class TunableSource { kDefault, kEnv, kApi };
const char* tunable_source_name(TunableSource s);

struct TunableDef {
  const char* name;      // "bootstrap_timeout_ms"
  const char* env;       // "MK_BOOTSTRAP_TIMEOUT_MS"
  TunableType type;
  const char* default_value;
  const char* help;
  int64_t min_value = 0;                    // integers below it are rejected (kInt only)
  int64_t max_value = int64_t(1) << 40;     // integers above it are rejected (kInt only)
  const char* choices = nullptr;            // kString: "a|b|c", the only values accepted (exact
                                            // spelling); nullptr: any string (some checked by
                                            // their own rule: validate())
};

struct TunableValue {
  const TunableDef* def;
  std::string value;
  TunableSource source;
};

namespace tunables {
// The declared table (see src/common/tunables.cc), in declaration order.
const std::vector<TunableDef>& table();
// Current values with their source. The environment is read on every lookup, so a variable
// set before a communicator is created takes effect; an API value wins over both.
std::vector<TunableValue> snapshot();
// Whether `value` is acceptable for the tunable (type, range, choices, its own rule); the error
// names the tunable and its variable and says what is accepted.
Status validate(const TunableDef& def, const std::string& value);
// Every tunable's current value validated: OK, or one InvalidArgument naming each bad one
// ("MK_SIGNAL_TIMEOUT_MS='abc' (env): expects an integer ..."). Communicator::create and
// `mkernel doctor` call it, so a bad setting is one clear error before any work.
Status check_all();
// The table as a Markdown document (docs/tunables.md is this text; a test keeps them equal).
std::string markdown();
// Set by name ("signal_timeout_ms") or env name ("MK_SIGNAL_TIMEOUT_MS"). Validates the value.
Status set(const std::string& name, const std::string& value);
// Drops an API override (the value falls back to env or default).
Status reset(const std::string& name);
// Typed reads; an unknown name or a malformed value is an InvalidArgument status.
Status get_int(const std::string& name, int64_t* out);
Status get_string(const std::string& name, std::string* out);
// Convenience for code paths where the name is a literal from the table: returns the
// default when the value is not valid (and logs one WARN per tunable and value, naming the
// variable), so a bad setting cannot crash a kernel launch.
int64_t int_or_default(const std::string& name);
std::string string_or_default(const std::string& name);

// Typed accessors, one per tunable and named as it: tunables::signal_timeout_ms() is the
// current value of "signal_timeout_ms" (API, else env, else default; a malformed value gives
// the default with a WARN, as int_or_default). Library code reads tunables through these, so
// a misspelled name does not compile. The list: INT_(name) declares `int64_t name()`,
// STRING_(name) `std::string name()`; each name is an entry of the table (a test checks it).
#define MK_TUNABLE_ACCESSORS(INT_, STRING_) \
  STRING_(debug)                             \
  STRING_(debug_subsys)                      \
  STRING_(debug_file)                        \
  INT_(bootstrap_timeout_ms)                 \
  INT_(failure_grace_ms)                     \
  INT_(ipc_timeout_ms)                       \
  INT_(signal_timeout_ms)                    \
  INT_(ranks_per_node)                       \
  INT_(device)                               \
  STRING_(symmem_mode)                       \
  STRING_(net_backend)                       \
  STRING_(net_provider)                      \
  STRING_(net_staging)                       \
  STRING_(net_check_senders)                 \
  INT_(proxy_ring_slots)                     \
  INT_(proxy_max_inflight)                   \
  INT_(net_timeout_ms)                       \
  INT_(fused_comm_ctas)                      \
  STRING_(fused_route)                       \
  STRING_(fused_split)                       \
  STRING_(fused_path)                        \
  STRING_(split_memory_file)                 \
  INT_(ring_comm_ctas)                       \
  INT_(moe_comm_ctas)                        \
  INT_(moe_small_tokens)                     \
  INT_(moe_local_dispatch)                   \
  INT_(moe_fused_layer)                      \
  INT_(pdl)                                  \
  INT_(wait_backoff_ns)                      \
  INT_(check_calls)                          \
  STRING_(fault)                             \
  INT_(fault_delay_ms)
#define MK_TUNABLE_DECLARE_INT_(name_) int64_t name_();
#define MK_TUNABLE_DECLARE_STRING_(name_) std::string name_();
MK_TUNABLE_ACCESSORS(MK_TUNABLE_DECLARE_INT_, MK_TUNABLE_DECLARE_STRING_)
#undef MK_TUNABLE_DECLARE_INT_
#undef MK_TUNABLE_DECLARE_STRING_
}  // namespace tunables

}  // namespace mk
