// bench_proxy — the host proxy measured on the CPU, CPU threads standing in for GPU producers.
//
//   bench_proxy drain      [--n N] [--reps R] [--ring S] [--inflight K] [--no-pin] [--json FILE]
//       one process, loopback backend in a 1-rank thread world: how fast one proxy thread
//       drains its ring (NOPs; empty puts to self), next to the bare ring (a consumer that
//       only peeks and pops) as the ceiling the ring protocol itself allows.
//   bench_proxy handoff    [--warmup W] [--iters I] [--batches B] [--no-pin] [--json FILE]
//       one process, loopback: an 8-byte put to self with a remote flag through the proxy
//       vs the same put driven directly: the proxy's own latency when it has a CPU to itself.
//   bench_proxy latency    [--warmup W] [--iters I] [--batches B] [--budget-s S] [--json FILE]
//       (mpirun -np 2) 8-byte ping-pong: the raw backend (put + progress, no proxy), then
//       through the proxies with the waiting threads spinning, then yielding.
//   bench_proxy bandwidth  [--total-mib M] [--sizes-kib a,b,..] [--reps R] [--spin] [--json FILE]
//       (mpirun -np 2) rank 0 streams puts to rank 1: the raw backend, then through the proxy.
//
// The network backend of latency/bandwidth is chosen as create_backend does: tunables
// net_backend (MK_NET_BACKEND) and net_provider (MK_NET_PROVIDER).
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/tunables.h"
#include "mkernel/net/backend.h"
#include "mkernel/proxy/command_ring.h"
#include "mkernel/proxy/proxy.h"
#include "mkernel/proxy/windows.h"
#include "mkernel/runtime/bootstrap.h"
#include "mkernel/runtime/topology.h"

namespace mk {
namespace bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

[[noreturn]] void die(const std::string& what, const Status& s) {
  fprintf(stderr, "bench_proxy: %s: %s\n", what.c_str(), s.to_string().c_str());
  fflush(stderr);
  _exit(1);  // under mpirun a non-zero exit ends the job
}
[[noreturn]] void die(const std::string& what) {
  fprintf(stderr, "bench_proxy: %s\n", what.c_str());
  fflush(stderr);
  _exit(1);
}
#define BENCH_OK(expr)                          \
  do {                                          \
    ::mk::Status bench_s_ = (expr);             \
    if (!bench_s_.ok()) die(#expr, bench_s_);   \
  } while (0)

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

// ---- options ------------------------------------------------------------------------------

struct Args {
  std::string cmd;
  std::string json;
  uint64_t n = 2000000;        // drain: commands per measurement
  int reps = 3;                // timed repetitions (after one warm-up)
  uint64_t ring = 4096;        // drain: ring slots
  uint32_t inflight = 1024;    // drain: max_inflight
  bool pin = true;             // drain: producer and proxy thread on different CPUs
  std::string only;            // drain: "nop", "put" or "bare" (profiling one case)
  int warmup = 2000;           // latency: warm-up round trips
  int iters = 20000;           // latency: timed round trips
  int batches = 20;            // latency: batches the timed round trips are split into
  uint64_t total_mib = 256;    // bandwidth: bytes per size
  uint64_t window_mib = 64;    // bandwidth: window size
  std::vector<uint64_t> sizes_kib = {64, 256, 1024, 4096};
  bool spin = false;           // bandwidth: waiting threads spin instead of yielding
  int deadline_s = 50;         // any single wait longer than this fails loudly
  double budget_s = 12;        // latency: wall time a variant may take (fewer round trips past it)
};

void usage() {
  printf(
      "usage: bench_proxy drain|handoff|latency|bandwidth [options]\n"
      "  --json FILE        also write the figures as JSON (rank 0)\n"
      "  --reps R           timed repetitions after one warm-up (drain, bandwidth; default 3)\n"
      "  --deadline-s S     fail when one phase takes longer (default 50)\n"
      " drain:     --n N (2000000) --ring S (4096) --inflight K (1024) --no-pin --only nop|put|bare\n"
      " handoff:   --warmup W (2000) --iters I (20000) --batches B (20) --no-pin\n"
      " latency:   --warmup W (2000) --iters I (20000) --batches B (20) --budget-s S (12, per variant)\n"
      "                                                                        [mpirun -np 2]\n"
      " bandwidth: --total-mib M (256) --window-mib M (64) --sizes-kib 64,256,1024,4096 --spin\n"
      "                                                                        [mpirun -np 2]\n"
      "latency/bandwidth take the backend from MK_NET_BACKEND / MK_NET_PROVIDER.\n");
}

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) {
    usage();
    exit(2);
  }
  a.cmd = argv[1];
  if (a.cmd == "-h" || a.cmd == "--help" || a.cmd == "help") {
    usage();
    exit(0);
  }
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) die("option " + k + " needs a value");
      return argv[++i];
    };
    if (k == "--json") a.json = val();
    else if (k == "--n") a.n = std::stoull(val());
    else if (k == "--reps") a.reps = std::stoi(val());
    else if (k == "--ring") a.ring = std::stoull(val());
    else if (k == "--inflight") a.inflight = static_cast<uint32_t>(std::stoul(val()));
    else if (k == "--no-pin") a.pin = false;
    else if (k == "--only") a.only = val();
    else if (k == "--warmup") a.warmup = std::stoi(val());
    else if (k == "--iters") a.iters = std::stoi(val());
    else if (k == "--batches") a.batches = std::stoi(val());
    else if (k == "--total-mib") a.total_mib = std::stoull(val());
    else if (k == "--window-mib") a.window_mib = std::stoull(val());
    else if (k == "--spin") a.spin = true;
    else if (k == "--deadline-s") a.deadline_s = std::stoi(val());
    else if (k == "--budget-s") a.budget_s = std::stod(val());
    else if (k == "--sizes-kib") {
      a.sizes_kib.clear();
      std::stringstream ss(val());
      std::string t;
      while (std::getline(ss, t, ',')) a.sizes_kib.push_back(std::stoull(t));
    } else if (k == "-h" || k == "--help") {
      usage();
      exit(0);
    } else {
      usage();
      die("unknown option " + k);
    }
  }
  if (a.reps < 1 || a.batches < 1 || a.iters < a.batches || a.iters % a.batches != 0)
    die("--reps and --batches must be >= 1 and --iters a multiple of --batches");
  return a;
}

