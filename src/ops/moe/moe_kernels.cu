// MoE dispatch/combine kernels (see src/ops/moe/moe_launch.h; the rules are moe_plan.h's, on
// the CPU). Every position is computed in a fixed order (counting sorts by chunk, stable within
// a chunk): layouts and sums are the same on every run.
#include "src/ops/moe/moe_launch.h"
#include "src/ops/moe/moe_layer_launch.h"

#include <cuda_bf16.h>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/device/epoch.cuh"
#include "mkernel/device/signal.cuh"
#include "src/comm/executor.cuh"
#include "src/comm/runner.cuh"
#include "src/ops/moe/moe_plan.h"
#include "src/ops/moe/moe_program.h"

namespace mk {
namespace ops {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxGrid = 65536;  // CTAs of the per-token / per-row kernels (grid-stride past it)
constexpr unsigned kFull = 0xffffffffu;
constexpr int kRouteStageIds = 2048;  // route_pack's CTA 0: ids staged in shared memory per chunk

// The first bad input wins the record; later ones are left out silently (the first names the
// problem, and calls are refused from then on).
__device__ void report(const MoeLaunch& l, int32_t kind, int32_t token, int32_t slot, int32_t expert, int64_t count,
                       int64_t limit) {
  if (atomicCAS(l.err_claim, 0u, 1u) != 0u) return;
  MoeErrorRecord* r = l.err;
  r->kind = kind;
  r->rank = l.me;
  r->token = token;
  r->slot = slot;
  r->expert = expert;
  r->count = count;
  r->limit = limit;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&r->state) = 1u;
  __threadfence_system();
}

__device__ __forceinline__ bool valid_expert(const MoeLaunch& l, int32_t e) { return e >= 0 && e < l.E; }

// A kernel that follows another of the same call starts with this: launched early (programmatic
// dependent launch, MoeLaunch::pdl), it waits here until the kernel before it has finished and its
// writes are visible; launched plainly, it returns at once. Nothing before it reads or writes
// what the kernel before touches.
__device__ __forceinline__ void after_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// dst[0, bytes) = src[0, bytes) by the CTA (kThreads threads): the communication executor's copy.
__device__ __forceinline__ void copy_row(const char* src, char* dst, int64_t bytes) {
  void* d = dst;
  comm::copy_words<kThreads>(src, &d, 1, uint64_t(bytes), int(threadIdx.x));
}

// A row held in the CTA's registers (rows of at most kRowRegs * 16 * blockDim bytes), written to
// several destinations with one read.
constexpr int kRowRegs = 8;
struct RowRegs {
  int4 v[kRowRegs];
  __device__ __forceinline__ static bool fits(int64_t bytes) { return bytes / 16 <= int64_t(kRowRegs) * blockDim.x; }
  __device__ __forceinline__ void load(const char* src, int64_t bytes) {
    const int4* s = reinterpret_cast<const int4*>(src);
    const int64_t n = bytes / 16;
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i < n) v[j] = s[i];
    }
  }
  __device__ __forceinline__ void store(char* dst, int64_t bytes) const {
    int4* d = reinterpret_cast<int4*>(dst);
    const int64_t n = bytes / 16;
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i < n) d[i] = v[j];
    }
  }
};

// ---- route: per chunk of tokens (one warp), stable ranks of every entry among the chunk's
// entries of its expert (erank), of its rank (cpos) and of the records for its rank (recpos),
// and the chunk's counts per bucket (experts, then entries per rank, then records per rank).
__global__ void __launch_bounds__(32) route_local(MoeLaunch l, const int32_t* ids, const float* w, const int32_t* d_n,
                                                  int64_t tokens) {
  extern __shared__ int32_t cnt[];
  const int B = moe_buckets(l);
  const int lane = threadIdx.x;
  for (int b = lane; b < B; b += 32) cnt[b] = 0;
  int64_t n = d_n ? int64_t(*d_n) : tokens;
  if (n < 0 || n > tokens) {
    if (blockIdx.x == 0 && lane == 0) report(l, kMoeErrTooManyTokens, -1, -1, -1, n, tokens);
    n = n < 0 ? 0 : tokens;
  }
  if (blockIdx.x == 0 && lane == 0) *l.n_tokens = int32_t(n);
  __syncwarp();
  const int k = l.k;
  const int64_t t0 = int64_t(blockIdx.x) * l.chunk_tokens;
  const int64_t t1 = min(n, t0 + l.chunk_tokens);
  const int64_t e0 = t0 * k, e1 = t1 > t0 ? t1 * k : e0;
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t b0 = e0; b0 < e1; b0 += 32) {
    const int64_t i = b0 + lane;
    int32_t e = -1;
    if (i < e1) {
      e = ids[i];
      if (e != -1 && !valid_expert(l, e)) {
        report(l, kMoeErrBadExpert, int32_t(i / k), int32_t(i % k), e, l.E, l.E);
        e = -1;
      }
      l.ids[i] = e;
      l.weights[i] = w ? w[i] : 1.f;  // null: unit weights
    }
    const int32_t r = e >= 0 ? e / l.El : -1;
    bool first = r >= 0;
    if (first)
      for (int64_t j = (i / k) * k; j < i; ++j) {
        const int32_t e2 = ids[j];
        if (valid_expert(l, e2) && e2 / l.El == r) {
          first = false;
          break;
        }
      }
    // One bucket family at a time: the lanes of a bucket take consecutive ranks after the
    // bucket's running count, then its lowest lane advances it.
    auto rank_in = [&](int key, int bucket) {
      const unsigned m = __match_any_sync(kFull, key);
      const int before = __popc(m & lt);
      int v = -1;
      if (key >= 0) v = cnt[bucket] + before;
      __syncwarp();
      if (key >= 0 && before == 0) cnt[bucket] += __popc(m);
      __syncwarp();
      return v;
    };
    const int er = rank_in(e, e >= 0 ? e : 0);
    const int cp = rank_in(r, r >= 0 ? l.E + r : 0);
    const int rp = rank_in(first ? r : -1, r >= 0 ? l.E + l.W + r : 0);
    int np = -1;
    if (l.hier) {
      // The first entry of the token for a remote node: a node record.
      const int node = r >= 0 ? l.node_of[r] : -1;
      bool nfirst = node >= 0 && node != l.my_node;
      if (nfirst)
        for (int64_t j = (i / k) * k; j < i; ++j) {
          const int32_t e2 = ids[j];
          if (valid_expert(l, e2) && l.node_of[e2 / l.El] == node) {
            nfirst = false;
            break;
          }
        }
      np = rank_in(nfirst ? node : -1, nfirst ? l.E + 2 * l.W + node : 0);
    }
    if (i < e1) {
      l.erank[i] = er;
      l.cpos[i] = cp;
      l.recpos[i] = rp;
      if (l.hier) l.nrecpos[i] = np;
    }
  }
  __syncwarp();
  for (int b = lane; b < B; b += 32) l.hist[int64_t(blockIdx.x) * B + b] = cnt[b];
}

