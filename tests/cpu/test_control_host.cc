// The controller's host side: the learned starting split (src/ops/control/split_memory.h) and
// policy auto's choice between the fused and the unfused path (src/ops/control/path_policy.h),
// with injected timings.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "src/ops/control/path_policy.h"
#include "src/ops/control/split_memory.h"
#include "tests/common/test_util.h"

namespace mk {
namespace ops {
namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/mk-split-XXXXXX";
  const char* d = mkdtemp(tmpl);
  return d ? d : "";
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A private file's text (the split memory refuses files others may write).
void write_file(const std::string& path, const std::string& text, mode_t mode = 0600) {
  { std::ofstream(path, std::ios::trunc) << text; }
  ASSERT_EQ(chmod(path.c_str(), mode), 0);
}

// ---------------------------------------------------------------------------------------
// SplitMemory

TEST(SplitMemory, KeyNamesEveryPart) {
  const std::string k = split_key("gemm_rs", 8192, 4096, 2048, 4, 2, "tcp;ofi_rxm", 3);
  EXPECT_EQ(k, "gemm_rs M=8192 N=4096 K=2048 W=4 nodes=2 provider=tcp;ofi_rxm rank=3");
  EXPECT_NE(k, split_key("gemm_rs", 8192, 4096, 2048, 4, 2, "tcp;ofi_rxm", 2));
  EXPECT_NE(k, split_key("gemm_ar", 8192, 4096, 2048, 4, 2, "tcp;ofi_rxm", 3));
  EXPECT_EQ(split_key("ag_gemm", 1, 2, 3, 1, 1, "", 0), "ag_gemm M=1 N=2 K=3 W=1 nodes=1 provider=none rank=0");
  EXPECT_EQ(split_key("x", 1, 1, 1, 1, 1, "a b\tc", 0), "x M=1 N=1 K=1 W=1 nodes=1 provider=a_b_c rank=0");
}

TEST(SplitMemory, InMemory) {
  SplitMemory m;
  int c = -1;
  EXPECT_FALSE(m.lookup("a", &c));
  MK_EXPECT_OK(m.record("a", 12));
  ASSERT_TRUE(m.lookup("a", &c));
  EXPECT_EQ(c, 12);
  MK_EXPECT_OK(m.record("a", 5));
  ASSERT_TRUE(m.lookup("a", &c));
  EXPECT_EQ(c, 5);
  EXPECT_EQ(m.size(), 1u);
  EXPECT_EQ(m.record("b", 0).code(), Code::kInvalidArgument);
  EXPECT_EQ(m.record("b\tc", 3).code(), Code::kInvalidArgument);
  EXPECT_EQ(m.record("#b", 3).code(), Code::kInvalidArgument);
  EXPECT_EQ(m.record("", 3).code(), Code::kInvalidArgument);
  EXPECT_EQ(m.size(), 1u);
  m.clear();
  EXPECT_FALSE(m.lookup("a", &c));
}

TEST(SplitMemory, FileRoundTripAndMerge) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string file = dir + "/splits.txt";
  std::mt19937 rng(static_cast<uint32_t>(test::test_seed()));
  std::vector<std::pair<std::string, int>> want;
  {
    SplitMemory m;
    MK_ASSERT_OK(m.attach(file));  // no file yet: fine
    for (int i = 0; i < 20; ++i) {
      const std::string k = split_key("gemm_rs", 128 * (1 + rng() % 64), 4096, 1024, 4, 2, "shm", i % 4);
      const int c = 1 + static_cast<int>(rng() % 32);
      MK_ASSERT_OK(m.record(k, c));
      want.emplace_back(k, c);
    }
  }
  // A second memory (another process's) reads them all back.
  SplitMemory r;
  MK_ASSERT_OK(r.attach(file));
  for (const auto& [k, c] : want) {
    int got = -1;
    ASSERT_TRUE(r.lookup(k, &got)) << k;
    int last = -1;
    for (const auto& w : want)
      if (w.first == k) last = w.second;
    EXPECT_EQ(got, last) << k;
  }
  // Its writes keep the other's entries.
  MK_ASSERT_OK(r.record("ring_attention M=1 N=1 K=1 W=2 nodes=1 provider=none rank=0", 3));
  SplitMemory again;
  MK_ASSERT_OK(again.attach(file));
  EXPECT_EQ(again.size(), r.size());
  // An entry already in memory keeps its value when a file is attached.
  SplitMemory mine;
  MK_ASSERT_OK(mine.record(want[0].first, 31));
  MK_ASSERT_OK(mine.attach(file));
  int c = 0;
  ASSERT_TRUE(mine.lookup(want[0].first, &c));
  EXPECT_EQ(c, 31);
  EXPECT_EQ(slurp(file).rfind("# mkernel split memory v1", 0), 0u);
}

TEST(SplitMemory, MalformedFilesAreNamed) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/bad.txt";
  const char* cases[] = {"k\tabc\n", "k\t0\n", "k\t-3\n", "no tab here\n", "\t5\n", "k\t5x\n", "k\t\n"};
  for (const char* body : cases) {
    write_file(file, std::string("# header\nfine key\t4\n") + body);
    SplitMemory m;
    MK_ASSERT_OK(m.record("kept", 7));
    Status s = m.attach(file);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << body;
    EXPECT_NE(s.message().find("line 3"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(file), std::string::npos) << s.message();
    EXPECT_EQ(m.size(), 1u) << "a bad file leaves the memory as it was";
    EXPECT_TRUE(m.path().empty());
  }
  // Comments, blank lines and CRLF endings are fine.
  write_file(file, "# c\r\n\r\nkey one\t9\r\n");
  SplitMemory m;
  MK_ASSERT_OK(m.attach(file));
  int c = 0;
  ASSERT_TRUE(m.lookup("key one", &c));
  EXPECT_EQ(c, 9);
}

TEST(SplitMemory, UnwritableFileIsAnErrorNotALoss) {
  SplitMemory m;
  MK_ASSERT_OK(m.attach("/nonexistent-dir-mk/splits.txt"));
  Status s = m.record("a", 4);
  EXPECT_EQ(s.code(), Code::kSystemError);
  EXPECT_NE(s.message().find("/nonexistent-dir-mk/splits.txt"), std::string::npos) << s.message();
  int c = 0;
  ASSERT_TRUE(m.lookup("a", &c)) << "the memory keeps it";
  EXPECT_EQ(c, 4);
}

// The file and its lock are private files (src/common/private_file.h): every trap another local
// user could set in a shared directory is refused promptly, and nothing is written through it.
TEST(SplitMemory, FileTrapsAreRefused) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string file = dir + "/splits.txt", victim = dir + "/victim";
  write_file(victim, "victim\n");
  auto refused = [](const Status& s, Code code, const std::string& word) {
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(word), std::string::npos) << s.message();
  };
  // The file a symbolic link (to a file this user may write).
  ASSERT_EQ(symlink(victim.c_str(), file.c_str()), 0);
  {
    SplitMemory m;
    refused(m.attach(file), Code::kPermissionDenied, "symbolic link");
  }
  unlink(file.c_str());
  // The lock a symbolic link: the write is refused, the target untouched.
  ASSERT_EQ(symlink(victim.c_str(), (file + ".lock").c_str()), 0);
  {
    SplitMemory m;
    MK_ASSERT_OK(m.attach(file));
    refused(m.record("k", 3), Code::kPermissionDenied, "symbolic link");
    int c = 0;
    EXPECT_TRUE(m.lookup("k", &c)) << "the memory keeps it";
  }
  unlink((file + ".lock").c_str());
  EXPECT_EQ(slurp(victim), "victim\n");
  // A FIFO (once hung attach for good), a directory.
  ASSERT_EQ(mkfifo(file.c_str(), 0600), 0);
  {
    SplitMemory m;
    refused(m.attach(file), Code::kPermissionDenied, "not a regular file");
  }
  unlink(file.c_str());
  ASSERT_EQ(mkdir(file.c_str(), 0700), 0);
  {
    SplitMemory m;
    refused(m.attach(file), Code::kPermissionDenied, "not a regular file");
  }
  rmdir(file.c_str());
  // Writable by others.
  write_file(file, "# h\nk\t4\n", 0666);
  {
    SplitMemory m;
    refused(m.attach(file), Code::kPermissionDenied, "writable by group or others");
  }
  // Larger than any memory of ours (a 65 MB file once cost 848 MB and 3.7 s per rank).
  write_file(file, std::string(SplitMemory::kMaxFileBytes + 1, '#'));
  {
    SplitMemory m;
    refused(m.attach(file), Code::kInvalidArgument, std::to_string(SplitMemory::kMaxFileBytes + 1) + " bytes");
  }
  unlink(file.c_str());
  // What it creates is 0600, the lock too.
  {
    SplitMemory m;
    MK_ASSERT_OK(m.attach(file));
    MK_ASSERT_OK(m.record("k", 5));
  }
  for (const std::string& p : {file, file + ".lock"}) {
    struct stat st;
    ASSERT_EQ(stat(p.c_str(), &st), 0) << p;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << p;
  }
  for (const std::string& p : {file, file + ".lock", victim}) unlink(p.c_str());
  rmdir(dir.c_str());
}