// ---- small JSON writer ----------------------------------------------------------------------

class Json {
 public:
  Json& begin_obj(const char* key = nullptr) { return open(key, '{'); }
  Json& end_obj() { return close('}'); }
  Json& begin_arr(const char* key = nullptr) { return open(key, '['); }
  Json& end_arr() { return close(']'); }
  Json& kv(const char* key, const std::string& v) {
    sep(key);
    o_ << '"' << escape(v) << '"';
    return *this;
  }
  Json& kv(const char* key, const char* v) { return kv(key, std::string(v)); }
  Json& kv(const char* key, double v) {
    sep(key);
    char b[64];
    snprintf(b, sizeof(b), "%.6g", v);
    o_ << b;
    return *this;
  }
  Json& kv(const char* key, uint64_t v) {
    sep(key);
    o_ << v;
    return *this;
  }
  Json& kv(const char* key, int v) { return kv(key, static_cast<uint64_t>(v)); }
  Json& kv(const char* key, bool v) {
    sep(key);
    o_ << (v ? "true" : "false");
    return *this;
  }
  Json& arr(const char* key, const std::vector<double>& v) {
    begin_arr(key);
    for (double x : v) kv(nullptr, x);
    return end_arr();
  }
  std::string str() const { return o_.str() + "\n"; }

 private:
  static std::string escape(const std::string& s) {
    std::string r;
    for (char c : s) {
      if (c == '"' || c == '\\') r += '\\';
      if (static_cast<unsigned char>(c) < 0x20) {
        r += ' ';
        continue;
      }
      r += c;
    }
    return r;
  }
  void sep(const char* key) {
    if (!first_.empty()) {
      if (!first_.back()) o_ << ", ";
      first_.back() = false;
    }
    if (key) o_ << '"' << escape(key) << "\": ";
  }
  Json& open(const char* key, char c) {
    sep(key);
    o_ << c;
    first_.push_back(true);
    return *this;
  }
  Json& close(char c) {
    o_ << c;
    first_.pop_back();
    return *this;
  }
  std::ostringstream o_;
  std::vector<bool> first_;
};

void write_json(const std::string& path, const Json& j) {
  if (path.empty()) return;
  std::ofstream f(path);
  if (!f) die("cannot write " + path);
  f << j.str();
  printf("wrote %s\n", path.c_str());
}

std::string utc_now() {
  char b[64];
  time_t t = time(nullptr);
  struct tm tm;
  gmtime_r(&t, &tm);
  strftime(b, sizeof(b), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

// "0-1", "1": the CPUs the calling thread may run on.
std::string affinity_str() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return "?";
  std::string s;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    int e = c;
    while (e + 1 < CPU_SETSIZE && CPU_ISSET(e + 1, &set)) ++e;
    s += (s.empty() ? "" : ",") + (e == c ? std::to_string(c) : std::to_string(c) + "-" + std::to_string(e));
    c = e;
  }
  return s;
}

bool pin_self(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof(set), &set) == 0;
}

void machine_json(Json& j, const Args& a, int argc, char** argv) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string cmdline;
  for (int i = 0; i < argc; ++i) cmdline += (i ? " " : "") + std::string(argv[i]);
  j.kv("benchmark", "bench_proxy " + a.cmd).kv("date_utc", utc_now()).kv("host", host);
  j.kv("online_cpus", static_cast<uint64_t>(sysconf(_SC_NPROCESSORS_ONLN))).kv("argv", cmdline);
}

// Waits until done() (spinning, or yielding the CPU between checks), failing loudly past the
// deadline or when `healthy` turns false.
template <class Done>
void wait_for(Done done, bool yield, const char* what, int deadline_s,
              const std::function<Status()>& healthy = nullptr) {
  const auto deadline = Clock::now() + std::chrono::seconds(deadline_s);
  for (uint64_t i = 1; !done(); ++i) {
    if (yield)
      std::this_thread::yield();
    else
      cpu_relax();
    if ((i & 4095) == 0) {
      if (Clock::now() > deadline) die(std::string("timed out: ") + what);
      if (healthy) {
        Status s = healthy();
        if (!s.ok()) die(what, s);
      }
    }
  }
}

