// CPU tests of mkernel/common: Status, the check macros, the tunables table and logging.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>

#include "mkernel/common/check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/status.h"
#include "mkernel/common/tunables.h"
#include "src/common/deadline.h"
#include "src/common/fault.h"
#include "tests/common/test_util.h"

namespace mk {
namespace {

// A random printable token so the strings checked below differ on every run.
std::string random_token(std::mt19937_64& rng, size_t n) {
  static const char kAlpha[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += kAlpha[rng() % (sizeof(kAlpha) - 1)];
  return s;
}

// Saves an environment variable, unsets it, and restores it on scope exit.
class EnvGuard {
 public:
  explicit EnvGuard(const char* name) : name_(name) {
    if (const char* v = getenv(name)) {
      had_ = true;
      old_ = v;
    }
    unsetenv(name);
  }
  ~EnvGuard() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

// Resets a tunable's API override on scope exit (even when an assertion returns early).
class TunableGuard {
 public:
  explicit TunableGuard(std::string name) : name_(std::move(name)) {}
  ~TunableGuard() { (void)tunables::reset(name_); }

 private:
  std::string name_;
};

const TunableValue* find_value(const std::vector<TunableValue>& snap, const std::string& name) {
  for (const auto& v : snap)
    if (name == v.def->name) return &v;
  return nullptr;
}

// ---------------------------------------------------------------------------------------
// Status

TEST(Status, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), Code::kOk);
  EXPECT_TRUE(s.message().empty());
  EXPECT_EQ(s.to_string(), "ok");
  EXPECT_TRUE(OkStatus().ok());
  EXPECT_TRUE(Status::ok_status().ok());
}

TEST(Status, CodeNamesAreDistinctAndKnown) {
  std::set<std::string> names;
  for (int c = 0; c <= static_cast<int>(Code::kInternal); ++c) {
    std::string n = code_name(static_cast<Code>(c));
    EXPECT_FALSE(n.empty()) << "code " << c;
    EXPECT_NE(n, "unknown") << "code " << c;
    EXPECT_TRUE(names.insert(n).second) << "duplicate name '" << n << "' for code " << c;
  }
  EXPECT_EQ(std::string(code_name(Code::kOk)), "ok");
  EXPECT_EQ(std::string(code_name(Code::kTimeout)), "timeout");
  EXPECT_EQ(std::string(code_name(static_cast<Code>(9999))), "unknown");
}

TEST(Status, CarriesCodeAndMessage) {
  std::mt19937_64 rng(test::test_seed());
  for (int c = 1; c <= static_cast<int>(Code::kInternal); ++c) {
    std::string msg = random_token(rng, 1 + rng() % 40);
    Status s(static_cast<Code>(c), msg);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(static_cast<int>(s.code()), c);
    EXPECT_EQ(s.message(), msg);
    EXPECT_EQ(s.to_string(), std::string(code_name(static_cast<Code>(c))) + ": " + msg);
  }
  // An error without a message prints just the code name.
  Status bare(Code::kInternal, "");
  EXPECT_FALSE(bare.ok());
  EXPECT_EQ(bare.to_string(), code_name(Code::kInternal));
}

TEST(Status, MakeStatusFormats) {
  std::mt19937_64 rng(test::test_seed() ^ 0x51);
  int a = static_cast<int>(rng() % 100000);
  std::string word = random_token(rng, 12);
  Status s = make_status(Code::kMismatch, "rank %d says %s (%zu)", a, word.c_str(), word.size());
  EXPECT_EQ(s.code(), Code::kMismatch);
  EXPECT_EQ(s.message(), "rank " + std::to_string(a) + " says " + word + " (12)");
  EXPECT_EQ(s.to_string(), "mismatch across ranks: " + s.message());

  // Long messages are truncated, not overflowed.
  std::string big(5000, 'x');
  Status t = make_status(Code::kInternal, "%s", big.c_str());
  EXPECT_FALSE(t.ok());
  EXPECT_GT(t.message().size(), 1000u);
  EXPECT_LE(t.message().size(), big.size());
}

// ---------------------------------------------------------------------------------------
// MK_CHECK / MK_REQUIRE

int g_after_check = 0;

Status maybe_fail(bool fail, Code code, const std::string& msg) {
  if (fail) return Status(code, msg);
  return OkStatus();
}

Status uses_check(bool fail, Code code, const std::string& msg) {
  MK_CHECK(maybe_fail(fail, code, msg));
  ++g_after_check;  // reached only when the check passed
  return OkStatus();
}

Status uses_require(int x, int limit) {
  MK_REQUIRE(x < limit, Code::kInvalidArgument, "x=%d must be below %d", x, limit);
  return OkStatus();
}

Status uses_require_code(bool cond) {
  MK_REQUIRE(cond, Code::kNotSupported, "feature %s missing", "frob");
  return OkStatus();
}

TEST(CheckMacros, CheckPropagatesFailureUnchanged) {
  std::mt19937_64 rng(test::test_seed() ^ 0xC4EC);
  for (int c = 1; c <= static_cast<int>(Code::kInternal); ++c) {
    std::string msg = random_token(rng, 20);
    g_after_check = 0;
    Status s = uses_check(true, static_cast<Code>(c), msg);
    EXPECT_EQ(static_cast<int>(s.code()), c);
    EXPECT_EQ(s.message(), msg);
    EXPECT_EQ(g_after_check, 0) << "MK_CHECK did not return on failure";
  }
  g_after_check = 0;
  MK_EXPECT_OK(uses_check(false, Code::kInternal, "unused"));
  EXPECT_EQ(g_after_check, 1) << "MK_CHECK returned although the status was ok";
}

TEST(CheckMacros, RequireReturnsFormattedStatus) {
  std::mt19937_64 rng(test::test_seed() ^ 0x4E9);
  int limit = 10 + static_cast<int>(rng() % 1000);
  MK_EXPECT_OK(uses_require(limit - 1, limit));
  Status s = uses_require(limit + 3, limit);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(s.message(), "x=" + std::to_string(limit + 3) + " must be below " + std::to_string(limit));

  MK_EXPECT_OK(uses_require_code(true));
  Status t = uses_require_code(false);
  EXPECT_EQ(t.code(), Code::kNotSupported);
  EXPECT_EQ(t.message(), "feature frob missing");
}

// ---------------------------------------------------------------------------------------
// Tunables

TEST(Tunables, TableIsWellFormed) {
  const auto& table = tunables::table();
  ASSERT_FALSE(table.empty());
  std::set<std::string> names, envs;
  for (const auto& d : table) {
    ASSERT_NE(d.name, nullptr);
    ASSERT_NE(d.env, nullptr);
    ASSERT_NE(d.default_value, nullptr);
    ASSERT_NE(d.help, nullptr);
    EXPECT_FALSE(std::string(d.name).empty());
    EXPECT_EQ(std::string(d.env).rfind("MK_", 0), 0u) << d.env;
    EXPECT_FALSE(std::string(d.help).empty()) << d.name;
    EXPECT_TRUE(names.insert(d.name).second) << "duplicate name " << d.name;
    EXPECT_TRUE(envs.insert(d.env).second) << "duplicate env name " << d.env;
    if (d.type == TunableType::kInt) {
      std::string v = d.default_value;
      ASSERT_FALSE(v.empty()) << d.name;
      size_t used = 0;
      long long x = 0;
      EXPECT_NO_THROW(x = std::stoll(v, &used, 10)) << d.name << " default '" << v << "'";
      EXPECT_EQ(used, v.size()) << d.name << " default '" << v << "' does not parse fully";
      (void)x;
    }
  }
  // A name is never also another tunable's env name.
  for (const auto& n : names) EXPECT_EQ(envs.count(n), 0u) << n;
}

TEST(Tunables, DefaultsReadBackWithDefaultSource) {
  for (const auto& d : tunables::table()) {
    EnvGuard env(d.env);
    TunableGuard guard(d.name);
    MK_ASSERT_OK(tunables::reset(d.name));
    auto snap = tunables::snapshot();
    ASSERT_EQ(snap.size(), tunables::table().size());
    const TunableValue* v = find_value(snap, d.name);
    ASSERT_NE(v, nullptr) << d.name;
    EXPECT_EQ(v->source, TunableSource::kDefault) << d.name;
    EXPECT_EQ(v->value, d.default_value) << d.name;
    if (d.type == TunableType::kInt) {
      int64_t x = 12345678;
      MK_EXPECT_OK(tunables::get_int(d.name, &x));
      EXPECT_EQ(x, std::stoll(d.default_value)) << d.name;
      EXPECT_EQ(tunables::int_or_default(d.name), std::stoll(d.default_value)) << d.name;
      std::string s;
      MK_EXPECT_OK(tunables::get_string(d.name, &s));
      EXPECT_EQ(s, d.default_value);
    } else {
      std::string s = "garbage";
      MK_EXPECT_OK(tunables::get_string(d.name, &s));
      EXPECT_EQ(s, d.default_value) << d.name;
      EXPECT_EQ(tunables::string_or_default(d.name), d.default_value);
      int64_t x;
      EXPECT_EQ(tunables::get_int(d.name, &x).code(), Code::kInvalidArgument)
          << "get_int on string tunable " << d.name;
    }
  }
  EXPECT_EQ(std::string(tunable_source_name(TunableSource::kDefault)), "default");
  EXPECT_EQ(std::string(tunable_source_name(TunableSource::kEnv)), "env");
  EXPECT_EQ(std::string(tunable_source_name(TunableSource::kApi)), "api");
}

TEST(Tunables, EnvOverridesDefaultAndApiOverridesEnv) {
  std::mt19937_64 rng(test::test_seed() ^ 0xE17);
  EnvGuard env("MK_RANKS_PER_NODE");
  TunableGuard guard("ranks_per_node");
  MK_ASSERT_OK(tunables::reset("ranks_per_node"));

  const int64_t from_env = 2 + static_cast<int64_t>(rng() % 50);
  const int64_t from_api = from_env + 1 + static_cast<int64_t>(rng() % 50);
  ASSERT_EQ(setenv("MK_RANKS_PER_NODE", std::to_string(from_env).c_str(), 1), 0);

  int64_t x = -1;
  MK_ASSERT_OK(tunables::get_int("ranks_per_node", &x));
  EXPECT_EQ(x, from_env);
  const TunableValue* v;
  auto snap = tunables::snapshot();
  v = find_value(snap, "ranks_per_node");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->source, TunableSource::kEnv);
  EXPECT_EQ(v->value, std::to_string(from_env));

