// Proxy conformance over a libfabric provider (MK_NET_PROVIDER), ranks as MPI processes.
#include <mpi.h>

#include "mkernel/runtime/bootstrap_mpi.h"
#include "tests/cpu/proxy_suite.h"

namespace mk {
namespace test {
namespace {

std::unique_ptr<Bootstrap> mpi_bs() {
  std::unique_ptr<Bootstrap> bs;
  Status s = make_mpi_bootstrap(MPI_COMM_WORLD, &bs);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return bs;
}

net::BackendConfig cfg() {
  net::BackendConfig c;
  c.kind = "libfabric";
  return c;  // provider from MK_NET_PROVIDER
}

TEST(ProxyConformance, RandomPutsEveryByteAndCompletion) {
  auto bs = mpi_bs();
  ASSERT_TRUE(bs);
  conformance(bs.get(), cfg());
}

TEST(ProxyConformance, StressHundredThousandCommands) {
  auto bs = mpi_bs();
  ASSERT_TRUE(bs);
  stress(bs.get(), cfg());
}

TEST(ProxyConformance, BadCommandsAreRejected) {
  auto bs = mpi_bs();
  ASSERT_TRUE(bs);
  bad_commands(bs.get(), cfg());
}

}  // namespace
}  // namespace test
}  // namespace mk
