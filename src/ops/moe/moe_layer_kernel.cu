// mkernel — the fused MoE layer kernel (moe_layer_launch.h): one persistent launch per layer call
// whose CTAs run the layer program's ops and the units of its work queue, each when ready.
//
// CTA: the grouped GEMM's (src/gemm/kernel/grouped_gemm.cuh): warpgroup 0's first warp produces,
// warpgroups 1 and 2 consume. One elected producer thread schedules: it draws the next queue
// item (MoeLayerQueue order: layout, unpack chunks, the first GEMM's tiles, the second's, combine
// chunks; moe_layer_item) from the call's counter and keeps it until its waits are met; meanwhile
// it hands the program's next op to the consumers whenever that op is ready (a peek, then a
// compare-and-swap on the op counter: ops stay in program order and no CTA takes one that would
// wait). A ready item goes to the consumers through a two-slot ring in shared memory; a GEMM
// tile's loads follow from the producer (TMA, after a proxy fence: the rows were written by
// generic stores). Once the queue is drawn out the CTA takes the remaining ops in order, ready or
// not, and ends when none is left. Units wait only for units before them in the queue and for
// ops, and a CTA never holds an op it cannot run, so any number of resident CTAs finishes the
// call (docs/moe.md; the CPU replay with shared slots, tests/cpu/test_moe_layer_program.cc).
//
// Every wait is bounded: an item that is not ready within the wait context's bound (or once the
// communicator aborted) goes through the program's bounded waits, which record rank, peer and
// flag and give up; the kernel then runs to its end and raises nothing (hook_signals).
#include "src/ops/moe/moe_layer_launch.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/epoch.cuh"
#include "mkernel/device/signal.cuh"
#include "src/comm/executor.cuh"
#include "src/gemm/tensor_map.h"
#include "src/runtime/cuda_driver.h"

#if MK_WITH_CUTLASS
#include "cutlass/util/packed_stride.hpp"
#define MK_GROUPED_PARTS_ONLY 1  // the grouped GEMM kernel itself lives in sm90_grouped_bf16.cu
#include "src/gemm/kernel/grouped_gemm.cuh"
#include "src/gemm/kernel/scheduler.cuh"
#endif