  // The API wins over the environment.
  MK_ASSERT_OK(tunables::set("ranks_per_node", std::to_string(from_api)));
  MK_ASSERT_OK(tunables::get_int("ranks_per_node", &x));
  EXPECT_EQ(x, from_api);
  snap = tunables::snapshot();
  v = find_value(snap, "ranks_per_node");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->source, TunableSource::kApi);
  EXPECT_EQ(v->value, std::to_string(from_api));

  // reset drops the API value: back to the environment ...
  MK_ASSERT_OK(tunables::reset("ranks_per_node"));
  MK_ASSERT_OK(tunables::get_int("ranks_per_node", &x));
  EXPECT_EQ(x, from_env);
  snap = tunables::snapshot();
  EXPECT_EQ(find_value(snap, "ranks_per_node")->source, TunableSource::kEnv);

  // ... and without the environment, back to the default.
  unsetenv("MK_RANKS_PER_NODE");
  MK_ASSERT_OK(tunables::get_int("ranks_per_node", &x));
  EXPECT_EQ(x, 0);
  snap = tunables::snapshot();
  EXPECT_EQ(find_value(snap, "ranks_per_node")->source, TunableSource::kDefault);

  // reset is idempotent.
  MK_EXPECT_OK(tunables::reset("ranks_per_node"));
}

