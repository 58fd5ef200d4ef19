// The network backends (include/mkernel/net/backend.h).
//
// Built twice from this file:
//   test_net_backend (mpirun, one binary per provider through MK_NET_PROVIDER): the libfabric
//     backend between processes;
//   test_net_loopback (MK_NET_TEST_LOOPBACK, one process): the loopback backend between the
//     threads of a thread world, W = 1..4.
// The exchange at the heart of both: every rank registers a destination window and a source
// window, then puts to every rank (itself included) rank-tagged bytes at unaligned offsets.
// Receivers check each put's bytes when its Arrival comes (data before completion), every
// byte at the end (unwritten bytes keep their poison), and every LocalDone cookie once.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/tunables.h"
#include "mkernel/net/backend.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/topology.h"
#include "src/common/fault.h"
#include "tests/common/test_util.h"

#ifndef MK_NET_TEST_LOOPBACK
#include <fcntl.h>
#include <mpi.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>

#include "mkernel/runtime/bootstrap_mpi.h"
#include "src/net/libfabric/libfabric_internal.h"
#endif

namespace mk {
namespace {

using net::Arrival;
using net::Backend;
using net::LocalDone;
using net::MemKind;
using net::WindowId;
using Clock = std::chrono::steady_clock;

constexpr int64_t kWaitMs = 15000;   // every wait in a test is bounded by this
constexpr uint64_t kSrcShift = 5;    // source regions start at odd offsets...
constexpr uint64_t kDstShift = 3;    // ...and so do destination regions
constexpr int kImmIndexBits = 20;    // imm = src << 20 | put index
constexpr uint32_t kImmIndexMask = (1u << kImmIndexBits) - 1;

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 32;
  return x;
}

// The bytes rank src sends rank dst: a stream keyed by (seed, tag, src, dst), byte `pos`.
uint64_t stream_key(uint64_t tag, int src, int dst) {
  return mix(mix(mix(test::test_seed(), tag), static_cast<uint64_t>(src) + 1),
             static_cast<uint64_t>(dst) + 1);
}
inline uint8_t stream_byte(uint64_t key, uint64_t pos) {
  return static_cast<uint8_t>(mix(key, pos >> 3) >> ((pos & 7) * 8));
}
void fill_stream(uint8_t* p, uint64_t key, uint64_t pos, uint64_t n, bool invert) {
  for (uint64_t i = 0; i < n; ++i) {
    uint8_t b = stream_byte(key, pos + i);
    p[i] = invert ? static_cast<uint8_t>(~b) : b;
  }
}
// Index of the first byte of p that differs from the stream, or n.
uint64_t first_bad(const uint8_t* p, uint64_t key, uint64_t pos, uint64_t n, bool invert) {
  for (uint64_t i = 0; i < n; ++i) {
    uint8_t b = stream_byte(key, pos + i);
    if (p[i] != (invert ? static_cast<uint8_t>(~b) : b)) return i;
  }
  return n;
}

enum class Plan { kRandom, kSmall };

struct PutDesc {
  uint64_t off;    // within the (src, dst) region, the same on both sides
  uint64_t bytes;
};

constexpr uint64_t kRandomRegion = 5ull << 20;
constexpr int kSmallPuts = 3000;
constexpr uint64_t kSmallSlot = 72;

uint64_t region_bytes(Plan p) { return p == Plan::kRandom ? kRandomRegion : kSmallPuts * kSmallSlot; }

// The puts src makes to dst, derived from the seed alone (every rank can compute every plan).
//   kRandom: one zero-byte put, one of 1 B..4 MiB, then 1 B..64 KiB ones (log-uniform) with
//            gaps of 0..40 bytes until the region is full;
//   kSmall:  kSmallPuts puts of 0..64 bytes, one per 72-byte slot (a flood for back-pressure).
std::vector<PutDesc> make_plan(Plan kind, uint64_t tag, int src, int dst) {
  std::mt19937_64 g(stream_key(tag ^ 0x9a11, src, dst));
  std::vector<PutDesc> v;
  const uint64_t region = region_bytes(kind);
  if (kind == Plan::kSmall) {
    for (int i = 0; i < kSmallPuts; ++i)
      v.push_back({static_cast<uint64_t>(i) * kSmallSlot + g() % 7, g() % 65});
    return v;
  }
  uint64_t off = g() % 61;
  v.push_back({off, 0});
  uint64_t big = 1 + g() % (4ull << 20);
  v.push_back({off, big});
  off += big + g() % 41;
  for (;;) {
    uint64_t bytes = std::max<uint64_t>(1, static_cast<uint64_t>(std::exp2((g() % 1601) / 100.0)));
    if (off + bytes > region) break;
    v.push_back({off, bytes});
    off += bytes + g() % 41;
  }
  std::shuffle(v.begin(), v.end(), g);  // issue order is not address order
  return v;
}

struct Stats {
  uint64_t puts = 0;
  uint64_t bytes = 0;
  uint64_t eagain = 0;
  double seconds = 0;
};

// Collects the first few failures of a rank as text (works from any thread).
struct Failures {
  std::string text;
  int count = 0;
  void add(const std::string& s) {
    if (count++ < 8) text += (text.empty() ? "" : "\n") + s;
  }
  bool any() const { return count > 0; }
};

// The exchange, run by every rank (a process or a thread). Returns "" or what went wrong.
// Collectives (register/deregister) are always reached, even after a failure, so one rank's
// failure shows as a message rather than as the other ranks hanging.
std::string run_exchange(Bootstrap& bs, Backend& be, Plan kind, uint64_t tag, Stats* st) {
  const int me = bs.rank(), W = bs.size();
  const uint64_t R = region_bytes(kind);
  Failures f;
  auto where = [&](const std::string& s) { return "rank " + std::to_string(me) + ": " + s; };

  // Source: region for dst d at d*R + kSrcShift holds stream(me, d). Destination: region for
  // src s at s*R + kDstShift starts as the complement of stream(s, me); the rest is 0xA5.
  std::vector<uint8_t> src(W * R + 16), dst(W * R + 16, 0xA5);
  for (int d = 0; d < W; ++d) fill_stream(src.data() + d * R + kSrcShift, stream_key(tag, me, d), 0, R, false);
  for (int s = 0; s < W; ++s) fill_stream(dst.data() + s * R + kDstShift, stream_key(tag, s, me), 0, R, true);
  std::vector<std::vector<PutDesc>> out_plan(W), in_plan(W);
  for (int p = 0; p < W; ++p) {
    out_plan[p] = make_plan(kind, tag, me, p);
    in_plan[p] = make_plan(kind, tag, p, me);
    if (out_plan[p].size() > kImmIndexMask) f.add(where("plan too long for the imm encoding"));
  }

  WindowId wdst = net::kNoWindow, wsrc = net::kNoWindow;
  Status s = be.register_window(dst.data(), dst.size(), MemKind::kHost, &wdst);
  if (!s.ok()) return where("register dst: " + s.to_string());
  s = be.register_window(src.data(), src.size(), MemKind::kHost, &wsrc);
  if (!s.ok()) return where("register src: " + s.to_string());
  for (int p = 0; p < W; ++p) {
    if (be.window_size(wdst, p) != W * R + 16 || be.window_size(wsrc, p) != W * R + 16)
      f.add(where("window_size of rank " + std::to_string(p) + " is wrong"));
  }

  // Book-keeping.
  std::vector<std::vector<uint8_t>> done_seen(W), arr_seen(W);
  std::vector<uint64_t> arr_count(W, 0);
  uint64_t expected_arrivals = 0, expected_done = 0, n_done = 0, n_arr = 0;
  for (int p = 0; p < W; ++p) {
    done_seen[p].assign(out_plan[p].size(), 0);
    arr_seen[p].assign(in_plan[p].size(), 0);
    expected_arrivals += in_plan[p].size();
    expected_done += out_plan[p].size();
  }
  std::vector<LocalDone> done;
  std::vector<Arrival> arrivals;
  auto drain = [&]() -> bool {
    done.clear();
    arrivals.clear();
    Status ps = be.progress(&done, &arrivals);
    if (!ps.ok()) {
      f.add(where("progress: " + ps.to_string()));
      return false;
    }
    for (const LocalDone& d : done) {
      const int p = static_cast<int>(d.cookie >> 32);
      const uint64_t i = d.cookie & 0xffffffffu;
      if (p < 0 || p >= W || i >= done_seen[p].size()) {
        f.add(where("LocalDone with a cookie never used: " + std::to_string(d.cookie)));
        continue;
      }
      if (done_seen[p][i]++) f.add(where("LocalDone twice for put " + std::to_string(i) + " to rank " + std::to_string(p)));
      ++n_done;
    }
    for (const Arrival& a : arrivals) {
      const int p = static_cast<int>(a.imm >> kImmIndexBits);
      const uint32_t i = a.imm & kImmIndexMask;
      if (p >= W || i >= arr_seen[p].size()) {
        f.add(where("Arrival with an imm never sent: " + std::to_string(a.imm)));
        continue;
      }
      if (arr_seen[p][i]++) f.add(where("Arrival twice for put " + std::to_string(i) + " of rank " + std::to_string(p)));
      ++arr_count[p];
      ++n_arr;
      const PutDesc& pd = in_plan[p][i];
      const uint8_t* at = dst.data() + p * R + kDstShift + pd.off;
      uint64_t bad = first_bad(at, stream_key(tag, p, me), pd.off, pd.bytes, false);
      if (bad != pd.bytes)
        f.add(where("put " + std::to_string(i) + " of rank " + std::to_string(p) + " (" +
                    std::to_string(pd.bytes) + " bytes at +" + std::to_string(pd.off) +
                    "): byte " + std::to_string(bad) + " not there when its Arrival came"));
    }
    return true;
  };

  // Issue every put, interleaved over the destinations; progress only when refused.
  struct Op {
    int peer;
    uint32_t index;
  };
  std::vector<Op> ops;
  for (int p = 0; p < W; ++p)
    for (uint32_t i = 0; i < out_plan[p].size(); ++i) ops.push_back({p, i});
  std::mt19937_64 g(stream_key(tag ^ 0x155e, me, me));
  std::shuffle(ops.begin(), ops.end(), g);
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(kWaitMs);
  bool alive = !f.any();
  for (size_t k = 0; alive && k < ops.size(); ++k) {
    const Op& op = ops[k];
    const PutDesc& pd = out_plan[op.peer][op.index];
    const uint32_t imm = static_cast<uint32_t>(me) << kImmIndexBits | op.index;
    const uint64_t cookie = static_cast<uint64_t>(op.peer) << 32 | op.index;
    for (;;) {
      bool posted = false;
      Status ps = be.put(op.peer, wsrc, op.peer * R + kSrcShift + pd.off, wdst,
                         me * R + kDstShift + pd.off, pd.bytes, imm, cookie, &posted);
      if (!ps.ok()) {
        f.add(where("put to rank " + std::to_string(op.peer) + ": " + ps.to_string()));
        alive = false;
        break;
      }
      if (posted) {
        ++st->puts;
        st->bytes += pd.bytes;
        break;
      }
      ++st->eagain;
      const bool drained = drain();
      if (drained && done.empty() && arrivals.empty()) std::this_thread::yield();
      if (!drained || Clock::now() > deadline) {
        if (Clock::now() > deadline) f.add(where("put to rank " + std::to_string(op.peer) + " refused until the deadline"));
        alive = false;
        break;
      }
    }
  }
  // Wait for every LocalDone and every Arrival.
  while (alive && (n_done < expected_done || n_arr < expected_arrivals)) {
    if (!drain()) break;
    if (Clock::now() > deadline) {
      std::string miss;
      for (int p = 0; p < W; ++p)
        if (arr_count[p] < in_plan[p].size())
          miss += " rank " + std::to_string(p) + ": " + std::to_string(arr_count[p]) + "/" +
                  std::to_string(in_plan[p].size()) + ";";
      f.add(where("after " + std::to_string(kWaitMs) + " ms: LocalDone " + std::to_string(n_done) +
                  "/" + std::to_string(expected_done) + ", arrivals" + (miss.empty() ? " complete" : miss)));
      break;
    }
    if (done.empty() && arrivals.empty()) std::this_thread::yield();
  }
  st->seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  // Every byte: written ranges hold the stream, the rest of each region its complement, the
  // gaps between regions 0xA5.
  if (!f.any()) {
    for (int p = 0; p < W; ++p) {
      std::vector<uint8_t> written(R, 0);
      for (const PutDesc& pd : in_plan[p]) memset(written.data() + pd.off, 1, pd.bytes);
      const uint64_t key = stream_key(tag, p, me);
      const uint8_t* region = dst.data() + p * R + kDstShift;
      uint64_t bad = 0;
      std::string first;
      for (uint64_t i = 0; i < R; ++i) {
        uint8_t want = written[i] ? stream_byte(key, i) : static_cast<uint8_t>(~stream_byte(key, i));
        if (region[i] != want && bad++ == 0)
          first = std::string(written[i] ? "written" : "unwritten") + " byte +" + std::to_string(i);
      }
      if (bad) f.add(where(std::to_string(bad) + " wrong bytes from rank " + std::to_string(p) + "; first: " + first));
    }
    for (int p = 0; p <= W; ++p) {
      const uint64_t lo = p == 0 ? 0 : (p - 1) * R + kDstShift + R;
      const uint64_t hi = p == W ? dst.size() : p * R + kDstShift;
      for (uint64_t i = lo; i < hi; ++i)
        if (dst[i] != 0xA5) {
          f.add(where("byte " + std::to_string(i) + " outside every region was written"));
          break;
        }
    }
  }
  s = be.deregister_window(wsrc);
  if (!s.ok()) f.add(where("deregister src: " + s.to_string()));
  s = be.deregister_window(wdst);
  if (!s.ok()) f.add(where("deregister dst: " + s.to_string()));
  // Completions the quiesce of deregister may have kept must not be duplicates.
  if (s.ok()) {
    done.clear();
    arrivals.clear();
    Status ps = be.progress(&done, &arrivals);
    if (!ps.ok()) f.add(where("progress after deregister: " + ps.to_string()));
    if (!done.empty() || !arrivals.empty()) f.add(where("completions after everything was seen"));
  }
  return f.text;
}

// Windows of different sizes, a zero-byte window, repeat deregistration, GPU kind without
// FI_HMEM, puts into a dead window, finalize twice.
std::string run_windows(Bootstrap& bs, Backend& be, bool expect_cuda_refused) {
  const int me = bs.rank(), W = bs.size();
  Failures f;
  auto where = [&](const std::string& s) { return "rank " + std::to_string(me) + ": " + s; };
  std::vector<uint8_t> a((me + 1) * 4096 + me, 0x11);
  WindowId wa = net::kNoWindow, wz = net::kNoWindow;
  Status s = be.register_window(a.data(), a.size(), MemKind::kHost, &wa);
  if (!s.ok()) return where("register: " + s.to_string());
  for (int p = 0; p < W; ++p)
    if (be.window_size(wa, p) != static_cast<uint64_t>((p + 1) * 4096 + p))
      f.add(where("window_size(" + std::to_string(p) + ") = " + std::to_string(be.window_size(wa, p))));
  if (be.window_size(wa, W) != 0 || be.window_size(wa, -1) != 0 || be.window_size(wa + 7, 0) != 0)
    f.add(where("window_size of an unknown rank or window is not 0"));
  // Rank 0's copy of window z has no bytes at all; zero-byte puts into it must arrive.
  std::vector<uint8_t> z(64, 0x22);
  s = be.register_window(me == 0 ? nullptr : z.data(), me == 0 ? 0 : z.size(), MemKind::kHost, &wz);
  if (!s.ok()) return where("register zero-byte window: " + s.to_string());
  if (be.window_size(wz, 0) != 0) f.add(where("zero-byte window has a size"));
  const int kZeroPuts = 3;
  std::vector<int> got(W * kZeroPuts, 0);
  size_t nd = 0, na = 0;
  const size_t want_a = me == 0 ? static_cast<size_t>(W * kZeroPuts) : 0;
  auto count = [&]() {
    std::vector<LocalDone> d;
    std::vector<Arrival> ar;
    Status ps = be.progress(&d, &ar);
    if (!ps.ok()) {
      f.add(where("progress: " + ps.to_string()));
      return false;
    }
    nd += d.size();
    for (const Arrival& x : ar) {
      uint32_t i = x.imm - 0x7000u;
      if (i >= got.size() || got[i]++) f.add(where("unexpected zero-byte arrival " + std::to_string(x.imm)));
      ++na;
    }
    return true;
  };
  auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
  for (int k = 0; k < kZeroPuts && !f.any(); ++k) {
    WindowId from = k == 0 ? wz : wa;
    for (;;) {
      bool posted = false;
      s = be.put(0, from, 0, wz, 0, 0, 0x7000u + static_cast<uint32_t>(me * kZeroPuts + k),
                 1000 + k, &posted);
      if (!s.ok()) {
        f.add(where("zero-byte put: " + s.to_string()));
        break;
      }
      if (posted) break;
      if (Clock::now() > deadline) {
        f.add(where("zero-byte put refused until the deadline"));
        break;
      }
      if (!count()) break;
    }
  }
  // Every rank's LocalDones; rank 0 also W * kZeroPuts arrivals.
  while (!f.any() && (nd < static_cast<size_t>(kZeroPuts) || na < want_a)) {
    if (!count()) break;
    if (Clock::now() > deadline) {
      f.add(where("zero-byte puts: " + std::to_string(nd) + " LocalDone, " + std::to_string(na) +
                  "/" + std::to_string(want_a) + " arrivals by the deadline"));
      break;
    }
  }
  // GPU memory without FI_HMEM: refused on every rank, nothing registered.
  if (expect_cuda_refused) {
    WindowId wc = 12345;
    s = be.register_window(a.data(), a.size(), MemKind::kCuda, &wc);
    if (s.code() != Code::kNotSupported) f.add(where("kCuda window without FI_HMEM: " + s.to_string()));
    if (wc != net::kNoWindow) f.add(where("a refused window got an id"));
  }
  s = be.deregister_window(wz);
  if (!s.ok()) f.add(where("deregister z: " + s.to_string()));
  s = be.deregister_window(wa);
  if (!s.ok()) f.add(where("deregister a: " + s.to_string()));
  s = be.deregister_window(wa);  // idempotent
  if (!s.ok()) f.add(where("second deregister: " + s.to_string()));
  if (be.window_size(wa, me) != 0) f.add(where("a dead window still has a size"));
  bool posted = true;
  s = be.put(me, wa, 0, wa, 0, 1, 1, 1, &posted);
  if (s.ok() || posted) f.add(where("a put into a dead window was accepted"));
  if (be.deregister_window(999).code() != Code::kInvalidArgument)
    f.add(where("deregister of an unknown window is not kInvalidArgument"));
  s = be.finalize();
  if (!s.ok()) f.add(where("finalize: " + s.to_string()));
  s = be.finalize();
  if (!s.ok()) f.add(where("second finalize: " + s.to_string()));
  posted = true;
  s = be.put(me, wa, 0, wa, 0, 1, 1, 1, &posted);
  if (s.ok() || posted) f.add(where("a put after finalize was accepted"));
  return f.text;
}

std::string describe(const Stats& st, int rank) {
  char b[200];
  snprintf(b, sizeof(b), "rank %d: %llu puts, %.1f MiB in %.2f s, %llu refused (posted=false)", rank,
           static_cast<unsigned long long>(st.puts), st.bytes / 1048576.0, st.seconds,
           static_cast<unsigned long long>(st.eagain));
  return b;
}

Status make_topology(Bootstrap& bs, Topology* topo) {
  std::vector<RankInfo> infos(bs.size());
  RankInfo mine = local_host_info(bs.rank());
  Status s = bs.allgather(&mine, infos.data(), sizeof(RankInfo));
  if (!s.ok()) return s;
  return build_topology(bs.rank(), infos, 0, nullptr, topo);
}

// Bounds every collective of a test, so a broken rank surfaces as an error, not a hang.
void bound_timeouts() {
  (void)tunables::set("bootstrap_timeout_ms", "20000");
  (void)tunables::set("net_timeout_ms", "15000");
}

#ifndef MK_NET_TEST_LOOPBACK
// ---------------------------------------------------------------------------------------
// libfabric, one process per rank. MK_NET_PROVIDER (set by ctest) names the provider.

std::string provider_under_test() {
  const char* p = getenv("MK_NET_PROVIDER");
  return p && *p ? p : "auto";
}

class NetMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    bound_timeouts();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MK_ASSERT_OK(make_mpi_bootstrap(MPI_COMM_WORLD, &bs_));
    MK_ASSERT_OK(make_topology(*bs_, &topo_));
  }
  void TearDown() override {
    if (be_) (void)be_->finalize();
    be_.reset();
    bs_.reset();
    MPI_Barrier(MPI_COMM_WORLD);
  }
  Status create(const std::string& provider = "") {
    net::BackendConfig cfg;
    cfg.kind = "libfabric";
    cfg.provider = provider;
    return net::create_backend(*bs_, topo_, cfg, &be_);
  }
  // Failures of every rank reach rank 0's report too.
  void expect_empty_everywhere(const std::string& mine) {
    char buf[1024] = {0};
    snprintf(buf, sizeof(buf), "%s", mine.c_str());
    std::vector<char> all(sizeof(buf) * size_);
    MK_ASSERT_OK(bs_->allgather(buf, all.data(), sizeof(buf)));
    for (int r = 0; r < size_; ++r)
      EXPECT_STREQ(all.data() + r * sizeof(buf), "") << "(reported by rank " << r << ")";
  }
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Bootstrap> bs_;
  Topology topo_;
  std::unique_ptr<Backend> be_;
};

