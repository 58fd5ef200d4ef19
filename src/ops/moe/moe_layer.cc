// The MoE layer (include/mkernel/ops/moe_layer.h): MoeEp's dispatch and combine around two
// grouped GEMMs (SwiGLU in the first one's epilogue), all on the caller's stream.
#include "mkernel/ops/moe_layer.h"

#include <cuda_runtime_api.h>

#include <cstdlib>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/gemm/grouped.h"
#include "mkernel/runtime/communicator.h"
#include "src/comm/session.h"
#include "src/ops/moe/moe_layer_launch.h"
#include "src/ops/moe/moe_program.h"

namespace mk {
namespace ops {

struct MoeLayer::State {
  MoeLayerConfig cfg;
  std::unique_ptr<MoeEp> ep;
  int El = 0;
  int64_t rows = 0;
  void* recv_x = nullptr;  // [rows, H]
  void* act = nullptr;     // [rows, I]
  void* y = nullptr;       // [rows, H]
  int32_t* counts = nullptr;   // [El]
  int32_t* offsets = nullptr;  // [El + 1]
  // 0, or 1 + the first expert whose range a GEMM refused: written on the device, copied to
  // pinned host memory at the end of each call (stream-ordered, capturable).
  int32_t* gemm_err_dev = nullptr;
  int32_t* gemm_err_host = nullptr;
  // The first error check() reported: run() and run_experts() refuse from then on (the caller's
  // observation, in its program order; never the device's records racing the calls in flight).
  mutable Status reported;
  // The fused path (tunable moe_fused_layer): the layer program's session and the kernel's launch.
  bool fused = false;
  std::unique_ptr<comm::OpSession> lses;
  comm::Program lprog;
  MoeLayerFusedLaunch fl;
  ~State() {
    cudaFree(recv_x);
    cudaFree(act);
    cudaFree(y);
    cudaFree(counts);
    cudaFree(offsets);
    cudaFree(gemm_err_dev);
    if (gemm_err_host) cudaFreeHost(gemm_err_host);
  }
};

// The fused path's session, program and launch (collective; every rank takes it or none: the
// tunable and the mode are the same on every rank).
struct MoeLayerInternal {
  static Status create_fused(Communicator* comm, MoeLayer::State& st, const MoeOptions& opt);
};

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

Status check_config(const MoeLayerConfig& cfg) {
  MK_REQUIRE(cfg.intermediate > 0 && cfg.intermediate % 8 == 0, Code::kInvalidArgument,
             "moe layer: intermediate size %lld must be a positive multiple of 8 (16-byte activation rows)",
             (long long)cfg.intermediate);
  MK_REQUIRE(cfg.moe.hidden > 0 && cfg.moe.hidden % 8 == 0, Code::kInvalidArgument,
             "moe layer: hidden size %lld must be a positive multiple of 8", (long long)cfg.moe.hidden);
  return OkStatus();
}

uint64_t intermediate_bytes(const MoeLayerConfig& cfg, int El, int64_t rows) {
  return uint64_t(rows) * uint64_t(cfg.moe.hidden) * 2 * 2 + uint64_t(rows) * uint64_t(cfg.intermediate) * 2 +
         uint64_t(2 * El + 1) * 4;
}
}  // namespace

Status MoeLayer::buffer_bytes(const MoeLayerConfig& cfg, const Topology& topo, bool staged, MoeLayerMemory* out,
                              MoeMode mode) {
  MK_REQUIRE(out, Code::kInvalidArgument, "moe layer: null output");
  MK_CHECK(check_config(cfg));
  MK_CHECK(MoeEp::buffer_bytes(cfg.moe, topo, staged, &out->ep, mode));
  const int El = cfg.moe.num_experts / topo.world;
  out->intermediate_bytes = intermediate_bytes(cfg, El, out->ep.recv_rows);
  return OkStatus();
}

Status MoeLayer::create(Communicator* comm, const MoeLayerConfig& cfg, const MoeOptions& opt,
                        std::unique_ptr<MoeLayer>* out) {
  MK_REQUIRE(comm && out, Code::kInvalidArgument, "moe layer: null communicator or output");
  // Checked before the collective create, the same on every rank: no rank enters it alone.
  MK_CHECK(check_config(cfg));
  std::unique_ptr<MoeLayer> layer(new MoeLayer());
  layer->st_ = std::make_unique<State>();
  State& st = *layer->st_;
  st.cfg = cfg;
  MK_CHECK(MoeEp::create(comm, cfg.moe, opt, &st.ep));
  MK_REQUIRE(st.ep->local_experts() <= gemm::kMaxGroups, Code::kInvalidArgument,
             "moe layer: %d local experts, the grouped GEMM takes at most %d", st.ep->local_experts(),
             gemm::kMaxGroups);
  st.El = st.ep->local_experts();
  st.rows = st.ep->recv_rows();
  const int64_t H = cfg.moe.hidden, I = cfg.intermediate;
  MK_CUDA_CHECK(cudaMalloc(&st.recv_x, size_t(st.rows) * H * 2 + 16));
  MK_CUDA_CHECK(cudaMalloc(&st.act, size_t(st.rows) * I * 2 + 16));
  MK_CUDA_CHECK(cudaMalloc(&st.y, size_t(st.rows) * H * 2 + 16));
  MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&st.counts), size_t(st.El) * 4));
  MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&st.offsets), size_t(st.El + 1) * 4));
  MK_CHECK(zero_bounded(st.counts, size_t(st.El) * 4, -1, "moe layer: zeroing the counts"));
  MK_CHECK(zero_bounded(st.offsets, size_t(st.El + 1) * 4, -1, "moe layer: zeroing the offsets"));
  MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&st.gemm_err_dev), 16));
  MK_CHECK(zero_bounded(st.gemm_err_dev, 16, -1, "moe layer: zeroing the error word"));
  MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&st.gemm_err_host), 16, cudaHostAllocDefault));
  *st.gemm_err_host = 0;
  if (tunables::moe_fused_layer() != 0 && !st.ep->hierarchical()) MK_CHECK(MoeLayerInternal::create_fused(comm, st, opt));
  *out = std::move(layer);
  return OkStatus();
}

