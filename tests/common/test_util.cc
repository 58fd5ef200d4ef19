#include "tests/common/test_util.h"

#include <cuda_runtime_api.h>
#include <dirent.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <fstream>
#include <random>
#include <sstream>

#include "mkernel/common/check.h"

namespace mk {
namespace test {

uint64_t fresh_seed() {
  uint64_t t = static_cast<uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  return t ^ (static_cast<uint64_t>(std::random_device{}()) * 0x9e3779b97f4a7c15ull);
}

namespace {
std::atomic<uint64_t> g_seed{0};
std::once_flag g_seed_once;
void init_seed() {
  std::call_once(g_seed_once, [] {
    const char* s = getenv("MK_TEST_SEED");
    g_seed.store(s && *s ? static_cast<uint64_t>(strtoull(s, nullptr, 0)) : fresh_seed());
  });
}
}  // namespace

uint64_t test_seed() {
  init_seed();
  return g_seed.load();
}

void set_test_seed(uint64_t seed) {
  init_seed();  // a later test_seed() must not overwrite it
  g_seed.store(seed);
  setenv("MK_TEST_SEED", std::to_string(seed).c_str(), 1);
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x;
}

std::vector<uint8_t> rank_payload(uint64_t op, int rank, size_t n) {
  std::mt19937_64 g(mix(mix(test_seed(), op), static_cast<uint64_t>(rank) + 1));
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(g());
  if (n >= 8) {
    uint32_t r = static_cast<uint32_t>(rank), o = static_cast<uint32_t>(op);
    memcpy(v.data(), &r, 4);
    memcpy(v.data() + 4, &o, 4);
  }
  return v;
}

bool small_shapes() {
  const char* v = getenv("MK_TEST_SMALL");
  return v && *v && strcmp(v, "0") != 0;
}

uint64_t test_stride() {
  static const uint64_t n = [] {
    const char* v = getenv("MK_TEST_STRIDE");
    if (!v || !*v) return uint64_t(1);
    char* end = nullptr;
    const unsigned long long x = strtoull(v, &end, 10);
    if (*end != '\0' || x < 1) {
      fprintf(stderr, "MK_TEST_STRIDE='%s': not a number >= 1\n", v);
      std::abort();
    }
    return uint64_t(x);
  }();
  return n;
}

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

namespace {
class SeedReporter : public ::testing::EmptyTestEventListener {
 public:
  explicit SeedReporter(int rank) : rank_(rank) {}
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (!t.result()->Failed()) return;
    const unsigned long long s = static_cast<unsigned long long>(test_seed());
    const std::string who = rank_ >= 0 ? "[rank " + std::to_string(rank_) + "] " : "";
    fprintf(stderr, "%s%s.%s failed with run seed %llu: MK_TEST_SEED=%llu replays it\n", who.c_str(),
            t.test_suite_name(), t.name(), s, s);
  }
 private:
  int rank_;
};
}  // namespace

::testing::TestEventListener* new_seed_reporter(int rank) { return new SeedReporter(rank); }

std::vector<std::string> skipped_tests() {
  std::vector<std::string> out;
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < u.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& s = *u.GetTestSuite(i);
    for (int j = 0; j < s.total_test_count(); ++j) {
      const ::testing::TestInfo& t = *s.GetTestInfo(j);
      if (!t.should_run() || !t.result()->Skipped()) continue;
      std::string why;
      for (int k = 0; k < t.result()->total_part_count(); ++k) {
        const ::testing::TestPartResult& r = t.result()->GetTestPartResult(k);
        if (r.skipped() && r.message() && *r.message()) why = r.message();
      }
      while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
      if (why.rfind("Skipped\n", 0) == 0) why = why.substr(8);  // GTEST_SKIP()'s own prefix
      out.push_back(std::string(s.name()) + "." + t.name() + (why.empty() ? "" : ": " + why));
    }
  }
  return out;
}