TEST_F(NetMpi, NameAndCaps) {
  MK_ASSERT_OK(create());
  const std::string want = provider_under_test();
  const std::string name = be_->name();
  EXPECT_EQ(name.rfind("libfabric/", 0), 0u) << name;
  // The backend reads "tcp_rxm" as "tcp;ofi_rxm" (the spelling ctest uses: no ';' in a list).
  std::string full = want;
  for (const char* u : {"_rxm", "_rxd"}) {
    size_t at = full.find(u);
    if (at != std::string::npos && full.find(';') == std::string::npos)
      full = full.substr(0, at) + ";ofi_" + (u + 1);
  }
  if (want != "auto") {
    EXPECT_EQ(name, "libfabric/" + full);
  }
  if (rank_ == 0) printf("provider under test: %s -> backend %s\n", want.c_str(), name.c_str());
  net::BackendCaps c = be_->caps();
  EXPECT_GE(c.imm_bytes, 4u);
  EXPECT_GE(c.max_put_bytes, 4ull << 20);
  EXPECT_FALSE(c.cuda_windows) << "no GPU here, so no FI_HMEM";
  EXPECT_EQ(be_->api_version(), net::kBackendApiVersion);
  std::vector<std::string> provs = net::libfabric_providers();
  EXPECT_NE(std::find(provs.begin(), provs.end(), name.substr(strlen("libfabric/"))), provs.end())
      << "libfabric_providers() lacks " << name;
  MK_EXPECT_OK(be_->finalize());
  MK_EXPECT_OK(be_->finalize());
}

