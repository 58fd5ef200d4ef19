// `mkernel bench allgather|reduce_scatter|allreduce`: the standalone collectives
// (include/mkernel/ops/collective.h) against NCCL's collective of the same buffers and data type
// and a device copy of the bytes the collective moves per rank.
//
// Per count (elements per rank as the operator counts them: allgather and allreduce the input,
// reduce_scatter the output):
//   - inputs: element j of rank r's input is a small nonzero integer v(seed, r, j) in [-m, m],
//     m = min(8, 256 / W), from a hash, so any rank recomputes any rank's input, a wrong source
//     shows, and every partial sum of W of them is an integer of magnitude <= 256: exact in bf16
//     and fp32 in any order. The expected output is therefore one value per element, whatever
//     the summation order (the operator's fixed order, NCCL's ring or tree);
//   - check, outputs poisoned (NaN) before each call: the operator's plain path (user buffers,
//     copied in and out by the call), its zero-copy path (input written into input(), the
//     all-reduce read from output()) and, when NCCL is timed, NCCL's output — each must equal the
//     expected value bit for bit, every element;
//   - timings (median over ranks' slowest of --reps calls after --warmup, CUDA events on the
//     stream; bench_common.h's time_it): op (plain path), zc (zero-copy path), NCCL (out of
//     place, user buffers: what the plain path does) when every rank has its own GPU, and the
//     device copy.
//
// Bytes (nccl-tests' convention). size: allreduce count x e (the buffer each rank reduces),
// allgather and reduce_scatter W x count x e (the gathered output, the input to scatter), e the
// element size. algbw = size / time. Bus bytes = size x 2(W-1)/W (allreduce) or size x (W-1)/W
// (allgather, reduce_scatter): what each rank must send (and receive) at least; busbw = bus bytes
// / time (0, "-", at W = 1). The copy baseline is one cudaMemcpyAsync device to device of the
// bus bytes (rounded down to 16 B) on every rank at once, between two buffers of this rank: the
// rate at which a rank's own memory moves the bytes the collective must move, not a link's.
// Ratios (same run, same bytes): vs_nccl = nccl_us / op_us, zc_vs_nccl = nccl_us / zc_us (above
// 1: the operator is faster), vs_copy = zc busbw / copy GB/s = copy_us / zc_us (bytes equal up to
// the rounding). Times are the slowest rank's; ranks sharing a GPU (MPS) get no NCCL figures and
// their times are labelled not comparable.
//
// Part of the CLI (mkernel_cli), not of the library; the shared helpers are tools/bench_common.h.
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/mkernel.h"
#include "mkernel/ops/collective.h"
#include "tools/bench_common.h"
#if MK_HAVE_NCCL
#include "tools/baseline/baseline.h"
#endif