__device__ __forceinline__ char* dispatch_slot(const MoeLaunch& l, int r) {
  // The own slot is written in place in the receive slots (no copy).
  return r == l.me ? l.recv + int64_t(l.me) * l.slot_bytes : l.send + int64_t(r) * l.slot_bytes;
}

// Source s's dispatch slot in this rank's receive slots (the own one written in place by pack).
__device__ __forceinline__ const char* recv_slot(const MoeLaunch& l, int s) { return l.recv + int64_t(s) * l.slot_bytes; }

// ---- scan: chunk bases per bucket (in place), totals, and the send slots' headers.
// One warp per bucket: the chunks' counts, 32 at a time, scanned with shuffles.
__device__ void route_scan_body(const MoeLaunch& l) {
  const int B = moe_buckets(l);
  const int lane = threadIdx.x & 31;
  const int b = int(blockIdx.x) * 8 + int(threadIdx.x >> 5);
  if (b >= B) return;
  int32_t run = 0;
  for (int c0 = 0; c0 < l.nchunks; c0 += 32) {
    const int c = c0 + lane;
    const int32_t v = c < l.nchunks ? l.hist[int64_t(c) * B + b] : 0;
    int32_t incl = v;
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t u = __shfl_up_sync(kFull, incl, d);
      if (lane >= d) incl += u;
    }
    if (c < l.nchunks) l.hist[int64_t(c) * B + b] = run + incl - v;
    run += __shfl_sync(kFull, incl, 31);
  }
  if (lane == 0) l.totals[b] = run;
}

__device__ void write_headers(const MoeLaunch& l);

// The scan, then — the last CTA to finish — the slots' headers from the totals.
__global__ void __launch_bounds__(256) route_scan_headers(MoeLaunch l) {
  after_prior_grid();
  route_scan_body(l);
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(l.scan_done, 1) == int(gridDim.x) - 1;
    if (last) *l.scan_done = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  write_headers(l);
}

// The slots' headers from the totals (one CTA).
__device__ void write_headers(const MoeLaunch& l) {
  for (int r = threadIdx.x; r < l.W; r += blockDim.x) {
    char* s = dispatch_slot(l, r);
    const int32_t nrec = l.totals[l.E + l.W + r];
    *reinterpret_cast<uint64_t*>(s) = uint64_t(l.hdr_bytes + int64_t(nrec) * l.rec_bytes);
    reinterpret_cast<uint32_t*>(s)[2] = uint32_t(nrec);
    reinterpret_cast<uint32_t*>(s)[3] = uint32_t(l.totals[l.E + r]);
    if (r != l.me)
      for (int pc = 0; pc < l.dP; ++pc)
        l.dpiece[r * l.dP + pc] =
            l.layer_body ? moe_piece_count_of(l.slot_bytes - l.hdr_bytes, l.dpb, pc, uint64_t(int64_t(nrec) * l.rec_bytes))
                         : moe_piece_count_of(l.slot_bytes, l.dpb, pc, uint64_t(l.hdr_bytes + int64_t(nrec) * l.rec_bytes));
  }
  for (int i = threadIdx.x; i < l.W * l.El; i += blockDim.x) {
    const int r = i / l.El, le = i % l.El;
    reinterpret_cast<int32_t*>(dispatch_slot(l, r) + 16)[le] = l.totals[r * l.El + le];
  }
  if (!l.hier) return;
  // Node slots (moe_program.h): bytes in use, records, then per rank of the node its records,
  // entries and per-expert counts.
  const int64_t per_l = 8 + 4 * int64_t(l.El);
  for (int n = threadIdx.x; n < l.nodes; n += blockDim.x) {
    if (n == l.my_node) continue;
    char* ns = l.nsend + int64_t(n) * l.nslot_bytes;
    const int32_t nrec = l.totals[l.E + 2 * l.W + n];
    const uint64_t used = uint64_t(l.nhdr_bytes + int64_t(nrec) * l.nrec_bytes);
    *reinterpret_cast<uint64_t*>(ns) = used;
    reinterpret_cast<uint32_t*>(ns)[2] = uint32_t(nrec);
    reinterpret_cast<uint32_t*>(ns)[3] = 0;
    for (int pc = 0; pc < l.nP; ++pc) l.npiece[n * l.nP + pc] = moe_piece_count_of(l.nslot_bytes, l.npb, pc, used);
  }
  for (int i = threadIdx.x; i < l.nodes * l.local * (l.El + 2); i += blockDim.x) {
    const int n = i / (l.local * (l.El + 2)), rest = i % (l.local * (l.El + 2));
    const int lo = rest / (l.El + 2), q = rest % (l.El + 2);
    if (n == l.my_node) continue;
    const int r = l.node_ranks[n * l.local + lo];
    int32_t* h = reinterpret_cast<int32_t*>(l.nsend + int64_t(n) * l.nslot_bytes + 16 + lo * per_l);
    h[q] = q == 0 ? l.totals[l.E + l.W + r] : q == 1 ? l.totals[l.E + r] : l.totals[r * l.El + (q - 2)];
  }
}