TEST_F(NetMpi, RandomPutsEveryPair) {
  MK_ASSERT_OK(create());
  Stats st;
  std::string err = run_exchange(*bs_, *be_, Plan::kRandom, 1, &st);
  printf("[%s] random: %s\n", be_->name(), describe(st, rank_).c_str());
  expect_empty_everywhere(err);
  MK_EXPECT_OK(be_->finalize());
}

TEST_F(NetMpi, FloodOfSmallPuts) {
  MK_ASSERT_OK(create());
  Stats st;
  std::string err = run_exchange(*bs_, *be_, Plan::kSmall, 2, &st);
  printf("[%s] flood: %s\n", be_->name(), describe(st, rank_).c_str());
  expect_empty_everywhere(err);
  // The same backend again: windows come and go, ids keep counting.
  Stats st2;
  err = run_exchange(*bs_, *be_, Plan::kRandom, 3, &st2);
  expect_empty_everywhere(err);
  MK_EXPECT_OK(be_->finalize());
}

TEST_F(NetMpi, Windows) {
  MK_ASSERT_OK(create());
  expect_empty_everywhere(run_windows(*bs_, *be_, /*expect_cuda_refused=*/true));
}

// Ranks posing as separate hosts: "auto" must skip shm and take tcp;ofi_rxm on a routable
// (non-loopback) fabric. It does not depend on the provider under test: every suite runs it.
// Memory keys are drawn at random (issue 39): a process that can reach an endpoint (another
// user's, on tcp any host that reaches the listener) must not be able to guess the key of a
// window and write into it. Keys numbered 1, 2, 3 ... in registration order (as before) fail
// every check here. Where the provider chooses the keys (FI_MR_PROV_KEY) ours are not used.
TEST_F(NetMpi, MemoryKeysAreNotGuessable) {
  MK_ASSERT_OK(create());
  auto* lf = dynamic_cast<net::lf::LibfabricBackend*>(be_.get());
  ASSERT_NE(lf, nullptr);
  if (lf->provider_keys()) GTEST_SKIP() << be_->name() << " chooses its own memory keys";
  constexpr int kWindows = 16;
  std::vector<std::vector<uint8_t>> mem(kWindows, std::vector<uint8_t>(4096));
  std::vector<net::WindowId> ids(kWindows);
  for (int i = 0; i < kWindows; ++i) MK_ASSERT_OK(be_->register_window(mem[i].data(), 4096, net::MemKind::kHost, &ids[i]));
  std::string why;
  std::vector<uint64_t> keys;
  for (int i = 0; i < kWindows; ++i)
    for (int r = 0; r < size_; ++r) keys.push_back(lf->window_key(ids[i], r));
  const uint64_t small = lf->key_bits() >= 32 ? uint64_t(1) << 20 : 0;
  for (uint64_t k : keys)
    if (k == 0 || k < small) why = "key " + std::to_string(k) + " is small enough to guess";
  std::vector<uint64_t> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) why = "two windows share a key";
  bool progression = true;  // this rank's keys in registration order, a fixed step apart
  for (int i = 2; i < kWindows; ++i)
    progression &= keys[size_t(i) * size_] - keys[size_t(i - 1) * size_] ==
                   keys[size_t(i - 1) * size_] - keys[size_t(i - 2) * size_];
  if (progression) why = "the keys of successive windows are a fixed step apart";
  if (lf->key_bits() < 64)
    for (uint64_t k : keys)
      if (k >> lf->key_bits()) why = "key " + std::to_string(k) + " exceeds the provider's key size";
  for (int i = 0; i < kWindows; ++i) MK_ASSERT_OK(be_->deregister_window(ids[i]));
  expect_empty_everywhere(why);
}