TEST(Tunables, SetByEnvNameAndStrings) {
  std::mt19937_64 rng(test::test_seed() ^ 0x5E7);
  EnvGuard env1("MK_SIGNAL_TIMEOUT_MS");
  EnvGuard env2("MK_SYMMEM_MODE");
  TunableGuard g1("signal_timeout_ms");
  TunableGuard g2("symmem_mode");

  const int64_t val = 1 + static_cast<int64_t>(rng() % 1000000);
  MK_ASSERT_OK(tunables::set("MK_SIGNAL_TIMEOUT_MS", std::to_string(val)));
  int64_t x = 0;
  MK_ASSERT_OK(tunables::get_int("signal_timeout_ms", &x));
  EXPECT_EQ(x, val);
  MK_ASSERT_OK(tunables::get_int("MK_SIGNAL_TIMEOUT_MS", &x));  // reads by env name too
  EXPECT_EQ(x, val);
  EXPECT_EQ(tunables::int_or_default("signal_timeout_ms"), val);
  auto snap = tunables::snapshot();
  EXPECT_EQ(find_value(snap, "signal_timeout_ms")->source, TunableSource::kApi);
  // reset by env name as well.
  MK_ASSERT_OK(tunables::reset("MK_SIGNAL_TIMEOUT_MS"));
  MK_ASSERT_OK(tunables::get_int("signal_timeout_ms", &x));
  EXPECT_EQ(x, 10000);

  // A free-text string takes any text; a fixed list only its own words.
  EnvGuard env3("MK_SPLIT_MEMORY_FILE");
  TunableGuard g3("split_memory_file");
  const std::string word = random_token(rng, 16);
  MK_ASSERT_OK(tunables::set("split_memory_file", word));
  std::string s;
  MK_ASSERT_OK(tunables::get_string("split_memory_file", &s));
  EXPECT_EQ(s, word);
  EXPECT_EQ(tunables::string_or_default("split_memory_file"), word);
  EXPECT_EQ(tunables::set("symmem_mode", word).code(), Code::kInvalidArgument);
  MK_ASSERT_OK(tunables::set("MK_SYMMEM_MODE", "ipc"));
  EXPECT_EQ(tunables::string_or_default("symmem_mode"), "ipc");
}