inline uint64_t load_acq(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

// ---- drain ----------------------------------------------------------------------------------

// The ring alone: a consumer that only peeks and pops. The ceiling the ring protocol allows
// one producer and one consumer thread on this machine.
double bare_ring_rate(const Args& a, uint64_t n) {
  std::unique_ptr<CommandRing> ring;
  BENCH_OK(CommandRing::create(a.ring, false, &ring));
  std::atomic<uint64_t> consumed{0};
  std::atomic<bool> stop{false};
  const int ncpu = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (a.pin && ncpu >= 2) pin_self(1);  // the consumer inherits CPU 1
  std::thread consumer([&] {
    Command c;
    uint64_t k = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      while (ring->peek(&c)) {
        ring->pop();
        ++k;
      }
      consumed.store(k, std::memory_order_release);
    }
  });
  if (a.pin && ncpu >= 2) pin_self(0);
  const Command nop = make_op(CmdOp::kNop);
  const auto t0 = Clock::now();
  for (uint64_t i = 0; i < n; ++i) BENCH_OK(ring->push(nop, 30000));
  wait_for([&] { return consumed.load(std::memory_order_acquire) >= n; }, false, "bare ring", a.deadline_s);
  const auto t1 = Clock::now();
  stop.store(true);
  consumer.join();
  if (a.pin && ncpu >= 2) {
    cpu_set_t all;
    CPU_ZERO(&all);
    for (int c = 0; c < ncpu; ++c) CPU_SET(c, &all);
    sched_setaffinity(0, sizeof(all), &all);
  }
  return n / seconds(t0, t1);
}

struct DrainResult {
  std::string name;
  std::vector<double> rates;      // commands/s per timed repetition
  std::vector<double> push_rates; // the producer's own pace (pushes/s, back-pressure included)
  std::vector<double> fill;       // mean ring occupancy the producer saw (fraction of the slots)
  uint64_t eagain = 0;
  double med() const { return median(rates); }
};

// One rank in a thread world over the loopback backend, one 4 KiB host window.
struct SelfWorld {
  std::vector<std::unique_ptr<Bootstrap>> world;
  Bootstrap* bs = nullptr;
  Topology topo;
  std::unique_ptr<net::Backend> be;
  std::unique_ptr<ProxyWindows> wins;
  std::vector<uint8_t> buf = std::vector<uint8_t>(4096, 0);
  uint32_t win = 0;

  void init() {
    BENCH_OK(make_thread_world(1, &world));
    bs = world[0].get();
    std::vector<RankInfo> infos(1);
    RankInfo me = local_host_info(0);
    BENCH_OK(bs->allgather(&me, infos.data(), sizeof(me)));
    BENCH_OK(build_topology(0, infos, 0, nullptr, &topo));
    net::BackendConfig cfg;
    cfg.kind = "loopback";
    BENCH_OK(net::create_backend(*bs, topo, cfg, &be));
    BENCH_OK(ProxyWindows::create(bs, be.get(), "never", StagingConfig{}, &wins));
    BENCH_OK(wins->add(buf.data(), buf.size(), net::MemKind::kHost, &win));
  }
  void finish() {
    BENCH_OK(wins->destroy());
    BENCH_OK(be->finalize());
  }
};

// Starts the proxy on CPU 1 (the thread inherits its creator's affinity) and returns with the
// calling thread on CPU 0; does nothing about affinity when `pin` is false.
void start_pinned(Proxy* proxy, bool pin) {
  if (pin) pin_self(1);
  BENCH_OK(proxy->start());
  if (pin) pin_self(0);
}

