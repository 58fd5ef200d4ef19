// mkernel — the persistent attention kernel as operators launch it (library-internal).
//
// Work is a list of *pairs*: (a segment of this rank's query rows, a segment of key rows) with a
// mask. A pair's work items are (batch, head, 128-row query tile); the kernel walks items pair by
// pair. Several pairs may cover the same query segment (one per key block of a ring): their
// partial results are merged in the pair's `ordinal` order through an fp32 accumulator, and the
// pair with ordinal == total - 1 writes the bf16 O and the LSE.
#pragma once

#include <cstdint>

#include "mkernel/attention/attention.h"
#include "mkernel/device/trace.h"
#include "src/attention/doc_window.h"
#include "src/comm/device_program.h"

namespace mk {
namespace attention {

struct FmhaPair {
  int32_t q_row0 = 0, q_len = 0;   // local query rows [q_row0, q_row0 + q_len)
  int64_t q_pos0 = 0;              // global position of row q_row0
  int32_t kv_src = 0;              // 0: the local K/V tensors; 1: the slot tensors
  int32_t kv_slot = 0;             // slot (kv_src 1)
  int32_t kv_row0 = 0, kv_len = 0; // key rows of the slot (or of the local K/V)
  int64_t kv_pos0 = 0;
  int32_t causal = 0;
  int32_t ordinal = 0, total = 1;  // merge order among the pairs of this query segment
  int32_t seq_base = 0;            // first sequence counter of the query segment
  int32_t wait = 0;                // wait for the key rows' arrival flags (kv_src 1)
  int32_t item0 = 0;               // first work item (prefix sum over pairs)
  int32_t pad = 0;
};
static_assert(sizeof(FmhaPair) == 72, "FmhaPair layout");

// Where the key rows of the slot tensors come from and how the kernel learns they arrived.
struct FmhaSlots {
  const void* k = nullptr;   // [slots][B][S_slot][Hkv][D] bf16, contiguous
  const void* v = nullptr;
  int slots = 0, rows = 0;   // S_slot
  // Arrival flags (ring): flags[(slot * B + b) * chunks + c] >= wait_mul * epoch once rows
  // [c * chunk_rows, (c + 1) * chunk_rows) of batch b of the slot are in place (K and V).
  const uint64_t* flags = nullptr;
  int chunks = 0, chunk_rows = 0;
  uint64_t wait_mul = 0;
};

struct FmhaLaunch {
  const FmhaPair* pairs = nullptr;  // device array; null: the single pair below
  int n_pairs = 0;
  FmhaPair single;
  int n_items = 0;
  // Packed variable-length sequences (single launches): items are (head, virtual tile), B = 1.
  const int32_t* cu_seqlens = nullptr;
  int n_docs = 0;
  FmhaSlots slots;
  // Merging (pairs with total > 1): fp32 [B][H][Sq][D] and [B][H][Sq]; sequence counters
  // (2 per item of a query segment) zeroed by the launch.
  float* o_acc = nullptr;
  float* lse_acc = nullptr;
  uint64_t* seq = nullptr;
  int n_seq = 0;
  bool reset_seq = true;  // false: continue the merge of an earlier launch (stream-ordered)
  // Non-null: dynamic schedule (items from this device counter, zeroed by the launch; one
  // counter per concurrently running launch). The ring's launches take it; single calls run
  // the static schedule (src/attention/kernel/scheduler.cuh).
  int* item_counter = nullptr;
  // Packed documents by global position (pair launches: ring attention over packed documents):
  // doc_win[pos] = the document window of global position pos (doc_window.h); key j of a pair
  // is visible to query i iff win(i).lo <= j < win(i).hi (and j <= i when the pair is causal).
  // Only the communication-role variant reads it (run_fmha picks that variant when it is set).
  const DocWindow* doc_win = nullptr;
  // Communication program (ring): run by the first comm_ctas CTAs; epoch read at the start and
  // advanced by the last CTA.
  comm::DeviceProgram program{};
  int comm_ctas = 0;
  // Non-null: the traced kernel variant records into this buffer (device/trace.h).
  const TraceBuffer* trace = nullptr;
};

// Items of one pair: B * H * ceil(q_len / 128).
int pair_items(const FmhaPair& p, int B, int H);
constexpr int kTileM = 128;

// Packed variable-length sequences (ForwardArgs::cu_seqlens): the virtual tiles of `tile` rows
// over S rows in n_docs documents (src/attention/kernel/varlen.cuh numbers them).
inline int varlen_tiles(int S, int n_docs, int tile) { return S / tile + n_docs + 1; }
// Documents whose cu_seqlens the forward keeps in shared memory (more are searched in global memory).
constexpr int kVarlenSmemEntries = 8192;

// The array's own checks (n_docs >= 1, 4-byte aligned; OK without cu_seqlens and n_docs 0),
// shared by every call that takes cu_seqlens (the attention calls, ring attention).
Status check_cu_seqlens(const char* what, const int32_t* cu, int n_docs);

// The checks of a packed variable-length call (cu_seqlens, n_docs) shared by the forward and the
// backward; OK without cu_seqlens (and n_docs 0).
Status check_varlen(const char* what, const int32_t* cu, int n_docs, int B, int Sq, int Skv, int64_t q_pos0,
                    int64_t kv_pos0);

// The document windows of packed documents (cu_seqlens: n_docs + 1 device int32 entries over a
// sequence of S tokens) for the rows of up to 3 segments: out[out0 + i] = doc_window(pos0 + i)
// for i < len; out[i] = {S, S} (no key visible) for the other i < n_out. One launch on `stream`.
struct DocSegment {
  int64_t out0 = 0, pos0 = 0, len = 0;
};
Status doc_windows(const int32_t* cu, int n_docs, int32_t S, const DocSegment* segs, int nseg, int64_t n_out,
                   DocWindow* out, cudaStream_t stream);

// Launches the kernel (checks what can_implement checks for the tensors it is given).
Status run_fmha(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, const RunConfig& cfg);

// The instantiation units (sm90_fmha_d{64,128}{,_comm}.cu), built with the CUTLASS headers:
// plain launches (no communication program, no arrival flags, untraced), and launches with the
// communication role (ring attention; also every traced launch).
namespace sm90 {
Status launch_d64(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid);
Status launch_d128(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid);
Status launch_d64_comm(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid);
Status launch_d128_comm(const ForwardArgs& a, const FmhaLaunch& l, cudaStream_t stream, int grid);
}  // namespace sm90

// CTAs of the persistent grid on this device (one per SM visible to this context).
Status fmha_ctas(int* out);

}  // namespace attention
}  // namespace mk
