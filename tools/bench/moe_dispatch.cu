// `mkernel bench moe_dispatch`: MoE dispatch and combine (include/mkernel/ops/moe.h) against a
// device copy of the same bytes and an NCCL all-to-all-v with permute kernels.
//
// Per preset (a model's hidden size, experts and top-k; tokens per rank):
//   - inputs: every rank's routing (top-k distinct experts per token, uniform) and weights come
//     from a seeded hash on the host, so every rank regenerates every rank's routing; x rows are
//     hashed from (seed, rank, token, column) by a fill kernel, so any rank recomputes any row;
//   - check of one dispatch: counts, offsets and every row in use of recv_x against the CPU
//     rules of src/ops/moe/moe_plan.h (route_source, dest_layout) applied to all ranks' ids —
//     each row must be its sender's x row, exactly (recv_x, counts, offsets poisoned before);
//   - check of one combine with identity experts (y = recv_x): out[t] must equal, bit for bit,
//     bf16_rne(fp32 fused multiply-adds w[t, k] * x[t] over the slots k in order, -1 skipped);
//   - timings (median over ranks' slowest of --reps calls after --warmup, CUDA events on the
//     stream; bench_common.h's time_it) of dispatch alone, combine alone, a device-to-device
//     cudaMemcpyAsync of the bytes dispatch delivers to the rank, and — when every rank has its
//     own GPU and NCCL is built — NCCL: a gather of the records by destination, a grouped
//     ncclSend/ncclRecv all-to-all-v, a scatter into the expert-major layout (the per-peer
//     counts are exchanged and the permutation maps built on the host beforehand, outside the
//     timing: the baseline does no routing work on the device, the operator does all of it).
//
// Bandwidth (DeepEP's convention): bytes = records this rank receives in dispatch (one per
// source token and destination rank, its own included) x H x 2, over the call's time; combine
// is counted with the same bytes (it moves one row per entry back, more than that). The copy
// baseline moves the same bytes, so vs_copy = copy_us / dispatch_us = dispatch GB/s / copy GB/s.
// Rank 0 prints its own figures; a time is the slowest rank's.
//
// Experts not a multiple of W are rounded up (said in the line and the JSON); ranks sharing a
// GPU get min(preset, 4096 / W) tokens unless --tokens is given, and their times are not
// comparable across GPUs.
//
// Part of the CLI (mkernel_cli), not of the library; the shared helpers are tools/bench_common.h.
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/mkernel.h"
#include "mkernel/ops/moe.h"
#include "src/ops/moe/moe_plan.h"
#include "tools/bench_common.h"
#if MK_HAVE_NCCL
#include "tools/baseline/baseline.h"
#endif