// ---- pack: one CTA per token (grid-stride): its records, and its entries' combine rows.
__global__ void __launch_bounds__(kThreads) pack(MoeLaunch l, const char* x) {
  after_prior_grid();
  const int B = moe_buckets(l);
  const int n = *l.n_tokens;
  const int k = l.k;
  for (int t = blockIdx.x; t < n; t += gridDim.x) {
    const int32_t* base = l.hist + int64_t(t / l.chunk_tokens) * B;
    const int32_t* ids = l.ids + int64_t(t) * k;
    for (int kk = 0; kk < k; ++kk) {
      const int32_t e = ids[kk];
      if (e < 0 || l.recpos[int64_t(t) * k + kk] < 0) continue;
      // The first entry of token t for rank r: the record (across nodes in hier mode: the
      // twin there writes it from the node record).
      const int r = e / l.El;
      if (l.hier && l.node_of[r] != l.my_node) continue;
      const int64_t j = int64_t(base[l.E + l.W + r]) + l.recpos[int64_t(t) * k + kk];
      char* rec = dispatch_slot(l, r) + l.hdr_bytes + j * l.rec_bytes;
      copy_row(x + int64_t(t) * l.row_bytes, rec, l.row_bytes);
      int32_t* meta = reinterpret_cast<int32_t*>(rec + l.row_bytes);
      const int words = int((l.rec_bytes - l.row_bytes) / 4);
      for (int q = threadIdx.x; q < words; q += blockDim.x) {
        int32_t v = 0;
        if (q == kMetaToken) {
          v = t;
        } else if (q == kMetaNk) {
          for (int k2 = 0; k2 < k; ++k2) v += ids[k2] >= 0 && ids[k2] / l.El == r;
        } else if (q == kMetaCbase) {
          v = base[l.E + r] + l.cpos[int64_t(t) * k + kk];
        } else if (q == kMetaSrc) {
          v = l.me;
        } else if (q >= kMetaSlots && q < kMetaSlots + 2 * k) {
          const int k2 = (q - kMetaSlots) / 2;
          const int32_t e2 = ids[k2];
          const bool here = e2 >= 0 && e2 / l.El == r;
          if (!here) v = -1;
          else if ((q - kMetaSlots) % 2 == 0) v = e2 - r * l.El;
          else v = base[e2] + l.erank[int64_t(t) * k + k2];
        }
        meta[q] = v;
      }
    }
    if (l.hier)
      for (int kk = 0; kk < k; ++kk) {
        const int32_t e = ids[kk];
        const int32_t np = e < 0 ? -1 : l.nrecpos[int64_t(t) * k + kk];
        if (np < 0) continue;
        const int node = l.node_of[e / l.El];
        const int64_t j = int64_t(base[l.E + 2 * l.W + node]) + np;
        char* rec = l.nsend + int64_t(node) * l.nslot_bytes + l.nhdr_bytes + j * l.nrec_bytes;
        copy_row(x + int64_t(t) * l.row_bytes, rec, l.row_bytes);
        int32_t* meta = reinterpret_cast<int32_t*>(rec + l.row_bytes);
        const int words = int(l.nmeta_bytes / 4);
        for (int q = threadIdx.x; q < words; q += blockDim.x) {
          int32_t v = 0;
          if (q == 0) {
            v = t;
          } else if (q == 1) {
            v = l.me;
          } else if (q >= kNodeMetaSlots && q < kNodeMetaSlots + 3 * k) {
            const int k2 = (q - kNodeMetaSlots) / 3, f = (q - kNodeMetaSlots) % 3;
            const int32_t e2 = ids[k2];
            const bool here = e2 >= 0 && l.node_of[e2 / l.El] == node;
            if (!here) v = -1;
            else if (f == 0) v = e2;
            else if (f == 1) v = base[e2] + l.erank[int64_t(t) * k + k2];
            else v = base[l.E + e2 / l.El] + l.cpos[int64_t(t) * k + k2];
          } else if (q >= kNodeMetaSlots + 3 * k && q < kNodeMetaSlots + 3 * k + l.local) {
            const int lo = q - kNodeMetaSlots - 3 * k;
            const int r = l.node_ranks[node * l.local + lo];
            v = -1;
            for (int k2 = 0; k2 < k; ++k2) {
              const int32_t e2 = ids[k2];
              if (e2 >= 0 && e2 / l.El == r && l.recpos[int64_t(t) * k + k2] >= 0) {
                v = base[l.E + l.W + r] + l.recpos[int64_t(t) * k + k2];
                break;
              }
            }
          }
          meta[q] = v;
        }
      }
    // Where each entry's output comes back (combine).
    for (int kk = threadIdx.x; kk < k; kk += blockDim.x) {
      const int32_t e = ids[kk];
      l.cpos_g[int64_t(t) * k + kk] = e < 0 ? -1 : base[l.E + e / l.El] + l.cpos[int64_t(t) * k + kk];
    }
  }
}

// ---- small batches: token t's entries (the CTA; k <= 32) — its ids checked and saved with its
// weights, then ranked among every entry before them by counting: ex/rk each slot's expert and
// rank (-1: none), er/cp the entries of its expert/rank before it, rp the records for its rank
// before the token's, first whether it is the token's first entry for its rank (its record). The
// positions route + scan give, in one pass; route_pack and local_dispatch share it.
__device__ void rank_token(const MoeLaunch& l, const int32_t* ids_in, const float* w, int64_t t, int32_t* ex,
                           int32_t* rk, int32_t* er, int32_t* cp, int32_t* rp, bool* first) {
  const int k = l.k, El = l.El;
  const int64_t i0 = t * k;
  __syncthreads();  // the slots of the CTA's previous token are read
  if (threadIdx.x < k) {
    const int kk = threadIdx.x;
    const int32_t raw = ids_in[i0 + kk];
    const int32_t e = valid_expert(l, raw) ? raw : -1;
    if (raw != -1 && e < 0) report(l, kMoeErrBadExpert, int32_t(t), kk, raw, l.E, l.E);
    l.ids[i0 + kk] = e;
    l.weights[i0 + kk] = w ? w[i0 + kk] : 1.f;  // null: unit weights
    ex[kk] = e;
    rk[kk] = e >= 0 ? e / El : -1;
  }
  __syncthreads();
  if (threadIdx.x < k) {
    const int kk = threadIdx.x;
    small_route_own(k, kk, ex, rk, &er[kk], &cp[kk], &first[kk]);
    rp[kk] = 0;
  }
  __syncthreads();
  // The earlier tokens, one per thread (shared-memory atomics: counts, so the order is free).
  auto expert = [&](int64_t i) {
    const int32_t e = ids_in[i];
    return valid_expert(l, e) ? e : -1;
  };
  for (int64_t t2 = threadIdx.x; t2 < t; t2 += blockDim.x)
    small_route_before(k, El, [&](int j) { return expert(t2 * k + j); }, ex, rk, first, er, cp, rp,
                       [](int32_t* c, int32_t v) { atomicAdd(c, v); });
  __syncthreads();
}