namespace mk {
namespace ops {

int moe_layer_unpack_chunks(int64_t T) { return int(std::max<int64_t>(1, std::min<int64_t>(64, (T + 31) / 32))); }
int moe_layer_combine_chunks(int64_t T) { return int(std::max<int64_t>(1, std::min<int64_t>(256, (T + 15) / 16))); }

#if MK_WITH_CUTLASS
namespace {

using namespace gemm::sm90;

// What the producer hands the consumers: a queue item (kind, its fields, and for a GEMM tile the
// expert's first row and the rows it takes), an op, or the end.
constexpr int kSlotOp = 100, kSlotDone = 101;
struct LayerSlot {
  int kind;
  int a, b, c;  // moe_layer_item's fields; kSlotOp: a = the op
  int row0;     // GEMM: the expert's first row
  int count;    // GEMM: the expert's rows the GEMMs take
};

struct LayerParams {
  GroupedParams g1, g2;  // maps, C, ldc, n_out, k_tiles, tiles_n, swiglu (the mainloop's: g1's)
  MoeLayerFusedLaunch f;
  char* out;
  int debug;  // one-off experiment bits (MK_MOE_FUSED_DEBUG): 1 the second GEMM's tile fence at system scope
              // (with 256), 2 the units' waits and signals at system scope (as first written), 4 no epilogue
              // stores, 8 the gate without its acquire (a gpu-scope fence instead), 64 timing counters, 128
              // no proxy fence before a tile's loads, 256 every consumer thread fences after a tile (as
              // first written)
};

struct LayerSmem {
  alignas(1024) MainloopStorage tensors;
  alignas(16) typename MainloopCollective::PipelineStorage pipe;
  alignas(16) typename ItemPipeline::SharedStorage items;
  LayerSlot slots[kItemStages];
  alignas(16) int prefix[kGroupedMaxGroups + 4];  // the tile prefix (the producer's copy)
  int cnt[kGroupedMaxGroups + 1];                  // layout: counts, then the tile prefix
  int off[kGroupedMaxGroups + 1];                  // layout: offsets
  int wsum[32];
  int over;
  int urow[kMmaThreads / 32][32];                  // unpack: each warp's record's rows
  const char* src[32];                             // combine: the token's rows
  float wt[32];                                    // and weights
  alignas(16) char stage[kMmaThreads / 32][kStageWarpBytes];
};
constexpr int kSmem = int(sizeof(LayerSmem));
static_assert(kSmem <= 232448, "the fused layer's shared storage exceeds the sm_90 opt-in limit");

__device__ __forceinline__ void consumers_sync() { device::named_barrier_sync(kMmaThreads, kHookBarrier); }

// The first bad input wins the record (as the dispatch kernels' report).
__device__ __noinline__ void layer_report(const MoeLaunch& l, int32_t kind, int32_t expert, int64_t count, int64_t limit) {
  if (atomicCAS(l.err_claim, 0u, 1u) != 0u) return;
  MoeErrorRecord* r = l.err;
  r->kind = kind;
  r->rank = l.me;
  r->token = -1;
  r->slot = -1;
  r->expert = expert;
  r->count = count;
  r->limit = limit;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&r->state) = 1u;
  __threadfence_system();
}

__device__ __forceinline__ const char* recv_slot(const MoeLaunch& l, int s) { return l.recv + int64_t(s) * l.slot_bytes; }
__device__ __forceinline__ int32_t* lay_prefix(const MoeLayerFusedLaunch& f) { return f.lay; }
__device__ __forceinline__ int32_t* lay_rows(const MoeLayerFusedLaunch& f) { return f.lay + f.l.El + 1; }
__device__ __forceinline__ int32_t* lay_done(const MoeLayerFusedLaunch& f, int gemm) {
  return f.lay + 2 * f.l.El + 1 + gemm * f.l.El;
}

// One-off timing counters (MK_MOE_FUSED_DEBUG bit 64): [kind] the producer's gate time, [8 + kind]
// the consumers' time, [16 + kind] items, [24] load issue time, [25] item-ring waits, [30] the
// longest CTA, [31] the CTAs' time summed (ns; kind 5: ops, 6: the layout's flag before the prefix).
__device__ __forceinline__ void stat_add(const LayerParams& P, int i, unsigned long long v) {
  if (P.f.stats) atomicAdd(P.f.stats + i, v);
}
__device__ __forceinline__ int stat_kind(int kind) { return kind == kSlotOp ? 5 : kind < 0 ? 6 : kind; }

// A unit's signal (pool place i): a flag only this GPU's threads wait on (release at GPU scope).
__device__ __forceinline__ void local_signal(const LayerParams& P, uint32_t i, uint64_t epoch) {
  if (P.debug & 2) comm::hook_signals(P.f.program, i, 1, epoch);
  else comm::hook_signals<true>(P.f.program, i, 1, epoch);
}

// Exclusive scan of val(i), i < n, by the 256 consumers into out[0, n], out[n] the total.
template <class Val>
__device__ __forceinline__ void scan256(LayerSmem& s, int n, Val val, int* out, int tid) {
  const int per = (n + kMmaThreads - 1) / kMmaThreads;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int mine = 0;
  for (int i = lo; i < hi; ++i) mine += val(i);
  const int lane = tid & 31, warp = tid >> 5;
  int incl = mine;
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) s.wsum[warp] = incl;
  consumers_sync();
  if (warp == 0) {
    int v = lane < kMmaThreads / 32 ? s.wsum[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += u;
    }
    if (lane < kMmaThreads / 32) s.wsum[lane] = v;
  }
  consumers_sync();
  int run = incl - mine + (warp > 0 ? s.wsum[warp - 1] : 0);
  for (int i = lo; i < hi; ++i) {
    out[i] = run;
    run += val(i);
  }
  if (tid == kMmaThreads - 1) out[n] = s.wsum[kMmaThreads / 32 - 1];
  consumers_sync();
}

// ---- the units (the 256 consumer threads; the producer checked their waits) ----

// The layout from the W headers: counts, offsets and every source's base rows; the rows the GEMMs
// take per expert (cut at recv_rows; the overflow reported) and the tile prefix; every combine
// slot's header and piece counts; the tile counters zeroed; the flags of experts without tiles.
__device__ __forceinline__ void layout_unit(const LayerParams& P, LayerSmem& s, int tid, uint64_t epoch) {
  const MoeLayerFusedLaunch& f = P.f;
  const MoeLaunch& l = f.l;
  const int El = l.El, W = l.W;
  if (tid == 0) s.over = El;
  for (int le = tid; le < El; le += kMmaThreads) {
    int run = 0;
    for (int src = 0; src < W; ++src) run += reinterpret_cast<const int32_t*>(recv_slot(l, src) + 16)[le];
    s.cnt[le] = run;
  }
  consumers_sync();
  scan256(s, El, [&](int le) { return (s.cnt[le] + l.align - 1) / l.align * l.align; }, s.off, tid);
  int32_t* rows = lay_rows(f);
  for (int le = tid; le < El; le += kMmaThreads) {
    const int c = s.cnt[le], o = s.off[le];
    if (int64_t(o) + c > l.recv_rows) atomicMin(&s.over, le);
    const int take = int(max<int64_t>(0, min<int64_t>(c, l.recv_rows - o)));
    rows[le] = take;
    l.counts[le] = c;
    l.offsets[le] = o;
    if (f.counts_out) f.counts_out[le] = c;
    if (f.offsets_out) f.offsets_out[le] = o;
    int b = o;
    for (int src = 0; src < W; ++src) {
      l.base[int64_t(src) * El + le] = b;
      b += reinterpret_cast<const int32_t*>(recv_slot(l, src) + 16)[le];
    }
    lay_done(f, 0)[le] = 0;
    lay_done(f, 1)[le] = 0;
  }
  if (tid == 0) {
    l.offsets[El] = s.off[El];
    if (f.offsets_out) f.offsets_out[El] = s.off[El];
  }
  consumers_sync();
  if (tid == 0 && s.over < El) layer_report(l, kMoeErrOverflow, s.over, s.off[El], l.recv_rows);
  // The tile prefix over the rows taken (reads rows[] this CTA wrote: the barrier above orders it).
  scan256(s, El, [&](int le) { return moe_tile_rows(rows[le], f.q.tile_rows); }, s.cnt, tid);
  for (int i = tid; i <= El; i += kMmaThreads) lay_prefix(f)[i] = s.cnt[i];
  // Every other source's combine slot: bytes in use (the entries it sent here) and piece counts.
  for (int src = tid; src < W; src += kMmaThreads) {
    if (src == l.me) continue;
    const uint32_t entries = reinterpret_cast<const uint32_t*>(recv_slot(l, src))[3];
    const uint64_t used = uint64_t(l.chdr_bytes) + uint64_t(entries) * uint64_t(l.row_bytes);
    *reinterpret_cast<uint64_t*>(l.csend + int64_t(src) * l.cslot_bytes) = used;
    for (int pc = 0; pc < l.cP; ++pc) l.cpiece[src * l.cP + pc] = moe_piece_count_of(l.cslot_bytes, l.cpb, pc, used);
  }
  __threadfence_system();
  consumers_sync();
  // Experts without tiles: nothing will raise their flags but this.
  for (int le = tid; le < El; le += kMmaThreads)
    if (s.cnt[le + 1] == s.cnt[le]) {
      local_signal(P, f.pools.s_g1 + uint32_t(le), epoch);
      local_signal(P, f.pools.s_packed, epoch);
    }
  if (tid == 0) local_signal(P, f.pools.s_laid, epoch);
}

// Records [j0, j1) of source src's slot (chunk c of its records, moe_plan.h's unpack_source): one
// warp per record; each of its entries' rows gets the record's row, and its way back (source,
// combine row); the own tokens' entries their row (self_row, -1 when lost to overflow).
__device__ __forceinline__ void unpack_unit(const LayerParams& P, LayerSmem& s, int tid, int i, int c, uint64_t epoch) {
  const MoeLayerFusedLaunch& f = P.f;
  const MoeLaunch& l = f.l;
  const int src = (l.me + i) % l.W;
  const char* slot = recv_slot(l, src);
  const uint32_t nrec = reinterpret_cast<const uint32_t*>(slot)[2];
  const int64_t per = (l.T + f.q.unpack_chunks - 1) / f.q.unpack_chunks;
  const int64_t j0 = int64_t(c) * per, j1 = min<int64_t>(int64_t(nrec), j0 + per);
  const int32_t* base = l.base + int64_t(src) * l.El;
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t words = l.row_bytes / 16;
  char* rx = static_cast<char*>(f.recv_x);
  for (int64_t j = j0 + warp; j < j1; j += kMmaThreads / 32) {
    const char* rec = slot + l.hdr_bytes + j * l.rec_bytes;
    const int32_t* meta = reinterpret_cast<const int32_t*>(rec + l.row_bytes);
    int32_t row = -1;
    bool entry = false;
    if (lane < l.k) {
      const int32_t le = meta[kMetaSlots + 2 * lane];
      entry = le >= 0;
      if (entry) {
        const int64_t r = int64_t(base[le]) + meta[kMetaSlots + 2 * lane + 1];
        row = r < l.recv_rows ? int32_t(r) : -1;
      }
    }
    const unsigned held = __ballot_sync(0xffffffffu, entry);
    if (entry) {
      const int ord = __popc(held & ((1u << lane) - 1u));
      if (row >= 0) {
        l.back[2 * int64_t(row)] = src;
        l.back[2 * int64_t(row) + 1] = meta[kMetaCbase] + ord;
      }
      if (src == l.me) l.self_row[int64_t(meta[kMetaToken]) * l.k + lane] = row;
    }
    s.urow[warp][lane] = row;
    __syncwarp();
    const int4* from = reinterpret_cast<const int4*>(rec);
    for (int64_t w0 = 0; w0 < words; w0 += 4 * 32) {
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (w0 + u * 32 + lane < words) v[u] = from[w0 + u * 32 + lane];
      for (int kk = 0; kk < l.k; ++kk) {
        const int32_t r = s.urow[warp][kk];
        if (r < 0) continue;
        int4* to = reinterpret_cast<int4*>(rx + int64_t(r) * l.row_bytes);
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (w0 + u * 32 + lane < words) to[w0 + u * 32 + lane] = v[u];
      }
    }
    __syncwarp();
  }
  consumers_sync();
  if (tid == 0) {
    __threadfence();
    local_signal(P, f.pools.s_unpacked + uint32_t(src), epoch);
  }
}

// The own tokens of chunk c: out[t] = sum_k w[t, k] * y(t, k) in fp32, slots in order (as
// combine_sum): an own expert's row in y (self_row), another rank's in its combine slot here.
__device__ __forceinline__ void combine_unit(const LayerParams& P, LayerSmem& s, int tid, int c) {
  const MoeLayerFusedLaunch& f = P.f;
  const MoeLaunch& l = f.l;
  const int n = *l.n_tokens, k = l.k;
  const int64_t per = (l.T + f.q.combine_chunks - 1) / f.q.combine_chunks;
  const int64_t t0 = int64_t(c) * per, t1 = min<int64_t>(n, t0 + per);
  const int64_t chunks = l.row_bytes / 16;
  const char* y = static_cast<const char*>(f.y);
  for (int64_t t = t0; t < t1; ++t) {
    if (tid < k) {
      const int32_t e = l.ids[t * k + tid];
      const char* p = nullptr;
      if (e >= 0 && e / l.El == l.me) {
        const int32_t row = l.self_row[t * k + tid];
        if (row >= 0 && row < l.recv_rows) p = y + int64_t(row) * l.row_bytes;
      } else if (e >= 0) {
        p = l.crecv + int64_t(e / l.El) * l.cslot_bytes + l.chdr_bytes + int64_t(l.cpos_g[t * k + tid]) * l.row_bytes;
      }
      s.src[tid] = p;
      s.wt[tid] = l.weights[t * k + tid];
    }
    consumers_sync();
    for (int64_t q = tid; q < chunks; q += kMmaThreads) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < k; k0 += 8) {
        int4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (k0 + j < k && s.src[k0 + j]) v[j] = reinterpret_cast<const int4*>(s.src[k0 + j])[q];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (k0 + j >= k || !s.src[k0 + j]) continue;
          const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v[j]);
          const float wk = s.wt[k0 + j];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = __fmaf_rn(wk, __bfloat162float(b[e]), acc[e]);
        }
      }
      int4 o;
      __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
      for (int e = 0; e < 8; ++e) ob[e] = __float2bfloat16_rn(acc[e]);
      reinterpret_cast<int4*>(P.out + t * l.row_bytes)[q] = o;
    }
    consumers_sync();  // the slots' pointers are read before the next token's
  }
}

