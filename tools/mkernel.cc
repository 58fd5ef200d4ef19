// mkernel — command line entry: `mkernel doctor`, `mkernel selfcheck`, `mkernel bench`.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mkernel/mkernel.h"
#include "tools/cli.h"

namespace {
void usage() {
  printf(
      "usage: mkernel <command> [options]\n"
      "  doctor               GPUs, driver/CUDA versions, peer access and NVLink, MPS,\n"
      "                       libfabric providers, and every tunable with its source\n"
      "  selfcheck [--ranks N] [--timeout-ms T]\n"
      "                       bootstrap, topology, symmetric memory and signals on the local\n"
      "                       GPUs; under mpirun one rank per process, else N threads\n"
      "  bench <op|all> [--m M --n N --k K] [--reps R] [--json FILE]\n"
      "                       fused ag_gemm / gemm_rs / gemm_ar against cuBLAS + NCCL on the\n"
      "                       local GPUs (under mpirun one rank per process): correctness, ms,\n"
      "                       TFLOP/s, speedups, overlap efficiency\n"
      "  bench ring_attention [--seq S_per_rank]... [--non-causal] [--reps R] [--json FILE] [--trace PREFIX]\n"
      "                       ring attention (B1 H32 D128, zigzag) against NCCL all-gather +\n"
      "                       attention and a per-step NCCL send/recv ring\n"
      "  version              print the version\n"
      "Tunables: see `mkernel doctor`; set MK_<NAME> in the environment.\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage();
    return 2;
  }
  std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (cmd == "doctor") return mk::cli::doctor(args);
  if (cmd == "selfcheck") {
    // Ranks as threads share one CUDA context and wait on each other's kernels: give every
    // stream its own hardware queue (read when CUDA creates the context). Not for one rank
    // per process: under MPS each client's queues come from one pool, and 4 clients with 32
    // each exhausted it (context creation failed with out-of-memory on an H200).
    if (!mk::launched_by_mpi()) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
    return mk::cli::selfcheck(args);
  }
  if (cmd == "bench") return mk::cli::bench(args);
  if (cmd == "version" || cmd == "--version") {
    printf("mkernel %s\n", mk::version());
    return 0;
  }
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    usage();
    return 0;
  }
  fprintf(stderr, "mkernel: unknown command '%s'\n", cmd.c_str());
  usage();
  return 2;
}