namespace mk {
namespace bench {
namespace {

using ops::CollDType;
using ops::Collective;
using ops::CollectiveKind;

// The default sizes (nccl-tests' "size", see above), 64 KiB .. 256 MiB.
constexpr int64_t kDefaultSizes[] = {int64_t(64) << 10, int64_t(1) << 20, int64_t(16) << 20, int64_t(64) << 20,
                                     int64_t(256) << 20};

// Element j of rank r's input: a nonzero integer in [-m, m].
__host__ __device__ inline float coll_value(uint64_t seed, int rank, int64_t j, int m) {
  const uint64_t h = mix(mix(seed ^ (uint64_t(rank) << 44) ^ 0xc011ull) ^ uint64_t(j));
  int v = int(h % uint64_t(2 * m)) - m;
  if (v >= 0) ++v;
  return float(v);
}

struct CollGeometry {
  int kind = 0;  // CollectiveKind
  int f32 = 0;   // CollDType::kF32
  int me = 0, world = 1, m = 1;
  int64_t count = 0;
};

__global__ void fill_input(void* p, int64_t n, CollGeometry g, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = coll_value(seed, g.me, i, g.m);
    if (g.f32) static_cast<float*>(p)[i] = v;
    else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
}

// Elements of this rank's output that differ, bit for bit, from the exact result.
__global__ void count_wrong(const void* got, int64_t n, CollGeometry g, uint64_t seed, unsigned long long* bad) {
  unsigned long long mine = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float want = 0.f;
    if (g.kind == int(CollectiveKind::kAllGather)) {
      want = coll_value(seed, int(i / g.count), i % g.count, g.m);
    } else {
      const int64_t j = g.kind == int(CollectiveKind::kReduceScatter) ? int64_t(g.me) * g.count + i : i;
      for (int s = 0; s < g.world; ++s) want += coll_value(seed, s, j, g.m);  // integers: exact
    }
    if (g.f32) mine += static_cast<const uint32_t*>(got)[i] != __float_as_uint(want);
    else mine += static_cast<const uint16_t*>(got)[i] != __bfloat16_as_ushort(__float2bfloat16_rn(want));
  }
  if (mine) atomicAdd(bad, mine);
}

// nccl-tests' bus factor: the share of `size` each rank must move.
double bus_factor(CollectiveKind k, int W) {
  return k == CollectiveKind::kAllReduce ? 2.0 * (W - 1) / W : double(W - 1) / W;
}

// Elements per rank (the operator's count) for a size in bytes: a multiple of 8, at least 8.
int64_t count_for_size(CollectiveKind k, int64_t size, int64_t esize, int W) {
  const int64_t per = k == CollectiveKind::kAllReduce ? size / esize : size / (esize * W);
  return std::max<int64_t>(8, per / 8 * 8);
}

struct CollRow {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  CollDType dtype = CollDType::kBF16;
  int W = 1, nodes = 1, ctas = 0;
  int64_t count = 0, chunk = 0, in_elems = 0, out_elems = 0, esize = 2;
  bool comparable = false, shared_gpu = false, checked = false, correct = false;
  unsigned long long bad = 0;
  double op_us = 0, zc_us = 0, nccl_us = 0, copy_us = 0;
  uint64_t copy_bytes = 0;
  double size() const {
    return double(kind == CollectiveKind::kAllReduce ? count : count * W) * double(esize);
  }
  double bus_bytes() const { return size() * bus_factor(kind, W); }
  double algbw(double us) const { return us > 0 ? size() / (us * 1e3) : 0; }
  double busbw(double us) const { return us > 0 ? bus_bytes() / (us * 1e3) : 0; }
  double copy_gbps() const { return copy_us > 0 ? double(copy_bytes) / (copy_us * 1e3) : 0; }
};

#if MK_HAVE_NCCL
using ops::baseline::Baselines;
Baselines::Coll nccl_coll(CollectiveKind k) {
  return k == CollectiveKind::kAllGather       ? Baselines::Coll::kAllGather
         : k == CollectiveKind::kReduceScatter ? Baselines::Coll::kReduceScatter
                                               : Baselines::Coll::kAllReduce;
}
#else
struct Baselines {};  // no NCCL: never created
#endif

Status bench_coll_body(Communicator* comm, Collective* op, const RunCfg& rc, uint64_t seed,
                       std::unique_ptr<Baselines>* bl, CollRow* r) {
  const int W = comm->world(), me = comm->rank();
  cudaStream_t st = comm->stream();
  const bool ar = r->kind == CollectiveKind::kAllReduce;
  r->in_elems = op->in_elems();
  r->out_elems = op->out_elems();
  r->ctas = op->ctas();
  const size_t ib = size_t(r->in_elems) * r->esize, ob = size_t(r->out_elems) * r->esize;
  r->copy_bytes = uint64_t(r->bus_bytes()) / 16 * 16;
  CollGeometry g;
  g.kind = int(r->kind), g.f32 = r->dtype == CollDType::kF32;
  g.me = me, g.world = W, g.m = std::max(1, std::min(8, 256 / W));
  g.count = r->count;

  Buf in, out, nccl_out, copy_src, copy_dst, bad;
  Status s = [&]() -> Status {
    MK_CHECK(CLI_CUDA(comm, in.alloc(ib)));
    MK_CHECK(CLI_CUDA(comm, out.alloc(ob)));
    if (r->comparable) MK_CHECK(CLI_CUDA(comm, nccl_out.alloc(ob)));
    if (r->copy_bytes) {
      MK_CHECK(CLI_CUDA(comm, copy_src.alloc(r->copy_bytes)));
      MK_CHECK(CLI_CUDA(comm, copy_dst.alloc(r->copy_bytes)));
      MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(copy_src.p, 0x3c, r->copy_bytes, st)));
    }
    MK_CHECK(CLI_CUDA(comm, bad.alloc(sizeof(unsigned long long))));
    fill_input<<<264, 256, 0, st>>>(in.p, r->in_elems, g, seed);
    // The zero-copy caller writes its input into the operator's workspace itself.
    fill_input<<<264, 256, 0, st>>>(op->input(), r->in_elems, g, seed);
    MK_CHECK(CLI_CUDA(comm, cudaGetLastError()));
    return synced(comm, st);
  }();
  MK_CHECK(agreed(comm, s, "preparing inputs"));
  unsigned long long* d_bad = static_cast<unsigned long long*>(bad.p);
  const ops::CollectiveArgs plain{in.p, out.p};
  const ops::CollectiveArgs zc{op->input(), ar ? op->output() : out.p};

