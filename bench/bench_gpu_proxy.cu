// bench_gpu_proxy: GPU-initiated networking through the proxy, next to the host's own limits.
// Run under mpirun -np 2 with every rank on its own (emulated) node, e.g. on one GPU under MPS:
//   MK_RANKS_PER_NODE=1 MK_NET_PROVIDER=shm MK_NET_STAGING=always
//     mpirun -np 2 build/bench/bench_gpu_proxy [--json FILE]   (one command line)
// Measures, in one run:
//   host limits   GPU -> pinned host word -> CPU thread -> pinned word -> GPU round trip;
//                 pinned copy rate host->device and device->host (256 MiB)
//   provider      raw backend bandwidth, host memory to host memory (4 MiB puts)
//   latency       a kernel's put (8 B, 64 KiB) until the flag is visible to the remote kernel
//                 (half of a kernel-to-kernel ping-pong through both proxies)
//   bandwidth     sustained GPU-pushed puts of 64 KiB - 4 MiB (256 MiB per size)
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/command_ring.cuh"
#include "mkernel/mkernel.h"
#include "mkernel/proxy/proxy.h"
#include "mkernel/runtime/bootstrap_mpi.h"

namespace mk {
namespace {

// ---- host limits ---------------------------------------------------------------------------
__global__ void pinned_pingpong(volatile uint64_t* to_cpu, volatile uint64_t* from_cpu, int n,
                                unsigned long long* ns) {
  uint64_t t0 = device::global_timer_ns();
  for (int i = 1; i <= n; ++i) {
    *to_cpu = i;
    __threadfence_system();
    while (*from_cpu < uint64_t(i)) {
    }
  }
  *ns = device::global_timer_ns() - t0;
}

Status host_limits(double* rtt_us, double* h2d_gbs, double* d2h_gbs) {
  uint64_t *to_cpu, *from_cpu;
  MK_CUDA_CHECK(cudaHostAlloc(&to_cpu, 64, cudaHostAllocMapped));
  MK_CUDA_CHECK(cudaHostAlloc(&from_cpu, 64, cudaHostAllocMapped));
  *to_cpu = *from_cpu = 0;
  unsigned long long* ns;
  MK_CUDA_CHECK(cudaMalloc(&ns, sizeof(*ns)));
  const int n = 2000;
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    uint64_t seen = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      uint64_t v = __atomic_load_n(to_cpu, __ATOMIC_ACQUIRE);
      if (v != seen) {
        seen = v;
        __atomic_store_n(from_cpu, v, __ATOMIC_RELEASE);
      }
    }
  });
  pinned_pingpong<<<1, 1>>>(to_cpu, from_cpu, n, ns);
  cudaError_t e = cudaDeviceSynchronize();
  stop = true;
  echo.join();
  MK_CUDA_CHECK(e);
  unsigned long long t = 0;
  MK_CUDA_CHECK(cudaMemcpy(&t, ns, sizeof(t), cudaMemcpyDeviceToHost));
  *rtt_us = t / 1e3 / n;
  cudaFree(ns);
  cudaFreeHost(to_cpu);
  cudaFreeHost(from_cpu);

  const size_t bytes = 256u << 20;
  void *h, *d;
  MK_CUDA_CHECK(cudaHostAlloc(&h, bytes, 0));
  MK_CUDA_CHECK(cudaMalloc(&d, bytes));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int dir = 0; dir < 2; ++dir) {
    std::vector<float> ms;
    for (int r = 0; r < 6; ++r) {
      cudaEventRecord(a);
      if (dir == 0) cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice);
      else cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost);
      cudaEventRecord(b);
      MK_CUDA_CHECK(cudaEventSynchronize(b));
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      if (r > 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    (dir == 0 ? *h2d_gbs : *d2h_gbs) = bytes / (ms[ms.size() / 2] * 1e-3) / 1e9;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFreeHost(h);
  cudaFree(d);
  return OkStatus();
}