namespace mk {
namespace bench {
namespace {

using ops::DestLayout;
using ops::MoeGeometry;
using ops::SourceRoute;

struct Preset {
  const char* name;
  int64_t tokens;  // per rank
  int64_t hidden;
  int experts;
  int topk;
};
// deepep_ht / deepep_ll: DeepSeek-V3 shapes of DeepEP's normal (high-throughput) and low-latency
// tests; qwen3: Qwen3-30B-A3B; mixtral: Mixtral 8x7B.
constexpr Preset kPresets[] = {
    {"deepep_ht", 4096, 7168, 256, 8},
    {"deepep_ll", 128, 7168, 288, 8},
    {"qwen3", 4096, 2048, 128, 8},
    {"mixtral", 4096, 4096, 8, 2},
};
// Tokens per rank when ranks share one GPU: W ranks together send about this many.
constexpr int64_t kSharedTokens = 4096;

// ---- inputs: functions of (seed, rank, token, slot or column), on the host and the device ----

// The hash key of row `token` of rank `rank`'s x (token < 2^24: moe_geometry's limit).
__host__ __device__ inline uint64_t x_row_key(uint64_t seed, int rank, int64_t token) {
  return mix(seed ^ (uint64_t(rank) << 32 | uint64_t(token)));
}
// x[rank][token][col] (key = x_row_key): v / 64 with v in [-127, 127] \ {0}, exact in bf16, never 0.
__host__ __device__ inline float x_value(uint64_t key, int64_t col) {
  const uint64_t h = mix(key ^ uint64_t(col));
  int v = int(h % 254u) - 127;
  if (v >= 0) ++v;
  return float(v) * (1.f / 64.f);
}

__global__ void fill_x(__nv_bfloat16* x, int64_t T, int64_t H, uint64_t seed, int rank) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * H; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16_rn(x_value(x_row_key(seed, rank, i / H), i % H));
}

// Rank s's top-k ids [T, k]: k distinct experts per token, uniform over [0, E).
void make_ids(uint64_t seed, int s, const MoeGeometry& g, std::vector<int32_t>* ids) {
  ids->assign(size_t(g.T) * g.k, -1);
  const uint64_t rank_key = mix(seed ^ 0x1d5ull ^ (uint64_t(s) << 40));
  for (int64_t t = 0; t < g.T; ++t) {
    int32_t* row = ids->data() + t * g.k;
    const uint64_t tok_key = mix(rank_key ^ uint64_t(t));
    for (int kk = 0; kk < g.k; ++kk)
      for (uint64_t attempt = 0;; ++attempt) {  // k <= E: terminates (draws until distinct)
        const int32_t e = int32_t(mix(tok_key ^ (uint64_t(kk) << 32 | attempt)) % uint64_t(g.E));
        if (std::find(row, row + kk, e) == row + kk) {
          row[kk] = e;
          break;
        }
      }
  }
}

// Rank s's weights [T, k]: (0, 1], 24-bit fractions.
void make_weights(uint64_t seed, int s, const MoeGeometry& g, std::vector<float>* w) {
  w->assign(size_t(g.T) * g.k, 0.f);
  const uint64_t rank_key = mix(seed ^ 0x3e1ull ^ (uint64_t(s) << 40));
  for (size_t i = 0; i < w->size(); ++i) (*w)[i] = float((mix(rank_key ^ i) >> 40) + 1) * (1.f / 16777216.f);
}

// bf16 bits of a finite float, round to nearest even (as __float2bfloat16_rn).
uint16_t bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Every rank's routing, regenerated on this host, and this rank's expected receive layout.
struct World {
  MoeGeometry g;
  std::vector<std::vector<int32_t>> ids;  // [W][T * k]
  std::vector<SourceRoute> routes;        // [W] route_source of each rank's ids
  DestLayout dest;                        // this rank's (dest_layout)
  int64_t records = 0;                    // records this rank receives (every source, itself included)
};

Status make_world(const MoeGeometry& g, int me, uint64_t seed, World* w) {
  w->g = g;
  w->ids.resize(g.W);
  w->routes.resize(g.W);
  std::vector<const int32_t*> ptrs(g.W);
  std::vector<int64_t> n(g.W, g.T);
  w->records = 0;
  for (int s = 0; s < g.W; ++s) {
    make_ids(seed, s, g, &w->ids[s]);
    int64_t bad = 0;
    ops::route_source(g, w->ids[s].data(), g.T, &w->routes[s], &bad);
    MK_REQUIRE(bad == 0, Code::kInternal, "moe bench: rank %d's generated routing has %lld bad ids", s, (long long)bad);
    ptrs[s] = w->ids[s].data();
    w->records += int64_t(w->routes[s].rec_tokens[me].size());
  }
  ops::dest_layout(g, me, ptrs, n, w->routes, &w->dest);
  return OkStatus();
}

// Mismatching elements of rows [0, rows) of an expert-major layout (host copy, [rows, H] bf16)
// against what `d` says each row holds: its sender's x row. Alignment gaps are not checked.
uint64_t check_rows(const World& w, uint64_t seed, const std::vector<uint16_t>& got, int64_t rows) {
  const int64_t H = w.g.H;
  uint64_t bad = 0;
  for (int64_t row = 0; row < rows; ++row) {
    const ops::RowOrigin o = w.dest.rows[size_t(row)];
    if (o.src < 0) continue;
    const uint64_t key = x_row_key(seed, o.src, o.token);
    const uint16_t* g = got.data() + row * H;
    for (int64_t c = 0; c < H; ++c) bad += g[c] != bf16_rne(x_value(key, c));
  }
  return bad;
}

// Sums each rank's `mine` after every rank's step `s` was agreed (count_world's host twin).
Status sum_world(Communicator* comm, const Status& s, uint64_t mine, const std::string& what,
                 unsigned long long* total) {
  MK_CHECK(agreed(comm, s, what));
  std::vector<uint64_t> all(comm->world());
  MK_CHECK(comm->bootstrap().allgather(&mine, all.data(), sizeof(mine)));
  *total = 0;
  for (uint64_t b : all) *total += b;
  return OkStatus();
}

struct MoeRow {
  std::string preset;
  int W = 1, nodes = 1;
  int64_t tokens = 0, tokens_preset = 0, hidden = 0;
  int experts = 0, experts_preset = 0, topk = 0;
  bool tokens_scaled = false, comparable = false, shared_gpu = false;
  bool checked = false, correct = false;
  unsigned long long bad = 0;
  int64_t records = 0, recv_rows = 0;  // this rank's: records received, rows in use (alignment included)
  double dispatch_us = 0, combine_us = 0, copy_us = 0, nccl_us = 0;
  bool hierarchical = false;  // records crossed nodes through the twins (MoeMode, auto)
  double out_copy_us = 0;  // a device copy of the expert-major rows in use (recv_rows x H x 2)
  // rank 0's host time to enqueue one call (the call's time is device time only while the
  // enqueue is shorter: past that, the GPU waits for the host)
  double dispatch_host_us = 0, combine_host_us = 0;
  uint64_t bytes() const { return uint64_t(records) * uint64_t(hidden) * 2; }
  double gbps(double us) const { return us > 0 ? double(bytes()) / (us * 1e3) : 0; }
};

#if MK_HAVE_NCCL
// dst row map[i].y = src row map[i].x, rows of row_bytes (a multiple of 16); one CTA per pair.
// The NCCL baseline's gather (tokens by destination) and scatter (records to expert rows).
__global__ void permute_rows(const char* src, char* dst, const int2* map, int64_t n, int64_t row_bytes) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int4* s = reinterpret_cast<const int4*>(src + int64_t(map[i].x) * row_bytes);
    int4* d = reinterpret_cast<int4*>(dst + int64_t(map[i].y) * row_bytes);
    for (int64_t j = threadIdx.x; j < row_bytes / 16; j += blockDim.x) d[j] = s[j];
  }
}