// A bare endpoint of libfabric's own (the test's tool: for planting shm regions, or standing in
// for a stranger; mkernel's backend is what is under test). `why` says what failed before
// fi_enable; enable_ret is fi_enable's return (1: not reached).
struct RawEndpoint {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_cq* cq = nullptr;
  fid_av* av = nullptr;
  fid_ep* ep = nullptr;
  int enable_ret = 1;
  std::string why;

  RawEndpoint(const std::string& prov, uint64_t caps) {
    fi_info* hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = caps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->fabric_attr->prov_name = strdup(prov.c_str());
    int ret = fi_getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints, &info);
    fi_freeinfo(hints);
    if (ret || !info) { why = "fi_getinfo(" + prov + "): " + std::to_string(ret); return; }
    if ((ret = fi_fabric(info->fabric_attr, &fabric, nullptr))) { why = "fi_fabric"; return; }
    if ((ret = fi_domain(fabric, info, &domain, nullptr))) { why = "fi_domain"; return; }
    fi_cq_attr cqa;
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    if ((ret = fi_cq_open(domain, &cqa, &cq, nullptr))) { why = "fi_cq_open"; return; }
    fi_av_attr ava;
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    if ((ret = fi_av_open(domain, &ava, &av, nullptr))) { why = "fi_av_open"; return; }
    if ((ret = fi_endpoint(domain, info, &ep, nullptr))) { why = "fi_endpoint"; return; }
    if (fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) || fi_ep_bind(ep, &av->fid, 0)) {
      why = "fi_ep_bind";
      return;
    }
    enable_ret = fi_enable(ep);
  }
  std::string name() const {
    char b[256] = {0};
    size_t len = sizeof(b) - 1;
    return ep && fi_getname(&ep->fid, b, &len) == 0 ? std::string(b) : std::string();
  }
  virtual ~RawEndpoint() {
    for (fid* f : {ep ? &ep->fid : nullptr, av ? &av->fid : nullptr, cq ? &cq->fid : nullptr,
                   domain ? &domain->fid : nullptr, fabric ? &fabric->fid : nullptr})
      if (f) (void)fi_close(f);
    if (info) fi_freeinfo(info);
  }
};
struct RawShmEndpoint : RawEndpoint {
  RawShmEndpoint() : RawEndpoint("shm", FI_MSG) {}
};