// ---- the producer's schedule (one thread) ----

struct Scheduler {
  const LayerParams& P;
  LayerSmem& s;
  uint64_t epoch;
  int64_t nstatic, total;

  __device__ __forceinline__ const comm::DeviceProgram& h() const { return P.f.program; }
  // One of the item's waits (pool place w): met now (peek), or — block — waited for (bounded).
  // `local`: a flag only this GPU's units raise (layout, unpack, the GEMMs' experts, packed): an
  // acquire at GPU scope; a system-scope fence per item serialized the items (a one-off run of
  // this kernel: 1.5 us per item across the whole GPU). Other ranks' flags: system scope.
  __device__ __forceinline__ bool one(uint32_t w, bool block, bool local) const {
    if (block) {
      if (local && !(P.debug & 2)) comm::hook_waits<true, true>(h(), w, 1, epoch);
      else comm::hook_waits<true>(h(), w, 1, epoch);
      return true;
    }
    return comm::waits_met(h(), w, 1, epoch);
  }
  // Whether the item's waits are met (block: waits for each, bounded). kind -1: the layout's flag
  // alone (before the GEMM items can be read).
  __device__ __forceinline__ bool ready(const LayerSlot& it, bool block) const {
    const MoeLayerFusedLaunch& f = P.f;
    const MoeLayerPools& pl = f.pools;
    const int W = f.l.W;
    switch (it.kind) {
      case kMoeItemLayout:
        for (int i = 0; i < W - 1; ++i)
          if (!one(pl.hdr + uint32_t(i), block, false)) return false;
        return true;
      case kMoeItemUnpack:
        if (!one(pl.laid, block, true)) return false;
        return it.a == 0 || one(pl.arrived + uint32_t(it.a - 1), block, false);
      case kMoeItemGemm1: {
        const int le = it.a;
        const int64_t r0 = int64_t(it.row0) + int64_t(it.b) * kTileM;
        const int64_t r1 = min<int64_t>(r0 + kTileM, int64_t(it.row0) + it.count);
        const int64_t end = int64_t(f.l.offsets[le]) + f.l.counts[le];
        for (int src = 0; src < W; ++src)
          if (moe_tile_has_source(f.l.base, W, f.l.El, le, end, r0, r1, src) &&
              !one(pl.unpacked + uint32_t(src), block, true))
            return false;
        return true;
      }
      case kMoeItemGemm2:
        return one(pl.g1 + uint32_t(it.a), block, true);
      case kMoeItemCombine:
        for (int i = 0; i < W; ++i)  // packed, then every other source's combine slot
          if (!one(pl.packed + uint32_t(i), block, i == 0)) return false;
        return true;
      default:
        return one(pl.laid, block, true);
    }
  }
  // Hands the op the counter points at to the consumers when its waits are met now.
  __device__ __forceinline__ bool try_op(ItemPipeline& ip, ItemState& iw) const {
    const comm::DeviceProgram& H = h();
    if (H.n_ops <= 0) return false;
    const int idx = *reinterpret_cast<volatile int*>(H.op_counter);
    if (idx >= H.n_ops || !comm::op_ready(H, idx, epoch)) return false;
    if (atomicCAS(H.op_counter, idx, idx + 1) != idx) return false;
    hand(ip, iw, LayerSlot{kSlotOp, idx, 0, 0, 0, 0});
    return true;
  }
  __device__ __forceinline__ void hand(ItemPipeline& ip, ItemState& iw, const LayerSlot& sl) const {
    const uint64_t t0 = P.f.stats ? device::global_timer_ns() : 0;
    ip.producer_acquire(iw);
    if (P.f.stats) stat_add(P, 25, device::global_timer_ns() - t0);
    s.slots[iw.index()] = sl;
    ip.producer_commit(iw);
    ++iw;
  }
  // Waits until `it` is ready, running ready ops meanwhile; past the bound (or once the
  // communicator aborted) through the bounded waits, which record and give up.
  __device__ __forceinline__ void gate(ItemPipeline& ip, ItemState& iw, const LayerSlot& it) const {
    const uint64_t t0 = P.f.stats ? device::global_timer_ns() : 0;
    gate_body(ip, iw, it);
    if (P.f.stats) {
      stat_add(P, stat_kind(it.kind), device::global_timer_ns() - t0);
      stat_add(P, 16 + stat_kind(it.kind), 1);
    }
  }
  // Polls back off from 64 ns to 1 us (every CTA whose item waits polls a few shared flags); the
  // bound and the abort word — pinned host memory, a PCIe read — are checked every 64th poll only,
  // as device::wait_ge does.
  __device__ __forceinline__ void gate_body(ItemPipeline& ip, ItemState& iw, const LayerSlot& it) const {
    uint64_t since = 0;
    uint32_t spins = 0, nap = 0;
    while (!ready(it, false)) {
      if (try_op(ip, iw)) {
        since = 0, spins = 0, nap = 0;
        continue;
      }
      if ((spins++ & 63u) == 0) {
        const uint64_t now = device::global_timer_ns();
        if (since == 0) since = now;
        const WaitCtx& ctx = h().wait;
        const bool aborted = ctx.abort && device::ld_volatile_u64(ctx.abort) != 0;
        if (now - since > ctx.timeout_ns || aborted || device::wait_failed(ctx)) break;
      }
      nap = nap ? min(2 * nap, 1024u) : 64u;
      __nanosleep(nap);
    }
    if (P.debug & 8) {
      __threadfence();
      return;
    }
    ready(it, true);  // the acquire (met: returns at once); else the bounded waits
  }
};