// ---- small batches (direct mode): route and pack in one launch. CTA t (grid-stride) ranks its
// own token's entries among every entry before them by counting (entries of the earlier tokens,
// then the token's own earlier slots: the positions route + scan give, in one pass), then packs
// the token as pack does; CTA 0 first counts every bucket's total and writes the slots' headers.
// Work per CTA grows with the tokens before its own, hence the bound moe_small_tokens.
__global__ void __launch_bounds__(kThreads) route_pack(MoeLaunch l, const char* x, const int32_t* ids_in,
                                                       const float* w, const int32_t* d_n, int64_t tokens) {
  __shared__ int32_t ex[32], rk[32], er[32], cp[32], rp[32];
  __shared__ bool first[32];
  const int k = l.k, El = l.El;
  int64_t n = d_n ? int64_t(*d_n) : tokens;
  if (n < 0 || n > tokens) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report(l, kMoeErrTooManyTokens, -1, -1, -1, n, tokens);
    n = n < 0 ? 0 : tokens;
  }
  auto expert = [&](int64_t i) {
    const int32_t e = ids_in[i];
    return valid_expert(l, e) ? e : -1;
  };
  if (blockIdx.x == 0) {
    // This CTA is the launch's longest: it counts every entry before its own token. Counted in
    // shared memory (buckets[moe_buckets]: many entries share a bucket, and a global atomic per
    // entry serialized it), then stored once; the ids come in through shared memory a chunk of
    // tokens at a time (staged[kRouteStageIds]: one round of independent loads per chunk instead
    // of a chain of dependent loads per entry).
    extern __shared__ int32_t buckets[];
    int32_t* staged = buckets + moe_buckets(l);
    if (threadIdx.x == 0) *l.n_tokens = int32_t(n);
    const int B = moe_buckets(l);
    for (int b = threadIdx.x; b < B; b += blockDim.x) buckets[b] = 0;
    const int64_t per = kRouteStageIds / k;  // tokens per chunk (k <= 32)
    for (int64_t c0 = 0; c0 < n; c0 += per) {
      const int64_t ne = (min(n, c0 + per) - c0) * k;
      __syncthreads();  // the buckets zeroed, or the previous chunk counted
      for (int64_t i = threadIdx.x; i < ne; i += blockDim.x) staged[i] = expert(c0 * k + i);
      __syncthreads();
      for (int64_t i = threadIdx.x; i < ne; i += blockDim.x) {
        const int32_t e = staged[i];
        if (e < 0) continue;
        const int r = e / El;
        bool rec = true;  // the token's first entry for rank r: a record
        for (int64_t j = (i / k) * k; j < i && rec; ++j) rec = !(staged[j] >= 0 && staged[j] / El == r);
        atomicAdd(&buckets[e], 1);
        atomicAdd(&buckets[l.E + r], 1);
        if (rec) atomicAdd(&buckets[l.E + l.W + r], 1);
      }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < B; b += blockDim.x) l.totals[b] = buckets[b];
    __threadfence_block();
    __syncthreads();
    write_headers(l);
  }
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t i0 = t * k;
    rank_token(l, ids_in, w, t, ex, rk, er, cp, rp, first);
    for (int kk = 0; kk < k; ++kk) {
      if (!first[kk]) continue;
      const int r = rk[kk];
      char* rec = dispatch_slot(l, r) + l.hdr_bytes + int64_t(rp[kk]) * l.rec_bytes;
      copy_row(x + t * l.row_bytes, rec, l.row_bytes);
      int32_t* meta = reinterpret_cast<int32_t*>(rec + l.row_bytes);
      const int words = int((l.rec_bytes - l.row_bytes) / 4);
      for (int q = threadIdx.x; q < words; q += blockDim.x) {
        int32_t v = 0;
        if (q == kMetaToken) {
          v = int32_t(t);
        } else if (q == kMetaNk) {
          for (int k2 = 0; k2 < k; ++k2) v += rk[k2] == r;
        } else if (q == kMetaCbase) {
          v = cp[kk];
        } else if (q == kMetaSrc) {
          v = l.me;
        } else if (q >= kMetaSlots && q < kMetaSlots + 2 * k) {
          const int k2 = (q - kMetaSlots) / 2;
          if (rk[k2] != r) v = -1;
          else if ((q - kMetaSlots) % 2 == 0) v = ex[k2] - r * El;
          else v = er[k2];
        }
        meta[q] = v;
      }
    }
    // Where each entry's output comes back (combine).
    if (threadIdx.x < k) l.cpos_g[i0 + threadIdx.x] = ex[threadIdx.x] < 0 ? -1 : cp[threadIdx.x];
  }
}

// ---- the program: communication CTAs take ops in order until none is left (comm::run_program,
// src/comm/runner.cuh).

// The epoch of the call whose runner just finished (the runner advanced it at its end).
__device__ __forceinline__ uint64_t epoch_after_runner(const comm::DeviceProgram& h) {
  return *reinterpret_cast<const volatile uint64_t*>(&h.epoch->value);
}

// ---- repack (hier, at the twin): every node record from the remote twins to the record slots
// of this node's ranks (peer stores), then — the last CTA — the fwd flags. blockIdx.y: node.
__global__ void __launch_bounds__(kThreads) repack(MoeLaunch l) {
  after_prior_grid();
  const int n = blockIdx.y;
  const uint64_t e = epoch_after_runner(l.dispatch_program);
  if (threadIdx.x == 0) comm::hook_waits(l.dispatch_program, l.rw0, l.rwn, e);
  __syncthreads();
  if (n != l.my_node) {
    const int s = l.node_ranks[n * l.local + l.my_local];  // the twin that sent this node slot
    const char* ns = l.nrecv + int64_t(n) * l.nslot_bytes;
    const int64_t per_l = 8 + 4 * int64_t(l.El);
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < l.local * (l.El + 4); i += blockDim.x) {
        const int lo = i / (l.El + 4), q = i % (l.El + 4);
        const int32_t* h = reinterpret_cast<const int32_t*>(ns + 16 + lo * per_l);
        char* slot = l.peer_recv[lo] + int64_t(s) * l.slot_bytes;
        if (q == 0) *reinterpret_cast<uint64_t*>(slot) = uint64_t(l.hdr_bytes + int64_t(h[0]) * l.rec_bytes);
        else if (q == 1) reinterpret_cast<int32_t*>(slot)[2] = h[0];
        else if (q == 2) reinterpret_cast<int32_t*>(slot)[3] = h[1];
        else if (q == 3) continue;
        else reinterpret_cast<int32_t*>(slot + 16)[q - 4] = h[2 + (q - 4)];
      }
    const int nrec = reinterpret_cast<const int32_t*>(ns)[2];
    for (int j = blockIdx.x; j < nrec; j += gridDim.x) {
      const char* nr = ns + l.nhdr_bytes + int64_t(j) * l.nrec_bytes;
      const int32_t* nm = reinterpret_cast<const int32_t*>(nr + l.row_bytes);
      const bool regs = RowRegs::fits(l.row_bytes);
      RowRegs rr;
      if (regs) rr.load(nr, l.row_bytes);
      for (int lo = 0; lo < l.local; ++lo) {
        const int32_t idx = nm[kNodeMetaSlots + 3 * l.k + lo];
        if (idx < 0) continue;
        const int d = l.node_ranks[l.my_node * l.local + lo];
        char* rec = l.peer_recv[lo] + int64_t(s) * l.slot_bytes + l.hdr_bytes + int64_t(idx) * l.rec_bytes;
        if (regs) rr.store(rec, l.row_bytes);
        else copy_row(nr, rec, l.row_bytes);
        int32_t* meta = reinterpret_cast<int32_t*>(rec + l.row_bytes);
        const int words = int((l.rec_bytes - l.row_bytes) / 4);
        for (int q = threadIdx.x; q < words; q += blockDim.x) {
          int32_t v = 0;
          if (q == kMetaToken) {
            v = nm[0];
          } else if (q == kMetaSrc) {
            v = nm[1];
          } else if (q == kMetaNk || q == kMetaCbase) {
            int32_t nk = 0, cb = -1;
            for (int k2 = 0; k2 < l.k; ++k2) {
              const int32_t e2 = nm[kNodeMetaSlots + 3 * k2];
              if (e2 >= 0 && e2 / l.El == d) {
                if (cb < 0) cb = nm[kNodeMetaSlots + 3 * k2 + 2];
                ++nk;
              }
            }
            v = q == kMetaNk ? nk : cb;
          } else if (q >= kMetaSlots && q < kMetaSlots + 2 * l.k) {
            const int k2 = (q - kMetaSlots) / 2;
            const int32_t e2 = nm[kNodeMetaSlots + 3 * k2];
            const bool here = e2 >= 0 && e2 / l.El == d;
            v = !here ? -1 : (q - kMetaSlots) % 2 == 0 ? e2 - d * l.El : nm[kNodeMetaSlots + 3 * k2 + 1];
          }
          meta[q] = v;
        }
      }
    }
  }
  // Every CTA's stores visible at system scope, then the last one raises the fwd flags.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int total = int(gridDim.x * gridDim.y);
    if (atomicAdd(l.repack_done, 1) == total - 1) {
      *l.repack_done = 0;
      __threadfence_system();
      comm::hook_signals(l.dispatch_program, l.rs0, l.rsn, e);
    }
  }
}

