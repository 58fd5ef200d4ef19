// GPU-initiated puts through the proxy between ranks on different (emulated) nodes:
// kernels push commands into the ring, the proxies move the bytes over libfabric (staged
// through pinned host buffers unless MK_NET_STAGING says otherwise), and the receiving
// kernel waits on the flags and checks every byte. Run as processes under MPS with
// MK_RANKS_PER_NODE=1, so every peer is another node.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <chrono>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/command_ring.cuh"
#include "mkernel/proxy/proxy.h"
#include "tests/gpu/mpi_fixture.h"
#include "tests/gpu/test_kernels.cuh"

namespace mk {
namespace test {
namespace {

constexpr uint64_t kTile = 64 << 10;
constexpr int kTiles = 1000;

// Pushes one put per tile [first, first + n): tile i of src goes to tile i of the peer's dst,
// raising the peer's flag i. Every thread of every CTA may push (slots are claimed atomically).
__global__ void push_tiles(RingView ring, WaitCtx ctx, int peer, uint32_t src_win, uint32_t dst_win,
                           int first, int n, uint64_t tile, uint64_t bytes) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int t = first + i;
    device::ring_push(ring, ctx, make_put(peer, src_win, t * tile, dst_win, t * tile, bytes, t, kNoFlag, t));
  }
}

// One CTA per tile: waits for flag t >= 1, then checks the tile's words.
__global__ void check_tiles(SignalView flags, WaitCtx ctx, const uint32_t* dst, int peer, int me,
                            int first, int n, uint64_t tile_words, uint64_t words, uint64_t seed,
                            unsigned long long* bad) {
  for (int i = blockIdx.x; i < n; i += gridDim.x) {
    const int t = first + i;
    if (threadIdx.x == 0) device::wait_ge(ctx, &flags.local[t], 1, peer, t);
    __syncthreads();
    unsigned long long b = 0;
    for (uint64_t w = threadIdx.x; w < words; w += blockDim.x)
      b += dst[t * tile_words + w] != tag_word(seed, peer, me, 7, t * tile_words + w);
    if (b) atomicAdd(bad, b);
    __syncthreads();
  }
}

struct ProxyRig {
  Communicator* comm;
  std::unique_ptr<net::Backend> be;
  std::unique_ptr<ProxyWindows> wins;
  std::unique_ptr<CudaFlagSink> sink;
  std::unique_ptr<Proxy> proxy;
  SymmetricBuffer* flags = nullptr;
  void* src = nullptr;
  void* dst = nullptr;
  uint32_t src_win = 0, dst_win = 0;

  Status init(uint64_t bytes) {
    MK_CHECK(net::create_backend(comm->bootstrap(), comm->topology(), net::BackendConfig{}, &be));
    MK_CHECK(ProxyWindows::create(&comm->bootstrap(), be.get(), "", StagingConfig{}, &wins));
    MK_CUDA_CHECK(cudaMalloc(&src, bytes));
    MK_CUDA_CHECK(cudaMalloc(&dst, bytes));
    MK_CHECK(wins->add(src, bytes, net::MemKind::kCuda, &src_win));
    MK_CHECK(wins->add(dst, bytes, net::MemKind::kCuda, &dst_win));
    MK_CHECK(comm->alloc_signals(kTiles, &flags));
    sink = std::make_unique<CudaFlagSink>(static_cast<uint64_t*>(flags->local()), kTiles);
    ProxyConfig pc;
    pc.gpu_ring = true;
    pc.near_gpu = comm->device();
    pc.device = comm->device();
    // Created from a thread whose current device is another one (where there is another): the
    // proxy's stream and thread must still belong to the rank's device.
    int ndev = 1;
    MK_CUDA_CHECK(cudaGetDeviceCount(&ndev));
    MK_CUDA_CHECK(cudaSetDevice((comm->device() + 1) % ndev));
    Status cs = Proxy::create(wins.get(), sink.get(), pc, &proxy);
    MK_CUDA_CHECK(cudaSetDevice(comm->device()));
    MK_CHECK(cs);
    proxy->on_error([c = comm](const Status& s) { c->abort(s); });
    MK_CHECK(proxy->start());
    return comm->bootstrap().barrier();
  }
  Status finish() {
    MK_CHECK(proxy->flush());
    MK_CHECK(comm->bootstrap().barrier());
    MK_CHECK(proxy->stop());
    MK_CHECK(wins->destroy());
    MK_CHECK(be->finalize());
    cudaFree(src);
    cudaFree(dst);
    return comm->heap().free(flags);
  }
};

class GpuProxy : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = shared_comm();
    ASSERT_NE(comm, nullptr);
    if (comm->world() < 2) GTEST_SKIP() << "needs 2 ranks";
    ASSERT_FALSE(comm->topology().same_node((comm->rank() + 1) % comm->world()))
        << "run with MK_RANKS_PER_NODE=1: the peer must be on another node";
  }
  Communicator* comm = nullptr;
};

