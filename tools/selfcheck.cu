// `mkernel selfcheck`: bootstrap, topology, symmetric memory and signals on the local GPUs.
// Under mpirun each process is one rank (real IPC mapping between processes); otherwise a
// world of threads in this process. Without a GPU it says so and checks what runs on the CPU.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/cuda_check.h"
#include "mkernel/device/signal.cuh"
#include "mkernel/mkernel.h"
#include "tools/cli.h"

namespace mk {
namespace cli {
namespace {

std::mutex g_print;
#define SAY(...)                                   \
  do {                                             \
    std::lock_guard<std::mutex> g_(g_print);       \
    printf(__VA_ARGS__);                           \
    fflush(stdout);                                \
  } while (0)

__host__ __device__ inline uint32_t tag(int rank, size_t i) {
  return (static_cast<uint32_t>(rank + 1) << 24) ^ static_cast<uint32_t>(i * 2654435761u);
}

__global__ void fill_kernel(uint32_t* p, size_t n, int rank) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = tag(rank, i);
}

__global__ void check_kernel(SymmetricView v, size_t n, unsigned long long* bad) {
  unsigned long long mine = 0;
  for (int r = 0; r < v.world; ++r) {
    const uint32_t* p = static_cast<const uint32_t*>(v.peers[r]);
    if (!p) continue;
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
      mine += p[i] != tag(r, i);
  }
  if (mine) atomicAdd(bad, mine);
}

// Every mapped peer raises flag[rank] on every other mapped peer to `it`, `iters` times.
__global__ void exchange_kernel(SignalView s, WaitCtx ctx, int iters) {
  for (int it = 1; it <= iters; ++it) {
    for (int r = 0; r < s.world; ++r)
      if (r != s.rank && s.peers[r]) device::signal_set(&s.peers[r][s.rank], it);
    for (int r = 0; r < s.world; ++r)
      if (r != s.rank && s.peers[r]) device::wait_ge(ctx, &s.local[r], it, r, r);
  }
}

Status check_bootstrap(Bootstrap& bs, double* barrier_us) {
  const int W = bs.size(), R = bs.rank();
  std::vector<uint64_t> mine(64), all(64 * W);
  for (int i = 0; i < 64; ++i) mine[i] = (uint64_t(R) << 32) | uint64_t(i * 7 + 1);
  MK_CHECK(bs.allgather(mine.data(), all.data(), 64 * sizeof(uint64_t)));
  for (int r = 0; r < W; ++r)
    for (int i = 0; i < 64; ++i)
      MK_REQUIRE(all[r * 64 + i] == ((uint64_t(r) << 32) | uint64_t(i * 7 + 1)), Code::kInternal,
                 "allgather: rank %d's word %d is wrong", r, i);
  for (int root = 0; root < W; ++root) {
    uint64_t v = (R == root) ? 0xabc000u + root : 0;
    MK_CHECK(bs.broadcast(&v, sizeof(v), root));
    MK_REQUIRE(v == 0xabc000u + root, Code::kInternal, "broadcast from %d gave %llx", root,
               static_cast<unsigned long long>(v));
  }
  std::vector<double> t;
  for (int i = 0; i < 21; ++i) {
    auto a = std::chrono::steady_clock::now();
    MK_CHECK(bs.barrier());
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  *barrier_us = t[t.size() / 2];
  return OkStatus();
}

// Synchronizes the stream and checks the communicator's health: a device wait that gave up lets
// its kernel finish, and only comm.check() (its decoded record) says so. When both fail, the
// record comes first: it names the culprit, the CUDA error is what followed.
Status synced(Communicator& comm) {
  const Status s = comm.sync(comm.stream());
  const Status c = comm.check();
  if (c.ok()) return s;
  if (s.ok()) return c;
  if (s.message().find(c.message()) != std::string::npos) return s;
  return Status(c.code(), c.message() + " (then: " + s.to_string() + ")");
}

// Every rank passes the outcome of a step it ran on its own and gets the same result (the first
// failing rank's error), so all ranks leave by the same path and no rank waits in a collective
// for one that left. A failing rank prints its own whole message (agree() carries ~250 chars).
Status agreed(Communicator& comm, const Status& mine, const char* what) {
  if (!mine.ok()) SAY("rank %d: %s: %s\n", comm.rank(), what, mine.to_string().c_str());
  return agree(comm.bootstrap(), mine, what);
}

Status check_gpu(Communicator& comm, int64_t timeout_ms) {
  const size_t n = (1u << 20) / 4 + 13;  // not a multiple of anything convenient
  SymmetricBuffer* buf = nullptr;
  MK_CHECK(comm.heap().alloc(n * 4, &buf));
  Status s = [&]() -> Status {
    fill_kernel<<<132, 256, 0, comm.stream()>>>(static_cast<uint32_t*>(buf->local()), n, comm.rank());
    MK_CUDA_CHECK(cudaGetLastError());
    return synced(comm);
  }();
  // Every rank's copy is written before any rank reads it.
  MK_CHECK(agreed(comm, s, "selfcheck: filling symmetric memory"));
  const int mapped = static_cast<int>(comm.topology().mapped_ranks().size());
  s = [&]() -> Status {
    unsigned long long* bad = nullptr;
    MK_CUDA_CHECK(cudaMalloc(&bad, sizeof(*bad)));
    unsigned long long h = 0;
    Status r = [&]() -> Status {
      MK_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof(*bad), comm.stream()));
      check_kernel<<<132, 256, 0, comm.stream()>>>(buf->view(), n, bad);
      MK_CUDA_CHECK(cudaGetLastError());
      MK_CHECK(synced(comm));
      MK_CUDA_CHECK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
      return OkStatus();
    }();
    cudaFree(bad);
    MK_CHECK(r);
    MK_REQUIRE(h == 0, Code::kInternal, "rank %d read %llu wrong words from its %d mapped ranks", comm.rank(), h,
               mapped);
    return OkStatus();
  }();
  MK_CHECK(agreed(comm, s, "selfcheck: reading the mapped ranks' copies"));
  SAY("rank %d: symmetric memory (%s): read %d mapped ranks' copies (%zu words each): ok\n",
      comm.rank(), symmetric_mode_name(buf->mode()), mapped, n);