// ---- unpack, part 1: counts and aligned offsets per local expert from the W receive slots'
// headers, into shared memory (cnt [El], off [El + 1]); the first local expert whose rows begin
// past capacity in *over (El: none). Every thread of the CTA takes part (blockDim a multiple of 32).
__device__ void scan_offsets(const MoeLaunch& l, const int32_t* cnt, int32_t* off, int32_t* over);
__device__ void layout_shared(const MoeLaunch& l, int32_t* cnt, int32_t* off, int32_t* over) {
  for (int le = threadIdx.x; le < l.El; le += blockDim.x) {
    int32_t run = 0;
    for (int s = 0; s < l.W; ++s) run += reinterpret_cast<const int32_t*>(recv_slot(l, s) + 16)[le];
    cnt[le] = run;
  }
  scan_offsets(l, cnt, off, over);
}

// The aligned offsets from the counts in shared memory (cnt [El] -> off [El + 1]), the first local
// expert whose rows begin past capacity in *over (El: none). Every thread of the CTA calls it
// (blockDim a multiple of 32); the counts are read after a barrier, the offsets ready on return.
__device__ void scan_offsets(const MoeLaunch& l, const int32_t* cnt, int32_t* off, int32_t* over) {
  __shared__ int32_t warp_sum[32];
  const int El = l.El;
  if (threadIdx.x == 0) *over = El;
  __syncthreads();
  // Exclusive scan of the aligned counts: each thread a contiguous run of experts, then the
  // runs' totals across warps.
  const int per = (El + int(blockDim.x) - 1) / int(blockDim.x);
  const int lo = min(El, int(threadIdx.x) * per), hi = min(El, lo + per);
  int64_t mine = 0;
  for (int le = lo; le < hi; ++le) mine += (int64_t(cnt[le]) + l.align - 1) / l.align * l.align;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t incl = int32_t(mine);
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t v = __shfl_up_sync(kFull, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int nw = int(blockDim.x + 31) / 32;
    int32_t v = lane < nw ? warp_sum[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t u = __shfl_up_sync(kFull, v, d);
      if (lane >= d) v += u;
    }
    if (lane < nw) warp_sum[lane] = v;  // inclusive over warps
  }
  __syncthreads();
  int64_t run = int64_t(incl) - mine + (warp > 0 ? warp_sum[warp - 1] : 0);
  for (int le = lo; le < hi; ++le) {
    off[le] = int32_t(run);
    if (run + cnt[le] > l.recv_rows) atomicMin(over, le);
    run += (int64_t(cnt[le]) + l.align - 1) / l.align * l.align;
  }
  if (threadIdx.x == blockDim.x - 1) off[El] = warp_sum[(blockDim.x - 1) / 32];
  __syncthreads();
}

// What the layout leaves for later launches (one CTA): the overflow record, the counts and
// offsets (the caller's too), the alignment gaps marked in `back`.
__device__ void layout_outputs(const MoeLaunch& l, const int32_t* cnt, const int32_t* off, int32_t over,
                               int32_t* counts, int32_t* offsets) {
  const int El = l.El;
  if (threadIdx.x == 0 && over < El) report(l, kMoeErrOverflow, -1, -1, over, off[El], l.recv_rows);
  for (int le = threadIdx.x; le <= El; le += blockDim.x) {
    l.offsets[le] = off[le];
    if (offsets) offsets[le] = off[le];
    if (le == El) continue;
    l.counts[le] = cnt[le];
    if (counts) counts[le] = cnt[le];
    for (int64_t row = int64_t(off[le]) + cnt[le]; row < off[le + 1] && row < l.recv_rows; ++row) l.back[2 * row] = -1;
  }
}

// The per-source record and combine counts from the receive slots' headers (one CTA).
__device__ void slot_totals(const MoeLaunch& l) {
  for (int s = threadIdx.x; s < l.W; s += blockDim.x) {
    l.nrec[s] = reinterpret_cast<const int32_t*>(recv_slot(l, s))[2];
    l.ncomb[s] = reinterpret_cast<const int32_t*>(recv_slot(l, s))[3];
  }
}

// Source s's first row per local expert: its expert's offset plus the counts of the sources before it.
__device__ __forceinline__ int32_t source_base(const MoeLaunch& l, const int32_t* off, int s, int le) {
  int32_t b = off[le];
  for (int s2 = 0; s2 < s; ++s2) b += reinterpret_cast<const int32_t*>(recv_slot(l, s2) + 16)[le];
  return b;
}

// One CTA: the layout (shared memory: counts then offsets, [El], [El + 1]) and every source's
// bases for unpack.
__global__ void __launch_bounds__(1024) layout(MoeLaunch l, int32_t* counts, int32_t* offsets) {
  extern __shared__ int32_t sm[];
  after_prior_grid();
  int32_t* cnt = sm;
  int32_t* off = sm + l.El;
  __shared__ int32_t over;
  // hier: the record slots the other ranks of the node wrote here from their node slots.
  if (l.hier && l.lwn) {
    if (threadIdx.x == 0) comm::hook_waits(l.dispatch_program, l.lw0, l.lwn, epoch_after_runner(l.dispatch_program));
    __syncthreads();
  }
  layout_shared(l, cnt, off, &over);
  for (int le = threadIdx.x; le < l.El; le += blockDim.x) {
    int32_t b = off[le];
    for (int s = 0; s < l.W; ++s) {
      l.base[int64_t(s) * l.El + le] = b;
      b += reinterpret_cast<const int32_t*>(recv_slot(l, s) + 16)[le];
    }
  }
  layout_outputs(l, cnt, off, over, counts, offsets);
  slot_totals(l);
}