  // One checked call: poison the output, call, synchronize and check the communicator, then
  // count the elements that differ from the exact result (summed over ranks).
  auto checked = [&](void* dst, const std::string& what, auto&& call, unsigned long long* total) -> Status {
    Status c = CLI_CUDA(comm, cudaMemsetAsync(dst, 0xff, ob, st));
    if (c.ok()) c = decoded(comm, call());
    if (c.ok()) c = synced(comm, st);
    return count_world(
        comm, st, c, d_bad, [&] { count_wrong<<<264, 256, 0, st>>>(dst, r->out_elems, g, seed, d_bad); }, what, total);
  };
  unsigned long long bad_plain = 0, bad_zc = 0;
  MK_CHECK(checked(out.p, "the checked call (plain)", [&] { return op->run(plain, st); }, &bad_plain));
  MK_CHECK(checked(zc.out, "the checked call (zero-copy)", [&] { return op->run(zc, st); }, &bad_zc));
  r->checked = true;
  r->bad = bad_plain + bad_zc;
  r->correct = r->bad == 0;
  if (!r->correct) return OkStatus();  // no timings of a wrong operator

  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing the operator (plain)", [&] { return op->enqueue(plain, st); }, &t));
  r->op_us = t.median_ms * 1e3;
  MK_CHECK(time_it(comm, st, rc, "timing the operator (zero-copy)", [&] { return op->enqueue(zc, st); }, &t));
  r->zc_us = t.median_ms * 1e3;
  if (r->copy_bytes) {
    MK_CHECK(time_it(comm, st, rc, "timing the device copy", [&] {
      return CLI_CUDA(comm, cudaMemcpyAsync(copy_dst.p, copy_src.p, r->copy_bytes, cudaMemcpyDeviceToDevice, st));
    }, &t));
    r->copy_us = t.median_ms * 1e3;
  }
#if MK_HAVE_NCCL
  if (r->comparable) {
    if (!*bl)
      MK_CHECK(agreed(comm, Baselines::create(comm->bootstrap(), comm->device(), bl), "creating the NCCL baselines"));
    const Baselines::DType dt = r->dtype == CollDType::kF32 ? Baselines::DType::kF32 : Baselines::DType::kBF16;
    auto nccl = [&] { return (*bl)->collective(nccl_coll(r->kind), in.p, nccl_out.p, size_t(r->out_elems), st, dt); };
    // NCCL must produce the same result, or its time means nothing.
    unsigned long long bad_nccl = 0;
    MK_CHECK(checked(nccl_out.p, "checking NCCL's result", nccl, &bad_nccl));
    MK_REQUIRE(bad_nccl == 0, Code::kInternal, "%s bench: NCCL's result differs from the exact one in %llu elements",
               collective_kind_name(r->kind), bad_nccl);
    MK_CHECK(time_it(comm, st, rc, "timing NCCL", nccl, &t));
    r->nccl_us = t.median_ms * 1e3;
  }
#else
  (void)bl;
#endif
  return OkStatus();
}

Status bench_coll_one(Communicator* comm, const CollBenchArgs& a, uint64_t seed, std::unique_ptr<Baselines>* bl,
                      CollRow* r) {
  ops::CollectiveOptions opt;
  opt.chunk_elems = a.chunk;
  opt.ctas = a.ctas;
  std::unique_ptr<Collective> op;
  MK_CHECK(Collective::create(comm, r->kind, r->count, r->dtype, opt, &op));  // collective: the same error everywhere
  const Status s = bench_coll_body(comm, op.get(), a.rc, seed, bl, r);
  // Every rank gets here on the same path (the body's failures are agreed): destroy is collective.
  const Status d = op->destroy();
  return s.ok() ? d : s;
}

std::string size_cell(double b) {
  char s[32];
  if (b >= double(1 << 20)) snprintf(s, sizeof s, "%.4gM", b / double(1 << 20));
  else if (b >= 1024) snprintf(s, sizeof s, "%.4gK", b / 1024);
  else snprintf(s, sizeof s, "%.0f", b);
  return s;
}