// Each typed accessor reads the table entry of its name and type: the default with nothing
// set, the API value once set. Every entry has one (but the ones listed in `untyped`).
TEST(Tunables, TypedAccessorsReadTheirEntry) {
  std::mt19937_64 rng(test::test_seed() ^ 0x7E9);
  std::set<std::string> typed;
  auto entry = [](const char* name) -> const TunableDef* {
    for (const auto& d : tunables::table())
      if (std::string(d.name) == name) return &d;
    return nullptr;
  };
  auto check_int = [&](const char* name, int64_t (*read)()) {
    SCOPED_TRACE(name);
    typed.insert(name);
    const TunableDef* d = entry(name);
    ASSERT_NE(d, nullptr) << "accessor without a table entry";
    ASSERT_EQ(d->type, TunableType::kInt);
    EnvGuard env(d->env);
    TunableGuard guard(name);
    MK_ASSERT_OK(tunables::reset(name));
    EXPECT_EQ(read(), std::stoll(d->default_value));
    const int64_t span = std::min<int64_t>(d->max_value - d->min_value, 100000);
    const int64_t v = d->min_value + static_cast<int64_t>(rng() % uint64_t(span + 1));
    MK_ASSERT_OK(tunables::set(name, std::to_string(v)));
    EXPECT_EQ(read(), v);
  };
  auto check_string = [&](const char* name, std::string (*read)()) {
    SCOPED_TRACE(name);
    typed.insert(name);
    const TunableDef* d = entry(name);
    ASSERT_NE(d, nullptr) << "accessor without a table entry";
    ASSERT_EQ(d->type, TunableType::kString);
    EnvGuard env(d->env);
    TunableGuard guard(name);
    MK_ASSERT_OK(tunables::reset(name));
    EXPECT_EQ(read(), d->default_value);
    if (std::string(name).rfind("debug", 0) == 0) return;  // would reconfigure the log
    // A value it accepts: one of its words, one its rule accepts, or any text.
    std::string v = random_token(rng, 12);
    if (d->choices) {
      std::vector<std::string> words;
      std::string cur;
      for (const char* c = d->choices;; ++c) {
        if (*c == '|' || !*c) {
          words.push_back(cur);
          cur.clear();
          if (!*c) break;
        } else {
          cur += *c;
        }
      }
      v = words[rng() % words.size()];
    } else if (std::string(name) == "fault") {
      v = "put:error@" + std::to_string(1000 + rng() % 1000);  // a rank no test world has
    } else if (std::string(name) == "net_provider") {
      v = "tcp_rxm";
    }
    MK_ASSERT_OK(tunables::set(name, v));
    EXPECT_EQ(read(), v);
  };
#define MK_CHECK_INT_(name_) check_int(#name_, &tunables::name_);
#define MK_CHECK_STRING_(name_) check_string(#name_, &tunables::name_);
  MK_TUNABLE_ACCESSORS(MK_CHECK_INT_, MK_CHECK_STRING_)
#undef MK_CHECK_INT_
#undef MK_CHECK_STRING_
  for (const auto& d : tunables::table()) EXPECT_TRUE(typed.count(d.name)) << d.name << " has no typed accessor";
}

