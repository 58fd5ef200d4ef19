// mkernel — command line entry: `mkernel doctor`, `mkernel selfcheck`, `mkernel bench`.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mkernel/mkernel.h"
#include "tools/cli.h"

namespace mk {
namespace cli {

std::string ArgReader::next() {
  const std::string& a = args_[i_++];
  has_inline_ = false;
  inline_.clear();
  opt_ = a;
  const size_t eq = a.find('=');
  if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
    opt_ = a.substr(0, eq);
    inline_ = a.substr(eq + 1);
    has_inline_ = true;
  }
  return opt_;
}

bool ArgReader::fail(const std::string& msg) {
  if (err_.empty()) err_ = msg;
  return false;
}

bool ArgReader::value(std::string* v) {
  if (has_inline_) {
    has_inline_ = false;
    if (inline_.empty()) return fail(opt_ + ": missing value (" + opt_ + "= is empty)");
    *v = inline_;
    return true;
  }
  if (done()) return fail(opt_ + ": missing value at the end of the line");
  const std::string& a = args_[i_];
  if (a.empty()) return fail(opt_ + ": missing value (empty argument)");
  if (a.rfind("--", 0) == 0) return fail(opt_ + ": missing value (next is the option '" + a + "')");
  *v = a;
  ++i_;
  return true;
}

bool ArgReader::int_value(int64_t lo, int64_t hi, int64_t* out) {
  std::string v;
  if (!value(&v)) return false;
  const std::string range = "(" + std::to_string(lo) + ".." + std::to_string(hi) + ")";
  const char* s = v.c_str();
  // strtoll accepts leading blanks and a '+'; an option value is digits with an optional '-'.
  const char* d = s[0] == '-' ? s + 1 : s;
  if (*d < '0' || *d > '9') return fail(opt_ + " '" + v + "': not an integer");
  errno = 0;
  char* end = nullptr;
  const long long x = strtoll(s, &end, 10);
  if (*end != '\0') return fail(opt_ + " '" + v + "': not an integer (trailing '" + std::string(end) + "')");
  if (errno == ERANGE) return fail(opt_ + " '" + v + "': out of range " + range);
  if (x < 0 && lo >= 0) return fail(opt_ + " '" + v + "': must not be negative " + range);
  if (x == 0 && lo > 0) return fail(opt_ + " '" + v + "': must be at least " + std::to_string(lo) + " " + range);
  if (x < lo || x > hi) return fail(opt_ + " '" + v + "': out of range " + range);
  *out = x;
  return true;
}

bool ArgReader::int_value(int lo, int hi, int* out) {
  int64_t x = 0;
  if (!int_value(int64_t(lo), int64_t(hi), &x)) return false;
  *out = int(x);
  return true;
}

bool ArgReader::no_value() {
  if (!has_inline_) return true;
  return fail(opt_ + " takes no value (got '" + opt_ + "=" + inline_ + "')");
}

int launch_rank() {
  const char* vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"};
  for (const char* v : vars)
    if (const char* s = getenv(v)) return atoi(s);
  return -1;
}

int launch_size() {
  const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"};
  for (const char* v : vars)
    if (const char* s = getenv(v)) return atoi(s);
  return -1;
}

}  // namespace cli
}  // namespace mk

namespace {
void usage() {
  printf(
      "usage: mkernel <command> [options]\n"
      "  doctor               GPUs, driver/CUDA versions, peer access and NVLink, MPS,\n"
      "                       libfabric providers, and every tunable with its source\n"
      "  selfcheck [--ranks N] [--timeout-ms T]\n"
      "                       bootstrap, topology, symmetric memory and signals on the local\n"
      "                       GPUs; under mpirun one rank per process, else N threads\n"
      "  bench <ag_gemm|gemm_rs|gemm_ar|all> [--m M] [--n N] [--k K | --sweep] [--deterministic]\n"
      "                       [--splits] [--path fused|unfused|auto] [--reps R] [--warmup U]\n"
      "                       [--json FILE] [--trace PREFIX]\n"
      "                       fused ag_gemm / gemm_rs / gemm_ar against cuBLAS + NCCL on the\n"
      "                       local GPUs (under mpirun one rank per process): a bit-exact check\n"
      "                       (\"check: ... ok\"), ms, TFLOP/s, fused / compute-alone (f/c),\n"
      "                       speedups and, where ranks communicate (W > 1), the overlap\n"
      "                       efficiency. Without --m/--n/--k two default shapes; --sweep: the\n"
      "                       Llama-3-70B TP8 shapes; a dimension left out is 4096. --trace: one\n"
      "                       traced call per shape and rank (JSON) and rank 0's breakdown.\n"
      "                       --splits (W > 1): the fused call with 1, 2, 4, 8, 16, 24 and 32\n"
      "                       communication CTAs and with the SM-partition controller\n"
      "                       (MK_FUSED_SPLIT=auto), ctl/best and ctl/default. --path: the\n"
      "                       operators on that path; unfused/auto (W > 1) also time the\n"
      "                       collective alone, auto the forced paths in the same run.\n"
      "                       --rows R0,R1,...: each rank's shard rows (uneven shards; M their sum);\n"
      "                       an M the ranks do not divide is split as evenly as it allows; uneven\n"
      "                       runs also time the operator padded to even shards\n"
      "  bench ring_attention [--seq S_per_rank]... [--rows R0,R1,...] [--non-causal]\n"
      "                       [--doc-len L [--balanced]] [--reps R] [--warmup U] [--json FILE] [--trace PREFIX]\n"
      "                       ring attention (B1 H32 D128, zigzag) against NCCL all-gather +\n"
      "                       attention and a per-step NCCL send/recv ring; --doc-len: the\n"
      "                       sequence packed with documents of L tokens (cu_seqlens); --rows:\n"
      "                       uneven shards (each rank's tokens), then the same sequence padded\n"
      "                       to even shards, and uneven / padded; --balanced: contiguous shards\n"
      "                       balancing the documents' work, then even zigzag ones, and their ratio\n"
      "  bench moe_dispatch [--preset deepep_ht|deepep_ll|qwen3|mixtral]... [--tokens T_per_rank]\n"
      "                       [--reps R] [--warmup U] [--json FILE]\n"
      "                       MoE dispatch and combine (exact checks) against a device copy of\n"
      "                       the same bytes and NCCL all-to-all-v + permute (one GPU per rank)\n"
      "  bench moe_layer [--preset qwen3_30b|qwen3_235b|mixtral|deepseek_v3]... [--tokens T_per_rank]\n"
      "                       [--reps R] [--warmup U] [--json FILE]\n"
      "                       the MoE layer (dispatch, expert MLPs, combine) against the same\n"
      "                       layer from separate launches with cuBLAS's grouped GEMM\n"
      "  bench allgather|reduce_scatter|allreduce [--count N]... [--dtype bf16|fp32] [--chunk E]\n"
      "                       [--ctas C] [--reps R] [--warmup U] [--json FILE]\n"
      "                       the standalone collectives (bit-exact check of the plain and the\n"
      "                       zero-copy path) against NCCL's and a device copy of the bus bytes:\n"
      "                       us, algbw and busbw (nccl-tests' convention). --count: elements\n"
      "                       per rank as the operator counts them (default: 64 KiB .. 256 MiB)\n"
      "                       (defaults: --reps 20 --warmup 3; options also as --name=value)\n"
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
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    }
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
    if (!args.empty()) {
      fprintf(stderr, "mkernel version: unexpected argument '%s' (usage: mkernel version)\n", args[0].c_str());
      return 2;
    }
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