int run_drain(const Args& a, int argc, char** argv) {
  SelfWorld sw;
  sw.init();
  const uint32_t win = sw.win;
  uint64_t flag = 0;
  HostFlagSink sink(&flag, 1);

  const int ncpu = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  const bool pin = a.pin && ncpu >= 2;
  ProxyConfig pc;
  pc.ring_slots = a.ring;
  pc.max_inflight = a.inflight;
  std::unique_ptr<Proxy> proxy;
  BENCH_OK(Proxy::create(sw.wins.get(), &sink, pc, &proxy));
  start_pinned(proxy.get(), pin);

  printf("bench_proxy drain: loopback backend, 1-rank thread world, ring %" PRIu64
         " slots, max_inflight %u, N = %" PRIu64 ", %d timed reps after 1 warm-up, %s\n",
         a.ring, a.inflight, a.n, a.reps,
         pin ? "producer on CPU 0, proxy thread on CPU 1" : "threads not pinned");

  auto measure = [&](const char* name, const Command& c, bool is_put) {
    DrainResult r;
    r.name = name;
    const uint64_t eagain0 = proxy->stats().eagain;
    for (int rep = 0; rep <= a.reps; ++rep) {
      const ProxyStats s0 = proxy->stats();
      const uint64_t want_cmd = s0.commands + a.n, want_puts = s0.puts + (is_put ? a.n : 0);
      // Occupancy sampled every 1024 pushes: near 1 the proxy is the bottleneck (the producer
      // waits for room), near 0 the producer is.
      const uint64_t* tail = proxy->ring().view().tail;
      const uint64_t base = load_acq(tail);
      double fill_sum = 0;
      uint64_t fill_n = 0;
      const auto t0 = Clock::now();
      for (uint64_t i = 0; i < a.n; ++i) {
        Status s = proxy->ring().push(c, 30000, &proxy->failed_word());
        if (!s.ok()) die(std::string("push (") + name + ")", s);
        if ((i & 1023) == 1023) {
          fill_sum += double(base + i + 1 - load_acq(tail)) / double(a.ring);
          ++fill_n;
        }
      }
      const auto tp = Clock::now();
      // Poll the counters gently: every read pulls the proxy's counter lines to this core.
      wait_for(
          [&] {
            for (int k = 0; k < 64; ++k) cpu_relax();
            const ProxyStats s = proxy->stats();
            return s.commands >= want_cmd && s.puts >= want_puts;
          },
          false, name, a.deadline_s, [&] { return proxy->status(); });
      const auto t1 = Clock::now();
      if (rep == 0) continue;  // warm-up
      r.rates.push_back(a.n / seconds(t0, t1));
      r.push_rates.push_back(a.n / seconds(t0, tp));
      r.fill.push_back(fill_n ? fill_sum / fill_n : 0);
    }
    r.eagain = proxy->stats().eagain - eagain0;
    return r;
  };
  std::vector<DrainResult> res;
  if (a.only.empty() || a.only == "nop") res.push_back(measure("nop", make_op(CmdOp::kNop), false));
  if (a.only.empty() || a.only == "put") res.push_back(measure("put0", make_put(0, win, 0, win, 0, 0, kNoFlag), true));
  BENCH_OK(proxy->flush(10000));
  BENCH_OK(proxy->stop());
  const ProxyStats fin = proxy->stats();
  proxy.reset();
  sw.finish();

  // The ring's own ceiling (same producer, a consumer that does nothing else).
  std::vector<double> bare;
  const uint64_t bare_n = std::min<uint64_t>(a.n, 2000000);
  if (a.only.empty() || a.only == "bare") {
    bare_ring_rate(a, bare_n);  // warm-up
    for (int rep = 0; rep < a.reps; ++rep) bare.push_back(bare_ring_rate(a, bare_n));
  }

  const double target = 2e6;
  auto row = [](const char* label, const std::vector<double>& v, const char* fill) {
    printf("%-34s %14.0f %14.0f %14.0f %10.1f %10s\n", label, median(v), *std::min_element(v.begin(), v.end()),
           *std::max_element(v.begin(), v.end()), 1e9 / median(v), fill);
  };
  printf("\n%-34s %14s %14s %14s %10s %10s\n", "case", "median cmd/s", "min cmd/s", "max cmd/s", "ns/cmd",
         "ring fill");
  for (const DrainResult& r : res) {
    char fill[32];
    snprintf(fill, sizeof(fill), "%.0f%%", 100 * median(r.fill));
    row(r.name == "nop" ? "NOP commands" : "empty puts to self (0 B, no flag)", r.rates, fill);
  }
  if (!bare.empty()) row("bare ring (peek+pop only)", bare, "-");
  printf("\n'ring fill': mean occupancy the producer saw (near 100%%: the consumer is the bottleneck).\n");
  for (const DrainResult& r : res)
    printf("target >= %.0f commands/s per proxy thread, %s: %s (EAGAIN retries %" PRIu64 ")\n", target,
           r.name.c_str(), r.med() >= target ? "met" : "MISSED", r.eagain);
  printf("proxy totals: %" PRIu64 " commands, %" PRIu64 " puts, %" PRIu64 " arrivals\n", fin.commands, fin.puts,
         fin.arrivals);

  Json j;
  j.begin_obj();
  machine_json(j, a, argc, argv);
  j.kv("backend", "loopback").kv("ring_slots", a.ring).kv("max_inflight", static_cast<uint64_t>(a.inflight));
  j.kv("n", a.n).kv("reps", a.reps).kv("pinned", pin).kv("target_commands_per_s", target);
  j.begin_arr("cases");
  for (const DrainResult& r : res) {
    j.begin_obj().kv("case", r.name).kv("median_commands_per_s", r.med()).arr("commands_per_s", r.rates);
    j.arr("producer_pushes_per_s", r.push_rates).arr("ring_fill", r.fill).kv("eagain", r.eagain).kv("target_met", r.med() >= target);
    j.end_obj();
  }
  if (!bare.empty()) {
    j.begin_obj().kv("case", "bare_ring").kv("n", bare_n).kv("median_commands_per_s", median(bare));
    j.arr("commands_per_s", bare).end_obj();
  }
  j.end_arr().end_obj();
  write_json(a.json, j);
  return 0;
}

// The backend driven directly (no proxy): what one put costs through the thin wrapper.
struct Raw {
  explicit Raw(net::Backend* b) : be(b) {}
  net::Backend* be;
  std::vector<net::LocalDone> done;
  std::vector<net::Arrival> arr;
  uint64_t posted = 0, completed = 0, arrived = 0, eagain = 0;
  bool stopped = false;  // an arrival with imm 1 (kStopImm) came: it is not counted
  static constexpr uint64_t kCookie = 1ull << 40;  // never a proxy op id

  void progress() {
    done.clear();
    arr.clear();
    Status s = be->progress(&done, &arr);
    if (!s.ok()) die("raw progress", s);
    completed += done.size();
    for (const net::Arrival& x : arr) {
      if (x.imm == 1) stopped = true;
      else ++arrived;
    }
  }
  // Posts one put, progressing while the backend has no resources.
  void put(int peer, net::WindowId src, uint64_t soff, net::WindowId dst, uint64_t doff, uint64_t bytes,
           uint32_t imm = 0) {
    for (;;) {
      bool ok = false;
      Status s = be->put(peer, src, soff, dst, doff, bytes, imm, kCookie + posted, &ok);
      if (!s.ok()) die("raw put", s);
      if (ok) break;
      ++eagain;
      progress();
    }
    ++posted;
  }
  bool try_put(int peer, net::WindowId src, uint64_t soff, net::WindowId dst, uint64_t doff, uint64_t bytes) {
    bool ok = false;
    Status s = be->put(peer, src, soff, dst, doff, bytes, 0, kCookie + posted, &ok);
    if (!s.ok()) die("raw put", s);
    if (ok) ++posted;
    else ++eagain;
    return ok;
  }
  void wait_arrived(uint64_t n, int deadline_s) {
    wait_for([&] { progress(); return arrived >= n; }, false, "raw arrival", deadline_s);
  }
  void wait_completed(int deadline_s) {
    wait_for([&] { progress(); return completed >= posted; }, false, "raw completions", deadline_s);
  }
};

// ---- handoff --------------------------------------------------------------------------------