std::string coll_json(const CollRow& r) {
  char b[2048];
  snprintf(b, sizeof b,
           "{\"op\": \"%s\", \"dtype\": \"%s\", \"W\": %d, \"nodes\": %d, \"count\": %lld, \"in_elems\": %lld, "
           "\"out_elems\": %lld, \"size_bytes\": %.0f, \"bus_bytes\": %.0f, \"copy_bytes\": %llu, \"ctas\": %d, "
           "\"chunk_elems\": %lld, \"correct\": %s, \"mismatches\": %llu, \"op_us\": %s, \"zc_us\": %s, "
           "\"nccl_us\": %s, \"copy_us\": %s, \"op_algbw_GBps\": %s, \"op_busbw_GBps\": %s, \"zc_algbw_GBps\": %s, "
           "\"zc_busbw_GBps\": %s, \"nccl_algbw_GBps\": %s, \"nccl_busbw_GBps\": %s, \"copy_GBps\": %s, "
           "\"vs_nccl\": %s, \"zc_vs_nccl\": %s, \"vs_copy\": %s, \"shared_gpu\": %s, \"comparable\": %s}",
           collective_kind_name(r.kind), coll_dtype_name(r.dtype), r.W, r.nodes, (long long)r.count,
           (long long)r.in_elems, (long long)r.out_elems, r.size(), r.bus_bytes(), (unsigned long long)r.copy_bytes,
           r.ctas, (long long)r.chunk, r.correct ? "true" : "false", r.bad, jnum(r.op_us, 2).c_str(),
           jnum(r.zc_us, 2).c_str(), jnum(r.nccl_us, 2).c_str(), jnum(r.copy_us, 2).c_str(),
           jnum(r.algbw(r.op_us), 2).c_str(), jnum(r.busbw(r.op_us), 2).c_str(), jnum(r.algbw(r.zc_us), 2).c_str(),
           jnum(r.busbw(r.zc_us), 2).c_str(), jnum(r.algbw(r.nccl_us), 2).c_str(),
           jnum(r.busbw(r.nccl_us), 2).c_str(), jnum(r.copy_gbps(), 2).c_str(),
           jnum(ratio(r.nccl_us, r.op_us), 3).c_str(), jnum(ratio(r.nccl_us, r.zc_us), 3).c_str(),
           jnum(r.copy_gbps() > 0 ? r.busbw(r.zc_us) / r.copy_gbps() : 0, 3).c_str(),
           r.shared_gpu ? "true" : "false", r.comparable ? "true" : "false");
  return b;
}

}  // namespace

