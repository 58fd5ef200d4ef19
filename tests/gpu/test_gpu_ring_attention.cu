// Ring attention (ops/ring_attention.h) on ranks as processes under MPS: W = 1, 2, 4 on one node
// and 2 emulated nodes x 2 over libfabric (shm, tcp; host-staged).
//
// Data: every rank builds the whole sequence's Q, K, V from a hash of (run seed, call, tensor,
// batch, token, head, d) — fresh per call and per run (MK_TEST_SEED replays a run), so a block
// from the wrong rank or the wrong call is wrong data — and takes its shard (its chunks, in
// token order). Reference: the single-GPU attention kernel over the full sequence on the same
// GPU; the ring's O (poisoned with NaN before each call) must match the reference rows of this
// rank to bf16 rounding, its LSE to 1e-3, every element. The K and V slots must hold every other
// rank's K and V blocks bit for bit after the call. Graph replays: 200 calls back to back with
// no host barrier, inputs advanced inside the graph, every call's slots checked inside the graph
// and its O and LSE kept and checked afterwards.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "mkernel/attention/attention.h"
#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/tunables.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "mkernel/ops/ring_attention.h"
#include "src/comm/session.h"
#include "src/ops/ring_attention/ring_attention_testing.h"
#include "src/ops/ring_attention/ring_attention_plan.h"
#include "tests/common/test_util.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace {

using ops::RingAttention;
using ops::RingAttentionArgs;
using ops::RingAttentionShape;
using ops::SeqLayout;

__device__ inline float hval(uint64_t seed, uint64_t call, int which, uint64_t i) {
  uint64_t x = seed + call * 0xd1b54a32d192ed03ull + uint64_t(which) * 0x8cb92ba72f3d8dd7ull + i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return float(x % 20001) / 10000.f - 1.f;  // [-1, 1]
}