// An endpoint of this job's provider that is not of this job: a stranger (another user's
// process, or any host that reaches a tcp listener). The test's tool; the backend is under test.
struct StrangerEndpoint : RawEndpoint {
  fid_mr* mr = nullptr;
  std::vector<uint8_t> buf = std::vector<uint8_t>(256);
  fi_addr_t target = FI_ADDR_NOTAVAIL;

  StrangerEndpoint(const std::string& prov, const std::vector<uint8_t>& target_addr)
      : RawEndpoint(prov, FI_MSG | FI_RMA) {
    if (!why.empty()) return;
    if (enable_ret) { why = std::string("fi_enable: ") + fi_strerror(-enable_ret); return; }
    if (int ret = fi_mr_reg(domain, buf.data(), buf.size(), FI_SEND | FI_WRITE, 0, 0, 0, &mr, nullptr)) {
      why = std::string("fi_mr_reg: ") + fi_strerror(-ret);
      return;
    }
    if (fi_av_insert(av, target_addr.data(), 1, &target, 0, nullptr) != 1) why = "fi_av_insert";
  }
  // Sends `bytes` of buf (with remote CQ data `imm` when with_data); false once it cannot.
  bool send(size_t bytes, bool with_data, uint64_t imm, fi_context2* ctx) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < end) {
      ssize_t r = with_data ? fi_senddata(ep, buf.data(), bytes, fi_mr_desc(mr), imm, target, ctx)
                            : fi_send(ep, buf.data(), bytes, fi_mr_desc(mr), target, ctx);
      if (r == 0) return true;
      if (r != -FI_EAGAIN) {
        why = std::string("send: ") + fi_strerror(static_cast<int>(-r));
        return false;
      }
      progress();
    }
    why = "send: EAGAIN for 10 s";
    return false;
  }
  void progress() {
    fi_cq_data_entry e[8];
    while (fi_cq_read(cq, e, 8) > 0) {
    }
    fi_cq_err_entry err;
    memset(&err, 0, sizeof(err));
    (void)fi_cq_readerr(cq, &err, 0);
  }
  ~StrangerEndpoint() override {
    if (mr) (void)fi_close(&mr->fid);
  }
};

// What a stranger does, in a process of its own (fork()ed from rank 0: a process outside the
// job, as another user's would be). Exits 0 once its messages were posted and it progressed a
// while; kStrangerNoStart when its own endpoint could not start (the tool's failure, not the
// backend's: libfabric's state is the parent's copy in a forked child, and shm has refused a
// stranger's endpoint with EBUSY once in many runs); 2 (with a line on stderr) when it could
// not do what it was sent for.
constexpr int kStrangerNoStart = 3;
struct StrangerPlan {
  bool messages = false;  // a message with remote CQ data 0x1003, and a quiet message claiming rank 1
  std::vector<uint64_t> keys;  // writes with remote CQ data 0x2003 to `addr` + 64, one per key
  uint64_t addr = 0;
};
[[noreturn]] void stranger_main(const std::string& prov, const std::vector<uint8_t>& target, const StrangerPlan& plan) {
  StrangerEndpoint s(prov, target);
  auto die = [&](const std::string& what) {
    fprintf(stderr, "stranger: %s (%s)\n", what.c_str(), s.why.c_str());
    _exit(2);
  };
  if (!s.why.empty()) {
    fprintf(stderr, "stranger: could not start (%s)\n", s.why.c_str());
    _exit(kStrangerNoStart);
  }
  fi_context2 ctx[16];
  int c = 0;
  if (plan.messages) {
    if (!s.send(8, true, 0x1003, &ctx[c++])) die("could not send");
    const net::lf::QuietMsg q{net::lf::kQuietMagic, 99, 1, 0};  // "rank 1 is quiet at epoch 99"
    memcpy(s.buf.data() + 64, &q, sizeof(q));
    memmove(s.buf.data(), s.buf.data() + 64, sizeof(q));
    if (!s.send(sizeof(q), false, 0, &ctx[c++])) die("could not send");
  }
  memset(s.buf.data(), 0xde, 8);
  for (uint64_t k : plan.keys) {
    ssize_t r = -FI_EAGAIN;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (r == -FI_EAGAIN && std::chrono::steady_clock::now() < end) {
      r = fi_writedata(s.ep, s.buf.data(), 8, fi_mr_desc(s.mr), 0x2003, s.target, plan.addr + 64, k, &ctx[c++ % 16]);
      s.progress();
    }
    if (r != 0) die("could not post a write");
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() < end) s.progress();
  _exit(0);
}

std::string run_stranger_once(Backend& be, const std::string& prov, const std::vector<uint8_t>& target,
                              const StrangerPlan& plan, std::vector<net::Arrival>* arrivals,
                              const std::function<bool()>& done_early, bool* no_start);