// What one put costs end to end through a proxy that has a CPU of its own: one rank, loopback,
// the producer pushes an 8-byte put to itself with a remote flag and spins until the flag
// rises (ring hand-off, validation, post, progress, arrival, flag), next to the same put
// driven by the producer thread itself (put + progress, no proxy). Two busy threads on two
// CPUs: no oversubscription, unlike the two-process latency run on this machine.
int run_handoff(const Args& a, int argc, char** argv) {
  SelfWorld sw;
  sw.init();
  const int ncpu = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  const bool pin = a.pin && ncpu >= 2;
  const int per = a.iters / a.batches;
  auto timed = [&](const std::function<void(uint64_t)>& one) {
    std::vector<double> us;
    uint64_t k = 0;
    for (int i = 0; i < a.warmup; ++i) one(++k);
    for (int b = 0; b < a.batches; ++b) {
      const auto t0 = Clock::now();
      for (int i = 0; i < per; ++i) one(++k);
      us.push_back(seconds(t0, Clock::now()) * 1e6 / per);
    }
    return us;
  };

  std::vector<uint64_t> flags(1, 0);
  HostFlagSink sink(flags.data(), 1);
  std::unique_ptr<Proxy> proxy;
  BENCH_OK(Proxy::create(sw.wins.get(), &sink, ProxyConfig{}, &proxy));
  start_pinned(proxy.get(), pin);
  const Command put = make_put(0, sw.win, 0, sw.win, 64, 8, 0);
  std::vector<double> via_proxy = timed([&](uint64_t k) {
    Status s = proxy->ring().push(put, 30000, &proxy->failed_word());
    if (!s.ok()) die("push", s);
    wait_for([&] { return load_acq(&flags[0]) >= k; }, false, "flag", a.deadline_s,
             [&] { return proxy->status(); });
  });
  BENCH_OK(proxy->flush(10000));
  BENCH_OK(proxy->stop());
  proxy.reset();

  // The same put without the proxy, from the pinned producer thread (after the proxy is gone).
  Raw raw(sw.be.get());
  const net::WindowId bw = sw.wins->transport_id(sw.win);
  std::vector<double> direct = timed([&](uint64_t k) {
    raw.put(0, bw, 0, bw, 64, 8);
    while (raw.arrived < k) raw.progress();
  });
  raw.wait_completed(a.deadline_s);
  sw.finish();

  printf("bench_proxy handoff: loopback backend, 1 rank, 8-byte put to self with a remote flag, %d warm-up + "
         "%d timed puts in %d batches, %s\n\n",
         a.warmup, per * a.batches, a.batches, pin ? "producer on CPU 0, proxy thread on CPU 1" : "threads not pinned");
  printf("%-52s %10s %10s\n", "path (push/put until the flag/arrival is seen)", "mean us", "median us");
  printf("%-52s %10.3f %10.3f\n", "through the proxy (producer spins on the flag)", mean(via_proxy), median(via_proxy));
  printf("%-52s %10.3f %10.3f\n", "backend driven by the producer (put + progress)", mean(direct), median(direct));
  printf("%-52s %10.3f %10.3f\n", "added by the proxy", mean(via_proxy) - mean(direct),
         median(via_proxy) - median(direct));

  Json j;
  j.begin_obj();
  machine_json(j, a, argc, argv);
  j.kv("backend", "loopback").kv("bytes", static_cast<uint64_t>(8)).kv("pinned", pin);
  j.kv("warmup", a.warmup).kv("timed", per * a.batches).kv("batches", a.batches);
  j.kv("proxy_mean_us", mean(via_proxy)).kv("proxy_median_us", median(via_proxy)).arr("proxy_us_per_batch", via_proxy);
  j.kv("direct_mean_us", mean(direct)).kv("direct_median_us", median(direct)).arr("direct_us_per_batch", direct);
  j.kv("added_median_us", median(via_proxy) - median(direct)).end_obj();
  write_json(a.json, j);
  return 0;
}

// ---- two ranks over MPI (latency, bandwidth) -------------------------------------------------

#if defined(MK_BENCH_WITH_MPI)

struct NetWorld {
  std::unique_ptr<Bootstrap> bs;
  Topology topo;
  std::unique_ptr<net::Backend> be;
  std::unique_ptr<ProxyWindows> wins;
  std::vector<uint8_t> src, dst;
  uint32_t src_win = 0, dst_win = 0;
  int rank = 0, peer = 1;
  std::vector<std::string> affinity;  // per rank, at startup

  void init(size_t bytes) {
    BENCH_OK(make_mpi_world_bootstrap(&bs));
    if (bs->size() != 2) die("run with exactly 2 ranks (mpirun -np 2), got " + std::to_string(bs->size()));
    rank = bs->rank();
    peer = 1 - rank;
    std::vector<RankInfo> infos(2);
    RankInfo me = local_host_info(rank);
    BENCH_OK(bs->allgather(&me, infos.data(), sizeof(me)));
    BENCH_OK(build_topology(rank, infos, 0, nullptr, &topo));
    net::BackendConfig cfg;  // kind and provider from the tunables, as create_backend does
    BENCH_OK(net::create_backend(*bs, topo, cfg, &be));
    BENCH_OK(ProxyWindows::create(bs.get(), be.get(), "never", StagingConfig{}, &wins));
    src.assign(bytes, static_cast<uint8_t>(rank + 1));
    dst.assign(bytes, 0);
    BENCH_OK(wins->add(src.data(), bytes, net::MemKind::kHost, &src_win));
    BENCH_OK(wins->add(dst.data(), bytes, net::MemKind::kHost, &dst_win));
    char mine[64] = {0};
    snprintf(mine, sizeof(mine), "%s", affinity_str().c_str());
    std::vector<char> all(2 * sizeof(mine));
    BENCH_OK(bs->allgather(mine, all.data(), sizeof(mine)));
    for (int r = 0; r < 2; ++r) affinity.emplace_back(all.data() + r * sizeof(mine));
  }
  void finish() {
    BENCH_OK(wins->destroy());
    BENCH_OK(be->finalize());
  }
  net::WindowId bsrc() const { return wins->transport_id(src_win); }
  net::WindowId bdst() const { return wins->transport_id(dst_win); }
};

