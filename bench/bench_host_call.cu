// bench_host_call: the host time of one fused-operator call, from run() to its return (the
// enqueue path: checks, argument binding, the launch), median over many calls after warm-up.
// The device work is synchronized outside the timed region. Ranks as MPI processes (under MPS
// on one GPU), or one rank without MPI.
//   mpirun -np 2 bench_host_call [ag_gemm|gemm_rs|gemm_ar] [M N K] [calls]
// Prints one JSON line per operator from rank 0:
//   {"op": "gemm_rs", "world": 2, "calls": 500, "host_us_median": ..., "host_us_p10": ..., "host_us_p90": ...}
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mkernel/mkernel.h"
#include "mkernel/ops/fused.h"

using namespace mk;

namespace {

int fail(const char* what, const Status& s) {
  fprintf(stderr, "bench_host_call: %s: %s\n", what, s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "gemm_rs";
  const int64_t M = argc > 4 ? atoll(argv[2]) : 2048, N = argc > 4 ? atoll(argv[3]) : 1024,
                K = argc > 4 ? atoll(argv[4]) : 1024;
  const int calls = argc > 5 ? atoi(argv[5]) : 500;
  ops::FusedKind kind = ops::FusedKind::kGemmRs;
  if (which == "ag_gemm") kind = ops::FusedKind::kAgGemm;
  else if (which == "gemm_ar") kind = ops::FusedKind::kGemmAr;
  else if (which != "gemm_rs") return fprintf(stderr, "bench_host_call: unknown operator %s\n", which.c_str()), 2;

  std::unique_ptr<Bootstrap> bs;
  Status s;
  if (getenv("OMPI_COMM_WORLD_SIZE")) {
    s = make_mpi_world_bootstrap(&bs);
  } else {
    std::vector<std::unique_ptr<Bootstrap>> w;
    s = make_thread_world(1, &w);
    if (s.ok()) bs = std::move(w[0]);
  }
  if (!s.ok()) return fail("bootstrap", s);
  std::unique_ptr<Communicator> comm;
  CommConfig cfg;
  cfg.require_gpu = true;
  s = Communicator::create(std::move(bs), cfg, &comm);
  if (!s.ok()) return fail("communicator", s);
  const int W = comm->world();
  std::unique_ptr<ops::FusedGemm> op;
  s = ops::FusedGemm::create(comm.get(), kind, ops::PlanShape{M, N, K}, ops::FusedOptions{}, &op);
  if (!s.ok()) return fail("create", s);
  const int64_t a_rows = kind == ops::FusedKind::kAgGemm ? M / W : M;
  const int64_t c_rows = kind == ops::FusedKind::kGemmRs ? M / W : M;
  void *A = nullptr, *B = nullptr, *C = nullptr;
  if (cudaMalloc(&A, size_t(a_rows) * K * 2) || cudaMalloc(&B, size_t(N) * K * 2) ||
      cudaMalloc(&C, size_t(c_rows) * N * 2))
    return fprintf(stderr, "bench_host_call: cudaMalloc failed\n"), 1;
  cudaMemset(A, 0, size_t(a_rows) * K * 2);
  cudaMemset(B, 0, size_t(N) * K * 2);
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  ops::FusedArgs args;
  args.A = A, args.B = B, args.C = C;
  std::vector<double> us;
  for (int i = 0; i < calls + 20; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    s = op->run(args, st);
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) return fail("run", s);
    if (cudaStreamSynchronize(st) != cudaSuccess) return fprintf(stderr, "bench_host_call: sync failed\n"), 1;
    if (i >= 20) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  if (comm->rank() == 0)
    printf("{\"op\": \"%s\", \"world\": %d, \"M\": %lld, \"N\": %lld, \"K\": %lld, \"calls\": %d, "
           "\"host_us_median\": %.2f, \"host_us_p10\": %.2f, \"host_us_p90\": %.2f}\n",
           which.c_str(), W, (long long)M, (long long)N, (long long)K, calls, us[us.size() / 2], us[us.size() / 10],
           us[us.size() * 9 / 10]);
  op.reset();
  cudaFree(A), cudaFree(B), cudaFree(C);
  s = comm->destroy();
  return s.ok() ? 0 : fail("destroy", s);
}
