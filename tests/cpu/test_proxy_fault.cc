// Fault: W processes stream puts to each other through their proxies; one is killed with
// SIGKILL mid-run. Every survivor must fail within the timeout with an error naming it.
// Processes are forked here (mpirun would tear the whole job down); they bootstrap through
// a key-value store kept in files of a private directory.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cpu/proxy_harness.h"

namespace mk {
namespace test {
namespace {

using Clock = std::chrono::steady_clock;

std::string file_key(const std::string& dir, const std::string& key) {
  std::string k = key;
  for (auto& c : k)
    if (c == '/') c = '_';
  return dir + "/" + k;
}

StoreCallbacks file_store(const std::string& dir) {
  StoreCallbacks cb;
  cb.set = [dir](const std::string& key, const std::vector<uint8_t>& v) -> Status {
    std::string path = file_key(dir, key), tmp = path + ".tmp";
    FILE* f = fopen(tmp.c_str(), "wb");
    if (!f) return make_status(Code::kSystemError, "store: cannot write %s", tmp.c_str());
    fwrite(v.data(), 1, v.size(), f);
    fclose(f);
    rename(tmp.c_str(), path.c_str());  // atomic: readers see all or nothing
    return OkStatus();
  };
  cb.try_get = [dir](const std::string& key, std::vector<uint8_t>* v, bool* found) -> Status {
    std::ifstream f(file_key(dir, key), std::ios::binary);
    *found = static_cast<bool>(f);
    if (*found) v->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    return OkStatus();
  };
  return cb;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// The peer an error names ("a put to rank P", "no arrivals from rank P"), or -1.
int named_peer(const std::string& m) {
  for (const char* key : {"to rank ", "from rank "}) {
    const size_t at = m.find(key);
    if (at != std::string::npos) return atoi(m.c_str() + at + strlen(key));
  }
  return -1;
}

// One rank: exits 0 when it failed with an error naming `victim`, 10 + P when it failed naming
// another peer P, 1 when it did not fail.
int child(const std::string& dir, int rank, int W, int victim, int64_t timeout_ms) {
  std::unique_ptr<Bootstrap> bs;
  if (!make_store_bootstrap(rank, W, "fault", file_store(dir), &bs).ok()) return 1;
  ProxyWorld w;
  Status s = w.init(bs.get(), net::BackendConfig{}, 65536, 65536);
  if (!s.ok()) {
    write_file(dir + "/result_" + std::to_string(rank), "init: " + s.to_string());
    return 1;
  }
  std::vector<uint64_t> flags(W, 0);
  HostFlagSink sink(flags.data(), W);
  std::unique_ptr<Proxy> proxy;
  ProxyConfig pc;
  pc.timeout_ms = timeout_ms;
  if (!Proxy::create(w.wins.get(), &sink, pc, &proxy).ok() || !proxy->start().ok()) return 1;
  (void)bs->barrier();
  write_file(dir + "/ready_" + std::to_string(rank), "ready");
  // Stream puts to every peer; watch every peer's arrivals. A peer whose arrivals stop for
  // timeout_ms, or a proxy error, ends the run.
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
  write_file(dir + "/result_" + std::to_string(rank), err.to_string());
  // Stay alive (the proxy keeps serving) until every survivor has reported, so no survivor
  // mistakes another's exit for the failure. No collective teardown: a peer is dead.
  auto linger = Clock::now() + std::chrono::seconds(20);
  while (access((dir + "/done").c_str(), F_OK) != 0 && Clock::now() < linger)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const int named = err.ok() ? -2 : named_peer(err.message());
  // Leave at once: a collective teardown would wait for the dead rank (and time out).
  _exit(err.ok() || named < 0 ? 1 : named == victim ? 0 : 10 + named);
}

// No rank closes its endpoint (one is killed, the others leave through _exit), so the shm
// provider's regions stay in /dev/shm, 16 MiB each, named "<pid>:...": removed here.
void remove_leftover_shm_regions(const std::vector<pid_t>& pids) {
  DIR* d = opendir("/dev/shm");
  if (!d) return;
  std::vector<std::string> gone;
  while (dirent* e = readdir(d)) {
    for (pid_t p : pids) {
      const std::string prefix = std::to_string(p) + ":";
      if (strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) gone.push_back(e->d_name);
    }
  }
  closedir(d);
  for (const auto& n : gone) shm_unlink(n.c_str());
}

TEST(ProxyFault, KilledPeerIsNamedBySurvivors) {
  const int W = 3, victim = 2;
  const int64_t timeout_ms = 2000;
  char tmpl[] = "/tmp/mk-fault-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<pid_t> pids(W);
  for (int r = 0; r < W; ++r) {
    pids[r] = fork();
    ASSERT_GE(pids[r], 0);
    if (pids[r] == 0) _exit(child(dir, r, W, victim, timeout_ms));
  }
  // Kill the victim once every rank streams.
  auto deadline = Clock::now() + std::chrono::seconds(30);
  bool ready = false;
  while (!ready && Clock::now() < deadline) {
    ready = true;
    for (int r = 0; r < W; ++r) ready &= access((dir + "/ready_" + std::to_string(r)).c_str(), F_OK) == 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(ready) << "ranks did not start";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  kill(pids[victim], SIGKILL);
  auto killed = Clock::now();
  // A survivor has reported when its result file exists.
  std::vector<double> took(W, -1);
  for (int left = W - 1; left > 0 && Clock::now() < killed + std::chrono::seconds(30);) {
    for (int r = 0; r < W; ++r) {
      if (r == victim || took[r] >= 0) continue;
      if (access((dir + "/result_" + std::to_string(r)).c_str(), F_OK) == 0) {
        took[r] = std::chrono::duration<double, std::milli>(Clock::now() - killed).count();
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  write_file(dir + "/done", "done");
  std::vector<int> status(W, -1);
  for (int left = W; left > 0 && Clock::now() < killed + std::chrono::seconds(60);) {
    for (int r = 0; r < W; ++r) {
      if (status[r] != -1) continue;
      int st = 0;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        status[r] = st;
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int r = 0; r < W; ++r) {
    if (status[r] == -1) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], nullptr, 0);
    }
  }
  remove_leftover_shm_regions(pids);
  // Every survivor fails in time, naming the victim — or, when its puts to another survivor
  // stalled behind that survivor's own failure (the shm provider can stop progressing a rank's
  // incoming puts once one of its peers died), naming that survivor, which itself named the
  // victim. At least one survivor names the victim directly.
  auto code = [&](int r) { return WIFEXITED(status[r]) ? WEXITSTATUS(status[r]) : -1; };
  int direct = 0;
  for (int r = 0; r < W; ++r) direct += r != victim && code(r) == 0;
  EXPECT_GE(direct, 1) << "no survivor named rank " << victim;
  for (int r = 0; r < W; ++r) {
    if (r == victim) {
      EXPECT_TRUE(WIFSIGNALED(status[r])) << "the victim was not killed";
      continue;
    }
    std::ifstream f(dir + "/result_" + std::to_string(r));
    std::stringstream msg;
    msg << f.rdbuf();
    printf("rank %d (after %.0f ms): %s\n", r, took[r], msg.str().c_str());
    const int c = code(r);
    const int via = c >= 10 ? c - 10 : -1;
    EXPECT_TRUE(c == 0 || (via >= 0 && via < W && via != victim && via != r && code(via) == 0))
        << "rank " << r << " did not fail naming rank " << victim << " (or a survivor that named it): "
        << msg.str();
    EXPECT_GE(took[r], 0.0) << "rank " << r << " never reported";
    EXPECT_LT(took[r], timeout_ms + 5000.0) << "rank " << r << " took too long";
  }
  std::string cmd = "rm -rf " + dir;
  (void)!system(cmd.c_str());
}

}  // namespace
}  // namespace test
}  // namespace mk