// The NCCL baseline: gather x rows by destination, all-to-all-v, scatter into the expert-major
// layout (rows [0, rows in use) of `out`). The maps and counts are built here on the host.
Status time_nccl(Communicator* comm, cudaStream_t st, const RunCfg& rc, const World& w, uint64_t seed,
                 const void* x, MoeRow* row) {
  using ops::baseline::Baselines;
  const MoeGeometry& g = w.g;
  const int W = g.W, me = comm->rank();
  const SourceRoute& mine = w.routes[me];
  std::vector<int64_t> send_rows(W), send_off(W + 1, 0), recv_rows(W), recv_off(W + 1, 0);
  for (int r = 0; r < W; ++r) {
    send_rows[r] = int64_t(mine.rec_tokens[r].size());
    send_off[r + 1] = send_off[r] + send_rows[r];
  }
  // The per-peer counts, exchanged on the host (in an NCCL-based dispatch, a small all-to-all
  // before the payload; not timed here).
  std::vector<int64_t> all(size_t(W) * W);
  MK_CHECK(comm->bootstrap().allgather(send_rows.data(), all.data(), sizeof(int64_t) * W));
  for (int s = 0; s < W; ++s) {
    recv_rows[s] = all[size_t(s) * W + me];
    recv_off[s + 1] = recv_off[s] + recv_rows[s];
  }
  // Gather map: token t -> its place among the records for rank r. Scatter map: record j from
  // source s -> the row of each of its entries (dest_layout's rule, per source).
  std::vector<int2> gmap, smap;
  for (int r = 0; r < W; ++r)
    for (size_t j = 0; j < mine.rec_tokens[r].size(); ++j)
      gmap.push_back(make_int2(mine.rec_tokens[r][j], int(send_off[r] + int64_t(j))));
  std::vector<int64_t> base(w.dest.offsets.begin(), w.dest.offsets.end() - 1);
  Status s;
  for (int src = 0; src < W && s.ok(); ++src) {
    const SourceRoute& rt = w.routes[src];
    const std::vector<int32_t>& toks = rt.rec_tokens[me];
    if (int64_t(toks.size()) != recv_rows[src])
      s = make_status(Code::kInternal, "moe bench: rank %d says it sends %lld records here, its routing says %zu", src,
                      (long long)recv_rows[src], toks.size());
    for (size_t j = 0; j < toks.size() && s.ok(); ++j) {
      const int64_t t = toks[j];
      for (int kk = 0; kk < g.k; ++kk) {
        const int32_t e = w.ids[src][t * g.k + kk];
        if (e < 0 || e / g.El != me) continue;
        const int64_t dst = base[e - me * g.El] + rt.erank[t * g.k + kk];
        smap.push_back(make_int2(int(recv_off[src] + int64_t(j)), int(dst)));
      }
    }
    for (int le = 0; le < g.El; ++le) base[le] += rt.ecount[me * g.El + le];
  }
  MK_CHECK(agreed(comm, s, "building the NCCL baseline's maps"));

  const int64_t rows_in_use = w.dest.offsets[g.El];
  std::unique_ptr<Baselines> bl;
  MK_CHECK(agreed(comm, Baselines::create(comm->bootstrap(), comm->device(), &bl), "creating the NCCL baselines"));
  Buf sendb, recvb, out, gm, sm;
  s = CLI_CUDA(comm, sendb.alloc(size_t(send_off[W]) * g.row_bytes));
  if (s.ok()) s = CLI_CUDA(comm, recvb.alloc(size_t(recv_off[W]) * g.row_bytes));
  if (s.ok()) s = CLI_CUDA(comm, out.alloc(size_t(rows_in_use) * g.row_bytes));
  if (s.ok()) s = CLI_CUDA(comm, gm.alloc(gmap.size() * sizeof(int2)));
  if (s.ok()) s = CLI_CUDA(comm, sm.alloc(smap.size() * sizeof(int2)));
  if (s.ok() && !gmap.empty())
    s = CLI_CUDA(comm, cudaMemcpy(gm.p, gmap.data(), gmap.size() * sizeof(int2), cudaMemcpyHostToDevice));
  if (s.ok() && !smap.empty())
    s = CLI_CUDA(comm, cudaMemcpy(sm.p, smap.data(), smap.size() * sizeof(int2), cudaMemcpyHostToDevice));
  // A pageable cudaMemcpy may return before its DMA lands, unordered with the stream below.
  if (s.ok()) s = CLI_CUDA(comm, cudaDeviceSynchronize());
  if (s.ok()) s = CLI_CUDA(comm, cudaMemsetAsync(out.p, 0xff, size_t(rows_in_use) * g.row_bytes, st));  // poison
  if (s.ok()) s = synced(comm, st);
  MK_CHECK(agreed(comm, s, "allocating the NCCL baseline's buffers"));

  const int64_t ng = int64_t(gmap.size()), ns = int64_t(smap.size());
  auto grid = [](int64_t n) { return int(std::max<int64_t>(1, std::min<int64_t>(n, 1024))); };
  auto baseline = [&]() -> Status {
    permute_rows<<<grid(ng), 128, 0, st>>>(static_cast<const char*>(x), static_cast<char*>(sendb.p),
                                           static_cast<const int2*>(gm.p), ng, g.row_bytes);
    MK_CHECK(CLI_CUDA(comm, cudaGetLastError()));
    MK_CHECK(bl->alltoallv(sendb.p, send_rows.data(), send_off.data(), recvb.p, recv_rows.data(), recv_off.data(),
                           g.H, st));
    permute_rows<<<grid(ns), 128, 0, st>>>(static_cast<const char*>(recvb.p), static_cast<char*>(out.p),
                                           static_cast<const int2*>(sm.p), ns, g.row_bytes);
    return CLI_CUDA(comm, cudaGetLastError());
  };
  // The baseline must build the same layout, or its time means nothing.
  s = decoded(comm, baseline());
  if (s.ok()) s = synced(comm, st);
  std::vector<uint16_t> got;
  uint64_t mine_bad = 0;
  if (s.ok()) {
    got.resize(size_t(rows_in_use) * g.H);
    s = CLI_CUDA(comm, cudaMemcpy(got.data(), out.p, got.size() * 2, cudaMemcpyDeviceToHost));
  }
  if (s.ok()) mine_bad = check_rows(w, seed, got, rows_in_use);
  unsigned long long bad = 0;
  MK_CHECK(sum_world(comm, s, mine_bad, "checking the NCCL baseline", &bad));
  MK_REQUIRE(bad == 0, Code::kInternal, "moe bench: the NCCL baseline built a wrong layout (%llu elements differ)",
             bad);
  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing the NCCL all-to-all-v + permute", baseline, &t));
  row->nccl_us = t.median_ms * 1e3;
  return OkStatus();
}
#endif