__device__ __forceinline__ void produce(const LayerParams& P, LayerSmem& s, ItemPipeline& ip, MainloopPipeline& pipe, uint64_t epoch) {
  const MoeLayerFusedLaunch& f = P.f;
  Scheduler sch{P, s, epoch, moe_layer_static_items(f.q), INT64_MAX};
  ItemState iw = cutlass::make_producer_start_state<ItemPipeline>();
  MainloopState ml = cutlass::make_producer_start_state<MainloopPipeline>();
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(s.tensors.smem_A.data()));
  const uint32_t sb = static_cast<uint32_t>(__cvta_generic_to_shared(s.tensors.smem_B.data()));
  constexpr uint32_t kStageA = kTileM * kTileK * 2, kStageB = kTileN * kTileK * 2;
  const comm::DeviceProgram& h = f.program;
  // A wait of this rank gave up: nothing more is drawn (its data would not be there); the ops
  // still run (their waits give up at once), so the peers' waits end too.
  for (;;) {
    if (device::wait_failed(h.wait)) break;
    const int64_t item = atomicAdd(f.queue_counter, 1);
    if (item >= sch.nstatic && sch.total == INT64_MAX) {
      // The GEMM items follow from the layout: its flag, then the tile prefix into shared memory.
      sch.gate(ip, iw, LayerSlot{-1, 0, 0, 0, 0, 0});
      if (device::wait_failed(h.wait)) break;
      const int El = f.l.El;
      for (int i = 0; i <= El; i += 4) {
        const int4 v = __ldcg(reinterpret_cast<const int4*>(lay_prefix(f) + i));
        s.prefix[i] = v.x, s.prefix[i + 1] = v.y, s.prefix[i + 2] = v.z, s.prefix[i + 3] = v.w;
      }
      sch.total = sch.nstatic + int64_t(s.prefix[El]) * (f.q.tiles_n1 + f.q.tiles_n2) + f.q.combine_chunks;
    }
    if (item >= sch.total) break;
    const MoeLayerItem m = moe_layer_item(f.q, s.prefix, item);
    LayerSlot sl{m.kind, m.a, m.b, m.c, 0, 0};
    const bool gemm = m.kind == kMoeItemGemm1 || m.kind == kMoeItemGemm2;
    if (gemm) {
      sl.row0 = __ldcg(f.l.offsets + m.a);
      sl.count = __ldcg(lay_rows(f) + m.a);
    }
    sch.gate(ip, iw, sl);
    if (device::wait_failed(h.wait)) break;
    sch.hand(ip, iw, sl);
    if (!gemm) continue;
    // The tile's loads: its rows were written by generic stores (released to the waits above).
    if (!(P.debug & 128)) asm volatile("fence.proxy.async.global;" ::: "memory");
    // (Everything the loop reads is in registers: the asm statements' memory clobbers would
    // reload it from the parameters at every slice.)
    const bool first = m.kind == kMoeItemGemm1;
    const CUtensorMap* map_a = first ? &P.g1.map_a : &P.g2.map_a;
    const CUtensorMap* map_b = first ? &P.g1.map_b : &P.g2.map_b;
    const int k_tiles = first ? P.g1.k_tiles : P.g2.k_tiles;
    const int row = sl.row0 + m.b * kTileM, le = m.a, col = first ? m.c * (kTileN / 2) : m.c * kTileN;
    const uint64_t t_load = P.f.stats ? device::global_timer_ns() : 0;
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipe.producer_acquire(ml);
      const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(pipe.producer_get_barrier(ml)));
      const int stage = ml.index();
      tma_load_2d(map_a, sa + stage * kStageA, bar, kt * kTileK, row);
      if (first) tma_load_4d(map_b, sb + stage * kStageB, bar, kt * kTileK, col, 0, le);
      else tma_load_3d(map_b, sb + stage * kStageB, bar, kt * kTileK, col, le);
      ++ml;
    }
    if (P.f.stats) stat_add(P, 24, device::global_timer_ns() - t_load);
  }
  // The queue is drawn out: the program's remaining ops, in order, ready or not.
  if (h.n_ops > 0)
    for (int op = atomicAdd(h.op_counter, 1); op < h.n_ops; op = atomicAdd(h.op_counter, 1))
      sch.hand(ip, iw, LayerSlot{kSlotOp, op, 0, 0, 0, 0});
  sch.hand(ip, iw, LayerSlot{kSlotDone, 0, 0, 0, 0, 0});
  pipe.producer_tail(ml);  // the CTA stays until the consumers released every stage
}