// Every record of a source's slot (`nrec` records) to its experts' rows: CTA blockIdx.x takes
// records blockIdx.x, + gridDim.x, ...; base[le]: the source's first row of local expert le.
__device__ void unpack_source(const MoeLaunch& l, int s, int nrec, const int32_t* base, char* recv_x) {
  const char* slot = recv_slot(l, s) + l.hdr_bytes;
  for (int j = blockIdx.x; j < nrec; j += gridDim.x) {
    const char* rec = slot + int64_t(j) * l.rec_bytes;
    const int32_t* meta = reinterpret_cast<const int32_t*>(rec + l.row_bytes);
    const bool regs = RowRegs::fits(l.row_bytes);
    RowRegs rr;
    if (regs) rr.load(rec, l.row_bytes);
    int ord = 0;
    for (int kk = 0; kk < l.k; ++kk) {
      const int32_t le = meta[kMetaSlots + 2 * kk];
      if (le < 0) continue;
      const int64_t row = int64_t(base[le]) + meta[kMetaSlots + 2 * kk + 1];
      // The own tokens' outputs are read in place by combine (no copy back); -1: lost to overflow.
      if (s == l.me && threadIdx.x == 0)
        l.self_row[int64_t(meta[kMetaToken]) * l.k + kk] = row < l.recv_rows ? int32_t(row) : -1;
      if (row < l.recv_rows) {
        if (regs) rr.store(recv_x + row * l.row_bytes, l.row_bytes);
        else copy_row(rec, recv_x + row * l.row_bytes, l.row_bytes);

        if (threadIdx.x == 0) {
          l.back[2 * row] = s;
          l.back[2 * row + 1] = meta[kMetaCbase] + ord;
        }
      }
      ++ord;
    }
  }
}

// ---- unpack, part 2: every record of source blockIdx.y to its experts' rows.
__global__ void __launch_bounds__(kThreads) unpack(MoeLaunch l, char* recv_x) {
  after_prior_grid();
  const int s = blockIdx.y;
  unpack_source(l, s, l.nrec[s], l.base + int64_t(s) * l.El, recv_x);
}

// ---- small batches: layout and unpack in one launch. Every CTA computes the layout in shared
// memory (counts, offsets, its source's bases: [El], [El + 1], [El]); CTA (0, 0) also leaves it for
// combine and the caller.
__global__ void __launch_bounds__(kThreads) layout_unpack(MoeLaunch l, int32_t* counts, int32_t* offsets,
                                                          char* recv_x) {
  extern __shared__ int32_t sm[];
  after_prior_grid();
  int32_t* cnt = sm;
  int32_t* off = sm + l.El;
  int32_t* base = sm + 2 * l.El + 1;
  __shared__ int32_t over;
  const int s = blockIdx.y;
  layout_shared(l, cnt, off, &over);
  for (int le = threadIdx.x; le < l.El; le += blockDim.x) base[le] = source_base(l, off, s, le);
  __syncthreads();
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    layout_outputs(l, cnt, off, over, counts, offsets);
    slot_totals(l);
  }
  unpack_source(l, s, reinterpret_cast<const int32_t*>(recv_slot(l, s))[2], base, recv_x);
}

// One rank (direct rows): entry i of the own tokens at layout row `row` — its token's row (xrow,
// held in rr when regs) copied there, and where its output goes back (the own rank, combine row
// crow) noted; past capacity only self_row's -1 (the overflow is reported by the layout's CTA).
__device__ __forceinline__ void place_local_entry(const MoeLaunch& l, const char* xrow, bool regs, const RowRegs& rr,
                                                  int64_t i, int64_t row, int32_t crow, char* recv_x) {
  if (threadIdx.x == 0) l.self_row[i] = row < l.recv_rows ? int32_t(row) : -1;
  if (row >= l.recv_rows) return;
  if (regs) rr.store(recv_x + row * l.row_bytes, l.row_bytes);
  else copy_row(xrow, recv_x + row * l.row_bytes, l.row_bytes);
  if (threadIdx.x == 0) {
    l.back[2 * row] = l.me;
    l.back[2 * row + 1] = crow;
  }
}

// ---- one rank, small batches (MoeLaunch::direct_rows): the whole dispatch in one launch. Every
// entry stays on this rank, so no record is written: each CTA counts every entry's expert in
// shared memory (the layout's counts), scans them to the offsets, ranks its token's entries among
// the earlier entries of their experts (route_pack's counting, the same rows layout_unpack gives)
// and copies the token's row straight to those rows. CTA 0 also leaves the layout, the call's
// tokens and the per-source totals for combine and the caller. Work per CTA grows with the
// call's entries (bounded by moe_small_tokens).
__global__ void __launch_bounds__(kThreads) local_dispatch(MoeLaunch l, const char* x, const int32_t* ids_in,
                                                           const float* w, const int32_t* d_n, int64_t tokens,
                                                           int32_t* counts, int32_t* offsets, char* recv_x) {
  extern __shared__ int32_t sm[];
  int32_t* cnt = sm;           // [El]
  int32_t* off = sm + l.El;    // [El + 1]
  __shared__ int32_t ex[32], rk[32], er[32], cp[32], rp[32];
  __shared__ bool first[32];
  __shared__ int32_t over, records;
  const int k = l.k, El = l.El;
  int64_t n = d_n ? int64_t(*d_n) : tokens;
  if (n < 0 || n > tokens) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report(l, kMoeErrTooManyTokens, -1, -1, -1, n, tokens);
    n = n < 0 ? 0 : tokens;
  }
  if (blockIdx.x != 0 && blockIdx.x >= n) return;  // no token (CTA 0 still writes the layout)
  auto expert = [&](int64_t i) {
    const int32_t e = ids_in[i];
    return valid_expert(l, e) ? e : -1;
  };
  for (int le = threadIdx.x; le < El; le += blockDim.x) cnt[le] = 0;
  if (threadIdx.x == 0) records = 0;
  __syncthreads();
  for (int64_t t2 = threadIdx.x; t2 < n; t2 += blockDim.x) {
    bool any = false;
    for (int j = 0; j < k; ++j) {
      const int32_t e = expert(t2 * k + j);
      if (e < 0) continue;
      atomicAdd(&cnt[e], 1);
      any = true;
    }
    if (any && blockIdx.x == 0) atomicAdd(&records, 1);
  }
  scan_offsets(l, cnt, off, &over);  // barriers inside: the counts complete, the offsets ready
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      *l.n_tokens = int32_t(n);
      int32_t entries = 0;
      for (int le = 0; le < El; ++le) entries += cnt[le];
      l.nrec[0] = records;
      l.ncomb[0] = entries;
    }
    layout_outputs(l, cnt, off, over, counts, offsets);
  }
  const bool regs = RowRegs::fits(l.row_bytes);
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t i0 = t * k;
    rank_token(l, ids_in, w, t, ex, rk, er, cp, rp, first);
    RowRegs rr;
    if (regs) rr.load(x + t * l.row_bytes, l.row_bytes);
    for (int kk = 0; kk < k; ++kk) {
      if (ex[kk] < 0) continue;
      const int64_t row = int64_t(off[ex[kk]]) + er[kk];
      place_local_entry(l, x + t * l.row_bytes, regs, rr, i0 + kk, row, cp[kk], recv_x);
    }
    // Where each entry's output comes back (combine).
    if (threadIdx.x < k) l.cpos_g[i0 + threadIdx.x] = ex[threadIdx.x] < 0 ? -1 : cp[threadIdx.x];
  }
}