MoeLayer::~MoeLayer() {
  Status s = destroy();
  if (!s.ok()) MK_WARN(kSubsysInit, "moe layer: destroy: %s", s.to_string().c_str());
}

Status MoeLayer::destroy() {
  if (!st_ || !st_->ep) return OkStatus();
  if (st_->fused && st_->lses->alive()) moe_layer_fused_print_stats(st_->fl);
  Status first = st_->lses ? st_->lses->destroy() : OkStatus();
  const Status s = st_->ep->destroy();
  return first.ok() ? s : first;
}

Status MoeLayerInternal::create_fused(Communicator* comm, MoeLayer::State& st, const MoeOptions& opt) {
  const int W = comm->world(), me = comm->rank();
  MoeGeometry g;
  MK_CHECK(moe_geometry(st.cfg.moe, W, &g));
  const comm::Layout layout = comm::layout_of(comm->topology());
  MK_CHECK(comm::OpSession::create(comm, "moe_layer", opt.staging, &st.lses));
  const MoeLaunch& el = moe_launch_of(*st.ep);
  const int pieces = moe_default_pieces(el.comm_ctas, W);
  const int uchunks = moe_layer_unpack_chunks(g.T);
  const int64_t H = st.cfg.moe.hidden, I = st.cfg.intermediate;
  MK_CHECK(build_moe_layer_program(layout, g, I, pieces, uchunks, st.lses->staged(), &st.lprog));
  MK_CHECK(st.lses->setup(st.lprog));
  auto fill = [&]() -> Status {
    comm::OpSession& ls = *st.lses;
    comm::Resolved r;
    MK_CHECK(ls.resolve(st.lprog, st.lprog.ranks[me], &r));
    MoeLayerFusedLaunch& f = st.fl;
    f.l = el;
    MoeLaunch& l = f.l;
    l.send = static_cast<char*>(ls.local(MoeBuf::kSend));
    l.recv = static_cast<char*>(ls.local(MoeBuf::kRecv));
    l.dpiece = static_cast<uint64_t*>(ls.local(MoeBuf::kPieceBytes));
    l.csend = static_cast<char*>(ls.local(MoeLayerBuf::kCSend));
    l.crecv = static_cast<char*>(ls.local(MoeLayerBuf::kCRecv));
    l.cpiece = static_cast<uint64_t*>(ls.local(MoeLayerBuf::kCPieceBytes));
    MK_REQUIRE(l.send && l.recv && l.dpiece && l.csend && l.crecv && l.cpiece, Code::kInternal,
               "moe layer (fused): a slot buffer was not allocated");
    const int64_t body = g.slot_bytes - g.hdr_bytes;
    l.dP = moe_pieces(body, pieces), l.dpb = moe_piece_bytes(body, pieces);
    l.cP = moe_pieces(g.cslot_bytes, pieces), l.cpb = moe_piece_bytes(g.cslot_bytes, pieces);
    l.layer_body = true;
    l.direct_rows = false;
    l.dispatch_program = comm::DeviceProgram{};
    l.combine_program = comm::DeviceProgram{};
    f.program = r.program;
    MoeLayerPools& pl = f.pools;
    pl = moe_layer_pools(W, g.El);
    for (uint32_t* w : {&pl.hdr, &pl.laid, &pl.arrived, &pl.unpacked, &pl.g1, &pl.packed, &pl.carrived, &pl.waits})
      *w += r.hook_wait0;
    for (uint32_t* s : {&pl.s_laid, &pl.s_unpacked, &pl.s_g1, &pl.s_packed, &pl.signals}) *s += r.hook_signal0;
    f.q.W = W, f.q.El = g.El, f.q.unpack_chunks = uchunks, f.q.combine_chunks = moe_layer_combine_chunks(g.T);
    f.q.tile_rows = 128;
    f.q.tiles_n1 = int((I + 127) / 128);  // SwiGLU outputs per tile: 128 (the tile's 256 columns: gate, up)
    f.q.tiles_n2 = int((H + 255) / 256);
    f.I = I;
    f.recv_x = st.recv_x, f.act = st.act, f.y = st.y;
    f.counts_out = st.counts, f.offsets_out = st.offsets;
    void* p = nullptr;
    MK_CHECK(ls.alloc_zeroed(size_t(moe_layer_fused_lay_bytes(g.El)), &p));
    f.lay = static_cast<int32_t*>(p);
    MK_CHECK(ls.alloc_zeroed(sizeof(int), &p));
    f.queue_counter = static_cast<int*>(p);
    MK_CHECK(ls.alloc_zeroed(sizeof(int), &p));
    f.done_ctas = static_cast<int*>(p);
    if (const char* d = std::getenv("MK_MOE_FUSED_DEBUG"); d && (std::atoi(d) & 64)) {  // one-off timing counters
      MK_CHECK(ls.alloc_zeroed(64 * sizeof(unsigned long long), &p));
      f.stats = static_cast<unsigned long long*>(p);
    }
    return moe_layer_fused_prepare(&f);
  };
  MK_CHECK(agree(comm->bootstrap(), fill(), "moe layer create (fused)"));
  st.fused = true;
  return OkStatus();
}