// Rank r sends to r^1 and receives from it. Single puts of several sizes, then 1000 x 64 KiB.
TEST_F(GpuProxy, PutsFromDeviceMemoryLandAndRaiseFlags) {
  const int me = comm->rank(), peer = me ^ 1;
  if (peer >= comm->world()) GTEST_SKIP() << "odd rank out";
  const uint64_t bytes = kTile * kTiles;
  const uint64_t seed = test_seed();
  ProxyRig rig{comm};
  MK_ASSERT_OK(rig.init(bytes));
  for (int i = 0; i < 1000 && rig.proxy->thread_device() < 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(rig.proxy->thread_device(), comm->device()) << "the proxy thread runs on another device";
  // Tagged source, poisoned destination.
  fill_tagged<<<264, 256, 0, comm->stream()>>>(static_cast<uint32_t*>(rig.src), bytes / 4, seed, me, peer, 7);
  fill_u32<<<264, 256, 0, comm->stream()>>>(static_cast<uint32_t*>(rig.dst), bytes / 4, 0xDEADBEEFu);
  MK_ASSERT_OK(comm->sync(comm->stream()));
  MK_ASSERT_OK(comm->bootstrap().barrier());
  BadCounter bad;
  const WaitCtx ctx = comm->wait_ctx(OpTag::kSelfCheck, Role::kNetSend);
  const WaitCtx rctx = comm->wait_ctx(OpTag::kSelfCheck, Role::kNetRecv);
  const RingView ring = rig.proxy->ring().view(ctx.abort);
  cudaStream_t recv_stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&recv_stream, cudaStreamNonBlocking), cudaSuccess);

  // Single puts: tiles 0..3 with 8 B, 4 KiB + 4, 60 KiB, 64 KiB (whole words, checked whole).
  const uint64_t sizes[] = {8, 4100, 60 << 10, kTile};
  for (int t = 0; t < 4; ++t) {
    push_tiles<<<1, 1, 0, comm->stream()>>>(ring, ctx, peer, rig.src_win, rig.dst_win, t, 1, kTile, sizes[t]);
    check_tiles<<<1, 256, 0, recv_stream>>>(rig.flags->signal_view(), rctx, static_cast<uint32_t*>(rig.dst),
                                            peer, me, t, 1, kTile / 4, sizes[t] / 4, seed, bad.d);
    MK_ASSERT_OK(comm->sync(recv_stream));
    MK_ASSERT_OK(comm->sync(comm->stream()));
    EXPECT_EQ(bad.take(), 0ull) << "single put of " << sizes[t] << " B";
  }
  // The rest of tile 0..3 stayed poisoned? (only `sizes[t]` bytes were sent)
  std::vector<uint32_t> tail(kTile / 4);
  ASSERT_EQ(cudaMemcpy(tail.data(), static_cast<uint8_t*>(rig.dst), kTile, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint64_t w = 2; w < kTile / 4; ++w) ASSERT_EQ(tail[w], 0xDEADBEEFu) << "word " << w << " of tile 0";

  // A stream of tiles as a fused kernel would send them: 996 x 64 KiB, checked per tile on arrival.
  auto t0 = std::chrono::steady_clock::now();
  check_tiles<<<132, 256, 0, recv_stream>>>(rig.flags->signal_view(), rctx, static_cast<uint32_t*>(rig.dst),
                                            peer, me, 4, kTiles - 4, kTile / 4, kTile / 4, seed, bad.d);
  push_tiles<<<8, 32, 0, comm->stream()>>>(ring, ctx, peer, rig.src_win, rig.dst_win, 4, kTiles - 4, kTile, kTile);
  MK_ASSERT_OK(comm->sync(recv_stream));
  MK_ASSERT_OK(comm->sync(comm->stream()));
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(bad.take(), 0ull) << "tile stream";
  printf("rank %d -> %d (%s%s): %d x 64 KiB tiles in %.1f ms: %.2f GB/s each way\n", me, peer,
         rig.be->name(), rig.wins->staging() ? ", staged" : "", kTiles - 4, s * 1e3,
         (kTiles - 4) * kTile / s / 1e9);
  // Every tile arrived at the peer; the local completions of this rank's own puts come through
  // the proxy's progress loop on their own time (bounded here, then counted exactly).
  ProxyStats st = rig.proxy->stats();
  for (int i = 0; i < 5000 && (st.puts < uint64_t(kTiles) || st.arrivals < uint64_t(kTiles)); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    st = rig.proxy->stats();
  }
  EXPECT_EQ(st.puts, uint64_t(kTiles));
  EXPECT_EQ(st.arrivals, uint64_t(kTiles));
  cudaStreamDestroy(recv_stream);
  MK_ASSERT_OK(rig.finish());
}

}  // namespace
}  // namespace test
}  // namespace mk
