// Shared by the standalone collectives' GPU tests (test_gpu_collective.cu, test_gpu_matrix.cu):
// inputs every rank can rebuild, the reference kernel (the gathered inputs, or the fp32 sum in the
// documented order — by local index within each node, then the node partials in node order —
// rounded once), the operator with its buffers, and checked calls.
//
// Data: every element of every rank's input is a random value (random sign, exponent and
// mantissa, rounded to the data type), a function of (run seed, rank, call, index), fresh per
// call. The operator's output must equal the reference bit for bit, every element, with the
// output poisoned before each call; the reference kernel is itself checked against the host's
// sum in the same order at sampled elements.
#pragma once

#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/ops/collective.h"
#include "src/comm/session.h"
#include "tests/gpu/mpi_fixture.h"

namespace mk {
namespace test {
namespace coll {

using ops::CollDType;
using ops::Collective;
using ops::CollectiveKind;

__host__ __device__ inline uint64_t hash64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}
__host__ __device__ inline float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
__host__ __device__ inline uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
__host__ __device__ inline uint16_t bf16_rne(float f) {  // no NaN here
  uint32_t u = float_bits(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// Element i of rank r's input in call `call`, as the data type holds it.
__host__ __device__ inline float input_value(uint64_t seed, int rank, uint64_t call, uint64_t i, bool bf16) {
  const uint64_t h = hash64(seed ^ hash64((uint64_t(rank) << 40) ^ (call << 20) ^ 0x5bd1e995ull) ^ hash64(i + 1));
  const uint32_t u = (uint32_t(h >> 63) << 31) | (uint32_t(124 + (h >> 40) % 6) << 23) | uint32_t(h & 0x7fffff);
  const float f = bits_float(u);
  return bf16 ? bits_float(uint32_t(bf16_rne(f)) << 16) : f;
}
__host__ __device__ inline void store_value(void* p, int64_t i, float v, bool bf16) {
  if (bf16) static_cast<uint16_t*>(p)[i] = bf16_rne(v);
  else static_cast<float*>(p)[i] = v;
}

struct RefGeometry {
  int kind = 0;     // CollectiveKind
  int bf16 = 1;
  int me = 0, world = 1, nodes = 1, local = 1;
  int64_t count = 0, out_elems = 0;
  const int* node_ranks = nullptr;  // device [nodes][local]
};

// Reference element i of this rank's output in call `call`.
__host__ __device__ inline float reference_value(const RefGeometry& g, const int* node_ranks, uint64_t seed,
                                                 uint64_t call, int64_t i) {
  const bool bf = g.bf16 != 0;
  if (g.kind == int(CollectiveKind::kAllGather)) return input_value(seed, int(i / g.count), call, uint64_t(i % g.count), bf);
  const int64_t j = g.kind == int(CollectiveKind::kReduceScatter) ? int64_t(g.me) * g.count + i : i;
  float total = 0.f;
  for (int n = 0; n < g.nodes; ++n) {
    float part = input_value(seed, node_ranks[n * g.local], call, uint64_t(j), bf);
    for (int l = 1; l < g.local; ++l) {
#ifdef __CUDA_ARCH__
      part = __fadd_rn(part, input_value(seed, node_ranks[n * g.local + l], call, uint64_t(j), bf));
#else
      part = part + input_value(seed, node_ranks[n * g.local + l], call, uint64_t(j), bf);
#endif
    }
#ifdef __CUDA_ARCH__
    total = n == 0 ? part : __fadd_rn(total, part);
#else
    total = n == 0 ? part : total + part;
#endif
  }
  return total;
}

// call_at: the call is read there (graph replays), else `call`.
__global__ void fill_input(void* dst, int64_t n, int bf16, uint64_t seed, int rank, uint64_t call,
                           const uint64_t* call_at) {
  const uint64_t e = call_at ? *call_at : call;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_value(dst, i, input_value(seed, rank, e, uint64_t(i), bf16 != 0), bf16 != 0);
}
__global__ void fill_reference(void* ref, RefGeometry g, uint64_t seed, uint64_t call, const uint64_t* call_at) {
  const uint64_t e = call_at ? *call_at : call;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < g.out_elems; i += int64_t(gridDim.x) * blockDim.x)
    store_value(ref, i, reference_value(g, g.node_ranks, seed, e, i), g.bf16 != 0);
}
__global__ void poison(uint16_t* p, int64_t words) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 0x7fc1;  // NaN in bf16, and in fp32 as a pair
}
// Mismatching 16-bit words into bad[0], the first (replay << 32 | word) into bad[1]; bad[2] counts
// the compares that ran.
__global__ void compare(const uint16_t* got, const uint16_t* want, int64_t words, unsigned long long* bad,
                        const uint64_t* replay_at) {
  const unsigned long long rep = replay_at ? (static_cast<unsigned long long>(*replay_at) << 32) : 0ull;
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(bad + 2, 1ull);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x)
    if (got[i] != want[i]) {
      atomicAdd(bad, 1ull);
      atomicMin(bad + 1, rep | static_cast<unsigned long long>(i));
    }
}
__global__ void bump(uint64_t* counter) { ++*counter; }

constexpr int kGrid = 264, kBlock = 256;

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t b) { cudaMalloc(&p, b ? b : 16); }
  ~DevBuf() { cudaFree(p); }
};