// Files of another user (a 0666 lock another uid left in a shared 1777 directory once blocked
// destroy for good): refused by owner. As root the test makes such files (uid 65534); as
// another user it names a file of root's (/etc/passwd) and checks the memory file only.
TEST(SplitMemory, FilesOfAnotherUserAreRefused) {
  if (geteuid() != 0) {
    SplitMemory m;
    Status s = m.attach("/etc/passwd");
    EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
    EXPECT_NE(s.message().find("owned by uid 0"), std::string::npos) << s.message();
    return;
  }
  const std::string dir = temp_dir();
  const std::string file = dir + "/splits.txt";
  write_file(file, "# h\nk\t4\n");
  ASSERT_EQ(chown(file.c_str(), 65534, 65534), 0);
  {
    SplitMemory m;
    Status s = m.attach(file);
    EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
    EXPECT_NE(s.message().find("owned by uid 65534"), std::string::npos) << s.message();
  }
  unlink(file.c_str());
  write_file(file + ".lock", "", 0666);
  ASSERT_EQ(chown((file + ".lock").c_str(), 65534, 65534), 0);
  {
    SplitMemory m;
    MK_ASSERT_OK(m.attach(file));
    Status s = m.record("k", 3);
    EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
    EXPECT_NE(s.message().find("owned by uid 65534"), std::string::npos) << s.message();
  }
  unlink((file + ".lock").c_str());
  rmdir(dir.c_str());
}