  SymmetricBuffer* flags = nullptr;
  MK_CHECK(comm.alloc_signals(comm.world(), &flags));
  const int iters = 200;
  float ms = 0;
  s = [&]() -> Status {
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    Status r = [&]() -> Status {
      MK_CUDA_CHECK(cudaEventCreate(&e0));
      MK_CUDA_CHECK(cudaEventCreate(&e1));
      MK_CUDA_CHECK(cudaEventRecord(e0, comm.stream()));
      exchange_kernel<<<1, 1, 0, comm.stream()>>>(flags->signal_view(),
                                                  comm.wait_ctx(OpTag::kSelfCheck, Role::kTest, timeout_ms), iters);
      MK_CUDA_CHECK(cudaGetLastError());
      MK_CUDA_CHECK(cudaEventRecord(e1, comm.stream()));
      // A flag that never came: the wait gives up, the kernel finishes, check() names the peer.
      MK_CHECK(synced(comm));
      MK_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return OkStatus();
    }();
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    return r;
  }();
  MK_CHECK(agreed(comm, s, "selfcheck: signal exchange"));
  SAY("rank %d: signals: %d rounds of flag exchange with %d mapped peer(s): ok, %.2f us per round\n",
      comm.rank(), iters, mapped - 1, ms * 1000.0 / iters);
  MK_CHECK(comm.heap().free(flags));
  MK_CHECK(comm.heap().free(buf));
  return OkStatus();
}

int run_rank(std::unique_ptr<Bootstrap> bs, int64_t timeout_ms, bool* skipped_gpu) {
  const int R = bs->rank(), W = bs->size();
  double us = 0;
  Status s = check_bootstrap(*bs, &us);
  if (!s.ok()) {
    SAY("rank %d: bootstrap (%s): FAILED: %s\n", R, bs->kind(), s.to_string().c_str());
    return 1;
  }
  if (R == 0)
    SAY("bootstrap (%s, %d ranks): allgather, broadcast, barrier: ok; barrier %.1f us (median)\n",
        bs->kind(), W, us);
  std::unique_ptr<Communicator> comm;
  s = Communicator::create(std::move(bs), CommConfig{}, &comm);
  if (!s.ok()) {
    SAY("rank %d: communicator: FAILED: %s\n", R, s.to_string().c_str());
    return 1;
  }
  SAY("%s\n", comm->topology().describe().c_str());
  if (!comm->has_gpu()) {
    *skipped_gpu = true;
    if (R == 0) SAY("no GPU on this machine: symmetric memory and signal checks NOT run\n");
    return comm->destroy().ok() ? 0 : 1;
  }
  s = check_gpu(*comm, timeout_ms);
  if (!s.ok()) {
    SAY("rank %d: GPU checks: FAILED: %s\n", R, s.to_string().c_str());
    // The failure was agreed: every rank tears down here, together.
    Status d = comm->destroy();
    if (!d.ok()) SAY("rank %d: teardown: FAILED: %s\n", R, d.to_string().c_str());
    return 1;
  }
  s = comm->destroy();
  if (!s.ok()) {
    SAY("rank %d: teardown: FAILED: %s\n", R, s.to_string().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int selfcheck(const std::vector<std::string>& args) {
  int ranks = 0;
  int64_t timeout_ms = 5000;
  // Arguments first, before any collective or GPU work (every rank gets the same argv).
  ArgReader ar(args);
  bool ok = true;
  while (ok && !ar.done()) {
    const std::string a = ar.next();
    if (a == "--ranks") ok = ar.int_value(1, 1024, &ranks);
    else if (a == "--timeout-ms") ok = ar.int_value(int64_t(1), int64_t(24) * 3600 * 1000, &timeout_ms);
    else ok = ar.fail("unknown option '" + a + "'");
  }
  if (!ok) {
    if (launch_rank() <= 0) fprintf(stderr, "mkernel selfcheck: %s\n", ar.error().c_str());
    return 2;
  }
  bool skipped = false;
  if (launched_by_mpi() && have_mpi()) {
    std::unique_ptr<Bootstrap> bs;
    Status s = make_mpi_world_bootstrap(&bs);
    if (!s.ok()) {
      fprintf(stderr, "selfcheck: %s\n", s.to_string().c_str());
      return 1;
    }
    int rc = run_rank(std::move(bs), timeout_ms, &skipped);
    if (rc == 0) SAY("selfcheck: rank passed%s\n", skipped ? " (CPU checks only)" : "");
    return rc;
  }
  int ngpu = 0;
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess) {
    cudaGetLastError();
    ngpu = 0;
  }
  if (ranks <= 0) ranks = std::max(2, ngpu);
  std::vector<std::unique_ptr<Bootstrap>> world;
  Status s = make_thread_world(ranks, &world);
  if (!s.ok()) {
    fprintf(stderr, "selfcheck: %s\n", s.to_string().c_str());
    return 1;
  }
  std::vector<int> rc(ranks, 0);
  std::vector<std::thread> th;
  std::vector<char> sk(ranks, 0);
  for (int r = 0; r < ranks; ++r)
    th.emplace_back([&, r] {
      bool k = false;
      rc[r] = run_rank(std::move(world[r]), timeout_ms, &k);
      sk[r] = k;
    });
  for (auto& t : th) t.join();
  int bad = 0;
  for (int r = 0; r < ranks; ++r) bad += rc[r] != 0;
  skipped = sk[0];
  if (bad) {
    printf("selfcheck: FAILED on %d of %d ranks\n", bad, ranks);
    return 1;
  }
  printf("selfcheck: passed (%d ranks as threads in one process%s)\n", ranks,
         skipped ? "; CPU checks only: no GPU" : "");
  return 0;
}

}  // namespace cli
}  // namespace mk