// ---- the consumers ----

__device__ __forceinline__ void consume(const LayerParams& P, LayerSmem& s, ItemPipeline& ip, MainloopPipeline& pipe, int tid,
                        uint64_t epoch) {
  const MoeLayerFusedLaunch& f = P.f;
  const MoeLaunch& l = f.l;
  MainloopCollective mainloop;
  TiledMma tiled_mma;
  MainloopState read;
  ItemState ir;
  for (;;) {
    ip.consumer_wait(ir);
    const LayerSlot sl = s.slots[ir.index()];
    ip.consumer_release(ir);
    ++ir;
    if (sl.kind == kSlotDone) break;
    const uint64_t t_item = P.f.stats ? device::global_timer_ns() : 0;
    switch (sl.kind) {
      case kSlotOp:
        comm::run_comm_op<kMmaThreads, kHookBarrier>(f.program, sl.a, tid, epoch);
        break;
      case kMoeItemLayout:
        layout_unit(P, s, tid, epoch);
        break;
      case kMoeItemUnpack:
        unpack_unit(P, s, tid, sl.a, sl.b, epoch);
        break;
      case kMoeItemCombine:
        combine_unit(P, s, tid, sl.a);
        break;
      default: {  // a GEMM tile
        const bool first = sl.kind == kMoeItemGemm1;
        const GroupedParams& g = first ? P.g1 : P.g2;
        auto accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
        mma_tile(mainloop, P.g1.mainloop, pipe, read, accum, g.k_tiles, tid, s.tensors);
        if (P.debug & 4) {
        } else if (first) {
          grouped_store_staged(g, accum, tid, sl.row0, sl.count, sl.b, sl.c, s.stage[tid / 32]);
        } else {
          // Rows of another rank's tokens also go straight into its combine slot.
          auto also = [&](int row) -> __nv_bfloat16* {
            if (l.W == 1) return nullptr;
            const int32_t to = l.back[2 * int64_t(row)];
            if (to < 0 || to == l.me) return nullptr;
            return reinterpret_cast<__nv_bfloat16*>(l.csend + int64_t(to) * l.cslot_bytes + l.chdr_bytes +
                                                    int64_t(l.back[2 * int64_t(row) + 1]) * l.row_bytes);
          };
          grouped_store_staged(g, accum, tid, sl.row0, sl.count, sl.b, sl.c, s.stage[tid / 32], also);
        }
        // The expert's last tile raises its flag (g1done[le]; packed after the second GEMM).
        // The consumers meet, then one thread fences and counts (as a barrier's arrival: the
        // barrier orders the others' stores before its fence, and its release is cumulative). GPU
        // scope: the combine slots are read by this rank's ops (their waits acquire `packed`); a
        // network put's command is pushed after a system-scope release, also cumulative.
        if (P.debug & 256) {
          if (first || !(P.debug & 1)) __threadfence();
          else __threadfence_system();
        }
        consumers_sync();
        if (tid == 0) {
          __threadfence();
          const int tiles = moe_tile_rows(sl.count, f.q.tile_rows) * (first ? f.q.tiles_n1 : f.q.tiles_n2);
          const int done = atomicAdd(lay_done(f, first ? 0 : 1) + sl.a, 1) + 1;
          if (moe_tile_raises(tiles, done))
            local_signal(P, first ? f.pools.s_g1 + uint32_t(sl.a) : f.pools.s_packed, epoch);
        }
        break;
      }
    }
    if (P.f.stats && tid == 0) stat_add(P, 8 + stat_kind(sl.kind), device::global_timer_ns() - t_item);
  }
}