// Full tensor [B, S, heads, D] of tensor `which` in call `call` (+ *call_at if set: graph replays).
__global__ void fill_full(__nv_bfloat16* t, int64_t n, uint64_t seed, uint64_t call, int which, float amp,
                          const uint64_t* call_at = nullptr) {
  const uint64_t c = call + (call_at ? *call_at : 0);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    t[i] = __float2bfloat16(amp * hval(seed, c, which, uint64_t(i)));
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
// Graph replays: the call counter, and `bytes` of `src` kept in slot (*call_at - 1) of `hist`.
__global__ void bump(uint64_t* counter) { ++*counter; }
__global__ void keep(const uint8_t* src, uint8_t* hist, int64_t bytes, const uint64_t* call_at) {
  uint8_t* dst = hist + (*call_at - 1) * bytes;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
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

// Counts, into bad[0] (K) and bad[1] (V), the elements of this rank's slot r that differ from
// rank r's block of the full K and V, for every other rank r (scratch: one block). On `stream`.
// The single-GPU reference call over the whole sequence (S tokens, [B, S, heads, D]).
attention::ForwardArgs whole_sequence(const RingAttentionShape& s, int64_t S, const void* q, const void* k,
                                      const void* v, void* o, float* lse) {
  attention::ForwardArgs f;
  f.q = q, f.k = k, f.v = v, f.o = o, f.lse = lse;
  f.B = s.B, f.H = s.H, f.Hkv = s.Hkv, f.Sq = f.Skv = int(S), f.D = s.D, f.causal = s.causal;
  f.q_stride = f.o_stride = attention::Strides::bshd(S, s.H, s.D);
  f.k_stride = f.v_stride = attention::Strides::bshd(S, s.Hkv, s.D);
  return f;
}

// A slot holds B x slot_rows rows: the owner's block, then (uneven shards) zeros — compared whole.
void check_slots(const RingAttention& op, const RingAttentionShape& s, const __nv_bfloat16* k,
                 const __nv_bfloat16* v, __nv_bfloat16* scratch, unsigned long long* bad, cudaStream_t stream) {
  const auto& p = ops::RingAttentionTesting::plan(op);
  const int W = p.world, me = shared_comm()->rank();
  const int64_t S = s.S, S_slot = ops::RingAttentionTesting::slot_rows(op), krow = int64_t(s.Hkv) * s.D;
  const int64_t block = int64_t(s.B) * S_slot * krow;
  for (int kv = 0; kv < 2; ++kv)
    for (int r = 0; r < W; ++r) {
      if (r == me) continue;
      cudaMemsetAsync(scratch, 0, size_t(block) * 2, stream);
      for (const auto& c : p.chunks[r])
        take_rows<<<256, 256, 0, stream>>>(kv ? v : k, scratch, s.B, S, S_slot, c.token0, c.row0, c.tokens, krow);
      const void* slots = kv ? ops::RingAttentionTesting::v_slots(op) : ops::RingAttentionTesting::k_slots(op);
      equal16<<<256, 256, 0, stream>>>(static_cast<const uint16_t*>(slots) + size_t(r) * block,
                                       reinterpret_cast<const uint16_t*>(scratch), block, bad + kv);
    }
}

// Runs `calls` calls of the ring on fresh data and checks each against the full-sequence kernel.
// trace_name non-null: every call runs the traced kernel, and its timeline must show every work
// item computed once and every communication op run once (MK_TRACE_OUT=prefix writes the last
// call's as prefix.<trace_name>.<rank>.json).
// A traced call's timeline: every work item computed once, every op of the program run once,
// nothing else but long producer waits and (backward) each CTA's life at most once (written to
// $MK_TRACE_OUT.<name>.<rank>.json if set and last).
void check_trace(TraceRecorder& rec, int n_items, int n_ops, int me, const char* name, bool last) {
  std::vector<TraceEvent> ev;
  uint64_t dropped = 0;
  MK_ASSERT_OK(rec.fetch(&ev, &dropped));
  EXPECT_EQ(dropped, 0u);
  std::vector<int> computed(n_items, 0), ran(n_ops, 0), ctas(4096, 0);
  int waits = 0;
  for (const auto& e : ev) {
    EXPECT_LE(e.t0_ns, e.t1_ns);
    if (e.role == uint32_t(Role::kCompute)) ++computed.at(e.item);
    else if (e.role == uint32_t(Role::kComm) || e.role == uint32_t(Role::kNetSend)) ++ran.at(e.item);
    else if (e.role == uint32_t(Role::kWait)) ++waits;
    else if (e.role == uint32_t(Role::kCta)) ++ctas.at(e.cta);  // the backward's CTA lives
    else ADD_FAILURE() << "unexpected role " << e.role;
  }
  for (size_t c = 0; c < ctas.size(); ++c) EXPECT_LE(ctas[c], 1) << "rank " << me << " CTA " << c << " lived twice";
  for (size_t i = 0; i < computed.size(); ++i) EXPECT_EQ(computed[i], 1) << "rank " << me << " item " << i;
  for (size_t i = 0; i < ran.size(); ++i) EXPECT_EQ(ran[i], 1) << "rank " << me << " op " << i;
  if (me == 0)
    printf("trace %s: %zu items, %zu ops, %d waits > 5 us on rank 0\n", name, computed.size(), ran.size(), waits);
  const char* out = getenv("MK_TRACE_OUT");
  if (out && last) MK_ASSERT_OK(write_chrome_trace(ev, std::string(out) + "." + name + "." + std::to_string(me) + ".json"));
}

// One call of a ring operator (forward or backward): checked (run), or — graph — its enqueue
// captured once into exec and replayed.
template <class Op_, class Args_>
void run_call(Op_& op, const Args_& a, cudaStream_t stream, bool graph, cudaGraphExec_t* exec) {
  if (!graph) {
    const Status st = op.run(a, stream);
    ASSERT_TRUE(st.ok()) << st.to_string();
    return;
  }
  if (!*exec) {
    cudaGraph_t g;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const Status st = op.enqueue(a, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_EQ(cudaGraphInstantiate(exec, g, 0), cudaSuccess);
    cudaGraphDestroy(g);
  }
  ASSERT_EQ(cudaGraphLaunch(*exec, stream), cudaSuccess);
}

// Packed documents (RingAttentionArgs::cu_seqlens) over S tokens for a call: pattern 1 short
// documents (1 to 300 tokens, around the 64- and 128-row tiles), pattern 2 long ones (S/7 to
// S/2, so they span chunks and ranks) between short ones; drawn from (seed, call), so each call
// packs anew. At most cap documents (the last takes the rest); padded to cap + 1 entries with S
// (empty documents) when pad is set, so that a captured graph's n_docs stays the same.
std::vector<int32_t> packing(int64_t S, uint64_t seed, int call, int pattern, int cap, bool pad) {
  std::vector<int32_t> cu{0};
  uint64_t x = mix(seed, 0x70ac + uint64_t(call) * 31 + uint64_t(pattern));
  static const int kShort[] = {1, 2, 63, 64, 65, 127, 128, 129, 200, 300};
  while (cu.back() < S) {
    x = mix(x, 1);
    int64_t len = pattern == 1 || x % 3 == 0 ? kShort[(x >> 8) % 10] : S / 7 + int64_t((x >> 8) % uint64_t(S / 3 + 1));
    if (int(cu.size()) == cap) len = S;  // the last document
    cu.push_back(int32_t(std::min<int64_t>(S, cu.back() + std::max<int64_t>(len, 1))));
  }
  if (pad) cu.resize(size_t(cap) + 1, int32_t(S));
  return cu;
}
// The documents a test's calls may hold: S / 16 + 4 (so a reference backward's workspace stays small).
int doc_cap(int64_t S) { return int(S / 16 + 4); }

void check_ring(const RingAttentionShape& s, int calls, bool graph = false, const char* trace_name = nullptr,
                int docs = 0) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world(), me = comm->rank();
  std::unique_ptr<RingAttention> op;
  Status st = RingAttention::create(comm, s, ops::RingAttentionOptions{}, &op);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const int64_t S = s.S, S_l = op->local_tokens();  // uneven shards: this rank's rows
  EXPECT_EQ(S_l, s.rows.empty() ? S / W : s.rows[size_t(me)]);
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
  auto* kr = d.get<__nv_bfloat16>(size_t(s.B) * ops::RingAttentionTesting::slot_rows(*op) * krow);
  auto* bad = d.get<unsigned long long>(4);
  auto* cu = d.get<int32_t>(size_t(doc_cap(S)) + 1);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto& chunks = ops::RingAttentionTesting::plan(*op).chunks;
  const float qamp = 2.0f;
  const uint64_t seed = test_seed();
  cudaGraphExec_t exec = nullptr;
  for (int call = 0; call < calls; ++call) {
    const uint64_t tag = uint64_t(call) + 1 + (s.causal ? 100 : 0) + (s.layout == SeqLayout::kZigzag ? 200 : 0);
    fill_full<<<1024, 256, 0, stream>>>(q, int64_t(s.B) * S * qrow, seed, tag, 0, qamp);
    fill_full<<<1024, 256, 0, stream>>>(k, int64_t(s.B) * S * krow, seed, tag, 1, 1.f);
    fill_full<<<1024, 256, 0, stream>>>(v, int64_t(s.B) * S * krow, seed, tag, 2, 1.f);
    // This rank's shard and the reference rows (packed documents: the single-GPU packed call).
    attention::ForwardArgs ref = whole_sequence(s, S, q, k, v, o_full, lse_full);
    std::vector<int32_t> hcu;
    if (docs) {
      hcu = packing(S, seed, call, docs, doc_cap(S), graph);
      ASSERT_EQ(cudaMemcpyAsync(cu, hcu.data(), hcu.size() * 4, cudaMemcpyHostToDevice, stream), cudaSuccess);
      ref.cu_seqlens = cu;
      ref.n_docs = int(hcu.size()) - 1;
    }
    st = attention::forward(ref, stream);
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
    if (docs) a.cu_seqlens = cu, a.n_docs = int(hcu.size()) - 1;
    TraceRecorder rec;
    if (trace_name) {
      const int n_items = op->work_items(), n_ops = op->comm_ops();
      ASSERT_GT(n_items, 0);
      MK_ASSERT_OK(TraceRecorder::create(uint32_t(64 * (n_items + n_ops) + 4096), &rec));
      a.trace = rec.device();
    }
    ASSERT_NO_FATAL_FAILURE(run_call(*op, a, stream, graph && call > 0, &exec));
    st = comm->sync(stream);
    ASSERT_TRUE(st.ok()) << "rank " << me << " call " << call << ": " << st.to_string();
    cudaMemset(bad, 0, 4 * sizeof(unsigned long long));
    close_bf16<<<1024, 256>>>(ol, o_want, int64_t(s.B) * S_l * qrow, 2e-3f, 1.6e-2f, bad);
    close_f32<<<1024, 256>>>(lsel, lse_want, int64_t(s.B) * s.H * S_l, 1e-3f, bad + 1);
    // Every other rank's K and V blocks passed through this rank's slots r.
    check_slots(*op, s, k, v, kr, bad + 2, nullptr);
    unsigned long long h[4] = {};
    ASSERT_EQ(cudaMemcpy(h, bad, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(h[0], 0ull) << "rank " << me << " call " << call << ": O elements off";
    EXPECT_EQ(h[1], 0ull) << "rank " << me << " call " << call << ": LSE elements off";
    EXPECT_EQ(h[2], 0ull) << "rank " << me << " call " << call << ": K slot elements differ from the owners' K";
    EXPECT_EQ(h[3], 0ull) << "rank " << me << " call " << call << ": V slot elements differ from the owners' V";
    if (trace_name) ASSERT_NO_FATAL_FAILURE(check_trace(rec, op->work_items(), op->comm_ops(), me, trace_name,
                                                        call + 1 == calls));
    ASSERT_TRUE(comm->bootstrap().barrier().ok());
  }
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  st = op->destroy();
  EXPECT_TRUE(st.ok()) << st.to_string();
}

// Tokens per rank: n, or an eighth of it (even, >= 2) under MK_TEST_SMALL (sanitizer runs).
int64_t toks(int64_t n) { return small_shapes() ? std::max<int64_t>(2, (n / 8) & ~int64_t(1)) : n; }

TEST(Ring, ContiguousFullTails) {
  // 1000 tokens per rank: neither the tiles nor the forwarded pieces divide them.
  check_ring(RingAttentionShape{2, 8, 2, 128, int64_t(shared_comm()->world()) * toks(1000), SeqLayout::kContiguous, false}, 3);
}
TEST(Ring, ZigzagCausal) {
  check_ring(RingAttentionShape{1, 8, 8, 128, int64_t(shared_comm()->world()) * toks(2048), SeqLayout::kZigzag, true}, 3);
}
TEST(Ring, ContiguousCausalD64) {
  check_ring(RingAttentionShape{1, 16, 4, 64, int64_t(shared_comm()->world()) * toks(1536), SeqLayout::kContiguous, true}, 2);
}
TEST(Ring, ZigzagFullGraphReplays) {
  check_ring(RingAttentionShape{2, 8, 8, 64, int64_t(shared_comm()->world()) * toks(1000), SeqLayout::kZigzag, false}, 6, true);
}
// Packed documents (cu_seqlens): against the single-GPU packed call over the whole sequence,
// a new packing per call.
TEST(Ring, ZigzagCausalShortDocuments) {
  check_ring(RingAttentionShape{1, 8, 2, 128, int64_t(shared_comm()->world()) * toks(2048), SeqLayout::kZigzag, true}, 2,
             false, nullptr, 1);
}
TEST(Ring, ContiguousFullLongDocumentsD64) {
  check_ring(RingAttentionShape{1, 8, 8, 64, int64_t(shared_comm()->world()) * toks(1000), SeqLayout::kContiguous, false},
             2, false, nullptr, 2);
}
TEST(Ring, ZigzagCausalDocumentsGraphReplays) {
  // One captured call replayed on a new packing each time (cu padded to a fixed n_docs).
  check_ring(RingAttentionShape{1, 8, 4, 128, int64_t(shared_comm()->world()) * toks(1000), SeqLayout::kZigzag, true}, 4,
             true, nullptr, 2);
}
// Uneven shards (RingAttentionShape::rows) of about n tokens per rank: rank r holds
// n (2 + r % 3) / 3 + 13 r + 1 tokens (two thirds to four thirds of n, odd and even, no tile or
// piece dividing them); the sequence is their sum.
RingAttentionShape uneven(RingAttentionShape s, int64_t n) {
  s.rows.clear();
  s.S = 0;
  for (int r = 0; r < shared_comm()->world(); ++r) {
    s.rows.push_back(n * (2 + r % 3) / 3 + 13 * r + 1);
    s.S += s.rows.back();
  }
  return s;
}
TEST(Ring, UnevenContiguousCausal) {
  check_ring(uneven(RingAttentionShape{2, 8, 2, 128, 0, SeqLayout::kContiguous, true}, toks(1000)), 3);
}
TEST(Ring, UnevenZigzagFullD64) {
  check_ring(uneven(RingAttentionShape{2, 8, 8, 64, 0, SeqLayout::kZigzag, false}, toks(1000)), 2);
}
TEST(Ring, UnevenZigzagCausalDocumentsGraphReplays) {
  check_ring(uneven(RingAttentionShape{1, 8, 4, 128, 0, SeqLayout::kZigzag, true}, toks(1000)), 4, true, nullptr, 2);
}
TEST(Ring, TracedZigzagCausal) {
  check_ring(RingAttentionShape{1, 16, 16, 128, int64_t(shared_comm()->world()) * toks(4096), SeqLayout::kZigzag, true}, 2,
             false, "ring_zigzag_causal");
}
// ---- the backward (RingAttentionBackward) ----
//
// Per call: fresh Q, K, V and dO over the whole sequence; the reference is the single-GPU
// forward and backward over it (the backward kernel tested against float64 in
// tests/gpu/test_attention_bwd.py); the ring's backward gets this rank's shards of Q, K, V, dO
// and of the reference O and LSE, its dQ, dK, dV poisoned with NaN before each call, and must
// match the reference rows of this rank element by element: |got - want| <= 2^-6 max|want| +
// 2^-6 |want| (bf16 rounding of both plus fp32 sums in another order). Graph: calls after the
// first replay one captured enqueue on new data.
__global__ void abs_max(const __nv_bfloat16* x, int64_t n, unsigned int* out) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(__bfloat162float(x[i])));
  atomicMax(out, __float_as_uint(m));  // non-negative floats order as their bits
}

void check_ring_backward(const RingAttentionShape& s, int calls, bool graph = false, const char* trace_name = nullptr,
                         int docs = 0) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world(), me = comm->rank();
  std::unique_ptr<ops::RingAttentionBackward> op;
  Status st = ops::RingAttentionBackward::create(comm, s, ops::RingAttentionOptions{}, &op);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ops::RingPlan plan;
  ASSERT_TRUE(ops::build_ring_plan(comm::layout_of(comm->topology()), s.S, s.layout, s.causal, &plan, s.rows).ok());
  const int64_t S = s.S, S_l = plan.rows[size_t(me)];  // uneven shards: this rank's rows
  const int64_t qrow = int64_t(s.H) * s.D, krow = int64_t(s.Hkv) * s.D;
  const size_t qn = size_t(s.B) * S * qrow, kn = size_t(s.B) * S * krow;
  const size_t qln = size_t(s.B) * S_l * qrow, kln = size_t(s.B) * S_l * krow;
  Dev d;
  auto* q = d.get<__nv_bfloat16>(qn);
  auto* k = d.get<__nv_bfloat16>(kn);
  auto* v = d.get<__nv_bfloat16>(kn);
  auto* dout = d.get<__nv_bfloat16>(qn);
  auto* o = d.get<__nv_bfloat16>(qn);
  auto* lse = d.get<float>(size_t(s.B) * s.H * S);
  auto* dq = d.get<__nv_bfloat16>(qn);
  auto* dk = d.get<__nv_bfloat16>(kn);
  auto* dv = d.get<__nv_bfloat16>(kn);
  attention::BackwardArgs ref;
  const attention::ForwardArgs f = whole_sequence(s, S, q, k, v, o, lse);
  ref.q = q, ref.k = k, ref.v = v, ref.o = o, ref.dout = dout, ref.lse = lse, ref.dq = dq, ref.dk = dk, ref.dv = dv;
  ref.B = s.B, ref.H = s.H, ref.Hkv = s.Hkv, ref.D = s.D, ref.Sq = ref.Skv = int(S), ref.causal = s.causal;
  ref.q_stride = ref.o_stride = ref.do_stride = ref.dq_stride = f.q_stride;
  ref.k_stride = ref.v_stride = ref.dk_stride = ref.dv_stride = f.k_stride;
  auto* cu = d.get<int32_t>(size_t(doc_cap(S)) + 1);
  if (docs) ref.cu_seqlens = cu, ref.n_docs = doc_cap(S);  // the workspace for the most documents
  ref.workspace_bytes = attention::backward_workspace_bytes(ref);
  ref.workspace = d.get<uint8_t>(ref.workspace_bytes);
  // This rank's shards: inputs (l), outputs (r) and the reference's rows (w).
  auto* ql = d.get<__nv_bfloat16>(qln);
  auto* kl = d.get<__nv_bfloat16>(kln);
  auto* vl = d.get<__nv_bfloat16>(kln);
  auto* dol = d.get<__nv_bfloat16>(qln);
  auto* ol = d.get<__nv_bfloat16>(qln);
  auto* lsel = d.get<float>(size_t(s.B) * s.H * S_l);
  // The outputs with a poisoned guard of 4 rows after them, which no call may write (a row past
  // a shard's end, e.g. a zigzag chunk taken one row too long).
  const size_t guard = size_t(4) * qrow;
  auto* dqr = d.get<__nv_bfloat16>(qln + guard);
  auto* dkr = d.get<__nv_bfloat16>(kln + guard);
  auto* dvr = d.get<__nv_bfloat16>(kln + guard);
  auto* pz = d.get<uint16_t>(guard);
  auto* dqw = d.get<__nv_bfloat16>(qln);
  auto* dkw = d.get<__nv_bfloat16>(kln);
  auto* dvw = d.get<__nv_bfloat16>(kln);
  auto* bad = d.get<unsigned long long>(4);
  auto* mx = d.get<unsigned int>(3);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const uint64_t seed = test_seed();
  cudaGraphExec_t exec = nullptr;
  for (int call = 0; call < calls; ++call) {
    const uint64_t tag = uint64_t(call) + 1001 + (s.causal ? 100 : 0) + (s.layout == SeqLayout::kZigzag ? 200 : 0);
    fill_full<<<1024, 256, 0, stream>>>(q, int64_t(qn), seed, tag, 0, 2.f);
    fill_full<<<1024, 256, 0, stream>>>(k, int64_t(kn), seed, tag, 1, 1.f);
    fill_full<<<1024, 256, 0, stream>>>(v, int64_t(kn), seed, tag, 2, 1.f);
    fill_full<<<1024, 256, 0, stream>>>(dout, int64_t(qn), seed, tag, 3, 1.f);
    attention::ForwardArgs fr = f;
    std::vector<int32_t> hcu;
    if (docs) {
      hcu = packing(S, seed, call, docs, doc_cap(S), graph);
      ASSERT_EQ(cudaMemcpyAsync(cu, hcu.data(), hcu.size() * 4, cudaMemcpyHostToDevice, stream), cudaSuccess);
      fr.cu_seqlens = ref.cu_seqlens = cu;
      fr.n_docs = ref.n_docs = int(hcu.size()) - 1;
    }
    MK_ASSERT_OK(attention::forward(fr, stream));
    MK_ASSERT_OK(attention::backward(ref, stream));
    int64_t row0 = 0;
    for (const auto& c : plan.chunks[me]) {
      take_rows<<<256, 256, 0, stream>>>(q, ql, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_rows<<<256, 256, 0, stream>>>(k, kl, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      take_rows<<<256, 256, 0, stream>>>(v, vl, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      take_rows<<<256, 256, 0, stream>>>(dout, dol, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_rows<<<256, 256, 0, stream>>>(o, ol, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_lse<<<256, 256, 0, stream>>>(lse, lsel, s.B * s.H, S, S_l, c.token0, row0, c.tokens);
      take_rows<<<256, 256, 0, stream>>>(dq, dqw, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_rows<<<256, 256, 0, stream>>>(dk, dkw, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      take_rows<<<256, 256, 0, stream>>>(dv, dvw, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      row0 += c.tokens;
    }
    poison16<<<256, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(dqr), int64_t(qln + guard));
    poison16<<<256, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(dkr), int64_t(kln + guard));
    poison16<<<256, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(dvr), int64_t(kln + guard));
    poison16<<<256, 256, 0, stream>>>(pz, int64_t(guard));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ops::RingAttentionBackwardArgs a{ql, kl, vl, ol, dol, lsel, dqr, dkr, dvr};
    if (docs) a.cu_seqlens = cu, a.n_docs = int(hcu.size()) - 1;
    TraceRecorder rec;
    if (trace_name) {
      MK_ASSERT_OK(TraceRecorder::create(uint32_t(64 * (op->work_items() + op->comm_ops()) + 4096), &rec));
      a.trace = rec.device();
    }
    ASSERT_NO_FATAL_FAILURE(run_call(*op, a, stream, graph && call > 0, &exec));
    // Bounded: a call that outlives every device wait's bound hangs in a place that has none;
    // then this rank says where the call stands (its items' ready counts, its next op).
    st = sync_stream_bounded(stream, 2 * tunables::signal_timeout_ms() + 5000, "the ring backward call");
    if (st.code() == Code::kTimeout) {
      std::string where;
      Status ps = ops::RingAttentionTesting::backward_progress(*op, &where);
      fprintf(stderr, "rank %d call %d did not finish: %s\n%s", me, call, ps.ok() ? "" : ps.to_string().c_str(),
              where.c_str());
    }
    ASSERT_TRUE(st.ok()) << "rank " << me << " call " << call << ": " << st.to_string();
    cudaMemset(bad, 0, 4 * sizeof(unsigned long long));
    cudaMemset(mx, 0, 3 * sizeof(unsigned int));
    equal16<<<64, 256>>>(reinterpret_cast<const uint16_t*>(dqr + qln), pz, int64_t(guard), bad + 3);
    equal16<<<64, 256>>>(reinterpret_cast<const uint16_t*>(dkr + kln), pz, int64_t(guard), bad + 3);
    equal16<<<64, 256>>>(reinterpret_cast<const uint16_t*>(dvr + kln), pz, int64_t(guard), bad + 3);
    abs_max<<<256, 256>>>(dqw, int64_t(qln), mx);
    abs_max<<<256, 256>>>(dkw, int64_t(kln), mx + 1);
    abs_max<<<256, 256>>>(dvw, int64_t(kln), mx + 2);
    unsigned int hm[3];
    ASSERT_EQ(cudaMemcpy(hm, mx, sizeof(hm), cudaMemcpyDeviceToHost), cudaSuccess);
    float m[3];
    memcpy(m, hm, sizeof(m));
    const float tol = 1.f / 64;
    close_bf16<<<1024, 256>>>(dqr, dqw, int64_t(qln), tol * m[0], tol, bad);
    close_bf16<<<1024, 256>>>(dkr, dkw, int64_t(kln), tol * m[1], tol, bad + 1);
    close_bf16<<<1024, 256>>>(dvr, dvw, int64_t(kln), tol * m[2], tol, bad + 2);
    unsigned long long h[4] = {};
    ASSERT_EQ(cudaMemcpy(h, bad, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(h[3], 0ull) << "rank " << me << " call " << call << ": elements written past dQ, dK or dV";
    EXPECT_GT(m[0] * m[1] * m[2], 0.f) << "rank " << me << " call " << call << ": a zero reference gradient";
    EXPECT_EQ(h[0], 0ull) << "rank " << me << " call " << call << ": dQ elements off (max |dQ| " << m[0] << ")";
    EXPECT_EQ(h[1], 0ull) << "rank " << me << " call " << call << ": dK elements off (max |dK| " << m[1] << ")";
    EXPECT_EQ(h[2], 0ull) << "rank " << me << " call " << call << ": dV elements off (max |dV| " << m[2] << ")";
    if (trace_name) ASSERT_NO_FATAL_FAILURE(check_trace(rec, op->work_items(), op->comm_ops(), me, trace_name,
                                                        call + 1 == calls));
    ASSERT_TRUE(comm->bootstrap().barrier().ok());
  }
  if (me == 0) printf("ring backward: %d items, %d ops, %d communication CTAs\n", op->work_items(), op->comm_ops(),
                      op->comm_ctas());
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  st = op->destroy();
  EXPECT_TRUE(st.ok()) << st.to_string();
}

TEST(RingBackward, ContiguousFullTails) {
  // 1000 tokens per rank: neither the 128-key blocks nor the 64-row query blocks divide them.
  check_ring_backward(RingAttentionShape{2, 8, 2, 128, int64_t(shared_comm()->world()) * toks(1000),
                                         SeqLayout::kContiguous, false}, 3);
}
TEST(RingBackward, ZigzagCausalGqa) {
  check_ring_backward(RingAttentionShape{1, 8, 2, 128, int64_t(shared_comm()->world()) * toks(2048),
                                         SeqLayout::kZigzag, true}, 3);
}
TEST(RingBackward, ContiguousCausalD64) {
  check_ring_backward(RingAttentionShape{1, 16, 4, 64, int64_t(shared_comm()->world()) * toks(1536),
                                         SeqLayout::kContiguous, true}, 2);
}
// The traced kernel: the same results, and a timeline with every item and op once.
TEST(RingBackward, TracedZigzagCausal) {
  check_ring_backward(RingAttentionShape{1, 8, 4, 128, int64_t(shared_comm()->world()) * toks(1024),
                                         SeqLayout::kZigzag, true}, 2, false, "ring_bwd_zigzag_causal");
}
// Packed documents: against the single-GPU packed backward over the whole sequence.
TEST(RingBackward, ZigzagCausalLongDocumentsGqa) {
  check_ring_backward(RingAttentionShape{1, 8, 2, 128, int64_t(shared_comm()->world()) * toks(2048),
                                         SeqLayout::kZigzag, true}, 2, false, nullptr, 2);
}
TEST(RingBackward, ContiguousFullShortDocumentsD64) {
  check_ring_backward(RingAttentionShape{1, 16, 4, 64, int64_t(shared_comm()->world()) * toks(1536),
                                         SeqLayout::kContiguous, false}, 2, false, nullptr, 1);
}
TEST(RingBackward, ZigzagCausalShortDocumentsD64GraphReplays) {
  check_ring_backward(RingAttentionShape{1, 8, 8, 64, int64_t(shared_comm()->world()) * toks(1000),
                                         SeqLayout::kZigzag, true}, 3, true, nullptr, 1);
}
TEST(RingBackward, ZigzagFullD64GraphReplays) {
  // 1000 tokens per rank: chunks of 500 rows (no block divides them).
  check_ring_backward(RingAttentionShape{2, 8, 8, 64, int64_t(shared_comm()->world()) * toks(1000),
                                         SeqLayout::kZigzag, false}, 4, true);
}

// Uneven shards: the same reference rows.
TEST(RingBackward, UnevenZigzagCausalGqa) {
  check_ring_backward(uneven(RingAttentionShape{1, 8, 2, 128, 0, SeqLayout::kZigzag, true}, toks(1000)), 3);
}
TEST(RingBackward, UnevenContiguousFullD64) {
  check_ring_backward(uneven(RingAttentionShape{2, 16, 4, 64, 0, SeqLayout::kContiguous, false}, toks(1000)), 2);
}
TEST(RingBackward, UnevenZigzagCausalShortDocumentsGraphReplays) {
  check_ring_backward(uneven(RingAttentionShape{1, 8, 8, 64, 0, SeqLayout::kZigzag, true}, toks(1000)), 3, true,
                      nullptr, 1);
}

// The ring captured once in a CUDA graph — a kernel advancing the call counter, the fills of
// this call's Q, K, V and of this rank's shard, the poisoned O and LSE, the ring call, a copy
// of O and LSE into a history and the K/V slot checks — replayed kGraphReplays times back to
// back on every rank with no host barrier in between. Afterwards: every replay ran, no slot
// differed, and each replay's O and LSE match the single-GPU kernel over that call's sequence.
constexpr int kGraphReplays = 200;

TEST(Ring, GraphReplaysBackToBack) {
  Communicator* comm = shared_comm();
  ASSERT_NE(comm, nullptr);
  const int W = comm->world(), me = comm->rank();
  const RingAttentionShape s{1, 4, 2, 64, int64_t(W) * 256, SeqLayout::kZigzag, true};
  std::unique_ptr<RingAttention> op;
  MK_ASSERT_OK(RingAttention::create(comm, s, ops::RingAttentionOptions{}, &op));
  const int64_t S = s.S, S_l = S / W;
  const int64_t qrow = int64_t(s.H) * s.D, krow = int64_t(s.Hkv) * s.D;
  const int64_t o_elems = int64_t(s.B) * S_l * qrow, lse_elems = int64_t(s.B) * s.H * S_l;
  Dev d;
  auto* q = d.get<__nv_bfloat16>(size_t(s.B) * S * qrow);
  auto* k = d.get<__nv_bfloat16>(size_t(s.B) * S * krow);
  auto* v = d.get<__nv_bfloat16>(size_t(s.B) * S * krow);
  auto* ql = d.get<__nv_bfloat16>(size_t(s.B) * S_l * qrow);
  auto* kl = d.get<__nv_bfloat16>(size_t(s.B) * S_l * krow);
  auto* vl = d.get<__nv_bfloat16>(size_t(s.B) * S_l * krow);
  auto* ol = d.get<__nv_bfloat16>(size_t(o_elems));
  auto* lsel = d.get<float>(size_t(lse_elems));
  auto* kr = d.get<__nv_bfloat16>(size_t(s.B) * S_l * krow);
  auto* o_hist = d.get<__nv_bfloat16>(size_t(o_elems) * kGraphReplays);
  auto* lse_hist = d.get<float>(size_t(lse_elems) * kGraphReplays);
  auto* o_full = d.get<__nv_bfloat16>(size_t(s.B) * S * qrow);
  auto* lse_full = d.get<float>(size_t(s.B) * s.H * S);
  auto* o_want = d.get<__nv_bfloat16>(size_t(o_elems));
  auto* lse_want = d.get<float>(size_t(lse_elems));
  auto* bad = d.get<unsigned long long>(4);
  auto* calls = d.get<uint64_t>(1);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const uint64_t seed = test_seed(), base = 1000;  // tags base + 1 .. base + kGraphReplays
  const auto& chunks = ops::RingAttentionTesting::plan(*op).chunks;
  // Call `base + *call_at` (call_at null: `base + call`): the full tensors and this rank's shard.
  auto inputs = [&](uint64_t call, const uint64_t* call_at) {
    fill_full<<<1024, 256, 0, stream>>>(q, int64_t(s.B) * S * qrow, seed, base + call, 0, 2.f, call_at);
    fill_full<<<1024, 256, 0, stream>>>(k, int64_t(s.B) * S * krow, seed, base + call, 1, 1.f, call_at);
    fill_full<<<1024, 256, 0, stream>>>(v, int64_t(s.B) * S * krow, seed, base + call, 2, 1.f, call_at);
    int64_t row0 = 0;
    for (const auto& c : chunks[me]) {
      take_rows<<<256, 256, 0, stream>>>(q, ql, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_rows<<<256, 256, 0, stream>>>(k, kl, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      take_rows<<<256, 256, 0, stream>>>(v, vl, s.B, S, S_l, c.token0, row0, c.tokens, krow);
      row0 += c.tokens;
    }
    poison16<<<256, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(ol), o_elems);
    cudaMemsetAsync(lsel, 0xff, size_t(lse_elems) * 4, stream);  // NaN
  };
  RingAttentionArgs a{ql, kl, vl, ol, lsel};
  inputs(0, nullptr);
  Status st = op->run(a, stream);  // a checked first call (agrees on the arguments)
  ASSERT_TRUE(st.ok()) << st.to_string();
  st = comm->sync(stream);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(cudaMemsetAsync(calls, 0, sizeof(uint64_t), stream), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(bad, 0, 4 * sizeof(unsigned long long), stream), cudaSuccess);
  cudaGraph_t g;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  bump<<<1, 1, 0, stream>>>(calls);
  inputs(0, calls);
  st = op->enqueue(a, stream);
  keep<<<256, 256, 0, stream>>>(reinterpret_cast<const uint8_t*>(ol), reinterpret_cast<uint8_t*>(o_hist), o_elems * 2,
                                calls);
  keep<<<256, 256, 0, stream>>>(reinterpret_cast<const uint8_t*>(lsel), reinterpret_cast<uint8_t*>(lse_hist),
                                lse_elems * 4, calls);
  check_slots(*op, s, k, v, kr, bad, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  ASSERT_TRUE(comm->bootstrap().barrier().ok());  // the last barrier: every rank's graph is ready
  for (int rep = 0; rep < kGraphReplays; ++rep) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  st = comm->sync(stream);
  ASSERT_TRUE(st.ok()) << "rank " << me << " after " << kGraphReplays << " replays: " << st.to_string();
  // Each replay's O and LSE against the single-GPU kernel over that call's whole sequence.
  for (int call = 1; call <= kGraphReplays; ++call) {
    inputs(uint64_t(call), nullptr);
    st = attention::forward(whole_sequence(s, S, q, k, v, o_full, lse_full), stream);
    ASSERT_TRUE(st.ok()) << st.to_string();
    int64_t row0 = 0;
    for (const auto& c : chunks[me]) {
      take_rows<<<256, 256, 0, stream>>>(o_full, o_want, s.B, S, S_l, c.token0, row0, c.tokens, qrow);
      take_lse<<<256, 256, 0, stream>>>(lse_full, lse_want, s.B * s.H, S, S_l, c.token0, row0, c.tokens);
      row0 += c.tokens;
    }
    close_bf16<<<256, 256, 0, stream>>>(o_hist + size_t(call - 1) * o_elems, o_want, o_elems, 2e-3f, 1.6e-2f, bad + 2);
    close_f32<<<256, 256, 0, stream>>>(lse_hist + size_t(call - 1) * lse_elems, lse_want, lse_elems, 1e-3f, bad + 3);
  }
  unsigned long long h[4] = {};
  uint64_t ran = 0;
  ASSERT_EQ(cudaMemcpyAsync(h, bad, sizeof(h), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(&ran, calls, sizeof(ran), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(ran, uint64_t(kGraphReplays)) << "rank " << me << ": replays that ran";
  EXPECT_EQ(h[0], 0ull) << "rank " << me << ": K slot elements differing from the owners' K, over all replays";
  EXPECT_EQ(h[1], 0ull) << "rank " << me << ": V slot elements differing from the owners' V, over all replays";
  EXPECT_EQ(h[2], 0ull) << "rank " << me << ": O elements off, over all replays";
  EXPECT_EQ(h[3], 0ull) << "rank " << me << ": LSE elements off, over all replays";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  cudaStreamDestroy(stream);
  ASSERT_TRUE(comm->bootstrap().barrier().ok());
  st = op->destroy();
  EXPECT_TRUE(st.ok()) << st.to_string();
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
    EXPECT_EQ(st.code(), Code::kMismatch) << st.to_string();
    EXPECT_NE(st.message().find("ranks disagree: rank 0 has"), std::string::npos) << st.to_string();
    EXPECT_NE(st.message().find("rank " + std::to_string(W - 1) + " has"), std::string::npos) << st.to_string();
  }
  // A sequence that does not split.
  st = RingAttention::create(comm, RingAttentionShape{1, 8, 8, 128, int64_t(2 * W) + 1, SeqLayout::kZigzag, true}, {},
                             &op);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  // Shard rows that differ between ranks (the same sum), then rows that do not sum to S.
  if (W > 1) {
    std::vector<int64_t> rows(size_t(W), 256);
    if (comm->rank() == W - 1) rows[0] = 255, rows[1] = 257;
    st = RingAttention::create(comm, RingAttentionShape{1, 8, 8, 128, int64_t(W) * 256, SeqLayout::kContiguous, false,
                                                        rows},
                               {}, &op);
    EXPECT_EQ(st.code(), Code::kMismatch) << st.to_string();
    EXPECT_NE(st.message().find("shard rows given, hash"), std::string::npos) << st.to_string();
  }
  st = RingAttention::create(comm, RingAttentionShape{1, 8, 8, 128, int64_t(W) * 256 + 1, SeqLayout::kContiguous, false,
                                                      std::vector<int64_t>(size_t(W), 256)},
                             {}, &op);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("not the sequence's"), std::string::npos) << st.to_string();
  // A null pointer on one rank: with the debug agreement (check_calls, read at create) run()
  // fails on every rank. Without it run() checks locally only (no host collective per call).
  ASSERT_TRUE(tunables::set("check_calls", "1").ok());
  st = RingAttention::create(comm, RingAttentionShape{1, 8, 8, 128, int64_t(W) * 256, SeqLayout::kContiguous, false},
                             {}, &op);
  ASSERT_TRUE(tunables::reset("check_calls").ok());
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