TEST(Tunables, BadInputsAreInvalidArgument) {
  EnvGuard env("MK_BOOTSTRAP_TIMEOUT_MS");
  TunableGuard guard("bootstrap_timeout_ms");
  MK_ASSERT_OK(tunables::reset("bootstrap_timeout_ms"));

  for (const char* bad : {"", "abc", "12abc", "1.5", "99999999999999999999999"}) {
    Status s = tunables::set("bootstrap_timeout_ms", bad);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << "value '" << bad << "': " << s.to_string();
  }
  // A rejected set leaves the value untouched.
  int64_t x = 0;
  MK_ASSERT_OK(tunables::get_int("bootstrap_timeout_ms", &x));
  EXPECT_EQ(x, 60000);
  EXPECT_EQ(find_value(tunables::snapshot(), "bootstrap_timeout_ms")->source,
            TunableSource::kDefault);

  std::string s;
  EXPECT_EQ(tunables::set("no_such_tunable", "1").code(), Code::kInvalidArgument);
  EXPECT_EQ(tunables::reset("no_such_tunable").code(), Code::kInvalidArgument);
  EXPECT_EQ(tunables::get_int("no_such_tunable", &x).code(), Code::kInvalidArgument);
  EXPECT_EQ(tunables::get_string("no_such_tunable", &s).code(), Code::kInvalidArgument);
  EXPECT_EQ(tunables::set("MK_NO_SUCH", "1").code(), Code::kInvalidArgument);
  Status u = tunables::set("no_such_tunable", "1");
  EXPECT_NE(u.message().find("no_such_tunable"), std::string::npos) << u.message();

  // A malformed environment value is an error for get_int and the default for int_or_default.
  ASSERT_EQ(setenv("MK_BOOTSTRAP_TIMEOUT_MS", "soon", 1), 0);
  Status e = tunables::get_int("bootstrap_timeout_ms", &x);
  EXPECT_EQ(e.code(), Code::kInvalidArgument);
  EXPECT_NE(e.message().find("soon"), std::string::npos) << e.message();
  EXPECT_EQ(tunables::int_or_default("bootstrap_timeout_ms"), 60000);
  // Base 10 (a leading zero is not octal) and per-tunable minimums.
  MK_ASSERT_OK(tunables::set("bootstrap_timeout_ms", "010"));
  MK_ASSERT_OK(tunables::get_int("bootstrap_timeout_ms", &x));
  EXPECT_EQ(x, 10);
  EXPECT_EQ(tunables::set("bootstrap_timeout_ms", "0x10").code(), Code::kInvalidArgument);
  EXPECT_EQ(tunables::set("bootstrap_timeout_ms", "-5").code(), Code::kInvalidArgument);
  EXPECT_EQ(tunables::set("signal_timeout_ms", "0").code(), Code::kInvalidArgument);
  MK_ASSERT_OK(tunables::set("device", "-1"));
  EXPECT_EQ(tunables::set("device", "-2").code(), Code::kInvalidArgument);
  MK_ASSERT_OK(tunables::reset("device"));
  MK_ASSERT_OK(tunables::reset("bootstrap_timeout_ms"));
  ASSERT_EQ(setenv("MK_BOOTSTRAP_TIMEOUT_MS", "-5", 1), 0);
  EXPECT_EQ(tunables::get_int("bootstrap_timeout_ms", &x).code(), Code::kInvalidArgument);
  EXPECT_EQ(tunables::int_or_default("bootstrap_timeout_ms"), 60000);
  // An unknown name in int_or_default does not crash.
  EXPECT_EQ(tunables::int_or_default("no_such_tunable"), 0);
  EXPECT_EQ(tunables::string_or_default("no_such_tunable"), "");
}