struct Lat {
  std::string key, name;
  std::vector<double> half_rtt_us;  // per batch
  int warmup = 0, per_batch = 0;    // what was run (the budget may shorten both)
  bool reduced = false;
  double mean() const { return bench::mean(half_rtt_us); }
  double med() const { return median(half_rtt_us); }
};

// Rank 0's side of a ping-pong: warm-up, then `batches` timed batches. A variant that cannot
// finish in `budget_s` (oversubscribed cores: one round trip can take a scheduler time slice)
// runs fewer warm-up round trips (at most a quarter of the budget) and smaller batches, sized
// from the warm-up's pace, and says so. `round_trip(k)` sends ping k and waits for reply k.
template <class RoundTrip>
Lat drive_ping_pong(const char* key, const char* name, const Args& a, RoundTrip round_trip) {
  Lat l;
  l.key = key;
  l.name = name;
  const auto start = Clock::now();
  uint64_t k = 0;
  while (l.warmup < a.warmup && (l.warmup < 10 || seconds(start, Clock::now()) < 0.25 * a.budget_s)) {
    round_trip(++k);
    ++l.warmup;
  }
  const double used = seconds(start, Clock::now());
  const double rt = used / l.warmup, left = std::max(0.1, a.budget_s - used);
  l.per_batch = a.iters / a.batches;
  if (l.per_batch * a.batches * rt > left)
    l.per_batch = std::max(1, static_cast<int>(left / (a.batches * rt)));
  l.reduced = l.warmup < a.warmup || l.per_batch < a.iters / a.batches;
  for (int b = 0; b < a.batches; ++b) {
    const auto t0 = Clock::now();
    for (int i = 0; i < l.per_batch; ++i) round_trip(++k);
    l.half_rtt_us.push_back(seconds(t0, Clock::now()) * 1e6 / (2.0 * l.per_batch));
  }
  return l;
}

constexpr uint32_t kPingImm = 0, kStopImm = 1;  // raw ping-pong: imm of a ping/reply, of "stop"

