// The attention backward's argument rules and workspace size, before any GPU: every rule names
// what is wrong (attention::can_implement_backward), the workspace covers its parts, and the
// FLOP count is 2.5x the forward's; the rules of packed variable-length calls (cu_seqlens) in the
// forward and the backward, and their workspace. Fake, never dereferenced addresses stand in for
// tensors.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mkernel/attention/attention.h"

namespace mk {
namespace attention {
namespace {

// A valid problem: B 2, H 8, Hkv 2, Sq 1000, Skv 1500, D 128, bshd tensors at disjoint fake
// addresses, with its workspace.
struct Problem {
  BackwardArgs a;
  Problem() {
    a.B = 2, a.H = 8, a.Hkv = 2, a.Sq = 1000, a.Skv = 1500, a.D = 128;
    const Strides sq = Strides::bshd(a.Sq, a.H, a.D), skv = Strides::bshd(a.Skv, a.Hkv, a.D);
    uintptr_t next = uintptr_t(1) << 32;
    auto take = [&](uint64_t bytes) {
      const uintptr_t p = next;
      next += (bytes + 4095) / 4096 * 4096 + 4096;
      return reinterpret_cast<void*>(p);
    };
    const uint64_t qb = uint64_t(a.B) * a.Sq * a.H * a.D * 2, kb = uint64_t(a.B) * a.Skv * a.Hkv * a.D * 2;
    a.q = take(qb), a.o = take(qb), a.dout = take(qb), a.dq = take(qb);
    a.k = take(kb), a.v = take(kb), a.dk = take(kb), a.dv = take(kb);
    a.lse = static_cast<const float*>(take(uint64_t(a.B) * a.H * a.Sq * 4));
    a.q_stride = a.o_stride = a.do_stride = a.dq_stride = sq;
    a.k_stride = a.v_stride = a.dk_stride = a.dv_stride = skv;
    a.workspace_bytes = backward_workspace_bytes(a.B, a.H, a.Sq, a.D);
    a.workspace = take(a.workspace_bytes);
  }
};

Status check(const BackwardArgs& a) { return can_implement_backward(a); }

TEST(AttentionBackwardArgs, ValidProblemPasses) {
  Problem p;
  const Status s = check(p.a);
  // Without the CUTLASS headers the kernel is absent: the rules still pass, then kNotSupported.
  EXPECT_TRUE(s.ok() || s.code() == Code::kNotSupported) << s.message();
}

TEST(AttentionBackwardArgs, EveryRuleNamesTheProblem) {
  struct Bad {
    const char* what;
    std::function<void(BackwardArgs&)> change;
    const char* says;
  };
  const std::vector<Bad> bad = {
      {"null dO", [](BackwardArgs& a) { a.dout = nullptr; }, "null Q, K, V, O, dO or LSE"},
      {"null LSE", [](BackwardArgs& a) { a.lse = nullptr; }, "null Q, K, V, O, dO or LSE"},
      {"null dV", [](BackwardArgs& a) { a.dv = nullptr; }, "null dQ, dK or dV"},
      {"D 96", [](BackwardArgs& a) { a.D = 96; }, "head dimension 96"},
      {"Sq 0", [](BackwardArgs& a) { a.Sq = 0; }, "empty shape"},
      {"H % Hkv", [](BackwardArgs& a) { a.Hkv = 3; }, "not a multiple of 3 key/value heads"},
      {"misaligned dK", [](BackwardArgs& a) { a.dk = static_cast<char*>(a.dk) + 8; }, "dK must be 16-byte aligned"},
      {"dO stride", [](BackwardArgs& a) { a.do_stride.s = 1028; }, "dO strides (b"},
      {"zero dV stride", [](BackwardArgs& a) { a.dv_stride.h = 0; }, "dV strides"},
      {"dQ on Q", [](BackwardArgs& a) { a.dq = const_cast<void*>(a.q); }, "dQ overlaps Q"},
      {"dK on dV", [](BackwardArgs& a) { a.dk = a.dv; }, "dK overlaps dV"},
      {"dV inside O", [](BackwardArgs& a) { a.dv = static_cast<char*>(const_cast<void*>(a.o)) + 4096; },
       "dV overlaps O"},
      {"dQ on LSE", [](BackwardArgs& a) { a.dq = const_cast<float*>(a.lse); }, "overlaps the LSE"},
      {"no workspace", [](BackwardArgs& a) { a.workspace = nullptr; }, "the workspace has 0 bytes"},
      {"small workspace", [](BackwardArgs& a) { a.workspace_bytes -= 256; }, "needed (backward_workspace_bytes)"},
      {"misaligned workspace", [](BackwardArgs& a) { a.workspace = static_cast<char*>(a.workspace) + 128; },
       "256-byte aligned"},
      {"workspace on dK", [](BackwardArgs& a) { a.workspace = a.dk; }, "the workspace overlaps"},
  };
  for (const Bad& b : bad) {
    Problem p;
    b.change(p.a);
    const Status s = check(p.a);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.what << ": " << s.message();
    EXPECT_NE(s.message().find(b.says), std::string::npos) << b.what << ": " << s.message();
  }
}

TEST(AttentionBackwardArgs, WorkspaceCoversItsParts) {
  // dQ accumulator (fp32 D per row), LSE2 and Dsum (fp32 per row), one 8-byte counter per 64 rows;
  // rows padded to 128 per (batch, head).
  for (int D : {64, 128})
    for (int Sq : {1, 127, 128, 129, 1000, 4096}) {
      const size_t rows = size_t(3) * 5 * ((Sq + 127) / 128 * 128);
      const size_t need = rows * D * 4 + 2 * rows * 4 + rows / 64 * 8;
      const size_t got = backward_workspace_bytes(3, 5, Sq, D);
      EXPECT_GE(got, need) << "D " << D << " Sq " << Sq;
      EXPECT_LE(got, need + 4 * 256) << "D " << D << " Sq " << Sq;
    }
  EXPECT_EQ(backward_workspace_bytes(0, 5, 100, 64), 0u);
  EXPECT_EQ(backward_workspace_bytes(1, 5, 0, 64), 0u);
}

// A valid packed call: B 1, 1000 rows in 5 documents, the workspace for them.
struct VarlenProblem : Problem {
  VarlenProblem() {
    a.B = 1, a.Skv = a.Sq;
    a.cu_seqlens = reinterpret_cast<const int32_t*>(uintptr_t(1) << 40);
    a.n_docs = 5;
    a.workspace_bytes = backward_workspace_bytes(a.B, a.H, a.Sq, a.D, a.n_docs);
    a.workspace = reinterpret_cast<void*>(uintptr_t(1) << 41);
  }
};

TEST(AttentionVarlenArgs, ValidProblemPasses) {
  VarlenProblem p;
  const Status s = check(p.a);
  EXPECT_TRUE(s.ok() || s.code() == Code::kNotSupported) << s.message();
}

TEST(AttentionVarlenArgs, EveryRuleNamesTheProblem) {
  struct Bad {
    const char* what;
    std::function<void(BackwardArgs&)> change;
    const char* says;
  };
  const std::vector<Bad> bad = {
      {"B 2", [](BackwardArgs& a) { a.B = 2; }, "need B = 1"},
      {"Skv != Sq", [](BackwardArgs& a) { a.Skv = 999; }, "need Sq = Skv"},
      {"q_pos0", [](BackwardArgs& a) { a.q_pos0 = 3; }, "restart positions at 0"},
      {"kv_pos0", [](BackwardArgs& a) { a.kv_pos0 = 128; }, "restart positions at 0"},
      {"no documents", [](BackwardArgs& a) { a.n_docs = 0; }, "n_docs 0 (at least 1)"},
      {"documents without cu_seqlens", [](BackwardArgs& a) { a.cu_seqlens = nullptr; }, "n_docs 5 without cu_seqlens"},
      {"misaligned cu_seqlens", [](BackwardArgs& a) { a.cu_seqlens = reinterpret_cast<const int32_t*>(uintptr_t(1) << 40 | 2); },
       "4-byte aligned"},
      {"too many documents", [](BackwardArgs& a) { a.n_docs = 1 << 24; }, "too many"},
      {"workspace of a dense call", [](BackwardArgs& a) { a.workspace_bytes = backward_workspace_bytes(1, 8, 1000, 128); },
       "with n_docs"},
  };
  for (const Bad& b : bad) {
    VarlenProblem p;
    b.change(p.a);
    const Status s = check(p.a);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.what << ": " << s.message();
    EXPECT_NE(s.message().find(b.says), std::string::npos) << b.what << ": " << s.message();
  }
  // The forward's rules are the same ones.
  VarlenProblem p;
  ForwardArgs f;
  f.q = p.a.q, f.k = p.a.k, f.v = p.a.v, f.o = p.a.dq;
  f.q_stride = f.o_stride = p.a.q_stride;
  f.k_stride = f.v_stride = p.a.k_stride;
  f.B = 1, f.H = p.a.H, f.Hkv = p.a.Hkv, f.Sq = f.Skv = p.a.Sq, f.D = p.a.D;
  f.cu_seqlens = p.a.cu_seqlens, f.n_docs = 5;
  Status s = can_implement(f);
  EXPECT_TRUE(s.ok() || s.code() == Code::kNotSupported) << s.message();
  f.B = 2;
  s = can_implement(f);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("need B = 1"), std::string::npos) << s.message();
  f.B = 1, f.n_docs = 0;
  s = can_implement(f);
  EXPECT_NE(s.message().find("at least 1"), std::string::npos) << s.message();
  f.cu_seqlens = nullptr, f.n_docs = 3;
  s = can_implement(f);
  EXPECT_NE(s.message().find("without cu_seqlens"), std::string::npos) << s.message();
}

TEST(AttentionVarlenArgs, WorkspaceCoversTheVirtualBlocks) {
  // The rows of floor(Sq / BM) + n_docs + 1 query blocks (BM 128 at D 64, 64 at D 128) per head,
  // padded to 128.
  for (int D : {64, 128})
    for (int Sq : {1, 127, 1000, 4096})
      for (int n : {1, 7, 300}) {
        const size_t bm = D == 64 ? 128 : 64;
        const size_t rows = size_t(5) * (((Sq / bm + n + 1) * bm + 127) / 128 * 128);
        const size_t need = rows * D * 4 + 2 * rows * 4 + rows / 64 * 8;
        const size_t got = backward_workspace_bytes(1, 5, Sq, D, n);
        EXPECT_GE(got, need) << "D " << D << " Sq " << Sq << " n_docs " << n;
        EXPECT_LE(got, need + 4 * 256) << "D " << D << " Sq " << Sq << " n_docs " << n;
        EXPECT_GE(got, backward_workspace_bytes(1, 5, Sq, D)) << "D " << D << " Sq " << Sq << " n_docs " << n;
      }
  EXPECT_EQ(backward_workspace_bytes(1, 5, 100, 64, -1), 0u);
  EXPECT_EQ(backward_workspace_bytes(1, 5, 100, 64, 1 << 24), 0u);
}

TEST(AttentionBackwardArgs, SplitWorkspaceAddsTheDkDvAccumulators) {
  // GQA and not deterministic: room for fp32 dK and dV of every 128-row key block; otherwise the
  // least workspace.
  Problem p;  // B 2, H 8, Hkv 2, Sq 1000, Skv 1500, D 128
  const size_t least = backward_workspace_bytes(2, 8, 1000, 128);
  const size_t acc = size_t(2) * 2 * 2 * ((1500 + 127) / 128) * 128 * 128 * 4;
  EXPECT_EQ(backward_workspace_bytes(p.a), least + acc);
  p.a.deterministic = true;
  EXPECT_EQ(backward_workspace_bytes(p.a), least);
  p.a.deterministic = false, p.a.Hkv = 8;
  EXPECT_EQ(backward_workspace_bytes(p.a), least);
  // Packed documents: the virtual key blocks.
  VarlenProblem v;  // H 8, Hkv 2, 1000 rows in 5 documents
  EXPECT_EQ(backward_workspace_bytes(v.a), backward_workspace_bytes(1, 8, 1000, 128, 5) +
                                               size_t(2) * 2 * (1000 / 128 + 5 + 1) * 128 * 128 * 4);
  // A call given the least runs unsplit: still valid.
  p.a.Hkv = 2, p.a.workspace_bytes = least;
  const Status s = check(p.a);
  EXPECT_TRUE(s.ok() || s.code() == Code::kNotSupported) << s.message();
}

TEST(AttentionBackwardArgs, FlopsAreTwoAndAHalfForwards) {
  EXPECT_DOUBLE_EQ(backward_flops(1, 32, 4096, 4096, 128, false), 2.5 * forward_flops(1, 32, 4096, 4096, 128, false));
  EXPECT_DOUBLE_EQ(backward_flops(2, 8, 1000, 3000, 64, true), 2.5 * forward_flops(2, 8, 1000, 3000, 64, true));
}

}  // namespace
}  // namespace attention
}  // namespace mk