// A lock another process holds and never releases fails the write within the bound (kTimeout,
// naming the lock), and the memory keeps the value; once released, the write goes through.
TEST(SplitMemory, LockHeldElsewhereFailsWithinItsBound) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/splits.txt";
  SplitMemory m;
  MK_ASSERT_OK(m.attach(file));
  m.set_lock_timeout_ms(300);
  // Another open file description of the lock, locked: flock(2) treats it as another holder.
  const int other = open((file + ".lock").c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(other, 0);
  ASSERT_EQ(flock(other, LOCK_EX), 0);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = m.record("k", 6);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find(file + ".lock"), std::string::npos) << s.message();
  EXPECT_GE(secs, 0.25);
  EXPECT_LT(secs, 5.0);
  int c = 0;
  EXPECT_TRUE(m.lookup("k", &c) && c == 6);
  close(other);  // releases it
  MK_EXPECT_OK(m.flush());
  SplitMemory r;
  MK_ASSERT_OK(r.attach(file));
  EXPECT_TRUE(r.lookup("k", &c) && c == 6);
  for (const std::string& p : {file, file + ".lock"}) unlink(p.c_str());
  rmdir(dir.c_str());
}

// Ranks of a job write one file at once: every entry of every writer survives.
TEST(SplitMemory, ConcurrentWritersMerge) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/shared.txt";
  const int kProcs = 4, kEach = 25;
  std::vector<pid_t> kids;
  for (int p = 0; p < kProcs; ++p) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      SplitMemory m;
      if (!m.attach(file).ok()) _exit(2);
      for (int i = 0; i < kEach; ++i)
        if (!m.record("op rank=" + std::to_string(p) + " i=" + std::to_string(i), 1 + p * 100 + i).ok()) _exit(3);
      _exit(0);
    }
    kids.push_back(pid);
  }
  for (pid_t k : kids) {
    int st = 0;
    ASSERT_EQ(waitpid(k, &st, 0), k);
    ASSERT_TRUE(WIFEXITED(st));
    EXPECT_EQ(WEXITSTATUS(st), 0);
  }
  SplitMemory r;
  MK_ASSERT_OK(r.attach(file));
  EXPECT_EQ(r.size(), static_cast<size_t>(kProcs * kEach));
  for (int p = 0; p < kProcs; ++p)
    for (int i = 0; i < kEach; ++i) {
      int c = 0;
      ASSERT_TRUE(r.lookup("op rank=" + std::to_string(p) + " i=" + std::to_string(i), &c));
      EXPECT_EQ(c, 1 + p * 100 + i);
    }
}

// ---------------------------------------------------------------------------------------
// PathPolicy

