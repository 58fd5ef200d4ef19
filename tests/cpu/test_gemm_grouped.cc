// The grouped GEMM's argument checks (gemm::can_implement_grouped), on the host: what it accepts
// and each refusal with its reason. (The kernel itself: tests/gpu/test_gpu_grouped.cu.)
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "mkernel/gemm/grouped.h"

namespace mk {
namespace test {
namespace {

// Host addresses stand in for device buffers: the checks never dereference them.
alignas(16) char a_mem[1 << 16], b_mem[1 << 16], c_mem[1 << 16];
int32_t counts_mem[4];

gemm::GroupedArguments valid() {
  gemm::GroupedArguments g;
  g.A = a_mem;
  g.B = b_mem;
  g.C = c_mem;
  g.groups = 4;
  g.rows = 64;
  g.N = 64;
  g.K = 64;
  g.counts = counts_mem;
  return g;
}

void expect_refused(const gemm::GroupedArguments& g, const std::string& words) {
  const Status s = gemm::can_implement_grouped(g);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(words), std::string::npos) << s.to_string();
}

// Accepted: OK, or — in a build without the CUTLASS headers (the sanitizer builds) — the one
// refusal such a build gives after every argument check passed; the test then reports skipped.
TEST(GroupedArgs, AcceptsValidShapes) {
  bool no_cutlass = false;
  auto expect_accepted = [&](const gemm::GroupedArguments& g, const char* what) {
    const Status s = gemm::can_implement_grouped(g);
    if (s.code() == Code::kNotSupported && s.message().find("without CUTLASS") != std::string::npos) {
      no_cutlass = true;
      return;
    }
    EXPECT_TRUE(s.ok()) << what << ": " << s.to_string();
  };
  expect_accepted(valid(), "plain");
  gemm::GroupedArguments g = valid();
  g.epilogue = gemm::GroupedEpilogue::kSwiGLU;  // N = 2I, I = 32
  expect_accepted(g, "SwiGLU");
  g = valid();
  g.rows = 0;  // nothing to do: pointers are not needed
  g.A = g.B = g.C = nullptr;
  expect_accepted(g, "no rows");
  if (no_cutlass) GTEST_SKIP() << "built without CUTLASS: valid arguments end in kNotSupported";
}

TEST(GroupedArgs, RefusesWithReasons) {
  gemm::GroupedArguments g = valid();
  g.groups = 0;
  expect_refused(g, "groups 0");
  g = valid(), g.groups = gemm::kMaxGroups + 1;
  expect_refused(g, "groups");
  g = valid(), g.K = 60;
  expect_refused(g, "K must be a multiple of 8");
  g = valid(), g.N = 12;
  expect_refused(g, "N must be a multiple of 8");
  g = valid(), g.N = 24, g.epilogue = gemm::GroupedEpilogue::kSwiGLU;
  expect_refused(g, "SwiGLU");
  g = valid(), g.lda = 60;
  expect_refused(g, "row strides");
  g = valid(), g.counts = nullptr;
  expect_refused(g, "counts");
  g = valid(), g.A = nullptr;
  expect_refused(g, "null");
  g = valid(), g.C = c_mem + 2;
  expect_refused(g, "16-byte aligned");
  g = valid(), g.C = a_mem + 16;
  expect_refused(g, "overlaps");
  g = valid(), g.epilogue = static_cast<gemm::GroupedEpilogue>(7);
  expect_refused(g, "epilogue");
  g = valid(), g.rows = -1;
  expect_refused(g, "rows");
}

}  // namespace
}  // namespace test
}  // namespace mk
