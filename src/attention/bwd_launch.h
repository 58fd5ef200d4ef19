// mkernel — the attention backward as its API launches it (library-internal): the workspace's
// parts and the kernel's instantiation units (sm90_fmha_bwd_d{64,128}.cu).
#pragma once

#include <cstdint>

#include "mkernel/attention/attention.h"
#include "mkernel/device/diag.h"
#include "mkernel/device/trace.h"
#include "src/attention/fmha_launch.h"

namespace mk {
namespace attention {

// Carved from BackwardArgs::workspace (backward_workspace_bytes); rows padded to sq_pad.
struct BwdWorkspace {
  float* dq_acc = nullptr;  // [B][H][sq_pad][D] fp32, zeroed by the preprocessing
  float* lse2 = nullptr;    // [B][H][sq_pad]: LSE * log2(e), +inf where P is 0
  float* dsum = nullptr;    // [B][H][sq_pad]: rowsum(dO * O)
  uint64_t* order = nullptr;  // [B][H][sq_pad / 64]: deterministic mode's per-query-block counters
  int sq_pad = 0;
  float scale = 0.f;
  // Split schedule: each key block's GQA group over head_split CTAs (1: one CTA), dK and dV summed
  // in dkv_acc (fp32 [2][B][Hkv][key blocks][128 * D] in fragment order, zeroed by the launch).
  int head_split = 1;
  float* dkv_acc = nullptr;
  WaitCtx wait{};
};

// The backward grid's 128-row key blocks per (batch, key/value head): the sequence's, or a
// packed call's virtual key tiles (kernel/varlen.cuh).
inline int bwd_key_blocks(const BackwardArgs& a) {
  return a.cu_seqlens ? varlen_tiles(a.Skv, a.n_docs, 128) : (a.Skv + 127) / 128;
}

// ---- ring attention's backward (src/ops/ring_attention): one persistent launch ----
//
// Work is a list of *pairs*: (a step's key chunk, the query segments of this rank that see it).
// A pair's items are (batch, 128-row key block of the chunk, key/value head), heads innermost;
// an item computes its key block's dK/dV over every query segment of the pair (fp32, into its
// part tile), its share of dQ into the workspace, and adds 1 to its dK/dV piece's ready flag.

// A query segment: rows [q_row0, q_row0 + 128-or-64 * m_blocks) of Q at global position q_pos0;
// its first query block among the workspace's (virtual) blocks is qb0.
struct BwdSeg {
  int32_t q_row0 = 0, m_blocks = 0, qb0 = 0, causal = 0;
  int64_t q_pos0 = 0;
};
struct BwdRingPair {
  int32_t kv_src = 0;              // 0: the caller's K/V; 1: the slots
  int32_t slot = 0;                // kv_src 1: which slot (the block's owner)
  int32_t kv_row0 = 0, kv_len = 0; // key rows of the chunk
  int64_t kv_pos0 = 0;
  int32_t nseg = 0, wait = 0;      // wait: for the chunk's arrival flags (steps >= 1)
  int32_t item0 = 0;               // first item (prefix sum over pairs)
  int32_t ready0 = 0;              // ready flag of (block, batch 0, the chunk's first piece)
  int64_t tile0 = 0;               // part tile of (block, batch 0, the chunk's first key block, head 0)
  BwdSeg seg[2];
};
static_assert(sizeof(BwdRingPair) == 96, "BwdRingPair layout");

struct BwdRing {
  const BwdRingPair* pairs = nullptr;  // device
  int n_pairs = 0, n_items = 0;
  // The dynamic schedule's item counter (device, zeroed by each launch; one per concurrently
  // running launch), or null: the static schedule (compute CTA c takes items c, c + n, ...).
  int* item_counter = nullptr;
  // K/V slots [slots][B][rows][Hkv][D] bf16 and their arrival flags (FmhaSlots' meaning).
  FmhaSlots slots;
  // dK/dV: fp32 tiles [blocks][B][kb][Hkv][2][128 * D] (dK scaled, then dV; fragment order);
  // ready flags (ready0 + b * dpieces + key block / kb_per_piece).
  float* part = nullptr;
  uint64_t* ready = nullptr;
  int kb = 0, dpieces = 0, kb_per_piece = 0;
  // The rank's own block's tiles (part[me]: its step-0 items'), plus, for the key blocks whose
  // flag in own_sum ([B][kb] bytes, device) is set, the other ranks' sum that came back round the
  // ring (own_acc: acc[me]); rounded into dK / dV by the finishing kernel: key block kb of chunk
  // kb / kb_per_chunk; the block's `rows` rows, chunk 0 the first chunk_len of them, chunk 1
  // (zigzag) the rest. W = 1: own_acc and own_sum null.
  const float* own = nullptr;
  const float* own_acc = nullptr;
  const uint8_t* own_sum = nullptr;
  int kb_per_chunk = 0, chunk_len = 0, rows = 0;
  // Packed documents by position (ring over packed documents), or null: doc_win[pos] the
  // document window of global position pos, qwin [workspace rows] those of this rank's query
  // rows in the workspace's (virtual) rows (doc_window.h; B = 1).
  const DocWindow* doc_win = nullptr;
  const DocWindow* qwin = nullptr;
  comm::DeviceProgram program{};
  // The persistent grid and its communication CTAs, interleaved with the compute ones by index
  // (ring_role, src/attention/ring_roles.h).
  int comm_ctas = 0, grid = 0;
  TraceBuffer trace{};  // events non-null: the kernel records items, long K/V waits, ops, CTA lives
};

// The ring's call: `a` as launch_bwd_d* takes it, a.workspace of
// backward_workspace_bytes(B, H, S/W, D, chunks) bytes (256-byte aligned), a.cu_seqlens the
// chunks' bounds {0, chunk 0's rows[, S/W]} on the device (n_docs = chunks), so that each chunk's query
// blocks are the workspace's virtual blocks; the caller checked the tensors.
Status run_ring_backward(const BackwardArgs& a, const BwdRing& ring, cudaStream_t stream);

namespace sm90 {
// ring: null for the plain backward (grid launch); else the ring's persistent launch (the
// caller's BackwardArgs: the rank's Q/K/V/O/dO/LSE/dQ/dK/dV, cu_seqlens = the chunks' bounds).
Status launch_bwd_d64(const BackwardArgs& a, const BwdWorkspace& w, cudaStream_t stream, const BwdRing* ring = nullptr);
Status launch_bwd_d128(const BackwardArgs& a, const BwdWorkspace& w, cudaStream_t stream,
                       const BwdRing* ring = nullptr);
}  // namespace sm90

}  // namespace attention
}  // namespace mk
