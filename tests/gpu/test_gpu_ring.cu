// Ring attention (ops/ring_attention.h) on ranks as processes under MPS: W = 1, 2, 4 on one node
// and 2 emulated nodes x 2 over libfabric (shm, tcp; host-staged).
//
// Data: every rank builds the whole sequence's Q, K, V from a hash of (call, tensor, batch, token,
// head, d) — fresh per call, so a block from the wrong rank or the wrong call is wrong data — and
// takes its shard (its chunks, in token order). Reference: the single-GPU attention kernel over
// the full sequence on the same GPU; the ring's O (poisoned with NaN before each call) must match
// the reference rows of this rank to bf16 rounding, its LSE to 1e-3, every element. The K/V slots
// must hold every other rank's shard bit for bit after the call.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <cmath>
#include <vector>

#include "mkernel/attention/attention.h"
#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "mkernel/ops/ring_attention.h"
#include "tests/common/test_util.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

using ops::RingAttention;
using ops::RingAttentionArgs;
using ops::RingAttentionShape;
using ops::SeqLayout;

__device__ inline float hval(uint64_t call, int which, uint64_t i) {
  uint64_t x = (call << 56) ^ (uint64_t(which) << 52) ^ i ^ 0x9e3779b97f4a7c15ull;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return float(x % 20001) / 10000.f - 1.f;  // [-1, 1]
}

// Full tensor [B, S, heads, D] of tensor `which`.
__global__ void fill_full(__nv_bfloat16* t, int64_t n, uint64_t call, int which, float amp) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    t[i] = __float2bfloat16(amp * hval(call, which, uint64_t(i)));
}
// dst[b, r, :] = src[b, tok0 + r, :] for r < len (rows of `row` elements), into rows [dst_row0, ...).
__global__ void take_rows(const __nv_bfloat16* src, __nv_bfloat16* dst, int B, int64_t S_src, int64_t S_dst,
                          int64_t tok0, int64_t dst_row0, int64_t len, int64_t row) {
  const int64_t n = int64_t(B) * len * row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i % row, r = (i / row) % len, b = i / (row * len);
    dst[(b * S_dst + dst_row0 + r) * row + e] = src[(b * S_src + tok0 + r) * row + e];
  }
}
// lse_dst[b, h, dst_row0 + r] = lse_src[b, h, tok0 + r]
__global__ void take_lse(const float* src, float* dst, int BH, int64_t S_src, int64_t S_dst, int64_t tok0,
                         int64_t dst_row0, int64_t len) {
  const int64_t n = int64_t(BH) * len;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i % len, bh = i / len;
    dst[bh * S_dst + dst_row0 + r] = src[bh * S_src + tok0 + r];
  }
}
__global__ void poison16(uint16_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 0x7fc1;
}
// Counts elements with |got - want| > atol + rtol |want| (NaN counts).
__global__ void close_bf16(const __nv_bfloat16* got, const __nv_bfloat16* want, int64_t n, float atol, float rtol,
                           unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(got[i]), w = __bfloat162float(want[i]);
    if (!(fabsf(g - w) <= atol + rtol * fabsf(w))) atomicAdd(bad, 1ull);
  }
}
__global__ void close_f32(const float* got, const float* want, int64_t n, float atol, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (!(fabsf(got[i] - want[i]) <= atol)) atomicAdd(bad, 1ull);
}
__global__ void equal16(const uint16_t* a, const uint16_t* b, int64_t n, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (a[i] != b[i]) atomicAdd(bad, 1ull);
}

struct Dev {
  std::vector<void*> p;
  template <class T>
  T* get(size_t n) {
    void* x = nullptr;
    EXPECT_EQ(cudaMalloc(&x, n * sizeof(T)), cudaSuccess);
    p.push_back(x);
    return static_cast<T*>(x);
  }
  ~Dev() {
    for (void* x : p) cudaFree(x);
  }
};