// ---- one rank, larger batches (MoeLaunch::direct_rows): after route and the scan, each token's
// CTA copies its row straight to its experts' rows — no record, no layout launch. Every CTA scans
// the expert totals to the offsets in shared memory; an entry's row is its expert's offset, its
// chunk's base for the expert and its rank in the chunk (erank). CTA 0 also leaves the layout.
__global__ void __launch_bounds__(kThreads) local_scatter(MoeLaunch l, const char* x, int32_t* counts,
                                                          int32_t* offsets, char* recv_x) {
  extern __shared__ int32_t sm[];
  int32_t* cnt = sm;         // [El]
  int32_t* off = sm + l.El;  // [El + 1]
  __shared__ int32_t over;
  after_prior_grid();
  const int n = *l.n_tokens;
  if (blockIdx.x != 0 && blockIdx.x >= n) return;  // no token (CTA 0 still writes the layout)
  const int k = l.k, El = l.El, B = moe_buckets(l);
  for (int le = threadIdx.x; le < El; le += blockDim.x) cnt[le] = l.totals[le];  // W = 1: every expert is local
  scan_offsets(l, cnt, off, &over);
  if (blockIdx.x == 0) {
    layout_outputs(l, cnt, off, over, counts, offsets);
    if (threadIdx.x == 0) {
      l.nrec[0] = l.totals[l.E + l.W];  // records a source would have sent: tokens with an entry
      l.ncomb[0] = l.totals[l.E];
    }
  }
  const bool regs = RowRegs::fits(l.row_bytes);
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int32_t* base = l.hist + (t / l.chunk_tokens) * B;
    const int64_t i0 = t * k;
    if (threadIdx.x < k) {
      const int32_t e = l.ids[i0 + threadIdx.x];
      l.cpos_g[i0 + threadIdx.x] = e < 0 ? -1 : base[l.E] + l.cpos[i0 + threadIdx.x];
    }
    RowRegs rr;
    if (regs) rr.load(x + t * l.row_bytes, l.row_bytes);
    for (int kk = 0; kk < k; ++kk) {
      const int32_t e = l.ids[i0 + kk];
      if (e < 0) continue;
      const int64_t row = int64_t(off[e]) + base[e] + l.erank[i0 + kk];
      place_local_entry(l, x + t * l.row_bytes, regs, rr, i0 + kk, row, base[l.E] + l.cpos[i0 + kk], recv_x);
    }
  }
}

__device__ __forceinline__ char* combine_slot(const MoeLaunch& l, int s) {
  return s == l.me ? l.crecv + int64_t(l.me) * l.cslot_bytes : l.csend + int64_t(s) * l.cslot_bytes;
}

// ---- combine pack: every row in use back to its source's combine slot.
__global__ void __launch_bounds__(kThreads) combine_pack(MoeLaunch l, const char* y) {
  if (blockIdx.x == 0)
    for (int s = threadIdx.x; s < l.W; s += blockDim.x)
    {
      const uint64_t used = uint64_t(l.chdr_bytes + int64_t(l.ncomb[s]) * l.row_bytes);
      *reinterpret_cast<uint64_t*>(combine_slot(l, s)) = used;
      if (s != l.me)
        for (int pc = 0; pc < l.cP; ++pc) l.cpiece[s * l.cP + pc] = moe_piece_count_of(l.cslot_bytes, l.cpb, pc, used);
    }
  const int64_t rows = min(int64_t(l.offsets[l.El]), l.recv_rows);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int s = l.back[2 * row];
    if (s < 0 || s == l.me) continue;  // a gap, or an own token's output (read in place)
    copy_row(y + row * l.row_bytes, combine_slot(l, s) + l.chdr_bytes + int64_t(l.back[2 * row + 1]) * l.row_bytes,
             l.row_bytes);
  }
}

// ---- combine: out[t] = sum_k w[t, k] * y(t, k), fp32 fused multiply-adds in slot order, w the
// call's weights (`w`, [T, k]) or, null, the dispatch's. The token's row addresses and weights go
// to shared memory first; each thread then keeps up to 8 rows' loads in flight per 16-byte chunk.
__global__ void __launch_bounds__(kThreads) combine_sum(MoeLaunch l, const char* y, const float* w, char* out) {
  __shared__ const char* src[32];
  __shared__ float wt[32];
  after_prior_grid();
  const int n = *l.n_tokens;
  const int k = l.k;
  const int64_t chunks = l.row_bytes / 16;
  for (int t = blockIdx.x; t < n; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x < k) {
      const int kk = threadIdx.x;
      const int32_t e = l.ids[int64_t(t) * k + kk];
      if (e < 0) {
        src[kk] = nullptr;
      } else if (e / l.El == l.me) {
        const int32_t row = l.self_row[int64_t(t) * k + kk];
        src[kk] = row < l.recv_rows && row >= 0 ? y + int64_t(row) * l.row_bytes : nullptr;
      } else {
        src[kk] = l.crecv + int64_t(e / l.El) * l.cslot_bytes + l.chdr_bytes +
                  int64_t(l.cpos_g[int64_t(t) * k + kk]) * l.row_bytes;
      }
      wt[kk] = (w ? w : l.weights)[int64_t(t) * k + kk];
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < k; k0 += 8) {
        int4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (k0 + j < k && src[k0 + j]) v[j] = reinterpret_cast<const int4*>(src[k0 + j])[c];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (k0 + j >= k || !src[k0 + j]) continue;
          const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v[j]);
          const float wk = wt[k0 + j];
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = __fmaf_rn(wk, __bfloat162float(b[q]), acc[q]);
        }
      }
      int4 o;
      __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
      for (int q = 0; q < 8; ++q) ob[q] = __float2bfloat16_rn(acc[q]);
      reinterpret_cast<int4*>(out + int64_t(t) * l.row_bytes)[c] = o;
    }
  }
}

}  // namespace

