// Uses an installed mkernel through its public headers only, on a machine without a GPU:
// the version, the tunables table and Status. With MPI, also takes the address of the MPI
// bootstrap so its object (and libmpi) is on the link line. Prints one line per check and
// "consumer: ok" at the end; exits 1 on the first failure.
#include <cstdio>
#include <cstring>
#include <string>

#include <mkernel/mkernel.h>
#ifdef MK_HAVE_MPI
#include <mkernel/runtime/bootstrap_mpi.h>
#endif

namespace {
int fail(const char* what, const std::string& detail) {
  std::printf("consumer: FAILED: %s: %s\n", what, detail.c_str());
  return 1;
}
}  // namespace

int main() {
  const char* version = mk::version();
  std::printf("consumer: mkernel %s (package %s)\n", version, MK_CONSUMER_EXPECTED_VERSION);
  if (std::strcmp(version, MK_CONSUMER_EXPECTED_VERSION) != 0) {
    return fail("version", std::string(version) + " != " + MK_CONSUMER_EXPECTED_VERSION);
  }

  std::printf("consumer: %zu tunables\n", mk::tunables::table().size());
  if (mk::tunables::table().empty()) return fail("tunables", "empty table");
  mk::Status s = mk::tunables::set("signal_timeout_ms", "1234");
  if (!s.ok()) return fail("tunables::set", s.to_string());
  int64_t v = 0;
  s = mk::tunables::get_int("MK_SIGNAL_TIMEOUT_MS", &v);
  if (!s.ok()) return fail("tunables::get_int", s.to_string());
  if (v != 1234) return fail("tunables::get_int", std::to_string(v) + " != 1234");
  std::printf("consumer: signal_timeout_ms = %lld (set through the API)\n", static_cast<long long>(v));

  // An unknown name is an error Status, not a crash.
  s = mk::tunables::set("no_such_tunable", "1");
  if (s.ok() || s.code() != mk::Code::kInvalidArgument) return fail("unknown tunable", s.to_string());
  std::printf("consumer: unknown tunable -> %s\n", s.to_string().c_str());

#ifdef MK_HAVE_MPI
  // volatile: the reference must survive to the link.
  mk::Status (*volatile mpi_bootstrap)(MPI_Comm, std::unique_ptr<mk::Bootstrap>*) = &mk::make_mpi_bootstrap;
  if (mpi_bootstrap == nullptr) return fail("MPI bootstrap", "not linked");
  std::printf("consumer: MPI bootstrap linked\n");
#endif
  std::printf("consumer: ok\n");
  return 0;
}