// Every setting is validated when read: integers by range (a maximum too), fixed lists by
// exact spelling, the others by their own rule; the error names the variable.
TEST(Tunables, EveryKindOfSettingIsValidated) {
  struct Case {
    const char* name;
    const char* good;
    const char* bad;
  };
  const Case cases[] = {
      {"bootstrap_timeout_ms", "5000", "9300000000000"},  // past its maximum (a day)
      {"proxy_ring_slots", "4096", "288230376151711744"}, // 2^58: past its maximum
      {"proxy_max_inflight", "64", "4294967296"},
      {"signal_timeout_ms", "100", "abc"},
      {"debug", "INFO", "LOUD"},
      {"debug", "VERSION", "info"},
      {"debug_subsys", "^NET,PROXY", "NET,BOGUS"},
      {"net_staging", "always", "sometimes"},
      {"net_check_senders", "off", "yes"},
      {"fused_split", "auto", "dynamic"},
      {"symmem_mode", "vmm", "VMM"},
      {"net_provider", "tcp_rxm", "tcp rxm"},
      {"net_provider", "udp;ofi_rxd", ""},
      {"fault", "call:kill@1#2", "call:explode@1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.name) + " good '" + c.good + "' bad '" + c.bad + "'");
    const TunableDef* d = nullptr;
    for (const auto& t : tunables::table())
      if (std::string(t.name) == c.name) d = &t;
    ASSERT_NE(d, nullptr);
    EnvGuard env(d->env);
    TunableGuard guard(d->name);
    MK_EXPECT_OK(tunables::validate(*d, c.good));
    const Status b = tunables::validate(*d, c.bad);
    EXPECT_EQ(b.code(), Code::kInvalidArgument);
    EXPECT_NE(b.message().find(d->env), std::string::npos) << b.message();
    // set() refuses it; from the environment, the typed read is the error and check_all names it.
    EXPECT_EQ(tunables::set(c.name, c.bad).code(), Code::kInvalidArgument);
    ASSERT_EQ(setenv(d->env, c.bad, 1), 0);
    const Status all = tunables::check_all();
    EXPECT_EQ(all.code(), Code::kInvalidArgument);
    EXPECT_NE(all.message().find(std::string(d->env) + "='" + c.bad + "'"), std::string::npos) << all.message();
    EXPECT_NE(all.message().find("(from env)"), std::string::npos) << all.message();
    if (d->type == TunableType::kInt) {
      int64_t x = 0;
      EXPECT_EQ(tunables::get_int(c.name, &x).code(), Code::kInvalidArgument);
      EXPECT_EQ(tunables::int_or_default(c.name), std::stoll(d->default_value));
    } else {
      std::string v;
      EXPECT_EQ(tunables::get_string(c.name, &v).code(), Code::kInvalidArgument);
      EXPECT_EQ(tunables::string_or_default(c.name), d->default_value);
    }
    ASSERT_EQ(setenv(d->env, c.good, 1), 0);
    MK_EXPECT_OK(tunables::check_all());
  }
}

// Several bad settings: one error naming each of them.
TEST(Tunables, CheckAllNamesEveryBadSetting) {
  EnvGuard a("MK_SIGNAL_TIMEOUT_MS"), b("MK_NET_STAGING");
  MK_ASSERT_OK(tunables::check_all());
  ASSERT_EQ(setenv("MK_SIGNAL_TIMEOUT_MS", "0", 1), 0);
  ASSERT_EQ(setenv("MK_NET_STAGING", "maybe", 1), 0);
  const Status s = tunables::check_all();
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("MK_SIGNAL_TIMEOUT_MS='0'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("MK_NET_STAGING='maybe'"), std::string::npos) << s.message();
}

// docs/tunables.md is the table's own rendering (regenerate: mkernel doctor --tunables-md).
TEST(Tunables, DocumentMatchesTheTable) {
  const std::string path = std::string(MK_SOURCE_DIR) + "/docs/tunables.md";
  FILE* f = fopen(path.c_str(), "rb");
  ASSERT_NE(f, nullptr) << path;
  std::string doc;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) doc.append(buf, n);
  fclose(f);
  const std::string want = tunables::markdown();
  EXPECT_EQ(doc, want) << path << " differs from the table: regenerate it with "
                       << "`build/mkernel doctor --tunables-md > docs/tunables.md`";
  for (const auto& d : tunables::table()) EXPECT_NE(doc.find(std::string("`") + d.env + "`"), std::string::npos) << d.env;
}

// ---------------------------------------------------------------------------------------
// Logging

TEST(Log, LevelFollowsDebugTunable) {
  EnvGuard e1("MK_DEBUG");
  EnvGuard e2("MK_DEBUG_SUBSYS");
  TunableGuard g1("debug");
  TunableGuard g2("debug_subsys");
  MK_ASSERT_OK(tunables::reset("debug_subsys"));

  MK_ASSERT_OK(tunables::set("debug", "INFO"));
  EXPECT_TRUE(log_enabled(LogLevel::kInfo, kSubsysBoot));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn, kSubsysBoot));
  EXPECT_FALSE(log_enabled(LogLevel::kTrace, kSubsysBoot));

  MK_ASSERT_OK(tunables::set("debug", "WARN"));
  EXPECT_FALSE(log_enabled(LogLevel::kInfo, kSubsysBoot));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn, kSubsysBoot));

  MK_ASSERT_OK(tunables::set("debug", "TRACE"));
  EXPECT_TRUE(log_enabled(LogLevel::kTrace, kSubsysMem));

  MK_ASSERT_OK(tunables::set("debug", "NONE"));
  EXPECT_FALSE(log_enabled(LogLevel::kWarn, kSubsysBoot));

  // Back to the default (WARN) after reset.
  MK_ASSERT_OK(tunables::reset("debug"));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn, kSubsysBoot));
  EXPECT_FALSE(log_enabled(LogLevel::kInfo, kSubsysBoot));
}