// ---- raw provider bandwidth (before the proxy owns the backend) -----------------------------
Status provider_bandwidth(net::Backend* be, int me, double* gbs) {
  const uint64_t msg = 4u << 20, total = 512u << 20, bytes = 64u << 20;
  std::vector<uint8_t> src(bytes, uint8_t(me + 1)), dst(bytes, 0);
  net::WindowId s, d;
  MK_CHECK(be->register_window(src.data(), bytes, net::MemKind::kHost, &s));
  MK_CHECK(be->register_window(dst.data(), bytes, net::MemKind::kHost, &d));
  const uint64_t n = total / msg;
  std::vector<net::LocalDone> done;
  std::vector<net::Arrival> arr;
  MPI_Barrier(MPI_COMM_WORLD);
  auto t0 = std::chrono::steady_clock::now();
  if (me == 0) {
    uint64_t posted = 0, completed = 0;
    while (completed < n) {
      bool ok = false;
      if (posted < n && posted - completed < 16) {
        MK_CHECK(be->put(1, s, (posted * msg) % bytes, d, (posted * msg) % bytes, msg, 1, posted, &ok));
        posted += ok;
      }
      done.clear();
      arr.clear();
      MK_CHECK(be->progress(&done, &arr));
      completed += done.size();
    }
  } else if (me == 1) {
    uint64_t got = 0;
    while (got < n) {
      done.clear();
      arr.clear();
      MK_CHECK(be->progress(&done, &arr));
      got += arr.size();
    }
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double mine = (me == 1) ? total / secs / 1e9 : 0;
  MPI_Allreduce(&mine, gbs, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MK_CHECK(be->deregister_window(d));
  MK_CHECK(be->deregister_window(s));
  return OkStatus();
}

// ---- GPU-pushed puts -------------------------------------------------------------------------
// Ping-pong: the initiator pushes, waits for the echo; the other side waits, pushes back.
__global__ void gpu_pingpong(RingView ring, WaitCtx ctx, SignalView flags, int peer, bool initiator,
                             uint32_t src_win, uint32_t dst_win, uint64_t bytes, int n, uint64_t base,
                             unsigned long long* ns) {
  uint64_t t0 = device::global_timer_ns();
  for (int i = 1; i <= n; ++i) {
    if (!initiator) device::wait_ge(ctx, &flags.local[0], base + i, peer, 0);
    device::ring_push(ring, ctx, make_put(peer, src_win, 0, dst_win, 0, bytes, 0));
    if (initiator) device::wait_ge(ctx, &flags.local[0], base + i, peer, 0);
  }
  if (ns) *ns = device::global_timer_ns() - t0;
}

__global__ void gpu_stream(RingView ring, WaitCtx ctx, int peer, uint32_t src_win, uint32_t dst_win,
                           uint64_t bytes, uint64_t window, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const uint64_t off = (uint64_t(i) * bytes) % window;
    device::ring_push(ring, ctx, make_put(peer, src_win, off, dst_win, off, bytes, 1));
  }
}

__global__ void gpu_wait(SignalView flags, WaitCtx ctx, int peer, uint64_t target) {
  device::wait_ge(ctx, &flags.local[1], target, peer, 1);
}

struct Row {
  std::string what;
  double value;
  const char* unit;
};

int run(int argc, char** argv) {
  std::string json;
  for (int i = 1; i < argc; ++i)
    if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  std::unique_ptr<Bootstrap> bs;
  Status s = make_mpi_bootstrap(MPI_COMM_WORLD, &bs);
  std::unique_ptr<Communicator> comm;
  CommConfig cfg;
  cfg.require_gpu = true;
  if (s.ok()) s = Communicator::create(std::move(bs), cfg, &comm);
  if (!s.ok() || comm->world() != 2) {
    fprintf(stderr, "bench_gpu_proxy: %s\n", s.ok() ? "needs exactly 2 ranks" : s.to_string().c_str());
    return 1;
  }
  const int me = comm->rank(), peer = 1 - me;
  if (comm->topology().same_node(peer)) {
    fprintf(stderr, "bench_gpu_proxy: run with MK_RANKS_PER_NODE=1 (the peer must be another node)\n");
    return 1;
  }
  std::vector<Row> rows;
  auto check = [&](const Status& st, const char* what) {
    if (!st.ok()) {
      fprintf(stderr, "rank %d: %s: %s\n", me, what, st.to_string().c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  };
  // Host limits, measured by rank 0 while rank 1 waits.
  double rtt = 0, h2d = 0, d2h = 0;
  if (me == 0) check(host_limits(&rtt, &h2d, &d2h), "host limits");
  MPI_Barrier(MPI_COMM_WORLD);

  std::unique_ptr<net::Backend> be;
  check(net::create_backend(comm->bootstrap(), comm->topology(), net::BackendConfig{}, &be), "backend");
  double prov = 0;
  check(provider_bandwidth(be.get(), me, &prov), "provider bandwidth");

  std::unique_ptr<ProxyWindows> wins;
  check(ProxyWindows::create(&comm->bootstrap(), be.get(), "", StagingConfig{}, &wins), "windows");
  const uint64_t window = 64u << 20;
  void *src, *dst;
  cudaMalloc(&src, window);
  cudaMalloc(&dst, window);
  cudaMemset(src, me + 1, window);
  uint32_t sw, dw;
  check(wins->add(src, window, net::MemKind::kCuda, &sw), "window");
  check(wins->add(dst, window, net::MemKind::kCuda, &dw), "window");
  SymmetricBuffer* flags;
  check(comm->alloc_signals(4, &flags), "flags");
  CudaFlagSink sink(static_cast<uint64_t*>(flags->local()), 4);
  std::unique_ptr<Proxy> proxy;
  ProxyConfig pc;
  pc.gpu_ring = true;
  pc.near_gpu = comm->device();
  check(Proxy::create(wins.get(), &sink, pc, &proxy), "proxy");
  proxy->on_error([c = comm.get()](const Status& e) { c->abort(e); });
  check(proxy->start(), "proxy start");
  const WaitCtx ctx = comm->wait_ctx(OpTag::kSelfCheck, Role::kNetSend, 30000);
  const RingView ring = proxy->ring().view(ctx.abort);
  unsigned long long* ns;
  cudaMalloc(&ns, sizeof(*ns));
  uint64_t base = 0;  // flag 0 count so far

  for (uint64_t bytes : {uint64_t(8), uint64_t(64) << 10}) {
    const int warm = 50, n = 500;
    for (int pass = 0; pass < 2; ++pass) {
      const int k = pass == 0 ? warm : n;
      check(comm->bootstrap().barrier(), "barrier");
      gpu_pingpong<<<1, 1, 0, comm->stream()>>>(ring, ctx, flags->signal_view(), peer, me == 0, sw, dw,
                                                bytes, k, base, ns);
      check(comm->sync(comm->stream()), "ping-pong");
      base += k;
    }
    unsigned long long t = 0;
    cudaMemcpy(&t, ns, sizeof(t), cudaMemcpyDeviceToHost);
    if (me == 0)
      rows.push_back({"latency, GPU push to remote flag, " + std::to_string(bytes) + " B", t / 1e3 / n / 2, "us"});
  }
  uint64_t streamed = 0;  // flag 1 count so far
  for (uint64_t bytes : {uint64_t(64) << 10, uint64_t(256) << 10, uint64_t(1) << 20, uint64_t(4) << 20}) {
    const int n = static_cast<int>((256ull << 20) / bytes);
    check(comm->bootstrap().barrier(), "barrier");
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, comm->stream());
    if (me == 0) gpu_stream<<<1, 128, 0, comm->stream()>>>(ring, ctx, peer, sw, dw, bytes, window, n);
    else gpu_wait<<<1, 1, 0, comm->stream()>>>(flags->signal_view(), ctx, peer, streamed + n);
    cudaEventRecord(b, comm->stream());
    check(comm->sync(comm->stream()), "stream");
    streamed += me == 1 ? n : 0;
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    double gbs = me == 1 ? (double(n) * bytes) / (ms * 1e-3) / 1e9 : 0, all = 0;
    MPI_Allreduce(&gbs, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    rows.push_back({"bandwidth, GPU-pushed puts of " + std::to_string(bytes >> 10) + " KiB", all, "GB/s"});
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  check(proxy->flush(), "flush");
  check(comm->bootstrap().barrier(), "barrier");
  check(proxy->stop(), "stop");
  check(wins->destroy(), "windows");
  check(be->finalize(), "finalize");
  cudaFree(src);
  cudaFree(dst);
  cudaFree(ns);

  if (me == 0) {
    rows.insert(rows.begin(), {"provider bandwidth, host to host, 4 MiB puts", prov, "GB/s"});
    rows.insert(rows.begin(), {"host: pinned copy device->host, 256 MiB", d2h, "GB/s"});
    rows.insert(rows.begin(), {"host: pinned copy host->device, 256 MiB", h2d, "GB/s"});
    rows.insert(rows.begin(), {"host: GPU->pinned word->CPU->pinned word->GPU round trip", rtt, "us"});
    const double limit = std::min({h2d, d2h, prov});
    printf("\nbench_gpu_proxy: %s%s, 2 ranks on separate (emulated) nodes\n", be->name(),
           wins->staging() ? ", staged through pinned host buffers" : "");
    for (const Row& r : rows) printf("  %-62s %10.2f %s\n", r.what.c_str(), r.value, r.unit);
    double best = 0;
    for (const Row& r : rows)
      if (r.what.rfind("bandwidth, GPU", 0) == 0) best = std::max(best, r.value);
    printf("  best GPU-pushed bandwidth / min(pinned copy, provider) = %.2f / %.2f = %.0f%% (target >= 50%%)\n",
           best, limit, 100 * best / limit);
    if (!json.empty()) {
      FILE* f = fopen(json.c_str(), "w");
      if (f) {
        fprintf(f, "{\"backend\": \"%s\", \"staged\": %s, \"rows\": [\n", be->name(), wins->staging() ? "true" : "false");
        for (size_t i = 0; i < rows.size(); ++i)
          fprintf(f, "  {\"what\": \"%s\", \"value\": %.4f, \"unit\": \"%s\"}%s\n", rows[i].what.c_str(),
                  rows[i].value, rows[i].unit, i + 1 < rows.size() ? "," : "");
        fprintf(f, "]}\n");
        fclose(f);
      }
    }
  }
  (void)comm->destroy();
  return 0;
}

}  // namespace
}  // namespace mk

int main(int argc, char** argv) {
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rc = mk::run(argc, argv);
  MPI_Finalize();
  return rc;
}