__global__ void __launch_bounds__(kThreads, 1) moe_layer_fused(__grid_constant__ const LayerParams P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  LayerSmem& s = *reinterpret_cast<LayerSmem*>(smem_raw);
  const int wg = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  const int mma_tid = int(threadIdx.x) % kMmaThreads;
  if (threadIdx.x == 0) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&P.g1.map_a)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&P.g1.map_b)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&P.g2.map_a)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&P.g2.map_b)) : "memory");
  }
  typename MainloopPipeline::Params mp;
  if (wg == 0 && warp_in_wg == 0) mp.role = MainloopPipeline::ThreadCategory::Producer;
  if (wg >= 1) mp.role = MainloopPipeline::ThreadCategory::Consumer;
  mp.is_leader = (threadIdx.x % cutlass::NumThreadsPerWarpGroup) == 0;
  mp.num_consumers = kMmaThreads;
  mp.num_producers = 1;
  mp.transaction_bytes = P.g1.mainloop.tma_transaction_bytes;
  MainloopPipeline pipeline(s.pipe, mp, ClusterShape{});
  typename ItemPipeline::Params ipp;
  if (wg == 0 && warp_in_wg == 0) ipp.role = ItemPipeline::ThreadCategory::Producer;
  if (wg >= 1) ipp.role = ItemPipeline::ThreadCategory::Consumer;
  ipp.producer_arv_count = 1;
  ipp.consumer_arv_count = kMmaThreads;
  ItemPipeline item_pipeline(s.items, ipp);
  __syncthreads();  // barrier inits visible to the whole CTA
  const comm::DeviceProgram& h = P.f.program;
  const uint64_t epoch = device::epoch_of_call(h.epoch);
  const uint64_t t_cta = P.f.stats ? device::global_timer_ns() : 0;

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_wg == 0 && cute::elect_one_sync()) produce(P, s, item_pipeline, pipeline, epoch);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume(P, s, item_pipeline, pipeline, mma_tid, epoch);
  }
  // The last CTA resets the queue for the next call (every CTA drew past its end), then the
  // epoch's last one zeroes the op counter and advances the epoch.
  __syncthreads();
  if (threadIdx.x == 0) {
    if (P.f.stats) {
      const unsigned long long dt = device::global_timer_ns() - t_cta;
      atomicMax(P.f.stats + 30, dt);
      atomicAdd(P.f.stats + 31, dt);
    }
    __threadfence();
    if (atomicAdd(P.f.done_ctas, 1) == int(gridDim.x) - 1) {
      *P.f.done_ctas = 0;
      *P.f.queue_counter = 0;
      __threadfence();
    }
  }
  device::epoch_finish(h.epoch, gridDim.x, h.op_counter);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: fail loudly instead of computing nothing