TEST(Log, SubsystemMaskAndExclusion) {
  EnvGuard e1("MK_DEBUG");
  EnvGuard e2("MK_DEBUG_SUBSYS");
  TunableGuard g1("debug");
  TunableGuard g2("debug_subsys");
  MK_ASSERT_OK(tunables::set("debug", "INFO"));

  const uint32_t others[] = {kSubsysInit, kSubsysBoot,   kSubsysNet,
                             kSubsysProxy, kSubsysTopo, kSubsysSignal, kSubsysTune};

  MK_ASSERT_OK(tunables::set("debug_subsys", "MEM"));
  EXPECT_TRUE(log_enabled(LogLevel::kInfo, kSubsysMem));
  for (uint32_t s : others) EXPECT_FALSE(log_enabled(LogLevel::kInfo, s)) << "subsys bit " << s;

  MK_ASSERT_OK(tunables::set("debug_subsys", "^MEM"));
  EXPECT_FALSE(log_enabled(LogLevel::kInfo, kSubsysMem));
  for (uint32_t s : others) EXPECT_TRUE(log_enabled(LogLevel::kInfo, s)) << "subsys bit " << s;

  MK_ASSERT_OK(tunables::set("debug_subsys", "BOOT,NET"));
  EXPECT_TRUE(log_enabled(LogLevel::kInfo, kSubsysBoot));
  EXPECT_TRUE(log_enabled(LogLevel::kInfo, kSubsysNet));
  EXPECT_FALSE(log_enabled(LogLevel::kInfo, kSubsysMem));
  EXPECT_FALSE(log_enabled(LogLevel::kInfo, kSubsysTopo));

  MK_ASSERT_OK(tunables::set("debug_subsys", "ALL"));
  for (uint32_t s : others) EXPECT_TRUE(log_enabled(LogLevel::kInfo, s));
  EXPECT_TRUE(log_enabled(LogLevel::kInfo, kSubsysMem));

  // The level still applies inside an enabled subsystem.
  MK_ASSERT_OK(tunables::set("debug_subsys", "MEM"));
  EXPECT_FALSE(log_enabled(LogLevel::kTrace, kSubsysMem));

  MK_ASSERT_OK(tunables::reset("debug_subsys"));
  MK_ASSERT_OK(tunables::reset("debug"));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn, kSubsysMem));
  EXPECT_TRUE(log_enabled(LogLevel::kWarn, kSubsysBoot));
}