Status MoeLayer::check() const {
  MK_REQUIRE(st_ && st_->ep, Code::kInvalidArgument, "moe layer: not created");
  if (!st_->reported.ok()) return st_->reported;
  Status s = st_->ep->check();
  const int32_t g = *reinterpret_cast<const volatile int32_t*>(st_->gemm_err_host);
  if (s.ok() && g != 0)
    s = make_status(Code::kInternal,
                    "moe layer: the expert GEMMs found local expert %d's rows outside the receive buffer (%lld rows)",
                    g - 1, (long long)st_->rows);
  st_->reported = s;
  return s;
}

Status MoeLayer::run(const MoeLayerArgs& a, void* out, cudaStream_t stream) {
  MK_REQUIRE(st_ && st_->ep, Code::kInvalidArgument, "moe layer: not created");
  State& st = *st_;
  MK_CHECK(st.reported);  // an error check() reported (not the device's records: they race)
  MK_REQUIRE(a.w1 && a.w2 && out, Code::kInvalidArgument, "moe layer: null w1, w2 or out");
  MK_REQUIRE(aligned16(a.w1) && aligned16(a.w2), Code::kInvalidArgument,
             "moe layer: w1 and w2 must be 16-byte aligned");
  if (st.fused) {
    MK_REQUIRE(a.x && a.topk_ids, Code::kInvalidArgument, "moe layer: null x or topk_ids");
    MK_REQUIRE(aligned16(a.x) && aligned16(out), Code::kInvalidArgument, "moe layer: x and out must be 16-byte aligned");
    MK_REQUIRE(a.tokens >= 0 && a.tokens <= st.cfg.moe.max_tokens_per_rank, Code::kInvalidArgument,
               "moe layer: %lld token rows (max_tokens_per_rank %lld)", (long long)a.tokens,
               (long long)st.cfg.moe.max_tokens_per_rank);
    MK_CHECK(st.lses->check_call());
    return moe_layer_fused_launch(st.fl, a.x, a.topk_ids, a.topk_weights, a.d_num_tokens, a.tokens, a.w1, a.w2, out,
                                  stream);
  }
  MK_CHECK(st.ep->dispatch_enqueue({a.x, a.topk_ids, a.topk_weights, a.d_num_tokens, a.tokens},
                                   {st.recv_x, st.counts, st.offsets}, stream));
  MK_CHECK(enqueue_experts(a.w1, a.w2, stream));
  MK_CUDA_CHECK(cudaMemcpyAsync(st.gemm_err_host, st.gemm_err_dev, 4, cudaMemcpyDeviceToHost, stream));
  // combine_enqueue: the refusal is the layer's own (above), already taken for this call.
  return st.ep->combine_enqueue({st.y}, out, stream, nullptr);
}