#endif
}


}  // namespace

Status moe_layer_fused_prepare(MoeLayerFusedLaunch* f) {
  MK_REQUIRE(f && f->l.El >= 1 && f->l.El <= kGroupedMaxGroups && f->l.k <= 32, Code::kInvalidArgument,
             "moe layer (fused): %d local experts (at most %d) and top-%d (at most 32)", f ? f->l.El : 0,
             kGroupedMaxGroups, f ? f->l.k : 0);
  int dev = 0, major = 0, sms = 0, per_sm = 0;
  MK_CUDA_CHECK(cudaGetDevice(&dev));
  MK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MK_REQUIRE(major == 9, Code::kNotSupported, "moe layer (fused): needs an sm_90 GPU (this one is sm_%d*)", major);
  MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  MK_CUDA_CHECK(cudaFuncSetAttribute(moe_layer_fused, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  MK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_layer_fused, kThreads, kSmem));
  MK_REQUIRE(per_sm >= 1, Code::kNotSupported, "moe layer (fused): the kernel cannot be resident on this device");
  f->grid = sms * per_sm;
  return OkStatus();
}

Status moe_layer_fused_launch(const MoeLayerFusedLaunch& f, const void* x, const int32_t* ids, const float* weights,
                              const int32_t* d_n, int64_t tokens, const void* w1, const void* w2, void* out,
                              cudaStream_t stream) {
  MK_REQUIRE(f.grid > 0, Code::kInternal, "moe layer (fused): not prepared");
  MK_CHECK(moe_route_pack_launch(f.l, x, ids, weights, d_n, tokens, stream));
  const CudaDriver* drv = nullptr;
  MK_CHECK(cuda_driver(&drv));
  const MoeLaunch& l = f.l;
  const int64_t H = l.H, I = f.I, rows = std::max<int64_t>(l.recv_rows, 1), El = l.El;
  LayerParams P{};
  P.f = f;
  P.out = static_cast<char*>(out);
  static const int debug = [] {  // one-off experiment switches (LayerParams::debug), read once
    const char* d = getenv("MK_MOE_FUSED_DEBUG");
    return d ? atoi(d) : 0;
  }();
  P.debug = debug;
  {  // x W1ᵀ with SwiGLU: A = recv_x [rows, H]; W1 as [El, 2, I, H]
    const cuuint64_t da[2] = {cuuint64_t(H), cuuint64_t(rows)};
    const cuuint64_t sa[1] = {cuuint64_t(H) * 2};
    const cuuint32_t ba[2] = {kTileK, kTileM};
    MK_CHECK(gemm::encode_bf16_map(drv, &P.g1.map_a, 2, f.recv_x, da, sa, ba));
    const cuuint64_t db[4] = {cuuint64_t(H), cuuint64_t(I), 2, cuuint64_t(El)};
    const cuuint64_t sb[3] = {cuuint64_t(H) * 2, cuuint64_t(I * H) * 2, cuuint64_t(2 * I * H) * 2};
    const cuuint32_t bb[4] = {kTileK, kTileN / 2, 2, 1};
    MK_CHECK(gemm::encode_bf16_map(drv, &P.g1.map_b, 4, w1, db, sb, bb));
  }
  {  // act W2ᵀ: A = act [rows, I]; W2 as [El, H, I]
    const cuuint64_t da[2] = {cuuint64_t(I), cuuint64_t(rows)};
    const cuuint64_t sa[1] = {cuuint64_t(I) * 2};
    const cuuint32_t ba[2] = {kTileK, kTileM};
    MK_CHECK(gemm::encode_bf16_map(drv, &P.g2.map_a, 2, f.act, da, sa, ba));
    const cuuint64_t db[3] = {cuuint64_t(I), cuuint64_t(H), cuuint64_t(El)};
    const cuuint64_t sb[2] = {cuuint64_t(I) * 2, cuuint64_t(H * I) * 2};
    const cuuint32_t bb[3] = {kTileK, kTileN, 1};
    MK_CHECK(gemm::encode_bf16_map(drv, &P.g2.map_b, 3, w2, db, sb, bb));
  }
  {  // the mainloop's parameters (its MMA reads none of them; the pipeline takes the stage bytes)
    const int M = int(rows), N = int(2 * I), K = int(H);
    ProblemShape problem{M, N, K, 1};
    StrideA dA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
    StrideB dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));
    typename MainloopCollective::Arguments ml{static_cast<const Element*>(f.recv_x), dA,
                                              static_cast<const Element*>(w1), dB};
    P.g1.mainloop = MainloopCollective::to_underlying_arguments(problem, ml, nullptr);
    MK_REQUIRE(P.g1.mainloop.tma_transaction_bytes == uint32_t(kTileM + kTileN) * kTileK * 2, Code::kInternal,
               "moe layer (fused): stage bytes %u differ from the raw loads' %d", P.g1.mainloop.tma_transaction_bytes,
               (kTileM + kTileN) * kTileK * 2);
  }
  // The epilogues' parts of the grouped GEMM's parameters (its maps are above).
  auto gemm_of = [&](GroupedParams& g, void* C, int64_t n_out, int64_t K, int tiles_n, bool swiglu) {
    g.C = static_cast<__nv_bfloat16*>(C);
    g.ldc = n_out;
    g.n_out = int(n_out);
    g.k_tiles = int((K + kTileK - 1) / kTileK);
    g.tiles_n = tiles_n;
    g.swiglu = swiglu ? 1 : 0;
    g.staged = 1;
    g.rows = int(rows);
  };
  gemm_of(P.g1, f.act, I, H, f.q.tiles_n1, true);
  gemm_of(P.g2, f.y, H, I, f.q.tiles_n2, false);
  moe_layer_fused<<<f.grid, kThreads, kSmem, stream>>>(P);
  MK_CUDA_CHECK(cudaGetLastError());
  return OkStatus();
}