// Time limits saturate: a huge count waits about a century, a negative one not at all, and a
// nanosecond count never wraps (src/common/deadline.h).
TEST(Deadline, SaturatesInsteadOfWrapping) {
  using std::chrono::hours;
  const auto now = std::chrono::steady_clock::now();
  EXPECT_GT(deadline_after_ms(std::numeric_limits<int64_t>::max()), now + hours(24 * 365 * 99));
  EXPECT_GT(deadline_after_ms(9300000000000), now + hours(24 * 365 * 99));  // 9.3e12 ms: past a century
  const auto negative = deadline_after_ms(-5);
  EXPECT_LE(negative, std::chrono::steady_clock::now());
  const auto d = deadline_after_ms(1500);
  EXPECT_GE(d, now + std::chrono::milliseconds(1500));
  EXPECT_LT(d, now + std::chrono::milliseconds(61500));
  EXPECT_EQ(ms_to_ns(std::numeric_limits<int64_t>::max()), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(ms_to_ns(int64_t{18446744073709}), 18446744073709000000ull);  // the largest that fits
  EXPECT_EQ(ms_to_ns(int64_t{18446744073710}), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(ms_to_ns(7), 7000000u);
  EXPECT_EQ(ms_to_ns(0), 0u);
  EXPECT_EQ(ms_to_ns(-3), 0u);
}

// MK_DEBUG_FILE is a private file: a symbolic link there (another user's trap in a shared
// directory) is refused, the log goes to stderr and the link's target is untouched; a FIFO does
// not block the process; a file it creates is 0600.
TEST(Log, DebugFileIsPrivate) {
  EnvGuard e1("MK_DEBUG");
  EnvGuard e2("MK_DEBUG_FILE");
  TunableGuard g1("debug");
  TunableGuard g2("debug_file");
  char tmpl[] = "/tmp/mk-logfile-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl, target = dir + "/target", link = dir + "/link", fifo = dir + "/fifo",
                    log = dir + "/log";
  auto text_of = [](const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  { std::ofstream(target) << "keep\n"; }
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::mt19937_64 rng(test::test_seed() ^ 0x10F);
  const std::string token = "token-" + random_token(rng, 12);
  MK_ASSERT_OK(tunables::set("debug", "WARN"));
  MK_ASSERT_OK(tunables::set("debug_file", link));
  MK_WARN(kSubsysBoot, "through the link %s", token.c_str());
  MK_ASSERT_OK(tunables::set("debug_file", fifo));  // returns: the FIFO is refused, not opened
  MK_WARN(kSubsysBoot, "into the fifo %s", token.c_str());
  MK_ASSERT_OK(tunables::set("debug_file", log));
  MK_WARN(kSubsysBoot, "into the file %s", token.c_str());
  MK_ASSERT_OK(tunables::reset("debug_file"));  // closes it
  EXPECT_EQ(text_of(target), "keep\n");
  EXPECT_NE(text_of(log).find("into the file " + token), std::string::npos) << text_of(log);
  struct stat st;
  ASSERT_EQ(stat(log.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  for (const auto& p : {target, link, fifo, log}) unlink(p.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace mk

namespace mk {
namespace {

// The fault tunable (src/common/fault.h): what parses, what is refused and why.
TEST(Fault, SpecsParseOrSayWhy) {
  for (const char* ok : {"", "call:kill@1", "call:stop@0#3", "call:badinput@2#1", "put:error@1#200",
                         "completion:error@0", "register:error@3#2", "call:kill@1,put:error@2#5"}) {
    std::string why;
    EXPECT_TRUE(fault::parse(ok, &why).ok()) << ok << ": " << why;
  }
  struct Bad {
    const char* spec;
    const char* why;
  };
  for (const Bad& b : {Bad{"call", "malformed"}, Bad{"call:kill", "malformed"}, Bad{"cal:kill@1", "unknown site"},
                       Bad{"call:explode@1", "unknown action"}, Bad{"put:kill@1", "does not apply"},
                       Bad{"call:error@1", "does not apply"}, Bad{"call:kill@x", "rank is not a number"},
                       Bad{"call:kill@1#0", "count after # must be"}, Bad{"call:kill@1#", "count after # must be"},
                       Bad{"call:kill@1,", "malformed"}, Bad{"call:kill@-1", "rank is not a number"}}) {
    std::string why;
    Status s = fault::parse(b.spec, &why);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.spec;
    EXPECT_NE(why.find(b.why), std::string::npos) << b.spec << ": " << why;
    EXPECT_NE(why.find(b.spec[0] ? std::string(b.spec).substr(0, 4) : ""), std::string::npos) << why;
  }
}

// The n-th event of a site on the planted rank, and only it, gets the action.
TEST(Fault, FiresAtTheNthEventOfItsRankOnly) {
  MK_ASSERT_OK(tunables::set("fault", "put:error@2#3,call:badinput@0#2"));
  fault::reload();
  std::vector<fault::Action> r2, r1, c0;
  for (int i = 0; i < 5; ++i) {
    r2.push_back(fault::at(fault::Site::kPut, 2));
    r1.push_back(fault::at(fault::Site::kPut, 1));
    c0.push_back(fault::at(fault::Site::kCall, 0));
  }
  EXPECT_EQ(fault::at(fault::Site::kCompletion, 2), fault::Action::kNone);
  MK_ASSERT_OK(tunables::reset("fault"));
  fault::reload();
  EXPECT_EQ(fault::at(fault::Site::kPut, 2), fault::Action::kNone);
  using A = fault::Action;
  EXPECT_EQ(r2, (std::vector<A>{A::kNone, A::kNone, A::kError, A::kNone, A::kNone}));
  EXPECT_EQ(r1, (std::vector<A>(5, A::kNone)));
  EXPECT_EQ(c0, (std::vector<A>{A::kNone, A::kBadInput, A::kNone, A::kNone, A::kNone}));
}

// A malformed value is refused where a job starts (the communicator agrees on validate()).
TEST(Fault, ValidateReadsTheTunable) {
  // set() refuses a malformed plan; from the environment, validate() names it.
  EXPECT_EQ(tunables::set("fault", "call:kill@one").code(), Code::kInvalidArgument);
  EnvGuard env("MK_FAULT");
  ASSERT_EQ(setenv("MK_FAULT", "call:kill@one", 1), 0);
  Status s = fault::validate();
  ASSERT_EQ(unsetenv("MK_FAULT"), 0);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("call:kill@one"), std::string::npos) << s.to_string();
  MK_EXPECT_OK(fault::validate());
}

}  // namespace
}  // namespace mk