Status bench_moe_body(Communicator* comm, ops::MoeEp* ep, const RunCfg& rc, uint64_t seed, MoeRow* row) {
  const int me = comm->rank();
  cudaStream_t st = comm->stream();
  MoeGeometry g;
  MK_CHECK(ops::moe_geometry(ep->config(), comm->world(), &g));
  World w;
  std::vector<float> weights;
  Status s = make_world(g, me, seed, &w);
  make_weights(seed, me, g, &weights);
  MK_CHECK(agreed(comm, s, "generating the routing"));
  row->records = w.records;
  row->recv_rows = w.dest.offsets[g.El];
  const int64_t rows_in_use = std::min<int64_t>(w.dest.offsets[g.El], g.recv_rows);
  const size_t x_bytes = size_t(g.T) * g.row_bytes, tk = size_t(g.T) * g.k;
  const size_t recv_bytes = size_t(g.recv_rows) * g.row_bytes;

  Buf x, ids, wts, recv_x, counts, offsets, out, copy_src;
  s = [&]() -> Status {
    MK_CHECK(CLI_CUDA(comm, x.alloc(x_bytes)));
    MK_CHECK(CLI_CUDA(comm, ids.alloc(tk * 4)));
    MK_CHECK(CLI_CUDA(comm, wts.alloc(tk * 4)));
    MK_CHECK(CLI_CUDA(comm, recv_x.alloc(recv_bytes)));
    MK_CHECK(CLI_CUDA(comm, counts.alloc(size_t(g.El) * 4)));
    MK_CHECK(CLI_CUDA(comm, offsets.alloc(size_t(g.El + 1) * 4)));
    MK_CHECK(CLI_CUDA(comm, out.alloc(x_bytes)));
    MK_CHECK(CLI_CUDA(comm, copy_src.alloc(std::max(size_t(row->bytes()), size_t(rows_in_use) * g.row_bytes))));
    fill_x<<<264, 256, 0, st>>>(x.bf(), g.T, g.H, seed, me);
    MK_CHECK(CLI_CUDA(comm, cudaGetLastError()));
    MK_CHECK(CLI_CUDA(comm, cudaMemcpyAsync(ids.p, w.ids[me].data(), tk * 4, cudaMemcpyHostToDevice, st)));
    MK_CHECK(CLI_CUDA(comm, cudaMemcpyAsync(wts.p, weights.data(), tk * 4, cudaMemcpyHostToDevice, st)));
    // Poison the outputs: a row, count or offset the operator did not write is a mismatch.
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(recv_x.p, 0xff, recv_bytes, st)));
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(counts.p, 0xff, size_t(g.El) * 4, st)));
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(offsets.p, 0xff, size_t(g.El + 1) * 4, st)));
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(out.p, 0xff, x_bytes, st)));
    MK_CHECK(CLI_CUDA(comm, cudaMemsetAsync(copy_src.p, 0x3c,
                                            std::max(size_t(row->bytes()), size_t(rows_in_use) * g.row_bytes), st)));
    return synced(comm, st);
  }();
  MK_CHECK(agreed(comm, s, "preparing inputs"));

  ops::MoeDispatchArgs da;
  da.x = x.p;
  da.topk_ids = static_cast<const int32_t*>(ids.p);
  da.topk_weights = static_cast<const float*>(wts.p);
  da.d_num_tokens = nullptr;
  da.tokens = g.T;
  ops::MoeDispatchOut dout;
  dout.recv_x = recv_x.p;
  dout.counts = static_cast<int32_t*>(counts.p);
  dout.offsets = static_cast<int32_t*>(offsets.p);

  // The checked dispatch: run, synchronize, comm->check() and the operator's check(); only then
  // read what it wrote.
  s = decoded(comm, ep->dispatch(da, dout, st));
  if (s.ok()) s = synced(comm, st);
  if (s.ok()) s = ep->check();
  uint64_t mine_bad = 0;
  if (s.ok()) {
    std::vector<int32_t> c(g.El), o(g.El + 1);
    std::vector<uint16_t> got(size_t(rows_in_use) * g.H);
    s = CLI_CUDA(comm, cudaMemcpy(c.data(), counts.p, c.size() * 4, cudaMemcpyDeviceToHost));
    if (s.ok()) s = CLI_CUDA(comm, cudaMemcpy(o.data(), offsets.p, o.size() * 4, cudaMemcpyDeviceToHost));
    if (s.ok()) s = CLI_CUDA(comm, cudaMemcpy(got.data(), recv_x.p, got.size() * 2, cudaMemcpyDeviceToHost));
    if (s.ok()) {
      for (int le = 0; le < g.El; ++le) mine_bad += c[le] != w.dest.counts[le];
      for (int le = 0; le <= g.El; ++le) mine_bad += o[le] != w.dest.offsets[le];
      mine_bad += check_rows(w, seed, got, rows_in_use);
    }
  }
  unsigned long long bad_d = 0;
  MK_CHECK(sum_world(comm, s, mine_bad, "the checked dispatch", &bad_d));

  // The checked combine, identity experts (y = recv_x): out[t] = bf16_rne(sum_k fma(w, x[t])),
  // the fp32 fused multiply-adds in slot order from 0, slots without an expert skipped.
  ops::MoeCombineArgs ca;
  ca.y = recv_x.p;
  s = OkStatus();
  mine_bad = 0;
  if (bad_d == 0) {
    s = decoded(comm, ep->combine(ca, out.p, st));
    if (s.ok()) s = synced(comm, st);
    if (s.ok()) s = ep->check();
    std::vector<uint16_t> got;
    if (s.ok()) {
      got.resize(size_t(g.T) * g.H);
      s = CLI_CUDA(comm, cudaMemcpy(got.data(), out.p, x_bytes, cudaMemcpyDeviceToHost));
    }
    if (s.ok()) {
      const std::vector<int32_t>& id = w.ids[me];
      for (int64_t t = 0; t < g.T; ++t) {
        const uint64_t key = x_row_key(seed, me, t);
        for (int64_t c = 0; c < g.H; ++c) {
          const float xv = x_value(key, c);
          float acc = 0.f;
          for (int kk = 0; kk < g.k; ++kk)
            if (id[t * g.k + kk] >= 0) acc = std::fma(weights[t * g.k + kk], xv, acc);
          mine_bad += got[size_t(t) * g.H + c] != bf16_rne(acc);
        }
      }
    }
  }
  unsigned long long bad_c = 0;
  MK_CHECK(sum_world(comm, s, mine_bad, "the checked combine", &bad_c));
  row->checked = true;
  row->bad = bad_d + bad_c;
  row->correct = row->bad == 0;
  if (!row->correct) return OkStatus();  // no timings of a wrong operator

  Timing t;
  MK_CHECK(time_it(comm, st, rc, "timing dispatch", [&] { return ep->dispatch(da, dout, st); }, &t));
  row->dispatch_us = t.median_ms * 1e3;
  row->dispatch_host_us = t.host_median_ms * 1e3;
  MK_CHECK(time_it(comm, st, rc, "timing combine", [&] { return ep->combine(ca, out.p, st); }, &t));
  row->combine_us = t.median_ms * 1e3;
  row->combine_host_us = t.host_median_ms * 1e3;
  // A bad input met during the timed calls would only show in check() (none is expected).
  MK_CHECK(agreed(comm, ep->check(), "the timed calls"));
  MK_CHECK(time_it(comm, st, rc, "timing the device copy", [&] {
    return CLI_CUDA(comm, cudaMemcpyAsync(recv_x.p, copy_src.p, size_t(row->bytes()), cudaMemcpyDeviceToDevice, st));
  }, &t));
  row->copy_us = t.median_ms * 1e3;
  // The expert-major output itself (one row per entry): the least a dispatch into this layout
  // writes.
  MK_CHECK(time_it(comm, st, rc, "timing the output copy", [&] {
    return CLI_CUDA(comm, cudaMemcpyAsync(recv_x.p, copy_src.p, size_t(rows_in_use) * g.row_bytes,
                                          cudaMemcpyDeviceToDevice, st));
  }, &t));
  row->out_copy_us = t.median_ms * 1e3;