int exit_code(int rc, int rank, bool quiet) {
  if (rc != 0 || ::testing::UnitTest::GetInstance()->Failed()) return 1;
  const std::vector<std::string> skipped = skipped_tests();
  if (skipped.empty()) return 0;
  const std::string who = rank >= 0 ? "[rank " + std::to_string(rank) + "] " : "";
  printf("%sSKIPPED: %zu test(s) did not run here, so this binary reports skipped (exit %d), not passed%s\n",
         who.c_str(), skipped.size(), kSkipExitCode, quiet ? "" : ":");
  if (!quiet)
    for (const auto& s : skipped) printf("%s  %s\n", who.c_str(), s.c_str());
  fflush(stdout);
  return kSkipExitCode;
}

Status make_one_rank_comm(std::unique_ptr<Communicator>* out) {
  std::vector<std::unique_ptr<Bootstrap>> world;
  MK_CHECK(make_thread_world(1, &world));
  CommConfig cfg;
  cfg.require_gpu = true;
  return Communicator::create(std::move(world[0]), cfg, out);
}

StoreCallbacks file_store(const std::string& dir) {
  auto path_of = [dir](const std::string& key) {
    std::string k = key;
    for (auto& c : k)
      if (c == '/') c = '_';
    return dir + "/" + k;
  };
  StoreCallbacks cb;
  cb.set = [path_of](const std::string& key, const std::vector<uint8_t>& v) -> Status {
    const std::string path = path_of(key), tmp = path + ".tmp";
    FILE* f = fopen(tmp.c_str(), "wb");
    if (!f) return make_status(Code::kSystemError, "file store: cannot write %s", tmp.c_str());
    const bool ok = fwrite(v.data(), 1, v.size(), f) == v.size();
    if (fclose(f) != 0 || !ok) return make_status(Code::kSystemError, "file store: cannot write %s", tmp.c_str());
    if (rename(tmp.c_str(), path.c_str()) != 0)  // atomic: readers see all or nothing
      return make_status(Code::kSystemError, "file store: cannot rename %s", tmp.c_str());
    return OkStatus();
  };
  cb.try_get = [path_of](const std::string& key, size_t max_bytes, std::vector<uint8_t>* v, bool* found) -> Status {
    FILE* f = fopen(path_of(key).c_str(), "rb");
    *found = f != nullptr;
    if (!f) return OkStatus();
    v->clear();
    uint8_t buf[4096];
    size_t n;
    while (v->size() <= max_bytes && (n = fread(buf, 1, sizeof(buf), f)) > 0) v->insert(v->end(), buf, buf + n);
    fclose(f);
    return OkStatus();
  };
  return cb;
}

std::string stacks_of(int pid, size_t max_chars) {
  std::string out;
  const std::string pid_s = std::to_string(pid);
  if (system("command -v gdb >/dev/null 2>&1") == 0) {
    const std::string cmd = "timeout 30 gdb -batch -nx -p " + pid_s + " -ex 'thread apply all bt' 2>&1";
    if (FILE* f = popen(cmd.c_str(), "r")) {
      char buf[4096];
      size_t n;
      while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
      pclose(f);
    }
    if (out.find("#0") != std::string::npos) {
      // gdb's own chatter before the first thread is not worth the space.
      const size_t t = out.find("\nThread ");
      if (t != std::string::npos) out = out.substr(t + 1);
      if (out.size() > max_chars) out = out.substr(0, max_chars) + "\n...";
      return "stacks of pid " + pid_s + " (gdb):\n" + out;
    }
  }
  out = "threads of pid " + pid_s + " (name, kernel wait channel):\n";
  const std::string task = "/proc/" + pid_s + "/task";
  if (DIR* d = opendir(task.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      auto read = [&](const char* what) {
        std::ifstream f(task + "/" + e->d_name + "/" + what);
        std::stringstream ss;
        ss << f.rdbuf();
        std::string v = ss.str();
        while (!v.empty() && v.back() == '\n') v.pop_back();
        return v;
      };
      out += std::string("  ") + e->d_name + " " + read("comm") + ": " + read("wchan") + "\n";
    }
    closedir(d);
  }
  if (out.size() > max_chars) out = out.substr(0, max_chars) + "\n...";
  return out;
}

}  // namespace test
}  // namespace mk