// Runs the stranger against rank 0 while rank 0's backend progresses; returns "" or what failed.
std::string run_stranger(Backend& be, const std::string& prov, const std::vector<uint8_t>& target,
                         const StrangerPlan& plan, std::vector<net::Arrival>* arrivals,
                         const std::function<bool()>& done_early = nullptr) {
  for (int attempt = 1;; ++attempt) {
    bool no_start = false;
    std::string why = run_stranger_once(be, prov, target, plan, arrivals, done_early, &no_start);
    // A stranger that could not start its own endpoint (no traffic sent) is started again, in a
    // new process; three in a row is the test's failure.
    if (!no_start || attempt == 3) return why;
  }
}

std::string run_stranger_once(Backend& be, const std::string& prov, const std::vector<uint8_t>& target,
                              const StrangerPlan& plan, std::vector<net::Arrival>* arrivals,
                              const std::function<bool()>& done_early, bool* no_start) {
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) stranger_main(prov, target, plan);
  std::vector<net::LocalDone> done;
  int status = 0;
  bool exited = false;
  std::string why;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  auto after = std::chrono::steady_clock::time_point::max();
  while (std::chrono::steady_clock::now() < end && std::chrono::steady_clock::now() < after) {
    Status p = be.progress(&done, arrivals);
    if (!p.ok() && why.empty()) why = "the job failed on the stranger's traffic: " + p.to_string();
    if (!exited && waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      after = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);  // what is still in flight
    }
    if (done_early && done_early()) break;
  }
  if (!exited) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    if (!done_early || !done_early()) return why.empty() ? "the stranger did not finish" : why;
  } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *no_start = WIFEXITED(status) && WEXITSTATUS(status) == kStrangerNoStart;
    return why.empty() ? "the stranger failed (see its line on stderr)" : why;
  }
  return why;
}

std::string provider_of(const Backend& be) {
  std::string prov = be.name();
  return prov.substr(prov.find('/') + 1);
}

// Memory keys are random, but a stranger can still send: a message with remote CQ data lands in
// a posted receive exactly as a remote write's arrival does, and a control message can claim any
// rank. Where the provider names senders (FI_SOURCE), both are dropped and counted, never an
// arrival (before, the stranger's imm 0x1003 arrived as flag 0x1003). Rank 0 is the target; the
// stranger is a process of its own.
TEST_F(NetMpi, ArrivalsFromOutsideTheJobAreDropped) {
  MK_ASSERT_OK(create());
  auto* lf = dynamic_cast<net::lf::LibfabricBackend*>(be_.get());
  ASSERT_NE(lf, nullptr);
  // Registered only for providers that check (tests/cpu/CMakeLists.txt): it must be on.
  ASSERT_TRUE(lf->checks_senders()) << be_->name() << " does not check senders";
  std::string why;
  if (rank_ == 0) {
    StrangerPlan plan;
    plan.messages = true;
    std::vector<net::Arrival> arrivals;
    why = run_stranger(*be_, provider_of(*be_), lf->endpoint_address(), plan, &arrivals,
                       [&] { return lf->strangers_dropped() >= 2; });
    for (const auto& a : arrivals)
      if (a.imm == 0x1003) why = "the stranger's imm 0x1003 arrived";
    if (why.empty() && lf->strangers_dropped() < 2)
      why = "only " + std::to_string(lf->strangers_dropped()) + " of the stranger's 2 messages were dropped";
  }
  expect_empty_everywhere(why);
  // The job's own traffic still arrives.
  expect_empty_everywhere(run_windows(*bs_, *be_, /*expect_cuda_refused=*/true));
  MK_EXPECT_OK(be_->finalize());
}

// The sender check follows net_check_senders: auto on tcp;ofi_rxm only (the provider whose sender
// names were checked here), on wherever FI_SOURCE is offered, off nowhere. (`on` is tried on
// tcp only: on udp;ofi_rxd and shm it drops the job's own messages, as documented, and the
// job fails.)
TEST_F(NetMpi, SenderCheckFollowsTheSetting) {
  for (const char* v : {"auto", "on", "off"}) {
    if (std::string(v) == "on" && provider_under_test() != "tcp_rxm") continue;
    MK_ASSERT_OK(tunables::set("net_check_senders", v));
    Status s = create();
    if (s.ok()) {
      auto* lf = dynamic_cast<net::lf::LibfabricBackend*>(be_.get());
      ASSERT_NE(lf, nullptr);
      const bool want = std::string(v) == "on" || (std::string(v) == "auto" && provider_of(*be_) == "tcp;ofi_rxm");
      EXPECT_EQ(lf->checks_senders(), want) << v << " on " << be_->name();
      MK_EXPECT_OK(be_->finalize());
      be_.reset();
    }
    MK_ASSERT_OK(tunables::reset("net_check_senders"));
    MK_ASSERT_OK(s);
  }
}

// The finding itself: a stranger that reaches rank 0 writes with guessed keys — 1, 2, 3, 4 (what
// registration order gave before), 0, and the real key with one bit flipped — into rank 0's
// window, with remote CQ data: not a byte changes, no arrival appears, and the job goes on. A
// control with the real key shows that the stranger's writes do reach the window (so the
// refusals are the keys', not a path that never worked).
TEST_F(NetMpi, AStrangerCannotWriteAWindowWithoutItsKey) {
  MK_ASSERT_OK(create());
  auto* lf = dynamic_cast<net::lf::LibfabricBackend*>(be_.get());
  ASSERT_NE(lf, nullptr);
  std::vector<uint8_t> mem(4096, 0x11);
  net::WindowId id = net::kNoWindow;
  MK_ASSERT_OK(be_->register_window(mem.data(), mem.size(), net::MemKind::kHost, &id));
  std::string why;
  if (rank_ == 0) {
    const uint64_t key = lf->window_key(id, 0);
    StrangerPlan guesses;
    guesses.addr = lf->window_addr(id, 0);
    for (uint64_t g : {uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{4}, uint64_t{0}, key ^ 1})
      if (g != key) guesses.keys.push_back(g);
    std::vector<net::Arrival> arrivals;
    why = run_stranger(*be_, provider_of(*be_), lf->endpoint_address(), guesses, &arrivals);
    if (why.empty() && mem[64] != 0x11) why = "a write with a guessed key changed the window";
    for (const auto& a : arrivals)
      if (a.imm == 0x2003) why = "a write with a guessed key arrived (imm 0x2003)";
    if (why.empty()) {
      StrangerPlan control = guesses;
      control.keys = {key};
      why = run_stranger(*be_, provider_of(*be_), lf->endpoint_address(), control, &arrivals,
                         [&] { return mem[64] == 0xde; });
      if (why.empty() && mem[64] != 0xde) why = "the control write with the real key never landed";
    }
  }
  expect_empty_everywhere(why);
  MK_EXPECT_OK(be_->deregister_window(id));
  MK_EXPECT_OK(be_->finalize());
}