Status MoeLayer::enqueue_experts(const void* w1, const void* w2, cudaStream_t stream) {
  State& st = *st_;
  const int64_t H = st.cfg.moe.hidden, I = st.cfg.intermediate;
  gemm::GroupedArguments g1;
  g1.A = st.recv_x;
  g1.B = w1;
  g1.C = st.act;
  g1.groups = st.El;
  g1.rows = st.rows;
  g1.N = 2 * I;
  g1.K = H;
  g1.counts = st.counts;
  g1.offsets = st.offsets;
  g1.epilogue = gemm::GroupedEpilogue::kSwiGLU;
  g1.error = st.gemm_err_dev;
  MK_CHECK(gemm::run_grouped(g1, stream));
  gemm::GroupedArguments g2 = g1;
  g2.A = st.act;
  g2.B = w2;
  g2.C = st.y;
  g2.N = H;
  g2.K = I;
  g2.epilogue = gemm::GroupedEpilogue::kStore;
  return gemm::run_grouped(g2, stream);
}

Status MoeLayer::run_experts(const void* w1, const void* w2, cudaStream_t stream) {
  MK_REQUIRE(st_ && st_->ep, Code::kInvalidArgument, "moe layer: not created");
  MK_CHECK(st_->reported);
  MK_REQUIRE(w1 && w2 && aligned16(w1) && aligned16(w2), Code::kInvalidArgument,
             "moe layer: w1 and w2 must be non-null and 16-byte aligned");
  MK_CHECK(enqueue_experts(w1, w2, stream));
  MK_CUDA_CHECK(cudaMemcpyAsync(st_->gemm_err_host, st_->gemm_err_dev, 4, cudaMemcpyDeviceToHost, stream));
  return OkStatus();
}

const MoeLayerConfig& MoeLayer::config() const { return st_->cfg; }
bool MoeLayer::fused() const { return st_ && st_->fused; }
MoeEp* MoeLayer::ep() const { return st_->ep.get(); }
int MoeLayer::local_experts() const { return st_->El; }
int64_t MoeLayer::recv_rows() const { return st_->rows; }
const int32_t* MoeLayer::counts() const { return st_->counts; }
const int32_t* MoeLayer::offsets() const { return st_->offsets; }
const void* MoeLayer::expert_inputs() const { return st_->recv_x; }
const void* MoeLayer::expert_outputs() const { return st_->y; }

}  // namespace ops
}  // namespace mk