namespace {
size_t route_smem(const MoeLaunch& l) { return size_t(moe_buckets(l)) * 4; }   // route_local's counters
size_t route_pack_smem(const MoeLaunch& l) { return route_smem(l) + size_t(kRouteStageIds) * 4; }  // and staged ids
size_t layout_smem(const MoeLaunch& l) { return size_t(2 * l.El + 1) * 4; }   // layout's counts and offsets
size_t layout_unpack_smem(const MoeLaunch& l) { return size_t(3 * l.El + 1) * 4; }  // and a source's bases
}  // namespace

Status moe_prepare_launch(const MoeLaunch& l) {
  if (route_smem(l) > 48 * 1024)
    MK_CUDA_CHECK(cudaFuncSetAttribute(route_local, cudaFuncAttributeMaxDynamicSharedMemorySize, int(route_smem(l))));
  if (l.small && route_pack_smem(l) > 48 * 1024)
    MK_CUDA_CHECK(
        cudaFuncSetAttribute(route_pack, cudaFuncAttributeMaxDynamicSharedMemorySize, int(route_pack_smem(l))));
  if (layout_smem(l) > 48 * 1024) {
    MK_CUDA_CHECK(cudaFuncSetAttribute(layout, cudaFuncAttributeMaxDynamicSharedMemorySize, int(layout_smem(l))));
    if (l.direct_rows) {
      MK_CUDA_CHECK(
          cudaFuncSetAttribute(local_dispatch, cudaFuncAttributeMaxDynamicSharedMemorySize, int(layout_smem(l))));
      MK_CUDA_CHECK(
          cudaFuncSetAttribute(local_scatter, cudaFuncAttributeMaxDynamicSharedMemorySize, int(layout_smem(l))));
    }
  }
  if (l.small && layout_unpack_smem(l) > 48 * 1024)
    MK_CUDA_CHECK(cudaFuncSetAttribute(layout_unpack, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(layout_unpack_smem(l))));
  return OkStatus();
}

namespace {
// A kernel of the call that follows another of its kernels on the stream: with pdl (MoeLaunch::pdl),
// launched early (programmatic dependent launch: its CTAs are set up while the kernel before
// finishes; it waits in after_prior_grid()); else a plain launch.
template <class... P, class... A>
Status launch_next(bool pdl, void (*kernel)(P...), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                   A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  MK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...));
  return OkStatus();
}
}  // namespace

Status moe_route_pack_launch(const MoeLaunch& l, const void* x, const int32_t* ids, const float* weights,
                             const int32_t* d_n, int64_t tokens, cudaStream_t stream) {
  const int grid = int(std::min<int64_t>(std::max<int64_t>(l.T, 1), kMaxGrid));
  const char* xc = static_cast<const char*>(x);
  if (l.small) {
    route_pack<<<grid, kThreads, route_pack_smem(l), stream>>>(l, xc, ids, weights, d_n, tokens);
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  }
  route_local<<<l.nchunks, 32, route_smem(l), stream>>>(l, ids, weights, d_n, tokens);
  MK_CUDA_CHECK(cudaGetLastError());
  MK_CHECK(launch_next(l.pdl, route_scan_headers, dim3((moe_buckets(l) + 7) / 8), 256, 0, stream, l));
  return launch_next(l.pdl, pack, dim3(grid), kThreads, 0, stream, l, xc);
}

Status moe_dispatch_launch(const MoeLaunch& l, const void* x, const int32_t* ids, const float* weights,
                           const int32_t* d_n, int64_t tokens, void* recv_x, int32_t* counts, int32_t* offsets,
                           cudaStream_t stream) {
  // One CTA per token or record (grid-stride past 64 Ki): each one's chain of dependent loads is
  // short, and many CTAs in flight hide it.
  const int grid = int(std::min<int64_t>(std::max<int64_t>(l.T, 1), kMaxGrid));
  const char* xc = static_cast<const char*>(x);
  char* rx = static_cast<char*>(recv_x);
  if (l.direct_rows && l.small) {
    local_dispatch<<<grid, kThreads, layout_smem(l), stream>>>(l, xc, ids, weights, d_n, tokens, counts, offsets, rx);
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  }
  if (l.small) {
    MK_CHECK(moe_route_pack_launch(l, x, ids, weights, d_n, tokens, stream));
    MK_CHECK(comm::run_program(l.dispatch_program, l.comm_ctas, stream));
    return launch_next(l.pdl, layout_unpack, dim3(grid, l.W), kThreads, layout_unpack_smem(l), stream, l, counts,
                       offsets, rx);
  }
  if (l.direct_rows) {
    route_local<<<l.nchunks, 32, route_smem(l), stream>>>(l, ids, weights, d_n, tokens);
    MK_CUDA_CHECK(cudaGetLastError());
    MK_CHECK(launch_next(l.pdl, route_scan_headers, dim3((moe_buckets(l) + 7) / 8), 256, 0, stream, l));
    return launch_next(l.pdl, local_scatter, dim3(grid), kThreads, layout_smem(l), stream, l, xc, counts, offsets, rx);
  }
  MK_CHECK(moe_route_pack_launch(l, x, ids, weights, d_n, tokens, stream));
  MK_CHECK(comm::run_program(l.dispatch_program, l.comm_ctas, stream));
  if (l.hier) MK_CHECK(launch_next(l.pdl, repack, dim3(grid, l.nodes), kThreads, 0, stream, l));
  MK_CHECK(launch_next(l.pdl, layout, dim3(1), 1024, layout_smem(l), stream, l, counts, offsets));
  return launch_next(l.pdl, unpack, dim3(grid, l.W), kThreads, 0, stream, l, rx);
}

Status moe_combine_launch(const MoeLaunch& l, const void* y, const float* weights, void* out, cudaStream_t stream) {
  const char* yc = static_cast<const char*>(y);
  char* oc = static_cast<char*>(out);
  const int grid = int(std::min<int64_t>(std::max<int64_t>(l.T, 1), kMaxGrid));
  if (l.W == 1) {  // one rank: every output row is read in place, and the sums are the call's only kernel
    combine_sum<<<grid, kThreads, 0, stream>>>(l, yc, weights, oc);
    MK_CUDA_CHECK(cudaGetLastError());
    return OkStatus();
  }
  const int rows_grid = int(std::max<int64_t>(1, std::min<int64_t>(l.recv_rows, kMaxGrid)));
  combine_pack<<<rows_grid, kThreads, 0, stream>>>(l, yc);
  MK_CUDA_CHECK(cudaGetLastError());
  MK_CHECK(comm::run_program(l.combine_program, l.comm_ctas, stream));
  return launch_next(l.pdl, combine_sum, dim3(grid), kThreads, 0, stream, l, yc, weights, oc);
}

}  // namespace ops
}  // namespace mk
