// Faults: W processes stream puts to each other through their proxies; one fails mid-run —
// killed (SIGKILL), stopped (SIGSTOP), or its provider fails a put or a completion (MK_FAULT).
// Every other rank must leave by itself through the ordinary teardown within the timeout + 5 s,
// naming the culprit, and leave nothing behind. Processes are forked here (mpirun would tear
// the whole job down); they bootstrap through a key-value store kept in files of a private
// directory.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/tunables.h"
#include "tests/cpu/proxy_harness.h"
#include "tests/common/test_util.h"
#include "src/common/keep_until_exit.h"

namespace mk {
namespace test {
namespace {

using Clock = std::chrono::steady_clock;

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

enum class Fault { kKill, kStop, kPutError, kCompletionError };
const char* fault_name(Fault f) {
  switch (f) {
    case Fault::kKill: return "kill";
    case Fault::kStop: return "stop";
    case Fault::kPutError: return "put_error";
    case Fault::kCompletionError: return "completion_error";
  }
  return "?";
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

// One rank: streams puts to every peer until the job fails (its proxy fails, or a peer's
// arrivals stop for timeout_ms), then does what an application does after a failed call — asks
// for the job's report, tears everything down through the ordinary collective path (proxy
// flush and stop, a barrier, windows, backend finalize) — and exits: 0 when the report named
// `victim` as the culprit, 2 when it named someone else, 1 when the job did not fail. Writes
// "<report>\n<ms when it saw the failure>\n<ms when its teardown ended>" to result_<rank>.
int child(const std::string& dir, int rank, int W, int victim, int64_t timeout_ms) {
  (void)tunables::set("failure_grace_ms", "1000");
  std::unique_ptr<Bootstrap> bs;
  if (!make_store_bootstrap(rank, W, "fault", file_store(dir), &bs).ok()) return 1;
  ProxyWorld w;
  Status s = w.init(bs.get(), net::BackendConfig{}, 65536, 65536);
  if (!s.ok()) {
    write_file(dir + "/result_" + std::to_string(rank), "init: " + s.to_string() + "\n0\n0");
    return 1;
  }
  std::vector<uint64_t> flags(W, 0);
  HostFlagSink sink(flags.data(), W);
  std::unique_ptr<Proxy> proxy;
  ProxyConfig pc;
  pc.timeout_ms = timeout_ms;
  if (!Proxy::create(w.wins.get(), &sink, pc, &proxy).ok() || !proxy->start().ok()) return 1;
  Bootstrap* b = bs.get();
  proxy->on_error([b](const Status& e) { b->fail(e); });  // as the communicator does
  (void)bs->barrier();
  write_file(dir + "/ready_" + std::to_string(rank), "ready");
  std::vector<uint64_t> last(W, 0);
  std::vector<Clock::time_point> moved(W, Clock::now());
  Status err;
  auto end = Clock::now() + std::chrono::seconds(60);
  uint64_t i = 0;
  while (err.ok() && Clock::now() < end) {
    for (int p = 0; p < W && err.ok(); ++p) {
      if (p == rank) continue;
      Status ps = proxy->ring().push(make_put(p, w.src_win, (i % 64) * 8, w.dst_win,
                                              uint64_t(rank) * 512 + (i % 64) * 8, 8, rank),
                                     timeout_ms, &proxy->failed_word());
      if (!ps.ok()) err = proxy->status().ok() ? ps : proxy->status();
    }
    ++i;
    if (err.ok() && !proxy->status().ok()) err = proxy->status();
    for (int p = 0; p < W && err.ok(); ++p) {
      if (p == rank) continue;
      uint64_t f = __atomic_load_n(&flags[p], __ATOMIC_ACQUIRE);
      if (f != last[p]) {
        last[p] = f;
        moved[p] = Clock::now();
      } else if (Clock::now() - moved[p] > std::chrono::milliseconds(timeout_ms)) {
        err = make_status(Code::kTimeout, "rank %d: no arrivals from rank %d for %lld ms", rank, p,
                          static_cast<long long>(timeout_ms));
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const int64_t failed_at = now_ms();
  if (err.ok()) {
    write_file(dir + "/result_" + std::to_string(rank), "the job did not fail\n0\n0");
    return 1;
  }
  // The application's side of a failure: the report, then the ordinary teardown.
  bs->fail(err);
  const Status rep = bs->failure_report();
  (void)proxy->flush(200);
  (void)bs->barrier();  // returns at once: the job has failed
  (void)proxy->stop();
  if (proxy->abandoned()) {  // as NetSession::destroy: what the stuck thread uses stays
    keep_until_exit(std::move(proxy));
    keep_until_exit(std::move(w.wins));
    keep_until_exit(std::move(w.be));
  } else {
    (void)w.finish();
  }
  proxy.reset();
  w.wins.reset();
  w.be.reset();
  bs.reset();
  const std::string named = "culprit rank " + std::to_string(victim) + ":";
  const std::string named_silent = "culprit rank(s) " + std::to_string(victim) + ":";
  write_file(dir + "/result_" + std::to_string(rank),
             rep.to_string() + "\n" + std::to_string(failed_at) + "\n" + std::to_string(now_ms()));
  const std::string m = rep.message();
  return m.find(named) != std::string::npos || m.find(named_silent) != std::string::npos ? 0 : 2;
}

// Ranks whose endpoints were never closed leave the shm provider's regions in /dev/shm,
// 16 MiB each, named "<pid>:...". Returns the names of those of `pids`.
std::vector<std::string> shm_regions_of(const std::vector<pid_t>& pids) {
  std::vector<std::string> found;
  DIR* d = opendir("/dev/shm");
  if (!d) return found;
  while (dirent* e = readdir(d)) {
    for (pid_t p : pids) {
      const std::string prefix = std::to_string(p) + ":";
      if (strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) found.push_back(e->d_name);
    }
  }
  closedir(d);
  return found;
}

// Every name in /dev/shm.
std::vector<std::string> shm_regions_all() {
  std::vector<std::string> found;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') found.push_back(e->d_name);
    closedir(d);
  }
  return found;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The helper the fault tests use to say where a rank that did not leave is stuck: a process
// asleep in a known call is found there (by gdb, or by its threads' names and wait channels).
TEST(Stacks, SayWhereAProcessWaits) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    for (;;) pause();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string where = stacks_of(pid);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  EXPECT_NE(where.find("pid " + std::to_string(pid)), std::string::npos) << where;
  // gdb shows the call (pause, or the syscall under it); /proc at least the thread.
  const bool gdb = where.find("(gdb)") != std::string::npos;
  if (gdb)
    EXPECT_TRUE(where.find("pause") != std::string::npos || where.find("syscall") != std::string::npos) << where;
  else
    EXPECT_NE(where.find("test_proxy_fau"), std::string::npos) << where;
}

class JobFault : public ::testing::TestWithParam<Fault> {};

// W processes stream puts to each other through their proxies; one fails (killed, stopped, or
// its provider fails a put or a completion). Every other rank — and the failing one itself when
// it lives — must leave by itself through the ordinary teardown within the timeout + 5 s of the
// fault, name the failing rank as the culprit, and close its endpoints (no shm region left).
TEST_P(JobFault, EveryRankLeavesAndNamesTheCulprit) {
  const Fault fault = GetParam();
  const int W = 3, victim = 2;
  const int64_t timeout_ms = 2000;
  const bool signal_fault = fault == Fault::kKill || fault == Fault::kStop;
  char tmpl[] = "/tmp/mk-fault-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  // Each process reads the plant at its first put or completion; only the victim's matches.
  if (fault == Fault::kPutError) setenv("MK_FAULT", ("put:error@" + std::to_string(victim) + "#300").c_str(), 1);
  if (fault == Fault::kCompletionError)
    setenv("MK_FAULT", ("completion:error@" + std::to_string(victim) + "#300").c_str(), 1);
  // Regions already there (other jobs' leftovers; a recycled pid can match one) are not ours.
  const std::vector<std::string> before = shm_regions_all();
  std::vector<pid_t> pids(W);
  for (int r = 0; r < W; ++r) {
    pids[r] = fork();
    ASSERT_GE(pids[r], 0);
    if (pids[r] == 0) _exit(child(dir, r, W, victim, timeout_ms));
  }
  unsetenv("MK_FAULT");
  auto deadline = Clock::now() + std::chrono::seconds(30);
  bool ready = false;
  while (!ready && Clock::now() < deadline) {
    ready = true;
    for (int r = 0; r < W; ++r) ready &= access((dir + "/ready_" + std::to_string(r)).c_str(), F_OK) == 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(ready) << "ranks did not start";
  int64_t fault_at = 0;
  if (signal_fault) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(pids[victim], fault == Fault::kKill ? SIGKILL : SIGSTOP);
    fault_at = now_ms();
  }
  // Every process that can leave must leave by itself.
  std::vector<int> status(W, -1);
  std::vector<int64_t> exit_at(W, 0);
  auto give_up = Clock::now() + std::chrono::seconds(40);
  auto must_leave = [&](int r) { return !(signal_fault && r == victim); };
  for (;;) {
    bool all = true;
    for (int r = 0; r < W; ++r) {
      if (status[r] != -1 || !must_leave(r)) continue;
      int st = 0;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        status[r] = st;
        exit_at[r] = now_ms();
      } else {
        all = false;
      }
    }
    if (all || Clock::now() > give_up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // The victim of a signal (stopped or dead) is ended here, as a launcher would; stragglers too.
  for (int r = 0; r < W; ++r) {
    if (status[r] != -1) continue;
    // Where a rank that should have left is stuck, before it is ended (the victim of SIGSTOP
    // would only show its stop).
    const std::string where = must_leave(r) ? test::stacks_of(pids[r]) : std::string();
    kill(pids[r], SIGKILL);
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (must_leave(r))
      ADD_FAILURE() << "rank " << r << " did not leave by itself within 40 s; what it had written: \""
                    << read_file(dir + "/result_" + std::to_string(r)) << "\"\n" << where;
    status[r] = st;
  }
  if (!signal_fault) {
    // The fault's moment: when the first rank saw it.
    fault_at = INT64_MAX;
    for (int r = 0; r < W; ++r) {
      std::istringstream in(read_file(dir + "/result_" + std::to_string(r)));
      std::string line;
      std::getline(in, line);
      int64_t t = 0;
      in >> t;
      if (t > 0) fault_at = std::min(fault_at, t);
    }
  }
  std::vector<pid_t> leavers;
  for (int r = 0; r < W; ++r) {
    if (!must_leave(r)) {
      EXPECT_TRUE(WIFSIGNALED(status[r])) << "the victim was not ended by its signal";
      continue;
    }
    leavers.push_back(pids[r]);
    const std::string res = read_file(dir + "/result_" + std::to_string(r));
    printf("[%s] rank %d left %.1f s after the fault, exit %d: %s\n", fault_name(fault), r,
           (exit_at[r] - fault_at) / 1000.0, WIFEXITED(status[r]) ? WEXITSTATUS(status[r]) : -1,
           res.substr(0, res.find('\n')).c_str());
    EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
        << "rank " << r << " did not name rank " << victim << " as the culprit: " << res;
    EXPECT_LE(exit_at[r] - fault_at, timeout_ms + 5000) << "rank " << r << " took too long to leave";
  }
  // Every rank that left closed its endpoint; the victim's region (if it never closed one) goes.
  std::vector<std::string> kept;
  for (const auto& n : shm_regions_of(leavers))
    if (std::find(before.begin(), before.end(), n) == before.end()) kept.push_back(n);
  EXPECT_TRUE(kept.empty()) << "a rank that left kept its shm region: " << (kept.empty() ? "" : kept[0]);
  for (const auto& n : shm_regions_of(pids))
    if (std::find(before.begin(), before.end(), n) == before.end()) shm_unlink(n.c_str());
  std::string cmd = "rm -rf " + dir;
  (void)!system(cmd.c_str());
}

INSTANTIATE_TEST_SUITE_P(Faults, JobFault,
                         ::testing::Values(Fault::kKill, Fault::kStop, Fault::kPutError, Fault::kCompletionError),
                         [](const ::testing::TestParamInfo<Fault>& i) { return std::string(fault_name(i.param)); });

}  // namespace
}  // namespace test
}  // namespace mk