#if MK_HAVE_NCCL
  if (row->comparable) MK_CHECK(time_nccl(comm, st, rc, w, seed, x.p, row));
#endif
  return OkStatus();
}

Status bench_moe_one(Communicator* comm, const RunCfg& rc, uint64_t seed, MoeRow* row) {
  ops::MoeConfig cfg;
  cfg.hidden = row->hidden;
  cfg.num_experts = row->experts;
  cfg.topk = row->topk;
  cfg.max_tokens_per_rank = row->tokens;
  cfg.expert_align = 1;
  cfg.recv_capacity = 0;  // the worst case: never overflows
  std::unique_ptr<ops::MoeEp> ep;
  MK_CHECK(ops::MoeEp::create(comm, cfg, {}, &ep));  // collective: a bad config fails every rank
  row->hierarchical = ep->hierarchical();
  const Status s = bench_moe_body(comm, ep.get(), rc, seed, row);
  // Every rank gets here on the same path (the body's failures are agreed): destroy is collective.
  const Status d = ep->destroy();
  return s.ok() ? d : s;
}

std::string moe_json(const MoeRow& r) {
  char b[2048];
  snprintf(b, sizeof b,
           "{\"op\": \"moe_dispatch\", \"preset\": \"%s\", \"W\": %d, \"nodes\": %d, \"tokens\": %lld, "
           "\"tokens_preset\": %lld, \"tokens_scaled\": %s, \"hidden\": %lld, \"experts\": %d, "
           "\"experts_preset\": %d, \"experts_rounded\": %s, \"topk\": %d, \"expert_align\": 1, "
           "\"recv_records\": %lld, \"recv_rows\": %lld, \"correct\": %s, \"mismatches\": %llu, "
           "\"dispatch_us\": %s, \"combine_us\": %s, \"copy_us\": %s, \"out_copy_us\": %s, \"nccl_us\": %s, "
           "\"dispatch_host_us\": %s, \"combine_host_us\": %s, \"dispatch_GBps\": %s, "
           "\"combine_GBps\": %s, \"copy_GBps\": %s, \"nccl_GBps\": %s, \"copy_ratio\": %s, \"out_copy_ratio\": %s, "
           "\"shared_gpu\": %s, \"comparable\": %s, \"hierarchical\": %s}",
           r.preset.c_str(), r.W, r.nodes, (long long)r.tokens, (long long)r.tokens_preset,
           r.tokens_scaled ? "true" : "false", (long long)r.hidden, r.experts, r.experts_preset,
           r.experts != r.experts_preset ? "true" : "false", r.topk, (long long)r.records, (long long)r.recv_rows,
           r.correct ? "true" : "false", r.bad, jnum(r.dispatch_us, 2).c_str(), jnum(r.combine_us, 2).c_str(),
           jnum(r.copy_us, 2).c_str(), jnum(r.out_copy_us, 2).c_str(), jnum(r.nccl_us, 2).c_str(),
           jnum(r.dispatch_host_us, 2).c_str(), jnum(r.combine_host_us, 2).c_str(),
           jnum(r.gbps(r.dispatch_us), 2).c_str(),
           jnum(r.gbps(r.combine_us), 2).c_str(), jnum(r.gbps(r.copy_us), 2).c_str(),
           jnum(r.gbps(r.nccl_us), 2).c_str(), jnum(ratio(r.copy_us, r.dispatch_us), 3).c_str(),
           jnum(ratio(r.out_copy_us, r.dispatch_us), 3).c_str(),
           r.shared_gpu ? "true" : "false", r.comparable ? "true" : "false", r.hierarchical ? "true" : "false");
  return b;
}