TEST_F(NetMpi, AutoAcrossHostsTakesTcp) {
  std::vector<RankInfo> infos = topo_.info;
  for (int r = 0; r < size_; ++r) infos[r].host_hash ^= 0x5151000000000000ull + static_cast<uint64_t>(r);
  Topology several;
  MK_ASSERT_OK(build_topology(rank_, infos, 0, nullptr, &several));
  ASSERT_EQ(several.num_nodes, size_);
  net::BackendConfig cfg;
  cfg.kind = "libfabric";
  cfg.provider = "auto";
  MK_ASSERT_OK(net::create_backend(*bs_, several, cfg, &be_));
  EXPECT_STREQ(be_->name(), "libfabric/tcp;ofi_rxm");
  expect_empty_everywhere(run_windows(*bs_, *be_, /*expect_cuda_refused=*/true));
}

TEST_F(NetMpi, UnknownProviderIsNamed) {
  Status s = create("no_such_provider");
  EXPECT_EQ(s.code(), Code::kNotSupported) << s.to_string();
  EXPECT_NE(s.message().find("no_such_provider"), std::string::npos) << s.message();
  EXPECT_EQ(be_, nullptr);
  // The job carries on: a good backend right after.
  MK_ASSERT_OK(create());
  MK_EXPECT_OK(be_->finalize());
}

TEST_F(NetMpi, OtherKinds) {
  net::BackendConfig cfg;
  cfg.kind = "carrier_pigeon";
  EXPECT_EQ(net::create_backend(*bs_, topo_, cfg, &be_).code(), Code::kInvalidArgument);
  cfg.kind = "loopback";
  Status s = net::create_backend(*bs_, topo_, cfg, &be_);
  if (size_ == 1) {
    MK_EXPECT_OK(s);
  } else {
    EXPECT_EQ(s.code(), Code::kNotSupported) << s.to_string();
    EXPECT_NE(s.message().find("process"), std::string::npos) << s.message();
  }
}

// A window registration refused on one rank (MK_FAULT register:error, as a provider out of
// registrable memory would): every rank's register_window returns the same error naming that
// rank, nothing is registered, and the backend goes on (the next registration works).
TEST_F(NetMpi, RegistrationRefusedOnOneRankIsNamedEverywhere) {
  if (size_ < 2) GTEST_SKIP() << "needs two ranks";
  const int culprit = size_ - 1;
  MK_ASSERT_OK(tunables::set("fault", "register:error@" + std::to_string(culprit) + "#1"));
  fault::reload();
  MK_ASSERT_OK(create());
  std::vector<uint8_t> buf(4096, 1);
  WindowId id = 7;
  Status s = be_->register_window(buf.data(), buf.size(), MemKind::kHost, &id);
  MK_ASSERT_OK(tunables::reset("fault"));
  fault::reload();
  EXPECT_EQ(s.code(), Code::kSystemError) << s.to_string();
  EXPECT_NE(s.message().find("failed on rank(s) " + std::to_string(culprit) + ":"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("refused 4096 bytes (planted by MK_FAULT=register:error@"), std::string::npos)
      << s.to_string();
  EXPECT_EQ(id, net::kNoWindow);
  MK_EXPECT_OK(be_->register_window(buf.data(), buf.size(), MemKind::kHost, &id));
  EXPECT_EQ(id, 0u);
}

// A process that died without closing its shm endpoint leaves the endpoint's region behind,
// named by the provider after its pid. When the pid comes back (containers recycle pids
// quickly) the provider refuses the default name (EBUSY: the recorded owner is alive), and so,
// before the backend named its endpoints itself, did create(). Planted here: copies of the
// head of this process's own live region under the names its next endpoints would take.
TEST_F(NetMpi, LeftoverShmRegionOfARecycledPid) {
  if (provider_under_test() != "shm") GTEST_SKIP() << "shm provider only";
  RawShmEndpoint live;
  ASSERT_EQ(live.enable_ret, 0) << live.why << " / fi_enable: " << fi_strerror(-live.enable_ret);
  // The default name: "<prefix>://<pid>:<uid>:<endpoint index>"; the region is its tail.
  const std::string name = live.name();
  const size_t scheme = name.find("://");
  const size_t colon = name.rfind(':');
  if (scheme == std::string::npos || colon == std::string::npos || colon <= scheme + 3)
    GTEST_SKIP() << "this libfabric names shm endpoints differently: '" << name << "'";
  const std::string base = name.substr(scheme + 3, colon - scheme - 3);
  const int index = atoi(name.c_str() + colon + 1);
  std::vector<char> head(4096);
  {
    const int fd = shm_open(name.substr(scheme + 3).c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0) << "shm_open(" << name << "): " << strerror(errno);
    const ssize_t n = pread(fd, head.data(), head.size(), 0);
    close(fd);
    ASSERT_EQ(n, static_cast<ssize_t>(head.size()));
  }
  std::vector<std::string> planted;
  for (int k = 1; k <= 4; ++k) {
    const std::string n = base + ":" + std::to_string(index + k);
    const int fd = shm_open(n.c_str(), O_RDWR | O_CREAT | O_EXCL, S_IRUSR | S_IWUSR);
    ASSERT_GE(fd, 0) << "shm_open(" << n << ", O_EXCL): " << strerror(errno);
    const ssize_t w = pwrite(fd, head.data(), head.size(), 0);
    close(fd);
    planted.push_back(n);
    ASSERT_EQ(w, static_cast<ssize_t>(head.size()));
  }
  {
    // The trap is armed: an endpoint with the default name is refused.
    RawShmEndpoint trapped;
    if (trapped.enable_ret != -FI_EBUSY) {
      for (const auto& n : planted) shm_unlink(n.c_str());
      GTEST_SKIP() << "this libfabric does not refuse a live owner's region (fi_enable: "
                   << trapped.enable_ret << ")";
    }
  }
  Status s = create();
  for (const auto& n : planted) shm_unlink(n.c_str());
  MK_ASSERT_OK(s);
  expect_empty_everywhere(run_windows(*bs_, *be_, /*expect_cuda_refused=*/true));
  MK_EXPECT_OK(be_->finalize());
}

// A failed job's teardown while puts of this rank are still in the provider (nobody progresses
// them: the job failed): deregistration and finalize return within their bounds on every rank
// and nothing crashes. Closing an rxm endpoint while such a write was arriving crashed
// tcp;ofi_rxm in fi_close (on the target rank; the CLI's put and completion faults): after a
// failure the backend leaves that endpoint open (docs/backend-contract.md).
// Last of the suite: its bootstrap has failed.
TEST_F(NetMpi, TeardownOfAFailedJobWithPutsInFlight) {
  if (size_ < 2) GTEST_SKIP() << "needs two ranks";
  MK_ASSERT_OK(create());
  const size_t bytes = size_t(16) << 20, piece = bytes / 8;
  std::vector<uint8_t> src(bytes, uint8_t(rank_ + 1)), dst(bytes, 0);
  WindowId sw = net::kNoWindow, dw = net::kNoWindow;
  MK_ASSERT_OK(be_->register_window(src.data(), bytes, MemKind::kHost, &sw));
  MK_ASSERT_OK(be_->register_window(dst.data(), bytes, MemKind::kHost, &dw));
  MPI_Barrier(MPI_COMM_WORLD);  // every rank is out of the registration's collective
  int posted_n = 0;
  if (rank_ == 0) {
    for (size_t i = 0; i < 8; ++i) {
      bool posted = false;
      MK_ASSERT_OK(be_->put(1, sw, i * piece, dw, i * piece, piece, 0, 100 + i, &posted));
      posted_n += posted;
    }
    bs_->fail(make_status(Code::kSystemError, "rank 0: planted: the job failed with %d put(s) in flight", posted_n));
    (void)bs_->poll_failure();  // the notice leaves now
    // The peers close their endpoints first, as quick survivors do: rank 0's puts then meet
    // closed connections in its teardown.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  const auto t0 = std::chrono::steady_clock::now();
  Status d1 = be_->deregister_window(sw);
  Status d2 = be_->deregister_window(dw);
  Status f = be_->finalize();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("rank %d: %d put(s) in flight; teardown in %.2f s: %s / %s / %s\n", rank_, posted_n, secs,
         d1.to_string().c_str(), d2.to_string().c_str(), f.to_string().c_str());
  EXPECT_LT(secs, 15.0) << "the teardown waited for a failed job";
  if (rank_ == 0) {
    EXPECT_GT(posted_n, 0);
    // Its own teardown after its own failure: nothing to report.
    MK_EXPECT_OK(d1);
    MK_EXPECT_OK(d2);
    MK_EXPECT_OK(f);
  }
  EXPECT_FALSE(bs_->poll_failure().ok()) << "the failure reached every rank";
}

#else  // MK_NET_TEST_LOOPBACK
// ---------------------------------------------------------------------------------------
// loopback, ranks as threads of this process.

template <typename F>
void run_ranks(int world, F fn) {
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) th.emplace_back([&fn, r] { fn(r); });
  for (auto& t : th) t.join();
}

struct ThreadWorld {
  std::vector<std::unique_ptr<Bootstrap>> bs;
  std::vector<Topology> topo;
  std::vector<std::unique_ptr<Backend>> be;
};

class NetLoopback : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { bound_timeouts(); }
  // Builds the world and each rank's backend; returns per-rank errors ("" each if fine).
  std::vector<std::string> start(ThreadWorld* w, uint32_t depth) {
    const int W = GetParam();
    std::vector<std::string> err(W);
    Status s = make_thread_world(W, &w->bs);
    if (!s.ok()) return std::vector<std::string>(W, s.to_string());
    w->topo.resize(W);
    w->be.resize(W);
    run_ranks(W, [&](int r) {
      Status t = make_topology(*w->bs[r], &w->topo[r]);
      if (t.ok()) {
        net::BackendConfig cfg;
        cfg.kind = "loopback";
        cfg.loopback_queue_depth = depth;
        t = net::create_backend(*w->bs[r], w->topo[r], cfg, &w->be[r]);
      }
      if (!t.ok()) err[r] = "rank " + std::to_string(r) + ": " + t.to_string();
    });
    return err;
  }
};