// One operator and its buffers, checked call by call.
struct Case {
  Communicator* comm;
  CollectiveKind kind;
  CollDType dtype;
  int64_t count;
  ops::CollectiveOptions opt{};
  uint64_t seed = test_seed();
  std::unique_ptr<Collective> op;
  std::unique_ptr<DevBuf> in, out, ref;
  int* d_nodes = nullptr;
  unsigned long long* d_bad = nullptr;
  uint64_t* d_call = nullptr;
  RefGeometry g;
  std::vector<int> node_ranks;
  int es = 2;

  Status init() {
    MK_CHECK(Collective::create(comm, kind, count, dtype, opt, &op));
    es = dtype == CollDType::kBF16 ? 2 : 4;
    in = std::make_unique<DevBuf>(size_t(op->in_elems()) * es);
    out = std::make_unique<DevBuf>(size_t(op->out_elems()) * es);
    ref = std::make_unique<DevBuf>(size_t(op->out_elems()) * es);
    const comm::Layout L = comm::layout_of(comm->topology());
    for (const auto& nr : L.node_ranks) node_ranks.insert(node_ranks.end(), nr.begin(), nr.end());
    MK_CUDA_CHECK(cudaMalloc(&d_nodes, node_ranks.size() * sizeof(int)));
    MK_CUDA_CHECK(cudaMemcpy(d_nodes, node_ranks.data(), node_ranks.size() * sizeof(int), cudaMemcpyHostToDevice));
    MK_CUDA_CHECK(cudaMalloc(&d_bad, 3 * sizeof(unsigned long long)));
    MK_CUDA_CHECK(cudaMalloc(&d_call, sizeof(uint64_t)));
    g.kind = int(kind);
    g.bf16 = dtype == CollDType::kBF16;
    g.me = comm->rank();
    g.world = comm->world();
    g.nodes = L.nodes();
    g.local = L.local();
    g.count = count;
    g.out_elems = op->out_elems();
    g.node_ranks = d_nodes;
    return OkStatus();
  }
  ~Case() {
    if (op) {
      Status st = op->destroy();
      if (!st.ok()) ADD_FAILURE() << st.to_string();
    }
    cudaFree(d_nodes);
    cudaFree(d_bad);
    cudaFree(d_call);
  }
  std::string name() const {
    return std::string(ops::collective_kind_name(kind)) + " " + ops::coll_dtype_name(dtype) + " count " +
           std::to_string(count) + " chunk " + std::to_string(opt.chunk_elems) + " ctas " + std::to_string(opt.ctas);
  }
  // This call's input into `dst`, the reference, the output `o` poisoned. Capturable.
  Status prepare(uint64_t call, void* dst, void* o, cudaStream_t st, const uint64_t* call_at = nullptr) {
    fill_input<<<kGrid, kBlock, 0, st>>>(dst, op->in_elems(), g.bf16, seed, comm->rank(), call, call_at);
    fill_reference<<<kGrid, kBlock, 0, st>>>(ref->p, g, seed, call, call_at);
    poison<<<kGrid, kBlock, 0, st>>>(static_cast<uint16_t*>(o), op->out_elems() * es / 2);
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  }
  Status reset_bad(cudaStream_t st) {
    const unsigned long long init[3] = {0ull, ~0ull, 0ull};
    MK_CUDA_CHECK(cudaMemcpyAsync(d_bad, init, sizeof init, cudaMemcpyHostToDevice, st));
    return OkStatus();
  }
  void enqueue_compare(const void* o, cudaStream_t st, const uint64_t* replay_at = nullptr) {
    compare<<<kGrid, kBlock, 0, st>>>(static_cast<const uint16_t*>(o), static_cast<const uint16_t*>(ref->p),
                                      op->out_elems() * es / 2, d_bad, replay_at);
  }
  Status take_bad(cudaStream_t st, unsigned long long h[3]) {
    MK_CHECK(comm->sync(st));
    MK_CUDA_CHECK(cudaMemcpy(h, d_bad, 3 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    return OkStatus();
  }
  // The reference kernel of call `call` (prepared, synchronized) at sampled elements against the
  // host's own computation: the number that differ.
  Status check_reference(uint64_t call, int samples, int* wrong) {
    std::vector<uint8_t> h(size_t(op->out_elems()) * es);
    MK_CUDA_CHECK(cudaMemcpy(h.data(), ref->p, h.size(), cudaMemcpyDeviceToHost));
    std::mt19937_64 rng(mix(seed, call));
    *wrong = 0;
    for (int s = 0; s < samples; ++s) {
      const int64_t i = int64_t(rng() % uint64_t(op->out_elems()));
      const float v = reference_value(g, node_ranks.data(), seed, call, i);
      uint32_t want = g.bf16 ? bf16_rne(v) : float_bits(v), got = 0;
      memcpy(&got, h.data() + size_t(i) * es, size_t(es));
      *wrong += got != want;
    }
    return OkStatus();
  }
};

// `calls` calls of c with fresh data, each checked. mode: 0 plain buffers; 1 the operator's own
// workspaces (input(), and output() for all-reduce); 2 in place (all-reduce: in == out).
// after_enqueue, when set, runs while each call is in flight (the matrix's blocking CUDA calls).
inline void run_calls(Case& c, int calls, int mode, const std::function<void(cudaStream_t)>& after_enqueue = {}) {
  Communicator* comm = c.comm;
  cudaStream_t st = comm->stream();
  void* in = mode == 1 ? c.op->input() : c.in->p;
  void* out = c.out->p;
  if (mode == 1 && c.op->output()) out = c.op->output();
  if (mode == 2) out = in;
  ASSERT_NE(in, nullptr);
  for (int call = 1; call <= calls; ++call) {
    MK_ASSERT_OK(c.prepare(uint64_t(call), in, mode == 2 ? c.out->p : out, st));
    MK_ASSERT_OK(c.reset_bad(st));
    MK_ASSERT_OK(c.op->run({in, out}, st));
    if (after_enqueue) after_enqueue(st);
    c.enqueue_compare(out, st);
    unsigned long long h[3];
    MK_ASSERT_OK(c.take_bad(st, h));
    ASSERT_EQ(h[0], 0ull) << c.name() << " mode " << mode << " call " << call << " rank " << comm->rank() << ": "
                          << h[0] << " wrong 16-bit words of " << c.op->out_elems() * c.es / 2 << ", the first at "
                          << h[1];
    int wrong = 0;
    MK_ASSERT_OK(c.check_reference(uint64_t(call), 64, &wrong));
    ASSERT_EQ(wrong, 0) << c.name() << ": the reference kernel disagrees with the host";
  }
  MK_ASSERT_OK(comm->bootstrap().barrier());
}

}  // namespace coll
}  // namespace test
}  // namespace mk