// Runs `calls` calls of the ring on fresh data and checks each against the full-sequence kernel.
// trace_name non-null: every call runs the traced kernel, and its timeline must show every work
// item computed once and every communication op run once (MK_TRACE_OUT=prefix writes the last
// call's as prefix.<trace_name>.<rank>.json).
void check_ring(const RingAttentionShape& s, int calls, bool graph = false, const char* trace_name = nullptr) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world(), me = comm->rank();
  std::unique_ptr<RingAttention> op;
  Status st = RingAttention::create(comm, s, ops::RingAttentionOptions{}, &op);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const int64_t S = s.S, S_l = S / W;
  const int64_t qrow = int64_t(s.H) * s.D, krow = int64_t(s.Hkv) * s.D;
  Dev d;
  auto* q = d.get<__nv_bfloat16>(size_t(s.B) * S * qrow);
  auto* k = d.get<__nv_bfloat16>(size_t(s.B) * S * krow);
  auto* v = d.get<__nv_bfloat16>(size_t(s.B) * S * krow);
  auto* o_full = d.get<__nv_bfloat16>(size_t(s.B) * S * qrow);
  auto* lse_full = d.get<float>(size_t(s.B) * s.H * S);
  auto* ql = d.get<__nv_bfloat16>(size_t(s.B) * S_l * qrow);
  auto* kl = d.get<__nv_bfloat16>(size_t(s.B) * S_l * krow);
  auto* vl = d.get<__nv_bfloat16>(size_t(s.B) * S_l * krow);
  auto* ol = d.get<__nv_bfloat16>(size_t(s.B) * S_l * qrow);
  auto* lsel = d.get<float>(size_t(s.B) * s.H * S_l);
  auto* o_want = d.get<__nv_bfloat16>(size_t(s.B) * S_l * qrow);
  auto* lse_want = d.get<float>(size_t(s.B) * s.H * S_l);
  auto* kr = d.get<__nv_bfloat16>(size_t(s.B) * S_l * krow);
  auto* bad = d.get<unsigned long long>(4);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto& chunks = op->plan().chunks;
  const float qamp = 2.0f;
  cudaGraphExec_t exec = nullptr;
  for (int call = 0; call < calls; ++call) {
    const uint64_t tag = uint64_t(call) + 1 + (s.causal ? 100 : 0) + (s.layout == SeqLayout::kZigzag ? 200 : 0);
    fill_full<<<1024, 256, 0, stream>>>(q, int64_t(s.B) * S * qrow, tag, 0, qamp);
    fill_full<<<1024, 256, 0, stream>>>(k, int64_t(s.B) * S * krow, tag, 1, 1.f);
    fill_full<<<1024, 256, 0, stream>>>(v, int64_t(s.B) * S * krow, tag, 2, 1.f);
    // This rank's shard and the reference rows.
    attention::ForwardArgs f;
    f.q = q, f.k = k, f.v = v, f.o = o_full, f.lse = lse_full;
    f.B = s.B, f.H = s.H, f.Hkv = s.Hkv, f.Sq = f.Skv = int(S), f.D = s.D, f.causal = s.causal;
    f.q_stride = f.o_stride = attention::Strides::bshd(S, s.H, s.D);
    f.k_stride = f.v_stride = attention::Strides::bshd(S, s.Hkv, s.D);
    st = attention::forward(f, stream);
    ASSERT_TRUE(st.ok()) << st.to_string();
    int64_t row0 = 0;
    for (const auto& c : chunks[me]) {
      take_rows<<<256, 256, 0, stream>>>(q, ql, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_rows<<<256, 256, 0, stream>>>(k, kl, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      take_rows<<<256, 256, 0, stream>>>(v, vl, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      take_rows<<<256, 256, 0, stream>>>(o_full, o_want, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_lse<<<256, 256, 0, stream>>>(lse_full, lse_want, s.B * s.H, S, S_l, c.token0, row0, c.tokens);
      row0 += c.tokens;
    }
    poison16<<<256, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(ol), int64_t(s.B) * S_l * qrow);
    cudaMemsetAsync(lsel, 0xff, size_t(s.B) * s.H * S_l * 4, stream);  // NaN
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    RingAttentionArgs a{ql, kl, vl, ol, lsel};
    TraceRecorder rec;
    if (trace_name) {
      const int n_items = op->work_items(), n_ops = op->comm_ops();
      ASSERT_GT(n_items, 0);
      MK_ASSERT_OK(TraceRecorder::create(uint32_t(64 * (n_items + n_ops) + 4096), &rec));
      a.trace = rec.device();
    }
    if (graph && call > 0) {
      if (!exec) {
        cudaGraph_t g;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        st = op->enqueue(a, stream);
        ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
        ASSERT_TRUE(st.ok()) << st.to_string();
        ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
        cudaGraphDestroy(g);
      }
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    } else {
      st = op->run(a, stream);
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    st = comm->sync(stream);
    ASSERT_TRUE(st.ok()) << "rank " << me << " call " << call << ": " << st.to_string();
    cudaMemset(bad, 0, 4 * sizeof(unsigned long long));
    close_bf16<<<1024, 256>>>(ol, o_want, int64_t(s.B) * S_l * qrow, 2e-3f, 1.6e-2f, bad);
    close_f32<<<1024, 256>>>(lsel, lse_want, int64_t(s.B) * s.H * S_l, 1e-3f, bad + 1);
    // Every other rank's K block passed through this rank's slot r.
    for (int r = 0; r < W; ++r) {
      if (r == me) continue;
      int64_t rr = 0;
      for (const auto& c : chunks[r]) {
        take_rows<<<256, 256>>>(k, kr, s.B, S, S_l, c.token0, rr, c.tokens, krow);
        rr += c.tokens;
      }
      equal16<<<256, 256>>>(static_cast<const uint16_t*>(op->k_slots()) + size_t(r) * s.B * S_l * krow,
                            reinterpret_cast<const uint16_t*>(kr), int64_t(s.B) * S_l * krow, bad + 2);
    }
    unsigned long long h[4] = {};
    ASSERT_EQ(cudaMemcpy(h, bad, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(h[0], 0ull) << "rank " << me << " call " << call << ": O elements off";
    EXPECT_EQ(h[1], 0ull) << "rank " << me << " call " << call << ": LSE elements off";
    EXPECT_EQ(h[2], 0ull) << "rank " << me << " call " << call << ": slot elements differ from the owners' K";
    if (trace_name) {
      std::vector<TraceEvent> ev;
      uint64_t dropped = 0;
      MK_ASSERT_OK(rec.fetch(&ev, &dropped));
      EXPECT_EQ(dropped, 0u);
      std::vector<int> computed(op->work_items(), 0), ran(op->comm_ops(), 0);
      int waits = 0;
      for (const auto& e : ev) {
        EXPECT_LE(e.t0_ns, e.t1_ns);
        if (e.role == uint32_t(Role::kCompute)) ++computed.at(e.item);
        else if (e.role == uint32_t(Role::kComm) || e.role == uint32_t(Role::kNetSend)) ++ran.at(e.item);
        else if (e.role == uint32_t(Role::kWait)) ++waits;
        else ADD_FAILURE() << "unexpected role " << e.role;
      }
      for (size_t i = 0; i < computed.size(); ++i) EXPECT_EQ(computed[i], 1) << "rank " << me << " item " << i;
      for (size_t i = 0; i < ran.size(); ++i) EXPECT_EQ(ran[i], 1) << "rank " << me << " op " << i;
      if (me == 0)
        printf("trace %s: %zu items, %zu ops, %d waits > 5 us on rank 0\n", trace_name, computed.size(), ran.size(),
               waits);
      const char* out = getenv("MK_TRACE_OUT");
      if (out && call + 1 == calls) {
        const std::string path = std::string(out) + "." + trace_name + "." + std::to_string(me) + ".json";
        MK_ASSERT_OK(write_chrome_trace(ev, path));
      }
    }
    ASSERT_TRUE(comm->bootstrap().barrier().ok());
  }
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  st = op->destroy();
  EXPECT_TRUE(st.ok()) << st.to_string();
}

TEST(Ring, ContiguousFullTails) {
  // 1000 tokens per rank: neither the tiles nor the forwarded pieces divide them.
  check_ring(RingAttentionShape{2, 8, 2, 128, int64_t(shared_comm()->world()) * 1000, SeqLayout::kContiguous, false}, 3);
}
TEST(Ring, ZigzagCausal) {
  check_ring(RingAttentionShape{1, 8, 8, 128, int64_t(shared_comm()->world()) * 2048, SeqLayout::kZigzag, true}, 3);
}
TEST(Ring, ContiguousCausalD64) {
  check_ring(RingAttentionShape{1, 16, 4, 64, int64_t(shared_comm()->world()) * 1536, SeqLayout::kContiguous, true}, 2);
}
TEST(Ring, ZigzagFullGraphReplays) {
  check_ring(RingAttentionShape{2, 8, 8, 64, int64_t(shared_comm()->world()) * 1000, SeqLayout::kZigzag, false}, 6, true);
}
TEST(Ring, TracedZigzagCausal) {
  check_ring(RingAttentionShape{1, 16, 16, 128, int64_t(shared_comm()->world()) * 4096, SeqLayout::kZigzag, true}, 2,
             false, "ring_zigzag_causal");
}
TEST(Ring, BadInputSameErrorEverywhere) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world();
  std::unique_ptr<RingAttention> op;
  // Shapes that differ between ranks.
  RingAttentionShape bad{1, 8, 8, 128, int64_t(W) * 256, SeqLayout::kContiguous, comm->rank() == W - 1 && W > 1};
  Status st = RingAttention::create(comm, bad, {}, &op);
  if (W > 1) {
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  }
  // A sequence that does not split.
  st = RingAttention::create(comm, RingAttentionShape{1, 8, 8, 128, int64_t(2 * W) + 1, SeqLayout::kZigzag, true}, {},
                             &op);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  // A null pointer on one rank: run() fails on every rank.
  st = RingAttention::create(comm, RingAttentionShape{1, 8, 8, 128, int64_t(W) * 256, SeqLayout::kContiguous, false},
                             {}, &op);
  ASSERT_TRUE(st.ok()) << st.to_string();
  Dev d;
  auto* x = d.get<__nv_bfloat16>(256 * 8 * 128 * 4);
  RingAttentionArgs a{x, x + 256 * 1024, x + 512 * 1024, x + 768 * 1024, nullptr};
  if (comm->rank() == 0) a.k = nullptr;
  st = op->run(a, nullptr);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("ring_attention: null"), std::string::npos) << st.to_string();
  EXPECT_TRUE(op->destroy().ok());
}

}  // namespace
}  // namespace test
}  // namespace mk