int run_latency(const Args& a, int argc, char** argv) {
  NetWorld w;
  w.init(4096);
  std::vector<Lat> res;

  // (a) Raw backend first: no proxy exists yet, so nothing else drives the endpoint.
  {
    Raw raw(w.be.get());
    BENCH_OK(w.bs->barrier());
    if (w.rank == 0) {
      res.push_back(drive_ping_pong("raw", "raw backend (put + progress, spins)", a, [&](uint64_t k) {
        raw.put(1, w.bsrc(), 0, w.bdst(), 0, 8, kPingImm);
        raw.wait_arrived(k, a.deadline_s);
      }));
      raw.put(1, w.bsrc(), 0, w.bdst(), 0, 8, kStopImm);
    } else {
      for (uint64_t k = 1;; ++k) {
        wait_for([&] { raw.progress(); return raw.arrived >= k || raw.stopped; }, false, "raw ping",
                 a.deadline_s);
        if (raw.arrived < k) break;
        raw.put(0, w.bsrc(), 0, w.bdst(), 0, 8, kPingImm);
      }
    }
    raw.wait_completed(a.deadline_s);  // no LocalDone of ours may reach a proxy later
    BENCH_OK(w.bs->barrier());
  }

  // (b) Through the proxies: one per rank, fresh for each variant, torn down after it.
  // Flag 0 counts pings (rank 1) / replies (rank 0); flag 1 on rank 1 is "stop".
  for (int v = 0; v < 2; ++v) {
    const bool yield = v == 1;
    std::vector<uint64_t> flags(2, 0);
    HostFlagSink sink(flags.data(), 2);
    std::unique_ptr<Proxy> proxy;
    BENCH_OK(Proxy::create(w.wins.get(), &sink, ProxyConfig{}, &proxy));
    BENCH_OK(proxy->start());
    BENCH_OK(w.bs->barrier());
    auto push = [&](uint32_t flag) {
      Status s = proxy->ring().push(make_put(w.peer, w.src_win, 0, w.dst_win, 0, 8, flag), 30000,
                                    &proxy->failed_word());
      if (!s.ok()) die("push", s);
    };
    auto healthy = [&] { return proxy->status(); };
    if (w.rank == 0) {
      res.push_back(drive_ping_pong(yield ? "proxy_yield" : "proxy_spin",
                                    yield ? "proxy, waiting threads yield" : "proxy, waiting threads spin", a,
                                    [&](uint64_t k) {
                                      push(0);
                                      wait_for([&] { return load_acq(&flags[0]) >= k; }, yield, "reply flag",
                                               a.deadline_s, healthy);
                                    }));
      push(1);
    } else {
      for (uint64_t k = 1;; ++k) {
        wait_for([&] { return load_acq(&flags[0]) >= k || load_acq(&flags[1]) > 0; }, yield, "ping flag",
                 a.deadline_s, healthy);
        if (load_acq(&flags[0]) < k) break;
        push(0);
      }
    }
    BENCH_OK(proxy->flush(20000));
    BENCH_OK(w.bs->barrier());
    BENCH_OK(proxy->stop());
  }
  const std::string be_name = w.be->name();
  const net::BackendCaps caps = w.be->caps();
  w.finish();
  if (w.rank != 0) return 0;

  printf("bench_proxy latency: %s, 2 ranks, 8-byte puts, up to %d warm-up + %d timed round trips in %d batches,\n"
         "  at most ~%.0f s per variant; half round trip in us (mean and median over the batches);\n"
         "  CPU affinity: rank 0 {%s}, rank 1 {%s}. In the proxied variants each rank has 2 busy threads\n"
         "  (its proxy thread and the waiting thread): more busy threads than CPUs on a 2-CPU machine.\n\n",
         be_name.c_str(), a.warmup, a.iters, a.batches, a.budget_s, w.affinity[0].c_str(),
         w.affinity[1].c_str());
  printf("%-38s %10s %10s %10s %10s %12s\n", "path", "mean us", "median us", "+mean us", "+median us",
         "warm-up/timed");
  const Lat& raw = res[0];
  for (const Lat& l : res) {
    char runs[48];
    snprintf(runs, sizeof(runs), "%d/%d%s", l.warmup, l.per_batch * a.batches, l.reduced ? "*" : "");
    if (&l == &raw)
      printf("%-38s %10.3f %10.3f %10s %10s %12s\n", l.name.c_str(), l.mean(), l.med(), "-", "-", runs);
    else
      printf("%-38s %10.3f %10.3f %10.3f %10.3f %12s\n", l.name.c_str(), l.mean(), l.med(), l.mean() - raw.mean(),
             l.med() - raw.med(), runs);
  }
  const bool shm = be_name.find("shm") != std::string::npos;
  auto verdict = [&](const Lat& l) { return !shm ? "n/a (the target is for shm)" : l.med() - raw.med() <= 1.0 ? "met" : "MISSED"; };
  printf("\n'+' columns: added by the proxy (proxied minus raw, per half round trip = per put). '*': fewer\n"
         "round trips than asked, to fit the time budget (--budget-s). Target <= 1 us added per 8 B put on\n"
         "shm (median): spinning %s, yielding %s.\n", verdict(res[1]), verdict(res[2]));

  Json j;
  j.begin_obj();
  machine_json(j, a, argc, argv);
  j.kv("backend", be_name).kv("inject_bytes", caps.inject_bytes).kv("bytes", static_cast<uint64_t>(8));
  j.kv("warmup_asked", a.warmup).kv("iters_asked", a.iters).kv("batches", a.batches).kv("budget_s", a.budget_s);
  j.begin_arr("affinity").kv(nullptr, w.affinity[0]).kv(nullptr, w.affinity[1]).end_arr();
  j.begin_arr("cases");
  for (const Lat& l : res) {
    j.begin_obj().kv("case", l.key).kv("label", l.name);
    j.kv("half_rtt_mean_us", l.mean()).kv("half_rtt_median_us", l.med()).arr("half_rtt_us_per_batch", l.half_rtt_us);
    j.kv("warmup_round_trips", l.warmup).kv("timed_round_trips", l.per_batch * a.batches).kv("reduced", l.reduced);
    if (&l != &raw) {
      j.kv("added_mean_us", l.mean() - raw.mean()).kv("added_median_us", l.med() - raw.med());
      j.kv("target_added_us", 1.0);
      if (shm) j.kv("target_met", l.med() - raw.med() <= 1.0);
    }
    j.end_obj();
  }
  j.end_arr().end_obj();
  write_json(a.json, j);
  return 0;
}

struct Bw {
  uint64_t size;
  std::vector<double> raw_gbps, proxy_gbps;
  uint64_t raw_eagain = 0, proxy_eagain = 0;
};