void moe_layer_fused_print_stats(const MoeLayerFusedLaunch& f) {
  if (!f.stats) return;
  unsigned long long v[64] = {};
  if (cudaMemcpy(v, f.stats, sizeof v, cudaMemcpyDeviceToHost) != cudaSuccess) return;
  static const char* names[7] = {"layout", "unpack", "gemm1", "gemm2", "combine", "op", "laid-prefix"};
  fprintf(stderr, "moe fused stats (rank %d; us summed over CTAs, per item in brackets):\n", f.l.me);
  for (int k = 0; k < 7; ++k) {
    const double n = double(v[16 + k]);
    if (n == 0 && v[8 + k] == 0) continue;
    fprintf(stderr, "  %-12s items %8.0f  gate %10.1f (%7.2f)  consumers %10.1f (%7.2f)\n", names[k], n, v[k] / 1e3,
            n ? v[k] / 1e3 / n : 0.0, v[8 + k] / 1e3, n ? v[8 + k] / 1e3 / n : 0.0);
  }
  fprintf(stderr, "  load issue %.1f us, item-ring waits %.1f us, longest CTA %.1f us, CTAs summed %.1f us\n",
          v[24] / 1e3, v[25] / 1e3, v[30] / 1e3, v[31] / 1e3);
}

#else  // !MK_WITH_CUTLASS

void moe_layer_fused_print_stats(const MoeLayerFusedLaunch&) {}

Status moe_layer_fused_prepare(MoeLayerFusedLaunch*) {
  return Status(Code::kNotSupported, "moe layer (fused): mkernel was built without CUTLASS headers");
}
Status moe_layer_fused_launch(const MoeLayerFusedLaunch&, const void*, const int32_t*, const float*, const int32_t*,
                              int64_t, const void*, const void*, void*, cudaStream_t) {
  return Status(Code::kNotSupported, "moe layer (fused): mkernel was built without CUTLASS headers");
}

#endif

}  // namespace ops
}  // namespace mk
