// MoE dispatch/combine on the GPU through the public API (include/mkernel/ops/moe.h), every rank
// a process (MPS on one GPU), in the layouts ctest launches (one node, emulated nodes over
// libfabric shm/tcp, staged).
//
// Dispatch: every received row equals the sent row bit for bit (rows are hash-tagged by source
// rank, token and column, so a row in the wrong place cannot pass), at the row the layout rules
// put it (src/ops/moe/moe_plan.h, computed on the host from every rank's routing); counts and
// offsets exact. Outputs are poisoned first. Combine: experts scale their rows by a per-expert
// factor (on the host), and each token's output must equal, bit for bit, bf16 of the fp32 fused
// multiply-adds of weight x expert output in slot order — computed from the token's own routing,
// independently of the layout. Routings: uniform, Zipf-skewed, all-local, sparse (-1), empty
// ranks; token counts from the device; expert_align 1 and 8. Then 200 CUDA-graph replays with
// fresh routings and token counts, bad inputs (each named on the rank that made it), and a
// config mismatch.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/tunables.h"
#include "mkernel/ops/moe.h"
#include "src/ops/moe/moe_plan.h"
#include "tests/common/moe_routing.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(std::max<size_t>(b, 16)) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// The expert transform of the test, distinct for every global expert e (< 128): an affine map
// x * (1 + e / 128) + (e + 1) / 64 with one rounding (fma), then to bf16. Slot or expert mix-ups
// change the combined rows (with a transform shared by experts, as a scale by e % 5 was, experts
// e and e + 5 looked the same). The device copy below computes the same bits.
uint16_t expert_out(uint16_t x, int e) {
  return float_to_bf16(std::fma(bf16_to_float(x), 1.f + float(e) / 128.f, float(e + 1) / 64.f));
}
__device__ uint16_t expert_out_dev(uint16_t x, int e) {
  const float y = __fmaf_rn(__uint_as_float(uint32_t(x) << 16), 1.f + float(e) / 128.f, float(e + 1) / 64.f);
  const uint32_t u = __float_as_uint(y);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// The experts of rank `me` on the device: row r of local expert le (offsets[le] <= r <
// offsets[le] + counts[le]) becomes expert_out(row, me * El + le). Reads the counts and offsets
// dispatch wrote, so it can sit in a graph between dispatch and combine.
__global__ void run_test_experts(const uint16_t* recv, uint16_t* y, const int32_t* counts, const int32_t* offsets,
                                 int El, int me, int64_t H) {
  for (int le = 0; le < El; ++le) {
    const int64_t r0 = offsets[le], r1 = r0 + counts[le];
    for (int64_t r = r0 + blockIdx.x; r < r1; r += gridDim.x)
      for (int64_t c = threadIdx.x; c < H; c += blockDim.x) y[r * H + c] = expert_out_dev(recv[r * H + c], me * El + le);
  }
}

struct World {
  int W, me;
  ops::MoeGeometry g;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> w;
  std::vector<int64_t> n;
  std::vector<ops::SourceRoute> routes;
};

void make_world(const ops::MoeConfig& cfg, int W, int me, MoeRouting kind, uint64_t seed, World* out) {
  World& wd = *out;
  wd.W = W;
  wd.me = me;
  ASSERT_TRUE(ops::moe_geometry(cfg, W, &wd.g).ok());
  wd.ids.resize(W);
  wd.w.resize(W);
  wd.n.resize(W);
  wd.routes.resize(W);
  for (int r = 0; r < W; ++r) {
    make_moe_routing(kind, seed, r, W, cfg.num_experts, cfg.topk, cfg.max_tokens_per_rank, &wd.ids[r], &wd.w[r],
                     &wd.n[r]);
    ops::route_source(wd.g, wd.ids[r].data(), wd.n[r], &wd.routes[r], nullptr);
  }
}

// One dispatch + combine through the operator, checked. `tag` salts the data.
void run_and_check(Communicator* comm, ops::MoeEp* ep, const ops::MoeConfig& cfg, const World& wd, uint64_t seed,
                   const std::string& what) {
  const int me = wd.me;
  const ops::MoeGeometry& g = wd.g;
  const int64_t T = cfg.max_tokens_per_rank, H = cfg.hidden;
  const int k = cfg.topk;
  cudaStream_t st = comm->stream();
  std::vector<uint16_t> x(size_t(T) * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) x[size_t(t) * H + c] = moe_x_bits(seed, me, t, c);
  DevBuf dx(x.size() * 2), dids(size_t(T) * k * 4), dw(size_t(T) * k * 4), dn(4);
  DevBuf drecv(size_t(g.recv_rows) * H * 2), dcounts(4 * size_t(g.El)), doff(4 * size_t(g.El + 1));
  DevBuf dy(size_t(g.recv_rows) * H * 2), dout(size_t(T) * H * 2);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dids.p, wd.ids[me].data(), size_t(T) * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.p, wd.w[me].data(), size_t(T) * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const int32_t n32 = int32_t(wd.n[me]);
  ASSERT_EQ(cudaMemcpy(dn.p, &n32, 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(drecv.p, 0xff, drecv.bytes), cudaSuccess);  // NaN poison
  ASSERT_EQ(cudaMemset(dcounts.p, 0xff, dcounts.bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(doff.p, 0xff, doff.bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(dout.p, 0xff, dout.bytes), cudaSuccess);
  // The uploads ran on the legacy stream (a pageable cudaMemcpy may return before its copy lands,
  // cudaMemset is asynchronous); the operator runs on the communicator's stream.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ops::MoeDispatchArgs a{dx.p, dids.as<int32_t>(), dw.as<float>(), dn.as<int32_t>(), T};
  MK_ASSERT_OK(ep->dispatch(a, {drecv.p, dcounts.as<int32_t>(), doff.as<int32_t>()}, st));
  MK_ASSERT_OK(comm->sync(st));
  MK_ASSERT_OK(ep->check());

  // ---- the layout and every row ----
  std::vector<const int32_t*> idp(wd.W);
  for (int r = 0; r < wd.W; ++r) idp[r] = wd.ids[r].data();
  ops::DestLayout L;
  ops::dest_layout(g, me, idp, wd.n, wd.routes, &L);
  std::vector<int32_t> counts(g.El), offsets(g.El + 1);
  ASSERT_EQ(cudaMemcpy(counts.data(), dcounts.p, 4 * size_t(g.El), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(offsets.data(), doff.p, 4 * size_t(g.El + 1), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(counts, L.counts) << what;
  EXPECT_EQ(offsets, L.offsets) << what;
  const int64_t rows = L.offsets[g.El];
  ASSERT_LE(rows, g.recv_rows);
  std::vector<uint16_t> recv(size_t(g.recv_rows) * H);
  ASSERT_EQ(cudaMemcpy(recv.data(), drecv.p, recv.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int64_t bad = 0, checked = 0;
  for (int64_t row = 0; row < rows; ++row) {
    const ops::RowOrigin o = L.rows[size_t(row)];
    if (o.src < 0) continue;
    ++checked;
    for (int64_t c = 0; c < H; ++c)
      if (recv[size_t(row) * H + c] != moe_x_bits(seed, o.src, o.token, c)) {
        if (bad++ < 5)
          ADD_FAILURE() << what << " rank " << me << " row " << row << " (from rank " << o.src << " token " << o.token
                        << " slot " << o.slot << ") col " << c << ": got " << recv[size_t(row) * H + c] << " want "
                        << moe_x_bits(seed, o.src, o.token, c);
        break;
      }
  }
  EXPECT_EQ(bad, 0) << what << " rank " << me << ": " << bad << " of " << checked << " rows wrong";
  int64_t expected_rows = 0;
  for (int le = 0; le < g.El; ++le) expected_rows += L.counts[le];
  EXPECT_EQ(checked, expected_rows);

  // ---- combine: experts scale their rows ----
  std::vector<uint16_t> y(recv.size(), 0xffff);
  for (int le = 0; le < g.El; ++le)
    for (int64_t row = offsets[le]; row < offsets[le] + counts[le]; ++row)
      for (int64_t c = 0; c < H; ++c)
        y[size_t(row) * H + c] = expert_out(recv[size_t(row) * H + c], me * g.El + le);
  ASSERT_EQ(cudaMemcpy(dy.p, y.data(), y.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  MK_ASSERT_OK(ep->combine({dy.p}, dout.p, st));
  MK_ASSERT_OK(comm->sync(st));
  MK_ASSERT_OK(ep->check());
  std::vector<uint16_t> out(size_t(T) * H);
  ASSERT_EQ(cudaMemcpy(out.data(), dout.p, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  int64_t cbad = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      uint16_t want = 0xffff;  // rows past the call's tokens keep the poison
      if (t < wd.n[me]) {
        float acc = 0.f;
        for (int kk = 0; kk < k; ++kk) {
          const int32_t e = wd.ids[me][size_t(t) * k + kk];
          if (e < 0) continue;
          acc = std::fma(wd.w[me][size_t(t) * k + kk], bf16_to_float(expert_out(x[size_t(t) * H + c], e)), acc);
        }
        want = float_to_bf16(acc);
      }
      const uint16_t got = out[size_t(t) * H + c];
      if (got != want && cbad++ < 5)
        ADD_FAILURE() << what << " rank " << me << " combine token " << t << " col " << c << ": got " << got
                      << " want " << want;
    }
  EXPECT_EQ(cbad, 0) << what << " rank " << me << ": combine elements wrong";
}

struct Case {
  int64_t H;
  int experts_per_rank, k;
  int64_t T;
  int align;
};

TEST(Moe, DispatchCombineEveryRouting) {
  Communicator* comm = shared_comm();
  const int W = comm->world(), me = comm->rank();
  // T 300 is past the small-batch bound (moe_small_tokens, 256 by default): the six-launch path;
  // the others run on the small-batch path and, with the bound at 0, on the six-launch one. At
  // W = 1 rows go straight to their experts' rows (moe_local_dispatch 1: one launch for small
  // batches; 2: route + scan + scatter past the bound), and every case also runs on the record
  // paths. Each distinct path once per case.
  const Case cases[] = {{256, 4, 4, 77, 1}, {512, 3, 2, 130, 8}, {128, 8, 6, 33, 1}, {128, 5, 3, 300, 4}};
  const Topology& topo = comm->topology();
  int ci = 0;
  struct Path {
    const char *small, *direct;
  };
  for (const Case& c : cases) {
    std::set<std::string> ran;
    for (const Path path : {Path{"256", "1"}, Path{"256", "0"}, Path{"256", "2"}, Path{"0", "2"}, Path{"0", "0"}})
    for (ops::MoeMode mode : {ops::MoeMode::kLowLatency, ops::MoeMode::kThroughput}) {
      const std::string small = path.small, direct = path.direct;
      const bool is_small = c.T <= std::stoll(small);
      const std::string path_kind = W > 1      ? (is_small ? "small" : "six")
                                    : is_small ? (direct != "0" ? "one launch" : "small")
                                               : (direct == "2" ? "scatter" : "six");
      if (mode == ops::MoeMode::kLowLatency && !ran.insert(path_kind).second) break;  // that path ran already
      MK_ASSERT_OK(tunables::set("moe_small_tokens", small));
      MK_ASSERT_OK(tunables::set("moe_local_dispatch", direct));
      ops::MoeConfig cfg;
      cfg.hidden = c.H;
      cfg.num_experts = c.experts_per_rank * W;
      cfg.topk = c.k;
      cfg.max_tokens_per_rank = c.T;
      cfg.expert_align = c.align;
      std::unique_ptr<ops::MoeEp> ep;
      ops::MoeOptions opt;
      opt.mode = mode;
      MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, opt, &ep));
      MK_ASSERT_OK(tunables::reset("moe_small_tokens"));
      MK_ASSERT_OK(tunables::reset("moe_local_dispatch"));
      EXPECT_EQ(ep->hierarchical(), mode == ops::MoeMode::kThroughput && topo.num_nodes > 1 && topo.local_size > 1);
      for (MoeRouting kind : {MoeRouting::kUniform, MoeRouting::kZipf, MoeRouting::kLocal, MoeRouting::kSparse,
                              MoeRouting::kEmptyRanks}) {
        const uint64_t seed = mix(test_seed(), uint64_t(ci) * 16 + uint64_t(kind));
        World wd;
        make_world(cfg, W, me, kind, seed, &wd);
        const std::string what = "case " + std::to_string(&c - cases) + (ep->hierarchical() ? " hierarchical " : " ") +
                                 "small_tokens " + small + " direct_rows " + direct + " (" + path_kind + ") " +
                                 moe_routing_name(kind);
        run_and_check(comm, ep.get(), cfg, wd, seed, what);
        if (HasFailure()) break;
      }
      MK_EXPECT_OK(ep->destroy());
      ++ci;
      if (HasFailure()) break;
    }
    if (HasFailure()) break;
  }
}

// Two dispatches in flight before their combines (micro-batches), each routing in its own
// handle (one in the caller's memory, its weights given to the combine instead of the dispatch);
// combines in the opposite order. Each output must equal its own routing's reference.
TEST(Moe, TwoHandlesInFlight) {
  Communicator* comm = shared_comm();
  const int W = comm->world(), me = comm->rank();
  ops::MoeConfig cfg{256, 3 * W, 3, 40, 1, 0};
  const int64_t T = cfg.max_tokens_per_rank, H = cfg.hidden;
  const int k = cfg.topk;
  for (ops::MoeMode mode : {ops::MoeMode::kLowLatency, ops::MoeMode::kThroughput}) {
    ops::MoeOptions opt;
    opt.mode = mode;
    std::unique_ptr<ops::MoeEp> ep;
    MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, opt, &ep));
    // Handle 0 owns its memory; handle 1's routing lives in this test's memory (as the torch ops
    // keep it), dispatched with no weights and combined through a second handle over the same
    // memory (holds_routing) with the weights given to the combine.
    std::unique_ptr<ops::MoeHandle> h[2], h1_again;
    MK_ASSERT_OK(ep->create_handle(&h[0]));
    DevBuf hmem(ep->handle_bytes());
    ASSERT_EQ(cudaMemset(hmem.p, 0, hmem.bytes), cudaSuccess);
    std::unique_ptr<ops::MoeHandle> refused;
    EXPECT_EQ(ep->create_handle(hmem.p, ep->handle_bytes() - 1, false, &refused).code(), Code::kInvalidArgument);
    EXPECT_EQ(ep->create_handle(hmem.as<char>() + 4, ep->handle_bytes(), false, &refused).code(),
              Code::kInvalidArgument);
    MK_ASSERT_OK(ep->create_handle(hmem.p, hmem.bytes, false, &h[1]));
    MK_ASSERT_OK(ep->create_handle(hmem.p, hmem.bytes, true, &h1_again));
    cudaStream_t st = comm->stream();
    // A handle nobody dispatched into has no routes.
    EXPECT_EQ(ep->combine({nullptr}, nullptr, st, h[0].get()).code(), Code::kInvalidArgument);
    World wd[2];
    uint64_t seed[2];
    std::vector<uint16_t> x[2];
    std::unique_ptr<DevBuf> dx[2], dids[2], dw[2], dn[2], drecv[2], dcounts[2], doff[2], dy[2], dout[2];
    for (int b = 0; b < 2; ++b) {
      seed[b] = mix(test_seed(), 0x68616e64ull + 10 * uint64_t(mode) + uint64_t(b));
      make_world(cfg, W, me, b == 0 ? MoeRouting::kUniform : MoeRouting::kZipf, seed[b], &wd[b]);
      x[b].resize(size_t(T) * H);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < H; ++c) x[b][size_t(t) * H + c] = moe_x_bits(seed[b], me, t, c);
      dx[b].reset(new DevBuf(x[b].size() * 2));
      dids[b].reset(new DevBuf(size_t(T) * k * 4));
      dw[b].reset(new DevBuf(size_t(T) * k * 4));
      dn[b].reset(new DevBuf(4));
      drecv[b].reset(new DevBuf(size_t(ep->recv_rows()) * H * 2));
      dcounts[b].reset(new DevBuf(4 * size_t(ep->local_experts())));
      doff[b].reset(new DevBuf(4 * size_t(ep->local_experts() + 1)));
      dy[b].reset(new DevBuf(size_t(ep->recv_rows()) * H * 2));
      dout[b].reset(new DevBuf(size_t(T) * H * 2));
      const int32_t n32 = int32_t(wd[b].n[me]);
      ASSERT_EQ(cudaMemcpy(dx[b]->p, x[b].data(), x[b].size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dids[b]->p, wd[b].ids[me].data(), size_t(T) * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dw[b]->p, wd[b].w[me].data(), size_t(T) * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dn[b]->p, &n32, 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(dout[b]->p, 0xff, dout[b]->bytes), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int b = 0; b < 2; ++b)
      MK_ASSERT_OK(ep->dispatch({dx[b]->p, dids[b]->as<int32_t>(), b == 0 ? dw[b]->as<float>() : nullptr,
                                 dn[b]->as<int32_t>(), T},
                                {drecv[b]->p, dcounts[b]->as<int32_t>(), doff[b]->as<int32_t>()}, st, h[b].get()));
    MK_ASSERT_OK(comm->sync(st));
    // The experts: scale each row (on the host), per dispatch.
    const int El = ep->local_experts();
    for (int b = 0; b < 2; ++b) {
      std::vector<int32_t> counts(El), offsets(El + 1);
      std::vector<uint16_t> recv(size_t(ep->recv_rows()) * H), y(recv.size(), 0xffff);
      ASSERT_EQ(cudaMemcpy(counts.data(), dcounts[b]->p, 4 * size_t(El), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(offsets.data(), doff[b]->p, 4 * size_t(El + 1), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(recv.data(), drecv[b]->p, recv.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int le = 0; le < El; ++le)
        for (int64_t row = offsets[le]; row < offsets[le] + counts[le]; ++row)
          for (int64_t c = 0; c < H; ++c)
            y[size_t(row) * H + c] = expert_out(recv[size_t(row) * H + c], me * El + le);
      ASSERT_EQ(cudaMemcpy(dy[b]->p, y.data(), y.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    MK_ASSERT_OK(ep->combine({dy[1]->p, dw[1]->as<float>()}, dout[1]->p, st, h1_again.get()));
    MK_ASSERT_OK(ep->combine({dy[0]->p}, dout[0]->p, st, h[0].get()));
    MK_ASSERT_OK(comm->sync(st));
    MK_ASSERT_OK(ep->check());
    for (int b = 0; b < 2; ++b) {
      std::vector<uint16_t> out(size_t(T) * H);
      ASSERT_EQ(cudaMemcpy(out.data(), dout[b]->p, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      int64_t bad = 0;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < H; ++c) {
          uint16_t want = 0xffff;
          if (t < wd[b].n[me]) {
            float acc = 0.f;
            for (int kk = 0; kk < k; ++kk) {
              const int32_t e = wd[b].ids[me][size_t(t) * k + kk];
              if (e >= 0)
                acc = std::fma(wd[b].w[me][size_t(t) * k + kk], bf16_to_float(expert_out(x[b][size_t(t) * H + c], e)),
                               acc);
            }
            want = float_to_bf16(acc);
          }
          if (out[size_t(t) * H + c] != want && bad++ < 3)
            ADD_FAILURE() << "handle " << b << (ep->hierarchical() ? " (hierarchical)" : "") << " rank " << me
                          << " token " << t << " col " << c << ": got " << out[size_t(t) * H + c] << " want " << want;
        }
      EXPECT_EQ(bad, 0) << "handle " << b;
    }
    // A handle of another operator is refused.
    std::unique_ptr<ops::MoeEp> other;
    MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, opt, &other));
    EXPECT_EQ(other->combine({dy[0]->p}, dout[0]->p, st, h[0].get()).code(), Code::kInvalidArgument);
    MK_EXPECT_OK(other->destroy());
    MK_EXPECT_OK(ep->destroy());
  }
}

// One graph (dispatch, the test's experts — a distinct transform per expert, on the device —
// then combine) replayed with new routings and token counts written into the same device
// buffers between replays: a token's slots hold different rows, so slot and expert mix-ups show.
TEST(Moe, GraphReplaysWithFreshRoutings) {
  Communicator* comm = shared_comm();
  const int W = comm->world(), me = comm->rank();
  ops::MoeConfig cfg;
  cfg.hidden = 128;
  cfg.num_experts = 4 * W;
  cfg.topk = 3;
  cfg.max_tokens_per_rank = 48;
  std::unique_ptr<ops::MoeEp> ep;
  ops::MoeOptions opt;
  opt.mode = ops::MoeMode::kThroughput;  // hierarchical across nodes (the same as direct on one)
  MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, opt, &ep));
  const int64_t T = cfg.max_tokens_per_rank, H = cfg.hidden;
  const int k = cfg.topk;
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  const uint64_t seed = mix(test_seed(), 0x67726170ull);
  std::vector<uint16_t> x(size_t(T) * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) x[size_t(t) * H + c] = moe_x_bits(seed, me, t, c);
  DevBuf dx(x.size() * 2), dids(size_t(T) * k * 4), dw(size_t(T) * k * 4), dn(4);
  const int El = ep->local_experts();
  DevBuf drecv(size_t(ep->recv_rows()) * H * 2), dcounts(4 * size_t(El)), doff(4 * size_t(El + 1));
  DevBuf dy(size_t(ep->recv_rows()) * H * 2), dout(size_t(T) * H * 2);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dids.p, 0xff, dids.bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(dn.p, 0, 4), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  MK_ASSERT_OK(ep->dispatch({dx.p, dids.as<int32_t>(), dw.as<float>(), dn.as<int32_t>(), T},
                            {drecv.p, dcounts.as<int32_t>(), doff.as<int32_t>()}, st));
  run_test_experts<<<64, 128, 0, st>>>(drecv.as<uint16_t>(), dy.as<uint16_t>(), dcounts.as<int32_t>(),
                                       doff.as<int32_t>(), El, me, H);
  MK_ASSERT_OK(ep->combine({dy.p}, dout.p, st));
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const int kReplays = 200;
  std::vector<uint16_t> out(size_t(T) * H);
  int64_t bad = 0;
  for (int rep = 0; rep < kReplays && bad == 0; ++rep) {
    std::vector<int32_t> ids;
    std::vector<float> w;
    int64_t n;
    const MoeRouting kind = MoeRouting(rep % 6);  // every kind, full ones included
    make_moe_routing(kind, mix(seed, uint64_t(rep)), me, W, cfg.num_experts, k, T, &ids, &w, &n);
    n = (n + rep) % (T + 1);
    const int32_t n32 = int32_t(n);
    ASSERT_EQ(cudaMemcpyAsync(dids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, st), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice, st), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(dn.p, &n32, 4, cudaMemcpyHostToDevice, st), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(dout.p, 0xff, dout.bytes, st), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(out.data(), dout.p, out.size() * 2, cudaMemcpyDeviceToHost, st), cudaSuccess);
    MK_ASSERT_OK(comm->sync(st));
    MK_ASSERT_OK(ep->check());
    for (int64_t t = 0; t < T && bad < 5; ++t)
      for (int64_t c = 0; c < H; ++c) {
        uint16_t want = 0xffff;
        if (t < n) {
          float acc = 0.f;
          for (int kk = 0; kk < k; ++kk) {
            const int32_t e = ids[size_t(t) * k + kk];
            if (e >= 0) acc = std::fma(w[size_t(t) * k + kk], bf16_to_float(expert_out(x[size_t(t) * H + c], e)), acc);
          }
          want = float_to_bf16(acc);
        }
        if (out[size_t(t) * H + c] != want) {
          ADD_FAILURE() << "replay " << rep << " (" << moe_routing_name(kind) << ", " << n << " tokens) rank " << me
                        << " token " << t << " col " << c << ": got " << out[size_t(t) * H + c] << " want " << want;
          ++bad;
          break;
        }
      }
  }
  EXPECT_EQ(bad, 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  MK_EXPECT_OK(ep->destroy());
}

// One rank's buffers for the bad-input tests: x (constant), a uniform routing of `seed` spoiled
// by `spoil` (ids, and the device token count), uploaded; the receive side sized for `ep`.
struct SpoiledCall {
  int64_t T, H;
  DevBuf dx, dids, dw, dn, drecv, dcounts, dout;
  SpoiledCall(const ops::MoeEp& ep, const ops::MoeConfig& cfg, uint64_t seed, int me, int W,
              const std::function<void(std::vector<int32_t>&, int32_t&, int)>& spoil)
      : T(cfg.max_tokens_per_rank), H(cfg.hidden), dx(size_t(T) * H * 2), dids(size_t(T) * cfg.topk * 4),
        dw(size_t(T) * cfg.topk * 4), dn(4), drecv(size_t(ep.recv_rows()) * H * 2),
        dcounts(4 * size_t(ep.local_experts())), dout(size_t(T) * H * 2) {
    std::vector<int32_t> ids;
    std::vector<float> w;
    int64_t n;
    make_moe_routing(MoeRouting::kUniform, seed, me, W, cfg.num_experts, cfg.topk, T, &ids, &w, &n);
    int32_t n32 = int32_t(T);
    spoil(ids, n32, me);
    EXPECT_EQ(cudaMemset(dx.p, 0x3c, dx.bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(dids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(dn.p, &n32, 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ops::MoeDispatchArgs args() const { return {dx.p, dids.as<int32_t>(), dw.as<float>(), dn.as<int32_t>(), T}; }
  ops::MoeDispatchOut out() const { return {drecv.p, dcounts.as<int32_t>(), nullptr}; }
};

// Bad input on one rank: the call still completes everywhere (no hang), the rank that made it
// names it in check(), and refuses later calls.
void bad_input_case(const char* what, ops::MoeConfig cfg, int bad_rank,
                    const std::function<void(std::vector<int32_t>&, int32_t&, int)>& spoil, Code code,
                    const std::vector<std::string>& words) {
  Communicator* comm = shared_comm();
  const int W = comm->world(), me = comm->rank();
  std::unique_ptr<ops::MoeEp> ep;
  MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, {}, &ep));
  SpoiledCall call(*ep, cfg, mix(test_seed(), 0xbad), me, W, spoil);
  MK_ASSERT_OK(ep->dispatch(call.args(), call.out(), comm->stream()));
  MK_ASSERT_OK(comm->sync(comm->stream()));
  // An overflow is met by the receiving ranks: every rank may report it.
  const Status s = ep->check();
  if (me == bad_rank) {
    EXPECT_EQ(s.code(), code) << what << ": " << s.to_string();
    for (const auto& wd : words) EXPECT_NE(s.message().find(wd), std::string::npos) << what << ": " << s.to_string();
    printf("rank %d %s: %s\n", me, what, s.to_string().c_str());
    // Refused from now on, with the same message.
    const Status again = ep->dispatch(call.args(), call.out(), comm->stream());
    EXPECT_EQ(again.code(), code) << again.to_string();
  } else if (code != Code::kOutOfMemory) {
    MK_EXPECT_OK(s);
  }
  MK_ASSERT_OK(comm->bootstrap().barrier());
  MK_EXPECT_OK(ep->destroy());
}

TEST(Moe, BadExpertIdIsNamed) {
  const int W = shared_comm()->world();
  ops::MoeConfig cfg{128, 2 * W, 2, 16, 1, 0};
  const int bad = W - 1;
  bad_input_case("bad id", cfg, bad,
                 [&](std::vector<int32_t>& ids, int32_t&, int me) {
                   if (me == bad) ids[5 * 2 + 1] = 2 * W + 3;
                 },
                 Code::kInvalidArgument, {"rank " + std::to_string(bad), "token 5", "expert " + std::to_string(2 * W + 3)});
}

// A combine after the dispatch that recorded a bad input runs on every rank — here with the
// stream synchronized in between, so the device's record is already visible to the host when the
// combine is called: the refusal follows check(), which nobody asked yet. (A refusal taken from
// the record would refuse this combine on the bad rank while the others wait in theirs: the
// others' syncs would time out.) Once check() reported it, the bad rank's calls are refused.
TEST(Moe, CombineAfterABadDispatchRunsOnEveryRank) {
  Communicator* comm = shared_comm();
  const int W = comm->world(), me = comm->rank();
  const ops::MoeConfig cfg{128, 2 * W, 2, 16, 1, 0};
  const int bad = W - 1;
  std::unique_ptr<ops::MoeEp> ep;
  MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, {}, &ep));
  SpoiledCall call(*ep, cfg, mix(test_seed(), 0xbad2), me, W, [&](std::vector<int32_t>& ids, int32_t&, int r) {
    if (r == bad) ids[3 * 2] = 2 * W + 5;
  });
  MK_ASSERT_OK(ep->dispatch(call.args(), call.out(), comm->stream()));
  MK_ASSERT_OK(comm->sync(comm->stream()));
  // The record is on the host now (bad rank); the combine still runs, on every rank.
  const Status c = ep->combine({call.drecv.p}, call.dout.p, comm->stream());
  EXPECT_TRUE(c.ok()) << "rank " << me << ": " << c.to_string();
  const Status s = comm->sync(comm->stream());
  EXPECT_TRUE(s.ok()) << "rank " << me << ": " << s.to_string();
  ASSERT_TRUE(c.ok() && s.ok());
  const Status chk = ep->check();
  if (me == bad) {
    EXPECT_EQ(chk.code(), Code::kInvalidArgument) << chk.to_string();
    EXPECT_NE(chk.message().find("expert " + std::to_string(2 * W + 5)), std::string::npos) << chk.to_string();
    // Reported: refused from now on (only this rank calls: no peer waits for it).
    EXPECT_EQ(ep->combine({call.drecv.p}, call.dout.p, comm->stream()).code(), Code::kInvalidArgument);
  } else {
    MK_EXPECT_OK(chk);
  }
  MK_ASSERT_OK(comm->bootstrap().barrier());
  MK_EXPECT_OK(ep->destroy());
}

TEST(Moe, TooManyTokensIsNamed) {
  const int W = shared_comm()->world();
  ops::MoeConfig cfg{128, 2 * W, 2, 16, 1, 0};
  bad_input_case("too many tokens", cfg, 0,
                 [&](std::vector<int32_t>&, int32_t& n, int me) {
                   if (me == 0) n = 17;
                 },
                 Code::kInvalidArgument, {"rank 0", "17", "16"});
}

TEST(Moe, CapacityOverflowIsNamed) {
  const int W = shared_comm()->world();
  // Every token of every rank to expert 0 (rank 0): 16 * W rows, capacity 10.
  ops::MoeConfig cfg{128, 2 * W, 1, 16, 1, 10};
  bad_input_case("overflow", cfg, 0, [&](std::vector<int32_t>& ids, int32_t&, int) { ids.assign(ids.size(), 0); },
                 Code::kOutOfMemory, {"rank 0", "capacity 10", "local expert 0"});
}

TEST(Moe, HostChecks) {
  Communicator* comm = shared_comm();
  const int W = comm->world();
  ops::MoeConfig cfg{128, 2 * W, 2, 16, 1, 0};
  std::unique_ptr<ops::MoeEp> ep;
  MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, {}, &ep));
  DevBuf b(1 << 20);
  char* p = b.as<char>();
  const ops::MoeDispatchOut o{p, reinterpret_cast<int32_t*>(p + 4096), nullptr};
  EXPECT_EQ(ep->dispatch({nullptr, reinterpret_cast<int32_t*>(p), reinterpret_cast<float*>(p), nullptr, 16}, o,
                         comm->stream()).code(), Code::kInvalidArgument);
  EXPECT_EQ(ep->dispatch({p + 2, reinterpret_cast<int32_t*>(p), reinterpret_cast<float*>(p), nullptr, 16}, o,
                         comm->stream()).code(), Code::kInvalidArgument);
  EXPECT_EQ(ep->dispatch({p, reinterpret_cast<int32_t*>(p), reinterpret_cast<float*>(p), nullptr, 17}, o,
                         comm->stream()).code(), Code::kInvalidArgument);
  EXPECT_EQ(ep->combine({p}, p, comm->stream()).code(), Code::kInvalidArgument);  // no dispatch yet
  // The same checks without a call (can_implement), and the enqueue path checks them too.
  const ops::MoeDispatchArgs good{p, reinterpret_cast<int32_t*>(p), reinterpret_cast<float*>(p), nullptr, 16};
  MK_EXPECT_OK(ep->can_implement(good, o));
  EXPECT_EQ(ep->can_implement({p + 2, good.topk_ids, good.topk_weights, nullptr, 16}, o).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(ep->dispatch_enqueue({nullptr, good.topk_ids, good.topk_weights, nullptr, 16}, o, comm->stream()).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(ep->can_implement(ops::MoeCombineArgs{p}, p).code(), Code::kInvalidArgument);  // no dispatch yet
  EXPECT_EQ(ep->combine_enqueue({p}, p, comm->stream()).code(), Code::kInvalidArgument);
  MK_EXPECT_OK(ep->destroy());
  // With the debug agreement (check_calls, read at create) a bad argument on one rank is the
  // same error on every rank, before any rank launches.
  if (W > 1) {
    MK_ASSERT_OK(tunables::set("check_calls", "1"));
    std::unique_ptr<ops::MoeEp> checked;
    const Status cs = ops::MoeEp::create(comm, cfg, {}, &checked);
    MK_ASSERT_OK(tunables::reset("check_calls"));
    MK_ASSERT_OK(cs);
    ops::MoeDispatchArgs mine = good;
    if (comm->rank() == W - 1) mine.x = nullptr;
    const Status s = checked->dispatch(mine, o, comm->stream());
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("failed on rank(s) " + std::to_string(W - 1)), std::string::npos) << s.to_string();
    MK_EXPECT_OK(checked->destroy());
  }
  // Geometry the operator cannot take.
  ops::MoeConfig odd = cfg;
  odd.num_experts = 2 * W + (W > 1 ? 1 : 0);
  if (W > 1) EXPECT_EQ(ops::MoeEp::create(comm, odd, {}, &ep).code(), Code::kInvalidArgument);
  odd = cfg;
  odd.hidden = 100;
  EXPECT_EQ(ops::MoeEp::create(comm, odd, {}, &ep).code(), Code::kInvalidArgument);
  odd = cfg;
  odd.dtype = gemm::DType::kF16;  // bf16 only
  EXPECT_EQ(ops::MoeEp::create(comm, odd, {}, &ep).code(), Code::kNotSupported);
}

TEST(Moe, ConfigMismatchIsAnErrorOnEveryRank) {
  Communicator* comm = shared_comm();
  const int W = comm->world();
  if (W < 2) GTEST_SKIP() << "needs 2 ranks";
  ops::MoeConfig cfg{128, 2 * W, 2, 16, 1, 0};
  if (comm->rank() == W - 1) cfg.topk = 1;
  std::unique_ptr<ops::MoeEp> ep;
  const Status s = ops::MoeEp::create(comm, cfg, {}, &ep);
  EXPECT_EQ(s.code(), Code::kMismatch) << s.to_string();
  EXPECT_NE(s.message().find("rank " + std::to_string(W - 1)), std::string::npos) << s.to_string();
}

// Run alone, with a short MK_SIGNAL_TIMEOUT_MS (ctest: test_gpu_moe_dead): the last rank never
// calls; the others' call fails naming it.
TEST(MoeDeadRank, SilentRankIsNamed) {
  Communicator* comm = shared_comm();
  const int W = comm->world();
  if (W != 2) GTEST_SKIP() << "needs 2 ranks";
  ops::MoeConfig cfg{128, 2 * W, 2, 16, 1, 0};
  std::unique_ptr<ops::MoeEp> ep;
  MK_ASSERT_OK(ops::MoeEp::create(comm, cfg, {}, &ep));
  const int silent = W - 1;
  DevBuf b(1 << 20);
  char* p = b.as<char>();
  ASSERT_EQ(cudaMemset(p, 0, b.bytes), cudaSuccess);  // ids 0: every token to expert 0
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (comm->rank() != silent) {
    MK_ASSERT_OK(ep->dispatch({p + 65536, reinterpret_cast<int32_t*>(p), reinterpret_cast<float*>(p + 4096), nullptr, 16},
                              {p + 131072, reinterpret_cast<int32_t*>(p + 8192), nullptr}, comm->stream()));
    expect_silent_rank_named(comm, "moe_dispatch", silent);
  }
  expect_barrier_reports_failure(comm);
  MK_EXPECT_OK(ep->destroy());
}

}  // namespace
}  // namespace test
}  // namespace mk