int run_bandwidth(const Args& a, int argc, char** argv) {
  const uint64_t window = a.window_mib << 20, total = a.total_mib << 20;
  NetWorld w;
  w.init(window);
  std::vector<Bw> res;
  for (uint64_t kib : a.sizes_kib) {
    const uint64_t size = kib << 10;
    if (size == 0 || size > window || total % size != 0) die("bad size " + std::to_string(kib) + " KiB");
    if (w.be->caps().max_put_bytes && size > w.be->caps().max_put_bytes)
      die("size past the backend's max_put_bytes");
    res.push_back(Bw{size, {}, {}});
  }
  const bool yield = !a.spin;

  // (a) Raw backend: the same stream without the proxy, with at most as many puts in flight
  // as the proxy allows (tunable proxy_max_inflight, the proxy's default).
  const uint64_t cap = static_cast<uint64_t>(tunables::proxy_max_inflight());
  Raw raw(w.be.get());
  uint64_t acks = 0;
  for (Bw& b : res) {
    const uint64_t count = total / b.size;
    const uint64_t e0 = raw.eagain;
    for (int rep = 0; rep <= a.reps; ++rep) {
      BENCH_OK(w.bs->barrier());
      if (w.rank == 0) {
        const auto t0 = Clock::now();
        uint64_t i = 0;
        const auto deadline = t0 + std::chrono::seconds(a.deadline_s);
        while (i < count) {
          if (raw.posted - raw.completed < cap) {
            const uint64_t off = (i % (window / b.size)) * b.size;  // whole puts, cycling
            if (raw.try_put(1, w.bsrc(), off, w.bdst(), off, b.size)) {
              ++i;
              continue;
            }
          }
          raw.progress();
          if (Clock::now() > deadline) die("raw bandwidth stream timed out");
        }
        raw.wait_arrived(++acks, a.deadline_s);  // rank 1 saw every put
        const auto t1 = Clock::now();
        raw.wait_completed(a.deadline_s);
        if (rep > 0) b.raw_gbps.push_back(double(total) / seconds(t0, t1) / 1e9);
      } else {
        raw.wait_arrived(raw.arrived + count, a.deadline_s);
        raw.put(0, w.bsrc(), 0, w.bdst(), 0, 8);  // the ack
        raw.wait_completed(a.deadline_s);
      }
    }
    b.raw_eagain = raw.eagain - e0;
  }
  BENCH_OK(w.bs->barrier());

  // (b) Through the proxy: flag 0 counts data puts on rank 1, flag 1 counts acks on rank 0.
  std::vector<uint64_t> flags(2, 0);
  HostFlagSink sink(flags.data(), 2);
  std::unique_ptr<Proxy> proxy;
  BENCH_OK(Proxy::create(w.wins.get(), &sink, ProxyConfig{}, &proxy));
  BENCH_OK(proxy->start());
  auto push = [&](const Command& c) {
    Status s = proxy->ring().push(c, 30000, &proxy->failed_word());
    if (!s.ok()) die("push", s);
  };
  auto healthy = [&] { return proxy->status(); };
  uint64_t expect_data = 0, expect_acks = 0;
  for (Bw& b : res) {
    const uint64_t count = total / b.size;
    const uint64_t e0 = proxy->stats().eagain;
    for (int rep = 0; rep <= a.reps; ++rep) {
      BENCH_OK(w.bs->barrier());
      if (w.rank == 0) {
        const auto t0 = Clock::now();
        for (uint64_t i = 0; i < count; ++i) {
          const uint64_t off = (i % (window / b.size)) * b.size;  // whole puts, cycling
          push(make_put(1, w.src_win, off, w.dst_win, off, b.size, 0));
        }
        ++expect_acks;
        wait_for([&] { return load_acq(&flags[1]) >= expect_acks; }, yield, "ack", a.deadline_s, healthy);
        const auto t1 = Clock::now();
        if (rep > 0) b.proxy_gbps.push_back(double(total) / seconds(t0, t1) / 1e9);
      } else {
        expect_data += count;
        wait_for([&] { return load_acq(&flags[0]) >= expect_data; }, yield, "data flag", a.deadline_s, healthy);
        push(make_put(0, w.src_win, 0, w.dst_win, 0, 8, 1));
      }
    }
    b.proxy_eagain = proxy->stats().eagain - e0;
  }
  BENCH_OK(proxy->flush(20000));
  BENCH_OK(w.bs->barrier());
  BENCH_OK(proxy->stop());
  const std::string be_name = w.be->name();
  w.finish();
  if (w.rank != 0) return 0;

  printf("bench_proxy bandwidth: %s, rank 0 -> rank 1, %" PRIu64 " MiB per size, %" PRIu64
         " MiB host windows, %d timed reps after 1 warm-up (median shown);\n"
         "  raw: at most %" PRIu64 " puts in flight; proxy: one counting remote flag, the waiting threads %s;\n"
         "  CPU affinity: rank 0 {%s}, rank 1 {%s}\n\n",
         be_name.c_str(), a.total_mib, a.window_mib, a.reps, cap, yield ? "yield" : "spin",
         w.affinity[0].c_str(), w.affinity[1].c_str());
  printf("%10s %8s %12s %12s %10s %14s\n", "put size", "puts", "raw GB/s", "proxy GB/s", "proxy/raw", "EAGAIN raw/px");
  for (const Bw& b : res) {
    const double r = median(b.raw_gbps), p = median(b.proxy_gbps);
    char sz[32];
    snprintf(sz, sizeof(sz), b.size >= (1u << 20) ? "%" PRIu64 " MiB" : "%" PRIu64 " KiB",
             b.size >= (1u << 20) ? b.size >> 20 : b.size >> 10);
    printf("%10s %8" PRIu64 " %12.3f %12.3f %9.0f%% %7" PRIu64 "/%" PRIu64 "\n", sz, total / b.size, r, p,
           100.0 * p / r, b.raw_eagain, b.proxy_eagain);
  }

  Json j;
  j.begin_obj();
  machine_json(j, a, argc, argv);
  j.kv("backend", be_name).kv("total_bytes", total).kv("window_bytes", window).kv("reps", a.reps);
  j.kv("raw_max_inflight", cap).kv("waiting_threads", yield ? "yield" : "spin");
  j.begin_arr("affinity").kv(nullptr, w.affinity[0]).kv(nullptr, w.affinity[1]).end_arr();
  j.begin_arr("sizes");
  for (const Bw& b : res) {
    j.begin_obj().kv("bytes", b.size).kv("puts", total / b.size);
    j.kv("raw_gbps_median", median(b.raw_gbps)).arr("raw_gbps", b.raw_gbps);
    j.kv("proxy_gbps_median", median(b.proxy_gbps)).arr("proxy_gbps", b.proxy_gbps);
    j.kv("raw_eagain", b.raw_eagain).kv("proxy_eagain", b.proxy_eagain).end_obj();
  }
  j.end_arr().end_obj();
  write_json(a.json, j);
  return 0;
}

#endif  // MK_BENCH_WITH_MPI

}  // namespace
}  // namespace bench
}  // namespace mk

int main(int argc, char** argv) {
  using namespace mk::bench;
  Args a = parse(argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (a.cmd == "drain") return run_drain(a, argc, argv);
  if (a.cmd == "handoff") return run_handoff(a, argc, argv);
  if (a.cmd == "latency" || a.cmd == "bandwidth") {
#if defined(MK_BENCH_WITH_MPI)
    return a.cmd == "latency" ? run_latency(a, argc, argv) : run_bandwidth(a, argc, argv);
#else
    die("'" + a.cmd + "' needs MPI: this build of mkernel has none (configure with MPI found)");
#endif
  }
  usage();
  die("unknown subcommand '" + a.cmd + "'");
}