std::string notes_of(const MoeRow& r) {
  std::string n;
  if (r.experts != r.experts_preset)
    n += "  (experts " + std::to_string(r.experts_preset) + " -> " + std::to_string(r.experts) + ": a multiple of W)";
  if (r.tokens_scaled)
    n += "  (tokens " + std::to_string(r.tokens_preset) + " -> " + std::to_string(r.tokens) + ": ranks share a GPU)";
  if (r.hierarchical) n += "  (hierarchical: node records through the twins)";
  if (r.shared_gpu) n += "  (times not comparable across GPUs)";
  return n;
}

}  // namespace

std::vector<std::string> moe_presets() {
  std::vector<std::string> v;
  for (const Preset& p : kPresets) v.push_back(p.name);
  return v;
}

int moe_dispatch(const Env& env, const MoeBenchArgs& a) {
  Communicator* comm = env.comm;
  const int W = comm->world(), me = comm->rank(), nodes = comm->topology().num_nodes;
  const bool shared = !env.own_gpu;
  // Fresh inputs every run, the same on every rank (rank 0's seed); printed to reproduce one.
  uint64_t seed = 0;
  if (me == 0) seed = mix(uint64_t(std::chrono::system_clock::now().time_since_epoch().count()));
  const Status bs = comm->bootstrap().broadcast(&seed, sizeof(seed), 0);
  if (!bs.ok()) {
    fprintf(stderr, "bench moe_dispatch: rank %d: broadcasting the seed: %s\n", me, bs.to_string().c_str());
    return 1;
  }
  std::vector<const Preset*> chosen;
  if (a.presets.empty())
    for (const Preset& p : kPresets) chosen.push_back(&p);
  for (const std::string& name : a.presets)
    for (const Preset& p : kPresets)
      if (name == p.name && std::find(chosen.begin(), chosen.end(), &p) == chosen.end()) chosen.push_back(&p);
  if (me == 0) {
    printf("moe_dispatch: bf16, expert_align 1, %d rank(s), %d node(s), seed 0x%016llx; %s\n", W, nodes,
           (unsigned long long)seed,
           env.comparable ? "one GPU per rank: vs a device copy of the same bytes and NCCL all-to-all-v + permute"
           : shared ? "ranks share a GPU: tokens scaled down, times not comparable across GPUs; no NCCL baseline"
                    : "no NCCL: vs a device copy of the same bytes only");
    printf("GB/s: records rank 0 receives (one per source token and destination rank) x H x 2 / time "
           "(DeepEP's convention; combine counted with the same bytes); vs_copy = copy_us / dispatch_us; "
           "vs_out = (device copy of the expert-major rows in use) / dispatch_us; host_us: rank 0's time to "
           "enqueue one dispatch / combine (past the device time, the GPU waits for the host)\n");
    printf("%-10s %3s %6s %5s %4s %2s  %-6s %9s %9s %9s %9s %9s %9s %7s %7s %11s\n", "preset", "W", "tokens", "H", "E",
           "k", "check", "disp_us", "comb_us", "copy_us", "nccl_us", "disp_GB/s", "comb_GB/s", "vs_copy", "vs_out",
           "host_us d/c");
  }
  std::vector<std::string> rows;
  std::vector<CheckLine> checks;
  bool failed = false;
  for (size_t i = 0; i < chosen.size(); ++i) {
    const Preset& p = *chosen[i];
    MoeRow r;
    r.preset = p.name;
    r.W = W, r.nodes = nodes;
    r.hidden = p.hidden, r.topk = p.topk;
    r.experts_preset = p.experts;
    r.experts = (p.experts + W - 1) / W * W;
    r.tokens_preset = p.tokens;
    r.tokens = a.tokens > 0 ? a.tokens
                            : shared ? std::min(p.tokens, std::max<int64_t>(1, kSharedTokens / W)) : p.tokens;
    r.tokens_scaled = r.tokens != p.tokens && a.tokens == 0;
    r.shared_gpu = shared;
    r.comparable = env.comparable;
    CheckLine c;
    c.label = "moe_dispatch " + r.preset + " tokens " + std::to_string(r.tokens) + " E " + std::to_string(r.experts) +
              " W " + std::to_string(W);
    Status s = bench_moe_one(comm, a.rc, mix(seed ^ uint64_t(i + 1)), &r);
    c.done = r.checked, c.ok = r.correct, c.bad = r.bad;
    if (!s.ok()) {
      c.error = s.to_string();
      note_failure(s);
      if (me == 0) fprintf(stderr, "bench moe_dispatch %s: %s\n", r.preset.c_str(), c.error.c_str());
    }
    checks.push_back(c);
    if (s.ok() && r.correct) {
      rows.push_back(moe_json(r));
      if (me == 0) {
        printf("%-10s %3d %6lld %5lld %4d %2d  %-6s %9s %9s %9s %9s %9s %9s %7s %7s %11s%s\n", r.preset.c_str(), W,
               (long long)r.tokens, (long long)r.hidden, r.experts, r.topk, "ok", cell(r.dispatch_us, 1).c_str(),
               cell(r.combine_us, 1).c_str(), cell(r.copy_us, 1).c_str(),
               r.nccl_us > 0 ? cell(r.nccl_us, 1).c_str() : "n/a", cell(r.gbps(r.dispatch_us), 1).c_str(),
               cell(r.gbps(r.combine_us), 1).c_str(), cell(ratio(r.copy_us, r.dispatch_us), 2).c_str(),
               cell(ratio(r.out_copy_us, r.dispatch_us), 2).c_str(),
               (cell(r.dispatch_host_us, 1) + "/" + cell(r.combine_host_us, 1)).c_str(), notes_of(r).c_str());
        fflush(stdout);
      }
    } else if (me == 0 && r.checked && !r.correct) {
      printf("%-10s %3d %6lld %5lld %4d %2d  %-6s (%llu mismatches)%s\n", r.preset.c_str(), W, (long long)r.tokens,
             (long long)r.hidden, r.experts, r.topk, "WRONG", r.bad, notes_of(r).c_str());
    }
    if (!s.ok() && communicator_failed(comm)) break;
  }
  if (me == 0 && !env.json.empty() && !write_json(env.json, W, nodes, env.comparable, rows)) failed = true;
  return summarize(comm, checks,
                   "exact: counts, offsets and recv_x rows against the CPU routing rules; combine bit-exact "
                   "against fp32 FMAs in slot order",
                   failed);
}

}  // namespace bench
}  // namespace mk
