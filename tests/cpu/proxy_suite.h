// The proxy conformance cases, each run by every rank of a world (see proxy_harness.h).
#pragma once

#include "tests/cpu/proxy_harness.h"

namespace mk {
namespace test {

using Clock = std::chrono::steady_clock;

// Random sizes 1 B - 4 MiB at unaligned offsets, rank-tagged, from two producer threads;
// every put has its own flag on the receiver, which checks the put's bytes the moment its
// flag rises (a flag is never observed before its data), then every byte of the window
// (gaps and margins still poison) and every completion count.
inline void conformance(Bootstrap* bs, const net::BackendConfig& cfg, const std::string& staging = "") {
  const int W = bs->size(), me = bs->rank(), K = 12;
  const uint64_t region = 5u << 20, src_bytes = 6u << 20, seed = test_seed();
  ProxyWorld w;
  MK_ASSERT_OK(w.init(bs, cfg, src_bytes, W * region, staging));
  const std::vector<PlannedPut> plan = make_plan(seed, W, K, region, src_bytes);
  const uint32_t nflags = W * K + 1, local_flag = W * K;
  std::vector<uint64_t> flags(nflags, 0);
  HostFlagSink sink(flags.data(), nflags);
  std::unique_ptr<Proxy> proxy;
  ProxyConfig pc;
  pc.ring_slots = 256;
  pc.max_inflight = 64;
  MK_ASSERT_OK(Proxy::create(w.wins.get(), &sink, pc, &proxy));
  MK_ASSERT_OK(proxy->start());
  MK_ASSERT_OK(bs->barrier());

  std::vector<const PlannedPut*> mine, incoming;
  for (const auto& p : plan) {
    if (p.src == me) mine.push_back(&p);
    if (p.dst == me) incoming.push_back(&p);
  }
  std::atomic<int> push_errors{0};
  std::vector<std::thread> producers;
  for (int t = 0; t < 2; ++t)
    producers.emplace_back([&, t] {
      for (const PlannedPut* p : mine) {
        if (p->k % 2 != t) continue;
        Status s = proxy->ring().push(make_put(p->dst, w.src_win, p->src_off, w.dst_win, p->dst_off,
                                               p->bytes, p->flag, local_flag, p->k),
                                      20000, &proxy->failed_word());
        if (!s.ok()) {
          ADD_FAILURE() << "rank " << me << ": push: " << s.to_string();
          ++push_errors;
          return;
        }
      }
    });

  // Check each incoming put as soon as its flag rises.
  std::vector<bool> seen(incoming.size(), false);
  size_t left = incoming.size();
  uint64_t early = 0;
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (left > 0 && Clock::now() < deadline && proxy->status().ok()) {
    for (size_t i = 0; i < incoming.size(); ++i) {
      if (seen[i]) continue;
      const PlannedPut& p = *incoming[i];
      uint64_t f = __atomic_load_n(&flags[p.flag], __ATOMIC_ACQUIRE);
      if (f == 0) continue;
      EXPECT_EQ(f, 1u) << "flag of put " << p.src << "/" << p.k << " raised twice";
      for (uint64_t b = 0; b < p.bytes; ++b)
        if (w.dst.window()[p.dst_off + b] != tag_byte(seed, p.src, p.src_off + b)) {
          ++early;
          break;
        }
      seen[i] = true;
      --left;
    }
  }
  for (auto& t : producers) t.join();
  EXPECT_TRUE(proxy->status().ok()) << "rank " << me << ": " << proxy->status().to_string();
  for (size_t i = 0; i < incoming.size(); ++i)
    EXPECT_TRUE(seen[i]) << "rank " << me << ": put " << incoming[i]->k << " from rank "
                         << incoming[i]->src << " never arrived";
  EXPECT_EQ(early, 0u) << "rank " << me << ": flags observed before their data";
  EXPECT_EQ(push_errors.load(), 0);

  MK_EXPECT_OK(proxy->flush(20000));
  MK_ASSERT_OK(bs->barrier());
  // Every completion counted: one local completion per put sent, one arrival per put received.
  EXPECT_EQ(__atomic_load_n(&flags[local_flag], __ATOMIC_ACQUIRE), mine.size());
  ProxyStats st = proxy->stats();
  EXPECT_EQ(st.puts, mine.size());
  EXPECT_EQ(st.arrivals, incoming.size());
  EXPECT_EQ(st.commands, mine.size());
  // Every byte: written ranges hold their put's data, gaps and margins are untouched.
  std::vector<uint8_t> expect(W * region, kPoison);
  for (const PlannedPut* p : incoming)
    for (uint64_t b = 0; b < p->bytes; ++b) expect[p->dst_off + b] = tag_byte(seed, p->src, p->src_off + b);
  EXPECT_EQ(memcmp(expect.data(), w.dst.window(), expect.size()), 0) << "rank " << me << ": window differs";
  EXPECT_TRUE(w.dst.margins_intact()) << "rank " << me << ": bytes outside the window changed";
  MK_EXPECT_OK(proxy->stop());
  MK_EXPECT_OK(w.finish());
  if (me == 0)
    printf("%s%s: %d ranks, %zu puts per rank, %llu EAGAIN retries on rank 0\n", w.be->name(),
           w.wins->staging() ? " (staged)" : "", W, mine.size(), static_cast<unsigned long long>(st.eagain));
}

// >= 100 000 commands through a 64-slot ring (wrap-around, back-pressure), 8-byte puts to the
// next rank, a NOP every 1000 and a final fence; every count checked.
inline void stress(Bootstrap* bs, const net::BackendConfig& cfg, int n = 100000,
                   const std::string& staging = "") {
  const int W = bs->size(), me = bs->rank();
  const int next = (me + 1) % W, prev = (me + W - 1) % W;
  ProxyWorld w;
  MK_ASSERT_OK(w.init(bs, cfg, 8192, 8192, staging));
  std::vector<uint64_t> flags(W + 2, 0);
  HostFlagSink sink(flags.data(), W + 2);
  std::unique_ptr<Proxy> proxy;
  ProxyConfig pc;
  pc.ring_slots = 64;
  pc.max_inflight = 32;
  MK_ASSERT_OK(Proxy::create(w.wins.get(), &sink, pc, &proxy));
  MK_ASSERT_OK(proxy->start());
  MK_ASSERT_OK(bs->barrier());
  auto t0 = Clock::now();
  int nops = 0;
  for (int i = 0; i < n; ++i) {
    const uint64_t off = uint64_t(i % 1024) * 8;
    Status s = proxy->ring().push(make_put(next, w.src_win, off, w.dst_win, off, 8, me, W), 30000,
                                  &proxy->failed_word());
    ASSERT_TRUE(s.ok()) << s.to_string();
    if (i % 1000 == 999) {
      ASSERT_TRUE(proxy->ring().push(make_op(CmdOp::kNop, W + 1), 30000, &proxy->failed_word()).ok());
      ++nops;
    }
  }
  ASSERT_TRUE(proxy->ring().push(make_op(CmdOp::kFence, W + 1), 30000, &proxy->failed_word()).ok());
  // Waits while the counts still move: a provider that is only slow (udp's small window on a
  // loaded 2-core machine under TSan) finishes; one that stalls fails after 60 s without progress.
  auto load = [&](int i) { return __atomic_load_n(&flags[i], __ATOMIC_ACQUIRE); };
  auto done = [&] {
    return load(prev) == uint64_t(n) && load(W) == uint64_t(n) && load(W + 1) == uint64_t(nops + 1);
  };
  uint64_t last = 0;
  auto moved = Clock::now();
  while (!done() && proxy->status().ok()) {
    const uint64_t now_sum = load(prev) + load(W) + load(W + 1);
    if (now_sum != last) {
      last = now_sum;
      moved = Clock::now();
    } else if (Clock::now() - moved > std::chrono::seconds(60)) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // leave the cores to the proxies
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(done()) << "rank " << me << ": arrivals from " << prev << " " << load(prev)
                      << ", local completions " << load(W) << ", nop/fence " << load(W + 1)
                      << " (no progress for 60 s); proxy: " << proxy->status().to_string();
  MK_EXPECT_OK(proxy->flush(20000));
  MK_ASSERT_OK(bs->barrier());
  ProxyStats st = proxy->stats();
  EXPECT_EQ(st.commands, uint64_t(n + nops + 1));
  EXPECT_EQ(st.nops, uint64_t(nops));
  EXPECT_EQ(proxy->ring().consumed(), uint64_t(n + nops + 1));
  // The window holds prev's source bytes (prev wrote its own source offsets).
  const uint64_t seed = test_seed();
  size_t bad = 0;
  for (size_t i = 0; i < 8192; ++i) bad += w.dst.window()[i] != tag_byte(seed, prev, i);
  EXPECT_EQ(bad, 0u);
  EXPECT_TRUE(w.dst.margins_intact());
  MK_EXPECT_OK(proxy->stop());
  MK_EXPECT_OK(w.finish());
  if (me == 0)
    printf("%s%s: %d ranks, %d puts + %d nops + 1 fence per rank through a %d-slot ring in %.2f s "
           "(%.0f commands/s per proxy, %llu EAGAIN)\n",
           w.be->name(), w.wins->staging() ? " (staged)" : "", W, n, nops, int(pc.ring_slots), secs, (n + nops + 1) / secs,
           static_cast<unsigned long long>(st.eagain));
}

// Bad commands are rejected with an error naming the command; nothing is written anywhere.
inline void bad_commands(Bootstrap* bs, const net::BackendConfig& cfg, const std::string& staging = "") {
  const int W = bs->size(), me = bs->rank();
  const int target = W > 1 ? 1 : 0;
  const uint64_t bytes = 65536;
  ProxyWorld w;
  MK_ASSERT_OK(w.init(bs, cfg, bytes, bytes, staging));
  MK_ASSERT_OK(bs->barrier());
  struct Case {
    const char* what;
    Command c;
    const char* expect;
  };
  auto put = [&](uint64_t src_off, uint64_t dst_off, uint64_t n) {
    return make_put(target, w.src_win, src_off, w.dst_win, dst_off, n, 0);
  };
  std::vector<Case> cases = {
      {"offset past the window", put(0, bytes - 4, 8), "past rank"},
      {"offset wrapping around", put(0, ~uint64_t(0) - 2, 8), "past rank"},
      {"source past its window", put(bytes, 0, 1), "source range past"},
      {"unknown peer", make_put(W, w.src_win, 0, w.dst_win, 0, 8, 0), "unknown peer"},
      {"unknown window", make_put(target, w.src_win, 0, 77, 0, 8, 0), "unknown window"},
      {"unknown op", [&] { Command c = put(0, 0, 8); c.op = 9; return c; }(), "unknown op"},
      {"local flag past the flags", put(0, 0, 8), "local flag"},
  };
  cases.back().c.local_flag = 100;
  if (me == 0) {
    for (const Case& k : cases) {
      SCOPED_TRACE(k.what);
      std::vector<uint64_t> flags(4, 0);
      HostFlagSink sink(flags.data(), 4);
      std::unique_ptr<Proxy> proxy;
      MK_ASSERT_OK(Proxy::create(w.wins.get(), &sink, ProxyConfig{}, &proxy));
      MK_ASSERT_OK(proxy->start());
      MK_ASSERT_OK(proxy->ring().push(k.c, 5000));
      // A valid put after the bad one: fail-stop, so it is not posted either.
      MK_ASSERT_OK(proxy->ring().push(put(0, 0, 64), 5000));
      auto deadline = Clock::now() + std::chrono::seconds(5);
      while (proxy->status().ok() && Clock::now() < deadline) std::this_thread::yield();
      Status s = proxy->status();
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find(k.expect), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("command #0"), std::string::npos) << s.message();
      // drained (producers never block) but nothing posted
      deadline = Clock::now() + std::chrono::seconds(5);
      while (proxy->stats().commands < 2 && Clock::now() < deadline) std::this_thread::yield();
      EXPECT_EQ(proxy->stats().commands, 2u);
      EXPECT_EQ(proxy->stats().rejected, 1u);
      EXPECT_EQ(proxy->stats().puts, 0u);
      (void)proxy->stop();
    }
  }
  MK_ASSERT_OK(bs->barrier());
  // Give any stray write time to land, then check the target: nothing changed.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (me == target) {
    size_t changed = 0;
    for (size_t i = 0; i < bytes; ++i) changed += w.dst.window()[i] != kPoison;
    EXPECT_EQ(changed, 0u) << "bytes written by rejected commands";
    EXPECT_TRUE(w.dst.margins_intact());
  }
  MK_ASSERT_OK(bs->barrier());
  MK_EXPECT_OK(w.finish());
}

}  // namespace test
}  // namespace mk