int collective(const Env& env, const CollBenchArgs& a) {
  Communicator* comm = env.comm;
  const int W = comm->world(), me = comm->rank(), nodes = comm->topology().num_nodes;
  const char* name = collective_kind_name(a.kind);
  const int64_t esize = a.dtype == CollDType::kF32 ? 4 : 2;
  // Fresh inputs every run, the same on every rank (rank 0's seed); printed to reproduce one.
  uint64_t seed = 0;
  if (me == 0) seed = mix(uint64_t(std::chrono::system_clock::now().time_since_epoch().count()));
  const Status bs = comm->bootstrap().broadcast(&seed, sizeof(seed), 0);
  if (!bs.ok()) {
    fprintf(stderr, "bench %s: rank %d: broadcasting the seed: %s\n", name, me, bs.to_string().c_str());
    return 1;
  }
  std::vector<int64_t> counts = a.counts;
  if (counts.empty())
    for (int64_t size : kDefaultSizes) {
      const int64_t c = count_for_size(a.kind, size, esize, W);
      if (std::find(counts.begin(), counts.end(), c) == counts.end()) counts.push_back(c);
    }
  if (me == 0) {
    printf("%s: %s%s, %d rank(s), %d node(s), chunk %s, ctas %s, seed 0x%016llx; %s\n", name,
           coll_dtype_name(a.dtype), a.kind == CollectiveKind::kAllGather ? "" : ", sum", W, nodes,
           a.chunk ? std::to_string(a.chunk).c_str() : "default", a.ctas ? std::to_string(a.ctas).c_str() : "default",
           (unsigned long long)seed,
           env.comparable ? "one GPU per rank: vs NCCL of the same buffers and a device copy of the bus bytes"
           : !env.own_gpu ? "ranks share a GPU: times not comparable across GPUs; no NCCL baseline"
                          : "no NCCL: vs a device copy of the bus bytes only");
    printf("size = %s; algbw = size / time; busbw = size x %s / time (nccl-tests); op: user buffers (copied in%s by "
           "the call); zc: zero-copy (input()%s); copy: cudaMemcpyAsync D2D of the bus bytes on every rank; "
           "vs_nccl = nccl_us / op_us, zc/nccl = nccl_us / zc_us, vs_copy = zc busbw / copy GB/s\n",
           a.kind == CollectiveKind::kAllReduce ? "count x e" : "W x count x e",
           a.kind == CollectiveKind::kAllReduce ? "2(W-1)/W" : "(W-1)/W",
           a.kind == CollectiveKind::kAllReduce ? " and out" : "",
           a.kind == CollectiveKind::kAllReduce ? ", output()" : ", a plain output");
    printf("%-14s %-5s %3s %11s %8s %5s  %-6s %9s %9s %9s %9s %7s %7s %7s %8s %9s %7s %7s %7s\n", "op", "dtype", "W",
           "count", "size", "ctas", "check",
           "op_us", "zc_us", "nccl_us", "copy_us", "zc_alg", "zc_bus", "op_bus", "nccl_bus", "copy_GB/s", "vs_nccl",
           "zc/nccl", "vs_copy");
  }
  std::unique_ptr<Baselines> bl;
  std::vector<std::string> rows;
  std::vector<CheckLine> checks;
  bool failed = false;
  for (size_t i = 0; i < counts.size(); ++i) {
    CollRow r;
    r.kind = a.kind, r.dtype = a.dtype, r.esize = esize;
    r.W = W, r.nodes = nodes, r.count = counts[i], r.chunk = a.chunk;
    r.comparable = env.comparable, r.shared_gpu = !env.own_gpu;
    CheckLine c;
    c.label = std::string(name) + " " + coll_dtype_name(a.dtype) + " count " + std::to_string(r.count) + " W " +
              std::to_string(W);
    Status s = bench_coll_one(comm, a, mix(seed ^ uint64_t(i + 1)), &bl, &r);
    c.done = r.checked, c.ok = r.correct, c.bad = r.bad;
    if (!s.ok()) {
      c.error = s.to_string();
      note_failure(s);
      if (me == 0) fprintf(stderr, "bench %s count %lld: %s\n", name, (long long)r.count, c.error.c_str());
    }
    checks.push_back(c);
    if (s.ok() && r.correct) {
      rows.push_back(coll_json(r));
      if (me == 0) {
        printf("%-14s %-5s %3d %11lld %8s %5d  %-6s %9s %9s %9s %9s %7s %7s %7s %8s %9s %7s %7s %7s%s\n", name,
               coll_dtype_name(a.dtype), W, (long long)r.count,
               size_cell(r.size()).c_str(), r.ctas, "ok", cell(r.op_us, 1).c_str(), cell(r.zc_us, 1).c_str(),
               r.comparable ? cell(r.nccl_us, 1).c_str() : "n/a", cell(r.copy_us, 1).c_str(),
               cell(r.algbw(r.zc_us), 1).c_str(), cell(r.busbw(r.zc_us), 1).c_str(),
               cell(r.busbw(r.op_us), 1).c_str(), cell(r.busbw(r.nccl_us), 1).c_str(), cell(r.copy_gbps(), 1).c_str(),
               cell(ratio(r.nccl_us, r.op_us), 2).c_str(), cell(ratio(r.nccl_us, r.zc_us), 2).c_str(),
               cell(r.copy_gbps() > 0 ? r.busbw(r.zc_us) / r.copy_gbps() : 0, 2).c_str(),
               r.shared_gpu ? "  (ranks share a GPU: not comparable)" : "");
        fflush(stdout);
      }
    } else if (me == 0 && r.checked && !r.correct) {
      printf("%-14s %-5s %3d %11lld %8s %5d  %-6s (%llu mismatches)\n", name, coll_dtype_name(a.dtype), W,
             (long long)r.count, size_cell(r.size()).c_str(), r.ctas, "WRONG", r.bad);
    }
    if (!s.ok() && communicator_failed(comm)) break;
  }
  bl.reset();
  if (me == 0 && !env.json.empty() && !write_json(env.json, W, nodes, env.comparable, rows)) failed = true;
  return summarize(comm, checks,
                   "bit for bit against the exact result of small-integer inputs: plain and zero-copy paths, and "
                   "NCCL's output where timed",
                   failed);
}

}  // namespace bench
}  // namespace mk
