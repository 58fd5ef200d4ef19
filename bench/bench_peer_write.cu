// bench_peer_write: how fast a rank writes into its own memory and into a node peer's, with every
// rank writing at once — the traffic of the fused reductions' epilogues (fp32 partials stored or
// reduce-added into another rank's buffer), without the GEMM. Separates what sharing a GPU costs
// (ranks as MPI processes under MPS, peers' buffers mapped through IPC) from what the library
// adds: the same with ranks as threads of one process (--threads W: one context, no MPS).
//   mpirun -np W bench_peer_write [MiB per rank] [reps]        (under MPS on one GPU)
//   bench_peer_write --threads W [MiB per rank] [reps]
// Each rank's kernel gets SMs / W CTAs of 256 threads (MPS at 100/W % gives each process that
// share). Modes: store (16-byte stores), red (system-scope red.add.v2.f32, as the library's `red`
// route), each into the own buffer and into the next rank's. Rank 0 prints one JSON line per
// mode: the median over reps of the slowest rank's time, and GB/s per rank and for the GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/cuda_check.h"
#include "mkernel/mkernel.h"

using namespace mk;

namespace {

__global__ void store_kernel(uint4* dst, size_t n, uint32_t tag) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = make_uint4(tag, uint32_t(i), tag ^ 0x5a5a5a5au, uint32_t(i >> 32));
}
__global__ void red_kernel(float* dst, size_t n2) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n2; i += size_t(gridDim.x) * blockDim.x)
    asm volatile("red.relaxed.sys.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst + 2 * i), "f"(1.f), "f"(2.f)
                 : "memory");
}

struct Result {
  std::string mode;
  double ms = 0;
};

// One rank: every mode, timed with the ranks started together per rep (a barrier per rep).
Status run_rank(Communicator* comm, size_t bytes, int reps, int ctas, std::vector<Result>* out) {
  const int W = comm->world(), me = comm->rank(), next = (me + 1) % W;
  SymmetricBuffer* buf = nullptr;
  MK_CHECK(comm->heap().alloc(bytes, &buf));
  void* local = buf->local();
  void* peer = buf->peer(next);
  MK_REQUIRE(peer, Code::kNotSupported, "bench_peer_write: rank %d is not mapped (another node?)", next);
  cudaStream_t st = comm->stream();
  cudaEvent_t e0, e1;
  MK_CUDA_CHECK(cudaEventCreate(&e0));
  MK_CUDA_CHECK(cudaEventCreate(&e1));
  struct Mode {
    const char* name;
    bool red;
    void* dst;
  };
  const Mode modes[] = {{"store_local", false, local}, {"store_peer", false, peer}, {"red_local", true, local},
                        {"red_peer", true, peer}};
  Status s;
  for (const Mode& m : modes) {
    std::vector<double> ms;
    for (int r = -2; r < reps && s.ok(); ++r) {  // two warm-up reps
      s = comm->bootstrap().barrier();
      if (!s.ok()) break;
      cudaEventRecord(e0, st);
      if (m.red) red_kernel<<<ctas, 256, 0, st>>>(static_cast<float*>(m.dst), bytes / 8);
      else store_kernel<<<ctas, 256, 0, st>>>(static_cast<uint4*>(m.dst), bytes / 16, uint32_t(me));
      cudaEventRecord(e1, st);
      s = comm->sync(st);
      float t = 0;
      if (s.ok() && cudaEventElapsedTime(&t, e0, e1) != cudaSuccess) s = Status(Code::kCudaError, "event");
      if (r >= 0) ms.push_back(t);
    }
    if (!s.ok()) break;
    // The slowest rank's time per rep.
    std::vector<double> all(ms.size() * W);
    s = comm->bootstrap().allgather(ms.data(), all.data(), sizeof(double) * ms.size());
    if (!s.ok()) break;
    for (size_t i = 0; i < ms.size(); ++i)
      for (int r = 0; r < W; ++r) ms[i] = std::max(ms[i], all[r * ms.size() + i]);
    std::sort(ms.begin(), ms.end());
    out->push_back({m.name, ms[ms.size() / 2]});
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const Status f = comm->heap().free(buf);
  return s.ok() ? f : s;
}

void print(const char* how, int W, int ctas, size_t bytes, const std::vector<Result>& res) {
  for (const Result& r : res)
    printf("{\"ranks\": \"%s\", \"world\": %d, \"ctas_per_rank\": %d, \"mib_per_rank\": %zu, \"mode\": \"%s\", "
           "\"ms\": %.4f, \"gbs_per_rank\": %.1f, \"gbs_gpu\": %.1f}\n",
           how, W, ctas, bytes >> 20, r.mode.c_str(), r.ms, bytes / (r.ms * 1e6), W * bytes / (r.ms * 1e6));
}

int fail(const char* what, const Status& s) {
  fprintf(stderr, "bench_peer_write: %s: %s\n", what, s.to_string().c_str());
  return 1;
}

int sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0, a = 1;
  if (argc > 2 && std::string(argv[1]) == "--threads") {
    threads = atoi(argv[2]);
    a = 3;
    if (threads < 2) return fprintf(stderr, "bench_peer_write: --threads needs W >= 2\n"), 2;
  }
  const size_t mib = argc > a ? size_t(atoll(argv[a])) : 64;
  const int reps = argc > a + 1 ? atoi(argv[a + 1]) : 20;
  if (mib < 1 || reps < 1) return fprintf(stderr, "bench_peer_write: MiB and reps must be >= 1\n"), 2;
  const size_t bytes = mib << 20;
  CommConfig cfg;
  cfg.require_gpu = true;
  if (threads == 0) {
    std::unique_ptr<Bootstrap> bs;
    Status s = make_mpi_world_bootstrap(&bs);
    if (!s.ok()) return fail("bootstrap (run under mpirun, or with --threads W)", s);
    std::unique_ptr<Communicator> comm;
    s = Communicator::create(std::move(bs), cfg, &comm);
    if (!s.ok()) return fail("communicator", s);
    // Under MPS the device reports the process's share of SMs: keep it whole (one CTA per SM).
    const int ctas = sms();
    std::vector<Result> res;
    s = run_rank(comm.get(), bytes, reps, ctas, &res);
    if (!s.ok()) return fail("run", s);
    if (comm->rank() == 0) print("processes", comm->world(), ctas, bytes, res);
    return comm->destroy().ok() ? 0 : 1;
  }
  std::vector<std::unique_ptr<Bootstrap>> world;
  Status s = make_thread_world(threads, &world);
  if (!s.ok()) return fail("thread bootstrap", s);
  const int ctas = std::max(1, sms() / threads);  // one context: each rank gets its share by grid size
  std::vector<Status> st(threads);
  std::vector<std::vector<Result>> res(threads);
  std::vector<std::thread> th;
  for (int r = 0; r < threads; ++r)
    th.emplace_back([&, r] {
      std::unique_ptr<Communicator> comm;
      st[r] = Communicator::create(std::move(world[r]), cfg, &comm);
      if (st[r].ok()) st[r] = run_rank(comm.get(), bytes, reps, ctas, &res[r]);
      if (comm) {
        const Status d = comm->destroy();
        if (st[r].ok()) st[r] = d;
      }
    });
  for (auto& t : th) t.join();
  for (int r = 0; r < threads; ++r)
    if (!st[r].ok()) return fail(("rank " + std::to_string(r)).c_str(), st[r]);
  print("threads", threads, ctas, bytes, res[0]);
  return 0;
}