// Every rank's policy through the calls until decided, each rank's timings injected (noisy, per
// rank), the decision made from every rank's medians as the operator does. Returns the paths of
// the calls (the same on every rank, checked) and the choice.
struct Ranks {
  std::vector<PathPolicy> pol;
  std::vector<Path> order;
};
Ranks run_ranks(int W, PathPolicyConfig cfg, const std::vector<double>& fused_ms, const std::vector<double>& unfused_ms,
                std::mt19937& rng, int extra_calls = 20) {
  std::uniform_real_distribution<double> noise(0.97, 1.03);
  Ranks r;
  r.pol.assign(W, PathPolicy(PathMode::kAuto, cfg));
  for (int call = 0; call < 1000 && (extra_calls > 0); ++call) {
    std::vector<PathPolicy::Call> c(W);
    for (int q = 0; q < W; ++q) c[q] = r.pol[q].next();
    for (int q = 1; q < W; ++q) {
      EXPECT_EQ(c[q].path, c[0].path) << "call " << call << ": rank " << q << " takes another path";
      EXPECT_EQ(c[q].decide_before, c[0].decide_before) << "call " << call;
    }
    if (c[0].decide_before) {
      std::vector<double> f(W), u(W);
      for (int q = 0; q < W; ++q) f[q] = r.pol[q].median(Path::kFused), u[q] = r.pol[q].median(Path::kUnfused);
      for (int q = 0; q < W; ++q) r.pol[q].decide(f, u);
      for (int q = 0; q < W; ++q) c[q] = r.pol[q].next();
      EXPECT_FALSE(c[0].decide_before);
    }
    r.order.push_back(c[0].path);
    for (int q = 0; q < W; ++q)
      if (c[q].timed) {
        const double ms = (c[q].path == Path::kFused ? fused_ms[q] : unfused_ms[q]) * noise(rng);
        EXPECT_TRUE(r.pol[q].report(c[q].path, ms).ok());
      }
    if (r.pol[0].decided()) --extra_calls;
  }
  return r;
}

TEST(PathPolicy, FixedModesNeverTime) {
  for (PathMode m : {PathMode::kFused, PathMode::kUnfused}) {
    PathPolicy p(m);
    EXPECT_TRUE(p.settled());
    for (int i = 0; i < 30; ++i) {
      const PathPolicy::Call c = p.next();
      EXPECT_EQ(c.path, m == PathMode::kFused ? Path::kFused : Path::kUnfused);
      EXPECT_FALSE(c.timed || c.decide_before);
    }
    EXPECT_EQ(p.describe(), path_mode_name(m));
  }
  PathMode m;
  MK_EXPECT_OK(parse_path_mode("auto", &m));
  EXPECT_EQ(m, PathMode::kAuto);
  EXPECT_NE(parse_path_mode("sometimes", &m).to_string().find("'sometimes' is not fused, unfused or auto"),
            std::string::npos);
}

TEST(PathPolicy, PicksThePathWhoseSlowestRankIsFaster) {
  std::mt19937 rng(static_cast<uint32_t>(test::test_seed()));
  // One rank: the faster path.
  Ranks r = run_ranks(1, {1, 5}, {1.0}, {1.3}, rng);
  EXPECT_EQ(r.pol[0].choice(), Path::kFused);
  r = run_ranks(1, {1, 5}, {1.3}, {1.0}, rng);
  EXPECT_EQ(r.pol[0].choice(), Path::kUnfused);
  // The sequence, in blocks of one path (each led by a warm-up call): fused 1 + 3, unfused 1 + 5,
  // fused 1 + 2, then the choice.
  ASSERT_GE(r.order.size(), 14u);
  for (size_t i = 0; i < 13; ++i) EXPECT_EQ(r.order[i], i < 4 || i >= 10 ? Path::kFused : Path::kUnfused) << i;
  for (size_t i = 13; i < r.order.size(); ++i) EXPECT_EQ(r.order[i], Path::kUnfused) << i;
  {
    // Which calls are timed: all but each block's first.
    PathPolicy p(PathMode::kAuto, {1, 5});
    std::string timed;
    for (int i = 0; i < 13; ++i) timed += p.next().timed ? 't' : '-';
    EXPECT_EQ(timed, "-ttt-ttttt-tt");
    EXPECT_TRUE(p.next().decide_before);
    EXPECT_EQ(p.describe(), "auto: deciding (call 13 of 13)");
  }
  EXPECT_EQ(r.pol[0].describe().rfind("auto: unfused (fused 1.", 0), 0u) << r.pol[0].describe();
  // Four ranks: unfused is faster on three of them, but its slowest rank (2.0) is slower than
  // fused's slowest (1.5): fused, on every rank.
  r = run_ranks(4, {1, 5}, {1.5, 1.5, 1.5, 1.5}, {1.0, 1.0, 2.0, 1.0}, rng);
  for (int q = 0; q < 4; ++q) EXPECT_EQ(r.pol[q].choice(), Path::kFused) << "rank " << q;
  r = run_ranks(4, {0, 3}, {1.5, 1.2, 1.5, 1.5}, {1.0, 1.0, 1.4, 1.0}, rng);
  for (int q = 0; q < 4; ++q) EXPECT_EQ(r.pol[q].choice(), Path::kUnfused) << "rank " << q;
  // The slowest rank anywhere in the list: fused's (rank 1, 2.2) is slower than unfused's (2.0).
  r = run_ranks(4, {1, 3}, {1.5, 2.2, 1.5, 1.5}, {1.0, 1.0, 2.0, 1.0}, rng);
  for (int q = 0; q < 4; ++q) EXPECT_EQ(r.pol[q].choice(), Path::kUnfused) << "rank " << q;
  PathPolicy d(PathMode::kAuto);
  d.decide({3.0, 1.0}, {2.0, 2.0});
  EXPECT_EQ(d.choice(), Path::kUnfused);
  EXPECT_DOUBLE_EQ(d.decided_fused_ms(), 3.0);
  d = PathPolicy(PathMode::kAuto);
  d.decide({1.0, 1.0}, {2.0, 0.5});
  EXPECT_EQ(d.choice(), Path::kFused);
  EXPECT_DOUBLE_EQ(d.decided_unfused_ms(), 2.0);
}

