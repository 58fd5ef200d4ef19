// The proxy conformance suite, run per rank against any backend: under mpirun (libfabric
// providers) or as threads of one process (loopback). CPU threads stand in for GPU producers.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/net/backend.h"
#include "mkernel/proxy/proxy.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/topology.h"
#include "tests/common/test_util.h"

namespace mk {
namespace test {

inline uint8_t tag_byte(uint64_t seed, int src, uint64_t i) {
  uint64_t x = seed ^ (uint64_t(src + 1) * 0x9e3779b97f4a7c15ull) ^ (i * 0xbf58476d1ce4e5b9ull);
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

constexpr uint8_t kPoison = 0xA5;
constexpr size_t kMargin = 4096;  // poisoned bytes each side of every window

// A host buffer with poisoned margins; the window is the middle.
struct Guarded {
  std::vector<uint8_t> mem;
  size_t bytes = 0;
  void init(size_t n) {
    bytes = n;
    mem.assign(n + 2 * kMargin, kPoison);
  }
  uint8_t* window() { return mem.data() + kMargin; }
  bool margins_intact() const {
    for (size_t i = 0; i < kMargin; ++i)
      if (mem[i] != kPoison || mem[kMargin + bytes + i] != kPoison) return false;
    return true;
  }
};

// One put of the plan: from src's source window to dst's data window.
struct PlannedPut {
  int src, dst, k;
  uint64_t src_off, dst_off, bytes;
  uint32_t flag;  // on dst: src * K + k
};

// Deterministic from the seed, so every rank knows every put. Per (src, dst): K puts into
// src's region of dst's window, disjoint, unaligned: one large (2-4 MiB), one empty, the
// rest 1 B - 64 KiB.
inline std::vector<PlannedPut> make_plan(uint64_t seed, int W, int K, uint64_t region,
                                         uint64_t src_bytes) {
  std::vector<PlannedPut> plan;
  for (int s = 0; s < W; ++s)
    for (int d = 0; d < W; ++d) {
      std::mt19937_64 rng(seed ^ (uint64_t(s) << 20) ^ (uint64_t(d) << 40) ^ 0x5eedull);
      uint64_t off = uint64_t(s) * region + (rng() % 61) + 1;
      for (int k = 0; k < K; ++k) {
        uint64_t n;
        if (k == 0) n = (2u << 20) + rng() % (2u << 20) - 997;
        else if (k == 1) n = 0;
        else n = 1 + (rng() % (1u << (1 + rng() % 16)));
        PlannedPut p{s, d, k, rng() % (src_bytes - n), off, n, uint32_t(s * K + k)};
        plan.push_back(p);
        off += n + 1 + rng() % 63;
      }
      EXPECT_LE(off, uint64_t(s + 1) * region) << "plan overflows a region";
    }
  return plan;
}

// staging: "" (tunable net_staging), "never" or "always" (the staged protocol on host memory);
// copier: staging copies through it (null: the default).
struct ProxyWorld {
  Bootstrap* bs;
  Topology topo;
  std::unique_ptr<net::Backend> be;
  std::unique_ptr<ProxyWindows> wins;
  Guarded src, dst;
  uint32_t src_win = 0, dst_win = 0;
  int rank, W;

  Status init(Bootstrap* b, const net::BackendConfig& cfg, size_t src_bytes, size_t dst_bytes,
              const std::string& staging = "", StagingCopier* copier = nullptr) {
    bs = b;
    rank = b->rank();
    W = b->size();
    std::vector<RankInfo> infos(W);
    RankInfo me = local_host_info(rank);
    MK_CHECK(bs->allgather(&me, infos.data(), sizeof(me)));
    MK_CHECK(build_topology(rank, infos, 0, nullptr, &topo));
    MK_CHECK(net::create_backend(*bs, topo, cfg, &be));
    src.init(src_bytes);
    dst.init(dst_bytes);
    const uint64_t seed = test_seed();
    for (size_t i = 0; i < src_bytes; ++i) src.window()[i] = tag_byte(seed, rank, i);
    StagingConfig sc;
    sc.chunk_bytes = 256 << 10;  // small: a 4 MiB put goes as 16 chunks
    sc.inbox_slots = 4;          // few: senders wait for credits
    sc.outbox_slots = 8;
    sc.copier = copier;
    MK_CHECK(ProxyWindows::create(bs, be.get(), staging, sc, &wins));
    MK_CHECK(wins->add(src.window(), src_bytes, net::MemKind::kHost, &src_win));
    MK_CHECK(wins->add(dst.window(), dst_bytes, net::MemKind::kHost, &dst_win));
    return OkStatus();
  }
  Status finish() {
    MK_CHECK(wins->destroy());
    return be->finalize();
  }
};

}  // namespace test
}  // namespace mk