TEST_P(NetLoopback, RandomPutsEveryPair) {
  const int W = GetParam();
  ThreadWorld w;
  for (auto& e : start(&w, 0)) ASSERT_EQ(e, "");
  std::vector<std::string> err(W);
  std::vector<Stats> st(W);
  run_ranks(W, [&](int r) {
    EXPECT_STREQ(w.be[r]->name(), "loopback");
    err[r] = run_exchange(*w.bs[r], *w.be[r], Plan::kRandom, 11, &st[r]);
    Status s = w.be[r]->finalize();
    if (!s.ok()) err[r] += " finalize: " + s.to_string();
  });
  for (int r = 0; r < W; ++r) {
    printf("[loopback W=%d] random: %s\n", W, describe(st[r], r).c_str());
    EXPECT_EQ(err[r], "");
  }
}

TEST_P(NetLoopback, BackPressure) {
  const int W = GetParam();
  ThreadWorld w;
  for (auto& e : start(&w, 16)) ASSERT_EQ(e, "");  // 16 arrivals per inbox, then posted=false
  std::vector<std::string> err(W);
  std::vector<Stats> st(W);
  run_ranks(W, [&](int r) {
    err[r] = run_exchange(*w.bs[r], *w.be[r], Plan::kSmall, 12, &st[r]);
    if (err[r].empty()) err[r] = run_exchange(*w.bs[r], *w.be[r], Plan::kRandom, 13, &st[r]);
    Status s = w.be[r]->finalize();
    if (!s.ok()) err[r] += " finalize: " + s.to_string();
  });
  for (int r = 0; r < W; ++r) {
    printf("[loopback W=%d] flood: %s\n", W, describe(st[r], r).c_str());
    EXPECT_EQ(err[r], "");
    EXPECT_GT(st[r].eagain, 0u) << "rank " << r << " was never refused: the retry path went untested";
  }
}

TEST_P(NetLoopback, Windows) {
  const int W = GetParam();
  ThreadWorld w;
  for (auto& e : start(&w, 0)) ASSERT_EQ(e, "");
  std::vector<std::string> err(W);
  run_ranks(W, [&](int r) { err[r] = run_windows(*w.bs[r], *w.be[r], /*expect_cuda_refused=*/false); });
  for (int r = 0; r < W; ++r) EXPECT_EQ(err[r], "");
}

INSTANTIATE_TEST_SUITE_P(Sizes, NetLoopback, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "W" + std::to_string(i.param);
                         });

// A rank of another process: refused from the gathered infos alone, no collective started.
TEST(NetLoopbackErrors, AnotherProcessIsRefused) {
  std::vector<RankInfo> infos = {local_host_info(0), local_host_info(1)};
  infos[1].pid += 1;
  Topology topo;
  MK_ASSERT_OK(build_topology(0, infos, 0, nullptr, &topo));
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(2, &bs));
  net::BackendConfig cfg;
  cfg.kind = "loopback";
  std::unique_ptr<Backend> be;
  Status s = net::create_backend(*bs[0], topo, cfg, &be);
  EXPECT_EQ(s.code(), Code::kNotSupported) << s.to_string();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
  EXPECT_EQ(be, nullptr);
}

TEST(NetLoopbackErrors, MismatchedTopology) {
  std::vector<std::unique_ptr<Bootstrap>> bs;
  MK_ASSERT_OK(make_thread_world(2, &bs));
  Topology topo;  // a world of one
  MK_ASSERT_OK(build_topology(0, {local_host_info(0)}, 0, nullptr, &topo));
  net::BackendConfig cfg;
  cfg.kind = "loopback";
  std::unique_ptr<Backend> be;
  EXPECT_EQ(net::create_backend(*bs[0], topo, cfg, &be).code(), Code::kInvalidArgument);
}
#endif

}  // namespace
}  // namespace mk