TEST(PathPolicy, TiesAndMissingTimesGoToFused) {
  PathPolicy p(PathMode::kAuto, {0, 3});
  p.decide({2.0, 2.0}, {2.0, 1.0});
  EXPECT_EQ(p.choice(), Path::kFused) << "a tie of the slowest ranks";
  PathPolicy q(PathMode::kAuto, {0, 3});
  q.decide({2.0, 2.0}, {1.0, 0.0});
  EXPECT_EQ(q.choice(), Path::kFused) << "a rank without an unfused time";
  // An outlier does not move a median.
  PathPolicy o(PathMode::kAuto, {0, 5});
  const double fused[] = {1.0, 1.0, 50.0, 1.0, 1.0};
  int fi = 0;
  for (int i = 0; i < 10; ++i) {
    const PathPolicy::Call c = o.next();
    ASSERT_TRUE(c.timed);
    MK_ASSERT_OK(o.report(c.path, c.path == Path::kFused ? fused[fi++] : 1.1));
  }
  EXPECT_TRUE(o.next().decide_before);
  EXPECT_DOUBLE_EQ(o.median(Path::kFused), 1.0);
  o.decide({o.median(Path::kFused)}, {o.median(Path::kUnfused)});
  EXPECT_EQ(o.choice(), Path::kFused);
}

TEST(PathPolicy, RememberedChoiceSkipsTheTrials) {
  PathPolicy p(PathMode::kAuto);
  EXPECT_FALSE(p.settled());
  p.preset(Path::kUnfused);
  EXPECT_TRUE(p.settled());
  for (int i = 0; i < 5; ++i) {
    const PathPolicy::Call c = p.next();
    EXPECT_EQ(c.path, Path::kUnfused);
    EXPECT_FALSE(c.timed || c.decide_before);
  }
  EXPECT_EQ(p.describe(), "auto: unfused (remembered)");
}

TEST(PathPolicy, BadReportsAreRefused) {
  PathPolicy p(PathMode::kAuto, {0, 2});
  EXPECT_EQ(p.report(Path::kFused, 1.0).code(), Code::kInvalidArgument) << "no timed call yet";
  const PathPolicy::Call c = p.next();
  ASSERT_TRUE(c.timed);
  EXPECT_EQ(p.report(c.path, 0.0).code(), Code::kInvalidArgument);
  EXPECT_EQ(p.report(c.path, -1.0).code(), Code::kInvalidArgument);
  EXPECT_EQ(p.report(c.path, std::nan("")).code(), Code::kInvalidArgument);
  const Path other = c.path == Path::kFused ? Path::kUnfused : Path::kFused;
  EXPECT_EQ(p.report(other, 1.0).code(), Code::kInvalidArgument) << "that path never ran timed";
  MK_EXPECT_OK(p.report(c.path, 1.0));
  EXPECT_EQ(p.report(c.path, 1.0).code(), Code::kInvalidArgument) << "one timing per timed call";
}

}  // namespace
}  // namespace ops
}  // namespace mk
